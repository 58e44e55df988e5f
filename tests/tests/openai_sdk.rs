//! A real client: the official OpenAI Python SDK (`pip install openai`) talks to the gateway with
//! the plugin in prefix_cache mode; every turn of its conversation (JSON and streamed) lands on one
//! pod and the SDK parses every answer.
//!
//! The SDK is installed with pip when missing (PyPI is reachable on the project's machines); if
//! that fails the test fails: it is never silently skipped.

use std::process::Command;
use std::time::Duration;

use e2e::*;
use serde_json::{json, Value};

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string())
}

fn ensure_openai_sdk() {
    let has = Command::new(python())
        .args(["-c", "import openai"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if has {
        return;
    }
    let out = Command::new(python())
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "openai"])
        .output()
        .expect("run pip");
    assert!(
        out.status.success(),
        "pip install openai failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_sdk_conversation_sticks_to_one_pod() {
    tokio::task::spawn_blocking(ensure_openai_sdk).await.unwrap();
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("sdk", 3).await.unwrap();
    for p in &pods {
        p.set_stream_chunk_delay(Duration::from_millis(10));
    }
    let gw =
        Gateway::start(&redis_policy_config("route-sdk", &pods, &redis, "prefix_cache", json!({})))
            .await
            .unwrap();
    let script = paths::workspace_root().join("tests/python/openai_conversation.py");
    let base_url = format!("http://{}/v1", gw.addr());
    let run = tokio::task::spawn_blocking(move || {
        Command::new(python())
            .arg(script)
            .env("GATEWAY_BASE_URL", base_url)
            .env("MODEL", MODEL)
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
    let turns: Vec<Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(turns.len(), 4, "{stdout}");
    let home = turns[0]["upstream"].as_str().unwrap().to_string();
    let pod = pod_at(&pods, &home).unwrap();
    for t in &turns {
        assert_eq!(t["upstream"].as_str(), Some(home.as_str()), "turn left its pod: {stdout}");
        assert_eq!(
            t["answer"].as_str(),
            Some(format!("Hello from {}", pod.name()).as_str()),
            "{stdout}"
        );
    }
    assert!(turns.iter().any(|t| t["stream"] == true), "no streamed turn");
    assert_eq!(pod.inference_count(), 4);
}
