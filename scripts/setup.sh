#!/usr/bin/env bash
# Sets up everything on a fresh machine: a virtual environment in .venv with the
# CPU build of torch and the project (editable) with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
# helm-sdkpy (the test extra's Helm library) says Python >= 3.12 but runs on 3.11
if .venv/bin/python -c 'import sys; sys.exit(sys.version_info >= (3, 12))'; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --ignore-requires-python \
    helm-sdkpy==0.1.32
fi
