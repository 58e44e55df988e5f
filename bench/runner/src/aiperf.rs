//! The published test's tool, run by us: NVIDIA AIPerf (GenAI-Perf's successor) drives a scenario's
//! multi-turn load through the gateway to podsim, once per policy with fresh pods, and its own report
//! becomes a row of our results. Anyone can repeat a row with the command line printed beside it.
//!
//! A scenario runs under AIPerf when its YAML says `driver: aiperf`. Its `workload` must be
//! `multi_turn`; the same numbers become AIPerf's conversation, ISL and OSL options. With
//! `aiperf.compare_with_loadgen: true` the runner also drives the same shape with our own load
//! generator on fresh pods, so the two tools' TTFT and hit rate can be compared in one run.
//!
//! Token counts: AIPerf sizes prompts and counts reply tokens with a tokenizer. The one built by
//! `bench/aiperf/make_tokenizer.py` counts exactly like podsim, so reply counts agree to the token;
//! AIPerf's input length counts the message text, while podsim's `usage.prompt_tokens` also counts
//! its chat template (5 tokens per message plus 5 for the generation prompt).

use crate::procs::{http_get, prom_value, redis_cmd, require, Redis, RedisUsage};
use crate::scenario::Scenario;
use crate::{start_gateway, start_pods, Paths};
use anyhow::{anyhow, bail, Context, Result};
use loadgen::Workload;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::process::Command;

/// The pinned AIPerf release `build.sh` installs.
pub const AIPERF_VERSION: &str = "0.13.0";

/// The `aiperf:` section of a scenario file.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct AiperfOptions {
    /// Also run the same shape through our load generator, for the agreement table.
    #[serde(default)]
    pub compare_with_loadgen: bool,
    /// Mean think time between a reply and the next turn (ms), AIPerf's
    /// `--conversation-turn-delay-mean`.
    #[serde(default)]
    pub turn_delay_ms_mean: f64,
    /// Per-request timeout (s).
    #[serde(default = "default_timeout_s")]
    pub request_timeout_s: u64,
}

fn default_timeout_s() -> u64 {
    600
}

/// The parts of a scenario file this module reads besides [`Scenario`].
#[derive(Debug, Clone, Deserialize)]
struct DriverSection {
    #[serde(default)]
    driver: Option<String>,
    #[serde(default)]
    aiperf: AiperfOptions,
}

/// `Some(options)` when the scenario file at `file` says `driver: aiperf`.
pub fn aiperf_options(file: &Path) -> Result<Option<AiperfOptions>> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let d: DriverSection =
        serde_yaml::from_str(&text).with_context(|| format!("parsing {}", file.display()))?;
    Ok((d.driver.as_deref() == Some("aiperf")).then_some(d.aiperf))
}

/// Where AIPerf and its tokenizer are: `AIPERF` (the executable) and `AIPERF_TOKENIZER` (a
/// directory with `tokenizer.json`) override the project-local install made by `build.sh`.
#[derive(Debug, Clone)]
pub struct AiperfInstall {
    /// The `aiperf` executable.
    pub bin: PathBuf,
    /// The podsim-compatible tokenizer directory.
    pub tokenizer: PathBuf,
}

impl AiperfInstall {
    /// Finds the install under workspace `root`, or says how to make it.
    pub fn locate(root: &Path) -> Result<AiperfInstall> {
        let bin = std::env::var_os("AIPERF")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join(".venv-aiperf/bin/aiperf"));
        let tokenizer = std::env::var_os("AIPERF_TOKENIZER")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("target/aiperf-tokenizer"));
        let hint = "install it with ./build.sh aiperf (or any ./build.sh bench run)";
        require(&bin, hint)?;
        require(&tokenizer.join("tokenizer.json"), hint)?;
        Ok(AiperfInstall { bin, tokenizer })
    }
}

/// AIPerf's arguments for `sc` against `url`, writing into `artifacts`.
pub fn command_args(
    sc: &Scenario,
    opts: &AiperfOptions,
    tokenizer: &Path,
    url: &str,
    artifacts: &Path,
) -> Result<Vec<String>> {
    let Workload::MultiTurn {
        sessions,
        turns_mean,
        turns_stddev,
        input_tokens_mean,
        input_tokens_stddev,
        output_tokens_mean,
        output_tokens_stddev,
        concurrency,
        system_prompt_tokens,
        session_prefix_tokens,
        think_time_ms_mean,
        arrival_rate_per_s,
        tool_rounds,
        tools_tokens,
        seed,
        ..
    } = &sc.workload
    else {
        bail!("scenario {}: the aiperf driver needs a multi_turn workload", sc.name);
    };
    if *system_prompt_tokens > 0 || *session_prefix_tokens > 0 {
        bail!("scenario {}: AIPerf has no shared system prompt or session document", sc.name);
    }
    if *tool_rounds || *tools_tokens > 0 {
        bail!("scenario {}: AIPerf's synthetic conversations have no tool rounds", sc.name);
    }
    if *think_time_ms_mean > 0.0 || arrival_rate_per_s.is_some() {
        bail!(
            "scenario {}: give AIPerf's think time as aiperf.turn_delay_ms_mean; open-loop arrivals are not mapped to AIPerf",
            sc.name
        );
    }
    let mut a: Vec<String> = [
        "profile",
        "--model",
        &sc.model,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        &tokenizer.to_string_lossy(),
        "--use-legacy-max-tokens",
        "--conversation-num",
        &sessions.to_string(),
        "--conversation-turn-mean",
        &turns_mean.to_string(),
        "--conversation-turn-stddev",
        &turns_stddev.to_string(),
        "--prompt-input-tokens-mean",
        &input_tokens_mean.to_string(),
        "--prompt-input-tokens-stddev",
        &input_tokens_stddev.to_string(),
        "--prompt-output-tokens-mean",
        &output_tokens_mean.to_string(),
        "--prompt-output-tokens-stddev",
        &output_tokens_stddev.to_string(),
        "--concurrency",
        &concurrency.to_string(),
        "--random-seed",
        &seed.to_string(),
        "--request-timeout-seconds",
        &opts.request_timeout_s.to_string(),
        "--output-artifact-dir",
        &artifacts.to_string_lossy(),
        "--ui-type",
        "none",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if opts.turn_delay_ms_mean > 0.0 {
        a.push("--conversation-turn-delay-mean".into());
        a.push(opts.turn_delay_ms_mean.to_string());
    }
    Ok(a)
}

/// The command line as a user would type it (temporary paths replaced by placeholders).
pub fn printable_command(args: &[String]) -> String {
    let mut out = String::from("aiperf");
    let mut prev = "";
    for a in args {
        let shown = match prev {
            "--url" => "http://<gateway>",
            "--tokenizer" => "target/aiperf-tokenizer",
            "--output-artifact-dir" => "<dir>",
            _ => a.as_str(),
        };
        out.push(' ');
        out.push_str(shown);
        prev = a.as_str();
    }
    out
}

/// avg / p50 / p90 / p99 of one AIPerf metric.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct Percentiles {
    /// Mean.
    pub avg: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// What AIPerf's `profile_export_aiperf.json` says about one run.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct AiperfReport {
    /// Requests that completed (success or error).
    pub requests: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Time to first token (ms).
    pub ttft_ms: Percentiles,
    /// Inter-token latency (ms).
    pub itl_ms: Percentiles,
    /// Request latency (ms).
    pub request_latency_ms: Percentiles,
    /// Output tokens per second, all requests.
    pub output_tokens_per_s: f64,
    /// Mean input sequence length as AIPerf counts it (message text).
    pub isl_mean: f64,
    /// Σ cached / Σ prompt tokens from the responses' `usage`.
    pub usage_cache_hit_rate: f64,
}

fn metric(doc: &Value, name: &str) -> Result<Percentiles> {
    let m = doc.get(name).ok_or_else(|| anyhow!("AIPerf report has no {name}"))?;
    let f = |k: &str| m.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    Ok(Percentiles { avg: f("avg"), p50: f("p50"), p90: f("p90"), p99: f("p99") })
}

fn scalar(doc: &Value, name: &str) -> f64 {
    doc.get(name).and_then(|m| m.get("avg")).and_then(Value::as_f64).unwrap_or(0.0)
}

/// Reads AIPerf's summary JSON.
pub fn parse_report(doc: &Value) -> Result<AiperfReport> {
    let prompt = scalar(doc, "total_usage_prompt_tokens");
    let cached = scalar(doc, "total_usage_prompt_cache_read_tokens");
    let errors = doc
        .get("error_summary")
        .and_then(Value::as_array)
        .map(|e| e.iter().filter_map(|x| x.get("count").and_then(Value::as_u64)).sum())
        .unwrap_or(0);
    Ok(AiperfReport {
        requests: scalar(doc, "request_count") as u64 + errors,
        errors,
        ttft_ms: metric(doc, "time_to_first_token")?,
        itl_ms: metric(doc, "inter_token_latency")?,
        request_latency_ms: metric(doc, "request_latency")?,
        output_tokens_per_s: scalar(doc, "output_token_throughput"),
        isl_mean: scalar(doc, "input_sequence_length"),
        usage_cache_hit_rate: if prompt > 0.0 { cached / prompt } else { 0.0 },
    })
}

/// One policy's row: AIPerf's view plus what the pods and Redis saw.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AiperfRow {
    /// Policy name.
    pub policy: String,
    /// AIPerf's report.
    pub aiperf: AiperfReport,
    /// Σ cached / Σ prompt tokens from the pods' counters.
    pub pods_hit_rate: f64,
    /// Requests served per pod.
    pub requests_per_pod: Vec<u64>,
    /// Redis command time per request (µs), as the bench's other scenarios count it.
    pub redis_usec_per_request: f64,
    /// Redis bytes in + out per request.
    pub redis_bytes_per_request: f64,
    /// The same shape through our load generator, when asked.
    pub loadgen: Option<LoadgenRow>,
    /// Per-request token usage from AIPerf's `profile_export.jsonl`.
    #[serde(skip)]
    pub turns: Vec<TurnUsage>,
}

/// One request of AIPerf's per-request export.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TurnUsage {
    /// AIPerf's conversation id.
    pub conversation: String,
    /// Turn index within the conversation (0-based).
    pub turn: u64,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// `usage.completion_tokens`.
    pub completion_tokens: u64,
    /// Reply tokens as AIPerf counted them with its tokenizer.
    pub client_output_tokens: u64,
}

/// Reads AIPerf's per-request JSONL export (lines it cannot read are skipped).
pub fn parse_turns(jsonl: &str) -> Vec<TurnUsage> {
    let num = |v: &Value, k: &str| {
        v.get("metrics").and_then(|m| m.get(k)).and_then(|m| m.get("value")).and_then(Value::as_u64)
    };
    jsonl
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| {
            let meta = v.get("metadata")?;
            Some(TurnUsage {
                conversation: meta.get("conversation_id")?.as_str()?.to_string(),
                turn: meta.get("turn_index")?.as_u64()?,
                prompt_tokens: num(&v, "usage_prompt_tokens")?,
                cached_tokens: num(&v, "usage_prompt_cache_read_tokens").unwrap_or(0),
                completion_tokens: num(&v, "usage_completion_tokens").unwrap_or(0),
                client_output_tokens: num(&v, "output_token_count").unwrap_or(0),
            })
        })
        .collect()
}

/// Our load generator on the same shape.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct LoadgenRow {
    /// TTFT mean (ms).
    pub ttft_mean_ms: f64,
    /// TTFT p50 (ms).
    pub ttft_p50_ms: f64,
    /// Σ cached / Σ prompt tokens from the pods' counters.
    pub pods_hit_rate: f64,
}

/// The pods' cache counters and request counts, read after a run.
struct PodTotals {
    hit_rate: f64,
    requests: Vec<u64>,
}

async fn pod_totals(pods: &[String]) -> Result<PodTotals> {
    let (mut prompt, mut cached, mut requests) = (0.0, 0.0, Vec::new());
    for p in pods {
        let m = http_get(p, "/metrics").await.with_context(|| format!("scraping {p}"))?;
        prompt += prom_value(&m, "podsim_prompt_tokens_total").unwrap_or(0.0);
        cached += prom_value(&m, "podsim_cached_tokens_total").unwrap_or(0.0);
        requests.push(prom_value(&m, "podsim_requests_total").unwrap_or(0.0) as u64);
    }
    Ok(PodTotals { hit_rate: if prompt > 0.0 { cached / prompt } else { 0.0 }, requests })
}

/// Runs AIPerf once for `policy` on fresh pods and a flushed Redis.
pub async fn run_policy(
    paths: &Paths,
    install: &AiperfInstall,
    sc: &Scenario,
    opts: &AiperfOptions,
    redis: &Redis,
    policy: &str,
) -> Result<AiperfRow> {
    let spec = crate::policy::lookup(policy)?;
    if spec.client_header() != crate::policy::ClientHeader::None {
        bail!("policy {policy} needs our load generator (AIPerf cannot send the session header)");
    }
    if !matches!(spec.route, crate::policy::Route::Gateway(_)) {
        bail!("policy {policy}: the AIPerf scenario runs our gateway's policies only");
    }
    let (pods_proc, pods) = start_pods(paths, sc).await?;
    redis_cmd(&redis.addr, &["FLUSHALL"]).await?;
    let (gw, addr) =
        start_gateway(paths, sc, policy, &pods, &redis.addr, &format!("aiperf-{policy}")).await?;
    if spec.scrapes_metrics() {
        // Let the first health checks store metrics.
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    redis_cmd(&redis.addr, &["CONFIG", "RESETSTAT"]).await?;
    let artifacts = std::env::temp_dir().join(format!(
        "bench-aiperf-{}-{}-{policy}",
        std::process::id(),
        sc.name
    ));
    let _ = std::fs::remove_dir_all(&artifacts);
    let args = command_args(sc, opts, &install.tokenizer, &format!("http://{addr}"), &artifacts)?;
    let out = Command::new(&install.bin)
        .args(&args)
        // AIPerf reads a local tokenizer path as a hub id when HF_HUB_OFFLINE is set.
        .env_remove("HF_HUB_OFFLINE")
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .current_dir(std::env::temp_dir())
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("running {}", install.bin.display()))?;
    let summary = artifacts.join("profile_export_aiperf.json");
    if !out.status.success() || !summary.exists() {
        let tail = |b: &[u8]| {
            let s = String::from_utf8_lossy(b);
            s.lines()
                .rev()
                .take(30)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n")
        };
        bail!("aiperf failed ({}):\n{}\n{}", out.status, tail(&out.stdout), tail(&out.stderr));
    }
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&summary)?)
        .with_context(|| format!("parsing {}", summary.display()))?;
    let report = parse_report(&doc)?;
    let turns = std::fs::read_to_string(artifacts.join("profile_export.jsonl"))
        .map(|t| parse_turns(&t))
        .unwrap_or_default();
    let usage = RedisUsage::since_reset(&redis.addr, 0.0).await.unwrap_or_default();
    let (usec, bytes) = (usage.script_usec, usage.bytes_in + usage.bytes_out);
    let totals = pod_totals(&pods).await?;
    gw.stop().await;
    pods_proc.stop().await;
    let _ = std::fs::remove_dir_all(&artifacts);
    let n = report.requests.max(1) as f64;
    Ok(AiperfRow {
        policy: policy.to_string(),
        aiperf: report,
        pods_hit_rate: totals.hit_rate,
        requests_per_pod: totals.requests,
        redis_usec_per_request: usec as f64 / n,
        redis_bytes_per_request: bytes as f64 / n,
        loadgen: None,
        turns,
    })
}

/// The same shape through our own load generator, for the agreement table.
pub async fn run_loadgen(
    paths: &Paths,
    sc: &Scenario,
    redis: &Redis,
    policy: &str,
) -> Result<LoadgenRow> {
    let progress = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let r = crate::run_policy(paths, sc, redis, policy, 1, 0, progress).await?;
    Ok(LoadgenRow {
        ttft_mean_ms: r.ttft_ms.mean,
        ttft_p50_ms: r.ttft_ms.p50,
        pods_hit_rate: r.prefix_hit_rate,
    })
}

/// What `bench run <aiperf scenario>` writes to `bench/results/<scenario>.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AiperfResults {
    /// Scenario name.
    pub scenario: String,
    /// Scenario description.
    pub description: String,
    /// Date, commit and machine (blank in a file written before the report carried them).
    #[serde(default)]
    pub stamp: crate::Stamp,
    /// When a file written before the stamp was made; None in newer ones (the stamp has it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unix_time: Option<u64>,
    /// AIPerf version.
    pub aiperf_version: String,
    /// The command line (per policy only the gateway URL differs).
    pub command: String,
    /// The scenario as run.
    pub config: Scenario,
    /// AIPerf options of the scenario.
    pub options: AiperfOptions,
    /// One row per policy.
    pub policies: Vec<AiperfRow>,
}

/// Runs scenario `sc` under AIPerf for each of its policies (fresh pods each), writes the JSON and
/// prints the table with the command line.
pub async fn run_scenario(paths: &Paths, sc: Scenario, opts: AiperfOptions) -> Result<()> {
    if sc.time_scale != 1.0 {
        bail!("scenario {}: AIPerf measures real time, so time_scale must be 1.0", sc.name);
    }
    let install = AiperfInstall::locate(&paths.root)?;
    let redis = Redis::start().await?;
    let mut rows = Vec::new();
    for policy in &sc.policies {
        eprintln!("aiperf: {} with {policy} ...", sc.name);
        let mut row = run_policy(paths, &install, &sc, &opts, &redis, policy).await?;
        if opts.compare_with_loadgen {
            eprintln!("loadgen: {} with {policy} ...", sc.name);
            row.loadgen = Some(run_loadgen(paths, &sc, &redis, policy).await?);
        }
        eprintln!(
            "{policy}: {} requests, {} errors, TTFT avg {:.0} ms, hit rate {:.1}%",
            row.aiperf.requests,
            row.aiperf.errors,
            row.aiperf.ttft_ms.avg,
            row.pods_hit_rate * 100.0
        );
        rows.push(row);
    }
    let args = command_args(&sc, &opts, &install.tokenizer, "u", Path::new("d"))?;
    let results = AiperfResults {
        scenario: sc.name.clone(),
        description: sc.description.clone(),
        stamp: crate::Stamp::now(&paths.root),
        unix_time: None,
        aiperf_version: AIPERF_VERSION.to_string(),
        command: printable_command(&args),
        config: sc.clone(),
        options: opts,
        policies: rows,
    };
    std::fs::create_dir_all(&paths.results)?;
    let json_path = paths.results.join(format!("{}.json", sc.name));
    std::fs::write(&json_path, serde_json::to_string_pretty(&results)?)?;
    println!("\n{}: {}\n", sc.name, sc.description);
    print!("{}", table(&results.policies));
    println!("\nAIPerf {AIPERF_VERSION}: {}", results.command);
    println!("\nwrote {}", json_path.display());
    Ok(())
}

impl AiperfResults {
    /// Markdown for the README: what was run (AIPerf's command line), the stamp line and the table.
    pub fn section(&self) -> String {
        format!(
            "`{}` (NVIDIA AIPerf {}): {}\n\n{} · profile `{}` · one run per policy, fresh pods each · real ms\n\nAIPerf's command (per policy only the gateway URL differs): `{}`\n\n{}",
            self.scenario,
            self.aiperf_version,
            self.description,
            crate::tables::stamp_text(&self.stamp, self.unix_time),
            self.config.pods.profile,
            self.command,
            table(&self.policies)
        )
    }
}

#[cfg(test)]
impl AiperfResults {
    /// A small results file: one policy, with the load generator's agreement row, stamped.
    pub(crate) fn example() -> AiperfResults {
        let p = |avg, p50, p90, p99| Percentiles { avg, p50, p90, p99 };
        AiperfResults {
            scenario: "t-aiperf".into(),
            description: "d".into(),
            stamp: crate::Stamp::example(),
            unix_time: None,
            aiperf_version: AIPERF_VERSION.into(),
            command: "aiperf profile --model llama-3.1-8b".into(),
            config: serde_yaml::from_str(
                "name: t-aiperf\ntime_scale: 1.0\npods: {count: 3}\nworkload: {kind: multi_turn, sessions: 60, turns_mean: 5, input_tokens_mean: 200, output_tokens_mean: 800}\n",
            )
            .expect("scenario"),
            options: AiperfOptions { compare_with_loadgen: true, ..Default::default() },
            policies: vec![AiperfRow {
                policy: "prefix_cache".into(),
                aiperf: AiperfReport {
                    requests: 300,
                    errors: 0,
                    ttft_ms: p(40.0, 34.0, 51.0, 110.0),
                    itl_ms: p(7.2, 7.1, 8.0, 8.5),
                    request_latency_ms: p(5840.0, 5800.0, 7900.0, 9800.0),
                    output_tokens_per_s: 2489.0,
                    isl_mean: 2188.0,
                    usage_cache_hit_rate: 0.901,
                },
                pods_hit_rate: 0.901,
                requests_per_pod: vec![100, 100, 100],
                redis_usec_per_request: 332.3,
                redis_bytes_per_request: 3162.0,
                loadgen: Some(LoadgenRow {
                    ttft_mean_ms: 40.0,
                    ttft_p50_ms: 33.0,
                    pods_hit_rate: 0.9,
                }),
                turns: Vec::new(),
            }],
        }
    }
}

/// The results table (Markdown), with the agreement columns when loadgen ran too.
pub fn table(rows: &[AiperfRow]) -> String {
    let mut t = String::from(
        "| policy | req | err | TTFT avg | TTFT p50 | TTFT p90 | TTFT p99 | ITL avg | req latency avg | out tok/s | hit rate (pods) | hit rate (usage) | redis µs/req | redis B/req |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let a = &r.aiperf;
        t.push_str(&format!(
            "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {:.0} | {:.0} | {:.1}% | {:.1}% | {:.1} | {:.0} |\n",
            r.policy,
            a.requests,
            a.errors,
            a.ttft_ms.avg,
            a.ttft_ms.p50,
            a.ttft_ms.p90,
            a.ttft_ms.p99,
            a.itl_ms.avg,
            a.request_latency_ms.avg,
            a.output_tokens_per_s,
            r.pods_hit_rate * 100.0,
            a.usage_cache_hit_rate * 100.0,
            r.redis_usec_per_request,
            r.redis_bytes_per_request,
        ));
    }
    if rows.iter().any(|r| r.loadgen.is_some()) {
        t.push_str("\nAgreement with our load generator (same shape, fresh pods):\n\n| policy | TTFT avg AIPerf | TTFT mean loadgen | ratio | hit rate AIPerf (pods) | hit rate loadgen (pods) | difference |\n|---|---|---|---|---|---|---|\n");
        for r in rows {
            let Some(l) = r.loadgen else { continue };
            t.push_str(&format!(
                "| {} | {:.0} | {:.0} | {:.2} | {:.1}% | {:.1}% | {:+.1} pt |\n",
                r.policy,
                r.aiperf.ttft_ms.avg,
                l.ttft_mean_ms,
                if l.ttft_mean_ms > 0.0 { r.aiperf.ttft_ms.avg / l.ttft_mean_ms } else { 0.0 },
                r.pods_hit_rate * 100.0,
                l.pods_hit_rate * 100.0,
                (r.pods_hit_rate - l.pods_hit_rate) * 100.0,
            ));
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seed_like() -> Scenario {
        serde_yaml::from_str(
            "name: t\ntime_scale: 1.0\npods: {count: 3}\nworkload: {kind: multi_turn, sessions: 60, turns_mean: 5, input_tokens_mean: 200, input_tokens_stddev: 40, output_tokens_mean: 800, output_tokens_stddev: 160, concurrency: 20, seed: 7}\n",
        )
        .expect("scenario")
    }

    #[test]
    fn the_workload_becomes_aiperf_options() {
        let a = command_args(
            &seed_like(),
            &AiperfOptions { turn_delay_ms_mean: 500.0, ..Default::default() },
            Path::new("/tok"),
            "http://127.0.0.1:1",
            Path::new("/out"),
        )
        .expect("args");
        let after = |flag: &str| {
            let i = a.iter().position(|x| x == flag).unwrap_or_else(|| panic!("{flag} missing"));
            a[i + 1].clone()
        };
        assert_eq!(after("--conversation-num"), "60");
        assert_eq!(after("--conversation-turn-mean"), "5");
        assert_eq!(after("--prompt-input-tokens-mean"), "200");
        assert_eq!(after("--prompt-input-tokens-stddev"), "40");
        assert_eq!(after("--prompt-output-tokens-mean"), "800");
        assert_eq!(after("--prompt-output-tokens-stddev"), "160");
        assert_eq!(after("--concurrency"), "20");
        assert_eq!(after("--random-seed"), "7");
        assert_eq!(after("--conversation-turn-delay-mean"), "500");
        assert_eq!(after("--tokenizer"), "/tok");
        assert!(a.contains(&"--use-legacy-max-tokens".to_string()), "pods read max_tokens");
        let shown = printable_command(&a);
        assert!(shown.starts_with("aiperf profile --model llama-3.1-8b --url http://<gateway>"));
        assert!(shown.contains("--tokenizer target/aiperf-tokenizer"));
    }

    #[test]
    fn a_shared_system_prompt_is_refused() {
        let sc: Scenario = serde_yaml::from_str(
            "name: t\npods: {count: 1}\nworkload: {kind: multi_turn, sessions: 1, turns_mean: 1, input_tokens_mean: 1, output_tokens_mean: 1, system_prompt_tokens: 100}\n",
        )
        .expect("scenario");
        let e = command_args(&sc, &AiperfOptions::default(), Path::new("/t"), "u", Path::new("/o"));
        assert!(e.is_err());
    }

    #[test]
    fn the_summary_json_is_read() {
        let doc: Value =
            serde_json::from_str(include_str!("../testdata/profile_export_aiperf.json"))
                .expect("sample");
        let r = parse_report(&doc).expect("report");
        assert_eq!(r.requests, 9);
        assert_eq!(r.errors, 0);
        assert!((r.ttft_ms.avg - 25.079).abs() < 0.01, "{:?}", r.ttft_ms);
        assert!((r.ttft_ms.p90 - 30.572).abs() < 0.01);
        assert!((r.itl_ms.avg - 6.1197).abs() < 0.01);
        assert!((r.output_tokens_per_s - 208.91).abs() < 0.01);
        assert!((r.usage_cache_hit_rate - 720.0 / 1125.0).abs() < 1e-9);
    }

    #[test]
    fn per_request_usage_is_read() {
        let line = r#"{"metadata":{"conversation_id":"session_000001","turn_index":1},"metrics":{"usage_prompt_tokens":{"value":140,"unit":"tokens"},"usage_prompt_cache_read_tokens":{"value":80,"unit":"tokens"},"usage_completion_tokens":{"value":20,"unit":"tokens"},"output_token_count":{"value":20,"unit":"tokens"}}}"#;
        let t = parse_turns(&format!("{line}\nnot json\n"));
        assert_eq!(
            t,
            vec![TurnUsage {
                conversation: "session_000001".into(),
                turn: 1,
                prompt_tokens: 140,
                cached_tokens: 80,
                completion_tokens: 20,
                client_output_tokens: 20,
            }]
        );
    }

    #[test]
    fn the_results_file_reads_back_as_a_stamped_section() {
        let json = serde_json::to_string(&AiperfResults::example()).expect("json");
        let md = serde_json::from_str::<AiperfResults>(&json).expect("read").section();
        assert!(md.starts_with("`t-aiperf` (NVIDIA AIPerf 0.13.0): d\n\n"), "{md}");
        assert!(md.contains("2026-11-24 07:49 UTC · commit `abc123` · vm · profile `h100-8b`"));
        assert!(md.contains(
            "per policy only the gateway URL differs): `aiperf profile --model llama-3.1-8b`"
        ));
        assert!(
            md.contains("| prefix_cache | 300 | 0 | 40 | 34 | 51 | 110 | 7.2 | 5840 | 2489 | 90.1% | 90.1% | 332.3 | 3162 |"),
            "{md}"
        );
        assert!(md.contains("| prefix_cache | 40 | 40 | 1.00 | 90.1% | 90.0% | +0.1 pt |"), "{md}");

        // A file written before the stamp: the run's date only.
        let mut old = serde_json::to_value(AiperfResults::example()).expect("value");
        let o = old.as_object_mut().expect("object");
        o.remove("stamp");
        o.insert("unix_time".into(), 1_795_358_038u64.into());
        let md = serde_json::from_value::<AiperfResults>(old).expect("old file").section();
        assert!(
            md.contains("\n\n2026-11-22 14:33 UTC · commit and machine not recorded (written before this report carried a stamp) · profile"),
            "{md}"
        );
        assert!(md.contains("| prefix_cache | 300 | 0 | 40 |"), "{md}");
    }

    #[test]
    fn the_driver_key_selects_aiperf() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios");
        let o = aiperf_options(&Path::new(dir).join("seed-aiperf.yaml")).expect("read");
        assert!(o.is_some_and(|o| o.compare_with_loadgen));
        assert_eq!(aiperf_options(&Path::new(dir).join("seed.yaml")).expect("read"), None);
    }
}
