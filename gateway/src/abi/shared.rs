//! Shared data and queues: `proxy_get_shared_data`, `proxy_set_shared_data`,
//! `proxy_register_shared_queue`, `proxy_resolve_shared_queue`, `proxy_dequeue_shared_queue`,
//! `proxy_enqueue_shared_queue`.
//!
//! Both are keyed per `vm_id` and shared by all workers (process-wide, like Envoy). Shared data
//! uses a CAS counter: `cas = 0` sets unconditionally, a stale CAS gives CasMismatch (8).
//! `enqueue` wakes `proxy_on_queue_ready` on the root context of the worker that registered the
//! queue (the latest registration wins); `dequeue` of an empty queue gives Empty (7).

use super::{copy_out, read_bytes, read_string, status, write_u32, HostState, Registrar};
use crate::global::WorkerEvent;
pub use crate::global::{SharedData, SharedQueues};
use wasmtime::Caller;

/// Register the group.
pub fn add(l: &mut Registrar<'_>) -> anyhow::Result<()> {
    l.func(
        "proxy_get_shared_data",
        |mut c: Caller<'_, HostState>, kp: i32, ks: i32, vpp: i32, vsp: i32, casp: i32| -> i32 {
            let key = match read_string(&mut c, kp, ks) {
                Ok(k) => k,
                Err(e) => return e,
            };
            let g = c.data().g.clone();
            match g.shared_data.get(&g.plugin_vm_id, &key) {
                Some((v, cas)) => {
                    if let Err(e) = copy_out(&mut c, &v, vpp, vsp) {
                        return e;
                    }
                    match write_u32(&mut c, casp, cas) {
                        Ok(()) => status::OK,
                        Err(e) => e,
                    }
                }
                None => status::NOT_FOUND,
            }
        },
    )?;
    l.func(
        "proxy_set_shared_data",
        |mut c: Caller<'_, HostState>, kp: i32, ks: i32, vp: i32, vs: i32, cas: i32| -> i32 {
            let (key, val) = match (read_string(&mut c, kp, ks), read_bytes(&mut c, vp, vs)) {
                (Ok(k), Ok(v)) => (k, v),
                (Err(e), _) | (_, Err(e)) => return e,
            };
            let g = c.data().g.clone();
            g.shared_data.set(&g.plugin_vm_id, &key, val, cas as u32)
        },
    )?;
    l.func(
        "proxy_register_shared_queue",
        |mut c: Caller<'_, HostState>, np: i32, ns: i32, idp: i32| -> i32 {
            let name = match read_string(&mut c, np, ns) {
                Ok(n) => n,
                Err(e) => return e,
            };
            let (g, w, gen) = (c.data().g.clone(), c.data().worker, c.data().gen);
            let id = g.queues.register(&g.plugin_vm_id, &name, w, gen);
            match write_u32(&mut c, idp, id) {
                Ok(()) => status::OK,
                Err(e) => e,
            }
        },
    )?;
    l.func(
        "proxy_resolve_shared_queue",
        |mut c: Caller<'_, HostState>, vp: i32, vs: i32, np: i32, ns: i32, idp: i32| -> i32 {
            let (vm, name) = match (read_string(&mut c, vp, vs), read_string(&mut c, np, ns)) {
                (Ok(v), Ok(n)) => (v, n),
                (Err(e), _) | (_, Err(e)) => return e,
            };
            let g = c.data().g.clone();
            let vm = if vm.is_empty() { g.plugin_vm_id.clone() } else { vm };
            match g.queues.resolve(&vm, &name) {
                Some(id) => match write_u32(&mut c, idp, id) {
                    Ok(()) => status::OK,
                    Err(e) => e,
                },
                None => status::NOT_FOUND,
            }
        },
    )?;
    l.func(
        "proxy_dequeue_shared_queue",
        |mut c: Caller<'_, HostState>, id: i32, pp: i32, sp: i32| -> i32 {
            let g = c.data().g.clone();
            match g.queues.dequeue(id as u32) {
                Ok(v) => match copy_out(&mut c, &v, pp, sp) {
                    Ok(()) => status::OK,
                    Err(e) => e,
                },
                Err(e) => e,
            }
        },
    )?;
    l.func(
        "proxy_enqueue_shared_queue",
        |mut c: Caller<'_, HostState>, id: i32, vp: i32, vs: i32| -> i32 {
            let v = match read_bytes(&mut c, vp, vs) {
                Ok(v) => v,
                Err(e) => return e,
            };
            let g = c.data().g.clone();
            match g.queues.enqueue(id as u32, v) {
                Some((w, gen)) => {
                    if let Some(tx) = g.worker_events.get().and_then(|v| v.get(w)) {
                        let _ = tx.send(WorkerEvent::QueueReady { gen, queue_id: id as u32 });
                    }
                    status::OK
                }
                None => status::NOT_FOUND,
            }
        },
    )?;
    Ok(())
}
