//! Two gateway processes (replicas) sharing one Redis: the routing state is global, not per replica.

use std::time::Duration;

use e2e::*;
use serde_json::json;
use testkit::http::HttpRequest;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_turns_through_different_gateways_land_on_the_same_pod() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("two", 3).await.unwrap();
    let cfg = redis_policy_config(
        "route-shared",
        &pods,
        &redis,
        "prefix_cache",
        json!({"timeout": 1000}),
    );
    let gw_a = Gateway::start(&cfg).await.unwrap();
    let gw_b = Gateway::start(&cfg).await.unwrap();

    for c in 0..4 {
        let mut conv = Conversation::new(&format!("replicas {c} {}", paths::unique_name("x")));
        // Turn 1 via A, turn 2 via B, then alternating.
        let home = conv
            .turn(&gw_a, "Summarise the incident report in three bullet points.")
            .await
            .unwrap();
        for turn in 2..=5 {
            let gw = if turn % 2 == 0 { &gw_b } else { &gw_a };
            let host = conv
                .turn(gw, &format!("Turn {turn}: expand bullet {turn} with the timeline."))
                .await
                .unwrap();
            assert_eq!(
                host,
                home,
                "conversation {c} turn {turn} (via {}) left its pod",
                if turn % 2 == 0 { "B" } else { "A" }
            );
        }
    }
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_least_request_counts_are_shared_by_both_gateways() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("two-glr", 2).await.unwrap();
    let cfg =
        redis_policy_config("route-shared-glr", &pods, &redis, "global_least_request", json!({}));
    let gw_a = Gateway::start(&cfg).await.unwrap();
    let gw_b = Gateway::start(&cfg).await.unwrap();
    for p in &pods {
        p.set_hold(true);
    }
    // Alternate gateways: each sees the other's in-flight requests through Redis, so the pods end
    // up evenly loaded (a per-replica count would let both replicas pick the same pod).
    let mut pending = Vec::new();
    for i in 0..6 {
        let gw = if i % 2 == 0 { &gw_a } else { &gw_b };
        let body =
            json!({"model": MODEL, "messages": [{"role": "user", "content": format!("job {i}")}]});
        pending.push(spawn_request(
            gw.addr(),
            HttpRequest::post_json("/v1/chat/completions", &body),
            Duration::from_secs(30),
        ));
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    eventually(Duration::from_secs(10), "6 requests in flight", || async {
        Ok(pods.iter().map(Pod::in_flight).sum::<usize>() == 6)
    })
    .await
    .unwrap();
    assert_eq!(pods.iter().map(Pod::in_flight).collect::<Vec<_>>(), vec![3, 3]);
    for p in &pods {
        p.set_hold(false);
        p.release();
    }
    for h in pending {
        assert_eq!(h.await.unwrap().unwrap().status, 200);
    }
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}
