#!/usr/bin/env bash
# One command: set everything up with the test extras, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest -q "$@"
