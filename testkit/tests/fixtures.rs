//! Tests of the fixtures themselves (no gateway needed): both Redis backends, the recording pod
//! and the HTTP client's timeouts and aborts.

use std::time::{Duration, Instant};

use serde_json::json;
use testkit::http::{self, AbortAt, HttpRequest};
use testkit::redis::RedisValue;
use testkit::{samples, Pod, RedisFixture};

async fn exercise_redis(mut redis: RedisFixture, backend: &str) {
    assert_eq!(redis.backend(), backend);
    let mut c = redis.client().await.expect("client");
    assert_eq!(
        c.cmd(&["SET", "k1", "v1", "EX", "100"]).await.unwrap(),
        RedisValue::Status("OK".into())
    );
    assert_eq!(c.get("k1").await.unwrap().as_deref(), Some("v1"));
    let ttl = c.ttl("k1").await.unwrap();
    assert!((1..=100).contains(&ttl), "ttl {ttl}");
    c.cmd(&["HINCRBY", "h", "127.0.0.1:1", "2"]).await.unwrap();
    c.cmd(&["HINCRBY", "h", "127.0.0.1:2", "-1"]).await.unwrap();
    let mut counters = c.all_hash_counters().await.unwrap();
    counters.sort();
    assert_eq!(
        counters,
        vec![("h".into(), "127.0.0.1:1".into(), 2), ("h".into(), "127.0.0.1:2".into(), -1)]
    );
    assert_eq!(c.keys("*").await.unwrap(), vec!["h".to_string(), "k1".to_string()]);
    match c.cmd(&["NOSUCHCOMMAND"]).await.unwrap() {
        RedisValue::Error(e) => assert!(e.contains("unknown command"), "{e}"),
        other => panic!("expected an error reply, got {other:?}"),
    }

    // Frozen: the connection stays open but no reply comes; thawed: it answers again.
    redis.freeze().await.expect("freeze");
    let mut frozen = redis.client().await.expect("connect to a frozen Redis");
    let ping = tokio::time::timeout(Duration::from_millis(500), frozen.cmd(&["PING"])).await;
    assert!(ping.is_err(), "a frozen Redis answered: {ping:?}");
    redis.unfreeze().await.expect("unfreeze");
    let mut c = redis.client().await.unwrap();
    assert_eq!(c.cmd(&["PING"]).await.unwrap(), RedisValue::Status("PONG".into()));

    // Stopped: connections fail fast (refused), nothing hangs.
    let addr = redis.addr();
    redis.stop().await.expect("stop");
    assert!(!redis.is_running());
    let t = Instant::now();
    let after_stop = async {
        let mut c = testkit::RedisClient::connect(addr).await?;
        c.cmd(&["PING"]).await
    }
    .await;
    assert!(after_stop.is_err(), "Redis still answers after stop: {after_stop:?}");
    assert!(t.elapsed() < Duration::from_secs(6));

    // Restarted on the same address, empty (no persistence).
    redis.restart().await.expect("restart");
    assert_eq!(redis.addr(), addr);
    let mut c = redis.client().await.unwrap();
    assert_eq!(c.cmd(&["PING"]).await.unwrap(), RedisValue::Status("PONG".into()));
    assert_eq!(c.keys("*").await.unwrap(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_redis_server_fixture() {
    let redis = RedisFixture::start_local().await.expect("local redis-server");
    exercise_redis(redis, "local").await;
}

/// The testcontainers path. Needs a Docker engine and the image from `testkit/redis-image.sh`;
/// it fails (never skips) without them, since CI must exercise this path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_redis_fixture() {
    let redis = RedisFixture::start_docker().await.expect(
        "Docker Redis (needs a Docker engine and `testkit/redis-image.sh` to have built the image)",
    );
    exercise_redis(redis, "docker").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_answers_chat_stream_metrics_and_records() {
    let pod = Pod::start("pod-a").await.unwrap();
    pod.set_metrics(samples::vllm_v1(3, 1, 0.25));
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let r = http::post_json(pod.addr(), "/v1/chat/completions", &body).await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-pod"), Some("pod-a"));
    assert_eq!(r.json().unwrap()["choices"][0]["message"]["content"], "Hello from pod-a");

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    pod.set_stream_chunk_delay(Duration::from_millis(5));
    let r = http::post_json(pod.addr(), "/v1/chat/completions", &sbody).await.unwrap();
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let text = r.text();
    assert!(text.starts_with("data: {"), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");

    let m = http::get(pod.addr(), "/metrics").await.unwrap();
    assert!(m.text().contains("vllm:kv_cache_usage_perc{engine=\"0\",model_name="));
    assert_eq!(pod.metrics_scrapes(), 1);

    let bad = http::send(
        pod.addr(),
        HttpRequest::post("/v1/chat/completions", "{not json"),
        http::DEFAULT_TIMEOUT,
    )
    .await
    .unwrap();
    assert_eq!(bad.status, 400);

    let recs = pod.inference_records();
    assert_eq!(recs.len(), 3);
    assert_eq!(recs[0].body, bytes::Bytes::from(body.to_string()));
    assert_eq!(pod.in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_holds_fails_and_stops() {
    let pod = Pod::start("pod-b").await.unwrap();
    pod.set_hold(true);
    let addr = pod.addr();
    let body = json!({"model": "m", "messages": []});
    let held =
        tokio::spawn(async move { http::post_json(addr, "/v1/chat/completions", &body).await });
    let deadline = Instant::now() + Duration::from_secs(5);
    while pod.in_flight() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(pod.in_flight(), 1);
    // A short client timeout reports a hang instead of waiting forever.
    let t = Instant::now();
    let err = http::send(
        pod.addr(),
        HttpRequest::post("/v1/completions", "{}"),
        Duration::from_millis(300),
    )
    .await;
    assert!(err.unwrap_err().to_string().contains("hangs"));
    assert!(t.elapsed() < Duration::from_secs(2));
    pod.set_hold(false);
    pod.release();
    let r = held.await.unwrap().unwrap();
    assert_eq!(r.status, 200);

    pod.set_fail(Some(503));
    let r =
        http::post_json(pod.addr(), "/v1/chat/completions", &json!({"model": "m"})).await.unwrap();
    assert_eq!(r.status, 503);
    pod.set_fail(None);

    // A client abort while the pod holds the request ends the pod's handling of it.
    pod.set_hold(true);
    let seen = http::send_and_abort(
        pod.addr(),
        HttpRequest::post_json("/v1/chat/completions", &json!({"model": "m"})),
        AbortAt::After(Duration::from_millis(200)),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert_eq!(seen.status, None);
    pod.set_hold(false);
    pod.release();

    pod.stop();
    let r = http::send(pod.addr(), HttpRequest::get("/health"), Duration::from_secs(2)).await;
    assert!(r.is_err(), "stopped pod still answers: {r:?}");
}

#[test]
fn samples_hold_the_names_routers_read() {
    let v0 = samples::vllm_v0(2, 7, 0.5, Some((4, "sql-lora,tweet-lora")));
    assert!(v0.contains(
        "vllm:num_requests_waiting{model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 7.0"
    ));
    assert!(v0.contains("vllm:gpu_cache_usage_perc{"));
    assert!(v0.contains("running_lora_adapters=\"sql-lora,tweet-lora\""));
    let v1 = samples::vllm_v1(2, 7, 0.5);
    assert!(v1.contains("vllm:kv_cache_usage_perc{") && !v1.contains("gpu_cache_usage_perc"));
    assert!(samples::sglang(1, 2, 0.3)
        .contains("sglang:num_queue_reqs{model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 2.0"));
    assert!(samples::sglang_underscore(1, 2, 0.3).contains("sglang_token_usage{"));
}

async fn password_checks(redis: RedisFixture) {
    let mut anon = testkit::RedisClient::connect(redis.addr()).await.unwrap();
    match anon.cmd(&["PING"]).await.unwrap() {
        RedisValue::Error(e) => assert!(e.contains("NOAUTH"), "{e}"),
        other => panic!("unauthenticated PING answered {other:?}"),
    }
    let mut c = redis.client().await.unwrap();
    assert_eq!(c.cmd(&["PING"]).await.unwrap(), RedisValue::Status("PONG".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_protected_redis_local() {
    password_checks(RedisFixture::start_local_with(Some("s3cret")).await.unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_protected_redis_docker() {
    password_checks(RedisFixture::start_docker_with(Some("s3cret")).await.unwrap()).await;
}
