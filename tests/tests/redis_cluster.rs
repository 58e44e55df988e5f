//! The compiled plugin on a real Redis Cluster (3 masters, local `redis-server` processes), the
//! gateway's Redis cluster declared `type: REDIS_CLUSTER`.
//!
//! What a user notices: least-request spreading, in-flight counts and prefix hits work as on one
//! Redis; the slot holding the plugin's keys moves to another master under load, and a master
//! fails over to its replica under load, with no failed request and counts exact afterwards.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use e2e::*;
use serde_json::json;
use testkit::http::HttpRequest;
use testkit::redis_cluster::{keyslot, RedisClusterFixture};

const DECISION: &str = "x-ai-lb-decision";

fn config(route: &str, pods: &[Pod], rc: &RedisClusterFixture, policy: &str) -> GatewayConfig {
    config_with(route, pods, rc, policy, json!({}))
}

/// [`config`] with more `lb_config` keys.
fn config_with(
    route: &str,
    pods: &[Pod],
    rc: &RedisClusterFixture,
    policy: &str,
    extra: serde_json::Value,
) -> GatewayConfig {
    let mut lb_config = redis_lb_config();
    lb_config["decisionHeader"] = json!(DECISION);
    if let (Some(cfg), Some(extra)) = (lb_config.as_object_mut(), extra.as_object()) {
        cfg.extend(extra.clone());
    }
    GatewayConfig::new()
        .route(route, "/", LLM_CLUSTER)
        .cluster(LLM_CLUSTER, &hosts(pods))
        .cluster_json(json!({
            "name": REDIS_CLUSTER,
            "type": "REDIS_CLUSTER",
            "endpoints": rc.endpoints(),
        }))
        .plugin(json!({"lb_policy": policy, "lb_config": lb_config}))
}

/// The slot of every key the plugin keeps for `route` (one hash tag per route and cluster).
fn plugin_slot(route: &str) -> u16 {
    keyslot(&format!("{{{route}|{LLM_CLUSTER}}}"))
}

/// The in-flight counters on the cluster's masters (per-owner records left out).
async fn counters(rc: &RedisClusterFixture) -> Vec<(String, String, i64)> {
    let all = rc.all_hash_counters().await.unwrap();
    all.into_iter().filter(|(k, _, _)| k.ends_with(":inflight")).collect()
}

async fn wait_counters_zero(rc: &RedisClusterFixture) {
    let mut last = Vec::new();
    for _ in 0..100 {
        last = counters(rc).await;
        if !last.is_empty() && last.iter().all(|(_, _, v)| *v == 0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("in-flight counters not back to 0 within 5 s: {last:?}");
}

fn chat(text: &str) -> HttpRequest {
    HttpRequest::post_json(
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": text}]}),
    )
}

/// Sequential requests from `clients` tasks until `stop`; returns (status, decision) of each.
fn load(
    gw: &Gateway,
    clients: usize,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<(u16, String)>>> {
    (0..clients)
        .map(|c| {
            let (addr, stop) = (gw.addr(), stop.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let r = testkit::http::send(
                        addr,
                        chat(&format!("client {c} request {i}")),
                        REQUEST_TIMEOUT,
                    )
                    .await;
                    seen.push(match r {
                        Ok(r) => (r.status, r.header(DECISION).unwrap_or_default().to_string()),
                        Err(e) => (0, format!("{e:#}")),
                    });
                }
                seen
            })
        })
        .collect()
}

async fn finish(handles: Vec<tokio::task::JoinHandle<Vec<(u16, String)>>>) -> Vec<(u16, String)> {
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.unwrap());
    }
    all
}

/// How many of `seen` were decided with Redis (not a fallback).
fn by_redis(seen: &[(u16, String)]) -> usize {
    seen.iter().filter(|(_, d)| !d.starts_with("fallback")).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_request_counts_and_a_slot_move_under_load() {
    let rc = RedisClusterFixture::start(3, 0).await.unwrap();
    let pods = start_pods("rcl", 3).await.unwrap();
    let route = "route-rc-glr";
    let gw = Gateway::start(&config(route, &pods, &rc, "global_least_request")).await.unwrap();

    // Held requests spread evenly, counted on the master of the plugin's slot.
    for p in &pods {
        p.set_hold(true);
    }
    let mut pending = Vec::new();
    for i in 0..6 {
        pending.push(spawn_request(gw.addr(), chat(&format!("held {i}")), Duration::from_secs(20)));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eventually(Duration::from_secs(10), "6 requests at the pods", || async {
        Ok(pods.iter().map(Pod::in_flight).sum::<usize>() == 6)
    })
    .await
    .unwrap();
    assert_eq!(pods.iter().map(Pod::in_flight).collect::<Vec<_>>(), vec![2, 2, 2]);
    let owner = rc.slot_owner(plugin_slot(route)).await.unwrap();
    let on_owner = rc.client(owner).await.unwrap().all_hash_counters().await.unwrap();
    let held: i64 =
        on_owner.iter().filter(|(k, _, _)| k.ends_with(":inflight")).map(|(_, _, v)| v).sum();
    assert_eq!(held, 6, "the counts live on the slot's master {owner}: {on_owner:?}");
    for p in &pods {
        p.set_hold(false);
        p.release();
    }
    for h in pending {
        let r = h.await.unwrap().unwrap();
        assert_eq!((r.status, r.header(DECISION)), (200, Some("least_request_routed")));
    }
    wait_counters_zero(&rc).await;

    // The slot half-moved (IMPORTING/MIGRATING set, its keys still on the old master): a pick that
    // would create a key there (this VM's record hash, gone since its last release) fails on that
    // master before any count changes; the request is decided without Redis and nothing leaks.
    let masters = rc.master_ports().await.unwrap();
    let mut others = masters.iter().copied().filter(|&m| m != owner);
    let (first_to, to) = (others.next().unwrap(), others.next().unwrap());
    rc.start_slot_move(plugin_slot(route), first_to).await.unwrap();
    let mut decisions = Vec::new();
    for i in 0..4 {
        let r = gw.send(chat(&format!("half-moved {i}")), REQUEST_TIMEOUT).await.unwrap();
        assert_eq!(r.status, 200);
        decisions.push(r.header(DECISION).unwrap_or_default().to_string());
    }
    eprintln!("half-moved slot: {decisions:?}");
    wait_counters_zero(&rc).await;
    rc.finish_slot_move(plugin_slot(route), first_to).await.unwrap();
    let owner = first_to;

    // Under load, the plugin's slot moves to the third master.
    let stop = Arc::new(AtomicBool::new(false));
    let handles = load(&gw, 2, stop.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    rc.move_slot(plugin_slot(route), to).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before_stop = gw.stats().await.unwrap();
    stop.store(true, Ordering::Relaxed);
    let seen = finish(handles).await;

    let failed: Vec<_> = seen.iter().filter(|(s, _)| *s != 200).collect();
    assert!(failed.is_empty(), "failed requests during the slot move: {failed:?}");
    assert!(seen.len() >= 20, "too little load to mean anything: {}", seen.len());
    let fallbacks = seen.len() - by_redis(&seen);
    eprintln!("slot move: {} requests, {fallbacks} decided without Redis", seen.len());
    // Only picks in the few milliseconds between MIGRATING and MIGRATE fall back (see above).
    assert!(fallbacks * 50 <= seen.len(), "{fallbacks} of {} without Redis", seen.len());
    // After the move the keys are on the new master and requests still use them.
    let keys_there = rc.client(to).await.unwrap().keys(&format!("*{route}*")).await.unwrap();
    assert!(keys_there.iter().any(|k| k.ends_with(":inflight")), "{keys_there:?}");
    let keys_left = rc.client(owner).await.unwrap().keys(&format!("*{route}*")).await.unwrap();
    assert!(keys_left.is_empty(), "keys left on the old master: {keys_left:?}");
    let r = gw.send(chat("after the move"), REQUEST_TIMEOUT).await.unwrap();
    assert_eq!((r.status, r.header(DECISION)), (200, Some("least_request_routed")));
    wait_counters_zero(&rc).await;
    assert_eq!(stat(&before_stop, "gateway_vm_traps_total"), 0);
}

/// The plugin's slot moved under load the slow way, one key per `MIGRATE` (`redis-cli --cluster
/// reshard --cluster-pipeline 1 --cluster-replace`): meanwhile picks run on the importing master
/// where their owner's hash has not arrived yet, create it there, and lose their record when the
/// tool replaces that key with the one it moves. The counts those +1s left behind mend at the next
/// recount (every six leases): after the load, every count is back to 0, none failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_moved_key_by_key_under_load_leaves_no_count_behind() {
    let rc = RedisClusterFixture::start(3, 0).await.unwrap();
    let pods = start_pods("rcl-keys", 3).await.unwrap();
    let route = "route-rc-keys";
    let cfg = config_with(route, &pods, &rc, "global_least_request", json!({"leaseMs": 1000}));
    let gw = Gateway::start(&cfg).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let handles = load(&gw, 3, stop.clone());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let slot = plugin_slot(route);
    let owner = rc.slot_owner(slot).await.unwrap();
    let masters = rc.master_ports().await.unwrap();
    let to = masters.iter().copied().find(|&m| m != owner).unwrap();
    let replaced = rc.move_slot_key_by_key(slot, to, Duration::from_millis(100)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let seen = finish(handles).await;
    let failed: Vec<_> = seen.iter().filter(|(s, _)| *s != 200).collect();
    assert!(failed.is_empty(), "failed requests during the slot move: {failed:?}");
    eprintln!("{} requests, {replaced} key(s) replaced by the move", seen.len());
    // Six leases (the recount's period) and two more for the heartbeats to come round.
    let mut last = Vec::new();
    for _ in 0..160 {
        last = counters(&rc).await;
        if !last.is_empty() && last.iter().all(|(_, _, v)| *v == 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !last.is_empty() && last.iter().all(|(_, _, v)| *v == 0),
        "counts left after the move: {last:?}"
    );
    let keys_there = rc.client(to).await.unwrap().keys(&format!("*{route}*")).await.unwrap();
    assert!(keys_there.iter().any(|k| k.ends_with(":inflight")), "{keys_there:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_hits_and_a_failover_under_load() {
    let rc = RedisClusterFixture::start(3, 1).await.unwrap();
    let pods = start_pods("rcp", 3).await.unwrap();
    let route = "route-rc-pfx";
    let gw = Gateway::start(&config(route, &pods, &rc, "prefix_cache")).await.unwrap();

    // A conversation stays on its pod: later turns are prefix hits found on the cluster.
    let mut conv = Conversation::new("cluster failover");
    let first = conv.turn(&gw, "first question").await.unwrap();
    for i in 0..3 {
        assert_eq!(conv.turn(&gw, &format!("follow-up {i}")).await.unwrap(), first);
    }
    let stats = gw.stats().await.unwrap();
    assert_eq!(stat(&stats, "ai_lb_prefix_hit"), 3, "{stats}");
    let owner = rc.slot_owner(plugin_slot(route)).await.unwrap();
    let pfx = rc.client(owner).await.unwrap().keys(&format!("*{route}*:pfx:*")).await.unwrap();
    assert!(pfx.len() >= 4, "prefix keys on the slot's master {owner}: {pfx:?}");

    // Under load, that master's replica takes over (CLUSTER FAILOVER). The new master never ran
    // the plugin's scripts (NOSCRIPT, then EVAL) and the old one now answers MOVED.
    let stop = Arc::new(AtomicBool::new(false));
    let handles = load(&gw, 2, stop.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let new_master = rc.failover(owner).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let seen = finish(handles).await;
    let failed: Vec<_> = seen.iter().filter(|(s, _)| *s != 200).collect();
    assert!(failed.is_empty(), "failed requests during the failover: {failed:?}");
    let fallbacks = seen.len() - by_redis(&seen);
    eprintln!("failover: {} requests, {fallbacks} decided without Redis", seen.len());
    assert_eq!(rc.slot_owner(plugin_slot(route)).await.unwrap(), new_master);

    // The old master's pause during the failover may have opened the breaker (its probe, sent at
    // once, closes it for every worker as soon as Redis answers; a stall soon after a close waits
    // breakerOpenMs, 1 s by default). Then the conversation still finds its prefix, now on the new
    // master; counts converge to 0.
    if stat(&gw.stats().await.unwrap(), "ai_lb_breaker_opened") > 0 {
        tokio::time::sleep(Duration::from_millis(1300)).await;
    }
    assert_eq!(conv.turn(&gw, "after the failover").await.unwrap(), first);
    let stats = gw.stats().await.unwrap();
    assert!(stat(&stats, "ai_lb_prefix_hit") >= 4, "{stats}");
    wait_counters_zero(&rc).await;
    let on_new =
        rc.client(new_master).await.unwrap().keys(&format!("*{route}*:inflight")).await.unwrap();
    assert_eq!(on_new.len(), 1, "the in-flight hash is on the new master: {on_new:?}");
    assert_eq!(stat(&stats, "gateway_vm_traps_total"), 0);
}

/// The plugin's pick script on a slot being migrated, called directly (no gateway): a pick that
/// carries its owner's only record. Whatever the call answers, no count may be left without a
/// record (a release sent again finds the record or finds the count already down).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pick_carrying_its_owners_last_record_on_a_migrating_slot_keeps_counts_and_records_equal()
{
    use ai_load_balancer::policy::picker::{PickCall, PickKind, StateKeys};
    use ai_load_balancer::redis::LEAST_REQUEST_LUA;
    use testkit::redis::RedisValue;

    const POD: &str = "10.0.0.1:8000";
    let rc = RedisClusterFixture::start(3, 0).await.unwrap();
    let keys = StateKeys::new("route-rc-script", LLM_CLUSTER, "vm1");
    let slot = keyslot(&keys.inflight);
    let pick = |request: &str, ended: Vec<(String, String)>| PickCall {
        keys: keys.clone(),
        max_inflight: 0,
        lease_ms: 60_000,
        owner_id: "vm1".into(),
        request_id: request.into(),
        ended,
        healthy: vec![POD.into()],
        kind: PickKind::LeastRequest,
    };
    let eval = |call: PickCall| {
        let (k, a) = call.keys_args();
        let mut cmd =
            vec!["EVAL".to_string(), LEAST_REQUEST_LUA.as_str().to_string(), k.len().to_string()];
        cmd.extend(k);
        cmd.extend(a);
        cmd
    };
    let source = rc.slot_owner(slot).await.unwrap();
    let mut src = rc.client(source).await.unwrap();
    let first = src.cmd(&eval(pick("1", vec![]))).await.unwrap();
    assert!(!matches!(first, RedisValue::Error(_)), "first pick: {first:?}");

    // The slot starts moving; every key is still on the old master.
    let to = rc.master_ports().await.unwrap().into_iter().find(|&p| p != source).unwrap();
    rc.start_slot_move(slot, to).await.unwrap();
    let second = src.cmd(&eval(pick("2", vec![("1".into(), POD.into())]))).await.unwrap();

    // Counts and records on the old master (a key it no longer holds answers an error: none).
    let count = |v: RedisValue| match v {
        RedisValue::Bulk(Some(v)) => String::from_utf8(v).unwrap().parse::<i64>().unwrap(),
        other => panic!("in-flight count: {other:?}"),
    };
    // Records: the owner's fields but its marker ('~', kept until the reaper deletes the hash).
    let records = |v: RedisValue| match v {
        RedisValue::Array(Some(fields)) => {
            fields.iter().filter(|f| f.as_string().as_deref() != Some("~")).count() as i64
        }
        RedisValue::Error(_) => 0,
        other => panic!("records: {other:?}"),
    };
    let c = count(src.cmd(&["HGET", &keys.inflight, POD]).await.unwrap());
    let r = records(src.cmd(&["HKEYS", &keys.owner]).await.unwrap());
    assert_eq!(c, r, "the pod's count must equal the records naming it (pick answered {second:?})");
    assert!(!matches!(second, RedisValue::Error(_)), "the pick can run here: {second:?}");
    assert_eq!(c, 1, "request 1 released, request 2 counted");

    rc.finish_slot_move(slot, to).await.unwrap();
    let mut dst = rc.client(to).await.unwrap();
    let c = count(dst.cmd(&["HGET", &keys.inflight, POD]).await.unwrap());
    let r = records(dst.cmd(&["HKEYS", &keys.owner]).await.unwrap());
    assert_eq!((c, r), (1, 1), "after the move: request 2 counted and recorded once");
    let marker = dst.cmd(&["HGET", &keys.owner, "~"]).await.unwrap();
    assert_eq!(marker, RedisValue::Bulk(Some(vec![])), "the owner's marker moved with its hash");
}
