//! Stream control: `proxy_continue_stream`, `proxy_close_stream`, `proxy_send_local_response`,
//! `proxy_get_status`, `proxy_set_effective_context`, `proxy_done`, `proxy_call_foreign_function`
//! (and the 0_1_0 names `proxy_continue_request` / `proxy_continue_response`).
//!
//! `continue_stream` and `send_local_response` are deferred until the current VM call returns
//! (Envoy `addAfterVmCallAction`); `send_local_response` forces the current callback's result to
//! StopAll; a second one is Ok and has no effect.

use super::{
    copy_out, defer, read_bytes, read_string, status, unmarshal_pairs, write_u32, Action,
    HostState, LocalReply, Registrar,
};
use bytes::Bytes;
use wasmtime::Caller;

/// Envoy `Context::continueStream`: the continue itself is deferred until the VM call returns,
/// but the request headers and body stop being accessible at once (whichever direction is
/// continued). On the root context (e.g. after switching to a stream that is gone failed) there
/// is nothing to continue: Ok.
fn continue_stream(c: &mut Caller<'_, HostState>, ty: i32) -> i32 {
    let st = c.data_mut();
    let action = match ty {
        0 => Action::ContinueRequest,
        1 => Action::ContinueResponse,
        _ => return status::BAD_ARGUMENT,
    };
    let Some(stream) = st.effective_stream() else { return status::OK };
    if let Ok(mut s) = stream.lock() {
        s.req_hdr_access = false;
        s.req_body_access = false;
    }
    defer(st, action);
    status::OK
}

/// Register the group.
pub fn add(l: &mut Registrar<'_>) -> anyhow::Result<()> {
    l.func("proxy_continue_stream", |mut c: Caller<'_, HostState>, ty: i32| -> i32 {
        continue_stream(&mut c, ty)
    })?;
    l.func("proxy_continue_request", |mut c: Caller<'_, HostState>| -> i32 {
        continue_stream(&mut c, 0)
    })?;
    l.func("proxy_continue_response", |mut c: Caller<'_, HostState>| -> i32 {
        continue_stream(&mut c, 1)
    })?;
    // Envoy `Context::closeStream`: Request/Response reset the HTTP stream (Ok, also on the
    // root context where there is none); Downstream/Upstream are for network filters.
    l.func("proxy_close_stream", |mut c: Caller<'_, HostState>, ty: i32| -> i32 {
        if !matches!(ty, 0 | 1) {
            return status::BAD_ARGUMENT;
        }
        let st = c.data_mut();
        if st.effective_stream().is_some() {
            defer(st, Action::Reset);
        }
        status::OK
    })?;
    l.func(
        "proxy_send_local_response",
        |mut c: Caller<'_, HostState>,
         code: i32,
         dp: i32,
         ds: i32,
         bp: i32,
         bs: i32,
         hp: i32,
         hs: i32,
         _grpc: i32|
         -> i32 {
            let details = match read_string(&mut c, dp, ds) {
                Ok(d) => d,
                Err(e) => return e,
            };
            let body = match read_bytes(&mut c, bp, bs) {
                Ok(b) => b,
                Err(e) => return e,
            };
            let hdrs = match read_bytes(&mut c, hp, hs) {
                Ok(h) => h,
                Err(e) => return e,
            };
            let Some(headers) = unmarshal_pairs(&hdrs) else { return status::BAD_ARGUMENT };
            let st = c.data_mut();
            // Envoy 1.40 `Context::sendLocalResponse` defers every call and returns Ok, also a
            // second one in the same callback (the first reply wins) and one on the root context
            // (no stream: nothing is sent).
            if st.effective_stream().is_none() {
                return status::OK;
            }
            st.local_reply_in_call = true;
            let status_code =
                u16::try_from(code).ok().filter(|c| (100..=999).contains(c)).unwrap_or(500);
            defer(
                st,
                Action::LocalReply(LocalReply {
                    status: status_code,
                    details,
                    body: Bytes::from(body),
                    headers,
                }),
            );
            status::OK
        },
    )?;
    l.func(
        "proxy_get_status",
        |mut c: Caller<'_, HostState>, codep: i32, mpp: i32, msp: i32| -> i32 {
            let (code, msg) = c.data().last_status.clone();
            if let Err(e) = write_u32(&mut c, codep, code) {
                return e;
            }
            match copy_out(&mut c, msg.as_bytes(), mpp, msp) {
                Ok(()) => status::OK,
                Err(e) => e,
            }
        },
    )?;
    l.func("proxy_set_effective_context", |mut c: Caller<'_, HostState>, ctx: i32| -> i32 {
        let st = c.data_mut();
        let ctx = ctx as u32;
        if ctx == st.root_id || st.streams.contains_key(&ctx) {
            st.effective_ctx = ctx;
            status::OK
        } else {
            // Deleted or unknown context: the SDKs drop the callback on this result.
            status::BAD_ARGUMENT
        }
    })?;
    // Only a root context whose `proxy_on_done` returned false may say it is done (cpp-host
    // `WasmBase::done`: NotFound otherwise, also inside that on_done, which has not returned
    // yet). Envoy calls a root's on_done only as it destroys the VM at exit, after which no
    // callback runs that could call it: NotFound always (conformance test
    // `at_exit_a_root_context_that_is_not_done_gets_nothing_more`).
    l.func("proxy_done", |_c: Caller<'_, HostState>| -> i32 { status::NOT_FOUND })?;
    l.func(
        "proxy_call_foreign_function",
        |_c: Caller<'_, HostState>,
         _np: i32,
         _ns: i32,
         _ap: i32,
         _as: i32,
         _rpp: i32,
         _rsp: i32|
         -> i32 { status::NOT_FOUND },
    )?;
    Ok(())
}
