#!/usr/bin/env bash
# Regenerates shared/proto/*_pb2*.py from protos/ (pass --check to only verify).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m shared.proto.gen "$@"
