//! `podsim`: serve several simulated pods from one process.

use clap::Parser;
use podsim::engine::{EngineConfig, LatencyModel, Profile, H100_8B};
use podsim::server::{serve, Faults, Flavor, Pod, PodConfig};
use std::io::Write;
use std::net::SocketAddr;

/// Simulated vLLM/SGLang pods (OpenAI API, prefix cache, batching latency model).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Number of pods (ignored when --listen is given).
    #[arg(long, default_value_t = 1)]
    pods: usize,
    /// First port; pod i listens on 127.0.0.1:(base_port + i). Default: free ports.
    #[arg(long)]
    base_port: Option<u16>,
    /// Explicit listen address, one per pod (repeatable; port 0 = pick a free port).
    #[arg(long)]
    listen: Vec<SocketAddr>,
    /// Served model name.
    #[arg(long, default_value = "llama-3.1-8b")]
    model: String,
    /// Pod name prefix (x-pod-name = <prefix>-<index>).
    #[arg(long, default_value = "pod")]
    name_prefix: String,
    /// Metrics flavours, comma-separated, assigned to pods in turn: vllm-v0, vllm-v1, sglang.
    #[arg(long, default_value = "vllm-v1", value_delimiter = ',')]
    flavor: Vec<Flavor>,
    /// KV cache capacity per pod in tokens.
    #[arg(long, default_value_t = 400_000)]
    kv_capacity_tokens: usize,
    /// KV page (block) size in tokens.
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// Max running sequences per pod.
    #[arg(long, default_value_t = 128)]
    max_running: usize,
    /// Prefill token budget per step (chunked prefill).
    #[arg(long, default_value_t = 8192)]
    prefill_budget: usize,
    /// Hardware profile (step costs and API overhead): h100-8b, published-testbed. The four
    /// coefficient options below override single terms of it.
    #[arg(long, default_value_t = H100_8B)]
    profile: Profile,
    /// Step base cost (ms).
    #[arg(long)]
    step_base_ms: Option<f64>,
    /// Cost per uncached prefill token (ms).
    #[arg(long)]
    prefill_ms_per_token: Option<f64>,
    /// Cost per decoding sequence (ms).
    #[arg(long)]
    decode_ms_per_seq: Option<f64>,
    /// Cost per context token in the batch (ms).
    #[arg(long)]
    ctx_ms_per_token: Option<f64>,
    /// Speed of each pod relative to the profile (comma-separated, pod i gets entry i, missing
    /// entries 1.0): 0.5 = every step takes twice as long.
    #[arg(long, value_delimiter = ',')]
    speed: Vec<f64>,
    /// Mean reply length at which the model stops (EOS), geometric; 0 = every reply runs to
    /// max_tokens. Requests with "ignore_eos": true always run to max_tokens.
    #[arg(long, default_value_t = 0.0)]
    eos_mean_tokens: f64,
    /// Real seconds per simulated second (0.25 = 4x faster than real time).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// API/tokenization overhead before scheduling (simulated ms; default: the profile's).
    #[arg(long)]
    api_overhead_ms: Option<f64>,
    /// LoRA adapters served (comma-separated); enables vllm:lora_requests_info.
    #[arg(long, value_delimiter = ',')]
    lora: Vec<String>,
    /// vLLM max_lora reported in vllm:lora_requests_info.
    #[arg(long, default_value_t = 4)]
    max_lora: usize,
    /// Fault: share of completion requests answered with 500.
    #[arg(long, default_value_t = 0.0)]
    error_rate: f64,
    /// Fault: 503 on /health and completions for this many seconds after start.
    #[arg(long, default_value_t = 0.0)]
    slow_start_s: f64,
    /// Fault: stop answering anything, and stop the engine, after this many seconds.
    #[arg(long)]
    hang_after_s: Option<f64>,
    /// Fault: the hang ends after this many seconds (default: never).
    #[arg(long)]
    hang_for_s: Option<f64>,
    /// Fault: the engine dies after this many seconds: streams in flight are cut, completions and
    /// /health answer 503.
    #[arg(long)]
    fail_after_s: Option<f64>,
    /// Pods the faults apply to (comma-separated indexes; default: all).
    #[arg(long, value_delimiter = ',')]
    fault_pods: Vec<usize>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let addrs: Vec<SocketAddr> = if !a.listen.is_empty() {
        a.listen.clone()
    } else {
        (0..a.pods)
            .map(|i| {
                let port = a.base_port.map(|p| p + i as u16).unwrap_or(0);
                SocketAddr::from(([127, 0, 0, 1], port))
            })
            .collect()
    };
    let p = a.profile.model;
    let model = LatencyModel {
        base_ms: a.step_base_ms.unwrap_or(p.base_ms),
        prefill_ms_per_token: a.prefill_ms_per_token.unwrap_or(p.prefill_ms_per_token),
        decode_ms_per_seq: a.decode_ms_per_seq.unwrap_or(p.decode_ms_per_seq),
        ctx_ms_per_token: a.ctx_ms_per_token.unwrap_or(p.ctx_ms_per_token),
    };
    if let Some(bad) = a.speed.iter().find(|s| !(**s > 0.0 && s.is_finite())) {
        anyhow::bail!("--speed {bad}: every speed factor must be a positive number");
    }
    let engine = EngineConfig {
        page: a.page_size,
        capacity_tokens: a.kv_capacity_tokens,
        max_running: a.max_running,
        prefill_budget: a.prefill_budget,
        model,
        eos_mean_tokens: a.eos_mean_tokens,
    };
    let mut out = std::io::stdout().lock();
    for (i, addr) in addrs.iter().enumerate() {
        let faulty = a.fault_pods.is_empty() || a.fault_pods.contains(&i);
        let faults = if faulty {
            Faults {
                error_rate: a.error_rate,
                slow_start_s: a.slow_start_s,
                hang_after_s: a.hang_after_s,
                hang_for_s: a.hang_for_s,
                fail_after_s: a.fail_after_s,
            }
        } else {
            Faults::default()
        };
        let cfg = PodConfig {
            index: i,
            name: format!("{}-{i}", a.name_prefix),
            model: a.model.clone(),
            flavor: a.flavor[i % a.flavor.len().max(1)],
            engine: EngineConfig {
                model: model.at_speed(a.speed.get(i).copied().unwrap_or(1.0)),
                ..engine
            },
            time_scale: a.time_scale,
            api_overhead_ms: a.api_overhead_ms.unwrap_or(a.profile.api_overhead_ms),
            loras: a.lora.clone(),
            max_lora: a.max_lora,
            faults,
        };
        let bound = serve(Pod::new(cfg), *addr).await?;
        writeln!(out, "POD {i} {bound}")?;
    }
    writeln!(out, "READY")?;
    out.flush()?;
    drop(out);
    std::future::pending::<()>().await;
    Ok(())
}
