"""A trajectory that kills the trainer process outright (issue 17 item 1): the batch in flight is marked
in the spool before its update, a restarted trainer trains those rows apart, halving the set each time
it dies with them, and quarantines the row that was in flight alone when it died; the others train,
the slot comes back, nothing crash-loops. A trainer killed from outside mid-update loses nothing and
quarantines nothing.

The trainer's core (no sockets) on a real SQLite spool; a "death" is a core abandoned mid-update and a
new one recovering from the same spool, as a restarted process does. The whole system under
supervisord, with a real SIGSEGV in the update: tests/test_quarantine_system.py.

Run: .venv/bin/python -m pytest -q tests/test_quarantine.py
"""

from __future__ import annotations

import math
import time

from areal_bus.runtime.spool import Spool
from nodes.trainer.recovery import Start
from tests.test_trainer_core import _acks, _core, _states

RUN = {"trigger_batch_size": 8, "global_batch_size": 8, "staleness_threshold": 4}


def _spool(tmp_path) -> Spool:
    spool = Spool(tmp_path / "spool.sqlite", sync_every_ms=0, batch_rows=64)
    spool.start_run(epoch="epoch-1", owner="sup", finished=0)
    return spool


def _accept(core, trajs) -> None:
    core.receive(trajs)
    core.tick(time.monotonic())


def _restart(spool, **over):
    """A new trainer process of the same run (no checkpoint: it recovers from the run's start)."""
    core = _core(spool=spool, start=Start("epoch-1", recovering=True), **(over or RUN))
    return core, core.begin()


def _events(out, level: str) -> list[str]:
    return [name for lv, name, _ in out.logs if lv == level]


def test_the_in_flight_mark_survives_the_process_and_counts_one_death_per_row(tmp_path):
    spool = _spool(tmp_path)
    try:
        spool.set_in_flight(["a", "b"])
        assert spool.take_in_flight() == ["a", "b"] and spool.suspects() == {"a": 1, "b": 1}
        assert spool.take_in_flight() == []  # taken once: the next restart finds no batch in flight
        spool.set_in_flight(["a"])
        assert spool.take_in_flight() == ["a"] and spool.suspects() == {"a": 2, "b": 1}
        spool.set_in_flight(["b"])
        spool.clear_in_flight(["b"])  # its update returned
        assert spool.take_in_flight() == [] and spool.suspects() == {"a": 2}
    finally:
        spool.close()


def test_a_trainer_killed_mid_update_from_outside_trains_the_batch_in_two_halves_and_quarantines_nothing(
        tmp_path, make_traj):
    spool = _spool(tmp_path)
    try:
        first = _core(spool=spool, **RUN)
        _accept(first, [make_traj(f"t{i}", ticket=i, source="s") for i in range(8)])
        assert len(first.next_job(1.0).job.batch) == 8  # and then kill -9, mid-update
        core, out = _restart(spool)
        assert "died_in_update" in _events(out, "error") and len(core.suspects) == 8
        assert _acks(out, "rejected") == []
        sizes = []
        while core.suspects:
            job = core.next_job(2.0).job
            assert job.probe, "suspects are trained before anything else"
            sizes.append(len(job.batch))
            core.on_trained(job, {"loss": 0.5}, 3.0)
        assert sizes == [4, 4] and core.trained == 8
        assert spool.dead_letters() == [] and spool.suspects() == {}
        # Nothing is in flight any more: the next restart finds no suspect.
        assert not _restart(spool)[0].suspects
    finally:
        spool.close()


def test_the_row_that_kills_the_trainer_is_quarantined_and_the_rest_of_its_batch_trains(tmp_path, make_traj):
    spool = _spool(tmp_path)
    killer = "t5"
    try:
        core = _core(spool=spool, **RUN)
        _accept(core, [make_traj(f"t{i}", ticket=i, source="s") for i in range(8)])
        deaths, quarantined_at = 0, None
        while deaths < 10:
            job = core.next_job(1.0).job
            if job is None and quarantined_at is not None and "t8" not in core.queue.seen:
                _accept(core, [make_traj("t8", ticket=8, source="s")])  # 7 rows are left: one more makes a batch
                continue
            if job is None:
                break
            if killer in {t.traj_id for t in job.batch}:  # the update kills the process: nothing returns
                deaths += 1
                core, out = _restart(spool)
                if _acks(out, "rejected"):
                    quarantined_at = deaths
                    assert _acks(out, "rejected") == [killer]
                    assert "quarantined_killer" in _events(out, "error")
                    assert _states(out)[-1].sources["s"] == [0, 1]  # the admission slot comes back
                continue
            core.on_trained(job, {"loss": 0.5}, 2.0)
        assert quarantined_at is not None, "the killer was never quarantined"
        assert deaths == quarantined_at <= 1 + math.ceil(math.log2(8)), deaths  # never a crash loop
        dead = spool.dead_letters("epoch-1")
        assert [d["traj_id"] for d in dead] == [killer] and dead[0]["reason"].startswith("killed_trainer: ")
        assert core.trained == 8 and core.metrics.counters["quarantined"] == 1
        assert dict(core.totals) == {"s": [8, 1]}
        assert spool.suspects() == {}
        # A resend of it is a duplicate, never trained.
        assert _acks(core.receive([make_traj(killer, source="s")]), "duplicate") == [killer]
    finally:
        spool.close()


def test_a_lone_row_that_kills_the_trainer_is_quarantined_after_its_one_try(tmp_path, make_traj):
    spool = _spool(tmp_path)
    try:
        lone = {"trigger_batch_size": 1, "global_batch_size": 1, "mini_batch_size": 1}
        core = _core(spool=spool, **lone)
        _accept(core, [make_traj("k", source="s")])
        assert [t.traj_id for t in core.next_job(1.0).job.batch] == ["k"]  # dies in it
        again, out = _restart(spool, **lone)
        assert _acks(out, "rejected") == ["k"] and not again.suspects and not again.queue.buffer
        assert [d["traj_id"] for d in spool.dead_letters()] == ["k"]
    finally:
        spool.close()


def test_a_resend_of_a_suspect_is_a_duplicate_and_suspects_count_against_the_queue(tmp_path, make_traj):
    spool = _spool(tmp_path)
    try:
        first = _core(spool=spool, **RUN)
        _accept(first, [make_traj(f"t{i}", ticket=i, source="s") for i in range(8)])
        first.next_job(1.0)
        core, _ = _restart(spool)
        assert _acks(core.receive([make_traj("t3", source="s")]), "duplicate") == ["t3"]
        assert core.room() == core.queue.capacity - 8
        # Still unconsumed when the run ends: the ledger's final word names them.
        assert sorted(core.finish().ledger[0][1]["unconsumed"]) == sorted(f"t{i}" for i in range(8))
    finally:
        spool.close()
