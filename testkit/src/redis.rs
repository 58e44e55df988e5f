//! A real Redis for the e2e tests, and a small client for assertions.
//!
//! Backend choice ([`RedisFixture::start`]):
//! - `AI_LB_REDIS_BACKEND=docker|local` forces one.
//! - Otherwise, if a Docker engine answers on `$DOCKER_HOST` (or `/var/run/docker.sock`), a container
//!   of `$AI_LB_REDIS_IMAGE` (default `ai-lb-redis:local`, built by `testkit/redis-image.sh`) is run
//!   through testcontainers, its port 6379 published on a free host port. Outside CI a missing
//!   image falls back to the local server below, with a note on stderr.
//! - Otherwise a `redis-server` process (`$AI_LB_REDIS_SERVER` or from `PATH`) on a free port.
//!
//! With `CI=true` the Docker path is mandatory: an unreachable engine or a missing image is an
//! error, never a silent fallback, so CI really exercises the testcontainers path.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use redis_protocol::resp2::decode::decode;
use redis_protocol::resp2::types::OwnedFrame;
use testcontainers::core::{ContainerPort, IntoContainerPort, WaitFor};
use testcontainers::runners::AsyncRunner;
use testcontainers::{ContainerAsync, GenericImage, ImageExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::paths::{free_port, TempDir};

/// Default image name for the Docker path.
pub const DEFAULT_IMAGE: &str = "ai-lb-redis:local";

/// How long one assertion-client command may take.
const CMD_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a Redis gets to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

enum Backend {
    Docker { container: Box<ContainerAsync<GenericImage>> },
    Local { child: Option<Child>, dir: TempDir, bin: String },
}

/// A running Redis server reachable at `127.0.0.1:<port>`.
pub struct RedisFixture {
    port: u16,
    backend: Backend,
    running: bool,
    /// `requirepass`, if the server was started with one.
    password: Option<String>,
}

/// Which backend [`RedisFixture::start`] should use.
fn is_ci() -> bool {
    std::env::var("CI").map(|v| v == "true" || v == "1").unwrap_or(false)
}

fn wanted_backend() -> Result<&'static str> {
    let ci = is_ci();
    match std::env::var("AI_LB_REDIS_BACKEND").ok().as_deref() {
        Some("docker") => return Ok("docker"),
        Some("local") => return Ok("local"),
        Some(other) if !other.is_empty() => {
            bail!("AI_LB_REDIS_BACKEND={other:?}: expected \"docker\" or \"local\"")
        }
        _ => {}
    }
    match docker_ping() {
        Ok(()) => Ok("docker"),
        Err(e) if ci => bail!(
            "CI=true but no Docker engine is reachable ({e:#}); the e2e tests must use the \
             testcontainers path in CI (set AI_LB_REDIS_BACKEND=local to override on purpose)"
        ),
        Err(_) => Ok("local"),
    }
}

/// The Docker engine's unix socket path, from `DOCKER_HOST` (unix:// only) or the default.
fn docker_socket() -> Result<String> {
    match std::env::var("DOCKER_HOST") {
        Ok(h) if !h.is_empty() => h.strip_prefix("unix://").map(str::to_string).ok_or_else(|| {
            anyhow!("DOCKER_HOST={h:?} is not a unix:// socket; only local engines are supported")
        }),
        _ => Ok("/var/run/docker.sock".to_string()),
    }
}

/// One raw HTTP/1.0 request to the engine API; returns (status, body).
fn docker_api(path: &str) -> Result<(u16, String)> {
    let sock = docker_socket()?;
    let mut s = std::os::unix::net::UnixStream::connect(&sock)
        .with_context(|| format!("connect to Docker engine at {sock}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: docker\r\n\r\n")?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| anyhow!("unexpected Docker API answer: {text:.200}"))?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}

/// Whether a Docker engine answers `/_ping`.
pub fn docker_ping() -> Result<()> {
    let (status, body) = docker_api("/_ping")?;
    if status == 200 {
        Ok(())
    } else {
        bail!("Docker /_ping answered {status}: {body:.200}")
    }
}

/// Whether the engine has `image` (name:tag) locally.
fn docker_has_image(image: &str) -> Result<bool> {
    let (status, body) = docker_api(&format!("/images/{image}/json"))?;
    match status {
        200 => Ok(true),
        404 => Ok(false),
        s => bail!("Docker image inspect {image} answered {s}: {body:.200}"),
    }
}

fn image_name() -> String {
    std::env::var("AI_LB_REDIS_IMAGE")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| DEFAULT_IMAGE.to_string())
}

impl RedisFixture {
    /// Starts a fresh, empty Redis (see the module docs for the backend choice).
    pub async fn start() -> Result<RedisFixture> {
        RedisFixture::start_with(None).await
    }

    /// Like [`RedisFixture::start`], with `requirepass` set (clients must AUTH).
    pub async fn start_with_password(password: &str) -> Result<RedisFixture> {
        RedisFixture::start_with(Some(password)).await
    }

    async fn start_with(password: Option<&str>) -> Result<RedisFixture> {
        let fixture = RedisFixture::start_chosen(password).await?;
        // Shown with a failing test's output: which backend the failure happened on.
        eprintln!("testkit: Redis ({}) at {}", fixture.backend(), fixture.addr());
        Ok(fixture)
    }

    async fn start_chosen(password: Option<&str>) -> Result<RedisFixture> {
        match wanted_backend()? {
            "docker" => {
                let forced = std::env::var("AI_LB_REDIS_BACKEND").is_ok_and(|v| v == "docker");
                if !forced && !is_ci() {
                    // Outside CI a developer without the image still gets a Redis, with a note.
                    let image = image_name();
                    let img = image.clone();
                    let has = tokio::task::spawn_blocking(move || docker_has_image(&img)).await?;
                    if !matches!(has, Ok(true)) {
                        eprintln!(
                            "testkit: Docker image {image} missing (build it with testkit/redis-image.sh); \
                             using a local redis-server instead"
                        );
                        return RedisFixture::start_local_with(password).await;
                    }
                }
                RedisFixture::start_docker_with(password).await
            }
            _ => RedisFixture::start_local_with(password).await,
        }
    }

    /// Starts Redis in a container of `$AI_LB_REDIS_IMAGE` through testcontainers.
    pub async fn start_docker() -> Result<RedisFixture> {
        RedisFixture::start_docker_with(None).await
    }

    /// [`RedisFixture::start_docker`], optionally with `requirepass`.
    pub async fn start_docker_with(password: Option<&str>) -> Result<RedisFixture> {
        let image = image_name();
        let ping = tokio::task::spawn_blocking(docker_ping).await?;
        ping.context("Docker engine not reachable")?;
        let img = image.clone();
        let has = tokio::task::spawn_blocking(move || docker_has_image(&img)).await??;
        if !has {
            bail!(
                "Docker is reachable but the Redis image {image:?} does not exist; no registry can be \
                 reached here, so build it first: `testkit/redis-image.sh {image}` \
                 (or set AI_LB_REDIS_IMAGE to an existing image)"
            );
        }
        let (name, tag) = match image.rsplit_once(':') {
            Some((n, t)) if !t.contains('/') => (n.to_string(), t.to_string()),
            _ => (image.clone(), "latest".to_string()),
        };
        let mut last_err = None;
        // The host port is chosen here (not by Docker) so a stopped and restarted container keeps
        // its address, which is baked into the gateway's config. A lost race for the port retries.
        for _ in 0..3 {
            let port = free_port()?;
            let mut request = GenericImage::new(name.clone(), tag.clone())
                .with_exposed_port(6379.tcp())
                .with_wait_for(WaitFor::message_on_stdout("Ready to accept connections"))
                .with_mapped_port(port, ContainerPort::Tcp(6379))
                .with_startup_timeout(READY_TIMEOUT);
            if let Some(pw) = password {
                // Same server settings as the image's CMD, plus the password.
                request = request.with_cmd(
                    [
                        "/usr/bin/redis-server",
                        "--protected-mode",
                        "no",
                        "--bind",
                        "0.0.0.0",
                        "--port",
                        "6379",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        "/data",
                        "--requirepass",
                        pw,
                    ]
                    .map(str::to_string),
                );
            }
            match request.start().await {
                Ok(container) => {
                    let mut fixture = RedisFixture {
                        port,
                        backend: Backend::Docker { container: Box::new(container) },
                        running: true,
                        password: password.map(str::to_string),
                    };
                    fixture.wait_ready().await?;
                    return Ok(fixture);
                }
                Err(e) => last_err = Some(anyhow!("start container {image}: {e}")),
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow!("start container {image}: unknown error")))
    }

    /// Starts a local `redis-server` process on a free port, without persistence.
    pub async fn start_local() -> Result<RedisFixture> {
        RedisFixture::start_local_with(None).await
    }

    /// [`RedisFixture::start_local`], optionally with `requirepass`.
    pub async fn start_local_with(password: Option<&str>) -> Result<RedisFixture> {
        let bin = redis_server_bin();
        let mut last_err = None;
        for _ in 0..3 {
            let port = free_port()?;
            let mut fixture = RedisFixture {
                port,
                backend: Backend::Local {
                    child: None,
                    dir: TempDir::new("ai-lb-redis")?,
                    bin: bin.clone(),
                },
                running: false,
                password: password.map(str::to_string),
            };
            fixture.spawn_local()?;
            match fixture.wait_ready().await {
                Ok(()) => return Ok(fixture),
                // Most likely the port was taken in the meantime: the drop kills the process.
                Err(e) => last_err = Some(e),
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow!("redis-server did not start")))
    }

    fn spawn_local(&mut self) -> Result<()> {
        let port = self.port;
        let Backend::Local { child, dir, bin } = &mut self.backend else {
            bail!("not a local Redis");
        };
        let mut extra = Vec::new();
        if let Some(pw) = &self.password {
            extra.extend(["--requirepass".to_string(), pw.clone()]);
        }
        let c = spawn_redis_server(bin, port, dir.path(), &extra)?;
        *child = Some(c);
        self.running = true;
        Ok(())
    }

    /// `"docker"` or `"local"`.
    pub fn backend(&self) -> &'static str {
        match self.backend {
            Backend::Docker { .. } => "docker",
            Backend::Local { .. } => "local",
        }
    }

    /// The host port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `"127.0.0.1:<port>"`, the endpoint string for the gateway's Redis cluster.
    pub fn endpoint(&self) -> String {
        self.addr().to_string()
    }

    /// Opens an assertion client (authenticated when the server has a password).
    pub async fn client(&self) -> Result<RedisClient> {
        let mut c = RedisClient::connect(self.addr()).await?;
        if let Some(pw) = &self.password {
            match c.cmd(&["AUTH", pw.as_str()]).await? {
                RedisValue::Status(s) if s == "OK" => {}
                other => bail!("AUTH failed: {other:?}"),
            }
        }
        Ok(c)
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut last = anyhow!("never tried");
        while Instant::now() < deadline {
            if let Backend::Local { child: Some(c), dir, .. } = &mut self.backend {
                if let Ok(Some(status)) = c.try_wait() {
                    let log =
                        std::fs::read_to_string(dir.path().join("redis.log")).unwrap_or_default();
                    bail!("redis-server exited at start ({status}): {log}");
                }
            }
            let ours = match &self.backend {
                Backend::Local { child: Some(c), .. } => Some(c.id()),
                _ => None,
            };
            match self.client().await {
                Ok(mut c) => match c.cmd(&["PING"]).await {
                    Ok(RedisValue::Status(s)) if s == "PONG" => match ours {
                        None => return Ok(()),
                        Some(pid) => match c.process_id().await {
                            Ok(answered) if answered == pid => return Ok(()),
                            // Another server holds the port; ours will fail to bind.
                            Ok(answered) => bail!("port {} is served by pid {answered}", self.port),
                            Err(e) => last = e,
                        },
                    },
                    Ok(other) => last = anyhow!("PING answered {other:?}"),
                    Err(e) => last = e,
                },
                Err(e) => last = e,
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(last.context(format!("Redis at {} not ready within {READY_TIMEOUT:?}", self.addr())))
    }

    /// Stops the server abruptly (SIGKILL): clients see refused connections until [`restart`].
    ///
    /// [`restart`]: RedisFixture::restart
    pub async fn stop(&mut self) -> Result<()> {
        match &mut self.backend {
            Backend::Docker { container } => {
                container.stop_with_timeout(Some(0)).await.context("stop Redis container")?;
            }
            Backend::Local { child, .. } => {
                if let Some(mut c) = child.take() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
            }
        }
        self.running = false;
        Ok(())
    }

    /// Starts the server again on the same port (empty: no persistence) and waits until it answers.
    pub async fn restart(&mut self) -> Result<()> {
        if self.running {
            self.stop().await?;
        }
        match &mut self.backend {
            Backend::Docker { container } => {
                container.start().await.context("restart Redis container")?;
                self.running = true;
            }
            Backend::Local { .. } => self.spawn_local()?,
        }
        self.wait_ready().await
    }

    /// Freezes the server without closing anything (`docker pause` / SIGSTOP): connections still
    /// open but no reply ever comes, so clients hit their own timeouts. Undo with [`unfreeze`].
    ///
    /// [`unfreeze`]: RedisFixture::unfreeze
    pub async fn freeze(&mut self) -> Result<()> {
        self.signal_or_pause(true).await
    }

    /// Lets a frozen server go on.
    pub async fn unfreeze(&mut self) -> Result<()> {
        self.signal_or_pause(false).await
    }

    async fn signal_or_pause(&mut self, freeze: bool) -> Result<()> {
        match &mut self.backend {
            Backend::Docker { container } => {
                if freeze {
                    container.pause().await.context("pause Redis container")?;
                } else {
                    container.unpause().await.context("unpause Redis container")?;
                }
            }
            Backend::Local { child, .. } => {
                let Some(c) = child.as_ref() else { bail!("Redis is not running") };
                let sig = if freeze { "-STOP" } else { "-CONT" };
                let status = Command::new("kill").args([sig, &c.id().to_string()]).status()?;
                if !status.success() {
                    bail!("kill {sig} {} failed", c.id());
                }
            }
        }
        Ok(())
    }

    /// Whether the server is (supposed to be) running.
    pub fn is_running(&self) -> bool {
        self.running
    }
}

/// The `redis-server` binary: `$AI_LB_REDIS_SERVER`, else `redis-server` from `PATH`.
pub(crate) fn redis_server_bin() -> String {
    std::env::var("AI_LB_REDIS_SERVER")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "redis-server".to_string())
}

/// Spawns `bin` on `127.0.0.1:port` without persistence, working in `dir` and logging to
/// `dir/redis.log`, with `extra` arguments first.
pub(crate) fn spawn_redis_server(
    bin: &str,
    port: u16,
    dir: &std::path::Path,
    extra: &[String],
) -> Result<Child> {
    let log = std::fs::File::create(dir.join("redis.log"))?;
    Command::new(bin)
        .args(extra)
        .args(["--port", &port.to_string()])
        .args(["--bind", "127.0.0.1"])
        .args(["--save", ""])
        .args(["--appendonly", "no"])
        .args(["--protected-mode", "no"])
        .arg("--dir")
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| {
            format!("spawn {bin} (install Debian's redis-server, or set AI_LB_REDIS_SERVER)")
        })
}

impl Drop for RedisFixture {
    fn drop(&mut self) {
        // The container is removed by testcontainers' own drop; the local process is killed here.
        if let Backend::Local { child, .. } = &mut self.backend {
            if let Some(mut c) = child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// A decoded Redis reply.
#[derive(Clone, Debug, PartialEq)]
pub enum RedisValue {
    /// `+OK`
    Status(String),
    /// `-ERR ...`
    Error(String),
    /// `:n`
    Int(i64),
    /// `$n ...` (None for the null bulk string)
    Bulk(Option<Vec<u8>>),
    /// `*n ...` (None for the null array)
    Array(Option<Vec<RedisValue>>),
}

impl RedisValue {
    fn from_frame(f: OwnedFrame) -> RedisValue {
        match f {
            OwnedFrame::SimpleString(s) => {
                RedisValue::Status(String::from_utf8_lossy(&s).into_owned())
            }
            OwnedFrame::Error(e) => RedisValue::Error(e.to_string()),
            OwnedFrame::Integer(i) => RedisValue::Int(i),
            OwnedFrame::BulkString(b) => RedisValue::Bulk(Some(b)),
            OwnedFrame::Array(a) => {
                RedisValue::Array(Some(a.into_iter().map(RedisValue::from_frame).collect()))
            }
            OwnedFrame::Null => RedisValue::Bulk(None),
        }
    }

    /// As text (status, bulk string, or integer).
    pub fn as_string(&self) -> Option<String> {
        match self {
            RedisValue::Status(s) => Some(s.clone()),
            RedisValue::Bulk(Some(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            RedisValue::Int(i) => Some(i.to_string()),
            _ => None,
        }
    }

    /// As an integer (integer reply, or a bulk string holding one).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            RedisValue::Int(i) => Some(*i),
            RedisValue::Bulk(Some(b)) => std::str::from_utf8(b).ok()?.trim().parse().ok(),
            _ => None,
        }
    }

    /// The elements of an array reply (empty for anything else).
    pub fn items(&self) -> Vec<RedisValue> {
        match self {
            RedisValue::Array(Some(a)) => a.clone(),
            _ => Vec::new(),
        }
    }
}

/// A minimal async Redis client (one connection, one command at a time, RESP2).
pub struct RedisClient {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl RedisClient {
    /// Connects to `addr`.
    pub async fn connect(addr: SocketAddr) -> Result<RedisClient> {
        let stream = tokio::time::timeout(CMD_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| anyhow!("connect to Redis {addr}: timeout"))?
            .with_context(|| format!("connect to Redis {addr}"))?;
        Ok(RedisClient { stream, buf: Vec::new() })
    }

    /// The `process_id` of the server at the other end (`INFO server`): which process a port
    /// really belongs to, when a just-freed port may have gone to another test's server.
    pub async fn process_id(&mut self) -> Result<u32> {
        let info = self.cmd(&["INFO", "server"]).await?;
        let text = info.as_string().ok_or_else(|| anyhow!("INFO server answered {info:?}"))?;
        text.lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .and_then(|pid| pid.trim().parse().ok())
            .ok_or_else(|| anyhow!("INFO server without a process_id"))
    }

    /// Sends one command and reads its reply. `-ERR` replies come back as [`RedisValue::Error`].
    pub async fn cmd<S: AsRef<[u8]>>(&mut self, args: &[S]) -> Result<RedisValue> {
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            let a = a.as_ref();
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
        tokio::time::timeout(CMD_TIMEOUT, self.roundtrip(&out))
            .await
            .map_err(|_| anyhow!("Redis command timed out"))?
    }

    async fn roundtrip(&mut self, out: &[u8]) -> Result<RedisValue> {
        self.stream.write_all(out).await?;
        loop {
            if let Some((frame, used)) =
                decode(&self.buf).map_err(|e| anyhow!("bad RESP: {e:?}"))?
            {
                self.buf.drain(..used);
                return Ok(RedisValue::from_frame(frame));
            }
            let mut chunk = [0u8; 16 * 1024];
            let n = self.stream.read(&mut chunk).await?;
            if n == 0 {
                bail!("Redis closed the connection");
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// All keys matching `pattern` (SCAN, so large databases are fine), sorted.
    pub async fn keys(&mut self, pattern: &str) -> Result<Vec<String>> {
        let mut cursor = "0".to_string();
        let mut keys = Vec::new();
        loop {
            let reply = self.cmd(&["SCAN", &cursor, "MATCH", pattern, "COUNT", "1000"]).await?;
            let items = reply.items();
            let (Some(next), Some(batch)) = (items.first(), items.get(1)) else {
                bail!("unexpected SCAN reply {reply:?}");
            };
            cursor = next.as_string().unwrap_or_else(|| "0".into());
            keys.extend(batch.items().iter().filter_map(RedisValue::as_string));
            if cursor == "0" {
                break;
            }
        }
        keys.sort();
        keys.dedup();
        Ok(keys)
    }

    /// The key's type (`string`, `hash`, `none`, ...).
    pub async fn key_type(&mut self, key: &str) -> Result<String> {
        Ok(self.cmd(&["TYPE", key]).await?.as_string().unwrap_or_default())
    }

    /// `GET key`.
    pub async fn get(&mut self, key: &str) -> Result<Option<String>> {
        Ok(self.cmd(&["GET", key]).await?.as_string())
    }

    /// `TTL key` in seconds (-1: no expiry, -2: no key).
    pub async fn ttl(&mut self, key: &str) -> Result<i64> {
        self.cmd(&["TTL", key]).await?.as_int().ok_or_else(|| anyhow!("TTL: not an integer"))
    }

    /// `HGETALL key` as (field, value) pairs.
    pub async fn hgetall(&mut self, key: &str) -> Result<Vec<(String, String)>> {
        let items = self.cmd(&["HGETALL", key]).await?.items();
        Ok(items
            .chunks(2)
            .filter_map(|p| Some((p.first()?.as_string()?, p.get(1)?.as_string()?)))
            .collect())
    }

    /// Every hash field in the database whose value is an integer, as (key, field, value):
    /// what the in-flight counters look like, whatever the exact key layout.
    pub async fn all_hash_counters(&mut self) -> Result<Vec<(String, String, i64)>> {
        let mut out = Vec::new();
        for key in self.keys("*").await? {
            if self.key_type(&key).await? == "hash" {
                for (field, value) in self.hgetall(&key).await? {
                    if let Ok(v) = value.trim().parse::<i64>() {
                        out.push((key.clone(), field, v));
                    }
                }
            }
        }
        Ok(out)
    }
}
