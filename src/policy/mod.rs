//! The `Policy` trait every load-balancing policy implements, and the factory from config.
//!
//! The dispatcher (`crate::filter`, driven by `abi.rs` in the .wasm and by tests natively) owns the
//! request flow; a policy only answers "what now?" at each event:
//!
//! * `on_request_headers`: policies that do not need the body decide here. Body policies return
//!   [`Decision::NeedBody`] — unless [`Stream::bodiless`] (the headers ended the request, Higress
//!   #3740): then no body callback will ever come and they MUST decide now.
//! * `on_request_body(.., body)`: called once with the complete body (the dispatcher buffers;
//!   bodies above `maxBodyBytes` never reach the policy, they pass through).
//! * `on_redis_reply` / `on_http_reply`: the reply to a call the policy made. `stream` is `Some` when
//!   the call was made by a stream that is still alive (the dispatcher already made it the effective
//!   context), `None` for calls made at root level (tick) and for streams that ended meanwhile.
//! * `on_stream_done`: exactly once per stream that reached the policy, whatever the outcome
//!   (success, upstream failure, reset, client abort, local reply). The place to release counters
//!   and to drop what the policy keeps for the stream (by `Stream::id`, in a typed map of its own).
//! * `on_tick`: periodic, at root level (no stream); period from `tick_period_ms`. Then
//!   `on_pending_tick` for each of the policy's streams held with a call in flight (a way to give
//!   up on a call that takes too long).
//!
//! Calls: a policy makes Redis and HTTP calls through the host and gets their tokens back. To hold
//! the request for a call's reply it returns [`Decision::Pending`] with that token; the reply then
//! comes with the stream. Replies to its other calls (releases, heartbeats, scrapes, the late reply
//! of a call it gave up on) come without a stream, to every policy: each keeps the tokens of its
//! own calls and ignores the rest.
//!
//! Every decision that is not `NeedBody`/`Pending` ends the policy's say over the request; the
//! dispatcher applies it and resumes.

use crate::config::{LbConfig, PolicyConfig};
use crate::host::{Host, HttpReply, RedisReply};

pub mod breaker;
mod cache_check;
pub mod cluster_hash;
pub mod cluster_metrics;
pub mod endpoint_hash;
pub mod endpoint_metrics;
pub mod global_least_request;
pub mod latency;
pub mod load;
pub mod picker;
pub mod prefill;
pub mod prefix_cache;
pub mod response_id;

/// What the dispatcher should do with the request.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Continue with the gateway's normal balancing (also every error/fallback path).
    Passthrough,
    /// Pin the request to this `ip:port` (set_upstream_override_host) and continue.
    Route(String),
    /// Write a request header (e.g. `cluster_header` for `lb_type: cluster`) and continue.
    SetHeader {
        /// Header name.
        name: String,
        /// Header value.
        value: String,
    },
    /// Answer locally (e.g. 429) and do not forward.
    Reject {
        /// HTTP status.
        status: u32,
        /// Response body.
        body: String,
    },
    /// Keep the request paused and deliver the complete body to `on_request_body`.
    NeedBody,
    /// Keep the request paused until the reply to this call (the token of a Redis or HTTP call the
    /// policy just made) decides.
    Pending(u32),
}

/// Per-request state the dispatcher keeps for a policy.
#[derive(Default)]
pub struct Stream {
    /// The proxy-wasm context id of the stream.
    pub id: u32,
    /// Property `route_name` ("" if the host gave none).
    pub route: String,
    /// Property `cluster_name` ("" if the host gave none).
    pub cluster: String,
    /// `:authority`.
    pub authority: String,
    /// The headers ended the request (GET...): no body callback will come.
    pub bodiless: bool,
    /// Stream start time (ns since epoch) — for latency statistics.
    pub start_ns: u64,
    /// How the policy decided (a counter's name without `ai_lb_`, plus details), for the optional
    /// decision response header.
    pub decision: Option<String>,
}

impl core::fmt::Debug for Stream {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Stream")
            .field("id", &self.id)
            .field("route", &self.route)
            .field("cluster", &self.cluster)
            .finish()
    }
}

/// A load-balancing policy. One instance per config (top level or `_rules_` entry) per worker VM.
pub trait Policy {
    /// Name for logs (`global_least_request`, ...).
    fn name(&self) -> &'static str;

    /// Called once when the plugin (re)starts with this config, on the root context: e.g. Redis init.
    /// Must not fail the plugin start for environment errors (Higress #1517): log and retry later.
    fn on_start(&mut self, _host: &mut dyn Host) {}

    /// Request headers arrived. See the module docs for [`Stream::bodiless`].
    fn on_request_headers(&mut self, host: &mut dyn Host, stream: &mut Stream) -> Decision;

    /// The complete request body (only after `NeedBody`).
    fn on_request_body(
        &mut self,
        _host: &mut dyn Host,
        _stream: &mut Stream,
        _body: &[u8],
    ) -> Decision {
        Decision::Passthrough
    }

    /// Reply to a Redis call made by this policy.
    fn on_redis_reply(
        &mut self,
        _host: &mut dyn Host,
        _stream: Option<&mut Stream>,
        _token: u32,
        _reply: &RedisReply,
    ) -> Decision {
        Decision::Passthrough
    }

    /// Reply to an HTTP call made by this policy.
    fn on_http_reply(
        &mut self,
        _host: &mut dyn Host,
        _stream: Option<&mut Stream>,
        _token: u32,
        _reply: &HttpReply,
    ) -> Decision {
        Decision::Passthrough
    }

    /// Response headers arrived (for latency statistics).
    fn on_response_headers(&mut self, _host: &mut dyn Host, _stream: &mut Stream) {}

    /// A response body chunk arrived (`size` bytes of this chunk; e.g. first token time).
    fn on_response_body(
        &mut self,
        _host: &mut dyn Host,
        _stream: &mut Stream,
        _size: usize,
        _end_of_stream: bool,
    ) {
    }

    /// The stream ended (exactly once per stream that reached this policy).
    fn on_stream_done(&mut self, _host: &mut dyn Host, _stream: &mut Stream) {}

    /// Desired tick period in ms (0 = no tick). The root uses the smallest non-zero of all policies.
    fn tick_period_ms(&self) -> u32 {
        0
    }

    /// Periodic work at root level.
    fn on_tick(&mut self, _host: &mut dyn Host) {}

    /// The root context stops (the gateway shuts down, or the plugin is removed): send the work
    /// that waits for a later pick or tick, which will not come. Returns whether the policy is done;
    /// if not, [`Policy::stopped`] says when the replies it still waits for have come.
    fn on_stop(&mut self, _host: &mut dyn Host) -> bool {
        true
    }

    /// After [`Policy::on_stop`]: whether nothing this policy sent still needs its reply.
    fn stopped(&self) -> bool {
        true
    }

    /// At each tick, for each stream this policy holds with a call in flight: `None` keeps
    /// waiting; a decision gives up on the call and is applied at once (the call's late reply then
    /// comes without the stream).
    fn on_pending_tick(&mut self, _host: &mut dyn Host, _stream: &mut Stream) -> Option<Decision> {
        None
    }
}

/// Builds the policy for one config.
pub fn build(config: &LbConfig) -> Box<dyn Policy> {
    match &config.policy {
        PolicyConfig::GlobalLeastRequest(c) => {
            Box::new(global_least_request::GlobalLeastRequest::new(c.clone()))
        }
        PolicyConfig::PrefixCache(c) => Box::new(prefix_cache::PrefixCache::new(c.clone())),
        PolicyConfig::EndpointMetrics(c) => {
            Box::new(endpoint_metrics::EndpointMetrics::new(c.clone()))
        }
        PolicyConfig::ClusterMetrics(c) => {
            Box::new(cluster_metrics::ClusterMetrics::new(c.clone()))
        }
        PolicyConfig::ClusterHash(c) => Box::new(cluster_hash::ClusterHash::new(c.clone())),
        PolicyConfig::EndpointHash(c) => Box::new(endpoint_hash::EndpointHash::new(c.clone())),
    }
}

/// 32-bit FNV-1a, the Go plugin's hash of a session or routing key (`hash/fnv.New32a`), so that
/// `cluster_hash` and `endpoint_hash` map a key as the Go plugin does.
pub fn fnv1a32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5_u32, |h, &b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

/// Healthy and other host addresses of `list` (the cluster's host list, fetched once by the caller),
/// or `None` (with a log line) when the list is missing or has no healthy host — the caller then
/// passes through to normal balancing.
pub fn healthy_hosts(
    list: Option<&[crate::host::UpstreamHost]>,
    host: &dyn Host,
    policy: &str,
) -> Option<(Vec<String>, Vec<String>)> {
    let Some(list) = list else {
        host.log(
            crate::host::LogLevel::Warn,
            &format!("{policy}: no upstream host list; using normal balancing"),
        );
        return None;
    };
    let mut healthy = Vec::new();
    let mut other = Vec::new();
    for h in list {
        if h.is_healthy() {
            healthy.push(h.address.clone());
        } else {
            other.push(h.address.clone());
        }
    }
    if healthy.is_empty() {
        host.log(
            crate::host::LogLevel::Warn,
            &format!("{policy}: no healthy upstream host; using normal balancing"),
        );
        return None;
    }
    Some((healthy, other))
}

/// The pod that answers the stream (`upstream.address`), whoever chose it (this plugin, or the
/// gateway's own balancing); `None` before one is chosen or when the host does not say.
pub fn upstream_address(host: &dyn Host) -> Option<String> {
    host.get_property(&["upstream", "address"])
        .and_then(|b| String::from_utf8(b).ok())
        .filter(|a| !a.is_empty())
}

/// What follows the first `key` (quoted, e.g. `b"\"id\""`) and its `:` in `text`, whitespace
/// skipped: a JSON member's value, found without parsing a document that may be cut anywhere (the
/// start or the end of a reply).
pub fn after_first_key<'t>(text: &'t [u8], key: &[u8]) -> Option<&'t [u8]> {
    let at = text.windows(key.len()).position(|w| w == key)?;
    member_value(text, at + key.len())
}

/// [`after_first_key`] at the last `key` in `text`.
pub fn after_last_key<'t>(text: &'t [u8], key: &[u8]) -> Option<&'t [u8]> {
    let at = text.windows(key.len()).rposition(|w| w == key)?;
    member_value(text, at + key.len())
}

/// The value after a member's key that ends at `key_end`.
fn member_value(text: &[u8], key_end: usize) -> Option<&[u8]> {
    let rest = text.get(key_end..)?.trim_ascii_start().strip_prefix(b":")?;
    Some(rest.trim_ascii_start())
}

/// `pairs` indexed by key, the first pair of a key kept (as a linear `find` would): every pick
/// looks up each healthy pod once, so a large cluster costs linear time, not quadratic.
pub fn first_by_key<'a, V>(
    pairs: impl Iterator<Item = (&'a str, V)>,
) -> rustc_hash::FxHashMap<&'a str, V> {
    let mut map = rustc_hash::FxHashMap::default();
    for (k, v) in pairs {
        map.entry(k).or_insert(v);
    }
    map
}
