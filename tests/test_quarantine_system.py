"""A trajectory that kills the trainer in its update, in a real system (issue 17 item 1).

A sim-engine run under supervisord; the trainer is started with the test-only fault
``AREAL_BUS_TEST_CRASH_ON=killer-`` (nodes/trainer/wiring.py: an update whose batch holds such an id
dies of SIGSEGV, as a native crash would). One such trajectory, valid by every check, is pushed on the
train channel mid-run. The trainer dies with it in flight, is restarted by supervisord, trains the
suspects apart until the killer is alone, quarantines it, and the run finishes: the killer in the dead
letters, every other accepted trajectory trained (ledger audit: lost 0, duplicated 0), a few restarts
(no crash loop), no other node restarted, the counts in run_outcome.json.

Run: .venv/bin/python -m pytest -q tests/test_quarantine_system.py      (slow: about a minute)
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import zmq

from areal_bus.wire import messages as m
from areal_bus.wire.codec import Encoder
from areal_bus.runtime.ledger import audit
from areal_bus.runtime.spool import Spool
from tests import test_system
from tests.test_system import System, wait_until

RUN = {"max_steps": 30, "staleness_threshold": 4, "trigger_batch_size": 4, "global_batch_size": 8,
       "logging": {"log_dir": "logs", "log_interval": 2, "save_interval": 5},
       "rollout_workers": 1}


def _killer(version: int) -> m.Trajectory:
    n = 6
    return m.Trajectory(traj_id="killer-1", episode_id="killer-1", ticket=0, worker="rollout-0",
                        prompt_ids=np.arange(1, 9, dtype=np.int32), output_ids=np.arange(10, 10 + n, dtype=np.int32),
                        logprobs=np.full(n, -0.5, np.float32), versions=np.full(n, version, np.int32),
                        loss_mask=np.ones(n, np.int32), reward=1.0, source="poisoner:1")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_trajectory_that_kills_the_trainer_is_quarantined_and_the_run_finishes(monkeypatch):
    monkeypatch.setitem(test_system.ENV, "AREAL_BUS_TEST_CRASH_ON", "killer-")
    system = System(RUN)
    try:
        system.start()
        wait_until(system.all_running, 90, "every process RUNNING")
        wait_until(lambda: len(system.train_steps()) >= 6, 120, "six updates")
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 2000)
        try:
            push.connect(system.topo.endpoint("train"))
            # A version the run has made (a newer one would be refused on arrival as from the future).
            push.send_multipart(Encoder("poisoner/test").encode(_killer(system.train_steps()[-1]["step"])))
        finally:
            push.close()
            ctx.term()
        try:
            rc = system.proc.wait(240)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not finish:\n{system.tail('train.log')}") from None
        train_log = system.tail("train.log", 80)
        assert rc == 0, system.tail("supervisord.log") + "\n" + train_log
        spool = Spool(system.logs / "spool" / "spool.sqlite")
        try:
            dead = spool.dead_letters()
        finally:
            spool.close()
        assert [d["traj_id"] for d in dead] == ["killer-1"], train_log
        assert dead[0]["reason"].startswith("killed_trainer: "), dead
        result = audit(system.logs)
        assert result["finished"] and result["quarantined"] == 1, result
        assert result["lost"] == 0 and result["duplicated"] == 0 and result["unknown"] == 0, result
        assert result["quarantined_and_trained"] == 0, result
        # A batch is at most 8: at most 1 + log2(8) deaths before the killer is alone, then one more start.
        assert 2 <= result["trainer_incarnations"] <= 5, result
        spawned = [line for line in system.lines("supervisord.log") if "spawned: " in line]
        assert sum("'trainer-0'" in line for line in spawned) == result["trainer_incarnations"], spawned
        for node in ("rollout-0", "agent-0", "reward-0", "weights-0", "bus-0"):
            assert sum(f"'{node}'" in line for line in spawned) == 1, (node, spawned)  # never restarted
        assert any("quarantined_killer" in line for line in system.lines("train.log")), train_log
        outcome = json.loads((system.logs / "run_outcome.json").read_text())
        assert outcome["trainer"]["quarantined"] == 1 and outcome["trainer"]["steps"] == RUN["max_steps"], outcome
    finally:
        system.cleanup()
