//! Small recording upstream "inference pods".
//!
//! A [`Pod`] answers like an OpenAI-compatible model server: `POST /v1/chat/completions`,
//! `/v1/completions` and `/v1/responses` (JSON or SSE with `"stream": true`), `GET /metrics` (a Prometheus text the test
//! sets), `GET /health`, and anything else with a small JSON echo. It records every request it
//! received, counts requests in flight, and can add latency, hold requests open until released,
//! answer 5xx, or stop altogether. Like vLLM with `VLLM_ENABLE_RESPONSES_API_STORE`, it keeps the
//! Responses API answers it gave in its own memory: a request naming a `previous_response_id`
//! this pod did not make gets 404.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::AbortHandle;

use crate::http::chunked_body;

/// The longest a held request waits for [`Pod::release`] (so a forgotten release cannot hang a test).
pub const MAX_HOLD: Duration = Duration::from_secs(30);

/// One request as the pod received it.
#[derive(Clone, Debug)]
pub struct Recorded {
    /// Method.
    pub method: String,
    /// Path and query.
    pub path: String,
    /// Headers (names lower-case).
    pub headers: Vec<(String, String)>,
    /// The complete body.
    pub body: Bytes,
    /// When the pod had read the whole request.
    pub at: Instant,
}

impl Recorded {
    /// First value of a header.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// Whether this was an inference request (not `/metrics` or `/health`).
    pub fn is_inference(&self) -> bool {
        !matches!(self.path_only(), "/metrics" | "/health")
    }

    /// The path without the query.
    pub fn path_only(&self) -> &str {
        self.path.split('?').next().unwrap_or("")
    }
}

/// How the pod answers inference requests.
#[derive(Clone, Debug, Default)]
struct Behavior {
    /// Added before answering.
    delay: Duration,
    /// Hold every inference request until [`Pod::release`] (or [`MAX_HOLD`]).
    hold: bool,
    /// Answer with this status (and an error JSON) instead of a completion.
    fail_status: Option<u16>,
    /// Pause between SSE chunks of a streamed answer.
    stream_chunk_delay: Duration,
    /// Words a streamed answer carries after "Hello from <name>", one event each.
    stream_extra_words: usize,
}

struct State {
    name: String,
    behavior: Mutex<Behavior>,
    metrics: Mutex<String>,
    records: Mutex<Vec<Recorded>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    release: watch::Sender<u64>,
    /// The message-list prefixes of the chats served, as a prefix cache remembers them: one hash
    /// per prefix (see `cached_tokens`).
    cached_chats: Mutex<HashSet<u64>>,
    /// The Responses API answers stored (`store` not false), by id: the conversation up to and
    /// with the answer, item by item.
    responses: Mutex<HashMap<String, Vec<serde_json::Value>>>,
    /// Responses API answers given (their ids are numbered, stored or not).
    responses_given: AtomicUsize,
}

/// Prompt tokens this pod finds cached for `messages`: the longest run of leading messages equal to
/// those of a chat it served before (a prefix cache at message granularity), at 4 bytes a token.
/// The chat is then remembered. Every prefix of every chat served is kept as a hash, so the
/// lookup costs the same however many chats came before (a scan of all of them made the pod
/// slower as a benchmark went on, which showed up as latency of whatever row ran later).
fn cached_tokens(state: &State, messages: &[serde_json::Value]) -> usize {
    use std::hash::{Hash, Hasher};
    let Ok(mut seen) = state.cached_chats.lock() else { return 0 };
    // The hash of messages[..=k], chained message by message; the set holds every prefix of
    // every chat, so the first unseen prefix ends the shared run.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut shared = 0;
    let mut prefixes = Vec::with_capacity(messages.len());
    for (k, m) in messages.iter().enumerate() {
        m.to_string().hash(&mut h);
        let key = h.finish();
        if shared == k && seen.contains(&key) {
            shared = k + 1;
        }
        prefixes.push(key);
    }
    seen.extend(prefixes);
    messages.iter().take(shared).map(|m| m.to_string().len() / 4).sum()
}

/// A Responses API request's conversation, item by item (`instructions` first), for
/// [`cached_tokens`].
fn responses_conversation(parsed: &serde_json::Value) -> Vec<serde_json::Value> {
    let instructions = parsed.get("instructions").filter(|i| !i.is_null()).cloned();
    let input = match parsed.get("input") {
        Some(serde_json::Value::Array(items)) => items.clone(),
        Some(text) => vec![text.clone()],
        None => Vec::new(),
    };
    instructions.into_iter().chain(input).collect()
}

/// A Responses API request's answer: the conversation is the stored one it continues
/// (`previous_response_id`; 404 when this pod has no such response, as vLLM answers), then its
/// own items. The answer is stored under a new id unless `store` is false.
fn responses_reply(
    state: &State,
    parsed: &serde_json::Value,
    model: &str,
    stream: bool,
    body_len: usize,
    behavior: &Behavior,
) -> hyper::Response<PodBody> {
    let name = &state.name;
    let previous = parsed.get("previous_response_id").and_then(|v| v.as_str());
    let mut conversation = Vec::new();
    if let Some(id) = previous.filter(|id| !id.is_empty()) {
        let stored = state.responses.lock().ok().and_then(|r| r.get(id).cloned());
        let Some(stored) = stored else {
            let err = serde_json::json!({"error": {"message": format!("Response with id '{id}' not found."),
                "type": "invalid_request_error", "param": "previous_response_id", "code": 404}});
            return full(404, name, "application/json", err.to_string());
        };
        conversation = stored;
    }
    conversation.extend(responses_conversation(parsed));
    let cached = cached_tokens(state, &conversation);
    let id = format!("resp_{name}_{}", state.responses_given.fetch_add(1, Ordering::Relaxed) + 1);
    if parsed.get("store").and_then(|s| s.as_bool()) != Some(false) {
        let answer = serde_json::json!({"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": format!("Hello from {name}")}]});
        conversation.push(answer);
        if let Ok(mut responses) = state.responses.lock() {
            responses.insert(id.clone(), conversation);
        }
    }
    responses_answer(name, &id, model, stream, body_len, cached, behavior)
}

/// The answer "Hello from <name>" as the Responses API gives it: a `response` object, or a
/// stream of typed events (`response.created`, one `response.output_text.delta` per word,
/// `response.completed` with the usage; no `[DONE]`).
fn responses_answer(
    name: &str,
    id: &str,
    model: &str,
    stream: bool,
    body_len: usize,
    cached: usize,
    behavior: &Behavior,
) -> hyper::Response<PodBody> {
    let text = format!("Hello from {name}");
    let response = |status: &str, text: &str| {
        serde_json::json!({
            "id": id, "object": "response", "created_at": 0, "model": model,
            "status": status,
            "output": [{"type": "message", "id": format!("msg_{name}"), "role": "assistant",
                "status": status, "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "usage": {"input_tokens": body_len / 4, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": body_len / 4 + 3},
        })
    };
    if !stream {
        return full(200, name, "application/json", response("completed", &text).to_string());
    }
    let words = answer_words(name, behavior);
    let mut events =
        vec![("response.created", serde_json::json!({"response": response("in_progress", "")}))];
    for word in &words {
        events.push((
            "response.output_text.delta",
            serde_json::json!({"item_id": format!("msg_{name}"), "output_index": 0, "content_index": 0, "delta": word}),
        ));
    }
    events.push((
        "response.completed",
        serde_json::json!({"response": response("completed", &words.concat())}),
    ));
    let chunks = events
        .into_iter()
        .enumerate()
        .map(|(seq, (kind, mut data))| {
            data["type"] = serde_json::json!(kind);
            data["sequence_number"] = serde_json::json!(seq);
            Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
        })
        .collect();
    sse(name, chunks, behavior.stream_chunk_delay)
}

/// The words of a streamed answer: "Hello from <name>", then `stream_extra_words` more.
fn answer_words(name: &str, behavior: &Behavior) -> Vec<String> {
    let mut words = vec!["Hello".to_string(), " from".into(), format!(" {name}")];
    words.extend((1..=behavior.stream_extra_words).map(|i| format!(" w{i}")));
    words
}

/// A streamed (server-sent events) answer of `chunks`, `delay` apart.
fn sse(name: &str, chunks: Vec<Bytes>, delay: Duration) -> hyper::Response<PodBody> {
    let mut resp = hyper::Response::new(chunked_body(chunks, delay));
    let h = resp.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/event-stream"),
    );
    if let Ok(v) = hyper::header::HeaderValue::from_str(name) {
        h.insert("x-pod", v);
    }
    resp
}

/// Decrements the in-flight count when the request ends, also when hyper drops the handler
/// because the client (the gateway) went away.
struct InFlight(Arc<State>);

impl InFlight {
    fn enter(state: &Arc<State>) -> InFlight {
        let now = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        state.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(state.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A running recording upstream on 127.0.0.1 (stopped on drop).
pub struct Pod {
    addr: SocketAddr,
    state: Arc<State>,
    tasks: Arc<Mutex<Vec<AbortHandle>>>,
}

impl Pod {
    /// Starts a pod on a free loopback port. `name` shows up in its answers and in `x-pod`.
    pub async fn start(name: &str) -> Result<Pod> {
        let listener = TcpListener::bind("127.0.0.1:0").await.context("bind pod")?;
        Pod::serve(name, listener)
    }

    /// Starts a pod on a given address (used to bring a stopped pod back on the same port).
    pub async fn start_at(name: &str, addr: SocketAddr) -> Result<Pod> {
        let listener = TcpListener::bind(addr).await.with_context(|| format!("bind pod {addr}"))?;
        Pod::serve(name, listener)
    }

    fn serve(name: &str, listener: TcpListener) -> Result<Pod> {
        let addr = listener.local_addr()?;
        let (release, _) = watch::channel(0u64);
        let state = Arc::new(State {
            name: name.to_string(),
            behavior: Mutex::new(Behavior::default()),
            metrics: Mutex::new(String::new()),
            records: Mutex::new(Vec::new()),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            release,
            cached_chats: Mutex::new(HashSet::new()),
            responses: Mutex::new(HashMap::new()),
            responses_given: AtomicUsize::new(0),
        });
        let tasks: Arc<Mutex<Vec<AbortHandle>>> = Arc::new(Mutex::new(Vec::new()));
        let accept_state = state.clone();
        let accept_tasks = tasks.clone();
        let accept = tokio::spawn(async move {
            loop {
                let stream = match listener.accept().await {
                    Ok((s, _)) => s,
                    Err(_) => {
                        // e.g. out of file descriptors: back off instead of spinning.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let st = accept_state.clone();
                let conn = tokio::spawn(async move {
                    let svc = service_fn(move |req| handle(st.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
                if let Ok(mut t) = accept_tasks.lock() {
                    t.retain(|h| !h.is_finished());
                    t.push(conn.abort_handle());
                }
            }
        });
        if let Ok(mut t) = tasks.lock() {
            t.push(accept.abort_handle());
        }
        Ok(Pod { addr, state, tasks })
    }

    /// `127.0.0.1:port`.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `"127.0.0.1:port"`, the form the gateway config and `x-gateway-upstream-host` use.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// The pod's name.
    pub fn name(&self) -> &str {
        &self.state.name
    }

    /// Sets the Prometheus text served at `/metrics`.
    pub fn set_metrics(&self, text: impl Into<String>) {
        if let Ok(mut m) = self.state.metrics.lock() {
            *m = text.into();
        }
    }

    /// Adds latency before every inference answer.
    pub fn set_delay(&self, delay: Duration) {
        self.with_behavior(|b| b.delay = delay);
    }

    /// Holds every new inference request open until [`Pod::release`] (at most [`MAX_HOLD`]).
    pub fn set_hold(&self, hold: bool) {
        self.with_behavior(|b| b.hold = hold);
    }

    /// Answers inference requests with this status (None: answer normally).
    pub fn set_fail(&self, status: Option<u16>) {
        self.with_behavior(|b| b.fail_status = status);
    }

    /// Pause between SSE chunks when streaming.
    pub fn set_stream_chunk_delay(&self, delay: Duration) {
        self.with_behavior(|b| b.stream_chunk_delay = delay);
    }

    /// A streamed answer carries `words` more word events after "Hello from <name>" (a gateway
    /// times a pod's decode rate only on answers of more than a few events).
    pub fn set_stream_extra_words(&self, words: usize) {
        self.with_behavior(|b| b.stream_extra_words = words);
    }

    fn with_behavior(&self, f: impl FnOnce(&mut Behavior)) {
        if let Ok(mut b) = self.state.behavior.lock() {
            f(&mut b);
        }
    }

    /// Lets every request currently held go on.
    pub fn release(&self) {
        self.state.release.send_modify(|g| *g += 1);
    }

    /// Everything received so far.
    pub fn records(&self) -> Vec<Recorded> {
        self.state.records.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Inference requests received so far (everything but `/metrics` and `/health`).
    pub fn inference_records(&self) -> Vec<Recorded> {
        self.records().into_iter().filter(Recorded::is_inference).collect()
    }

    /// Number of inference requests received so far.
    pub fn inference_count(&self) -> usize {
        self.inference_records().len()
    }

    /// Number of `GET /metrics` requests received so far (someone scraped us).
    pub fn metrics_scrapes(&self) -> usize {
        self.records().iter().filter(|r| r.path_only() == "/metrics").count()
    }

    /// Forgets what was recorded so far (in-flight counters stay).
    pub fn clear_records(&self) {
        if let Ok(mut r) = self.state.records.lock() {
            r.clear();
        }
    }

    /// Inference requests being handled right now (counted once the whole request body arrived).
    pub fn in_flight(&self) -> usize {
        self.state.in_flight.load(Ordering::SeqCst)
    }

    /// The highest in-flight count seen.
    pub fn max_in_flight(&self) -> usize {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }

    /// Stops listening and closes every open connection (requests in progress are cut).
    pub fn stop(&self) {
        if let Ok(mut t) = self.tasks.lock() {
            for h in t.drain(..) {
                h.abort();
            }
        }
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        self.stop();
        self.release();
    }
}

type PodBody = BoxBody<Bytes, Infallible>;

fn full(
    status: u16,
    name: &str,
    content_type: &str,
    body: impl Into<Bytes>,
) -> hyper::Response<PodBody> {
    let mut resp = hyper::Response::new(Full::new(body.into()).boxed());
    *resp.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::OK);
    let h = resp.headers_mut();
    if let Ok(v) = hyper::header::HeaderValue::from_str(content_type) {
        h.insert(hyper::header::CONTENT_TYPE, v);
    }
    if let Ok(v) = hyper::header::HeaderValue::from_str(name) {
        h.insert("x-pod", v);
    }
    resp
}

async fn handle(
    state: Arc<State>,
    req: hyper::Request<hyper::body::Incoming>,
) -> Result<hyper::Response<PodBody>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let rec = Recorded {
        method: parts.method.to_string(),
        path: parts
            .uri
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| parts.uri.path().to_string()),
        headers: parts
            .headers
            .iter()
            .map(|(n, v)| {
                (n.as_str().to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned())
            })
            .collect(),
        body: body.clone(),
        at: Instant::now(),
    };
    let path = rec.path_only().to_string();
    if let Ok(mut r) = state.records.lock() {
        r.push(rec);
    }
    let name = state.name.clone();
    match path.as_str() {
        "/metrics" => {
            let text = state.metrics.lock().map(|m| m.clone()).unwrap_or_default();
            return Ok(full(200, &name, "text/plain; version=0.0.4", text));
        }
        "/health" => return Ok(full(200, &name, "text/plain", "ok")),
        _ => {}
    }

    let _guard = InFlight::enter(&state);
    let behavior = state.behavior.lock().map(|b| b.clone()).unwrap_or_default();
    if behavior.hold {
        let mut rx = state.release.subscribe();
        // Wait for the next release (a generation change) or the safety limit.
        let _ = tokio::time::timeout(MAX_HOLD, rx.changed()).await;
    }
    if !behavior.delay.is_zero() {
        tokio::time::sleep(behavior.delay).await;
    }
    if let Some(status) = behavior.fail_status {
        let err = serde_json::json!({"error": {"message": format!("{name} failing on purpose"), "code": status}});
        return Ok(full(status, &name, "application/json", err.to_string()));
    }

    let is_responses = path.ends_with("/v1/responses");
    let is_llm =
        path.ends_with("/chat/completions") || path.ends_with("/completions") || is_responses;
    if !is_llm {
        let echo = serde_json::json!({
            "pod": name, "method": parts.method.as_str(), "path": path, "body_len": body.len()
        });
        return Ok(full(200, &name, "application/json", echo.to_string()));
    }
    let parsed: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            // What a real OpenAI-compatible server does with a broken body: a 400 with an error object.
            let err = serde_json::json!({"error": {"message": format!("invalid JSON body: {e}"), "type": "BadRequestError", "code": 400, "pod": name}});
            return Ok(full(400, &name, "application/json", err.to_string()));
        }
    };
    let model = parsed.get("model").and_then(|m| m.as_str()).unwrap_or("unknown").to_string();
    let stream = parsed.get("stream").and_then(|s| s.as_bool()).unwrap_or(false);
    let content = format!("Hello from {name}");
    if is_responses {
        return Ok(responses_reply(&state, &parsed, &model, stream, body.len(), &behavior));
    }
    let messages = parsed.get("messages").and_then(|m| m.as_array()).cloned().unwrap_or_default();
    let cached = cached_tokens(&state, &messages);
    if !stream {
        let answer = serde_json::json!({
            "id": format!("chatcmpl-{name}"),
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": body.len() / 4, "completion_tokens": 3, "total_tokens": body.len() / 4 + 3,
                      "prompt_tokens_details": {"cached_tokens": cached}}
        });
        return Ok(full(200, &name, "application/json", answer.to_string()));
    }
    let mut chunks = Vec::new();
    let words = answer_words(&name, &behavior);
    for (i, word) in words.iter().enumerate() {
        let delta = if i == 0 {
            serde_json::json!({"role": "assistant", "content": word})
        } else {
            serde_json::json!({"content": word})
        };
        let chunk = serde_json::json!({
            "id": format!("chatcmpl-{name}"), "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": null}]
        });
        chunks.push(Bytes::from(format!("data: {chunk}\n\n")));
    }
    let last = serde_json::json!({
        "id": format!("chatcmpl-{name}"), "object": "chat.completion.chunk", "created": 0, "model": model,
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    });
    chunks.push(Bytes::from(format!("data: {last}\n\n")));
    if parsed.pointer("/stream_options/include_usage").and_then(|v| v.as_bool()) == Some(true) {
        let usage = serde_json::json!({
            "id": format!("chatcmpl-{name}"), "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [],
            "usage": {"prompt_tokens": body.len() / 4, "completion_tokens": 3, "total_tokens": body.len() / 4 + 3,
                      "prompt_tokens_details": {"cached_tokens": cached}}
        });
        chunks.push(Bytes::from(format!("data: {usage}\n\n")));
    }
    chunks.push(Bytes::from_static(b"data: [DONE]\n\n"));
    Ok(sse(&name, chunks, behavior.stream_chunk_delay))
}
