//! Workers: each one is a thread with its own Tokio runtime and its own plugin VM (wasmtime
//! Store + instance of the module compiled once), like Envoy workers.

use crate::abi::{self, AbiVersion, Action, HostState, StreamState};
use crate::body::HttpClient;
use crate::config::{FailurePolicy, PluginConfig};
use crate::global::{Global, WorkerEvent};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use wasmtime::{Engine, Func, Instance, Linker, Module, Store, Val, ValType};

/// The compiled plugin, shared by all workers.
pub struct PluginRuntime {
    /// Engine.
    pub engine: Engine,
    /// Module (compiled once).
    pub module: Module,
    /// Linker with all hostcalls.
    pub linker: Linker<HostState>,
    /// Detected ABI marker.
    pub abi: AbiVersion,
    /// Configuration JSON.
    pub plugin_config: Vec<u8>,
    /// VM configuration.
    pub vm_config: Vec<u8>,
}

impl PluginRuntime {
    /// Compile the module and build the linker.
    pub fn load(p: &PluginConfig) -> anyhow::Result<PluginRuntime> {
        let mut config = wasmtime::Config::new();
        if std::env::var_os("GATEWAY_WASM_PERFMAP").is_some() {
            // For profiling with `perf`: the plugin's compiled functions named in
            // /tmp/perf-<pid>.map.
            config.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        let engine = Engine::new(&config).map_err(|e| anyhow::anyhow!("wasmtime engine: {e:#}"))?;
        let module = Module::from_file(&engine, &p.wasm)
            .map_err(|e| anyhow::anyhow!("plugin {}: loading {}: {e:#}", p.name, p.wasm))?;
        let abi = AbiVersion::detect(&module).ok_or_else(|| {
            anyhow::anyhow!(
                "plugin {}: {}: Missing or unknown Proxy-Wasm ABI version (no function export \
                 proxy_abi_version_0_1_0, 0_2_0, 0_2_1 or 0_2_100)",
                p.name,
                p.wasm
            )
        })?;
        let linker = abi::build_linker(&engine, &module, abi)
            .map_err(|e| anyhow::anyhow!("plugin {}: {}: {e:#}", p.name, p.wasm))?;
        let vm_config = match &p.vm_configuration {
            Some(v) => serde_json::to_string(v)?.into_bytes(),
            None => Vec::new(),
        };
        Ok(PluginRuntime {
            engine,
            module,
            linker,
            abi,
            plugin_config: p.configuration_json()?.into_bytes(),
            vm_config,
        })
    }
}

/// One VM instance (Store + instance) of a worker.
pub struct Vm {
    store: Store<HostState>,
    funcs: HashMap<String, Export>,
    /// Root context id.
    pub root_id: u32,
    /// ABI marker.
    pub abi: AbiVersion,
}

/// An exported function with its signature, read once at instantiation: reading a function's
/// type from the store at every call cost a response chunk's callback about a tenth of its time.
struct Export {
    func: Func,
    /// Each parameter is an `i64` (else `i32`).
    params_i64: Vec<bool>,
    results: usize,
}

/// A VM call trapped; the VM has been replaced.
#[derive(Debug)]
pub struct Trapped;

impl Vm {
    /// Call an export with i32 arguments (adapted to the export's arity). Sets the current and
    /// effective context, then applies the deferred actions once the call has returned.
    /// Returns (result, local reply requested during the call); Ok((None, _)) if not exported.
    pub fn call(
        &mut self,
        ctx: u32,
        name: &str,
        args: &[i32],
    ) -> wasmtime::Result<(Option<i32>, bool)> {
        let Some(export) = self.funcs.get(name) else { return Ok((None, false)) };
        let f = export.func;
        let params: Vec<Val> = export
            .params_i64
            .iter()
            .enumerate()
            .map(|(i, &is_i64)| {
                let v = args.get(i).copied().unwrap_or(0);
                if is_i64 {
                    Val::I64(v as u32 as i64)
                } else {
                    Val::I32(v)
                }
            })
            .collect();
        let mut results: Vec<Val> = vec![Val::I32(0); export.results];
        {
            let st = self.store.data_mut();
            st.current_ctx = ctx;
            st.effective_ctx = ctx;
            st.local_reply_in_call = false;
            st.actions.clear();
        }
        let r = f.call(&mut self.store, &params, &mut results);
        if let Some(m) = self.store.data().exports.memory {
            let bytes = m.data_size(&self.store) as u64;
            self.store.data().g.stats.vm_memory_bytes_max.fetch_max(bytes, Ordering::Relaxed);
        }
        let st = self.store.data_mut();
        let local = st.local_reply_in_call;
        let actions = std::mem::take(&mut st.actions);
        st.local_reply_in_call = false;
        r?;
        // After-VM-call actions (Envoy addAfterVmCallAction).
        for (ctx, action) in actions {
            let Some(s) = st.streams.get(&ctx).cloned() else { continue };
            let Ok(mut s) = s.lock() else { continue };
            match action {
                Action::ContinueRequest => {
                    s.continue_req = true;
                    s.req_hdr_access = false;
                    s.req_body_access = false;
                }
                Action::ContinueResponse => {
                    s.continue_resp = true;
                    s.resp_hdr_access = false;
                    s.resp_body_access = false;
                }
                Action::LocalReply(lr) => {
                    if s.local_reply.is_none() {
                        s.local_reply = Some(lr);
                    }
                }
                Action::Reset => s.reset = true,
            }
            s.notify.notify_one();
        }
        let out = results.first().map(|v| match v {
            Val::I32(x) => *x,
            Val::I64(x) => *x as i32,
            _ => 0,
        });
        Ok((out, local))
    }

    /// Host state.
    pub fn state(&mut self) -> &mut HostState {
        self.store.data_mut()
    }
}

/// A worker (lives on its own thread; not Send).
pub struct Worker {
    /// Index.
    pub idx: usize,
    /// Shared state.
    pub g: Arc<Global>,
    /// The VM (None without plugin).
    pub vm: RefCell<Option<Vm>>,
    /// VM generation.
    pub gen: Cell<u64>,
    /// Upstream HTTP client of this worker.
    pub client: HttpClient,
    /// Sender of this worker's events.
    pub events: mpsc::UnboundedSender<WorkerEvent>,
    /// Compiled plugin.
    pub plugin: Option<Arc<PluginRuntime>>,
    /// The VM trapped and stays failed (`FAIL_CLOSED` / `FAIL_OPEN`).
    failed: Cell<bool>,
    next_ctx: Arc<AtomicU32>,
    next_conn: Cell<u64>,
}

impl Worker {
    /// Create a worker and start its VM (runs the root lifecycle: context create, vm_start,
    /// configure). Fails if the plugin rejects its configuration.
    pub fn new(
        idx: usize,
        g: Arc<Global>,
        plugin: Option<Arc<PluginRuntime>>,
        events: mpsc::UnboundedSender<WorkerEvent>,
    ) -> anyhow::Result<Worker> {
        // Room for the largest response header any cluster accepts: the clusters' own limits
        // are applied to each response (`response_header_overflow`).
        let room = g.clusters.all().iter().map(|c| c.response_header_limits).fold(
            crate::config::HeaderLimits { bytes: 0, count: 0 },
            |a, l| crate::config::HeaderLimits {
                bytes: a.bytes.max(l.bytes),
                count: a.count.max(l.count),
            },
        );
        let w = Worker {
            idx,
            client: crate::body::upstream_client(std::time::Duration::from_secs(5), room),
            g,
            vm: RefCell::new(None),
            gen: Cell::new(0),
            events,
            plugin,
            failed: Cell::new(false),
            next_ctx: Arc::new(AtomicU32::new(1)),
            next_conn: Cell::new(1),
        };
        w.start_vm()?;
        Ok(w)
    }

    /// Next connection id.
    pub fn next_connection_id(&self) -> u64 {
        let c = self.next_conn.get();
        self.next_conn.set(c + 1);
        (c << 8) | self.idx as u64
    }

    /// Allocate a context id.
    pub fn new_ctx_id(&self) -> u32 {
        self.next_ctx.fetch_add(1, Ordering::Relaxed)
    }

    fn start_vm(&self) -> anyhow::Result<()> {
        let Some(p) = self.plugin.clone() else { return Ok(()) };
        let gen = self.gen.get() + 1;
        self.gen.set(gen);
        let plugin_name = self.g.plugin_name.clone();
        let wasi = wasmtime_wasi::WasiCtxBuilder::new().build_p1();
        let (tick_tx, tick_rx) = tokio::sync::watch::channel(0u64);
        let root_id = self.new_ctx_id();
        let state = HostState {
            wasi,
            g: self.g.clone(),
            worker: self.idx,
            gen,
            abi: p.abi,
            root_id,
            current_ctx: root_id,
            effective_ctx: root_id,
            streams: HashMap::new(),
            actions: Vec::new(),
            local_reply_in_call: false,
            call_response: None,
            redis_response: None,
            redis_clients: HashMap::new(),
            next_http_token: 4,
            next_redis_token: 7,
            tick_tx,
            last_status: (0, String::new()),
            vm_config: p.vm_config.clone(),
            plugin_config: p.plugin_config.clone(),
            configuring: false,
            events: self.events.clone(),
            http_client: self.client.clone(),
            next_ctx: self.next_ctx.clone(),
            exports: Default::default(),
        };
        let mut store = Store::new(&p.engine, state);
        let instance: Instance = p
            .linker
            .instantiate(&mut store, &p.module)
            .map_err(|e| anyhow::anyhow!("plugin {plugin_name}: instantiation failed: {e:?}"))?;
        let mut funcs = HashMap::new();
        for e in p.module.exports() {
            if let Some(func) = instance.get_func(&mut store, e.name()) {
                let ty = func.ty(&store);
                let params_i64 = ty.params().map(|t| matches!(t, ValType::I64)).collect();
                let export = Export { func, params_i64, results: ty.results().len() };
                funcs.insert(e.name().to_string(), export);
            }
        }
        // Envoy (cpp-host `getFunctions`) fails a module it could hand no data to.
        if !crate::abi::ALLOCATOR_EXPORTS.iter().any(|name| funcs.contains_key(*name)) {
            anyhow::bail!(
                "plugin {plugin_name}: the module exports neither malloc nor \
                 proxy_on_memory_allocate (Envoy refuses it too)"
            );
        }
        let memory = instance.get_memory(&mut store, "memory");
        let alloc = crate::abi::ALLOCATOR_EXPORTS
            .into_iter()
            .find_map(|name| funcs.get(name))
            .and_then(|e| e.func.typed::<i32, i32>(&store).ok());
        store.data_mut().exports = crate::abi::GuestExports { memory, alloc };
        let mut vm = Vm { store, funcs, root_id, abi: p.abi };
        // Reactor start: `_initialize`, or `_start` (a proc_exit(0) from it is fine).
        if vm.funcs.contains_key("_initialize") {
            vm.call(root_id, "_initialize", &[])
                .map_err(|e| anyhow::anyhow!("plugin {plugin_name}: _initialize failed: {e:?}"))?;
        } else if vm.funcs.contains_key("_start") {
            if let Err(e) = vm.call(root_id, "_start", &[]) {
                let exit0 = e.downcast_ref::<wasmtime_wasi::I32Exit>().is_some_and(|x| x.0 == 0);
                if !exit0 {
                    anyhow::bail!("plugin {plugin_name}: _start failed: {e:?}");
                }
            }
        }
        vm.call(root_id, "proxy_on_context_create", &[root_id as i32, 0]).map_err(|e| {
            anyhow::anyhow!("plugin {plugin_name}: root context creation trapped: {e:?}")
        })?;
        let (r, _) = vm
            .call(root_id, "proxy_on_vm_start", &[root_id as i32, p.vm_config.len() as i32])
            .map_err(|e| {
                anyhow::anyhow!("plugin {plugin_name}: proxy_on_vm_start trapped: {e:?}")
            })?;
        if r == Some(0) {
            anyhow::bail!("plugin {plugin_name}: proxy_on_vm_start returned false");
        }
        vm.state().configuring = true;
        let configured =
            vm.call(root_id, "proxy_on_configure", &[root_id as i32, p.plugin_config.len() as i32]);
        vm.state().configuring = false;
        let (r, _) = configured.map_err(|e| {
            anyhow::anyhow!("plugin {plugin_name}: proxy_on_configure trapped: {e:?}")
        })?;
        if r == Some(0) {
            anyhow::bail!("plugin {plugin_name}: proxy_on_configure rejected the configuration");
        }
        *self.vm.borrow_mut() = Some(vm);
        // Tick timer of the root context.
        let events = self.events.clone();
        let mut rx = tick_rx;
        tokio::task::spawn_local(async move {
            loop {
                let period = *rx.borrow_and_update();
                if period == 0 {
                    if rx.changed().await.is_err() {
                        return;
                    }
                    continue;
                }
                tokio::select! {
                    _ = tokio::time::sleep(std::time::Duration::from_millis(period)) => {
                        if events.send(WorkerEvent::Tick { gen }).is_err() { return; }
                    }
                    r = rx.changed() => if r.is_err() { return; },
                }
            }
        });
        Ok(())
    }

    /// Is a plugin VM running for generation `gen`?
    pub fn vm_alive(&self, gen: u64) -> bool {
        self.gen.get() == gen && self.vm.borrow().is_some()
    }

    /// The plugin's `failure_policy`.
    pub fn failure_policy(&self) -> FailurePolicy {
        self.g.plugin.as_ref().map(|p| p.failure_policy).unwrap_or_default()
    }

    /// True when this worker's VM trapped and stays failed under `FAIL_CLOSED`: every stream gets
    /// 503 `wasm_fail_stream`.
    pub fn fails_streams(&self) -> bool {
        self.failed.get() && self.failure_policy() == FailurePolicy::FailClosed
    }

    /// Call into the VM. On a trap: log it, count it, and as `failure_policy` says keep the VM
    /// failed (as Envoy does by default) or start a new one; return Err.
    pub fn vm_call(
        &self,
        ctx: u32,
        name: &str,
        args: &[i32],
    ) -> Result<(Option<i32>, bool), Trapped> {
        let started = std::time::Instant::now();
        let r = {
            let mut vm = self.vm.borrow_mut();
            let Some(vm) = vm.as_mut() else { return Ok((None, false)) };
            vm.call(ctx, name, args)
        };
        self.g.stats.vm_call(name, started.elapsed().as_nanos() as u64);
        match r {
            Ok(x) => Ok(x),
            Err(e) => {
                let policy = self.failure_policy();
                tracing::error!(worker = self.idx, plugin = %self.g.plugin_name, ?policy, "plugin trapped in {name}: {e:?}");
                self.g.stats.vm_traps_total.fetch_add(1, Ordering::Relaxed);
                match policy {
                    FailurePolicy::FailReload => self.restart_vm(),
                    FailurePolicy::FailClosed | FailurePolicy::FailOpen => {
                        self.stop_vm();
                        self.failed.set(true);
                    }
                }
                Err(Trapped)
            }
        }
    }

    /// The gateway exits: the root context's `proxy_on_done`, then `proxy_on_delete` when it
    /// returned true. When it returned false Envoy keeps the root pending until `proxy_done`,
    /// but at exit it destroys the VM right after, so nothing more runs (no on_delete).
    /// A worker without a running VM (none, or failed) has nothing to stop. Later callbacks to
    /// the root are dropped, as the gateway is exiting (see [`Worker::handle_event`]).
    fn stop_root(&self) {
        if let Some(root) = self.root_id() {
            // Done at once (a module without proxy_on_done counts as done); a trap ends the VM.
            if let Ok((r, _)) = self.vm_call(root, "proxy_on_done", &[root as i32]) {
                if r.is_none_or(|r| r != 0) {
                    let _ = self.vm_call(root, "proxy_on_delete", &[root as i32]);
                }
            }
        }
        self.g.roots_stopping.fetch_sub(1, Ordering::Relaxed);
    }

    /// Drops the VM; streams waiting on it are woken (they see it gone).
    fn stop_vm(&self) {
        let old = self.vm.borrow_mut().take();
        if let Some(mut old) = old {
            for s in old.state().streams.values() {
                if let Ok(s) = s.lock() {
                    s.notify.notify_one();
                }
            }
        }
    }

    fn restart_vm(&self) {
        self.stop_vm();
        if let Err(e) = self.start_vm() {
            tracing::error!(
                worker = self.idx,
                "plugin VM restart failed: {e:#}; requests on this worker bypass the plugin"
            );
        }
    }

    /// Register a stream context in the VM (if any) and return the VM generation.
    pub fn register_stream(&self, ctx: u32, st: &Arc<Mutex<StreamState>>) -> Option<u64> {
        let mut vm = self.vm.borrow_mut();
        let vm = vm.as_mut()?;
        vm.state().streams.insert(ctx, st.clone());
        Some(self.gen.get())
    }

    /// Remove a stream context.
    pub fn unregister_stream(&self, ctx: u32, gen: u64) {
        if self.gen.get() != gen {
            return;
        }
        if let Some(vm) = self.vm.borrow_mut().as_mut() {
            vm.state().streams.remove(&ctx);
        }
    }

    /// Root context id of the current VM.
    pub fn root_id(&self) -> Option<u32> {
        self.vm.borrow().as_ref().map(|v| v.root_id)
    }

    /// ABI of the current VM.
    pub fn abi(&self) -> AbiVersion {
        self.vm.borrow().as_ref().map(|v| v.abi).unwrap_or(AbiVersion::V0_2_100)
    }

    /// Deliver an asynchronous event to the root context.
    pub fn handle_event(&self, ev: WorkerEvent) {
        if let WorkerEvent::Stop = ev {
            return self.stop_root();
        }
        // A Redis reply stops counting as outstanding only after the plugin handled it: a command
        // it sends in reply (a script resent after NOSCRIPT) is counted first, so the drain never
        // sees zero in between.
        let _answered = matches!(ev, WorkerEvent::Redis { .. }).then(|| RedisAnswered(&self.g));
        let Some(root) = self.root_id() else { return };
        // Exiting: Envoy's dispatchers have stopped, nothing more reaches the plugin.
        if self.g.is_exiting() {
            return;
        }
        let cur = self.gen.get();
        match ev {
            WorkerEvent::Stop => {}
            WorkerEvent::Redis { gen, token, reply } => {
                if gen != cur {
                    return;
                }
                let (status, size) = match &reply {
                    Some(b) => (0, b.len() as i32),
                    None => (1, 0),
                };
                if let Some(vm) = self.vm.borrow_mut().as_mut() {
                    let st = vm.state();
                    // As Envoy: a failure sets the code and message; a success clears only
                    // the message (the code of an earlier failure stays).
                    if reply.is_some() {
                        st.last_status.1.clear();
                    } else {
                        st.last_status = (11, "reset".into());
                    }
                    st.redis_response = reply;
                }
                let _ = self.vm_call(
                    root,
                    "proxy_on_redis_call_response",
                    &[root as i32, token as i32, status, size],
                );
                if let Some(vm) = self.vm.borrow_mut().as_mut() {
                    vm.state().redis_response = None;
                }
            }
            WorkerEvent::HttpCall { gen, token, result } => {
                if gen != cur {
                    return;
                }
                let (nh, nb, nt) = match &result {
                    Some(r) => {
                        (r.headers.len() as i32, r.body.len() as i32, r.trailers.len() as i32)
                    }
                    None => (0, 0, 0),
                };
                if let Some(vm) = self.vm.borrow_mut().as_mut() {
                    let st = vm.state();
                    // As Envoy: a failure sets the code and message; a success clears only
                    // the message (the code of an earlier failure stays).
                    if result.is_some() {
                        st.last_status.1.clear();
                    } else {
                        st.last_status = (11, "reset".into());
                    }
                    st.call_response = result;
                }
                let _ = self.vm_call(
                    root,
                    "proxy_on_http_call_response",
                    &[root as i32, token as i32, nh, nb, nt],
                );
                if let Some(vm) = self.vm.borrow_mut().as_mut() {
                    vm.state().call_response = None;
                }
            }
            WorkerEvent::Tick { gen } => {
                if gen == cur {
                    let _ = self.vm_call(root, "proxy_on_tick", &[root as i32]);
                }
            }
            WorkerEvent::QueueReady { gen, queue_id } => {
                if gen == cur {
                    let _ =
                        self.vm_call(root, "proxy_on_queue_ready", &[root as i32, queue_id as i32]);
                }
            }
        }
    }
}

/// Takes one answered Redis call off [`Global::redis_outstanding`] when dropped.
struct RedisAnswered<'a>(&'a Global);

impl Drop for RedisAnswered<'_> {
    fn drop(&mut self) {
        let _ = self
            .0
            .redis_outstanding
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }
}
