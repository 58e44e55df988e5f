//! `bench run chaos`: seed-like chat load through 4 gateway replicas (global_least_request, the
//! plugin's default lease and breaker settings) while Redis is frozen (SIGSTOP) for 10 s and one of
//! the replicas is SIGKILLed in the middle of the freeze. Clients stop using a replica once it is
//! dead (as a load balancer in front of the gateways would); what was in flight on it fails with it.
//!
//! Reports: failed requests on the surviving replicas (and those lost with the killed one), p99
//! latency before and during the outage and the difference; apart, by each request's decision
//! (the plugin's `decisionHeader`), the requests that paid a Redis wait (`breakerSlowMs` or the
//! Redis timeout: the picks that open the breaker, and its probes) and the added p99 of the requests
//! decided at once because the breaker was open; time from SIGCONT until the surviving
//! replicas decide on Redis again (their `ai_lb_least_request_routed` counters move), and the sum of
//! the in-flight counts in Redis once the load has stopped and the killed replica's lease has run
//! out (count drift, must be 0).

use anyhow::{anyhow, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use testkit::http::{self, HttpRequest};

use crate::procs::{http_get, redis_cmd, Redis, Resp};
use crate::{load_scenario, start_gateway, start_pods, Paths};

const REPLICAS: usize = 4;
const CLIENTS: usize = 20;
const POLICY: &str = "global_least_request";
/// The response header naming how the plugin decided each request.
const DECISION_HEADER: &str = "x-ai-lb-decision";
const FREEZE_AT: Duration = Duration::from_secs(5);
const FREEZE_FOR: Duration = Duration::from_secs(10);
const KILL_AT: Duration = Duration::from_secs(10);
/// Requests started this long into the freeze find every worker's breaker already open (each opens
/// after 3 slow picks of `breakerSlowMs` 200 ms): picks that were waiting on Redis when it opened
/// are decided at that moment and also say `fallback_breaker_open`, but they did wait.
const OPEN_SETTLE: Duration = Duration::from_secs(1);
const LOAD_FOR: Duration = Duration::from_secs(25);
/// The default lease (10 s) plus two heartbeat periods and a margin: the killed replica's counts
/// must be gone by then.
const SETTLE: Duration = Duration::from_secs(20);

/// One request as a client saw it.
#[derive(Debug, Clone)]
struct Sent {
    at: Duration,
    took: Duration,
    replica: usize,
    ok: bool,
    /// The plugin's decision (`decisionHeader`), empty when absent.
    decision: String,
    /// The pod's own time for it (`x-pod-time-ms`: request received to response headers), real ms.
    pod_ms: Option<f64>,
}

impl Sent {
    /// It waited for Redis in vain: `breakerSlowMs` (a slow pick given up) or the Redis timeout.
    fn paid_redis_wait(&self) -> bool {
        self.decision.starts_with("fallback_redis_slow")
            || self.decision.starts_with("fallback_redis_timeout")
    }
    /// Decided at once without Redis because the breaker was open.
    fn breaker_open(&self) -> bool {
        self.decision.starts_with("fallback_breaker_open")
    }
    /// Decided with the breaker open and started once every breaker had opened (at least
    /// [`OPEN_SETTLE`] into the freeze, before its end): what "after the breaker opens" means.
    fn after_open(&self) -> bool {
        self.breaker_open()
            && self.at >= FREEZE_AT + OPEN_SETTLE
            && self.at < FREEZE_AT + FREEZE_FOR
    }
    /// [`Sent::after_open`] and started before the kill: still 4 replicas sharing the load, as
    /// before the freeze (after the kill 3 replicas carry it, a different load per gateway).
    fn after_open_before_kill(&self) -> bool {
        self.after_open() && self.at < KILL_AT
    }
    /// The gateway's own added time (real ms), as loadgen measures it for the other scenarios: the
    /// client's time minus the pod's. The replies are not streamed and are short (`max_tokens` 32),
    /// so the pod's headers and body leave together and the client's whole-response time stands
    /// for its time to headers. Each request opens its own connection to the gateway, so the
    /// figure also holds the client's connect (the same for every request class compared).
    fn gateway_added_ms(&self) -> Option<f64> {
        self.pod_ms.map(|p| (self.took.as_secs_f64() * 1e3 - p).max(0.0))
    }
}

/// p50 and p99 of the gateway's own added time over a class of requests, with how many there were.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct GatewayAdded {
    /// Requests in the class that answered 200 with the pod's time header.
    pub requests: usize,
    /// Median added time (ms).
    pub p50_ms: f64,
    /// 99th percentile of the added time (ms).
    pub p99_ms: f64,
}

impl GatewayAdded {
    fn of(v: Vec<f64>) -> Self {
        Self { requests: v.len(), p50_ms: quantile(v.clone(), 0.5), p99_ms: quantile(v, 0.99) }
    }
}

/// The gateway's added time for the requests `class` picks (successful ones with a pod time).
fn gateway_added(sent: &[Sent], class: impl Fn(&Sent) -> bool) -> GatewayAdded {
    GatewayAdded::of(class_samples(sent, class))
}

/// What the run measured.
#[derive(Debug, Serialize, Deserialize)]
pub struct ChaosReport {
    /// Requests sent.
    pub requests: usize,
    /// Requests to surviving replicas that failed (no answer or not 200).
    pub failed_on_survivors: usize,
    /// Requests lost with the killed replica (in flight when it died).
    pub lost_with_killed: usize,
    /// p99 latency (ms) of requests started before the freeze.
    pub p99_before_ms: f64,
    /// p99 latency (ms) of requests started during the freeze.
    pub p99_outage_ms: f64,
    /// Requests during the freeze that took over 100 ms more than the p99 before it.
    pub slow_in_outage: usize,
    /// Requests that waited for Redis in vain (`breakerSlowMs` or the Redis timeout), whole run.
    pub paid_redis_wait: usize,
    /// Requests decided at once because the breaker was open.
    pub breaker_open_requests: usize,
    /// p99 latency (ms) of the requests decided at once because the breaker was open.
    pub p99_breaker_open_ms: f64,
    /// Time from SIGCONT until every surviving replica routed by Redis again (ms).
    pub recover_ms: Option<f64>,
    /// Sum of the in-flight counts in Redis after the load and the settle time.
    pub count_drift: i64,
    /// The gateway's own added time of the requests started before the freeze (Redis answering).
    pub gw_added_before: GatewayAdded,
    /// The gateway's own added time of the requests decided with the breaker open (including the
    /// picks that were waiting on Redis when it opened).
    pub gw_added_breaker_open: GatewayAdded,
    /// The same for those started at least 1 s into the freeze (every breaker open by then).
    pub gw_added_after_open: GatewayAdded,
    /// Of those, the ones started before the kill (4 replicas, as before the freeze).
    pub gw_added_after_open_before_kill: GatewayAdded,
    /// The gateway's added-time samples behind the two figures above (ms), kept so that several
    /// repetitions can be pooled into one p99 over enough requests.
    #[serde(skip)]
    samples: [Vec<f64>; 4],
}

/// Nearest-rank quantile (`q` in 0..=1) of `v`; 0 for an empty set.
fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64) * q).ceil() as usize;
    v.get(i.saturating_sub(1).min(v.len().saturating_sub(1))).copied().unwrap_or(0.0)
}

fn p99(v: Vec<f64>) -> f64 {
    quantile(v, 0.99)
}

fn signal(pid: u32, sig: &str) -> Result<()> {
    let st = std::process::Command::new("kill").args([sig, &pid.to_string()]).status()?;
    if !st.success() {
        return Err(anyhow!("kill {sig} {pid} failed"));
    }
    Ok(())
}

async fn inflight_sum(redis: &str) -> Result<i64> {
    let Resp::Array(Some(keys)) = redis_cmd(redis, &["KEYS", "*:inflight"]).await? else {
        return Ok(0);
    };
    let mut sum = 0;
    for k in keys {
        if let Resp::Array(Some(kv)) = redis_cmd(redis, &["HVALS", &k.text()]).await? {
            sum += kv.iter().filter_map(|v| v.text().parse::<i64>().ok()).sum::<i64>();
        }
    }
    Ok(sum)
}

async fn routed(admin: &str) -> i64 {
    let text = http_get(admin, "/stats").await.unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("ai_lb_least_request_routed "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Runs the chaos scenario `reps` times; prints a table (a row per run and, over all runs
/// together, the gateway's added time), writes `bench/results/chaos[-<tag>].json` and returns the
/// reports.
pub async fn run(paths: &Paths, reps: usize, tag: Option<&str>) -> Result<Vec<ChaosReport>> {
    let mut reports = Vec::new();
    for rep in 0..reps.max(1) {
        println!("chaos: run {} of {}", rep + 1, reps.max(1));
        reports.push(run_once(paths).await?);
    }
    let out = paths.results.join(match tag {
        Some(t) => format!("chaos-{t}.json"),
        None => "chaos.json".to_string(),
    });
    std::fs::create_dir_all(&paths.results)?;
    let results = ChaosResults {
        stamp: crate::Stamp::now(&paths.root),
        pooled: Pooled::of(&reports),
        runs: reports,
    };
    std::fs::write(&out, serde_json::to_string_pretty(&results)?)?;
    println!("{}", table(&results.runs));
    println!("{}", gateway_added_table(&results.pooled));
    println!("wrote {}", out.display());
    Ok(results.runs)
}

/// `bench/results/chaos[-<tag>].json`.
#[derive(Debug, Serialize, Deserialize)]
pub struct ChaosResults {
    /// Date, commit and machine (blank in a file written before the report carried them).
    #[serde(default)]
    pub stamp: crate::Stamp,
    /// One report per run, in order.
    pub runs: Vec<ChaosReport>,
    /// The gateway's added time over all runs together.
    pub pooled: Pooled,
}

impl ChaosResults {
    /// Markdown for the README: what was run, the stamp line, the table of runs and the pooled
    /// gateway added time.
    pub fn section(&self) -> String {
        let n = self.runs.len();
        format!(
            "`chaos` (`bench run chaos --reps {n}`): seed-like 5-turn chats from {CLIENTS} clients through {REPLICAS} gateway replicas ({POLICY}) sharing one Redis; Redis frozen (SIGSTOP) {}–{} s into the load and one replica SIGKILLed at {} s\n\n{} · {n} run{} · real ms\n\n{}\n{}",
            FREEZE_AT.as_secs(),
            (FREEZE_AT + FREEZE_FOR).as_secs(),
            KILL_AT.as_secs(),
            crate::tables::stamp_text(&self.stamp, None),
            if n == 1 { "" } else { "s" },
            table(&self.runs),
            gateway_added_table(&self.pooled)
        )
    }
}

/// The gateway's added time over every run's requests together (a p99 over more requests).
#[derive(Debug, Serialize, Deserialize)]
pub struct Pooled {
    /// Runs pooled.
    pub runs: usize,
    /// Requests started before the freeze.
    pub before: GatewayAdded,
    /// Requests decided with the breaker open.
    pub breaker_open: GatewayAdded,
    /// Those of them started at least 1 s into the freeze.
    pub after_open: GatewayAdded,
    /// Of those, the ones started before the kill (4 replicas sharing the load, as before).
    pub after_open_before_kill: GatewayAdded,
}

impl Pooled {
    /// Pools the added-time samples of `reports`.
    pub fn of(reports: &[ChaosReport]) -> Self {
        let cat = |f: &dyn Fn(&ChaosReport) -> &Vec<f64>| {
            reports.iter().flat_map(|r| f(r).iter().copied()).collect::<Vec<f64>>()
        };
        Self {
            runs: reports.len(),
            before: GatewayAdded::of(cat(&|r| &r.samples[0])),
            breaker_open: GatewayAdded::of(cat(&|r| &r.samples[1])),
            after_open: GatewayAdded::of(cat(&|r| &r.samples[2])),
            after_open_before_kill: GatewayAdded::of(cat(&|r| &r.samples[3])),
        }
    }
}

#[cfg(test)]
impl ChaosResults {
    /// A small results file: one run, stamped.
    pub(crate) fn example() -> ChaosResults {
        let added = |requests, p50_ms, p99_ms| GatewayAdded { requests, p50_ms, p99_ms };
        let run = ChaosReport {
            requests: 1437,
            failed_on_survivors: 0,
            lost_with_killed: 8,
            p99_before_ms: 375.9,
            p99_outage_ms: 626.6,
            slow_in_outage: 18,
            paid_redis_wait: 12,
            breaker_open_requests: 541,
            p99_breaker_open_ms: 484.4,
            recover_ms: Some(109.1),
            count_drift: 0,
            gw_added_before: added(300, 1.53, 9.63),
            gw_added_breaker_open: added(541, 1.10, 207.04),
            gw_added_after_open: added(510, 1.10, 1.80),
            gw_added_after_open_before_kill: added(223, 1.07, 1.76),
            samples: Default::default(),
        };
        let pooled = Pooled {
            runs: 1,
            before: run.gw_added_before,
            breaker_open: run.gw_added_breaker_open,
            after_open: run.gw_added_after_open,
            after_open_before_kill: run.gw_added_after_open_before_kill,
        };
        ChaosResults { stamp: crate::Stamp::example(), runs: vec![run], pooled }
    }
}

/// A Markdown table of the pooled gateway added time.
pub fn gateway_added_table(p: &Pooled) -> String {
    format!(
        "| gateway added time, {} runs pooled | requests | p50 (ms) | p99 (ms) |\n|---|---|---|---|\n| started before the freeze | {} | {:.2} | {:.2} |\n| decided with the breaker open | {} | {:.2} | {:.2} |\n| of those, started >= 1 s into the freeze | {} | {:.2} | {:.2} |\n| of those, started before the kill (4 replicas) | {} | {:.2} | {:.2} |\n| started >= 1 s into the freeze minus before | | {:+.2} | {:+.2} |\n",
        p.runs,
        p.before.requests,
        p.before.p50_ms,
        p.before.p99_ms,
        p.breaker_open.requests,
        p.breaker_open.p50_ms,
        p.breaker_open.p99_ms,
        p.after_open.requests,
        p.after_open.p50_ms,
        p.after_open.p99_ms,
        p.after_open_before_kill.requests,
        p.after_open_before_kill.p50_ms,
        p.after_open_before_kill.p99_ms,
        p.after_open.p50_ms - p.before.p50_ms,
        p.after_open.p99_ms - p.before.p99_ms,
    )
}

/// Runs the chaos scenario once and returns its report.
async fn run_once(paths: &Paths) -> Result<ChaosReport> {
    let mut sc = load_scenario(paths, "seed")?;
    sc.lb_config.insert("decisionHeader".into(), DECISION_HEADER.into());
    let mut redis = Redis::start().await?;
    let (pods_proc, pods) = start_pods(paths, &sc).await?;
    let mut gws = Vec::new();
    let mut addrs = Vec::new();
    let mut admins = Vec::new();
    for i in 0..REPLICAS {
        let (p, addr) =
            start_gateway(paths, &sc, POLICY, &pods, &redis.addr, &format!("chaos-{i}")).await?;
        let admin = p
            .lines_with("ADMIN ")
            .first()
            .and_then(|v| v.first().cloned())
            .ok_or_else(|| anyhow!("gateway printed no ADMIN line"))?;
        addrs.push(addr.parse::<std::net::SocketAddr>().context("gateway address")?);
        admins.push(admin);
        gws.push(Some(p));
    }
    let killed = REPLICAS - 1;
    let dead = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(Mutex::new(Vec::<Sent>::new()));
    let t0 = Instant::now();
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let (dead, stop, sent, addrs) = (dead.clone(), stop.clone(), sent.clone(), addrs.clone());
        let model = sc.model.clone();
        clients.push(tokio::spawn(async move {
            // A 5-turn chat per session, then a new one: seed-like, short replies.
            let mut messages = Vec::new();
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                if messages.len() >= 10 {
                    messages.clear();
                }
                messages.push(json!({"role": "user", "content": format!("client {c} turn {n}: tell me about topic {}", n % 7)}));
                let live: Vec<usize> = (0..REPLICAS)
                    .filter(|r| *r != killed || !dead.load(Ordering::Relaxed))
                    .collect();
                let replica = live.get((c + n) % live.len().max(1)).copied().unwrap_or(0);
                let body = json!({"model": model, "messages": messages, "max_tokens": 32});
                let req = HttpRequest::post_json("/v1/chat/completions", &body);
                let at = t0.elapsed();
                let started = Instant::now();
                let Some(addr) = addrs.get(replica).copied() else { break };
                let r = http::send(addr, req, Duration::from_secs(30)).await;
                let ok = r.as_ref().map(|r| r.status == 200).unwrap_or(false);
                let decision = r
                    .as_ref()
                    .ok()
                    .and_then(|r| r.headers.iter().find(|(k, _)| k == DECISION_HEADER))
                    .map(|(_, v)| v.clone())
                    .unwrap_or_default();
                let pod_ms = r
                    .as_ref()
                    .ok()
                    .and_then(|r| r.headers.iter().find(|(k, _)| k == "x-pod-time-ms"))
                    .and_then(|(_, v)| v.parse::<f64>().ok());
                messages.push(json!({"role": "assistant", "content": "ok"}));
                if let Ok(mut s) = sent.lock() {
                    s.push(Sent { at, took: started.elapsed(), replica, ok, decision, pod_ms });
                }
                n += 1;
            }
        }));
    }
    tokio::time::sleep(FREEZE_AT).await;
    let redis_pid = redis.proc.id().ok_or_else(|| anyhow!("redis-server has no pid"))?;
    signal(redis_pid, "-STOP")?;
    tokio::time::sleep(KILL_AT.saturating_sub(FREEZE_AT)).await;
    dead.store(true, Ordering::Relaxed);
    if let Some(g) = gws.get_mut(killed).and_then(Option::take) {
        g.stop().await;
    }
    let killed_at = t0.elapsed();
    tokio::time::sleep((FREEZE_AT + FREEZE_FOR).saturating_sub(t0.elapsed())).await;
    let before: Vec<i64> = {
        let mut v = Vec::new();
        for (i, a) in admins.iter().enumerate() {
            if i != killed {
                v.push(routed(a).await);
            }
        }
        v
    };
    signal(redis_pid, "-CONT")?;
    let thawed = Instant::now();
    let mut recover_ms = None;
    while thawed.elapsed() < Duration::from_secs(10) {
        let mut all = true;
        let mut j = 0;
        for (i, a) in admins.iter().enumerate() {
            if i == killed {
                continue;
            }
            all &= routed(a).await > before.get(j).copied().unwrap_or(0);
            j += 1;
        }
        if all {
            recover_ms = Some(thawed.elapsed().as_secs_f64() * 1e3);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(LOAD_FOR.saturating_sub(t0.elapsed())).await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.await;
    }
    let settle_until = killed_at + SETTLE;
    tokio::time::sleep(settle_until.saturating_sub(t0.elapsed())).await;
    let count_drift = inflight_sum(&redis.addr).await?;
    for g in gws.into_iter().flatten() {
        g.stop().await;
    }
    pods_proc.stop().await;
    let _ = redis.proc.kill().await;

    let sent = sent.lock().map(|s| s.clone()).unwrap_or_default();
    let ms = |s: &Sent| s.took.as_secs_f64() * 1e3;
    let outage = FREEZE_AT..FREEZE_AT + FREEZE_FOR;
    let p99_before = p99(sent.iter().filter(|s| s.at < FREEZE_AT && s.ok).map(ms).collect());
    let in_outage: Vec<&Sent> = sent.iter().filter(|s| outage.contains(&s.at) && s.ok).collect();
    let report = ChaosReport {
        requests: sent.len(),
        failed_on_survivors: sent.iter().filter(|s| !s.ok && s.replica != killed).count(),
        lost_with_killed: sent.iter().filter(|s| !s.ok && s.replica == killed).count(),
        p99_before_ms: p99_before,
        p99_outage_ms: p99(in_outage.iter().map(|s| ms(s)).collect()),
        slow_in_outage: in_outage.iter().filter(|s| ms(s) > p99_before + 100.0).count(),
        paid_redis_wait: sent.iter().filter(|s| s.paid_redis_wait()).count(),
        breaker_open_requests: sent.iter().filter(|s| s.ok && s.breaker_open()).count(),
        p99_breaker_open_ms: p99(sent
            .iter()
            .filter(|s| s.ok && s.breaker_open())
            .map(ms)
            .collect()),
        recover_ms,
        count_drift,
        gw_added_before: gateway_added(&sent, |s| s.at < FREEZE_AT),
        gw_added_breaker_open: gateway_added(&sent, Sent::breaker_open),
        gw_added_after_open: gateway_added(&sent, Sent::after_open),
        gw_added_after_open_before_kill: gateway_added(&sent, Sent::after_open_before_kill),
        samples: [
            class_samples(&sent, |s| s.at < FREEZE_AT),
            class_samples(&sent, Sent::breaker_open),
            class_samples(&sent, Sent::after_open),
            class_samples(&sent, Sent::after_open_before_kill),
        ],
    };
    println!("{}", table(std::slice::from_ref(&report)));
    Ok(report)
}

fn class_samples(sent: &[Sent], class: impl Fn(&Sent) -> bool) -> Vec<f64> {
    sent.iter().filter(|s| s.ok && class(s)).filter_map(Sent::gateway_added_ms).collect()
}

/// A Markdown table of the reports, a row per run. Latencies in the first columns are end to end
/// (the pods' queues dominate them); the last four are the gateway's own added time.
pub fn table(reports: &[ChaosReport]) -> String {
    let mut t = String::from(
        "| run | requests | failed (surviving replicas) | lost with the killed replica | E2E p99 before (ms) | E2E p99 during the freeze (ms) | paid a Redis wait (breakerSlowMs or timeout) | decided with the breaker open | their E2E p99 (ms) | slow (> p99 + 100 ms) during the freeze | back on Redis after SIGCONT (ms) | count drift | gw added p50 / p99 before (ms) | gw added p50 / p99 breaker open (ms) | gw added p50 / p99 breaker open, >= 1 s into the freeze (ms) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for (i, r) in reports.iter().enumerate() {
        t.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} | {:.1} | {} | {} | {:.1} | {} | {} | {} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} / {:.2} |\n",
            i + 1,
            r.requests,
            r.failed_on_survivors,
            r.lost_with_killed,
            r.p99_before_ms,
            r.p99_outage_ms,
            r.paid_redis_wait,
            r.breaker_open_requests,
            r.p99_breaker_open_ms,
            r.slow_in_outage,
            r.recover_ms.map(|m| format!("{m:.0}")).unwrap_or_else(|| "not within 10 s".into()),
            r.count_drift,
            r.gw_added_before.p50_ms,
            r.gw_added_before.p99_ms,
            r.gw_added_breaker_open.p50_ms,
            r.gw_added_breaker_open.p99_ms,
            r.gw_added_after_open.p50_ms,
            r.gw_added_after_open.p99_ms,
        ));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(at_ms: u64, took_ms: u64, pod_ms: Option<f64>, decision: &str, ok: bool) -> Sent {
        Sent {
            at: Duration::from_millis(at_ms),
            took: Duration::from_millis(took_ms),
            replica: 0,
            ok,
            decision: decision.into(),
            pod_ms,
        }
    }

    #[test]
    fn gateway_added_is_client_time_minus_pod_time_per_class() {
        let v = vec![
            // Before the freeze: 2 ms and 4 ms added, whatever the pods took.
            sent(100, 302, Some(300.0), "least_request", true),
            sent(200, 54, Some(50.0), "least_request", true),
            // Breaker open: 1 ms added on a slow pod reply; a failed one and one without the
            // pod's header do not count.
            sent(6000, 901, Some(900.0), "fallback_breaker_open", true),
            sent(6100, 500, Some(10.0), "fallback_breaker_open", false),
            sent(6200, 500, None, "fallback_breaker_open", true),
            // A Redis wait is neither class.
            sent(6300, 250, Some(40.0), "fallback_redis_slow", true),
        ];
        let before = gateway_added(&v, |s| s.at < FREEZE_AT);
        assert_eq!(before.requests, 2);
        assert!((before.p50_ms - 2.0).abs() < 1e-9, "{before:?}");
        assert!((before.p99_ms - 4.0).abs() < 1e-9, "{before:?}");
        let open = gateway_added(&v, Sent::breaker_open);
        assert_eq!(open.requests, 1);
        assert!((open.p99_ms - 1.0).abs() < 1e-9, "{open:?}");
    }

    #[test]
    fn after_open_leaves_out_the_picks_waiting_when_the_breaker_opened() {
        let v = vec![
            // 100 ms into the freeze: it waited ~200 ms for Redis, then the breaker opened.
            sent(5100, 260, Some(60.0), "fallback_breaker_open", true),
            // 2 s into the freeze: decided at once.
            sent(7000, 62, Some(60.0), "fallback_breaker_open", true),
            // After the thaw, a breaker still open until its probe: not the freeze's.
            sent(15_100, 61, Some(60.0), "fallback_breaker_open", true),
        ];
        let all = gateway_added(&v, Sent::breaker_open);
        assert_eq!(all.requests, 3);
        assert!((all.p99_ms - 200.0).abs() < 1e-9, "{all:?}");
        let after = gateway_added(&v, Sent::after_open);
        assert_eq!(after.requests, 1);
        assert!((after.p99_ms - 2.0).abs() < 1e-9, "{after:?}");
        // 7 s is 2 s before the kill at 10 s; one started after the kill is left out.
        let mut v = v;
        v.push(sent(11_000, 90, Some(60.0), "fallback_breaker_open", true));
        assert_eq!(gateway_added(&v, Sent::after_open).requests, 2);
        let before_kill = gateway_added(&v, Sent::after_open_before_kill);
        assert_eq!(before_kill.requests, 1);
        assert!((before_kill.p99_ms - 2.0).abs() < 1e-9, "{before_kill:?}");
    }

    #[test]
    fn the_results_file_reads_back_as_a_stamped_section_with_both_tables() {
        let json = serde_json::to_string(&ChaosResults::example()).expect("json");
        let md = serde_json::from_str::<ChaosResults>(&json).expect("read").section();
        assert!(md.starts_with("`chaos` (`bench run chaos --reps 1`): "), "{md}");
        assert!(md.contains("Redis frozen (SIGSTOP) 5–15 s into the load"), "{md}");
        assert!(
            md.contains("\n\n2026-11-24 07:49 UTC · commit `abc123` · vm · 1 run · real ms\n\n")
        );
        assert!(
            md.contains("| 1 | 1437 | 0 | 8 | 375.9 | 626.6 | 12 | 541 | 484.4 | 18 | 109 | 0 |")
        );
        assert!(md.contains("| gateway added time, 1 runs pooled |"), "{md}");
        assert!(md.contains("| started before the freeze | 300 | 1.53 | 9.63 |"), "{md}");

        // A file written before the report carried a stamp.
        let mut old = serde_json::to_value(ChaosResults::example()).expect("value");
        old.as_object_mut().expect("object").remove("stamp");
        let md = serde_json::from_value::<ChaosResults>(old).expect("old file").section();
        assert!(md.contains("\n\nundated · commit and machine not recorded (written before this report carried a stamp) · 1 run"), "{md}");
        assert!(md.contains("| 1 | 1437 | 0 | 8 |"), "{md}");
    }

    #[test]
    fn quantile_is_nearest_rank() {
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(quantile(v.clone(), 0.99), 990.0);
        assert_eq!(quantile(v, 0.5), 500.0);
        assert_eq!(quantile(vec![], 0.99), 0.0);
        assert_eq!(quantile(vec![7.0], 0.99), 7.0);
    }
}
