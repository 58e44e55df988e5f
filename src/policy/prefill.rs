//! `prefix_cache` with `loadAware`: each pod's prefill backlog as this worker knows it, the prompt
//! bytes it sent the pod that the pod has not started answering (no response body byte yet) and
//! that the pod does not hold (past the matched prefix).
//!
//! Why: in-flight counts weigh a request that prefills a 12k-token document like one that decodes
//! a short answer, and the engines' metrics do not tell them apart either (a prefill in progress
//! is a running request; its KV is a few percent of the cache). A new long prompt sent to a pod
//! that is still prefilling another one waits for it: on document QA (`long-context`) that made
//! least-request placement of first turns slower than hashing sessions blindly.

use super::prefix_cache::MAX_BLOCKS;
use std::collections::HashMap;

/// A prompt older than this with no answer no longer counts (a stream whose end the plugin never
/// saw).
const FORGET_NS: u64 = 60 * 1_000_000_000;
/// At most this many prompts are tracked (bounded memory per worker); past it the oldest goes.
const MAX_TRACKED: usize = 4096;

/// One prompt sent and not answered yet.
struct Prompt {
    /// Cumulative bytes of its first prefix blocks (at most [`MAX_BLOCKS`], as many as a pick
    /// can find cached): `cum[i]` = bytes of blocks `0..=i`.
    cum: Vec<usize>,
    /// Bytes of all its blocks.
    total: usize,
    sent_ns: u64,
}

/// How one admitted pick placed a request, as the picker reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement<'a> {
    /// The pod.
    pub pod: &'a str,
    /// Prefix blocks the pod already holds (0 on a miss or a diverted hit).
    pub cached_blocks: usize,
}

/// See the module docs.
#[derive(Default)]
pub struct PrefillBacklog {
    prompts: HashMap<u32, Prompt>,
}

impl PrefillBacklog {
    /// `stream`'s prompt, cut into blocks of these byte lengths, is about to be routed.
    pub fn on_prompt(
        &mut self,
        stream: u32,
        block_bytes: impl Iterator<Item = usize>,
        now_ns: u64,
    ) {
        if self.prompts.len() >= MAX_TRACKED {
            self.prompts.retain(|_, p| now_ns.saturating_sub(p.sent_ns) < FORGET_NS);
        }
        if self.prompts.len() >= MAX_TRACKED {
            let oldest = self.prompts.iter().min_by_key(|(_, p)| p.sent_ns).map(|(s, _)| *s);
            if let Some(oldest) = oldest {
                self.prompts.remove(&oldest);
            }
        }
        let mut total = 0usize;
        let mut cum = Vec::new();
        for b in block_bytes {
            total = total.saturating_add(b);
            if cum.len() < MAX_BLOCKS {
                cum.push(total);
            }
        }
        self.prompts.insert(stream, Prompt { cum, total, sent_ns: now_ns });
    }

    /// The pod started answering `stream` (its prefill is over), or the stream ended.
    pub fn on_answered(&mut self, stream: u32) {
        self.prompts.remove(&stream);
    }

    /// How many prompts are tracked.
    #[cfg(test)]
    pub(crate) fn tracked(&self) -> usize {
        self.prompts.len()
    }

    /// Each pod's backlog in bytes: the uncached part of every prompt still waiting for its first
    /// answer byte, by the pod `placement` says it went to (prompts not placed yet, or routed
    /// without Redis, are left out).
    pub fn per_pod<'a>(
        &self,
        now_ns: u64,
        placement: impl Fn(u32) -> Option<Placement<'a>>,
    ) -> Vec<(String, u64)> {
        let mut by_pod: HashMap<&str, u64> = HashMap::new();
        for (stream, p) in &self.prompts {
            if now_ns.saturating_sub(p.sent_ns) >= FORGET_NS {
                continue;
            }
            let Some(place) = placement(*stream) else { continue };
            let total = p.total;
            let cached =
                place.cached_blocks.checked_sub(1).and_then(|i| p.cum.get(i)).copied().unwrap_or(0);
            *by_pod.entry(place.pod).or_insert(0) += total.saturating_sub(cached) as u64;
        }
        by_pod.into_iter().map(|(pod, bytes)| (pod.to_string(), bytes)).collect()
    }
}

#[cfg(test)]
#[path = "prefill_tests.rs"]
mod tests;
