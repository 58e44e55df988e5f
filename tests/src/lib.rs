//! Scenario helpers for the end-to-end tests in `tests/tests/*.rs`: the compiled plugin in real
//! gateway processes, a real Redis, real HTTP upstream pods (fixtures from `testkit`).
//!
//! Every request has a timeout, so a hang is a failure with a message, never a stuck test.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _, Result};
use serde_json::{json, Value};
pub use testkit::gateway::{redis_lb_config, LLM_CLUSTER, REDIS_CLUSTER};
use testkit::http::{self, HttpRequest, HttpResponse};
pub use testkit::{paths, samples, Gateway, GatewayConfig, Pod, RedisFixture};

/// Model name used in request bodies.
pub const MODEL: &str = samples::MODEL;

/// Per-request timeout for ordinary requests through the gateway.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Starts `n` pods named `<prefix>-0..n`.
pub async fn start_pods(prefix: &str, n: usize) -> Result<Vec<Pod>> {
    let mut pods = Vec::with_capacity(n);
    for i in 0..n {
        pods.push(Pod::start(&format!("{prefix}-{i}")).await?);
    }
    Ok(pods)
}

/// The pods' `ip:port` strings.
pub fn hosts(pods: &[Pod]) -> Vec<String> {
    pods.iter().map(Pod::host).collect()
}

/// The pod serving at `host`.
pub fn pod_at<'a>(pods: &'a [Pod], host: &str) -> Result<&'a Pod> {
    pods.iter()
        .find(|p| p.host() == host)
        .ok_or_else(|| anyhow!("{host} is not one of the test's pods {:?}", hosts(pods)))
}

/// A gateway config with one route (`route`, prefix `/`) to [`LLM_CLUSTER`] holding `pods`, the Redis
/// cluster, and the plugin with `lb_policy` and `lb_config` = Redis settings merged with `extra`.
pub fn redis_policy_config(
    route: &str,
    pods: &[Pod],
    redis: &RedisFixture,
    lb_policy: &str,
    extra: Value,
) -> GatewayConfig {
    let mut lb_config = redis_lb_config();
    if let (Some(base), Value::Object(add)) = (lb_config.as_object_mut(), extra) {
        base.extend(add);
    }
    GatewayConfig::new()
        .route(route, "/", LLM_CLUSTER)
        .cluster(LLM_CLUSTER, &hosts(pods))
        .redis(&redis.endpoint())
        .plugin(json!({"lb_policy": lb_policy, "lb_config": lb_config}))
}

/// A multi-turn chat conversation as a client keeps it.
#[derive(Clone, Debug)]
pub struct Conversation {
    /// Messages so far.
    pub messages: Vec<Value>,
    /// Whether to ask for a streamed answer.
    pub stream: bool,
}

impl Conversation {
    /// A conversation with a system prompt and no turns yet; `topic` makes it distinct.
    pub fn new(topic: &str) -> Conversation {
        Conversation {
            messages: vec![json!({
                "role": "system",
                "content": format!(
                    "You are a careful assistant helping with {topic}. Answer briefly and cite the \
                     relevant section of the user's documents when you can."
                )
            })],
            stream: false,
        }
    }

    /// The request body for the current state.
    pub fn body(&self) -> Value {
        let mut body = json!({"model": MODEL, "messages": self.messages, "stream": self.stream, "max_tokens": 64});
        if self.stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    }

    /// Sends one turn (`user_text`) through `gw`, appends the assistant's answer and returns the
    /// upstream host that served it. Fails on a non-200 answer or a timeout.
    pub async fn turn(&mut self, gw: &Gateway, user_text: &str) -> Result<String> {
        self.messages.push(json!({"role": "user", "content": user_text}));
        let resp = gw
            .send(HttpRequest::post_json("/v1/chat/completions", &self.body()), REQUEST_TIMEOUT)
            .await?;
        if resp.status != 200 {
            bail!("turn {:?}: status {} body {}", user_text, resp.status, resp.text());
        }
        let upstream =
            resp.upstream().ok_or_else(|| anyhow!("no x-gateway-upstream-host in {resp:?}"))?;
        let answer = answer_text(&resp)?;
        self.messages.push(json!({"role": "assistant", "content": answer}));
        Ok(upstream)
    }
}

/// The assistant text of a chat completion (JSON or SSE).
pub fn answer_text(resp: &HttpResponse) -> Result<String> {
    let is_sse = resp.header("content-type").is_some_and(|c| c.starts_with("text/event-stream"));
    if !is_sse {
        let v = resp.json()?;
        return v["choices"][0]["message"]["content"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| anyhow!("no message content in {v}"));
    }
    let mut text = String::new();
    for line in resp.text().lines() {
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(data).with_context(|| format!("SSE data {data:?}"))?;
        if let Some(s) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(s);
        }
    }
    Ok(text)
}

/// Sends a one-message chat request; returns the response (any status).
pub async fn chat_once(gw: &Gateway, text: &str) -> Result<HttpResponse> {
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": text}]});
    gw.send(HttpRequest::post_json("/v1/chat/completions", &body), REQUEST_TIMEOUT).await
}

/// The value of counter `name` in a gateway's `/stats` text (0 when absent).
pub fn stat(stats: &str, name: &str) -> i64 {
    stats
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// How many of `upstreams` went to each host.
pub fn tally(upstreams: &[String]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for u in upstreams {
        *m.entry(u.clone()).or_insert(0) += 1;
    }
    m
}

/// `upstreams` with each host replaced by its pod's name (for readable assertion messages).
pub fn named(pods: &[Pod], upstreams: &[String]) -> Vec<String> {
    upstreams
        .iter()
        .map(|u| {
            pods.iter()
                .find(|p| p.host() == *u)
                .map(|p| p.name().to_string())
                .unwrap_or_else(|| u.clone())
        })
        .collect()
}

/// Polls `check` every 50 ms until it returns `Ok(true)` or `within` passes.
pub async fn eventually<F, Fut>(within: Duration, what: &str, mut check: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool>>,
{
    let deadline = tokio::time::Instant::now() + within;
    let mut last_err = None;
    loop {
        match check().await {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => last_err = Some(e),
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(match last_err {
                Some(e) => e.context(format!("{what}: not within {within:?}")),
                None => anyhow!("{what}: not within {within:?}"),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until every pod has received at least `n` more `/metrics` requests than `before[i]`
/// (someone — the host's health check or the plugin — has seen the current metrics).
pub async fn wait_scrapes(
    pods: &[Pod],
    before: &[usize],
    n: usize,
    within: Duration,
) -> Result<()> {
    eventually(within, "every pod scraped again", || async {
        Ok(pods.iter().zip(before).all(|(p, b)| p.metrics_scrapes() >= b + n))
    })
    .await
}

/// Current scrape counts of `pods`.
pub fn scrape_counts(pods: &[Pod]) -> Vec<usize> {
    pods.iter().map(Pod::metrics_scrapes).collect()
}

/// The in-flight counters the plugin keeps in Redis, as (key, field, value), whatever the layout.
/// The per-owner hashes (`...:own:<owner>`) hold each plugin VM's share of those counts, not counts
/// of their own: they are left out so that sums are not doubled.
pub async fn redis_counters(redis: &RedisFixture) -> Result<Vec<(String, String, i64)>> {
    let all = redis.client().await?.all_hash_counters().await?;
    Ok(all.into_iter().filter(|(key, _, _)| !key.contains(":own:")).collect())
}

/// Waits until every in-flight counter in Redis is exactly 0 (the decrement is off the request
/// path, so it may land a little after the response); fails showing the counters otherwise.
pub async fn wait_counters_zero(redis: &RedisFixture, within: Duration) -> Result<()> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let c = redis_counters(redis).await?;
        if c.iter().all(|(_, _, v)| *v == 0) {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("in-flight counters not back to 0 within {within:?}: {c:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sum of all in-flight counters in Redis.
pub async fn counters_sum(redis: &RedisFixture) -> Result<i64> {
    Ok(redis_counters(redis).await?.iter().map(|(_, _, v)| v).sum())
}

/// Sends a request in the background (returns its join handle).
pub fn spawn_request(
    addr: std::net::SocketAddr,
    req: HttpRequest,
    timeout: Duration,
) -> tokio::task::JoinHandle<Result<HttpResponse>> {
    tokio::spawn(async move { http::send(addr, req, timeout).await })
}
