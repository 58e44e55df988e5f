//! The policies a scenario can run, by name: what routes the traffic (our gateway with or without
//! the plugin, or a competing router) and how it is configured. One table, [`POLICIES`]: a new
//! variant is one entry there (e.g. `prefix_cache` with one more `lb_config` key).
//!
//! Dispatch points (every other file asks this module, never matches on policy names):
//! - [`Policy::route`]: [`Route::Gateway`] runs our gateway (`crate::start_gateway`),
//!   [`Route::External`] a competitor router (`crate::routers`);
//! - [`Policy::gateway_plugin`]: the plugin's `lb_policy` and `lb_config` for a gateway run;
//! - [`Policy::uses_redis`]: whether Redis figures mean anything for the run;
//! - [`Policy::client_header`]: what the load generator adds to each request.

use anyhow::{anyhow, Result};
use serde_json::{Map, Value};

/// A competing router shipped on PyPI (installed by `build.sh` into `.venv-routers/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Router {
    /// SGLang's router, `sglang-router` 0.3.2 (`sglang-router launch ...`).
    Sglang,
    /// vLLM's router, `vllm-router` 0.1.17.
    Vllm,
}

impl Router {
    /// The command in `.venv-routers/bin/`.
    pub fn bin(self) -> &'static str {
        match self {
            Router::Sglang => "sglang-router",
            Router::Vllm => "vllm-router",
        }
    }

    /// Arguments before the router's options (`sglang-router` has subcommands).
    pub fn subcommand(self) -> &'static [&'static str] {
        match self {
            Router::Sglang => &["launch"],
            Router::Vllm => &[],
        }
    }
}

/// What our gateway does for a policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatewayMode {
    /// No plugin: Envoy's round robin over one cluster.
    RoundRobin,
    /// No plugin: one cluster per pod, the client naming one per session in a header
    /// (`cluster_header`), what a hash-on-session balancer gives.
    SessionHash,
    /// The plugin with `lb_policy`.
    Plugin {
        /// The plugin's `lb_policy`.
        lb_policy: &'static str,
        /// Keys added over the scenario's `lb_config` (a JSON object, e.g. `{"loadAware":true}`).
        extra_lb_config: &'static str,
        /// Only the Go plugin's keys from the scenario's `lb_config` (the Go-mode baseline).
        go_keys_only: bool,
    },
}

/// Who routes a policy's traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Our gateway (one per gateway slot), sharing one Redis.
    Gateway(GatewayMode),
    /// A competitor router (one independent instance per gateway slot), its own `--policy`.
    External {
        /// Which router.
        router: Router,
        /// Its `--policy` value.
        policy: &'static str,
    },
}

/// A header the load generator adds to every request of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientHeader {
    /// Nothing.
    None,
    /// `x-bench-session-cluster: <pod cluster>` from the session's hash (our `session_hash`).
    SessionCluster,
    /// `X-Session-ID: <session id>`: what vLLM's router hashes in `consistent_hash` and
    /// `sticky_least_loaded` (first in its key order, before user/tenant/request ids and the body).
    SessionId,
}

/// One runnable policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Name in scenarios, `--policies` and the results.
    pub name: &'static str,
    /// Who routes.
    pub route: Route,
}

/// The lb_config keys the Go plugin reads (Redis connection, TTL, least-request limits); the others
/// are ours and off by default.
pub const GO_LB_CONFIG_KEYS: &[&str] = &[
    "serviceFQDN",
    "servicePort",
    "username",
    "password",
    "timeout",
    "database",
    "redisKeyTTL",
    "maxRequestCount",
    "cleanInterval",
    "enableDetailLog",
];

const fn plugin(name: &'static str, lb_policy: &'static str) -> Policy {
    plugin_with(name, lb_policy, "{}")
}

/// `lb_policy` with `extra_lb_config` over the scenario's lb_config (a variant of our own keys).
const fn plugin_with(
    name: &'static str,
    lb_policy: &'static str,
    extra_lb_config: &'static str,
) -> Policy {
    Policy {
        name,
        route: Route::Gateway(GatewayMode::Plugin {
            lb_policy,
            extra_lb_config,
            go_keys_only: false,
        }),
    }
}

const fn external(name: &'static str, router: Router, policy: &'static str) -> Policy {
    Policy { name, route: Route::External { router, policy } }
}

/// Every policy the runner knows.
pub const POLICIES: &[Policy] = &[
    Policy { name: "round_robin", route: Route::Gateway(GatewayMode::RoundRobin) },
    Policy { name: "session_hash", route: Route::Gateway(GatewayMode::SessionHash) },
    plugin("global_least_request", "global_least_request"),
    // The scenario's lb_config applies (a scenario may turn our own keys on).
    plugin("prefix_cache", "prefix_cache"),
    // prefix_cache exactly as a Go config gives it: our own keys dropped from the scenario's.
    Policy {
        name: "prefix_cache_go",
        route: Route::Gateway(GatewayMode::Plugin {
            lb_policy: "prefix_cache",
            extra_lb_config: "{}",
            go_keys_only: true,
        }),
    },
    // prefix_cache with the Go plugin's block cuts for agents' tool rounds (our default before
    // 2026-11-30: only user messages end a block).
    plugin_with("prefix_cache_user_cuts", "prefix_cache", r#"{"splitToolResults":false}"#),
    // Ours: prefix_cache weighing affinity against the pods' GPU metrics (stored by the health check).
    plugin_with("prefix_cache_load_aware", "prefix_cache", r#"{"loadAware":true}"#),
    // loadAware without the observed-latency signal (on by default, weight 16).
    plugin_with(
        "prefix_cache_load_aware_no_latency",
        "prefix_cache",
        r#"{"loadAware":true,"loadLatencyWeight":0}"#,
    ),
    // loadAware diverting hits off a pod observed 1.6x as slow as the fastest, explicitly (the
    // default since 2026-11-27 evening; before it, off: tables before then compare the two).
    plugin_with(
        "prefix_cache_load_aware_divert_slow",
        "prefix_cache",
        r#"{"loadAware":true,"overloadLatency":1.6}"#,
    ),
    // loadAware that never diverts a hit for slowness (the default before 2026-11-27 evening).
    plugin_with(
        "prefix_cache_load_aware_no_divert",
        "prefix_cache",
        r#"{"loadAware":true,"overloadLatency":0}"#,
    ),
    // loadAware that also diverts hits off a pod whose KV-cache use is 0.2 above the least used
    // pod's (the default before 2026-11-26; off by default since).
    plugin_with(
        "prefix_cache_load_aware_kv_divert",
        "prefix_cache",
        r#"{"loadAware":true,"overloadKvCache":0.2}"#,
    ),
    // loadAware without the prefill backlog signal (the default before 2026-11-28).
    plugin_with(
        "prefix_cache_load_aware_no_prefill",
        "prefix_cache",
        r#"{"loadAware":true,"loadPrefillBytes":0}"#,
    ),
    // loadAware whose diverts do not weigh the cached prefix they give up (the default before
    // 2026-11-28 afternoon).
    plugin_with(
        "prefix_cache_load_aware_no_divert_cost",
        "prefix_cache",
        r#"{"loadAware":true,"divertPrefixBytes":0}"#,
    ),
    // loadAware with the Go plugin's block cuts for agents' tool rounds (before 2026-11-30).
    plugin_with(
        "prefix_cache_load_aware_user_cuts",
        "prefix_cache",
        r#"{"loadAware":true,"splitToolResults":false}"#,
    ),
    // loadAware with the keys of every model in one space, as the Go plugin keys them (the
    // default before 2026-12-01: a LoRA adapter's request was promised another adapter's cache).
    plugin_with(
        "prefix_cache_load_aware_unscoped",
        "prefix_cache",
        r#"{"loadAware":true,"scopedKeys":false}"#,
    ),
    // loadAware letting a prefix key name up to 4 pods (the default is 2): after a scale-out the
    // new pods can become holders of prompts the old ones already hold.
    plugin_with(
        "prefix_cache_load_aware_holders4",
        "prefix_cache",
        r#"{"loadAware":true,"maxHolders":4}"#,
    ),
    plugin("endpoint_metrics", "endpoint_metrics"),
    external("sglang_round_robin", Router::Sglang, "round_robin"),
    external("sglang_cache_aware", Router::Sglang, "cache_aware"),
    external("vllm_round_robin", Router::Vllm, "round_robin"),
    external("vllm_cache_aware", Router::Vllm, "cache_aware"),
    external("vllm_consistent_hash", Router::Vllm, "consistent_hash"),
    external("vllm_sticky_least_loaded", Router::Vllm, "sticky_least_loaded"),
];

/// The policy called `name`.
pub fn lookup(name: &str) -> Result<&'static Policy> {
    POLICIES.iter().find(|p| p.name == name).ok_or_else(|| {
        let known: Vec<&str> = POLICIES.iter().map(|p| p.name).collect();
        anyhow!("unknown policy {name:?}; known: {}", known.join(", "))
    })
}

impl Policy {
    /// Whether the run talks to Redis (its Redis figures are the policy's cost).
    pub fn uses_redis(&self) -> bool {
        match self.route {
            Route::Gateway(GatewayMode::Plugin { lb_policy, .. }) => {
                lb_policy != "endpoint_metrics"
            }
            _ => false,
        }
    }

    /// Whether the gateway's health check stores the pods' /metrics for the plugin: the policies
    /// that route by them (`endpoint_metrics`, `loadAware`).
    pub fn scrapes_metrics(&self) -> bool {
        match self.route {
            Route::Gateway(GatewayMode::Plugin { lb_policy, extra_lb_config, .. }) => {
                lb_policy == "endpoint_metrics" || extra_lb_config.contains(r#""loadAware":true"#)
            }
            _ => false,
        }
    }

    /// The header the load generator sends.
    pub fn client_header(&self) -> ClientHeader {
        match self.route {
            Route::Gateway(GatewayMode::SessionHash) => ClientHeader::SessionCluster,
            Route::External {
                router: Router::Vllm,
                policy: "consistent_hash" | "sticky_least_loaded",
            } => ClientHeader::SessionId,
            _ => ClientHeader::None,
        }
    }

    /// For a gateway run with the plugin: `lb_policy` and `lb_config` (Redis keys, then the
    /// scenario's keys, Go ones only in Go mode, then the policy's own). None without a plugin.
    pub fn gateway_plugin(
        &self,
        scenario_lb_config: &Map<String, Value>,
    ) -> Result<Option<(&'static str, Map<String, Value>)>> {
        let Route::Gateway(GatewayMode::Plugin { lb_policy, extra_lb_config, go_keys_only }) =
            self.route
        else {
            return Ok(None);
        };
        let mut lb = Map::new();
        if self.uses_redis() {
            lb.insert("serviceFQDN".into(), Value::from("redis.static"));
            lb.insert("servicePort".into(), Value::from(6379));
        }
        for (k, v) in scenario_lb_config {
            if !go_keys_only || GO_LB_CONFIG_KEYS.contains(&k.as_str()) {
                lb.insert(k.clone(), v.clone());
            }
        }
        match serde_json::from_str::<Value>(extra_lb_config) {
            Ok(Value::Object(extra)) => lb.extend(extra),
            _ => return Err(anyhow!("policy {}: extra_lb_config is not a JSON object", self.name)),
        }
        Ok(Some((lb_policy, lb)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_are_unique_and_every_plugin_entry_builds_its_config() {
        let mut names: Vec<&str> = POLICIES.iter().map(|p| p.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), POLICIES.len(), "duplicate policy name");
        for p in POLICIES {
            let cfg = p.gateway_plugin(&Map::new()).expect("extra_lb_config parses");
            assert_eq!(
                cfg.is_some(),
                matches!(p.route, Route::Gateway(GatewayMode::Plugin { .. }))
            );
        }
        assert!(lookup("nope").is_err());
    }

    #[test]
    fn go_mode_drops_our_keys_and_default_mode_keeps_them() {
        let sc = json!({"splitSystemPrompt": true, "hitLoadFactor": 2, "redisKeyTTL": 60});
        let sc = sc.as_object().expect("object");
        let (lp, lb) = lookup("prefix_cache_go")
            .and_then(|p| p.gateway_plugin(sc))
            .expect("config")
            .expect("plugin");
        assert_eq!(lp, "prefix_cache");
        assert_eq!(
            Value::Object(lb),
            json!({"serviceFQDN": "redis.static", "servicePort": 6379, "redisKeyTTL": 60})
        );
        let (_, lb) = lookup("prefix_cache")
            .and_then(|p| p.gateway_plugin(sc))
            .expect("config")
            .expect("plugin");
        assert_eq!(lb.get("splitSystemPrompt"), Some(&json!(true)));
        assert_eq!(lb.get("hitLoadFactor"), Some(&json!(2)));
    }

    #[test]
    fn redis_headers_and_routers_follow_the_entry() {
        let get = |n| lookup(n).expect("known");
        assert!(get("global_least_request").uses_redis());
        assert!(!get("endpoint_metrics").uses_redis());
        assert!(get("endpoint_metrics").scrapes_metrics());
        let (_, lb) = get("endpoint_metrics").gateway_plugin(&Map::new()).expect("ok").expect("p");
        assert!(!lb.contains_key("serviceFQDN"), "endpoint_metrics needs no Redis");
        assert!(!get("sglang_cache_aware").uses_redis());
        assert_eq!(get("session_hash").client_header(), ClientHeader::SessionCluster);
        assert_eq!(get("vllm_consistent_hash").client_header(), ClientHeader::SessionId);
        assert_eq!(get("vllm_sticky_least_loaded").client_header(), ClientHeader::SessionId);
        assert_eq!(get("vllm_cache_aware").client_header(), ClientHeader::None);
        assert_eq!(
            get("sglang_cache_aware").route,
            Route::External { router: Router::Sglang, policy: "cache_aware" }
        );
    }
}
