//! HTTP callouts: `proxy_http_call` (+ `proxy_on_http_call_response` delivery in the worker).
//! The gRPC calls (`proxy_grpc_call`, `proxy_grpc_stream`, `proxy_grpc_send`, `proxy_grpc_cancel`,
//! `proxy_grpc_close`) are not implemented: they link to the Unimplemented (12) stub.
//!
//! The headers need `:method`, `:path` and `:authority` (else BadArgument); an unknown cluster is
//! BadArgument. On an ORIGINAL_DST cluster with `use_http_header`, `x-envoy-original-dst-host:
//! ip:port` is the destination (without it the call fails); on any other cluster the header means
//! nothing and the cluster's LB picks, as in Envoy. A cluster with no host to pick (no endpoints,
//! or ORIGINAL_DST without the header) is InternalFailure at once, with no callback, its token used
//! up (conformance test `dispatch_http_call_to_a_cluster_without_hosts`). The response
//! goes to the root context. A failure before the response headers (connection
//! refused, the call's timeout) is Envoy's router local reply (503 / 504 with a text body),
//! delivered as the response; a failure after them (a reset or timeout mid-body) gives counts of
//! 0 and `proxy_get_status` gives BrokenConnection. Tokens start at 4 and step by 4.

use super::{
    code, read_bytes, read_string, status, unmarshal_pairs, write_u32, CallResponse, HostState,
    Registrar,
};
use crate::global::WorkerEvent;
use bytes::Bytes;
use http_body_util::BodyExt;
use std::time::Duration;
use wasmtime::Caller;

/// Register the group.
pub fn add(l: &mut Registrar<'_>) -> anyhow::Result<()> {
    l.func(
        "proxy_http_call",
        |mut c: Caller<'_, HostState>,
         up: i32,
         us: i32,
         hp: i32,
         hs: i32,
         bp: i32,
         bs: i32,
         tp: i32,
         ts: i32,
         timeout: i32,
         tokp: i32|
         -> i32 {
            let cluster = match read_string(&mut c, up, us) {
                Ok(x) => x,
                Err(e) => return e,
            };
            let (hdrs, body, _trl) = match (
                read_bytes(&mut c, hp, hs),
                read_bytes(&mut c, bp, bs),
                read_bytes(&mut c, tp, ts),
            ) {
                (Ok(h), Ok(b), Ok(t)) => (h, b, t),
                (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return e,
            };
            // Envoy's `Context::httpCall` takes the timeout as a signed int and refuses a
            // negative one.
            if timeout < 0 {
                return status::BAD_ARGUMENT;
            }
            let Some(headers) = unmarshal_pairs(&hdrs) else { return status::BAD_ARGUMENT };
            let get = |k: &str| {
                headers
                    .iter()
                    .find(|(n, _)| n == k)
                    .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            };
            let (Some(method), Some(path), Some(authority)) =
                (get(":method"), get(":path"), get(":authority"))
            else {
                return status::BAD_ARGUMENT;
            };
            let st = c.data_mut();
            let Some(cl) = st.g.clusters.get(&cluster) else { return status::BAD_ARGUMENT };
            let token = st.next_http_token;
            st.next_http_token = st.next_http_token.wrapping_add(4);
            // Envoy honours `x-envoy-original-dst-host` only on an ORIGINAL_DST cluster with
            // `use_http_header`; on any other cluster the LB picks.
            let endpoint = cl.pick_for_request(get("x-envoy-original-dst-host").as_deref(), None);
            // No host to pick (no endpoints, an ORIGINAL_DST cluster without the header): Envoy's
            // router answers inside the async client's `send`, which then returns no request, and
            // the call is InternalFailure at once, with no callback; its token is used up.
            let Some(endpoint) = endpoint else { return status::INTERNAL_FAILURE };
            // Exiting: Envoy's dispatchers have stopped, so the request never goes out.
            if st.g.is_exiting() {
                return code(write_u32(&mut c, tokp, token));
            }
            let client = st.http_client.clone();
            let events = st.events.clone();
            let gen = st.gen;
            // 0 = no timeout.
            let timeout_ms = timeout.unsigned_abs();
            let timeout = if timeout_ms == 0 {
                Duration::from_secs(24 * 3600)
            } else {
                Duration::from_millis(timeout_ms as u64)
            };
            tokio::task::spawn_local(async move {
                // Whether the response headers arrived: until then Envoy's router answers a
                // failure with a local reply, which the call delivers as its response.
                let got_headers = std::cell::Cell::new(false);
                let result = async {
                    let mut b = hyper::Request::builder()
                        .method(method.as_str())
                        .uri(format!("http://{}{}", endpoint.addr, path));
                    for (k, v) in &headers {
                        if k.starts_with(':') || k == "host" || ASYNC_CLIENT_SETS.contains(&k.as_str())
                        {
                            continue;
                        }
                        b = b.header(k.as_str(), v.as_slice());
                    }
                    b = b.header("host", authority.as_str());
                    // Envoy's async client marks its requests internal, and its router sends
                    // the call's timeout on as for any route.
                    b = b.header("x-envoy-internal", "true");
                    if timeout_ms > 0 {
                        b = b.header("x-envoy-expected-rq-timeout-ms", timeout_ms.to_string());
                    }
                    let req = b
                        .body(crate::body::GwBody::full(Bytes::from(body)))
                        .map_err(|_| CallError::Failed("bad request"))?;
                    let resp = tokio::time::timeout(timeout, async {
                        let resp = client.request(req).await.map_err(|e| {
                            CallError::Local(
                                503,
                                if e.is_connect() { CONNECT_FAILURE } else { TERMINATED },
                            )
                        })?;
                        got_headers.set(true);
                        let (parts, body) = resp.into_parts();
                        let collected =
                            body.collect().await.map_err(|_| CallError::Failed("reset"))?;
                        let trailers = collected.trailers().cloned();
                        Ok::<_, CallError>((parts, collected.to_bytes(), trailers))
                    })
                    .await
                    .map_err(|_| {
                        if got_headers.get() {
                            CallError::Failed("timeout")
                        } else {
                            CallError::Local(504, "upstream request timeout")
                        }
                    })??;
                    let (parts, body, trailers) = resp;
                    let mut headers =
                        vec![(":status".to_string(), parts.status.as_str().as_bytes().to_vec())];
                    for (k, v) in parts.headers.iter() {
                        headers.push((k.as_str().to_string(), v.as_bytes().to_vec()));
                    }
                    let trailers = trailers
                        .map(|t| {
                            t.iter()
                                .map(|(k, v)| (k.as_str().to_string(), v.as_bytes().to_vec()))
                                .collect()
                        })
                        .unwrap_or_default();
                    Ok::<_, CallError>(CallResponse { headers, body, trailers })
                }
                .await;
                let result = match result {
                    Ok(r) => Some(r),
                    Err(CallError::Local(code, text)) => {
                        tracing::debug!(cluster = %cluster, "http call {token}: local reply {code} {text}");
                        Some(local_reply(code, text))
                    }
                    Err(CallError::Failed(e)) => {
                        tracing::debug!(cluster = %cluster, "http call {token} failed: {e}");
                        None
                    }
                };
                let _ = events.send(WorkerEvent::HttpCall { gen, token, result });
            });
            match write_u32(&mut c, tokp, token) {
                Ok(()) => status::OK,
                Err(e) => e,
            }
        },
    )?;
    Ok(())
}

/// Headers of a call that Envoy's async client sets itself (the plugin's values are replaced).
const ASYNC_CLIENT_SETS: &[&str] = &["x-envoy-internal", "x-envoy-expected-rq-timeout-ms"];

/// Envoy's local reply body when the upstream refuses the connection (verified against Envoy
/// 1.40 by the conformance scenario `dispatch_http_call_timeout_and_refused`).
const CONNECT_FAILURE: &str =
    "upstream connect error or disconnect/reset before headers. reset reason: remote connection failure";
/// The same when the connection closes before the response headers (Envoy's reset reason
/// `connection termination`; not exercised by the conformance suite).
const TERMINATED: &str =
    "upstream connect error or disconnect/reset before headers. reset reason: connection termination";

/// How a call ended without a response from the upstream.
enum CallError {
    /// Before the response headers: Envoy's router answers with a local reply (503 on a
    /// connection failure, 504 on the call's timeout), which the async client
    /// delivers to the plugin as the response (`on_http_call_response` with its headers and
    /// body).
    Local(u16, &'static str),
    /// After the response headers (a reset or a timeout mid-body): the call fails, the plugin
    /// gets zero headers, body and trailers.
    Failed(&'static str),
}

/// The local reply of Envoy's router as the async client delivers it: `:status`,
/// `content-length` and `content-type: text/plain`, and the text as the body.
fn local_reply(code: u16, text: &'static str) -> CallResponse {
    CallResponse {
        headers: vec![
            (":status".to_string(), code.to_string().into_bytes()),
            ("content-length".to_string(), text.len().to_string().into_bytes()),
            ("content-type".to_string(), b"text/plain".to_vec()),
        ],
        body: Bytes::from_static(text.as_bytes()),
        trailers: Vec::new(),
    }
}
