#!/usr/bin/env bash
# FlashAttention-4 (the flash-attn-4 package, CuTe DSL) in the trainer on the registry-less GPU host:
# checked against FlashAttention-2 and timed, kernel by kernel (bench/attn_varlen.py) and in the trainer's
# update (bench/trainer.py, `+fa4` against the same engine with torch's FlashAttention-2, same call).
#
# Its wheels (~100 MB: flash-attn-4, quack-kernels, nvidia-cutlass-dsl and its libs-base/-core/-cu13,
# apache-tvm-ffi, torch-c-dlpack-ext; the host has cuda-bindings, einops and protobuf) travel as a tar in
# parts, one per call. Here (pip reaches the registry):
#     bash scripts/gpu-host/gpu_fa4.sh --pack DIR      (DIR/p1: part 0 + SHA + the bus's wheels from .whl; DIR/p2: part 1)
# There, one call per part, each carrying it (the machine keeps /tmp while warm):
#     PARTS=DIR/p1 bash scripts/gpu-host/gpu_fa4.sh    (stores the part, installs the bus's wheels, runs RUN1 if set)
#     PARTS=DIR/p2 bash scripts/gpu-host/gpu_fa4.sh    (the tar whole: installs it, then the checks and benches)
# Knobs (environment): OUT (gpu_logs), RUNS ("0.5b:16384 0.5b:32768 1.5b:16384"), PATHS (per run), WARMUP (4),
# STEPS (4), RUN_TIMEOUT (240 s per run of bench/trainer.py), PYTEST (1: the CUDA tests of
# tests/test_train_model.py), ATTN (1: bench/attn_varlen.py), RUN1 (a command for the first call, while the second part is on its way).
set -uo pipefail
cd "$(dirname "$0")/../.."     # the repository root
if [ "${1:-}" = "--pack" ]; then
    dir=${2:?usage: --pack DIR}
    mkdir -p "$dir/wheels" "$dir/p1/bus" "$dir/p2"
    (cd "$dir/wheels" && python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --pre flash-attn-4==4.0.0b40 quack-kernels==0.6.5 \
        torch-c-dlpack-ext==0.1.5 apache-tvm-ffi==0.1.15.post2 nvidia-cutlass-dsl==4.8.1 \
        nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
        nvidia-cutlass-dsl-libs-cu13==4.8.1) || exit 1
    tar -cf "$dir/fa4.tar" -C "$dir/wheels" . && sha256sum "$dir/fa4.tar" | cut -c1-64 > "$dir/SHA"
    (cd "$dir" && split -b 50M -d -a 1 fa4.tar fa4- && mv fa4-0 p1/ && mv fa4-1 p2/ && rm fa4.tar) || exit 1
    cp "$dir/SHA" "$dir/p1/" && cp "$dir/SHA" "$dir/p2/" && cp .whl/*.whl "$dir/p1/bus/"
    du -sh "$dir/p1" "$dir/p2"
    exit 0
fi
PARTS=${PARTS:?where the carried part and SHA are}
OUT=${OUT:-gpu_logs}
mkdir -p /tmp/fa4-parts /tmp/site "$OUT"
export PYTHONUNBUFFERED=1
if [ -d "$PARTS/bus" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$PARTS"/bus/*.whl || exit 1
fi
cp "$PARTS"/fa4-* /tmp/fa4-parts/ && echo "parts here: $(ls /tmp/fa4-parts | tr '\n' ' ')"
# nvidia-cutlass-dsl's .pth puts its dsl_packages on the path: /tmp/site is no site directory, so say it here.
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
if [ "$(cat /tmp/fa4-parts/fa4-* | sha256sum | cut -c1-64)" != "$(cat "$PARTS/SHA")" ]; then
    echo "flash-attn-4's tar not whole yet (or a part is bad): carry the next part"
    [ -n "${RUN1:-}" ] && bash -c "$RUN1"
    exit 0
fi
if [ ! -d /tmp/fa4-wheels ]; then
    mkdir -p /tmp/fa4-wheels && cat /tmp/fa4-parts/fa4-* | tar -xf - -C /tmp/fa4-wheels || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        /tmp/fa4-wheels/*.whl || exit 1
fi
python3 -c "import flash_attn.cute.interface as i, torch; print('flash-attn-4 imports;', torch.cuda.get_device_name())" \
    2>&1 | tail -n 5
B="--warmup ${WARMUP:-4} --steps ${STEPS:-4}"
P=${PATHS:-engine:compute_copy+compile,engine:compute_copy+compile+fa4}
{
    if [ "${ATTN:-1}" = 1 ]; then
        timeout 240 python3 bench/attn_varlen.py 2>&1 | grep -v "^\s*$" | tail -n 30
    fi
    if [ "${PYTEST:-1}" = 1 ]; then
        timeout 240 python3 -m pytest -q --noconftest -p no:cacheprovider -rs -m gpu tests/test_train_model.py 2>&1 \
            | tail -n 15
    fi
    for run in ${RUNS:-0.5b:16384 0.5b:32768 1.5b:16384}; do
        echo "# ${run%%:*}, micro-batches of ${run#*:} tokens"
        timeout "${RUN_TIMEOUT:-240}" python3 bench/trainer.py $B --shapes "${run%%:*}" --micro-tokens "${run#*:}" \
            --paths "$P" 2>&1 \
            | grep -E "^# bench|^[0-9.]+b |RESULT|rror|graph breaks|timed updates"
    done
} 2>&1 | tee "$OUT/fa4.log"
