#!/usr/bin/env bash
# System packages the tests use, from Debian's archive: Prometheus (with promtool) and
# Alertmanager for the scrape and alerting tests, systemd for `systemd-analyze verify`
# of the unit, nginx
# (the binary package, built with auth_request) for the gateway test of /admission.
# Needs root (CI runs as root); safe to re-run. Services the packages would start
# are kept from starting: the tests start their own, on 127.0.0.1, and stop them.
set -euo pipefail

packages=(prometheus prometheus-alertmanager systemd nginx)  # promtool comes with prometheus; systemd-analyze with systemd
missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-system.sh: ${packages[*]} already installed"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-system.sh: need root to install ${missing[*]} (apt-get); tests that need them will skip" >&2
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "install-system.sh: no apt-get here; install ${missing[*]} yourself, or tests that need them skip" >&2
  exit 0
fi

# Keep package scripts from starting services (a container has no init to run them).
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && created_policy=1
fi
trap '[ "$created_policy" = 1 ] && rm -f "$policy"' EXIT

start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
timeout 600 apt-get update -qq
timeout 900 apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-system.sh: installed ${missing[*]} in $(( $(date +%s) - start )) s"
