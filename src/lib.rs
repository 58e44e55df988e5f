//! Higress-compatible `ai-load-balancer` plugin (placeholder while the crate is being written).
