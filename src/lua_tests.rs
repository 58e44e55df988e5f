//! The Lua scripts against a real `redis-server` (from PATH, or `$AI_LB_REDIS_SERVER`). Native only.
//! These fail (not skip) without redis-server: install it (`apt-get install redis-server`).

use crate::redis::{
    decode_reply, encode_command, Frame, Script, LEAST_REQUEST_LUA, PREFIX_CACHE_LUA, RELEASE_LUA,
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
    reqs: usize,
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
                return Redis { child, conn, sock, last_req: String::new(), reqs: 0 };
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

    /// EVALSHA, loading with EVAL on NOSCRIPT (what the plugin does). `keys` = in-flight hash,
    /// last-clean key, then prefix keys; a fresh pick record key `rq:<n>` is inserted third.
    fn run(&mut self, script: &Script, keys: &[&str], args: &[String]) -> Frame {
        self.reqs += 1;
        self.last_req = format!("rq:{}", self.reqs);
        let mut keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        keys.insert(2.min(keys.len()), self.last_req.clone());
        self.run_keys(script, &keys, args)
    }

    fn run_keys(&mut self, script: &Script, keys: &[String], args: &[String]) -> Frame {
        let r = self.raw(&script.command(keys, args, false));
        if crate::redis::is_noscript(&r) {
            return self.raw(&script.command(keys, args, true));
        }
        r
    }

    fn release(&mut self, req: &str, tombstone_ttl: u32) -> Frame {
        let s = Script::new(RELEASE_LUA);
        self.raw(&s.command(
            &["inflight".to_string(), req.to_string()],
            &[tombstone_ttl.to_string()],
            true,
        ))
    }
}

fn lr_args(now: u64, interval: u64, maxc: u64, healthy: &[&str], others: &[&str]) -> Vec<String> {
    let mut a =
        vec![now.to_string(), interval.to_string(), maxc.to_string(), healthy.len().to_string()];
    a.extend(healthy.iter().map(|h| h.to_string()));
    a.extend(others.iter().map(|h| h.to_string()));
    a
}

fn pc_args(maxc: u64, ttl: u64, factor: f64, healthy: &[&str], others: &[&str]) -> Vec<String> {
    let mut a = vec![
        "1000".to_string(),
        "0".to_string(),
        maxc.to_string(),
        ttl.to_string(),
        factor.to_string(),
        healthy.len().to_string(),
    ];
    a.extend(healthy.iter().map(|h| h.to_string()));
    a.extend(others.iter().map(|h| h.to_string()));
    a
}

fn pick(f: &Frame) -> (String, i64, i64, i64) {
    let p = crate::policy::global_least_request::parse_pick(f)
        .unwrap_or_else(|| panic!("bad reply {f:?}"));
    (p.host, p.count, p.admitted as i64, p.matched)
}

#[test]
fn script_sha_matches_redis_and_noscript_is_recognised() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA);
    let first = r.raw(&s.command(
        &["inflight".into(), "lc".into(), "rq".into()],
        &lr_args(1, 0, 0, &["a"], &[]),
        false,
    ));
    assert!(crate::redis::is_noscript(&first), "{first:?}");
    assert_eq!(
        r.cmd(&["SCRIPT", "LOAD", LEAST_REQUEST_LUA]),
        Frame::BulkString(s.sha.clone().into_bytes())
    );
}

#[test]
fn least_request_picks_the_minimum_counting_missing_hosts_as_zero() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA);
    r.cmd(&["HSET", "inflight", "a", "3", "b", "1"]);
    let f = r.run(&s, &["inflight", "lc"], &lr_args(1, 0, 0, &["a", "b", "c"], &[]));
    assert_eq!(pick(&f).0, "c", "c is missing from the hash: 0 in flight");
    assert_eq!(r.count("c"), Some(1));
    let f = r.run(&s, &["inflight", "lc"], &lr_args(1, 0, 0, &["a", "b", "c"], &[]));
    assert_eq!(pick(&f).0, "b", "first minimum in the (shuffled) order wins ties");
    assert_eq!(r.count("b"), Some(2));
}

#[test]
fn least_request_rejects_above_max_and_undoes_the_increment() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA);
    r.cmd(&["HSET", "inflight", "a", "2", "b", "2"]);
    let f = r.run(&s, &["inflight", "lc"], &lr_args(1, 0, 2, &["a", "b"], &[]));
    assert_eq!(pick(&f), ("a".to_string(), 3, 0, 0));
    assert_eq!(r.count("a"), Some(2), "undone");
    let f = r.run(&s, &["inflight", "lc"], &lr_args(1, 0, 3, &["a", "b"], &[]));
    assert_eq!(pick(&f).2, 1);
    assert_eq!(r.count("a"), Some(3));
}

#[test]
fn least_request_cleans_out_hosts_that_left_every_interval() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA);
    r.cmd(&["HSET", "inflight", "gone", "0", "sick", "4", "a", "1"]);
    r.cmd(&["SET", "lc", "1000"]);
    // Not yet due (interval 3600 s since t=1000).
    r.run(&s, &["inflight", "lc"], &lr_args(2000, 3600, 0, &["a"], &["sick"]));
    assert_eq!(r.count("gone"), Some(0));
    r.run(&s, &["inflight", "lc"], &lr_args(4600, 3600, 0, &["a"], &["sick"]));
    assert_eq!(r.count("gone"), None, "removed");
    assert_eq!(r.count("sick"), Some(4), "unhealthy but still in the cluster: kept");
    assert_eq!(r.get("lc").as_deref(), Some("4600"));
}

#[test]
fn least_request_repairs_negative_counts() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA);
    r.cmd(&["HSET", "inflight", "a", "-2", "b", "0"]);
    let f = r.run(&s, &["inflight", "lc"], &lr_args(1, 0, 0, &["a", "b"], &[]));
    assert_eq!(pick(&f).0, "a");
    assert_eq!(r.count("a"), Some(1), "reset to 0 then +1");
}

#[test]
fn prefix_miss_writes_the_chain_to_the_least_loaded_host() {
    let mut r = Redis::start();
    let s = Script::new(PREFIX_CACHE_LUA);
    r.cmd(&["HSET", "inflight", "a", "5"]);
    let f = r.run(&s, &["inflight", "lc", "k1", "k2"], &pc_args(0, 600, 0.0, &["a", "b"], &[]));
    assert_eq!(pick(&f), ("b".to_string(), 1, 1, 0));
    assert_eq!(r.get("k1").as_deref(), Some("b"));
    assert_eq!(r.get("k2").as_deref(), Some("b"));
    assert!((590..=600).contains(&r.ttl("k2")));
}

#[test]
fn prefix_hit_routes_to_the_holder_refreshes_and_extends_the_chain() {
    let mut r = Redis::start();
    let s = Script::new(PREFIX_CACHE_LUA);
    r.cmd(&["SET", "k1", "a", "EX", "10"]);
    r.cmd(&["SET", "k2", "a", "EX", "10"]);
    r.cmd(&["HSET", "inflight", "a", "3", "b", "0"]);
    let f =
        r.run(&s, &["inflight", "lc", "k1", "k2", "k3"], &pc_args(0, 600, 0.0, &["b", "a"], &[]));
    assert_eq!(pick(&f), ("a".to_string(), 4, 1, 2));
    assert!(r.ttl("k1") > 10, "matched keys refreshed");
    assert_eq!(r.get("k3").as_deref(), Some("a"));
}

#[test]
fn prefix_hit_on_an_unhealthy_host_rehomes_that_key_and_keeps_the_chain_aligned() {
    let mut r = Redis::start();
    let s = Script::new(PREFIX_CACHE_LUA);
    // k1 on healthy a; k2, k3 on sick (unhealthy) host; k4 new.
    r.cmd(&["SET", "k1", "a"]);
    r.cmd(&["SET", "k2", "sick"]);
    r.cmd(&["SET", "k3", "sick"]);
    let f = r.run(
        &s,
        &["inflight", "lc", "k1", "k2", "k3", "k4"],
        &pc_args(0, 600, 0.0, &["b", "a"], &["sick"]),
    );
    assert_eq!(pick(&f), ("a".to_string(), 1, 1, 1), "longest prefix on a healthy host");
    for k in ["k1", "k2", "k3", "k4"] {
        assert_eq!(r.get(k).as_deref(), Some("a"), "{k} re-homed in place");
    }
    // Everything on a gone host: least-loaded host takes the whole chain, same keys.
    r.cmd(&["SET", "j1", "gone"]);
    r.cmd(&["SET", "j2", "gone"]);
    r.cmd(&["HSET", "inflight", "a", "9"]);
    let f = r.run(&s, &["inflight", "lc", "j1", "j2"], &pc_args(0, 600, 0.0, &["a", "b"], &[]));
    assert_eq!(pick(&f), ("b".to_string(), 1, 1, 0));
    assert_eq!(r.get("j1").as_deref(), Some("b"));
    assert_eq!(r.get("j2").as_deref(), Some("b"));
    let keys = r.cmd(&["KEYS", "*"]);
    let Frame::Array(keys) = keys else { panic!() };
    assert_eq!(
        keys.len(),
        9,
        "k1-k4, j1-j2, the in-flight hash and two pick records only: {keys:?}"
    );
}

#[test]
fn prefix_load_guard_and_max_request_count() {
    let mut r = Redis::start();
    let s = Script::new(PREFIX_CACHE_LUA);
    r.cmd(&["SET", "k1", "a"]);
    r.cmd(&["HSET", "inflight", "a", "10", "b", "1"]);
    // factor 2: a has 10 > 2 * (1 + 1) -> spill to b, chain beyond the match goes to b.
    let f = r.run(&s, &["inflight", "lc", "k1", "k2"], &pc_args(0, 600, 2.0, &["a", "b"], &[]));
    assert_eq!(pick(&f).0, "b");
    assert_eq!(r.get("k1").as_deref(), Some("a"), "a still holds the matched prefix");
    assert_eq!(r.get("k2").as_deref(), Some("b"));
    // Guard off: the hit wins despite the load.
    let f = r.run(&s, &["inflight", "lc", "k1"], &pc_args(0, 600, 0.0, &["a", "b"], &[]));
    assert_eq!(pick(&f).0, "a");
    // maxRequestCount 11: a is full (11 -> 12 > 11), falls back to b.
    let f = r.run(&s, &["inflight", "lc", "k1"], &pc_args(11, 600, 0.0, &["a", "b"], &[]));
    assert_eq!(pick(&f).0, "b");
    assert_eq!(r.count("a"), Some(11), "undone");
    // Everyone full: rejected, nothing counted, nothing written.
    r.cmd(&["HSET", "inflight", "b", "11"]);
    let f = r.run(&s, &["inflight", "lc", "k1", "k9"], &pc_args(11, 600, 0.0, &["a", "b"], &[]));
    assert_eq!(pick(&f).2, 0);
    assert_eq!(r.count("a"), Some(11));
    assert_eq!(r.count("b"), Some(11));
    assert_eq!(r.get("k9"), None);
}

#[test]
fn release_undoes_the_pick_exactly_once() {
    let mut r = Redis::start();
    let s = Script::new(LEAST_REQUEST_LUA);
    let f = r.run(&s, &["inflight", "lc"], &lr_args(1, 0, 0, &["a"], &[]));
    assert_eq!(pick(&f).0, "a");
    let req = r.last_req.clone();
    assert_eq!(r.get(&req).as_deref(), Some("a"), "pick record");
    assert_eq!(r.release(&req, 0), Frame::BulkString(b"a".to_vec()));
    assert_eq!(r.count("a"), Some(0));
    assert_eq!(r.get(&req), None, "record deleted: no key per finished request");
    assert_eq!(r.release(&req, 0), Frame::BulkString(Vec::new()), "a second release does nothing");
    assert_eq!(r.count("a"), Some(0));
    // A rejected pick (maxRequestCount) writes no record: nothing to release.
    r.cmd(&["HSET", "inflight", "a", "5"]);
    let f = r.run(&s, &["inflight", "lc"], &lr_args(1, 0, 5, &["a"], &[]));
    assert_eq!(pick(&f).2, 0);
    let req = r.last_req.clone();
    assert_eq!(r.get(&req), None);
}

#[test]
fn a_pick_cancelled_before_it_runs_does_nothing_when_it_arrives_late() {
    // A stalled Redis runs the pick after the plugin gave up (timeout) and sent the cancel.
    let mut r = Redis::start();
    let s = Script::new(PREFIX_CACHE_LUA);
    let keys: Vec<String> =
        ["inflight", "lc", "rq:late", "k1"].iter().map(|k| k.to_string()).collect();
    assert_eq!(r.release("rq:late", 3600), Frame::BulkString(Vec::new()));
    assert!(r.ttl("rq:late") > 3000, "tombstone");
    let f = r.run_keys(&s, &keys, &pc_args(0, 600, 0.0, &["a"], &[]));
    assert!(crate::policy::global_least_request::parse_pick(&f).is_none(), "no pick: {f:?}");
    assert_eq!(r.count("a"), None, "nothing counted");
    assert_eq!(r.get("k1"), None, "nothing written");
    // Cancel after the pick ran (same connection order): undone.
    let keys: Vec<String> =
        ["inflight", "lc", "rq:ran", "k1"].iter().map(|k| k.to_string()).collect();
    let f = r.run_keys(&s, &keys, &pc_args(0, 600, 0.0, &["a"], &[]));
    assert_eq!(pick(&f).0, "a");
    assert_eq!(r.release("rq:ran", 3600), Frame::BulkString(b"a".to_vec()));
    assert_eq!(r.count("a"), Some(0));
}
