//! Header maps: `proxy_get_header_map_pairs`, `proxy_set_header_map_pairs`,
//! `proxy_get_header_map_value`, `proxy_replace_header_map_value`, `proxy_remove_header_map_value`,
//! `proxy_add_header_map_value`.
//!
//! Map types: 0 request headers, 1 request trailers, 2 response headers, 3 response trailers,
//! 6 callout response headers, 7 callout response trailers. Request headers are accessible only
//! while this filter holds them (Envoy resets `request_headers_` on Continue).

use super::{
    copy_out, marshal_pairs, read_bytes, read_string, status, unmarshal_pairs, HResult, HeaderMap,
    HostState, Registrar,
};
use wasmtime::Caller;

fn with_map<R>(
    c: &mut Caller<'_, HostState>,
    ty: i32,
    write: bool,
    f: impl FnOnce(&mut HeaderMap) -> HResult<R>,
) -> HResult<R> {
    let st = c.data_mut();
    match ty {
        0..=3 => {
            let s = st.effective_stream().ok_or(status::NOT_FOUND)?;
            let mut s = s.lock().map_err(|_| status::INTERNAL_FAILURE)?;
            match ty {
                0 => {
                    if !s.req_hdr_access {
                        return Err(status::NOT_FOUND);
                    }
                    if write {
                        s.req_headers_modified = true;
                    }
                    f(&mut s.req_headers)
                }
                1 => f(&mut s.req_trailers),
                2 => {
                    if !s.resp_hdr_access {
                        return Err(status::NOT_FOUND);
                    }
                    f(&mut s.resp_headers)
                }
                _ => f(&mut s.resp_trailers),
            }
        }
        6 | 7 => match st.call_response.as_mut() {
            Some(r) if ty == 6 => f(&mut r.headers),
            Some(r) => f(&mut r.trailers),
            None => Err(status::NOT_FOUND),
        },
        _ => Err(status::BAD_ARGUMENT),
    }
}

/// Register the group.
pub fn add(l: &mut Registrar<'_>) -> anyhow::Result<()> {
    l.func(
        "proxy_get_header_map_pairs",
        |mut c: Caller<'_, HostState>, ty: i32, pp: i32, sp: i32| -> i32 {
            match with_map(&mut c, ty, false, |m| Ok(marshal_pairs(m))) {
                Ok(b) => match copy_out(&mut c, &b, pp, sp) {
                    Ok(()) => status::OK,
                    Err(e) => e,
                },
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
            match with_map(&mut c, ty, true, |m| {
                *m = pairs;
                Ok(())
            }) {
                Ok(()) => status::OK,
                Err(e) => e,
            }
        },
    )?;
    l.func(
        "proxy_get_header_map_value",
        |mut c: Caller<'_, HostState>, ty: i32, kp: i32, ks: i32, vpp: i32, vsp: i32| -> i32 {
            let key = match read_string(&mut c, kp, ks) {
                Ok(k) => k.to_ascii_lowercase(),
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
                Err(e) => e,
            }
        },
    )?;
    l.func(
        "proxy_replace_header_map_value",
        |mut c: Caller<'_, HostState>, ty: i32, kp: i32, ks: i32, vp: i32, vs: i32| -> i32 {
            let (key, val) = match (read_string(&mut c, kp, ks), read_bytes(&mut c, vp, vs)) {
                (Ok(k), Ok(v)) => (k.to_ascii_lowercase(), v),
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
            super::code(r)
        },
    )?;
    l.func(
        "proxy_remove_header_map_value",
        |mut c: Caller<'_, HostState>, ty: i32, kp: i32, ks: i32| -> i32 {
            let key = match read_string(&mut c, kp, ks) {
                Ok(k) => k.to_ascii_lowercase(),
                Err(e) => return e,
            };
            super::code(with_map(&mut c, ty, true, |m| {
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
            super::code(with_map(&mut c, ty, true, |m| {
                m.push((key, val));
                Ok(())
            }))
        },
    )?;
    Ok(())
}
