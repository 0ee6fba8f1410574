#!/usr/bin/env bash
# One command: set everything up (virtualenv, the default model), then serve it:
#   scripts/serve.sh [gapserve serve flags]   e.g. --http-port 8080 --max-num-seqs 64
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m shared.default_model  # converts the default model once
exec .venv/bin/gapserve serve "$@"
