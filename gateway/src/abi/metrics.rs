//! Metrics: `proxy_define_metric`, `proxy_increment_metric`, `proxy_record_metric`, `proxy_get_metric`.
//! Metrics are process-wide (like Envoy stats) and exposed on admin `/stats`.

use super::{read_string, status, write_bytes, write_u32, HostState, Registrar};
use crate::stats::{MetricError, MetricKind};
use wasmtime::Caller;

/// Register the group.
pub fn add(l: &mut Registrar<'_>) -> anyhow::Result<()> {
    l.func(
        "proxy_define_metric",
        |mut c: Caller<'_, HostState>, kind: i32, ptr: i32, len: i32, out: i32| -> i32 {
            let kind = match kind {
                0 => MetricKind::Counter,
                1 => MetricKind::Gauge,
                2 => MetricKind::Histogram,
                _ => return status::BAD_ARGUMENT,
            };
            let name = match read_string(&mut c, ptr, len) {
                Ok(n) => n,
                Err(e) => return e,
            };
            let id = c.data().g.stats.define(kind, &name);
            match write_u32(&mut c, out, id) {
                Ok(()) => status::OK,
                Err(e) => e,
            }
        },
    )?;
    l.func("proxy_increment_metric", |c: Caller<'_, HostState>, id: i32, offset: i64| -> i32 {
        match c.data().g.stats.increment(id as u32, offset) {
            Ok(()) => status::OK,
            Err(e) => metric_status(e),
        }
    })?;
    l.func("proxy_record_metric", |c: Caller<'_, HostState>, id: i32, value: i64| -> i32 {
        match c.data().g.stats.record(id as u32, value as u64) {
            Ok(()) => status::OK,
            Err(e) => metric_status(e),
        }
    })?;
    l.func("proxy_get_metric", |mut c: Caller<'_, HostState>, id: i32, out: i32| -> i32 {
        match c.data().g.stats.get(id as u32) {
            Ok(v) => match write_bytes(&mut c, out, &v.to_le_bytes()) {
                Ok(()) => status::OK,
                Err(e) => e,
            },
            Err(e) => metric_status(e),
        }
    })?;
    Ok(())
}

fn metric_status(e: MetricError) -> i32 {
    match e {
        MetricError::NotFound => status::NOT_FOUND,
        MetricError::BadArgument => status::BAD_ARGUMENT,
    }
}
