//! Prometheus text parsing of vLLM V0/V1 and SGLang metrics.

use super::*;

const VLLM_V0: &str = include_str!("testdata/vllm_v0.txt");
const VLLM_V1: &str = include_str!("testdata/vllm_v1.txt");
const VLLM_V1_DP: &str = include_str!("testdata/vllm_v1_dp2_lora.txt");
const SGLANG: &str = include_str!("testdata/sglang.txt");
const SGLANG_ROUTER: &str = include_str!("testdata/sglang_router.txt");
const SGLANG_ALL_SCHEDULERS: &str = include_str!("testdata/sglang_all_schedulers.txt");

#[test]
fn vllm_v0_sample() {
    let m = parse(VLLM_V0.as_bytes(), None);
    assert_eq!(m.running, Some(3.0));
    assert_eq!(m.waiting, Some(1.0));
    assert_eq!(m.kv_cache_usage, Some(0.4021052631578947));
    // V0 has no token counters for the prefix cache; only a hit-rate gauge.
    assert_eq!(m.prefix_cache_queries, None);
    assert_eq!(m.lora, None);
    assert!(!m.is_empty());
}

#[test]
fn vllm_v1_sample_prefers_new_kv_name_and_reads_prefix_counters() {
    let m = parse(VLLM_V1.as_bytes(), None);
    assert_eq!(m.running, Some(12.0));
    assert_eq!(m.waiting, Some(4.0));
    // Body has both kv_cache_usage_perc (0.61) and the deprecated gpu_ name (0.61); not doubled.
    assert_eq!(m.kv_cache_usage, Some(0.6132));
    assert_eq!(m.prefix_cache_queries, Some(1_048_576.0));
    assert_eq!(m.prefix_cache_hits, Some(524_288.0));
}

#[test]
fn vllm_v1_two_engines_sum_counts_average_kv_and_take_newest_lora() {
    let m = parse(VLLM_V1_DP.as_bytes(), None);
    assert_eq!(m.running, Some(5.0 + 7.0));
    assert_eq!(m.waiting, Some(0.0 + 2.0));
    let kv = m.kv_cache_usage.unwrap_or(-1.0);
    assert!((kv - (0.25 + 0.75) / 2.0).abs() < 1e-12, "kv = {kv}");
    let lora = m.lora.unwrap_or_default();
    // The newest series (largest timestamp value) wins over the older one.
    assert_eq!(lora.max_lora, 4);
    assert_eq!(lora.running, vec!["sql-lora".to_string(), "tweet-summary".to_string()]);
    assert_eq!(lora.waiting, vec!["french-lora".to_string()]);
    assert!(lora.has_adapter("french-lora"));
    assert!(!lora.has_adapter("sql-lora-2"));
    assert_eq!(lora.active_count(), 3);
}

#[test]
fn sglang_colon_names() {
    let m = parse(SGLANG.as_bytes(), None);
    assert_eq!(m.running, Some(162.0));
    assert_eq!(m.waiting, Some(2826.0));
    assert_eq!(m.kv_cache_usage, Some(0.28));
    assert_eq!(m.lora, None);
}

#[test]
fn sglang_router_underscore_names_and_dp_ranks() {
    let m = parse(SGLANG_ROUTER.as_bytes(), None);
    assert_eq!(m.running, Some(40.0 + 38.0));
    assert_eq!(m.waiting, Some(3.0 + 0.0));
    let kv = m.kv_cache_usage.unwrap_or(-1.0);
    assert!((kv - (0.5 + 0.3) / 2.0).abs() < 1e-12, "kv = {kv}");
}

#[test]
fn sglang_ranks_of_one_engine_count_once() {
    // Four TP ranks in two data-parallel groups, each rank repeating its group's state: the pod
    // runs 16 requests with 4 queued, not twice that.
    let m = parse(SGLANG_ALL_SCHEDULERS.as_bytes(), None);
    assert_eq!(m.running, Some(10.0 + 6.0));
    assert_eq!(m.waiting, Some(3.0 + 1.0));
    let kv = m.kv_cache_usage.unwrap_or(-1.0);
    assert!((kv - (0.4 + 0.2) / 2.0).abs() < 1e-12, "kv = {kv}");
    let m = parse(SGLANG_ALL_SCHEDULERS.as_bytes(), Some("sglang:num_queue_reqs"));
    assert_eq!(m.target, Some(4.0));

    // Pipeline stages without data parallelism: one engine whatever the label order, and a stage
    // that lags counts at the largest value.
    let body = "sglang:num_queue_reqs{model_name=\"m\",tp_rank=\"0\",pp_rank=\"0\"} 5\n\
                sglang:num_queue_reqs{pp_rank=\"1\",tp_rank=\"0\",model_name=\"m\"} 4\n\
                sglang:num_running_reqs{model_name=\"m\",tp_rank=\"0\",pp_rank=\"0\"} 7\n\
                sglang:num_running_reqs{model_name=\"m\",tp_rank=\"0\",pp_rank=\"1\"} 7\n";
    let m = parse(body.as_bytes(), None);
    assert_eq!(m.waiting, Some(5.0));
    assert_eq!(m.running, Some(7.0));

    // Different models (or a dp_rank) are different engines and still add up.
    let body = "sglang:num_queue_reqs{model_name=\"a\",tp_rank=\"0\"} 2\n\
                sglang:num_queue_reqs{model_name=\"b\",tp_rank=\"0\"} 3\n";
    assert_eq!(parse(body.as_bytes(), None).waiting, Some(5.0));
}

#[test]
fn target_metric_is_summed_and_accepts_either_separator() {
    let m = parse(VLLM_V1_DP.as_bytes(), Some("vllm:num_requests_running"));
    assert_eq!(m.target, Some(12.0));
    let m = parse(SGLANG_ROUTER.as_bytes(), Some("sglang:num_queue_reqs"));
    assert_eq!(m.target, Some(3.0));
    // A KV target uses the averaged usage, not a sum over engines.
    let m = parse(VLLM_V1_DP.as_bytes(), Some("vllm:kv_cache_usage_perc"));
    assert!((m.target.unwrap_or(-1.0) - 0.5).abs() < 1e-12);
    // A histogram name never matches its _sum/_count series.
    let m = parse(VLLM_V1.as_bytes(), Some("vllm:time_to_first_token_seconds"));
    assert_eq!(m.target, None);
    let m = parse(VLLM_V1.as_bytes(), Some("vllm:time_to_first_token_seconds_count"));
    assert_eq!(m.target, Some(1520.0));
}

#[test]
fn a_target_of_another_family_is_read_among_process_and_python_series() {
    // What a real server's body also holds (prometheus_client's default collectors), with CRLF
    // line ends, an indented line and no trailing newline.
    let body = "python_gc_objects_collected_total{generation=\"0\"} 10.0\r\n\
                process_cpu_seconds_total 3.5\r\n\
                  tgi_queue_size{model=\"m\"} 7\r\n\
                vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\r\n\
                tgi_queue_size{model=\"n\"} 1";
    let m = parse(body.as_bytes(), Some("tgi_queue_size"));
    assert_eq!(m.target, Some(8.0));
    assert_eq!(m.waiting, Some(2.0));
    let m = parse(body.as_bytes(), Some("process:cpu_seconds_total"));
    assert_eq!(m.target, Some(3.5));
    assert_eq!(parse(body.as_bytes(), Some("python_gc_objects_collected")).target, None);
}

#[test]
fn created_series_and_comments_do_not_count() {
    let body = "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n\
                # TYPE vllm:prefix_cache_hits_total counter\n\
                vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 10.0\n\
                vllm:prefix_cache_hits_created{engine=\"0\",model_name=\"m\"} 1.7e9\n\
                #vllm:num_requests_running 99\n";
    let m = parse(body.as_bytes(), None);
    assert_eq!(m.prefix_cache_hits, Some(10.0));
    assert_eq!(m.running, None);
    assert!(m.is_empty());
}

#[test]
fn hostile_input_never_panics_and_keeps_good_lines() {
    let body = "vllm:num_requests_running{model_name=\"a\\\"}b\"} 2 1700000000000\r\n\
                vllm:num_requests_running{unterminated=\"x 5\n\
                vllm:num_requests_waiting NaN\n\
                vllm:num_requests_waiting\n\
                vllm:num_requests_waiting{} +Inf\n\
                vllm:lora_requests_info{max_lora=\"-3\",running_lora_adapters=\"\",waiting_lora_adapters=\"a\\\\b\"} 5\n\
                \u{0}\u{ff}{}}}\"\"\n\
                {\n }\n";
    let m = parse(body.as_bytes(), None);
    assert_eq!(m.running, Some(2.0));
    assert_eq!(m.waiting, Some(f64::INFINITY));
    let lora = m.lora.unwrap_or_default();
    assert_eq!(lora.max_lora, 0);
    assert!(lora.running.is_empty());
    assert_eq!(lora.waiting, vec!["a\\b".to_string()]);
    // Every prefix of a real body parses without panicking.
    for cut in (0..VLLM_V1_DP.len()).step_by(7) {
        let _ = parse(&VLLM_V1_DP.as_bytes()[..cut], Some("vllm:num_requests_running"));
    }
    assert_eq!(parse(b"", None), PodMetrics::default());
}

#[test]
fn many_engines_are_each_counted() {
    // 20 000 models on one pod (hostile or huge): each its own engine, summed, in one pass.
    let body: String = (0..20_000)
        .map(|i| format!("sglang:num_queue_reqs{{model_name=\"m{i}\",tp_rank=\"0\"}} 1\n"))
        .collect();
    assert_eq!(parse(body.as_bytes(), None).waiting, Some(20_000.0));
}
