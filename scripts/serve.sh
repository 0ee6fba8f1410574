#!/usr/bin/env bash
# One command: set everything up (virtualenv, the default model), then serve it:
#   scripts/serve.sh [gapserve serve flags]   e.g. --http-port 8080 --max-num-seqs 64
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "gapserve serve.sh: preparing the default model (converted once into ~/.cache/gapserve)" >&2
.venv/bin/python -m shared.default_model  # converts the default model once
echo "gapserve serve.sh: starting the services (the worker loads the model first)" >&2
exec .venv/bin/gapserve serve "$@"
