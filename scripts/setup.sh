#!/usr/bin/env bash
# Create .venv (if needed) and install trtforge with everything the tests and the quickstart use,
# pinned by constraints/dev.txt (CPU torch). Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints/dev.txt -e ".[dev]"
# NVIDIA Dynamo's Python package without its dependency list (its planner's `aisimulate` is served
# only by NVIDIA's index); what `trtforge dynamo-worker` needs of it comes with the `dynamo` extra.
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints/dev.txt --no-deps ai-dynamo
