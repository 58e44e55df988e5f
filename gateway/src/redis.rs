//! Per-worker Redis clients for `proxy_redis_init` / `proxy_redis_call` (Higress extension).
//!
//! Like Higress's Redis async client (`AsyncClientImpl::send` in its Envoy): each command goes to
//! the host the cluster's load balancer picks for it (round robin by default, healthy hosts
//! first), over one connection per host per worker; on connect `AUTH [user] pass` and
//! `SELECT db` are pipelined with discarded replies; queries are raw RESP bytes written verbatim
//! and replies are matched FIFO. Writes are batched
//! (flush after `buffer_flush_timeout` ms or `max_buffer_size_before_flush` bytes; 0/0 flushes at
//! once). Connect failure, remote close and op timeout close the connection and fail every pending
//! request with NetworkError (status 1, size 0).
//!
//! On a `REDIS_CLUSTER` cluster the client is a Redis Cluster client, as Envoy's Redis connection
//! pool on an `envoy.clusters.redis` cluster: see [`cluster_client`].

mod cluster_client;

use crate::cluster::Cluster;
use crate::config::ClusterType;
use crate::global::WorkerEvent;
use bytes::{Bytes, BytesMut};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

/// Settings from `proxy_redis_init`.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// Cluster name (before `?`).
    pub cluster: String,
    /// AUTH user (may be empty).
    pub username: String,
    /// AUTH password (empty: no AUTH).
    pub password: String,
    /// Op timeout.
    pub timeout: Duration,
    /// `db` parameter.
    pub db: Option<String>,
    /// `buffer_flush_timeout` (ms).
    pub flush_timeout: Duration,
    /// `max_buffer_size_before_flush` (bytes).
    pub max_buffer: usize,
    /// Connect timeout (the cluster's).
    pub connect_timeout: Duration,
    /// Every query parameter of the cluster string, as Envoy keeps them (`params_`): part of the
    /// configuration a re-init compares.
    pub params: std::collections::BTreeMap<String, String>,
}

impl RedisConfig {
    /// Whether a write buffer of `len` bytes goes out now: batching is off (a zero timeout or
    /// size) or the buffer reached `max_buffer_size_before_flush`.
    fn flushes_at_once(&self, len: usize) -> bool {
        self.max_buffer == 0 || len >= self.max_buffer || self.flush_timeout.is_zero()
    }

    /// Parse `cluster?db=1&buffer_flush_timeout=3&max_buffer_size_before_flush=1024`.
    pub fn parse(
        full: &str,
        username: String,
        password: String,
        timeout_ms: u32,
        connect_timeout: Duration,
    ) -> RedisConfig {
        let (cluster, query) = full.split_once('?').unwrap_or((full, ""));
        let mut cfg = RedisConfig {
            cluster: cluster.to_string(),
            username,
            password,
            timeout: Duration::from_millis(if timeout_ms == 0 { 1000 } else { timeout_ms as u64 }),
            db: None,
            flush_timeout: Duration::from_millis(3),
            max_buffer: 1024,
            connect_timeout,
            params: Default::default(),
        };
        for kv in query.split('&').filter(|kv| !kv.is_empty()) {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            // The first occurrence of a key wins, as in Envoy's query-string parser.
            cfg.params.entry(k.to_string()).or_insert_with(|| v.to_string());
            match k {
                "db" if !v.is_empty() => cfg.db = Some(v.to_string()),
                "buffer_flush_timeout" => {
                    if let Ok(n) = v.parse::<u64>() {
                        cfg.flush_timeout = Duration::from_millis(n)
                    }
                }
                "max_buffer_size_before_flush" => {
                    if let Ok(n) = v.parse::<usize>() {
                        cfg.max_buffer = n
                    }
                }
                _ => {}
            }
        }
        cfg
    }

    /// Whether a re-init with `other` changes nothing Envoy's async client compares
    /// (`currentConfigEquals` in Higress's `async_client_impl.cc`): credentials, the query
    /// parameters, the op timeout and the batching settings.
    pub fn same_settings(&self, other: &RedisConfig) -> bool {
        self.username == other.username
            && self.password == other.password
            && self.params == other.params
            && self.timeout == other.timeout
            && self.max_buffer == other.max_buffer
            && self.flush_timeout == other.flush_timeout
    }
}

/// Where a client's commands go.
#[derive(Debug, Clone)]
pub enum RedisTarget {
    /// One Redis server: every command goes to it.
    Node(SocketAddr),
    /// A Redis Cluster reached through these seed nodes.
    Cluster {
        /// The cluster's endpoints; the slot map is read from the first that answers.
        seeds: Vec<SocketAddr>,
        /// Slot map refresh settings.
        settings: crate::config::RedisClusterConfig,
    },
}

impl RedisTarget {
    /// The target of one command on a gateway cluster: the endpoint the cluster's load balancer
    /// picks (so an ordinary cluster of several independent Redis servers spreads the commands
    /// over them, as Envoy's `chooseHost` per command does), or on a `REDIS_CLUSTER` cluster all
    /// its endpoints as seeds. `None` without endpoints (the call then fails with
    /// InternalFailure).
    pub fn of(cluster: &Cluster) -> Option<RedisTarget> {
        match cluster.cluster_type {
            ClusterType::RedisCluster => {
                let seeds: Vec<SocketAddr> = cluster.endpoints().iter().map(|e| e.addr).collect();
                (!seeds.is_empty())
                    .then_some(RedisTarget::Cluster { seeds, settings: cluster.redis_cluster })
            }
            _ => cluster.pick().map(|e| RedisTarget::Node(e.addr)),
        }
    }
}

/// One worker's client for one cluster. Dropping it closes its connections (pending requests
/// fail).
pub struct RedisClient {
    /// Settings.
    pub cfg: RedisConfig,
    /// The open connections: one per host the load balancer picked, or one Redis Cluster client.
    conns: HashMap<ConnKey, mpsc::UnboundedSender<NodeRequest>>,
    /// Set by `proxy_redis_init` (a client first used by a call without init has defaults).
    initialized: bool,
}

impl RedisClient {
    /// New client; the connection is opened on the first call.
    pub fn new(cfg: RedisConfig) -> RedisClient {
        RedisClient { cfg, conns: HashMap::new(), initialized: false }
    }

    /// `proxy_redis_init` on an existing client, as Higress's Envoy does it
    /// (`AsyncClientImpl::initialize`): after a first init, the same settings again change
    /// nothing (the connection and the calls in flight on it stay; Higress #4086, a plugin
    /// reload re-inits); other settings close the connection (its calls in flight fail with
    /// NetworkError) and the next call connects with the new ones.
    pub fn initialize(&mut self, cfg: RedisConfig) {
        if self.initialized && self.cfg.same_settings(&cfg) {
            return;
        }
        // Dropping the senders ends the connection tasks, which fail what is pending.
        self.conns.clear();
        self.cfg = cfg;
        self.initialized = true;
    }

    /// Queue a raw command. The reply arrives as a `WorkerEvent::Redis`.
    pub fn send(
        &mut self,
        target: RedisTarget,
        token: u32,
        query: Bytes,
        events: mpsc::UnboundedSender<WorkerEvent>,
        gen: u64,
    ) -> bool {
        let key = match &target {
            RedisTarget::Node(addr) => ConnKey::Node(*addr),
            RedisTarget::Cluster { .. } => ConnKey::Cluster,
        };
        let open = self.conns.get(&key).filter(|t| !t.is_closed());
        let tx = match open {
            Some(tx) => tx,
            None => {
                let (tx, rx) = mpsc::unbounded_channel();
                let cfg = self.cfg.clone();
                match target {
                    RedisTarget::Node(addr) => {
                        tokio::task::spawn_local(run_node(
                            cfg,
                            addr,
                            rx,
                            ReplySink::Worker { events, gen },
                        ));
                    }
                    RedisTarget::Cluster { seeds, settings } => {
                        tokio::task::spawn_local(cluster_client::run(
                            cfg, seeds, settings, rx, events, gen,
                        ));
                    }
                }
                // Connections that ended (a host gone or failing) are dropped, not kept per address.
                self.conns.retain(|_, t| !t.is_closed());
                self.conns.entry(key).insert_entry(tx).into_mut()
            }
        };
        tx.send(NodeRequest { token, query, asking: false }).is_ok()
    }
}

/// Which connection of a [`RedisClient`] a command goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum ConnKey {
    /// The connection to one host.
    Node(SocketAddr),
    /// The Redis Cluster client (its own connections to the nodes).
    Cluster,
}

/// One command for a node's connection.
struct NodeRequest {
    token: u32,
    query: Bytes,
    /// Send `ASKING` first (a Redis Cluster `ASK` redirection).
    asking: bool,
}

/// Where a connection's replies go: straight to the worker, or (Redis Cluster) to the cluster
/// router, which may redirect them.
#[derive(Clone)]
enum ReplySink {
    Worker { events: mpsc::UnboundedSender<WorkerEvent>, gen: u64 },
    Router(mpsc::UnboundedSender<(u32, Option<Bytes>)>),
}

impl ReplySink {
    /// `None` is a failure (NetworkError).
    fn deliver(&self, token: u32, reply: Option<Bytes>) {
        match self {
            ReplySink::Worker { events, gen } => {
                let _ = events.send(WorkerEvent::Redis { gen: *gen, token, reply });
            }
            ReplySink::Router(tx) => {
                let _ = tx.send((token, reply));
            }
        }
    }
}

/// Fails every request still waiting on a connection that broke.
fn deliver_all_failed(sink: &ReplySink, pending: &mut VecDeque<(Option<u32>, Instant)>) {
    for (t, _) in pending.drain(..) {
        if let Some(t) = t {
            sink.deliver(t, None);
        }
    }
}

fn resp_command(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// The commands a new connection sends first, with discarded replies: `AUTH`, `SELECT`.
fn connection_setup(cfg: &RedisConfig) -> (Vec<u8>, usize) {
    let mut wbuf = Vec::new();
    let mut n = 0;
    if !cfg.password.is_empty() {
        if cfg.username.is_empty() {
            wbuf.extend(resp_command(&[b"AUTH", cfg.password.as_bytes()]));
        } else {
            wbuf.extend(resp_command(&[b"AUTH", cfg.username.as_bytes(), cfg.password.as_bytes()]));
        }
        n += 1;
    }
    if let Some(db) = &cfg.db {
        wbuf.extend(resp_command(&[b"SELECT", db.as_bytes()]));
        n += 1;
    }
    (wbuf, n)
}

/// Appends one request (with `ASKING` before it when asked) to the write buffer.
fn queue_request(
    req: NodeRequest,
    wbuf: &mut Vec<u8>,
    pending: &mut VecDeque<(Option<u32>, Instant)>,
) {
    if req.asking {
        wbuf.extend(resp_command(&[b"ASKING"]));
        pending.push_back((None, Instant::now()));
    }
    wbuf.extend_from_slice(&req.query);
    pending.push_back((Some(req.token), Instant::now()));
}

/// One node's connection: opened on the first request, opened again for the next request after a
/// failure; ends (failing what is pending) when its sender is dropped.
async fn run_node(
    cfg: RedisConfig,
    addr: SocketAddr,
    mut rx: mpsc::UnboundedReceiver<NodeRequest>,
    sink: ReplySink,
) {
    let mut first: Option<NodeRequest> = None;
    loop {
        let Some(req) = (match first.take() {
            Some(r) => Some(r),
            None => rx.recv().await,
        }) else {
            return;
        };
        let conn =
            tokio::time::timeout(cfg.connect_timeout, tokio::net::TcpStream::connect(addr)).await;
        let mut sock = match conn {
            Ok(Ok(s)) => s,
            _ => {
                tracing::debug!(cluster = %cfg.cluster, %addr, "redis connect failed");
                sink.deliver(req.token, None);
                while let Ok(r) = rx.try_recv() {
                    sink.deliver(r.token, None);
                }
                continue;
            }
        };
        let _ = sock.set_nodelay(true);
        // None = reply to discard (AUTH / SELECT / ASKING).
        let mut pending: VecDeque<(Option<u32>, Instant)> = VecDeque::new();
        let (mut wbuf, setup) = connection_setup(&cfg);
        pending.extend(std::iter::repeat_n((None, Instant::now()), setup));
        queue_request(req, &mut wbuf, &mut pending);
        let mut flush_at: Option<tokio::time::Instant> = None;
        if cfg.flushes_at_once(wbuf.len()) {
            // Written here, not through a timer: tokio timers round up to the millisecond, which
            // would add ~1 ms to every Redis round trip.
            if sock.write_all(&wbuf).await.is_err() {
                deliver_all_failed(&sink, &mut pending);
                continue;
            }
            wbuf.clear();
        } else {
            flush_at = Some(tokio::time::Instant::now() + cfg.flush_timeout);
        }
        let mut rbuf = BytesMut::with_capacity(4096);
        let mut channel_open = true;
        let failed = loop {
            // Op timeout: the oldest outstanding request.
            let deadline = pending.iter().find(|p| p.0.is_some()).map(|p| p.1 + cfg.timeout);
            tokio::select! {
                r = rx.recv(), if channel_open => match r {
                    Some(req) => {
                        queue_request(req, &mut wbuf, &mut pending);
                        if cfg.flushes_at_once(wbuf.len()) {
                            flush_at = None;
                            if sock.write_all(&wbuf).await.is_err() {
                                break true;
                            }
                            wbuf.clear();
                        } else {
                            flush_at.get_or_insert(tokio::time::Instant::now() + cfg.flush_timeout);
                        }
                    }
                    None => {
                        // Client dropped (re-init or VM gone): close the connection.
                        channel_open = false;
                        break true;
                    }
                },
                _ = async { match flush_at { Some(t) => tokio::time::sleep_until(t).await, None => std::future::pending().await } } => {
                    flush_at = None;
                    if sock.write_all(&wbuf).await.is_err() {
                        break true;
                    }
                    wbuf.clear();
                }
                r = sock.read_buf(&mut rbuf) => match r {
                    Ok(0) | Err(_) => break true,
                    Ok(_) => {
                        let decode_failed = loop {
                            match redis_protocol::resp2::decode::decode_range(&rbuf) {
                                Ok(Some((_, n))) => {
                                    let raw = rbuf.split_to(n).freeze();
                                    match pending.pop_front() {
                                        Some((Some(t), _)) => sink.deliver(t, Some(raw)),
                                        Some((None, _)) => {}
                                        None => tracing::warn!(cluster = %cfg.cluster, "unexpected redis reply"),
                                    }
                                }
                                Ok(None) => break false,
                                Err(e) => {
                                    // Envoy's client (`ClientImpl::onData`) closes a connection
                                    // whose reply it cannot decode: the calls pending on it fail,
                                    // where skipping the bytes would pair every later reply with
                                    // the wrong call.
                                    tracing::warn!(cluster = %cfg.cluster, "bad redis reply, closing the connection: {e:?}");
                                    break true;
                                }
                            }
                        };
                        if decode_failed {
                            break true;
                        }
                    }
                },
                _ = async { match deadline { Some(d) => tokio::time::sleep_until(d.into()).await, None => std::future::pending().await } } => {
                    tracing::debug!(cluster = %cfg.cluster, %addr, "redis op timeout; closing connection");
                    break true;
                }
            }
        };
        if failed {
            deliver_all_failed(&sink, &mut pending);
        }
        if !channel_open {
            while let Ok(r) = rx.try_recv() {
                sink.deliver(r.token, None);
            }
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_query_parameters_are_parsed() {
        let c = RedisConfig::parse(
            "outbound|6379||redis.static?db=2&buffer_flush_timeout=0&max_buffer_size_before_flush=0",
            "u".into(),
            "p".into(),
            0,
            Duration::from_secs(1),
        );
        assert_eq!(c.cluster, "outbound|6379||redis.static");
        assert_eq!(c.db.as_deref(), Some("2"));
        assert_eq!((c.flush_timeout, c.max_buffer), (Duration::ZERO, 0));
        let d = RedisConfig::parse(
            "outbound|6379||redis.static",
            String::new(),
            String::new(),
            3000,
            Duration::from_secs(1),
        );
        assert_eq!(
            (d.db, d.flush_timeout, d.max_buffer, d.timeout),
            (None, Duration::from_millis(3), 1024, Duration::from_secs(3))
        );
    }
}
