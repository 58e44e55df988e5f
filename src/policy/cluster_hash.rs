//! `cluster_hash` (`lb_type: cluster`): a request's hash key (a header, a cookie, a field of the
//! JSON body, or a host property) picks one of `clusters` by weight, the same one for the same key
//! on every worker and gateway replica, and the service's name is written to the request header
//! `cluster_header`; the gateway's route takes its cluster from that header (Envoy
//! `RouteAction.cluster_header`), as with `cluster_metrics`.
//!
//! The choice is the Go plugin's: the key's 32-bit FNV-1a hash modulo 100 indexes 100 slots, each
//! cluster holding `weight` of them in config order, so a config carried over from the Go plugin
//! sends every key to the same service it did there.
//!
//! A request without a key is answered 403 `hash key required`, as the Go plugin does: the policy
//! exists to keep each key's traffic on its own service, and a keyless request has none. For a
//! body key that includes a request without a body (`GET`, `HEAD`, `content-length: 0`, or headers
//! that end the request) and a JSON body without the field. A body that is not JSON, or larger than
//! the body limit (`key.max_body_bytes`, 100 MiB by default, or `maxBodyBytes`), is passed on
//! without the header, with a log line, as every bad body is in this plugin: the route decides.
//!
//! Stateless: nothing is kept per stream, and no Redis is used.

use super::{fnv1a32, Decision, Policy, Stream};
use crate::config::{ClusterHashConfig, HashKeySource};
use crate::host::{Counter, Host, LogLevel};

/// The `cluster_hash` policy.
pub struct ClusterHash {
    config: ClusterHashConfig,
}

/// Whether the request has no body to read a key from, as the Go plugin judges it (its method or
/// a zero `content-length`), or because its headers ended it.
fn has_no_body(host: &dyn Host, stream: &Stream) -> bool {
    let method = host.request_header(":method").unwrap_or_default();
    stream.bodiless
        || method.eq_ignore_ascii_case("GET")
        || method.eq_ignore_ascii_case("HEAD")
        || host.request_header("content-length").is_some_and(|l| l.trim() == "0")
}

/// The value of cookie `name` in a `cookie` header (the first of that name; surrounding double
/// quotes dropped, as Go's `Request.Cookie` does).
fn cookie_value(header: &str, name: &str) -> Option<String> {
    cookie::Cookie::split_parse(header)
        .filter_map(Result::ok)
        .find(|c| c.name() == name)
        .map(|c| c.value_trimmed().to_string())
}

/// The text of the GJSON `path` in `body` (a string's contents, a number's, `true`/`false`, an
/// object's or array's JSON), as Go's `gjson.GetBytes(body, path).String()` gives it; `None` for a
/// body that is not JSON.
fn body_key(body: &[u8], path: &str) -> Option<String> {
    let json = std::str::from_utf8(body).ok()?;
    if !gjson::valid(json) {
        return None;
    }
    let value = gjson::get(json, path);
    Some(match value.kind() {
        gjson::Kind::Number => go_number_text(value.json(), value.f64()),
        _ => value.str().to_string(),
    })
}

/// A number as Go's gjson `Result.String()` writes it, so a numeric key hashes as in Go: an
/// integer as written, any other number in the shortest form that reads back the same, without
/// an exponent (`strconv.FormatFloat(n, 'f', -1, 64)`: `1.50` is "1.5", `1e3` "1000"). Rust's
/// `Display` for `f64` is that form; only the infinities (`1e400`) are written differently.
fn go_number_text(raw: &str, n: f64) -> String {
    let digits = raw.strip_prefix('-').unwrap_or(raw);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        return raw.to_string();
    }
    match n {
        f64::INFINITY => "+Inf".into(),
        f64::NEG_INFINITY => "-Inf".into(),
        _ => n.to_string(),
    }
}

impl ClusterHash {
    /// Creates the policy from its config.
    pub fn new(config: ClusterHashConfig) -> Self {
        ClusterHash { config }
    }

    /// The service for `key`.
    fn service(&self, key: &str) -> Option<&String> {
        let slots = &self.config.slots;
        let n = u32::try_from(slots.len()).ok().filter(|&n| n > 0)?;
        slots.get((fnv1a32(key.as_bytes()) % n) as usize)
    }

    /// Routes by `key`, or rejects the request without one.
    fn route(&self, host: &mut dyn Host, stream: &mut Stream, key: Option<String>) -> Decision {
        let Some(key) = key.filter(|k| !k.is_empty()) else {
            let source = match &self.config.key {
                HashKeySource::Header(name) => format!("header {name:?}"),
                HashKeySource::Cookie(name) => format!("cookie {name:?}"),
                HashKeySource::Body(path) => format!("body field {path:?}"),
                HashKeySource::Metadata(path) => format!("property {:?}", path.join(".")),
            };
            host.log(
                LogLevel::Warn,
                &format!("cluster_hash: no hash key ({source}); rejecting the request (403)"),
            );
            host.increment_counter(Counter::HashKeyMissing, 1);
            stream.decision = Some(Counter::HashKeyMissing.label().into());
            return Decision::Reject { status: 403, body: "hash key required".into() };
        };
        let Some(service) = self.service(&key).cloned() else { return Decision::Passthrough };
        host.log(LogLevel::Debug, &format!("cluster_hash: -> {service}"));
        host.increment_counter(Counter::HashRouted, 1);
        stream.decision = Some(format!("{}; service={service}", Counter::HashRouted.label()));
        Decision::SetHeader { name: self.config.cluster_header.clone(), value: service }
    }
}

impl Policy for ClusterHash {
    fn name(&self) -> &'static str {
        "cluster_hash"
    }

    fn on_request_headers(&mut self, host: &mut dyn Host, stream: &mut Stream) -> Decision {
        let key = match &self.config.key {
            HashKeySource::Body(_) if has_no_body(host, stream) => None,
            HashKeySource::Body(_) => return Decision::NeedBody,
            HashKeySource::Header(name) => host.request_header(name),
            HashKeySource::Cookie(name) => {
                host.request_header("cookie").and_then(|h| cookie_value(&h, name))
            }
            HashKeySource::Metadata(path) => {
                let path: Vec<&str> = path.iter().map(String::as_str).collect();
                host.get_property(&path).map(|v| String::from_utf8_lossy(&v).into_owned())
            }
        };
        self.route(host, stream, key)
    }

    fn on_request_body(
        &mut self,
        host: &mut dyn Host,
        stream: &mut Stream,
        body: &[u8],
    ) -> Decision {
        let HashKeySource::Body(path) = &self.config.key else { return Decision::Passthrough };
        match body_key(body, path) {
            Some(key) => self.route(host, stream, Some(key)),
            None => {
                host.log(
                    LogLevel::Info,
                    "cluster_hash: the request body is not JSON; passed on without a cluster",
                );
                host.increment_counter(Counter::FallbackBadBody, 1);
                stream.decision = Some(Counter::FallbackBadBody.label().into());
                Decision::Passthrough
            }
        }
    }
}

#[cfg(test)]
#[path = "cluster_hash_tests.rs"]
mod tests;
