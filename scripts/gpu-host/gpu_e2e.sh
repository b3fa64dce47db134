#!/usr/bin/env bash
# The one-GPU end-to-end run on the GPU host (bench/gpu_e2e.py), which lacks pyzmq, pydantic, structlog
# and supervisor: they travel as wheels in .whl (made here by scripts/gpu-host/host_wheels.sh) and go to
# /tmp/site; `areal-bus` is a two-line launcher there. Logs go to $OUT (default ./gpu_logs).
#
# Run from the repository root:  bash scripts/gpu-host/gpu_e2e.sh [bench/gpu_e2e.py arguments]
set -uo pipefail
cd "$(dirname "$0")/../.."     # the repository root
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT" /tmp/site/bin
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
printf '#!/usr/bin/env python3\nimport sys\nfrom areal_bus.launch.cli import main\nsys.exit(main())\n' > /tmp/site/bin/areal-bus
chmod +x /tmp/site/bin/areal-bus
timeout "${E2E_TIMEOUT:-560}" python3 bench/gpu_e2e.py --keep-logs "$OUT/e2e" "$@" 2>&1 | tee "$OUT/e2e.log"
