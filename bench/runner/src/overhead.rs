//! `bench run overhead`: what the gateway host and the plugin add to one request, in one run.
//!
//! Rows, each measured as `requests` sequential requests on one keep-alive connection (after a
//! warm-up), repeated `reps` times in interleaved order, medians over the repetitions:
//! - `direct`: the client straight to a pod (the floor);
//! - `plain proxy`: through a gateway without plugin (1 worker, round robin over 2 pods);
//! - one row per policy: the same gateway with the compiled plugin (`global_least_request` and
//!   `prefix_cache` make one Redis call before the request leaves, `endpoint_metrics` none: it
//!   reads the metrics the host's health check keeps; `prefix_cache loadAware` both);
//! - `redis round trip`: a bare `PING` on one connection to the same `redis-server`.
//!
//! For the policy rows, `plugin CPU` is the time spent inside the plugin VM per request
//! (`gateway_vm_call_seconds_total` delta / requests: every callback, hostcalls included) and
//! `redis cmds` the commands Redis processed per request. The target of issue #8: with one Redis
//! call, gateway-added p50 at most plain proxy + Redis round trip + 0.2 ms (the `budget` column).
//!
//! Three shapes: `overhead`, a short chat and short `/metrics` bodies (what the plugin itself adds);
//! `overhead-large`, a 16 KB system prompt and pods whose `/metrics` is the size of a real vLLM's
//! (40 KB: every request reads every pod's stored body through the host list); and
//! `overhead-stream`, the short chat answered as a stream of about 200 SSE chunks, usage last.
//! An engine streams a chat answer a token per chunk, and the plugin is called for each chunk, so
//! for streamed traffic its cost per chunk (`plugin µs/chunk`: the time inside
//! `proxy_on_response_body` over its calls) weighs more than its cost per request.
//!
//! With `BENCH_BASELINE_WASM=<path to a .wasm>` every policy row runs a second time with that
//! module (rows marked `(baseline)`), interleaved with the others: a change to the plugin is
//! measured against the build before it in the same run.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};
use testkit::gateway::{redis_lb_config, LLM_CLUSTER};
use testkit::{Gateway, GatewayConfig, Pod, RedisFixture};

use crate::stats::interleaved;

/// The plugin policies measured.
const POLICIES: [&str; 4] =
    ["global_least_request", "prefix_cache", "endpoint_metrics", "prefix_cache loadAware"];

/// What each request and each pod's `/metrics` look like.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Shape {
    /// Bytes of system prompt before the short user message (0: none).
    pub system_prompt_bytes: usize,
    /// Least bytes of each pod's `/metrics` body (0: the short vLLM V1 sample).
    pub pod_metrics_bytes: usize,
    /// Words of a streamed answer, one SSE chunk each (0: the answer is not streamed).
    #[serde(default)]
    pub stream_words: usize,
}

impl Shape {
    /// `overhead-large`: a long system prompt, pods' metrics the size of a real vLLM's.
    pub const LARGE: Shape =
        Shape { system_prompt_bytes: 16_000, pod_metrics_bytes: 40_000, stream_words: 0 };

    /// `overhead-stream`: the short chat, its answer streamed as 200 chunks (a chat answer of 200
    /// tokens, as an engine streams it).
    pub const STREAM: Shape =
        Shape { system_prompt_bytes: 0, pod_metrics_bytes: 0, stream_words: 200 };

    /// The shape a `bench run` name asks for: `overhead`, `overhead-large` or `overhead-stream`.
    pub fn named(name: &str) -> Option<Shape> {
        [Shape::default(), Shape::LARGE, Shape::STREAM].into_iter().find(|s| s.name() == name)
    }

    /// The results' name.
    pub fn name(&self) -> &'static str {
        if *self == Shape::default() {
            "overhead"
        } else if self.stream_words > 0 {
            "overhead-stream"
        } else {
            "overhead-large"
        }
    }

    fn describe(&self) -> String {
        if *self == Shape::default() {
            "a short chat, short pod metrics".to_string()
        } else if self.stream_words > 0 {
            // The stub pods stream "Hello from <pod>" before the words asked for.
            format!(
                "a short chat answered as a stream of {} word chunks, a finish chunk, a usage chunk and `[DONE]`, short pod metrics",
                self.stream_words + 3
            )
        } else {
            format!(
                "a {} B system prompt, each pod's `/metrics` {} B as a real vLLM's",
                self.system_prompt_bytes, self.pod_metrics_bytes
            )
        }
    }
}
/// Unmeasured requests before each row.
const WARMUP: usize = 50;

/// One row of one repetition.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sample {
    /// Row name.
    pub row: String,
    /// Repetition.
    pub rep: usize,
    /// Median latency (ms).
    pub p50_ms: f64,
    /// 99th percentile latency (ms).
    pub p99_ms: f64,
    /// Plugin VM time per request (ms), policy rows only.
    pub plugin_cpu_ms: Option<f64>,
    /// Redis commands per request, policy rows only.
    pub redis_cmds: Option<f64>,
    /// Plugin VM time per response body callback (µs), policy rows only.
    #[serde(default)]
    pub chunk_us: Option<f64>,
}

/// A row's medians over the repetitions.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    /// Row name.
    pub row: String,
    /// Median of the repetitions' p50 (ms).
    pub p50_ms: f64,
    /// Median of the repetitions' p99 (ms).
    pub p99_ms: f64,
    /// Median plugin VM time per request (ms).
    pub plugin_cpu_ms: Option<f64>,
    /// Median Redis commands per request.
    pub redis_cmds: Option<f64>,
    /// Median plugin VM time per response body callback (µs).
    #[serde(default)]
    pub chunk_us: Option<f64>,
}

/// `bench/results/overhead.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OverheadResults {
    /// Date, commit and machine (blank in a file written before the report carried them).
    #[serde(default)]
    pub stamp: crate::Stamp,
    /// The requests' and pods' shape (the short one in a file written before it was recorded).
    #[serde(default)]
    pub shape: Shape,
    /// Repetitions (interleaved).
    pub reps: usize,
    /// Measured requests per row and repetition.
    pub requests: usize,
    /// The module of the `(baseline)` rows (`BENCH_BASELINE_WASM`), if any.
    #[serde(default)]
    pub baseline_wasm: Option<String>,
    /// Each row's medians, in measuring order (`direct` first).
    pub rows: Vec<Row>,
    /// Every row of every repetition.
    pub samples: Vec<Sample>,
}

impl OverheadResults {
    /// Markdown for the README: what was run, the stamp line and the table.
    pub fn section(&self) -> String {
        let baseline = self
            .baseline_wasm
            .as_deref()
            .map(|w| format!("; rows marked (baseline) load `{w}`"))
            .unwrap_or_default();
        format!(
            "`{name}` (`bench run {name} --reps {reps}`): what the gateway host and the plugin add to one request, {} sequential keep-alive requests per row (one gateway worker, 2 stub pods; {}{baseline}), medians\n\n{} · {reps} repetitions, interleaved · real ms\n\n{}",
            self.requests,
            self.shape.describe(),
            crate::tables::stamp_text(&self.stamp, None),
            table(&self.rows),
            reps = self.reps,
            name = self.shape.name(),
        )
    }
}

#[cfg(test)]
impl OverheadResults {
    /// A small results file: one repetition of four rows, stamped.
    pub(crate) fn example() -> OverheadResults {
        let row = |row: &str, p50_ms, p99_ms, plugin_cpu_ms, redis_cmds| Sample {
            row: row.into(),
            rep: 0,
            p50_ms,
            p99_ms,
            plugin_cpu_ms,
            redis_cmds,
            chunk_us: None,
        };
        let samples = vec![
            row("direct", 0.05, 0.17, None, None),
            row("plain proxy", 0.10, 0.27, None, None),
            row("prefix_cache", 0.33, 0.68, Some(0.046), Some(11.0)),
            row("redis round trip", 0.065, 0.2, None, None),
        ];
        let order: Vec<String> = samples.iter().map(|s| s.row.clone()).collect();
        OverheadResults {
            stamp: crate::Stamp::example(),
            shape: Shape::default(),
            reps: 1,
            requests: 2000,
            baseline_wasm: None,
            rows: summarize(&order, &samples),
            samples,
        }
    }
}

/// What a row measures.
enum Target {
    Http(SocketAddr, Option<usize>),
    Redis(SocketAddr),
}

/// Runs the scenario and prints the table; writes `bench/results/overhead.json`.
pub async fn run(paths: &crate::Paths, reps: usize, requests: usize, shape: Shape) -> Result<()> {
    if requests < 1000 {
        bail!("overhead needs at least 1000 requests per row (got {requests})");
    }
    let redis = RedisFixture::start().await?;
    let pods = vec![Pod::start("overhead-0").await?, Pod::start("overhead-1").await?];
    for p in &pods {
        p.set_metrics(match shape.pod_metrics_bytes {
            0 => testkit::samples::vllm_v1(0, 0, 0.1),
            n => testkit::samples::vllm_v1_full(0, 0, 0.1, n),
        });
    }
    for p in &pods {
        p.set_stream_extra_words(shape.stream_words);
    }
    let hosts: Vec<String> = pods.iter().map(Pod::host).collect();
    let base = |route: &str| {
        GatewayConfig::new()
            .route(route, "/", LLM_CLUSTER)
            .cluster(LLM_CLUSTER, &hosts)
            .redis(&redis.endpoint())
            .workers(1)
            .log_level("warn")
    };
    let baseline = std::env::var_os("BENCH_BASELINE_WASM").map(std::path::PathBuf::from);
    if let Some(b) = &baseline {
        if !b.is_file() {
            bail!("BENCH_BASELINE_WASM: no file {}", b.display());
        }
    }
    let modules: Vec<(&str, std::path::PathBuf)> =
        std::iter::once(("", testkit::paths::plugin_wasm()))
            .chain(baseline.iter().map(|b| (" (baseline)", b.clone())))
            .collect();
    let mut gateways = vec![("plain proxy".to_string(), Gateway::start(&base("plain")).await?)];
    for policy in POLICIES {
        for (suffix, module) in &modules {
            let cfg = if policy == "endpoint_metrics" {
                base(policy)
                    .plugin_module(module, json!({"lb_policy": policy, "lb_config": {}}))
                    .metrics_health_check(LLM_CLUSTER, 200)
            } else if policy == "prefix_cache loadAware" {
                let mut lb = redis_lb_config();
                lb["loadAware"] = json!(true);
                lb["splitSystemPrompt"] = json!(true);
                base("load_aware")
                    .plugin_module(module, json!({"lb_policy": "prefix_cache", "lb_config": lb}))
                    .metrics_health_check(LLM_CLUSTER, 200)
            } else {
                base(policy).plugin_module(
                    module,
                    json!({"lb_policy": policy, "lb_config": redis_lb_config()}),
                )
            };
            gateways.push((format!("{policy}{suffix}"), Gateway::start(&cfg).await?));
        }
    }
    let mut rows: Vec<(String, Target)> =
        vec![("direct".into(), Target::Http(pods[0].addr(), None))];
    for (i, (name, gw)) in gateways.iter().enumerate() {
        rows.push((name.clone(), Target::Http(gw.addr(), Some(i))));
    }
    rows.push(("redis round trip".into(), Target::Redis(redis.addr())));

    let mut samples = Vec::new();
    for (rep, k) in interleaved(rows.len(), reps) {
        let (name, target) = &rows[k];
        let sample = match target {
            Target::Redis(addr) => {
                let addr = *addr;
                let lat =
                    tokio::task::spawn_blocking(move || redis_pings(addr, requests)).await??;
                sample(name, rep, lat, None, None, None)
            }
            Target::Http(addr, gw) => {
                let gw = gw.map(|i| &gateways[i].1);
                let before = match gw {
                    Some(g) => Some(counters(g, &redis).await?),
                    None => None,
                };
                let addr = *addr;
                let lat = tokio::task::spawn_blocking(move || http_requests(addr, requests, shape))
                    .await??;
                // Late callbacks (the release's Redis reply) land within a few ms.
                tokio::time::sleep(Duration::from_millis(100)).await;
                let (cpu, cmds, chunk) = match (gw, before) {
                    (Some(g), Some(c0)) if name != "plain proxy" => {
                        let c1 = counters(g, &redis).await?;
                        let n = (requests + WARMUP) as f64;
                        let chunks = c1.chunk_calls - c0.chunk_calls;
                        let chunk_us = (chunks > 0.0)
                            .then(|| (c1.chunk_seconds - c0.chunk_seconds) * 1e6 / chunks);
                        (
                            Some((c1.vm_seconds - c0.vm_seconds) * 1e3 / n),
                            Some((c1.redis_commands - c0.redis_commands) / n),
                            chunk_us,
                        )
                    }
                    _ => (None, None, None),
                };
                sample(name, rep, lat, cpu, cmds, chunk)
            }
        };
        eprintln!(
            "{:<22} #{}: p50 {:.3} ms  p99 {:.3} ms{}{}",
            sample.row,
            rep + 1,
            sample.p50_ms,
            sample.p99_ms,
            sample.plugin_cpu_ms.map(|c| format!("  plugin {c:.3} ms")).unwrap_or_default(),
            sample.chunk_us.map(|c| format!("  {c:.2} us/chunk")).unwrap_or_default()
        );
        samples.push(sample);
    }
    for (_, mut gw) in gateways {
        gw.check_no_traps()?;
        gw.kill();
    }
    let results = OverheadResults {
        stamp: crate::Stamp::now(&paths.root),
        shape,
        reps,
        requests,
        baseline_wasm: baseline.map(|b| b.display().to_string()),
        rows: summarize(&rows.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(), &samples),
        samples,
    };
    println!("{}", markdown(&results.rows, reps, requests));
    std::fs::create_dir_all(&paths.results)?;
    let path = paths.results.join(format!("{}.json", shape.name()));
    std::fs::write(&path, serde_json::to_string_pretty(&results)?)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// A gateway's and Redis's counters before and after a row.
struct Counters {
    /// `gateway_vm_call_seconds_total`: every plugin callback.
    vm_seconds: f64,
    /// Calls of and seconds in `proxy_on_response_body`.
    chunk_calls: f64,
    chunk_seconds: f64,
    /// Redis `total_commands_processed`.
    redis_commands: f64,
}

async fn counters(gw: &Gateway, redis: &RedisFixture) -> Result<Counters> {
    let stats = gw.stats().await?;
    let stat = |name: &str, labels: &[(&str, &str)]| {
        testkit::gateway::prom_sum(&stats, name, labels).unwrap_or(0.0)
    };
    let body = [("callback", "proxy_on_response_body")];
    let vm_seconds = stat("gateway_vm_call_seconds_total", &[]);
    let chunk_calls = stat("gateway_vm_callback_calls_total", &body);
    let chunk_seconds = stat("gateway_vm_callback_seconds_total", &body);
    let info = redis.client().await?.cmd(&["INFO", "stats"]).await?;
    let info = info.as_string().unwrap_or_default();
    let cmds = info
        .lines()
        .find_map(|l| l.strip_prefix("total_commands_processed:"))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .context("no total_commands_processed in INFO stats")?;
    // The INFO call itself counts one command.
    Ok(Counters { vm_seconds, chunk_calls, chunk_seconds, redis_commands: cmds - 1.0 })
}

fn sample(
    row: &str,
    rep: usize,
    mut lat: Vec<Duration>,
    plugin_cpu_ms: Option<f64>,
    redis_cmds: Option<f64>,
    chunk_us: Option<f64>,
) -> Sample {
    lat.sort();
    let at = |q: f64| {
        let i = ((lat.len() as f64 - 1.0) * q).round() as usize;
        lat.get(i).map(|d| d.as_secs_f64() * 1e3).unwrap_or(f64::NAN)
    };
    Sample {
        row: row.to_string(),
        rep,
        p50_ms: at(0.5),
        p99_ms: at(0.99),
        plugin_cpu_ms,
        redis_cmds,
        chunk_us,
    }
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

fn summarize(order: &[String], samples: &[Sample]) -> Vec<Row> {
    order
        .iter()
        .map(|name| {
            let of = |f: &dyn Fn(&Sample) -> Option<f64>| {
                median(samples.iter().filter(|s| &s.row == name).filter_map(f).collect())
            };
            Row {
                row: name.clone(),
                p50_ms: of(&|s| Some(s.p50_ms)).unwrap_or(f64::NAN),
                p99_ms: of(&|s| Some(s.p99_ms)).unwrap_or(f64::NAN),
                plugin_cpu_ms: of(&|s| s.plugin_cpu_ms),
                redis_cmds: of(&|s| s.redis_cmds),
                chunk_us: of(&|s| s.chunk_us),
            }
        })
        .collect()
}

/// The table under a line saying what was measured, as printed after a run.
fn markdown(rows: &[Row], reps: usize, requests: usize) -> String {
    format!(
        "{requests} sequential keep-alive requests per row, {reps} interleaved repetitions, medians\n\n{}",
        table(rows)
    )
}

/// The README table: each row's p50/p99, the gateway-added p50 (over `direct`), and for the
/// policies the budget plain proxy + Redis round trip + 0.2 ms; with streamed answers, the plugin's
/// time per response chunk too.
pub fn table(rows: &[Row]) -> String {
    let p50 = |n: &str| rows.iter().find(|r| r.row == n).map(|r| r.p50_ms).unwrap_or(f64::NAN);
    let (direct, plain, rtt) = (p50("direct"), p50("plain proxy"), p50("redis round trip"));
    let chunks = rows.iter().any(|r| r.chunk_us.is_some());
    let mut out = String::from(
        "| row | p50 ms | p99 ms | added p50 ms | plugin CPU ms/req | Redis cmds/req | budget p50 ms |",
    );
    out.push_str(if chunks { " plugin µs/chunk |\n" } else { "\n" });
    out.push_str("|---|---:|---:|---:|---:|---:|---:|");
    out.push_str(if chunks { "---:|\n" } else { "\n" });
    for r in rows {
        let added = if r.row == "direct" || r.row == "redis round trip" {
            "".to_string()
        } else {
            format!("{:.3}", r.p50_ms - direct)
        };
        let budget = match r.redis_cmds {
            Some(c) if c > 0.5 => format!("{:.3}", plain + rtt + 0.2),
            _ => String::new(),
        };
        out.push_str(&format!(
            "| {} | {:.3} | {:.3} | {added} | {} | {} | {budget} |",
            r.row,
            r.p50_ms,
            r.p99_ms,
            r.plugin_cpu_ms.map(|c| format!("{c:.3}")).unwrap_or_default(),
            r.redis_cmds.map(|c| format!("{c:.2}")).unwrap_or_default(),
        ));
        if chunks {
            out.push_str(&format!(
                " {} |",
                r.chunk_us.map(|c| format!("{c:.2}")).unwrap_or_default()
            ));
        }
        out.push('\n');
    }
    out
}

/// `n` sequential chat requests on one keep-alive connection (after a warm-up); their latencies.
fn http_requests(addr: SocketAddr, n: usize, shape: Shape) -> Result<Vec<Duration>> {
    let stream = TcpStream::connect(addr).with_context(|| format!("connect {addr}"))?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut w = stream.try_clone()?;
    let mut r = BufReader::new(stream);
    let mut lat = Vec::with_capacity(n);
    let system =
        "You are a careful assistant; answer briefly. ".repeat(shape.system_prompt_bytes / 45);
    for i in 0..WARMUP + n {
        let user = json!({"role": "user", "content": format!("overhead request {i}: say hi")});
        let messages = if system.is_empty() {
            json!([user])
        } else {
            json!([{"role": "system", "content": system}, user])
        };
        let mut body = json!({
            "model": testkit::samples::MODEL,
            "messages": messages,
            "max_tokens": 8
        });
        if shape.stream_words > 0 {
            body["max_tokens"] = json!(shape.stream_words + 3);
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        let body = body.to_string();
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let started = Instant::now();
        w.write_all(req.as_bytes())?;
        let status = read_response(&mut r)?;
        let took = started.elapsed();
        if status != 200 {
            bail!("request {i} to {addr}: status {status}");
        }
        if i >= WARMUP {
            lat.push(took);
        }
    }
    Ok(lat)
}

/// Reads one HTTP/1.1 response (Content-Length or chunked); its status.
fn read_response(r: &mut impl BufRead) -> Result<u16> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("bad status line {line:?}"))?;
    let (mut len, mut chunked) = (0usize, false);
    loop {
        line.clear();
        r.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let lower = l.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            len = v.trim().parse()?;
        } else if lower.starts_with("transfer-encoding:") && lower.contains("chunked") {
            chunked = true;
        }
    }
    if !chunked {
        std::io::copy(&mut r.take(len as u64), &mut std::io::sink())?;
        return Ok(status);
    }
    loop {
        line.clear();
        r.read_line(&mut line)?;
        let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or("0"), 16)?;
        std::io::copy(&mut r.take(size as u64 + 2), &mut std::io::sink())?;
        if size == 0 {
            return Ok(status);
        }
    }
}

/// `n` sequential `PING`s on one connection (after a warm-up); their round trips.
fn redis_pings(addr: SocketAddr, n: usize) -> Result<Vec<Duration>> {
    let stream = TcpStream::connect(addr)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut w = stream.try_clone()?;
    let mut r = BufReader::new(stream);
    let mut lat = Vec::with_capacity(n);
    let mut line = String::new();
    for i in 0..WARMUP + n {
        let started = Instant::now();
        w.write_all(b"*1\r\n$4\r\nPING\r\n")?;
        line.clear();
        r.read_line(&mut line)?;
        let took = started.elapsed();
        if line.trim_end() != "+PONG" {
            bail!("PING answered {line:?}");
        }
        if i >= WARMUP {
            lat.push(took);
        }
    }
    Ok(lat)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_shape_is_run_by_its_own_name() {
        assert_eq!(Shape::named("overhead"), Some(Shape::default()));
        assert_eq!(Shape::named("overhead-large"), Some(Shape::LARGE));
        assert_eq!(Shape::named("overhead-stream"), Some(Shape::STREAM));
        assert_eq!(Shape::named("seed"), None);
    }

    #[test]
    fn the_results_file_reads_back_as_a_stamped_section() {
        let json = serde_json::to_string(&OverheadResults::example()).expect("json");
        let md = serde_json::from_str::<OverheadResults>(&json).expect("read").section();
        assert!(md.starts_with("`overhead` (`bench run overhead --reps 1`): "), "{md}");
        assert!(md.contains("2000 sequential keep-alive requests per row"), "{md}");
        assert!(md.contains("\n\n2026-11-24 07:49 UTC · commit `abc123` · vm · 1 repetitions"));
        // Added over direct 0.28 ms; budget plain proxy + Redis round trip + 0.2 ms.
        assert!(md.contains("| prefix_cache | 0.330 | 0.680 | 0.280 | 0.046 | 11.00 | 0.365 |"));
        assert!(md.contains("| direct | 0.050 | 0.170 |  |  |  |  |"), "{md}");

        // A file written before the report carried a stamp.
        let mut old = serde_json::to_value(OverheadResults::example()).expect("value");
        old.as_object_mut().expect("object").remove("stamp");
        let md = serde_json::from_value::<OverheadResults>(old).expect("old file").section();
        assert!(md.contains("\n\nundated · commit and machine not recorded"), "{md}");
        assert!(md.contains("| prefix_cache | 0.330 |"), "{md}");
    }

    #[test]
    fn a_streamed_run_shows_the_time_per_chunk_and_its_baseline_module() {
        let mut results = OverheadResults::example();
        results.shape = Shape::STREAM;
        results.baseline_wasm = Some("/work/old.wasm".into());
        for s in &mut results.samples {
            if s.row == "prefix_cache" {
                s.chunk_us = Some(1.25);
            }
        }
        let order: Vec<String> = results.samples.iter().map(|s| s.row.clone()).collect();
        results.rows = summarize(&order, &results.samples);
        let json = serde_json::to_string(&results).expect("json");
        let md = serde_json::from_str::<OverheadResults>(&json).expect("read").section();
        assert!(
            md.starts_with("`overhead-stream` (`bench run overhead-stream --reps 1`): "),
            "{md}"
        );
        assert!(md.contains("a stream of 203 word chunks, a finish chunk, a usage chunk"), "{md}");
        assert!(md.contains("rows marked (baseline) load `/work/old.wasm`"), "{md}");
        assert!(md.contains("| budget p50 ms | plugin µs/chunk |"), "{md}");
        assert!(
            md.contains("| prefix_cache | 0.330 | 0.680 | 0.280 | 0.046 | 11.00 | 0.365 | 1.25 |")
        );
        assert!(md.contains("| direct | 0.050 | 0.170 |  |  |  |  |  |"), "{md}");
    }
}
