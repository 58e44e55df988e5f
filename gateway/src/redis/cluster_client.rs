//! A Redis Cluster client behind `proxy_redis_call`, as Envoy's Redis connection pool behaves on
//! a cluster of type `envoy.clusters.redis` (the pool behind `redis_proxy`):
//! - the slot map is read with `CLUSTER SLOTS` from a known master or a seed endpoint, at start,
//!   every `cluster_refresh_rate_ms`, after a `MOVED` reply and after a node's connection fails;
//! - each raw command goes to the master of its key's slot (CRC16 of the key, or of its
//!   `{hash tag}`): for `EVAL`/`EVALSHA`/`FCALL` the first key after `numkeys`, for other commands
//!   their first argument; commands without a key (`PING`, `SCRIPT ...`) go to any master;
//! - `-MOVED <slot> <ip:port>`: the slot's entry is updated, the command is sent again to that node
//!   and the whole map is read again; `-ASK <slot> <ip:port>`: `ASKING` then the command on that
//!   node, the map unchanged. Up to [`MAX_REDIRECTS`] per command, then the last reply goes to the
//!   plugin as it is;
//! - one connection per node, opened on first use and again after a failure (AUTH/SELECT as for a
//!   single server); a failure fails only the commands on that node's connection (NetworkError).
//!
//! Commands that arrive before the first slot map is known wait for it; if no node answers
//! `CLUSTER SLOTS`, they go to a seed and redirections teach the map.

use super::{connection_setup, resp_command, run_node, NodeRequest, RedisConfig, ReplySink};
use crate::config::RedisClusterConfig;
use crate::global::WorkerEvent;
use bytes::{Bytes, BytesMut};
use redis_protocol::resp2::types::OwnedFrame;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

/// Hash slots of a Redis Cluster.
const SLOTS: usize = 16384;

/// Redirections followed for one command.
pub const MAX_REDIRECTS: u8 = 5;

/// One range of a `CLUSTER SLOTS` reply: first and last slot, master.
type SlotRange = (usize, usize, SocketAddr);

/// A command on its way.
struct Pending {
    query: Bytes,
    /// The node it was last sent to (an empty host in a redirection means this node's).
    node: SocketAddr,
    redirects: u8,
}

struct Router {
    cfg: RedisConfig,
    settings: RedisClusterConfig,
    seeds: Vec<SocketAddr>,
    /// Master of each slot; `None` until the first `CLUSTER SLOTS` answer (or failure).
    slots: Option<Vec<Option<SocketAddr>>>,
    nodes: HashMap<SocketAddr, mpsc::UnboundedSender<NodeRequest>>,
    pending: HashMap<u32, Pending>,
    /// Commands waiting for the first slot map.
    waiting: Vec<u32>,
    refreshing: bool,
    refresh_again: bool,
    /// Round robin over masters for commands without a key.
    next_any: usize,
    replies: mpsc::UnboundedSender<(u32, Option<Bytes>)>,
    maps: mpsc::UnboundedSender<Option<Vec<SlotRange>>>,
    events: mpsc::UnboundedSender<WorkerEvent>,
    gen: u64,
}

/// The client's task: routes the worker's commands until the client is dropped.
pub(super) async fn run(
    cfg: RedisConfig,
    seeds: Vec<SocketAddr>,
    settings: RedisClusterConfig,
    mut rx: mpsc::UnboundedReceiver<NodeRequest>,
    events: mpsc::UnboundedSender<WorkerEvent>,
    gen: u64,
) {
    let (replies, mut reply_rx) = mpsc::unbounded_channel();
    let (maps, mut map_rx) = mpsc::unbounded_channel();
    let mut router = Router {
        cfg,
        settings,
        seeds,
        slots: None,
        nodes: HashMap::new(),
        pending: HashMap::new(),
        waiting: Vec::new(),
        refreshing: false,
        refresh_again: false,
        next_any: 0,
        replies,
        maps,
        events,
        gen,
    };
    router.refresh();
    let period = Duration::from_millis(settings.cluster_refresh_rate_ms.max(1));
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            m = rx.recv() => match m {
                Some(request) => router.submit(request.token, request.query),
                None => {
                    // Client dropped (re-init or VM gone): what is pending fails, connections close.
                    for token in std::mem::take(&mut router.pending).into_keys() {
                        router.deliver(token, None);
                    }
                    return;
                }
            },
            Some((token, reply)) = reply_rx.recv() => router.on_reply(token, reply),
            Some(map) = map_rx.recv() => router.on_map(map),
            _ = tick.tick() => router.refresh(),
        }
    }
}

impl Router {
    fn deliver(&self, token: u32, reply: Option<Bytes>) {
        let _ = self.events.send(WorkerEvent::Redis { gen: self.gen, token, reply });
    }

    fn submit(&mut self, token: u32, query: Bytes) {
        let node = self.seeds.first().copied().unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0)));
        self.pending.insert(token, Pending { query, node, redirects: 0 });
        self.route(token);
    }

    /// Sends a command to the master of its key's slot.
    fn route(&mut self, token: u32) {
        let Some(map) = &self.slots else {
            self.waiting.push(token);
            return;
        };
        let Some(p) = self.pending.get(&token) else { return };
        let owner = key_slot(&p.query).and_then(|slot| map.get(slot).copied().flatten());
        match owner.or_else(|| self.any_master()) {
            Some(addr) => self.send_to(token, addr, false),
            None => self.fail(token),
        }
    }

    /// A master for a command without a key (or a slot no master serves: the node answers).
    fn any_master(&mut self) -> Option<SocketAddr> {
        let mut masters: Vec<SocketAddr> = self.slots.iter().flatten().flatten().copied().collect();
        masters.sort();
        masters.dedup();
        if masters.is_empty() {
            masters = self.seeds.clone();
        }
        self.next_any = self.next_any.wrapping_add(1);
        masters.get(self.next_any % masters.len().max(1)).copied()
    }

    fn send_to(&mut self, token: u32, addr: SocketAddr, asking: bool) {
        let Some(p) = self.pending.get_mut(&token) else { return };
        p.node = addr;
        let request = NodeRequest { token, query: p.query.clone(), asking };
        let replies = &self.replies;
        let cfg = &self.cfg;
        let tx = self.nodes.entry(addr).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::task::spawn_local(run_node(
                cfg.clone(),
                addr,
                rx,
                ReplySink::Router(replies.clone()),
            ));
            tx
        });
        if tx.send(request).is_err() {
            self.nodes.remove(&addr);
            self.fail(token);
        }
    }

    fn fail(&mut self, token: u32) {
        if self.pending.remove(&token).is_some() {
            self.deliver(token, None);
        }
    }

    fn on_reply(&mut self, token: u32, reply: Option<Bytes>) {
        let Some(p) = self.pending.get_mut(&token) else { return };
        if let Some(redirect) = reply.as_deref().and_then(|r| parse_redirect(r, p.node)) {
            if p.redirects < MAX_REDIRECTS {
                p.redirects += 1;
                match redirect {
                    Redirect::Moved { slot, to } => {
                        if let Some(entry) = self.slots.as_mut().and_then(|m| m.get_mut(slot)) {
                            *entry = Some(to);
                        }
                        self.refresh();
                        self.send_to(token, to, false);
                    }
                    Redirect::Ask { to } => self.send_to(token, to, true),
                }
                return;
            }
        }
        if reply.is_none() {
            // A node's connection failed: it may have gone, or lost its slots (failover).
            self.refresh();
        }
        self.pending.remove(&token);
        self.deliver(token, reply);
    }

    /// Starts reading the slot map (at most one read at a time; one more is queued).
    fn refresh(&mut self) {
        if self.refreshing {
            self.refresh_again = true;
            return;
        }
        self.refreshing = true;
        // Known masters first (seeds may be gone), then the seeds.
        let mut candidates: Vec<SocketAddr> =
            self.slots.iter().flatten().flatten().copied().collect();
        candidates.sort();
        candidates.dedup();
        candidates.extend(
            self.seeds.iter().filter(|s| !candidates.contains(s)).copied().collect::<Vec<_>>(),
        );
        let cfg = self.cfg.clone();
        let timeout = Duration::from_millis(self.settings.cluster_refresh_timeout_ms.max(1));
        let maps = self.maps.clone();
        tokio::task::spawn_local(async move {
            let mut found = None;
            for addr in candidates {
                match tokio::time::timeout(timeout, read_slots(&cfg, addr)).await {
                    Ok(Ok(ranges)) => {
                        found = Some(ranges);
                        break;
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(cluster = %cfg.cluster, %addr, "CLUSTER SLOTS: {e}")
                    }
                    Err(_) => {
                        tracing::debug!(cluster = %cfg.cluster, %addr, "CLUSTER SLOTS timed out")
                    }
                }
            }
            let _ = maps.send(found);
        });
    }

    fn on_map(&mut self, ranges: Option<Vec<SlotRange>>) {
        self.refreshing = false;
        match ranges {
            Some(ranges) => {
                let mut map = vec![None; SLOTS];
                for (first, last, master) in ranges {
                    for entry in map.iter_mut().take(last.min(SLOTS - 1) + 1).skip(first) {
                        *entry = Some(master);
                    }
                }
                self.slots = Some(map);
            }
            None => {
                tracing::warn!(cluster = %self.cfg.cluster, "no node answered CLUSTER SLOTS");
                self.slots.get_or_insert_with(|| vec![None; SLOTS]);
            }
        }
        for token in std::mem::take(&mut self.waiting) {
            self.route(token);
        }
        if std::mem::take(&mut self.refresh_again) {
            self.refresh();
        }
    }
}

/// The slot of a raw RESP command's key: for `EVAL`/`EVALSHA`/`FCALL` (and their `_RO` forms) the
/// first key after `numkeys`, for other commands the first argument. `None` without a key.
pub fn key_slot(query: &[u8]) -> Option<usize> {
    let (OwnedFrame::Array(args), _) = redis_protocol::resp2::decode::decode(query).ok()?? else {
        return None;
    };
    let arg = |i: usize| match args.get(i) {
        Some(OwnedFrame::BulkString(b)) | Some(OwnedFrame::SimpleString(b)) => Some(b.as_slice()),
        _ => None,
    };
    let name = String::from_utf8_lossy(arg(0)?).to_ascii_uppercase();
    let key = match name.as_str() {
        "EVAL" | "EVALSHA" | "EVAL_RO" | "EVALSHA_RO" | "FCALL" | "FCALL_RO" => {
            let numkeys: usize = std::str::from_utf8(arg(2)?).ok()?.parse().ok()?;
            if numkeys == 0 {
                return None;
            }
            arg(3)?
        }
        "PING" | "ECHO" | "SCRIPT" | "FUNCTION" | "INFO" | "TIME" | "CLUSTER" | "AUTH"
        | "SELECT" | "HELLO" | "CLIENT" | "CONFIG" | "COMMAND" | "DBSIZE" | "FLUSHALL"
        | "FLUSHDB" => return None,
        _ => arg(1)?,
    };
    Some(redis_protocol::redis_keyslot(key) as usize)
}

/// A Redis Cluster redirection.
#[derive(Debug, PartialEq, Eq)]
enum Redirect {
    Moved { slot: usize, to: SocketAddr },
    Ask { to: SocketAddr },
}

/// `-MOVED <slot> <ip:port>` / `-ASK <slot> <ip:port>`; an empty ip means the node that answered.
fn parse_redirect(reply: &[u8], from: SocketAddr) -> Option<Redirect> {
    let text = std::str::from_utf8(reply.strip_prefix(b"-")?).ok()?.trim_end();
    let mut parts = text.split(' ');
    let kind = parts.next()?;
    if kind != "MOVED" && kind != "ASK" {
        return None;
    }
    let slot: usize = parts.next()?.parse().ok()?;
    let (host, port) = parts.next()?.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ip: IpAddr = if host.is_empty() { from.ip() } else { host.parse().ok()? };
    let to = SocketAddr::new(ip, port);
    if kind == "MOVED" {
        Some(Redirect::Moved { slot, to })
    } else {
        Some(Redirect::Ask { to })
    }
}

/// `CLUSTER SLOTS` on one node (after AUTH, on a connection of its own).
async fn read_slots(cfg: &RedisConfig, addr: SocketAddr) -> Result<Vec<SlotRange>, String> {
    let mut sock = tokio::time::timeout(cfg.connect_timeout, tokio::net::TcpStream::connect(addr))
        .await
        .map_err(|_| "connect timeout".to_string())?
        .map_err(|e| e.to_string())?;
    let (mut out, mut skip) = connection_setup(cfg);
    out.extend(resp_command(&[b"CLUSTER", b"SLOTS"]));
    sock.write_all(&out).await.map_err(|e| e.to_string())?;
    let mut buf = BytesMut::with_capacity(4096);
    loop {
        match redis_protocol::resp2::decode::decode(&buf) {
            Ok(Some((frame, used))) => {
                let _ = buf.split_to(used);
                if skip > 0 {
                    skip -= 1;
                    continue;
                }
                return parse_slots(frame, addr);
            }
            Ok(None) => {}
            Err(e) => return Err(format!("bad reply: {e:?}")),
        }
        if sock.read_buf(&mut buf).await.map_err(|e| e.to_string())? == 0 {
            return Err("connection closed".into());
        }
    }
}

/// The ranges of a `CLUSTER SLOTS` reply: `[[first, last, [ip, port, id, ...], replicas...], ...]`.
fn parse_slots(frame: OwnedFrame, queried: SocketAddr) -> Result<Vec<SlotRange>, String> {
    let ranges = match frame {
        OwnedFrame::Array(r) => r,
        OwnedFrame::Error(e) => return Err(e.to_string()),
        other => return Err(format!("unexpected reply {other:?}")),
    };
    let int = |f: Option<&OwnedFrame>| match f {
        Some(OwnedFrame::Integer(i)) => usize::try_from(*i).ok(),
        _ => None,
    };
    let mut out = Vec::new();
    for range in ranges {
        let OwnedFrame::Array(parts) = range else { return Err("bad range".into()) };
        let (Some(first), Some(last)) = (int(parts.first()), int(parts.get(1))) else {
            return Err("bad slot numbers".into());
        };
        let Some(OwnedFrame::Array(master)) = parts.get(2) else {
            return Err("range without master".into());
        };
        let ip = match master.first() {
            Some(OwnedFrame::BulkString(b)) if b.is_empty() => queried.ip(),
            Some(OwnedFrame::BulkString(b)) => std::str::from_utf8(b)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| format!("master address {:?}", String::from_utf8_lossy(b)))?,
            _ => return Err("master without address".into()),
        };
        let port = int(master.get(1)).and_then(|p| u16::try_from(p).ok()).ok_or("bad port")?;
        out.push((first, last, SocketAddr::new(ip, port)));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd(args: &[&str]) -> Vec<u8> {
        resp_command(&args.iter().map(|a| a.as_bytes()).collect::<Vec<_>>())
    }

    #[test]
    fn key_slot_follows_the_command_and_hash_tags() {
        // `CLUSTER KEYSLOT foo` = 12182; a hash tag hashes only what is inside the braces.
        assert_eq!(key_slot(&cmd(&["GET", "foo"])), Some(12182));
        assert_eq!(key_slot(&cmd(&["hincrby", "a:{foo}:b", "h", "1"])), Some(12182));
        assert_eq!(key_slot(&cmd(&["EVALSHA", "abc", "2", "{foo}x", "bar"])), Some(12182));
        assert_eq!(key_slot(&cmd(&["eval", "return 1", "1", "x{foo}", "arg"])), Some(12182));
        assert_eq!(key_slot(&cmd(&["EVAL", "return 1", "0", "notakey"])), None);
        assert_eq!(key_slot(&cmd(&["PING"])), None);
        assert_eq!(key_slot(&cmd(&["SCRIPT", "LOAD", "return 1"])), None);
        assert_eq!(key_slot(b"not resp"), None);
    }

    #[test]
    fn redirections_are_parsed() {
        let from: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        assert_eq!(
            parse_redirect(b"-MOVED 3999 127.0.0.1:7002\r\n", from),
            Some(Redirect::Moved { slot: 3999, to: "127.0.0.1:7002".parse().unwrap() })
        );
        assert_eq!(
            parse_redirect(b"-ASK 12 :7001\r\n", from),
            Some(Redirect::Ask { to: "127.0.0.1:7001".parse().unwrap() })
        );
        assert_eq!(parse_redirect(b"-ERR MOVED 1 127.0.0.1:1\r\n", from), None);
        assert_eq!(parse_redirect(b"+OK\r\n", from), None);
    }
}
