#!/usr/bin/env bash
# Install kvguard as a service: a virtual environment in /opt/kvguard holding kvguard and
# its runtime dependencies only (no test or lint tools), the systemd unit whose ExecStart
# runs it, and the example config (kept if one is already there). Run as root from a
# checkout of this repository; safe to re-run (an upgrade).
#
#   sudo scripts/install-service.sh              # then edit /etc/kvguard/kvguard.toml and
#                                                # systemctl enable --now kvguard
#   scripts/install-service.sh --root /tmp/root  # everything under /tmp/root (a dry install:
#                                                # no systemctl; what the tests verify)
#
# Options: --root DIR (install under DIR). nvidia-ml-py (the NVML probe) is a dependency
# of kvguard, always installed; --gpu, which used to add it, is accepted and does nothing.
# /opt is not under /home or /root: the unit's ProtectHome= does not hide it, and its
# DynamicUser= can read it.
set -euo pipefail
cd "$(dirname "$0")/.."

root=""
while [ $# -gt 0 ]; do
  case "$1" in
    --root) root=${2:?--root needs a directory}; shift 2 ;;
    --gpu) echo "install-service.sh: --gpu is no longer needed: nvidia-ml-py is always installed" >&2; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "install-service.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "install-service.sh: kvguard needs Python >= 3.10; set PYTHON=/path/to/python3.10+." >&2
  exit 1
fi

prefix=/opt/kvguard
venv="$root$prefix"
unit_dir="$root/etc/systemd/system"
config_dir="$root/etc/kvguard"

"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
# Not editable, no extras: the runtime alone (nvidia-ml-py included), a copy of this checkout.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check .

mkdir -p "$unit_dir" "$config_dir"
# The unit as shipped runs $prefix/bin/kvguard: installed as it is.
install -m 0644 systemd/kvguard.service "$unit_dir/kvguard.service"
if [ ! -e "$config_dir/kvguard.toml" ]; then
  install -m 0644 systemd/kvguard.toml "$config_dir/kvguard.toml"
fi

version=$("$venv/bin/kvguard" --version | cut -d' ' -f2)
echo "install-service.sh: kvguard $version in $venv, unit $unit_dir/kvguard.service,"\
  "config $config_dir/kvguard.toml"
if [ -z "$root" ]; then
  if command -v systemctl >/dev/null 2>&1; then systemctl daemon-reload; fi
  echo "install-service.sh: set [engine] url in /etc/kvguard/kvguard.toml, then"\
    "'systemctl enable --now kvguard'"
fi
