#!/usr/bin/env bash
# The torch engine's decode attention on the GPU host, in one command (issue 15, item 3): the gpu-marked tests of
# tests/test_cuda_decode.py (FlashAttention's varlen kernel against the masked attention, CUDA-graph capture, bf16
# at the 0.5B head shapes, the fused step), then bench/engine.py on the headline's long-tailed lengths at batch 256:
# sdpa and flash_varlen, each unfused and fused (rollout_engine.decode_compile), and where each one's decode
# step time goes (--profile: graph replay time, kernels a step, their summed device time).
#
# Needs the bus's wheels in /tmp/site (scripts/gpu-host/gpu_smollm2.sh or scripts/gpu-host/gpu_headline.sh installs them) or
# importable otherwise. Run from the repository root:  bash scripts/gpu-host/gpu_decode_check.sh
# Output: $OUT (default ./gpu_logs)/cuda_decode_tests.log and engine_longtail.log.
set -uo pipefail
cd "$(dirname "$0")/../.."     # the repository root
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
rc=0
timeout 240 python3 -m pytest -q --noconftest -p no:cacheprovider -m gpu tests/test_cuda_decode.py 2>&1 \
    | tee "$OUT/cuda_decode_tests.log" || rc=1
timeout "${ENGINE_TIMEOUT:-300}" python3 bench/engine.py --no-hf --longtail --batches 256 --variants \
    --rows engine "engine flash_varlen" "engine sdpa+compile" "engine flash_varlen+compile" --profile 2>&1 \
    | tee "$OUT/engine_longtail.log" || rc=1
exit "$rc"
