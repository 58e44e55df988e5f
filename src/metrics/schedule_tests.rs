//! The endpoint_metrics decision core: filter chain, least/most, rate limit.

use super::*;
use crate::metrics::prometheus::LoraInfo;

fn pm(waiting: f64, kv: f64) -> PodMetrics {
    PodMetrics {
        running: Some(1.0),
        waiting: Some(waiting),
        kv_cache_usage: Some(kv),
        ..Default::default()
    }
}

fn with_lora(mut m: PodMetrics, max: u32, running: &[&str]) -> PodMetrics {
    m.lora = Some(LoraInfo {
        max_lora: max,
        running: running.iter().map(|s| s.to_string()).collect(),
        waiting: vec![],
        timestamp: 1.0,
    });
    m
}

fn names(pods: &[Candidate<'_>], idx: &[usize]) -> Vec<String> {
    let mut v: Vec<String> = idx.iter().map(|&i| pods[i].address.to_string()).collect();
    v.sort();
    v
}

fn cands<'a>(ms: &'a [(&'a str, PodMetrics)]) -> Vec<Candidate<'a>> {
    ms.iter()
        .map(|(a, m)| Candidate {
            address: a,
            metrics: m,
            pending: 0,
            own_picks: OwnPicks::WhenQueueing,
        })
        .collect()
}

#[test]
fn default_prefers_short_queue_then_low_kv() {
    let ms = [("a", pm(0.0, 0.9)), ("b", pm(0.0, 0.1)), ("c", pm(30.0, 0.0)), ("d", pm(1.0, 0.2))];
    let pods = cands(&ms);
    // Queue range 0..30 over 4 pods: band [0, 7.5] keeps a, b, d; KV band [0.1, 0.1+0.8/3] keeps b, d.
    assert_eq!(names(&pods, &filter(MetricPolicy::Default, "", &pods)), ["b", "d"]);
}

#[test]
fn default_lora_affinity_wins_while_queues_are_short() {
    let ms = [
        ("a", with_lora(pm(10.0, 0.5), 2, &["sql-lora"])),
        ("b", with_lora(pm(0.0, 0.0), 2, &["other"])),
        ("c", with_lora(pm(0.0, 0.0), 1, &["x"])),
    ];
    let pods = cands(&ms);
    assert_eq!(names(&pods, &filter(MetricPolicy::Default, "sql-lora", &pods)), ["a"]);
    // An adapter nobody has goes to a pod with a free slot (b), not to the full one (c).
    assert_eq!(names(&pods, &filter(MetricPolicy::Default, "new-lora", &pods)), ["b"]);
}

#[test]
fn default_lora_no_free_slot_falls_back_to_low_queue_pods() {
    let ms = [
        ("a", with_lora(pm(40.0, 0.5), 1, &["x"])),
        ("b", with_lora(pm(2.0, 0.5), 1, &["y"])),
        ("c", with_lora(pm(60.0, 0.0), 4, &[])),
    ];
    let pods = cands(&ms);
    // c has a free slot but is over the queue threshold; among a and b the queue band keeps b.
    assert_eq!(names(&pods, &filter(MetricPolicy::Default, "z", &pods)), ["b"]);
}

#[test]
fn default_all_queueing_orders_by_queue_then_lora_cost_then_kv() {
    let ms = [
        ("a", with_lora(pm(60.0, 0.2), 1, &["other"])),
        ("b", with_lora(pm(62.0, 0.9), 1, &["sql-lora"])),
        ("c", with_lora(pm(300.0, 0.0), 4, &[])),
    ];
    let pods = cands(&ms);
    // Queue band [60, 60+240/3] keeps a, b; only b can serve sql-lora cheaply.
    assert_eq!(names(&pods, &filter(MetricPolicy::Default, "sql-lora", &pods)), ["b"]);
    // Nobody among a, b is cheap for a new adapter: keep both, KV band picks a.
    assert_eq!(names(&pods, &filter(MetricPolicy::Default, "new", &pods)), ["a"]);
}

#[test]
fn pending_requests_spread_a_burst_over_queueing_pods_only() {
    let ms = [("a", pm(1.0, 0.1)), ("b", pm(1.0, 0.1))];
    let mut pods = cands(&ms);
    assert_eq!(names(&pods, &filter(MetricPolicy::Default, "", &pods)), ["a", "b"]);
    pods[0].pending = 8;
    assert_eq!(names(&pods, &filter(MetricPolicy::Default, "", &pods)), ["b"]);
    // Nearly full KV cache: new requests will queue, so they count as well.
    let ms = [("a", pm(0.0, 0.85)), ("b", pm(0.0, 0.85))];
    let mut pods = cands(&ms);
    pods[1].pending = 8;
    assert_eq!(names(&pods, &filter(MetricPolicy::Default, "", &pods)), ["a"]);
    // An idle pod with free KV takes the burst into its running batch: still the best pod.
    let ms = [("a", pm(0.0, 0.2)), ("b", pm(3.0, 0.2))];
    let mut pods = cands(&ms);
    pods[0].pending = 8;
    assert_eq!(names(&pods, &filter(MetricPolicy::Default, "", &pods)), ["a"]);
}

#[test]
fn one_pod_with_unknown_metrics_leaves_the_request_to_normal_balancing() {
    // As in Go: a pod the scheduler cannot see makes the whole request fall back, instead of
    // ranking that pod out of the choice (a new pod would otherwise get no traffic at all).
    let empty = PodMetrics::default();
    let ms = [("a", empty.clone()), ("b", pm(20.0, 0.7))];
    assert!(filter(MetricPolicy::Default, "", &cands(&ms)).is_empty());
    let running_only = PodMetrics { running: Some(3.0), ..Default::default() };
    let ms = [("a", running_only), ("b", pm(20.0, 0.7))];
    assert!(filter(MetricPolicy::Default, "", &cands(&ms)).is_empty(), "queue and KV are needed");
    let ms = [("a", empty.clone()), ("b", empty)];
    assert!(filter(MetricPolicy::Default, "", &cands(&ms)).is_empty());
    let ms = [("a", pm(0.0, 0.1)), ("b", pm(20.0, 0.7))];
    assert_eq!(names(&cands(&ms), &filter(MetricPolicy::Default, "", &cands(&ms))), ["a"]);
}

#[test]
fn least_and_most_use_the_target_metric() {
    let t = |v: f64| PodMetrics { target: Some(v), ..Default::default() };
    let ms = [("a", t(1.0)), ("b", t(2.0)), ("c", t(10.0))];
    let pods = cands(&ms);
    // Range 1..10 over 3 pods: width 3.
    assert_eq!(names(&pods, &filter(MetricPolicy::Least, "", &pods)), ["a", "b"]);
    assert_eq!(names(&pods, &filter(MetricPolicy::Most, "", &pods)), ["c"]);
    // A pod without the target metric: no opinion (Go falls back to normal balancing).
    let ms = [("a", t(1.0)), ("d", PodMetrics::default())];
    assert!(filter(MetricPolicy::Least, "", &cands(&ms)).is_empty());
    let ms = [("a", t(5.0)), ("b", t(5.0))];
    assert_eq!(names(&cands(&ms), &filter(MetricPolicy::Least, "", &cands(&ms))), ["a", "b"]);
    let ms = [("a", t(f64::INFINITY)), ("b", t(3.0))];
    assert!(filter(MetricPolicy::Least, "", &cands(&ms)).is_empty(), "not a usable value");
}

#[test]
fn rate_limit_moves_traffic_off_a_hot_pod() {
    let mut recent = RecentPicks::new(100, 60_000);
    for i in 0..8 {
        recent.push(1_000 + i, "a");
    }
    recent.push(1_010, "b");
    recent.push(1_011, "c");
    // a has 80% of the window; limit 0.6 sends the request elsewhere.
    let healthy = ["a", "b", "c"];
    let got = apply_rate_limit(&mut recent, 1_020, 0.6, "a", &healthy, 0);
    assert!(got == "b" || got == "c");
    assert_eq!(apply_rate_limit(&mut recent, 1_020, 0.6, "b", &healthy, 0), "b");
    // Limit 1.0 (the default) never overrides.
    assert_eq!(apply_rate_limit(&mut recent, 1_020, 1.0, "a", &healthy, 0), "a");
    // Alone: nothing to move to.
    assert_eq!(apply_rate_limit(&mut recent, 1_020, 0.1, "a", &["a"], 0), "a");
    // Every other pod over the limit too: the least loaded of them.
    assert_eq!(apply_rate_limit(&mut recent, 1_020, 0.05, "a", &healthy, 7), "b");
}

#[test]
fn recent_picks_expire_by_age_and_size() {
    let mut recent = RecentPicks::new(3, 1_000);
    recent.push(0, "a");
    recent.push(10, "a");
    assert_eq!(recent.share(20, "a"), 1.0);
    // Older than the window: gone.
    assert_eq!(recent.share(2_000, "a"), 0.0);
    for t in 0..5 {
        recent.push(3_000 + t, if t < 2 { "a" } else { "b" });
    }
    // Only the 3 newest picks remain: b, b, b.
    assert_eq!(recent.share(3_010, "b"), 1.0);
}

#[test]
fn own_picks_always_spread_a_burst_over_idle_pods_too() {
    // Both idle, a with a little less KV in use: the chain alone keeps only a.
    let ms = [("a", pm(0.0, 0.10)), ("b", pm(0.0, 0.20))];
    let mut pods = cands(&ms);
    pods[0].pending = 2;
    assert_eq!(names(&pods, &filter(MetricPolicy::Default, "", &pods)), ["a"], "WhenQueueing");
    for p in &mut pods {
        p.own_picks = OwnPicks::Always;
    }
    assert_eq!(names(&pods, &filter(MetricPolicy::Default, "", &pods)), ["b"]);
}

fn since(pods: &[(&'static str, u64)]) -> std::collections::HashMap<&'static str, u64> {
    pods.iter().copied().collect()
}

#[test]
fn in_flight_picks_count_after_the_sample_until_they_end() {
    let mut f = InFlightPicks::new(600_000, 100);
    f.start(1, 1_000, "a");
    f.start(2, 1_200, "a");
    f.start(3, 1_300, "b");
    let s = since(&[("a", 1_100), ("b", 1_100), ("c", 1_100)]);
    let n = f.count_since(1_400, &s);
    // Stream 1 was picked before a's sample: already in it.
    assert_eq!((n["a"], n["b"], n["c"]), (1, 1, 0));
    f.end(2);
    f.end(99); // not ours: ignored
    let n = f.count_since(1_400, &s);
    assert_eq!((n["a"], n["b"]), (0, 1), "an ended pick is no load");
    // Decided again (a resent pick): counted once, where it went last.
    f.start(3, 1_350, "a");
    let n = f.count_since(1_400, &s);
    assert_eq!((n["a"], n["b"]), (1, 0));
}

#[test]
fn in_flight_picks_that_never_end_are_forgotten_by_age_and_count() {
    let mut f = InFlightPicks::new(10_000, 3);
    for id in 0..5 {
        f.start(id, 1_000 + u64::from(id), "a");
    }
    assert_eq!(f.len(), 3, "the oldest forgotten beyond the bound");
    let s = since(&[("a", 0)]);
    assert_eq!(f.count_since(2_000, &s)["a"], 3);
    // Past the age bound they no longer count, and the next pick drops them.
    assert_eq!(f.count_since(11_100, &s)["a"], 0);
    f.start(9, 12_000, "a");
    assert_eq!(f.len(), 1);
}
