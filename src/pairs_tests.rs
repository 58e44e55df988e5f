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
