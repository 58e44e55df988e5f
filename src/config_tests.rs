//! Config parsing: Go defaults, every error names its field and the accepted values.

use super::*;

fn parse(s: &str) -> Result<PluginConfig, ConfigError> {
    PluginConfig::from_json(s.as_bytes())
}

/// The rule a request gets, as the dispatcher chooses it: the first rule that matches, else the
/// top-level config (index `rules.len()`).
trait Select {
    fn select(&self, input: &MatchInput<'_>) -> Option<(usize, &LbConfig)>;
}

impl Select for PluginConfig {
    fn select(&self, input: &MatchInput<'_>) -> Option<(usize, &LbConfig)> {
        match self.rules.iter().position(|r| r.matcher.matches(input)) {
            Some(i) => self.rules.get(i).map(|r| (i, &r.config)),
            None => self.default.as_ref().map(|d| (self.rules.len(), d)),
        }
    }
}

fn glr(extra: &str) -> String {
    format!(
        r#"{{"lb_policy":"global_least_request","lb_config":{{"serviceFQDN":"redis.static","servicePort":6379{extra}}}}}"#
    )
}

fn prefix(extra: &str) -> String {
    format!(
        r#"{{"lb_policy":"prefix_cache","lb_config":{{"serviceFQDN":"r","servicePort":1{extra}}}}}"#
    )
}

fn expect_err(json: &str, field: &str, needle: &str) {
    let e = parse(json).expect_err("config should be rejected");
    assert_eq!(e.field, field, "wrong field for {json}: {e}");
    let text = e.to_string();
    assert!(text.contains(field), "{text}");
    assert!(text.contains(needle), "message {text:?} should contain {needle:?}");
}

#[test]
fn go_defaults_for_global_least_request() {
    let c = parse(&glr("")).unwrap();
    let d = c.default.unwrap();
    assert_eq!(d.lb_type, LbType::Endpoint);
    assert_eq!(d.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
    let PolicyConfig::GlobalLeastRequest(g) = d.policy else { panic!("wrong policy") };
    assert_eq!(g.redis.timeout_ms, 3000);
    assert_eq!(g.redis.database, 0);
    assert_eq!(g.redis.username, "");
    assert_eq!(g.redis.password, "");
    assert_eq!(g.max_request_count, 0);
    assert_eq!(g.clean_interval_min, 60);
    assert!(g.enable_detail_log);
    assert_eq!(g.redis.cluster(), "outbound|6379||redis.static");
}

#[test]
fn prefix_cache_keys_and_database_in_cluster_name() {
    let c = parse(r#"{"lb_policy":"prefix_cache","lb_config":{"serviceFQDN":"redis.dns","servicePort":"6380","username":"default","password":123456,"timeout":500,"database":3,"redisKeyTTL":60,"maxRequestCount":8,"cleanInterval":5,"enableDetailLog":false,"hitLoadFactor":1.5,"maxBodyBytes":1024}}"#).unwrap();
    let d = c.default.unwrap();
    assert_eq!(d.max_body_bytes, 1024);
    let PolicyConfig::PrefixCache(p) = d.policy else { panic!("wrong policy") };
    assert_eq!(p.redis_key_ttl_s, 60);
    assert_eq!(p.hit_load_factor, 1.5);
    let g = p.least_request;
    assert_eq!(g.redis.cluster(), "outbound|6380||redis.dns?db=3");
    assert_eq!(g.redis.password, "123456");
    assert_eq!(g.redis.timeout_ms, 500);
    assert_eq!(g.max_request_count, 0, "Go's prefix_cache never reads maxRequestCount");
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert!(c.warnings[0].contains("lb_config.maxRequestCount"), "{:?}", c.warnings);
    assert_eq!(g.clean_interval_min, 5);
    assert!(!g.enable_detail_log);
    let c =
        parse(r#"{"lb_policy":"prefix_cache","lb_config":{"serviceFQDN":"r","servicePort":1}}"#)
            .unwrap();
    let PolicyConfig::PrefixCache(p) = c.default.unwrap().policy else { panic!() };
    assert_eq!(p.redis_key_ttl_s, 1800);
}

#[test]
fn metrics_based_is_an_alias_of_endpoint_metrics() {
    for name in ["endpoint_metrics", "metrics_based"] {
        let c = parse(&format!(r#"{{"lb_policy":"{name}","lb_config":{{}}}}"#)).unwrap();
        let PolicyConfig::EndpointMetrics(e) = c.default.unwrap().policy else {
            panic!("wrong policy")
        };
        assert_eq!(e.metric_policy, MetricPolicy::Default);
        assert_eq!(e.rate_limit, 1.0);
        assert_eq!(e.window_size, 100);
        assert_eq!(e.window_seconds, 60);
    }
    let c = parse(r#"{"lb_policy":"endpoint_metrics","lb_config":{"metric_policy":"least","target_metric":"vllm:num_requests_waiting","rate_limit":0.5}}"#).unwrap();
    let PolicyConfig::EndpointMetrics(e) = c.default.unwrap().policy else { panic!() };
    assert_eq!(e.metric_policy, MetricPolicy::Least);
    assert_eq!(e.target_metric.as_deref(), Some("vllm:num_requests_waiting"));
    assert_eq!(e.rate_limit, 0.5);
}

#[test]
fn cluster_metrics_defaults() {
    let c = parse(r#"{"lb_type":"cluster","lb_policy":"cluster_metrics","lb_config":{"mode":"LeastBusy","service_list":["outbound|80||a.dns","outbound|80||b.dns"]}}"#).unwrap();
    let d = c.default.unwrap();
    assert_eq!(d.lb_type, LbType::Cluster);
    let PolicyConfig::ClusterMetrics(m) = d.policy else { panic!() };
    assert_eq!(m.mode, ClusterMode::LeastBusy);
    assert_eq!(m.service_list.len(), 2);
    assert_eq!(m.cluster_header, DEFAULT_CLUSTER_HEADER);
    assert_eq!(m.rate_limit, 1.0);
    assert_eq!(m.queue_size, 100);
}

// ---- one test per field error ----

#[test]
fn error_not_json() {
    expect_err("{", "(root)", "not valid JSON");
}
#[test]
fn error_root_not_object() {
    expect_err("[1]", "(root)", "expected a JSON object");
}
#[test]
fn error_lb_type() {
    expect_err(
        r#"{"lb_type":"pod","lb_policy":"prefix_cache"}"#,
        "lb_type",
        "accepted: endpoint (default), cluster",
    );
}
#[test]
fn error_lb_policy_unknown() {
    expect_err(
        r#"{"lb_policy":"round_robin"}"#,
        "lb_policy",
        "global_least_request, prefix_cache, endpoint_metrics",
    );
}
#[test]
fn error_lb_policy_missing() {
    expect_err(r#"{}"#, "lb_policy", "missing");
}
#[test]
fn error_lb_policy_wrong_type_for_cluster() {
    expect_err(
        r#"{"lb_type":"cluster","lb_policy":"prefix_cache"}"#,
        "lb_policy",
        "accepted: cluster_metrics",
    );
}
#[test]
fn error_lb_policy_not_string() {
    expect_err(r#"{"lb_policy":[5]}"#, "lb_policy", "expected a string");
}
#[test]
fn error_lb_config_not_object() {
    expect_err(
        r#"{"lb_policy":"prefix_cache","lb_config":"x"}"#,
        "lb_config",
        "expected an object",
    );
}
#[test]
fn error_service_fqdn() {
    expect_err(
        r#"{"lb_policy":"prefix_cache","lb_config":{"servicePort":6379}}"#,
        "lb_config.serviceFQDN",
        "required",
    );
}
#[test]
fn error_service_port() {
    expect_err(
        r#"{"lb_policy":"prefix_cache","lb_config":{"serviceFQDN":"r","servicePort":"abc"}}"#,
        "lb_config.servicePort",
        "between 0 and 65535",
    );
    expect_err(
        r#"{"lb_policy":"prefix_cache","lb_config":{"serviceFQDN":"r"}}"#,
        "lb_config.servicePort",
        "required",
    );
    expect_err(
        r#"{"lb_policy":"prefix_cache","lb_config":{"serviceFQDN":"r","servicePort":70000}}"#,
        "lb_config.servicePort",
        "65535",
    );
}
#[test]
fn error_username() {
    expect_err(&glr(r#","username":[1]"#), "lb_config.username", "expected a string");
}
#[test]
fn error_password() {
    expect_err(&glr(r#","password":{}"#), "lb_config.password", "expected a string");
}
#[test]
fn error_database() {
    expect_err(&glr(r#","database":[1]"#), "lb_config.database", "integer");
}
#[test]
fn error_redis_key_ttl() {
    expect_err(&prefix(r#","redisKeyTTL":1.5"#), "lb_config.redisKeyTTL", "integer");
}
#[test]
fn error_max_request_count() {
    expect_err(&glr(r#","maxRequestCount":true"#), "lb_config.maxRequestCount", "integer");
}
#[test]
fn error_clean_interval() {
    expect_err(&glr(r#","cleanInterval":{"every":"hour"}"#), "lb_config.cleanInterval", "integer");
}
#[test]
fn error_max_body_bytes() {
    expect_err(&glr(r#","maxBodyBytes":-1"#), "lb_config.maxBodyBytes", "integer");
}
#[test]
fn error_hit_load_factor() {
    expect_err(&prefix(r#","hitLoadFactor":-2"#), "lb_config.hitLoadFactor", "non-negative number");
}
#[test]
fn error_target_metric() {
    expect_err(
        r#"{"lb_policy":"endpoint_metrics","lb_config":{"metric_policy":"most"}}"#,
        "lb_config.target_metric",
        "required",
    );
}
#[test]
fn error_rate_limit() {
    expect_err(
        r#"{"lb_policy":"endpoint_metrics","lb_config":{"rate_limit":"high"}}"#,
        "lb_config.rate_limit",
        "number",
    );
}
#[test]
fn error_service_list() {
    expect_err(
        r#"{"lb_type":"cluster","lb_policy":"cluster_metrics","lb_config":{"mode":"LeastBusy"}}"#,
        "lb_config.service_list",
        "non-empty",
    );
    expect_err(
        r#"{"lb_type":"cluster","lb_policy":"cluster_metrics","lb_config":{"service_list":"a"}}"#,
        "lb_config.service_list",
        "array of strings",
    );
}
#[test]
fn error_cluster_header() {
    expect_err(
        r#"{"lb_type":"cluster","lb_policy":"cluster_metrics","lb_config":{"service_list":["a"],"cluster_header":1.5e400}}"#,
        "(root)",
        "not valid JSON",
    );
    expect_err(
        r#"{"lb_type":"cluster","lb_policy":"cluster_metrics","lb_config":{"service_list":["a"],"cluster_header":[]}}"#,
        "lb_config.cluster_header",
        "expected a string",
    );
}
#[test]
fn error_queue_size() {
    expect_err(
        r#"{"lb_type":"cluster","lb_policy":"cluster_metrics","lb_config":{"service_list":["a"],"queue_size":[100]}}"#,
        "lb_config.queue_size",
        "integer",
    );
}
#[test]
fn error_rules_not_array() {
    expect_err(r#"{"_rules_":{}}"#, "_rules_", "array");
}
#[test]
fn error_rule_without_matcher() {
    expect_err(&format!(r#"{{"_rules_":[{}]}}"#, glr("")), "_rules_[0]", "_match_route_");
}
#[test]
fn error_rule_matcher_type() {
    expect_err(
        r#"{"_rules_":[{"_match_route_":"r1","lb_policy":"prefix_cache"}]}"#,
        "_rules_[0]._match_route_",
        "array of strings",
    );
}
#[test]
fn error_inside_rule_names_the_rule() {
    expect_err(
        r#"{"_rules_":[{"_match_route_":["r1"],"lb_policy":"prefix_cache","lb_config":{"serviceFQDN":"r","servicePort":0}}]}"#,
        "_rules_[0].lb_config.servicePort",
        "required",
    );
}

// ---- rules ----

#[test]
fn rules_match_route_domain_service_and_prefix_first_wins() {
    let json = r#"{
      "_rules_": [
        {"_match_route_": ["chat-route"], "lb_policy": "prefix_cache", "lb_config": {"serviceFQDN":"redis.static","servicePort":6379}},
        {"_match_domain_": ["*.example.com", "api.test"], "lb_policy": "endpoint_metrics"},
        {"_match_service_": ["llm.static:8000"], "lb_policy": "global_least_request", "lb_config": {"serviceFQDN":"redis.static","servicePort":6379}},
        {"_match_route_prefix_": ["ai-"], "lb_policy": "endpoint_metrics", "lb_config": {"metric_policy":"least","target_metric":"x"}}
      ]
    }"#;
    let c = parse(json).unwrap();
    assert!(c.default.is_none(), "only rules: unmatched requests pass through");
    let sel = |route: &str, authority: &str, cluster: &str| {
        c.select(&MatchInput { route, authority, cluster }).map(|(i, _)| i)
    };
    assert_eq!(sel("chat-route", "api.example.com", "outbound|8000||llm.static"), Some(0));
    assert_eq!(sel("other", "API.Example.com:443", ""), Some(1));
    assert_eq!(sel("other", "api.test", ""), Some(1));
    assert_eq!(sel("other", "example.com", "outbound|8000||llm.static"), Some(2));
    assert_eq!(sel("other", "x", "outbound|9000||llm.static"), None, "port must match");
    assert_eq!(sel("ai-route-1", "x", ""), Some(3));
    assert_eq!(sel("other", "x", ""), None);
}

#[test]
fn rules_inherit_top_level_keys_and_default_applies_otherwise() {
    let json = r#"{"lb_policy":"global_least_request","lb_config":{"serviceFQDN":"redis.static","servicePort":6379},
      "_rules_":[{"_match_route_":["r2"],"lb_policy":"prefix_cache"}]}"#;
    let c = parse(json).unwrap();
    let (i, cfg) = c.select(&MatchInput { route: "r2", authority: "", cluster: "" }).unwrap();
    assert_eq!(i, 0);
    let PolicyConfig::PrefixCache(p) = &cfg.policy else { panic!("rule config") };
    assert_eq!(p.least_request.redis.service_fqdn, "redis.static");
    let (i, cfg) = c.select(&MatchInput { route: "r1", authority: "", cluster: "" }).unwrap();
    assert_eq!(i, 1);
    assert!(matches!(cfg.policy, PolicyConfig::GlobalLeastRequest(_)));
}

#[test]
fn domain_patterns_match_case_insensitively_in_either_direction() {
    // Patterns are lower-cased once when the config is parsed; hosts on every request.
    let json = r#"{"_rules_": [{"_match_domain_": ["*.Example.COM", "API.Test"], "lb_policy": "endpoint_metrics"}]}"#;
    let c = parse(json).unwrap();
    let sel = |authority: &str| {
        c.select(&MatchInput { route: "r", authority, cluster: "" }).map(|(i, _)| i)
    };
    assert_eq!(sel("chat.example.com"), Some(0));
    assert_eq!(sel("CHAT.EXAMPLE.COM:8443"), Some(0));
    assert_eq!(sel("api.test"), Some(0));
    assert_eq!(sel("api.test.evil"), None);
}

/// Configs the Go plugin starts with, each with the meaning Go gives it: they start here too, with
/// Go's meaning and one warning line naming the field.
#[test]
fn go_compatibility_corpus_values_go_tolerates() {
    let glr_of = |json: &str| {
        let c = parse(json).unwrap_or_else(|e| panic!("{json}: {e}"));
        let PolicyConfig::GlobalLeastRequest(g) = c.default.clone().unwrap().policy else {
            panic!("wrong policy")
        };
        (g, c.warnings)
    };
    // (lb_config extra, check, warned field or "" for none)
    type Check = fn(&GlobalLeastRequestConfig) -> bool;
    let cases: Vec<(&str, Check, &str)> = vec![
        (r#","timeout":-5"#, |g| g.redis.timeout_ms == 3000, "timeout"),
        (r#","timeout":0"#, |g| g.redis.timeout_ms == 3000, ""),
        (r#","timeout":"700""#, |g| g.redis.timeout_ms == 700, ""),
        (r#","maxRequestCount":-1"#, |g| g.max_request_count == 0, "maxRequestCount"),
        (r#","maxRequestCount":"12""#, |g| g.max_request_count == 12, ""),
        (r#","cleanInterval":0"#, |g| g.clean_interval_min == 60, ""),
        (r#","cleanInterval":-3"#, |g| g.clean_interval_min == 60, "cleanInterval"),
        (r#","cleanInterval":"15""#, |g| g.clean_interval_min == 15, ""),
        (r#","enableDetailLog":1"#, |g| g.enable_detail_log, "enableDetailLog"),
        (r#","enableDetailLog":0"#, |g| !g.enable_detail_log, "enableDetailLog"),
        (r#","enableDetailLog":"1""#, |g| g.enable_detail_log, "enableDetailLog"),
        (r#","enableDetailLog":"t""#, |g| g.enable_detail_log, "enableDetailLog"),
        (r#","enableDetailLog":"TRUE""#, |g| g.enable_detail_log, "enableDetailLog"),
        (r#","enableDetailLog":"yes""#, |g| !g.enable_detail_log, "enableDetailLog"),
        (r#","enableDetailLog":"false""#, |g| !g.enable_detail_log, ""),
    ];
    for (extra, check, warned) in cases {
        let (g, warnings) = glr_of(&glr(extra));
        assert!(check(&g), "{extra}: {g:?}");
        if warned.is_empty() {
            assert!(warnings.is_empty(), "{extra}: {warnings:?}");
        } else {
            assert_eq!(warnings.len(), 1, "{extra}: {warnings:?}");
            assert!(warnings[0].contains(&format!("lb_config.{warned}")), "{warnings:?}");
        }
    }
    let c =
        parse(r#"{"lb_policy":"endpoint_metrics","lb_config":{"metric_policy":"best"}}"#).unwrap();
    let PolicyConfig::EndpointMetrics(e) = c.default.unwrap().policy else { panic!() };
    assert_eq!(e.metric_policy, MetricPolicy::Default, "Go runs its default chain");
    assert!(c.warnings[0].contains("lb_config.metric_policy"), "{:?}", c.warnings);
    let c = parse(r#"{"lb_type":"cluster","lb_policy":"cluster_metrics","lb_config":{"mode":"Fastest","service_list":["a"],"queue_size":-4}}"#).unwrap();
    let PolicyConfig::ClusterMetrics(m) = c.default.unwrap().policy else { panic!() };
    assert_eq!(m.mode, ClusterMode::Random, "Go picks a random candidate");
    assert_eq!(m.queue_size, 16, "Go's size for a negative queue_size");
    assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
}

#[test]
fn warnings_are_logged_at_plugin_start() {
    let mut host = crate::host::fake::FakeHost::new();
    let mut f = crate::filter::Filter::new();
    assert!(f.configure(&mut host, glr(r#","maxRequestCount":-1"#).as_bytes()));
    assert!(host.logged("lb_config.maxRequestCount: -1 is negative: no limit, as in Go"));
}

#[test]
fn decision_header_is_off_by_default_and_must_be_a_header_name() {
    let d = parse(&glr("")).unwrap().default.unwrap();
    assert_eq!(d.decision_header, None);
    let d = parse(&glr(r#","decisionHeader":"X-AI-LB-Decision""#)).unwrap().default.unwrap();
    assert_eq!(d.decision_header.as_deref(), Some("x-ai-lb-decision"));
    expect_err(
        &glr(r#","decisionHeader":"x decision""#),
        "lb_config.decisionHeader",
        "header name",
    );
    expect_err(&glr(r#","decisionHeader":":status""#), "lb_config.decisionHeader", "header name");
}

#[test]
fn redis_policies_read_the_metrics_source_keys() {
    let d = parse(&glr(r#","scrapeCluster":"pods-original-dst","scrapeIntervalMs":250"#))
        .unwrap()
        .default
        .unwrap();
    let PolicyConfig::GlobalLeastRequest(g) = d.policy else { panic!("wrong policy") };
    assert_eq!(g.metrics.scrape_cluster.as_deref(), Some("pods-original-dst"));
    assert_eq!(g.metrics.scrape_interval_ms, 250);
    let d = parse(&glr("")).unwrap().default.unwrap();
    let PolicyConfig::GlobalLeastRequest(g) = d.policy else { panic!("wrong policy") };
    assert_eq!(g.metrics, PodMetricsSource::default(), "no scraping unless asked");
}

#[test]
fn go_integer_keys_with_a_unit_read_as_zero_with_a_warning() {
    let c = parse(&glr(r#","timeout":"3s","cleanInterval":"hourly","database":"one""#)).unwrap();
    let PolicyConfig::GlobalLeastRequest(g) = c.default.as_ref().unwrap().policy.clone() else {
        panic!("wrong policy")
    };
    assert_eq!(g.redis.timeout_ms, 3000, "0 is the default timeout");
    assert_eq!(g.clean_interval_min, 60);
    assert_eq!(g.redis.database, 0);
    assert_eq!(c.warnings.len(), 3, "{:?}", c.warnings);
    assert!(
        c.warnings[0].contains(r#"lb_config.timeout: "3s" is not a number"#),
        "{:?}",
        c.warnings
    );
    // Our own keys stay strict.
    expect_err(&glr(r#","leaseMs":"10s""#), "lb_config.leaseMs", "integer");
}
