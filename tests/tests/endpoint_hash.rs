//! endpoint_hash end to end: the compiled plugin in two gateways on one real Redis keeps each
//! session (the `x-session` header) on the pod that served it first; a binding to a pod that left
//! is replaced; a frozen Redis costs a request at most `breakerSlowMs`, never the Redis timeout.

use std::time::{Duration, Instant};

use e2e::*;
use serde_json::json;
use testkit::http::HttpRequest;

const ROUTE: &str = "route-eh";

fn chat(session: Option<&str>, i: usize) -> HttpRequest {
    let req = HttpRequest::post_json(
        "/v1/chat/completions",
        &json!({"model": MODEL, "stream": false, "messages": [{"role": "user", "content": format!("q{i}")}]}),
    );
    match session {
        Some(s) => req.header("x-session", s),
        None => req,
    }
}

/// The Go plugin's binding key of `session` (FNV-1a, 8 hex digits), computed here independently.
fn binding_key(session: &str) -> String {
    let h =
        session.bytes().fold(0x811c_9dc5_u32, |h, b| (h ^ u32::from(b)).wrapping_mul(16_777_619));
    format!("higress:endpoint_hash_table:{ROUTE}:{LLM_CLUSTER}:{h:08x}")
}

async fn served_by(gw: &Gateway, session: Option<&str>, i: usize) -> String {
    let r = gw.send(chat(session, i), REQUEST_TIMEOUT).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    r.upstream().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_stay_on_their_first_pod_across_gateways() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("eh", 3).await.unwrap();
    let cfg = redis_policy_config(
        ROUTE,
        &pods,
        &redis,
        "endpoint_hash",
        json!({"hash_header": "x-session", "stickyTimeout": 2}),
    );
    let (gw1, gw2) = (Gateway::start(&cfg).await.unwrap(), Gateway::start(&cfg).await.unwrap());
    let sessions = ["alice", "bob", "carol", "dave", "erin", "frank"];
    let mut first = Vec::new();
    for (i, s) in sessions.iter().enumerate() {
        first.push(served_by(&gw1, Some(s), i).await);
    }
    let mut c = redis.client().await.unwrap();
    for (s, pod) in sessions.iter().zip(&first) {
        let key = binding_key(s);
        assert_eq!(c.get(&key).await.unwrap().as_deref(), Some(pod.as_str()), "{s}'s binding");
        let ttl = c.ttl(&key).await.unwrap();
        assert!((100..=120).contains(&ttl), "stickyTimeout 2 minutes: TTL {ttl}");
    }
    for round in 0..4 {
        for (i, (s, pod)) in sessions.iter().zip(&first).enumerate() {
            let gw = if (round + i) % 2 == 0 { &gw1 } else { &gw2 };
            assert_eq!(&served_by(gw, Some(s), i).await, pod, "{s}, round {round}");
        }
    }
    let spread: std::collections::BTreeSet<&String> = first.iter().collect();
    assert!(spread.len() >= 2, "six sessions all on one pod: {first:?}");
    // Without the header: the gateway's balancing, and nothing is bound.
    let before = c.keys("higress:endpoint_hash_table:*").await.unwrap().len();
    for i in 0..3 {
        served_by(&gw2, None, i).await;
    }
    assert_eq!(c.keys("higress:endpoint_hash_table:*").await.unwrap().len(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binding_to_a_pod_that_left_is_replaced() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("eh-left", 2).await.unwrap();
    let cfg = redis_policy_config(ROUTE, &pods, &redis, "endpoint_hash", json!({}));
    let gw = Gateway::start(&cfg).await.unwrap();
    let mut c = redis.client().await.unwrap();
    // The default header, x-mse-consumer, bound to a pod no longer in the cluster.
    let key = binding_key("tenant-1");
    c.cmd(&["SET", key.as_str(), "127.0.0.1:9"]).await.unwrap();
    let req = chat(None, 0).header("x-mse-consumer", "tenant-1");
    let r = gw.send(req, REQUEST_TIMEOUT).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let pod = r.upstream().unwrap();
    assert!(hosts(&pods).contains(&pod), "{pod}");
    eventually(Duration::from_secs(5), "the binding rewritten", || {
        let (redis, key, pod) = (&redis, key.clone(), pod.clone());
        async move { Ok(redis.client().await?.get(&key).await?.as_deref() == Some(pod.as_str())) }
    })
    .await
    .unwrap();
    for i in 1..4 {
        let req = chat(None, i).header("x-mse-consumer", "tenant-1");
        let r = gw.send(req, REQUEST_TIMEOUT).await.unwrap();
        assert_eq!(r.upstream().as_deref(), Some(pod.as_str()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_costs_a_request_at_most_breaker_slow_ms() {
    let mut redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("eh-freeze", 2).await.unwrap();
    let cfg = redis_policy_config(ROUTE, &pods, &redis, "endpoint_hash", json!({"timeout": 3000}));
    let gw = Gateway::start(&cfg).await.unwrap();
    let pod = served_by(&gw, Some("alice"), 0).await;
    redis.freeze().await.unwrap();
    let mut slowest = Duration::ZERO;
    for i in 1..9 {
        let t = Instant::now();
        let r = gw.send(chat(Some("alice"), i), REQUEST_TIMEOUT).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        slowest = slowest.max(t.elapsed());
    }
    redis.unfreeze().await.unwrap();
    // breakerSlowMs is 200 ms and the breaker opens at the first stalled lookup; the Redis
    // timeout (3 s) is never waited for.
    assert!(slowest < Duration::from_millis(1500), "slowest request while frozen: {slowest:?}");
    eventually(Duration::from_secs(5), "alice back on her pod", || {
        let (gw, pod) = (&gw, pod.clone());
        async move { Ok(served_by(gw, Some("alice"), 99).await == pod) }
    })
    .await
    .unwrap();
}
