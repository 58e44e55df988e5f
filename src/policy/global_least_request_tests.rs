//! `global_least_request` through the dispatcher against the fake host.

use crate::host::{Host, HostError, RedisReply};
use crate::redis::{inflight_key, LEAST_REQUEST_LUA};
use crate::testutil::*;
use crate::types::{DataAction, HeaderAction};

const CLUSTER: &str = "outbound|8000||llm.static";

fn cfg(extra: &str) -> String {
    format!(
        r#"{{"lb_policy":"global_least_request","lb_config":{{"serviceFQDN":"redis.static","servicePort":6379,"username":"u","password":"p"{extra}}}}}"#
    )
}

#[test]
fn redis_is_initialised_at_start_with_the_go_cluster_name() {
    let (_f, host) = setup(&cfg(r#","database":2,"timeout":700"#));
    assert_eq!(
        host.redis_inits,
        vec![crate::host::fake::RedisInit {
            cluster: "outbound|6379||redis.static?db=2&buffer_flush_timeout=0&max_buffer_size_before_flush=0".into(),
            username: "u".into(),
            password: "p".into(),
            timeout_ms: 700
        }]
    );
}

#[test]
fn redis_init_failure_does_not_fail_start() {
    let mut host = crate::host::fake::FakeHost::new();
    host.redis_init_error = Some(HostError::BadArgument);
    let mut f = crate::filter::Filter::new();
    assert!(
        f.configure(&mut host, cfg("").as_bytes()),
        "Higress #1517: must not reject the config"
    );
    assert!(host.logged("will retry"));
}

#[test]
fn bad_config_fails_start_with_one_clear_line() {
    let mut host = crate::host::fake::FakeHost::new();
    let mut f = crate::filter::Filter::new();
    assert!(!f.configure(&mut host, br#"{"lb_policy":"nope"}"#));
    let logs = host.logs.borrow();
    assert_eq!(logs.len(), 1);
    assert!(logs[0].1.contains("lb_policy") && logs[0].1.contains("global_least_request"));
}

#[test]
fn picks_in_headers_phase_and_routes_to_the_script_choice() {
    let (mut f, mut host) = setup(&cfg(r#","maxRequestCount":10,"cleanInterval":5"#));
    assert_eq!(f.on_request_headers(&mut host, 7, false), HeaderAction::StopIteration);
    // The body is not read: the stream keeps the gateway's own buffer limit.
    assert_eq!(host.get_property(&["set_decoder_buffer_limit"]), None);
    assert_eq!(host.redis_calls.len(), 1);
    let cmd = command(&host, 0);
    assert_eq!(cmd[0], "EVALSHA");
    assert_eq!(cmd[1], crate::redis::sha1_hex_lower(LEAST_REQUEST_LUA.as_str().as_bytes()));
    let (keys, args) = keys_args(&cmd);
    assert_eq!(keys, vec![inflight_key("r1", CLUSTER)], "the scripts derive the other keys");
    assert_eq!(args[0], "10", "maxRequestCount");
    assert_eq!(args[1], "10000", "leaseMs");
    assert_eq!(args[2].len(), 12, "owner id");
    assert_eq!(args[3], "1", "request id: a counter");
    let mut healthy = args[4..].to_vec();
    healthy.sort();
    assert_eq!(healthy, vec!["10.0.0.1:8000", "10.0.0.2:8000"], "only healthy hosts, whole");
    // Body chunks that come while the pick is out are held under flow control: a body over the
    // buffer limit slows the client down instead of getting 413.
    assert_eq!(f.on_request_body(&mut host, 7, 100, false), DataAction::StopIterationAndWatermark);
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, RedisReply::Ok(pick_reply("10.0.0.2:8000", 1, true, None)));
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.2:8000"));
    assert_eq!(host.resumes, 1);
}

#[test]
fn bodiless_request_decides_in_headers_and_never_waits_for_a_body() {
    let (mut f, mut host) = setup(&cfg(""));
    assert_eq!(f.on_request_headers(&mut host, 7, true), HeaderAction::StopIteration);
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, true, None)));
    assert_eq!(host.resumes, 1, "resumed without any body callback");
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.1:8000"));
}

#[test]
fn ties_are_broken_uniformly_at_random() {
    let (mut f, mut host) = setup(&cfg(""));
    host.set_hosts(&[("a:1", true), ("b:1", true), ("c:1", true), ("d:1", true)]);
    let mut first = std::collections::HashMap::new();
    let n = 4000;
    for i in 0..n {
        let before = host.redis_calls.len();
        f.on_request_headers(&mut host, 100 + i, false);
        let (_, args) = keys_args(&command(&host, before));
        // The script takes the first minimum: with equal counts, the first shuffled host wins.
        *first.entry(args[4].clone()).or_insert(0) += 1;
        f.on_delete(&mut host, 100 + i);
    }
    assert_eq!(first.len(), 4);
    for (h, c) in first {
        assert!((800..1200).contains(&c), "host {h} first {c} times out of {n}");
    }
}

#[test]
fn over_max_request_count_answers_429_and_never_decrements_again() {
    let (mut f, mut host) = setup(&cfg(r#","maxRequestCount":1"#));
    f.on_request_headers(&mut host, 7, true);
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, RedisReply::Ok(pick_reply("10.0.0.1:8000", 2, false, None)));
    assert_eq!(host.local_responses.len(), 1);
    assert_eq!(host.local_responses[0].status, 429);
    assert_eq!(host.resumes, 0, "a local reply is not resumed");
    assert_eq!(host.override_host, None);
    f.on_stream_end(&mut host, 7);
    f.on_delete(&mut host, 7);
    assert!(releases(&host).is_empty(), "the script already undid the +1");
}

#[test]
fn decrement_exactly_once_when_the_stream_ends() {
    let (mut f, mut host) = setup(&cfg(""));
    route_to(&mut f, &mut host, 7, "10.0.0.2:8000");
    // on_log, on_done and on_delete all end the stream; only the first counts.
    f.on_stream_end(&mut host, 7);
    f.on_stream_end(&mut host, 7);
    f.on_delete(&mut host, 7);
    assert_eq!(releases(&host), vec![release_of(&host, 0, false)]);
    assert_eq!(f.live_streams(), 0);
}

#[test]
fn decrement_on_delete_alone_for_reset_streams() {
    let (mut f, mut host) = setup(&cfg(""));
    f.on_request_headers(&mut host, 7, false);
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, true, None)));
    f.on_delete(&mut host, 7); // no on_log (e.g. a reset stream)
    assert_eq!(releases(&host).len(), 1);
}

#[test]
fn client_abort_while_pick_in_flight_cancels_the_pick_once() {
    let (mut f, mut host) = setup(&cfg(""));
    f.on_request_headers(&mut host, 7, false);
    let t = host.last_redis_token().unwrap();
    f.on_stream_end(&mut host, 7);
    f.on_delete(&mut host, 7);
    // Sent at once, after the pick on the same connection: it undoes the pick or leaves a tombstone.
    assert_eq!(releases(&host), vec![release_of(&host, 0, true)]);
    assert_eq!(f.stream_of_token(t), None, "the stream is gone: abi.rs must not switch to it");
    f.on_redis_reply(
        &mut host,
        t,
        &RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, true, None)),
        false,
    );
    assert_eq!(releases(&host).len(), 1, "the late reply changes nothing");
    assert_eq!(host.resumes, 0, "nothing to resume");
}

#[test]
fn noscript_falls_back_to_eval_then_routes() {
    let (mut f, mut host) = setup(&cfg(""));
    f.on_request_headers(&mut host, 7, false);
    let t = host.last_redis_token().unwrap();
    deliver(
        &mut f,
        &mut host,
        t,
        RedisReply::Ok(b"-NOSCRIPT No matching script. Please use EVAL.\r\n".to_vec()),
    );
    assert_eq!(host.resumes, 0, "still waiting for the EVAL");
    let cmd = command(&host, 1);
    assert_eq!(cmd[0], "EVAL");
    assert_eq!(cmd[1], LEAST_REQUEST_LUA.as_str());
    assert_eq!(keys_args(&cmd), keys_args(&command(&host, 0)), "same keys and args");
    let t2 = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t2, RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, true, None)));
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.1:8000"));
    assert_eq!(host.resumes, 1);
}

#[test]
fn redis_error_reply_resumes_on_normal_balancing() {
    // (reply, the pick may have run so it is cancelled)
    for (reply, cancel) in [
        (RedisReply::Ok(b"-ERR something\r\n".to_vec()), false),
        (RedisReply::Ok(b"-NOAUTH Authentication required.\r\n".to_vec()), false),
        (RedisReply::NetworkError, true),
        (RedisReply::Ok(b"garbage".to_vec()), true),
        (RedisReply::Ok(b":5\r\n".to_vec()), true),
        (RedisReply::Ok(b"*3\r\n$0\r\n\r\n:0\r\n:0\r\n".to_vec()), true),
    ] {
        let (mut f, mut host) = setup(&cfg(""));
        f.on_request_headers(&mut host, 7, false);
        let t = host.last_redis_token().unwrap();
        f.on_redis_reply(&mut host, t, &reply, true);
        assert_eq!(host.resumes, 1, "{reply:?}");
        assert_eq!(host.override_host, None, "{reply:?}");
        assert!(host.local_responses.is_empty());
        f.on_delete(&mut host, 7);
        let expected = if cancel { vec![release_of(&host, 0, true)] } else { vec![] };
        assert_eq!(releases(&host), expected, "{reply:?}");
    }
}

#[test]
fn noauth_reinitialises_redis_on_the_next_request() {
    let (mut f, mut host) = setup(&cfg(""));
    f.on_request_headers(&mut host, 7, false);
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, RedisReply::Ok(b"-NOAUTH Authentication required.\r\n".to_vec()));
    assert_eq!(host.redis_inits.len(), 1);
    f.on_request_headers(&mut host, 8, false);
    assert_eq!(host.redis_inits.len(), 2);
}

#[test]
fn redis_call_failure_or_missing_hosts_continue_immediately() {
    let (mut f, mut host) = setup(&cfg(""));
    host.redis_call_error = Some(HostError::InternalFailure);
    assert_eq!(f.on_request_headers(&mut host, 7, false), HeaderAction::Continue);
    let (mut f, mut host) = setup(&cfg(""));
    host.hosts = None;
    assert_eq!(f.on_request_headers(&mut host, 7, false), HeaderAction::Continue);
    assert!(host.redis_calls.is_empty());
    host.set_hosts(&[("10.0.0.1:8000", false)]);
    assert_eq!(f.on_request_headers(&mut host, 8, false), HeaderAction::Continue);
    assert!(host.logged("no healthy upstream host"));
    host.properties.remove("route_name");
    host.set_hosts(&[("10.0.0.1:8000", true)]);
    assert_eq!(f.on_request_headers(&mut host, 9, false), HeaderAction::Continue);
    assert!(host.redis_calls.is_empty());
}

#[test]
fn replies_for_other_tokens_do_not_resume() {
    let (mut f, mut host) = setup(&cfg(""));
    f.on_request_headers(&mut host, 7, false);
    deliver(&mut f, &mut host, 9999, RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, true, None)));
    assert_eq!(host.resumes, 0);
    assert_eq!(host.override_host, None);
}

/// Request 7 routed to `10.0.0.2:8000` and ended: its release is the last Redis call.
fn one_request_ended() -> (crate::filter::Filter, crate::host::fake::FakeHost) {
    let (mut f, mut host) = setup(&cfg(""));
    route_to(&mut f, &mut host, 7, "10.0.0.2:8000");
    f.on_delete(&mut host, 7);
    (f, host)
}

#[test]
fn a_release_lost_to_a_redis_network_error_is_sent_again_once_redis_answers() {
    let (mut f, mut host) = one_request_ended();
    let first = release_of(&host, 0, false);
    // Higress closes the pipeline on an op timeout: the -1 may never have reached Redis.
    let lost = host.last_redis_token().unwrap();
    f.on_redis_reply(&mut host, lost, &RedisReply::NetworkError, false);
    assert_eq!(
        releases(&host),
        vec![first.clone()],
        "not resent into the broken connection at once"
    );
    // The next pick is answered: Redis is back, so the lost -1 goes out again (release.lua is
    // idempotent per pick record, so a -1 that did run is not applied twice).
    f.on_request_headers(&mut host, 9, true);
    let t2 = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t2, RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, true, None)));
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.1:8000"));
    assert_eq!(releases(&host), vec![first.clone(), first.clone()]);
    // Acknowledged this time: never sent again.
    let resent = host.last_redis_token().unwrap();
    f.on_redis_reply(
        &mut host,
        resent,
        &RedisReply::Ok(b"$13\r\n10.0.0.2:8000\r\n".to_vec()),
        false,
    );
    f.on_request_headers(&mut host, 11, true);
    let t3 = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t3, RedisReply::Ok(pick_reply("10.0.0.1:8000", 2, true, None)));
    assert_eq!(releases(&host), vec![first.clone(), first]);
}

#[test]
fn a_stopping_root_is_done_only_once_its_release_ran() {
    let (mut f, mut host) = setup(&cfg(""));
    assert!(f.on_stop(&mut host), "nothing in flight: done at once");
    let (mut f, mut host) = one_request_ended();
    let sent = host.last_redis_token().unwrap();
    assert!(!f.on_stop(&mut host), "the -1 is in flight");
    // Redis lost its scripts (restarted): the release goes again with its source.
    deliver(
        &mut f,
        &mut host,
        sent,
        RedisReply::Ok(b"-NOSCRIPT No matching script. Please use EVAL.\r\n".to_vec()),
    );
    assert_eq!(command(&host, host.redis_calls.len() - 1)[0], "EVAL");
    assert_eq!(host.root_dones, 0, "the resent -1 is in flight");
    let resent = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, resent, RedisReply::Ok(b"$13\r\n10.0.0.2:8000\r\n".to_vec()));
    assert_eq!(host.root_dones, 1);
    f.on_tick(&mut host);
    assert!(f.on_stop(&mut host));
    assert_eq!(host.root_dones, 1, "said once");
}

#[test]
fn a_stopping_root_whose_release_is_never_answered_is_done_after_five_seconds() {
    let (mut f, mut host) = one_request_ended();
    assert!(!f.on_stop(&mut host));
    host.now += 4_900 * MS;
    f.on_tick(&mut host);
    assert_eq!(host.root_dones, 0, "still waiting");
    host.now += 100 * MS;
    f.on_tick(&mut host);
    assert_eq!(host.root_dones, 1, "a reply that never comes does not hold the exit");
    assert!(host.logged("stopping without the replies"));
}

#[test]
fn a_stopping_root_sends_the_releases_that_waited_for_redis() {
    let (mut f, mut host) = one_request_ended();
    let first = release_of(&host, 0, false);
    let lost = host.last_redis_token().unwrap();
    f.on_redis_reply(&mut host, lost, &RedisReply::NetworkError, false);
    assert_eq!(releases(&host), vec![first.clone()]);
    // No later pick or answer would send it again: the stop does.
    assert!(!f.on_stop(&mut host));
    assert_eq!(releases(&host), vec![first.clone(), first]);
    let resent = host.last_redis_token().unwrap();
    f.on_redis_reply(&mut host, resent, &RedisReply::NetworkError, false);
    assert_eq!(host.root_dones, 1, "failed again: nothing is left to wait for");
}

#[test]
fn a_release_that_keeps_failing_is_dropped_after_a_few_sends() {
    let (mut f, mut host) = one_request_ended();
    let mut ctx = 9;
    for _ in 0..15 {
        // Every send of the release is lost, every pick is answered.
        let rt = host.last_redis_token().unwrap();
        f.on_redis_reply(&mut host, rt, &RedisReply::NetworkError, false);
        f.on_request_headers(&mut host, ctx, true);
        let pt = host.last_redis_token().unwrap();
        deliver(&mut f, &mut host, pt, RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, false, None)));
        ctx += 2;
    }
    let first = release_of(&host, 0, false);
    assert_eq!(releases(&host).iter().filter(|r| **r == first).count(), 10, "bounded resends");
    assert!(host.logged("giving up the release"));
    // The lost release's record would hold its +1 while this VM renews its lease: the next
    // heartbeat no longer lists it among the records the VM needs, so Redis releases it.
    let owner =
        |host: &crate::host::fake::FakeHost, i: usize| keys_args(&command(host, i)).1[2].clone();
    let old = owner(&host, 0);
    f.on_request_headers(&mut host, ctx, true);
    assert_eq!(owner(&host, host.redis_calls.len() - 1), old, "the owner stays");
    host.now += 10 * 1_000_000_000;
    let before = host.redis_calls.len();
    f.on_tick(&mut host);
    let sha = crate::redis::sha1_hex_lower(crate::redis::HEARTBEAT_LUA.as_bytes());
    let heartbeat = (before..host.redis_calls.len())
        .find(|&i| command(&host, i).get(1) == Some(&sha))
        .expect("a heartbeat");
    let (_, args) = keys_args(&command(&host, heartbeat));
    let needed: Vec<&str> = args[3].split(',').filter(|id| !id.is_empty()).collect();
    let in_flight = release_of(&host, before - 1, false).request;
    assert_eq!(needed, vec![in_flight.as_str()], "only the pick in flight: {args:?}");
    assert!(!needed.contains(&first.request.as_str()), "the dropped release's record goes");
    // Redis says it released it, and that its recount corrected two pods' counts.
    let token = host.redis_calls[heartbeat].token;
    f.on_redis_reply(&mut host, token, &RedisReply::Ok(b"*2\r\n:1\r\n:2\r\n".to_vec()), false);
    assert_eq!(host.counters.get("ai_lb_stale_records_released"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_counts_recounted"), Some(&2));
    assert!(host.logged("the recount corrected the in-flight counts of 2 pod(s)"));
}

const MS: u64 = 1_000_000;

/// Sends request `ctx` (bodiless) and answers its pick with `reply`; returns the pick's token.
fn request_with_reply(
    f: &mut crate::filter::Filter,
    host: &mut crate::host::fake::FakeHost,
    ctx: u32,
    reply: RedisReply,
) -> u32 {
    f.on_request_headers(host, ctx, true);
    let t = host.last_redis_token().unwrap();
    f.on_redis_reply(host, t, &reply, true);
    t
}

#[test]
fn a_stalled_redis_opens_the_breaker_then_one_probe_closes_it() {
    let (mut f, mut host) = setup(&cfg(""));
    for ctx in [7, 9, 11] {
        request_with_reply(&mut f, &mut host, ctx, RedisReply::NetworkError);
        f.on_delete(&mut host, ctx);
    }
    assert_eq!(host.resumes, 3);
    // Open: decided at once, no call to Redis.
    let calls = host.redis_calls.len();
    assert_eq!(f.on_request_headers(&mut host, 13, true), HeaderAction::Continue);
    assert_eq!(host.redis_calls.len(), calls, "no Redis call while open");
    assert_eq!(host.counters.get("ai_lb_fallback_breaker_open"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_breaker_opened"), Some(&1));
    assert!(host.logged("breaker open after 3 failed or slow calls"));
    f.on_delete(&mut host, 13);
    // After breakerOpenMs a request still does not wait: the tick carries the probe (a read of the
    // failed picks' in-flight hash, which on a Redis Cluster goes to their node), and while it is
    // out requests are decided at once.
    host.now += 1000 * MS;
    assert_eq!(f.on_request_headers(&mut host, 15, true), HeaderAction::Continue);
    assert_eq!(host.redis_calls.len(), calls, "a request never carries the probe");
    f.on_delete(&mut host, 15);
    f.on_tick(&mut host);
    let probe_command = command(&host, host.redis_calls.len() - 1);
    assert_eq!(probe_command, vec!["EXISTS".to_string(), inflight_key("r1", CLUSTER)]);
    let probe = host.last_redis_token().unwrap();
    assert_eq!(f.on_request_headers(&mut host, 17, true), HeaderAction::Continue);
    assert_eq!(host.redis_calls.len(), calls + 1, "no call while the probe is out");
    f.on_delete(&mut host, 17);
    // A failed probe opens it for breakerOpenMs again, and says so.
    f.on_redis_reply(&mut host, probe, &RedisReply::NetworkError, false);
    assert!(host.logged("breaker open after its probe failed"));
    assert_eq!(host.counters.get("ai_lb_breaker_opened"), Some(&2));
    host.now += 999 * MS;
    f.on_tick(&mut host);
    assert_eq!(host.redis_calls.len(), calls + 1, "no probe before breakerOpenMs");
    host.now += MS;
    f.on_tick(&mut host);
    assert_eq!(host.redis_calls.len(), calls + 2);
    let probe = host.last_redis_token().unwrap();
    f.on_redis_reply(&mut host, probe, &RedisReply::Ok(b":1\r\n".to_vec()), false);
    assert!(host.logged("breaker closed"));
    // Closed again: the next request calls Redis.
    assert_eq!(f.on_request_headers(&mut host, 19, true), HeaderAction::StopIteration);
}

#[test]
fn picks_still_waiting_when_the_breaker_opens_are_decided_at_once() {
    let (mut f, mut host) = setup(&cfg(r#","breakerSlowMs":200"#));
    // Redis stalls: three picks go out at 0 ms, two more at 100 ms, and none is answered.
    let mut tokens = Vec::new();
    for ctx in [7, 9, 11, 13, 15] {
        if ctx == 13 {
            host.now += 100 * MS;
        }
        f.on_request_headers(&mut host, ctx, true);
        tokens.push(host.last_redis_token().unwrap());
    }
    host.now += 60 * MS;
    f.on_tick(&mut host);
    assert_eq!(host.resumes, 0, "no pick has waited breakerSlowMs yet");
    // At 210 ms the first pick has waited breakerSlowMs with nothing answered since it was sent:
    // Redis is stalled, so it is given up and the breaker opens at once (no two more slow
    // picks). The other four wait on the same stall: decided in the same tick, not at their own
    // 200 ms.
    host.now += 50 * MS;
    f.on_tick(&mut host);
    assert_eq!(host.counters.get("ai_lb_fallback_redis_slow"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_breaker_opened"), Some(&1));
    assert!(host.logged("redis answered nothing for 200 ms: breaker open"));
    assert_eq!(host.resumes, 5, "every held request resumed");
    assert_eq!(host.counters.get("ai_lb_fallback_breaker_open"), Some(&4), "not counted as slow");
    // Their late replies change nothing.
    for t in tokens {
        deliver(&mut f, &mut host, t, RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, true, None)));
    }
    assert_eq!(host.resumes, 5);
    assert_eq!(host.override_host, None);
    // Each abandoned pick is cancelled once the probe finds Redis answering again.
    host.now += 1000 * MS;
    f.on_tick(&mut host);
    let ping = host.last_redis_token().unwrap();
    f.on_redis_reply(&mut host, ping, &RedisReply::Ok(b"+PONG\r\n".to_vec()), false);
    let cancels = releases(&host);
    assert_eq!(cancels.len(), 5, "five cancels, none lost: {cancels:?}");
    assert!((0..5).all(|i| cancels.contains(&release_of(&host, i, true))));
}

/// Two workers' VMs of one gateway with the same configuration: one host, whose shared data is
/// the gateway's.
fn two_workers(
    extra: &str,
) -> (crate::filter::Filter, crate::filter::Filter, crate::host::fake::FakeHost) {
    let (a, mut host) = setup(&cfg(extra));
    let mut b = crate::filter::Filter::new();
    assert!(b.configure(&mut host, cfg(extra).as_bytes()));
    (a, b, host)
}

#[test]
fn a_breaker_opened_by_one_worker_opens_the_others_at_their_next_tick() {
    let (mut a, mut b, mut host) = two_workers(r#","breakerSlowMs":200"#);
    // Worker b has a pick waiting on the stalled Redis; worker a's picks find the stall and open
    // its breaker.
    b.on_request_headers(&mut host, 101, true);
    let b_calls = host.redis_calls.len();
    for ctx in [7, 9, 11] {
        a.on_request_headers(&mut host, ctx, true);
    }
    host.now += 210 * MS;
    a.on_tick(&mut host);
    assert_eq!(host.counters.get("ai_lb_breaker_opened"), Some(&1));
    // b's next tick follows: its waiting pick is decided at once, not at its own breakerSlowMs,
    // and its next request does not call Redis.
    let resumed = host.resumes;
    host.now += 5 * MS;
    b.on_tick(&mut host);
    assert!(host.logged("breaker open in another worker"));
    assert_eq!(host.resumes, resumed + 1, "b's waiting pick decided at the tick");
    assert_eq!(host.counters.get("ai_lb_breaker_opened"), Some(&1), "only a detected the stall");
    let calls = host.redis_calls.len();
    assert_eq!(b.on_request_headers(&mut host, 103, true), HeaderAction::Continue);
    assert_eq!(host.redis_calls.len(), calls, "b decides without Redis while a's breaker is open");
    assert!(calls > b_calls);
    // After breakerOpenMs b probes on its own; Redis answering closes b's breaker.
    host.now += 1000 * MS;
    b.on_tick(&mut host);
    assert_eq!(command(&host, host.redis_calls.len() - 1), vec!["PING".to_string()]);
    let probe = host.last_redis_token().unwrap();
    b.on_redis_reply(&mut host, probe, &RedisReply::Ok(b"+PONG\r\n".to_vec()), false);
    assert_eq!(b.on_request_headers(&mut host, 105, true), HeaderAction::StopIteration);
    // The shared value is in the past now: b does not open again from it.
    b.on_tick(&mut host);
    let calls = host.redis_calls.len();
    assert_eq!(b.on_request_headers(&mut host, 107, true), HeaderAction::StopIteration);
    assert_eq!(host.redis_calls.len(), calls + 1);
}

#[test]
fn a_request_follows_another_workers_open_breaker_before_its_own_tick() {
    let (mut a, mut b, mut host) = two_workers(r#","breakerSlowMs":200"#);
    a.on_request_headers(&mut host, 7, true);
    host.now += 210 * MS;
    a.on_tick(&mut host);
    assert_eq!(host.counters.get("ai_lb_breaker_opened"), Some(&1));
    // b has had no tick since: its next request reads a's breaker and does not call Redis.
    let calls = host.redis_calls.len();
    assert_eq!(b.on_request_headers(&mut host, 101, true), HeaderAction::Continue);
    assert_eq!(host.redis_calls.len(), calls, "no pick sent into the stall");
    assert_eq!(host.counters.get("ai_lb_fallback_breaker_open"), Some(&1));
    assert!(host.logged("breaker open in another worker"));
}

#[test]
fn a_worker_whose_probe_redis_answers_closes_the_other_workers_breakers() {
    let (mut a, mut b, mut host) = two_workers(r#","breakerSlowMs":200"#);
    // b's pick goes out just before Redis pauses (a failover, a fork); a's finds the pause, and
    // a's breaker sends its probe at once.
    b.on_request_headers(&mut host, 101, true);
    let b_pick = host.last_redis_token().unwrap();
    a.on_request_headers(&mut host, 7, true);
    host.now += 210 * MS;
    a.on_tick(&mut host);
    assert_eq!(host.counters.get("ai_lb_breaker_opened"), Some(&1));
    let a_probe = host.last_redis_token().unwrap();
    let calls = host.redis_calls.len();
    assert_eq!(a.on_request_headers(&mut host, 9, true), HeaderAction::Continue);
    // b's next request follows a's breaker (its first pick still waits).
    assert_eq!(b.on_request_headers(&mut host, 103, true), HeaderAction::Continue);
    assert_eq!(host.redis_calls.len(), calls);
    // The pause ends long before breakerOpenMs. The late answer of b's pick, sent before the
    // breaker opened, closes b's breaker only: it would say as much of a Redis slow enough to open
    // it, where every worker would send its picks into the slowness again.
    host.now += 30 * MS;
    deliver(&mut b, &mut host, b_pick, RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, true, None)));
    assert!(host.logged("redis answers again: breaker closed"));
    assert_eq!(a.on_request_headers(&mut host, 11, true), HeaderAction::Continue);
    assert_eq!(host.redis_calls.len(), calls, "a still waits for its probe");
    // a's probe, queued behind the stalled pick, is answered: a closes and tells b, which had
    // followed again at its next request.
    assert_eq!(b.on_request_headers(&mut host, 105, true), HeaderAction::Continue);
    a.on_redis_reply(&mut host, a_probe, &RedisReply::Ok(b":1\r\n".to_vec()), false);
    assert_eq!(b.on_request_headers(&mut host, 107, true), HeaderAction::StopIteration);
    assert!(host.logged("redis answers another worker of this gateway again: breaker closed"));
    // a's cancel of its stalled pick went out as it closed, then b's pick.
    let sent: Vec<_> = (calls..host.redis_calls.len()).map(|i| command(&host, i)).collect();
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert!(sent[1].contains(&"10.0.0.2:8000".to_string()), "b's pick goes to Redis: {sent:?}");
    // A later stall opens the breakers again as before.
    assert_eq!(a.on_request_headers(&mut host, 13, true), HeaderAction::StopIteration);
    host.now += 210 * MS;
    a.on_tick(&mut host);
    assert_eq!(host.counters.get("ai_lb_breaker_opened"), Some(&2));
    assert_eq!(b.on_request_headers(&mut host, 109, true), HeaderAction::Continue);
}

#[test]
fn a_pick_slower_than_breaker_slow_ms_is_given_up_at_the_next_tick() {
    let (mut f, mut host) = setup(&cfg(r#","breakerSlowMs":200"#));
    assert_eq!(f.tick_period_ms(), 50, "slow picks are noticed within a quarter of breakerSlowMs");
    f.on_request_headers(&mut host, 7, false);
    let t = host.last_redis_token().unwrap();
    host.now += 150 * MS;
    f.on_tick(&mut host);
    assert_eq!(host.resumes, 0, "still within breakerSlowMs");
    host.now += 100 * MS;
    f.on_tick(&mut host);
    // The held stream is made current at each tick, before its policy may give up its pick (a
    // pick given up is decided by the stream's own cluster's metrics) and to resume it.
    assert_eq!(host.effective_streams, vec![7, 7]);
    assert_eq!(host.resumes, 1, "normal balancing");
    assert_eq!(host.override_host, None);
    // Redis answered nothing since the pick went out: a stall, so the breaker opened, its probe
    // went out at once behind the stalled pick, and the pick's cancel waits for Redis to answer.
    assert_eq!(host.counters.get("ai_lb_breaker_opened"), Some(&1));
    assert_eq!(command(&host, host.redis_calls.len() - 1)[0], "EXISTS");
    let probe = host.last_redis_token().unwrap();
    assert!(releases(&host).is_empty());
    // Its late reply changes nothing.
    deliver(&mut f, &mut host, t, RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, true, None)));
    assert_eq!((host.resumes, host.override_host.clone()), (1, None));
    // The probe is answered right after, long before breakerOpenMs: the breaker closes and the
    // cancel goes out; no second probe.
    host.now += 20 * MS;
    f.on_redis_reply(&mut host, probe, &RedisReply::Ok(b":1\r\n".to_vec()), false);
    assert!(host.logged("redis answers again: breaker closed"));
    assert_eq!(releases(&host), vec![release_of(&host, 0, true)], "the pick is cancelled");
    // The stream's end sends nothing more.
    f.on_delete(&mut host, 7);
    assert_eq!(releases(&host).len(), 1);
    host.now += 1000 * MS;
    f.on_tick(&mut host);
    let probes = (0..host.redis_calls.len()).filter(|i| command(&host, *i)[0] == "EXISTS").count();
    assert_eq!(probes, 1);
}

#[test]
fn a_slow_pick_while_redis_answers_others_counts_towards_breaker_failures_only() {
    let (mut f, mut host) = setup(&cfg(r#","breakerSlowMs":200"#));
    f.on_request_headers(&mut host, 7, true);
    // A later pick is answered: Redis is alive, only the first pick is slow (a slow shard, a long
    // script ahead of it), so it alone is given up and the breaker stays closed.
    host.now += 50 * MS;
    request_with_reply(
        &mut f,
        &mut host,
        9,
        RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, true, None)),
    );
    host.now += 160 * MS;
    f.on_tick(&mut host);
    assert_eq!(host.counters.get("ai_lb_fallback_redis_slow"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_breaker_opened"), None, "one failure of breakerFailures");
    let calls = host.redis_calls.len();
    assert_eq!(f.on_request_headers(&mut host, 11, true), HeaderAction::StopIteration);
    assert!(host.redis_calls.len() > calls, "the next request still asks Redis");
}

#[test]
fn leases_are_renewed_every_third_of_the_lease_while_the_route_is_used() {
    let (mut f, mut host) = setup(&cfg(r#","leaseMs":3000"#));
    request_with_reply(
        &mut f,
        &mut host,
        7,
        RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, true, None)),
    );
    let owner = keys_args(&command(&host, 0)).1[2].clone();
    let heartbeats = |host: &crate::host::fake::FakeHost| {
        let sha = crate::redis::sha1_hex_lower(crate::redis::HEARTBEAT_LUA.as_bytes());
        (0..host.redis_calls.len()).filter(|i| command(host, *i)[1] == sha).count()
    };
    host.now += 1000 * MS;
    f.on_tick(&mut host);
    assert_eq!(heartbeats(&host), 1);
    let (keys, args) = keys_args(&command(&host, host.redis_calls.len() - 1));
    assert_eq!(keys, vec![inflight_key("r1", CLUSTER)]);
    assert_eq!(
        args[..4],
        ["3000".to_string(), owner, "3600".into(), "1".into()],
        "lease, owner, cleanInterval s, the requests whose records the VM needs (one in flight)"
    );
    let mut in_cluster = args[4..].to_vec();
    in_cluster.sort();
    assert_eq!(
        in_cluster,
        vec!["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"],
        "the cleanup keeps every host still in the cluster, healthy or not"
    );
    f.on_tick(&mut host);
    assert_eq!(heartbeats(&host), 1, "every third of the lease");
    f.on_delete(&mut host, 7);
    host.now += 1000 * MS;
    f.on_tick(&mut host);
    assert_eq!(heartbeats(&host), 2, "still used recently: keeps reaping dead owners");
    host.now += 601_000 * MS;
    f.on_tick(&mut host);
    assert_eq!(heartbeats(&host), 2, "idle for 10 minutes and nothing held: no more heartbeats");
}

#[test]
fn releases_wait_while_the_breaker_is_open_and_go_out_when_it_closes() {
    let (mut f, mut host) = setup(&cfg(r#","breakerFailures":1"#));
    request_with_reply(
        &mut f,
        &mut host,
        7,
        RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, true, None)),
    );
    request_with_reply(&mut f, &mut host, 9, RedisReply::NetworkError);
    f.on_delete(&mut host, 7);
    assert_eq!(releases(&host), vec![], "the breaker is open: the cancel and the -1 wait");
    // The tick probes Redis after breakerOpenMs (no request needed); its answer sends the -1.
    host.now += 1000 * MS;
    f.on_tick(&mut host);
    let probe = host.last_redis_token().unwrap();
    assert_eq!(command(&host, host.redis_calls.len() - 1)[0], "EXISTS");
    f.on_redis_reply(&mut host, probe, &RedisReply::Ok(b":1\r\n".to_vec()), false);
    // The -1 that waited for a pick to carry it goes out as the breaker closes, then the cancel.
    assert_eq!(releases(&host), vec![release_of(&host, 0, false), release_of(&host, 1, true)]);
}

/// Admits request `ctx` on `pod`; returns the index of its pick among the Redis calls.
fn admit(
    f: &mut crate::filter::Filter,
    host: &mut crate::host::fake::FakeHost,
    ctx: u32,
    pod: &str,
) -> usize {
    let n = host.redis_calls.len();
    request_with_reply(f, host, ctx, RedisReply::Ok(pick_reply(pod, 1, true, None)));
    n
}

#[test]
fn a_release_rides_on_the_next_pick_while_other_requests_are_in_flight() {
    let (mut f, mut host) = setup(&cfg(""));
    let p7 = admit(&mut f, &mut host, 7, "10.0.0.1:8000");
    let p9 = admit(&mut f, &mut host, 9, "10.0.0.2:8000");
    f.on_delete(&mut host, 7);
    assert_eq!(releases(&host), vec![], "9 is still in flight: 7's -1 waits for the next pick");
    let calls = host.redis_calls.len();
    let p11 = admit(&mut f, &mut host, 11, "10.0.0.1:8000");
    assert_eq!(host.redis_calls.len(), calls + 1, "one call: the pick");
    let (_, args) = keys_args(&command(&host, p11));
    assert_eq!(args[3], format!("{},1=10.0.0.1:8000", release_of(&host, p11, false).request));
    assert_eq!(releases(&host), vec![release_of(&host, p7, false)], "carried by 11's pick");
    // 9 ends with 11 in flight: waits; 11 is the last one in flight: both go out at once.
    f.on_delete(&mut host, 9);
    assert_eq!(releases(&host).len(), 1);
    f.on_delete(&mut host, 11);
    assert_eq!(
        releases(&host),
        vec![
            release_of(&host, p7, false),
            release_of(&host, p9, false),
            release_of(&host, p11, false)
        ]
    );
    assert_eq!(host.redis_calls.len(), calls + 2, "in one release call");
}

#[test]
fn a_release_no_pick_carries_goes_out_on_the_next_tick() {
    let (mut f, mut host) = setup(&cfg(""));
    let p7 = admit(&mut f, &mut host, 7, "10.0.0.1:8000");
    admit(&mut f, &mut host, 9, "10.0.0.2:8000");
    f.on_delete(&mut host, 7);
    assert!(f.tick_period_ms() <= crate::policy::picker::CARRY_FLUSH_MS);
    host.now += u64::from(f.tick_period_ms()) * MS;
    f.on_tick(&mut host);
    assert_eq!(releases(&host), vec![release_of(&host, p7, false)]);
}

#[test]
fn a_request_routed_before_a_reconfigure_is_released_on_the_next_tick() {
    let (mut f, mut host) = setup(&cfg(""));
    let p7 = admit(&mut f, &mut host, 7, "10.0.0.1:8000");
    admit(&mut f, &mut host, 9, "10.0.0.2:8000");
    // A new configuration (its own policy and owner) while 7 and 9 are in flight.
    assert!(f.configure(&mut host, cfg(r#","maxRequestCount":50"#).as_bytes()));
    f.on_delete(&mut host, 7);
    host.now += u64::from(f.tick_period_ms()) * MS;
    f.on_tick(&mut host);
    assert_eq!(releases(&host), vec![release_of(&host, p7, false)]);
}

#[test]
fn each_pick_is_logged_at_debug_level_unless_enable_detail_log_is_false() {
    let pick_lines = |host: &crate::host::fake::FakeHost| -> Vec<crate::types::LogLevel> {
        let logs = host.logs.borrow();
        logs.iter().filter(|(_, m)| m.contains("host=10.0.0.1:8000")).map(|(l, _)| *l).collect()
    };
    let (mut f, mut host) = setup(&cfg(""));
    admit(&mut f, &mut host, 7, "10.0.0.1:8000");
    assert_eq!(pick_lines(&host), vec![crate::types::LogLevel::Debug]);
    let (mut f, mut host) = setup(&cfg(r#","enableDetailLog":false"#));
    admit(&mut f, &mut host, 7, "10.0.0.1:8000");
    assert_eq!(pick_lines(&host), vec![]);
}

#[test]
fn releases_carried_by_a_pick_that_may_not_have_run_are_sent_again() {
    let (mut f, mut host) = setup(&cfg(""));
    let p7 = admit(&mut f, &mut host, 7, "10.0.0.1:8000");
    admit(&mut f, &mut host, 9, "10.0.0.2:8000");
    f.on_delete(&mut host, 7);
    // 11's pick carries 7's -1 and is lost (a timeout: it may or may not have run).
    let p11 = host.redis_calls.len();
    request_with_reply(&mut f, &mut host, 11, RedisReply::NetworkError);
    assert_eq!(releases(&host), vec![release_of(&host, p7, false), release_of(&host, p11, true)]);
    // The next pick carries it again (a release is idempotent per pick record).
    let p13 = admit(&mut f, &mut host, 13, "10.0.0.3:8000");
    let (_, args) = keys_args(&command(&host, p13));
    assert!(args[3].ends_with(",1=10.0.0.1:8000"), "{args:?}");
    assert_eq!(releases(&host).iter().filter(|r| **r == release_of(&host, p7, false)).count(), 2);
}

#[test]
fn without_redis_requests_go_to_the_least_loaded_pod_by_its_metrics() {
    let (mut f, mut host) = setup(&cfg(r#","decisionHeader":"X-AI-LB-Decision""#));
    // .1 is queueing with a full KV cache; .2 has room.
    set_hosts_with_metrics(&mut host, vllm_metrics(30, 12, 0.97), vllm_metrics(4, 0, 0.2));
    // A Redis timeout: routed by metrics, not round robin.
    request_with_reply(&mut f, &mut host, 7, RedisReply::NetworkError);
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.2:8000"));
    assert_eq!(host.resumes, 1);
    assert_eq!(host.counters.get("ai_lb_fallback_redis_timeout"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_redis_down_routed_by_metrics"), Some(&1));
    f.on_response_headers(&mut host, 7);
    assert_eq!(
        host.response_headers_set,
        vec![("x-ai-lb-decision".to_string(), "fallback_redis_timeout; by=metrics".to_string())]
    );
    f.on_delete(&mut host, 7);
    // An error reply (e.g. a script error) too.
    host.override_host = None;
    request_with_reply(&mut f, &mut host, 9, RedisReply::Ok(b"-ERR boom\r\n".to_vec()));
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.2:8000"));
    assert_eq!(host.counters.get("ai_lb_fallback_redis_error"), Some(&1));
    f.on_delete(&mut host, 9);
    // An error reply shows Redis answers; three timeouts in a row open the breaker. Open, requests
    // are routed by metrics at once.
    for ctx in [11, 13, 15] {
        request_with_reply(&mut f, &mut host, ctx, RedisReply::NetworkError);
        f.on_delete(&mut host, ctx);
    }
    host.override_host = None;
    let calls = host.redis_calls.len();
    assert_eq!(f.on_request_headers(&mut host, 17, true), HeaderAction::Continue);
    assert_eq!(host.redis_calls.len(), calls, "no Redis call while the breaker is open");
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.2:8000"));
    assert_eq!(host.counters.get("ai_lb_fallback_breaker_open"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_redis_down_routed_by_metrics"), Some(&6));
}

#[test]
fn without_redis_or_metrics_requests_take_normal_balancing() {
    let (mut f, mut host) = setup(&cfg(r#","decisionHeader":"x-lb""#));
    request_with_reply(&mut f, &mut host, 7, RedisReply::NetworkError);
    assert_eq!(host.override_host, None, "no metrics: the gateway balances");
    assert_eq!(host.resumes, 1);
    assert_eq!(host.counters.get("ai_lb_redis_down_routed_by_metrics"), None);
    assert!(host.logged("redis network error or timeout; using normal balancing"));
    f.on_response_headers(&mut host, 7);
    assert_eq!(
        host.response_headers_set,
        vec![("x-lb".to_string(), "fallback_redis_timeout".to_string())]
    );
}

#[test]
fn routed_requests_are_counted_and_the_decision_header_is_off_by_default() {
    let (mut f, mut host) = setup(&cfg(""));
    request_with_reply(
        &mut f,
        &mut host,
        7,
        RedisReply::Ok(pick_reply("10.0.0.2:8000", 1, true, None)),
    );
    assert_eq!(host.counters.get("ai_lb_least_request_routed"), Some(&1));
    f.on_response_headers(&mut host, 7);
    assert!(host.response_headers_set.is_empty());
}

#[test]
fn a_pick_in_flight_is_cancelled_even_after_its_idle_group_was_dropped() {
    // No slow-pick deadline: the pick waits; the heartbeat tick drops groups idle for 10 minutes.
    let (mut f, mut host) = setup(&cfg(r#","breakerSlowMs":0"#));
    let p7 = host.redis_calls.len();
    f.on_request_headers(&mut host, 7, true);
    host.now += 601_000 * MS;
    f.on_tick(&mut host);
    f.on_delete(&mut host, 7);
    assert_eq!(releases(&host), vec![release_of(&host, p7, true)]);
}
