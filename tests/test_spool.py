"""The trainer's durable spool: a commit is all or nothing, a process killed with SIGKILL mid-batch
leaves a store that reopens with every committed batch intact and no part of the batch it was
writing, rows read back are the trajectories that went in, and pruning and a new run forget rows."""

from __future__ import annotations

import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from areal_bus.runtime.spool import Spool


def _same(a, b) -> bool:
    return a.traj_id == b.traj_id and a.reward == b.reward and a.source == b.source and all(
        np.array_equal(getattr(a, f), getattr(b, f)) for f in ("prompt_ids", "output_ids", "logprobs", "versions",
                                                               "loss_mask"))


def test_committed_rows_come_back_after_reopening_and_staged_ones_do_not(tmp_path, make_traj):
    path = tmp_path / "spool.sqlite"
    spool = Spool(path, sync_every_ms=1000, batch_rows=100)
    sent = [make_traj(f"t-{i}", versions=(i, i, i + 1), reward=i / 10, source="agent-0:x") for i in range(5)]
    for t in sent[:3]:
        spool.stage(t)
    assert [t.traj_id for t in spool.commit()] == ["t-0", "t-1", "t-2"]
    for t in sent[3:]:
        spool.stage(t)  # never committed: a crash now loses them, and they were never acknowledged
    spool.close()  # closing never commits what is staged: as if the process died here

    again = Spool(path)
    back, bad = again.load()
    assert not bad and len(back) == 3 and all(_same(a, b) for a, b in zip(back, sent[:3]))
    again.close()


def test_a_staged_id_is_staged_once_and_a_commit_is_due_by_time_or_rows(tmp_path, make_traj):
    spool = Spool(tmp_path / "s.sqlite", sync_every_ms=20, batch_rows=3)
    assert spool.due_in(time.monotonic()) is None
    spool.stage(make_traj("a"))
    spool.stage(make_traj("a"))
    assert spool.staged == 1 and spool.is_staged("a")
    assert 0 < spool.due_in(time.monotonic()) <= 0.02
    assert spool.due_in(time.monotonic() + 0.05) == 0
    spool.stage(make_traj("b"))
    spool.stage(make_traj("c"))
    assert spool.due_in(time.monotonic()) == 0  # batch_rows reached
    assert len(spool.commit()) == 3 and len(spool) == 3 and spool.staged == 0
    spool.close()


def test_pruned_rows_go_with_the_next_commit_and_a_new_run_starts_empty(tmp_path, make_traj):
    spool = Spool(tmp_path / "s.sqlite")
    spool.start_run(epoch="e1", owner="o")
    for i in range(4):
        spool.stage(make_traj(f"t-{i}"))
    spool.commit()
    spool.prune(["t-0", "t-2"])
    assert len(spool) == 4
    spool.commit()
    assert spool.ids() == ["t-1", "t-3"]
    assert spool.meta() == {"epoch": "e1", "owner": "o"}
    spool.set_meta(finished=1)
    assert spool.meta()["finished"] == "1"
    spool.start_run(epoch="e2")
    assert len(spool) == 0 and spool.meta() == {"epoch": "e2"}
    spool.close()


def test_a_row_that_does_not_decode_is_reported_not_raised(tmp_path, make_traj):
    spool = Spool(tmp_path / "s.sqlite")
    spool.stage(make_traj("good"))
    spool.commit()
    spool.db.execute("INSERT INTO spool (traj_id, frames) VALUES ('bad', x'c1ff00')")
    back, bad = spool.load()
    assert [t.traj_id for t in back] == ["good"] and bad == ["bad"]
    assert spool.load(skip={"good"})[0] == []
    spool.close()


# A writer in its own process: commits batches of BATCH rows as fast as it can and prints each
# batch number once its commit has returned. The parent kills it with SIGKILL at a random moment,
# usually mid-commit (big rows make the commit most of the loop).
WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from areal_bus.wire import messages as m
    from areal_bus.runtime.spool import Spool

    spool = Spool(sys.argv[1], sync_every_ms=1e6, batch_rows=10**6)
    n = 2000
    for b in range(10**6):
        for i in range({batch}):
            spool.stage(m.Trajectory(traj_id=f"b{{b}}-{{i}}", episode_id="e", ticket=b, worker="w",
                prompt_ids=np.arange(64, dtype=np.int32), output_ids=np.full(n, b, dtype=np.int32),
                logprobs=np.zeros(n, np.float32), versions=np.full(n, b, np.int32), loss_mask=np.ones(n, np.uint8)))
        spool.commit()
        print(b, flush=True)
""")
BATCH = 40


@pytest.mark.timeout(60)
def test_sigkill_mid_batch_leaves_whole_committed_batches_and_nothing_of_the_next(tmp_path):
    rng = random.Random(7)
    for attempt in range(4):
        path = tmp_path / f"s{attempt}.sqlite"
        proc = subprocess.Popen([sys.executable, "-c", WRITER.format(batch=BATCH), str(path)],
                                stdout=subprocess.PIPE, text=True)
        try:
            reported = -1
            while reported < 2:  # a few batches in, then kill at a random point of the next ones
                line = proc.stdout.readline()
                assert line, "writer died on its own"
                reported = int(line)
            time.sleep(rng.uniform(0.0, 0.05))
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            reported = max([reported, *(int(x) for x in proc.stdout.read().split())])
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert proc.returncode == -signal.SIGKILL

        spool = Spool(path)
        assert spool.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        ids = spool.ids()
        batches = sorted({int(i.split("-")[0][1:]) for i in ids})
        # Every batch whose commit returned is there, whole; the one being written is all or nothing.
        assert batches == list(range(len(batches))) and len(batches) - 1 >= reported, (batches, reported)
        assert len(ids) == BATCH * len(batches)
        back, bad = spool.load()
        assert not bad and all(int(t.output_ids[0]) == int(t.traj_id.split("-")[0][1:]) for t in back)
        spool.close()


def test_the_store_is_in_wal_mode(tmp_path):
    Spool(tmp_path / "s.sqlite").close()
    assert sqlite3.connect(tmp_path / "s.sqlite").execute("PRAGMA journal_mode").fetchone()[0] == "wal"
