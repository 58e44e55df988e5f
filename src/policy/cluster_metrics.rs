//! `cluster_metrics` (`lb_type: cluster`): pick a service (Envoy cluster) from `service_list` and
//! write its name to the request header `cluster_header`; the gateway's route takes its cluster
//! from that header (Envoy `RouteAction.cluster_header`).
//!
//! Measurements, kept per worker VM like the Go plugin (no cross-worker traffic on the request path;
//! each worker sees a fair sample of the same services, so its averages and in-flight ordering
//! agree with the others'):
//! - in flight: +1 when a service is chosen, −1 exactly once when the stream ends (whatever the
//!   outcome);
//! - total latency: request headers → end of stream, mean of the last `queue_size` requests;
//! - first-token latency: request headers → first response body bytes, mean of the last
//!   `queue_size` requests;
//! - a failed request (`:status` other than 200, or no response at all) is recorded as
//!   2 × max(its own time, the highest mean of any service), as Go does, so a failing service
//!   loses traffic quickly; a request that ends without any body also gets such a first-token sample
//!   (Go records none, which makes a service that resets connections look fast).
//!
//! `mode: AdaptiveScore` (the Go plugin's newer mode, same keys and score): each latency also has a
//! moving average (`ewma_beta`), each service counts its successes and failures, and a failure
//! keeps the service out of the choice for `failure_cooldown_ms` while another is available. The
//! candidates are the services under `rate_limit` (all when none is), of those the ones not cooling
//! down (all when every one is), and of those a random sample of `p2c_choices`; the lowest score
//! wins: (in flight + 1, plus the failures in a row + 1 while cooling down) × (`ttft_weight` ·
//! √(TTFT + 1) + `total_latency_weight` · √(total + 1)) × (1 + `error_penalty` × error rate), or
//! the in-flight term alone before any latency sample (least busy). The Go plugin's
//! `global_inflight_enabled` (in-flight counts shared through Redis) is not supported: the counts
//! stay per worker, with a warning at start.
//!
//! Choice in the other modes: among services whose share of this worker's last `queue_size`
//! choices is below `rate_limit` (every service when `rate_limit` ≥ 1), the one with the lowest
//! value for `mode` (random among ties; a service without samples has latency 0 and is tried
//! first, which is how new or recovered services get measured). If every service is over the
//! limit, the one with the smallest share. Without `mode`: random among the services under the
//! limit.
//!
//! Differences from Go: the share is over the recent `queue_size` choices instead of all requests
//! since the VM started (which made the limit ever harder to move), and `rate_limit: 1` (the default)
//! never pushes traffic away from the best service (Go's `>=` does so once it has every request).
//!
//! Route cache: writing the header must make the gateway re-match the route, which is Higress's
//! default for header changes; the policy therefore never sets `clear_route_cache` to `off`.

use super::{Decision, Policy, Stream};
use crate::config::{ClusterMetricsConfig, ClusterMode};
use crate::host::{Host, LogLevel};
use crate::metrics::schedule::{self, RecentPicks};
use rustc_hash::FxHashMap;
use std::collections::{HashMap, VecDeque};

/// Statistics of one service, per worker.
#[derive(Debug, Default, Clone)]
struct ServiceStats {
    in_flight: u64,
    ttft_ms: VecDeque<f64>,
    total_ms: VecDeque<f64>,
    /// `AdaptiveScore`: the moving averages of the same samples (`None` before the first).
    ewma_ttft_ms: Option<f64>,
    ewma_total_ms: Option<f64>,
    /// `AdaptiveScore`: requests that ended with status 200, and the others.
    successes: u64,
    errors: u64,
    /// `AdaptiveScore`: failures since the last success, and until when the last one keeps the
    /// service out of the choice (ms).
    consecutive_errors: u64,
    cooldown_until_ms: u64,
}

fn mean(q: &VecDeque<f64>) -> f64 {
    if q.is_empty() {
        0.0
    } else {
        q.iter().sum::<f64>() / q.len() as f64
    }
}

/// Per-request state.
#[derive(Debug)]
struct Pick {
    service: String,
    start_ms: u64,
    status: u16,
    first_byte_seen: bool,
}

/// The `cluster_metrics` policy.
pub struct ClusterMetrics {
    config: ClusterMetricsConfig,
    stats: HashMap<String, ServiceStats>,
    recent: RecentPicks,
    /// Each live stream's pick, by stream id (until the stream ends).
    picks: FxHashMap<u32, Pick>,
}

fn now_ms(host: &dyn Host) -> u64 {
    host.now_nanos() / 1_000_000
}

impl ClusterMetrics {
    /// Creates the policy from its config.
    pub fn new(config: ClusterMetricsConfig) -> Self {
        let stats =
            config.service_list.iter().map(|s| (s.clone(), ServiceStats::default())).collect();
        // Share over the last `queue_size` choices; age is not a criterion (u64::MAX window).
        let recent = RecentPicks::new(config.queue_size, u64::MAX);
        ClusterMetrics { config, stats, recent, picks: FxHashMap::default() }
    }

    fn value(&self, service: &str, now: u64) -> f64 {
        let Some(s) = self.stats.get(service) else { return 0.0 };
        match self.config.mode {
            ClusterMode::LeastBusy => s.in_flight as f64,
            ClusterMode::LeastTotalLatency => mean(&s.total_ms),
            ClusterMode::LeastFirstTokenLatency => mean(&s.ttft_ms),
            ClusterMode::AdaptiveScore => self.adaptive_score(s, now),
            ClusterMode::Random => 0.0,
        }
    }

    /// `AdaptiveScore`'s score (lower is better), the Go plugin's: the requests in flight plus one
    /// (plus the failures in a row and one more while a failure's cooldown runs); without any
    /// latency sample that alone (least busy); else times the weighted square roots of the
    /// latencies' moving averages and `1 + error_penalty × error rate`.
    fn adaptive_score(&self, s: &ServiceStats, now: u64) -> f64 {
        let a = &self.config.adaptive;
        let mut load = s.in_flight as f64 + 1.0;
        if s.cooldown_until_ms > now {
            load += s.consecutive_errors as f64 + 1.0;
        }
        let (ttft, total) = match (s.ewma_ttft_ms, s.ewma_total_ms) {
            (None, None) => return load,
            (Some(t), None) => (t, t),
            (None, Some(r)) => (r, r),
            (Some(t), Some(r)) => (t, r),
        };
        let latency =
            a.ttft_weight * (ttft + 1.0).sqrt() + a.total_latency_weight * (total + 1.0).sqrt();
        let ended = s.successes.saturating_add(s.errors);
        let error_rate = if ended > 0 { s.errors as f64 / ended as f64 } else { 0.0 };
        latency * load * (1.0 + a.error_penalty * error_rate)
    }

    /// `AdaptiveScore`'s candidates: the services under `rate_limit` (all when none is), then of
    /// those the ones not cooling down after a failure (all when every one is), then a random
    /// sample of `p2c_choices` of them.
    fn adaptive_candidates(&self, now: u64, shares: &[f64], mut rand: u64) -> Vec<usize> {
        let list = &self.config.service_list;
        let all: Vec<usize> = (0..list.len()).collect();
        // `rate_limit: 1` (the default) limits nothing, as in the other modes.
        let limited = self.config.rate_limit < 1.0;
        let under: Vec<usize> = all
            .iter()
            .copied()
            .filter(|&i| !limited || shares.get(i).is_some_and(|&x| x < self.config.rate_limit))
            .collect();
        let pool = if under.is_empty() { all } else { under };
        let cool = |i: &usize| {
            list.get(*i)
                .and_then(|svc| self.stats.get(svc))
                .is_some_and(|s| s.cooldown_until_ms <= now)
        };
        let available: Vec<usize> = pool.iter().copied().filter(cool).collect();
        let mut pool = if available.is_empty() { pool } else { available };
        let k = self.config.adaptive.p2c_choices;
        // A partial Fisher-Yates shuffle: the first `k` are a uniform sample without repeats.
        for j in 0..k.min(pool.len().saturating_sub(1)) {
            let span = (pool.len() - j) as u64;
            pool.swap(j, j + (rand % span) as usize);
            rand = rand.rotate_left(17).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
        pool.truncate(k.max(1));
        pool
    }

    /// Chooses a service (see the module docs).
    fn choose(&mut self, now: u64, rand: u64) -> Option<String> {
        if self.config.mode == ClusterMode::AdaptiveScore {
            let shares: Vec<f64> =
                self.config.service_list.iter().map(|s| self.recent.share(now, s)).collect();
            let sample = self.adaptive_candidates(now, &shares, rand);
            // The first of the (random) sample wins ties, as in Go.
            let best = sample.iter().copied().min_by(|&a, &b| {
                let score = |i: usize| {
                    self.config.service_list.get(i).map_or(f64::INFINITY, |s| self.value(s, now))
                };
                score(a).total_cmp(&score(b))
            })?;
            return self.config.service_list.get(best).cloned();
        }
        let list = &self.config.service_list;
        let limited = self.config.rate_limit < 1.0;
        let shares: Vec<f64> = list.iter().map(|s| self.recent.share(now, s)).collect();
        let eligible: Vec<usize> = (0..list.len())
            .filter(|&i| !limited || shares.get(i).is_some_and(|&x| x < self.config.rate_limit))
            .collect();
        if eligible.is_empty() {
            let best = (0..list.len()).min_by(|&a, &b| {
                let (x, y) =
                    (shares.get(a).copied().unwrap_or(1.0), shares.get(b).copied().unwrap_or(1.0));
                x.total_cmp(&y)
            })?;
            return list.get(best).cloned();
        }
        let values: Vec<f64> =
            eligible.iter().map(|&i| list.get(i).map_or(0.0, |s| self.value(s, now))).collect();
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let ties: Vec<usize> =
            eligible.iter().zip(&values).filter(|(_, &v)| v <= min).map(|(&i, _)| i).collect();
        let i = schedule::pick(&ties, rand)?;
        list.get(i).cloned()
    }

    /// A failed request's sample: 2 × max(own duration, highest mean of any service).
    fn punished(&self, duration: f64, ttft: bool) -> f64 {
        let worst = self
            .stats
            .values()
            .map(|s| mean(if ttft { &s.ttft_ms } else { &s.total_ms }))
            .fold(duration, f64::max);
        worst * 2.0
    }

    fn record(&mut self, service: &str, ttft: bool, sample: f64) {
        let cap = self.config.queue_size.max(1);
        let beta = self.config.adaptive.ewma_beta;
        if let Some(s) = self.stats.get_mut(service) {
            let (q, ewma) = if ttft {
                (&mut s.ttft_ms, &mut s.ewma_ttft_ms)
            } else {
                (&mut s.total_ms, &mut s.ewma_total_ms)
            };
            q.push_back(sample);
            while q.len() > cap {
                q.pop_front();
            }
            *ewma = Some(ewma.map_or(sample, |old| beta * old + (1.0 - beta) * sample));
        }
    }

    /// A request of `service` ended at `now`: `AdaptiveScore`'s success and failure counts, and a
    /// failure's cooldown.
    fn record_outcome(&mut self, service: &str, ok: bool, now: u64) {
        let cooldown = self.config.adaptive.failure_cooldown_ms;
        let Some(s) = self.stats.get_mut(service) else { return };
        if ok {
            s.successes = s.successes.saturating_add(1);
            s.consecutive_errors = 0;
        } else {
            s.errors = s.errors.saturating_add(1);
            s.consecutive_errors = s.consecutive_errors.saturating_add(1);
            s.cooldown_until_ms = now.saturating_add(cooldown);
        }
    }
}

impl Policy for ClusterMetrics {
    fn name(&self) -> &'static str {
        "cluster_metrics"
    }

    fn on_request_headers(&mut self, host: &mut dyn Host, stream: &mut Stream) -> Decision {
        let now = now_ms(host);
        let rand = host.random_u64();
        let Some(service) = self.choose(now, rand) else {
            return Decision::Passthrough;
        };
        self.recent.push(now, &service);
        if let Some(s) = self.stats.get_mut(&service) {
            s.in_flight = s.in_flight.saturating_add(1);
        }
        host.log(LogLevel::Debug, &format!("cluster_metrics: -> {service}"));
        stream.decision = Some(format!("cluster_metrics; service={service}"));
        let start_ms = if stream.start_ns > 0 { stream.start_ns / 1_000_000 } else { now };
        self.picks.insert(
            stream.id,
            Pick { service: service.clone(), start_ms, status: 0, first_byte_seen: false },
        );
        Decision::SetHeader { name: self.config.cluster_header.clone(), value: service }
    }

    fn on_response_headers(&mut self, host: &mut dyn Host, stream: &mut Stream) {
        let status =
            host.response_header(":status").and_then(|s| s.trim().parse::<u16>().ok()).unwrap_or(0);
        if let Some(p) = self.picks.get_mut(&stream.id) {
            p.status = status;
        }
    }

    fn on_response_body(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        size: usize,
        _end_of_stream: bool,
    ) {
        let now = now_ms(host);
        let Some(p) = self.picks.get_mut(&stream.id) else { return };
        if p.first_byte_seen || size == 0 {
            return;
        }
        p.first_byte_seen = true;
        let (service, status, duration) =
            (p.service.clone(), p.status, now.saturating_sub(p.start_ms) as f64);
        let sample = if status == 200 { duration } else { self.punished(duration, true) };
        self.record(&service, true, sample);
    }

    fn on_stream_done(&mut self, host: &mut dyn Host, stream: &mut Stream) {
        let now = now_ms(host);
        let Some(p) = self.picks.remove(&stream.id) else { return };
        if let Some(s) = self.stats.get_mut(&p.service) {
            s.in_flight = s.in_flight.saturating_sub(1);
        }
        let duration = now.saturating_sub(p.start_ms) as f64;
        let ok = p.status == 200;
        if !p.first_byte_seen {
            let sample = if ok { duration } else { self.punished(duration, true) };
            self.record(&p.service, true, sample);
        }
        let sample = if ok { duration } else { self.punished(duration, false) };
        self.record(&p.service, false, sample);
        self.record_outcome(&p.service, ok, now);
    }
}

#[cfg(test)]
#[path = "cluster_metrics_tests.rs"]
mod tests;
