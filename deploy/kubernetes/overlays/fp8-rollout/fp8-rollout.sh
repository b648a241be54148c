#!/bin/sh
# kvguard's command-mode fp8 switch for Kubernetes (deploy/kubernetes/overlays/fp8-rollout).
# kvguard runs it with KVGUARD_ACTION (kv_fp8 or revert_kv_fp8) and
# KVGUARD_KV_CACHE_DTYPE (fp8, or auto to revert) in the environment.
#
# Setting the env var changes the pod template: Kubernetes rolls every replica to the
# new --kv-cache-dtype, one pod at a time (maxUnavailable 1). The same value twice is
# no change and no rollout, so replicas asking at once cause one rollout. The wait
# ends when this pod is replaced (kvguard is stopped with it) or the rollout is done.
set -eu
deployment="${KVGUARD_DEPLOYMENT:-vllm}"
kubectl set env "deployment/${deployment}" -c vllm \
  "VLLM_KV_CACHE_DTYPE=${KVGUARD_KV_CACHE_DTYPE}"
exec kubectl rollout status "deployment/${deployment}" --timeout=1700s
