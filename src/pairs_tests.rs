//! proxy-wasm header-pair (de)serialisation.

use super::*;

#[test]
fn round_trips_and_matches_the_documented_layout() {
    let b = serialize(&[("a", "xy")]);
    assert_eq!(b, vec![1, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, b'a', 0, b'x', b'y', 0]);
    let pairs = vec![(":status", "200"), ("x", ""), ("", "v")];
    let parsed = parse(&serialize(&pairs)).unwrap();
    assert_eq!(parsed.len(), 3);
    assert_eq!(parsed[0], (b":status".to_vec(), b"200".to_vec()));
    assert_eq!(parsed[2], (Vec::new(), b"v".to_vec()));
}

#[test]
fn malformed_input_is_rejected_not_panicking() {
    let good = serialize(&[("key", "value")]);
    for cut in 1..good.len() - 1 {
        assert_eq!(parse(&good[..cut]), None, "truncated at {cut}");
    }
    assert_eq!(parse(&[0xff, 0xff, 0xff, 0xff]), None);
    assert_eq!(parse(&[]), Some(vec![]));
}

#[test]
fn parses_upstream_hosts_with_health_and_metrics() {
    let bytes = serialize(&[
        (
            "10.0.0.1:8000",
            r#"{"health_status":"Healthy","metrics":"vllm:num_requests_running 3\n"}"#,
        ),
        ("10.0.0.2:8000", r#"{"health_status":"Unhealthy","metrics":""}"#),
        ("10.0.0.3:8000", "not json"),
    ]);
    let hosts = parse_upstream_hosts(&bytes).unwrap();
    assert_eq!(hosts.len(), 3);
    assert!(hosts[0].is_healthy());
    assert_eq!(hosts[0].metrics.as_deref(), Some("vllm:num_requests_running 3\n"));
    assert_eq!(hosts[1].health, Health::Unhealthy);
    assert_eq!(hosts[1].metrics, None);
    assert_eq!(hosts[2].health, Health::Unknown);
    assert!(!hosts[2].is_healthy());
}

fn host_list(hosts: &[(&str, &str, &str)]) -> Vec<u8> {
    let pairs: Vec<(String, String)> = hosts
        .iter()
        .map(|(a, health, metrics)| {
            let info = serde_json::json!({"health_status": health, "metrics": metrics});
            (a.to_string(), info.to_string())
        })
        .collect();
    serialize(&pairs)
}

#[test]
fn a_memo_reads_an_unchanged_host_list_without_copying_its_metrics_bodies() {
    let body = "vllm:num_requests_waiting{model_name=\"m\"} 2.0\n".repeat(500);
    let list = host_list(&[("10.0.0.1:8000", "Healthy", &body), ("10.0.0.2:8000", "Healthy", "")]);
    let mut memo = HostListMemo::default();
    let first = memo.parse(&list).unwrap();
    assert_eq!(first, parse_upstream_hosts(&list).unwrap());
    let again = memo.parse(&list).unwrap();
    assert_eq!(again, first);
    let (a, b) = (first[0].metrics.as_ref().unwrap(), again[0].metrics.as_ref().unwrap());
    assert!(Rc::ptr_eq(a, b), "an unchanged body is shared, not parsed again");
}

#[test]
fn a_memo_sees_each_changed_host_at_once() {
    let mut memo = HostListMemo::default();
    let before =
        host_list(&[("10.0.0.1:8000", "Healthy", "q 1\n"), ("10.0.0.2:8000", "Healthy", "q 1\n")]);
    let kept = memo.parse(&before).unwrap();
    // Pod 1 fails its health check (Higress clears the stored body), pod 2 has a new sample.
    let after =
        host_list(&[("10.0.0.1:8000", "Unhealthy", ""), ("10.0.0.2:8000", "Healthy", "q 7\n")]);
    let hosts = memo.parse(&after).unwrap();
    assert_eq!(hosts, parse_upstream_hosts(&after).unwrap());
    assert_eq!(hosts[0].health, Health::Unhealthy);
    assert_eq!(hosts[0].metrics, None);
    assert_eq!(hosts[1].metrics.as_deref(), Some("q 7\n"));
    // Pod 1 left the cluster, and pod 2's body went back to its first sample: what the list says.
    let back = host_list(&[("10.0.0.2:8000", "Healthy", "q 1\n")]);
    assert_eq!(memo.parse(&back).unwrap(), vec![kept[1].clone()]);
    assert_eq!(memo.parse(&[1, 0]), None, "malformed bytes are refused as without the memo");
}

#[test]
fn a_memo_over_its_byte_bound_starts_over_and_still_reads_right() {
    let mut memo = HostListMemo::default();
    let body = "x".repeat(60 * 1024);
    // 300 pods of 60 KiB each: past the memo's bound within one list.
    let names: Vec<String> =
        (0..300).map(|i| format!("10.0.{}.{}:8000", i / 250, i % 250)).collect();
    let hosts: Vec<(&str, &str, &str)> =
        names.iter().map(|n| (n.as_str(), "Healthy", body.as_str())).collect();
    let list = host_list(&hosts);
    for _ in 0..2 {
        let read = memo.parse(&list).unwrap();
        assert_eq!(read.len(), 300);
        assert!(read.iter().all(|h| h.metrics.as_deref() == Some(body.as_str())));
        assert!(memo.bytes <= MEMO_MAX_BYTES, "held {} bytes", memo.bytes);
    }
}
