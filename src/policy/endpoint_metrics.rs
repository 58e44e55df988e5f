//! `endpoint_metrics` (alias `metrics_based`): pick a pod of the routed cluster from its vLLM /
//! SGLang metrics.
//!
//! Flow per request:
//! 1. Read the cluster's host list; only `Healthy` hosts are candidates (as in Go).
//! 2. Metrics source: if any healthy host carries a `metrics` body (Higress health check with
//!    `store_metrics`), those bodies are parsed. Otherwise the plugin scrapes the pods itself
//!    ([`crate::metrics::scrape`]) and reads the shared, fresh snapshots. Hosts without usable or
//!    fresh metrics are "unknown" and not picked; if no host is known, the request passes through to
//!    the gateway's own balancing (never stuck).
//! 3. Decide with [`crate::metrics::schedule`]: the GIE filter chain (`default`) or the `least` /
//!    `most` band of `target_metric`, then a random pick among the survivors.
//! 4. `rate_limit`: a pod that already got more than this share of the worker's recent requests
//!    (`window_size` requests, `window_seconds`) is swapped for another healthy pod.
//!
//! Unlike the Go plugin, which always waits for the body, the body is read only when it can change
//! the answer: `default` with at least one LoRA-enabled pod (the body's `model` names the adapter).
//! Otherwise the decision is made on the request headers, with no body buffering delay.

use super::{Decision, Policy, Stream};
use crate::config::EndpointMetricsConfig;
use crate::host::{Counter, Host, HttpReply, LogLevel};
use crate::metrics::router::{MetricsRouter, PodView, Ranking};
use crate::metrics::schedule::OwnPicks;

/// The `endpoint_metrics` policy (one per config per worker VM).
pub struct EndpointMetrics {
    router: MetricsRouter,
}

/// The request body's `model` (the LoRA adapter or base model name), "" if absent or not JSON.
/// (Only called when a pod has LoRA enabled, so the full parse is rare.)
fn body_model(body: &[u8]) -> String {
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(mut o)) => match o.remove("model") {
            Some(serde_json::Value::String(s)) => s,
            _ => String::new(),
        },
        _ => String::new(),
    }
}

fn now_ms(host: &dyn Host) -> u64 {
    host.now_nanos() / 1_000_000
}

impl EndpointMetrics {
    /// Creates the policy from its config.
    pub fn new(config: EndpointMetricsConfig) -> Self {
        let ranking = Ranking {
            policy: config.metric_policy,
            target_metric: config.target_metric.clone(),
            rate_limit: config.rate_limit,
            window_size: config.window_size,
            window_ms: config.window_seconds.saturating_mul(1000),
            // As before (and as close to Go as a worker's own picks allow): an idle pod takes new
            // requests into its running batch, so they count only on a queueing pod.
            own_picks: OwnPicks::WhenQueueing,
        };
        EndpointMetrics { router: MetricsRouter::new(&config.source, ranking) }
    }

    /// The routed cluster's healthy pods with their metrics; `None` (no host list, no healthy pod,
    /// no metrics source) leaves the request to normal balancing.
    fn pods(&mut self, host: &dyn Host, stream: &Stream, now: u64) -> Option<Vec<PodView>> {
        let list = self.router.host_list(host, &stream.cluster, now)?;
        self.router.gather(host, &stream.cluster, list, now)
    }

    fn decide(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        pods: &[PodView],
        model: &str,
        now: u64,
    ) -> Decision {
        match self.router.choose(host, stream.id, pods, model, now) {
            Some(pod) => {
                host.log(LogLevel::Debug, &format!("endpoint_metrics: model {model:?} -> {pod}"));
                host.increment_counter(Counter::MetricsRouted, 1);
                stream.decision = Some(Counter::MetricsRouted.label().into());
                Decision::Route(pod)
            }
            None => {
                host.log(
                    LogLevel::Debug,
                    "endpoint_metrics: no pod with fresh metrics; using normal balancing",
                );
                host.increment_counter(Counter::FallbackNoMetrics, 1);
                stream.decision = Some(Counter::FallbackNoMetrics.label().into());
                Decision::Passthrough
            }
        }
    }
}

impl Policy for EndpointMetrics {
    fn name(&self) -> &'static str {
        "endpoint_metrics"
    }

    fn on_start(&mut self, host: &mut dyn Host) {
        self.router.on_start(host);
        if !self.router.scrapes() {
            host.log(
                LogLevel::Info,
                "endpoint_metrics: no scrapeCluster set: pod metrics come from the gateway's health \
                 check (store_metrics) only; without them requests use normal balancing",
            );
        }
    }

    fn on_request_headers(&mut self, host: &mut dyn Host, stream: &mut Stream) -> Decision {
        let now = now_ms(host);
        let Some(pods) = self.pods(host, stream, now) else { return Decision::Passthrough };
        // The model name only matters to the LoRA steps of the default chain.
        let lora_pods = pods.iter().any(|p| p.metrics.as_ref().is_some_and(|m| m.lora.is_some()));
        if self.router.uses_filter_chain() && lora_pods && !stream.bodiless {
            return Decision::NeedBody;
        }
        self.decide(host, stream, &pods, "", now)
    }

    fn on_request_body(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        body: &[u8],
    ) -> Decision {
        let now = now_ms(host);
        let Some(pods) = self.pods(host, stream, now) else { return Decision::Passthrough };
        let model = body_model(body);
        self.decide(host, stream, &pods, &model, now)
    }

    fn on_http_reply(
        &mut self,
        host: &mut dyn Host,
        _stream: Option<&mut Stream>,
        token: u32,
        reply: &HttpReply,
    ) -> Decision {
        self.router.on_http_reply(host, token, reply);
        Decision::Passthrough
    }

    fn on_stream_done(&mut self, _host: &mut dyn Host, stream: &mut Stream) {
        self.router.on_stream_done(stream.id);
    }

    fn tick_period_ms(&self) -> u32 {
        self.router.tick_period_ms()
    }

    fn on_tick(&mut self, host: &mut dyn Host) {
        let now = now_ms(host);
        self.router.on_tick(host, now);
    }
}

#[cfg(test)]
#[path = "endpoint_metrics_tests.rs"]
mod tests;
