#!/usr/bin/env bash
# The LoRA and 8B-class measurements (issue 50 item 6, issue 51 items 1 and 5) on the lent GPU host, in three
# device calls of at most ~9 minutes, each running this script with its steps (any order, any subset):
#
#   step    what it runs                                                                         expected
#   tests   the GPU tests of the shared base, the paged KV cache, sharded publish, CUDA weights,   ~2 min
#           the CUDA-graph decode and LoRA decode (pytest -m gpu); run first: e2e8b builds on them
#   trainer bench/trainer.py: Qwen2.5-3B full fine-tuning (the same-call baseline) and LoRA r16,   ~7 min
#           (trainer3b: those two alone, ~3.5 min; trainer8b: the 8B paths alone), then the
#           Llama-3.1-8B shape with LoRA r16 as measured first (checkpointing, 8k micro-batches),
#           compiled with 16k micro-batches (8.7k tokens/s on 2026-12-06), compiled without
#           checkpointing (both levers: issue 51's 10k tokens/s?), and r64 compiled (T8B_PATHS: others)
#   swap    bench/lora_swap.py: publish -> first token of the new version in the torch engine,  ~3 min
#           the LoRA adapter (r 16, 64) beside the full weights, 0.5B and 1.5B shapes
#   decode  bench/engine.py --shape 8b --no-hf --batches 64 256: the torch engine's decode        ~1.5 min
#           tokens/s at Llama-3.1-8B's shape against its bandwidth bound, bench/engine.py's sdpa row
#           (measured 2026-12-06) and the rollout's default step (flash_varlen fused), with profiles
#   learn   bench/learning.py on SmolLM2-135M-Instruct (topology/smollm2-math-gpu.yaml): full     ~6.5 min
#           fine-tuning async then sync, then LoRA r16 (lr x10) async then sync, one run at a time
#           (held-out accuracy against wall time); the GGUF is imported first (~20 s)
#   e2e8b   bench/gpu_e2e.py --shape 8b --lora 16 on the long tail, lengths scaled (median 200,    ~7 min
#           64..800), async (staleness 2, trigger half the batch) vs sync, rollout and trainer on the card
#   e2e3b   (optional, if device time is left) bench/gpu_e2e.py --shape 3b, the same workload,   ~7 min
#           full fine-tuning then LoRA r16, async vs sync each
#
# The calls (from the repository root; first, HERE: `bash scripts/gpu-host/host_wheels.sh --smollm2`, which makes
# .whl14/w (the bus's wheels: pydantic, pyzmq, structlog, supervisor, orjson ..., and gguf, datasets: ~6 MB) and
# the GGUF (98 MB: more than one call carries) in two parts .whl14/g1 (48 MiB) and .whl14/g2 (46 MiB)):
#   1. carry [".whl14/g1", ".whl14/w"]:  PARTS=.whl14/g1 WHEELS=.whl14/w bash scripts/gpu-host/gpu_size.sh swap decode
#   2. carry [".whl14/g2", ".whl14/w"], AT ONCE (the machine stays warm only 30 s after a call, and part 1 lives
#      in its /tmp):  PARTS=.whl14/g2 WHEELS=.whl14/w bash scripts/gpu-host/gpu_size.sh learn
#   3. carry [".whl14/w"]:  WHEELS=.whl14/w bash scripts/gpu-host/gpu_size.sh e2e8b
# The wheels go to /tmp/site and the GGUF's parts to /tmp/gguf-parts. If the machine went cold between calls 1
# and 2, learn says "not whole": then the part-1 call again (with a short step, or e2e8b), call 2 right after it.
#
# The 8B run's memory plan (`areal-bus plan`, checked at node start), computed here for an 80 GB card: trainer
# ~25 GiB (bf16 base 14 GB, LoRA state, activations at 8k-token micro-batches with checkpointing), rollout ~17 GiB
# (base mapped from the trainer, model.share_base true, set by the step; dense KV 128 x 960 tokens, 16 GB): it fits.
# Knobs (environment): T3B_PATHS / T8B_PATHS (bench/trainer.py paths of the trainer steps), TESTS (the tests step's pytest paths or ids, instead of its six files), E2E8B_ARGS / E2E3B_ARGS (more bench/gpu_e2e.py arguments, after the defaults: e.g. the
# paged KV cache, "--rollout-batch 256 --set rollout_engine.kv_tokens 131072", or "--set model.share_base false" for a copy of its own),
# LEARN_ARGS (more bench/learning.py arguments for both pairs), LORA_LR (the LoRA pair's learning rate, 1e-4),
# SWAP_ARGS, DECODE_ARGS. Logs go to $OUT (default gpu_logs): one per step, and gpu_mem.log (nvidia-smi every 20 s).
set -uo pipefail
cd "$(dirname "$0")/../.."     # the repository root
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT" /tmp/site/bin /tmp/gguf-parts
if [ -n "${WHEELS:-}" ] && [ -d "$WHEELS" ]; then  # installed once; a later call on the warm machine carries none
    find "$WHEELS" -type f -name '*.whl' -print0 | xargs -0 -r python3 -m pip install -q --no-index --no-deps \
        --no-compile --no-cache-dir --upgrade --target /tmp/site || exit 1
fi
if [ -n "${PARTS:-}" ] && [ -d "$PARTS" ]; then
    cp "$PARTS"/gguf-* /tmp/gguf-parts/ && cp "$PARTS/SHA" /tmp/gguf-parts/SHA && echo "GGUF parts here: $(ls /tmp/gguf-parts | tr '\n' ' ')"
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
printf '#!/usr/bin/env python3\nimport sys\nfrom areal_bus.launch.cli import main\nsys.exit(main())\n' > /tmp/site/bin/areal-bus
chmod +x /tmp/site/bin/areal-bus
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
(while sleep 20; do
    echo "$(date +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader) |" \
        "$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ';')"
done) >> "$OUT/gpu_mem.log" 2>&1 &
monitor=$!
trap 'kill $monitor 2>/dev/null' EXIT
need_bus() {  # the system's runs need the bus's packages from the wheels
    python3 -c "import pydantic, zmq, structlog, supervisor, orjson" 2>/dev/null && return 0
    echo "the bus's wheels are not installed in /tmp/site (a cold machine?): carry .whl14/w and set WHEELS=.whl14/w"
    return 1
}
step() {  # step NAME SECONDS COMMAND...: one step, its log, its time
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "== $name: $* (limit ${limit} s)"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || failed="$failed $name"
}
failed=
[ $# -gt 0 ] || { echo "steps: tests trainer trainer3b trainer8b swap decode learn e2e8b e2e3b (see the header)"; exit 2; }
# The long tail scaled to fit a 10-minute call at 8B (bench/gpu_e2e.py's defaults are median 500, 200..3,000).
LONGTAIL=(--workload longtail --batch 64 --group-size 8 --agents 2 --steps 7 --skip 2 --median 200 --sigma 0.8
          --min-len 64 --max-len 800 --rollout-batch 128 --runs sync async:2:true --timeout 300
          --set trainer_engine.gradient_checkpointing true --set trainer_engine.micro_batch_tokens 8192)
for s in "$@"; do
    case $s in
    tests)
        # shellcheck disable=SC2086
        step tests 240 python3 -m pytest -q --noconftest -p no:cacheprovider -m gpu --tb=short ${TESTS:-tests/test_shared_base.py \
            tests/test_kv_pages.py tests/test_sharded_publish.py tests/test_weights_cuda.py tests/test_cuda_decode.py \
            tests/test_lora_decode.py} ;;
    trainer|trainer3b|trainer8b)
        T=(python3 bench/trainer.py --steps 2 --warmup 1)
        # shellcheck disable=SC2086
        [ "$s" = trainer8b ] || step trainer_3b 260 "${T[@]}" --shapes 3b --paths ${T3B_PATHS:-engine:compute_copy,\
engine:autocast+lora16} --checkpointing --micro-tokens 8192 --weights-dtype bfloat16
        [ "$s" = trainer3b ] && continue
        # shellcheck disable=SC2086
        step trainer_8b 420 "${T[@]}" --shapes 8b --paths ${T8B_PATHS:-engine:autocast+lora16+ckpt+micro8192,\
engine:autocast+lora16+compile+ckpt+micro16384,engine:autocast+lora16+compile+nockpt+micro8192,\
engine:autocast+lora64+compile+ckpt+micro16384} ;;
    swap)
        # shellcheck disable=SC2086
        step swap 260 python3 bench/lora_swap.py ${SWAP_ARGS:-} ;;
    decode)
        # shellcheck disable=SC2086
        step decode 220 python3 bench/engine.py --shape 8b --no-hf --batches 64 256 --variants \
            --rows engine "engine flash_varlen+compile" --profile ${DECODE_ARGS:-} ;;
    learn)
        need_bus || { failed="$failed learn"; continue; }
        python3 -c "import gguf, datasets" || { failed="$failed learn"; continue; }
        cat /tmp/gguf-parts/gguf-* > /tmp/smol.gguf 2>/dev/null
        if [ "$(sha256sum /tmp/smol.gguf | cut -c1-64)" != "$(cat /tmp/gguf-parts/SHA 2>/dev/null)" ]; then
            echo "learn: the GGUF is not whole yet (parts here: $(ls /tmp/gguf-parts | tr '\n' ' ')): carry the other part"
            failed="$failed learn"; continue
        fi
        [ -f /tmp/smollm2/config.json ] || areal-bus import-model /tmp/smol.gguf --out /tmp/smollm2 || { failed="$failed learn"; continue; }
        COMMON=(--topology topology/smollm2-math-gpu.yaml --model /tmp/smollm2 --seeds 0 --parallel 1 --steps 32
                --async-steps 48 --set agent.max_turns 1 --set trainer_engine.eval_interval 8
                --set trainer_engine.eval_episodes 200 --set trainer_engine.loss_token_norm 256)
        # shellcheck disable=SC2086
        step learn_full 260 python3 bench/learning.py "${COMMON[@]}" --set learning_rate 1e-5 \
            --plot "$OUT/learn_full.png" --save "$OUT/learn_full" ${LEARN_ARGS:-}
        # shellcheck disable=SC2086
        step learn_lora 260 python3 bench/learning.py "${COMMON[@]}" --lora 16 --set learning_rate "${LORA_LR:-1e-4}" \
            --plot "$OUT/learn_lora.png" --save "$OUT/learn_lora" ${LEARN_ARGS:-} ;;
    e2e8b)
        need_bus || { failed="$failed e2e8b"; continue; }
        # shellcheck disable=SC2086
        # The trainer compiled with 16k-token micro-batches (1.33x alone, 24.5 GiB): the run of 2026-12-06 without
        # it (checkpointing, 8k) was trainer-bound at 2.02x; E2E8B_ARGS="--set trainer_engine.compile false
        # --set trainer_engine.micro_batch_tokens 8192" repeats that one.
        step e2e8b 540 python3 bench/gpu_e2e.py --shape 8b --lora 16 "${LONGTAIL[@]}" --set model.share_base true \
            --set trainer_engine.compile true --set trainer_engine.micro_batch_tokens 16384 ${E2E8B_ARGS:-} ;;
    e2e3b)
        need_bus || { failed="$failed e2e3b"; continue; }
        # shellcheck disable=SC2086
        step e2e3b_full 270 python3 bench/gpu_e2e.py --shape 3b "${LONGTAIL[@]}" ${E2E3B_ARGS:-}
        # shellcheck disable=SC2086
        step e2e3b_lora 270 python3 bench/gpu_e2e.py --shape 3b --lora 16 "${LONGTAIL[@]}" ${E2E3B_ARGS:-} ;;
    *)
        echo "unknown step $s (tests trainer trainer3b trainer8b swap decode learn e2e8b e2e3b)"; failed="$failed $s" ;;
    esac
done
grep -h "^RESULT" "$OUT"/*.log 2>/dev/null
[ -z "$failed" ] || { echo "failed:$failed"; exit 1; }
