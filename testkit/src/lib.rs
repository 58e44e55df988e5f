//! Fixtures for the end-to-end tests of the compiled plugin in the gateway host.
//!
//! - [`redis`]: a real Redis server, through testcontainers when a Docker engine is reachable
//!   (image `ai-lb-redis:local`, built by `testkit/redis-image.sh`), otherwise a local
//!   `redis-server` process; plus a small RESP client for assertions.
//! - [`redis_cluster`]: a real 3-master Redis Cluster of local `redis-server` processes, with slot
//!   moves and failovers.
//! - [`gateway`]: writes a gateway YAML config, spawns `target/release/gateway`, parses its
//!   `LISTENING`/`ADMIN`/`READY` lines and wraps the admin API.
//! - [`pod`]: small recording upstream "inference pods" (chat completions, `/metrics`, `/health`)
//!   whose behaviour (latency, holding requests open, 5xx, metrics text) the test controls.
//! - [`http`]: a minimal HTTP/1.1 client with per-request timeouts and client-abort helpers.
//! - [`samples`]: Prometheus texts as vLLM V0, vLLM V1 and SGLang expose them.
//!
//! Everything binds to loopback on free ports so tests can run in parallel.

pub mod gateway;
pub mod http;
pub mod paths;
pub mod pod;
pub mod redis;
pub mod redis_cluster;
pub mod samples;

pub use gateway::{Gateway, GatewayConfig};
pub use http::{HttpRequest, HttpResponse};
pub use pod::{Pod, Recorded};
pub use redis::{RedisClient, RedisFixture, RedisValue};
pub use redis_cluster::RedisClusterFixture;
