"""The trajectory ledger: which ids were produced, accepted, trained on and dropped, and the audit
that checks none was lost or trained twice.

Files, one per writing node, under ``<log_dir>/ledger/`` (appended across restarts; each record is
one JSON line on an O_APPEND descriptor, written whole or its write raises: ``AppendFile``):

  agent-<n>.jsonl, gateway-<n>.jsonl   {"ev": "produced", "ids": [...]}      an episode source emitted these
  trainer-0.jsonl                      {"ev": "start", "inc", "epoch", "resumed_step", "ckpt_inc"}
                                       {"ev": "accepted", "inc", "ids"}     durable (committed to the spool)
                                       {"ev": "step", "inc", "step", "ids"} update step -> step+1 trained these
                                       {"ev": "stale", "inc", "version", "ids"}  dropped as over-stale at version
                                       {"ev": "checkpoint", "inc", "version"}    a checkpoint of version is on disk
                                       {"ev": "finished", "inc", "version", "unconsumed"}  accepted, untrained at the end

The trainer writes "accepted" after the spool commit and before it acknowledges, and "step" /
"stale" before it acknowledges and before any checkpoint that covers them; so the ledger is never
behind what a producer or a checkpoint relies on.

The final lineage is what the finished model was trained on: the finishing incarnation's steps,
then, going back through the checkpoint it resumed from (written by an earlier incarnation at
version K), that incarnation's steps and stale drops below K, and so on to a fresh start. Steps of
an incarnation after the checkpoint its successor resumed from were lost with its weights: their
trajectories are in the spool and are trained again (``retrained``), which is no duplicate.

A record can still be torn: a kill -9 inside a write, or a full disk (a short write, then ENOSPC:
the write raises ``LedgerWriteError`` and the node dies loudly, before the acknowledgement the record
explains; supervisord restarts it, and once space returns it writes again). The next record written to
that file starts on a new line, and the reader resynchronises on the start of a record (``{"ev":``,
which json.dumps never writes inside a string), so a damaged record is counted (``torn_lines``) and
costs no whole record around it, and no id of a torn record is attributed to anything.

Run: python -c "from areal_bus.runtime.ledger import audit; print(audit('logs'))"
"""

from __future__ import annotations

import collections
import errno
import json
import os
import time
from pathlib import Path


class LedgerWriteError(OSError):
    """A ledger record that could not be written whole (disk full, a file size limit). Not caught:
    the node must stop before it acknowledges what the record would have said."""


class AppendFile:
    """An O_APPEND file written one whole line at a time. ``os.write`` may write less than it was
    given (a full disk writes what fits, then raises ENOSPC on the next call): ``append`` writes the
    rest, or raises with how much of the line got out. A line after a torn one starts on a new line,
    whoever tore it (this process, or the incarnation before it), so a torn line damages itself only."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(self.fd).st_size
        self.at_line_start = size == 0 or os.pread(self.fd, 1, size - 1) == b"\n"

    def append(self, line: bytes) -> None:
        """Write ``line`` (ending in a newline) whole, or raise OSError."""
        data = memoryview(line if self.at_line_start else b"\n" + line)
        done = 0
        while done < len(data):
            n = os.write(self.fd, data[done:])  # raises once nothing at all fits
            if n == 0:  # not seen on Linux; never loop on it
                raise OSError(errno.EIO, f"write() wrote nothing to {self.path}")
            done += n
            self.at_line_start = data[done - 1] == ord("\n")

    def close(self) -> None:
        os.close(self.fd)


class Ledger:
    """Append-only JSON lines, each written whole (``AppendFile``) or raising LedgerWriteError."""

    def __init__(self, path: str | Path):
        self.file = AppendFile(path)

    def write(self, ev: str, **fields) -> None:
        line = (json.dumps({"ev": ev, "t": round(time.time(), 3), **fields}, separators=(",", ":")) + "\n").encode()
        try:
            self.file.append(line)
        except OSError as err:
            raise LedgerWriteError(err.errno, f"ledger {self.file.path}: a {ev!r} record of {len(line)} bytes "
                                   f"could not be written ({os.strerror(err.errno or errno.EIO)}); this node stops "
                                   f"here, before acknowledging it. Free space on that disk: supervisord restarts "
                                   f"the node, and the record is written again") from err

    def close(self) -> None:
        self.file.close()


def ledger_path(log_dir: str | Path, node_id: str) -> Path:
    return Path(log_dir) / "ledger" / f"{node_id}.jsonl"


RECORD_START = b'{"ev":'
"""Every record starts so (``ev`` is its first key) and nothing inside one does (json.dumps escapes
the quotes of a string), so it is where a reader resynchronises after a damaged record."""


def read(path: str | Path) -> tuple[list[dict], int]:
    """(records, damaged records skipped). Each line is cut at every record start, so a torn record
    glued to the next one (a short write, then a restart's first record) costs itself only. A record
    is ASCII (json.dumps escapes the rest): one with any other byte in it is damaged, never read."""
    out, damaged = [], 0
    for line in Path(path).read_bytes().splitlines():
        starts = list(_starts(line))
        if not starts or starts[0] != 0:  # bytes before the first record start: the rest of something torn
            starts.insert(0, 0)
        for a, b in zip(starts, [*starts[1:], len(line)]):
            text = line[a:b].decode("latin-1")  # any byte decodes; the ASCII check below refuses the rest
            try:
                rec, end = _DECODER.raw_decode(text)
            except ValueError:
                rec, end = None, 0
            if isinstance(rec, dict) and "ev" in rec and text[:end].isascii():
                out.append(rec)
            else:
                end = 0
            if text[end:].strip():  # a torn record, or bytes after a whole one
                damaged += 1
    return out, damaged


_DECODER = json.JSONDecoder()


def _starts(line: bytes):
    i = line.find(RECORD_START)
    while i != -1:
        yield i
        i = line.find(RECORD_START, i + 1)


def audit(log_dir: str | Path, trainer: str = "trainer-0") -> dict:
    """Counts over trajectory ids: produced, accepted, trained and stale in the final lineage,
    unconsumed at the end, lost (accepted, yet none of those: must be 0), duplicated (trained or
    dropped more than once in the final lineage: must be 0), and more, for the chaos table."""
    folder = Path(log_dir) / "ledger"
    recs, torn = read(folder / f"{trainer}.jsonl")
    produced: set[str] = set()
    for path in sorted(folder.glob("*.jsonl")):
        if path.name == f"{trainer}.jsonl":
            continue
        got, bad = read(path)
        torn += bad
        for r in got:
            if r.get("ev") == "produced":
                produced.update(r["ids"])
    by_ev = collections.defaultdict(list)
    for r in recs:
        by_ev[r.get("ev")].append(r)
    accepted = {i for r in by_ev["accepted"] for i in r["ids"]}
    starts = {r["inc"]: r for r in by_ev["start"]}
    # The last finish counts: a trainer killed after writing it but before marking its spool finished
    # is restarted and finishes again, from its newest checkpoint.
    finished = by_ev["finished"][-1] if by_ev["finished"] else None
    # The final lineage, newest segment first: (incarnation, versions below which its records count).
    segments: list[tuple[str, float]] = []
    inc, upto = (finished["inc"], float("inf")) if finished else (None, 0.0)
    while inc is not None and inc in starts and len(segments) <= len(starts):
        segments.append((inc, upto))
        start = starts[inc]
        inc, upto = start.get("ckpt_inc"), start.get("resumed_step", 0)
    in_lineage = dict(segments)
    trained, stale, dead = collections.Counter(), collections.Counter(), set()
    for r in by_ev["step"]:
        if r["inc"] in in_lineage and r["step"] < in_lineage[r["inc"]]:
            trained.update(r["ids"])
        else:
            dead.update(r["ids"])
    for r in by_ev["stale"]:
        if r["inc"] in in_lineage and r["version"] < in_lineage[r["inc"]]:
            stale.update(r["ids"])
    unconsumed = set(finished["unconsumed"]) if finished else set()
    settled = set(trained) | set(stale)
    # Refused for good (dead letters, in every lineage): before acceptance (rejected) or after it, by a
    # failed or fatal update (quarantined). Neither is lost; a quarantined id also trained is a bug.
    refused = {i for r in by_ev["rejected"] for i in r["ids"]}
    return {
        "produced": len(produced),
        "accepted": len(accepted),
        "trained": len(trained),
        "dropped_stale": len(stale),
        "unconsumed_at_end": len(unconsumed - settled),
        "lost": len(accepted - settled - unconsumed - refused),
        "rejected": len(refused - accepted),
        "quarantined": len(refused & accepted),
        "quarantined_and_trained": len(refused & set(trained)),
        "duplicated": sum(c - 1 for c in trained.values()) + sum(c - 1 for c in stale.values())
        + len(set(trained) & set(stale)),
        "not_accepted": len(produced - accepted),  # in flight at the end, or died with a killed producer
        "unknown": len((settled | unconsumed) - accepted),  # settled but never accepted: must be 0
        "retrained": len(dead & set(trained)),  # trained by a lineage a crash lost, then again
        "trainer_incarnations": len(starts),
        "lineage_segments": len(segments),
        "finished": finished is not None,
        "torn_lines": torn,
    }
