//! A small, panic-free reader of the Prometheus text exposition format, specialised for the
//! load signals of LLM model servers (vLLM V0 and V1, SGLang).
//!
//! Why not a general parser: the plugin runs as wasm inside every gateway worker, must stay small,
//! and reads each pod's `/metrics` (30–60 KiB, mostly histogram buckets) often. This reader walks the
//! text once, looks only at the families it needs, and parses a value only when the name matches,
//! so unrelated lines cost a few byte comparisons. It allocates only a small map per signal (one
//! entry per engine) and LoRA adapter names.
//!
//! Semantics:
//! - Comments (`# HELP`, `# TYPE`, anything after `#`) and blank lines are skipped.
//! - Names are matched exactly, so histogram series (`_bucket`, `_sum`, `_count`) and counter
//!   `_created` series never match a gauge name.
//! - `:` and `_` are interchangeable in names: SGLang's router re-exports `sglang:x` as `sglang_x`.
//! - Series are grouped by **engine**: their labels minus the shard ranks (every label whose name
//!   ends in `_rank` except `dp_rank`). SGLang's schedulers label their gauges with `tp_rank` and
//!   `pp_rank`; by default only each data-parallel group's first attention-TP rank exports them, but
//!   with pipeline parallelism each stage's scheduler does, and with
//!   `--enable-metrics-for-all-schedulers` every TP rank does, each repeating its group's queue.
//!   Within one engine the largest value is taken, so those repeats are counted once.
//! - Counts (running, waiting, prefix-cache counters, the target metric) are **summed** over
//!   engines: a pod serving several models or several data-parallel engines reports one series each.
//! - KV-cache usage is the **mean** over engines (each engine has its own pool, so the mean is the
//!   fraction of the pod's total KV memory in use when engines are equally sized), clamped to 0..1.
//!   vLLM 0.10.x emits both `kv_cache_usage_perc` and the deprecated `gpu_cache_usage_perc`; the
//!   new name wins so a pod is not counted twice.
//! - `vllm:lora_requests_info`: the series whose value (a wall-clock timestamp) is the newest wins.
//! - Unparsable lines are skipped, never an error: a partial body still yields what it contains.

use std::collections::BTreeMap;

/// LoRA state of a vLLM pod, from the labels of `vllm:lora_requests_info`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoraInfo {
    /// `max_lora`: how many adapters the pod can hold at once.
    pub max_lora: u32,
    /// `running_lora_adapters`: adapters with running requests (loaded on the GPU).
    pub running: Vec<String>,
    /// `waiting_lora_adapters`: adapters with waiting requests (about to be loaded).
    pub waiting: Vec<String>,
    /// The sample value: vLLM sets it to the wall-clock time (seconds) of the update.
    pub timestamp: f64,
}

impl LoraInfo {
    /// True when `adapter` is loaded or about to be loaded on this pod.
    pub fn has_adapter(&self, adapter: &str) -> bool {
        self.running.iter().any(|a| a == adapter) || self.waiting.iter().any(|a| a == adapter)
    }

    /// Number of distinct adapters running or waiting (a pod's adapter slots in use).
    pub fn active_count(&self) -> usize {
        let extra = self.waiting.iter().filter(|w| !self.running.contains(w)).count();
        self.running.len() + extra
    }
}

/// The load signals of one pod. `None` means "the body did not contain this signal".
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodMetrics {
    /// Requests being decoded/prefilled now (`vllm:num_requests_running`, `sglang:num_running_reqs`).
    pub running: Option<f64>,
    /// Requests queued in the engine (`vllm:num_requests_waiting`, `sglang:num_queue_reqs`).
    pub waiting: Option<f64>,
    /// KV-cache usage 0..1 (`vllm:kv_cache_usage_perc`, `vllm:gpu_cache_usage_perc`, `sglang:token_usage`).
    pub kv_cache_usage: Option<f64>,
    /// LoRA state (vLLM only, when LoRA is enabled).
    pub lora: Option<LoraInfo>,
    /// vLLM V1 `vllm:prefix_cache_queries_total` (tokens).
    pub prefix_cache_queries: Option<f64>,
    /// vLLM V1 `vllm:prefix_cache_hits_total` (tokens).
    pub prefix_cache_hits: Option<f64>,
    /// The user-selected `target_metric` (summed over engines), when one was asked for.
    pub target: Option<f64>,
}

impl PodMetrics {
    /// True when the body held at least one signal the scheduler can use.
    pub fn is_empty(&self) -> bool {
        self.running.is_none()
            && self.waiting.is_none()
            && self.kv_cache_usage.is_none()
            && self.lora.is_none()
            && self.target.is_none()
    }
}

/// Which family a name belongs to (after `:`/`_` normalisation).
#[derive(Clone, Copy, PartialEq)]
enum Family {
    Running,
    Waiting,
    KvV1,
    KvV0,
    KvSglang,
    Lora,
    PrefixQueries,
    PrefixHits,
}

const FAMILIES: &[(&str, Family)] = &[
    ("vllm:num_requests_running", Family::Running),
    ("vllm:num_requests_waiting", Family::Waiting),
    ("vllm:kv_cache_usage_perc", Family::KvV1),
    ("vllm:gpu_cache_usage_perc", Family::KvV0),
    ("vllm:lora_requests_info", Family::Lora),
    ("vllm:prefix_cache_queries_total", Family::PrefixQueries),
    ("vllm:prefix_cache_hits_total", Family::PrefixHits),
    ("sglang:num_running_reqs", Family::Running),
    ("sglang:num_queue_reqs", Family::Waiting),
    ("sglang:token_usage", Family::KvSglang),
];

/// Names whose value is a 0..1 KV usage: a `target_metric` naming one of these uses the
/// averaged `kv_cache_usage` rather than a sum.
const KV_NAMES: &[&str] =
    &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"];

/// Compares metric names treating `:` and `_` as the same character.
pub fn names_equal(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b.iter()).all(|(&x, &y)| {
            let nx = if x == b':' { b'_' } else { x };
            let ny = if y == b':' { b'_' } else { y };
            nx == ny
        })
}

/// One signal's value per engine (see the module notes): repeats of an engine's series from its
/// shards count once, at their largest value.
/// A map, not a list: a body with very many series (hostile, or a pod with many models) costs
/// n log n, never n².
#[derive(Default)]
struct PerEngine {
    values: BTreeMap<u64, f64>,
}

impl PerEngine {
    fn add(&mut self, engine: u64, v: f64) {
        self.values.entry(engine).and_modify(|seen| *seen = seen.max(v)).or_insert(v);
    }

    fn sum(&self) -> Option<f64> {
        if self.values.is_empty() {
            None
        } else {
            Some(self.values.values().sum())
        }
    }

    /// The mean over engines, clamped to 0..1 (a KV-cache usage).
    fn mean_fraction(&self) -> Option<f64> {
        let n = self.values.len();
        self.sum().map(|total| (total / n as f64).clamp(0.0, 1.0))
    }
}

/// Names the engine a series belongs to: a hash of its label pairs other than shard ranks,
/// independent of the labels' order.
fn engine_of(labels: &[u8]) -> u64 {
    label_pairs(labels)
        .filter(|(name, _)| !is_shard_rank(name))
        .map(|(name, value)| {
            // FNV-1a over `name=value`; pairs are combined by a wrapping sum so order is irrelevant.
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for &b in name.iter().chain(b"=").chain(value) {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
            h
        })
        .fold(0u64, u64::wrapping_add)
}

/// `tp_rank`, `pp_rank` and the like name a shard of one engine; `dp_rank` names an engine.
fn is_shard_rank(label: &[u8]) -> bool {
    label.ends_with(b"_rank") && label != b"dp_rank"
}

/// Parses a `/metrics` body. `target_metric`, when given, is summed into [`PodMetrics::target`].
pub fn parse(text: &[u8], target_metric: Option<&str>) -> PodMetrics {
    let target = target_metric.filter(|t| !t.is_empty()).map(str::as_bytes);
    let mut out = PodMetrics::default();
    let (mut running, mut waiting) = (PerEngine::default(), PerEngine::default());
    let (mut kv1, mut kv0, mut kvs) =
        (PerEngine::default(), PerEngine::default(), PerEngine::default());
    let (mut queries, mut hits, mut target_values) =
        (PerEngine::default(), PerEngine::default(), PerEngine::default());

    for raw_line in lines(text) {
        let line = trim_start(raw_line);
        if line.is_empty() || line.first() == Some(&b'#') {
            continue;
        }
        let Some((name, rest)) = split_name(line) else { continue };
        let family =
            FAMILIES.iter().find(|(n, _)| names_equal(n.as_bytes(), name)).map(|(_, f)| *f);
        let is_target = target.is_some_and(|t| names_equal(t, name));
        if family.is_none() && !is_target {
            continue;
        }
        let (labels, after) = match split_labels(rest) {
            Some(x) => x,
            None => continue,
        };
        let value = match parse_value(after) {
            Some(v) => v,
            None => continue,
        };
        let engine = engine_of(labels);
        if is_target {
            target_values.add(engine, value);
        }
        match family {
            Some(Family::Running) => running.add(engine, value),
            Some(Family::Waiting) => waiting.add(engine, value),
            Some(Family::KvV1) => kv1.add(engine, value),
            Some(Family::KvV0) => kv0.add(engine, value),
            Some(Family::KvSglang) => kvs.add(engine, value),
            Some(Family::PrefixQueries) => queries.add(engine, value),
            Some(Family::PrefixHits) => hits.add(engine, value),
            Some(Family::Lora) => {
                let newer = out.lora.as_ref().is_none_or(|l| value > l.timestamp);
                if newer {
                    out.lora = Some(lora_from_labels(labels, value));
                }
            }
            None => {}
        }
    }
    out.running = running.sum();
    out.waiting = waiting.sum();
    out.prefix_cache_queries = queries.sum();
    out.prefix_cache_hits = hits.sum();
    out.kv_cache_usage =
        kv1.mean_fraction().or_else(|| kv0.mean_fraction()).or_else(|| kvs.mean_fraction());
    out.target = match target {
        Some(t) if KV_NAMES.iter().any(|k| names_equal(k.as_bytes(), t)) => out.kv_cache_usage,
        Some(_) => target_values.sum(),
        None => None,
    };
    out
}

/// The lines of `text` (without their `\n`). `memchr` finds the ends a word at a time: a body is
/// tens of KB and is read whenever the health check stored a new one.
fn lines(text: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = Some(text);
    std::iter::from_fn(move || {
        let text = rest?;
        match memchr::memchr(b'\n', text) {
            Some(end) => {
                rest = text.get(end + 1..);
                text.get(..end)
            }
            None => {
                rest = None;
                Some(text)
            }
        }
    })
}

/// Splits a sample line into its name and the rest (labels, value).
fn split_name(line: &[u8]) -> Option<(&[u8], &[u8])> {
    let end = memchr::memchr3(b'{', b' ', b'\t', line).unwrap_or(line.len());
    line.split_at_checked(end)
}

fn trim_start(s: &[u8]) -> &[u8] {
    let start = s.iter().position(|&b| b != b' ' && b != b'\t').unwrap_or(s.len());
    let s = s.get(start..).unwrap_or_default();
    // Also drop a trailing '\r' (CRLF bodies).
    s.strip_suffix(b"\r").unwrap_or(s)
}

/// Splits `{labels} rest` into (label text without braces, rest). Without `{`, labels are empty.
/// Quotes and backslash escapes inside label values are honoured, so `}` in a value is fine.
fn split_labels(s: &[u8]) -> Option<(&[u8], &[u8])> {
    if s.first() != Some(&b'{') {
        return Some((&[], s));
    }
    let mut in_quotes = false;
    let mut escaped = false;
    for (i, &b) in s.iter().enumerate().skip(1) {
        if escaped {
            escaped = false;
        } else if in_quotes {
            match b {
                b'\\' => escaped = true,
                b'"' => in_quotes = false,
                _ => {}
            }
        } else if b == b'"' {
            in_quotes = true;
        } else if b == b'}' {
            return Some((s.get(1..i)?, s.get(i + 1..)?));
        }
    }
    None
}

/// Parses the sample value (first token after the labels); an optional timestamp follows and is
/// ignored. NaN and unparsable values give `None`.
fn parse_value(s: &[u8]) -> Option<f64> {
    let s = trim_start(s);
    let end = s.iter().position(|&b| b == b' ' || b == b'\t').unwrap_or(s.len());
    let tok = std::str::from_utf8(s.get(..end)?).ok()?;
    let v: f64 = tok.parse().ok()?;
    if v.is_nan() {
        None
    } else {
        Some(v)
    }
}

/// Iterates `name="value"` pairs of a label set; values are returned raw (escapes kept).
fn label_pairs(mut s: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    std::iter::from_fn(move || {
        // Skip separators.
        let start = s.iter().position(|&b| b != b',' && b != b' ' && b != b'\t')?;
        s = s.get(start..)?;
        let eq = s.iter().position(|&b| b == b'=')?;
        let name = trim_end(s.get(..eq)?);
        let after = trim_start(s.get(eq + 1..)?);
        if after.first() != Some(&b'"') {
            return None;
        }
        let mut escaped = false;
        let mut close = None;
        for (i, &b) in after.iter().enumerate().skip(1) {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                close = Some(i);
                break;
            }
        }
        let close = close?;
        let value = after.get(1..close)?;
        s = after.get(close + 1..).unwrap_or(&[]);
        Some((name, value))
    })
}

fn trim_end(s: &[u8]) -> &[u8] {
    let end = s.iter().rposition(|&b| b != b' ' && b != b'\t').map_or(0, |i| i + 1);
    s.get(..end).unwrap_or_default()
}

/// Undoes the exposition format's label escapes (`\\`, `\"`, `\n`).
fn unescape(raw: &[u8]) -> String {
    let mut out = Vec::with_capacity(raw.len());
    let mut it = raw.iter();
    while let Some(&b) = it.next() {
        if b == b'\\' {
            match it.next() {
                Some(b'n') => out.push(b'\n'),
                Some(&o) => out.push(o),
                None => {}
            }
        } else {
            out.push(b);
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn split_adapters(raw: &[u8]) -> Vec<String> {
    let text = unescape(raw);
    text.split(',').map(str::trim).filter(|a| !a.is_empty()).map(String::from).collect()
}

fn lora_from_labels(labels: &[u8], timestamp: f64) -> LoraInfo {
    let mut info = LoraInfo { timestamp, ..LoraInfo::default() };
    for (name, value) in label_pairs(labels) {
        match name {
            b"max_lora" => {
                info.max_lora = std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| v.trim().parse::<f64>().ok())
                    .filter(|v| v.is_finite() && *v >= 0.0)
                    .map_or(0, |v| v.min(f64::from(u32::MAX)) as u32);
            }
            b"running_lora_adapters" => info.running = split_adapters(value),
            b"waiting_lora_adapters" => info.waiting = split_adapters(value),
            _ => {}
        }
    }
    info
}

#[cfg(test)]
#[path = "prometheus_tests.rs"]
mod tests;
