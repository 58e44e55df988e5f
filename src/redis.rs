//! Redis: RESP2 command encoding and reply decoding (with the `redis-protocol` crate), the Lua
//! scripts (cached with EVALSHA, NOSCRIPT falls back to EVAL), the key layout, and a small client
//! over [`Host`] that (re)initialises the per-worker Redis connection.
//!
//! Key layout (all keys of one route+cluster share the Redis Cluster hash tag `{route|cluster}`, so
//! one script call touches one slot):
//! * `higress:ai-lb:{<route>|<cluster>}:inflight`   hash: host -> in-flight requests
//! * `higress:ai-lb:{<route>|<cluster>}:last_clean` unix seconds of the last cleanup
//! * `higress:ai-lb:{<route>|<cluster>}:pfx:<40 upper-case hex>` prefix chain key -> host (TTL)
//! * `higress:ai-lb:{<route>|<cluster>}:owners`     sorted set: owner (one plugin VM) -> lease
//!   expiry (ms, Redis clock)
//! * `higress:ai-lb:{<route>|<cluster>}:own:<owner>` hash: `r:<request>` -> host of each admitted
//!   pick of that owner not released yet (an empty value is the tombstone of an abandoned pick).
//!   Deleted, and its picks subtracted, once the owner's lease runs out.
//!
//! The scripts get only the in-flight key and derive the others from it (same hash tag, one slot).
//!
//! No key that correctness depends on has a TTL (eviction under a `volatile-*` policy would remove
//! it); only prefix keys and the cleanup time do.

use crate::config::RedisConfig;
use crate::host::{Host, HostError, LogLevel};
use redis_protocol::resp2::types::{OwnedFrame, Resp2Frame};
use sha1::{Digest, Sha1};

pub use redis_protocol::resp2::types::OwnedFrame as Frame;

/// The global least-request script (after the shared lease prelude).
pub const LEAST_REQUEST_LUA: &str = concat!(
    include_str!("lua/reap.lua"),
    include_str!("lua/lease.lua"),
    include_str!("lua/least_request.lua")
);
/// The prefix-cache script (after the shared lease prelude).
pub const PREFIX_CACHE_LUA: &str = concat!(
    include_str!("lua/reap.lua"),
    include_str!("lua/lease.lua"),
    include_str!("lua/prefix_cache.lua")
);
/// The release script (the `-1` at stream end, and the cancel of an abandoned pick).
pub const RELEASE_LUA: &str =
    concat!(include_str!("lua/reap.lua"), include_str!("lua/release.lua"));
/// Renews an owner's lease, reaps dead owners, cleans out hosts that left the cluster.
pub const HEARTBEAT_LUA: &str =
    concat!(include_str!("lua/reap.lua"), include_str!("lua/heartbeat.lua"));

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
    config: RedisConfig,
    /// Cluster name for redis_init (with `?db=N`).
    init_cluster: String,
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
        let call_cluster = format!("outbound|{}||{}", config.service_port, config.service_fqdn);
        RedisClient { config, init_cluster, call_cluster, inited: false, last_attempt_ns: None }
    }

    /// The cluster name passed to `proxy_redis_init`: [`RedisConfig::cluster`] plus the buffering
    /// parameters.
    pub fn init_cluster(&self) -> &str {
        &self.init_cluster
    }

    /// Initialises the connection. Failure is logged, not fatal (Higress #1517): retried later.
    pub fn init(&mut self, host: &mut dyn Host) -> bool {
        self.last_attempt_ns = Some(host.now_nanos());
        match host.redis_init(
            &self.init_cluster,
            &self.config.username,
            &self.config.password,
            self.config.timeout_ms,
        ) {
            Ok(()) => {
                self.inited = true;
                true
            }
            Err(e) => {
                self.inited = false;
                host.log(
                    LogLevel::Warn,
                    &format!("ai-load-balancer: redis init of {} failed ({e}); will retry, using normal balancing meanwhile", self.init_cluster),
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
mod tests {
    use super::*;

    #[test]
    fn encodes_command_as_array_of_bulk_strings() {
        let q = encode_command(&["HINCRBY", "k", "10.0.0.1:80", "-1"]);
        assert_eq!(
            q,
            b"*4\r\n$7\r\nHINCRBY\r\n$1\r\nk\r\n$11\r\n10.0.0.1:80\r\n$2\r\n-1\r\n".to_vec()
        );
    }

    #[test]
    fn binary_safe_arguments() {
        let q = encode_command(&[&b"SET"[..], &b"a\r\nb"[..], &[0u8, 255][..]]);
        assert_eq!(q, b"*3\r\n$3\r\nSET\r\n$4\r\na\r\nb\r\n$2\r\n\x00\xff\r\n".to_vec());
    }

    #[test]
    fn decodes_replies() {
        assert_eq!(decode_reply(b":42\r\n"), Ok(Frame::Integer(42)));
        assert_eq!(decode_reply(b"$-1\r\n"), Ok(Frame::Null));
        assert_eq!(decode_reply(b"+OK\r\n"), Ok(Frame::SimpleString(b"OK".to_vec())));
        assert_eq!(
            decode_reply(b"*3\r\n$5\r\nh:1\r\n\r\n:3\r\n:1\r\n"),
            Ok(Frame::Array(vec![
                Frame::BulkString(b"h:1\r\n".to_vec()),
                Frame::Integer(3),
                Frame::Integer(1)
            ]))
        );
        let e = decode_reply(b"-NOSCRIPT No matching script. Please use EVAL.\r\n").unwrap();
        assert!(is_noscript(&e));
        assert!(!is_noscript(&Frame::Error("ERR x".into())));
    }

    #[test]
    fn rejects_truncated_or_garbage_replies() {
        assert!(decode_reply(b"*2\r\n:1\r\n").is_err());
        assert!(decode_reply(b"").is_err());
        assert!(decode_reply(b"?what\r\n").is_err());
    }

    #[test]
    fn script_sha_is_sha1_of_source() {
        // SHA-1("abc") = a9993e36..., FIPS 180 test vector.
        assert_eq!(sha1_hex_lower(b"abc"), "a9993e364706816aba3e25717850c26c9cd0d89d");
        let s = Script::new(LEAST_REQUEST_LUA);
        assert_eq!(s.sha, sha1_hex_lower(LEAST_REQUEST_LUA.as_bytes()));
        let cmd = s.command(&["k1".into()], &["a".into()], false);
        let f = decode_reply(&cmd).unwrap();
        let Frame::Array(parts) = f else { panic!("not an array") };
        assert_eq!(parts[0], Frame::BulkString(b"EVALSHA".to_vec()));
        assert_eq!(parts[1], Frame::BulkString(s.sha.as_bytes().to_vec()));
        assert_eq!(parts[2], Frame::BulkString(b"1".to_vec()));
        let eval = decode_reply(&s.command(&["k1".into()], &[], true)).unwrap();
        let Frame::Array(parts) = eval else { panic!("not an array") };
        assert_eq!(parts[1], Frame::BulkString(LEAST_REQUEST_LUA.as_bytes().to_vec()));
    }

    #[test]
    fn keys_share_one_hash_tag() {
        let a = inflight_key("r1", "outbound|8000||llm.static");
        let b = prefix_key("r1", "outbound|8000||llm.static", "AB");
        assert_eq!(a, "higress:ai-lb:{r1|outbound|8000||llm.static}:inflight");
        assert_eq!(b, "higress:ai-lb:{r1|outbound|8000||llm.static}:pfx:AB");
        let tag = |k: &str| {
            let s = k.find('{').unwrap();
            let e = k[s..].find('}').unwrap() + s;
            k[s + 1..e].to_string()
        };
        assert_eq!(tag(&a), tag(&b));
        assert_eq!(tag(&a), tag(&last_clean_key("r1", "outbound|8000||llm.static")));
    }

    #[test]
    fn init_cluster_has_db_only_when_nonzero() {
        let mut cfg = RedisConfig {
            service_fqdn: "redis.static".into(),
            service_port: 6379,
            username: "u".into(),
            password: "p".into(),
            timeout_ms: 3000,
            database: 0,
            buffer_flush_timeout_ms: 0,
            max_buffer_size_before_flush: 0,
        };
        assert_eq!(cfg.cluster(), "outbound|6379||redis.static");
        assert_eq!(
            RedisClient::new(cfg.clone()).init_cluster(),
            "outbound|6379||redis.static?buffer_flush_timeout=0&max_buffer_size_before_flush=0"
        );
        cfg.database = 2;
        cfg.buffer_flush_timeout_ms = 3;
        cfg.max_buffer_size_before_flush = 1024;
        assert_eq!(cfg.cluster(), "outbound|6379||redis.static?db=2");
        assert_eq!(
            RedisClient::new(cfg).init_cluster(),
            "outbound|6379||redis.static?db=2&buffer_flush_timeout=3&max_buffer_size_before_flush=1024"
        );
    }

    #[test]
    fn failed_init_is_retried_after_a_while_not_on_every_request() {
        let cfg = RedisConfig {
            service_fqdn: "redis.static".into(),
            service_port: 6379,
            username: String::new(),
            password: String::new(),
            timeout_ms: 50,
            database: 0,
            buffer_flush_timeout_ms: 0,
            max_buffer_size_before_flush: 0,
        };
        let mut host = crate::host::fake::FakeHost::new();
        host.redis_init_error = Some(HostError::BadArgument);
        let mut c = RedisClient::new(cfg);
        assert!(!c.init(&mut host));
        assert!(c.call(&mut host, b"x").is_err());
        assert_eq!(host.redis_inits.len(), 1, "no retry within 5 s");
        host.now += 6_000_000_000;
        host.redis_init_error = None;
        assert!(c.call(&mut host, b"*1\r\n$4\r\nPING\r\n").is_ok());
        assert_eq!(host.redis_inits.len(), 2);
        assert_eq!(host.redis_inits[1].timeout_ms, 50);
    }
}
