//! cluster_metrics end to end: the plugin picks one of two clusters (services) by writing the
//! cluster header, and traffic moves between them as the chosen mode says.

use std::time::Duration;

use e2e::*;
use serde_json::json;
use testkit::http::HttpRequest;

const SVC_A: &str = "outbound|8000||svc-a.static";
const SVC_B: &str = "outbound|8000||svc-b.static";
const HEADER: &str = "x-envoy-target-cluster";

async fn two_clusters(route: &str, mode: &str) -> (Pod, Pod, Gateway) {
    two_clusters_on_workers(route, mode, 2).await
}

/// Statistics are per worker: a test of one request's effect runs on one worker.
async fn two_clusters_on_workers(route: &str, mode: &str, workers: usize) -> (Pod, Pod, Gateway) {
    let a = Pod::start(&format!("{route}-a")).await.unwrap();
    let b = Pod::start(&format!("{route}-b")).await.unwrap();
    let cfg = GatewayConfig::new()
        .route_json(json!({"name": route, "match": {"prefix": "/"}, "cluster_header": HEADER, "timeout_ms": 60000}))
        .cluster(SVC_A, &[a.host()])
        .cluster(SVC_B, &[b.host()])
        .workers(workers)
        .plugin(json!({
            "lb_type": "cluster",
            "lb_policy": "cluster_metrics",
            "lb_config": {"mode": mode, "service_list": [SVC_A, SVC_B], "cluster_header": HEADER, "queue_size": 5}
        }));
    let gw = Gateway::start(&cfg).await.unwrap();
    (a, b, gw)
}

fn request(i: usize, stream: bool) -> HttpRequest {
    HttpRequest::post_json(
        "/v1/chat/completions",
        &json!({"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": format!("q{i}")}]}),
    )
}

async fn sequential(gw: &Gateway, n: usize, stream: bool) -> Vec<String> {
    let mut out = Vec::new();
    for i in 0..n {
        let r = gw.send(request(i, stream), REQUEST_TIMEOUT).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        out.push(r.upstream().unwrap());
    }
    out
}

fn count(sent: &[String], pod: &Pod) -> usize {
    sent.iter().filter(|h| **h == pod.host()).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_busy_avoids_the_cluster_with_requests_in_flight() {
    let (a, b, gw) = two_clusters("cm-busy", "LeastBusy").await;
    a.set_delay(Duration::from_millis(1500));
    let mut pending = Vec::new();
    for i in 0..20 {
        pending.push(spawn_request(gw.addr(), request(i, false), Duration::from_secs(20)));
        tokio::time::sleep(Duration::from_millis(75)).await;
    }
    let mut sent = Vec::new();
    for p in pending {
        let r = p.await.unwrap().unwrap();
        assert_eq!(r.status, 200);
        sent.push(r.upstream().unwrap());
    }
    assert!(
        count(&sent, &b) >= 14,
        "LeastBusy sent {}/20 to the idle cluster: {:?}",
        count(&sent, &b),
        tally(&sent)
    );
    assert!(count(&sent, &a) >= 1, "both clusters are candidates");
    // The plugin told the router which cluster to use through the header, and the pods saw it.
    for r in b.inference_records() {
        assert_eq!(r.header(HEADER), Some(SVC_B));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_total_latency_moves_traffic_when_latencies_swap() {
    let (a, b, gw) = two_clusters("cm-lat", "LeastTotalLatency").await;
    a.set_delay(Duration::from_millis(300));
    let sent = sequential(&gw, 16, false).await;
    assert!(count(&sent, &b) >= 12, "fast cluster got {}/16: {:?}", count(&sent, &b), tally(&sent));

    // Now B is the slow one.
    a.set_delay(Duration::ZERO);
    b.set_delay(Duration::from_millis(600));
    let sent = sequential(&gw, 20, false).await;
    let tail = &sent[10..];
    assert!(count(tail, &a) >= 8, "after the swap the last 10 requests should go to A: {:?}", sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_first_token_latency_prefers_the_quick_starter() {
    let (a, b, gw) = two_clusters("cm-ttft", "LeastFirstTokenLatency").await;
    // A starts streaming late; B starts at once (both stream the same answer).
    a.set_delay(Duration::from_millis(300));
    a.set_stream_chunk_delay(Duration::from_millis(5));
    b.set_stream_chunk_delay(Duration::from_millis(5));
    let sent = sequential(&gw, 16, true).await;
    assert!(
        count(&sent, &b) >= 12,
        "quick-start cluster got {}/16: {:?}",
        count(&sent, &b),
        tally(&sent)
    );
    let _ = a;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_score_sends_most_requests_to_the_faster_cluster() {
    let (a, b, gw) = two_clusters_on_workers("cm-adaptive", "AdaptiveScore", 1).await;
    a.set_delay(Duration::from_millis(300));
    let sent = sequential(&gw, 20, false).await;
    // The slow cluster is measured once (a service without samples scores as least busy), then
    // the fast one wins until its queue would outweigh it (never, one request at a time).
    assert_eq!(count(&sent, &a), 1, "{:?}", tally(&sent));
    // The fast cluster fails once: it cools down for failure_cooldown_ms (30 s by default), and
    // the slow one takes the requests meanwhile.
    b.set_fail(Some(503));
    let r = gw.send(request(100, false), REQUEST_TIMEOUT).await.unwrap();
    assert_eq!(r.status, 503, "the fast cluster, chosen, failed");
    b.set_fail(None);
    let sent = sequential(&gw, 8, false).await;
    assert_eq!(count(&sent, &a), 8, "the failed cluster cools down: {:?}", tally(&sent));
}
