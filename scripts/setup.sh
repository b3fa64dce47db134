#!/usr/bin/env bash
# Create .venv and install areal_bus with what it needs (idempotent; fast when already done).
# torch is installed first and pinned: an unpinned torch on a machine without it pulls a multi-GB
# CUDA build, while torch==2.13.0 is the CPU build these machines carry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.areal_bus-installed
want=$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
    .venv/bin/pip install -q --disable-pip-version-check -e ".[dev]"
    echo "$want" > "$stamp"
fi
