//! Responses kept on the server. With OpenAI's Responses API a client can send only the new items
//! and name the response they follow (`previous_response_id`): the server rebuilds the
//! conversation from what it stored. vLLM stores responses in the memory of the process that made
//! them (`VLLM_ENABLE_RESPONSES_API_STORE`), so such a request must reach that pod: any other
//! answers 404. Where the store is shared, the pod that made the response still holds its
//! conversation in KV cache.
//!
//! So `prefix_cache` reads the id of each stored response (`store` not `false`) from the start of
//! the reply and writes it to Redis as a prefix key naming the pod that answered (the chain value
//! of the block `response:<id>`, [`super::prefix_cache::response_chain_value`]); a request that
//! continues the response starts its chain with the same block, and its pick goes to that pod.
//!
//! The gateway also keeps its own record of recent responses' pods, in shared data (every worker
//! of this gateway reads it): [`RECORD_SLOTS`] keys, each holding the last [`RECORD_WAYS`]
//! responses whose id hashes to it. A request that continues a response the record holds is held
//! to that pod (see [`super::picker::Pin`]); while Redis cannot answer (down, stalled, the breaker
//! open) it goes there directly, instead of to a pod that would answer 404.
//!
//! The id is the first `"id"` of the reply: a JSON reply is the response object, whose first key
//! it is (OpenAI, vLLM and SGLang all write it first), and a stream's first event
//! (`response.created`) carries that object. Only the first [`HEAD`] bytes are kept; nothing is
//! buffered or delayed.

use crate::host::Host;

/// Buckets of the gateway's own record of responses' pods: shared data keys, each holding the
/// last [`RECORD_WAYS`] responses whose id hashes to it (about 100 bytes each: 6.5 MB when all are
/// full). A response is forgotten there only once that many later ones share its bucket.
pub const RECORD_SLOTS: u64 = 16384;

/// Responses one bucket holds. With one, two of the few hundred responses a busy gateway makes in
/// a few seconds often shared a slot (16384 slots: the birthday bound), and the older was forgotten
/// before its next request (bench `agentic-stored-freeze`: every 404 left during the freeze).
pub const RECORD_WAYS: usize = 4;

/// Writes `pod` as the pod that made the stored response `id`, in the gateway's own record: first
/// in its bucket, the bucket's oldest dropped past [`RECORD_WAYS`]. Workers write a bucket with
/// its CAS, so one worker's write does not undo another's.
pub fn remember(host: &mut dyn Host, id: &str, pod: &str) {
    let key = record_key(id);
    for _ in 0..3 {
        let (held, cas) = host.get_shared_data(&key);
        let held = held.and_then(|b| String::from_utf8(b).ok()).unwrap_or_default();
        let mut lines = vec![format!("{id} {pod}")];
        lines.extend(
            held.lines()
                .filter(|line| line.split_once(' ').is_some_and(|(other, _)| other != id))
                .take(RECORD_WAYS - 1)
                .map(str::to_string),
        );
        match host.set_shared_data(&key, lines.join("\n").as_bytes(), cas) {
            Err(crate::host::HostError::CasMismatch) => continue,
            _ => return,
        }
    }
}

/// The pod that made the stored response `id`, if the gateway's own record still holds it.
pub fn recall(host: &dyn Host, id: &str) -> Option<String> {
    let (value, _) = host.get_shared_data(&record_key(id));
    let value = String::from_utf8(value?).ok()?;
    value.lines().find_map(|line| {
        let (held, pod) = line.split_once(' ')?;
        (held == id && !pod.is_empty()).then(|| pod.to_string())
    })
}

/// The record's key for `id`: its bucket, by FNV-1a.
fn record_key(id: &str) -> String {
    let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("ai-lb/response/{}", hash % RECORD_SLOTS)
}

/// Bytes of the reply's start searched for the response id (a `response.created` event puts the
/// id within its first hundred bytes).
pub const HEAD: usize = 2048;

/// The longest response id taken (OpenAI's are about 55 bytes; a longer string is not an id).
pub const MAX_ID: usize = 256;

/// One stream whose response id is wanted: the pod that answers and the reply's start so far.
#[derive(Debug, Default)]
pub(crate) struct ResponseIdReader {
    /// The pod that answered (`upstream.address`), once the response headers came with a 2xx.
    pod: Option<String>,
    head: Vec<u8>,
}

impl ResponseIdReader {
    /// The response headers: `false` when no id is to be read (not a 2xx, or no upstream address:
    /// nothing was stored, or nowhere known).
    pub fn on_headers(&mut self, host: &dyn Host) -> bool {
        let ok = host.response_header(":status").is_some_and(|s| s.starts_with('2'));
        self.pod = super::upstream_address(host).filter(|_| ok);
        self.pod.is_some()
    }

    /// A response body chunk of `size` bytes. `Some((pod, id))` once the id is found; `None` while
    /// it may still come, and for good once [`HEAD`] bytes came without it.
    pub fn on_chunk(&mut self, host: &dyn Host, size: usize) -> Option<(String, String)> {
        let room = HEAD.saturating_sub(self.head.len());
        if room > 0 && size > 0 {
            if let Some(bytes) = host.response_body(0, size.min(room)) {
                self.head.extend_from_slice(&bytes);
            }
        }
        let id = first_id(&self.head)?;
        Some((self.pod.clone()?, id.to_string()))
    }

    /// Whether the reply's start is read without an id: nothing more to look for.
    pub fn gave_up(&self) -> bool {
        self.head.len() >= HEAD
    }
}

/// The value of the first `"id"` key in `text`, when it is a whole JSON string without escapes
/// of at most [`MAX_ID`] bytes. A key inside a string is written `\"id\"` and is not matched.
pub fn first_id(text: &[u8]) -> Option<&str> {
    let rest = super::after_first_key(text, b"\"id\"")?.strip_prefix(b"\"")?;
    let len = rest.iter().take(MAX_ID + 1).position(|b| *b == b'"')?;
    let id = std::str::from_utf8(rest.get(..len)?).ok()?;
    (!id.is_empty() && !id.contains('\\') && !id.chars().any(char::is_control)).then_some(id)
}

#[cfg(test)]
#[path = "response_id_tests.rs"]
mod tests;
