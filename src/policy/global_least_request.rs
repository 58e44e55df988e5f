//! `global_least_request`: in-flight counts per host in Redis, shared by every gateway worker and
//! replica; each request goes to the healthy host with the fewest (random among ties).
//!
//! One Redis round trip per request (the `least_request.lua` script: cleanup + pick + `+1` +
//! `maxRequestCount` check with undo). The `-1` is sent fire-and-forget when the stream ends,
//! exactly once, whatever the outcome. The decision is taken in the headers phase (no body needed).
//!
//! [`Picker`] is the shared machinery (also used by `prefix_cache`): send the script, NOSCRIPT ->
//! EVAL retry, parse `{host, count, admitted, ...}`, remember the pick, release it at stream end.
//!
//! Exactly-once release: each pick carries a random request key (`...:req:<id>`). An admitted pick
//! writes the chosen host there; `release.lua` decrements from that record and deletes it. When the
//! plugin gives up on a pick (Redis timeout / NetworkError, client gone while waiting), it sends the
//! same release with a tombstone TTL: if the pick already ran it is undone, and if it has not run yet
//! (a frozen Redis executes it later) the tombstone makes it a no-op. So a Redis stall never leaves
//! phantom in-flight counts behind.

use super::{healthy_hosts, Decision, Policy, Stream};
use crate::config::GlobalLeastRequestConfig;
use crate::host::{Host, LogLevel, RedisReply};
use crate::redis::{self, decode_reply, Frame, RedisClient, Script};
use std::collections::HashMap;

/// Body of the local 429 reply (same text as the Go plugin).
pub const REJECT_BODY: &str = "Exceeded maximum request limit from ai-load-balancer.";

/// How long a tombstone of an abandoned pick lives (s): longer than any Redis stall we expect a
/// late pick to survive.
const TOMBSTONE_TTL_S: u32 = 3600;

/// A release whose delivery failed is sent again at most this many times in all.
const MAX_RELEASE_ATTEMPTS: u32 = 5;
/// At most this many failed releases wait for Redis to come back (bounded memory per worker).
const MAX_QUEUED_RELEASES: usize = 1024;

/// One release (`-1`, or the cancel of an abandoned pick). `release.lua` is idempotent per pick
/// record, so a release whose outcome is unknown can always be sent again.
#[derive(Debug, Clone)]
struct Release {
    inflight_key: String,
    req_key: String,
    tombstone_ttl_s: u32,
    /// Sends that failed so far.
    failures: u32,
}

/// Per-request state of a pick.
#[derive(Debug, Default)]
pub(crate) struct PickState {
    /// The in-flight hash key of this route+cluster.
    inflight_key: String,
    /// This request's pick record key.
    req_key: String,
    /// Script keys and args, kept to resend with EVAL after NOSCRIPT.
    keys: Vec<String>,
    args: Vec<String>,
    /// Token of the pick call in flight.
    pending: Option<u32>,
    /// EVAL fallback already tried.
    used_eval: bool,
    /// The host that got the `+1` (released exactly once at stream end).
    picked: Option<String>,
}

/// Result of a successful pick script reply.
#[derive(Debug, Clone, PartialEq)]
pub struct PickResult {
    /// The chosen host.
    pub host: String,
    /// Its in-flight count after the pick.
    pub count: i64,
    /// False when over `maxRequestCount` (the script undid the +1).
    pub admitted: bool,
    /// Matched prefix blocks (prefix_cache only; 0 otherwise).
    pub matched: i64,
}

/// Parses `{host, count, admitted[, matched]}`.
pub fn parse_pick(frame: &Frame) -> Option<PickResult> {
    let Frame::Array(items) = frame else { return None };
    let mut it = items.iter();
    let host = match it.next()? {
        Frame::BulkString(b) | Frame::SimpleString(b) => String::from_utf8(b.clone()).ok()?,
        _ => return None,
    };
    let int = |f: Option<&Frame>| match f {
        Some(Frame::Integer(i)) => Some(*i),
        Some(Frame::BulkString(b)) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    };
    let count = int(it.next())?;
    let admitted = int(it.next())? == 1;
    let matched = int(it.next()).unwrap_or(0);
    if host.is_empty() {
        return None;
    }
    Some(PickResult { host, count, admitted, matched })
}

/// Fisher–Yates shuffle with the host's randomness: the script takes the first minimum, so ties
/// are broken uniformly at random (Go's tie-break was biased, higress PR #3255).
pub(crate) fn shuffle(host: &mut dyn Host, v: &mut [String]) {
    let n = v.len();
    for i in (1..n).rev() {
        let j = (host.random_u64() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

/// The shared pick machinery.
pub(crate) struct Picker {
    pub redis: RedisClient,
    pub config: GlobalLeastRequestConfig,
    script: Script,
    release: Script,
    /// Name for logs.
    name: &'static str,
    /// Releases sent and not yet answered, by token. A lost release (NetworkError: Higress closes
    /// the whole pipeline on an op timeout, taking the releases queued behind a stalled pick with
    /// it) would otherwise leave a phantom in-flight count on that host for good.
    releases_in_flight: HashMap<u32, Release>,
    /// Failed releases, sent again as soon as a Redis reply shows the connection works.
    release_retry: Vec<Release>,
}

impl Picker {
    pub fn new(
        config: GlobalLeastRequestConfig,
        source: &'static str,
        name: &'static str,
    ) -> Picker {
        Picker {
            redis: RedisClient::new(config.redis.clone()),
            config,
            script: Script::new(source),
            release: Script::new(redis::RELEASE_LUA),
            name,
            releases_in_flight: HashMap::new(),
            release_retry: Vec::new(),
        }
    }

    /// Common script arguments after `fixed`: the N count, healthy hosts (shuffled), other hosts.
    /// Returns `None` (pass through) when the host list is missing or has no healthy host.
    pub fn host_args(&self, host: &mut dyn Host) -> Option<Vec<String>> {
        let (mut healthy, others) = healthy_hosts(host, self.name)?;
        shuffle(host, &mut healthy);
        let mut args = Vec::with_capacity(1 + healthy.len() + others.len());
        args.push(healthy.len().to_string());
        args.extend(healthy);
        args.extend(others);
        Some(args)
    }

    /// The leading script args shared by both scripts: now (s), clean interval (s), max in-flight.
    pub fn base_args(&self, host: &dyn Host) -> Vec<String> {
        vec![
            (host.now_nanos() / 1_000_000_000).to_string(),
            self.config.clean_interval_min.saturating_mul(60).to_string(),
            self.config.max_request_count.to_string(),
        ]
    }

    /// The first three script keys: in-flight hash, last-cleanup time, a fresh pick record.
    pub fn base_keys(&self, host: &mut dyn Host, stream: &Stream) -> Vec<String> {
        vec![
            redis::inflight_key(&stream.route, &stream.cluster),
            redis::last_clean_key(&stream.route, &stream.cluster),
            redis::request_key(&stream.route, &stream.cluster, host.random_u64()),
        ]
    }

    /// Sends the pick script for `stream` (`keys` start with [`Picker::base_keys`]). Returns
    /// `Pending`, or `Passthrough` if it could not be sent.
    pub fn start(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        keys: Vec<String>,
        args: Vec<String>,
    ) -> Decision {
        let inflight_key = keys.first().cloned().unwrap_or_default();
        let req_key = keys.get(2).cloned().unwrap_or_default();
        let query = self.script.command(&keys, &args, false);
        match self.redis.call(host, &query) {
            Ok(token) => {
                stream.set_data(PickState {
                    inflight_key,
                    req_key,
                    keys,
                    args,
                    pending: Some(token),
                    used_eval: false,
                    picked: None,
                });
                Decision::Pending
            }
            Err(_) => {
                host.increment_counter("ai_lb_fallback_redis", 1);
                Decision::Passthrough
            }
        }
    }

    /// Handles a reply. `Ok(result)` for an admitted or rejected pick (already recorded on the
    /// stream), `Err(decision)` for everything the caller just returns (Pending, Passthrough).
    pub fn on_reply(
        &mut self,
        host: &mut dyn Host,
        stream: Option<&mut Stream>,
        token: u32,
        reply: &RedisReply,
    ) -> Result<PickResult, Decision> {
        // The reply to one of our releases (whatever the stream's state): resend it if it may not
        // have run. Nothing waits for it.
        if let Some(rel) = self.releases_in_flight.remove(&token) {
            self.on_release_reply(host, rel, reply);
            return Err(Decision::Pending);
        }
        // A stream that ended while its pick was in flight already sent the cancel (on_done).
        let Some(stream) = stream else { return Err(Decision::Pending) };
        let name = self.name;
        let Some(state) = stream.data_mut::<PickState>() else { return Err(Decision::Pending) };
        if state.pending != Some(token) {
            return Err(Decision::Pending); // e.g. a fire-and-forget reply
        }
        state.pending = None;
        let bytes = match reply {
            RedisReply::Ok(b) => b,
            RedisReply::NetworkError => {
                host.log(
                    LogLevel::Warn,
                    &format!("{name}: redis network error or timeout; using normal balancing"),
                );
                host.increment_counter("ai_lb_fallback_redis", 1);
                // The pick may still run later (a stalled Redis): cancel it.
                let (k, r) = (state.inflight_key.clone(), state.req_key.clone());
                self.send_release(host, &k, &r, TOMBSTONE_TTL_S);
                return Err(Decision::Passthrough);
            }
        };
        let frame = match decode_reply(bytes) {
            Ok(f) => f,
            Err(e) => {
                host.log(LogLevel::Warn, &format!("{name}: {e}; using normal balancing"));
                host.increment_counter("ai_lb_fallback_redis", 1);
                let (k, r) = (state.inflight_key.clone(), state.req_key.clone());
                self.send_release(host, &k, &r, TOMBSTONE_TTL_S);
                return Err(Decision::Passthrough);
            }
        };
        if redis::is_noscript(&frame) && !state.used_eval {
            // The script is not cached on this Redis (restart, failover, new shard): send it once.
            state.used_eval = true;
            let query = self.script.command(&state.keys, &state.args, true);
            return match self.redis.call(host, &query) {
                Ok(t) => {
                    state.pending = Some(t);
                    Err(Decision::Pending)
                }
                Err(_) => Err(Decision::Passthrough),
            };
        }
        if let Frame::Error(msg) = &frame {
            host.log(
                LogLevel::Warn,
                &format!("{name}: redis error reply {msg:?}; using normal balancing"),
            );
            host.increment_counter("ai_lb_fallback_redis", 1);
            self.redis.on_error_reply(msg);
            return Err(Decision::Passthrough);
        }
        // Redis answered: releases lost earlier can go out again (before this stream's own).
        self.flush_release_retries(host);
        let Some(pick) = parse_pick(&frame) else {
            host.log(
                LogLevel::Warn,
                &format!("{name}: unexpected script reply; using normal balancing"),
            );
            let (k, r) = (state.inflight_key.clone(), state.req_key.clone());
            self.send_release(host, &k, &r, TOMBSTONE_TTL_S);
            return Err(Decision::Passthrough);
        };
        if pick.admitted {
            state.picked = Some(pick.host.clone());
        }
        if self.config.enable_detail_log {
            host.log(
                LogLevel::Info,
                &format!(
                    "{name}: route={} cluster={} host={} inflight={} admitted={} matched={}",
                    stream.route,
                    stream.cluster,
                    pick.host,
                    pick.count,
                    pick.admitted,
                    pick.matched
                ),
            );
        }
        Ok(pick)
    }

    /// The decision for a pick result: route there, or 429 (the script already undid the +1).
    pub fn decide(&self, host: &mut dyn Host, pick: &PickResult) -> Decision {
        if pick.admitted {
            Decision::Route(pick.host.clone())
        } else {
            host.increment_counter("ai_lb_rejected", 1);
            Decision::Reject { status: 429, body: REJECT_BODY.to_string() }
        }
    }

    /// Stream end: `-1` for the picked host, exactly once; a pick still in flight is cancelled (it
    /// runs before the cancel on the same connection, or finds the tombstone).
    pub fn on_done(&mut self, host: &mut dyn Host, stream: &mut Stream) {
        let Some(state) = stream.take_data::<PickState>() else { return };
        if state.picked.is_some() {
            self.send_release(host, &state.inflight_key, &state.req_key, 0);
        } else if state.pending.is_some() {
            self.send_release(host, &state.inflight_key, &state.req_key, TOMBSTONE_TTL_S);
        }
    }

    fn send_release(
        &mut self,
        host: &mut dyn Host,
        inflight_key: &str,
        req_key: &str,
        tombstone_ttl_s: u32,
    ) {
        let rel = Release {
            inflight_key: inflight_key.to_string(),
            req_key: req_key.to_string(),
            tombstone_ttl_s,
            failures: 0,
        };
        self.send_release_record(host, rel);
    }

    fn send_release_record(&mut self, host: &mut dyn Host, rel: Release) {
        // Off the request path, and EVAL (not EVALSHA): no NOSCRIPT round trip; the script is small.
        let q = self.release.command(
            &[rel.inflight_key.clone(), rel.req_key.clone()],
            &[rel.tombstone_ttl_s.to_string()],
            true,
        );
        match self.redis.call(host, &q) {
            Ok(token) => {
                self.releases_in_flight.insert(token, rel);
            }
            Err(_) => self.release_failed(host, rel),
        }
    }

    /// A release reply: done if Redis ran it; otherwise (NetworkError, error reply such as NOAUTH
    /// or LOADING, garbage) it may not have run, so it is queued to be sent again.
    fn on_release_reply(&mut self, host: &mut dyn Host, rel: Release, reply: &RedisReply) {
        let ran = match reply {
            RedisReply::Ok(b) => match decode_reply(b) {
                Ok(Frame::Error(msg)) => {
                    self.redis.on_error_reply(&msg);
                    false
                }
                Ok(_) => true,
                Err(_) => false,
            },
            RedisReply::NetworkError => false,
        };
        if ran {
            self.flush_release_retries(host);
        } else {
            self.release_failed(host, rel);
        }
    }

    fn release_failed(&mut self, host: &mut dyn Host, mut rel: Release) {
        rel.failures = rel.failures.saturating_add(1);
        if rel.failures >= MAX_RELEASE_ATTEMPTS || self.release_retry.len() >= MAX_QUEUED_RELEASES {
            host.log(
                LogLevel::Warn,
                &format!(
                    "{}: giving up the release of {} after {} failed sends",
                    self.name, rel.req_key, rel.failures
                ),
            );
            host.increment_counter("ai_lb_release_dropped", 1);
            return;
        }
        self.release_retry.push(rel);
    }

    fn flush_release_retries(&mut self, host: &mut dyn Host) {
        for rel in std::mem::take(&mut self.release_retry) {
            self.send_release_record(host, rel);
        }
    }
}

/// The `global_least_request` policy.
pub struct GlobalLeastRequest {
    picker: Picker,
}

impl GlobalLeastRequest {
    /// Creates the policy from its config.
    pub fn new(config: GlobalLeastRequestConfig) -> Self {
        GlobalLeastRequest {
            picker: Picker::new(config, redis::LEAST_REQUEST_LUA, "global_least_request"),
        }
    }
}

impl Policy for GlobalLeastRequest {
    fn name(&self) -> &'static str {
        "global_least_request"
    }

    fn on_start(&mut self, host: &mut dyn Host) {
        self.picker.redis.init(host);
    }

    fn on_request_headers(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        _end_of_stream: bool,
    ) -> Decision {
        if stream.route.is_empty() || stream.cluster.is_empty() {
            host.log(
                LogLevel::Warn,
                "global_least_request: no route_name/cluster_name; using normal balancing",
            );
            return Decision::Passthrough;
        }
        let Some(hosts) = self.picker.host_args(host) else { return Decision::Passthrough };
        let keys = self.picker.base_keys(host, stream);
        let mut args = self.picker.base_args(host);
        args.extend(hosts);
        self.picker.start(host, stream, keys, args)
    }

    fn on_redis_reply(
        &mut self,
        host: &mut dyn Host,
        stream: Option<&mut Stream>,
        token: u32,
        reply: &RedisReply,
    ) -> Decision {
        match self.picker.on_reply(host, stream, token, reply) {
            Ok(pick) => self.picker.decide(host, &pick),
            Err(d) => d,
        }
    }

    fn on_stream_done(&mut self, host: &mut dyn Host, stream: &mut Stream) {
        self.picker.on_done(host, stream);
    }
}

#[cfg(test)]
#[path = "global_least_request_tests.rs"]
mod tests;
