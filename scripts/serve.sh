#!/usr/bin/env bash
# One command: set up what serving needs (virtualenv, no test extras; pip is skipped
# when nothing changed), prepare the default model once, then serve:
#   scripts/serve.sh [MODEL] [gapserve serve flags]   e.g. --port 8080 --max-num-seqs 64
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh serve
# fetches the default model's GGUF once into ~/.cache/gapserve; quick after
.venv/bin/python -m shared.model_files.default_model >/dev/null
echo "gapserve serve.sh: starting the services (the worker loads the model first)" >&2
exec .venv/bin/gapserve serve "$@"
