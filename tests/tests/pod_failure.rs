//! A pod dies under the routing policies that remember or measure pods: once the gateway's health
//! check has marked it Unhealthy, no request fails. Real parts: the compiled plugin in the
//! gateway, a real Redis, recording pods; the pod's listener really goes away (connections
//! refused), and the gateway's own active health check (store_metrics on `/metrics`, as Higress
//! feeds `endpoint_metrics` and `loadAware`) marks it.
//!
//! What a user notices: conversations whose prefix key names the dead pod, and pods whose last
//! stored metrics made them look idle, must not send a single request to it after the mark.

use std::sync::Arc;
use std::time::Duration;

use e2e::*;
use serde_json::{json, Value};

fn question(turn: usize) -> String {
    format!("Turn {turn}: what does section {} of the handbook say about on-call duty?", turn * 3)
}

/// The cluster with a health check on `/metrics` every 100 ms, one failure to mark (so the test
/// knows when the mark is made by watching the admin API, not by guessing).
fn config(
    route: &str,
    pods: &[Pod],
    redis: &RedisFixture,
    policy: &str,
    lb: Value,
) -> GatewayConfig {
    redis_policy_config(route, pods, redis, policy, lb).metrics_health_check(LLM_CLUSTER, 100)
}

/// Runs conversations over three pods, kills the pod holding the most of them, waits for the mark,
/// then checks every later request (old conversations and new ones, sequential and concurrent).
async fn no_request_fails_after_the_mark(prefix: &str, policy: &str, lb: Value) {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods(prefix, 3).await.unwrap();
    for p in &pods {
        // Equal, idle-looking metrics: the dead pod's last stored metrics stay attractive.
        p.set_metrics(samples::vllm_v1(0, 0, 0.1));
    }
    let gw = Arc::new(
        Gateway::start(&config(&format!("route-{prefix}"), &pods, &redis, policy, lb))
            .await
            .unwrap(),
    );
    wait_scrapes(&pods, &[0, 0, 0], 2, Duration::from_secs(15)).await.unwrap();

    let mut convs = Vec::new();
    for i in 0..12 {
        let mut conv =
            Conversation::new(&format!("on-call rota #{i} ({})", paths::unique_name("c")));
        let home = conv.turn(&gw, &question(1)).await.unwrap();
        conv.turn(&gw, &question(2)).await.unwrap();
        convs.push((conv, home));
    }
    let victim =
        pods.iter().max_by_key(|p| convs.iter().filter(|(_, h)| *h == p.host()).count()).unwrap();
    let on_victim = convs.iter().filter(|(_, h)| *h == victim.host()).count();
    assert!(on_victim > 0, "no conversation started on any pod?");

    victim.stop();
    gw.wait_health(LLM_CLUSTER, &victim.host(), "Unhealthy", Duration::from_secs(10))
        .await
        .unwrap();
    let served_by_victim = victim.inference_count();

    // Every old conversation goes on, three more turns each, none of them failing.
    for turn in 3..=5 {
        for (conv, _) in convs.iter_mut() {
            let host = conv.turn(&gw, &question(turn)).await.unwrap_or_else(|e| {
                panic!("{policy}: a request failed after the dead pod was marked: {e:#}")
            });
            assert_ne!(host, victim.host(), "{policy}: routed to the pod marked Unhealthy");
        }
    }
    // New conversations, 12 at once.
    let mut tasks = Vec::new();
    for i in 0..12 {
        let gw = gw.clone();
        tasks.push(tokio::spawn(async move {
            let mut conv = Conversation::new(&format!(
                "new after the failure #{i} ({})",
                paths::unique_name("n")
            ));
            conv.turn(&gw, &question(1)).await
        }));
    }
    for t in tasks {
        let host = t.await.unwrap().unwrap_or_else(|e| {
            panic!("{policy}: a new conversation failed after the dead pod was marked: {e:#}")
        });
        assert_ne!(host, victim.host(), "{policy}: routed to the pod marked Unhealthy");
    }
    assert_eq!(victim.inference_count(), served_by_victim, "the dead pod got requests");
    let served: usize = pods.iter().map(Pod::inference_count).sum();
    assert_eq!(served, 12 * 2 + 12 * 3 + 12, "every request was served once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_go_keys_no_request_fails_after_the_mark() {
    no_request_fails_after_the_mark("pf-go", "prefix_cache", json!({"redisKeyTTL": 120})).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_load_aware_no_request_fails_after_the_mark() {
    no_request_fails_after_the_mark(
        "pf-load",
        "prefix_cache",
        json!({"redisKeyTTL": 120, "loadAware": true}),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_metrics_no_request_fails_after_the_mark() {
    no_request_fails_after_the_mark("pf-metrics", "endpoint_metrics", json!({})).await;
}
