"""Structured logs in the shape users recognise, one file per node kind under log_dir.

    [rollout] step=120 generated=32 tokens=18420 ts=14:23:01.221
    [train] step=118 updated=32 loss=0.421 ts=14:23:01.335
    [train] throughput samples_per_second=41.2 tokens_per_second=30118 ts=14:23:05.002

structlog does the structuring; the renderer below only decides the line's shape. Each line goes to
``<log_dir>/<file>.log`` (appended; every replica of a kind shares the file, and O_APPEND keeps whole
lines whole); warnings and errors also go to stdout, which supervisord keeps per process beside any
traceback. A line that cannot be written (disk full) is counted and dropped: logging never fails the
code that logs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import structlog

from areal_bus.runtime.ledger import AppendFile

# Node kind -> (tag in brackets, file name). The trainer's lines say [train] as AReaL's do.
LOG_NAMES = {
    "trainer": ("train", "train"),
    "rollout": ("rollout", "rollout"),
    "agent": ("agent", "agent"),
    "reward": ("reward", "reward"),
    "weights": ("weights", "weights"),
    "bus": ("bus", "bus"),
    "gateway": ("gateway", "gateway"),
    "probe": ("probe", "probe"),
}

# Events whose name is implied by their fields: the line starts with the fields (step=...).
_SILENT_EVENTS = {"step"}
# Bound context that goes last, so each line still starts with what happened.
_TRAILING = ("node",)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}" if abs(value) < 1e6 else f"{value:.0f}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_fmt(v)}" for k, v in value.items()) + "}"
    text = str(value)
    return f'"{text}"' if (" " in text or not text) else text


def render_line(_, __, event_dict) -> str:
    tag = event_dict.pop("_tag", "node")
    event = event_dict.pop("event", "")
    event_dict.pop("level", None)
    ts = event_dict.pop("ts", None) or time.time()
    parts = [f"[{tag}]"]
    if event and event not in _SILENT_EVENTS:
        parts.append(event)
    trailing = [(k, event_dict.pop(k)) for k in _TRAILING if k in event_dict]
    parts.extend(f"{k}={_fmt(v)}" for k, v in [*event_dict.items(), *trailing])
    t = time.localtime(ts)
    parts.append(f"ts={time.strftime('%H:%M:%S', t)}.{int((ts % 1) * 1000):03d}")
    return " ".join(parts)


_failures = 0


def log_failures() -> int:
    """Log lines this process could not write (a full disk, a closed stdout), since it started."""
    return _failures


class _NodeLogger:
    """Where rendered lines go: every line to the node-kind log file; warnings and errors also to
    stdout, which supervisord keeps per process beside the tracebacks. Routine lines (one per request
    on a gateway, one per step elsewhere) skip stdout: the pipe to supervisord costs CPU on every line.

    Logging is best effort and the data path is not: a line that cannot be written (ENOSPC) is counted
    (``log_failures``) and dropped, never raised into the code that logged it (a gateway's reply, a
    trainer's step). What must not be lost goes to the ledger or a spool, which raise instead."""

    def __init__(self, path: Path | None, echo: bool = True):
        self.echo = echo
        self._file = AppendFile(path) if path is not None else None

    def _write(self, line: str, loud: bool) -> None:
        global _failures
        data = (line + "\n").encode("utf-8", "backslashreplace")
        if self._file is not None:
            try:
                self._file.append(data)
            except OSError:  # deliberately tolerated: see the class docstring
                _failures += 1
        if self.echo and (loud or self._file is None):
            try:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
            except (OSError, ValueError):  # ValueError: stdout closed. Tolerated as above
                _failures += 1

    def info(self, line: str) -> None:
        self._write(line, loud=False)

    debug = msg = info

    def warning(self, line: str) -> None:
        self._write(line, loud=True)

    error = critical = exception = warn = warning


def setup_logging(kind: str, log_dir: Path | None, echo: bool = True, **bound):
    """Configure structlog for this process and return a logger bound to the node's tag."""
    tag, fname = LOG_NAMES.get(kind, (kind, kind))
    sink = _NodeLogger(log_dir / f"{fname}.log" if log_dir is not None else None, echo)
    structlog.configure(
        processors=[structlog.processors.add_log_level, render_line],
        logger_factory=lambda *_: sink,
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger().bind(_tag=tag, **bound)
