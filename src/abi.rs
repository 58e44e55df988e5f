//! The proxy-wasm ABI layer: the ONLY module with `unsafe`.
//!
//! Why our own: the crates.io `proxy-wasm` crate always exports `proxy_abi_version_0_2_1`, under
//! which Higress turns a header StopIteration into StopAllIterationAndWatermark, so the plugin would
//! never see the body before the upstream is chosen. We export `proxy_abi_version_0_2_100` (and no
//! other marker) plus Higress's extensions (Redis calls, upstream hosts, override host).
//!
//! Structure: `extern "C"` imports (module `env`), small safe wrappers, [`WasmHost`] (the
//! [`Host`] implementation), and the exported callbacks, which look up the root context's
//! [`Filter`] and call it. Compiled only for `target_arch = "wasm32"`.
#![allow(unsafe_code)]

use crate::filter::Filter;
use crate::host::{
    Counter, Host, HostError, HttpCallRequest, HttpReply, LogLevel, RedisInit, RedisReply,
    UpstreamHost,
};
use crate::types::{BufferType, DataAction, HeaderAction, MapType, MetricType, StreamType};
use rustc_hash::FxHashMap;
use std::cell::RefCell;
use std::collections::HashMap;

mod sys {
    use crate::types::{BufferType, LogLevel, MapType, MetricType, StreamType};

    // Statuses come back as `u32`: the host may answer a value this plugin does not know, so they
    // are matched (`status`, `get_bytes`), never transmuted into an enum.
    #[link(wasm_import_module = "env")]
    extern "C" {
        pub fn proxy_log(level: LogLevel, msg: *const u8, len: usize) -> u32;
        pub fn proxy_get_current_time_nanoseconds(out: *mut u64) -> u32;
        pub fn proxy_set_tick_period_milliseconds(ms: u32) -> u32;
        pub fn proxy_get_buffer_bytes(
            t: BufferType,
            start: usize,
            max: usize,
            out: *mut *mut u8,
            out_len: *mut usize,
        ) -> u32;
        pub fn proxy_get_header_map_pairs(
            t: MapType,
            out: *mut *mut u8,
            out_len: *mut usize,
        ) -> u32;
        pub fn proxy_get_header_map_value(
            t: MapType,
            key: *const u8,
            key_len: usize,
            out: *mut *mut u8,
            out_len: *mut usize,
        ) -> u32;
        pub fn proxy_replace_header_map_value(
            t: MapType,
            key: *const u8,
            key_len: usize,
            v: *const u8,
            v_len: usize,
        ) -> u32;
        pub fn proxy_remove_header_map_value(t: MapType, key: *const u8, key_len: usize) -> u32;
        pub fn proxy_get_property(
            path: *const u8,
            path_len: usize,
            out: *mut *mut u8,
            out_len: *mut usize,
        ) -> u32;
        pub fn proxy_set_property(
            path: *const u8,
            path_len: usize,
            v: *const u8,
            v_len: usize,
        ) -> u32;
        pub fn proxy_get_shared_data(
            key: *const u8,
            key_len: usize,
            out: *mut *mut u8,
            out_len: *mut usize,
            cas: *mut u32,
        ) -> u32;
        pub fn proxy_set_shared_data(
            key: *const u8,
            key_len: usize,
            v: *const u8,
            v_len: usize,
            cas: u32,
        ) -> u32;
        pub fn proxy_continue_stream(stream_type: StreamType) -> u32;
        pub fn proxy_send_local_response(
            status: u32,
            details: *const u8,
            details_len: usize,
            body: *const u8,
            body_len: usize,
            headers: *const u8,
            headers_len: usize,
            grpc_status: i32,
        ) -> u32;
        pub fn proxy_http_call(
            upstream: *const u8,
            upstream_len: usize,
            headers: *const u8,
            headers_len: usize,
            body: *const u8,
            body_len: usize,
            trailers: *const u8,
            trailers_len: usize,
            timeout_ms: u32,
            token: *mut u32,
        ) -> u32;
        pub fn proxy_set_effective_context(ctx: u32) -> u32;
        pub fn proxy_done() -> u32;
        pub fn proxy_define_metric(
            t: MetricType,
            name: *const u8,
            name_len: usize,
            id: *mut u32,
        ) -> u32;
        pub fn proxy_increment_metric(id: u32, offset: i64) -> u32;
        // Higress extensions.
        pub fn proxy_redis_init(
            cluster: *const u8,
            cluster_len: usize,
            user: *const u8,
            user_len: usize,
            pass: *const u8,
            pass_len: usize,
            timeout_ms: u32,
        ) -> u32;
        pub fn proxy_redis_call(
            cluster: *const u8,
            cluster_len: usize,
            query: *const u8,
            query_len: usize,
            token: *mut u32,
        ) -> u32;
        pub fn proxy_get_upstream_hosts(out: *mut *mut u8, out_len: *mut usize) -> u32;
        pub fn proxy_set_upstream_override_host(addr: *const u8, addr_len: usize) -> u32;
    }

    #[link(wasm_import_module = "wasi_snapshot_preview1")]
    extern "C" {
        pub fn random_get(buf: *mut u8, len: usize) -> u16;
        pub fn clock_time_get(clock_id: u32, precision: u64, time: *mut u64) -> u16;
    }
}

fn status(code: u32) -> Result<(), HostError> {
    if code == 0 {
        Ok(())
    } else {
        Err(HostError::from_status(code))
    }
}

/// Takes ownership of host-written memory (allocated through `proxy_on_memory_allocate`).
fn take_host_bytes(ptr: *mut u8, len: usize) -> Vec<u8> {
    if ptr.is_null() || len == 0 {
        return Vec::new();
    }
    // SAFETY: the host wrote `len` bytes into a buffer it obtained from `proxy_on_memory_allocate`
    // with exactly this size, which is a `Vec<u8>` allocation of capacity `len` that we leaked.
    unsafe { Vec::from_raw_parts(ptr, len, len) }
}

fn get_bytes(
    f: impl FnOnce(*mut *mut u8, *mut usize) -> u32,
) -> Result<Option<Vec<u8>>, HostError> {
    let mut ptr: *mut u8 = std::ptr::null_mut();
    let mut len: usize = 0;
    match f(&mut ptr, &mut len) {
        0 => Ok(if ptr.is_null() { None } else { Some(take_host_bytes(ptr, len)) }),
        1 => Ok(None),
        code => Err(HostError::from_status(code)),
    }
}

fn buffer_bytes(t: BufferType, start: usize, max: usize) -> Option<Vec<u8>> {
    if max == 0 {
        return Some(Vec::new());
    }
    // SAFETY: out-pointers are valid locals; see take_host_bytes.
    get_bytes(|p, l| unsafe { sys::proxy_get_buffer_bytes(t, start, max, p, l) }).ok().flatten()
}

fn header_value(map: MapType, name: &str) -> Option<String> {
    // SAFETY: name is a valid slice; out-pointers are valid locals.
    let v = get_bytes(|p, l| unsafe {
        sys::proxy_get_header_map_value(map, name.as_ptr(), name.len(), p, l)
    })
    .ok()??;
    String::from_utf8(v).ok()
}

fn set_effective_context(ctx: u32) -> bool {
    // SAFETY: plain integer argument.
    unsafe { sys::proxy_set_effective_context(ctx) == 0 }
}

/// The [`Host`] implementation over the hostcalls. Zero-sized: state lives in the host.
pub struct WasmHost;

thread_local! {
    static METRIC_IDS: RefCell<HashMap<String, u32>> = RefCell::new(HashMap::new());
    /// What the host lists this VM read said about each host, for reading the next one cheaply.
    static HOST_LISTS: RefCell<crate::pairs::HostListMemo> = RefCell::default();
}

impl Host for WasmHost {
    fn log(&self, level: LogLevel, msg: &str) {
        // SAFETY: msg is a valid slice.
        unsafe {
            sys::proxy_log(level, msg.as_ptr(), msg.len());
        }
    }
    /// WASI's monotonic clock (Envoy's steady clock, the same in every worker): everything the
    /// plugin times is an interval (leases, the breaker, slow picks, scrapes, decode speeds), and
    /// proxy-wasm's current time is the wall clock, which a step of the gateway's clock (NTP, a
    /// VM resumed) would move backwards or forwards. The wall clock only if a host lacks it.
    fn now_nanos(&self) -> u64 {
        const CLOCK_MONOTONIC: u32 = 1;
        let mut t: u64 = 0;
        // SAFETY: t is a valid local.
        if unsafe { sys::clock_time_get(CLOCK_MONOTONIC, 1, &mut t) } == 0 {
            return t;
        }
        // SAFETY: t is a valid local.
        unsafe {
            sys::proxy_get_current_time_nanoseconds(&mut t);
        }
        t
    }
    /// proxy-wasm's current time: Envoy's system clock, which the gateways share within their
    /// clocks' skew.
    fn unix_seconds(&self) -> u64 {
        let mut t: u64 = 0;
        // SAFETY: t is a valid local.
        unsafe {
            sys::proxy_get_current_time_nanoseconds(&mut t);
        }
        t / 1_000_000_000
    }
    fn random_u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        // SAFETY: b is a valid 8-byte buffer.
        let rc = unsafe { sys::random_get(b.as_mut_ptr(), b.len()) };
        if rc != 0 {
            // Never fail the request for randomness: fall back to the clock's low bits.
            return self.now_nanos().wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
        u64::from_le_bytes(b)
    }
    fn get_property(&self, path: &[&str]) -> Option<Vec<u8>> {
        let joined = path.join("\0");
        // SAFETY: joined is a valid slice; out-pointers are valid locals.
        get_bytes(|p, l| unsafe { sys::proxy_get_property(joined.as_ptr(), joined.len(), p, l) })
            .ok()
            .flatten()
    }
    fn set_property(&mut self, path: &[&str], value: &[u8]) -> Result<(), HostError> {
        let joined = path.join("\0");
        // SAFETY: valid slices.
        status(unsafe {
            sys::proxy_set_property(joined.as_ptr(), joined.len(), value.as_ptr(), value.len())
        })
    }
    fn request_header(&self, name: &str) -> Option<String> {
        header_value(MapType::HttpRequestHeaders, name)
    }
    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        // SAFETY: valid slices.
        unsafe {
            match value {
                Some(v) => sys::proxy_replace_header_map_value(
                    MapType::HttpRequestHeaders,
                    name.as_ptr(),
                    name.len(),
                    v.as_ptr(),
                    v.len(),
                ),
                None => sys::proxy_remove_header_map_value(
                    MapType::HttpRequestHeaders,
                    name.as_ptr(),
                    name.len(),
                ),
            };
        }
    }
    fn request_body(&self, max: usize) -> Option<Vec<u8>> {
        buffer_bytes(BufferType::HttpRequestBody, 0, max)
    }
    fn response_header(&self, name: &str) -> Option<String> {
        header_value(MapType::HttpResponseHeaders, name)
    }
    fn response_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        buffer_bytes(BufferType::HttpResponseBody, start, max)
    }
    fn upstream_hosts(&self) -> Option<Vec<UpstreamHost>> {
        // SAFETY: out-pointers are valid locals.
        match get_bytes(|p, l| unsafe { sys::proxy_get_upstream_hosts(p, l) }) {
            Ok(Some(b)) => HOST_LISTS.with(|m| match m.try_borrow_mut() {
                Ok(mut memo) => memo.parse(&b),
                Err(_) => crate::pairs::parse_upstream_hosts(&b),
            }),
            // Ok with no data: an empty list (every host gone) — the policies pass through.
            Ok(None) => Some(Vec::new()),
            Err(_) => None,
        }
    }
    fn set_upstream_override_host(&mut self, addr: &str) -> Result<(), HostError> {
        // SAFETY: valid slice.
        status(unsafe { sys::proxy_set_upstream_override_host(addr.as_ptr(), addr.len()) })
    }
    fn redis_init(&mut self, init: &RedisInit) -> Result<(), HostError> {
        let RedisInit { cluster, username, password, timeout_ms } = init;
        // SAFETY: valid slices.
        status(unsafe {
            sys::proxy_redis_init(
                cluster.as_ptr(),
                cluster.len(),
                username.as_ptr(),
                username.len(),
                password.as_ptr(),
                password.len(),
                *timeout_ms,
            )
        })
    }
    fn redis_call(&mut self, cluster: &str, query: &[u8]) -> Result<u32, HostError> {
        let mut token = 0u32;
        // SAFETY: valid slices and local.
        status(unsafe {
            sys::proxy_redis_call(
                cluster.as_ptr(),
                cluster.len(),
                query.as_ptr(),
                query.len(),
                &mut token,
            )
        })?;
        Ok(token)
    }
    fn http_call(&mut self, call: &HttpCallRequest<'_>) -> Result<u32, HostError> {
        let HttpCallRequest { cluster, headers, body, timeout_ms } = *call;
        let h = crate::pairs::serialize(headers);
        let t = crate::pairs::serialize::<&str, &str>(&[]);
        let b = body.unwrap_or(&[]);
        let mut token = 0u32;
        // SAFETY: valid slices and local.
        status(unsafe {
            sys::proxy_http_call(
                cluster.as_ptr(),
                cluster.len(),
                h.as_ptr(),
                h.len(),
                b.as_ptr(),
                b.len(),
                t.as_ptr(),
                t.len(),
                timeout_ms,
                &mut token,
            )
        })?;
        Ok(token)
    }
    fn get_shared_data(&self, key: &str) -> (Option<Vec<u8>>, u32) {
        let mut cas = 0u32;
        // SAFETY: valid slice and locals.
        let r = get_bytes(|p, l| unsafe {
            sys::proxy_get_shared_data(key.as_ptr(), key.len(), p, l, &mut cas)
        });
        match r {
            Ok(v) => (v, cas),
            Err(_) => (None, 0),
        }
    }
    fn set_shared_data(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), HostError> {
        // SAFETY: valid slices.
        status(unsafe {
            sys::proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas)
        })
    }
    fn send_local_response(&mut self, status_code: u32, body: &[u8], headers: &[(&str, &str)]) {
        let h = crate::pairs::serialize(headers);
        let details = "ai_load_balancer";
        // SAFETY: valid slices.
        unsafe {
            sys::proxy_send_local_response(
                status_code,
                details.as_ptr(),
                details.len(),
                body.as_ptr(),
                body.len(),
                h.as_ptr(),
                h.len(),
                -1,
            );
        }
    }
    fn resume_request(&mut self) {
        // SAFETY: plain integer argument.
        unsafe {
            sys::proxy_continue_stream(StreamType::HttpRequest);
        }
    }
    fn set_effective_stream(&mut self, ctx: u32) -> bool {
        set_effective_context(ctx)
    }
    fn set_response_header(&mut self, name: &str, value: &str) {
        // SAFETY: valid slices.
        unsafe {
            sys::proxy_replace_header_map_value(
                MapType::HttpResponseHeaders,
                name.as_ptr(),
                name.len(),
                value.as_ptr(),
                value.len(),
            );
        }
    }
    fn root_done(&mut self) {
        // SAFETY: no arguments. NotFound (the root is not stopping) leaves nothing to do.
        unsafe {
            sys::proxy_done();
        }
    }
    fn increment_counter(&mut self, counter: Counter, delta: i64) {
        if let Some(id) = metric_id(counter) {
            // SAFETY: plain integer arguments.
            unsafe {
                sys::proxy_increment_metric(id, delta);
            }
        }
    }
    fn define_counter(&mut self, counter: Counter) {
        let _ = metric_id(counter);
    }
}

/// The host's id of `counter`'s metric, defined on first use (`None` if the host refused it).
fn metric_id(counter: Counter) -> Option<u32> {
    let name = counter.name();
    METRIC_IDS.with(|m| {
        let mut m = m.try_borrow_mut().ok()?;
        if let Some(id) = m.get(name) {
            return Some(*id);
        }
        let mut id = 0u32;
        // SAFETY: valid slice and local.
        let rc = unsafe {
            sys::proxy_define_metric(MetricType::Counter, name.as_ptr(), name.len(), &mut id)
        };
        if rc != 0 {
            return None;
        }
        m.insert(name.to_string(), id);
        Some(id)
    })
}

/// All contexts of this VM: root contexts own a [`Filter`]; streams map to their root.
#[derive(Default)]
struct Vm {
    roots: FxHashMap<u32, Filter>,
    stream_root: FxHashMap<u32, u32>,
}

thread_local! {
    static VM: RefCell<Vm> = RefCell::new(Vm::default());
}

/// A call reply that arrived while the VM state was busy (a host delivering it re-entrantly,
/// e.g. an inline HTTP-call failure): handled as soon as the outer callback's work is done, so the
/// stream waiting for it is never left paused.
enum Deferred {
    Http(u32, u32, HttpReply),
    Redis(u32, u32, RedisReply),
}

thread_local! {
    static DEFERRED: RefCell<Vec<Deferred>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with the filter of `ctx`'s root (ctx may be a stream or a root). Returns `default` if
/// there is none or the state is busy (never panics). Afterwards, handles deferred replies.
fn with_filter<R>(ctx: u32, default: R, f: impl FnOnce(&mut Filter, u32) -> R) -> R {
    let r = VM.with(|vm| {
        let Ok(mut vm) = vm.try_borrow_mut() else { return default };
        let root = if vm.roots.contains_key(&ctx) {
            ctx
        } else {
            match vm.stream_root.get(&ctx) {
                Some(r) => *r,
                None => return default,
            }
        };
        match vm.roots.get_mut(&root) {
            Some(filter) => f(filter, root),
            None => default,
        }
    });
    drain_deferred();
    r
}

fn vm_busy() -> bool {
    VM.with(|vm| vm.try_borrow_mut().is_err())
}

fn drain_deferred() {
    if vm_busy() {
        return; // the outermost with_filter drains
    }
    loop {
        let next = DEFERRED.with(|d| {
            d.try_borrow_mut()
                .ok()
                .and_then(|mut d| if d.is_empty() { None } else { Some(d.remove(0)) })
        });
        match next {
            Some(Deferred::Http(root, token, reply)) => deliver_http(root, token, &reply),
            Some(Deferred::Redis(root, token, reply)) => deliver_redis(root, token, &reply),
            None => return,
        }
    }
}

fn defer(d: Deferred) {
    DEFERRED.with(|q| {
        if let Ok(mut q) = q.try_borrow_mut() {
            q.push(d);
        }
    });
}

fn deliver_http(root: u32, token: u32, reply: &HttpReply) {
    with_filter(root, (), |f, _| {
        let active = f.stream_of_token(token).map(set_effective_context).unwrap_or(false);
        f.on_http_reply(&mut WasmHost, token, reply, active);
    });
}

fn deliver_redis(root: u32, token: u32, reply: &RedisReply) {
    with_filter(root, (), |f, _| {
        let active = f.stream_of_token(token).map(set_effective_context).unwrap_or(false);
        f.on_redis_reply(&mut WasmHost, token, reply, active);
    });
}

// ---- exported callbacks ----

/// The ABI marker: Higress binds header callbacks as ABI 0.3-style for this version, so a header
/// StopIteration stays a real StopIteration and the body keeps flowing to the plugin.
#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_100() {}

/// Memory for host-written data.
#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    let mut v: Vec<u8> = Vec::with_capacity(size);
    let p = v.as_mut_ptr();
    std::mem::forget(v);
    p
}

/// A root (`parent == 0`) or stream context is created.
#[no_mangle]
pub extern "C" fn proxy_on_context_create(ctx: u32, parent: u32) {
    VM.with(|vm| {
        if let Ok(mut vm) = vm.try_borrow_mut() {
            if parent == 0 {
                vm.roots.entry(ctx).or_default();
            } else if vm.roots.contains_key(&parent) {
                vm.stream_root.insert(ctx, parent);
            } else if let Some(r) = vm.stream_root.get(&parent).copied() {
                vm.stream_root.insert(ctx, r);
            }
        }
    });
}

/// VM start: nothing to do (config arrives in on_configure).
#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_root: u32, _size: usize) -> u32 {
    1
}

/// Plugin configuration. Returns 0 (fail start) only for an invalid config.
#[no_mangle]
pub extern "C" fn proxy_on_configure(root: u32, size: usize) -> u32 {
    let bytes = buffer_bytes(BufferType::PluginConfiguration, 0, size).unwrap_or_default();
    let (ok, tick) = with_filter(root, (false, 0), |f, _| {
        let mut host = WasmHost;
        let ok = f.configure(&mut host, &bytes);
        (ok, f.tick_period_ms())
    });
    // SAFETY: plain integer argument.
    unsafe {
        sys::proxy_set_tick_period_milliseconds(tick);
    }
    u32::from(ok)
}

/// Root tick.
#[no_mangle]
pub extern "C" fn proxy_on_tick(root: u32) {
    with_filter(root, (), |f, _| f.on_tick(&mut WasmHost));
}

/// Shared queue ready: unused.
#[no_mangle]
pub extern "C" fn proxy_on_queue_ready(_root: u32, _queue: u32) {}

/// Request headers.
#[no_mangle]
pub extern "C" fn proxy_on_request_headers(
    ctx: u32,
    _headers: usize,
    end_of_stream: u32,
) -> HeaderAction {
    with_filter(ctx, HeaderAction::Continue, |f, _| {
        f.on_request_headers(&mut WasmHost, ctx, end_of_stream != 0)
    })
}

/// Request body chunk (cumulative size when buffering).
#[no_mangle]
pub extern "C" fn proxy_on_request_body(ctx: u32, size: usize, end_of_stream: u32) -> DataAction {
    with_filter(ctx, DataAction::Continue, |f, _| {
        f.on_request_body(&mut WasmHost, ctx, size, end_of_stream != 0)
    })
}

/// Request trailers (the body ended without an end-of-stream body callback).
#[no_mangle]
pub extern "C" fn proxy_on_request_trailers(ctx: u32, _trailers: usize) -> HeaderAction {
    with_filter(ctx, HeaderAction::Continue, |f, _| f.on_request_trailers(&mut WasmHost, ctx))
}

/// Response headers.
#[no_mangle]
pub extern "C" fn proxy_on_response_headers(
    ctx: u32,
    _headers: usize,
    _end_of_stream: u32,
) -> HeaderAction {
    with_filter(ctx, (), |f, _| f.on_response_headers(&mut WasmHost, ctx));
    HeaderAction::Continue
}

/// Response body chunk.
#[no_mangle]
pub extern "C" fn proxy_on_response_body(ctx: u32, size: usize, end_of_stream: u32) -> DataAction {
    with_filter(ctx, (), |f, _| f.on_response_body(&mut WasmHost, ctx, size, end_of_stream != 0));
    DataAction::Continue
}

/// Response trailers: continue.
#[no_mangle]
pub extern "C" fn proxy_on_response_trailers(_ctx: u32, _trailers: usize) -> HeaderAction {
    HeaderAction::Continue
}

/// Access-log time: the stream is over (first of on_log / on_done / on_delete ends it).
#[no_mangle]
pub extern "C" fn proxy_on_log(ctx: u32) {
    with_filter(ctx, (), |f, _| f.on_stream_end(&mut WasmHost, ctx));
}

/// Context done: a stream ends; a root stops (not done while its releases are in flight: it calls
/// `proxy_done` when they are answered).
#[no_mangle]
pub extern "C" fn proxy_on_done(ctx: u32) -> u32 {
    with_filter(ctx, true, |f, root| {
        if root == ctx {
            f.on_stop(&mut WasmHost)
        } else {
            f.on_stream_end(&mut WasmHost, ctx);
            true
        }
    })
    .into()
}

/// Context deleted: forget it.
#[no_mangle]
pub extern "C" fn proxy_on_delete(ctx: u32) {
    with_filter(ctx, (), |f, _| f.on_delete(&mut WasmHost, ctx));
    VM.with(|vm| {
        if let Ok(mut vm) = vm.try_borrow_mut() {
            vm.stream_root.remove(&ctx);
            vm.roots.remove(&ctx);
        }
    });
}

/// An HTTP-call reply body larger than this is not read into the VM (the plugin's only calls are
/// metrics scrapes: a vLLM or SGLang `/metrics` is tens of KiB); the call then counts as a reply
/// without metrics. A VM's linear memory only grows, so one huge reply would cost it for good.
pub const MAX_HTTP_REPLY_BODY: usize = 4 << 20;

/// HTTP-call reply (on the root context).
#[no_mangle]
pub extern "C" fn proxy_on_http_call_response(
    root: u32,
    token: u32,
    _headers: usize,
    body_size: usize,
    _trailers: usize,
) {
    // Read the reply before switching context: the call-response buffers belong to the root call.
    // SAFETY: out-pointers are valid locals.
    let headers = get_bytes(|p, l| unsafe {
        sys::proxy_get_header_map_pairs(MapType::HttpCallResponseHeaders, p, l)
    })
    .ok()
    .flatten()
    .and_then(|b| crate::pairs::parse(&b))
    .unwrap_or_default();
    let headers: Vec<(String, String)> = headers
        .into_iter()
        .filter_map(|(k, v)| Some((String::from_utf8(k).ok()?, String::from_utf8(v).ok()?)))
        .collect();
    let status = headers
        .iter()
        .find(|(k, _)| k == ":status")
        .and_then(|(_, v)| v.parse::<u16>().ok())
        .unwrap_or(0);
    let body = if body_size > MAX_HTTP_REPLY_BODY {
        WasmHost.log(
            LogLevel::Warn,
            &format!(
                "ai-load-balancer: HTTP-call reply of {body_size} bytes not read (over \
                 {MAX_HTTP_REPLY_BODY}): no metrics from it"
            ),
        );
        Vec::new()
    } else {
        buffer_bytes(BufferType::HttpCallResponseBody, 0, body_size).unwrap_or_default()
    };
    let reply = HttpReply { status, headers, body };
    if vm_busy() {
        defer(Deferred::Http(root, token, reply));
    } else {
        deliver_http(root, token, &reply);
    }
}

/// Higress Redis reply (on the root context): switch to the stream that made the call, if alive.
#[no_mangle]
pub extern "C" fn proxy_on_redis_call_response(
    root: u32,
    token: u32,
    status: u32,
    response_size: usize,
) {
    // Buffer 9 is only valid during this callback: read it now, even if handling is deferred.
    let reply = if status == 0 {
        RedisReply::Ok(
            buffer_bytes(BufferType::RedisCallResponse, 0, response_size).unwrap_or_default(),
        )
    } else {
        RedisReply::NetworkError
    };
    if vm_busy() {
        defer(Deferred::Redis(root, token, reply));
    } else {
        deliver_redis(root, token, &reply);
    }
}
