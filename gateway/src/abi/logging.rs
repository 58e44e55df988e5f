//! Logging and time: `proxy_log`, `proxy_get_log_level`, `proxy_get_current_time_nanoseconds`,
//! `proxy_set_tick_period_milliseconds`.

use super::{code, read_string, status, write_bytes, write_u32, HResult, HostState, Registrar};
use wasmtime::Caller;

/// proxy-wasm log levels: trace 0, debug 1, info 2, warn 3, error 4, critical 5.
pub fn level_from_name(name: &str) -> u32 {
    match name.to_ascii_lowercase().as_str() {
        "trace" => 0,
        "debug" => 1,
        "info" => 2,
        "warn" | "warning" => 3,
        "error" => 4,
        "critical" | "off" => 5,
        _ => 2,
    }
}

/// Register the group.
pub fn add(l: &mut Registrar<'_>) -> anyhow::Result<()> {
    l.func("proxy_log", |mut c: Caller<'_, HostState>, level: i32, ptr: i32, len: i32| -> i32 {
        let msg = match read_string(&mut c, ptr, len) {
            Ok(m) => m,
            Err(e) => return e,
        };
        let worker = c.data().worker;
        let ctx = c.data().effective_ctx;
        let plugin = c.data().g.plugin_name.clone();
        match level {
            0 => tracing::trace!(target: "wasm", "[{plugin} worker={worker} ctx={ctx}] {msg}"),
            1 => tracing::debug!(target: "wasm", "[{plugin} worker={worker} ctx={ctx}] {msg}"),
            2 => tracing::info!(target: "wasm", "[{plugin} worker={worker} ctx={ctx}] {msg}"),
            3 => tracing::warn!(target: "wasm", "[{plugin} worker={worker} ctx={ctx}] {msg}"),
            _ => tracing::error!(target: "wasm", "[{plugin} worker={worker} ctx={ctx}] {msg}"),
        }
        status::OK
    })?;
    l.func("proxy_get_log_level", |mut c: Caller<'_, HostState>, out: i32| -> i32 {
        let lvl = c.data().g.log_level;
        code(write_u32(&mut c, out, lvl))
    })?;
    l.func(
        "proxy_get_current_time_nanoseconds",
        |mut c: Caller<'_, HostState>, out: i32| -> i32 {
            let ns = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            code(write_bytes(&mut c, out, &ns.to_le_bytes()))
        },
    )?;
    l.func("proxy_set_tick_period_milliseconds", |c: Caller<'_, HostState>, ms: i32| -> i32 {
        code(set_tick(c, ms as u32))
    })?;
    Ok(())
}

fn set_tick(c: Caller<'_, HostState>, ms: u32) -> HResult<()> {
    // Tick timers belong to the root context (0 disables).
    c.data().tick_tx.send_replace(ms as u64);
    Ok(())
}
