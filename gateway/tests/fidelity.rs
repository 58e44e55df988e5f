//! Fidelity tests of the gateway host against small purpose-built WAT plugins, real HTTP upstreams
//! and Redis (a fake RESP server, and a real `redis-server` when one is on PATH).

mod common;

use common::*;
use std::time::{Duration, Instant};

fn pairs(p: &[(&str, &str)]) -> Vec<u8> {
    let v: Vec<(String, Vec<u8>)> =
        p.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())).collect();
    gateway::abi::marshal_pairs(&v)
}

fn idx(ev: &[String], prefix: &str) -> Option<usize> {
    ev.iter().position(|e| e.starts_with(prefix))
}

/// A plugin that pauses in request headers and continues from an HTTP callout response.
/// Its body callback buffers until the request has been continued.
fn pause_plugin(marker: &str) -> String {
    let mut w = Wat::new();
    let hdrs = w.b(&pairs(&[(":method", "GET"), (":path", "/slow"), (":authority", "up")]));
    let body = format!(
        r#"
  (global $stream (mut i32) (i32.const 0))
  (global $continued (mut i32) (i32.const 0))
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (global.set $stream (local.get $ctx))
    (global.set $continued (i32.const 0))
    (call $ev_start {ev_hdrs}) (call $ev_num (local.get $eos)) (call $ev_end)
    (drop (call $proxy_http_call {up} {hdrs} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 5000) (i32.const 264)))
    (i32.const 1))
  (func (export "proxy_on_request_body") (param $ctx i32) (param $size i32) (param $eos i32) (result i32)
    (call $ev_start {ev_body}) (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $ev_end)
    (if (result i32) (global.get $continued) (then (i32.const 0)) (else (i32.const 1))))
  (func (export "proxy_on_http_call_response") (param $root i32) (param $token i32) (param $nh i32) (param $nb i32) (param $nt i32)
    (call $ev_start {ev_callout}) (call $ev_num (local.get $token)) (call $ev_num (local.get $nb)) (call $ev_end)
    (drop (call $proxy_set_effective_context (global.get $stream)))
    (global.set $continued (i32.const 1))
    (drop (call $proxy_continue_stream (i32.const 0))))
"#,
        ev_hdrs = w.s("hdrs"),
        ev_body = w.s("body"),
        ev_callout = w.s("callout"),
        up = w.s("up"),
        hdrs = hdrs,
    );
    w.module(marker, &body)
}

async fn run_pause(marker: &str) -> (Vec<String>, Upstream) {
    let up = Upstream::start().await;
    let cfg = one_cluster_config(
        &format!("\"{}\"", up.addr),
        true,
        &format!("  - name: up\n    endpoints: [\"{}\"]\n", up.addr),
    );
    let gw = Gateway::start(&cfg, Some(&pause_plugin(marker)), 1);
    let r = post_chunks(
        &gw.url("/v1/chat"),
        &[],
        &["aaaaa", "bbbbb", "ccccc"],
        Duration::from_millis(100),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let ev = gw
        .wait_events(
            |e| {
                idx(e, "callout").is_some()
                    && e.iter().any(|x| x.ends_with(" 1") && x.starts_with("body"))
            },
            "body eos",
        )
        .await;
    let posted: Vec<_> = up.requests().into_iter().filter(|r| r.path == "/v1/chat").collect();
    assert_eq!(posted.len(), 1);
    assert_eq!(&posted[0].body[..], b"aaaaabbbbbccccc", "the upstream gets the whole body once");
    assert_eq!(up.count("/slow"), 1, "the callout went to the `up` cluster");
    (ev, up)
}

#[tokio::test(flavor = "multi_thread")]
async fn abi_0_2_1_pause_in_headers_hides_body_until_continue() {
    let (ev, _up) = run_pause("0_2_1").await;
    let callout = idx(&ev, "callout").unwrap();
    let first_body = idx(&ev, "body").unwrap();
    assert!(first_body > callout, "0_2_1: no body callback before the headers continue: {ev:?}");
    // The buffered body is replayed once, whole, after the continue.
    let bodies: Vec<_> = ev.iter().filter(|e| e.starts_with("body")).collect();
    assert_eq!(bodies, vec!["body 15 1"], "{ev:?}");
    assert_eq!(ev[0], "hdrs 0");
}

#[tokio::test(flavor = "multi_thread")]
async fn abi_0_2_100_pause_in_headers_still_sees_body_chunks() {
    let (ev, _up) = run_pause("0_2_100").await;
    let callout = idx(&ev, "callout").unwrap();
    let bodies: Vec<(usize, u32, u32)> = ev
        .iter()
        .enumerate()
        .filter(|(_, e)| e.starts_with("body"))
        .map(|(i, e)| {
            let p: Vec<&str> = e.split(' ').collect();
            (i, p[1].parse().unwrap(), p[2].parse().unwrap())
        })
        .collect();
    assert!(bodies.len() >= 3, "several body callbacks (one per chunk): {ev:?}");
    assert!(
        bodies.iter().all(|(i, _, _)| *i < callout),
        "all body callbacks before the continue: {ev:?}"
    );
    // Cumulative sizes: 5, 10, 15 ... and the last one carries end_of_stream.
    assert_eq!(bodies[0].1, 5, "{ev:?}");
    assert!(bodies.windows(2).all(|w| w[1].1 >= w[0].1), "cumulative sizes: {ev:?}");
    let last = bodies.last().unwrap();
    assert_eq!((last.1, last.2), (15, 1), "{ev:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn local_reply_in_headers_stops_the_request_and_passes_response_callbacks() {
    let up = Upstream::start().await;
    let mut w = Wat::new();
    let body = format!(
        r#"
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (drop (call $proxy_send_local_response (i32.const 403) {details} {text} (i32.const 0) (i32.const 0) (i32.const -1)))
    (call $ev_start {ev_second}) (call $ev_num (call $proxy_send_local_response (i32.const 401) {details} {text} (i32.const 0) (i32.const 0) (i32.const -1))) (call $ev_end)
    (call $ev_start {ev_grpc}) (call $ev_num (call $proxy_grpc_call (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0))) (call $ev_end)
    (i32.const 0))
  (func (export "proxy_on_response_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (call $ev_start {ev_resp}) (call $ev_end)
    (drop (call $proxy_add_header_map_value (i32.const 2) {hk} {hv}))
    (i32.const 0))
"#,
        details = w.s("denied_by_test"),
        text = w.s("blocked"),
        ev_second = w.s("second"),
        ev_grpc = w.s("grpc"),
        ev_resp = w.s("resp_hdrs"),
        hk = w.s("x-seen-by-plugin"),
        hv = w.s("yes"),
    );
    let gw = Gateway::start(
        &one_cluster_config(&format!("\"{}\"", up.addr), true, ""),
        Some(&w.module("0_2_100", &body)),
        1,
    );
    let r = get(&gw.url("/x"), &[]).await;
    assert_eq!(r.status, 403);
    assert_eq!(r.text(), "blocked");
    assert_eq!(
        r.header("x-seen-by-plugin").as_deref(),
        Some("yes"),
        "local replies pass the plugin's response callbacks"
    );
    assert_eq!(up.requests().len(), 0, "a request answered locally never reaches the upstream");
    let ev = gw.wait_events(|e| idx(e, "resp_hdrs").is_some(), "resp_hdrs").await;
    assert!(
        ev.contains(&"second 0".to_string()),
        "a second local response is Ok and changes nothing (Envoy 1.40): {ev:?}"
    );
    assert!(
        ev.contains(&"grpc 12".to_string()),
        "unimplemented hostcalls link and return Unimplemented: {ev:?}"
    );
}

/// Envoy `Context::continueStream`: the continue runs after the callback returns, but the
/// request headers stop being accessible inside the hostcall (conformance scenario
/// `continue_stream_ends_header_and_body_access` checks the same against Envoy 1.40).
#[tokio::test(flavor = "multi_thread")]
async fn continue_ends_request_header_access_at_once() {
    let up = Upstream::start().await;
    let mut w = Wat::new();
    let body = format!(
        r#"
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (drop (call $proxy_continue_stream (i32.const 0)))
    ;; still inside the call, but the headers are no longer the plugin's
    (call $ev_start {ev_add}) (call $ev_num (call $proxy_add_header_map_value (i32.const 0) {hk} {hv})) (call $ev_end)
    (i32.const 1))
  (func (export "proxy_on_response_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (call $ev_start {ev_after}) (call $ev_num (call $proxy_get_header_map_value (i32.const 0) {path} (i32.const 256) (i32.const 260))) (call $ev_end)
    (i32.const 0))
"#,
        ev_add = w.s("add"),
        hk = w.s("x-after-continue"),
        hv = w.s("1"),
        ev_after = w.s("req_hdr_after_continue"),
        path = w.s(":path"),
    );
    let gw = Gateway::start(
        &one_cluster_config(&format!("\"{}\"", up.addr), true, ""),
        Some(&w.module("0_2_100", &body)),
        1,
    );
    let r = get(&gw.url("/deferred"), &[]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let reqs = up.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].headers.get("x-after-continue"), None, "a header added after continue");
    let ev = gw.wait_events(|e| idx(e, "req_hdr_after_continue").is_some(), "response").await;
    assert!(ev.contains(&"add 2".to_string()), "BadArgument after continue_stream: {ev:?}");
    assert!(
        ev.contains(&"req_hdr_after_continue 2".to_string()),
        "request headers are not available (BadArgument) in the response phase: {ev:?}"
    );
}

fn override_plugin() -> String {
    let mut w = Wat::new();
    let body = format!(
        r#"
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (if (i32.eqz (call $proxy_get_header_map_value (i32.const 0) {hk} (i32.const 256) (i32.const 260)))
      (then (drop (call $proxy_set_upstream_override_host (i32.load (i32.const 256)) (i32.load (i32.const 260))))))
    (i32.const 0))
"#,
        hk = w.s("x-target"),
    );
    w.module("0_2_100", &body)
}

#[tokio::test(flavor = "multi_thread")]
async fn override_host_is_honoured_and_non_strict() {
    let (u1, u2) = (Upstream::start().await, Upstream::start().await);
    let eps = format!("\"{}\", \"{}\"", u1.addr, u2.addr);
    let gw = Gateway::start(&one_cluster_config(&eps, true, ""), Some(&override_plugin()), 2);
    let target = u2.addr.to_string();
    for _ in 0..6 {
        let r = get(&gw.url("/o"), &[("x-target", &target)]).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-gateway-upstream-host"), Some(target.clone()));
    }
    // Unknown host: normal balancing (round robin reaches both).
    let mut seen = std::collections::HashSet::new();
    for _ in 0..8 {
        let r = get(&gw.url("/o"), &[("x-target", "127.0.0.1:1")]).await;
        assert_eq!(r.status, 200);
        seen.insert(r.header("x-gateway-upstream-host").unwrap());
    }
    assert_eq!(seen.len(), 2, "unknown override host falls back to round robin: {seen:?}");
    // Degraded host: still taken (Envoy's default `override_host_status` is UNKNOWN, HEALTHY,
    // DEGRADED), although the LB itself would avoid it while a healthy host is left.
    let r = request(
        "POST",
        &gw.admin_url("/clusters/pods/health"),
        &[],
        &format!("{{\"{target}\": \"Degraded\"}}"),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    for _ in 0..4 {
        let r = get(&gw.url("/o"), &[("x-target", &target)]).await;
        assert_eq!(r.header("x-gateway-upstream-host"), Some(target.clone()));
        let r = get(&gw.url("/o"), &[]).await;
        assert_eq!(r.header("x-gateway-upstream-host"), Some(u1.addr.to_string()));
    }
    // Unhealthy host: normal balancing over the healthy ones.
    let r = request(
        "POST",
        &gw.admin_url("/clusters/pods/health"),
        &[],
        &format!("{{\"{target}\": \"Unhealthy\"}}"),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    for _ in 0..4 {
        let r = get(&gw.url("/o"), &[("x-target", &target)]).await;
        assert_eq!(r.header("x-gateway-upstream-host"), Some(u1.addr.to_string()));
    }
}

/// Higress's defaults, without the test fixtures' route entry: no response names the upstream
/// (Envoy adds no such header of its own), and the upstream gets the forwarding headers Higress's
/// listeners add. With `xff_num_trusted_hops: 1` the client is the last `x-forwarded-for` entry.
#[tokio::test(flavor = "multi_thread")]
async fn higress_defaults_name_no_upstream_and_forward_the_client() {
    let u = Upstream::start().await;
    let cfg = one_cluster_config(&format!("\"{}\"", u.addr), false, "");
    let gw = Gateway::start(&format!("response_headers_to_add: []\n{cfg}"), None, 1);
    let r =
        get(&gw.url("/p"), &[("x-forwarded-for", "203.0.113.9"), ("x-request-id", "mine")]).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-gateway-upstream-host"), None);
    let got = &u.requests()[0].headers;
    let h = |k: &str| got.get(k).and_then(|v| v.to_str().ok()).map(str::to_string);
    let xff = h("x-forwarded-for").unwrap_or_default();
    assert!(xff.starts_with("203.0.113.9,") && xff.len() > 12, "{xff}");
    assert_eq!(h("x-forwarded-proto").as_deref(), Some("http"));
    assert_eq!(h("x-envoy-external-address").as_deref(), Some("127.0.0.1"));
    let id = h("x-request-id").unwrap_or_default();
    assert!(id != "mine" && id.len() == 36, "{id}");
    // The route's timeout (5000 ms in this config) goes upstream.
    assert_eq!(h("x-envoy-expected-rq-timeout-ms").as_deref(), Some("5000"));

    let trusting = cfg.replace(
        "listeners: [{name: main, address: 127.0.0.1:0}]",
        "listeners: [{name: main, address: 127.0.0.1:0, xff_num_trusted_hops: 1}]",
    );
    assert_ne!(trusting, cfg);
    let gw = Gateway::start(&trusting, None, 1);
    let r = get(&gw.url("/p"), &[("x-forwarded-for", "198.51.100.7, 203.0.113.9")]).await;
    assert_eq!(r.status, 200);
    let got = &u.requests()[1].headers;
    assert_eq!(
        got.get("x-envoy-external-address").and_then(|v| v.to_str().ok()),
        Some("203.0.113.9"),
        "the client named by the trusted proxy"
    );
}

/// A value Envoy's formatter would need but this host does not know fails the start, naming the
/// entry.
#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_response_header_command_fails_the_start() {
    let u = Upstream::start().await;
    let cfg = one_cluster_config(&format!("\"{}\"", u.addr), false, "");
    let bad = format!(
        "response_headers_to_add: [{{header: {{key: x-t, value: \"%START_TIME%\"}}}}]\n{cfg}"
    );
    let err = Gateway::try_start(&bad, None, 1).err().unwrap_or_default();
    assert!(err.contains("response_headers_to_add[0].header.value"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn plain_proxy_round_robin_and_admin_endpoints() {
    let (u1, u2) = (Upstream::start().await, Upstream::start().await);
    let eps = format!("\"{}\", \"{}\"", u1.addr, u2.addr);
    let gw = Gateway::start(&one_cluster_config(&eps, false, ""), None, 2);
    for _ in 0..4 {
        let r =
            request("POST", &gw.url("/p"), &[("content-type", "application/json")], "{\"x\":1}")
                .await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(u1.count("/p"), 2);
    assert_eq!(u2.count("/p"), 2);
    assert_eq!(&u1.requests()[0].body[..], b"{\"x\":1}");
    // Replace the endpoint set at run time.
    let r = request(
        "POST",
        &gw.admin_url("/clusters/pods/endpoints"),
        &[],
        &format!("[\"{}\"]", u2.addr),
    )
    .await;
    assert_eq!(r.status, 200);
    for _ in 0..3 {
        assert_eq!(
            get(&gw.url("/p"), &[]).await.header("x-gateway-upstream-host"),
            Some(u2.addr.to_string())
        );
    }
    let stats = get(&gw.admin_url("/stats"), &[]).await.text();
    assert!(stats.contains("gateway_requests_total 7"), "{stats}");
    assert!(
        stats.contains(&format!(
            "gateway_upstream_requests_total{{cluster=\"pods\",host=\"{}\"}} 5",
            u2.addr
        )),
        "{stats}"
    );
    let clusters: serde_json::Value =
        serde_json::from_slice(&get(&gw.admin_url("/clusters"), &[]).await.body).unwrap();
    assert_eq!(clusters[0]["endpoints"].as_array().unwrap().len(), 1);
    assert_eq!(get(&gw.admin_url("/ready"), &[]).await.status, 200);
    // No endpoint reachable: 503 local reply.
    let r =
        request("POST", &gw.admin_url("/clusters/pods/endpoints"), &[], "[\"127.0.0.1:1\"]").await;
    assert_eq!(r.status, 200);
    assert_eq!(get(&gw.url("/p"), &[]).await.status, 503);
}

fn redis_config(up: &Upstream, redis_addr: &str) -> String {
    one_cluster_config(
        &format!("\"{}\"", up.addr),
        true,
        &format!("  - name: outbound|6379||redis.static\n    endpoints: [\"{redis_addr}\"]\n"),
    )
}

const CLUSTER: &str = "outbound|6379||redis.static";

/// A fake Redis that records the commands it receives and answers PING/AUTH/SELECT/others.
async fn fake_redis() -> (std::net::SocketAddr, std::sync::Arc<std::sync::Mutex<Vec<Vec<String>>>>)
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let s2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else { continue };
            let seen = s2.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut tmp = [0u8; 4096];
                loop {
                    let n = match s.read(&mut tmp).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    buf.extend_from_slice(&tmp[..n]);
                    while let Ok(Some((frame, used))) = redis_protocol::resp2::decode::decode(&buf)
                    {
                        buf.drain(..used);
                        let args = command_args(frame);
                        seen.lock().unwrap().push(args.clone());
                        let reply: &[u8] =
                            match args.first().map(|a| a.to_ascii_uppercase()).as_deref() {
                                Some("PING") => b"+PONG\r\n",
                                Some("AUTH") | Some("SELECT") => b"+OK\r\n",
                                Some("MGET") => b"*2\r\n$1\r\na\r\n$-1\r\n",
                                _ => b"$5\r\nhello\r\n",
                            };
                        if s.write_all(reply).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, seen)
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_auth_select_pipelining_and_raw_replies() {
    let up = Upstream::start().await;
    let (addr, seen) = fake_redis().await;
    let gw = Gateway::start(&redis_config(&up, &addr.to_string()), Some(&redis_plugin()), 1);
    let r = request("POST", &gw.url("/r"), &[("x-cluster", CLUSTER)], &resp(&["PING"])).await;
    assert_eq!((r.status, r.text().as_str()), (200, "+PONG\r\n"));
    // An array reply with a nil element is one reply (framed whole).
    let r = request(
        "POST",
        &gw.url("/r"),
        &[("x-cluster", &format!("{CLUSTER}?db=1"))],
        &resp(&["MGET", "a", "b"]),
    )
    .await;
    assert_eq!((r.status, r.text().as_str()), (200, "*2\r\n$1\r\na\r\n$-1\r\n"));
    let cmds = seen.lock().unwrap().clone();
    assert_eq!(cmds[0], vec!["AUTH", "secret"], "AUTH first on a new connection: {cmds:?}");
    assert_eq!(cmds[1], vec!["SELECT", "1"], "then SELECT db: {cmds:?}");
    assert_eq!(cmds[2], vec!["PING"]);
    assert_eq!(cmds.len(), 4, "one connection, AUTH/SELECT once: {cmds:?}");
    let ev = gw
        .wait_events(
            |e| e.iter().filter(|x| x.starts_with("redis")).count() >= 2,
            "two redis callbacks",
        )
        .await;
    assert!(ev.contains(&"init 0".to_string()), "{ev:?}");
    assert!(
        ev.contains(&"redis 7 0 7".to_string()),
        "first token 7, status Ok, size of +PONG: {ev:?}"
    );
    assert!(ev.iter().any(|e| e.starts_with("redis 11 0 ")), "tokens step by 4: {ev:?}");
    // Unknown cluster: BadArgument at once.
    let r = request(
        "POST",
        &gw.url("/r"),
        &[("x-cluster", "outbound|1||nope.static")],
        &resp(&["PING"]),
    )
    .await;
    assert_eq!(r.status, 592, "BadArgument (2) surfaced by the plugin");
}

/// An ordinary cluster of two Redis servers: Higress's Redis client asks the cluster's load
/// balancer for a host per command (`AsyncClientImpl::send`), so round robin alternates them, each
/// over its own connection (AUTH and SELECT once per server), not every command to the first.
#[tokio::test(flavor = "multi_thread")]
async fn an_ordinary_redis_cluster_of_two_servers_gets_the_commands_by_round_robin() {
    let up = Upstream::start().await;
    let (a, seen_a) = fake_redis().await;
    let (b, seen_b) = fake_redis().await;
    let config = one_cluster_config(
        &format!("\"{}\"", up.addr),
        true,
        &format!("  - name: {CLUSTER}\n    endpoints: [\"{a}\", \"{b}\"]\n"),
    );
    let gw = Gateway::start(&config, Some(&redis_plugin()), 1);
    for _ in 0..6 {
        let r = request("POST", &gw.url("/r"), &[("x-cluster", CLUSTER)], &resp(&["PING"])).await;
        assert_eq!((r.status, r.text().as_str()), (200, "+PONG\r\n"));
    }
    for (server, seen) in [(a, seen_a), (b, seen_b)] {
        let cmds = seen.lock().unwrap().clone();
        let pings = cmds.iter().filter(|c| c[0] == "PING").count();
        assert_eq!(pings, 3, "{server}: every other command: {cmds:?}");
        let auths = cmds.iter().filter(|c| c[0] == "AUTH").count();
        assert_eq!(auths, 1, "{server}: one connection, opened once: {cmds:?}");
        assert_eq!(cmds[..2], [vec!["AUTH", "secret"], vec!["SELECT", "1"]], "{server}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_down_gives_network_error() {
    let up = Upstream::start().await;
    // A port nobody listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let gw = Gateway::start(&redis_config(&up, &closed.to_string()), Some(&redis_plugin()), 1);
    let t = Instant::now();
    let r = request("POST", &gw.url("/r"), &[("x-cluster", CLUSTER)], &resp(&["PING"])).await;
    assert_eq!(r.status, 503, "callback status 1 (NetworkError)");
    assert!(t.elapsed() < Duration::from_secs(5));
    let ev = gw.wait_events(|e| idx(e, "redis").is_some(), "redis").await;
    assert!(ev.contains(&"redis 7 1 0".to_string()), "NetworkError with size 0: {ev:?}");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_real_server_set_get_in_selected_db() {
    let Ok(path) = which("redis-server") else {
        // build.sh installs redis-server: in CI its absence is a failure, not a skip.
        assert!(std::env::var_os("CI").is_none(), "CI=true but redis-server is not on PATH");
        eprintln!("redis-server not on PATH: skipping the real-Redis test (the fake-Redis test covers the protocol)");
        return;
    };
    let port = free_port();
    let mut child = std::process::Command::new(path)
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let addr = format!("127.0.0.1:{port}");
    for _ in 0..100 {
        if std::net::TcpStream::connect(&addr).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let up = Upstream::start().await;
    let gw = Gateway::start(&redis_config(&up, &addr), Some(&redis_plugin()), 2);
    let r =
        request("POST", &gw.url("/r"), &[("x-cluster", CLUSTER)], &resp(&["SET", "gwkey", "v1"]))
            .await;
    assert_eq!((r.status, r.text().as_str()), (200, "+OK\r\n"));
    let r =
        request("POST", &gw.url("/r"), &[("x-cluster", CLUSTER)], &resp(&["GET", "gwkey"])).await;
    assert_eq!((r.status, r.text().as_str()), (200, "$2\r\nv1\r\n"));
    let r = request("POST", &gw.url("/r"), &[("x-cluster", CLUSTER)], &resp(&["NOSUCHCMD"])).await;
    assert_eq!(r.status, 200, "an error reply is status Ok");
    assert!(r.text().starts_with("-ERR"), "{}", r.text());
    // The key went to db 1 (SELECT on connect), not db 0.
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.write_all(
        format!("{}{}{}", resp(&["GET", "gwkey"]), resp(&["SELECT", "1"]), resp(&["GET", "gwkey"]))
            .as_bytes(),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mut buf = [0u8; 256];
    let n = s.read(&mut buf).unwrap();
    assert_eq!(String::from_utf8_lossy(&buf[..n]), "$-1\r\n+OK\r\n$2\r\nv1\r\n");
    let _ = child.kill();
    let _ = child.wait();
}

fn which(name: &str) -> Result<std::path::PathBuf, ()> {
    std::env::var_os("PATH")
        .and_then(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|p| p.is_file()))
        .ok_or(())
}

#[tokio::test(flavor = "multi_thread")]
async fn shared_data_cas_is_shared_across_workers() {
    let up = Upstream::start().await;
    let mut w = Wat::new();
    let body = format!(
        r#"
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (local $r i32) (local $val i32) (local $cas i32)
    (loop $retry
      (local.set $r (call $proxy_get_shared_data {key} (i32.const 256) (i32.const 260) (i32.const 264)))
      (if (i32.eq (local.get $r) (i32.const 1))
        (then (local.set $val (i32.const 0)) (local.set $cas (i32.const 0)))
        (else (local.set $val (i32.load (i32.load (i32.const 256)))) (local.set $cas (i32.load (i32.const 264)))))
      (i32.store (i32.const 600) (i32.add (local.get $val) (i32.const 1)))
      (local.set $r (call $proxy_set_shared_data {key} (i32.const 600) (i32.const 4) (local.get $cas)))
      (br_if $retry (i32.eq (local.get $r) (i32.const 8))))
    (call $ev_start {ev_cnt}) (call $ev_num (i32.load (i32.const 600))) (call $ev_end)
    ;; a stale CAS must fail now (the value has moved on); use cas+0 when it was 0 (never stale)
    (if (local.get $cas)
      (then (call $ev_start {ev_stale}) (call $ev_num (call $proxy_set_shared_data {key} (i32.const 600) (i32.const 4) (local.get $cas))) (call $ev_end)))
    (i32.const 0))
"#,
        key = w.s("cnt"),
        ev_cnt = w.s("cnt"),
        ev_stale = w.s("stale"),
    );
    let gw = Gateway::start(
        &one_cluster_config(&format!("\"{}\"", up.addr), true, ""),
        Some(&w.module("0_2_100", &body)),
        2,
    );
    let n = 41;
    // The first increment goes alone: on a missing key there is no CAS to compare (the module
    // passes 0, and Envoy's `SharedData::set` stores a new key whatever the CAS), so two workers
    // creating the key at once would both write 1, in Envoy as here.
    let get = |url: String| async move {
        let req = hyper::Request::get(&url)
            .header("connection", "close")
            .body(gateway::body::GwBody::full(bytes::Bytes::new()))
            .unwrap();
        let r = client().request(req).await.unwrap();
        assert_eq!(r.status(), 200);
    };
    get(gw.url("/c")).await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let url = gw.url("/c");
        tasks.push(tokio::spawn(async move {
            for _ in 0..((n - 1) / 8) {
                get(url.clone()).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let ev = gw
        .wait_events(|e| e.iter().filter(|x| x.starts_with("cnt")).count() == n, "all counts")
        .await;
    let mut counts: Vec<u32> =
        ev.iter().filter_map(|e| e.strip_prefix("cnt ")).map(|x| x.parse().unwrap()).collect();
    counts.sort();
    assert_eq!(
        counts,
        (1..=n as u32).collect::<Vec<_>>(),
        "every increment is unique: CAS works across workers"
    );
    assert!(ev.iter().filter(|e| e.starts_with("stale")).all(|e| e == "stale 8"), "{ev:?}");
    let log = gw.log.lock().unwrap().clone();
    let w0 = log.iter().any(|l| l.contains("EV cnt") && l.contains("worker=0"));
    let w1 = log.iter().any(|l| l.contains("EV cnt") && l.contains("worker=1"));
    assert!(w0 && w1, "both workers served requests");
}

fn lifecycle_plugin() -> String {
    let mut w = Wat::new();
    let body = format!(
        r#"
  (func (export "proxy_on_response_body") (param $ctx i32) (param $size i32) (param $eos i32) (result i32)
    (call $ev_start {ev_rb}) (call $ev_num (local.get $ctx)) (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $ev_end)
    (i32.const 0))
  (func (export "proxy_on_log") (param $ctx i32)
    (call $ev_start {ev_log}) (call $ev_num (local.get $ctx)) (call $ev_end))
  (func (export "proxy_on_done") (param $ctx i32) (result i32)
    (call $ev_start {ev_done}) (call $ev_num (local.get $ctx)) (call $ev_end) (i32.const 1))
  (func (export "proxy_on_delete") (param $ctx i32)
    (call $ev_start {ev_del}) (call $ev_num (local.get $ctx)) (call $ev_end))
"#,
        ev_rb = w.s("resp_body"),
        ev_log = w.s("log"),
        ev_done = w.s("done"),
        ev_del = w.s("delete"),
    );
    w.module("0_2_100", &body)
}

fn lifecycle_of(ev: &[String], ctx: &str) -> Vec<String> {
    ev.iter()
        .filter(|e| {
            let p: Vec<&str> = e.split(' ').collect();
            matches!(p.first(), Some(&"log") | Some(&"done") | Some(&"delete"))
                && p.get(1) == Some(&ctx)
        })
        .map(|e| e.split(' ').next().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn sse_passes_chunk_by_chunk_then_log_done_delete() {
    let up = Upstream::start().await;
    let gw = Gateway::start(
        &one_cluster_config(&format!("\"{}\"", up.addr), true, ""),
        Some(&lifecycle_plugin()),
        1,
    );
    let req = hyper::Request::get(gw.url("/sse"))
        .body(gateway::body::GwBody::full(bytes::Bytes::new()))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.headers().get("content-type").unwrap(), "text/event-stream");
    let mut body = resp.into_body();
    let mut arrivals = Vec::new();
    let t = Instant::now();
    use http_body_util::BodyExt;
    while let Some(f) = body.frame().await {
        if let Ok(d) = f.unwrap().into_data() {
            arrivals.push((t.elapsed(), String::from_utf8_lossy(&d).into_owned()));
        }
    }
    let all: String = arrivals.iter().map(|a| a.1.as_str()).collect();
    assert_eq!(all, "data: 0\n\ndata: 1\n\ndata: 2\n\n");
    assert!(arrivals.len() >= 3, "{arrivals:?}");
    assert!(
        arrivals.last().unwrap().0 - arrivals[0].0 >= Duration::from_millis(250),
        "chunks arrive as sent, not buffered: {arrivals:?}"
    );
    let ev = gw.wait_events(|e| idx(e, "delete").is_some(), "delete").await;
    let rb: Vec<_> = ev.iter().filter(|e| e.starts_with("resp_body")).collect();
    assert!(rb.len() >= 3, "one response body callback per chunk: {ev:?}");
    let ctx = rb[0].split(' ').nth(1).unwrap().to_string();
    assert_eq!(lifecycle_of(&ev, &ctx), vec!["log", "done", "delete"], "{ev:?}");
    assert!(
        idx(&ev, "log").unwrap() > ev.iter().rposition(|e| e.starts_with("resp_body")).unwrap()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn client_disconnect_mid_stream_still_ends_the_context() {
    let up = Upstream::start().await;
    let gw = Gateway::start(
        &one_cluster_config(&format!("\"{}\"", up.addr), true, ""),
        Some(&lifecycle_plugin()),
        1,
    );
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(b"GET /sse-forever HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        // Read until a body chunk arrived: the headers may come in a read of their own, and the
        // filter has only seen a response body once data reached the client.
        let mut seen = Vec::new();
        let mut buf = vec![0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains("data: ") {
            let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
                .await
                .expect("no SSE data within 5 s")
                .unwrap();
            assert!(n > 0, "closed before any SSE data: {}", String::from_utf8_lossy(&seen));
            seen.extend_from_slice(&buf[..n]);
        }
        assert!(String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 200"));
        // drop the connection mid-stream
    }
    let ev = gw.wait_events(|e| idx(e, "delete").is_some(), "delete after disconnect").await;
    let ctx = ev
        .iter()
        .find(|e| e.starts_with("resp_body"))
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .to_string();
    assert_eq!(lifecycle_of(&ev, &ctx), vec!["log", "done", "delete"], "{ev:?}");
    let t = Instant::now();
    while !*up.sse_closed.lock().unwrap() {
        assert!(t.elapsed() < Duration::from_secs(5), "the upstream stream was not closed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn upstream_failure_gives_503_and_still_ends_the_context() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let gw = Gateway::start(
        &one_cluster_config(&format!("\"{closed}\""), true, ""),
        Some(&lifecycle_plugin()),
        1,
    );
    let r = get(&gw.url("/x"), &[]).await;
    assert_eq!(r.status, 503);
    let ev = gw.wait_events(|e| idx(e, "delete").is_some(), "delete").await;
    let ctx =
        ev.iter().find(|e| e.starts_with("log")).unwrap().split(' ').nth(1).unwrap().to_string();
    assert_eq!(lifecycle_of(&ev, &ctx), vec!["log", "done", "delete"]);
    // the local reply passed the response body callback too
    assert!(
        ev.iter().any(|e| e.starts_with(&format!("resp_body {ctx} ")) && e.ends_with(" 1")),
        "{ev:?}"
    );
}

/// A plugin that traps in its request headers callback when the request has `x-trap`, and adds
/// `x-plugin-saw: 1` to the requests it lets through.
fn trapping_plugin() -> String {
    let mut w = Wat::new();
    let body = format!(
        r#"
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (if (i32.eqz (call $proxy_get_header_map_value (i32.const 0) {hk} (i32.const 256) (i32.const 260)))
      (then unreachable))
    (drop (call $proxy_replace_header_map_value (i32.const 0) {sk} {sv}))
    (i32.const 0))
"#,
        hk = w.s("x-trap"),
        sk = w.s("x-plugin-saw"),
        sv = w.s("1"),
    );
    w.module("0_2_100", &body)
}

async fn trap_then_next(policy: &str) -> (u16, String, u16, Option<String>, String) {
    let up = Upstream::start().await;
    let cfg = one_cluster_config(&format!("\"{}\"", up.addr), true, "");
    let cfg = if policy.is_empty() { cfg } else { format!("{cfg}  failure_policy: {policy}\n") };
    let gw = Gateway::start(&cfg, Some(&trapping_plugin()), 1);
    let trapped = get(&gw.url("/t"), &[("x-trap", "1")]).await;
    let next = get(&gw.url("/t"), &[]).await;
    let saw = up.seen.lock().unwrap().last().and_then(|r| {
        r.headers.get("x-plugin-saw").and_then(|v| v.to_str().ok()).map(str::to_string)
    });
    let stats = get(&gw.admin_url("/stats"), &[]).await.text();
    assert!(stats.contains("gateway_vm_traps_total 1"), "{stats}");
    (
        trapped.status,
        trapped.text(),
        next.status,
        if next.status == 200 { saw } else { None },
        stats,
    )
}

/// Envoy's default `failure_policy` (FAIL_CLOSED, Higress's `failStrategy: FAIL_CLOSE`): the VM
/// stays failed; the trapping stream and every later one get 503 `wasm_fail_stream`.
#[tokio::test(flavor = "multi_thread")]
async fn a_trap_fails_the_vm_closed_by_default() {
    let (trapped, body, next, _, _) = trap_then_next("").await;
    assert_eq!(trapped, 503, "{body}");
    assert_eq!(next, 503, "the VM stays failed: later streams fail too");
}

/// FAIL_OPEN, as Higress deploys `failStrategy: FAIL_OPEN` (Envoy's legacy `fail_open: true`):
/// the trapping stream and later streams go on without the plugin (conformance test
/// `a_trap_under_fail_open_and_the_streams_in_flight`).
#[tokio::test(flavor = "multi_thread")]
async fn fail_open_lets_the_trapping_and_later_streams_through_without_the_plugin() {
    let (trapped, body, next, saw, _) = trap_then_next("FAIL_OPEN").await;
    assert_eq!(trapped, 200, "the trapping stream goes on without the plugin: {body}");
    assert_eq!(next, 200);
    assert_eq!(saw, None, "the failed plugin no longer runs");
}

#[tokio::test(flavor = "multi_thread")]
async fn fail_reload_fails_the_stream_and_starts_a_new_vm() {
    let (trapped, _, next, saw, _) = trap_then_next("FAIL_RELOAD").await;
    assert_eq!(trapped, 503);
    assert_eq!(next, 200);
    assert_eq!(saw.as_deref(), Some("1"), "the new VM runs the plugin");
}

#[tokio::test(flavor = "multi_thread")]
async fn decoder_buffer_limit_gives_413() {
    let up = Upstream::start().await;
    let mut w = Wat::new();
    let body = format!(
        r#"
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (drop (call $proxy_set_property {k} {v}))
    (i32.const 1))
  (func (export "proxy_on_request_body") (param $ctx i32) (param $size i32) (param $eos i32) (result i32)
    (i32.const 1))
"#,
        k = w.s("set_decoder_buffer_limit"),
        v = w.s("12"),
    );
    let gw = Gateway::start(
        &one_cluster_config(&format!("\"{}\"", up.addr), true, ""),
        Some(&w.module("0_2_100", &body)),
        1,
    );
    let r =
        post_chunks(&gw.url("/big"), &[], &["aaaaa", "bbbbb", "ccccc"], Duration::from_millis(50))
            .await;
    assert_eq!(r.status, 413);
    assert_eq!(up.requests().len(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn watermark_buffering_over_the_limit_slows_the_client_instead_of_413() {
    // Envoy: a body held with StopIterationAndWatermark past the buffer limit triggers flow control
    // (the downstream stops being read), not the 413 that StopIterationAndBuffer gets. The plugin
    // holds the request with headers paused until a tick continues it.
    let up = Upstream::start().await;
    let mut w = Wat::new();
    let body = format!(
        r#"
  (global $held (mut i32) (i32.const 0))
  (func (export "proxy_on_configure") (param $root i32) (param $size i32) (result i32)
    (drop (call $proxy_set_tick_period_milliseconds (i32.const 300)))
    (i32.const 1))
  (func (export "proxy_on_tick") (param $root i32)
    (if (global.get $held)
      (then
        (drop (call $proxy_set_effective_context (global.get $held)))
        (global.set $held (i32.const 0))
        (call $ev_start {ev_cont}) (call $ev_num (call $proxy_continue_stream (i32.const 0))) (call $ev_end))))
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (drop (call $proxy_set_property {k} {v}))
    (global.set $held (local.get $ctx))
    (i32.const 1))
  (func (export "proxy_on_request_body") (param $ctx i32) (param $size i32) (param $eos i32) (result i32)
    (if (global.get $held) (then (return (i32.const 2))))
    (i32.const 0))
"#,
        k = w.s("set_decoder_buffer_limit"),
        v = w.s("12"),
        ev_cont = w.s("continued"),
    );
    let gw = Gateway::start(
        &one_cluster_config(&format!("\"{}\"", up.addr), true, ""),
        Some(&w.module("0_2_100", &body)),
        1,
    );
    let r = post_chunks(
        &gw.url("/big"),
        &[],
        &["aaaaa", "bbbbb", "ccccc", "ddddd"],
        Duration::from_millis(20),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    // The log line may reach the test's stderr reader after the response.
    gw.wait_events(|e| e.iter().any(|e| e == "continued 0"), "the tick's continue").await;
    let got = up.requests();
    assert_eq!(got.len(), 1);
    assert_eq!(&got[0].body[..], b"aaaaabbbbbcccccddddd", "the whole body arrives");
}

#[tokio::test(flavor = "multi_thread")]
async fn upstream_hosts_carry_health_and_stored_metrics_and_properties() {
    let (u1, u2) = (Upstream::start().await, Upstream::start().await);
    let mut w = Wat::new();
    let body = format!(
        r#"
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (drop (call $proxy_get_property {route} (i32.const 256) (i32.const 260)))
    (call $ev_start {ev_route}) (call $ev_str (i32.load (i32.const 256)) (i32.load (i32.const 260)))
    (drop (call $proxy_get_property {cluster} (i32.const 256) (i32.const 260)))
    (call $ev_str (i32.load (i32.const 256)) (i32.load (i32.const 260)))
    (drop (call $proxy_get_property {path} (i32.const 256) (i32.const 260)))
    (call $ev_str (i32.load (i32.const 256)) (i32.load (i32.const 260)))
    (drop (call $proxy_get_property {root} (i32.const 256) (i32.const 260)))
    (call $ev_str (i32.load (i32.const 256)) (i32.load (i32.const 260)))
    (call $ev_end)
    (drop (call $proxy_get_upstream_hosts (i32.const 256) (i32.const 260)))
    (drop (call $proxy_send_local_response (i32.const 200) (i32.const 0) (i32.const 0) (i32.load (i32.const 256)) (i32.load (i32.const 260)) (i32.const 0) (i32.const 0) (i32.const -1)))
    (i32.const 0))
"#,
        route = w.s("route_name"),
        cluster = w.s("cluster_name"),
        path = w.b(b"request\0path"),
        root = w.s("plugin_root_id"),
        ev_route = w.s("props"),
    );
    let cfg = format!(
        "listeners: [{{name: main, address: 127.0.0.1:0}}]\nadmin: {{address: 127.0.0.1:0}}\nroutes:\n  - name: test-route\n    match: {{prefix: /}}\n    cluster: pods\nclusters:\n  - name: pods\n    endpoints: [\"{}\", \"{}\"]\n    health_check: {{path: /metrics, interval_ms: 200, timeout_ms: 500, store_metrics: true}}\nplugin:\n  wasm: {{PLUGIN}}\n  name: test-plugin\n  root_id: test-root\n",
        u1.addr, u2.addr
    );
    let gw = Gateway::start(&cfg, Some(&w.module("0_2_100", &body)), 1);
    let r = get(&gw.url("/hosts?x=1"), &[]).await;
    assert_eq!(r.status, 200);
    let hosts = gateway::abi::unmarshal_pairs(&r.body).unwrap();
    assert_eq!(hosts.len(), 2);
    for (addr, info) in &hosts {
        let port = addr.rsplit(':').next().unwrap();
        let j: serde_json::Value = serde_json::from_slice(info).unwrap();
        assert_eq!(j["health_status"], "Healthy");
        assert_eq!(
            j["metrics"],
            format!("vllm:num_requests_running {port}\n"),
            "health-check body stored as metrics"
        );
    }
    let ev = gw.wait_events(|e| idx(e, "props").is_some(), "props").await;
    assert!(ev.contains(&"props test-route pods /hosts?x=1 test-root".to_string()), "{ev:?}");
    // Forced health shows up; a stopped pod turns Unhealthy through the health checker.
    let r = request(
        "POST",
        &gw.admin_url("/clusters/pods/health"),
        &[],
        &format!("{{\"{}\": \"Degraded\"}}", u1.addr),
    )
    .await;
    assert_eq!(r.status, 200);
    let hosts = gateway::abi::unmarshal_pairs(&get(&gw.url("/hosts"), &[]).await.body).unwrap();
    let u1info: serde_json::Value =
        serde_json::from_slice(&hosts.iter().find(|h| h.0 == u1.addr.to_string()).unwrap().1)
            .unwrap();
    assert_eq!(u1info["health_status"], "Degraded");
}

#[tokio::test(flavor = "multi_thread")]
async fn original_dst_host_is_honoured_only_on_an_original_dst_cluster_with_use_http_header() {
    let (u1, u2) = (Upstream::start().await, Upstream::start().await);
    let mut w = Wat::new();
    let target = u2.addr.to_string();
    let to_static = w.b(&pairs(&[
        (":method", "GET"),
        (":path", "/callout-static"),
        (":authority", "pods"),
        ("x-envoy-original-dst-host", &target),
    ]));
    let to_dst = w.b(&pairs(&[
        (":method", "GET"),
        (":path", "/callout-dst"),
        (":authority", "pods"),
        ("x-envoy-original-dst-host", &target),
    ]));
    let no_header =
        w.b(&pairs(&[(":method", "GET"), (":path", "/callout-none"), (":authority", "pods")]));
    let bad = w.b(&pairs(&[(":method", "GET"), (":authority", "pods")]));
    let body = format!(
        r#"
  (global $stream (mut i32) (i32.const 0))
  (global $left (mut i32) (i32.const 0))
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (global.set $stream (local.get $ctx))
    (global.set $left (i32.const 3))
    (call $ev_start {ev_bad}) (call $ev_num (call $proxy_http_call {cl} {bad} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 1000) (i32.const 264))) (call $ev_end)
    (drop (call $proxy_http_call {cl} {to_static} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 1000) (i32.const 264)))
    (drop (call $proxy_http_call {cl} {to_static} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 1000) (i32.const 264)))
    (drop (call $proxy_http_call {dst} {to_dst} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 1000) (i32.const 264)))
    (call $ev_start {ev_none}) (call $ev_num (call $proxy_http_call {dst} {no_header} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 1000) (i32.const 264))) (call $ev_end)
    (i32.const 1))
  (func (export "proxy_on_http_call_response") (param $root i32) (param $token i32) (param $nh i32) (param $nb i32) (param $nt i32)
    (call $ev_start {ev_resp}) (call $ev_num (local.get $nb)) (call $ev_end)
    (global.set $left (i32.sub (global.get $left) (i32.const 1)))
    (if (i32.eqz (global.get $left)) (then
      (drop (call $proxy_set_effective_context (global.get $stream)))
      (drop (call $proxy_continue_stream (i32.const 0))))))
"#,
        cl = w.s("pods"),
        dst = w.s("pods-dst"),
        to_static = to_static,
        to_dst = to_dst,
        no_header = no_header,
        bad = bad,
        ev_bad = w.s("bad"),
        ev_none = w.s("no-header"),
        ev_resp = w.s("resp"),
    );
    let eps = format!("\"{}\", \"{}\"", u1.addr, u2.addr);
    let dst_cluster = "  - name: pods-dst\n    type: ORIGINAL_DST\n    original_dst_lb_config: {use_http_header: true}\n";
    let gw = Gateway::start(
        &one_cluster_config(&eps, true, dst_cluster),
        Some(&w.module("0_2_100", &body)),
        1,
    );
    for _ in 0..4 {
        assert_eq!(get(&gw.url("/x"), &[]).await.status, 200);
    }
    let ev = gw
        .wait_events(
            |e| e.iter().filter(|x| x.starts_with("resp")).count() == 12,
            "12 callout responses",
        )
        .await;
    assert!(ev.contains(&"bad 2".to_string()), "missing :path is BadArgument: {ev:?}");
    // ORIGINAL_DST + use_http_header: the header is the destination.
    assert_eq!((u1.count("/callout-dst"), u2.count("/callout-dst")), (0, 4));
    // Without the header there is no destination: the call is InternalFailure at once, with no
    // callback (as Envoy 1.40, conformance `dispatch_http_call_to_a_cluster_without_hosts`),
    // reaching no pod.
    assert_eq!(ev.iter().filter(|x| *x == "no-header 10").count(), 4, "{ev:?}");
    assert_eq!(u1.count("/callout-none") + u2.count("/callout-none"), 0);
    // Any other cluster: the header means nothing and round robin spreads the calls (two in a row
    // per request, so both pods get some whatever the requests in between).
    assert_eq!(u1.count("/callout-static") + u2.count("/callout-static"), 8);
    assert!(
        u1.count("/callout-static") > 0 && u2.count("/callout-static") > 0,
        "the header must not pin a STATIC cluster's calls"
    );
}

#[test]
fn on_configure_false_stops_the_gateway_with_the_plugin_name() {
    let mut w = Wat::new();
    let _ = w.s("x");
    let body = r#"
  (func (export "proxy_on_configure") (param i32 i32) (result i32) (i32.const 0))
"#;
    let cfg = one_cluster_config("\"127.0.0.1:1\"", true, "");
    let err = match Gateway::try_start(&cfg, Some(&w.module("0_2_100", body)), 1) {
        Ok(_) => panic!("the gateway must not start"),
        Err(e) => e,
    };
    assert!(err.contains("test-plugin") && err.contains("configur"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn ticks_queues_metrics_and_header_properties() {
    let up = Upstream::start().await;
    let mut w = Wat::new();
    let body = format!(
        r#"
  (global $ticked (mut i32) (i32.const 0))
  (func (export "proxy_on_configure") (param $root i32) (param $size i32) (result i32)
    (drop (call $proxy_register_shared_queue {q} (i32.const 700)))
    (drop (call $proxy_define_metric (i32.const 0) {m} (i32.const 704)))
    (drop (call $proxy_set_tick_period_milliseconds (i32.const 50)))
    (i32.const 1))
  (func (export "proxy_on_tick") (param $root i32)
    (if (i32.eqz (global.get $ticked))
      (then (global.set $ticked (i32.const 1)) (call $ev_start {ev_tick}) (call $ev_num (local.get $root)) (call $ev_end))))
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (drop (call $proxy_increment_metric (i32.load (i32.const 704)) (i64.const 1)))
    (drop (call $proxy_get_property {hp} (i32.const 256) (i32.const 260)))
    (call $ev_start {ev_hdr}) (call $ev_str (i32.load (i32.const 256)) (i32.load (i32.const 260))) (call $ev_end)
    (drop (call $proxy_resolve_shared_queue (i32.const 0) (i32.const 0) {q} (i32.const 708)))
    (call $ev_start {ev_enq}) (call $ev_num (call $proxy_enqueue_shared_queue (i32.load (i32.const 708)) {item})) (call $ev_end)
    (i32.const 0))
  (func (export "proxy_on_queue_ready") (param $root i32) (param $qid i32)
    (drop (call $proxy_dequeue_shared_queue (local.get $qid) (i32.const 256) (i32.const 260)))
    (call $ev_start {ev_q}) (call $ev_str (i32.load (i32.const 256)) (i32.load (i32.const 260))) (call $ev_end)
    (call $ev_start {ev_empty}) (call $ev_num (call $proxy_dequeue_shared_queue (local.get $qid) (i32.const 256) (i32.const 260))) (call $ev_end))
"#,
        q = w.s("q"),
        m = w.s("test_requests"),
        ev_tick = w.s("tick"),
        hp = w.b(b"request\0headers\0x-foo"),
        ev_hdr = w.s("hdr"),
        ev_enq = w.s("enqueue"),
        item = w.s("item"),
        ev_q = w.s("queue"),
        ev_empty = w.s("empty"),
    );
    let gw = Gateway::start(
        &one_cluster_config(&format!("\"{}\"", up.addr), true, ""),
        Some(&w.module("0_2_100", &body)),
        2,
    );
    for i in 1..=3 {
        assert_eq!(get(&gw.url("/q"), &[("x-foo", "bar")]).await.status, 200);
        // one at a time, so each enqueue finds the queue empty again
        gw.wait_events(
            |e| {
                e.iter().filter(|x| *x == "queue item").count() == i
                    && e.iter().filter(|x| x.starts_with("empty")).count() == i
            },
            "queue ready",
        )
        .await;
    }
    let ev = gw
        .wait_events(
            |e| e.iter().filter(|x| *x == "queue item").count() == 3 && idx(e, "tick").is_some(),
            "queue and tick",
        )
        .await;
    assert_eq!(ev.iter().filter(|e| *e == "hdr bar").count(), 3, "{ev:?}");
    assert_eq!(ev.iter().filter(|e| *e == "enqueue 0").count(), 3, "{ev:?}");
    assert_eq!(
        ev.iter().filter(|e| *e == "empty 7").count(),
        3,
        "dequeue of an empty queue is Empty: {ev:?}"
    );
    let stats = get(&gw.admin_url("/stats"), &[]).await.text();
    assert!(stats.contains("test_requests 3"), "plugin metrics on /stats: {stats}");
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_requests_all_complete_and_counters_return_to_zero() {
    let (u1, u2) = (Upstream::start().await, Upstream::start().await);
    let eps = format!("\"{}\", \"{}\"", u1.addr, u2.addr);
    let gw = Gateway::start(&one_cluster_config(&eps, true, ""), Some(&lifecycle_plugin()), 2);
    let mut tasks = Vec::new();
    for t in 0..20 {
        let url = gw.url("/load");
        tasks.push(tokio::spawn(async move {
            let c = client();
            for i in 0..10 {
                let body = format!("{{\"t\":{t},\"i\":{i}}}");
                let req = hyper::Request::post(&url)
                    .body(gateway::body::GwBody::full(bytes::Bytes::from(body.clone())))
                    .unwrap();
                let r = c.request(req).await.unwrap();
                assert_eq!(r.status(), 200);
                use http_body_util::BodyExt;
                let b = r.into_body().collect().await.unwrap().to_bytes();
                assert!(b.starts_with(b"ok "));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(u1.count("/load") + u2.count("/load"), 200);
    let bodies: std::collections::HashSet<_> =
        u1.requests().into_iter().chain(u2.requests()).map(|r| r.body).collect();
    assert_eq!(bodies.len(), 200, "every body arrived intact and once");
    let ev = gw
        .wait_events(|e| e.iter().filter(|x| x.starts_with("delete")).count() == 200, "200 deletes")
        .await;
    assert_eq!(ev.iter().filter(|x| x.starts_with("log")).count(), 200);
    let stats = get(&gw.admin_url("/stats"), &[]).await.text();
    assert!(
        stats
            .lines()
            .filter(|l| l.starts_with("gateway_upstream_rq_active"))
            .all(|l| l.ends_with(" 0")),
        "{stats}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_op_timeout_gives_network_error() {
    let up = Upstream::start().await;
    // Accepts connections and reads, but never answers.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else { continue };
            tokio::spawn(async move {
                use tokio::io::AsyncReadExt;
                let mut b = [0u8; 1024];
                while let Ok(n) = s.read(&mut b).await {
                    if n == 0 {
                        return;
                    }
                }
            });
        }
    });
    let gw = Gateway::start(&redis_config(&up, &addr.to_string()), Some(&redis_plugin()), 1);
    let t = Instant::now();
    let r = request("POST", &gw.url("/r"), &[("x-cluster", CLUSTER)], &resp(&["PING"])).await;
    assert_eq!(r.status, 503, "op timeout (1000 ms in redis_init) -> NetworkError");
    assert!(
        t.elapsed() >= Duration::from_millis(900) && t.elapsed() < Duration::from_secs(5),
        "{:?}",
        t.elapsed()
    );
    let ev = gw.wait_events(|e| idx(e, "redis").is_some(), "redis callback").await;
    assert!(ev.contains(&"redis 7 1 0".to_string()), "{ev:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn client_abort_while_waiting_for_the_upstream_ends_the_context_promptly() {
    let up = Upstream::start().await;
    let gw = Gateway::start(
        &one_cluster_config(&format!("\"{}\"", up.addr), true, ""),
        Some(&lifecycle_plugin()),
        1,
    );
    {
        use tokio::io::AsyncWriteExt;
        let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(b"GET /hang HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let t = Instant::now();
    let ev = gw.wait_events(|e| idx(e, "delete").is_some(), "delete after abort").await;
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "the abort is noticed before the upstream answers (10 s)"
    );
    assert_eq!(
        ev.iter().map(|e| e.split(' ').next().unwrap()).collect::<Vec<_>>(),
        vec!["log", "done", "delete"]
    );
    let stats = get(&gw.admin_url("/stats"), &[]).await.text();
    assert!(
        stats.contains(&format!(
            "gateway_upstream_rq_active{{cluster=\"pods\",host=\"{}\"}} 0",
            up.addr
        )),
        "{stats}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn header_changes_rematch_the_route_unless_clear_route_cache_off() {
    let (u1, u2) = (Upstream::start().await, Upstream::start().await);
    let mut w = Wat::new();
    let body = format!(
        r#"
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (if (i32.eqz (call $proxy_get_header_map_value (i32.const 0) {off} (i32.const 256) (i32.const 260)))
      (then (drop (call $proxy_set_property {crc} {offv}))))
    (if (i32.eqz (call $proxy_get_header_map_value (i32.const 0) {rw} (i32.const 256) (i32.const 260)))
      (then (drop (call $proxy_replace_header_map_value (i32.const 0) {path} {newpath}))))
    (if (i32.eqz (call $proxy_get_header_map_value (i32.const 0) {sc} (i32.const 256) (i32.const 260)))
      (then (drop (call $proxy_add_header_map_value (i32.const 0) {tc} {c1}))))
    (i32.const 0))
"#,
        off = w.s("x-off"),
        crc = w.s("clear_route_cache"),
        offv = w.s("off"),
        rw = w.s("x-rewrite"),
        path = w.s(":path"),
        newpath = w.s("/a/x"),
        sc = w.s("x-set-cluster"),
        tc = w.s("x-target-cluster"),
        c1 = w.s("c1"),
    );
    let cfg = format!(
        "listeners: [{{name: main, address: 127.0.0.1:0}}]\nadmin: {{address: 127.0.0.1:0}}\nroutes:\n  - {{name: r-a, match: {{prefix: /a}}, cluster: c1}}\n  - {{name: r-hdr, match: {{prefix: /, host: hdr.test}}, cluster_header: x-target-cluster}}\n  - {{name: r-root, match: {{prefix: /}}, cluster: c2}}\nclusters:\n  - {{name: c1, endpoints: [\"{}\"]}}\n  - {{name: c2, endpoints: [\"{}\"]}}\nplugin:\n  wasm: {{PLUGIN}}\n  name: test-plugin\n",
        u1.addr, u2.addr
    );
    let gw = Gateway::start(&cfg, Some(&w.module("0_2_100", &body)), 1);
    let r = get(&gw.url("/b"), &[("x-rewrite", "1")]).await;
    assert_eq!(
        r.header("x-gateway-upstream-host"),
        Some(u1.addr.to_string()),
        "path change re-matched to route r-a"
    );
    assert_eq!(u1.requests()[0].path, "/a/x");
    let r = get(&gw.url("/b"), &[("x-rewrite", "1"), ("x-off", "1")]).await;
    assert_eq!(
        r.header("x-gateway-upstream-host"),
        Some(u2.addr.to_string()),
        "clear_route_cache=off keeps route r-root"
    );
    assert_eq!(u2.requests()[0].path, "/a/x");
    let r = get(&gw.url("/"), &[("host", "hdr.test:8080"), ("x-set-cluster", "1")]).await;
    assert_eq!(
        r.header("x-gateway-upstream-host"),
        Some(u1.addr.to_string()),
        "cluster_header read when the headers leave the filter"
    );
    let r = get(&gw.url("/"), &[("host", "hdr.test")]).await;
    assert_eq!(r.status, 404, "cluster_header absent");
}

#[tokio::test(flavor = "multi_thread")]
async fn wasi_stdio_clock_and_random_work_inside_the_workers() {
    let up = Upstream::start().await;
    let mut w = Wat::new();
    let text = "hello from wasi stdout\n";
    let body = format!(
        r#"
  (import "wasi_snapshot_preview1" "clock_time_get" (func $clock_time_get (param i32 i64 i32) (result i32)))
  (import "wasi_snapshot_preview1" "random_get" (func $random_get (param i32 i32) (result i32)))
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (i32.store (i32.const 800) (i32.const {addr}))
    (i32.store (i32.const 804) (i32.const {len}))
    (call $ev_start {ev_w}) (call $ev_num (call $fd_write (i32.const 1) (i32.const 800) (i32.const 1) (i32.const 808))) (call $ev_num (i32.load (i32.const 808))) (call $ev_end)
    (call $ev_start {ev_c}) (call $ev_num (call $clock_time_get (i32.const 0) (i64.const 1) (i32.const 816)))
    (call $ev_num (i64.gt_u (i64.load (i32.const 816)) (i64.const 1600000000000000000))) (call $ev_end)
    (call $ev_start {ev_r}) (call $ev_num (call $random_get (i32.const 832) (i32.const 16))) (call $ev_end)
    (i32.const 0))
"#,
        addr = {
            let s = w.s(text);
            s.split(' ').nth(1).unwrap().trim_end_matches(')').to_string()
        },
        len = text.len(),
        ev_w = w.s("fd_write"),
        ev_c = w.s("clock"),
        ev_r = w.s("random"),
    );
    let module = w.module("0_2_100", &body);
    let gw = Gateway::start(
        &one_cluster_config(&format!("\"{}\"", up.addr), true, ""),
        Some(&module),
        1,
    );
    assert_eq!(get(&gw.url("/w"), &[]).await.status, 200);
    let ev = gw.wait_events(|e| idx(e, "random").is_some(), "wasi calls").await;
    assert!(ev.contains(&format!("fd_write 0 {}", text.len())), "{ev:?}");
    assert!(ev.contains(&"clock 0 1".to_string()), "{ev:?}");
    assert!(ev.contains(&"random 0".to_string()), "{ev:?}");
    let log = gw.log.lock().unwrap().clone();
    assert!(
        log.iter().any(|l| l.contains("hello from wasi stdout")),
        "plugin stdout goes to the gateway's stderr"
    );
}

/// A client that goes away in the middle of its upload: Envoy resets the upstream request, so the
/// upstream never takes the part it got for a complete body.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_abort_mid_upload_resets_the_upstream_request() {
    use tokio::io::AsyncWriteExt;
    let up = Upstream::start().await;
    let gw = Gateway::start(&one_cluster_config(&format!("\"{}\"", up.addr), false, ""), None, 1);
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(
        b"POST /upload HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
    )
    .await
    .unwrap();
    // The gateway has started the upstream request with the first chunk; then the client dies.
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(5);
    let seen = loop {
        let seen: Vec<(String, bytes::Bytes)> = up
            .seen
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.path == "/upload")
            .map(|r| (r.path.clone(), r.body.clone()))
            .collect();
        if !seen.is_empty() || Instant::now() > deadline {
            break seen;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(seen.len(), 1, "the upstream request was started: {seen:?}");
    assert!(seen[0].1.is_empty(), "the upstream read a truncated body as complete: {seen:?}");
}

/// proxy-wasm-cpp-host reads the ABI version from *function* exports only and refuses a module
/// with no known version ("Missing or unknown Proxy-Wasm ABI version"); an unknown marker next to a
/// known one is skipped.
#[tokio::test(flavor = "multi_thread")]
async fn abi_markers_are_function_exports_of_a_known_version() {
    let up = Upstream::start().await;
    let cfg = one_cluster_config(&format!("\"{}\"", up.addr), true, "");
    // The test prelude imports `proxy_continue_stream`, which a 0_1_0 host does not link
    // (cpp-host `WasmBase::registerCallbacks`; conformance `abi_marker_0_1_0_*` against Envoy).
    for (marker, refusal) in [
        ("0_1_0", Some("missing import: env.proxy_continue_stream")),
        ("0_2_0", None),
        ("0_2_1", None),
        ("0_2_100", None),
        ("0_3_0", Some("unknown Proxy-Wasm ABI version")),
    ] {
        let started = Gateway::try_start(&cfg, Some(&Wat::new().module(marker, "")), 1);
        match (started, refusal) {
            (Ok(gw), None) => assert_eq!(get(&gw.url("/t"), &[]).await.status, 200, "{marker}"),
            (Err(e), Some(why)) => assert!(e.contains(why), "{e}"),
            (Ok(_), Some(_)) => panic!("a module whose only marker is {marker} must be refused"),
            (Err(e), None) => panic!("{marker} refused: {e}"),
        }
    }
    // A marker that is a global, not a function, does not count.
    let global_marker = Wat::new()
        .module("0_3_0", "  (global (export \"proxy_abi_version_0_2_1\") i32 (i32.const 0))\n");
    assert!(Gateway::try_start(&cfg, Some(&global_marker), 1).is_err());
    // An unknown marker before a known one is skipped.
    let both = Wat::new().module("0_3_0", "  (func (export \"proxy_abi_version_0_2_1\"))\n");
    let gw = Gateway::try_start(&cfg, Some(&both), 1).expect("the known marker counts");
    assert_eq!(get(&gw.url("/t"), &[]).await.status, 200);
}

// ------------------------------------------------------------------ timers

/// One route to `up` with the given listener and route settings (YAML flow-map entries).
fn timer_config(up: &Upstream, listener: &str, route: &str, plugin: bool) -> String {
    let plugin = if plugin {
        "plugin:\n  wasm: {PLUGIN}\n  name: test-plugin\n  root_id: test-root\n"
    } else {
        ""
    };
    format!(
        "listeners: [{{name: main, address: 127.0.0.1:0{listener}}}]\nadmin: {{address: 127.0.0.1:0}}\nroutes:\n  - {{name: r, match: {{prefix: /}}, cluster: pods{route}}}\nclusters:\n  - name: pods\n    endpoints: [\"{}\"]\n{plugin}",
        up.addr
    )
}

/// A plugin that holds every request (StopIteration in request headers) and never resumes it;
/// it logs its on_log and on_done.
fn never_resume_plugin() -> String {
    let mut w = Wat::new();
    let body = format!(
        r#"
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (i32.const 1))
  (func (export "proxy_on_log") (param $ctx i32)
    (call $ev_start {ev_log}) (call $ev_num (local.get $ctx)) (call $ev_end))
  (func (export "proxy_on_done") (param $ctx i32) (result i32)
    (call $ev_start {ev_done}) (call $ev_num (local.get $ctx)) (call $ev_end)
    (i32.const 1))
"#,
        ev_log = w.s("log"),
        ev_done = w.s("done"),
    );
    w.module("0_2_100", &body)
}

/// Envoy's `stream_idle_timeout`: a request the plugin holds and never resumes gets 408
/// "stream timeout" once nothing happened on the stream for that long, and the plugin's on_log
/// and on_done run. (The route timeout does not cover it: it starts once the router has the
/// whole request.) The host used to hold such a request until the client gave up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_plugin_never_resumes_gets_408_after_the_stream_idle_timeout() {
    let up = Upstream::start().await;
    let cfg = timer_config(&up, ", stream_idle_timeout_ms: 500", ", timeout_ms: 200", true);
    let gw = Gateway::start(&cfg, Some(&never_resume_plugin()), 1);
    let started = Instant::now();
    let r = get(&gw.url("/held"), &[]).await;
    assert_eq!((r.status, r.text().as_str()), (408, "stream timeout"));
    assert!(started.elapsed() >= Duration::from_millis(450), "{:?}", started.elapsed());
    gw.wait_events(|e| idx(e, "log").is_some() && idx(e, "done").is_some(), "on_log and on_done")
        .await;
    assert_eq!(up.count("/held"), 0, "the held request never reached the upstream");
}

/// Envoy's route timeout starts when the router has the whole request: a slow upload longer
/// than the timeout still succeeds (the host used to count from the first upstream poll and
/// answer 504 mid-upload).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_route_timeout_does_not_count_the_upload() {
    let up = Upstream::start().await;
    let cfg = timer_config(&up, "", ", timeout_ms: 800", false);
    let gw = Gateway::start(&cfg, None, 1);
    let r = post_chunks(&gw.url("/upload"), &[], &["a", "b", "c", "d"], Duration::from_millis(400))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        up.requests().last().map(|q| q.body.clone()),
        Some(bytes::Bytes::from_static(b"abcd"))
    );
}

/// Envoy's route timeout covers the response to its end: a response still streaming when it
/// fires is reset, and the upstream request is cancelled. The host used to stop counting at
/// the response headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_route_timeout_resets_a_response_still_streaming() {
    use http_body_util::BodyExt;
    let up = Upstream::start().await;
    let cfg = timer_config(&up, "", ", timeout_ms: 1000", false);
    let gw = Gateway::start(&cfg, None, 1);
    let req = hyper::Request::get(gw.url("/sse-forever"))
        .body(gateway::body::GwBody::full(bytes::Bytes::new()))
        .unwrap();
    let started = Instant::now();
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect()).await;
    let body = body.expect("the route timeout must end the stream");
    assert!(body.is_err(), "a reset, not a clean end");
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(8), "{took:?}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !*up.sse_closed.lock().unwrap() {
        assert!(Instant::now() < deadline, "the upstream stream was never cancelled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Reads from a raw connection until the peer closes it (Ok(elapsed)) or `within` passes.
async fn closed_within(
    s: &mut tokio::net::TcpStream,
    within: Duration,
) -> Result<Duration, String> {
    use tokio::io::AsyncReadExt;
    let started = Instant::now();
    let mut buf = vec![0u8; 4096];
    loop {
        match tokio::time::timeout_at((started + within).into(), s.read(&mut buf)).await {
            Err(_) => return Err(format!("still open after {within:?}")),
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(started.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

/// Higress's `downstream.idleTimeout` (Envoy's connection `idle_timeout`): a keep-alive
/// connection with no request in flight is closed after it. The host used to keep it forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() {
    use tokio::io::AsyncWriteExt;
    let up = Upstream::start().await;
    let cfg = timer_config(&up, ", idle_timeout_ms: 400", "", false);
    let gw = Gateway::start(&cfg, None, 1);
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    // The request takes 500 ms upstream, longer than the idle timeout: a stream in flight
    // keeps the connection open; the answer arrives, then the idle connection closes.
    let took = closed_within(&mut s, Duration::from_secs(10)).await.unwrap();
    assert!(took >= Duration::from_millis(850), "closed while the request was in flight: {took:?}");
    assert_eq!(up.count("/slow"), 1);
}

/// Partial request headers are bounded: by `request_headers_timeout_ms` when set, else by the
/// stream idle timeout (Envoy has a stream from the first byte). Hyper's header-read timeout
/// needs a timer; the host used to create none, so a stalled header kept its socket forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_request_header_is_cut() {
    use tokio::io::AsyncWriteExt;
    let up = Upstream::start().await;
    for listener in [", request_headers_timeout_ms: 300", ", stream_idle_timeout_ms: 300"] {
        let cfg = timer_config(&up, &format!("{listener}, idle_timeout_ms: 0"), "", false);
        let gw = Gateway::start(&cfg, None, 1);
        let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nx-partial: ").await.unwrap();
        let took = closed_within(&mut s, Duration::from_secs(10)).await.unwrap();
        assert!(took >= Duration::from_millis(250), "{listener}: {took:?}");
    }
    assert_eq!(up.count("/"), 0);
}

// ------------------------------------------------------------------ first health check

/// The `health_status` of `addr` in the admin `/clusters` document.
async fn health_of(gw: &Gateway, addr: &str) -> Option<String> {
    let doc: serde_json::Value =
        serde_json::from_slice(&get(&gw.admin_url("/clusters"), &[]).await.body).ok()?;
    doc.as_array()?
        .iter()
        .flat_map(|c| c["endpoints"].as_array().cloned().unwrap_or_default())
        .find_map(|e| {
            (e["address"] == addr).then(|| e["health_status"].as_str().unwrap_or("").to_string())
        })
}

/// Envoy's HTTP health checker counts only the statuses in `expected_statuses` as healthy, by
/// default 200 alone: a pod whose health path answers 204 or 299 is Unhealthy unless the config
/// lists it. Higress's stored metrics keep the first 64 KiB of a healthy answer's body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_expected_statuses_are_healthy() {
    let up = Upstream::start().await;
    let cluster = |name: &str, path: &str, extra: &str| {
        format!(
            "  - name: {name}\n    endpoints: [\"{}\"]\n    health_check: {{path: {path}, interval_ms: 60000, timeout_ms: 1000, store_metrics: true{extra}}}\n",
            up.addr
        )
    };
    let cfg = format!(
        "listeners: [{{name: main, address: 127.0.0.1:0}}]\nadmin: {{address: 127.0.0.1:0}}\nroutes:\n  - {{name: r, match: {{prefix: /}}, cluster: ok}}\nclusters:\n{}{}{}{}{}",
        cluster("ok", "/status/200", ""),
        cluster("no-content", "/status/204", ""),
        cluster("redirect", "/status/299", ""),
        cluster("listed", "/status/204", ", expected_statuses: [[200, 300]]"),
        cluster("large", "/bytes/200000", ""),
    );
    let gw = Gateway::start(&cfg, None, 1);
    let doc: serde_json::Value =
        serde_json::from_slice(&get(&gw.admin_url("/clusters"), &[]).await.body).unwrap();
    let endpoint = |name: &str| {
        doc.as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == name))
            .and_then(|c| c["endpoints"].get(0).cloned())
            .unwrap_or_default()
    };
    let health = |name: &str| endpoint(name)["health_status"].as_str().unwrap_or("").to_string();
    assert_eq!(health("ok"), "Healthy");
    assert_eq!(health("no-content"), "Unhealthy", "204 is not in the default expected statuses");
    assert_eq!(health("redirect"), "Unhealthy");
    assert_eq!(health("listed"), "Healthy", "204 is in [200, 300)");
    assert_eq!(health("large"), "Healthy");
    let metrics = endpoint("large")["metrics"].as_str().unwrap_or("").len();
    assert_eq!(metrics, 64 * 1024, "the first 64 KiB of the body are kept");
}

/// Envoy (`updateDynamicHostList`): an endpoint added at run time to a health-checked cluster
/// starts FAILED_ACTIVE_HC (Unhealthy) and its first check runs at once; that first check decides
/// alone (one success is enough whatever `healthy_threshold` says). The host used to start such
/// an endpoint Healthy, so a dead pod took traffic until enough checks had failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_added_at_run_time_is_unhealthy_until_its_first_health_check() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let cfg = format!(
        "listeners: [{{name: main, address: 127.0.0.1:0}}]\nadmin: {{address: 127.0.0.1:0}}\nroutes:\n  - {{name: r, match: {{prefix: /}}, cluster: pods}}\nclusters:\n  - name: pods\n    endpoints: [\"{}\"]\n    health_check: {{path: /metrics, interval_ms: 60000, timeout_ms: 1000, unhealthy_threshold: 3, healthy_threshold: 3}}\n",
        a.addr
    );
    let gw = Gateway::start(&cfg, None, 1);
    assert_eq!(health_of(&gw, &a.addr.to_string()).await.as_deref(), Some("Healthy"));
    let set = |list: String| {
        let url = gw.admin_url("/clusters/pods/endpoints");
        async move { request("POST", &url, &[], &list).await.status }
    };
    assert_eq!(set(format!("[\"{}\", \"{dead}\"]", a.addr)).await, 200);
    assert_eq!(health_of(&gw, &dead.to_string()).await.as_deref(), Some("Unhealthy"));
    for _ in 0..6 {
        let r = get(&gw.url("/p"), &[]).await;
        assert_eq!(
            (r.status, r.header("x-gateway-upstream-host")),
            (200, Some(a.addr.to_string()))
        );
    }
    // A live endpoint: Healthy after its first check, long before the 60 s interval.
    assert_eq!(set(format!("[\"{}\", \"{dead}\", \"{}\"]", a.addr, b.addr)).await, 200);
    let deadline = Instant::now() + Duration::from_secs(5);
    while health_of(&gw, &b.addr.to_string()).await.as_deref() != Some("Healthy") {
        assert!(Instant::now() < deadline, "the new endpoint was not checked at once");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(health_of(&gw, &dead.to_string()).await.as_deref(), Some("Unhealthy"));
    for _ in 0..6 {
        assert_eq!(get(&gw.url("/p"), &[]).await.status, 200);
    }
    assert_eq!(b.count("/p"), 3, "round robin over the two healthy endpoints");
}

// ------------------------------------------------------------------ override host timing

/// A plugin that overrides the upstream host with `x-target`: from the Redis reply (root
/// context, after `set_effective_context`) while the headers are held, or, with `x-late`, from
/// the body callback after the headers were let through.
fn override_from_redis_plugin() -> String {
    let mut w = Wat::new();
    let body = format!(
        r#"
  (global $stream (mut i32) (i32.const 0))
  (global $tp (mut i32) (i32.const 0))
  (global $tl (mut i32) (i32.const 0))
  (global $late (mut i32) (i32.const 0))
  (func (export "proxy_on_configure") (param $root i32) (param $size i32) (result i32)
    (drop (call $proxy_redis_init {cluster} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 1000)))
    (i32.const 1))
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (global.set $stream (local.get $ctx))
    (drop (call $proxy_get_header_map_value (i32.const 0) {tk} (i32.const 256) (i32.const 260)))
    (global.set $tp (i32.load (i32.const 256))) (global.set $tl (i32.load (i32.const 260)))
    (global.set $late (i32.eqz (call $proxy_get_header_map_value (i32.const 0) {lk} (i32.const 256) (i32.const 260))))
    (if (global.get $late) (then (return (i32.const 0))))
    (call $ev_start {ev_call}) (call $ev_num (call $proxy_redis_call {cluster} {ping} (i32.const 264))) (call $ev_end)
    (i32.const 1))
  (func (export "proxy_on_request_body") (param $ctx i32) (param $size i32) (param $eos i32) (result i32)
    (if (global.get $late)
      (then (call $ev_start {ev_late}) (call $ev_num (call $proxy_set_upstream_override_host (global.get $tp) (global.get $tl))) (call $ev_end)))
    (i32.const 0))
  (func (export "proxy_on_redis_call_response") (param $root i32) (param $token i32) (param $status i32) (param $size i32)
    (call $ev_start {ev_switch}) (call $ev_num (call $proxy_set_effective_context (global.get $stream))) (call $ev_num (local.get $status)) (call $ev_end)
    (call $ev_start {ev_override}) (call $ev_num (call $proxy_set_upstream_override_host (global.get $tp) (global.get $tl))) (call $ev_end)
    (drop (call $proxy_continue_stream (i32.const 0))))
"#,
        cluster = w.s("outbound|6379||redis.static"),
        tk = w.s("x-target"),
        lk = w.s("x-late"),
        ping = w.s(&resp(&["PING"])),
        ev_call = w.s("call"),
        ev_late = w.s("late"),
        ev_override = w.s("override"),
        ev_switch = w.s("switch"),
    );
    w.module("0_2_100", &body)
}

/// The override host can be set from a root callback (the Redis reply) for the stream made
/// effective there, and it is honoured; set after the headers left (the router has picked), it
/// changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn override_from_a_redis_reply_is_honoured_and_after_the_headers_ignored() {
    let (u1, u2) = (Upstream::start().await, Upstream::start().await);
    let (redis, _) = fake_redis().await;
    let eps = format!("\"{}\", \"{}\"", u1.addr, u2.addr);
    let cfg = one_cluster_config(
        &eps,
        true,
        &format!("  - name: outbound|6379||redis.static\n    endpoints: [\"{redis}\"]\n"),
    );
    let gw = Gateway::start(&cfg, Some(&override_from_redis_plugin()), 1);
    let target = u2.addr.to_string();
    for _ in 0..4 {
        let r = get(&gw.url("/from-redis"), &[("x-target", &target)]).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-gateway-upstream-host"), Some(target.clone()));
    }
    let ev = gw
        .wait_events(|e| e.iter().filter(|e| *e == "override 0").count() == 4, "4 overrides")
        .await;
    assert_eq!(ev.iter().filter(|e| *e == "call 0").count(), 4, "{ev:?}");
    // Too late: round robin decides (both upstreams get requests).
    let mut seen = std::collections::HashSet::new();
    for _ in 0..4 {
        let r =
            request("POST", &gw.url("/late"), &[("x-target", &target), ("x-late", "1")], "body")
                .await;
        assert_eq!(r.status, 200, "{}", r.text());
        seen.insert(r.header("x-gateway-upstream-host").unwrap());
    }
    assert_eq!(seen.len(), 2, "an override set after the headers left was honoured: {seen:?}");
    // Two body callbacks per request, as Envoy 1.40's HTTP/1 codec delivers the body: the data
    // frame (end_of_stream=false), then the end of the message (end_of_stream=true, no data).
    gw.wait_events(|e| e.iter().filter(|e| e.starts_with("late")).count() == 8, "8 late").await;
}

/// A Redis reply for a stream the client has left: the reply still reaches the root context,
/// and switching to the deleted stream with `proxy_set_effective_context` is BadArgument (2), as
/// in Envoy. (Redis here is a socket that never answers; the op timeout ends the call.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_for_a_deleted_stream_cannot_switch_to_it() {
    let up = Upstream::start().await;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let redis = silent.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let cfg = one_cluster_config(
        &format!("\"{}\"", up.addr),
        true,
        &format!("  - name: outbound|6379||redis.static\n    endpoints: [\"{redis}\"]\n"),
    );
    let gw = Gateway::start(&cfg, Some(&override_from_redis_plugin()), 1);
    let gone = tokio::time::timeout(Duration::from_millis(300), get(&gw.url("/gone"), &[])).await;
    assert!(gone.is_err(), "the request is held until Redis answers");
    // The op timeout (1000 ms in redis_init) answers NetworkError to the root after the stream
    // was deleted.
    let ev = gw.wait_events(|e| idx(e, "switch").is_some(), "the Redis callback").await;
    assert!(ev.contains(&"switch 2 1".to_string()), "BadArgument, NetworkError: {ev:?}");
    assert_eq!(up.count("/gone"), 0);
}

/// A Redis cluster without endpoints: `proxy_redis_call` answers InternalFailure (10) at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_call_to_a_cluster_without_endpoints_is_internal_failure() {
    let up = Upstream::start().await;
    let cfg = one_cluster_config(
        &format!("\"{}\"", up.addr),
        true,
        "  - name: outbound|6379||redis.static\n    endpoints: []\n",
    );
    let gw = Gateway::start(&cfg, Some(&redis_plugin()), 1);
    let r = request("POST", &gw.url("/r"), &[("x-cluster", CLUSTER)], &resp(&["PING"])).await;
    assert_eq!(r.status, 600, "InternalFailure (10) surfaced by the plugin");
    gw.wait_events(|e| e.iter().any(|e| e == "call 10 0"), "the call's InternalFailure").await;
}

/// Batching (`buffer_flush_timeout`, `max_buffer_size_before_flush` in the cluster string given
/// to `proxy_redis_init`): commands wait until the buffer is full or the flush timeout passes;
/// several calls in flight are sent together and each reply reaches its own token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_batching_flushes_on_timeout_with_several_calls_in_flight() {
    let up = Upstream::start().await;
    let (addr, seen) = fake_redis().await;
    // Flush timeout 500 ms, under the 1000 ms op timeout (which runs from the call, as in Envoy).
    let plugin = redis_plugin_with(
        "outbound|6379||redis.static?db=1&buffer_flush_timeout=500&max_buffer_size_before_flush=100000",
    );
    let gw = Gateway::start(&redis_config(&up, &addr.to_string()), Some(&plugin), 1);
    let started = Instant::now();
    let calls = (0..3).map(|i| {
        let url = gw.url("/r");
        async move {
            tokio::time::sleep(Duration::from_millis(150 * i)).await;
            let key = format!("k{i}");
            let r = request("POST", &url, &[("x-cluster", CLUSTER)], &resp(&["GET", key.as_str()]))
                .await;
            (r, started.elapsed())
        }
    });
    let done = futures_join_all(calls).await;
    let times: Vec<Duration> = done.iter().map(|(_, t)| *t).collect();
    for (r, t) in &done {
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(*t >= Duration::from_millis(450), "flushed before the timeout: {times:?}");
    }
    let spread = times.iter().max().unwrap().saturating_sub(*times.iter().min().unwrap());
    // One flush 500 ms after the first call: the three answers arrive together (a timer per
    // command would spread them 150 ms apart, like the calls).
    assert!(spread < Duration::from_millis(250), "not sent as one batch: {times:?}");
    let gets: Vec<Vec<String>> =
        seen.lock().unwrap().iter().filter(|c| c[0] == "GET").cloned().collect();
    assert_eq!(gets.len(), 3, "{gets:?}");
    let ev = gw.wait_events(|e| idx(e, "redis 15 ").is_some(), "the third reply").await;
    for token in [7, 11, 15] {
        assert!(ev.iter().any(|e| e.starts_with(&format!("redis {token} 0 "))), "{ev:?}");
    }
}

/// Runs futures concurrently; their outputs in order.
async fn futures_join_all<F>(fs: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = fs.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

/// A Redis that restarts: it answers the first connection's `AUTH`, `SELECT` and first command,
/// then closes it (as a restarted server drops its clients); later connections stay open. Records
/// every connection's commands.
async fn restarting_redis(
) -> (std::net::SocketAddr, std::sync::Arc<std::sync::Mutex<Vec<Vec<String>>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let conns = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let c2 = conns.clone();
    tokio::spawn(async move {
        let mut n = 0;
        loop {
            let Ok((mut s, _)) = l.accept().await else { continue };
            let idx = {
                let mut c = c2.lock().unwrap();
                c.push(Vec::new());
                c.len() - 1
            };
            let first = n == 0;
            n += 1;
            let conns = c2.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut tmp = [0u8; 4096];
                loop {
                    let got = match s.read(&mut tmp).await {
                        Ok(0) | Err(_) => return,
                        Ok(got) => got,
                    };
                    buf.extend_from_slice(&tmp[..got]);
                    while let Ok(Some((frame, used))) = redis_protocol::resp2::decode::decode(&buf)
                    {
                        buf.drain(..used);
                        let cmd = match frame {
                            redis_protocol::resp2::types::OwnedFrame::Array(items) => {
                                match items.into_iter().next() {
                                    Some(redis_protocol::resp2::types::OwnedFrame::BulkString(
                                        b,
                                    )) => String::from_utf8_lossy(&b).to_ascii_uppercase(),
                                    other => format!("{other:?}"),
                                }
                            }
                            other => format!("{other:?}"),
                        };
                        let seen = {
                            let mut c = conns.lock().unwrap();
                            c[idx].push(cmd.clone());
                            c[idx].len()
                        };
                        let reply: &[u8] = match cmd.as_str() {
                            "PING" => b"+PONG\r\n",
                            _ => b"+OK\r\n",
                        };
                        if s.write_all(reply).await.is_err() {
                            return;
                        }
                        if first && seen == 3 {
                            return; // the "restart": this connection closes
                        }
                    }
                }
            });
        }
    });
    (addr, conns)
}

/// Envoy's Redis client (Higress `proxy_redis_init`): when the server drops the connection (a
/// Redis restart), the next call opens a new one and sends `AUTH` and `SELECT` on it again before
/// the command; the call succeeds and the plugin sees no difference.
#[tokio::test(flavor = "multi_thread")]
async fn redis_restart_reconnects_with_auth_and_select_again() {
    let up = Upstream::start().await;
    let (addr, conns) = restarting_redis().await;
    let gw = Gateway::start(&redis_config(&up, &addr.to_string()), Some(&redis_plugin()), 1);
    let r = request("POST", &gw.url("/r"), &[("x-cluster", CLUSTER)], &resp(&["PING"])).await;
    assert_eq!((r.status, r.text().as_str()), (200, "+PONG\r\n"));
    // The server closed that connection after answering; the client notices the close.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = request("POST", &gw.url("/r"), &[("x-cluster", CLUSTER)], &resp(&["PING"])).await;
    assert_eq!(
        (r.status, r.text().as_str()),
        (200, "+PONG\r\n"),
        "the call after the restart succeeds"
    );
    let c = conns.lock().unwrap().clone();
    assert_eq!(c.len(), 2, "a new connection after the restart: {c:?}");
    assert_eq!(c[0], vec!["AUTH", "SELECT", "PING"], "{c:?}");
    assert_eq!(
        c[1],
        vec!["AUTH", "SELECT", "PING"],
        "AUTH and SELECT again on the new connection: {c:?}"
    );
}

/// A Redis whose `SLOW` command answers `+SLOW` after 400 ms (replies stay in order: one
/// command at a time per connection); everything else as `restarting_redis`'s later connections.
/// Records each connection's commands with their arguments.
async fn slow_redis() -> (std::net::SocketAddr, std::sync::Arc<std::sync::Mutex<Vec<Vec<String>>>>)
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let conns = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let c2 = conns.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else { continue };
            let idx = {
                let mut c = c2.lock().unwrap();
                c.push(Vec::new());
                c.len() - 1
            };
            let conns = c2.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut tmp = [0u8; 4096];
                loop {
                    let got = match s.read(&mut tmp).await {
                        Ok(0) | Err(_) => return,
                        Ok(got) => got,
                    };
                    buf.extend_from_slice(&tmp[..got]);
                    while let Ok(Some((frame, used))) = redis_protocol::resp2::decode::decode(&buf)
                    {
                        buf.drain(..used);
                        let args = command_args(frame);
                        conns.lock().unwrap()[idx].push(args.join(" "));
                        let reply: &[u8] = match args.first().map(String::as_str) {
                            Some("SLOW") => {
                                tokio::time::sleep(Duration::from_millis(400)).await;
                                b"+SLOW\r\n"
                            }
                            Some("GARBLE") => {
                                tokio::time::sleep(Duration::from_millis(200)).await;
                                b"?not RESP\r\n"
                            }
                            Some("PING") => b"+PONG\r\n",
                            _ => b"+OK\r\n",
                        };
                        if s.write_all(reply).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, conns)
}

/// Envoy's Redis client closes a connection whose reply it cannot decode (`ClientImpl::onData`
/// catches the protocol error and closes it): every call pending on it fails with NetworkError at
/// once, and the next call opens a new connection. Skipping the bad bytes instead would hand the
/// next reply to the wrong call, or leave the calls to the op timeout.
#[tokio::test(flavor = "multi_thread")]
async fn a_reply_that_is_not_resp_fails_the_calls_on_its_connection() {
    let up = Upstream::start().await;
    let (addr, conns) = slow_redis().await;
    let gw = Gateway::start(&redis_config(&up, &addr.to_string()), Some(&redis_plugin()), 1);
    let url = gw.url("/r");
    let started = Instant::now();
    let garble = resp(&["GARBLE"]);
    let garbled = request("POST", &url, &[("x-cluster", CLUSTER)], &garble);
    // Sent while the first waits for its (bad) reply: pipelined on the same connection.
    let behind = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        request("POST", &url, &[("x-cluster", CLUSTER)], &resp(&["PING"])).await
    };
    let (garbled, behind) = tokio::join!(garbled, behind);
    let took = started.elapsed();
    assert_eq!(garbled.status, 503, "the call answered with bytes that are not RESP: NetworkError");
    assert_eq!(
        behind.status, 503,
        "the call pipelined behind it fails too, never given another call's reply"
    );
    assert!(took < Duration::from_millis(900), "at once, not at the 1000 ms op timeout: {took:?}");
    let r = request("POST", &url, &[("x-cluster", CLUSTER)], &resp(&["PING"])).await;
    assert_eq!((r.status, r.text().as_str()), (200, "+PONG\r\n"), "the next call succeeds");
    let c = conns.lock().unwrap().clone();
    let last = |i: usize| c.get(i).and_then(|cmds| cmds.last()).cloned();
    assert_eq!(c.len(), 2, "a new connection after the bad reply: {c:?}");
    assert_eq!(last(0).as_deref(), Some("PING"), "{c:?}");
    assert_eq!(last(1).as_deref(), Some("PING"), "{c:?}");
}

/// A second `proxy_redis_init` (a plugin that inits again after a failed init, Higress #1517, or
/// on reconfigure), as Higress's Envoy does it (`AsyncClientImpl::initialize` in its
/// `source/common/redis/async_client_impl.cc`): the same settings again change nothing, so the
/// connection and the call in flight on it stay (Higress #4086: reloading a plugin re-inits);
/// other settings close the connection, the call in flight on it fails with NetworkError, and
/// the next call connects with the new settings (`AUTH`, then `SELECT` of the new db).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_redis_init_keeps_the_connection_unless_its_settings_change() {
    let up = Upstream::start().await;
    let (addr, conns) = slow_redis().await;
    // The plugin inits `CLUSTER?db=1` with password "secret" in on_configure.
    let gw = Gateway::start(&redis_config(&up, &addr.to_string()), Some(&redis_plugin()), 1);
    let slow_call = |url: String| async move {
        request("POST", &url, &[("x-cluster", CLUSTER)], &resp(&["SLOW"])).await
    };
    // The re-init comes once the SLOW command is at Redis (in flight on the connection).
    let slow_at_redis = |n: usize| {
        let conns = conns.clone();
        async move {
            let started = Instant::now();
            while conns.lock().unwrap().iter().flatten().filter(|c| *c == "SLOW").count() < n {
                assert!(started.elapsed() < Duration::from_secs(10), "SLOW never reached Redis");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    let held = tokio::spawn(slow_call(gw.url("/r")));
    slow_at_redis(1).await;
    let same = format!("{CLUSTER}?db=1");
    let r = request(
        "POST",
        &gw.url("/r"),
        &[("x-cluster", CLUSTER), ("x-init", &same)],
        &resp(&["PING"]),
    )
    .await;
    assert_eq!((r.status, r.text().as_str()), (200, "+PONG\r\n"));
    let r = held.await.unwrap();
    assert_eq!(
        (r.status, r.text().as_str()),
        (200, "+SLOW\r\n"),
        "the call in flight during a re-init with the same settings was answered"
    );
    assert_eq!(conns.lock().unwrap().len(), 1, "same settings: one connection");

    let held = tokio::spawn(slow_call(gw.url("/r")));
    slow_at_redis(2).await;
    let other = format!("{CLUSTER}?db=2");
    let r = request(
        "POST",
        &gw.url("/r"),
        &[("x-cluster", CLUSTER), ("x-init", &other)],
        &resp(&["PING"]),
    )
    .await;
    assert_eq!((r.status, r.text().as_str()), (200, "+PONG\r\n"));
    let r = held.await.unwrap();
    assert_eq!(r.status, 503, "the call in flight on the closed connection: NetworkError");
    let c = conns.lock().unwrap().clone();
    assert_eq!(c.len(), 2, "other settings: a new connection: {c:?}");
    assert_eq!(c[0], vec!["AUTH secret", "SELECT 1", "SLOW", "PING", "SLOW"], "{c:?}");
    assert_eq!(c[1], vec!["AUTH secret", "SELECT 2", "PING"], "{c:?}");
    let ev =
        gw.wait_events(|e| e.iter().filter(|e| *e == "reinit 0").count() == 2, "2 re-inits").await;
    assert!(ev.iter().any(|e| e.starts_with("redis ") && e.contains(" 1 0")), "{ev:?}");
}

/// A stop as a Higress pod stops, by default: the listeners drain for `drain_timeout_ms` (still
/// accepting: a request during the drain is served, its answer says `connection: close`), then
/// the proxy ends as pilot-agent ends Envoy, with SIGKILL: the root context gets no on_done, and
/// nothing more is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_for_the_drain_time_then_ends_the_proxy_as_sigkill_does() {
    let up = Upstream::start().await;
    let (addr, seen) = fake_redis().await;
    let cfg = format!("drain_timeout_ms: 800\n{}", redis_config(&up, &addr.to_string()));
    let mut gw = Gateway::start(&cfg, Some(&stopping_root_plugin()), 1);
    assert_eq!(get(&gw.url("/p"), &[]).await.status, 200);
    let stopped = Instant::now();
    let during = gw.url("/during-the-drain");
    let (status, r) = tokio::join!(gw.terminate(Duration::from_secs(5)), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        get(&during, &[]).await
    });
    assert_eq!(r.status, 200, "a new connection during the drain is served");
    assert_eq!(r.header("connection").as_deref(), Some("close"), "{:?}", r.headers);
    assert!(status.is_some_and(|s| s.success()), "the gateway did not exit cleanly: {status:?}");
    let took = stopped.elapsed();
    assert!(took >= Duration::from_millis(800), "exited before the drain's end: {took:?}");
    assert!(took < Duration::from_secs(2), "the end waits for nothing: {took:?}");
    let ev = gw.events();
    assert!(!ev.iter().any(|e| e.starts_with("root_done") || e == "root_delete"), "{ev:?}");
    let sets = seen.lock().unwrap().iter().filter(|c| c[0] == "SET").count();
    assert_eq!(sets, 0, "nothing is sent at the end");
}

/// A plugin whose root context, when the gateway stops, sends a Redis command from `on_done`,
/// calls `proxy_done`, answers "not done yet" (false), and would call `proxy_done` from the reply;
/// it logs each step and its root `on_delete`. `proxy_done` is also called once outside a stop
/// (at configure).
fn stopping_root_plugin() -> String {
    let mut w = Wat::new();
    let body = format!(
        r#"
  (import "env" "proxy_done" (func $proxy_done (result i32)))
  (global $root (mut i32) (i32.const 0))
  (func (export "proxy_on_configure") (param $root i32) (param $size i32) (result i32)
    (global.set $root (local.get $root))
    (drop (call $proxy_redis_init {cluster} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 1000)))
    (call $ev_start {ev_early}) (call $ev_num (call $proxy_done)) (call $ev_end)
    (i32.const 1))
  (func (export "proxy_on_done") (param $ctx i32) (result i32)
    (if (i32.ne (local.get $ctx) (global.get $root)) (then (return (i32.const 1))))
    (call $ev_start {ev_done}) (call $ev_num (call $proxy_redis_call {cluster} {cmd} (i32.const 264)))
    (call $ev_num (call $proxy_done)) (call $ev_end)
    (i32.const 0))
  (func (export "proxy_on_redis_call_response") (param $root i32) (param $token i32) (param $status i32) (param $size i32)
    (call $ev_start {ev_reply}) (call $ev_num (local.get $status)) (call $ev_num (call $proxy_done)) (call $ev_end))
  (func (export "proxy_on_delete") (param $ctx i32)
    (if (i32.eq (local.get $ctx) (global.get $root)) (then (call $ev_start {ev_delete}) (call $ev_end))))
"#,
        cluster = w.s(CLUSTER),
        cmd = w.s(&resp(&["SET", "released", "1"])),
        ev_early = w.s("early_done"),
        ev_done = w.s("root_done"),
        ev_reply = w.s("reply"),
        ev_delete = w.s("root_delete"),
    );
    w.module("0_2_100", &body)
}

/// With `exit_after_drain: envoy` (a bare Envoy on SIGTERM: no drain), a stop stops the root
/// context as Envoy 1.40 does when it destroys the VM at exit (proxy-wasm-cpp-host
/// `WasmBase::startShutdown`, after the dispatchers stopped): `proxy_on_done` on the root, where
/// `proxy_done` is NotFound (the root is not pending yet) and a Redis call is accepted (Ok) but
/// never written; it answered false, so no reply, no on_delete, and the gateway exits at once
/// (what the conformance test `at_exit_a_root_context_that_is_not_done_gets_nothing_more` shows
/// for Envoy with an HTTP callout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_runs_the_root_on_done_but_nothing_it_sends_leaves() {
    let up = Upstream::start().await;
    let (addr, seen) = fake_redis().await;
    let cfg = format!(
        "drain_timeout_ms: 0\nexit_after_drain: envoy\n{}",
        redis_config(&up, &addr.to_string())
    );
    let mut gw = Gateway::start(&cfg, Some(&stopping_root_plugin()), 1);
    assert_eq!(get(&gw.url("/p"), &[]).await.status, 200);
    let stopped = Instant::now();
    let status = gw.terminate(Duration::from_secs(10)).await;
    assert!(status.is_some_and(|s| s.success()), "the gateway did not exit cleanly: {status:?}");
    assert!(stopped.elapsed() < Duration::from_secs(2), "no wait for proxy_done: {stopped:?}");
    let ev = gw.events();
    // One worker and the main thread's VM: each root context stops.
    assert_eq!(ev.iter().filter(|e| *e == "early_done 1").count(), 2, "NotFound: {ev:?}");
    assert_eq!(ev.iter().filter(|e| *e == "root_done 0 1").count(), 2, "Ok, NotFound: {ev:?}");
    assert!(!ev.iter().any(|e| e.starts_with("reply") || e == "root_delete"), "{ev:?}");
    let sets = seen.lock().unwrap().iter().filter(|c| c[0] == "SET").count();
    assert_eq!(sets, 0, "a command sent from the root's on_done at exit is never written");
}

/// A RESP command frame as its arguments (a fake Redis server's view of what the gateway sent).
fn command_args(frame: redis_protocol::resp2::types::OwnedFrame) -> Vec<String> {
    use redis_protocol::resp2::types::OwnedFrame;
    match frame {
        OwnedFrame::Array(items) => items
            .into_iter()
            .map(|f| match f {
                OwnedFrame::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
                other => format!("{other:?}"),
            })
            .collect(),
        other => vec![format!("{other:?}")],
    }
}

// ------------------------------------------------------------------ HTTP/2 downstream

/// An HTTP/2 connection with prior knowledge (h2c) to `addr`, and the task driving it (it ends
/// when the connection does).
async fn h2_connect(
    addr: std::net::SocketAddr,
) -> (
    hyper::client::conn::http2::SendRequest<gateway::body::GwBody>,
    tokio::task::JoinHandle<hyper::Result<()>>,
) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .expect("HTTP/2 handshake");
    (send, tokio::spawn(conn))
}

/// A GET over an HTTP/2 connection: status and body.
async fn h2_get(
    send: &mut hyper::client::conn::http2::SendRequest<gateway::body::GwBody>,
    path: &str,
) -> (u16, String) {
    use http_body_util::BodyExt;
    let req = hyper::Request::get(format!("http://h2.test{path}"))
        .body(gateway::body::GwBody::full(bytes::Bytes::new()))
        .unwrap();
    let resp = send.send_request(req).await.expect("HTTP/2 response");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("HTTP/2 body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Logs `hdrs <ctx>` in request headers and `log <ctx>` in on_log; continues.
fn context_logging_plugin() -> String {
    let mut w = Wat::new();
    let body = format!(
        r#"
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (call $ev_start {ev_hdrs}) (call $ev_num (local.get $ctx)) (call $ev_end)
    (i32.const 0))
  (func (export "proxy_on_log") (param $ctx i32)
    (call $ev_start {ev_log}) (call $ev_num (local.get $ctx)) (call $ev_end))
"#,
        ev_hdrs = w.s("hdrs"),
        ev_log = w.s("log"),
    );
    w.module("0_2_100", &body)
}

/// Streams multiplexed on one HTTP/2 connection: five requests to a 500 ms upstream at once
/// each get their own plugin context, all reach the plugin before any ends (they run side by
/// side, not one after another), and all answer 200. With no stream left, the connection idle
/// timeout ends the connection (GOAWAY, as Envoy starts its drain sequence there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_share_a_connection_and_the_idle_timeout_ends_it() {
    let up = Upstream::start().await;
    let cfg = timer_config(&up, ", idle_timeout_ms: 700", "", true);
    let gw = Gateway::start(&cfg, Some(&context_logging_plugin()), 1);
    let (send, conn) = h2_connect(gw.addr).await;
    let gets = (0..5).map(|_| {
        let mut send = send.clone();
        async move { h2_get(&mut send, "/slow").await }
    });
    for r in futures_join_all(gets).await {
        assert_eq!(r, (200, "slow".to_string()));
    }
    let ev = gw
        .wait_events(|e| e.iter().filter(|x| x.starts_with("log ")).count() == 5, "5 on_log")
        .await;
    let first_log = idx(&ev, "log ").unwrap();
    assert_eq!(ev[..first_log].iter().filter(|e| e.starts_with("hdrs ")).count(), 5, "{ev:?}");
    let mut ctxs: Vec<&String> = ev.iter().filter(|e| e.starts_with("hdrs ")).collect();
    ctxs.sort();
    ctxs.dedup();
    assert_eq!(ctxs.len(), 5, "one context per stream: {ev:?}");
    assert_eq!(up.count("/slow"), 5);
    // The client keeps its side open (a dropped `send` would close the connection itself).
    let idle_from = Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(5), conn).await;
    assert!(ended.is_ok(), "the idle HTTP/2 connection was not closed");
    let took = idle_from.elapsed();
    assert!(took >= Duration::from_millis(550), "closed before the idle timeout: {took:?}");
    drop(send);
}

/// A stop (SIGTERM) with an HTTP/2 stream in flight: the stream is answered to its end (its
/// answer, started during the drain, starts the connection's GOAWAY sequence), and the
/// connection is gone once the gateway has exited cleanly after the drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_an_http2_connection() {
    let up = Upstream::start().await;
    let cfg = format!("drain_timeout_ms: 1000\n{}", timer_config(&up, "", "", false));
    let mut gw = Gateway::start(&cfg, None, 1);
    let (mut send, conn) = h2_connect(gw.addr).await;
    let slow = tokio::spawn(async move { h2_get(&mut send, "/slow").await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let status = gw.terminate(Duration::from_secs(10)).await;
    assert!(status.is_some_and(|s| s.success()), "the gateway did not exit cleanly: {status:?}");
    assert_eq!(slow.await.unwrap(), (200, "slow".to_string()));
    let ended = tokio::time::timeout(Duration::from_secs(5), conn).await;
    assert!(ended.is_ok(), "the HTTP/2 connection outlived the gateway");
}
