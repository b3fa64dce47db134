#!/usr/bin/env bash
# Install what is needed, then run the whole test suite.
# Run (from anywhere):  bash scripts/test.sh [pytest arguments]   (the README's second command; CI's .ci/run)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q --durations=15 "$@"
