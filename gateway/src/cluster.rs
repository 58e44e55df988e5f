//! Upstream clusters: endpoints, health, load balancing and active HTTP health checks.
//!
//! Shared by all workers (Envoy keeps a thread-local copy per worker; one shared copy behaves the same
//! for our purposes and lets the admin API change endpoints atomically).

use crate::config::{ClusterConfig, ClusterType, HealthCheckConfig, LbPolicy, RedisClusterConfig};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// Health of an endpoint, named like Envoy's `Upstream::Host::Health`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Takes traffic.
    Healthy,
    /// Takes traffic only when no healthy host is left.
    Degraded,
    /// Takes no traffic (unless the cluster is in panic mode).
    Unhealthy,
}

impl Health {
    /// The name used in `get_upstream_hosts` and the admin API.
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Healthy => "Healthy",
            Health::Degraded => "Degraded",
            Health::Unhealthy => "Unhealthy",
        }
    }
    /// Parse the admin API name.
    pub fn parse(s: &str) -> Option<Health> {
        match s {
            "Healthy" => Some(Health::Healthy),
            "Degraded" => Some(Health::Degraded),
            "Unhealthy" => Some(Health::Unhealthy),
            _ => None,
        }
    }
}

/// An endpoint's serialized host info, with the health and the stored body's version it was made
/// from.
#[derive(Debug)]
struct HostInfo {
    health: Health,
    metrics_version: u64,
    json: Arc<[u8]>,
}

/// One upstream endpoint.
#[derive(Debug)]
pub struct Endpoint {
    /// `ip:port` as configured.
    pub address: String,
    /// Parsed address.
    pub addr: SocketAddr,
    /// Current health.
    pub health: Mutex<Health>,
    /// Last stored health-check body (`store_metrics`), and how many times it was stored or
    /// cleared (for [`Endpoint::host_info`]'s memo).
    metrics: Mutex<(String, u64)>,
    /// The last [`Endpoint::host_info`].
    host_info: Mutex<Option<HostInfo>>,
    /// In-flight upstream requests (for least_request and `/stats`).
    pub active: AtomicI64,
    /// Requests sent to this endpoint.
    pub total: AtomicU64,
    hc_successes: Mutex<(u32, u32)>,
    /// Not health-checked yet (Envoy: a session's `first_check_`): one success makes it Healthy.
    first_hc_pending: AtomicBool,
    /// Envoy's PENDING_ACTIVE_HC under `ignore_new_hosts_until_first_hc`: left out of load
    /// balancing until the first check.
    excluded: AtomicBool,
}

impl Endpoint {
    /// An endpoint of a cluster without health check: Healthy.
    fn new(address: &str) -> Option<Arc<Endpoint>> {
        Self::with_state(address, Health::Healthy, false)
    }

    /// An endpoint of a health-checked cluster. Envoy marks it FAILED_ACTIVE_HC (Unhealthy) until
    /// its first check passes, whether it was configured or added at run time.
    fn new_checked(address: &str, excluded: bool) -> Option<Arc<Endpoint>> {
        Self::with_state(address, Health::Unhealthy, excluded)
    }

    fn with_state(address: &str, health: Health, excluded: bool) -> Option<Arc<Endpoint>> {
        let addr: SocketAddr = address.parse().ok()?;
        Some(Arc::new(Endpoint {
            address: address.to_string(),
            addr,
            health: Mutex::new(health),
            metrics: Mutex::new((String::new(), 0)),
            host_info: Mutex::new(None),
            active: AtomicI64::new(0),
            total: AtomicU64::new(0),
            hc_successes: Mutex::new((0, 0)),
            first_hc_pending: AtomicBool::new(health == Health::Unhealthy),
            excluded: AtomicBool::new(excluded),
        }))
    }

    /// Left out of load balancing until its first health check.
    pub fn excluded(&self) -> bool {
        self.excluded.load(Ordering::Relaxed)
    }
    /// Current health.
    pub fn health(&self) -> Health {
        self.health.lock().map(|h| *h).unwrap_or(Health::Unhealthy)
    }
    /// Force a health state.
    pub fn set_health(&self, h: Health) {
        if let Ok(mut g) = self.health.lock() {
            *g = h;
        }
    }
    /// Stored metrics text.
    pub fn metrics(&self) -> String {
        self.metrics.lock().map(|m| m.0.clone()).unwrap_or_default()
    }
    /// Replaces the stored metrics text (empty: none).
    pub fn set_metrics(&self, text: String) {
        if let Ok(mut m) = self.metrics.lock() {
            *m = (text, m.1.wrapping_add(1));
        }
    }
    /// This endpoint's info as `proxy_get_upstream_hosts` lists it: JSON with `health_status`
    /// and the stored `metrics`. Serialized again only when the health or the stored body
    /// changed: a real vLLM's body is 30-60 KB, and a plugin lists the hosts per request, while
    /// the body changes once per check interval.
    pub fn host_info(&self) -> Arc<[u8]> {
        let health = self.health();
        let Ok(metrics) = self.metrics.lock() else { return Arc::from(&b"{}"[..]) };
        let Ok(mut memo) = self.host_info.lock() else { return Arc::from(&b"{}"[..]) };
        if let Some(info) = memo.as_ref() {
            if info.health == health && info.metrics_version == metrics.1 {
                return Arc::clone(&info.json);
            }
        }
        let json: Arc<[u8]> = serde_json::json!({
            "health_status": health.as_str(),
            "metrics": metrics.0,
        })
        .to_string()
        .into_bytes()
        .into();
        *memo = Some(HostInfo { health, metrics_version: metrics.1, json: Arc::clone(&json) });
        json
    }
}

/// One cluster.
#[derive(Debug)]
pub struct Cluster {
    /// Name.
    pub name: String,
    /// LB policy.
    pub lb_policy: LbPolicy,
    /// Current endpoint set.
    pub endpoints: RwLock<Vec<Arc<Endpoint>>>,
    /// Optional health check.
    pub health_check: Option<HealthCheckConfig>,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// STATIC or ORIGINAL_DST.
    pub cluster_type: ClusterType,
    /// ORIGINAL_DST: destination from `x-envoy-original-dst-host`.
    pub use_http_header: bool,
    /// REDIS_CLUSTER: slot map refresh settings.
    pub redis_cluster: RedisClusterConfig,
    /// Envoy's `ignore_new_hosts_until_first_hc`.
    pub ignore_new_hosts_until_first_hc: bool,
    /// How large and how many an upstream response's headers may be.
    pub response_header_limits: crate::config::HeaderLimits,
    /// Round-robin position. Starts at a random value, as Envoy's round-robin LB starts each
    /// worker's index at a random seed: gateways (or workers) started together do not all send
    /// their first requests to the same endpoint.
    rr: AtomicUsize,
}

impl Cluster {
    /// Snapshot of the endpoints.
    pub fn endpoints(&self) -> Vec<Arc<Endpoint>> {
        self.endpoints.read().map(|e| e.clone()).unwrap_or_default()
    }

    /// Find an endpoint by `ip:port`.
    pub fn find(&self, address: &str) -> Option<Arc<Endpoint>> {
        self.endpoints().into_iter().find(|e| e.address == address)
    }

    /// Replace the endpoint set, keeping the state of endpoints that stay. New ones start Healthy
    /// without a health check; with one they start Unhealthy pending their first check, as in
    /// Envoy's `updateDynamicHostList` (and excluded from load balancing under
    /// `ignore_new_hosts_until_first_hc`). Returns the new endpoints, to be checked at once.
    pub fn set_endpoints(&self, addrs: &[String]) -> Result<Vec<Arc<Endpoint>>, String> {
        let old = self.endpoints();
        let mut all = Vec::new();
        let mut added = Vec::new();
        for a in addrs {
            if let Some(e) = old.iter().find(|e| &e.address == a) {
                all.push(e.clone());
                continue;
            }
            let e = if self.health_check.is_some() {
                Endpoint::new_checked(a, self.ignore_new_hosts_until_first_hc)
            } else {
                Endpoint::new(a)
            };
            let e = e.ok_or_else(|| format!("bad endpoint {a}"))?;
            added.push(e.clone());
            all.push(e);
        }
        if let Ok(mut g) = self.endpoints.write() {
            *g = all;
        }
        Ok(added)
    }

    /// The cluster's load balancer. Like Envoy: healthy hosts first, degraded hosts when no healthy
    /// host is left, and panic mode (all hosts) below 50% healthy.
    pub fn pick(&self) -> Option<Arc<Endpoint>> {
        let mut all = self.endpoints();
        all.retain(|e| !e.excluded());
        if all.is_empty() {
            return None;
        }
        let healthy: Vec<_> =
            all.iter().filter(|e| e.health() == Health::Healthy).cloned().collect();
        let candidates = if healthy.len() * 2 >= all.len() && !healthy.is_empty() {
            healthy
        } else {
            let degraded: Vec<_> =
                all.iter().filter(|e| e.health() != Health::Unhealthy).cloned().collect();
            if !degraded.is_empty() && degraded.len() * 2 >= all.len() {
                degraded
            } else {
                // Envoy panic threshold (50%): balance across all hosts.
                all
            }
        };
        match self.lb_policy {
            LbPolicy::RoundRobin => {
                let i = self.rr.fetch_add(1, Ordering::Relaxed);
                candidates.get(i % candidates.len()).cloned()
            }
            LbPolicy::Random => {
                let i = rand::random_range(0..candidates.len());
                candidates.get(i).cloned()
            }
            LbPolicy::LeastRequest => {
                let a = candidates.get(rand::random_range(0..candidates.len()))?;
                let b = candidates.get(rand::random_range(0..candidates.len()))?;
                if b.active.load(Ordering::Relaxed) < a.active.load(Ordering::Relaxed) {
                    Some(b.clone())
                } else {
                    Some(a.clone())
                }
            }
        }
    }

    /// Pick with an override host (non-strict): used when it is an endpoint of this cluster whose
    /// health is Healthy or Degraded; otherwise the normal LB decides.
    /// The endpoint a request (or a plugin's HTTP call) goes to, as Envoy decides it: on an
    /// ORIGINAL_DST cluster with `use_http_header`, the address in `x-envoy-original-dst-host`
    /// (`None` without it); on any other cluster the header means nothing and the override host or
    /// the LB decides.
    pub fn pick_for_request(
        &self,
        original_dst_header: Option<&str>,
        override_host: Option<&str>,
    ) -> Option<Arc<Endpoint>> {
        match self.cluster_type {
            ClusterType::OriginalDst if self.use_http_header => {
                let addr = original_dst_header?.trim();
                self.find(addr).or_else(|| Endpoint::new(addr))
            }
            ClusterType::OriginalDst | ClusterType::RedisCluster => None,
            ClusterType::Static => self.pick_with_override(override_host),
        }
    }

    /// Pick with Higress's override host (non-strict: an unknown or unhealthy host falls back to
    /// the LB).
    pub fn pick_with_override(&self, override_host: Option<&str>) -> Option<Arc<Endpoint>> {
        if let Some(h) = override_host {
            if let Some(e) = self.find(h) {
                if e.health() != Health::Unhealthy {
                    return Some(e);
                }
            }
        }
        self.pick()
    }
}

/// All clusters, by name.
#[derive(Debug, Default)]
pub struct Clusters {
    map: HashMap<String, Arc<Cluster>>,
    order: Vec<String>,
}

impl Clusters {
    /// Build from config.
    pub fn new(cfgs: &[ClusterConfig]) -> anyhow::Result<Clusters> {
        let mut c = Clusters::default();
        for cfg in cfgs {
            let mut eps = Vec::new();
            for e in &cfg.endpoints {
                // Envoy's static clusters mark every host FAILED_ACTIVE_HC when a health checker
                // is configured; the warming round before READY checks them.
                let ep = if cfg.health_check.is_some() {
                    Endpoint::new_checked(e, false)
                } else {
                    Endpoint::new(e)
                };
                eps.push(ep.ok_or_else(|| anyhow::anyhow!("bad endpoint {e}"))?);
            }
            c.order.push(cfg.name.clone());
            c.map.insert(
                cfg.name.clone(),
                Arc::new(Cluster {
                    name: cfg.name.clone(),
                    lb_policy: cfg.lb_policy,
                    endpoints: RwLock::new(eps),
                    health_check: cfg.health_check.clone(),
                    connect_timeout: Duration::from_millis(cfg.connect_timeout_ms.max(1)),
                    cluster_type: cfg.cluster_type,
                    use_http_header: cfg.original_dst_lb_config.use_http_header,
                    redis_cluster: cfg.redis_cluster,
                    ignore_new_hosts_until_first_hc: cfg.ignore_new_hosts_until_first_hc,
                    response_header_limits: cfg.response_header_limits(),
                    rr: AtomicUsize::new(rand::random::<u32>() as usize),
                }),
            );
        }
        Ok(c)
    }
    /// Look up by exact name.
    pub fn get(&self, name: &str) -> Option<Arc<Cluster>> {
        self.map.get(name).cloned()
    }
    /// All clusters in config order.
    pub fn all(&self) -> Vec<Arc<Cluster>> {
        self.order.iter().filter_map(|n| self.map.get(n).cloned()).collect()
    }
}

/// Largest body kept as metrics (Higress caps at 64 KiB).
const MAX_METRICS: usize = 64 * 1024;

/// One probe of one endpoint: Ok(the body's first `MAX_METRICS` bytes) when the status is one
/// `hc` expects. A longer body is not read further.
async fn probe(
    addr: SocketAddr,
    hc: &HealthCheckConfig,
    timeout: Duration,
) -> Result<bytes::Bytes, String> {
    use http_body_util::BodyExt;
    let fut = async {
        let stream = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let io = hyper_util::rt::TokioIo::new(stream);
        let (mut send, conn) =
            hyper::client::conn::http1::handshake::<_, http_body_util::Empty<bytes::Bytes>>(io)
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let req = hyper::Request::get(hc.path.as_str())
            .header("host", addr.to_string())
            .header("user-agent", "Envoy/HC")
            .body(http_body_util::Empty::new())
            .map_err(|e| e.to_string())?;
        let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        if !hc.expects(status.as_u16()) {
            return Err(format!("status {status}"));
        }
        let mut body = resp.into_body();
        let mut kept = bytes::BytesMut::new();
        while kept.len() < MAX_METRICS {
            let Some(frame) = body.frame().await else { break };
            if let Ok(data) = frame.map_err(|e| e.to_string())?.into_data() {
                let room = MAX_METRICS - kept.len();
                kept.extend_from_slice(&data[..data.len().min(room)]);
            }
        }
        Ok(kept.freeze())
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err("timeout".into()),
    }
}

/// Run one health-check round over a cluster's endpoints.
pub async fn health_check_round(cluster: &Cluster) {
    check_endpoints(cluster, cluster.endpoints()).await
}

/// Health-check `eps` of `cluster` once (a round, or endpoints just added: Envoy starts a new
/// host's session, and so its first check, at once).
pub async fn check_endpoints(cluster: &Cluster, eps: Vec<Arc<Endpoint>>) {
    let Some(hc) = &cluster.health_check else { return };
    let mut tasks = Vec::new();
    for e in eps {
        let hc = hc.clone();
        let timeout = Duration::from_millis(hc.timeout_ms.max(1));
        tasks.push(tokio::spawn(async move {
            let r = probe(e.addr, &hc, timeout).await;
            (e, r)
        }));
    }
    for t in tasks {
        let Ok((e, r)) = t.await else { continue };
        let mut counts = match e.hc_successes.lock() {
            Ok(c) => c,
            Err(_) => continue,
        };
        // Envoy: the first check of a host decides alone (one success is enough to leave
        // FAILED_ACTIVE_HC), and ends its PENDING_ACTIVE_HC either way.
        let first = e.first_hc_pending.swap(false, Ordering::Relaxed);
        e.excluded.store(false, Ordering::Relaxed);
        match r {
            Ok(body) => {
                counts.0 += 1;
                counts.1 = 0;
                if hc.store_metrics {
                    e.set_metrics(String::from_utf8_lossy(&body).into_owned());
                }
                if (first || counts.0 >= hc.healthy_threshold) && e.health() == Health::Unhealthy {
                    e.set_health(Health::Healthy);
                }
            }
            Err(err) => {
                counts.1 += 1;
                counts.0 = 0;
                tracing::debug!(endpoint = %e.address, cluster = %cluster.name, "health check failed: {err}");
                e.set_metrics(String::new());
                if counts.1 >= hc.unhealthy_threshold {
                    e.set_health(Health::Unhealthy);
                }
            }
        }
    }
}

/// Spawn the periodic health checkers (after a first round has been run by the caller).
pub fn spawn_health_checks(clusters: &Clusters) {
    for c in clusters.all() {
        let Some(hc) = c.health_check.clone() else { continue };
        tokio::spawn(async move {
            let mut iv = tokio::time::interval(Duration::from_millis(hc.interval_ms.max(10)));
            iv.tick().await;
            loop {
                iv.tick().await;
                health_check_round(&c).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(ignore_new_hosts: bool) -> Arc<Cluster> {
        let cfg: ClusterConfig = serde_json::from_value(serde_json::json!({
            "name": "pods",
            "endpoints": ["127.0.0.1:1"],
            "health_check": {"path": "/metrics", "interval_ms": 60000},
            "ignore_new_hosts_until_first_hc": ignore_new_hosts,
        }))
        .unwrap();
        let c = Clusters::new(&[cfg]).unwrap().get("pods").unwrap();
        c.find("127.0.0.1:1").unwrap().set_health(Health::Healthy);
        c
    }

    /// Where 30 picks go after two endpoints were added and before their first check.
    fn picks_before_first_check(ignore_new_hosts: bool) -> Vec<String> {
        let c = cluster(ignore_new_hosts);
        let added = c
            .set_endpoints(&["127.0.0.1:1".into(), "127.0.0.1:2".into(), "127.0.0.1:3".into()])
            .unwrap();
        assert_eq!(added.len(), 2);
        assert!(added.iter().all(|e| e.health() == Health::Unhealthy));
        (0..30).filter_map(|_| c.pick()).map(|e| e.address.clone()).collect()
    }

    /// Envoy's default: new hosts count as Unhealthy, so one healthy host of three puts the
    /// cluster in panic (every host takes traffic). With `ignore_new_hosts_until_first_hc` they
    /// are left out until checked: the one healthy host takes everything.
    #[test]
    fn new_hosts_count_for_panic_unless_ignored_until_first_check() {
        let counted = picks_before_first_check(false);
        assert!(counted.iter().any(|a| a == "127.0.0.1:2"), "{counted:?}");
        let ignored = picks_before_first_check(true);
        assert!(ignored.iter().all(|a| a == "127.0.0.1:1"), "{ignored:?}");
        assert_eq!(ignored.len(), 30);
    }

    /// Envoy seeds each round-robin index at random: clusters built from one config do not all
    /// begin at the first endpoint (all 64 would with a counter starting at 0; at random, the
    /// chance of that is 4^-63).
    #[test]
    fn round_robin_starts_at_a_random_endpoint() {
        let cfg: ClusterConfig = serde_json::from_value(serde_json::json!({
            "name": "c",
            "endpoints": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4"],
        }))
        .unwrap();
        let firsts: std::collections::HashSet<String> = (0..64)
            .filter_map(|_| Clusters::new(std::slice::from_ref(&cfg)).ok()?.get("c")?.pick())
            .map(|e| e.address.clone())
            .collect();
        assert!(firsts.len() > 1, "{firsts:?}");
        // Still a rotation from there: four picks visit every endpoint once.
        let c = Clusters::new(&[cfg]).unwrap().get("c").unwrap();
        let four: std::collections::HashSet<String> =
            (0..4).filter_map(|_| c.pick()).map(|e| e.address.clone()).collect();
        assert_eq!(four.len(), 4, "{four:?}");
    }

    #[test]
    fn endpoints_of_a_cluster_without_health_check_start_healthy() {
        let cfg: ClusterConfig =
            serde_json::from_value(serde_json::json!({"name": "c", "endpoints": ["127.0.0.1:1"]}))
                .unwrap();
        let c = Clusters::new(&[cfg]).unwrap().get("c").unwrap();
        let added = c.set_endpoints(&["127.0.0.1:1".into(), "127.0.0.1:2".into()]).unwrap();
        assert_eq!(added[0].health(), Health::Healthy);
        assert_eq!(c.find("127.0.0.1:1").unwrap().health(), Health::Healthy);
    }

    #[test]
    fn host_info_is_made_again_only_when_the_health_or_the_stored_body_changed() {
        let e = Endpoint::new("127.0.0.1:1").unwrap();
        let info =
            |e: &Endpoint| serde_json::from_slice::<serde_json::Value>(&e.host_info()).unwrap();
        assert_eq!(info(&e), serde_json::json!({"health_status": "Healthy", "metrics": ""}));
        e.set_metrics("vllm:num_requests_running 3\n".into());
        let first = e.host_info();
        assert!(Arc::ptr_eq(&first, &e.host_info()), "unchanged: the same bytes, not made again");
        assert_eq!(info(&e)["metrics"], "vllm:num_requests_running 3\n");
        // The same text stored again by the next check is a new sample: made again, still equal.
        e.set_metrics("vllm:num_requests_running 3\n".into());
        assert!(!Arc::ptr_eq(&first, &e.host_info()));
        assert_eq!(*first, *e.host_info());
        e.set_health(Health::Unhealthy);
        assert_eq!(info(&e)["health_status"], "Unhealthy");
        e.set_metrics(String::new());
        assert_eq!(info(&e), serde_json::json!({"health_status": "Unhealthy", "metrics": ""}));
    }
}
