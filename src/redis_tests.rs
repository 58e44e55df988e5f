//! RESP encoding and decoding, scripts, the Redis client's init and retries.

use super::*;

#[test]
fn encodes_command_as_array_of_bulk_strings() {
    let q = encode_command(&["HINCRBY", "k", "10.0.0.1:80", "-1"]);
    assert_eq!(q, b"*4\r\n$7\r\nHINCRBY\r\n$1\r\nk\r\n$11\r\n10.0.0.1:80\r\n$2\r\n-1\r\n".to_vec());
}

#[test]
fn binary_safe_arguments() {
    let q = encode_command(&[&b"SET"[..], &b"a\r\nb"[..], &[0u8, 255][..]]);
    assert_eq!(q, b"*3\r\n$3\r\nSET\r\n$4\r\na\r\nb\r\n$2\r\n\x00\xff\r\n".to_vec());
}

#[test]
fn decodes_replies() {
    assert_eq!(decode_reply(b":42\r\n"), Ok(Frame::Integer(42)));
    assert_eq!(decode_reply(b"$-1\r\n"), Ok(Frame::Null));
    assert_eq!(decode_reply(b"+OK\r\n"), Ok(Frame::SimpleString(b"OK".to_vec())));
    assert_eq!(
        decode_reply(b"*3\r\n$5\r\nh:1\r\n\r\n:3\r\n:1\r\n"),
        Ok(Frame::Array(vec![
            Frame::BulkString(b"h:1\r\n".to_vec()),
            Frame::Integer(3),
            Frame::Integer(1)
        ]))
    );
    let e = decode_reply(b"-NOSCRIPT No matching script. Please use EVAL.\r\n").unwrap();
    assert!(is_noscript(&e));
    assert!(!is_noscript(&Frame::Error("ERR x".into())));
}

#[test]
fn rejects_truncated_or_garbage_replies() {
    assert!(decode_reply(b"*2\r\n:1\r\n").is_err());
    assert!(decode_reply(b"").is_err());
    assert!(decode_reply(b"?what\r\n").is_err());
}

#[test]
fn script_sha_is_sha1_of_source() {
    // SHA-1("abc") = a9993e36..., FIPS 180 test vector.
    assert_eq!(sha1_hex_lower(b"abc"), "a9993e364706816aba3e25717850c26c9cd0d89d");
    // What Redis names a script: the lower-case hex SHA-1 of its source (vector from Python's
    // hashlib.sha1(b"return 1")).
    assert_eq!(Script::new("return 1").sha, "e0e1f9fabfc9d4800c877a703b823ac0578ff8db");
    let s = Script::new(LEAST_REQUEST_LUA.as_str());
    let cmd = s.command(&["k1".into()], &["a".into()], false);
    let f = decode_reply(&cmd).unwrap();
    let Frame::Array(parts) = f else { panic!("not an array") };
    assert_eq!(parts[0], Frame::BulkString(b"EVALSHA".to_vec()));
    assert_eq!(parts[1], Frame::BulkString(s.sha.as_bytes().to_vec()));
    assert_eq!(parts[2], Frame::BulkString(b"1".to_vec()));
    let eval = decode_reply(&s.command(&["k1".into()], &[], true)).unwrap();
    let Frame::Array(parts) = eval else { panic!("not an array") };
    assert_eq!(parts[1], Frame::BulkString(LEAST_REQUEST_LUA.as_str().as_bytes().to_vec()));
}

#[test]
fn keys_share_one_hash_tag() {
    let a = inflight_key("r1", "outbound|8000||llm.static");
    let b = prefix_key("r1", "outbound|8000||llm.static", "AB");
    assert_eq!(a, "higress:ai-lb:{r1|outbound|8000||llm.static}:inflight");
    assert_eq!(b, "higress:ai-lb:{r1|outbound|8000||llm.static}:pfx:AB");
    let tag = |k: &str| {
        let s = k.find('{').unwrap();
        let e = k[s..].find('}').unwrap() + s;
        k[s + 1..e].to_string()
    };
    assert_eq!(tag(&a), tag(&b));
    assert_eq!(tag(&a), tag(&last_clean_key("r1", "outbound|8000||llm.static")));
}

#[test]
fn init_cluster_has_db_only_when_nonzero() {
    let mut cfg = RedisConfig {
        service_fqdn: "redis.static".into(),
        service_port: 6379,
        username: "u".into(),
        password: "p".into(),
        timeout_ms: 3000,
        database: 0,
        buffer_flush_timeout_ms: 0,
        max_buffer_size_before_flush: 0,
    };
    assert_eq!(cfg.cluster(), "outbound|6379||redis.static");
    assert_eq!(
        RedisClient::new(cfg.clone()).init_cluster(),
        "outbound|6379||redis.static?buffer_flush_timeout=0&max_buffer_size_before_flush=0"
    );
    cfg.database = 2;
    cfg.buffer_flush_timeout_ms = 3;
    cfg.max_buffer_size_before_flush = 1024;
    assert_eq!(cfg.cluster(), "outbound|6379||redis.static?db=2");
    assert_eq!(
        RedisClient::new(cfg).init_cluster(),
        "outbound|6379||redis.static?db=2&buffer_flush_timeout=3&max_buffer_size_before_flush=1024"
    );
}

#[test]
fn failed_init_is_retried_after_a_while_not_on_every_request() {
    let cfg = RedisConfig {
        service_fqdn: "redis.static".into(),
        service_port: 6379,
        username: String::new(),
        password: String::new(),
        timeout_ms: 50,
        database: 0,
        buffer_flush_timeout_ms: 0,
        max_buffer_size_before_flush: 0,
    };
    let mut host = crate::host::fake::FakeHost::new();
    host.redis_init_error = Some(HostError::BadArgument);
    let mut c = RedisClient::new(cfg);
    assert!(!c.init(&mut host));
    assert!(c.call(&mut host, b"x").is_err());
    assert_eq!(host.redis_inits.len(), 1, "no retry within 5 s");
    host.now += 6_000_000_000;
    host.redis_init_error = None;
    assert!(c.call(&mut host, b"*1\r\n$4\r\nPING\r\n").is_ok());
    assert_eq!(host.redis_inits.len(), 2);
    assert_eq!(host.redis_inits[1].timeout_ms, 50);
}

#[test]
fn pick_scripts_have_the_lease_steps_spliced_in_once_and_define_at_most_one_function() {
    for (name, script, functions) in
        [("least_request", &*LEAST_REQUEST_LUA, 0), ("prefix_cache", &*PREFIX_CACHE_LUA, 1)]
    {
        assert!(script.starts_with(PRELUDE_LUA), "{name}: the prelude first");
        assert_eq!(script.matches(PICK_SETTLE_LUA).count(), 1, "{name}: pick_settle.lua once");
        assert_eq!(script.matches(PICK_COMMIT_LUA).count(), 1, "{name}: pick_commit.lua once");
        let marker_left = script.lines().any(|l| l.trim_start().starts_with("--@"));
        assert!(!marker_left, "{name}: a marker line left in");
        // Redis makes each function a script defines anew at every call (see pick_settle.lua).
        let code = script.lines().filter(|l| !l.trim_start().starts_with("--"));
        let defined: usize = code.map(|l| l.matches("function").count()).sum();
        assert_eq!(defined, functions, "{name}: functions defined");
    }
}
