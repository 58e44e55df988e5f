//! Reading a stored response's id from the start of its reply.

use super::*;

#[test]
fn the_id_is_read_from_a_json_reply_and_from_a_streams_first_event() {
    let json = br#"{"id":"resp_68af3c1e","object":"response","created_at":1,"status":"completed"}"#;
    assert_eq!(first_id(json), Some("resp_68af3c1e"));
    // OpenAI's event order (type first) and vLLM's (the response object first).
    let openai = b"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_1\",\"object\":\"response\"}}\n\n";
    assert_eq!(first_id(openai), Some("resp_1"));
    let vllm = b"data: {\"response\": {\"id\": \"resp_9f2\", \"object\": \"response\"}, \"sequence_number\": 0, \"type\": \"response.created\"}\n\n";
    assert_eq!(first_id(vllm), Some("resp_9f2"));
}

#[test]
fn no_id_is_taken_from_text_that_only_looks_like_one() {
    // Inside a string the key is escaped: not a key of the object.
    assert_eq!(first_id(br#"{"instructions":"say \"id\": \"x\"","object":"response"}"#), None);
    // Not a string, empty, with escapes, control characters, or longer than any id.
    assert_eq!(first_id(br#"{"id":17}"#), None);
    assert_eq!(first_id(br#"{"id":""}"#), None);
    assert_eq!(first_id(br#"{"id":"resp_\"x"}"#), None);
    assert_eq!(first_id(b"{\"id\":\"resp_\x01\"}"), None);
    let long = format!(r#"{{"id":"{}"}}"#, "r".repeat(MAX_ID + 1));
    assert_eq!(first_id(long.as_bytes()), None);
    let longest = format!(r#"{{"id":"{}"}}"#, "r".repeat(MAX_ID));
    assert_eq!(first_id(longest.as_bytes()).map(str::len), Some(MAX_ID));
}

#[test]
fn an_id_cut_by_a_chunk_boundary_is_read_once_the_rest_comes() {
    let whole = br#"{"id":"resp_abcdef","object":"response"}"#;
    for cut in 1..whole.len() {
        let head = &whole[..cut];
        // Either not yet readable, or already the whole id: never a piece of it.
        match first_id(head) {
            None => {}
            Some(id) => assert_eq!(id, "resp_abcdef", "cut at {cut}"),
        }
    }
    assert_eq!(first_id(whole), Some("resp_abcdef"));
}

#[test]
fn the_gateways_own_record_gives_back_the_pod_of_the_id_it_holds() {
    let mut host = crate::host::fake::FakeHost::new();
    assert_eq!(recall(&host, "resp_1"), None);
    remember(&mut host, "resp_1", "10.0.0.1:8000");
    remember(&mut host, "resp_2", "10.0.0.2:8000");
    assert_eq!(recall(&host, "resp_1").as_deref(), Some("10.0.0.1:8000"));
    assert_eq!(recall(&host, "resp_2").as_deref(), Some("10.0.0.2:8000"));
    // Ids sharing a bucket: the last RECORD_WAYS are kept, the oldest forgotten, never given
    // another's pod.
    let slot = record_key("resp_1");
    let rivals: Vec<String> = (0..2_000_000)
        .map(|i| format!("resp_{i}x"))
        .filter(|id| record_key(id) == slot)
        .take(RECORD_WAYS)
        .collect();
    assert_eq!(rivals.len(), RECORD_WAYS, "ids sharing the bucket");
    for (i, rival) in rivals.iter().enumerate() {
        remember(&mut host, rival, &format!("10.0.1.{i}:8000"));
        let kept = i + 1 < RECORD_WAYS;
        assert_eq!(recall(&host, "resp_1").is_some(), kept, "after {} rivals", i + 1);
    }
    assert_eq!(recall(&host, "resp_1"), None);
    for (i, rival) in rivals.iter().enumerate() {
        assert_eq!(recall(&host, rival), Some(format!("10.0.1.{i}:8000")));
    }
    // The same id written again is moved first, not held twice.
    remember(&mut host, &rivals[0], "10.0.1.9:8000");
    assert_eq!(recall(&host, &rivals[0]).as_deref(), Some("10.0.1.9:8000"));
    assert_eq!(recall(&host, &rivals[1]).as_deref(), Some("10.0.1.1:8000"));
    let (bucket, _) = host.get_shared_data(&slot);
    assert_eq!(String::from_utf8(bucket.unwrap()).unwrap().lines().count(), RECORD_WAYS);
}

#[test]
fn a_bucket_written_by_another_worker_meanwhile_keeps_both_writes() {
    // The CAS read before the write is stale once another worker wrote: the write is retried on
    // the new value, so no response is lost. (A bucket's first write has no CAS to check: the ABI
    // reads a missing key with CAS 0, which writes unconditionally.)
    let mut host = crate::host::fake::FakeHost::new();
    let slot = record_key("resp_1");
    let rivals: Vec<String> = (0..2_000_000)
        .map(|i| format!("resp_{i}x"))
        .filter(|id| record_key(id) == slot)
        .take(2)
        .collect();
    remember(&mut host, &rivals[0], "10.0.0.8:8000");
    let other_worker = format!("{} 10.0.0.9:8000\n{} 10.0.0.8:8000", rivals[1], rivals[0]);
    host.shared_data_write_before_next_set = Some((slot, other_worker));
    remember(&mut host, "resp_1", "10.0.0.1:8000");
    assert_eq!(recall(&host, "resp_1").as_deref(), Some("10.0.0.1:8000"));
    assert_eq!(recall(&host, &rivals[1]).as_deref(), Some("10.0.0.9:8000"));
    assert_eq!(recall(&host, &rivals[0]).as_deref(), Some("10.0.0.8:8000"));
}
