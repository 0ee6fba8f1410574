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
# the pinned dependencies include llguidance (structured outputs), a wheel without
# dependencies; xgrammar is deliberately not one (its metadata pulls triton)
say "installing gapserve (editable) and its test dependencies"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
# helm-sdkpy (the test extra's Helm library) says Python >= 3.12 but runs on 3.11
if .venv/bin/python -c 'import sys; sys.exit(sys.version_info >= (3, 12))'; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --ignore-requires-python \
    helm-sdkpy==0.1.32
fi
say "done"
