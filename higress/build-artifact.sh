#!/usr/bin/env bash
# Build the Higress marketplace artefact directory for the Rust ai-load-balancer plugin.
#
#   higress/build-artifact.sh [--build] [--wasm PATH] [--image REF] [OUT_DIR]
#   higress/build-artifact.sh WASM OUT_DIR            (the form ./build.sh package uses)
#
#   OUT_DIR      default: higress/dist
#   --wasm PATH  the compiled module (default: target/wasm32-wasip1/wasm-release/ai_load_balancer.wasm)
#   --build      run `cargo build --target wasm32-wasip1 --profile wasm-release -p ai-load-balancer` first
#   --image REF  the OCI reference written into push.sh
#                (default: $IMAGE_REF or <your-registry>/plugins/ai-load-balancer-rs:<version>)
#
# Works offline: it only copies files, tars the module and writes the `oras push` command; it never
# pushes. Layout produced (one file per OCI layer, in push order; Higress wants the module last):
#
#   spec.yaml       application/vnd.module.wasm.spec.v1+yaml
#   README.md       application/vnd.module.wasm.doc.v1+markdown      (Chinese, the marketplace default)
#   README_EN.md    application/vnd.module.wasm.doc.v1.en+markdown
#   plugin.tar.gz   application/vnd.oci.image.layer.v1.tar+gzip      (holds plugin.wasm; LAST layer)
#
# plus files that are not pushed: layers.txt (the list above), push.sh (the oras command),
# plugin.wasm (so the directory is also the `docker build` context of higress/Dockerfile) and
# SHA256SUMS (WasmPlugin.spec.sha256 for file:// or http(s):// installs).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WASM="$ROOT/target/wasm32-wasip1/wasm-release/ai_load_balancer.wasm"
OUT=""
BUILD=0
IMAGE="${IMAGE_REF:-}"
POS=()

die() { echo "build-artifact: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=1 ;;
    --wasm) [ $# -ge 2 ] || die "--wasm needs a path"; WASM="$2"; shift ;;
    --image) [ $# -ge 2 ] || die "--image needs a reference"; IMAGE="$2"; shift ;;
    -h|--help) sed -n '2,23p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) POS+=("$1") ;;
  esac
  shift
done
case "${#POS[@]}" in
  0) ;;
  1) OUT="${POS[0]}" ;;
  2) WASM="${POS[0]}"; OUT="${POS[1]}" ;;
  *) die "too many arguments (see --help)" ;;
esac
OUT="${OUT:-$ROOT/higress/dist}"
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac

# The marketplace version comes from spec.yaml; it must match the crate so images are not mislabelled.
VERSION="$(sed -n 's/^  version: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "$ROOT/higress/spec.yaml" | head -n1)"
CRATE_VERSION="$(sed -n '/^\[package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -n1)"
[ -n "$VERSION" ] || die "no info.version in higress/spec.yaml"
[ "$VERSION" = "$CRATE_VERSION" ] || die "higress/spec.yaml info.version $VERSION != Cargo.toml version $CRATE_VERSION"
IMAGE="${IMAGE:-<your-registry>/plugins/ai-load-balancer-rs:$VERSION}"

if [ "$BUILD" = 1 ]; then
  (cd "$ROOT" && cargo build --target wasm32-wasip1 --profile wasm-release -p ai-load-balancer)
fi
[ -f "$WASM" ] || die "no wasm module at $WASM (build it: cargo build --target wasm32-wasip1 --profile wasm-release -p ai-load-balancer, or pass --build)"
# A wrong file here would only show up as a load failure inside Envoy, so check the wasm magic now.
[ "$(head -c 4 "$WASM" | od -An -tx1 | tr -d ' \n')" = "0061736d" ] || die "$WASM is not a WebAssembly module"

mkdir -p "$OUT"
# Only our own file names are replaced; anything else a user keeps in OUT_DIR is left alone.
rm -f "$OUT/spec.yaml" "$OUT/README.md" "$OUT/README_EN.md" "$OUT/plugin.tar.gz" "$OUT/plugin.wasm" \
      "$OUT/layers.txt" "$OUT/push.sh" "$OUT/SHA256SUMS"

cp "$ROOT/higress/spec.yaml" "$OUT/spec.yaml"
cp "$ROOT/higress/README.md" "$OUT/README.md"
cp "$ROOT/higress/README_EN.md" "$OUT/README_EN.md"
cp "$WASM" "$OUT/plugin.wasm"
# Reproducible tarball: fixed owner, mtime and order, gzip without a timestamp.
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime='@0' --mode='a+r,u+w,go-w' \
    -C "$OUT" -cf - plugin.wasm | gzip -n -9 > "$OUT/plugin.tar.gz"

cat > "$OUT/layers.txt" <<'EOF'
spec.yaml:application/vnd.module.wasm.spec.v1+yaml
README.md:application/vnd.module.wasm.doc.v1+markdown
README_EN.md:application/vnd.module.wasm.doc.v1.en+markdown
plugin.tar.gz:application/vnd.oci.image.layer.v1.tar+gzip
EOF

{
  echo '#!/usr/bin/env bash'
  echo '# Publish this directory as a Higress Wasm plugin image. NOT run by the build: needs oras >= 1.0'
  echo '# and `oras login <registry>` first. Run it from this directory; layer order matters'
  echo '# (plugin.tar.gz last).'
  echo 'set -euo pipefail'
  echo 'cd "$(dirname "${BASH_SOURCE[0]}")"'
  printf "oras push '%s'" "$IMAGE"
  while IFS= read -r layer; do printf ' \\\n  ./%s' "$layer"; done < "$OUT/layers.txt"
  echo
} > "$OUT/push.sh"
chmod +x "$OUT/push.sh"

(cd "$OUT" && sha256sum plugin.wasm plugin.tar.gz > SHA256SUMS)

echo "artefact directory: $OUT"
(cd "$OUT" && ls -l spec.yaml README.md README_EN.md plugin.tar.gz)
echo
echo "to publish (not run here):"
sed -n '/^oras push/,$p' "$OUT/push.sh"
echo
echo "plain OCI image (FROM scratch, only /plugin.wasm):"
echo "  docker build -f $ROOT/higress/Dockerfile -t ai-load-balancer-rs:$VERSION $OUT"
