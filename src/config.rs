//! Plugin configuration: the JSON shape, keys and defaults of Higress's Go `ai-load-balancer`, read
//! with Go's meaning (README "Coming from the Go plugin" lists every difference),
//! plus a few keys of ours (camelCase like the Go `lb_config` keys). These types are the
//! documentation of the config; README "## Plugin configuration" lists every key with its default.
//!
//! Parsing is manual over `serde_json::Value` so that every error names the field and the accepted
//! values (one clear log line when the plugin refuses to start).

use serde_json::{Map, Value};
use std::cell::RefCell;

/// Default Redis operation timeout (ms), as in Go.
pub const DEFAULT_REDIS_TIMEOUT_MS: u32 = 3000;
/// Default TTL of prefix keys (s), as in Go.
pub const DEFAULT_REDIS_KEY_TTL_S: u64 = 1800;
/// Default interval between cleanups of hosts that left the cluster (minutes), as in Go.
pub const DEFAULT_CLEAN_INTERVAL_MIN: u64 = 60;
/// Default largest request body the plugin buffers to route on (ours). Larger bodies pass through
/// to normal balancing: hashing or parsing more would cost more than it saves.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 * 1024 * 1024;
/// Default cluster header for `cluster_metrics`, as in the current Go code (its README says
/// `x-envoy-target-cluster`; set `cluster_header` explicitly to use that).
pub const DEFAULT_CLUSTER_HEADER: &str = "x-higress-target-cluster";
/// Default latency sample queue size for `cluster_metrics`, as in Go.
pub const DEFAULT_QUEUE_SIZE: usize = 100;
/// Default sliding window size (requests) for `endpoint_metrics` `rate_limit` (ours; Go always
/// counts its last 100 picks).
pub const DEFAULT_WINDOW_SIZE: usize = 100;
/// Default sliding window length (s) for `endpoint_metrics` `rate_limit` (ours; Go has none).
pub const DEFAULT_WINDOW_SECONDS: u64 = 60;
/// Default `prefix_cache` hit load guard (ours): a prefix hit is not taken when the hit host has
/// more than `hitLoadFactor` × (least in-flight + 1) requests in flight. 0 disables the guard.
pub const DEFAULT_HIT_LOAD_FACTOR: f64 = 0.0;
/// `prefix_cache` `loadAware` thresholds (ours; see [`LoadAwareConfig`]): a hit's pod is overloaded
/// when its waiting queue exceeds the least queued pod's by more than this many requests...
pub const DEFAULT_OVERLOAD_QUEUE: f64 = 4.0;
/// ... or its KV-cache use (0-1) exceeds the least used pod's by more than this (1: never, the
/// default: on `cache-pressure`, where every pod's cache is full of sessions, the former 0.2 diverted
/// hits whenever pods' running contexts differed, each a full prefill elsewhere that evicted that
/// pod's sessions in turn: hit rate 49% against 72% with it off; README, "Load-aware defaults")...
pub const DEFAULT_OVERLOAD_KV_CACHE: f64 = 1.0;
/// ... or its in-flight count exceeds the least loaded pod's by more than this...
pub const DEFAULT_OVERLOAD_INFLIGHT: u32 = 4;
/// ... and, for each signal, by more than this factor (SGLang's absolute AND relative imbalance).
pub const DEFAULT_OVERLOAD_RATIO: f64 = 1.5;
/// KV-cache use counts as this many queued requests at 100% in the combined load signal.
pub const DEFAULT_LOAD_KV_WEIGHT: f64 = 8.0;
/// Most pods one prefix key may name as holders (a hot prefix spread by diverted hits).
pub const DEFAULT_MAX_HOLDERS: u32 = 2;
/// A pod twice as slow as the fastest (by the decode rate this gateway observes) counts as this
/// many more requests in flight in the combined load signal (misses only; 0 turns it off). 16:
/// `unequal-pods` p90 TTFT 0.90x Go mode against 1.02x without it, `hot-spot` unchanged (README,
/// "Load-aware defaults").
pub const DEFAULT_LOAD_LATENCY_WEIGHT: f64 = 16.0;
/// A hit's pod this many times as steadily slow as the fastest pod is overloaded (0 = never for
/// slowness). 1.6 meets `unequal-pods` (0.79x Go mode's p90) and, since slowness is the median gap
/// between chunks of answers long enough to time, costs no other scenario (README, "Load-aware
/// defaults"). A pod full of long contexts is at most about 1.3x slower per step.
pub const DEFAULT_OVERLOAD_LATENCY: f64 = 1.6;
/// Bytes of a pod's prefill backlog (prompts this worker sent it, not answered yet, past what it
/// holds) that count as one more request in flight in the combined load signal (0 = off).
pub const DEFAULT_LOAD_PREFILL_BYTES: u32 = 4096;
/// `divertPrefixBytes` default: a diverted hit pays one request per 4096 bytes of the matched
/// prefix it gives up (the same exchange rate as `loadPrefillBytes`: bytes to prefill that weigh
/// as one request).
pub const DEFAULT_DIVERT_PREFIX_BYTES: u32 = 4096;
/// Default age (ms) after which scraped metrics count as unknown (ours).
pub const DEFAULT_METRICS_STALE_MS: u64 = 5000;
/// Default `hostListCacheMs`.
pub const DEFAULT_HOST_LIST_CACHE_MS: u64 = 10;
/// Default scrape interval (ms) when the host list carries no metrics (ours).
pub const DEFAULT_SCRAPE_INTERVAL_MS: u32 = 1000;

/// A configuration error: which field, and what was wrong (including the accepted values).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Dotted path of the offending field, e.g. `lb_config.servicePort` or `_rules_[1]._match_route_`.
    pub field: String,
    /// What is wrong and what is accepted.
    pub message: String,
}

impl core::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "invalid ai-load-balancer config: {}: {}", self.field, self.message)
    }
}

impl std::error::Error for ConfigError {}

fn err(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError { field: field.to_string(), message: message.into() }
}

/// `lb_type`: where the plugin balances.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LbType {
    /// `endpoint` (default): pick a host (pod) inside the route's cluster.
    Endpoint,
    /// `cluster`: pick a cluster (service) by writing `cluster_header`.
    Cluster,
}

/// Redis connection settings shared by the Redis-backed policies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// `serviceFQDN` (required): e.g. `redis.static`, `redis.dns`, `redis.default.svc.cluster.local`.
    pub service_fqdn: String,
    /// `servicePort` (required): e.g. 6379.
    pub service_port: u16,
    /// `username` (default empty).
    pub username: String,
    /// `password` (default empty).
    pub password: String,
    /// `timeout` in ms (default 3000; 0 means default, as in Go).
    pub timeout_ms: u32,
    /// `database` (default 0).
    pub database: u32,
    /// `bufferFlushTimeout` (ours, ms, default 0): Envoy Redis client batching delay, sent as
    /// `buffer_flush_timeout` on `proxy_redis_init`. 0 with `maxBufferSizeBeforeFlush` 0 sends each
    /// command at once (Envoy's default would add up to 3 ms per request).
    pub buffer_flush_timeout_ms: u32,
    /// `maxBufferSizeBeforeFlush` (ours, bytes, default 0): sent as `max_buffer_size_before_flush`.
    pub max_buffer_size_before_flush: u32,
}

impl RedisConfig {
    /// The Envoy cluster of the Redis service: `outbound|{servicePort}||{serviceFQDN}` (what
    /// `proxy_redis_call` names).
    pub fn service_cluster(&self) -> String {
        format!("outbound|{}||{}", self.service_port, self.service_fqdn)
    }

    /// The cluster name for `proxy_redis_init`: [`RedisConfig::service_cluster`] plus `?db=N`
    /// when `database` != 0.
    pub fn cluster(&self) -> String {
        let mut c = self.service_cluster();
        if self.database != 0 {
            c.push_str(&format!("?db={}", self.database));
        }
        c
    }
}

/// `global_least_request` settings (`lb_config`).
#[derive(Debug, Clone, PartialEq)]
pub struct GlobalLeastRequestConfig {
    /// Redis connection.
    pub redis: RedisConfig,
    /// `maxRequestCount` (default 0 = unlimited): above this many in-flight requests on the least
    /// loaded host, answer 429.
    pub max_request_count: u64,
    /// `cleanInterval` in minutes (default 60, also for 0, as in Go, and for a negative value): hosts that left
    /// the cluster, at a count of 0, are removed from the in-flight table this often.
    pub clean_interval_min: u64,
    /// `enableDetailLog` (default true): log each pick with its count, at debug level as Go does.
    pub enable_detail_log: bool,
    /// Leases and the Redis breaker (ours).
    pub state: SharedStateConfig,
    /// The pods' metrics, used when Redis cannot be (ours; same keys as `endpoint_metrics`).
    pub metrics: PodMetricsSource,
}

/// How the in-flight counts survive dead gateways and a stalled Redis (keys of ours; a Go config
/// gets these defaults, which only change what happens when something has failed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedStateConfig {
    /// `leaseMs` (default 10000): a plugin VM's share of the in-flight counts is subtracted once it
    /// has not renewed its lease for this long (it is renewed every third of it).
    pub lease_ms: u32,
    /// `breakerFailures` (default 3; 0 = no breaker): consecutive failed or slow Redis calls that
    /// open the breaker.
    pub breaker_failures: u32,
    /// `breakerOpenMs` (default 1000): how long an open breaker decides without Redis before one
    /// probe call is let through.
    pub breaker_open_ms: u32,
    /// `breakerSlowMs` (default 200; 0 = wait for the Redis `timeout`): a pick not answered within
    /// this long is given up (normal balancing, counted as a failure).
    pub breaker_slow_ms: u32,
}

impl Default for SharedStateConfig {
    fn default() -> Self {
        SharedStateConfig {
            lease_ms: 10_000,
            breaker_failures: 3,
            breaker_open_ms: 1000,
            breaker_slow_ms: 200,
        }
    }
}

/// `prefix_cache` settings (`lb_config`).
#[derive(Debug, Clone, PartialEq)]
pub struct PrefixCacheConfig {
    /// Redis connection and the least-request settings used on a miss (same keys as
    /// `global_least_request`).
    pub least_request: GlobalLeastRequestConfig,
    /// `redisKeyTTL` in seconds (default 1800).
    pub redis_key_ttl_s: u64,
    /// `hitLoadFactor` (ours, default 0 = off): see [`DEFAULT_HIT_LOAD_FACTOR`].
    pub hit_load_factor: f64,
    /// How a prompt becomes chain keys: where blocks end besides user messages, and what keeps
    /// the keys of different models apart (see [`KeyRules`]).
    pub key_rules: KeyRules,
    /// `loadAware` (ours, default false): weigh prefix affinity against the pods' GPU metrics
    /// (queue, KV-cache use) and the global in-flight counts; `None` when off (Go's routing).
    pub load_aware: Option<LoadAwareConfig>,
}

/// How a prompt becomes chain keys: where its blocks end, besides after each user message and
/// after the last message (the Go plugin's cuts), and what the first block is scoped by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRules {
    /// `splitSystemPrompt` (ours, default false): also cut after the leading system/developer
    /// messages (and `tools`), so conversations that share only a system prompt share the first
    /// key; pair it with `hitLoadFactor` or `loadAware`, since one app's requests all share that
    /// key.
    pub after_system_prompt: bool,
    /// `splitToolResults`: after each run of `tool`/`function` messages. An agent's session has
    /// one user message and then a tool round per request: cut only at user messages, its whole
    /// history after the first message is one block that changes every request, so a pod holding
    /// 30 rounds of it is found by its first block alone and credited with that block's bytes.
    /// Cut here, each round is a block of the chain: the match says how much the pod holds.
    /// `splitToolResults` (ours, default true).
    pub after_tool_results: bool,
    /// `scopedKeys` (ours; default false, true with `loadAware`): the request's `model`,
    /// `cache_salt` and `extra_key` scope its keys. Engines keep the KV cache of each LoRA adapter
    /// and each salt apart (vLLM hashes the adapter and the salt into its blocks, SGLang keys its
    /// radix tree by them and by `extra_key`): the same messages under another adapter or salt
    /// find nothing cached, and unscoped keys would promise them a hit. `false` keys by the
    /// messages alone, as the Go plugin does (also for routes whose model names are aliases of one
    /// model).
    pub scoped: bool,
}

impl Default for KeyRules {
    fn default() -> Self {
        KeyRules { after_system_prompt: false, after_tool_results: true, scoped: false }
    }
}

/// `prefix_cache` with `loadAware: true`: when every healthy pod has fresh metrics, a hit is not
/// taken when its pod is overloaded against the least loaded pod (each signal past an absolute
/// gap AND a ratio, as SGLang's cache-aware router), a miss or a diverted hit goes to the pod with
/// the least combined load (in flight + queue + `loadKvWeight` × KV-cache use), and a diverted
/// hit adds its pod to the prefix's holders (up to `maxHolders`).
#[derive(Debug, Clone, PartialEq)]
pub struct LoadAwareConfig {
    /// `overloadQueue`: waiting requests above the least queued pod's.
    pub queue_gap: f64,
    /// `overloadKvCache`: KV-cache use (0-1) above the least used pod's.
    pub kv_gap: f64,
    /// `overloadInflight`: in-flight requests (Redis, all gateways) above the least loaded pod's.
    pub inflight_gap: u32,
    /// `overloadRatio`: and more than this times the least loaded pod's value.
    pub ratio: f64,
    /// `loadKvWeight`: KV-cache use at 100% counts as this many queued requests.
    pub kv_weight: f64,
    /// `maxHolders`: most pods one prefix key names (1-8).
    pub max_holders: u32,
    /// `loadLatencyWeight`: a pod's observed slowness over the fastest pod's, minus 1, times this
    /// is added to its combined load (in requests).
    pub latency_weight: f64,
    /// `overloadLatency`: a hit's pod at least this many times as slow as the fastest is
    /// overloaded (0 = off).
    pub latency_ratio: f64,
    /// `loadPrefillBytes`: this many bytes of a pod's prefill backlog count as one more request
    /// in its combined load (0 = off).
    pub prefill_bytes: u32,
    /// `divertPrefixBytes`: a hit is diverted only when the pod it would go to, charged one more
    /// request per this many bytes of the matched prefix (which it must prefill again), is still
    /// less loaded than the holder (0 = off: an overloaded holder always loses the hit).
    pub divert_prefix_bytes: u32,
}

impl Default for LoadAwareConfig {
    /// The documented defaults (`DEFAULT_OVERLOAD_*`, `DEFAULT_LOAD_KV_WEIGHT`, `DEFAULT_MAX_HOLDERS`).
    fn default() -> Self {
        LoadAwareConfig {
            queue_gap: DEFAULT_OVERLOAD_QUEUE,
            kv_gap: DEFAULT_OVERLOAD_KV_CACHE,
            inflight_gap: DEFAULT_OVERLOAD_INFLIGHT,
            ratio: DEFAULT_OVERLOAD_RATIO,
            kv_weight: DEFAULT_LOAD_KV_WEIGHT,
            max_holders: DEFAULT_MAX_HOLDERS,
            latency_weight: DEFAULT_LOAD_LATENCY_WEIGHT,
            latency_ratio: DEFAULT_OVERLOAD_LATENCY,
            prefill_bytes: DEFAULT_LOAD_PREFILL_BYTES,
            divert_prefix_bytes: DEFAULT_DIVERT_PREFIX_BYTES,
        }
    }
}

/// `endpoint_metrics` `metric_policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricPolicy {
    /// `default`: the Gateway API Inference Extension filter chain.
    Default,
    /// `least`: the host with the smallest `target_metric`.
    Least,
    /// `most`: the host with the largest `target_metric`.
    Most,
    /// `least`/`most` without `target_metric`: Go reads every value as 0, so all pods with the
    /// default metrics tie and one is picked at random.
    Random,
}

/// `endpoint_metrics` (alias `metrics_based`) settings (`lb_config`).
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointMetricsConfig {
    /// `metric_policy` (default `default`).
    pub metric_policy: MetricPolicy,
    /// `target_metric` (for `least`/`most`; without it they become [`MetricPolicy::Random`]):
    /// metric name in the pods' Prometheus text.
    pub target_metric: Option<String>,
    /// `rate_limit` (default 1.0): largest share of the recent requests one host may get.
    pub rate_limit: f64,
    /// `window_size` (default 100): requests remembered for `rate_limit`.
    pub window_size: usize,
    /// `window_seconds` (default 60): how long a request stays in the window.
    pub window_seconds: u64,
    /// Where the pods' metrics come from.
    pub source: PodMetricsSource,
}

/// Where a policy gets the pods' metrics (keys of ours): the metrics the gateway's health check
/// stores (`store_metrics`), or the plugin's own scrapes through `scrapeCluster`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodMetricsSource {
    /// `scrapeIntervalMs` (default 1000): when the host list carries no metrics the plugin
    /// scrapes each pod's `/metrics` this often.
    pub scrape_interval_ms: u32,
    /// `scrapePath` (default `/metrics`).
    pub scrape_path: String,
    /// `scrapeCluster` (default none): an Envoy ORIGINAL_DST cluster with `use_http_header`,
    /// through which the plugin scrapes each pod itself (`x-envoy-original-dst-host` names the pod).
    /// Envoy honours that header on no other cluster, so without one the plugin does not scrape
    /// and uses the metrics the gateway's health check stores (`store_metrics`) only.
    pub scrape_cluster: Option<String>,
    /// `metricsStaleMs` (default 5000): older metrics count as unknown.
    pub metrics_stale_ms: u64,
    /// `hostListCacheMs` (default 10, at most 1000; 0 = read at every request): a worker reads a
    /// cluster's host list from the host at most once per this long while it carries the pods'
    /// stored `/metrics` bodies, which the host serializes into it at every read (up to 64 KiB
    /// each).
    pub host_list_cache_ms: u64,
}

impl Default for PodMetricsSource {
    fn default() -> Self {
        PodMetricsSource {
            scrape_interval_ms: DEFAULT_SCRAPE_INTERVAL_MS,
            scrape_path: "/metrics".to_string(),
            scrape_cluster: None,
            metrics_stale_ms: DEFAULT_METRICS_STALE_MS,
            host_list_cache_ms: DEFAULT_HOST_LIST_CACHE_MS,
        }
    }
}

/// `cluster_metrics` `mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClusterMode {
    /// `LeastBusy`: fewest in-flight requests.
    LeastBusy,
    /// `LeastTotalLatency`: lowest mean total latency.
    LeastTotalLatency,
    /// `LeastFirstTokenLatency`: lowest mean time to first token.
    LeastFirstTokenLatency,
    /// `AdaptiveScore`: the lowest score of a power-of-choices sample, the score weighing the
    /// latencies' moving averages, the requests in flight, the error rate and a cooldown after a
    /// failure ([`AdaptiveScoreConfig`]).
    AdaptiveScore,
    /// No `mode` given: random service (Go behaviour), still subject to `rate_limit`.
    Random,
}

/// `cluster_metrics` `mode: AdaptiveScore` settings (the Go plugin's keys and defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveScoreConfig {
    /// `ewma_beta` (0.5, in 0–1): the weight of the old average in each latency's moving average.
    pub ewma_beta: f64,
    /// `p2c_choices` (2; 0 or less = 2): services sampled per request.
    pub p2c_choices: usize,
    /// `ttft_weight` (0.7): weight of the time to first token in the score.
    pub ttft_weight: f64,
    /// `total_latency_weight` (0.3): weight of the total latency in the score.
    pub total_latency_weight: f64,
    /// `error_penalty` (3): the score grows by this times the service's error rate.
    pub error_penalty: f64,
    /// `failure_cooldown_ms` (30000; 0 = 30000): a failed request keeps its service out of the
    /// choice this long while another is available.
    pub failure_cooldown_ms: u64,
}

impl Default for AdaptiveScoreConfig {
    fn default() -> Self {
        AdaptiveScoreConfig {
            ewma_beta: 0.5,
            p2c_choices: 2,
            ttft_weight: 0.7,
            total_latency_weight: 0.3,
            error_penalty: 3.0,
            failure_cooldown_ms: 30_000,
        }
    }
}

/// `cluster_metrics` settings (`lb_config`, with `lb_type: cluster`).
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterMetricsConfig {
    /// `mode` (default: random, as Go when absent).
    pub mode: ClusterMode,
    /// `service_list` (required, non-empty): the cluster names to choose from.
    pub service_list: Vec<String>,
    /// `cluster_header` (default `x-higress-target-cluster`): request header written with the choice.
    pub cluster_header: String,
    /// `rate_limit` (default 1.0): largest share of requests one service may get.
    pub rate_limit: f64,
    /// `queue_size` (default 100): latency samples kept per service.
    pub queue_size: usize,
    /// `mode: AdaptiveScore` settings (parsed, and checked, in every mode, as in Go).
    pub adaptive: AdaptiveScoreConfig,
}

/// Where `cluster_hash` reads a request's hash key (`lb_config.key.source`; without `key`, the
/// header `hash_header`).
#[derive(Debug, Clone, PartialEq)]
pub enum HashKeySource {
    /// A request header (`key.name`, else `hash_header`, else `x-mse-consumer`).
    Header(String),
    /// A cookie of the `cookie` request header (`key.name`).
    Cookie(String),
    /// A GJSON path into the JSON request body (`key.jsonPath` or `key.json_path`, a leading `$.`
    /// dropped).
    Body(String),
    /// A host property (`key.propertyPath` or `key.property_path`, else `["metadata", key.name]`).
    Metadata(Vec<String>),
}

/// `cluster_hash` settings (`lb_config`, with `lb_type: cluster`).
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterHashConfig {
    /// Where the hash key comes from.
    pub key: HashKeySource,
    /// `cluster_header` (default `x-higress-target-cluster`): request header written with the choice.
    pub cluster_header: String,
    /// `clusters` by `weight` (which sum to 100): each cluster name `weight` times, in config order;
    /// a key's FNV-1a hash modulo 100 picks one.
    pub slots: Vec<String>,
}

/// `endpoint_hash` settings (`lb_config`): sticky sessions kept in Redis.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointHashConfig {
    /// Redis connection.
    pub redis: RedisConfig,
    /// `hash_header` (default `x-mse-consumer`): the request header whose value is the session key.
    pub hash_header: String,
    /// `stickyTimeout` (minutes, default 60) in seconds: how long a binding lives after its last
    /// use.
    pub sticky_ttl_s: u64,
    /// The Redis breaker (ours; `leaseMs` is not used: nothing is counted).
    pub state: SharedStateConfig,
}

/// The policy chosen by `lb_policy` with its settings.
#[derive(Debug, Clone, PartialEq)]
pub enum PolicyConfig {
    /// `global_least_request`.
    GlobalLeastRequest(GlobalLeastRequestConfig),
    /// `prefix_cache`.
    PrefixCache(PrefixCacheConfig),
    /// `endpoint_metrics` (or `metrics_based`).
    EndpointMetrics(EndpointMetricsConfig),
    /// `cluster_metrics`.
    ClusterMetrics(ClusterMetricsConfig),
    /// `cluster_hash`.
    ClusterHash(ClusterHashConfig),
    /// `endpoint_hash`.
    EndpointHash(EndpointHashConfig),
}

/// One complete load-balancer config (the top level, or one `_rules_` entry).
#[derive(Debug, Clone, PartialEq)]
pub struct LbConfig {
    /// `lb_type` (default `endpoint`).
    pub lb_type: LbType,
    /// `lb_policy` with its `lb_config`.
    pub policy: PolicyConfig,
    /// `lb_config.maxBodyBytes` (ours, default 4 MiB): larger bodies pass through.
    pub max_body_bytes: usize,
    /// `lb_config.decisionHeader` (ours, default none): a response header that names how the
    /// request was routed (e.g. `prefix_hit; blocks=3`), for debugging and load tests.
    pub decision_header: Option<String>,
}

/// What a `_rules_` entry matches on, read as Higress's wasm-go rule matcher reads it: a rule has
/// one kind, chosen by precedence from the match keys it has (route, optionally with service;
/// else domain; else service; else route prefix, optionally with consumer). Keys of a lower kind
/// next to a higher one are not consulted (a warning says so at start).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuleMatch {
    /// `_match_route_`: exact route names (property `route_name`).
    pub routes: Vec<String>,
    /// `_match_route_prefix_`: route name prefixes.
    pub route_prefixes: Vec<String>,
    /// `_match_domain_`: `:authority` without port, compared as written (case-sensitive, as in
    /// Go); `*.example.com` and `example.*` wildcards.
    pub domains: Vec<String>,
    /// `_match_service_`: `fqdn` or `fqdn:port`, compared with the cluster name
    /// `outbound|port|subset|fqdn`.
    pub services: Vec<String>,
    /// `_match_consumer_`: with `_match_route_prefix_` only, values of the `x-mse-consumer`
    /// request header (set by Higress's auth plugins).
    pub consumers: Vec<String>,
}

/// One `_rules_` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// What it matches.
    pub matcher: RuleMatch,
    /// The config that applies when it matches.
    pub config: LbConfig,
}

/// The whole plugin configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct PluginConfig {
    /// The top-level config; `None` when only `_rules_` configure the plugin (Higress
    /// `defaultConfigDisable`): unmatched requests then pass through.
    pub default: Option<LbConfig>,
    /// Per-route rules, first match wins.
    pub rules: Vec<Rule>,
    /// Values the Go plugin tolerates that were read with Go's meaning, one line each naming the
    /// field (logged at plugin start).
    pub warnings: Vec<String>,
}

/// Identity of a request used to pick a rule.
#[derive(Debug, Clone, Default)]
pub struct MatchInput<'a> {
    /// Property `route_name`.
    pub route: &'a str,
    /// `:authority` (port allowed; it is stripped).
    pub authority: &'a str,
    /// Property `cluster_name`.
    pub cluster: &'a str,
    /// Request header `x-mse-consumer` (only read when a rule has `_match_consumer_`).
    pub consumer: &'a str,
}

/// The request header Higress's auth plugins name the consumer in (`_match_consumer_`).
pub const CONSUMER_HEADER: &str = "x-mse-consumer";

impl PluginConfig {
    /// Parses the plugin configuration (JSON text as delivered to `proxy_on_configure`).
    pub fn from_json(bytes: &[u8]) -> Result<PluginConfig, ConfigError> {
        let v: Value = serde_json::from_slice(bytes)
            .map_err(|e| err("(root)", format!("not valid JSON: {e}")))?;
        let root = match v {
            Value::Object(m) => m,
            Value::Null => Map::new(),
            other => {
                return Err(err(
                    "(root)",
                    format!("expected a JSON object, got {}", type_name(&other)),
                ))
            }
        };
        let warnings = RefCell::new(Vec::new());
        let mut rules = Vec::new();
        let rule_values = match root.get("_rules_") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a.iter().collect(),
            // gjson's `.Array()` reads any other value as a list of one.
            Some(v) => {
                warn_at(
                    &warnings,
                    "_rules_",
                    format!("{} read as a list of one rule, as Go reads it", type_name(v)),
                );
                vec![v]
            }
        };
        let empty = Map::new();
        for (i, r) in rule_values.into_iter().enumerate() {
            let path = format!("_rules_[{i}]");
            // A rule that is not an object has no match keys, which Go refuses below.
            let obj = r.as_object().unwrap_or(&empty);
            let matcher = parse_matcher(obj, &path, &warnings)?;
            // Each rule is a complete config of its own: Go parses it alone, nothing is inherited
            // from the top level.
            let config = parse_lb(obj, &format!("{path}."), &warnings)?;
            rules.push(Rule { matcher, config });
        }
        let has_top = root.keys().any(|k| k != "_rules_");
        let default = if rules.is_empty() {
            Some(parse_lb(&root, "", &warnings)?)
        } else if has_top {
            // Go disables an invalid top-level config when rules exist (requests matching no rule
            // pass through) instead of failing the plugin.
            match parse_lb(&root, "", &warnings) {
                Ok(d) => Some(d),
                Err(e) => {
                    warn_at(
                        &warnings,
                        &e.field,
                        format!(
                            "{}: the top-level config is disabled, only _rules_ apply (as in Go)",
                            e.message
                        ),
                    );
                    None
                }
            }
        } else {
            None
        };
        Ok(PluginConfig { default, rules, warnings: warnings.into_inner() })
    }

    /// Whether a rule reads the consumer header (so the request path reads it only then).
    pub fn matches_consumers(&self) -> bool {
        self.rules.iter().any(|r| r.matcher.kind() == RuleKind::RoutePrefixAndConsumer)
    }
}

/// The kind of a rule, by the wasm-go matcher's precedence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleKind {
    /// `_match_route_` (and no `_match_service_`).
    Route,
    /// `_match_route_` and `_match_service_`: both must match.
    RouteAndService,
    /// `_match_domain_` (no route).
    Domain,
    /// `_match_service_` (no route, no domain).
    Service,
    /// `_match_route_prefix_` alone.
    RoutePrefix,
    /// `_match_route_prefix_` and `_match_consumer_`: both must match.
    RoutePrefixAndConsumer,
}

impl RuleMatch {
    /// The rule's kind (which keys it is matched on).
    pub fn kind(&self) -> RuleKind {
        if !self.routes.is_empty() {
            if self.services.is_empty() {
                RuleKind::Route
            } else {
                RuleKind::RouteAndService
            }
        } else if !self.domains.is_empty() {
            RuleKind::Domain
        } else if !self.services.is_empty() {
            RuleKind::Service
        } else if !self.consumers.is_empty() {
            RuleKind::RoutePrefixAndConsumer
        } else {
            RuleKind::RoutePrefix
        }
    }

    /// True when the request matches the rule's kind.
    pub fn matches(&self, input: &MatchInput<'_>) -> bool {
        let route = || self.routes.iter().any(|r| r == input.route);
        let service = || self.services.iter().any(|s| service_matches(s, input.cluster));
        let prefix = || self.route_prefixes.iter().any(|p| input.route.starts_with(p.as_str()));
        match self.kind() {
            RuleKind::Route => route(),
            RuleKind::RouteAndService => route() && service(),
            RuleKind::Domain => {
                let host = strip_port(input.authority);
                self.domains.iter().any(|d| domain_matches(d, host))
            }
            RuleKind::Service => service(),
            RuleKind::RoutePrefix => prefix(),
            RuleKind::RoutePrefixAndConsumer => {
                prefix() && self.consumers.iter().any(|c| c == input.consumer)
            }
        }
    }
}

/// The host without its port, as Envoy's (and the wasm-go matcher's) port stripping does: cut at
/// the last `:` unless it lies inside an IPv6 literal's brackets.
fn strip_port(authority: &str) -> &str {
    match authority.rfind(':') {
        Some(colon) if authority.rfind(']').is_none_or(|bracket| bracket < colon) => {
            authority.get(..colon).unwrap_or(authority)
        }
        _ => authority,
    }
}

fn domain_matches(pattern: &str, host: &str) -> bool {
    if let Some(suffix) = pattern.strip_prefix('*') {
        host.ends_with(suffix)
    } else if let Some(prefix) = pattern.strip_suffix('*') {
        host.starts_with(prefix)
    } else {
        pattern == host
    }
}

/// `service` (`fqdn` or `fqdn:port`) against a cluster name `outbound|port|subset|fqdn`; other
/// cluster name shapes never match, as in Go.
fn service_matches(service: &str, cluster: &str) -> bool {
    let parts: Vec<&str> = cluster.split('|').collect();
    let [_, port, _, fqdn] = parts.as_slice() else { return false };
    match service.rsplit_once(':') {
        Some((name, p)) if name == *fqdn && p == *port => true,
        _ => service == *fqdn,
    }
}

const MATCH_KEYS: [&str; 5] = [
    "_match_route_",
    "_match_domain_",
    "_match_service_",
    "_match_route_prefix_",
    "_match_consumer_",
];

fn parse_matcher(
    obj: &Map<String, Value>,
    path: &str,
    warnings: &RefCell<Vec<String>>,
) -> Result<RuleMatch, ConfigError> {
    let mut m = RuleMatch::default();
    for key in MATCH_KEYS {
        let Some(v) = obj.get(key) else { continue };
        let field = format!("{path}.{key}");
        let items: Vec<&Value> = match v {
            Value::Array(a) => a.iter().collect(),
            Value::Null => Vec::new(),
            // gjson's `.Array()` reads a single value as a list of one.
            other => {
                warn_at(warnings, &field, format!("{other} read as a list of one, as Go reads it"));
                vec![other]
            }
        };
        let list = items.into_iter().map(go_string);
        match key {
            // Go keeps an empty domain (it matches an empty host) but drops other empty names.
            "_match_domain_" => m.domains = list.collect(),
            _ => {
                let list: Vec<String> = list.filter(|s| !s.is_empty()).collect();
                match key {
                    "_match_route_" => m.routes = list,
                    "_match_service_" => m.services = list,
                    "_match_route_prefix_" => m.route_prefixes = list,
                    _ => m.consumers = list,
                }
            }
        }
    }
    if m.routes.is_empty()
        && m.domains.is_empty()
        && m.services.is_empty()
        && m.route_prefixes.is_empty()
    {
        return Err(err(
            path,
            "a rule needs a non-empty _match_route_, _match_domain_, _match_service_ or _match_route_prefix_",
        ));
    }
    // Keys the rule's kind does not consult, as the wasm-go matcher ignores them.
    let kind = m.kind();
    let unused: &[(&str, bool)] = &[
        (
            "_match_domain_",
            !m.domains.is_empty() && matches!(kind, RuleKind::Route | RuleKind::RouteAndService),
        ),
        ("_match_service_", !m.services.is_empty() && kind == RuleKind::Domain),
        (
            "_match_route_prefix_",
            !m.route_prefixes.is_empty()
                && !matches!(kind, RuleKind::RoutePrefix | RuleKind::RoutePrefixAndConsumer),
        ),
        ("_match_consumer_", !m.consumers.is_empty() && kind != RuleKind::RoutePrefixAndConsumer),
    ];
    for (key, ignored) in unused {
        if *ignored {
            warn_at(
                warnings,
                &format!("{path}.{key}"),
                format!(
                    "ignored: this rule matches on {kind:?} only, as Higress's rule matcher does"
                ),
            );
        }
    }
    Ok(m)
}

/// A JSON value as gjson's `.String()` gives it: strings as they are, null as "", anything else as
/// its JSON text.
fn go_string(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// gjson's integer text: an optional `-` and digits, nothing else.
fn gjson_parse_int(s: &str) -> Option<i64> {
    let digits = s.strip_prefix('-').unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse::<i64>().ok()
}

fn warn_at(warnings: &RefCell<Vec<String>>, field: &str, msg: impl std::fmt::Display) {
    warnings.borrow_mut().push(format!("ai-load-balancer config: {field}: {msg}"));
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn string_list(v: &Value, field: &str) -> Result<Vec<String>, ConfigError> {
    let arr = v
        .as_array()
        .ok_or_else(|| err(field, format!("expected an array of strings, got {}", type_name(v))))?;
    arr.iter()
        .map(|x| {
            x.as_str()
                .map(str::to_string)
                .ok_or_else(|| err(field, format!("expected strings, got {}", type_name(x))))
        })
        .collect()
}

/// Reads optional typed values from an object, naming the field on error.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: String,
    warnings: &'a RefCell<Vec<String>>,
}

impl Fields<'_> {
    /// Records that `key` was read with the Go plugin's meaning of a value it tolerates.
    fn warn(&self, key: &str, msg: impl std::fmt::Display) {
        warn_at(self.warnings, &self.path(key), msg);
    }
    /// Whether `key` is one the Go plugin reads with gjson `.Int()` (ours are read strictly).
    fn is_go_int_key(key: &str) -> bool {
        const GO_INT_KEYS: [&str; 15] = [
            "window_size",
            "window_seconds",
            "p2c_choices",
            "failure_cooldown_ms",
            "global_inflight_timeout",
            "global_inflight_key_ttl",
            "weight",
            "stickyTimeout",
            "servicePort",
            "timeout",
            "database",
            "maxRequestCount",
            "cleanInterval",
            "redisKeyTTL",
            "queue_size",
        ];
        GO_INT_KEYS.contains(&key)
    }
    /// A Go integer key read as gjson `.Int()` reads it: integers and integer strings as they are;
    /// a fraction truncated toward zero; `true` 1, `false` 0; a string that is not an integer
    /// (`3s`, `" 5"`, `"1.5"`) and arrays or objects 0. Anything but an integer or an integer string
    /// gets a warning naming the field.
    fn go_int(&self, key: &str, v: &Value) -> i64 {
        let (n, why) = match v {
            Value::Number(n) => match n.as_i64() {
                Some(i) => return i,
                None => {
                    let f = n.as_f64().unwrap_or(0.0);
                    if f.fract() == 0.0 && f.abs() < 9e15 {
                        return f as i64;
                    }
                    // `as` saturates out-of-range values, as the limits here do.
                    (
                        f.trunc() as i64,
                        format!("{v} is not an integer: read as {}", f.trunc() as i64),
                    )
                }
            },
            Value::String(s) => match gjson_parse_int(s) {
                Some(i) => return i,
                None => (0, format!("{s:?} is not a number (no units): read as 0")),
            },
            Value::Bool(b) => (i64::from(*b), format!("{b} read as {}", i64::from(*b))),
            other => (0, format!("{} read as 0", type_name(other))),
        };
        self.warn(key, format!("{why}, as the Go plugin reads it"));
        n
    }
    /// An integer that may be negative: Go keys as [`Fields::go_int`]; our keys as numbers or
    /// numeric strings, anything else an error.
    fn int(&self, key: &str) -> Result<Option<i64>, ConfigError> {
        let Some(v) = self.present(key) else { return Ok(None) };
        if Self::is_go_int_key(key) {
            return Ok(Some(self.go_int(key, v)));
        }
        let bad = || err(&self.path(key), format!("expected an integer, got {v}"));
        match v {
            Value::Number(n) => n
                .as_i64()
                .or_else(|| {
                    n.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 9e18).map(|f| f as i64)
                })
                .map(Some)
                .ok_or_else(bad),
            Value::String(s) => s.trim().parse::<i64>().map(Some).map_err(|_| bad()),
            _ => Err(bad()),
        }
    }
    fn path(&self, key: &str) -> String {
        format!("{}{}", self.prefix, key)
    }
    fn present(&self, key: &str) -> Option<&Value> {
        match self.obj.get(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }
    fn string(&self, key: &str) -> Result<Option<String>, ConfigError> {
        match self.present(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            // YAML may turn a numeric password into a number; accept it as text like Go's gjson.
            Some(Value::Number(n)) => Ok(Some(n.to_string())),
            Some(v) => {
                Err(err(&self.path(key), format!("expected a string, got {}", type_name(v))))
            }
        }
    }
    /// Non-negative integer in `0..=max`; numeric strings are accepted (Go's gjson does); Go keys
    /// are read as [`Fields::go_int`] first.
    fn uint(&self, key: &str, max: u64) -> Result<Option<u64>, ConfigError> {
        let bad = |v: &Value| {
            err(&self.path(key), format!("expected an integer between 0 and {max}, got {v}"))
        };
        let Some(v) = self.present(key) else { return Ok(None) };
        let x = if Self::is_go_int_key(key) {
            u64::try_from(self.go_int(key, v)).ok()
        } else {
            match v {
                Value::Number(n) => n.as_u64().or_else(|| {
                    n.as_f64().filter(|f| f.fract() == 0.0 && *f >= 0.0).map(|f| f as u64)
                }),
                Value::String(s) => s.trim().parse::<u64>().ok(),
                _ => None,
            }
        };
        match x {
            Some(x) if x <= max => Ok(Some(x)),
            _ => Err(bad(v)),
        }
    }
    fn float(&self, key: &str) -> Result<Option<f64>, ConfigError> {
        let bad =
            |v: &Value| err(&self.path(key), format!("expected a non-negative number, got {v}"));
        match self.present(key) {
            None => Ok(None),
            Some(v @ Value::Number(n)) => {
                n.as_f64().filter(|f| f.is_finite() && *f >= 0.0).map(Some).ok_or_else(|| bad(v))
            }
            Some(v @ Value::String(s)) => match s.trim().parse::<f64>() {
                Ok(f) if f.is_finite() && f >= 0.0 => Ok(Some(f)),
                _ => Err(bad(v)),
            },
            Some(v) => Err(bad(v)),
        }
    }
    fn boolean(&self, key: &str) -> Result<Option<bool>, ConfigError> {
        match self.present(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(Value::String(s)) if s == "true" => Ok(Some(true)),
            Some(Value::String(s)) if s == "false" => Ok(Some(false)),
            Some(v) => Err(err(&self.path(key), format!("expected true or false, got {v}"))),
        }
    }
    /// A boolean read as the Go plugin reads it (gjson `.Bool()`): JSON booleans; numbers are true
    /// when not 0; strings as Go's `strconv.ParseBool` of their lower case (`1`, `t`, `true` are
    /// true), anything else false. Values other than JSON booleans and "true"/"false" are warned.
    fn go_boolean(&self, key: &str) -> Option<bool> {
        let v = self.present(key)?;
        let b = match v {
            Value::Bool(b) => return Some(*b),
            Value::String(s) if s == "true" || s == "false" => return Some(s == "true"),
            Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
            Value::String(s) => matches!(s.to_ascii_lowercase().as_str(), "1" | "t" | "true"),
            _ => false,
        };
        self.warn(key, format!("{v} read as {b}, as the Go plugin reads it"));
        Some(b)
    }
}

fn parse_lb(
    root: &Map<String, Value>,
    prefix: &str,
    warnings: &RefCell<Vec<String>>,
) -> Result<LbConfig, ConfigError> {
    let top = Fields { obj: root, prefix: prefix.to_string(), warnings };
    let lb_type = match top.string("lb_type")?.as_deref() {
        None | Some("") | Some("endpoint") => LbType::Endpoint,
        Some("cluster") => LbType::Cluster,
        Some(other) => {
            return Err(err(
                &top.path("lb_type"),
                format!("unknown value {other:?}; accepted: endpoint (default), cluster"),
            ))
        }
    };
    let empty = Map::new();
    let lb_obj = match root.get("lb_config") {
        None | Some(Value::Null) => &empty,
        Some(Value::Object(m)) => m,
        // gjson finds no keys in anything else: the policy runs on its defaults, as in Go.
        Some(v) => {
            top.warn(
                "lb_config",
                format!("{} has no keys: read as {{}}, as Go reads it", type_name(v)),
            );
            &empty
        }
    };
    let f = Fields { obj: lb_obj, prefix: format!("{prefix}lb_config."), warnings };
    let policy_name = top.string("lb_policy")?;
    // The body limit without `maxBodyBytes`: ours, unless the policy's Go config sets one.
    let mut body_limit_default = DEFAULT_MAX_BODY_BYTES;
    let policy = match (lb_type, policy_name.as_deref()) {
        (LbType::Endpoint, Some("global_least_request")) => PolicyConfig::GlobalLeastRequest(parse_glr(&f)?),
        (LbType::Endpoint, Some("prefix_cache")) => PolicyConfig::PrefixCache(parse_prefix_cache(&f)?),
        (LbType::Endpoint, Some("endpoint_hash")) => {
            PolicyConfig::EndpointHash(parse_endpoint_hash(&f)?)
        }
        (LbType::Endpoint, Some("endpoint_metrics" | "metrics_based")) => {
            PolicyConfig::EndpointMetrics(parse_endpoint_metrics(&f)?)
        }
        (LbType::Cluster, Some("cluster_metrics")) => PolicyConfig::ClusterMetrics(parse_cluster_metrics(&f)?),
        (LbType::Cluster, Some("cluster_hash")) => {
            let (config, key_max_body) = parse_cluster_hash(&f)?;
            if matches!(config.key, HashKeySource::Body(_)) {
                body_limit_default = key_max_body;
            }
            PolicyConfig::ClusterHash(config)
        }
        (LbType::Endpoint, other) => {
            return Err(err(
                &top.path("lb_policy"),
                format!(
                    "{} for lb_type endpoint; accepted: global_least_request, prefix_cache, endpoint_metrics (alias metrics_based), endpoint_hash",
                    describe(other)
                ),
            ))
        }
        (LbType::Cluster, other) => {
            return Err(err(&top.path("lb_policy"), format!("{} for lb_type cluster; accepted: cluster_metrics, cluster_hash", describe(other))))
        }
    };
    let max_body_bytes =
        f.uint("maxBodyBytes", u32::MAX as u64)?.map(|x| x as usize).unwrap_or(body_limit_default);
    let decision_header = match f.string("decisionHeader")?.map(|h| h.trim().to_ascii_lowercase()) {
        None => None,
        Some(h) if h.is_empty() => None,
        Some(h)
            if h.starts_with(':')
                || !h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') =>
        {
            return Err(err(
                &f.path("decisionHeader"),
                "a header name: letters, digits, '-' and '_'",
            ))
        }
        Some(h) => Some(h),
    };
    Ok(LbConfig { lb_type, policy, max_body_bytes, decision_header })
}

fn describe(v: Option<&str>) -> String {
    match v {
        None | Some("") => "missing".to_string(),
        Some(s) => format!("unknown value {s:?}"),
    }
}

fn parse_redis(f: &Fields<'_>) -> Result<RedisConfig, ConfigError> {
    let service_fqdn = match f.string("serviceFQDN")? {
        Some(s) if !s.trim().is_empty() => s.trim().to_string(),
        _ => {
            return Err(err(
                &f.path("serviceFQDN"),
                "required: the Redis service FQDN, e.g. redis.static",
            ))
        }
    };
    let service_port = match f.uint("servicePort", 65535)? {
        Some(p) if p > 0 => p as u16,
        _ => {
            return Err(err(
                &f.path("servicePort"),
                "required: the Redis port, an integer between 1 and 65535",
            ))
        }
    };
    Ok(RedisConfig {
        service_fqdn,
        service_port,
        username: f.string("username")?.unwrap_or_default(),
        password: f.string("password")?.unwrap_or_default(),
        timeout_ms: match f.int("timeout")? {
            None | Some(0) => DEFAULT_REDIS_TIMEOUT_MS,
            Some(t) if t < 0 => {
                f.warn("timeout", format!("{t} is negative; using {DEFAULT_REDIS_TIMEOUT_MS} ms"));
                DEFAULT_REDIS_TIMEOUT_MS
            }
            Some(t) => t.min(i64::from(u32::MAX)) as u32,
        },
        database: f.uint("database", 1_000_000)?.unwrap_or(0) as u32,
        buffer_flush_timeout_ms: f.uint("bufferFlushTimeout", 60_000)?.unwrap_or(0) as u32,
        max_buffer_size_before_flush: f.uint("maxBufferSizeBeforeFlush", 1 << 30)?.unwrap_or(0)
            as u32,
    })
}

/// `loadAware` and its thresholds (validated even when off, so a typo fails at start).
fn parse_load_aware(f: &Fields<'_>) -> Result<Option<LoadAwareConfig>, ConfigError> {
    let ratio = f.float("overloadRatio")?.unwrap_or(DEFAULT_OVERLOAD_RATIO);
    if ratio < 1.0 {
        return Err(err(&f.path("overloadRatio"), format!("expected a number >= 1, got {ratio}")));
    }
    let latency_ratio = f.float("overloadLatency")?.unwrap_or(DEFAULT_OVERLOAD_LATENCY);
    if latency_ratio != 0.0 && latency_ratio < 1.0 {
        return Err(err(
            &f.path("overloadLatency"),
            format!("expected 0 (off) or a number >= 1, got {latency_ratio}"),
        ));
    }
    let max_holders = f.uint("maxHolders", 8)?.unwrap_or(u64::from(DEFAULT_MAX_HOLDERS));
    if max_holders == 0 {
        return Err(err(&f.path("maxHolders"), "expected an integer between 1 and 8, got 0"));
    }
    let cfg = LoadAwareConfig {
        queue_gap: f.float("overloadQueue")?.unwrap_or(DEFAULT_OVERLOAD_QUEUE),
        kv_gap: f.float("overloadKvCache")?.unwrap_or(DEFAULT_OVERLOAD_KV_CACHE),
        inflight_gap: f
            .uint("overloadInflight", u64::from(u32::MAX))?
            .map_or(DEFAULT_OVERLOAD_INFLIGHT, |x| x as u32),
        ratio,
        kv_weight: f.float("loadKvWeight")?.unwrap_or(DEFAULT_LOAD_KV_WEIGHT),
        max_holders: max_holders as u32,
        latency_weight: f.float("loadLatencyWeight")?.unwrap_or(DEFAULT_LOAD_LATENCY_WEIGHT),
        latency_ratio,
        prefill_bytes: f
            .uint("loadPrefillBytes", u64::from(u32::MAX))?
            .map_or(DEFAULT_LOAD_PREFILL_BYTES, |x| x as u32),
        divert_prefix_bytes: f
            .uint("divertPrefixBytes", u64::from(u32::MAX))?
            .map_or(DEFAULT_DIVERT_PREFIX_BYTES, |x| x as u32),
    };
    Ok(f.boolean("loadAware")?.unwrap_or(false).then_some(cfg))
}

/// `rate_limit` (both metrics policies): a share of the recent picks, 0–1 (1 = no limit). Above
/// 1 is a share never reached: accepted as Go accepts it, with a warning.
fn parse_rate_limit(f: &Fields<'_>) -> Result<f64, ConfigError> {
    let r = f.float("rate_limit")?.unwrap_or(1.0);
    if r > 1.0 {
        f.warn("rate_limit", format!("{r} is above 1, a share never reached: no limit"));
    }
    Ok(r)
}

fn parse_prefix_cache(f: &Fields<'_>) -> Result<PrefixCacheConfig, ConfigError> {
    let load_aware = parse_load_aware(f)?;
    Ok(PrefixCacheConfig {
        least_request: {
            let mut least_request = parse_glr(f)?;
            if least_request.max_request_count > 0 {
                // Go's prefix_cache never reads it: a Go config carrying it must not get 429s.
                f.warn("maxRequestCount", "ignored by prefix_cache, as in Go");
                least_request.max_request_count = 0;
            }
            least_request
        },
        redis_key_ttl_s: match f.int("redisKeyTTL")? {
            None | Some(0) => DEFAULT_REDIS_KEY_TTL_S,
            Some(n) if n < 0 => {
                // Go starts with it, and its keys expire as soon as they are written.
                f.warn(
                    "redisKeyTTL",
                    format!(
                        "{n} is negative: the default, {DEFAULT_REDIS_KEY_TTL_S} s (the Go \
                         plugin's prefix keys would expire at once)"
                    ),
                );
                DEFAULT_REDIS_KEY_TTL_S
            }
            Some(n) => n.unsigned_abs().min(u64::from(u32::MAX)),
        },
        hit_load_factor: f.float("hitLoadFactor")?.unwrap_or(DEFAULT_HIT_LOAD_FACTOR),
        key_rules: KeyRules {
            after_system_prompt: f.boolean("splitSystemPrompt")?.unwrap_or(false),
            after_tool_results: f.boolean("splitToolResults")?.unwrap_or(true),
            scoped: f.boolean("scopedKeys")?.unwrap_or(load_aware.is_some()),
        },
        load_aware,
    })
}

fn parse_glr(f: &Fields<'_>) -> Result<GlobalLeastRequestConfig, ConfigError> {
    Ok(GlobalLeastRequestConfig {
        redis: parse_redis(f)?,
        max_request_count: match f.int("maxRequestCount")? {
            None => 0,
            Some(n) if n < 0 => {
                f.warn("maxRequestCount", format!("{n} is negative: no limit, as in Go"));
                0
            }
            Some(n) => n as u64,
        },
        // Go: 0 (or absent) means the default, 60 minutes, and a negative value every request;
        // there is no "never". Here a negative value is the default too: the cleanup removes only
        // pods at 0, so how often it runs changes no route.
        clean_interval_min: match f.int("cleanInterval")? {
            Some(n) if n > 0 => n as u64,
            Some(n) if n < 0 => {
                f.warn(
                    "cleanInterval",
                    format!(
                        "{n} is negative: every {DEFAULT_CLEAN_INTERVAL_MIN} minutes (Go cleans \
                         at every request)"
                    ),
                );
                DEFAULT_CLEAN_INTERVAL_MIN
            }
            _ => DEFAULT_CLEAN_INTERVAL_MIN,
        },
        enable_detail_log: f.go_boolean("enableDetailLog").unwrap_or(true),
        state: parse_state(f)?,
        metrics: parse_metrics_source(f)?,
    })
}

fn parse_state(f: &Fields<'_>) -> Result<SharedStateConfig, ConfigError> {
    let d = SharedStateConfig::default();
    let lease_ms = match f.uint("leaseMs", 3_600_000)? {
        None => d.lease_ms,
        Some(ms) if ms >= 1000 => ms as u32,
        Some(_) => {
            return Err(err(
                &f.path("leaseMs"),
                "at least 1000: leases are renewed every third of it",
            ))
        }
    };
    let u32_or = |key: &str, default: u32| -> Result<u32, ConfigError> {
        Ok(f.uint(key, u64::from(u32::MAX))?.map(|v| v as u32).unwrap_or(default))
    };
    Ok(SharedStateConfig {
        lease_ms,
        breaker_failures: u32_or("breakerFailures", d.breaker_failures)?,
        breaker_open_ms: u32_or("breakerOpenMs", d.breaker_open_ms)?,
        breaker_slow_ms: u32_or("breakerSlowMs", d.breaker_slow_ms)?,
    })
}

fn parse_endpoint_metrics(f: &Fields<'_>) -> Result<EndpointMetricsConfig, ConfigError> {
    // Not Go keys: Go ignores them and runs its defaults, so a Go config carrying them must too.
    for (camel, snake) in [("metricPolicy", "metric_policy"), ("targetMetric", "target_metric")] {
        if f.present(camel).is_some() {
            f.warn(
                camel,
                format!("not a key (the key is {snake}): ignored, as the Go plugin ignores it"),
            );
        }
    }
    let metric_policy = match f.string("metric_policy")?.as_deref() {
        None | Some("") | Some("default") => MetricPolicy::Default,
        Some("least") => MetricPolicy::Least,
        Some("most") => MetricPolicy::Most,
        Some(other) => {
            // Go runs its default filter chain for any other value.
            f.warn(
                "metric_policy",
                format!("unknown value {other:?} (accepted: default, least, most); using default, as Go does"),
            );
            MetricPolicy::Default
        }
    };
    let target_metric = f.string("target_metric")?.filter(|s| !s.is_empty());
    let metric_policy = if metric_policy != MetricPolicy::Default && target_metric.is_none() {
        // Go reads every pod's value as 0: all pods tie and one is picked at random.
        f.warn(
            "target_metric",
            "missing with metric_policy least/most: every pod ties, picked at random (as in Go)",
        );
        MetricPolicy::Random
    } else {
        metric_policy
    };
    Ok(EndpointMetricsConfig {
        metric_policy,
        target_metric,
        rate_limit: parse_rate_limit(f)?,
        // The Go plugin's newer keys too (`.Int()`, 0 or less = the default).
        window_size: match f.int("window_size")? {
            Some(n) if n > 0 => n.min(1_000_000) as usize,
            Some(n) if n < 0 => {
                f.warn("window_size", format!("{n} is negative: {DEFAULT_WINDOW_SIZE}, as in Go"));
                DEFAULT_WINDOW_SIZE
            }
            _ => DEFAULT_WINDOW_SIZE,
        },
        window_seconds: match f.int("window_seconds")? {
            Some(n) if n > 0 => n.unsigned_abs().min(86_400),
            Some(n) if n < 0 => {
                f.warn(
                    "window_seconds",
                    format!("{n} is negative: {DEFAULT_WINDOW_SECONDS}, as in Go"),
                );
                DEFAULT_WINDOW_SECONDS
            }
            _ => DEFAULT_WINDOW_SECONDS,
        },
        source: parse_metrics_source(f)?,
    })
}

fn parse_metrics_source(f: &Fields<'_>) -> Result<PodMetricsSource, ConfigError> {
    let d = PodMetricsSource::default();
    Ok(PodMetricsSource {
        scrape_interval_ms: match f.uint("scrapeIntervalMs", 3_600_000)? {
            None | Some(0) => d.scrape_interval_ms,
            Some(x) => x as u32,
        },
        scrape_cluster: f
            .string("scrapeCluster")?
            .map(|c| c.trim().to_string())
            .filter(|c| !c.is_empty()),
        scrape_path: f
            .string("scrapePath")?
            .filter(|s| s.starts_with('/'))
            .unwrap_or(d.scrape_path),
        metrics_stale_ms: match f.uint("metricsStaleMs", 86_400_000)? {
            None | Some(0) => d.metrics_stale_ms,
            Some(x) => x,
        },
        host_list_cache_ms: f.uint("hostListCacheMs", 1000)?.unwrap_or(d.host_list_cache_ms),
    })
}

fn parse_cluster_metrics(f: &Fields<'_>) -> Result<ClusterMetricsConfig, ConfigError> {
    let mode = match f.string("mode")?.as_deref() {
        None | Some("") => ClusterMode::Random,
        Some("LeastBusy") => ClusterMode::LeastBusy,
        Some("LeastTotalLatency") => ClusterMode::LeastTotalLatency,
        Some("LeastFirstTokenLatency") => ClusterMode::LeastFirstTokenLatency,
        Some("AdaptiveScore") => ClusterMode::AdaptiveScore,
        Some(other) => {
            // Go picks a random candidate for any other value.
            f.warn(
                "mode",
                format!("unknown value {other:?} (accepted: LeastBusy, LeastTotalLatency, LeastFirstTokenLatency, AdaptiveScore); picking at random, as Go does"),
            );
            ClusterMode::Random
        }
    };
    let service_list = match f.present("service_list") {
        None => Vec::new(),
        // Go reads the list with gjson `.Array()`, which makes a string a list of that one name.
        Some(Value::String(one)) => {
            f.warn(
                "service_list",
                format!("a string, not a list: read as the one cluster {one:?}, as in Go"),
            );
            vec![one.clone()]
        }
        Some(v) => string_list(v, &f.path("service_list"))?,
    };
    if service_list.is_empty() {
        return Err(err(&f.path("service_list"), "required: a non-empty array of cluster names"));
    }
    Ok(ClusterMetricsConfig {
        mode,
        service_list,
        cluster_header: f
            .string("cluster_header")?
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| DEFAULT_CLUSTER_HEADER.into()),
        rate_limit: parse_rate_limit(f)?,
        queue_size: match f.int("queue_size")? {
            None | Some(0) => DEFAULT_QUEUE_SIZE,
            Some(x) if x < 0 => {
                f.warn("queue_size", format!("{x} is negative: 16, as in Go"));
                16
            }
            Some(x) => x.min(1_000_000) as usize,
        },
        adaptive: parse_adaptive_score(f)?,
    })
}

/// `mode: AdaptiveScore`'s keys, checked as the Go plugin checks them (in every mode). Its
/// `global_inflight_*` keys share the in-flight counts through Redis in Go; here they are read and
/// checked, and the counts stay per worker, with a warning.
fn parse_adaptive_score(f: &Fields<'_>) -> Result<AdaptiveScoreConfig, ConfigError> {
    let d = AdaptiveScoreConfig::default();
    let ewma_beta = f.float("ewma_beta")?.unwrap_or(d.ewma_beta);
    if ewma_beta > 1.0 {
        return Err(err(&f.path("ewma_beta"), format!("{ewma_beta}: must be in [0, 1]")));
    }
    let ttft_weight = f.float("ttft_weight")?.unwrap_or(d.ttft_weight);
    let total_latency_weight = f.float("total_latency_weight")?.unwrap_or(d.total_latency_weight);
    if ttft_weight == 0.0 && total_latency_weight == 0.0 {
        return Err(err(
            &f.path("ttft_weight"),
            "ttft_weight and total_latency_weight cannot both be 0",
        ));
    }
    let non_negative_ms = |key: &str, default: u64| -> Result<u64, ConfigError> {
        match f.int(key)? {
            None | Some(0) => Ok(default),
            Some(n) if n < 0 => Err(err(&f.path(key), format!("{n}: must be >= 0"))),
            Some(n) => Ok(n.unsigned_abs()),
        }
    };
    let failure_cooldown_ms = non_negative_ms("failure_cooldown_ms", d.failure_cooldown_ms)?;
    non_negative_ms("global_inflight_timeout", 3000)?;
    non_negative_ms("global_inflight_key_ttl", 1800)?;
    if f.go_boolean("global_inflight_enabled") == Some(true) {
        if f.string("serviceFQDN")?.unwrap_or_default().is_empty()
            || f.int("servicePort")?.unwrap_or(0) == 0
        {
            return Err(err(
                &f.path("serviceFQDN"),
                "required with global_inflight_enabled: the Redis service FQDN and servicePort",
            ));
        }
        f.warn(
            "global_inflight_enabled",
            "not supported: AdaptiveScore counts the requests in flight per worker, as Go does \
             without it",
        );
    }
    if let Some(p) = f.string("metrics_missing_policy")?.filter(|p| p != "least_busy") {
        f.warn("metrics_missing_policy", format!("{p:?} read as least_busy, as in Go"));
    }
    Ok(AdaptiveScoreConfig {
        ewma_beta,
        p2c_choices: match f.int("p2c_choices")? {
            Some(n) if n > 0 => n.min(1_000) as usize,
            _ => d.p2c_choices,
        },
        ttft_weight,
        total_latency_weight,
        error_penalty: f.float("error_penalty")?.unwrap_or(d.error_penalty),
        failure_cooldown_ms,
    })
}

/// `endpoint_hash`'s default `stickyTimeout`, in minutes (the Go plugin's).
pub const DEFAULT_STICKY_TIMEOUT_MIN: u64 = 60;

/// `endpoint_hash`, as the Go plugin reads it, plus our breaker keys.
fn parse_endpoint_hash(f: &Fields<'_>) -> Result<EndpointHashConfig, ConfigError> {
    let minutes = match f.int("stickyTimeout")? {
        None | Some(0) => DEFAULT_STICKY_TIMEOUT_MIN,
        Some(m) if m < 0 => {
            // Go passes it on: every binding's write fails and every hit's EXPIRE deletes it.
            f.warn(
                "stickyTimeout",
                format!("{m} is negative: {DEFAULT_STICKY_TIMEOUT_MIN} minutes (the Go plugin would keep no binding)"),
            );
            DEFAULT_STICKY_TIMEOUT_MIN
        }
        Some(m) => m.unsigned_abs().min(u64::from(u32::MAX)),
    };
    Ok(EndpointHashConfig {
        redis: parse_redis(f)?,
        hash_header: f
            .string("hash_header")?
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| DEFAULT_HASH_HEADER.into()),
        sticky_ttl_s: minutes.saturating_mul(60),
        state: parse_state(f)?,
    })
}

/// `cluster_hash`'s default `hash_header`, and its key source's default header.
pub const DEFAULT_HASH_HEADER: &str = "x-mse-consumer";
/// `cluster_hash`'s default `key.max_body_bytes` (the Go plugin's: 100 MiB).
pub const DEFAULT_HASH_KEY_MAX_BODY_BYTES: usize = 100 * 1024 * 1024;

/// `cluster_hash`, as the Go plugin reads it, and `key.max_body_bytes`: the body limit while a
/// body key is read (the Go plugin raises the stream's buffer limit to it).
fn parse_cluster_hash(f: &Fields<'_>) -> Result<(ClusterHashConfig, usize), ConfigError> {
    let hash_header = f
        .string("hash_header")?
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| DEFAULT_HASH_HEADER.into());
    let (key, max_body) = match f.present("key") {
        None => (HashKeySource::Header(hash_header), DEFAULT_HASH_KEY_MAX_BODY_BYTES),
        Some(Value::Object(m)) => {
            let k = Fields { obj: m, prefix: f.path("key."), warnings: f.warnings };
            parse_hash_key(&k, &hash_header)?
        }
        // gjson finds no keys in anything else: the header source, as in Go.
        Some(v) => {
            f.warn("key", format!("{} has no keys: read as {{}}, as Go reads it", type_name(v)));
            (HashKeySource::Header(hash_header), DEFAULT_HASH_KEY_MAX_BODY_BYTES)
        }
    };
    let list = match f.present("clusters") {
        Some(Value::Array(list)) if !list.is_empty() => list,
        _ => {
            return Err(err(
                &f.path("clusters"),
                "required: a non-empty array of {cluster, weight}",
            ))
        }
    };
    let empty = Map::new();
    let mut slots = Vec::with_capacity(100);
    let mut total: i64 = 0;
    for (i, entry) in list.iter().enumerate() {
        let c = Fields {
            obj: entry.as_object().unwrap_or(&empty),
            prefix: f.path(&format!("clusters[{i}].")),
            warnings: f.warnings,
        };
        let cluster = c.string("cluster")?.unwrap_or_default();
        if cluster.is_empty() {
            return Err(err(&c.path("cluster"), "required: a non-empty cluster name"));
        }
        let weight = c.int("weight")?.unwrap_or(0);
        if weight <= 0 {
            return Err(err(&c.path("weight"), format!("{weight} for {cluster:?}: must be > 0")));
        }
        total = total.saturating_add(weight);
        if total > 100 {
            break;
        }
        slots.extend(std::iter::repeat_n(cluster, weight as usize));
    }
    if total != 100 {
        return Err(err(&f.path("clusters"), format!("the weights must sum to 100, got {total}")));
    }
    let cluster_header = f
        .string("cluster_header")?
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| DEFAULT_CLUSTER_HEADER.into());
    Ok((ClusterHashConfig { key, cluster_header, slots }, max_body))
}

/// `cluster_hash`'s `key` object: the source and the body limit.
fn parse_hash_key(
    k: &Fields<'_>,
    hash_header: &str,
) -> Result<(HashKeySource, usize), ConfigError> {
    let max_body = match k.uint("max_body_bytes", u64::from(u32::MAX))? {
        None | Some(0) => DEFAULT_HASH_KEY_MAX_BODY_BYTES,
        Some(n) => n as usize,
    };
    let name = k.string("name")?.unwrap_or_default();
    let source = match k.string("source")?.as_deref() {
        None | Some("") | Some("header") => {
            HashKeySource::Header(if name.is_empty() { hash_header.to_string() } else { name })
        }
        Some("cookie") if name.is_empty() => {
            return Err(err(&k.path("name"), "required when key.source is cookie"))
        }
        Some("cookie") => HashKeySource::Cookie(name),
        Some("body") => {
            let normalise = |p: Option<String>| {
                let p = p.unwrap_or_default();
                let p = p.trim();
                let p = p.strip_prefix("$.").unwrap_or(p);
                if p == "$" {
                    String::new()
                } else {
                    p.to_string()
                }
            };
            let mut path = normalise(k.string("jsonPath")?);
            if path.is_empty() {
                path = normalise(k.string("json_path")?);
            }
            if path.is_empty() {
                return Err(err(&k.path("jsonPath"), "required when key.source is body"));
            }
            HashKeySource::Body(path)
        }
        Some("metadata") => {
            let parts = |key: &str| -> Result<Vec<String>, ConfigError> {
                Ok(match k.present(key) {
                    // gjson's `.Array()` reads a string as a list of that one string.
                    Some(Value::String(one)) => {
                        k.warn(key, format!("a string, not a list: read as [{one:?}], as in Go"));
                        vec![one.clone()].into_iter().filter(|p| !p.is_empty()).collect()
                    }
                    Some(v) => string_list(v, &k.path(key))?
                        .into_iter()
                        .filter(|p| !p.is_empty())
                        .collect(),
                    None => Vec::new(),
                })
            };
            let mut path = parts("propertyPath")?;
            if path.is_empty() {
                path = parts("property_path")?;
            }
            if path.is_empty() {
                if name.is_empty() {
                    return Err(err(
                        &k.path("propertyPath"),
                        "key.name or key.propertyPath is required when key.source is metadata",
                    ));
                }
                path = vec!["metadata".to_string(), name];
            }
            HashKeySource::Metadata(path)
        }
        Some(other) => {
            return Err(err(
                &k.path("source"),
                format!("unknown value {other:?}; accepted: header, cookie, body, metadata"),
            ))
        }
    };
    Ok((source, max_body))
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
