//! Body type used for downstream responses and upstream requests: a full buffer or a channel of
//! chunks (so SSE and request bodies stream chunk by chunk).

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::mpsc;

/// Error type of [`GwBody`] (a stream aborted by the gateway).
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// HTTP client used for upstream requests and callouts.
pub type HttpClient =
    hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, GwBody>;

/// A body: full bytes, or chunks from a channel (an `Err` item aborts the stream).
#[derive(Debug)]
pub enum GwBody {
    /// Whole body (None once sent).
    Full(Option<Bytes>),
    /// Streamed chunks.
    Chan(mpsc::Receiver<Result<Bytes, BodyError>>),
    /// Streamed chunks whose reader reports when it found the channel empty.
    Watched(mpsc::Receiver<Result<Bytes, BodyError>>, Arc<ReaderCaughtUp>),
}

/// Set when the reader of a [`GwBody::Watched`] body (hyper's connection) polled the channel and
/// found it empty. hyper flushes what it wrote so far (the response head, earlier chunks) right
/// after such a poll, in the same turn; an error item sent before that would make it drop the
/// connection with the head still unsent.
#[derive(Debug, Default)]
pub struct ReaderCaughtUp {
    caught_up: AtomicBool,
    changed: tokio::sync::Notify,
}

impl ReaderCaughtUp {
    /// Wait (at most `limit`) until the reader took everything `tx` sent and then found the
    /// channel empty.
    pub async fn wait(
        &self,
        tx: &mpsc::Sender<Result<Bytes, BodyError>>,
        limit: std::time::Duration,
    ) {
        let until = tokio::time::Instant::now() + limit;
        // Done when the reader is gone, or it took every item and then found nothing more.
        let done = |tx: &mpsc::Sender<Result<Bytes, BodyError>>| {
            let took_all = tx.capacity() == tx.max_capacity();
            tx.is_closed() || (took_all && self.caught_up.load(Ordering::Acquire))
        };
        while !done(tx) {
            let step = tokio::time::Instant::now() + std::time::Duration::from_millis(20);
            if tokio::time::timeout_at(step.min(until), self.changed.notified()).await.is_err()
                && tokio::time::Instant::now() >= until
            {
                return;
            }
        }
    }
}

impl GwBody {
    /// A full body.
    pub fn full(b: Bytes) -> GwBody {
        GwBody::Full(if b.is_empty() { None } else { Some(b) })
    }
    /// A streamed body and its sender.
    pub fn channel() -> (mpsc::Sender<Result<Bytes, BodyError>>, GwBody) {
        let (tx, rx) = mpsc::channel(16);
        (tx, GwBody::Chan(rx))
    }
    /// A streamed body whose reader reports when it caught up (see [`ReaderCaughtUp`]).
    pub fn watched_channel() -> (mpsc::Sender<Result<Bytes, BodyError>>, GwBody, Arc<ReaderCaughtUp>)
    {
        let (tx, rx) = mpsc::channel(16);
        let w = Arc::new(ReaderCaughtUp::default());
        (tx, GwBody::Watched(rx, w.clone()), w)
    }
}

impl Body for GwBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            GwBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            GwBody::Chan(rx) => match rx.poll_recv(cx) {
                Poll::Ready(Some(Ok(b))) => Poll::Ready(Some(Ok(Frame::data(b)))),
                Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
            GwBody::Watched(rx, w) => match rx.poll_recv(cx) {
                Poll::Ready(Some(Ok(b))) => {
                    w.caught_up.store(false, Ordering::Release);
                    Poll::Ready(Some(Ok(Frame::data(b))))
                }
                Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => {
                    w.caught_up.store(true, Ordering::Release);
                    w.changed.notify_one();
                    Poll::Pending
                }
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, GwBody::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            GwBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            GwBody::Full(None) => SizeHint::with_exact(0),
            GwBody::Chan(_) | GwBody::Watched(..) => SizeHint::default(),
        }
    }
}

/// Build an HTTP client (it adds a `host` header from the URI when the request has none).
pub fn client(connect_timeout: std::time::Duration) -> HttpClient {
    builder().build(connector(connect_timeout))
}

/// The worker's client for upstream requests and callouts: a request goes out with the `host`
/// the stream's `:authority` gives it, and without one when the plugin removed `:authority`,
/// as Envoy sends it (`host_is_the_authority_in_the_request_header_map`).
pub fn upstream_client(
    connect_timeout: std::time::Duration,
    headers: crate::config::HeaderLimits,
) -> HttpClient {
    let mut b = builder();
    // Above the clusters' limits (which the proxy applies as Envoy counts them), never below
    // hyper's defaults: hyper's own refusal must not come first.
    b.http1_max_headers(headers.count.saturating_mul(2).max(HYPER_MAX_HEADERS));
    b.http1_max_buf_size(headers.bytes.saturating_mul(2).max(HYPER_MAX_BUF_SIZE));
    b.set_host(false).build(connector(connect_timeout))
}

/// Hyper's default limit on the headers of an HTTP/1 head.
pub const HYPER_MAX_HEADERS: usize = 100;
/// Hyper's default read buffer limit for HTTP/1 (8 KiB plus 100 lines of 4 KiB).
pub const HYPER_MAX_BUF_SIZE: usize = 8192 + 4096 * 100;

fn connector(
    connect_timeout: std::time::Duration,
) -> hyper_util::client::legacy::connect::HttpConnector {
    let mut conn = hyper_util::client::legacy::connect::HttpConnector::new();
    conn.set_connect_timeout(Some(connect_timeout));
    conn.set_nodelay(true);
    conn
}

fn builder() -> hyper_util::client::legacy::Builder {
    let mut b = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new());
    b.pool_idle_timeout(std::time::Duration::from_secs(30));
    b
}
