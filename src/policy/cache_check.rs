//! Was the router's guess right? After a `prefix_cache` decision, the engine's reply says how many
//! prompt tokens it found cached (`usage.prompt_tokens_details.cached_tokens`, in a JSON reply and
//! in the last chunk of a stream with `stream_options.include_usage`; the Responses API names them
//! `input_tokens` and `input_tokens_details.cached_tokens`, in its reply and in the stream's
//! `response.completed` event). Comparing that with the
//! prediction (a prefix hit or a miss) tells an operator how often the routing paid off.
//!
//! The usage object is at the end of the body, so only the last [`TAIL`] bytes of the response are
//! kept: each chunk costs one copy of at most that many bytes, and nothing is buffered or delayed.

use crate::host::{Counter, Host};

/// Bytes of the response end kept to find the usage object (a vLLM or SGLang usage object with
/// `[DONE]` after it is well under this).
pub const TAIL: usize = 1024;

/// The prediction for one request and the end of its response so far.
#[derive(Debug)]
pub(crate) struct CacheCheck {
    predicted_hit: bool,
    tail: Vec<u8>,
}

impl CacheCheck {
    pub fn new(predicted_hit: bool) -> CacheCheck {
        CacheCheck { predicted_hit, tail: Vec::new() }
    }

    /// A response body chunk of `size` bytes: keep the end of the response.
    pub fn on_chunk(&mut self, host: &dyn Host, size: usize) {
        let take = size.min(TAIL);
        let Some(bytes) = host.response_body(size - take, take) else { return };
        self.tail.extend_from_slice(&bytes);
        let excess = self.tail.len().saturating_sub(TAIL);
        self.tail.drain(..excess);
    }

    /// The response is complete: count the prediction against the engine's report, if any.
    pub fn finish(&self, host: &mut dyn Host) {
        let Some((prompt, cached)) = usage_tokens(&self.tail) else { return };
        host.increment_counter(Counter::EnginePromptTokens, prompt);
        host.increment_counter(Counter::EngineCachedTokens, cached);
        let counter = match (self.predicted_hit, cached > 0) {
            (true, true) => Counter::PredictedHitEngineHit,
            (true, false) => Counter::PredictedHitEngineMiss,
            (false, true) => Counter::PredictedMissEngineHit,
            (false, false) => Counter::PredictedMissEngineMiss,
        };
        host.increment_counter(counter, 1);
    }
}

/// `(prompt_tokens, cached_tokens)` of the last usage object in `tail`; `None` without a
/// `cached_tokens` figure (engines that do not report it).
pub fn usage_tokens(tail: &[u8]) -> Option<(i64, i64)> {
    let cached = last_number(tail, b"\"cached_tokens\"")?;
    let prompt = last_number(tail, b"\"prompt_tokens\"")
        .or_else(|| last_number(tail, b"\"input_tokens\""))
        .unwrap_or(0);
    Some((prompt, cached))
}

/// The integer after the last `"key"` `:` in `text`.
fn last_number(text: &[u8], key: &[u8]) -> Option<i64> {
    let rest = super::after_last_key(text, key)?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(rest.get(..digits)?).ok()?.parse().ok()
}

#[cfg(test)]
#[path = "cache_check_tests.rs"]
mod tests;
