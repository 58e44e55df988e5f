//! Property tests over what strangers control: request bodies, Redis replies, config JSON and
//! Prometheus text. Each target sends its input through the code the .wasm runs (the dispatcher
//! over the fake host) and checks what a user would notice: no panic, and every request resumed
//! or answered exactly once, never left paused.
//!
//! Inputs are both raw bytes and structure-aware (JSON and RESP shaped like the real thing, with
//! the field names the parsers look for), so the parsers get past their first byte. The seed corpus
//! in `src/fuzz_corpus/` is replayed with every prefix of every seed (truncated bodies and replies
//! are what a broken client or connection produces).
//!
//! CI runs a short pass (`PROPTEST_CASES` unset: 512 cases per target). The long pass, at least
//! 10 million inputs in all, is `PROPTEST_CASES=2500000 cargo test --release --lib fuzz_` (see the
//! README's Tests section).

use crate::filter::Filter;
use crate::host::fake::FakeHost;
use crate::host::{Health, RedisReply, UpstreamHost};
use crate::testutil::deliver;
use crate::types::{DataAction, HeaderAction};
use proptest::prelude::*;
use serde_json::{json, Map, Value};
use std::path::PathBuf;

const REDIS_CFG: &str = r#""serviceFQDN":"redis.static","servicePort":6379"#;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512)
}

fn config() -> ProptestConfig {
    ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() }
}

fn filter(cfg: &str) -> (Filter, FakeHost) {
    let mut host = FakeHost::new();
    host.set_hosts(&[("10.0.0.1:8000", true), ("10.0.0.2:8000", true), ("10.0.0.3:8000", false)]);
    let mut f = Filter::new();
    assert!(f.configure(&mut host, cfg.as_bytes()), "{:?}", host.logs.borrow());
    (f, host)
}

/// Answers every Redis call still waiting with a pick of `.1` until none is left, then ends the
/// stream; asserts the request was resumed or answered exactly once.
fn finish(f: &mut Filter, host: &mut FakeHost, ctx: u32) {
    let mut answered = 0;
    while let Some(t) = host.last_redis_token() {
        if f.stream_of_token(t).is_none() || answered > 4 {
            break;
        }
        answered += 1;
        let reply = b"*3\r\n$13\r\n10.0.0.1:8000\r\n:1\r\n:1\r\n".to_vec();
        f.on_redis_reply(host, t, &RedisReply::Ok(reply), true);
    }
    let done = host.resumes as usize + host.local_responses.len();
    assert!(done <= 1, "request continued {done} times");
    f.on_delete(host, ctx);
    assert_eq!(f.live_streams(), 0);
}

/// A request with `body` through `prefix_cache` (and its pick answered).
fn body_target(body: &[u8]) {
    use crate::policy::prefix_cache::{blocks_from_body, chain, prompt_from_body, Prompt};
    // What the plugin routes by is the chain of the readable blocks, hashed without building them.
    for rules in crate::testutil::every_key_rules() {
        let stored = prompt_from_body(body, rules).map(|p| p.stored).unwrap_or_default();
        let text = blocks_from_body(body, rules).map(|blocks| Prompt {
            keys: chain(&blocks),
            block_bytes: blocks.iter().map(String::len).collect(),
            stored,
        });
        assert_eq!(prompt_from_body(body, rules), text);
    }
    let (mut f, mut host) =
        filter(&format!(r#"{{"lb_policy":"prefix_cache","lb_config":{{{REDIS_CFG}}}}}"#));
    assert_eq!(f.on_request_headers(&mut host, 7, false), HeaderAction::StopIteration);
    host.request_body = body.to_vec();
    let action = f.on_request_body(&mut host, 7, body.len(), true);
    let waiting = host.last_redis_token().is_some_and(|t| f.stream_of_token(t).is_some());
    if action == DataAction::Continue {
        assert!(!waiting, "continued while its pick is still out");
        finish(&mut f, &mut host, 7);
        assert_eq!(host.resumes, 0, "continued twice");
    } else {
        assert!(waiting, "held without a call whose reply would resume it");
        finish(&mut f, &mut host, 7);
        assert_eq!(host.resumes as usize + host.local_responses.len(), 1, "never resumed");
    }
}

/// A request with `body` through `cluster_hash` keyed by a body field (GJSON paths of several
/// shapes): routed, answered 403, or passed through, once.
fn cluster_hash_body_target(body: &[u8]) {
    for path in ["model", "messages.0.content", "messages.#", "m*.1.role", "prompt|@reverse"] {
        let cfg = format!(
            r#"{{"lb_type":"cluster","lb_policy":"cluster_hash","lb_config":{{"key":{{"source":"body","jsonPath":"{path}"}},"clusters":[{{"cluster":"a","weight":50}},{{"cluster":"b","weight":50}}]}}}}"#
        );
        let (mut f, mut host) = filter(&cfg);
        host.request_headers.push((":method".into(), "POST".into()));
        assert_eq!(f.on_request_headers(&mut host, 7, false), HeaderAction::StopIteration);
        host.request_body = body.to_vec();
        let action = f.on_request_body(&mut host, 7, body.len(), true);
        let answered = host.local_responses.len();
        assert!(
            (action == DataAction::Continue) != (answered == 1),
            "{path}: continued ({action:?}) or answered ({answered}), exactly one"
        );
        f.on_delete(&mut host, 7);
        assert_eq!(f.live_streams(), 0);
    }
}

/// `reply` as the answer to a `global_least_request` pick.
fn reply_target(reply: &[u8]) {
    let _ = crate::redis::decode_reply(reply).map(|f| crate::policy::picker::parse_pick(&f));
    let (mut f, mut host) =
        filter(&format!(r#"{{"lb_policy":"global_least_request","lb_config":{{{REDIS_CFG}}}}}"#));
    assert_eq!(f.on_request_headers(&mut host, 7, true), HeaderAction::StopIteration);
    let Some(t) = host.last_redis_token() else { panic!("no pick sent") };
    deliver(&mut f, &mut host, t, RedisReply::Ok(reply.to_vec()));
    // NOSCRIPT resends the pick once: that one times out.
    if let Some(t2) = host.last_redis_token().filter(|t2| *t2 != t) {
        if f.stream_of_token(t2).is_some() {
            deliver(&mut f, &mut host, t2, RedisReply::NetworkError);
        }
    }
    assert_eq!(host.resumes as usize + host.local_responses.len(), 1, "resumed exactly once");
    f.on_delete(&mut host, 7);
    // Releases and their replies (the same bytes) must not trip anything either.
    let tokens: Vec<u32> = host.redis_calls.iter().map(|c| c.token).collect();
    for t in tokens {
        f.on_redis_reply(&mut host, t, &RedisReply::Ok(reply.to_vec()), false);
    }
    host.now += 60_000_000_000;
    f.on_tick(&mut host);
}

/// `reply` as the answer to an `endpoint_hash` lookup, and to the write that follows it.
fn sticky_reply_target(reply: &[u8]) {
    let (mut f, mut host) = filter(&format!(
        r#"{{"lb_policy":"endpoint_hash","lb_config":{{{REDIS_CFG},"hash_header":"x-session"}}}}"#
    ));
    host.request_headers.push(("x-session".into(), "alice".into()));
    host.properties.insert("upstream.address".into(), b"10.0.0.2:8000".to_vec());
    assert_eq!(f.on_request_headers(&mut host, 7, true), HeaderAction::StopIteration);
    let Some(t) = host.last_redis_token() else { panic!("no lookup sent") };
    deliver(&mut f, &mut host, t, RedisReply::Ok(reply.to_vec()));
    assert_eq!(host.resumes, 1, "resumed exactly once");
    f.on_response_headers(&mut host, 7);
    f.on_delete(&mut host, 7);
    let tokens: Vec<u32> = host.redis_calls.iter().map(|c| c.token).skip(1).collect();
    for t in tokens {
        f.on_redis_reply(&mut host, t, &RedisReply::Ok(reply.to_vec()), false);
    }
    assert_eq!(f.live_streams(), 0);
}

/// `json` as the plugin configuration.
fn config_target(json: &[u8]) {
    let _ = crate::config::PluginConfig::from_json(json);
    let mut host = FakeHost::new();
    host.set_hosts(&[("10.0.0.1:8000", true)]);
    let mut f = Filter::new();
    if f.configure(&mut host, json) {
        // A config that starts must serve requests without panicking.
        f.on_request_headers(&mut host, 7, false);
        host.request_body = br#"{"messages":[{"role":"user","content":"hi"}]}"#.to_vec();
        let n = host.request_body.len();
        f.on_request_body(&mut host, 7, n, true);
        finish(&mut f, &mut host, 7);
        f.on_tick(&mut host);
    }
}

/// `text` as every pod's stored `/metrics`, routed by `endpoint_metrics` (each policy kind).
fn prometheus_target(text: &[u8]) {
    let _ = crate::metrics::prometheus::parse(text, Some("vllm:num_requests_waiting"));
    let body = String::from_utf8_lossy(text).into_owned();
    for lb in [
        r#"{}"#,
        r#"{"metric_policy":"least","target_metric":"vllm:num_requests_waiting"}"#,
        r#"{"metric_policy":"most","target_metric":"x"}"#,
    ] {
        let mut host = FakeHost::new();
        host.hosts = Some(
            ["10.0.0.1:8000", "10.0.0.2:8000"]
                .iter()
                .map(|a| UpstreamHost {
                    address: a.to_string(),
                    health: Health::Healthy,
                    metrics: Some(body.as_str().into()),
                })
                .collect(),
        );
        let mut f = Filter::new();
        let cfg = format!(r#"{{"lb_policy":"endpoint_metrics","lb_config":{lb}}}"#);
        assert!(f.configure(&mut host, cfg.as_bytes()));
        f.on_request_headers(&mut host, 7, false);
        host.request_body = br#"{"model":"adapter-1","messages":[]}"#.to_vec();
        let n = host.request_body.len();
        f.on_request_body(&mut host, 7, n, true);
        finish(&mut f, &mut host, 7);
    }
}

// ---- structure-aware generators ----

fn json_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "[a-z]{0,8}".prop_map(Value::String),
        ".{0,40}".prop_map(Value::String),
        prop::sample::select(vec![
            "user",
            "system",
            "assistant",
            "developer",
            "tool",
            "text",
            "image_url",
            "redis.static",
            "global_least_request",
            "prefix_cache",
            "endpoint_metrics",
            "cluster_metrics",
            "default",
            "least",
            "most",
            "LeastBusy",
            "true",
            "-1",
            "3s",
        ])
        .prop_map(|s| Value::String(s.to_string())),
    ]
}

/// Keys the plugin's parsers look for, so generated objects reach past the first lookup.
const KEYS: &[&str] = &[
    "clusters",
    "key",
    "source",
    "jsonPath",
    "hash_header",
    "messages",
    "role",
    "content",
    "prompt",
    "model",
    "tools",
    "type",
    "text",
    "input",
    "lb_type",
    "lb_policy",
    "lb_config",
    "_rules_",
    "_match_route_",
    "_match_domain_",
    "_match_service_",
    "_match_route_prefix_",
    "serviceFQDN",
    "servicePort",
    "timeout",
    "database",
    "maxRequestCount",
    "cleanInterval",
    "enableDetailLog",
    "redisKeyTTL",
    "hitLoadFactor",
    "splitSystemPrompt",
    "scopedKeys",
    "maxBodyBytes",
    "decisionHeader",
    "leaseMs",
    "breakerFailures",
    "breakerOpenMs",
    "breakerSlowMs",
    "metric_policy",
    "target_metric",
    "rate_limit",
    "window_size",
    "window_seconds",
    "scrapeCluster",
    "scrapeIntervalMs",
    "scrapePath",
    "metricsStaleMs",
    "hostListCacheMs",
    "mode",
    "service_list",
    "cluster_header",
    "queue_size",
];

fn json_value() -> impl Strategy<Value = Value> {
    json_leaf().prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS), inner), 0..8).prop_map(|kv| {
                Value::Object(
                    kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect::<Map<_, _>>(),
                )
            }),
        ]
    })
}

/// A chat or completions body with arbitrary message parts.
fn chat_body() -> impl Strategy<Value = Vec<u8>> {
    let message = (json_leaf(), json_value())
        .prop_map(|(role, content)| json!({"role": role, "content": content}));
    prop_oneof![
        prop::collection::vec(message, 0..8).prop_map(|m| json!({"model": "m", "messages": m})),
        json_value().prop_map(|p| json!({"model": "m", "prompt": p})),
        json_value(),
    ]
    .prop_map(|v| v.to_string().into_bytes())
}

/// A config with the real top-level shape and arbitrary values.
fn config_json() -> impl Strategy<Value = Vec<u8>> {
    let lb_config = prop::collection::vec((prop::sample::select(KEYS), json_leaf()), 0..12)
        .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()));
    let policy = prop::sample::select(vec![
        "global_least_request",
        "prefix_cache",
        "endpoint_metrics",
        "metrics_based",
        "cluster_metrics",
        "cluster_hash",
        "nope",
    ]);
    (policy, prop::option::of(json_leaf()), lb_config, prop::option::of(json_value())).prop_map(
        |(p, lb_type, mut lb, rules)| {
            if let Value::Object(o) = &mut lb {
                o.entry("serviceFQDN").or_insert(json!("redis.static"));
                o.entry("servicePort").or_insert(json!(6379));
            }
            let mut v = json!({"lb_policy": p, "lb_config": lb});
            if let Some(t) = lb_type {
                v["lb_type"] = t;
            }
            if let Some(r) = rules {
                v["_rules_"] = r;
            }
            v.to_string().into_bytes()
        },
    )
}

fn resp_frame(depth: u32) -> BoxedStrategy<Vec<u8>> {
    let leaf = prop_oneof![
        any::<i64>().prop_map(|i| format!(":{i}\r\n").into_bytes()),
        "[ -~]{0,20}".prop_map(|s| format!("${}\r\n{s}\r\n", s.len()).into_bytes()),
        "[ -~]{0,20}".prop_map(|s| format!("+{s}\r\n").into_bytes()),
        prop::sample::select(vec![
            "NOSCRIPT No matching script",
            "ERR boom",
            "OOM",
            "LOADING",
            "NOAUTH"
        ])
        .prop_map(|s| format!("-{s}\r\n").into_bytes()),
        Just(b"$-1\r\n".to_vec()),
        Just(b"*-1\r\n".to_vec()),
        Just(b"$13\r\n10.0.0.1:8000\r\n".to_vec()),
        (0i64..3).prop_map(|i| format!(":{i}\r\n").into_bytes()),
    ];
    if depth == 0 {
        return leaf.boxed();
    }
    prop_oneof![
        leaf,
        prop::collection::vec(resp_frame(depth - 1), 0..6).prop_map(|items| {
            let mut out = format!("*{}\r\n", items.len()).into_bytes();
            for i in items {
                out.extend(i);
            }
            out
        }),
    ]
    .boxed()
}

fn prometheus_text() -> impl Strategy<Value = Vec<u8>> {
    let name = prop::sample::select(vec![
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:lora_requests_info",
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:token_usage",
        "sglang_num_queue_reqs",
        "x",
    ]);
    let value = prop_oneof![
        any::<f64>().prop_map(|f| f.to_string()),
        Just("NaN".to_string()),
        Just("+Inf".to_string()),
        Just("-Inf".to_string()),
        "[ -~]{0,6}",
    ];
    let labels = prop_oneof![
        Just(String::new()),
        "[a-z_]{1,8}=\"[ -~]{0,12}\"".prop_map(|l| format!("{{{l}}}")),
        Just(
            r#"{max_lora="2",running_lora_adapters="adapter-1,b",waiting_lora_adapters=""}"#.into()
        ),
        "[ -~]{0,16}".prop_map(|l| format!("{{{l}")),
    ];
    prop::collection::vec((name, labels, value, prop::bool::ANY), 0..12).prop_map(|lines| {
        let mut out = String::new();
        for (n, l, v, comment) in lines {
            if comment {
                out.push_str(&format!("# TYPE {n} gauge\n"));
            }
            out.push_str(&format!("{n}{l} {v}\n"));
        }
        out.into_bytes()
    })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn fuzz_request_body_bytes(body in prop::collection::vec(any::<u8>(), 0..512)) {
        body_target(&body);
        cluster_hash_body_target(&body);
    }

    #[test]
    fn fuzz_request_body_json(body in chat_body()) {
        body_target(&body);
        cluster_hash_body_target(&body);
    }

    #[test]
    fn fuzz_redis_reply_bytes(reply in prop::collection::vec(any::<u8>(), 0..128)) {
        reply_target(&reply);
        sticky_reply_target(&reply);
    }

    #[test]
    fn fuzz_redis_reply_resp(reply in resp_frame(3)) {
        reply_target(&reply);
        sticky_reply_target(&reply);
    }

    #[test]
    fn fuzz_config_bytes(json in prop::collection::vec(any::<u8>(), 0..256)) {
        config_target(&json);
    }

    #[test]
    fn fuzz_config_json(json in config_json()) {
        config_target(&json);
    }

    #[test]
    fn fuzz_prometheus_text(text in prometheus_text()) {
        prometheus_target(&text);
    }

    #[test]
    fn fuzz_host_list_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let mut memo = crate::pairs::HostListMemo::default();
        prop_assert_eq!(memo.parse(&bytes), crate::pairs::parse_upstream_hosts(&bytes));
    }

    /// Host lists read one after another through one memo (pods failing, coming back, new
    /// samples, bodies that are not JSON strings) read as each list alone does.
    #[test]
    fn fuzz_host_lists_through_a_memo(lists in prop::collection::vec(host_list(), 1..6)) {
        let mut memo = crate::pairs::HostListMemo::default();
        for list in &lists {
            prop_assert_eq!(memo.parse(list), crate::pairs::parse_upstream_hosts(list));
        }
    }
}

/// A `proxy_get_upstream_hosts` list over a few addresses, with varied health and info.
fn host_list() -> impl Strategy<Value = Vec<u8>> {
    let info = prop_oneof![
        (
            prop::sample::select(vec!["Healthy", "Unhealthy", "Degraded", ""]),
            prop::sample::select(vec!["", r"q 1\n", r"q 2\n", r#"\u00e9 \"x\"\n"#]),
        )
            .prop_map(|(h, m)| format!(r#"{{"health_status":"{h}","metrics":"{m}"}}"#)),
        Just(r#"{"health_status":"Healthy","metrics":null}"#.to_string()),
        Just(r#"{"health_status":7,"metrics":"q 1\n"}"#.to_string()),
        Just("not json".to_string()),
    ];
    let address = prop::sample::select(vec!["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]);
    prop::collection::vec((address, info), 0..4)
        .prop_map(|hosts: Vec<(&str, String)>| crate::pairs::serialize(&hosts))
}

fn corpus(dir: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut out: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap_or_default();
            (p, bytes)
        })
        .collect();
    out.sort();
    assert!(!out.is_empty(), "empty corpus {}", root.display());
    out
}

/// Every seed, and every prefix of it (a truncated body, reply or config).
fn replay(dir: &str, target: fn(&[u8])) {
    for (path, bytes) in corpus(dir) {
        let step = (bytes.len() / 400).max(1);
        for end in (0..=bytes.len()).step_by(step).chain([bytes.len()]) {
            let input = bytes.get(..end).unwrap_or(&bytes);
            let r = std::panic::catch_unwind(|| target(input));
            assert!(r.is_ok(), "{} cut at {end} bytes", path.display());
        }
    }
}

#[test]
fn fuzz_corpus_replay_bodies() {
    replay("src/fuzz_corpus/body", body_target);
    replay("src/fuzz_corpus/body", cluster_hash_body_target);
}

#[test]
fn fuzz_corpus_replay_redis_replies() {
    replay("src/fuzz_corpus/redis", reply_target);
    replay("src/fuzz_corpus/redis", sticky_reply_target);
}

#[test]
fn fuzz_corpus_replay_configs() {
    replay("src/fuzz_corpus/config", config_target);
}

#[test]
fn fuzz_corpus_replay_prometheus() {
    replay("src/metrics/testdata", prometheus_target);
}
