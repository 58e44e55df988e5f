//! `prefix_cache`: send a conversation to the pod that already holds its prompt prefix in KV cache.
//!
//! Blocks: the text `role + ":" + content` of each message, concatenated, cut after each user
//! message and after the last message; the `tools` list (what a chat template renders first),
//! then a top-level `system` prompt (Anthropic's Messages API), open the first block. Each block
//! is hashed with SHA-1; the chain is `key_i = key_{i-1} XOR sha1_i` (Higress's key semantics),
//! named by upper-case hex. The chain is computed here, not in Lua, and sent in one
//! `prefix_cache.lua` call that finds the longest chain present in Redis, routes to its host if
//! healthy (re-homing keys that name a gone/unhealthy host, without breaking the chain), otherwise
//! picks the least-loaded host, writes the rest of the chain, and counts in-flight like
//! `global_least_request`.
//!
//! With `loadAware` (ours, off by default) and fresh metrics for every healthy pod, the call also
//! carries each pod's load ([`super::load`]): a hit is not taken when its pod is overloaded, a miss
//! goes to the pod with the least combined load, and a diverted hit adds its pod as a holder of
//! the prefix (a key names up to `maxHolders` pods; later requests take the least loaded one).

use super::latency::PodSpeed;
use super::picker::{LoadAware, PickKind, PickResult, Picker, Routed};
use super::prefill::PrefillBacklog;
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
///
/// The body (up to `maxBodyBytes`) is not parsed into a JSON tree: only `tools`, `system`
/// (Anthropic's top-level system prompt), `messages` (each message's `role`, `content` and
/// `tool_calls`) and `prompt` are read, other keys are skipped, and string contents without
/// escapes are borrowed from the body, not copied.
///
/// A body that fails to parse only for its text (bytes that are not UTF-8, or a `\uD83D` escape
/// without its other half, as a JavaScript client that cut a string in the middle of an emoji
/// sends) is read again with each of those as U+FFFD, as the Go plugin's JSON reader does: the
/// conversation keeps its affinity.
pub fn blocks_from_body(body: &[u8], split_system: bool) -> Option<Vec<String>> {
    match serde_json::from_slice::<ChatBody<'_>>(body) {
        Ok(req) => Some(blocks_of(&req, split_system)),
        Err(_) => {
            let repaired = replace_bad_text(body)?;
            let req: ChatBody<'_> = serde_json::from_slice(&repaired).ok()?;
            Some(blocks_of(&req, split_system))
        }
    }
}

/// `body` with bytes that are not UTF-8 and unpaired UTF-16 surrogate escapes replaced by U+FFFD,
/// or `None` when it has neither.
fn replace_bad_text(body: &[u8]) -> Option<Vec<u8>> {
    let (mut out, mut changed) = match String::from_utf8_lossy(body) {
        std::borrow::Cow::Borrowed(_) => (body.to_vec(), false),
        std::borrow::Cow::Owned(s) => (s.into_bytes(), true),
    };
    // `\uXXXX` escapes: a high surrogate must be followed at once by a low one, and a low one
    // preceded by a high one. Other escapes (`\\`, `\"`, ...) are stepped over whole, so an escaped
    // backslash followed by `u` is not taken for an escape.
    let hex = |b: &[u8]| std::str::from_utf8(b).ok().and_then(|h| u16::from_str_radix(h, 16).ok());
    let escape_at = |out: &[u8], i: usize| {
        (out.get(i) == Some(&b'\\') && out.get(i + 1) == Some(&b'u'))
            .then(|| out.get(i + 2..i + 6).and_then(hex))
            .flatten()
    };
    let mut i = 0;
    while i < out.len() {
        if out.get(i) != Some(&b'\\') {
            i += 1;
            continue;
        }
        let Some(unit) = escape_at(&out, i) else {
            i += 2;
            continue;
        };
        let paired = match unit {
            0xD800..=0xDBFF => {
                escape_at(&out, i + 6).is_some_and(|n| (0xDC00..=0xDFFF).contains(&n))
            }
            0xDC00..=0xDFFF => false,
            _ => {
                i += 6;
                continue;
            }
        };
        if paired {
            i += 12;
        } else {
            if let Some(digits) = out.get_mut(i + 2..i + 6) {
                digits.copy_from_slice(b"FFFD");
                changed = true;
            }
            i += 6;
        }
    }
    changed.then_some(out)
}

/// The blocks of a parsed body (see [`blocks_from_body`]).
fn blocks_of(req: &ChatBody<'_>, split_system: bool) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut cur = String::new();
    if let Some(tools) = &req.tools {
        cur.push_str("tools:");
        cur.push_str(&tools.to_string());
    }
    if let Some(Messages::List(messages)) = &req.messages {
        // A top-level system prompt (Anthropic) is rendered first, as a system message is: two
        // conversations that differ only in it share no cached prefix.
        if let Some(system) = &req.system {
            cur.push_str("system:");
            push_content(&mut cur, system);
            if split_system && !messages.is_empty() {
                blocks.push(std::mem::take(&mut cur));
            }
        }
        let last = messages.len().saturating_sub(1);
        let is_system = |m: &Message<'_>| matches!(m.role(), "system" | "developer");
        for (i, m) in messages.iter().enumerate() {
            let role = m.role();
            cur.push_str(role);
            cur.push(':');
            if let Message::Object { content, tool_calls, .. } = m {
                if let Some(content) = content {
                    push_content(&mut cur, content);
                }
                if let Some(tc) = tool_calls {
                    cur.push_str(&tc.to_string());
                }
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
    } else if let Some(prompt) = &req.prompt {
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
    blocks
}

/// Appends the text of a message `content`: a string; an array of parts (text, image URLs so that
/// different images differ, other parts as JSON); nothing for null.
fn push_content(out: &mut String, content: &Json<'_>) {
    let v = match content {
        Json::Str(s) => return out.push_str(s),
        Json::Other(v) => v,
    };
    match v {
        Value::Null => {}
        Value::String(s) => out.push_str(s),
        Value::Array(parts) => {
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
        other => out.push_str(&other.to_string()),
    }
}

/// The parts of a chat/completions body the blocks are made of.
struct ChatBody<'a> {
    tools: Option<Value>,
    /// Anthropic's Messages API (`/v1/messages`): the system prompt, a string or text blocks,
    /// beside `messages` (which then holds no system message).
    system: Option<Json<'a>>,
    messages: Option<Messages<'a>>,
    prompt: Option<Value>,
}

/// `messages`: a list, or any other value (then the body is read as a completions body).
enum Messages<'a> {
    List(Vec<Message<'a>>),
    NotAList,
}

/// One message: an object (its other keys skipped), or any other value (an empty role).
enum Message<'a> {
    Object { role: Option<Json<'a>>, content: Option<Json<'a>>, tool_calls: Option<Value> },
    NotAnObject,
}

impl Message<'_> {
    fn role(&self) -> &str {
        match self {
            Message::Object { role: Some(Json::Str(r)), .. } => r,
            _ => "",
        }
    }
}

/// A JSON value whose strings are borrowed from the body when they need no unescaping; other
/// values (small: content parts, numbers) are kept as a [`Value`].
enum Json<'a> {
    Str(std::borrow::Cow<'a, str>),
    Other(Value),
}

mod body_de {
    //! Deserializers for [`super::ChatBody`]: visitors that keep only what the blocks need.
    use super::{ChatBody, Json, Message, Messages};
    use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
    use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use serde_json::Value;
    use std::borrow::Cow;
    use std::fmt;

    #[derive(serde::Deserialize)]
    #[serde(field_identifier, rename_all = "snake_case")]
    enum BodyField {
        Tools,
        System,
        Messages,
        Prompt,
        #[serde(other)]
        Other,
    }

    #[derive(serde::Deserialize)]
    #[serde(field_identifier, rename_all = "snake_case")]
    enum MessageField {
        Role,
        Content,
        ToolCalls,
        #[serde(other)]
        Other,
    }

    /// Consumes any value in a visitor callback, for the shapes that are read as "not this".
    macro_rules! skip_scalars {
        ($out:expr) => {
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok($out)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok($out)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok($out)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok($out)
            }
            fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
                Ok($out)
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok($out)
            }
        };
    }

    impl<'de> Deserialize<'de> for ChatBody<'de> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = ChatBody<'de>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                    let mut body =
                        ChatBody { tools: None, system: None, messages: None, prompt: None };
                    // A repeated key: the last one counts (as in a parsed JSON object).
                    while let Some(key) = map.next_key::<BodyField>()? {
                        match key {
                            BodyField::Tools => body.tools = map.next_value()?,
                            BodyField::System => body.system = map.next_value()?,
                            BodyField::Messages => body.messages = map.next_value()?,
                            BodyField::Prompt => body.prompt = map.next_value()?,
                            BodyField::Other => {
                                map.next_value::<IgnoredAny>()?;
                            }
                        }
                    }
                    Ok(body)
                }
            }
            d.deserialize_map(V)
        }
    }

    impl<'de> Deserialize<'de> for Messages<'de> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Messages<'de>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("any JSON value")
                }
                skip_scalars!(Messages::NotAList);
                fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                    let mut list = Vec::new();
                    while let Some(m) = seq.next_element()? {
                        list.push(m);
                    }
                    Ok(Messages::List(list))
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                    Ok(Messages::NotAList)
                }
            }
            d.deserialize_any(V)
        }
    }

    impl<'de> Deserialize<'de> for Message<'de> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Message<'de>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("any JSON value")
                }
                skip_scalars!(Message::NotAnObject);
                fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                    while seq.next_element::<IgnoredAny>()?.is_some() {}
                    Ok(Message::NotAnObject)
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                    let (mut role, mut content, mut tool_calls) = (None, None, None);
                    while let Some(key) = map.next_key::<MessageField>()? {
                        match key {
                            MessageField::Role => role = map.next_value()?,
                            MessageField::Content => content = map.next_value()?,
                            MessageField::ToolCalls => tool_calls = map.next_value()?,
                            MessageField::Other => {
                                map.next_value::<IgnoredAny>()?;
                            }
                        }
                    }
                    Ok(Message::Object { role, content, tool_calls })
                }
            }
            d.deserialize_any(V)
        }
    }

    impl<'de> Deserialize<'de> for Json<'de> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Json<'de>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("any JSON value")
                }
                fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
                    Ok(Json::Str(Cow::Borrowed(s)))
                }
                fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
                    Ok(Json::Str(Cow::Owned(s.to_owned())))
                }
                fn visit_string<E>(self, s: String) -> Result<Self::Value, E> {
                    Ok(Json::Str(Cow::Owned(s)))
                }
                fn visit_bool<E>(self, b: bool) -> Result<Self::Value, E> {
                    Ok(Json::Other(Value::Bool(b)))
                }
                fn visit_i64<E>(self, n: i64) -> Result<Self::Value, E> {
                    Ok(Json::Other(Value::from(n)))
                }
                fn visit_u64<E>(self, n: u64) -> Result<Self::Value, E> {
                    Ok(Json::Other(Value::from(n)))
                }
                fn visit_f64<E>(self, n: f64) -> Result<Self::Value, E> {
                    Ok(Json::Other(Value::from(n)))
                }
                fn visit_unit<E>(self) -> Result<Self::Value, E> {
                    Ok(Json::Other(Value::Null))
                }
                fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                    Value::deserialize(SeqAccessDeserializer::new(seq)).map(Json::Other)
                }
                fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                    Value::deserialize(MapAccessDeserializer::new(map)).map(Json::Other)
                }
            }
            d.deserialize_any(V)
        }
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
/// load (`hitLoadFactor`, `loadAware`), or a miss; a hit's prediction is checked against the engine's report.
/// A request without a prompt (`GET /v1/models`, an empty body, `messages: []`) had no prefix to
/// find: it is a least-request pick, counted as one, with no prediction to check.
fn routed(host: &mut dyn Host, pick: &PickResult) -> Routed {
    if !pick.had_prompt {
        let counter = Counter::LeastRequestRouted;
        return Routed { counter, decision: counter.label().to_string(), predicted_hit: None };
    }
    let counter = match (pick.matched > 0, pick.diverted) {
        (true, false) => Counter::PrefixHit,
        (true, true) => Counter::PrefixHitDiverted,
        (false, _) => Counter::PrefixMiss,
    };
    if counter == Counter::PrefixHit {
        host.increment_counter(Counter::PrefixMatchedBlocks, pick.matched);
    }
    if pick.holder_added {
        host.increment_counter(Counter::PrefixHolderAdded, 1);
    }
    Routed {
        counter,
        decision: format!("{}; blocks={}", counter.label(), pick.matched),
        predicted_hit: Some(counter == Counter::PrefixHit),
    }
}

/// What a diverted hit gives up for each chain length (`chain_len` values), in requests: the
/// cumulative bytes of the first blocks over `per_request` bytes, rounded down (empty when
/// `per_request` is 0).
fn divert_costs(block_bytes: &[usize], chain_len: usize, per_request: u32) -> Vec<u64> {
    if per_request == 0 {
        return Vec::new();
    }
    let mut total = 0u64;
    block_bytes
        .iter()
        .take(chain_len)
        .map(|b| {
            total = total.saturating_add(*b as u64);
            total / u64::from(per_request)
        })
        .collect()
}

/// The `prefix_cache` policy.
pub struct PrefixCache {
    picker: Picker,
    config: PrefixCacheConfig,
    /// `loadAware` with `loadLatencyWeight` or `overloadLatency` only: each pod's decode rate as
    /// this worker observes it.
    speed: Option<PodSpeed>,
    /// `loadAware` with `loadPrefillBytes` only: each pod's prefill backlog, from this worker and
    /// the others.
    prefill: Option<PrefillBacklog>,
}

impl PrefixCache {
    /// Creates the policy from its config.
    pub fn new(config: PrefixCacheConfig) -> Self {
        PrefixCache {
            picker: Picker::new(
                config.least_request.clone(),
                redis::PREFIX_CACHE_LUA.as_str(),
                "prefix_cache",
            ),
            // Timed only when the latency signal is used.
            speed: config
                .load_aware
                .as_ref()
                .is_some_and(|l| l.latency_weight > 0.0 || l.latency_ratio >= 1.0)
                .then(PodSpeed::default),
            prefill: config
                .load_aware
                .as_ref()
                .is_some_and(|l| l.prefill_bytes > 0)
                .then(PrefillBacklog::default),
            config,
        }
    }

    /// Publishes this worker's prefill backlog for the other workers (when it changed).
    fn publish_prefill_backlog(&mut self, host: &mut dyn Host) {
        if let Some(prefill) = self.prefill.as_mut() {
            prefill.publish(host, |s| self.picker.placement(s));
        }
    }

    /// Picks for a prompt whose chain values are `chain` and whose blocks are `block_bytes` long.
    fn pick(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        chain: &[String],
        block_bytes: &[usize],
    ) -> Decision {
        let prefill_backlog = match self.prefill.as_mut() {
            Some(prefill) => prefill.totals(host, |s| self.picker.placement(s)),
            None => Vec::new(),
        };
        let kind = PickKind::Prefix {
            chain: chain.to_vec(),
            ttl_s: self.config.redis_key_ttl_s,
            now_s: host.unix_seconds(),
            hit_load_factor: self.config.hit_load_factor,
            load: self.config.load_aware.as_ref().map(|config| {
                Box::new(LoadAware {
                    config: config.clone(),
                    args: None,
                    // Compared over the healthy pods by the picker, from the host list it reads.
                    decode_averages: self
                        .speed
                        .as_ref()
                        .map(|speed| speed.averages(host.now_nanos()))
                        .unwrap_or_default(),
                    prefill_backlog,
                    divert_costs: divert_costs(
                        block_bytes,
                        chain.len(),
                        config.divert_prefix_bytes,
                    ),
                })
            }),
        };
        self.picker.start(host, stream, kind)
    }
}

impl Policy for PrefixCache {
    fn on_request_headers(&mut self, host: &mut dyn Host, stream: &mut Stream) -> Decision {
        if !self.picker.has_group(host, stream) {
            return Decision::Passthrough;
        }
        if stream.bodiless {
            // Bodiless (GET...): no prompt, so a least-request pick now (Higress #3740: never wait).
            return self.pick(host, stream, &[], &[]);
        }
        Decision::NeedBody
    }

    fn on_request_body(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        body: &[u8],
    ) -> Decision {
        if body.trim_ascii().is_empty() {
            // An empty body (chunked with no data) is a request without a prompt, as one whose
            // headers ended it: a least-request pick.
            return self.pick(host, stream, &[], &[]);
        }
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
        let block_bytes: Vec<usize> = blocks.iter().map(String::len).collect();
        if let Some(prefill) = self.prefill.as_mut() {
            prefill.on_prompt(stream.id, block_bytes.iter().copied(), host.now_nanos());
        }
        self.pick(host, stream, &keys, &block_bytes)
    }

    fn on_response_headers(&mut self, host: &mut dyn Host, stream: &mut Stream) {
        let Some(speed) = self.speed.as_mut() else { return };
        // The pod that answers, whoever chose it (this plugin, or the gateway's own balancing).
        let pod = host
            .get_property(&["upstream", "address"])
            .and_then(|b| String::from_utf8(b).ok())
            .filter(|a| !a.is_empty());
        if let Some(pod) = pod {
            speed.on_response_headers(stream.id, pod, host.now_nanos());
        }
    }

    fn on_response_body(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        size: usize,
        end_of_stream: bool,
    ) {
        if let Some(speed) = self.speed.as_mut() {
            speed.on_response_body(stream.id, host.now_nanos(), size, end_of_stream);
        }
        // Only the first answer bytes change the backlog (and only then is it published again).
        if size > 0 && self.prefill.as_mut().is_some_and(|p| p.on_answered(stream.id)) {
            self.publish_prefill_backlog(host);
        }
        self.picker.on_response_body(host, stream, size, end_of_stream);
    }

    super::picker::delegate_to_picker!(
        routed,
        |p: &mut Self, host: &mut dyn Host, stream: u32| {
            // A stream that ends before its first answer byte (client gone during the prefill, an
            // upstream reset, a headers-only answer) leaves no prompt behind.
            if p.prefill.as_mut().is_some_and(|prefill| prefill.on_answered(stream)) {
                p.publish_prefill_backlog(host);
            }
        },
        // A pick's reply that placed its prompt on a pod changed the backlog (the replies of
        // releases and heartbeats did not).
        |p: &mut Self, host: &mut dyn Host, stream: Option<u32>| {
            let placed = stream.is_some_and(|s| {
                p.picker.placement(s).is_some()
                    && p.prefill.as_ref().is_some_and(|prefill| prefill.is_waiting(s))
            });
            if placed {
                p.publish_prefill_backlog(host);
            }
        }
    );
}

#[cfg(test)]
#[path = "prefix_cache_tests.rs"]
mod tests;
