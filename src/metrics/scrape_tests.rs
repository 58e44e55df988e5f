//! Scraping pods through an ORIGINAL_DST cluster and sharing the snapshots.

use super::*;
use crate::host::fake::FakeHost;

#[test]
fn staleness_bound_is_at_least_two_intervals() {
    let mut h = FakeHost::new();
    let now = h.now / 1_000_000;
    // metricsStaleMs 1000 with a 3 s interval would drop every snapshot before the next scrape.
    let s = Scraper::new("scrape-cluster", "/metrics", 3_000, 1_000, None);
    let snap = Snapshot {
        sampled_ms: now,
        metrics: prometheus::parse(b"vllm:num_requests_waiting 2\n", None),
    };
    let key = s.snapshot_key("c", "10.0.0.1:80");
    assert!(h.set_shared_data(&key, &snap.encode(), 0).is_ok());
    assert!(s.read(&h, "c", "10.0.0.1:80", now + 5_000).is_some());
    assert!(s.read(&h, "c", "10.0.0.1:80", now + 6_001).is_none());
    // Foreign bytes under the key are ignored, not trusted.
    assert!(h.set_shared_data(&key, b"garbage", 0).is_ok());
    assert!(s.read(&h, "c", "10.0.0.1:80", now).is_none());
}

#[test]
fn pods_that_leave_have_their_shared_entries_emptied() {
    let mut h = FakeHost::new();
    let now = h.now / 1_000_000;
    let mut s = Scraper::new("scrape-cluster", "/metrics", 1_000, 5_000, None);
    s.set_worker_id(7);
    let pods: Vec<String> = (1..=3).map(|i| format!("10.0.0.{i}:8000")).collect();
    s.learn("c", &pods, now);
    s.on_tick(&mut h, now);
    let calls: Vec<(u32, String)> = h
        .http_calls
        .iter()
        .map(|c| (c.token, c.header(":authority").unwrap_or_default().to_string()))
        .collect();
    assert_eq!(calls.len(), 3);
    for (token, _) in &calls {
        let reply = HttpReply {
            status: 200,
            headers: vec![],
            body: b"vllm:num_requests_waiting 1\n".to_vec(),
        };
        assert!(s.on_reply(&mut h, *token, &reply, now));
    }
    let key = |pod: &str| format!("{KEY_PREFIX}c/{pod}/");
    let stored =
        |h: &FakeHost, pod: &str| h.get_shared_data(&key(pod)).0.is_some_and(|v| !v.is_empty());
    assert_eq!(key(&pods[0]), s.snapshot_key("c", &pods[0]));
    assert!(pods.iter().all(|p| stored(&h, p)));
    // Pod 2 is replaced by pod 4 (a new IP): pod 2's snapshot and lease are emptied.
    let churned = vec![pods[0].clone(), pods[2].clone(), "10.0.0.4:8000".to_string()];
    s.learn("c", &churned, now + 100);
    s.on_tick(&mut h, now + 100);
    assert!(!stored(&h, &pods[1]), "the departed pod's snapshot is emptied");
    let lease = format!("{LEASE_PREFIX}c/{}/", pods[1]);
    assert_eq!(h.get_shared_data(&lease).0, Some(Vec::new()), "and its lease");
    assert!(stored(&h, &pods[0]) && stored(&h, &pods[2]), "live pods keep theirs");
    // A cluster no request names any more is forgotten with all its pods.
    s.on_tick(&mut h, now + CLUSTER_IDLE_MS + 200);
    assert!(!stored(&h, &pods[0]) && !stored(&h, &pods[2]));
}
