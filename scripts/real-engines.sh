#!/usr/bin/env bash
# Real engines for the real-engine test suites (tests/real/): vLLM for CPU and
# llama.cpp's llama-server, each in its own environment outside kvguard's .venv, with
# tiny models made offline. Everything is cached under one ignored folder
# ($KVGUARD_REAL_ENGINES, default .real-engines/ in the checkout), so a second run on
# the same machine is fast.
#
#   scripts/real-engines.sh install [vllm|llamacpp]   # both when none is named
#   scripts/real-engines.sh status
#
# Prints what it did and how long it took; fails with a clear message (not a hang)
# when a registry is unreachable.
set -euo pipefail
cd "$(dirname "$0")/.."
export KVGUARD_REAL_ENGINES="${KVGUARD_REAL_ENGINES:-$PWD/.real-engines}"
mkdir -p "$KVGUARD_REAL_ENGINES"

command="${1:-install}"
shift || true
engines=("$@")
[ ${#engines[@]} -eq 0 ] && engines=(vllm llamacpp)

case "$command" in
  install)
    for engine in "${engines[@]}"; do
      case "$engine" in
        vllm | llamacpp) ;;
        *) echo "real-engines.sh: unknown engine '$engine' (vllm or llamacpp)" >&2; exit 2 ;;
      esac
      start=$(date +%s)
      bash "scripts/real-engines/$engine.sh"
      echo "real-engines.sh: $engine ready in $(( $(date +%s) - start )) s (cache: $KVGUARD_REAL_ENGINES)"
    done
    ;;
  status)
    for engine in "${engines[@]}"; do
      if [ -f "$KVGUARD_REAL_ENGINES/$engine/READY" ]; then
        echo "$engine: installed ($(cat "$KVGUARD_REAL_ENGINES/$engine/READY"))"
      else
        echo "$engine: not installed (scripts/real-engines.sh install $engine)"
      fi
    done
    ;;
  *)
    echo "usage: scripts/real-engines.sh install|status [vllm|llamacpp]" >&2
    exit 2
    ;;
esac
