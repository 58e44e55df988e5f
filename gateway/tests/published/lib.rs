//! Only here so that `cargo metadata` resolves the pinned proxy-wasm package.
