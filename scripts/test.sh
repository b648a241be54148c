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
echo "== lint-imports"; .venv/bin/lint-imports --no-cache
# Two stages, both run every time (a failure in the first does not skip the second;
# the first failure's exit code is the script's): the default suite (a few minutes:
# `.venv/bin/pytest -m "not slow and not real_engine"` while developing), then the
# long runs: soaks, benchmark smoke runs, efficacy runs and the real engines. Extra
# arguments go to both stages (a `-m` of yours replaces the stage's).
ran=0
failed=0
stage() {
  local code=0
  .venv/bin/pytest "$@" || code=$?
  case "$code" in
    0) ran=$((ran + 1)) ;;
    5) ;; # nothing selected: extra arguments may pick tests of one stage only
    *) ran=$((ran + 1)); if [ "$failed" -eq 0 ]; then failed=$code; fi ;;
  esac
}
echo "== pytest: default suite"; stage -m "not slow and not real_engine" "$@"
echo "== pytest: slow and real-engine suites"; stage -m "slow or real_engine" "$@"
if [ "$failed" -ne 0 ]; then exit "$failed"; fi
if [ "$ran" -eq 0 ]; then echo "== no test was selected" >&2; exit 5; fi
