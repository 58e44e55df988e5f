//! `prefix_cache`: send a conversation to the pod that already holds its prompt prefix in KV cache.
//!
//! Blocks: the text `role + ":" + content` of each message, concatenated, cut after each user
//! message and after the last message; the `tools` list (what a chat template renders first),
//! then a top-level `system` prompt (Anthropic's Messages API), open the first block. OpenAI's
//! Responses API (`instructions`, `input` items) is cut the same way; a request that continues a
//! response kept on the server (`previous_response_id`) starts with the block `response:<id>`,
//! which stands for the whole conversation up to that response (see [`super::response_id`]).
//! With `scopedKeys` (ours; on with `loadAware`), the request's `model`, `cache_salt` and
//! `extra_key` open the first block: an engine keeps each LoRA adapter's and each salt's KV cache
//! apart, so the same messages under another one share no key.
//! Each block is hashed with SHA-1; the chain is `key_i = key_{i-1} XOR sha1_i` (Higress's key
//! semantics), named by upper-case hex. The chain is computed here, not in Lua, and sent in one
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
use super::picker::{LoadAware, PickKind, PickResult, Picker, Pin, Routed};
use super::prefill::PrefillBacklog;
use super::response_id::{self, ResponseIdReader};
use super::{Decision, Policy, Stream};
use crate::config::{KeyRules, PrefixCacheConfig};
use crate::host::{Counter, Host, LogLevel};
use crate::redis;
use rustc_hash::FxHashMap;
use serde_json::Value;
use sha1::{Digest, Sha1};
use std::borrow::Cow;

/// At most this many chain keys per request: prefixes matter from the start, and the script call
/// must stay small. Later blocks are not indexed.
pub const MAX_BLOCKS: usize = 256;

/// Splits a request body into prefix blocks, as text. `None` when the body is not a JSON object
/// (the request then passes through). An object without `messages`/`prompt` gives no blocks.
/// `rules`: where blocks end besides user messages and the last message, and what scopes the keys.
/// The plugin itself routes by [`prompt_from_body`], which hashes the same text as it is read and
/// keeps none of it; this is the readable form of the same split, for tests and tools.
///
/// The body (up to `maxBodyBytes`) is not parsed into a JSON tree: only `tools`, `system`
/// (Anthropic's top-level system prompt), `messages` (each message's `role`, `content` and
/// `tool_calls`), `prompt`, and the Responses API's `instructions` and `input` (each item's
/// `role` and `content`, or `type`, `name`, `arguments` and `output`) are read, other keys are
/// skipped, and strings are kept as the body writes them until their text is needed.
///
/// A body that fails to parse only for its text (bytes that are not UTF-8, or a `\uD83D` escape
/// without its other half, as a JavaScript client that cut a string in the middle of an emoji
/// sends) is read again with each of those as U+FFFD, as the Go plugin's JSON reader does: the
/// conversation keeps its affinity.
pub fn blocks_from_body(body: &[u8], rules: KeyRules) -> Option<Vec<String>> {
    let mut text = BlockText::default();
    split_body(body, rules, &mut text)?;
    Some(text.blocks)
}

/// What routing needs of a prompt: its chain values ([`chain`] of its blocks) and each block's
/// length in bytes (all blocks, also those past [`MAX_BLOCKS`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Prompt {
    /// `key_i = key_{i-1} XOR sha1(block_i)`, upper-case hex, as [`chain`] gives them.
    pub keys: Vec<String>,
    /// Each block's length in bytes.
    pub block_bytes: Vec<usize>,
    /// What the request says of responses kept on the server (Responses API).
    pub stored: StoredResponse,
}

/// What a Responses API request says of responses kept on the server.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The stored response it continues (`previous_response_id`): its chain starts with that
    /// response's block, and it goes to the pod that made the response whatever that pod's load
    /// (another pod may not have the response at all).
    pub continues: Option<String>,
    /// Its own response is stored (`store` is not `false`): the response's id is recorded with the
    /// pod that answers.
    pub stores: bool,
}

/// The start of the block that stands for a stored response: `response:<id>`.
pub const RESPONSE_BLOCK_PREFIX: &[u8] = b"response:";

/// The chain value of a request that continues the stored response `id`: the first key of its
/// chain, which the plugin writes with the pod that made the response.
pub fn response_chain_value(id: &str) -> String {
    hex_upper(&sha1(&[RESPONSE_BLOCK_PREFIX, id.as_bytes()].concat()))
}

/// The prompt of a request body: the blocks of [`blocks_from_body`], each hashed while the body
/// is read. No block's text is built and no string is copied out of the body (each is unescaped
/// piece by piece into the hash): a long chat costs no second copy of its conversation.
pub fn prompt_from_body(body: &[u8], rules: KeyRules) -> Option<Prompt> {
    let mut hashes = BlockHashes::default();
    let stored = split_body(body, rules, &mut hashes)?;
    Some(Prompt { stored, ..hashes.into_prompt() })
}

/// Parses `body` (again with bad text replaced, see [`blocks_from_body`]) and feeds its blocks to
/// `sink`; `None` when it is not a JSON object.
fn split_body(body: &[u8], rules: KeyRules, sink: &mut dyn BlockSink) -> Option<StoredResponse> {
    match serde_json::from_slice::<ChatBody<'_>>(body) {
        Ok(req) => Some(blocks_of(&req, rules, sink)),
        Err(_) => {
            let repaired = replace_bad_text(body)?;
            let req: ChatBody<'_> = serde_json::from_slice(&repaired).ok()?;
            Some(blocks_of(&req, rules, sink))
        }
    }
}

/// Where a prompt's block text goes, piece by piece as the body is read.
trait BlockSink {
    /// Appends to the current block.
    fn push(&mut self, text: &[u8]);
    /// Ends the current block (empty or not).
    fn cut(&mut self);
    /// Whether the current block has no text yet.
    fn current_is_empty(&self) -> bool;
    /// How many blocks were cut so far.
    fn cut_count(&self) -> usize;
}

/// `std::io::Write` into a [`BlockSink`], for serde_json's writer.
struct SinkWriter<'a>(&'a mut dyn BlockSink);

impl std::io::Write for SinkWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.push(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The blocks as text ([`blocks_from_body`]).
#[derive(Default)]
struct BlockText {
    blocks: Vec<String>,
    current: Vec<u8>,
}

impl BlockSink for BlockText {
    fn push(&mut self, text: &[u8]) {
        self.current.extend_from_slice(text);
    }
    fn cut(&mut self) {
        // The pieces are whole UTF-8 strings and JSON text, so this never replaces anything.
        let block = String::from_utf8_lossy(&std::mem::take(&mut self.current)).into_owned();
        self.blocks.push(block);
    }
    fn current_is_empty(&self) -> bool {
        self.current.is_empty()
    }
    fn cut_count(&self) -> usize {
        self.blocks.len()
    }
}

/// The blocks hashed as they come ([`prompt_from_body`]): only the first [`MAX_BLOCKS`] are
/// hashed, every block is measured.
#[derive(Default)]
struct BlockHashes {
    digests: Vec<[u8; 20]>,
    block_bytes: Vec<usize>,
    current: Sha1,
    current_bytes: usize,
}

impl BlockHashes {
    fn into_prompt(self) -> Prompt {
        Prompt {
            keys: chain_of_digests(self.digests),
            block_bytes: self.block_bytes,
            stored: StoredResponse::default(),
        }
    }
}

impl BlockSink for BlockHashes {
    fn push(&mut self, text: &[u8]) {
        if self.digests.len() < MAX_BLOCKS {
            self.current.update(text);
        }
        self.current_bytes += text.len();
    }
    fn cut(&mut self) {
        if self.digests.len() < MAX_BLOCKS {
            self.digests.push(std::mem::take(&mut self.current).finalize().into());
        }
        self.block_bytes.push(std::mem::take(&mut self.current_bytes));
    }
    fn current_is_empty(&self) -> bool {
        self.current_bytes == 0
    }
    fn cut_count(&self) -> usize {
        self.block_bytes.len()
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

/// Feeds the blocks of a parsed body to `sink` (see [`blocks_from_body`]); says what a Responses
/// API body asks of stored responses.
fn blocks_of(req: &ChatBody<'_>, rules: KeyRules, sink: &mut dyn BlockSink) -> StoredResponse {
    let chat = matches!(&req.messages, Some(Messages::List(_)));
    let responses = !chat && (req.input.is_some() || req.previous_response_id.is_some());
    let mut stored = StoredResponse::default();
    if responses {
        stored.stores = !matches!(req.store, Some(Json::Other(Value::Bool(false))));
        // A stored response the request continues opens the chain, before anything the request
        // carries (an agent sends its `tools` again each round): its block is the key the
        // response's pod was written under.
        if let Some(Json::Str(id)) = &req.previous_response_id {
            if !id.0.is_empty() {
                sink.push(RESPONSE_BLOCK_PREFIX);
                id.push_to(sink);
                sink.cut();
                stored.continues = Some(id.text().into_owned());
            }
        }
    }
    // A continued response's block is the response's own already: only a new prompt is scoped.
    let scope = if stored.continues.is_some() { Vec::new() } else { scope_of(req, rules) };
    // Most prompts have no scope: they skip the wrapper's indirect call on every push.
    if scope.is_empty() {
        blocks_of_prompt(req, responses, rules, sink);
    } else {
        blocks_of_prompt(req, responses, rules, &mut Scoped { sink, scope });
    }
    stored
}

/// Feeds the blocks of what a body asks the model (its tools, then its conversation, Responses
/// input or completion prompt) to `sink`; `responses` says the body is a Responses API request.
fn blocks_of_prompt(
    req: &ChatBody<'_>,
    responses: bool,
    rules: KeyRules,
    sink: &mut dyn BlockSink,
) {
    if let Some(tools) = &req.tools {
        sink.push(b"tools:");
        push_json(sink, tools);
    }
    if let Some(Messages::List(messages)) = &req.messages {
        // A top-level system prompt (Anthropic) is rendered first, as a system message is: two
        // conversations that differ only in it share no cached prefix.
        blocks_of_conversation(req.system.as_ref(), messages, rules, sink);
    } else if responses {
        // The Responses API: `instructions` stand where a system message would, and a string
        // input is one user message.
        match req.input.as_ref().unwrap_or(&Input::Other) {
            Input::Items(items) => {
                blocks_of_conversation(req.instructions.as_ref(), items, rules, sink)
            }
            Input::Text(text) => {
                let user = Message::Object {
                    role: Some(Json::Str(JsonStr("user"))),
                    content: Some(Json::Str(*text)),
                    tool_calls: None,
                    item: None,
                };
                blocks_of_conversation(req.instructions.as_ref(), &[user], rules, sink)
            }
            Input::Other => {}
        }
    } else if let Some(prompt) = &req.prompt {
        // /v1/completions: one prompt is one block (a string, or an array of strings / token ids).
        match prompt {
            Json::Str(s) => s.push_to(sink),
            Json::Other(Value::Array(items)) => {
                for (i, it) in items.iter().enumerate() {
                    match it {
                        Value::String(s) => sink.push(s.as_bytes()),
                        other => {
                            // Token ids: separated, or [1,23] and [12,3] would share a block.
                            if i > 0 {
                                sink.push(b",");
                            }
                            push_json(sink, other);
                        }
                    }
                }
            }
            Json::Other(Value::Null) => {}
            Json::Other(other) => push_json(sink, other),
        }
        if !sink.current_is_empty() {
            sink.cut();
        }
    }
}

/// What keeps a prompt's keys apart from the same text's in another KV cache (see
/// [`KeyRules::scoped`]): `model`, `cache_salt` and `extra_key`, each as `name=text` and a
/// newline; empty when the keys are not scoped or the request has none of them.
fn scope_of(req: &ChatBody<'_>, rules: KeyRules) -> Vec<u8> {
    let mut scope = Vec::new();
    if !rules.scoped {
        return scope;
    }
    let parts = [
        ("model", req.model.as_ref()),
        ("cache_salt", req.cache_salt.as_ref()),
        ("extra_key", req.extra_key.as_ref()),
    ];
    for (name, value) in parts {
        let text = match value {
            None | Some(Json::Other(Value::Null)) => continue,
            Some(Json::Str(s)) => s.text(),
            // SGLang takes a list for a batch: the whole list then scopes the prompt.
            Some(Json::Other(other)) => Cow::Owned(other.to_string()),
        };
        if text.is_empty() {
            continue;
        }
        scope.extend_from_slice(name.as_bytes());
        scope.push(b'=');
        scope.extend_from_slice(text.as_bytes());
        scope.push(b'\n');
    }
    scope
}

/// A sink whose first text is preceded by the prompt's scope ([`scope_of`]): the first block, and
/// through the chain every key, is then the scope's own. A prompt without text gets no block.
struct Scoped<'a> {
    sink: &'a mut dyn BlockSink,
    /// Not yet pushed.
    scope: Vec<u8>,
}

impl BlockSink for Scoped<'_> {
    fn push(&mut self, text: &[u8]) {
        if !text.is_empty() && !self.scope.is_empty() {
            let scope = std::mem::take(&mut self.scope);
            self.sink.push(&scope);
        }
        self.sink.push(text);
    }
    fn cut(&mut self) {
        self.sink.cut();
    }
    fn current_is_empty(&self) -> bool {
        self.sink.current_is_empty()
    }
    fn cut_count(&self) -> usize {
        self.sink.cut_count()
    }
}

/// Feeds the blocks of a conversation: its system prompt (when given apart from the messages),
/// then each message or Responses item, cut as [`blocks_of`] says.
fn blocks_of_conversation(
    system: Option<&Json<'_>>,
    messages: &[Message<'_>],
    rules: KeyRules,
    sink: &mut dyn BlockSink,
) {
    if let Some(system) = system {
        sink.push(b"system:");
        push_content(sink, system);
        if rules.after_system_prompt && !messages.is_empty() {
            sink.cut();
        }
    }
    let last = messages.len().saturating_sub(1);
    let is_system = |m: &Message<'_>| matches!(&*m.role(), "system" | "developer");
    let is_tool_result = |m: &Message<'_>| is_tool_result_role(&m.role());
    let mut leading_system = true;
    for (i, m) in messages.iter().enumerate() {
        let role = m.role();
        let role = &*role;
        sink.push(role.as_bytes());
        sink.push(b":");
        if let Message::Object { content, tool_calls, item, .. } = m {
            if let Some(content) = content {
                push_content(sink, content);
            }
            if let Some(tc) = tool_calls {
                push_json(sink, tc);
            }
            // A Responses item other than a message: its call or its call's output.
            if let Some(item) = item {
                for field in [&item.name, &item.arguments, &item.output].into_iter().flatten() {
                    push_content(sink, field);
                }
            }
        }
        // End of the leading system run: the next message is the first non-system one.
        leading_system &= matches!(role, "system" | "developer");
        let system_cut = rules.after_system_prompt
            && leading_system
            && sink.cut_count() == 0
            && messages.get(i + 1).is_some_and(|n| !is_system(n));
        // End of a run of tool results (parallel calls answer in several messages): what an
        // agent appends at each step, as a chat appends a user message.
        let tool_results_cut = rules.after_tool_results
            && is_tool_result_role(role)
            && !messages.get(i + 1).is_some_and(is_tool_result);
        if role == "user" || i == last || system_cut || tool_results_cut {
            sink.cut();
        }
    }
}

/// A tool's answer: a chat `tool` (or legacy `function`) message, or a Responses
/// `function_call_output` (or another `*_call_output` item).
fn is_tool_result_role(role: &str) -> bool {
    matches!(role, "tool" | "function") || role.ends_with("_call_output")
}

/// Appends `value` as compact JSON (as `Value::to_string` gives it), without building the string.
fn push_json(sink: &mut dyn BlockSink, value: &Value) {
    // Writing into a sink cannot fail; a serializer error could only shorten the block.
    let _ = serde_json::to_writer(SinkWriter(sink), value);
}

/// Appends the text of a message `content`: a string; an array of parts (text, image URLs so that
/// different images differ, other parts as JSON); nothing for null.
fn push_content(sink: &mut dyn BlockSink, content: &Json<'_>) {
    let v = match content {
        Json::Str(s) => return s.push_to(sink),
        Json::Other(v) => v,
    };
    match v {
        Value::Null => {}
        Value::Array(parts) => {
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("text" | "input_text" | "output_text") => {
                        sink.push(p.get("text").and_then(Value::as_str).unwrap_or("").as_bytes())
                    }
                    Some("image_url") => {
                        let url = p
                            .get("image_url")
                            .and_then(|u| u.get("url").or(Some(u)))
                            .and_then(Value::as_str)
                            .unwrap_or("");
                        sink.push(b"<image:");
                        sink.push(url.as_bytes());
                        sink.push(b">");
                    }
                    _ => match p {
                        Value::String(s) => sink.push(s.as_bytes()),
                        other => push_json(sink, other),
                    },
                }
            }
        }
        other => push_json(sink, other),
    }
}

/// The parts of a chat/completions body the blocks are made of.
struct ChatBody<'a> {
    tools: Option<Value>,
    /// Anthropic's Messages API (`/v1/messages`): the system prompt, a string or text blocks,
    /// beside `messages` (which then holds no system message).
    system: Option<Json<'a>>,
    messages: Option<Messages<'a>>,
    prompt: Option<Json<'a>>,
    /// OpenAI's Responses API (`/v1/responses`): the system prompt, and the conversation.
    instructions: Option<Json<'a>>,
    input: Option<Input<'a>>,
    /// The Responses API: the stored response this request continues, and whether its own
    /// response is stored (`false` says not; absent means it is).
    previous_response_id: Option<Json<'a>>,
    store: Option<Json<'a>>,
    /// What scopes the keys ([`scope_of`]): the model or LoRA adapter, and the engines' cache
    /// isolation keys (vLLM's and SGLang's `cache_salt`, SGLang's `extra_key`).
    model: Option<Json<'a>>,
    cache_salt: Option<Json<'a>>,
    extra_key: Option<Json<'a>>,
}

/// A Responses API `input`: a string (one user message), a list of items, or any other value.
enum Input<'a> {
    Text(JsonStr<'a>),
    Items(Vec<Message<'a>>),
    Other,
}

/// `messages`: a list, or any other value (then the body is read as a completions body).
enum Messages<'a> {
    List(Vec<Message<'a>>),
    NotAList,
}

/// One message (or Responses item): an object (its other keys skipped), or any other value (an
/// empty role).
enum Message<'a> {
    Object {
        role: Option<Json<'a>>,
        content: Option<Json<'a>>,
        tool_calls: Option<Value>,
        /// For an object without a `role` only (boxed: chat messages carry none).
        item: Option<Box<ItemFields<'a>>>,
    },
    NotAnObject,
}

/// What a Responses item other than a message holds instead of `role` and `content`: its `type`
/// (`function_call`, `function_call_output`, ...), and the call's `name` and `arguments` or its
/// `output`. Kept only for an object without a `role` (a chat message's `name` is not hashed).
#[derive(Default)]
struct ItemFields<'a> {
    kind: Option<Json<'a>>,
    name: Option<Json<'a>>,
    arguments: Option<Json<'a>>,
    output: Option<Json<'a>>,
}

impl Message<'_> {
    /// The role; a Responses item without one goes by its `type`.
    fn role(&self) -> Cow<'_, str> {
        match self {
            Message::Object { role: Some(Json::Str(r)), .. } => r.text(),
            Message::Object { role: None, item: Some(item), .. } => match &item.kind {
                Some(Json::Str(t)) => t.text(),
                _ => Cow::Borrowed(""),
            },
            _ => Cow::Borrowed(""),
        }
    }
}

/// A JSON value read for its text. A string is kept as written in the body, escapes and all, and
/// unescaped only as its text is pushed into a block, piece by piece: a long message is never
/// copied, nor unescaped into a buffer of its size. Other values (small: content parts, numbers)
/// are parsed.
enum Json<'a> {
    Str(JsonStr<'a>),
    Other(Value),
}

/// The contents of a JSON string as the body has them, between the quotes (serde_json checked it:
/// valid UTF-8, well-formed escapes).
#[derive(Clone, Copy)]
struct JsonStr<'a>(&'a str);

impl<'a> JsonStr<'a> {
    /// Feeds the string's text to `sink`.
    fn push_to(self, sink: &mut dyn BlockSink) {
        unescape(self.0, &mut |piece| sink.push(piece.as_bytes()));
    }

    /// The string's text: borrowed when it has no escapes.
    fn text(self) -> Cow<'a, str> {
        if !self.0.contains('\\') {
            return Cow::Borrowed(self.0);
        }
        let mut text = String::with_capacity(self.0.len());
        unescape(self.0, &mut |piece| text.push_str(piece));
        Cow::Owned(text)
    }
}

/// Calls `out` with the text of the JSON string contents `raw`: each run without escapes as a
/// slice of `raw`, each escape as its character. Half of a surrogate pair (`\uD83D` alone) is
/// U+FFFD, as the Go plugin's JSON reader reads it and as [`replace_bad_text`] writes it.
/// Hand-written: serde_json unescapes only into a buffer of the whole string.
fn unescape(raw: &str, out: &mut dyn FnMut(&str)) {
    let mut rest = raw;
    while let Some(at) = rest.find('\\') {
        let (run, escape) = rest.split_at_checked(at).unwrap_or((rest, ""));
        if !run.is_empty() {
            out(run);
        }
        let mut chars = escape.chars();
        chars.next(); // the backslash
        let simple = match chars.next() {
            Some('n') => Some('\n'),
            Some('t') => Some('\t'),
            Some('r') => Some('\r'),
            Some('b') => Some('\u{8}'),
            Some('f') => Some('\u{c}'),
            Some(c @ ('"' | '\\' | '/')) => Some(c),
            _ => None,
        };
        let (ch, used) = match simple {
            Some(c) => (c, 2),
            None => match hex_unit(escape) {
                Some(hi @ 0xD800..=0xDBFF) => match escape.get(6..).and_then(hex_unit) {
                    Some(lo @ 0xDC00..=0xDFFF) => {
                        let code =
                            0x10000 + ((u32::from(hi) - 0xD800) << 10) + (u32::from(lo) - 0xDC00);
                        (char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER), 12)
                    }
                    _ => (char::REPLACEMENT_CHARACTER, 6),
                },
                Some(unit) => {
                    (char::from_u32(u32::from(unit)).unwrap_or(char::REPLACEMENT_CHARACTER), 6)
                }
                // Not an escape serde_json lets through: kept as written.
                None => {
                    let (kept, after) = escape.split_at_checked(1).unwrap_or((escape, ""));
                    out(kept);
                    rest = after;
                    continue;
                }
            },
        };
        out(ch.encode_utf8(&mut [0; 4]));
        rest = escape.get(used..).unwrap_or("");
    }
    if !rest.is_empty() {
        out(rest);
    }
}

/// The UTF-16 unit of the `\uXXXX` escape `s` starts with.
fn hex_unit(s: &str) -> Option<u16> {
    let hex = s.strip_prefix("\\u")?.get(..4)?;
    u16::from_str_radix(hex, 16).ok().filter(|_| hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

mod body_de {
    //! Deserializers for [`super::ChatBody`]: visitors that keep only what the blocks need.
    use super::{ChatBody, Input, ItemFields, Json, JsonStr, Message, Messages};
    use serde::de::{Deserialize, Deserializer, Error, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use serde_json::value::RawValue;
    use std::fmt;

    #[derive(serde::Deserialize)]
    #[serde(field_identifier, rename_all = "snake_case")]
    enum BodyField {
        Tools,
        System,
        Messages,
        Prompt,
        Instructions,
        Input,
        PreviousResponseId,
        Store,
        Model,
        CacheSalt,
        ExtraKey,
        #[serde(other)]
        Other,
    }

    #[derive(serde::Deserialize)]
    #[serde(field_identifier, rename_all = "snake_case")]
    enum MessageField {
        Role,
        Content,
        ToolCalls,
        Type,
        Name,
        Arguments,
        Output,
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
                    let mut body = ChatBody {
                        tools: None,
                        system: None,
                        messages: None,
                        prompt: None,
                        instructions: None,
                        input: None,
                        previous_response_id: None,
                        store: None,
                        model: None,
                        cache_salt: None,
                        extra_key: None,
                    };
                    // A repeated key: the last one counts (as in a parsed JSON object).
                    while let Some(key) = map.next_key::<BodyField>()? {
                        match key {
                            BodyField::Tools => body.tools = map.next_value()?,
                            BodyField::System => body.system = map.next_value()?,
                            BodyField::Messages => body.messages = map.next_value()?,
                            BodyField::Prompt => body.prompt = map.next_value()?,
                            BodyField::Instructions => body.instructions = map.next_value()?,
                            BodyField::Input => body.input = map.next_value()?,
                            BodyField::PreviousResponseId => {
                                body.previous_response_id = map.next_value()?
                            }
                            BodyField::Store => body.store = map.next_value()?,
                            BodyField::Model => body.model = map.next_value()?,
                            BodyField::CacheSalt => body.cache_salt = map.next_value()?,
                            BodyField::ExtraKey => body.extra_key = map.next_value()?,
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
                    let mut item = ItemFields::default();
                    while let Some(key) = map.next_key::<MessageField>()? {
                        match key {
                            MessageField::Role => role = map.next_value()?,
                            MessageField::Content => content = map.next_value()?,
                            MessageField::ToolCalls => tool_calls = map.next_value()?,
                            MessageField::Type => item.kind = map.next_value()?,
                            MessageField::Name => item.name = map.next_value()?,
                            MessageField::Arguments => item.arguments = map.next_value()?,
                            MessageField::Output => item.output = map.next_value()?,
                            MessageField::Other => {
                                map.next_value::<IgnoredAny>()?;
                            }
                        }
                    }
                    // A message's `type` ("message") and `name` are not part of it.
                    let item = role.is_none().then(|| Box::new(item));
                    Ok(Message::Object { role, content, tool_calls, item })
                }
            }
            d.deserialize_any(V)
        }
    }

    impl<'de> Deserialize<'de> for Input<'de> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            // As the body has it (checked, nothing copied); a list is then read item by item.
            let raw = <&'de RawValue>::deserialize(d)?.get();
            if let Some(contents) = raw.strip_prefix('"').and_then(|r| r.strip_suffix('"')) {
                return Ok(Input::Text(JsonStr(contents)));
            }
            match serde_json::from_str::<Messages<'de>>(raw).map_err(D::Error::custom)? {
                Messages::List(items) => Ok(Input::Items(items)),
                Messages::NotAList => Ok(Input::Other),
            }
        }
    }

    impl<'de> Deserialize<'de> for Json<'de> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            // The value as the body has it (serde_json checks it, skipping it without unescaping
            // or copying anything).
            let raw = <&'de RawValue>::deserialize(d)?.get();
            match raw.strip_prefix('"').and_then(|r| r.strip_suffix('"')) {
                Some(contents) => Ok(Json::Str(JsonStr(contents))),
                None => serde_json::from_str(raw).map(Json::Other).map_err(D::Error::custom),
            }
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
    chain_of_digests(blocks.iter().take(MAX_BLOCKS).map(|b| sha1(b.as_bytes())))
}

/// [`chain`] from the blocks' SHA-1 digests.
fn chain_of_digests(digests: impl IntoIterator<Item = [u8; 20]>) -> Vec<String> {
    let mut acc = [0u8; 20];
    let mut out = Vec::new();
    for h in digests.into_iter().take(MAX_BLOCKS) {
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
    /// Streams whose stored response's id is read from the reply, to record its pod.
    response_ids: FxHashMap<u32, ResponseIdReader>,
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
            response_ids: FxHashMap::default(),
        }
    }

    /// A reply chunk of a stream whose stored response's id is wanted: once the id is found, its
    /// pod is written as the holder of the block that stands for it, with the prefix keys' TTL.
    fn read_response_id(
        &mut self,
        host: &mut dyn Host,
        stream: &Stream,
        size: usize,
        end_of_stream: bool,
    ) {
        let Some(reader) = self.response_ids.get_mut(&stream.id) else { return };
        let found = reader.on_chunk(host, size);
        if found.is_some() || end_of_stream || reader.gave_up() {
            self.response_ids.remove(&stream.id);
        }
        let Some((pod, id)) = found else { return };
        let key = redis::prefix_key(&stream.route, &stream.cluster, &response_chain_value(&id));
        let value = format!("{pod}@{}", host.unix_seconds());
        self.picker.write_key(host, &key, &value, self.config.redis_key_ttl_s);
        response_id::remember(host, &id, &pod);
        host.increment_counter(Counter::PrefixResponseRecorded, 1);
    }

    /// Publishes this worker's prefill backlog for the other workers (when it changed).
    fn publish_prefill_backlog(&mut self, host: &mut dyn Host) {
        if let Some(prefill) = self.prefill.as_mut() {
            prefill.publish(host, |s| self.picker.placement(s));
        }
    }

    /// Picks for a prompt whose chain values are `chain` and whose blocks are `block_bytes` long.
    /// `pin` (a request that continues a stored response): the pod holding the prefix is taken
    /// whatever its load, so the pick goes without `hitLoadFactor` and `loadAware` (and
    /// `maxRequestCount` is off for `prefix_cache`, as in Go).
    fn pick(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        chain: &[String],
        block_bytes: &[usize],
        pin: Option<Pin>,
    ) -> Decision {
        let pinned = pin.is_some();
        let prefill_backlog = match self.prefill.as_mut() {
            Some(prefill) => prefill.totals(host, |s| self.picker.placement(s)),
            None => Vec::new(),
        };
        let kind = PickKind::Prefix {
            chain: chain.to_vec(),
            ttl_s: self.config.redis_key_ttl_s,
            now_s: host.unix_seconds(),
            hit_load_factor: self.config.hit_load_factor,
            load: self.config.load_aware.as_ref().filter(|_| !pinned).map(|config| {
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
            pin,
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
            return self.pick(host, stream, &[], &[], None);
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
            return self.pick(host, stream, &[], &[], None);
        }
        let Some(prompt) = prompt_from_body(body, self.config.key_rules) else {
            host.log(
                LogLevel::Info,
                "prefix_cache: request body is not a JSON object; using normal balancing",
            );
            host.increment_counter(Counter::FallbackBadBody, 1);
            stream.decision = Some(Counter::FallbackBadBody.label().to_string());
            return Decision::Passthrough;
        };
        if let Some(prefill) = self.prefill.as_mut() {
            prefill.on_prompt(stream.id, prompt.block_bytes.iter().copied(), host.now_nanos());
        }
        if prompt.stored.stores {
            self.response_ids.insert(stream.id, ResponseIdReader::default());
        }
        let pin = prompt
            .stored
            .continues
            .as_deref()
            .map(|id| Pin { fallback_pod: response_id::recall(host, id) });
        self.pick(host, stream, &prompt.keys, &prompt.block_bytes, pin)
    }

    fn on_response_headers(&mut self, host: &mut dyn Host, stream: &mut Stream) {
        if let Some(reader) = self.response_ids.get_mut(&stream.id) {
            if !reader.on_headers(host) {
                self.response_ids.remove(&stream.id);
            }
        }
        let Some(speed) = self.speed.as_mut() else { return };
        // The pod that answers, whoever chose it (this plugin, or the gateway's own balancing).
        if let Some(pod) = super::upstream_address(host) {
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
        self.read_response_id(host, stream, size, end_of_stream);
        // Only the first answer bytes change the backlog (and only then is it published again).
        if size > 0 && self.prefill.as_mut().is_some_and(|p| p.on_answered(stream.id)) {
            self.publish_prefill_backlog(host);
        }
        self.picker.on_response_body(host, stream, size, end_of_stream);
    }

    super::picker::delegate_to_picker!(
        routed,
        |p: &mut Self, host: &mut dyn Host, stream: u32| {
            p.response_ids.remove(&stream);
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
