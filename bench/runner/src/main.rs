//! `bench`: `bench run <scenario>` (one run per policy, table + JSON + PNG) and `bench demo`.

use anyhow::{bail, Result};
use bench::procs::{redis_cmd, Redis, Resp};
use bench::{chart, load_scenario, start_gateway, start_pods, stats, table, Paths, Report, Stamp};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

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
        /// These policies (comma-separated, any the runner knows), default: the scenario's list.
        #[arg(long, value_delimiter = ',')]
        policies: Vec<String>,
        /// Repetitions per policy (default: the scenario's, 3 unless it says otherwise).
        #[arg(long)]
        reps: Option<usize>,
        /// A shorter run of the same shape: only the first N sessions (multi-turn scenarios);
        /// the report records it.
        #[arg(long)]
        sessions: Option<usize>,
        /// Write the results as <scenario>-<TAG>.json/.png, beside the scenario's main results
        /// instead of over them (e.g. extra policies with same-run references).
        #[arg(long)]
        tag: Option<String>,
    },
    /// Load sweep: the scenario's sessions as an open loop (Poisson) at each offered rate, every
    /// policy at every rate, interleaved repetitions; writes <scenario>-sweep.json and .png.
    Sweep {
        /// Scenario name or file.
        scenario: String,
        /// Sessions per simulated second (default: the scenario's sweep_rates).
        #[arg(long, value_delimiter = ',')]
        rates: Vec<f64>,
        /// Only these policies (comma-separated).
        #[arg(long, value_delimiter = ',')]
        policies: Vec<String>,
        /// Repetitions per (policy, rate).
        #[arg(long)]
        reps: Option<usize>,
    },
    /// Time-scale check: the scenario at each time scale (and, with `--real-clock-health-check`,
    /// `endpoint_metrics`-style policies with the health check on the real clock), every
    /// (scale, policy) in one interleaved series; writes <scenario>-ts<scale>[-hc-real].json.
    Timescale {
        /// Scenario name or file.
        scenario: String,
        /// Time scales (real s per simulated s).
        #[arg(long, value_delimiter = ',', default_value = "1,0.25")]
        scales: Vec<f64>,
        /// Only these policies (comma-separated).
        #[arg(long, value_delimiter = ',')]
        policies: Vec<String>,
        /// Repetitions per (scale, policy).
        #[arg(long)]
        reps: Option<usize>,
        /// Only the first N sessions (multi-turn scenarios).
        #[arg(long)]
        sessions: Option<usize>,
        /// Also run the policies that read the pods' /metrics at every scale below 1 with the
        /// health check every 200 real ms (the harness before it followed the pods' clock).
        #[arg(long)]
        real_clock_health_check: bool,
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
    /// Each router's own added latency: sequential requests to one fast pod, straight and
    /// through our gateway and the competing routers (interleaved repetitions); writes
    /// bench/results/router-overhead.json.
    RouterOverhead {
        /// Requests per target and repetition.
        #[arg(long, default_value_t = 300)]
        requests: usize,
        /// Repetitions (interleaved).
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Targets (default: direct, our gateway and each router).
        #[arg(long, value_delimiter = ',')]
        targets: Vec<String>,
    },
    /// What one routed request costs Redis (script time, main-thread CPU, bytes) with the plugin's
    /// scripts, beside a trivial EVALSHA floor; writes bench/results/redis-cost.json.
    RedisCost {
        /// Routed requests per repetition.
        #[arg(long, default_value_t = 20_000)]
        requests: u64,
        /// Repetitions per case (interleaved); medians are reported.
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Pods in the cluster (every pick reads each one's count; the Go way sends each one).
        /// Other than the default, the report goes to `redis-cost-pods<N>.json`.
        #[arg(long, default_value_t = bench::redis_cost::DEFAULT_PODS)]
        pods: usize,
        /// Connections sending at once (1 to 4), the plugin VMs shared out among them: Redis is
        /// then kept busy, as by many gateways, where one connection leaves it idle between calls.
        /// Above 1, the report goes to `redis-cost[-pods<N>]-clients<N>.json`.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=4))]
        clients: u8,
        /// Prefix blocks per `prefix_cache` request (a chat's turns, an agent's tool rounds: a
        /// conversation's blocks so far plus a new one). Other than the default, the report goes to
        /// `redis-cost[...]-blocks<N>.json`.
        #[arg(long, default_value_t = bench::redis_cost::DEFAULT_BLOCKS as u16,
              value_parser = clap::value_parser!(u16).range(1..=256))]
        blocks: u16,
        /// Appended to the report's file name (`redis-cost[...]-<tag>.json`), as `run --tag` does.
        #[arg(long)]
        tag: Option<String>,
    },
}

fn root(cli: &Cli) -> PathBuf {
    cli.root.clone().unwrap_or_else(|| {
        let p = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
        p.canonicalize().unwrap_or(p)
    })
}

async fn run(
    paths: Paths,
    name: String,
    only: Vec<String>,
    reps: Option<usize>,
    sessions: Option<usize>,
    tag: Option<String>,
) -> Result<()> {
    if name == "chaos" {
        // Faults, not a policy comparison: its own module. Three runs by default, as the
        // scenarios: the pooled p99s then rest on 600-1500 requests instead of one run's few hundred.
        return bench::chaos::run(&paths, reps.unwrap_or(3), tag.as_deref()).await.map(|_| ());
    }
    if let Some(shape) = bench::overhead::Shape::named(&name) {
        // Its own measurement (sequential keep-alive requests per row), not a workload scenario.
        let reps = reps.unwrap_or(3).max(1);
        return bench::overhead::run(&paths, reps, 2000, shape).await;
    }
    let mut sc = load_scenario(&paths, &name)?;
    if let Some(n) = sessions {
        sc.workload = sc
            .workload
            .with_sessions(n)
            .ok_or_else(|| anyhow::anyhow!("--sessions applies to multi_turn workloads only"))?;
        sc.description = format!("{} [this run: the first {n} sessions]", sc.description);
    }
    if !only.is_empty() {
        // Exactly these, also policies the scenario does not list (a variant beside its baselines).
        sc.policies = only;
    }
    if let Some(t) = tag {
        sc.name = format!("{}-{t}", sc.name);
    }
    if let Some(r) = reps {
        sc.repetitions = r;
    }
    sc.repetitions = sc.repetitions.max(1);
    // Unknown names and missing routers fail now, not after an hour of other policies.
    for p in &sc.policies {
        if let bench::policy::Route::External { router, .. } = bench::policy::lookup(p)?.route {
            let bin = bench::routers::router_bin(&paths.root, router);
            if !bin.exists() {
                bail!("policy {p} needs {}: run ./build.sh routers", bin.display());
            }
        }
    }
    if let Some(opts) = bench::aiperf::aiperf_options(&bench::scenario_file(&paths, &name))? {
        return bench::aiperf::run_scenario(&paths, sc, opts).await;
    }
    let redis = Redis::start().await?;
    let mut jobs = Vec::new();
    for r in &sc.gateway_replicas {
        for p in &sc.policies {
            jobs.push(bench::Job {
                sc: sc.clone(),
                replicas: *r,
                policy: p.clone(),
                label: format!("{p} via {r} gateway(s)"),
            });
        }
    }
    let results = bench::run_jobs(&paths, &redis, &jobs, sc.repetitions).await?;
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
    let plugin = bench::plugin_table(&rep);
    if !plugin.is_empty() {
        print!("\n{plugin}");
    }
    let redis = bench::redis_table(&rep);
    if !redis.is_empty() {
        print!("\n{redis}");
    }
    let outage = bench::outage_table(&rep);
    if !outage.is_empty() {
        print!("\n{outage}");
    }
    let scale_out = bench::scale_out_table(&rep);
    if !scale_out.is_empty() {
        print!("\n{scale_out}");
    }
    let failures = bench::failure_table(&rep);
    if !failures.is_empty() {
        print!("\n{failures}");
    }
    println!("\nwrote {} and {}", json_path.display(), png_path.display());
    Ok(())
}

async fn sweep(
    paths: Paths,
    name: String,
    rates: Vec<f64>,
    only: Vec<String>,
    reps: Option<usize>,
) -> Result<()> {
    let mut sc = load_scenario(&paths, &name)?;
    if !only.is_empty() {
        sc.policies.retain(|p| only.contains(p));
    }
    let rates = if rates.is_empty() { sc.sweep_rates.clone() } else { rates };
    if rates.is_empty() {
        bail!("no rates: give --rates or sweep_rates in the scenario");
    }
    let reps = reps.unwrap_or(sc.repetitions).max(1);
    for p in &sc.policies {
        bench::policy::lookup(p)?;
    }
    let redis = Redis::start().await?;
    let mut jobs = Vec::new();
    for &rate in &rates {
        for p in &sc.policies {
            let mut point = sc.clone();
            point.workload = sc.workload.with_arrival_rate(rate);
            jobs.push(bench::Job {
                sc: point,
                replicas: 1,
                policy: p.clone(),
                label: format!("{p} at {rate} sessions/s"),
            });
        }
    }
    let runs = bench::run_jobs(&paths, &redis, &jobs, reps).await?;
    let rep = bench::sweep::SweepReport {
        scenario: sc.name.clone(),
        description: sc.description.clone(),
        stamp: Stamp::now(&paths.root),
        config: sc.clone(),
        points: bench::sweep::points(&runs, &rates),
        rates,
        runs,
    };
    std::fs::create_dir_all(&paths.results)?;
    let json_path = paths.results.join(format!("{}-sweep.json", sc.name));
    std::fs::write(&json_path, serde_json::to_string_pretty(&rep)?)?;
    let png_path = paths.results.join(format!("{}-sweep.png", sc.name));
    chart::draw_sweep(&rep, &png_path)?;
    print!("{}", bench::sweep::table(&rep));
    println!("\nwrote {} and {}", json_path.display(), png_path.display());
    Ok(())
}

/// One series of [`Cmd::Timescale`]: the scenario at one scale, written as its own report.
struct ScaleVariant {
    /// Results file stem.
    name: String,
    sc: bench::scenario::Scenario,
}

async fn timescale(
    paths: Paths,
    name: String,
    scales: Vec<f64>,
    only: Vec<String>,
    reps: Option<usize>,
    sessions: Option<usize>,
    real_clock_health_check: bool,
) -> Result<()> {
    let mut base = load_scenario(&paths, &name)?;
    if let Some(n) = sessions {
        base.workload = base
            .workload
            .with_sessions(n)
            .ok_or_else(|| anyhow::anyhow!("--sessions applies to multi_turn workloads only"))?;
    }
    if !only.is_empty() {
        base.policies.retain(|p| only.contains(p));
    }
    base.repetitions = reps.unwrap_or(base.repetitions).max(1);
    base.gateway_replicas.truncate(1);
    for p in &base.policies {
        bench::policy::lookup(p)?;
    }
    let list = scales.iter().map(f64::to_string).collect::<Vec<_>>().join(", ");
    let shortened = sessions.map(|n| format!("; the first {n} sessions")).unwrap_or_default();
    let mut variants = Vec::new();
    for &scale in &scales {
        if !(scale.is_finite() && scale > 0.0) {
            bail!("time scale {scale}: must be positive");
        }
        let mut sc = base.clone();
        sc.time_scale = scale;
        sc.name = format!("{}-ts{scale}", base.name);
        sc.description = format!(
            "{} [time-scale check: this series at scale {scale}, interleaved with scales {list}{shortened}; health check every {} simulated ms]",
            base.description, sc.health_check_interval_ms
        );
        let hc = (real_clock_health_check && scale < 1.0).then(|| {
            let mut hc = sc.clone();
            hc.policies.retain(|p| {
                bench::policy::lookup(p).map(|s| s.scrapes_metrics()).unwrap_or(false)
            });
            // 200 real ms at this scale: what the harness gave before the interval followed
            // the pods' clock.
            hc.health_check_interval_ms = 200.0 / scale;
            hc.name = format!("{}-hc-real", sc.name);
            hc.description = format!(
                "{} [time-scale check: scale {scale} with the health check every 200 real ms ({} simulated ms), interleaved with scales {list}{shortened}]",
                base.description, hc.health_check_interval_ms
            );
            hc
        });
        variants.push(ScaleVariant { name: sc.name.clone(), sc });
        if let Some(hc) = hc.filter(|hc| !hc.policies.is_empty()) {
            variants.push(ScaleVariant { name: hc.name.clone(), sc: hc });
        }
    }
    let redis = Redis::start().await?;
    let mut jobs = Vec::new();
    let mut owner = Vec::new();
    for (v, var) in variants.iter().enumerate() {
        for p in &var.sc.policies {
            jobs.push(bench::Job {
                sc: var.sc.clone(),
                replicas: 1,
                policy: p.clone(),
                label: format!("{p} ({})", var.name),
            });
            owner.push(v);
        }
    }
    let reps = base.repetitions;
    let runs = bench::run_jobs(&paths, &redis, &jobs, reps).await?;
    // run_jobs returns the runs in the order it made them: the interleaved order.
    let order = stats::interleaved(jobs.len(), reps);
    std::fs::create_dir_all(&paths.results)?;
    for (v, var) in variants.iter().enumerate() {
        let mine: Vec<_> = order
            .iter()
            .zip(&runs)
            .filter(|((_, k), _)| owner.get(*k) == Some(&v))
            .map(|(_, r)| r.clone())
            .collect();
        let rep = Report {
            scenario: var.name.clone(),
            description: var.sc.description.clone(),
            stamp: Stamp::now(&paths.root),
            time_scale: var.sc.time_scale,
            config: var.sc.clone(),
            policies: stats::aggregate(&mine),
            runs: mine,
        };
        let json_path = paths.results.join(format!("{}.json", var.name));
        std::fs::write(&json_path, serde_json::to_string_pretty(&rep)?)?;
        println!("\n{}: {}\n", var.name, var.sc.description);
        print!("{}", table(&rep));
        println!("wrote {}", json_path.display());
    }
    Ok(())
}

fn tables(paths: Paths, write: bool) -> Result<()> {
    let (md, skipped) = bench::tables::render(&paths.results)?;
    for f in skipped {
        eprintln!("skipped {f}: not a report `bench tables` can read (re-run what wrote it)");
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
    println!(
        "| policy | req | TTFT mean | TTFT p90 | E2E mean | out tok/s | out tokens/reply | hit rate |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for policy in [
        "round_robin",
        "session_hash",
        "sticky_balanced",
        "sticky_speed_balanced",
        "sticky_moves_off_slow",
        "fastest_pods_only",
        "learns_then_avoids_slow",
        "learns_then_moves_off_slow",
    ] {
        let r = bench::model::run(&sc, policy)?;
        println!(
            "| {policy} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1}% |",
            r.requests,
            r.ttft_mean_ms,
            r.ttft_p90_ms,
            r.e2e_mean_ms,
            r.output_tokens_per_s,
            r.output_tokens_mean,
            r.hit_rate * 100.0
        );
    }
    Ok(())
}

async fn redis_cost(
    paths: Paths,
    requests: u64,
    reps: usize,
    traffic: bench::redis_cost::Traffic,
    tag: Option<String>,
) -> Result<()> {
    let rows = bench::redis_cost::measure(requests, reps, traffic).await?;
    let table = bench::redis_cost::table(&rows, reps);
    std::fs::create_dir_all(&paths.results)?;
    let stem = bench::redis_cost::file_stem(traffic, tag.as_deref());
    let out = paths.results.join(format!("{stem}.json"));
    let json = bench::redis_cost::RedisCostReport {
        stamp: Stamp::now(&paths.root),
        unix_time: None,
        requests_per_rep: requests,
        reps,
        pods: traffic.pods,
        clients: traffic.clients,
        blocks: traffic.blocks,
        tag,
        cases: rows,
    };
    std::fs::write(&out, serde_json::to_string_pretty(&json)?)?;
    print!("{table}");
    println!("\nwrote {}", out.display());
    Ok(())
}

async fn router_overhead(
    paths: Paths,
    requests: usize,
    reps: usize,
    mut targets: Vec<String>,
) -> Result<()> {
    if targets.is_empty() {
        targets = bench::routers::OVERHEAD_TARGETS.iter().map(|s| s.to_string()).collect();
    }
    if targets.first().map(String::as_str) != Some("direct") {
        targets.insert(0, "direct".into());
    }
    let rows = bench::routers::measure_added_latency(&paths, &targets, requests, reps).await?;
    let table = bench::routers::added_latency_table(&rows);
    std::fs::create_dir_all(&paths.results)?;
    let out = paths.results.join("router-overhead.json");
    let json = bench::routers::OverheadReport {
        stamp: Stamp::now(&paths.root),
        requests_per_rep: requests,
        reps,
        sglang_router: bench::routers::SGLANG_ROUTER_VERSION.into(),
        vllm_router: bench::routers::VLLM_ROUTER_VERSION.into(),
        rows,
    };
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
            Cmd::Run { scenario, policies, reps, sessions, tag } => {
                run(paths, scenario, policies, reps, sessions, tag).await
            }
            Cmd::Model { scenario } => model(paths, scenario),
            Cmd::Timescale {
                scenario,
                scales,
                policies,
                reps,
                sessions,
                real_clock_health_check,
            } => {
                timescale(
                    paths,
                    scenario,
                    scales,
                    policies,
                    reps,
                    sessions,
                    real_clock_health_check,
                )
                .await
            }
            Cmd::Sweep { scenario, rates, policies, reps } => {
                sweep(paths, scenario, rates, policies, reps).await
            }
            Cmd::Tables { write } => tables(paths, write),
            Cmd::Demo => demo(paths).await,
            Cmd::RedisCost { requests, reps, pods, clients, blocks, tag } => {
                let traffic = bench::redis_cost::Traffic {
                    pods,
                    clients: usize::from(clients),
                    blocks: usize::from(blocks),
                };
                redis_cost(paths, requests, reps, traffic, tag).await
            }
            Cmd::RouterOverhead { requests, reps, targets } => {
                router_overhead(paths, requests, reps, targets).await
            }
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
