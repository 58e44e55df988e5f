//! NVIDIA AIPerf, as a user would run it, through the gateway with the compiled plugin to podsim
//! pods: a few multi-turn conversations with `prefix_cache`. What a user notices: no request fails,
//! every later turn finds its whole history in its pod's cache (it was routed to the pod that served
//! the conversation before), and AIPerf's token counts agree with the pods' `usage`.
//!
//! Needs `./build.sh aiperf` (AIPerf in `.venv-aiperf`, the podsim tokenizer in
//! `target/aiperf-tokenizer`), which `./build.sh test` runs. Under CI a missing install fails the test.

use bench::aiperf::{run_policy, AiperfInstall, AiperfOptions};
use bench::procs::Redis;
use bench::scenario::Scenario;
use bench::Paths;
use std::path::PathBuf;

fn root() -> PathBuf {
    let p = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    p.canonicalize().unwrap_or(p)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aiperf_conversations_stay_on_the_pod_that_holds_their_history() {
    let root = root();
    let install = match AiperfInstall::locate(&root) {
        Ok(i) => i,
        Err(e) if std::env::var_os("CI").is_none() => {
            eprintln!("not run: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let paths = Paths::new(&root);
    let sc: Scenario = serde_yaml::from_str(
        "name: aiperf-ci\ntime_scale: 1.0\npods: {count: 3}\npolicies: [prefix_cache]\nworkload: {kind: multi_turn, sessions: 4, turns_mean: 3, input_tokens_mean: 60, output_tokens_mean: 24, concurrency: 2, seed: 3}\n",
    )
    .expect("scenario");
    let redis = Redis::start().await.expect("redis-server");
    let opts = AiperfOptions { request_timeout_s: 60, ..Default::default() };
    let row =
        run_policy(&paths, &install, &sc, &opts, &redis, "prefix_cache").await.expect("aiperf run");

    assert_eq!(row.aiperf.errors, 0, "{row:?}");
    assert_eq!(row.aiperf.requests, 12, "4 conversations x 3 turns");
    assert_eq!(row.turns.len(), 12, "one per-request record each");
    for t in &row.turns {
        assert_eq!(t.client_output_tokens, t.completion_tokens, "AIPerf counts like podsim: {t:?}");
        if t.turn == 0 {
            continue;
        }
        let prev = row
            .turns
            .iter()
            .find(|p| p.conversation == t.conversation && p.turn == t.turn - 1)
            .expect("previous turn recorded");
        let history = prev.prompt_tokens + prev.completion_tokens;
        assert!(
            t.cached_tokens >= history / 16 * 16,
            "turn {} of {} found {} of its {history} history tokens cached",
            t.turn,
            t.conversation,
            t.cached_tokens
        );
    }
    assert!(row.pods_hit_rate > 0.3, "pods' hit rate {}", row.pods_hit_rate);
}
