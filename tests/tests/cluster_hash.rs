//! cluster_hash end to end: the compiled plugin sends each key (a header, or the OpenAI `user`
//! field of the body) to one of two clusters by weight, always the same one, as the Go plugin's
//! FNV-1a slots do; a request without its key is answered 403.

use e2e::*;
use serde_json::json;
use testkit::http::HttpRequest;

const SVC_A: &str = "outbound|8000||svc-a.static";
const SVC_B: &str = "outbound|8000||svc-b.static";
const HEADER: &str = "x-higress-target-cluster";

/// Keys and the cluster the Go plugin's slots give them with weights 30/70 (FNV-1a % 100:
/// "a" 20, "42" 11; "bob" 44, "alice" 79, "u-7" 92).
const KEYS: [(&str, &str); 5] =
    [("a", SVC_A), ("42", SVC_A), ("bob", SVC_B), ("alice", SVC_B), ("u-7", SVC_B)];

async fn two_clusters(route: &str, key: serde_json::Value) -> (Pod, Pod, Gateway) {
    let a = Pod::start(&format!("{route}-a")).await.unwrap();
    let b = Pod::start(&format!("{route}-b")).await.unwrap();
    let cfg = GatewayConfig::new()
        .route_json(json!({"name": route, "match": {"prefix": "/"}, "cluster_header": HEADER, "timeout_ms": 60000}))
        .cluster(SVC_A, &[a.host()])
        .cluster(SVC_B, &[b.host()])
        .plugin(json!({
            "lb_type": "cluster",
            "lb_policy": "cluster_hash",
            "lb_config": {"key": key, "clusters": [{"cluster": SVC_A, "weight": 30}, {"cluster": SVC_B, "weight": 70}]}
        }));
    let gw = Gateway::start(&cfg).await.unwrap();
    (a, b, gw)
}

fn chat(extra: serde_json::Value) -> serde_json::Value {
    let mut body =
        json!({"model": MODEL, "stream": false, "messages": [{"role": "user", "content": "hi"}]});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

fn pod_of<'a>(service: &str, a: &'a Pod, b: &'a Pod) -> &'a Pod {
    if service == SVC_A {
        a
    } else {
        b
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_key_always_reaches_the_cluster_of_its_slot() {
    let (a, b, gw) = two_clusters("ch-header", json!({"source": "header", "name": "x-user"})).await;
    for round in 0..3 {
        for (key, service) in KEYS {
            let req = HttpRequest::post_json("/v1/chat/completions", &chat(json!({})))
                .header("x-user", key);
            let r = gw.send(req, REQUEST_TIMEOUT).await.unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            let pod = pod_of(service, &a, &b);
            assert_eq!(
                r.upstream().as_deref(),
                Some(pod.host().as_str()),
                "key {key}, round {round}"
            );
        }
    }
    // The router read the cluster from the header the plugin wrote.
    for r in a.inference_records() {
        assert_eq!(r.header(HEADER), Some(SVC_A));
    }
    for r in b.inference_records() {
        assert_eq!(r.header(HEADER), Some(SVC_B));
    }
    let before = a.inference_records().len() + b.inference_records().len();
    let r = gw
        .send(HttpRequest::post_json("/v1/chat/completions", &chat(json!({}))), REQUEST_TIMEOUT)
        .await
        .unwrap();
    assert_eq!((r.status, r.text().as_str()), (403, "hash key required"));
    assert_eq!(a.inference_records().len() + b.inference_records().len(), before, "not forwarded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_key_reads_the_field_of_the_json_body() {
    let (a, b, gw) = two_clusters("ch-body", json!({"source": "body", "jsonPath": "$.user"})).await;
    for (key, service) in KEYS {
        let req = HttpRequest::post_json("/v1/chat/completions", &chat(json!({"user": key})));
        let r = gw.send(req, REQUEST_TIMEOUT).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let pod = pod_of(service, &a, &b);
        assert_eq!(r.upstream().as_deref(), Some(pod.host().as_str()), "user {key}");
    }
    let before = a.inference_records().len() + b.inference_records().len();
    let r = gw
        .send(HttpRequest::post_json("/v1/chat/completions", &chat(json!({}))), REQUEST_TIMEOUT)
        .await
        .unwrap();
    assert_eq!((r.status, r.text().as_str()), (403, "hash key required"), "no `user` field");
    let r = gw.send(HttpRequest::get("/v1/models"), REQUEST_TIMEOUT).await.unwrap();
    assert_eq!((r.status, r.text().as_str()), (403, "hash key required"), "a GET has no body");
    assert_eq!(a.inference_records().len() + b.inference_records().len(), before, "not forwarded");
}
