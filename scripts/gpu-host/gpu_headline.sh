#!/usr/bin/env bash
# Issue 15's table on one GPU (the lent H200 host, which lacks pyzmq and friends: they come as wheels in
# .whl, made here by `bash scripts/gpu-host/host_wheels.sh`, as for scripts/gpu-host/gpu_e2e.sh): the
# longtail workload (one turn, outputs lognormal median 500 clipped 200..3000, eos ignored) at the
# Qwen2-0.5B shape, global batch 128, trigger 64 (half the batch), in ONE bench/gpu_e2e.py invocation:
#
#     sync                       the baseline (staleness and the drop policy do not apply)
#     async staleness 2, drop    staleness.drop_at_consume true (today's default)
#     async staleness 2, keep    staleness.drop_at_consume false (AReaL's admission-only bound)
#     async staleness 4, drop
#
# each with samples/s, tokens/s, the ratio over sync, trainer busy, the rollout engine's running batch
# over time, drops, over_bound and the staleness histogram; each run's records and series saved as JSON.
#
# Run from the repository root (the device tool: carry [".whl"]; about 7-9 minutes):
#     bash scripts/gpu-host/gpu_headline.sh
#     ENGINE=vllm bash scripts/gpu-host/gpu_headline.sh
#         (vLLM, once scripts/gpu-host/gpu_vllm.sh has installed it into /tmp/site: a second command, it
#         does not fit in the first's 10 minutes)
#     SHAPE=1.5b RUNS="sync async:2:true" bash scripts/gpu-host/gpu_headline.sh
#     RUNS="sync async:2:true async:2:per_token async:2:false" bash scripts/gpu-host/gpu_headline.sh
#         (the three over-stale policies: drop, staleness.per_token, keep)
#     RUNS="sync async:2:true async:2:true:bound:in_order" bash scripts/gpu-host/gpu_headline.sh
#         (staleness.in_order against arrival order, the speed side of the SmolLM2 runs)
#     STEPS=5 SKIP=1 RUNS="sync async:2:true sync:::::sdpa async:2::::sdpa" bash scripts/gpu-host/gpu_headline.sh
#         (the default decode step, flash_varlen fused by torch.compile on a GPU, against sdpa unfused; each
#         async ratio over the sync of its attention; "sdpa+compile", "flash_varlen" the two apart)
# STEPS and SKIP default to 10 and 4: an asynchronous run's first updates after the warm-up drain a backlog
# rollout built while the first update compiled, so fewer counted updates read faster than the run goes on
# (bench/gpu_e2e.py prints "not steady" under such a row; 2026-12-06 at staleness 2: 3.8-4.2x over updates 2-5,
# 2.76x over updates 5-10). The shorter STEPS=5 SKIP=1 examples above are what earlier tables ran.
# Knobs (environment): ENGINE torch|vllm, SHAPE 0.5b|1.5b, RUNS, STEPS (10), SKIP (4), AGENTS (4), EXTRA
# (more bench/gpu_e2e.py arguments), HEADLINE_TIMEOUT (560 s, the whole), RUN_TIMEOUT (300 s, each run).
# Output: $OUT (default ./gpu_logs)/headline.log and headline/<run>.json.
set -uo pipefail
cd "$(dirname "$0")/../.."     # the repository root
OUT=${OUT:-gpu_logs}
ENGINE=${ENGINE:-torch}
SHAPE=${SHAPE:-0.5b}
RUNS=${RUNS:-sync async:2:true async:2:false async:4:true}
mkdir -p "$OUT" /tmp/site/bin
if ! python3 -c "import zmq, pydantic, structlog, supervisor" 2>/dev/null; then
    ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/*.whl: run bash scripts/gpu-host/host_wheels.sh where a registry is reachable, and carry .whl" >&2; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
printf '#!/usr/bin/env python3\nimport sys\nfrom areal_bus.launch.cli import main\nsys.exit(main())\n' > /tmp/site/bin/areal-bus
chmod +x /tmp/site/bin/areal-bus
if [ "$ENGINE" = vllm ]; then
    export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ATTENTION_BACKEND=FLASH_ATTN  # as scripts/gpu-host/gpu_vllm.sh: no flashinfer there
    python3 -c "import vllm" 2>/dev/null || { echo "vllm is not importable: install it with scripts/gpu-host/gpu_vllm.sh first" >&2; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1
# shellcheck disable=SC2086
timeout "${HEADLINE_TIMEOUT:-560}" python3 bench/gpu_e2e.py --workload longtail --shape "$SHAPE" --engine "$ENGINE" \
    --batch 128 --trigger 64 --agents "${AGENTS:-4}" --steps "${STEPS:-10}" --skip "${SKIP:-4}" \
    --timeout "${RUN_TIMEOUT:-300}" --save "$OUT/headline" --runs $RUNS ${EXTRA:-} 2>&1 | tee "$OUT/headline.log"
exit "${PIPESTATUS[0]}"
