#!/usr/bin/env bash
# Issue 30 in one go on the 1-GPU host (tests/gpu/README.md §7): bench.gpu_ipc (8B shape, 2
# replicas, breakdown, restart, rolling, negative controls), then bench.gpu_trl (TRL from GPU
# memory, a replica tainted mid-run), then the two-process IPC test. Each step writes into DIR
# as it ends (a later step failing loses nothing); DIR/done marks the end. From the project
# root, after `source tests/gpu/gpu_env.sh`:   bash tests/gpu/ipc_all.sh DIR
set -u
D=${1:?usage: ipc_all.sh DIR}
mkdir -p "$D"
export ROLLOUTPOOL_GPU=1 CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
step() {
  local name=$1 t0=$SECONDS rc
  shift
  echo "== $name $(date +%T)"
  "$@" >"$D/$name.log" 2>&1
  rc=$?
  echo "== $name rc=$rc $((SECONDS - t0)) s"
}
step ipc timeout 560 python3 -m bench.gpu_ipc --out "$D/ipc.json" --vllm-cycles 0 --budget-s 480
nvidia-smi --query-gpu=memory.used --format=csv,noheader
step trl timeout 420 python3 -m bench.gpu_trl --raw "$D/trl_mem.json" --out "$D/trl_grpo_gpu.json"
step pytest timeout 120 python3 -m pytest -m gpu tests/gpu/test_ipc_gpu.py -p no:cacheprovider -q \
  -W ignore::pytest.PytestConfigWarning  # the host has no pytest-asyncio for its ini options
touch "$D/done"
