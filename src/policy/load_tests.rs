//! `loadAware`: the pods' metrics turned into the script's load arguments.

use super::*;
use crate::metrics::PodMetrics;
use crate::policy::latency::{DecodeAverage, Slowness};

fn cfg() -> LoadAwareConfig {
    LoadAwareConfig::default()
}

/// The defaults with a KV-cache gap (off by default).
fn with_kv_gap() -> LoadAwareConfig {
    LoadAwareConfig { kv_gap: 0.2, ..cfg() }
}

fn pod(address: &str, waiting: f64, kv: f64) -> PodView {
    PodView {
        address: address.into(),
        metrics: Some(PodMetrics {
            running: Some(1.0),
            waiting: Some(waiting),
            kv_cache_usage: Some(kv),
            ..PodMetrics::default()
        }),
        sampled_ms: None,
    }
}

fn flags(args: &LoadArgs) -> Vec<(String, bool, u32)> {
    args.hosts.iter().map(|h| (h.address.clone(), h.overloaded, h.penalty)).collect()
}

#[test]
fn a_deep_queue_or_a_full_kv_cache_marks_a_pod_overloaded_against_the_least_loaded() {
    let pods = [pod("a", 0.0, 0.1), pod("b", 9.0, 0.1), pod("c", 1.0, 0.7)];
    let a = load_args(&cfg(), &pods).expect("every pod has metrics");
    assert_eq!(
        flags(&a),
        vec![
            ("a".into(), false, 1), // 0 + 8 × 0.1
            ("b".into(), true, 10), // queue 9 - 0 > 4 and 9 > 1.5 × 0
            ("c".into(), false, 7), // KV use alone never overloads by default
        ]
    );
    assert_eq!((a.inflight_gap, a.ratio, a.max_holders), (4, 1.5, 2));
    // With `overloadKvCache: 0.2`: KV 0.7 - 0.1 > 0.2 and 0.7 > 1.5 × 0.1.
    let a = load_args(&with_kv_gap(), &pods).unwrap();
    assert!(a.hosts[2].overloaded, "{a:?}");
}

#[test]
fn both_the_gap_and_the_ratio_must_be_passed() {
    // Queue 14 vs 10: past the ratio? 14 > 15 no. Gap 4 is not more than 4 either way.
    let a = load_args(&cfg(), &[pod("a", 10.0, 0.5), pod("b", 14.0, 0.5)]).unwrap();
    assert!(a.hosts.iter().all(|h| !h.overloaded), "{a:?}");
    // Queue 20 vs 10: gap 10 > 4 and 20 > 15.
    let a = load_args(&cfg(), &[pod("a", 10.0, 0.5), pod("b", 20.0, 0.5)]).unwrap();
    assert!(a.hosts[1].overloaded);
    // KV 0.95 vs 0.7 with a KV gap of 0.2: gap 0.25 > 0.2 but 0.95 < 1.05: all pods nearly
    // full, none singled out.
    let a = load_args(&with_kv_gap(), &[pod("a", 0.0, 0.7), pod("b", 0.0, 0.95)]).unwrap();
    assert!(!a.hosts[1].overloaded);
}

#[test]
fn any_pod_without_queue_or_kv_metrics_means_no_load_arguments() {
    let mut no_kv = pod("b", 0.0, 0.0);
    no_kv.metrics.as_mut().unwrap().kv_cache_usage = None;
    assert_eq!(load_args(&cfg(), &[pod("a", 0.0, 0.1), no_kv]), None);
    let unknown = PodView { address: "b".into(), metrics: None, sampled_ms: None };
    assert_eq!(load_args(&cfg(), &[pod("a", 0.0, 0.1), unknown]), None);
    assert_eq!(load_args(&cfg(), &[]), None);
}

#[test]
fn arguments_follow_the_calls_host_order() {
    let a = load_args(&cfg(), &[pod("a", 0.0, 0.0), pod("b", 9.0, 0.5)]).unwrap();
    let mut out = Vec::new();
    a.args(&["b".to_string(), "a".to_string()], &mut out);
    assert_eq!(out, vec!["4", "1.5", "2", "10", "13", "0"]);
}

#[test]
fn a_slow_pod_gets_a_penalty_and_is_overloaded_only_past_overload_latency() {
    let both = |v: f64| Slowness { overall: v, steady: v };
    let slow = vec![
        ("a".to_string(), both(1.0)),
        ("b".to_string(), both(2.0)),
        ("c".to_string(), both(1.2)),
    ];
    let base =
        load_args(&cfg(), &[pod("a", 0.0, 0.0), pod("b", 0.0, 0.0), pod("c", 0.0, 0.0)]).unwrap();
    let weighted = LoadAwareConfig { latency_weight: 4.0, latency_ratio: 0.0, ..cfg() };
    let a = base.clone().add_slowness(&weighted, &slow);
    // loadLatencyWeight 4: twice as slow = 4 more requests; 1.2x = 0.8, rounded to 1. With
    // overloadLatency 0 no hit is diverted for slowness.
    assert_eq!(
        flags(&a),
        vec![("a".into(), false, 0), ("b".into(), false, 4), ("c".into(), false, 1)]
    );
    let eager = LoadAwareConfig { latency_ratio: 1.8, ..weighted.clone() };
    let a = base.clone().add_slowness(&eager, &slow);
    assert_eq!(
        flags(&a),
        vec![("a".into(), false, 0), ("b".into(), true, 4), ("c".into(), false, 1)]
    );
    // The defaults: weight 16, twice as slow = 16 more, 1.2x = 3.2, rounded to 3; overloadLatency
    // 1.6, so b's hits are diverted. Weight 0: no penalty.
    assert_eq!(
        flags(&base.clone().add_slowness(&cfg(), &slow)),
        vec![("a".into(), false, 0), ("b".into(), true, 16), ("c".into(), false, 3)]
    );
    let off = LoadAwareConfig { latency_weight: 0.0, latency_ratio: 0.0, ..cfg() };
    assert_eq!(flags(&base.clone().add_slowness(&off, &slow)), flags(&base), "both off");
}

#[test]
fn a_pod_slow_only_by_its_prefill_stalls_gets_the_penalty_but_keeps_its_hits() {
    // b's mean time per byte is twice a's (long gaps while it prefilled), but between them it
    // decodes at a's rate: it counts as more loaded, and its hits are not diverted for slowness
    // (a recompute of their prefix elsewhere would stall that pod in turn). c is slower at
    // every step.
    let slow = vec![
        ("a".to_string(), Slowness::NONE),
        ("b".to_string(), Slowness { overall: 2.0, steady: 1.05 }),
        ("c".to_string(), Slowness { overall: 2.0, steady: 2.0 }),
    ];
    let base =
        load_args(&cfg(), &[pod("a", 0.0, 0.0), pod("b", 0.0, 0.0), pod("c", 0.0, 0.0)]).unwrap();
    assert_eq!(
        flags(&base.add_slowness(&cfg(), &slow)),
        vec![("a".into(), false, 0), ("b".into(), false, 16), ("c".into(), true, 16)]
    );
}

#[test]
fn every_pod_of_a_large_cluster_gets_its_own_load_and_slowness() {
    // 300 pods (looked up by address, not by position): pod i queues i requests, and every third
    // pod streams twice as slowly as the fastest.
    let names: Vec<String> =
        (0..300).map(|i| format!("10.0.{}.{}:8000", i / 256, i % 256)).collect();
    let pods: Vec<PodView> = names.iter().enumerate().map(|(i, n)| pod(n, i as f64, 0.0)).collect();
    let averages: Vec<DecodeAverage> = names
        .iter()
        .enumerate()
        .map(|(i, n)| DecodeAverage {
            pod: n.clone(),
            ns_per_byte: if i % 3 == 0 { 2.0 } else { 1.0 },
            steady_ns_per_byte: 1.0,
            age_ns: 0,
        })
        .collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let slowness = crate::policy::latency::relative_slowness(&averages, &refs);
    let a = load_args(&cfg(), &pods).unwrap().add_slowness(&cfg(), &slowness);
    // The call's host order is the reverse of the metrics' order.
    let order: Vec<String> = names.iter().rev().cloned().collect();
    let mut out = Vec::new();
    a.args(&order, &mut out);
    let penalties: Vec<u32> = out[4..].iter().map(|p| p.parse().unwrap()).collect();
    let expected: Vec<u32> =
        (0..300u32).rev().map(|i| i + if i % 3 == 0 { 16 } else { 0 }).collect();
    assert_eq!(penalties, expected);
}

#[test]
fn a_prefill_backlog_adds_one_request_per_load_prefill_bytes() {
    let pods = [pod("10.0.0.1:8000", 0.0, 0.0), pod("10.0.0.2:8000", 0.0, 0.0)];
    let backlog = vec![("10.0.0.1:8000".to_string(), 48_000), ("10.0.0.9:8000".to_string(), 9_000)];
    let with = load_args(&cfg(), &pods).unwrap().add_prefill_backlog(&cfg(), &backlog);
    let penalties: Vec<u32> = with.hosts.iter().map(|h| h.penalty).collect();
    assert_eq!(penalties, vec![48_000 / 4096, 0], "one request per 4096 bytes by default");
    assert!(with.hosts.iter().all(|h| !h.overloaded), "a backlog never diverts a hit");
    let off = LoadAwareConfig { prefill_bytes: 0, ..cfg() };
    let without = load_args(&off, &pods).unwrap().add_prefill_backlog(&off, &backlog);
    assert!(without.hosts.iter().all(|h| h.penalty == 0));
}
