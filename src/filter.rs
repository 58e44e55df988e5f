//! The request flow (dispatcher), in safe Rust over [`Host`]: `abi.rs` forwards every proxy-wasm
//! callback of one root context here; native tests drive it with the fake host.
//!
//! Guarantees (the reasons are Higress facts, see README "## Design"):
//! * Header pause returns StopIteration (1), which under ABI 0_2_100 still lets body callbacks come.
//! * A bodiless request (headers with end_of_stream) is decided in the headers phase (Higress #3740).
//! * While a decision is pending, body chunks are buffered (StopIterationAndBuffer): returning
//!   Continue from a body callback would release the held headers before the upstream is chosen.
//! * Bodies above `maxBodyBytes` and every error path continue on the gateway's normal balancing.
//! * A stream is never left paused: a `Pending` decision without an outstanding call resumes.
//! * `Policy::on_stream_done` runs exactly once per stream (on_log, else on_done, else on_delete).

use crate::config::{LbConfig, MatchInput, PluginConfig};
use crate::host::{Counter, Host, HostError, HttpReply, LogLevel, RedisReply, UpstreamHost};
use crate::policy::{self, Decision, Policy, Stream};
use crate::types::{DataAction, HeaderAction};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

type PolicyRef = Rc<RefCell<Box<dyn Policy>>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the complete body.
    WaitingBody,
    /// A call is in flight; the request is held.
    Pending,
    /// Decided (or never paused): everything continues.
    Done,
}

struct StreamEntry {
    policy: PolicyRef,
    stream: Stream,
    phase: Phase,
    max_body: usize,
    /// `decisionHeader`, if set.
    decision_header: Option<String>,
    ended: bool,
    outstanding: u32,
}

struct TokenOwner {
    policy: PolicyRef,
    stream: Option<u32>,
}

/// Records the tokens of calls a policy makes, so their replies go back to it.
struct Tracking<'a> {
    inner: &'a mut dyn Host,
    tokens: Vec<u32>,
}

impl Host for Tracking<'_> {
    fn log(&self, level: LogLevel, msg: &str) {
        self.inner.log(level, msg)
    }
    fn now_nanos(&self) -> u64 {
        self.inner.now_nanos()
    }
    fn random_u64(&mut self) -> u64 {
        self.inner.random_u64()
    }
    fn get_property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.inner.get_property(path)
    }
    fn set_property(&mut self, path: &[&str], value: &[u8]) -> Result<(), HostError> {
        self.inner.set_property(path, value)
    }
    fn request_header(&self, name: &str) -> Option<String> {
        self.inner.request_header(name)
    }
    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        self.inner.set_request_header(name, value)
    }
    fn request_body(&self, max: usize) -> Option<Vec<u8>> {
        self.inner.request_body(max)
    }
    fn response_header(&self, name: &str) -> Option<String> {
        self.inner.response_header(name)
    }
    fn response_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        self.inner.response_body(start, max)
    }
    fn upstream_hosts(&self) -> Option<Vec<UpstreamHost>> {
        self.inner.upstream_hosts()
    }
    fn set_upstream_override_host(&mut self, addr: &str) -> Result<(), HostError> {
        self.inner.set_upstream_override_host(addr)
    }
    fn redis_init(
        &mut self,
        cluster: &str,
        username: &str,
        password: &str,
        timeout_ms: u32,
    ) -> Result<(), HostError> {
        self.inner.redis_init(cluster, username, password, timeout_ms)
    }
    fn redis_call(&mut self, cluster: &str, query: &[u8]) -> Result<u32, HostError> {
        let t = self.inner.redis_call(cluster, query)?;
        self.tokens.push(t);
        Ok(t)
    }
    fn http_call(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout_ms: u32,
    ) -> Result<u32, HostError> {
        let t = self.inner.http_call(cluster, headers, body, timeout_ms)?;
        self.tokens.push(t);
        Ok(t)
    }
    fn get_shared_data(&self, key: &str) -> (Option<Vec<u8>>, u32) {
        self.inner.get_shared_data(key)
    }
    fn set_shared_data(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), HostError> {
        self.inner.set_shared_data(key, value, cas)
    }
    fn send_local_response(&mut self, status: u32, body: &[u8], headers: &[(&str, &str)]) {
        self.inner.send_local_response(status, body, headers)
    }
    fn resume_request(&mut self) {
        self.inner.resume_request()
    }
    fn set_effective_stream(&mut self, ctx: u32) -> bool {
        self.inner.set_effective_stream(ctx)
    }
    fn increment_counter(&mut self, counter: Counter, delta: i64) {
        self.inner.increment_counter(counter, delta)
    }
    fn set_response_header(&mut self, name: &str, value: &str) {
        self.inner.set_response_header(name, value)
    }
}

/// The plugin state of one root context: config, policy instances, live streams, call tokens.
#[derive(Default)]
pub struct Filter {
    config: Option<PluginConfig>,
    /// Index = rule index; the default config (if any) is last.
    policies: Vec<Option<PolicyRef>>,
    streams: HashMap<u32, StreamEntry>,
    tokens: HashMap<u32, TokenOwner>,
}

impl Filter {
    /// An unconfigured filter (passes everything through).
    pub fn new() -> Filter {
        Filter::default()
    }

    /// Applies a new plugin configuration. Returns false (plugin start fails) only for a bad config,
    /// with one clear log line; environment errors (Redis unreachable) are logged by the policies.
    pub fn configure(&mut self, host: &mut dyn Host, bytes: &[u8]) -> bool {
        let cfg = match PluginConfig::from_json(bytes) {
            Ok(c) => c,
            Err(e) => {
                host.log(LogLevel::Error, &e.to_string());
                return false;
            }
        };
        for w in &cfg.warnings {
            host.log(LogLevel::Warn, w);
        }
        let mut policies: Vec<Option<PolicyRef>> = Vec::with_capacity(cfg.rules.len() + 1);
        let mut all: Vec<&LbConfig> = cfg.rules.iter().map(|r| &r.config).collect();
        if let Some(d) = &cfg.default {
            all.push(d);
        }
        for c in all {
            let p: PolicyRef = Rc::new(RefCell::new(policy::build(c)));
            self.run_root(host, &p, |pol, h| pol.on_start(h));
            policies.push(Some(p));
        }
        let default_name = match policies.last() {
            Some(Some(p)) if cfg.default.is_some() => p.borrow().name(),
            _ => "none",
        };
        if cfg.default.is_none() {
            policies.push(None);
        }
        host.log(
            LogLevel::Info,
            &format!(
                "ai-load-balancer configured: {} rule(s), default {default_name}",
                cfg.rules.len()
            ),
        );
        self.config = Some(cfg);
        self.policies = policies;
        true
    }

    /// A filter with a single policy for every request (tests of the flow itself).
    #[cfg(test)]
    pub(crate) fn with_policy(policy: Box<dyn Policy>, max_body: usize) -> Filter {
        let mut f = Filter::new();
        f.config = Some(PluginConfig {
            default: Some(LbConfig {
                lb_type: crate::config::LbType::Endpoint,
                policy: crate::config::PolicyConfig::EndpointMetrics(
                    crate::config::EndpointMetricsConfig {
                        metric_policy: crate::config::MetricPolicy::Default,
                        target_metric: None,
                        rate_limit: 1.0,
                        window_size: 1,
                        window_seconds: 1,
                        source: crate::config::PodMetricsSource {
                            metrics_stale_ms: 1000,
                            ..Default::default()
                        },
                    },
                ),
                max_body_bytes: max_body,
                decision_header: Some("x-ai-lb-decision".into()),
            }),
            rules: Vec::new(),
            warnings: Vec::new(),
        });
        f.policies = vec![Some(Rc::new(RefCell::new(policy)))];
        f
    }

    /// Smallest non-zero tick period wanted by any policy (0 = none).
    pub fn tick_period_ms(&self) -> u32 {
        self.policies
            .iter()
            .flatten()
            .filter_map(|p| p.try_borrow().ok().map(|p| p.tick_period_ms()))
            .filter(|t| *t > 0)
            .min()
            .unwrap_or(0)
    }

    /// Root tick: every policy's periodic work, then each held stream's policy may give up on the
    /// call it waits for (the stream is made the effective context to resume it).
    pub fn on_tick(&mut self, host: &mut dyn Host) {
        let policies: Vec<PolicyRef> = self.policies.iter().flatten().cloned().collect();
        for p in policies {
            self.run_root(host, &p, |pol, h| pol.on_tick(h));
        }
        let mut held: Vec<u32> = self
            .streams
            .iter()
            .filter(|(_, e)| e.phase == Phase::Pending)
            .map(|(c, _)| *c)
            .collect();
        held.sort_unstable();
        for ctx in held {
            let decision = self.call_stream(host, ctx, |pol, h, s| pol.on_pending_tick(h, s));
            if matches!(decision, Decision::Pending | Decision::NeedBody) {
                continue;
            }
            self.set_phase(ctx, Phase::Done);
            if !host.set_effective_stream(ctx) {
                host.log(
                    LogLevel::Warn,
                    "ai-load-balancer: could not switch to a held stream to resume it",
                );
                continue;
            }
            if apply_final(host, decision) {
                host.resume_request();
            }
        }
    }

    /// Request headers of stream `ctx`. Returns the header action.
    pub fn on_request_headers(
        &mut self,
        host: &mut dyn Host,
        ctx: u32,
        end_of_stream: bool,
    ) -> HeaderAction {
        let Some(cfg) = &self.config else { return HeaderAction::Continue };
        let route = host.route_name().unwrap_or_default();
        let cluster = host.cluster_name().unwrap_or_default();
        let authority = host.request_header(":authority").unwrap_or_default();
        let Some((idx, lb)) =
            cfg.select(&MatchInput { route: &route, authority: &authority, cluster: &cluster })
        else {
            return HeaderAction::Continue;
        };
        let max_body = lb.max_body_bytes;
        let decision_header = lb.decision_header.clone();
        let Some(Some(p)) = self.policies.get(idx).cloned() else { return HeaderAction::Continue };
        let stream = Stream {
            id: ctx,
            route,
            cluster,
            authority,
            start_ns: host.now_nanos(),
            decision: None,
        };
        let entry = StreamEntry {
            policy: p,
            stream,
            phase: Phase::Done,
            max_body,
            decision_header,
            ended: false,
            outstanding: 0,
        };
        self.streams.insert(ctx, entry);
        let decision =
            self.call_stream(host, ctx, |pol, h, s| pol.on_request_headers(h, s, end_of_stream));
        match decision {
            Decision::NeedBody if end_of_stream => {
                // A body policy asked for a body that will never come: never hang (Higress #3740).
                host.log(LogLevel::Warn, "ai-load-balancer: policy asked for the body of a bodiless request; using normal balancing");
                self.set_phase(ctx, Phase::Done);
                HeaderAction::Continue
            }
            Decision::NeedBody => {
                raise_decoder_buffer_limit(host, max_body);
                self.set_phase(ctx, Phase::WaitingBody);
                HeaderAction::StopIteration
            }
            Decision::Pending => {
                if self.outstanding(ctx) == 0 {
                    host.log(LogLevel::Warn, "ai-load-balancer: pending without a call in flight; using normal balancing");
                    self.set_phase(ctx, Phase::Done);
                    return HeaderAction::Continue;
                }
                self.set_phase(ctx, Phase::Pending);
                HeaderAction::StopIteration
            }
            other => {
                self.set_phase(ctx, Phase::Done);
                if apply_final(host, other) {
                    HeaderAction::Continue
                } else {
                    HeaderAction::StopIteration
                }
            }
        }
    }

    /// A request body chunk; `body_size` is the cumulative buffered size. Returns the data action.
    pub fn on_request_body(
        &mut self,
        host: &mut dyn Host,
        ctx: u32,
        body_size: usize,
        end_of_stream: bool,
    ) -> DataAction {
        let Some(entry) = self.streams.get(&ctx) else { return DataAction::Continue };
        match entry.phase {
            Phase::Done => DataAction::Continue,
            // Hold the data: continuing here would release the held headers before the pick. The
            // body is not needed, so past the buffer limit the client is slowed down (flow
            // control), never answered 413.
            Phase::Pending => DataAction::StopIterationAndWatermark,
            Phase::WaitingBody => {
                if body_size > entry.max_body {
                    let max = entry.max_body;
                    return self.body_too_large(host, ctx, body_size, max);
                }
                if !end_of_stream {
                    return DataAction::StopIterationAndBuffer;
                }
                let Some(body) = host.request_body(body_size) else {
                    host.log(
                        LogLevel::Warn,
                        "ai-load-balancer: request body unavailable; using normal balancing",
                    );
                    self.set_phase(ctx, Phase::Done);
                    return DataAction::Continue;
                };
                self.body_complete(host, ctx, &body)
            }
        }
    }

    /// A waiting body is over `maxBodyBytes`: normal balancing. Returns the data action.
    fn body_too_large(
        &mut self,
        host: &mut dyn Host,
        ctx: u32,
        size: usize,
        max: usize,
    ) -> DataAction {
        host.log(
            LogLevel::Info,
            &format!("ai-load-balancer: request body larger than maxBodyBytes ({size} > {max}); using normal balancing"),
        );
        host.increment_counter(Counter::FallbackBodyTooLarge, 1);
        if let Some(entry) = self.streams.get_mut(&ctx) {
            entry.stream.decision = Some(Counter::FallbackBodyTooLarge.label().to_string());
        }
        self.set_phase(ctx, Phase::Done);
        DataAction::Continue
    }

    /// The complete body of a stream waiting for it: the policy decides. Returns the data action.
    fn body_complete(&mut self, host: &mut dyn Host, ctx: u32, body: &[u8]) -> DataAction {
        let decision = self.call_stream(host, ctx, |pol, h, s| pol.on_request_body(h, s, body));
        match decision {
            Decision::Pending if self.outstanding(ctx) > 0 => {
                self.set_phase(ctx, Phase::Pending);
                DataAction::StopIterationAndBuffer
            }
            Decision::Pending | Decision::NeedBody => {
                self.set_phase(ctx, Phase::Done);
                DataAction::Continue
            }
            other => {
                self.set_phase(ctx, Phase::Done);
                if apply_final(host, other) {
                    DataAction::Continue
                } else {
                    DataAction::StopIterationAndBuffer
                }
            }
        }
    }

    /// Request trailers: the body ended without an end-of-stream body callback. A body policy still
    /// waiting decides now on the buffered body. Returns the trailers action.
    pub fn on_request_trailers(&mut self, host: &mut dyn Host, ctx: u32) -> HeaderAction {
        let Some(entry) = self.streams.get(&ctx) else { return HeaderAction::Continue };
        match entry.phase {
            Phase::Done => HeaderAction::Continue,
            Phase::Pending => HeaderAction::StopIteration,
            Phase::WaitingBody => {
                let max = entry.max_body;
                // One read of up to max+1 bytes: its length says whether the body is over the
                // limit, and it is the body the policy gets (no second copy of it).
                let body = host.request_body(max.saturating_add(1)).unwrap_or_default();
                let action = if body.len() > max {
                    self.body_too_large(host, ctx, body.len(), max)
                } else {
                    self.body_complete(host, ctx, &body)
                };
                match action {
                    DataAction::Continue => HeaderAction::Continue,
                    DataAction::StopIterationAndBuffer | DataAction::StopIterationAndWatermark => {
                        HeaderAction::StopIteration
                    }
                }
            }
        }
    }

    /// Response headers of stream `ctx`.
    pub fn on_response_headers(&mut self, host: &mut dyn Host, ctx: u32) {
        if let Some(entry) = self.streams.get(&ctx) {
            if let Some(name) = &entry.decision_header {
                host.set_response_header(
                    name,
                    entry.stream.decision.as_deref().unwrap_or("normal_balancing"),
                );
            }
            self.call_stream(host, ctx, |pol, h, s| {
                pol.on_response_headers(h, s);
                Decision::Passthrough
            });
        }
    }

    /// A response body chunk of stream `ctx`.
    pub fn on_response_body(
        &mut self,
        host: &mut dyn Host,
        ctx: u32,
        size: usize,
        end_of_stream: bool,
    ) {
        if self.streams.contains_key(&ctx) {
            self.call_stream(host, ctx, |pol, h, s| {
                pol.on_response_body(h, s, size, end_of_stream);
                Decision::Passthrough
            });
        }
    }

    /// The stream ended (proxy_on_log, proxy_on_done): runs `on_stream_done` once.
    pub fn on_stream_end(&mut self, host: &mut dyn Host, ctx: u32) {
        let Some(entry) = self.streams.get_mut(&ctx) else { return };
        if entry.ended {
            return;
        }
        entry.ended = true;
        self.call_stream(host, ctx, |pol, h, s| {
            pol.on_stream_done(h, s);
            Decision::Passthrough
        });
    }

    /// The stream context is deleted: forget it (after `on_stream_end` if that never ran).
    pub fn on_delete(&mut self, host: &mut dyn Host, ctx: u32) {
        self.on_stream_end(host, ctx);
        self.streams.remove(&ctx);
    }

    /// The live stream waiting for the reply with this token, if any. `abi.rs` makes it the
    /// effective context before calling `on_redis_reply` / `on_http_reply`.
    pub fn stream_of_token(&self, token: u32) -> Option<u32> {
        let owner = self.tokens.get(&token)?;
        let s = owner.stream?;
        self.streams.contains_key(&s).then_some(s)
    }

    /// A Redis reply. `stream_active` says whether the effective context was switched to the
    /// owning stream (false: the stream is gone, or the switch failed).
    pub fn on_redis_reply(
        &mut self,
        host: &mut dyn Host,
        token: u32,
        reply: &RedisReply,
        stream_active: bool,
    ) {
        self.on_reply(host, token, stream_active, |pol, h, s, t| {
            pol.on_redis_reply(h, s, t, reply)
        });
    }

    /// An HTTP-call reply (see `on_redis_reply`).
    pub fn on_http_reply(
        &mut self,
        host: &mut dyn Host,
        token: u32,
        reply: &HttpReply,
        stream_active: bool,
    ) {
        self.on_reply(host, token, stream_active, |pol, h, s, t| pol.on_http_reply(h, s, t, reply));
    }

    /// Number of live streams (for tests and leak checks).
    pub fn live_streams(&self) -> usize {
        self.streams.len()
    }

    fn on_reply(
        &mut self,
        host: &mut dyn Host,
        token: u32,
        stream_active: bool,
        f: impl FnOnce(&mut dyn Policy, &mut dyn Host, Option<&mut Stream>, u32) -> Decision,
    ) {
        let Some(owner) = self.tokens.remove(&token) else { return };
        let stream_id = owner.stream.filter(|s| stream_active && self.streams.contains_key(s));
        let Some(sid) = stream_id else {
            // Root-level call, or its stream is gone: the policy may still need the reply (e.g. to
            // undo a +1 for a client that went away while the pick was in flight).
            self.run_root(host, &owner.policy, |pol, h| {
                let _ = f(pol, h, None, token);
            });
            return;
        };
        if let Some(e) = self.streams.get_mut(&sid) {
            e.outstanding = e.outstanding.saturating_sub(1);
        }
        let decision = self.call_stream(host, sid, |pol, h, s| f(pol, h, Some(s), token));
        let Some(entry) = self.streams.get(&sid) else { return };
        if entry.phase != Phase::Pending {
            return; // a fire-and-forget reply; the request is not held
        }
        match decision {
            Decision::Pending if self.outstanding(sid) > 0 => {}
            Decision::Pending | Decision::NeedBody => {
                host.log(
                    LogLevel::Warn,
                    "ai-load-balancer: policy left the request without a pending call; resuming",
                );
                self.set_phase(sid, Phase::Done);
                host.resume_request();
            }
            other => {
                self.set_phase(sid, Phase::Done);
                if apply_final(host, other) {
                    host.resume_request();
                }
            }
        }
    }

    /// Runs a root-level policy callback (start, tick, a reply without its stream), recording the
    /// calls it makes so that their replies come back to this policy.
    fn run_root(
        &mut self,
        host: &mut dyn Host,
        policy: &PolicyRef,
        f: impl FnOnce(&mut dyn Policy, &mut dyn Host),
    ) {
        let mut tracking = Tracking { inner: host, tokens: Vec::new() };
        if let Ok(mut pol) = policy.try_borrow_mut() {
            f(pol.as_mut(), &mut tracking);
        }
        for t in std::mem::take(&mut tracking.tokens) {
            self.tokens.insert(t, TokenOwner { policy: policy.clone(), stream: None });
        }
    }

    /// Runs a policy callback for a live stream, recording the calls it makes.
    fn call_stream(
        &mut self,
        host: &mut dyn Host,
        ctx: u32,
        f: impl FnOnce(&mut dyn Policy, &mut dyn Host, &mut Stream) -> Decision,
    ) -> Decision {
        let Some(entry) = self.streams.get_mut(&ctx) else { return Decision::Passthrough };
        let policy = entry.policy.clone();
        let mut tracking = Tracking { inner: host, tokens: Vec::new() };
        let decision = match policy.try_borrow_mut() {
            Ok(mut pol) => f(pol.as_mut(), &mut tracking, &mut entry.stream),
            Err(_) => Decision::Passthrough,
        };
        let tokens = std::mem::take(&mut tracking.tokens);
        entry.outstanding += tokens.len() as u32;
        for t in tokens {
            self.tokens.insert(t, TokenOwner { policy: policy.clone(), stream: Some(ctx) });
        }
        decision
    }

    fn set_phase(&mut self, ctx: u32, phase: Phase) {
        if let Some(e) = self.streams.get_mut(&ctx) {
            e.phase = phase;
        }
    }

    fn outstanding(&self, ctx: u32) -> u32 {
        self.streams.get(&ctx).map(|e| e.outstanding).unwrap_or(0)
    }
}

/// Lets this stream buffer up to `max_body` bytes while the plugin waits for the whole body. Higress's default
/// downstream buffer limit is 32 KiB and a held body over it is answered 413 by Envoy, so every plugin
/// that reads bodies raises it per stream, as Higress's own AI plugins do (wasm-go
/// `SetRequestBodyBufferLimit`). A host without the property (upstream Envoy) keeps its own limit.
fn raise_decoder_buffer_limit(host: &mut dyn Host, max_body: usize) {
    let limit = u32::try_from(max_body).unwrap_or(u32::MAX).to_string();
    if let Err(e) = host.set_property(&["set_decoder_buffer_limit"], limit.as_bytes()) {
        host.log(
            LogLevel::Debug,
            &format!("ai-load-balancer: set_decoder_buffer_limit not supported by the host: {e:?}"),
        );
    }
}

/// Applies a final decision to the current stream. Returns true when the request should continue
/// (false after a local reply).
fn apply_final(host: &mut dyn Host, d: Decision) -> bool {
    match d {
        Decision::Route(addr) => {
            if let Err(e) = host.set_upstream_override_host(&addr) {
                host.log(
                    LogLevel::Warn,
                    &format!("ai-load-balancer: set_upstream_override_host({addr}) failed: {e}"),
                );
            }
            true
        }
        Decision::SetHeader { name, value } => {
            host.set_request_header(&name, Some(&value));
            true
        }
        Decision::Reject { status, body } => {
            host.send_local_response(status, body.as_bytes(), &[("content-type", "text/plain")]);
            false
        }
        Decision::Passthrough | Decision::NeedBody | Decision::Pending => true,
    }
}

#[cfg(test)]
#[path = "filter_tests.rs"]
mod tests;
