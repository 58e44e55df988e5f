//! Higress-compatible `ai-load-balancer` plugin for LLM inference traffic (proxy-wasm, ABI 0_2_100).
//!
//! Layout: `abi` (the only unsafe module: hostcalls, exported callbacks) drives `filter` (the
//! request flow / dispatcher) over the narrow [`host::Host`] trait; `policy` holds the four
//! policies; `config` the config types; `redis` RESP encoding and the Lua scripts;
//! `types` the ABI's enumerated values.
#![deny(unsafe_code)]
#![warn(missing_docs)]
// The plugin never panics on host- or client-supplied data: checked, not hoped (tests may unwrap).
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)
)]

#[cfg(all(target_arch = "wasm32", not(test)))]
pub mod abi;
pub mod config;
pub mod filter;
pub mod host;
pub mod metrics;
pub mod pairs;
pub mod policy;
pub mod redis;
pub mod types;

#[cfg(test)]
mod testutil;

#[cfg(all(test, not(target_arch = "wasm32")))]
mod lua_tests;

#[cfg(all(test, not(target_arch = "wasm32")))]
mod fuzz_tests;

#[cfg(all(test, not(target_arch = "wasm32")))]
#[path = "wasm_exports_tests.rs"]
mod wasm_exports_tests;
