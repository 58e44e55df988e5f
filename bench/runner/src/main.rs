//! `bench`: `bench run <scenario>` (one run per policy, table + JSON + PNG) and `bench demo`.

use anyhow::{bail, Result};
use bench::procs::{redis_cmd, Redis, Resp};
use bench::{
    chart, load_scenario, run_policy, start_gateway, start_pods, stats, table, Paths, Report, Stamp,
};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Routing benchmark for the ai-load-balancer plugin.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    /// Workspace root (default: the source tree this binary was built from).
    #[arg(long, global = true)]
    root: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run a scenario (name in bench/scenarios/ or a YAML path): every policy, repeated in
    /// interleaved order.
    Run {
        /// Scenario name or file.
        scenario: String,
        /// Only these policies (comma-separated), default: the scenario's list.
        #[arg(long, value_delimiter = ',')]
        policies: Vec<String>,
        /// Repetitions per policy (default: the scenario's, 3 unless it says otherwise).
        #[arg(long)]
        reps: Option<usize>,
    },
    /// The scenario's workload through the pods' latency model alone (no HTTP, gateway or Redis),
    /// with round_robin and session_hash: what the model gives, in a second.
    Model {
        /// Scenario name or file.
        scenario: String,
    },
    /// The README's result tables from bench/results/*.json, stamped with date, commit, machine.
    Tables {
        /// Replace the generated part of README.md instead of printing.
        #[arg(long)]
        write: bool,
    },
    /// Two 5-turn conversations through one gateway with prefix_cache; checks session stickiness.
    Demo,
    /// What one routed request costs Redis (script time, main-thread CPU, bytes) with the plugin's
    /// scripts, beside a trivial EVALSHA floor; writes bench/results/redis-cost.json.
    RedisCost {
        /// Routed requests per repetition.
        #[arg(long, default_value_t = 20_000)]
        requests: u64,
        /// Repetitions per case (interleaved); medians are reported.
        #[arg(long, default_value_t = 3)]
        reps: usize,
    },
}

fn root(cli: &Cli) -> PathBuf {
    cli.root.clone().unwrap_or_else(|| {
        let p = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
        p.canonicalize().unwrap_or(p)
    })
}

async fn run(paths: Paths, name: String, only: Vec<String>, reps: Option<usize>) -> Result<()> {
    if name == "chaos" {
        // Faults, not a policy comparison: its own module.
        return bench::chaos::run(&paths).await.map(|_| ());
    }
    let mut sc = load_scenario(&paths, &name)?;
    if !only.is_empty() {
        sc.policies.retain(|p| only.contains(p));
    }
    if let Some(r) = reps {
        sc.repetitions = r;
    }
    sc.repetitions = sc.repetitions.max(1);
    if let Some(opts) = bench::aiperf::aiperf_options(&bench::scenario_file(&paths, &name))? {
        return bench::aiperf::run_scenario(&paths, sc, opts).await;
    }
    let redis = Redis::start().await?;
    let per_run = sc.workload.plan().iter().map(|s| s.turns.len()).sum::<usize>() as u64;
    let runs: Vec<(usize, String)> = sc
        .gateway_replicas
        .iter()
        .flat_map(|r| sc.policies.iter().map(move |p| (*r, p.clone())))
        .collect();
    let order = stats::interleaved(runs.len(), sc.repetitions);
    let bar = ProgressBar::new(per_run * order.len() as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests  {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut results = Vec::new();
    for (i, (rep, k)) in order.iter().enumerate() {
        let Some((replicas, policy)) = runs.get(*k) else { continue };
        bar.set_message(format!(
            "{policy} via {replicas} gateway(s), repetition {}/{}",
            rep + 1,
            sc.repetitions
        ));
        let progress = Arc::new(AtomicU64::new(0));
        let ticker = {
            let (bar, progress) = (bar.clone(), progress.clone());
            let base = per_run * i as u64;
            tokio::spawn(async move {
                loop {
                    bar.set_position(base + progress.load(Ordering::Relaxed));
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            })
        };
        let r = run_policy(&paths, &sc, &redis, policy, *replicas, *rep, progress).await;
        ticker.abort();
        let r = r?;
        bar.println(format!(
            "{policy} x{replicas} #{}: {} requests, {} errors, TTFT mean {:.0} ms, hit rate {:.1}%",
            rep + 1,
            r.requests,
            r.errors,
            r.ttft_ms.mean,
            r.prefix_hit_rate * 100.0
        ));
        results.push(r);
    }
    bar.finish_and_clear();
    let rep = Report {
        scenario: sc.name.clone(),
        description: sc.description.clone(),
        stamp: Stamp::now(&paths.root),
        time_scale: sc.time_scale,
        config: sc.clone(),
        policies: stats::aggregate(&results),
        runs: results,
    };
    std::fs::create_dir_all(&paths.results)?;
    let json_path = paths.results.join(format!("{}.json", sc.name));
    std::fs::write(&json_path, serde_json::to_string_pretty(&rep)?)?;
    let png_path = paths.results.join(format!("{}.png", sc.name));
    chart::draw(&rep, &png_path)?;
    println!(
        "\n{}: {}\n(median (min–max) of {} runs each, interleaved; latencies in simulated ms at time scale {}, profile {}; gateway added time in real ms)\n",
        sc.name, sc.description, sc.repetitions, sc.time_scale, sc.pods.profile
    );
    print!("{}", table(&rep));
    println!("\nwrote {} and {}", json_path.display(), png_path.display());
    Ok(())
}

fn tables(paths: Paths, write: bool) -> Result<()> {
    let (md, skipped) = bench::tables::render(&paths.results)?;
    for f in skipped {
        eprintln!("skipped {f}: not a `bench run` report of this version (re-run its scenario)");
    }
    if !write {
        print!("{md}");
        return Ok(());
    }
    let readme = paths.root.join("README.md");
    let text = std::fs::read_to_string(&readme)?;
    std::fs::write(&readme, bench::tables::splice(&text, &md)?)?;
    println!("updated {}", readme.display());
    Ok(())
}

fn model(paths: Paths, name: String) -> Result<()> {
    let sc = load_scenario(&paths, &name)?;
    println!("{} (model only, profile {}):\n", sc.name, sc.pods.profile);
    println!("| policy | req | TTFT mean | E2E mean | out tok/s | out tokens/reply | hit rate |");
    println!("|---|---|---|---|---|---|---|");
    for policy in ["round_robin", "session_hash"] {
        let r = bench::model::run(&sc, policy)?;
        println!(
            "| {policy} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1}% |",
            r.requests,
            r.ttft_mean_ms,
            r.e2e_mean_ms,
            r.output_tokens_per_s,
            r.output_tokens_mean,
            r.hit_rate * 100.0
        );
    }
    Ok(())
}

async fn redis_cost(paths: Paths, requests: u64, reps: usize) -> Result<()> {
    let rows = bench::redis_cost::measure(requests, reps).await?;
    let table = bench::redis_cost::table(&rows, reps);
    std::fs::create_dir_all(&paths.results)?;
    let out = paths.results.join("redis-cost.json");
    let json = serde_json::json!({
        "unix_time": SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "requests_per_rep": requests,
        "reps": reps,
        "cases": rows,
    });
    std::fs::write(&out, serde_json::to_string_pretty(&json)?)?;
    print!("{table}");
    println!("\nwrote {}", out.display());
    Ok(())
}

async fn demo(paths: Paths) -> Result<()> {
    let sc: bench::scenario::Scenario = serde_yaml::from_str(
        "name: demo\ntime_scale: 1.0\npods: {count: 3, flavor: vllm-v1}\nworkload: {kind: multi_turn, sessions: 2, turns_mean: 5, input_tokens_mean: 120, output_tokens_mean: 60, concurrency: 1}\n",
    )?;
    let redis = Redis::start().await?;
    let (pods_proc, pods) = start_pods(&paths, &sc).await?;
    let (gw, addr) = start_gateway(&paths, &sc, "prefix_cache", &pods, &redis.addr, "demo").await?;
    println!("redis {}  pods {}  gateway {addr} (prefix_cache)", redis.addr, pods.join(" "));
    let target = loadgen::Target {
        urls: vec![format!("http://{addr}")],
        gateway_choice: loadgen::GatewayChoice::PerSession,
        sticky: None,
        time_scale: sc.time_scale,
        model: sc.model.clone(),
        timeout: Duration::from_secs(60),
        page: 16,
    };
    let records = loadgen::run(sc.workload.plan(), target, 1, Arc::new(AtomicU64::new(0))).await;
    println!(
        "{:>4} {:>4} {:>8} {:>7} {:>7} {:>9}",
        "conv", "turn", "pod", "prompt", "cached", "TTFT ms"
    );
    let mut ok = true;
    for conv in 0..2 {
        let turns: Vec<_> = records.iter().filter(|r| r.session == conv).collect();
        for r in &turns {
            let ttft = r.ttft_ms.unwrap_or(f64::NAN);
            println!(
                "{:>4} {:>4} {:>8} {:>7} {:>7} {:>9.1}{}",
                conv + 1,
                r.turn + 1,
                r.pod.as_deref().unwrap_or("?"),
                r.prompt_tokens,
                r.cached_tokens,
                ttft,
                r.error.as_deref().map(|e| format!("  ERROR {e}")).unwrap_or_default()
            );
        }
        let first = turns.first().and_then(|r| r.pod.clone());
        if turns.len() != 5
            || first.is_none()
            || turns.iter().any(|r| r.pod != first || r.error.is_some())
        {
            ok = false;
        }
    }
    println!("plugin keys in Redis (TTL s):");
    if let Resp::Array(Some(v)) = redis_cmd(&redis.addr, &["KEYS", "*"]).await? {
        for k in v.iter().map(Resp::text).take(40) {
            let ttl =
                redis_cmd(&redis.addr, &["TTL", &k]).await.map(|r| r.text()).unwrap_or_default();
            println!("  {k}  {ttl}");
        }
    }
    gw.stop().await;
    pods_proc.stop().await;
    if !ok {
        bail!("a conversation's turns did not all land on the same pod");
    }
    println!("OK: every turn of each conversation landed on the pod of its first turn");
    Ok(())
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let paths = Paths::new(&root(&cli));
    let work = async move {
        match cli.cmd {
            Cmd::Run { scenario, policies, reps } => run(paths, scenario, policies, reps).await,
            Cmd::Model { scenario } => model(paths, scenario),
            Cmd::Tables { write } => tables(paths, write),
            Cmd::Demo => demo(paths).await,
            Cmd::RedisCost { requests, reps } => redis_cost(paths, requests, reps).await,
        }
    };
    // Dropping the work future on Ctrl-C kills every child (kill_on_drop).
    let res = tokio::select! {
        r = work => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    // Gateway config files written by this run.
    let _ =
        std::fs::remove_dir_all(std::env::temp_dir().join(format!("bench-{}", std::process::id())));
    if let Err(e) = res {
        eprintln!("bench: {e:#}");
        std::process::exit(1);
    }
}
