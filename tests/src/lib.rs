//! e2e (placeholder)
