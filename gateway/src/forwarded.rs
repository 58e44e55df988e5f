//! What Envoy's HTTP connection manager does to every request's headers before the filters see
//! them (`ConnectionManagerUtility::mutateRequestHeaders`): `x-forwarded-for`,
//! `x-forwarded-proto`, `x-envoy-external-address`, the internal-only `x-envoy-*` headers, and
//! `x-request-id`. The settings are a Higress gateway's: istio builds gateway listeners with
//! `use_remote_address: true`, `xff_num_trusted_hops` from `gatewayTopology.numTrustedProxies`
//! (default 0) and `preserve_external_request_id` false (istio's gateway defaults, istio/istio
//! PR 13157; Higress users see the appended address, higress-group/higress issue 771). Envoy
//! 1.40 treats no address as internal by default (its `internal_address_config` is empty), so
//! with `use_remote_address` every request is an edge request. Checked against Envoy 1.40 by
//! the conformance tests.

use crate::global::{header_bytes as get, HeaderMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

/// A listener's forwarding settings (see the listener config fields of the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardingConfig {
    pub use_remote_address: bool,
    pub xff_num_trusted_hops: u32,
    pub preserve_external_request_id: bool,
}

impl Default for ForwardingConfig {
    fn default() -> Self {
        ForwardingConfig {
            use_remote_address: true,
            xff_num_trusted_hops: 0,
            preserve_external_request_id: false,
        }
    }
}

/// Request headers Envoy removes from a request that is not internal
/// (`ConnectionManagerUtility::cleanInternalHeaders`): they would steer its router.
const INTERNAL_ONLY: &[&str] = &[
    "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names",
    "x-envoy-retry-on",
    "x-envoy-retry-grpc-on",
    "x-envoy-max-retries",
    "x-envoy-upstream-alt-stat-name",
    "x-envoy-upstream-rq-timeout-ms",
    "x-envoy-upstream-rq-per-try-timeout-ms",
    "x-envoy-upstream-rq-timeout-alt-response",
    "x-envoy-expected-rq-timeout-ms",
    "x-envoy-force-trace",
    "x-envoy-ip-tags",
    "x-envoy-original-url",
    "x-envoy-hedge-on-per-try-timeout",
];

/// Removed too when the request comes from the edge.
const EDGE_ONLY: &[&str] = &[
    "x-envoy-decorator-operation",
    "x-envoy-downstream-service-cluster",
    "x-envoy-downstream-service-node",
];

/// The address Envoy appends to `x-forwarded-for` for a client on loopback (its
/// `LocalInfo::address()`, from `Network::Utility::getLocalAddress`): the first IPv4 address of
/// a network interface that is not loopback, else 127.0.0.1.
pub fn node_address() -> IpAddr {
    if_addrs::get_if_addrs()
        .ok()
        .and_then(|ifs| {
            ifs.into_iter().map(|i| i.ip()).find(|ip| ip.is_ipv4() && !ip.is_loopback())
        })
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

fn set(h: &mut HeaderMap, name: &str, value: Vec<u8>) {
    match h.iter_mut().find(|(k, _)| k == name) {
        Some((_, v)) => *v = value,
        None => h.push((name.to_string(), value)),
    }
}

/// The address `n` entries from the right of `x-forwarded-for` (0: the last), when it is an
/// IP address (Envoy's `Utility::getLastAddressFromXFF`; it comes with port 0).
fn xff_address(h: &HeaderMap, n: u32) -> Option<SocketAddr> {
    let xff = std::str::from_utf8(get(h, "x-forwarded-for")?).ok()?;
    let entry = xff.rsplit(',').nth(n as usize)?;
    entry.trim().parse::<IpAddr>().ok().map(|ip| SocketAddr::new(ip, 0))
}

/// Connection tokens that name no header to remove (Envoy's `sanitizeConnectionHeader`).
const CONNECTION_OPTIONS: &[&str] = &["close", "keep-alive", "upgrade", "http2-settings"];

/// Headers the connection manager removes before the filters (`mutateRequestHeaders`, "clean
/// proxy headers"; no upgrades here).
const PROXY_HEADERS: &[&str] = &[
    "connection",
    "upgrade",
    "x-envoy-internal",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
];

/// Why Envoy's HTTP/1 codec answers a request's `Connection` header with 400 before any filter
/// (`Utility::sanitizeConnectionHeader`), if it does: ten or more tokens, or a token naming an
/// `x-forwarded-*` header or a pseudo-header, whose removal would hide where the request came
/// from. `tokens`: the header's comma-separated tokens, all of its lines.
pub fn connection_header_refused<'a>(tokens: impl Iterator<Item = &'a str>) -> bool {
    let tokens: Vec<&str> = tokens.map(str::trim).collect();
    tokens.len() >= 10
        || tokens.iter().any(|t| {
            t.starts_with(':')
                || ["x-forwarded-for", "x-forwarded-host", "x-forwarded-proto"]
                    .iter()
                    .any(|x| t.eq_ignore_ascii_case(x))
        })
}

/// Removes the headers an HTTP/1 request's `Connection` header nominates, as Envoy's codec does
/// before the filters: any header named there, except `te`, which stays (as `trailers`) when it
/// asks for trailers.
fn remove_nominated(h: &mut HeaderMap) {
    let nominated: Vec<String> = h
        .iter()
        .filter(|(k, _)| k == "connection")
        .flat_map(|(_, v)| {
            String::from_utf8_lossy(v)
                .split(',')
                .map(|t| t.trim().to_ascii_lowercase())
                .collect::<Vec<_>>()
        })
        .filter(|t| !t.is_empty() && t != "connection" && !CONNECTION_OPTIONS.contains(&t.as_str()))
        .collect();
    for name in nominated {
        if name == "te" {
            let trailers = get(h, "te").is_some_and(|v| {
                String::from_utf8_lossy(v)
                    .split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("trailers"))
            });
            if trailers {
                set(h, "te", b"trailers".to_vec());
                continue;
            }
        }
        h.retain(|(k, _)| *k != name);
    }
}

/// Envoy's request header mutations for a request from `peer`, in its order: the HTTP/1 codec's
/// `Connection` handling, then the connection manager's. Returns the client address the
/// request is logged and seen under (`source.address`).
pub fn mutate_request_headers(
    h: &mut HeaderMap,
    cfg: &ForwardingConfig,
    peer: SocketAddr,
    node: IpAddr,
) -> SocketAddr {
    remove_nominated(h);
    h.retain(|(k, _)| !PROXY_HEADERS.contains(&k.as_str()));
    let final_remote = if cfg.use_remote_address {
        let trusted = match cfg.xff_num_trusted_hops {
            0 => None,
            n => xff_address(h, n - 1),
        };
        let appended = if peer.ip().is_loopback() { node } else { peer.ip() };
        let xff = match get(h, "x-forwarded-for") {
            Some(v) => [v, b",", appended.to_string().as_bytes()].concat(),
            None => appended.to_string().into_bytes(),
        };
        set(h, "x-forwarded-for", xff);
        // An untrusted client's `x-forwarded-proto` is replaced (no TLS here).
        if cfg.xff_num_trusted_hops == 0 || get(h, "x-forwarded-proto").is_none() {
            set(h, "x-forwarded-proto", b"http".to_vec());
        }
        Some(trusted.unwrap_or(peer))
    } else {
        xff_address(h, cfg.xff_num_trusted_hops)
    };
    if get(h, "x-forwarded-proto").is_none() {
        set(h, "x-forwarded-proto", b"http".to_vec());
    }
    // No request is internal (Envoy 1.40's default internal address config names none), so
    // every request loses the internal-only headers, and with `use_remote_address` it is an
    // edge request.
    let edge = cfg.use_remote_address;
    h.retain(|(k, _)| {
        let k = k.as_str();
        !(INTERNAL_ONLY.contains(&k) || edge && EDGE_ONLY.contains(&k))
    });
    let final_remote = final_remote.unwrap_or(peer);
    if edge {
        set(h, "x-envoy-external-address", final_remote.ip().to_string().into_bytes());
    }
    if (edge && !cfg.preserve_external_request_id) || get(h, "x-request-id").is_none() {
        set(h, "x-request-id", uuid::Uuid::new_v4().to_string().into_bytes());
    }
    final_remote
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())).collect()
    }

    fn value(h: &HeaderMap, name: &str) -> Option<String> {
        get(h, name).map(|v| String::from_utf8_lossy(v).into_owned())
    }

    const NODE: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 2));

    #[test]
    fn an_edge_request_gets_the_client_appended_and_a_new_request_id() {
        let mut h = headers(&[
            ("x-forwarded-for", "9.9.9.9, 8.8.8.8"),
            ("x-forwarded-proto", "https"),
            ("x-request-id", "mine"),
            ("x-envoy-retry-on", "5xx"),
            ("x-envoy-internal", "true"),
            ("x-envoy-decorator-operation", "op"),
            ("x-envoy-external-address", "1.1.1.1"),
        ]);
        let peer: SocketAddr = "10.1.2.3:5555".parse().unwrap();
        let src = mutate_request_headers(&mut h, &ForwardingConfig::default(), peer, NODE);
        assert_eq!(src, peer);
        assert_eq!(value(&h, "x-forwarded-for").as_deref(), Some("9.9.9.9, 8.8.8.8,10.1.2.3"));
        assert_eq!(value(&h, "x-forwarded-proto").as_deref(), Some("http"));
        assert_eq!(value(&h, "x-envoy-external-address").as_deref(), Some("10.1.2.3"));
        let id = value(&h, "x-request-id").unwrap();
        assert!(uuid::Uuid::parse_str(&id).is_ok(), "{id}");
        for gone in ["x-envoy-retry-on", "x-envoy-internal", "x-envoy-decorator-operation"] {
            assert_eq!(value(&h, gone), None, "{gone}");
        }
    }

    #[test]
    fn headers_the_connection_header_nominates_are_removed() {
        let mut h = headers(&[
            ("connection", "keep-alive, X-Foo, cache-control"),
            ("connection", "te"),
            ("x-foo", "1"),
            ("cache-control", "no-cache"),
            ("te", "gzip, trailers"),
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "keep-alive"),
            ("x-kept", "1"),
        ]);
        let peer: SocketAddr = "10.0.0.1:1".parse().unwrap();
        mutate_request_headers(&mut h, &ForwardingConfig::default(), peer, NODE);
        for gone in ["connection", "x-foo", "cache-control", "keep-alive", "proxy-connection"] {
            assert_eq!(value(&h, gone), None, "{gone}");
        }
        assert_eq!(value(&h, "te").as_deref(), Some("trailers"));
        assert_eq!(value(&h, "x-kept").as_deref(), Some("1"));
        let mut h = headers(&[("connection", "te"), ("te", "gzip")]);
        mutate_request_headers(&mut h, &ForwardingConfig::default(), peer, NODE);
        assert_eq!(value(&h, "te"), None);
    }

    #[test]
    fn a_connection_header_that_could_hide_the_client_is_refused() {
        let refused = |v: &str| connection_header_refused(v.split(','));
        assert!(refused("x-forwarded-for"));
        assert!(refused("close, X-Forwarded-Proto"));
        assert!(refused(":path"));
        assert!(refused("a1,a2,a3,a4,a5,a6,a7,a8,a9,a10"));
        assert!(!refused("a1,a2,a3,a4,a5,a6,a7,a8,a9"));
        assert!(!refused("keep-alive, x-foo"));
    }

    #[test]
    fn a_loopback_client_is_forwarded_as_the_node_address() {
        let mut h = headers(&[]);
        let peer: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        mutate_request_headers(&mut h, &ForwardingConfig::default(), peer, NODE);
        assert_eq!(value(&h, "x-forwarded-for").as_deref(), Some("192.0.2.2"));
        assert_eq!(value(&h, "x-envoy-external-address").as_deref(), Some("127.0.0.1"));
    }

    #[test]
    fn trusted_hops_take_the_client_from_x_forwarded_for() {
        let cfg = ForwardingConfig { xff_num_trusted_hops: 1, ..ForwardingConfig::default() };
        let mut h = headers(&[("x-forwarded-for", "7.7.7.7"), ("x-forwarded-proto", "https")]);
        let peer: SocketAddr = "10.0.0.9:1".parse().unwrap();
        let src = mutate_request_headers(&mut h, &cfg, peer, NODE);
        assert_eq!(src, "7.7.7.7:0".parse().unwrap());
        assert_eq!(value(&h, "x-forwarded-for").as_deref(), Some("7.7.7.7,10.0.0.9"));
        assert_eq!(value(&h, "x-forwarded-proto").as_deref(), Some("https"));
        assert_eq!(value(&h, "x-envoy-external-address").as_deref(), Some("7.7.7.7"));
    }

    #[test]
    fn without_remote_address_the_request_id_is_kept_and_nothing_is_appended() {
        let cfg = ForwardingConfig { use_remote_address: false, ..ForwardingConfig::default() };
        let mut h = headers(&[("x-request-id", "mine"), ("x-envoy-decorator-operation", "op")]);
        let peer: SocketAddr = "10.0.0.9:1".parse().unwrap();
        mutate_request_headers(&mut h, &cfg, peer, NODE);
        assert_eq!(value(&h, "x-request-id").as_deref(), Some("mine"));
        assert_eq!(value(&h, "x-forwarded-for"), None);
        assert_eq!(value(&h, "x-envoy-external-address"), None);
        assert_eq!(value(&h, "x-forwarded-proto").as_deref(), Some("http"));
        assert_eq!(value(&h, "x-envoy-decorator-operation").as_deref(), Some("op"));
    }
}
