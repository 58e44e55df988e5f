//! Per-request latency and size histograms, as the engines export them on `/metrics`.
//!
//! Why a simulator keeps them: a real vLLM's `/metrics` is 30-60 KB, almost all of it these
//! histograms (every bucket of a dozen families, per engine), and the gateway's health check stores
//! that whole body per pod and hands it to the plugin with every host list (Higress caps it at
//! 64 KiB). Pods serving only their gauges (about 1.5 KB) made the scenarios cheaper for the
//! gateway and the plugin than production is. The values are observed on the simulated clock, so
//! the histograms say what the pod did, as a real engine's do.

use std::fmt::Write as _;

/// A Prometheus histogram: cumulative bucket counts over fixed upper bounds, plus sum and count.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations at most each bound (not yet cumulative).
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram over `bounds` (ascending; `+Inf` is implied).
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    /// Records one value.
    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Appends the family in the text exposition format, as `prometheus_client` writes it:
    /// HELP, TYPE, one `_bucket` line per bound and `+Inf`, `_count`, `_sum`, `_created`.
    /// `labels` are the series' own labels (`le` goes after them).
    pub fn write(&self, o: &mut String, name: &str, help: &str, labels: &str, created: f64) {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, n) in self.bounds.iter().zip(&self.counts) {
            cumulative += n;
            let _ =
                writeln!(o, "{name}_bucket{{{labels},le=\"{bound:?}\"}} {:.1}", cumulative as f64);
        }
        let _ = writeln!(o, "{name}_bucket{{{labels},le=\"+Inf\"}} {:.1}", self.count as f64);
        let _ = writeln!(o, "{name}_count{{{labels}}} {:.1}", self.count as f64);
        let _ = writeln!(o, "{name}_sum{{{labels}}} {:?}", self.sum);
        let _ = writeln!(o, "{name}_created{{{labels}}} {created:.9e}");
    }
}

/// vLLM V1's time-to-first-token buckets (`vllm/v1/metrics/loggers.py`), seconds.
const VLLM_TTFT: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's inter-token (and time-per-output-token) buckets, seconds.
const VLLM_ITL: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's request-phase buckets (e2e, queue, inference, prefill, decode), seconds.
const VLLM_REQUEST: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// vLLM's token-count buckets: 1-2-5 steps up to the model length (32768 here).
const VLLM_TOKENS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
];
/// vLLM's tokens-per-step buckets (its CUDA graph sizes and beyond).
const VLLM_STEP_TOKENS: &[f64] =
    &[1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0];
/// vLLM's `n` parameter buckets.
const VLLM_N: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0];
/// SGLang's time-to-first-token buckets (`sglang/srt/metrics/collector.py`), seconds.
const SGLANG_TTFT: &[f64] = &[
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0,
];
/// SGLang's inter-token buckets, seconds.
const SGLANG_ITL: &[f64] = &[
    0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2,
    0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0,
];
/// SGLang's end-to-end buckets, seconds.
const SGLANG_E2E: &[f64] = &[
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0, 800.0,
];

/// Which engine's bucket bounds a pod's histograms use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buckets {
    /// vLLM (V0 and V1 share them).
    Vllm,
    /// SGLang.
    Sglang,
}

/// The per-request histograms of one pod, in simulated seconds and tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestStats {
    /// Arrival to first token.
    pub ttft: Histogram,
    /// Between consecutive tokens of a request.
    pub inter_token: Histogram,
    /// Arrival to last token.
    pub e2e: Histogram,
    /// Arrival to admission.
    pub queue: Histogram,
    /// Admission to last token.
    pub inference: Histogram,
    /// Admission to first token.
    pub prefill: Histogram,
    /// First token to last.
    pub decode: Histogram,
    /// Prompt tokens of finished requests.
    pub prompt_tokens: Histogram,
    /// Generated tokens of finished requests.
    pub generation_tokens: Histogram,
    /// `max_tokens` of finished requests.
    pub max_tokens: Histogram,
    /// `n` of finished requests (always 1 here).
    pub n: Histogram,
    /// Tokens computed per engine step (prefill and decode).
    pub step_tokens: Histogram,
    /// Finished with `stop` (EOS).
    pub finished_stop: u64,
    /// Finished with `length` (`max_tokens`).
    pub finished_length: u64,
    /// Ended before finishing (the client went away).
    pub aborted: u64,
}

impl RequestStats {
    /// Empty histograms with `buckets`' bounds.
    pub fn new(buckets: Buckets) -> RequestStats {
        let (ttft, itl, e2e) = match buckets {
            Buckets::Vllm => (VLLM_TTFT, VLLM_ITL, VLLM_REQUEST),
            Buckets::Sglang => (SGLANG_TTFT, SGLANG_ITL, SGLANG_E2E),
        };
        RequestStats {
            ttft: Histogram::new(ttft),
            inter_token: Histogram::new(itl),
            e2e: Histogram::new(e2e),
            queue: Histogram::new(VLLM_REQUEST),
            inference: Histogram::new(VLLM_REQUEST),
            prefill: Histogram::new(VLLM_REQUEST),
            decode: Histogram::new(VLLM_REQUEST),
            prompt_tokens: Histogram::new(VLLM_TOKENS),
            generation_tokens: Histogram::new(VLLM_TOKENS),
            max_tokens: Histogram::new(VLLM_TOKENS),
            n: Histogram::new(VLLM_N),
            step_tokens: Histogram::new(VLLM_STEP_TOKENS),
            finished_stop: 0,
            finished_length: 0,
            aborted: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_inf_counts_everything() {
        let mut h = Histogram::new(&[0.5, 1.0]);
        for v in [0.25, 0.5, 0.75, 3.0] {
            h.observe(v);
        }
        let mut o = String::new();
        h.write(&mut o, "x_seconds", "X.", "model_name=\"m\"", 1.0);
        assert!(o.contains("x_seconds_bucket{model_name=\"m\",le=\"0.5\"} 2.0\n"), "{o}");
        assert!(o.contains("x_seconds_bucket{model_name=\"m\",le=\"1.0\"} 3.0\n"), "{o}");
        assert!(o.contains("x_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 4.0\n"), "{o}");
        assert!(o.contains("x_seconds_count{model_name=\"m\"} 4.0\n"), "{o}");
        assert!(o.contains("x_seconds_sum{model_name=\"m\"} 4.5\n"), "{o}");
    }
}
