"""TrainerCore without sockets: what the trainer accepts, when it trains, and in which order it tells
producers (batch forming, stale drop, duplicate suppression, spool-before-ack), and where a trainer
process starts (plan_start). TrainQueue's own rules are in tests/test_trainqueue.py."""

from __future__ import annotations

import time

import pytest

from areal_bus.wire import messages as m
from areal_bus.runtime.spool import Spool
from areal_bus.config.topology import parse_topology
from nodes.trainer.core import TrainerCore
from nodes.trainer.recovery import Start, plan_start, write_run_state


def _topo(**over):
    data = {"async": {"enabled": True}, "global_batch_size": 4, "trigger_batch_size": 2, "mini_batch_size": 2,
            "staleness_threshold": 1, "max_steps": 100, "logging": {"save_interval": 0},
            "trainer_engine": {"kind": "sim"}}
    data.update(over)
    return parse_topology(data)


def _core(spool=None, start=None, **over) -> TrainerCore:
    return TrainerCore(_topo(**over), start or Start("epoch-1"), spool, incarnation="inc-1", lineage="001-a")


def _acks(out, kind: str) -> list[str]:
    return [i for _, msg in out.publish if isinstance(msg, m.TrajAck) for i in getattr(msg, kind)]


def _states(out) -> list[m.RunState]:
    return [msg for _, msg in out.publish if isinstance(msg, m.RunState)]


def _train(core: TrainerCore, now: float = 1.0):
    """Hand out the next update and finish it at once: (its job, the core's answer)."""
    job = core.next_job(now).job
    assert job is not None and job.kind == "train"
    return job, core.on_trained(job, {"loss": 0.5}, now)


# -- batch forming ----------------------------------------------------------------------------------
def test_async_mode_trains_once_the_trigger_is_reached_oldest_version_first(make_traj):
    core = _core(start=Start("epoch-1", version=1))  # samples of version 1 exist once it is made
    core.receive([make_traj("new", ticket=0, versions=(1,))])
    assert core.next_job(0.0).job is None  # one sample, trigger 2
    core.receive([make_traj("old", ticket=5, versions=(0,)), make_traj("newer", ticket=1, versions=(1,))])
    job = core.next_job(0.0).job
    assert [t.traj_id for t in job.batch] == ["old", "new", "newer"]  # version, then ticket; up to the batch


def test_sync_mode_waits_for_exactly_the_global_batch(make_traj):
    core = _core(**{"async": {"enabled": False}})
    core.receive([make_traj(f"t-{i}", ticket=i) for i in range(3)])
    assert core.next_job(0.0).job is None  # past trigger_batch_size, short of global_batch_size
    core.receive([make_traj("t-3", ticket=3), make_traj("t-4", ticket=4)])
    assert [t.traj_id for t in core.next_job(0.0).job.batch] == ["t-0", "t-1", "t-2", "t-3"]


def test_a_finished_update_advances_the_version_exports_it_and_acks_its_samples(make_traj):
    core = _core()
    core.receive([make_traj("a", source="agent-0:x"), make_traj("b", source="agent-0:x")])
    job, out = _train(core)
    assert core.policy.version == 1 and out.export == 1
    assert _acks(out, "consumed") == ["a", "b"]
    assert out.ledger[0] == ("step", {"inc": "inc-1", "step": 0, "ids": ["a", "b"]})
    state = _states(out)[-1]
    assert (state.version, state.consumed, state.lineage, state.sources) == (1, 2, "001-a", {"agent-0:x": [2, 0]})


def test_the_trained_total_is_the_core_state_and_continues_across_a_resume(make_traj):
    core = _core(start=Start("epoch-1", version=3, consumed=["x", "y"], trained=2, sources={"s": [2, 0]}))
    core.receive([make_traj("a", versions=(3,), source="s"), make_traj("b", versions=(3,), source="s")])
    _, out = _train(core)
    state = _states(out)[-1]
    assert (state.version, state.consumed, state.sources) == (4, 4, {"s": [4, 0]})
    assert core.metrics.counters["samples"] == 2  # the metric counts this process, the state the run


def test_a_save_is_due_at_the_save_interval_and_covers_what_was_consumed_since(make_traj):
    core = _core(logging={"save_interval": 1})
    core.receive([make_traj("a"), make_traj("b")])
    _, out = _train(core)
    save = out.job
    assert save.kind == "save" and save.version == 1 and save.covers == ["a", "b"]
    assert save.state["consumed"] == ["a", "b"] and save.state["trained"] == 2 and save.state["epoch"] == "epoch-1"
    assert core.unpruned == []


# -- stale drop -------------------------------------------------------------------------------------
def test_over_stale_samples_are_dropped_counted_per_source_and_acked_as_stale(make_traj):
    core = _core(start=Start("epoch-1", version=3))
    core.receive([make_traj("old", versions=(1,), source="agent-0:x"),  # 3 - 1 = 2 > staleness 1
                  make_traj("ok", versions=(2,), source="agent-1:y")])
    out = core.next_job(1.0)
    assert _acks(out, "stale") == ["old"] and core.queue.stale == 1
    assert ("stale", {"inc": "inc-1", "version": 3, "ids": ["old"]}) in out.ledger
    assert _states(out)[-1].sources == {"agent-0:x": [0, 1]}
    assert out.job is None and list(core.queue.buffer) == ["ok"]
    assert core.metrics.counters["stale_dropped"] == 1


def test_an_update_carries_its_groups_dropped_members_as_their_baseline(make_traj):
    core = _core(start=Start("epoch-1", version=3), agent={"group_size": 2})
    core.receive([make_traj("g-0", ticket=0, versions=(1,), group_id="g", reward=0.0),  # over-stale
                  make_traj("g-1", ticket=1, versions=(2,), group_id="g", reward=1.0),
                  make_traj("h-0", ticket=2, versions=(2,), group_id="h", reward=1.0),
                  make_traj("h-1", ticket=3, versions=(2,), group_id="h", reward=0.0)])
    job = core.next_job(1.0).job
    assert sorted(t.traj_id for t in job.batch) == ["g-1", "h-0", "h-1"]
    assert job.baseline == [("g", 0.0)]
    assert job.split_groups == 0  # g's other member was dropped: g is whole


def test_an_update_that_takes_groups_in_part_counts_them_in_its_record(make_traj):
    core = _core(agent={"group_size": 2})
    core.receive([make_traj(f"{g}-0", ticket=i, group_id=g) for i, g in enumerate("abcd")])  # first members only
    job = core.next_job(1.0).job  # a global batch of incomplete groups: taken as they are
    assert job.split_groups == 4
    out = core.on_trained(job, {"loss": 0.1}, 2.0)
    assert out.steps[0]["split_groups"] == 4 and core.metrics.counters["split_groups"] == 4


def test_the_late_members_of_a_group_taken_in_part_get_their_whole_group_advantages(make_traj):
    """The short answers (right) come first and the overflow trains them; the long ones (wrong) come
    after. Judged among themselves the long ones are all equal: advantage 0, nothing learned. Judged
    against the whole group (their baseline: the first part's rewards) they get what GRPO over all
    four gives them."""
    from areal_bus.train.loss import grpo_advantages

    core = _core(agent={"group_size": 4})
    core.receive([make_traj(f"{g}-{i}", ticket=10 * k + i, group_id=g, reward=1.0)
                  for k, g in enumerate("ab") for i in range(2)])
    first = core.next_job(1.0).job
    assert first.split_groups == 2 and first.baseline == []
    core.on_trained(first, {"loss": 0.1}, 2.0)
    core.receive([make_traj(f"{g}-{i}", ticket=10 * k + i, group_id=g, reward=0.0)
                  for k, g in enumerate("ab") for i in range(2, 4)])
    job = core.next_job(3.0).job
    assert sorted(t.traj_id for t in job.batch) == ["a-2", "a-3", "b-2", "b-3"] and job.split_groups == 0
    rewards = [t.reward for t in job.batch] + [r for _, r in job.baseline]
    groups = [t.group_id for t in job.batch] + [g for g, _ in job.baseline]
    late = grpo_advantages(rewards, groups)[: len(job.batch)]
    whole = grpo_advantages([1.0, 1.0, 0.0, 0.0], ["a"] * 4)[2:]
    assert late.tolist() == pytest.approx(whole.tolist() * 2) and late.max() < -0.9


# -- duplicate suppression --------------------------------------------------------------------------
def test_a_resent_id_is_acked_as_a_duplicate_and_not_queued_twice(make_traj):
    core = _core()
    core.receive([make_traj("a")])
    out = core.receive([make_traj("a", ticket=9)])
    assert _acks(out, "duplicate") == ["a"] and len(core.queue.buffer) == 1


def test_an_id_trained_before_a_resume_is_a_duplicate(make_traj):
    core = _core(start=Start("epoch-1", version=2, consumed=["a"], trained=1))
    out = core.receive([make_traj("a", versions=(2,))])
    assert _acks(out, "duplicate") == ["a"] and not core.queue.buffer


# -- spool before ack -------------------------------------------------------------------------------
def test_with_a_spool_a_trajectory_is_acked_accepted_only_after_its_commit(tmp_path, make_traj):
    spool = Spool(tmp_path / "spool.sqlite", sync_every_ms=1000, batch_rows=64)
    try:
        core = _core(spool=spool)
        out = core.receive([make_traj("a"), make_traj("b")])
        assert _acks(out, "accepted") == [] and len(spool) == 0 and not core.queue.buffer
        assert _acks(core.tick(time.monotonic()), "accepted") == []  # staged, not due yet: nothing said
        out = core.tick(time.monotonic() + 1.0)  # the oldest staged row has waited sync_every_ms
        assert len(spool) == 2 and _acks(out, "accepted") == ["a", "b"]
        assert out.ledger == [("accepted", {"inc": "inc-1", "ids": ["a", "b"]})]  # recorded before the ack
        assert sorted(core.queue.buffer) == ["a", "b"]
    finally:
        spool.close()


def test_without_a_spool_nothing_is_acked_accepted(make_traj):
    core = _core()
    out = core.receive([make_traj("a")])
    assert _acks(out, "accepted") == [] and list(core.queue.buffer) == ["a"]
    assert out.ledger == [("accepted", {"inc": "inc-1", "ids": ["a"]})]


def test_spool_rows_are_pruned_only_once_a_later_checkpoint_than_the_one_covering_them_is_saved(tmp_path,
                                                                                                make_traj):
    spool = Spool(tmp_path / "spool.sqlite", sync_every_ms=0, batch_rows=1)
    try:
        core = _core(spool=spool, logging={"save_interval": 1})
        core.receive([make_traj("a"), make_traj("b")])
        core.tick(time.monotonic())
        _, out = _train(core)
        assert len(spool) == 2  # trained, but no checkpoint holds them yet
        out = core.on_saved(out.job, 2.0)
        assert out.ledger[0] == ("checkpoint", {"inc": "inc-1", "version": 1})
        # Kept while step_1 is the newest checkpoint: were it found bad, recovery falls back one and
        # re-queues them from here.
        assert sorted(spool.ids()) == ["a", "b"]
        core.receive([make_traj("c", versions=(1,)), make_traj("d", versions=(1,))])
        core.tick(time.monotonic())
        _, out = _train(core, 3.0)
        core.on_saved(out.job, 4.0)
        assert sorted(spool.ids()) == ["c", "d"]  # step_2 sealed: what step_1 covered goes
    finally:
        spool.close()


def test_a_recovering_core_requeues_the_spooled_rows_its_checkpoint_does_not_cover(tmp_path, make_traj):
    spool = Spool(tmp_path / "spool.sqlite")
    try:
        for tid in ("a", "b", "c"):
            spool.stage(make_traj(tid))
        spool.commit()
        core = _core(spool=spool, start=Start("epoch-1", version=5, consumed=["a"], trained=1, recovering=True))
        out = core.begin()
        assert sorted(core.queue.buffer) == ["b", "c"]  # "a" is in the checkpoint
        assert ("accepted", {"inc": "inc-1", "ids": ["b", "c"]}) in out.ledger and out.export == 5
        spool.commit()
        # The covered row stays until a checkpoint after the one it is in is sealed.
        assert spool.ids() == ["a", "b", "c"]
    finally:
        spool.close()


# -- the hub ----------------------------------------------------------------------------------------
def test_a_committed_version_of_this_lineage_releases_older_buffers_and_others_do_not():
    core = _core()
    assert core.on_hub([m.VersionCommitted(version=4, lineage="000-old")]).release == []
    assert core.on_hub([m.VersionCommitted(version=4, lineage="001-a")]).release == [2, 3]


def test_a_restarted_broadcaster_is_told_the_newest_weights_again():
    core = _core()
    core.on_exported(0, "loc", 10)
    out = core.on_hub([m.Event(name="peer_restarted", node_id="weights-0", fields={"kind": "weights"})])
    assert out.ready is not None and (out.ready.version, out.ready.lineage) == (0, "001-a")


def _broadcaster_says(version: int) -> m.Heartbeat:
    return m.Heartbeat(node_id="weights-0", kind="weights", incarnation="i2", pid=1, t=0.0, version=version,
                       counters={}, gauges={}, hists={})


def test_a_broadcaster_whose_heartbeats_stay_behind_the_newest_export_is_sent_it_again():
    """The resend on peer_restarted is one message; the heartbeats say what the broadcaster holds, so a
    lost WeightsReady is sent again once they have said the same older version for READY_RESEND_S, and
    again every READY_RESEND_S until they catch up. Older but moving (training outpacing the beats), no
    heartbeat since the last resend (a stopped broadcaster), or a relay's heartbeat: nothing."""
    core = _core()
    core.on_exported(7, "loc", 10)
    core.tick(100.0)
    core.on_hub([_broadcaster_says(6)])
    assert core.tick(100.5).ready is None  # behind: the wait starts
    core.on_hub([_broadcaster_says(7)])  # caught up
    assert core.tick(103.0).ready is None
    core.on_exported(8, "loc", 10)
    for t, version in ((103.5, 7), (105.0, 7), (106.0, 7)):  # the same older version, 2.5 s
        core.on_hub([_broadcaster_says(version)])
        out = core.tick(t)
    assert out.ready is not None and out.ready.version == 8
    assert ("warning", "weights_ready_resent", {"version": 8, "broadcaster_version": 7}) in out.logs
    assert core.tick(107.0).ready is None and core.tick(108.1).ready is None  # not heard since: stopped?
    core.on_hub([_broadcaster_says(7)])
    assert core.tick(108.2).ready.version == 8  # beating, still behind: again, READY_RESEND_S on
    core.on_exported(20, "loc", 10)
    for beat in range(10):  # moving, one version a beat for 5 s, and behind all along
        core.on_hub([_broadcaster_says(9 + beat)])
        assert core.tick(109.0 + beat / 2).ready is None
    relay = m.Heartbeat(node_id="weights-1", kind="weights", incarnation="r", pid=2, t=0.0, version=0,
                        counters={}, gauges={}, hists={})
    core.on_hub([_broadcaster_says(20), relay])  # caught up; a relay's older version is not the broadcaster's
    assert core.tick(120.0).ready is None and core.tick(130.0).ready is None


# -- the resume plan --------------------------------------------------------------------------------
@pytest.fixture
def spool(tmp_path):
    made = Spool(tmp_path / "spool.sqlite")
    yield made
    made.close()


def test_a_fresh_run_starts_at_version_zero_with_an_empty_spool(tmp_path, spool, make_traj):
    spool.stage(make_traj("left-over"))
    spool.commit()
    start = plan_start(spool, tmp_path / "ckpt", resume=False, incarnation="inc1", owner="sup-1")
    assert (start.epoch, start.version, start.folder, start.recovering, start.finished) == \
        ("inc1", 0, None, False, False)
    assert len(spool) == 0


def test_a_crash_under_the_same_supervisord_recovers_the_run_from_its_checkpoint(tmp_path, spool):
    ckpt = tmp_path / "ckpt"
    plan_start(spool, ckpt, resume=False, incarnation="inc1", owner="sup-1")
    (ckpt / "step_5").mkdir(parents=True)
    write_run_state(ckpt / "step_5", {"version": 5, "epoch": "inc1", "inc": "inc1", "consumed": ["t-0"],
                                      "sources": {"s": [1, 0]}, "trained": 1})
    (ckpt / "step_7").mkdir()  # a save killed before its run state: not a recovery point
    again = plan_start(spool, ckpt, resume=False, incarnation="inc2", owner="sup-1")
    assert (again.epoch, again.version, again.folder, again.ckpt_inc, again.recovering) == \
        ("inc1", 5, ckpt / "step_5", "inc1", True)
    assert (again.consumed, again.sources, again.trained) == (["t-0"], {"s": [1, 0]}, 1)


def test_a_group_split_across_a_crash_keeps_its_gone_members_rewards_and_is_whole(tmp_path, spool, make_traj):
    """Before: both were in memory only, so after a restart the group's last member waited GROUP_WAIT_S for
    a mate that had gone before the crash, and then trained with itself alone as its GRPO baseline."""
    ckpt = tmp_path / "ckpt"
    plan_start(spool, ckpt, resume=False, incarnation="inc1", owner="sup-1")
    over = {"agent": {"group_size": 2}, "logging": {"save_interval": 1}}
    core = _core(spool=spool, start=Start("inc1", version=3), **over)
    core.receive([make_traj("g-0", ticket=0, versions=(1,), group_id="g", reward=0.0),  # over-stale at 3
                  make_traj("h-0", ticket=1, versions=(3,), group_id="h", reward=1.0),
                  make_traj("h-1", ticket=2, versions=(3,), group_id="h", reward=0.0)])
    core.tick(time.monotonic() + 1.0)
    job, out = _train(core)
    assert [t.traj_id for t in job.batch] == ["h-0", "h-1"] and job.baseline == []
    (ckpt / "step_4").mkdir(parents=True)
    write_run_state(ckpt / "step_4", out.job.state)  # the save after the update; then the trainer dies
    again = plan_start(spool, ckpt, resume=False, incarnation="inc2", owner="sup-1")
    core = TrainerCore(_topo(**over), again, spool, incarnation="inc2", lineage="002-b")
    core.begin()
    core.receive([make_traj("g-1", ticket=3, versions=(3,), group_id="g", reward=1.0),
                  make_traj("k-0", ticket=4, versions=(4,), group_id="k", reward=1.0),
                  make_traj("k-1", ticket=5, versions=(4,), group_id="k", reward=0.0)])
    core.tick(time.monotonic() + 1.0)
    job = core.next_job(2.0).job  # g is whole at once: its other member went before the crash
    assert job is not None and [t.traj_id for t in job.batch] == ["g-1", "k-0", "k-1"]
    assert job.baseline == [("g", 0.0)]  # and the dropped member's reward is still in its baseline


def test_a_checkpoint_that_names_them_dropped_rewards_still_restores_them(tmp_path, spool):
    ckpt = tmp_path / "ckpt"
    plan_start(spool, ckpt, resume=False, incarnation="inc1", owner="sup-1")
    (ckpt / "step_2").mkdir(parents=True)
    write_run_state(ckpt / "step_2", {"version": 2, "epoch": "inc1", "inc": "inc1", "consumed": [], "sources": {},
                                      "trained": 0, "dropped_rewards": {"g": [0.5]}, "group_left": {"g": 1}})
    again = plan_start(spool, ckpt, resume=False, incarnation="inc2", owner="sup-1")
    assert (again.version, again.gone_rewards, again.group_left) == (2, {"g": [0.5]}, {"g": 1})


def test_resume_under_a_new_supervisord_continues_the_unfinished_run(tmp_path, spool):
    ckpt = tmp_path / "ckpt"
    plan_start(spool, ckpt, resume=False, incarnation="inc1", owner="sup-1")
    (ckpt / "step_3").mkdir(parents=True)
    write_run_state(ckpt / "step_3", {"version": 3, "epoch": "inc1", "inc": "inc1", "consumed": []})
    resumed = plan_start(spool, ckpt, resume=True, incarnation="inc2", owner="sup-2")
    assert (resumed.epoch, resumed.version, resumed.recovering) == ("inc1", 3, True)


def test_a_finished_run_stays_finished_for_its_supervisord(tmp_path, spool):
    plan_start(spool, tmp_path / "ckpt", resume=False, incarnation="inc1", owner="sup-1")
    spool.set_meta(finished=1)
    assert plan_start(spool, tmp_path / "ckpt", resume=False, incarnation="inc2", owner="sup-1").finished


def test_the_end_records_the_ledger_then_marks_the_spool_then_stops_the_agents(tmp_path, spool, make_traj):
    core = _core(spool=spool, max_steps=1)
    core.receive([make_traj("a"), make_traj("b"), make_traj("c")])
    core.tick(time.monotonic() + 1.0)
    _train(core)
    end = core.finish()
    assert end.ledger[0][0] == "finished" and spool.meta().get("finished") != "1"
    out = core.finished(2.0)
    assert spool.meta()["finished"] == "1" and _states(out)[-1].finished
