//! `prefix_cache`: send a conversation to the pod that already holds its prompt prefix in KV cache.
//!
//! Blocks: the text `role + ":" + content` of each message, concatenated, cut after each user
//! message and after the last message; the `tools` list (what a chat template renders first) opens
//! the first block. Each block is hashed with SHA-1; the chain is `key_i = key_{i-1} XOR sha1_i`
//! (Higress's key semantics), named by upper-case hex. The chain is computed here, not in Lua, and
//! sent in one `prefix_cache.lua` call that finds the longest chain present in Redis, routes to its
//! host if healthy (re-homing keys that name a gone/unhealthy host, without breaking the chain),
//! otherwise picks the least-loaded host, writes the rest of the chain, and counts in-flight like
//! `global_least_request`.

use super::picker::{PickKind, PickResult, Picker, Routed};
use super::{Decision, Policy, Stream};
use crate::config::PrefixCacheConfig;
use crate::host::{Counter, Host, LogLevel};
use crate::redis;
use serde_json::Value;
use sha1::{Digest, Sha1};

/// At most this many chain keys per request: prefixes matter from the start, and the script call
/// must stay small. Later blocks are not indexed.
pub const MAX_BLOCKS: usize = 256;

/// Splits a request body into prefix blocks. `None` when the body is not a JSON object (the
/// request then passes through). An object without `messages`/`prompt` gives no blocks.
/// `split_system`: also cut after the leading system/developer messages (`splitSystemPrompt`).
pub fn blocks_from_body(body: &[u8], split_system: bool) -> Option<Vec<String>> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let obj = v.as_object()?;
    let mut blocks = Vec::new();
    let mut cur = String::new();
    if let Some(tools) = obj.get("tools").filter(|t| !t.is_null()) {
        cur.push_str("tools:");
        cur.push_str(&tools.to_string());
    }
    if let Some(Value::Array(messages)) = obj.get("messages") {
        let last = messages.len().saturating_sub(1);
        let is_system = |m: &Value| {
            matches!(m.get("role").and_then(Value::as_str), Some("system" | "developer"))
        };
        for (i, m) in messages.iter().enumerate() {
            let role = m.get("role").and_then(Value::as_str).unwrap_or("");
            cur.push_str(role);
            cur.push(':');
            push_content(&mut cur, m.get("content"));
            if let Some(tc) = m.get("tool_calls").filter(|t| !t.is_null()) {
                cur.push_str(&tc.to_string());
            }
            // End of the leading system run: the next message is the first non-system one.
            let system_cut = split_system
                && blocks.is_empty()
                && messages.iter().take(i + 1).all(is_system)
                && messages.get(i + 1).is_some_and(|n| !is_system(n));
            if role == "user" || i == last || system_cut {
                blocks.push(std::mem::take(&mut cur));
            }
        }
    } else if let Some(prompt) = obj.get("prompt") {
        // /v1/completions: one prompt is one block (a string, or an array of strings / token ids).
        match prompt {
            Value::String(s) => cur.push_str(s),
            Value::Array(items) => {
                for (i, it) in items.iter().enumerate() {
                    match it {
                        Value::String(s) => cur.push_str(s),
                        other => {
                            // Token ids: separated, or [1,23] and [12,3] would share a block.
                            if i > 0 {
                                cur.push(',');
                            }
                            cur.push_str(&other.to_string());
                        }
                    }
                }
            }
            Value::Null => {}
            other => cur.push_str(&other.to_string()),
        }
        if !cur.is_empty() {
            blocks.push(std::mem::take(&mut cur));
        }
    }
    Some(blocks)
}

/// Appends the text of a message `content`: a string; an array of parts (text, image URLs so that
/// different images differ, other parts as JSON); nothing for null.
fn push_content(out: &mut String, content: Option<&Value>) {
    match content {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push_str(s),
        Some(Value::Array(parts)) => {
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        out.push_str(p.get("text").and_then(Value::as_str).unwrap_or(""))
                    }
                    Some("image_url") => {
                        let url = p
                            .get("image_url")
                            .and_then(|u| u.get("url").or(Some(u)))
                            .and_then(Value::as_str)
                            .unwrap_or("");
                        out.push_str("<image:");
                        out.push_str(url);
                        out.push('>');
                    }
                    _ => match p {
                        Value::String(s) => out.push_str(s),
                        other => out.push_str(&other.to_string()),
                    },
                }
            }
        }
        Some(other) => out.push_str(&other.to_string()),
    }
}

/// SHA-1 of a block.
pub fn sha1(block: &[u8]) -> [u8; 20] {
    let d = Sha1::digest(block);
    let mut out = [0u8; 20];
    out.copy_from_slice(d.as_slice());
    out
}

/// Upper-case hex (like Higress's key names).
pub fn hex_upper(bytes: &[u8]) -> String {
    hex::encode_upper(bytes)
}

/// The chain values `key_i = key_{i-1} XOR sha1(block_i)` (key_0 = 0), as upper-case hex, at most
/// [`MAX_BLOCKS`]. The chain stops before an all-zero value: XOR cancels repeated blocks, and the
/// zero key would be shared by unrelated conversations (Higress's bug writes it).
pub fn chain(blocks: &[String]) -> Vec<String> {
    let mut acc = [0u8; 20];
    let mut out = Vec::with_capacity(blocks.len().min(MAX_BLOCKS));
    for b in blocks.iter().take(MAX_BLOCKS) {
        let h = sha1(b.as_bytes());
        for (a, x) in acc.iter_mut().zip(h.iter()) {
            *a ^= x;
        }
        if acc.iter().all(|b| *b == 0) {
            break;
        }
        out.push(hex_upper(&acc));
    }
    out
}

/// An admitted pick is a hit (on the pod holding the longest known prefix), a hit diverted for
/// load (`hitLoadFactor`), or a miss; a hit's prediction is checked against the engine's report.
fn routed(host: &mut dyn Host, pick: &PickResult) -> Routed {
    let counter = match (pick.matched > 0, pick.diverted) {
        (true, false) => Counter::PrefixHit,
        (true, true) => Counter::PrefixHitDiverted,
        (false, _) => Counter::PrefixMiss,
    };
    if counter == Counter::PrefixHit {
        host.increment_counter(Counter::PrefixMatchedBlocks, pick.matched);
    }
    Routed {
        counter,
        decision: format!("{}; blocks={}", counter.label(), pick.matched),
        predicted_hit: Some(counter == Counter::PrefixHit),
    }
}

/// The `prefix_cache` policy.
pub struct PrefixCache {
    picker: Picker,
    config: PrefixCacheConfig,
}

impl PrefixCache {
    /// Creates the policy from its config.
    pub fn new(config: PrefixCacheConfig) -> Self {
        PrefixCache {
            picker: Picker::new(
                config.least_request.clone(),
                redis::PREFIX_CACHE_LUA,
                "prefix_cache",
            ),
            config,
        }
    }

    fn pick(&mut self, host: &mut dyn Host, stream: &mut Stream, chain: &[String]) -> Decision {
        let kind = PickKind::Prefix {
            chain: chain.to_vec(),
            ttl_s: self.config.redis_key_ttl_s,
            hit_load_factor: self.config.hit_load_factor,
        };
        self.picker.start(host, stream, kind)
    }
}

impl Policy for PrefixCache {
    fn on_request_headers(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        end_of_stream: bool,
    ) -> Decision {
        if !self.picker.has_group(host, stream) {
            return Decision::Passthrough;
        }
        if end_of_stream {
            // Bodiless (GET...): no prompt, so a least-request pick now (Higress #3740: never wait).
            return self.pick(host, stream, &[]);
        }
        Decision::NeedBody
    }

    fn on_request_body(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        body: &[u8],
    ) -> Decision {
        let Some(blocks) = blocks_from_body(body, self.config.split_system_prompt) else {
            host.log(
                LogLevel::Info,
                "prefix_cache: request body is not a JSON object; using normal balancing",
            );
            host.increment_counter(Counter::FallbackBadBody, 1);
            stream.decision = Some(Counter::FallbackBadBody.label().to_string());
            return Decision::Passthrough;
        };
        let keys = chain(&blocks);
        self.pick(host, stream, &keys)
    }

    fn on_response_body(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        size: usize,
        end_of_stream: bool,
    ) {
        self.picker.on_response_body(host, stream, size, end_of_stream);
    }

    super::picker::delegate_to_picker!(routed);
}

#[cfg(test)]
#[path = "prefix_cache_tests.rs"]
mod tests;
