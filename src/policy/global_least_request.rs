//! `global_least_request`: in-flight counts per host in Redis, shared by every gateway worker and
//! replica; each request goes to the healthy host with the fewest (random among ties).
//!
//! One Redis round trip per request (`least_request.lua`: lease upkeep + cleanup + pick + `+1` +
//! `maxRequestCount` check with undo). The `-1` is sent when the stream ends, exactly once,
//! whatever the outcome. The decision is taken in the headers phase (no body needed). The machinery
//! is shared with `prefix_cache`: see [`super::picker`].

use super::picker::{PickKind, PickResult, Picker, Routed};
use super::{Decision, Policy, Stream};
use crate::config::GlobalLeastRequestConfig;
use crate::host::{Counter, Host};
use crate::redis;

/// The `global_least_request` policy.
pub struct GlobalLeastRequest {
    picker: Picker,
}

impl GlobalLeastRequest {
    /// Creates the policy from its config.
    pub fn new(config: GlobalLeastRequestConfig) -> Self {
        GlobalLeastRequest {
            picker: Picker::new(config, redis::LEAST_REQUEST_LUA.as_str(), "global_least_request"),
        }
    }
}

/// Every admitted pick is a least-request route.
fn routed(_host: &mut dyn Host, _pick: &PickResult) -> Routed {
    let counter = Counter::LeastRequestRouted;
    Routed { counter, decision: counter.label().to_string(), predicted_hit: None }
}

impl Policy for GlobalLeastRequest {
    fn on_request_headers(&mut self, host: &mut dyn Host, stream: &mut Stream) -> Decision {
        if !self.picker.has_group(host, stream) {
            return Decision::Passthrough;
        }
        self.picker.start(host, stream, PickKind::LeastRequest)
    }

    super::picker::delegate_to_picker!(routed);
}

#[cfg(test)]
#[path = "global_least_request_tests.rs"]
mod tests;
