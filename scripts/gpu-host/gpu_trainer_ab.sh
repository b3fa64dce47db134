#!/usr/bin/env bash
# A change to the trainer engine against the engine before it, in one call on one GPU: bench/trainer.py's
# long-tail updates (lognormal median 500 in 200..3,000 tokens, ~64k tokens per update in 4 mini-batches)
# with the engine of $BASE (`old:` paths) and today's (`engine:` paths), alternating, each path in a
# process of its own; then one profiled update of today's engine (host vs device time, kernel launches,
# synchronizations) and, with COMPILE_LOGS=1, the recompilations of the compiled path at 1.5B.
#
# Run from the repository root (the device tool: carry [".base"] made by
#     rm -rf .base && mkdir .base && git archive <rev> areal_bus bench | tar -x -C .base
# ; about 7 minutes):  bash scripts/gpu-host/gpu_trainer_ab.sh
# Knobs (environment): BASE (.base), OUT (gpu_logs), SHAPES_AB ("0.5b 1.5b"), VARIANTS ("compute_copy
# compute_copy+compile"), PROFILE (1), PROFILE_PATHS ("old:compute_copy,engine:compute_copy"), COMPILE_LOGS (0),
# PYTEST (0; 1 runs the trainer's CUDA tests first), BENCH_ARGS (more bench/trainer.py arguments for every
# table and the profile, e.g. "--micro-tokens 32768").
set -uo pipefail
cd "$(dirname "$0")/../.."     # the repository root
OUT=${OUT:-gpu_logs}
BASE=${BASE:-.base}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -d "$BASE/areal_bus" ] || { echo "no $BASE/areal_bus: make it with git archive <rev> areal_bus bench | tar -x -C $BASE" >&2; exit 1; }
{
    if [ "${PYTEST:-0}" = 1 ]; then
        timeout 240 python3 -m pytest -q --noconftest -p no:cacheprovider -rs -m gpu tests/test_train_model.py \
            2>&1 | tail -n 15
    fi
    for shape in ${SHAPES_AB:-0.5b 1.5b}; do
        paths=""
        for v in ${VARIANTS:-compute_copy compute_copy+compile}; do
            paths="$paths,old:$v,engine:$v"
        done
        timeout 330 python3 bench/trainer.py --shapes "$shape" --old-tree "$BASE" --paths "${paths#,}" ${BENCH_ARGS:-}
    done
    if [ "${PROFILE:-1}" = 1 ]; then
        echo "# one profiled update of each of ${PROFILE_PATHS:=old:compute_copy,engine:compute_copy}, 0.5b"
        timeout 150 python3 bench/trainer.py --shapes 0.5b --old-tree "$BASE" --paths "$PROFILE_PATHS" \
            --steps 1 --profile ${BENCH_ARGS:-} > "$OUT/profile.log" 2>&1
        grep -E "^# |^0.5b" "$OUT/profile.log"
    fi
    if [ "${COMPILE_LOGS:-0}" = 1 ]; then
        echo "# the compiled path at 1.5b: recompilations"
        TORCH_LOGS=recompiles timeout 200 python3 bench/trainer.py --shapes 1.5b --paths engine:compute_copy+compile 2>&1 \
            | grep -E "Recompiling|^1.5b|triggered by" | cut -c1-200 | head -20
    fi
} 2>&1 | tee "$OUT/trainer_ab.log"
