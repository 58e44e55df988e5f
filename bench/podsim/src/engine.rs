//! Step-based continuous-batching scheduler and latency model of one pod (no real time here:
//! the server drives it and sleeps for each step's simulated duration).
//!
//! Per step: admit waiting requests (running-slot and KV-memory limits, FIFO), give prefill a
//! token budget (chunked prefill, oldest first), let every fully prefilled sequence decode one
//! token, and cost the step as
//! `base + per_prefill_token * prefill_tokens + per_decode_seq * decode_seqs + per_ctx_token * sum_ctx`
//! with the coefficients of a [`Profile`].
//!
//! Caching follows vLLM V1 and SGLang (`cache_unfinished_req`): the prompt's whole pages enter the
//! prefix tree at the end of the step that computed them, so a request admitted in a later step
//! reuses them even while the first request is still running; the reply's pages enter when the
//! request finishes.
//!
//! Reply length: the model stops at EOS. With `eos_mean_tokens > 0` each request draws, from its
//! seed, a geometric length (a constant per-token EOS probability `1/eos_mean_tokens`, mean
//! `eos_mean_tokens`) and stops there (`finish_reason: "stop"`) unless `max_tokens` comes first
//! (`"length"`); a request with `ignore_eos` (vLLM's sampling parameter) always runs to
//! `max_tokens`. The load generator only sets `max_tokens`: the pod is the one place that decides
//! how long a reply is.
//!
//! No preemption: admission reserves KV for the whole prompt and `max_tokens`, so a running request
//! never runs out of pages and nothing needs to be preempted (SGLang's conservative reservation with
//! `new_token_ratio` 1). The cost is that under memory pressure requests wait in the queue where
//! vLLM would admit them and preempt later; only `cache-pressure` gets near that regime.

use crate::radix::{NodeId, RadixCache};
use crate::stats::{Buckets, RequestStats};
use crate::tokenizer::{fnv1a32, word, Rng};
use std::collections::VecDeque;

/// Step-time coefficients, in simulated milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyModel {
    /// Fixed cost of every step (weights read + launch/scheduler overhead).
    pub base_ms: f64,
    /// Cost of each uncached prompt token computed in the step.
    pub prefill_ms_per_token: f64,
    /// Cost of each decoding sequence in the step.
    pub decode_ms_per_seq: f64,
    /// Cost of each context token attended to (KV read) in the step.
    pub ctx_ms_per_token: f64,
}

impl Default for LatencyModel {
    fn default() -> Self {
        H100_8B.model
    }
}

impl LatencyModel {
    /// The same model for a pod `speed` times as fast (0.5 = every step takes twice as long).
    pub fn at_speed(self, speed: f64) -> LatencyModel {
        let f = if speed > 0.0 { 1.0 / speed } else { 1.0 };
        LatencyModel {
            base_ms: self.base_ms * f,
            prefill_ms_per_token: self.prefill_ms_per_token * f,
            decode_ms_per_seq: self.decode_ms_per_seq * f,
            ctx_ms_per_token: self.ctx_ms_per_token * f,
        }
    }

    /// Duration of one step in simulated ms.
    pub fn step_ms(&self, prefill_tokens: usize, decode_seqs: usize, sum_ctx_tokens: usize) -> f64 {
        self.base_ms
            + self.prefill_ms_per_token * prefill_tokens as f64
            + self.decode_ms_per_seq * decode_seqs as f64
            + self.ctx_ms_per_token * sum_ctx_tokens as f64
    }
}

/// A named hardware profile: step costs and the API overhead before scheduling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Profile {
    /// Name used in scenario files and on podsim's command line.
    pub name: &'static str,
    /// Step costs.
    pub model: LatencyModel,
    /// API/tokenizer overhead before a request is scheduled (simulated ms).
    pub api_overhead_ms: f64,
}

/// Llama-3.1-8B, BF16, one H100 SXM, vLLM. Step, prefill and decode terms are BLIS's fitted
/// coefficients for llama-3.1-8b-instruct on H100 TP1 with vLLM 0.8.4 (inference-sim/inference-sim
/// `defaults.yaml`: 5753 µs per step, 17.25 µs per uncached prefill token, 6.0 µs per decode
/// token); the context term is the KV read (128 KiB per token at ~2.7 TB/s effective). Checks:
/// 5.8 ms ITL at batch 7, within LambdaLabs' measured 7.6 ms median TPOT at 10 concurrent ShareGPT
/// prompts (Llama-3-8B, 1×H100 SXM) once the KV read of longer contexts is added.
pub const H100_8B: Profile = Profile {
    name: "h100-8b",
    model: LatencyModel {
        base_ms: 5.753,
        prefill_ms_per_token: 0.01725,
        decode_ms_per_seq: 0.006,
        ctx_ms_per_token: 0.000049,
    },
    api_overhead_ms: 10.0,
};

/// The testbed of the published Higress test (GPU and model not named there), fitted so that the
/// `seed` scenario's round_robin row reproduces the published figures: TTFT 240 ms, 367 output
/// tok/s, hit rate about 40%, mean request time 14.9 s. Fitted with the model-only run
/// (`bench model seed`) over a grid of step base, prefill cost and EOS mean: 40 ms per step,
/// 0.2 ms per prefill token and replies stopping at EOS with mean 330 (seed.yaml) give 233 ms,
/// 362 tok/s, 44% and 14.2 s. Steps cost about 7x [`H100_8B`]'s, so something like an older or
/// shared GPU, or a larger model; the fit is not unique.
pub const PUBLISHED_TESTBED: Profile = Profile {
    name: "published-testbed",
    model: LatencyModel {
        base_ms: 40.0,
        prefill_ms_per_token: 0.2,
        decode_ms_per_seq: 0.3,
        ctx_ms_per_token: 0.00035,
    },
    api_overhead_ms: 10.0,
};

/// Every profile, for lookups by name.
pub const PROFILES: [Profile; 2] = [H100_8B, PUBLISHED_TESTBED];

impl Profile {
    /// The profile called `name`.
    pub fn named(name: &str) -> Option<Profile> {
        PROFILES.iter().copied().find(|p| p.name == name)
    }
}

impl std::fmt::Display for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

impl std::str::FromStr for Profile {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Profile::named(s).ok_or_else(|| {
            let names: Vec<&str> = PROFILES.iter().map(|p| p.name).collect();
            format!("unknown hardware profile {s:?} ({})", names.join(", "))
        })
    }
}

/// Scheduler limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineConfig {
    /// KV block size in tokens.
    pub page: usize,
    /// KV capacity in tokens (cached tree + running requests' private tokens).
    pub capacity_tokens: usize,
    /// Max running sequences (vLLM max_num_seqs).
    pub max_running: usize,
    /// Prefill tokens per step (vLLM max_num_batched_tokens, chunked prefill).
    pub prefill_budget: usize,
    /// Step costs.
    pub model: LatencyModel,
    /// Mean reply length when the model stops at EOS (0 = never: every reply is `max_tokens`).
    pub eos_mean_tokens: f64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            page: 16,
            capacity_tokens: 400_000,
            max_running: 128,
            prefill_budget: 8192,
            model: LatencyModel::default(),
            eos_mean_tokens: 0.0,
        }
    }
}

/// Length at which a reply drawn with `seed` hits EOS: geometric on 1, 2, ... with mean `mean`
/// (the model stops after each token with probability `1/mean`). `None` when `mean` is 0.
pub fn eos_length(seed: u64, mean: f64) -> Option<usize> {
    if mean <= 0.0 {
        return None;
    }
    if mean <= 1.0 {
        return Some(1);
    }
    // A stream of its own, so the reply's words do not depend on whether EOS is modelled.
    let u = 1.0 - Rng::new(seed ^ 0x0e05_0e05_0e05_0e05).next_f64(); // (0, 1]
    let k = (u.ln() / (1.0 - 1.0 / mean).ln()).floor();
    Some(1 + k.min(1e9) as usize)
}

/// Why generation ended (OpenAI `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The model emitted EOS: `"stop"`.
    Stop,
    /// `max_tokens` reached: `"length"`.
    Length,
}

impl Finish {
    /// The OpenAI `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What happens to a request, reported after the step in which it happened.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// One generated token (its text: a word, with a leading space except for the first).
    Token(String),
    /// Generation finished.
    Done(Usage, Finish),
}

/// A request to schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Id (unique per pod).
    pub id: u64,
    /// Prompt tokens.
    pub prompt: Vec<u32>,
    /// `max_tokens` of the request.
    pub max_tokens: usize,
    /// Seed of the generated text and of its EOS length.
    pub seed: u64,
    /// LoRA adapter, if the request names one.
    pub adapter: Option<String>,
    /// Generate exactly `max_tokens` (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
}

/// Token accounting of a finished request (OpenAI `usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
}

#[derive(Debug)]
struct Running {
    id: u64,
    prompt: Vec<u32>,
    max_tokens: usize,
    /// Length at which this reply stops (EOS), when shorter than `max_tokens`.
    stop_at: Option<usize>,
    rng: Rng,
    adapter: Option<String>,
    cached: usize,
    lock: NodeId,
    reserved: usize,
    prefilled: usize,
    generated: Vec<u32>,
    /// Emits a token at the end of the current step.
    emits: bool,
    /// Computed prompt tokens in the current step (their pages are cached at its end).
    prefills: bool,
    /// Simulated clock (ms) when the request arrived, was admitted, got its first and its latest
    /// token.
    arrived_ms: f64,
    admitted_ms: f64,
    first_token_ms: f64,
    last_token_ms: f64,
}

/// A request waiting for admission.
#[derive(Debug)]
struct Queued {
    req: Request,
    /// Simulated clock (ms) at arrival.
    arrived_ms: f64,
}

/// Cumulative counters (for /metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Requests admitted.
    pub requests: u64,
    /// Requests finished.
    pub finished: u64,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: u64,
    /// Of those, served from cache.
    pub cached_tokens: u64,
    /// Generated tokens.
    pub generation_tokens: u64,
    /// Highest running + waiting seen.
    pub peak_inflight: u64,
    /// Σ over steps of (running + waiting) × step duration, simulated µs: the time-weighted
    /// in-flight count (divide by the run's duration for the mean).
    pub inflight_us: u64,
    /// Simulated µs spent in steps.
    pub busy_us: u64,
}

/// One pod's scheduler state.
#[derive(Debug)]
pub struct Scheduler {
    cfg: EngineConfig,
    cache: RadixCache,
    waiting: VecDeque<Queued>,
    running: Vec<Running>,
    private_tokens: usize,
    counters: Counters,
    in_step: bool,
    /// Simulated time (ms): the sum of the steps' durations, so it stands still while idle.
    clock_ms: f64,
    /// Duration of the step planned by `begin_step`.
    step_ms: f64,
    stats: RequestStats,
}

impl Scheduler {
    /// A scheduler with an empty cache (histograms on vLLM's buckets).
    pub fn new(cfg: EngineConfig) -> Self {
        Self::with_buckets(cfg, Buckets::Vllm)
    }

    /// A scheduler with an empty cache whose histograms use `buckets`' bounds.
    pub fn with_buckets(cfg: EngineConfig, buckets: Buckets) -> Self {
        Scheduler {
            cfg,
            cache: RadixCache::new(cfg.page),
            waiting: VecDeque::new(),
            running: Vec::new(),
            private_tokens: 0,
            counters: Counters::default(),
            in_step: false,
            clock_ms: 0.0,
            step_ms: 0.0,
            stats: RequestStats::new(buckets),
        }
    }

    /// Queues a request. Its `seed` makes its generated text and length deterministic.
    pub fn submit(&mut self, mut req: Request) {
        req.max_tokens = req.max_tokens.max(1);
        self.waiting.push_back(Queued { req, arrived_ms: self.clock_ms });
        let inflight = (self.waiting.len() + self.running.len()) as u64;
        self.counters.peak_inflight = self.counters.peak_inflight.max(inflight);
    }

    /// Cancels a request (client went away); frees its pages.
    pub fn abort(&mut self, id: u64) {
        let queued = self.waiting.len();
        self.waiting.retain(|w| w.req.id != id);
        if self.waiting.len() < queued {
            self.stats.aborted += 1;
        }
        if let Some(i) = self.running.iter().position(|r| r.id == id) {
            self.stats.aborted += 1;
            let r = self.running.remove(i);
            self.cache.unlock(r.lock);
            self.private_tokens -= r.reserved;
        }
    }

    /// Nothing to do.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }
    /// Running sequences.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    /// Queued requests.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    /// Counters so far.
    pub fn counters(&self) -> Counters {
        self.counters
    }
    /// Histograms of the requests finished so far (time on the simulated clock).
    pub fn stats(&self) -> &RequestStats {
        &self.stats
    }
    /// KV tokens in use: locked tree pages plus running requests' own tokens (idle cached
    /// pages count as free, like vLLM's kv_cache_usage_perc and SGLang's token_usage).
    pub fn used_tokens(&self) -> usize {
        (self.cache.locked_tokens() + self.private_tokens).min(self.cfg.capacity_tokens)
    }
    /// Capacity in tokens.
    pub fn capacity_tokens(&self) -> usize {
        self.cfg.capacity_tokens
    }
    /// Tokens held by the prefix tree (idle + locked).
    pub fn cached_tree_tokens(&self) -> usize {
        self.cache.total_tokens()
    }
    /// Adapters of running and waiting requests (for vllm:lora_requests_info).
    pub fn adapters(&self) -> (Vec<String>, Vec<String>) {
        let mut run: Vec<String> = self.running.iter().filter_map(|r| r.adapter.clone()).collect();
        let mut wait: Vec<String> =
            self.waiting.iter().filter_map(|w| w.req.adapter.clone()).collect();
        run.sort();
        run.dedup();
        wait.sort();
        wait.dedup();
        (run, wait)
    }
    /// Empties the prefix cache (only the unreferenced part if requests are running).
    pub fn flush_cache(&mut self) {
        if self.running.is_empty() {
            self.cache.clear();
        } else {
            self.cache.evict(usize::MAX);
        }
    }

    fn admit(&mut self) {
        while self.running.len() < self.cfg.max_running {
            let Some(Queued { req: w, .. }) = self.waiting.front() else { break };
            let n = w.prompt.len();
            let (hit, node) = self.cache.match_prefix(&w.prompt);
            // Like vLLM V1, at least the last prompt token is computed (to get logits), and
            // hits are whole blocks: cap at n-1, then round down to a page.
            let page = self.cfg.page.max(1);
            let cached = hit.min(n.saturating_sub(1) / page * page);
            let need = n - cached + w.max_tokens;
            let over = (self.cache.total_tokens() + self.private_tokens + need)
                .saturating_sub(self.cfg.capacity_tokens);
            if over > 0 {
                // Pin the match while evicting so the request's own prefix survives, and count
                // it as in use when checking what is left.
                self.cache.lock(node);
                self.cache.evict(over);
                let still = self.cache.locked_tokens() + self.private_tokens + need
                    > self.cfg.capacity_tokens;
                self.cache.unlock(node);
                if still && !self.running.is_empty() {
                    break; // wait for running requests to free memory
                }
            }
            let Some(Queued { req: w, arrived_ms }) = self.waiting.pop_front() else { break };
            self.stats.queue.observe((self.clock_ms - arrived_ms) / 1000.0);
            self.cache.lock(node);
            self.private_tokens += need;
            self.counters.requests += 1;
            self.counters.prompt_tokens += n as u64;
            self.counters.cached_tokens += cached as u64;
            let stop_at = if w.ignore_eos {
                None
            } else {
                eos_length(w.seed, self.cfg.eos_mean_tokens).filter(|l| *l < w.max_tokens)
            };
            self.running.push(Running {
                id: w.id,
                prompt: w.prompt,
                max_tokens: w.max_tokens,
                stop_at,
                rng: Rng::new(w.seed),
                adapter: w.adapter,
                cached,
                lock: node,
                reserved: need,
                prefilled: cached,
                generated: Vec::new(),
                emits: false,
                prefills: false,
                arrived_ms,
                admitted_ms: self.clock_ms,
                first_token_ms: 0.0,
                last_token_ms: 0.0,
            });
        }
    }

    /// Plans the next step: admits, allocates prefill budget, returns the step's simulated
    /// duration in ms (None when idle). Call [`Scheduler::end_step`] after waiting that long.
    pub fn begin_step(&mut self) -> Option<f64> {
        self.admit();
        if self.running.is_empty() {
            return None;
        }
        let mut budget = self.cfg.prefill_budget;
        let (mut prefill, mut decode, mut ctx) = (0usize, 0usize, 0usize);
        for r in &mut self.running {
            let n = r.prompt.len();
            if r.prefilled < n {
                let take = (n - r.prefilled).min(budget);
                budget -= take;
                r.prefilled += take;
                prefill += take;
                r.prefills = take > 0;
                r.emits = r.prefilled == n;
            } else {
                decode += 1;
                r.prefills = false;
                r.emits = true;
            }
            ctx += r.prefilled + r.generated.len();
        }
        self.in_step = true;
        let ms = self.cfg.model.step_ms(prefill, decode, ctx);
        self.step_ms = ms;
        self.stats.step_tokens.observe((prefill + decode) as f64);
        let us = (ms * 1000.0).round() as u64;
        self.counters.busy_us += us;
        self.counters.inflight_us += us * (self.running.len() + self.waiting.len()) as u64;
        Some(ms)
    }

    /// Puts the whole pages of `r`'s computed prompt into the tree and moves its lock there; the
    /// tokens the tree did not hold yet stop counting as the request's private KV.
    fn cache_prefilled(cache: &mut RadixCache, private_tokens: &mut usize, r: &mut Running) {
        let done = &r.prompt[..r.prefilled];
        let aligned = done.len() / cache.page() * cache.page();
        if aligned == 0 {
            return;
        }
        let already = cache.insert(done);
        let added = (aligned - already).min(r.reserved);
        let (_, node) = cache.match_prefix(done);
        cache.lock(node);
        cache.unlock(r.lock);
        r.lock = node;
        r.reserved -= added;
        *private_tokens -= added;
    }

    /// Completes the planned step: caches the prompt pages computed in it, emits tokens,
    /// finishes requests (their prompt + output go into the prefix tree), and returns the events
    /// per request id.
    pub fn end_step(&mut self) -> Vec<(u64, Event)> {
        let mut events = Vec::new();
        if !self.in_step {
            return events;
        }
        self.in_step = false;
        self.clock_ms += self.step_ms;
        let now = self.clock_ms;
        for r in self.running.iter_mut().filter(|r| r.prefills) {
            r.prefills = false;
            Self::cache_prefilled(&mut self.cache, &mut self.private_tokens, r);
        }
        let mut i = 0;
        while i < self.running.len() {
            let r = &mut self.running[i];
            if !r.emits {
                i += 1;
                continue;
            }
            r.emits = false;
            let w = word(&mut r.rng);
            r.generated.push(fnv1a32(w.as_bytes()));
            let text = if r.generated.len() == 1 {
                r.first_token_ms = now;
                self.stats.ttft.observe((now - r.arrived_ms) / 1000.0);
                self.stats.prefill.observe((now - r.admitted_ms) / 1000.0);
                w
            } else {
                self.stats.inter_token.observe((now - r.last_token_ms) / 1000.0);
                format!(" {w}")
            };
            r.last_token_ms = now;
            events.push((r.id, Event::Token(text)));
            self.counters.generation_tokens += 1;
            let finish = if Some(r.generated.len()) == r.stop_at {
                Finish::Stop
            } else if r.generated.len() >= r.max_tokens {
                Finish::Length
            } else {
                i += 1;
                continue;
            };
            let r = self.running.swap_remove(i);
            let usage = Usage {
                prompt_tokens: r.prompt.len(),
                cached_tokens: r.cached,
                completion_tokens: r.generated.len(),
            };
            let mut all = r.prompt;
            all.extend_from_slice(&r.generated);
            self.cache.insert(&all);
            self.cache.unlock(r.lock);
            self.private_tokens -= r.reserved;
            let over = (self.cache.total_tokens() + self.private_tokens)
                .saturating_sub(self.cfg.capacity_tokens);
            self.cache.evict(over);
            self.counters.finished += 1;
            let st = &mut self.stats;
            st.e2e.observe((now - r.arrived_ms) / 1000.0);
            st.inference.observe((now - r.admitted_ms) / 1000.0);
            st.decode.observe((now - r.first_token_ms) / 1000.0);
            st.prompt_tokens.observe(usage.prompt_tokens as f64);
            st.generation_tokens.observe(usage.completion_tokens as f64);
            st.max_tokens.observe(r.max_tokens as f64);
            st.n.observe(1.0);
            match finish {
                Finish::Stop => st.finished_stop += 1,
                Finish::Length => st.finished_length += 1,
            }
            events.push((r.id, Event::Done(usage, finish)));
        }
        // swap_remove breaks admission order; prefill priority is oldest-first by id.
        self.running.sort_by_key(|r| r.id);
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::{tokenize, words};

    fn req(id: u64, prompt: Vec<u32>, max_tokens: usize, seed: u64) -> Request {
        Request { id, prompt, max_tokens, seed, adapter: None, ignore_eos: false }
    }

    /// Runs until `id` gets its first token; returns simulated ms elapsed.
    fn time_to_first_token(s: &mut Scheduler, id: u64) -> f64 {
        let mut t = 0.0;
        loop {
            t += s.begin_step().expect("work to do");
            if s.end_step().iter().any(|(i, e)| *i == id && matches!(e, Event::Token(_))) {
                return t;
            }
        }
    }

    fn run_to_completion(s: &mut Scheduler) -> Vec<(u64, Event)> {
        let mut all = Vec::new();
        while s.begin_step().is_some() {
            all.extend(s.end_step());
        }
        all
    }

    #[test]
    fn step_time_follows_the_formula() {
        let m = LatencyModel {
            base_ms: 6.0,
            prefill_ms_per_token: 0.030,
            decode_ms_per_seq: 0.05,
            ctx_ms_per_token: 0.000049,
        };
        assert!((m.step_ms(0, 1, 0) - 6.05).abs() < 1e-9);
        assert!((m.step_ms(1000, 0, 1000) - (6.0 + 30.0 + 0.049)).abs() < 1e-9);
        let half = m.at_speed(0.5);
        assert!((half.step_ms(1000, 0, 1000) - 2.0 * (6.0 + 30.0 + 0.049)).abs() < 1e-9);
    }

    #[test]
    fn a_half_speed_pod_takes_twice_as_long_per_step() {
        // A scenario's `speed: 0.5` is the pod's model `at_speed(0.5)`: the same requests make
        // the same steps with the same tokens as on a pod at 1.0, each step twice as long.
        let model = PUBLISHED_TESTBED.model;
        let mut full = Scheduler::new(EngineConfig { model, ..EngineConfig::default() });
        let mut half =
            Scheduler::new(EngineConfig { model: model.at_speed(0.5), ..EngineConfig::default() });
        for s in [&mut full, &mut half] {
            s.submit(req(1, tokenize(&words(&mut Rng::new(1), 3000)), 20, 7));
            s.submit(req(2, tokenize(&words(&mut Rng::new(2), 300)), 30, 8));
        }
        let mut steps = 0;
        loop {
            match (full.begin_step(), half.begin_step()) {
                (Some(f), Some(h)) => {
                    assert!((h - 2.0 * f).abs() < 1e-9, "step {steps}: {h} ms at 0.5, {f} at 1.0");
                    assert_eq!(full.end_step(), half.end_step(), "step {steps}");
                    steps += 1;
                }
                (None, None) => break,
                other => panic!("step {steps}: only one pod has work: {other:?}"),
            }
        }
        assert!(steps >= 30, "prefill and decode steps: {steps}");
    }

    #[test]
    fn h100_profile_matches_published_decode_and_prefill_rates() {
        let m = H100_8B.model;
        // BLIS fit: ~5.8 ms per decode step at batch 7; LambdaLabs: 7.6 ms median TPOT at 10
        // concurrent ShareGPT prompts, i.e. with a few thousand tokens of context each.
        let itl7 = m.step_ms(0, 7, 0);
        assert!((5.7..6.0).contains(&itl7), "{itl7}");
        let itl10 = m.step_ms(0, 10, 10 * 3000);
        assert!((6.5..8.5).contains(&itl10), "{itl10}");
        // prefill ~58k tokens/s: a 4000-token miss costs ~75 ms
        let miss = m.step_ms(4000, 0, 4000) - m.step_ms(0, 0, 0);
        assert!((65.0..80.0).contains(&miss), "{miss}");
        assert_eq!("published-testbed".parse::<Profile>(), Ok(PUBLISHED_TESTBED));
        assert!("a100".parse::<Profile>().is_err());
    }

    #[test]
    fn cached_prompt_has_much_lower_ttft() {
        let mut s = Scheduler::new(EngineConfig::default());
        let prompt = tokenize(&words(&mut Rng::new(3), 4000));
        s.submit(req(1, prompt.clone(), 4, 1));
        let cold = time_to_first_token(&mut s, 1);
        run_to_completion(&mut s);
        s.submit(req(2, prompt.clone(), 4, 1));
        let warm = time_to_first_token(&mut s, 2);
        // cold: 4000 * 0.01725 = 69 ms of prefill; warm: only the last (partial) page
        assert!(cold > 69.0, "{cold}");
        assert!(warm < 10.0, "{warm}");
        let done = run_to_completion(&mut s);
        let usage = done
            .iter()
            .find_map(|(_, e)| if let Event::Done(u, _) = e { Some(*u) } else { None })
            .expect("done");
        assert_eq!(usage.prompt_tokens, 4000);
        assert_eq!(usage.cached_tokens, 3984, "page-aligned, last token recomputed");
    }

    #[test]
    fn generated_tokens_are_cached_for_the_next_turn() {
        let mut s = Scheduler::new(EngineConfig::default());
        let prompt = tokenize(&words(&mut Rng::new(4), 100));
        s.submit(req(1, prompt.clone(), 64, 9));
        let mut reply = String::new();
        for (_, e) in run_to_completion(&mut s) {
            if let Event::Token(t) = e {
                reply.push_str(&t);
            }
        }
        let mut next = prompt;
        next.extend(tokenize(&reply));
        next.extend(tokenize("next question here"));
        s.submit(req(2, next.clone(), 1, 1));
        let done = run_to_completion(&mut s);
        let Some((_, Event::Done(u, _))) = done.last() else { panic!("no done") };
        assert_eq!(u.cached_tokens, 160, "100 prompt + 64 reply = 164 -> 10 pages");
    }

    #[test]
    fn same_seed_same_text() {
        let texts: Vec<String> = (0..2)
            .map(|_| {
                let mut s = Scheduler::new(EngineConfig::default());
                s.submit(req(1, vec![1, 2, 3], 20, 42));
                run_to_completion(&mut s)
                    .into_iter()
                    .filter_map(|(_, e)| if let Event::Token(t) = e { Some(t) } else { None })
                    .collect()
            })
            .collect();
        assert_eq!(texts[0], texts[1]);
        assert_eq!(tokenize(&texts[0]).len(), 20);
    }

    #[test]
    fn queueing_beyond_max_running_delays_ttft() {
        let cfg = EngineConfig { max_running: 2, ..EngineConfig::default() };
        let mut s = Scheduler::new(cfg);
        for id in 1..=3 {
            s.submit(req(id, vec![id as u32; 50], 100, id));
        }
        s.begin_step();
        assert_eq!(s.num_running(), 2);
        assert_eq!(s.num_waiting(), 1);
        s.end_step();
        let t3 = time_to_first_token(&mut s, 3);
        // request 3 waits ~100 decode steps of ~5.8 ms
        assert!(t3 > 500.0, "{t3}");
    }

    #[test]
    fn histograms_follow_the_simulated_clock() {
        let cfg = EngineConfig { max_running: 1, eos_mean_tokens: 0.0, ..EngineConfig::default() };
        let mut s = Scheduler::new(cfg);
        s.submit(req(1, vec![1; 50], 10, 1));
        s.submit(req(2, vec![2; 50], 10, 2));
        let t1 = time_to_first_token(&mut s, 1);
        run_to_completion(&mut s);
        let st = s.stats();
        assert_eq!(st.ttft.count(), 2);
        assert_eq!(st.e2e.count(), 2);
        assert_eq!(st.queue.count(), 2);
        // 9 gaps between each request's 10 tokens
        assert_eq!(st.inter_token.count(), 18);
        assert_eq!(st.finished_length, 2);
        // Request 2 queued behind request 1's whole run: its wait and its TTFT exceed 1's TTFT.
        let mut o = String::new();
        st.ttft.write(&mut o, "t", "T.", "m=\"x\"", 0.0);
        let sum: f64 = o
            .lines()
            .find_map(|l| l.strip_prefix("t_sum{m=\"x\"} "))
            .and_then(|v| v.parse().ok())
            .expect("a sum line");
        assert!(sum * 1000.0 > 3.0 * t1, "TTFTs {sum} s against the first's {t1} ms");
    }

    #[test]
    fn chunked_prefill_spreads_long_prompts_over_steps() {
        let cfg = EngineConfig { prefill_budget: 1000, ..EngineConfig::default() };
        let mut s = Scheduler::new(cfg);
        s.submit(req(1, (0..3500).collect(), 1, 1));
        let mut steps = 0;
        while s.begin_step().is_some() {
            steps += 1;
            s.end_step();
        }
        assert_eq!(steps, 4);
    }

    #[test]
    fn memory_limit_queues_and_evicts() {
        let cfg = EngineConfig { capacity_tokens: 1000, page: 16, ..EngineConfig::default() };
        let mut s = Scheduler::new(cfg);
        s.submit(req(1, (0..600).collect(), 100, 1));
        s.submit(req(2, (10_000..10_600).collect(), 100, 2));
        s.begin_step();
        assert_eq!(s.num_running(), 1, "second request does not fit next to the first");
        s.end_step();
        run_to_completion(&mut s);
        assert!(s.cached_tree_tokens() <= 1000);
        assert_eq!(s.counters().finished, 2);
    }

    fn reply(events: &[(u64, Event)], id: u64) -> (usize, Option<Finish>) {
        let tokens =
            events.iter().filter(|(i, e)| *i == id && matches!(e, Event::Token(_))).count();
        let finish = events.iter().find_map(|(i, e)| match e {
            Event::Done(_, f) if *i == id => Some(*f),
            _ => None,
        });
        (tokens, finish)
    }

    #[test]
    fn replies_stop_at_eos_with_the_configured_mean_unless_ignore_eos() {
        let cfg = EngineConfig { eos_mean_tokens: 40.0, ..EngineConfig::default() };
        let mut s = Scheduler::new(cfg);
        for id in 0..400 {
            s.submit(req(id, vec![id as u32; 20], 120, 1000 + id));
        }
        let mut loud = req(1000, vec![7; 20], 120, 5);
        loud.ignore_eos = true;
        s.submit(loud);
        let ev = run_to_completion(&mut s);
        let lens: Vec<(usize, Option<Finish>)> = (0..400).map(|id| reply(&ev, id)).collect();
        for (n, f) in &lens {
            let expected = if *n == 120 { Finish::Length } else { Finish::Stop };
            assert_eq!(*f, Some(expected), "{n} tokens");
        }
        // geometric with mean 40 capped at 120: mean 40·(1 - (1-1/40)^120) = 38.1
        let mean = lens.iter().map(|(n, _)| *n as f64).sum::<f64>() / 400.0;
        assert!((34.0..42.0).contains(&mean), "mean reply {mean}");
        let short = lens.iter().filter(|(n, _)| *n <= 10).count();
        assert!(short > 60, "EOS early often, as a memoryless stop does: {short}");
        assert_eq!(reply(&ev, 1000), (120, Some(Finish::Length)), "ignore_eos runs to max_tokens");
        // the same seed gives the same length on any pod
        assert_eq!(eos_length(1003, 40.0), eos_length(1003, 40.0));
        assert_eq!(eos_length(1003, 0.0), None);
    }

    #[test]
    fn prompt_pages_are_reusable_once_prefilled_while_the_first_request_runs() {
        let cfg = EngineConfig { prefill_budget: 1000, ..EngineConfig::default() };
        let mut s = Scheduler::new(cfg);
        let prompt: Vec<u32> = (0..4000).collect();
        s.submit(req(1, prompt.clone(), 50, 1));
        // two steps compute 2000 prompt tokens of request 1
        for _ in 0..2 {
            s.begin_step();
            s.end_step();
        }
        let mut longer = prompt.clone();
        longer.extend(9000..9100);
        s.submit(req(2, longer, 5, 2));
        let ev = run_to_completion(&mut s);
        let cached = ev.iter().find_map(|(i, e)| match e {
            Event::Done(u, _) if *i == 2 => Some(u.cached_tokens),
            _ => None,
        });
        // admitted in step 3, after 2000 tokens (125 pages) were computed
        assert_eq!(cached, Some(2000));
        // nothing is left locked or reserved once both are done
        assert_eq!(s.used_tokens(), 0);
        assert_eq!(s.counters().finished, 2);
    }

    #[test]
    fn time_weighted_inflight_counts_requests_times_step_time() {
        let mut s = Scheduler::new(EngineConfig::default());
        s.submit(req(1, vec![1; 16], 3, 1));
        s.submit(req(2, vec![2; 16], 3, 2));
        let mut total_ms = 0.0;
        while let Some(ms) = s.begin_step() {
            total_ms += ms;
            s.end_step();
        }
        let c = s.counters();
        assert!((c.busy_us as f64 - total_ms * 1000.0).abs() < 2.0, "{} vs {total_ms}", c.busy_us);
        // both run through all 3 steps (prefill + 2 decodes)
        let expected = 2.0 * total_ms * 1000.0;
        assert!((c.inflight_us as f64 - expected).abs() < 4.0, "{} vs {expected}", c.inflight_us);
    }
}
