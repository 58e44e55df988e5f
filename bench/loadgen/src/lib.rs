//! loadgen (placeholder)
