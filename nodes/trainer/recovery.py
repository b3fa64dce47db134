"""Where a trainer process starts, and what a checkpoint adds for crash recovery.

``plan_start`` reads the spool's run metadata and the checkpoints: a fresh run, a crash recovery (the
supervisord that started the run restarted its trainer: the run goes on from its newest checkpoint,
the spool's rows that checkpoint does not cover are trained again), ``--resume`` (continue the spool's
unfinished run, or the newest checkpoint of any run as a new epoch), or a run that already finished.
``write_run_state`` is the last file of a checkpoint: one counts for recovery only once it is there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from areal_bus.spool import Spool


def resume_state(ckpt_dir: Path) -> tuple[Path | None, int, list[str]]:
    """(checkpoint folder, version, consumed ids) of the newest complete checkpoint, or a fresh start."""
    done = [p for p in ckpt_dir.glob("step_*") if (p / "trainer_state.json").exists()] if ckpt_dir.exists() else []
    if not done:
        return None, 0, []
    folder = max(done, key=lambda p: int(p.name.split("_")[1]))
    state = json.loads((folder / "trainer_state.json").read_text())
    return folder, int(state["version"]), list(state["consumed"])


RUN_STATE = "run_state.json"
"""What the trainer adds to each checkpoint folder, atomically, once the engine's save has returned:
the run epoch, the incarnation that wrote it, the consumed ids and the per-source totals. A
checkpoint counts for crash recovery only once this file is there, so a trainer killed mid-save
recovers from the checkpoint before."""


def write_run_state(folder: Path, state: dict) -> None:
    tmp = folder / (RUN_STATE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the spool rows it covers are pruned
    os.replace(tmp, folder / RUN_STATE)


def recovery_point(ckpt_dir: Path, epoch: str) -> tuple[Path | None, dict]:
    """The newest checkpoint of run ``epoch`` with its run state, or (None, {}): the run's start."""
    best: tuple[Path | None, dict] = (None, {})
    for folder in ckpt_dir.glob("step_*") if ckpt_dir.exists() else []:
        try:
            state = json.loads((folder / RUN_STATE).read_text())
        except (OSError, ValueError):
            continue  # no run state: a save that did not finish, or another run's checkpoint
        if state.get("epoch") == epoch and (best[0] is None or state["version"] > best[1]["version"]):
            best = folder, state
    return best


def supervisor_instance() -> str:
    """The supervisord that started this process (pid and start time), "" when none did. A trainer
    restarted by the supervisord that started its run recovers that run; a new supervisord starts a
    new run (``--resume`` continues an old one on purpose)."""
    if not os.environ.get("SUPERVISOR_ENABLED"):
        return ""
    ppid = os.getppid()
    try:
        started = Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "?"
    return f"{ppid}:{started}"


@dataclass
class Start:
    """Where a trainer process starts: a fresh run, a checkpoint (``--resume``), or a crash recovery."""

    epoch: str  # names the run in RunState: agents count on across trainer restarts of one epoch
    folder: Path | None = None  # checkpoint to load
    version: int = 0
    consumed: list = field(default_factory=list)  # ids trained on or dropped as stale, in that lineage
    sources: dict = field(default_factory=dict)  # per-source [consumed, stale] at that checkpoint
    trained: int = 0
    ckpt_inc: str | None = None  # the incarnation that wrote the checkpoint
    recovering: bool = False  # re-queue the spool's rows the checkpoint does not cover
    finished: bool = False  # the run had already finished: nothing to do


def plan_start(spool: Spool | None, ckpt_dir: Path, resume: bool, incarnation: str, owner: str) -> Start:
    """Restarted by the supervisord (``owner``) that started the spool's run: recover that run (or
    say it finished). ``--resume``: continue the spool's unfinished run, else the newest checkpoint.
    Otherwise a new run, with an empty spool."""

    def from_state(epoch, folder, state, recovering) -> Start:
        return Start(epoch, folder, int(state.get("version", 0)), list(state.get("consumed", [])),
                     dict(state.get("sources", {})), int(state.get("trained", len(state.get("consumed", [])))),
                     state.get("inc"), recovering)

    meta = spool.meta() if spool is not None else {}
    if spool is not None and meta.get("epoch") and owner and meta.get("owner") == owner:
        if meta.get("finished") == "1":
            return Start(meta["epoch"], finished=True)
        folder, state = recovery_point(ckpt_dir, meta["epoch"])
        return from_state(meta["epoch"], folder, state, recovering=True)
    if resume and spool is not None and meta.get("epoch") and meta.get("finished") != "1":
        # Continue the spool's unfinished run on purpose (e.g. after the whole machine went down).
        spool.set_meta(owner=owner)
        folder, state = recovery_point(ckpt_dir, meta["epoch"])
        return from_state(meta["epoch"], folder, state, recovering=True)
    if resume:
        # The newest checkpoint of any run, as a new epoch (without a spool, or its run had finished).
        folder, version, consumed = resume_state(ckpt_dir)
        if spool is not None:
            spool.start_run(epoch=incarnation, owner=owner, finished=0)
        return from_state(incarnation, folder, {"version": version, "consumed": consumed}, recovering=False)
    if spool is not None:
        spool.start_run(epoch=incarnation, owner=owner, finished=0)
    return Start(incarnation)
