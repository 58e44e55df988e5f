//! Step-based continuous-batching scheduler and latency model of one pod (no real time here:
//! the server drives it and sleeps for each step's simulated duration).
//!
//! Per step: admit waiting requests (running-slot and KV-memory limits, FIFO), give prefill a
//! token budget (chunked prefill, oldest first), let every fully prefilled sequence decode one
//! token, and cost the step as
//! `base + per_prefill_token * prefill_tokens + per_decode_seq * decode_seqs + per_ctx_token * sum_ctx`
//! (8B model on one H100; see shared notes §4).

use crate::radix::{NodeId, RadixCache};
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
        LatencyModel {
            base_ms: 6.0,
            prefill_ms_per_token: 0.030,
            decode_ms_per_seq: 0.05,
            ctx_ms_per_token: 0.000049,
        }
    }
}

impl LatencyModel {
    /// Duration of one step in simulated ms.
    pub fn step_ms(&self, prefill_tokens: usize, decode_seqs: usize, sum_ctx_tokens: usize) -> f64 {
        self.base_ms
            + self.prefill_ms_per_token * prefill_tokens as f64
            + self.decode_ms_per_seq * decode_seqs as f64
            + self.ctx_ms_per_token * sum_ctx_tokens as f64
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
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            page: 16,
            capacity_tokens: 400_000,
            max_running: 128,
            prefill_budget: 8192,
            model: LatencyModel::default(),
        }
    }
}

/// What happens to a request, reported after the step in which it happened.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// One generated token (its text: a word, with a leading space except for the first).
    Token(String),
    /// Generation finished (max_tokens reached).
    Done(Usage),
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

/// A request waiting for admission.
#[derive(Debug)]
struct Waiting {
    id: u64,
    prompt: Vec<u32>,
    max_tokens: usize,
    seed: u64,
    adapter: Option<String>,
}

#[derive(Debug)]
struct Running {
    id: u64,
    prompt: Vec<u32>,
    max_tokens: usize,
    rng: Rng,
    adapter: Option<String>,
    cached: usize,
    lock: NodeId,
    reserved: usize,
    prefilled: usize,
    generated: Vec<u32>,
    /// Emits a token at the end of the current step.
    emits: bool,
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
}

/// One pod's scheduler state.
#[derive(Debug)]
pub struct Scheduler {
    cfg: EngineConfig,
    cache: RadixCache,
    waiting: VecDeque<Waiting>,
    running: Vec<Running>,
    private_tokens: usize,
    counters: Counters,
    in_step: bool,
}

impl Scheduler {
    /// A scheduler with an empty cache.
    pub fn new(cfg: EngineConfig) -> Self {
        Scheduler {
            cfg,
            cache: RadixCache::new(cfg.page),
            waiting: VecDeque::new(),
            running: Vec::new(),
            private_tokens: 0,
            counters: Counters::default(),
            in_step: false,
        }
    }

    /// Queues a request. `seed` makes its generated text deterministic.
    pub fn submit(
        &mut self,
        id: u64,
        prompt: Vec<u32>,
        max_tokens: usize,
        seed: u64,
        adapter: Option<String>,
    ) {
        self.waiting.push_back(Waiting {
            id,
            prompt,
            max_tokens: max_tokens.max(1),
            seed,
            adapter,
        });
        let inflight = (self.waiting.len() + self.running.len()) as u64;
        self.counters.peak_inflight = self.counters.peak_inflight.max(inflight);
    }

    /// Cancels a request (client went away); frees its pages.
    pub fn abort(&mut self, id: u64) {
        self.waiting.retain(|w| w.id != id);
        if let Some(i) = self.running.iter().position(|r| r.id == id) {
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
        let mut wait: Vec<String> = self.waiting.iter().filter_map(|w| w.adapter.clone()).collect();
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
            let Some(w) = self.waiting.front() else { break };
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
                // Pin the match while evicting so the request's own prefix survives.
                self.cache.lock(node);
                self.cache.evict(over);
                self.cache.unlock(node);
                let still = self.cache.locked_tokens() + self.private_tokens + need
                    > self.cfg.capacity_tokens;
                if still && !self.running.is_empty() {
                    break; // wait for running requests to free memory
                }
            }
            let Some(w) = self.waiting.pop_front() else { break };
            self.cache.lock(node);
            self.private_tokens += need;
            self.counters.requests += 1;
            self.counters.prompt_tokens += n as u64;
            self.counters.cached_tokens += cached as u64;
            self.running.push(Running {
                id: w.id,
                prompt: w.prompt,
                max_tokens: w.max_tokens,
                rng: Rng::new(w.seed),
                adapter: w.adapter,
                cached,
                lock: node,
                reserved: need,
                prefilled: cached,
                generated: Vec::new(),
                emits: false,
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
                r.emits = r.prefilled == n;
            } else {
                decode += 1;
                r.emits = true;
            }
            ctx += r.prefilled + r.generated.len();
        }
        self.in_step = true;
        Some(self.cfg.model.step_ms(prefill, decode, ctx))
    }

    /// Completes the planned step: emits tokens, finishes requests (their prompt + output
    /// go into the prefix tree), and returns the events per request id.
    pub fn end_step(&mut self) -> Vec<(u64, Event)> {
        let mut events = Vec::new();
        if !self.in_step {
            return events;
        }
        self.in_step = false;
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
            let text = if r.generated.len() == 1 { w } else { format!(" {w}") };
            events.push((r.id, Event::Token(text)));
            self.counters.generation_tokens += 1;
            if r.generated.len() < r.max_tokens {
                i += 1;
                continue;
            }
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
            events.push((r.id, Event::Done(usage)));
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
        let m = LatencyModel::default();
        assert!((m.step_ms(0, 1, 0) - 6.05).abs() < 1e-9);
        assert!((m.step_ms(1000, 0, 1000) - (6.0 + 30.0 + 0.049)).abs() < 1e-9);
        // B=64 decodes at 2k context: ~15 ms per notes
        let itl = m.step_ms(0, 64, 64 * 2048);
        assert!(itl > 12.0 && itl < 16.0, "{itl}");
    }

    #[test]
    fn cached_prompt_has_much_lower_ttft() {
        let mut s = Scheduler::new(EngineConfig::default());
        let prompt = tokenize(&words(&mut Rng::new(3), 4000));
        s.submit(1, prompt.clone(), 4, 1, None);
        let cold = time_to_first_token(&mut s, 1);
        run_to_completion(&mut s);
        s.submit(2, prompt.clone(), 4, 1, None);
        let warm = time_to_first_token(&mut s, 2);
        // cold: 4000 * 0.03 = 120 ms of prefill; warm: only the last (partial) page
        assert!(cold > 120.0, "{cold}");
        assert!(warm < 10.0, "{warm}");
        let done = run_to_completion(&mut s);
        let usage = done
            .iter()
            .find_map(|(_, e)| if let Event::Done(u) = e { Some(*u) } else { None })
            .expect("done");
        assert_eq!(usage.prompt_tokens, 4000);
        assert_eq!(usage.cached_tokens, 3984, "page-aligned, last token recomputed");
    }

    #[test]
    fn generated_tokens_are_cached_for_the_next_turn() {
        let mut s = Scheduler::new(EngineConfig::default());
        let prompt = tokenize(&words(&mut Rng::new(4), 100));
        s.submit(1, prompt.clone(), 64, 9, None);
        let mut reply = String::new();
        for (_, e) in run_to_completion(&mut s) {
            if let Event::Token(t) = e {
                reply.push_str(&t);
            }
        }
        let mut next = prompt;
        next.extend(tokenize(&reply));
        next.extend(tokenize("next question here"));
        s.submit(2, next.clone(), 1, 1, None);
        let done = run_to_completion(&mut s);
        let Some((_, Event::Done(u))) = done.last() else { panic!("no done") };
        assert_eq!(u.cached_tokens, 160, "100 prompt + 64 reply = 164 -> 10 pages");
    }

    #[test]
    fn same_seed_same_text() {
        let texts: Vec<String> = (0..2)
            .map(|_| {
                let mut s = Scheduler::new(EngineConfig::default());
                s.submit(1, vec![1, 2, 3], 20, 42, None);
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
            s.submit(id, vec![id as u32; 50], 100, id, None);
        }
        s.begin_step();
        assert_eq!(s.num_running(), 2);
        assert_eq!(s.num_waiting(), 1);
        s.end_step();
        let t3 = time_to_first_token(&mut s, 3);
        // request 3 waits ~100 decode steps of ~6 ms
        assert!(t3 > 500.0, "{t3}");
    }

    #[test]
    fn chunked_prefill_spreads_long_prompts_over_steps() {
        let cfg = EngineConfig { prefill_budget: 1000, ..EngineConfig::default() };
        let mut s = Scheduler::new(cfg);
        s.submit(1, (0..3500).collect(), 1, 1, None);
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
        s.submit(1, (0..600).collect(), 100, 1, None);
        s.submit(2, (10_000..10_600).collect(), 100, 2, None);
        s.begin_step();
        assert_eq!(s.num_running(), 1, "second request does not fit next to the first");
        s.end_step();
        run_to_completion(&mut s);
        assert!(s.cached_tree_tokens() <= 1000);
        assert_eq!(s.counters().finished, 2);
    }
}
