//! Gateway configuration (YAML), as documented in the README section "Gateway host".

use serde::Deserialize;
use std::path::Path;

/// The whole gateway configuration file.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    /// HTTP listeners; every one is served by all workers.
    #[serde(default)]
    pub listeners: Vec<ListenerConfig>,
    /// Optional admin listener (`/stats`, `/ready`, `/clusters`).
    #[serde(default)]
    pub admin: Option<AdminConfig>,
    /// Routes, first match wins.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// Envoy's route configuration `response_headers_to_add` (for all routes): headers every
    /// response of a routed stream gets, `%UPSTREAM_HOST%` standing for the chosen endpoint.
    /// Default none, as in Higress. See `response_headers.rs`.
    #[serde(default)]
    pub response_headers_to_add: Vec<crate::response_headers::HeaderValueOption>,
    /// Upstream clusters (HTTP pods, Redis, ...).
    #[serde(default)]
    pub clusters: Vec<ClusterConfig>,
    /// The proxy-wasm plugin; without it the gateway is a plain proxy.
    #[serde(default)]
    pub plugin: Option<PluginConfig>,
    /// On SIGTERM/SIGINT (a Higress gateway pod stopping): how long the listeners drain before
    /// the proxy ends. Istio's pilot-agent, which runs Higress's Envoy, asks Envoy for a graceful
    /// drain and waits this long in full (`terminationDrainDuration`, default 5 s), whatever is
    /// still in flight; see [`ExitAfterDrain`] for what ends the proxy then.
    #[serde(default = "default_drain_timeout")]
    pub drain_timeout_ms: u64,
    /// How the proxy ends once the drain is over.
    #[serde(default)]
    pub exit_after_drain: ExitAfterDrain,
}

fn default_drain_timeout() -> u64 {
    5_000
}

/// How the proxy ends after the drain (see [`Config::drain_timeout_ms`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExitAfterDrain {
    /// As pilot-agent ends Envoy in a Higress gateway pod: SIGKILL (Go's `Process.Kill` in its
    /// `envoy.Run`). Nothing more runs: no stream's or root context's callback, no Redis
    /// command or callout leaves; the kernel closes the sockets.
    #[default]
    Kill,
    /// As Envoy 1.40 itself exits on SIGTERM (what a bare Envoy does, and what the conformance
    /// tests compare): its dispatchers stop, the streams still open are cut (their on_log,
    /// on_done, on_delete run), then each root context's on_done, and nothing the plugin sends
    /// from those callbacks leaves.
    Envoy,
}

/// One listener.
#[derive(Debug, Clone, Deserialize)]
pub struct ListenerConfig {
    /// Name printed in the `LISTENING` line.
    pub name: String,
    /// `ip:port`; port 0 picks a free port.
    pub address: String,
    /// Envoy's `per_connection_buffer_limit_bytes`: how much of a request or response body a
    /// filter may hold on a stream of this listener before the stream gets 413 (request) or 500
    /// (response). Default 32 KiB, Higress's `downstream.connectionBufferLimits`; a plugin raises
    /// it per stream with the `set_decoder_buffer_limit` / `set_encoder_buffer_limit` properties.
    #[serde(default = "default_connection_buffer_limit")]
    pub per_connection_buffer_limit_bytes: u32,
    /// Envoy's HCM `common_http_protocol_options.idle_timeout`: a downstream connection with no
    /// stream in flight for this long is closed. Default 180 s, Higress's
    /// `downstream.idleTimeout` (Envoy's own default is 1 h); 0 disables.
    #[serde(default = "default_idle_timeout")]
    pub idle_timeout_ms: u64,
    /// Envoy's HCM `stream_idle_timeout`: a stream with no activity (request data received,
    /// response data sent) for this long ends: 408 "stream timeout" when no response started,
    /// else a reset. This is what bounds a request the plugin holds and never resumes: the
    /// route timeout only starts once the router has the whole request. Default 5 min (Envoy's;
    /// Higress does not change it); 0 disables.
    #[serde(default = "default_stream_idle_timeout")]
    pub stream_idle_timeout_ms: u64,
    /// Envoy's HCM `request_headers_timeout`: the whole request header must arrive within this
    /// long. Default 0 (off, Envoy's and Higress's default); with 0, partial headers are bounded
    /// by `stream_idle_timeout_ms` as in Envoy, where a stream exists from the first byte.
    #[serde(default)]
    pub request_headers_timeout_ms: u64,
    /// Envoy's HCM `drain_timeout`: an HTTP/2 connection that is to close (idle timeout, drain)
    /// gets a first GOAWAY at once, and the second one, after which it closes, this much
    /// later. Default 5 s (Envoy's; Higress does not change it); 0: at once. Either way the
    /// socket closes 1 s after the second GOAWAY (Envoy's `delayed_close_timeout`).
    #[serde(default = "default_http2_drain_timeout")]
    pub http2_drain_timeout_ms: u64,
    /// Envoy's HCM `http_protocol_options.accept_http_10`: whether HTTP/1.0 requests are served.
    /// Default true, as in Higress: its gateway pods set `ISTIO_META_HTTP10=1`, for which istio
    /// turns it on in the gateway listeners (without a `default_host_for_http_10`, so an
    /// HTTP/1.0 request without `host` gets 400). With false (Envoy's own default) an HTTP/1.0
    /// request gets 426 Upgrade Required before any filter runs.
    #[serde(default = "default_accept_http_10")]
    pub accept_http_10: bool,
    /// Envoy's HCM `use_remote_address`: the client is the connection's peer, appended to
    /// `x-forwarded-for` (a client on loopback as the machine's first non-loopback IPv4
    /// address, as Envoy does), and the request is an edge request (`x-envoy-external-address`,
    /// a new `x-request-id`). Default true: istio builds Higress's gateway listeners so.
    #[serde(default = "default_use_remote_address")]
    pub use_remote_address: bool,
    /// Envoy's HCM `xff_num_trusted_hops`: proxies in front of the gateway trusted to have
    /// appended to `x-forwarded-for`. Default 0 (istio sets it from
    /// `gatewayTopology.numTrustedProxies`, default 0).
    #[serde(default)]
    pub xff_num_trusted_hops: u32,
    /// Envoy's HCM `preserve_external_request_id`: keep an edge request's `x-request-id`.
    /// Default false, as in Higress: Envoy replaces it.
    #[serde(default)]
    pub preserve_external_request_id: bool,
    /// Envoy's HCM `max_request_headers_kb`: a request whose header is larger is refused before
    /// any filter sees it. HTTP/1 counts the head from the request line to the blank line (431,
    /// connection closed); HTTP/2 the names and values, pseudo-headers included (stream reset).
    /// Default 60 (Envoy's, and Higress's helm `maxRequestHeadersKb`), at most 8192.
    #[serde(default = "default_max_request_headers_kb")]
    pub max_request_headers_kb: u32,
    /// Envoy's HCM `common_http_protocol_options.max_headers_count`: likewise for the number
    /// of headers (HTTP/2: pseudo-headers included). Default 100 (Envoy's).
    #[serde(default = "default_max_headers_count")]
    pub max_headers_count: u32,
    /// HTTP/2 over cleartext with prior knowledge, which the listener serves next to HTTP/1
    /// (Envoy's HCM `codec_type: AUTO`, as Higress configures its listeners): Envoy's
    /// `http2_protocol_options` with Higress's `downstream.http2` defaults.
    #[serde(default)]
    pub http2: Http2Config,
}

/// A listener's HTTP/2 settings (Envoy's `http2_protocol_options`). The defaults are Higress's
/// helm `downstream.http2` values, not Envoy's own (100 streams, not 2^31 - 1; a 64 KiB stream
/// window, not 256 MiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Http2Config {
    /// Streams a client may have open at once on one connection (SETTINGS_MAX_CONCURRENT_STREAMS).
    #[serde(default = "default_h2_max_concurrent_streams")]
    pub max_concurrent_streams: u32,
    /// The stream flow-control window (SETTINGS_INITIAL_WINDOW_SIZE). Envoy also makes it the
    /// buffer limit of every HTTP/2 stream in place of `per_connection_buffer_limit_bytes`:
    /// a body held past it gets 413 (conformance test `http2_held_body_and_the_buffer_limit`).
    #[serde(default = "default_h2_initial_stream_window_size")]
    pub initial_stream_window_size: u32,
    /// The connection flow-control window.
    #[serde(default = "default_h2_initial_connection_window_size")]
    pub initial_connection_window_size: u32,
}

impl Default for Http2Config {
    fn default() -> Self {
        Http2Config {
            max_concurrent_streams: default_h2_max_concurrent_streams(),
            initial_stream_window_size: default_h2_initial_stream_window_size(),
            initial_connection_window_size: default_h2_initial_connection_window_size(),
        }
    }
}

fn default_h2_max_concurrent_streams() -> u32 {
    100
}
fn default_h2_initial_stream_window_size() -> u32 {
    65535
}
fn default_h2_initial_connection_window_size() -> u32 {
    1_048_576
}

impl Http2Config {
    /// The ranges Envoy accepts for these fields (its config is refused outside them).
    fn check(&self, listener: &str) -> anyhow::Result<()> {
        const MAX: u32 = (1 << 31) - 1;
        let in_range = |what: &str, v: u32, lo: u32| {
            if v < lo || v > MAX {
                anyhow::bail!("listener {listener}: http2.{what} {v} is not in {lo}..={MAX}");
            }
            Ok(())
        };
        in_range("max_concurrent_streams", self.max_concurrent_streams, 1)?;
        in_range("initial_stream_window_size", self.initial_stream_window_size, 65535)?;
        in_range("initial_connection_window_size", self.initial_connection_window_size, 65535)
    }
}

fn default_max_request_headers_kb() -> u32 {
    60
}
fn default_max_response_headers_kb() -> u32 {
    80
}
fn default_max_headers_count() -> u32 {
    100
}

fn default_accept_http_10() -> bool {
    true
}

/// Higress's helm default `downstream.idleTimeout` (180 s).
pub const HIGRESS_DOWNSTREAM_IDLE_TIMEOUT_MS: u64 = 180_000;

fn default_use_remote_address() -> bool {
    true
}

fn default_idle_timeout() -> u64 {
    HIGRESS_DOWNSTREAM_IDLE_TIMEOUT_MS
}

fn default_http2_drain_timeout() -> u64 {
    5_000
}

/// Envoy's default HCM `stream_idle_timeout` (5 min).
pub const ENVOY_STREAM_IDLE_TIMEOUT_MS: u64 = 300_000;

fn default_stream_idle_timeout() -> u64 {
    ENVOY_STREAM_IDLE_TIMEOUT_MS
}

impl ListenerConfig {
    /// The timers of this listener's connections and streams.
    pub fn timers(&self) -> ListenerTimers {
        let ms = |v: u64| (v > 0).then(|| std::time::Duration::from_millis(v));
        ListenerTimers {
            idle: ms(self.idle_timeout_ms),
            stream_idle: ms(self.stream_idle_timeout_ms),
            headers: ms(self.request_headers_timeout_ms).or(ms(self.stream_idle_timeout_ms)),
            http2_drain: std::time::Duration::from_millis(self.http2_drain_timeout_ms),
        }
    }

    /// This listener's request header limits.
    pub fn header_limits(&self) -> HeaderLimits {
        HeaderLimits {
            bytes: self.max_request_headers_kb as usize * 1024,
            count: self.max_headers_count as usize,
        }
    }

    /// What this listener does to `x-forwarded-*` and friends.
    pub fn forwarding(&self) -> crate::forwarded::ForwardingConfig {
        crate::forwarded::ForwardingConfig {
            use_remote_address: self.use_remote_address,
            xff_num_trusted_hops: self.xff_num_trusted_hops,
            preserve_external_request_id: self.preserve_external_request_id,
        }
    }
}

/// How large a request header may be (`max_request_headers_kb` in bytes) and how many headers
/// it may hold (`max_headers_count`).
#[derive(Debug, Clone, Copy)]
pub struct HeaderLimits {
    pub bytes: usize,
    pub count: usize,
}

/// A listener's timers (`None`: off).
#[derive(Debug, Clone, Copy, Default)]
pub struct ListenerTimers {
    /// Connection idle timeout (no stream in flight).
    pub idle: Option<std::time::Duration>,
    /// Stream idle timeout.
    pub stream_idle: Option<std::time::Duration>,
    /// How long the request header may take to arrive (hyper's `header_read_timeout`).
    pub headers: Option<std::time::Duration>,
    /// From an HTTP/2 connection's first GOAWAY to its second (Envoy's `drain_timeout`).
    pub http2_drain: std::time::Duration,
}

/// Higress's helm default `downstream.connectionBufferLimits`.
pub const HIGRESS_DOWNSTREAM_BUFFER_LIMIT: u32 = 32 * 1024;

fn default_connection_buffer_limit() -> u32 {
    HIGRESS_DOWNSTREAM_BUFFER_LIMIT
}

/// Admin listener.
#[derive(Debug, Clone, Deserialize)]
pub struct AdminConfig {
    /// `ip:port`; port 0 picks a free port.
    pub address: String,
}

/// Route match criteria.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RouteMatch {
    /// Path prefix (default `/`).
    #[serde(default)]
    pub prefix: Option<String>,
    /// Exact `:authority` without port.
    #[serde(default)]
    pub host: Option<String>,
}

/// One route.
#[derive(Debug, Clone, Deserialize)]
pub struct RouteConfig {
    /// Route name (property `route_name`).
    pub name: String,
    /// Match criteria.
    #[serde(default, rename = "match")]
    pub match_: RouteMatch,
    /// Target cluster (property `cluster_name`).
    #[serde(default)]
    pub cluster: Option<String>,
    /// Take the cluster name from this request header instead (Envoy `cluster_header`).
    #[serde(default)]
    pub cluster_header: Option<String>,
    /// Envoy's route `timeout`: counted from the moment the router has the whole request (so
    /// not while the plugin holds it) until the response has ended: 504 "upstream request
    /// timeout" before the response headers, a reset after. Default 0 (off), Higress's
    /// `downstream.routeTimeout` (Envoy's own default is 15 s).
    #[serde(default)]
    pub timeout_ms: u64,
}

/// Load-balancing policy of a cluster.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LbPolicy {
    /// Round robin over healthy endpoints (Envoy default).
    #[default]
    RoundRobin,
    /// Uniform random.
    Random,
    /// Power of two choices on active requests (Envoy LEAST_REQUEST).
    LeastRequest,
}

/// One cluster.
#[derive(Debug, Clone, Deserialize)]
pub struct ClusterConfig {
    /// Cluster name, e.g. `outbound|8000||llm.static`.
    pub name: String,
    /// LB policy.
    #[serde(default)]
    pub lb_policy: LbPolicy,
    /// `ip:port` endpoints.
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// Optional active HTTP health check.
    #[serde(default)]
    pub health_check: Option<HealthCheckConfig>,
    /// Connect timeout in milliseconds.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_ms: u64,
    /// Envoy's cluster discovery type: `STATIC` (default: the listed endpoints) or `ORIGINAL_DST`.
    #[serde(default, rename = "type")]
    pub cluster_type: ClusterType,
    /// `ORIGINAL_DST` only: Envoy's `original_dst_lb_config`.
    #[serde(default)]
    pub original_dst_lb_config: OriginalDstLbConfig,
    /// `REDIS_CLUSTER` only: Envoy's `RedisClusterConfig` (slot map refresh).
    #[serde(default)]
    pub redis_cluster: RedisClusterConfig,
    /// Envoy's `common_lb_config.ignore_new_hosts_until_first_hc`: an endpoint added at run time
    /// to a health-checked cluster is left out of load balancing entirely (not even counted for
    /// the panic threshold) until its first check. Default false: it counts, as Unhealthy.
    #[serde(default)]
    pub ignore_new_hosts_until_first_hc: bool,
    /// Envoy's cluster `HttpProtocolOptions.common_http_protocol_options.max_response_headers_kb`:
    /// an upstream response whose head (status line to blank line) is larger is a protocol error
    /// (502, `reset reason: protocol error`). Default 80 (Envoy 1.40's, measured: the request
    /// side's is 60), at most 8192.
    #[serde(default = "default_max_response_headers_kb")]
    pub max_response_headers_kb: u32,
    /// The same options' `max_headers_count`: likewise for the number of response headers.
    /// Default 100 (Envoy's).
    #[serde(default = "default_max_headers_count")]
    pub max_headers_count: u32,
}

impl ClusterConfig {
    /// The limits of this cluster's upstream response headers.
    pub fn response_header_limits(&self) -> HeaderLimits {
        HeaderLimits {
            bytes: self.max_response_headers_kb as usize * 1024,
            count: self.max_headers_count as usize,
        }
    }
}

/// Envoy's cluster discovery types the host knows.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
pub enum ClusterType {
    /// The endpoints listed in the config (and set through the admin API).
    #[default]
    #[serde(rename = "STATIC", alias = "static")]
    Static,
    /// Envoy's ORIGINAL_DST: each request goes to the address it names. With
    /// `use_http_header: true` that is the `x-envoy-original-dst-host` header (`ip:port`); without
    /// it (or without the header) the downstream connection's original destination, which neither
    /// a plugin's HTTP call nor this host's listeners have: such requests fail (503).
    #[serde(rename = "ORIGINAL_DST", alias = "original_dst")]
    OriginalDst,
    /// Envoy's `envoy.clusters.redis`: the endpoints are seed nodes of a Redis Cluster; the Redis
    /// client learns the slot map from them (`CLUSTER SLOTS`), sends each command to the master of
    /// its key's slot and follows `MOVED` / `ASK`. HTTP requests to such a cluster find no host
    /// (503), as Envoy's Redis cluster load balancer needs a key to pick one.
    #[serde(rename = "REDIS_CLUSTER", alias = "redis_cluster")]
    RedisCluster,
}

/// Envoy's `envoy.extensions.clusters.redis.v3.RedisClusterConfig`, the keys this host uses.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
pub struct RedisClusterConfig {
    /// How often the slot map is read again (Envoy's `cluster_refresh_rate`, default 5 s). A
    /// `MOVED` reply or a node's connection failing also triggers a read.
    #[serde(default = "default_cluster_refresh_rate")]
    pub cluster_refresh_rate_ms: u64,
    /// How long one `CLUSTER SLOTS` may take (Envoy's `cluster_refresh_timeout`, default 3 s).
    #[serde(default = "default_cluster_refresh_timeout")]
    pub cluster_refresh_timeout_ms: u64,
}

impl Default for RedisClusterConfig {
    fn default() -> Self {
        RedisClusterConfig {
            cluster_refresh_rate_ms: default_cluster_refresh_rate(),
            cluster_refresh_timeout_ms: default_cluster_refresh_timeout(),
        }
    }
}

fn default_cluster_refresh_rate() -> u64 {
    5_000
}

fn default_cluster_refresh_timeout() -> u64 {
    3_000
}

/// Envoy's `original_dst_lb_config`.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
pub struct OriginalDstLbConfig {
    /// Take the destination from the `x-envoy-original-dst-host` request header.
    #[serde(default)]
    pub use_http_header: bool,
}

fn default_connect_timeout() -> u64 {
    5_000
}

/// Active HTTP health check (Envoy HTTP health checker + Higress `store_metrics`).
#[derive(Debug, Clone, Deserialize)]
pub struct HealthCheckConfig {
    /// Path to GET.
    #[serde(default = "default_hc_path")]
    pub path: String,
    /// Interval between probes.
    #[serde(default = "default_hc_interval")]
    pub interval_ms: u64,
    /// Probe timeout.
    #[serde(default = "default_hc_interval")]
    pub timeout_ms: u64,
    /// Consecutive failures before Unhealthy.
    #[serde(default = "one")]
    pub unhealthy_threshold: u32,
    /// Consecutive successes before Healthy.
    #[serde(default = "one")]
    pub healthy_threshold: u32,
    /// Keep the healthy answer's body (<= 64 KiB) as the endpoint's `metrics`.
    #[serde(default)]
    pub store_metrics: bool,
    /// Statuses that count as healthy, as Envoy's `expected_statuses`: half-open ranges
    /// `[start, end)`. Default: 200 only, as Envoy's.
    #[serde(default = "default_expected_statuses")]
    pub expected_statuses: Vec<[u16; 2]>,
}

impl HealthCheckConfig {
    /// Whether an answer with `status` is a healthy one.
    pub fn expects(&self, status: u16) -> bool {
        self.expected_statuses.iter().any(|[start, end]| (*start..*end).contains(&status))
    }
}

fn default_expected_statuses() -> Vec<[u16; 2]> {
    vec![[200, 201]]
}

fn default_hc_path() -> String {
    "/metrics".into()
}
fn default_hc_interval() -> u64 {
    1000
}
fn one() -> u32 {
    1
}

/// The plugin section.
#[derive(Debug, Clone, Deserialize)]
pub struct PluginConfig {
    /// Path of the .wasm (relative paths are relative to the working directory).
    pub wasm: String,
    /// `plugin_name` property.
    #[serde(default)]
    pub name: String,
    /// `plugin_root_id` property.
    #[serde(default)]
    pub root_id: String,
    /// `plugin_vm_id` property; also the shared-data namespace.
    #[serde(default)]
    pub vm_id: String,
    /// Any value; delivered to `proxy_on_configure` as JSON text.
    #[serde(default)]
    pub configuration: serde_yaml::Value,
    /// Optional VM configuration (delivered to `proxy_on_vm_start`), JSON text.
    #[serde(default)]
    pub vm_configuration: Option<serde_yaml::Value>,
    /// What a trap does to the plugin (Envoy's `failure_policy`).
    #[serde(default)]
    pub failure_policy: FailurePolicy,
}

/// What happens after a plugin VM traps, as Envoy 1.40 does it (conformance tests
/// `a_trap_under_*_and_the_streams_in_flight`). The policy decides what the trapping stream, the
/// worker's other streams that already have a context in that VM (in flight) and the streams
/// that start later get. Under every policy a stream held waiting for the plugin (a callout, a
/// tick) stays held, as the plugin's callbacks are not delivered any more, and no stream of the
/// failed VM gets `on_log`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum FailurePolicy {
    /// Envoy's default `failure_policy: FAIL_CLOSED`, and Higress's `failStrategy: FAIL_CLOSE`:
    /// the VM stays failed; the trapping stream and the streams in flight fail at their next
    /// filter callback (503 `wasm_fail_stream`, a reset once the response headers went out);
    /// every later stream on that worker gets 503 `wasm_fail_stream`.
    #[default]
    FailClosed,
    /// Modelled on Higress's `failStrategy: FAIL_OPEN`, which Higress's istio deploys as Envoy's
    /// legacy `fail_open: true` (not `failure_policy`): the VM stays failed; the trapping
    /// stream, the streams in flight and every later stream on that worker go on without the
    /// plugin.
    FailOpen,
    /// Envoy's `failure_policy: FAIL_RELOAD`: the trapping stream and the streams in flight fail
    /// as under `FailClosed`; a new VM is started for the next stream.
    FailReload,
}

impl PluginConfig {
    /// The plugin configuration as the JSON text Higress delivers.
    pub fn configuration_json(&self) -> anyhow::Result<String> {
        if self.configuration.is_null() {
            return Ok(String::new());
        }
        Ok(serde_json::to_string(&self.configuration)?)
    }
}

impl Config {
    /// Load from a YAML file.
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("reading config {}: {e}", path.display()))?;
        Self::parse(&text)
    }

    /// Parse YAML text and check references.
    pub fn parse(text: &str) -> anyhow::Result<Config> {
        let cfg: Config = serde_yaml::from_str(text)?;
        for l in &cfg.listeners {
            l.http2.check(&l.name)?;
            let what = format!("listener {}", l.name);
            check_header_kb(&what, "max_request_headers_kb", l.max_request_headers_kb)?;
            check_header_count(&what, l.max_headers_count)?;
        }
        for r in &cfg.routes {
            if r.cluster.is_none() && r.cluster_header.is_none() {
                anyhow::bail!("route {} needs `cluster` or `cluster_header`", r.name);
            }
            if let Some(c) = &r.cluster {
                if !cfg.clusters.iter().any(|x| &x.name == c) {
                    anyhow::bail!("route {} names unknown cluster {c}", r.name);
                }
            }
        }
        for c in &cfg.clusters {
            let what = format!("cluster {}", c.name);
            check_header_kb(&what, "max_response_headers_kb", c.max_response_headers_kb)?;
            check_header_count(&what, c.max_headers_count)?;
            for e in &c.endpoints {
                e.parse::<std::net::SocketAddr>().map_err(|_| {
                    anyhow::anyhow!("cluster {}: endpoint {e} is not ip:port", c.name)
                })?;
            }
        }
        Ok(cfg)
    }
}

/// A header size limit in KiB, in the range Envoy accepts (1..=8192; its config is refused outside).
fn check_header_kb(what: &str, field: &str, kb: u32) -> anyhow::Result<()> {
    if !(1..=8192).contains(&kb) {
        anyhow::bail!("{what}: {field} {kb} is not in 1..=8192");
    }
    Ok(())
}

/// A header count limit, at least 1 as Envoy requires.
fn check_header_count(what: &str, count: u32) -> anyhow::Result<()> {
    if count == 0 {
        anyhow::bail!("{what}: max_headers_count must be at least 1");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listener(extra: &str) -> anyhow::Result<Config> {
        Config::parse(&format!("listeners: [{{name: main, address: 127.0.0.1:0{extra}}}]\n"))
    }

    /// A listener serves HTTP/2 with Higress's `downstream.http2` defaults unless told otherwise.
    #[test]
    fn http2_settings_default_to_higress_and_are_range_checked() {
        let cfg = listener("").unwrap();
        let h = cfg.listeners[0].http2;
        assert_eq!(
            (
                h.max_concurrent_streams,
                h.initial_stream_window_size,
                h.initial_connection_window_size
            ),
            (100, 65535, 1_048_576)
        );
        let cfg = listener(", http2: {initial_stream_window_size: 1048576}").unwrap();
        assert_eq!(cfg.listeners[0].http2.initial_stream_window_size, 1_048_576);
        assert_eq!(cfg.listeners[0].http2.max_concurrent_streams, 100);
        let err = listener(", http2: {initial_stream_window_size: 1000}").unwrap_err().to_string();
        assert!(err.contains("http2.initial_stream_window_size 1000"), "{err}");
        assert!(listener(", http2: {max_concurrent_streams: 0}").is_err());
        assert!(listener(", http2: {max_streams: 5}").is_err(), "unknown keys are refused");
    }

    /// Envoy's request header limits by default (60 KiB, 100 headers), within Envoy's ranges.
    #[test]
    fn request_header_limits_default_to_envoy_and_are_range_checked() {
        let limits = listener("").unwrap().listeners[0].header_limits();
        assert_eq!((limits.bytes, limits.count), (61_440, 100));
        let cfg = listener(", max_request_headers_kb: 96, max_headers_count: 200").unwrap();
        let limits = cfg.listeners[0].header_limits();
        assert_eq!((limits.bytes, limits.count), (98_304, 200));
        let err = listener(", max_request_headers_kb: 8193").unwrap_err().to_string();
        assert!(err.contains("max_request_headers_kb 8193"), "{err}");
        let err = listener(", max_request_headers_kb: 0").unwrap_err().to_string();
        assert!(err.contains("max_request_headers_kb 0"), "{err}");
        let err = listener(", max_headers_count: 0").unwrap_err().to_string();
        assert!(err.contains("max_headers_count"), "{err}");
    }

    /// Envoy's upstream response header limits by default (80 KiB, 100 headers), per cluster,
    /// within Envoy's ranges.
    #[test]
    fn response_header_limits_default_to_envoy_and_are_range_checked() {
        let cluster = |extra: &str| {
            Config::parse(&format!(
                "clusters: [{{name: c, endpoints: [\"127.0.0.1:1\"]{extra}}}]\n"
            ))
        };
        let limits = cluster("").unwrap().clusters[0].response_header_limits();
        assert_eq!((limits.bytes, limits.count), (81_920, 100));
        let cfg = cluster(", max_response_headers_kb: 96, max_headers_count: 200").unwrap();
        let limits = cfg.clusters[0].response_header_limits();
        assert_eq!((limits.bytes, limits.count), (98_304, 200));
        let err = cluster(", max_response_headers_kb: 8193").unwrap_err().to_string();
        assert!(err.contains("cluster c: max_response_headers_kb 8193"), "{err}");
        let err = cluster(", max_headers_count: 0").unwrap_err().to_string();
        assert!(err.contains("cluster c: max_headers_count"), "{err}");
    }
}
