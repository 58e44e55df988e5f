//! Body type used for downstream responses and upstream requests: a full buffer or a channel of
//! chunks (so SSE and request bodies stream chunk by chunk).

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use std::pin::Pin;
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
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, GwBody::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            GwBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            GwBody::Full(None) => SizeHint::with_exact(0),
            GwBody::Chan(_) => SizeHint::default(),
        }
    }
}

/// Build an HTTP client for one worker.
pub fn client(connect_timeout: std::time::Duration) -> HttpClient {
    let mut conn = hyper_util::client::legacy::connect::HttpConnector::new();
    conn.set_connect_timeout(Some(connect_timeout));
    conn.set_nodelay(true);
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(std::time::Duration::from_secs(30))
        .build(conn)
}
