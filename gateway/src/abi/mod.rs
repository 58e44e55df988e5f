//! Host side of the proxy-wasm ABI (0_2_1 / 0_2_100 + Higress extensions).
//!
//! One file per group of `docs: higress-abi.md §3.1`, so the code can be checked against the spec:
//! - [`logging`]: `proxy_log`, `proxy_get_log_level`, `proxy_get_current_time_nanoseconds`,
//!   `proxy_set_tick_period_milliseconds`
//! - [`buffers`]: `proxy_get_buffer_bytes`, `proxy_set_buffer_bytes`, `proxy_get_buffer_status`
//! - [`headers`]: `proxy_{get,set}_header_map_pairs`, `proxy_{get,replace,remove,add}_header_map_value`
//! - [`properties`]: `proxy_get_property`, `proxy_set_property`
//! - [`shared`]: shared data and shared queues
//! - [`stream`]: `proxy_continue_stream`, `proxy_close_stream`, `proxy_send_local_response`,
//!   `proxy_get_status`, `proxy_set_effective_context`, `proxy_done`, `proxy_call_foreign_function`
//! - [`calls`]: `proxy_http_call` and the gRPC calls (gRPC: Unimplemented)
//! - [`metrics`]: `proxy_define_metric`, `proxy_get_metric`, `proxy_record_metric`, `proxy_increment_metric`
//! - [`higress`]: `proxy_redis_init`, `proxy_redis_call`, `proxy_get_upstream_hosts`,
//!   `proxy_set_upstream_override_host`, `proxy_inject_encoded_data_to_filter_chain`
//! - [`wasi`]: WASI preview 1 from wasmtime-wasi, with the stdio calls replaced by synchronous ones.
//!
//! The hostcalls of the module's ABI version only, as cpp-host registers them; known proxy-wasm
//! hostcalls this host does not implement (gRPC, ...) are stubs returning Unimplemented (12);
//! any other `env` import refuses the module (Envoy: "missing import").

pub mod buffers;
pub mod calls;
pub mod headers;
pub mod higress;
pub mod logging;
pub mod metrics;
pub mod properties;
pub mod shared;
pub mod stream;
pub mod wasi;

pub use crate::global::{status, CallResponse, HeaderMap};
use crate::global::{Global, WorkerEvent};
use bytes::{Bytes, BytesMut};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;
use wasmtime::{Caller, Engine, Linker, Module, Val, ValType};

/// The ABI marker exported by the module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbiVersion {
    /// proxy_abi_version_0_1_0
    V0_1_0,
    /// proxy_abi_version_0_2_0
    V0_2_0,
    /// proxy_abi_version_0_2_1 (crates.io proxy-wasm)
    V0_2_1,
    /// proxy_abi_version_0_2_100 (Higress SDKs)
    V0_2_100,
}

impl AbiVersion {
    /// Detect from the module's exports as proxy-wasm-cpp-host does (`getAbiVersion`): the first
    /// *function* export named after a known version; other kinds and unknown versions are
    /// skipped. `None`: the host refuses the module ("Missing or unknown Proxy-Wasm ABI version").
    pub fn detect(module: &Module) -> Option<AbiVersion> {
        module.exports().find_map(|e| {
            if !matches!(e.ty(), wasmtime::ExternType::Func(_)) {
                return None;
            }
            match e.name() {
                "proxy_abi_version_0_1_0" => Some(AbiVersion::V0_1_0),
                "proxy_abi_version_0_2_0" => Some(AbiVersion::V0_2_0),
                "proxy_abi_version_0_2_1" => Some(AbiVersion::V0_2_1),
                "proxy_abi_version_0_2_100" => Some(AbiVersion::V0_2_100),
                _ => None,
            }
        })
    }
    /// cpp-host `convertVmCallResultToFilterHeadersStatus`: for abi_01/abi_02 a header `1`
    /// becomes StopAllIterationAndWatermark.
    pub fn pause_is_stop_all(self) -> bool {
        !matches!(self, AbiVersion::V0_2_100)
    }
}

/// What the filter chain does after a headers callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderAction {
    /// Continue (0), also ContinueAndEndStream (2).
    Continue,
    /// StopIteration (1) under 0_2_100: headers held, body callbacks continue.
    StopIteration,
    /// StopAllIterationAndBuffer/Watermark: headers held, body buffered without callbacks.
    StopAll,
}

impl HeaderAction {
    /// Convert a raw return value, as cpp-host does.
    pub fn from_raw(raw: i32, abi: AbiVersion, local_reply_in_call: bool) -> HeaderAction {
        if local_reply_in_call {
            return HeaderAction::StopAll;
        }
        match raw {
            0 | 2 => HeaderAction::Continue,
            1 if abi.pause_is_stop_all() => HeaderAction::StopAll,
            1 => HeaderAction::StopIteration,
            _ => HeaderAction::StopAll,
        }
    }
}

/// A local reply requested by the plugin or the gateway.
#[derive(Debug, Clone)]
pub struct LocalReply {
    /// HTTP status.
    pub status: u16,
    /// Response code details.
    pub details: String,
    /// Body.
    pub body: Bytes,
    /// Extra headers.
    pub headers: HeaderMap,
}

/// Request attributes for `request.*`, `source.*`, `destination.*` properties.
#[derive(Debug, Clone)]
pub struct RequestInfo {
    /// Protocol, e.g. `HTTP/1.1`.
    pub protocol: String,
    /// Request start.
    pub time: SystemTime,
    /// Downstream peer.
    pub source: SocketAddr,
    /// Local address.
    pub destination: SocketAddr,
    /// Connection id.
    pub connection_id: u64,
}

/// Per-stream state shared between the stream driver and the hostcalls.
#[derive(Debug)]
pub struct StreamState {
    /// Context id.
    pub id: u32,
    /// Request headers (pseudo-headers first).
    pub req_headers: HeaderMap,
    /// Plugin may read/write request headers (they are held by this filter).
    pub req_hdr_access: bool,
    /// Request headers were changed by the plugin (triggers a route re-match).
    pub req_headers_modified: bool,
    /// Buffered request body.
    pub req_body: BytesMut,
    /// Plugin may read/write the request body buffer.
    pub req_body_access: bool,
    /// Where the plugin's view of `req_body` starts: past the data held after a body callback
    /// answered StopIterationAndWatermark (Envoy's wasm filter keeps the body for the plugin
    /// only while it answers StopIterationAndBuffer; the filter manager still holds it all).
    pub req_body_from: usize,
    /// Request trailers.
    pub req_trailers: HeaderMap,
    /// Response headers (`:status` first).
    pub resp_headers: HeaderMap,
    /// Plugin may read/write response headers.
    pub resp_hdr_access: bool,
    /// Buffered response body.
    pub resp_body: BytesMut,
    /// Plugin may read/write the response body buffer.
    pub resp_body_access: bool,
    /// The same as `req_body_from` for `resp_body`.
    pub resp_body_from: usize,
    /// `proxy_on_log` is running: the request and response headers are readable (Envoy's
    /// access-log phase), a missing map is NotFound instead of BadArgument.
    pub log_phase: bool,
    /// Response trailers.
    pub resp_trailers: HeaderMap,
    /// Deferred `continue_stream(Request)` has been applied.
    pub continue_req: bool,
    /// Deferred `continue_stream(Response)` has been applied.
    pub continue_resp: bool,
    /// Deferred local reply.
    pub local_reply: Option<LocalReply>,
    /// `close_stream` was called.
    pub reset: bool,
    /// `set_upstream_override_host`.
    pub override_host: Option<String>,
    /// Current route index.
    pub route: Option<usize>,
    /// `route_name` property.
    pub route_name: String,
    /// `cluster_name` property.
    pub cluster_name: String,
    /// `clear_route_cache` set to `off`.
    pub clear_route_cache_off: bool,
    /// Decoder buffer limit in bytes.
    pub decoder_limit: usize,
    /// Encoder buffer limit in bytes.
    pub encoder_limit: usize,
    /// Properties set by the plugin.
    pub props: HashMap<String, Vec<u8>>,
    /// Request attributes.
    pub info: RequestInfo,
    /// Response code once known.
    pub response_code: Option<u16>,
    /// Chosen upstream host.
    pub upstream_host: Option<String>,
    /// Wakes the stream driver after an after-VM-call action.
    pub notify: Arc<tokio::sync::Notify>,
}

/// Decoder/encoder buffer limit of a stream until its listener's limit is applied: Higress's
/// default downstream connection buffer limit (32 KiB).
pub const DEFAULT_BUFFER_LIMIT: usize = crate::config::HIGRESS_DOWNSTREAM_BUFFER_LIMIT as usize;

impl StreamState {
    /// New stream state.
    pub fn new(id: u32, req_headers: HeaderMap, info: RequestInfo) -> StreamState {
        StreamState {
            id,
            req_headers,
            req_hdr_access: true,
            req_headers_modified: false,
            req_body: BytesMut::new(),
            req_body_access: false,
            req_body_from: 0,
            req_trailers: Vec::new(),
            resp_headers: Vec::new(),
            resp_hdr_access: false,
            resp_body: BytesMut::new(),
            resp_body_access: false,
            resp_body_from: 0,
            log_phase: false,
            resp_trailers: Vec::new(),
            continue_req: false,
            continue_resp: false,
            local_reply: None,
            reset: false,
            override_host: None,
            route: None,
            route_name: String::new(),
            cluster_name: String::new(),
            clear_route_cache_off: false,
            decoder_limit: DEFAULT_BUFFER_LIMIT,
            encoder_limit: DEFAULT_BUFFER_LIMIT,
            props: HashMap::new(),
            info,
            response_code: None,
            upstream_host: None,
            notify: Arc::new(tokio::sync::Notify::new()),
        }
    }
}

/// A deferred action, applied after the current VM call returns (Envoy `addAfterVmCallAction`).
#[derive(Debug)]
pub enum Action {
    /// `continue_stream(Request)`.
    ContinueRequest,
    /// `continue_stream(Response)`.
    ContinueResponse,
    /// `send_local_response`.
    LocalReply(LocalReply),
    /// `close_stream`.
    Reset,
}

/// Per-VM host state (one per worker VM instance).
pub struct HostState {
    /// WASI preview 1.
    pub wasi: wasmtime_wasi::p1::WasiP1Ctx,
    /// Process-wide state.
    pub g: Arc<Global>,
    /// Worker index.
    pub worker: usize,
    /// VM generation (bumped on re-instantiation after a trap).
    pub gen: u64,
    /// Detected ABI.
    pub abi: AbiVersion,
    /// The root context id.
    pub root_id: u32,
    /// Context the host called into.
    pub current_ctx: u32,
    /// Effective context (`proxy_set_effective_context`).
    pub effective_ctx: u32,
    /// Live stream contexts.
    pub streams: HashMap<u32, Arc<Mutex<StreamState>>>,
    /// Deferred actions of the current call.
    pub actions: Vec<(u32, Action)>,
    /// `send_local_response` was called during the current call.
    pub local_reply_in_call: bool,
    /// Callout response (valid during `proxy_on_http_call_response`).
    pub call_response: Option<CallResponse>,
    /// Redis reply (buffer 9, valid during `proxy_on_redis_call_response`).
    pub redis_response: Option<Bytes>,
    /// Per-cluster Redis clients of this worker.
    pub redis_clients: HashMap<String, crate::redis::RedisClient>,
    /// Next HTTP call token (4, 8, ...).
    pub next_http_token: u32,
    /// Next Redis call token (7, 11, ...).
    pub next_redis_token: u32,
    /// Tick period of the root context.
    pub tick_tx: tokio::sync::watch::Sender<u64>,
    /// Last callout status for `proxy_get_status`.
    pub last_status: (u32, String),
    /// VM configuration bytes.
    pub vm_config: Vec<u8>,
    /// Plugin configuration bytes.
    pub plugin_config: Vec<u8>,
    /// `proxy_on_configure` is running: only then can the plugin read its configuration (Envoy
    /// holds it for that call only; elsewhere the buffer is NotFound).
    pub configuring: bool,
    /// Events back to this worker (async results).
    pub events: tokio::sync::mpsc::UnboundedSender<WorkerEvent>,
    /// This worker's HTTP client (callouts).
    pub http_client: crate::body::HttpClient,
    /// Next context id (shared counter, never reused across VM generations).
    pub next_ctx: Arc<std::sync::atomic::AtomicU32>,
    /// The module's exported `memory` and allocator, resolved once after instantiation as
    /// cpp-host's `WasmBase::getFunctions` does: looking them up by name at every hostcall cost
    /// more than the rest of a small hostcall. `None` before instantiation, for a module without
    /// them, or for an allocator without the `(i32) -> i32` type (a hostcall that returns data
    /// then fails with InvalidMemoryAccess).
    pub exports: GuestExports,
}

/// The allocator exports in cpp-host's order (`WasmBase::getFunctions`): `malloc` first, so a
/// module with both (a TinyGo plugin) gets its buffers from the same allocator as in Envoy.
pub const ALLOCATOR_EXPORTS: [&str; 2] = ["malloc", "proxy_on_memory_allocate"];

/// See [`HostState::exports`].
#[derive(Default)]
pub struct GuestExports {
    /// The exported linear memory.
    pub memory: Option<wasmtime::Memory>,
    /// The allocator, typed.
    pub alloc: Option<wasmtime::TypedFunc<i32, i32>>,
}

impl HostState {
    /// The stream of the effective context, if it is a live stream.
    pub fn effective_stream(&self) -> Option<Arc<Mutex<StreamState>>> {
        self.streams.get(&self.effective_ctx).cloned()
    }
}

/// Hostcall result type: Err carries a proxy-wasm status.
pub type HResult<T> = Result<T, i32>;

/// Turn an `HResult<()>` into the i32 a hostcall returns.
pub fn code(r: HResult<()>) -> i32 {
    match r {
        Ok(()) => status::OK,
        Err(c) => c,
    }
}

fn memory(caller: &mut Caller<'_, HostState>) -> HResult<wasmtime::Memory> {
    caller.data().exports.memory.ok_or(status::INVALID_MEMORY_ACCESS)
}

/// Read guest bytes.
pub fn read_bytes(caller: &mut Caller<'_, HostState>, ptr: i32, len: i32) -> HResult<Vec<u8>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let mem = memory(caller)?;
    let data = mem.data(&*caller);
    let start = ptr as u32 as usize;
    let end = start.checked_add(len as u32 as usize).ok_or(status::INVALID_MEMORY_ACCESS)?;
    data.get(start..end).map(|s| s.to_vec()).ok_or(status::INVALID_MEMORY_ACCESS)
}

/// Read a guest string (lossy).
pub fn read_string(caller: &mut Caller<'_, HostState>, ptr: i32, len: i32) -> HResult<String> {
    Ok(String::from_utf8_lossy(&read_bytes(caller, ptr, len)?).into_owned())
}

/// Write guest bytes.
pub fn write_bytes(caller: &mut Caller<'_, HostState>, ptr: i32, bytes: &[u8]) -> HResult<()> {
    let mem = memory(caller)?;
    let data = mem.data_mut(&mut *caller);
    let start = ptr as u32 as usize;
    let end = start.checked_add(bytes.len()).ok_or(status::INVALID_MEMORY_ACCESS)?;
    data.get_mut(start..end).ok_or(status::INVALID_MEMORY_ACCESS)?.copy_from_slice(bytes);
    Ok(())
}

/// Write a little-endian u32.
pub fn write_u32(caller: &mut Caller<'_, HostState>, ptr: i32, v: u32) -> HResult<()> {
    write_bytes(caller, ptr, &v.to_le_bytes())
}

/// Allocate guest memory with the module's allocator and copy `bytes` there; write the pointer and
/// size to `ptr_ptr`/`size_ptr` (cpp-host `copyToPointerSize`: empty data gives a null pointer).
pub fn copy_out(
    caller: &mut Caller<'_, HostState>,
    bytes: &[u8],
    ptr_ptr: i32,
    size_ptr: i32,
) -> HResult<()> {
    let mut ptr = 0u32;
    if !bytes.is_empty() {
        let len = i32::try_from(bytes.len()).map_err(|_| status::INVALID_MEMORY_ACCESS)?;
        ptr = allocate(caller, len)?;
        write_bytes(caller, ptr as i32, bytes)?;
    }
    write_u32(caller, ptr_ptr, ptr)?;
    write_u32(caller, size_ptr, bytes.len() as u32)
}

/// `len` bytes from the module's allocator; a null pointer or a trap is an error.
fn allocate(caller: &mut Caller<'_, HostState>, len: i32) -> HResult<u32> {
    let alloc = caller.data().exports.alloc.clone().ok_or(status::INVALID_MEMORY_ACCESS)?;
    match alloc.call(&mut *caller, len).map_err(|_| status::INVALID_MEMORY_ACCESS)? as u32 {
        0 => Err(status::INVALID_MEMORY_ACCESS),
        p => Ok(p),
    }
}

/// Serialize pairs like cpp-host `PairsUtil::marshalPairs`.
pub fn marshal_pairs<V: AsRef<[u8]>>(pairs: &[(String, V)]) -> Vec<u8> {
    let size = 4 + pairs.iter().map(|(k, v)| 10 + k.len() + v.as_ref().len()).sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.as_ref().len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_ref());
        out.push(0);
    }
    out
}

/// Parse the pairs format; None if malformed.
pub fn unmarshal_pairs(data: &[u8]) -> Option<HeaderMap> {
    let rd = |at: usize| -> Option<u32> {
        data.get(at..at + 4).and_then(|s| s.try_into().ok()).map(u32::from_le_bytes)
    };
    if data.is_empty() {
        return Some(Vec::new());
    }
    let n = rd(0)? as usize;
    let mut sizes = Vec::with_capacity(n.min(1024));
    let mut at = 4;
    for _ in 0..n {
        sizes.push((rd(at)? as usize, rd(at + 4)? as usize));
        at += 8;
    }
    let mut out = Vec::with_capacity(sizes.len());
    for (kl, vl) in sizes {
        let k = data.get(at..at + kl)?;
        at += kl + 1;
        let v = data.get(at..at + vl)?;
        at += vl + 1;
        out.push((String::from_utf8_lossy(k).to_ascii_lowercase(), v.to_vec()));
    }
    Some(out)
}

/// The hostcalls cpp-host registers for some ABI versions only (`WasmBase::registerCallbacks`,
/// the same in Higress's fork, which gives 0_2_100 the 0_2_1 set): a module importing one its
/// marker does not have fails to link.
fn abi_specific(name: &str) -> Option<&'static [AbiVersion]> {
    use AbiVersion::*;
    match name {
        "proxy_get_configuration"
        | "proxy_continue_request"
        | "proxy_continue_response"
        | "proxy_clear_route_cache" => Some(&[V0_1_0]),
        "proxy_continue_stream" | "proxy_close_stream" => Some(&[V0_2_0, V0_2_1, V0_2_100]),
        "proxy_get_log_level" => Some(&[V0_2_1, V0_2_100]),
        _ => None,
    }
}

/// `env` functions Envoy (with Higress's additions) links that this host does not implement:
/// they are linked to a stub returning Unimplemented. Any other `env` import is missing, and
/// the module is refused as Envoy refuses it.
const KNOWN_UNIMPLEMENTED: &[&str] = &[
    "proxy_get_header_map_size",
    "proxy_grpc_call",
    "proxy_grpc_stream",
    "proxy_grpc_close",
    "proxy_grpc_cancel",
    "proxy_grpc_send",
    "proxy_get_configuration",
    "proxy_clear_route_cache",
    "proxy_inject_encoded_data_to_filter_chain",
    "envoy_resolve_dns",
    "pthread_equal",
    "emscripten_notify_memory_growth",
];

/// Build the linker with every hostcall group, then stub the known imports of `module` this host
/// does not implement. Fails, as Envoy's "missing import", for an import the module's ABI
/// version does not have or that no proxy-wasm host provides.
pub fn build_linker(
    engine: &Engine,
    module: &Module,
    abi: AbiVersion,
) -> anyhow::Result<Linker<HostState>> {
    let mut linker: Linker<HostState> = Linker::new(engine);
    wasi::add(&mut linker)?;
    let mut defined: HashSet<(String, String)> = HashSet::new();
    let mut l = Registrar { linker: &mut linker, defined: &mut defined };
    logging::add(&mut l)?;
    buffers::add(&mut l)?;
    headers::add(&mut l)?;
    properties::add(&mut l)?;
    shared::add(&mut l)?;
    stream::add(&mut l)?;
    calls::add(&mut l)?;
    metrics::add(&mut l)?;
    higress::add(&mut l)?;
    for imp in module.imports() {
        let key = (imp.module().to_string(), imp.name().to_string());
        let missing = || {
            anyhow::anyhow!(
                "Failed to load Wasm module due to a missing import: {}.{}",
                imp.module(),
                imp.name()
            )
        };
        if imp.module() == "wasi_snapshot_preview1" || imp.module() == "wasi_unstable" {
            if wasi::provided(imp.name()) {
                continue;
            }
        } else {
            if abi_specific(imp.name()).is_some_and(|v| !v.contains(&abi)) {
                return Err(missing());
            }
            if defined.contains(&key) {
                continue;
            }
            if imp.module() != "env" || !KNOWN_UNIMPLEMENTED.contains(&imp.name()) {
                return Err(missing());
            }
        }
        if let wasmtime::ExternType::Func(ft) = imp.ty() {
            let name = imp.name().to_string();
            // WASI: ENOSYS (52), but `path_open` ENOENT (44) as proxy-wasm-cpp-host's (no
            // preopened directory); proxy-wasm: Unimplemented (12).
            let code = match (imp.module().starts_with("wasi"), imp.name()) {
                (true, "path_open") => 44,
                (true, _) => 52,
                (false, _) => status::UNIMPLEMENTED,
            };
            let results: Vec<ValType> = ft.results().collect();
            tracing::debug!("stubbing import {}.{} as Unimplemented", imp.module(), name);
            linker
                .func_new(imp.module(), imp.name(), ft.clone(), move |_c, _p, out| {
                    tracing::debug!("unimplemented hostcall {name}");
                    for (i, ty) in results.iter().enumerate() {
                        if let Some(o) = out.get_mut(i) {
                            *o = match ty {
                                ValType::I64 => Val::I64(code as i64),
                                ValType::F32 => Val::F32(0),
                                ValType::F64 => Val::F64(0),
                                _ => Val::I32(code),
                            };
                        }
                    }
                    Ok(())
                })
                .map_err(werr)?;
        }
    }
    Ok(linker)
}

/// Registers hostcalls in module `env` and remembers their names.
pub struct Registrar<'a> {
    /// The linker.
    pub linker: &'a mut Linker<HostState>,
    defined: &'a mut HashSet<(String, String)>,
}

impl Registrar<'_> {
    /// Register `env.name`.
    pub fn func<Params, Args>(
        &mut self,
        name: &str,
        f: impl wasmtime::IntoFunc<HostState, Params, Args>,
    ) -> anyhow::Result<()> {
        self.linker.func_wrap("env", name, f).map_err(werr)?;
        self.defined.insert(("env".to_string(), name.to_string()));
        Ok(())
    }
}

/// Queue a deferred action on the effective context.
pub fn defer(state: &mut HostState, action: Action) {
    let ctx = state.effective_ctx;
    state.actions.push((ctx, action));
}

/// Convert a wasmtime error (wasmtime 48 has its own error type) into anyhow.
pub fn werr(e: wasmtime::Error) -> anyhow::Error {
    anyhow::anyhow!("{e:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_pause_depends_on_abi_marker() {
        use HeaderAction::*;
        assert_eq!(HeaderAction::from_raw(1, AbiVersion::V0_2_1, false), StopAll);
        assert_eq!(HeaderAction::from_raw(1, AbiVersion::V0_2_0, false), StopAll);
        assert_eq!(HeaderAction::from_raw(1, AbiVersion::V0_1_0, false), StopAll);
        assert_eq!(HeaderAction::from_raw(1, AbiVersion::V0_2_100, false), StopIteration);
        assert_eq!(HeaderAction::from_raw(0, AbiVersion::V0_2_100, false), Continue);
        assert_eq!(
            HeaderAction::from_raw(0, AbiVersion::V0_2_100, true),
            StopAll,
            "local reply forces StopAll"
        );
        assert_eq!(
            HeaderAction::from_raw(7, AbiVersion::V0_2_100, false),
            StopAll,
            "values above 4"
        );
        assert_eq!(HeaderAction::from_raw(2, AbiVersion::V0_2_1, false), Continue);
    }

    #[test]
    fn pairs_round_trip_in_envoy_layout() {
        let p = vec![(":path".to_string(), b"/a".to_vec()), ("x".to_string(), Vec::new())];
        let b = marshal_pairs(&p);
        // count, then sizes, then NUL-terminated key/value bytes
        assert_eq!(&b[..4], &2u32.to_le_bytes());
        assert_eq!(&b[4..8], &5u32.to_le_bytes());
        assert_eq!(&b[20..], b":path\0/a\0x\0\0");
        assert_eq!(unmarshal_pairs(&b), Some(p));
        assert_eq!(unmarshal_pairs(&b[..10]), None, "truncated input is rejected");
    }
}
