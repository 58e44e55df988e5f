//! A minimal HTTP/1.1 client for tests: one fresh TCP connection per request (so a client abort is
//! simply dropping that connection), a hard timeout on every request, bodies sent whole or in chunks.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _, Result};
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::{Body, Frame};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// Default per-request timeout used by the convenience helpers.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Header the test gateways add to every routed response (route `response_headers_to_add` with
/// `%UPSTREAM_HOST%`, see `GatewayConfig::to_json`): the upstream `ip:port` the router chose.
pub const UPSTREAM_HEADER: &str = "x-gateway-upstream-host";

/// A request to send.
#[derive(Clone, Debug)]
pub struct HttpRequest {
    /// Method, e.g. `GET`.
    pub method: String,
    /// Path and query, e.g. `/v1/chat/completions`.
    pub path: String,
    /// Extra headers (a `host` header is added when absent).
    pub headers: Vec<(String, String)>,
    /// Body; `None` sends a bodiless request (no content-length, no transfer-encoding).
    pub body: Option<Bytes>,
    /// When set, the body is sent in frames of this size with `chunk_delay` between them.
    pub chunk_size: Option<usize>,
    /// Pause between body frames (only with `chunk_size`).
    pub chunk_delay: Duration,
    /// Framed bodies go without `content-length` (HTTP/1.1 chunked transfer coding), as a client
    /// streaming a body of unknown size sends them.
    pub unsized_body: bool,
}

impl HttpRequest {
    /// A bodiless `GET`.
    pub fn get(path: &str) -> HttpRequest {
        HttpRequest {
            method: "GET".into(),
            path: path.into(),
            headers: Vec::new(),
            body: None,
            chunk_size: None,
            chunk_delay: Duration::ZERO,
            unsized_body: false,
        }
    }

    /// A `POST` with a raw body.
    pub fn post(path: &str, body: impl Into<Bytes>) -> HttpRequest {
        HttpRequest {
            method: "POST".into(),
            path: path.into(),
            headers: vec![("content-type".into(), "application/json".into())],
            body: Some(body.into()),
            chunk_size: None,
            chunk_delay: Duration::ZERO,
            unsized_body: false,
        }
    }

    /// A `POST` of a JSON value.
    pub fn post_json(path: &str, value: &serde_json::Value) -> HttpRequest {
        HttpRequest::post(path, value.to_string())
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: &str) -> HttpRequest {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sends the body in several frames (exercises the host's cumulative body buffering).
    pub fn chunked(mut self, chunk_size: usize, delay: Duration) -> HttpRequest {
        self.chunk_size = Some(chunk_size.max(1));
        self.chunk_delay = delay;
        self
    }

    /// Sends the body in frames without a `content-length` (chunked transfer coding).
    pub fn chunked_unsized(self, chunk_size: usize, delay: Duration) -> HttpRequest {
        HttpRequest { unsized_body: true, ..self.chunked(chunk_size, delay) }
    }
}

/// A complete response.
#[derive(Clone, Debug)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Response headers (names lower-case).
    pub headers: Vec<(String, String)>,
    /// The whole body.
    pub body: Bytes,
}

impl HttpResponse {
    /// First value of a header.
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str())
    }

    /// The upstream `ip:port` the gateway says served this response.
    pub fn upstream(&self) -> Option<String> {
        self.header(UPSTREAM_HEADER).map(str::to_string)
    }

    /// The body as (lossy) UTF-8.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body parsed as JSON.
    pub fn json(&self) -> Result<serde_json::Value> {
        serde_json::from_slice(&self.body)
            .with_context(|| format!("response body is not JSON: {:?}", self.text()))
    }
}

/// A body fed from a channel, one frame per message.
struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx.poll_recv(cx).map(|m| m.map(|b| Ok(Frame::data(b))))
    }
}

/// Builds a boxed body that yields `chunks` with `delay` between them, produced by a task.
pub fn chunked_body(chunks: Vec<Bytes>, delay: Duration) -> BoxBody<Bytes, Infallible> {
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        for (i, chunk) in chunks.into_iter().enumerate() {
            if i > 0 && !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            if tx.send(chunk).await.is_err() {
                return;
            }
        }
    });
    ChannelBody { rx }.boxed()
}

fn build(
    addr: SocketAddr,
    req: &HttpRequest,
) -> Result<hyper::Request<BoxBody<Bytes, Infallible>>> {
    let mut builder = hyper::Request::builder().method(req.method.as_str()).uri(req.path.as_str());
    let mut has_host = false;
    for (name, value) in &req.headers {
        has_host |= name.eq_ignore_ascii_case("host");
        builder = builder.header(name.as_str(), value.as_str());
    }
    if !has_host {
        builder = builder.header("host", addr.to_string());
    }
    let body = match (&req.body, req.chunk_size) {
        (None, _) => Empty::<Bytes>::new().boxed(),
        (Some(b), None) => Full::new(b.clone()).boxed(),
        (Some(b), Some(size)) => {
            // Keep an explicit content-length so the upstream sees the same framing a client
            // library would use for a known-size body.
            if !req.unsized_body {
                builder = builder.header("content-length", b.len().to_string());
            }
            let chunks = b.chunks(size).map(Bytes::copy_from_slice).collect();
            chunked_body(chunks, req.chunk_delay)
        }
    };
    builder.body(body).map_err(|e| anyhow!("bad request: {e}"))
}

/// A connected HTTP/1.1 client on one TCP connection; the connection task ends when dropped.
struct Conn {
    sender: hyper::client::conn::http1::SendRequest<BoxBody<Bytes, Infallible>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn connect(addr: SocketAddr) -> Result<Conn> {
    let stream = TcpStream::connect(addr).await.with_context(|| format!("connect to {addr}"))?;
    let _ = stream.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .context("http1 handshake")?;
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(Conn { sender, task })
}

/// Sends `req` to `addr` and reads the whole response, failing if it takes longer than `timeout`.
pub async fn send(addr: SocketAddr, req: HttpRequest, timeout: Duration) -> Result<HttpResponse> {
    let what = format!("{} {} to {addr}", req.method, req.path);
    match tokio::time::timeout(timeout, send_inner(addr, req)).await {
        Ok(r) => r.with_context(|| what.clone()),
        Err(_) => bail!("{what}: no complete response within {timeout:?} (request hangs)"),
    }
}

async fn send_inner(addr: SocketAddr, req: HttpRequest) -> Result<HttpResponse> {
    let mut conn = connect(addr).await?;
    let request = build(addr, &req)?;
    let resp = conn.sender.send_request(request).await.context("send request")?;
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.context("read response body")?.to_bytes();
    Ok(HttpResponse { status: parts.status.as_u16(), headers: headers_vec(&parts.headers), body })
}

fn headers_vec(map: &hyper::HeaderMap) -> Vec<(String, String)> {
    map.iter()
        .map(|(n, v)| (n.as_str().to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
        .collect()
}

/// `GET path` with the default timeout.
pub async fn get(addr: SocketAddr, path: &str) -> Result<HttpResponse> {
    send(addr, HttpRequest::get(path), DEFAULT_TIMEOUT).await
}

/// `POST path` of a JSON value with the default timeout.
pub async fn post_json(
    addr: SocketAddr,
    path: &str,
    value: &serde_json::Value,
) -> Result<HttpResponse> {
    send(addr, HttpRequest::post_json(path, value), DEFAULT_TIMEOUT).await
}

/// Where a client abort happens.
#[derive(Clone, Copy, Debug)]
pub enum AbortAt {
    /// Drop the connection this long after the request was sent, whether or not anything came back.
    After(Duration),
    /// Wait for the response headers and the first body frame, then drop the connection
    /// (a client that goes away mid-stream).
    FirstBodyFrame,
}

/// What the client saw before it aborted.
#[derive(Clone, Debug, Default)]
pub struct Aborted {
    /// Status, if response headers arrived before the abort.
    pub status: Option<u16>,
    /// The upstream header, if response headers arrived.
    pub upstream: Option<String>,
}

/// Sends `req`, then aborts the connection as `at` says. Fails only if the request cannot be sent
/// or (for [`AbortAt::FirstBodyFrame`]) nothing arrives within `timeout`.
pub async fn send_and_abort(
    addr: SocketAddr,
    req: HttpRequest,
    at: AbortAt,
    timeout: Duration,
) -> Result<Aborted> {
    let mut conn = connect(addr).await?;
    let request = build(addr, &req)?;
    let fut = conn.sender.send_request(request);
    match at {
        AbortAt::After(d) => {
            let mut seen = Aborted::default();
            tokio::select! {
                r = fut => {
                    // The response came before the abort point: note it, then still drop the
                    // connection at the abort point while the body is (maybe) streaming.
                    if let Ok(resp) = r {
                        seen.status = Some(resp.status().as_u16());
                        seen.upstream = resp.headers().get(UPSTREAM_HEADER)
                            .and_then(|v| v.to_str().ok()).map(str::to_string);
                        tokio::time::sleep(d).await;
                        drop(resp);
                    }
                }
                _ = tokio::time::sleep(d) => {}
            }
            drop(conn);
            Ok(seen)
        }
        AbortAt::FirstBodyFrame => {
            let work = async {
                let resp = fut.await.context("send request")?;
                let status = resp.status().as_u16();
                let upstream = resp
                    .headers()
                    .get(UPSTREAM_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string);
                let mut body = resp.into_body();
                let _ = body.frame().await;
                drop(body);
                Ok::<_, anyhow::Error>(Aborted { status: Some(status), upstream })
            };
            let seen = tokio::time::timeout(timeout, work)
                .await
                .map_err(|_| anyhow!("no response headers/first frame within {timeout:?}"))??;
            drop(conn);
            Ok(seen)
        }
    }
}
