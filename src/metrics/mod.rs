//! Model-server metrics: Prometheus text parsing ([`prometheus`]), the `endpoint_metrics` decision
//! core ([`schedule`]), and the per-pod snapshots shared between worker VMs ([`Snapshot`]).
//!
//! Where metrics come from (see `policy::endpoint_metrics`): the gateway's health checker stores
//! each pod's `/metrics` body in the upstream host info (`metrics` field) when configured to; when
//! it does not, the plugin scrapes the pods itself on a tick, and one worker's scrape is shared with
//! the others through proxy-wasm shared data as a compact [`Snapshot`].

pub mod prometheus;
pub mod router;
pub mod schedule;
pub mod scrape;

pub use prometheus::{LoraInfo, PodMetrics};

/// A pod's parsed metrics plus the time they were sampled, as stored in shared data.
///
/// Encoded as short `key=value` lines (not JSON) so that reading it on the request path costs a few
/// splits and float parses; unknown keys are ignored so a newer plugin version can add fields.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    /// Wall-clock time (ms since the epoch) the scrape response arrived.
    pub sampled_ms: u64,
    /// The parsed signals.
    pub metrics: PodMetrics,
}

impl Snapshot {
    /// Encodes for `set_shared_data`.
    pub fn encode(&self) -> Vec<u8> {
        use std::fmt::Write;
        let mut s = String::with_capacity(96);
        let _ = write!(s, "v1\nts={}\n", self.sampled_ms);
        let m = &self.metrics;
        let mut opt = |k: &str, v: Option<f64>| {
            if let Some(v) = v {
                let _ = writeln!(s, "{k}={v}");
            }
        };
        opt("r", m.running);
        opt("w", m.waiting);
        opt("kv", m.kv_cache_usage);
        opt("t", m.target);
        opt("pq", m.prefix_cache_queries);
        opt("ph", m.prefix_cache_hits);
        if let Some(l) = &m.lora {
            let _ = writeln!(s, "lm={}", l.max_lora);
            let _ = writeln!(s, "lt={}", l.timestamp);
            let _ = writeln!(s, "lr={}", l.running.join(","));
            let _ = writeln!(s, "lw={}", l.waiting.join(","));
        }
        s.into_bytes()
    }

    /// Decodes what [`Snapshot::encode`] wrote; `None` for anything else (foreign or corrupt data).
    pub fn decode(bytes: &[u8]) -> Option<Snapshot> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut lines = text.lines();
        if lines.next()? != "v1" {
            return None;
        }
        let mut snap = Snapshot::default();
        let mut have_ts = false;
        let num = |v: &str| v.parse::<f64>().ok().filter(|x| !x.is_nan());
        let list =
            |v: &str| v.split(',').filter(|a| !a.is_empty()).map(String::from).collect::<Vec<_>>();
        for line in lines {
            let Some((k, v)) = line.split_once('=') else { continue };
            let m = &mut snap.metrics;
            match k {
                "ts" => {
                    snap.sampled_ms = v.parse().ok()?;
                    have_ts = true;
                }
                "r" => m.running = num(v),
                "w" => m.waiting = num(v),
                "kv" => m.kv_cache_usage = num(v),
                "t" => m.target = num(v),
                "pq" => m.prefix_cache_queries = num(v),
                "ph" => m.prefix_cache_hits = num(v),
                "lm" => {
                    m.lora.get_or_insert_with(LoraInfo::default).max_lora = v.parse().unwrap_or(0)
                }
                "lt" => {
                    m.lora.get_or_insert_with(LoraInfo::default).timestamp = num(v).unwrap_or(0.0)
                }
                "lr" => m.lora.get_or_insert_with(LoraInfo::default).running = list(v),
                "lw" => m.lora.get_or_insert_with(LoraInfo::default).waiting = list(v),
                _ => {}
            }
        }
        have_ts.then_some(snap)
    }

    /// True when the sample is older than `stale_ms` at `now_ms` (or from the future by more than
    /// that, which means a clock jump; such data is not trusted either).
    pub fn is_stale(&self, now_ms: u64, stale_ms: u64) -> bool {
        now_ms.abs_diff(self.sampled_ms) > stale_ms
    }
}

#[cfg(test)]
#[path = "snapshot_tests.rs"]
mod tests;
