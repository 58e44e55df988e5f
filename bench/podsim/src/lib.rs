//! podsim (placeholder)
