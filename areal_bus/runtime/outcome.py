"""The run's outcome file and resume flag: what the launcher (``areal-bus run``, the run-end listener) and the
trainer node both read or write, so that a node needs nothing of the launcher.

``log_dir/run_outcome.json`` holds the run's id, status and end reason (the launcher) and its data counts (the
trainer, at its end). ``AREAL_BUS_RESUME=1`` in supervisord's environment tells the trainer to resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

OUTCOME = "run_outcome.json"
"""The outcome file's name in log_dir."""
OUTCOME_ENV = "AREAL_BUS_RUN_OUTCOME"
"""The outcome file's path, set in supervisord's environment by ``areal-bus run``."""
RESUME_ENV = "AREAL_BUS_RESUME"
"""Set to 1 in supervisord's environment by ``areal-bus run --resume``; supervisord hands it to the
trainer, which then resumes as ``areal-bus node trainer --resume`` does. An environment variable, not
a file: it lives exactly as long as that supervisord, so a later bare ``supervisord -c`` never
resumes (nor starts over) by accident."""


def outcome_path(env=os.environ) -> Path | None:
    """``$AREAL_BUS_RUN_OUTCOME`` (``areal-bus run`` sets it), else log_dir/run_outcome.json found
    from supervisord's socket, which the rendered conf puts in log_dir; None without either."""
    if env.get(OUTCOME_ENV):
        return Path(env[OUTCOME_ENV])
    url = env.get("SUPERVISOR_SERVER_URL", "")
    return Path(url[len("unix://"):]).parent / OUTCOME if url.startswith("unix://") else None


def write_outcome(path: Path, **fields) -> None:
    """Merge ``fields`` into the outcome file (``areal-bus run`` wrote the run's id and start), atomically."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):  # no file yet, or one cut short: start a fresh record
        record = {}
    record.update(fields)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
