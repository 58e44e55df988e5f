//! Higress extensions: `proxy_redis_init`, `proxy_redis_call`, `proxy_get_upstream_hosts`,
//! `proxy_set_upstream_override_host`. (`proxy_inject_encoded_data_to_filter_chain` links to the
//! Unimplemented stub.)
//!
//! Redis calls run on the root context: tokens start at 7 and step by 4, the reply is delivered to
//! `proxy_on_redis_call_response(root_id, token, status, size)` with the raw RESP bytes in buffer 9.
//! Unknown cluster: BadArgument at once; no endpoint: InternalFailure. A second
//! `proxy_redis_init` with the same settings keeps the connection; with others it closes it.
//! `get_upstream_hosts` lists the hosts of the effective stream's cluster as header-map pairs
//! (`ip:port`, `{"health_status": ..., "metrics": ...}`); `set_upstream_override_host` always
//! returns Ok and is read by the router when the request headers leave this filter (non-strict).

use super::{
    code, copy_out, marshal_pairs, read_bytes, read_string, status, write_u32, HostState, Registrar,
};
use crate::redis::{RedisClient, RedisConfig, RedisTarget};
use bytes::Bytes;
use wasmtime::Caller;

/// Register the group.
pub fn add(l: &mut Registrar<'_>) -> anyhow::Result<()> {
    l.func(
        "proxy_redis_init",
        |mut c: Caller<'_, HostState>,
         cp: i32,
         cs: i32,
         up: i32,
         us: i32,
         pp: i32,
         ps: i32,
         timeout: i32|
         -> i32 {
            let (full, user, pass) = match (
                read_string(&mut c, cp, cs),
                read_string(&mut c, up, us),
                read_string(&mut c, pp, ps),
            ) {
                (Ok(a), Ok(b), Ok(p)) => (a, b, p),
                (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return e,
            };
            let st = c.data_mut();
            let name = full.split('?').next().unwrap_or("").to_string();
            let Some(cluster) = st.g.clusters.get(&name) else { return status::BAD_ARGUMENT };
            let cfg =
                RedisConfig::parse(&full, user, pass, timeout as u32, cluster.connect_timeout);
            // A re-init with the same settings keeps the connection; other settings close it
            // (see `RedisClient::initialize`).
            match st.redis_clients.get_mut(&name) {
                Some(client) => client.initialize(cfg),
                None => {
                    let mut client = RedisClient::new(cfg.clone());
                    client.initialize(cfg);
                    st.redis_clients.insert(name, client);
                }
            }
            status::OK
        },
    )?;
    l.func(
        "proxy_redis_call",
        |mut c: Caller<'_, HostState>, cp: i32, cs: i32, qp: i32, qs: i32, tokp: i32| -> i32 {
            let (full, query) = match (read_string(&mut c, cp, cs), read_bytes(&mut c, qp, qs)) {
                (Ok(a), Ok(q)) => (a, q),
                (Err(e), _) | (_, Err(e)) => return e,
            };
            let st = c.data_mut();
            let name = full.split('?').next().unwrap_or("").to_string();
            let Some(cluster) = st.g.clusters.get(&name) else { return status::BAD_ARGUMENT };
            let Some(target) = RedisTarget::of(&cluster) else {
                return status::INTERNAL_FAILURE;
            };
            let token = st.next_redis_token;
            st.next_redis_token = st.next_redis_token.wrapping_add(4);
            // Exiting: Envoy's dispatchers have stopped, so the command is never written.
            if st.g.is_exiting() {
                return code(write_u32(&mut c, tokp, token));
            }
            let (events, gen) = (st.events.clone(), st.gen);
            let ct = cluster.connect_timeout;
            let client = st.redis_clients.entry(name).or_insert_with(|| {
                RedisClient::new(RedisConfig::parse(&full, String::new(), String::new(), 0, ct))
            });
            if !client.send(target, token, Bytes::from(query), events, gen) {
                return status::INTERNAL_FAILURE;
            }
            st.g.redis_outstanding.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            match write_u32(&mut c, tokp, token) {
                Ok(()) => status::OK,
                Err(e) => e,
            }
        },
    )?;
    l.func("proxy_get_upstream_hosts", |mut c: Caller<'_, HostState>, pp: i32, sp: i32| -> i32 {
        let st = c.data();
        let Some(stream) = st.effective_stream() else { return status::NOT_FOUND };
        let cluster_name = match stream.lock() {
            Ok(s) => s.cluster_name.clone(),
            Err(_) => return status::INTERNAL_FAILURE,
        };
        let Some(cluster) = st.g.clusters.get(&cluster_name) else { return status::NOT_FOUND };
        let pairs: Vec<(String, std::sync::Arc<[u8]>)> =
            cluster.endpoints().iter().map(|e| (e.address.clone(), e.host_info())).collect();
        let data = if pairs.is_empty() { Vec::new() } else { marshal_pairs(&pairs) };
        match copy_out(&mut c, &data, pp, sp) {
            Ok(()) => status::OK,
            Err(e) => e,
        }
    })?;
    l.func(
        "proxy_set_upstream_override_host",
        |mut c: Caller<'_, HostState>, p: i32, s: i32| -> i32 {
            let host = match read_string(&mut c, p, s) {
                Ok(h) => h,
                Err(e) => return e,
            };
            if let Some(stream) = c.data().effective_stream() {
                if let Ok(mut s) = stream.lock() {
                    s.override_host = Some(host);
                }
            }
            // Always Ok: misuse is not reported (Envoy).
            status::OK
        },
    )?;
    Ok(())
}
