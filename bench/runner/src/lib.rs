//! bench: runs a scenario's load-balancing policies (Redis + podsim pods + gateway replicas with
//! the plugin), each several times in interleaved order, and reports latency, throughput, hit
//! rates, balance and Redis cost as median with min–max over the repetitions.

pub mod aiperf;
pub mod chaos;
pub mod chart;
pub mod model;
pub mod overhead;
pub mod policy;
pub mod procs;
pub mod redis_cost;
pub mod routers;
pub mod scenario;
pub mod stats;
pub mod sweep;
pub mod tables;

use anyhow::{anyhow, Context, Result};
use loadgen::stats::{Dist, P50P99};
use policy::{ClientHeader, GatewayMode, Route};
use procs::{http_get, prom_value, redis_cmd, require, Proc, Redis, RedisUsage};
use scenario::Scenario;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use stats::{PolicyAggregate, Spread};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::process::Command;

/// Cluster names as Higress/Envoy spell them, the same as the end-to-end tests': the LLM service,
/// and the Redis cluster the plugin names in `proxy_redis_init` (serviceFQDN redis.static, port 6379).
pub use testkit::gateway::{LLM_CLUSTER, REDIS_CLUSTER};
/// Request header naming the upstream cluster in the `session_hash` baseline (Envoy
/// `cluster_header`): one cluster per pod, the client hashing the session onto them.
pub const SESSION_CLUSTER_HEADER: &str = "x-bench-session-cluster";

/// The name pod `i` reports in `x-pod-name` (podsim's default prefix).
pub fn pod_name(i: usize) -> String {
    format!("pod-{i}")
}

/// Cluster of pod `i` in the `session_hash` baseline.
pub fn pod_cluster(i: usize) -> String {
    format!("outbound|8000||pod-{i}.static")
}

/// Where the binaries and results live.
#[derive(Debug, Clone)]
pub struct Paths {
    /// Workspace root.
    pub root: PathBuf,
    /// target/release/podsim.
    pub podsim: PathBuf,
    /// target/release/gateway.
    pub gateway: PathBuf,
    /// The plugin .wasm: `$AI_LB_WASM`, else the tree's wasm-release build.
    pub wasm: PathBuf,
    /// bench/results.
    pub results: PathBuf,
}

impl Paths {
    /// Paths under workspace `root`.
    pub fn new(root: &Path) -> Paths {
        Paths {
            root: root.to_path_buf(),
            podsim: root.join("target/release/podsim"),
            gateway: root.join("target/release/gateway"),
            // `$AI_LB_WASM` as the tests and `build.sh` take it: another build of the plugin
            // (an A/B of two versions) without swapping the file in the tree.
            wasm: std::env::var_os("AI_LB_WASM").map(PathBuf::from).unwrap_or_else(|| {
                root.join("target/wasm32-wasip1/wasm-release/ai_load_balancer.wasm")
            }),
            results: root.join("bench/results"),
        }
    }
}

/// Results of one run of one policy (at one gateway replica count).
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct PolicyResult {
    /// Policy name.
    pub policy: String,
    /// Repetition (0-based).
    pub repetition: usize,
    /// Gateway replicas sharing one Redis.
    pub gateway_replicas: usize,
    /// Requests sent.
    pub requests: usize,
    /// Failed requests.
    pub errors: usize,
    /// Client TTFT, simulated ms.
    pub ttft_ms: Dist,
    /// Client end-to-end latency, simulated ms.
    pub e2e_ms: Dist,
    /// Generated tokens per simulated second.
    pub output_tokens_per_s: f64,
    /// Σcached / Σprompt tokens from the pods' counters.
    pub prefix_hit_rate: f64,
    /// Same from the responses' usage.
    pub client_hit_rate: f64,
    /// What a router knowing every cache could reach (same session or group seen before).
    pub oracle_hit_rate: f64,
    /// Requests on the busiest pod / mean requests per pod (pods' own counters).
    pub request_share_max_over_mean: f64,
    /// Time-weighted in-flight (running + waiting) requests: busiest pod / mean pod.
    pub inflight_max_over_mean: f64,
    /// Time-weighted mean in-flight requests per pod over the run.
    pub mean_inflight_per_pod: Vec<f64>,
    /// Peak in-flight (running + waiting) per pod.
    pub peak_inflight_per_pod: Vec<u64>,
    /// Requests served per pod (`x-pod-name` of the responses).
    pub requests_per_pod: BTreeMap<String, usize>,
    /// Redis script time per routed request (µs): `EVAL`/`EVALSHA` only, never the commands run
    /// inside them (listed again in commandstats, their time inside the script's).
    pub redis_usec_per_request: f64,
    /// Redis bytes in + out per routed request.
    pub redis_bytes_per_request: f64,
    /// Commands sent to Redis per routed request (scripts and `SCRIPT LOAD`; nothing run inside
    /// a script).
    #[serde(default)]
    pub redis_commands_per_request: f64,
    /// Redis main-thread CPU per routed request (µs, `INFO cpu` delta).
    #[serde(default)]
    pub redis_cpu_usec_per_request: f64,
    /// Whether Redis's idle CPU (measured just before the load) was taken off
    /// `redis_cpu_usec_per_request` (runs before this field: not).
    #[serde(default)]
    pub redis_cpu_idle_subtracted: bool,
    /// Bytes Redis read per routed request.
    #[serde(default)]
    pub redis_bytes_in_per_request: f64,
    /// Bytes Redis wrote per routed request.
    #[serde(default)]
    pub redis_bytes_out_per_request: f64,
    /// Client time-to-headers minus pod time, real ms.
    pub gateway_added_ms: P50P99,
    /// Time the gateways spent inside the plugin per routed request (real ms): every callback
    /// of every stream, tick and Redis or HTTP reply, the host calls the plugin made included
    /// (the gateways' `gateway_vm_call_seconds_total` over the load). None for competitor
    /// routers and runs before this field.
    #[serde(default)]
    pub plugin_ms_per_request: Option<f64>,
    /// `plugin_ms_per_request` by phase of [`PLUGIN_PHASES`] (empty for competitor routers and
    /// runs before this field).
    #[serde(default)]
    pub plugin_ms_by_phase: BTreeMap<String, f64>,
    /// Of the requests `prefix_cache` routed as prefix hits, the share whose engine reported no
    /// cached token (the gateways' `ai_lb_predicted_hit_engine_*` counters): hits the router
    /// promised and the pod could not serve. None for other policies, runs without a predicted
    /// hit, and runs before this field.
    #[serde(default)]
    pub predicted_hits_missed: Option<f64>,
    /// Wall-clock seconds of the load.
    pub wall_s: f64,
    /// Offered load of an open-loop sweep point (sessions per simulated second); None for the
    /// scenario's own arrivals.
    #[serde(default)]
    pub offered_sessions_per_s: Option<f64>,
    /// Per-pod requests in flight over the run (client view; wall seconds).
    #[serde(default)]
    pub load_series: stats::LoadSeries,
    /// With a health check: seconds into the load when the gateway first marked a pod
    /// Unhealthy (polled from its admin `/clusters` every 20 ms); None if it never did.
    #[serde(default)]
    pub marked_unhealthy_at_s: Option<f64>,
    /// Whether the mark was watched (runs before this field: not; their split is unknown).
    #[serde(default)]
    pub mark_watched: bool,
    /// Failed requests sent once that mark was made (the pod-failure goal: zero).
    #[serde(default)]
    pub errors_after_mark: usize,
    /// Every failed request: when it started and ended and why (pod-failure analysis).
    #[serde(default)]
    pub failures: Vec<Failure>,
    /// With `redis_freeze`: TTFT p90 (simulated ms) of the successful requests sent while Redis
    /// was frozen, and how many there were.
    #[serde(default)]
    pub outage_ttft_p90_ms: Option<f64>,
    /// Successful requests sent while Redis was frozen.
    #[serde(default)]
    pub outage_requests: usize,
    /// With `scale_out`: how the requests sent after the new pods came were served.
    #[serde(default)]
    pub after_scale_out: Option<AfterScaleOut>,
    /// TTFTs (simulated ms), for the chart.
    #[serde(skip)]
    pub ttfts: Vec<f64>,
}

/// One failed request.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Failure {
    /// Start, seconds into the load (wall clock).
    pub start_s: f64,
    /// End, seconds into the load (wall clock).
    pub end_s: f64,
    /// The client's error text (first 120 characters).
    pub error: String,
}

/// TTFT (simulated ms, as in [`PolicyResult::ttfts`]) of the successful requests sent while
/// Redis was frozen.
fn outage_ttfts(records: &[loadgen::RequestRecord], f: scenario::RedisFreeze, ts: f64) -> Vec<f64> {
    records
        .iter()
        .filter(|r| r.start_s >= f.at_s && r.start_s < f.at_s + f.for_s)
        .filter_map(|r| simulated_ttft(r, ts))
        .collect()
}

/// A successful request's TTFT in simulated ms: the pods' part of it scaled back to their clock
/// (`ts`), the gateway's own added time kept as measured, as [`loadgen::summarize`] does.
fn simulated_ttft(r: &loadgen::RequestRecord, ts: f64) -> Option<f64> {
    if r.error.is_some() {
        return None;
    }
    let gw = r.gateway_added_ms.unwrap_or(0.0);
    r.ttft_ms.map(|v| (v - gw.clamp(0.0, v)) / ts + gw.clamp(0.0, v))
}

/// How the requests sent after a scale-out were served.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct AfterScaleOut {
    /// Successful requests sent once every router knew the new pods.
    pub requests: usize,
    /// Their TTFT mean (simulated ms).
    pub ttft_mean_ms: f64,
    /// Their TTFT p90 (simulated ms).
    pub ttft_p90_ms: f64,
    /// The share of them the new pods served.
    pub new_pods_share: f64,
}

impl AfterScaleOut {
    /// Of `records`, the successful requests sent `since_s` or later into the load; the new
    /// pods are the ones named in `new_pods` (`x-pod-name`). None when there was no such request.
    pub fn of(
        records: &[loadgen::RequestRecord],
        since_s: f64,
        new_pods: &[String],
        ts: f64,
    ) -> Option<AfterScaleOut> {
        let after: Vec<&loadgen::RequestRecord> =
            records.iter().filter(|r| r.start_s >= since_s && r.error.is_none()).collect();
        let ttfts: Vec<f64> = after.iter().filter_map(|r| simulated_ttft(r, ts)).collect();
        if after.is_empty() || ttfts.is_empty() {
            return None;
        }
        let on_new =
            after.iter().filter(|r| r.pod.as_ref().is_some_and(|p| new_pods.contains(p))).count();
        let d = loadgen::stats::dist(&ttfts);
        Some(AfterScaleOut {
            requests: after.len(),
            ttft_mean_ms: d.mean,
            ttft_p90_ms: d.p90,
            new_pods_share: on_new as f64 / after.len() as f64,
        })
    }
}

/// The routers a scale-out tells about the new pods.
enum ScaleTarget {
    /// Our gateways' admin addresses: each gets the LLM cluster's whole new endpoint list, as
    /// an xDS update gives Envoy.
    Gateways(Vec<String>),
    /// Competitor routers' addresses: each registers the new pods through its worker API.
    Routers(policy::Router, Vec<String>),
}

/// `s.at_s` after `t0`, tells `target` that the LLM service now has `pods` (the new ones are
/// `pods[s.initial_pods..]`); returns when they all knew, in seconds since `t0`.
async fn scale_out(
    target: ScaleTarget,
    pods: Vec<String>,
    s: scenario::ScaleOut,
    t0: Instant,
) -> Result<f64> {
    tokio::time::sleep_until((t0 + Duration::from_secs_f64(s.at_s.max(0.0))).into()).await;
    let new = pods.get(s.initial_pods..).unwrap_or_default();
    match &target {
        ScaleTarget::Gateways(admins) => {
            let path = format!("/clusters/{}/endpoints", testkit::gateway::url_encode(LLM_CLUSTER));
            for a in admins {
                let addr: std::net::SocketAddr = a.parse()?;
                let req = testkit::http::HttpRequest::post_json(&path, &json!(pods));
                let resp = testkit::http::send(addr, req, Duration::from_secs(10)).await?;
                if resp.status != 200 {
                    return Err(anyhow!(
                        "gateway admin {a}: setting {LLM_CLUSTER}'s endpoints: status {} {:?}",
                        resp.status,
                        resp.text()
                    ));
                }
            }
        }
        ScaleTarget::Routers(router, addrs) => {
            for a in addrs {
                for pod in new {
                    routers::add_worker(*router, a, pod).await?;
                }
            }
        }
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// Freezes Redis (SIGSTOP) `f.at_s` into the load and thaws it (SIGCONT) `f.for_s` later.
async fn freeze_redis(pid: u32, f: scenario::RedisFreeze) -> Result<()> {
    let signal = |sig: &str| -> Result<()> {
        let st = std::process::Command::new("kill").args([sig, &pid.to_string()]).status()?;
        if !st.success() {
            return Err(anyhow!("kill {sig} {pid} failed"));
        }
        Ok(())
    };
    tokio::time::sleep(Duration::from_secs_f64(f.at_s.max(0.0))).await;
    signal("-STOP")?;
    tokio::time::sleep(Duration::from_secs_f64(f.for_s.max(0.0))).await;
    signal("-CONT")
}

/// Polls the gateways' admin `/clusters` until `stop`; returns when one of them first showed an
/// endpoint Unhealthy, measured from `t0`.
async fn watch_first_unhealthy(
    admins: Vec<String>,
    t0: Instant,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> Option<f64> {
    use std::sync::atomic::Ordering;
    while !stop.load(Ordering::Relaxed) {
        for a in &admins {
            let Ok(text) = http_get(a, "/clusters").await else { continue };
            let Ok(v) = serde_json::from_str::<Value>(&text) else { continue };
            let unhealthy = v.as_array().into_iter().flatten().any(|c| {
                c["name"].as_str() != Some(REDIS_CLUSTER)
                    && c["endpoints"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|e| e["health_status"].as_str() == Some("Unhealthy"))
            });
            if unhealthy {
                return Some(t0.elapsed().as_secs_f64());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Where the plugin's time goes: the callbacks a gateway counts
/// (`gateway_vm_callback_seconds_total{callback}`), grouped by the part of a request's life, or
/// the background work, that calls them.
pub const PLUGIN_PHASES: [(&str, &[&str]); 5] = [
    (
        "request",
        &[
            "proxy_on_context_create",
            "proxy_on_request_headers",
            "proxy_on_request_body",
            "proxy_on_request_trailers",
        ],
    ),
    ("Redis replies", &["proxy_on_redis_call_response"]),
    ("response", &["proxy_on_response_headers", "proxy_on_response_body"]),
    ("stream end", &["proxy_on_log", "proxy_on_done", "proxy_on_delete"]),
    ("background", &["proxy_on_tick", "proxy_on_http_call_response", "proxy_on_queue_ready"]),
];

/// Seconds the gateways have spent inside the plugin so far, in all and per phase of
/// [`PLUGIN_PHASES`] (None from a gateway without per-callback counts).
#[derive(Debug, Clone, Copy, PartialEq)]
struct PluginSeconds {
    total: f64,
    phases: Option<[f64; PLUGIN_PHASES.len()]>,
}

/// The `/stats` text of each gateway behind `admins`; None when one of them did not answer.
async fn gateway_stats(admins: &[String]) -> Option<Vec<String>> {
    let mut texts = Vec::with_capacity(admins.len());
    for a in admins {
        texts.push(http_get(a, "/stats").await.ok()?);
    }
    Some(texts)
}

/// The plugin time in the gateways' `stats`, summed; None when there is no gateway (a
/// competitor router).
fn plugin_seconds(stats: &[String]) -> Option<PluginSeconds> {
    if stats.is_empty() {
        return None;
    }
    let mut sum = PluginSeconds { total: 0.0, phases: Some([0.0; PLUGIN_PHASES.len()]) };
    for text in stats {
        sum.total += prom_value(text, "gateway_vm_call_seconds_total")?;
        if !text.contains("# TYPE gateway_vm_callback_seconds_total ") {
            sum.phases = None;
        }
        let Some(phases) = sum.phases.as_mut() else { continue };
        for ((_, callbacks), phase) in PLUGIN_PHASES.iter().zip(phases) {
            *phase += callbacks
                .iter()
                .filter_map(|c| {
                    let sample = format!("gateway_vm_callback_seconds_total{{callback=\"{c}\"}}");
                    prom_value(text, &sample)
                })
                .sum::<f64>();
        }
    }
    Some(sum)
}

/// Of the predicted hits the gateways (their `stats`) checked against the engines' reports, the
/// share the engine found nothing cached for; None without a gateway or a checked hit.
fn predicted_hits_missed(stats: &[String]) -> Option<f64> {
    let (mut served, mut missed) = (0.0, 0.0);
    for text in stats {
        served += prom_value(text, "ai_lb_predicted_hit_engine_hit").unwrap_or(0.0);
        missed += prom_value(text, "ai_lb_predicted_hit_engine_miss").unwrap_or(0.0);
    }
    (served + missed > 0.0).then(|| missed / (served + missed))
}

/// When, from what and where a report was made.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Stamp {
    /// Unix time at the end of the run.
    pub unix_time: u64,
    /// `git describe --always --dirty` of the source tree.
    pub commit: String,
    /// Host name, CPU model and core count.
    pub machine: String,
}

impl Stamp {
    /// The stamp for now, the tree at `root` and this machine.
    pub fn now(root: &Path) -> Stamp {
        let commit = std::process::Command::new("git")
            .args(["describe", "--always", "--dirty", "--abbrev=12"])
            .current_dir(root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_else(|| "unknown".into());
        let host = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|t| {
                t.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown CPU".into());
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
        Stamp {
            unix_time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            commit,
            machine: format!("{} ({cpu}, {cores} cores)", host.trim()),
        }
    }
}

#[cfg(test)]
impl Stamp {
    /// The stamp of the test reports: 2026-11-24 07:49 UTC, commit `abc123`, machine `vm`.
    pub(crate) fn example() -> Stamp {
        Stamp { unix_time: 1_795_506_556, commit: "abc123".into(), machine: "vm".into() }
    }
}

/// The whole report written to bench/results/<scenario>.json.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Scenario name.
    pub scenario: String,
    /// Scenario description.
    pub description: String,
    /// Date, commit and machine.
    pub stamp: Stamp,
    /// Pods' time scale.
    pub time_scale: f64,
    /// The scenario as run.
    pub config: Scenario,
    /// One entry per (replicas, policy): median with min–max over the repetitions.
    pub policies: Vec<PolicyAggregate>,
    /// Every run, in the order they were made.
    pub runs: Vec<PolicyResult>,
}

/// Our gateway's configuration for `policy` (a [`Route::Gateway`] entry) over `pods`.
pub fn gateway_config(
    paths: &Paths,
    sc: &Scenario,
    policy: &policy::Policy,
    pods: &[String],
    redis: &str,
) -> Result<Value> {
    let Route::Gateway(mode) = policy.route else {
        return Err(anyhow!("policy {} is not run by our gateway", policy.name));
    };
    // The interval follows the pods' clock (simulated ms); the timeout stays real time, as it
    // bounds the gateway's and the machine's own delays.
    let interval_ms = sc.gateway_health_interval_ms();
    let health = sc.health_check.then(|| {
        json!({"path": "/health", "interval_ms": interval_ms, "timeout_ms": 1000,
            "unhealthy_threshold": 3, "healthy_threshold": 1})
    });
    if mode == GatewayMode::SessionHash {
        // No plugin: one cluster per pod, picked by the header the client derives from the
        // session (what a hash-on-session load balancer gives).
        let clusters: Vec<Value> = pods
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut c = json!({"name": pod_cluster(i), "endpoints": [p]});
                if let Some(h) = &health {
                    c["health_check"] = h.clone();
                }
                c
            })
            .collect();
        return Ok(json!({
            "listeners": [{"name": "main", "address": "127.0.0.1:0"}],
            "admin": {"address": "127.0.0.1:0"},
            "routes": [{"name": "llm-route", "match": {"prefix": "/"},
                "cluster_header": SESSION_CLUSTER_HEADER, "timeout_ms": 600000}],
            "clusters": clusters,
        }));
    }
    let mut llm = json!({"name": LLM_CLUSTER, "lb_policy": "round_robin", "endpoints": pods});
    if let Some(h) = health {
        llm["health_check"] = h;
    }
    if policy.scrapes_metrics() {
        // Like Higress: the health checker keeps each pod's /metrics body for the plugin.
        llm["health_check"] = json!({"path": "/metrics", "interval_ms": interval_ms, "timeout_ms": 1000,
            "unhealthy_threshold": 3, "healthy_threshold": 1, "store_metrics": true});
    }
    let mut cfg = json!({
        "listeners": [{"name": "main", "address": "127.0.0.1:0"}],
        "admin": {"address": "127.0.0.1:0"},
        "routes": [{"name": "llm-route", "match": {"prefix": "/"}, "cluster": LLM_CLUSTER, "timeout_ms": 600000}],
        "clusters": [llm, {"name": REDIS_CLUSTER, "endpoints": [redis]}],
    });
    if let Some((lb_policy, lb)) = policy.gateway_plugin(&sc.lb_config)? {
        cfg["plugin"] = json!({
            "wasm": paths.wasm.to_string_lossy(), "name": "ai-load-balancer", "root_id": "", "vm_id": "",
            "configuration": {"lb_policy": lb_policy, "lb_config": lb},
        });
    }
    Ok(cfg)
}

/// Starts `count` pods; returns the process and their addresses.
pub async fn start_pods(paths: &Paths, sc: &Scenario) -> Result<(Proc, Vec<String>)> {
    require(&paths.podsim, "build it: cargo build --release -p podsim")?;
    let mut cmd = Command::new(&paths.podsim);
    cmd.args(["--pods", &sc.pods.count.to_string()])
        .args(["--time-scale", &sc.time_scale.to_string()])
        .args(["--model", &sc.model])
        .args(["--flavor", &sc.pods.flavor])
        .args(["--kv-capacity-tokens", &sc.pods.kv_capacity_tokens.to_string()])
        .args(["--max-running", &sc.pods.max_running.to_string()])
        .args(["--profile", &sc.pods.profile])
        .args(["--eos-mean-tokens", &sc.pods.eos_mean_tokens.to_string()]);
    if !sc.pods.speed.is_empty() {
        let speeds: Vec<String> = sc.pods.speed.iter().map(f64::to_string).collect();
        cmd.args(["--speed", &speeds.join(",")]);
    }
    cmd.args(&sc.pods.args);
    let p = Proc::spawn_until_ready(cmd, "podsim", Duration::from_secs(30)).await?;
    let addrs: Vec<String> =
        p.lines_with("POD ").into_iter().filter_map(|v| v.get(1).cloned()).collect();
    if addrs.len() != sc.pods.count {
        return Err(anyhow!("podsim printed {} pods, expected {}", addrs.len(), sc.pods.count));
    }
    Ok((p, addrs))
}

/// Starts one gateway replica for `policy`; returns it and its listener address.
pub async fn start_gateway(
    paths: &Paths,
    sc: &Scenario,
    policy: &str,
    pods: &[String],
    redis: &str,
    tag: &str,
) -> Result<(Proc, String)> {
    require(&paths.gateway, "build it: cargo build --release -p gateway")?;
    let policy = policy::lookup(policy)?;
    if !matches!(policy.route, Route::Gateway(GatewayMode::RoundRobin | GatewayMode::SessionHash)) {
        require(&paths.wasm, "build it: cargo build --target wasm32-wasip1 --profile wasm-release -p ai-load-balancer")?;
    }
    let dir = std::env::temp_dir().join(format!("bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join(format!("gateway-{tag}.yaml"));
    // JSON is valid YAML.
    std::fs::write(
        &file,
        serde_json::to_string_pretty(&gateway_config(paths, sc, policy, pods, redis)?)?,
    )?;
    let mut cmd = Command::new(&paths.gateway);
    cmd.arg("--config").arg(&file).args([
        "--workers",
        &sc.gateway_workers.to_string(),
        "--log-level",
        "warn",
    ]);
    let p = Proc::spawn_until_ready(cmd, "gateway", Duration::from_secs(60)).await?;
    let addr = p
        .lines_with("LISTENING ")
        .into_iter()
        .find(|v| v.first().map(String::as_str) == Some("main"))
        .and_then(|v| v.get(1).cloned())
        .ok_or_else(|| anyhow!("gateway printed no LISTENING main line: {:?}", p.lines))?;
    Ok((p, addr))
}

/// Runs the scenario's workload once with `policy` through `replicas` gateways.
pub async fn run_policy(
    paths: &Paths,
    sc: &Scenario,
    redis: &Redis,
    policy: &str,
    replicas: usize,
    repetition: usize,
    progress: Arc<AtomicU64>,
) -> Result<PolicyResult> {
    let spec = policy::lookup(policy)?;
    if sc.scale_out.is_some() && spec.client_header() == ClientHeader::SessionCluster {
        return Err(anyhow!(
            "{policy} cannot run with scale_out: its client picks the pod and never learns new ones"
        ));
    }
    // Fresh pods per policy: every policy starts with cold caches.
    let (pods_proc, pods) = start_pods(paths, sc).await?;
    // With a scale-out the routers start with the first pods and learn the rest mid-run.
    let routed = &pods[..sc.initial_pods()];
    redis_cmd(&redis.addr, &["FLUSHALL"]).await?;
    // Redis's main thread spends CPU when idle too (serverCron, 10 Hz): measured over a quiet
    // half second before any gateway starts (so their heartbeats count as the plugin's cost,
    // not as idle) and taken off the run's figure pro rata.
    let idle_cpu_per_s =
        RedisUsage::idle_cpu_per_s(&redis.addr, Duration::from_millis(500)).await.unwrap_or(0.0);
    // One gateway (or one independent competitor router) per gateway slot.
    let mut gws = Vec::new();
    let mut urls = Vec::new();
    let mut admins = Vec::new();
    let mut external = None;
    for i in 0..replicas.max(1) {
        let tag = format!("{policy}-{i}");
        let (p, addr) = match spec.route {
            Route::Gateway(_) => {
                let (p, addr) = start_gateway(paths, sc, policy, routed, &redis.addr, &tag).await?;
                admins.extend(p.lines_with("ADMIN ").first().and_then(|v| v.first().cloned()));
                (p, addr)
            }
            Route::External { router, policy: rp } => {
                let r = routers::start_router(&paths.root, sc, router, rp, routed, &tag).await?;
                external.get_or_insert((router, Vec::new())).1.push(r.addr.clone());
                (r.proc, r.addr)
            }
        };
        urls.push(format!("http://{addr}"));
        gws.push(p);
    }
    if spec.scrapes_metrics() {
        // Let the first health checks store metrics.
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    redis_cmd(&redis.addr, &["CONFIG", "RESETSTAT"]).await?;
    let cpu0 = RedisUsage::main_thread_cpu_s(&redis.addr).await.unwrap_or(0.0);
    let vm_before = gateway_stats(&admins).await.and_then(|s| plugin_seconds(&s));
    let target = loadgen::Target {
        urls,
        gateway_choice: sc.client_gateway,
        sticky: match spec.client_header() {
            ClientHeader::None => None,
            ClientHeader::SessionCluster => Some(loadgen::StickyHeader {
                header: SESSION_CLUSTER_HEADER.into(),
                values: loadgen::StickyValues::OneOf((0..routed.len()).map(pod_cluster).collect()),
            }),
            ClientHeader::SessionId => Some(loadgen::StickyHeader {
                header: "X-Session-ID".into(),
                values: loadgen::StickyValues::SessionId,
            }),
        },
        time_scale: sc.time_scale,
        model: sc.model.clone(),
        timeout: Duration::from_secs(600),
        page: 16,
    };
    let t0 = Instant::now();
    let watch_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Only our gateways mark pods (a competitor router has no admin API to watch).
    let mark_watched = sc.health_check && !admins.is_empty();
    let watcher = mark_watched
        .then(|| tokio::spawn(watch_first_unhealthy(admins.clone(), t0, watch_stop.clone())));
    let freezer = match (sc.redis_freeze, redis.proc.id()) {
        (Some(f), Some(pid)) => Some(tokio::spawn(freeze_redis(pid, f))),
        _ => None,
    };
    let scaler = sc.scale_out.map(|s| {
        let target = match external {
            Some((router, addrs)) => ScaleTarget::Routers(router, addrs),
            None => ScaleTarget::Gateways(admins.clone()),
        };
        let s = scenario::ScaleOut { initial_pods: sc.initial_pods(), ..s };
        tokio::spawn(scale_out(target, pods.clone(), s, t0))
    });
    let records =
        loadgen::run(sc.workload.plan(), target, sc.workload.concurrency(), progress).await;
    // A run that ended before the scale-out has nothing after it.
    let scaled_at_s = match scaler {
        Some(h) if !h.is_finished() => {
            h.abort();
            None
        }
        Some(h) => Some(h.await.map_err(|e| anyhow!("scale-out: {e}"))??),
        None => None,
    };
    let wall = t0.elapsed().as_secs_f64();
    if let Some(dir) = std::env::var_os("BENCH_DUMP_RECORDS") {
        // Diagnosis: every request's record (start, pod, TTFT, cached tokens), one file per run.
        let path = std::path::Path::new(&dir).join(format!("{policy}-{repetition}.json"));
        std::fs::write(&path, serde_json::to_vec(&records)?)?;
    }
    if let Some(f) = freezer {
        // A run shorter than the freeze still gets Redis back before the next one.
        f.await.map_err(|e| anyhow!("freezer: {e}"))??;
    }
    watch_stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let marked_unhealthy_at_s = match watcher {
        Some(w) => w.await.ok().flatten(),
        None => None,
    };
    let failures: Vec<Failure> = records
        .iter()
        .filter_map(|r| {
            r.error.as_ref().map(|e| Failure {
                start_s: r.start_s,
                end_s: r.start_s + r.e2e_ms / 1000.0,
                error: e.chars().take(120).collect(),
            })
        })
        .collect();
    let errors_after_mark = marked_unhealthy_at_s
        .map(|m| failures.iter().filter(|f| f.start_s >= m).count())
        .unwrap_or(0);
    let mut usage = RedisUsage::since_reset(&redis.addr, cpu0).await.unwrap_or_default();
    usage.cpu_s = (usage.cpu_s - idle_cpu_per_s * wall).max(0.0);
    let mut prompt = 0.0;
    let mut cached = 0.0;
    let mut peaks = Vec::new();
    let mut requests = Vec::new();
    let mut inflight = Vec::new();
    for p in &pods {
        // A pod that hangs (pod-failure) must not stop the report: it counts as empty.
        let m = match tokio::time::timeout(Duration::from_secs(3), http_get(p, "/metrics")).await {
            Ok(r) => r.with_context(|| format!("scraping {p}"))?,
            Err(_) => String::new(),
        };
        prompt += prom_value(&m, "podsim_prompt_tokens_total").unwrap_or(0.0);
        cached += prom_value(&m, "podsim_cached_tokens_total").unwrap_or(0.0);
        peaks.push(prom_value(&m, "podsim_peak_inflight").unwrap_or(0.0) as u64);
        requests.push(prom_value(&m, "podsim_requests_total").unwrap_or(0.0));
        inflight.push(prom_value(&m, "podsim_inflight_seconds_total").unwrap_or(0.0));
    }
    // Late callbacks (the last streams' log phase, their releases' replies) land within a few ms.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stats_after = gateway_stats(&admins).await;
    let vm_after = stats_after.as_deref().and_then(plugin_seconds);
    let predicted_hits_missed = stats_after.as_deref().and_then(predicted_hits_missed);
    for g in gws {
        g.stop().await;
    }
    pods_proc.stop().await;
    let s = loadgen::summarize(&records, wall, sc.time_scale);
    let routed = records.len().max(1) as f64;
    let per_request = |after: f64, before: f64| (after - before).max(0.0) * 1e3 / routed;
    let (plugin_ms_per_request, plugin_ms_by_phase) = match (vm_before, vm_after) {
        (Some(before), Some(after)) => (
            Some(per_request(after.total, before.total)),
            match (after.phases, before.phases) {
                (Some(after), Some(before)) => PLUGIN_PHASES
                    .iter()
                    .zip(after.iter().zip(&before))
                    .map(|((name, _), (a, b))| (name.to_string(), per_request(*a, *b)))
                    .collect(),
                _ => BTreeMap::new(),
            },
        ),
        _ => (None, BTreeMap::new()),
    };
    let ts = sc.time_scale;
    let sim_s = (wall / ts).max(1e-9);
    Ok(PolicyResult {
        policy: policy.to_string(),
        repetition,
        gateway_replicas: replicas,
        requests: s.requests,
        errors: s.errors,
        ttft_ms: s.ttft_ms,
        e2e_ms: s.e2e_ms,
        output_tokens_per_s: s.output_tokens_per_s,
        prefix_hit_rate: if prompt > 0.0 { cached / prompt } else { 0.0 },
        client_hit_rate: s.client_hit_rate,
        oracle_hit_rate: s.oracle_hit_rate,
        request_share_max_over_mean: stats::max_over_mean(&requests),
        inflight_max_over_mean: stats::max_over_mean(&inflight),
        mean_inflight_per_pod: inflight.iter().map(|x| x / sim_s).collect(),
        peak_inflight_per_pod: peaks,
        requests_per_pod: s.per_pod_requests,
        redis_usec_per_request: usage.script_usec as f64 / routed,
        redis_bytes_per_request: (usage.bytes_in + usage.bytes_out) as f64 / routed,
        redis_commands_per_request: usage.top_level_calls as f64 / routed,
        redis_cpu_usec_per_request: usage.cpu_s * 1e6 / routed,
        redis_cpu_idle_subtracted: true,
        redis_bytes_in_per_request: usage.bytes_in as f64 / routed,
        redis_bytes_out_per_request: usage.bytes_out as f64 / routed,
        gateway_added_ms: s.gateway_added_ms,
        plugin_ms_per_request,
        plugin_ms_by_phase,
        predicted_hits_missed,
        wall_s: wall,
        offered_sessions_per_s: sc
            .workload
            .open_loop()
            .then(|| sc.workload.arrival_rate())
            .flatten(),
        load_series: stats::load_series(
            &records
                .iter()
                .filter_map(|r| {
                    r.pod.clone().map(|p| (p, r.start_s, r.start_s + r.e2e_ms / 1000.0))
                })
                .collect::<Vec<_>>(),
            120,
        ),
        marked_unhealthy_at_s,
        mark_watched,
        errors_after_mark,
        failures,
        outage_ttft_p90_ms: sc.redis_freeze.and_then(|f| {
            let mut v = outage_ttfts(&records, f, ts);
            v.sort_by(f64::total_cmp);
            let i = ((v.len() as f64) * 0.9).ceil() as usize;
            v.get(i.saturating_sub(1)).copied()
        }),
        outage_requests: sc.redis_freeze.map_or(0, |f| outage_ttfts(&records, f, ts).len()),
        after_scale_out: scaled_at_s.and_then(|at| {
            let new: Vec<String> = (sc.initial_pods()..pods.len()).map(pod_name).collect();
            AfterScaleOut::of(&records, at, &new, ts)
        }),
        ttfts: records.iter().filter_map(|r| simulated_ttft(r, ts)).collect(),
    })
}

/// One (scenario, gateway replicas, policy) to run several times.
#[derive(Debug, Clone)]
pub struct Job {
    /// The scenario as run (a sweep point changes its arrivals).
    pub sc: Scenario,
    /// Gateway slots (our gateways sharing Redis, or independent competitor routers).
    pub replicas: usize,
    /// Policy name (see [`policy::POLICIES`]).
    pub policy: String,
    /// What the progress bar says.
    pub label: String,
}

/// Runs every job `reps` times in interleaved rotating order ([`stats::interleaved`]), with a
/// progress bar over all requests; returns the runs in the order they were made.
pub async fn run_jobs(
    paths: &Paths,
    redis: &Redis,
    jobs: &[Job],
    reps: usize,
) -> Result<Vec<PolicyResult>> {
    use indicatif::{ProgressBar, ProgressStyle};
    use std::sync::atomic::Ordering;
    let per_run =
        |j: &Job| j.sc.workload.plan().iter().map(|s| s.turns.len()).sum::<usize>() as u64;
    let order = stats::interleaved(jobs.len(), reps);
    let total: u64 = order.iter().filter_map(|(_, k)| jobs.get(*k)).map(per_run).sum();
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests (eta {eta})  {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut results = Vec::new();
    let mut base = 0;
    for (rep, k) in order {
        let Some(job) = jobs.get(k) else { continue };
        bar.set_message(format!("{}, repetition {}/{reps}", job.label, rep + 1));
        let progress = Arc::new(AtomicU64::new(0));
        let ticker = {
            let (bar, progress) = (bar.clone(), progress.clone());
            tokio::spawn(async move {
                loop {
                    bar.set_position(base + progress.load(Ordering::Relaxed));
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            })
        };
        let r = run_policy(paths, &job.sc, redis, &job.policy, job.replicas, rep, progress).await;
        ticker.abort();
        let r = r.with_context(|| format!("{}, repetition {}", job.label, rep + 1))?;
        base += per_run(job);
        let mut line = format!(
            "{} #{}: {} requests, {} errors, TTFT mean {:.0} ms, hit rate {:.1}%",
            job.label,
            rep + 1,
            r.requests,
            r.errors,
            r.ttft_ms.mean,
            r.prefix_hit_rate * 100.0
        );
        if job.sc.redis_freeze.is_some() {
            line.push_str(&format!(
                "; while Redis was frozen: {} requests, TTFT p90 {} ms",
                r.outage_requests,
                r.outage_ttft_p90_ms.map_or_else(|| "n/a".into(), |v| format!("{v:.0}"))
            ));
        }
        if let Some(a) = &r.after_scale_out {
            line.push_str(&format!(
                "; after the scale-out: {} requests, TTFT mean {:.0} ms, p90 {:.0} ms, {:.0}% on the new pods",
                a.requests,
                a.ttft_mean_ms,
                a.ttft_p90_ms,
                a.new_pods_share * 100.0
            ));
        }
        if job.sc.health_check {
            let starts: Vec<String> =
                r.failures.iter().map(|f| format!("{:.2}", f.start_s)).collect();
            line.push_str(&format!(
                "; pod marked Unhealthy at {}, {} errors after it; failures started at [{}]",
                r.marked_unhealthy_at_s
                    .map(|m| format!("{m:.2} s"))
                    .unwrap_or_else(|| "never".into()),
                r.errors_after_mark,
                starts.join(", ")
            ));
        }
        // Without a terminal the bar is hidden and prints nothing: the log still gets the line.
        if bar.is_hidden() {
            eprintln!("{line}");
        } else {
            bar.println(line);
        }
        results.push(r);
    }
    bar.finish_and_clear();
    Ok(results)
}

/// The file of scenario `name`: a path, or `bench/scenarios/<name>.yaml`.
pub fn scenario_file(paths: &Paths, name: &str) -> PathBuf {
    let p = Path::new(name);
    if p.exists() {
        p.to_path_buf()
    } else {
        paths.root.join("bench/scenarios").join(format!("{name}.yaml"))
    }
}

/// Loads `bench/scenarios/<name>.yaml` (or a path).
pub fn load_scenario(paths: &Paths, name: &str) -> Result<Scenario> {
    let file = scenario_file(paths, name);
    let text =
        std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    serde_yaml::from_str(&text).with_context(|| format!("parsing {}", file.display()))
}

/// Label of a result row.
pub fn label(r: &PolicyAggregate, multi_replica: bool) -> String {
    if multi_replica {
        format!("{} x{}", r.policy, r.gateway_replicas)
    } else {
        r.policy.clone()
    }
}

/// The results table (Markdown, also readable on a terminal): median (min–max) over the
/// repetitions; p99 only where every run had at least 1000 requests. Redis figures are in
/// [`redis_table`].
pub fn table(rep: &Report) -> String {
    let multi = rep.config.gateway_replicas.len() > 1;
    let mut t = String::from(
        "| policy | runs × req | err | TTFT mean | TTFT p50 | TTFT p90 | TTFT p99 | E2E mean | out tok/s | hit rate (pods) | oracle | req share max/mean | in-flight max/mean | gw added p50 ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in &rep.policies {
        t.push_str(&format!(
            "| {} | {} × {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            label(r, multi),
            r.repetitions,
            r.requests_per_run,
            r.errors,
            r.ttft_mean_ms.show(0, 1.0),
            r.ttft_p50_ms.show(0, 1.0),
            r.ttft_p90_ms.show(0, 1.0),
            r.ttft_p99_ms.map(|s| s.show(0, 1.0)).unwrap_or_else(|| "n/a".into()),
            r.e2e_mean_ms.show(0, 1.0),
            r.output_tokens_per_s.show(0, 1.0),
            r.prefix_hit_rate.show(1, 100.0),
            r.oracle_hit_rate.show(1, 100.0),
            r.request_share_max_over_mean.show(2, 1.0),
            r.inflight_max_over_mean.show(2, 1.0),
            r.gateway_added_p50_ms.show(2, 1.0),
        ));
    }
    t
}

/// What the plugin costs the gateway per routed request, for the policies run by our gateway in
/// reports that measured it; empty otherwise.
pub fn plugin_table(rep: &Report) -> String {
    let multi = rep.config.gateway_replicas.len() > 1;
    let rows: Vec<(&PolicyAggregate, Spread)> =
        rep.policies.iter().filter_map(|r| Some((r, r.plugin_ms_per_request?))).collect();
    if rows.is_empty() {
        return String::new();
    }
    // The phases' columns when every row has them (reports before the per-callback counts: none).
    let phases: Vec<&str> = PLUGIN_PHASES
        .iter()
        .map(|(p, _)| *p)
        .filter(|p| rows.iter().all(|(r, _)| r.plugin_ms_by_phase.iter().any(|(n, _)| n == p)))
        .collect();
    let mut t = String::from(
        "| policy (gateway per routed request) | time in the plugin, ms (its host calls included) |",
    );
    for p in &phases {
        t.push_str(&format!(" of it: {p} |"));
    }
    t.push_str(" gw added p50 ms |");
    // Reports before the prediction check, or without a prefix_cache row: no column.
    let predictions = rows.iter().any(|(r, _)| r.predicted_hits_missed.is_some());
    if predictions {
        t.push_str(" predicted hits the engine had nothing cached for, % |");
    }
    t.push_str("\n|---|---|");
    t.push_str(&"---|".repeat(phases.len() + 1 + usize::from(predictions)));
    t.push('\n');
    for (r, plugin) in rows {
        t.push_str(&format!("| {} | {} |", label(r, multi), plugin.show(3, 1.0)));
        for p in &phases {
            let spread = r.plugin_ms_by_phase.iter().find(|(n, _)| n == p).map(|(_, s)| s);
            t.push_str(&format!(" {} |", spread.map_or(String::new(), |s| s.show(3, 1.0))));
        }
        t.push_str(&format!(" {} |", r.gateway_added_p50_ms.show(2, 1.0)));
        if predictions {
            let missed = r.predicted_hits_missed.as_ref().map(|s| s.show(1, 100.0));
            t.push_str(&format!(" {} |", missed.unwrap_or_default()));
        }
        t.push('\n');
    }
    t
}

/// With `redis_freeze`: per policy, the median (min–max) over the runs of the TTFT p90 of the
/// requests sent while Redis was frozen. Empty without a freeze.
pub fn outage_table(rep: &Report) -> String {
    if rep.config.redis_freeze.is_none() {
        return String::new();
    }
    let mut t = String::from(
        "| policy | TTFT p90 while Redis was frozen (ms) | per run | requests in the freeze (median) |\n|---|---|---|---|\n",
    );
    let mut names: Vec<&str> = Vec::new();
    for r in &rep.runs {
        if !names.contains(&r.policy.as_str()) {
            names.push(&r.policy);
        }
    }
    for name in names {
        let runs: Vec<&PolicyResult> = rep.runs.iter().filter(|r| r.policy == name).collect();
        let mut p90: Vec<f64> = runs.iter().filter_map(|r| r.outage_ttft_p90_ms).collect();
        p90.sort_by(f64::total_cmp);
        let mut n: Vec<usize> = runs.iter().map(|r| r.outage_requests).collect();
        n.sort_unstable();
        let median = p90.get(p90.len() / 2).map_or_else(|| "n/a".into(), |m| format!("{m:.0}"));
        let per: Vec<String> = runs
            .iter()
            .map(|r| r.outage_ttft_p90_ms.map_or_else(|| "n/a".into(), |v| format!("{v:.0}")))
            .collect();
        t.push_str(&format!(
            "| {name} | {median} | {} | {} |\n",
            per.join(", "),
            n.get(n.len() / 2).copied().unwrap_or(0)
        ));
    }
    t
}

/// With `scale_out`: per policy, how the requests sent after the new pods came were served,
/// median over the runs (TTFT p90 and the new pods' share also per run). Empty without one.
pub fn scale_out_table(rep: &Report) -> String {
    let Some(s) = rep.config.scale_out else {
        return String::new();
    };
    let count = rep.config.pods.count.max(1);
    let fair = (count - rep.config.initial_pods().min(count)) as f64 * 100.0 / count as f64;
    let mut t = format!(
        "| policy (requests sent after the scale-out, {:.0} s in) | TTFT mean, ms | TTFT p90, ms | p90 per run | on the new pods, % (fair: {fair:.0}) | per run | requests |\n|---|---|---|---|---|---|---|\n",
        s.at_s
    );
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    let show = |v: Option<f64>| v.map_or_else(|| "n/a".into(), |v| format!("{v:.0}"));
    let mut names: Vec<&str> = Vec::new();
    for r in &rep.runs {
        if !names.contains(&r.policy.as_str()) {
            names.push(&r.policy);
        }
    }
    for name in names {
        let runs: Vec<Option<&AfterScaleOut>> = rep
            .runs
            .iter()
            .filter(|r| r.policy == name)
            .map(|r| r.after_scale_out.as_ref())
            .collect();
        let of = |f: fn(&AfterScaleOut) -> f64| -> Vec<f64> {
            runs.iter().flatten().map(|a| f(a)).collect()
        };
        let per_run = |f: fn(&AfterScaleOut) -> f64| -> String {
            let v: Vec<String> = runs.iter().map(|a| show(a.map(f))).collect();
            v.join(", ")
        };
        let share = |a: &AfterScaleOut| a.new_pods_share * 100.0;
        t.push_str(&format!(
            "| {name} | {} | {} | {} | {} | {} | {} |\n",
            show(median(of(|a| a.ttft_mean_ms))),
            show(median(of(|a| a.ttft_p90_ms))),
            per_run(|a| a.ttft_p90_ms),
            show(median(of(share))),
            per_run(share),
            show(median(of(|a| a.requests as f64))),
        ));
    }
    t
}

/// With a health check (pod-failure): per policy, the errors over all runs split at the moment
/// the gateway marked the failed pod Unhealthy, and when that was. Empty without a health check.
pub fn failure_table(rep: &Report) -> String {
    if !rep.config.health_check {
        return String::new();
    }
    let mut t = String::from(
        "| policy | errors (all runs) | before the mark | after the mark | marked at (s into the load, per run) |\n|---|---|---|---|---|\n",
    );
    let mut names: Vec<&str> = Vec::new();
    for r in rep.runs.iter().filter(|r| r.mark_watched) {
        if !names.contains(&r.policy.as_str()) {
            names.push(&r.policy);
        }
    }
    if names.is_empty() {
        return String::new();
    }
    for name in names {
        let runs: Vec<&PolicyResult> =
            rep.runs.iter().filter(|r| r.policy == name && r.mark_watched).collect();
        let errors: usize = runs.iter().map(|r| r.errors).sum();
        let after: usize = runs.iter().map(|r| r.errors_after_mark).sum();
        let marks: Vec<String> = runs
            .iter()
            .map(|r| r.marked_unhealthy_at_s.map_or_else(|| "never".into(), |m| format!("{m:.2}")))
            .collect();
        let never = runs.iter().all(|r| r.marked_unhealthy_at_s.is_none());
        t.push_str(&format!(
            "| {name} | {errors} | {} | {} | {} |\n",
            if never { "n/a".into() } else { (errors - after).to_string() },
            if never { "n/a".into() } else { after.to_string() },
            marks.join(", ")
        ));
    }
    t
}

/// What Redis did per routed request, for the policies that use it (empty when none did):
/// script time, commands sent (never the ones run inside scripts), main-thread CPU, bytes.
pub fn redis_table(rep: &Report) -> String {
    let multi = rep.config.gateway_replicas.len() > 1;
    let rows: Vec<&PolicyAggregate> = rep
        .policies
        .iter()
        .filter(|r| policy::lookup(&r.policy).map(|p| p.uses_redis()).unwrap_or(false))
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut t = String::from(
        "| policy (Redis per routed request) | script µs | commands | main-thread CPU µs | bytes in | bytes out |\n|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let idle = if r.redis_cpu_idle_subtracted { "" } else { " incl. idle" };
        t.push_str(&format!(
            "| {} | {} | {} | {}{idle} | {} | {} |\n",
            label(r, multi),
            r.redis_usec_per_request.show(1, 1.0),
            r.redis_commands_per_request.show(2, 1.0),
            r.redis_cpu_usec_per_request.show(1, 1.0),
            r.redis_bytes_in_per_request.show(0, 1.0),
            r.redis_bytes_out_per_request.show(0, 1.0),
        ));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request record sent `start_s` into the load, served by `pod` with a TTFT of `ttft_ms`
    /// (wall ms, 2 of them the gateway's), or failed.
    fn record(start_s: f64, pod: &str, ttft_ms: Option<f64>) -> loadgen::RequestRecord {
        loadgen::RequestRecord {
            start_s,
            pod: Some(pod.into()),
            ttft_ms,
            gateway_added_ms: Some(2.0),
            error: ttft_ms.is_none().then(|| "connection reset".into()),
            ..Default::default()
        }
    }

    /// Only the successful requests sent once the new pods were known count; their TTFTs are
    /// on the pods' clock (the gateway's part kept) and the share is of them.
    #[test]
    fn after_scale_out_counts_the_requests_sent_after_it() {
        let records = [
            record(1.0, "pod-2", Some(1000.0)),
            record(4.9, "pod-0", Some(12.0)),
            record(5.0, "pod-0", Some(12.0)),
            record(5.5, "pod-2", Some(22.0)),
            record(6.0, "pod-3", Some(32.0)),
            record(6.5, "pod-1", Some(42.0)),
            record(7.0, "pod-3", None),
        ];
        let new = [pod_name(2), pod_name(3)];
        let a = AfterScaleOut::of(&records, 5.0, &new, 0.25).expect("requests after 5 s");
        // Simulated TTFT = (wall - 2) / 0.25 + 2: 42, 82, 122, 162.
        assert_eq!(a.requests, 4);
        assert_eq!(a.ttft_mean_ms, 102.0);
        assert_eq!(a.ttft_p90_ms, 162.0);
        assert_eq!(a.new_pods_share, 0.5);
        assert_eq!(AfterScaleOut::of(&records, 7.0, &new, 0.25), None, "only a failure after 7 s");
    }

    /// Two gateways' `/stats`: plugin time and checked predictions are summed over both; a
    /// gateway without per-callback counts leaves the phases out.
    #[test]
    fn gateway_stats_are_summed_over_gateways() {
        let with_phases = "# TYPE gateway_vm_call_seconds_total counter\n\
            gateway_vm_call_seconds_total 2.5\n\
            # TYPE gateway_vm_callback_seconds_total counter\n\
            gateway_vm_callback_seconds_total{callback=\"proxy_on_request_body\"} 1.5\n\
            gateway_vm_callback_seconds_total{callback=\"proxy_on_tick\"} 0.25\n\
            ai_lb_predicted_hit_engine_hit 3\n\
            ai_lb_predicted_hit_engine_miss 1\n";
        let without_phases = "gateway_vm_call_seconds_total 1.5\n\
            ai_lb_predicted_hit_engine_hit 5\n\
            ai_lb_predicted_hit_engine_miss 1\n";
        let one = plugin_seconds(&[with_phases.to_string()]).expect("one gateway");
        assert_eq!(one.total, 2.5);
        let phases = one.phases.expect("per-callback counts");
        let phase = |name: &str| {
            let i = PLUGIN_PHASES.iter().position(|(n, _)| *n == name).expect("phase");
            phases[i]
        };
        assert_eq!(phase("background"), 0.25);
        assert_eq!(phases.iter().sum::<f64>(), 1.75);

        let both = [with_phases.to_string(), without_phases.to_string()];
        let sum = plugin_seconds(&both).expect("two gateways");
        assert_eq!((sum.total, sum.phases), (4.0, None));
        assert_eq!(predicted_hits_missed(&both), Some(0.2));

        assert_eq!(plugin_seconds(&[]), None, "a competitor router has no gateway");
        assert_eq!(
            predicted_hits_missed(&[without_phases
                .replace("_hit 5", "_hit 0")
                .replace("_miss 1", "_miss 0")]),
            None
        );
    }
}
