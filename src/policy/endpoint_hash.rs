//! `endpoint_hash`: sticky sessions kept in Redis, as the Go plugin's `endpoint_hash` keeps them. A
//! request's key (the header `hash_header`) is bound to the pod that served it first, and later
//! requests with that key go to the same pod while it is healthy, on every worker and gateway
//! replica that shares the Redis.
//!
//! - The binding of a key is the string `higress:endpoint_hash_table:<route>:<cluster>:<hash>`
//!   (`<hash>`: the key's 32-bit FNV-1a, 8 lower-case hex digits) holding the pod's `ip:port`, with
//!   a TTL of `stickyTimeout` minutes: the Go plugin's key, so Go and Rust gateways on one Redis
//!   share the bindings.
//! - A hit (the bound pod is healthy) pins the request to it and renews the TTL (`EXPIRE`).
//! - A miss, or a bound pod that is no longer healthy, leaves the choice to the gateway's own
//!   balancing; the pod it chose (`upstream.address`) is bound at the response headers (`SETEX`),
//!   or at the stream's end when no response came.
//! - A request without the header, or with no healthy pod, takes the gateway's balancing and binds
//!   nothing.
//!
//! Failures (ours; the Go plugin waits for its Redis `timeout` on every request): a lookup not
//! answered within `breakerSlowMs` is given up, and the [`Breaker`] decides without Redis after
//! `breakerFailures` failed or slow calls in a row (at once when Redis answered nothing while the
//! lookup waited), for `breakerOpenMs`, then lets one lookup through as its probe. Without Redis a
//! request takes the gateway's balancing and binds nothing; a Redis error reply counts as a miss
//! (the binding is written again), as in Go.

use super::breaker::{Admission, Breaker};
use super::{fnv1a32, healthy_hosts, Decision, Policy, Stream};
use crate::config::EndpointHashConfig;
use crate::host::{Counter, Host, LogLevel, RedisReply};
use crate::redis::{decode_reply, encode_command, Frame, RedisClient};
use rustc_hash::FxHashMap;
use std::collections::HashSet;

/// One stream's binding.
struct Sticky {
    /// The Redis key of the stream's session.
    key: String,
    /// The lookup while it is out.
    lookup: Option<Lookup>,
    /// The pod the gateway's balancing picks must be bound to the key.
    record: bool,
}

/// A lookup (`GET`) in flight.
struct Lookup {
    sent_ns: u64,
    /// The pods it may pin the request to.
    healthy: Vec<String>,
}

/// The `endpoint_hash` policy.
pub struct EndpointHash {
    config: EndpointHashConfig,
    redis: RedisClient,
    breaker: Breaker,
    /// Live streams that have a key, by stream id.
    streams: FxHashMap<u32, Sticky>,
    /// This policy's Redis calls in flight (lookups, also those given up or whose stream ended,
    /// and writes): each reply, or the host's timeout, tells the breaker whether Redis answers
    /// (a breaker whose probe's stream went away would otherwise stay half-open).
    calls: HashSet<u32>,
    /// When Redis last answered any call (ns): a lookup given up with no answer since it was sent
    /// found a stall.
    last_answer_ns: u64,
}

/// The Redis key of session `key` on `route` and `cluster` (the Go plugin's format).
pub fn binding_key(route: &str, cluster: &str, key: &str) -> String {
    format!("higress:endpoint_hash_table:{route}:{cluster}:{:08x}", fnv1a32(key.as_bytes()))
}

/// What a lookup's reply says.
enum Bound {
    /// The key is bound to this pod.
    To(String),
    /// No binding.
    Nothing,
    /// An error reply or bytes that are not RESP.
    Error(String),
}

fn parse_lookup(bytes: &[u8]) -> Bound {
    match decode_reply(bytes) {
        Ok(Frame::BulkString(b)) | Ok(Frame::SimpleString(b)) => match String::from_utf8(b) {
            Ok(pod) if !pod.is_empty() => Bound::To(pod),
            _ => Bound::Nothing,
        },
        Ok(Frame::Null) => Bound::Nothing,
        Ok(Frame::Error(e)) => Bound::Error(e.to_string()),
        Ok(other) => Bound::Error(format!("unexpected reply {other:?}")),
        Err(e) => Bound::Error(e),
    }
}

impl EndpointHash {
    /// Creates the policy from its config.
    pub fn new(config: EndpointHashConfig) -> Self {
        let redis = RedisClient::new(config.redis.clone());
        let breaker = Breaker::new(config.state.breaker_failures, config.state.breaker_open_ms);
        EndpointHash {
            config,
            redis,
            breaker,
            streams: FxHashMap::default(),
            calls: HashSet::new(),
            last_answer_ns: 0,
        }
    }

    /// Sends a write whose reply nobody waits for, unless the breaker keeps Redis out.
    fn send_write(&mut self, host: &mut dyn Host, args: &[&str]) {
        if !self.breaker.is_closed() {
            return;
        }
        if let Ok(token) = self.redis.call(host, &encode_command(args)) {
            self.calls.insert(token);
        }
    }

    /// Binds the stream's key to the pod the gateway chose, if it still has to.
    fn record(&mut self, host: &mut dyn Host, stream_id: u32) {
        let Some(s) = self.streams.get_mut(&stream_id).filter(|s| s.record) else { return };
        s.record = false;
        let key = s.key.clone();
        let Some(pod) = super::upstream_address(host) else {
            host.log(LogLevel::Debug, "endpoint_hash: no upstream address to bind the key to");
            return;
        };
        let ttl = self.config.sticky_ttl_s.to_string();
        self.send_write(host, &["SETEX", &key, &ttl, &pod]);
    }

    /// Redis answered (`ok`) or failed a call, for the breaker.
    fn on_call_outcome(&mut self, host: &mut dyn Host, ok: bool) {
        let now = host.now_nanos();
        if ok {
            self.last_answer_ns = now;
            self.breaker.on_success(now);
        } else if self.breaker.on_failure(now) {
            self.breaker_opened(host);
        }
    }

    fn breaker_opened(&mut self, host: &mut dyn Host) {
        host.increment_counter(Counter::BreakerOpened, 1);
        host.log(
            LogLevel::Warn,
            &format!(
                "endpoint_hash: Redis breaker open for {} ms after failed or slow calls; requests \
                 take the gateway's balancing meanwhile",
                self.config.state.breaker_open_ms
            ),
        );
    }

    /// The answer to a lookup of `stream`.
    fn on_lookup(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        reply: &RedisReply,
    ) -> Decision {
        let Some(s) = self.streams.get_mut(&stream.id) else { return Decision::Passthrough };
        let Some(lookup) = s.lookup.take() else { return Decision::Passthrough };
        let bound = match reply {
            RedisReply::Ok(bytes) => parse_lookup(bytes),
            RedisReply::NetworkError => {
                // No binding is written either: Redis is not answering.
                self.on_call_outcome(host, false);
                host.increment_counter(Counter::FallbackRedisTimeout, 1);
                stream.decision = Some(Counter::FallbackRedisTimeout.label().into());
                return Decision::Passthrough;
            }
        };
        self.on_call_outcome(host, true);
        let Some(s) = self.streams.get_mut(&stream.id) else { return Decision::Passthrough };
        match bound {
            Bound::To(pod) if lookup.healthy.contains(&pod) => {
                let (key, ttl) = (s.key.clone(), self.config.sticky_ttl_s.to_string());
                self.send_write(host, &["EXPIRE", &key, &ttl]);
                host.increment_counter(Counter::StickyHit, 1);
                stream.decision = Some(format!("{}; pod={pod}", Counter::StickyHit.label()));
                Decision::Route(pod)
            }
            Bound::Error(e) => {
                host.log(
                    LogLevel::Warn,
                    &format!("endpoint_hash: Redis lookup failed: {e}; binding again"),
                );
                self.redis.on_error_reply(&e);
                s.record = true;
                host.increment_counter(Counter::FallbackRedisError, 1);
                stream.decision = Some(Counter::FallbackRedisError.label().into());
                Decision::Passthrough
            }
            // No binding, or its pod is no longer healthy: the gateway chooses, and that is bound.
            Bound::To(_) | Bound::Nothing => {
                s.record = true;
                host.increment_counter(Counter::StickyMiss, 1);
                stream.decision = Some(Counter::StickyMiss.label().into());
                Decision::Passthrough
            }
        }
    }
}

impl Policy for EndpointHash {
    fn name(&self) -> &'static str {
        "endpoint_hash"
    }

    fn on_start(&mut self, host: &mut dyn Host) {
        self.redis.init(host);
    }

    fn on_request_headers(&mut self, host: &mut dyn Host, stream: &mut Stream) -> Decision {
        let Some(key) = host.request_header(&self.config.hash_header).filter(|k| !k.is_empty())
        else {
            return Decision::Passthrough;
        };
        if stream.route.is_empty() || stream.cluster.is_empty() {
            host.log(
                LogLevel::Warn,
                "endpoint_hash: no route or cluster name; using normal balancing",
            );
            return Decision::Passthrough;
        }
        let list = host.upstream_hosts();
        let Some((healthy, _)) = healthy_hosts(list.as_deref(), host, "endpoint_hash") else {
            return Decision::Passthrough;
        };
        let now = host.now_nanos();
        if self.breaker.admit(now) == Admission::Refuse {
            host.increment_counter(Counter::FallbackBreakerOpen, 1);
            stream.decision = Some(Counter::FallbackBreakerOpen.label().into());
            return Decision::Passthrough;
        }
        let key = binding_key(&stream.route, &stream.cluster, &key);
        let token = match self.redis.call(host, &encode_command(&["GET", key.as_str()])) {
            Ok(token) => token,
            Err(_) => {
                // A failed call, for the breaker (a probe that could not be sent reopens it).
                self.on_call_outcome(host, false);
                host.increment_counter(Counter::FallbackRedisError, 1);
                stream.decision = Some(Counter::FallbackRedisError.label().into());
                return Decision::Passthrough;
            }
        };
        self.calls.insert(token);
        let lookup = Lookup { sent_ns: now, healthy };
        self.streams.insert(stream.id, Sticky { key, lookup: Some(lookup), record: false });
        Decision::Pending(token)
    }

    fn on_redis_reply(
        &mut self,
        host: &mut dyn Host,
        stream: Option<&mut Stream>,
        token: u32,
        reply: &RedisReply,
    ) -> Decision {
        if !self.calls.remove(&token) {
            return Decision::Passthrough;
        }
        // The dispatcher passes the stream only to the reply it waits for: its lookup's.
        match stream {
            Some(stream) => self.on_lookup(host, stream, reply),
            // A write, or a lookup given up or whose stream ended: it still says whether Redis
            // answers.
            None => {
                self.on_call_outcome(host, matches!(reply, RedisReply::Ok(_)));
                Decision::Passthrough
            }
        }
    }

    fn on_response_headers(&mut self, host: &mut dyn Host, stream: &mut Stream) {
        self.record(host, stream.id);
    }

    fn on_stream_done(&mut self, host: &mut dyn Host, stream: &mut Stream) {
        // No response headers (the upstream failed): bind at the end, as the Go plugin does.
        self.record(host, stream.id);
        self.streams.remove(&stream.id);
    }

    fn tick_period_ms(&self) -> u32 {
        // Slow lookups are given up on the tick: a quarter of `breakerSlowMs` late at most.
        match self.config.state.breaker_slow_ms {
            0 => 0,
            slow => (slow / 4).max(1),
        }
    }

    fn on_pending_tick(&mut self, host: &mut dyn Host, stream: &mut Stream) -> Option<Decision> {
        let slow_ns = u64::from(self.config.state.breaker_slow_ms) * 1_000_000;
        let now = host.now_nanos();
        let s = self.streams.get_mut(&stream.id)?;
        let lookup = s.lookup.as_ref()?;
        if slow_ns == 0 || now.saturating_sub(lookup.sent_ns) < slow_ns {
            return None;
        }
        let sent_ns = lookup.sent_ns;
        // Its late reply comes without a stream, still counted in `calls`.
        s.lookup = None;
        // A stall opens a closed breaker at once; a slow probe reopens it for `breakerOpenMs`.
        let stalled = self.last_answer_ns < sent_ns && self.breaker.is_closed();
        let opened = if stalled {
            self.breaker.on_stall(now).is_some()
        } else {
            self.breaker.on_failure(now)
        };
        if opened {
            self.breaker_opened(host);
        }
        host.increment_counter(Counter::FallbackRedisSlow, 1);
        stream.decision = Some(Counter::FallbackRedisSlow.label().into());
        Some(Decision::Passthrough)
    }
}

#[cfg(test)]
#[path = "endpoint_hash_tests.rs"]
mod tests;
