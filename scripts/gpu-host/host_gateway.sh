#!/usr/bin/env bash
# bench/gateway.py on another host (the lent GPU machine's 16 cores: the gateway's added latency where
# processes do not share two vCPUs). That host lacks pyzmq, pydantic, structlog, aiohttp and uvloop:
# they travel as cp312 wheels in .whl and .whl/gw (made here by scripts/gpu-host/host_wheels.sh) and go to
# /tmp/site; `areal-bus` is a two-line launcher there. Output to $OUT/gateway.log (default ./gpu_logs).
#
# Run from the repository root:  bash scripts/gpu-host/host_gateway.sh [bench/gateway.py arguments]
set -uo pipefail
cd "$(dirname "$0")/../.."     # the repository root
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT" /tmp/site/bin
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl .whl/gw/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
printf '#!/usr/bin/env python3\nimport sys\nfrom areal_bus.launch.cli import main\nsys.exit(main())\n' > /tmp/site/bin/areal-bus
chmod +x /tmp/site/bin/areal-bus
{ nproc; lscpu | grep -E "Model name|^CPU\(s\)"; python3 --version; } 2>&1 | tee "$OUT/host.txt"
timeout "${GW_TIMEOUT:-500}" python3 bench/gateway.py "$@" 2>&1 | tee "$OUT/gateway.log"
