"""``staleness.drop_at_consume`` on the trainer core (nodes/trainer/core.py): true (the default) drops
every sample over staleness_threshold when its batch forms, so no trained sample is over the bound;
false trains what admission let in, counting those over the threshold per update (``over_bound``)."""

from __future__ import annotations

import numpy as np
import pytest

from areal_bus.wire import messages as m
from areal_bus.config.topology import TopologyError, parse_topology
from nodes.trainer.core import TrainerCore
from nodes.trainer.recovery import Start

STALENESS = 1


def _core(drop: bool | None, version: int = 3, per_token: bool = False) -> TrainerCore:
    data = {"async": {"enabled": True}, "global_batch_size": 4, "trigger_batch_size": 2, "mini_batch_size": 2,
            "staleness_threshold": STALENESS, "max_steps": 1000, "logging": {"save_interval": 0},
            "trainer_engine": {"kind": "sim"}}
    if drop is not None:
        data["staleness"] = {"drop_at_consume": drop, "per_token": per_token}
        data["experimental"] = per_token  # staleness.per_token is experimental: the topology opts in
    return TrainerCore(parse_topology(data), Start("epoch-1", version=version), None, incarnation="inc-1",
                       lineage="001-a")


def _acked(out, kind: str) -> list[str]:
    return [i for _, msg in out.publish if isinstance(msg, m.TrajAck) for i in getattr(msg, kind)]


def test_the_default_is_to_drop_at_consume():
    assert parse_topology({}).staleness.drop_at_consume is True


def test_a_number_for_staleness_is_refused_pointing_at_staleness_threshold():
    with pytest.raises(TopologyError, match=r"staleness: .*staleness_threshold: 2"):
        parse_topology({"staleness": 2}, "t.yaml")


def test_a_wrong_value_is_refused_naming_the_field():
    with pytest.raises(TopologyError, match=r"staleness\.drop_at_consume"):
        parse_topology({"staleness": {"drop_at_consume": "sometimes"}}, "t.yaml")
    with pytest.raises(TopologyError, match=r"staleness\.drop_at_cosume"):
        parse_topology({"staleness": {"drop_at_cosume": False}}, "t.yaml")


def test_drop_at_consume_true_drops_the_over_stale_sample_and_never_trains_it(make_traj):
    core = _core(True)
    core.receive([make_traj("old", versions=(1,), source="s"),  # 3 - 1 = 2 > 1
                  make_traj("a", versions=(2,), source="s"), make_traj("b", versions=(3,), source="s")])
    out = core.next_job(1.0)
    assert _acked(out, "stale") == ["old"] and core.queue.stale == 1
    assert [t.traj_id for t in out.job.batch] == ["a", "b"] and out.job.over_bound == 0
    trained = core.on_trained(out.job, {"loss": 0.1}, 2.0)
    assert trained.steps[0]["over_bound"] == 0 and trained.steps[0]["staleness"] == {"0": 1, "1": 1}
    assert core.totals["s"] == [2, 1]  # the dropped one's admission slot comes back


def test_drop_at_consume_false_trains_the_over_stale_sample_and_counts_it(make_traj):
    core = _core(False)
    core.receive([make_traj("old", versions=(1,), source="s"),
                  make_traj("a", versions=(2,), source="s"), make_traj("b", versions=(3,), source="s")])
    out = core.next_job(1.0)
    assert _acked(out, "stale") == [] and core.queue.stale == 0
    assert [t.traj_id for t in out.job.batch] == ["old", "a", "b"]  # oldest first, as ever
    trained = core.on_trained(out.job, {"loss": 0.1}, 2.0)
    step = trained.steps[0]
    assert step["over_bound"] == 1 and step["staleness"] == {"0": 1, "1": 1, "2": 1} and step["stale_dropped"] == 0
    assert core.metrics.counters["trained_over_bound"] == 1 and "stale_dropped" not in core.metrics.counters
    assert _acked(trained, "consumed") == ["old", "a", "b"] and core.totals["s"] == [3, 0]


@pytest.mark.parametrize("drop", [True, False])
def test_over_many_updates_the_bound_holds_in_the_sense_of_each_policy(make_traj, drop):
    """Samples of random ages arrive update after update. true: nothing trained is over the bound and
    every sample over it was dropped; false: nothing is dropped, and over_bound counts exactly the
    trained samples over it."""
    rng = np.random.default_rng(0)
    core = _core(drop, version=0)
    trained_ages, dropped, over_counted, n = [], 0, 0, 0
    for _ in range(30):
        v = core.version
        fresh = [make_traj(f"t{n + i}", ticket=n + i, versions=(int(max(0, v - rng.integers(0, 4))),), source="s")
                 for i in range(3)]
        n += 3
        core.receive(fresh)
        out = core.next_job(float(v))
        dropped += len(_acked(out, "stale"))
        if out.job is None:
            continue
        trained_ages += [v - t.start_version for t in out.job.batch]
        over_counted += core.on_trained(out.job, {"loss": 0.0}, float(v) + 0.5).steps[0]["over_bound"]
    over = sum(a > STALENESS for a in trained_ages)
    assert len(trained_ages) > 40
    if drop:
        assert over == 0 and over_counted == 0 and dropped > 0
    else:
        assert dropped == 0 and over > 0 and over_counted == over


def test_the_run_state_after_an_update_says_how_many_samples_wait_and_lead_is_a_checked_knob(make_traj):
    """RunState.ready (what staleness.lead: adaptive reads) is the trainer's queue right after an update,
    before the next batch is taken."""
    core = _core(True)
    core.receive([make_traj(t, versions=(3,), source="s") for t in "abcde"])
    out = core.next_job(1.0)
    assert len(out.job.batch) == 4
    trained = core.on_trained(out.job, {"loss": 0.1}, 2.0)
    (state,) = [msg for _, msg in trained.publish if isinstance(msg, m.RunState)]
    assert (state.ready, state.consumed) == (1, 4)
    assert parse_topology({}).staleness.lead == "bound"
    assert parse_topology({"experimental": True, "staleness": {"lead": "adaptive"}}).staleness.lead == "adaptive"
    with pytest.raises(TopologyError, match=r"staleness\.lead"):
        parse_topology({"staleness": {"lead": "sometimes"}}, "t.yaml")


def test_per_token_drops_only_a_sample_whose_newest_token_is_over_the_bound(make_traj):
    """staleness.per_token: a long output whose weights changed under it (versions 1, 1, 2, 3 at trainer
    version 3, bound 1) is trained, its tokens over the bound left to the engine to mask; one whose every
    token is over goes as stale; nothing counts as trained over the bound."""
    core = _core(True, per_token=True)
    core.receive([make_traj("long", versions=(1, 1, 2, 3), source="s"),
                  make_traj("gone", versions=(0, 1, 1), source="s"), make_traj("a", versions=(3,), source="s")])
    out = core.next_job(1.0)
    assert _acked(out, "stale") == ["gone"] and core.queue.stale == 1
    assert [t.traj_id for t in out.job.batch] == ["long", "a"] and out.job.over_bound == 0
    assert core.on_trained(out.job, {"loss": 0.1}, 2.0).steps[0]["over_bound"] == 0
    whole = _core(True)  # the whole-sample rule drops the long one too
    whole.receive([make_traj("long", versions=(1, 1, 2, 3), source="s"), make_traj("a", versions=(3,), source="s"),
                   make_traj("b", versions=(3,), source="s")])
    assert _acked(whole.next_job(1.0), "stale") == ["long"]


def test_per_token_needs_the_drop_and_is_off_by_default():
    assert parse_topology({}).staleness.per_token is False
    with pytest.raises(TopologyError, match=r"per_token applies the bound to each token.*drop_at_consume: true"):
        parse_topology({"staleness": {"drop_at_consume": False, "per_token": True}}, "t.yaml")


def test_in_order_is_off_by_default_and_refused_where_no_bus_agent_would_honour_it():
    assert parse_topology({}).staleness.in_order is False
    assert parse_topology({"staleness": {"in_order": True}}).staleness.in_order is True
    gateway = {"agent": {"via": "gateway", "framework": "guess"}, "rollout_engine": {"kind": "torch"},
               "trainer_engine": {"kind": "torch"}, "nodes": {"gateway": {}}}
    parse_topology(gateway, "t.yaml")
    with pytest.raises(TopologyError, match=r"in_order orders the bus agent's groups.*agent.via 'bus'"):
        parse_topology({**gateway, "staleness": {"in_order": True}}, "t.yaml")
