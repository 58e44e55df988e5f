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
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_matches_the_documented_layout() {
        let b = serialize(&[("a", "xy")]);
        assert_eq!(b, vec![1, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, b'a', 0, b'x', b'y', 0]);
        let pairs = vec![(":status", "200"), ("x", ""), ("", "v")];
        let parsed = parse(&serialize(&pairs)).unwrap();
        assert_eq!(parsed.len(), 3);
        assert_eq!(parsed[0], (b":status".to_vec(), b"200".to_vec()));
        assert_eq!(parsed[2], (Vec::new(), b"v".to_vec()));
    }

    #[test]
    fn malformed_input_is_rejected_not_panicking() {
        let good = serialize(&[("key", "value")]);
        for cut in 1..good.len() - 1 {
            assert_eq!(parse(&good[..cut]), None, "truncated at {cut}");
        }
        assert_eq!(parse(&[0xff, 0xff, 0xff, 0xff]), None);
        assert_eq!(parse(&[]), Some(vec![]));
    }

    #[test]
    fn parses_upstream_hosts_with_health_and_metrics() {
        let bytes = serialize(&[
            (
                "10.0.0.1:8000",
                r#"{"health_status":"Healthy","metrics":"vllm:num_requests_running 3\n"}"#,
            ),
            ("10.0.0.2:8000", r#"{"health_status":"Unhealthy","metrics":""}"#),
            ("10.0.0.3:8000", "not json"),
        ]);
        let hosts = parse_upstream_hosts(&bytes).unwrap();
        assert_eq!(hosts.len(), 3);
        assert!(hosts[0].is_healthy());
        assert_eq!(hosts[0].metrics.as_deref(), Some("vllm:num_requests_running 3\n"));
        assert_eq!(hosts[1].health, Health::Unhealthy);
        assert_eq!(hosts[1].metrics, None);
        assert_eq!(hosts[2].health, Health::Unknown);
        assert!(!hosts[2].is_healthy());
    }
}
