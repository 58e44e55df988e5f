//! The HTTP stream: an Envoy-like filter chain with one wasm filter followed by the router.
//!
//! Request side: the filter's header action decides whether the headers are held
//! (StopIteration: body callbacks go on with the cumulative buffer; StopAll: the body is buffered
//! without callbacks and replayed to the filter once the headers are continued). The router picks
//! the upstream when the headers leave the filter: route match, cluster (`cluster_header` read at
//! that moment), then the override host (non-strict) or the cluster's LB.
//! Response side: the same for response headers/body; chunks are passed one by one (SSE).
//! At the end: `proxy_on_log`, `proxy_on_done`, `proxy_on_delete` (also on client disconnect and
//! upstream failure).

use crate::abi::headers::add_to;
use crate::abi::{HeaderAction, HeaderMap, LocalReply, RequestInfo, StreamState};
use crate::body::{BodyError, GwBody, ReaderCaughtUp};
use crate::cluster::Endpoint;
use crate::config::{FailurePolicy, HeaderLimits, Http2Config, ListenerTimers};
use crate::global::{Global, Shutdown};
use crate::worker::Worker;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// The route timeout, as Envoy's router sends it upstream.
const EXPECTED_TIMEOUT_HEADER: &str = "x-envoy-expected-rq-timeout-ms";

const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "upgrade",
    "trailer",
];

/// The streams in flight on one downstream connection, for its idle timeout.
#[derive(Default)]
struct ConnStreams {
    active: std::cell::Cell<usize>,
    /// When the last stream ended (or the connection opened).
    idle_since: std::cell::Cell<Option<tokio::time::Instant>>,
    changed: tokio::sync::Notify,
    /// The connection is to be reset (closed at once, with a TCP RST).
    reset: std::cell::Cell<bool>,
    /// An HTTP/2 connection that is closing: when Envoy's drain timeout ends (see
    /// `DownstreamIo::draining`).
    drain_until: std::cell::Cell<Option<tokio::time::Instant>>,
    /// A response started while the gateway drained: the connection closes after it (an
    /// HTTP/2 one starts its GOAWAY sequence).
    drain_close: std::cell::Cell<bool>,
}

/// One stream in flight on a connection (ends when dropped, after the plugin's on_delete).
struct ConnStream(Rc<ConnStreams>);

impl ConnStreams {
    fn enter(self: &Rc<Self>) -> ConnStream {
        self.active.set(self.active.get() + 1);
        self.changed.notify_one();
        ConnStream(self.clone())
    }

    /// When the connection's idle timeout fires (None while a stream is in flight).
    fn idle_deadline(&self, timeout: Option<Duration>) -> Option<tokio::time::Instant> {
        let since = self.idle_since.get()?;
        (self.active.get() == 0).then_some(since + timeout?)
    }
}

impl Drop for ConnStream {
    fn drop(&mut self) {
        let n = self.0.active.get().saturating_sub(1);
        self.0.active.set(n);
        if n == 0 {
            self.0.idle_since.set(Some(tokio::time::Instant::now()));
        }
        self.0.changed.notify_one();
    }
}

/// What a listener's connections are served with.
#[derive(Debug, Clone, Copy)]
pub struct ListenerOpts {
    /// `per_connection_buffer_limit_bytes`: the buffer limit of every HTTP/1 stream.
    pub buffer_limit: usize,
    pub timers: ListenerTimers,
    pub accept_http_10: bool,
    pub header_limits: HeaderLimits,
    /// HTTP/2 settings; `initial_stream_window_size` is also every HTTP/2 stream's buffer limit.
    pub http2: Http2Config,
    pub forwarding: crate::forwarded::ForwardingConfig,
    /// What a client on loopback is appended to `x-forwarded-for` as.
    pub node_address: std::net::IpAddr,
}

/// Envoy's HTTP connection manager with `codec_type: AUTO` (as Higress configures its
/// listeners) picks the codec from the connection's first read: HTTP/2 when it starts with the
/// first 12 bytes of the client preface (`PRI * HTTP/2`), else HTTP/1. A preface split across
/// reads goes to HTTP/1 there too.
const H2_PREFACE_START: &[u8] = b"PRI * HTTP/2";

/// Runs the futures hyper's HTTP/2 server spawns (its streams) on this worker's `LocalSet`: the
/// services hold the worker (`Rc`), so they cannot move to another thread.
#[derive(Clone, Copy)]
struct LocalExec;

impl<F> hyper::rt::Executor<F> for LocalExec
where
    F: Future + 'static,
{
    fn execute(&self, fut: F) {
        tokio::task::spawn_local(fut);
    }
}

/// Serve one downstream connection on this worker: HTTP/1.x, or HTTP/2 with prior knowledge.
pub async fn serve_connection(
    w: Rc<Worker>,
    mut stream: tokio::net::TcpStream,
    peer: SocketAddr,
    local: SocketAddr,
    opts: ListenerOpts,
) {
    let _ = stream.set_nodelay(true);
    let conn_id = w.next_connection_id();
    let shutdown = w.g.shutdown.clone();
    let streams = Rc::new(ConnStreams::default());
    streams.idle_since.set(Some(tokio::time::Instant::now()));
    let mut stop = shutdown.subscribe();
    // The first read picks the codec. Until it comes the connection is idle: the idle timeout
    // and the exit close it (as they close an idle HTTP/1 connection; a drain does not).
    let first = {
        let mut buf = vec![0u8; 16 * 1024];
        let idle_at = streams.idle_deadline(opts.timers.idle);
        tokio::select! {
            r = tokio::io::AsyncReadExt::read(&mut stream, &mut buf) => match r {
                Ok(n) if n > 0 => {
                    buf.truncate(n);
                    Bytes::from(buf)
                }
                _ => return,
            },
            _ = deadline_passed(idle_at) => return,
            _ = exited(&mut stop) => return,
        }
    };
    let h2 = first.starts_with(H2_PREFACE_START);
    let refused_http10 = Rc::new(std::cell::Cell::new(false));
    let conn_streams = streams.clone();
    let refused = refused_http10.clone();
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let w = w.clone();
        let in_flight = conn_streams.enter();
        let refused = refused.clone();
        let streams = conn_streams.clone();
        async move {
            if h2 && req.uri().authority().is_none() && !req.headers().contains_key("host") {
                // An HTTP/2 request with neither `:authority` nor `host`: Envoy 1.40's HTTP/2
                // codec resets the whole connection; no stream, no plugin context
                // (conformance test `http2_downstream_with_prior_knowledge`).
                drop(in_flight);
                streams.reset.set(true);
                streams.changed.notify_one();
                return std::future::pending().await;
            }
            // Counted as this connection's codec counts it, once.
            let overflow = header_overflow(&req, opts.header_limits, h2);
            if h2 && overflow {
                // Envoy's HTTP/2 codec resets the stream as it decodes the header block: no
                // response, no plugin callback (conformance test `request_header_limits`).
                drop(in_flight);
                return Err(HeaderOverflow);
            }
            let http10 = req.version() == hyper::Version::HTTP_10;
            let keep_alive = http10 && has_token(req.headers(), "connection", "keep-alive");
            let refusal = refusal_before_filters(&req, &opts, overflow);
            // (HTTP/2 has no `connection` header: the stream ends, the connection stays.)
            let close = !h2 && (refusal.is_some() || (http10 && !keep_alive));
            let low_version = refusal.as_ref().is_some_and(|r| r.status == 426);
            let conn = ConnInfo { peer, local, id: conn_id };
            let g = w.g.clone();
            let mut resp = handle(w, req, conn, opts, refusal, in_flight).await;
            // Envoy's HCM while its listeners drain (strategy immediate, as pilot-agent starts
            // Envoy): each response closes its connection, whenever the connection was opened.
            let drain_close = *g.shutdown.borrow() == Shutdown::Draining;
            if drain_close && h2 {
                streams.drain_close.set(true);
                streams.changed.notify_one();
                // Envoy sends its GOAWAY as it encodes the response headers, before them: the
                // connection's task (on this thread, woken above) starts the close first.
                for _ in 0..8 {
                    if streams.drain_until.get().is_some() {
                        break;
                    }
                    tokio::task::yield_now().await;
                }
            }
            // Envoy's HTTP/1 codec: `connection: close` on a response to an HTTP/1.0 request
            // without keep-alive, on these refusals and while draining (the connection closes
            // after it).
            if close || (drain_close && !h2) {
                resp.headers_mut()
                    .insert("connection", hyper::header::HeaderValue::from_static("close"));
                if http10 {
                    // Else hyper adds `keep-alive` for an HTTP/1.0 client that asked for it.
                    *resp.version_mut() = hyper::Version::HTTP_10;
                }
            }
            if low_version {
                refused.set(true);
            }
            Ok::<_, HeaderOverflow>(resp)
        }
    });
    let io = hyper_util::rt::TokioIo::new(DownstreamIo {
        inner: stream,
        first,
        refused_http10,
        streams: streams.clone(),
        drain_timer: None,
        ack_timer: None,
        frames: h2.then(|| Box::new(H2Frames::new())),
    });
    if h2 {
        let h = opts.http2;
        let conn = hyper::server::conn::http2::Builder::new(LocalExec)
            .timer(hyper_util::rt::TokioTimer::new())
            .max_concurrent_streams(h.max_concurrent_streams)
            .initial_stream_window_size(h.initial_stream_window_size)
            .initial_connection_window_size(h.initial_connection_window_size)
            // Room for every header list within the limits as HPACK counts it (32 bytes more a
            // field): the service applies the limits as Envoy counts them.
            .max_header_list_size(header_list_room(opts.header_limits))
            .serve_connection(io, svc);
        drive_connection(conn, |c| c.graceful_shutdown(), &streams, opts.timers, true, stop).await;
    } else {
        // Hyper's header-read timeout only runs with a timer; without one it is silently off.
        let conn = hyper::server::conn::http1::Builder::new()
            .keep_alive(true)
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(opts.timers.headers)
            // Hyper answers a head over these with a 431 of its own (no body): room past the
            // limits, which the service applies with Envoy's reply.
            .max_headers(opts.header_limits.count.saturating_mul(2))
            .max_buf_size(
                opts.header_limits.bytes.saturating_mul(2).max(crate::body::HYPER_MAX_BUF_SIZE),
            )
            .serve_connection(io, svc);
        drive_connection(conn, |c| c.graceful_shutdown(), &streams, opts.timers, false, stop).await;
    }
}

/// Resolves when the proxy exits (never, once no stop can come any more).
async fn exited(stop: &mut tokio::sync::watch::Receiver<Shutdown>) {
    if stop.wait_for(|s| *s == Shutdown::Cut).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Drives a served connection (`graceful` starts its graceful close) to its end, with the
/// connection idle timeout and the gateway's drain.
async fn drive_connection<C>(
    conn: C,
    graceful: impl Fn(Pin<&mut C>),
    streams: &ConnStreams,
    timers: ListenerTimers,
    h2: bool,
    mut stop: tokio::sync::watch::Receiver<Shutdown>,
) where
    C: Future<Output = hyper::Result<()>>,
{
    tokio::pin!(conn);
    // A graceful close was started: the connection ends once its streams have.
    let mut closing = false;
    let start_closing = |conn: Pin<&mut C>| {
        if h2 {
            streams.drain_until.set(Some(tokio::time::Instant::now() + timers.http2_drain));
        }
        graceful(conn);
    };
    loop {
        let idle_at = if closing { None } else { streams.idle_deadline(timers.idle) };
        tokio::select! {
            // Envoy's connection idle timeout: no stream for `idle_timeout_ms`. An HTTP/1
            // connection is closed at once; on HTTP/2 Envoy starts its drain sequence (GOAWAY),
            // as hyper's graceful close does.
            _ = deadline_passed(idle_at) => {
                tracing::debug!("downstream connection idle timeout");
                if !h2 {
                    return;
                }
                closing = true;
                start_closing(conn.as_mut());
            }
            _ = streams.changed.notified() => {
                if streams.reset.get() {
                    tracing::debug!("downstream connection reset");
                    return;
                }
                if streams.drain_close.get() && !closing {
                    closing = true;
                    start_closing(conn.as_mut());
                }
            }
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!("downstream connection error: {e}");
                }
                return;
            }
            changed = stop.changed() => {
                if changed.is_err() {
                    // No stop can come any more: serve to the end.
                    if let Err(e) = conn.as_mut().await {
                        tracing::debug!("downstream connection error: {e}");
                    }
                    return;
                }
                let now = *stop.borrow_and_update();
                match now {
                    // Dropping the connection ends its streams as a client abort would: the
                    // plugin's on_log/on_done/on_delete still run.
                    Shutdown::Cut => return,
                    // A drain leaves the connection as it is, idle or not: its next response
                    // closes it (Envoy 1.40 sends an idle connection nothing when its
                    // listeners start draining).
                    Shutdown::Draining | Shutdown::Running => {}
                }
            }
        }
    }
}

/// Whether `v` (a comma-separated header value of `name`) lists `token`.
fn has_token(h: &hyper::HeaderMap, name: &str, token: &str) -> bool {
    h.get_all(name).iter().any(|v| {
        v.to_str().is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    })
}

/// The requests Envoy's HTTP connection manager answers itself once the stream's filter chain
/// exists but before its first filter callback (`ActiveStream::decodeHeaders`): a header over
/// the listener's limits (431, with the status text as the body), an HTTP/1.0 request when the
/// listener does not accept HTTP/1.0 (426, likewise), then a request without a host (400, no
/// body; without `default_host_for_http_10` this includes an accepted HTTP/1.0 request without
/// `host`). The plugin's context is created and gets only `on_log`, `on_done` and `on_delete`
/// (conformance tests `request_header_limits`,
/// `http_1_0_and_a_missing_host_as_higress_configures_envoy`,
/// `http_1_0_refused_with_the_envoy_default`).
fn refusal_before_filters(
    req: &Request<Incoming>,
    opts: &ListenerOpts,
    header_overflow: bool,
) -> Option<LocalReply> {
    // Envoy's HTTP/1 codec, while it parses the header (an HTTP/2 stream over the limits was
    // reset before this).
    if header_overflow {
        return Some(local(431, "http1.headers_too_large", "Request Header Fields Too Large"));
    }
    // Envoy's HTTP/1 codec, when the request's headers are complete (`onHeadersCompleteBase`).
    let connection = req.headers().get_all("connection");
    if crate::forwarded::connection_header_refused(
        connection.iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')),
    ) {
        return Some(local(400, "http1.connection_header_rejected", "Bad Request"));
    }
    if req.version() == hyper::Version::HTTP_10 && !opts.accept_http_10 {
        return Some(local(426, "low_version", "Upgrade Required"));
    }
    if !req.headers().contains_key("host") && req.uri().authority().is_none() {
        return Some(local(400, "missing_host_header", ""));
    }
    None
}

/// Whether the request's header is over the listener's limits as Envoy's codec counts it.
/// HTTP/1: the head's bytes, from the request line to the blank line (Envoy 1.40's parser limits
/// the whole head; hyper keeps no raw head, so a header line is counted as `name: value` with
/// one space, as clients write it), and the headers. HTTP/2: the bytes of the names and values,
/// pseudo-headers included, and the fields.
fn header_overflow(req: &Request<Incoming>, limits: HeaderLimits, h2: bool) -> bool {
    let uri = req.uri();
    let h = req.headers();
    let fields: usize = h.iter().map(|(k, v)| k.as_str().len() + v.len()).sum();
    let path = uri.path_and_query().map_or(0, |p| p.as_str().len());
    let method = req.method().as_str().len();
    let (bytes, count) = if h2 {
        let pseudo = [
            Some(":method".len() + method),
            Some(":scheme".len() + uri.scheme_str().map_or(0, str::len)),
            uri.authority().map(|a| ":authority".len() + a.as_str().len()),
            Some(":path".len() + path),
        ];
        (fields + pseudo.iter().flatten().sum::<usize>(), h.len() + pseudo.iter().flatten().count())
    } else {
        // `GET <target> HTTP/1.1\r\n`, each `name: value\r\n`, then `\r\n`. An absolute-form
        // target carries its scheme and authority.
        let target = uri.scheme_str().map_or(0, |s| s.len() + "://".len())
            + uri.authority().map_or(0, |a| a.as_str().len())
            + path;
        let line = method + 1 + target + " HTTP/1.1\r\n".len();
        (line + fields + h.len() * ": \r\n".len() + "\r\n".len(), h.len())
    };
    bytes > limits.bytes || count > limits.count
}

/// Whether an upstream response's header is over the cluster's limits as Envoy's HTTP/1 codec
/// counts it: the head's bytes from the status line to the blank line (a header line counted as
/// `name: value`, as servers write it), and the headers.
fn response_header_overflow<B>(resp: &Response<B>, limits: HeaderLimits) -> bool {
    let h = resp.headers();
    let fields: usize = h.iter().map(|(k, v)| k.as_str().len() + v.len()).sum();
    let reason = resp
        .extensions()
        .get::<hyper::ext::ReasonPhrase>()
        .map(|r| r.as_bytes().len())
        .or_else(|| resp.status().canonical_reason().map(str::len))
        .unwrap_or(0);
    // `HTTP/1.1 200 OK\r\n`, each `name: value\r\n`, then `\r\n`.
    let line = "HTTP/1.1 200 ".len() + reason + "\r\n".len();
    let bytes = line + fields + h.len() * ": \r\n".len() + "\r\n".len();
    bytes > limits.bytes || h.len() > limits.count
}

/// SETTINGS_MAX_HEADER_LIST_SIZE for header lists within `limits` (RFC 9113 counts 32 bytes
/// more per field than Envoy does).
fn header_list_room(limits: HeaderLimits) -> u32 {
    let room = limits.bytes.saturating_add(limits.count.saturating_mul(32));
    u32::try_from(room).unwrap_or(u32::MAX)
}

/// What the service answers for an HTTP/2 request whose header is over the listener's limits:
/// hyper resets the stream with INTERNAL_ERROR, as Envoy's HTTP/2 codec does.
#[derive(Debug)]
struct HeaderOverflow;

impl std::fmt::Display for HeaderOverflow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("request header over the listener's limits")
    }
}

impl std::error::Error for HeaderOverflow {}

/// Envoy's default `delayed_close_timeout`: how long it waits for the client to close first
/// after it flushed its last bytes on a connection it closes.
const DELAYED_CLOSE: Duration = Duration::from_secs(1);

/// The downstream socket. Envoy's HTTP/1 codec answers an HTTP/1.0 request it refuses (426) with
/// an `HTTP/1.1` status line, where hyper answers every HTTP/1.0 request in HTTP/1.0: once the
/// service made that refusal (`refused_http10`), the next status line written says HTTP/1.1
/// (the same length; the connection closes after it).
struct DownstreamIo {
    inner: tokio::net::TcpStream,
    /// What the first read took (to pick the codec), read again first.
    first: Bytes,
    refused_http10: Rc<std::cell::Cell<bool>>,
    /// The connection's streams; `reset` makes dropping the socket an abortive close.
    streams: Rc<ConnStreams>,
    /// Runs until `streams.drain_until` plus the delayed close (see `draining`).
    drain_timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Runs until `streams.drain_until`, while PING acks are held (see `poll_read_h2`).
    ack_timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// An HTTP/2 connection's client bytes, cut into frames (None on HTTP/1).
    frames: Option<Box<H2Frames>>,
}

/// HTTP/2 frame types and flags the IO shim looks at.
const H2_FRAME_PING: u8 = 0x6;
const H2_FLAG_ACK: u8 = 0x1;
/// The client connection preface (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`) and a frame header.
const H2_PREFACE_LEN: usize = 24;
const H2_FRAME_HEADER_LEN: usize = 9;

/// What the client sent on an HTTP/2 connection, followed frame by frame, so that the PING acks
/// that come while the connection drains can be held back from hyper until the drain timeout
/// ends (see `DownstreamIo::draining`) while every other frame (a new stream's HEADERS) reaches
/// it at once.
struct H2Frames {
    /// Bytes of the client preface still to come.
    preface: usize,
    /// The header of the frame being read, while it is incomplete.
    head: [u8; H2_FRAME_HEADER_LEN],
    head_len: usize,
    /// How many of `head`'s bytes hyper has had (they were read while nothing was held; such
    /// a frame is never held: its start is gone).
    head_given: usize,
    /// Payload bytes of the current frame still to come.
    payload: usize,
    /// The current frame is held.
    holding: bool,
    /// Held frames (whole ones once `at_boundary`), for hyper when the drain timeout ends.
    held: Vec<u8>,
    /// Bytes for hyper that its reads did not take yet (they go before anything read later).
    ready: Vec<u8>,
}

impl H2Frames {
    fn new() -> Self {
        H2Frames {
            preface: H2_PREFACE_LEN,
            head: [0; H2_FRAME_HEADER_LEN],
            head_len: 0,
            head_given: 0,
            payload: 0,
            holding: false,
            held: Vec::new(),
            ready: Vec::new(),
        }
    }

    /// Between two frames: held frames may go to hyper here without cutting one in two.
    fn at_boundary(&self) -> bool {
        self.preface == 0 && self.head_len == 0 && self.payload == 0
    }

    /// Follows `input`, the next bytes from the client. With `out`, what hyper is to get goes
    /// there and, when `hold`, PING acks go to `held`. Without, `input` already went to hyper
    /// as it is: only valid when nothing is held (`hold` false) and no header bytes wait
    /// (`head_given == head_len`), as then every byte passes in order.
    fn follow(&mut self, mut input: &[u8], hold: bool, mut out: Option<&mut Vec<u8>>) {
        let mut give = |b: &[u8]| {
            if let Some(o) = out.as_deref_mut() {
                o.extend_from_slice(b);
            }
        };
        while !input.is_empty() {
            if self.preface > 0 {
                let n = self.preface.min(input.len());
                give(&input[..n]);
                self.preface -= n;
                input = &input[n..];
                continue;
            }
            if self.payload > 0 {
                let n = self.payload.min(input.len());
                if self.holding {
                    self.held.extend_from_slice(&input[..n]);
                } else {
                    give(&input[..n]);
                }
                self.payload -= n;
                input = &input[n..];
                continue;
            }
            let n = (H2_FRAME_HEADER_LEN - self.head_len).min(input.len());
            self.head[self.head_len..self.head_len + n].copy_from_slice(&input[..n]);
            self.head_len += n;
            input = &input[n..];
            if !hold {
                // Nothing to hold: the header's bytes need not wait for its type.
                give(&self.head[self.head_given..self.head_len]);
                self.head_given = self.head_len;
            }
            if self.head_len < H2_FRAME_HEADER_LEN {
                continue;
            }
            let h = self.head;
            self.payload = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
            // A PING ack (8 bytes of payload; any other size is hyper's error to find).
            self.holding = hold
                && self.head_given == 0
                && h[3] == H2_FRAME_PING
                && h[4] & H2_FLAG_ACK != 0
                && self.payload == 8;
            if self.holding {
                self.held.extend_from_slice(&h);
            } else {
                give(&h[self.head_given..]);
            }
            self.head_len = 0;
            self.head_given = 0;
        }
    }
}

impl Drop for DownstreamIo {
    fn drop(&mut self) {
        if self.streams.reset.get() {
            // SO_LINGER 0: the close sends a TCP RST instead of a FIN, as Envoy's reset of
            // the connection does.
            let _ = self.inner.set_zero_linger();
        }
    }
}

impl DownstreamIo {
    /// Pending until `then` past the end of a closing HTTP/2 connection's drain timeout. Envoy
    /// sends its first GOAWAY when the connection is to close, the second one after its
    /// `drain_timeout`, and closes the socket after its `delayed_close_timeout` (1 s) unless the
    /// client closed first; hyper's graceful close sends a GOAWAY and a PING, the second GOAWAY
    /// as soon as the PING's ack is read, and then closes. So while the drain runs the client's
    /// PING acks are held back (`poll_read_h2`; all else is read), and the close waits for the
    /// drain and the delayed close in any case (conformance test
    /// `http2_idle_timeout_and_drain`).
    fn draining(&mut self, cx: &mut std::task::Context<'_>, then: Duration) -> std::task::Poll<()> {
        let Some(until) = self.streams.drain_until.get() else { return std::task::Poll::Ready(()) };
        let at = until + then;
        let timer = self.drain_timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
        if timer.deadline() != at {
            timer.as_mut().reset(at);
        }
        timer.as_mut().poll(cx)
    }

    /// Whether the drain timeout of a closing HTTP/2 connection runs (then this task wakes when
    /// it ends). A timer of its own: `poll_shutdown` waits on `drain_timer` for a later time.
    fn acks_held(&mut self, cx: &mut std::task::Context<'_>) -> bool {
        let Some(until) = self.streams.drain_until.get() else { return false };
        let timer = self.ack_timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(until)));
        if timer.deadline() != until {
            timer.as_mut().reset(until);
        }
        timer.as_mut().poll(cx).is_pending()
    }

    /// A read on an HTTP/2 connection: everything the client sent, in order, except the PING
    /// acks that come while the connection drains; those follow once the drain timeout ended.
    /// Hyper's graceful close sends its second GOAWAY as soon as it reads the ack of the PING it
    /// sent with the first, where Envoy sends it after `drain_timeout`; a new stream that the
    /// client opens meanwhile is read and served at once, as Envoy serves it (the h2 crate
    /// accepts streams until its second GOAWAY; conformance test
    /// `http2_request_while_the_connection_drains`).
    fn poll_read_h2(
        &mut self,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        loop {
            let hold = self.acks_held(cx);
            let Some(f) = self.frames.as_deref_mut() else { return std::task::Poll::Ready(Ok(())) };
            if !hold && !f.held.is_empty() && f.at_boundary() {
                let held = std::mem::take(&mut f.held);
                f.ready.extend_from_slice(&held);
            }
            if !f.ready.is_empty() {
                let n = f.ready.len().min(buf.remaining());
                buf.put_slice(&f.ready[..n]);
                f.ready.drain(..n);
                return std::task::Poll::Ready(Ok(()));
            }
            let start = buf.filled().len();
            if !self.first.is_empty() {
                let n = self.first.len().min(buf.remaining());
                let head = self.first.split_to(n);
                buf.put_slice(&head);
            } else {
                std::task::ready!(tokio::io::AsyncRead::poll_read(
                    Pin::new(&mut self.inner),
                    cx,
                    buf
                ))?;
            }
            let Some(f) = self.frames.as_deref_mut() else { return std::task::Poll::Ready(Ok(())) };
            let new = &buf.filled()[start..];
            if new.is_empty() {
                // The client closed its side (or hyper's buffer is full).
                return std::task::Poll::Ready(Ok(()));
            }
            if !hold && !f.holding && f.head_given == f.head_len {
                // Nothing is held (not even the rest of a frame held before the drain timeout
                // ended): the bytes stay where they are.
                f.follow(new, false, None);
                return std::task::Poll::Ready(Ok(()));
            }
            let new = new.to_vec();
            buf.set_filled(start);
            let mut ready = std::mem::take(&mut f.ready);
            f.follow(&new, hold, Some(&mut ready));
            f.ready = ready;
            // Then to the top: hyper gets what passed, or (when all was held) the next read.
        }
    }

    fn rewrite(&self, buf: &[u8]) -> Option<Vec<u8>> {
        if !self.refused_http10.get() || !buf.starts_with(b"HTTP/1.0 ") {
            return None;
        }
        self.refused_http10.set(false);
        let mut v = buf.to_vec();
        v[7] = b'1';
        Some(v)
    }
}

impl tokio::io::AsyncRead for DownstreamIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.frames.is_some() {
            return self.poll_read_h2(cx, buf);
        }
        if !self.first.is_empty() {
            let n = self.first.len().min(buf.remaining());
            let head = self.first.split_to(n);
            buf.put_slice(&head);
            return std::task::Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for DownstreamIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.rewrite(buf) {
            Some(v) => Pin::new(&mut self.inner).poll_write(cx, &v),
            None => Pin::new(&mut self.inner).poll_write(cx, buf),
        }
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let first = bufs.iter().find(|b| !b.is_empty());
        match first.and_then(|b| self.rewrite(b)) {
            // Only the status line's buffer this time (a short write is allowed).
            Some(v) => Pin::new(&mut self.inner).poll_write(cx, &v),
            None => Pin::new(&mut self.inner).poll_write_vectored(cx, bufs),
        }
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.draining(cx, DELAYED_CLOSE).is_pending() {
            return std::task::Poll::Pending;
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The downstream connection a stream came on.
#[derive(Debug, Clone, Copy)]
struct ConnInfo {
    peer: SocketAddr,
    local: SocketAddr,
    id: u64,
}

async fn handle(
    w: Rc<Worker>,
    req: Request<Incoming>,
    conn: ConnInfo,
    opts: ListenerOpts,
    refusal: Option<LocalReply>,
    in_flight: ConnStream,
) -> Response<GwBody> {
    let (tx, rx) = oneshot::channel();
    tokio::task::spawn_local(async move {
        let mut d = Drive::new(w, &req, conn, opts, tx);
        d.idle = StreamIdle::new(opts.timers.stream_idle);
        d.refusal = refusal;
        d.run(req).await;
        drop(in_flight);
    });
    match rx.await {
        Ok(r) => r,
        Err(_) => simple_response(500, "stream aborted"),
    }
}

fn simple_response(status: u16, body: &str) -> Response<GwBody> {
    let mut r = Response::new(GwBody::full(Bytes::from(body.to_string())));
    *r.status_mut() =
        hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert("content-type", hyper::header::HeaderValue::from_static("text/plain"));
    r
}

type UpResult = Result<Response<Incoming>, UpError>;

#[derive(Debug)]
enum UpError {
    Connect,
    /// The upstream closed the connection before the response started.
    Terminated,
    Timeout,
    Other,
}

struct Upstream {
    body_tx: Option<mpsc::Sender<Result<Bytes, BodyError>>>,
    fut: Option<Pin<Box<dyn Future<Output = UpResult>>>>,
    result: Option<UpResult>,
    /// When the request started upstream (for `x-envoy-upstream-service-time`).
    started: tokio::time::Instant,
}

impl Drop for Upstream {
    /// An upstream request dropped before its body ended (client abort, local reply, trap) is
    /// reset, as Envoy does, instead of ending cleanly: a closed channel would end the chunked body
    /// and the upstream would take the truncated body for a complete one.
    fn drop(&mut self) {
        let Some(tx) = self.body_tx.take() else { return };
        let abort: BodyError = "request aborted before its body ended".into();
        if let Err(mpsc::error::TrySendError::Full(item)) = tx.try_send(Err(abort)) {
            tokio::spawn(async move {
                let _ = tx.send(item).await;
            });
        }
    }
}

/// Envoy's stream idle timer: re-armed by stream activity (request data received, response
/// headers or data sent); when it fires the stream gets 408 "stream timeout" if no response has
/// started, else a reset.
struct StreamIdle {
    timeout: Option<Duration>,
    deadline: tokio::time::Instant,
}

impl StreamIdle {
    fn new(timeout: Option<Duration>) -> StreamIdle {
        let mut t = StreamIdle { timeout, deadline: tokio::time::Instant::now() };
        t.touch();
        t
    }

    fn touch(&mut self) {
        if let Some(t) = self.timeout {
            self.deadline = tokio::time::Instant::now() + t;
        }
    }

    /// Resolves when the timer fires (never when it is off). Holds no borrow of the stream.
    fn expired(&self) -> impl Future<Output = ()> {
        deadline_passed(self.timeout.map(|_| self.deadline))
    }
}

/// Resolves at `at`, or never.
async fn deadline_passed(at: Option<tokio::time::Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// Envoy's local reply when the stream idle timer fires before a response started.
fn stream_timeout() -> LocalReply {
    local(408, "stream_idle_timeout", "stream timeout")
}

/// Envoy's local reply when the route timeout fires before the response headers.
fn route_timeout() -> LocalReply {
    local(504, "upstream_response_timeout", "upstream request timeout")
}

/// Decrements the endpoint's active count when the upstream request ends.
struct ActiveGuard(Arc<Endpoint>);
impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The direction a filter iteration drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    /// Decoding: client to upstream.
    Request,
    /// Encoding: upstream (or local reply) to client.
    Response,
}

impl Dir {
    fn headers_callback(self) -> &'static str {
        match self {
            Dir::Request => "proxy_on_request_headers",
            Dir::Response => "proxy_on_response_headers",
        }
    }
    fn body_callback(self) -> &'static str {
        match self {
            Dir::Request => "proxy_on_request_body",
            Dir::Response => "proxy_on_response_body",
        }
    }
}

/// The stream's parts of one direction, as the filter iteration reads them.
impl StreamState {
    fn headers(&self, dir: Dir) -> &HeaderMap {
        match dir {
            Dir::Request => &self.req_headers,
            Dir::Response => &self.resp_headers,
        }
    }
    fn body(&mut self, dir: Dir) -> &mut bytes::BytesMut {
        match dir {
            Dir::Request => &mut self.req_body,
            Dir::Response => &mut self.resp_body,
        }
    }
    fn body_len(&self, dir: Dir) -> usize {
        match dir {
            Dir::Request => self.req_body.len(),
            Dir::Response => self.resp_body.len(),
        }
    }
    /// Where the plugin's view of the body starts (see `StreamState::req_body_from`).
    fn body_from(&mut self, dir: Dir) -> &mut usize {
        match dir {
            Dir::Request => &mut self.req_body_from,
            Dir::Response => &mut self.resp_body_from,
        }
    }
    fn limit(&self, dir: Dir) -> usize {
        match dir {
            Dir::Request => self.decoder_limit,
            Dir::Response => self.encoder_limit,
        }
    }
    fn set_headers_access(&mut self, dir: Dir, on: bool) {
        match dir {
            Dir::Request => self.req_hdr_access = on,
            Dir::Response => self.resp_hdr_access = on,
        }
    }
    fn set_body_access(&mut self, dir: Dir, on: bool) {
        match dir {
            Dir::Request => self.req_body_access = on,
            Dir::Response => self.resp_body_access = on,
        }
    }
    /// The deferred `continue_stream` of this direction.
    fn continue_flag(&mut self, dir: Dir) -> &mut bool {
        match dir {
            Dir::Request => &mut self.continue_req,
            Dir::Response => &mut self.continue_resp,
        }
    }
}

/// Where one direction's filter iteration stands.
struct Iteration {
    /// The body still being read (None once it ended, or when the headers ended the stream).
    body: Option<Incoming>,
    /// All of the body is in the buffer.
    body_done: bool,
    /// The filter holds the headers.
    held: bool,
    /// ... and buffers the body without callbacks until it continues (StopAll).
    stop_all: bool,
    /// The last body callback stopped: the data stays buffered.
    data_stopped: bool,
    /// Stopped for good by a Stop after a `continue_stream` inside the headers callback: the
    /// body is buffered, never passed on nor shown to the plugin.
    wedged: bool,
    /// Request trailers came (HTTP/2) while the filter did not take callbacks (StopAll): they
    /// go to the plugin after the replayed body.
    trailers_pending: bool,
    /// The filter manager has a local reply (413) prepared: the data callback still runs, but
    /// its answer releases nothing, so the router never sees the request (Envoy sends the
    /// prepared reply before iterating on).
    reply_prepared: bool,
}

/// How a direction's iteration ended.
enum Flow {
    /// The request went upstream; its response (or failure).
    Upstream(Box<UpResult>),
    /// A local reply is to be sent (plugin, limits, failures).
    Local(LocalReply),
    /// The stream is reset (plugin `close_stream`, a broken body).
    Reset,
    /// Nothing more to send: the response is complete, or the client went away.
    Over,
}

/// How a data callback stopped the body (Envoy's `FilterDataStatus`, by the plugin's answer).
#[derive(Clone, Copy, PartialEq, Eq)]
enum DataStop {
    /// Continue, or an answer that does not stop the data.
    NotStopped,
    /// StopIterationAndBuffer: Envoy's wasm filter adds the next data to the buffer (and checks
    /// the limit) before it calls the plugin again.
    Buffer,
    /// StopIterationAndWatermark: past the buffer limit Envoy applies flow control (stops
    /// reading) instead of a 413/500 local reply.
    Watermark,
    /// StopIterationNoBuffer: Envoy's filter manager neither passes that data on nor keeps it
    /// (see `Drive::on_data`).
    NoBuffer,
}

impl DataStop {
    fn from_raw(raw: i32) -> DataStop {
        match raw {
            1 => DataStop::Buffer,
            2 => DataStop::Watermark,
            3 => DataStop::NoBuffer,
            _ => DataStop::NotStopped,
        }
    }
}

struct Drive {
    w: Rc<Worker>,
    ctx: u32,
    gen: Option<u64>,
    st: Arc<Mutex<StreamState>>,
    notify: Arc<tokio::sync::Notify>,
    resp_tx: Option<oneshot::Sender<Response<GwBody>>>,
    down: Option<mpsc::Sender<Result<Bytes, BodyError>>>,
    upstream: Option<Upstream>,
    pending_req: Option<hyper::http::request::Builder>,
    /// The routed cluster's limits on its response headers.
    response_limits: Option<HeaderLimits>,
    endpoint: Option<Arc<Endpoint>>,
    active: Option<ActiveGuard>,
    timeout: Duration,
    /// The route timeout's deadline: set when the router has the whole request.
    route_deadline: Option<tokio::time::Instant>,
    idle: StreamIdle,
    trapped: bool,
    /// How the last data callback stopped the body, if it did.
    data_stop: DataStop,
    /// Reports when hyper took every chunk sent to the client (see `abort_downstream`).
    down_caught_up: Option<Arc<ReaderCaughtUp>>,
    /// Bytes of the response's `content-length` not sent yet (see `flush_response`).
    down_owed: Option<u64>,
    /// The same for the request's (see `flush_request`).
    req_owed: Option<u64>,
    /// Answered by the connection manager before the filter's first callback (see
    /// `refusal_before_filters`).
    refusal: Option<LocalReply>,
    /// The downstream stream is HTTP/2.
    h2: bool,
    /// The whole request came from the client (its end of stream was read).
    req_done: bool,
    /// Counts this stream in [`Global::live_streams`] until it is dropped (after `finish`).
    _live: LiveStream,
}

/// One live stream in [`Global::live_streams`] (the drain waits for them).
struct LiveStream(Arc<Global>);
impl LiveStream {
    fn new(g: &Arc<Global>) -> LiveStream {
        g.live_streams.fetch_add(1, Ordering::Relaxed);
        LiveStream(g.clone())
    }
}
impl Drop for LiveStream {
    fn drop(&mut self) {
        self.0.live_streams.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Envoy's local reply when a buffer held by the filter goes over the buffer limit: 413 for the
/// request, 500 for the response (a reset once the response headers went out).
fn payload_too_large(dir: Dir) -> LocalReply {
    match dir {
        Dir::Request => local(413, "request_payload_too_large", "Payload Too Large"),
        Dir::Response => local(500, "response_payload_too_large", "Internal Server Error"),
    }
}

/// What Envoy's `failStream` sends when the plugin failed under a stream (fail-closed).
fn wasm_fail_stream() -> LocalReply {
    local(503, "wasm_fail_stream", "")
}

fn local(status: u16, details: &str, body: &str) -> LocalReply {
    LocalReply {
        status,
        details: details.to_string(),
        body: Bytes::from(body.to_string()),
        headers: Vec::new(),
    }
}

/// Route match: first route whose prefix matches the path and whose host (if any) equals the
/// authority without port.
pub fn match_route(
    routes: &[crate::config::RouteConfig],
    path: &str,
    authority: &str,
) -> Option<usize> {
    let host = authority
        .rsplit_once(':')
        .map(|(h, p)| if p.chars().all(|c| c.is_ascii_digit()) { h } else { authority })
        .unwrap_or(authority);
    routes.iter().position(|r| {
        let prefix_ok = path.starts_with(r.match_.prefix.as_deref().unwrap_or("/"));
        let host_ok = r.match_.host.as_deref().is_none_or(|h| h.eq_ignore_ascii_case(host));
        prefix_ok && host_ok
    })
}

fn header_value(h: &HeaderMap, name: &str) -> Option<String> {
    crate::global::header_bytes(h, name).map(|v| String::from_utf8_lossy(v).into_owned())
}

impl Drive {
    fn new(
        w: Rc<Worker>,
        req: &Request<Incoming>,
        conn: ConnInfo,
        opts: ListenerOpts,
        resp_tx: oneshot::Sender<Response<GwBody>>,
    ) -> Drive {
        w.g.stats.requests_total.fetch_add(1, Ordering::Relaxed);
        let h2 = req.version() == hyper::Version::HTTP_2;
        let host = req.headers().get("host").and_then(|v| v.to_str().ok()).map(str::to_string);
        let uri_authority = req.uri().authority().map(|a| a.to_string());
        // Envoy's header maps keep `host` as `:authority` (a lookup of `host` finds it). Over
        // HTTP/1 it is the `Host` header (an absolute-form target's authority without one). Over
        // HTTP/2 it is `:authority`; Envoy 1.40's HTTP/2 codec discards a `host` header sent
        // next to it, and takes `host` when `:authority` is missing (conformance test
        // `http2_downstream_with_prior_knowledge`).
        let authority =
            if h2 { uri_authority.or(host) } else { host.or(uri_authority) }.unwrap_or_default();
        let path = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into());
        let method = req.method().as_str().to_string();
        // HTTP/1 has no scheme on the wire: Envoy sets the connection's (`http`, no TLS here).
        // An HTTP/2 client sends `:scheme`, which Envoy keeps.
        let scheme = match req.uri().scheme_str() {
            Some(s) if h2 => s.to_string(),
            _ => "http".to_string(),
        };
        let mut headers: HeaderMap = vec![
            (":authority".into(), authority.clone().into_bytes()),
            (":path".into(), path.clone().into_bytes()),
            (":method".into(), method.into_bytes()),
            (":scheme".into(), scheme.into_bytes()),
        ];
        // Envoy's codecs add each received header to the map as a plugin's add does: a
        // repeated inline header becomes one entry (`a,b`; conformance test
        // `add_header_map_value_to_inline_headers`).
        for (k, v) in req.headers() {
            if k == "host" {
                continue;
            }
            add_to(0, &mut headers, k.as_str().to_string(), v.as_bytes().to_vec());
        }
        // Envoy (`proxy_100_continue` off, its default and Higress's) answers `expect:
        // 100-continue` itself and removes the header before the filters: neither the plugin
        // nor the upstream sees it (conformance test `expect_100_continue`). Here hyper sends
        // the 100 over HTTP/1 when the body is first read; over HTTP/2 it sends none.
        headers.retain(|(k, v)| !(k == "expect" && v.eq_ignore_ascii_case(b"100-continue")));
        let source = crate::forwarded::mutate_request_headers(
            &mut headers,
            &opts.forwarding,
            conn.peer,
            opts.node_address,
        );
        let info = RequestInfo {
            // Envoy's protocol names (`Http::Utility::getProtocolString`).
            protocol: match req.version() {
                hyper::Version::HTTP_10 => "HTTP/1.0",
                hyper::Version::HTTP_2 => "HTTP/2",
                _ => "HTTP/1.1",
            }
            .into(),
            time: std::time::SystemTime::now(),
            source,
            destination: conn.local,
            connection_id: conn.id,
        };
        let ctx = w.new_ctx_id();
        let mut st = StreamState::new(ctx, headers, info);
        // Envoy gives every stream its codec stream's buffer limit, both directions: on HTTP/1
        // the connection's (`per_connection_buffer_limit_bytes`), on HTTP/2 the stream window
        // (`initial_stream_window_size`; conformance test `http2_held_body_and_the_buffer_limit`).
        let buffer_limit =
            if h2 { opts.http2.initial_stream_window_size as usize } else { opts.buffer_limit };
        st.decoder_limit = buffer_limit;
        st.encoder_limit = buffer_limit;
        let route = match_route(&w.g.routes, &path, &authority);
        st.route = route;
        if let Some(r) = route.and_then(|i| w.g.routes.get(i)) {
            st.route_name = r.name.clone();
            st.cluster_name = match (&r.cluster_header, &r.cluster) {
                (Some(h), _) => header_value(&st.req_headers, &h.to_ascii_lowercase())
                    .or(r.cluster.clone())
                    .unwrap_or_default(),
                (None, Some(c)) => c.clone(),
                _ => String::new(),
            };
        }
        let notify = st.notify.clone();
        let st = Arc::new(Mutex::new(st));
        let gen = w.register_stream(ctx, &st);
        let live = LiveStream::new(&w.g);
        Drive {
            w,
            ctx,
            gen,
            st,
            notify,
            resp_tx: Some(resp_tx),
            down: None,
            upstream: None,
            pending_req: None,
            response_limits: None,
            endpoint: None,
            active: None,
            timeout: Duration::ZERO,
            route_deadline: None,
            idle: StreamIdle::new(None),
            trapped: false,
            data_stop: DataStop::NotStopped,
            down_caught_up: None,
            down_owed: None,
            req_owed: None,
            refusal: None,
            h2,
            req_done: false,
            _live: live,
        }
    }

    fn plugin(&self) -> bool {
        !self.trapped && self.gen.is_some_and(|g| self.w.vm_alive(g))
    }

    /// The plugin VM died under this stream (trap here or elsewhere on this worker).
    fn orphaned(&self) -> bool {
        self.gen.is_some() && !self.plugin()
    }

    /// Call a stream callback. Ok(None) if there is no plugin; Err on a trap, and for every
    /// callback of a stream whose VM failed (a trap here or in another stream of this worker),
    /// under FAIL_CLOSED, FAIL_RELOAD and the default: in Envoy 1.40 a stream that already has
    /// its plugin context fails with it (503 `wasm_fail_stream`, a reset once the response
    /// headers went out). Under FAIL_OPEN (Higress's `failStrategy: FAIL_OPEN`, which its istio
    /// deploys as Envoy's legacy `fail_open: true`) such a callback answers Ok(None) instead:
    /// the trapping stream and the streams in flight go on without the plugin. Either way a
    /// stream held waiting for the plugin (a callout) stays held, as nothing calls it any more
    /// (conformance tests `a_trap_under_*_and_the_streams_in_flight`).
    fn call(&mut self, name: &str, args: &[i32]) -> Result<Option<(i32, bool)>, ()> {
        let fail = || match self.w.failure_policy() {
            FailurePolicy::FailOpen => Ok(None),
            FailurePolicy::FailClosed | FailurePolicy::FailReload => Err(()),
        };
        if self.orphaned() {
            return fail();
        }
        if !self.plugin() {
            return Ok(None);
        }
        match self.w.vm_call(self.ctx, name, args) {
            Ok((r, l)) => Ok(Some((r.unwrap_or(0), l))),
            Err(_) => {
                self.trapped = true;
                fail()
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StreamState> {
        match self.st.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn header_action(&mut self, name: &str, n: usize, eos: bool) -> Result<HeaderAction, ()> {
        let abi = self.w.abi();
        match self.call(name, &[self.ctx as i32, n as i32, eos as i32])? {
            None => Ok(HeaderAction::Continue),
            Some((raw, local)) => Ok(HeaderAction::from_raw(raw, abi, local)),
        }
    }

    /// Returns true if the data callback said Continue.
    fn data_action(&mut self, name: &str, len: usize, eos: bool) -> Result<bool, ()> {
        self.data_stop = DataStop::NotStopped;
        match self.call(name, &[self.ctx as i32, len as i32, eos as i32])? {
            None => Ok(true),
            Some((_, true)) => Ok(false),
            Some((raw, false)) => {
                self.data_stop = DataStop::from_raw(raw);
                Ok(raw == 0)
            }
        }
    }

    async fn run(mut self, req: Request<Incoming>) {
        let (_parts, body) = req.into_parts();
        {
            use hyper::body::Body;
            self.req_done = body.is_end_stream();
        }
        let mut via_filter = true;
        let failed = self.w.fails_streams()
            || (self.plugin()
                && self
                    .call(
                        "proxy_on_context_create",
                        &[self.ctx as i32, self.w.root_id().unwrap_or(0) as i32],
                    )
                    .is_err());
        let flow = if failed {
            Flow::Local(wasm_fail_stream())
        } else if let Some(lr) = self.refusal.take() {
            // Answered before the filter's first callback: no response callbacks either.
            via_filter = false;
            if matches!(lr.status, 426 | 431) {
                // Envoy's HTTP/1 codec refuses these while parsing, before the request headers
                // reach the connection manager: `on_log` sees an empty request header map.
                self.lock().req_headers.clear();
            }
            Flow::Local(lr)
        } else {
            match self.iterate(Dir::Request, body).await {
                Flow::Upstream(r) => match *r {
                    Ok(resp) => {
                        // From here on a local reply bypasses the filter (see `local_reply`).
                        via_filter = false;
                        let body = self.response_arrived(resp);
                        self.idle.touch();
                        self.iterate(Dir::Response, body).await
                    }
                    Err(e) => Flow::Upstream(Box::new(Err(e))),
                },
                other => other,
            }
        };
        match flow {
            // (The response direction never ends with an upstream response.)
            Flow::Upstream(r) => {
                let Err(e) = *r else { return self.finish() };
                let lr = match e {
                    // Envoy 1.40's reset reason for a refused connection (conformance test
                    // `forwarded_headers_and_route_response_headers`).
                    UpError::Connect => local(503, "upstream_reset_before_response_started{remote_connection_failure}", "upstream connect error or disconnect/reset before headers. reset reason: remote connection failure"),
                    UpError::Terminated => local(503, "upstream_reset_before_response_started{connection_termination}", "upstream connect error or disconnect/reset before headers. reset reason: connection termination"),
                    UpError::Timeout => route_timeout(),
                    UpError::Other => local(502, "upstream_reset_before_response_started{protocol_error}", "upstream connect error or disconnect/reset before headers. reset reason: protocol error"),
                };
                self.upstream = None;
                self.active = None;
                self.local_reply(lr, true).await;
            }
            Flow::Local(lr) => {
                self.upstream = None;
                self.active = None;
                self.local_reply(lr, via_filter).await
            }
            Flow::Reset => self.abort_downstream().await,
            Flow::Over => {}
        }
        // Let the connection task write what the stream handed it (the response's last bytes)
        // before on_log runs: the plugin's log-phase work (e.g. a Redis release) then overlaps
        // the client's next request instead of delaying this response. The plugin cannot tell.
        tokio::task::yield_now().await;
        self.finish();
    }

    fn finish(&mut self) {
        self.upstream = None;
        self.active = None;
        if self.plugin() {
            let ctx = self.ctx as i32;
            // Envoy: log, then onDestroy -> on_done, then on_delete. `on_log` runs in the
            // access-log phase: request and response headers readable, nothing writable.
            self.lock().log_phase = true;
            let logged = self.call("proxy_on_log", &[ctx]).is_ok();
            self.lock().log_phase = false;
            if logged && self.call("proxy_on_done", &[ctx]).is_ok() {
                let _ = self.call("proxy_on_delete", &[ctx]);
            }
        }
        if let Some(g) = self.gen {
            self.w.unregister_stream(self.ctx, g);
        }
    }

    /// The upstream's response headers become the stream's response headers; returns its body.
    fn response_arrived(&mut self, resp: Response<Incoming>) -> Incoming {
        let (parts, body) = resp.into_parts();
        let mut s = self.lock();
        let mut h: HeaderMap = vec![(":status".into(), parts.status.as_str().as_bytes().to_vec())];
        for (k, v) in parts.headers.iter() {
            add_to(2, &mut h, k.as_str().to_string(), v.as_bytes().to_vec());
        }
        // Envoy's router adds how long the upstream took to its response headers (Higress
        // keeps Envoy's headers: `disableXEnvoyHeaders` is off by default).
        if let Some(u) = &self.upstream {
            h.retain(|(k, _)| k != "x-envoy-upstream-service-time");
            let ms = u.started.elapsed().as_millis().to_string();
            h.push(("x-envoy-upstream-service-time".into(), ms.into_bytes()));
        }
        s.resp_headers = h;
        s.response_code = Some(parts.status.as_u16());
        s.resp_hdr_access = true;
        drop(s);
        self.add_route_response_headers();
        body
    }

    /// The route's `response_headers_to_add`, as Envoy adds them to every response of a routed
    /// stream (the router's `finalizeResponseHeaders`, also in the filter manager's local
    /// replies) before the filters' response callbacks.
    fn add_route_response_headers(&self) {
        let mut s = self.lock();
        if s.route.is_none() {
            return;
        }
        let StreamState { resp_headers, upstream_host, .. } = &mut *s;
        self.w.g.response_headers_to_add.apply(resp_headers, upstream_host.as_deref());
    }

    // ------------------------------------------------------------ filter iteration

    /// One direction of the stream through the filter, as Envoy's filter manager iterates it:
    /// the headers callback, then a body callback per data frame the codec delivers
    /// (`end_of_stream=false`) and one more when the message ends (`end_of_stream=true`, with no
    /// new data, as Envoy's HTTP/1 codec reports the end of a body); what the filter lets go is
    /// passed on (request: to the router and upstream; response: to the client). Held headers
    /// (StopIteration) let body callbacks go on with the cumulative buffer; StopAll buffers the
    /// body without callbacks and replays it once the headers are continued.
    async fn iterate(&mut self, dir: Dir, body: Incoming) -> Flow {
        use hyper::body::Body;
        let headers_eos = body.is_end_stream();
        let mut it = Iteration {
            body: (!headers_eos).then_some(body),
            body_done: headers_eos,
            held: false,
            stop_all: false,
            data_stopped: false,
            wedged: false,
            trailers_pending: false,
            reply_prepared: false,
        };
        let n = self.lock().headers(dir).len();
        let action = match self.header_action(dir.headers_callback(), n, headers_eos) {
            Ok(a) => a,
            Err(()) => return Flow::Local(wasm_fail_stream()),
        };
        it.held = action != HeaderAction::Continue;
        it.stop_all = action == HeaderAction::StopAll;
        // `continue_stream` inside the headers callback that then answers Stop: Envoy runs the
        // continue right after the callback, while the filter is not stopped yet, so the headers
        // go on to the next filter; the Stop then stops the filter for good: the body is never
        // passed on nor shown to the plugin, the peer waits (until it or a timeout gives up).
        // (With a Continue answer Envoy passes the headers on twice; not modelled.)
        if it.stop_all && !headers_eos && std::mem::take(self.lock().continue_flag(dir)) {
            it.held = false;
            it.data_stopped = true;
            it.wedged = true;
        }
        if !it.held {
            // Envoy drops its pointer to headers a callback continued.
            self.lock().set_headers_access(dir, false);
            if let Err(f) = self.release_headers(dir, headers_eos) {
                return f;
            }
            // The router sends the headers upstream at once.
            if it.wedged && dir == Dir::Request {
                if let Some(f) = self.flush_request(Bytes::new(), false).await {
                    return f;
                }
            }
        }
        loop {
            // Deferred actions applied after the last VM call.
            {
                let mut s = self.lock();
                if let Some(lr) = s.local_reply.take() {
                    return Flow::Local(lr);
                }
                if s.reset {
                    return Flow::Reset;
                }
            }
            let cont = std::mem::take(self.lock().continue_flag(dir));
            if cont {
                if self.data_stop == DataStop::Buffer {
                    self.data_stop = DataStop::NotStopped;
                }
                if it.held {
                    it.held = false;
                    if let Err(f) = self.release_headers(dir, headers_eos) {
                        return f;
                    }
                    let buffered = !self.lock().body(dir).is_empty();
                    let trailers = std::mem::take(&mut it.trailers_pending);
                    if it.stop_all && (buffered || it.body_done) && !headers_eos {
                        // StopAll: replay the buffered body to the filter now, then the
                        // trailers (Envoy's `commonContinue`: the data without the end of
                        // stream when trailers follow, no data callback when none is held).
                        if buffered || !trailers {
                            let eos = it.body_done && !trailers;
                            if let Err(f) = self.on_data(dir, &mut it, eos) {
                                return f;
                            }
                        }
                        if trailers {
                            if let Err(f) = self.on_request_trailers(&mut it) {
                                return f;
                            }
                        }
                        continue;
                    }
                }
                it.data_stopped = false;
                it.wedged = false;
            }
            // Buffer limit while this filter holds data. Over it, a request body whose filter
            // asked for watermark buffering gets flow control (reading pauses below); otherwise
            // Envoy answers 413 (request) or 500 (response; a reset once headers went out).
            let over_limit = {
                let s = self.lock();
                s.body_len(dir) > s.limit(dir)
            };
            let flow_controlled = dir == Dir::Request
                && it.data_stopped
                && self.data_stop == DataStop::Watermark
                && over_limit;
            if (it.held || it.data_stopped) && over_limit && !flow_controlled {
                return Flow::Local(payload_too_large(dir));
            }
            // Pass released data on.
            if !it.held && !it.data_stopped {
                let chunk = {
                    let mut s = self.lock();
                    s.set_body_access(dir, false);
                    *s.body_from(dir) = 0;
                    s.body(dir).split().freeze()
                };
                let done = match dir {
                    Dir::Request => self.flush_request(chunk, it.body_done).await,
                    Dir::Response => self.flush_response(chunk, it.body_done).await,
                };
                if let Some(f) = done {
                    return f;
                }
            }
            // Wait for the next event.
            let notify = self.notify.clone();
            let up_fut = match dir {
                Dir::Request => self.upstream.as_mut().and_then(|u| {
                    if u.result.is_none() {
                        u.fut.as_mut()
                    } else {
                        None
                    }
                }),
                Dir::Response => None,
            };
            let down = self.down.clone();
            let idle = self.idle.expired();
            let route_deadline = match dir {
                // The route timeout runs until the upstream response is complete.
                Dir::Response if it.body.is_some() => self.route_deadline,
                _ => None,
            };
            let resp_tx = self.resp_tx.as_mut();
            let reading = it.body.is_some() && !flow_controlled;
            tokio::select! {
                // Nothing happened on the stream for stream_idle_timeout_ms (e.g. the plugin
                // holds the request or response and never resumes it): Envoy's 408 "stream
                // timeout" local reply (direct once a response is encoding; a reset once its
                // headers went out, see `local_reply`).
                _ = idle => return Flow::Local(stream_timeout()),
                // The route timeout before the upstream response ended: 504 if no response
                // headers went out, else a reset (same local reply rules).
                _ = deadline_passed(route_deadline) => return Flow::Local(route_timeout()),
                f = async { match it.body.as_mut() { Some(b) => b.frame().await, None => std::future::pending().await } }, if reading => {
                    self.idle.touch();
                    match f {
                        None => {
                            it.body = None;
                            it.body_done = true;
                            self.req_done |= dir == Dir::Request;
                            if !(it.wedged || it.held && it.stop_all) {
                                if let Err(f) = self.on_data(dir, &mut it, true) {
                                    return f;
                                }
                            }
                        }
                        Some(Err(_)) => return Flow::Reset,
                        Some(Ok(frame)) => {
                            let data = match frame.into_data() {
                                Ok(data) => data,
                                Err(frame) => {
                                    if let Err(f) = self.trailers_arrived(dir, &mut it, frame) {
                                        return f;
                                    }
                                    continue;
                                }
                            };
                            // An HTTP/2 DATA frame with END_STREAM: Envoy's HTTP/2 codec gives
                            // the filter its data and the end in one callback (HTTP/1 reports
                            // the end on its own, below). Responses come from HTTP/1 upstreams.
                            let eos = dir == Dir::Request
                                && self.h2
                                && it.body.as_ref().is_some_and(|b| b.is_end_stream());
                            if eos {
                                it.body = None;
                                it.body_done = true;
                                self.req_done = true;
                            }
                            let over_limit = {
                                let mut s = self.lock();
                                s.body(dir).extend_from_slice(&data);
                                s.body_len(dir) > s.limit(dir)
                            };
                            // While the plugin buffers (its last data callback answered
                            // StopIterationAndBuffer), Envoy's wasm filter adds new data to the
                            // filter manager's buffer before calling the plugin
                            // (`Context::decodeData` / `encodeData`), and crossing the limit
                            // there is final. In the response, the 500 goes straight to the
                            // client (or the stream is reset once the headers went out), the
                            // stream ends at once and the plugin never sees this data. In the
                            // request, the filter manager prepares the 413 and sends it once the
                            // data callback has returned (`executeLocalReplyIfPrepared`): the
                            // plugin sees the whole buffer, but whatever it answers, even
                            // Continue, the client gets 413.
                            let crossed =
                                it.data_stopped && self.data_stop == DataStop::Buffer && over_limit;
                            if dir == Dir::Response && crossed {
                                return Flow::Local(payload_too_large(dir));
                            }
                            it.reply_prepared = crossed;
                            if !(it.wedged || it.held && it.stop_all) {
                                if let Err(f) = self.on_data(dir, &mut it, eos) {
                                    return f;
                                }
                            }
                            if crossed {
                                return Flow::Local(payload_too_large(dir));
                            }
                        }
                    }
                }
                _ = notify.notified() => {}
                r = async { match up_fut { Some(f) => f.await, None => std::future::pending().await } } => {
                    if let Some(u) = self.upstream.as_mut() {
                        u.fut = None;
                        match r {
                            Err(e) => return Flow::Upstream(Box::new(Err(e))),
                            Ok(resp) => u.result = Some(Ok(resp)),
                        }
                    }
                }
                _ = async { match &down { Some(t) => t.closed().await, None => std::future::pending().await } } => {
                    return Flow::Over; // client disconnected mid-response
                }
                _ = async { match resp_tx { Some(t) => t.closed().await, None => std::future::pending().await } } => {
                    return Flow::Over; // client went away
                }
            }
        }
    }

    /// A body callback on the cumulative buffer, or, after a StopIterationAndWatermark answer,
    /// on what came since: Envoy's wasm filter shows the plugin the filter manager's buffer only
    /// while it answers StopIterationAndBuffer, else the new data alone, which the filter
    /// manager then adds to the data it holds (conformance test
    /// `body_after_stop_iteration_and_watermark_is_the_new_chunk_only`). A StopIterationNoBuffer
    /// answer drops the data the plugin was shown and, like Watermark, shows the next callback
    /// only what came since (`body_answered_stop_iteration_no_buffer`). Continue releases held
    /// headers (a header StopIteration under 0_2_100 / `allow_on_headers_stop_iteration`).
    fn on_data(&mut self, dir: Dir, it: &mut Iteration, eos: bool) -> Result<(), Flow> {
        let len = {
            let mut s = self.lock();
            s.set_body_access(dir, true);
            let from = *s.body_from(dir);
            s.body_len(dir).saturating_sub(from)
        };
        let was_buffering = self.data_stop == DataStop::Buffer;
        let action = self.data_action(dir.body_callback(), len, eos);
        {
            let mut s = self.lock();
            let stopped = matches!(action, Ok(false));
            if stopped && self.data_stop == DataStop::NoBuffer && !was_buffering {
                // StopIterationNoBuffer drops the data this callback was shown: the filter
                // manager keeps only what earlier answers buffered (after a Buffer answer the
                // new data is already in that buffer, and nothing is dropped).
                let from = *s.body_from(dir);
                s.body(dir).truncate(from);
            }
            let held =
                if stopped && matches!(self.data_stop, DataStop::Watermark | DataStop::NoBuffer) {
                    s.body_len(dir)
                } else {
                    0
                };
            *s.body_from(dir) = held;
        }
        match action {
            Ok(cont) => {
                if cont && it.held && !it.reply_prepared {
                    it.held = false;
                    self.release_headers(dir, false)?;
                }
                it.data_stopped = !cont;
                Ok(())
            }
            Err(()) => Err(Flow::Local(wasm_fail_stream())),
        }
    }

    /// A trailers frame ended the body. Envoy's HTTP/1 codecs drop trailers (`enable_trailers`
    /// off by default: conformance tests `request_trailers_on_http1`,
    /// `response_trailers_on_http1`), so hyper's trailers of an HTTP/1 request and of a
    /// response (the upstreams are HTTP/1) are left out and the body ends as if they had not
    /// been sent. Envoy's HTTP/2 codec passes request trailers on: the body ends without an
    /// end-of-stream data callback and the plugin gets `on_request_trailers`
    /// (`request_trailers_on_http2`).
    fn trailers_arrived(
        &mut self,
        dir: Dir,
        it: &mut Iteration,
        frame: hyper::body::Frame<Bytes>,
    ) -> Result<(), Flow> {
        let Ok(trailers) = frame.into_trailers() else { return Ok(()) };
        if dir != Dir::Request || !self.h2 {
            return Ok(());
        }
        it.body = None;
        it.body_done = true;
        self.req_done = true;
        self.lock().req_trailers =
            trailers.iter().map(|(k, v)| (k.as_str().to_string(), v.as_bytes().to_vec())).collect();
        if it.wedged || it.held && it.stop_all {
            // Shown after the held body once the headers continue (a wedged filter never).
            it.trailers_pending = true;
            return Ok(());
        }
        self.on_request_trailers(it)
    }

    /// `proxy_on_request_trailers`. Continue lets the filter's held headers and data go on
    /// with the end of the stream (Envoy's `commonHandleAfterTrailersCallback`); StopIteration
    /// holds them (and the end) until `continue_stream`.
    fn on_request_trailers(&mut self, it: &mut Iteration) -> Result<(), Flow> {
        let n = self.lock().req_trailers.len();
        match self.call("proxy_on_request_trailers", &[self.ctx as i32, n as i32]) {
            Err(()) => Err(Flow::Local(wasm_fail_stream())),
            Ok(Some((raw, false))) if raw != 0 => {
                it.data_stopped = true;
                Ok(())
            }
            // A local reply asked for in the callback is sent by the iteration.
            Ok(Some((_, true))) => Ok(()),
            Ok(_) => {
                // Envoy drops its pointer to trailers a callback continued: the map is gone for
                // the later callbacks (BadArgument; NotFound in `on_log`). The trailers go no
                // further either: the upstreams are HTTP/1, whose codec drops them.
                self.lock().req_trailers.clear();
                self.data_stop = DataStop::NotStopped;
                it.data_stopped = false;
                if std::mem::take(&mut it.held) {
                    self.release_headers(Dir::Request, false)?;
                }
                Ok(())
            }
        }
    }

    /// The headers leave the filter: to the router (request) or to the client (response).
    fn release_headers(&mut self, dir: Dir, eos: bool) -> Result<(), Flow> {
        match dir {
            Dir::Request => self.forward(!eos).map_err(Flow::Local),
            Dir::Response => {
                if self.send_headers(eos) {
                    Ok(())
                } else {
                    Err(Flow::Over)
                }
            }
        }
    }

    /// Released request data to the upstream; at the end of the body, wait for its response.
    async fn flush_request(&mut self, mut chunk: Bytes, end: bool) -> Option<Flow> {
        if let Some(b) = self.pending_req.take() {
            self.req_owed = b
                .headers_ref()
                .and_then(|h| h.get("content-length"))
                .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
            let short = self.req_owed.is_some_and(|n| n > chunk.len() as u64);
            let full = if end && !short { Some(std::mem::take(&mut chunk)) } else { None };
            if let Err(lr) = self.start_upstream(b, full) {
                return Some(Flow::Local(lr));
            }
        }
        let up = self.upstream.as_mut()?;
        if let Some(owed) = &mut self.req_owed {
            *owed = owed.saturating_sub(chunk.len() as u64);
        }
        if !chunk.is_empty() {
            if let Some(tx) = &up.body_tx {
                // The upstream request is driven while its body waits for room (the channel holds
                // 16 chunks): it is what connects and drains the body, so awaiting the send alone
                // would wait forever once a fast client filled the channel before the connection
                // was up. A response that came meanwhile is kept (or its error returned), and the
                // body still goes out after it, as before.
                let answered = match up.fut.as_mut().filter(|_| up.result.is_none()) {
                    Some(f) => tokio::select! {
                        _ = tx.send(Ok(chunk)) => None,
                        r = f => Some(r),
                    },
                    None => {
                        let _ = tx.send(Ok(chunk)).await;
                        None
                    }
                };
                if let Some(r) = answered {
                    up.fut = None;
                    match r {
                        Err(e) => return Some(Flow::Upstream(Box::new(Err(e)))),
                        Ok(resp) => up.result = Some(Ok(resp)),
                    }
                }
            }
        }
        if !end {
            return None;
        }
        // A body shorter than the `content-length` the plugin left (it rewrote the body): Envoy
        // sends what it has and waits for the response, the upstream for the rest, until the
        // route timeout. Ending the body would make hyper abort the request at once.
        if self.req_owed.is_none_or(|n| n == 0) {
            up.body_tx = None;
        }
        // The router has the whole request: Envoy's route timeout starts.
        let route_deadline =
            (!self.timeout.is_zero()).then(|| tokio::time::Instant::now() + self.timeout);
        self.route_deadline = route_deadline;
        let idle = self.idle.expired();
        let r = match up.result.take() {
            Some(r) => r,
            None => match up.fut.take() {
                Some(f) => match self.resp_tx.as_mut() {
                    Some(rt) => tokio::select! {
                        r = f => r,
                        _ = rt.closed() => return Some(Flow::Over),
                        _ = deadline_passed(route_deadline) => Err(UpError::Timeout),
                        _ = idle => return Some(Flow::Local(stream_timeout())),
                    },
                    None => f.await,
                },
                None => return Some(Flow::Over),
            },
        };
        Some(Flow::Upstream(Box::new(r)))
    }

    /// Released response data to the client; the stream is over at the end of the body.
    async fn flush_response(&mut self, chunk: Bytes, end: bool) -> Option<Flow> {
        if !chunk.is_empty() {
            if let Some(owed) = &mut self.down_owed {
                *owed = owed.saturating_sub(chunk.len() as u64);
            }
            // A body longer than the `content-length` sent: hyper writes only the announced
            // bytes, as the client reads them from Envoy (which writes all, the rest is junk
            // before the connection's next response).
            let sent = match &self.down {
                Some(tx) => tx.send(Ok(chunk)).await.is_ok(),
                None => true,
            };
            if !sent {
                return Some(Flow::Over); // client went away
            }
            self.idle.touch();
        }
        if end {
            if let Some(tx) = self.down.take() {
                if self.down_owed.is_some_and(|n| n > 0) {
                    // A body shorter than its `content-length`: Envoy's HTTP/1 codec ends the
                    // stream after the bytes the filter let go and leaves the connection open;
                    // the client waits for the rest. Ending the body would make hyper close the
                    // connection, so the body stays open until the client goes away.
                    tokio::spawn(async move { tx.closed().await });
                }
            }
            return Some(Flow::Over);
        }
        None
    }

    /// The router: the request headers leave the filter. `has_body`: the client's request has a
    /// body (its headers did not end the stream).
    fn forward(&mut self, has_body: bool) -> Result<(), LocalReply> {
        let g = self.w.g.clone();
        let (method, path, headers, override_host, cluster_name, route_timeout) = {
            let mut s = self.lock();
            // A header change re-matches the route unless clear_route_cache=off (Higress).
            if s.req_headers_modified && !s.clear_route_cache_off {
                let p = header_value(&s.req_headers, ":path").unwrap_or_else(|| "/".into());
                let a = header_value(&s.req_headers, ":authority").unwrap_or_default();
                s.route = match_route(&g.routes, &p, &a);
            }
            let Some(route) = s.route.and_then(|i| g.routes.get(i)) else {
                return Err(local(404, "route_not_found", ""));
            };
            s.route_name = route.name.clone();
            let cluster_name = match &route.cluster_header {
                Some(h) => match header_value(&s.req_headers, &h.to_ascii_lowercase()) {
                    Some(c) => c,
                    None => return Err(local(404, "cluster_not_found", "")),
                },
                None => route.cluster.clone().unwrap_or_default(),
            };
            s.cluster_name = cluster_name.clone();
            let route_timeout = Duration::from_millis(route.timeout_ms);
            (
                header_value(&s.req_headers, ":method").unwrap_or_else(|| "GET".into()),
                header_value(&s.req_headers, ":path").unwrap_or_else(|| "/".into()),
                s.req_headers.clone(),
                s.override_host.clone(),
                cluster_name,
                route_timeout,
            )
        };
        self.timeout = route_timeout;
        let Some(cluster) = g.clusters.get(&cluster_name) else {
            let code = if self
                .lock()
                .route
                .and_then(|i| g.routes.get(i))
                .is_some_and(|r| r.cluster_header.is_some())
            {
                404
            } else {
                503
            };
            return Err(local(code, "cluster_not_found", ""));
        };
        let original_dst = header_value(&headers, "x-envoy-original-dst-host");
        let Some(ep) = cluster.pick_for_request(original_dst.as_deref(), override_host.as_deref())
        else {
            return Err(local(503, "no_healthy_upstream", "no healthy upstream"));
        };
        self.lock().upstream_host = Some(ep.address.clone());
        let mut b =
            Request::builder().method(method.as_str()).uri(format!("http://{}{}", ep.addr, path));
        let mut authority = None;
        for (k, v) in &headers {
            if k == ":authority" {
                authority = Some(v.clone());
                continue;
            }
            // Envoy forwards `te` with only its `trailers` value (the others are hop-by-hop).
            if k == "te" {
                let v = String::from_utf8_lossy(v);
                if v.split(',').any(|t| t.trim().eq_ignore_ascii_case("trailers")) {
                    b = b.header("te", "trailers");
                }
                continue;
            }
            if k.starts_with(':')
                || k == "host"
                || HOP_BY_HOP.contains(&k.as_str())
                || k == EXPECTED_TIMEOUT_HEADER
            {
                continue;
            }
            b = b.header(k.as_str(), v.as_slice());
        }
        if let Some(a) = authority {
            b = b.header("host", a);
        }
        // Envoy's router tells the upstream the route timeout (not when it is off, Higress's
        // default).
        if !route_timeout.is_zero() {
            b = b.header(EXPECTED_TIMEOUT_HEADER, route_timeout.as_millis().to_string());
        }
        // Framing as Envoy's HTTP/1 codec: the request's `content-length` is kept (also when the
        // filter buffered the body, or the client goes away mid-body); a body without one is
        // sent chunked, even when the filter buffered all of it.
        if has_body && header_value(&headers, "content-length").is_none() {
            b = b.header("transfer-encoding", "chunked");
        }
        ep.active.fetch_add(1, Ordering::Relaxed);
        ep.total.fetch_add(1, Ordering::Relaxed);
        self.active = Some(ActiveGuard(ep.clone()));
        self.endpoint = Some(ep);
        // Sent with the first released body data (or at once when there is none to wait for).
        self.pending_req = Some(b);
        self.response_limits = Some(cluster.response_header_limits);
        Ok(())
    }

    /// Start the upstream request: a full body when the request is complete (content-length),
    /// otherwise a streamed body.
    fn start_upstream(
        &mut self,
        b: hyper::http::request::Builder,
        full: Option<Bytes>,
    ) -> Result<(), LocalReply> {
        let (body_tx, gw_body) = match full {
            Some(b) => (None, GwBody::full(b)),
            None => {
                let (tx, rx) = GwBody::channel();
                (Some(tx), rx)
            }
        };
        let req = b.body(gw_body).map_err(|_| local(400, "invalid_request", "bad request"))?;
        let client = self.w.client.clone();
        let limits = self.response_limits;
        // No timeout here: the route timeout runs from the end of the request (`route_deadline`).
        let fut = async move {
            let resp = client.request(req).await.map_err(|e| {
                let source = std::error::Error::source(&e);
                if e.is_connect() {
                    UpError::Connect
                } else if source
                    .and_then(|s| s.downcast_ref::<hyper::Error>())
                    .is_some_and(hyper::Error::is_incomplete_message)
                {
                    UpError::Terminated
                } else {
                    UpError::Other
                }
            })?;
            // Envoy's upstream codec refuses a head over the cluster's limits while it parses it:
            // the connection is closed and the stream reset (`protocol error`).
            if limits.is_some_and(|l| response_header_overflow(&resp, l)) {
                return Err(UpError::Other);
            }
            Ok(resp)
        };
        self.upstream = Some(Upstream {
            body_tx,
            fut: Some(Box::pin(fut)),
            result: None,
            started: tokio::time::Instant::now(),
        });
        Ok(())
    }

    // ---------------------------------------------------------------- response side

    fn send_headers(&mut self, eos: bool) -> bool {
        let (status, headers) = {
            let mut s = self.lock();
            s.resp_hdr_access = false;
            let status = header_value(&s.resp_headers, ":status")
                .and_then(|v| v.parse::<u16>().ok())
                .unwrap_or(200);
            (status, s.resp_headers.clone())
        };
        let (tx, body) = if eos {
            (None, GwBody::full(Bytes::new()))
        } else {
            let (tx, b, caught_up) = GwBody::watched_channel();
            self.down_caught_up = Some(caught_up);
            (Some(tx), b)
        };
        let mut resp = Response::new(body);
        *resp.status_mut() =
            hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::BAD_GATEWAY);
        // Envoy keeps the upstream's `content-length` even when the plugin changed the body
        // (a plugin that rewrites a body removes it itself): see `flush_response`.
        self.down_owed = (!eos)
            .then(|| header_value(&headers, "content-length").and_then(|v| v.trim().parse().ok()))
            .flatten();
        for (k, v) in &headers {
            if k.starts_with(':')
                // Envoy passes the response's `trailer` header on (its HTTP/1 codec drops the
                // trailers themselves).
                || (HOP_BY_HOP.contains(&k.as_str()) && k != "trailer")
            {
                continue;
            }
            if let (Ok(n), Ok(v)) = (
                hyper::header::HeaderName::from_bytes(k.as_bytes()),
                hyper::header::HeaderValue::from_bytes(v),
            ) {
                resp.headers_mut().append(n, v);
            }
        }
        self.close_if_request_unfinished(&mut resp);
        self.down = tx;
        match self.resp_tx.take() {
            Some(t) => t.send(resp).is_ok(),
            None => false,
        }
    }

    /// Reset the stream. Once the response headers went out, Envoy's HTTP/1 codec has written
    /// them (and the data passed so far) to the connection before it resets: the client sees
    /// them, then a broken body. hyper drops what it has not flushed when the body fails, so the
    /// reset waits (briefly) until hyper took everything and flushed.
    async fn abort_downstream(&mut self) {
        if let Some(tx) = self.down.take() {
            if let Some(caught_up) = self.down_caught_up.take() {
                caught_up.wait(&tx, Duration::from_millis(500)).await;
            }
            let _ = tx.send(Err("stream reset".into())).await;
        }
        if let Some(t) = self.resp_tx.take() {
            drop(t);
        }
    }

    /// Send a local reply, as Envoy's `FilterManager::sendLocalReply`: before any response
    /// reached the filter (`via_filter`) it passes through the plugin's response callbacks; once
    /// a response is being encoded but no headers went out, it goes straight to the client
    /// without callbacks (`sendDirectLocalReply`); after the headers went out, the stream is
    /// reset.
    async fn local_reply(&mut self, lr: LocalReply, via_filter: bool) {
        self.w.g.stats.local_replies_total.fetch_add(1, Ordering::Relaxed);
        if self.resp_tx.is_none() {
            // Headers already sent: reset the stream.
            self.abort_downstream().await;
            return;
        }
        tracing::debug!(status = lr.status, details = %lr.details, "local reply");
        {
            let mut s = self.lock();
            let mut h: HeaderMap = vec![(":status".into(), lr.status.to_string().into_bytes())];
            if !lr.body.is_empty() {
                h.push(("content-type".into(), b"text/plain".to_vec()));
            }
            for (k, _) in &lr.headers {
                h.retain(|(x, _)| x != k);
            }
            h.extend(lr.headers.iter().cloned());
            s.resp_headers = h;
            s.resp_body.clear();
            s.resp_body_from = 0;
            s.resp_body.extend_from_slice(&lr.body);
            s.response_code = Some(lr.status);
            s.resp_hdr_access = true;
            s.local_reply = None;
        }
        self.add_route_response_headers();
        let body_len = lr.body.len();
        let n = self.lock().resp_headers.len();
        if via_filter
            && self
                .call(
                    "proxy_on_response_headers",
                    &[self.ctx as i32, n as i32, (body_len == 0) as i32],
                )
                .is_ok()
            && body_len > 0
        {
            self.lock().resp_body_access = true;
            let _ = self.call("proxy_on_response_body", &[self.ctx as i32, body_len as i32, 1]);
        }
        let (status, headers, body) = {
            let mut s = self.lock();
            s.resp_hdr_access = false;
            s.resp_body_access = false;
            s.local_reply = None;
            let status = header_value(&s.resp_headers, ":status")
                .and_then(|v| v.parse::<u16>().ok())
                .unwrap_or(lr.status);
            (status, s.resp_headers.clone(), s.resp_body.split().freeze())
        };
        let mut resp = Response::new(GwBody::full(body));
        *resp.status_mut() =
            hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
        for (k, v) in &headers {
            if k.starts_with(':') || k == "content-length" {
                continue;
            }
            if let (Ok(n), Ok(v)) = (
                hyper::header::HeaderName::from_bytes(k.as_bytes()),
                hyper::header::HeaderValue::from_bytes(v),
            ) {
                resp.headers_mut().append(n, v);
            }
        }
        self.close_if_request_unfinished(&mut resp);
        if let Some(t) = self.resp_tx.take() {
            let _ = t.send(resp);
        }
    }

    /// A response that starts before the whole request came: Envoy's HTTP/1 connection manager
    /// will not wait for the rest of the request, so it answers with `connection: close` and
    /// closes the connection after the response (HTTP/2 resets the stream instead, which hyper's
    /// HTTP/2 server does with NO_ERROR once the response ended).
    fn close_if_request_unfinished(&self, resp: &mut Response<GwBody>) {
        if !self.h2 && !self.req_done {
            resp.headers_mut()
                .insert("connection", hyper::header::HeaderValue::from_static("close"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(ty: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[ty, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// The frame follower keeps its place across reads cut anywhere (in the preface, in a frame
    /// header, in a payload): while holding, exactly the PING acks are held, whole; a frame
    /// whose header hyper already got in part is never held; without holding, all passes.
    #[test]
    fn h2_frames_hold_ping_acks_across_any_cut() {
        let ack = frame(H2_FRAME_PING, H2_FLAG_ACK, 0, b"12345678");
        let others = [
            frame(4, 0, 0, &[0, 3, 0, 0, 0, 100]),
            frame(H2_FRAME_PING, 0, 0, b"abcdefgh"),
            frame(1, 0x5, 3, b"\x82\x86\x84"),
            frame(0, 0x1, 3, &[7u8; 300]),
            frame(4, 1, 0, &[]),
        ];
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        let mut kept = input.clone();
        for f in &others {
            input.extend_from_slice(&ack);
            input.extend_from_slice(f);
            kept.extend_from_slice(f);
        }
        let held: Vec<u8> = std::iter::repeat_n(ack.clone(), others.len()).flatten().collect();
        for cut in 1..=input.len() {
            let mut f = H2Frames::new();
            let mut out = Vec::new();
            for piece in input.chunks(cut) {
                f.follow(piece, true, Some(&mut out));
            }
            assert_eq!(out, kept, "cut {cut}");
            assert_eq!(f.held, held, "cut {cut}");
            assert!(f.at_boundary());
        }
        // Not holding: nothing is held, and the follower ends between frames.
        for cut in 1..=input.len() {
            let mut f = H2Frames::new();
            for piece in input.chunks(cut) {
                f.follow(piece, false, None);
            }
            assert!(f.held.is_empty() && f.at_boundary(), "cut {cut}");
        }
        // Holding starts inside an ack's header that hyper already has in part: it passes.
        let mut f = H2Frames::new();
        let mut out = Vec::new();
        f.follow(&input[..24 + 4], false, None);
        f.follow(&input[24 + 4..24 + ack.len()], true, Some(&mut out));
        assert_eq!(out, input[24 + 4..24 + ack.len()]);
        assert!(f.held.is_empty() && f.at_boundary());
        // The drain timeout ends inside a held ack: its rest is held too (`holding`, which keeps
        // `poll_read_h2` from passing those bytes on in place), so the ack reaches hyper whole.
        let mut f = H2Frames::new();
        let mut out = Vec::new();
        f.follow(&input[..24 + 12], true, Some(&mut out));
        assert!(f.holding);
        f.follow(&input[24 + 12..24 + ack.len()], false, Some(&mut out));
        assert_eq!(out, input[..24]);
        assert_eq!(f.held, ack);
        assert!(f.at_boundary());
    }
}
