//! Redis with a password and a non-zero database, as production Redis usually is configured
//! (`username`, `password`, `database` in `lb_config`).

use std::time::{Duration, Instant};

use e2e::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_and_database_are_used() {
    let redis = RedisFixture::start_with_password("s3cret-pw").await.unwrap();
    let pods = start_pods("auth", 3).await.unwrap();
    let cfg = redis_policy_config(
        "route-auth",
        &pods,
        &redis,
        "prefix_cache",
        json!({"username": "default", "password": "s3cret-pw", "database": 2, "timeout": 1000}),
    );
    let gw = Gateway::start(&cfg).await.unwrap();
    let mut conv = Conversation::new("authenticated redis");
    let home = conv.turn(&gw, "first").await.unwrap();
    for turn in 2..=4 {
        assert_eq!(conv.turn(&gw, &format!("turn {turn}")).await.unwrap(), home);
    }
    let mut c = redis.client().await.unwrap();
    assert!(c.keys("*").await.unwrap().is_empty(), "keys were written to database 0");
    c.cmd(&["SELECT", "2"]).await.unwrap();
    let keys = c.keys("*:pfx:*").await.unwrap();
    assert_eq!(keys.len(), 4, "prefix keys in database 2: {keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_still_serves_every_request() {
    let redis = RedisFixture::start_with_password("right-pw").await.unwrap();
    let pods = start_pods("noauth", 2).await.unwrap();
    let cfg = redis_policy_config(
        "route-noauth",
        &pods,
        &redis,
        "global_least_request",
        json!({"username": "default", "password": "wrong-pw", "timeout": 1000}),
    );
    let gw = Gateway::start(&cfg).await.unwrap();
    let mut seen = Vec::new();
    for i in 0..6 {
        let started = Instant::now();
        let r = chat_once(&gw, &format!("q{i}")).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "request {i} took {:?}",
            started.elapsed()
        );
        seen.push(r.upstream().unwrap());
    }
    assert_eq!(tally(&seen).len(), 2, "normal balancing uses both pods: {:?}", named(&pods, &seen));
    assert!(redis.client().await.unwrap().keys("*").await.unwrap().is_empty());
}
