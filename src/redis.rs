//! Redis: RESP2 command encoding and reply decoding (with the `redis-protocol` crate), the Lua
//! scripts (cached with EVALSHA, NOSCRIPT falls back to EVAL), the key layout, and a small client
//! over [`Host`] that (re)initialises the per-worker Redis connection.
//!
//! Key layout (all keys of one route+cluster share the Redis Cluster hash tag `{route|cluster}`, so
//! one script call touches one slot):
//! * `higress:ai-lb:{<route>|<cluster>}:inflight`   hash: host -> in-flight requests
//! * `higress:ai-lb:{<route>|<cluster>}:last_clean` unix seconds of the last cleanup
//! * `higress:ai-lb:{<route>|<cluster>}:last_recount` Redis ms time of the last recount
//! * `higress:ai-lb:{<route>|<cluster>}:pfx:<40 upper-case hex>` prefix chain key -> host (TTL)
//! * `higress:ai-lb:{<route>|<cluster>}:owners`     sorted set: owner (one plugin VM) -> lease
//!   expiry (ms, Redis clock)
//! * `higress:ai-lb:{<route>|<cluster>}:own:<owner>` hash: `<request>` (hex) -> host of each
//!   admitted pick of that owner not released yet (`#` and a Redis time in ms is the tombstone of
//!   an abandoned pick), and the marker `~` (empty) from the owner's registration on. Deleted, and
//!   its picks subtracted, once the owner's lease runs out.
//!
//! The scripts get only the in-flight key and derive the others from it (same hash tag, one slot).
//!
//! No key that correctness depends on has a TTL (eviction under a `volatile-*` policy would remove
//! it); only prefix keys do.

use crate::config::RedisConfig;
use crate::host::{Host, HostError, LogLevel, RedisInit};
use redis_protocol::resp2::types::{OwnedFrame, Resp2Frame};
use sha1::{Digest, Sha1};
use std::sync::LazyLock;

pub use redis_protocol::resp2::types::OwnedFrame as Frame;

/// The first lines of every script: the key names derived from KEYS[1], effects replication, the
/// owner hash's marker.
const PRELUDE_LUA: &str = include_str!("lua/prelude.lua");
/// The lease steps of a pick, spliced in where a pick script's `--@settle` and `--@commit` lines
/// stand: the pick scripts are written out flat, without functions, as Redis runs a script's whole
/// body (and makes each function it defines anew) at every call.
const PICK_SETTLE_LUA: &str = include_str!("lua/pick_settle.lua");
/// The lease steps' second part (see [`PICK_SETTLE_LUA`]).
const PICK_COMMIT_LUA: &str = include_str!("lua/pick_commit.lua");

/// A pick script: the prelude, then the policy's script with the lease steps spliced in.
fn pick_script(policy: &str) -> String {
    let body = policy.replacen("--@settle\n", PICK_SETTLE_LUA, 1).replacen(
        "--@commit\n",
        PICK_COMMIT_LUA,
        1,
    );
    format!("{PRELUDE_LUA}{body}")
}

/// The global least-request pick.
pub static LEAST_REQUEST_LUA: LazyLock<String> =
    LazyLock::new(|| pick_script(include_str!("lua/least_request.lua")));
/// The prefix-cache pick.
pub static PREFIX_CACHE_LUA: LazyLock<String> =
    LazyLock::new(|| pick_script(include_str!("lua/prefix_cache.lua")));
/// The release script (the `-1` at stream end, and the cancel of an abandoned pick).
pub const RELEASE_LUA: &str = concat!(
    include_str!("lua/prelude.lua"),
    include_str!("lua/shared.lua"),
    include_str!("lua/release.lua")
);
/// Renews an owner's lease, reaps dead owners, cleans out hosts that left the cluster.
pub const HEARTBEAT_LUA: &str = concat!(
    include_str!("lua/prelude.lua"),
    include_str!("lua/shared.lua"),
    include_str!("lua/reap.lua"),
    include_str!("lua/heartbeat.lua")
);

/// How long to wait before retrying a failed `redis_init` (ns).
const INIT_RETRY_NS: u64 = 5_000_000_000;

/// Encodes one command as a RESP2 array of bulk strings.
pub fn encode_command<A: AsRef<[u8]>>(args: &[A]) -> Vec<u8> {
    let frame = OwnedFrame::Array(
        args.iter().map(|a| OwnedFrame::BulkString(a.as_ref().to_vec())).collect(),
    );
    let mut buf = vec![0u8; frame.encode_len(false)];
    match redis_protocol::resp2::encode::encode(&mut buf, &frame, false) {
        Ok(n) => {
            buf.truncate(n);
            buf
        }
        // Cannot happen (the buffer is sized by encode_len); an empty query is refused by callers.
        Err(_) => Vec::new(),
    }
}

/// Decodes exactly one RESP2 reply.
pub fn decode_reply(bytes: &[u8]) -> Result<Frame, String> {
    match redis_protocol::resp2::decode::decode(bytes) {
        Ok(Some((frame, _))) => Ok(frame),
        Ok(None) => Err("incomplete RESP reply".to_string()),
        Err(e) => Err(format!("bad RESP reply: {e:?}")),
    }
}

/// Lower-case hex SHA-1 (the form EVALSHA expects).
pub fn sha1_hex_lower(data: &[u8]) -> String {
    hex::encode(Sha1::digest(data))
}

/// A Lua script with its SHA-1.
#[derive(Debug, Clone)]
pub struct Script {
    /// Source text.
    pub source: &'static str,
    /// Lower-case hex SHA-1 of the source.
    pub sha: String,
}

impl Script {
    /// Wraps a script source.
    pub fn new(source: &'static str) -> Script {
        Script { source, sha: sha1_hex_lower(source.as_bytes()) }
    }

    /// `EVALSHA sha numkeys keys... args...` (or `EVAL source ...` when `use_eval`).
    pub fn command(&self, keys: &[String], args: &[String], use_eval: bool) -> Vec<u8> {
        let mut parts: Vec<&[u8]> = Vec::with_capacity(3 + keys.len() + args.len());
        let nkeys = keys.len().to_string();
        if use_eval {
            parts.push(b"EVAL");
            parts.push(self.source.as_bytes());
        } else {
            parts.push(b"EVALSHA");
            parts.push(self.sha.as_bytes());
        }
        parts.push(nkeys.as_bytes());
        parts.extend(keys.iter().map(|k| k.as_bytes()));
        parts.extend(args.iter().map(|a| a.as_bytes()));
        encode_command(&parts)
    }
}

/// True for the `NOSCRIPT` error (script not cached on that Redis yet).
pub fn is_noscript(frame: &Frame) -> bool {
    matches!(frame, Frame::Error(e) if e.starts_with("NOSCRIPT"))
}

/// The common key prefix (with hash tag) of a route and cluster.
pub fn key_base(route: &str, cluster: &str) -> String {
    format!("higress:ai-lb:{{{route}|{cluster}}}")
}

/// The in-flight hash key.
pub fn inflight_key(route: &str, cluster: &str) -> String {
    format!("{}:inflight", key_base(route, cluster))
}

/// The last-cleanup key.
pub fn last_clean_key(route: &str, cluster: &str) -> String {
    format!("{}:last_clean", key_base(route, cluster))
}

/// A prefix chain key for a 40-hex-digit chain value.
pub fn prefix_key(route: &str, cluster: &str, chain_hex: &str) -> String {
    format!("{}:pfx:{}", key_base(route, cluster), chain_hex)
}

/// The owners (lease) sorted set.
pub fn owners_key(route: &str, cluster: &str) -> String {
    format!("{}:owners", key_base(route, cluster))
}

/// One owner's hash (its shares of the counts and its requests' pick records).
pub fn owner_key(route: &str, cluster: &str, owner: &str) -> String {
    format!("{}:own:{owner}", key_base(route, cluster))
}

/// Per-policy Redis client: owns the cluster name and (re)initialisation.
#[derive(Debug, Clone)]
pub struct RedisClient {
    /// What `redis_init` gets (its cluster name with `?db=N` and the buffering parameters).
    init: RedisInit,
    /// Cluster name for redis_call (the host strips any `?...` anyway).
    call_cluster: String,
    inited: bool,
    last_attempt_ns: Option<u64>,
}

impl RedisClient {
    /// A client for this config (not yet initialised).
    pub fn new(config: RedisConfig) -> RedisClient {
        // Flush every command at once (Envoy's Redis client batches for 3 ms / 1024 bytes by default;
        // with one command per request, batching only adds latency). Hosts that do not know these
        // parameters ignore them.
        let base = config.cluster();
        let sep = if base.contains('?') { '&' } else { '?' };
        let init_cluster = format!(
            "{base}{sep}buffer_flush_timeout={}&max_buffer_size_before_flush={}",
            config.buffer_flush_timeout_ms, config.max_buffer_size_before_flush
        );
        let call_cluster = config.service_cluster();
        let init = RedisInit {
            cluster: init_cluster,
            username: config.username,
            password: config.password,
            timeout_ms: config.timeout_ms,
        };
        RedisClient { init, call_cluster, inited: false, last_attempt_ns: None }
    }

    /// The cluster name `proxy_redis_call` gets.
    pub fn call_cluster(&self) -> &str {
        &self.call_cluster
    }

    /// The cluster name passed to `proxy_redis_init`: [`RedisConfig::cluster`] plus the buffering
    /// parameters.
    pub fn init_cluster(&self) -> &str {
        &self.init.cluster
    }

    /// Initialises the connection. Failure is logged, not fatal (Higress #1517): retried later.
    pub fn init(&mut self, host: &mut dyn Host) -> bool {
        self.last_attempt_ns = Some(host.now_nanos());
        match host.redis_init(&self.init) {
            Ok(()) => {
                self.inited = true;
                true
            }
            Err(e) => {
                self.inited = false;
                host.log(
                    LogLevel::Warn,
                    &format!("ai-load-balancer: redis init of {} failed ({e}); will retry, using normal balancing meanwhile", self.init.cluster),
                );
                false
            }
        }
    }

    /// True when ready; retries a failed init at most every 5 s.
    pub fn ensure(&mut self, host: &mut dyn Host) -> bool {
        if self.inited {
            return true;
        }
        let now = host.now_nanos();
        match self.last_attempt_ns {
            Some(t) if now.saturating_sub(t) < INIT_RETRY_NS => false,
            _ => self.init(host),
        }
    }

    /// Sends a command; errors are logged.
    pub fn call(&mut self, host: &mut dyn Host, query: &[u8]) -> Result<u32, HostError> {
        if !self.ensure(host) {
            return Err(HostError::InternalFailure);
        }
        let r = host.redis_call(&self.call_cluster, query);
        if let Err(e) = r {
            host.log(
                LogLevel::Warn,
                &format!("ai-load-balancer: redis call to {} failed: {e}", self.call_cluster),
            );
            if e == HostError::BadArgument {
                // Unknown cluster now (config changed under us): re-init on a later request.
                self.inited = false;
            }
        }
        r
    }

    /// Reacts to an error reply: `NOAUTH` means the connection lost its AUTH (the host's AUTH on
    /// connect is fire-and-forget), so re-initialise on the next request.
    pub fn on_error_reply(&mut self, msg: &str) {
        if msg.starts_with("NOAUTH") || msg.starts_with("WRONGPASS") {
            self.inited = false;
            self.last_attempt_ns = None;
        }
    }
}

#[cfg(test)]
#[path = "redis_tests.rs"]
mod tests;
