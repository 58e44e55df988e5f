//! Choosing a pod by its metrics: where the metrics come from (the gateway's health check, or the
//! plugin's own scrapes through an ORIGINAL_DST cluster) and the decision over them. Used by
//! `endpoint_metrics` for every request, and by the Redis policies when Redis cannot be used (an
//! error, a timeout, an open breaker): then the pods' queues and KV-cache use decide instead of
//! the gateway's round robin.

use super::schedule::{
    self, Candidate, InFlightPicks, MetricPolicy, OwnPicks, RecentPicks, IN_FLIGHT_MAX_AGE_MS,
    MAX_IN_FLIGHT,
};
use super::scrape::Scraper;
use super::{prometheus, PodMetrics};
use crate::config::PodMetricsSource;
use crate::host::{Host, HttpReply, LogLevel, UpstreamHost};
use std::collections::HashMap;
use std::rc::Rc;

/// Metrics of one healthy pod at decision time.
pub struct PodView {
    /// `ip:port`.
    pub address: String,
    /// Usable metrics, or `None` when unknown (none stored, stale, unparsable).
    pub metrics: Option<PodMetrics>,
    /// When the metrics were sampled (ms); `None` for host-provided metrics (time unknown).
    pub sampled_ms: Option<u64>,
}

/// How a metrics policy ranks pods.
#[derive(Debug, Clone, PartialEq)]
pub struct Ranking {
    /// `metric_policy`.
    pub policy: MetricPolicy,
    /// `target_metric` (for `least`/`most`).
    pub target_metric: Option<String>,
    /// `rate_limit`: largest share of the recent requests one pod may get (1.0 = no limit).
    pub rate_limit: f64,
    /// Requests remembered for `rate_limit`.
    pub window_size: usize,
    /// How long a request stays remembered (ms).
    pub window_ms: u64,
    /// Which pods count this worker's picks since their sample, still in flight, as queued.
    pub own_picks: OwnPicks,
}

impl Ranking {
    /// The GIE filter chain with no rate limit: what the Redis policies use without Redis. Their
    /// own picks since a pod's sample count on every pod: the fallback starts with the burst of
    /// picks that waited on the frozen Redis, decided together on one sample.
    pub fn filter_chain() -> Ranking {
        Ranking {
            policy: MetricPolicy::Default,
            target_metric: None,
            rate_limit: 1.0,
            window_size: 100,
            window_ms: 60_000,
            own_picks: OwnPicks::Always,
        }
    }
}

/// The pods' metrics and the decision over them, for one policy instance in one worker VM.
pub struct MetricsRouter {
    ranking: Ranking,
    /// Picks for `rate_limit`.
    recent: RecentPicks,
    /// Picks whose streams have not ended: the load a pod's last sample does not show yet.
    in_flight: InFlightPicks,
    /// Scrapes pods itself when `scrapeCluster` names an ORIGINAL_DST cluster to do it through.
    scraper: Option<Scraper>,
    scrape_interval_ms: u32,
    /// Last parsed host-provided body per cluster and pod: health-check bodies change once per
    /// check interval while every request reads them, so the same body (shared by the host list's
    /// memo, else an equal one: a memcmp) reuses the parse. Kept per cluster, so one policy
    /// serving several clusters (rules matching by domain or route prefix) does not evict one
    /// cluster's pods for another's on every request.
    parsed: HashMap<String, HashMap<String, (Rc<str>, PodMetrics)>>,
    /// Host list per cluster and when it was read (ms), for `hostListCacheMs`.
    host_lists: HashMap<String, (u64, Vec<UpstreamHost>)>,
    host_list_cache_ms: u64,
}

/// At most this many clusters keep parsed metrics in one policy instance; beyond, the cache starts
/// over (bounded memory with any number of clusters).
const MAX_PARSED_CLUSTERS: usize = 64;

impl MetricsRouter {
    /// A router over `source` ranking pods as `ranking` says.
    pub fn new(source: &PodMetricsSource, ranking: Ranking) -> MetricsRouter {
        let recent = RecentPicks::new(ranking.window_size, ranking.window_ms);
        let scraper = source.scrape_cluster.as_deref().map(|via| {
            Scraper::new(
                via,
                &source.scrape_path,
                u64::from(source.scrape_interval_ms),
                source.metrics_stale_ms,
                ranking.target_metric.clone(),
            )
        });
        MetricsRouter {
            ranking,
            recent,
            in_flight: InFlightPicks::new(IN_FLIGHT_MAX_AGE_MS, MAX_IN_FLIGHT),
            scraper,
            scrape_interval_ms: source.scrape_interval_ms,
            parsed: HashMap::new(),
            host_lists: HashMap::new(),
            host_list_cache_ms: source.host_list_cache_ms,
        }
    }

    /// `cluster`'s host list (`proxy_get_upstream_hosts`); `None` when the host has none. A list
    /// that carries metrics bodies is kept for `hostListCacheMs` and read from the host at most
    /// once per that long. Why: the host serializes every pod's stored metrics body (up to 64 KiB
    /// each; a real vLLM's is 30-60 KB) into the list at every read (about 50 us per pod of 31 KB
    /// in our gateway host; `bench/HISTORY.md`, "Real engines' /metrics in the scenarios"), while
    /// the bodies change once per health-check interval. A health change is then seen up to that
    /// much later; a pod marked down meanwhile is still safe to name, as Envoy routes a non-strict
    /// override to an unhealthy host by normal balancing. A list without bodies costs the host
    /// little and is read at every request, as the Go plugin does.
    pub fn host_list(
        &mut self,
        host: &dyn Host,
        cluster: &str,
        now_ms: u64,
    ) -> Option<Vec<UpstreamHost>> {
        if self.host_list_cache_ms == 0 {
            return host.upstream_hosts();
        }
        if let Some((read_ms, list)) = self.host_lists.get(cluster) {
            // A clock that went back reads again.
            if now_ms.checked_sub(*read_ms).is_some_and(|age| age < self.host_list_cache_ms) {
                return Some(list.clone());
            }
        }
        let list = host.upstream_hosts()?;
        if !list.iter().any(|h| h.metrics.is_some()) {
            self.host_lists.remove(cluster);
            return Some(list);
        }
        if self.host_lists.len() >= MAX_PARSED_CLUSTERS && !self.host_lists.contains_key(cluster) {
            self.host_lists.clear();
        }
        self.host_lists.insert(cluster.to_string(), (now_ms, list.clone()));
        Some(list)
    }

    /// Whether the policy ranks by the GIE filter chain (which reads the model for LoRA pods).
    pub fn uses_filter_chain(&self) -> bool {
        self.ranking.policy == MetricPolicy::Default
    }

    /// Pods with a cached parse, per cluster (for tests of the cache's bounds).
    #[cfg(test)]
    pub fn cached_pods(&self, cluster: &str) -> usize {
        self.parsed.get(cluster).map_or(0, HashMap::len)
    }

    /// Whether the plugin scrapes the pods itself.
    pub fn scrapes(&self) -> bool {
        self.scraper.is_some()
    }

    /// Plugin start: the scraper's worker id.
    pub fn on_start(&mut self, host: &mut dyn Host) {
        if let Some(scraper) = self.scraper.as_mut() {
            scraper.set_worker_id(host.random_u64());
        }
    }

    /// The healthy pods of `cluster` (its host list `hosts`) with their metrics, or `None` when
    /// there is no healthy host.
    pub fn gather(
        &mut self,
        host: &dyn Host,
        cluster: &str,
        hosts: Vec<UpstreamHost>,
        now_ms: u64,
    ) -> Option<Vec<PodView>> {
        let healthy: Vec<_> = hosts.into_iter().filter(|h| h.is_healthy()).collect();
        if healthy.is_empty() {
            return None;
        }
        let host_has_metrics =
            healthy.iter().any(|h| h.metrics.as_deref().is_some_and(|m| !m.is_empty()));
        let target = self.ranking.target_metric.as_deref();
        if host_has_metrics {
            if !self.parsed.contains_key(cluster) && self.parsed.len() >= MAX_PARSED_CLUSTERS {
                self.parsed.clear();
            }
            let parsed = self.parsed.entry(cluster.to_string()).or_default();
            // Forget pods that left the cluster (bounded memory).
            parsed.retain(|addr, _| healthy.iter().any(|h| h.address == *addr));
            let mut out = Vec::with_capacity(healthy.len());
            for h in healthy {
                let metrics = match h.metrics {
                    Some(body) if !body.is_empty() => {
                        let m = match parsed.get(&h.address) {
                            // The same shared body as last time (the host list's memo) or
                            // an equal one.
                            Some((cached, m)) if Rc::ptr_eq(cached, &body) || *cached == body => {
                                m.clone()
                            }
                            _ => {
                                let m = prometheus::parse(body.as_bytes(), target);
                                parsed.insert(h.address.clone(), (body, m.clone()));
                                m
                            }
                        };
                        Some(m).filter(|m| !m.is_empty())
                    }
                    _ => None,
                };
                out.push(PodView { address: h.address, metrics, sampled_ms: None });
            }
            return Some(out);
        }
        let addrs: Vec<String> = healthy.into_iter().map(|h| h.address).collect();
        let Some(scraper) = self.scraper.as_mut() else {
            // No metrics stored by the host and no way to scrape each pod.
            return Some(
                addrs
                    .into_iter()
                    .map(|address| PodView { address, metrics: None, sampled_ms: None })
                    .collect(),
            );
        };
        scraper.learn(cluster, &addrs, now_ms);
        let scraper = &*scraper;
        Some(
            addrs
                .into_iter()
                .map(|address| {
                    let snap = scraper.read(host, cluster, &address, now_ms);
                    let sampled_ms = snap.as_ref().map(|s| s.sampled_ms);
                    let metrics = snap.map(|s| s.metrics).filter(|m| !m.is_empty());
                    PodView { address, metrics, sampled_ms }
                })
                .collect(),
        )
    }

    /// The pod to route stream `stream` to, or `None` when some pod has no usable metrics. The pick
    /// counts as load on its pod until [`MetricsRouter::on_stream_done`].
    pub fn choose(
        &mut self,
        host: &mut dyn Host,
        stream: u32,
        pods: &[PodView],
        model: &str,
        now_ms: u64,
    ) -> Option<String> {
        let interval = u64::from(self.scrape_interval_ms);
        // Requests sent after the sample are not in it yet. Host-provided metrics carry no time:
        // assume they are one scrape interval old.
        let since: HashMap<&str, u64> = pods
            .iter()
            .map(|p| {
                (
                    p.address.as_str(),
                    p.sampled_ms.unwrap_or_else(|| now_ms.saturating_sub(interval)),
                )
            })
            .collect();
        let pending = self.in_flight.count_since(now_ms, &since);
        let own_picks = self.ranking.own_picks;
        // One pod without metrics: no opinion for the whole request, as in Go.
        let candidates: Vec<Candidate<'_>> = pods
            .iter()
            .map(|p| {
                Some(Candidate {
                    address: &p.address,
                    metrics: p.metrics.as_ref()?,
                    pending: pending.get(p.address.as_str()).copied().unwrap_or(0),
                    own_picks,
                })
            })
            .collect::<Option<_>>()?;
        let survivors = schedule::filter(self.ranking.policy, model, &candidates);
        let idx = schedule::pick(&survivors, host.random_u64())?;
        let chosen = candidates.get(idx).map(|c| c.address)?;
        let healthy: Vec<&str> = pods.iter().map(|p| p.address.as_str()).collect();
        let rand = host.random_u64();
        let fin = schedule::apply_rate_limit(
            &mut self.recent,
            now_ms,
            self.ranking.rate_limit,
            chosen,
            &healthy,
            rand,
        );
        if fin != chosen {
            host.log(LogLevel::Debug, &format!("{chosen} over rate_limit, using {fin}"));
        }
        let fin = fin.to_string();
        self.recent.push(now_ms, &fin);
        self.in_flight.start(stream, now_ms, &fin);
        Some(fin)
    }

    /// Stream `stream` ended: its pick, if this router made one, no longer loads its pod.
    pub fn on_stream_done(&mut self, stream: u32) {
        self.in_flight.end(stream);
    }

    /// Picks remembered in flight (for tests).
    #[cfg(test)]
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// An HTTP-call reply; the scraper ignores tokens that are not its scrapes.
    pub fn on_http_reply(&mut self, host: &mut dyn Host, token: u32, reply: &HttpReply) {
        if let Some(scraper) = self.scraper.as_mut() {
            let now_ms = host.now_nanos() / 1_000_000;
            scraper.on_reply(host, token, reply, now_ms);
        }
    }

    /// Tick period the scraper needs (0 = none).
    pub fn tick_period_ms(&self) -> u32 {
        if self.scraper.is_some() {
            self.scrape_interval_ms
        } else {
            0
        }
    }

    /// Root tick: scrapes that are due.
    pub fn on_tick(&mut self, host: &mut dyn Host, now_ms: u64) {
        let Some(scraper) = self.scraper.as_mut() else { return };
        if !scraper.has_worker_id() {
            // Lazily, in case on_start was not delivered to this instance.
            let id = host.random_u64();
            scraper.set_worker_id(id);
        }
        scraper.on_tick(host, now_ms);
    }
}
