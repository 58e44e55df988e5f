//! Reading the engine's cache report and counting the guess against it.

use super::*;

#[test]
fn reads_the_usage_of_a_json_reply_and_of_a_stream() {
    let json = br#"{"choices":[{"message":{"content":"prompt_tokens"}}],"usage":{"prompt_tokens":812,"completion_tokens":9,"total_tokens":821,"prompt_tokens_details":{"cached_tokens":768}}}"#;
    assert_eq!(usage_tokens(json), Some((812, 768)));
    let sse = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\": 40, \"prompt_tokens_details\": {\"cached_tokens\": 0}}}\n\ndata: [DONE]\n\n";
    assert_eq!(usage_tokens(sse), Some((40, 0)));
    let responses = b"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"status\":\"completed\",\"usage\":{\"input_tokens\":2048,\"input_tokens_details\":{\"cached_tokens\":1920},\"output_tokens\":80,\"total_tokens\":2128}}}\n\n";
    assert_eq!(usage_tokens(responses), Some((2048, 1920)), "the Responses API's names");
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
        br#"{"usage":{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":0}}}"#.to_vec();
    miss.on_chunk(&host, host.response_body.len());
    miss.finish(&mut host);
    assert_eq!(host.counters.get("ai_lb_predicted_miss_engine_miss"), Some(&1));
}
