//! The pure decision core of `endpoint_metrics`: which pods are worth sending a request to, given
//! each pod's latest metrics. No host access here, so every rule is unit-tested directly.
//!
//! `metric_policy: default` is the Gateway API Inference Extension (GIE) filter chain that the
//! Go plugin embeds, for a *critical* request (the Go plugin marks every request critical, so the
//! "sheddable" branch of GIE never runs there, nor here):
//!
//! ```text
//! waiting < 50 (queueingThresholdLoRA) ?
//!   yes -> adapter already on the pod ?
//!            yes -> least queue -> least KV
//!            no  -> pod has a free adapter slot ? (yes: those pods, no: the low-queue pods)
//!                     -> least queue -> least KV
//!   no  -> least queue -> low LoRA cost (has adapter or free slot; skipped if none) -> least KV
//! ```
//!
//! "least X" keeps the pods whose X lies in the lowest 1/n-th of the range [min, max] (n = pods
//! considered), which leaves several near-best pods for the next step and for the final random
//! pick, instead of herding every request to the single minimum.
//!
//! `least` / `most` apply the same band rule to the user's `target_metric`.
//!
//! Differences from the Go plugin (documented in the README):
//! - As in Go, when any pod's metrics are unknown (missing, unparsable, stale, or without the
//!   queue and KV-cache signals) the request gets no opinion (normal balancing). Go also needs
//!   `vllm:lora_requests_info` and vLLM V0 names; here a pod without LoRA info has no adapters, and
//!   vLLM V1 and SGLang names count.
//! - LoRA: adapters in `waiting_lora_adapters` count as present (newer GIE does the same), and a
//!   request without `model` skips the LoRA steps.
//! - `pending`: requests this worker sent to a pod after its metrics were sampled and that are still
//!   in flight are added to the queue of a pod that was already queueing (or had ≥ 80% KV cache in
//!   use), so a burst between two samples does not pile onto one saturated pod. A pod with an empty
//!   queue and free KV admits new requests into its running batch, so for it they are not counted
//!   ([`OwnPicks::WhenQueueing`]) — except in the Redis policies' fallback
//!   ([`OwnPicks::Always`]), which starts with a burst decided on one sample.

use super::prometheus::PodMetrics;
use rustc_hash::FxHashMap;

/// Queue length under which LoRA affinity is preferred (GIE `queueingThresholdLoRA`).
pub const QUEUEING_THRESHOLD_LORA: f64 = 50.0;

/// KV-cache usage from which a pod is considered full (GIE `kvCacheThreshold`).
pub const KV_CACHE_THRESHOLD: f64 = 0.8;

pub use crate::config::MetricPolicy;

/// Which pods count this worker's requests sent since their sample ([`Candidate::pending`]) as
/// queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnPicks {
    /// Only a pod already queueing (or with its KV cache nearly full): such a pod queues new
    /// requests too, while one with an empty queue and free KV admits them straight into its
    /// running batch. `endpoint_metrics`, whose steady stream of picks keeps the Go plugin's
    /// ranking of idle pods.
    WhenQueueing,
    /// Every pod. The Redis policies' fallback: when the breaker opens, every pick that waited on
    /// the frozen Redis is decided in the same tick on the same sample, and counted only on
    /// queueing pods they would all go to the one idle pod with the least KV in use.
    Always,
}

/// One schedulable pod: its address, its metrics and how many requests this worker sent it since
/// those metrics were sampled.
#[derive(Clone, Debug)]
pub struct Candidate<'a> {
    /// `ip:port`.
    pub address: &'a str,
    /// Latest fresh metrics.
    pub metrics: &'a PodMetrics,
    /// Requests routed here after the sample and still in flight (not visible in the metrics).
    pub pending: u32,
    /// Whether `pending` counts as queued on a pod that was not queueing.
    pub own_picks: OwnPicks,
}

impl Candidate<'_> {
    /// Queue length, plus the requests sent since the sample and still in flight when
    /// [`OwnPicks`] says they count on this pod.
    fn waiting(&self) -> f64 {
        let w = self.metrics.waiting.unwrap_or(0.0);
        let queueing = w > 0.0 || self.kv() >= KV_CACHE_THRESHOLD;
        if queueing || self.own_picks == OwnPicks::Always {
            w + f64::from(self.pending)
        } else {
            w
        }
    }
    fn kv(&self) -> f64 {
        self.metrics.kv_cache_usage.unwrap_or(0.0)
    }
    fn has_adapter(&self, model: &str) -> bool {
        self.metrics.lora.as_ref().is_some_and(|l| l.has_adapter(model))
    }
    fn has_free_adapter_slot(&self) -> bool {
        self.metrics.lora.as_ref().is_some_and(|l| l.active_count() < l.max_lora as usize)
    }
    /// True when the pod has the signals `policy` needs.
    pub fn usable_for(&self, policy: MetricPolicy) -> bool {
        match policy {
            // The chain's two signals (Go needs them too, plus LoRA info, which is optional here).
            MetricPolicy::Default | MetricPolicy::Random => {
                self.metrics.waiting.is_some() && self.metrics.kv_cache_usage.is_some()
            }
            MetricPolicy::Least | MetricPolicy::Most => {
                self.metrics.target.is_some_and(f64::is_finite)
            }
        }
    }
}

/// Returns the indices (into `pods`) of the pods the policy would pick among; the caller picks one
/// at random. As in Go, when any pod is not [`Candidate::usable_for`] the policy the result is
/// empty: "no opinion" (the gateway then balances normally), rather than ranking the pods it
/// cannot see out of the choice.
pub fn filter(policy: MetricPolicy, model: &str, pods: &[Candidate<'_>]) -> Vec<usize> {
    if pods.is_empty() || !pods.iter().all(|c| c.usable_for(policy)) {
        return Vec::new();
    }
    let usable: Vec<usize> = (0..pods.len()).collect();
    match policy {
        MetricPolicy::Default => default_chain(model, pods, usable),
        MetricPolicy::Random => usable,
        MetricPolicy::Least => band(pods, usable, |c| c.metrics.target.unwrap_or(0.0), false),
        MetricPolicy::Most => band(pods, usable, |c| c.metrics.target.unwrap_or(0.0), true),
    }
}

fn keep<'a>(
    pods: &[Candidate<'a>],
    set: &[usize],
    pred: impl Fn(&Candidate<'a>) -> bool,
) -> Vec<usize> {
    set.iter().copied().filter(|&i| pods.get(i).is_some_and(&pred)).collect()
}

/// Keeps the pods whose value lies in the lowest (or, with `most`, highest) 1/n-th of the range.
fn band<'a>(
    pods: &[Candidate<'a>],
    set: Vec<usize>,
    value: impl Fn(&Candidate<'a>) -> f64,
    most: bool,
) -> Vec<usize> {
    let vals: Vec<f64> = set.iter().map(|&i| pods.get(i).map_or(0.0, &value)).collect();
    let (min, max) =
        vals.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    if set.is_empty() || !min.is_finite() || !max.is_finite() {
        // Infinite values (a pod reporting +Inf) make the range meaningless: keep the extreme ones.
        let target = if most { max } else { min };
        return set.iter().zip(&vals).filter(|(_, &v)| v == target).map(|(&i, _)| i).collect();
    }
    let width = (max - min) / set.len() as f64;
    set.iter()
        .zip(&vals)
        .filter(|(_, &v)| if most { v >= max - width } else { v <= min + width })
        .map(|(&i, _)| i)
        .collect()
}

fn least_queue_then_kv(pods: &[Candidate<'_>], set: Vec<usize>) -> Vec<usize> {
    let q = band(pods, set, Candidate::waiting, false);
    band(pods, q, Candidate::kv, false)
}

fn default_chain(model: &str, pods: &[Candidate<'_>], all: Vec<usize>) -> Vec<usize> {
    let lora = !model.is_empty();
    let low_queue = keep(pods, &all, |c| c.waiting() < QUEUEING_THRESHOLD_LORA);
    if !low_queue.is_empty() {
        if !lora {
            return least_queue_then_kv(pods, low_queue);
        }
        let affinity = keep(pods, &low_queue, |c| c.has_adapter(model));
        if !affinity.is_empty() {
            return least_queue_then_kv(pods, affinity);
        }
        let free = keep(pods, &low_queue, Candidate::has_free_adapter_slot);
        let next = if free.is_empty() { low_queue } else { free };
        return least_queue_then_kv(pods, next);
    }
    // Every pod is queueing: load first, then LoRA cost, then KV.
    let least_q = band(pods, all, Candidate::waiting, false);
    let next = if lora {
        let cheap = keep(pods, &least_q, |c| c.has_adapter(model) || c.has_free_adapter_slot());
        if cheap.is_empty() {
            least_q
        } else {
            cheap
        }
    } else {
        least_q
    };
    band(pods, next, Candidate::kv, false)
}

/// Recent routing decisions of this worker: the basis of `rate_limit` (a pod's share of the recent
/// requests). Bounded by `max_entries` and by age (`window_ms`), like the
/// Go plugin's `window_size` / `window_seconds`.
#[derive(Clone, Debug)]
pub struct RecentPicks {
    entries: std::collections::VecDeque<(u64, String)>,
    max_entries: usize,
    window_ms: u64,
}

impl RecentPicks {
    /// An empty window holding at most `max_entries` picks younger than `window_ms`.
    pub fn new(max_entries: usize, window_ms: u64) -> Self {
        RecentPicks {
            entries: Default::default(),
            max_entries: max_entries.max(1),
            window_ms: window_ms.max(1),
        }
    }

    fn purge(&mut self, now_ms: u64) {
        let cutoff = now_ms.saturating_sub(self.window_ms);
        while self.entries.front().is_some_and(|(t, _)| *t < cutoff) {
            self.entries.pop_front();
        }
    }

    /// Records that `addr` was chosen at `now_ms`.
    pub fn push(&mut self, now_ms: u64, addr: &str) {
        self.purge(now_ms);
        self.entries.push_back((now_ms, addr.to_string()));
        while self.entries.len() > self.max_entries {
            self.entries.pop_front();
        }
    }

    /// Share (0..1) of the picks in the window that went to `addr`; 0 for an empty window.
    pub fn share(&mut self, now_ms: u64, addr: &str) -> f64 {
        self.purge(now_ms);
        if self.entries.is_empty() {
            return 0.0;
        }
        let n = self.entries.iter().filter(|(_, a)| a == addr).count();
        n as f64 / self.entries.len() as f64
    }
}

/// A pick still in flight after this long is forgotten: its stream's end never came (a host that
/// lost it), and a request counted forever would keep its pod looking loaded. Generous: an LLM
/// stream of several minutes still counts until it ends.
pub const IN_FLIGHT_MAX_AGE_MS: u64 = 600_000;

/// At most this many picks are remembered in flight per policy instance and worker; beyond, the
/// oldest is forgotten (bounded memory whatever the host does).
pub const MAX_IN_FLIGHT: usize = 16_384;

/// This worker's picks whose streams have not ended yet, by stream id: the basis of the `pending`
/// count. A pick that ended is no longer in the pod, and one made before the pod's sample is in
/// it already; only those in between are load the sample does not show.
#[derive(Clone, Debug)]
pub struct InFlightPicks {
    /// Stream id → (pick time in ms, pod address).
    picks: FxHashMap<u32, (u64, String)>,
    max_age_ms: u64,
    max_entries: usize,
    last_purge_ms: u64,
}

impl InFlightPicks {
    /// Empty; picks older than `max_age_ms` are forgotten, and beyond `max_entries` the oldest.
    pub fn new(max_age_ms: u64, max_entries: usize) -> Self {
        InFlightPicks {
            picks: Default::default(),
            max_age_ms: max_age_ms.max(1),
            max_entries: max_entries.max(1),
            last_purge_ms: 0,
        }
    }

    /// Picks remembered (for tests of the bounds).
    pub fn len(&self) -> usize {
        self.picks.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.picks.is_empty()
    }

    /// Stream `stream` was sent to `addr` at `now_ms` (a stream decided twice counts once, where it
    /// went last).
    pub fn start(&mut self, stream: u32, now_ms: u64, addr: &str) {
        // Aged picks go at most once per second: a scan per pick would cost O(in flight).
        if now_ms.saturating_sub(self.last_purge_ms) >= 1_000 {
            self.last_purge_ms = now_ms;
            let cutoff = now_ms.saturating_sub(self.max_age_ms);
            self.picks.retain(|_, (t, _)| *t >= cutoff);
        }
        if !self.picks.contains_key(&stream) && self.picks.len() >= self.max_entries {
            let oldest = self.picks.iter().min_by_key(|(_, (t, _))| *t).map(|(id, _)| *id);
            if let Some(id) = oldest {
                self.picks.remove(&id);
            }
        }
        self.picks.insert(stream, (now_ms, addr.to_string()));
    }

    /// Stream `stream` ended (unknown streams are ignored: not every stream is routed here).
    pub fn end(&mut self, stream: u32) {
        self.picks.remove(&stream);
    }

    /// Picks still in flight per pod made strictly after that pod's `since_ms` (and younger than
    /// the age bound at `now_ms`): `since` gives each pod's sample time, `None` for a pod not
    /// asked about.
    pub fn count_since<'a>(
        &self,
        now_ms: u64,
        since: &std::collections::HashMap<&'a str, u64>,
    ) -> std::collections::HashMap<&'a str, u32> {
        let cutoff = now_ms.saturating_sub(self.max_age_ms);
        let mut counts: std::collections::HashMap<&'a str, u32> =
            since.keys().map(|a| (*a, 0)).collect();
        for (t, addr) in self.picks.values() {
            let Some((key, since_ms)) = since.get_key_value(addr.as_str()) else { continue };
            if *t > *since_ms && *t >= cutoff {
                if let Some(c) = counts.get_mut(key) {
                    *c = c.saturating_add(1);
                }
            }
        }
        counts
    }
}

/// Applies `rate_limit`: when `chosen` already received more than `limit` of the recent requests,
/// another healthy pod is taken instead (the Go plugin picks a random other host). We prefer the
/// others still under the limit (random among them); if every other pod is over it too, the one
/// with the smallest share. `rand` is a random number from the host. Returns the final address.
pub fn apply_rate_limit<'a>(
    recent: &mut RecentPicks,
    now_ms: u64,
    limit: f64,
    chosen: &'a str,
    healthy: &[&'a str],
    rand: u64,
) -> &'a str {
    if recent.share(now_ms, chosen) <= limit {
        return chosen;
    }
    let others: Vec<(&str, f64)> =
        healthy.iter().filter(|a| **a != chosen).map(|a| (*a, recent.share(now_ms, a))).collect();
    if others.is_empty() {
        return chosen;
    }
    let under: Vec<&str> = others.iter().filter(|(_, s)| *s <= limit).map(|(a, _)| *a).collect();
    if !under.is_empty() {
        return pick(&under, rand).unwrap_or(chosen);
    }
    others
        .iter()
        .fold(None::<(&str, f64)>, |best, &(a, s)| match best {
            Some((_, bs)) if bs <= s => best,
            _ => Some((a, s)),
        })
        .map_or(chosen, |(a, _)| a)
}

/// Uniform pick from a non-empty slice with a host random number.
pub fn pick<T: Copy>(items: &[T], rand: u64) -> Option<T> {
    if items.is_empty() {
        return None;
    }
    let i = (rand % items.len() as u64) as usize;
    items.get(i).copied()
}

#[cfg(test)]
#[path = "schedule_tests.rs"]
mod tests;
