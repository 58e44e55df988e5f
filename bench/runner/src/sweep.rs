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

/// How much a policy's TTFT must grow over its lightest-load value to count as saturated: queueing
/// in front of full pods multiplies TTFT, while below the knee it only drifts by tens of percent.
pub const SATURATION_FACTOR: f64 = 2.0;

/// Where a policy saturated: the lowest offered rate whose TTFT mean (median over repetitions) is
/// at least [`SATURATION_FACTOR`] times that at the lowest rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Knee {
    /// Offered sessions per simulated second.
    pub rate: f64,
    /// TTFT mean at the lowest rate, ms.
    pub base_ms: f64,
    /// TTFT mean at `rate`, ms.
    pub at_ms: f64,
}

/// Per policy (first-seen order) its [`Knee`], None when the policy stayed below the factor
/// within the swept rates.
pub fn saturation(points: &[SweepPoint]) -> Vec<(String, Option<Knee>)> {
    let mut out: Vec<(String, Option<Knee>)> = Vec::new();
    for p in points {
        if out.iter().any(|(name, _)| *name == p.aggregate.policy) {
            continue;
        }
        let mut mine: Vec<&SweepPoint> =
            points.iter().filter(|q| q.aggregate.policy == p.aggregate.policy).collect();
        mine.sort_by(|a, b| a.sessions_per_s.total_cmp(&b.sessions_per_s));
        let base = mine[0].aggregate.ttft_mean_ms.median;
        let knee = mine
            .iter()
            .find(|q| q.aggregate.ttft_mean_ms.median >= SATURATION_FACTOR * base)
            .map(|q| Knee {
                rate: q.sessions_per_s,
                base_ms: base,
                at_ms: q.aggregate.ttft_mean_ms.median,
            });
        out.push((p.aggregate.policy.clone(), knee));
    }
    out
}

/// Markdown: one row per (policy, rate), then where each policy saturates.
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
    let lowest = rep.rates.iter().copied().fold(f64::INFINITY, f64::min);
    t.push_str(&format!(
        "\nSaturation (the lowest offered rate at which TTFT mean is at least {SATURATION_FACTOR}x that at {lowest} sessions/s):\n\n"
    ));
    for (policy, knee) in saturation(&rep.points) {
        t.push_str(&match knee {
            Some(k) => format!(
                "- {policy}: {} sessions/s (TTFT {:.0} ms against {:.0} ms)\n",
                k.rate, k.at_ms, k.base_ms
            ),
            None => format!("- {policy}: not within the swept rates\n"),
        });
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

    #[test]
    fn saturation_is_the_first_rate_where_ttft_doubles_and_none_when_it_never_does() {
        let runs = [
            run("rr", 1.0, 100.0),
            run("rr", 2.0, 180.0),
            run("rr", 3.0, 900.0),
            run("rr", 4.0, 5000.0),
            run("pc", 1.0, 90.0),
            run("pc", 2.0, 120.0),
            run("pc", 3.0, 170.0),
            run("pc", 4.0, 179.0),
        ];
        let pts = points(&runs, &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(
            saturation(&pts),
            [
                ("rr".to_string(), Some(Knee { rate: 3.0, base_ms: 100.0, at_ms: 900.0 })),
                ("pc".to_string(), None)
            ]
        );
        let rep = SweepReport {
            scenario: "s".into(),
            description: "d".into(),
            stamp: Stamp::default(),
            config: serde_yaml::from_str(
                "name: s\ndescription: d\npods: {count: 2}\nworkload: {kind: multi_turn, sessions: 1, turns_mean: 1, input_tokens_mean: 1, output_tokens_mean: 1}\n",
            )
            .unwrap(),
            rates: vec![1.0, 2.0, 3.0, 4.0],
            points: pts,
            runs: runs.to_vec(),
        };
        let md = table(&rep);
        assert!(md.contains("- rr: 3 sessions/s (TTFT 900 ms against 100 ms)"), "{md}");
        assert!(md.contains("- pc: not within the swept rates"), "{md}");
    }
}
