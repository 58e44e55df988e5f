//! Properties: `proxy_get_property`, `proxy_set_property`.
//!
//! Path segments are joined with `\0` (a trailing NUL is accepted). Strings are raw bytes, integers
//! 8-byte little-endian, as in Envoy. Supported: `plugin_name`, `plugin_root_id`, `plugin_vm_id`,
//! `route_name`, `cluster_name` (also `xds.route_name`, `xds.cluster_name`), `connection_id`,
//! `request.{path,url_path,query,host,method,scheme,id,protocol,time,useragent,referer}`,
//! `request.headers` (pairs), `request.headers.<name>`, `response.code`, `response.headers.<name>`,
//! `source.{address,port}`, `destination.{address,port}`, `upstream.address`, plus anything the plugin set.
//! Higress `set_property` keys: `clear_route_cache` (`off` disables the re-match after header
//! changes) and `set_decoder_buffer_limit` / `set_encoder_buffer_limit` (uint32 as a string).

use super::{copy_out, read_bytes, status, HostState, Registrar, StreamState};
use wasmtime::Caller;

fn int(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn stream_property(s: &StreamState, segs: &[&str]) -> Option<Vec<u8>> {
    let joined = segs.join(".");
    if let Some(v) = s.props.get(&joined) {
        return Some(v.clone());
    }
    let i = &s.info;
    let v = match segs {
        ["route_name"] | ["xds", "route_name"] => {
            if s.route_name.is_empty() {
                return None;
            }
            s.route_name.clone().into_bytes()
        }
        ["cluster_name"] | ["xds", "cluster_name"] => {
            if s.cluster_name.is_empty() {
                return None;
            }
            s.cluster_name.clone().into_bytes()
        }
        ["connection_id"] => int(i.connection_id),
        // Envoy's CEL request attributes read the request's header map as it is now, so a
        // plugin's rewrite of `:path` shows in `request.path`.
        ["request", "path"] => header(s, ":path")?,
        ["request", "url_path"] => {
            let path = header(s, ":path")?;
            let end = path.iter().position(|&b| b == b'?' || b == b'#').unwrap_or(path.len());
            path[..end].to_vec()
        }
        ["request", "query"] => {
            let path = header(s, ":path")?;
            match path.iter().position(|&b| b == b'?') {
                Some(q) => path[q + 1..].to_vec(),
                None => Vec::new(),
            }
        }
        ["request", "host"] => header(s, ":authority")?,
        ["request", "method"] => header(s, ":method")?,
        ["request", "scheme"] => header(s, ":scheme")?,
        ["request", "id"] => header(s, "x-request-id")?,
        ["request", "protocol"] => i.protocol.clone().into_bytes(),
        ["request", "time"] => int(i
            .time
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)),
        ["request", "useragent"] => header(s, "user-agent")?,
        ["request", "referer"] => header(s, "referer")?,
        ["request", "headers", name] => header(s, name)?,
        ["request", "headers"] => super::marshal_pairs(
            &s.req_headers.iter().filter(|(k, _)| !k.starts_with(':')).cloned().collect::<Vec<_>>(),
        ),
        ["response", "headers", name] => {
            let name = name.to_ascii_lowercase();
            s.resp_headers.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone())?
        }
        ["response", "code"] => int(s.response_code? as u64),
        ["source", "address"] => i.source.to_string().into_bytes(),
        ["source", "port"] => int(i.source.port() as u64),
        ["destination", "address"] => i.destination.to_string().into_bytes(),
        ["destination", "port"] => int(i.destination.port() as u64),
        ["upstream", "address"] => s.upstream_host.clone()?.into_bytes(),
        _ => return None,
    };
    Some(v)
}

fn header(s: &StreamState, name: &str) -> Option<Vec<u8>> {
    crate::global::header_bytes(&s.req_headers, &name.to_ascii_lowercase()).map(<[u8]>::to_vec)
}

fn get_property(st: &HostState, path: &[u8]) -> Option<Vec<u8>> {
    let text = String::from_utf8_lossy(path);
    let segs: Vec<&str> = text.split('\0').filter(|s| !s.is_empty()).collect();
    let g = &st.g;
    match segs.as_slice() {
        ["plugin_name"] => return Some(g.plugin_name.clone().into_bytes()),
        ["plugin_root_id"] => return Some(g.plugin_root_id.clone().into_bytes()),
        ["plugin_vm_id"] => return Some(g.plugin_vm_id.clone().into_bytes()),
        _ => {}
    }
    let s = st.effective_stream()?;
    let s = s.lock().ok()?;
    stream_property(&s, &segs)
}

/// Register the group.
pub fn add(l: &mut Registrar<'_>) -> anyhow::Result<()> {
    l.func(
        "proxy_get_property",
        |mut c: Caller<'_, HostState>, pp: i32, ps: i32, vpp: i32, vsp: i32| -> i32 {
            let path = match read_bytes(&mut c, pp, ps) {
                Ok(p) => p,
                Err(e) => return e,
            };
            match get_property(c.data(), &path) {
                Some(v) => match copy_out(&mut c, &v, vpp, vsp) {
                    Ok(()) => status::OK,
                    Err(e) => e,
                },
                None => status::NOT_FOUND,
            }
        },
    )?;
    l.func(
        "proxy_set_property",
        |mut c: Caller<'_, HostState>, pp: i32, ps: i32, vp: i32, vs: i32| -> i32 {
            let (path, value) = match (read_bytes(&mut c, pp, ps), read_bytes(&mut c, vp, vs)) {
                (Ok(p), Ok(v)) => (p, v),
                (Err(e), _) | (_, Err(e)) => return e,
            };
            let text = String::from_utf8_lossy(&path);
            let key = text.split('\0').filter(|s| !s.is_empty()).collect::<Vec<_>>().join(".");
            let vtext = String::from_utf8_lossy(&value).trim().to_string();
            let st = c.data_mut();
            match st.effective_stream() {
                Some(s) => {
                    let Ok(mut s) = s.lock() else { return status::INTERNAL_FAILURE };
                    match key.as_str() {
                        "clear_route_cache" => s.clear_route_cache_off = vtext == "off",
                        "set_decoder_buffer_limit" => match vtext.parse::<u32>() {
                            Ok(n) => s.decoder_limit = n as usize,
                            Err(_) => return status::BAD_ARGUMENT,
                        },
                        "set_encoder_buffer_limit" => match vtext.parse::<u32>() {
                            Ok(n) => s.encoder_limit = n as usize,
                            Err(_) => return status::BAD_ARGUMENT,
                        },
                        _ => {
                            s.props.insert(key, value);
                        }
                    }
                }
                // Envoy's root context has no stream info to set a property on.
                None => return status::NOT_FOUND,
            }
            status::OK
        },
    )?;
    Ok(())
}
