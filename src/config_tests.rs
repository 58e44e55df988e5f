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
fn lb_config_not_an_object_has_no_keys_as_in_go() {
    // The Redis policies then miss their Redis location, as in Go.
    expect_err(
        r#"{"lb_policy":"prefix_cache","lb_config":"x"}"#,
        "lb_config.serviceFQDN",
        "required",
    );
    // endpoint_metrics runs on its defaults, with a warning.
    let c = parse(r#"{"lb_policy":"endpoint_metrics","lb_config":[1]}"#).unwrap();
    let Some(LbConfig { policy: PolicyConfig::EndpointMetrics(e), .. }) = c.default else {
        panic!()
    };
    assert_eq!(e.metric_policy, MetricPolicy::Default);
    assert!(c.warnings[0].contains("lb_config: an array has no keys"), "{:?}", c.warnings);
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
        "required",
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
fn error_max_body_bytes() {
    expect_err(&glr(r#","maxBodyBytes":-1"#), "lb_config.maxBodyBytes", "integer");
}
#[test]
fn error_hit_load_factor() {
    expect_err(&prefix(r#","hitLoadFactor":-2"#), "lb_config.hitLoadFactor", "non-negative number");
}
#[test]
fn error_load_aware_keys() {
    expect_err(&prefix(r#","loadAware":"yes""#), "lb_config.loadAware", "true or false");
    expect_err(&prefix(r#","overloadQueue":-1"#), "lb_config.overloadQueue", "non-negative");
    expect_err(&prefix(r#","overloadKvCache":"x""#), "lb_config.overloadKvCache", "non-negative");
    expect_err(&prefix(r#","overloadInflight":-3"#), "lb_config.overloadInflight", "integer");
    expect_err(&prefix(r#","overloadRatio":0.5"#), "lb_config.overloadRatio", ">= 1");
    expect_err(&prefix(r#","loadKvWeight":-8"#), "lb_config.loadKvWeight", "non-negative");
    expect_err(&prefix(r#","maxHolders":0"#), "lb_config.maxHolders", "between 1 and 8");
    expect_err(&prefix(r#","overloadLatency":0.5"#), "lb_config.overloadLatency", ">= 1");
    expect_err(
        &prefix(r#","loadLatencyWeight":-1"#),
        "lb_config.loadLatencyWeight",
        "non-negative",
    );
    expect_err(&prefix(r#","maxHolders":9"#), "lb_config.maxHolders", "between 0 and 8");
    expect_err(&prefix(r#","loadPrefillBytes":-1"#), "lb_config.loadPrefillBytes", "integer");
    expect_err(&prefix(r#","divertPrefixBytes":"x""#), "lb_config.divertPrefixBytes", "integer");
}
#[test]
fn load_aware_is_off_by_default_and_reads_its_thresholds() {
    let policy = |extra: &str| {
        let c = parse(&prefix(extra)).unwrap();
        let PolicyConfig::PrefixCache(p) = c.default.unwrap().policy else { panic!() };
        p.load_aware
    };
    assert_eq!(policy(""), None, "a Go config routes as Go does");
    assert_eq!(policy(r#","overloadQueue":2"#), None, "thresholds alone do not turn it on");
    let l = policy(r#","loadAware":true,"overloadQueue":2,"overloadKvCache":"0.3","overloadInflight":6,"overloadRatio":2,"loadKvWeight":4,"maxHolders":3,"loadLatencyWeight":2,"overloadLatency":1.8,"loadPrefillBytes":8192,"divertPrefixBytes":2048"#).unwrap();
    assert_eq!(
        l,
        LoadAwareConfig {
            queue_gap: 2.0,
            kv_gap: 0.3,
            inflight_gap: 6,
            ratio: 2.0,
            kv_weight: 4.0,
            max_holders: 3,
            latency_weight: 2.0,
            latency_ratio: 1.8,
            prefill_bytes: 8192,
            divert_prefix_bytes: 2048,
        }
    );
    let d = policy(r#","loadAware":true"#).unwrap();
    assert_eq!(
        (d.latency_weight, d.latency_ratio),
        (DEFAULT_LOAD_LATENCY_WEIGHT, DEFAULT_OVERLOAD_LATENCY)
    );
    let d = policy(r#","loadAware":true"#).unwrap();
    assert_eq!(
        (d.queue_gap, d.kv_gap, d.inflight_gap, d.ratio, d.kv_weight, d.max_holders),
        (
            DEFAULT_OVERLOAD_QUEUE,
            DEFAULT_OVERLOAD_KV_CACHE,
            DEFAULT_OVERLOAD_INFLIGHT,
            DEFAULT_OVERLOAD_RATIO,
            DEFAULT_LOAD_KV_WEIGHT,
            DEFAULT_MAX_HOLDERS
        )
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
fn a_rate_limit_above_one_starts_with_a_warning() {
    for (policy, keys) in [
        (r#""lb_policy":"endpoint_metrics""#, ""),
        (r#""lb_type":"cluster","lb_policy":"cluster_metrics""#, r#","service_list":["a"]"#),
    ] {
        let c = parse(&format!(r#"{{{policy},"lb_config":{{"rate_limit":2{keys}}}}}"#)).unwrap();
        assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
        assert!(c.warnings[0].contains("lb_config.rate_limit"), "{:?}", c.warnings);
        assert!(c.warnings[0].contains("no limit"), "{:?}", c.warnings);
        let quiet =
            parse(&format!(r#"{{{policy},"lb_config":{{"rate_limit":0.5{keys}}}}}"#)).unwrap();
        assert!(quiet.warnings.is_empty(), "{:?}", quiet.warnings);
    }
}
#[test]
fn error_service_list() {
    expect_err(
        r#"{"lb_type":"cluster","lb_policy":"cluster_metrics","lb_config":{"mode":"LeastBusy"}}"#,
        "lb_config.service_list",
        "non-empty",
    );
    expect_err(
        r#"{"lb_type":"cluster","lb_policy":"cluster_metrics","lb_config":{"service_list":[1]}}"#,
        "lb_config.service_list",
        "expected strings",
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
fn error_rule_without_matcher() {
    expect_err(&format!(r#"{{"_rules_":[{}]}}"#, glr("")), "_rules_[0]", "_match_route_");
    // Consumers alone are no match kind (Go refuses it too).
    expect_err(
        r#"{"_rules_":[{"_match_consumer_":["alice"],"lb_policy":"endpoint_metrics"}]}"#,
        "_rules_[0]",
        "_match_route_prefix_",
    );
    // Go drops empty route names: a list of only "" is no matcher.
    expect_err(
        r#"{"_rules_":[{"_match_route_":[""],"lb_policy":"endpoint_metrics"}]}"#,
        "_rules_[0]",
        "_match_route_",
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

// ---- rules, as Higress's wasm-go rule matcher reads them ----

const EM: &str = r#""lb_policy":"endpoint_metrics""#;

fn select_index(
    c: &PluginConfig,
    route: &str,
    authority: &str,
    cluster: &str,
    consumer: &str,
) -> Option<usize> {
    c.select(&MatchInput { route, authority, cluster, consumer }).map(|(i, _)| i)
}

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
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let sel = |route, authority, cluster| select_index(&c, route, authority, cluster, "");
    assert_eq!(sel("chat-route", "api.example.com", "outbound|8000||llm.static"), Some(0));
    assert_eq!(sel("other", "api.example.com:443", ""), Some(1));
    assert_eq!(sel("other", "api.test", ""), Some(1));
    assert_eq!(sel("other", "example.com", "outbound|8000||llm.static"), Some(2));
    assert_eq!(sel("other", "x", "outbound|9000||llm.static"), None, "port must match");
    assert_eq!(sel("ai-route-1", "x", ""), Some(3));
    assert_eq!(sel("other", "x", ""), None);
}

#[test]
fn a_rule_is_parsed_alone_nothing_is_inherited() {
    // Go parses each rule with the plugin's parser and no override parser: a rule without
    // lb_policy is invalid even when the top level has one.
    let json = r#"{"lb_policy":"global_least_request","lb_config":{"serviceFQDN":"redis.static","servicePort":6379},
      "_rules_":[{"_match_route_":["r2"],"lb_config":{"serviceFQDN":"redis.static","servicePort":6379}}]}"#;
    expect_err(json, "_rules_[0].lb_policy", "missing");
    // A top-level lb_type: cluster does not reach the rule: its lb_type is the default, endpoint.
    let json = r#"{"lb_type":"cluster","lb_policy":"cluster_metrics","lb_config":{"service_list":["a"]},
      "_rules_":[{"_match_route_":["r2"],"lb_policy":"prefix_cache","lb_config":{"serviceFQDN":"redis.static","servicePort":6379}}]}"#;
    let c = parse(json).unwrap();
    let (i, cfg) = c.select(&MatchInput { route: "r2", ..Default::default() }).unwrap();
    assert_eq!((i, cfg.lb_type), (0, LbType::Endpoint));
    // A rule's lb_config does not inherit the top level's keys either.
    let json = r#"{"lb_policy":"global_least_request","lb_config":{"serviceFQDN":"redis.static","servicePort":6379,"timeout":900},
      "_rules_":[{"_match_route_":["r2"],"lb_policy":"global_least_request","lb_config":{"serviceFQDN":"redis.static","servicePort":6380}}]}"#;
    let c = parse(json).unwrap();
    let (_, cfg) = c.select(&MatchInput { route: "r2", ..Default::default() }).unwrap();
    let PolicyConfig::GlobalLeastRequest(g) = &cfg.policy else { panic!("rule config") };
    assert_eq!((g.redis.service_port, g.redis.timeout_ms), (6380, 3000));
    let (i, cfg) = c.select(&MatchInput { route: "r1", ..Default::default() }).unwrap();
    assert_eq!(i, 1, "the top level applies to other routes");
    let PolicyConfig::GlobalLeastRequest(g) = &cfg.policy else { panic!("top-level config") };
    assert_eq!(g.redis.timeout_ms, 900);
}

#[test]
fn an_invalid_top_level_next_to_rules_is_disabled_with_a_warning() {
    let json = format!(
        r#"{{"lb_policy":"prefix_cache","lb_config":{{}},"_rules_":[{{"_match_route_":["r1"],{EM}}}]}}"#
    );
    let c = parse(&json).unwrap();
    assert!(c.default.is_none(), "Go disables the global config");
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert!(c.warnings[0].contains("lb_config.serviceFQDN: required"), "{:?}", c.warnings);
    assert!(c.warnings[0].contains("disabled"), "{:?}", c.warnings);
    assert_eq!(select_index(&c, "r1", "", "", ""), Some(0));
    assert_eq!(select_index(&c, "r2", "", "", ""), None, "unmatched requests pass through");
    // Without rules (or with an empty list) an invalid top level still fails the plugin, as in Go.
    expect_err(r#"{"lb_policy":"prefix_cache","_rules_":[]}"#, "lb_config.serviceFQDN", "required");
    expect_err(
        r#"{"lb_policy":"prefix_cache","_rules_":null}"#,
        "lb_config.serviceFQDN",
        "required",
    );
}

#[test]
fn rule_kind_follows_go_precedence() {
    // route (+service) > domain > service > route prefix (+consumer); other keys are ignored.
    let json = format!(
        r#"{{"_rules_":[
        {{"_match_route_":["r1"],"_match_domain_":["only.example"],{EM}}},
        {{"_match_route_":["r2"],"_match_service_":["svc"],{EM}}},
        {{"_match_domain_":["d.example"],"_match_service_":["svc"],{EM}}},
        {{"_match_service_":["svc"],"_match_route_prefix_":["p-"],{EM}}},
        {{"_match_route_prefix_":["c-"],"_match_consumer_":["alice"],{EM}}},
        {{"_match_route_":["r3"],"_match_consumer_":["bob"],{EM}}}
      ]}}"#
    );
    let c = parse(&json).unwrap();
    let kinds: Vec<RuleKind> = c.rules.iter().map(|r| r.matcher.kind()).collect();
    use RuleKind::*;
    assert_eq!(kinds, [Route, RouteAndService, Domain, Service, RoutePrefixAndConsumer, Route]);
    // Each ignored key is named in a warning.
    let ignored = [
        "_rules_[0]._match_domain_",
        "_rules_[2]._match_service_",
        "_rules_[3]._match_route_prefix_",
        "_rules_[5]._match_consumer_",
    ];
    assert_eq!(c.warnings.len(), ignored.len(), "{:?}", c.warnings);
    for (w, key) in c.warnings.iter().zip(ignored) {
        assert!(w.contains(key) && w.contains("ignored"), "{w}");
    }
    let svc = "outbound|80||svc";
    let sel =
        |route, authority, cluster, consumer| select_index(&c, route, authority, cluster, consumer);
    assert_eq!(sel("r1", "other.example", "", ""), Some(0), "the domain is not consulted");
    assert_eq!(sel("r2", "", "outbound|80||other", ""), None, "route and service both");
    assert_eq!(sel("r2", "", svc, ""), Some(1));
    assert_eq!(sel("x", "d.example", "", ""), Some(2));
    assert_eq!(sel("x", "other", svc, ""), Some(3));
    assert_eq!(sel("p-1", "", "", ""), None, "the prefix is not consulted next to a service");
    assert_eq!(sel("c-1", "", "", "alice"), Some(4));
    assert_eq!(sel("c-1", "", "", "mallory"), None);
    assert_eq!(sel("r3", "", "", ""), Some(5), "consumers only count with a route prefix");
    assert!(c.matches_consumers());
}

#[test]
fn domains_and_services_compare_as_go_does() {
    let json = format!(
        r#"{{"_rules_":[
        {{"_match_domain_":["*.Example.com","api.test","pre.*"],{EM}}},
        {{"_match_service_":["llm.static","llm.dns:8000"],{EM}}}
      ]}}"#
    );
    let c = parse(&json).unwrap();
    let host = |authority| select_index(&c, "r", authority, "", "");
    assert_eq!(host("chat.Example.com"), Some(0));
    assert_eq!(host("chat.example.com"), None, "case-sensitive, as in Go");
    assert_eq!(host("api.test:8443"), Some(0));
    assert_eq!(host("api.test.evil"), None);
    assert_eq!(host("pre.anything"), Some(0));
    assert_eq!(host("[::1]:80"), None);
    let svc = |cluster| select_index(&c, "r", "", cluster, "");
    assert_eq!(svc("outbound|80||llm.static"), Some(1), "fqdn alone: any port");
    assert_eq!(svc("outbound|8000||llm.dns"), Some(1));
    assert_eq!(svc("outbound|9000||llm.dns"), None);
    assert_eq!(svc("llm.static"), None, "only outbound|port|subset|fqdn names match");
    assert_eq!(svc("outbound|80||llm.static|x"), None);
    assert_eq!(strip_port("[::1]:80"), "[::1]");
    assert_eq!(strip_port("[::1]"), "[::1]");
    assert_eq!(strip_port("host:abc"), "host", "Go cuts at the last colon whatever follows");
}

#[test]
fn rule_shapes_go_tolerates_start_with_a_warning() {
    // A match key given one value instead of a list: gjson reads a list of one.
    let c = parse(&format!(r#"{{"_rules_":[{{"_match_route_":"r1",{EM}}}]}}"#)).unwrap();
    assert_eq!(c.rules[0].matcher.routes, ["r1"]);
    assert!(c.warnings[0].contains("_rules_[0]._match_route_"), "{:?}", c.warnings);
    // _rules_ given one rule object instead of a list.
    let c = parse(&format!(r#"{{"_rules_":{{"_match_route_":["r1"],{EM}}}}}"#)).unwrap();
    assert_eq!(c.rules.len(), 1);
    assert!(
        c.warnings[0].contains("_rules_: an object read as a list of one rule"),
        "{:?}",
        c.warnings
    );
    // Non-string names read as their JSON text; empty names dropped.
    let c = parse(&format!(r#"{{"_rules_":[{{"_match_route_":[7,"",null,"r"],{EM}}}]}}"#)).unwrap();
    assert_eq!(c.rules[0].matcher.routes, ["7", "r"]);
    // A rule that is not an object has no match keys: refused, as in Go.
    expect_err(r#"{"_rules_":["r1"]}"#, "_rules_[0]", "_match_route_");
}

/// Go integer keys read as gjson `.Int()` reads them (what Go starts with): a fraction truncated,
/// booleans 1/0, non-integer strings, arrays and objects 0; each such value warns, naming the field.
#[test]
fn go_integer_keys_read_as_gjson_int() {
    let glr_of = |extra: &str| {
        let c = parse(&glr(extra)).unwrap_or_else(|e| panic!("{extra}: {e}"));
        let Some(LbConfig { policy: PolicyConfig::GlobalLeastRequest(g), .. }) = c.default else {
            panic!("wrong policy")
        };
        (g, c.warnings)
    };
    type Check = fn(&GlobalLeastRequestConfig) -> bool;
    let cases: Vec<(&str, Check, &str)> = vec![
        (r#","maxRequestCount":true"#, |g| g.max_request_count == 1, "true read as 1"),
        (r#","maxRequestCount":false"#, |g| g.max_request_count == 0, "false read as 0"),
        (
            r#","maxRequestCount":2.9"#,
            |g| g.max_request_count == 2,
            "2.9 is not an integer: read as 2",
        ),
        (
            r#","maxRequestCount":-2.9"#,
            |g| g.max_request_count == 0,
            "-2.9 is not an integer: read as -2",
        ),
        (
            r#","cleanInterval":{"every":"hour"}"#,
            |g| g.clean_interval_min == 60,
            "an object read as 0",
        ),
        (r#","database":[1]"#, |g| g.redis.database == 0, "an array read as 0"),
        (r#","database":true"#, |g| g.redis.database == 1, "true read as 1"),
        (r#","timeout":1500.7"#, |g| g.redis.timeout_ms == 1500, "read as 1500"),
        (r#","timeout":" 700""#, |g| g.redis.timeout_ms == 3000, "\" 700\" is not a number"),
        (r#","timeout":"1.5""#, |g| g.redis.timeout_ms == 3000, "\"1.5\" is not a number"),
        (r#","timeout":"-20""#, |g| g.redis.timeout_ms == 3000, "timeout: -20 is negative"),
        (r#","servicePort":6379.0"#, |g| g.redis.service_port == 6379, ""),
        (r#","servicePort":"6380""#, |g| g.redis.service_port == 6380, ""),
    ];
    for (extra, check, warned) in cases {
        // servicePort given twice: serde_json keeps the last.
        let (g, warnings) = glr_of(extra);
        assert!(check(&g), "{extra}: {g:?}");
        if warned.is_empty() {
            assert!(warnings.is_empty(), "{extra}: {warnings:?}");
        } else {
            assert!(warnings.iter().any(|w| w.contains(warned)), "{extra}: {warnings:?}");
        }
    }
    let c = parse(r#"{"lb_policy":"prefix_cache","lb_config":{"serviceFQDN":"r","servicePort":1,"redisKeyTTL":1.5}}"#).unwrap();
    let Some(LbConfig { policy: PolicyConfig::PrefixCache(p), .. }) = c.default else { panic!() };
    assert_eq!(p.redis_key_ttl_s, 1, "1.5 reads as 1 (Go: keys live 1 s)");
    let c = parse(r#"{"lb_type":"cluster","lb_policy":"cluster_metrics","lb_config":{"service_list":["a"],"queue_size":[100]}}"#).unwrap();
    let Some(LbConfig { policy: PolicyConfig::ClusterMetrics(m), .. }) = c.default else {
        panic!()
    };
    assert_eq!(m.queue_size, 100, "an array reads as 0, the default");
    // A port that reads as 0 is missing, as Go says ("invalid redis service config").
    expect_err(&glr(r#","servicePort":false"#), "lb_config.servicePort", "required");
    // Our own integer keys stay strict.
    expect_err(&glr(r#","leaseMs":true"#), "lb_config.leaseMs", "integer");
    expect_err(&glr(r#","breakerFailures":2.5"#), "lb_config.breakerFailures", "integer");
}

#[test]
fn least_or_most_without_target_metric_ties_every_pod_as_in_go() {
    let c =
        parse(r#"{"lb_policy":"endpoint_metrics","lb_config":{"metric_policy":"most"}}"#).unwrap();
    let Some(LbConfig { policy: PolicyConfig::EndpointMetrics(e), .. }) = c.default else {
        panic!()
    };
    assert_eq!((e.metric_policy, e.target_metric), (MetricPolicy::Random, None));
    assert!(c.warnings[0].contains("lb_config.target_metric: missing"), "{:?}", c.warnings);
}

#[test]
fn camel_case_metric_keys_are_not_go_keys_and_are_ignored() {
    let c = parse(r#"{"lb_policy":"endpoint_metrics","lb_config":{"metricPolicy":"most","targetMetric":"x"}}"#).unwrap();
    let Some(LbConfig { policy: PolicyConfig::EndpointMetrics(e), .. }) = c.default else {
        panic!()
    };
    assert_eq!(
        (e.metric_policy, e.target_metric),
        (MetricPolicy::Default, None),
        "Go runs its default"
    );
    assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
    assert!(c.warnings[0].contains("lb_config.metricPolicy: not a key (the key is metric_policy)"));
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

fn cluster_hash(lb_config: &str) -> String {
    format!(r#"{{"lb_type":"cluster","lb_policy":"cluster_hash","lb_config":{lb_config}}}"#)
}

#[test]
fn cluster_hash_reads_the_go_config() {
    let c = parse(&cluster_hash(
        r#"{"clusters":[{"cluster":"a","weight":25},{"cluster":"b","weight":"75"}]}"#,
    ))
    .unwrap();
    let d = c.default.unwrap();
    let PolicyConfig::ClusterHash(h) = &d.policy else { panic!("{:?}", d.policy) };
    assert_eq!(h.key, HashKeySource::Header("x-mse-consumer".into()));
    assert_eq!(h.cluster_header, "x-higress-target-cluster");
    assert_eq!(h.slots.len(), 100);
    assert_eq!(h.slots.iter().filter(|s| *s == "a").count(), 25);
    assert!(h.slots[..25].iter().all(|s| s == "a") && h.slots[25..].iter().all(|s| s == "b"));
    // A header key reads no body: the body limit is ours.
    assert_eq!(d.max_body_bytes, DEFAULT_MAX_BODY_BYTES);

    let c = parse(&cluster_hash(
        r#"{"hash_header":"x-user","cluster_header":"x-target","clusters":[{"cluster":"a","weight":100}]}"#,
    ))
    .unwrap();
    let PolicyConfig::ClusterHash(h) = c.default.unwrap().policy else { panic!() };
    assert_eq!(h.key, HashKeySource::Header("x-user".into()));
    assert_eq!(h.cluster_header, "x-target");

    let key = |k: &str| {
        let json = cluster_hash(&format!(
            r#"{{"hash_header":"x-user","key":{k},"clusters":[{{"cluster":"a","weight":100}}]}}"#
        ));
        let d = parse(&json).unwrap().default.unwrap();
        let PolicyConfig::ClusterHash(h) = d.policy else { panic!() };
        (h.key, d.max_body_bytes)
    };
    let go_body_limit = 100 * 1024 * 1024;
    assert_eq!(key("{}"), (HashKeySource::Header("x-user".into()), DEFAULT_MAX_BODY_BYTES));
    assert_eq!(key(r#"{"name":"x-tenant"}"#).0, HashKeySource::Header("x-tenant".into()));
    assert_eq!(key(r#"{"source":"cookie","name":"sid"}"#).0, HashKeySource::Cookie("sid".into()));
    assert_eq!(
        key(r#"{"source":"body","jsonPath":" $.user.id "}"#),
        (HashKeySource::Body("user.id".into()), go_body_limit)
    );
    assert_eq!(
        key(r#"{"source":"body","jsonPath":"$","json_path":"user","max_body_bytes":65536}"#),
        (HashKeySource::Body("user".into()), 65536)
    );
    assert_eq!(
        key(r#"{"source":"metadata","name":"tenant"}"#).0,
        HashKeySource::Metadata(vec!["metadata".into(), "tenant".into()])
    );
    assert_eq!(
        key(r#"{"source":"metadata","property_path":["a","","b"],"name":"x"}"#).0,
        HashKeySource::Metadata(vec!["a".into(), "b".into()])
    );
    // gjson's `.Array()` reads a string as a list of one, with a warning here.
    assert_eq!(
        key(r#"{"source":"metadata","propertyPath":"tenant"}"#).0,
        HashKeySource::Metadata(vec!["tenant".into()])
    );
    // Ours, when given, wins over key.max_body_bytes.
    let json = cluster_hash(
        r#"{"maxBodyBytes":1024,"key":{"source":"body","jsonPath":"user"},"clusters":[{"cluster":"a","weight":100}]}"#,
    );
    assert_eq!(parse(&json).unwrap().default.unwrap().max_body_bytes, 1024);
}

#[test]
fn cluster_hash_errors_name_the_field() {
    let one = r#""clusters":[{"cluster":"a","weight":100}]"#;
    expect_err(&cluster_hash("{}"), "lb_config.clusters", "non-empty array");
    expect_err(&cluster_hash(r#"{"clusters":[]}"#), "lb_config.clusters", "non-empty array");
    expect_err(
        &cluster_hash(r#"{"clusters":[{"cluster":"a","weight":60},{"cluster":"b","weight":30}]}"#),
        "lb_config.clusters",
        "sum to 100, got 90",
    );
    expect_err(
        &cluster_hash(r#"{"clusters":[{"cluster":"a","weight":60},{"cluster":"b","weight":60}]}"#),
        "lb_config.clusters",
        "sum to 100",
    );
    expect_err(
        &cluster_hash(r#"{"clusters":[{"cluster":"a","weight":100},{"cluster":"b","weight":0}]}"#),
        "lb_config.clusters[1].weight",
        "must be > 0",
    );
    expect_err(
        &cluster_hash(r#"{"clusters":[{"weight":100}]}"#),
        "lb_config.clusters[0].cluster",
        "non-empty cluster name",
    );
    for (key, field, needle) in [
        (r#"{"source":"cookie"}"#, "lb_config.key.name", "cookie"),
        (r#"{"source":"body"}"#, "lb_config.key.jsonPath", "body"),
        (r#"{"source":"metadata"}"#, "lb_config.key.propertyPath", "metadata"),
        (r#"{"source":"query"}"#, "lb_config.key.source", "header, cookie, body, metadata"),
        (
            r#"{"source":"body","jsonPath":"u","max_body_bytes":5000000000}"#,
            "lb_config.key.max_body_bytes",
            "between 0 and",
        ),
    ] {
        expect_err(&cluster_hash(&format!(r#"{{"key":{key},{one}}}"#)), field, needle);
    }
    // Only under lb_type cluster, as in Go.
    expect_err(
        &format!(r#"{{"lb_policy":"cluster_hash","lb_config":{{{one}}}}}"#),
        "lb_policy",
        "lb_type endpoint",
    );
}

#[test]
fn endpoint_hash_reads_the_go_config() {
    let json = |extra: &str| {
        format!(
            r#"{{"lb_policy":"endpoint_hash","lb_config":{{"serviceFQDN":"redis.static","servicePort":6379{extra}}}}}"#
        )
    };
    let c = parse(&json("")).unwrap();
    let PolicyConfig::EndpointHash(h) = c.default.unwrap().policy else { panic!("endpoint_hash") };
    assert_eq!(h.hash_header, "x-mse-consumer");
    assert_eq!(h.sticky_ttl_s, 3600, "60 minutes");
    assert_eq!(h.redis.timeout_ms, DEFAULT_REDIS_TIMEOUT_MS);
    assert_eq!(h.state, SharedStateConfig::default());
    let c = parse(&json(
        r#","hash_header":"x-user","stickyTimeout":"15","password":"p","breakerSlowMs":50"#,
    ))
    .unwrap();
    let PolicyConfig::EndpointHash(h) = c.default.unwrap().policy else { panic!() };
    assert_eq!((h.hash_header.as_str(), h.sticky_ttl_s), ("x-user", 900));
    assert_eq!(h.redis.password, "p");
    assert_eq!(h.state.breaker_slow_ms, 50);
    // A negative timeout: Go would keep no binding; ours warns and takes the default.
    let c = parse(&json(r#","stickyTimeout":-5"#)).unwrap();
    assert!(c.warnings.iter().any(|w| w.contains("lb_config.stickyTimeout")), "{:?}", c.warnings);
    let PolicyConfig::EndpointHash(h) = c.default.unwrap().policy else { panic!() };
    assert_eq!(h.sticky_ttl_s, 3600);
    expect_err(r#"{"lb_policy":"endpoint_hash","lb_config":{}}"#, "lb_config.serviceFQDN", "");
}

#[test]
fn cluster_metrics_adaptive_score_reads_the_go_keys() {
    let cfg = |extra: &str| {
        format!(
            r#"{{"lb_type":"cluster","lb_policy":"cluster_metrics","lb_config":{{"mode":"AdaptiveScore","service_list":["a","b"]{extra}}}}}"#
        )
    };
    let c = parse(&cfg("")).unwrap();
    let PolicyConfig::ClusterMetrics(m) = c.default.unwrap().policy else { panic!() };
    assert_eq!(m.mode, ClusterMode::AdaptiveScore);
    assert_eq!(m.adaptive, AdaptiveScoreConfig::default());
    let c = parse(&cfg(
        r#","ewma_beta":0.8,"p2c_choices":"3","ttft_weight":0,"error_penalty":1,"failure_cooldown_ms":0"#,
    ))
    .unwrap();
    let PolicyConfig::ClusterMetrics(m) = c.default.unwrap().policy else { panic!() };
    let a = &m.adaptive;
    assert_eq!((a.ewma_beta, a.p2c_choices, a.ttft_weight), (0.8, 3, 0.0));
    assert_eq!((a.error_penalty, a.failure_cooldown_ms), (1.0, 30_000));
    for (extra, field, needle) in [
        (r#","ewma_beta":1.2"#, "lb_config.ewma_beta", "[0, 1]"),
        (r#","ttft_weight":0,"total_latency_weight":0"#, "lb_config.ttft_weight", "both be 0"),
        (r#","error_penalty":-1"#, "lb_config.error_penalty", "non-negative"),
        (r#","failure_cooldown_ms":-1"#, "lb_config.failure_cooldown_ms", ">= 0"),
        (r#","global_inflight_timeout":-1"#, "lb_config.global_inflight_timeout", ">= 0"),
        (r#","global_inflight_enabled":true"#, "lb_config.serviceFQDN", "global_inflight_enabled"),
    ] {
        expect_err(&cfg(extra), field, needle);
    }
    // Go shares the in-flight counts through Redis with it; here they stay per worker.
    let c = parse(&cfg(
        r#","global_inflight_enabled":true,"serviceFQDN":"redis.static","servicePort":6379"#,
    ))
    .unwrap();
    assert!(c.warnings.iter().any(|w| w.contains("global_inflight_enabled")), "{:?}", c.warnings);
}

#[test]
fn endpoint_metrics_window_keys_are_read_as_the_go_plugin_reads_them() {
    let cfg = |extra: &str| {
        format!(r#"{{"lb_policy":"endpoint_metrics","lb_config":{{"rate_limit":0.5{extra}}}}}"#)
    };
    let window = |extra: &str| {
        let c = parse(&cfg(extra)).unwrap();
        let PolicyConfig::EndpointMetrics(e) = c.default.unwrap().policy else { panic!() };
        (e.window_size, e.window_seconds, c.warnings.len())
    };
    assert_eq!(window(r#","window_size":20,"window_seconds":"30""#), (20, 30, 0));
    assert_eq!(window(r#","window_size":0,"window_seconds":0"#), (100, 60, 0));
    // Negative: the default, as in Go, with a warning each.
    assert_eq!(window(r#","window_size":-1,"window_seconds":-5"#), (100, 60, 2));
}
