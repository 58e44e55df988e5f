//! loadgen: multi-turn and shared-prefix load for OpenAI-compatible endpoints, measured on
//! the client (TTFT from the first non-empty streamed token), with an oracle prefix hit rate
//! computed with podsim's tokenizer.

pub mod run;
pub mod stats;
pub mod workload;

pub use run::{run, GatewayChoice, RequestRecord, StickyHeader, StickyValues, Target};
pub use stats::{summarize, Summary};
pub use workload::{SessionPlan, Workload};
