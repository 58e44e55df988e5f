//! `endpoint_metrics` against the fake host: host-stored and scraped metrics, LoRA, least/most, rate limit.

use super::*;
use crate::config::{PluginConfig, PolicyConfig};
use crate::host::fake::FakeHost;
use crate::host::{Health, UpstreamHost};

const CLUSTER: &str = "outbound|8000||llm.static";

fn config(lb_config: &str) -> EndpointMetricsConfig {
    let json = format!(r#"{{"lb_policy":"endpoint_metrics","lb_config":{lb_config}}}"#);
    match PluginConfig::from_json(json.as_bytes()).ok().and_then(|c| c.default).map(|d| d.policy) {
        Some(PolicyConfig::EndpointMetrics(c)) => c,
        other => panic!("bad test config: {other:?}"),
    }
}

/// A vLLM V1 `/metrics` body as a pod would serve it.
fn vllm(running: u32, waiting: u32, kv: f64, lora: Option<(&str, u32)>) -> String {
    let mut s = String::from(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n",
    );
    s += &format!("vllm:num_requests_running{{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"}} {running}.0\n");
    s += "# TYPE vllm:num_requests_waiting gauge\n";
    s += &format!("vllm:num_requests_waiting{{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"}} {waiting}.0\n");
    s += "# TYPE vllm:kv_cache_usage_perc gauge\n";
    s += &format!("vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"}} {kv}\n");
    s += "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 90.0\n";
    if let Some((adapters, max)) = lora {
        s += "# TYPE vllm:lora_requests_info gauge\n";
        s += &format!(
            "vllm:lora_requests_info{{max_lora=\"{max}\",running_lora_adapters=\"{adapters}\",waiting_lora_adapters=\"\"}} 1.7553921484e+09\n"
        );
    }
    s
}

fn host_with(pods: &[(&str, bool, Option<String>)]) -> FakeHost {
    let mut h = FakeHost::new();
    h.hosts = Some(
        pods.iter()
            .map(|(a, ok, m)| UpstreamHost {
                address: a.to_string(),
                health: if *ok { Health::Healthy } else { Health::Unhealthy },
                metrics: m.as_deref().map(Into::into),
            })
            .collect(),
    );
    h
}

/// Pods 10.0.0.1 and 10.0.0.2, both healthy, with these metrics from the health check.
fn two_healthy_pods(first: String, second: String) -> FakeHost {
    host_with(&[("10.0.0.1:8000", true, Some(first)), ("10.0.0.2:8000", true, Some(second))])
}

/// The scrapes the policy sent: token and the pod each was for.
fn scrape_calls(h: &FakeHost) -> Vec<(u32, String)> {
    h.http_calls
        .iter()
        .map(|c| (c.token, c.header(":authority").unwrap_or_default().to_string()))
        .collect()
}

/// A new stream of the routed cluster (each with its own id, as the host gives them).
fn stream() -> Stream {
    static NEXT_ID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Stream { id, cluster: CLUSTER.to_string(), ..Default::default() }
}

fn bodiless() -> Stream {
    Stream { bodiless: true, ..stream() }
}

fn route(p: &mut EndpointMetrics, h: &mut FakeHost) -> Decision {
    p.on_request_headers(h, &mut bodiless())
}

#[test]
fn routes_to_the_least_loaded_healthy_pod_from_host_metrics() {
    let mut h = host_with(&[
        ("10.0.0.1:8000", true, Some(vllm(20, 30, 0.9, None))),
        ("10.0.0.2:8000", true, Some(vllm(4, 0, 0.2, None))),
        ("10.0.0.3:8000", false, Some(vllm(0, 0, 0.0, None))), // idle but unhealthy
    ]);
    let mut p = EndpointMetrics::new(config("{}"));
    for _ in 0..20 {
        assert_eq!(route(&mut p, &mut h), Decision::Route("10.0.0.2:8000".into()));
        h.now += 1_000_000_000; // 1 s apart, so the pending estimate does not kick in
    }
    assert!(h.http_calls.is_empty(), "host metrics present: no scraping");
}

#[test]
fn the_host_list_is_read_at_most_once_per_host_list_cache_ms() {
    let mut h = two_healthy_pods(vllm(20, 30, 0.9, None), vllm(4, 0, 0.2, None));
    let mut p = EndpointMetrics::new(config("{}"));
    assert_eq!(route(&mut p, &mut h), Decision::Route("10.0.0.2:8000".into()));
    // The least loaded pod is marked down. 5 ms after the read the list kept (10 ms by default)
    // still names it: a pod marked down meanwhile is safe to name, as Envoy routes a non-strict
    // override to an unhealthy host by normal balancing.
    if let Some(hosts) = h.hosts.as_mut() {
        hosts[1].health = Health::Unhealthy;
    }
    h.now += 5_000_000;
    assert_eq!(route(&mut p, &mut h), Decision::Route("10.0.0.2:8000".into()));
    assert_eq!(h.host_list_reads.get(), 1);
    h.now += 6_000_000;
    assert_eq!(route(&mut p, &mut h), Decision::Route("10.0.0.1:8000".into()));
    assert_eq!(h.host_list_reads.get(), 2);
    // A clock that went back reads the list again.
    h.now -= 1_000_000_000;
    route(&mut p, &mut h);
    assert_eq!(h.host_list_reads.get(), 3);
    // hostListCacheMs 0: every request reads it.
    let mut p = EndpointMetrics::new(config(r#"{"hostListCacheMs":0}"#));
    for _ in 0..3 {
        route(&mut p, &mut h);
    }
    assert_eq!(h.host_list_reads.get(), 6);
    // A list without metrics bodies is cheap for the host: read at every request, as in Go.
    let mut bare = host_with(&[("10.0.0.1:8000", true, None), ("10.0.0.2:8000", true, None)]);
    let mut p = EndpointMetrics::new(config("{}"));
    for _ in 0..3 {
        route(&mut p, &mut bare);
    }
    assert_eq!(bare.host_list_reads.get(), 3);
    // Out of range: plugin start fails naming the key.
    let json = r#"{"lb_policy":"endpoint_metrics","lb_config":{"hostListCacheMs":5000}}"#;
    let err = PluginConfig::from_json(json.as_bytes()).err().map(|e| e.to_string());
    assert!(err.as_deref().is_some_and(|e| e.contains("hostListCacheMs")), "{err:?}");
}

#[test]
fn each_decision_is_named_after_its_counter() {
    // The decision header's value is the counter's name without `ai_lb_`, as for every policy.
    let mut h = two_healthy_pods(vllm(20, 30, 0.9, None), vllm(4, 0, 0.2, None));
    let mut p = EndpointMetrics::new(config("{}"));
    let mut s = bodiless();
    assert_eq!(p.on_request_headers(&mut h, &mut s), Decision::Route("10.0.0.2:8000".into()));
    assert_eq!(s.decision.as_deref(), Some("metrics_routed"));
    assert_eq!(h.counters.get("ai_lb_metrics_routed"), Some(&1));
    let mut none = host_with(&[("10.0.0.1:8000", true, None)]);
    none.now = h.now + 1_000_000_000; // past hostListCacheMs: the list is read again
    let mut s = bodiless();
    assert_eq!(p.on_request_headers(&mut none, &mut s), Decision::Passthrough);
    assert_eq!(s.decision.as_deref(), Some("fallback_no_metrics"));
    assert_eq!(none.counters.get("ai_lb_fallback_no_metrics"), Some(&1));
}

#[test]
fn a_new_health_check_body_replaces_the_cached_parse() {
    let mut h = two_healthy_pods(vllm(20, 30, 0.9, None), vllm(4, 0, 0.2, None));
    let mut p = EndpointMetrics::new(config("{}"));
    assert_eq!(route(&mut p, &mut h), Decision::Route("10.0.0.2:8000".into()));
    // The next health check finds the load reversed.
    if let Some(hosts) = h.hosts.as_mut() {
        hosts[0].metrics = Some(vllm(1, 0, 0.1, None).into());
        hosts[1].metrics = Some(vllm(30, 45, 0.97, None).into());
    }
    h.now += 2_000_000_000;
    assert_eq!(route(&mut p, &mut h), Decision::Route("10.0.0.1:8000".into()));
}

#[test]
fn a_burst_between_samples_is_spread_by_pending_requests() {
    let mut h = two_healthy_pods(vllm(2, 3, 0.3, None), vllm(2, 3, 0.3, None));
    let mut p = EndpointMetrics::new(config("{}"));
    let mut count = std::collections::HashMap::new();
    for _ in 0..40 {
        if let Decision::Route(a) = route(&mut p, &mut h) {
            *count.entry(a).or_insert(0) += 1;
        }
        h.now += 1_000_000; // 1 ms: same metrics sample
    }
    let a: u32 = count.get("10.0.0.1:8000").copied().unwrap_or(0);
    let b: u32 = count.get("10.0.0.2:8000").copied().unwrap_or(0);
    assert_eq!(a + b, 40);
    assert!(a.abs_diff(b) <= 2, "burst not spread: {a} vs {b}");
}

#[test]
fn requests_that_ended_since_the_sample_do_not_count_as_queued() {
    // Both pods queueing, 10.0.0.1 less: it stays the better pod for a sequential client whose
    // every request ends before the next, all within one metrics sample.
    let mut h = two_healthy_pods(vllm(2, 1, 0.3, None), vllm(2, 2, 0.3, None));
    let mut p = EndpointMetrics::new(config("{}"));
    for _ in 0..20 {
        let mut s = bodiless();
        assert_eq!(p.on_request_headers(&mut h, &mut s), Decision::Route("10.0.0.1:8000".into()));
        p.on_stream_done(&mut h, &mut s);
        h.now += 1_000_000; // 1 ms: same metrics sample
    }
    // Left in flight, two of them make it look as queued as 10.0.0.2: both pods are picked.
    let mut seen = std::collections::HashSet::new();
    for _ in 0..40 {
        if let Decision::Route(a) = route(&mut p, &mut h) {
            seen.insert(a);
        }
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
}

#[test]
fn no_metrics_passes_through_then_scrapes_and_routes_on_shared_snapshots() {
    let mut h = host_with(&[("10.0.0.1:8000", true, None), ("10.0.0.2:8000", true, None)]);
    let mut p = EndpointMetrics::new(config(
        r#"{"scrapeIntervalMs":500,"scrapePath":"/stats/prometheus","scrapeCluster":"pods-original-dst"}"#,
    ));
    assert_eq!(p.tick_period_ms(), 500);
    p.on_start(&mut h);
    // Nothing known yet: normal balancing, but the pods are now known to the scraper.
    assert_eq!(route(&mut p, &mut h), Decision::Passthrough);
    p.on_tick(&mut h);
    assert_eq!(h.http_calls.len(), 2);
    for call in &h.http_calls {
        assert_eq!(call.cluster, "pods-original-dst", "through the ORIGINAL_DST cluster");
        assert!(call.body.is_none());
        assert_eq!(call.header(":method"), Some("GET"));
        assert_eq!(call.header(":path"), Some("/stats/prometheus"));
        assert_eq!(call.header(":authority"), call.header("x-envoy-original-dst-host"));
    }
    // A second tick while the calls are in flight sends nothing more.
    p.on_tick(&mut h);
    assert_eq!(h.http_calls.len(), 2);
    let calls = scrape_calls(&h);
    for (token, pod) in &calls {
        let body =
            if pod == "10.0.0.1:8000" { vllm(30, 12, 0.95, None) } else { vllm(1, 0, 0.1, None) };
        let reply = HttpReply { status: 200, headers: vec![], body: body.into_bytes() };
        assert_eq!(p.on_http_reply(&mut h, None, *token, &reply), Decision::Passthrough);
    }
    assert_eq!(route(&mut p, &mut h), Decision::Route("10.0.0.2:8000".into()));

    // Another worker VM (same shared data) uses the snapshots without scraping itself.
    let mut other = EndpointMetrics::new(config(
        r#"{"scrapeIntervalMs":500,"scrapePath":"/stats/prometheus","scrapeCluster":"pods-original-dst"}"#,
    ));
    other.on_start(&mut h);
    assert_eq!(route(&mut other, &mut h), Decision::Route("10.0.0.2:8000".into()));
    other.on_tick(&mut h);
    assert_eq!(h.http_calls.len(), 2, "fresh shared snapshots: no second scrape");

    // Later the snapshots are due again: exactly one of the two workers scrapes each pod.
    h.now += 400_000_000;
    other.on_tick(&mut h);
    p.on_tick(&mut h);
    assert_eq!(h.http_calls.len(), 4, "one scrape per pod across workers (lease)");

    // Past metricsStaleMs (default 5 s) without fresh data, the pods are unknown again.
    h.now += 6_000_000_000;
    assert_eq!(route(&mut p, &mut h), Decision::Passthrough);
}

#[test]
fn a_failed_scrape_makes_the_pod_unknown_at_once() {
    let mut h = host_with(&[("10.0.0.1:8000", true, None), ("10.0.0.2:8000", true, None)]);
    let mut p = EndpointMetrics::new(config(r#"{"scrapeCluster":"pods-original-dst"}"#));
    route(&mut p, &mut h);
    p.on_tick(&mut h);
    let calls = scrape_calls(&h);
    for (token, pod) in &calls {
        let reply =
            HttpReply { status: 200, headers: vec![], body: vllm(0, 0, 0.0, None).into_bytes() };
        p.on_http_reply(&mut h, None, *token, &reply);
        let _ = pod;
    }
    // Next round: pod 1 answers 503, pod 2 is busy but fine.
    h.now += 1_000_000_000;
    p.on_tick(&mut h);
    let calls: Vec<(u32, String)> = h.http_calls[2..]
        .iter()
        .map(|c| (c.token, c.header(":authority").unwrap_or_default().to_string()))
        .collect();
    assert_eq!(calls.len(), 2);
    for (token, pod) in &calls {
        let reply = if pod == "10.0.0.1:8000" {
            HttpReply { status: 503, ..Default::default() }
        } else {
            HttpReply { status: 200, headers: vec![], body: vllm(40, 20, 0.8, None).into_bytes() }
        };
        p.on_http_reply(&mut h, None, *token, &reply);
    }
    // Pod 1 is unknown from now on, so the request is left to normal balancing (as Go does when
    // a pod has no metrics), not sent to the busy pod 2.
    for _ in 0..10 {
        assert_eq!(route(&mut p, &mut h), Decision::Passthrough);
    }
}

#[test]
fn lora_deployments_read_the_model_from_the_body() {
    let mut h = two_healthy_pods(
        vllm(3, 1, 0.3, Some(("sql-lora", 1))),
        vllm(1, 0, 0.1, Some(("tweet-summary", 1))),
    );
    let mut p = EndpointMetrics::new(config(r#"{"metric_policy":"default"}"#));
    let mut s = stream();
    assert_eq!(p.on_request_headers(&mut h, &mut s), Decision::NeedBody);
    let body = br#"{"model":"sql-lora","messages":[{"role":"user","content":"hi"}],"stream":true}"#;
    assert_eq!(p.on_request_body(&mut h, &mut s, body), Decision::Route("10.0.0.1:8000".into()));
    let body = br#"{"model":"tweet-summary","prompt":"x"}"#;
    assert_eq!(p.on_request_body(&mut h, &mut s, body), Decision::Route("10.0.0.2:8000".into()));
    // A bodiless request decides on its headers (never waits for a body that will not come).
    assert!(matches!(p.on_request_headers(&mut h, &mut bodiless()), Decision::Route(_)));
    // Without LoRA pods the headers suffice.
    let mut h2 = host_with(&[("10.0.0.1:8000", true, Some(vllm(3, 1, 0.3, None)))]);
    h2.now = h.now + 1_000_000_000; // past hostListCacheMs: the list is read again
    assert!(matches!(p.on_request_headers(&mut h2, &mut s), Decision::Route(_)));
}

#[test]
fn least_and_most_follow_target_metric() {
    let pods = [
        ("10.0.0.1:8000", true, Some(vllm(9, 0, 0.5, None))),
        ("10.0.0.2:8000", true, Some(vllm(1, 0, 0.5, None))),
        ("10.0.0.3:8000", true, Some(vllm(5, 0, 0.5, None))),
    ];
    let mut h = host_with(&pods);
    let mut least = EndpointMetrics::new(config(
        r#"{"metric_policy":"least","target_metric":"vllm:num_requests_running"}"#,
    ));
    let mut most = EndpointMetrics::new(config(
        r#"{"metric_policy":"most","target_metric":"vllm:num_requests_running"}"#,
    ));
    for _ in 0..10 {
        assert_eq!(route(&mut least, &mut h), Decision::Route("10.0.0.2:8000".into()));
        assert_eq!(route(&mut most, &mut h), Decision::Route("10.0.0.1:8000".into()));
        h.now += 1_000_000_000;
    }
    // A pod whose metrics lack the target metric: the request uses normal balancing (Go's
    // scheduler fails for the whole request too).
    let mut h = host_with(&[
        ("10.0.0.9:8000", true, Some("sglang:num_running_reqs 0\n".into())),
        pods[0].clone(),
    ]);
    assert_eq!(route(&mut least, &mut h), Decision::Passthrough);
}

#[test]
fn rate_limit_caps_the_share_of_the_best_pod() {
    let mut h = two_healthy_pods(vllm(0, 0, 0.0, None), vllm(0, 40, 0.9, None));
    let mut p = EndpointMetrics::new(config(r#"{"rate_limit":0.6}"#));
    let mut best = 0;
    for _ in 0..100 {
        if route(&mut p, &mut h) == Decision::Route("10.0.0.1:8000".into()) {
            best += 1;
        }
        h.now += 2_000_000_000; // far apart: no pending estimate; window_seconds 60 keeps 30 picks
    }
    assert!((55..=65).contains(&best), "best pod got {best}% with rate_limit 0.6");
}

#[test]
fn without_scrape_cluster_the_plugin_never_scrapes_and_says_so() {
    use crate::filter::Filter;
    let mut h = host_with(&[("10.0.0.1:8000", true, None), ("10.0.0.2:8000", true, None)]);
    let mut f = Filter::new();
    // A pod's own cluster is not an ORIGINAL_DST cluster: Envoy would ignore
    // x-envoy-original-dst-host there and file one pod's metrics under another.
    let cfg = br#"{"lb_policy":"endpoint_metrics","lb_config":{"scrapeIntervalMs":200}}"#;
    assert!(f.configure(&mut h, cfg));
    assert!(h.logged("no scrapeCluster set"), "{:?}", h.logs.borrow());
    assert_eq!(f.tick_period_ms(), 0, "nothing to do on ticks");
    f.on_request_headers(&mut h, 10, true);
    assert_eq!(h.override_host, None, "no metrics: normal balancing");
    f.on_tick(&mut h);
    assert!(h.http_calls.is_empty());
}

#[test]
fn through_the_dispatcher_scrape_on_tick_then_pin_requests() {
    use crate::filter::Filter;
    let mut h = host_with(&[("10.0.0.1:8000", true, None), ("10.0.0.2:8000", true, None)]);
    let mut f = Filter::new();
    let cfg = br#"{"lb_policy":"endpoint_metrics","lb_config":{"scrapeIntervalMs":200,"scrapeCluster":"pods-original-dst"}}"#;
    assert!(f.configure(&mut h, cfg));
    assert_eq!(f.tick_period_ms(), 200);
    // First request: nothing known, normal balancing; the pods become known.
    f.on_request_headers(&mut h, 10, true);
    assert_eq!(h.override_host, None);
    f.on_stream_end(&mut h, 10);
    f.on_delete(&mut h, 10);
    f.on_tick(&mut h);
    assert_eq!(h.http_calls.len(), 2);
    let calls = scrape_calls(&h);
    for (token, pod) in calls {
        let body =
            if pod == "10.0.0.2:8000" { vllm(0, 0, 0.05, None) } else { vllm(64, 70, 0.99, None) };
        f.on_http_reply(
            &mut h,
            token,
            &HttpReply { status: 200, headers: vec![], body: body.into_bytes() },
            false,
        );
    }
    f.on_request_headers(&mut h, 11, true);
    assert_eq!(h.override_host.as_deref(), Some("10.0.0.2:8000"));
}

#[test]
fn parsed_metrics_are_cached_per_cluster_and_bounded() {
    // One policy serving two clusters (e.g. a domain rule over two services), requests alternating:
    // each cluster keeps its pods' parses instead of evicting the other's on every request.
    let a = || {
        host_with(&[
            ("10.0.1.1:8000", true, Some(vllm(2, 0, 0.2, None))),
            ("10.0.1.2:8000", true, Some(vllm(1, 0, 0.2, None))),
        ])
    };
    let b = || host_with(&[("10.0.2.1:8000", true, Some(vllm(3, 0, 0.2, None)))]);
    let mut p = EndpointMetrics::new(config("{}"));
    for _ in 0..3 {
        for (cluster, mut h) in [("outbound|8000||a", a()), ("outbound|8000||b", b())] {
            let mut s =
                Stream { cluster: cluster.to_string(), bodiless: true, ..Default::default() };
            assert!(matches!(p.on_request_headers(&mut h, &mut s), Decision::Route(_)));
        }
        assert_eq!(p.router.cached_pods("outbound|8000||a"), 2);
        assert_eq!(p.router.cached_pods("outbound|8000||b"), 1);
    }
    // Any number of clusters: the cache starts over rather than grow.
    for i in 0..200 {
        let mut h = b();
        let mut s = Stream {
            cluster: format!("outbound|8000||c{i}"),
            bodiless: true,
            ..Default::default()
        };
        p.on_request_headers(&mut h, &mut s);
    }
    let cached: usize =
        (0..200).map(|i| p.router.cached_pods(&format!("outbound|8000||c{i}"))).sum();
    assert!(cached <= 64, "{cached} clusters cached");
}
