//! Prometheus texts shaped like what real model servers expose, for pods' `/metrics`.
//!
//! Shapes follow vLLM's and SGLang's own docs (HELP/TYPE lines, `model_name` labels, histograms
//! and counters next to the gauges a router reads) so the plugin's parser is tested on realistic
//! input, not on a minimal hand-made subset.

/// The model name used in labels.
pub const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn histogram(name: &str, labels: &str, count: u64) -> String {
    let mut s = format!("# HELP {name} Histogram.\n# TYPE {name} histogram\n");
    let mut cum = 0;
    for (i, le) in ["0.02", "0.04", "0.1", "0.5", "1.0", "+Inf"].iter().enumerate() {
        cum = (count * (i as u64 + 1)) / 6;
        s.push_str(&format!("{name}_bucket{{le=\"{le}\",{labels}}} {cum}.0\n"));
    }
    s.push_str(&format!(
        "{name}_sum{{{labels}}} {:.3}\n{name}_count{{{labels}}} {cum}.0\n",
        cum as f64 * 0.07
    ));
    s
}

/// vLLM V0 (`vllm:gpu_cache_usage_perc`), optionally with the LoRA info gauge
/// (`max_lora`, comma-separated running adapters).
pub fn vllm_v0(running: u32, waiting: u32, kv_usage: f64, lora: Option<(u32, &str)>) -> String {
    let l = format!("model_name=\"{MODEL}\"");
    let mut s = String::new();
    s.push_str("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n");
    s.push_str("vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",gpu_memory_utilization=\"0.9\"} 1.0\n");
    s.push_str(&format!("# HELP vllm:num_requests_running Number of requests currently running on GPU.\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{l}}} {running}.0\n"));
    s.push_str(&format!("# HELP vllm:num_requests_swapped Number of requests swapped to CPU.\n# TYPE vllm:num_requests_swapped gauge\nvllm:num_requests_swapped{{{l}}} 0.0\n"));
    s.push_str(&format!("# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{l}}} {waiting}.0\n"));
    s.push_str(&format!("# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.\n# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{{{l}}} {kv_usage}\n"));
    s.push_str(&format!("# HELP vllm:cpu_cache_usage_perc CPU KV-cache usage. 1 means 100 percent usage.\n# TYPE vllm:cpu_cache_usage_perc gauge\nvllm:cpu_cache_usage_perc{{{l}}} 0.0\n"));
    s.push_str(&format!("# HELP vllm:gpu_prefix_cache_hit_rate GPU prefix cache block hit rate.\n# TYPE vllm:gpu_prefix_cache_hit_rate gauge\nvllm:gpu_prefix_cache_hit_rate{{{l}}} 0.41\n"));
    if let Some((max_lora, adapters)) = lora {
        s.push_str("# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\n");
        s.push_str(&format!("vllm:lora_requests_info{{max_lora=\"{max_lora}\",running_lora_adapters=\"{adapters}\",waiting_lora_adapters=\"\"}} 1.7e+09\n"));
    }
    s.push_str(&histogram("vllm:time_to_first_token_seconds", &l, 140));
    s.push_str(&format!("# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter\nvllm:request_success_total{{finished_reason=\"stop\",{l}}} 131.0\n"));
    s
}

/// vLLM V1 (`vllm:kv_cache_usage_perc`, prefix-cache counters, `engine` label).
pub fn vllm_v1(running: u32, waiting: u32, kv_usage: f64) -> String {
    let l = format!("engine=\"0\",model_name=\"{MODEL}\"");
    let mut s = String::new();
    s.push_str(&format!("# HELP vllm:num_requests_running Number of requests in model execution batches.\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{l}}} {running}.0\n"));
    s.push_str(&format!("# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{l}}} {waiting}.0\n"));
    s.push_str(&format!("# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{l}}} {kv_usage}\n"));
    // prometheus_client emits a `_created` sample inside each counter family.
    s.push_str(&format!("# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.\n# TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total{{{l}}} 52340.0\nvllm:prefix_cache_queries_created{{{l}}} 1.7e+09\n"));
    s.push_str(&format!("# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{{{l}}} 20110.0\n"));
    s.push_str(&histogram("vllm:time_to_first_token_seconds", &l, 90));
    s.push_str(&histogram("vllm:inter_token_latency_seconds", &l, 900));
    s
}

/// SGLang with its native `sglang:` prefix.
pub fn sglang(running: u32, queued: u32, token_usage: f64) -> String {
    sglang_with_prefix("sglang:", running, queued, token_usage)
}

/// SGLang as sgl-router's `/engine_metrics` rewrites it (`sglang_` prefix).
pub fn sglang_underscore(running: u32, queued: u32, token_usage: f64) -> String {
    sglang_with_prefix("sglang_", running, queued, token_usage)
}

fn sglang_with_prefix(p: &str, running: u32, queued: u32, token_usage: f64) -> String {
    let l = format!("model_name=\"{MODEL}\"");
    let mut s = String::new();
    s.push_str(&format!("# HELP {p}token_usage The token usage\n# TYPE {p}token_usage gauge\n{p}token_usage{{{l}}} {token_usage}\n"));
    s.push_str(&format!("# HELP {p}cache_hit_rate The prefix cache hit rate\n# TYPE {p}cache_hit_rate gauge\n{p}cache_hit_rate{{{l}}} 0.007507552643049313\n"));
    s.push_str(&format!("# HELP {p}num_running_reqs The number of running requests\n# TYPE {p}num_running_reqs gauge\n{p}num_running_reqs{{{l}}} {running}.0\n"));
    s.push_str(&format!("# HELP {p}num_queue_reqs The number of requests in the waiting queue\n# TYPE {p}num_queue_reqs gauge\n{p}num_queue_reqs{{{l}}} {queued}.0\n"));
    s.push_str(&format!("# HELP {p}num_used_tokens The number of used tokens\n# TYPE {p}num_used_tokens gauge\n{p}num_used_tokens{{{l}}} 123859.0\n"));
    s.push_str(&format!("# HELP {p}gen_throughput The generate throughput (token/s)\n# TYPE {p}gen_throughput gauge\n{p}gen_throughput{{{l}}} 86.5\n"));
    s.push_str(&format!("# HELP {p}prompt_tokens_total Number of prefill tokens processed.\n# TYPE {p}prompt_tokens_total counter\n{p}prompt_tokens_total{{{l}}} 8128902.0\n"));
    s.push_str(&histogram(&format!("{p}time_to_first_token_seconds"), &l, 27));
    s
}

/// vLLM V1 as a real server exposes it in full: [`vllm_v1`] followed by the request histograms
/// every vLLM V1 server also exports (each with vLLM's own buckets, its `_sum`, `_count` and
/// `_created`), with the samples of as many engines (data-parallel ranks) as it takes to reach
/// `min_bytes` in each family. A real server's `/metrics`
/// is 30-60 KB (Higress stores up to 64 KiB of it per pod); the short texts above are what a
/// parser needs, this is what a gateway carries.
pub fn vllm_v1_full(running: u32, waiting: u32, kv_usage: f64, min_bytes: usize) -> String {
    const LATENCY: &[&str] = &[
        "0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0", "30.0",
        "40.0", "50.0", "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", "+Inf",
    ];
    const TOKENS: &[&str] = &[
        "1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0",
        "5000.0", "10000.0", "20000.0", "50000.0", "100000.0", "+Inf",
    ];
    const FAMILIES: &[(&str, &[&str])] = &[
        ("vllm:e2e_request_latency_seconds", LATENCY),
        ("vllm:request_queue_time_seconds", LATENCY),
        ("vllm:request_inference_time_seconds", LATENCY),
        ("vllm:request_prefill_time_seconds", LATENCY),
        ("vllm:request_decode_time_seconds", LATENCY),
        ("vllm:request_prompt_tokens", TOKENS),
        ("vllm:request_generation_tokens", TOKENS),
        ("vllm:request_max_num_generation_tokens", TOKENS),
        ("vllm:request_params_max_tokens", TOKENS),
        ("vllm:iteration_tokens_total", TOKENS),
    ];
    let with_engines = |engines: usize| {
        let mut s = vllm_v1(running, waiting, kv_usage);
        for (name, buckets) in FAMILIES {
            s.push_str(&format!("# HELP {name} Histogram of requests.\n# TYPE {name} histogram\n"));
            for engine in 0..engines {
                let l = format!("engine=\"{engine}\",model_name=\"{MODEL}\"");
                for (i, le) in buckets.iter().enumerate() {
                    s.push_str(&format!("{name}_bucket{{{l},le=\"{le}\"}} {}.0\n", 17 * (i + 1)));
                }
                let n = 17 * buckets.len();
                s.push_str(&format!(
                    "{name}_count{{{l}}} {n}.0\n{name}_sum{{{l}}} {}.25\n{name}_created{{{l}}} 1.7e+09\n",
                    n * 3
                ));
            }
        }
        s
    };
    let mut engines = 1;
    let mut s = with_engines(engines);
    while s.len() < min_bytes && engines < 64 {
        engines += 1;
        s = with_engines(engines);
    }
    s
}
