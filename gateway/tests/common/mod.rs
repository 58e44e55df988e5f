//! Test harness: gateway processes, recording upstreams, WAT test plugins.
#![allow(dead_code)]

use bytes::Bytes;
use gateway::body::GwBody;
use http_body_util::BodyExt;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running gateway process (killed on drop).
pub struct Gateway {
    child: Child,
    /// Main listener.
    pub addr: SocketAddr,
    /// Admin listener.
    pub admin: SocketAddr,
    /// Stderr lines (plugin logs).
    pub log: Arc<Mutex<Vec<String>>>,
    _dir: TempDir,
}

/// Asks `child` to stop (SIGTERM) and waits up to `within` for it to exit; its exit status, or
/// None if it still runs.
pub async fn terminate(child: &mut Child, within: Duration) -> Option<std::process::ExitStatus> {
    let sent = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(sent, "kill -TERM failed");
    let deadline = Instant::now() + within;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            // Let the log reader take the last lines.
            tokio::time::sleep(Duration::from_millis(100)).await;
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A temp directory removed on drop.
pub struct TempDir(pub std::path::PathBuf);
impl TempDir {
    pub fn new() -> TempDir {
        let p = std::env::temp_dir().join(format!("gw-test-{}-{}", std::process::id(), rand_u64()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The route configuration entry that names the chosen endpoint in every response.
pub const UPSTREAM_HOST_TO_ADD: &str =
    "response_headers_to_add: [{header: {key: x-gateway-upstream-host, value: \"%UPSTREAM_HOST%\"}}]\n";

pub fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    h.finish()
}

impl Gateway {
    /// Start with a YAML config; `{PLUGIN}` in it is replaced by the path of `wat` (if given).
    pub fn start(yaml: &str, wat: Option<&str>, workers: usize) -> Gateway {
        Self::try_start(yaml, wat, workers).expect("gateway did not start")
    }

    pub fn try_start(yaml: &str, wat: Option<&str>, workers: usize) -> Result<Gateway, String> {
        let dir = TempDir::new();
        // The tests read the chosen endpoint from every response, as a route configuration
        // with this entry gives it in Envoy too.
        let mut yaml = if yaml.contains("response_headers_to_add") {
            yaml.to_string()
        } else {
            format!("{UPSTREAM_HOST_TO_ADD}{yaml}")
        };
        if let Some(w) = wat {
            let p = dir.0.join("plugin.wat");
            std::fs::write(&p, w).unwrap();
            yaml = yaml.replace("{PLUGIN}", p.to_str().unwrap());
        }
        let cfg = dir.0.join("gateway.yaml");
        std::fs::write(&cfg, yaml).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_gateway"))
            .arg("--config")
            .arg(&cfg)
            .arg("--workers")
            .arg(workers.to_string())
            .arg("--log-level")
            .arg("info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().unwrap();
        let l2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                l2.lock().unwrap().push(line);
            }
        });
        let stdout = child.stdout.take().unwrap();
        let mut addr = None;
        let mut admin = None;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let parts: Vec<&str> = line.split_whitespace().collect();
            match parts.as_slice() {
                ["LISTENING", _, a] => addr = a.parse().ok(),
                ["ADMIN", a] => admin = a.parse().ok(),
                ["READY"] => break,
                _ => {}
            }
        }
        match (addr, admin) {
            (Some(addr), Some(admin)) => Ok(Gateway { child, addr, admin, log, _dir: dir }),
            _ => {
                let status = child.wait().ok();
                std::thread::sleep(Duration::from_millis(100));
                Err(format!("gateway exited ({status:?}): {}", log.lock().unwrap().join("\n")))
            }
        }
    }

    /// Plugin events: the text after "EV " in log lines, in order.
    pub fn events(&self) -> Vec<String> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter_map(|l| l.split_once("EV ").map(|(_, e)| e.trim().to_string()))
            .collect()
    }

    /// Wait until `pred(events)` holds (or time out).
    pub async fn wait_events(&self, pred: impl Fn(&[String]) -> bool, what: &str) -> Vec<String> {
        let start = Instant::now();
        loop {
            let ev = self.events();
            if pred(&ev) {
                return ev;
            }
            if start.elapsed() > Duration::from_secs(10) {
                panic!("timed out waiting for {what}; events: {ev:#?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Asks the process to stop (SIGTERM) and waits up to `within` for it to exit; its exit
    /// status, or None if it still runs.
    pub async fn terminate(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        terminate(&mut self.child, within).await
    }
    /// The gateway's process.
    pub fn process(&mut self) -> &mut Child {
        &mut self.child
    }
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A simple response.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}
impl Resp {
    pub fn header(&self, k: &str) -> Option<String> {
        self.headers.get(k).and_then(|v| v.to_str().ok()).map(str::to_string)
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub fn client() -> gateway::body::HttpClient {
    gateway::body::client(Duration::from_secs(5))
}

/// One request with a full body.
pub async fn request(method: &str, url: &str, headers: &[(&str, &str)], body: &str) -> Resp {
    let mut b = hyper::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(GwBody::full(Bytes::from(body.to_string()))).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(20), client().request(req))
        .await
        .expect("request timed out")
        .expect("request failed");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    Resp { status, headers, body }
}

pub async fn get(url: &str, headers: &[(&str, &str)]) -> Resp {
    request("GET", url, headers, "").await
}

/// POST a body in several chunks with a pause between them (chunked transfer encoding).
pub async fn post_chunks(
    url: &str,
    headers: &[(&str, &str)],
    chunks: &[&str],
    pause: Duration,
) -> Resp {
    let (tx, body) = GwBody::channel();
    let mut b = hyper::Request::builder().method("POST").uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(body).unwrap();
    let chunks: Vec<String> = chunks.iter().map(|s| s.to_string()).collect();
    tokio::spawn(async move {
        for c in chunks {
            let _ = tx.send(Ok(Bytes::from(c))).await;
            tokio::time::sleep(pause).await;
        }
    });
    let resp = tokio::time::timeout(Duration::from_secs(20), client().request(req))
        .await
        .expect("request timed out")
        .expect("request failed");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    Resp { status, headers, body }
}

/// What an upstream received.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

/// Whether the connection's first request is `GET /trailers` (peeked, not consumed).
async fn starts_with_trailers_request(stream: &tokio::net::TcpStream) -> bool {
    const LINE: &[u8] = b"GET /trailers ";
    let mut head = [0u8; 14];
    for _ in 0..100 {
        match stream.peek(&mut head).await {
            Ok(n) if n >= LINE.len() || n == 0 || !LINE.starts_with(&head[..n]) => {
                return head[..n] == *LINE;
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            Err(_) => return false,
        }
    }
    false
}

/// `GET /trailers`, answered by hand (hyper's server writes trailers only to clients that sent
/// `te: trailers`): a chunked body "hello" ending with the trailer field `x-trailer: t1`, then
/// the connection closes.
async fn answer_with_trailers(mut stream: tokio::net::TcpStream, seen: &Mutex<Vec<Recorded>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let text = String::from_utf8_lossy(&buf).into_owned();
    let mut lines = text.split("\r\n");
    let mut first = lines.next().unwrap_or_default().split(' ');
    let (method, path) = (first.next().unwrap_or_default(), first.next().unwrap_or_default());
    let mut headers = hyper::HeaderMap::new();
    for l in lines.take_while(|l| !l.is_empty()) {
        let Some((k, v)) = l.split_once(':') else { continue };
        if let (Ok(k), Ok(v)) = (
            hyper::header::HeaderName::from_bytes(k.trim().as_bytes()),
            hyper::header::HeaderValue::from_str(v.trim()),
        ) {
            headers.append(k, v);
        }
    }
    seen.lock().unwrap().push(Recorded {
        method: method.to_string(),
        path: path.to_string(),
        headers,
        body: Bytes::new(),
    });
    let resp = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-trailer\r\nconnection: close\r\n\r\n5\r\nhello\r\n0\r\nx-trailer: t1\r\n\r\n";
    let _ = stream.write_all(resp.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// A recording upstream. Paths: `/close` closes the connection without a response; `/slow` answers after 500 ms; `/secret` a body with "secret"; `/sse` streams 3 events 150 ms
/// apart; `/sse-forever` streams until the client goes away; `/reset-mid` sends a chunked
/// response's first chunk and then drops the connection; `/metrics` answers a fixed text;
/// `/trailers` a chunked body with a trailer field (then the connection closes); `/bytes/<n>`
/// answers n bytes (at most 1 MiB); anything else answers "ok <port>".
pub struct Upstream {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Recorded>>>,
    /// Set when an `/sse-forever` stream noticed its client went away.
    pub sse_closed: Arc<Mutex<bool>>,
}

impl Upstream {
    pub async fn start() -> Upstream {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sse_closed = Arc::new(Mutex::new(false));
        let (s2, c2) = (seen.clone(), sse_closed.clone());
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = l.accept().await else { continue };
                let (seen, closed) = (s2.clone(), c2.clone());
                tokio::spawn(async move {
                    if starts_with_trailers_request(&stream).await {
                        answer_with_trailers(stream, &seen).await;
                        return;
                    }
                    let svc = hyper::service::service_fn(
                        move |req: hyper::Request<hyper::body::Incoming>| {
                            let (seen, closed) = (seen.clone(), closed.clone());
                            async move {
                                let (parts, body) = req.into_parts();
                                let body =
                                    body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
                                let path = parts.uri.path().to_string();
                                seen.lock().unwrap().push(Recorded {
                                    method: parts.method.to_string(),
                                    path: path.clone(),
                                    headers: parts.headers.clone(),
                                    body,
                                });
                                let resp = match path.as_str() {
                                    // A service error: hyper closes the connection without
                                    // a response.
                                    "/close" => {
                                        return Err(std::io::Error::other("closed by the test"));
                                    }
                                    "/slow" => {
                                        tokio::time::sleep(Duration::from_millis(500)).await;
                                        hyper::Response::new(GwBody::full(Bytes::from("slow")))
                                    }
                                    "/hang" => {
                                        tokio::time::sleep(Duration::from_secs(10)).await;
                                        hyper::Response::new(GwBody::full(Bytes::from("late")))
                                    }
                                    "/reset-mid" => {
                                        let (tx, b) = GwBody::channel();
                                        tokio::spawn(async move {
                                            let _ = tx.send(Ok(Bytes::from("first chunk"))).await;
                                            tokio::time::sleep(Duration::from_millis(100)).await;
                                            // A body error: hyper aborts the connection mid-body.
                                            let _ = tx
                                                .send(Err(std::io::Error::other("reset").into()))
                                                .await;
                                        });
                                        hyper::Response::new(b)
                                    }
                                    "/secret" => hyper::Response::new(GwBody::full(Bytes::from(
                                        "a body with a secret in it",
                                    ))),
                                    "/metrics" => hyper::Response::new(GwBody::full(Bytes::from(
                                        format!("vllm:num_requests_running {}\n", addr.port()),
                                    ))),
                                    p if p.starts_with("/status/") => {
                                        let code = p["/status/".len()..].parse().unwrap_or(500);
                                        let mut r = hyper::Response::new(GwBody::full(
                                            Bytes::from(format!("status {code}")),
                                        ));
                                        *r.status_mut() = hyper::StatusCode::from_u16(code)
                                            .unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
                                        r
                                    }
                                    // A response head (status line to blank line) of
                                    // exactly N bytes: hyper adds `content-length: 2` and a
                                    // 29-byte `date`; one `x-big` header pads the rest.
                                    p if p.starts_with("/response-head/") => {
                                        let n =
                                            p["/response-head/".len()..].parse().unwrap_or(0usize);
                                        let fixed = "HTTP/1.1 200 OK\r\n".len()
                                            + "content-length: 2\r\n".len()
                                            + "date: Mon, 30 Nov 2026 21:48:43 GMT\r\n".len()
                                            + "x-big: \r\n".len()
                                            + "\r\n".len();
                                        let mut r =
                                            hyper::Response::new(GwBody::full(Bytes::from("ok")));
                                        let pad = "a".repeat(n.saturating_sub(fixed).min(1 << 20));
                                        r.headers_mut().insert("x-big", pad.parse().unwrap());
                                        r
                                    }
                                    // N response headers, hyper's `content-length` and `date`
                                    // among them.
                                    p if p.starts_with("/response-headers/") => {
                                        let n = p["/response-headers/".len()..]
                                            .parse()
                                            .unwrap_or(0usize);
                                        let mut r =
                                            hyper::Response::new(GwBody::full(Bytes::from("ok")));
                                        for i in 2..n.min(1000) {
                                            let name = format!("x-h{i}");
                                            r.headers_mut().insert(
                                                hyper::header::HeaderName::from_bytes(
                                                    name.as_bytes(),
                                                )
                                                .unwrap(),
                                                "a".parse().unwrap(),
                                            );
                                        }
                                        r
                                    }
                                    p if p.starts_with("/bytes/") => {
                                        let n = p["/bytes/".len()..].parse().unwrap_or(0usize);
                                        hyper::Response::new(GwBody::full(Bytes::from(
                                            "y".repeat(n.min(1 << 20)),
                                        )))
                                    }
                                    "/sse" | "/sse-forever" => {
                                        let forever = path == "/sse-forever";
                                        let (tx, b) = GwBody::channel();
                                        tokio::spawn(async move {
                                            let mut i = 0;
                                            loop {
                                                if tx
                                                    .send(Ok(Bytes::from(format!("data: {i}\n\n"))))
                                                    .await
                                                    .is_err()
                                                {
                                                    *closed.lock().unwrap() = true;
                                                    return;
                                                }
                                                i += 1;
                                                if !forever && i == 3 {
                                                    return;
                                                }
                                                tokio::select! {
                                                    _ = tokio::time::sleep(Duration::from_millis(150)) => {}
                                                    _ = tx.closed() => { *closed.lock().unwrap() = true; return; }
                                                }
                                            }
                                        });
                                        let mut r = hyper::Response::new(b);
                                        r.headers_mut().insert(
                                            "content-type",
                                            "text/event-stream".parse().unwrap(),
                                        );
                                        r
                                    }
                                    _ => hyper::Response::new(GwBody::full(Bytes::from(format!(
                                        "ok {}",
                                        addr.port()
                                    )))),
                                };
                                Ok::<_, std::io::Error>(resp)
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Upstream { addr, seen, sse_closed }
    }
    pub fn requests(&self) -> Vec<Recorded> {
        self.seen.lock().unwrap().clone()
    }
    pub fn count(&self, path: &str) -> usize {
        self.seen.lock().unwrap().iter().filter(|r| r.path == path).count()
    }
}

/// Builds WAT test plugins: a prelude (memory, allocator, logging helpers), string constants.
pub struct Wat {
    data: Vec<(u32, Vec<u8>)>,
    next: u32,
}

impl Wat {
    pub fn new() -> Wat {
        Wat { data: Vec::new(), next: 8192 }
    }
    /// A constant string: expands to `(i32.const addr) (i32.const len)`.
    pub fn s(&mut self, text: &str) -> String {
        self.b(text.as_bytes())
    }
    pub fn b(&mut self, bytes: &[u8]) -> String {
        let addr = self.next;
        self.data.push((addr, bytes.to_vec()));
        self.next += (bytes.len() as u32 + 8) & !7;
        format!("(i32.const {addr}) (i32.const {})", bytes.len())
    }
    /// The whole module: `marker` like "0_2_100", `body` the plugin's functions.
    pub fn module(&self, marker: &str, body: &str) -> String {
        self.module_with(PRELUDE, marker, body)
    }
    /// The whole module on another prelude (e.g. one without the Higress-only imports).
    pub fn module_with(&self, prelude: &str, marker: &str, body: &str) -> String {
        let mut data = String::new();
        for (addr, bytes) in &self.data {
            let esc: String = bytes.iter().map(|b| format!("\\{b:02x}")).collect();
            data.push_str(&format!("  (data (i32.const {addr}) \"{esc}\")\n"));
        }
        // Extra imports in `body` must precede every definition: hoist them before the memory.
        let imports: String = body
            .lines()
            .filter(|l| l.trim_start().starts_with("(import"))
            .map(|l| format!("{l}\n"))
            .collect();
        let body: String = body
            .lines()
            .filter(|l| !l.trim_start().starts_with("(import"))
            .map(|l| format!("{l}\n"))
            .collect();
        let prelude = prelude.replacen("  (memory", &format!("{imports}  (memory"), 1);
        format!("{prelude}\n  (func (export \"proxy_abi_version_{marker}\"))\n{body}\n{data})\n")
    }
}

/// Imports, memory, a bump allocator and log helpers.
/// Scratch: 256 = out ptr, 260 = out len, 264 = out u32 (token/cas/id), 512.. = stored values.
/// `$ev_start(ptr,len)` starts "EV name", `$ev_num(n)` appends " n", `$ev_str(ptr,len)` appends
/// " text", `$ev_end` logs it at info level.
pub const PRELUDE: &str = r#"(module
  (import "env" "proxy_log" (func $proxy_log (param i32 i32 i32) (result i32)))
  (import "env" "proxy_continue_stream" (func $proxy_continue_stream (param i32) (result i32)))
  (import "env" "proxy_send_local_response" (func $proxy_send_local_response (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_get_header_map_value" (func $proxy_get_header_map_value (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_add_header_map_value" (func $proxy_add_header_map_value (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_get_buffer_bytes" (func $proxy_get_buffer_bytes (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_http_call" (func $proxy_http_call (param i32 i32 i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_effective_context" (func $proxy_set_effective_context (param i32) (result i32)))
  (import "env" "proxy_set_upstream_override_host" (func $proxy_set_upstream_override_host (param i32 i32) (result i32)))
  (import "env" "proxy_get_upstream_hosts" (func $proxy_get_upstream_hosts (param i32 i32) (result i32)))
  (import "env" "proxy_redis_init" (func $proxy_redis_init (param i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_redis_call" (func $proxy_redis_call (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_get_shared_data" (func $proxy_get_shared_data (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_shared_data" (func $proxy_set_shared_data (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_property" (func $proxy_set_property (param i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_get_property" (func $proxy_get_property (param i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_grpc_call" (func $proxy_grpc_call (param i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_tick_period_milliseconds" (func $proxy_set_tick_period_milliseconds (param i32) (result i32)))
  (import "env" "proxy_register_shared_queue" (func $proxy_register_shared_queue (param i32 i32 i32) (result i32)))
  (import "env" "proxy_resolve_shared_queue" (func $proxy_resolve_shared_queue (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_enqueue_shared_queue" (func $proxy_enqueue_shared_queue (param i32 i32 i32) (result i32)))
  (import "env" "proxy_dequeue_shared_queue" (func $proxy_dequeue_shared_queue (param i32 i32 i32) (result i32)))
  (import "env" "proxy_define_metric" (func $proxy_define_metric (param i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_increment_metric" (func $proxy_increment_metric (param i32 i64) (result i32)))
  (import "env" "proxy_replace_header_map_value" (func $proxy_replace_header_map_value (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 2)
  (global $heap (mut i32) (i32.const 65536))
  (global $pos (mut i32) (i32.const 0))
  (func (export "proxy_on_memory_allocate") (param $n i32) (result i32)
    (local $p i32)
    (local.set $p (global.get $heap))
    (global.set $heap (i32.and (i32.add (i32.add (global.get $heap) (local.get $n)) (i32.const 15)) (i32.const -16)))
    (if (i32.gt_u (global.get $heap) (i32.mul (memory.size) (i32.const 65536)))
      (then (drop (memory.grow (i32.add (i32.shr_u (local.get $n) (i32.const 16)) (i32.const 1))))))
    (local.get $p))
  (func $copy (param $dst i32) (param $src i32) (param $n i32)
    (memory.copy (local.get $dst) (local.get $src) (local.get $n)))
  (func $ev_start (param $p i32) (param $n i32)
    (i32.store8 (i32.const 4096) (i32.const 69)) (i32.store8 (i32.const 4097) (i32.const 86)) (i32.store8 (i32.const 4098) (i32.const 32))
    (call $copy (i32.const 4099) (local.get $p) (local.get $n))
    (global.set $pos (i32.add (i32.const 4099) (local.get $n))))
  (func $ev_str (param $p i32) (param $n i32)
    (i32.store8 (global.get $pos) (i32.const 32))
    (call $copy (i32.add (global.get $pos) (i32.const 1)) (local.get $p) (local.get $n))
    (global.set $pos (i32.add (global.get $pos) (i32.add (local.get $n) (i32.const 1)))))
  (func $ev_num (param $v i32)
    (local $tmp i32) (local $len i32) (local $i i32)
    (i32.store8 (global.get $pos) (i32.const 32))
    (global.set $pos (i32.add (global.get $pos) (i32.const 1)))
    (if (i32.lt_s (local.get $v) (i32.const 0))
      (then (i32.store8 (global.get $pos) (i32.const 45))
            (global.set $pos (i32.add (global.get $pos) (i32.const 1)))
            (local.set $v (i32.sub (i32.const 0) (local.get $v)))))
    ;; digits into 3072.. reversed
    (local.set $len (i32.const 0))
    (loop $d
      (i32.store8 (i32.add (i32.const 3072) (local.get $len)) (i32.add (i32.const 48) (i32.rem_u (local.get $v) (i32.const 10))))
      (local.set $len (i32.add (local.get $len) (i32.const 1)))
      (local.set $v (i32.div_u (local.get $v) (i32.const 10)))
      (br_if $d (i32.ne (local.get $v) (i32.const 0))))
    (local.set $i (i32.const 0))
    (loop $r
      (i32.store8 (i32.add (global.get $pos) (local.get $i))
        (i32.load8_u (i32.add (i32.const 3072) (i32.sub (i32.sub (local.get $len) (local.get $i)) (i32.const 1)))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $r (i32.lt_u (local.get $i) (local.get $len))))
    (global.set $pos (i32.add (global.get $pos) (local.get $len))))
  (func $ev_end
    (drop (call $proxy_log (i32.const 2) (i32.const 4096) (i32.sub (global.get $pos) (i32.const 4096)))))
  ;; the text written by $ev_* so far (after "EV "), e.g. to use as a body
  (func $out_ptr (result i32) (i32.const 4099))
  (func $out_len (result i32) (i32.sub (global.get $pos) (i32.const 4099)))
  (func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 1))
"#;

/// A config with one route to the cluster `pods` (endpoints `up`), `extra_clusters` (YAML lines)
/// and, when `plugin`, the test plugin (`{PLUGIN}` is replaced by its path).
pub fn one_cluster_config(up: &str, plugin: bool, extra_clusters: &str) -> String {
    let plugin = if plugin {
        "plugin:\n  wasm: {PLUGIN}\n  name: test-plugin\n  root_id: test-root\n  configuration: {a: 1}\n"
    } else {
        ""
    };
    format!(
        "listeners: [{{name: main, address: 127.0.0.1:0}}]\nadmin: {{address: 127.0.0.1:0}}\nroutes:\n  - name: test-route\n    match: {{prefix: /}}\n    cluster: pods\n    timeout_ms: 5000\nclusters:\n  - name: pods\n    endpoints: [{up}]\n{extra_clusters}{plugin}"
    )
}

/// Plugin for the Redis tests: POST body = raw RESP query, header x-cluster = cluster string,
/// optional header x-init = a cluster string to `proxy_redis_init` again before the call.
pub fn redis_plugin() -> String {
    redis_plugin_with("outbound|6379||redis.static?db=1")
}

/// [`redis_plugin`] with another cluster string for `proxy_redis_init`.
pub fn redis_plugin_with(init_cluster: &str) -> String {
    let mut w = Wat::new();
    let body = format!(
        r#"
  (global $stream (mut i32) (i32.const 0))
  (func (export "proxy_on_configure") (param $root i32) (param $size i32) (result i32)
    (call $ev_start {ev_init}) (call $ev_num (call $proxy_redis_init {cl_init} (i32.const 0) (i32.const 0) {pw} (i32.const 1000))) (call $ev_end)
    (i32.const 1))
  (func (export "proxy_on_request_headers") (param $ctx i32) (param $n i32) (param $eos i32) (result i32)
    (global.set $stream (local.get $ctx))
    (i32.const 1))
  (func (export "proxy_on_request_body") (param $ctx i32) (param $size i32) (param $eos i32) (result i32)
    (local $r i32)
    (if (i32.eqz (local.get $eos)) (then (return (i32.const 1))))
    (drop (call $proxy_get_buffer_bytes (i32.const 0) (i32.const 0) (local.get $size) (i32.const 512) (i32.const 516)))
    (drop (call $proxy_get_header_map_value (i32.const 0) {hk} (i32.const 520) (i32.const 524)))
    ;; `x-init: <cluster string>`: init again first (same password), as a plugin does after a
    ;; failed init or on reconfigure.
    (if (i32.eqz (call $proxy_get_header_map_value (i32.const 0) {ik} (i32.const 528) (i32.const 532)))
      (then (call $ev_start {ev_reinit}) (call $ev_num (call $proxy_redis_init (i32.load (i32.const 528)) (i32.load (i32.const 532)) (i32.const 0) (i32.const 0) {pw} (i32.const 1000))) (call $ev_end)))
    (local.set $r (call $proxy_redis_call (i32.load (i32.const 520)) (i32.load (i32.const 524)) (i32.load (i32.const 512)) (i32.load (i32.const 516)) (i32.const 264)))
    (call $ev_start {ev_call}) (call $ev_num (local.get $r)) (call $ev_num (i32.load (i32.const 264))) (call $ev_end)
    ;; The stream of each token (tokens are small here), so concurrent calls answer their own.
    (if (i32.eqz (local.get $r))
      (then (i32.store (i32.add (i32.const 4096) (i32.mul (i32.load (i32.const 264)) (i32.const 4))) (local.get $ctx))))
    (if (local.get $r)
      (then (drop (call $proxy_send_local_response (i32.add (i32.const 590) (local.get $r)) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const -1)))))
    (i32.const 1))
  (func (export "proxy_on_redis_call_response") (param $root i32) (param $token i32) (param $status i32) (param $size i32)
    (call $ev_start {ev_resp}) (call $ev_num (local.get $token)) (call $ev_num (local.get $status)) (call $ev_num (local.get $size)) (call $ev_end)
    (i32.store (i32.const 256) (i32.const 0)) (i32.store (i32.const 260) (i32.const 0))
    (drop (call $proxy_get_buffer_bytes (i32.const 9) (i32.const 0) (local.get $size) (i32.const 256) (i32.const 260)))
    (drop (call $proxy_set_effective_context (i32.load (i32.add (i32.const 4096) (i32.mul (local.get $token) (i32.const 4))))))
    (drop (call $proxy_send_local_response (i32.add (i32.const 200) (i32.mul (local.get $status) (i32.const 303))) (i32.const 0) (i32.const 0) (i32.load (i32.const 256)) (i32.load (i32.const 260)) (i32.const 0) (i32.const 0) (i32.const -1))))
"#,
        ev_init = w.s("init"),
        cl_init = w.s(init_cluster),
        pw = w.s("secret"),
        hk = w.s("x-cluster"),
        ik = w.s("x-init"),
        ev_reinit = w.s("reinit"),
        ev_call = w.s("call"),
        ev_resp = w.s("redis"),
    );
    w.module("0_2_100", &body)
}

/// A RESP command (array of bulk strings).
pub fn resp(args: &[&str]) -> String {
    let mut s = format!("*{}\r\n", args.len());
    for a in args {
        s.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    s
}
