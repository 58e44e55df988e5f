//! Packaging checks (owned by the packaging engineer): what a Higress user installs and types.
//!
//! - every example in plugin-config/ is accepted by the plugin's own parser and by
//!   plugin-config/schema.json, and the schema's documented defaults are the parser's defaults;
//! - every broken example in plugin-config/invalid/ is refused by the parser with the message its
//!   `# expect:` line promises (and by the schema, unless it says `# schema: accepts`);
//! - higress/spec.yaml embeds exactly the schema (as OpenAPI 3.0) and a valid example;
//! - higress/wasmplugin/*.yaml deliver configs the plugin accepts, with FAIL_OPEN;
//! - higress/envoy.yaml and docker-compose.yaml are consistent with the plugin and the host names;
//! - higress/README*.md document every key with its default;
//! - higress/build-artifact.sh produces the marketplace layout, and (when a Docker engine is
//!   reachable) higress/Dockerfile builds an image holding exactly plugin.wasm.

use std::collections::BTreeSet;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use ai_load_balancer::config::{
    ClusterMode, HashKeySource, LbConfig, LbType, MetricPolicy, PluginConfig, PolicyConfig,
    DEFAULT_CLUSTER_HEADER, DEFAULT_HASH_HEADER,
};
use serde_json::{json, Map, Value};

const POLICIES: [&str; 6] = [
    "global_least_request",
    "prefix_cache",
    "endpoint_metrics",
    "cluster_metrics",
    "cluster_hash",
    "endpoint_hash",
];

/// Layers of the Higress plugin image, in push order (plugin.tar.gz must be last).
const LAYERS: [(&str, &str); 4] = [
    ("spec.yaml", "application/vnd.module.wasm.spec.v1+yaml"),
    ("README.md", "application/vnd.module.wasm.doc.v1+markdown"),
    ("README_EN.md", "application/vnd.module.wasm.doc.v1.en+markdown"),
    ("plugin.tar.gz", "application/vnd.oci.image.layer.v1.tar+gzip"),
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

fn read(rel: &str) -> String {
    let p = root().join(rel);
    fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

fn yaml_files(rel_dir: &str) -> Vec<PathBuf> {
    let dir = root().join(rel_dir);
    let mut v: Vec<PathBuf> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read dir {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no .yaml files in {rel_dir}");
    v
}

fn name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// YAML text -> the JSON value Higress would hand the plugin.
fn yaml_to_json(text: &str, what: &str) -> Value {
    serde_yaml::from_str::<Value>(text).unwrap_or_else(|e| panic!("{what}: not valid YAML: {e}"))
}

fn parse(config: &Value) -> Result<PluginConfig, ai_load_balancer::config::ConfigError> {
    PluginConfig::from_json(config.to_string().as_bytes())
}

/// The root Cargo.toml `[package] version` (the plugin's version, not this crate's).
fn plugin_version() -> String {
    let text = read("Cargo.toml");
    let pkg = text.split("[package]").nth(1).expect("[package] in Cargo.toml");
    pkg.lines()
        .take_while(|l| !l.starts_with('['))
        .find_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k.trim() == "version").then(|| v.trim().trim_matches('"').to_string())
        })
        .expect("version in [package]")
}

struct Schema {
    schemas: boon::Schemas,
    index: boon::SchemaIndex,
    json: Value,
}

impl Schema {
    fn load() -> Schema {
        let path = root().join("plugin-config/schema.json");
        let json: Value =
            serde_json::from_str(&read("plugin-config/schema.json")).expect("schema.json is JSON");
        let mut schemas = boon::Schemas::new();
        let mut compiler = boon::Compiler::new();
        let index = compiler
            .compile(path.to_str().expect("utf-8 path"), &mut schemas)
            .unwrap_or_else(|e| panic!("schema.json does not compile: {e:#}"));
        Schema { schemas, index, json }
    }

    fn check(&self, v: &Value) -> Result<(), String> {
        self.schemas.validate(v, self.index).map_err(|e| format!("{e}"))
    }

    fn lb_config_props(&self) -> &Map<String, Value> {
        self.json["$defs"]["lbConfig"]["properties"].as_object().expect("lbConfig.properties")
    }

    fn default_of(&self, key: &str) -> &Value {
        let d = &self.lb_config_props()[key]["default"];
        assert!(!d.is_null(), "schema.json: lb_config.{key} has no default");
        d
    }
}

fn policy_name(p: &PolicyConfig) -> &'static str {
    match p {
        PolicyConfig::GlobalLeastRequest(_) => "global_least_request",
        PolicyConfig::PrefixCache(_) => "prefix_cache",
        PolicyConfig::EndpointMetrics(_) => "endpoint_metrics",
        PolicyConfig::ClusterMetrics(_) => "cluster_metrics",
        PolicyConfig::ClusterHash(_) => "cluster_hash",
        PolicyConfig::EndpointHash(_) => "endpoint_hash",
    }
}

/// Checks that a parsed config says what its source says: the policy (alias resolved), lb_type,
/// and for Redis policies the Envoy cluster the plugin will call.
fn assert_matches_source(what: &str, src: &Value, parsed: &LbConfig) {
    let want = match src["lb_policy"].as_str() {
        Some("metrics_based") => "endpoint_metrics",
        Some(p) => p,
        None => return, // inherited in a rule: checked through the merged config elsewhere
    };
    assert_eq!(policy_name(&parsed.policy), want, "{what}: lb_policy");
    let lb_type = if parsed.lb_type == LbType::Cluster { "cluster" } else { "endpoint" };
    assert_eq!(lb_type, src["lb_type"].as_str().unwrap_or("endpoint"), "{what}: lb_type");
    let redis = match &parsed.policy {
        PolicyConfig::GlobalLeastRequest(g) => Some(&g.redis),
        PolicyConfig::PrefixCache(p) => Some(&p.least_request.redis),
        PolicyConfig::EndpointHash(e) => Some(&e.redis),
        _ => None,
    };
    if let Some(r) = redis {
        let c = &src["lb_config"];
        let mut cluster = format!(
            "outbound|{}||{}",
            c["servicePort"],
            c["serviceFQDN"].as_str().unwrap_or_default()
        );
        if let Some(db) = c["database"].as_u64().filter(|d| *d != 0) {
            cluster.push_str(&format!("?db={db}"));
        }
        assert_eq!(r.cluster(), cluster, "{what}: Redis cluster name");
    }
}

#[test]
fn every_example_is_accepted_by_the_parser_and_the_schema() {
    let schema = Schema::load();
    let mut seen = BTreeSet::new();
    for path in yaml_files("plugin-config") {
        let n = name(&path);
        let cfg = yaml_to_json(&fs::read_to_string(&path).expect("read"), &n);
        let parsed = parse(&cfg).unwrap_or_else(|e| panic!("{n}: the plugin refuses it: {e}"));
        schema.check(&cfg).unwrap_or_else(|e| panic!("{n}: schema.json refuses it: {e}"));
        // An example means what it says: nothing in it is ignored (a rule's key its kind of
        // match does not consult, a key Go tolerates but this plugin does not use).
        assert!(parsed.warnings.is_empty(), "{n}: the plugin warns: {:?}", parsed.warnings);
        if let Some(d) = &parsed.default {
            assert_matches_source(&n, &cfg, d);
            seen.insert(policy_name(&d.policy));
        }
        let rules = cfg["_rules_"].as_array().cloned().unwrap_or_default();
        assert_eq!(parsed.rules.len(), rules.len(), "{n}: every _rules_ entry becomes a rule");
        for (i, (src, rule)) in rules.iter().zip(&parsed.rules).enumerate() {
            assert_matches_source(&format!("{n} _rules_[{i}]"), src, &rule.config);
            seen.insert(policy_name(&rule.config.policy));
        }
        if cfg.get("_rules_").is_some() && cfg.as_object().is_some_and(|o| o.len() == 1) {
            assert!(parsed.default.is_none(), "{n}: a rules-only config has no default");
        }
    }
    for p in POLICIES {
        assert!(seen.contains(p), "plugin-config/ has no example of {p}");
    }
}

#[test]
fn notable_options_have_examples() {
    // The options a user is most likely to look for each have an example that sets them.
    let all: String =
        yaml_files("plugin-config").iter().map(|p| fs::read_to_string(p).expect("read")).collect();
    for needle in [
        "maxRequestCount:",
        "redisKeyTTL:",
        "loadAware: true",
        "scopedKeys:",
        "metric_policy: default",
        "metric_policy: least",
        "metric_policy: most",
        "mode: LeastBusy",
        "mode: LeastTotalLatency",
        "mode: LeastFirstTokenLatency",
        "mode: AdaptiveScore",
        "source: body",
        "stickyTimeout:",
        "_match_route_:",
        "_match_domain_:",
        "_match_service_:",
        "lb_policy: metrics_based",
    ] {
        assert!(all.contains(needle), "no example in plugin-config/ sets `{needle}`");
    }
}

#[test]
fn schema_defaults_are_the_parser_defaults() {
    let schema = Schema::load();
    let d = |k: &str| schema.default_of(k).clone();
    let one = |cfg: Value| -> LbConfig {
        parse(&cfg).unwrap_or_else(|e| panic!("{cfg}: {e}")).default.expect("top-level config")
    };
    let redis = json!({"serviceFQDN": "redis.static", "servicePort": 6379});

    let c = one(json!({"lb_policy": "prefix_cache", "lb_config": redis}));
    assert_eq!(c.lb_type, LbType::Endpoint);
    assert_eq!(schema.json["$defs"]["lbType"]["default"], json!("endpoint"));
    assert_eq!(json!(c.max_body_bytes), d("maxBodyBytes"));
    let PolicyConfig::PrefixCache(p) = c.policy else { panic!("prefix_cache") };
    assert_eq!(json!(p.redis_key_ttl_s), d("redisKeyTTL"));
    assert_eq!(json!(p.hit_load_factor), json!(d("hitLoadFactor").as_f64()));
    assert_eq!(p.load_aware, None);
    assert_eq!(d("loadAware"), json!(false));
    assert_eq!(json!(p.key_rules.after_system_prompt), d("splitSystemPrompt"));
    assert_eq!(json!(p.key_rules.after_tool_results), d("splitToolResults"));
    assert_eq!(json!(p.key_rules.scoped), d("scopedKeys"));
    let on = one(json!({"lb_policy": "prefix_cache",
        "lb_config": {"serviceFQDN": "r", "servicePort": 1, "loadAware": true}}));
    let PolicyConfig::PrefixCache(on) = on.policy else { panic!("prefix_cache") };
    assert!(on.key_rules.scoped, "loadAware turns scopedKeys on, as the schema says");
    let l = on.load_aware.expect("loadAware: true");
    assert_eq!(json!(l.queue_gap), json!(d("overloadQueue").as_f64()));
    assert_eq!(json!(l.kv_gap), json!(d("overloadKvCache").as_f64()));
    assert_eq!(json!(l.inflight_gap), d("overloadInflight"));
    assert_eq!(json!(l.ratio), json!(d("overloadRatio").as_f64()));
    assert_eq!(json!(l.kv_weight), json!(d("loadKvWeight").as_f64()));
    assert_eq!(json!(l.max_holders), d("maxHolders"));
    assert_eq!(json!(l.latency_weight), json!(d("loadLatencyWeight").as_f64()));
    assert_eq!(json!(l.latency_ratio), json!(d("overloadLatency").as_f64()));
    let g = p.least_request;
    assert_eq!(json!(g.redis.timeout_ms), d("timeout"));
    assert_eq!(json!(g.redis.database), d("database"));
    assert_eq!(json!(g.redis.username), d("username"));
    assert_eq!(json!(g.redis.password), d("password"));
    assert_eq!(json!(g.max_request_count), d("maxRequestCount"));
    assert_eq!(json!(g.clean_interval_min), d("cleanInterval"));
    assert_eq!(json!(g.enable_detail_log), d("enableDetailLog"));

    let c = one(json!({"lb_policy": "endpoint_metrics"}));
    let PolicyConfig::EndpointMetrics(e) = c.policy else { panic!("endpoint_metrics") };
    assert_eq!(e.metric_policy, MetricPolicy::Default);
    assert_eq!(d("metric_policy"), json!("default"));
    assert_eq!(json!(e.rate_limit), json!(d("rate_limit").as_f64()));
    assert_eq!(json!(e.window_size), d("window_size"));
    assert_eq!(json!(e.window_seconds), d("window_seconds"));
    assert_eq!(json!(e.source.scrape_interval_ms), d("scrapeIntervalMs"));
    assert_eq!(json!(e.source.scrape_path), d("scrapePath"));
    assert_eq!(json!(e.source.metrics_stale_ms), d("metricsStaleMs"));

    let c = one(
        json!({"lb_type": "cluster", "lb_policy": "cluster_metrics", "lb_config": {"service_list": ["a"]}}),
    );
    let PolicyConfig::ClusterMetrics(m) = c.policy else { panic!("cluster_metrics") };
    assert_eq!(m.mode, ClusterMode::Random, "no mode: random, as documented");
    assert_eq!(json!(m.cluster_header), d("cluster_header"));
    assert_eq!(m.cluster_header, DEFAULT_CLUSTER_HEADER);
    assert_eq!(json!(m.rate_limit), json!(d("rate_limit").as_f64()));
    assert_eq!(json!(m.queue_size), d("queue_size"));
    let a = &m.adaptive;
    assert_eq!(json!(a.ewma_beta), json!(d("ewma_beta").as_f64()));
    assert_eq!(json!(a.p2c_choices), d("p2c_choices"));
    assert_eq!(json!(a.ttft_weight), json!(d("ttft_weight").as_f64()));
    assert_eq!(json!(a.total_latency_weight), json!(d("total_latency_weight").as_f64()));
    assert_eq!(json!(a.error_penalty), json!(d("error_penalty").as_f64()));
    assert_eq!(json!(a.failure_cooldown_ms), d("failure_cooldown_ms"));

    let c = one(json!({"lb_policy": "endpoint_hash", "lb_config": redis}));
    let PolicyConfig::EndpointHash(e) = c.policy else { panic!("endpoint_hash") };
    assert_eq!(json!(e.hash_header), d("hash_header"));
    assert_eq!(json!(e.sticky_ttl_s / 60), d("stickyTimeout"));
    let c = one(json!({"lb_type": "cluster", "lb_policy": "cluster_hash",
        "lb_config": {"clusters": [{"cluster": "a", "weight": 100}]}}));
    let PolicyConfig::ClusterHash(h) = c.policy else { panic!("cluster_hash") };
    assert_eq!(h.key, HashKeySource::Header(DEFAULT_HASH_HEADER.into()));
    assert_eq!(json!(DEFAULT_HASH_HEADER), d("hash_header"));
    assert_eq!(json!(h.cluster_header), d("cluster_header"));
}

/// Values the Go plugin tolerates (plugin-config/go-tolerated/): the plugin starts with Go's meaning
/// and one warning naming the field, as each file's `# warns:` line says.
#[test]
fn every_go_tolerated_example_starts_with_its_documented_warning() {
    let files = yaml_files("plugin-config/go-tolerated");
    assert!(files.len() >= 4, "found only {}", files.len());
    for path in files {
        let n = name(&path);
        let text = fs::read_to_string(&path).expect("read");
        let warns = text
            .lines()
            .find_map(|l| l.strip_prefix("# warns:"))
            .unwrap_or_else(|| panic!("{n}: no `# warns:` line"))
            .trim()
            .to_string();
        let cfg = yaml_to_json(&text, &n);
        let parsed =
            parse(&cfg).unwrap_or_else(|e| panic!("{n}: the Go plugin starts with it: {e}"));
        assert_eq!(parsed.warnings.len(), 1, "{n}: {:?}", parsed.warnings);
        assert!(
            parsed.warnings[0].contains(&warns),
            "{n}: the plugin warns\n  {}\nbut the file promises\n  {warns}",
            parsed.warnings[0]
        );
    }
}

/// `# expect: <text>` and optional `# schema: accepts ...` lines of an invalid example.
fn expectations(text: &str, n: &str) -> (String, bool) {
    let expect = text
        .lines()
        .find_map(|l| l.strip_prefix("# expect:"))
        .unwrap_or_else(|| panic!("{n}: no `# expect:` line"))
        .trim()
        .to_string();
    assert!(!expect.is_empty(), "{n}: empty `# expect:`");
    (expect, text.lines().any(|l| l.starts_with("# schema: accepts")))
}

#[test]
fn every_broken_example_is_refused_with_its_documented_message() {
    let schema = Schema::load();
    let files = yaml_files("plugin-config/invalid");
    assert!(files.len() >= 20, "one broken example per rule; found only {}", files.len());
    let mut messages = BTreeSet::new();
    for path in files {
        let n = name(&path);
        let text = fs::read_to_string(&path).expect("read");
        let (expect, schema_accepts) = expectations(&text, &n);
        let cfg = yaml_to_json(&text, &n);
        match parse(&cfg) {
            Ok(_) => panic!("{n}: the plugin accepts it, but it should fail with `{expect}`"),
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(&expect),
                    "{n}: the plugin says\n  {msg}\nbut the file promises\n  {expect}"
                );
                assert!(!msg.contains('\n'), "{n}: the error is one line: {msg}");
                messages.insert(msg);
            }
        }
        match (schema.check(&cfg), schema_accepts) {
            (Ok(()), false) => panic!(
                "{n}: schema.json accepts it; add `# schema: accepts <why>` if it cannot tell"
            ),
            (Err(e), true) => {
                panic!("{n}: marked `# schema: accepts` but the schema refuses it: {e}")
            }
            _ => {}
        }
    }
    assert!(
        messages.len() >= 15,
        "broken examples should cover distinct rules, got {} messages",
        messages.len()
    );
}

/// plugin-config/schema.json -> the OpenAPI 3.0 schema in higress/spec.yaml (same steps as
/// higress/gen-spec.py): inline `$ref`s, drop `$schema`/`$id`/`$defs`, drop `_rules_` (the console
/// writes rules itself) and the rules-only alternative.
fn openapi_from_schema(schema: &Value) -> Value {
    fn inline(node: &Value, defs: &Map<String, Value>) -> Value {
        match node {
            Value::Array(a) => Value::Array(a.iter().map(|x| inline(x, defs)).collect()),
            Value::Object(m) => {
                if let Some(r) = m.get("$ref").and_then(Value::as_str) {
                    let key =
                        r.strip_prefix("#/$defs/").unwrap_or_else(|| panic!("non-local $ref {r}"));
                    let mut target =
                        defs.get(key).unwrap_or_else(|| panic!("$ref to missing {key}")).clone();
                    let t = target.as_object_mut().expect("$defs entries are objects");
                    for (k, v) in m.iter().filter(|(k, _)| *k != "$ref") {
                        t.insert(k.clone(), v.clone());
                    }
                    inline(&target, defs)
                } else {
                    Value::Object(m.iter().map(|(k, v)| (k.clone(), inline(v, defs))).collect())
                }
            }
            other => other.clone(),
        }
    }
    let defs = schema["$defs"].as_object().expect("$defs").clone();
    let mut top = schema.as_object().expect("schema object").clone();
    for k in ["$schema", "$id", "$defs", "anyOf"] {
        top.remove(k);
    }
    let mut out = inline(&Value::Object(top), &defs);
    out["properties"].as_object_mut().expect("properties").remove("_rules_");
    out["allOf"] = json!([inline(&json!({"$ref": "#/$defs/policyConfig"}), &defs)]);
    out
}

fn assert_openapi_3_0(v: &Value, at: &str) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                // JSON Schema keywords the console's OpenAPI 3.0 reader does not know.
                assert!(
                    ![
                        "$ref",
                        "$defs",
                        "$schema",
                        "$id",
                        "const",
                        "if",
                        "then",
                        "else",
                        "prefixItems",
                        "examples"
                    ]
                    .contains(&k.as_str()),
                    "spec.yaml {at}: `{k}` is not OpenAPI 3.0"
                );
                if k == "exclusiveMinimum" || k == "exclusiveMaximum" {
                    assert!(x.is_boolean(), "spec.yaml {at}.{k}: OpenAPI 3.0 wants a boolean");
                }
                if k == "type" {
                    assert!(x.is_string(), "spec.yaml {at}.type: one type only in OpenAPI 3.0");
                }
                assert_openapi_3_0(x, &format!("{at}.{k}"));
            }
        }
        Value::Array(a) => {
            a.iter().enumerate().for_each(|(i, x)| assert_openapi_3_0(x, &format!("{at}[{i}]")))
        }
        _ => {}
    }
}

fn spec_yaml() -> Value {
    yaml_to_json(&read("higress/spec.yaml"), "higress/spec.yaml")
}

#[test]
fn spec_yaml_embeds_the_schema_and_a_valid_example() {
    let schema = Schema::load();
    let spec = spec_yaml();
    assert_eq!(spec["apiVersion"], json!("1.0.0"));
    assert_eq!(
        spec["info"]["version"],
        json!(plugin_version()),
        "spec.yaml info.version = Cargo.toml version"
    );
    assert_eq!(spec["info"]["category"], json!("ai"));
    assert!(spec["info"]["name"].as_str().is_some_and(|s| !s.is_empty()));
    assert!(spec["info"]["x-title-i18n"]["zh-CN"].is_string(), "Chinese title for the console");
    assert_eq!(spec["spec"]["phase"], json!("UNSPECIFIED_PHASE"));
    assert_eq!(spec["spec"]["priority"], json!(50));

    let expected = openapi_from_schema(&schema.json);
    for which in ["configSchema", "routeConfigSchema"] {
        let mut got = spec["spec"][which]["openAPIV3Schema"].clone();
        assert!(got.is_object(), "spec.yaml spec.{which}.openAPIV3Schema missing");
        let example = got
            .as_object_mut()
            .expect("object")
            .remove("example")
            .expect("an example in spec.yaml");
        assert!(
            got == expected,
            "spec.yaml spec.{which} differs from plugin-config/schema.json: run `python3 higress/gen-spec.py`"
        );
        assert_openapi_3_0(&got, which);
        let parsed = parse(&example)
            .unwrap_or_else(|e| panic!("spec.yaml {which}.example: the plugin refuses it: {e}"));
        assert!(parsed.default.is_some());
        schema
            .check(&example)
            .unwrap_or_else(|e| panic!("spec.yaml {which}.example: schema refuses it: {e}"));
    }
}

/// What Higress hands the plugin for a WasmPlugin: defaultConfig (unless disabled) plus one
/// `_rules_` entry per enabled matchRule (ingress -> _match_route_, domain -> _match_domain_,
/// service -> _match_service_).
fn delivered_config(spec: &Value, n: &str) -> Value {
    let mut out = Map::new();
    if !spec["defaultConfigDisable"].as_bool().unwrap_or(false) {
        if let Some(d) = spec["defaultConfig"].as_object() {
            out.extend(d.clone());
        }
    }
    let mut rules = Vec::new();
    for (i, r) in spec["matchRules"].as_array().cloned().unwrap_or_default().iter().enumerate() {
        if r["configDisable"].as_bool().unwrap_or(false) {
            continue;
        }
        let mut rule = r["config"]
            .as_object()
            .cloned()
            .unwrap_or_else(|| panic!("{n} matchRules[{i}]: no config"));
        for (from, to) in [
            ("ingress", "_match_route_"),
            ("domain", "_match_domain_"),
            ("service", "_match_service_"),
        ] {
            if let Some(list) = r.get(from) {
                rule.insert(to.into(), list.clone());
            }
        }
        rules.push(Value::Object(rule));
    }
    if !rules.is_empty() {
        out.insert("_rules_".into(), Value::Array(rules));
    }
    Value::Object(out)
}

#[test]
fn wasmplugin_resources_deliver_configs_the_plugin_accepts() {
    let schema = Schema::load();
    let spec_yaml = spec_yaml();
    let version = plugin_version();
    let mut global = BTreeSet::new();
    let mut per_route = BTreeSet::new();
    for path in yaml_files("higress/wasmplugin") {
        let n = name(&path);
        let cr = yaml_to_json(&fs::read_to_string(&path).expect("read"), &n);
        assert_eq!(cr["apiVersion"], json!("extensions.higress.io/v1alpha1"), "{n}");
        assert_eq!(cr["kind"], json!("WasmPlugin"), "{n}");
        assert_eq!(cr["metadata"]["namespace"], json!("higress-system"), "{n}");
        let spec = &cr["spec"];
        assert_eq!(
            spec["failStrategy"],
            json!("FAIL_OPEN"),
            "{n}: traffic must keep flowing if the plugin fails"
        );
        let url = spec["url"].as_str().unwrap_or_default();
        assert!(
            url.starts_with("oci://") && url.ends_with(&format!(":{version}")),
            "{n}: url {url} is not oci://…:{version}"
        );
        assert_eq!(spec["phase"], spec_yaml["spec"]["phase"], "{n}: phase as in spec.yaml");
        assert_eq!(
            spec["priority"], spec_yaml["spec"]["priority"],
            "{n}: priority as in spec.yaml"
        );

        let cfg = delivered_config(spec, &n);
        let parsed = parse(&cfg).unwrap_or_else(|e| {
            panic!("{n}: the plugin refuses what Higress delivers: {e}\n{cfg}")
        });
        schema.check(&cfg).unwrap_or_else(|e| panic!("{n}: schema refuses it: {e}"));
        if let Some(d) = &parsed.default {
            assert!(spec["matchRules"].is_null(), "{n}: one style per file");
            global.insert(policy_name(&d.policy));
        }
        for r in &parsed.rules {
            per_route.insert(policy_name(&r.config.policy));
        }
        if spec["defaultConfigDisable"].as_bool() == Some(true) {
            assert!(
                parsed.default.is_none(),
                "{n}: defaultConfigDisable leaves unmatched routes untouched"
            );
        }
    }
    for p in POLICIES {
        assert!(global.contains(p), "no global (defaultConfig) WasmPlugin for {p}");
        assert!(per_route.contains(p), "no per-route (matchRules) WasmPlugin for {p}");
    }
}

#[test]
fn local_envoy_setup_is_consistent() {
    let envoy = yaml_to_json(&read("higress/envoy.yaml"), "higress/envoy.yaml");
    let clusters = envoy["static_resources"]["clusters"].as_array().expect("static clusters");
    let cluster_names: BTreeSet<&str> =
        clusters.iter().filter_map(|c| c["name"].as_str()).collect();
    assert!(
        cluster_names.contains("outbound|6379||redis.static"),
        "Redis cluster name the plugin calls: {cluster_names:?}"
    );

    // Every wasm filter: our module, ABI-compatible runtime, and a configuration the plugin accepts
    // whose Redis cluster exists.
    let text = envoy.to_string();
    let mut filters = Vec::new();
    find_key(&envoy, "envoy.filters.http.wasm", &mut filters);
    assert!(!filters.is_empty(), "envoy.yaml has no wasm filter");
    for f in filters {
        let cfg = &f["typed_config"]["config"];
        assert_eq!(cfg["vm_config"]["runtime"], json!("envoy.wasm.runtime.v8"));
        let file = cfg["vm_config"]["code"]["local"]["filename"].as_str().unwrap_or_default();
        assert!(file.ends_with(".wasm"), "module path {file}");
        let conf = cfg["configuration"]["value"].as_str().expect("configuration StringValue");
        let parsed = PluginConfig::from_json(conf.as_bytes())
            .unwrap_or_else(|e| panic!("envoy.yaml plugin configuration: {e}"));
        let all = parsed.default.iter().chain(parsed.rules.iter().map(|r| &r.config));
        for c in all {
            let redis = match &c.policy {
                PolicyConfig::GlobalLeastRequest(g) => Some(g.redis.cluster()),
                PolicyConfig::PrefixCache(p) => Some(p.least_request.redis.cluster()),
                _ => None,
            };
            if let Some(r) = redis {
                assert!(
                    cluster_names.contains(r.as_str()),
                    "plugin calls Redis cluster {r}, not defined in envoy.yaml"
                );
            }
            // cluster_metrics only works if a route forwards by the header the plugin writes, to
            // clusters that exist.
            if let PolicyConfig::ClusterMetrics(m) = &c.policy {
                assert!(
                    text.contains(&format!("\"cluster_header\":\"{}\"", m.cluster_header)),
                    "no envoy.yaml route forwards by the plugin's cluster_header {}",
                    m.cluster_header
                );
                for s in &m.service_list {
                    assert!(
                        cluster_names.contains(s.as_str()),
                        "service_list names {s}, not defined in envoy.yaml"
                    );
                }
            }
        }
    }
    // Pods' metrics reach the plugin through health checks that store the response body.
    assert!(
        text.contains("\"store_metrics\":true"),
        "an LLM cluster health check with store_metrics: true"
    );

    let compose = yaml_to_json(&read("higress/docker-compose.yaml"), "higress/docker-compose.yaml");
    let services = compose["services"].as_object().expect("compose services");
    assert!(services.contains_key("redis"), "compose has a redis service");
    let gw = services
        .values()
        .find(|s| s["image"].as_str().is_some_and(|i| i.contains("higress")))
        .expect("a Higress service");
    let vols = gw["volumes"].to_string();
    assert!(
        vols.contains("envoy.yaml") && vols.contains(".wasm"),
        "Higress mounts envoy.yaml and the module: {vols}"
    );
}

fn find_key<'a>(v: &'a Value, name: &str, out: &mut Vec<&'a Value>) {
    match v {
        Value::Object(m) => {
            if m.get("name").and_then(Value::as_str) == Some(name) {
                out.push(v);
            }
            m.values().for_each(|x| find_key(x, name, out));
        }
        Value::Array(a) => a.iter().for_each(|x| find_key(x, name, out)),
        _ => {}
    }
}

#[test]
fn readmes_document_every_key_with_its_default() {
    let schema = Schema::load();
    for readme in ["higress/README.md", "higress/README_EN.md"] {
        let text = read(readme);
        for p in POLICIES.iter().chain(["metrics_based"].iter()) {
            assert!(text.contains(p), "{readme} does not mention {p}");
        }
        for (key, prop) in schema.lb_config_props() {
            let row = text
                .lines()
                .find(|l| l.starts_with('|') && l.contains(&format!("`{key}`")))
                .unwrap_or_else(|| panic!("{readme}: no table row for `{key}`"));
            if let Some(d) = prop.get("default") {
                let shown = match d {
                    Value::String(s) if s.is_empty() => None,
                    Value::String(s) => Some(s.clone()),
                    other => Some(other.to_string()),
                };
                if let Some(s) = shown {
                    assert!(
                        row.contains(&s),
                        "{readme}: the row of `{key}` does not show its default {s}: {row}"
                    );
                }
            }
        }
        assert!(
            text.contains("oras push") || readme.ends_with("README.md"),
            "{readme}: publishing steps"
        );
        assert!(text.contains("FAIL_OPEN"), "{readme}: WasmPlugin example with failStrategy");
    }
}

/// A minimal valid WebAssembly module (magic + version), for when the real plugin is not built.
const DUMMY_WASM: &[u8] = b"\0asm\x01\0\0\0";

/// The module to package: a private copy of the built plugin (so a concurrent rebuild cannot change
/// it under the test), or a stand-in when the plugin has not been built. `tag` keeps parallel tests
/// apart.
fn wasm_for_packaging(tag: &str) -> (PathBuf, Vec<u8>) {
    let real = root().join("target/wasm32-wasip1/wasm-release/ai_load_balancer.wasm");
    let bytes = match fs::read(&real) {
        Ok(b) => b,
        Err(_) => {
            eprintln!("packaging: {} not built; packaging a stand-in module", real.display());
            DUMMY_WASM.to_vec()
        }
    };
    let p = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("packaging-{tag}.wasm"));
    fs::write(&p, &bytes).expect("write module copy");
    (p, bytes)
}

fn build_artifact(out: &Path, wasm: &Path) -> std::process::Output {
    Command::new("bash")
        .arg(root().join("higress/build-artifact.sh"))
        .arg("--wasm")
        .arg(wasm)
        .arg("--image")
        .arg("registry.example.com/plugins/ai-load-balancer-rs:test")
        .arg(out)
        .output()
        .expect("run build-artifact.sh")
}

fn tar_entries(gz: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(gz));
    let mut out = Vec::new();
    for e in archive.entries().expect("tar entries") {
        let mut e = e.expect("tar entry");
        let path = e.path().expect("entry path").to_string_lossy().into_owned();
        let mut data = Vec::new();
        e.read_to_end(&mut data).expect("entry data");
        out.push((path, data));
    }
    out
}

#[test]
fn artefact_dir_has_the_marketplace_layout() {
    let (wasm, wasm_bytes) = wasm_for_packaging("artefact");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("packaging-artefact");
    let _ = fs::remove_dir_all(&out);
    let run = build_artifact(&out, &wasm);
    assert!(
        run.status.success(),
        "build-artifact.sh failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(stdout.contains("oras push"), "the push command is printed: {stdout}");

    for (file, _) in LAYERS {
        assert!(out.join(file).is_file(), "{file} missing in the artefact dir");
    }
    // Layer order and media types, as listed and as in the push command.
    let layers = fs::read_to_string(out.join("layers.txt")).expect("layers.txt");
    let want: Vec<String> = LAYERS.iter().map(|(f, m)| format!("{f}:{m}")).collect();
    assert_eq!(layers.lines().collect::<Vec<_>>(), want, "layers.txt");
    let push = fs::read_to_string(out.join("push.sh")).expect("push.sh");
    let args: Vec<&str> = push
        .split("oras push")
        .nth(1)
        .expect("oras push in push.sh")
        .split_whitespace()
        .filter(|a| *a != "\\")
        .collect();
    assert_eq!(
        args.first().copied(),
        Some("'registry.example.com/plugins/ai-load-balancer-rs:test'")
    );
    let pushed: Vec<String> =
        args.iter().skip(1).map(|a| a.trim_start_matches("./").to_string()).collect();
    assert_eq!(pushed, want, "push.sh pushes the layers in order, plugin.tar.gz last");

    // The documents are the ones in higress/, and spec.yaml is valid YAML with the schema.
    for f in ["spec.yaml", "README.md", "README_EN.md"] {
        assert_eq!(
            fs::read_to_string(out.join(f)).expect("read"),
            read(&format!("higress/{f}")),
            "{f} copied"
        );
    }
    let spec = yaml_to_json(
        &fs::read_to_string(out.join("spec.yaml")).expect("read"),
        "artefact spec.yaml",
    );
    assert!(spec["spec"]["configSchema"]["openAPIV3Schema"]["properties"]["lb_config"].is_object());

    // The tarball holds exactly plugin.wasm, byte for byte.
    let gz = fs::read(out.join("plugin.tar.gz")).expect("plugin.tar.gz");
    let entries = tar_entries(&gz);
    assert_eq!(
        entries.len(),
        1,
        "plugin.tar.gz holds one file: {:?}",
        entries.iter().map(|e| &e.0).collect::<Vec<_>>()
    );
    assert_eq!(entries[0].0, "plugin.wasm");
    assert!(entries[0].1 == wasm_bytes, "plugin.tar.gz's plugin.wasm is the built module");

    // Building twice gives the same tarball (reproducible layer digest).
    let out2 = Path::new(env!("CARGO_TARGET_TMPDIR")).join("packaging-artefact-2");
    let _ = fs::remove_dir_all(&out2);
    assert!(build_artifact(&out2, &wasm).status.success());
    assert!(
        fs::read(out2.join("plugin.tar.gz")).expect("second tarball") == gz,
        "tarball is reproducible"
    );
}

#[test]
fn artefact_script_refuses_a_file_that_is_not_wasm() {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let bogus = tmp.join("packaging-not-wasm.wasm");
    fs::write(&bogus, b"#!/bin/sh\necho not a module\n").expect("write");
    let out = tmp.join("packaging-artefact-refused");
    let run = build_artifact(&out, &bogus);
    assert!(!run.status.success(), "a non-wasm file must not be packaged");
    assert!(String::from_utf8_lossy(&run.stderr).contains("is not a WebAssembly module"));
    assert!(!out.join("plugin.tar.gz").exists());
}

fn docker_available() -> bool {
    Command::new("docker").arg("info").output().is_ok_and(|o| o.status.success())
}

#[test]
fn docker_image_holds_exactly_plugin_wasm() {
    if !docker_available() {
        // CI machines have a Docker engine: there a missing engine is a failure, not a skip.
        assert!(std::env::var_os("CI").is_none(), "CI=true but no Docker engine is reachable");
        eprintln!("packaging: no Docker engine reachable; image check skipped");
        return;
    }
    let (wasm, wasm_bytes) = wasm_for_packaging("docker");
    let ctx = Path::new(env!("CARGO_TARGET_TMPDIR")).join("packaging-docker-ctx");
    let _ = fs::remove_dir_all(&ctx);
    assert!(build_artifact(&ctx, &wasm).status.success());
    let tag = format!("ai-load-balancer-rs-packaging-test:{}", std::process::id());
    let build = Command::new("docker")
        .args(["build", "-q", "-f"])
        .arg(root().join("higress/Dockerfile"))
        .args(["-t", &tag])
        .arg(&ctx)
        .output()
        .expect("docker build");
    assert!(
        build.status.success(),
        "docker build failed: {}",
        String::from_utf8_lossy(&build.stderr)
    );
    let save = Command::new("docker").args(["save", &tag]).output().expect("docker save");
    let _ = Command::new("docker").args(["rmi", "-f", &tag]).output();
    assert!(save.status.success(), "docker save failed");

    // The saved image: manifest.json names the layer tarballs; together they hold one file.
    let mut outer = tar::Archive::new(save.stdout.as_slice());
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    let mut blobs: Vec<(String, Vec<u8>)> = Vec::new();
    for e in outer.entries().expect("image tar") {
        let mut e = e.expect("entry");
        let p = e.path().expect("path").to_string_lossy().into_owned();
        let mut data = Vec::new();
        e.read_to_end(&mut data).expect("data");
        blobs.push((p, data));
    }
    let manifest: Value = serde_json::from_slice(
        &blobs.iter().find(|(p, _)| p == "manifest.json").expect("manifest.json").1,
    )
    .expect("manifest JSON");
    let layers = manifest[0]["Layers"].as_array().expect("Layers");
    assert_eq!(layers.len(), 1, "FROM scratch + one COPY = one layer");
    for l in layers {
        let l = l.as_str().expect("layer path");
        let blob = &blobs.iter().find(|(p, _)| p == l).expect("layer blob").1;
        for e in tar::Archive::new(blob.as_slice()).entries().expect("layer tar") {
            let mut e = e.expect("entry");
            let p = e.path().expect("path").to_string_lossy().into_owned();
            let mut data = Vec::new();
            e.read_to_end(&mut data).expect("data");
            files.push((p, data));
        }
    }
    assert_eq!(files.iter().map(|f| f.0.as_str()).collect::<Vec<_>>(), vec!["plugin.wasm"]);
    assert!(files[0].1 == wasm_bytes, "the image's plugin.wasm is the built module");
}
