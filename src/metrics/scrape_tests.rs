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
