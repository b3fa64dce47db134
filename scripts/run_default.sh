#!/usr/bin/env bash
# The main job: install what is needed, then run the embedded default topology under supervisord
# until it ends by itself after max_steps. Logs land in logs/ (train.log, rollout.log, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p logs/supervisor
.venv/bin/supervisord -c supervisord.conf
echo "run finished; logs in $(pwd)/logs"
tail -n 3 logs/train.log
