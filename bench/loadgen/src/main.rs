//! `loadgen`: run a workload against an OpenAI-compatible endpoint and print a JSON summary.

use clap::Parser;
use loadgen::{run, summarize, GatewayChoice, Target, Workload};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Multi-turn / shared-prefix load generator.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Base URL (repeat for several gateway replicas; sessions are spread over them).
    #[arg(long, required = true)]
    url: Vec<String>,
    /// Send each turn of a session through the next gateway (--url repeated), not all through one.
    #[arg(long)]
    gateway_per_turn: bool,
    /// YAML file with the workload (either the workload itself, or a scenario file with a
    /// `workload:` key).
    #[arg(long)]
    workload_file: std::path::PathBuf,
    /// Model name to send.
    #[arg(long, default_value = "llama-3.1-8b")]
    model: String,
    /// Pod time scale (to report latencies in simulated ms).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// KV page size for the oracle hit rate.
    #[arg(long, default_value_t = 16)]
    page: usize,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
    /// Also print every request record.
    #[arg(long)]
    records: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let text = std::fs::read_to_string(&a.workload_file)?;
    let v: serde_yaml::Value = serde_yaml::from_str(&text)?;
    let w: Workload = match v.get("workload") {
        Some(w) => serde_yaml::from_value(w.clone())?,
        None => serde_yaml::from_value(v)?,
    };
    let target = Target {
        urls: a.url.clone(),
        gateway_choice: if a.gateway_per_turn {
            GatewayChoice::PerTurn
        } else {
            GatewayChoice::PerSession
        },
        sticky: None,
        time_scale: a.time_scale,
        model: a.model.clone(),
        timeout: Duration::from_secs(a.timeout_s),
        page: a.page,
    };
    let t0 = Instant::now();
    let records = run(w.plan(), target, w.concurrency(), Arc::new(AtomicU64::new(0))).await;
    let s = summarize(&records, t0.elapsed().as_secs_f64(), a.time_scale);
    if a.records {
        println!("{}", serde_json::to_string_pretty(&records)?);
    }
    println!("{}", serde_json::to_string_pretty(&s)?);
    Ok(())
}
