//! Scenario files (bench/scenarios/*.yaml).

use loadgen::{GatewayChoice, Workload};
use serde::{Deserialize, Serialize};

fn one() -> Vec<usize> {
    vec![1]
}
fn all_policies() -> Vec<String> {
    ["round_robin", "session_hash", "global_least_request", "prefix_cache", "endpoint_metrics"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}
fn default_scale() -> f64 {
    0.25
}
fn default_model() -> String {
    "llama-3.1-8b".into()
}
fn default_workers() -> usize {
    2
}
fn default_reps() -> usize {
    3
}
fn default_health_interval() -> f64 {
    200.0
}

/// The simulated pods of a scenario.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Pods {
    /// Number of pods.
    pub count: usize,
    /// Metrics flavours (comma-separated, in turn): vllm-v0, vllm-v1, sglang.
    #[serde(default = "default_flavor")]
    pub flavor: String,
    /// KV capacity per pod, tokens.
    #[serde(default = "default_capacity")]
    pub kv_capacity_tokens: usize,
    /// Max running sequences per pod.
    #[serde(default = "default_running")]
    pub max_running: usize,
    /// Hardware profile: `h100-8b` or `published-testbed` (podsim `--profile`).
    #[serde(default = "default_profile")]
    pub profile: String,
    /// Speed of each pod relative to the profile (pod i gets entry i, missing entries 1.0).
    #[serde(default)]
    pub speed: Vec<f64>,
    /// Mean reply length at which the model stops (EOS); 0 = replies run to max_tokens.
    #[serde(default)]
    pub eos_mean_tokens: f64,
    /// Extra podsim arguments.
    #[serde(default)]
    pub args: Vec<String>,
}
fn default_profile() -> String {
    "h100-8b".into()
}
fn default_flavor() -> String {
    "vllm-v1".into()
}
fn default_capacity() -> usize {
    400_000
}
fn default_running() -> usize {
    128
}

/// When Redis is frozen, in wall seconds from the start of the load.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct RedisFreeze {
    /// SIGSTOP this many seconds into the load.
    pub at_s: f64,
    /// SIGCONT this many seconds later.
    pub for_s: f64,
}

/// Pods added mid-run, as an autoscaler adds them under load: every router starts with the first
/// `initial_pods` and learns the others `at_s` wall seconds into the load (our gateways through
/// their admin API, as Higress learns endpoints from xDS; a competitor router through its own
/// worker API).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct ScaleOut {
    /// Seconds into the load.
    pub at_s: f64,
    /// Pods routed to before then (the first ones; at least one, fewer than `pods.count`).
    pub initial_pods: usize,
}

/// A benchmark scenario.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Scenario {
    /// Name (results file stem).
    pub name: String,
    /// One line for humans.
    #[serde(default)]
    pub description: String,
    /// Pods' time scale (real s per simulated s).
    #[serde(default = "default_scale")]
    pub time_scale: f64,
    /// Model name.
    #[serde(default = "default_model")]
    pub model: String,
    /// Pods.
    pub pods: Pods,
    /// Gateway replica counts to run (each with every policy), sharing one Redis.
    #[serde(default = "one")]
    pub gateway_replicas: Vec<usize>,
    /// How turns are spread over the replicas: `per_session` (a session keeps its gateway) or
    /// `per_turn` (each turn through the next gateway).
    #[serde(default)]
    pub client_gateway: GatewayChoice,
    /// Repetitions of every (replicas, policy), run interleaved.
    #[serde(default = "default_reps")]
    pub repetitions: usize,
    /// Gateway worker threads per replica.
    #[serde(default = "default_workers")]
    pub gateway_workers: usize,
    /// Policies: round_robin and session_hash (no plugin), global_least_request, prefix_cache,
    /// endpoint_metrics.
    #[serde(default = "all_policies")]
    pub policies: Vec<String>,
    /// Active health checks of the pods for every policy (`endpoint_metrics` always has one, on
    /// `/metrics`; the others check `/health`), as a deployment with failing pods would have.
    #[serde(default)]
    pub health_check: bool,
    /// Freeze Redis (SIGSTOP, then SIGCONT) during every run: TTFT is then reported for the
    /// requests sent while it was frozen.
    #[serde(default)]
    pub redis_freeze: Option<RedisFreeze>,
    /// Add pods during every run: TTFT and the new pods' share are then reported for the
    /// requests sent after they came.
    #[serde(default)]
    pub scale_out: Option<ScaleOut>,
    /// Our gateway's health-check interval in simulated ms (default 200, Higress's
    /// `store_metrics` scrape as we configure it): the gateway gets it times `time_scale`, so
    /// between two scrapes the pods advance as much as they would on real hardware.
    #[serde(default = "default_health_interval")]
    pub health_check_interval_ms: f64,
    /// Extra plugin `lb_config` keys per policy (merged over the defaults).
    #[serde(default)]
    pub lb_config: serde_json::Map<String, serde_json::Value>,
    /// Offered loads of `bench sweep` (sessions per simulated second, open loop).
    #[serde(default)]
    pub sweep_rates: Vec<f64>,
    /// The load.
    pub workload: Workload,
}

impl Scenario {
    /// How many pods the routers know at the start: all, or `scale_out`'s first ones.
    pub fn initial_pods(&self) -> usize {
        match self.scale_out {
            Some(s) => s.initial_pods.clamp(1, self.pods.count),
            None => self.pods.count,
        }
    }

    /// The health-check interval our gateway runs, real ms: `health_check_interval_ms` on the
    /// pods' clock, at least 10 ms (the gateway's floor).
    pub fn gateway_health_interval_ms(&self) -> u64 {
        let real = self.health_check_interval_ms * self.time_scale;
        if real.is_finite() {
            (real.round() as u64).max(10)
        } else {
            200
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shipped_scenario_parses() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios");
        let mut n = 0;
        for e in std::fs::read_dir(dir).expect("scenarios dir") {
            let p = e.expect("entry").path();
            if p.extension().and_then(|x| x.to_str()) != Some("yaml") {
                continue;
            }
            let s: Scenario =
                serde_yaml::from_str(&std::fs::read_to_string(&p).expect("read")).expect("parse");
            assert_eq!(
                Some(s.name.as_str()),
                p.file_stem().and_then(|x| x.to_str()),
                "name matches file"
            );
            assert!(!s.workload.plan().is_empty());
            assert!(
                podsim::engine::Profile::named(&s.pods.profile).is_some(),
                "{}: profile {}",
                s.name,
                s.pods.profile
            );
            n += 1;
        }
        assert!(n >= 4, "seed, shared-prefix, cache-pressure, replicas");
    }

    fn shipped(name: &str) -> Scenario {
        let file = format!("{}/../scenarios/{name}.yaml", env!("CARGO_MANIFEST_DIR"));
        serde_yaml::from_str(&std::fs::read_to_string(&file).expect("read")).expect("parse")
    }

    #[test]
    fn seed_p99_is_the_seed_with_enough_requests_per_run_for_a_p99() {
        let seed = shipped("seed");
        let long = shipped("seed-p99");
        let plan = long.workload.plan();
        let requests: usize = plan.iter().map(|s| s.turns.len()).sum();
        // The table shows a p99 only when every run has this many TTFTs; a margin covers a
        // request or two failing.
        assert!(
            requests >= loadgen::stats::MIN_SAMPLES_FOR_P99 + 10,
            "{requests} requests per run"
        );
        // The same pods, clock and load, and its sessions start with the seed's very sessions.
        assert_eq!(long.pods, seed.pods);
        assert_eq!(long.time_scale, seed.time_scale);
        assert_eq!(long.workload.concurrency(), seed.workload.concurrency());
        let seed_plan = seed.workload.plan();
        assert_eq!(plan[..seed_plan.len()], seed_plan[..]);
        assert!(long.repetitions >= 3);
    }

    #[test]
    fn health_check_interval_follows_the_pods_clock() {
        let mut s: Scenario = serde_yaml::from_str(
            "name: t\npods: {count: 1}\nworkload: {kind: multi_turn, sessions: 1, turns_mean: 1, input_tokens_mean: 10, output_tokens_mean: 10, concurrency: 1}\n",
        )
        .expect("parse");
        assert_eq!(s.time_scale, 0.25);
        assert_eq!(s.health_check_interval_ms, 200.0, "default: 200 simulated ms");
        assert_eq!(s.gateway_health_interval_ms(), 50, "4x faster pods, 4x shorter interval");
        s.time_scale = 1.0;
        assert_eq!(s.gateway_health_interval_ms(), 200);
        s.health_check_interval_ms = 800.0;
        s.time_scale = 0.25;
        assert_eq!(s.gateway_health_interval_ms(), 200, "the real-clock 200 ms at scale 0.25");
        s.time_scale = 0.01;
        assert_eq!(s.gateway_health_interval_ms(), 10, "the gateway's floor");
    }
}
