//! Buffers: `proxy_get_buffer_bytes`, `proxy_set_buffer_bytes`, `proxy_get_buffer_status`.
//!
//! Types: 0 request body, 1 response body, 4 HTTP call response body, 6 VM configuration,
//! 7 plugin configuration, 9 Redis call response (Higress). The request/response body is the
//! accumulated buffer (after a StopIterationAndWatermark answer only what came since), readable
//! only while this filter holds it (inside its body callbacks, or while buffering), otherwise an
//! empty buffer; callout/Redis buffers only inside their callbacks
//! (NotFound outside).

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
            // A body that is not available (not inside its callbacks, or on the root context) is
            // an empty read-only buffer, as Envoy's `buffer_.set(nullptr)`: reads are Ok and
            // empty, writes BadArgument.
            let Some(s) = st.effective_stream() else { return f(&mut ReadOnly(&[])) };
            let mut s = s.lock().map_err(|_| status::INTERNAL_FAILURE)?;
            let s = &mut *s;
            match ty {
                0 if s.req_body_access => f(&mut Owned(&mut s.req_body, s.req_body_from)),
                1 if s.resp_body_access => f(&mut Owned(&mut s.resp_body, s.resp_body_from)),
                _ => f(&mut ReadOnly(&[])),
            }
        }
        4 => match &st.call_response {
            Some(r) => f(&mut ReadOnly(&r.body)),
            None => Err(status::NOT_FOUND),
        },
        6 => f(&mut ReadOnly(&st.vm_config)),
        7 if st.configuring => f(&mut ReadOnly(&st.plugin_config)),
        7 => Err(status::NOT_FOUND),
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

/// The held body from the plugin's view's start (see `StreamState::req_body_from`).
struct Owned<'a>(&'a mut BytesMut, usize);
struct ReadOnly<'a>(&'a [u8]);

impl BufferAccess for Owned<'_> {
    fn bytes(&self) -> &[u8] {
        self.0.get(self.1..).unwrap_or_default()
    }
    /// Envoy `Buffer::copyFrom`: start 0 + len 0 prepends, start 0 + len >= size replaces,
    /// start >= size appends; anything else (a slice inside the buffer) is BadArgument. On the
    /// view: the held data before it stays as it is.
    fn set(&mut self, start: usize, len: usize, data: &[u8]) -> HResult<()> {
        let from = self.1.min(self.0.len());
        let size = self.0.len() - from;
        if start == 0 && len == 0 {
            let mut out = BytesMut::with_capacity(self.0.len() + data.len());
            out.extend_from_slice(&self.0[..from]);
            out.extend_from_slice(data);
            out.extend_from_slice(&self.0[from..]);
            *self.0 = out;
        } else if start == 0 && len >= size {
            self.0.truncate(from);
            self.0.extend_from_slice(data);
        } else if start >= size {
            self.0.extend_from_slice(data);
        } else {
            return Err(status::BAD_ARGUMENT);
        }
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
                Ok(()) => status::OK,
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
