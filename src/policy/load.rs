//! `prefix_cache` with `loadAware`: the pods' GPU metrics turned into what the pick script needs,
//! so the decision stays one Redis round trip. Per healthy pod the plugin sends an *overloaded*
//! flag (its queue or KV-cache use far above the least loaded pod's) and a *penalty* (queue +
//! `loadKvWeight` × KV-cache use, in requests); the script adds the penalty to the pod's global
//! in-flight count (live, from Redis) to rank pods, and checks the in-flight gap itself.
//!
//! Why both: the metrics say what the engine is doing (a slow or half-speed pod queues, a pod
//! behind on a long prefill holds KV), but lag by a sample; the in-flight counts are live and
//! shared by every gateway, but say nothing about how fast a pod drains them.

use super::first_by_key;
use super::latency::Slowness;
use crate::config::LoadAwareConfig;
use crate::metrics::router::PodView;

/// One healthy pod's load as the script reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostLoad {
    /// `ip:port`.
    pub address: String,
    /// Queue + `loadKvWeight` × KV-cache use, rounded: added to the pod's in-flight count.
    pub penalty: u32,
    /// Its queue or KV-cache use is past both thresholds against the least loaded pod.
    pub overloaded: bool,
}

/// The load part of a `prefix_cache` pick (`loadAware` with fresh metrics for every healthy pod).
#[derive(Debug, Clone, PartialEq)]
pub struct LoadArgs {
    /// `overloadInflight`.
    pub inflight_gap: u32,
    /// `overloadRatio`.
    pub ratio: f64,
    /// `maxHolders`.
    pub max_holders: u32,
    /// Each healthy pod's load (any order: the call writes them in its host order).
    pub hosts: Vec<HostLoad>,
}

/// `x` is past both the absolute `gap` and the relative `ratio` against the least value `min`
/// (SGLang's imbalance test: both must hold, so small absolute differences never divert).
fn past(x: f64, min: f64, gap: f64, ratio: f64) -> bool {
    x - min > gap && x > ratio * min
}

/// The load arguments for `pods` (the healthy pods), or `None` when any of them has no fresh
/// queue length or KV-cache use: then the request is decided as with `loadAware` off.
pub fn load_args(cfg: &LoadAwareConfig, pods: &[PodView]) -> Option<LoadArgs> {
    let signals: Vec<(f64, f64)> = pods
        .iter()
        .map(|p| {
            let m = p.metrics.as_ref()?;
            Some((m.waiting?.max(0.0), m.kv_cache_usage?.clamp(0.0, 1.0)))
        })
        .collect::<Option<_>>()?;
    let min_q = signals.iter().map(|s| s.0).fold(f64::INFINITY, f64::min);
    let min_kv = signals.iter().map(|s| s.1).fold(f64::INFINITY, f64::min);
    let hosts = pods
        .iter()
        .zip(&signals)
        .map(|(p, &(q, kv))| HostLoad {
            address: p.address.clone(),
            // Bounded by the clamp above and the config's finite weight; saturates otherwise.
            penalty: (q + cfg.kv_weight * kv).round().min(f64::from(u32::MAX)) as u32,
            overloaded: past(q, min_q, cfg.queue_gap, cfg.ratio)
                || past(kv, min_kv, cfg.kv_gap, cfg.ratio),
        })
        .collect::<Vec<_>>();
    if hosts.is_empty() {
        return None;
    }
    Some(LoadArgs {
        inflight_gap: cfg.inflight_gap,
        ratio: cfg.ratio,
        max_holders: cfg.max_holders,
        hosts,
    })
}

impl LoadArgs {
    /// Adds each pod's observed slowness (its decode time per byte over the fastest pod's, from
    /// [`super::latency::PodSpeed`]): `loadLatencyWeight` × (slowness − 1) more requests in its
    /// combined load, and overloaded when its steady slowness (between prefill stalls) is at least
    /// `overloadLatency` (when set). Pods not in `slowness` are unchanged.
    pub fn add_slowness(
        mut self,
        cfg: &LoadAwareConfig,
        slowness: &[(String, Slowness)],
    ) -> LoadArgs {
        let by_pod = first_by_key(slowness.iter().map(|(a, s)| (a.as_str(), *s)));
        for h in &mut self.hosts {
            let Some(&s) = by_pod.get(h.address.as_str()) else { continue };
            if s.overall.is_finite() && s.overall > 1.0 {
                let extra = (cfg.latency_weight * (s.overall - 1.0)).round();
                h.penalty = h.penalty.saturating_add(extra.min(f64::from(u32::MAX)) as u32);
            }
            if cfg.latency_ratio >= 1.0 && s.steady.is_finite() && s.steady >= cfg.latency_ratio {
                h.overloaded = true;
            }
        }
        self
    }

    /// Adds each pod's prefill backlog (bytes of prompts this worker sent it that it has not
    /// started answering, past what it holds): one more request in its combined load per
    /// `loadPrefillBytes`. Pods not in `backlog` are unchanged.
    pub fn add_prefill_backlog(
        mut self,
        cfg: &LoadAwareConfig,
        backlog: &[(String, u64)],
    ) -> LoadArgs {
        if cfg.prefill_bytes == 0 {
            return self;
        }
        let by_pod = first_by_key(backlog.iter().map(|(a, b)| (a.as_str(), *b)));
        for h in &mut self.hosts {
            let Some(&bytes) = by_pod.get(h.address.as_str()) else { continue };
            let extra = bytes / u64::from(cfg.prefill_bytes);
            h.penalty = h.penalty.saturating_add(u32::try_from(extra).unwrap_or(u32::MAX));
        }
        self
    }

    /// The script's load arguments for `healthy` (in that order): in-flight gap, ratio, max
    /// holders, one flag character per host (`1` overloaded), then one penalty per host. A host
    /// without a load entry (it cannot happen: both come from one host list) reads as idle.
    pub fn args(&self, healthy: &[String], out: &mut Vec<String>) {
        out.reserve(4 + healthy.len());
        out.push(self.inflight_gap.to_string());
        out.push(format!("{}", self.ratio));
        out.push(self.max_holders.to_string());
        let by_address = first_by_key(self.hosts.iter().map(|l| (l.address.as_str(), l)));
        let find = |h: &String| by_address.get(h.as_str()).copied();
        out.push(
            healthy
                .iter()
                .map(|h| if find(h).is_some_and(|l| l.overloaded) { '1' } else { '0' })
                .collect(),
        );
        out.extend(healthy.iter().map(|h| find(h).map_or(0, |l| l.penalty).to_string()));
    }
}

#[cfg(test)]
#[path = "load_tests.rs"]
mod tests;
