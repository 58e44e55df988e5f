//! `bench redis-cost`: what one routed request costs the shared Redis, measured against a real
//! `redis-server` with the plugin's own scripts and key layout (the `PickCall` the plugin sends),
//! beside the machine's floor, a trivial `EVALSHA` that returns 1.
//!
//! Per routed request = one pick + its release, as the plugin sends them (request ids are a per-VM
//! counter): a request's release rides on its VM's next pick (the ids of the VM's requests that
//! ended since its last pick, inside the pick's `EVALSHA`); what is left at the end goes in one
//! `release.lua` call per VM. Not counted: each plugin VM's heartbeat, one small script per route
//! every third of `leaseMs` whatever the traffic, and the root tick's release call for what no pick
//! carried (at most one per VM and route every 100 ms, none while picks come faster). The
//! workload: 8 pods (`--pods`), 4 plugin VMs (owners), 5-block chats (prefix_cache; `--blocks`,
//! e.g. an agent's session 30 tool rounds in) that are sent again with one more block (hits), 16
//! requests in flight at a time (each request ends 16 picks after its pick).
//!
//! Beside them, the Go plugin's way (`go_like/*.lua`: scripts of ours that make the same Redis calls
//! with the same keys and arguments as its scripts): the pick is `EVAL` with the script's source
//! every time, the release a plain `HINCRBY -1`. Figures per request:
//! - Redis time: `usec` of `EVAL`/`EVALSHA` in `INFO commandstats`, plus the top-level commands the
//!   bench sent outside scripts (Go's release `HINCRBY`: its calls times that command's
//!   `usec_per_call`). Commands run inside a script are listed on their own lines too, and their
//!   time is already inside the script's: never added;
//! - Redis main-thread CPU (`INFO cpu`, `used_cpu_{user,sys}_main_thread` deltas);
//! - bytes into Redis (`total_net_input_bytes`) and out of it.
//!
//! Beside them too, the least a shared least-request pick can cost (`least_request_minimum.lua`):
//! `HGETALL` then `HINCRBY` in one script, a top-level `HINCRBY -1` to release; what any
//! least-request router that shares counts in Redis pays, with none of the plugin's guarantees
//! (leases, exactly-once releases). A target below it cannot be met by any script on that machine.
//!
//! Each case runs `reps` times, interleaved, on a fresh Redis per repetition; medians are reported
//! with min-max.
//!
//! By default one connection sends one call at a time, so Redis sleeps between calls and each call
//! finds its caches cold: the figures of a Redis that one gateway worker keeps busy. With
//! `--clients N` (up to the 4 VMs), N connections send at once, each for its share of the VMs,
//! and Redis never waits: the figures of a Redis shared by many gateways (on 2 cores the client
//! threads compete with Redis for CPU, which the per-call times include).

use ai_load_balancer::config::LoadAwareConfig;
use ai_load_balancer::metrics::router::PodView;
use ai_load_balancer::metrics::PodMetrics;
use ai_load_balancer::policy::load::load_args;
use ai_load_balancer::policy::picker::{LoadAware, PickCall, PickKind, ReleaseCall, StateKeys};
use ai_load_balancer::redis::{
    decode_reply, encode_command, is_noscript, prefix_key, Frame, Script, LEAST_REQUEST_LUA,
    PREFIX_CACHE_LUA, RELEASE_LUA,
};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::TcpStream;

use crate::procs::{redis_info, Redis};

/// Pods in the cluster unless `--pods` says otherwise.
pub const DEFAULT_PODS: usize = 8;
/// Prefix blocks per request unless `--blocks` says otherwise.
pub const DEFAULT_BLOCKS: usize = 5;
const OWNERS: usize = 4;
const IN_FLIGHT: usize = 16;
const ROUTE: &str = "llm-route";
const CLUSTER: &str = "outbound|8000||llm.static";
const BASELINE_LUA: &str = "return 1";
const GO_LEAST_REQUEST_LUA: &str = include_str!("go_like/least_request.lua");
const GO_PREFIX_CACHE_LUA: &str = include_str!("go_like/prefix_cache.lua");
const LEAST_REQUEST_MINIMUM_LUA: &str = include_str!("least_request_minimum.lua");
const PREFIX_CACHE_MINIMUM_LUA: &str = include_str!("prefix_cache_minimum.lua");

/// One case's figures per routed request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Cost {
    /// Case name.
    pub case: String,
    /// Routed requests measured.
    pub requests: u64,
    /// Script time (µs) per request.
    pub script_usec: f64,
    /// Redis main-thread CPU (µs) per request.
    pub cpu_usec: f64,
    /// Bytes into Redis per request.
    pub bytes_in: f64,
    /// Bytes out of Redis per request.
    pub bytes_out: f64,
}

/// Median and range over the repetitions of one case.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    /// Case name.
    pub case: String,
    /// Median of each figure.
    pub median: Cost,
    /// (min, max) script time.
    pub script_usec_range: (f64, f64),
    /// (min, max) CPU.
    pub cpu_usec_range: (f64, f64),
    /// Median script time over the baseline's median.
    pub script_vs_baseline: f64,
    /// Median CPU over the baseline's median.
    pub cpu_vs_baseline: f64,
}

/// What the measured requests look like.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Traffic {
    /// Pods in the cluster: every pick reads each one's count, the Go way sends each one.
    pub pods: usize,
    /// Connections sending at once (1 to the 4 VMs), the VMs shared out among them.
    pub clients: usize,
    /// Prefix blocks per `prefix_cache` request: a conversation's blocks so far plus a new one.
    pub blocks: usize,
}

impl Default for Traffic {
    fn default() -> Self {
        Traffic { pods: DEFAULT_PODS, clients: 1, blocks: DEFAULT_BLOCKS }
    }
}

/// `bench/results/<file_stem(traffic, tag)>.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RedisCostReport {
    /// Date, commit and machine (blank in a file written before the report carried them).
    #[serde(default)]
    pub stamp: crate::Stamp,
    /// When a file written before the stamp was made; None in newer ones (the stamp has it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unix_time: Option<u64>,
    /// Routed requests per case and repetition.
    pub requests_per_rep: u64,
    /// Repetitions per case (interleaved).
    pub reps: usize,
    /// Pods in the cluster (files from before `--pods` ran with the default).
    #[serde(default = "default_pods")]
    pub pods: usize,
    /// Connections sending at once, the VMs shared out among them (files from before `--clients`
    /// ran with one).
    #[serde(default = "one_client")]
    pub clients: usize,
    /// Prefix blocks per request (files from before `--blocks` ran with the default).
    #[serde(default = "default_blocks")]
    pub blocks: usize,
    /// `--tag` (another machine's run, say), appended to the file name so that it does not
    /// replace the default run's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// One summary per case, the floor first.
    pub cases: Vec<Summary>,
}

fn default_pods() -> usize {
    DEFAULT_PODS
}

fn one_client() -> usize {
    1
}

fn default_blocks() -> usize {
    DEFAULT_BLOCKS
}

/// The results file's name without `.json`: `redis-cost`, then `-pods<N>` for another number of
/// pods, `-clients<N>` for more than one client, `-blocks<N>` for another number of blocks and
/// `-<tag>` for a tag (so the default run's file is not overwritten).
pub fn file_stem(traffic: Traffic, tag: Option<&str>) -> String {
    let mut stem = "redis-cost".to_string();
    if traffic.pods != DEFAULT_PODS {
        stem.push_str(&format!("-pods{}", traffic.pods));
    }
    if traffic.clients > 1 {
        stem.push_str(&format!("-clients{}", traffic.clients));
    }
    if traffic.blocks != DEFAULT_BLOCKS {
        stem.push_str(&format!("-blocks{}", traffic.blocks));
    }
    if let Some(tag) = tag {
        stem.push('-');
        stem.push_str(tag);
    }
    stem
}

impl RedisCostReport {
    /// The traffic the report measured.
    pub fn traffic(&self) -> Traffic {
        Traffic { pods: self.pods, clients: self.clients, blocks: self.blocks }
    }

    /// Markdown for the README: what was run, the stamp line and the table.
    pub fn section(&self) -> String {
        format!(
            "`{}` (`bench redis-cost --requests {} --reps {} --pods {}{}{}{}`): what one routed request (pick + release) costs the shared Redis with the plugin's scripts, beside a trivial `EVALSHA` floor and the Go plugin's way; {} pods, {OWNERS} plugin VMs, {IN_FLIGHT} requests in flight, {}-block chats, {}\n\n{} · {} repetitions per case, interleaved, a fresh Redis each · {} routed requests per case and repetition\n\n{}",
            file_stem(self.traffic(), self.tag.as_deref()),
            self.requests_per_rep,
            self.reps,
            self.pods,
            if self.clients > 1 { format!(" --clients {}", self.clients) } else { String::new() },
            if self.blocks != DEFAULT_BLOCKS {
                format!(" --blocks {}", self.blocks)
            } else {
                String::new()
            },
            self.tag.as_ref().map(|t| format!(" --tag {t}")).unwrap_or_default(),
            self.pods,
            self.blocks,
            if self.clients > 1 {
                format!("{} connections sending at once (Redis kept busy)", self.clients)
            } else {
                "one connection, one call at a time (Redis idle between calls)".to_string()
            },
            crate::tables::stamp_text(&self.stamp, self.unix_time),
            self.reps,
            self.requests_per_rep,
            table(&self.cases, self.reps)
        )
    }
}

#[cfg(test)]
impl RedisCostReport {
    /// A small results file: the floor and one case over 64 pods, stamped.
    pub(crate) fn example() -> RedisCostReport {
        let summary = |case: &str, median: [f64; 4], script, cpu, vs: (f64, f64)| Summary {
            case: case.into(),
            median: Cost {
                case: case.into(),
                requests: 10_000,
                script_usec: median[0],
                cpu_usec: median[1],
                bytes_in: median[2],
                bytes_out: median[3],
            },
            script_usec_range: script,
            cpu_usec_range: cpu,
            script_vs_baseline: vs.0,
            cpu_vs_baseline: vs.1,
        };
        RedisCostReport {
            stamp: crate::Stamp::example(),
            unix_time: None,
            requests_per_rep: 10_000,
            reps: 3,
            pods: 64,
            clients: 1,
            blocks: DEFAULT_BLOCKS,
            tag: None,
            cases: vec![
                summary(
                    Case::Baseline.name(),
                    [2.5, 60.0, 142.0, 8.0],
                    (2.4, 2.7),
                    (59.0, 64.0),
                    (1.0, 1.0),
                ),
                summary(
                    Case::PrefixCache.name(),
                    [44.2, 80.5, 630.0, 44.0],
                    (41.3, 44.9),
                    (77.0, 82.3),
                    (17.68, 1.34),
                ),
            ],
        }
    }
}

/// A blocking RESP connection (one command at a time: what a gateway worker does per request).
struct Conn(TcpStream, Vec<u8>);

impl Conn {
    fn open(addr: &str) -> Result<Conn> {
        let s = TcpStream::connect(addr).with_context(|| format!("connect {addr}"))?;
        s.set_nodelay(true)?;
        Ok(Conn(s, Vec::new()))
    }

    fn call(&mut self, q: &[u8]) -> Result<Frame> {
        self.0.write_all(q)?;
        self.1.clear();
        let mut chunk = [0u8; 4096];
        loop {
            let n = self.0.read(&mut chunk)?;
            if n == 0 {
                bail!("redis closed the connection");
            }
            self.1.extend_from_slice(chunk.get(..n).unwrap_or_default());
            if let Ok(f) = decode_reply(&self.1) {
                return Ok(f);
            }
        }
    }

    /// EVALSHA, EVAL on NOSCRIPT.
    fn script(&mut self, s: &Script, keys: &[String], args: &[String]) -> Result<Frame> {
        let f = self.call(&s.command(keys, args, false))?;
        if is_noscript(&f) {
            return self.call(&s.command(keys, args, true));
        }
        if let Frame::Error(e) = &f {
            bail!("script error: {e}");
        }
        Ok(f)
    }
}

/// Deterministic xorshift for ids and chat contents.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Case {
    Baseline,
    /// The least a shared least-request pick can cost: `HGETALL` then `HINCRBY`, released by a
    /// top-level `HINCRBY -1` (no lease or record: none of the plugin's guarantees).
    LeastRequestMinimum,
    LeastRequest,
    /// The least a shared prefix-cache pick can cost: `MGET` of the chain, `HGETALL`, `HINCRBY`,
    /// `SET` of the new blocks, released by a top-level `HINCRBY -1` (no lease, record, refresh or
    /// load guard).
    PrefixCacheMinimum,
    PrefixCache,
    /// `prefix_cache` with `loadAware`: each pod's overload flag and penalty (queue + KV) sent.
    PrefixCacheLoadAware,
    GoLeastRequest,
    GoPrefixCache,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::Baseline => "EVALSHA return 1 (floor)",
            Case::LeastRequestMinimum => "least-request minimum: HGETALL + HINCRBY",
            Case::LeastRequest => "global_least_request",
            Case::PrefixCacheMinimum => "prefix-cache minimum: MGET + HGETALL + HINCRBY + SET",
            Case::PrefixCache => "prefix_cache",
            Case::PrefixCacheLoadAware => "prefix_cache loadAware",
            Case::GoLeastRequest => "Go plugin's global_least_request",
            Case::GoPrefixCache => "Go plugin's prefix_cache",
        }
    }
}

async fn snapshot(addr: &str) -> Result<(f64, u64, u64)> {
    let cpu = redis_info(addr, "cpu").await?;
    let stats = redis_info(addr, "stats").await?;
    let f = |v: &[(String, String)], k: &str| {
        v.iter().find(|(n, _)| n == k).and_then(|(_, x)| x.parse::<f64>().ok()).unwrap_or(0.0)
    };
    let cpu_s = f(&cpu, "used_cpu_user_main_thread") + f(&cpu, "used_cpu_sys_main_thread");
    Ok((
        cpu_s,
        f(&stats, "total_net_input_bytes") as u64,
        f(&stats, "total_net_output_bytes") as u64,
    ))
}

/// Script time plus `top_level` (command, calls the bench sent outside scripts) at that command's
/// mean time per call (the same command run inside a script does the same work).
async fn redis_usec(addr: &str, top_level: Option<(&str, u64)>) -> Result<f64> {
    let field = |v: &str, name: &str| {
        v.split(',').find_map(|f| f.strip_prefix(name)).and_then(|u| u.parse::<f64>().ok())
    };
    let mut usec = 0.0;
    for (k, v) in redis_info(addr, "commandstats").await? {
        let cmd = k.trim_start_matches("cmdstat_");
        if ["eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro"].contains(&cmd) {
            usec += field(&v, "usec=").unwrap_or(0.0);
        }
        if let Some((top, calls)) = top_level {
            if cmd == top {
                usec += field(&v, "usec_per_call=").unwrap_or(0.0) * calls as f64;
            }
        }
    }
    Ok(usec)
}

/// Pod `i`'s address (distinct for any number of pods).
fn pod_address(i: usize) -> String {
    format!("10.0.{}.{}:8000", i / 250, i % 250 + 1)
}

fn healthy(rng: &mut Rng, pods: usize) -> Vec<String> {
    let mut healthy: Vec<String> = (0..pods).map(pod_address).collect();
    let n = healthy.len();
    for i in (1..n).rev() {
        healthy.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    healthy
}

/// The plugin's pick: `request` is the owner's request counter.
fn pick_call(
    rng: &mut Rng,
    pods: usize,
    owner: usize,
    request: u64,
    chain: &[String],
    kind: Case,
) -> PickCall {
    let owner_id = format!("{:012x}", 0x5eed_0000 + owner);
    // The gateway's clock, as the plugin stamps prefix keys with it.
    let now_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    PickCall {
        keys: StateKeys::new(ROUTE, CLUSTER, &owner_id),
        max_inflight: 0,
        lease_ms: 10_000,
        owner_id,
        request_id: format!("{request:x}"),
        ended: Vec::new(),
        healthy: healthy(rng, pods),
        kind: match kind {
            Case::PrefixCache => PickKind::Prefix {
                chain: chain.to_vec(),
                ttl_s: 1800,
                now_s,
                hit_load_factor: 0.0,
                load: None,
                pin: None,
            },
            Case::PrefixCacheLoadAware => {
                // Pods with queues of 0-3 and KV use of 0-0.5, none overloaded by its metrics.
                let config = LoadAwareConfig::default();
                let pods: Vec<PodView> = (0..pods)
                    .map(|i| PodView {
                        address: pod_address(i),
                        metrics: Some(PodMetrics {
                            waiting: Some((i % 4) as f64),
                            kv_cache_usage: Some((i % 6) as f64 / 10.0),
                            ..PodMetrics::default()
                        }),
                        sampled_ms: None,
                    })
                    .collect();
                let args = load_args(&config, &pods);
                PickKind::Prefix {
                    chain: chain.to_vec(),
                    ttl_s: 1800,
                    now_s,
                    hit_load_factor: 0.0,
                    load: Some(Box::new(LoadAware {
                        config,
                        args,
                        decode_averages: Vec::new(),
                        prefill_backlog: Vec::new(),
                        // Short chat turns: nothing to give up (sent as an empty argument).
                        divert_costs: vec![0; chain.len()],
                    })),
                    pin: None,
                }
            }
            _ => PickKind::LeastRequest,
        },
    }
}

/// A request in flight: ours (its VM and request id: its release rides on that VM's next pick), or
/// one released by a plain `HINCRBY -1` (Go's way, and the least-request minimum).
enum Pending {
    Ours { owner: usize, request_id: String, pod: String },
    PlainRelease { hash_key: String, host: String },
}

/// Runs one case for `n` routed requests against a fresh Redis, sent by `traffic.clients`
/// connections at once (the VMs shared out among them).
async fn run_case(case: Case, n: u64, traffic: Traffic) -> Result<Cost> {
    let redis = Redis::start().await?;
    let addr = redis.addr.clone();
    let pick = Script::new(match case {
        Case::PrefixCache | Case::PrefixCacheLoadAware => &PREFIX_CACHE_LUA,
        Case::LeastRequestMinimum => LEAST_REQUEST_MINIMUM_LUA,
        Case::PrefixCacheMinimum => PREFIX_CACHE_MINIMUM_LUA,
        _ => &LEAST_REQUEST_LUA,
    });
    let release = Script::new(RELEASE_LUA);
    let baseline = Script::new(BASELINE_LUA);
    let mut conn = Conn::open(&addr)?;
    // Load the scripts before measuring (a gateway pays NOSCRIPT once per Redis start).
    for s in [&pick, &release, &baseline] {
        conn.call(&encode_command(&["SCRIPT", "LOAD", s.source]))?;
    }
    conn.call(&encode_command(&["CONFIG", "RESETSTAT"]))?;
    let before = snapshot(&addr).await?;
    let clients = traffic.clients.clamp(1, OWNERS);
    let scripts = Scripts { pick: &pick, release: &release, baseline: &baseline };
    let top_level_hincrby = std::thread::scope(|scope| {
        let runs: Vec<_> = (0..clients)
            .map(|k| {
                let client = Client {
                    owners: (0..OWNERS).filter(|o| o % clients == k).collect(),
                    requests: n / clients as u64 + u64::from((k as u64) < n % clients as u64),
                    in_flight: (IN_FLIGHT / clients).max(1),
                    seed: 0x9E37_79B9_7F4A_7C15 ^ (k as u64).wrapping_mul(0x2545_F491_4F6C_DD1D),
                };
                let addr = &addr;
                let scripts = &scripts;
                scope.spawn(move || drive(addr, case, traffic, scripts, client))
            })
            .collect();
        runs.into_iter().try_fold(0u64, |sum, run| match run.join() {
            Ok(r) => r.map(|c| sum + c),
            Err(_) => bail!("a client thread panicked"),
        })
    })?;
    let after = snapshot(&addr).await?;
    let top_level = Some(("hincrby", top_level_hincrby)).filter(|(_, c)| *c > 0);
    let usec = redis_usec(&addr, top_level).await?;
    // The INFO/CONFIG calls of the snapshot itself are a few hundred bytes over the whole run.
    let nf = n as f64;
    Ok(Cost {
        case: case.name().to_string(),
        requests: n,
        script_usec: usec / nf,
        cpu_usec: (after.0 - before.0) * 1e6 / nf,
        bytes_in: after.1.saturating_sub(before.1) as f64 / nf,
        bytes_out: after.2.saturating_sub(before.2) as f64 / nf,
    })
}

/// The scripts a case sends (loaded before the run).
struct Scripts<'a> {
    pick: &'a Script,
    release: &'a Script,
    baseline: &'a Script,
}

/// One connection's share of a case: its VMs, its routed requests, how many it keeps in flight.
struct Client {
    owners: Vec<usize>,
    requests: u64,
    in_flight: usize,
    seed: u64,
}

/// Sends one client's requests, one at a time on its own connection. Returns the top-level (not
/// scripted) commands it sent.
fn drive(
    addr: &str,
    case: Case,
    traffic: Traffic,
    scripts: &Scripts,
    client: Client,
) -> Result<u64> {
    let Traffic { pods, blocks, .. } = traffic;
    let mut conn = Conn::open(addr)?;
    let go_source = match case {
        Case::GoPrefixCache => GO_PREFIX_CACHE_LUA,
        _ => GO_LEAST_REQUEST_LUA,
    };
    let go_hash = format!("higress:global_least_request_table:{ROUTE}:{CLUSTER}");
    let mut rng = Rng(client.seed | 1);
    let mut outstanding: VecDeque<Pending> = VecDeque::new();
    let mut requests = [0u64; OWNERS];
    // Per VM: ids of its requests that ended, carried by its next pick.
    let mut ended: Vec<Vec<(String, String)>> = vec![Vec::new(); OWNERS];
    let mut top_level_hincrby = 0u64;
    // `blocks`-block chats: a conversation's next turn resends its blocks plus one (prefix hits).
    let mut chats: Vec<Vec<String>> = Vec::new();
    for i in 0..client.requests {
        if case == Case::Baseline {
            conn.script(scripts.baseline, &[], &[])?;
            conn.script(scripts.baseline, &[], &[])?;
            continue;
        }
        // 64 conversations; each request is its conversation's blocks so far plus a new one.
        let conv = (rng.next() % 64) as usize;
        if chats.len() <= conv {
            chats.resize(conv + 1, Vec::new());
        }
        let mut chat = chats.get(conv).cloned().unwrap_or_default();
        while chat.len() < blocks {
            chat.push(format!("{:040X}", u128::from(rng.next()) << 64 | u128::from(rng.next())));
        }
        let owner =
            client.owners.get(i as usize % client.owners.len().max(1)).copied().unwrap_or(0);
        let pending = match case {
            Case::GoLeastRequest | Case::GoPrefixCache => {
                let hosts = healthy(&mut rng, pods);
                let default = hosts.get((rng.next() % pods as u64) as usize).cloned();
                let first = if case == Case::GoPrefixCache {
                    "1800".to_string()
                } else {
                    (1_700_000_000_000_000 + i).to_string()
                };
                let mut q: Vec<String> = vec!["EVAL".into(), go_source.into()];
                q.push((3 + hosts.len()).to_string());
                q.extend([first, go_hash.clone(), default.unwrap_or_default()]);
                q.extend(hosts);
                if case == Case::GoPrefixCache {
                    q.extend(chat.iter().cloned());
                }
                let host = match conn.call(&encode_command(&q))? {
                    Frame::BulkString(h) => String::from_utf8_lossy(&h).into_owned(),
                    other => bail!("unexpected Go-like pick reply {other:?}"),
                };
                Pending::PlainRelease { hash_key: go_hash.clone(), host }
            }
            Case::LeastRequestMinimum => {
                let keys = [StateKeys::new(ROUTE, CLUSTER, "").inflight];
                let host = match conn.script(scripts.pick, &keys, &healthy(&mut rng, pods))? {
                    Frame::BulkString(h) => String::from_utf8_lossy(&h).into_owned(),
                    other => bail!("unexpected minimum pick reply {other:?}"),
                };
                let [hash_key] = keys;
                Pending::PlainRelease { hash_key, host }
            }
            Case::PrefixCacheMinimum => {
                let hash_key = StateKeys::new(ROUTE, CLUSTER, "").inflight;
                let mut keys = vec![hash_key.clone()];
                keys.extend(chat.iter().map(|block| prefix_key(ROUTE, CLUSTER, block)));
                let mut args = vec!["1800".to_string()];
                args.extend(healthy(&mut rng, pods));
                let host = match conn.script(scripts.pick, &keys, &args)? {
                    Frame::BulkString(h) => String::from_utf8_lossy(&h).into_owned(),
                    other => bail!("unexpected minimum pick reply {other:?}"),
                };
                Pending::PlainRelease { hash_key, host }
            }
            _ => {
                let req = requests.get_mut(owner).map(|r| {
                    *r += 1;
                    *r
                });
                let mut call = pick_call(&mut rng, pods, owner, req.unwrap_or(1), &chat, case);
                if let Some(e) = ended.get_mut(owner) {
                    call.ended = std::mem::take(e);
                }
                let (keys, args) = call.keys_args();
                let pod = match conn.script(scripts.pick, &keys, &args)? {
                    Frame::Array(v) => match v.first() {
                        Some(Frame::BulkString(h)) => String::from_utf8_lossy(h).into_owned(),
                        other => bail!("unexpected pick reply {other:?}"),
                    },
                    other => bail!("unexpected pick reply {other:?}"),
                };
                Pending::Ours { owner, request_id: call.request_id, pod }
            }
        };
        chat.truncate(blocks.saturating_sub(1));
        if let Some(slot) = chats.get_mut(conv) {
            *slot = chat;
        }
        outstanding.push_back(pending);
        if outstanding.len() > client.in_flight {
            if let Some(p) = outstanding.pop_front() {
                top_level_hincrby += end_request(&mut conn, &mut ended, p)?;
            }
        }
    }
    while let Some(p) = outstanding.pop_front() {
        top_level_hincrby += end_request(&mut conn, &mut ended, p)?;
    }
    // What no pick carried: one release call per VM (the plugin's tick or last request does this).
    for (owner, ids) in ended.into_iter().enumerate() {
        if ids.is_empty() {
            continue;
        }
        let owner_id = format!("{:012x}", 0x5eed_0000 + owner);
        let call = ReleaseCall {
            inflight_key: StateKeys::new(ROUTE, CLUSTER, &owner_id).inflight,
            owner_id,
            ended: ids,
            abandoned: None,
        };
        let (keys, args) = call.keys_args();
        conn.script(scripts.release, &keys, &args)?;
    }
    Ok(top_level_hincrby)
}

/// A request ends: ours waits for its VM's next pick; a plain release is sent. Returns the top-level
/// (not scripted) commands it took.
fn end_request(conn: &mut Conn, ended: &mut [Vec<(String, String)>], p: Pending) -> Result<u64> {
    match p {
        Pending::Ours { owner, request_id, pod } => {
            if let Some(e) = ended.get_mut(owner) {
                e.push((request_id, pod));
            }
            Ok(0)
        }
        Pending::PlainRelease { hash_key, host } => {
            conn.call(&encode_command(&["HINCRBY", &hash_key, &host, "-1"]))?;
            Ok(1)
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn range(v: &[f64]) -> (f64, f64) {
    (v.iter().copied().fold(f64::INFINITY, f64::min), v.iter().copied().fold(0.0, f64::max))
}

/// Runs every case `reps` times (interleaved) with `n` requests each of `traffic`; returns one
/// summary per case.
pub async fn measure(n: u64, reps: usize, traffic: Traffic) -> Result<Vec<Summary>> {
    let cases = [
        Case::Baseline,
        Case::LeastRequestMinimum,
        Case::LeastRequest,
        Case::PrefixCacheMinimum,
        Case::PrefixCache,
        Case::PrefixCacheLoadAware,
        Case::GoLeastRequest,
        Case::GoPrefixCache,
    ];
    let mut runs: Vec<Vec<Cost>> = vec![Vec::new(); cases.len()];
    for _ in 0..reps.max(1) {
        for (i, c) in cases.iter().enumerate() {
            let traffic =
                Traffic { pods: traffic.pods.max(1), blocks: traffic.blocks.max(1), ..traffic };
            let cost = run_case(*c, n, traffic).await?;
            if let Some(r) = runs.get_mut(i) {
                r.push(cost);
            }
        }
    }
    let mut out = Vec::new();
    let (mut floor, mut floor_cpu) = (0.0, 0.0);
    for (c, costs) in cases.iter().zip(runs) {
        let col = |f: fn(&Cost) -> f64| costs.iter().map(f).collect::<Vec<f64>>();
        let script = col(|c| c.script_usec);
        let cpu = col(|c| c.cpu_usec);
        let med = Cost {
            case: c.name().to_string(),
            requests: n,
            script_usec: median(script.clone()),
            cpu_usec: median(cpu.clone()),
            bytes_in: median(col(|c| c.bytes_in)),
            bytes_out: median(col(|c| c.bytes_out)),
        };
        if *c == Case::Baseline {
            floor = med.script_usec;
            floor_cpu = med.cpu_usec;
        }
        out.push(Summary {
            case: c.name().to_string(),
            script_vs_baseline: if floor > 0.0 { med.script_usec / floor } else { 0.0 },
            cpu_vs_baseline: if floor_cpu > 0.0 { med.cpu_usec / floor_cpu } else { 0.0 },
            median: med,
            script_usec_range: range(&script),
            cpu_usec_range: range(&cpu),
        });
    }
    Ok(out)
}

/// A Markdown table of the summaries.
pub fn table(rows: &[Summary], reps: usize) -> String {
    let mut s = format!(
        "| per routed request (pick + release), median of {reps} | Redis µs: scripts + top-level (min–max) | × floor | Redis main-thread CPU µs (min–max) | × floor | bytes in | bytes out |\n|---|---|---|---|---|---|---|\n"
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {:.1} ({:.1}–{:.1}) | {:.1} | {:.1} ({:.1}–{:.1}) | {:.1} | {:.0} | {:.0} |\n",
            r.case,
            r.median.script_usec,
            r.script_usec_range.0,
            r.script_usec_range.1,
            r.script_vs_baseline,
            r.median.cpu_usec,
            r.cpu_usec_range.0,
            r.cpu_usec_range.1,
            r.cpu_vs_baseline,
            r.median.bytes_in,
            r.median.bytes_out
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_results_file_reads_back_as_a_stamped_section() {
        let json = serde_json::to_string(&RedisCostReport::example()).expect("json");
        let md = serde_json::from_str::<RedisCostReport>(&json).expect("read").section();
        assert!(
            md.starts_with(
                "`redis-cost-pods64` (`bench redis-cost --requests 10000 --reps 3 --pods 64`): "
            ),
            "{md}"
        );
        assert!(md.contains("\n\n2026-11-24 07:49 UTC · commit `abc123` · vm · 3 repetitions"));

        // A tagged run names its file and the flag that made it.
        let tagged = RedisCostReport { tag: Some("amd".into()), ..RedisCostReport::example() };
        assert!(
            tagged.section().starts_with(
                "`redis-cost-pods64-amd` (`bench redis-cost --requests 10000 --reps 3 --pods 64 --tag amd`): "
            ),
            "{}",
            tagged.section()
        );
        assert!(
            md.contains(
                "| prefix_cache | 44.2 (41.3–44.9) | 17.7 | 80.5 (77.0–82.3) | 1.3 | 630 | 44 |"
            ),
            "{md}"
        );

        // Longer chains name their flag and their length.
        let long = RedisCostReport { blocks: 30, ..RedisCostReport::example() }.section();
        assert!(long.starts_with("`redis-cost-pods64-blocks30` (`bench redis-cost --requests 10000 --reps 3 --pods 64 --blocks 30`)"), "{long}");
        assert!(long.contains(" 30-block chats, "), "{long}");

        // A file written before the stamp, `--pods` and `--blocks`: its date, and the 8 pods and
        // 5 blocks it ran with.
        let mut old = serde_json::to_value(RedisCostReport::example()).expect("value");
        let o = old.as_object_mut().expect("object");
        o.remove("stamp");
        o.remove("pods");
        o.remove("clients");
        o.remove("blocks");
        o.insert("unix_time".into(), 1_795_506_556u64.into());
        let md = serde_json::from_value::<RedisCostReport>(old).expect("old file").section();
        assert!(
            md.starts_with("`redis-cost` (`bench redis-cost --requests 10000 --reps 3 --pods 8`)")
        );
        assert!(
            md.contains("\n\n2026-11-24 07:49 UTC · commit and machine not recorded (written before this report carried a stamp) · 3 repetitions"),
            "{md}"
        );
        assert!(md.contains("| EVALSHA return 1 (floor) | 2.5 (2.4–2.7) | 1.0 |"), "{md}");
        assert!(md.contains(" 5-block chats, "), "{md}");
        let t = Traffic::default();
        assert_eq!(file_stem(t, None), "redis-cost");
        assert_eq!(file_stem(Traffic { clients: 4, ..t }, None), "redis-cost-clients4");
        assert_eq!(
            file_stem(Traffic { pods: 64, clients: 4, ..t }, None),
            "redis-cost-pods64-clients4"
        );
        assert_eq!(file_stem(Traffic { blocks: 30, ..t }, None), "redis-cost-blocks30");
        assert_eq!(file_stem(t, Some("amd")), "redis-cost-amd");
    }

    #[test]
    fn every_pod_of_a_large_cluster_has_its_own_valid_address() {
        let addrs: std::collections::HashSet<String> = (0..1000).map(pod_address).collect();
        assert_eq!(addrs.len(), 1000);
        assert!(addrs.iter().all(|a| a.parse::<std::net::SocketAddr>().is_ok()), "{addrs:?}");
        let mut rng = Rng(7);
        let mut hosts = healthy(&mut rng, 300);
        hosts.sort();
        hosts.dedup();
        assert_eq!(hosts.len(), 300, "each pod once in a pick's host list");
    }
}
