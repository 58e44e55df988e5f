//! endpoint_metrics end to end: pods exposing vLLM V0, vLLM V1 and SGLang metrics get traffic as
//! the filter chain says, both when the host keeps health-check bodies as metrics and when the
//! plugin has to scrape `/metrics` itself.

use std::time::Duration;

use e2e::*;
use serde_json::{json, Value};

/// The ORIGINAL_DST cluster (with `use_http_header`) the plugin scrapes pods through.
const SCRAPE_CLUSTER: &str = "ai-lb-scrape-original-dst";

/// With `host_metrics` the host's health check stores each pod's `/metrics`; without it the
/// plugin scrapes each pod itself through [`SCRAPE_CLUSTER`].
fn metrics_config(
    route: &str,
    pods: &[Pod],
    mut lb_config: Value,
    host_metrics: bool,
) -> GatewayConfig {
    if !host_metrics {
        lb_config["scrapeCluster"] = json!(SCRAPE_CLUSTER);
    }
    let mut cfg = GatewayConfig::new()
        .route(route, "/", LLM_CLUSTER)
        .cluster(LLM_CLUSTER, &hosts(pods))
        .plugin(json!({"lb_policy": "endpoint_metrics", "lb_config": lb_config}));
    if host_metrics {
        cfg = cfg.metrics_health_check(LLM_CLUSTER, 200);
    } else {
        cfg = cfg.cluster_json(json!({
            "name": SCRAPE_CLUSTER, "type": "ORIGINAL_DST",
            "original_dst_lb_config": {"use_http_header": true}
        }));
    }
    cfg
}

/// Sends `n` one-message chat requests, 30 ms apart; returns where each went.
async fn send_many(gw: &Gateway, n: usize) -> Vec<String> {
    let mut out = Vec::new();
    for i in 0..n {
        let r = chat_once(gw, &format!("question {i}")).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        out.push(r.upstream().unwrap());
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    out
}

fn count(sent: &[String], pod: &Pod) -> usize {
    sent.iter().filter(|h| **h == pod.host()).count()
}

/// Three pods, one per metrics dialect. First B (vLLM V1) is the only pod with an empty queue and
/// low KV usage; then C (SGLang) becomes the only one with an empty queue.
async fn default_chain_scenario(host_metrics: bool, route: &str) {
    let pods = start_pods(route, 3).await.unwrap();
    let (a, b, c) = (&pods[0], &pods[1], &pods[2]);
    a.set_metrics(samples::vllm_v0(4, 20, 0.9, None));
    b.set_metrics(samples::vllm_v1(2, 0, 0.2));
    c.set_metrics(samples::sglang(3, 0, 0.6));
    let lb = json!({"scrapeIntervalMs": 200, "metricsStaleMs": 5000});
    let gw = Gateway::start(&metrics_config(route, &pods, lb, host_metrics)).await.unwrap();
    if !host_metrics {
        // The plugin learns the cluster's hosts from the first requests; until it has metrics
        // those are served by normal balancing (and must be served).
        send_many(&gw, 2).await;
    }
    wait_scrapes(&pods, &[0, 0, 0], 2, Duration::from_secs(15)).await.unwrap();

    // Least queue, then least KV cache: the vLLM V1 pod. The plugin also counts the requests it
    // sent since the last sample as queued (so a burst does not all land on one pod): B gets the
    // large majority, and the queueing, nearly full vLLM V0 pod A gets nothing.
    let sent = send_many(&gw, 12).await;
    let names = named(&pods, &sent);
    assert_eq!(count(&sent, a), 0, "the queueing pod got traffic: {names:?}");
    assert!(count(&sent, b) >= 9, "the least loaded pod should get most requests: {names:?}");

    // The load changes: B queues now, the SGLang pod is idle.
    b.set_metrics(samples::vllm_v1(8, 12, 0.7));
    c.set_metrics(samples::sglang(0, 0, 0.1));
    let before = scrape_counts(&pods);
    wait_scrapes(&pods, &before, 2, Duration::from_secs(15)).await.unwrap();
    let sent = send_many(&gw, 12).await;
    let names = named(&pods, &sent);
    assert_eq!(count(&sent, a), 0, "the queueing pod got traffic: {names:?}");
    assert!(
        count(&sent, c) >= 9,
        "traffic should follow the new metrics to the SGLang pod: {names:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_filter_chain_follows_host_stored_metrics() {
    default_chain_scenario(true, "em-host").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_scrapes_metrics_itself_when_the_host_has_none() {
    // No health_check with store_metrics: only the plugin can be fetching /metrics.
    default_chain_scenario(false, "em-scrape").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_and_most_of_a_target_metric() {
    let pods = start_pods("lm", 3).await.unwrap();
    pods[0].set_metrics(samples::vllm_v1(10, 0, 0.5));
    pods[1].set_metrics(samples::vllm_v1(2, 0, 0.5));
    pods[2].set_metrics(samples::vllm_v1(7, 0, 0.5));
    let least = json!({"metric_policy": "least", "target_metric": "vllm:num_requests_running", "scrapeIntervalMs": 200});
    let most = json!({"metric_policy": "most", "target_metric": "vllm:num_requests_running", "scrapeIntervalMs": 200});
    let gw_least = Gateway::start(&metrics_config("lm-least", &pods, least, true)).await.unwrap();
    let gw_most = Gateway::start(&metrics_config("lm-most", &pods, most, true)).await.unwrap();
    wait_scrapes(&pods, &[0, 0, 0], 4, Duration::from_secs(15)).await.unwrap();

    let sent = send_many(&gw_least, 8).await;
    assert_eq!(tally(&sent), tally(&vec![pods[1].host(); 8]), "least running requests");
    let sent = send_many(&gw_most, 8).await;
    assert_eq!(tally(&sent), tally(&vec![pods[0].host(); 8]), "most running requests");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_underscore_names_and_rate_limit() {
    let pods = start_pods("rl", 3).await.unwrap();
    // sgl-router's rewritten names; pod 2 is clearly the least loaded.
    pods[0].set_metrics(samples::sglang_underscore(9, 30, 0.9));
    pods[1].set_metrics(samples::sglang_underscore(9, 25, 0.8));
    pods[2].set_metrics(samples::sglang_underscore(1, 0, 0.1));
    let lb = json!({"rate_limit": 0.5, "scrapeIntervalMs": 200});
    let gw = Gateway::start(&metrics_config("rl", &pods, lb, true)).await.unwrap();
    wait_scrapes(&pods, &[0, 0, 0], 2, Duration::from_secs(15)).await.unwrap();

    let sent = send_many(&gw, 40).await;
    let best = sent.iter().filter(|h| **h == pods[2].host()).count();
    // rate_limit 0.5: the best pod may take about half of the recent requests, not all of them.
    assert!(
        (14..=28).contains(&best),
        "best pod got {best}/40 with rate_limit 0.5: {:?}",
        tally(&sent)
    );
    for other in &pods[..2] {
        let n = sent.iter().filter(|h| **h == other.host()).count();
        assert!(n < best, "the best pod should still get the largest share: {:?}", tally(&sent));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_a_model_or_metrics_still_served() {
    // Pods expose no metrics at all and requests carry no model: the plugin must not block traffic.
    let pods = start_pods("nm", 2).await.unwrap();
    let gw = Gateway::start(&metrics_config("nm", &pods, json!({"scrapeIntervalMs": 200}), false))
        .await
        .unwrap();
    let mut seen = Vec::new();
    for i in 0..6 {
        let body = json!({"messages": [{"role": "user", "content": format!("no model {i}")}]});
        let r = gw.post_json("/v1/chat/completions", &body).await.unwrap();
        assert_eq!(r.status, 200);
        seen.push(r.upstream().unwrap());
    }
    assert_eq!(tally(&seen).len(), 2, "normal balancing uses both pods: {:?}", tally(&seen));
}

/// Envoy honours `x-envoy-original-dst-host` only on an ORIGINAL_DST cluster: without
/// `scrapeCluster` the plugin must not scrape through the pods' own cluster (each "pod" scrape
/// would reach whichever pod the LB picks, and its metrics would be filed under the wrong pod).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_scrape_cluster_the_plugin_never_scrapes() {
    let pods = start_pods("no-scrape", 2).await.unwrap();
    for p in &pods {
        p.set_metrics(samples::vllm_v1(1, 0, 0.1));
    }
    let cfg = GatewayConfig::new()
        .route("no-scrape", "/", LLM_CLUSTER)
        .cluster(LLM_CLUSTER, &hosts(&pods))
        .plugin(json!({"lb_policy": "endpoint_metrics", "lb_config": {"scrapeIntervalMs": 100}}));
    let gw = Gateway::start(&cfg).await.unwrap();
    let sent = send_many(&gw, 6).await;
    assert_eq!(tally(&sent).len(), 2, "normal balancing: {:?}", tally(&sent));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(scrape_counts(&pods), vec![0, 0], "no scrape without an ORIGINAL_DST cluster");
    assert!(gw.logs().contains("no scrapeCluster set"), "the plugin says so at start");
}

/// A `/metrics` reply over the plugin's cap (4 MiB) is not read into the VM: that pod has no
/// metrics, so requests take normal balancing, and the plugin says why. Read whole, the big pod's
/// metrics (idle, against a queueing pod) would have drawn every request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metrics_reply_over_the_cap_is_not_read_and_requests_still_served() {
    let pods = start_pods("big-metrics", 2).await.unwrap();
    let mut huge = samples::vllm_v1(0, 0, 0.1);
    let line = format!("# {}\n", "x".repeat(1000));
    while huge.len() <= 5 << 20 {
        huge.push_str(&line);
    }
    pods[0].set_metrics(huge);
    pods[1].set_metrics(samples::vllm_v1(8, 20, 0.9));
    let lb = json!({"scrapeIntervalMs": 200});
    let gw = Gateway::start(&metrics_config("big-metrics", &pods, lb, false)).await.unwrap();
    send_many(&gw, 2).await;
    wait_scrapes(&pods, &[0, 0], 2, Duration::from_secs(15)).await.unwrap();
    let sent = send_many(&gw, 8).await;
    assert_eq!(tally(&sent).len(), 2, "normal balancing over both pods: {:?}", tally(&sent));
    assert!(gw.logs().contains("not read (over 4194304)"), "the plugin says why");
}
