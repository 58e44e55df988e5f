//! testkit (placeholder)
