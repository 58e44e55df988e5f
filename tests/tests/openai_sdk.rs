//! A real client: the official OpenAI Python SDK (`pip install openai`) talks to the gateway with
//! the plugin in prefix_cache mode; every turn of its conversation (JSON and streamed, on the chat
//! API and on the Responses API) lands on one pod and the SDK parses every answer.
//!
//! The SDK is pinned (`OPENAI_SDK_VERSION`, as in build.sh) and lives in a venv of its own:
//! `./build.sh test` installs it into `.venv-sdk/` and passes its interpreter as
//! `OPENAI_SDK_PYTHON`. Run alone (`cargo test -p e2e --test openai_sdk`) the test makes that venv
//! itself, once per process (the tests run in parallel, and parallel pip runs into one
//! site-packages break each other). If the SDK cannot be had the test fails: it is never silently
//! skipped.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use e2e::*;
use serde_json::{json, Value};

/// The SDK release the scripts are written against; build.sh pins the same one.
const OPENAI_SDK_VERSION: &str = "3.57.0";

/// A Python interpreter that imports the pinned SDK: `OPENAI_SDK_PYTHON` when set, else the
/// workspace's `.venv-sdk`, made on first use.
fn python() -> &'static Result<PathBuf, String> {
    static PYTHON: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    PYTHON.get_or_init(|| {
        if let Ok(p) = std::env::var("OPENAI_SDK_PYTHON") {
            let p = PathBuf::from(p);
            return if has_pinned_sdk(&p) {
                Ok(p)
            } else {
                Err(format!(
                    "OPENAI_SDK_PYTHON={} does not import openai {OPENAI_SDK_VERSION}: `./build.sh test` installs it",
                    p.display()
                ))
            };
        }
        let venv = paths::workspace_root().join(".venv-sdk");
        let p = venv.join("bin/python");
        if has_pinned_sdk(&p) {
            return Ok(p);
        }
        run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
        run(Command::new(&p).args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            &format!("openai=={OPENAI_SDK_VERSION}"),
        ]))?;
        Ok(p)
    })
}

fn has_pinned_sdk(python: &Path) -> bool {
    let check =
        format!("import openai, sys; sys.exit(openai.__version__ != '{OPENAI_SDK_VERSION}')");
    Command::new(python).args(["-c", &check]).status().map(|s| s.success()).unwrap_or(false)
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

/// Runs `tests/python/<script>` against the gateway; its output lines, parsed.
async fn run_sdk_script(gw: &Gateway, script: &str, env: &[(&str, String)]) -> Vec<Value> {
    let python = tokio::task::spawn_blocking(python).await.unwrap();
    let python = python.as_ref().expect("the OpenAI SDK").clone();
    let script = paths::workspace_root().join("tests/python").join(script);
    let base_url = format!("http://{}/v1", gw.addr());
    let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
    let run = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .env("GATEWAY_BASE_URL", base_url)
            .env("MODEL", MODEL)
            .envs(env)
            .output()
    });
    let out = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the SDK script hangs")
        .unwrap()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "SDK script failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_sdk_conversation_sticks_to_one_pod() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("sdk", 3).await.unwrap();
    for p in &pods {
        p.set_stream_chunk_delay(Duration::from_millis(10));
    }
    let gw =
        Gateway::start(&redis_policy_config("route-sdk", &pods, &redis, "prefix_cache", json!({})))
            .await
            .unwrap();
    let turns = run_sdk_script(&gw, "openai_conversation.py", &[]).await;
    assert_eq!(turns.len(), 4, "{turns:?}");
    let home = turns[0]["upstream"].as_str().unwrap().to_string();
    let pod = pod_at(&pods, &home).unwrap();
    for t in &turns {
        assert_eq!(t["upstream"].as_str(), Some(home.as_str()), "turn left its pod: {turns:?}");
        assert_eq!(
            t["answer"].as_str(),
            Some(format!("Hello from {}", pod.name()).as_str()),
            "{turns:?}"
        );
    }
    assert!(turns.iter().any(|t| t["stream"] == true), "no streamed turn");
    assert_eq!(pod.inference_count(), 4);
}

/// A `prefix_cache` gateway on a fresh Redis before three pods (streaming 10 ms a word), and the
/// rounds a Responses API script printed, given a task of its own.
struct ResponsesRun {
    _redis: RedisFixture,
    pods: Vec<Pod>,
    gw: Gateway,
    rounds: Vec<Value>,
}

async fn run_responses_script(name: &str, script: &str) -> ResponsesRun {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods(name, 3).await.unwrap();
    for p in &pods {
        p.set_stream_chunk_delay(Duration::from_millis(10));
    }
    let route = format!("route-{name}");
    let cfg = redis_policy_config(&route, &pods, &redis, "prefix_cache", json!({}));
    let gw = Gateway::start(&cfg).await.unwrap();
    let task = format!("The build of {} fails on the CI; fix it.", paths::unique_name("repo"));
    let rounds = run_sdk_script(&gw, script, &[("TASK", task)]).await;
    ResponsesRun { _redis: redis, pods, gw, rounds }
}

impl ResponsesRun {
    /// Asserts that there were `n` rounds, some streamed, all answered by one pod, which reported
    /// the rounds before each as cached and served nothing else; returns that pod.
    fn one_pod_served(&self, n: usize) -> &Pod {
        let rounds = &self.rounds;
        assert_eq!(rounds.len(), n, "{rounds:?}");
        let home = rounds[0]["upstream"].as_str().unwrap().to_string();
        let pod = pod_at(&self.pods, &home).unwrap();
        for r in rounds {
            assert_eq!(
                r["upstream"].as_str(),
                Some(home.as_str()),
                "round left its pod: {rounds:?}"
            );
            let answer = format!("Hello from {}", pod.name());
            assert_eq!(r["answer"].as_str(), Some(answer.as_str()), "{rounds:?}");
            let cached = r["cached_tokens"].as_u64().unwrap_or(0);
            assert_eq!(cached > 0, r["round"] != 0, "the pod holds the rounds before: {rounds:?}");
        }
        assert!(rounds.iter().any(|r| r["stream"] == true), "no streamed round");
        assert_eq!(pod.inference_count(), n);
        pod
    }
}

/// A coding agent on the Responses API, as the SDK sends it (its own output items fed back, a
/// function call and its output per round, JSON and streamed rounds): every round lands on the
/// pod holding the rounds before, which reports them cached, and the plugin's counters agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_sdk_responses_agent_stays_on_its_pod() {
    let run = run_responses_script("sdk-responses", "openai_responses_agent.py").await;
    run.one_pod_served(4);
    let stats = run.gw.stats().await.unwrap();
    assert_eq!(stat(&stats, "ai_lb_prefix_miss"), 1, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_hit"), 3, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_predicted_hit_engine_hit"), 3, "{stats}");
}

/// A conversation kept on the server (`store=True`, then only `previous_response_id` and the new
/// message per round), as the SDK sends it, over three pods that each keep their own responses
/// (vLLM's store is per process): every round reaches the pod that made the response it names,
/// so none gets the 404 another pod gives, and the plugin's counters say why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_sdk_stored_responses_reach_the_pod_that_made_them() {
    let run = run_responses_script("sdk-stored", "openai_responses_stored.py").await;
    let pod = run.one_pod_served(6);
    let stats = run.gw.stats().await.unwrap();
    assert_eq!(stat(&stats, "ai_lb_prefix_response_recorded"), 6, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_response_followed"), 5, "{stats}");
    assert_eq!(stat(&stats, "ai_lb_prefix_response_unknown"), 0, "{stats}");
    // Any other pod refuses the last response's next round: the pinning is what kept them served.
    let last = run.rounds[5]["id"].as_str().unwrap();
    for other in run.pods.iter().filter(|p| p.name() != pod.name()) {
        let next = json!({"model": MODEL, "previous_response_id": last, "input": "Go on."});
        let r = testkit::http::post_json(other.addr(), "/v1/responses", &next).await.unwrap();
        assert_eq!(r.status, 404, "{} has no such response", other.name());
    }
}
