//! bench (placeholder)
