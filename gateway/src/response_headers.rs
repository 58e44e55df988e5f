//! Envoy's route configuration `response_headers_to_add`: headers every response of a routed
//! stream gets, with `%UPSTREAM_HOST%` (the endpoint the router chose) in their values. As
//! Envoy 1.40 applies them: to an upstream's response and to a router's or a filter's local
//! reply alike, before the filters' response callbacks, so a plugin sees and may change them; a
//! header whose value comes out empty (no upstream chosen yet) is left out; nothing is added to
//! a stream no route matched.
//!
//! The lab's test fixtures configure `x-gateway-upstream-host: "%UPSTREAM_HOST%"`, so the
//! same tests can run against a real Envoy or Higress with the same route configuration.

use crate::abi::headers::add_to;
use crate::global::HeaderMap;
use serde::Deserialize;

/// One entry, in Envoy's `HeaderValueOption` form.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderValueOption {
    pub header: HeaderValue,
    #[serde(default)]
    pub append_action: AppendAction,
    /// Add the header also when its value comes out empty.
    #[serde(default)]
    pub keep_empty_value: bool,
}

/// Envoy's `HeaderValue`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderValue {
    pub key: String,
    #[serde(default)]
    pub value: String,
}

/// Envoy's `HeaderValueOption.HeaderAppendAction`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AppendAction {
    #[default]
    AppendIfExistsOrAdd,
    AddIfAbsent,
    OverwriteIfExistsOrAdd,
    OverwriteIfExists,
}

/// A piece of a header value.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    /// `%UPSTREAM_HOST%` / `%UPSTREAM_REMOTE_ADDRESS%`: the chosen endpoint's `ip:port` (the
    /// same here: one address per endpoint).
    UpstreamHost,
}

/// One checked entry.
#[derive(Debug, Clone)]
struct Entry {
    /// Lower case.
    key: String,
    value: Vec<Part>,
    action: AppendAction,
    keep_empty_value: bool,
}

/// The checked configuration.
#[derive(Debug, Clone)]
pub struct ResponseHeadersToAdd(Vec<Entry>);

impl ResponseHeadersToAdd {
    /// Checks every entry; an error names the entry and says what is wrong.
    pub fn new(options: &[HeaderValueOption]) -> anyhow::Result<Self> {
        let mut out = Vec::with_capacity(options.len());
        for (i, o) in options.iter().enumerate() {
            let field = format!("response_headers_to_add[{i}].header");
            let key = o.header.key.to_ascii_lowercase();
            if key.is_empty() || key.starts_with(':') || key == "host" {
                anyhow::bail!("{field}.key: {:?} cannot be added", o.header.key);
            }
            let parts = parse_value(&o.header.value)
                .map_err(|e| anyhow::anyhow!("{field}.value {:?}: {e}", o.header.value))?;
            out.push(Entry {
                key,
                value: parts,
                action: o.append_action,
                keep_empty_value: o.keep_empty_value,
            });
        }
        Ok(ResponseHeadersToAdd(out))
    }

    /// Adds the headers to a response's headers; `upstream_host`: the endpoint the router
    /// chose, if it did.
    pub fn apply(&self, headers: &mut HeaderMap, upstream_host: Option<&str>) {
        for Entry { key, value, action, keep_empty_value } in &self.0 {
            let value: String = value
                .iter()
                .map(|p| match p {
                    Part::Text(t) => t.as_str(),
                    Part::UpstreamHost => upstream_host.unwrap_or(""),
                })
                .collect();
            if value.is_empty() && !keep_empty_value {
                continue;
            }
            let present = headers.iter().any(|(k, _)| k == key);
            match action {
                AppendAction::AppendIfExistsOrAdd => {}
                AppendAction::AddIfAbsent if present => continue,
                AppendAction::AddIfAbsent => {}
                AppendAction::OverwriteIfExists if !present => continue,
                AppendAction::OverwriteIfExists | AppendAction::OverwriteIfExistsOrAdd => {
                    headers.retain(|(k, _)| k != key);
                }
            }
            add_to(2, headers, key.clone(), value.into_bytes());
        }
    }
}

/// Splits a value into text and `%COMMAND%`s. Envoy's formatter knows many more commands;
/// this host knows the upstream's address only and refuses the rest rather than send them
/// as text.
fn parse_value(v: &str) -> Result<Vec<Part>, String> {
    let mut parts = Vec::new();
    let mut rest = v;
    while let Some(start) = rest.find('%') {
        if start > 0 {
            parts.push(Part::Text(rest[..start].to_string()));
        }
        let after = &rest[start + 1..];
        let Some(end) = after.find('%') else {
            return Err("a '%' that starts no %COMMAND%".into());
        };
        match &after[..end] {
            "UPSTREAM_HOST" | "UPSTREAM_REMOTE_ADDRESS" => parts.push(Part::UpstreamHost),
            other => {
                return Err(format!(
                    "%{other}% is not supported here (%UPSTREAM_HOST% and \
                     %UPSTREAM_REMOTE_ADDRESS% are)"
                ))
            }
        }
        rest = &after[end + 1..];
    }
    if !rest.is_empty() {
        parts.push(Part::Text(rest.to_string()));
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn option(key: &str, value: &str, action: AppendAction) -> HeaderValueOption {
        HeaderValueOption {
            header: HeaderValue { key: key.into(), value: value.into() },
            append_action: action,
            keep_empty_value: false,
        }
    }

    fn values(h: &HeaderMap, key: &str) -> Vec<String> {
        h.iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            .collect()
    }

    #[test]
    fn the_upstream_host_is_filled_in_and_left_out_when_there_is_none() {
        let add = ResponseHeadersToAdd::new(&[
            option("X-Up", "%UPSTREAM_HOST%", AppendAction::default()),
            option("x-both", "at %UPSTREAM_REMOTE_ADDRESS%!", AppendAction::default()),
        ])
        .unwrap();
        let mut h: HeaderMap = vec![(":status".into(), b"200".to_vec())];
        add.apply(&mut h, Some("10.0.0.1:80"));
        assert_eq!(values(&h, "x-up"), ["10.0.0.1:80"]);
        assert_eq!(values(&h, "x-both"), ["at 10.0.0.1:80!"]);
        let mut h: HeaderMap = Vec::new();
        add.apply(&mut h, None);
        assert_eq!(values(&h, "x-up"), Vec::<String>::new());
        assert_eq!(values(&h, "x-both"), ["at !"]);
    }

    #[test]
    fn append_actions_as_envoy_names_them() {
        let existing = || -> HeaderMap { vec![("x-a".into(), b"old".to_vec())] };
        let run = |action| {
            let mut h = existing();
            ResponseHeadersToAdd::new(&[option("x-a", "new", action)]).unwrap().apply(&mut h, None);
            values(&h, "x-a")
        };
        assert_eq!(run(AppendAction::AppendIfExistsOrAdd), ["old", "new"]);
        assert_eq!(run(AppendAction::AddIfAbsent), ["old"]);
        assert_eq!(run(AppendAction::OverwriteIfExistsOrAdd), ["new"]);
        assert_eq!(run(AppendAction::OverwriteIfExists), ["new"]);
        let mut h = HeaderMap::new();
        ResponseHeadersToAdd::new(&[option("x-a", "new", AppendAction::OverwriteIfExists)])
            .unwrap()
            .apply(&mut h, None);
        assert!(h.is_empty());
    }

    #[test]
    fn unknown_commands_and_pseudo_headers_fail_naming_the_entry() {
        let e = ResponseHeadersToAdd::new(&[
            option("x-ok", "fine", AppendAction::default()),
            option("x-b", "%START_TIME%", AppendAction::default()),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("response_headers_to_add[1].header.value"), "{e}");
        assert!(e.contains("%START_TIME%"), "{e}");
        let e = ResponseHeadersToAdd::new(&[option(":status", "1", AppendAction::default())])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("response_headers_to_add[0].header.key"), "{e}");
        assert!(ResponseHeadersToAdd::new(&[option("x", "50%", AppendAction::default())]).is_err());
    }
}
