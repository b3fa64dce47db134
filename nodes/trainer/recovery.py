"""Where a trainer process starts, and what a checkpoint adds for crash recovery.

``plan_start`` reads the spool's run metadata and the checkpoints: a fresh run, a crash recovery (the
supervisord that started the run restarted its trainer: the run goes on from its newest checkpoint,
the spool's rows that checkpoint does not cover are trained again), ``--resume`` (continue the spool's
unfinished run, or the newest checkpoint of any run as a new epoch), or a run that already finished.
A new supervisord over an unfinished run's data is refused (``UnfinishedRun``): the data is never
emptied or overwritten without ``areal-bus run --new-run`` (which moves it aside) or ``--resume``.

``write_run_state`` seals a checkpoint: the run state, then a manifest of every file's size and
sha256, written last and atomically, everything flushed to disk first. A checkpoint counts for
recovery only once its manifest is there and every file still matches it (``verify``); one that does
not is skipped and named in ``Start.skipped``, which the node logs as an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from areal_bus.runtime.spool import Spool

RUN_STATE = "run_state.json"
"""What the trainer adds to each checkpoint folder once the engine's save has returned: the run
epoch, the incarnation that wrote it, the consumed ids, the per-source totals, and for GRPO groups
not done how many of their members have gone and the rewards of those dropped as over-stale."""
MANIFEST = "manifest.json"
"""The last file of a checkpoint: {file: [size, sha256]} for every other file in the folder. Written
after everything else is on disk (fsync), by an atomic rename: a trainer killed mid-save leaves a
folder without one (an unfinished save), and a file damaged later no longer matches it."""
HASH_CHUNK = 1 << 20
"""Bytes read at a time when hashing checkpoint files: any size works; 1 MiB keeps the reads few."""


class UnfinishedRun(RuntimeError):
    """A new supervisord's trainer found an unfinished run's spool or checkpoints: starting afresh would
    empty and overwrite them. Raised (a traceback the run-end listener quotes) instead of doing so."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_run_state(folder: Path, state: dict) -> None:
    """Seal the checkpoint the engine saved in ``folder``: its run state, every file flushed, then the
    manifest (read back from disk, so it checks what was written), then the folder itself flushed.
    The spool rows the checkpoint covers may be pruned only after this returns."""
    folder = Path(folder)
    (folder / MANIFEST).unlink(missing_ok=True)  # a folder saved over: unsealed until sealed again
    _write_atomic(folder / RUN_STATE, json.dumps(state))
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        _fsync(path)
        files[str(path.relative_to(folder))] = [path.stat().st_size, _sha256(path)]
    _write_atomic(folder / MANIFEST, json.dumps({"files": files}))
    for d in (folder, folder.parent):  # the renames (engine's folder, run state, manifest) are durable
        _fsync(d)


def verify(folder: Path) -> str | None:
    """Why the checkpoint in ``folder`` cannot be trusted, or None: it is whole."""
    try:
        files = json.loads((Path(folder) / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return "no manifest: its save did not finish"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest ({type(exc).__name__})"
    if RUN_STATE not in files:
        return f"the manifest lists no {RUN_STATE}"
    for name, (size, digest) in files.items():
        path = Path(folder) / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size} bytes, the manifest says {size}"
        if _sha256(path) != digest:
            return f"{name} does not match its sha256 in the manifest"
    return None


def _steps(ckpt_dir: Path) -> list[Path]:
    """Checkpoint folders, newest version first."""
    found = [p for p in ckpt_dir.glob("step_*") if p.is_dir() and p.name[5:].isdigit()] if ckpt_dir.is_dir() else []
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def resume_state(ckpt_dir: Path, skipped: list | None = None) -> tuple[Path | None, int, list[str]]:
    """(checkpoint folder, version, consumed ids) of the newest whole checkpoint, or a fresh start. A
    sealed one that fails ``verify`` is passed over (and added to ``skipped``); an engine's own save
    without a manifest (saved outside a trainer run) counts as it is."""
    for folder in _steps(ckpt_dir):
        if not (folder / "trainer_state.json").exists():
            continue
        if (folder / MANIFEST).exists() and (why := verify(folder)) is not None:
            if skipped is not None:
                skipped.append((folder, why))
            continue
        try:
            state = json.loads((folder / "trainer_state.json").read_text())
            return folder, int(state["version"]), list(state["consumed"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if skipped is not None:
                skipped.append((folder, f"unreadable trainer_state.json ({type(exc).__name__})"))
    return None, 0, []


def recovery_point(ckpt_dir: Path, epoch: str) -> tuple[Path | None, dict, list[tuple[Path, str]]]:
    """The newest whole checkpoint of run ``epoch`` with its run state, or (None, {}): the run's start;
    and the newer checkpoints passed over, each with the reason (for the node to log as an error). An
    unfinished save (no manifest, no run state: a trainer killed mid-save) is passed over silently."""
    skipped = []
    for folder in _steps(ckpt_dir):
        why = verify(folder)
        if why is not None:
            if (folder / RUN_STATE).exists() or (folder / MANIFEST).exists():
                skipped.append((folder, why))
            continue
        try:
            state = json.loads((folder / RUN_STATE).read_text())
            if state.get("epoch") != epoch:
                continue  # another run's checkpoint
            int(state["version"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            skipped.append((folder, f"{RUN_STATE} does not parse as a run state ({type(exc).__name__})"))
            continue
        return folder, state, skipped
    return None, {}, skipped


def supervisor_instance() -> str:
    """The supervisord that started this process (pid and start time), "" when none did. A trainer
    restarted by the supervisord that started its run recovers that run; a new supervisord resumes it
    only when told (``--resume``), and refuses to start over it otherwise (``UnfinishedRun``)."""
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
    gone_rewards: dict = field(default_factory=dict)  # group -> rewards of its members dropped or trained (not done)
    group_left: dict = field(default_factory=dict)  # group -> its members trained or dropped (a group not done)
    ckpt_inc: str | None = None  # the incarnation that wrote the checkpoint
    recovering: bool = False  # re-queue the spool's rows the checkpoint does not cover
    finished: bool = False  # the run had already finished: nothing to do
    skipped: list = field(default_factory=list)  # (folder, reason): newer checkpoints that failed verification
    set_aside: Path | None = None  # a fresh start moved an earlier run's checkpoints here


def set_aside(ckpt_dir: Path, epoch: str) -> Path | None:
    """Move an earlier run's checkpoints out of a fresh run's way, to log_dir/runs/<epoch>/checkpoints
    (a new run would save over step folders of the same names)."""
    if not _steps(ckpt_dir):
        return None
    dest = ckpt_dir.parent / "runs" / (epoch or "earlier") / "checkpoints"
    n = 1
    while dest.exists():
        n += 1
        dest = dest.parent.parent / f"{epoch or 'earlier'}-{n}" / "checkpoints"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(ckpt_dir), str(dest))
    return dest


def plan_start(spool: Spool | None, ckpt_dir: Path, resume: bool, incarnation: str, owner: str) -> Start:
    """Restarted by the supervisord (``owner``) that started the spool's run: recover that run (or
    say it finished). ``--resume``: continue the spool's unfinished run, else the newest checkpoint.
    Otherwise a new run, with an empty spool, once any earlier run's checkpoints are set aside; over
    an unfinished run's spool rows or checkpoints, ``UnfinishedRun`` instead."""

    def from_state(epoch, folder, state, recovering, skipped) -> Start:
        # "dropped_rewards": the older name (a checkpoint of a trainer that kept the dropped members' only)
        gone = state.get("gone_rewards", state.get("dropped_rewards", {}))
        gone = {str(g): [float(r) for r in rewards] for g, rewards in gone.items()}
        left = {str(g): int(n) for g, n in state.get("group_left", {}).items()}
        return Start(epoch, folder, int(state.get("version", 0)), list(state.get("consumed", [])),
                     dict(state.get("sources", {})), int(state.get("trained", len(state.get("consumed", [])))),
                     gone, left, state.get("inc"), recovering, skipped=skipped)

    meta = spool.meta() if spool is not None else {}
    unfinished = spool is not None and bool(meta.get("epoch")) and meta.get("finished") != "1"
    if unfinished and owner and meta.get("owner") == owner:
        folder, state, skipped = recovery_point(ckpt_dir, meta["epoch"])
        return from_state(meta["epoch"], folder, state, True, skipped)
    if spool is not None and meta.get("epoch") and owner and meta.get("owner") == owner:
        return Start(meta["epoch"], finished=True)
    if resume and unfinished:
        # Continue the spool's unfinished run on purpose (e.g. after the whole machine went down).
        spool.set_meta(owner=owner)
        folder, state, skipped = recovery_point(ckpt_dir, meta["epoch"])
        return from_state(meta["epoch"], folder, state, True, skipped)
    if resume:
        # The newest checkpoint of any run, as a new epoch (without a spool, or its run had finished).
        skipped = []
        folder, version, consumed = resume_state(ckpt_dir, skipped)
        if spool is not None:
            spool.start_run(epoch=incarnation, owner=owner, finished=0)
        return from_state(incarnation, folder, {"version": version, "consumed": consumed}, False, skipped)
    if unfinished and (len(spool) or _steps(ckpt_dir)):
        raise UnfinishedRun(  # the options first: the run-end listener quotes the first 240 characters
            f"`areal-bus run --resume` continues the unfinished run in {ckpt_dir.parent}, `areal-bus run --new-run` "
            f"moves it to runs/ and starts anew; a new supervisord does not start over it (run {meta['epoch']}: "
            f"{len(spool)} accepted trajectories in spool/, {len(_steps(ckpt_dir))} checkpoints)")
    moved = set_aside(ckpt_dir, meta.get("epoch", ""))
    if spool is not None:
        spool.start_run(epoch=incarnation, owner=owner, finished=0)
    return Start(incarnation, set_aside=moved)
