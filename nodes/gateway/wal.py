"""The gateway's write-ahead log: what a 2xx has promised, kept on disk until the trainer has it.

One SQLite file in WAL mode (``<log_dir>/spool/<node id>.wal.sqlite``, beside the trainer's spool and
kept or moved aside with it), written only by the gateway's event-loop thread:

- ``sessions``: each open session (id, sha256 digest of its key's secret, ticket, group, meta). Never a
  key: the digest is what ``SessionStore.authenticate`` compares, so a resumed session's key keeps
  working and a copied file opens nothing.
- ``journal``: each recorded turn (the branch point it continued, the environment tokens, every choice's
  Completion and canonical messages) and each reward, in order, so replaying them through
  ``SessionStore.record`` / ``reward`` rebuilds the session as it was, branches and index included.
- ``responses``: each stored Responses API response of an open session (its id, the response it continued,
  the messages it added), so that a ``previous_response_id`` still continues it after a restart.
- ``ended``: each ended session's trajectories (the project codec's frames, as the trainer's spool keeps
  them) until a TrajAck names them: accepted, consumed, stale, duplicate (or rejected).

Every write is its own transaction, committed before the handler answers: a 2xx on a chat turn means the
turn is on disk, a 2xx on /end means the trajectory is. ``synchronous=NORMAL`` survives any process
crash (kill -9 included) without a disk flush per commit, as the spool's default does; ``fsync=True``
also survives power loss, at a flush per commit. A commit costs tens of microseconds (measured in
tests/test_gateway_wal.py), so there is no group commit: batching would delay every reply to save what
is a small part of a turn's latency.

A restarted gateway resumes its open sessions rather than ending them: an agent whose connection
dropped retries the same messages with the same key and carries on, and its episode is trained whole
instead of cut where the process died (what an ended stub would be: a reward for half an episode).
Ended trajectories are sent again; the trainer drops a second copy by id.

Run: used by nodes/gateway/sessions.py (SessionStore) and app.py; tests/test_gateway_wal.py.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import msgpack
import numpy as np

from areal_bus.wire.codec import DecodeError, Encoder, decode
from areal_bus.wire.messages import Completion, Trajectory
from areal_bus.runtime.spool import pack, unpack

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (sid TEXT PRIMARY KEY, key_hash BLOB NOT NULL, ticket INTEGER NOT NULL,
                                     group_id TEXT NOT NULL, meta TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS journal (seq INTEGER PRIMARY KEY AUTOINCREMENT, sid TEXT NOT NULL, body BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS journal_sid ON journal (sid);
CREATE TABLE IF NOT EXISTS ended (seq INTEGER PRIMARY KEY AUTOINCREMENT, traj_id TEXT NOT NULL UNIQUE,
                                  frames BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS responses (seq INTEGER PRIMARY KEY AUTOINCREMENT, owner TEXT NOT NULL, rid TEXT NOT NULL,
                                      parent TEXT, messages TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS responses_owner ON responses (owner);
"""


def wal_path(log_dir: str | Path, node_id: str) -> Path:
    return Path(log_dir) / "spool" / f"{node_id}.wal.sqlite"


def _tuples(x):
    """msgpack gives lists back; canonical messages are tuples (hashed and compared as such)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _ids(a) -> bytes | None:
    return None if a is None else np.asarray(a, dtype=np.int32).tobytes()


class GatewayWAL:
    """Open sessions, their turns and rewards, ended trajectories not yet acknowledged. One thread."""

    def __init__(self, path: str | Path, fsync: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None)  # explicit transactions only
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
        self.db.executescript(SCHEMA)
        self.encoder = Encoder("gateway/wal")
        self.commits = 0
        # Ids in ``ended``: every TrajAck goes to every producer, so most ids an ack names are not ours,
        # and a delete (a commit) per ack would cost the loop for nothing.
        self.unsettled: set[str] = {r[0] for r in self.db.execute("SELECT traj_id FROM ended")}

    def _write(self, sql_rows: list[tuple[str, list]]) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            for sql, rows in sql_rows:
                self.db.executemany(sql, rows)
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")
        self.commits += 1

    # -- writes (each committed before the caller answers) ------------------------------------------
    def opened(self, session) -> None:
        self._write([("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?)",
                      [(session.id, session.key_hash, session.ticket, session.group_id, json.dumps(session.meta))])])

    def turn(self, sid: str, base_idx: int | None, prompt_ids, env_ids, tools_key: str, first: int | None,
             choices) -> None:
        body = {"t": "turn", "base": base_idx, "prompt": _ids(prompt_ids) if base_idx is None else None,
                "env": _ids(env_ids), "tools": tools_key, "first": first,
                "choices": [[pack(c.completion, self.encoder), c.closed, new, c.temperature] for c, new in choices]}
        self._write([("INSERT INTO journal (sid, body) VALUES (?, ?)", [(sid, msgpack.packb(body, use_bin_type=True))])])

    def reward(self, sid: str, value: float, index: int | None, discount: float | None) -> None:
        body = {"t": "reward", "value": value, "index": index, "discount": discount}
        self._write([("INSERT INTO journal (sid, body) VALUES (?, ?)", [(sid, msgpack.packb(body, use_bin_type=True))])])

    def response(self, owner: str, rid: str, parent: str | None, messages: list[dict]) -> None:
        """A stored response of session ``owner``: what ``previous_response_id: rid`` continues. Its
        messages as JSON, what they came in and go out as (msgpack would refuse an integer past 64 bits)."""
        self._write([("INSERT INTO responses (owner, rid, parent, messages) VALUES (?, ?, ?, ?)",
                      [(owner, rid, parent, json.dumps(messages))])])

    def ended(self, sid: str, trajs: list[Trajectory]) -> None:
        """The session's trajectories replace its record, in one transaction."""
        self._write([("INSERT OR REPLACE INTO ended (traj_id, frames) VALUES (?, ?)",
                      [(t.traj_id, pack(t, self.encoder)) for t in trajs]),
                     ("DELETE FROM journal WHERE sid = ?", [(sid,)]),
                     ("DELETE FROM responses WHERE owner = ?", [(sid,)]),
                     ("DELETE FROM sessions WHERE sid = ?", [(sid,)])])
        self.unsettled.update(t.traj_id for t in trajs)

    def forget(self, traj_ids) -> None:
        """The trainer has these (a TrajAck named them): they need no resending."""
        ours = [t for t in traj_ids if t in self.unsettled]
        if ours:
            self._write([("DELETE FROM ended WHERE traj_id = ?", [(t,) for t in ours])])
            self.unsettled.difference_update(ours)

    # -- reads (at start) ---------------------------------------------------------------------------
    def pending(self) -> tuple[list[Trajectory], list[str]]:
        """(ended trajectories not yet acknowledged, in end order; ids of rows that would not decode)."""
        out, bad = [], []
        for tid, blob in self.db.execute("SELECT traj_id, frames FROM ended ORDER BY seq"):
            try:
                out.append(unpack(blob))
            except DecodeError:
                bad.append(tid)
        return out, bad

    def open_sessions(self):
        """Each open session as (sid, key_hash, ticket, group_id, meta, [journal entries in order]); an
        entry is a dict: a turn ("t": "turn", its choices' Completions decoded) or a reward."""
        journal: dict[str, list] = {}
        for sid, blob in self.db.execute("SELECT sid, body FROM journal ORDER BY seq"):
            body = msgpack.unpackb(blob, raw=False)
            if body["t"] == "turn":
                body["choices"] = [(_completion(c), closed, _tuples(new), temp)
                                   for c, closed, new, temp in body["choices"]]
            journal.setdefault(sid, []).append(body)
        return [(sid, bytes(key_hash), ticket, group_id, json.loads(meta), journal.get(sid, []))
                for sid, key_hash, ticket, group_id, meta in self.db.execute("SELECT * FROM sessions")]

    def responses(self):
        """Each stored response as (owner, rid, parent, messages), in the order they were answered."""
        return [(owner, rid, parent, json.loads(blob))
                for owner, rid, parent, blob in self.db.execute("SELECT owner, rid, parent, messages FROM responses "
                                                                 "ORDER BY seq")]

    def counts(self) -> dict[str, int]:
        return {t: self.db.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                for t in ("sessions", "journal", "ended", "responses")}

    def close(self) -> None:
        self.db.close()


def _completion(blob: bytes) -> Completion:
    frames = msgpack.unpackb(blob, raw=False)
    _, msg = decode(frames)
    if not isinstance(msg, Completion):
        raise DecodeError("bad_wal_row", type(msg).__name__)
    return msg
