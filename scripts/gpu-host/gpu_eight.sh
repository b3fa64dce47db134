#!/usr/bin/env bash
# Issue 53 ("Eight GPUs") on a multi-GPU kind (nvidia-h100-x8, or -x4 / -x2, or the h200 ones; ask `status`
# first): the trainer's dp scaling, the seed's layout (half the GPUs rollout workers, half a sharded trainer)
# async against sync beside the one-GPU figure, and the weights from the trainer to every rollout GPU. Each
# step fits one device call (10 minutes at most); run them in any order, any subset, e.g.
#
#   step          what it runs                                                                    expected
#   nccl          bench/nccl_bw.py: all-gather / all-reduce between the host's GPUs                 ~20 s
#   weights       bench/weights_cuda.py at 1.5B (3.1 GB): trainer on GPU 0, a receiver on each of    ~2 min
#                 GPUs 1..N/2, then on each of 1..N-1, copying every version into its own GPU
#   trainer S     bench/trainer_parallel.py --shape S (1.5b, 8b) on long-tailed rows (lognormal     1.5b ~4 min
#                 median 500, 200..3000, 128 rows an update): dp 1, 2, 4, 8 (FSDP2, up to the      8b ~8 min
#                 host's GPUs): tokens/s, MFU, scaling efficiency per GPU, loss parity with the first
#                 layout; 8b: gradient checkpointing, full fine-tuning from dp 4 on 80 GB cards, dp 2 on
#                 H200 (float32 masters, gradients and AdamW of 8B are 128 GB, split over the ranks)
#   lora S        the same with LoRA r16 (8b: from dp 1)                                             8b ~7 min
#   one S         bench/gpu_e2e.py --shape S, long tail, sync then async (staleness 2, trigger half  ~4 min
#                 the batch), rollout and trainer sharing GPU 0: the one-GPU figure
#   half S        the same workload in the seed's layout: N/2 rollout workers on GPUs 0..N/2-1      ~5 min
#                 (nodes.rollout.gpus), a dp N/2 trainer on the others (nodes.trainer.gpus); then
#                 each rollout worker's per-version copy (weights_copied: bytes, seconds) from its log
#   system S      one S, then half S (one call: the same card for both; ~9 min at 1.5b)
#   (8b in one / half / system: LoRA r16, gradient checkpointing, lengths median 250 up to 1000, as issue 51)
#
# The calls (from the repository root; first, HERE: `bash scripts/gpu-host/host_wheels.sh`, which makes .whl/
# with the bus's wheels: pydantic, pyzmq, structlog, supervisor ...):
#   1. run(kind="nvidia-h100-x8", carry=[".whl"], command="bash scripts/gpu-host/gpu_eight.sh nccl weights trainer 1.5b")
#   2. the machine still warm, carry nothing:  bash scripts/gpu-host/gpu_eight.sh system 1.5b
#   3. bash scripts/gpu-host/gpu_eight.sh trainer 8b     4. ... lora 8b     5. ... system 8b (or one 8b, half 8b)
# The wheels go to /tmp/site, which lasts while the machine stays warm; a cold one needs .whl carried again.
#
# Knobs (environment): STEPS (gpu_e2e updates per run, 8), E2E_ARGS (more bench/gpu_e2e.py arguments),
# TRAINER_ARGS (more bench/trainer_parallel.py arguments), E2E_TIMEOUT (seconds per gpu_e2e invocation, 280).
# Logs go to $OUT (default gpu_logs): one per step, and each gpu_e2e run's log folder under $OUT/e2e-*.
# NVLink multicast stays off in every process (the device notes say why).
set -uo pipefail
cd "$(dirname "$0")/../.."     # the repository root
OUT=${OUT:-gpu_logs}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT" /tmp/site/bin
if [ -d "$WHEELS" ]; then  # installed once; a later call on the warm machine carries none
    find "$WHEELS" -type f -name '*.whl' -print0 | xargs -0 -r python3 -m pip install -q --no-index --no-deps \
        --no-compile --no-cache-dir --upgrade --target /tmp/site || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
printf '#!/usr/bin/env python3\nimport sys\nfrom areal_bus.launch.cli import main\nsys.exit(main())\n' > /tmp/site/bin/areal-bus
chmod +x /tmp/site/bin/areal-bus

N=$(nvidia-smi -L | wc -l)
HALF=$((N / 2))
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
STEPS=${STEPS:-8}
seq_list() { seq -s, "$1" "$2"; }                        # 1 3 -> 1,2,3
layouts() {                                              # first dp (1 or 2) -> "1x1,2x1,4x1,8x1" up to N
    local out="" dp=$1
    while [ "$dp" -le "$N" ]; do out="$out${out:+,}${dp}x1"; dp=$((dp * 2)); done
    echo "$out"
}
echo "# gpu_eight: $N GPUs ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)), $(date -u +%FT%TZ)"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1

e2e_args() {  # the workload of shape $1, the same for the one-GPU and the half/half layouts
    local shape=$1
    local args=(--shape "$shape" --workload longtail --runs sync async:2:true --steps "$STEPS" --skip 2 --agents 4)
    [ "$shape" = 8b ] && args+=(--lora 16 --median 250 --min-len 64 --max-len 1000
                                --set trainer_engine.gradient_checkpointing true)
    echo "${args[@]}"
}

copies() {  # each rollout worker's per-version copy from its log: the median seconds and GB/s per receiver
    python3 - "$1" <<'EOF'
import re, statistics, sys
from pathlib import Path
rows = {}
for log in Path(sys.argv[1]).rglob("rollout.log"):
    for line in log.read_text(errors="replace").splitlines():
        if "weights_copied" in line:
            f = dict(re.findall(r"(\w+)=(\S+)", line))
            rows.setdefault((log.parent.name, f.get("node", "?")), []).append((int(f["nbytes"]), float(f["seconds"])))
if not rows:
    print("weights_copied: none logged (rollout workers on the trainer's GPU serve its buffers without a copy)")
for (run, node), got in sorted(rows.items()):
    s = statistics.median(t for _, t in got)
    print(f"weights_copied {run} {node}: {len(got)} versions, {got[-1][0] / 1e9:.2f} GB, median {s * 1e3:.1f} ms, "
          f"{got[-1][0] / s / 1e9:.1f} GB/s")
EOF
}

one() {
    # shellcheck disable=SC2046
    timeout "${E2E_TIMEOUT:-280}" python3 bench/gpu_e2e.py $(e2e_args "$1") --keep-logs "$OUT/e2e-one-$1" ${E2E_ARGS:-}
}

half() {
    local rollout trainer
    rollout="[$(seq_list 0 $((HALF - 1)))]" trainer="[$(seq_list "$HALF" $((N - 1)))]"
    # shellcheck disable=SC2046
    timeout "${E2E_TIMEOUT:-280}" python3 bench/gpu_e2e.py $(e2e_args "$1") --keep-logs "$OUT/e2e-half-$1" \
        --set rollout_workers "$HALF" --set train_workers "$HALF" \
        --set nodes.rollout.gpus "$rollout" --set nodes.trainer.gpus "$trainer" ${E2E_ARGS:-}
    copies "$OUT/e2e-half-$1"
}

trainer() {  # $1 shape, $2 extra arguments
    local shape=$1 extra=${2:-} first=1
    if [ "$shape" = 8b ]; then
        extra="$extra --checkpointing --steps 4 --warmup 1"
        [[ "$extra" != *--lora* ]] && first=$([ "$GPU_MIB" -ge 120000 ] && echo 2 || echo 4)
    fi
    # shellcheck disable=SC2086
    python3 bench/trainer_parallel.py --shape "$shape" --longtail --seq 3000 --batch 128 --mini-batch 32 \
        --layouts "$(layouts $first)" $extra ${TRAINER_ARGS:-}
}

while [ $# -gt 0 ]; do
    step=$1; shift
    case $step in
        nccl)    python3 bench/nccl_bw.py 2>&1 | tee "$OUT/nccl.log" ;;
        weights) { python3 bench/weights_cuda.py --readers "$HALF" --reader-gpus "$(seq_list 1 "$HALF")"
                   python3 bench/weights_cuda.py --readers $((N - 1)) --reader-gpus "$(seq_list 1 $((N - 1)))"
                 } 2>&1 | tee "$OUT/weights.log" ;;
        trainer) trainer "$1" 2>&1 | tee "$OUT/trainer-$1.log"; shift ;;
        lora)    trainer "$1" "--lora 16" 2>&1 | tee "$OUT/lora-$1.log"; shift ;;
        one)     one "$1" 2>&1 | tee "$OUT/one-$1.log"; shift ;;
        half)    half "$1" 2>&1 | tee "$OUT/half-$1.log"; shift ;;
        system)  { one "$1"; half "$1"; } 2>&1 | tee "$OUT/system-$1.log"; shift ;;
        *) echo "gpu_eight: unknown step '$step' (nccl, weights, trainer S, lora S, one S, half S, system S)" >&2; exit 2 ;;
    esac
done
