#!/usr/bin/env bash
# The main job: install what is needed, build the warm-start model if it is not there yet, run the
# embedded default topology under supervisord until it ends by itself after max_steps, then plot.
# `areal-bus run` shows a progress line, moves a previous run's logs to logs/runs/<run id>/ first, and
# exits non-zero with a one-line reason (the node and its log) when a node cannot run: so does this.
# Logs land in logs/ (train.log, rollout.log, ..., run_outcome.json); the curves in logs/reward.png and
# logs/loss.png.
# Run (from anywhere):  bash scripts/run_default.sh        (the README's first command)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/warmstart.py --out models/tiny-guess     # no-op when already built
# The gateway's admin token (opens sessions); one per run unless the caller set one. Never in a file.
export AREAL_BUS_ADMIN_TOKEN="${AREAL_BUS_ADMIN_TOKEN:-$(.venv/bin/python -c 'import secrets; print(secrets.token_urlsafe(24))')}"
.venv/bin/areal-bus run supervisord.conf
.venv/bin/areal-bus plot --log-dir logs --metric reward --output logs/reward.png
.venv/bin/areal-bus plot --log-dir logs --metric loss --output logs/loss.png
echo "run finished; logs and plots in $(pwd)/logs"
grep -E "eval|run_finished" logs/train.log | tail -n 4
