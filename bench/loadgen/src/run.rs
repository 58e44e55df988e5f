//! Sends the sessions: bounded concurrency, full history each turn, streamed replies,
//! client-side timings, and the oracle hit rate.

use crate::workload::{Api, SessionPlan, TOOL_NAME};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use podsim::tokenizer::{chat_prompt_tokens, tokenize, Message};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// Which gateway replica a turn goes through.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GatewayChoice {
    /// Session i sends every turn to `urls[i % len]` (one client per gateway replica).
    #[default]
    PerSession,
    /// Turn t of session i goes to `urls[(i + t) % len]`: consecutive turns always cross
    /// replicas, so only state shared between them (Redis) can keep a session's affinity.
    PerTurn,
}

impl GatewayChoice {
    /// Index of the gateway for turn `turn` of session `session` among `n`.
    pub fn index(self, session: usize, turn: usize, n: usize) -> usize {
        match self {
            GatewayChoice::PerSession => session % n.max(1),
            GatewayChoice::PerTurn => (session + turn) % n.max(1),
        }
    }
}

/// What a sticky client's header carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StickyValues {
    /// `values[hash(session) % len]`: the client hashes the session onto one value per pod (the
    /// gateway routes on it, e.g. a cluster per pod through `cluster_header`).
    OneOf(Vec<String>),
    /// The session's own id (`session-<n>`): the router hashes it (vLLM's router reads
    /// `X-Session-ID` in `consistent_hash` and `sticky_least_loaded`).
    SessionId,
}

/// A header naming the session on every request of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StickyHeader {
    /// Header name.
    pub header: String,
    /// Its value per session.
    pub values: StickyValues,
}

impl StickyHeader {
    /// The value for `session` (`OneOf`: FNV-1a of its id, modulo the number of values).
    pub fn value(&self, session: usize) -> Option<String> {
        match &self.values {
            StickyValues::OneOf(values) => {
                let h = podsim::tokenizer::fnv1a32(&(session as u64).to_le_bytes());
                let n = values.len();
                (n > 0).then(|| values[h as usize % n].clone())
            }
            StickyValues::SessionId => Some(format!("session-{session}")),
        }
    }
}

/// Where and how to send.
#[derive(Debug, Clone)]
pub struct Target {
    /// Base URLs (e.g. `http://127.0.0.1:8080`), one per gateway replica.
    pub urls: Vec<String>,
    /// How turns are spread over `urls`.
    pub gateway_choice: GatewayChoice,
    /// Session-hash stickiness decided by the client (the `session_hash` baseline).
    pub sticky: Option<StickyHeader>,
    /// Pods' time scale: think times and arrival times are simulated ms, slept times scale.
    pub time_scale: f64,
    /// `model` field.
    pub model: String,
    /// Per-request timeout.
    pub timeout: Duration,
    /// KV page size used by the oracle (same as the pods').
    pub page: usize,
}

/// Outcome of one request.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct RequestRecord {
    /// Session index.
    pub session: usize,
    /// Turn index within the session.
    pub turn: usize,
    /// Start time since the run began (s, wall clock).
    pub start_s: f64,
    /// Time to first non-empty content token (wall ms).
    pub ttft_ms: Option<f64>,
    /// End-to-end latency (wall ms).
    pub e2e_ms: f64,
    /// Generated tokens.
    pub output_tokens: usize,
    /// Prompt tokens (pod usage, or the client's own count).
    pub prompt_tokens: usize,
    /// Cached prompt tokens reported by the pod (`usage.prompt_tokens_details.cached_tokens`).
    pub cached_tokens: usize,
    /// Tokens an all-knowing router could have served from cache.
    pub oracle_cached_tokens: usize,
    /// `x-pod-name` of the pod that served.
    pub pod: Option<String>,
    /// Client time to response headers minus the pod's own (`x-pod-time-ms`), wall ms.
    pub gateway_added_ms: Option<f64>,
    /// Error text, if the request failed.
    pub error: Option<String>,
}

/// Remembers what every finished request put in the pods' caches, per session and group.
#[derive(Default)]
struct Oracle {
    seen: HashMap<(u8, usize), Vec<Arc<Vec<u32>>>>,
}

impl Oracle {
    fn keys(s: &SessionPlan) -> Vec<(u8, usize)> {
        let mut k = vec![(0, s.id)];
        if let Some(g) = s.group {
            k.push((1, g));
        }
        k
    }
    fn best(&self, s: &SessionPlan, prompt: &[u32]) -> usize {
        let mut best = 0;
        for k in Self::keys(s) {
            for seq in self.seen.get(&k).map(|v| v.as_slice()).unwrap_or(&[]) {
                let l = seq.iter().zip(prompt).take_while(|(a, b)| a == b).count();
                best = best.max(l);
            }
        }
        best
    }
    /// Records a prompt as cached (from when it is sent: engines cache prompt pages once they are
    /// prefilled, and counting them from the send is the upper bound) or a prompt + reply (when
    /// the request finishes).
    fn add(&mut self, s: &SessionPlan, seq: Vec<u32>) {
        let seq = Arc::new(seq);
        for k in Self::keys(s) {
            self.seen.entry(k).or_default().push(seq.clone());
        }
    }
}

/// Same rule as the pods: whole pages, at least the last prompt token recomputed.
pub fn cacheable(hit: usize, prompt_len: usize, page: usize) -> usize {
    let page = page.max(1);
    hit.min(prompt_len.saturating_sub(1)) / page * page
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

struct Reply {
    text: String,
    ttft: Option<Duration>,
    usage: Option<Usage>,
    pod: Option<String>,
    gateway_added_ms: Option<f64>,
    /// Responses API: the response's id (from `response.created`).
    response_id: Option<String>,
}

/// What the engine reported of one request, whichever API's names it used.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Usage {
    prompt_tokens: Option<usize>,
    completion_tokens: Option<usize>,
    cached_tokens: usize,
}

impl Usage {
    /// A chat or completions `usage` object, or a Responses API one (`input_tokens`,
    /// `output_tokens`, `input_tokens_details.cached_tokens`).
    fn read(u: &Value) -> Usage {
        let count = |keys: [&str; 2]| {
            keys.iter().find_map(|k| u.pointer(k)).and_then(Value::as_u64).map(|v| v as usize)
        };
        Usage {
            prompt_tokens: count(["/prompt_tokens", "/input_tokens"]),
            completion_tokens: count(["/completion_tokens", "/output_tokens"]),
            cached_tokens: count([
                "/prompt_tokens_details/cached_tokens",
                "/input_tokens_details/cached_tokens",
            ])
            .unwrap_or(0),
        }
    }
}

/// One streamed event's part in the reply: text, usage, the end.
#[derive(Debug, Default, PartialEq)]
struct StreamEvent<'a> {
    text: &'a str,
    usage: Option<Usage>,
    done: bool,
    /// Responses API: the response's id (`response.created`).
    response_id: Option<&'a str>,
}

/// Reads one `data:` payload of a chat stream (text deltas, a usage chunk, `[DONE]`) or of a
/// Responses API stream (`response.output_text.delta`, then `response.completed` or
/// `response.incomplete` carrying the usage and ending it). `Err` for a failed response.
fn stream_event<'a>(api: Api, v: &'a Value) -> Result<StreamEvent<'a>, String> {
    match api {
        Api::Chat => Ok(StreamEvent {
            text: v.pointer("/choices/0/delta/content").and_then(Value::as_str).unwrap_or(""),
            usage: v.get("usage").filter(|u| !u.is_null()).map(Usage::read),
            ..StreamEvent::default()
        }),
        Api::Responses => match v.get("type").and_then(Value::as_str).unwrap_or("") {
            "response.created" => Ok(StreamEvent {
                response_id: v.pointer("/response/id").and_then(Value::as_str),
                ..StreamEvent::default()
            }),
            "response.output_text.delta" => Ok(StreamEvent {
                text: v.get("delta").and_then(Value::as_str).unwrap_or(""),
                ..StreamEvent::default()
            }),
            "response.completed" | "response.incomplete" => Ok(StreamEvent {
                usage: v.pointer("/response/usage").filter(|u| !u.is_null()).map(Usage::read),
                done: true,
                ..StreamEvent::default()
            }),
            "response.failed" | "error" => Err(format!("response failed: {v}")),
            _ => Ok(StreamEvent::default()),
        },
    }
}

async fn send(
    client: &HttpClient,
    url: &str,
    sticky: Option<(&str, &str)>,
    api: Api,
    body: Value,
    t0: Instant,
) -> Result<Reply, String> {
    let mut req = hyper::Request::post(format!("{url}{}", api.path()))
        .header("content-type", "application/json");
    if let Some((name, value)) = sticky {
        req = req.header(name, value);
    }
    let req = req.body(Full::new(Bytes::from(body.to_string()))).map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| format!("connect: {e}"))?;
    let headers_ms = t0.elapsed().as_secs_f64() * 1000.0;
    let status = resp.status();
    let h = resp.headers();
    let pod = h.get("x-pod-name").and_then(|v| v.to_str().ok()).map(str::to_string);
    let pod_ms =
        h.get("x-pod-time-ms").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<f64>().ok());
    let mut body = resp.into_body();
    if !status.is_success() {
        let b = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        return Err(format!(
            "HTTP {}: {}",
            status.as_u16(),
            String::from_utf8_lossy(&b).chars().take(200).collect::<String>()
        ));
    }
    let mut reply = Reply {
        text: String::new(),
        ttft: None,
        usage: None,
        pod,
        gateway_added_ms: pod_ms.map(|p| headers_ms - p),
        response_id: None,
    };
    let mut buf: Vec<u8> = Vec::new();
    let mut done = false;
    while !done {
        let Some(frame) = body.frame().await else { break };
        let frame = frame.map_err(|e| format!("body: {e}"))?;
        let Ok(data) = frame.into_data() else { continue };
        buf.extend_from_slice(&data);
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            for line in event.split(|b| *b == b'\n') {
                let Some(payload) = line.strip_prefix(b"data:") else { continue };
                let payload = payload.trim_ascii();
                if payload == b"[DONE]" {
                    done = true;
                    continue;
                }
                let Ok(v) = serde_json::from_slice::<Value>(payload) else { continue };
                let event = stream_event(api, &v)?;
                if !event.text.is_empty() {
                    if reply.ttft.is_none() {
                        reply.ttft = Some(t0.elapsed());
                    }
                    reply.text.push_str(event.text);
                }
                if event.usage.is_some() {
                    reply.usage = event.usage;
                }
                if let Some(id) = event.response_id {
                    reply.response_id = Some(id.to_string());
                }
                done |= event.done;
            }
        }
    }
    if !done {
        // The pod died mid-stream (or the gateway cut it): not a complete reply.
        let (end, got) = (api.stream_end(), reply.text.len());
        return Err(format!("stream ended before {end} after {got} bytes"));
    }
    Ok(reply)
}

/// A session's conversation as its requests send it, in the workload's API.
struct Conversation {
    api: Api,
    /// Responses API: the system prompt, sent as `instructions` (chat: the first message).
    instructions: Option<String>,
    /// Chat: `messages`; Responses API: `input` items.
    items: Vec<Value>,
    /// Responses API kept on the server (`store_responses`): the last response's id, and where
    /// the items it does not hold begin.
    stored: Option<StoredConversation>,
}

/// Where a conversation kept on the server stands.
#[derive(Default)]
struct StoredConversation {
    previous: Option<String>,
    new_from: usize,
}

impl Conversation {
    fn new(api: Api, system: Option<String>, store_responses: bool) -> Conversation {
        let stored = store_responses.then(StoredConversation::default);
        let mut c = Conversation { api, instructions: None, items: Vec::new(), stored };
        match api {
            Api::Chat => c.items.extend(system.map(|s| json!({"role": "system", "content": s}))),
            Api::Responses => c.instructions = system,
        }
        c
    }

    fn user(&mut self, text: &str) {
        self.items.push(json!({"role": "user", "content": text}));
    }

    /// The previous reply called the tool (call `id`); its result is `output`.
    fn tool_result(&mut self, id: &str, output: &str) {
        let arguments = "{\"command\":\"make\"}";
        match self.api {
            Api::Chat => {
                if let Some(reply) = self.items.last_mut().and_then(Value::as_object_mut) {
                    let call = json!([{"id": id, "type": "function",
                        "function": {"name": TOOL_NAME, "arguments": arguments}}]);
                    reply.insert("tool_calls".into(), call);
                }
                self.items.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
            }
            Api::Responses => {
                // Kept on the server, the call is in the response the server stored.
                if self.stored.is_none() {
                    self.items.push(json!({"type": "function_call", "call_id": id,
                        "name": TOOL_NAME, "arguments": arguments}));
                }
                self.items
                    .push(json!({"type": "function_call_output", "call_id": id, "output": output}));
            }
        }
    }

    /// The reply (`response_id`: its id, when the server stored it).
    fn assistant(&mut self, text: &str, response_id: Option<String>) {
        self.items.push(match self.api {
            Api::Chat => json!({"role": "assistant", "content": text}),
            Api::Responses => json!({"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": text}]}),
        });
        if let (Some(stored), Some(id)) = (self.stored.as_mut(), response_id) {
            // The server holds everything up to here; a failed request leaves its items to send
            // again with the next one.
            stored.previous = Some(id);
            stored.new_from = self.items.len();
        }
    }

    /// The next request's body: the whole conversation, streamed, usage reported.
    fn body(&self, model: &str, max_tokens: usize, tools: Option<&Value>) -> Value {
        let mut body = match self.api {
            Api::Chat => json!({
                "model": model, "messages": self.items, "max_tokens": max_tokens,
                "stream": true, "stream_options": {"include_usage": true},
            }),
            Api::Responses => match &self.stored {
                None => json!({
                    "model": model, "input": self.items, "max_output_tokens": max_tokens,
                    "stream": true, "store": false,
                }),
                Some(StoredConversation { previous: Some(previous), new_from }) => json!({
                    "model": model, "input": self.items.get(*new_from..).unwrap_or_default(),
                    "max_output_tokens": max_tokens, "stream": true, "store": true,
                    "previous_response_id": previous,
                }),
                Some(StoredConversation { previous: None, .. }) => json!({
                    "model": model, "input": self.items, "max_output_tokens": max_tokens,
                    "stream": true, "store": true,
                }),
            },
        };
        let continues = self.stored.as_ref().is_some_and(|s| s.previous.is_some());
        if let Some(obj) = body.as_object_mut() {
            if let Some(tools) = tools {
                obj.insert("tools".into(), tools.clone());
            }
            // The stored conversation holds them (`instructions` are not carried over by OpenAI's
            // API, but this conversation's server keeps the system message it rendered).
            if let Some(instructions) = self.instructions.as_ref().filter(|_| !continues) {
                obj.insert("instructions".into(), json!(instructions));
            }
        }
        body
    }
}

async fn run_session(
    client: HttpClient,
    target: Arc<Target>,
    s: SessionPlan,
    oracle: Arc<Mutex<Oracle>>,
    started: Instant,
    progress: Arc<AtomicU64>,
) -> Vec<RequestRecord> {
    let sticky_value = target.sticky.as_ref().and_then(|st| st.value(s.id));
    let sticky =
        target.sticky.as_ref().zip(sticky_value.as_deref()).map(|(st, v)| (st.header.as_str(), v));
    // The conversation twice: as the pods tokenize it (for the oracle) and as the request sends
    // it (with the tool calls and their ids, which the pods' template does not render).
    let mut history: Vec<Message> = Vec::new();
    let mut sent = Conversation::new(s.api, s.system.clone(), s.store_responses);
    if let Some(sys) = &s.system {
        history.push(Message { role: "system".into(), content: sys.clone() });
    }
    let tools_text = s.tools.as_ref().map(Value::to_string);
    let mut out = Vec::new();
    for (t, turn) in s.turns.iter().enumerate() {
        if turn.think_ms > 0.0 {
            tokio::time::sleep(scaled(turn.think_ms, target.time_scale)).await;
        }
        let url = &target.urls[target.gateway_choice.index(s.id, t, target.urls.len())];
        if s.tool_rounds && t > 0 {
            // The previous reply called the tool; this turn sends its result.
            history.push(Message { role: "tool".into(), content: turn.user.clone() });
            sent.tool_result(&format!("call_{}_{t}", s.id), &turn.user);
        } else {
            history.push(Message { role: "user".into(), content: turn.user.clone() });
            sent.user(&turn.user);
        }
        let prompt = chat_prompt_tokens(&history, tools_text.as_deref());
        let oracle_hit = oracle
            .lock()
            .map(|mut o| {
                let best = o.best(&s, &prompt);
                o.add(&s, prompt.clone());
                best
            })
            .unwrap_or(0);
        let model = s.model.as_deref().unwrap_or(&target.model);
        let body = sent.body(model, turn.max_tokens, s.tools.as_ref());
        let t0 = Instant::now();
        let res = tokio::time::timeout(target.timeout, send(&client, url, sticky, s.api, body, t0))
            .await
            .unwrap_or_else(|_| Err("timeout".into()));
        let e2e_ms = t0.elapsed().as_secs_f64() * 1000.0;
        let mut rec = RequestRecord {
            session: s.id,
            turn: t,
            start_s: (t0 - started).as_secs_f64(),
            e2e_ms,
            prompt_tokens: prompt.len(),
            oracle_cached_tokens: cacheable(oracle_hit, prompt.len(), target.page),
            ..Default::default()
        };
        let mut response_id = None;
        let reply_text = match res {
            Ok(r) => {
                response_id = r.response_id;
                let gen = tokenize(&r.text);
                rec.ttft_ms = r.ttft.map(|d| d.as_secs_f64() * 1000.0);
                rec.pod = r.pod;
                rec.gateway_added_ms = r.gateway_added_ms;
                let u = r.usage;
                rec.output_tokens = u.and_then(|u| u.completion_tokens).unwrap_or(gen.len());
                rec.prompt_tokens = u.and_then(|u| u.prompt_tokens).unwrap_or(prompt.len());
                rec.cached_tokens = u.map_or(0, |u| u.cached_tokens);
                let mut seq = prompt;
                seq.extend(gen);
                if let Ok(mut o) = oracle.lock() {
                    o.add(&s, seq);
                }
                r.text
            }
            Err(e) => {
                rec.error = Some(e);
                String::new()
            }
        };
        sent.assistant(&reply_text, response_id);
        history.push(Message { role: "assistant".into(), content: reply_text });
        out.push(rec);
        progress.fetch_add(1, Ordering::Relaxed);
    }
    out
}

fn scaled(sim_ms: f64, time_scale: f64) -> Duration {
    let ts = if time_scale > 0.0 { time_scale } else { 1.0 };
    Duration::from_secs_f64((sim_ms * ts / 1000.0).max(0.0))
}

/// Runs all sessions against `target`: sessions with a `start_ms` (open loop) start then,
/// whatever is in flight; the others run at most `concurrency` at a time. Returns one record per
/// request, in completion order of sessions. `progress` counts finished requests.
pub async fn run(
    sessions: Vec<SessionPlan>,
    target: Target,
    concurrency: usize,
    progress: Arc<AtomicU64>,
) -> Vec<RequestRecord> {
    // Nagle + delayed ACK would add ~40 ms to the first byte of each request.
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    let client: HttpClient =
        Client::builder(TokioExecutor::new()).pool_max_idle_per_host(1024).build(conn);
    let target = Arc::new(target);
    let oracle = Arc::new(Mutex::new(Oracle::default()));
    let sem = Arc::new(Semaphore::new(concurrency.max(1)));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for s in sessions {
        if let Some(start) = s.start_ms {
            tokio::time::sleep_until((started + scaled(start, target.time_scale)).into()).await;
            let (client, target, oracle, progress) =
                (client.clone(), target.clone(), oracle.clone(), progress.clone());
            tasks.push(tokio::spawn(run_session(client, target, s, oracle, started, progress)));
            continue;
        }
        let Ok(permit) = sem.clone().acquire_owned().await else { break };
        let (client, target, oracle, progress) =
            (client.clone(), target.clone(), oracle.clone(), progress.clone());
        tasks.push(tokio::spawn(async move {
            let r = run_session(client, target, s, oracle, started, progress).await;
            drop(permit);
            r
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        if let Ok(r) = t.await {
            all.extend(r);
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oracle_counts_same_session_and_group_only() {
        let mk = |id, group| SessionPlan {
            id,
            group,
            system: None,
            turns: vec![],
            tool_rounds: false,
            tools: None,
            api: Api::Chat,
            store_responses: false,
            start_ms: None,
            model: None,
        };
        let mut o = Oracle::default();
        let a = mk(0, Some(1));
        o.add(&a, (0..100).collect());
        let prompt: Vec<u32> = (0..120).collect();
        assert_eq!(o.best(&mk(0, None), &prompt), 100, "same session");
        assert_eq!(o.best(&mk(5, Some(1)), &prompt), 100, "same group");
        assert_eq!(o.best(&mk(5, Some(2)), &prompt), 0, "other session, other group");
        assert_eq!(cacheable(100, 120, 16), 96);
        assert_eq!(cacheable(120, 120, 16), 112);
    }

    /// `n` simulated pods in this process, 50 times faster than real time; their base URLs.
    /// Runs `workload` on `n` fresh pods (time scale 0.02), `concurrency` sessions at a time.
    async fn run_on_pods(
        workload: &crate::Workload,
        n: usize,
        gateway_choice: GatewayChoice,
        concurrency: usize,
    ) -> Vec<RequestRecord> {
        let target = Target {
            urls: pods(n).await,
            gateway_choice,
            sticky: None,
            time_scale: 0.02,
            model: "m".into(),
            timeout: Duration::from_secs(30),
            page: 16,
        };
        run(workload.plan(), target, concurrency, Arc::new(AtomicU64::new(0))).await
    }

    async fn pods(n: usize) -> Vec<String> {
        use podsim::server::{serve, Faults, Flavor, Pod, PodConfig};
        let mut urls = Vec::new();
        for index in 0..n {
            let pod = Pod::new(PodConfig {
                index,
                name: format!("pod-{index}"),
                model: "m".into(),
                flavor: Flavor::VllmV1,
                engine: podsim::engine::EngineConfig::default(),
                time_scale: 0.02,
                api_overhead_ms: 0.0,
                loras: vec![],
                max_lora: 0,
                faults: Faults::default(),
            });
            let addr = serve(pod, "127.0.0.1:0".parse().expect("addr")).await.expect("serve");
            urls.push(format!("http://{addr}"));
        }
        urls
    }

    #[tokio::test]
    async fn the_oracle_hit_rate_bounds_what_the_pods_report_whatever_the_routing() {
        // Sessions sharing two system prompts, three turns each, over three pods: every session
        // on one pod (affinity), or each turn on the next pod (none: only the system prompts hit).
        let workload: crate::Workload = serde_yaml::from_str(
            "{kind: multi_turn, sessions: 8, turns_mean: 3, input_tokens_mean: 60, output_tokens_mean: 20, concurrency: 4, system_prompt_tokens: 64, system_prompts: 2, seed: 3}",
        )
        .expect("workload");
        let mut hit_rates = Vec::new();
        for choice in [GatewayChoice::PerSession, GatewayChoice::PerTurn] {
            let records = run_on_pods(&workload, 3, choice, 4).await;
            assert_eq!(records.len(), 24, "{choice:?}");
            // Per request the oracle credits a shared system prompt to whichever session the
            // client sent first, while a pod may prefill a later-sent one first (two sessions
            // sent at once, each with its own API overhead): the bound holds for the sum only.
            for r in &records {
                assert_eq!(r.error, None, "{choice:?}: {r:?}");
                assert!(r.cached_tokens <= r.prompt_tokens, "{choice:?}: {r:?}");
            }
            let pods_of = |session| {
                let mut p: Vec<_> = records
                    .iter()
                    .filter(|r| r.session == session)
                    .map(|r| r.pod.clone())
                    .collect();
                p.sort();
                p.dedup();
                p.len()
            };
            let expected = if choice == GatewayChoice::PerSession { 1 } else { 3 };
            assert!((0..8).all(|s| pods_of(s) == expected), "{choice:?}: pods per session");
            let s = crate::stats::summarize(&records, 1.0, 0.02);
            assert!(s.client_hit_rate <= s.oracle_hit_rate, "{choice:?}: {s:?}");
            hit_rates.push((s.client_hit_rate, s.oracle_hit_rate));
        }
        let ((sticky, oracle), (rotating, oracle_again)) = (hit_rates[0], hit_rates[1]);
        assert_eq!(oracle, oracle_again, "the oracle does not depend on the routing");
        assert!(rotating < sticky, "affinity hits the history: {rotating} vs {sticky}");
        assert!(rotating > 0.0, "the system prompts hit on every pod: {rotating}");
    }

    /// An agent session sent on the Responses API costs the pods what the same session costs on
    /// the chat API: the same prompt tokens turn by turn, the same cached tokens, the same replies.
    /// So does one kept on the server (each request after the first sends `previous_response_id`
    /// and only its tool output, and the pod adds the conversation it stored).
    #[tokio::test]
    async fn an_agent_on_the_responses_api_costs_what_it_costs_on_the_chat_api() {
        let mut per_api = Vec::new();
        for api in ["chat", "responses", "responses, store_responses: true"] {
            let workload: crate::Workload = serde_yaml::from_str(&format!(
                "{{kind: multi_turn, sessions: 3, turns_mean: 4, input_tokens_mean: 40, output_tokens_mean: 12, concurrency: 3, system_prompt_tokens: 48, tool_rounds: true, api: {api}, seed: 5}}"
            ))
            .expect("workload");
            let mut records = run_on_pods(&workload, 1, GatewayChoice::PerSession, 3).await;
            records.sort_by_key(|r| (r.session, r.turn));
            assert_eq!(records.len(), 12, "{api}");
            for r in &records {
                assert_eq!(r.error, None, "{api}: {r:?}");
                assert!(r.ttft_ms.is_some() && r.output_tokens > 0, "{api}: {r:?}");
                if r.turn > 0 {
                    // One pod: every later round finds the rounds before it.
                    assert!(r.cached_tokens >= r.oracle_cached_tokens, "{api}: {r:?}");
                    assert!(r.cached_tokens > 0, "{api}: {r:?}");
                }
            }
            per_api.push(
                records
                    .iter()
                    .map(|r| (r.session, r.turn, r.prompt_tokens, r.output_tokens))
                    .collect::<Vec<_>>(),
            );
        }
        assert_eq!(per_api[0], per_api[1], "the same conversation on either API");
        assert_eq!(per_api[0], per_api[2], "the same conversation kept on the server");
    }

    /// A conversation kept on the server reaches a pod that did not make its last response: that
    /// pod answers 404, as vLLM's per-process store does, and the request is an error.
    #[tokio::test]
    async fn a_stored_conversation_sent_to_another_pod_fails() {
        let workload: crate::Workload = serde_yaml::from_str(
            "{kind: multi_turn, sessions: 2, turns_mean: 3, input_tokens_mean: 20, output_tokens_mean: 8, concurrency: 2, api: responses, store_responses: true, seed: 5}",
        )
        .expect("workload");
        for choice in [GatewayChoice::PerSession, GatewayChoice::PerTurn] {
            let records = run_on_pods(&workload, 2, choice, 2).await;
            assert!(records.len() >= 4, "{records:?}");
            for r in &records {
                // Per turn, odd turns go to the other pod (the even ones come back to the pod
                // that made the last response that succeeded).
                let fails = choice == GatewayChoice::PerTurn && r.turn % 2 == 1;
                let error = r.error.as_deref().unwrap_or("");
                assert_eq!(error.starts_with("HTTP 404"), fails, "{choice:?}: {r:?}");
            }
        }
    }

    #[test]
    fn responses_api_stream_events_give_text_usage_and_end() {
        let delta = json!({"type": "response.output_text.delta", "delta": " word"});
        assert_eq!(
            stream_event(Api::Responses, &delta),
            Ok(StreamEvent { text: " word", ..StreamEvent::default() })
        );
        let done = json!({"type": "response.incomplete", "response": {"usage": {
            "input_tokens": 90, "input_tokens_details": {"cached_tokens": 64}, "output_tokens": 7}}});
        let usage =
            Usage { prompt_tokens: Some(90), completion_tokens: Some(7), cached_tokens: 64 };
        assert_eq!(
            stream_event(Api::Responses, &done),
            Ok(StreamEvent { usage: Some(usage), done: true, ..StreamEvent::default() })
        );
        let failed =
            json!({"type": "response.failed", "response": {"error": {"code": "server_error"}}});
        assert!(stream_event(Api::Responses, &failed).is_err());
        // A chat chunk read as a Responses event is nothing, and the other way round.
        let chunk = json!({"choices": [{"delta": {"content": "x"}}]});
        assert_eq!(stream_event(Api::Responses, &chunk), Ok(StreamEvent::default()));
        assert_eq!(stream_event(Api::Chat, &delta), Ok(StreamEvent::default()));
    }

    #[test]
    fn per_turn_gateways_rotate_and_sticky_values_are_stable() {
        let per_turn: Vec<usize> = (0..5).map(|t| GatewayChoice::PerTurn.index(7, t, 4)).collect();
        assert_eq!(per_turn, [3, 0, 1, 2, 3], "every turn through the next gateway");
        assert!((0..5).all(|t| GatewayChoice::PerSession.index(7, t, 4) == 3));
        let st = StickyHeader {
            header: "x".into(),
            values: StickyValues::OneOf(vec!["a".into(), "b".into(), "c".into()]),
        };
        let picks: Vec<String> = (0..300).filter_map(|s| st.value(s)).collect();
        assert_eq!(picks.len(), 300);
        assert_eq!(st.value(42), st.value(42));
        for v in ["a", "b", "c"] {
            let n = picks.iter().filter(|p| *p == v).count();
            assert!((60..140).contains(&n), "{v}: {n} of 300 sessions");
        }
        let ids = StickyHeader { header: "X-Session-ID".into(), values: StickyValues::SessionId };
        assert_eq!(ids.value(7).as_deref(), Some("session-7"));
        assert_ne!(ids.value(7), ids.value(8), "one value per session, not per pod");
    }
}
