//! global_least_request end to end.
//!
//! What a user notices: long requests are spread evenly over the pods; the in-flight counts in
//! Redis return to exactly 0 once everything ended, whatever way it ended (success, client abort,
//! upstream 5xx, aborted stream); `maxRequestCount` turns excess requests into quick 429s.

use std::time::Duration;

use e2e::*;
use serde_json::json;
use testkit::http::{self, AbortAt, HttpRequest};

fn chat_request(i: usize, stream: bool) -> HttpRequest {
    HttpRequest::post_json(
        "/v1/chat/completions",
        &json!({"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": format!("long task {i}")}]}),
    )
}

async fn wait_in_flight(pods: &[Pod], total: usize) {
    eventually(
        Duration::from_secs(10),
        &format!("{total} requests in flight at the pods"),
        || async { Ok(pods.iter().map(Pod::in_flight).sum::<usize>() == total) },
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_requests_spread_evenly_and_counts_return_to_zero() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("glr", 3).await.unwrap();
    let gw = Gateway::start(&redis_policy_config(
        "route-glr",
        &pods,
        &redis,
        "global_least_request",
        json!({}),
    ))
    .await
    .unwrap();
    for p in &pods {
        p.set_hold(true);
    }
    let mut pending = Vec::new();
    for i in 0..9 {
        pending.push(spawn_request(gw.addr(), chat_request(i, false), Duration::from_secs(30)));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_in_flight(&pods, 9).await;
    let spread: Vec<usize> = pods.iter().map(Pod::in_flight).collect();
    assert_eq!(spread, vec![3, 3, 3], "9 long requests on 3 pods must be 3 each");
    assert_eq!(counters_sum(&redis).await.unwrap(), 9, "Redis in-flight total while 9 are running");
    for c in redis_counters(&redis).await.unwrap() {
        assert_eq!(c.2, 3, "counter {c:?}");
    }

    for p in &pods {
        p.set_hold(false);
        p.release();
    }
    let mut served = Vec::new();
    for h in pending {
        let r = h.await.unwrap().unwrap();
        assert_eq!(r.status, 200);
        served.push(r.upstream().unwrap());
    }
    assert_eq!(tally(&served).values().copied().collect::<Vec<_>>(), vec![3, 3, 3]);
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();

    // With nothing in flight, a new request still works and the count goes 0 -> 1 -> 0.
    let r = chat_once(&gw, "short").await.unwrap();
    assert_eq!(r.status, 200);
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_return_to_zero_after_aborts_5xx_and_broken_streams() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("abort", 2).await.unwrap();
    let gw = Gateway::start(&redis_policy_config(
        "route-abort",
        &pods,
        &redis,
        "global_least_request",
        json!({}),
    ))
    .await
    .unwrap();

    // 1. Clients that give up while the pod is still working.
    for p in &pods {
        p.set_hold(true);
    }
    let mut aborts = Vec::new();
    for i in 0..4 {
        let addr = gw.addr();
        aborts.push(tokio::spawn(async move {
            http::send_and_abort(
                addr,
                chat_request(i, false),
                AbortAt::After(Duration::from_millis(700)),
                Duration::from_secs(10),
            )
            .await
        }));
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    wait_in_flight(&pods, 4).await;
    assert_eq!(counters_sum(&redis).await.unwrap(), 4);
    for a in aborts {
        let seen = a.await.unwrap().unwrap();
        assert_eq!(seen.status, None, "the held request answered before the abort");
    }
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
    for p in &pods {
        p.set_hold(false);
        p.release();
    }

    // 2. Upstream 5xx answers.
    for p in &pods {
        p.set_fail(Some(503));
    }
    for i in 0..4 {
        let r = gw.send(chat_request(i, false), REQUEST_TIMEOUT).await.unwrap();
        assert_eq!(r.status, 503, "the pod's 503 passes through");
    }
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
    for p in &pods {
        p.set_fail(None);
    }

    // 3. Streams the client drops after the first chunk.
    for p in &pods {
        p.set_stream_chunk_delay(Duration::from_millis(500));
    }
    for i in 0..3 {
        let seen = http::send_and_abort(
            gw.addr(),
            chat_request(i, true),
            AbortAt::FirstBodyFrame,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
        assert_eq!(seen.status, Some(200));
    }
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();

    // 4. A pod that dies mid-request (connection reset by the upstream).
    pods[0].set_hold(true);
    pods[1].set_hold(true);
    let a = spawn_request(gw.addr(), chat_request(100, false), Duration::from_secs(15));
    let b = spawn_request(gw.addr(), chat_request(101, false), Duration::from_secs(15));
    wait_in_flight(&pods, 2).await;
    pods[0].stop();
    pods[1].stop();
    for h in [a, b] {
        let r = h.await.unwrap().expect("the gateway answers even when the upstream dies");
        assert!(r.status >= 500, "status {} after the upstream died", r.status);
    }
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
    let all = redis_counters(&redis).await.unwrap();
    assert!(all.iter().all(|(_, _, v)| *v >= 0), "negative counters: {all:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_request_count_answers_429_and_undoes_the_increment() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("max", 2).await.unwrap();
    let gw = Gateway::start(&redis_policy_config(
        "route-max",
        &pods,
        &redis,
        "global_least_request",
        json!({"maxRequestCount": 1}),
    ))
    .await
    .unwrap();
    for p in &pods {
        p.set_hold(true);
    }
    let a = spawn_request(gw.addr(), chat_request(0, false), Duration::from_secs(30));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let b = spawn_request(gw.addr(), chat_request(1, false), Duration::from_secs(30));
    wait_in_flight(&pods, 2).await;
    assert_eq!(pods.iter().map(Pod::in_flight).collect::<Vec<_>>(), vec![1, 1]);

    // Both pods are at the limit: the next requests are refused at once, not queued.
    for i in 2..5 {
        let started = std::time::Instant::now();
        let r = gw.send(chat_request(i, false), Duration::from_secs(5)).await.unwrap();
        assert_eq!(r.status, 429, "body {}", r.text());
        assert!(started.elapsed() < Duration::from_secs(4));
    }
    assert_eq!(
        pods.iter().map(Pod::inference_count).sum::<usize>(),
        2,
        "a refused request reached a pod"
    );
    assert_eq!(counters_sum(&redis).await.unwrap(), 2, "a 429 left its +1 behind");

    for p in &pods {
        p.set_hold(false);
        p.release();
    }
    assert_eq!(a.await.unwrap().unwrap().status, 200);
    assert_eq!(b.await.unwrap().unwrap().status, 200);
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
    // Capacity is back.
    assert_eq!(chat_once(&gw, "after").await.unwrap().status, 200);
}
