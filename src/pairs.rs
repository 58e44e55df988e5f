//! proxy-wasm header-map serialization (`u32 n`, n × (`u32 key_len`, `u32 value_len`), then each
//! key and value followed by a NUL), and the upstream-host list carried in it. Safe and
//! bounds-checked: the bytes come from the host.

use crate::host::{Health, UpstreamHost};
use std::collections::HashMap;
use std::rc::Rc;

/// Serializes pairs.
pub fn serialize<K: AsRef<[u8]>, V: AsRef<[u8]>>(pairs: &[(K, V)]) -> Vec<u8> {
    let mut size = 4;
    for (k, v) in pairs {
        size += 8 + k.as_ref().len() + v.as_ref().len() + 2;
    }
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.as_ref().len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.as_ref().len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_ref());
        out.push(0);
        out.extend_from_slice(v.as_ref());
        out.push(0);
    }
    out
}

fn read_u32(bytes: &[u8], at: usize) -> Option<usize> {
    let b = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(b.try_into().ok()?) as usize)
}

/// Parses pairs; `None` if the bytes are malformed. Empty input is an empty map.
pub fn parse(bytes: &[u8]) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
    Some(slices(bytes)?.into_iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect())
}

/// The pairs of `bytes` as slices of it; `None` if the bytes are malformed.
fn slices(bytes: &[u8]) -> Option<Vec<(&[u8], &[u8])>> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let n = read_u32(bytes, 0)?;
    // Each pair needs at least 10 bytes: a huge n is a corrupt buffer, not an allocation request.
    if n > bytes.len() / 10 + 1 {
        return None;
    }
    let mut lens = Vec::with_capacity(n);
    for i in 0..n {
        let at = 4 + i * 8;
        lens.push((read_u32(bytes, at)?, read_u32(bytes, at + 4)?));
    }
    let mut pos = 4 + n * 8;
    let mut out = Vec::with_capacity(n);
    for (kl, vl) in lens {
        let k = bytes.get(pos..pos.checked_add(kl)?)?;
        pos = pos.checked_add(kl + 1)?;
        let v = bytes.get(pos..pos.checked_add(vl)?)?;
        pos = pos.checked_add(vl + 1)?;
        out.push((k, v));
    }
    Some(out)
}

/// One host from its `proxy_get_upstream_hosts` pair; `None` when the address is not UTF-8.
/// Malformed JSON gives health Unknown (never chosen) rather than an error.
fn upstream_host(address: &[u8], info: &[u8]) -> Option<UpstreamHost> {
    let address = std::str::from_utf8(address).ok()?.to_string();
    let info: Option<serde_json::Value> = serde_json::from_slice(info).ok();
    let health = info
        .as_ref()
        .and_then(|i| i.get("health_status"))
        .and_then(|h| h.as_str())
        .map(Health::parse)
        .unwrap_or(Health::Unknown);
    let metrics = info
        .as_ref()
        .and_then(|i| i.get("metrics"))
        .and_then(|m| m.as_str())
        .filter(|m| !m.is_empty())
        .map(Rc::from);
    Some(UpstreamHost { address, health, metrics })
}

/// Parses `proxy_get_upstream_hosts` output: pairs of (`ip:port`, info JSON with `health_status`
/// and `metrics`). Malformed JSON gives health Unknown (never chosen) rather than an error.
pub fn parse_upstream_hosts(bytes: &[u8]) -> Option<Vec<UpstreamHost>> {
    Some(slices(bytes)?.into_iter().filter_map(|(k, v)| upstream_host(k, v)).collect())
}

/// Most bytes of host info a [`HostListMemo`] keeps (Higress caps each stored health-check body
/// at 64 KiB: 256 such pods); past it the memo starts over.
const MEMO_MAX_BYTES: usize = 16 << 20;

/// [`parse_upstream_hosts`] for a worker that reads the same host list at every request: each
/// host's info bytes are compared with the last ones seen for its address, and an unchanged host
/// is taken from the memo (its metrics body shared, not parsed or copied again). Why: the
/// health check stores each pod's whole `/metrics` body (a real vLLM's is 30-60 KB, every
/// histogram bucket included), the list carries them all, and the bodies change once per check
/// interval while the list is read per request; parsing them each time cost about 0.15 ms of
/// plugin time per pod and request (`bench run overhead-large`, `bench/HISTORY.md`).
#[derive(Default)]
pub struct HostListMemo {
    /// Address -> (its last info bytes, the host parsed from them).
    by_address: HashMap<Vec<u8>, (Vec<u8>, UpstreamHost)>,
    /// Info bytes held.
    bytes: usize,
}

impl HostListMemo {
    /// The hosts of `bytes`, as [`parse_upstream_hosts`] gives them.
    pub fn parse(&mut self, bytes: &[u8]) -> Option<Vec<UpstreamHost>> {
        let pairs = slices(bytes)?;
        let mut out = Vec::with_capacity(pairs.len());
        for (address, info) in pairs {
            if let Some((seen, host)) = self.by_address.get(address) {
                if seen.as_slice() == info {
                    out.push(host.clone());
                    continue;
                }
            }
            let Some(host) = upstream_host(address, info) else { continue };
            if self.bytes.saturating_add(info.len()) > MEMO_MAX_BYTES {
                self.by_address.clear();
                self.bytes = 0;
            }
            self.bytes += info.len();
            if let Some((old, _)) =
                self.by_address.insert(address.to_vec(), (info.to_vec(), host.clone()))
            {
                self.bytes = self.bytes.saturating_sub(old.len());
            }
            out.push(host);
        }
        Some(out)
    }
}

#[cfg(test)]
#[path = "pairs_tests.rs"]
mod tests;
