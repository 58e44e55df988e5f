//! The Redis client behind `proxy_redis_call` on a `REDIS_CLUSTER` cluster, against a real
//! 3-master Redis Cluster (local `redis-server` processes): commands routed by their key's slot
//! (hash tags, the first key of `EVAL`/`EVALSHA`), `MOVED` after a slot moved, `ASK` while it
//! moves, a master gone, and the same commands on an ordinary cluster of one of the nodes.
//!
//! The test plugin sends the POST body as a raw RESP command to the cluster named in `x-cluster`
//! and answers with the raw reply (200), or 503 on NetworkError.

mod common;

use common::*;
use testkit::redis_cluster::{keyslot, RedisClusterFixture};

/// The Redis Cluster (the name the test plugin initialises).
const CLUSTER: &str = "outbound|6379||redis.static";
/// The same nodes as an ordinary cluster.
const PLAIN: &str = "outbound|6379||redis.plain";

fn cluster_config(up: &Upstream, rc: &RedisClusterFixture) -> String {
    let seeds: Vec<String> = rc.endpoints().iter().map(|e| format!("\"{e}\"")).collect();
    one_cluster_config(
        &format!("\"{}\"", up.addr),
        true,
        &format!(
            "  - name: {CLUSTER}\n    type: REDIS_CLUSTER\n    endpoints: [{seeds}]\n    redis_cluster: {{cluster_refresh_rate_ms: 60000}}\n  - name: {PLAIN}\n    endpoints: [{first}]\n",
            seeds = seeds.join(", "),
            first = seeds[0],
        ),
    )
}

/// A bulk-string reply.
fn bulk(v: &str) -> String {
    format!("${}\r\n{v}\r\n", v.len())
}

async fn call(gw: &Gateway, cluster: &str, args: &[&str]) -> Resp {
    request("POST", &gw.url("/r"), &[("x-cluster", cluster)], &resp(args)).await
}

/// A key (with `prefix`) whose slot the master at `port` serves.
async fn key_on(rc: &RedisClusterFixture, port: u16, prefix: &str) -> String {
    for i in 0.. {
        let key = format!("{prefix}{i}");
        if rc.slot_owner(keyslot(&key)).await.unwrap() == port {
            return key;
        }
    }
    unreachable!()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_follow_the_slot_map_moved_and_ask() {
    let rc = RedisClusterFixture::start(3, 0).await.unwrap();
    let masters = rc.master_ports().await.unwrap();
    assert_eq!(masters.len(), 3);
    let up = Upstream::start().await;
    let gw = Gateway::start(&cluster_config(&up, &rc), Some(&redis_plugin()), 1);

    // Every master gets the keys of its slots, written through the gateway.
    let mut keys = Vec::new();
    for &m in &masters {
        let key = key_on(&rc, m, "k").await;
        let r = call(&gw, CLUSTER, &["SET", &key, &format!("v-{m}")]).await;
        assert_eq!((r.status, r.text().as_str()), (200, "+OK\r\n"), "SET {key}");
        let on_owner = rc.client(m).await.unwrap().get(&key).await.unwrap();
        assert_eq!(on_owner, Some(format!("v-{m}")), "{key} is on its slot's master {m}");
        keys.push((m, key));
    }
    // The same key through an ordinary cluster of one of the nodes (Higress's Redis client on a
    // non-Redis-Cluster cluster follows no redirection): the plugin sees it.
    let (_, elsewhere) = keys.iter().find(|(m, _)| *m != masters[0]).unwrap().clone();
    let r = call(&gw, PLAIN, &["GET", &elsewhere]).await;
    assert!(r.text().starts_with("-MOVED "), "plain cluster: {}", r.text());

    // EVAL/EVALSHA go by their first key; hash tags keep related keys on one slot.
    let tag = "{tenant-7}";
    let script = "redis.call('SET', KEYS[1], ARGV[1]); return redis.call('INCR', KEYS[2])";
    let (k1, k2) = (format!("a:{tag}:x"), format!("b:{tag}:y"));
    let r = call(&gw, CLUSTER, &["EVAL", script, "2", &k1, &k2, "hello"]).await;
    assert_eq!((r.status, r.text().as_str()), (200, ":1\r\n"), "EVAL with hash-tagged keys");
    let owner = rc.slot_owner(keyslot(tag)).await.unwrap();
    assert_eq!(rc.client(owner).await.unwrap().get(&k1).await.unwrap().as_deref(), Some("hello"));
    let sha = "ffffffffffffffffffffffffffffffffffffffff";
    let r = call(&gw, CLUSTER, &["EVALSHA", sha, "1", &k1]).await;
    assert!(r.text().starts_with("-NOSCRIPT"), "the node's own error reply: {}", r.text());
    // A command without a key goes to some master.
    assert_eq!(call(&gw, CLUSTER, &["PING"]).await.text(), "+PONG\r\n");

    // MOVED: the slot of keys[0] moves to another master; the client follows and learns.
    let (from, key) = keys[0].clone();
    let to = masters.iter().copied().find(|&m| m != from).unwrap();
    rc.move_slot(keyslot(&key), to).await.unwrap();
    let r = call(&gw, CLUSTER, &["GET", &key]).await;
    assert_eq!(r.text(), bulk(&format!("v-{from}")), "after MOVED");
    let r = call(&gw, CLUSTER, &["SET", &key, "again"]).await;
    assert_eq!(r.text(), "+OK\r\n");
    assert_eq!(rc.client(to).await.unwrap().get(&key).await.unwrap().as_deref(), Some("again"));

    // ASK: the slot of keys[1] is half-way to another master (its key already there).
    let (from, key) = keys[1].clone();
    let to = masters.iter().copied().find(|&m| m != from).unwrap();
    rc.start_slot_move(keyslot(&key), to).await.unwrap();
    let mut src = rc.client(from).await.unwrap();
    let port = to.to_string();
    let m = src.cmd(&["MIGRATE", "127.0.0.1", &port, &key, "0", "5000"]).await.unwrap();
    assert_eq!(m.as_string().as_deref(), Some("OK"));
    let r = call(&gw, CLUSTER, &["GET", &key]).await;
    assert_eq!(r.text(), bulk(&format!("v-{from}")), "after ASK");
    // Without ASKING the importing node would refuse it: the ASK was followed, not the map.
    let direct = rc.client(to).await.unwrap().cmd(&["GET", &key]).await.unwrap();
    assert!(matches!(direct, testkit::RedisValue::Error(ref e) if e.starts_with("MOVED")));
    rc.finish_slot_move(keyslot(&key), to).await.unwrap();
    assert_eq!(call(&gw, CLUSTER, &["GET", &key]).await.text(), bulk(&format!("v-{from}")));

    // A master goes away: its slots fail with NetworkError, the others still answer.
    let (gone, gone_key) = keys[2].clone();
    let mut rc = rc;
    rc.kill_node(gone).unwrap();
    let r = call(&gw, CLUSTER, &["GET", &gone_key]).await;
    assert_eq!(r.status, 503, "a gone master's slot: NetworkError");
    let (_, alive_key) = &keys[0];
    let r = call(&gw, CLUSTER, &["GET", alive_key]).await;
    assert_eq!(r.text(), bulk("again"), "another master still answers");
}
