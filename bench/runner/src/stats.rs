//! Repetitions: the order runs are made in, and their summary as median with min–max.

use crate::PolicyResult;
use serde::{Deserialize, Serialize};

/// The order of `reps` repetitions of `runs` runs: repetition by repetition (every run once
/// before any run twice), each repetition starting one run later than the previous one, so no
/// policy is always first (cold machine) or always after the same neighbour. Returns
/// (repetition, run index) pairs.
pub fn interleaved(runs: usize, reps: usize) -> Vec<(usize, usize)> {
    (0..reps).flat_map(|rep| (0..runs).map(move |k| (rep, (k + rep) % runs.max(1)))).collect()
}

/// Median with the smallest and largest value of a metric over repetitions.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct Spread {
    /// Median (mean of the two middle values for an even count).
    pub median: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
}

impl Spread {
    /// The spread of `values` (non-finite values ignored); None when there is none.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Option<Spread> {
        let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        let (first, last) = (*v.first()?, *v.last()?);
        let n = v.len();
        let median = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
        Some(Spread { median, min: first, max: last })
    }

    /// `median (min–max)` with `digits` decimals, scaled by `factor` (100 for percentages).
    pub fn show(&self, digits: usize, factor: f64) -> String {
        let f = |x: f64| format!("{:.*}", digits, x * factor);
        format!("{} ({}–{})", f(self.median), f(self.min), f(self.max))
    }
}

/// One (replicas, policy) over all its repetitions.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct PolicyAggregate {
    /// Policy name.
    pub policy: String,
    /// Gateway replicas.
    pub gateway_replicas: usize,
    /// Repetitions run.
    pub repetitions: usize,
    /// Requests per repetition (the workload's).
    pub requests_per_run: usize,
    /// Failed requests over all repetitions.
    pub errors: usize,
    /// Client TTFT mean, simulated ms.
    pub ttft_mean_ms: Spread,
    /// Client TTFT median, simulated ms.
    pub ttft_p50_ms: Spread,
    /// Client TTFT p90, simulated ms (the routing goals are stated in it). Reports written before
    /// it existed have it only per run: [`crate::tables::render`] fills it from the runs.
    #[serde(default)]
    pub ttft_p90_ms: Spread,
    /// Client TTFT p99, simulated ms (only when each run had at least 1000 requests).
    pub ttft_p99_ms: Option<Spread>,
    /// End-to-end latency mean, simulated ms.
    pub e2e_mean_ms: Spread,
    /// Generated tokens per simulated second.
    pub output_tokens_per_s: Spread,
    /// Σcached / Σprompt from the pods.
    pub prefix_hit_rate: Spread,
    /// The oracle's hit rate (an upper bound, same for every policy up to reply lengths).
    pub oracle_hit_rate: Spread,
    /// Per-pod request share: most requests on a pod / mean per pod.
    pub request_share_max_over_mean: Spread,
    /// Time-weighted in-flight requests: busiest pod / mean pod.
    pub inflight_max_over_mean: Spread,
    /// Redis script time per request (µs).
    pub redis_usec_per_request: Spread,
    /// Redis bytes per request.
    pub redis_bytes_per_request: Spread,
    /// Commands sent to Redis per request (scripts, not what they run).
    #[serde(default)]
    pub redis_commands_per_request: Spread,
    /// Redis main-thread CPU per request (µs).
    #[serde(default)]
    pub redis_cpu_usec_per_request: Spread,
    /// Whether every run's CPU figure had Redis's idle CPU taken off.
    #[serde(default)]
    pub redis_cpu_idle_subtracted: bool,
    /// Bytes Redis read per request.
    #[serde(default)]
    pub redis_bytes_in_per_request: Spread,
    /// Bytes Redis wrote per request.
    #[serde(default)]
    pub redis_bytes_out_per_request: Spread,
    /// Gateway added time, median per run, real ms.
    pub gateway_added_p50_ms: Spread,
    /// Time in the plugin per routed request (real ms), when every run measured it.
    #[serde(default)]
    pub plugin_ms_per_request: Option<Spread>,
    /// `plugin_ms_per_request` by phase (`PLUGIN_PHASES`), when every run measured them.
    #[serde(default)]
    pub plugin_ms_by_phase: Vec<(String, Spread)>,
    /// Share of predicted prefix hits the engine reported nothing cached for, when every run
    /// checked some.
    #[serde(default)]
    pub predicted_hits_missed: Option<Spread>,
    /// TTFTs of every repetition (simulated ms), for the chart.
    #[serde(skip)]
    pub ttfts: Vec<f64>,
}

/// Groups `results` by (replicas, policy), in the order each first appears.
pub fn aggregate(results: &[PolicyResult]) -> Vec<PolicyAggregate> {
    let mut keys: Vec<(usize, &str)> = Vec::new();
    for r in results {
        let k = (r.gateway_replicas, r.policy.as_str());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.into_iter()
        .map(|(replicas, policy)| {
            let runs: Vec<&PolicyResult> = results
                .iter()
                .filter(|r| r.gateway_replicas == replicas && r.policy == policy)
                .collect();
            let sp = |f: &dyn Fn(&PolicyResult) -> f64| {
                Spread::of(runs.iter().map(|r| f(r))).unwrap_or_default()
            };
            let p99s: Vec<Option<f64>> = runs.iter().map(|r| r.ttft_ms.p99).collect();
            PolicyAggregate {
                policy: policy.to_string(),
                gateway_replicas: replicas,
                repetitions: runs.len(),
                requests_per_run: runs.first().map(|r| r.requests).unwrap_or(0),
                errors: runs.iter().map(|r| r.errors).sum(),
                ttft_mean_ms: sp(&|r| r.ttft_ms.mean),
                ttft_p50_ms: sp(&|r| r.ttft_ms.p50),
                ttft_p90_ms: sp(&|r| r.ttft_ms.p90),
                ttft_p99_ms: if p99s.iter().all(Option::is_some) {
                    Spread::of(p99s.into_iter().flatten())
                } else {
                    None
                },
                e2e_mean_ms: sp(&|r| r.e2e_ms.mean),
                output_tokens_per_s: sp(&|r| r.output_tokens_per_s),
                prefix_hit_rate: sp(&|r| r.prefix_hit_rate),
                oracle_hit_rate: sp(&|r| r.oracle_hit_rate),
                request_share_max_over_mean: sp(&|r| r.request_share_max_over_mean),
                inflight_max_over_mean: sp(&|r| r.inflight_max_over_mean),
                redis_usec_per_request: sp(&|r| r.redis_usec_per_request),
                redis_bytes_per_request: sp(&|r| r.redis_bytes_per_request),
                redis_commands_per_request: sp(&|r| r.redis_commands_per_request),
                redis_cpu_usec_per_request: sp(&|r| r.redis_cpu_usec_per_request),
                redis_cpu_idle_subtracted: runs.iter().all(|r| r.redis_cpu_idle_subtracted),
                redis_bytes_in_per_request: sp(&|r| r.redis_bytes_in_per_request),
                redis_bytes_out_per_request: sp(&|r| r.redis_bytes_out_per_request),
                gateway_added_p50_ms: sp(&|r| r.gateway_added_ms.p50),
                plugin_ms_per_request: runs
                    .iter()
                    .map(|r| r.plugin_ms_per_request)
                    .collect::<Option<Vec<f64>>>()
                    .and_then(Spread::of),
                plugin_ms_by_phase: crate::PLUGIN_PHASES
                    .iter()
                    .filter_map(|(phase, _)| {
                        let per_run = runs
                            .iter()
                            .map(|r| r.plugin_ms_by_phase.get(*phase).copied())
                            .collect::<Option<Vec<f64>>>()?;
                        Some((phase.to_string(), Spread::of(per_run)?))
                    })
                    .collect(),
                predicted_hits_missed: runs
                    .iter()
                    .map(|r| r.predicted_hits_missed)
                    .collect::<Option<Vec<f64>>>()
                    .and_then(Spread::of),
                ttfts: runs.iter().flat_map(|r| r.ttfts.iter().copied()).collect(),
            }
        })
        .collect()
}

/// Requests in flight on each pod over time, as the client saw them (sent, not yet finished).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LoadSeries {
    /// Seconds (wall) between samples.
    pub step_s: f64,
    /// Pod names, in the order of `inflight`.
    pub pods: Vec<String>,
    /// `inflight[p][k]`: requests on pod p at time k × step_s.
    pub inflight: Vec<Vec<f64>>,
}

/// Samples `spans` (pod, start s, end s) at `points` instants over [0, the last end].
pub fn load_series(spans: &[(String, f64, f64)], points: usize) -> LoadSeries {
    let mut pods: Vec<String> = spans.iter().map(|s| s.0.clone()).collect();
    pods.sort();
    pods.dedup();
    let end = spans.iter().map(|s| s.2).fold(0.0, f64::max);
    let points = points.max(2);
    let step_s = end / (points - 1) as f64;
    let inflight = pods
        .iter()
        .map(|pod| {
            (0..points)
                .map(|k| {
                    let t = k as f64 * step_s;
                    spans.iter().filter(|s| &s.0 == pod && s.1 <= t && t < s.2).count() as f64
                })
                .collect()
        })
        .collect();
    LoadSeries { step_s, pods, inflight }
}

/// Busiest / mean of per-pod values (0 when they are all 0). Pods that got nothing count in
/// the mean: a policy that starves a pod is imbalanced.
pub fn max_over_mean(values: &[f64]) -> f64 {
    let mean = values.iter().sum::<f64>() / values.len().max(1) as f64;
    if mean > 0.0 {
        values.iter().copied().fold(0.0, f64::max) / mean
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use loadgen::stats::Dist;

    #[test]
    fn repetitions_interleave_and_rotate() {
        let order = interleaved(3, 3);
        assert_eq!(
            order,
            [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 0), (2, 2), (2, 0), (2, 1)],
            "every run once per repetition, a different run first each time"
        );
        assert!(interleaved(0, 3).is_empty());
    }

    #[test]
    fn spread_is_median_min_max() {
        let s = Spread::of([30.0, 10.0, 20.0]).expect("values");
        assert_eq!(s, Spread { median: 20.0, min: 10.0, max: 30.0 });
        assert_eq!(Spread::of([4.0, 1.0, 3.0, 2.0]).map(|s| s.median), Some(2.5));
        assert_eq!(Spread::of([f64::NAN]), None);
        assert_eq!(s.show(1, 1.0), "20.0 (10.0–30.0)");
        assert_eq!(Spread::of([0.4]).map(|s| s.show(0, 100.0)).as_deref(), Some("40 (40–40)"));
    }

    #[test]
    fn load_series_counts_requests_in_flight_per_pod() {
        let spans = vec![
            ("pod-1".to_string(), 0.0, 4.0),
            ("pod-0".to_string(), 1.0, 3.0),
            ("pod-0".to_string(), 2.0, 4.0),
        ];
        let s = load_series(&spans, 5);
        assert_eq!(s.pods, ["pod-0", "pod-1"]);
        assert_eq!(s.step_s, 1.0);
        assert_eq!(s.inflight[0], [0.0, 1.0, 2.0, 1.0, 0.0], "ends are exclusive");
        assert_eq!(s.inflight[1], [1.0, 1.0, 1.0, 1.0, 0.0]);
    }

    #[test]
    fn balance_counts_starved_pods() {
        assert_eq!(max_over_mean(&[10.0, 10.0, 10.0]), 1.0);
        assert_eq!(max_over_mean(&[15.0, 15.0, 0.0]), 1.5, "an idle pod is imbalance");
        assert_eq!(max_over_mean(&[0.0, 0.0]), 0.0);
    }

    fn run(policy: &str, ttft: f64, p99: Option<f64>) -> PolicyResult {
        PolicyResult {
            policy: policy.into(),
            gateway_replicas: 1,
            requests: 300,
            ttft_ms: Dist { mean: ttft, p50: ttft, p90: ttft, p99 },
            ttfts: vec![ttft],
            ..Default::default()
        }
    }

    #[test]
    fn aggregate_groups_repetitions_and_keeps_p99_only_when_every_run_has_one() {
        let results = [
            run("rr", 100.0, None),
            run("pc", 50.0, Some(90.0)),
            run("rr", 120.0, None),
            run("pc", 40.0, Some(80.0)),
            run("rr", 110.0, None),
            run("pc", 45.0, Some(85.0)),
        ];
        let agg = aggregate(&results);
        assert_eq!(agg.len(), 2);
        assert_eq!(agg[0].policy, "rr", "first-seen order");
        assert_eq!(agg[0].repetitions, 3);
        assert_eq!(agg[0].ttft_mean_ms, Spread { median: 110.0, min: 100.0, max: 120.0 });
        assert_eq!(agg[0].ttft_p99_ms, None);
        assert_eq!(agg[1].ttft_p99_ms, Some(Spread { median: 85.0, min: 80.0, max: 90.0 }));
        assert_eq!(agg[1].ttfts.len(), 3, "every repetition's TTFTs for the CDF");
    }
}
