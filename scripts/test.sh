#!/usr/bin/env bash
# Install (scripts/setup.sh), lint, and run the whole test suite, end-to-end Triton tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The suite builds and tests the native CPU kernels (plugins/native.py): they need a C compiler. The
# engine itself falls back to torch without one; the tests must not silently skip them instead.
if ! command -v "${CC:-cc}" >/dev/null; then
    echo "scripts/test.sh: no C compiler (${CC:-cc}); install gcc (e.g. apt-get install gcc) or set CC" >&2
    exit 1
fi
# Lint before the tests (seconds): ruff ([tool.ruff] in pyproject.toml) and the architecture contract
# ([tool.importlinter]). Either failing fails the run.
.venv/bin/ruff check .
.venv/bin/lint-imports
exec .venv/bin/python -m pytest -q "$@"
