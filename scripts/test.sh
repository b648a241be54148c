#!/usr/bin/env bash
# The project's whole check, as CI runs it: set up, lint, type-check, test.
# Extra arguments go to pytest (e.g. scripts/test.sh -k budget).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install.sh
bash scripts/install-system.sh
echo "== ruff"; .venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
echo "== pytest"; .venv/bin/pytest "$@"
