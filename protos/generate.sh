#!/usr/bin/env bash
# Regenerates the Python stubs next to the .proto files (grpcio-tools 1.84.x; see pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")"
out="${1:-.}"
python -m grpc_tools.protoc -I. --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" meshrl/v1/*.proto
