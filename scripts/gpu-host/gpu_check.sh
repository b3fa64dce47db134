#!/usr/bin/env bash
# The GPU check, in one command on a CUDA host: the torch engine's CUDA tests (static-cache decode
# replayed as CUDA graphs, weight handoff over CUDA IPC), then bench/engine.py (engine tokens/s beside
# transformers' generate at batch 64 and 256, and the logprob check). About 3-4 minutes on an H200,
# at most 9 (every step has a timeout).
#
# Run from the repository root:  bash scripts/gpu-host/gpu_check.sh
# Needs python3 with torch, numpy, msgpack, transformers and pytest; no pyzmq (hence --noconftest:
# tests/conftest.py is the bus tests' and imports zmq). Logs go to $OUT (default ./gpu_logs).
# Exit status: 0 when the tests and the benchmark all passed.
set -uo pipefail
cd "$(dirname "$0")/../.."     # the repository root
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0

{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__)"; } 2>&1 | tee "$OUT/env.txt"

# -rs lists why anything skipped (a gpu test skipping here means CUDA was not seen).
timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider -rs \
    tests/test_cuda_decode.py tests/test_torch_engine.py tests/test_weights_cuda.py 2>&1 | tee "$OUT/pytest.log" \
    || status=1

# --variants adds the matmul-attention, eager (no graphs) and gather rows beside the default.
if ! timeout 270 python3 bench/engine.py --variants 2>&1 | tee "$OUT/bench_engine.log"; then
    status=1
    echo "bench/engine.py failed: once more without CUDA graphs, for numbers at least" | tee -a "$OUT/bench_engine.log"
    timeout 100 python3 bench/engine.py --no-graphs --batches 256 2>&1 | tee "$OUT/bench_engine_no_graphs.log"
fi
grep -h "^RESULT\|passed\|failed" "$OUT/pytest.log" "$OUT/bench_engine.log" | tail -n 5
exit $status
