//! `endpoint_hash` through the dispatcher and the fake host: the Go plugin's key, hits pinned and
//! renewed, misses bound at the response, stale pods, keyless requests, and a stalled Redis.

use super::*;
use crate::filter::Filter;
use crate::host::fake::FakeHost;
use crate::testutil::{command, deliver, setup};
use crate::types::HeaderAction;

const CONFIG: &str = r#"{"lb_policy":"endpoint_hash","lb_config":{"serviceFQDN":"redis.static","servicePort":6379,"hash_header":"x-session","stickyTimeout":5}}"#;
const CLUSTER: &str = "outbound|8000||llm.static";

fn bulk(s: &str) -> RedisReply {
    RedisReply::Ok(format!("${}\r\n{s}\r\n", s.len()).into_bytes())
}

fn nil() -> RedisReply {
    RedisReply::Ok(b"$-1\r\n".to_vec())
}

/// Sends a request with session `key` on stream `ctx`; returns the header action.
fn start(f: &mut Filter, host: &mut FakeHost, ctx: u32, key: Option<&str>) -> HeaderAction {
    host.request_headers.retain(|(k, _)| k != "x-session");
    if let Some(k) = key {
        host.request_headers.push(("x-session".into(), k.into()));
    }
    host.override_host = None;
    f.on_request_headers(host, ctx, true)
}

#[test]
fn the_binding_key_is_the_go_plugins() {
    // FNV-1a of "alice" is 0x872213e7.
    assert_eq!(
        binding_key("r1", CLUSTER, "alice"),
        "higress:endpoint_hash_table:r1:outbound|8000||llm.static:872213e7"
    );
}

#[test]
fn a_bound_healthy_pod_gets_the_request_and_its_binding_is_renewed() {
    let (mut f, mut host) = setup(CONFIG);
    assert_eq!(start(&mut f, &mut host, 7, Some("alice")), HeaderAction::StopIteration);
    let key = binding_key("r1", CLUSTER, "alice");
    assert_eq!(command(&host, 0), ["GET", key.as_str()]);
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, bulk("10.0.0.2:8000"));
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.2:8000"));
    assert_eq!(host.resumes, 1);
    assert_eq!(command(&host, 1), ["EXPIRE", key.as_str(), "300"], "stickyTimeout 5 min");
    assert_eq!(host.counters.get("ai_lb_sticky_hit"), Some(&1));
    // A hit writes nothing more at the response.
    host.properties.insert("upstream.address".into(), b"10.0.0.2:8000".to_vec());
    f.on_response_headers(&mut host, 7);
    f.on_delete(&mut host, 7);
    assert_eq!(host.redis_calls.len(), 2);
}

#[test]
fn a_miss_is_bound_to_the_pod_the_gateway_chose() {
    let (mut f, mut host) = setup(CONFIG);
    start(&mut f, &mut host, 7, Some("bob"));
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, nil());
    assert_eq!(host.override_host, None, "the gateway's balancing chooses");
    assert_eq!(host.resumes, 1);
    assert_eq!(host.counters.get("ai_lb_sticky_miss"), Some(&1));
    host.properties.insert("upstream.address".into(), b"10.0.0.1:8000".to_vec());
    f.on_response_headers(&mut host, 7);
    let key = binding_key("r1", CLUSTER, "bob");
    assert_eq!(command(&host, 1), ["SETEX", key.as_str(), "300", "10.0.0.1:8000"]);
    f.on_delete(&mut host, 7);
    assert_eq!(host.redis_calls.len(), 2, "bound once");
}

#[test]
fn a_bound_pod_that_is_no_longer_healthy_is_replaced() {
    let (mut f, mut host) = setup(CONFIG);
    start(&mut f, &mut host, 7, Some("carol"));
    let t = host.last_redis_token().unwrap();
    // .3 is unhealthy in the fake's host list.
    deliver(&mut f, &mut host, t, bulk("10.0.0.3:8000"));
    assert_eq!(host.override_host, None);
    host.properties.insert("upstream.address".into(), b"10.0.0.2:8000".to_vec());
    // No response headers (the upstream failed): bound at the end.
    f.on_delete(&mut host, 7);
    assert_eq!(command(&host, 1)[0], "SETEX");
    assert_eq!(command(&host, 1)[3], "10.0.0.2:8000");
}

#[test]
fn a_request_without_the_key_takes_normal_balancing_and_binds_nothing() {
    let (mut f, mut host) = setup(CONFIG);
    assert_eq!(start(&mut f, &mut host, 7, None), HeaderAction::Continue);
    assert_eq!(start(&mut f, &mut host, 8, Some("")), HeaderAction::Continue);
    host.properties.insert("upstream.address".into(), b"10.0.0.2:8000".to_vec());
    f.on_response_headers(&mut host, 7);
    f.on_delete(&mut host, 7);
    f.on_delete(&mut host, 8);
    assert!(host.redis_calls.is_empty());
}

#[test]
fn a_redis_error_is_a_miss_and_a_network_error_binds_nothing() {
    let (mut f, mut host) = setup(CONFIG);
    host.properties.insert("upstream.address".into(), b"10.0.0.1:8000".to_vec());
    start(&mut f, &mut host, 7, Some("dave"));
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, RedisReply::Ok(b"-ERR something\r\n".to_vec()));
    assert_eq!(host.resumes, 1);
    f.on_response_headers(&mut host, 7);
    assert_eq!(command(&host, 1)[0], "SETEX", "an error reply is a miss: bound again, as in Go");
    start(&mut f, &mut host, 8, Some("erin"));
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, RedisReply::NetworkError);
    assert_eq!(host.resumes, 2);
    f.on_response_headers(&mut host, 8);
    assert_eq!(host.redis_calls.len(), 3, "no write to a Redis that does not answer");
    assert_eq!(host.counters.get("ai_lb_fallback_redis_timeout"), Some(&1));
}

#[test]
fn a_stalled_redis_is_given_up_at_breaker_slow_ms_and_skipped_while_the_breaker_is_open() {
    let (mut f, mut host) = setup(CONFIG);
    start(&mut f, &mut host, 7, Some("alice"));
    let stalled = host.last_redis_token().unwrap();
    // Not yet: 150 ms.
    host.now += 150_000_000;
    f.on_tick(&mut host);
    assert_eq!(host.resumes, 0);
    // Past breakerSlowMs (200 ms) with no answer from Redis at all: given up, breaker open.
    host.now += 60_000_000;
    f.on_tick(&mut host);
    assert_eq!(host.resumes, 1, "resumed with normal balancing");
    assert_eq!(host.counters.get("ai_lb_fallback_redis_slow"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_breaker_opened"), Some(&1));
    // While it is open, requests do not wait for Redis.
    let calls = host.redis_calls.len();
    assert_eq!(start(&mut f, &mut host, 8, Some("bob")), HeaderAction::Continue);
    assert_eq!(host.redis_calls.len(), calls);
    assert_eq!(host.counters.get("ai_lb_fallback_breaker_open"), Some(&1));
    // The stalled lookup's late answer shows Redis is back: the next request looks up again.
    deliver(&mut f, &mut host, stalled, nil());
    assert_eq!(start(&mut f, &mut host, 9, Some("bob")), HeaderAction::StopIteration);
    assert_eq!(command(&host, host.redis_calls.len() - 1)[0], "GET");
    for ctx in [7, 8, 9] {
        f.on_delete(&mut host, ctx);
    }
}

#[test]
fn a_probe_whose_client_left_still_closes_the_breaker_when_redis_answers() {
    let (mut f, mut host) = setup(CONFIG);
    start(&mut f, &mut host, 7, Some("alice"));
    let stalled = host.last_redis_token().unwrap();
    host.now += 210_000_000;
    f.on_tick(&mut host);
    // The stalled lookup fails at the host's timeout: the breaker opens for breakerOpenMs.
    deliver(&mut f, &mut host, stalled, RedisReply::NetworkError);
    f.on_delete(&mut host, 7);
    assert_eq!(start(&mut f, &mut host, 8, Some("bob")), HeaderAction::Continue, "open");
    f.on_delete(&mut host, 8);
    // After breakerOpenMs one lookup is the probe; its client goes away before Redis answers.
    host.now += 1_100_000_000;
    assert_eq!(start(&mut f, &mut host, 9, Some("bob")), HeaderAction::StopIteration);
    let probe = host.last_redis_token().unwrap();
    f.on_delete(&mut host, 9);
    deliver(&mut f, &mut host, probe, nil());
    // Redis answered the probe: closed, the next request looks up again.
    let calls = host.redis_calls.len();
    assert_eq!(start(&mut f, &mut host, 10, Some("carol")), HeaderAction::StopIteration);
    assert_eq!(host.redis_calls.len(), calls + 1);
    f.on_delete(&mut host, 10);
}
