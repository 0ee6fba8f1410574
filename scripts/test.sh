#!/usr/bin/env bash
# One command: set everything up with the test extras, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export OMP_NUM_THREADS=1
# both cores: a test file runs on one worker (its module fixtures are built once), the
# workers draw loopback ports from separate ranges (tests/ports.py)
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
