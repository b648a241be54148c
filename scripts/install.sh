#!/usr/bin/env bash
# Set kvguard up on a fresh machine: a virtual environment in .venv holding kvguard
# (editable), its runtime dependencies, uvloop (the `fast` extra), and the test and lint tools.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "install.sh: kvguard needs Python >= 3.10; '$python' is $("$python" --version 2>&1 || echo missing)." >&2
  echo "install.sh: set PYTHON=/path/to/python3.10+ and run again." >&2
  exit 1
fi

if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test,dev,fast]'
echo "install.sh: kvguard $(.venv/bin/kvguard --version | cut -d' ' -f2) is in .venv (run .venv/bin/kvguard --help)"
