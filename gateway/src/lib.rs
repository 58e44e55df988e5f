//! A Higress-like gateway host: serves HTTP on loopback as a reverse proxy and runs a proxy-wasm
//! plugin (ABI 0_2_100 / 0_2_1 + Higress extensions) in wasmtime, one VM per worker thread.
//! See the README section "Gateway host".

pub mod abi;
pub mod admin;
pub mod body;
pub mod cluster;
pub mod config;
pub mod forwarded;
pub mod global;
pub mod proxy;
pub mod redis;
pub mod response_headers;
pub mod stats;
pub mod worker;

use std::io::Write;
use std::rc::Rc;
use std::sync::{Arc, OnceLock};
use tokio::sync::mpsc;

/// Command-line options.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "gateway",
    about = "Higress-like gateway host running a proxy-wasm plugin in wasmtime"
)]
pub struct Args {
    /// Configuration YAML.
    #[arg(long)]
    pub config: std::path::PathBuf,
    /// Worker threads, each with its own plugin VM.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Log level (trace, debug, info, warn, error); also what `proxy_get_log_level` returns.
    #[arg(long, default_value = "info")]
    pub log_level: String,
}

/// Run the gateway until killed. Prints `LISTENING <name> <addr>`, `ADMIN <addr>`, `READY`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        // Our crate and plugin logs at the chosen level; dependencies (cranelift, hyper) quieter.
        let l = &args.log_level;
        tracing_subscriber::EnvFilter::new(format!("warn,gateway={l},wasm={l}"))
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(LogWriter::start())
        .try_init();

    let cfg = config::Config::load(&args.config)?;
    let plugin = match &cfg.plugin {
        Some(p) => Some(Arc::new(worker::PluginRuntime::load(p)?)),
        None => None,
    };
    if let Some(p) = &plugin {
        tracing::info!("plugin ABI marker: {:?}", p.abi);
    }
    let g = global_state(&cfg, &args)?;
    let stop = Stop {
        drain: std::time::Duration::from_millis(cfg.drain_timeout_ms),
        exit: cfg.exit_after_drain,
    };

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    warm_clusters(&rt, &g);
    let listeners = bind_listeners(&cfg)?;
    start_workers(args.workers, &g, plugin.as_ref(), &listeners)?;
    let admin = match &cfg.admin {
        Some(a) => Some(
            std::net::TcpListener::bind(&a.address)
                .map_err(|e| anyhow::anyhow!("admin: bind {}: {e}", a.address))?,
        ),
        None => None,
    };
    announce(&listeners, admin.as_ref())?;
    // Each worker accepts on its own clone of every listening socket; with these gone, the sockets
    // close (new connections are refused) once the workers drop theirs at a drain.
    drop(listeners);
    rt.block_on(async move {
        let serve_admin = admin::serve(admin, g.clone());
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = serve_admin => r,
            _ = term.recv() => stop_pod(&g, stop, "SIGTERM").await,
            _ = tokio::signal::ctrl_c() => stop_pod(&g, stop, "SIGINT").await,
        }
    })
}

/// The state every worker shares: clusters, routes, stats, shared data and queues, the plugin's
/// identity, the shutdown signal.
fn global_state(cfg: &config::Config, args: &Args) -> anyhow::Result<Arc<global::Global>> {
    Ok(Arc::new(global::Global {
        clusters: cluster::Clusters::new(&cfg.clusters)?,
        routes: cfg.routes.clone(),
        response_headers_to_add: response_headers::ResponseHeadersToAdd::new(
            &cfg.response_headers_to_add,
        )?,
        stats: stats::Stats::default(),
        shared_data: Default::default(),
        queues: Default::default(),
        worker_events: OnceLock::new(),
        plugin_name: cfg.plugin.as_ref().map(|p| p.name.clone()).unwrap_or_default(),
        plugin_root_id: cfg.plugin.as_ref().map(|p| p.root_id.clone()).unwrap_or_default(),
        plugin_vm_id: cfg.plugin.as_ref().map(|p| p.vm_id.clone()).unwrap_or_default(),
        plugin: cfg.plugin.clone(),
        log_level: abi::logging::level_from_name(&args.log_level),
        shutdown: tokio::sync::watch::Sender::new(global::Shutdown::Running),
        live_streams: Default::default(),
        redis_outstanding: Default::default(),
        roots_stopping: Default::default(),
        exiting: Default::default(),
    }))
}

/// Like Envoy's cluster warming: one health-check round before serving, then the periodic checks.
fn warm_clusters(rt: &tokio::runtime::Runtime, g: &Arc<global::Global>) {
    rt.block_on(async {
        let mut tasks = Vec::new();
        for c in g.clusters.all() {
            tasks.push(tokio::spawn(async move { cluster::health_check_round(&c).await }));
        }
        for t in tasks {
            let _ = t.await;
        }
    });
    let _guard = rt.enter();
    cluster::spawn_health_checks(&g.clusters);
}

/// Binds every configured listener (non-blocking, for the workers' runtimes).
fn bind_listeners(cfg: &config::Config) -> anyhow::Result<Vec<Listener>> {
    let mut listeners = Vec::new();
    let node_address = forwarded::node_address();
    for l in &cfg.listeners {
        let sock = std::net::TcpListener::bind(&l.address)
            .map_err(|e| anyhow::anyhow!("listener {}: bind {}: {e}", l.name, l.address))?;
        sock.set_nonblocking(true)?;
        listeners.push((
            l.name.clone(),
            sock,
            proxy::ListenerOpts {
                buffer_limit: l.per_connection_buffer_limit_bytes as usize,
                timers: l.timers(),
                accept_http_10: l.accept_http_10,
                header_limits: l.header_limits(),
                http2: l.http2,
                forwarding: l.forwarding(),
                node_address,
            },
        ));
    }
    Ok(listeners)
}

/// Prints `LISTENING <name> <addr>` per listener, `ADMIN <addr>`, then `READY` (what the test
/// harness and the bench wait for).
fn announce(listeners: &[Listener], admin: Option<&std::net::TcpListener>) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    for (name, s, _) in listeners {
        writeln!(out, "LISTENING {name} {}", s.local_addr()?)?;
    }
    if let Some(a) = admin {
        writeln!(out, "ADMIN {}", a.local_addr()?)?;
    }
    writeln!(out, "READY")?;
    out.flush()?;
    Ok(())
}

/// A listening socket with what its connections are served with.
type Listener = (String, std::net::TcpListener, proxy::ListenerOpts);

/// Starts one thread per worker (each with its own runtime, plugin VM and a clone of every
/// listening socket), plus one for the main thread's plugin VM, and waits until every VM is
/// configured. Envoy also runs the plugin on its main thread: a root context that is configured
/// and ticks, and can call out, but serves no streams; it has the last index and no listeners.
fn start_workers(
    workers: usize,
    g: &Arc<global::Global>,
    plugin: Option<&Arc<worker::PluginRuntime>>,
    listeners: &[Listener],
) -> anyhow::Result<()> {
    let n = workers.max(1) + usize::from(plugin.is_some());
    let main_vm = plugin.is_some().then_some(n - 1);
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    for _ in 0..n {
        let (tx, rx) = mpsc::unbounded_channel();
        senders.push(tx);
        receivers.push(rx);
    }
    let _ = g.worker_events.set(senders.clone());
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<anyhow::Result<()>>();
    for (idx, mut events_rx) in receivers.into_iter().enumerate() {
        let g = g.clone();
        let plugin = plugin.cloned();
        let events_tx = senders[idx].clone();
        let socks: Vec<(std::net::TcpListener, proxy::ListenerOpts)> = listeners
            .iter()
            .filter(|_| main_vm != Some(idx))
            .filter_map(|(_, s, opts)| s.try_clone().ok().map(|s| (s, *opts)))
            .collect();
        let ready_tx = ready_tx.clone();
        let name =
            if main_vm == Some(idx) { "main-vm".to_string() } else { format!("worker-{idx}") };
        std::thread::Builder::new().name(name).spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(e.into()));
                    return;
                }
            };
            let local = tokio::task::LocalSet::new();
            local.block_on(&rt, async move {
                let w = match worker::Worker::new(idx, g, plugin, events_tx) {
                    Ok(w) => Rc::new(w),
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                for (s, opts) in socks {
                    let l = match tokio::net::TcpListener::from_std(s) {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.into()));
                            return;
                        }
                    };
                    let w = w.clone();
                    let mut stop = w.g.shutdown.subscribe();
                    tokio::task::spawn_local(async move {
                        loop {
                            let accepted = tokio::select! {
                                a = l.accept() => a,
                                // Envoy's exit closes the listener (dropped below): new
                                // connections are refused. A graceful drain still accepts.
                                _ = stop.wait_for(|s| *s == global::Shutdown::Cut) => break,
                            };
                            match accepted {
                                Ok((stream, peer)) => {
                                    let local_addr = stream.local_addr().unwrap_or(peer);
                                    tokio::task::spawn_local(proxy::serve_connection(
                                        w.clone(),
                                        stream,
                                        peer,
                                        local_addr,
                                        opts,
                                    ));
                                }
                                Err(e) => {
                                    tracing::warn!("accept failed: {e}");
                                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                                }
                            }
                        }
                    });
                }
                let _ = ready_tx.send(Ok(()));
                while let Some(ev) = events_rx.recv().await {
                    w.handle_event(ev);
                }
            });
        })?;
    }
    drop(ready_tx);
    for _ in 0..n {
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => anyhow::bail!("{e:#}"),
            Err(_) => anyhow::bail!("a worker failed to start"),
        }
    }
    Ok(())
}

/// How the gateway stops on SIGTERM/SIGINT (see [`config::Config::drain_timeout_ms`]).
#[derive(Debug, Clone, Copy)]
struct Stop {
    drain: std::time::Duration,
    exit: config::ExitAfterDrain,
}

/// A Higress gateway pod's stop, as its pilot-agent runs it: a graceful drain of Envoy's
/// listeners (they still accept; each response closes its connection) for the whole drain time,
/// whatever is in flight, then the end of the proxy (see [`config::ExitAfterDrain`]).
async fn stop_pod(g: &Arc<global::Global>, stop: Stop, why: &str) -> anyhow::Result<()> {
    use std::sync::atomic::Ordering;
    let live = || g.live_streams.load(Ordering::Relaxed);
    tracing::info!(
        "{why}: draining the listeners for {:?} ({} stream(s) in flight)",
        stop.drain,
        live()
    );
    g.shutdown.send_replace(global::Shutdown::Draining);
    tokio::time::sleep(stop.drain).await;
    // From here on nothing the plugin sends leaves, and nothing more reaches it.
    g.exiting.store(true, Ordering::Relaxed);
    match stop.exit {
        config::ExitAfterDrain::Kill => {
            tracing::info!(
                "drain over: the proxy ends as SIGKILL ends it ({} stream(s) cut)",
                live()
            );
            Ok(())
        }
        config::ExitAfterDrain::Envoy => exit_as_envoy(g).await,
    }
}

/// Envoy 1.40's exit on SIGTERM: its dispatchers stop first; the streams still open are cut
/// after that (their on_log/on_done/on_delete run), then each root context's on_done, and
/// nothing the plugin sends from those callbacks leaves, nor does any answer or tick reach it
/// (conformance test `at_exit_a_root_context_that_is_not_done_gets_nothing_more`).
async fn exit_as_envoy(g: &Arc<global::Global>) -> anyhow::Result<()> {
    use std::sync::atomic::Ordering;
    let started = std::time::Instant::now();
    let live = || g.live_streams.load(Ordering::Relaxed);
    if live() > 0 {
        tracing::warn!("exit: cutting {} stream(s)", live());
    }
    g.shutdown.send_replace(global::Shutdown::Cut);
    settled(|| live() == 0, std::time::Duration::from_secs(2)).await;
    // The root contexts stop: Envoy's thread-local Wasm handles are destroyed at exit, which
    // calls the root context's on_done. The Redis commands sent before the exit were written
    // while Envoy's dispatchers ran; waiting for their replies (which the plugin no longer gets)
    // makes sure this host wrote them too.
    let roots_done = stop_roots(g).await;
    let redis_done = settled(
        || g.redis_outstanding.load(Ordering::Relaxed) == 0,
        std::time::Duration::from_secs(2),
    )
    .await;
    tracing::info!(
        "stopped after {:?} ({} stream(s) left, root contexts {}, Redis {})",
        started.elapsed(),
        live(),
        if roots_done { "done" } else { "not done within 2 s" },
        if redis_done { "flushed" } else { "not flushed within 2 s" }
    );
    Ok(())
}

/// Asks every worker (and the main thread's VM) to stop its root context and waits up to 2 s
/// until all did.
async fn stop_roots(g: &Arc<global::Global>) -> bool {
    use std::sync::atomic::Ordering;
    let Some(workers) = g.worker_events.get() else { return true };
    g.roots_stopping.store(workers.len(), Ordering::Relaxed);
    for w in workers {
        if w.send(global::WorkerEvent::Stop).is_err() {
            g.roots_stopping.fetch_sub(1, Ordering::Relaxed);
        }
    }
    settled(|| g.roots_stopping.load(Ordering::Relaxed) == 0, std::time::Duration::from_secs(2))
        .await
}

/// Waits until `done()` holds, checking every 10 ms; false when `within` passed first.
async fn settled(done: impl Fn() -> bool, within: std::time::Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while !done() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    true
}

/// Log writer: lines go to stderr from a background thread through a bounded queue, so a slow or
/// undrained stderr pipe never blocks the workers (lines are dropped when the queue is full).
#[derive(Clone)]
struct LogWriter(std::sync::mpsc::SyncSender<Vec<u8>>);

impl LogWriter {
    fn start() -> LogWriter {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(65536);
        let _ = std::thread::Builder::new().name("log".into()).spawn(move || {
            let mut err = std::io::stderr();
            while let Ok(line) = rx.recv() {
                let _ = err.write_all(&line);
            }
        });
        LogWriter(tx)
    }
}

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = self.0.try_send(buf.to_vec());
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LogWriter;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}
