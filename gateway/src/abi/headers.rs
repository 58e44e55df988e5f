//! Header maps: `proxy_get_header_map_pairs`, `proxy_set_header_map_pairs`,
//! `proxy_get_header_map_value`, `proxy_replace_header_map_value`, `proxy_remove_header_map_value`,
//! `proxy_add_header_map_value`.
//!
//! Map types: 0 request headers, 1 request trailers, 2 response headers, 3 response trailers,
//! 6 callout response headers, 7 callout response trailers. Request headers are accessible only
//! while this filter holds them (Envoy resets `request_headers_` on Continue and inside
//! `continue_stream`); a map that is not available is BadArgument (NotFound in `on_log`, where
//! the request and response headers are readable), and reads as no pairs.
//!
//! In the request headers `host` is `:authority`, as in Envoy's request header map, which keeps
//! both names in one inline entry: reading, replacing or removing `host` reads, replaces or
//! removes `:authority` (conformance test `host_is_the_authority_in_the_request_header_map`).
//! Adding a header Envoy keeps inline (`:authority`, `user-agent`, `content-type`, ...) to a map
//! that has it appends `,value` to it; any other header gets an entry of its own (conformance
//! test `add_header_map_value_to_inline_headers`).

use super::{
    copy_out, marshal_pairs, read_bytes, read_string, status, unmarshal_pairs, HResult, HeaderMap,
    HostState, Registrar,
};
use wasmtime::Caller;

/// Why a map cannot be used.
enum Unavailable {
    /// Not available in this callback (Envoy: the map pointer is null): BadArgument, or NotFound
    /// in the access-log phase (Envoy `Context::getHeaderMapValue`).
    Map,
    /// Another status.
    Status(i32),
}

fn with_map<R>(
    c: &mut Caller<'_, HostState>,
    ty: i32,
    write: bool,
    f: impl FnOnce(&mut HeaderMap) -> HResult<R>,
) -> Result<R, (Unavailable, bool)> {
    let st = c.data_mut();
    let fail = |u| Err((u, false));
    match ty {
        0..=3 => {
            // The root context has no stream maps.
            let Some(s) = st.effective_stream() else { return fail(Unavailable::Map) };
            let mut s = match s.lock() {
                Ok(s) => s,
                Err(_) => return fail(Unavailable::Status(status::INTERNAL_FAILURE)),
            };
            let log = s.log_phase;
            // In the access-log phase Envoy reads copies of the request and response headers;
            // they cannot be written.
            let readable = match ty {
                0 => s.req_hdr_access || (log && !write),
                2 => s.resp_hdr_access || (log && !write && !s.resp_headers.is_empty()),
                // Trailers exist only when the message had them: request trailers over HTTP/2
                // until the trailers callback continues them (the response's come from HTTP/1
                // upstreams, whose codec drops them, so never).
                1 => !s.req_trailers.is_empty(),
                _ => !s.resp_trailers.is_empty(),
            };
            if !readable {
                return Err((Unavailable::Map, log));
            }
            let r = match ty {
                0 => {
                    if write {
                        s.req_headers_modified = true;
                    }
                    f(&mut s.req_headers)
                }
                1 => f(&mut s.req_trailers),
                2 => f(&mut s.resp_headers),
                _ => f(&mut s.resp_trailers),
            };
            r.map_err(|e| (Unavailable::Status(e), log))
        }
        6 | 7 => match st.call_response.as_mut() {
            Some(r) if ty == 6 => f(&mut r.headers).map_err(|e| (Unavailable::Status(e), false)),
            Some(r) => f(&mut r.trailers).map_err(|e| (Unavailable::Status(e), false)),
            None => fail(Unavailable::Map),
        },
        _ => fail(Unavailable::Status(status::BAD_ARGUMENT)),
    }
}

/// The key a hostcall names in map `ty` (request headers: `host` is `:authority`).
fn map_key(ty: i32, key: String) -> String {
    if ty == 0 && key == "host" {
        ":authority".to_string()
    } else {
        key
    }
}

/// The headers Envoy 1.40's request header map keeps inline: its own and those its extensions
/// register (the release binary's startup log, "HTTP header map info", lists them).
const INLINE_REQUEST_HEADERS: &[&str] = &[
    ":authority",
    ":method",
    ":path",
    ":protocol",
    ":scheme",
    "accept",
    "accept-encoding",
    "access-control-request-headers",
    "access-control-request-method",
    "access-control-request-private-network",
    "authentication",
    "authorization",
    "cache-control",
    "cdn-loop",
    "connection",
    "content-encoding",
    "content-length",
    "content-type",
    "expect",
    "grpc-accept-encoding",
    "grpc-timeout",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "keep-alive",
    "origin",
    "pragma",
    "proxy-connection",
    "proxy-status",
    "referer",
    "te",
    "transfer-encoding",
    "upgrade",
    "user-agent",
    "via",
    "x-client-trace-id",
    "x-envoy-attempt-count",
    "x-envoy-decorator-operation",
    "x-envoy-downstream-service-cluster",
    "x-envoy-downstream-service-node",
    "x-envoy-expected-rq-timeout-ms",
    "x-envoy-external-address",
    "x-envoy-force-trace",
    "x-envoy-hedge-on-per-try-timeout",
    "x-envoy-internal",
    "x-envoy-ip-tags",
    "x-envoy-is-timeout-retry",
    "x-envoy-max-retries",
    "x-envoy-original-host",
    "x-envoy-original-path",
    "x-envoy-original-url",
    "x-envoy-retriable-header-names",
    "x-envoy-retriable-status-codes",
    "x-envoy-retry-grpc-on",
    "x-envoy-retry-on",
    "x-envoy-upstream-alt-stat-name",
    "x-envoy-upstream-rq-per-try-timeout-ms",
    "x-envoy-upstream-rq-timeout-alt-response",
    "x-envoy-upstream-rq-timeout-ms",
    "x-envoy-upstream-stream-duration-ms",
    "x-forwarded-client-cert",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-port",
    "x-forwarded-proto",
    "x-request-id",
];

/// The same for Envoy 1.40's response header map (also a callout response's headers).
const INLINE_RESPONSE_HEADERS: &[&str] = &[
    ":status",
    "access-control-allow-credentials",
    "access-control-allow-headers",
    "access-control-allow-methods",
    "access-control-allow-origin",
    "access-control-allow-private-network",
    "access-control-expose-headers",
    "access-control-max-age",
    "age",
    "cache-control",
    "connection",
    "content-encoding",
    "content-length",
    "content-type",
    "date",
    "etag",
    "expires",
    "grpc-message",
    "grpc-status",
    "keep-alive",
    "last-modified",
    "location",
    "proxy-connection",
    "proxy-status",
    "server",
    "transfer-encoding",
    "upgrade",
    "vary",
    "via",
    "x-envoy-attempt-count",
    "x-envoy-decorator-operation",
    "x-envoy-degraded",
    "x-envoy-immediate-health-check-fail",
    "x-envoy-ratelimited",
    "x-envoy-upstream-canary",
    "x-envoy-upstream-healthchecked-cluster",
    "x-envoy-upstream-service-time",
    "x-request-id",
];

/// The same for the response trailer map (the request trailer map has none).
const INLINE_RESPONSE_TRAILERS: &[&str] = &["grpc-message", "grpc-status"];

/// Whether Envoy keeps header `key` of map `ty` inline.
fn inline(ty: i32, key: &str) -> bool {
    let names = match ty {
        0 => INLINE_REQUEST_HEADERS,
        2 | 6 => INLINE_RESPONSE_HEADERS,
        3 | 7 => INLINE_RESPONSE_TRAILERS,
        _ => &[],
    };
    names.contains(&key)
}

/// Adds a header to map `ty` as Envoy's `HeaderMapImpl::addCopy` does: to an inline header the
/// map has, the value is appended (`appendToHeader`: `a,b`; no comma after an empty value,
/// nothing for an empty one); else a new entry.
pub fn add_to(ty: i32, m: &mut HeaderMap, key: String, val: Vec<u8>) {
    let key = map_key(ty, key);
    if inline(ty, &key) {
        if let Some((_, v)) = m.iter_mut().find(|(k, _)| *k == key) {
            if !val.is_empty() {
                if !v.is_empty() {
                    v.push(b',');
                }
                v.extend_from_slice(&val);
            }
            return;
        }
    }
    m.push((key, val));
}

/// The status of a failed map access (Envoy `getHeaderMapValue`/`addHeaderMapValue`...): an
/// unavailable map is BadArgument, or NotFound in the access-log phase.
fn map_status(e: (Unavailable, bool)) -> i32 {
    match e {
        (Unavailable::Map, true) => status::NOT_FOUND,
        (Unavailable::Map, false) => status::BAD_ARGUMENT,
        (Unavailable::Status(c), _) => c,
    }
}

fn map_code(r: Result<(), (Unavailable, bool)>) -> i32 {
    match r {
        Ok(()) => status::OK,
        Err(e) => map_status(e),
    }
}

/// Register the group.
pub fn add(l: &mut Registrar<'_>) -> anyhow::Result<()> {
    l.func(
        "proxy_get_header_map_pairs",
        |mut c: Caller<'_, HostState>, ty: i32, pp: i32, sp: i32| -> i32 {
            // An unavailable map reads as no headers (cpp-host `get_header_map_pairs`: Ok, and
            // an empty result is a null pointer with size 0).
            let bytes = match with_map(&mut c, ty, false, |m| Ok(marshal_pairs(m))) {
                Ok(b) if b.len() > 4 => b,
                Ok(_) | Err((Unavailable::Map, _)) => Vec::new(),
                Err(e) => return map_status(e),
            };
            match copy_out(&mut c, &bytes, pp, sp) {
                Ok(()) => status::OK,
                Err(e) => e,
            }
        },
    )?;
    l.func(
        "proxy_set_header_map_pairs",
        |mut c: Caller<'_, HostState>, ty: i32, p: i32, s: i32| -> i32 {
            let data = match read_bytes(&mut c, p, s) {
                Ok(d) => d,
                Err(e) => return e,
            };
            let Some(pairs) = unmarshal_pairs(&data) else { return status::BAD_ARGUMENT };
            // Envoy removes every header, then adds each pair (`setHeaderMapPairs`).
            map_code(with_map(&mut c, ty, true, |m| {
                m.clear();
                for (k, v) in pairs {
                    add_to(ty, m, k.to_ascii_lowercase(), v);
                }
                Ok(())
            }))
        },
    )?;
    l.func(
        "proxy_get_header_map_value",
        |mut c: Caller<'_, HostState>, ty: i32, kp: i32, ks: i32, vpp: i32, vsp: i32| -> i32 {
            let key = match read_string(&mut c, kp, ks) {
                Ok(k) => map_key(ty, k.to_ascii_lowercase()),
                Err(e) => return e,
            };
            let v = with_map(&mut c, ty, false, |m| {
                m.iter().find(|(k, _)| *k == key).map(|(_, v)| v.clone()).ok_or(status::NOT_FOUND)
            });
            match v {
                Ok(v) => match copy_out(&mut c, &v, vpp, vsp) {
                    Ok(()) => status::OK,
                    Err(e) => e,
                },
                Err(e) => map_status(e),
            }
        },
    )?;
    l.func(
        "proxy_replace_header_map_value",
        |mut c: Caller<'_, HostState>, ty: i32, kp: i32, ks: i32, vp: i32, vs: i32| -> i32 {
            let (key, val) = match (read_string(&mut c, kp, ks), read_bytes(&mut c, vp, vs)) {
                (Ok(k), Ok(v)) => (map_key(ty, k.to_ascii_lowercase()), v),
                (Err(e), _) | (_, Err(e)) => return e,
            };
            let r = with_map(&mut c, ty, true, |m| {
                if let Some(pos) = m.iter().position(|(k, _)| *k == key) {
                    m[pos].1 = val;
                    let mut i = pos + 1;
                    while i < m.len() {
                        if m[i].0 == key {
                            m.remove(i);
                        } else {
                            i += 1;
                        }
                    }
                } else {
                    m.push((key, val));
                }
                Ok(())
            });
            map_code(r)
        },
    )?;
    l.func(
        "proxy_remove_header_map_value",
        |mut c: Caller<'_, HostState>, ty: i32, kp: i32, ks: i32| -> i32 {
            let key = match read_string(&mut c, kp, ks) {
                Ok(k) => map_key(ty, k.to_ascii_lowercase()),
                Err(e) => return e,
            };
            map_code(with_map(&mut c, ty, true, |m| {
                m.retain(|(k, _)| *k != key);
                Ok(())
            }))
        },
    )?;
    l.func(
        "proxy_add_header_map_value",
        |mut c: Caller<'_, HostState>, ty: i32, kp: i32, ks: i32, vp: i32, vs: i32| -> i32 {
            let (key, val) = match (read_string(&mut c, kp, ks), read_bytes(&mut c, vp, vs)) {
                (Ok(k), Ok(v)) => (k.to_ascii_lowercase(), v),
                (Err(e), _) | (_, Err(e)) => return e,
            };
            map_code(with_map(&mut c, ty, true, |m| {
                add_to(ty, m, key, val);
                Ok(())
            }))
        },
    )?;
    Ok(())
}
