"""The trainer's durable spool: every trajectory it has accepted and no checkpoint covers yet.

SQLite in WAL mode, one file (``<log_dir>/spool/spool.sqlite``), written only by the trainer's main
thread. A received trajectory is first *staged* (in memory); staged rows are committed together, in
one transaction, once the oldest has waited ``sync_every_ms`` or ``batch_rows`` are staged. Only a
committed row is *accepted*: the trainer then queues it for training and tells its producers, who
forget it (``TrajAck.accepted``). A row leaves the spool once a durable checkpoint lists its id as
consumed (trained on or dropped as stale); until then a restarted trainer re-queues it.

Why this is enough for exactly-once: a commit is atomic (WAL: a process killed mid-transaction
leaves the last committed state), a producer forgets a trajectory only after the commit that holds
it, and a row is deleted only after a checkpoint that covers it is on disk. So after a crash every
accepted trajectory is either in the newest checkpoint's consumed ids (it is part of the lineage
the trainer resumes) or still in the spool (it is re-queued, once, by id).

``synchronous=NORMAL`` (the default) survives any process crash, kill -9 included, without a disk
flush per commit; ``fsync=True`` (synchronous=FULL) also survives power loss, at one flush per commit.
Copying the WAL back into the database (a WAL checkpoint, which flushes the disk) is left to a
thread of its own, so the trainer's main thread only ever appends to the WAL.

The ``dead`` table (dead letters) holds what the trainer refused for good: a trajectory unfit for the
model (``check_trajectory``) or one whose update raised. It is written at once, in its own
transaction, before the rejection is acknowledged, survives new runs (it is a record for people; rows
carry their run's epoch), and is never re-queued: a poisoned row cannot crash-loop a restarted trainer.

A trajectory can also kill the trainer outright (a segfault or an OOM kill inside the update): no
exception to catch. So the trainer marks the batch it trains *in flight* (``set_in_flight``, committed
before the update starts, cleared after it returns). A restarted trainer that finds a batch still in
flight (``take_in_flight``) adds one to each of its rows' deaths in the ``suspect`` table; the trainer
then trains suspects apart from other rows, halving the set each time the process dies with them in
flight, and a row that was in flight alone when the trainer died is quarantined (nodes/trainer/core.py).

Rows are the trajectory encoded by the project's codec (a msgpack list of its frames), decoded with
the same checks as anything off the wire: no pickle.

Run: used by nodes/trainer/ (core.py, wiring.py); tests/test_spool.py.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

import msgpack

from areal_bus.wire.codec import DecodeError, Encoder, decode
from areal_bus.wire.messages import Trajectory

WAL_CHECKPOINT_S = 1.0
"""How often the checkpoint thread copies the WAL into the database. SQLite's own default would do it
inside a commit every ~4 MB, on the trainer's main thread, with a disk flush (measured: it tripled the
cost of a commit); once a second keeps the WAL to about a second of accepted trajectories."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS spool (seq INTEGER PRIMARY KEY AUTOINCREMENT, traj_id TEXT NOT NULL UNIQUE,
                                  frames BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS dead (traj_id TEXT PRIMARY KEY, epoch TEXT NOT NULL, source TEXT NOT NULL,
                                 reason TEXT NOT NULL, at REAL NOT NULL, frames BLOB);
CREATE TABLE IF NOT EXISTS suspect (traj_id TEXT PRIMARY KEY, deaths INTEGER NOT NULL);
"""
IN_FLIGHT = "in_flight"
"""The meta key of the batch being trained: a JSON list of its ids, present only while an update runs."""


def pack(traj: Trajectory, encoder: Encoder) -> bytes:
    """One blob: the codec's frames (header and raw arrays) as a msgpack list of bytes."""
    return msgpack.packb(encoder.encode(traj), use_bin_type=True)


def unpack(blob: bytes) -> Trajectory:
    """The trajectory in ``blob``; DecodeError if it is not one (checked like a frame off the wire)."""
    try:
        frames = msgpack.unpackb(blob, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage; all mean the same
        raise DecodeError("bad_spool_row", type(exc).__name__) from None
    if not isinstance(frames, list) or not all(isinstance(f, bytes) for f in frames):
        raise DecodeError("bad_spool_row", "not a list of frames")
    _, msg = decode(frames)
    if not isinstance(msg, Trajectory):
        raise DecodeError("bad_spool_row", type(msg).__name__)
    return msg


class Spool:
    """Staged rows, batched commits, a run marker, pruning. Not thread-safe: one thread uses it."""

    def __init__(self, path: str | Path, sync_every_ms: float = 5.0, batch_rows: int = 64, fsync: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.sync_every_s = sync_every_ms / 1000.0
        self.batch_rows = batch_rows
        # isolation_level=None: no implicit transactions; every write below is in an explicit BEGIN.
        self.db = sqlite3.connect(self.path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
        self.db.execute("PRAGMA wal_autocheckpoint=0")  # the checkpoint thread does it
        self.db.executescript(SCHEMA)
        self._stop = threading.Event()
        self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="spool-checkpoint", daemon=True)
        self._checkpointer.start()
        self.encoder = Encoder("trainer/spool")
        self._staged: dict[str, tuple[Trajectory, bytes]] = {}
        self._staged_at: float | None = None
        self._prune: list[str] = []
        self.commits = 0
        self.busy_seconds = 0.0  # encoding staged rows and committing them: durability's whole cost

    # -- the run this spool belongs to ---------------------------------------------------------
    def meta(self) -> dict[str, str]:
        return dict(self.db.execute("SELECT key, value FROM meta"))

    def start_run(self, **meta: str) -> None:
        """A new run: forget every row and set the run's metadata (one transaction)."""
        self.db.execute("BEGIN IMMEDIATE")
        self.db.execute("DELETE FROM spool")
        self.db.execute("DELETE FROM meta")
        self.db.execute("DELETE FROM suspect")
        self.db.executemany("INSERT INTO meta VALUES (?, ?)", [(k, str(v)) for k, v in meta.items()])
        self.db.execute("COMMIT")

    def set_meta(self, **meta: str) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        self.db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", [(k, str(v)) for k, v in meta.items()])
        self.db.execute("COMMIT")

    # -- accepting ------------------------------------------------------------------------------
    def stage(self, traj: Trajectory) -> None:
        """Hold ``traj`` for the next commit (a second copy of a staged id is ignored)."""
        if traj.traj_id in self._staged:
            return
        t0 = time.perf_counter()
        if not self._staged:
            self._staged_at = time.monotonic()
        self._staged[traj.traj_id] = (traj, pack(traj, self.encoder))
        self.busy_seconds += time.perf_counter() - t0

    def is_staged(self, traj_id: str) -> bool:
        return traj_id in self._staged

    @property
    def staged(self) -> int:
        return len(self._staged)

    def due_in(self, now: float) -> float | None:
        """Seconds until the staged rows must be committed (0: now); None when nothing is staged."""
        if not self._staged:
            return None
        if len(self._staged) >= self.batch_rows:
            return 0.0
        return max(0.0, self._staged_at + self.sync_every_s - now)

    def commit(self) -> list[Trajectory]:
        """Make the staged rows (and pending prunes) durable in one transaction; the accepted
        trajectories, in arrival order. Rows already in the spool are kept as they are."""
        if not self._staged and not self._prune:
            return []
        t0 = time.perf_counter()
        rows = [(tid, blob) for tid, (_, blob) in self._staged.items()]
        self.db.execute("BEGIN IMMEDIATE")
        self.db.executemany("INSERT OR IGNORE INTO spool (traj_id, frames) VALUES (?, ?)", rows)
        if self._prune:
            self.db.executemany("DELETE FROM spool WHERE traj_id = ?", [(t,) for t in self._prune])
        self.db.execute("COMMIT")
        accepted = [traj for traj, _ in self._staged.values()]
        self._staged.clear()
        self._prune.clear()
        self._staged_at = None
        self.commits += 1
        self.busy_seconds += time.perf_counter() - t0
        return accepted

    # -- leaving --------------------------------------------------------------------------------
    def prune(self, traj_ids) -> None:
        """Delete these rows with the next commit (a checkpoint that covers them is on disk)."""
        self._prune.extend(traj_ids)

    def quarantine(self, trajs, reason: str, epoch: str) -> None:
        """Move these trajectories to the dead letters with ``reason`` (one transaction, at once):
        their spool rows, staged or committed, go in the same transaction, so no restart re-queues them."""
        if not trajs:
            return
        now = time.time()
        rows = [(t.traj_id, epoch, t.source, reason[:2000], now, pack(t, self.encoder)) for t in trajs]
        self.db.execute("BEGIN IMMEDIATE")
        self.db.executemany("INSERT OR REPLACE INTO dead VALUES (?, ?, ?, ?, ?, ?)", rows)
        self.db.executemany("DELETE FROM spool WHERE traj_id = ?", [(t.traj_id,) for t in trajs])
        self.db.executemany("DELETE FROM suspect WHERE traj_id = ?", [(t.traj_id,) for t in trajs])
        self.db.execute("COMMIT")
        for t in trajs:
            self._staged.pop(t.traj_id, None)
        if not self._staged:
            self._staged_at = None

    # -- what kills the trainer ---------------------------------------------------------------
    def set_in_flight(self, traj_ids) -> None:
        """The update of these rows starts now (committed before it does: a process that dies inside it
        leaves the mark for its successor)."""
        self.set_meta(**{IN_FLIGHT: json.dumps(list(traj_ids))})

    def clear_in_flight(self, cleared=()) -> None:
        """The update returned (trained, or raised and quarantined): no batch is in flight, and rows of
        ``cleared`` are suspects no more. One transaction."""
        self.db.execute("BEGIN IMMEDIATE")
        self.db.execute("DELETE FROM meta WHERE key = ?", (IN_FLIGHT,))
        self.db.executemany("DELETE FROM suspect WHERE traj_id = ?", [(t,) for t in cleared])
        self.db.execute("COMMIT")

    def take_in_flight(self) -> list[str]:
        """At recovery: the ids of the batch the previous process had in flight when it died (none if it
        died between updates), each now counted one more death in ``suspects``. One transaction."""
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (IN_FLIGHT,)).fetchone()
        if row is None:
            return []
        ids = [str(t) for t in json.loads(row[0])]
        self.db.execute("BEGIN IMMEDIATE")
        self.db.executemany("INSERT INTO suspect VALUES (?, 1) ON CONFLICT(traj_id) DO UPDATE SET deaths = deaths + 1",
                            [(t,) for t in ids])
        self.db.execute("DELETE FROM meta WHERE key = ?", (IN_FLIGHT,))
        self.db.execute("COMMIT")
        return ids

    def suspects(self) -> dict[str, int]:
        """{traj_id: deaths}: rows that were in flight when a trainer process died, not yet cleared."""
        return dict(self.db.execute("SELECT traj_id, deaths FROM suspect"))

    def acquit(self, traj_ids) -> None:
        """These rows are suspects no more (the row that killed the trainer was found)."""
        self.db.execute("BEGIN IMMEDIATE")
        self.db.executemany("DELETE FROM suspect WHERE traj_id = ?", [(t,) for t in traj_ids])
        self.db.execute("COMMIT")

    def dead_letters(self, epoch: str | None = None) -> list[dict]:
        """The dead letters (of run ``epoch``, or all), oldest first: traj_id, epoch, source, reason, at."""
        sql = "SELECT traj_id, epoch, source, reason, at FROM dead"
        args = ()
        if epoch is not None:
            sql, args = sql + " WHERE epoch = ?", (epoch,)
        cols = ("traj_id", "epoch", "source", "reason", "at")
        return [dict(zip(cols, r)) for r in self.db.execute(sql + " ORDER BY at", args)]

    # -- recovery -------------------------------------------------------------------------------
    def ids(self) -> list[str]:
        """Every row's id, in acceptance order."""
        return [r[0] for r in self.db.execute("SELECT traj_id FROM spool ORDER BY seq")]

    def load(self, skip=frozenset()) -> tuple[list[Trajectory], list[str]]:
        """(the rows whose id is not in ``skip``, in acceptance order; ids of rows that would not decode).
        A row that does not decode cannot be trained on; the caller counts it."""
        out, bad = [], []
        for tid, blob in self.db.execute("SELECT traj_id, frames FROM spool ORDER BY seq"):
            if tid in skip:
                continue
            try:
                out.append(unpack(blob))
            except DecodeError:
                bad.append(tid)
        return out, bad

    def __len__(self) -> int:
        return self.db.execute("SELECT count(*) FROM spool").fetchone()[0]

    def _checkpoint_loop(self) -> None:
        db = sqlite3.connect(self.path, isolation_level=None)  # a connection is used by one thread only
        try:
            while not self._stop.wait(WAL_CHECKPOINT_S):
                # PASSIVE: copies what is committed without waiting for (or blocking) the writer.
                db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            db.close()

    def close(self) -> None:
        self._stop.set()
        self._checkpointer.join()
        self.db.close()
