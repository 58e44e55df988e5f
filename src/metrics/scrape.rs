//! Scraping pods' `/metrics` from the plugin itself, for gateways whose health checker does not
//! store metrics in the host info, and sharing the result between worker VMs.
//!
//! How it works:
//! - Pods are learned per cluster from the upstream host lists that requests see ([`Scraper::learn`]).
//! - On each tick, for every known pod whose shared snapshot is older than half the interval, a
//!   worker takes a short **lease** in shared data (compare-and-swap, so normally one worker scrapes
//!   a pod per round no matter how many workers there are) and sends `GET <scrapePath>` with
//!   `dispatch_http_call` to the `scrapeCluster`: an Envoy ORIGINAL_DST cluster with
//!   `use_http_header`, where `x-envoy-original-dst-host: ip:port` sends the call to that very pod.
//!   (Envoy ignores the header on any other cluster: a call to the pods' own cluster would reach
//!   whichever pod its LB picks, and its metrics would be filed under the wrong pod.)
//! - The reply is parsed and written to shared data as a [`Snapshot`] stamped with the receive time.
//!   A failed scrape writes an empty snapshot, so the pod at once counts as "metrics unknown".
//! - Readers treat snapshots older than `metricsStaleMs` as unknown.
//!
//! The first lease of a pod is written without CAS (proxy-wasm has no "create if absent"), so two
//! workers may both scrape a pod in its very first round; afterwards the CAS makes it exclusive.

use super::{prometheus, Snapshot};
use crate::host::{Host, HttpCallRequest, HttpReply, LogLevel};
use rustc_hash::FxHashMap;
use std::collections::HashMap;

/// Prefix of every shared-data key this module writes.
pub const KEY_PREFIX: &str = "ai-lb/metrics/";
const LEASE_PREFIX: &str = "ai-lb/lease/";
/// A cluster no request has named for this long stops being scraped.
const CLUSTER_IDLE_MS: u64 = 10 * 60 * 1000;
/// At most this many departed pods wait for their shared entries to be emptied (a tick empties
/// them all; the bound only matters if ticks stop).
const MAX_DEPARTED: usize = 4096;

#[derive(Debug, Default)]
struct ClusterPods {
    pods: Vec<String>,
    last_seen_ms: u64,
}

/// Per-worker scraper state.
#[derive(Debug)]
pub struct Scraper {
    /// The ORIGINAL_DST cluster the scrapes go through.
    via: String,
    path: String,
    interval_ms: u64,
    stale_ms: u64,
    timeout_ms: u32,
    target: Option<String>,
    worker_id: u64,
    clusters: HashMap<String, ClusterPods>,
    in_flight: FxHashMap<u32, (String, String, u64)>,
    /// (cluster, pod) that left their cluster: their snapshot and lease are emptied on the next
    /// tick, so shared data does not keep a snapshot per pod IP ever seen (proxy-wasm cannot
    /// delete a key; an empty value frees all but the key's name).
    departed: Vec<(String, String)>,
}

impl Scraper {
    /// A scraper for `path` every `interval_ms`; snapshots older than `stale_ms` are unknown.
    /// `target` is the `target_metric` to extract besides the standard signals.
    /// `via` is the ORIGINAL_DST cluster the calls go through.
    pub fn new(
        via: &str,
        path: &str,
        interval_ms: u64,
        stale_ms: u64,
        target: Option<String>,
    ) -> Scraper {
        let interval_ms = interval_ms.max(10);
        // Data must survive until the next scrape lands, or every pod would be unknown between
        // scrapes: the bound is at least two intervals whatever `metricsStaleMs` says.
        let stale_ms = stale_ms.max(interval_ms.saturating_mul(2));
        // A reply later than the staleness bound would be useless; more than 5 s ties up a lease.
        let timeout_ms = interval_ms.clamp(250, stale_ms.clamp(250, 5_000));
        Scraper {
            via: via.to_string(),
            path: path.to_string(),
            interval_ms,
            stale_ms,
            timeout_ms: u32::try_from(timeout_ms).unwrap_or(5_000),
            target,
            worker_id: 0,
            clusters: HashMap::new(),
            in_flight: FxHashMap::default(),
            departed: Vec::new(),
        }
    }

    /// Sets this worker's lease identity (a random number from the host, drawn once).
    pub fn set_worker_id(&mut self, id: u64) {
        self.worker_id = id.max(1);
    }

    /// True once [`Scraper::set_worker_id`] was called.
    pub fn has_worker_id(&self) -> bool {
        self.worker_id != 0
    }

    /// Shared-data key of a pod's snapshot. The target metric is part of it because configs with
    /// different `target_metric`s extract different values from the same pod.
    pub fn snapshot_key(&self, cluster: &str, pod: &str) -> String {
        format!("{KEY_PREFIX}{cluster}/{pod}/{}", self.target.as_deref().unwrap_or(""))
    }

    fn lease_key(&self, cluster: &str, pod: &str) -> String {
        format!("{LEASE_PREFIX}{cluster}/{pod}/{}", self.target.as_deref().unwrap_or(""))
    }

    /// Remembers the current pods of `cluster` (from a request's upstream host list).
    pub fn learn(&mut self, cluster: &str, pods: &[String], now_ms: u64) {
        if cluster.is_empty() {
            return;
        }
        let entry = self.clusters.entry(cluster.to_string()).or_default();
        if entry.pods.as_slice() != pods {
            let gone = entry.pods.iter().filter(|p| !pods.contains(p));
            let room = MAX_DEPARTED.saturating_sub(self.departed.len());
            self.departed.extend(gone.take(room).map(|p| (cluster.to_string(), p.clone())));
            entry.pods = pods.to_vec();
        }
        entry.last_seen_ms = now_ms;
    }

    /// The pod's snapshot if present and fresh.
    pub fn read(&self, host: &dyn Host, cluster: &str, pod: &str, now_ms: u64) -> Option<Snapshot> {
        let (bytes, _) = host.get_shared_data(&self.snapshot_key(cluster, pod));
        let snap = Snapshot::decode(&bytes?)?;
        (!snap.is_stale(now_ms, self.stale_ms)).then_some(snap)
    }

    /// Number of scrape calls this worker is waiting for.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Starts the scrapes due at `now_ms`.
    pub fn on_tick(&mut self, host: &mut dyn Host, now_ms: u64) {
        let departed = &mut self.departed;
        self.clusters.retain(|cluster, c| {
            let live = now_ms.saturating_sub(c.last_seen_ms) < CLUSTER_IDLE_MS;
            if !live {
                departed.extend(c.pods.iter().map(|p| (cluster.clone(), p.clone())));
            }
            live
        });
        self.forget_departed(host);
        // A reply that never came (host bug) must not block a pod forever.
        let timeout = u64::from(self.timeout_ms) * 2;
        self.in_flight.retain(|_, (_, _, started)| now_ms.saturating_sub(*started) < timeout);
        let due: Vec<(String, String)> = self
            .clusters
            .iter()
            .flat_map(|(c, p)| p.pods.iter().map(move |pod| (c.clone(), pod.clone())))
            .collect();
        for (cluster, pod) in due {
            if self.in_flight.values().any(|(c, p, _)| *c == cluster && *p == pod) {
                continue;
            }
            if !self.needs_scrape(host, &cluster, &pod, now_ms)
                || !self.take_lease(host, &cluster, &pod, now_ms)
            {
                continue;
            }
            let headers = [
                (":method", "GET"),
                (":path", self.path.as_str()),
                (":authority", pod.as_str()),
                ("x-envoy-original-dst-host", pod.as_str()),
                ("accept", "text/plain"),
            ];
            let call = HttpCallRequest {
                cluster: &self.via,
                headers: &headers,
                body: None,
                timeout_ms: self.timeout_ms,
            };
            match host.http_call(&call) {
                Ok(token) => {
                    self.in_flight.insert(token, (cluster, pod, now_ms));
                }
                Err(e) => host.log(
                    LogLevel::Warn,
                    &format!("endpoint_metrics: scrape of {pod} in {cluster} not sent: {e}"),
                ),
            }
        }
    }

    /// Empties the shared entries of pods that left (unless they came back meanwhile).
    fn forget_departed(&mut self, host: &mut dyn Host) {
        for (cluster, pod) in std::mem::take(&mut self.departed) {
            if self.clusters.get(&cluster).is_some_and(|c| c.pods.contains(&pod)) {
                continue;
            }
            for key in [self.snapshot_key(&cluster, &pod), self.lease_key(&cluster, &pod)] {
                if host.get_shared_data(&key).0.is_some_and(|v| !v.is_empty()) {
                    // A failure leaves a stale entry, which readers ignore; nothing to retry.
                    let _ = host.set_shared_data(&key, b"", 0);
                }
            }
        }
    }

    fn needs_scrape(&self, host: &dyn Host, cluster: &str, pod: &str, now_ms: u64) -> bool {
        let (bytes, _) = host.get_shared_data(&self.snapshot_key(cluster, pod));
        match bytes.as_deref().and_then(Snapshot::decode) {
            // Half the interval: a snapshot written just after the previous tick is still renewed
            // on this one, so each pod is scraped about once per interval.
            Some(s) => now_ms.saturating_sub(s.sampled_ms) >= self.interval_ms / 2,
            None => true,
        }
    }

    fn take_lease(&self, host: &mut dyn Host, cluster: &str, pod: &str, now_ms: u64) -> bool {
        let key = self.lease_key(cluster, pod);
        let (bytes, cas) = host.get_shared_data(&key);
        if let Some((owner, until)) = bytes.as_deref().and_then(parse_lease) {
            if owner != self.worker_id && until > now_ms {
                return false;
            }
        }
        let value =
            format!("{} {}", self.worker_id, now_ms.saturating_add(u64::from(self.timeout_ms)));
        host.set_shared_data(&key, value.as_bytes(), cas).is_ok()
    }

    /// Handles an HTTP-call reply; returns false if the token is not one of this scraper's calls.
    pub fn on_reply(
        &mut self,
        host: &mut dyn Host,
        token: u32,
        reply: &HttpReply,
        now_ms: u64,
    ) -> bool {
        let Some((cluster, pod, _)) = self.in_flight.remove(&token) else {
            return false;
        };
        let metrics = if (200..300).contains(&reply.status) {
            prometheus::parse(&reply.body, self.target.as_deref())
        } else {
            host.log(
                LogLevel::Debug,
                &format!("endpoint_metrics: scrape of {pod} failed (status {})", reply.status),
            );
            Default::default()
        };
        if reply.status != 0 && metrics.is_empty() {
            host.log(LogLevel::Debug, &format!("endpoint_metrics: {pod} exposes no known metric"));
        }
        let snap = Snapshot { sampled_ms: now_ms, metrics };
        if let Err(e) = host.set_shared_data(&self.snapshot_key(&cluster, &pod), &snap.encode(), 0)
        {
            host.log(
                LogLevel::Warn,
                &format!("endpoint_metrics: cannot store metrics of {pod}: {e}"),
            );
        }
        true
    }
}

fn parse_lease(bytes: &[u8]) -> Option<(u64, u64)> {
    let text = std::str::from_utf8(bytes).ok()?;
    let (owner, until) = text.split_once(' ')?;
    Some((owner.parse().ok()?, until.parse().ok()?))
}

#[cfg(test)]
#[path = "scrape_tests.rs"]
mod tests;
