"""Poisoned data (issue 17 item 1): a trajectory that passes the wire checks but is unfit for the model
is refused before acceptance (acknowledged ``rejected``, counted, in the spool's dead letters, its
admission slot given back); a batch whose update raises is quarantined after that one try; a trainer
crash does not take rollout workers down. The last test injects poisoned trajectories into a real
tiny-torch run under supervisord: it finishes with no trainer restart and no trajectory lost.

Run: .venv/bin/pytest tests/test_poisoned.py      (the system test is marked slow: about two minutes)
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from areal_bus.wire import messages as m
from areal_bus.wire.codec import Encoder
from areal_bus.runtime.spool import Spool
from areal_bus.trajectory_check import check_trajectory, model_vocab_size, reason_code
from nodes.trainer.recovery import Start
from tests.test_trainer_core import _acks, _core, _states

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "tiny-guess"


def _poison(traj_id: str, *, ids=(5, 6, 7), logprobs=None, versions=None, source="poisoner:1") -> m.Trajectory:
    n = len(ids)
    return m.Trajectory(traj_id=traj_id, episode_id=traj_id, ticket=0, worker="rollout-0",
                        prompt_ids=np.array([1, 2, 3], np.int32), output_ids=np.array(ids, np.int32),
                        logprobs=np.full(n if logprobs is None else logprobs, -0.5, np.float32),
                        versions=np.array([0] * n if versions is None else versions, np.int32),
                        loss_mask=np.ones(n, np.int32), reward=1.0, source=source)


# -- the check --------------------------------------------------------------------------------------
def test_a_consistent_trajectory_passes_and_each_inconsistency_has_its_reason():
    assert check_trajectory(_poison("ok"), vocab_size=99, newest_version=0) is None
    cases = {
        "misaligned": _poison("a", logprobs=2),
        "bad_id": _poison("b", ids=(5, 99, 7)),
        "future_version": _poison("c", versions=(0, 3, 3)),
        "bad_version": _poison("d", versions=(0, -1, 0)),  # a trained token (loss_mask 1) with no version
    }
    for code, traj in cases.items():
        reason = check_trajectory(traj, vocab_size=99, newest_version=2)
        assert reason is not None and reason_code(reason) == code, (code, reason)
    negative = _poison("e", ids=(5, -1, 7))
    assert reason_code(check_trajectory(negative, vocab_size=None, newest_version=None)) == "bad_id"
    nan = _poison("f")
    nan.logprobs[1] = np.nan
    assert reason_code(check_trajectory(nan, vocab_size=None, newest_version=None)) == "bad_number"
    # No vocabulary (a simulated engine), no version bound: only what no model could train on.
    assert check_trajectory(_poison("g", ids=(5, 10**6, 7), versions=(9, 9, 9)), None, None) is None


def test_the_vocabulary_is_read_from_the_checkpoint(tmp_path):
    assert model_vocab_size(TINY) == 99
    assert model_vocab_size(tmp_path) is None


# -- the trainer refuses before it accepts ----------------------------------------------------------
def test_the_trainer_refuses_a_bad_trajectory_with_a_rejected_ack_and_never_queues_it(tmp_path, make_traj):
    spool = Spool(tmp_path / "spool.sqlite", sync_every_ms=0, batch_rows=64)
    try:
        core = _core(spool=spool)
        core.vocab_size = 200
        out = core.receive([_poison("bad", ids=(5, 500, 7)), make_traj("good", source="agent-0:x")])
        assert _acks(out, "rejected") == ["bad"] and _acks(out, "accepted") == []
        assert ("rejected", {"inc": "inc-1", "ids": ["bad"], "reason": "bad_id: output_ids holds 500, vocabulary is 200"}) \
            in out.ledger
        # Its slot comes back: the source's stale total counts it, in the run state that goes out with the ack.
        assert _states(out)[-1].sources["poisoner:1"] == [0, 1]
        assert core.metrics.counters["rejected.bad_id"] == 1
        assert [d["traj_id"] for d in spool.dead_letters("epoch-1")] == ["bad"]
        accepted = core.tick(time.monotonic())
        assert _acks(accepted, "accepted") == ["good"] and list(core.queue.buffer) == ["good"]
        assert spool.ids() == ["good"]
        # A resend of it is a duplicate: acknowledged, never checked or queued again.
        again = core.receive([_poison("bad", ids=(5, 500, 7))])
        assert _acks(again, "duplicate") == ["bad"] and list(core.queue.buffer) == ["good"]
    finally:
        spool.close()


def test_a_batch_whose_update_raised_is_quarantined_and_the_run_goes_on(tmp_path, make_traj):
    spool = Spool(tmp_path / "spool.sqlite", sync_every_ms=0, batch_rows=64)
    try:
        core = _core(spool=spool)
        core.receive([make_traj("a", source="s"), make_traj("b", source="s")])
        core.tick(time.monotonic())
        job = core.next_job(1.0).job
        out = core.on_train_failed(job, "IndexError: index out of range in self", 2.0)
        assert sorted(_acks(out, "rejected")) == ["a", "b"] and core.version == 0
        assert spool.ids() == [] and sorted(d["traj_id"] for d in spool.dead_letters()) == ["a", "b"]
        assert {d["reason"] for d in spool.dead_letters()} == {"train_failed: IndexError: index out of range in self"}
        assert _states(out)[-1].sources == {"s": [0, 2]}
        assert any(level == "error" and name == "train_failed" for level, name, _ in out.logs)
        # The next batch trains.
        core.receive([make_traj("c", source="s"), make_traj("d", source="s")])
        core.tick(time.monotonic())
        assert [t.traj_id for t in core.next_job(3.0).job.batch] == ["c", "d"]
    finally:
        spool.close()


def test_a_recovering_trainer_never_requeues_a_dead_letter_and_counts_its_slot_again(tmp_path, make_traj):
    """Rejected after the last checkpoint: the checkpoint's totals do not have it, the dead letters do."""
    spool = Spool(tmp_path / "spool.sqlite", sync_every_ms=0, batch_rows=64)
    try:
        spool.start_run(epoch="epoch-1", owner="sup", finished=0)
        first = _core(spool=spool)
        first.vocab_size = 200
        first.receive([_poison("bad", ids=(500,)), make_traj("good", source="s")])
        first.tick(time.monotonic())
        # Killed now; restarted from the run's start (no checkpoint yet).
        again = _core(spool=spool, start=Start("epoch-1", recovering=True))
        out = again.begin()
        assert list(again.queue.buffer) == ["good"]
        assert dict(again.totals) == {"poisoner:1": [0, 1]}
        assert _acks(again.receive([_poison("bad", ids=(500,))]), "duplicate") == ["bad"]
        assert not any(name == "spool_bad_rows" for _, name, _ in out.logs)
    finally:
        spool.close()


def test_no_token_may_claim_a_version_the_run_has_not_made_and_a_crash_does_not_lower_that_bound(tmp_path, make_traj):
    spool = Spool(tmp_path / "spool.sqlite", sync_every_ms=0, batch_rows=64)
    try:
        spool.start_run(epoch="epoch-1", owner="sup", finished=0)
        core = _core(spool=spool)
        assert _acks(core.receive([make_traj("early", versions=(1,))]), "rejected") == ["early"]
        core.receive([make_traj("a"), make_traj("b")])
        core.tick(time.monotonic())
        core.on_trained(core.next_job(1.0).job, {"loss": 0.5}, 2.0)
        # Restarted from a checkpoint of version 0: samples of the lost version 1 are still good.
        again = _core(spool=spool, start=Start("epoch-1", recovering=True))
        assert _acks(again.receive([make_traj("late", versions=(1,))]), "rejected") == []
        assert _acks(again.receive([make_traj("forged", versions=(2,))]), "rejected") == ["forged"]
    finally:
        spool.close()


# -- rollout workers outlive the trainer's weights --------------------------------------------------
def test_a_rollout_worker_whose_announced_weights_are_gone_keeps_serving_and_takes_the_next(tmp_path):
    from areal_bus.engines.rollout_factory import make_engine
    from areal_bus.model.modeling import load_pretrained
    from areal_bus.config.topology import load_topology
    from areal_bus.weights.shm import ShmWeightWriter
    from nodes.rollout.core import RolloutCore, StepLog
    from tests.torch_threads import one_torch_thread

    topo = load_topology(ROOT / "topology" / "default.yaml")
    topo = topo.model_copy(update={"endpoints": topo.endpoints.model_copy(update={"ipc_dir": str(tmp_path / "ipc")})})
    with one_torch_thread():
        built = make_engine(topo, "rollout-0", 0, base=ROOT)
        core = RolloutCore(built.engine, "rollout-0", 1, StepLog(topo), release_upto=built.release_upto)
        name = topo.shm_name(ROOT)
        # A crashed trainer's announcement: its buffers are gone.
        gone = m.VersionAnnounce(version=7, location=f"shm:{name}.0@7", nbytes=0, published_at=0.0, lineage="001-a")
        assert core.on_hub([gone]) == []
        assert core.serving.version == 0 and core.metrics.counters["weight_swaps_unavailable"] == 1
        assert core.on_hub([gone]) == [m.VersionAck(node_id="rollout-0", version=0, lineage="")]  # not tried again
        # The restarted trainer's lineage is served as soon as it is announced.
        writer = ShmWeightWriter(name, load_pretrained(TINY).state_dict())
        try:
            location = writer.write(load_pretrained(TINY).state_dict(), 3)
            acks = core.on_hub([m.VersionAnnounce(version=3, location=location, nbytes=writer.nbytes,
                                                  published_at=0.0, lineage="002-b")])
            assert [(a.version, a.lineage) for a in acks] == [(3, "002-b")]
        finally:
            writer.close()


# -- a real run ------------------------------------------------------------------------------------
TORCH_RUN = {
    "max_steps": 6, "trigger_batch_size": 4, "global_batch_size": 4, "mini_batch_size": 4,
    "logging": {"log_dir": "logs", "log_interval": 2, "save_interval": 2},
    "model": {"path": str(TINY), "dtype": "float32", "device": "cpu", "threads": 1},
    "agent": {"framework": "guess", "max_turns": 2, "task_size": 16, "group_size": 4, "reward_source": "rule"},
    "rollout_engine": {"kind": "torch", "max_batch": 8, "max_len": 128, "temperature": 1.0},
    "trainer_engine": {"kind": "torch", "eval_interval": 0},
    "rollout_workers": 1,
}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_poisoned_trajectories_injected_into_a_torch_run_are_rejected_and_the_run_finishes():
    from areal_bus.runtime.ledger import audit, read
    from tests.test_system import System, wait_until

    system = System(TORCH_RUN)
    try:
        system.start()
        wait_until(system.all_running, 120, "every process RUNNING")
        # Sent as soon as the nodes run, the socket kept open to the end: a run of six small updates can be
        # over within a second of its first (a trainer that starts late finds them queued), and poison sent
        # after the first update, its socket closed at once, once arrived after the last.
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 2000)
        push.setsockopt(zmq.RECONNECT_IVL, 10)  # connected within 10 ms of the trainer's bind, not 100
        try:
            push.connect(system.topo.endpoint("train"))
            enc = Encoder("poisoner/test")
            for traj in (_poison("poison-vocab", ids=(5, 10**4, 7)), _poison("poison-misaligned", logprobs=2)):
                push.send_multipart(enc.encode(traj))
            wait_until(lambda: len(system.train_steps()) >= 1, 180, "the first update")
            try:
                rc = system.proc.wait(300)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the run did not finish:\n{system.tail('train.log')}") from None
        finally:
            push.close()
            ctx.term()
        assert rc == 0, system.tail("supervisord.log")
        trainer_log = system.tail("train.log", 60)
        rejected = {i for r in read(system.logs / "ledger" / "trainer-0.jsonl")[0] if r.get("ev") == "rejected"
                    for i in r["ids"]}
        assert rejected == {"poison-vocab", "poison-misaligned"}, trainer_log
        spool = Spool(system.logs / "spool" / "spool.sqlite")
        try:
            assert {d["traj_id"] for d in spool.dead_letters()} == rejected
        finally:
            spool.close()
        result = audit(system.logs)
        assert result["finished"] and result["trainer_incarnations"] == 1, result
        assert result["lost"] == 0 and result["duplicated"] == 0 and result["unknown"] == 0, result
        spawned = [line for line in system.lines("supervisord.log") if "spawned: " in line]
        assert sum("'rollout-0'" in line for line in spawned) == 1, spawned  # never restarted
        assert sum("'trainer-0'" in line for line in spawned) == 1, spawned
    finally:
        system.cleanup()
