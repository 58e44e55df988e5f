//! The request flow (dispatcher), in safe Rust over [`Host`]: `abi.rs` forwards every proxy-wasm
//! callback of one root context here; native tests drive it with the fake host.
//!
//! Guarantees (the reasons are Higress facts, see README "## Design"):
//! * Header pause returns StopIteration, which under ABI 0_2_100 still lets body callbacks come.
//! * A bodiless request (headers with end_of_stream) is decided in the headers phase (Higress #3740).
//! * While a decision is pending, body chunks are held (StopIterationAndBuffer/Watermark):
//!   returning Continue from a body callback would release the held headers before the upstream is
//!   chosen.
//! * Bodies above `maxBodyBytes` and every error path continue on the gateway's normal balancing.
//! * A stream is held only while it waits for one named call (`Decision::Pending(token)`): the
//!   reply (or NetworkError) to that call, or the policy giving up at a tick, decides and resumes it.
//! * `Policy::on_stream_done` runs exactly once per stream (on_log, else on_done, else on_delete).

use crate::config::{LbConfig, MatchInput, PluginConfig, RuleMatch, CONSUMER_HEADER};
use crate::host::{Counter, Host, HttpReply, LogLevel, RedisReply};
use crate::policy::{self, Decision, Policy, Stream};
use crate::types::{DataAction, HeaderAction};
use rustc_hash::FxHashMap;
use std::cell::RefCell;
use std::rc::Rc;

/// A `_rules_` entry, or the top-level config, with the policy instance that serves it.
struct Route {
    /// What the rule matches; `None` for the top-level config, which takes what no rule matched.
    matcher: Option<RuleMatch>,
    policy: RefCell<Box<dyn Policy>>,
    /// `maxBodyBytes`.
    max_body: usize,
    /// `decisionHeader`, if set.
    decision_header: Option<String>,
}

impl Route {
    fn new(matcher: Option<RuleMatch>, config: &LbConfig) -> Route {
        Route {
            matcher,
            policy: RefCell::new(policy::build(config)),
            max_body: config.max_body_bytes,
            decision_header: config.decision_header.clone(),
        }
    }

    fn matches(&self, input: &MatchInput<'_>) -> bool {
        self.matcher.as_ref().is_none_or(|m| m.matches(input))
    }

    /// Runs a callback of this route's policy; `default` if the policy is already running (a
    /// re-entrant host call), so that nothing ever panics.
    fn call<R>(&self, default: R, f: impl FnOnce(&mut dyn Policy) -> R) -> R {
        match self.policy.try_borrow_mut() {
            Ok(mut p) => f(p.as_mut()),
            Err(_) => default,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the complete body.
    WaitingBody,
    /// Held until the reply to this call (its token) arrives, or the policy gives up at a tick.
    Waiting(u32),
    /// Decided (or never paused): everything continues.
    Done,
}

struct StreamEntry {
    route: Rc<Route>,
    stream: Stream,
    phase: Phase,
    ended: bool,
}

/// What a decision did to the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settled {
    /// Held for a call's reply.
    Held,
    /// Goes upstream.
    Continues,
    /// Answered locally: must not continue.
    Replied,
}

impl Settled {
    fn header_action(self) -> HeaderAction {
        match self {
            Settled::Continues => HeaderAction::Continue,
            Settled::Held | Settled::Replied => HeaderAction::StopIteration,
        }
    }

    fn data_action(self) -> DataAction {
        match self {
            Settled::Continues => DataAction::Continue,
            Settled::Held | Settled::Replied => DataAction::StopIterationAndBuffer,
        }
    }
}

/// The plugin state of one root context: routes with their policies, live streams, held calls.
#[derive(Default)]
pub struct Filter {
    /// The rules in order, then the top-level config: the first that matches serves a request.
    routes: Vec<Rc<Route>>,
    /// The routes of the configuration before the last one: their policies may still get replies
    /// to calls made before the change.
    previous: Vec<Rc<Route>>,
    /// Whether a rule matches on the consumer header (read only then).
    reads_consumer: bool,
    streams: FxHashMap<u32, StreamEntry>,
    /// Call token -> the stream held for its reply.
    waiting: FxHashMap<u32, u32>,
    stop: RootStop,
}

/// How long a stopping root waits for the replies to its releases (each is bounded by the Redis
/// `timeout`, 3 s by default; one resent after NOSCRIPT takes two).
const MAX_STOP_WAIT_NS: u64 = 5_000_000_000;

/// Where the root context is in its stop (see [`Filter::on_stop`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum RootStop {
    #[default]
    Running,
    /// `proxy_on_done` said not done (at this time, ns): the policies wait for replies to what
    /// they sent.
    Stopping(u64),
    /// Done (said by `proxy_on_done` or by `proxy_done`).
    Done,
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
        for &counter in Counter::ALL {
            host.define_counter(counter);
        }
        let rules = cfg.rules.len();
        let reads_consumer = cfg.matches_consumers();
        let mut routes: Vec<Rc<Route>> = cfg
            .rules
            .into_iter()
            .map(|r| Rc::new(Route::new(Some(r.matcher), &r.config)))
            .collect();
        routes.extend(cfg.default.map(|d| Rc::new(Route::new(None, &d))));
        for r in &routes {
            r.call((), |p| p.on_start(host));
        }
        let default_name = routes
            .last()
            .filter(|r| r.matcher.is_none())
            .and_then(|r| r.policy.try_borrow().ok().map(|p| p.name()))
            .unwrap_or("none");
        host.log(
            LogLevel::Info,
            &format!("ai-load-balancer configured: {rules} rule(s), default {default_name}"),
        );
        self.previous = std::mem::replace(&mut self.routes, routes);
        self.reads_consumer = reads_consumer;
        true
    }

    /// A filter with a single policy for every request (tests of the flow itself).
    #[cfg(test)]
    pub(crate) fn with_policy(policy: Box<dyn Policy>, max_body: usize) -> Filter {
        let route = Route {
            matcher: None,
            policy: RefCell::new(policy),
            max_body,
            decision_header: Some("x-ai-lb-decision".into()),
        };
        Filter { routes: vec![Rc::new(route)], ..Filter::default() }
    }

    /// Smallest non-zero tick period wanted by any policy (0 = none).
    pub fn tick_period_ms(&self) -> u32 {
        self.routes
            .iter()
            .filter_map(|r| r.policy.try_borrow().ok().map(|p| p.tick_period_ms()))
            .filter(|t| *t > 0)
            .min()
            .unwrap_or(0)
    }

    /// Root tick: every policy's periodic work, then each held stream's policy may give up on the
    /// call it waits for (the stream is made the effective context to resume it).
    pub fn on_tick(&mut self, host: &mut dyn Host) {
        // The previous configuration's policies too: the requests they routed before a
        // reconfigure still end, and their releases and lease heartbeats go out on the tick (else
        // their owner would be reaped with those requests in flight, and counts run low).
        for r in self.routes.iter().chain(&self.previous) {
            r.call((), |p| p.on_tick(host));
        }
        self.report_stopped(host);
        let mut held: Vec<u32> = self
            .streams
            .iter()
            .filter(|(_, e)| matches!(e.phase, Phase::Waiting(_)))
            .map(|(c, _)| *c)
            .collect();
        held.sort_unstable();
        for ctx in held {
            // The stream is made current first: a pick given up here is decided without Redis,
            // by the pods' metrics in the stream's cluster, which the host gives only to the
            // stream's own context (at the root it has no upstream hosts).
            let switched = host.set_effective_stream(ctx);
            let Some(decision) = self.call_stream(ctx, None, |p, s| p.on_pending_tick(host, s))
            else {
                continue;
            };
            if !switched {
                host.log(
                    LogLevel::Warn,
                    "ai-load-balancer: could not switch to a held stream to resume it",
                );
                self.set_phase(ctx, Phase::Done);
                continue;
            }
            if self.settle(host, ctx, decision) == Settled::Continues {
                host.resume_request();
            }
        }
    }

    /// Request headers of stream `ctx`.
    pub fn on_request_headers(
        &mut self,
        host: &mut dyn Host,
        ctx: u32,
        end_of_stream: bool,
    ) -> HeaderAction {
        let route = host.route_name().unwrap_or_default();
        let cluster = host.cluster_name().unwrap_or_default();
        let authority = host.request_header(":authority").unwrap_or_default();
        let consumer = if self.reads_consumer {
            host.request_header(CONSUMER_HEADER).unwrap_or_default()
        } else {
            String::new()
        };
        let input = MatchInput {
            route: &route,
            authority: &authority,
            cluster: &cluster,
            consumer: &consumer,
        };
        let Some(served_by) = self.routes.iter().find(|r| r.matches(&input)).cloned() else {
            return HeaderAction::Continue;
        };
        let max_body = served_by.max_body;
        let stream = Stream {
            id: ctx,
            route,
            cluster,
            authority,
            bodiless: end_of_stream,
            start_ns: host.now_nanos(),
            decision: None,
        };
        let entry = StreamEntry { route: served_by, stream, phase: Phase::Done, ended: false };
        self.streams.insert(ctx, entry);
        let decision =
            self.call_stream(ctx, Decision::Passthrough, |p, s| p.on_request_headers(host, s));
        if decision == Decision::NeedBody && !end_of_stream {
            // A body its `content-length` already puts over the limit is not waited for: once
            // held, Envoy would answer the chunk that crosses the stream's buffer limit 413.
            let declared =
                host.request_header("content-length").and_then(|v| v.trim().parse().ok());
            if let Some(size) = declared.filter(|&size: &usize| size > max_body) {
                return self.body_too_large(host, ctx, size, max_body).header_action();
            }
            raise_decoder_buffer_limit(host, max_body);
            self.set_phase(ctx, Phase::WaitingBody);
            return HeaderAction::StopIteration;
        }
        self.settle(host, ctx, decision).header_action()
    }

    /// A request body chunk; `body_size` is the cumulative buffered size.
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
            Phase::Waiting(_) => DataAction::StopIterationAndWatermark,
            Phase::WaitingBody => {
                let max = entry.route.max_body;
                if body_size > max {
                    return self.body_too_large(host, ctx, body_size, max).data_action();
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
                self.body_complete(host, ctx, &body).data_action()
            }
        }
    }

    /// A waiting body is over `maxBodyBytes`: normal balancing.
    fn body_too_large(
        &mut self,
        host: &mut dyn Host,
        ctx: u32,
        size: usize,
        max: usize,
    ) -> Settled {
        host.log(
            LogLevel::Info,
            &format!(
                "ai-load-balancer: request body larger than maxBodyBytes ({size} > {max}); using \
                 normal balancing"
            ),
        );
        host.increment_counter(Counter::FallbackBodyTooLarge, 1);
        if let Some(entry) = self.streams.get_mut(&ctx) {
            entry.stream.decision = Some(Counter::FallbackBodyTooLarge.label().to_string());
        }
        self.set_phase(ctx, Phase::Done);
        Settled::Continues
    }

    /// The complete body of a stream waiting for it: the policy decides.
    fn body_complete(&mut self, host: &mut dyn Host, ctx: u32, body: &[u8]) -> Settled {
        let decision =
            self.call_stream(ctx, Decision::Passthrough, |p, s| p.on_request_body(host, s, body));
        self.settle(host, ctx, decision)
    }

    /// Request trailers: the body ended without an end-of-stream body callback. A body policy still
    /// waiting decides now on the buffered body.
    pub fn on_request_trailers(&mut self, host: &mut dyn Host, ctx: u32) -> HeaderAction {
        let Some(entry) = self.streams.get(&ctx) else { return HeaderAction::Continue };
        match entry.phase {
            Phase::Done => HeaderAction::Continue,
            Phase::Waiting(_) => HeaderAction::StopIteration,
            Phase::WaitingBody => {
                let max = entry.route.max_body;
                // One read of up to max+1 bytes: its length says whether the body is over the
                // limit, and it is the body the policy gets (no second copy of it).
                let body = host.request_body(max.saturating_add(1)).unwrap_or_default();
                let settled = if body.len() > max {
                    self.body_too_large(host, ctx, body.len(), max)
                } else {
                    self.body_complete(host, ctx, &body)
                };
                settled.header_action()
            }
        }
    }

    /// Response headers of stream `ctx`.
    pub fn on_response_headers(&mut self, host: &mut dyn Host, ctx: u32) {
        if let Some(entry) = self.streams.get(&ctx) {
            if let Some(name) = &entry.route.decision_header {
                host.set_response_header(
                    name,
                    entry.stream.decision.as_deref().unwrap_or("normal_balancing"),
                );
            }
            self.call_stream(ctx, (), |p, s| p.on_response_headers(host, s));
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
        self.call_stream(ctx, (), |p, s| p.on_response_body(host, s, size, end_of_stream));
    }

    /// The stream ended (proxy_on_log, proxy_on_done): runs `on_stream_done` once. A reply the
    /// stream still waited for then goes to the policies without it.
    pub fn on_stream_end(&mut self, host: &mut dyn Host, ctx: u32) {
        let Some(entry) = self.streams.get_mut(&ctx) else { return };
        if entry.ended {
            return;
        }
        entry.ended = true;
        self.call_stream(ctx, (), |p, s| p.on_stream_done(host, s));
        self.set_phase(ctx, Phase::Done);
    }

    /// The stream context is deleted: forget it (after `on_stream_end` if that never ran).
    pub fn on_delete(&mut self, host: &mut dyn Host, ctx: u32) {
        self.on_stream_end(host, ctx);
        self.streams.remove(&ctx);
    }

    /// The live stream held for the reply with this token, if any. `abi.rs` makes it the
    /// effective context before calling `on_redis_reply` / `on_http_reply`.
    pub fn stream_of_token(&self, token: u32) -> Option<u32> {
        self.waiting.get(&token).copied()
    }

    /// A Redis reply. `stream_active` says whether the effective context was switched to the
    /// stream held for it (false: no stream waits for it, or the switch failed).
    pub fn on_redis_reply(
        &mut self,
        host: &mut dyn Host,
        token: u32,
        reply: &RedisReply,
        stream_active: bool,
    ) {
        self.on_reply(host, token, stream_active, |p, h, s| p.on_redis_reply(h, s, token, reply));
    }

    /// An HTTP-call reply (see `on_redis_reply`).
    pub fn on_http_reply(
        &mut self,
        host: &mut dyn Host,
        token: u32,
        reply: &HttpReply,
        stream_active: bool,
    ) {
        self.on_reply(host, token, stream_active, |p, h, s| p.on_http_reply(h, s, token, reply));
    }

    /// The root context stops (`proxy_on_done`): every policy sends what waited for later.
    /// Returns whether the root is done now; if not, `Host::root_done` is called once the replies
    /// the policies wait for have come. This helps when Envoy stops a root while it runs (its
    /// configuration replaced or removed: Envoy keeps the root, with its answers and ticks, until
    /// then); at Envoy's exit nothing sent here leaves, and a Higress pod's agent ends Envoy
    /// with SIGKILL after its drain, so it is not even called there (conformance tests in `gateway/`:
    /// `envoy_keeps_a_replaced_configurations_root_until_proxy_done`,
    /// `at_exit_a_root_context_that_is_not_done_gets_nothing_more`).
    pub fn on_stop(&mut self, host: &mut dyn Host) -> bool {
        if self.stop != RootStop::Running {
            return self.stop == RootStop::Done;
        }
        let mut done = true;
        for r in self.routes.iter().chain(&self.previous) {
            done &= r.call(true, |p| p.on_stop(host));
        }
        self.stop = if done { RootStop::Done } else { RootStop::Stopping(host.now_nanos()) };
        done
    }

    /// A stopping root whose policies got their last replies says so; so does one that waited
    /// [`MAX_STOP_WAIT_NS`] (a reply that never comes must not keep the VM alive for good).
    fn report_stopped(&mut self, host: &mut dyn Host) {
        let RootStop::Stopping(since) = self.stop else { return };
        let stopped =
            self.routes.iter().chain(&self.previous).all(|r| r.call(false, |p| p.stopped()));
        let waited = host.now_nanos().saturating_sub(since) >= MAX_STOP_WAIT_NS;
        if waited && !stopped {
            host.log(
                LogLevel::Warn,
                "ai-load-balancer: stopping without the replies to some releases; other gateways \
                 release this one's records when its lease runs out",
            );
        }
        if stopped || waited {
            self.stop = RootStop::Done;
            host.root_done();
        }
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
        f: impl Fn(&mut dyn Policy, &mut dyn Host, Option<&mut Stream>) -> Decision,
    ) {
        let held = self.stream_of_token(token);
        let Some(ctx) = held.filter(|_| stream_active) else {
            if let Some(ctx) = held {
                self.set_phase(ctx, Phase::Done); // the host could not switch to it: it is gone
            }
            // No stream waits for it (a release, heartbeat or scrape; a stream that ended or gave
            // up): each policy knows its own calls and ignores the others'. A policy may still
            // need the reply, e.g. to undo a +1 for a client that went away meanwhile.
            for r in self.routes.iter().chain(&self.previous) {
                r.call((), |p| {
                    f(p, host, None);
                });
            }
            self.report_stopped(host);
            return;
        };
        self.set_phase(ctx, Phase::Done);
        let mut decision = self.call_stream(ctx, Decision::Passthrough, |p, s| f(p, host, Some(s)));
        if decision == Decision::Pending(token) {
            host.log(
                LogLevel::Warn,
                "ai-load-balancer: policy keeps waiting for a call already answered; resuming",
            );
            decision = Decision::Passthrough;
        }
        if self.settle(host, ctx, decision) == Settled::Continues {
            host.resume_request();
        }
    }

    /// Applies a policy's decision to stream `ctx`, which is the current context: the one place a
    /// decision takes effect.
    fn settle(&mut self, host: &mut dyn Host, ctx: u32, decision: Decision) -> Settled {
        let settled = match decision {
            Decision::Pending(token) => {
                self.set_phase(ctx, Phase::Waiting(token));
                return Settled::Held;
            }
            Decision::NeedBody => {
                // No body callback will come (bodiless request, Higress #3740; or the body was
                // already delivered): never hang.
                host.log(
                    LogLevel::Warn,
                    "ai-load-balancer: policy asked for a body that will not come; using normal \
                     balancing",
                );
                Settled::Continues
            }
            Decision::Passthrough => Settled::Continues,
            Decision::Route(addr) => {
                if let Err(e) = host.set_upstream_override_host(&addr) {
                    host.log(
                        LogLevel::Warn,
                        &format!(
                            "ai-load-balancer: set_upstream_override_host({addr}) failed: {e}"
                        ),
                    );
                }
                Settled::Continues
            }
            Decision::SetHeader { name, value } => {
                host.set_request_header(&name, Some(&value));
                Settled::Continues
            }
            Decision::Reject { status, body } => {
                host.send_local_response(
                    status,
                    body.as_bytes(),
                    &[("content-type", "text/plain")],
                );
                Settled::Replied
            }
        };
        self.set_phase(ctx, Phase::Done);
        settled
    }

    /// Runs a policy callback for live stream `ctx`; `default` if there is none.
    fn call_stream<R>(
        &mut self,
        ctx: u32,
        default: R,
        f: impl FnOnce(&mut dyn Policy, &mut Stream) -> R,
    ) -> R {
        let Some(entry) = self.streams.get_mut(&ctx) else { return default };
        let route = Rc::clone(&entry.route);
        route.call(default, |p| f(p, &mut entry.stream))
    }

    fn set_phase(&mut self, ctx: u32, phase: Phase) {
        let Some(entry) = self.streams.get_mut(&ctx) else { return };
        if let Phase::Waiting(token) = entry.phase {
            self.waiting.remove(&token);
        }
        if let Phase::Waiting(token) = phase {
            self.waiting.insert(token, ctx);
        }
        entry.phase = phase;
    }
}

/// How far the stream's buffer limit is set above `maxBodyBytes`: room for the data chunk that takes
/// a held body past `maxBodyBytes` (one socket read, at most the connection's buffer limit, or an
/// HTTP/2 DATA frame, 16 KiB by default), so that the plugin sees that chunk and lets the body
/// through before Envoy's limit is crossed. 1 MiB is also stock Envoy's default limit, so the plugin
/// never lowers a limit that an untouched Envoy would have had.
const BUFFER_LIMIT_MARGIN: usize = 1 << 20;

/// Lets this stream buffer more than `max_body` bytes while the plugin waits for the whole body.
/// Higress's default downstream buffer limit is 32 KiB and a held body over it is answered 413 by
/// Envoy, so every plugin that reads bodies raises it per stream, as Higress's own AI plugins do
/// (wasm-go `SetRequestBodyBufferLimit`). Envoy's wasm filter adds each chunk to the held body
/// *before* the plugin sees it, and a chunk that takes the body over the limit gets 413 whatever
/// the plugin answers: so the limit is `max_body` plus [`BUFFER_LIMIT_MARGIN`], and the plugin lets
/// a body through (normal balancing) at the first chunk past `max_body`, below Envoy's limit. A
/// host without the property (upstream Envoy) keeps its own limit.
fn raise_decoder_buffer_limit(host: &mut dyn Host, max_body: usize) {
    let limit = max_body.saturating_add(BUFFER_LIMIT_MARGIN);
    let limit = u32::try_from(limit).unwrap_or(u32::MAX).to_string();
    if let Err(e) = host.set_property(&["set_decoder_buffer_limit"], limit.as_bytes()) {
        host.log(
            LogLevel::Debug,
            &format!("ai-load-balancer: set_decoder_buffer_limit not supported by the host: {e:?}"),
        );
    }
}

#[cfg(test)]
#[path = "filter_tests.rs"]
mod tests;
