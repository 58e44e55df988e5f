//! A real Redis Cluster for the e2e and fidelity tests: `redis-server` processes in cluster mode on
//! loopback ports (`$AI_LB_REDIS_SERVER` or from `PATH`), slots assigned and nodes met by hand
//! (`CLUSTER ADDSLOTSRANGE`, `CLUSTER MEET`, `CLUSTER REPLICATE`), which is what
//! `redis-cli --cluster create` does, without its fixed waits. Startup is bounded
//! ([`START_TIMEOUT`]); every process is killed when the fixture is dropped.
//!
//! Also the operations a cluster's operator performs: moving a slot to another master
//! (`CLUSTER SETSLOT ... IMPORTING/MIGRATING`, `MIGRATE`, `SETSLOT ... NODE`) and a manual failover
//! (`CLUSTER FAILOVER` on a replica).

use std::net::SocketAddr;
use std::process::Child;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use tokio::time::Instant;

use crate::paths::{free_port, TempDir};
use crate::redis::{redis_server_bin, spawn_redis_server, RedisClient, RedisValue};

/// How long the whole cluster gets to come up (all nodes agreeing on the slot map).
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a slot move or a failover may take.
const OP_TIMEOUT: Duration = Duration::from_secs(15);

/// Hash slots of a Redis Cluster.
pub const SLOTS: u16 = 16384;

/// One `redis-server` of the cluster.
struct Node {
    port: u16,
    bus_port: u16,
    child: Option<Child>,
    id: String,
}

/// A running Redis Cluster on loopback.
pub struct RedisClusterFixture {
    nodes: Vec<Node>,
    dir: TempDir,
}

impl RedisClusterFixture {
    /// Starts `masters` masters sharing the 16384 slots evenly, each with `replicas` replicas,
    /// and waits until every node reports `cluster_state:ok` with the same slot map.
    pub async fn start(masters: usize, replicas: usize) -> Result<RedisClusterFixture> {
        if masters == 0 {
            bail!("a Redis Cluster needs at least one master");
        }
        let deadline = Instant::now() + START_TIMEOUT;
        let mut fixture = RedisClusterFixture { nodes: Vec::new(), dir: TempDir::new("ai-lb-rc")? };
        for _ in 0..masters * (1 + replicas) {
            fixture.spawn_node()?;
        }
        for i in 0..fixture.nodes.len() {
            fixture.nodes[i].id = fixture.wait_node_ready(i, deadline).await?;
        }
        // Slots and config epochs of the masters (distinct epochs: no collision to resolve).
        for m in 0..masters {
            let first = (SLOTS as usize * m / masters) as u16;
            let last = (SLOTS as usize * (m + 1) / masters - 1) as u16;
            let mut c = fixture.client_at(m).await?;
            expect_ok(
                c.cmd(&["CLUSTER", "ADDSLOTSRANGE", &first.to_string(), &last.to_string()]).await?,
                "CLUSTER ADDSLOTSRANGE",
            )?;
            expect_ok(
                c.cmd(&["CLUSTER", "SET-CONFIG-EPOCH", &(m + 1).to_string()]).await?,
                "CLUSTER SET-CONFIG-EPOCH",
            )?;
        }
        let mut first = fixture.client_at(0).await?;
        for n in &fixture.nodes[1..] {
            expect_ok(
                first
                    .cmd(&[
                        "CLUSTER",
                        "MEET",
                        "127.0.0.1",
                        &n.port.to_string(),
                        &n.bus_port.to_string(),
                    ])
                    .await?,
                "CLUSTER MEET",
            )?;
        }
        fixture.wait_all_known(deadline).await?;
        for r in masters..fixture.nodes.len() {
            let master = (r - masters) % masters;
            let master_id = fixture.nodes[master].id.clone();
            let mut c = fixture.client_at(r).await?;
            expect_ok(c.cmd(&["CLUSTER", "REPLICATE", &master_id]).await?, "CLUSTER REPLICATE")?;
        }
        fixture.wait_settled(deadline).await?;
        eprintln!(
            "testkit: Redis Cluster ({masters} masters, {replicas} replicas each) at {:?}",
            fixture.nodes.iter().map(|n| n.port).collect::<Vec<_>>()
        );
        Ok(fixture)
    }

    fn spawn_node(&mut self) -> Result<()> {
        let node = self.start_node()?;
        self.nodes.push(node);
        Ok(())
    }

    /// Starts a node on two ports that were free a moment ago (the OS may still hand one out to
    /// another socket before redis-server binds it: `wait_node_ready` then starts it again).
    fn start_node(&self) -> Result<Node> {
        let (port, bus_port) = (free_port()?, free_port()?);
        let dir = self.dir.path().join(port.to_string());
        std::fs::create_dir_all(&dir)?;
        let extra = [
            "--cluster-enabled",
            "yes",
            "--cluster-port",
            &bus_port.to_string(),
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "2000",
            // A master gone for good must not stop the others serving their slots.
            "--cluster-require-full-coverage",
            "no",
        ]
        .map(str::to_string);
        let child = spawn_redis_server(&redis_server_bin(), port, &dir, &extra)?;
        Ok(Node { port, bus_port, child: Some(child), id: String::new() })
    }

    /// Waits until node `i` answers; returns its node id.
    async fn wait_node_ready(&mut self, i: usize, deadline: Instant) -> Result<String> {
        let mut last = anyhow!("never tried");
        while Instant::now() < deadline {
            if let Some(Ok(Some(status))) = self.nodes[i].child.as_mut().map(Child::try_wait) {
                let log = self.log(i);
                if log.contains("Address already in use") {
                    // One of its ports was taken between free_port and bind: new ports.
                    self.nodes[i] = self.start_node()?;
                    continue;
                }
                bail!("redis-server (cluster node {i}) exited at start ({status}): {log}");
            }
            let ours = self.nodes[i].child.as_ref().map(Child::id);
            match self.client_at(i).await {
                Ok(mut c) => match c.process_id().await {
                    Ok(pid) if Some(pid) != ours => {
                        // Another server took the port before ours bound it: new ports.
                        if let Some(mut child) = self.nodes[i].child.take() {
                            let _ = child.kill();
                            let _ = child.wait();
                        }
                        self.nodes[i] = self.start_node()?;
                        continue;
                    }
                    Ok(_) => match c.cmd(&["CLUSTER", "MYID"]).await {
                        Ok(v) => match v.as_string() {
                            Some(id) if !id.is_empty() => return Ok(id),
                            _ => last = anyhow!("CLUSTER MYID answered {v:?}"),
                        },
                        Err(e) => last = e,
                    },
                    Err(e) => last = e,
                },
                Err(e) => last = e,
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(last.context(format!("cluster node {i} not ready within {START_TIMEOUT:?}")))
    }

    fn log(&self, i: usize) -> String {
        let port = self.nodes.get(i).map(|n| n.port).unwrap_or(0);
        std::fs::read_to_string(self.dir.path().join(port.to_string()).join("redis.log"))
            .unwrap_or_default()
    }

    /// Waits until every node lists every other node, none still in handshake.
    async fn wait_all_known(&self, deadline: Instant) -> Result<()> {
        loop {
            let mut ok = true;
            for i in 0..self.nodes.len() {
                let text = self.client_at(i).await?.cmd(&["CLUSTER", "NODES"]).await?;
                let text = text.as_string().unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                if lines.len() != self.nodes.len() || text.contains("handshake") {
                    ok = false;
                    break;
                }
            }
            if ok {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("cluster nodes did not all meet within {START_TIMEOUT:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until every node says `cluster_state:ok`, all give the same `CLUSTER SLOTS`, and
    /// every replica's link to its master is up.
    async fn wait_settled(&self, deadline: Instant) -> Result<()> {
        loop {
            let last = match self.settled().await {
                Ok(None) => return Ok(()),
                Ok(Some(why)) => why,
                Err(e) => format!("{e:#}"),
            };
            if Instant::now() >= deadline {
                bail!("Redis Cluster not settled in time: {last}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `None` when settled, else why not.
    async fn settled(&self) -> Result<Option<String>> {
        let mut maps = Vec::new();
        for i in 0..self.nodes.len() {
            let mut c = self.client_at(i).await?;
            let info = c.cmd(&["CLUSTER", "INFO"]).await?.as_string().unwrap_or_default();
            if !info.contains("cluster_state:ok") {
                return Ok(Some(format!("node {i}: not cluster_state:ok")));
            }
            maps.push(self.slot_map_from(&mut c).await?);
            let repl = c.cmd(&["INFO", "replication"]).await?.as_string().unwrap_or_default();
            if repl.contains("role:slave") && !repl.contains("master_link_status:up") {
                return Ok(Some(format!("node {i}: replica link not up")));
            }
        }
        if maps.windows(2).any(|w| w[0] != w[1]) {
            return Ok(Some("nodes disagree on the slot map".into()));
        }
        Ok(None)
    }

    /// `(first, last, master port)` of every slot range, sorted, as a node sees it.
    async fn slot_map_from(&self, c: &mut RedisClient) -> Result<Vec<(i64, i64, i64)>> {
        let mut out = Vec::new();
        for range in c.cmd(&["CLUSTER", "SLOTS"]).await?.items() {
            let parts = range.items();
            let master = parts.get(2).map(RedisValue::items).unwrap_or_default();
            match (
                parts.first().and_then(RedisValue::as_int),
                parts.get(1).and_then(RedisValue::as_int),
                master.get(1).and_then(RedisValue::as_int),
            ) {
                (Some(a), Some(b), Some(p)) => out.push((a, b, p)),
                _ => bail!("unexpected CLUSTER SLOTS range {range:?}"),
            }
        }
        out.sort();
        Ok(out)
    }

    async fn client_at(&self, i: usize) -> Result<RedisClient> {
        let n = self.nodes.get(i).ok_or_else(|| anyhow!("no cluster node {i}"))?;
        RedisClient::connect(SocketAddr::from(([127, 0, 0, 1], n.port))).await
    }

    /// Every node's `ip:port` (masters first, as started): the gateway cluster's seed endpoints.
    pub fn endpoints(&self) -> Vec<String> {
        self.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect()
    }

    /// A client on the node at `port`.
    pub async fn client(&self, port: u16) -> Result<RedisClient> {
        RedisClient::connect(SocketAddr::from(([127, 0, 0, 1], port))).await
    }

    /// The port of the master currently serving `slot`, as the first node that answers sees it.
    pub async fn slot_owner(&self, slot: u16) -> Result<u16> {
        for i in 0..self.nodes.len() {
            let Ok(mut c) = self.client_at(i).await else { continue };
            let Ok(map) = self.slot_map_from(&mut c).await else { continue };
            if let Some((_, _, port)) =
                map.iter().find(|(a, b, _)| (*a..=*b).contains(&i64::from(slot)))
            {
                return Ok(u16::try_from(*port)?);
            }
        }
        bail!("no node knows a master for slot {slot}")
    }

    /// Ports of the nodes that are masters now.
    pub async fn master_ports(&self) -> Result<Vec<u16>> {
        let mut out = Vec::new();
        for n in self.nodes.iter().filter(|n| n.child.is_some()) {
            let mut c = self.client(n.port).await?;
            let role = c.cmd(&["ROLE"]).await?.items();
            if role.first().and_then(RedisValue::as_string).as_deref() == Some("master") {
                out.push(n.port);
            }
        }
        Ok(out)
    }

    /// The node id of the node at `port`.
    fn id_of(&self, port: u16) -> Result<String> {
        self.nodes
            .iter()
            .find(|n| n.port == port)
            .map(|n| n.id.clone())
            .ok_or_else(|| anyhow!("no cluster node on port {port}"))
    }

    /// Moves `slot` with its keys to the master at `to`, the way an operator resharding does:
    /// [`start_slot_move`](Self::start_slot_move) then [`finish_slot_move`](Self::finish_slot_move).
    pub async fn move_slot(&self, slot: u16, to: u16) -> Result<()> {
        self.start_slot_move(slot, to).await?;
        self.finish_slot_move(slot, to).await
    }

    /// `CLUSTER SETSLOT <slot> IMPORTING` on the master at `to`, then `MIGRATING` on the slot's
    /// master: from now on the old master serves only the keys it still holds and answers `ASK`
    /// for the others.
    pub async fn start_slot_move(&self, slot: u16, to: u16) -> Result<()> {
        let from = self.slot_owner(slot).await?;
        if from == to {
            bail!("slot {slot} is already served by {to}");
        }
        let (from_id, to_id) = (self.id_of(from)?, self.id_of(to)?);
        let s = slot.to_string();
        let mut dst = self.client(to).await?;
        expect_ok(dst.cmd(&["CLUSTER", "SETSLOT", &s, "IMPORTING", &from_id]).await?, "IMPORTING")?;
        let mut src = self.client(from).await?;
        expect_ok(src.cmd(&["CLUSTER", "SETSLOT", &s, "MIGRATING", &to_id]).await?, "MIGRATING")
    }

    /// Moves `slot` to the master at `to` as `redis-cli --cluster reshard --cluster-pipeline 1
    /// --cluster-replace` does, one key per `MIGRATE` in `CLUSTER GETKEYSINSLOT` order, with
    /// `pause` between keys (a slow network, a big slot): every script call meanwhile runs on a
    /// half-moved slot. A key the target already has (`BUSYKEY`: created there by a script that
    /// an `ASK` sent to it) is replaced, as `--cluster-replace` does. Returns how many were.
    pub async fn move_slot_key_by_key(&self, slot: u16, to: u16, pause: Duration) -> Result<usize> {
        self.start_slot_move(slot, to).await?;
        let from = self.slot_owner(slot).await?;
        let (s, port) = (slot.to_string(), to.to_string());
        let mut src = self.client(from).await?;
        let mut replaced = 0;
        loop {
            let reply = src.cmd(&["CLUSTER", "GETKEYSINSLOT", &s, "1"]).await?;
            let Some(key) = reply.items().iter().find_map(RedisValue::as_string) else { break };
            let base = ["MIGRATE", "127.0.0.1", port.as_str(), "", "0", "5000"];
            let reply = src.cmd(&[&base[..], &["KEYS", key.as_str()]].concat()).await?;
            match &reply {
                RedisValue::Status(st) if st == "OK" || st == "NOKEY" => {}
                RedisValue::Error(e) if e.contains("BUSYKEY") => {
                    replaced += 1;
                    let again = [&base[..], &["REPLACE", "KEYS", key.as_str()]].concat();
                    let reply = src.cmd(&again).await?;
                    if !matches!(&reply, RedisValue::Status(st) if st == "OK") {
                        bail!("MIGRATE REPLACE of {key}: {reply:?}");
                    }
                }
                other => bail!("MIGRATE of {key} (slot {slot}) to {to}: {other:?}"),
            }
            tokio::time::sleep(pause).await;
        }
        self.finish_slot_move(slot, to).await?;
        Ok(replaced)
    }

    /// `MIGRATE` of every key left in `slot` to the master at `to`, then `SETSLOT ... NODE` on
    /// the target, the old master and the other masters. Returns when every node agrees on the
    /// new owner.
    pub async fn finish_slot_move(&self, slot: u16, to: u16) -> Result<()> {
        let from = self.slot_owner(slot).await?;
        let to_id = self.id_of(to)?;
        let s = slot.to_string();
        let mut src = self.client(from).await?;
        loop {
            let keys: Vec<String> = src
                .cmd(&["CLUSTER", "GETKEYSINSLOT", &s, "1000"])
                .await?
                .items()
                .iter()
                .filter_map(RedisValue::as_string)
                .collect();
            if keys.is_empty() {
                break;
            }
            let port = to.to_string();
            let mut args = vec!["MIGRATE", "127.0.0.1", port.as_str(), "", "0", "5000", "KEYS"];
            args.extend(keys.iter().map(String::as_str));
            let reply = src.cmd(&args).await?;
            if !matches!(&reply, RedisValue::Status(s) if s == "OK" || s == "NOKEY") {
                bail!("MIGRATE of slot {slot} to {to}: {reply:?}");
            }
        }
        let mut dst = self.client(to).await?;
        expect_ok(dst.cmd(&["CLUSTER", "SETSLOT", &s, "NODE", &to_id]).await?, "SETSLOT NODE")?;
        expect_ok(src.cmd(&["CLUSTER", "SETSLOT", &s, "NODE", &to_id]).await?, "SETSLOT NODE")?;
        for port in self.master_ports().await? {
            if port != from && port != to {
                let mut c = self.client(port).await?;
                expect_ok(c.cmd(&["CLUSTER", "SETSLOT", &s, "NODE", &to_id]).await?, "SETSLOT")?;
            }
        }
        self.wait_settled(Instant::now() + OP_TIMEOUT).await?;
        let owner = self.slot_owner(slot).await?;
        if owner != to {
            bail!("slot {slot} still served by {owner} after the move to {to}");
        }
        Ok(())
    }

    /// Promotes a replica of the master at `master` with `CLUSTER FAILOVER` (coordinated, no data
    /// lost) and waits until every node agrees; returns the new master's port.
    pub async fn failover(&self, master: u16) -> Result<u16> {
        let master_id = self.id_of(master)?;
        let mut replica = None;
        for n in &self.nodes {
            let mut c = self.client(n.port).await?;
            let repl = c.cmd(&["INFO", "replication"]).await?.as_string().unwrap_or_default();
            if repl.contains("role:slave") && repl.contains(&format!("master_port:{master}")) {
                replica = Some(n.port);
                break;
            }
        }
        let replica =
            replica.ok_or_else(|| anyhow!("master {master} ({master_id}) has no replica"))?;
        expect_ok(self.client(replica).await?.cmd(&["CLUSTER", "FAILOVER"]).await?, "FAILOVER")?;
        let deadline = Instant::now() + OP_TIMEOUT;
        loop {
            if self.master_ports().await?.contains(&replica) && self.settled().await?.is_none() {
                return Ok(replica);
            }
            if Instant::now() >= deadline {
                bail!("failover of {master} to {replica} not done within {OP_TIMEOUT:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills the node at `port` (SIGKILL): its connections break and, without a replica taking
    /// over, its slots are served by nobody.
    pub fn kill_node(&mut self, port: u16) -> Result<()> {
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.port == port)
            .ok_or_else(|| anyhow!("no cluster node on port {port}"))?;
        if let Some(mut c) = node.child.take() {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    /// Every hash field holding an integer on every master, as (key, field, value).
    pub async fn all_hash_counters(&self) -> Result<Vec<(String, String, i64)>> {
        let mut out = Vec::new();
        for port in self.master_ports().await? {
            out.extend(self.client(port).await?.all_hash_counters().await?);
        }
        Ok(out)
    }

    /// Every key on every master, sorted.
    pub async fn all_keys(&self) -> Result<Vec<String>> {
        let mut out = Vec::new();
        for port in self.master_ports().await? {
            out.extend(self.client(port).await?.keys("*").await?);
        }
        out.sort();
        Ok(out)
    }
}

/// The hash slot of `key` (CRC16 of the key or of its `{hash tag}`), as `CLUSTER KEYSLOT`.
pub fn keyslot(key: &str) -> u16 {
    redis_protocol::redis_keyslot(key.as_bytes())
}

fn expect_ok(reply: RedisValue, what: &str) -> Result<()> {
    match reply {
        RedisValue::Status(s) if s == "OK" => Ok(()),
        other => bail!("{what}: {other:?}"),
    }
}

impl Drop for RedisClusterFixture {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}
