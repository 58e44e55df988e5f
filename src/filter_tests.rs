//! The request flow itself, with scripted policies.

use super::*;
use crate::host::fake::{FakeHost, LocalResponse};
use crate::testutil::deliver;

/// A policy that answers from a script and records what it saw.
#[derive(Default)]
struct Scripted {
    headers: Option<Decision>,
    body: Option<Decision>,
    reply: Option<Decision>,
    /// The headers callback makes a Redis call and holds the request for it.
    make_call: bool,
    /// The reply callback asks to keep waiting for the call just answered.
    wait_again: bool,
    /// The stream-done callback makes a Redis call nothing waits for.
    call_at_end: bool,
    bodies: Rc<RefCell<Vec<Vec<u8>>>>,
    done: Rc<RefCell<u32>>,
    /// (token, came with its stream) of every reply.
    replies: Rc<RefCell<Vec<(u32, bool)>>>,
}

impl Policy for Scripted {
    fn name(&self) -> &'static str {
        "scripted"
    }
    fn on_request_headers(&mut self, host: &mut dyn Host, _s: &mut Stream) -> Decision {
        if self.make_call {
            if let Ok(token) = host.redis_call("c", b"*1\r\n$4\r\nPING\r\n") {
                return Decision::Pending(token);
            }
        }
        self.headers.clone().unwrap_or(Decision::Passthrough)
    }
    fn on_request_body(&mut self, _h: &mut dyn Host, _s: &mut Stream, body: &[u8]) -> Decision {
        self.bodies.borrow_mut().push(body.to_vec());
        self.body.clone().unwrap_or(Decision::Passthrough)
    }
    fn on_redis_reply(
        &mut self,
        _h: &mut dyn Host,
        s: Option<&mut Stream>,
        t: u32,
        _r: &RedisReply,
    ) -> Decision {
        self.replies.borrow_mut().push((t, s.is_some()));
        if self.wait_again {
            return Decision::Pending(t);
        }
        self.reply.clone().unwrap_or(Decision::Passthrough)
    }
    fn on_stream_done(&mut self, host: &mut dyn Host, _s: &mut Stream) {
        *self.done.borrow_mut() += 1;
        if self.call_at_end {
            let _ = host.redis_call("c", b"*1\r\n$4\r\nPING\r\n");
        }
    }
}

#[test]
fn a_request_held_for_a_call_is_decided_by_its_reply() {
    let replies = Rc::new(RefCell::new(Vec::new()));
    let p = Scripted {
        make_call: true,
        reply: Some(Decision::Route("10.0.0.9:80".into())),
        replies: replies.clone(),
        ..Default::default()
    };
    let mut f = Filter::with_policy(Box::new(p), 100);
    let mut host = FakeHost::new();
    assert_eq!(f.on_request_headers(&mut host, 1, false), HeaderAction::StopIteration);
    let t = host.last_redis_token().unwrap();
    assert_eq!(f.stream_of_token(t), Some(1));
    host.request_body = b"hello".to_vec();
    assert_eq!(f.on_request_body(&mut host, 1, 5, false), DataAction::StopIterationAndWatermark);
    deliver(&mut f, &mut host, t, RedisReply::NetworkError);
    assert_eq!(*replies.borrow(), vec![(t, true)]);
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.9:80"));
    assert_eq!(host.resumes, 1);
    assert_eq!(f.stream_of_token(t), None, "answered: nothing waits for it any more");
}

#[test]
fn replies_no_stream_waits_for_reach_the_policy_without_a_stream() {
    let replies = Rc::new(RefCell::new(Vec::new()));
    let p = Scripted { call_at_end: true, replies: replies.clone(), ..Default::default() };
    let mut f = Filter::with_policy(Box::new(p), 100);
    let mut host = FakeHost::new();
    assert_eq!(f.on_request_headers(&mut host, 1, true), HeaderAction::Continue);
    f.on_stream_end(&mut host, 1);
    let t = host.last_redis_token().unwrap();
    assert_eq!(f.stream_of_token(t), None);
    f.on_redis_reply(&mut host, t, &RedisReply::NetworkError, false);
    assert_eq!(*replies.borrow(), vec![(t, false)]);
    assert_eq!(host.resumes, 0, "no stream was held");
}

#[test]
fn need_body_on_a_bodiless_request_continues() {
    let mut f = Filter::with_policy(
        Box::new(Scripted { headers: Some(Decision::NeedBody), ..Default::default() }),
        100,
    );
    let mut host = FakeHost::new();
    assert_eq!(f.on_request_headers(&mut host, 1, true), HeaderAction::Continue);
}

/// A filter whose policy waits for the body and routes to 10.0.0.9:80; the bodies it got.
fn routes_by_body() -> (Filter, Rc<RefCell<Vec<Vec<u8>>>>) {
    let bodies = Rc::new(RefCell::new(Vec::new()));
    let p = Scripted {
        headers: Some(Decision::NeedBody),
        body: Some(Decision::Route("10.0.0.9:80".into())),
        bodies: bodies.clone(),
        ..Default::default()
    };
    (Filter::with_policy(Box::new(p), 100), bodies)
}

#[test]
fn body_is_delivered_once_whole_and_route_applies() {
    let (mut f, bodies) = routes_by_body();
    let mut host = FakeHost::new();
    assert_eq!(f.on_request_headers(&mut host, 1, false), HeaderAction::StopIteration);
    // The stream may buffer past maxBodyBytes (by one chunk's room) before Envoy answers 413.
    let limit = (100 + (1 << 20)).to_string();
    assert_eq!(host.get_property(&["set_decoder_buffer_limit"]), Some(limit.into_bytes()));
    host.request_body = b"hello".to_vec();
    assert_eq!(f.on_request_body(&mut host, 1, 5, false), DataAction::StopIterationAndBuffer);
    host.request_body = b"hello world".to_vec();
    assert_eq!(f.on_request_body(&mut host, 1, 11, true), DataAction::Continue);
    assert_eq!(*bodies.borrow(), vec![b"hello world".to_vec()]);
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.9:80"));
    assert_eq!(host.resumes, 0, "continued by the return value, not by a resume");
}

/// Envoy answers 413 to a held body over the stream's buffer limit whatever the plugin answers for
/// that chunk, so the plugin must let a body over `maxBodyBytes` go before the limit: its
/// `content-length` says so at the headers, and without one the first chunk past `maxBodyBytes`
/// still fits under the limit the plugin set.
#[test]
fn a_body_over_max_body_bytes_is_let_through_before_envoys_buffer_limit() {
    let (mut f, bodies) = routes_by_body();
    let mut host = FakeHost::new();
    host.request_headers.push(("content-length".into(), "101".into()));
    assert_eq!(f.on_request_headers(&mut host, 1, false), HeaderAction::Continue);
    assert_eq!(host.get_property(&["set_decoder_buffer_limit"]), None, "not held at all");
    assert_eq!(f.on_request_body(&mut host, 1, 101, true), DataAction::Continue);
    assert_eq!(host.counters.get("ai_lb_fallback_body_too_large"), Some(&1));

    // Chunked (no content-length): held, and the first chunk past 100 bytes is let through.
    let mut host = FakeHost::new();
    assert_eq!(f.on_request_headers(&mut host, 2, false), HeaderAction::StopIteration);
    let limit: usize = String::from_utf8(host.get_property(&["set_decoder_buffer_limit"]).unwrap())
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(f.on_request_body(&mut host, 2, 90, false), DataAction::StopIterationAndBuffer);
    let crossing = 90 + 16 * 1024;
    assert!(crossing <= limit, "a 16 KiB chunk past maxBodyBytes fits under the limit {limit}");
    assert_eq!(f.on_request_body(&mut host, 2, crossing, false), DataAction::Continue);
    assert_eq!(host.counters.get("ai_lb_fallback_body_too_large"), Some(&1));
    assert!(bodies.borrow().is_empty(), "neither body reached the policy");
    assert!(host.override_host.is_none());
}

#[test]
fn set_header_and_reject_decisions() {
    let p = Scripted {
        headers: Some(Decision::SetHeader { name: "x-target".into(), value: "c1".into() }),
        ..Default::default()
    };
    let mut f = Filter::with_policy(Box::new(p), 100);
    let mut host = FakeHost::new();
    assert_eq!(f.on_request_headers(&mut host, 1, true), HeaderAction::Continue);
    assert_eq!(host.request_header("x-target").as_deref(), Some("c1"));

    let p = Scripted {
        headers: Some(Decision::Reject { status: 503, body: "no".into() }),
        ..Default::default()
    };
    let mut f = Filter::with_policy(Box::new(p), 100);
    let mut host = FakeHost::new();
    assert_eq!(f.on_request_headers(&mut host, 1, true), HeaderAction::StopIteration);
    assert_eq!(host.local_responses, vec![LocalResponse { status: 503, body: b"no".to_vec() }]);
}

#[test]
fn a_reply_that_keeps_waiting_for_the_call_just_answered_resumes() {
    let p = Scripted { make_call: true, wait_again: true, ..Default::default() };
    let mut f = Filter::with_policy(Box::new(p), 100);
    let mut host = FakeHost::new();
    assert_eq!(f.on_request_headers(&mut host, 1, false), HeaderAction::StopIteration);
    let t = host.last_redis_token().unwrap();
    assert_eq!(f.stream_of_token(t), Some(1));
    deliver(&mut f, &mut host, t, RedisReply::NetworkError);
    assert_eq!(host.resumes, 1, "never left paused");
}

#[test]
fn stream_done_runs_once_for_every_end_path() {
    let done = Rc::new(RefCell::new(0));
    let p = Scripted { done: done.clone(), ..Default::default() };
    let mut f = Filter::with_policy(Box::new(p), 100);
    let mut host = FakeHost::new();
    for ctx in 1..=3 {
        f.on_request_headers(&mut host, ctx, true);
    }
    f.on_stream_end(&mut host, 1);
    f.on_stream_end(&mut host, 1);
    f.on_delete(&mut host, 1);
    f.on_delete(&mut host, 2);
    f.on_stream_end(&mut host, 3);
    f.on_delete(&mut host, 3);
    f.on_delete(&mut host, 3);
    assert_eq!(*done.borrow(), 3);
    assert_eq!(f.live_streams(), 0);
}

#[test]
fn unmatched_requests_are_not_touched_when_only_rules_configure_the_plugin() {
    let mut host = FakeHost::new();
    host.set_hosts(&[("10.0.0.1:8000", true)]);
    let mut f = Filter::new();
    let cfg = br#"{"_rules_":[{"_match_route_":["other"],"lb_policy":"global_least_request","lb_config":{"serviceFQDN":"redis.static","servicePort":6379}}]}"#;
    assert!(f.configure(&mut host, cfg));
    assert_eq!(f.on_request_headers(&mut host, 1, false), HeaderAction::Continue);
    assert!(host.redis_calls.is_empty());
    assert_eq!(f.live_streams(), 0);
    host.properties.insert("route_name".into(), b"other".to_vec());
    assert_eq!(f.on_request_headers(&mut host, 2, false), HeaderAction::StopIteration);
    assert_eq!(host.redis_calls.len(), 1);
}

#[test]
fn every_counter_is_defined_when_the_plugin_starts() {
    // Exported at 0 before its first event (Envoy exports a proxy-wasm metric once defined), so
    // a rate alert sees that first event and a dashboard shows 0 rather than no data.
    let mut host = FakeHost::new();
    let mut f = Filter::new();
    let cfg = br#"{"lb_policy":"global_least_request","lb_config":{"serviceFQDN":"redis.static","servicePort":6379}}"#;
    assert!(f.configure(&mut host, cfg));
    assert_eq!(host.defined_counters, Counter::ALL.to_vec());
    assert!(host.counters.is_empty(), "defined, not incremented");
    let mut names: Vec<&str> = Counter::ALL.iter().map(|c| c.name()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), Counter::ALL.len(), "each counter listed once");
}

#[test]
fn unconfigured_filter_passes_everything() {
    let mut f = Filter::new();
    let mut host = FakeHost::new();
    assert_eq!(f.on_request_headers(&mut host, 1, false), HeaderAction::Continue);
    assert_eq!(f.on_request_body(&mut host, 1, 10, true), DataAction::Continue);
}

#[test]
fn body_ending_with_trailers_is_read_from_the_host_once() {
    let (mut f, bodies) = routes_by_body();
    let mut host = FakeHost::new();
    assert_eq!(f.on_request_headers(&mut host, 1, false), HeaderAction::StopIteration);
    host.request_body = b"hello".to_vec();
    assert_eq!(f.on_request_body(&mut host, 1, 5, false), DataAction::StopIterationAndBuffer);
    assert_eq!(f.on_request_trailers(&mut host, 1), HeaderAction::Continue);
    assert_eq!(*bodies.borrow(), vec![b"hello".to_vec()]);
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.9:80"));
    assert_eq!(
        host.body_reads.get(),
        1,
        "one copy of the body, not one to size it and one to use it"
    );
    // Over maxBodyBytes with trailers: normal balancing, still one read.
    let mut f = Filter::with_policy(
        Box::new(Scripted { headers: Some(Decision::NeedBody), ..Default::default() }),
        3,
    );
    let mut host = FakeHost::new();
    f.on_request_headers(&mut host, 1, false);
    host.request_body = b"hello".to_vec();
    assert_eq!(f.on_request_trailers(&mut host, 1), HeaderAction::Continue);
    assert_eq!(host.body_reads.get(), 1);
    assert!(host.logged("larger than maxBodyBytes"));
}

#[test]
fn the_start_log_names_the_default_policy() {
    let mut host = FakeHost::new();
    let mut f = Filter::new();
    let cfg = r#"{"lb_policy":"prefix_cache","lb_config":{"serviceFQDN":"r","servicePort":1}}"#;
    assert!(f.configure(&mut host, cfg.as_bytes()));
    assert!(host.logged("configured: 0 rule(s), default prefix_cache"));
    let mut host = FakeHost::new();
    let mut f = Filter::new();
    let rules_only = r#"{"_rules_":[{"_match_route_":["r1"],"lb_policy":"endpoint_metrics"}]}"#;
    assert!(f.configure(&mut host, rules_only.as_bytes()));
    assert!(host.logged("configured: 1 rule(s), default none"));
}

#[test]
fn the_first_matching_rule_serves_a_request_and_the_top_level_config_the_rest() {
    let mut host = FakeHost::new();
    host.set_hosts(&[("10.0.0.1:8000", true)]);
    host.properties.insert("cluster_name".into(), b"outbound|8000||llm.static".to_vec());
    let mut f = Filter::new();
    let cfg =
        br#"{"lb_policy":"global_least_request","lb_config":{"serviceFQDN":"r","servicePort":1},
      "_rules_":[{"_match_route_":["chat"],"lb_policy":"prefix_cache","lb_config":{"serviceFQDN":"r","servicePort":1}},
                 {"_match_route_":["chat","other"],"lb_policy":"endpoint_metrics"}]}"#;
    assert!(f.configure(&mut host, cfg));
    host.properties.insert("route_name".into(), b"chat".to_vec());
    // prefix_cache waits for the body before it calls Redis.
    assert_eq!(f.on_request_headers(&mut host, 1, false), HeaderAction::StopIteration);
    assert!(host.redis_calls.is_empty());
    host.properties.insert("route_name".into(), b"elsewhere".to_vec());
    // global_least_request picks on the headers.
    assert_eq!(f.on_request_headers(&mut host, 2, false), HeaderAction::StopIteration);
    assert_eq!(host.redis_calls.len(), 1);
    assert_eq!(f.stream_of_token(host.last_redis_token().unwrap()), Some(2));
}
