//! A recording fake [`Host`] for native unit tests (also usable by other crates with the
//! `fake-host` feature). It records every side effect so tests can assert what a user would see:
//! where the request went, which Redis commands were sent, local replies, resumes.

use super::{Counter, Host, HostError, HttpCallRequest, LogLevel, UpstreamHost};
use std::cell::RefCell;
use std::collections::HashMap;

pub use super::RedisInit;

/// One `redis_call`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisCall {
    /// Token the reply comes back with.
    pub token: u32,
    /// The Redis cluster.
    pub cluster: String,
    /// The raw RESP command.
    pub query: Vec<u8>,
}

/// One `http_call`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpCall {
    /// Token the reply comes back with.
    pub token: u32,
    /// The cluster called.
    pub cluster: String,
    /// Request headers, pseudo-headers included.
    pub headers: Vec<(String, String)>,
    /// Request body.
    pub body: Option<Vec<u8>>,
}

impl HttpCall {
    /// A request header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// One local response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalResponse {
    /// HTTP status.
    pub status: u32,
    /// Body.
    pub body: Vec<u8>,
}

/// Recording fake host. Fields are public so tests can set the scene and inspect effects.
#[derive(Debug, Default)]
pub struct FakeHost {
    /// Properties by path joined with `.` (e.g. `route_name`).
    pub properties: HashMap<String, Vec<u8>>,
    /// Request headers (lower-case names).
    pub request_headers: Vec<(String, String)>,
    /// The buffered request body.
    pub request_body: Vec<u8>,
    /// How many times the plugin read the request body (each read is a copy out of the host).
    pub body_reads: std::cell::Cell<u32>,
    /// Response headers (lower-case names, `:status` included).
    pub response_headers: Vec<(String, String)>,
    /// The response body chunk being delivered.
    pub response_body: Vec<u8>,
    /// The cluster's hosts; `None` simulates a failing `proxy_get_upstream_hosts`.
    pub hosts: Option<Vec<UpstreamHost>>,
    /// How many times the plugin read the host list.
    pub host_list_reads: std::cell::Cell<u32>,
    /// Last override host set.
    pub override_host: Option<String>,
    /// `(cluster, username, password, timeout)` of each redis_init.
    pub redis_inits: Vec<RedisInit>,
    /// Error returned by redis_init, if set.
    pub redis_init_error: Option<HostError>,
    /// `(token, cluster, raw RESP query)` of each redis_call.
    pub redis_calls: Vec<RedisCall>,
    /// Error returned by redis_call, if set.
    pub redis_call_error: Option<HostError>,
    /// `(token, cluster, headers, body)` of each http_call.
    pub http_calls: Vec<HttpCall>,
    /// Error returned by http_call, if set.
    pub http_call_error: Option<HostError>,
    /// Shared data: key -> (value, cas).
    pub shared: HashMap<String, (Vec<u8>, u32)>,
    /// Another worker's write of `(key, value)`, made just before the next `set_shared_data` (a
    /// CAS read before it is then stale).
    pub shared_data_write_before_next_set: Option<(String, String)>,
    /// `(status, body)` of each local response.
    pub local_responses: Vec<LocalResponse>,
    /// Number of resume_request calls.
    pub resumes: u32,
    /// Number of `root_done` calls.
    pub root_dones: u32,
    /// Streams made effective by the dispatcher (inside root callbacks), in order.
    pub effective_streams: Vec<u32>,
    /// Log lines.
    pub logs: RefCell<Vec<(LogLevel, String)>>,
    /// Wall clock in ns.
    pub now: u64,
    /// Random state (xorshift); set to a fixed seed for reproducible tests.
    pub rng: u64,
    /// Counters by name.
    pub counters: HashMap<String, i64>,
    /// Counters defined (`define_counter`), in order.
    pub defined_counters: Vec<Counter>,
    /// `(name, value)` of each response header the plugin set.
    pub response_headers_set: Vec<(String, String)>,
    next_token: u32,
}

impl FakeHost {
    /// A fake with route `r1`, cluster `outbound|8000||llm.static` and no hosts.
    pub fn new() -> FakeHost {
        let mut h = FakeHost {
            rng: 0x9E37_79B9_7F4A_7C15,
            now: 1_700_000_000_000_000_000,
            next_token: 3,
            ..Default::default()
        };
        h.properties.insert("route_name".into(), b"r1".to_vec());
        h.properties.insert("cluster_name".into(), b"outbound|8000||llm.static".into());
        h
    }

    /// Replaces the host list with `(address, healthy)` pairs.
    pub fn set_hosts(&mut self, hosts: &[(&str, bool)]) {
        self.hosts = Some(
            hosts
                .iter()
                .map(|(a, ok)| UpstreamHost {
                    address: (*a).to_string(),
                    health: if *ok { super::Health::Healthy } else { super::Health::Unhealthy },
                    metrics: None,
                })
                .collect(),
        );
    }

    /// Sets a request header.
    pub fn with_header(mut self, name: &str, value: &str) -> FakeHost {
        self.request_headers.push((name.to_string(), value.to_string()));
        self
    }

    /// Token of the last Redis call, if any.
    pub fn last_redis_token(&self) -> Option<u32> {
        self.redis_calls.last().map(|c| c.token)
    }

    /// True if some log line contains `needle`.
    pub fn logged(&self, needle: &str) -> bool {
        self.logs.borrow().iter().any(|(_, m)| m.contains(needle))
    }
}

impl Host for FakeHost {
    fn log(&self, level: LogLevel, msg: &str) {
        self.logs.borrow_mut().push((level, msg.to_string()));
    }
    fn now_nanos(&self) -> u64 {
        self.now
    }
    fn unix_seconds(&self) -> u64 {
        // `now` starts at a unix time (2023-11-14), so one clock serves as both.
        self.now / 1_000_000_000
    }
    fn random_u64(&mut self) -> u64 {
        // xorshift64*: deterministic given the seed, good enough for tie-break statistics.
        let mut x = self.rng.max(1);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn get_property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.properties.get(&path.join(".")).cloned()
    }
    fn set_property(&mut self, path: &[&str], value: &[u8]) -> Result<(), HostError> {
        self.properties.insert(path.join("."), value.to_vec());
        Ok(())
    }
    fn request_header(&self, name: &str) -> Option<String> {
        self.request_headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    }
    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        self.request_headers.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
        if let Some(v) = value {
            self.request_headers.push((name.to_string(), v.to_string()));
        }
    }
    fn request_body(&self, max: usize) -> Option<Vec<u8>> {
        self.body_reads.set(self.body_reads.get() + 1);
        Some(self.request_body.iter().take(max).copied().collect())
    }
    fn response_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        let end = start.saturating_add(max).min(self.response_body.len());
        self.response_body.get(start.min(end)..end).map(<[u8]>::to_vec)
    }
    fn response_header(&self, name: &str) -> Option<String> {
        self.response_headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    }
    fn upstream_hosts(&self) -> Option<Vec<UpstreamHost>> {
        self.host_list_reads.set(self.host_list_reads.get() + 1);
        self.hosts.clone()
    }
    fn set_upstream_override_host(&mut self, addr: &str) -> Result<(), HostError> {
        self.override_host = Some(addr.to_string());
        Ok(())
    }
    fn redis_init(&mut self, init: &RedisInit) -> Result<(), HostError> {
        self.redis_inits.push(init.clone());
        match self.redis_init_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
    fn redis_call(&mut self, cluster: &str, query: &[u8]) -> Result<u32, HostError> {
        if let Some(e) = self.redis_call_error {
            return Err(e);
        }
        // Like Envoy: Redis tokens are 3 mod 4.
        self.next_token += 4;
        self.redis_calls.push(RedisCall {
            token: self.next_token,
            cluster: cluster.into(),
            query: query.to_vec(),
        });
        Ok(self.next_token)
    }
    fn http_call(&mut self, call: &HttpCallRequest<'_>) -> Result<u32, HostError> {
        let HttpCallRequest { cluster, headers, body, .. } = *call;
        if let Some(e) = self.http_call_error {
            return Err(e);
        }
        self.next_token += 4;
        let token = self.next_token + 1; // 0 mod 4 like Envoy's HTTP-call tokens
        self.http_calls.push(HttpCall {
            token,
            cluster: cluster.into(),
            headers: headers.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect(),
            body: body.map(|b| b.to_vec()),
        });
        Ok(token)
    }
    fn get_shared_data(&self, key: &str) -> (Option<Vec<u8>>, u32) {
        match self.shared.get(key) {
            Some((v, cas)) => (Some(v.clone()), *cas),
            None => (None, 0),
        }
    }
    fn set_shared_data(&mut self, key: &str, value: &[u8], cas: u32) -> Result<(), HostError> {
        if let Some((k, v)) = self.shared_data_write_before_next_set.take() {
            let next = self.shared.get(&k).map_or(1, |(_, c)| c + 1);
            self.shared.insert(k, (v.into_bytes(), next));
        }
        let current = self.shared.get(key).map(|(_, c)| *c).unwrap_or(0);
        if cas != 0 && cas != current {
            return Err(HostError::CasMismatch);
        }
        self.shared.insert(key.to_string(), (value.to_vec(), current + 1));
        Ok(())
    }
    fn send_local_response(&mut self, status: u32, body: &[u8], _headers: &[(&str, &str)]) {
        self.local_responses.push(LocalResponse { status, body: body.to_vec() });
    }
    fn resume_request(&mut self) {
        self.resumes += 1;
    }
    fn set_effective_stream(&mut self, ctx: u32) -> bool {
        self.effective_streams.push(ctx);
        true
    }
    fn root_done(&mut self) {
        self.root_dones += 1;
    }
    fn increment_counter(&mut self, counter: Counter, delta: i64) {
        *self.counters.entry(counter.name().to_string()).or_insert(0) += delta;
    }
    fn define_counter(&mut self, counter: Counter) {
        if !self.defined_counters.contains(&counter) {
            self.defined_counters.push(counter);
        }
    }
    fn set_response_header(&mut self, name: &str, value: &str) {
        self.response_headers_set.push((name.to_string(), value.to_string()));
    }
}
