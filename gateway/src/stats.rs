//! Host counters and plugin-defined metrics, rendered as Prometheus text on admin `/stats`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Kind of a plugin metric (proxy-wasm `MetricType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// 0
    Counter,
    /// 1
    Gauge,
    /// 2
    Histogram,
}

/// Why a metric operation failed (proxy-wasm statuses NotFound and BadArgument).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricError {
    /// No metric has this id.
    NotFound,
    /// The operation does not apply to the metric's type (or the value to a counter).
    BadArgument,
}

/// The callbacks a plugin VM exports that the host calls, as `vm_callbacks` counts them.
pub const VM_CALLBACKS: [&str; 16] = [
    "proxy_on_vm_start",
    "proxy_on_configure",
    "proxy_on_context_create",
    "proxy_on_request_headers",
    "proxy_on_request_body",
    "proxy_on_request_trailers",
    "proxy_on_response_headers",
    "proxy_on_response_body",
    "proxy_on_log",
    "proxy_on_done",
    "proxy_on_delete",
    "proxy_on_tick",
    "proxy_on_queue_ready",
    "proxy_on_http_call_response",
    "proxy_on_redis_call_response",
    "proxy_on_memory_allocate",
];

#[derive(Debug, Default)]
struct CallbackStat {
    calls: AtomicU64,
    nanos: AtomicU64,
}

#[derive(Debug)]
struct Metric {
    name: String,
    kind: MetricKind,
    value: i64,
    count: u64,
    sum: u64,
}

/// Process-wide statistics (Envoy stats are shared across workers).
#[derive(Debug, Default)]
pub struct Stats {
    /// Downstream requests.
    pub requests_total: AtomicU64,
    /// Local replies sent by the gateway or the plugin.
    pub local_replies_total: AtomicU64,
    /// Plugin VM traps.
    pub vm_traps_total: AtomicU64,
    /// Calls into a plugin VM (every callback: stream, root, tick, Redis/HTTP replies).
    pub vm_calls_total: AtomicU64,
    /// Wall time spent inside those calls (hostcalls included), in nanoseconds: the plugin's
    /// own CPU on the worker thread, which blocks while it runs.
    pub vm_call_nanos_total: AtomicU64,
    /// Calls and wall time per callback, in the order of [`VM_CALLBACKS`]: where the plugin's
    /// time goes (per-chunk body callbacks, ticks, Redis replies).
    vm_callbacks: [CallbackStat; VM_CALLBACKS.len()],
    /// Largest linear memory of any plugin VM, in bytes. A wasm memory never shrinks, so this is
    /// the peak any one VM needed.
    pub vm_memory_bytes_max: AtomicU64,
    metrics: Mutex<Vec<Metric>>,
}

impl Stats {
    /// One call into a plugin VM: `callback` took `nanos` of wall time.
    pub fn vm_call(&self, callback: &str, nanos: u64) {
        self.vm_calls_total.fetch_add(1, Ordering::Relaxed);
        self.vm_call_nanos_total.fetch_add(nanos, Ordering::Relaxed);
        if let Some(at) = VM_CALLBACKS.iter().position(|c| *c == callback) {
            if let Some(c) = self.vm_callbacks.get(at) {
                c.calls.fetch_add(1, Ordering::Relaxed);
                c.nanos.fetch_add(nanos, Ordering::Relaxed);
            }
        }
    }

    /// Define (or find) a metric; returns its id.
    pub fn define(&self, kind: MetricKind, name: &str) -> u32 {
        let Ok(mut m) = self.metrics.lock() else { return 0 };
        if let Some(i) = m.iter().position(|x| x.name == name) {
            return i as u32;
        }
        m.push(Metric { name: name.to_string(), kind, value: 0, count: 0, sum: 0 });
        (m.len() - 1) as u32
    }
    /// Add to a counter or gauge, as Envoy's `Context::incrementMetric`: a counter only grows
    /// (an offset <= 0 is BadArgument), a gauge adds or subtracts, a histogram has no increment
    /// (BadArgument).
    pub fn increment(&self, id: u32, offset: i64) -> Result<(), MetricError> {
        let mut m = self.metrics.lock().map_err(|_| MetricError::NotFound)?;
        let x = m.get_mut(id as usize).ok_or(MetricError::NotFound)?;
        match x.kind {
            MetricKind::Counter if offset <= 0 => Err(MetricError::BadArgument),
            MetricKind::Counter | MetricKind::Gauge => {
                x.value = x.value.saturating_add(offset);
                Ok(())
            }
            MetricKind::Histogram => Err(MetricError::BadArgument),
        }
    }
    /// Record, as Envoy's `Context::recordMetric`: a counter adds the value, a gauge is set to
    /// it, a histogram takes a sample.
    pub fn record(&self, id: u32, value: u64) -> Result<(), MetricError> {
        let mut m = self.metrics.lock().map_err(|_| MetricError::NotFound)?;
        let x = m.get_mut(id as usize).ok_or(MetricError::NotFound)?;
        match x.kind {
            MetricKind::Counter => x.value = x.value.saturating_add(value as i64),
            MetricKind::Gauge => x.value = value as i64,
            MetricKind::Histogram => {
                x.count += 1;
                x.sum = x.sum.saturating_add(value);
            }
        }
        Ok(())
    }
    /// Current value of a counter or gauge; a histogram has none to read (Envoy's
    /// `Context::getMetric` answers BadArgument).
    pub fn get(&self, id: u32) -> Result<u64, MetricError> {
        let m = self.metrics.lock().map_err(|_| MetricError::NotFound)?;
        let x = m.get(id as usize).ok_or(MetricError::NotFound)?;
        match x.kind {
            MetricKind::Histogram => Err(MetricError::BadArgument),
            _ => Ok(x.value as u64),
        }
    }

    /// Render plugin metrics + host counters. `upstreams` gives (cluster, host, total, active).
    pub fn render(&self, upstreams: &[(String, String, u64, i64)]) -> String {
        let mut out = String::new();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let host_metrics = [
            ("gateway_requests_total", "counter", load(&self.requests_total).to_string()),
            ("gateway_local_replies_total", "counter", load(&self.local_replies_total).to_string()),
            ("gateway_vm_traps_total", "counter", load(&self.vm_traps_total).to_string()),
            ("gateway_vm_calls_total", "counter", load(&self.vm_calls_total).to_string()),
            (
                "gateway_vm_call_seconds_total",
                "counter",
                format!("{:.9}", load(&self.vm_call_nanos_total) as f64 / 1e9),
            ),
            ("gateway_vm_memory_bytes_max", "gauge", load(&self.vm_memory_bytes_max).to_string()),
        ];
        for (name, kind, value) in host_metrics {
            out.push_str(&format!("# TYPE {name} {kind}\n{name} {value}\n"));
        }
        let called =
            || VM_CALLBACKS.iter().zip(&self.vm_callbacks).filter(|(_, c)| load(&c.calls) > 0);
        out.push_str("# TYPE gateway_vm_callback_calls_total counter\n");
        for (name, c) in called() {
            let calls = load(&c.calls);
            out.push_str(&format!(
                "gateway_vm_callback_calls_total{{callback=\"{name}\"}} {calls}\n"
            ));
        }
        out.push_str("# TYPE gateway_vm_callback_seconds_total counter\n");
        for (name, c) in called() {
            let seconds = load(&c.nanos) as f64 / 1e9;
            out.push_str(&format!(
                "gateway_vm_callback_seconds_total{{callback=\"{name}\"}} {seconds:.9}\n"
            ));
        }
        out.push_str("# TYPE gateway_upstream_requests_total counter\n");
        for (c, h, t, _) in upstreams {
            out.push_str(&format!(
                "gateway_upstream_requests_total{{cluster=\"{}\",host=\"{}\"}} {t}\n",
                esc(c),
                esc(h)
            ));
        }
        out.push_str("# TYPE gateway_upstream_rq_active gauge\n");
        for (c, h, _, a) in upstreams {
            out.push_str(&format!(
                "gateway_upstream_rq_active{{cluster=\"{}\",host=\"{}\"}} {a}\n",
                esc(c),
                esc(h)
            ));
        }
        if let Ok(m) = self.metrics.lock() {
            let mut sorted: BTreeMap<String, &Metric> = BTreeMap::new();
            for x in m.iter() {
                sorted.insert(x.name.clone(), x);
            }
            for (name, x) in sorted {
                let n = prom_name(&name);
                match x.kind {
                    MetricKind::Counter => {
                        out.push_str(&format!("# TYPE {n} counter\n{n} {}\n", x.value))
                    }
                    MetricKind::Gauge => {
                        out.push_str(&format!("# TYPE {n} gauge\n{n} {}\n", x.value))
                    }
                    MetricKind::Histogram => out.push_str(&format!(
                        "# TYPE {n} summary\n{n}_count {}\n{n}_sum {}\n",
                        x.count, x.sum
                    )),
                }
            }
        }
        out
    }
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Plugin metric names may contain `.`, `:` etc.; Prometheus allows `[a-zA-Z0-9_:]`.
fn prom_name(name: &str) -> String {
    let mut s: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == ':' { c } else { '_' })
        .collect();
    if s.chars().next().is_some_and(|c| c.is_ascii_digit()) {
        s.insert(0, '_');
    }
    s
}
