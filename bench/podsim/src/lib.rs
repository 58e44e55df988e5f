//! podsim: simulated OpenAI-compatible LLM pods for benchmarking the load-balancing plugin.
//!
//! - [`tokenizer`]: deterministic tokenizer + chat template (shared with `loadgen`).
//! - [`radix`]: RadixAttention-style prefix cache over tokens.
//! - [`engine`]: continuous-batching scheduler and step latency model.
//! - [`server`]: HTTP endpoints, SSE streaming, /metrics flavours, fault injection.
//! - [`stats`]: the per-request histograms a real engine's `/metrics` carries.

pub mod engine;
pub mod radix;
pub mod server;
pub mod stats;
pub mod tokenizer;
