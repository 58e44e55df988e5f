//! proxy-wasm header-map serialization (`u32 n`, n × (`u32 key_len`, `u32 value_len`), then each
//! key and value followed by a NUL), and the upstream-host list carried in it. Safe and
//! bounds-checked: the bytes come from the host.

use crate::host::{Health, UpstreamHost};

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
        let k = bytes.get(pos..pos.checked_add(kl)?)?.to_vec();
        pos = pos.checked_add(kl + 1)?;
        let v = bytes.get(pos..pos.checked_add(vl)?)?.to_vec();
        pos = pos.checked_add(vl + 1)?;
        out.push((k, v));
    }
    Some(out)
}

/// Parses `proxy_get_upstream_hosts` output: pairs of (`ip:port`, info JSON with `health_status`
/// and `metrics`). Malformed JSON gives health Unknown (never chosen) rather than an error.
pub fn parse_upstream_hosts(bytes: &[u8]) -> Option<Vec<UpstreamHost>> {
    let pairs = parse(bytes)?;
    Some(
        pairs
            .into_iter()
            .filter_map(|(k, v)| {
                let address = String::from_utf8(k).ok()?;
                let info: Option<serde_json::Value> = serde_json::from_slice(&v).ok();
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
                    .map(str::to_string);
                Some(UpstreamHost { address, health, metrics })
            })
            .collect(),
    )
}

#[cfg(test)]
#[path = "pairs_tests.rs"]
mod tests;
