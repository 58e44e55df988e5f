//! Per-route configuration as Higress delivers WasmPlugin matchRules (`_rules_`): each route or
//! domain gets its own policy; requests no rule matches keep the gateway's normal balancing.

use std::time::Duration;

use e2e::*;
use serde_json::json;
use testkit::http::HttpRequest;

/// `route-pc` (`/pc/`) and `route-plain` (`/`) to the same pods.
fn two_routes(redis: &RedisFixture, pods: &[Pod]) -> GatewayConfig {
    GatewayConfig::new()
        .route("route-pc", "/pc/", LLM_CLUSTER)
        .route("route-plain", "/", LLM_CLUSTER)
        .cluster(LLM_CLUSTER, &hosts(pods))
        .redis(&redis.endpoint())
}

/// Sends `turns` more turns of `conv` to `path` (each answer appended), returning which pod served
/// each.
async fn chat_turns(
    gw: &Gateway,
    path: &str,
    conv: &mut Conversation,
    turns: usize,
    label: &str,
) -> Vec<String> {
    let mut seen = Vec::new();
    for turn in 1..=turns {
        conv.messages.push(json!({"role": "user", "content": format!("{label} turn {turn}")}));
        let r = gw.send(HttpRequest::post_json(path, &conv.body()), REQUEST_TIMEOUT).await.unwrap();
        assert_eq!(r.status, 200);
        seen.push(r.upstream().unwrap());
        conv.messages.push(json!({"role": "assistant", "content": answer_text(&r).unwrap()}));
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_pick_the_policy_per_route_and_domain() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("rules", 3).await.unwrap();
    let mut pc = redis_lb_config();
    pc["redisKeyTTL"] = json!(300);
    let cfg = two_routes(&redis, &pods).plugin(json!({
            // No top-level policy (Higress defaultConfigDisable): only the rules configure it.
            "_rules_": [
                {"_match_route_": ["route-pc"], "lb_policy": "prefix_cache", "lb_config": pc},
                {"_match_domain_": ["glr.example.com"], "lb_policy": "global_least_request", "lb_config": redis_lb_config()}
            ]
        }));
    let gw = Gateway::start(&cfg).await.unwrap();

    // route-pc: prefix_cache, the conversation sticks.
    let mut conv = Conversation::new("rules");
    let seen =
        chat_turns(&gw, "/pc/v1/chat/completions", &mut conv, 4, "on the prefix route").await;
    assert_eq!(tally(&seen).len(), 1, "prefix route: {:?}", named(&pods, &seen));

    // route-plain, no matching rule: the same growing conversation is round robin.
    let seen = chat_turns(&gw, "/v1/chat/completions", &mut conv, 6, "on the plain route").await;
    assert_eq!(
        tally(&seen).values().copied().collect::<Vec<_>>(),
        vec![2, 2, 2],
        "plain route: {:?}",
        named(&pods, &seen)
    );
    let mut c = redis.client().await.unwrap();
    let plain_keys = c.keys("*route-plain*").await.unwrap();
    assert!(plain_keys.is_empty(), "the plain route wrote Redis keys: {plain_keys:?}");
    assert!(
        !c.keys("*route-pc*:pfx:*").await.unwrap().is_empty(),
        "the prefix route wrote no keys"
    );

    // Domain rule on the plain route: global least request spreads held requests evenly.
    for p in &pods {
        p.set_hold(true);
    }
    let mut pending = Vec::new();
    for i in 0..6 {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": format!("domain job {i}")}]});
        let req =
            HttpRequest::post_json("/v1/chat/completions", &body).header("host", "glr.example.com");
        pending.push(spawn_request(gw.addr(), req, Duration::from_secs(30)));
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    eventually(Duration::from_secs(10), "6 domain requests in flight", || async {
        Ok(pods.iter().map(Pod::in_flight).sum::<usize>() == 6)
    })
    .await
    .unwrap();
    assert_eq!(pods.iter().map(Pod::in_flight).collect::<Vec<_>>(), vec![2, 2, 2]);
    let counters = redis_counters(&redis).await.unwrap();
    let domain_total: i64 =
        counters.iter().filter(|(k, _, _)| k.contains("route-plain")).map(|(_, _, v)| v).sum();
    assert_eq!(domain_total, 6, "global least request counters for the domain rule: {counters:?}");
    for p in &pods {
        p.set_hold(false);
        p.release();
    }
    for h in pending {
        assert_eq!(h.await.unwrap().unwrap().status, 200);
    }
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

/// Two `_rules_` shapes where ours used to differ from Go, as Higress's wasm-go matcher reads them:
/// a rule with `_match_route_` and `_match_domain_` matches on the route alone, and an invalid
/// top-level config next to rules is disabled (the gateway starts; other routes pass through)
/// instead of failing the plugin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_follow_go_precedence_and_an_invalid_top_level_is_disabled() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("rules-go", 3).await.unwrap();
    let cfg = two_routes(&redis, &pods).plugin(json!({
        // Invalid: prefix_cache without the Redis location. Go disables it next to rules.
        "lb_policy": "prefix_cache",
        "lb_config": {"redisKeyTTL": 300},
        "_rules_": [
            {"_match_route_": ["route-pc"], "_match_domain_": ["never.example.com"],
             "lb_policy": "prefix_cache", "lb_config": redis_lb_config()}
        ]
    }));
    let gw = Gateway::start(&cfg).await.unwrap();

    // route-pc from any host: the route decides, the domain is not consulted.
    let mut conv = Conversation::new("rules-go");
    let seen = chat_turns(&gw, "/pc/v1/chat/completions", &mut conv, 4, "rule").await;
    assert_eq!(tally(&seen).len(), 1, "route rule by route alone: {:?}", named(&pods, &seen));
    let mut c = redis.client().await.unwrap();
    assert!(!c.keys("*route-pc*:pfx:*").await.unwrap().is_empty(), "the rule wrote no keys");

    // Other routes: the disabled top level leaves them to round robin, untouched by the plugin.
    let seen = chat_turns(&gw, "/v1/chat/completions", &mut conv, 6, "plain").await;
    assert_eq!(
        tally(&seen).values().copied().collect::<Vec<_>>(),
        vec![2, 2, 2],
        "plain route: {:?}",
        named(&pods, &seen)
    );
    assert!(c.keys("*route-plain*").await.unwrap().is_empty(), "the plain route wrote keys");
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}
