//! `cluster_hash`: each key source, the Go plugin's slot arithmetic, keyless requests and bad bodies
//! against the fake host.

use super::*;
use crate::config::{PluginConfig, PolicyConfig};
use crate::host::fake::FakeHost;

const A: &str = "outbound|80||svc-a.static";
const B: &str = "outbound|80||svc-b.static";

/// `A` holds slots 0–29, `B` 30–99.
fn policy(extra: &str) -> ClusterHash {
    let json = format!(
        r#"{{"lb_type":"cluster","lb_policy":"cluster_hash","lb_config":{{"clusters":[{{"cluster":"{A}","weight":30}},{{"cluster":"{B}","weight":70}}]{extra}}}}}"#
    );
    match PluginConfig::from_json(json.as_bytes()).ok().and_then(|c| c.default).map(|d| d.policy) {
        Some(PolicyConfig::ClusterHash(c)) => ClusterHash::new(c),
        other => panic!("bad test config: {other:?}"),
    }
}

fn post() -> (FakeHost, Stream) {
    let h = FakeHost::new().with_header(":method", "POST");
    (h, Stream { id: 1, ..Default::default() })
}

fn service(d: Decision) -> String {
    match d {
        Decision::SetHeader { name, value } => {
            assert_eq!(name, "x-higress-target-cluster");
            value
        }
        other => panic!("expected the cluster header, got {other:?}"),
    }
}

fn rejected(d: &Decision) -> bool {
    *d == Decision::Reject { status: 403, body: "hash key required".into() }
}

#[test]
fn the_hash_is_32_bit_fnv_1a() {
    // The published FNV-1a test vectors.
    use crate::policy::fnv1a32;
    assert_eq!(fnv1a32(b""), 0x811c_9dc5);
    assert_eq!(fnv1a32(b"a"), 0xe40c_292c);
    assert_eq!(fnv1a32(b"foobar"), 0xbf9c_f968);
}

#[test]
fn a_header_key_picks_the_slot_of_its_hash_modulo_100() {
    let mut p = policy("");
    // FNV-1a % 100: "a" 20 and "42" 11 (A's slots 0-29); "bob" 44, "alice" 79, "u-7" 92 (B's).
    for (key, want) in [("a", A), ("42", A), ("bob", B), ("alice", B), ("u-7", B)] {
        let (h, mut s) = post();
        let mut h = h.with_header("x-mse-consumer", key);
        assert_eq!(service(p.on_request_headers(&mut h, &mut s)), want, "key {key}");
        assert_eq!(s.decision.as_deref(), Some(format!("hash_routed; service={want}").as_str()));
    }
}

#[test]
fn the_same_key_always_gets_the_same_service_and_keys_spread_by_weight() {
    let mut p = policy("");
    let mut to_a = 0;
    for i in 0..10_000 {
        let key = format!("user-{i}");
        let mut first = None;
        for _ in 0..3 {
            let (h, mut s) = post();
            let mut h = h.with_header("x-mse-consumer", &key);
            let got = service(p.on_request_headers(&mut h, &mut s));
            assert_eq!(*first.get_or_insert(got.clone()), got, "key {key} moved");
        }
        to_a += usize::from(first.as_deref() == Some(A));
    }
    assert!((2_700..=3_300).contains(&to_a), "A has weight 30 of 100: {to_a} of 10000 keys");
}

#[test]
fn a_request_without_its_key_is_answered_403() {
    let mut p = policy(r#","hash_header":"x-user""#);
    let (mut h, mut s) = post();
    let d = p.on_request_headers(&mut h, &mut s);
    assert!(rejected(&d), "{d:?}");
    assert!(h.logged("no hash key (header \"x-user\")"));
    let (h, mut s) = post();
    let mut h = h.with_header("x-user", "");
    assert!(rejected(&p.on_request_headers(&mut h, &mut s)), "an empty key is no key");
    let (h, mut s) = post();
    let mut h = h.with_header("x-user", "bob");
    assert_eq!(service(p.on_request_headers(&mut h, &mut s)), B);
}

#[test]
fn a_cookie_key_is_read_from_the_cookie_header() {
    let mut p = policy(r#","key":{"source":"cookie","name":"session"}"#);
    let (h, mut s) = post();
    let mut h = h.with_header("cookie", "theme=dark; session=\"alice\"; lang=en");
    assert_eq!(service(p.on_request_headers(&mut h, &mut s)), B, "quotes dropped: alice");
    let (h, mut s) = post();
    let mut h = h.with_header("cookie", "theme=dark; session=a");
    assert_eq!(service(p.on_request_headers(&mut h, &mut s)), A);
    let (h, mut s) = post();
    let mut h = h.with_header("cookie", "theme=dark");
    assert!(rejected(&p.on_request_headers(&mut h, &mut s)));
}

#[test]
fn a_metadata_key_is_read_from_the_host_property() {
    let mut p = policy(r#","key":{"source":"metadata","name":"tenant"}"#);
    let (mut h, mut s) = post();
    assert!(rejected(&p.on_request_headers(&mut h, &mut s)), "no property");
    h.properties.insert("metadata.tenant".into(), b"alice".to_vec());
    assert_eq!(service(p.on_request_headers(&mut h, &mut s)), B);
    let mut p =
        policy(r#","key":{"source":"metadata","propertyPath":["filter_state","consumer"]}"#);
    h.properties.insert("filter_state.consumer".into(), b"a".to_vec());
    assert_eq!(service(p.on_request_headers(&mut h, &mut s)), A);
}

#[test]
fn a_body_key_waits_for_the_body_and_reads_its_gjson_path() {
    let mut p = policy(r#","key":{"source":"body","jsonPath":"$.user.id"}"#);
    let (mut h, mut s) = post();
    assert_eq!(p.on_request_headers(&mut h, &mut s), Decision::NeedBody);
    let d = p.on_request_body(&mut h, &mut s, br#"{"model":"m","user":{"id":"alice"}}"#);
    assert_eq!(service(d), B);
    // A number is its text: 42 is the key "42".
    assert_eq!(service(p.on_request_body(&mut h, &mut s, br#"{"user":{"id":42}}"#)), A);
    let d = p.on_request_body(&mut h, &mut s, br#"{"user":{}}"#);
    assert!(rejected(&d), "a JSON body without the field: {d:?}");
    // Not JSON: the route's own cluster, with a log line.
    let d = p.on_request_body(&mut h, &mut s, b"user=alice");
    assert_eq!(d, Decision::Passthrough);
    assert!(h.logged("not JSON"));
    let d = p.on_request_body(&mut h, &mut s, b"{\"user\":{\"id\":\"\xff\"}}");
    assert_eq!(d, Decision::Passthrough, "not UTF-8");
}

/// Go's gjson writes a number that is not an integer in its shortest form, so "1.50" and 1.5
/// are one key there; they must be here too (else a session would reach another service than
/// it does through a Go gateway).
#[test]
fn a_numeric_body_key_is_written_as_go_writes_it() {
    for (raw, go) in [
        ("42", "42"),
        ("-7", "-7"),
        ("1.50", "1.5"),
        ("-2.50", "-2.5"),
        ("1e3", "1000"),
        ("1E2", "100"),
        ("12.0", "12"),
        ("0.1", "0.1"),
        ("2.5e-3", "0.0025"),
        ("1e21", "1000000000000000000000"),
        ("123456789.123456789", "123456789.12345679"),
        ("1e400", "+Inf"),
        ("-1e400", "-Inf"),
    ] {
        let body = format!(r#"{{"user":{{"id":{raw}}}}}"#);
        assert_eq!(body_key(body.as_bytes(), "user.id").as_deref(), Some(go), "{raw}");
    }
}

#[test]
fn a_body_key_on_a_request_without_a_body_is_answered_403() {
    let mut p = policy(r#","key":{"source":"body","json_path":"user"}"#);
    for (method, length, bodiless) in [
        ("GET", None, false),
        ("HEAD", None, false),
        ("POST", Some("0"), false),
        ("POST", None, true),
    ] {
        let mut h = FakeHost::new().with_header(":method", method);
        if let Some(l) = length {
            h = h.with_header("content-length", l);
        }
        let mut s = Stream { id: 1, bodiless, ..Default::default() };
        let d = p.on_request_headers(&mut h, &mut s);
        assert!(rejected(&d), "{method} {length:?} {bodiless}: {d:?}");
    }
}
