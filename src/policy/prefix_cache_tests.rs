//! `prefix_cache`: blocks, hashing, chaining, and the request flow against the fake host.

use super::*;
use crate::filter::Filter;
use crate::host::fake::FakeHost;
use crate::host::RedisReply;
use crate::redis::{inflight_key, PREFIX_CACHE_LUA};
use crate::testutil::*;
use crate::types::{DataAction, HeaderAction};

const CLUSTER: &str = "outbound|8000||llm.static";
const CHAT: &str = r#"{"model":"m","messages":[
  {"role":"system","content":"You are helpful."},
  {"role":"user","content":"Hi"},
  {"role":"assistant","content":"Hello!"},
  {"role":"user","content":"What is 2+2?"}]}"#;

/// The cuts with `splitSystemPrompt` as given and the others at their defaults.
fn cuts(after_system_prompt: bool) -> KeyRules {
    KeyRules { after_system_prompt, ..KeyRules::default() }
}

fn cfg(extra: &str) -> String {
    format!(
        r#"{{"lb_policy":"prefix_cache","lb_config":{{"serviceFQDN":"redis.static","servicePort":6379,"redisKeyTTL":600{extra}}}}}"#
    )
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

#[test]
fn sha1_matches_published_vectors_in_upper_case_hex() {
    // FIPS 180-2 / RFC 3174 vectors.
    assert_eq!(hex_upper(&sha1(b"abc")), "A9993E364706816ABA3E25717850C26C9CD0D89D");
    assert_eq!(hex_upper(&sha1(b"")), "DA39A3EE5E6B4B0D3255BFEF95601890AFD80709");
    assert_eq!(
        hex_upper(&sha1(b"The quick brown fox jumps over the lazy dog")),
        "2FD4E1C67A2D28FCED849EE1BB76E7391B93EB12"
    );
}

#[test]
fn blocks_cut_after_each_user_message_and_the_last_message() {
    let b = blocks_from_body(CHAT.as_bytes(), cuts(false)).unwrap();
    assert_eq!(b, vec!["system:You are helpful.user:Hi", "assistant:Hello!user:What is 2+2?"]);
    let ends_with_assistant =
        r#"{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}]}"#;
    assert_eq!(
        blocks_from_body(ends_with_assistant.as_bytes(), cuts(false)).unwrap(),
        vec!["user:a", "assistant:b"]
    );
}

/// Text the strict JSON reader refuses, as clients do send it: a `\uD83D` escape cut from its other
/// half (a JavaScript string sliced in the middle of an emoji), bytes that are not UTF-8. The
/// body is read with each as U+FFFD (as the Go plugin's reader does), so the conversation keeps its
/// prefix and its pod, instead of normal balancing.
#[test]
fn broken_text_in_a_message_is_read_as_replacement_characters() {
    let with = |text: &str| {
        format!(
            r#"{{"messages":[{{"role":"system","content":"s"}},{{"role":"user","content":"{text}"}}]}}"#
        )
    };
    let expected = blocks_from_body(with(r"cut \ufffd here").as_bytes(), cuts(false)).unwrap();
    assert_eq!(
        blocks_from_body(with(r"cut \ud83d here").as_bytes(), cuts(false)).unwrap(),
        expected
    );
    assert_eq!(
        blocks_from_body(with(r"cut \ude00 here").as_bytes(), cuts(false)).unwrap(),
        expected
    );
    let mut raw = with("cut X here").into_bytes();
    let at = raw.iter().position(|&b| b == b'X').unwrap();
    raw[at] = 0xff;
    assert_eq!(blocks_from_body(&raw, cuts(false)).unwrap(), expected);
    // A whole pair, and an escaped backslash followed by `ud83d`, are text as they are.
    let pair = blocks_from_body(with(r"\ud83d\ude00").as_bytes(), cuts(false)).unwrap();
    assert!(pair.last().unwrap().ends_with("user:\u{1f600}"), "{pair:?}");
    let literal = blocks_from_body(with(r"\\ud83d \ud83d").as_bytes(), cuts(false)).unwrap();
    assert!(literal.last().unwrap().ends_with("user:\\ud83d \u{fffd}"), "{literal:?}");
    // Still not JSON: normal balancing.
    assert_eq!(blocks_from_body(b"{\"messages\": [\xff", cuts(false)), None);
}

#[test]
fn chain_is_xor_of_block_sha1s() {
    // Expected values computed outside the code under test (Python hashlib).
    let blocks = blocks_from_body(CHAT.as_bytes(), cuts(false)).unwrap();
    let c = chain(&blocks);
    assert_eq!(
        c,
        vec![
            "DC6E080F28569CE3D07E77FC3A00DF1CCD9DA20E",
            "62EE2EB1856F804718FE25AA35DBBAEB27D78035"
        ]
    );
    // And the XOR relation itself, from the two SHA-1 vectors above.
    let c = chain(&["abc".to_string(), String::new()]);
    let a = unhex("A9993E364706816ABA3E25717850C26C9CD0D89D");
    let e = unhex("DA39A3EE5E6B4B0D3255BFEF95601890AFD80709");
    let x: Vec<u8> = a.iter().zip(e.iter()).map(|(p, q)| p ^ q).collect();
    assert_eq!(c[0], "A9993E364706816ABA3E25717850C26C9CD0D89D");
    assert_eq!(c[1], hex_upper(&x));
}

#[test]
fn a_growing_conversation_extends_the_same_chain() {
    let short = r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"Q1"}]}"#;
    let long = r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"Q1"},{"role":"assistant","content":"A1"},{"role":"user","content":"Q2"}]}"#;
    let a = chain(&blocks_from_body(short.as_bytes(), cuts(false)).unwrap());
    let b = chain(&blocks_from_body(long.as_bytes(), cuts(false)).unwrap());
    assert_eq!(a.len(), 1);
    assert_eq!(b.len(), 2);
    assert_eq!(a[0], b[0]);
}

#[test]
fn never_produces_the_all_zero_key() {
    let c = chain(&["same".to_string(), "same".to_string(), "other".to_string()]);
    assert_eq!(c.len(), 1, "the chain stops before the zero key");
    assert!(c.iter().all(|k| k != &"0".repeat(40)));
}

/// What [`prompt_from_body`] routes by: the chain of the text blocks and their lengths, with no
/// block's text built (the stored-response flags are taken from it: only the chain is compared).
fn prompt_of_text(body: &[u8], rules: KeyRules) -> Option<Prompt> {
    let stored = prompt_from_body(body, rules).map(|p| p.stored).unwrap_or_default();
    blocks_from_body(body, rules).map(|blocks| Prompt {
        keys: chain(&blocks),
        block_bytes: blocks.iter().map(String::len).collect(),
        stored,
    })
}

#[test]
fn the_hashed_prompt_is_the_chain_of_the_text_blocks() {
    let tools = r#"{"tools":[{"type":"function","function":{"name":"f","parameters":{"a":[1,2.5,null]}}}],"system":[{"type":"text","text":"S\n\u00e9"}],
      "messages":[{"role":"system","content":"S"},{"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"http://x/a.png"}},{"type":"input_audio","x":1}]},
      {"role":"assistant","content":null,"tool_calls":[{"id":"c1","function":{"name":"g","arguments":"{\"q\":1}"}}]},{"role":"tool","content":"ok"},{"role":"user","content":"again"}]}"#;
    let bodies: [&[u8]; 8] = [
        CHAT.as_bytes(),
        tools.as_bytes(),
        br#"{"previous_response_id":"resp_\u0031","input":[{"role":"user","content":"go"}]}"#,
        br#"{"prompt":[1,23,"x",{"a":1}]}"#,
        br#"{"prompt":"Once upon"}"#,
        br#"{"input":"x"}"#,
        b"not json",
        b"{\"messages\":[{\"role\":\"user\",\"content\":\"caf\xe9 \\ud83d\"}]}",
    ];
    for body in bodies {
        for rules in every_key_rules() {
            let text = prompt_of_text(body, rules);
            assert_eq!(prompt_from_body(body, rules), text, "{}", String::from_utf8_lossy(body));
        }
    }
    assert_eq!(prompt_from_body(b"not json", cuts(false)), None);
    assert!(!prompt_of_text(tools.as_bytes(), cuts(true)).unwrap().keys.is_empty());
}

fn unescaped(raw: &str) -> String {
    let mut text = String::new();
    unescape(raw, &mut |piece| text.push_str(piece));
    text
}

#[test]
fn escapes_are_undone_as_json_reads_them_and_half_surrogates_are_replacement_characters() {
    assert_eq!(unescaped(r#"plain"#), "plain");
    assert_eq!(unescaped(r#"a\nb\t\"q\" \\ \/ \b\f\r"#), "a\nb\t\"q\" \\ / \u{8}\u{c}\r");
    assert_eq!(unescaped(r#"caf\u00e9 \u00E9"#), "café é");
    assert_eq!(unescaped(r#"\uD83D\uDE00!"#), "😀!");
    assert_eq!(unescaped(r#"a\uD83Db"#), "a\u{FFFD}b", "a high half alone");
    assert_eq!(unescaped(r#"\uDE00"#), "\u{FFFD}", "a low half alone");
    assert_eq!(unescaped(r#"\uD83D\uD83D\uDE00"#), "\u{FFFD}😀", "two highs, then a low");
    assert_eq!(unescaped(r#"\uD83D\n"#), "\u{FFFD}\n");
    assert_eq!(unescaped(r#"end\uD83D"#), "end\u{FFFD}");
    // A message whose role is escaped is still a user message.
    let body = br#"{"messages":[{"role":"us\u0065r","content":"x\ny"},{"role":"assistant","content":"z"}]}"#;
    assert_eq!(blocks_from_body(body, cuts(false)).unwrap(), vec!["user:x\ny", "assistant:z"]);
}

// proptest is a native-only dev-dependency (these tests also run compiled to wasm32-wasip1).
#[cfg(not(target_arch = "wasm32"))]
proptest::proptest! {
    /// Any string, written out by serde_json (short escapes) or with every character as a `\u`
    /// escape (surrogate pairs past U+FFFF), reads back as itself.
    #[test]
    fn any_string_reads_back_through_its_escapes(s in ".*", every_char_escaped in proptest::bool::ANY) {
        let raw = if every_char_escaped {
            s.encode_utf16().map(|u| format!("\\u{u:04x}")).collect::<String>()
        } else {
            let quoted = serde_json::to_string(&s).unwrap();
            quoted[1..quoted.len() - 1].to_string()
        };
        proptest::prop_assert_eq!(unescaped(&raw), s.clone());
        let body = format!(r#"{{"messages":[{{"role":"user","content":"{raw}"}}]}}"#);
        proptest::prop_assert_eq!(blocks_from_body(body.as_bytes(), cuts(false)), Some(vec![format!("user:{s}")]));
    }
}

#[test]
fn past_max_blocks_the_prompt_keeps_measuring_blocks_it_no_longer_hashes() {
    let turns: Vec<String> = (0..MAX_BLOCKS + 10)
        .map(|i| format!(r#"{{"role":"user","content":"turn {i}"}}"#))
        .collect();
    let body = format!(r#"{{"messages":[{}]}}"#, turns.join(","));
    let prompt = prompt_from_body(body.as_bytes(), cuts(false)).unwrap();
    assert_eq!(prompt.keys.len(), MAX_BLOCKS);
    assert_eq!(prompt.block_bytes.len(), MAX_BLOCKS + 10, "every block counts for its prefill");
    assert_eq!(prompt.block_bytes.last(), Some(&"user:turn 265".len()));
    assert_eq!(Some(prompt), prompt_of_text(body.as_bytes(), cuts(false)));
}

#[test]
fn content_parts_images_tool_calls_tools_and_prompt() {
    let img = |url: &str| {
        format!(
            r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":"what is this?"}},{{"type":"image_url","image_url":{{"url":"{url}"}}}}]}}]}}"#
        )
    };
    let a = blocks_from_body(img("http://x/cat.png").as_bytes(), cuts(false)).unwrap();
    let b = blocks_from_body(img("http://x/dog.png").as_bytes(), cuts(false)).unwrap();
    assert_ne!(a, b, "different images make different blocks");
    assert!(a[0].starts_with("user:what is this?"));

    let tool = r#"{"messages":[{"role":"user","content":"weather?"},
      {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"get_weather","arguments":"{}"}}]},
      {"role":"tool","tool_call_id":"c1","content":"sunny"}]}"#;
    let t = blocks_from_body(tool.as_bytes(), cuts(false)).unwrap();
    assert_eq!(t.len(), 2);
    assert!(t[1].contains("get_weather"), "tool_calls are part of the prefix: {}", t[1]);
    assert!(t[1].contains("tool:sunny"));

    let with_tools = r#"{"tools":[{"type":"function","function":{"name":"f"}}],"messages":[{"role":"user","content":"x"}]}"#;
    let w = blocks_from_body(with_tools.as_bytes(), cuts(false)).unwrap();
    assert!(w[0].starts_with("tools:") && w[0].contains("\"f\"") && w[0].ends_with("user:x"));

    assert_eq!(
        blocks_from_body(br#"{"prompt":"Once upon"}"#, cuts(false)).unwrap(),
        vec!["Once upon"]
    );
    assert_eq!(blocks_from_body(br#"{"prompt":["a","b"]}"#, cuts(false)).unwrap(), vec!["ab"]);
    assert_eq!(blocks_from_body(br#"{"prompt":[1,2,3]}"#, cuts(false)).unwrap(), vec!["1,2,3"]);
    assert_ne!(
        blocks_from_body(br#"{"prompt":[1,23]}"#, cuts(false)),
        blocks_from_body(br#"{"prompt":[12,3]}"#, cuts(false)),
        "different token-id prompts must not share a block"
    );
    assert_eq!(blocks_from_body(br#"{"text":"x"}"#, cuts(false)).unwrap(), Vec::<String>::new());
    assert_eq!(blocks_from_body(b"not json", cuts(false)), None);
    assert_eq!(blocks_from_body(b"[1,2]", cuts(false)), None);
}

#[test]
fn an_anthropic_system_prompt_opens_the_first_block() {
    // /v1/messages: the system prompt is a top-level string or list of text blocks, rendered
    // before the messages. Two conversations that differ only in it share no cached prefix.
    let body = |system: &str| {
        format!(
            r#"{{"model":"m","system":{system},"messages":[{{"role":"user","content":"hi"}},{{"role":"assistant","content":"yo"}},{{"role":"user","content":"more"}}],"max_tokens":5}}"#
        )
    };
    let pirate = blocks_from_body(body(r#""You are a pirate""#).as_bytes(), cuts(false)).unwrap();
    let lawyer = blocks_from_body(body(r#""You are a lawyer""#).as_bytes(), cuts(false)).unwrap();
    assert_eq!(pirate, vec!["system:You are a pirateuser:hi", "assistant:youser:more"]);
    assert_ne!(chain(&pirate)[0], chain(&lawyer)[0]);
    let as_blocks = blocks_from_body(
        body(r#"[{"type":"text","text":"You are a pirate","cache_control":{"type":"ephemeral"}}]"#)
            .as_bytes(),
        cuts(false),
    )
    .unwrap();
    assert_eq!(as_blocks, pirate, "text blocks read as the same text");
    // splitSystemPrompt: the system prompt is a block of its own, shared by every conversation
    // that starts with it.
    let split = blocks_from_body(body(r#""You are a pirate""#).as_bytes(), cuts(true)).unwrap();
    assert_eq!(split, vec!["system:You are a pirate", "user:hi", "assistant:youser:more"]);
    // An OpenAI body has no top-level system: unchanged.
    let openai = r#"{"messages":[{"role":"system","content":"You are a pirate"},{"role":"user","content":"hi"}]}"#;
    assert_eq!(
        blocks_from_body(openai.as_bytes(), cuts(false)).unwrap(),
        vec!["system:You are a pirateuser:hi"]
    );
}

#[test]
fn body_request_waits_for_the_whole_body_then_sends_one_script_call() {
    let (mut f, mut host) = setup(&cfg(r#","hitLoadFactor":2"#));
    assert_eq!(f.on_request_headers(&mut host, 7, false), HeaderAction::StopIteration);
    assert!(host.redis_calls.is_empty());
    assert_eq!(f.on_request_body(&mut host, 7, 10, false), DataAction::StopIterationAndBuffer);
    host.request_body = CHAT.as_bytes().to_vec();
    assert_eq!(
        f.on_request_body(&mut host, 7, CHAT.len(), true),
        DataAction::StopIterationAndBuffer
    );
    assert_eq!(host.redis_calls.len(), 1, "one round trip");
    let cmd = command(&host, 0);
    assert_eq!(cmd[1], crate::redis::sha1_hex_lower(PREFIX_CACHE_LUA.as_str().as_bytes()));
    let (keys, args) = keys_args(&cmd);
    let expected_chain = chain(&blocks_from_body(CHAT.as_bytes(), cuts(false)).unwrap());
    assert_eq!(keys, vec![inflight_key("r1", CLUSTER)]);
    assert_eq!(args[4], "600", "redisKeyTTL");
    assert_eq!(args[5], host.unix_seconds().to_string(), "the gateway's clock");
    assert_eq!(args[6], "2", "hitLoadFactor");
    assert_eq!(args[CHAIN_LEN_AT], expected_chain.len().to_string(), "chain length");
    let chain_at = CHAIN_LEN_AT + 1;
    assert_eq!(args[chain_at..chain_at + expected_chain.len()], expected_chain[..]);
    assert_eq!(args[chain_at + expected_chain.len()], "2", "healthy count");
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, RedisReply::Ok(pick_reply("10.0.0.2:8000", 3, true, Some(2))));
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.2:8000"));
    assert_eq!(host.resumes, 1);
    assert_eq!(host.counters.get("ai_lb_prefix_hit"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_prefix_matched_blocks"), Some(&2));
    f.on_delete(&mut host, 7);
    assert_eq!(releases(&host), vec![release_of(&host, 0, false)]);
}

#[test]
fn malformed_json_passes_through_with_a_log_line() {
    let (mut f, mut host) = setup(&cfg(""));
    f.on_request_headers(&mut host, 7, false);
    host.request_body = b"{\"messages\": [".to_vec();
    let n = host.request_body.len();
    assert_eq!(f.on_request_body(&mut host, 7, n, true), DataAction::Continue);
    assert!(host.redis_calls.is_empty());
    assert_eq!(host.override_host, None);
    assert!(host.logged("not a JSON object"));
    f.on_delete(&mut host, 7);
    assert!(releases(&host).is_empty());
}

#[test]
fn body_above_max_body_bytes_passes_through() {
    let (mut f, mut host) = setup(&cfg(r#","maxBodyBytes":100"#));
    f.on_request_headers(&mut host, 7, false);
    assert_eq!(f.on_request_body(&mut host, 7, 60, false), DataAction::StopIterationAndBuffer);
    assert_eq!(f.on_request_body(&mut host, 7, 160, false), DataAction::Continue);
    assert_eq!(f.on_request_body(&mut host, 7, 200, true), DataAction::Continue);
    assert!(host.redis_calls.is_empty());
    assert!(host.logged("maxBodyBytes"));
}

#[test]
fn bodiless_request_is_a_least_request_pick_in_the_headers_phase() {
    let (mut f, mut host) = setup(&cfg(r#","decisionHeader":"x-ai-lb-decision""#));
    assert_eq!(f.on_request_headers(&mut host, 7, true), HeaderAction::StopIteration);
    let (_, args) = keys_args(&command(&host, 0));
    assert_eq!(args[CHAIN_LEN_AT], "0", "no prefix keys");
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, true, Some(0))));
    assert_eq!(host.resumes, 1);
    // No prompt, so no prefix to find: counted as the least-request pick it is, not as a miss
    // (a miss is a prompt whose prefix no pod holds: GET /v1/models would skew the hit rate).
    assert_eq!(host.counters.get("ai_lb_least_request_routed"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_prefix_miss"), None);
    f.on_response_headers(&mut host, 7);
    assert_eq!(
        host.response_headers_set,
        vec![("x-ai-lb-decision".into(), "least_request_routed".into())]
    );
}

#[test]
fn an_empty_body_is_a_request_without_a_prompt_not_a_bad_body() {
    // Chunked with nothing but whitespace (or no data at all: then the body callback ends the
    // stream with 0 bytes, where Content-Length: 0 ends it in the headers): a least-request pick.
    let (mut f, mut host) = setup(&cfg(""));
    f.on_request_headers(&mut host, 7, false);
    host.request_body = b" \r\n".to_vec();
    let n = host.request_body.len();
    assert_eq!(f.on_request_body(&mut host, 7, n, true), DataAction::StopIterationAndBuffer);
    let (_, args) = keys_args(&command(&host, 0));
    assert_eq!(args[CHAIN_LEN_AT], "0", "no prefix keys");
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, true, Some(0))));
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.1:8000"));
    assert_eq!(host.counters.get("ai_lb_least_request_routed"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_fallback_bad_body"), None);
}

#[test]
fn a_prompt_whose_prefix_no_pod_holds_is_a_miss() {
    let (mut f, mut host) = setup(&cfg(""));
    f.on_request_headers(&mut host, 7, false);
    host.request_body = CHAT.as_bytes().to_vec();
    f.on_request_body(&mut host, 7, CHAT.len(), true);
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, true, Some(0))));
    assert_eq!(host.counters.get("ai_lb_prefix_miss"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_least_request_routed"), None);
}

#[test]
fn redis_errors_pass_through() {
    let (mut f, mut host) = setup(&cfg(""));
    f.on_request_headers(&mut host, 7, false);
    host.request_body = CHAT.as_bytes().to_vec();
    f.on_request_body(&mut host, 7, CHAT.len(), true);
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, RedisReply::NetworkError);
    assert_eq!(host.resumes, 1);
    assert_eq!(host.override_host, None);
}

#[test]
fn body_ending_with_trailers_is_still_routed() {
    let (mut f, mut host) = setup(&cfg(""));
    f.on_request_headers(&mut host, 7, false);
    host.request_body = CHAT.as_bytes().to_vec();
    assert_eq!(
        f.on_request_body(&mut host, 7, CHAT.len(), false),
        DataAction::StopIterationAndBuffer
    );
    assert_eq!(
        f.on_request_trailers(&mut host, 7),
        HeaderAction::StopIteration,
        "trailers wait for the pick"
    );
    assert_eq!(host.redis_calls.len(), 1);
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, RedisReply::Ok(pick_reply("10.0.0.1:8000", 1, true, Some(0))));
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.1:8000"));
    assert_eq!(host.resumes, 1);
}

#[test]
fn split_system_prompt_gives_shared_system_prompts_a_shared_first_key() {
    let a = r#"{"messages":[{"role":"system","content":"S"},{"role":"developer","content":"D"},{"role":"user","content":"Q1"}]}"#;
    let b = r#"{"messages":[{"role":"system","content":"S"},{"role":"developer","content":"D"},{"role":"user","content":"Q2"}]}"#;
    let ba = blocks_from_body(a.as_bytes(), cuts(true)).unwrap();
    assert_eq!(ba, vec!["system:Sdeveloper:D", "user:Q1"]);
    let (ka, kb) = (chain(&ba), chain(&blocks_from_body(b.as_bytes(), cuts(true)).unwrap()));
    assert_eq!(ka[0], kb[0]);
    assert_ne!(ka[1], kb[1]);
    // Off (Higress behaviour): the system prompt shares a block with the first question.
    assert_eq!(
        blocks_from_body(a.as_bytes(), cuts(false)).unwrap(),
        vec!["system:Sdeveloper:Duser:Q1"]
    );
    // Only the leading run is cut; a system message later in the conversation is not.
    let c = r#"{"messages":[{"role":"user","content":"Q"},{"role":"system","content":"S"},{"role":"assistant","content":"A"}]}"#;
    assert_eq!(
        blocks_from_body(c.as_bytes(), cuts(true)).unwrap(),
        vec!["user:Q", "system:Sassistant:A"]
    );
    // Config key.
    let (mut f, mut host) = setup(&cfg(r#","splitSystemPrompt":true"#));
    f.on_request_headers(&mut host, 7, false);
    host.request_body = a.as_bytes().to_vec();
    f.on_request_body(&mut host, 7, a.len(), true);
    let (_, args) = keys_args(&command(&host, 0));
    assert_eq!(args[CHAIN_LEN_AT], "2", "two prefix keys");
}

/// An agent's request: the user's task, then `rounds` tool rounds (an assistant message calling
/// tools and their results; round 2 calls two tools at once).
fn agent_body(rounds: usize) -> String {
    let mut messages = vec![r#"{"role":"user","content":"fix the build"}"#.to_string()];
    for r in 1..=rounds {
        let calls = if r == 2 { 2 } else { 1 };
        let tool_calls: Vec<String> = (0..calls)
            .map(|c| format!(r#"{{"id":"c{r}{c}","type":"function","function":{{"name":"sh","arguments":"{{}}"}}}}"#))
            .collect();
        messages.push(format!(
            r#"{{"role":"assistant","content":null,"tool_calls":[{}]}}"#,
            tool_calls.join(",")
        ));
        for c in 0..calls {
            messages.push(format!(
                r#"{{"role":"tool","tool_call_id":"c{r}{c}","content":"out {r}.{c}"}}"#
            ));
        }
    }
    format!(
        r#"{{"tools":[{{"type":"function","function":{{"name":"sh"}}}}],"messages":[{}]}}"#,
        messages.join(",")
    )
}

#[test]
fn an_agents_tool_rounds_are_blocks_of_the_chain() {
    let blocks = |rounds: usize, cuts: KeyRules| {
        blocks_from_body(agent_body(rounds).as_bytes(), cuts).unwrap()
    };
    let three = blocks(3, KeyRules::default());
    assert_eq!(three.len(), 4, "the task, then one block per round: {three:?}");
    assert!(three[0].starts_with("tools:") && three[0].ends_with("user:fix the build"));
    // The two results of round 2's parallel calls end one block.
    assert!(three[2].contains("tool:out 2.0tool:out 2.1"), "{}", three[2]);
    assert!(three[1].starts_with("assistant:") && three[1].ends_with("tool:out 1.0"));
    assert!(three[3].starts_with("assistant:") && three[3].ends_with("tool:out 3.0"));
    // Each request's chain starts with the previous request's: the pod that served round 3 is
    // found by all four keys at round 4, and credited with all they hold.
    let four = chain(&blocks(4, KeyRules::default()));
    assert_eq!(four[..4], chain(&three)[..]);
    assert_eq!(four.len(), 5);

    // splitToolResults off (the Go plugin's cuts): everything after the task is one block that
    // changes every round, so a later round matches the first block alone.
    let go = KeyRules { after_tool_results: false, ..KeyRules::default() };
    let (go3, go4) = (blocks(3, go), blocks(4, go));
    assert_eq!(go3.len(), 2);
    assert_eq!(go3[0], three[0]);
    assert_ne!(chain(&go4)[1], chain(&go3)[1]);

    // Config key: four keys sent with the default, two without the cut.
    for (extra, keys) in [("", "4"), (r#","splitToolResults":false"#, "2")] {
        let (mut f, mut host) = setup(&cfg(extra));
        f.on_request_headers(&mut host, 7, false);
        let body = agent_body(3);
        host.request_body = body.as_bytes().to_vec();
        f.on_request_body(&mut host, 7, body.len(), true);
        let (_, args) = keys_args(&command(&host, 0));
        assert_eq!(args[CHAIN_LEN_AT], keys, "{extra}");
    }
}

#[test]
fn a_hit_diverted_for_load_is_counted_and_named_in_the_decision_header() {
    let (mut f, mut host) =
        setup(&cfg(r#","hitLoadFactor":2,"decisionHeader":"x-ai-lb-decision""#));
    f.on_request_headers(&mut host, 7, false);
    host.request_body = CHAT.as_bytes().to_vec();
    f.on_request_body(&mut host, 7, CHAT.len(), true);
    let t = host.last_redis_token().unwrap();
    // {host, count, admitted, matched, diverted}
    let reply = b"*5\r\n$13\r\n10.0.0.1:8000\r\n:1\r\n:1\r\n:2\r\n:1\r\n".to_vec();
    deliver(&mut f, &mut host, t, RedisReply::Ok(reply));
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.1:8000"));
    assert_eq!(host.counters.get("ai_lb_prefix_hit_diverted"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_prefix_hit"), None);
    f.on_response_headers(&mut host, 7);
    assert_eq!(
        host.response_headers_set,
        vec![("x-ai-lb-decision".into(), "prefix_hit_diverted; blocks=2".into())]
    );
}

#[test]
fn without_redis_a_prompt_goes_to_the_pod_with_room_by_its_metrics() {
    let (mut f, mut host) = setup(&cfg(""));
    set_hosts_with_metrics(&mut host, vllm_metrics(2, 0, 0.1), vllm_metrics(40, 9, 0.99));
    host.redis_call_error = Some(crate::host::HostError::InternalFailure);
    f.on_request_headers(&mut host, 7, false);
    host.request_body = CHAT.as_bytes().to_vec();
    assert_eq!(f.on_request_body(&mut host, 7, CHAT.len(), true), DataAction::Continue);
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.1:8000"));
    assert_eq!(host.counters.get("ai_lb_fallback_redis_error"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_redis_down_routed_by_metrics"), Some(&1));
}

/// Six chat requests while Redis fails, with two idle pods (.1 with a little less KV in use than
/// .2); each request ends before the next when `sequential`. Returns how many went to .1 and to .2.
fn six_requests_without_redis(sequential: bool) -> (usize, usize) {
    let (mut f, mut host) = setup(&cfg(""));
    set_hosts_with_metrics(&mut host, vllm_metrics(2, 0, 0.10), vllm_metrics(2, 0, 0.20));
    host.redis_call_error = Some(crate::host::HostError::InternalFailure);
    let mut routed = Vec::new();
    for ctx in (1..=6).map(|i| i * 2 + 1) {
        f.on_request_headers(&mut host, ctx, false);
        host.request_body = CHAT.as_bytes().to_vec();
        f.on_request_body(&mut host, ctx, CHAT.len(), true);
        routed.push(host.override_host.take().expect("routed by metrics"));
        if sequential {
            f.on_delete(&mut host, ctx);
        }
    }
    assert_eq!(host.counters.get("ai_lb_redis_down_routed_by_metrics"), Some(&6));
    let to_one = routed.iter().filter(|a| *a == "10.0.0.1:8000").count();
    (to_one, routed.len() - to_one)
}

#[test]
fn without_redis_a_burst_decided_on_one_metrics_sample_is_spread_over_the_pods() {
    // When the breaker opens, every pick that waited on the frozen Redis is decided at once, on
    // the same sample: still in flight, each counts as queued where it went, so they alternate
    // instead of all landing on .1.
    assert_eq!(six_requests_without_redis(false), (3, 3));
}

#[test]
fn without_redis_sequential_requests_that_ended_do_not_make_a_pod_look_loaded() {
    // Each request ends before the next: none is load the sample misses, so all go to .1, the
    // pod with the most room.
    assert_eq!(six_requests_without_redis(true), (6, 0));
}

#[test]
fn odd_message_shapes_read_as_a_parsed_object_would() {
    let blocks = |b: &str| blocks_from_body(b.as_bytes(), cuts(false));
    // A message that is not an object has an empty role and no content; a non-string role is "".
    assert_eq!(
        blocks(r#"{"messages":["x",{"role":5,"content":"a"},{"role":"user","content":"q"}]}"#),
        Some(vec!["::auser:q".to_string()])
    );
    // Repeated keys: the last one counts; unknown keys are skipped whatever they hold.
    assert_eq!(
        blocks(r#"{"messages":[{"role":"system","role":"user","content":"a","x":{"y":[1,{}]}}]}"#),
        Some(vec!["user:a".to_string()])
    );
    // Escaped strings are unescaped, as in a parsed tree.
    assert_eq!(
        blocks(r#"{"messages":[{"role":"user","content":"line\nnext \u00e9"}]}"#),
        Some(vec!["user:line\nnext é".to_string()])
    );
    // messages that is not a list: the body is read as a completions body.
    assert_eq!(blocks(r#"{"messages":{"a":1},"prompt":"p"}"#), Some(vec!["p".to_string()]));
    // tool_calls without content; null content and null tool_calls add nothing.
    assert_eq!(
        blocks(
            r#"{"messages":[{"role":"assistant","tool_calls":[{"id":"1"}]},{"role":"user","content":null,"tool_calls":null}]}"#
        ),
        Some(vec![r#"assistant:[{"id":"1"}]user:"#.to_string()])
    );
    assert_eq!(blocks(r#"{"messages":[]} x"#), None, "trailing bytes");
    assert_eq!(blocks(r#""just a string""#), None);
}

/// Where the chain's length stands in a prefix pick's ARGV (0-based; `lua/prefix_cache.lua`'s
/// ARGV[8]): the chain values follow it, then the healthy count and hosts.
const CHAIN_LEN_AT: usize = 7;

/// The load arguments of pick `n` (after the healthy hosts), as (host, overloaded, penalty) per
/// host, with the in-flight gap, ratio and max holders; `None` when the call carries none.
#[allow(clippy::type_complexity)]
fn load_args_of(host: &FakeHost, n: usize) -> Option<(Vec<String>, Vec<(String, bool, u32)>)> {
    let (_, args) = keys_args(&command(host, n));
    let k: usize = args[CHAIN_LEN_AT].parse().unwrap();
    let hosts_at = CHAIN_LEN_AT + 2 + k;
    let nh: usize = args[CHAIN_LEN_AT + 1 + k].parse().unwrap();
    let healthy = &args[hosts_at..hosts_at + nh];
    let rest = &args[hosts_at + nh..];
    if rest.is_empty() {
        return None;
    }
    assert!(
        rest.len() == 4 + nh || rest.len() == 5 + nh,
        "gap, ratio, holders, flags, one penalty per host, divert costs: {rest:?}"
    );
    let flags: Vec<char> = rest[3].chars().collect();
    let per_host = healthy
        .iter()
        .enumerate()
        .map(|(i, h)| (h.clone(), flags[i] == '1', rest[4 + i].parse().unwrap()))
        .collect();
    Some((rest[..3].to_vec(), per_host))
}

/// The divert costs argument of call `n` (after the penalties), if sent.
fn divert_costs_of(host: &FakeHost, n: usize) -> Option<String> {
    let (_, args) = keys_args(&command(host, n));
    let k: usize = args[CHAIN_LEN_AT].parse().unwrap();
    let nh: usize = args[CHAIN_LEN_AT + 1 + k].parse().unwrap();
    args.get(CHAIN_LEN_AT + 2 + k + nh + 4 + nh).cloned()
}

fn send_chat(f: &mut Filter, host: &mut FakeHost, ctx: u32) {
    send_body(f, host, ctx, CHAT);
}

fn send_body(f: &mut Filter, host: &mut FakeHost, ctx: u32, body: &str) {
    f.on_request_headers(host, ctx, false);
    host.request_body = body.as_bytes().to_vec();
    f.on_request_body(host, ctx, body.len(), true);
}

/// A one-message chat whose message is a 48000-byte document to prefill ("user:" + it: 48005
/// bytes, 11 requests of 4096).
fn document_chat() -> String {
    let doc = "lorem ipsum ".repeat(4_000);
    format!(r#"{{"messages":[{{"role":"user","content":"{doc}"}}]}}"#)
}

/// The penalties of the last call's load arguments, by host address.
fn last_penalties(host: &FakeHost) -> Vec<u32> {
    let (_, mut per_host) = load_args_of(host, host.redis_calls.len() - 1).expect("load");
    per_host.sort();
    per_host.into_iter().map(|h| h.2).collect()
}

/// Answers the last pick sent: admitted to `pod`, `matched` blocks found.
fn answer_last_pick(f: &mut Filter, host: &mut FakeHost, pod: &str, matched: i64) {
    let t = host.last_redis_token().unwrap();
    deliver(f, host, t, RedisReply::Ok(pick_reply(pod, 1, true, Some(matched))));
}

/// `pod` sends the first body bytes of stream `ctx`'s answer.
fn first_answer_bytes(f: &mut Filter, host: &mut FakeHost, ctx: u32, pod: &str) {
    host.properties.insert("upstream.address".into(), pod.as_bytes().to_vec());
    f.on_response_headers(host, ctx);
    f.on_response_body(host, ctx, 100, false);
}

#[test]
fn load_aware_sends_each_pods_overload_flag_and_penalty_from_its_metrics() {
    let (mut f, mut host) = setup(&cfg(r#","loadAware":true,"overloadQueue":3,"maxHolders":3"#));
    // .1: 12 queued, 50% KV; .2: idle. .3 is unhealthy: not a candidate.
    set_hosts_with_metrics(&mut host, vllm_metrics(8, 12, 0.5), vllm_metrics(1, 0, 0.1));
    send_chat(&mut f, &mut host, 7);
    let (params, mut per_host) = load_args_of(&host, 0).expect("load arguments");
    assert_eq!(params, vec!["4", "1.5", "3"], "in-flight gap, ratio, max holders");
    per_host.sort();
    assert_eq!(
        per_host,
        vec![
            ("10.0.0.1:8000".to_string(), true, 16), // 12 + 8 × 0.5; queue 12 - 0 > 3
            ("10.0.0.2:8000".to_string(), false, 1), // 0 + 8 × 0.1
        ]
    );
    assert_eq!(host.counters.get("ai_lb_prefix_load_unknown"), None);
    // The script diverted the hit and added the pod as a holder: both counted.
    let t = host.last_redis_token().unwrap();
    let reply = b"*6\r\n$13\r\n10.0.0.2:8000\r\n:1\r\n:1\r\n:2\r\n:1\r\n:1\r\n".to_vec();
    deliver(&mut f, &mut host, t, RedisReply::Ok(reply));
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.2:8000"));
    assert_eq!(host.counters.get("ai_lb_prefix_hit_diverted"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_prefix_holder_added"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_prefix_hit"), None);
}

/// Stream `ctx`'s pick goes to `pod`, which answers: first chunk now, then 20 chunks of 100
/// bytes `every_ms` apart.
fn stream_from(f: &mut Filter, host: &mut FakeHost, ctx: u32, pod: &str, every_ms: u64) {
    let t = host.last_redis_token().expect("a pick was sent");
    deliver(f, host, t, RedisReply::Ok(pick_reply(pod, 1, true, Some(0))));
    assert_eq!(host.override_host.as_deref(), Some(pod));
    host.properties.insert("upstream.address".into(), pod.as_bytes().to_vec());
    f.on_response_headers(host, ctx);
    f.on_response_body(host, ctx, 100, false);
    for i in 0..20 {
        host.now += every_ms * 1_000_000;
        f.on_response_body(host, ctx, 100, i == 19);
    }
    f.on_stream_end(host, ctx);
}

#[test]
fn load_aware_counts_a_pod_that_streams_slower_as_more_loaded() {
    let (mut f, mut host) = setup(&cfg(r#","loadAware":true,"loadLatencyWeight":4"#));
    set_hosts_with_metrics(&mut host, vllm_metrics(1, 0, 0.0), vllm_metrics(1, 0, 0.0));
    host.now = 1_000_000_000;
    // Before any response: no opinion on speed, no penalty.
    send_chat(&mut f, &mut host, 1);
    let (_, mut per_host) = load_args_of(&host, 0).expect("load arguments");
    per_host.sort();
    assert_eq!(per_host.iter().map(|h| h.2).collect::<Vec<_>>(), vec![0, 0]);
    // .1 streams 20 ms per chunk, .2 60 ms per chunk (three times as slow).
    stream_from(&mut f, &mut host, 1, "10.0.0.1:8000", 20);
    send_chat(&mut f, &mut host, 2);
    stream_from(&mut f, &mut host, 2, "10.0.0.2:8000", 60);
    send_chat(&mut f, &mut host, 3);
    let n = host.redis_calls.len() - 1;
    let (_, mut per_host) = load_args_of(&host, n).expect("load arguments");
    per_host.sort();
    assert_eq!(
        per_host,
        vec![
            ("10.0.0.1:8000".to_string(), false, 0),
            // loadLatencyWeight 4 × (3 - 1); steadily 3 times as slow, past the default
            // overloadLatency 1.6: its hits are diverted.
            ("10.0.0.2:8000".to_string(), true, 8),
        ]
    );
}

#[test]
fn load_aware_counts_the_prompts_a_pod_has_not_started_answering() {
    let (mut f, mut host) = setup(&cfg(r#","loadAware":true"#));
    set_hosts_with_metrics(&mut host, vllm_metrics(1, 0, 0.0), vllm_metrics(1, 0, 0.0));
    let body = document_chat();
    // The document goes to .1 (a miss): until .1 answers, it owes its prefill.
    send_body(&mut f, &mut host, 1, &body);
    answer_last_pick(&mut f, &mut host, "10.0.0.1:8000", 0);
    send_chat(&mut f, &mut host, 2);
    assert_eq!(last_penalties(&host), vec![11, 0]);
    // The same document again, a hit on .2 that holds it: nothing left to prefill there.
    send_body(&mut f, &mut host, 3, &body);
    answer_last_pick(&mut f, &mut host, "10.0.0.2:8000", 1);
    send_chat(&mut f, &mut host, 4);
    assert_eq!(last_penalties(&host), vec![11, 0]);
    // .1's first answer byte: its prefill is over.
    first_answer_bytes(&mut f, &mut host, 1, "10.0.0.1:8000");
    send_chat(&mut f, &mut host, 5);
    assert_eq!(last_penalties(&host), vec![0, 0]);
}

#[test]
fn load_aware_counts_the_prompts_other_workers_of_the_gateway_sent_a_pod() {
    // Two worker VMs of one gateway: one host (its shared data), two filters.
    let config = cfg(r#","loadAware":true"#);
    let (mut a, mut host) = setup(&config);
    let mut b = Filter::new();
    assert!(b.configure(&mut host, config.as_bytes()));
    set_hosts_with_metrics(&mut host, vllm_metrics(1, 0, 0.0), vllm_metrics(1, 0, 0.0));
    let body = document_chat();
    // Worker a sends a document to .1 (a miss).
    send_body(&mut a, &mut host, 1, &body);
    answer_last_pick(&mut a, &mut host, "10.0.0.1:8000", 0);
    // Worker b, which never saw it, counts it in .1's load.
    send_chat(&mut b, &mut host, 2);
    assert_eq!(last_penalties(&host), vec![11, 0]);
    // b sends another document to .1 itself: both count, for either worker (2 × 48005 bytes,
    // 23 requests of 4096).
    send_body(&mut b, &mut host, 3, &body.replace("lorem", "dolor"));
    answer_last_pick(&mut b, &mut host, "10.0.0.1:8000", 0);
    send_chat(&mut b, &mut host, 4);
    assert_eq!(last_penalties(&host), vec![23, 0]);
    send_chat(&mut a, &mut host, 5);
    assert_eq!(last_penalties(&host), vec![23, 0]);
    // .1 starts answering a's request: neither counts it any more.
    first_answer_bytes(&mut a, &mut host, 1, "10.0.0.1:8000");
    send_chat(&mut b, &mut host, 6);
    assert_eq!(last_penalties(&host), vec![11, 0]);
    send_chat(&mut a, &mut host, 7);
    assert_eq!(last_penalties(&host), vec![11, 0]);
}

#[test]
fn load_aware_tells_the_script_what_each_matched_prefix_would_cost_a_diverted_hit() {
    let doc = "lorem ipsum ".repeat(4_000);
    let body = format!(
        r#"{{"messages":[{{"role":"user","content":"{doc}"}},{{"role":"assistant","content":"ok"}},{{"role":"user","content":"why?"}}]}}"#
    );
    let send = |f: &mut Filter, host: &mut FakeHost| send_body(f, host, 1, &body);
    let (mut f, mut host) = setup(&cfg(r#","loadAware":true"#));
    set_hosts_with_metrics(&mut host, vllm_metrics(1, 0, 0.0), vllm_metrics(1, 0, 0.0));
    send(&mut f, &mut host);
    // Block 1 is "user:" + the document (48005 bytes: 11 requests of 4096); block 2 adds the
    // answer and the question, a few bytes: the cost rises only at length 1.
    assert_eq!(divert_costs_of(&host, 0).as_deref(), Some("1:11"));
    // A short chat costs nothing to give up: sent empty.
    send_chat(&mut f, &mut host, 2);
    assert_eq!(divert_costs_of(&host, 1).as_deref(), Some(""));
    // divertPrefixBytes 0: not sent.
    let (mut f, mut host) = setup(&cfg(r#","loadAware":true,"divertPrefixBytes":0"#));
    set_hosts_with_metrics(&mut host, vllm_metrics(1, 0, 0.0), vllm_metrics(1, 0, 0.0));
    send(&mut f, &mut host);
    assert!(load_args_of(&host, 0).is_some());
    assert_eq!(divert_costs_of(&host, 0), None);
    // A larger exchange rate: 48005 / 16000.
    let (mut f, mut host) = setup(&cfg(r#","loadAware":true,"divertPrefixBytes":16000"#));
    set_hosts_with_metrics(&mut host, vllm_metrics(1, 0, 0.0), vllm_metrics(1, 0, 0.0));
    send(&mut f, &mut host);
    assert_eq!(divert_costs_of(&host, 0).as_deref(), Some("1:3"));
    // A long conversation sends only where the cost rises: 40 turns of 1100 bytes each, 4096
    // bytes per request.
    let turns: Vec<String> = (0..40)
        .map(|i| {
            format!(
                r#"{{"role":"user","content":"{}"}},{{"role":"assistant","content":"ok"}}"#,
                format!("{i:04}").repeat(273)
            )
        })
        .collect();
    let long = format!(r#"{{"messages":[{}]}}"#, turns.join(","));
    let (mut f, mut host) = setup(&cfg(r#","loadAware":true"#));
    set_hosts_with_metrics(&mut host, vllm_metrics(1, 0, 0.0), vllm_metrics(1, 0, 0.0));
    send_body(&mut f, &mut host, 1, &long);
    let steps = divert_costs_of(&host, 0).unwrap_or_default();
    let parsed: Vec<(usize, u64)> = steps
        .split(',')
        .filter_map(|s| s.split_once(':'))
        .map(|(l, c)| (l.parse().unwrap(), c.parse().unwrap()))
        .collect();
    assert!(parsed.len() < 40, "fewer steps than blocks: {steps}");
    assert!(parsed.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 < w[1].1), "{steps}");
    assert_eq!(parsed.first().map(|p| p.1), Some(1), "{steps}");
}

#[test]
fn a_stream_that_ends_before_its_first_answer_byte_leaves_no_prompt_behind() {
    // The client went away during the prefill: no response body ever comes.
    let config =
        match crate::config::PluginConfig::from_json(cfg(r#","loadAware":true"#).as_bytes())
            .ok()
            .and_then(|c| c.default)
            .map(|d| d.policy)
        {
            Some(crate::config::PolicyConfig::PrefixCache(c)) => c,
            other => panic!("bad test config: {other:?}"),
        };
    let mut p = PrefixCache::new(config);
    let mut host = FakeHost::new();
    host.set_hosts(&[("10.0.0.1:8000", true)]);
    let mut stream = Stream { id: 9, cluster: "c".into(), ..Default::default() };
    let _ = p.on_request_body(&mut host, &mut stream, CHAT.as_bytes());
    assert_eq!(p.prefill.as_ref().map(PrefillBacklog::tracked), Some(1));
    p.on_stream_done(&mut host, &mut stream);
    assert_eq!(p.prefill.as_ref().map(PrefillBacklog::tracked), Some(0));
}

#[test]
fn a_go_config_does_not_time_the_pods() {
    let (mut f, mut host) = setup(&cfg(""));
    set_hosts_with_metrics(&mut host, vllm_metrics(1, 0, 0.0), vllm_metrics(1, 0, 0.0));
    send_chat(&mut f, &mut host, 1);
    stream_from(&mut f, &mut host, 1, "10.0.0.1:8000", 20);
    send_chat(&mut f, &mut host, 2);
    stream_from(&mut f, &mut host, 2, "10.0.0.2:8000", 60);
    send_chat(&mut f, &mut host, 3);
    let n = host.redis_calls.len() - 1;
    assert_eq!(load_args_of(&host, n), None, "Go's call, no load arguments");
}

#[test]
fn load_aware_without_fresh_metrics_sends_todays_call_and_counts_it() {
    // Missing: the host list carries no metrics and nothing is scraped.
    let (mut f, mut host) = setup(&cfg(r#","loadAware":true"#));
    send_chat(&mut f, &mut host, 7);
    let (mut g, mut go_host) = setup(&cfg(""));
    send_chat(&mut g, &mut go_host, 7);
    let (_, with) = keys_args(&command(&host, 0));
    let (_, go) = keys_args(&command(&go_host, 0));
    assert_eq!(load_args_of(&host, 0), None);
    assert_eq!(with.len(), go.len(), "the same call as with loadAware off");
    assert_eq!(host.counters.get("ai_lb_prefix_load_unknown"), Some(&1));
    // One pod without a KV-cache figure: no opinion for the request either.
    let (mut f, mut host) = setup(&cfg(r#","loadAware":true"#));
    set_hosts_with_metrics(
        &mut host,
        vllm_metrics(1, 0, 0.1),
        "vllm:num_requests_waiting 3\n".to_string(),
    );
    send_chat(&mut f, &mut host, 7);
    assert_eq!(load_args_of(&host, 0), None);
    assert_eq!(host.counters.get("ai_lb_prefix_load_unknown"), Some(&1));
}

#[test]
fn a_go_config_sends_no_load_arguments_even_with_metrics() {
    let (mut f, mut host) = setup(&cfg(""));
    set_hosts_with_metrics(&mut host, vllm_metrics(8, 12, 0.5), vllm_metrics(1, 0, 0.1));
    send_chat(&mut f, &mut host, 7);
    assert_eq!(load_args_of(&host, 0), None);
    assert_eq!(host.counters.get("ai_lb_prefix_load_unknown"), None);
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, RedisReply::Ok(pick_reply("10.0.0.1:8000", 3, true, Some(2))));
    assert_eq!(host.counters.get("ai_lb_prefix_hit"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_prefix_holder_added"), None);
}

#[test]
fn load_aware_with_scraped_metrics_uses_them_while_fresh_and_not_once_stale() {
    use crate::host::HttpReply;
    let (mut f, mut host) = setup(&cfg(
        r#","loadAware":true,"scrapeCluster":"pods-original-dst","scrapeIntervalMs":500"#,
    ));
    let sha = crate::redis::sha1_hex_lower(PREFIX_CACHE_LUA.as_str().as_bytes());
    let picks = |host: &FakeHost| -> Vec<usize> {
        (0..host.redis_calls.len()).filter(|&i| command(host, i)[1] == sha).collect()
    };
    // Nothing scraped yet: today's call.
    f.on_request_headers(&mut host, 10, true);
    let p = picks(&host);
    assert_eq!(load_args_of(&host, p[0]), None);
    assert_eq!(host.counters.get("ai_lb_prefix_load_unknown"), Some(&1));
    f.on_tick(&mut host);
    let calls: Vec<(u32, String)> = host
        .http_calls
        .iter()
        .map(|c| (c.token, c.header(":authority").unwrap_or_default().to_string()))
        .collect();
    assert_eq!(calls.len(), 2, "the two healthy pods are scraped");
    for (token, pod) in calls {
        let body =
            if pod == "10.0.0.1:8000" { vllm_metrics(8, 12, 0.5) } else { vllm_metrics(1, 0, 0.1) };
        let reply = HttpReply { status: 200, headers: vec![], body: body.into_bytes() };
        f.on_http_reply(&mut host, token, &reply, false);
    }
    // Fresh: the pods' loads go with the pick.
    f.on_request_headers(&mut host, 11, true);
    let p = picks(&host);
    let (_, mut per_host) = load_args_of(&host, p[1]).expect("fresh scraped metrics");
    per_host.sort();
    assert_eq!(
        per_host,
        vec![("10.0.0.1:8000".to_string(), true, 16), ("10.0.0.2:8000".to_string(), false, 1)]
    );
    assert_eq!(host.counters.get("ai_lb_prefix_load_unknown"), Some(&1));
    // Past metricsStaleMs (5 s) with no new scrape: today's call again, and counted.
    host.now += 6_000_000_000;
    f.on_request_headers(&mut host, 12, true);
    let p = picks(&host);
    assert_eq!(load_args_of(&host, p[2]), None);
    assert_eq!(host.counters.get("ai_lb_prefix_load_unknown"), Some(&2));
}

/// A Codex-style agent turn through OpenAI's Responses API: `instructions`, then `input` items
/// (messages, the model's function calls and their outputs), `rounds` tool rounds.
fn responses_body(rounds: usize) -> String {
    let mut items = vec![serde_json::json!({"role":"user","content":[
        {"type":"input_text","text":"fix the build"}]})];
    for r in 1..=rounds {
        items.push(serde_json::json!({"type":"reasoning","id":format!("rs_{r}"),"summary":[]}));
        items.push(serde_json::json!({"type":"function_call","call_id":format!("call_{r}"),
            "name":"run_command","arguments":format!("{{\"cmd\":\"step {r}\"}}")}));
        items.push(serde_json::json!({"type":"function_call_output",
            "call_id":format!("call_{r}"),"output":format!("out {r}")}));
    }
    serde_json::json!({"model":"m","instructions":"You are a coding agent.",
        "tools":[{"type":"function","name":"run_command"}],"input":items,"stream":true})
    .to_string()
}

#[test]
fn a_responses_api_conversation_is_cut_as_a_chat_is() {
    let blocks = |body: &str| blocks_from_body(body.as_bytes(), cuts(false)).unwrap();
    let three = blocks(&responses_body(3));
    assert_eq!(three.len(), 4, "the task, then one block per round: {three:?}");
    assert!(three[0].starts_with("tools:"), "{}", three[0]);
    assert!(three[0].contains("system:You are a coding agent.user:fix the build"), "{}", three[0]);
    assert_eq!(
        three[2],
        "reasoning:function_call:run_command{\"cmd\":\"step 2\"}function_call_output:out 2"
    );
    // Each turn's chain starts with the previous turn's.
    let four = chain(&blocks(&responses_body(4)));
    assert_eq!(four[..4], chain(&three)[..]);

    // The same conversation through chat completions (a system message, a user message) and
    // through the Responses API (instructions, a string input) renders the same blocks: vLLM
    // applies one chat template to both, so both find the same cached prefix.
    let chat =
        r#"{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}"#;
    let responses = r#"{"instructions":"Be brief.","input":"Hi"}"#;
    assert_eq!(blocks(chat), blocks(responses));
    assert_eq!(blocks(responses), vec!["system:Be brief.user:Hi".to_string()]);

    // An input that is neither a string nor a list: no blocks (normal balancing).
    assert_eq!(blocks(r#"{"input":{"role":"user"}}"#), Vec::<String>::new());
    // A chat message's `name` is not hashed: chat keys are as before.
    let named = r#"{"messages":[{"role":"user","name":"ann","content":"Hi"}]}"#;
    assert_eq!(blocks(named), vec!["user:Hi".to_string()]);
}

#[test]
fn a_request_that_continues_a_stored_response_starts_with_its_block() {
    let blocks = |body: &str| blocks_from_body(body.as_bytes(), KeyRules::default()).unwrap();
    let prompt = |body: &str| prompt_from_body(body.as_bytes(), KeyRules::default()).unwrap();
    let next = r#"{"model":"m","previous_response_id":"resp_1","input":[
        {"type":"function_call_output","call_id":"c1","output":"ok"}]}"#;
    assert_eq!(blocks(next), vec!["response:resp_1", "function_call_output:ok"]);
    let p = prompt(next);
    assert_eq!(p.keys[0], response_chain_value("resp_1"));
    assert_eq!(p.stored, StoredResponse { continues: Some("resp_1".into()), stores: true });
    // Instructions and a string input follow the response's block; only the id, with no input.
    assert_eq!(
        blocks(r#"{"previous_response_id":"resp_2","instructions":"Be brief.","input":"Hi"}"#),
        vec!["response:resp_2", "system:Be brief.user:Hi"]
    );
    assert_eq!(blocks(r#"{"previous_response_id":"resp_3"}"#), vec!["response:resp_3"]);
    // An agent sends its tools again each round: the response's block still comes first, so the
    // chain starts with the key its pod was written under.
    let with_tools = r#"{"tools":[{"type":"function","name":"run"}],"previous_response_id":"resp_4","input":"Go"}"#;
    assert_eq!(
        blocks(with_tools),
        vec![r#"response:resp_4"#, r#"tools:[{"name":"run","type":"function"}]user:Go"#]
    );
    assert_eq!(prompt(with_tools).keys[0], response_chain_value("resp_4"));
    // `store: false`: nothing is kept on the server, so nothing is recorded.
    let unstored = prompt(r#"{"previous_response_id":"resp_1","input":"Hi","store":false}"#);
    assert_eq!(unstored.stored, StoredResponse { continues: Some("resp_1".into()), stores: false });
    assert!(prompt(r#"{"input":"Hi"}"#).stored.stores, "store defaults to true");
    // No id (null, empty, not a string): a new conversation.
    for none in [
        r#""previous_response_id":null"#,
        r#""previous_response_id":"""#,
        r#""previous_response_id":7"#,
    ] {
        let body = format!(r#"{{{none},"input":"Hi"}}"#);
        assert_eq!(prompt(&body).stored, StoredResponse { continues: None, stores: true });
        assert_eq!(blocks(&body), vec!["user:Hi"]);
    }
    // Chat completions bodies record nothing.
    assert_eq!(prompt(CHAT).stored, StoredResponse::default());
}

/// The pod answers stream `ctx` with `status`, its reply's start in `chunks`.
fn reply_from(
    f: &mut Filter,
    host: &mut FakeHost,
    ctx: u32,
    pod: &str,
    status: &str,
    chunks: &[&str],
) {
    host.properties.insert("upstream.address".into(), pod.as_bytes().to_vec());
    host.response_headers = vec![(":status".into(), status.into())];
    f.on_response_headers(host, ctx);
    for (i, chunk) in chunks.iter().enumerate() {
        host.response_body = chunk.as_bytes().to_vec();
        f.on_response_body(host, ctx, chunk.len(), i + 1 == chunks.len());
    }
}

/// The `SET` commands the plugin sent, as (key, value, ttl).
fn writes(host: &FakeHost) -> Vec<(String, String, String)> {
    (0..host.redis_calls.len())
        .map(|n| command(host, n))
        .filter(|c| c[0] == "SET")
        .map(|c| {
            assert_eq!((c.len(), c[3].as_str()), (5, "EX"), "{c:?}");
            (c[1].clone(), c[2].clone(), c[4].clone())
        })
        .collect()
}

#[test]
fn a_stored_response_is_recorded_with_its_pod_and_the_next_request_follows_it() {
    let (mut f, mut host) = setup(&cfg(r#","hitLoadFactor":1.5"#));
    send_body(&mut f, &mut host, 7, r#"{"model":"m","instructions":"Be brief.","input":"Hi"}"#);
    answer_last_pick(&mut f, &mut host, "10.0.0.2:8000", 0);
    let inflight = keys_args(&command(&host, 0)).0[0].clone();
    let base = inflight.strip_suffix("inflight").unwrap();
    // A JSON reply: its id is the object's first key.
    reply_from(
        &mut f,
        &mut host,
        7,
        "10.0.0.2:8000",
        "200",
        &[r#"{"id":"resp_a1","object":"response","status":"completed","output":[]}"#],
    );
    let key = format!("{base}pfx:{}", response_chain_value("resp_a1"));
    let stamp = format!("10.0.0.2:8000@{}", host.unix_seconds());
    assert_eq!(writes(&host), vec![(key.clone(), stamp, "600".to_string())]);
    assert_eq!(host.counters.get("ai_lb_prefix_response_recorded"), Some(&1));
    f.on_stream_end(&mut host, 7);

    // The next request names that response: its chain starts with the recorded key, and it goes
    // without the load guard (another pod may not have the response).
    send_body(
        &mut f,
        &mut host,
        8,
        r#"{"model":"m","previous_response_id":"resp_a1","input":"More"}"#,
    );
    let n = host.redis_calls.len() - 1;
    let (_, args) = keys_args(&command(&host, n));
    assert_eq!(args[CHAIN_LEN_AT - 1], "0", "no hitLoadFactor for a pinned pick");
    assert_eq!(args[CHAIN_LEN_AT + 1], response_chain_value("resp_a1"));
    assert_eq!(candidates_of(&host, n), vec!["10.0.0.2:8000"], "held to the recorded pod");
    answer_last_pick(&mut f, &mut host, "10.0.0.2:8000", 1);
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.2:8000"));
    assert_eq!(host.counters.get("ai_lb_prefix_response_followed"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_prefix_response_unknown"), None);
    // A request that is not pinned keeps the load guard.
    send_body(&mut f, &mut host, 9, r#"{"model":"m","input":"Other"}"#);
    let n = host.redis_calls.len() - 1;
    assert_eq!(keys_args(&command(&host, n)).1[CHAIN_LEN_AT - 1], "1.5");
}

/// The healthy candidates of pick `n`.
fn candidates_of(host: &FakeHost, n: usize) -> Vec<String> {
    let (_, args) = keys_args(&command(host, n));
    let k: usize = args[CHAIN_LEN_AT].parse().unwrap();
    let nh: usize = args[CHAIN_LEN_AT + 1 + k].parse().unwrap();
    args[CHAIN_LEN_AT + 2 + k..CHAIN_LEN_AT + 2 + k + nh].to_vec()
}

#[test]
fn a_response_redis_lost_still_reaches_its_pod_and_an_unknown_one_writes_no_key() {
    let (mut f, mut host) = setup(&cfg(r#","hitLoadFactor":1.5"#));
    let all = candidates_of_new_request(&mut f, &mut host);
    // .2 made resp_a; .3 (unhealthy since) made resp_b.
    record_two_responses(&mut f, &mut host);
    // resp_a: Redis no longer holds its key (a miss: matched 0), yet the only candidate is .2, so
    // the miss writes the key back to .2 and the request is counted followed.
    send_body(&mut f, &mut host, 3, r#"{"model":"m","previous_response_id":"resp_a","input":"M"}"#);
    let n = host.redis_calls.len() - 1;
    assert_eq!(candidates_of(&host, n), vec!["10.0.0.2:8000"]);
    assert_eq!(keys_args(&command(&host, n)).1[CHAIN_LEN_AT - 1], "0", "its key may be written");
    answer_last_pick(&mut f, &mut host, "10.0.0.2:8000", 0);
    assert_eq!(host.override_host.as_deref(), Some("10.0.0.2:8000"));
    assert_eq!(host.counters.get("ai_lb_prefix_response_followed"), Some(&1));
    // resp_b (its pod unhealthy) and an id never seen: every healthy pod is a candidate, and the
    // script is told not to write the response's key on a miss (`pin`).
    assert_eq!(all, ["10.0.0.1:8000", "10.0.0.2:8000"]);
    for (ctx, id) in [(4, "resp_b"), (5, "resp_never_seen")] {
        let body = format!(r#"{{"model":"m","previous_response_id":"{id}","input":"More"}}"#);
        send_body(&mut f, &mut host, ctx, &body);
        let n = host.redis_calls.len() - 1;
        let mut got = candidates_of(&host, n);
        got.sort();
        assert_eq!(got, all, "{id}");
        assert_eq!(keys_args(&command(&host, n)).1[CHAIN_LEN_AT - 1], "pin", "{id}");
        answer_last_pick(&mut f, &mut host, "10.0.0.1:8000", 0);
    }
    assert_eq!(host.counters.get("ai_lb_prefix_response_unknown"), Some(&2));
}

#[test]
fn a_response_made_while_the_breaker_is_open_is_written_to_redis_when_it_closes() {
    let (mut f, mut host) = setup(&cfg(r#","breakerFailures":1"#));
    send_body(&mut f, &mut host, 1, r#"{"model":"m","input":"Hi"}"#);
    let t = host.last_redis_token().unwrap();
    deliver(&mut f, &mut host, t, RedisReply::NetworkError);
    f.on_stream_end(&mut host, 1);
    // Open: decided without Redis, and its response's record waits.
    let calls = host.redis_calls.len();
    send_body(&mut f, &mut host, 2, r#"{"model":"m","input":"Hello"}"#);
    reply_from(&mut f, &mut host, 2, "10.0.0.2:8000", "200", &[r#"{"id":"resp_out"}"#]);
    f.on_stream_end(&mut host, 2);
    assert_eq!(host.redis_calls.len(), calls, "nothing sent while the breaker is open");
    assert_eq!(host.counters.get("ai_lb_prefix_response_recorded"), Some(&1));
    // The tick's probe after breakerOpenMs; Redis answers: the record goes out.
    host.now += 1_000_000_000;
    f.on_tick(&mut host);
    let probe = host.last_redis_token().unwrap();
    f.on_redis_reply(&mut host, probe, &RedisReply::Ok(b":1\r\n".to_vec()), false);
    let w = writes(&host);
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].0.ends_with(&response_chain_value("resp_out")), "{w:?}");
    assert!(w[0].1.starts_with("10.0.0.2:8000@"), "{w:?}");
}

#[test]
fn a_record_that_got_no_answer_is_sent_again_once_redis_answers() {
    let (mut f, mut host) = setup(&cfg(""));
    send_body(&mut f, &mut host, 1, r#"{"model":"m","input":"Hi"}"#);
    answer_last_pick(&mut f, &mut host, "10.0.0.2:8000", 0);
    reply_from(&mut f, &mut host, 1, "10.0.0.2:8000", "200", &[r#"{"id":"resp_lost"}"#]);
    f.on_stream_end(&mut host, 1);
    assert_eq!(writes(&host).len(), 1);
    // The connection drops before the SET's answer: it waits, and goes again with the next answer.
    let set = last_set_token(&host);
    deliver(&mut f, &mut host, set, RedisReply::NetworkError);
    assert_eq!(writes(&host).len(), 1, "not resent into a failing connection");
    send_body(&mut f, &mut host, 2, r#"{"model":"m","input":"Other"}"#);
    answer_last_pick(&mut f, &mut host, "10.0.0.1:8000", 0);
    let w = writes(&host);
    assert_eq!(w.len(), 2, "{w:?}");
    assert_eq!(w[0], w[1], "the same write again");
    // An error answer is not a lost write: Redis refused it, and it is not sent again.
    let refused = RedisReply::Ok(b"-OOM command not allowed\r\n".to_vec());
    let set = last_set_token(&host);
    deliver(&mut f, &mut host, set, refused);
    send_body(&mut f, &mut host, 3, r#"{"model":"m","input":"More"}"#);
    answer_last_pick(&mut f, &mut host, "10.0.0.1:8000", 0);
    assert_eq!(writes(&host).len(), 2);
}

/// The token of the last `SET` sent.
fn last_set_token(host: &FakeHost) -> u32 {
    let n = (0..host.redis_calls.len()).rev().find(|&n| command(host, n)[0] == "SET").unwrap();
    host.redis_calls[n].token
}

/// Streams 1 and 2 make stored responses: `resp_a` on .2 (healthy) and `resp_b` on .3 (unhealthy in
/// [`setup`]'s host list).
fn record_two_responses(f: &mut Filter, host: &mut FakeHost) {
    for (ctx, pod, id) in [(1, "10.0.0.2:8000", "resp_a"), (2, "10.0.0.3:8000", "resp_b")] {
        send_body(f, host, ctx, r#"{"model":"m","input":"Hi"}"#);
        answer_last_pick(f, host, pod, 0);
        let reply = format!(r#"{{"id":"{id}","object":"response"}}"#);
        reply_from(f, host, ctx, pod, "200", &[&reply]);
        f.on_stream_end(host, ctx);
    }
}

/// Every healthy candidate of a new conversation's pick (sorted); the pick is answered.
fn candidates_of_new_request(f: &mut Filter, host: &mut FakeHost) -> Vec<String> {
    send_body(f, host, 99, r#"{"model":"m","input":"Warm up"}"#);
    let mut all = candidates_of(host, host.redis_calls.len() - 1);
    all.sort();
    answer_last_pick(f, host, "10.0.0.1:8000", 0);
    f.on_stream_end(host, 99);
    all
}

#[test]
fn a_streamed_reply_is_recorded_once_its_id_has_come_whole() {
    let (mut f, mut host) = setup(&cfg(""));
    send_body(&mut f, &mut host, 7, r#"{"model":"m","input":"Hi","stream":true}"#);
    answer_last_pick(&mut f, &mut host, "10.0.0.1:8000", 0);
    reply_from(&mut f, &mut host, 7, "10.0.0.1:8000", "200", &[
        "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_s",
        "tream9\",\"object\":\"response\"}}\n\n",
        "event: response.output_text.delta\ndata: {\"item_id\":\"msg_1\",\"delta\":\"Hi\"}\n\n",
        "event: response.completed\ndata: {\"response\":{\"id\":\"resp_stream9\"}}\n\n",
    ]);
    let w = writes(&host);
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].0.ends_with(&response_chain_value("resp_stream9")), "{w:?}");
    assert_eq!(host.counters.get("ai_lb_prefix_response_recorded"), Some(&1));
}

#[test]
fn nothing_is_recorded_for_an_error_an_unstored_response_or_a_chat() {
    let (mut f, mut host) = setup(&cfg(""));
    let cases = [
        // A 404 (vLLM: the previous response is not on this pod): nothing was stored.
        (
            r#"{"model":"m","previous_response_id":"resp_x","input":"Hi"}"#,
            "404",
            r#"{"error":{"message":"Response with id 'resp_x' not found."}}"#,
        ),
        // Not stored.
        (
            r#"{"model":"m","input":"Hi","store":false}"#,
            "200",
            r#"{"id":"resp_y","object":"response"}"#,
        ),
        // A chat completion has an id too.
        (CHAT, "200", r#"{"id":"chatcmpl-1","object":"chat.completion"}"#),
    ];
    for (ctx, (body, status, reply)) in (1..).zip(cases) {
        send_body(&mut f, &mut host, ctx, body);
        answer_last_pick(&mut f, &mut host, "10.0.0.1:8000", 0);
        reply_from(&mut f, &mut host, ctx, "10.0.0.1:8000", status, &[reply]);
    }
    // The first named a response no pod was recorded for.
    assert_eq!(host.counters.get("ai_lb_prefix_response_unknown"), Some(&1));
    assert_eq!(writes(&host), vec![]);
    assert_eq!(host.counters.get("ai_lb_prefix_response_recorded"), None);
}

#[test]
fn a_pinned_request_goes_without_load_arguments() {
    let (mut f, mut host) = setup(&cfg(r#","loadAware":true"#));
    set_hosts_with_metrics(&mut host, vllm_metrics(8, 12, 0.5), vllm_metrics(1, 0, 0.1));
    send_body(&mut f, &mut host, 1, r#"{"model":"m","input":"Hi"}"#);
    assert!(load_args_of(&host, 0).is_some(), "a new conversation is load-aware");
    send_body(
        &mut f,
        &mut host,
        2,
        r#"{"model":"m","previous_response_id":"resp_1","input":"Hi"}"#,
    );
    assert_eq!(load_args_of(&host, 1), None, "its pod is taken whatever its load");
    assert_eq!(host.counters.get("ai_lb_prefix_load_unknown"), None);
}

#[test]
fn without_redis_a_continued_request_goes_to_the_pod_the_gateway_recorded() {
    let (mut f, mut host) = setup(&cfg(""));
    // Two responses recorded: one by .2 (healthy), one by .3 (unhealthy).
    record_two_responses(&mut f, &mut host);
    // Redis fails each pick: the request naming .2's response still goes to .2.
    let cases = [("resp_a", Some("10.0.0.2:8000")), ("resp_b", None), ("resp_never_seen", None)];
    for (ctx, (id, pod)) in (3..).zip(cases) {
        host.override_host = None;
        let body = format!(r#"{{"model":"m","previous_response_id":"{id}","input":"More"}}"#);
        send_body(&mut f, &mut host, ctx, &body);
        let t = host.last_redis_token().unwrap();
        deliver(&mut f, &mut host, t, RedisReply::NetworkError);
        assert_eq!(host.override_host.as_deref(), pod, "{id}");
    }
    assert_eq!(host.counters.get("ai_lb_prefix_response_followed"), Some(&1));
    assert_eq!(host.counters.get("ai_lb_prefix_response_unknown"), Some(&2), "unhealthy, unknown");
}

/// Two chats with the same messages, for the models and the cache isolation fields given (JSON
/// members, each with its comma).
fn chat_for(extra: &str) -> String {
    format!(
        r#"{{{extra}"messages":[{{"role":"system","content":"S"}},{{"role":"user","content":"Q1"}},{{"role":"assistant","content":"A1"}},{{"role":"user","content":"Q2"}}]}}"#
    )
}

fn keys_for(extra: &str, rules: KeyRules) -> Vec<String> {
    prompt_from_body(chat_for(extra).as_bytes(), rules).expect("a chat").keys
}

/// `scopedKeys`: the keys' rules with the scope on.
fn scoped_rules() -> KeyRules {
    KeyRules { scoped: true, ..KeyRules::default() }
}

/// vLLM hashes a request's LoRA adapter and `cache_salt` into its KV blocks, SGLang keys its radix
/// tree by them (and by `extra_key`): the same messages for another adapter or salt find nothing
/// cached, so scoped keys share no key with them.
#[test]
fn scoped_keys_are_apart_for_each_model_and_cache_salt() {
    let rules = scoped_rules();
    let adapter_a = keys_for(r#""model":"sql-lora","#, rules);
    let adapter_b = keys_for(r#""model":"chat-lora","#, rules);
    assert_eq!(adapter_a.len(), 2);
    assert!(adapter_a.iter().all(|k| !adapter_b.contains(k)), "{adapter_a:?} {adapter_b:?}");
    assert_eq!(adapter_a, keys_for(r#""model":"sql-lora","stream":true,"#, rules));
    // A longer conversation of one adapter still extends its own chain.
    let longer = r#"{"model":"sql-lora","messages":[{"role":"system","content":"S"},{"role":"user","content":"Q1"},{"role":"assistant","content":"A1"},{"role":"user","content":"Q2"},{"role":"assistant","content":"A2"},{"role":"user","content":"Q3"}]}"#;
    let longer = prompt_from_body(longer.as_bytes(), rules).unwrap().keys;
    assert_eq!(longer[..2], adapter_a[..]);

    // The salt (vLLM, SGLang) and SGLang's extra key scope the keys too.
    let salted = keys_for(r#""model":"sql-lora","cache_salt":"tenant-1","#, rules);
    let other_salt = keys_for(r#""model":"sql-lora","cache_salt":"tenant-2","#, rules);
    let extra_key = keys_for(r#""model":"sql-lora","extra_key":"tenant-1","#, rules);
    for (a, b) in [(&salted, &adapter_a), (&salted, &other_salt), (&salted, &extra_key)] {
        assert!(a.iter().all(|k| !b.contains(k)), "{a:?} {b:?}");
    }
    assert_eq!(
        blocks_from_body(chat_for(r#""model":"m","cache_salt":"t\u00e9","#).as_bytes(), rules)
            .unwrap()[0],
        "model=m\ncache_salt=t\u{e9}\nsystem:Suser:Q1"
    );
    // A batch's list of salts scopes the prompt as a whole.
    assert_ne!(
        keys_for(r#""extra_key":["a","b"],"#, rules),
        keys_for(r#""extra_key":["a","c"],"#, rules)
    );

    // Null and empty fields scope nothing: such a request's keys are the Go plugin's (the
    // messages' text alone), and so are every request's without `scopedKeys`.
    let go_keys = chain(&blocks_from_body(chat_for("").as_bytes(), cuts(false)).unwrap());
    assert_eq!(keys_for(r#""model":"","cache_salt":null,"#, rules), go_keys);
    for extra in [r#""model":"sql-lora","#, r#""model":"chat-lora","cache_salt":"t","#] {
        assert_eq!(keys_for(extra, KeyRules::default()), go_keys, "{extra}");
    }
}

#[test]
fn a_scope_alone_is_no_prompt_and_a_continued_response_is_not_scoped() {
    let rules = scoped_rules();
    for body in
        [r#"{"model":"m"}"#, r#"{"model":"m","messages":[]}"#, r#"{"model":"m","prompt":""}"#]
    {
        assert_eq!(blocks_from_body(body.as_bytes(), rules), Some(vec![]), "{body}");
    }
    // The first key of a request that continues a stored response is the key the response's pod
    // was recorded under, whatever the model: the response is where it was made.
    for model in ["a", "b"] {
        let body = format!(
            r#"{{"model":"{model}","cache_salt":"s","previous_response_id":"resp_9","input":"More"}}"#
        );
        let p = prompt_from_body(body.as_bytes(), rules).unwrap();
        assert_eq!(p.keys[0], response_chain_value("resp_9"));
        assert_eq!(blocks_from_body(body.as_bytes(), rules).unwrap()[1], "user:More");
    }
}

/// Through the filter: the keys the script is sent are the Go plugin's with a Go config, scoped
/// with `scopedKeys` or `loadAware` (unless `scopedKeys` is false), and a `scopedKeys` that is
/// not a boolean fails the start naming the field.
#[test]
fn scoped_keys_are_configured_and_reach_the_script() {
    let body = chat_for(r#""model":"sql-lora","#);
    let sent = |config: &str| {
        let (mut f, mut host) = setup(&cfg(config));
        send_body(&mut f, &mut host, 1, &body);
        let call = host.redis_calls.last().expect("a script call");
        String::from_utf8_lossy(&call.query).into_owned()
    };
    let go = keys_for("", cuts(false));
    let scoped = prompt_from_body(body.as_bytes(), scoped_rules()).unwrap().keys;
    for (config, keys) in [
        ("", &go),
        (r#","scopedKeys":true"#, &scoped),
        (r#","loadAware":true"#, &scoped),
        (r#","loadAware":true,"scopedKeys":false"#, &go),
    ] {
        let call = sent(config);
        assert!(keys.iter().all(|k| call.contains(k.as_str())), "{config}: {call}");
    }

    let mut host = FakeHost::new();
    let mut f = Filter::new();
    assert!(!f.configure(&mut host, cfg(r#","scopedKeys":"yes""#).as_bytes()));
    assert!(
        host.logs.borrow().iter().any(|l| l.1.contains("scopedKeys")),
        "{:?}",
        host.logs.borrow()
    );
}
