//! Buffers: `proxy_get_buffer_bytes`, `proxy_set_buffer_bytes`, `proxy_get_buffer_status`.
//!
//! Types: 0 request body, 1 response body, 4 HTTP call response body, 6 VM configuration,
//! 7 plugin configuration, 9 Redis call response (Higress). The request/response body is the
//! accumulated buffer, readable only while this filter holds it (inside its body callbacks, or while
//! buffering); callout/Redis buffers only inside their callbacks.

use super::{copy_out, read_bytes, status, write_u32, HResult, HostState, Registrar};
use bytes::BytesMut;
use wasmtime::Caller;

fn with_buffer<R>(
    c: &mut Caller<'_, HostState>,
    ty: i32,
    f: impl FnOnce(&mut dyn BufferAccess) -> HResult<R>,
) -> HResult<R> {
    let st = c.data_mut();
    match ty {
        0 | 1 => {
            let s = st.effective_stream().ok_or(status::NOT_FOUND)?;
            let mut s = s.lock().map_err(|_| status::INTERNAL_FAILURE)?;
            if ty == 0 {
                if !s.req_body_access {
                    return Err(status::NOT_FOUND);
                }
                f(&mut Owned(&mut s.req_body))
            } else {
                if !s.resp_body_access {
                    return Err(status::NOT_FOUND);
                }
                f(&mut Owned(&mut s.resp_body))
            }
        }
        4 => match &st.call_response {
            Some(r) => f(&mut ReadOnly(&r.body)),
            None => Err(status::NOT_FOUND),
        },
        6 => f(&mut ReadOnly(&st.vm_config)),
        7 => f(&mut ReadOnly(&st.plugin_config)),
        9 => match &st.redis_response {
            Some(r) => f(&mut ReadOnly(r)),
            None => Err(status::NOT_FOUND),
        },
        _ => Err(status::BAD_ARGUMENT),
    }
}

trait BufferAccess {
    fn bytes(&self) -> &[u8];
    fn set(&mut self, start: usize, len: usize, data: &[u8]) -> HResult<()>;
}

struct Owned<'a>(&'a mut BytesMut);
struct ReadOnly<'a>(&'a [u8]);

impl BufferAccess for Owned<'_> {
    fn bytes(&self) -> &[u8] {
        self.0
    }
    /// Envoy semantics: start 0 + len 0 prepends, start 0 + len >= size replaces, start >= size
    /// appends; we also allow replacing any in-range slice.
    fn set(&mut self, start: usize, len: usize, data: &[u8]) -> HResult<()> {
        let size = self.0.len();
        if start > size {
            return Err(status::BAD_ARGUMENT);
        }
        let end = start.saturating_add(len).min(size);
        let mut out = BytesMut::with_capacity(size - (end - start) + data.len());
        out.extend_from_slice(&self.0[..start]);
        out.extend_from_slice(data);
        out.extend_from_slice(&self.0[end..]);
        *self.0 = out;
        Ok(())
    }
}

impl BufferAccess for ReadOnly<'_> {
    fn bytes(&self) -> &[u8] {
        self.0
    }
    fn set(&mut self, _: usize, _: usize, _: &[u8]) -> HResult<()> {
        Err(status::BAD_ARGUMENT)
    }
}

/// Register the group.
pub fn add(l: &mut Registrar<'_>) -> anyhow::Result<()> {
    l.func(
        "proxy_get_buffer_bytes",
        |mut c: Caller<'_, HostState>, ty: i32, start: i32, max: i32, pp: i32, sp: i32| -> i32 {
            let r = with_buffer(&mut c, ty, |b| {
                let data = b.bytes();
                let start = start as u32 as usize;
                // A max past the end is clamped; start past the end gives 0 bytes.
                if start >= data.len() {
                    return Ok(Vec::new());
                }
                let end = start.saturating_add(max as u32 as usize).min(data.len());
                Ok(data[start..end].to_vec())
            });
            match r {
                Ok(bytes) => match copy_out(&mut c, &bytes, pp, sp) {
                    Ok(()) => status::OK,
                    Err(e) => e,
                },
                Err(e) => e,
            }
        },
    )?;
    l.func(
        "proxy_set_buffer_bytes",
        |mut c: Caller<'_, HostState>, ty: i32, start: i32, len: i32, dp: i32, ds: i32| -> i32 {
            let data = match read_bytes(&mut c, dp, ds) {
                Ok(d) => d,
                Err(e) => return e,
            };
            match with_buffer(&mut c, ty, |b| {
                b.set(start as u32 as usize, len as u32 as usize, &data)
            }) {
                Ok(()) => {
                    if ty == 1 {
                        if let Some(s) = c.data().effective_stream() {
                            if let Ok(mut s) = s.lock() {
                                s.resp_body_modified = true;
                            }
                        }
                    }
                    status::OK
                }
                Err(e) => e,
            }
        },
    )?;
    l.func(
        "proxy_get_buffer_status",
        |mut c: Caller<'_, HostState>, ty: i32, len_ptr: i32, flags_ptr: i32| -> i32 {
            match with_buffer(&mut c, ty, |b| Ok(b.bytes().len())) {
                Ok(n) => {
                    if let Err(e) = write_u32(&mut c, len_ptr, n as u32) {
                        return e;
                    }
                    match write_u32(&mut c, flags_ptr, 0) {
                        Ok(()) => status::OK,
                        Err(e) => e,
                    }
                }
                Err(e) => e,
            }
        },
    )?;
    Ok(())
}
