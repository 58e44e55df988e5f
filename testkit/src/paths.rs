//! Where the artifacts under test live, and small helpers for unique names and free ports.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

/// The workspace root (parent of this crate's directory).
pub fn workspace_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(Path::to_path_buf).unwrap_or_else(|| here.to_path_buf())
}

/// Cargo's target directory: `$CARGO_TARGET_DIR` or `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => {
            let p = PathBuf::from(dir);
            if p.is_absolute() {
                p
            } else {
                workspace_root().join(p)
            }
        }
        None => workspace_root().join("target"),
    }
}

/// The gateway binary: `$GATEWAY_BIN` or `<target>/release/gateway`.
pub fn gateway_bin() -> PathBuf {
    std::env::var_os("GATEWAY_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("release").join("gateway"))
}

/// The plugin module: `$AI_LB_WASM` or `<target>/wasm32-wasip1/wasm-release/ai_load_balancer.wasm`.
pub fn plugin_wasm() -> PathBuf {
    std::env::var_os("AI_LB_WASM").map(PathBuf::from).unwrap_or_else(|| {
        target_dir().join("wasm32-wasip1").join("wasm-release").join("ai_load_balancer.wasm")
    })
}

/// A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it), and that this process
/// has not handed out before. Tests in one binary run in parallel: without the second rule two of
/// them can get the same just-released port, and one test's client then talks to the other
/// test's server (the OS may still give the port to another socket; the servers' ready checks
/// catch that by process id).
pub fn free_port() -> std::io::Result<u16> {
    static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(PoisonError::into_inner);
    // Each try keeps its listener open until the end, so the OS gives a new port every time.
    let mut held = Vec::new();
    for _ in 0..64 {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        if handed_out.insert(port) {
            return Ok(port);
        }
        held.push(listener);
    }
    Err(std::io::Error::other("no port on 127.0.0.1 that this process has not used already"))
}

/// A name unique within this machine for a while: prefix, process id, a counter and the clock.
/// Used for route names (Redis key namespaces), temp dirs and conversation texts.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    format!("{prefix}-{}-{n}-{nanos:x}", std::process::id())
}

/// A fresh temporary directory (removed by [`TempDir`]'s drop).
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates `<tmp>/<unique prefix name>`.
    pub fn new(prefix: &str) -> std::io::Result<TempDir> {
        let path = std::env::temp_dir().join(unique_name(prefix));
        std::fs::create_dir_all(&path)?;
        Ok(TempDir { path })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
