#!/usr/bin/env bash
# Sets up everything on a fresh machine: a virtual environment in .venv with the
# CPU build of torch and the project (editable) with its test extras. pip stays
# quiet (-q); a line per stage says what the wait is for.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "gapserve setup: $*" >&2; }
if [ ! -x .venv/bin/python ]; then
  say "creating the virtual environment in .venv"
  "$PY" -m venv .venv
fi
say "installing torch 2.13.0 (about a minute on a first run; quick when present)"
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
say "installing gapserve (editable) and its test dependencies"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
say "done"
