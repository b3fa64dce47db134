"""The trajectory ledger: which ids were produced, accepted, trained on and dropped, and the audit
that checks none was lost or trained twice.

Files, one per writing node, under ``<log_dir>/ledger/`` (appended across restarts; each record is
one ``write()`` of one JSON line on an O_APPEND descriptor, so a kill -9 leaves whole lines, at most
a torn last one, which the reader skips):

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

Run: python -c "from areal_bus.ledger import audit; print(audit('logs'))"
"""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path


class Ledger:
    """Append-only JSON lines, one ``write()`` each."""

    def __init__(self, path: str | Path):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, ev: str, **fields) -> None:
        os.write(self.fd, (json.dumps({"ev": ev, "t": round(time.time(), 3), **fields},
                                      separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        os.close(self.fd)


def ledger_path(log_dir: str | Path, node_id: str) -> Path:
    return Path(log_dir) / "ledger" / f"{node_id}.jsonl"


def read(path: str | Path) -> tuple[list[dict], int]:
    """(records, torn lines skipped)."""
    out, torn = [], 0
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            torn += 1
            continue
        if isinstance(rec, dict):
            out.append(rec)
        else:
            torn += 1
    return out, torn


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
    return {
        "produced": len(produced),
        "accepted": len(accepted),
        "trained": len(trained),
        "dropped_stale": len(stale),
        "unconsumed_at_end": len(unconsumed - settled),
        "lost": len(accepted - settled - unconsumed),
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
