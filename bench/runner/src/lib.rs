//! bench: runs a scenario once per load-balancing policy (Redis + podsim pods + gateway
//! replicas with the plugin) and reports latency, throughput, hit rates, balance and Redis cost.

pub mod aiperf;
pub mod chart;
pub mod procs;
pub mod redis_cost;
pub mod scenario;

use anyhow::{anyhow, Context, Result};
use loadgen::stats::{Dist, P50P99};
use procs::{free_port, http_get, prom_value, redis_cmd, redis_usage, require, Proc, Redis};
use scenario::Scenario;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::process::Command;

/// Cluster names as Higress/Envoy spell them.
pub const LLM_CLUSTER: &str = "outbound|8000||llm.static";
/// The Redis cluster the plugin names in `proxy_redis_init` (serviceFQDN redis.static, port 6379).
pub const REDIS_CLUSTER: &str = "outbound|6379||redis.static";

/// Where the binaries and results live.
#[derive(Debug, Clone)]
pub struct Paths {
    /// Workspace root.
    pub root: PathBuf,
    /// target/release/podsim.
    pub podsim: PathBuf,
    /// target/release/gateway.
    pub gateway: PathBuf,
    /// The plugin .wasm.
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
            wasm: root.join("target/wasm32-wasip1/wasm-release/ai_load_balancer.wasm"),
            results: root.join("bench/results"),
        }
    }
}

/// Results of one policy (at one gateway replica count).
#[derive(Debug, Clone, Serialize, Default)]
pub struct PolicyResult {
    /// Policy name.
    pub policy: String,
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
    /// max over pods of peak in-flight requests / mean over pods of the same.
    pub max_over_mean_load: f64,
    /// Peak in-flight (running + waiting) per pod.
    pub peak_inflight_per_pod: Vec<u64>,
    /// Requests served per pod.
    pub requests_per_pod: BTreeMap<String, usize>,
    /// Redis command time per routed request (µs).
    pub redis_usec_per_request: f64,
    /// Redis bytes in + out per routed request.
    pub redis_bytes_per_request: f64,
    /// Client time-to-headers minus pod time, real ms.
    pub gateway_added_ms: P50P99,
    /// Wall-clock seconds of the load.
    pub wall_s: f64,
    /// TTFTs (simulated ms), for the chart.
    #[serde(skip)]
    pub ttfts: Vec<f64>,
}

/// The whole report written to bench/results/<scenario>.json.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Scenario name.
    pub scenario: String,
    /// Scenario description.
    pub description: String,
    /// Unix time of the run.
    pub unix_time: u64,
    /// Pods' time scale.
    pub time_scale: f64,
    /// The scenario as run.
    pub config: Scenario,
    /// One entry per (replicas, policy).
    pub policies: Vec<PolicyResult>,
}

fn gateway_config(
    paths: &Paths,
    sc: &Scenario,
    policy: &str,
    pods: &[String],
    redis: &str,
) -> Value {
    let mut llm = json!({"name": LLM_CLUSTER, "lb_policy": "round_robin", "endpoints": pods});
    if policy == "endpoint_metrics" {
        // Like Higress: the health checker keeps each pod's /metrics body for the plugin.
        llm["health_check"] = json!({"path": "/metrics", "interval_ms": 200, "timeout_ms": 1000,
            "unhealthy_threshold": 3, "healthy_threshold": 1, "store_metrics": true});
    }
    let mut cfg = json!({
        "listeners": [{"name": "main", "address": "127.0.0.1:0"}],
        "admin": {"address": "127.0.0.1:0"},
        "routes": [{"name": "llm-route", "match": {"prefix": "/"}, "cluster": LLM_CLUSTER, "timeout_ms": 600000}],
        "clusters": [llm, {"name": REDIS_CLUSTER, "endpoints": [redis]}],
    });
    if policy != "round_robin" {
        let mut lb = serde_json::Map::new();
        if policy != "endpoint_metrics" {
            lb.insert("serviceFQDN".into(), json!("redis.static"));
            lb.insert("servicePort".into(), json!(6379));
        }
        for (k, v) in &sc.lb_config {
            lb.insert(k.clone(), v.clone());
        }
        cfg["plugin"] = json!({
            "wasm": paths.wasm.to_string_lossy(), "name": "ai-load-balancer", "root_id": "", "vm_id": "",
            "configuration": {"lb_policy": policy, "lb_config": lb},
        });
    }
    cfg
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
        .args(&sc.pods.args);
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
    if policy != "round_robin" {
        require(&paths.wasm, "build it: cargo build --target wasm32-wasip1 --profile wasm-release -p ai-load-balancer")?;
    }
    let dir = std::env::temp_dir().join(format!("bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join(format!("gateway-{tag}.yaml"));
    // JSON is valid YAML.
    std::fs::write(
        &file,
        serde_json::to_string_pretty(&gateway_config(paths, sc, policy, pods, redis))?,
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
    progress: Arc<AtomicU64>,
) -> Result<PolicyResult> {
    // Fresh pods per policy: every policy starts with cold caches.
    let (pods_proc, pods) = start_pods(paths, sc).await?;
    redis_cmd(&redis.addr, &["FLUSHALL"]).await?;
    let mut gws = Vec::new();
    let mut urls = Vec::new();
    for i in 0..replicas.max(1) {
        let (p, addr) =
            start_gateway(paths, sc, policy, &pods, &redis.addr, &format!("{policy}-{i}")).await?;
        urls.push(format!("http://{addr}"));
        gws.push(p);
    }
    if policy == "endpoint_metrics" {
        // Let the first health checks store metrics.
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    redis_cmd(&redis.addr, &["CONFIG", "RESETSTAT"]).await?;
    let target = loadgen::Target {
        urls,
        model: sc.model.clone(),
        timeout: Duration::from_secs(600),
        page: 16,
    };
    let t0 = Instant::now();
    let records =
        loadgen::run(sc.workload.plan(), target, sc.workload.concurrency(), progress).await;
    let wall = t0.elapsed().as_secs_f64();
    let (usec, bytes) = redis_usage(&redis.addr).await.unwrap_or((0, 0));
    let mut prompt = 0.0;
    let mut cached = 0.0;
    let mut peaks = Vec::new();
    for p in &pods {
        let m = http_get(p, "/metrics").await.with_context(|| format!("scraping {p}"))?;
        prompt += prom_value(&m, "podsim_prompt_tokens_total").unwrap_or(0.0);
        cached += prom_value(&m, "podsim_cached_tokens_total").unwrap_or(0.0);
        peaks.push(prom_value(&m, "podsim_peak_inflight").unwrap_or(0.0) as u64);
    }
    for g in gws {
        g.stop().await;
    }
    pods_proc.stop().await;
    let s = loadgen::summarize(&records, wall, sc.time_scale);
    let mean_peak = peaks.iter().sum::<u64>() as f64 / peaks.len().max(1) as f64;
    let routed = records.len().max(1) as f64;
    let ts = sc.time_scale;
    Ok(PolicyResult {
        policy: policy.to_string(),
        gateway_replicas: replicas,
        requests: s.requests,
        errors: s.errors,
        ttft_ms: s.ttft_ms,
        e2e_ms: s.e2e_ms,
        output_tokens_per_s: s.output_tokens_per_s,
        prefix_hit_rate: if prompt > 0.0 { cached / prompt } else { 0.0 },
        client_hit_rate: s.client_hit_rate,
        oracle_hit_rate: s.oracle_hit_rate,
        max_over_mean_load: if mean_peak > 0.0 {
            *peaks.iter().max().unwrap_or(&0) as f64 / mean_peak
        } else {
            0.0
        },
        peak_inflight_per_pod: peaks,
        requests_per_pod: s.per_pod_requests,
        redis_usec_per_request: usec as f64 / routed,
        redis_bytes_per_request: bytes as f64 / routed,
        gateway_added_ms: s.gateway_added_ms,
        wall_s: wall,
        ttfts: records
            .iter()
            .filter(|r| r.error.is_none())
            .filter_map(|r| {
                let gw = r.gateway_added_ms.unwrap_or(0.0);
                r.ttft_ms.map(|v| (v - gw.clamp(0.0, v)) / ts + gw.clamp(0.0, v))
            })
            .collect(),
    })
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
pub fn label(r: &PolicyResult, multi_replica: bool) -> String {
    if multi_replica {
        format!("{} x{}", r.policy, r.gateway_replicas)
    } else {
        r.policy.clone()
    }
}

/// The results table (Markdown, also readable on a terminal).
pub fn table(rep: &Report) -> String {
    let multi = rep.config.gateway_replicas.len() > 1;
    let mut t = String::from(
        "| policy | req | err | TTFT mean | TTFT p50 | TTFT p99 | E2E mean | E2E p99 | out tok/s | hit rate (pods) | oracle | max/mean load | redis µs/req | redis B/req | gw added p50/p99 ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in &rep.policies {
        t.push_str(&format!(
            "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1}% | {:.1}% | {:.2} | {:.1} | {:.0} | {:.2} / {:.2} |\n",
            label(r, multi),
            r.requests,
            r.errors,
            r.ttft_ms.mean,
            r.ttft_ms.p50,
            r.ttft_ms.p99,
            r.e2e_ms.mean,
            r.e2e_ms.p99,
            r.output_tokens_per_s,
            r.prefix_hit_rate * 100.0,
            r.oracle_hit_rate * 100.0,
            r.max_over_mean_load,
            r.redis_usec_per_request,
            r.redis_bytes_per_request,
            r.gateway_added_ms.p50,
            r.gateway_added_ms.p99,
        ));
    }
    t
}

/// A free port (re-exported for the demo).
pub fn port() -> Result<u16> {
    free_port()
}
