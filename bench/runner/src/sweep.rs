//! Load sweep: the scenario's sessions as an open loop (Poisson arrivals) at several offered
//! rates, every policy at every rate, repetitions interleaved; TTFT against offered load.

use crate::stats::{aggregate, PolicyAggregate};
use crate::{PolicyResult, Stamp};
use serde::{Deserialize, Serialize};

/// One (policy, offered rate): the scenario table's aggregate at that rate.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SweepPoint {
    /// Sessions started per simulated second.
    pub sessions_per_s: f64,
    /// Median (min–max) over the repetitions.
    pub aggregate: PolicyAggregate,
}

/// bench/results/<scenario>-sweep.json.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SweepReport {
    /// Scenario name.
    pub scenario: String,
    /// Scenario description.
    pub description: String,
    /// Date, commit and machine.
    pub stamp: Stamp,
    /// The scenario as written (its arrivals replaced by each rate).
    pub config: crate::scenario::Scenario,
    /// Offered rates, sessions per simulated second.
    pub rates: Vec<f64>,
    /// Policy × rate, policies in scenario order, rates ascending.
    pub points: Vec<SweepPoint>,
    /// Every run.
    pub runs: Vec<PolicyResult>,
}

/// Groups sweep runs by offered rate, then by policy as [`aggregate`] does.
pub fn points(runs: &[PolicyResult], rates: &[f64]) -> Vec<SweepPoint> {
    let mut out = Vec::new();
    for &rate in rates {
        let at: Vec<PolicyResult> = runs
            .iter()
            .filter(|r| r.offered_sessions_per_s.is_some_and(|x| (x - rate).abs() < 1e-9))
            .cloned()
            .collect();
        for a in aggregate(&at) {
            out.push(SweepPoint { sessions_per_s: rate, aggregate: a });
        }
    }
    // Policy by policy (first-seen order), rates ascending within each.
    let order: Vec<String> = {
        let mut v: Vec<String> = Vec::new();
        for p in &out {
            if !v.contains(&p.aggregate.policy) {
                v.push(p.aggregate.policy.clone());
            }
        }
        v
    };
    out.sort_by(|a, b| {
        let ia = order.iter().position(|p| *p == a.aggregate.policy);
        let ib = order.iter().position(|p| *p == b.aggregate.policy);
        ia.cmp(&ib).then(a.sessions_per_s.total_cmp(&b.sessions_per_s))
    });
    out
}

/// Markdown: one row per (policy, rate).
pub fn table(rep: &SweepReport) -> String {
    let mut t = String::from(
        "| policy | sessions/s offered | runs × req | err | TTFT mean | TTFT p50 | E2E mean | out tok/s | hit rate (pods) | req share max/mean |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for p in &rep.points {
        let r = &p.aggregate;
        t.push_str(&format!(
            "| {} | {} | {} × {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.policy,
            p.sessions_per_s,
            r.repetitions,
            r.requests_per_run,
            r.errors,
            r.ttft_mean_ms.show(0, 1.0),
            r.ttft_p50_ms.show(0, 1.0),
            r.e2e_mean_ms.show(0, 1.0),
            r.output_tokens_per_s.show(0, 1.0),
            r.prefix_hit_rate.show(1, 100.0),
            r.request_share_max_over_mean.show(2, 1.0),
        ));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use loadgen::stats::Dist;

    fn run(policy: &str, rate: f64, ttft: f64) -> PolicyResult {
        PolicyResult {
            policy: policy.into(),
            gateway_replicas: 1,
            requests: 10,
            offered_sessions_per_s: Some(rate),
            ttft_ms: Dist { mean: ttft, p50: ttft, p90: ttft, p99: None },
            ..Default::default()
        }
    }

    #[test]
    fn sweep_points_group_by_rate_then_policy() {
        let runs = [
            run("rr", 2.0, 300.0),
            run("pc", 1.0, 90.0),
            run("rr", 1.0, 100.0),
            run("pc", 2.0, 150.0),
            run("rr", 1.0, 120.0),
            run("rr", 2.0, 320.0),
        ];
        let pts = points(&runs, &[1.0, 2.0]);
        let got: Vec<(&str, f64, f64, usize)> = pts
            .iter()
            .map(|p| {
                let a = &p.aggregate;
                (a.policy.as_str(), p.sessions_per_s, a.ttft_mean_ms.median, a.repetitions)
            })
            .collect();
        assert_eq!(
            got,
            [
                ("pc", 1.0, 90.0, 1),
                ("pc", 2.0, 150.0, 1),
                ("rr", 1.0, 110.0, 2),
                ("rr", 2.0, 310.0, 2)
            ]
        );
    }
}
