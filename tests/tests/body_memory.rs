//! Memory the plugin needs to split a long chat into prefix blocks: the body (up to
//! `maxBodyBytes`, 4 MiB by default) is read for its messages only, never as a whole JSON tree.
//! Measured with dhat's heap statistics on the plugin's own code (the same code runs in the .wasm;
//! its linear memory also holds the 4 MiB body copy the host hands over). One test per binary: the
//! global allocator counts every thread.

use ai_load_balancer::policy::prefix_cache::{blocks_from_body, chain};
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
fn a_4_mib_chat_is_split_without_a_json_tree() {
    let body = long_chat(4 * 1024 * 1024 - 16 * 1024);
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    let _profiler = dhat::Profiler::builder().testing().build();

    let keys = {
        let blocks = blocks_from_body(&body, false).expect("a chat");
        chain(&blocks)
    };
    let ours = dhat::HeapStats::get().max_bytes;
    assert!(keys.len() > 100, "{} keys", keys.len());

    // What the plugin used to do, for comparison: the body as a full JSON tree, alive while the
    // blocks are built.
    let tree: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    let blocks = blocks_from_body(&body, false).expect("a chat");
    drop((tree, blocks));
    let with_tree = dhat::HeapStats::get().max_bytes;

    println!(
        "body {:.2} MiB: splitting and hashing peaks at {:.2} MiB of heap; with a JSON tree of the body at {:.2} MiB",
        mib(body.len()),
        mib(ours),
        mib(with_tree)
    );
    // The blocks hold the conversation's text once (about the body's size); nothing else of the
    // body's size may be kept at the same time.
    assert!(
        (ours as f64) < 1.25 * body.len() as f64,
        "splitting a {:.2} MiB body peaked at {:.2} MiB",
        mib(body.len()),
        mib(ours)
    );
    assert!(
        with_tree as f64 > 1.8 * ours as f64,
        "the tree ({with_tree} B) should cost about twice ours ({ours} B)"
    );
}
