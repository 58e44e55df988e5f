//! Summaries of request records (percentiles, throughput, hit rates).

use crate::run::RequestRecord;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Mean and percentiles of a latency, in ms.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct Dist {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile, only from at least [`MIN_SAMPLES_FOR_P99`] values (below that it is one
    /// of the few largest values, not a percentile anyone can compare).
    pub p99: Option<f64>,
}

/// Fewest values a p99 is reported from.
pub const MIN_SAMPLES_FOR_P99: usize = 1000;

/// Nearest-rank percentile of sorted values (0 when empty).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Distribution of `values` (any order).
pub fn dist(values: &[f64]) -> Dist {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    let mean = if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
    Dist {
        mean,
        p50: percentile(&v, 50.0),
        p90: percentile(&v, 90.0),
        p99: (v.len() >= MIN_SAMPLES_FOR_P99).then(|| percentile(&v, 99.0)),
    }
}

/// p50/p99 pair.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct P50P99 {
    /// Median.
    pub p50: f64,
    /// 99th percentile (from at least [`MIN_SAMPLES_FOR_P99`] values).
    pub p99: Option<f64>,
}

/// What a run achieved, client side.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed.
    pub errors: usize,
    /// TTFT in simulated ms: (wall - gateway added) / time_scale + gateway added.
    pub ttft_ms: Dist,
    /// End-to-end latency in simulated ms.
    pub e2e_ms: Dist,
    /// Generated tokens per simulated second over the whole run.
    pub output_tokens_per_s: f64,
    /// Σcached / Σprompt tokens from `usage`.
    pub client_hit_rate: f64,
    /// Σoracle-cacheable / Σprompt tokens.
    pub oracle_hit_rate: f64,
    /// Client time-to-headers minus pod time, real (wall) ms: not scaled.
    pub gateway_added_ms: P50P99,
    /// Wall-clock seconds of the run.
    pub wall_s: f64,
    /// Time scale used to convert wall time to simulated time.
    pub time_scale: f64,
    /// Requests per pod (`x-pod-name`).
    pub per_pod_requests: BTreeMap<String, usize>,
}

/// Summarises `records` of a run that took `wall_s` seconds with pods at `time_scale`.
pub fn summarize(records: &[RequestRecord], wall_s: f64, time_scale: f64) -> Summary {
    let ts = if time_scale > 0.0 { time_scale } else { 1.0 };
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.error.is_none()).collect();
    // Pods run `ts` times real time but the gateway does not: convert the pod part of each
    // latency to simulated ms and keep the gateway's own added time (measured per request) as is.
    let sim = |wall: f64, r: &RequestRecord| {
        let gw = r.gateway_added_ms.unwrap_or(0.0).clamp(0.0, wall);
        (wall - gw) / ts + gw
    };
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms.map(|v| sim(v, r))).collect();
    let e2e: Vec<f64> = ok.iter().map(|r| sim(r.e2e_ms, r)).collect();
    let out: usize = ok.iter().map(|r| r.output_tokens).sum();
    let prompt: usize = ok.iter().map(|r| r.prompt_tokens).sum();
    let cached: usize = ok.iter().map(|r| r.cached_tokens).sum();
    let oracle: usize = ok.iter().map(|r| r.oracle_cached_tokens).sum();
    let gw = dist(&ok.iter().filter_map(|r| r.gateway_added_ms).collect::<Vec<_>>());
    let mut per_pod = BTreeMap::new();
    for r in &ok {
        *per_pod.entry(r.pod.clone().unwrap_or_else(|| "?".into())).or_insert(0) += 1;
    }
    let ratio = |a: usize, b: usize| if b > 0 { a as f64 / b as f64 } else { 0.0 };
    Summary {
        requests: records.len(),
        errors: records.len() - ok.len(),
        ttft_ms: dist(&ttft),
        e2e_ms: dist(&e2e),
        output_tokens_per_s: if wall_s > 0.0 { out as f64 / (wall_s / ts) } else { 0.0 },
        client_hit_rate: ratio(cached, prompt),
        oracle_hit_rate: ratio(oracle, prompt),
        gateway_added_ms: P50P99 { p50: gw.p50, p99: gw.p99 },
        wall_s,
        time_scale: ts,
        per_pod_requests: per_pod,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_nearest_rank() {
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        let d = dist(&v);
        assert_eq!(d.p50, 500.0);
        assert_eq!(d.p90, 900.0);
        assert_eq!(d.p99, Some(990.0));
        assert!((d.mean - 500.5).abs() < 1e-9);
        assert_eq!(dist(&v[..999]).p99, None, "no p99 from fewer than 1000 values");
        assert_eq!(dist(&v[..999]).p90, 900.0);
        assert_eq!(dist(&[]).p99, None);
    }

    #[test]
    fn summary_scales_to_simulated_time_and_skips_errors() {
        let ok = RequestRecord {
            ttft_ms: Some(25.0),
            e2e_ms: 100.0,
            output_tokens: 10,
            prompt_tokens: 100,
            cached_tokens: 50,
            oracle_cached_tokens: 80,
            pod: Some("pod-0".into()),
            gateway_added_ms: Some(1.0),
            ..Default::default()
        };
        let mut gw = ok.clone();
        gw.gateway_added_ms = Some(5.0);
        gw.ttft_ms = Some(30.0);
        assert_eq!(summarize(&[gw], 1.0, 0.25).ttft_ms.p50, 105.0, "gateway time is not scaled");
        let bad =
            RequestRecord { error: Some("HTTP 500".into()), e2e_ms: 5.0, ..Default::default() };
        let s = summarize(&[ok.clone(), ok, bad], 1.0, 0.25);
        assert_eq!(s.requests, 3);
        assert_eq!(s.errors, 1);
        // (25 - 1) / 0.25 + 1: the pod part is scaled, the 1 ms gateway part is not
        assert_eq!(s.ttft_ms.p50, 97.0);
        assert_eq!(s.e2e_ms.mean, 397.0);
        assert_eq!(s.output_tokens_per_s, 5.0, "20 tokens in 4 simulated seconds");
        assert_eq!(s.client_hit_rate, 0.5);
        assert_eq!(s.oracle_hit_rate, 0.8);
        assert_eq!(s.gateway_added_ms.p50, 1.0, "gateway overhead stays in real ms");
        assert_eq!(s.per_pod_requests.get("pod-0"), Some(&2));
    }
}
