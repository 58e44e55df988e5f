//! The Lua scripts against a real `redis-server` (from PATH, or `$AI_LB_REDIS_SERVER`). Native only.
//! These fail (not skip) without redis-server: install it (`apt-get install redis-server`).

use crate::policy::picker::{
    parse_pick, HeartbeatCall, PickCall, PickKind, Pin, ReleaseCall, StateKeys,
};
use crate::redis::{
    decode_reply, encode_command, Frame, Script, HEARTBEAT_LUA, LEAST_REQUEST_LUA,
    PREFIX_CACHE_LUA, RELEASE_LUA,
};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

static N: AtomicUsize = AtomicUsize::new(0);

struct Redis {
    child: Child,
    conn: UnixStream,
    sock: String,
    /// Pick record key of the last `run` (`rq:<n>`).
    last_req: String,
    /// How many pods' counts the last heartbeat's recount corrected.
    recounted: i64,
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.sock);
    }
}

impl Redis {
    // The child is owned by the returned Redis (killed and waited for in Drop).
    #[allow(clippy::zombie_processes)]
    fn start() -> Redis {
        let bin = std::env::var("AI_LB_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let sock = format!(
            "{}/ai-lb-lua-{}-{}.sock",
            std::env::temp_dir().display(),
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        );
        let _ = std::fs::remove_file(&sock);
        let mut child = Command::new(&bin)
            .args(["--port", "0", "--unixsocket", &sock, "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("these tests need redis-server ({bin}: {e}); install it (apt-get install redis-server) or set AI_LB_REDIS_SERVER"));
        let start = Instant::now();
        loop {
            if let Ok(conn) = UnixStream::connect(&sock) {
                conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                return Redis { child, conn, sock, last_req: String::new(), recounted: 0 };
            }
            if start.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                let _ = child.wait();
                panic!("redis-server did not start");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn raw(&mut self, q: &[u8]) -> Frame {
        self.conn.write_all(q).unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = self.conn.read(&mut chunk).unwrap();
            assert!(n > 0, "redis closed the connection");
            buf.extend_from_slice(&chunk[..n]);
            if let Ok(f) = decode_reply(&buf) {
                return f;
            }
        }
    }

    fn cmd(&mut self, args: &[&str]) -> Frame {
        self.raw(&encode_command(args))
    }

    fn get(&mut self, key: &str) -> Option<String> {
        match self.cmd(&["GET", key]) {
            Frame::BulkString(b) => Some(String::from_utf8(b).unwrap()),
            _ => None,
        }
    }

    /// A prefix key's holders (its value without the `@<time written>` suffix).
    fn holders(&mut self, key: &str) -> Option<String> {
        self.get(key).map(|v| v.split('@').next().unwrap_or_default().to_string())
    }

    fn count(&mut self, host: &str) -> Option<i64> {
        match self.cmd(&["HGET", "inflight", host]) {
            Frame::BulkString(b) => Some(String::from_utf8(b).unwrap().parse().unwrap()),
            _ => None,
        }
    }

    fn ttl(&mut self, key: &str) -> i64 {
        match self.cmd(&["TTL", key]) {
            Frame::Integer(i) => i,
            other => panic!("{other:?}"),
        }
    }

    /// EVALSHA, loading with EVAL on NOSCRIPT (what the plugin does).
    fn run(&mut self, script: &Script, call: &PickCall) -> Frame {
        self.last_req = call.request_id.clone();
        let (keys, args) = call.keys_args();
        self.run_keys(script, &keys, &args)
    }

    fn run_keys(&mut self, script: &Script, keys: &[String], args: &[String]) -> Frame {
        let r = self.raw(&script.command(keys, args, false));
        if crate::redis::is_noscript(&r) {
            return self.raw(&script.command(keys, args, true));
        }
        r
    }

    /// The release of a request admitted to `admitted_to`, or (`None`) the cancel of an abandoned
    /// pick.
    fn release(&mut self, owner: &str, req: &str, admitted_to: Option<&str>) -> Frame {
        let call = ReleaseCall {
            inflight_key: "inflight".into(),
            owner_id: owner.into(),
            ended: admitted_to.map(|h| (req.to_string(), h.to_string())).into_iter().collect(),
            abandoned: admitted_to.is_none().then(|| req.to_string()),
        };
        let (keys, args) = call.keys_args();
        self.raw(&Script::new(RELEASE_LUA).command(&keys, &args, true))
    }

    /// A heartbeat of `owner` with no cleanup, from a VM that still needs every record it has.
    fn heartbeat(&mut self, owner: &str, lease_ms: u32) -> Frame {
        self.heartbeat_cleaning(owner, lease_ms, 0, &[])
    }

    /// A heartbeat of `owner` from a VM that needs only the records of `live`.
    fn heartbeat_needing(&mut self, owner: &str, lease_ms: u32, live: &[&str]) -> Frame {
        self.heartbeat_call(HeartbeatCall {
            inflight_key: "inflight".into(),
            lease_ms,
            owner_id: owner.into(),
            clean_interval_s: 0,
            live: live.iter().map(|id| id.to_string()).collect(),
            hosts: Vec::new(),
        })
    }

    fn heartbeat_cleaning(
        &mut self,
        owner: &str,
        lease_ms: u32,
        clean_interval_s: u64,
        in_cluster: &[&str],
    ) -> Frame {
        let live = match self.cmd(&["HKEYS", &format!("own:{owner}")]) {
            Frame::Array(ids) => ids
                .into_iter()
                .filter_map(|f| match f {
                    Frame::BulkString(b) => String::from_utf8(b).ok(),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        };
        self.heartbeat_call(HeartbeatCall {
            inflight_key: "inflight".into(),
            lease_ms,
            owner_id: owner.into(),
            clean_interval_s,
            live,
            hosts: in_cluster.iter().map(|h| h.to_string()).collect(),
        })
    }

    /// The heartbeat's first reply field (records released) as an integer frame, or its error;
    /// the second (counts the recount corrected) goes to `recounted`.
    fn heartbeat_call(&mut self, call: HeartbeatCall) -> Frame {
        let (keys, args) = call.keys_args();
        match self.raw(&Script::new(HEARTBEAT_LUA).command(&keys, &args, true)) {
            Frame::Array(v) => match v.as_slice() {
                [Frame::Integer(released), Frame::Integer(corrected)] => {
                    self.recounted = *corrected;
                    Frame::Integer(*released)
                }
                other => panic!("heartbeat reply {other:?}"),
            },
            other => other,
        }
    }

    /// Lets the next heartbeat recount (as once a minute).
    fn allow_recount(&mut self) {
        self.cmd(&["DEL", "last_recount"]);
    }

    /// As if a heartbeat had just recounted: the next minute's heartbeats do not.
    fn defer_recount(&mut self) {
        let now_ms = (self.now_s() * 1000).to_string();
        self.cmd(&["SET", "last_recount", &now_ms]);
    }

    fn hget(&mut self, key: &str, field: &str) -> Option<String> {
        match self.cmd(&["HGET", key, field]) {
            Frame::BulkString(b) => Some(String::from_utf8(b).unwrap()),
            _ => None,
        }
    }

    /// Redis's clock, in seconds.
    fn now_s(&mut self) -> u64 {
        match self.cmd(&["TIME"]) {
            Frame::Array(v) => match &v[0] {
                Frame::BulkString(b) => std::str::from_utf8(b).unwrap().parse().unwrap(),
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        }
    }
}

static REQ: AtomicUsize = AtomicUsize::new(0);

/// A least-request pick by owner `vm1` (lease 10 s, no limit) with a fresh request id; change fields
/// with struct update syntax. The in-flight key is `inflight`, so the scripts' other keys are
/// `owners`, `own:<owner>`, `pfx:<hex>` and `last_clean`.
fn lr(healthy: &[&str]) -> PickCall {
    as_owner("vm1", 10_000, healthy)
}

fn as_owner(owner: &str, lease_ms: u32, healthy: &[&str]) -> PickCall {
    PickCall {
        keys: StateKeys {
            inflight: "inflight".into(),
            last_clean: "last_clean".into(),
            owners: "owners".into(),
            owner: format!("own:{owner}"),
        },
        max_inflight: 0,
        lease_ms,
        owner_id: owner.into(),
        request_id: format!("q{}", REQ.fetch_add(1, Ordering::SeqCst)),
        ended: Vec::new(),
        healthy: healthy.iter().map(|h| h.to_string()).collect(),
        kind: PickKind::LeastRequest,
    }
}

/// A prefix-cache pick over chain values `chain` (keys `pfx:<value>`; see [`lr`]).
fn pc(chain: &[&str], maxc: u64, ttl_s: u64, factor: f64, healthy: &[&str]) -> PickCall {
    PickCall {
        max_inflight: maxc,
        kind: PickKind::Prefix {
            chain: chain.iter().map(|k| k.to_string()).collect(),
            ttl_s,
            // The test's Redis runs on this machine: its clock and the gateway's are one.
            now_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            hit_load_factor: factor,
            load: None,
            pin: None,
        },
        ..lr(healthy)
    }
}

fn pick(f: &Frame) -> (String, i64, i64, i64) {
    let p = parse_pick(f).unwrap_or_else(|| panic!("bad reply {f:?}"));
    (p.host, p.count, p.admitted as i64, p.matched)
}

#[test]
fn script_sha_matches_redis_and_noscript_is_recognised() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    let (keys, args) = lr(&["a"]).keys_args();
    let first = r.raw(&s.command(&keys, &args, false));
    assert!(crate::redis::is_noscript(&first), "{first:?}");
    assert_eq!(
        r.cmd(&["SCRIPT", "LOAD", LEAST_REQUEST_LUA.as_str()]),
        Frame::BulkString(s.sha.clone().into_bytes())
    );
}

#[test]
fn least_request_picks_the_minimum_counting_missing_hosts_as_zero() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    r.cmd(&["HSET", "inflight", "a", "3", "b", "1"]);
    let f = r.run(&s, &lr(&["a", "b", "c"]));
    assert_eq!(pick(&f).0, "c", "c is missing from the hash: 0 in flight");
    assert_eq!(r.count("c"), Some(1));
    let f = r.run(&s, &lr(&["a", "b", "c"]));
    assert_eq!(pick(&f).0, "b", "first minimum in the (shuffled) order wins ties");
    assert_eq!(r.count("b"), Some(2));
}

#[test]
fn least_request_rejects_above_max_and_undoes_the_increment() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    r.cmd(&["HSET", "inflight", "a", "2", "b", "2"]);
    let f = r.run(&s, &PickCall { max_inflight: 2, ..lr(&["a", "b"]) });
    assert_eq!(pick(&f), ("a".to_string(), 3, 0, 0));
    assert_eq!(r.count("a"), Some(2), "undone");
    assert_eq!(r.hget("own:vm1", &r.last_req.clone()), None, "no record");
    let f = r.run(&s, &PickCall { max_inflight: 3, ..lr(&["a", "b"]) });
    assert_eq!(pick(&f).2, 1);
    assert_eq!(r.count("a"), Some(3));
}

#[test]
fn heartbeats_clean_out_idle_hosts_that_left_every_interval() {
    let mut r = Redis::start();
    // Counts set by hand, with no records behind them: the recount (tested apart) would zero them.
    r.defer_recount();
    r.cmd(&["HSET", "inflight", "gone", "0", "sick", "4", "a", "1", "new", "2", "left", "1"]);
    let now = r.now_s();
    r.cmd(&["SET", "last_clean", &(now - 10).to_string()]);
    // Not yet due (interval 3600 s, last cleanup 10 s ago).
    r.heartbeat_cleaning("vm1", 10_000, 3600, &["a", "sick"]);
    assert_eq!(r.count("gone"), Some(0));
    r.cmd(&["SET", "last_clean", &(now - 4000).to_string()]);
    // A VM that never saw the host list (no pick yet) sends none: nothing is removed.
    r.heartbeat_cleaning("vm2", 10_000, 3600, &[]);
    assert_eq!(r.count("gone"), Some(0));
    r.heartbeat_cleaning("vm1", 10_000, 3600, &["a", "sick"]);
    assert_eq!(r.count("gone"), None, "removed");
    assert_eq!(r.count("sick"), Some(4), "unhealthy but still in the cluster: kept");
    // Not in vm1's view but with requests in flight: a pod vm1 has not seen yet (another gateway
    // already routes to it), or one that left before its requests ended. Its count is kept.
    assert_eq!(r.count("new"), Some(2), "a count above 0 is never removed");
    r.cmd(&["HSET", "inflight", "left", "0"]);
    r.cmd(&["SET", "last_clean", &(now - 4000).to_string()]);
    r.heartbeat_cleaning("vm1", 10_000, 3600, &["a", "sick"]);
    assert_eq!(r.count("left"), None, "removed once its requests ended");
    assert_eq!(r.count("new"), Some(2));
    let last: u64 = r.get("last_clean").unwrap().parse().unwrap();
    assert!(last >= now, "cleanup time set from Redis's clock: {last} vs {now}");
}

#[test]
fn least_request_repairs_negative_counts() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    r.cmd(&["HSET", "inflight", "a", "-2", "b", "0"]);
    let f = r.run(&s, &lr(&["a", "b"]));
    assert_eq!(pick(&f).0, "a");
    assert_eq!(r.count("a"), Some(1), "reset to 0 then +1");
}

#[test]
fn prefix_miss_writes_the_chain_to_the_least_loaded_host() {
    let mut r = Redis::start();
    let s = Script::new(PREFIX_CACHE_LUA.as_str());
    r.cmd(&["HSET", "inflight", "a", "5"]);
    let f = r.run(&s, &pc(&["k1", "k2"], 0, 600, 0.0, &["a", "b"]));
    assert_eq!(pick(&f), ("b".to_string(), 1, 1, 0));
    assert_eq!(r.holders("pfx:k1").as_deref(), Some("b"));
    assert_eq!(r.holders("pfx:k2").as_deref(), Some("b"));
    assert!((590..=600).contains(&r.ttl("pfx:k2")));
}

#[test]
fn a_stored_responses_miss_writes_its_key_only_when_held_to_the_recorded_pod() {
    let mut r = Redis::start();
    let s = Script::new(PREFIX_CACHE_LUA.as_str());
    let pinned = |fallback_pod: Option<&str>, healthy: &[&str]| {
        let mut call = pc(&["resp", "k2"], 0, 600, 0.0, healthy);
        if let PickKind::Prefix { pin, .. } = &mut call.kind {
            *pin = Some(Pin { fallback_pod: fallback_pod.map(str::to_string) });
        }
        call
    };
    // Unknown here: the miss goes to a pod, but writes only the blocks after the response's.
    r.cmd(&["HSET", "inflight", "a", "5"]);
    let f = r.run(&s, &pinned(None, &["a", "b"]));
    assert_eq!(pick(&f), ("b".to_string(), 1, 1, 0));
    assert_eq!(r.holders("pfx:resp"), None, "no key naming a pod that may answer 404");
    assert_eq!(r.holders("pfx:k2").as_deref(), Some("b"));
    // Held to the pod this gateway recorded: the miss writes the key back.
    let f = r.run(&s, &pinned(Some("a"), &["a"]));
    assert_eq!(pick(&f), ("a".to_string(), 6, 1, 0));
    assert_eq!(r.holders("pfx:resp").as_deref(), Some("a"));
    // Once there, it is followed whatever the pick's candidates.
    let f = r.run(&s, &pinned(None, &["b", "a"]));
    assert_eq!(pick(&f), ("a".to_string(), 7, 1, 2));
}

#[test]
fn prefix_hit_routes_to_the_holder_refreshes_and_extends_the_chain() {
    let mut r = Redis::start();
    let s = Script::new(PREFIX_CACHE_LUA.as_str());
    r.cmd(&["SET", "pfx:k1", "a", "EX", "10"]);
    r.cmd(&["SET", "pfx:k2", "a", "EX", "10"]);
    r.cmd(&["HSET", "inflight", "a", "3", "b", "0"]);
    let f = r.run(&s, &pc(&["k1", "k2", "k3"], 0, 600, 0.0, &["b", "a"]));
    assert_eq!(pick(&f), ("a".to_string(), 4, 1, 2));
    assert!(r.ttl("pfx:k1") > 10, "matched keys written long ago refreshed");
    assert_eq!(r.holders("pfx:k3").as_deref(), Some("a"));
    // Keys written within the last eighth of their TTL are left as they are (no write per block
    // per hit); older ones get a new time and the full TTL.
    let now: u64 = match r.cmd(&["TIME"]) {
        Frame::Array(t) => match t.first() {
            Some(Frame::BulkString(b)) => String::from_utf8_lossy(b).parse().unwrap(),
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    };
    let recent = format!("a@{}", now - 10);
    let old = format!("a@{}", now - 100);
    r.cmd(&["SET", "pfx:k1", &recent, "EX", "500"]);
    r.cmd(&["SET", "pfx:k2", &old, "EX", "500"]);
    let f = r.run(&s, &pc(&["k1", "k2"], 0, 600, 0.0, &["b", "a"]));
    assert_eq!(pick(&f), ("a".to_string(), 5, 1, 2));
    assert_eq!((r.get("pfx:k1"), r.ttl("pfx:k1") <= 500), (Some(recent), true), "10 s < 600/8");
    let written = r.get("pfx:k2").and_then(|v| v.strip_prefix("a@")?.parse::<u64>().ok());
    assert!(written.is_some_and(|t| t >= now), "k2 written again: {written:?}");
    assert!(r.ttl("pfx:k2") > 500, "k2's TTL back to 600");
}

/// Keys Redis looked up to read them (`keyspace_hits` + `keyspace_misses`; writes do not count).
fn key_reads(r: &mut Redis) -> u64 {
    let Frame::BulkString(info) = r.cmd(&["INFO", "stats"]) else { return 0 };
    let info = String::from_utf8_lossy(&info).into_owned();
    ["keyspace_hits:", "keyspace_misses:"]
        .iter()
        .filter_map(|name| info.lines().find_map(|l| l.strip_prefix(name)))
        .filter_map(|v| v.trim().parse::<u64>().ok())
        .sum()
}

#[test]
fn a_long_conversations_next_request_reads_its_last_two_keys_only() {
    let mut r = Redis::start();
    let s = Script::new(PREFIX_CACHE_LUA.as_str());
    let now = r.now_s();
    // The 29 blocks of a conversation's last request, on `a`: k1 written 300 s ago (past an
    // eighth of 1800 s), the rest just now.
    r.cmd(&["SET", "pfx:k1", &format!("a@{}", now - 300), "EX", "1500"]);
    for i in 2..=29 {
        r.cmd(&["SET", &format!("pfx:k{i}"), &format!("a@{now}"), "EX", "1800"]);
    }
    let names: Vec<String> = (1..=30).map(|i| format!("k{i}")).collect();
    let chain: Vec<&str> = names.iter().map(String::as_str).collect();
    let reads = key_reads(&mut r);
    let f = r.run(&s, &pc(&chain, 0, 1800, 0.0, &["b", "a"]));
    assert_eq!(pick(&f), ("a".to_string(), 1, 1, 29), "all 29 blocks matched");
    // k29 and k30, the in-flight counts and the owner's registration: not 30 prefix keys.
    let read = key_reads(&mut r) - reads;
    assert!(read <= 5, "{read} keys read");
    assert_eq!(r.holders("pfx:k30").as_deref(), Some("a"), "the new block written");
    assert!(r.ttl("pfx:k1") <= 1500, "a key before the match is left as it is");

    // The match due for its refresh (k29 written 300 s ago): the whole chain is read, and every
    // matched key past an eighth of its TTL written again.
    r.cmd(&["SET", "pfx:k29", &format!("a@{}", now - 300), "EX", "1500"]);
    r.cmd(&["DEL", "pfx:k30"]);
    let reads = key_reads(&mut r);
    let f = r.run(&s, &pc(&chain, 0, 1800, 0.0, &["b", "a"]));
    assert_eq!(pick(&f).3, 29);
    assert!(key_reads(&mut r) - reads >= 30);
    assert!(r.ttl("pfx:k1") > 1500 && r.ttl("pfx:k29") > 1500, "k1 and k29 refreshed");

    // A key is evidence by itself: k29 fresh with every key before it gone still matches 29.
    for i in (1..=28).chain([30]) {
        r.cmd(&["DEL", &format!("pfx:k{i}")]);
    }
    r.cmd(&["SET", "pfx:k29", &format!("a@{now}"), "EX", "1800"]);
    let f = r.run(&s, &pc(&chain, 0, 1800, 0.0, &["a", "b"]));
    assert_eq!(pick(&f).3, 29);

    // Its holder unhealthy (not among the candidates): the whole chain decides, as before.
    let f = r.run(&s, &pc(&chain, 0, 1800, 0.0, &["b"]));
    assert_eq!(pick(&f), ("b".to_string(), 1, 1, 0));
    assert_eq!(r.holders("pfx:k29").as_deref(), Some("b"), "re-homed in place");
    assert_eq!(r.holders("pfx:k1").as_deref(), Some("b"));
}

#[test]
fn prefix_keys_are_stamped_with_the_gateways_clock_not_redis() {
    // Gateways share the stamps through Redis, so the pick takes the time it is given: here a
    // gateway whose clock is 1000 s behind Redis's. A key it stamped 100 s ago by its own clock is
    // fresh to it; the keys it writes carry its time.
    let mut r = Redis::start();
    let s = Script::new(PREFIX_CACHE_LUA.as_str());
    let gateway_now = r.now_s() - 1000;
    let recent = format!("a@{}", gateway_now - 100);
    r.cmd(&["SET", "pfx:k1", &recent, "EX", "500"]);
    let mut call = pc(&["k1", "k2"], 0, 1800, 0.0, &["b", "a"]);
    if let PickKind::Prefix { now_s, .. } = &mut call.kind {
        *now_s = gateway_now;
    }
    let f = r.run(&s, &call);
    assert_eq!(pick(&f), ("a".to_string(), 1, 1, 1));
    assert_eq!(r.get("pfx:k1"), Some(recent), "100 s < 1800/8 by the gateway's clock: not written");
    assert_eq!(r.get("pfx:k2"), Some(format!("a@{gateway_now}")), "the new key carries its time");
}

#[test]
fn prefix_hit_on_an_unhealthy_host_rehomes_that_key_and_keeps_the_chain_aligned() {
    let mut r = Redis::start();
    let s = Script::new(PREFIX_CACHE_LUA.as_str());
    // k1 on healthy a; k2, k3 on sick (unhealthy) host; k4 new.
    r.cmd(&["SET", "pfx:k1", "a"]);
    r.cmd(&["SET", "pfx:k2", "sick"]);
    r.cmd(&["SET", "pfx:k3", "sick"]);
    let f = r.run(&s, &pc(&["k1", "k2", "k3", "k4"], 0, 600, 0.0, &["b", "a"]));
    assert_eq!(pick(&f), ("a".to_string(), 1, 1, 1), "longest prefix on a healthy host");
    for k in ["pfx:k1", "pfx:k2", "pfx:k3", "pfx:k4"] {
        assert_eq!(r.holders(k).as_deref(), Some("a"), "{k} re-homed in place");
    }
    // Everything on a gone host: least-loaded host takes the whole chain, same keys.
    r.cmd(&["SET", "pfx:j1", "gone"]);
    r.cmd(&["SET", "pfx:j2", "gone"]);
    r.cmd(&["HSET", "inflight", "a", "9"]);
    let f = r.run(&s, &pc(&["j1", "j2"], 0, 600, 0.0, &["a", "b"]));
    assert_eq!(pick(&f), ("b".to_string(), 1, 1, 0));
    assert_eq!(r.holders("pfx:j1").as_deref(), Some("b"));
    assert_eq!(r.holders("pfx:j2").as_deref(), Some("b"));
    let keys = r.cmd(&["KEYS", "*"]);
    let Frame::Array(keys) = keys else { panic!() };
    assert_eq!(
        keys.len(),
        9,
        "k1-k4, j1-j2, the in-flight hash, the owners and one owner's hash only: {keys:?}"
    );
}

#[test]
fn prefix_load_guard_and_max_request_count() {
    let mut r = Redis::start();
    let s = Script::new(PREFIX_CACHE_LUA.as_str());
    r.cmd(&["SET", "pfx:k1", "a"]);
    r.cmd(&["HSET", "inflight", "a", "10", "b", "1"]);
    // factor 2: a has 10 > 2 * (1 + 1) -> spill to b, chain beyond the match goes to b.
    let f = r.run(&s, &pc(&["k1", "k2"], 0, 600, 2.0, &["a", "b"]));
    assert_eq!(pick(&f).0, "b");
    assert!(parse_pick(&f).is_some_and(|p| p.diverted && p.matched == 1), "a diverted hit");
    assert_eq!(r.holders("pfx:k1").as_deref(), Some("a"), "a still holds the matched prefix");
    assert_eq!(r.holders("pfx:k2").as_deref(), Some("b"));
    // Guard off: the hit wins despite the load.
    let f = r.run(&s, &pc(&["k1"], 0, 600, 0.0, &["a", "b"]));
    assert_eq!(pick(&f).0, "a");
    assert!(parse_pick(&f).is_some_and(|p| !p.diverted), "a plain hit");
    // maxRequestCount 11: a is full (11 -> 12 > 11), falls back to b.
    let f = r.run(&s, &pc(&["k1"], 11, 600, 0.0, &["a", "b"]));
    assert_eq!(pick(&f).0, "b");
    assert_eq!(r.count("a"), Some(11), "undone");
    // Everyone full: rejected, nothing counted, nothing written.
    r.cmd(&["HSET", "inflight", "b", "11"]);
    let f = r.run(&s, &pc(&["k1", "k9"], 11, 600, 0.0, &["a", "b"]));
    assert_eq!(pick(&f).2, 0);
    assert_eq!(r.count("a"), Some(11));
    assert_eq!(r.count("b"), Some(11));
    assert_eq!(r.holders("pfx:k9"), None);
}

#[test]
fn release_undoes_the_pick_exactly_once() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    let f = r.run(&s, &lr(&["a"]));
    assert_eq!(pick(&f).0, "a");
    let req = r.last_req.clone();
    assert_eq!(r.hget("own:vm1", &req).as_deref(), Some("a"), "pick record");
    assert_eq!(r.release("vm1", &req, Some("a")), Frame::Integer(1));
    assert_eq!(r.count("a"), Some(0));
    assert_eq!(r.hget("own:vm1", &req), None, "record deleted");
    assert_eq!(r.cmd(&["HKEYS", "own:vm1"]), marker_only(), "only the owner's marker is left");
    assert_eq!(r.release("vm1", &req, Some("a")), Frame::Integer(0), "second: no-op");
    assert_eq!(r.count("a"), Some(0));
}

#[test]
fn a_pick_carries_releases_exactly_once_and_nets_them_with_its_own_count() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    let first = lr(&["a"]);
    assert_eq!(pick(&r.run(&s, &first)).0, "a");
    assert_eq!(pick(&r.run(&s, &lr(&["b"]))).0, "b");
    // The third pick carries the first's release: a is free again, so a is chosen, and its count
    // (1 - 1 + 1) needs no write.
    let third = PickCall { ended: vec![(first.request_id.clone(), "a".into())], ..lr(&["b", "a"]) };
    assert_eq!(pick(&r.run(&s, &third)), ("a".to_string(), 1, 1, 0));
    assert_eq!((r.count("a"), r.count("b")), (Some(1), Some(1)));
    assert_eq!(r.hget("own:vm1", &first.request_id), None, "the first's record is gone");
    assert_eq!(r.hget("own:vm1", &third.request_id).as_deref(), Some("a"));
    // The same release carried again (its first carrier's reply was lost) changes nothing; one
    // that names no record (never admitted, or reaped) neither.
    let fourth = PickCall {
        ended: vec![(first.request_id.clone(), "a".into()), ("nope".into(), "b".into())],
        ..lr(&["b", "a"])
    };
    assert_eq!(pick(&r.run(&s, &fourth)).1, 2);
    assert_eq!(r.count("a").unwrap() + r.count("b").unwrap(), 3, "three requests in flight");
    // A 429 (maxRequestCount) still applies the releases it carries.
    let full = PickCall {
        max_inflight: 1,
        ended: vec![(third.request_id.clone(), "a".into())],
        ..lr(&["b"])
    };
    let f = r.run(&s, &full);
    assert_eq!(pick(&f).2, 0, "not admitted: {f:?}");
    assert_eq!((r.count("a"), r.count("b")), (Some(0), Some(2)));
    assert_eq!(r.hget("own:vm1", &full.request_id), None, "no record for a 429");
}

/// `n` least-request picks of `vm1` over pods `a` and `b`, and the pod each went to.
fn picks_over_a_and_b(r: &mut Redis, s: &Script, n: usize) -> (Vec<PickCall>, Vec<String>) {
    let picks: Vec<PickCall> = (0..n).map(|_| lr(&["a", "b"])).collect();
    let pods = picks.iter().map(|p| pick(&r.run(s, p)).0).collect();
    (picks, pods)
}

#[test]
fn a_least_request_pick_carrying_several_releases_applies_only_those_still_held() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    let (picks, pods) = picks_over_a_and_b(&mut r, &s, 4);
    assert_eq!((r.count("a"), r.count("b")), (Some(2), Some(2)));
    // The first is released on its own; a later pick then carries it again (its release's outcome
    // was unknown), the second and third, and an id that names no record.
    assert_eq!(r.release("vm1", &picks[0].request_id, Some(&pods[0])), Frame::Integer(1));
    let ended: Vec<(String, String)> =
        (0..3).map(|i| (picks[i].request_id.clone(), pods[i].clone())).collect();
    let carrier =
        PickCall { ended: [ended, vec![("nope".into(), "a".into())]].concat(), ..lr(&["a", "b"]) };
    r.cmd(&["CONFIG", "RESETSTAT"]);
    let (host, count, admitted, _) = pick(&r.run(&s, &carrier));
    assert_eq!((count, admitted), (1, 1), "one in flight left, on {}: it picks the other", pods[3]);
    assert_ne!(host, pods[3]);
    assert_eq!(r.count("a").unwrap() + r.count("b").unwrap(), 2, "the fourth and the carrier");
    assert_eq!((calls(&mut r, "hmget"), calls(&mut r, "hdel")), (1, 1), "one read, one delete");
    for p in &picks[..3] {
        assert_eq!(r.hget("own:vm1", &p.request_id), None, "released record gone");
    }
    // A pick with no candidate still applies what it carries (by HINCRBY: it read no counts).
    let empty = PickCall { ended: vec![(picks[3].request_id.clone(), pods[3].clone())], ..lr(&[]) };
    let none =
        Frame::Array(vec![Frame::BulkString(Vec::new()), Frame::Integer(0), Frame::Integer(0)]);
    assert_eq!(r.run(&s, &empty), none, "no candidate: no pick");
    assert_eq!(r.count(&pods[3]), Some(0));
    assert_eq!(r.count(&host), Some(1), "the carrier's own request is still in flight");
    assert_eq!(r.hget("own:vm1", &picks[3].request_id), None);
}

#[test]
fn one_release_call_releases_many_requests_exactly_once() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    let (picks, pods) = picks_over_a_and_b(&mut r, &s, 5);
    assert_eq!(r.count("a").unwrap() + r.count("b").unwrap(), 5);
    let call = ReleaseCall {
        inflight_key: "inflight".into(),
        owner_id: "vm1".into(),
        ended: picks[..4]
            .iter()
            .zip(&pods)
            .map(|(p, h)| (p.request_id.clone(), h.clone()))
            .collect(),
        abandoned: Some(picks[4].request_id.clone()),
    };
    let (keys, args) = call.keys_args();
    let release = Script::new(RELEASE_LUA);
    assert_eq!(r.run_keys(&release, &keys, &args), Frame::Integer(5));
    assert_eq!((r.count("a"), r.count("b")), (Some(0), Some(0)));
    assert_eq!(r.cmd(&["HKEYS", "own:vm1"]), marker_only(), "no record left");
    assert_eq!(r.run_keys(&release, &keys, &args), Frame::Integer(0), "sent again: no-op");
    assert_eq!((r.count("a"), r.count("b")), (Some(0), Some(0)));
}

#[test]
fn a_prefix_pick_carries_releases() {
    let mut r = Redis::start();
    let s = Script::new(PREFIX_CACHE_LUA.as_str());
    let first = pc(&["k1"], 0, 600, 0.0, &["a", "b"]);
    let home = pick(&r.run(&s, &first)).0;
    // Same prefix again, carrying the first's release: a hit on its pod, whose count stays 1.
    let again = PickCall {
        ended: vec![(first.request_id.clone(), home.clone())],
        ..pc(&["k1"], 0, 600, 0.0, &["a", "b"])
    };
    assert_eq!(pick(&r.run(&s, &again)), (home.clone(), 1, 1, 1));
    assert_eq!(r.count(&home), Some(1));
    assert_eq!(r.hget("own:vm1", &first.request_id), None);
}

#[test]
fn a_pick_cancelled_before_it_runs_does_nothing_when_it_arrives_late() {
    // A stalled Redis runs the pick after the plugin gave up (timeout) and sent the cancel.
    let mut r = Redis::start();
    let s = Script::new(PREFIX_CACHE_LUA.as_str());
    let late = pc(&["k1"], 0, 600, 0.0, &["a"]);
    assert_eq!(r.release("vm1", &late.request_id, None), Frame::Integer(0));
    assert_eq!(r.release("vm1", &late.request_id, None), Frame::Integer(0), "resent");
    let tomb = r.hget("own:vm1", &late.request_id).unwrap_or_default();
    assert!(tomb.starts_with('#'), "a tombstone with its time: {tomb:?}");
    let f = r.run(&s, &late);
    assert!(parse_pick(&f).is_none(), "no pick: {f:?}");
    assert_eq!(r.count("a"), None, "never counted: the tombstone is found before the +1");
    assert_eq!(r.holders("pfx:k1"), None, "nothing written");
    assert_eq!(r.hget("own:vm1", &late.request_id), None, "tombstone consumed");
    // Cancel after the pick ran (same connection order): undone.
    let ran = pc(&["k1"], 0, 600, 0.0, &["a"]);
    let f = r.run(&s, &ran);
    assert_eq!(pick(&f).0, "a");
    assert_eq!(r.release("vm1", &ran.request_id, None), Frame::Integer(1));
    assert_eq!(r.count("a"), Some(0));
}

#[test]
fn a_dead_owners_counts_are_subtracted_once_its_lease_runs_out() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    // vm1 (lease 1 s) takes a and b, then dies without releasing; vm2 (lease 10 s) takes c.
    let first = as_owner("vm1", 1000, &["a", "b", "c"]);
    assert_eq!(pick(&r.run(&s, &first)).0, "a");
    assert_eq!(pick(&r.run(&s, &as_owner("vm1", 1000, &["b", "c"]))).0, "b");
    assert_eq!(pick(&r.run(&s, &as_owner("vm2", 10_000, &["c"]))).0, "c");
    // Within the lease nothing is taken away.
    assert_eq!(r.heartbeat("vm2", 10_000), Frame::Integer(0));
    assert_eq!((r.count("a"), r.count("b")), (Some(1), Some(1)));
    std::thread::sleep(Duration::from_millis(1100));
    // The next heartbeat of any live VM subtracts vm1's picks.
    assert_eq!(r.heartbeat("vm2", 10_000), Frame::Integer(0));
    assert_eq!((r.count("a"), r.count("b"), r.count("c")), (Some(0), Some(0), Some(1)));
    let f = r.run(&s, &as_owner("vm2", 10_000, &["a", "c"]));
    assert_eq!(pick(&f), ("a".to_string(), 1, 1, 0));
    assert_eq!(r.cmd(&["EXISTS", "own:vm1"]), Frame::Integer(0), "the dead owner's hash is gone");
    assert_eq!(r.cmd(&["ZSCORE", "owners", "vm1"]), Frame::Null);
    // vm1's release, should it still arrive, changes nothing.
    assert_eq!(r.release("vm1", &first.request_id, Some("a")), Frame::Integer(0));
    assert_eq!(r.count("a"), Some(1));
}

#[test]
fn heartbeats_keep_a_live_owners_counts() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    assert_eq!(pick(&r.run(&s, &as_owner("vm1", 1000, &["a"]))).0, "a");
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(r.heartbeat("vm1", 1000), Frame::Integer(0));
    }
    r.run(&s, &PickCall { max_inflight: 1, ..as_owner("vm2", 1000, &["b"]) });
    assert_eq!(r.count("a"), Some(1), "1.2 s later, vm1's lease is still running");
}

#[test]
fn an_owner_is_registered_with_its_marker_and_keeps_it_until_reaped() {
    // The marker keeps the owner's hash alive while records come and go (deleting its last record
    // must not delete it: see shared.lua); a heartbeat registers with it, and the reaper removes it.
    let mut r = Redis::start();
    assert_eq!(r.heartbeat("vm9", 1000), Frame::Integer(0));
    assert_eq!(r.cmd(&["HKEYS", "own:vm9"]), Frame::Array(vec![Frame::BulkString("~".into())]));
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    let first = as_owner("vm9", 1000, &["a"]);
    assert_eq!(pick(&r.run(&s, &first)).0, "a");
    let next = PickCall {
        ended: vec![(first.request_id.clone(), "a".into())],
        ..as_owner("vm9", 1000, &["a"])
    };
    assert_eq!(pick(&r.run(&s, &next)), ("a".to_string(), 1, 1, 0), "first released, next counted");
    assert_eq!(r.release("vm9", &next.request_id, Some("a")), Frame::Integer(1));
    assert_eq!(r.cmd(&["HKEYS", "own:vm9"]), Frame::Array(vec![Frame::BulkString("~".into())]));
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(r.heartbeat("live", 10_000), Frame::Integer(0));
    assert_eq!(r.cmd(&["EXISTS", "own:vm9"]), Frame::Integer(0), "reaped with its marker");
    assert_eq!(r.count("a"), Some(0));
}

#[test]
fn no_key_the_counts_depend_on_has_a_ttl() {
    // Under a volatile-* maxmemory policy Redis evicts only keys with a TTL.
    let mut r = Redis::start();
    let f = r.run(&Script::new(PREFIX_CACHE_LUA.as_str()), &pc(&["k1"], 0, 600, 0.0, &["a"]));
    assert_eq!(pick(&f).0, "a");
    r.release("vm1", "abandoned-before-it-ran", None);
    for k in ["inflight", "owners", "own:vm1"] {
        assert_eq!(r.ttl(k), -1, "{k} must not expire");
    }
    assert!(r.ttl("pfx:k1") > 0, "prefix keys do expire (a lost one only costs a cache miss)");
}

#[test]
fn a_live_owners_heartbeat_reaps_a_dead_one_without_any_pick() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    assert_eq!(pick(&r.run(&s, &as_owner("dead", 500, &["a"]))).0, "a");
    assert_eq!(r.heartbeat("live", 10_000), Frame::Integer(0));
    assert_eq!(r.count("a"), Some(1));
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(r.heartbeat("live", 10_000), Frame::Integer(0));
    assert_eq!(r.count("a"), Some(0), "the dead owner's +1 is gone");
    assert_eq!(r.cmd(&["ZSCORE", "owners", "dead"]), Frame::Null);
}

#[test]
fn a_late_pick_of_a_reaped_owner_registers_it_again_so_its_count_is_reaped_too() {
    // A gateway dies during a freeze; a pick it sent before is read from its socket and run after
    // the reaper removed the owner.
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    assert_eq!(pick(&r.run(&s, &as_owner("dead", 1000, &["a"]))).0, "a");
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(r.heartbeat("live", 10_000), Frame::Integer(0));
    assert_eq!((r.count("a"), r.cmd(&["ZSCORE", "owners", "dead"])), (Some(0), Frame::Null));
    assert_eq!(pick(&r.run(&s, &as_owner("dead", 1000, &["a"]))).0, "a", "the late pick");
    assert!(matches!(r.cmd(&["ZSCORE", "owners", "dead"]), Frame::BulkString(_)), "registered");
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(r.heartbeat("live", 10_000), Frame::Integer(0));
    assert_eq!(r.count("a"), Some(0), "reaped one lease later");
}

#[test]
fn a_late_pick_carrying_releases_of_a_reaped_owner_registers_it_again() {
    // As above, but the late pick carries releases: their records went with the reaped hash, so
    // they prove nothing and the pick reads the owners set and registers its owner.
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    let first = as_owner("dead", 1000, &["a", "b"]);
    assert_eq!(pick(&r.run(&s, &first)).0, "a");
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(r.heartbeat("live", 10_000), Frame::Integer(0));
    assert_eq!((r.count("a"), r.cmd(&["ZSCORE", "owners", "dead"])), (Some(0), Frame::Null));
    let late = PickCall {
        ended: vec![(first.request_id.clone(), "a".into())],
        ..as_owner("dead", 1000, &["b"])
    };
    assert_eq!(pick(&r.run(&s, &late)), ("b".to_string(), 1, 1, 0), "the late pick");
    assert_eq!(r.count("a"), Some(0), "the reaped request is not released twice");
    assert!(matches!(r.cmd(&["ZSCORE", "owners", "dead"]), Frame::BulkString(_)), "registered");
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(r.heartbeat("live", 10_000), Frame::Integer(0));
    assert_eq!(r.count("b"), Some(0), "reaped one lease later");
}

#[test]
fn a_heartbeat_releases_the_records_its_vm_no_longer_needs_exactly_once() {
    // Redis came back from a snapshot older than vm1's releases: records of requests that ended
    // since are there again, with their +1s. vm1's heartbeat lists what it still needs (one
    // request in flight, one whose release is on its way); the others are released.
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    let ids: Vec<String> = (0..4)
        .map(|_| {
            let call = as_owner("vm1", 10_000, &["a"]);
            assert_eq!(pick(&r.run(&s, &call)).0, "a");
            call.request_id
        })
        .collect();
    assert_eq!(pick(&r.run(&s, &as_owner("vm2", 10_000, &["b"]))).0, "b");
    // A tombstone: vm1 gave up a pick that has not run yet.
    assert_eq!(r.release("vm1", "late", None), Frame::Integer(0));
    assert_eq!(r.count("a"), Some(4));
    let live = [ids[0].as_str(), ids[1].as_str()];
    assert_eq!(r.heartbeat_needing("vm1", 10_000, &live), Frame::Integer(2));
    assert_eq!(r.count("a"), Some(2), "two +1s left: the requests vm1 still needs");
    assert_eq!(r.count("b"), Some(1), "another owner's records are its own business");
    assert_eq!(r.hget("own:vm1", &ids[2]), None);
    let tomb = r.hget("own:vm1", "late").unwrap_or_default();
    assert!(tomb.starts_with('#'), "the tombstone stays while younger than a lease: {tomb:?}");
    assert_eq!(r.hget("own:vm1", "~").as_deref(), Some(""), "and the marker");
    // Exactly once: the next heartbeat and a late release of a released record change nothing;
    // the releases vm1 still sends work as before.
    assert_eq!(r.heartbeat_needing("vm1", 10_000, &live), Frame::Integer(0));
    assert_eq!(r.release("vm1", &ids[2], Some("a")), Frame::Integer(0));
    assert_eq!(r.release("vm1", &ids[1], Some("a")), Frame::Integer(1));
    assert_eq!(r.count("a"), Some(1));
    // The pick that was given up arrives late: the tombstone still stops it.
    let late = PickCall { request_id: "late".into(), ..as_owner("vm1", 10_000, &["a"]) };
    assert!(parse_pick(&r.run(&s, &late)).is_none());
    assert_eq!(r.count("a"), Some(1));
}

#[test]
fn a_heartbeat_deletes_tombstones_a_lease_old_and_a_later_pick_is_still_released_once() {
    // Picks given up and cancelled before they ran (a 429 reply that came too late, a pick lost
    // at a failover) leave tombstones; without an end, an owner living for months would gather
    // them by the million, and every heartbeat reads the whole hash.
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    let lease = 300;
    assert_eq!(r.release("vm1", "gone1", None), Frame::Integer(0));
    assert_eq!(r.release("vm1", "gone2", None), Frame::Integer(0));
    // A tombstone as versions before 2026-11-27 wrote it: no time, so old.
    r.cmd(&["HSET", "own:vm1", "legacy", ""]);
    assert_eq!(r.heartbeat_needing("vm1", lease, &["gone2"]), Frame::Integer(0));
    assert_eq!(r.hget("own:vm1", "legacy"), None, "an old tombstone the VM does not list goes");
    assert!(r.hget("own:vm1", "gone1").is_some(), "younger than a lease: stays");
    std::thread::sleep(Duration::from_millis(u64::from(lease) + 50));
    assert_eq!(r.heartbeat_needing("vm1", lease, &["gone2"]), Frame::Integer(0));
    assert_eq!(r.hget("own:vm1", "gone1"), None, "a lease old and not listed: deleted");
    assert!(r.hget("own:vm1", "gone2").is_some(), "still listed by the VM: kept");
    assert_eq!(r.hget("own:vm1", "~").as_deref(), Some(""), "the marker stays");
    // The abandoned pick arrives later still: admitted (no tombstone), and its record, which the
    // VM does not list, is released by the next heartbeat, once.
    let late = PickCall { request_id: "gone1".into(), ..as_owner("vm1", lease, &["a"]) };
    assert_eq!(pick(&r.run(&s, &late)).0, "a");
    assert_eq!(r.count("a"), Some(1));
    assert_eq!(r.heartbeat_needing("vm1", lease, &["gone2"]), Frame::Integer(1));
    assert_eq!(r.count("a"), Some(0));
    assert_eq!(r.heartbeat_needing("vm1", lease, &["gone2"]), Frame::Integer(0));
    assert_eq!(r.count("a"), Some(0));
    // A release sent again for the tombstoned id neither counts it nor takes the tombstone for a
    // record.
    assert_eq!(r.release("vm1", "gone2", None), Frame::Integer(0));
    assert_eq!(r.count("a"), Some(0));
}

#[test]
fn once_a_minute_a_heartbeat_sets_every_count_to_the_live_owners_records() {
    // Counts that went wrong whatever the cause (here: a +1 with no record, as a pick run on the
    // importing master of a half-moved Redis Cluster slot leaves once the resharding tool
    // replaced its owner's hash; and a -1 too many) mend at the next recount, and only then.
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    r.defer_recount();
    let mut held = Vec::new();
    for owner in ["vm1", "vm1", "vm2"] {
        let call = as_owner(owner, 10_000, &["a", "b"]);
        held.push((owner, pick(&r.run(&s, &call)).0, call.request_id));
    }
    r.cmd(&["HINCRBY", "inflight", "a", "1"]);
    r.cmd(&["HINCRBY", "inflight", "b", "-1"]);
    r.cmd(&["HSET", "inflight", "c", "3"]);
    let (a, b) = (r.count("a").unwrap(), r.count("b").unwrap());
    assert_eq!(r.heartbeat("vm1", 10_000), Frame::Integer(0));
    assert_eq!(r.recounted, 0, "not a minute since the last recount");
    assert_eq!((r.count("a"), r.count("b")), (Some(a), Some(b)));
    r.allow_recount();
    assert_eq!(r.heartbeat("vm1", 10_000), Frame::Integer(0));
    assert_eq!(r.recounted, 3, "a, b and c corrected");
    let truth = |pod: &str| held.iter().filter(|(_, p, _)| p == pod).count() as i64;
    assert_eq!(r.count("a"), Some(truth("a")));
    assert_eq!(r.count("b"), Some(truth("b")));
    assert_eq!(r.count("c"), Some(0));
    // From there, releases bring every count to 0 exactly.
    for (owner, pod, id) in &held {
        assert_eq!(r.release(owner, id, Some(pod)), Frame::Integer(1));
    }
    assert_eq!((r.count("a"), r.count("b")), (Some(0), Some(0)));
    r.allow_recount();
    assert_eq!(r.heartbeat("vm2", 10_000), Frame::Integer(0));
    assert_eq!(r.recounted, 0, "nothing left to correct");
}

/// `HKEYS` of an owner's hash holding no record: only the marker that keeps it (prelude.lua).
fn marker_only() -> Frame {
    Frame::Array(vec![Frame::BulkString("~".into())])
}

/// Calls of `cmd` run inside scripts since the last `CONFIG RESETSTAT` (INFO commandstats).
fn calls(r: &mut Redis, cmd: &str) -> u64 {
    let Frame::BulkString(info) = r.cmd(&["INFO", "commandstats"]) else { return 0 };
    let info = String::from_utf8_lossy(&info).into_owned();
    let line = format!("cmdstat_{cmd}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(&line))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_pick_carrying_a_release_skips_the_owner_read_and_writes_counts_once() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    let first = lr(&["a", "b"]);
    assert_eq!(pick(&r.run(&s, &first)).0, "a");
    r.cmd(&["CONFIG", "RESETSTAT"]);
    // The carried record of `a` was there: its owner is registered without a ZSCORE. Its -1 on
    // `a` and the +1 on the chosen pod go out in one HSET.
    let next = PickCall { ended: vec![(first.request_id.clone(), "a".into())], ..lr(&["b", "a"]) };
    assert_eq!(pick(&r.run(&s, &next)), ("b".to_string(), 1, 1, 0));
    assert_eq!((r.count("a"), r.count("b")), (Some(0), Some(1)));
    assert_eq!(calls(&mut r, "zscore"), 0, "owner proven by its carried record");
    assert_eq!((calls(&mut r, "hset"), calls(&mut r, "hincrby")), (1, 0), "one count write");
    // The carried record goes by one HDEL whose reply proves it was there (no HMGET of records);
    // the counts are read by one HGETALL.
    assert_eq!((calls(&mut r, "hdel"), calls(&mut r, "hmget")), (1, 0), "one record command");
    assert_eq!(calls(&mut r, "hgetall"), 1, "one read of the counts");
    // Sent again (unknown outcome): the record is gone, so nothing is released twice, and the
    // owner is checked the ordinary way.
    let again = PickCall { ended: next.ended.clone(), ..lr(&["a"]) };
    assert_eq!(pick(&r.run(&s, &again)), ("a".to_string(), 1, 1, 0));
    assert_eq!((r.count("a"), r.count("b")), (Some(1), Some(1)));
    assert_eq!(calls(&mut r, "zscore"), 1);
    // A release whose pod is no longer a candidate still goes down (by HINCRBY).
    let gone = PickCall { ended: vec![(again.request_id.clone(), "a".into())], ..lr(&["b"]) };
    assert_eq!(pick(&r.run(&s, &gone)), ("b".to_string(), 2, 1, 0));
    assert_eq!((r.count("a"), r.count("b")), (Some(0), Some(2)));
}

#[test]
fn least_request_hosts_go_whole_and_the_least_loaded_wins() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    let hosts = ["10.0.0.1:8000", "10.0.0.12:8000", "[fd00::3]:8000"];
    let call = lr(&hosts);
    let (_, args) = call.keys_args();
    assert_eq!(args[4..], hosts, "each healthy host whole, after the four common arguments");
    r.cmd(&["HSET", "inflight", "10.0.0.1:8000", "3", "[fd00::3]:8000", "2"]);
    assert_eq!(pick(&r.run(&s, &call)), ("10.0.0.12:8000".to_string(), 1, 1, 0));
    assert_eq!(r.count("10.0.0.12:8000"), Some(1));
    // No healthy host (the plugin never sends that, but a script must not fail on it): nothing is
    // picked and no count changes.
    let none = r.run(&s, &lr(&[]));
    assert_eq!(
        none,
        Frame::Array(vec![Frame::BulkString(Vec::new()), Frame::Integer(0), Frame::Integer(0)])
    );
    assert_eq!(r.count("10.0.0.12:8000"), Some(1));
}

/// A `loadAware` prefix pick: `pods` are (host, queue, KV use, in-flight), all healthy, with the
/// thresholds' defaults (queue gap 4, KV gap 0.2, in-flight gap 4, ratio 1.5, KV weight 8, two
/// holders); the in-flight counts are written to Redis first. The load arguments are made from the
/// metrics by the plugin's own code.
fn la_pick(
    r: &mut Redis,
    chain: &[&str],
    pods: &[(&str, f64, f64, i64)],
) -> crate::policy::picker::PickResult {
    la_pick_with(r, chain, pods, crate::config::LoadAwareConfig::default())
}

/// [`la_pick`] whose diverted hit would give up `divert_costs[matched - 1]` requests' worth of
/// cached prefix.
fn la_pick_costing(
    r: &mut Redis,
    chain: &[&str],
    pods: &[(&str, f64, f64, i64)],
    divert_costs: &[u64],
) -> crate::policy::picker::PickResult {
    la_pick_full(r, chain, pods, crate::config::LoadAwareConfig::default(), divert_costs)
}

/// [`la_pick`] with thresholds other than the defaults.
fn la_pick_with(
    r: &mut Redis,
    chain: &[&str],
    pods: &[(&str, f64, f64, i64)],
    cfg: crate::config::LoadAwareConfig,
) -> crate::policy::picker::PickResult {
    la_pick_full(r, chain, pods, cfg, &[])
}

fn la_pick_full(
    r: &mut Redis,
    chain: &[&str],
    pods: &[(&str, f64, f64, i64)],
    cfg: crate::config::LoadAwareConfig,
    divert_costs: &[u64],
) -> crate::policy::picker::PickResult {
    use crate::metrics::router::PodView;
    use crate::metrics::PodMetrics;
    let views: Vec<PodView> = pods
        .iter()
        .map(|&(h, q, kv, _)| PodView {
            address: h.into(),
            metrics: Some(PodMetrics {
                waiting: Some(q),
                kv_cache_usage: Some(kv),
                ..PodMetrics::default()
            }),
            sampled_ms: None,
        })
        .collect();
    for &(h, _, _, c) in pods {
        r.cmd(&["HSET", "inflight", h, &c.to_string()]);
    }
    let args = crate::policy::load::load_args(&cfg, &views).expect("metrics for every pod");
    let hosts: Vec<&str> = pods.iter().map(|p| p.0).collect();
    let mut call = pc(chain, 0, 600, 0.0, &hosts);
    if let PickKind::Prefix { load, .. } = &mut call.kind {
        *load = Some(Box::new(crate::policy::picker::LoadAware {
            config: cfg,
            args: Some(args),
            decode_averages: Vec::new(),
            prefill_backlog: Vec::new(),
            divert_costs: divert_costs.to_vec(),
        }));
    }
    let s = Script::new(PREFIX_CACHE_LUA.as_str());
    let f = r.run(&s, &call);
    parse_pick(&f).unwrap_or_else(|| panic!("bad reply {f:?}"))
}

#[test]
fn load_aware_hit_is_kept_when_its_pod_is_not_overloaded() {
    let mut r = Redis::start();
    r.cmd(&["SET", "pfx:k1", "a"]);
    // a: queue 3 above b's, 3 more in flight: under every threshold.
    let p = la_pick(&mut r, &["k1", "k2"], &[("b", 0.0, 0.1, 0), ("a", 3.0, 0.2, 3)]);
    assert_eq!((p.host.as_str(), p.matched, p.diverted, p.holder_added), ("a", 1, false, false));
    assert_eq!(r.holders("pfx:k1").as_deref(), Some("a"));
    assert_eq!(r.holders("pfx:k2").as_deref(), Some("a"));
}

#[test]
fn load_aware_hit_is_diverted_by_a_deep_queue_and_the_pod_becomes_a_holder() {
    let mut r = Redis::start();
    r.cmd(&["SET", "pfx:k1", "a"]);
    let p = la_pick(
        &mut r,
        &["k1", "k2"],
        &[("a", 9.0, 0.2, 1), ("b", 0.0, 0.2, 2), ("c", 1.0, 0.2, 1)],
    );
    // b: 2 in flight + 0 queued + 8 × 0.2 = 3.6 -> 4; c: 1 + 1 + 2 = 4 (ties: first wins).
    assert_eq!((p.host.as_str(), p.matched, p.diverted, p.holder_added), ("b", 1, true, true));
    assert_eq!(r.holders("pfx:k1").as_deref(), Some("a,b"), "b holds the matched prefix too");
    assert_eq!(r.holders("pfx:k2").as_deref(), Some("b"), "the new block is b's");
    assert!((590..=600).contains(&r.ttl("pfx:k1")));
}

#[test]
fn load_aware_hit_is_diverted_by_kv_cache_use_only_when_that_is_turned_on() {
    let mut r = Redis::start();
    r.cmd(&["SET", "pfx:k1", "a"]);
    // By default a hit's pod is never overloaded by its KV-cache use alone: a pod whose cache is
    // full of sessions is where their hits belong.
    let pods = [("a", 0.0, 0.9, 0), ("b", 0.0, 0.3, 1)];
    let p = la_pick(&mut r, &["k1"], &pods);
    assert_eq!((p.host.as_str(), p.diverted), ("a", false));
    let kv_gap =
        crate::config::LoadAwareConfig { kv_gap: 0.2, ..crate::config::LoadAwareConfig::default() };
    let p = la_pick_with(&mut r, &["k1"], &pods, kv_gap);
    assert_eq!((p.host.as_str(), p.diverted, p.holder_added), ("b", true, true));
}

#[test]
fn load_aware_hit_is_diverted_by_in_flight_past_gap_and_ratio() {
    let mut r = Redis::start();
    r.cmd(&["SET", "pfx:k1", "a"]);
    // 8 vs 5: gap 3 (not > 4): kept.
    let p = la_pick(&mut r, &["k1"], &[("a", 0.0, 0.1, 8), ("b", 0.0, 0.1, 5)]);
    assert_eq!((p.host.as_str(), p.diverted), ("a", false));
    // 10 vs 5: gap 5 > 4 and 10 > 7.5.
    let p = la_pick(&mut r, &["k1"], &[("a", 0.0, 0.1, 10), ("b", 0.0, 0.1, 5)]);
    assert_eq!((p.host.as_str(), p.diverted), ("b", true));
    // 16 vs 11: gap 5 but 16 < 16.5: kept (every pod busy, none singled out).
    r.cmd(&["SET", "pfx:k9", "a"]);
    let p = la_pick(&mut r, &["k9"], &[("a", 0.0, 0.1, 16), ("b", 0.0, 0.1, 11)]);
    assert_eq!((p.host.as_str(), p.diverted), ("a", false));
}

#[test]
fn load_aware_diverts_a_hit_only_when_the_gap_outweighs_the_prefix_it_gives_up() {
    let mut r = Redis::start();
    r.cmd(&["SET", "pfx:k1", "a"]);
    // a: 10 in flight + 1 (KV) = 11, b: 5 + 1 = 6; past the in-flight gap and ratio.
    let pods = [("a", 0.0, 0.1, 10), ("b", 0.0, 0.1, 5)];
    // Re-prefilling the matched block on b weighs 4 requests: 6 + 4 < 11, diverted.
    let p = la_pick_costing(&mut r, &["k1", "k2"], &pods, &[4, 12]);
    assert_eq!((p.host.as_str(), p.matched, p.diverted), ("b", 1, true));
    // 5 requests: 6 + 5 is not below 11, the hit stays on a.
    r.cmd(&["SET", "pfx:j1", "a"]);
    let p = la_pick_costing(&mut r, &["j1", "j2"], &pods, &[5, 12]);
    assert_eq!((p.host.as_str(), p.matched, p.diverted), ("a", 1, false));
    // The cost is that of the matched length: both blocks held, 12 requests, kept.
    r.cmd(&["SET", "pfx:i1", "a"]);
    r.cmd(&["SET", "pfx:i2", "a"]);
    let p = la_pick_costing(&mut r, &["i1", "i2"], &pods, &[1, 12]);
    assert_eq!((p.host.as_str(), p.matched, p.diverted), ("a", 2, false));
    // divertPrefixBytes 0: no cost is sent, the overloaded holder loses the hit.
    let off = crate::config::LoadAwareConfig {
        divert_prefix_bytes: 0,
        ..crate::config::LoadAwareConfig::default()
    };
    r.cmd(&["SET", "pfx:h1", "a"]);
    let p = la_pick_full(&mut r, &["h1"], &pods, off, &[50]);
    assert_eq!((p.host.as_str(), p.diverted), ("b", true));
}

#[test]
fn load_aware_in_flight_gap_is_measured_against_where_a_diverted_hit_would_go() {
    // s has nothing in flight only because its queue keeps requests away; a diverted hit would go
    // to b (least combined load), which has 1: a's 5 is not past the gap over b, so a keeps it.
    let mut r = Redis::start();
    r.cmd(&["SET", "pfx:k1", "a"]);
    let pods = [("a", 0.0, 0.1, 5), ("b", 0.0, 0.1, 1), ("s", 10.0, 0.1, 0)];
    let p = la_pick(&mut r, &["k1"], &pods);
    assert_eq!((p.host.as_str(), p.diverted), ("a", false));
    // With 6 in flight it is past both (5 > 4, 6 > 1.5): diverted to b, not to s.
    r.cmd(&["SET", "pfx:k2", "a"]);
    let pods = [("a", 0.0, 0.1, 6), ("b", 0.0, 0.1, 1), ("s", 10.0, 0.1, 0)];
    let p = la_pick(&mut r, &["k2"], &pods);
    assert_eq!((p.host.as_str(), p.diverted), ("b", true));
}

#[test]
fn load_aware_miss_goes_to_the_least_combined_load_not_the_least_in_flight() {
    let mut r = Redis::start();
    // b has fewer in flight but a queue and a fuller KV cache: a wins (2 vs 1 + 3 + 4).
    let p = la_pick(&mut r, &["k1"], &[("b", 3.0, 0.5, 1), ("a", 0.0, 0.0, 2)]);
    assert_eq!((p.host.as_str(), p.matched, p.diverted), ("a", 0, false));
    assert_eq!(r.holders("pfx:k1").as_deref(), Some("a"));
    // Without load arguments (stale metrics: as today) the in-flight count alone decides.
    r.cmd(&["HSET", "inflight", "a", "2", "b", "1"]);
    let f = r.run(&Script::new(PREFIX_CACHE_LUA.as_str()), &pc(&["j1"], 0, 600, 0.0, &["b", "a"]));
    assert_eq!(pick(&f).0, "b");
}

#[test]
fn load_aware_later_requests_take_the_least_loaded_holder() {
    let mut r = Redis::start();
    r.cmd(&["SET", "pfx:k1", "a,b"]);
    let p = la_pick(&mut r, &["k1"], &[("a", 0.0, 0.1, 3), ("b", 0.0, 0.1, 1), ("c", 0.0, 0.0, 0)]);
    assert_eq!((p.host.as_str(), p.matched, p.diverted), ("b", 1, false), "a hit on b, not a miss");
    let p = la_pick(&mut r, &["k1"], &[("a", 0.0, 0.1, 1), ("b", 0.0, 0.1, 3), ("c", 0.0, 0.0, 0)]);
    assert_eq!((p.host.as_str(), p.diverted), ("a", false));
    assert_eq!(r.holders("pfx:k1").as_deref(), Some("a,b"), "holders unchanged");
    // A holder that left (or is unhealthy) is not taken; the other one is.
    let p = la_pick(&mut r, &["k1"], &[("b", 0.0, 0.1, 3), ("c", 0.0, 0.0, 0)]);
    assert_eq!((p.host.as_str(), p.matched), ("b", 1));
}

#[test]
fn load_aware_holders_never_ping_pong() {
    let mut r = Redis::start();
    r.cmd(&["SET", "pfx:k1", "a,b"]);
    // Both holders overloaded: diverted to c, but the key is full: a and b stay its holders.
    let p = la_pick(&mut r, &["k1"], &[("a", 9.0, 0.1, 9), ("b", 9.0, 0.1, 9), ("c", 0.0, 0.0, 0)]);
    assert_eq!((p.host.as_str(), p.diverted, p.holder_added), ("c", true, false));
    assert_eq!(r.holders("pfx:k1").as_deref(), Some("a,b"));
    // The load swings back and forth: the key's value never changes.
    for i in 0..6 {
        let (qa, qb) = if i % 2 == 0 { (0.0, 9.0) } else { (9.0, 0.0) };
        let p =
            la_pick(&mut r, &["k1"], &[("a", qa, 0.1, 0), ("b", qb, 0.1, 0), ("c", 9.0, 0.9, 9)]);
        assert_eq!(p.host, if i % 2 == 0 { "a" } else { "b" });
        assert!(!p.diverted, "the less loaded holder is a plain hit");
        assert_eq!(r.holders("pfx:k1").as_deref(), Some("a,b"), "round {i}");
    }
    // A one-holder key grows once, then stays.
    r.cmd(&["SET", "pfx:j1", "a"]);
    let p = la_pick(&mut r, &["j1"], &[("a", 9.0, 0.1, 0), ("b", 0.0, 0.1, 0), ("c", 0.0, 0.1, 1)]);
    assert!(p.holder_added);
    let p = la_pick(&mut r, &["j1"], &[("a", 9.0, 0.1, 0), ("b", 9.0, 0.1, 0), ("c", 0.0, 0.1, 0)]);
    assert_eq!((p.host.as_str(), p.diverted, p.holder_added), ("c", true, false));
    assert_eq!(r.holders("pfx:j1").as_deref(), Some("a,b"));
}
