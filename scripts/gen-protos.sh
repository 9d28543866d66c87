#!/usr/bin/env bash
# Regenerates the Python code of every contract under protos/: the dsec contracts into
# dsec/ (messages, gRPC stubs, mypy stubs), and E2B's envd contracts (protos/e2b, served by
# the compatibility front end) into compat/e2b/envd/gen/ (protobuf-py messages and
# connectrpc services, the generators the e2b SDK's own code comes from). The output is
# committed; the test tests/unit/test_protos_fresh.py fails when it is stale.
#   usage: scripts/gen-protos.sh [OUTPUT_DIR]   (default: the repo root)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$repo}
py=${PYTHON:-$repo/.venv/bin/python}
export PATH="$(dirname "$py"):$PATH"
cd "$repo/protos"
mapfile -t files < <(find dsec -name '*.proto' | sort)
rm -rf "$out/dsec"
mkdir -p "$out"
"$py" -m grpc_tools.protoc -I. \
  --python_out="$out" --grpc_python_out="$out" \
  --mypy_out="$out" --mypy_grpc_out="$out" \
  --descriptor_set_out="$out/.dsec-descriptors.pb" --include_imports \
  "${files[@]}"
# protoc writes modules, not packages: add the __init__.py files.
find "$out/dsec" -type d -exec sh -c 'for d; do [ -f "$d/__init__.py" ] || : > "$d/__init__.py"; done' _ {} +
printf '"""Generated protobuf and gRPC code of the dsec contracts (scripts/gen-protos.sh). Do not edit."""\n' > "$out/dsec/__init__.py"
# The in-sandbox agents decode frames without the protobuf library (memory):
# they get a compact table of the same contracts.
"$py" "$repo/scripts/gen_wire_schema.py" "$out/.dsec-descriptors.pb" "$out/dsec/wire_schema.py"
rm -f "$out/.dsec-descriptors.pb"

# E2B's envd contracts: protoc-gen-py / protoc-gen-connectrpc (PyPI, pinned in pyproject.toml
# at the versions protobuf-py / connectrpc run), no gRPC.
gen="$out/compat/e2b/envd/gen"
rm -rf "$gen"
mkdir -p "$gen"
cd "$repo/protos/e2b"
mapfile -t envd < <(find . -name '*.proto' | sed 's|^\./||' | sort)
"$py" -m grpc_tools.protoc -I. --py_out="$gen" --connectrpc_out="$gen" "${envd[@]}"
find "$gen" -type d -exec sh -c 'for d; do [ -f "$d/__init__.py" ] || : > "$d/__init__.py"; done' _ {} +
printf '"""Generated code of E2B'"'"'s envd contracts (protos/e2b, scripts/gen-protos.sh). Do not edit."""\n' > "$gen/__init__.py"
