//! Competing routers as baselines, on the same pods and load: SGLang's `sglang-router` and vLLM's
//! `vllm-router`, both Rust binaries shipped as PyPI wheels, installed pinned by `build.sh` into
//! `.venv-routers/` (`./build.sh routers`). Each instance gets its own port and Prometheus port.

use crate::policy::Router;
use crate::procs::Proc;
use crate::scenario::Scenario;
use anyhow::{anyhow, bail, Result};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::Command;

/// Pinned versions (the same pins as build.sh's `ensure_routers`).
pub const SGLANG_ROUTER_VERSION: &str = "0.3.2";
/// vllm-router pin.
pub const VLLM_ROUTER_VERSION: &str = "0.1.17";

/// The router's executable: `$BENCH_ROUTERS_VENV/bin/<bin>` or `<root>/.venv-routers/bin/<bin>`.
pub fn router_bin(root: &Path, router: Router) -> PathBuf {
    let venv = std::env::var_os("BENCH_ROUTERS_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".venv-routers"));
    venv.join("bin").join(router.bin())
}

/// The command-line options of one router instance (after its subcommand).
pub fn router_args(
    router: Router,
    policy: &str,
    port: u16,
    prometheus_port: u16,
    pods: &[String],
    health_check: bool,
) -> Vec<String> {
    let mut a: Vec<String> =
        vec!["--host".into(), "127.0.0.1".into(), "--port".into(), port.to_string()];
    a.push("--worker-urls".into());
    a.extend(pods.iter().map(|p| format!("http://{p}")));
    a.extend(["--policy".into(), policy.into()]);
    a.extend(["--prometheus-host".into(), "127.0.0.1".into()]);
    a.extend(["--prometheus-port".into(), prometheus_port.to_string()]);
    // Both default to an INFO line per request; their own logging is not what is compared.
    let level = match router {
        Router::Sglang => "warn",
        Router::Vllm => "warning",
    };
    a.extend(["--log-level".into(), level.into()]);
    if health_check {
        // As close as their options go to the gateway's check (200 ms, 3 failures): whole seconds.
        a.extend(["--health-check-endpoint".into(), "/health".into()]);
        a.extend(["--health-check-interval-secs".into(), "1".into()]);
        a.extend(["--health-failure-threshold".into(), "3".into()]);
        a.extend(["--health-check-timeout-secs".into(), "1".into()]);
    }
    a
}

/// One running router instance.
pub struct RouterProc {
    /// The process (killed when dropped).
    pub proc: Proc,
    /// `127.0.0.1:port` of its OpenAI API.
    pub addr: String,
    /// Its log file.
    pub log: PathBuf,
}

/// HTTP status of `GET path` on `addr` (HTTP/1.0, one connection).
async fn http_status(addr: &str, path: &str) -> Result<u16> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).await?;
    let mut buf = vec![0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await??;
    let line = String::from_utf8_lossy(&buf[..n]);
    line.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow!("no status line from {addr}: {line:?}"))
}

/// Starts `router` with `policy` over `pods`; ready once `/v1/models` (proxied to a worker)
/// answers 200, i.e. it has registered a healthy worker.
pub async fn start_router(
    root: &Path,
    sc: &Scenario,
    router: Router,
    policy: &str,
    pods: &[String],
    tag: &str,
) -> Result<RouterProc> {
    let bin = router_bin(root, router);
    if !bin.exists() {
        bail!(
            "{} not found: run ./build.sh routers (pinned wheels into .venv-routers/)",
            bin.display()
        );
    }
    let port = testkit::paths::free_port()?;
    let prom = testkit::paths::free_port()?;
    let dir = std::env::temp_dir().join(format!("bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let log = dir.join(format!("router-{tag}.log"));
    let mut cmd = Command::new(&bin);
    cmd.args(router.subcommand())
        .args(router_args(router, policy, port, prom, pods, sc.health_check))
        // The Python wrapper's own output unbuffered, so the log is complete when it dies.
        .env("PYTHONUNBUFFERED", "1");
    let mut proc = Proc::spawn_logged(cmd, router.bin(), &log)?;
    let addr = format!("127.0.0.1:{port}");
    let t0 = Instant::now();
    loop {
        if proc.exited() {
            bail!("{} exited at start; log {}", router.bin(), log.display());
        }
        if matches!(http_status(&addr, "/v1/models").await, Ok(200)) {
            return Ok(RouterProc { proc, addr, log });
        }
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("{} not ready after 60 s; log {}", router.bin(), log.display());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The request that tells `router` about a new worker at `pod` (`ip:port`): SGLang's router
/// 0.3 registers workers with `POST /workers` and a JSON body, vLLM's with
/// `POST /add_worker?url=`.
pub fn add_worker_request(router: Router, pod: &str) -> testkit::http::HttpRequest {
    let url = format!("http://{pod}");
    match router {
        Router::Sglang => testkit::http::HttpRequest::post_json("/workers", &json!({"url": url})),
        Router::Vllm => testkit::http::HttpRequest::post(
            &format!("/add_worker?url={}", testkit::gateway::url_encode(&url)),
            Vec::new(),
        ),
    }
}

/// Adds the worker at `pod` to the router at `addr` (SGLang's router answers 202: it checks the
/// worker's health before routing to it, as our gateway does with a health check).
pub async fn add_worker(router: Router, addr: &str, pod: &str) -> Result<()> {
    let sock: std::net::SocketAddr = addr.parse()?;
    let resp =
        testkit::http::send(sock, add_worker_request(router, pod), Duration::from_secs(10)).await?;
    if !(200..300).contains(&resp.status) {
        bail!("{} at {addr}: adding {pod}: status {} {:?}", router.bin(), resp.status, resp.text());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_command_lines_name_every_pod_and_both_ports() {
        let pods = vec!["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()];
        let a = router_args(Router::Sglang, "cache_aware", 30000, 29000, &pods, false);
        let s = a.join(" ");
        assert!(
            s.contains("--worker-urls http://127.0.0.1:1 http://127.0.0.1:2 --policy cache_aware")
        );
        assert!(s.contains("--port 30000") && s.contains("--prometheus-port 29000"));
        assert!(s.contains("--log-level warn") && !s.contains("health-check"));
        let a = router_args(Router::Vllm, "consistent_hash", 1, 2, &pods, true).join(" ");
        assert!(a.contains("--log-level warning"), "vllm-router spells it warning: {a}");
        assert!(a.contains("--health-check-endpoint /health"));
        assert_eq!(Router::Sglang.subcommand(), ["launch"]);
        assert!(Router::Vllm.subcommand().is_empty());
    }

    #[test]
    fn added_latency_is_taken_against_the_direct_run_of_the_same_repetition() {
        let targets: Vec<String> = ["direct", "x"].iter().map(|s| s.to_string()).collect();
        // Repetition 1 is slower for both (a noisy machine): the excess stays 2 ms.
        let s = |target, rep, p50, p90, errors| Sample { target, rep, p50, p90, errors };
        let got = [
            s(0, 0, 1.0, 2.0, 0),
            s(1, 0, 3.0, 5.0, 0),
            s(1, 1, 13.0, 15.0, 1),
            s(0, 1, 11.0, 12.0, 0),
        ];
        let rows = added_latency(&targets, &got);
        assert_eq!(rows[0].added_p50_ms.median, 0.0);
        assert_eq!(rows[1].added_p50_ms, crate::stats::Spread { median: 2.0, min: 2.0, max: 2.0 });
        assert_eq!(rows[1].added_p90_ms.min, 3.0);
        assert_eq!(rows[1].ttft_p50_ms.max, 13.0);
        assert_eq!(rows[1].errors, 1);
        assert!(overhead_scenario(10).is_ok());
    }
}

/// One target's added latency over repetitions: TTFT (real ms) through it minus TTFT straight
/// to the pod in the same repetition.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct AddedLatency {
    /// `direct` or a policy name.
    pub target: String,
    /// Median TTFT per repetition, real ms.
    pub ttft_p50_ms: crate::stats::Spread,
    /// 90th percentile TTFT per repetition, real ms.
    pub ttft_p90_ms: crate::stats::Spread,
    /// Median TTFT minus the direct median of the same repetition.
    pub added_p50_ms: crate::stats::Spread,
    /// p90 minus the direct p90 of the same repetition.
    pub added_p90_ms: crate::stats::Spread,
    /// Failed requests over all repetitions.
    pub errors: usize,
}

/// bench/results/router-overhead.json.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct OverheadReport {
    /// Date, commit and machine.
    pub stamp: crate::Stamp,
    /// Sequential requests per target and repetition.
    pub requests_per_rep: usize,
    /// Repetitions.
    pub reps: usize,
    /// sglang-router version.
    pub sglang_router: String,
    /// vllm-router version.
    pub vllm_router: String,
    /// One row per target, `direct` first.
    pub rows: Vec<AddedLatency>,
}

impl OverheadReport {
    /// Markdown for the README: stamp line, then the table.
    pub fn section(&self) -> String {
        format!(
            "`router-overhead`: each router's own added latency, {} sequential streamed requests per target to one fast pod (sglang-router {}, vllm-router {})\n\n{} · {} repetitions, interleaved · real ms\n\n{}",
            self.requests_per_rep,
            self.sglang_router,
            self.vllm_router,
            crate::tables::stamp_text(&self.stamp, None),
            self.reps,
            added_latency_table(&self.rows)
        )
    }
}

/// Targets of `bench router-overhead`: straight to the pod, then these policies.
pub const OVERHEAD_TARGETS: &[&str] = &[
    "direct",
    "round_robin",
    "prefix_cache",
    "sglang_round_robin",
    "sglang_cache_aware",
    "vllm_round_robin",
    "vllm_cache_aware",
];

/// The fast upstream: one podsim pod at time scale 0.01 (a 200-token prefill and the API
/// overhead take about 0.1 ms; tokio's 1 ms timer dominates), one request at a time.
pub fn overhead_scenario(requests: usize) -> Result<Scenario> {
    Ok(serde_yaml::from_str(&format!(
        "name: router-overhead\ntime_scale: 0.01\npods: {{count: 1, profile: h100-8b}}\n\
         workload: {{kind: multi_turn, sessions: {requests}, turns_mean: 1, input_tokens_mean: 200, \
         output_tokens_mean: 4, concurrency: 1, seed: 7}}\n"
    ))?)
}

/// Sequential requests through each of `targets` (interleaved repetitions, fresh router or
/// gateway each time, one shared fast pod): each target's TTFT beside the direct one.
pub async fn measure_added_latency(
    paths: &crate::Paths,
    targets: &[String],
    requests: usize,
    reps: usize,
) -> Result<Vec<AddedLatency>> {
    let sc = overhead_scenario(requests)?;
    let redis = crate::procs::Redis::start().await?;
    let (pods_proc, pods) = crate::start_pods(paths, &sc).await?;
    let mut got: Vec<Sample> = Vec::new();
    for (rep, k) in crate::stats::interleaved(targets.len(), reps.max(1)) {
        let name = &targets[k];
        let (proc, url) = if name == "direct" {
            (None, format!("http://{}", pods[0]))
        } else {
            let spec = crate::policy::lookup(name)?;
            let (p, addr) = match spec.route {
                crate::policy::Route::Gateway(_) => {
                    crate::start_gateway(paths, &sc, name, &pods, &redis.addr, name).await?
                }
                crate::policy::Route::External { router, policy } => {
                    let r = start_router(&paths.root, &sc, router, policy, &pods, name).await?;
                    (r.proc, r.addr)
                }
            };
            (Some(p), format!("http://{addr}"))
        };
        let target = loadgen::Target {
            urls: vec![url],
            gateway_choice: loadgen::GatewayChoice::PerSession,
            sticky: None,
            time_scale: sc.time_scale,
            model: sc.model.clone(),
            timeout: Duration::from_secs(30),
            page: 16,
        };
        let progress = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let records = loadgen::run(sc.workload.plan(), target, 1, progress).await;
        if let Some(p) = proc {
            p.stop().await;
        }
        let ttfts: Vec<f64> = records.iter().filter_map(|r| r.ttft_ms).collect();
        let d = loadgen::stats::dist(&ttfts);
        let errors = records.iter().filter(|r| r.error.is_some()).count();
        eprintln!(
            "{name} #{}: TTFT p50 {:.2} ms, p90 {:.2} ms, {errors} errors",
            rep + 1,
            d.p50,
            d.p90
        );
        got.push(Sample { target: k, rep, p50: d.p50, p90: d.p90, errors });
    }
    pods_proc.stop().await;
    Ok(added_latency(targets, &got))
}

/// One target's repetition in `bench router-overhead`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// Index into the targets.
    pub target: usize,
    /// Repetition.
    pub rep: usize,
    /// TTFT median, real ms.
    pub p50: f64,
    /// TTFT 90th percentile, real ms.
    pub p90: f64,
    /// Failed requests.
    pub errors: usize,
}

/// Per target: its TTFT spread and its excess over `targets[0]` (direct) repetition by
/// repetition.
pub fn added_latency(targets: &[String], got: &[Sample]) -> Vec<AddedLatency> {
    use crate::stats::Spread;
    let direct = |rep: usize| got.iter().find(|g| g.target == 0 && g.rep == rep);
    targets
        .iter()
        .enumerate()
        .map(|(k, name)| {
            let mine: Vec<&Sample> = got.iter().filter(|g| g.target == k).collect();
            let added = |f: fn(&Sample) -> f64| {
                Spread::of(mine.iter().filter_map(|g| direct(g.rep).map(|d| f(g) - f(d))))
                    .unwrap_or_default()
            };
            AddedLatency {
                target: name.clone(),
                ttft_p50_ms: Spread::of(mine.iter().map(|g| g.p50)).unwrap_or_default(),
                ttft_p90_ms: Spread::of(mine.iter().map(|g| g.p90)).unwrap_or_default(),
                added_p50_ms: added(|g| g.p50),
                added_p90_ms: added(|g| g.p90),
                errors: mine.iter().map(|g| g.errors).sum(),
            }
        })
        .collect()
}

/// Markdown table of [`measure_added_latency`]'s rows.
pub fn added_latency_table(rows: &[AddedLatency]) -> String {
    let mut t = String::from(
        "| target | TTFT p50 ms | TTFT p90 ms | added p50 ms | added p90 ms | errors |\n|---|---|---|---|---|---|\n",
    );
    for r in rows {
        t.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            r.target,
            r.ttft_p50_ms.show(2, 1.0),
            r.ttft_p90_ms.show(2, 1.0),
            r.added_p50_ms.show(2, 1.0),
            r.added_p90_ms.show(2, 1.0),
            r.errors
        ));
    }
    t
}
