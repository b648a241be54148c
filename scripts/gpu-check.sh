#!/usr/bin/env bash
# The GPU check (docs/gpu-check.md): kvguard's NVML probe and GPU exhaustion forecast
# against a real GPU running out of memory, or against the fake NVML with --fake.
#
#   bash scripts/gpu-check.sh [--fake] [--out DIR] [--fill-s S] [--device N]
#
# Creates (or reuses) a venv, installs kvguard from this checkout into it without
# the internet, and runs bench/gpu_check.py under a hard time limit. Exit status is
# the driver's: 0 every check passed, 1 a check failed, 2 the check could not run
# (124/137: the hard limit killed it).
#
# Environment:
#   KVGUARD_GPU_CHECK_OUT      results folder (default: a new folder under $TMPDIR)
#   KVGUARD_WHEELS             a folder of wheels: pip installs from it with
#                              --no-index --find-links (docs/gpu-check.md lists them)
#   KVGUARD_GPU_CHECK_VENV     the venv (default: $TMPDIR/kvguard-gpu-check-venv); made
#                              with --system-site-packages so the machine's PyTorch is used
#   KVGUARD_PYTHON             use this Python as it is (kvguard's dependencies
#                              importable); no venv, no install (CI's fake run)
#   KVGUARD_GPU_CHECK_TIMEOUT  hard limit of the driver in seconds (default 450)
#
# pip is only ever run with --no-index: this script never reaches for the internet.
# It never touches GPU settings (clocks, power limits, compute mode, MIG) and never
# resets a GPU; the driver only allocates memory through PyTorch and frees it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
tmp="${TMPDIR:-/tmp}"

deps_import() {
  "$1" -c 'import aiohttp, prometheus_client, psutil, pynvml, structlog' 2>/dev/null
}

if [[ -n "${KVGUARD_PYTHON:-}" ]]; then
  python="$KVGUARD_PYTHON"
  if ! deps_import "$python"; then
    echo "gpu-check: $python cannot import kvguard's dependencies" \
      "(aiohttp, prometheus_client, psutil, pynvml, structlog)" >&2
    exit 2
  fi
else
  venv="${KVGUARD_GPU_CHECK_VENV:-$tmp/kvguard-gpu-check-venv}"
  if [[ ! -x "$venv/bin/python" ]]; then
    echo "== creating $venv (with the system's site packages: PyTorch is used as installed)"
    python3 -m venv --system-site-packages "$venv"
  fi
  python="$venv/bin/python"
  pip_args=(--no-index --disable-pip-version-check --no-input --quiet)
  if [[ -n "${KVGUARD_WHEELS:-}" ]]; then
    if [[ ! -d "$KVGUARD_WHEELS" ]]; then
      echo "gpu-check: KVGUARD_WHEELS=$KVGUARD_WHEELS is not a folder" >&2
      exit 2
    fi
    pip_args+=(--find-links "$KVGUARD_WHEELS")
  fi
  log="$tmp/kvguard-gpu-check-pip.log"
  echo "== installing kvguard from $root (offline; pip log: $log)"
  # Build isolation fetches hatchling from the wheels folder; without one, the
  # venv's own hatchling (from the system's site packages) builds it.
  if ! "$python" -m pip install "${pip_args[@]}" "$root" >"$log" 2>&1 &&
    ! "$python" -m pip install "${pip_args[@]}" --no-build-isolation "$root" >>"$log" 2>&1; then
    tail -n 5 "$log" >&2
    echo "gpu-check: cannot install kvguard offline. Bring the wheels listed in" \
      "docs/gpu-check.md and set KVGUARD_WHEELS to their folder." >&2
    exit 2
  fi
fi

# The driver runs from the checkout (python -m puts it first on sys.path), so the
# code checked is this checkout's, whatever else is installed.
exec timeout --kill-after=15 "${KVGUARD_GPU_CHECK_TIMEOUT:-450}" \
  "$python" -m bench.gpu_check "$@"
