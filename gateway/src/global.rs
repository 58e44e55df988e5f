//! Process-wide state and the events workers receive, as plain data.
//!
//! A leaf module: it depends on no gateway module that depends back on it (only on the data
//! types of `cluster`, `config` and `stats`), so `abi`, `worker` and `redis` can all use
//! `Global` and `WorkerEvent` without forming a module cycle. The shared-data and shared-queue
//! tables, the proxy-wasm status codes and the callout response live here for the same reason;
//! `abi` re-exports them under their old paths.

use crate::cluster::Clusters;
use crate::config::{PluginConfig, RouteConfig};
use crate::stats::Stats;
use bytes::Bytes;
use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, OnceLock};
use tokio::sync::mpsc;

/// proxy-wasm `WasmResult` codes.
pub mod status {
    /// Ok
    pub const OK: i32 = 0;
    /// NotFound
    pub const NOT_FOUND: i32 = 1;
    /// BadArgument
    pub const BAD_ARGUMENT: i32 = 2;
    /// SerializationFailure
    pub const SERIALIZATION_FAILURE: i32 = 3;
    /// InvalidMemoryAccess
    pub const INVALID_MEMORY_ACCESS: i32 = 6;
    /// Empty
    pub const EMPTY: i32 = 7;
    /// CasMismatch
    pub const CAS_MISMATCH: i32 = 8;
    /// InternalFailure
    pub const INTERNAL_FAILURE: i32 = 10;
    /// BrokenConnection
    pub const BROKEN_CONNECTION: i32 = 11;
    /// Unimplemented
    pub const UNIMPLEMENTED: i32 = 12;
}

/// A header map: (lower-case name, value), pseudo-headers included.
pub type HeaderMap = Vec<(String, Vec<u8>)>;

/// The first value of header `name` (lower case) in `h`.
pub fn header_bytes<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a [u8]> {
    h.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_slice())
}

/// Response of an HTTP callout, readable during `proxy_on_http_call_response`.
#[derive(Debug, Default, Clone)]
pub struct CallResponse {
    /// Headers (`:status` first).
    pub headers: HeaderMap,
    /// Body.
    pub body: Bytes,
    /// Trailers.
    pub trailers: HeaderMap,
}

/// Process-wide state shared by all workers.
pub struct Global {
    /// Clusters.
    pub clusters: Clusters,
    /// Routes.
    pub routes: Vec<RouteConfig>,
    /// What every routed response gets added (Envoy's route `response_headers_to_add`).
    pub response_headers_to_add: crate::response_headers::ResponseHeadersToAdd,
    /// Stats and plugin metrics.
    pub stats: Stats,
    /// Shared data (per vm_id, all workers).
    pub shared_data: SharedData,
    /// Shared queues.
    pub queues: SharedQueues,
    /// Event senders of every worker (for queue notifications).
    pub worker_events: OnceLock<Vec<mpsc::UnboundedSender<WorkerEvent>>>,
    /// Plugin section.
    pub plugin: Option<PluginConfig>,
    /// `plugin_name`.
    pub plugin_name: String,
    /// `plugin_root_id`.
    pub plugin_root_id: String,
    /// `plugin_vm_id`.
    pub plugin_vm_id: String,
    /// proxy-wasm log level for `proxy_get_log_level`.
    pub log_level: u32,
    /// Where a stop (SIGTERM/SIGINT) is; workers and connections watch it.
    pub shutdown: tokio::sync::watch::Sender<Shutdown>,
    /// Streams whose context has not finished yet (on_log/on_done/on_delete pending), all workers.
    pub live_streams: std::sync::atomic::AtomicUsize,
    /// Redis calls sent whose reply (or failure) has not reached the plugin yet, all workers.
    pub redis_outstanding: std::sync::atomic::AtomicUsize,
    /// Workers whose root context has not finished stopping yet (set by the drain, see
    /// [`WorkerEvent::Stop`]).
    pub roots_stopping: std::sync::atomic::AtomicUsize,
    /// The process is exiting (the drain is over): as in Envoy, whose exit runs the last
    /// callbacks after its dispatchers stopped, what the plugin sends from now on never leaves
    /// (the hostcalls still answer Ok) and nothing more is delivered to it.
    pub exiting: std::sync::atomic::AtomicBool,
}

impl Global {
    /// Whether the process is exiting (see [`Global::exiting`]).
    pub fn is_exiting(&self) -> bool {
        self.exiting.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The gateway's stop sequence on SIGTERM, as a Higress gateway pod stops (its agent drains
/// Envoy's listeners, then ends Envoy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shutdown {
    /// Serving.
    Running,
    /// Envoy's graceful listener drain as pilot-agent starts it (`drain_listeners?graceful`,
    /// `--drain-strategy immediate`): new connections are still accepted and idle ones stay
    /// open, but every response that starts from now on closes its connection (`connection:
    /// close` on HTTP/1, the GOAWAY sequence on HTTP/2; conformance test
    /// `a_graceful_drain_keeps_accepting_and_closes_each_connection_after_its_response`).
    Draining,
    /// Envoy exits on SIGTERM: its listeners close and the remaining connections are closed
    /// (their streams end as on a client abort, so the plugin's on_log/on_done/on_delete still
    /// run).
    Cut,
}

/// Asynchronous results delivered to a worker's VM.
#[derive(Debug)]
pub enum WorkerEvent {
    /// Redis reply (None: NetworkError).
    Redis {
        /// VM generation that made the call.
        gen: u64,
        /// Call token.
        token: u32,
        /// Raw RESP reply.
        reply: Option<Bytes>,
    },
    /// HTTP callout result (None: failure).
    HttpCall {
        /// VM generation.
        gen: u64,
        /// Token.
        token: u32,
        /// Response.
        result: Option<CallResponse>,
    },
    /// Tick of the root context.
    Tick {
        /// VM generation.
        gen: u64,
    },
    /// The gateway exits (after the drain of its streams): the root context's `proxy_on_done`,
    /// then `proxy_on_delete` when it returned true; when it returned false, nothing more (the
    /// VM is destroyed with its root pending, as Envoy 1.40 does at exit: conformance test
    /// `at_exit_a_root_context_that_is_not_done_gets_nothing_more`). The worker then decrements
    /// [`Global::roots_stopping`].
    Stop,
    /// A shared queue got an item.
    QueueReady {
        /// VM generation that registered the queue.
        gen: u64,
        /// Queue id.
        queue_id: u32,
    },
}

/// (vm id, key): the scope of one shared-data entry or queue name.
type VmKey = (String, String);

/// Shared-data entries (value, CAS) and the last CAS handed out.
#[derive(Debug, Default)]
struct DataTable {
    entries: HashMap<VmKey, (Vec<u8>, u32)>,
    last_cas: u32,
}

/// Process-wide shared data.
#[derive(Debug, Default)]
pub struct SharedData {
    map: Mutex<DataTable>,
}

impl SharedData {
    /// Get value and CAS.
    pub fn get(&self, vm: &str, key: &str) -> Option<(Vec<u8>, u32)> {
        let g = self.map.lock().ok()?;
        g.entries.get(&(vm.to_string(), key.to_string())).cloned()
    }
    /// Set with CAS check; returns a status code.
    pub fn set(&self, vm: &str, key: &str, value: Vec<u8>, cas: u32) -> i32 {
        let Ok(mut g) = self.map.lock() else { return status::INTERNAL_FAILURE };
        let DataTable { entries: map, last_cas: counter } = &mut *g;
        let k = (vm.to_string(), key.to_string());
        if let Some((_, cur)) = map.get(&k) {
            if cas != 0 && cas != *cur {
                return status::CAS_MISMATCH;
            }
        }
        *counter = counter.wrapping_add(1).max(1);
        map.insert(k, (value, *counter));
        status::OK
    }
}

#[derive(Debug)]
struct Queue {
    owner_worker: usize,
    owner_gen: u64,
    items: VecDeque<Vec<u8>>,
}

/// Queue ids by name, queues by id, and the last id handed out.
#[derive(Debug, Default)]
struct QueueTable {
    names: HashMap<VmKey, u32>,
    queues: HashMap<u32, Queue>,
    next: u32,
}

/// Process-wide shared queues.
#[derive(Debug, Default)]
pub struct SharedQueues {
    inner: Mutex<QueueTable>,
}

impl SharedQueues {
    pub(crate) fn register(&self, vm: &str, name: &str, worker: usize, gen: u64) -> u32 {
        let Ok(mut g) = self.inner.lock() else { return 0 };
        let QueueTable { names, queues, next } = &mut *g;
        let key = (vm.to_string(), name.to_string());
        if let Some(id) = names.get(&key).copied() {
            if let Some(q) = queues.get_mut(&id) {
                q.owner_worker = worker;
                q.owner_gen = gen;
            }
            return id;
        }
        *next += 1;
        let id = *next;
        names.insert(key, id);
        queues.insert(id, Queue { owner_worker: worker, owner_gen: gen, items: VecDeque::new() });
        id
    }
    pub(crate) fn resolve(&self, vm: &str, name: &str) -> Option<u32> {
        let g = self.inner.lock().ok()?;
        g.names.get(&(vm.to_string(), name.to_string())).copied()
    }
    pub(crate) fn enqueue(&self, id: u32, v: Vec<u8>) -> Option<(usize, u64)> {
        let mut g = self.inner.lock().ok()?;
        let q = g.queues.get_mut(&id)?;
        q.items.push_back(v);
        Some((q.owner_worker, q.owner_gen))
    }
    pub(crate) fn dequeue(&self, id: u32) -> Result<Vec<u8>, i32> {
        let mut g = self.inner.lock().map_err(|_| status::INTERNAL_FAILURE)?;
        let q = g.queues.get_mut(&id).ok_or(status::NOT_FOUND)?;
        q.items.pop_front().ok_or(status::EMPTY)
    }
}
