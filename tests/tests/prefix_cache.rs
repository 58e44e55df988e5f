//! prefix_cache end to end: the compiled plugin in the gateway, a real Redis, recording pods.
//!
//! What a user notices: every turn of a conversation lands on the pod that holds its KV cache;
//! new conversations spread over the pods; when that pod leaves the cluster or turns unhealthy the
//! conversation moves once and then stays on its new pod; Redis holds the prefix keys with a TTL.

use std::sync::Arc;
use std::time::Duration;

use e2e::*;
use serde_json::json;
use testkit::{HttpRequest, HttpResponse};

const TTL_S: i64 = 120;

fn prefix_config(route: &str, pods: &[Pod], redis: &RedisFixture) -> GatewayConfig {
    redis_policy_config(
        route,
        pods,
        redis,
        "prefix_cache",
        json!({"redisKeyTTL": TTL_S, "timeout": 1000}),
    )
}

fn question(turn: usize) -> String {
    format!(
        "Turn {turn}: given the previous answers, what does clause {} of the contract imply for the \
         delivery schedule, and which risks should we flag to the customer?",
        turn * 7
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_turn_conversations_stick_to_their_pod_and_new_ones_spread() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("pc", 3).await.unwrap();
    let gw = Arc::new(Gateway::start(&prefix_config("route-stick", &pods, &redis)).await.unwrap());

    // Six new conversations arrive while the pods are busy with them (requests held open): a miss
    // falls back to global least request, so they must spread evenly, two per pod.
    for p in &pods {
        p.set_hold(true);
    }
    let mut first_turns = Vec::new();
    for i in 0..6 {
        let gw = gw.clone();
        first_turns.push(tokio::spawn(async move {
            let mut conv =
                Conversation::new(&format!("contract review #{i} ({})", paths::unique_name("c")));
            let host = conv.turn(&gw, &question(1)).await;
            (conv, host)
        }));
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    eventually(Duration::from_secs(10), "6 first turns in flight at the pods", || async {
        Ok(pods.iter().map(Pod::in_flight).sum::<usize>() == 6)
    })
    .await
    .unwrap();
    let spread: Vec<usize> = pods.iter().map(Pod::in_flight).collect();
    assert_eq!(spread, vec![2, 2, 2], "new conversations did not spread by least request");
    for p in &pods {
        p.set_hold(false);
        p.release();
    }
    let mut convs = Vec::new();
    for t in first_turns {
        let (conv, host) = t.await.unwrap();
        convs.push((conv, host.unwrap()));
    }

    // Turns 2..5 of every conversation land on the pod of its first turn.
    for turn in 2..=5 {
        for (conv, home) in convs.iter_mut() {
            let host = conv.turn(&gw, &question(turn)).await.unwrap();
            assert_eq!(&host, home, "turn {turn} left its pod");
        }
    }
    // The pods really got those requests, with the whole history each time.
    for (conv, home) in &convs {
        let pod = pod_at(&pods, home).unwrap();
        let last_user =
            conv.messages[conv.messages.len() - 2]["content"].as_str().unwrap().to_string();
        let seen = pod.inference_records().iter().any(|r| {
            serde_json::from_slice::<serde_json::Value>(&r.body)
                .map(|b| {
                    b["messages"].as_array().map(Vec::len) == Some(conv.messages.len() - 1)
                        && b["messages"][conv.messages.len() - 2]["content"] == last_user.as_str()
                })
                .unwrap_or(false)
        });
        assert!(seen, "pod {home} never received the 5th turn of its conversation");
    }
    let per_pod: Vec<usize> = pods.iter().map(Pod::inference_count).collect();
    assert_eq!(per_pod, vec![10, 10, 10], "each pod serves its two conversations' 5 turns");
    // The decisions are counted, and the pods' cache reports (`cached_tokens`) confirm each guess:
    // first turns were misses with nothing cached, later turns hits with the history cached.
    let stats = gw.stats().await.unwrap();
    assert_eq!(stat(&stats, "ai_lb_prefix_miss"), 6, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_hit"), 24, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_predicted_miss_engine_miss"), 6, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_predicted_hit_engine_hit"), 24, "{stats}");
    assert!(stat(&stats, "ai_lb_engine_cached_tokens") > 0, "{stats}");
    // The host shows where the plugin's time went, callback by callback: each of the 30
    // requests had its headers, its reply's body chunks and its pick's Redis reply, and the
    // callbacks' times add up to the total.
    let per_callback = |metric: &str, callback: &str| {
        let sum = testkit::gateway::prom_sum(&stats, metric, &[("callback", callback)]);
        sum.unwrap_or(0.0)
    };
    for callback in
        ["proxy_on_request_headers", "proxy_on_response_body", "proxy_on_redis_call_response"]
    {
        let calls = per_callback("gateway_vm_callback_calls_total", callback);
        assert!(calls >= 30.0, "{callback}: {calls} calls\n{stats}");
        assert!(per_callback("gateway_vm_callback_seconds_total", callback) > 0.0, "{stats}");
    }
    let total =
        testkit::gateway::prom_sum(&stats, "gateway_vm_call_seconds_total", &[]).unwrap_or(0.0);
    let summed =
        testkit::gateway::prom_sum(&stats, "gateway_vm_callback_seconds_total", &[]).unwrap_or(0.0);
    assert!(total > 0.0 && (summed - total).abs() < 1e-3, "{summed} against {total}");
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

/// Scale-out: a pod added to the cluster while the others are busy takes the new conversations
/// at once (a miss goes to the least loaded pod, and the new pod has nothing in flight), and the
/// conversations already running keep their pods and caches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_added_at_run_time_takes_the_new_conversations_and_the_old_ones_stay() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("add", 3).await.unwrap();
    let (old_pods, new_pod) = (&pods[..2], &pods[2]);
    let gw = Arc::new(Gateway::start(&prefix_config("route-add", old_pods, &redis)).await.unwrap());
    for p in &pods {
        p.set_hold(true);
    }
    let start = |i: usize| {
        let gw = gw.clone();
        tokio::spawn(async move {
            let mut conv =
                Conversation::new(&format!("scale-out #{i} ({})", paths::unique_name("c")));
            let host = conv.turn(&gw, &question(1)).await;
            (conv, host)
        })
    };
    let in_flight = |n: usize| {
        let pods = &pods;
        async move {
            eventually(Duration::from_secs(10), &format!("{n} first turns in flight"), || async {
                Ok(pods.iter().map(Pod::in_flight).sum::<usize>() == n)
            })
            .await
        }
    };
    let mut first_turns: Vec<_> = (0..4).map(start).collect();
    in_flight(4).await.unwrap();
    let spread: Vec<usize> = pods.iter().map(Pod::in_flight).collect();
    assert_eq!(spread, vec![2, 2, 0], "before the scale-out");

    gw.set_endpoints(LLM_CLUSTER, &hosts(&pods)).await.unwrap();
    first_turns.extend((4..6).map(start));
    in_flight(6).await.unwrap();
    let spread: Vec<usize> = pods.iter().map(Pod::in_flight).collect();
    assert_eq!(spread, vec![2, 2, 2], "the added pod did not take the new conversations");

    for p in &pods {
        p.set_hold(false);
        p.release();
    }
    for (i, t) in first_turns.into_iter().enumerate() {
        let (mut conv, home) = t.await.unwrap();
        let home = home.unwrap();
        assert_eq!(i >= 4, home == new_pod.host(), "conversation {i} started on {home}");
        let again = conv.turn(&gw, &question(2)).await.unwrap();
        assert_eq!(again, home, "turn 2 of conversation {i} left its pod");
    }
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

async fn conversation_on_one_pod(gw: &Gateway, topic: &str) -> (Conversation, String) {
    let mut conv = Conversation::new(topic);
    let home = conv.turn(gw, &question(1)).await.unwrap();
    let again = conv.turn(gw, &question(2)).await.unwrap();
    assert_eq!(again, home, "turn 2 left its pod");
    (conv, home)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversation_moves_off_a_removed_pod_and_stays_on_the_new_one() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("rm", 3).await.unwrap();
    let gw = Gateway::start(&prefix_config("route-remove", &pods, &redis)).await.unwrap();

    let (mut conv, old) = conversation_on_one_pod(&gw, "pod removal").await;
    let remaining: Vec<String> = hosts(&pods).into_iter().filter(|h| *h != old).collect();
    gw.set_endpoints(LLM_CLUSTER, &remaining).await.unwrap();
    let old_count = pod_at(&pods, &old).unwrap().inference_count();

    let new_home = conv.turn(&gw, &question(3)).await.unwrap();
    assert_ne!(new_home, old, "turn 3 went to a pod that left the cluster");
    assert!(remaining.contains(&new_home));
    for turn in 4..=5 {
        assert_eq!(
            conv.turn(&gw, &question(turn)).await.unwrap(),
            new_home,
            "turn {turn} left its new pod"
        );
    }
    assert_eq!(
        pod_at(&pods, &old).unwrap().inference_count(),
        old_count,
        "removed pod still got traffic"
    );
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversation_moves_off_an_unhealthy_pod_and_stays_after_it_recovers() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("uh", 3).await.unwrap();
    let gw = Gateway::start(&prefix_config("route-unhealthy", &pods, &redis)).await.unwrap();

    let (mut conv, old) = conversation_on_one_pod(&gw, "unhealthy pod").await;
    gw.set_health(LLM_CLUSTER, &[(old.as_str(), "Unhealthy")]).await.unwrap();
    gw.wait_health(LLM_CLUSTER, &old, "Unhealthy", Duration::from_secs(5)).await.unwrap();
    let old_count = pod_at(&pods, &old).unwrap().inference_count();

    let new_home = conv.turn(&gw, &question(3)).await.unwrap();
    assert_ne!(new_home, old, "turn 3 went to an unhealthy pod");
    for turn in 4..=5 {
        assert_eq!(
            conv.turn(&gw, &question(turn)).await.unwrap(),
            new_home,
            "turn {turn} left its new pod"
        );
    }
    assert_eq!(
        pod_at(&pods, &old).unwrap().inference_count(),
        old_count,
        "unhealthy pod still got traffic"
    );

    // The conversation was re-homed in Redis: the old pod coming back does not pull it back
    // (its KV cache for the later turns is on the new pod now).
    gw.set_health(LLM_CLUSTER, &[(old.as_str(), "Healthy")]).await.unwrap();
    gw.wait_health(LLM_CLUSTER, &old, "Healthy", Duration::from_secs(5)).await.unwrap();
    assert_eq!(
        conv.turn(&gw, &question(6)).await.unwrap(),
        new_home,
        "turn 6 went back to the old pod"
    );
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_turns_stick_too() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("st", 3).await.unwrap();
    for p in &pods {
        p.set_stream_chunk_delay(Duration::from_millis(20));
    }
    let gw = Gateway::start(&prefix_config("route-stream", &pods, &redis)).await.unwrap();
    let mut conv = Conversation::new("streaming");
    conv.stream = true;
    let home = conv.turn(&gw, &question(1)).await.unwrap();
    assert!(conv.messages.last().unwrap()["content"].as_str().unwrap().starts_with("Hello from"));
    for turn in 2..=5 {
        assert_eq!(
            conv.turn(&gw, &question(turn)).await.unwrap(),
            home,
            "streamed turn {turn} left its pod"
        );
    }
    // The usage chunk at the end of each stream carries the pod's cache report.
    let stats = gw.stats().await.unwrap();
    assert_eq!(stat(&stats, "ai_lb_predicted_hit_engine_hit"), 4, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_predicted_miss_engine_miss"), 1, "{stats}");
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

/// The prefix blocks of a chat body as the plugin's contract (issue 2) defines them:
/// `role + ":" + content` concatenated, cut after each user message and after the last message.
fn expected_blocks(messages: &[serde_json::Value]) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut cur = String::new();
    for (i, m) in messages.iter().enumerate() {
        let role = m["role"].as_str().unwrap();
        cur.push_str(role);
        cur.push(':');
        cur.push_str(m["content"].as_str().unwrap());
        if role == "user" || i + 1 == messages.len() {
            blocks.push(std::mem::take(&mut cur));
        }
    }
    blocks
}

/// key_i = key_{i-1} XOR sha1(block_i), upper-case hex.
fn expected_chain(blocks: &[String]) -> Vec<String> {
    use sha1::{Digest, Sha1};
    let mut acc = [0u8; 20];
    blocks
        .iter()
        .map(|b| {
            for (a, x) in acc.iter_mut().zip(Sha1::digest(b.as_bytes()).iter()) {
                *a ^= x;
            }
            acc.iter().map(|b| format!("{b:02X}")).collect()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_holds_the_conversation_keys_with_ttl() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("ttl", 2).await.unwrap();
    let route = "route-ttl";
    let gw = Gateway::start(&prefix_config(route, &pods, &redis)).await.unwrap();
    let mut conv = Conversation::new("key layout");
    let home = conv.turn(&gw, &question(1)).await.unwrap();
    for turn in 2..=3 {
        assert_eq!(conv.turn(&gw, &question(turn)).await.unwrap(), home);
    }

    // The request of turn 3 held 3 blocks; turns 1 and 2 wrote the first 1 and 2 of the same chain.
    // So Redis holds exactly those 3 prefix keys (README "## Design": namespaced by route and
    // cluster with one hash tag), each naming the conversation's pod, each with a TTL <= redisKeyTTL.
    let sent = &conv.messages[..conv.messages.len() - 1];
    let chain = expected_chain(&expected_blocks(sent));
    assert_eq!(chain.len(), 3);
    let base = format!("higress:ai-lb:{{{route}|{LLM_CLUSTER}}}");
    let mut expected: Vec<String> = chain.iter().map(|k| format!("{base}:pfx:{k}")).collect();
    expected.sort();
    let mut c = redis.client().await.unwrap();
    let found = c.keys("*:pfx:*").await.unwrap();
    assert_eq!(found, expected, "prefix keys in Redis");
    for key in &found {
        // The value is the pod, then `@` and when it was written (Redis's clock, s).
        let value = c.get(key).await.unwrap().unwrap_or_default();
        assert_eq!(value.split('@').next(), Some(home.as_str()), "{key}: {value}");
        let ttl = c.ttl(key).await.unwrap();
        assert!(ttl > 0 && ttl <= TTL_S, "key {key} has TTL {ttl}, expected 1..={TTL_S}");
    }
    // The in-flight counters of this route live under the same hash tag.
    let inflight = c.keys(&format!("{base}:inflight")).await.unwrap();
    assert_eq!(inflight.len(), 1, "in-flight hash {base}:inflight missing");

    // A hit refreshes the TTL of a matched key written more than an eighth of its TTL ago (here
    // made so: the key turn 4 matches, turn 3's whole prompt, and the first one; the same pod,
    // written an hour ago, 20 s left): its match due for a refresh, the pick reads the whole chain
    // and writes both again.
    let long_ago = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() - 3600)
        .unwrap_or(0);
    let old_value = format!("{home}@{long_ago}");
    let aged: Vec<String> = [&chain[0], &chain[2]]
        .iter()
        .filter_map(|k| expected.iter().find(|key| key.ends_with(k.as_str())).cloned())
        .collect();
    assert_eq!(aged.len(), 2);
    for key in &aged {
        c.cmd(&["SET", key, &old_value, "EX", "20"]).await.unwrap();
        assert!(c.ttl(key).await.unwrap() <= 20);
    }
    assert_eq!(conv.turn(&gw, &question(4)).await.unwrap(), home);
    for key in &aged {
        let ttl = c.ttl(key).await.unwrap();
        assert!(ttl > 20 && ttl <= TTL_S, "matched key {key}'s TTL not refreshed: {ttl}");
    }
    // And turn 4 added its own block to the chain.
    assert_eq!(c.keys("*:pfx:*").await.unwrap().len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_prompts_and_tool_lists_are_part_of_the_prefix() {
    use testkit::http::HttpRequest;
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("tools", 2).await.unwrap();
    let gw = Gateway::start(&prefix_config("route-tools", &pods, &redis)).await.unwrap();

    // /v1/completions: the same long prompt goes to the same pod every time.
    let prompt =
        "Translate the following legal text into plain English, keeping every obligation: "
            .repeat(20);
    let mut seen = Vec::new();
    for _ in 0..4 {
        let r = gw
            .send(
                HttpRequest::post_json(
                    "/v1/completions",
                    &json!({"model": MODEL, "prompt": prompt, "max_tokens": 16}),
                ),
                REQUEST_TIMEOUT,
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        seen.push(r.upstream().unwrap());
    }
    assert_eq!(tally(&seen).len(), 1, "same prompt, different pods: {:?}", named(&pods, &seen));

    // Same messages, different `tools`: the chat template renders the tools first, so the KV
    // prefixes differ and the second request must not be glued to the first one's pod. With the
    // first request held on its pod, least request sends the second one to the other pod.
    let messages = json!([{"role": "user", "content": "What is the weather in Paris tomorrow?"}]);
    let tool = |name: &str| json!([{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    for p in &pods {
        p.set_hold(true);
    }
    let first = spawn_request(
        gw.addr(),
        HttpRequest::post_json(
            "/v1/chat/completions",
            &json!({"model": MODEL, "messages": messages, "tools": tool("get_weather")}),
        ),
        Duration::from_secs(20),
    );
    eventually(Duration::from_secs(10), "first request at a pod", || async {
        Ok(pods.iter().map(Pod::in_flight).sum::<usize>() == 1)
    })
    .await
    .unwrap();
    let first_pod = pods.iter().find(|p| p.in_flight() == 1).unwrap().host();
    for p in &pods {
        p.set_hold(false);
    }
    let second = gw
        .send(
            HttpRequest::post_json(
                "/v1/chat/completions",
                &json!({"model": MODEL, "messages": messages, "tools": tool("get_forecast_v2")}),
            ),
            REQUEST_TIMEOUT,
        )
        .await
        .unwrap();
    assert_eq!(second.status, 200);
    assert_ne!(
        second.upstream().unwrap(),
        first_pod,
        "a different tool list reused the other prefix's pod"
    );
    for p in &pods {
        p.release();
    }
    assert_eq!(first.await.unwrap().unwrap().status, 200);
    // Same tools again: a hit on the first pod.
    let again = gw
        .send(
            HttpRequest::post_json(
                "/v1/chat/completions",
                &json!({"model": MODEL, "messages": messages, "tools": tool("get_weather")}),
            ),
            REQUEST_TIMEOUT,
        )
        .await
        .unwrap();
    assert_eq!(again.upstream().unwrap(), first_pod);
}

/// An agent's session: a task, then a tool round per request (the reply calls a tool, the next
/// request carries its result). With the default `splitToolResults` every round is a block, so
/// round k finds all k blocks before it on its pod; with the Go plugin's cuts (off) it finds the
/// task's block alone, however long the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_tool_rounds_stay_on_its_pod_and_each_finds_every_round_before() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("agent", 2).await.unwrap();
    let tools = json!([{"type": "function", "function": {"name": "run_command", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]);
    for (split, matched_blocks) in [(true, 1 + 2 + 3), (false, 1 + 1 + 1)] {
        let route = format!("route-agent-{split}");
        let cfg = redis_policy_config(
            &route,
            &pods,
            &redis,
            "prefix_cache",
            json!({"redisKeyTTL": TTL_S, "timeout": 1000, "splitToolResults": split}),
        );
        let gw = Gateway::start(&cfg).await.unwrap();
        let mut messages = vec![
            json!({"role": "user", "content": format!("The build of {} fails on the CI; find out why and fix it.", paths::unique_name("repo"))}),
        ];
        let mut served = Vec::new();
        for round in 0..4 {
            let body =
                json!({"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 32});
            let r = gw
                .send(HttpRequest::post_json("/v1/chat/completions", &body), REQUEST_TIMEOUT)
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            served.push(r.upstream().unwrap());
            let id = format!("call_{round}");
            messages.push(json!({"role": "assistant", "content": answer_text(&r).unwrap(),
                "tool_calls": [{"id": id, "type": "function", "function": {"name": "run_command", "arguments": "{\"command\":\"make test\"}"}}]}));
            messages.push(json!({"role": "tool", "tool_call_id": id, "content": format!("exit status {round}: 3 tests failed in module {round}")}));
        }
        assert_eq!(tally(&served).len(), 1, "the session moved: {:?}", named(&pods, &served));
        let stats = gw.stats().await.unwrap();
        assert_eq!(stat(&stats, "ai_lb_prefix_miss"), 1, "{stats}");
        assert_eq!(stat(&stats, "ai_lb_prefix_hit"), 3, "{stats}");
        assert_eq!(
            stat(&stats, "ai_lb_prefix_matched_blocks"),
            matched_blocks,
            "split {split}: {stats}"
        );
    }
}

/// The same agent through OpenAI's Responses API (`/v1/responses`, as Codex sends it):
/// `instructions`, then `input` items, each turn resending the whole list with the model's
/// message, its function call and the call's output appended. The session stays on its pod and each
/// turn finds every round before, as over chat completions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_api_agent_stays_on_its_pod_and_each_turn_finds_every_round_before() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("responses", 2).await.unwrap();
    let cfg = redis_policy_config(
        "route-responses",
        &pods,
        &redis,
        "prefix_cache",
        json!({"redisKeyTTL": TTL_S, "timeout": 1000}),
    );
    let gw = Gateway::start(&cfg).await.unwrap();
    let tools = json!([{"type": "function", "name": "run_command", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}]);
    let mut input = vec![json!({"role": "user", "content": [{"type": "input_text",
        "text": format!("The build of {} fails on the CI; find out why and fix it.", paths::unique_name("repo"))}]})];
    let mut served = Vec::new();
    for round in 0..4 {
        let body = json!({"model": MODEL, "instructions": "You are a coding agent.",
            "input": input, "tools": tools, "max_output_tokens": 32, "stream": round % 2 == 1});
        let r =
            gw.send(HttpRequest::post_json("/v1/responses", &body), REQUEST_TIMEOUT).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(r.text().contains("Hello from"), "{}", r.text());
        served.push(r.upstream().unwrap());
        // (The model's turn is written here, whatever the test pod answered.)
        input.push(
            json!({"type": "message", "role": "assistant", "content": [{"type": "output_text",
            "text": format!("Round {round}: running the tests."), "annotations": []}]}),
        );
        let id = format!("call_{round}");
        input.push(json!({"type": "function_call", "call_id": id, "name": "run_command",
            "arguments": "{\"command\":\"make test\"}"}));
        input.push(json!({"type": "function_call_output", "call_id": id,
            "output": format!("exit status {round}: 3 tests failed in module {round}")}));
    }
    assert_eq!(tally(&served).len(), 1, "the session moved: {:?}", named(&pods, &served));
    let stats = gw.stats().await.unwrap();
    assert_eq!(stat(&stats, "ai_lb_prefix_miss"), 1, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_hit"), 3, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_matched_blocks"), 1 + 2 + 3, "{stats}");
    // The pod's reports (`usage.input_tokens_details`, in a JSON reply and in a stream's
    // `response.completed`) confirm each guess: the first round found nothing cached, the
    // later ones their history.
    assert_eq!(stat(&stats, "ai_lb_predicted_miss_engine_miss"), 1, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_predicted_hit_engine_hit"), 3, "{stats}");
    assert!(
        stat(&stats, "ai_lb_engine_prompt_tokens") > stat(&stats, "ai_lb_engine_cached_tokens")
    );
}

/// Higress's default downstream buffer limit is 32 KiB and Envoy answers 413 to a held body over
/// it. The gateway here runs with that default (no listener override), so these chats pass only
/// because the plugin raises the stream's limit to `maxBodyBytes` while it reads the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_chats_over_higress_default_buffer_limit_are_routed_by_prefix() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("long", 3).await.unwrap();
    let cfg = prefix_config("route-long", &pods, &redis);
    assert!(
        cfg.to_json()["listeners"][0].get("per_connection_buffer_limit_bytes").is_none(),
        "the test must run at the gateway's Higress default"
    );
    let gw = Gateway::start(&cfg).await.unwrap();

    for (name, doc_bytes) in [("200 KiB", 200 * 1024), ("3 MiB", 3 * 1024 * 1024)] {
        let mut conv =
            Conversation::new(&format!("a {name} contract ({})", paths::unique_name("l")));
        let document = "The supplier shall deliver the goods in full. ".repeat(doc_bytes / 46 + 1);
        let home = conv
            .turn(&gw, &format!("Here is the contract:\n{document}\nSummarise clause 1."))
            .await
            .unwrap_or_else(|e| panic!("{name} chat, turn 1: {e}"));
        for turn in 2..=4 {
            let host = conv
                .turn(&gw, &question(turn))
                .await
                .unwrap_or_else(|e| panic!("{name} chat, turn {turn}: {e}"));
            assert_eq!(host, home, "{name} chat: turn {turn} left the pod holding its prefix");
        }
    }

    // Above maxBodyBytes (4 MiB) the body is not read: normal balancing, still no 413.
    let filler = "lorem ipsum dolor sit amet ".repeat(5 * 1024 * 1024 / 27 + 1);
    let big = json!({"model": MODEL, "messages": [{"role": "user", "content": filler}]});
    let r = gw
        .send(
            testkit::HttpRequest::post_json("/v1/chat/completions", &big),
            Duration::from_secs(20),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "5 MiB chat: {}", r.text());
    // The same body streamed without a content-length: held until its first chunk past
    // maxBodyBytes, then let through below the buffer limit the plugin set (Envoy answers 413 to
    // a held body over that limit whatever the plugin says then).
    let r = gw
        .send(
            testkit::HttpRequest::post_json("/v1/chat/completions", &big)
                .chunked_unsized(64 * 1024, Duration::ZERO),
            Duration::from_secs(20),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "5 MiB chat, chunked: {}", r.text());
    let too_large = gw.stat("ai_lb_fallback_body_too_large", &[]).await.unwrap();
    assert_eq!(too_large, Some(2.0), "both let through as too large");
}

/// The plugin's linear memory while it routes chats just under `maxBodyBytes` (4 MiB) whose text has
/// escapes, as real chats do: the body the host hands over, and nothing else of its size, since
/// each message is unescaped and hashed piece by piece as its blocks are read (measured 8.8 MiB
/// for a 3.8 MiB chat, 2026-11-29: twice the body, as one turn's body does not fit where the last
/// one was; with serde's unescaped copy of the long message and the block text built from it, as
/// before, 16.4 MiB; a JSON tree of the body would add ~8 MiB more). A VM serving chat after chat
/// stays at that peak. Read from the gateway's `gateway_vm_memory_bytes_max` (a wasm memory never
/// shrinks, so it is the peak).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_4_mib_chat_is_routed_within_a_bounded_linear_memory() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("mem", 2).await.unwrap();
    // One worker: every turn runs in the same VM, as a long-lived VM serves chat after chat.
    let gw = Gateway::start(&prefix_config("route-mem", &pods, &redis).workers(1)).await.unwrap();
    let mib = |b: i64| b as f64 / (1024.0 * 1024.0);
    let memory = || async { stat(&gw.stats().await.unwrap(), "gateway_vm_memory_bytes_max") };
    let before = memory().await;

    let document = "The supplier shall deliver the goods in full. ".repeat(4_000_000 / 46);
    let mut conv = Conversation::new(&format!("a 4 MiB contract ({})", paths::unique_name("m")));
    let home =
        conv.turn(&gw, &format!("Here is the contract:\n{document}\nSummarise.")).await.unwrap();
    let mut after_turn = Vec::new();
    for turn in 2..=4 {
        let host = conv.turn(&gw, &question(turn)).await.unwrap();
        assert_eq!(host, home, "the 4 MiB chat's turn {turn} left the pod holding its prefix");
        after_turn.push(memory().await);
    }

    let stats = gw.stats().await.unwrap();
    assert_eq!(stat(&stats, "ai_lb_prefix_hit"), 3, "{stats}");
    let peak = stat(&stats, "gateway_vm_memory_bytes_max");
    eprintln!(
        "plugin linear memory: {:.1} MiB before, {:.1} MiB after 4 turns of a {:.1} MiB chat",
        mib(before),
        mib(peak),
        mib(document.len() as i64)
    );
    assert!(before > 0, "the gauge reads the VM's memory");
    let body = document.len() as i64;
    assert!(peak > body, "the body is copied into the VM: {peak} bytes");
    // A second copy of the conversation (4 × the body with the allocator's growth) fails here.
    assert!(
        peak < before + 3 * body + (1 << 20),
        "linear memory {:.1} MiB for a {:.1} MiB chat",
        mib(peak),
        mib(body)
    );
    assert!(
        after_turn.windows(2).all(|w| w[0] == w[1]),
        "linear memory keeps growing from chat to chat: {after_turn:?}"
    );
}

/// `loadAware` with the pods' metrics stored by the health check (as Higress's `store_metrics`).
fn load_aware_config(route: &str, pods: &[Pod], redis: &RedisFixture) -> GatewayConfig {
    redis_policy_config(
        route,
        pods,
        redis,
        "prefix_cache",
        json!({"redisKeyTTL": TTL_S, "timeout": 1000, "loadAware": true,
               "decisionHeader": "x-ai-lb-decision"}),
    )
    .metrics_health_check(LLM_CLUSTER, 100)
}

/// The prefix keys whose value names more than one holder, with their holders (the value without
/// its `@<time written>`).
async fn shared_keys(redis: &RedisFixture) -> Vec<(String, String)> {
    let mut c = redis.client().await.unwrap();
    let mut out = Vec::new();
    for k in c.keys("*:pfx:*").await.unwrap() {
        let value = c.get(&k).await.unwrap().unwrap_or_default();
        let holders = value.split('@').next().unwrap_or_default();
        if holders.contains(',') {
            out.push((k, holders.to_string()));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_aware_diverts_a_hit_from_a_pod_with_a_deep_queue_and_shares_the_prefix() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("pc-load", 3).await.unwrap();
    let (a, b, c) = (&pods[0], &pods[1], &pods[2]);
    // Nothing in flight anywhere: by in-flight alone a miss is a coin toss. By the combined load
    // (queue + 8 × KV use) A (0 + 0.8) is the least loaded, then C (1 + 3.2), then B (3 + 4).
    a.set_metrics(samples::vllm_v1(2, 0, 0.1));
    b.set_metrics(samples::vllm_v1(2, 3, 0.5));
    c.set_metrics(samples::vllm_v1(2, 1, 0.4));
    let gw = Gateway::start(&load_aware_config("route-load", &pods, &redis)).await.unwrap();
    wait_scrapes(&pods, &[0, 0, 0], 2, Duration::from_secs(15)).await.unwrap();

    let mut conv = Conversation::new(&format!("load-aware review ({})", paths::unique_name("c")));
    assert_eq!(conv.turn(&gw, &question(1)).await.unwrap(), a.host(), "miss: least combined load");
    assert_eq!(conv.turn(&gw, &question(2)).await.unwrap(), a.host(), "hit on A");

    // A's engine now has a deep queue: the next turn's hit on A is diverted to C, the least
    // loaded pod, which becomes a second holder of the conversation's prefix.
    a.set_metrics(samples::vllm_v1(16, 20, 0.9));
    let before = scrape_counts(&pods);
    wait_scrapes(&pods, &before, 2, Duration::from_secs(15)).await.unwrap();
    assert!(shared_keys(&redis).await.is_empty());
    let resp = gw
        .send(
            HttpRequest::post_json("/v1/chat/completions", &{
                conv.messages.push(json!({"role": "user", "content": question(3)}));
                conv.body()
            }),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.upstream().as_deref(), Some(c.host().as_str()), "diverted to C");
    assert_eq!(resp.header("x-ai-lb-decision"), Some("prefix_hit_diverted; blocks=2"));
    conv.messages.push(json!({"role": "assistant", "content": answer_text(&resp).unwrap()}));
    let shared = shared_keys(&redis).await;
    let both = format!("{},{}", a.host(), c.host());
    // The match (turn 2's whole prompt, the key the pick read) names A and C; the key before it,
    // which the pick did not read, still names A alone.
    assert_eq!(shared.len(), 1, "the matched key names A and C: {shared:?}");
    assert!(shared.iter().all(|(_, v)| *v == both), "{shared:?}");

    // The conversation now lives on C: the next turn is a plain hit there.
    assert_eq!(conv.turn(&gw, &question(4)).await.unwrap(), c.host());
    assert_eq!(b.inference_count(), 0, "B, the most loaded by its metrics, got nothing");

    let stats = gw.stats().await.unwrap();
    assert_eq!(stat(&stats, "ai_lb_prefix_miss"), 1, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_hit"), 2, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_hit_diverted"), 1, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_holder_added"), 1, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_load_unknown"), 0, "{stats}");
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_aware_without_pod_metrics_routes_as_go_does_and_says_so() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("pc-load-none", 2).await.unwrap();
    // loadAware on, but no health check stores metrics and nothing is scraped.
    let cfg = redis_policy_config(
        "route-load-none",
        &pods,
        &redis,
        "prefix_cache",
        json!({"redisKeyTTL": TTL_S, "timeout": 1000, "loadAware": true}),
    );
    let gw = Gateway::start(&cfg).await.unwrap();
    let mut conv = Conversation::new(&format!("no metrics ({})", paths::unique_name("c")));
    let home = conv.turn(&gw, &question(1)).await.unwrap();
    for turn in 2..=3 {
        assert_eq!(conv.turn(&gw, &question(turn)).await.unwrap(), home, "turn {turn}");
    }
    let stats = gw.stats().await.unwrap();
    assert_eq!(stat(&stats, "ai_lb_prefix_load_unknown"), 3, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_hit"), 2, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_miss"), 1, "{stats}");
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

/// Three pods with the same idle metrics (no queue, no KV in use) that stream every 4 ms, but the
/// third every 40 ms (what a half-speed or throttled GPU looks like to clients), behind one
/// gateway worker (the speed each pod streams at is observed per worker VM) running `prefix_cache`
/// with `loadAware` (`loadLatencyWeight` 4) on top of the test's Redis settings; returns once the
/// health check has stored every pod's metrics.
async fn one_pod_streaming_slowly(name: &str, route: &str) -> (RedisFixture, Vec<Pod>, Gateway) {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods(name, 3).await.unwrap();
    for p in &pods {
        p.set_metrics(samples::vllm_v1(1, 0, 0.0));
        p.set_stream_chunk_delay(Duration::from_millis(4));
        // Answers long enough to be timed (the plugin ignores answers of a few events).
        p.set_stream_extra_words(20);
    }
    pods[2].set_stream_chunk_delay(Duration::from_millis(40));
    let config = json!({
        "redisKeyTTL": TTL_S,
        "timeout": 1000,
        "loadAware": true,
        "loadLatencyWeight": 4,
    });
    let cfg = redis_policy_config(route, &pods, &redis, "prefix_cache", config)
        .metrics_health_check(LLM_CLUSTER, 100)
        .workers(1);
    let gw = Gateway::start(&cfg).await.unwrap();
    wait_scrapes(&pods, &[0, 0, 0], 2, Duration::from_secs(15)).await.unwrap();
    (redis, pods, gw)
}

/// New streamed conversations, one turn each, until every pod has served one (before that the
/// gateway has not timed every pod, and new conversations go anywhere): each with its pod.
async fn until_every_pod_streamed(gw: &Gateway, pods: &[Pod]) -> Vec<(Conversation, String)> {
    let mut started = Vec::new();
    while pods.iter().any(|p| p.inference_count() == 0) {
        assert!(started.len() < 40, "40 new conversations never reached every pod");
        let mut conv = Conversation::new(&format!("warm-up {}", paths::unique_name("w")));
        conv.stream = true;
        let pod = conv.turn(gw, &question(1)).await.unwrap();
        started.push((conv, pod));
    }
    started
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_aware_sends_new_conversations_away_from_a_pod_that_streams_slowly() {
    // Queue, KV and in-flight (nothing between the sequential requests below) cannot tell the
    // pods apart; only the slow pod's streaming rate can. `loadAware` on (off by default).
    let (redis, pods, gw) = one_pod_streaming_slowly("pc-slow", "route-slow").await;
    let slow = &pods[2];
    until_every_pod_streamed(&gw, &pods).await;
    // Then the slow pod is passed over for every new conversation.
    let before = slow.inference_count();
    let mut served = Vec::new();
    for _ in 0..12 {
        let mut conv = Conversation::new(&format!("new {}", paths::unique_name("n")));
        conv.stream = true;
        served.push(conv.turn(&gw, &question(1)).await.unwrap());
    }
    assert_eq!(slow.inference_count(), before, "the slow pod got new conversations: {served:?}");
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_aware_moves_a_conversation_off_a_slow_pod_and_keeps_it_on_its_new_one() {
    // A conversation whose history lives on the slow pod has its next turn diverted to a fast pod
    // (`overloadLatency`, 1.6 by default), which becomes a holder of that history, and the turns
    // after stay there (the least loaded holder). With `overloadLatency` 0 the conversation would
    // stay on the slow pod.
    let (redis, pods, gw) = one_pod_streaming_slowly("pc-divert-slow", "route-divert-slow").await;
    let slow = &pods[2];
    let (mut conv, _) = until_every_pod_streamed(&gw, &pods)
        .await
        .into_iter()
        .find(|(_, pod)| *pod == slow.host())
        .expect("the warm-up ends once the slow pod has served a conversation");
    // Every pod has been timed once: the history on the slow pod is diverted at its next turn.
    let before = gw.stats().await.unwrap();
    let moved_to = conv.turn(&gw, &question(2)).await.unwrap();
    assert_ne!(moved_to, slow.host(), "turn 2 stayed on the slow pod");
    let stats = gw.stats().await.unwrap();
    let diverted = |s: &str| stat(s, "ai_lb_prefix_hit_diverted");
    assert_eq!(diverted(&stats) - diverted(&before), 1, "{stats}");
    assert_eq!(
        stat(&stats, "ai_lb_prefix_holder_added") - stat(&before, "ai_lb_prefix_holder_added"),
        1,
        "{stats}"
    );
    for turn in 3..=4 {
        assert_eq!(conv.turn(&gw, &question(turn)).await.unwrap(), moved_to, "turn {turn}");
    }
    let after = gw.stats().await.unwrap();
    assert_eq!(diverted(&after), diverted(&stats), "turns 3 and 4 were hits: {after}");
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

/// What an operator reads: every counter exported at 0 from the start; a request without a
/// prompt counted as the least-request pick it is (not as a miss that would skew the hit rate);
/// and Anthropic `/v1/messages` bodies, whose system prompt is a top-level field, match only
/// conversations that start with the same system prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_start_at_zero_and_requests_without_a_prompt_are_least_request_picks() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("pz", 2).await.unwrap();
    let config = redis_policy_config(
        "route-zero",
        &pods,
        &redis,
        "prefix_cache",
        json!({"redisKeyTTL": TTL_S, "decisionHeader": "x-ai-lb"}),
    );
    let gw = Gateway::start(&config).await.unwrap();
    let stats = gw.stats().await.unwrap();
    for name in [
        "ai_lb_prefix_hit",
        "ai_lb_prefix_miss",
        "ai_lb_least_request_routed",
        "ai_lb_fallback_redis_timeout",
        "ai_lb_fallback_breaker_open",
        "ai_lb_breaker_opened",
        "ai_lb_release_dropped",
        "ai_lb_counts_recounted",
    ] {
        assert!(
            stats.lines().any(|l| l == format!("{name} 0")),
            "{name} is not exported at 0 before any request:\n{stats}"
        );
    }

    let models = gw.send(HttpRequest::get("/v1/models"), Duration::from_secs(5)).await.unwrap();
    assert_eq!(models.status, 200);
    assert_eq!(models.header("x-ai-lb"), Some("least_request_routed"));

    let anthropic = |system: &str| {
        json!({"model": "m", "system": system, "max_tokens": 8,
               "messages": [{"role": "user", "content": "hello, same opening line"}]})
    };
    let first = gw.post_json("/v1/messages", &anthropic("You are a pirate.")).await.unwrap();
    let second = gw.post_json("/v1/messages", &anthropic("You are a lawyer.")).await.unwrap();
    let again = gw.post_json("/v1/messages", &anthropic("You are a pirate.")).await.unwrap();
    assert_eq!(first.header("x-ai-lb"), Some("prefix_miss; blocks=0"));
    assert_eq!(second.header("x-ai-lb"), Some("prefix_miss; blocks=0"), "another system prompt");
    assert_eq!(again.header("x-ai-lb"), Some("prefix_hit; blocks=1"));

    let stats = gw.stats().await.unwrap();
    assert_eq!(stat(&stats, "ai_lb_least_request_routed"), 1, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_miss"), 2, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_hit"), 1, "{stats}");
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

/// `loadAware` (one worker, so that one VM sees every prompt): a new long document goes to the
/// pod that is not still prefilling another one, even when that pod has more requests in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_aware_sends_a_new_document_to_a_pod_not_prefilling_another() {
    new_document_goes_to_a_pod_not_prefilling_another(1).await;
}

/// The same through four workers: each connection goes to whichever worker accepts it first, so
/// the two documents are usually routed by different VMs, and each VM must count the prompts the
/// others sent (shared data).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_aware_counts_the_documents_every_worker_sent_a_pod() {
    new_document_goes_to_a_pod_not_prefilling_another(4).await;
}

async fn new_document_goes_to_a_pod_not_prefilling_another(workers: usize) {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods(&format!("pc-prefill-{workers}"), 2).await.unwrap();
    for p in &pods {
        p.set_metrics(samples::vllm_v1(2, 0, 0.1));
    }
    let route = format!("route-prefill-{workers}");
    let config = load_aware_config(&route, &pods, &redis).workers(workers);
    let gw = Arc::new(Gateway::start(&config).await.unwrap());
    wait_scrapes(&pods, &[0, 0], 2, Duration::from_secs(15)).await.unwrap();
    let in_flight = || pods.iter().map(Pod::in_flight).sum::<usize>();
    let held = Arc::new(tokio::sync::Mutex::new(Vec::new()));
    // Sends `content` as a new conversation; returns once the pods hold `n` requests in all.
    let send = |content: String, n: usize| {
        let gw = gw.clone();
        let held = held.clone();
        async move {
            let body = json!({"model": "m", "max_tokens": 8,
                              "messages": [{"role": "user", "content": content}]});
            held.lock().await.push(tokio::spawn(async move {
                gw.send(
                    HttpRequest::post_json("/v1/chat/completions", &body),
                    Duration::from_secs(30),
                )
                .await
            }));
            eventually(Duration::from_secs(10), "the request reached a pod", || async {
                Ok(in_flight() == n)
            })
            .await
            .unwrap();
        }
    };
    let document = |topic: &str| format!("{topic}: {}", "clause and schedule text ".repeat(2_000));
    // With several workers, a few rounds: in each, which worker routes which request is up to
    // the accepting race.
    let rounds = if workers > 1 { 4 } else { 1 };
    for round in 0..rounds {
        for p in &pods {
            p.set_hold(true);
        }
        // A 50 kB document (a miss) goes to a pod, which holds it: no answer byte yet.
        send(document(&format!("contract A{round}")), 1).await;
        let busy = pods.iter().position(|p| p.in_flight() == 1).unwrap();
        let other = 1 - busy;
        // Two short new chats: both to the other pod (the busy one owes a prefill of ~12
        // requests).
        send(format!("a short question {round}"), 2).await;
        send(format!("another short question {round}"), 3).await;
        assert_eq!(
            pods[other].in_flight(),
            2,
            "round {round}: short chats go to the pod not prefilling"
        );
        // A second document: by in-flight counts the busy pod (1) is the least loaded (the other
        // has 2), but it is still prefilling the first document.
        send(document(&format!("contract B{round}")), 4).await;
        assert_eq!(
            pods[busy].in_flight(),
            1,
            "round {round}: the second document must not join the first one's pod"
        );
        assert_eq!(pods[other].in_flight(), 3);

        for p in &pods {
            p.set_hold(false);
            p.release();
        }
        for h in held.lock().await.drain(..) {
            let resp = h.await.unwrap().unwrap();
            assert_eq!(resp.status, 200, "{}", resp.text());
            assert_eq!(resp.header("x-ai-lb-decision"), Some("prefix_miss; blocks=0"));
        }
    }
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

/// Multi-LoRA serving: two adapters' sessions share a system prompt, but an engine keeps each
/// adapter's KV cache apart. With `scopedKeys` (on with `loadAware`) the second adapter's first
/// request is a miss, not a hit promised on the first adapter's pod, and each adapter's later
/// requests find their own prefix; a Go config keys by the messages alone, as the Go plugin does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_adapters_sharing_a_system_prompt_keep_their_own_prefix_keys() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("pl", 2).await.unwrap();
    let chat = |model: &str, salt: Option<&str>, question: &str| {
        let mut body = json!({"model": model, "max_tokens": 8, "messages": [
            {"role": "system", "content": "You answer questions about the warehouse database."},
            {"role": "user", "content": question}]});
        if let Some(salt) = salt {
            body["cache_salt"] = json!(salt);
        }
        body
    };
    // Both gateways live to the end: a gateway's last releases ride on its next pick or leave
    // within a tick, and one stopped before then leaves its counts to the lease's reaping.
    let mut gateways = Vec::new();
    for (route, scoped) in [("route-lora-go", false), ("route-lora-scoped", true)] {
        let mut lb = json!({"redisKeyTTL": TTL_S, "decisionHeader": "x-ai-lb",
                            "splitSystemPrompt": true});
        if scoped {
            lb["scopedKeys"] = json!(true);
        }
        let config = redis_policy_config(route, &pods, &redis, "prefix_cache", lb);
        let gw = Gateway::start(&config).await.unwrap();
        let decision = |r: &HttpResponse| r.header("x-ai-lb").unwrap_or_default().to_string();
        let sql = gw.post_json("/v1/chat/completions", &chat("sql", None, "rows?")).await.unwrap();
        assert_eq!(sql.status, 200, "{}", sql.text());
        assert_eq!(decision(&sql), "prefix_miss; blocks=0", "{route}");
        let support =
            gw.post_json("/v1/chat/completions", &chat("support", None, "refund?")).await.unwrap();
        let salted = gw
            .post_json("/v1/chat/completions", &chat("sql", Some("t1"), "tables?"))
            .await
            .unwrap();
        let sql_again =
            gw.post_json("/v1/chat/completions", &chat("sql", None, "columns?")).await.unwrap();
        assert_eq!(decision(&sql_again), "prefix_hit; blocks=1", "{route}");
        assert_eq!(sql_again.upstream(), sql.upstream(), "{route}: the adapter's own prefix");
        if scoped {
            assert_eq!(decision(&support), "prefix_miss; blocks=0", "another adapter's cache");
            assert_eq!(decision(&salted), "prefix_miss; blocks=0", "another salt's cache");
            let support_again = gw
                .post_json("/v1/chat/completions", &chat("support", None, "ship?"))
                .await
                .unwrap();
            assert_eq!(decision(&support_again), "prefix_hit; blocks=1");
            assert_eq!(support_again.upstream(), support.upstream());
        } else {
            // The Go plugin's keys: one adapter's request is promised another's cache.
            assert_eq!(decision(&support), "prefix_hit; blocks=1");
            assert_eq!(support.upstream(), sql.upstream());
            assert_eq!(decision(&salted), "prefix_hit; blocks=1");
        }
        gateways.push(gw);
    }
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
    drop(gateways);
}
