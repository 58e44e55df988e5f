//! Was the router's guess right? After a `prefix_cache` decision, the engine's reply says how many
//! prompt tokens it found cached (`usage.prompt_tokens_details.cached_tokens`, in a JSON reply and
//! in the last chunk of a stream with `stream_options.include_usage`). Comparing that with the
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
    let prompt = last_number(tail, b"\"prompt_tokens\"").unwrap_or(0);
    Some((prompt, cached))
}

/// The integer after the last `"key"` `:` in `text`.
fn last_number(text: &[u8], key: &[u8]) -> Option<i64> {
    let at = text.windows(key.len()).rposition(|w| w == key)?;
    let rest = text.get(at + key.len()..)?;
    let rest = trim_start(rest);
    let rest = trim_start(rest.strip_prefix(b":")?);
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(rest.get(..digits)?).ok()?.parse().ok()
}

fn trim_start(s: &[u8]) -> &[u8] {
    let n = s.iter().take_while(|b| b.is_ascii_whitespace()).count();
    s.get(n..).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_usage_of_a_json_reply_and_of_a_stream() {
        let json = br#"{"choices":[{"message":{"content":"prompt_tokens"}}],"usage":{"prompt_tokens":812,"completion_tokens":9,"total_tokens":821,"prompt_tokens_details":{"cached_tokens":768}}}"#;
        assert_eq!(usage_tokens(json), Some((812, 768)));
        let sse = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\": 40, \"prompt_tokens_details\": {\"cached_tokens\": 0}}}\n\ndata: [DONE]\n\n";
        assert_eq!(usage_tokens(sse), Some((40, 0)));
        assert_eq!(usage_tokens(br#"{"usage":{"prompt_tokens":5}}"#), None, "no cache report");
        assert_eq!(usage_tokens(br#""cached_tokens": null"#), None);
        assert_eq!(usage_tokens(b"\"cached_tokens\":"), None, "cut");
    }

    #[test]
    fn counts_the_guess_against_the_report_over_chunks() {
        let mut host = crate::host::fake::FakeHost::new();
        let mut check = CacheCheck::new(true);
        let body = format!(
            "{{\"x\":\"{}\",\"usage\":{{\"prompt_tokens\":100,\"prompt_tokens_details\":{{\"cached_tokens\":64}}}}}}",
            "y".repeat(3000)
        );
        // Delivered in chunks, the key split across two of them.
        let split = body.find("cached_tok").unwrap_or(0) + 5;
        for chunk in [&body[..1500], &body[1500..split], &body[split..]] {
            host.response_body = chunk.as_bytes().to_vec();
            check.on_chunk(&host, chunk.len());
        }
        check.finish(&mut host);
        assert_eq!(host.counters.get("ai_lb_predicted_hit_engine_hit"), Some(&1));
        assert_eq!(host.counters.get("ai_lb_engine_cached_tokens"), Some(&64));
        assert_eq!(host.counters.get("ai_lb_engine_prompt_tokens"), Some(&100));
        let mut miss = CacheCheck::new(false);
        host.response_body =
            br#"{"usage":{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":0}}}"#
                .to_vec();
        miss.on_chunk(&host, host.response_body.len());
        miss.finish(&mut host);
        assert_eq!(host.counters.get("ai_lb_predicted_miss_engine_miss"), Some(&1));
    }
}
