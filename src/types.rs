//! The proxy-wasm ABI's enumerated values, typed (as the proxy-wasm Rust SDK's `types.rs`).
//!
//! Values the plugin passes to the host or returns to it are `#[repr(u32)]` enums used directly in
//! the FFI signatures of `abi.rs`. Values that come *from* the host (call statuses, flags) stay
//! `u32` at the boundary and are converted with a fallible match: a host may send a number this
//! plugin does not know, and transmuting it into an enum would be undefined behaviour.

/// What the host does after a headers or trailers callback.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderAction {
    /// Go on with the next filter.
    Continue = 0,
    /// Hold the headers. Under ABI `0_2_100` body callbacks keep coming (Higress does not turn
    /// this into StopAllIterationAndWatermark as it does for `0_2_1`).
    StopIteration = 1,
}

/// What the host does after a body callback.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataAction {
    /// Pass the data on (this also releases headers held so far).
    Continue = 0,
    /// Hold the data; the host accumulates the body and the next callback sees all of it.
    StopIterationAndBuffer = 1,
    /// Hold the data; past its buffer limit the host stops reading from the client instead of
    /// answering 413.
    StopIterationAndWatermark = 2,
}

/// Log levels, same numbering as proxy-wasm (argument of `proxy_log`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    /// Very verbose.
    Trace = 0,
    /// Debugging details (per-request decisions).
    Debug = 1,
    /// Normal operation.
    Info = 2,
    /// Something degraded (fallback to normal balancing).
    Warn = 3,
    /// Something is wrong with config or environment.
    Error = 4,
    /// Unrecoverable.
    Critical = 5,
}

/// Header maps (argument of the header hostcalls).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapType {
    /// The stream's request headers.
    HttpRequestHeaders = 0,
    /// The stream's response headers.
    HttpResponseHeaders = 2,
    /// Response headers of an HTTP call, during `proxy_on_http_call_response`.
    HttpCallResponseHeaders = 6,
}

/// Buffers (argument of `proxy_get_buffer_bytes`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferType {
    /// The stream's request body (cumulative while buffered).
    HttpRequestBody = 0,
    /// The response body chunk being delivered.
    HttpResponseBody = 1,
    /// The body of an HTTP call's response, during `proxy_on_http_call_response`.
    HttpCallResponseBody = 4,
    /// The plugin configuration, during `proxy_on_configure`.
    PluginConfiguration = 7,
    /// Higress: a Redis call's reply, during `proxy_on_redis_call_response`.
    RedisCallResponse = 9,
}

/// Stream direction (argument of `proxy_continue_stream`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamType {
    /// The request (downstream to upstream).
    HttpRequest = 0,
}

/// Metric kinds (argument of `proxy_define_metric`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricType {
    /// A monotonically increasing counter.
    Counter = 0,
}
