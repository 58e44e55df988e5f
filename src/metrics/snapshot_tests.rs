//! Snapshot encoding of pod metrics shared between worker VMs.

use super::*;

#[test]
fn snapshot_round_trips_every_field() {
    let body = include_str!("testdata/vllm_v1_dp2_lora.txt");
    let metrics = prometheus::parse(body.as_bytes(), Some("vllm:num_requests_waiting"));
    let snap = Snapshot { sampled_ms: 1_755_392_148_123, metrics };
    let back = Snapshot::decode(&snap.encode());
    assert_eq!(back.as_ref(), Some(&snap));
    let sg = Snapshot {
        sampled_ms: 5,
        metrics: prometheus::parse(include_bytes!("testdata/sglang.txt"), None),
    };
    assert_eq!(Snapshot::decode(&sg.encode()), Some(sg));
}

#[test]
fn snapshot_rejects_foreign_data_and_reports_staleness() {
    assert_eq!(Snapshot::decode(b""), None);
    assert_eq!(Snapshot::decode(b"v2\nts=1\n"), None);
    assert_eq!(Snapshot::decode(b"v1\nr=3\n"), None);
    assert_eq!(Snapshot::decode(b"v1\nts=abc\n"), None);
    assert_eq!(Snapshot::decode(&[0xff, 0xfe]), None);
    let s = Snapshot::decode(b"v1\nts=1000\nw=x\nkv=0.5\nzz=1\n").unwrap_or_default();
    assert_eq!(s.metrics.waiting, None);
    assert_eq!(s.metrics.kv_cache_usage, Some(0.5));
    assert!(!s.is_stale(2_000, 2_000));
    assert!(s.is_stale(3_001, 2_000));
    assert!(s.is_stale(0, 500));
}
