"""Crash safety: a node killed with SIGKILL mid-run is restarted by supervisord, the run completes, and
the ledger's audit finds every accepted trajectory trained on exactly once or dropped as stale (none
lost, none twice) in the final lineage. bench/chaos.py does the same over every node kind, many times.

Run: .venv/bin/pytest tests/test_crash.py      (about a minute; the system tests are marked slow)
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from areal_bus.wire import messages as m
from areal_bus.runtime.ledger import audit
from nodes.weights import VersionBook
from tests.test_system import System, wait_until

CHECKPOINTED = {
    "max_steps": 40,
    "logging": {"log_dir": "logs", "log_interval": 5, "save_interval": 5},
    # Decoding a little slower than test_system's quick run, so the kill lands mid-run.
    "rollout_engine": {"kind": "sim", "max_batch": 8, "decode_step_s": 0.003, "decode_step_per_seq_s": 0.00001,
                       "swap_s": 0.001, "output_len": {"dist": "uniform", "min": 8, "max": 32}},
}


@pytest.fixture
def system():
    made = System(CHECKPOINTED)
    yield made
    made.cleanup()


def _kill_mid_run(system: System, process: str, after_steps: int) -> None:
    system.start()
    wait_until(system.all_running, 60, "every process RUNNING")
    wait_until(lambda: len(system.train_steps()) >= after_steps, 60, f"{after_steps} updates")
    old = system.pid(process)
    os.kill(old, signal.SIGKILL)

    def restarted():
        system.assert_alive()
        state, pid = system.status().get(process, (None, None))
        return state == "RUNNING" and pid not in (None, old)
    wait_until(restarted, 30, f"supervisord to restart {process}")


def _finish(system: System) -> dict:
    try:
        rc = system.proc.wait(90)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the run did not finish after the kill:\n{system.tail('train.log')}") from None
    assert rc == 0, system.tail("supervisord.log")
    assert not system.tracebacks()
    return audit(system.logs)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_killed_trainer_resumes_from_its_checkpoint_and_no_accepted_trajectory_is_lost_or_trained_twice(system):
    _kill_mid_run(system, "trainer-0", after_steps=12)
    result = _finish(system)
    assert result["finished"] and result["accepted"] > 0, result
    assert result["lost"] == 0 and result["duplicated"] == 0 and result["unknown"] == 0, result
    # The finished model's lineage runs through the checkpoint the restarted trainer resumed from.
    assert result["trainer_incarnations"] == 2 and result["lineage_segments"] == 2, result
    recovered = [line for line in system.lines("train.log") if line.startswith("[train] recovered ")]
    assert len(recovered) == 1 and " version=0 " not in recovered[0], recovered


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_killed_reward_node_loses_no_trajectory_it_held(system):
    _kill_mid_run(system, "reward-0", after_steps=12)
    result = _finish(system)
    assert result["finished"] and result["lost"] == 0 and result["duplicated"] == 0 and result["unknown"] == 0, result
    assert result["trainer_incarnations"] == 1, result
    assert any("resent" in line and "reward-0 restarted" in line for line in system.lines("agent.log"))


def test_a_restarted_trainers_lineage_is_announced_though_its_version_is_lower():
    book = VersionBook()
    assert book.current is None and book.newly_committed(["rollout-0"]) is None  # nothing told yet: nothing said
    assert book.offer(m.WeightsReady(version=30, location="", nbytes=0, lineage="001-a")) is not None
    book.ack("rollout-0", 30, "001-a")
    assert book.newly_committed(["rollout-0"]) == 30
    assert book.offer(m.WeightsReady(version=29, location="", nbytes=0, lineage="001-a")) is None  # older
    # The trainer restarted from its checkpoint at version 25: a new lineage, announced as newer.
    ann = book.offer(m.WeightsReady(version=25, location="", nbytes=0, lineage="002-b"))
    assert ann is not None and (ann.version, ann.lineage) == (25, "002-b")
    assert book.newly_committed(["rollout-0"]) is None  # the worker still serves the old lineage's 30
    book.ack("rollout-0", 25, "002-b")
    assert book.newly_committed(["rollout-0"]) == 25


def test_only_the_supervisord_that_started_a_run_recovers_it(tmp_path, make_traj):
    from areal_bus.runtime.spool import Spool
    from nodes.trainer.recovery import plan_start, write_run_state

    ckpt = tmp_path / "checkpoints"
    spool = Spool(tmp_path / "spool.sqlite")
    first = plan_start(spool, ckpt, resume=False, incarnation="inc1", owner="sup-1")
    assert (first.epoch, first.version, first.recovering) == ("inc1", 0, False)
    for i in range(3):
        spool.stage(make_traj(f"t-{i}"))
    spool.commit()
    (ckpt / "step_5").mkdir(parents=True)
    write_run_state(ckpt / "step_5", {"version": 5, "epoch": "inc1", "inc": "inc1", "consumed": ["t-0"],
                                      "sources": {"a:1": [1, 0]}, "trained": 1})
    # Restarted by the same supervisord: the run goes on from its checkpoint, spool and all.
    again = plan_start(spool, ckpt, resume=False, incarnation="inc2", owner="sup-1")
    assert (again.epoch, again.version, again.ckpt_inc, again.recovering) == ("inc1", 5, "inc1", True)
    assert again.consumed == ["t-0"] and again.sources == {"a:1": [1, 0]} and len(spool) == 3
    # Explicitly resumed under a new supervisord: the same.
    resumed = plan_start(spool, ckpt, resume=True, incarnation="inc3", owner="sup-2")
    assert (resumed.epoch, resumed.version, resumed.recovering) == ("inc1", 5, True)
    # A finished run stays finished for its supervisord.
    spool.set_meta(finished=1)
    assert plan_start(spool, ckpt, resume=False, incarnation="inc4", owner="sup-2").finished
    # Started by a new supervisord without --resume: a new run, and the old spool is forgotten.
    fresh = plan_start(spool, ckpt, resume=False, incarnation="inc5", owner="sup-3")
    assert (fresh.epoch, fresh.version, fresh.recovering, len(spool)) == ("inc5", 0, False, 0)
    spool.close()
