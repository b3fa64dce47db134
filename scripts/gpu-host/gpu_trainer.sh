#!/usr/bin/env bash
# Issue 12's trainer table on one GPU (the lent H200 host: torch, transformers and safetensors are there;
# nothing else is needed): bench/trainer.py on the seed's long-tail updates at the 0.5B and 1.5B shapes,
# the old engine (a `git archive 7adbcb8 areal_bus bench` tree) beside today's engine with each knob,
# then bench/trainer_parallel.py's short rows (16 x <= 1,024) for the old engine and today's, each in
# the same call.
#
# Run from the repository root (the device tool: carry [".old7"] made by
#     mkdir .old7 && git archive 7adbcb8 areal_bus bench | tar -x -C .old7
# ; about 7 minutes):  bash scripts/gpu-host/gpu_trainer.sh
# Knobs (environment): OLD (.old7), SHAPES_LONG ("0.5b 1.5b"), OUT (gpu_logs).
set -uo pipefail
cd "$(dirname "$0")/../.."     # the repository root
OUT=${OUT:-gpu_logs}
OLD=${OLD:-.old7}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -d "$OLD/areal_bus" ] || { echo "no $OLD/areal_bus: make it with git archive 7adbcb8 areal_bus bench | tar -x -C $OLD" >&2; exit 1; }
{
    timeout 240 python3 bench/trainer.py --shapes 0.5b --old-tree "$OLD" \
        --paths baseline,old,engine:autocast,engine:compute_copy,engine:compute_copy+compile
    timeout 220 python3 bench/trainer.py --shapes 1.5b --paths engine:autocast,engine:compute_copy,engine:compute_copy+compile
    echo "# bench/trainer_parallel.py --layouts 1x1 --steps 6: the old engine ($OLD), then today's (compute_copy)"
    (cd "$OLD" && timeout 60 python3 bench/trainer_parallel.py --layouts 1x1 --steps 6) | grep -E "^dp1|^RESULT"
    timeout 50 python3 bench/trainer_parallel.py --layouts 1x1 --steps 6 | grep -E "^dp1|^RESULT"
} 2>&1 | tee "$OUT/trainer.log"
