//! The narrow host interface the policies use.
//!
//! In the .wasm it is implemented over the proxy-wasm hostcalls in `abi.rs`; in native unit tests by a
//! fake (`host::fake::FakeHost`). Every call acts on the *current* context: the stream whose callback
//! is running, or, inside a root callback (Redis / HTTP-call reply, tick), the context the dispatcher
//! made effective. Policies never deal with context ids.

pub use crate::types::LogLevel;
use std::rc::Rc;

/// Error status of a hostcall (proxy-wasm `WasmResult` values other than Ok).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostError {
    /// 1: no such item (property, header, shared-data key, host list).
    NotFound,
    /// 2: e.g. unknown cluster in redis_init / redis_call / http_call.
    BadArgument,
    /// 8: shared data was changed since it was read (compare-and-swap failed).
    CasMismatch,
    /// 10: e.g. no upstream host for a Redis call.
    InternalFailure,
    /// Any other status code.
    Other(u32),
}

impl HostError {
    /// Maps a raw proxy-wasm status code (non-zero) to an error.
    pub fn from_status(code: u32) -> HostError {
        match code {
            1 => HostError::NotFound,
            2 => HostError::BadArgument,
            8 => HostError::CasMismatch,
            10 => HostError::InternalFailure,
            other => HostError::Other(other),
        }
    }
}

impl core::fmt::Display for HostError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            HostError::NotFound => f.write_str("not found"),
            HostError::BadArgument => f.write_str("bad argument"),
            HostError::CasMismatch => f.write_str("cas mismatch"),
            HostError::InternalFailure => f.write_str("internal failure"),
            HostError::Other(c) => write!(f, "status {c}"),
        }
    }
}

/// Health of an upstream host as reported by `proxy_get_upstream_hosts` (`health_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// `"Healthy"`: the only state the policies route to (like the Go plugin).
    Healthy,
    /// `"Degraded"`.
    Degraded,
    /// `"Unhealthy"`.
    Unhealthy,
    /// Missing or unknown string.
    Unknown,
}

impl Health {
    /// Parses the `health_status` string of the host info JSON.
    pub fn parse(s: &str) -> Health {
        match s {
            "Healthy" => Health::Healthy,
            "Degraded" => Health::Degraded,
            "Unhealthy" => Health::Unhealthy,
            _ => Health::Unknown,
        }
    }
}

/// One host of the stream's upstream cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct UpstreamHost {
    /// `ip:port`, the value to pass to `set_upstream_override_host`.
    pub address: String,
    /// Health as seen by the gateway's health checker.
    pub health: Health,
    /// The stored health-check response body (Prometheus text from `/metrics`), if any. Shared:
    /// every request reads the host list, and an unchanged body is not copied again
    /// ([`crate::pairs::HostListMemo`]).
    pub metrics: Option<Rc<str>>,
}

impl UpstreamHost {
    /// True when the host may be chosen.
    pub fn is_healthy(&self) -> bool {
        self.health == Health::Healthy
    }
}

/// Reply to an HTTP call made with [`Host::http_call`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HttpReply {
    /// `:status` of the response; 0 when the call failed after the response started (a reset).
    /// A timeout, no host or a refused connection arrive as Envoy's router local reply (504 /
    /// 503 with a text body).
    pub status: u16,
    /// Response headers (lower-case names).
    pub headers: Vec<(String, String)>,
    /// Response body.
    pub body: Vec<u8>,
}

/// Reply to a Redis call made with [`Host::redis_call`].
#[derive(Debug, Clone, PartialEq)]
pub enum RedisReply {
    /// Status 0: the raw RESP bytes of exactly one reply (may be an error reply `-...`).
    Ok(Vec<u8>),
    /// Status 1 (NetworkError): connect failure, remote close, timeout, cancellation.
    NetworkError,
}

/// The arguments of `proxy_redis_init` (Higress): one per-worker Redis client per cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisInit {
    /// `outbound|port||fqdn[?db=N&...]`.
    pub cluster: String,
    /// ACL user.
    pub username: String,
    /// Password.
    pub password: String,
    /// Operation timeout.
    pub timeout_ms: u32,
}

/// The arguments of `proxy_http_call`.
#[derive(Debug, Clone, Copy)]
pub struct HttpCallRequest<'a> {
    /// The Envoy cluster called.
    pub cluster: &'a str,
    /// Request headers; must contain `:method`, `:path` and `:authority`.
    pub headers: &'a [(&'a str, &'a str)],
    /// Request body.
    pub body: Option<&'a [u8]>,
    /// The call's timeout.
    pub timeout_ms: u32,
}

/// What the policies may ask of the gateway. All methods are infallible from the caller's point of
/// view except where a `Result` says otherwise; implementations never panic.
pub trait Host {
    /// Writes one log line at `level` (the host filters by its own log level).
    fn log(&self, level: LogLevel, msg: &str);
    /// A monotonic clock in nanoseconds: only differences between two readings mean anything.
    fn now_nanos(&self) -> u64;
    /// The wall clock, unix seconds: for times other gateways read (prefix keys' stamps).
    fn unix_seconds(&self) -> u64;
    /// A random 64-bit number (WASI `random_get` in the .wasm).
    fn random_u64(&mut self) -> u64;

    /// Raw property value for a path such as `["route_name"]`.
    fn get_property(&self, path: &[&str]) -> Option<Vec<u8>>;
    /// Sets a property (e.g. Higress's `clear_route_cache`).
    fn set_property(&mut self, path: &[&str], value: &[u8]) -> Result<(), HostError>;
    /// The stream's route name (property `route_name`), if any.
    fn route_name(&self) -> Option<String> {
        self.get_property(&["route_name"]).and_then(|v| String::from_utf8(v).ok())
    }
    /// The stream's upstream cluster (property `cluster_name`), if any.
    fn cluster_name(&self) -> Option<String> {
        self.get_property(&["cluster_name"]).and_then(|v| String::from_utf8(v).ok())
    }

    /// A request header (pseudo-headers like `:authority`, `:path` included). Only valid while the
    /// request headers are held.
    fn request_header(&self, name: &str) -> Option<String>;
    /// Sets (`Some`) or removes (`None`) a request header. Only effective while headers are held.
    fn set_request_header(&mut self, name: &str, value: Option<&str>);

    /// The request body buffered so far (the host gives the cumulative body when the filter
    /// returned StopIterationAndBuffer), at most `max` bytes. Only valid in the body callback.
    fn request_body(&self, max: usize) -> Option<Vec<u8>>;
    /// A response header (e.g. `:status`); only valid in response callbacks.
    fn response_header(&self, name: &str) -> Option<String>;
    /// Bytes `start..start+max` of the response body chunk being delivered (not buffered: only
    /// this chunk); only valid in the response body callback.
    fn response_body(&self, start: usize, max: usize) -> Option<Vec<u8>>;

    /// Hosts of the stream's cluster with health and stored metrics. `None` when the host has no
    /// list (call failed / not supported): the caller then falls back to normal balancing.
    fn upstream_hosts(&self) -> Option<Vec<UpstreamHost>>;
    /// Pins the stream to `addr` (non-strict: if it is not a healthy host of the cluster the gateway
    /// balances normally). Only effective while the request headers are held.
    fn set_upstream_override_host(&mut self, addr: &str) -> Result<(), HostError>;

    /// (Re)initialises the per-worker Redis client for `init.cluster`.
    fn redis_init(&mut self, init: &RedisInit) -> Result<(), HostError>;
    /// Sends one complete RESP command; the reply arrives later with the returned token.
    fn redis_call(&mut self, cluster: &str, query: &[u8]) -> Result<u32, HostError>;
    /// Dispatches an HTTP call; the reply arrives later with the returned token.
    fn http_call(&mut self, call: &HttpCallRequest<'_>) -> Result<u32, HostError>;

    /// Shared data (shared across worker VMs): value and CAS token; `(None, 0)` if missing.
    fn get_shared_data(&self, key: &str) -> (Option<Vec<u8>>, u32);
    /// Writes shared data; `cas == 0` is unconditional, a stale CAS gives `CasMismatch`.
    fn set_shared_data(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), HostError>;

    /// Answers the request locally (e.g. 429). The stream must not be resumed afterwards.
    fn send_local_response(&mut self, status: u32, body: &[u8], headers: &[(&str, &str)]);
    /// Continues a paused request (deferred by the host until the current callback returns).
    fn resume_request(&mut self);
    /// Makes stream `ctx` the context that stream calls (resume, override host, local reply) act on,
    /// inside a root callback such as a tick. False when the host refuses (the stream is gone).
    fn set_effective_stream(&mut self, ctx: u32) -> bool;
    /// The root context, whose `proxy_on_done` said it was not done, finished its last work
    /// (`proxy_done`): the host may now delete it.
    fn root_done(&mut self);

    /// Adds `delta` to one of the plugin's counters (exported on the gateway's stats).
    fn increment_counter(&mut self, counter: Counter, delta: i64);

    /// Defines one of the plugin's counters, so that the gateway exports it (at 0) before its
    /// first event: an alert on its rate then sees that first event, and a dashboard shows 0, not
    /// "no data".
    fn define_counter(&mut self, counter: Counter);
    /// Sets a response header; only effective in the response headers callback.
    fn set_response_header(&mut self, name: &str, value: &str);
}

/// Defines [`Counter`] from one list of variants and metric names, so that [`Counter::ALL`] (what
/// the plugin defines at start) cannot miss a counter.
macro_rules! counters {
    ($($(#[$doc:meta])* $variant:ident => $name:literal,)+) => {
        /// The plugin's counters, one per decision kind and failure path, so an operator sees from
        /// the gateway's stats how requests were routed (Envoy exports proxy-wasm metrics as
        /// `wasmcustom.<name>`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Counter {
            $($(#[$doc])* $variant,)+
        }

        impl Counter {
            /// Every counter, each defined when the plugin starts.
            pub const ALL: &'static [Counter] = &[$(Counter::$variant,)+];

            /// The metric name.
            pub fn name(self) -> &'static str {
                match self {
                    $(Counter::$variant => $name,)+
                }
            }
        }
    };
}

counters! {
    /// `global_least_request`, and `prefix_cache` for a request without a prompt: routed to the
    /// pod with the fewest in-flight requests.
    LeastRequestRouted => "ai_lb_least_request_routed",
    /// `prefix_cache`: routed to the pod holding the request's longest known prefix.
    PrefixHit => "ai_lb_prefix_hit",
    /// `prefix_cache`: the prefix's pod was too loaded (`hitLoadFactor`, `loadAware`); routed to
    /// the least loaded.
    PrefixHitDiverted => "ai_lb_prefix_hit_diverted",
    /// `prefix_cache` (`loadAware`): a diverted hit made its pod a holder of the prefix.
    PrefixHolderAdded => "ai_lb_prefix_holder_added",
    /// `prefix_cache` (`loadAware`): some pod had no fresh metrics, so the request was decided
    /// without them (as with `loadAware` off).
    PrefixLoadUnknown => "ai_lb_prefix_load_unknown",
    /// `prefix_cache`: no known prefix; routed to the least loaded pod.
    PrefixMiss => "ai_lb_prefix_miss",
    /// `prefix_cache`: sum of the matched prefix blocks over all hits.
    PrefixMatchedBlocks => "ai_lb_prefix_matched_blocks",
    /// `prefix_cache`: a stored response's id was recorded with the pod that made it (Responses
    /// API, `store` not false).
    PrefixResponseRecorded => "ai_lb_prefix_response_recorded",
    /// `prefix_cache`: a request that continues a stored response (`previous_response_id`) went to
    /// the pod that made it.
    PrefixResponseFollowed => "ai_lb_prefix_response_followed",
    /// `prefix_cache`: a request that continues a stored response found no healthy pod recorded
    /// for it (made before the plugin ran, its key expired, its pod gone, Redis down): balanced as
    /// a new conversation.
    PrefixResponseUnknown => "ai_lb_prefix_response_unknown",
    /// `cluster_hash`: routed to the service of the request's hash key.
    HashRouted => "ai_lb_hash_routed",
    /// `cluster_hash`: no hash key; answered 403.
    HashKeyMissing => "ai_lb_hash_key_missing",
    /// `endpoint_hash`: routed to the healthy pod the session key is bound to.
    StickyHit => "ai_lb_sticky_hit",
    /// `endpoint_hash`: the session key had no binding, or its pod is no longer healthy; the
    /// gateway's balancing chose, and its choice is bound.
    StickyMiss => "ai_lb_sticky_miss",
    /// A Redis policy answered 429 (`maxRequestCount`).
    Rejected => "ai_lb_rejected",
    /// `endpoint_metrics`: routed by the pods' metrics.
    MetricsRouted => "ai_lb_metrics_routed",
    /// A Redis policy could not use Redis and routed by the pods' metrics instead.
    RedisDownRoutedByMetrics => "ai_lb_redis_down_routed_by_metrics",
    /// Redis answered with an error or an unusable reply, or the call could not be sent.
    FallbackRedisError => "ai_lb_fallback_redis_error",
    /// Redis connection failure or the host's Redis timeout.
    FallbackRedisTimeout => "ai_lb_fallback_redis_timeout",
    /// The pick took longer than `breakerSlowMs` and was given up.
    FallbackRedisSlow => "ai_lb_fallback_redis_slow",
    /// The breaker was open: decided without Redis.
    FallbackBreakerOpen => "ai_lb_fallback_breaker_open",
    /// The body was not a JSON object the policy could read.
    FallbackBadBody => "ai_lb_fallback_bad_body",
    /// The body was larger than `maxBodyBytes`.
    FallbackBodyTooLarge => "ai_lb_fallback_body_too_large",
    /// Normal balancing because no pod had usable metrics (`endpoint_metrics`, or a Redis policy
    /// without Redis).
    FallbackNoMetrics => "ai_lb_fallback_no_metrics",
    /// The Redis breaker opened.
    BreakerOpened => "ai_lb_breaker_opened",
    /// An in-flight count release was given up (the next heartbeat releases its record).
    ReleaseDropped => "ai_lb_release_dropped",
    /// Records of this VM's requests that a heartbeat released because their releases could not
    /// come (Redis restarted from older state, or releases were dropped).
    StaleRecordsReleased => "ai_lb_stale_records_released",
    /// Pods whose in-flight count the once-a-minute recount set back to what the live owners'
    /// records say.
    CountsRecounted => "ai_lb_counts_recounted",
    /// `prefix_cache`: prompt tokens the engines reported (`usage.prompt_tokens`).
    EnginePromptTokens => "ai_lb_engine_prompt_tokens",
    /// `prefix_cache`: prompt tokens the engines found cached
    /// (`usage.prompt_tokens_details.cached_tokens`).
    EngineCachedTokens => "ai_lb_engine_cached_tokens",
    /// `prefix_cache`: predicted a hit, and the engine had cached tokens.
    PredictedHitEngineHit => "ai_lb_predicted_hit_engine_hit",
    /// `prefix_cache`: predicted a hit, and the engine had none cached.
    PredictedHitEngineMiss => "ai_lb_predicted_hit_engine_miss",
    /// `prefix_cache`: predicted a miss, and the engine had cached tokens.
    PredictedMissEngineHit => "ai_lb_predicted_miss_engine_hit",
    /// `prefix_cache`: predicted a miss, and the engine had none cached.
    PredictedMissEngineMiss => "ai_lb_predicted_miss_engine_miss",
}

impl Counter {
    /// The name without `ai_lb_`: the decision header's value for requests counted here.
    pub fn label(self) -> &'static str {
        let name = self.name();
        name.strip_prefix("ai_lb_").unwrap_or(name)
    }
}

#[cfg(any(test, feature = "fake-host"))]
pub mod fake;
