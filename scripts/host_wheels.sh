#!/usr/bin/env bash
# The wheels the lent GPU host lacks, for scripts/gpu_e2e.sh and scripts/host_gateway.sh: run here (the
# registry is reachable from this machine, not from that one), after scripts/setup.sh. Each package at the
# version this venv has, built for the host's Python (3.12, x86_64 manylinux). .whl is git-ignored and
# travels to the host with the device tool's carry: [".whl"].
#
# Run from the repository root:  bash scripts/host_wheels.sh [python version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-3.12}
pinned() {  # name==version as installed in .venv
    .venv/bin/python - "$@" <<'PYEOF'
import sys
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
PYEOF
}
fetch() {  # fetch DIR PACKAGE...
    local dir=$1; shift
    mkdir -p "$dir"
    # shellcheck disable=SC2046
    .venv/bin/pip download -q --only-binary=:all: --no-deps --python-version "$PY" --dest "$dir" \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        $(pinned "$@")
}
# the bus and the nodes (gpu_e2e.sh)
fetch .whl pyzmq pydantic pydantic_core annotated-types typing-inspection typing_extensions structlog supervisor orjson
# the gateway's HTTP stack and the rest bench/gateway.py imports (host_gateway.sh)
fetch .whl/gw aiohttp uvloop multidict yarl propcache frozenlist aiosignal aiohappyeyeballs attrs msgpack pyyaml ml_dtypes
ls .whl .whl/gw
