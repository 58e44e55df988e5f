//! The Redis pick engine shared by `global_least_request` and `prefix_cache`: one script call per
//! request picks a host and adds `+1` to its in-flight count; the `-1` goes out when the stream
//! ends, exactly once, whatever the outcome.
//!
//! Counts that cannot leak. Each plugin VM is an *owner* with a lease in Redis: a sorted set of
//! owner -> expiry (Redis's clock), renewed by a heartbeat every third of `leaseMs` while the VM
//! uses that route+cluster. Its `+1`s are recorded in its own hash (request id -> host); every
//! live VM's heartbeat subtracts the records of owners whose lease ran out and deletes their hash.
//! So the counts of a gateway that was SIGKILLed, ran out of memory or got cut off return to the
//! truth within one lease plus one heartbeat period, with no help from it, and no key correctness
//! depends on has a TTL that eviction could remove. Every pick registers its owner if it is not
//! registered (a carried release whose record was still there proves it; else a read, and a write
//! only then): a pick that Redis runs late, after the reaper removed its owner (a frozen Redis
//! reading the socket of a gateway that died meanwhile), brings the owner back, so its record is
//! reaped one lease later instead of staying forever.
//!
//! Exactly-once release: each pick carries a request id (a counter, unique per owner). An
//! admitted pick writes the chosen host under that id in the owner's hash; a release deletes the
//! record and decrements only if it was there, so a release whose outcome is unknown can be sent
//! again. When the plugin gives up on a pick (Redis
//! timeout, a pick slower than `breakerSlowMs`, client gone while waiting), it sends the same
//! release without a host, "abandoned": if the pick already ran it is undone, and if it has not run
//! yet (a frozen Redis runs it later) a tombstone makes it a no-op.
//!
//! Releases ride on picks: the release of a request that ended while others of this VM on the same
//! route+cluster are still in flight waits in [`Group::ended`] and goes out inside this VM's next
//! pick there (one script call per routed request, and the pick's `+1` netted with the releases
//! per pod). What no pick carried goes out on the next root tick ([`CARRY_FLUSH_MS`] at most), and
//! the release of a VM's last request in flight goes out at once, so an idle VM (and a draining
//! gateway) holds no stale count.
//!
//! A stalled Redis: [`Breaker`] opens after consecutive failed or slow calls; while it is open,
//! requests are decided at once without Redis and releases wait in a bounded queue.
//!
//! Without Redis (an error, a timeout, a slow pick, the breaker open) a request is routed by the
//! pods' metrics when the gateway's health check stores them or `scrapeCluster` lets the plugin
//! scrape them (the `endpoint_metrics` filter chain: queue, KV-cache use); without fresh metrics it
//! takes the gateway's normal balancing, as the Go plugin does.

use super::breaker::{Admission, Breaker};
use super::cache_check::CacheCheck;
use super::latency;
use super::load::{self as load_args, LoadArgs};
use super::{healthy_hosts, Decision, Stream};
use crate::config::{GlobalLeastRequestConfig, LoadAwareConfig};
use crate::host::{Counter, Host, HttpReply, LogLevel, RedisReply, UpstreamHost};
use crate::metrics::router::{MetricsRouter, Ranking};
use crate::redis::{self, decode_reply, Frame, RedisClient, Script};
use rustc_hash::FxHashMap;
use std::collections::HashMap;

/// The shared breaker key's value once a worker's breaker closed because Redis answered it (an
/// open breaker's value is the host-clock ns it opens until, never 0).
const SHARED_BREAKER_CLOSED: u64 = 0;

/// The `Policy` methods the Redis policies hand to their `picker` field: name, start, Redis replies
/// (`$routed` names how the policy counts an admitted pick, see [`Routed`]), metric scrapes, stream
/// end (the release), ticks and slow picks. `$stream_done`, when given, is called with the policy,
/// the host and the stream id at the stream's end, before the picker's release: what the policy keeps
/// per stream goes there. `$after_reply`, when given, is called with the policy, the host and the
/// id of the reply's stream (none for releases and heartbeats) after each Redis reply the picker
/// handled (a pick it answers has its placement by then).
macro_rules! delegate_to_picker {
    ($routed:expr) => {
        $crate::policy::picker::delegate_to_picker!(
            $routed,
            |_: &mut Self, _: &mut dyn $crate::host::Host, _: u32| {}
        );
    };
    ($routed:expr, $stream_done:expr) => {
        $crate::policy::picker::delegate_to_picker!(
            $routed,
            $stream_done,
            |_: &mut Self, _: &mut dyn $crate::host::Host, _: Option<u32>| {}
        );
    };
    ($routed:expr, $stream_done:expr, $after_reply:expr) => {
        fn name(&self) -> &'static str {
            self.picker.name()
        }

        fn on_start(&mut self, host: &mut dyn Host) {
            self.picker.on_start(host);
        }

        fn on_redis_reply(
            &mut self,
            host: &mut dyn Host,
            stream: Option<&mut Stream>,
            token: u32,
            reply: &crate::host::RedisReply,
        ) -> Decision {
            let stream_id = stream.as_deref().map(|s| s.id);
            let decision = self.picker.on_redis_reply(host, stream, token, reply, $routed);
            ($after_reply)(self, host, stream_id);
            decision
        }

        fn on_http_reply(
            &mut self,
            host: &mut dyn Host,
            _stream: Option<&mut Stream>,
            token: u32,
            reply: &crate::host::HttpReply,
        ) -> Decision {
            self.picker.on_http_reply(host, token, reply);
            Decision::Passthrough
        }

        fn on_stream_done(&mut self, host: &mut dyn Host, stream: &mut Stream) {
            ($stream_done)(self, host, stream.id);
            self.picker.on_done(host, stream);
        }

        fn tick_period_ms(&self) -> u32 {
            self.picker.tick_period_ms()
        }

        fn on_tick(&mut self, host: &mut dyn Host) {
            self.picker.on_tick(host);
        }

        fn on_stop(&mut self, host: &mut dyn Host) -> bool {
            self.picker.on_stop(host)
        }

        fn stopped(&self) -> bool {
            self.picker.stopped()
        }

        fn on_pending_tick(
            &mut self,
            host: &mut dyn Host,
            stream: &mut Stream,
        ) -> Option<Decision> {
            self.picker.on_pending_tick(host, stream)
        }
    };
}
pub(crate) use delegate_to_picker;

/// Body of the local 429 reply (same text as the Go plugin).
pub const REJECT_BODY: &str = "Exceeded maximum request limit from ai-load-balancer.";

/// A release whose delivery failed is sent again at most this many times in all (failures while
/// the breaker is open are not counted: the release waits for Redis instead).
const MAX_RELEASE_ATTEMPTS: u32 = 10;
/// At most this many releases wait for Redis to come back (bounded memory per worker).
const MAX_QUEUED_RELEASES: usize = 16_384;
/// At most this many key writes wait for Redis to come back (each about 150 bytes): the records of
/// stored responses made while the breaker was open or Redis did not answer, the newest kept.
const MAX_WAITING_WRITES: usize = 4096;
/// A finished request's release waits at most about this long for a pick to carry it: the root tick
/// runs at least this often and sends what no pick carried.
pub const CARRY_FLUSH_MS: u32 = 100;
/// A pick carries at most this many releases, and a release call at most this many (bounded
/// script arguments; the rest go in the next call).
const MAX_CARRIED: usize = 32;
/// A route+cluster this VM picked in gets heartbeats (which also reap dead owners, so a dead
/// gateway's counts return even when no request comes) until it has been idle this long.
const GROUP_IDLE_NS: u64 = 600 * 1_000_000_000;

/// A route+cluster's shared state as this VM uses it.
#[derive(Debug)]
struct Group {
    inflight_key: String,
    /// Admitted picks not released yet.
    held: u32,
    last_pick_ns: u64,
    /// Every host of the cluster (healthy or not) at the last pick: the cleanup keeps these.
    hosts: Vec<String>,
    /// Admitted requests that ended (request id, pod) and whose release waits for a pick to carry
    /// it.
    ended: Vec<(String, String)>,
}

/// The keys of one route+cluster's shared state, for one owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateKeys {
    /// Hash host -> in-flight count.
    pub inflight: String,
    /// Time of the last cleanup of hosts that left the cluster.
    pub last_clean: String,
    /// Sorted set owner -> lease expiry.
    pub owners: String,
    /// This owner's hash.
    pub owner: String,
}

impl StateKeys {
    /// The keys of `route`+`cluster` for `owner`.
    pub fn new(route: &str, cluster: &str, owner: &str) -> StateKeys {
        StateKeys {
            inflight: redis::inflight_key(route, cluster),
            last_clean: redis::last_clean_key(route, cluster),
            owners: redis::owners_key(route, cluster),
            owner: redis::owner_key(route, cluster, owner),
        }
    }
}

/// What a policy adds to the common pick call.
#[derive(Debug, Clone, PartialEq)]
pub enum PickKind {
    /// `least_request.lua`.
    LeastRequest,
    /// `prefix_cache.lua`.
    Prefix {
        /// Chain values (upper-case hex), shortest prefix first.
        chain: Vec<String>,
        /// `redisKeyTTL`.
        ttl_s: u64,
        /// The gateway's wall clock (unix s): the time written keys are stamped with.
        now_s: u64,
        /// `hitLoadFactor` (not sent for a pinned pick, which has no load guard).
        hit_load_factor: f64,
        /// `loadAware`: `None` when off; [`Picker::start`] fills in the pods' loads, or sets
        /// `None` when some pod has no fresh metrics (decided as with it off).
        load: Option<Box<LoadAware>>,
        /// The request must reach the pod holding its chain's first key (see [`Pin`]).
        pin: Option<Pin>,
    },
}

/// A pick that must reach the pod holding its chain's first key: `prefix_cache`'s request that
/// continues a stored response, which another pod may answer with 404. Counted as followed
/// (`ai_lb_prefix_response_followed`) or not (`ai_lb_prefix_response_unknown`) once decided.
///
/// When the gateway's own record names a healthy pod, the pick's only candidate is that pod: a
/// response is made once, on one pod, so the record is right wherever Redis lost the key (its
/// `SET` skipped while the breaker was open, Redis restarted empty, the key evicted), and the
/// pick's miss writes the key again. Otherwise the script never writes the first key on a miss
/// (script argument `pin`): the pod a miss chooses would answer 404, and a key naming it would send
/// every later request for that response there.
#[derive(Debug, Clone, PartialEq)]
pub struct Pin {
    /// The pod the gateway's own record names (see [`super::response_id::recall`]): the pick's
    /// only candidate, and where the request goes when Redis cannot decide, when it is healthy.
    pub fallback_pod: Option<String>,
}

impl Pin {
    /// Whether a pick over `healthy` candidates is held to the recorded pod.
    fn holds_to_record(&self, healthy: &[String]) -> bool {
        matches!((self.fallback_pod.as_ref(), healthy), (Some(pod), [only]) if pod == only)
    }
}

/// `loadAware` in a pick: its thresholds, then (filled in by [`Picker::start`]) the pods' loads.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadAware {
    /// The thresholds.
    pub config: LoadAwareConfig,
    /// The script's load arguments, once known.
    pub args: Option<LoadArgs>,
    /// Each pod's recent decode time per byte (`prefix_cache`'s [`super::latency::PodSpeed`]),
    /// compared over the healthy pods when the pick starts.
    pub decode_averages: Vec<latency::DecodeAverage>,
    /// Each pod's prefill backlog from this worker, bytes (`prefix_cache`'s
    /// [`super::prefill::PrefillBacklog`]).
    pub prefill_backlog: Vec<(String, u64)>,
    /// What giving up each matched prefix costs a diverted hit, in requests: entry `i` is the
    /// bytes of the prompt's first `i + 1` blocks over `divertPrefixBytes` (one per chain value;
    /// empty when `divertPrefixBytes` is 0).
    pub divert_costs: Vec<u64>,
}

/// One pick script call, typed. [`PickCall::keys_args`] is the one place that writes KEYS and ARGV
/// in the order the scripts' headers (`lua/pick_settle.lua`, `lua/least_request.lua`,
/// `lua/prefix_cache.lua`) read them.
#[derive(Debug, Clone, PartialEq)]
pub struct PickCall {
    /// The route+cluster's keys for this owner (the scripts get the in-flight key and derive the
    /// others from it).
    pub keys: StateKeys,
    /// `maxRequestCount` (0 = no limit).
    pub max_inflight: u64,
    /// `leaseMs` (the lease a pick registers its owner with when it is not registered).
    pub lease_ms: u32,
    /// This VM's owner id.
    pub owner_id: String,
    /// This request's id (its pick record), unique per owner.
    pub request_id: String,
    /// This owner's ended requests (request id, pod) whose releases the pick carries.
    pub ended: Vec<(String, String)>,
    /// Healthy hosts, shuffled (the script takes the first minimum).
    pub healthy: Vec<String>,
    /// Policy-specific part.
    pub kind: PickKind,
}

impl PickCall {
    /// KEYS and ARGV of the script call.
    pub fn keys_args(&self) -> (Vec<String>, Vec<String>) {
        let keys = vec![self.keys.inflight.clone()];
        let mut ids = self.request_id.clone();
        for (id, pod) in &self.ended {
            ids.push(',');
            ids.push_str(id);
            ids.push('=');
            ids.push_str(pod);
        }
        let mut args = vec![
            self.max_inflight.to_string(),
            self.lease_ms.to_string(),
            self.owner_id.clone(),
            ids,
        ];
        match &self.kind {
            PickKind::Prefix { chain, ttl_s, now_s, hit_load_factor, load, pin } => {
                args.reserve(5 + chain.len() + self.healthy.len());
                args.push(ttl_s.to_string());
                args.push(now_s.to_string());
                // A stored response's pick has no load guard, and keeps its first key unwritten
                // unless it is held to the pod this gateway recorded (see `Pin`).
                args.push(match pin {
                    Some(pin) if !pin.holds_to_record(&self.healthy) => "pin".to_string(),
                    Some(_) => "0".to_string(),
                    None => format!("{hit_load_factor}"),
                });
                args.push(chain.len().to_string());
                args.extend(chain.iter().cloned());
                args.push(self.healthy.len().to_string());
                args.extend(self.healthy.iter().cloned());
                if let Some((load, args_of_load)) =
                    load.as_ref().and_then(|l| Some((l, l.args.as_ref()?)))
                {
                    args_of_load.args(&self.healthy, &mut args);
                    if load.config.divert_prefix_bytes > 0 {
                        args.push(divert_cost_steps(&load.divert_costs));
                    }
                }
            }
            PickKind::LeastRequest => args.extend(self.healthy.iter().cloned()),
        }
        (keys, args)
    }
}

/// The divert costs (non-decreasing, one per chain length) as the script reads them: only where
/// the cost rises, `{chain length}:{cost}` joined by ',' (a 12000-token document and a short
/// question is `1:11`; a short chat is empty), so a long conversation sends about one step per
/// `divertPrefixBytes` of it, not a number per block.
fn divert_cost_steps(costs: &[u64]) -> String {
    let mut steps = Vec::new();
    let mut last = 0;
    for (i, &cost) in costs.iter().enumerate() {
        if cost > last {
            steps.push(format!("{}:{cost}", i + 1));
            last = cost;
        }
    }
    steps.join(",")
}

/// One `release.lua` call, typed: [`ReleaseCall::keys_args`] is the one place that writes KEYS
/// and ARGV in the order the script's header reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseCall {
    /// The route+cluster's in-flight hash.
    pub inflight_key: String,
    /// The picking owner's id.
    pub owner_id: String,
    /// Admitted requests that ended: (request id, the pod it was admitted to).
    pub ended: Vec<(String, String)>,
    /// The id of a pick the plugin gave up waiting for: undone if it ran, else tombstoned.
    pub abandoned: Option<String>,
}

impl ReleaseCall {
    /// KEYS and ARGV of the script call.
    pub fn keys_args(&self) -> (Vec<String>, Vec<String>) {
        let ended: Vec<String> = self.ended.iter().map(|(id, pod)| format!("{id}={pod}")).collect();
        let mut args = vec![self.owner_id.clone(), ended.join(",")];
        args.extend(self.abandoned.iter().cloned());
        (vec![self.inflight_key.clone()], args)
    }

    /// How many requests' releases this call holds.
    pub fn len(&self) -> usize {
        self.ended.len() + usize::from(self.abandoned.is_some())
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One `heartbeat.lua` call, typed (see [`ReleaseCall`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatCall {
    /// The route+cluster's in-flight hash.
    pub inflight_key: String,
    /// `leaseMs`.
    pub lease_ms: u32,
    /// This VM's owner id.
    pub owner_id: String,
    /// `cleanInterval` in seconds (0 = never).
    pub clean_interval_s: u64,
    /// The request ids whose records must stay: picks not answered yet, admitted requests not
    /// ended, and ended ones whose release is still on its way. The script releases any other
    /// record of the owner.
    pub live: Vec<String>,
    /// Every host of the cluster (healthy or not): the cleanup keeps these.
    pub hosts: Vec<String>,
}

impl HeartbeatCall {
    /// KEYS and ARGV of the script call.
    pub fn keys_args(&self) -> (Vec<String>, Vec<String>) {
        let mut args = Vec::with_capacity(4 + self.hosts.len());
        args.push(self.lease_ms.to_string());
        args.push(self.owner_id.clone());
        args.push(self.clean_interval_s.to_string());
        args.push(self.live.join(","));
        args.extend(self.hosts.iter().cloned());
        (vec![self.inflight_key.clone()], args)
    }
}

/// How a policy counts a request its pick admitted.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    /// The counter incremented by one.
    pub counter: Counter,
    /// The decision header's value.
    pub decision: String,
    /// `Some(predicted hit)`: check the prediction against the engine's cache report.
    pub predicted_hit: Option<bool>,
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
    /// A prefix's pod was passed over for load (prefix_cache only).
    pub diverted: bool,
    /// The diverted pod became a holder of the prefix (prefix_cache with `loadAware` only).
    pub holder_added: bool,
    /// The request had a prompt whose prefix the pick looked up (prefix_cache: at least one chain
    /// key); filled in from the pick's own call, not from the reply.
    pub had_prompt: bool,
}

/// Parses `{host, count, admitted[, matched, diverted[, holder added]]}`.
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
    let diverted = int(it.next()) == Some(1);
    let holder_added = int(it.next()) == Some(1);
    if host.is_empty() {
        return None;
    }
    Some(PickResult { host, count, admitted, matched, diverted, holder_added, had_prompt: false })
}

/// Fisher–Yates shuffle with the host's randomness: the script takes the first minimum, so ties
/// are broken uniformly at random.
pub(crate) fn shuffle(host: &mut dyn Host, v: &mut [String]) {
    let n = v.len();
    for i in (1..n).rev() {
        let j = (host.random_u64() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

/// Why a request falls back to normal balancing after its pick was started (or instead of it).
#[derive(Debug, Clone, PartialEq)]
pub enum Fallback {
    /// The pick could not be sent.
    SendFailed,
    /// NetworkError reply: connection failure or the host's Redis timeout.
    NetworkError,
    /// No reply within `breakerSlowMs`.
    Slow,
    /// The breaker is open.
    BreakerOpen,
    /// Undecodable or unexpected reply (the pick may have run).
    BadReply(String),
    /// An error reply such as NOAUTH, LOADING or a script error (the pick did not complete).
    ErrorReply(String),
}

impl Fallback {
    fn counter(&self) -> Counter {
        match self {
            Fallback::SendFailed | Fallback::BadReply(_) | Fallback::ErrorReply(_) => {
                Counter::FallbackRedisError
            }
            Fallback::NetworkError => Counter::FallbackRedisTimeout,
            Fallback::Slow => Counter::FallbackRedisSlow,
            Fallback::BreakerOpen => Counter::FallbackBreakerOpen,
        }
    }
    /// The decision header's value for a request decided this way.
    fn label(&self) -> &'static str {
        self.counter().label()
    }
    fn describe(&self) -> String {
        match self {
            Fallback::SendFailed => "redis call could not be sent".into(),
            Fallback::NetworkError => "redis network error or timeout".into(),
            Fallback::Slow => "redis pick too slow, given up".into(),
            Fallback::BreakerOpen => "redis breaker open".into(),
            Fallback::BadReply(why) => format!("redis reply unusable ({why})"),
            Fallback::ErrorReply(msg) => format!("redis error reply {msg:?}"),
        }
    }
    /// Whether the pick may still run, or have run, so that it must be cancelled.
    fn may_have_run(&self) -> bool {
        matches!(self, Fallback::NetworkError | Fallback::Slow | Fallback::BadReply(_))
    }
}

/// What a Redis reply means for the policy that made the call.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplyOutcome {
    /// The pick ran: route (or 429 when not admitted).
    Picked(PickResult),
    /// Not a pick reply a request waits for (a release or heartbeat reply, an abandoned pick's
    /// late reply).
    NotForRequest,
    /// The script was not cached on Redis: the pick was sent again with EVAL, under this token.
    Resent(u32),
    /// Redis could not decide.
    Fallback(Fallback),
}

/// Per-request state of a pick.
#[derive(Debug)]
pub(crate) struct PickState {
    keys: StateKeys,
    owner_id: String,
    request_id: String,
    /// Script keys and args, kept to resend with EVAL after NOSCRIPT.
    call_keys: Vec<String>,
    call_args: Vec<String>,
    /// Token of the pick call in flight, and when it was sent.
    pending: Option<(u32, u64)>,
    /// EVAL fallback already tried.
    used_eval: bool,
    /// The host that got the `+1` (released exactly once at stream end).
    picked: Option<String>,
    /// Ended requests (request id, pod) whose releases the pick in flight carries: back to the
    /// group's queue unless the pick is known to have run.
    carried: Vec<(String, String)>,
    /// The prediction to check against the engine's cache report (`prefix_cache`).
    cache_check: Option<CacheCheck>,
    /// See [`PickResult::had_prompt`].
    had_prompt: bool,
    /// Prefix blocks the picked pod holds (an admitted hit not diverted; else 0).
    cached_blocks: usize,
    /// See [`Pin`].
    pin: Option<Pin>,
}

/// One release (`-1`, or the cancel of an abandoned pick). `release.lua` is idempotent per pick
/// record, so a release whose outcome is unknown can always be sent again.
#[derive(Debug, Clone)]
struct Release {
    call: ReleaseCall,
    /// Sends that failed so far while the breaker was closed.
    failures: u32,
    use_eval: bool,
}

/// A root-level call in flight (nothing waits for it).
#[derive(Debug)]
enum RootCall {
    Release(Release),
    Heartbeat {
        owners_key: String,
        use_eval: bool,
    },
    Probe,
    /// A key written for a policy ([`Picker::write_key`]).
    Write(KeyWrite),
}

/// A `SET key value EX ttl_s` for a policy ([`Picker::write_key`]).
#[derive(Debug)]
struct KeyWrite {
    key: String,
    value: String,
    ttl_s: u64,
}

/// The shared pick machinery.
pub(crate) struct Picker {
    pub redis: RedisClient,
    pub config: GlobalLeastRequestConfig,
    script: Script,
    release: Script,
    heartbeat: Script,
    /// Name for logs.
    name: &'static str,
    /// This VM's owner id (random, made on first use).
    owner: Option<String>,
    /// Request ids are this counter (unique per owner, short on the wire).
    next_request: u64,
    breaker: Breaker,
    /// When Redis last answered any call of this picker (host clock, ns; 0 = never): a slow pick
    /// sent after it waits on a Redis that answers nothing (see [`Breaker::on_stall`]).
    last_answer_ns: u64,
    /// The in-flight hash of the last pick that failed or was too slow: the breaker's probe reads
    /// it (see [`Picker::send_probe`]).
    probe_key: Option<String>,
    /// The shared-data key through which this gateway's workers tell each other that the breaker
    /// on this Redis opened (value: until when, host-clock ns, in decimal) or closed again
    /// ([`SHARED_BREAKER_CLOSED`]). Read at every pick's start, so made once.
    breaker_key: String,
    /// Route+clusters used, by owners key: their leases are renewed by heartbeats.
    groups: HashMap<String, Group>,
    last_heartbeat_ns: u64,
    /// Releases, heartbeats and probes sent and not yet answered, by token.
    root_calls: FxHashMap<u32, RootCall>,
    /// Releases waiting for Redis: sent as soon as a reply shows it answers again.
    release_queue: Vec<Release>,
    /// Key writes waiting for Redis: sent when it answers again.
    waiting_writes: std::collections::VecDeque<KeyWrite>,
    /// The pods' metrics, which decide when Redis cannot.
    metrics: MetricsRouter,
    /// Each live stream's pick, by stream id (from the pick's start to the stream's end).
    picks: FxHashMap<u32, PickState>,
}

impl Picker {
    pub fn new(
        config: GlobalLeastRequestConfig,
        source: &'static str,
        name: &'static str,
    ) -> Picker {
        let redis = RedisClient::new(config.redis.clone());
        Picker {
            metrics: MetricsRouter::new(&config.metrics, Ranking::filter_chain()),
            breaker_key: format!("ai-lb/breaker/{}", redis.call_cluster()),
            redis,
            breaker: Breaker::new(config.state.breaker_failures, config.state.breaker_open_ms),
            last_answer_ns: 0,
            probe_key: None,
            config,
            script: Script::new(source),
            release: Script::new(redis::RELEASE_LUA),
            heartbeat: Script::new(redis::HEARTBEAT_LUA),
            name,
            owner: None,
            next_request: 0,
            groups: HashMap::new(),
            last_heartbeat_ns: 0,
            root_calls: FxHashMap::default(),
            release_queue: Vec::new(),
            waiting_writes: std::collections::VecDeque::new(),
            picks: FxHashMap::default(),
        }
    }

    /// The policy's name, for logs.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Whether the stream names the route and cluster whose shared state a pick uses (logged when
    /// not: the request then takes normal balancing).
    pub fn has_group(&self, host: &dyn Host, stream: &Stream) -> bool {
        let named = !stream.route.is_empty() && !stream.cluster.is_empty();
        if !named {
            host.log(
                LogLevel::Warn,
                &format!("{}: no route_name/cluster_name; using normal balancing", self.name),
            );
        }
        named
    }

    /// Plugin start: the Redis client, and the metrics scraper if there is one.
    pub fn on_start(&mut self, host: &mut dyn Host) {
        self.redis.init(host);
        self.metrics.on_start(host);
    }

    /// The reply to an HTTP call (a metrics scrape).
    pub fn on_http_reply(&mut self, host: &mut dyn Host, token: u32, reply: &HttpReply) {
        self.metrics.on_http_reply(host, token, reply);
    }

    /// Tick period the picker needs: heartbeats every third of the lease, releases no pick carried
    /// sent within [`CARRY_FLUSH_MS`], and slow picks noticed within a quarter of `breakerSlowMs`
    /// (a request that finds Redis frozen waits `breakerSlowMs` and at most that much more).
    pub fn tick_period_ms(&self) -> u32 {
        let heartbeat_or_flush = (self.config.state.lease_ms / 3).min(CARRY_FLUSH_MS);
        let slow = self.config.state.breaker_slow_ms / 4;
        let mut period = if slow > 0 { heartbeat_or_flush.min(slow) } else { heartbeat_or_flush };
        let scrape = self.metrics.tick_period_ms();
        if scrape > 0 {
            period = period.min(scrape);
        }
        period.max(20)
    }

    fn owner_id(&mut self, host: &mut dyn Host) -> String {
        if let Some(o) = &self.owner {
            return o.clone();
        }
        // 48 random bits: two VMs of one route colliding is about n^2 / 2^49 (2e-9 for 1000 VMs).
        let o = format!("{:012x}", host.random_u64() >> 16);
        self.owner = Some(o.clone());
        o
    }

    /// Starts a pick for `stream`: `Pending`; `Passthrough` when there is no healthy host; decided
    /// without Redis when the breaker is open or the call could not be sent.
    pub fn start(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        mut kind: PickKind,
    ) -> Decision {
        let now_ms = host.now_nanos() / 1_000_000;
        let mut list = self.metrics.host_list(host, &stream.cluster, now_ms);
        let Some((mut healthy, others)) = healthy_hosts(list.as_deref(), host, self.name) else {
            return Decision::Passthrough;
        };
        let pin = match &kind {
            PickKind::Prefix { pin, .. } => pin.clone(),
            PickKind::LeastRequest => None,
        };
        // Another worker of this gateway may have found Redis stalled since this one's last tick:
        // this request must not send its pick into the stall.
        self.follow_shared_breaker(host);
        // While the breaker is open or its probe is out, requests are decided at once. The probe
        // is the tick's PING, never a request: a request carrying it would wait `breakerSlowMs`
        // on a still frozen Redis, once per `breakerOpenMs` per worker.
        if !self.breaker.is_closed() {
            return self.without_redis(host, stream, &Fallback::BreakerOpen, list, pin);
        }
        if let PickKind::Prefix { load: load @ Some(_), .. } = &mut kind {
            // The host list (with the health check's metrics bodies) is read once per request:
            // taken here; a failed send below reads it again.
            let args = list
                .take()
                .and_then(|l| self.metrics.gather(host, &stream.cluster, l, now_ms))
                .and_then(|pods| {
                    load.as_ref().and_then(|l| {
                        load_args::load_args(&l.config, &pods).map(|a| {
                            let a = a.add_prefill_backlog(&l.config, &l.prefill_backlog);
                            if l.decode_averages.is_empty() {
                                return a;
                            }
                            let names: Vec<&str> = healthy.iter().map(String::as_str).collect();
                            let slowness = latency::relative_slowness(&l.decode_averages, &names);
                            a.add_slowness(&l.config, &slowness)
                        })
                    })
                });
            match (args, load.as_mut()) {
                (Some(args), Some(l)) => l.args = Some(args),
                _ => {
                    host.increment_counter(Counter::PrefixLoadUnknown, 1);
                    *load = None;
                }
            }
        }
        let mut in_cluster = Vec::with_capacity(healthy.len() + others.len());
        in_cluster.extend(healthy.iter().cloned());
        in_cluster.extend(others);
        if let Some(pod) = pin.as_ref().and_then(|p| p.fallback_pod.as_ref()) {
            if healthy.contains(pod) {
                healthy = vec![pod.clone()];
            }
        }
        shuffle(host, &mut healthy);
        let owner_id = self.owner_id(host);
        self.next_request += 1;
        let keys = StateKeys::new(&stream.route, &stream.cluster, &owner_id);
        let now = host.now_nanos();
        let group = self.groups.entry(keys.owners.clone()).or_insert_with(|| Group {
            inflight_key: keys.inflight.clone(),
            held: 0,
            last_pick_ns: 0,
            hosts: Vec::new(),
            ended: Vec::new(),
        });
        group.hosts = in_cluster;
        // A pick in flight keeps its group (and heartbeats) alive, as a reply would.
        group.last_pick_ns = now;
        let carry = group.ended.len().min(MAX_CARRIED);
        let ended: Vec<(String, String)> = group.ended.drain(..carry).collect();
        let call = PickCall {
            keys,
            max_inflight: self.config.max_request_count,
            lease_ms: self.config.state.lease_ms,
            owner_id,
            request_id: format!("{:x}", self.next_request),
            ended,
            healthy,
            kind,
        };
        let (call_keys, call_args) = call.keys_args();
        let had_prompt = matches!(&call.kind, PickKind::Prefix { chain, .. } if !chain.is_empty());
        let query = self.script.command(&call_keys, &call_args, false);
        match self.redis.call(host, &query) {
            Ok(token) => {
                self.picks.insert(
                    stream.id,
                    PickState {
                        keys: call.keys,
                        owner_id: call.owner_id,
                        request_id: call.request_id,
                        call_keys,
                        call_args,
                        pending: Some((token, now)),
                        used_eval: false,
                        picked: None,
                        carried: call.ended,
                        cache_check: None,
                        had_prompt,
                        cached_blocks: 0,
                        pin,
                    },
                );
                Decision::Pending(token)
            }
            Err(_) => {
                self.requeue_ended(host, &call.keys.owners, call.ended);
                self.redis_failed(host);
                self.without_redis(host, stream, &Fallback::SendFailed, list, pin)
            }
        }
    }

    /// Handles a reply to any call of this picker.
    pub fn on_reply(
        &mut self,
        host: &mut dyn Host,
        stream: Option<&mut Stream>,
        token: u32,
        reply: &RedisReply,
    ) -> ReplyOutcome {
        if let Some(call) = self.root_calls.remove(&token) {
            self.on_root_reply(host, call, reply);
            return ReplyOutcome::NotForRequest;
        }
        // A stream that ended while its pick was in flight already sent the cancel (on_done).
        let Some(stream) = stream else { return ReplyOutcome::NotForRequest };
        match self.picks.get_mut(&stream.id) {
            Some(state) if state.pending.map(|(t, _)| t) == Some(token) => state.pending = None,
            // The late reply of an abandoned pick.
            _ => return ReplyOutcome::NotForRequest,
        }
        let frame = match reply {
            RedisReply::NetworkError => {
                if let Some(s) = self.picks.get(&stream.id) {
                    self.probe_key = Some(s.keys.inflight.clone());
                }
                self.redis_failed(host);
                return self.fallback(host, stream, Fallback::NetworkError);
            }
            RedisReply::Ok(bytes) => match decode_reply(bytes) {
                Ok(f) => f,
                Err(e) => return self.fallback(host, stream, Fallback::BadReply(e)),
            },
        };
        self.redis_answered(host);
        if redis::is_noscript(&frame) {
            // The script is not cached on this Redis (restart, failover, new shard): send it once.
            let resend = self.picks.get_mut(&stream.id).filter(|s| !s.used_eval).map(|s| {
                s.used_eval = true;
                self.script.command(&s.call_keys, &s.call_args, true)
            });
            if let Some(query) = resend {
                return match self.redis.call(host, &query) {
                    Ok(t) => {
                        if let Some(s) = self.picks.get_mut(&stream.id) {
                            s.pending = Some((t, host.now_nanos()));
                        }
                        ReplyOutcome::Resent(t)
                    }
                    Err(_) => self.fallback(host, stream, Fallback::SendFailed),
                };
            }
        }
        if let Frame::Error(msg) = &frame {
            self.redis.on_error_reply(msg);
            return self.fallback(host, stream, Fallback::ErrorReply(msg.clone()));
        }
        // Redis answers: releases that waited can go out (before this stream's own).
        self.flush_release_queue(host);
        let Some(mut pick) = parse_pick(&frame) else {
            return self.fallback(host, stream, Fallback::BadReply("unexpected reply".into()));
        };
        let now = host.now_nanos();
        if let Some(state) = self.picks.get_mut(&stream.id) {
            pick.had_prompt = state.had_prompt;
            // The pick ran: so did the releases it carried.
            state.carried.clear();
            if let Some(group) = self.groups.get_mut(&state.keys.owners) {
                group.last_pick_ns = now;
                if pick.admitted {
                    group.held += 1;
                }
            }
            if pick.admitted {
                state.picked = Some(pick.host.clone());
                state.cached_blocks =
                    if pick.diverted { 0 } else { usize::try_from(pick.matched).unwrap_or(0) };
            }
        }
        // Debug, as the Go plugin logs it: one line per routed request at the gateway's default
        // level (info) would flood a busy gateway's log; the decision counters are the
        // always-on view.
        if self.config.enable_detail_log {
            host.log(
                LogLevel::Debug,
                &format!(
                    "{}: route={} cluster={} host={} inflight={} admitted={} matched={}",
                    self.name,
                    stream.route,
                    stream.cluster,
                    pick.host,
                    pick.count,
                    pick.admitted,
                    pick.matched
                ),
            );
        }
        ReplyOutcome::Picked(pick)
    }

    /// A Redis reply to one of this picker's calls: the decision for the stream waiting for it
    /// (see [`Picker::decide`]); `routed` says how the policy counts an admitted pick.
    pub fn on_redis_reply(
        &mut self,
        host: &mut dyn Host,
        mut stream: Option<&mut Stream>,
        token: u32,
        reply: &RedisReply,
        routed: fn(&mut dyn Host, &PickResult) -> Routed,
    ) -> Decision {
        let outcome = self.on_reply(host, stream.as_deref_mut(), token, reply);
        if let (ReplyOutcome::Picked(pick), Some(s)) = (&outcome, stream.as_deref_mut()) {
            if let Some(pin) = self.picks.get(&s.id).and_then(|state| state.pin.as_ref()) {
                // Reached the pod holding the first key or the recorded one, or not (a miss, a
                // 429's other pod).
                let recorded = pin.fallback_pod.as_deref() == Some(pick.host.as_str());
                let followed = pick.admitted && (recorded || (!pick.diverted && pick.matched > 0));
                host.increment_counter(
                    if followed {
                        Counter::PrefixResponseFollowed
                    } else {
                        Counter::PrefixResponseUnknown
                    },
                    1,
                );
            }
            if pick.admitted {
                let r = routed(host, pick);
                host.increment_counter(r.counter, 1);
                s.decision = Some(r.decision);
                if let Some(hit) = r.predicted_hit {
                    self.check_cache(s, hit);
                }
            }
        }
        self.decide(host, stream, outcome)
    }

    /// Every fallback after a pick was sent goes through here: cancel the pick (it may still run
    /// later). [`Picker::decide`] then decides without Redis.
    fn fallback(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        why: Fallback,
    ) -> ReplyOutcome {
        let Some(state) = self.picks.get_mut(&stream.id) else {
            return ReplyOutcome::Fallback(why);
        };
        state.pending = None;
        // Whether the carried releases ran is not known: they go again (a release is idempotent).
        let carried = std::mem::take(&mut state.carried);
        let owners_key = state.keys.owners.clone();
        let cancel = why.may_have_run().then(|| ReleaseCall {
            inflight_key: state.keys.inflight.clone(),
            owner_id: state.owner_id.clone(),
            ended: Vec::new(),
            abandoned: Some(state.request_id.clone()),
        });
        self.requeue_ended(host, &owners_key, carried);
        if let Some(call) = cancel {
            self.send_release(host, Release { call, failures: 0, use_eval: false });
        }
        ReplyOutcome::Fallback(why)
    }

    /// `stream`'s [`Pin`], while its pick lives.
    fn pin_of(&self, stream: u32) -> Option<Pin> {
        self.picks.get(&stream).and_then(|s| s.pin.clone())
    }

    /// Every request Redis could not decide comes here: a pinned one to its pod when the gateway's
    /// own record names a healthy one; else routed by the pods' metrics when they are known, else
    /// normal balancing; logged and counted either way. `list` is the cluster's host list when
    /// this callback already has it.
    fn without_redis(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        why: &Fallback,
        list: Option<Vec<UpstreamHost>>,
        pin: Option<Pin>,
    ) -> Decision {
        host.increment_counter(why.counter(), 1);
        let now_ms = host.now_nanos() / 1_000_000;
        let list = list.or_else(|| self.metrics.host_list(host, &stream.cluster, now_ms));
        // While the breaker is open every request comes here: its opening was logged once.
        let level = if *why == Fallback::BreakerOpen { LogLevel::Debug } else { LogLevel::Warn };
        if let Some(pin) = pin {
            let healthy =
                |pod: &String| list.iter().flatten().any(|h| h.address == *pod && h.is_healthy());
            if let Some(pod) = pin.fallback_pod.filter(healthy) {
                host.log(
                    level,
                    &format!(
                        "{}: {}; routed to {pod}, which made the stored response",
                        self.name,
                        why.describe()
                    ),
                );
                host.increment_counter(Counter::PrefixResponseFollowed, 1);
                stream.decision = Some(format!("{}; by=stored-response", why.label()));
                return Decision::Route(pod);
            }
            host.increment_counter(Counter::PrefixResponseUnknown, 1);
        }
        let pod = list
            .and_then(|list| self.metrics.gather(host, &stream.cluster, list, now_ms))
            .and_then(|pods| self.metrics.choose(host, stream.id, &pods, "", now_ms));
        match pod {
            Some(pod) => {
                host.log(
                    level,
                    &format!("{}: {}; routed by pod metrics to {pod}", self.name, why.describe()),
                );
                host.increment_counter(Counter::RedisDownRoutedByMetrics, 1);
                stream.decision = Some(format!("{}; by=metrics", why.label()));
                Decision::Route(pod)
            }
            None => {
                host.log(
                    level,
                    &format!("{}: {}; using normal balancing", self.name, why.describe()),
                );
                stream.decision = Some(why.label().to_string());
                Decision::Passthrough
            }
        }
    }

    /// Follows an open breaker of another worker of this gateway on the same Redis (at each root
    /// tick, for the picks waiting, and at each pick's start): each worker would otherwise find a
    /// frozen Redis with its own slow picks, and every request that arrives while they wait waits
    /// with them.
    ///
    /// The other way round too: a worker whose breaker closes because Redis answered while its
    /// probe was out writes 0 (closed), and an open breaker reading it closes without waiting for
    /// its own probe. Until then every worker that followed refuses for the whole `breakerOpenMs`,
    /// though a brief pause (a cluster failover, a short fork) may be long over; it could not find
    /// out itself, as it sends Redis nothing while open.
    fn follow_shared_breaker(&mut self, host: &mut dyn Host) {
        let (value, _) = host.get_shared_data(&self.breaker_key);
        let until = value
            .and_then(|v| String::from_utf8(v).ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        let Some(until) = until else { return };
        if until == SHARED_BREAKER_CLOSED && !self.breaker.is_closed() {
            // A probe of its own still out is answered in time (or fails, one failure).
            self.breaker.on_success(host.now_nanos());
            host.log(
                LogLevel::Info,
                &format!(
                    "{}: redis answers another worker of this gateway again: breaker closed",
                    self.name
                ),
            );
            self.flush_all_ended(host);
            self.flush_writes(host);
            return;
        }
        if self.breaker.follow(host.now_nanos(), until) {
            host.log(
                LogLevel::Info,
                &format!(
                    "{}: redis breaker open in another worker of this gateway: deciding without \
                     redis here too, then probing",
                    self.name
                ),
            );
        }
    }

    /// A Redis call failed or was too slow: one step towards opening the breaker (shared with
    /// the gateway's other workers when it opens).
    fn redis_failed(&mut self, host: &mut dyn Host) {
        let probing = self.breaker.is_probing();
        if self.breaker.on_failure(host.now_nanos()) {
            if let Some(until) = self.breaker.open_until() {
                self.breaker_opened(host, until);
            }
            let why = if probing {
                // The probe failed, usually with every call on the connection when the Redis
                // timeout closed it.
                "its probe failed".to_string()
            } else {
                format!("{} failed or slow calls", self.config.state.breaker_failures)
            };
            host.log(
                LogLevel::Warn,
                &format!(
                    "{}: redis breaker open after {why}: deciding without redis for {} ms, then \
                     probing",
                    self.name, self.config.state.breaker_open_ms
                ),
            );
        }
    }

    /// A pick was given up as slow while Redis answered nothing since it was sent: the breaker
    /// opens at once (shared with the gateway's other workers), not after `breakerFailures` such
    /// picks, each of which would make its request and every request arriving meanwhile wait
    /// `breakerSlowMs` on the same stall. Its probe goes out at once, queued behind the stalled
    /// calls: the breaker closes as soon as Redis answers again (see [`Breaker::on_stall`]).
    fn redis_stalled(&mut self, host: &mut dyn Host) {
        let Some(follow_until) = self.breaker.on_stall(host.now_nanos()) else {
            // Disabled (`breakerFailures` 0) or already open.
            return;
        };
        self.breaker_opened(host, follow_until);
        let until = if self.breaker.is_probing() {
            "until it answers again".to_string()
        } else {
            format!(
                "for {} ms, then probing (it stalled again soon after closing)",
                self.config.state.breaker_open_ms
            )
        };
        host.log(
            LogLevel::Warn,
            &format!(
                "{}: redis answered nothing for {} ms: breaker open, deciding without redis {until}",
                self.name, self.config.state.breaker_slow_ms
            ),
        );
        if self.breaker.is_probing() {
            self.send_probe(host);
        }
    }

    /// The breaker just opened: tell the gateway's other workers until when to hold theirs open,
    /// and count it.
    fn breaker_opened(&mut self, host: &mut dyn Host, until_ns: u64) {
        // The other workers follow at their next tick or request (a failed write only costs them
        // their own detection).
        let _ = host.set_shared_data(&self.breaker_key, until_ns.to_string().as_bytes(), 0);
        host.increment_counter(Counter::BreakerOpened, 1);
    }

    /// The breaker's probe: a read of the in-flight hash whose pick failed last, so that on a
    /// Redis Cluster it goes to the node that failed (a `PING` goes to any master), or a `PING`
    /// before any pick failed.
    fn send_probe(&mut self, host: &mut dyn Host) {
        let query = match &self.probe_key {
            Some(key) => redis::encode_command(&["EXISTS", key.as_str()]),
            None => redis::encode_command(&["PING"]),
        };
        match self.redis.call(host, &query) {
            Ok(t) => {
                self.root_calls.insert(t, RootCall::Probe);
            }
            Err(_) => self.redis_failed(host),
        }
    }

    /// Redis answered a call: the breaker closes (if it was open, say so).
    fn redis_answered(&mut self, host: &mut dyn Host) {
        self.last_answer_ns = host.now_nanos();
        let was_open = !self.breaker.is_closed();
        let probing = self.breaker.is_probing();
        self.breaker.on_success(self.last_answer_ns);
        if was_open {
            host.log(
                LogLevel::Info,
                &format!("{}: redis answers again: breaker closed", self.name),
            );
            if probing {
                // An answer while the probe is out (the probe's, or one sent before it and
                // answered with it): the other workers that followed this breaker, or opened
                // their own on the same stall, close too, at their next tick or request. Not the
                // late answer of a call sent before an open breaker's probe: from a Redis slow
                // enough to open it (not stalled), that says nothing of the calls sent now, and
                // every worker would then send its picks into the same slowness again.
                let closed = SHARED_BREAKER_CLOSED.to_string();
                let _ = host.set_shared_data(&self.breaker_key, closed.as_bytes(), 0);
            }
            // The releases of requests that ended while it was open go out now.
            self.flush_all_ended(host);
        }
        // Key writes that waited: for the breaker, or after a send failed with it closed.
        if !self.waiting_writes.is_empty() {
            self.flush_writes(host);
        }
    }

    /// The decision for a reply's outcome: route to the pick, 429 when it was not admitted (the
    /// script already undid the +1), keep waiting for a resent pick, or decide without Redis.
    pub fn decide(
        &mut self,
        host: &mut dyn Host,
        stream: Option<&mut Stream>,
        outcome: ReplyOutcome,
    ) -> Decision {
        match (outcome, stream) {
            (ReplyOutcome::Picked(pick), _) if pick.admitted => Decision::Route(pick.host),
            (ReplyOutcome::Picked(_), stream) => {
                host.increment_counter(Counter::Rejected, 1);
                if let Some(s) = stream {
                    s.decision = Some(Counter::Rejected.label().to_string());
                }
                Decision::Reject { status: 429, body: REJECT_BODY.to_string() }
            }
            (ReplyOutcome::Resent(token), _) => Decision::Pending(token),
            (ReplyOutcome::NotForRequest, _) => Decision::Passthrough,
            (ReplyOutcome::Fallback(why), Some(stream)) => {
                let pin = self.pin_of(stream.id);
                self.without_redis(host, stream, &why, None, pin)
            }
            (ReplyOutcome::Fallback(_), None) => Decision::Passthrough,
        }
    }

    /// Checks the engine's cache report in the response against this prediction.
    fn check_cache(&mut self, stream: &Stream, predicted_hit: bool) {
        if let Some(state) = self.picks.get_mut(&stream.id) {
            state.cache_check = Some(CacheCheck::new(predicted_hit));
        }
    }

    /// A response body chunk: the cache check keeps the end of the response, and counts at its end.
    pub fn on_response_body(
        &mut self,
        host: &mut dyn Host,
        stream: &Stream,
        size: usize,
        end_of_stream: bool,
    ) {
        let Some(check) = self.picks.get_mut(&stream.id).and_then(|s| s.cache_check.as_mut())
        else {
            return;
        };
        check.on_chunk(host, size);
        if end_of_stream {
            check.finish(host);
        }
    }

    /// A tick while `stream` waits for its pick: give up a pick slower than `breakerSlowMs`, or
    /// any pick still waiting once the breaker has opened.
    pub fn on_pending_tick(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
    ) -> Option<Decision> {
        let slow_ns = u64::from(self.config.state.breaker_slow_ms) * 1_000_000;
        let (_, sent) = self.picks.get(&stream.id).and_then(|s| s.pending)?;
        if !self.breaker.is_closed() {
            // Other picks opened the breaker while this one waited: it waits on the same stalled
            // Redis. Decided now, as every new request is, instead of waiting out its own
            // `breakerSlowMs` (and not counted as one more failure).
            self.fallback(host, stream, Fallback::Slow);
            let pin = self.pin_of(stream.id);
            return Some(self.without_redis(host, stream, &Fallback::BreakerOpen, None, pin));
        }
        let now = host.now_nanos();
        if slow_ns == 0 || now.saturating_sub(sent) < slow_ns {
            return None;
        }
        if let Some(s) = self.picks.get(&stream.id) {
            self.probe_key = Some(s.keys.inflight.clone());
        }
        if self.last_answer_ns <= sent {
            self.redis_stalled(host);
        } else {
            self.redis_failed(host);
        }
        self.fallback(host, stream, Fallback::Slow);
        let pin = self.pin_of(stream.id);
        Some(self.without_redis(host, stream, &Fallback::Slow, None, pin))
    }

    /// Where `stream`'s admitted pick placed it, while the stream lives.
    pub fn placement(&self, stream: u32) -> Option<super::prefill::Placement<'_>> {
        let s = self.picks.get(&stream)?;
        Some(super::prefill::Placement {
            pod: s.picked.as_deref()?,
            cached_blocks: s.cached_blocks,
        })
    }

    /// Stream end: `-1` for the picked host, exactly once; a pick still in flight is cancelled (it
    /// runs before the cancel on the same connection, or finds the tombstone).
    ///
    /// An admitted request's release waits for this VM's next pick on the route+cluster to carry
    /// it, while other requests there are in flight; the last one's goes out at once (with any
    /// still waiting), and the root tick sends what no pick carried.
    pub fn on_done(&mut self, host: &mut dyn Host, stream: &mut Stream) {
        // A pick made by the pods' metrics (Redis down) no longer loads its pod.
        self.metrics.on_stream_done(stream.id);
        let Some(mut state) = self.picks.remove(&stream.id) else { return };
        let owners_key = state.keys.owners.clone();
        // A pick still in flight may run or not: its carried releases go again.
        let carried = std::mem::take(&mut state.carried);
        self.requeue_ended(host, &owners_key, carried);
        let (picked, abandoned) = match (state.picked, state.pending) {
            (Some(pod), _) => (Some(pod), None),
            (None, Some(_)) => (None, Some(state.request_id.clone())),
            (None, None) => return,
        };
        let group = self.groups.get_mut(&owners_key);
        let (Some(pod), Some(g)) = (picked.clone(), group) else {
            // The cancel of a pick still in flight goes at once, after the pick on the same
            // connection: it undoes the pick or leaves a tombstone. (It needs no group: the
            // heartbeat may have dropped an idle one meanwhile.)
            let call = ReleaseCall {
                inflight_key: state.keys.inflight,
                owner_id: state.owner_id,
                ended: picked.map(|pod| (state.request_id, pod)).into_iter().collect(),
                abandoned,
            };
            self.send_release(host, Release { call, failures: 0, use_eval: false });
            return;
        };
        g.held = g.held.saturating_sub(1);
        let full = g.ended.len() >= MAX_QUEUED_RELEASES;
        if !full {
            g.ended.push((state.request_id, pod));
        }
        let idle = g.held == 0;
        if full {
            self.drop_releases(host, 1, "release queue full");
        }
        if idle {
            self.flush_ended(host, &owners_key);
        }
    }

    /// Releases that a pick carried but that may not have run: they wait for the next pick or tick
    /// again (at the front: they ended first).
    fn requeue_ended(&mut self, host: &mut dyn Host, owners_key: &str, ids: Vec<(String, String)>) {
        if ids.is_empty() {
            return;
        }
        let Some(g) = self.groups.get_mut(owners_key) else { return };
        let room = MAX_QUEUED_RELEASES.saturating_sub(g.ended.len());
        let lost = ids.len().saturating_sub(room);
        let keep = ids.len().min(room);
        g.ended.splice(0..0, ids.into_iter().take(keep));
        if lost > 0 {
            self.drop_releases(host, lost, "release queue full");
        }
    }

    /// Sends the releases waiting in a group, at most [`MAX_CARRIED`] per call; while the breaker
    /// is open they keep waiting in the group.
    fn flush_ended(&mut self, host: &mut dyn Host, owners_key: &str) {
        let Some(owner_id) = self.owner.clone() else { return };
        if !self.breaker.is_closed() {
            return;
        }
        let Some(g) = self.groups.get_mut(owners_key) else { return };
        let mut calls = Vec::new();
        while !g.ended.is_empty() {
            let n = g.ended.len().min(MAX_CARRIED);
            calls.push(ReleaseCall {
                inflight_key: g.inflight_key.clone(),
                owner_id: owner_id.clone(),
                ended: g.ended.drain(..n).collect(),
                abandoned: None,
            });
        }
        for call in calls {
            self.send_release(host, Release { call, failures: 0, use_eval: false });
        }
    }

    /// The root stops: releases waiting for a pick, the tick or a reply go now (while the breaker
    /// is closed), so that this VM's counts are exact when it is gone instead of two leases later.
    /// Returns whether no release is left in flight.
    pub fn on_stop(&mut self, host: &mut dyn Host) -> bool {
        self.flush_all_ended(host);
        self.flush_release_queue(host);
        self.stopped()
    }

    /// Whether no release is in flight. A release answered with NOSCRIPT goes again first, so the
    /// root stays until Redis has run it (or failed it for good).
    pub fn stopped(&self) -> bool {
        !self.root_calls.values().any(|c| matches!(c, RootCall::Release(_)))
    }

    /// Sends the releases waiting in every group (see [`Picker::flush_ended`]).
    fn flush_all_ended(&mut self, host: &mut dyn Host) {
        let waiting: Vec<String> = self
            .groups
            .iter()
            .filter(|(_, g)| !g.ended.is_empty())
            .map(|(k, _)| k.clone())
            .collect();
        for owners_key in waiting {
            self.flush_ended(host, &owners_key);
        }
    }

    /// Root tick: lease heartbeats (which also reap dead owners), and the breaker's probe when no
    /// request comes to probe it.
    pub fn on_tick(&mut self, host: &mut dyn Host) {
        let now = host.now_nanos();
        self.metrics.on_tick(host, now / 1_000_000);
        self.follow_shared_breaker(host);
        if !self.breaker.is_closed() {
            if self.breaker.admit(now) == Admission::Probe {
                self.send_probe(host);
            }
            return;
        }
        // What no pick carried.
        self.flush_all_ended(host);
        let every_ns = u64::from(self.config.state.lease_ms / 3) * 1_000_000;
        if now.saturating_sub(self.last_heartbeat_ns) < every_ns {
            return;
        }
        self.last_heartbeat_ns = now;
        self.groups.retain(|_, g| {
            g.held > 0 || !g.ended.is_empty() || now.saturating_sub(g.last_pick_ns) < GROUP_IDLE_NS
        });
        let groups: Vec<String> = self.groups.keys().cloned().collect();
        for owners_key in groups {
            self.send_heartbeat(host, owners_key, false);
        }
    }

    /// The request ids of `group` whose records this VM still needs: every pick of a live stream
    /// (not answered yet, or admitted), and every ended request whose release has not been
    /// answered (waiting for a pick, carried by a pick in flight, queued, or sent). The heartbeat
    /// releases the owner's other records: their releases will never come.
    fn unreleased(&self, owners_key: &str, group: &Group) -> Vec<String> {
        let mut ids: Vec<String> = Vec::new();
        for s in self.picks.values().filter(|s| s.keys.owners == owners_key) {
            if s.pending.is_some() || s.picked.is_some() {
                ids.push(s.request_id.clone());
            }
            ids.extend(s.carried.iter().map(|(id, _)| id.clone()));
        }
        ids.extend(group.ended.iter().map(|(id, _)| id.clone()));
        let sent = self.root_calls.values().filter_map(|c| match c {
            RootCall::Release(r) => Some(r),
            _ => None,
        });
        for r in self.release_queue.iter().chain(sent) {
            if r.call.inflight_key == group.inflight_key {
                ids.extend(r.call.ended.iter().map(|(id, _)| id.clone()));
                ids.extend(r.call.abandoned.iter().cloned());
            }
        }
        ids
    }

    /// Renews this VM's lease on one route+cluster, reaps dead owners there, releases this VM's
    /// records that it no longer needs (see [`Picker::unreleased`]), and (every `cleanInterval`)
    /// cleans out hosts that left the cluster (`heartbeat.lua`).
    fn send_heartbeat(&mut self, host: &mut dyn Host, owners_key: String, use_eval: bool) {
        let Some(owner) = self.owner.clone() else { return };
        let Some(group) = self.groups.get(&owners_key) else { return };
        let call = HeartbeatCall {
            inflight_key: group.inflight_key.clone(),
            lease_ms: self.config.state.lease_ms,
            owner_id: owner,
            clean_interval_s: self.config.clean_interval_min.saturating_mul(60),
            live: self.unreleased(&owners_key, group),
            hosts: group.hosts.clone(),
        };
        let (keys, args) = call.keys_args();
        let q = self.heartbeat.command(&keys, &args, use_eval);
        if let Ok(t) = self.redis.call(host, &q) {
            self.root_calls.insert(t, RootCall::Heartbeat { owners_key, use_eval });
        }
    }

    fn send_release(&mut self, host: &mut dyn Host, rel: Release) {
        if !self.breaker.is_closed() {
            self.queue_release(host, rel);
            return;
        }
        let (keys, args) = rel.call.keys_args();
        let q = self.release.command(&keys, &args, rel.use_eval);
        match self.redis.call(host, &q) {
            Ok(token) => {
                self.root_calls.insert(token, RootCall::Release(rel));
            }
            Err(_) => self.release_failed(host, rel),
        }
    }

    /// Writes `key` = `value` for `ttl_s` seconds (`SET ... EX`), nothing waiting for the reply:
    /// `prefix_cache`'s record of the pod that made a stored response. While the breaker is open,
    /// or when the call cannot be sent or gets no answer, the write waits (at most
    /// [`MAX_WAITING_WRITES`], the oldest dropped) and goes out when Redis answers again: a
    /// response made during an outage is then found by every gateway, not only by this one's own
    /// record. A write lost costs a later request its pod, never a count.
    pub fn write_key(&mut self, host: &mut dyn Host, key: &str, value: &str, ttl_s: u64) {
        let write = KeyWrite { key: key.to_string(), value: value.to_string(), ttl_s };
        self.send_write(host, write);
    }

    fn send_write(&mut self, host: &mut dyn Host, write: KeyWrite) {
        if self.breaker.is_closed() {
            let ttl = write.ttl_s.to_string();
            let query = redis::encode_command(&["SET", &write.key, &write.value, "EX", &ttl]);
            match self.redis.call(host, &query) {
                Ok(token) => {
                    self.root_calls.insert(token, RootCall::Write(write));
                    return;
                }
                Err(_) => self.redis_failed(host),
            }
        }
        self.wait_write(write);
    }

    fn wait_write(&mut self, write: KeyWrite) {
        if self.waiting_writes.len() >= MAX_WAITING_WRITES {
            self.waiting_writes.pop_front();
        }
        self.waiting_writes.push_back(write);
    }

    /// Redis answers (again): the key writes that waited go out.
    fn flush_writes(&mut self, host: &mut dyn Host) {
        let waiting: Vec<_> = self.waiting_writes.drain(..).collect();
        for write in waiting {
            self.send_write(host, write);
        }
    }

    /// The reply to a release, heartbeat, probe or write.
    fn on_root_reply(&mut self, host: &mut dyn Host, call: RootCall, reply: &RedisReply) {
        let frame = match reply {
            RedisReply::Ok(b) => decode_reply(b).ok(),
            RedisReply::NetworkError => {
                self.redis_failed(host);
                None
            }
        };
        let noscript = frame.as_ref().is_some_and(redis::is_noscript);
        let ran = match &frame {
            Some(Frame::Error(msg)) => {
                self.redis.on_error_reply(msg);
                false
            }
            Some(_) => true,
            None => false,
        };
        if frame.is_some() {
            self.redis_answered(host);
        }
        match call {
            RootCall::Release(mut rel) => {
                if noscript && !rel.use_eval {
                    rel.use_eval = true;
                    self.send_release(host, rel);
                } else if !ran {
                    self.release_failed(host, rel);
                }
            }
            RootCall::Heartbeat { owners_key, use_eval } => {
                if noscript && !use_eval {
                    self.send_heartbeat(host, owners_key, true);
                } else if let Some(Frame::Array(reply)) = frame {
                    self.on_heartbeat_reply(host, &reply);
                }
            }
            // No answer: Redis may not have it. (An error answer is not sent again.)
            RootCall::Write(write) if frame.is_none() => self.wait_write(write),
            RootCall::Probe | RootCall::Write(_) => {}
        }
        if ran {
            self.flush_release_queue(host);
        }
    }

    /// What a heartbeat did beyond renewing the lease (`{released, corrected}`, heartbeat.lua).
    fn on_heartbeat_reply(&self, host: &mut dyn Host, reply: &[Frame]) {
        let count = |i: usize| match reply.get(i) {
            Some(Frame::Integer(n)) => *n,
            _ => 0,
        };
        let (released, corrected) = (count(0), count(1));
        if released > 0 {
            // Records whose releases could not come: Redis restarted from older state, or
            // releases were dropped.
            host.log(
                LogLevel::Warn,
                &format!(
                    "{}: the heartbeat released {released} record(s) of this VM whose releases \
                     will never come (redis restarted from older state, or releases were dropped)",
                    self.name
                ),
            );
            host.increment_counter(Counter::StaleRecordsReleased, released);
        }
        if corrected > 0 {
            host.log(
                LogLevel::Warn,
                &format!(
                    "{}: the recount corrected the in-flight counts of {corrected} pod(s) to what \
                     the live gateways' records say (a redis cluster slot moved while in use, or \
                     a count changed by hand)",
                    self.name
                ),
            );
            host.increment_counter(Counter::CountsRecounted, corrected);
        }
    }

    /// A release that may not have run: sent again later.
    fn release_failed(&mut self, host: &mut dyn Host, mut rel: Release) {
        if self.breaker.is_closed() {
            rel.failures = rel.failures.saturating_add(1);
        }
        if rel.failures >= MAX_RELEASE_ATTEMPTS {
            let why = format!("giving up the release after {} failed sends", rel.failures);
            self.drop_releases(host, rel.call.len(), &why);
            return;
        }
        self.queue_release(host, rel);
    }

    fn queue_release(&mut self, host: &mut dyn Host, rel: Release) {
        if self.release_queue.len() >= MAX_QUEUED_RELEASES {
            self.drop_releases(host, rel.call.len(), "release queue full");
            return;
        }
        self.release_queue.push(rel);
    }

    /// `n` releases lost for good (`why`). Their records are no longer among those this VM needs,
    /// so its next heartbeat that Redis runs releases them (see [`Picker::unreleased`]).
    fn drop_releases(&mut self, host: &mut dyn Host, n: usize, why: &str) {
        host.log(
            LogLevel::Warn,
            &format!(
                "{}: {why}: dropping {n} release(s); the next heartbeat releases their records",
                self.name
            ),
        );
        host.increment_counter(Counter::ReleaseDropped, n as i64);
    }

    fn flush_release_queue(&mut self, host: &mut dyn Host) {
        if !self.breaker.is_closed() {
            return;
        }
        for rel in std::mem::take(&mut self.release_queue) {
            self.send_release(host, rel);
        }
    }
}
