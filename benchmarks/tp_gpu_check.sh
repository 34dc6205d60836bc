#!/usr/bin/env bash
# Tensor-parallel decode throughput on CUDA: TP=2 vs TP=1 (benchmarks/tp_decode_bench.py),
# plus the parallel worker tests. Needs 2 GPUs for TP=2 (NCCL puts one rank on each GPU and
# refuses two ranks on one); with a single GPU it measures TP=1 only and says so.
# Usage: bash benchmarks/tp_gpu_check.sh   (a few minutes)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH=.

echo "== environment"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
echo "visible GPUs: $GPUS"
if [[ "$GPUS" -lt 1 ]]; then
  echo "no CUDA device visible to torch; nothing to check"
  exit 1
fi

echo "== parallel worker tests (gloo on CPU; the replica logic the GPU run uses)"
"$PYTHON" -m pytest -q -p no:cacheprovider tests/worker/test_worker_parallel_replica.py \
  tests/worker/test_worker_sharding.py

echo "== decode throughput of the default model (its float32 checkpoint), batch 16 and 64"
if [[ "$GPUS" -ge 2 ]]; then TP_SIZES="1 2"; else TP_SIZES="1"; echo "(1 GPU: TP=2 pending a 2-GPU machine)"; fi
for BATCH in 16 64; do
  # shellcheck disable=SC2086
  "$PYTHON" benchmarks/tp_decode_bench.py --device cuda --tp $TP_SIZES --batch "$BATCH" --new-tokens 64
done
