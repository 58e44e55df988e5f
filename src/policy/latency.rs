//! `prefix_cache` with `loadAware`: how fast each pod answers, as this worker sees it. A pod's
//! queue and KV-cache use say nothing about its speed: a pod on an older GPU, throttled or with
//! a noisy neighbour runs every step slower with an empty queue and little KV in use. The gateway
//! sees that speed directly: the time between the response's first body byte and its end, per
//! response byte (the engine's decode rate under its current batch, what a client waits per
//! token). Prefix hits do not change it (unlike the time to first byte, which a hit shortens), so
//! a pod that only gets hits is not mistaken for a fast one.
//!
//! Per pod an exponentially weighted moving average of that time per byte (Finagle's and
//! linkerd's EWMA load balancers track latency the same way); a pod's *slowness* is its average
//! over the fastest pod's, `1.0` for the fastest or a pod without an average.
//!
//! Beside it, a *steady* slowness from each response's median time per byte between two chunks.
//! A pod that prefills a long uncached prompt stalls every stream it decodes for that step (one
//! long gap among short ones): its mean time per byte rises, which counts (the pod is busy), but its
//! median gap does not. A pod on a slower GPU is slower at every step, so both rise. Diverting a hit
//! for slowness (`overloadLatency`) pays a recompute of its prefix on another pod, so it uses the
//! steady measure: otherwise a diverted hit's own long prefill stalls the pod it went to, which then
//! reads as slow and has its hits diverted in turn (`hot-spot-ts1`: p90 95 against 32 in 2 of 3
//! runs, each diverted request a miss of a 4000-token system prompt).
//!
//! An average is not dropped because it is old: avoiding a slow pod is what stops its samples, and
//! a router that forgot it after a quiet spell would send it sessions again, each found slow anew
//! (cache misses when their sessions move off it again). Past [`FRESH_NS`] without a sample, a
//! pod's excess slowness instead halves every [`SLOWNESS_HALF_LIFE_NS`], so a pod that may have
//! recovered gets new sessions back gradually, and its next sample replaces the old average.

use rustc_hash::FxHashMap;
use std::collections::HashMap;

/// Weight of a new sample in a pod's average: about the last 5 responses count.
const EWMA_ALPHA: f64 = 0.3;
/// A response shorter than this after its first body chunk says little about the decode rate.
const MIN_SAMPLE_BYTES: u64 = 512;
/// Nor does one with fewer chunk gaps: the median of a few gaps is whichever gap it lands on,
/// and a short answer from a pod taking new prompts can be all prefill stalls (`cache-pressure`
/// at time scale 1: a 5-token answer in the first second gave one pod a steady slowness of 11,
/// its hits diverted for the rest of the run). Real engines send about one event per token, so
/// this is a 16-token answer.
const MIN_SAMPLE_GAPS: u32 = 16;
/// At most this many chunk gaps are kept per response for its median: when full, every other one
/// is dropped and only every second gap after is kept (so they spread over the whole response).
const MAX_GAPS: usize = 32;
/// An average updated within this long is current: a new sample blends into it, and its
/// slowness counts in full. Older, a new sample replaces it, and its slowness decays.
const FRESH_NS: u64 = 30_000_000_000;
/// Past [`FRESH_NS`], a pod's slowness above the fastest pod's halves this often. Short enough
/// that a pod whose last samples were slow only because it was busy then is not held off for
/// long (its penalty is a quarter after 2.5 minutes), long enough that a slow pod is tried again
/// only every few minutes.
const SLOWNESS_HALF_LIFE_NS: u64 = 60_000_000_000;
/// An average not updated for this long is dropped: its excess slowness has halved twelve times.
const FORGET_NS: u64 = FRESH_NS + 12 * SLOWNESS_HALF_LIFE_NS;
/// At most this many streams and pods are tracked per worker (bounded memory).
const MAX_TRACKED: usize = 4096;
/// A stream timed for longer than this without its end seen (reset, cut) is dropped when the
/// table is full.
const STREAM_FORGET_NS: u64 = 600_000_000_000;

/// A pod's average decode time per response byte, as [`PodSpeed::averages`] reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeAverage {
    /// `ip:port`.
    pub pod: String,
    /// Nanoseconds per response byte after the first chunk.
    pub ns_per_byte: f64,
    /// The same from each response's median gap between chunks (see the module docs).
    pub steady_ns_per_byte: f64,
    /// Time since its last sample.
    pub age_ns: u64,
}

/// One response being timed.
struct Timing {
    pod: String,
    /// When its response headers came (ns).
    headers_ns: u64,
    /// When its first body chunk came (ns).
    first_ns: Option<u64>,
    /// Body bytes after the first chunk.
    bytes: u64,
    /// When the last non-empty chunk came (ns).
    last_ns: u64,
    /// Sampled gaps before a chunk, per byte of that chunk (ns), at most [`MAX_GAPS`].
    gaps: Vec<f32>,
    /// Every `stride`-th gap is sampled; `seen` counts them all.
    stride: u32,
    seen: u32,
}

impl Timing {
    fn gap(&mut self, now_ns: u64, size: usize) {
        let per_byte = now_ns.saturating_sub(self.last_ns) as f64 / size as f64;
        self.last_ns = now_ns;
        if self.seen.is_multiple_of(self.stride) {
            if self.gaps.len() >= MAX_GAPS {
                let mut i = 0;
                self.gaps.retain(|_| {
                    i += 1;
                    i % 2 == 1
                });
                self.stride = self.stride.saturating_mul(2);
            }
            if self.seen.is_multiple_of(self.stride) {
                self.gaps.push(per_byte as f32);
            }
        }
        self.seen = self.seen.wrapping_add(1);
    }

    /// The median sampled gap per byte, if any.
    fn median_gap(&mut self) -> Option<f64> {
        self.gaps.sort_by(f32::total_cmp);
        self.gaps.get(self.gaps.len() / 2).map(|g| f64::from(*g))
    }
}

/// One pod's averages.
struct PodAverage {
    /// Mean ns per byte, EWMA.
    mean: f64,
    /// Median-gap ns per byte, EWMA.
    steady: f64,
    /// When last updated (ns).
    at: u64,
}

/// A pod's slowness against the fastest pod by each measure (see the module docs), `>= 1`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slowness {
    /// By the mean time per byte: the combined load's penalty.
    pub overall: f64,
    /// By the median gap: whether a hit is diverted (`overloadLatency`).
    pub steady: f64,
}

impl Slowness {
    /// The fastest pod, or one without an average.
    pub const NONE: Slowness = Slowness { overall: 1.0, steady: 1.0 };
}

/// See the module docs.
#[derive(Default)]
pub struct PodSpeed {
    /// Per pod: its averages.
    per_pod: HashMap<String, PodAverage>,
    /// Streams whose response is being timed, by stream id.
    streams: FxHashMap<u32, Timing>,
}

impl PodSpeed {
    /// The response of `stream` comes from `pod` (`upstream.address` at its headers), at
    /// `now_ns`.
    pub fn on_response_headers(&mut self, stream: u32, pod: String, now_ns: u64) {
        if self.streams.len() >= MAX_TRACKED {
            // Streams whose end was never seen (reset): dropped, never grown without bound.
            self.streams.retain(|_, t| now_ns.saturating_sub(t.headers_ns) < STREAM_FORGET_NS);
            if self.streams.len() >= MAX_TRACKED {
                self.streams.clear();
            }
        }
        self.streams.insert(
            stream,
            Timing {
                pod,
                headers_ns: now_ns,
                first_ns: None,
                bytes: 0,
                last_ns: now_ns,
                gaps: Vec::new(),
                stride: 1,
                seen: 0,
            },
        );
    }

    /// A response body chunk of `size` bytes at `now_ns`; at the end of the stream a long enough
    /// response updates its pod's average.
    pub fn on_response_body(&mut self, stream: u32, now_ns: u64, size: usize, end: bool) {
        let Some(t) = self.streams.get_mut(&stream) else { return };
        match t.first_ns {
            None if size > 0 => {
                t.first_ns = Some(now_ns);
                t.last_ns = now_ns;
            }
            None => {}
            Some(_) if size > 0 => {
                t.bytes = t.bytes.saturating_add(size as u64);
                t.gap(now_ns, size);
            }
            Some(_) => {}
        }
        if !end {
            return;
        }
        let Some(mut t) = self.streams.remove(&stream) else { return };
        let Some(first) = t.first_ns else { return };
        let span = now_ns.saturating_sub(first);
        let steady = t.median_gap();
        let long_enough = t.bytes >= MIN_SAMPLE_BYTES && t.seen >= MIN_SAMPLE_GAPS;
        let Some(steady) = steady.filter(|g| *g > 0.0 && long_enough && span > 0) else {
            // A one-chunk (non-streamed) or short response, or one whose chunks mostly came at
            // once (read in a burst): no decode rate in it.
            return;
        };
        self.sample(t.pod, span as f64 / t.bytes as f64, steady, now_ns);
    }

    fn sample(&mut self, pod: String, ns_per_byte: f64, steady: f64, now_ns: u64) {
        if !self.per_pod.contains_key(&pod) && self.per_pod.len() >= MAX_TRACKED {
            self.per_pod.retain(|_, a| now_ns.saturating_sub(a.at) < FORGET_NS);
            if self.per_pod.len() >= MAX_TRACKED {
                return;
            }
        }
        let e =
            self.per_pod.entry(pod).or_insert(PodAverage { mean: ns_per_byte, steady, at: now_ns });
        if now_ns.saturating_sub(e.at) < FRESH_NS {
            e.mean += EWMA_ALPHA * (ns_per_byte - e.mean);
            e.steady += EWMA_ALPHA * (steady - e.steady);
        } else {
            e.mean = ns_per_byte;
            e.steady = steady;
        }
        e.at = now_ns;
    }

    /// Each of `pods`' slowness at `now_ns`: its average over the fastest of them (`>= 1`,
    /// decayed towards 1 when old; the fastest current one when any is current); `1.0` for a pod
    /// without an average. Empty when fewer than two
    /// pods have one (there is nothing to compare). The plugin compares [`PodSpeed::averages`] in
    /// the picker, over the healthy pods it already read; this is the same for the estimate's
    /// tests.
    #[cfg(test)]
    pub fn slowness(&self, pods: &[&str], now_ns: u64) -> Vec<(String, Slowness)> {
        relative_slowness(&self.averages(now_ns), pods)
    }

    /// Each pod's average at `now_ns`: the pods with one, unordered.
    pub fn averages(&self, now_ns: u64) -> Vec<DecodeAverage> {
        self.per_pod
            .iter()
            .map(|(p, a)| DecodeAverage {
                pod: p.clone(),
                ns_per_byte: a.mean,
                steady_ns_per_byte: a.steady,
                age_ns: now_ns.saturating_sub(a.at),
            })
            .filter(|a| {
                a.age_ns < FORGET_NS
                    && [a.ns_per_byte, a.steady_ns_per_byte]
                        .iter()
                        .all(|v| v.is_finite() && *v > 0.0)
            })
            .collect()
    }
}

/// `pods`' slowness from [`PodSpeed::averages`]: see [`PodSpeed::slowness`].
pub fn relative_slowness(averages: &[DecodeAverage], pods: &[&str]) -> Vec<(String, Slowness)> {
    let by_pod = super::first_by_key(averages.iter().map(|a| (a.pod.as_str(), a)));
    // Each pod's average, looked up once.
    let found: Vec<Option<&DecodeAverage>> = pods.iter().map(|p| by_pod.get(p).copied()).collect();
    if found.iter().flatten().count() < 2 {
        return Vec::new();
    }
    // The reference is the fastest current average when there is one: a decode rate depends on
    // the batch, so an old sample from a quieter time is not compared against today's load.
    let fastest_by = |measure: fn(&DecodeAverage) -> f64| {
        let fastest_of = |current_only: bool| {
            found
                .iter()
                .flatten()
                .filter(|a| !current_only || a.age_ns < FRESH_NS)
                .map(|a| measure(a))
                .fold(f64::INFINITY, f64::min)
        };
        Some(fastest_of(true)).filter(|f| f.is_finite()).unwrap_or(fastest_of(false))
    };
    let fastest = fastest_by(|a| a.ns_per_byte);
    let fastest_steady = fastest_by(|a| a.steady_ns_per_byte);
    pods.iter()
        .zip(found)
        .map(|(p, a)| {
            let slowness = a.map_or(Slowness::NONE, |a| {
                let beyond = a.age_ns.saturating_sub(FRESH_NS) as f64;
                let decay = 0.5f64.powf(beyond / SLOWNESS_HALF_LIFE_NS as f64);
                // An old average faster than the reference reads as 1, as the fastest does.
                let against = |v: f64, fastest: f64| (1.0 + (v / fastest - 1.0) * decay).max(1.0);
                Slowness {
                    overall: against(a.ns_per_byte, fastest),
                    steady: against(a.steady_ns_per_byte, fastest_steady),
                }
            });
            (p.to_string(), slowness)
        })
        .collect()
}

#[cfg(test)]
#[path = "latency_tests.rs"]
mod tests;
