//! OpenAI-compatible HTTP front end of a simulated pod, its scheduler driver and /metrics.

use crate::engine::{self, EngineConfig, Event, Finish, Scheduler, Usage};
use crate::stats::{Buckets, Histogram, RequestStats};
use crate::tokenizer::{chat_prompt_tokens, hash_tokens, tokenize, Message, Rng};
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Notify};

/// /metrics flavour of a pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// vLLM V0 names (`vllm:gpu_cache_usage_perc`, `vllm:gpu_prefix_cache_hit_rate`).
    VllmV0,
    /// vLLM V1 names (`vllm:kv_cache_usage_perc`, prefix cache counters).
    VllmV1,
    /// SGLang names (`sglang:num_running_reqs`, `sglang:token_usage`, ...).
    Sglang,
}

impl Flavor {
    /// The histogram bucket bounds of this flavour's engine.
    fn buckets(self) -> Buckets {
        match self {
            Flavor::VllmV0 | Flavor::VllmV1 => Buckets::Vllm,
            Flavor::Sglang => Buckets::Sglang,
        }
    }
}

impl std::str::FromStr for Flavor {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "vllm-v0" | "vllm_v0" | "v0" => Ok(Flavor::VllmV0),
            "vllm-v1" | "vllm_v1" | "v1" | "vllm" => Ok(Flavor::VllmV1),
            "sglang" => Ok(Flavor::Sglang),
            _ => Err(format!("unknown metrics flavour {s:?} (vllm-v0, vllm-v1, sglang)")),
        }
    }
}

/// Fault injection settings of a pod.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Faults {
    /// Share of completion requests answered with HTTP 500 (0..1).
    pub error_rate: f64,
    /// /health (and completions) answer 503 for this many seconds after start.
    pub slow_start_s: f64,
    /// After this many seconds the pod stops answering anything and its engine stops stepping
    /// (a hung GPU): connections and streams stall.
    pub hang_after_s: Option<f64>,
    /// The hang ends after this long (default: never).
    pub hang_for_s: Option<f64>,
    /// From this many seconds on the engine is dead: streams in flight are cut, and completions
    /// and `/health` answer 503 (so a health check removes the pod).
    pub fail_after_s: Option<f64>,
}

/// Everything that defines one simulated pod.
#[derive(Debug, Clone)]
pub struct PodConfig {
    /// Pod index (in the process).
    pub index: usize,
    /// Name reported in `x-pod-name`.
    pub name: String,
    /// Served model name.
    pub model: String,
    /// /metrics flavour.
    pub flavor: Flavor,
    /// Scheduler and latency model.
    pub engine: EngineConfig,
    /// Real seconds per simulated second (0.25 = 4x faster than real time).
    pub time_scale: f64,
    /// API/tokenizer overhead added before scheduling, in simulated ms.
    pub api_overhead_ms: f64,
    /// LoRA adapter names served (requests whose `model` is one of them use it).
    pub loras: Vec<String>,
    /// vLLM --max-loras.
    pub max_lora: usize,
    /// Faults.
    pub faults: Faults,
}

struct Shared {
    sched: Scheduler,
    senders: HashMap<u64, mpsc::UnboundedSender<Event>>,
    next_id: u64,
    error_rng: Rng,
    error_rate: f64,
}

/// Responses API answers a pod keeps before it forgets the oldest.
pub const STORED_RESPONSES: usize = 20_000;

/// The Responses API answers a pod stored (`store` not false), as vLLM keeps them in the memory of
/// its process (`VLLM_ENABLE_RESPONSES_API_STORE`): by id, the conversation up to and with the
/// answer. A request that names one this pod does not have (`previous_response_id`) gets 404.
#[derive(Default)]
pub struct ResponseStore {
    by_id: HashMap<String, Vec<Message>>,
    order: VecDeque<String>,
}

impl ResponseStore {
    fn get(&self, id: &str) -> Option<Vec<Message>> {
        self.by_id.get(id).cloned()
    }

    fn insert(&mut self, id: String, conversation: Vec<Message>) {
        if self.order.len() >= STORED_RESPONSES {
            if let Some(old) = self.order.pop_front() {
                self.by_id.remove(&old);
            }
        }
        self.order.push_back(id.clone());
        self.by_id.insert(id, conversation);
    }
}

/// A conversation to store once its answer is complete: the store, and the messages before the
/// answer.
struct ToStore {
    store: Arc<Mutex<ResponseStore>>,
    conversation: Vec<Message>,
}

impl ToStore {
    fn answered(self, id: &str, text: &str) {
        let mut conversation = self.conversation;
        conversation.push(Message { role: "assistant".into(), content: text.to_string() });
        self.store.lock().unwrap_or_else(|e| e.into_inner()).insert(id.to_string(), conversation);
    }
}

/// A running pod: shared state between HTTP handlers and the scheduler loop.
pub struct Pod {
    cfg: PodConfig,
    state: Mutex<Shared>,
    responses: Arc<Mutex<ResponseStore>>,
    notify: Notify,
    started: Instant,
    hang: AtomicBool,
}

type RespBody = BoxBody<Bytes, Infallible>;

fn full(s: impl Into<Bytes>) -> RespBody {
    Full::new(s.into()).boxed()
}

fn scaled(ms: f64, scale: f64) -> Duration {
    Duration::from_secs_f64((ms * scale / 1000.0).max(0.0))
}

/// Blocks the calling thread until `deadline`, late by the kernel's timer slack (tens of µs). The
/// pods' clock is not tokio's timer, which ends every sleep at its next millisecond tick: at time
/// scale 0.25 a 5.8 simulated ms step (1.44 real ms) then ended 1.1 or 2.1 real ms after the one
/// before, so a pod's chunk gaps, the plugin's speed signal, came in two values twice apart (equal
/// pods could read as one twice as slow as the other, and have hits diverted for nothing), and
/// every TTFT gained up to 4 simulated ms per sleep. Only on a thread that nothing else runs on.
fn sleep_until_precisely(deadline: Instant) {
    let now = Instant::now();
    if deadline > now {
        std::thread::sleep(deadline - now);
    }
}

impl Pod {
    /// Creates a pod (call [`serve`] to run it).
    pub fn new(cfg: PodConfig) -> Arc<Pod> {
        let error_rate = cfg.faults.error_rate;
        Arc::new(Pod {
            state: Mutex::new(Shared {
                sched: Scheduler::with_buckets(cfg.engine, cfg.flavor.buckets()),
                senders: HashMap::new(),
                next_id: 1,
                error_rng: Rng::new(0x5eed ^ cfg.index as u64),
                error_rate,
            }),
            cfg,
            responses: Arc::default(),
            notify: Notify::new(),
            started: Instant::now(),
            hang: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn hanging(&self) -> bool {
        if self.hang.load(Ordering::Relaxed) {
            return true;
        }
        let t = self.started.elapsed().as_secs_f64();
        let f = &self.cfg.faults;
        matches!(f.hang_after_s, Some(s) if t >= s && f.hang_for_s.is_none_or(|d| t < s + d))
    }

    fn failed(&self) -> bool {
        matches!(self.cfg.faults.fail_after_s, Some(s) if self.started.elapsed().as_secs_f64() >= s)
    }

    /// Waits while the pod hangs.
    async fn wait_while_hanging(&self) {
        while self.hanging() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn starting(&self) -> bool {
        self.started.elapsed().as_secs_f64() < self.cfg.faults.slow_start_s
    }

    /// The scheduler loop: one step at a time, sleeping each step's scaled duration.
    async fn drive(self: Arc<Self>) {
        let mut deadline = Instant::now();
        loop {
            if self.hanging() {
                self.wait_while_hanging().await;
                deadline = Instant::now();
            }
            if self.failed() {
                // The engine died: every stream in flight ends where it is (no [DONE]).
                {
                    let mut st = self.lock();
                    let ids: Vec<u64> = st.senders.keys().copied().collect();
                    for id in ids {
                        st.sched.abort(id);
                    }
                    st.senders.clear();
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            let step = self.lock().sched.begin_step();
            let Some(ms) = step else {
                self.notify.notified().await;
                deadline = Instant::now();
                continue;
            };
            deadline += scaled(ms, self.cfg.time_scale);
            // Catch up after a late wake-up, but only a little: bursts would distort TTFT.
            let now = Instant::now();
            if now > deadline + Duration::from_millis(20) {
                deadline = now;
            }
            sleep_until_precisely(deadline);
            let mut st = self.lock();
            let events = st.sched.end_step();
            let mut gone = Vec::new();
            for (id, ev) in events {
                let done = matches!(ev, Event::Done(..));
                if let Some(tx) = st.senders.get(&id) {
                    if tx.send(ev).is_err() {
                        gone.push(id);
                    }
                }
                if done {
                    st.senders.remove(&id);
                }
            }
            for id in gone {
                st.senders.remove(&id);
                st.sched.abort(id);
            }
        }
    }

    /// Prometheus text in this pod's flavour (plus `podsim_*` counters the bench reads).
    pub fn metrics_text(&self) -> String {
        let st = self.lock();
        let s = &st.sched;
        let c = s.counters();
        let m = &self.cfg.model;
        let usage = s.used_tokens() as f64 / s.capacity_tokens().max(1) as f64;
        let hit_rate =
            if c.prompt_tokens > 0 { c.cached_tokens as f64 / c.prompt_tokens as f64 } else { 0.0 };
        let mut o = String::new();
        // vLLM V1 labels every series with its engine (one here).
        let labels = match self.cfg.flavor {
            Flavor::VllmV1 => format!("model_name=\"{m}\",engine=\"0\""),
            Flavor::VllmV0 | Flavor::Sglang => format!("model_name=\"{m}\""),
        };
        let g = |o: &mut String, name: &str, kind: &str, v: String| {
            let _ = writeln!(o, "# TYPE {name} {kind}\n{name}{{{labels}}} {v}");
        };
        match self.cfg.flavor {
            Flavor::VllmV0 | Flavor::VllmV1 => {
                g(
                    &mut o,
                    "vllm:num_requests_running",
                    "gauge",
                    format!("{:.1}", s.num_running() as f64),
                );
                g(
                    &mut o,
                    "vllm:num_requests_waiting",
                    "gauge",
                    format!("{:.1}", s.num_waiting() as f64),
                );
                if self.cfg.flavor == Flavor::VllmV0 {
                    g(&mut o, "vllm:gpu_cache_usage_perc", "gauge", format!("{usage}"));
                    g(&mut o, "vllm:gpu_prefix_cache_hit_rate", "gauge", format!("{hit_rate}"));
                } else {
                    g(&mut o, "vllm:kv_cache_usage_perc", "gauge", format!("{usage}"));
                    g(
                        &mut o,
                        "vllm:prefix_cache_queries_total",
                        "counter",
                        format!("{:.1}", c.prompt_tokens as f64),
                    );
                    g(
                        &mut o,
                        "vllm:prefix_cache_hits_total",
                        "counter",
                        format!("{:.1}", c.cached_tokens as f64),
                    );
                }
                g(
                    &mut o,
                    "vllm:prompt_tokens_total",
                    "counter",
                    format!("{:.1}", c.prompt_tokens as f64),
                );
                g(
                    &mut o,
                    "vllm:generation_tokens_total",
                    "counter",
                    format!("{:.1}", c.generation_tokens as f64),
                );
                let blocks = s.capacity_tokens() / self.cfg.engine.page.max(1);
                let _ = writeln!(
                    o,
                    "# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",num_gpu_blocks=\"{blocks}\"}} 1.0",
                    self.cfg.engine.page
                );
                if !self.cfg.loras.is_empty() {
                    let (run, wait) = s.adapters();
                    let ts = SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .map(|d| d.as_secs_f64())
                        .unwrap_or(0.0);
                    let _ = writeln!(
                        o,
                        "# TYPE vllm:lora_requests_info gauge\nvllm:lora_requests_info{{max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {ts:.9e}",
                        self.cfg.max_lora,
                        run.join(","),
                        wait.join(",")
                    );
                }
            }
            Flavor::Sglang => {
                g(
                    &mut o,
                    "sglang:num_running_reqs",
                    "gauge",
                    format!("{:.1}", s.num_running() as f64),
                );
                g(
                    &mut o,
                    "sglang:num_queue_reqs",
                    "gauge",
                    format!("{:.1}", s.num_waiting() as f64),
                );
                g(&mut o, "sglang:token_usage", "gauge", format!("{usage}"));
                g(
                    &mut o,
                    "sglang:num_used_tokens",
                    "gauge",
                    format!("{:.1}", s.used_tokens() as f64),
                );
                g(
                    &mut o,
                    "sglang:max_total_num_tokens",
                    "gauge",
                    format!("{:.1}", s.capacity_tokens() as f64),
                );
                g(&mut o, "sglang:cache_hit_rate", "gauge", format!("{hit_rate}"));
                g(
                    &mut o,
                    "sglang:prompt_tokens_total",
                    "counter",
                    format!("{:.1}", c.prompt_tokens as f64),
                );
                g(
                    &mut o,
                    "sglang:generation_tokens_total",
                    "counter",
                    format!("{:.1}", c.generation_tokens as f64),
                );
                g(
                    &mut o,
                    "sglang:cached_tokens_total",
                    "counter",
                    format!("{:.1}", c.cached_tokens as f64),
                );
                g(
                    &mut o,
                    "sglang:num_requests_total",
                    "counter",
                    format!("{:.1}", c.requests as f64),
                );
            }
        }
        let created = SystemTime::now()
            .checked_sub(self.started.elapsed())
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0.0, |d| d.as_secs_f64());
        self.write_histograms(&mut o, &labels, s.stats(), created);
        let _ = writeln!(
            o,
            "# TYPE podsim_prompt_tokens_total counter\npodsim_prompt_tokens_total {}",
            c.prompt_tokens
        );
        let _ = writeln!(
            o,
            "# TYPE podsim_cached_tokens_total counter\npodsim_cached_tokens_total {}",
            c.cached_tokens
        );
        let _ = writeln!(
            o,
            "# TYPE podsim_generation_tokens_total counter\npodsim_generation_tokens_total {}",
            c.generation_tokens
        );
        let _ = writeln!(
            o,
            "# TYPE podsim_requests_total counter\npodsim_requests_total {}",
            c.requests
        );
        let _ = writeln!(
            o,
            "# TYPE podsim_peak_inflight gauge\npodsim_peak_inflight {}",
            c.peak_inflight
        );
        let _ = writeln!(
            o,
            "# TYPE podsim_cache_tree_tokens gauge\npodsim_cache_tree_tokens {}",
            s.cached_tree_tokens()
        );
        // Simulated seconds: Σ (running + waiting) × step time, and Σ step time.
        let _ = writeln!(
            o,
            "# TYPE podsim_inflight_seconds_total counter\npodsim_inflight_seconds_total {}",
            c.inflight_us as f64 / 1e6
        );
        let _ = writeln!(
            o,
            "# TYPE podsim_busy_seconds_total counter\npodsim_busy_seconds_total {}",
            c.busy_us as f64 / 1e6
        );
        o
    }

    /// The per-request histograms and finish counters under this flavour's names and labels
    /// (V0 names its inter-token histogram `time_per_output_token`, which V1 still exports beside
    /// `inter_token_latency`; SGLang exports three histograms).
    fn write_histograms(&self, o: &mut String, labels: &str, st: &RequestStats, created: f64) {
        const TTFT: &str = "Histogram of time to first token in seconds.";
        const ITL: &str = "Histogram of inter-token latency in seconds.";
        const E2E: &str = "Histogram of end-to-end request latency in seconds.";
        let mut families: Vec<(&Histogram, &str, &str)> = match self.cfg.flavor {
            Flavor::Sglang => vec![
                (&st.ttft, "sglang:time_to_first_token_seconds", TTFT),
                (&st.inter_token, "sglang:inter_token_latency_seconds", ITL),
                (&st.e2e, "sglang:e2e_request_latency_seconds", E2E),
            ],
            Flavor::VllmV0 | Flavor::VllmV1 => vec![
                (&st.ttft, "vllm:time_to_first_token_seconds", TTFT),
                (&st.inter_token, "vllm:time_per_output_token_seconds", ITL),
                (&st.e2e, "vllm:e2e_request_latency_seconds", E2E),
                (&st.queue, "vllm:request_queue_time_seconds", "Time spent waiting, seconds."),
                (&st.inference, "vllm:request_inference_time_seconds", "Time running, seconds."),
                (&st.prefill, "vllm:request_prefill_time_seconds", "Time in prefill, seconds."),
                (&st.decode, "vllm:request_decode_time_seconds", "Time in decode, seconds."),
                (&st.prompt_tokens, "vllm:request_prompt_tokens", "Prefill tokens processed."),
                (&st.generation_tokens, "vllm:request_generation_tokens", "Tokens generated."),
                (&st.max_tokens, "vllm:request_params_max_tokens", "The max_tokens parameter."),
                (&st.generation_tokens, "vllm:request_max_num_generation_tokens", "Most tokens."),
                (&st.n, "vllm:request_params_n", "The n parameter."),
                (&st.step_tokens, "vllm:iteration_tokens_total", "Tokens per engine step."),
            ],
        };
        if self.cfg.flavor == Flavor::VllmV1 {
            families.push((&st.inter_token, "vllm:inter_token_latency_seconds", ITL));
        }
        if self.cfg.flavor != Flavor::Sglang {
            let _ = writeln!(
                o,
                "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter"
            );
            let finished =
                [("stop", st.finished_stop), ("length", st.finished_length), ("abort", st.aborted)];
            for (reason, n) in finished {
                let l = format!("{labels},finished_reason=\"{reason}\"");
                let _ = writeln!(
                    o,
                    "vllm:request_success_total{{{l}}} {:.1}\nvllm:request_success_total_created{{{l}}} {created:.9e}",
                    n as f64
                );
            }
        }
        for (h, name, help) in families {
            h.write(o, name, help, labels, created);
        }
    }

    fn json_response(&self, status: StatusCode, v: &Value) -> Response<RespBody> {
        let mut r = Response::new(full(v.to_string()));
        *r.status_mut() = status;
        let h = r.headers_mut();
        h.insert("content-type", hyper::header::HeaderValue::from_static("application/json"));
        self.name_header(h);
        r
    }

    fn name_header(&self, h: &mut hyper::HeaderMap) {
        if let Ok(v) = self.cfg.name.parse() {
            h.insert("x-pod-name", v);
        }
    }

    fn error(&self, status: StatusCode, msg: &str) -> Response<RespBody> {
        self.json_response(
            status,
            &json!({"error": {"message": msg, "type": "server_error", "code": status.as_u16()}}),
        )
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<RespBody> {
        let t0 = Instant::now();
        self.wait_while_hanging().await;
        let path = req.uri().path().to_string();
        match (req.method().clone(), path.as_str()) {
            (Method::GET, "/health") | (Method::GET, "/health/ready") => {
                if self.failed() {
                    self.error(StatusCode::SERVICE_UNAVAILABLE, "engine dead")
                } else if self.starting() {
                    self.error(StatusCode::SERVICE_UNAVAILABLE, "starting")
                } else {
                    let mut r = Response::new(full("OK"));
                    self.name_header(r.headers_mut());
                    r
                }
            }
            (Method::GET, "/metrics") => {
                let mut r = Response::new(full(self.metrics_text()));
                // A dead engine takes its API server down: vLLM's launcher shuts the server down
                // on EngineDeadError (unless VLLM_KEEP_ALIVE_ON_ENGINE_DEATH), SGLang kills its
                // process tree. So a health check on /metrics (Higress with store_metrics) must
                // fail as it would against a server that is gone. The body stays, for the bench's
                // own podsim_* counters (a health checker ignores the body of a failed probe).
                if self.failed() {
                    *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                }
                r.headers_mut().insert(
                    "content-type",
                    hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"),
                );
                self.name_header(r.headers_mut());
                r
            }
            (Method::GET, "/v1/models") => {
                let mut data =
                    vec![json!({"id": self.cfg.model, "object": "model", "owned_by": "podsim"})];
                for l in &self.cfg.loras {
                    data.push(json!({"id": l, "object": "model", "owned_by": "podsim", "parent": self.cfg.model}));
                }
                self.json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
            }
            (Method::POST, "/admin/flush") | (Method::POST, "/flush_cache") => {
                self.lock().sched.flush_cache();
                self.json_response(StatusCode::OK, &json!({"flushed": true}))
            }
            (Method::POST, "/admin/fault") => {
                let body =
                    req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                if let Some(r) = v.get("error_rate").and_then(Value::as_f64) {
                    self.lock().error_rate = r;
                }
                if let Some(h) = v.get("hang").and_then(Value::as_bool) {
                    self.hang.store(h, Ordering::Relaxed);
                }
                self.json_response(StatusCode::OK, &json!({"ok": true}))
            }
            (Method::POST, "/v1/chat/completions") => self.completion(req, Api::Chat, t0).await,
            (Method::POST, "/v1/completions") => self.completion(req, Api::Completions, t0).await,
            (Method::POST, "/v1/responses") => self.completion(req, Api::Responses, t0).await,
            _ => self.error(StatusCode::NOT_FOUND, "not found"),
        }
    }

    async fn completion(
        self: Arc<Self>,
        req: Request<Incoming>,
        api: Api,
        t0: Instant,
    ) -> Response<RespBody> {
        if self.failed() {
            return self.error(StatusCode::SERVICE_UNAVAILABLE, "engine dead");
        }
        if self.starting() {
            return self.error(StatusCode::SERVICE_UNAVAILABLE, "starting");
        }
        let body = match req.into_body().collect().await {
            Ok(b) => b.to_bytes(),
            Err(_) => return self.error(StatusCode::BAD_REQUEST, "unreadable body"),
        };
        let v: Value = match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => return self.error(StatusCode::BAD_REQUEST, &format!("invalid JSON: {e}")),
        };
        let mut to_store = None;
        let prompt = match api {
            Api::Chat => {
                let Some(msgs) = v.get("messages").and_then(Value::as_array) else {
                    return self.error(StatusCode::BAD_REQUEST, "messages missing");
                };
                let messages: Vec<Message> = msgs
                    .iter()
                    .map(|m| Message {
                        role: m.get("role").and_then(Value::as_str).unwrap_or("user").to_string(),
                        content: content_text(m.get("content")),
                    })
                    .collect();
                chat_prompt_tokens(&messages, tools_text(&v).as_deref())
            }
            Api::Responses => {
                // A stored response this request continues: its conversation comes first.
                let previous =
                    v.get("previous_response_id").and_then(Value::as_str).filter(|s| !s.is_empty());
                let mut messages = Vec::new();
                if let Some(id) = previous {
                    let stored = self.responses.lock().unwrap_or_else(|e| e.into_inner()).get(id);
                    let Some(stored) = stored else {
                        let msg = format!("Response with id '{id}' not found.");
                        return self.json_response(
                            StatusCode::NOT_FOUND,
                            &json!({"error": {"message": msg, "type": "invalid_request_error",
                                "param": "previous_response_id", "code": 404}}),
                        );
                    };
                    messages = stored;
                }
                match responses_messages(&v) {
                    Some(new) => messages.extend(new),
                    None if previous.is_some() => {}
                    None => return self.error(StatusCode::BAD_REQUEST, "input missing"),
                }
                if v.get("store").and_then(Value::as_bool) != Some(false) {
                    to_store = Some(ToStore {
                        store: self.responses.clone(),
                        conversation: messages.clone(),
                    });
                }
                chat_prompt_tokens(&messages, tools_text(&v).as_deref())
            }
            Api::Completions => match v.get("prompt") {
                Some(Value::String(s)) => tokenize(s),
                Some(Value::Array(a)) => {
                    tokenize(&a.iter().filter_map(Value::as_str).collect::<Vec<_>>().join("\n"))
                }
                _ => return self.error(StatusCode::BAD_REQUEST, "prompt missing"),
            },
        };
        let max_tokens = v
            .get("max_completion_tokens")
            .or_else(|| v.get("max_tokens"))
            .or_else(|| v.get("max_output_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(128) as usize;
        let seed = v.get("seed").and_then(Value::as_u64).unwrap_or_else(|| hash_tokens(&prompt));
        let model = v.get("model").and_then(Value::as_str).unwrap_or(&self.cfg.model).to_string();
        let adapter = self.cfg.loras.iter().find(|l| **l == model).cloned();
        let prompt = scoped(prompt, adapter.as_deref(), &v);
        let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
        let ignore_eos = v.get("ignore_eos").and_then(Value::as_bool).unwrap_or(false);
        let include_usage =
            v.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);

        {
            let mut st = self.lock();
            let rate = st.error_rate;
            if rate > 0.0 && st.error_rng.next_f64() < rate {
                drop(st);
                return self.error(StatusCode::INTERNAL_SERVER_ERROR, "injected server error");
            }
        }
        // On a blocking-pool thread: precise, unlike tokio's timer (see `sleep_until_precisely`).
        let overhead = Instant::now() + scaled(self.cfg.api_overhead_ms, self.cfg.time_scale);
        let _ = tokio::task::spawn_blocking(move || sleep_until_precisely(overhead)).await;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let id = {
            let mut st = self.lock();
            let id = st.next_id;
            st.next_id += 1;
            st.senders.insert(id, tx);
            st.sched.submit(engine::Request { id, prompt, max_tokens, seed, adapter, ignore_eos });
            id
        };
        self.notify.notify_one();
        let created =
            SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let rid = format!("{}-{}-{id}", api.id_prefix(), self.cfg.name);
        if stream {
            let mut r = Response::new(
                SseBody {
                    rx,
                    api,
                    include_usage,
                    id: rid,
                    model,
                    created,
                    first: true,
                    finished: false,
                    sequence: 0,
                    text: String::new(),
                    to_store,
                }
                .boxed(),
            );
            let h = r.headers_mut();
            h.insert("content-type", hyper::header::HeaderValue::from_static("text/event-stream"));
            h.insert("cache-control", hyper::header::HeaderValue::from_static("no-cache"));
            self.name_header(h);
            self.time_header(h, t0);
            return r;
        }
        let mut text = String::new();
        let mut usage = Usage::default();
        let mut finish = Finish::Length;
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Token(t) => text.push_str(&t),
                Event::Done(u, f) => {
                    usage = u;
                    finish = f;
                    break;
                }
            }
        }
        if let Some(to_store) = to_store {
            to_store.answered(&rid, &text);
        }
        let v = match api {
            Api::Responses => response_object(&rid, &model, created, &text, finish, Some(&usage)),
            Api::Chat | Api::Completions => {
                let reason = finish.as_str();
                let choice = if api == Api::Chat {
                    json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason})
                } else {
                    json!({"index": 0, "text": text, "finish_reason": reason})
                };
                json!({
                    "id": rid, "object": if api == Api::Chat { "chat.completion" } else { "text_completion" },
                    "created": created, "model": model, "choices": [choice], "usage": usage_json(&usage),
                })
            }
        };
        let mut r = self.json_response(StatusCode::OK, &v);
        self.time_header(r.headers_mut(), t0);
        r
    }

    fn time_header(&self, h: &mut hyper::HeaderMap, t0: Instant) {
        let ms = t0.elapsed().as_secs_f64() * 1000.0;
        if let Ok(v) = format!("{ms:.3}").parse() {
            h.insert("x-pod-time-ms", v);
        }
    }
}

/// The OpenAI API a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// `/v1/responses`: `instructions` and `input` items in, typed events out.
    Responses,
}

impl Api {
    fn id_prefix(self) -> &'static str {
        match self {
            Api::Chat => "chatcmpl",
            Api::Completions => "cmpl",
            Api::Responses => "resp",
        }
    }
}

fn content_text(c: Option<&Value>) -> String {
    match c {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// The prompt as the prefix cache sees it. vLLM hashes a request's LoRA adapter and `cache_salt`
/// into its KV blocks, and SGLang keys its radix tree by them (and by `extra_key`): the same
/// tokens under another adapter or salt share no cached page. Each token of a scoped prompt is
/// XORed with the scope's hash, so the radix tree holds each scope's pages apart; a request for
/// the base model without a salt is not scoped.
fn scoped(mut prompt: Vec<u32>, adapter: Option<&str>, body: &Value) -> Vec<u32> {
    let salt = |name: &str| body.get(name).filter(|v| !v.is_null()).map(Value::to_string);
    let parts = [adapter.map(str::to_string), salt("cache_salt"), salt("extra_key")];
    if parts.iter().all(Option::is_none) {
        return prompt;
    }
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    parts.hash(&mut hasher);
    // Never 0: XOR with 0 would leave the prompt in the unscoped cache.
    let scope = hasher.finish() as u32 | 1;
    for t in &mut prompt {
        *t ^= scope;
    }
    prompt
}

/// The `tools` list as the chat template renders it (its JSON text), if any.
fn tools_text(v: &Value) -> Option<String> {
    v.get("tools").filter(|t| !t.is_null()).map(Value::to_string)
}

/// A Responses API request as the conversation the chat template renders: `instructions` as the
/// system message, a string `input` as one user message, and each `input` item as a message: a
/// message item by its role, a tool's output (`function_call_output`) as a `tool` message. The
/// calls themselves are not rendered, as the chat path does not render `tool_calls`, so the same
/// conversation costs the same tokens on either API. `None` without `input`.
fn responses_messages(v: &Value) -> Option<Vec<Message>> {
    let mut messages = Vec::new();
    if let Some(instructions) = v.get("instructions").and_then(Value::as_str) {
        messages.push(Message { role: "system".into(), content: instructions.to_string() });
    }
    match v.get("input")? {
        Value::String(text) => {
            messages.push(Message { role: "user".into(), content: text.clone() })
        }
        Value::Array(items) => {
            for item in items {
                let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
                if let Some(role) = item.get("role").and_then(Value::as_str) {
                    let content = content_text(item.get("content"));
                    messages.push(Message { role: role.to_string(), content });
                } else if kind.ends_with("_call_output") {
                    let content = content_text(item.get("output"));
                    messages.push(Message { role: "tool".into(), content });
                }
            }
        }
        _ => return None,
    }
    Some(messages)
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// The Responses API's usage object (its own names for the chat API's figures).
fn responses_usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// A Responses API `response` object: `usage` None while it is still in progress.
fn response_object(
    id: &str,
    model: &str,
    created: u64,
    text: &str,
    finish: Finish,
    usage: Option<&Usage>,
) -> Value {
    let (status, incomplete) = match (usage, finish) {
        (None, _) => ("in_progress", Value::Null),
        (Some(_), Finish::Stop) => ("completed", Value::Null),
        (Some(_), Finish::Length) => ("incomplete", json!({"reason": "max_output_tokens"})),
    };
    let output =
        if usage.is_some() { json!([response_message(id, text, "completed")]) } else { json!([]) };
    json!({
        "id": id, "object": "response", "created_at": created, "model": model,
        "status": status, "incomplete_details": incomplete, "output": output,
        "usage": usage.map(responses_usage_json),
    })
}

/// The one output message of a response.
fn response_message(id: &str, text: &str, status: &str) -> Value {
    json!({
        "type": "message", "id": format!("msg_{id}"), "role": "assistant", "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    })
}

/// Server-sent events body fed by the scheduler; coalesces tokens that are already queued.
struct SseBody {
    rx: mpsc::UnboundedReceiver<Event>,
    api: Api,
    include_usage: bool,
    id: String,
    model: String,
    created: u64,
    first: bool,
    finished: bool,
    /// Responses API: the events' `sequence_number` so far.
    sequence: u64,
    /// Responses API: the text so far (its closing events repeat it).
    text: String,
    /// Responses API: the conversation to store with the answer (`store` not false).
    to_store: Option<ToStore>,
}

impl SseBody {
    fn chunk(&self, out: &mut String, choices: Value, usage: Option<Value>) {
        let mut v = json!({
            "id": self.id,
            "object": if self.api == Api::Chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created, "model": self.model, "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        out.push_str("data: ");
        out.push_str(&v.to_string());
        out.push_str("\n\n");
    }

    /// One typed Responses API event (`event:` line, then its JSON with `type` and
    /// `sequence_number`).
    fn event(&mut self, out: &mut String, kind: &str, mut v: Value) {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        out.push_str("event: ");
        out.push_str(kind);
        out.push_str("\ndata: ");
        out.push_str(&v.to_string());
        out.push_str("\n\n");
    }

    fn format(&mut self, ev: Event, out: &mut String) {
        if self.api == Api::Responses {
            return self.format_responses(ev, out);
        }
        let chat = self.api == Api::Chat;
        match ev {
            Event::Token(t) => {
                let choice = if chat {
                    let delta = if self.first {
                        json!({"role": "assistant", "content": t})
                    } else {
                        json!({"content": t})
                    };
                    json!([{"index": 0, "delta": delta, "finish_reason": null}])
                } else {
                    json!([{"index": 0, "text": t, "finish_reason": null}])
                };
                self.first = false;
                self.chunk(out, choice, None);
            }
            Event::Done(u, finish) => {
                let reason = finish.as_str();
                let choice = if chat {
                    json!([{"index": 0, "delta": {}, "finish_reason": reason}])
                } else {
                    json!([{"index": 0, "text": "", "finish_reason": reason}])
                };
                self.chunk(out, choice, None);
                if self.include_usage {
                    self.chunk(out, json!([]), Some(usage_json(&u)));
                }
                out.push_str("data: [DONE]\n\n");
                self.finished = true;
            }
        }
    }

    /// The Responses API's stream: `response.created`, the output item and its text deltas, and
    /// `response.completed` (or `response.incomplete`) carrying the usage. No `[DONE]`.
    fn format_responses(&mut self, ev: Event, out: &mut String) {
        let item_id = format!("msg_{}", self.id);
        if self.first {
            self.first = false;
            let response =
                response_object(&self.id, &self.model, self.created, "", Finish::Stop, None);
            self.event(out, "response.created", json!({"response": response}));
            let item = response_message(&self.id, "", "in_progress");
            self.event(out, "response.output_item.added", json!({"output_index": 0, "item": item}));
        }
        match ev {
            Event::Token(t) => {
                self.text.push_str(&t);
                self.event(
                    out,
                    "response.output_text.delta",
                    json!({"item_id": item_id, "output_index": 0, "content_index": 0, "delta": t}),
                );
            }
            Event::Done(u, finish) => {
                let text = std::mem::take(&mut self.text);
                if let Some(to_store) = self.to_store.take() {
                    // Stored before the client can read the id and send the next request.
                    to_store.answered(&self.id, &text);
                }
                self.event(
                    out,
                    "response.output_text.done",
                    json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": text}),
                );
                let item = response_message(&self.id, &text, "completed");
                self.event(
                    out,
                    "response.output_item.done",
                    json!({"output_index": 0, "item": item}),
                );
                let response =
                    response_object(&self.id, &self.model, self.created, &text, finish, Some(&u));
                let kind = match finish {
                    Finish::Stop => "response.completed",
                    Finish::Length => "response.incomplete",
                };
                self.event(out, kind, json!({"response": response}));
                self.finished = true;
            }
        }
    }
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        let mut buf = String::new();
        while !this.finished && buf.len() < 64 * 1024 {
            match this.rx.poll_recv(cx) {
                Poll::Ready(Some(ev)) => this.format(ev, &mut buf),
                Poll::Ready(None) => this.finished = true,
                Poll::Pending => break,
            }
        }
        if !buf.is_empty() {
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(buf)))))
        } else if this.finished {
            Poll::Ready(None)
        } else {
            Poll::Pending
        }
    }
}

/// Binds `addr` and serves `pod` on it; returns the bound address. Spawns the accept loop on the
/// current tokio runtime and the scheduler loop on a thread of its own, whose step sleeps block it
/// (see `sleep_until_precisely`).
pub async fn serve(pod: Arc<Pod>, addr: SocketAddr) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let scheduler = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
    let driven = pod.clone();
    std::thread::Builder::new()
        .name(format!("pod-{}-steps", pod.cfg.index))
        .spawn(move || scheduler.block_on(driven.drive()))?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let _ = stream.set_nodelay(true);
            let pod = pod.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let pod = pod.clone();
                    async move { Ok::<_, Infallible>(pod.handle(req).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok(local)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Sends one raw HTTP/1.0 request; the whole response.
    async fn exchange(addr: SocketAddr, request: String) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(request.as_bytes()).await.expect("write");
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.expect("read");
        String::from_utf8_lossy(&buf).into_owned()
    }

    async fn get_status(addr: SocketAddr, path: &str) -> u16 {
        let text = exchange(addr, format!("GET {path} HTTP/1.0\r\n\r\n")).await;
        text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
    }

    fn pod_config(flavor: Flavor, faults: Faults) -> PodConfig {
        PodConfig {
            index: 0,
            name: "pod-0".into(),
            model: "m".into(),
            flavor,
            engine: EngineConfig::default(),
            time_scale: 0.1,
            api_overhead_ms: 0.0,
            loras: vec![],
            max_lora: 0,
            faults,
        }
    }

    /// What a gateway's health check stores: a served request shows in the histograms, and the
    /// body has the size of a real engine's (vLLM's tens of KB).
    #[tokio::test]
    async fn metrics_carry_the_served_requests_histograms() {
        for (flavor, ttft, min_bytes) in [
            (Flavor::VllmV1, "vllm:time_to_first_token_seconds", 26_000),
            (Flavor::VllmV0, "vllm:time_to_first_token_seconds", 22_000),
            (Flavor::Sglang, "sglang:time_to_first_token_seconds", 5_000),
        ] {
            let pod = Pod::new(pod_config(flavor, Faults::default()));
            let addr = serve(pod, "127.0.0.1:0".parse().expect("addr")).await.expect("serve");
            let body = r#"{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":5}"#;
            let reply = exchange(
                addr,
                format!(
                    "POST /v1/chat/completions HTTP/1.0\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                ),
            )
            .await;
            assert!(reply.starts_with("HTTP/1.0 200"), "{flavor:?}: {reply}");
            let metrics = exchange(addr, "GET /metrics HTTP/1.0\r\n\r\n".into()).await;
            let count = metrics
                .lines()
                .find(|l| l.starts_with(&format!("{ttft}_count{{")))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse::<f64>().ok());
            assert_eq!(count, Some(1.0), "{flavor:?}: one request's first token");
            let body = metrics.split_once("\r\n\r\n").map_or("", |(_, b)| b);
            assert!(body.len() >= min_bytes, "{flavor:?}: {} bytes", body.len());
            // The plugin reads the idle pod's gauges among the histograms.
            let read = ai_load_balancer::metrics::prometheus::parse(body.as_bytes(), None);
            assert_eq!((read.running, read.waiting), (Some(0.0), Some(0.0)), "{flavor:?}");
            assert_eq!(read.kv_cache_usage, Some(0.0), "{flavor:?}");
        }
    }

    /// Posts `body` to `path`; the status and the response body.
    async fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
        let text = exchange(
            addr,
            format!(
                "POST {path} HTTP/1.0\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            ),
        )
        .await;
        let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        (status, text.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string())
    }

    /// As vLLM: each LoRA adapter and each `cache_salt` has its own prefix cache; the base model's
    /// requests (under any name the pod does not serve as an adapter) share one.
    #[tokio::test]
    async fn adapters_and_salts_keep_their_prefix_caches_apart() {
        let mut config = pod_config(Flavor::VllmV1, Faults::default());
        config.loras = vec!["sql".into(), "chat".into()];
        config.max_lora = 2;
        let addr =
            serve(Pod::new(config), "127.0.0.1:0".parse().expect("addr")).await.expect("serve");
        let system = "you answer questions about the warehouse database ".repeat(80);
        let cached = |extra: Value| {
            let mut body = json!({"max_tokens": 2, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": "how many rows"}]});
            if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
                b.extend(e.clone());
            }
            async move {
                let (status, reply) = post(addr, "/v1/chat/completions", &body.to_string()).await;
                assert_eq!(status, 200, "{reply}");
                let reply: Value = serde_json::from_str(&reply).expect("JSON");
                reply["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)
            }
        };
        assert_eq!(cached(json!({"model": "m"})).await, 0, "a cold pod");
        assert!(cached(json!({"model": "base-alias"})).await > 400, "the base model's cache");
        assert_eq!(cached(json!({"model": "sql"})).await, 0, "another adapter's cache");
        assert!(cached(json!({"model": "sql"})).await > 400);
        assert_eq!(cached(json!({"model": "chat"})).await, 0);
        assert_eq!(cached(json!({"model": "sql", "cache_salt": "t1"})).await, 0, "a salted cache");
        assert!(cached(json!({"model": "sql", "cache_salt": "t1"})).await > 400);
        assert_eq!(cached(json!({"model": "sql", "cache_salt": "t2"})).await, 0);
        assert_eq!(cached(json!({"model": "m", "extra_key": "t1"})).await, 0, "SGLang's key");
        assert!(cached(json!({"model": "m"})).await > 400, "the base cache is still there");
    }

    /// A Responses API request is the chat request it stands for: the same prompt tokens, the
    /// same cache, the same reply; a stream ends with `response.completed` carrying the usage.
    #[tokio::test]
    async fn the_responses_api_serves_the_conversation_the_chat_api_does() {
        let pod = Pod::new(pod_config(Flavor::VllmV1, Faults::default()));
        let addr = serve(pod, "127.0.0.1:0".parse().expect("addr")).await.expect("serve");
        let chat = json!({"model": "m", "max_tokens": 6, "messages": [
            {"role": "system", "content": "you are a coding agent"},
            {"role": "user", "content": "build the project"},
            {"role": "assistant", "content": "running it", "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "run_command", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "error on line seven"},
        ]});
        let responses = json!({"model": "m", "max_output_tokens": 6,
        "instructions": "you are a coding agent",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "build the project"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "running it"}]},
            {"type": "function_call", "call_id": "c1", "name": "run_command", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "error on line seven"},
        ]});
        let (status, body) = post(addr, "/v1/chat/completions", &chat.to_string()).await;
        assert_eq!(status, 200, "{body}");
        let chat_reply: Value = serde_json::from_str(&body).expect("chat JSON");
        let (status, body) = post(addr, "/v1/responses", &responses.to_string()).await;
        assert_eq!(status, 200, "{body}");
        let reply: Value = serde_json::from_str(&body).expect("response JSON");
        assert_eq!(reply["object"], "response");
        let prompt = &chat_reply["usage"]["prompt_tokens"];
        assert_eq!(&reply["usage"]["input_tokens"], prompt, "{reply}");
        assert!(reply["usage"]["input_tokens_details"]["cached_tokens"].as_u64() > Some(0));
        assert_eq!(
            reply["output"][0]["content"][0]["text"],
            chat_reply["choices"][0]["message"]["content"],
            "the same prompt, the same reply"
        );
        assert_eq!(
            reply["status"],
            if chat_reply["choices"][0]["finish_reason"] == "stop" {
                "completed"
            } else {
                "incomplete"
            }
        );

        let mut streamed = responses.clone();
        streamed["stream"] = json!(true);
        let (status, body) = post(addr, "/v1/responses", &streamed.to_string()).await;
        assert_eq!(status, 200, "{body}");
        let events: Vec<Value> = body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str(d).ok())
            .collect();
        let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
        assert_eq!(kinds.first(), Some(&"response.created"), "{kinds:?}");
        let last = events.last().expect("events");
        assert!(
            ["response.completed", "response.incomplete"]
                .contains(&last["type"].as_str().unwrap_or("")),
            "{kinds:?}"
        );
        assert_eq!(&last["response"]["usage"]["input_tokens"], prompt);
        let text: String = events.iter().filter_map(|e| e["delta"].as_str()).collect();
        assert_eq!(json!(text), chat_reply["choices"][0]["message"]["content"]);
        let sequence: Vec<u64> =
            events.iter().filter_map(|e| e["sequence_number"].as_u64()).collect();
        assert_eq!(sequence, (0..events.len() as u64).collect::<Vec<_>>());
        assert!(!body.contains("[DONE]"), "the Responses API's stream has no [DONE]");

        let (status, _) = post(addr, "/v1/responses", r#"{"model":"m"}"#).await;
        assert_eq!(status, 400, "no input");
    }

    #[tokio::test]
    async fn a_pod_hangs_then_dies_on_its_timeline() {
        let faults = Faults {
            hang_after_s: Some(0.0),
            hang_for_s: Some(0.3),
            fail_after_s: Some(0.6),
            ..Faults::default()
        };
        let cfg = PodConfig { time_scale: 1.0, ..pod_config(Flavor::VllmV1, faults) };
        let addr = serve(Pod::new(cfg), "127.0.0.1:0".parse().expect("addr")).await.expect("serve");
        let t0 = Instant::now();
        assert_eq!(get_status(addr, "/health").await, 200, "answers once the hang is over");
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_millis(250), "hung for {waited:?}");
        assert_eq!(get_status(addr, "/metrics").await, 200, "a live engine serves its metrics");
        tokio::time::sleep(Duration::from_millis(700).saturating_sub(t0.elapsed())).await;
        assert_eq!(get_status(addr, "/health").await, 503, "dead engine fails its health check");
        assert_eq!(
            get_status(addr, "/metrics").await,
            503,
            "a dead engine's server is down, so a health check on /metrics fails too"
        );
    }
}
