//! Admin endpoints: `GET /stats`, `GET /ready`, `GET /clusters`,
//! `POST /clusters/<url-encoded name>/endpoints` (JSON array of "ip:port"),
//! `POST /clusters/<url-encoded name>/health` (JSON object {"ip:port": "Healthy"|"Unhealthy"|"Degraded"}).

use crate::body::GwBody;
use crate::cluster::Health;
use crate::global::Global;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use std::sync::atomic::Ordering;
use std::sync::Arc;

fn resp(status: StatusCode, ctype: &str, body: String) -> Response<GwBody> {
    let mut r = Response::new(GwBody::full(Bytes::from(body)));
    *r.status_mut() = status;
    if let Ok(v) = hyper::header::HeaderValue::from_str(ctype) {
        r.headers_mut().insert("content-type", v);
    }
    r
}

/// Percent-decode a path segment.
pub fn url_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let hex = |c: u8| (c as char).to_digit(16);
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Serves the admin endpoints on `listener` until the process ends (never, without one).
pub async fn serve(listener: Option<std::net::TcpListener>, g: Arc<Global>) -> anyhow::Result<()> {
    let Some(a) = listener else { return std::future::pending().await };
    a.set_nonblocking(true)?;
    let l = tokio::net::TcpListener::from_std(a)?;
    loop {
        let (stream, _) = match l.accept().await {
            Ok(x) => x,
            Err(_) => continue,
        };
        let g = g.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let g = g.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(g, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// Handle one admin request.
pub async fn handle(g: Arc<Global>, req: Request<Incoming>) -> Response<GwBody> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    match (method, path.as_str()) {
        (Method::GET, "/ready") => resp(StatusCode::OK, "text/plain", "LIVE\n".into()),
        // What pilot-agent asks of Envoy when its pod stops. Only the graceful drain is
        // modelled (the listeners keep accepting, each response closes its connection); an
        // immediate one (listeners closed at once) is refused rather than done otherwise.
        (Method::POST, "/drain_listeners") => {
            let graceful = req.uri().query().is_some_and(|q| q.split('&').any(|p| p == "graceful"));
            if !graceful {
                return resp(
                    StatusCode::BAD_REQUEST,
                    "text/plain",
                    "this host drains only gracefully: POST /drain_listeners?graceful\n".into(),
                );
            }
            g.shutdown.send_if_modified(|s| {
                let start = *s == crate::global::Shutdown::Running;
                if start {
                    *s = crate::global::Shutdown::Draining;
                }
                start
            });
            resp(StatusCode::OK, "text/plain", "OK\n".into())
        }
        (Method::GET, "/stats") | (Method::GET, "/stats/prometheus") => {
            let mut ups = Vec::new();
            for c in g.clusters.all() {
                for e in c.endpoints() {
                    ups.push((
                        c.name.clone(),
                        e.address.clone(),
                        e.total.load(Ordering::Relaxed),
                        e.active.load(Ordering::Relaxed),
                    ));
                }
            }
            resp(StatusCode::OK, "text/plain; version=0.0.4", g.stats.render(&ups))
        }
        (Method::GET, "/clusters") => {
            let list: Vec<_> = g
                .clusters
                .all()
                .iter()
                .map(|c| {
                    serde_json::json!({
                        "name": c.name,
                        "endpoints": c.endpoints().iter().map(|e| serde_json::json!({
                            "address": e.address,
                            "health_status": e.health().as_str(),
                            "metrics": e.metrics(),
                            "active_requests": e.active.load(Ordering::Relaxed),
                            "total_requests": e.total.load(Ordering::Relaxed),
                        })).collect::<Vec<_>>(),
                    })
                })
                .collect();
            resp(StatusCode::OK, "application/json", serde_json::Value::Array(list).to_string())
        }
        (Method::POST, p) if p.starts_with("/clusters/") => {
            let rest = &p["/clusters/".len()..];
            let Some((name, what)) = rest.rsplit_once('/') else {
                return resp(StatusCode::NOT_FOUND, "text/plain", "not found\n".into());
            };
            let name = url_decode(name);
            let Some(cluster) = g.clusters.get(&name) else {
                return resp(
                    StatusCode::NOT_FOUND,
                    "text/plain",
                    format!("unknown cluster {name}\n"),
                );
            };
            let body = req.into_body().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
            match what {
                "endpoints" => match serde_json::from_slice::<Vec<String>>(&body) {
                    Ok(list) => match cluster.set_endpoints(&list) {
                        Ok(added) => {
                            if !added.is_empty() && cluster.health_check.is_some() {
                                let cluster = cluster.clone();
                                tokio::spawn(async move {
                                    crate::cluster::check_endpoints(&cluster, added).await
                                });
                            }
                            resp(StatusCode::OK, "text/plain", "OK\n".into())
                        }
                        Err(e) => resp(StatusCode::BAD_REQUEST, "text/plain", format!("{e}\n")),
                    },
                    Err(e) => resp(
                        StatusCode::BAD_REQUEST,
                        "text/plain",
                        format!("expected a JSON array of \"ip:port\": {e}\n"),
                    ),
                },
                "health" => {
                    match serde_json::from_slice::<std::collections::HashMap<String, String>>(&body)
                    {
                        Ok(map) => {
                            for (addr, h) in &map {
                                let Some(h) = Health::parse(h) else {
                                    return resp(
                                        StatusCode::BAD_REQUEST,
                                        "text/plain",
                                        format!("bad health {h}\n"),
                                    );
                                };
                                let Some(e) = cluster.find(addr) else {
                                    return resp(
                                        StatusCode::NOT_FOUND,
                                        "text/plain",
                                        format!("unknown endpoint {addr}\n"),
                                    );
                                };
                                e.set_health(h);
                            }
                            resp(StatusCode::OK, "text/plain", "OK\n".into())
                        }
                        Err(e) => resp(
                            StatusCode::BAD_REQUEST,
                            "text/plain",
                            format!("expected a JSON object: {e}\n"),
                        ),
                    }
                }
                _ => resp(StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
            }
        }
        _ => resp(StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    }
}
