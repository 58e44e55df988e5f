//! `cluster_metrics`: the three modes and the rate limit against the fake host.

use super::*;
use crate::config::{PluginConfig, PolicyConfig};
use crate::host::fake::FakeHost;

const A: &str = "outbound|80||svc-a.static";
const B: &str = "outbound|80||svc-b.static";

fn policy(extra: &str) -> ClusterMetrics {
    let json = format!(
        r#"{{"lb_type":"cluster","lb_policy":"cluster_metrics","lb_config":{{"service_list":["{A}","{B}"]{extra}}}}}"#
    );
    match PluginConfig::from_json(json.as_bytes()).ok().and_then(|c| c.default).map(|d| d.policy) {
        Some(PolicyConfig::ClusterMetrics(c)) => ClusterMetrics::new(c),
        other => panic!("bad test config: {other:?}"),
    }
}

fn start(p: &mut ClusterMetrics, h: &mut FakeHost) -> (Stream, String) {
    // Each stream has its own id, as the dispatcher gives it (the policy keeps state per stream).
    static NEXT_ID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut s = Stream { id, start_ns: h.now, bodiless: true, ..Default::default() };
    match p.on_request_headers(h, &mut s) {
        Decision::SetHeader { name, value } => {
            assert_eq!(name, "x-higress-target-cluster");
            (s, value)
        }
        other => panic!("expected a header, got {other:?}"),
    }
}

/// Runs one request to completion: response after `ttft_ms`, end after `total_ms`.
fn complete(
    p: &mut ClusterMetrics,
    h: &mut FakeHost,
    s: &mut Stream,
    status: &str,
    ttft_ms: u64,
    total_ms: u64,
) {
    let t0 = s.start_ns;
    h.response_headers = vec![(":status".into(), status.into())];
    h.now = t0 + ttft_ms * 1_000_000;
    p.on_response_headers(h, s);
    p.on_response_body(h, s, 17, false);
    h.now = t0 + total_ms * 1_000_000;
    p.on_response_body(h, s, 40, true);
    p.on_stream_done(h, s);
}

#[test]
fn least_busy_sends_to_the_service_with_fewer_requests_in_flight() {
    let mut p = policy(r#","mode":"LeastBusy","cluster_header":"x-higress-target-cluster""#);
    let mut h = FakeHost::new();
    let (mut first, svc1) = start(&mut p, &mut h);
    // One request in flight on svc1: the next ones alternate to keep in-flight equal.
    let (_second, svc2) = start(&mut p, &mut h);
    assert_ne!(svc1, svc2);
    complete(&mut p, &mut h, &mut first, "200", 5, 10);
    // svc1 is now idle, svc2 has one in flight.
    let (_third, svc3) = start(&mut p, &mut h);
    assert_eq!(svc3, svc1);
}

#[test]
fn least_total_latency_prefers_the_faster_service_and_punishes_failures() {
    let mut p = policy(r#","mode":"LeastTotalLatency","queue_size":5"#);
    let mut h = FakeHost::new();
    // Both services get measured: A slow (900 ms), B fast (100 ms).
    for _ in 0..6 {
        let (mut s, svc) = start(&mut p, &mut h);
        let total = if svc == A { 900 } else { 100 };
        complete(&mut p, &mut h, &mut s, "200", 50, total);
    }
    for _ in 0..10 {
        let (mut s, svc) = start(&mut p, &mut h);
        assert_eq!(svc, B);
        complete(&mut p, &mut h, &mut s, "200", 50, 100);
    }
    // B starts failing fast (503 in 5 ms): the failures count as 2 × the worst mean, so A wins.
    for _ in 0..3 {
        let (mut s, svc) = start(&mut p, &mut h);
        if svc == B {
            complete(&mut p, &mut h, &mut s, "503", 5, 5);
        } else {
            complete(&mut p, &mut h, &mut s, "200", 50, 900);
        }
    }
    let (_s, svc) = start(&mut p, &mut h);
    assert_eq!(svc, A);
}

#[test]
fn least_first_token_latency_uses_time_to_first_body_bytes() {
    let mut p = policy(r#","mode":"LeastFirstTokenLatency","queue_size":5"#);
    let mut h = FakeHost::new();
    for _ in 0..8 {
        let (mut s, svc) = start(&mut p, &mut h);
        // A: quick first token but long total; B: slow first token, short total.
        if svc == A {
            complete(&mut p, &mut h, &mut s, "200", 20, 5_000);
        } else {
            complete(&mut p, &mut h, &mut s, "200", 400, 500);
        }
    }
    let (_s, svc) = start(&mut p, &mut h);
    assert_eq!(svc, A);
    // A stream that ends without any response (reset) is a first-token failure for its service.
    let mut p = policy(r#","mode":"LeastFirstTokenLatency""#);
    for _ in 0..4 {
        let (mut s, svc) = start(&mut p, &mut h);
        if svc == A {
            h.response_headers.clear();
            h.now += 1_000_000;
            p.on_stream_done(&mut h, &mut s);
        } else {
            complete(&mut p, &mut h, &mut s, "200", 300, 600);
        }
    }
    let (_s, svc) = start(&mut p, &mut h);
    assert_eq!(svc, B);
}

#[test]
fn rate_limit_bounds_the_share_of_the_best_service() {
    let mut p = policy(r#","mode":"LeastTotalLatency","rate_limit":0.7,"queue_size":50"#);
    let mut h = FakeHost::new();
    let mut to_b = 0;
    for i in 0..200 {
        let (mut s, svc) = start(&mut p, &mut h);
        let total = if svc == A { 900 } else { 100 };
        complete(&mut p, &mut h, &mut s, "200", 50, total);
        if i >= 100 && svc == B {
            to_b += 1;
        }
    }
    assert!((60..=72).contains(&to_b), "best service got {to_b}/100 with rate_limit 0.7");
    // The default rate_limit (1) never pushes traffic off the best service.
    let mut p = policy(r#","mode":"LeastTotalLatency""#);
    let mut last = Vec::new();
    for _ in 0..50 {
        let (mut s, svc) = start(&mut p, &mut h);
        let total = if svc == A { 900 } else { 100 };
        complete(&mut p, &mut h, &mut s, "200", 50, total);
        last.push(svc);
    }
    assert!(last[10..].iter().all(|s| s == B));
}

#[test]
fn in_flight_is_released_once_per_stream() {
    let mut p = policy(r#","mode":"LeastBusy""#);
    let mut h = FakeHost::new();
    // Three requests over two services: one service holds two, so a double release of one stream
    // would show as 0 there (a floor at 0 cannot hide it).
    let (_s1, _) = start(&mut p, &mut h);
    let (_s2, _) = start(&mut p, &mut h);
    let (mut s3, svc) = start(&mut p, &mut h);
    assert_eq!(p.stats.get(&svc).map(|st| st.in_flight), Some(2));
    p.on_stream_done(&mut h, &mut s3);
    p.on_stream_done(&mut h, &mut s3); // a duplicate call must not release again
    assert_eq!(p.stats.get(&svc).map(|st| st.in_flight), Some(1));
    let other = if svc == A { B } else { A };
    assert_eq!(p.stats.get(other).map(|st| st.in_flight), Some(1));
}

#[test]
fn adaptive_score_prefers_the_faster_service_until_its_queue_outweighs_it() {
    let mut p = policy(r#","mode":"AdaptiveScore""#);
    let mut h = FakeHost::new();
    // Both get measured: A slow (TTFT 300, total 900 ms), B fast (20 and 100 ms).
    for _ in 0..6 {
        let (mut s, svc) = start(&mut p, &mut h);
        let (ttft, total) = if svc == A { (300, 900) } else { (20, 100) };
        complete(&mut p, &mut h, &mut s, "200", ttft, total);
    }
    let b = p.stats.get(B).and_then(|s| s.ewma_ttft_ms);
    assert_eq!(b, Some(20.0), "a moving average of equal samples is the sample");
    for _ in 0..5 {
        let (mut s, svc) = start(&mut p, &mut h);
        assert_eq!(svc, B);
        complete(&mut p, &mut h, &mut s, "200", 20, 100);
    }
    // B's score (0.7·√21 + 0.3·√101 ≈ 6.2 per request in flight) passes A's idle one (≈ 21.1)
    // once B holds 3 and A none.
    let held: Vec<String> = (0..3).map(|_| start(&mut p, &mut h).1).collect();
    assert_eq!(held, [B, B, B]);
    assert_eq!(start(&mut p, &mut h).1, A);
}

#[test]
fn adaptive_score_keeps_a_failed_service_out_while_it_cools_down() {
    let mut p = policy(r#","mode":"AdaptiveScore","failure_cooldown_ms":60000"#);
    let mut h = FakeHost::new();
    for _ in 0..6 {
        let (mut s, svc) = start(&mut p, &mut h);
        let total = if svc == A { 100 } else { 900 };
        complete(&mut p, &mut h, &mut s, "200", 20, total);
    }
    // A, the fast one, fails once: B takes every request during A's cooldown.
    let mut s = loop {
        let (s, svc) = start(&mut p, &mut h);
        if svc == A {
            break s;
        }
    };
    complete(&mut p, &mut h, &mut s, "503", 5, 5);
    for _ in 0..10 {
        let (mut s, svc) = start(&mut p, &mut h);
        assert_eq!(svc, B, "A cools down for 60 s after its failure");
        complete(&mut p, &mut h, &mut s, "200", 20, 900);
    }
    // Even with B busy, while A cools down.
    let held: Vec<String> = (0..2).map(|_| start(&mut p, &mut h).1).collect();
    assert_eq!(held, [B, B]);
    // After the cooldown A is a candidate again: its failure made its averages and error rate
    // worse (score ≈ 20), but B with two in flight scores ≈ 37.
    h.now += 61_000_000_000;
    assert_eq!(start(&mut p, &mut h).1, A);
}

#[test]
fn adaptive_score_without_samples_is_least_busy() {
    let mut p = policy(r#","mode":"AdaptiveScore","p2c_choices":2"#);
    let mut h = FakeHost::new();
    let (_a, first) = start(&mut p, &mut h);
    let (_b, second) = start(&mut p, &mut h);
    assert_ne!(first, second, "the idle one is chosen");
}
