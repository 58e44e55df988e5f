//! Real faults against the shared state: a gateway SIGKILLed with requests in flight, Redis frozen
//! (SIGSTOP / docker pause) under load. Each test asserts that no client request fails, that the
//! in-flight counts in Redis return to the truth within the stated bound, and that nothing hangs.

use std::time::{Duration, Instant};

use e2e::*;
use serde_json::json;
use testkit::http::HttpRequest;

fn chat(text: &str) -> HttpRequest {
    HttpRequest::post_json(
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": text}]}),
    )
}

/// Higress #3407: a gateway that dies with requests in flight must not leave its +1s behind. Its
/// lease (here 2 s) runs out and the surviving gateway's heartbeat subtracts them, with no new
/// request needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gateways_counts_return_within_two_leases() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("killed", 2).await.unwrap();
    let cfg = redis_policy_config(
        "route-killed",
        &pods,
        &redis,
        "global_least_request",
        json!({"leaseMs": 2000}),
    );
    let mut doomed = Gateway::start(&cfg).await.unwrap();
    let survivor = Gateway::start(&cfg).await.unwrap();
    assert_eq!(chat_once(&survivor, "the survivor routes here too").await.unwrap().status, 200);
    for p in &pods {
        p.set_hold(true);
    }
    let held: Vec<_> = (0..6)
        .map(|i| {
            spawn_request(doomed.addr(), chat(&format!("in flight {i}")), Duration::from_secs(30))
        })
        .collect();
    eventually(Duration::from_secs(10), "6 requests held by the pods and counted", || async {
        Ok(pods.iter().map(Pod::in_flight).sum::<usize>() == 6 && counters_sum(&redis).await? == 6)
    })
    .await
    .unwrap();
    doomed.kill();
    for h in held {
        assert!(
            h.await.unwrap().is_err(),
            "the client of a killed gateway sees its connection die"
        );
    }
    for p in &pods {
        p.set_hold(false);
        p.release();
    }
    let killed_at = Instant::now();
    wait_counters_zero(&redis, Duration::from_secs(4)).await.unwrap();
    eprintln!("counts back to 0 {:?} after the kill", killed_at.elapsed());
    // The survivor goes on serving, and its own requests leave nothing behind.
    for i in 0..4 {
        assert_eq!(chat_once(&survivor, &format!("after the kill {i}")).await.unwrap().status, 200);
    }
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
}

/// Redis frozen under load: the breaker bounds what requests pay (the first few give up after
/// `breakerSlowMs`, the rest do not wait at all), no request fails, Redis is used again within
/// 5 s of SIGCONT, and the counts are exact afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_costs_a_few_requests_breaker_slow_ms_and_the_rest_nothing() {
    let mut redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("breaker", 2).await.unwrap();
    // The Redis timeout stays at Go's default (3 s): without the breaker, every request would wait
    // 3 s.
    let cfg = redis_policy_config(
        "route-breaker",
        &pods,
        &redis,
        "global_least_request",
        json!({"breakerFailures": 3, "breakerSlowMs": 200, "breakerOpenMs": 1000}),
    );
    let gw = Gateway::start(&cfg).await.unwrap();
    assert_eq!(chat_once(&gw, "warm up").await.unwrap().status, 200);
    redis.freeze().await.unwrap();
    let mut took = Vec::new();
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(4) {
        let started = Instant::now();
        let r = gw.send(chat("during the freeze"), Duration::from_secs(10)).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        took.push(started.elapsed());
    }
    let slow: Vec<_> = took.iter().filter(|t| **t > Duration::from_millis(100)).collect();
    assert!(took.len() >= 10, "only {} requests in 4 s", took.len());
    assert!(
        slow.iter().all(|t| **t < Duration::from_millis(1000)),
        "no request may wait for the Redis timeout: {slow:?}"
    );
    // Each worker VM (2) has its breaker. The first pick that waits breakerSlowMs with Redis
    // answering nothing opens it at once (not after breakerFailures such picks), and tells the
    // other worker, which follows at its next request or tick (50 ms); the tick, not a request,
    // probes it. So at most one request per worker pays breakerSlowMs; a pick the other worker
    // sent before it followed waits for its tick, which may take over 100 ms on a loaded
    // machine, but never breakerSlowMs.
    let paid: Vec<_> = took.iter().filter(|t| **t >= Duration::from_millis(200)).collect();
    assert!(paid.len() <= 2, "{} of {} paid breakerSlowMs: {paid:?}", paid.len(), took.len());
    assert!(slow.len() <= 4, "{} slow of {}: {slow:?}", slow.len(), took.len());
    eprintln!("{} requests during the freeze, {} slow: {slow:?}", took.len(), slow.len());
    redis.unfreeze().await.unwrap();
    let thawed = Instant::now();
    // Back on Redis: a held request is counted there again.
    for p in &pods {
        p.set_hold(true);
    }
    let h = spawn_request(gw.addr(), chat("after the thaw"), Duration::from_secs(20));
    let mut back = false;
    while thawed.elapsed() < Duration::from_secs(5) {
        if counters_sum(&redis).await.unwrap() >= 1 {
            back = true;
            break;
        }
        // The request above may have been decided while the breaker was still open: the tick's
        // probe closes it within breakerOpenMs, then new requests use Redis.
        drop(spawn_request(gw.addr(), chat("probe"), Duration::from_secs(20)));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(back, "Redis not used again within 5 s of SIGCONT");
    eprintln!("back on Redis {:?} after SIGCONT", thawed.elapsed());
    for p in &pods {
        p.set_hold(false);
        p.release();
    }
    assert_eq!(h.await.unwrap().unwrap().status, 200);
    wait_counters_zero(&redis, Duration::from_secs(10)).await.unwrap();
}

/// A pause shorter than `breakerOpenMs` (a cluster failover's, a fork's): the breaker it opens
/// sends its probe at once, queued behind the stalled calls, and closes when Redis answers it; the
/// other worker, which followed, closes with it. Redis is used again right after SIGCONT, not
/// `breakerOpenMs` (here 5 s) after the pause began.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_redis_pause_keeps_the_breaker_open_only_as_long_as_it_lasts() {
    let mut redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("pause", 2).await.unwrap();
    let cfg = redis_policy_config(
        "route-pause",
        &pods,
        &redis,
        "global_least_request",
        json!({"breakerSlowMs": 200, "breakerOpenMs": 5000}),
    );
    let gw = Gateway::start(&cfg).await.unwrap();
    assert_eq!(chat_once(&gw, "warm up").await.unwrap().status, 200);
    redis.freeze().await.unwrap();
    let paused = Instant::now();
    while paused.elapsed() < Duration::from_millis(600) {
        let r = gw.send(chat("during the pause"), Duration::from_secs(10)).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let stats = gw.stats().await.unwrap();
    assert!(stat(&stats, "ai_lb_breaker_opened") >= 1, "the pause opened the breaker: {stats}");
    let routed = stat(&stats, "ai_lb_least_request_routed");
    redis.unfreeze().await.unwrap();
    let thawed = Instant::now();
    // Requests one after another: the first routed by Redis shows a breaker closed. (Not the
    // counts in Redis: the pick that found the pause runs when Redis goes on, +1 until its cancel.)
    let mut back = None;
    while thawed.elapsed() < Duration::from_secs(4) {
        assert_eq!(chat_once(&gw, "after the pause").await.unwrap().status, 200);
        if stat(&gw.stats().await.unwrap(), "ai_lb_least_request_routed") > routed {
            back = Some(thawed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let back = back.expect("no request routed by Redis within 4 s of SIGCONT");
    eprintln!("back on Redis {back:?} after SIGCONT");
    // breakerOpenMs after the pause began would be 4.4 s after SIGCONT.
    assert!(back < Duration::from_millis(2500), "back on Redis only {back:?} after SIGCONT");
    wait_counters_zero(&redis, Duration::from_secs(10)).await.unwrap();
}

/// With Redis frozen, a Redis policy does not fall back to round robin: once its breaker is open
/// it routes by the pods' metrics (here stored by the gateway's health check), so the one pod with
/// room gets the requests. The decision header and the gateway's stats say how each was routed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_routes_by_the_pods_metrics_not_round_robin() {
    let mut redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("metrics-fallback", 3).await.unwrap();
    pods[0].set_metrics(samples::vllm_v1(30, 20, 0.95));
    pods[1].set_metrics(samples::vllm_v1(2, 0, 0.1));
    pods[2].set_metrics(samples::vllm_v1(25, 15, 0.9));
    let cfg = redis_policy_config(
        "route-metrics-fallback",
        &pods,
        &redis,
        "prefix_cache",
        json!({"decisionHeader": "x-ai-lb-decision", "breakerSlowMs": 200}),
    )
    .metrics_health_check(LLM_CLUSTER, 200);
    let gw = Gateway::start(&cfg).await.unwrap();
    wait_scrapes(&pods, &[0, 0, 0], 2, Duration::from_secs(15)).await.unwrap();
    let r = gw.send(chat("with redis"), Duration::from_secs(10)).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-ai-lb-decision"), Some("prefix_miss; blocks=0"));

    redis.freeze().await.unwrap();
    let mut sent = Vec::new();
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(3) {
        let r = gw.send(chat("during the freeze"), Duration::from_secs(10)).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let decision = r.header("x-ai-lb-decision").unwrap_or_default().to_string();
        sent.push((r.upstream().unwrap_or_default(), decision));
    }
    redis.unfreeze().await.unwrap();
    let by_metrics: Vec<_> = sent.iter().filter(|(_, d)| d.ends_with("; by=metrics")).collect();
    eprintln!("{} requests during the freeze, {} routed by metrics", sent.len(), by_metrics.len());
    assert!(by_metrics.len() >= 10, "too few routed by metrics: {sent:?}");
    // Every request of the freeze: the picks given up as too slow (on the root tick) as well as
    // those decided with the breaker open.
    let other: Vec<_> = sent.iter().filter(|(_, d)| !d.ends_with("; by=metrics")).collect();
    assert!(other.is_empty(), "not routed by metrics: {other:?}");
    assert!(
        by_metrics.iter().all(|(pod, _)| *pod == pods[1].host()),
        "routed by metrics to a loaded pod: {sent:?}"
    );
    assert!(
        by_metrics.iter().any(|(_, d)| d.starts_with("fallback_redis_slow")),
        "a pick given up as too slow decides by metrics: {sent:?}"
    );
    assert!(
        by_metrics.iter().any(|(_, d)| d.starts_with("fallback_breaker_open")),
        "the open breaker decides by metrics too: {sent:?}"
    );
    let stats = gw.stats().await.unwrap();
    let counted = stat(&stats, "ai_lb_redis_down_routed_by_metrics");
    assert!(counted >= by_metrics.len() as i64, "{counted} < {}:\n{stats}", by_metrics.len());
    wait_counters_zero(&redis, Duration::from_secs(10)).await.unwrap();
}

/// Redis at its `maxmemory` with `volatile-lru` evicts keys that have a TTL. Under that pressure
/// the plugin keeps routing and its counts stay exact: no key the counts depend on (in-flight hash,
/// owners, owner hashes) has a TTL, so only prefix keys and other volatile keys are evicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volatile_lru_eviction_never_takes_the_counts() {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("eviction", 2).await.unwrap();
    let cfg = redis_policy_config("route-eviction", &pods, &redis, "prefix_cache", json!({}));
    let gw = Gateway::start(&cfg).await.unwrap();
    assert_eq!(chat_once(&gw, "before the pressure").await.unwrap().status, 200);
    let mut c = redis.client().await.unwrap();
    let used = |info: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let info = c.cmd(&["INFO", "memory"]).await.unwrap().as_string().unwrap_or_default();
    let limit = used(&info) + 256 * 1024;
    c.cmd(&["CONFIG", "SET", "maxmemory-policy", "volatile-lru"]).await.unwrap();
    c.cmd(&["CONFIG", "SET", "maxmemory", &limit.to_string()]).await.unwrap();
    // Other tenants' cache entries (with a TTL) fill Redis to its limit, and keep coming.
    let filler = "x".repeat(1024);
    let mut written = 0;
    let mut fill = |n: usize| {
        let start = written;
        written += n;
        start..written
    };
    for i in fill(600) {
        c.cmd(&["SET", &format!("tenant:{i}"), &filler, "EX", "3600"]).await.unwrap();
    }
    for p in &pods {
        p.set_hold(true);
    }
    let held: Vec<_> = (0..6)
        .map(|i| spawn_request(gw.addr(), chat(&format!("held {i}")), Duration::from_secs(30)))
        .collect();
    eventually(Duration::from_secs(10), "6 requests held by the pods and counted", || async {
        Ok(pods.iter().map(Pod::in_flight).sum::<usize>() == 6 && counters_sum(&redis).await? == 6)
    })
    .await
    .unwrap();
    for i in fill(600) {
        c.cmd(&["SET", &format!("tenant:{i}"), &filler, "EX", "3600"]).await.unwrap();
    }
    assert_eq!(counters_sum(&redis).await.unwrap(), 6, "eviction took in-flight counts");
    for p in &pods {
        p.set_hold(false);
        p.release();
    }
    for h in held {
        assert_eq!(h.await.unwrap().unwrap().status, 200);
    }
    // Requests keep being routed (and their prefix keys evicted in turn) under the pressure.
    for i in 0..40 {
        let r = chat_once(&gw, &format!("under pressure {i} {}", "words ".repeat(50))).await;
        assert_eq!(r.unwrap().status, 200);
    }
    let stats = c.cmd(&["INFO", "stats"]).await.unwrap().as_string().unwrap_or_default();
    let evicted = stats
        .lines()
        .find_map(|l| l.strip_prefix("evicted_keys:"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    assert!(evicted > 100, "Redis evicted only {evicted} keys: no pressure");
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
    eprintln!("{evicted} keys evicted; counts exact");
}

/// A gateway (global_least_request, lease `lease_ms`) over two pods that hold every request, with
/// requests held there and counted in Redis; `cfg` starts another gateway like it.
struct Holding {
    redis: RedisFixture,
    pods: Vec<Pod>,
    gw: Gateway,
    held: Vec<tokio::task::JoinHandle<anyhow::Result<testkit::HttpResponse>>>,
    cfg: GatewayConfig,
}

/// [`Holding`] with `n` requests, a drain timeout of `drain_ms` and a lease of `lease_ms`; `name`
/// names the pods and route.
async fn gateway_holding(name: &str, n: usize, drain_ms: u64, lease_ms: u64) -> Holding {
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods(name, 2).await.unwrap();
    let route = format!("route-{name}");
    let cfg = redis_policy_config(
        &route,
        &pods,
        &redis,
        "global_least_request",
        json!({"leaseMs": lease_ms}),
    )
    .drain_timeout_ms(drain_ms);
    let gw = Gateway::start(&cfg).await.unwrap();
    for p in &pods {
        p.set_hold(true);
    }
    let held = (0..n)
        .map(|i| spawn_request(gw.addr(), chat(&format!("{name} {i}")), Duration::from_secs(30)))
        .collect();
    eventually(Duration::from_secs(10), "the requests held and counted", || async {
        Ok(pods.iter().map(Pod::in_flight).sum::<usize>() == n
            && counters_sum(&redis).await? == n as i64)
    })
    .await
    .unwrap();
    Holding { redis, pods, gw, held, cfg }
}

/// A normal stop (SIGTERM, as Kubernetes sends it) with requests in flight, as a Higress pod
/// stops: its agent drains Envoy's listeners for the whole drain time (they still accept; each
/// answer closes its connection), then ends Envoy. The requests in flight finish within the
/// drain, a request that comes during it is served, their releases are written to Redis, and
/// nothing is left counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests_and_their_counts() {
    const DRAIN_MS: u64 = 4000;
    // Lease 60 s: only the releases can bring the counts down.
    let Holding { redis, pods, mut gw, held, .. } =
        gateway_holding("drain", 3, DRAIN_MS, 60_000).await;
    let stopped = Instant::now();
    gw.terminate().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    for p in &pods {
        p.set_hold(false);
        p.release();
    }
    // A new connection during the drain is accepted and served, and told to go away.
    let late = testkit::http::send(gw.addr(), chat("during the drain"), Duration::from_secs(10))
        .await
        .expect("a request during the drain is served");
    assert_eq!(late.status, 200, "{}", late.text());
    assert_eq!(late.header("connection"), Some("close"), "{:?}", late.headers);
    for h in held {
        let r = h.await.unwrap().expect("a request in flight at SIGTERM completes");
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert!(gw.is_running(), "the drain lasts its whole time");
    let status = gw.wait_exit(Duration::from_secs(8)).await.expect("exits after the drain");
    assert!(status.success(), "{status}");
    let took = stopped.elapsed();
    assert!(took >= Duration::from_millis(DRAIN_MS), "exited before the drain's end: {took:?}");
    // The releases were written before the exit (the lease is 60 s: only they can zero it).
    assert_eq!(counters_sum(&redis).await.unwrap(), 0, "{:?}", redis_counters(&redis).await);
}

/// Streams still running when the drain ends are cut as pilot-agent ends Envoy (SIGKILL):
/// nothing of the plugin runs any more, so no release leaves and their counts stay (Envoy's own
/// exit on SIGTERM would run their on_log/on_done but send nothing either). The lease takes them
/// away: another gateway on the same Redis removes them within two leases (2 s here) of the
/// exit, with no help from the gone one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_cut_at_exit_leave_their_counts_to_the_lease() {
    let Holding { redis, pods, mut gw, held, cfg } = gateway_holding("cut", 2, 300, 2000).await;
    let stopped = Instant::now();
    gw.terminate().unwrap();
    let status = gw.wait_exit(Duration::from_secs(6)).await.expect("exits after the drain");
    assert!(status.success(), "{status}");
    let exited = Instant::now();
    assert!(exited - stopped >= Duration::from_millis(300), "waited for the drain's end");
    for h in held {
        assert!(h.await.unwrap().is_err(), "a cut stream's client sees its connection close");
    }
    assert_eq!(counters_sum(&redis).await.unwrap(), 2, "{:?}", redis_counters(&redis).await);
    for p in &pods {
        p.set_hold(false);
        p.release();
    }
    let other = Gateway::start(&cfg).await.unwrap();
    assert_eq!(chat_once(&other, "another gateway").await.unwrap().status, 200);
    wait_counters_zero(&redis, Duration::from_secs(4).saturating_sub(exited.elapsed()))
        .await
        .unwrap();
    eprintln!("counts back to 0 {:?} after the exit", exited.elapsed());
}

/// Clients that send `chat` requests one after another to `addr` until `stop`; each returns the
/// status of every request (`None`: the request failed without an HTTP answer).
fn client_loops(
    addr: std::net::SocketAddr,
    clients: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<Option<u16>>>> {
    (0..clients)
        .map(|c| {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let req = chat(&format!("client {c} request {}", seen.len()));
                    let r = testkit::http::send(addr, req, Duration::from_secs(15)).await;
                    seen.push(r.ok().map(|r| r.status));
                }
                seen
            })
        })
        .collect()
}

/// Two gateways share Redis, both under load; one is SIGKILLed with requests in flight. No request
/// through the survivor fails or hangs, and while the survivor is still loaded the dead gateway's
/// +1s are gone within two leases (2 s here) of the kill: the counts then hold no more than the
/// survivor's own requests (each client's next pick may be counted just before its previous
/// release lands: at most two per client). Once the load stops they are 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_under_load_one_killed_the_survivor_serves_and_counts_return() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("two-gw", 2).await.unwrap();
    for p in &pods {
        p.set_delay(Duration::from_millis(300));
    }
    let lease = Duration::from_millis(1000);
    let cfg = redis_policy_config(
        "route-two-gw",
        &pods,
        &redis,
        "global_least_request",
        json!({"leaseMs": lease.as_millis() as u64}),
    );
    let mut doomed = Gateway::start(&cfg).await.unwrap();
    let survivor = Gateway::start(&cfg).await.unwrap();
    // The doomed gateway carries more concurrent requests than the survivor, so that a leak of its
    // counts cannot pass for the survivor's own.
    const DOOMED_CLIENTS: usize = 8;
    const SURVIVOR_CLIENTS: usize = 2;
    let stop_doomed = Arc::new(AtomicBool::new(false));
    let stop_survivor = Arc::new(AtomicBool::new(false));
    let doomed_loads = client_loops(doomed.addr(), DOOMED_CLIENTS, stop_doomed.clone());
    let survivor_loads = client_loops(survivor.addr(), SURVIVOR_CLIENTS, stop_survivor.clone());
    eventually(Duration::from_secs(10), "both gateways' requests counted", || async {
        Ok(counters_sum(&redis).await? > SURVIVOR_CLIENTS as i64)
    })
    .await
    .unwrap();
    doomed.kill();
    let killed_at = Instant::now();
    stop_doomed.store(true, Ordering::Relaxed);
    let mut doomed_failed = 0;
    for h in doomed_loads {
        doomed_failed += h.await.unwrap().iter().filter(|s| s.is_none()).count();
    }
    assert!(doomed_failed > 0, "requests were in flight on the killed gateway");
    // Two leases after the kill, with the survivor still loaded, the counts are the survivor's.
    let bound = 2 * lease;
    let mut max_after_bound = 0;
    while killed_at.elapsed() < bound + Duration::from_millis(1500) {
        let sum = counters_sum(&redis).await.unwrap();
        if killed_at.elapsed() > bound {
            max_after_bound = max_after_bound.max(sum);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        max_after_bound <= 2 * SURVIVOR_CLIENTS as i64,
        "{max_after_bound} counted {bound:?} after the kill: the killed gateway's +1s stayed"
    );
    stop_survivor.store(true, Ordering::Relaxed);
    let mut served = 0;
    for h in survivor_loads {
        let seen = h.await.unwrap();
        assert!(seen.iter().all(|s| *s == Some(200)), "survivor request failed: {seen:?}");
        served += seen.len();
    }
    assert!(served >= 10, "the survivor served only {served} requests");
    eprintln!(
        "killed under load: {doomed_failed} requests to the killed gateway failed (in flight, or \
         refused before its clients stopped), the survivor served {served}, at most \
         {max_after_bound} counted after {bound:?}"
    );
    wait_counters_zero(&redis, Duration::from_secs(3)).await.unwrap();
    assert_eq!(pods.iter().map(Pod::in_flight).sum::<usize>(), 0, "no request left paused");
}

/// Redis restarted from a snapshot older than the gateway's releases (an RDB `SAVE` here; an
/// append-only file fsynced once a second, or a replica promoted with some lag, leave the same):
/// it comes back holding the records and +1s of 4 requests that ended after the snapshot, whose
/// releases went to the Redis that died. Each VM's heartbeat lists the records it still needs and
/// Redis releases the others, so under load the stale +1s are gone within a lease of the restart,
/// no request fails, and the counts are 0 once the load stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarted_from_an_older_snapshot_leaves_no_stale_count() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let mut redis = RedisFixture::start().await.unwrap();
    let pods = start_pods("snapshot", 2).await.unwrap();
    // Long enough that the leases in the snapshot are still running when Redis is back: with a
    // short one, another VM's heartbeat may reap this VM (its snapshot lease ran out during the
    // restart) before this VM's own heartbeat releases the stale records, which mends the counts
    // as well but by the reaper, not the path this test is about (seen once in CI, lease 2 s).
    let lease = Duration::from_millis(10_000);
    let cfg = redis_policy_config(
        "route-snapshot",
        &pods,
        &redis,
        "global_least_request",
        json!({"leaseMs": lease.as_millis() as u64}),
    );
    let gw = Gateway::start(&cfg).await.unwrap();
    for p in &pods {
        p.set_hold(true);
    }
    let held: Vec<_> = (0..4)
        .map(|i| {
            let req = chat(&format!("in flight at the snapshot {i}"));
            spawn_request(gw.addr(), req, Duration::from_secs(30))
        })
        .collect();
    eventually(Duration::from_secs(10), "4 requests held by the pods and counted", || async {
        Ok(pods.iter().map(Pod::in_flight).sum::<usize>() == 4 && counters_sum(&redis).await? == 4)
    })
    .await
    .unwrap();
    let saved = redis.client().await.unwrap().cmd(&["SAVE"]).await.unwrap();
    assert_eq!(saved.as_string().as_deref(), Some("OK"), "{saved:?}");
    for p in &pods {
        p.set_hold(false);
        p.release();
    }
    for h in held {
        assert_eq!(h.await.unwrap().unwrap().status, 200);
    }
    wait_counters_zero(&redis, Duration::from_secs(5)).await.unwrap();
    // Under load from here on: through the kill (requests decided without Redis meanwhile), the
    // restart and its aftermath.
    for p in &pods {
        p.set_delay(Duration::from_millis(100));
    }
    const CLIENTS: usize = 2;
    let stop = Arc::new(AtomicBool::new(false));
    let loads = client_loops(gw.addr(), CLIENTS, stop.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    redis.stop().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    redis.restart().await.unwrap();
    // The snapshot brings back the +1s of the 4 requests that ended since (the gateway's next
    // heartbeat may already have released them: the stats below count them).
    let restarted = Instant::now();
    // From a lease after the restart on, the counts hold no more than the clients' own requests
    // (each client's next pick may be counted just before its previous release lands).
    let mut max_after_bound = 0;
    while restarted.elapsed() < lease + Duration::from_millis(1500) {
        let sum = counters_sum(&redis).await.unwrap();
        if restarted.elapsed() > lease {
            max_after_bound = max_after_bound.max(sum);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut served = 0;
    for h in loads {
        let seen = h.await.unwrap();
        assert!(seen.iter().all(|s| *s == Some(200)), "a request failed: {seen:?}");
        served += seen.len();
    }
    assert!(
        max_after_bound <= 2 * CLIENTS as i64,
        "{max_after_bound} counted {lease:?} after the restart: the snapshot's stale +1s stayed"
    );
    assert!(served >= 10, "only {served} requests served");
    wait_counters_zero(&redis, Duration::from_secs(3)).await.unwrap();
    assert_eq!(pods.iter().map(Pod::in_flight).sum::<usize>(), 0, "no request left paused");
    let stats = gw.stats().await.unwrap();
    assert_eq!(
        stat(&stats, "ai_lb_stale_records_released"),
        4,
        "the 4 records the snapshot brought back, released by the heartbeats:\n{stats}"
    );
}
