#!/usr/bin/env bash
# The project's whole check, as CI runs it: set up, lint, type-check, test.
# Extra arguments go to pytest (e.g. scripts/test.sh -k budget).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install.sh
bash scripts/install-system.sh
# The real engines (vLLM for CPU, llama.cpp) for tests/real/: minutes on a fresh
# machine, seconds once cached in .real-engines/. When a registry is unreachable the
# install says why and their tests skip with that reason; everything else still runs.
if ! bash scripts/real-engines.sh install; then
  echo "== real engines could not be installed (see above): tests/real/ will skip" >&2
fi
echo "== ruff"; .venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
echo "== pytest"; .venv/bin/pytest "$@"
