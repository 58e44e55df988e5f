#!/usr/bin/env node
// Runs a wasm32-wasip1 test binary (or any WASI command module) in node's WASI.
// Use as cargo's runner:
//   CARGO_TARGET_WASM32_WASIP1_RUNNER="node scripts/wasm-test-runner.mjs" \
//     cargo test --target wasm32-wasip1 --profile wasm-release -p ai-load-balancer --lib
// The module gets the caller's arguments and environment, and the file system at "/" and "."
// (tests may read fixtures by absolute or relative path). The exit code is the module's.
import { readFile } from 'node:fs/promises';
import process from 'node:process';
import { WASI } from 'node:wasi';

// node prints an ExperimentalWarning for WASI on every run; it is noise in test output.
process.removeAllListeners('warning');
process.on('warning', (w) => {
  if (w.name !== 'ExperimentalWarning') console.warn(w);
});

const [wasmPath, ...args] = process.argv.slice(2);
if (!wasmPath) {
  console.error('usage: node scripts/wasm-test-runner.mjs <module.wasm> [args...]');
  process.exit(2);
}

const wasi = new WASI({
  version: 'preview1',
  args: [wasmPath, ...args],
  env: process.env,
  preopens: { '/': '/', '.': process.cwd() },
  returnOnExit: true,
});

const module = await WebAssembly.compile(await readFile(wasmPath));
const instance = await WebAssembly.instantiate(module, wasi.getImportObject());
const code = wasi.start(instance);
process.exit(code ?? 0);
