//! Memory the plugin needs to split a long chat into hashed prefix blocks: the body (up to
//! `maxBodyBytes`, 4 MiB by default) is read for its messages only, never as a whole JSON tree.
//! Measured with dhat's heap statistics on the plugin's own code (the same code runs in the .wasm;
//! its linear memory also holds the 4 MiB body copy the host hands over). One test per binary: the
//! global allocator counts every thread.

use ai_load_balancer::config::KeyRules;
use ai_load_balancer::policy::prefix_cache::{blocks_from_body, chain, prompt_from_body};
use serde_json::json;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

/// A chat of alternating user/assistant turns, about `size` bytes of JSON.
fn long_chat(size: usize) -> Vec<u8> {
    let turn = "The quick brown fox jumps over the lazy dog. ".repeat(200);
    let mut messages = vec![json!({"role": "system", "content": "You are a helpful assistant."})];
    let mut i = 0;
    while serde_json::to_vec(&messages).map(|v| v.len()).unwrap_or(0) + turn.len() < size {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(json!({"role": role, "content": format!("{i}: {turn}")}));
        i += 1;
    }
    serde_json::to_vec(&json!({"model": "m", "stream": true, "messages": messages})).unwrap()
}

#[test]
fn a_4_mib_chat_is_routed_without_a_copy_of_its_conversation() {
    let body = long_chat(4 * 1024 * 1024 - 16 * 1024);
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    let _profiler = dhat::Profiler::builder().testing().build();

    // What the plugin does: each block hashed as the body is read (dhat's peak only grows, so the
    // cheapest way is measured first).
    let prompt = prompt_from_body(&body, KeyRules::default()).expect("a chat");
    let ours = dhat::HeapStats::get().max_bytes;
    assert!(prompt.keys.len() > 100, "{} keys", prompt.keys.len());

    // The same split as text, as the plugin built it before: the blocks hold the conversation once.
    let keys = {
        let blocks = blocks_from_body(&body, KeyRules::default()).expect("a chat");
        chain(&blocks)
    };
    assert_eq!(keys, prompt.keys);
    let as_text = dhat::HeapStats::get().max_bytes;

    // Before that: the body as a full JSON tree, alive while the blocks are built.
    let tree: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    let blocks = blocks_from_body(&body, KeyRules::default()).expect("a chat");
    drop((tree, blocks));
    let with_tree = dhat::HeapStats::get().max_bytes;

    println!(
        "body {:.2} MiB: hashing as read peaks at {:.3} MiB of heap; building the blocks' text at {:.2} MiB; with a JSON tree of the body at {:.2} MiB",
        mib(body.len()),
        mib(ours),
        mib(as_text),
        mib(with_tree)
    );
    // Its text has no escapes, so nothing of the conversation is copied: what is left is a small
    // entry per message and the keys.
    assert!(
        (ours as f64) < 0.1 * body.len() as f64,
        "routing a {:.2} MiB body peaked at {:.2} MiB",
        mib(body.len()),
        mib(ours)
    );
    assert!(
        as_text as f64 > 0.9 * body.len() as f64,
        "the blocks' text ({as_text} B) holds the conversation once"
    );
    assert!(
        with_tree as f64 > 1.8 * as_text as f64,
        "the tree ({with_tree} B) should cost about twice the text ({as_text} B)"
    );
}
