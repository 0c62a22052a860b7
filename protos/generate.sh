#!/usr/bin/env bash
# Regenerates the Python stubs next to the .proto files with grpcio-tools 1.84.0 (pinned in pyproject.toml:
# generated stubs refuse a grpcio older than the tools that made them, and the GPU image has 1.84.0).
set -euo pipefail
cd "$(dirname "$0")"
out="${1:-.}"
python -m grpc_tools.protoc -I. --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" meshrl/v1/*.proto
