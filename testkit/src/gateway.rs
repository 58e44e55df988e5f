//! Gateway processes: a config builder for the host contract in `coord/ARCH.md`, a spawned
//! `target/release/gateway` whose `LISTENING`/`ADMIN`/`READY` lines are parsed, and the admin API.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _, Result};
use serde_json::{json, Value};

use crate::http::{self, HttpRequest, HttpResponse};
use crate::paths::{gateway_bin, plugin_wasm, TempDir};

/// The Redis cluster name the plugin derives from `serviceFQDN: redis.static, servicePort: 6379`.
pub const REDIS_CLUSTER: &str = "outbound|6379||redis.static";

/// The usual LLM cluster name in these tests.
pub const LLM_CLUSTER: &str = "outbound|8000||llm.static";

/// How long a gateway gets to print `READY` (it compiles the .wasm with cranelift at start,
/// possibly on a busy 2-core machine).
const START_TIMEOUT: Duration = Duration::from_secs(90);

/// Keep at most this much of the gateway's output for diagnostics.
const LOG_LIMIT: usize = 256 * 1024;

/// A gateway configuration (serialised as JSON, which is valid YAML).
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    listeners: Vec<Value>,
    admin: bool,
    routes: Vec<Value>,
    clusters: Vec<Value>,
    plugin: Option<Value>,
    workers: usize,
    log_level: String,
    drain_timeout_ms: Option<u64>,
    traps_expected: bool,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig::new()
    }
}

impl GatewayConfig {
    /// One listener `main` on a free port, an admin listener, 2 workers, no routes yet.
    pub fn new() -> GatewayConfig {
        GatewayConfig {
            listeners: vec![json!({"name": "main", "address": "127.0.0.1:0"})],
            admin: true,
            routes: Vec::new(),
            clusters: Vec::new(),
            plugin: None,
            workers: 2,
            log_level: "info".into(),
            drain_timeout_ms: None,
            traps_expected: false,
        }
    }

    /// The test makes the plugin trap on purpose: the gateway's stop does not check that
    /// `gateway_vm_traps_total` is 0 (every other gateway fails its test when a VM trapped).
    pub fn expect_traps(mut self) -> GatewayConfig {
        self.traps_expected = true;
        self
    }

    /// `drain_timeout_ms`: how long the listeners drain after SIGTERM before the gateway ends
    /// (in full, as pilot-agent waits; default 5 s).
    pub fn drain_timeout_ms(mut self, ms: u64) -> GatewayConfig {
        self.drain_timeout_ms = Some(ms);
        self
    }

    /// Adds a route `{name, match: {prefix}, cluster, timeout_ms: 60000}`.
    pub fn route(mut self, name: &str, prefix: &str, cluster: &str) -> GatewayConfig {
        self.routes.push(json!({
            "name": name, "match": {"prefix": prefix}, "cluster": cluster, "timeout_ms": 60000
        }));
        self
    }

    /// Adds a route given as raw JSON (e.g. with `cluster_header` or a host match).
    pub fn route_json(mut self, route: Value) -> GatewayConfig {
        self.routes.push(route);
        self
    }

    /// Adds a cluster with static endpoints and the default (round robin) LB.
    pub fn cluster(mut self, name: &str, endpoints: &[String]) -> GatewayConfig {
        self.clusters.push(json!({"name": name, "endpoints": endpoints}));
        self
    }

    /// Adds a cluster given as raw JSON.
    pub fn cluster_json(mut self, cluster: Value) -> GatewayConfig {
        self.clusters.push(cluster);
        self
    }

    /// Gives an existing cluster an active `/metrics` health check whose body the host keeps as
    /// each endpoint's `metrics` (Higress's store_metrics).
    pub fn metrics_health_check(mut self, cluster: &str, interval_ms: u64) -> GatewayConfig {
        for c in &mut self.clusters {
            if c.get("name").and_then(Value::as_str) == Some(cluster) {
                c["health_check"] = json!({
                    "path": "/metrics", "interval_ms": interval_ms, "timeout_ms": 1000,
                    "unhealthy_threshold": 1, "healthy_threshold": 1, "store_metrics": true
                });
            }
        }
        self
    }

    /// Adds the Redis cluster (`outbound|6379||redis.static`) pointing at `endpoint` (`ip:port`).
    pub fn redis(self, endpoint: &str) -> GatewayConfig {
        self.cluster(REDIS_CLUSTER, &[endpoint.to_string()])
    }

    /// Loads the plugin (`$AI_LB_WASM` or the wasm-release build) with this configuration value.
    pub fn plugin(self, configuration: Value) -> GatewayConfig {
        self.plugin_module(&plugin_wasm(), configuration)
    }

    /// Loads another plugin module (`.wasm` or `.wat`) with this configuration value.
    pub fn plugin_module(
        mut self,
        module: &std::path::Path,
        configuration: Value,
    ) -> GatewayConfig {
        self.plugin = Some(json!({
            "wasm": module.to_string_lossy(),
            "name": "ai-load-balancer",
            "root_id": "",
            "vm_id": "",
            "configuration": configuration,
        }));
        self
    }

    /// Worker threads (each with its own plugin VM).
    pub fn workers(mut self, n: usize) -> GatewayConfig {
        self.workers = n.max(1);
        self
    }

    /// `--log-level`.
    pub fn log_level(mut self, level: &str) -> GatewayConfig {
        self.log_level = level.into();
        self
    }

    /// The config document.
    pub fn to_json(&self) -> Value {
        let mut doc = json!({
            "listeners": self.listeners,
            "routes": self.routes,
            "clusters": self.clusters,
            // Every response names the endpoint the router chose ([`crate::http::UPSTREAM_HEADER`]),
            // as this route configuration entry does in Envoy or Higress too.
            "response_headers_to_add": [
                {"header": {"key": crate::http::UPSTREAM_HEADER, "value": "%UPSTREAM_HOST%"}}
            ],
        });
        if self.admin {
            doc["admin"] = json!({"address": "127.0.0.1:0"});
        }
        if let Some(p) = &self.plugin {
            doc["plugin"] = p.clone();
        }
        if let Some(ms) = self.drain_timeout_ms {
            doc["drain_timeout_ms"] = json!(ms);
        }
        doc
    }
}

/// The `lb_config` part every Redis-backed policy needs, pointing at [`REDIS_CLUSTER`].
pub fn redis_lb_config() -> Value {
    json!({"serviceFQDN": "redis.static", "servicePort": 6379})
}

/// A running gateway process (killed on drop). When it is dropped, it checks that no plugin VM
/// trapped during the test (`gateway_vm_traps_total` is 0) and panics otherwise, so a trap in any
/// callback (tick, Redis or HTTP reply, on_log) fails the test that caused it, even when the
/// request it was under fell back to a normal answer. [`GatewayConfig::expect_traps`] opts out.
pub struct Gateway {
    child: Child,
    traps_expected: bool,
    listeners: HashMap<String, SocketAddr>,
    admin: Option<SocketAddr>,
    log: Arc<Mutex<String>>,
    config_path: PathBuf,
    _dir: TempDir,
}

fn push_log(log: &Mutex<String>, line: &str) {
    if let Ok(mut l) = log.lock() {
        if l.len() > LOG_LIMIT {
            // Keep the most recent half: the end of the log is what explains a failure.
            let cut = l.len() - LOG_LIMIT / 2;
            let cut = (cut..l.len()).find(|&i| l.is_char_boundary(i)).unwrap_or(l.len());
            l.drain(..cut);
        }
        l.push_str(line);
        l.push('\n');
    }
}

impl Gateway {
    /// Writes `cfg` to a temp file, spawns the gateway and waits for `READY`.
    pub async fn start(cfg: &GatewayConfig) -> Result<Gateway> {
        let bin = gateway_bin();
        if !bin.exists() {
            bail!(
                "gateway binary {} not found: build it with `cargo build --release -p gateway` \
                 (or set GATEWAY_BIN)",
                bin.display()
            );
        }
        let module = cfg.plugin.as_ref().and_then(|p| p["wasm"].as_str()).map(PathBuf::from);
        if module.as_ref().is_some_and(|m| !m.exists()) {
            bail!(
                "plugin {} not found: build it with `cargo build --target wasm32-wasip1 --profile \
                 wasm-release -p ai-load-balancer` (or set AI_LB_WASM)",
                module.unwrap_or_default().display()
            );
        }
        let dir = TempDir::new("ai-lb-gateway")?;
        let config_path = dir.path().join("gateway.yaml");
        let text = serde_json::to_string_pretty(&cfg.to_json())?;
        std::fs::write(&config_path, &text)?;

        let mut child = Command::new(&bin)
            .arg("--config")
            .arg(&config_path)
            .args(["--workers", &cfg.workers.to_string()])
            .args(["--log-level", &cfg.log_level])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;

        let log = Arc::new(Mutex::new(String::new()));
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        if let Some(stdout) = child.stdout.take() {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    push_log(&log, &line);
                    let _ = tx.send(line);
                }
            });
        }
        if let Some(stderr) = child.stderr.take() {
            let log = log.clone();
            std::thread::spawn(move || drain_lines(stderr, &log));
        }

        let mut gw = Gateway {
            child,
            traps_expected: cfg.traps_expected,
            listeners: HashMap::new(),
            admin: None,
            log,
            config_path,
            _dir: dir,
        };
        let ready = async {
            while let Some(line) = rx.recv().await {
                let mut parts = line.split_whitespace();
                match parts.next() {
                    Some("LISTENING") => {
                        let (Some(name), Some(addr)) = (parts.next(), parts.next()) else {
                            bail!("malformed line {line:?}");
                        };
                        let addr: SocketAddr =
                            addr.parse().with_context(|| format!("in {line:?}"))?;
                        gw.listeners.insert(name.to_string(), addr);
                    }
                    Some("ADMIN") => {
                        let addr =
                            parts.next().ok_or_else(|| anyhow!("malformed line {line:?}"))?;
                        gw.admin = Some(addr.parse().with_context(|| format!("in {line:?}"))?);
                    }
                    Some("READY") => return Ok(()),
                    _ => {}
                }
            }
            bail!("gateway stdout closed before READY")
        };
        let outcome = tokio::time::timeout(START_TIMEOUT, ready).await;
        let err = match outcome {
            Ok(Ok(())) => return Ok(gw),
            Ok(Err(e)) => e,
            Err(_) => anyhow!("no READY within {START_TIMEOUT:?}"),
        };
        // Give the stderr reader a moment to collect the reason the gateway gave.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let status = gw.child.try_wait().ok().flatten();
        Err(err.context(format!(
            "gateway failed to start (exit: {status:?}); config:\n{text}\n--- gateway output ---\n{}",
            gw.logs()
        )))
    }

    /// The address of listener `main` (or the only listener).
    pub fn addr(&self) -> SocketAddr {
        self.listeners
            .get("main")
            .or_else(|| self.listeners.values().next())
            .copied()
            .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// The address of a named listener.
    pub fn listener(&self, name: &str) -> Option<SocketAddr> {
        self.listeners.get(name).copied()
    }

    /// The admin address.
    pub fn admin(&self) -> Result<SocketAddr> {
        self.admin.ok_or_else(|| anyhow!("gateway printed no ADMIN line"))
    }

    /// Path of the config file the gateway was started with.
    pub fn config_path(&self) -> &std::path::Path {
        &self.config_path
    }

    /// Everything the gateway printed so far (stdout and stderr, interleaved by arrival).
    pub fn logs(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Asks the process to stop (SIGTERM), as Kubernetes does before it kills a pod.
    pub fn terminate(&self) -> Result<()> {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .context("running kill -TERM")?;
        anyhow::ensure!(status.success(), "kill -TERM failed: {status}");
        Ok(())
    }

    /// Waits up to `within` for the process to exit; its exit status, or `None` if still running.
    pub async fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + within;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills the process at once (SIGKILL): no callback of the plugin runs any more.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether the process is still alive.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends a request to the `main` listener.
    pub async fn send(&self, req: HttpRequest, timeout: Duration) -> Result<HttpResponse> {
        http::send(self.addr(), req, timeout).await
    }

    /// `POST path` of JSON to the `main` listener with the default timeout.
    pub async fn post_json(&self, path: &str, body: &Value) -> Result<HttpResponse> {
        http::post_json(self.addr(), path, body).await
    }

    async fn admin_call(&self, req: HttpRequest) -> Result<HttpResponse> {
        let what = format!("admin {} {}", req.method, req.path);
        let resp = http::send(self.admin()?, req, Duration::from_secs(5)).await?;
        if !(200..300).contains(&resp.status) {
            bail!("{what}: status {} body {:?}", resp.status, resp.text());
        }
        Ok(resp)
    }

    /// `GET /stats` (Prometheus text).
    pub async fn stats(&self) -> Result<String> {
        Ok(self.admin_call(HttpRequest::get("/stats")).await?.text())
    }

    /// Sum of the samples of metric `name` whose labels include all of `labels`
    /// (None if no such sample exists).
    pub async fn stat(&self, name: &str, labels: &[(&str, &str)]) -> Result<Option<f64>> {
        Ok(prom_sum(&self.stats().await?, name, labels))
    }

    /// `GET /clusters` (JSON).
    pub async fn clusters(&self) -> Result<Value> {
        self.admin_call(HttpRequest::get("/clusters")).await?.json()
    }

    /// Replaces a cluster's endpoints at run time. New endpoints start Healthy, or on a
    /// health-checked cluster Unhealthy until their first check (which runs at once), as in Envoy.
    pub async fn set_endpoints(&self, cluster: &str, endpoints: &[String]) -> Result<()> {
        let path = format!("/clusters/{}/endpoints", url_encode(cluster));
        self.admin_call(HttpRequest::post_json(&path, &json!(endpoints))).await?;
        Ok(())
    }

    /// Forces endpoints' health (`Healthy`, `Unhealthy`, `Degraded`).
    pub async fn set_health(&self, cluster: &str, states: &[(&str, &str)]) -> Result<()> {
        let path = format!("/clusters/{}/health", url_encode(cluster));
        let body: serde_json::Map<String, Value> =
            states.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
        self.admin_call(HttpRequest::post_json(&path, &Value::Object(body))).await?;
        Ok(())
    }

    /// Waits until the admin API shows `host` in `cluster` with health `state`
    /// (the host applies admin changes asynchronously to its workers).
    pub async fn wait_health(
        &self,
        cluster: &str,
        host: &str,
        state: &str,
        within: Duration,
    ) -> Result<()> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let clusters = self.clusters().await?;
            if endpoint_health(&clusters, cluster, host).as_deref() == Some(state) {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("{host} in {cluster} never became {state}: {clusters}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The line the gateway logs for every VM trap (`worker.rs`), next to counting it in
/// `gateway_vm_traps_total`.
const TRAP_LOG_LINE: &str = "plugin trapped in ";

impl Gateway {
    /// How many times a plugin VM trapped in this process: `gateway_vm_traps_total` from the admin
    /// API while the process runs; once it has exited (SIGTERM, SIGKILL), the trap lines it logged.
    pub fn traps(&mut self) -> Result<u64> {
        if self.is_running() {
            if let Some(admin) = self.admin {
                let stats = blocking_get(admin, "/stats")?;
                let traps = prom_sum(&stats, "gateway_vm_traps_total", &[])
                    .ok_or_else(|| anyhow!("no gateway_vm_traps_total in /stats:\n{stats}"))?;
                return Ok(traps as u64);
            }
        }
        Ok(self.logs().matches(TRAP_LOG_LINE).count() as u64)
    }

    /// Fails when a plugin VM trapped (unless the test expects traps).
    pub fn check_no_traps(&mut self) -> Result<()> {
        if self.traps_expected {
            return Ok(());
        }
        let traps = self.traps()?;
        if traps != 0 {
            // The counter moves before the stderr reader has the trap's log line: give it a moment.
            let deadline = std::time::Instant::now() + Duration::from_secs(2);
            while !self.logs().contains(TRAP_LOG_LINE) && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let logs = self.logs();
            let trap_lines: Vec<&str> =
                logs.lines().filter(|l| l.contains(TRAP_LOG_LINE)).take(5).collect();
            bail!(
                "the plugin VM trapped {traps} time(s) during this test (gateway_vm_traps_total); \
                 first trap lines:\n{}",
                trap_lines.join("\n")
            );
        }
        Ok(())
    }
}

/// A plain HTTP/1.0 GET with a short timeout, usable where no async runtime can be awaited (drop).
fn blocking_get(addr: SocketAddr, path: &str) -> Result<String> {
    use std::io::Write as _;
    let timeout = Duration::from_secs(5);
    let mut s = std::net::TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("connect to admin {addr}"))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out).with_context(|| format!("read admin {path}"))?;
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((out.as_str(), ""));
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        bail!("admin GET {path}: {head}");
    }
    Ok(body.to_string())
}

impl Drop for Gateway {
    fn drop(&mut self) {
        // Checked before the kill, while the admin API still answers.
        let traps = if std::thread::panicking() { Ok(()) } else { self.check_no_traps() };
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Err(e) = traps {
            let logs = self.logs();
            let start = logs.len().saturating_sub(16 * 1024);
            let start = (start..logs.len()).find(|&i| logs.is_char_boundary(i)).unwrap_or(0);
            panic!("{e:#}\n--- gateway output (tail) ---\n{}", &logs[start..]);
        }
        if std::thread::panicking() {
            let logs = self.logs();
            let tail: String = {
                let start = logs.len().saturating_sub(16 * 1024);
                let start = (start..logs.len()).find(|&i| logs.is_char_boundary(i)).unwrap_or(0);
                logs[start..].to_string()
            };
            eprintln!("--- gateway output (tail) ---\n{tail}\n--- end gateway output ---");
        }
    }
}

fn drain_lines(r: impl Read, log: &Mutex<String>) {
    for line in BufReader::new(r).lines() {
        let Ok(line) = line else { break };
        push_log(log, &line);
    }
}

/// Percent-encodes everything but unreserved characters (cluster names contain `|`).
pub fn url_encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Health of `host` in `cluster` according to a `/clusters` document, tolerant of its exact shape:
/// looks for an object naming the host (`address`/`host`/`endpoint`) with a `health`-like field.
pub fn endpoint_health(clusters: &Value, cluster: &str, host: &str) -> Option<String> {
    let cluster_obj = find_cluster(clusters, cluster)?;
    let mut found = None;
    walk(cluster_obj, &mut |v| {
        if found.is_some() {
            return;
        }
        if let Value::Object(m) = v {
            let names_host = ["address", "host", "endpoint"]
                .iter()
                .any(|k| m.get(*k).and_then(Value::as_str) == Some(host));
            if names_host {
                found = ["health", "health_status", "status"]
                    .iter()
                    .find_map(|k| m.get(*k).and_then(Value::as_str).map(str::to_string));
            }
        }
    });
    found
}

fn find_cluster<'a>(doc: &'a Value, name: &str) -> Option<&'a Value> {
    match doc {
        Value::Object(m) => {
            if m.get("name").and_then(Value::as_str) == Some(name) {
                return Some(doc);
            }
            if let Some(v) = m.get(name) {
                return Some(v);
            }
            m.values().find_map(|v| find_cluster(v, name))
        }
        Value::Array(a) => a.iter().find_map(|v| find_cluster(v, name)),
        _ => None,
    }
}

fn walk(v: &Value, f: &mut dyn FnMut(&Value)) {
    f(v);
    match v {
        Value::Object(m) => m.values().for_each(|x| walk(x, f)),
        Value::Array(a) => a.iter().for_each(|x| walk(x, f)),
        _ => {}
    }
}

/// Parses `name{a="b",c="d"} value` lines; sums samples of `name` carrying all `labels`.
pub fn prom_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut sum = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = match line.rfind(|c: char| c.is_whitespace()) {
            Some(i) => (line[..i].trim(), line[i..].trim()),
            None => continue,
        };
        let (metric, label_text) = match series.find('{') {
            Some(i) => (&series[..i], series[i + 1..].trim_end_matches('}')),
            None => (series, ""),
        };
        if metric != name {
            continue;
        }
        let parsed = parse_labels(label_text);
        if labels.iter().all(|(k, v)| parsed.iter().any(|(pk, pv)| pk == k && pv == v)) {
            if let Ok(x) = value.parse::<f64>() {
                *sum.get_or_insert(0.0) += x;
            }
        }
    }
    sum
}

fn parse_labels(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(eq) = rest.find('=') {
        let key = rest[..eq].trim().trim_start_matches(',').trim().to_string();
        let after = &rest[eq + 1..];
        let Some(after) = after.strip_prefix('"') else { break };
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        value.push(match n {
                            'n' => '\n',
                            other => other,
                        });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.push((key, value));
        rest = &after[end.min(after.len())..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prom_sum_matches_label_subsets() {
        let text = "# TYPE gateway_upstream_requests_total counter\n\
            gateway_upstream_requests_total{cluster=\"outbound|8000||llm.static\",host=\"127.0.0.1:1\"} 3\n\
            gateway_upstream_requests_total{cluster=\"outbound|8000||llm.static\",host=\"127.0.0.1:2\"} 4\n\
            gateway_requests_total 9\n";
        assert_eq!(prom_sum(text, "gateway_requests_total", &[]), Some(9.0));
        assert_eq!(prom_sum(text, "gateway_upstream_requests_total", &[]), Some(7.0));
        assert_eq!(
            prom_sum(text, "gateway_upstream_requests_total", &[("host", "127.0.0.1:2")]),
            Some(4.0)
        );
        assert_eq!(prom_sum(text, "gateway_local_replies_total", &[]), None);
    }

    #[test]
    fn url_encode_escapes_cluster_names() {
        assert_eq!(url_encode("outbound|8000||llm.static"), "outbound%7C8000%7C%7Cllm.static");
    }

    #[test]
    fn endpoint_health_reads_common_shapes() {
        let doc = json!([{"name": "c", "endpoints": [{"address": "127.0.0.1:1", "health": "Unhealthy"}]}]);
        assert_eq!(endpoint_health(&doc, "c", "127.0.0.1:1").as_deref(), Some("Unhealthy"));
        assert_eq!(endpoint_health(&doc, "c", "127.0.0.1:2"), None);
    }
}
