//! The gateway fixture against the real `target/release/gateway` without a plugin (a plain
//! round-robin proxy): startup-line parsing, proxying with `x-gateway-upstream-host`, the admin API.

use std::time::Duration;

use serde_json::json;
use testkit::gateway::{endpoint_health, LLM_CLUSTER};
use testkit::http::HttpRequest;
use testkit::{Gateway, GatewayConfig, Pod};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_gateway_round_robins_and_admin_api_works() {
    let a = Pod::start("plain-a").await.unwrap();
    let b = Pod::start("plain-b").await.unwrap();
    let cfg = GatewayConfig::new()
        .route("plain", "/", LLM_CLUSTER)
        .cluster(LLM_CLUSTER, &[a.host(), b.host()]);
    let gw = Gateway::start(&cfg).await.unwrap();
    assert_ne!(gw.addr().port(), 0);
    gw.admin().unwrap();

    let mut seen = Vec::new();
    for i in 0..6 {
        let body =
            json!({"model": "m", "messages": [{"role": "user", "content": format!("hi {i}")}]});
        let r = gw.post_json("/v1/chat/completions", &body).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let up = r.upstream().expect("x-gateway-upstream-host");
        assert_eq!(
            Some(up.as_str()),
            r.header("x-pod").map(|n| if n == "plain-a" { a.host() } else { b.host() }).as_deref()
        );
        seen.push(up);
    }
    let on_a = seen.iter().filter(|h| **h == a.host()).count();
    assert_eq!(on_a, 3, "round robin over two pods: {seen:?}");

    let stats = gw.stats().await.unwrap();
    assert!(stats.contains("gateway_requests_total"), "{stats}");
    let total = gw.stat("gateway_upstream_requests_total", &[("host", &a.host())]).await.unwrap();
    assert_eq!(total, Some(3.0), "{stats}");

    // Mark A unhealthy: everything goes to B.
    gw.set_health(LLM_CLUSTER, &[(a.host().as_str(), "Unhealthy")]).await.unwrap();
    gw.wait_health(LLM_CLUSTER, &a.host(), "Unhealthy", Duration::from_secs(5)).await.unwrap();
    for _ in 0..4 {
        let r = gw.send(HttpRequest::get("/v1/models"), Duration::from_secs(5)).await.unwrap();
        assert_eq!(r.upstream(), Some(b.host()));
    }
    // Replace the endpoint set: only B; then A comes back as a new endpoint, which starts Healthy.
    gw.set_endpoints(LLM_CLUSTER, &[b.host()]).await.unwrap();
    let clusters = gw.clusters().await.unwrap();
    assert_eq!(endpoint_health(&clusters, LLM_CLUSTER, &a.host()), None, "{clusters}");
    gw.set_endpoints(LLM_CLUSTER, &[a.host(), b.host()]).await.unwrap();
    gw.wait_health(LLM_CLUSTER, &a.host(), "Healthy", Duration::from_secs(5)).await.unwrap();
    let mut seen = Vec::new();
    for _ in 0..4 {
        let r = gw.send(HttpRequest::get("/v1/models"), Duration::from_secs(5)).await.unwrap();
        seen.push(r.upstream().unwrap());
    }
    assert!(seen.contains(&a.host()) && seen.contains(&b.host()), "{seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_config_fails_fast_with_the_gateway_message() {
    let cfg = GatewayConfig::new().route("r", "/", "no-such-cluster");
    let started = std::time::Instant::now();
    let err = match Gateway::start(&cfg).await {
        Ok(_) => panic!("a route to an unknown cluster must be refused"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("no-such-cluster"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// A plugin that traps in every request headers callback.
const TRAPPING_PLUGIN: &str = r#"(module
  (memory (export "memory") 1)
  (func (export "proxy_abi_version_0_2_1"))
  (func (export "proxy_on_memory_allocate") (param i32) (result i32) (i32.const 1024))
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32) unreachable))
"#;

async fn trapping_gateway(pod: &Pod, dir: &testkit::paths::TempDir, expect: bool) -> Gateway {
    let module = dir.path().join("trap.wat");
    std::fs::write(&module, TRAPPING_PLUGIN).unwrap();
    let cfg = GatewayConfig::new()
        .route("r", "/", LLM_CLUSTER)
        .cluster(LLM_CLUSTER, &[pod.host()])
        .plugin_module(&module, json!({}))
        .workers(1)
        .drain_timeout_ms(0);
    let cfg = if expect { cfg.expect_traps() } else { cfg };
    let gw = Gateway::start(&cfg).await.unwrap();
    let r = gw.send(HttpRequest::get("/v1/models"), Duration::from_secs(5)).await.unwrap();
    assert_eq!(r.status, 503, "fail-closed after the trap: {}", r.text());
    gw
}

/// The harness's zero-trap check: a gateway whose plugin trapped fails the test when it is dropped
/// (from the admin stats while it runs, from its trap log lines once it has exited), unless the
/// test said it expects traps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trap_fails_the_test_unless_expected() {
    let pod = Pod::start("trap-pod").await.unwrap();
    let dir = testkit::paths::TempDir::new("trap-plugin").unwrap();

    let mut gw = trapping_gateway(&pod, &dir, false).await;
    assert_eq!(gw.traps().unwrap(), 1);
    let err = gw.check_no_traps().unwrap_err().to_string();
    assert!(err.contains("trapped 1 time(s)"), "{err}");
    let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(gw)));
    let msg = dropped.expect_err("dropping a gateway whose plugin trapped must panic");
    let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("proxy_on_request_headers"), "{msg}");

    // After the process exited, the trap lines it logged count.
    let mut gw = trapping_gateway(&pod, &dir, false).await;
    gw.terminate().unwrap();
    assert!(gw.wait_exit(Duration::from_secs(10)).await.is_some());
    assert_eq!(gw.traps().unwrap(), 1);
    let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(gw)));
    assert!(dropped.is_err(), "an exited gateway whose plugin trapped must fail too");

    // Opted out: the same trap passes.
    let gw = trapping_gateway(&pod, &dir, true).await;
    drop(gw);
}
