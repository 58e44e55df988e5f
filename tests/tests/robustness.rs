//! Never stuck: Redis going away mid-test, bodiless requests, malformed JSON, non-chat paths and a
//! 5 MiB body are all served (by the plugin's choice or by normal balancing), none hangs.

use std::time::{Duration, Instant};

use bytes::Bytes;
use e2e::*;
use serde_json::json;
use testkit::http::HttpRequest;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_mid_test_requests_still_served_by_normal_balancing() {
    let mut redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("down", 2).await.unwrap();
    // Redis op timeout 1000 ms: a request may wait at most about that long for Redis.
    let cfg =
        redis_policy_config("route-down", &pods, &redis, "prefix_cache", json!({"timeout": 1000}));
    let gw = Gateway::start(&cfg).await.unwrap();
    let mut conv = Conversation::new("redis outage");
    let home = conv.turn(&gw, "first question").await.unwrap();
    assert_eq!(conv.turn(&gw, "second question").await.unwrap(), home);

    redis.stop().await.unwrap();
    let mut served = Vec::new();
    for i in 0..8 {
        let started = Instant::now();
        let resp = if i % 2 == 0 {
            let mut c = Conversation::new(&format!("outage {i}"));
            c.turn(&gw, "hello?").await.map(|h| (200, Some(h)))
        } else {
            chat_once(&gw, &format!("one-shot {i}")).await.map(|r| (r.status, r.upstream()))
        };
        let (status, upstream) =
            resp.unwrap_or_else(|e| panic!("request {i} with Redis down: {e:#}"));
        assert_eq!(status, 200);
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "request {i} took {:?}",
            started.elapsed()
        );
        served.push(upstream.unwrap());
    }
    // Normal balancing (round robin) uses both pods.
    assert_eq!(
        tally(&served).len(),
        2,
        "with Redis down all went to one pod: {:?}",
        tally(&served)
    );
    // The conversation itself is still served too.
    conv.turn(&gw, "third question, Redis is down").await.unwrap();

    // Redis comes back (empty): prefix routing works again for new conversations.
    redis.restart().await.unwrap();
    let mut after = Conversation::new("after the outage");
    let mut recovered = false;
    for _ in 0..20 {
        let h1 = after.turn(&gw, "question one").await.unwrap();
        let h2 = after.turn(&gw, "question two").await.unwrap();
        let keys = redis.client().await.unwrap().keys("*").await.unwrap();
        if h1 == h2 && !keys.is_empty() {
            recovered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        after = Conversation::new(&paths::unique_name("after"));
    }
    assert!(recovered, "prefix routing never resumed after Redis came back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_redis_delays_requests_by_at_most_the_redis_timeout() {
    let mut redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("frozen", 2).await.unwrap();
    // Redis answers nothing (paused), connections stay open: only the plugin's `timeout` (500 ms)
    // through the host's op timeout can unblock the requests.
    let cfg = redis_policy_config(
        "route-frozen",
        &pods,
        &redis,
        "global_least_request",
        json!({"timeout": 500}),
    );
    let gw = Gateway::start(&cfg).await.unwrap();
    assert_eq!(chat_once(&gw, "warm up").await.unwrap().status, 200);
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();

    redis.freeze().await.unwrap();
    let mut served = Vec::new();
    for i in 0..4 {
        let started = Instant::now();
        let r = gw
            .send(HttpRequest::post_json("/v1/chat/completions", &json!({"model": MODEL, "messages": [{"role": "user", "content": format!("frozen {i}")}]})), Duration::from_secs(8))
            .await
            .unwrap_or_else(|e| panic!("request {i} with Redis frozen: {e:#}"));
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "request {i} took {:?}",
            started.elapsed()
        );
        served.push(r.upstream().unwrap());
    }
    assert_eq!(
        tally(&served).len(),
        2,
        "normal balancing should use both pods: {:?}",
        named(&pods, &served)
    );
    // Bodiless requests too.
    let started = Instant::now();
    let r = gw.send(HttpRequest::get("/v1/models"), Duration::from_secs(8)).await.unwrap();
    assert_eq!(r.status, 200);
    assert!(started.elapsed() < Duration::from_secs(4));
    redis.unfreeze().await.unwrap();
    // The slow picks above opened the workers' breakers (`breakerOpenMs` 1000 by default): until
    // it runs out a request is decided without Redis, by design. After it, the next request is the
    // half-open probe and goes to Redis. Without this wait the test raced the breaker (seen under
    // load: the held request landed inside the open period and never counted).
    tokio::time::sleep(Duration::from_millis(1300)).await;

    // Redis is back: the plugin routes through it again (counters appear for a held request).
    for p in &pods {
        p.set_hold(true);
    }
    let h = spawn_request(
        gw.addr(),
        HttpRequest::post_json(
            "/v1/chat/completions",
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "after thaw"}]}),
        ),
        Duration::from_secs(20),
    );
    eventually(Duration::from_secs(10), "the plugin counts in Redis again", || async {
        Ok(pods.iter().map(Pod::in_flight).sum::<usize>() == 1 && counters_sum(&redis).await? >= 1)
    })
    .await
    .unwrap();
    for p in &pods {
        p.set_hold(false);
        p.release();
    }
    assert_eq!(h.await.unwrap().unwrap().status, 200);
}

/// A Redis stall must not leave phantom in-flight requests behind: the picks the plugin gave up on
/// (op timeout) must not be counted when Redis catches up, or balancing stays skewed for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_return_to_zero_after_a_redis_freeze() {
    let mut redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("leak", 2).await.unwrap();
    let cfg = redis_policy_config(
        "route-leak",
        &pods,
        &redis,
        "global_least_request",
        json!({"timeout": 500}),
    );
    let gw = Gateway::start(&cfg).await.unwrap();
    assert_eq!(chat_once(&gw, "warm up").await.unwrap().status, 200);
    redis.freeze().await.unwrap();
    for i in 0..4 {
        assert_eq!(chat_once(&gw, &format!("during the stall {i}")).await.unwrap().status, 200);
    }
    redis.unfreeze().await.unwrap();
    for i in 0..4 {
        assert_eq!(chat_once(&gw, &format!("after the stall {i}")).await.unwrap().status, 200);
    }
    // Nothing is in flight any more.
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

/// A client that disconnects while still uploading its body: nothing is counted, nothing hangs,
/// the gateway keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_gone_during_body_upload() {
    use testkit::http::{send_and_abort, AbortAt};
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("upload", 2).await.unwrap();
    let cfg = redis_policy_config("route-upload", &pods, &redis, "prefix_cache", json!({}));
    let gw = Gateway::start(&cfg).await.unwrap();
    let body =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "x".repeat(20_000)}]})
            .to_string();
    for _ in 0..3 {
        // First 1 KiB now, the rest only after 5 s: the client is gone long before.
        let req = HttpRequest::post("/v1/chat/completions", body.clone())
            .chunked(1024, Duration::from_secs(5));
        let seen = send_and_abort(
            gw.addr(),
            req,
            AbortAt::After(Duration::from_millis(300)),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert_eq!(seen.status, None);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
    let mut conv = Conversation::new("after aborted uploads");
    let home = conv.turn(&gw, "still there?").await.unwrap();
    assert_eq!(conv.turn(&gw, "and again").await.unwrap(), home);
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

async fn odd_requests_all_served(policy: &str, lb_extra: serde_json::Value, route: &str) {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods(route, 2).await.unwrap();
    let mut cfg = redis_policy_config(route, &pods, &redis, policy, lb_extra);
    if policy == "endpoint_metrics" {
        for p in &pods {
            p.set_metrics(samples::vllm_v1(1, 0, 0.1));
        }
        cfg = cfg.metrics_health_check(LLM_CLUSTER, 200);
    }
    let gw = Gateway::start(&cfg).await.unwrap();
    let t = Duration::from_secs(8);

    // Bodiless GET (Higress #3740: must not wait for a body that never comes).
    let r = gw.send(HttpRequest::get("/v1/models"), t).await.unwrap();
    assert_eq!(r.status, 200, "GET /v1/models: {}", r.text());
    assert!(r.upstream().is_some());
    let rec = pods
        .iter()
        .flat_map(|p| p.records())
        .find(|r| r.path == "/v1/models")
        .expect("GET reached a pod");
    assert_eq!(rec.method, "GET");
    assert!(rec.body.is_empty());

    // A bodiless POST and a DELETE too.
    let mut empty_post = HttpRequest::get("/v1/chat/completions");
    empty_post.method = "POST".into();
    let r = gw.send(empty_post, t).await.unwrap();
    assert!(r.upstream().is_some(), "bodiless POST not proxied: {} {}", r.status, r.text());

    // Malformed JSON reaches a pod unchanged and the pod's own 400 comes back.
    let broken =
        "{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"unterminated";
    let r = gw.send(HttpRequest::post("/v1/chat/completions", broken), t).await.unwrap();
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.upstream().is_some());
    assert!(pods.iter().flat_map(|p| p.records()).any(|r| r.body == broken.as_bytes()));

    // Valid JSON of unexpected shapes.
    for body in [
        json!([1, 2, 3]),
        json!({"model": MODEL, "messages": "not a list"}),
        json!({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "part"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
        json!({"model": MODEL, "messages": [{"role": "user", "content": "call a tool"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "42"}]}),
        json!({"model": MODEL, "messages": [{"role": 5, "content": {"x": 1}}]}),
    ] {
        let r = gw.send(HttpRequest::post_json("/v1/chat/completions", &body), t).await.unwrap();
        assert!(r.upstream().is_some() && r.status < 500, "{body}: {} {}", r.status, r.text());
    }

    // Non-chat paths.
    let r = gw
        .send(
            HttpRequest::post_json("/v1/embeddings", &json!({"model": MODEL, "input": "hello"})),
            t,
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.json().unwrap()["path"], "/v1/embeddings");
    let r = gw
        .send(
            HttpRequest::post_json(
                "/v1/completions",
                &json!({"model": MODEL, "prompt": "Once upon a time"}),
            ),
            t,
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200);

    // A 5 MiB chat body, sent in 64 KiB chunks, arrives whole.
    let filler = "lorem ipsum dolor sit amet ".repeat(5 * 1024 * 1024 / 27 + 1);
    let big =
        json!({"model": MODEL, "messages": [{"role": "user", "content": filler}]}).to_string();
    assert!(big.len() >= 5 * 1024 * 1024);
    let big = Bytes::from(big);
    let r = gw
        .send(
            HttpRequest::post("/v1/chat/completions", big.clone())
                .chunked(64 * 1024, Duration::ZERO),
            Duration::from_secs(20),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "5 MiB body: {}", r.text());
    assert!(
        pods.iter().flat_map(|p| p.records()).any(|rec| rec.body == big),
        "the pod did not get the 5 MiB body intact"
    );

    // A chat body delivered slowly in small pieces (several body callbacks).
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "slow client ".repeat(200)}]});
    let r = gw
        .send(
            HttpRequest::post_json("/v1/chat/completions", &body)
                .chunked(300, Duration::from_millis(5)),
            t,
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200);

    if policy != "endpoint_metrics" {
        wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_requests_served_with_prefix_cache() {
    odd_requests_all_served("prefix_cache", json!({}), "odd-pc").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_requests_served_with_global_least_request() {
    odd_requests_all_served("global_least_request", json!({}), "odd-glr").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_requests_served_with_endpoint_metrics() {
    odd_requests_all_served("endpoint_metrics", json!({"scrapeIntervalMs": 200}), "odd-em").await;
}

/// Calls of EVAL and EVALSHA so far (Redis `INFO commandstats`).
async fn script_calls(redis: &RedisFixture) -> i64 {
    let info = redis.client().await.unwrap().cmd(&["INFO", "commandstats"]).await.unwrap();
    let info = info.as_string().unwrap_or_default();
    info.lines()
        .filter(|l| l.starts_with("cmdstat_eval:") || l.starts_with("cmdstat_evalsha:"))
        .filter_map(|l| l.split("calls=").nth(1)?.split(',').next()?.parse::<i64>().ok())
        .sum()
}

/// The client goes away while the plugin holds its request waiting for the pick's Redis reply.
/// Redis runs the pick afterwards (it was frozen, then thawed within the op timeout), so the
/// count goes up for a request that no longer exists: it must come back to 0, and the request
/// never reaches a pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_gone_while_the_pick_is_in_redis_leaves_no_count() {
    use testkit::http::{send_and_abort, AbortAt};
    let mut redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("gone-in-redis", 2).await.unwrap();
    let cfg = redis_policy_config(
        "route-gone",
        &pods,
        &redis,
        "global_least_request",
        json!({"timeout": 3000}),
    );
    let gw = Gateway::start(&cfg).await.unwrap();
    assert_eq!(chat_once(&gw, "warm up").await.unwrap().status, 200);
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
    let served_before: usize = pods.iter().map(Pod::inference_count).sum();
    let calls_before = script_calls(&redis).await;

    redis.freeze().await.unwrap();
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "gone"}]});
    let seen = send_and_abort(
        gw.addr(),
        HttpRequest::post_json("/v1/chat/completions", &body),
        // Before the plugin's own pick deadline (it then falls back to normal balancing).
        AbortAt::After(Duration::from_millis(100)),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert_eq!(seen.status, None, "the request was still held when the client left");
    // The stream has ended (on_log/on_done ran) before Redis answers.
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.unfreeze().await.unwrap();

    eventually(Duration::from_secs(5), "the pick ran in Redis after the client left", || async {
        Ok(script_calls(&redis).await > calls_before)
    })
    .await
    .unwrap();
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
    let served_after: usize = pods.iter().map(Pod::inference_count).sum();
    assert_eq!(served_after, served_before, "the abandoned request reached a pod");
    // The gateway still balances through Redis.
    assert_eq!(chat_once(&gw, "after").await.unwrap().status, 200);
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

/// A conversation kept on the server (Responses API: `store`, then `previous_response_id`) over
/// three pods that each keep their own responses (as vLLM's store does): with Redis stopped, each
/// round still reaches the pod that made the response it names, from the gateway's own record,
/// instead of a pod that answers 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_down_stored_responses_still_reach_their_pod() {
    let mut redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("down-stored", 3).await.unwrap();
    let lb_config = json!({"timeout": 1000});
    let cfg = redis_policy_config("route-down-stored", &pods, &redis, "prefix_cache", lb_config);
    let gw = Gateway::start(&cfg).await.unwrap();
    let respond = |body: serde_json::Value| {
        gw.send(HttpRequest::post_json("/v1/responses", &body), Duration::from_secs(10))
    };
    let first = respond(json!({"model": MODEL, "input": "Fix the build.", "store": true}));
    let first = first.await.unwrap();
    assert_eq!(first.status, 200, "{}", first.text());
    let home = first.upstream().unwrap();
    let mut previous = first.json().unwrap()["id"].as_str().unwrap().to_string();

    redis.stop().await.unwrap();
    for round in 1..=6 {
        let next = json!({"model": MODEL, "previous_response_id": previous,
            "input": format!("Round {round}: the tests still fail."), "store": true});
        let r = respond(next).await.unwrap();
        assert_eq!(r.status, 200, "round {round}: {}", r.text());
        assert_eq!(r.upstream().as_deref(), Some(home.as_str()), "round {round}");
        previous = r.json().unwrap()["id"].as_str().unwrap().to_string();
    }
    let stats = gw.stats().await.unwrap();
    assert_eq!(stat(&stats, "ai_lb_prefix_response_followed"), 6, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_response_unknown"), 0, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_response_recorded"), 7, "{stats}");
}

/// Redis comes back empty (restarted without persistence) after responses were made while it was
/// down, so it knows none of them. The first request Redis decides again continues such a response:
/// held to the pod this gateway recorded, it reaches that pod, and its pick writes the response's key
/// back. Three rounds of stop and restart: an unheld pick on 3 idle pods finds the home pod only
/// one time in three.
#[tokio::test]
async fn after_redis_comes_back_empty_stored_responses_still_reach_their_pod() {
    let mut redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("back-stored", 3).await.unwrap();
    let lb_config = json!({"timeout": 1000, "breakerOpenMs": 200});
    let cfg = redis_policy_config("route-back-stored", &pods, &redis, "prefix_cache", lb_config);
    let gw = Gateway::start(&cfg).await.unwrap();
    let respond = |previous: Option<&str>, round: usize| {
        let mut body = json!({"model": MODEL, "input": format!("Round {round}."), "store": true});
        if let Some(id) = previous {
            body["previous_response_id"] = json!(id);
        }
        gw.send(HttpRequest::post_json("/v1/responses", &body), Duration::from_secs(10))
    };
    let first = respond(None, 0).await.unwrap();
    assert_eq!(first.status, 200, "{}", first.text());
    let home = first.upstream().unwrap();
    let mut previous = first.json().unwrap()["id"].as_str().unwrap().to_string();
    let mut round = 0;
    for cycle in 0..3 {
        redis.stop().await.unwrap();
        round += 1;
        let r = respond(Some(&previous), round).await.unwrap();
        assert_eq!((r.status, r.upstream()), (200, Some(home.clone())), "{}", r.text());
        previous = r.json().unwrap()["id"].as_str().unwrap().to_string();
        redis.restart().await.unwrap();
        let mut c = redis.client().await.unwrap();
        // Rounds until one is decided by Redis: its pick writes the key of the response it
        // continues (one decided without Redis writes none), naming the home pod. Each round
        // reaches the home pod.
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            assert!(Instant::now() < deadline, "cycle {cycle}: Redis never used again");
            round += 1;
            let continued = previous.clone();
            let r = respond(Some(&continued), round).await.unwrap();
            assert_eq!((r.status, r.upstream()), (200, Some(home.clone())), "round {round}");
            previous = r.json().unwrap()["id"].as_str().unwrap().to_string();
            if let Some(key) = c.keys(&response_key_pattern(&continued)).await.unwrap().first() {
                let holder = c.get(key).await.unwrap().unwrap_or_default();
                assert!(holder.starts_with(&format!("{home}@")), "cycle {cycle}: {holder}");
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let stats = gw.stats().await.unwrap();
    assert_eq!(stat(&stats, "ai_lb_prefix_response_unknown"), 0, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_response_followed"), round as i64, "{stats}");
}

/// A response made through gateway A while Redis is down (its record's `SET` cannot be sent) is
/// written once Redis answers A again, so a request continuing it through gateway B, which never
/// saw it, still reaches its pod.
#[tokio::test]
async fn a_response_made_while_redis_was_down_reaches_its_pod_through_another_gateway() {
    let mut redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("down-two-gw", 3).await.unwrap();
    let lb_config = json!({"timeout": 1000, "breakerOpenMs": 200});
    let cfg = redis_policy_config("route-down-two-gw", &pods, &redis, "prefix_cache", lb_config);
    let (a, b) = (Gateway::start(&cfg).await.unwrap(), Gateway::start(&cfg).await.unwrap());
    async fn respond(gw: &Gateway, previous: Option<&str>) -> testkit::http::HttpResponse {
        let mut body = json!({"model": MODEL, "input": "Next step.", "store": true});
        if let Some(id) = previous {
            body["previous_response_id"] = json!(id);
        }
        gw.send(HttpRequest::post_json("/v1/responses", &body), Duration::from_secs(10))
            .await
            .unwrap()
    }
    let first = respond(&a, None).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let home = first.upstream().unwrap();
    let first_id = first.json().unwrap()["id"].as_str().unwrap().to_string();

    redis.stop().await.unwrap();
    let r = respond(&a, Some(&first_id)).await;
    assert_eq!((r.status, r.upstream()), (200, Some(home.clone())), "{}", r.text());
    let made_while_down = r.json().unwrap()["id"].as_str().unwrap().to_string();
    redis.restart().await.unwrap();

    // A writes the record once Redis answers it again (its heartbeat or breaker probe).
    let pattern = response_key_pattern(&made_while_down);
    let mut c = redis.client().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while c.keys(&pattern).await.unwrap().is_empty() {
        assert!(Instant::now() < deadline, "the record of {made_while_down} never reached Redis");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = respond(&b, Some(&made_while_down)).await;
    assert_eq!((r.status, r.upstream()), (200, Some(home.clone())), "{}", r.text());
    let stats = b.stats().await.unwrap();
    assert_eq!(stat(&stats, "ai_lb_prefix_response_followed"), 1, "{stats}");
}

/// A `KEYS` pattern for the prefix key recording the pod of stored response `id`: the chain value
/// of the block `response:<id>` (computed here, not by the plugin's code).
fn response_key_pattern(id: &str) -> String {
    use sha1::{Digest, Sha1};
    let digest = Sha1::digest(format!("response:{id}").as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02X}")).collect();
    format!("*:pfx:{hex}")
}
