//! Helpers shared by the unit tests (compiled only for tests).

use crate::config::KeyRules;
use crate::filter::Filter;
use crate::host::fake::FakeHost;
use crate::host::RedisReply;
use crate::redis::{decode_reply, Frame};

/// Every combination of `prefix_cache`'s key rules.
pub fn every_key_rules() -> Vec<KeyRules> {
    let both = [false, true];
    let mut all = Vec::new();
    for after_system_prompt in both {
        for after_tool_results in both {
            for scoped in both {
                all.push(KeyRules { after_system_prompt, after_tool_results, scoped });
            }
        }
    }
    all
}

/// A configured filter and a fake host with hosts .1, .2 healthy and .3 unhealthy.
pub fn setup(config: &str) -> (Filter, FakeHost) {
    let mut host = FakeHost::new();
    host.set_hosts(&[("10.0.0.1:8000", true), ("10.0.0.2:8000", true), ("10.0.0.3:8000", false)]);
    let mut f = Filter::new();
    assert!(f.configure(&mut host, config.as_bytes()), "config rejected: {:?}", host.logs.borrow());
    (f, host)
}

/// Delivers a Redis reply as `abi.rs` does: with the stream held for it (made the current
/// context), else without a stream.
pub fn deliver(f: &mut Filter, host: &mut FakeHost, token: u32, reply: RedisReply) {
    let held = f.stream_of_token(token).is_some();
    f.on_redis_reply(host, token, &reply, held);
}

/// Starts a bodiless request on stream `ctx` and answers its pick: admitted to `addr`.
pub fn route_to(f: &mut Filter, host: &mut FakeHost, ctx: u32, addr: &str) {
    f.on_request_headers(host, ctx, true);
    let t = host.last_redis_token().expect("a pick was sent");
    deliver(f, host, t, RedisReply::Ok(pick_reply(addr, 1, true, None)));
}

/// The `n`-th Redis command sent, as strings.
pub fn command(host: &FakeHost, n: usize) -> Vec<String> {
    match decode_reply(&host.redis_calls[n].query).expect("valid RESP") {
        Frame::Array(parts) => parts
            .into_iter()
            .map(|p| match p {
                Frame::BulkString(b) => String::from_utf8(b).expect("utf8"),
                other => panic!("not a bulk string: {other:?}"),
            })
            .collect(),
        other => panic!("not an array: {other:?}"),
    }
}

/// Splits an EVAL/EVALSHA command into (keys, args).
pub fn keys_args(cmd: &[String]) -> (Vec<String>, Vec<String>) {
    let n: usize = cmd[2].parse().expect("numkeys");
    (cmd[3..3 + n].to_vec(), cmd[3 + n..].to_vec())
}

/// RESP bytes of a script reply `{host, count, admitted[, matched]}`.
pub fn pick_reply(host: &str, count: i64, admitted: bool, matched: Option<i64>) -> Vec<u8> {
    let mut frames = vec![
        Frame::BulkString(host.as_bytes().to_vec()),
        Frame::Integer(count),
        Frame::Integer(admitted as i64),
    ];
    if let Some(m) = matched {
        frames.push(Frame::Integer(m));
    }
    let f = Frame::Array(frames);
    let mut buf = vec![0u8; 256 + host.len()];
    let n = redis_protocol::resp2::encode::encode(&mut buf, &f, false).expect("encode");
    buf.truncate(n);
    buf
}

/// One request's release the plugin sent: in a release script call, or carried by a pick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseSent {
    /// The in-flight hash key.
    pub inflight: String,
    /// The picking owner's id.
    pub owner: String,
    /// The request id.
    pub request: String,
    /// True for the cancel of a pick the plugin gave up on.
    pub abandoned: bool,
}

/// Whether `cmd` runs `source` (EVALSHA, or EVAL after NOSCRIPT).
fn runs(cmd: &[String], source: &str) -> bool {
    match (cmd.first().map(String::as_str), cmd.get(1)) {
        (Some("EVALSHA"), Some(x)) => *x == crate::redis::sha1_hex_lower(source.as_bytes()),
        (Some("EVAL"), Some(x)) => x == source,
        _ => false,
    }
}

/// The releases sent, one per request, in order: those of release script calls, and those that
/// picks carried (each send counts, also a resend with EVAL after NOSCRIPT).
pub fn releases(host: &FakeHost) -> Vec<ReleaseSent> {
    let mut out = Vec::new();
    for c in (0..host.redis_calls.len()).map(|i| command(host, i)) {
        let (keys, args) = if c.first().is_some_and(|x| x.starts_with("EVAL")) {
            keys_args(&c)
        } else {
            continue;
        };
        let one = |request: &str, abandoned: bool, owner: &str| ReleaseSent {
            inflight: keys[0].clone(),
            owner: owner.to_string(),
            request: request.to_string(),
            abandoned,
        };
        if runs(&c, crate::redis::RELEASE_LUA) {
            for e in args[1].split(',').filter(|e| !e.is_empty()) {
                out.push(one(e.split('=').next().unwrap_or_default(), false, &args[0]));
            }
            if let Some(id) = args.get(2) {
                out.push(one(id, true, &args[0]));
            }
        } else if runs(&c, crate::redis::LEAST_REQUEST_LUA.as_str())
            || runs(&c, crate::redis::PREFIX_CACHE_LUA.as_str())
        {
            for e in args[3].split(',').skip(1) {
                out.push(one(e.split('=').next().unwrap_or_default(), false, &args[2]));
            }
        }
    }
    out
}

/// The release the plugin must send for the pick sent as the `n`-th Redis command: of a request
/// it admitted, or (`abandoned`) the cancel of the pick it gave up on.
pub fn release_of(fake: &FakeHost, n: usize, abandoned: bool) -> ReleaseSent {
    let (keys, args) = keys_args(&command(fake, n));
    ReleaseSent {
        inflight: keys[0].clone(),
        owner: args[2].clone(),
        request: args[3].split(',').next().unwrap_or_default().to_string(),
        abandoned,
    }
}

/// A pod's vLLM V1 `/metrics` text with these gauges.
pub fn vllm_metrics(running: u32, waiting: u32, kv_cache_usage: f64) -> String {
    format!(
        "vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}.0\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}.0\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {kv_cache_usage}\n"
    )
}

/// Hosts .1 and .2 healthy with these metrics bodies (as a Higress health check stores them),
/// .3 unhealthy and idle.
pub fn set_hosts_with_metrics(host: &mut FakeHost, one: String, two: String) {
    use crate::host::{Health, UpstreamHost};
    let pod = |address: &str, health, metrics: String| UpstreamHost {
        address: address.to_string(),
        health,
        metrics: Some(metrics.into()),
    };
    host.hosts = Some(vec![
        pod("10.0.0.1:8000", Health::Healthy, one),
        pod("10.0.0.2:8000", Health::Healthy, two),
        pod("10.0.0.3:8000", Health::Unhealthy, vllm_metrics(0, 0, 0.0)),
    ]);
}
