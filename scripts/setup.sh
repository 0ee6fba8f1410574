#!/usr/bin/env bash
# Sets up .venv for serving or for testing:
#   scripts/setup.sh [serve|test]     (default serve)
#   scripts/setup.sh --decide MODE    prints install or skip, changes nothing
# serve: the CPU build of torch and the project (editable) with its `dependencies` only.
# test:  that plus the test extras (pytest, triton, the Helm/Kubernetes validators, ...).
# A stamp (.venv/.gapserve-stamp: the install mode and pyproject.toml's hash) skips pip
# entirely when the environment is installed and unchanged; a test install satisfies
# serve too. Each stage says what it installs and roughly how long it takes, and a
# line every 20 s says pip is still at work.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${GAPSERVE_VENV:-.venv}
STAMP="$VENV/.gapserve-stamp"
say() { echo "gapserve setup: $*" >&2; }

project_hash() { sha256sum pyproject.toml | cut -d' ' -f1; }

# The one rule for skipping pip: the stamp names this pyproject.toml and a mode at
# least as full as the one asked for (test includes serve).
decide() {
  local mode=$1 stamped
  [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] || { echo install; return; }
  stamped=$(cat "$STAMP")
  if [ "$stamped" = "test $(project_hash)" ] || [ "$stamped" = "$mode $(project_hash)" ]; then
    echo skip
  else
    echo install
  fi
}

# Runs pip quietly with a heartbeat, so a long download is never minutes of silence.
pip_step() {
  local start=$SECONDS
  # sleep holds no pipe open (a caller reading our output would wait out its 20 s)
  ( while sleep 20 >/dev/null 2>&1 </dev/null; do say "  ... still installing ($((SECONDS - start)) s)"; done ) &
  local beat=$!
  local rc=0
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" || rc=$?
  kill "$beat" 2>/dev/null; wait "$beat" 2>/dev/null || true
  [ $rc -eq 0 ] && say "  done in $((SECONDS - start)) s"
  return $rc
}

if [ "${1:-}" = "--decide" ]; then
  decide "${2:-serve}"
  exit 0
fi
MODE=${1:-serve}
case "$MODE" in serve|test) ;; *) say "unknown mode '$MODE' (serve or test)"; exit 2;; esac

if [ "$(decide "$MODE")" = skip ]; then
  say "environment up to date for $MODE ($STAMP matches pyproject.toml): pip skipped"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  say "creating the virtual environment in $VENV"
  "$PY" -m venv "$VENV"
fi
rm -f "$STAMP"  # an interrupted install leaves no stamp behind
say "installing torch 2.13.0, CPU build (~200 MB: about two minutes on a first run, seconds when installed)"
pip_step torch==2.13.0
if [ "$MODE" = serve ]; then
  # the pinned dependencies include llguidance (structured outputs), a wheel without
  # dependencies; xgrammar is deliberately not one (its metadata pulls triton)
  say "installing gapserve (editable) and its serving dependencies (transformers, grpcio, fastapi, ...: two or three minutes on a first run)"
  pip_step -e .
else
  say "installing gapserve (editable) with its test extras (pytest, triton, Helm/Kubernetes validators, routers: ~1.3 GB, several minutes on a first run)"
  pip_step -e '.[test]'
  # pyproject.toml's [tool.gapserve.setup] test-no-deps (one line): test packages whose
  # metadata caps a library below the test extra's pins (the reasons are noted there)
  no_deps=$(sed -n 's/^test-no-deps = \[\(.*\)\]$/\1/p' pyproject.toml | tr -d '",')
  if [ -n "$no_deps" ]; then
    say "installing $no_deps without its dependencies (pyproject.toml [tool.gapserve.setup])"
    # shellcheck disable=SC2086  # one argument per package
    pip_step --no-deps $no_deps
  fi
  # helm-sdkpy (the test extra's Helm library) says Python >= 3.12 but runs on 3.11
  if "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info >= (3, 12))'; then
    pip_step --ignore-requires-python helm-sdkpy==0.1.32
  fi
fi
echo "$MODE $(project_hash)" > "$STAMP"
say "done: $VENV ready for $MODE"
