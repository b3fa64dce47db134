"""Staleness rules: the admission capacity (an episode starts only if it can be consumed within
``staleness`` versions) and the consumption bound, by hand cases and by simulating a run."""

from __future__ import annotations

import collections
import itertools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_bus.wire import messages as m
from areal_bus.admission import Admission, Sources, capacity, group_stall, is_over_stale, staleness_of
from areal_bus.constants import SOURCE_GONE_S
from areal_bus.version import PolicyVersion


@pytest.mark.parametrize("version, staleness, batch, admitted, expected", [
    (0, 2, 4, 0, 12),    # (2 + 0 + 1) * 4
    (0, 2, 4, 12, 0),    # all of it taken
    (1, 2, 4, 12, 4),    # one update later: one more batch
    (5, 2, 4, 20, 12),   # (2 + 5 + 1) * 4 - 20
    (0, 0, 8, 0, 8),     # synchronous: one batch
    (3, 0, 8, 32, 0),
    (0, 2, 4, 50, 0),    # over-admitted (e.g. after a version regression): never negative
])
def test_capacity_matches_the_formula(version, staleness, batch, admitted, expected):
    assert capacity(version, staleness, batch, admitted) == expected


@pytest.mark.parametrize("trainer_version, start_version, staleness, over", [
    (5, 3, 2, False),   # exactly at the bound is still fine
    (5, 2, 2, True),
    (4, 4, 0, False),
    (4, 3, 0, True),
    (0, 0, 0, False),
])
def test_over_stale_means_more_than_staleness_versions_behind(trainer_version, start_version, staleness, over):
    assert staleness_of(trainer_version, start_version) == trainer_version - start_version
    assert is_over_stale(trainer_version, start_version, staleness) is over


@settings(max_examples=300)
@given(
    staleness=st.integers(0, 4),
    batch=st.integers(1, 6),
    lag=st.integers(0, 3),
    plan=st.lists(st.one_of(st.just("step"), st.integers(1, 20)), max_size=60),
)
def test_fifo_consumption_never_sees_an_over_stale_admission(staleness, batch, lag, plan):
    """Admit what the rule allows, knowing the trainer's progress up to ``lag`` updates late; the
    trainer consumes ``batch`` per update in admission order: no sample is consumed more than
    ``staleness`` versions after the version it was admitted under."""
    adm = Admission(staleness, batch)
    queue: collections.deque[int] = collections.deque()  # admission version of each waiting sample
    reports = [(0, 0)]  # (version, consumed) as the trainer publishes them
    for op in plan:
        if op == "step":
            if len(queue) < batch:
                continue  # the trainer waits for a full batch
            version = reports[-1][0]
            for _ in range(batch):
                assert not is_over_stale(version, queue.popleft(), staleness)
            reports.append((version + 1, reports[-1][1] + batch))
        else:
            known_version, known_consumed = reports[max(0, len(reports) - 1 - lag)]
            adm.observe(PolicyVersion("t1", known_version), known_consumed)
            adm.consume(known_consumed - adm.consumed)  # the acks of our samples, as late as the report
            n = min(op, adm.capacity(known_version))
            adm.admit(n)
            queue.extend([known_version] * n)
            assert adm.admitted <= (staleness + reports[-1][0] + 1) * batch


@settings(max_examples=100)
@given(batch=st.integers(1, 64), versions=st.integers(1, 10))
def test_sync_mode_admits_exactly_one_batch_per_version(batch, versions):
    adm = Admission(staleness=0, batch=batch)
    for version in range(versions):
        adm.observe(PolicyVersion("t1", version), consumed=version * batch)
        adm.consume(version * batch - adm.consumed)  # the acks of the batch trained into this version
        assert adm.capacity(version) == batch
        adm.admit(batch)
        assert adm.capacity(version) == 0


@settings(max_examples=200)
@given(batch=st.integers(1, 512), sources=st.integers(1, 64))
def test_shares_of_several_sources_sum_to_the_batch(batch, sources):
    shares = [Admission(2, batch, sources, i).batch_share for i in range(sources)]
    assert sum(shares) == batch
    assert max(shares) - min(shares) <= 1


@settings(max_examples=200)
@given(staleness=st.integers(0, 4), batch=st.integers(1, 64), sources=st.integers(1, 8), version=st.integers(0, 50))
def test_several_sources_together_never_exceed_the_rule_for_one(staleness, batch, sources, version):
    together = sum(Admission(staleness, batch, sources, i).capacity(version) for i in range(sources))
    assert together <= capacity(version, staleness, batch, admitted=0)


def test_several_sources_in_sync_mode_together_admit_one_batch():
    assert sum(Admission(0, 10, 3, i).capacity(0) for i in range(3)) == 10


def test_giving_back_a_stale_slot_restores_capacity():
    adm = Admission(staleness=1, batch=4)
    adm.admit(adm.capacity(0))
    assert adm.capacity(0) == 0
    adm.give_back(3)
    assert adm.capacity(0) == 3
    assert adm.returned == 3


@pytest.mark.parametrize("kwargs", [dict(batch=0), dict(batch=4, sources=0), dict(batch=4, sources=2, source_index=2)])
def test_admission_rejects_impossible_settings(kwargs):
    with pytest.raises(ValueError):
        Admission(staleness=2, **kwargs)


def test_a_busy_source_is_not_starved_by_an_idle_co_source():
    """An agent beside an idle gateway: all consumption is the agent's, and its capacity keeps
    reopening as its own episodes are trained on (its share bounds only what it has in flight)."""
    adm = Admission(staleness=2, batch=32, sources=2, source_index=0, max_batch=64)
    consumed = 0
    for version in range(1, 40):
        adm.admit(adm.capacity(version - 1))
        in_flight = adm.admitted - adm.consumed
        taken = min(in_flight, 64)  # the trainer takes what there is, up to global
        consumed += taken
        adm.consume(taken)
        adm.observe(PolicyVersion("t1", version), consumed)
    assert adm.capacity(40) > 0
    assert consumed >= 39 * 60  # full batches: not held to its share of the versions (32 each)


def _state(version, consumed, sources, incarnation="t1", lineage=""):
    from areal_bus.wire.messages import RunState

    return RunState(version=version, max_steps=100, finished=False, consumed=consumed, incarnation=incarnation,
                    sources=sources, lineage=lineage)


def test_a_restarted_trainers_lower_versions_are_followed_and_its_batch_measured_from_its_own_start():
    # Lineage a made 8 samples an update; b resumes from a checkpoint at version 3 and takes 2 an
    # update. Compared as bare numbers, b's reports (3, 4 <= 5) would be ignored and the batch stay 8.
    adm = Admission(staleness=1, batch=2, max_batch=8)
    adm.follow(_state(4, 32, {}, lineage="001-a"), "s")
    adm.follow(_state(5, 40, {}, lineage="001-a"), "s")
    assert adm.batch == 8
    adm.follow(_state(3, 24, {}, lineage="002-b"), "s")
    adm.follow(_state(4, 26, {}, lineage="002-b"), "s")
    assert adm.batch == 2
    adm.follow(_state(6, 48, {}, lineage="001-a"), "s")  # the old trainer's last report, arriving late
    assert adm.batch == 2


def test_run_state_totals_return_slots_and_a_lost_or_repeated_report_changes_nothing():
    adm = Admission(staleness=1, batch=4)
    adm.admit(adm.capacity(0))  # 8 in flight
    adm.follow(_state(1, 4, {"a:1": [4, 0], "other": [9, 9]}), "a:1")
    assert (adm.consumed, adm.returned) == (4, 0)
    # The next report is lost; the one after carries both updates' totals.
    adm.follow(_state(3, 8, {"a:1": [7, 1]}), "a:1")
    assert (adm.consumed, adm.returned, adm.admitted) == (7, 1, 7)
    before = adm.capacity(3)
    adm.follow(_state(3, 8, {"a:1": [7, 1]}), "a:1")  # repeated (heartbeat, or the bus's replay)
    adm.follow(_state(3, 8, {"a:1": [5, 0]}), "a:1")  # an older report arriving late never goes back
    assert (adm.consumed, adm.returned, adm.capacity(3)) == (7, 1, before)


@pytest.mark.parametrize("entry", [None, [1], [1, 2, 3], ["1", 2], [-1, 0], [True, 0], {"c": 1}, 5])
def test_a_malformed_totals_entry_is_ignored(entry):
    adm = Admission(staleness=1, batch=4)
    adm.admit(8)
    adm.follow(_state(1, 4, {"a:1": entry}), "a:1")
    assert (adm.consumed, adm.returned, adm.admitted) == (0, 0, 8)


def test_a_restarted_trainer_counts_on_from_the_last_totals():
    adm = Admission(staleness=1, batch=4)
    adm.admit(12)
    adm.follow(_state(2, 8, {"a:1": [8, 1]}, incarnation="t1"), "a:1")
    # The trainer restarts (from a checkpoint) and counts from zero in its new incarnation.
    adm.follow(_state(2, 8, {}, incarnation="t2"), "a:1")
    assert (adm.consumed, adm.returned) == (8, 1)
    adm.follow(_state(3, 11, {"a:1": [3, 0]}, incarnation="t2"), "a:1")
    assert (adm.consumed, adm.returned) == (11, 1)


def test_a_trainer_recovered_in_the_same_epoch_counts_nothing_twice_while_it_catches_up():
    # With a durable spool the restarted trainer keeps the run's epoch, restores its checkpoint's
    # totals and trains the spooled rest again: its totals climb back to where they were.
    adm = Admission(staleness=1, batch=4)
    adm.admit(12)
    adm.follow(_state(5, 10, {"a:1": [10, 1]}, incarnation="run"), "a:1")
    adm.follow(_state(3, 6, {"a:1": [6, 0]}, incarnation="run"), "a:1")  # the checkpoint's totals
    adm.follow(_state(4, 9, {"a:1": [9, 1]}, incarnation="run"), "a:1")  # re-training the spool
    assert (adm.consumed, adm.returned, adm.admitted) == (10, 1, 11)
    adm.follow(_state(6, 12, {"a:1": [12, 1]}, incarnation="run"), "a:1")  # past it: counts on
    assert (adm.consumed, adm.returned) == (12, 1)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.0, 0.6))
def test_a_run_never_stalls_however_many_run_states_the_hub_loses(seed, loss):
    """The CI failure this guards: acks lost on the hub left slots admitted forever, until fewer than
    trigger_batch_size samples could be in flight and the run stopped. With totals, a later report
    always restores them; sent totals are repeated every heartbeat, modelled by retrying each step."""
    import random

    rng = random.Random(seed)
    staleness, trigger, glob = 2, 4, 8
    adm = Admission(staleness, trigger, max_batch=glob)
    totals = [0, 0]
    in_flight = 0
    version = 0
    for _ in range(300):
        started = adm.capacity(version)
        adm.admit(started)
        in_flight += started
        ready = in_flight
        if ready >= trigger:
            taken = min(ready, glob)
            stale = rng.randint(0, ready - taken)  # some of the rest dropped as over-stale
            in_flight -= taken + stale
            totals[0] += taken
            totals[1] += stale
            version += 1
        if rng.random() >= loss:  # this report arrives (a lost one is followed by the next)
            adm.follow(_state(version, totals[0], {"a": list(totals)}), "a")
    assert version >= 300 * (1 - loss) / 3, "the run stalled"
    adm.follow(_state(version, totals[0], {"a": list(totals)}), "a")
    assert adm.admitted == in_flight + adm.consumed


def test_an_episode_a_worker_refused_frees_its_slot_and_the_trainers_stale_totals_still_count():
    import numpy as np

    from areal_bus.wire import messages as m
    from areal_bus.config.topology import Topology
    from nodes.agent import EpisodeSource

    src = EpisodeSource(Topology(), replica=0, replicas=1)
    started = src.start_episodes(now=0.0)
    assert started > 0 and src.admission.capacity(0) == 0
    req = src.to_send[0]
    empty = np.zeros(0, np.int32)
    refused = m.Completion(request_id=req.request_id, episode_id=req.episode_id, ticket=req.ticket, worker="rollout-0",
                           output_ids=empty, logprobs=np.zeros(0, np.float32), versions=empty, finish_reason="error",
                           error="request x: prompt of 2000 tokens, need 1..1023")
    assert src.on_completion(refused, now=1.0) is None
    assert req.episode_id not in src.episodes and src.abandoned == 1
    assert src.admission.capacity(0) == 1  # the slot is free again
    src.admission.sync("trainer-a", consumed=0, stale=2)  # the trainer's own stale drops: returned on top
    assert src.admission.capacity(0) == 3


# -- tickets: the update an episode is admitted for (what [rollout] step logs) ---------------------------

def test_with_every_update_taking_the_trigger_batch_the_ticket_is_the_plain_admission_slot():
    adm = Admission(staleness=2, batch=4, max_batch=4)
    tickets = [adm.admit() for _ in range(adm.capacity(0))]
    for version in range(1, 6):
        adm.follow(_state(version, 4 * version, {"a": [4 * version, 0]}), "a")
        tickets += [adm.admit() for _ in range(adm.capacity(version))]
    assert tickets == list(range(len(tickets))) and len(tickets) == (2 + 5 + 1) * 4


@settings(max_examples=300, deadline=None)
@given(staleness=st.integers(0, 4), trigger=st.integers(1, 8), extra=st.integers(0, 8), lag=st.integers(0, 3),
       sources=st.integers(1, 3), plan=st.lists(st.integers(0, 3), min_size=1, max_size=80))
def test_an_episode_is_never_admitted_for_an_update_past_the_staleness_bound(staleness, trigger, extra, lag, sources,
                                                                            plan):
    """Whatever the trainer takes per update (trigger to global, all that is ready), however late its
    reports: ticket // trigger_batch_size, the update the episode is admitted for, is at most the
    trainer's version + staleness (so [rollout] step leads [train] step, the update just done, by at
    most staleness + 1), and never an update already done when it was admitted."""
    glob = trigger + extra
    adm = Admission(staleness, trigger, sources, 0, max_batch=glob)
    version, consumed, ready = 0, 0, 0
    reports = [(0, 0)]
    for op in plan:
        if op == 0 and ready >= trigger:  # an update: everything ready, up to global_batch_size
            taken = min(ready, glob)
            ready, consumed, version = ready - taken, consumed + taken, version + 1
            reports.append((version, consumed))
        elif op == 1:  # a report reaches the source, up to ``lag`` updates late
            v, c = reports[max(0, len(reports) - 1 - lag)]
            adm.follow(_state(v, c, {"a": [c, 0]}), "a")
        else:  # this source starts what the rule allows
            seen = adm.history[-1][0].version if adm.history else 0
            for _ in range(adm.capacity(seen)):
                update = adm.admit() // trigger
                assert seen <= update <= version + staleness
                assert update <= seen + staleness
                ready += 1


def _ready_state(version, consumed, ready, sources=None):
    from areal_bus.wire.messages import RunState

    return RunState(version=version, max_steps=100, finished=False, consumed=consumed, incarnation="t1",
                    sources=sources or {}, ready=ready)


def test_an_adaptive_lead_steps_down_while_the_trainer_holds_a_spare_batch_and_up_when_it_would_wait():
    # global batch 64, trigger 32, staleness 2: the lead starts at the bound.
    adm = Admission(staleness=2, batch=32, max_batch=64, adaptive=True)
    assert adm.lead == 2
    adm.follow(_ready_state(1, 64, 128), "s")  # one report: no batch measured yet, nothing moves
    assert adm.lead == 2
    # Two batches waiting after an update: the trainer is the bottleneck; three updates in a row step down.
    for v in (2, 3):
        adm.follow(_ready_state(v, 64 * v, 128), "s")
        assert adm.lead == 2
    adm.follow(_ready_state(3, 192, 128), "s")  # the same version again (a heartbeat): counts nothing
    assert adm.lead == 2
    adm.follow(_ready_state(4, 256, 128), "s")
    assert adm.lead == 1
    for v in (5, 6, 7):
        adm.follow(_ready_state(v, 64 * v, 128), "s")
    assert adm.lead == 1  # never below 1: rollout keeps overlapping training
    adm.follow(_ready_state(8, 512, 64), "s")  # one batch waiting: just enough, stays
    assert adm.lead == 1
    adm.follow(_ready_state(9, 576, 10), "s")  # fewer than the trigger: the trainer would wait, up at once
    assert adm.lead == 2
    adm.follow(_ready_state(10, 640, 0), "s")
    assert adm.lead == 2  # never above the bound
    for v in (11, 12):  # a surplus run broken by a deficit starts over
        adm.follow(_ready_state(v, 64 * v, 128), "s")
    adm.follow(_ready_state(13, 832, 20), "s")
    adm.follow(_ready_state(14, 896, 128), "s")
    assert adm.lead == 2


def test_the_lead_is_what_admission_and_tickets_use_and_the_bound_alone_without_adaptive():
    fixed = Admission(staleness=2, batch=32, max_batch=64)
    adaptive = Admission(staleness=2, batch=32, max_batch=64, adaptive=True)
    for adm in (fixed, adaptive):
        for v in range(1, 5):
            adm.follow(_ready_state(v, 64 * v, 128), "s")
    assert (fixed.lead, adaptive.lead) == (2, 1)
    # In flight allowed (nothing of this source's consumed yet): (lead + 1) batches.
    assert fixed.capacity(4) == 3 * 64
    assert adaptive.capacity(4) == 2 * 64
    adaptive.admit(adaptive.capacity(4) - 1)
    # The last episode admitted is for the update lead versions past the trainer's (tickets count
    # 1 / trigger of an update).
    assert adaptive.admit(1) // 32 == 4 + adaptive.lead
    # Synchronous and staleness-1 runs have nothing to adapt.
    assert not Admission(staleness=1, batch=32, adaptive=True).adaptive
    assert not Admission(staleness=0, batch=32, adaptive=True).adaptive


def test_an_agents_admission_follows_the_trainers_ready_count_with_lead_adaptive():
    """The wiring: topology staleness.lead -> the agent's admission, RunState.ready -> its lead."""
    from areal_bus.config.topology import parse_topology
    from nodes.agent import EpisodeSource

    topo = parse_topology({"async": {"enabled": True}, "global_batch_size": 64, "trigger_batch_size": 32,
                           "staleness_threshold": 2, "staleness": {"lead": "adaptive"}, "experimental": True})
    src = EpisodeSource(topo, replica=0, replicas=1)
    assert src.admission.adaptive and src.admission.lead == 2
    for v in range(1, 5):
        src.on_run_state(_ready_state(v, 64 * v, 128))
    assert src.admission.lead == 1
    assert not EpisodeSource(parse_topology({"staleness_threshold": 2}), replica=0, replicas=1).admission.adaptive


def _done(req, n_out: int = 3, error: str = ""):
    import numpy as np

    from areal_bus.wire import messages as m

    ids = np.arange(1, n_out + 1, dtype=np.int32) if not error else np.zeros(0, np.int32)
    return m.Completion(request_id=req.request_id, episode_id=req.episode_id, ticket=req.ticket, worker="rollout-0",
                        output_ids=ids, logprobs=np.full(ids.size, -1.0, np.float32),
                        versions=np.zeros(ids.size, np.int32), finish_reason="error" if error else "stop",
                        error=error)


def test_in_order_hands_on_whole_groups_in_admission_order_whatever_order_they_finish_in():
    """staleness.in_order: a group that finished first waits for the one admitted before it; a group
    one of whose members a worker refused goes one member short; a group held GROUP_WAIT_S behind an
    unfinished one goes anyway. Without in_order each episode goes the moment it ends."""
    from areal_bus.constants import GROUP_WAIT_S
    from areal_bus.config.topology import parse_topology
    from nodes.agent import EpisodeSource

    spec = {"async": {"enabled": True}, "global_batch_size": 8, "trigger_batch_size": 4, "staleness_threshold": 1,
            "agent": {"group_size": 2}, "staleness": {"in_order": True}}
    src = EpisodeSource(parse_topology(spec), replica=0, replicas=1)
    assert src.start_episodes(now=0.0) == 16
    reqs = list(src.to_send)
    group = [r.group_id for r in reqs]
    assert group[0] == group[1] != group[2] == group[3] != group[4]

    def finish(i, now=1.0, **kw):
        traj = src.on_completion(_done(reqs[i], **kw), now)
        return [t.episode_id for t in src.deliver(traj, now)]

    assert finish(2) == [] and finish(3) == []  # group 1 is whole, group 0 not yet: held
    assert finish(1) == []
    assert finish(0) == [reqs[i].episode_id for i in (1, 0, 2, 3)]  # group 0 (as its members ended), then group 1
    assert finish(5, error="refused") == [] and src.abandoned == 1
    assert finish(4) == [reqs[4].episode_id]  # group 2 one member short
    assert finish(8) == [] and finish(9) == []  # group 4 behind unfinished group 3
    assert src.deliver(None, now=1.0 + GROUP_WAIT_S - 1) == []
    assert [t.episode_id for t in src.deliver(None, now=1.0 + GROUP_WAIT_S)] == [reqs[8].episode_id, reqs[9].episode_id]
    assert finish(6) == [] and finish(7) == [reqs[6].episode_id, reqs[7].episode_id]

    plain = EpisodeSource(parse_topology({**spec, "staleness": {}}), replica=0, replicas=1)
    plain.start_episodes(now=0.0)
    req = plain.to_send[3]
    traj = plain.on_completion(_done(req), 1.0)
    assert [t.episode_id for t in plain.deliver(traj, 1.0)] == [req.episode_id] and not plain.held
    sync = EpisodeSource(parse_topology({**spec, "async": {"enabled": False}}), replica=0, replicas=1)
    assert not sync.in_order  # nothing to reorder: one batch per version


def _topo(agents: int, gateways: int, group: int, staleness: int, trigger: int, batch: int, sync: bool,
          adaptive: bool) -> SimpleNamespace:
    """What admission reads of a topology (unvalidated: the validator refuses what these tests play)."""
    sources = [f"agent-{i}" for i in range(agents)] + [f"gateway-{i}" for i in range(gateways)]
    return SimpleNamespace(agent=SimpleNamespace(group_size=group), admission_sources=lambda: sources,
                           is_async=not sync, global_batch_size=batch, effective_trigger=batch if sync else trigger,
                           effective_staleness=0 if sync else staleness,
                           staleness=SimpleNamespace(lead="adaptive" if adaptive else "bound"))


def _stalls(topo, updates: int = 200) -> bool:
    """Play the sources against a trainer that takes exactly what an update waits for (trigger_batch_size,
    or global_batch_size in sync) as soon as it is there: episodes end at once, oldest trained first.
    An agent admits whole groups of its capacity (nodes/agent/core.py), a gateway single sessions."""
    group = topo.agent.group_size
    states = {s: Admission.of(topo, s) for s in topo.admission_sources()}
    need = topo.effective_trigger
    waiting: collections.deque[str] = collections.deque()
    version = consumed = 0
    for _ in range(updates):
        for s, adm in states.items():
            n = adm.capacity(version)
            n -= n % group if s.startswith("agent-") else 0
            adm.admit(n)
            waiting.extend([s] * n)
        if len(waiting) < need:
            return True
        took = collections.Counter(waiting.popleft() for _ in range(need))
        version, consumed = version + 1, consumed + need
        for s, adm in states.items():
            adm.consume(took[s])
            adm.observe(PolicyVersion("run", version), consumed, ready=len(waiting))
    return False


SETTINGS = [s for s in itertools.product([1, 3, 8], [0, 1], [1, 4, 8, 16], [0, 1, 2, 4], [4, 8, 32], [8, 32, 128],
                                         [False, True], [False, True])
            if s[4] <= s[5] and not (s[6] and (s[3] or s[7] or s[4] != s[5]))]


def test_group_stall_refuses_every_setting_whose_whole_groups_stall_the_run_and_with_a_fixed_lead_no_other():
    stalled = foreseen = 0
    for agents, gateways, group, staleness, trigger, batch, sync, adaptive in SETTINGS:
        topo = _topo(agents, gateways, group, staleness, trigger, batch, sync, adaptive)
        stalls, refused = _stalls(topo), group_stall(topo) is not None
        stalled += stalls
        assert refused or not stalls, f"a stall not foreseen: {topo}"
        if not adaptive:  # an adaptive lead may sit at 2 in a stall, which this trainer never drives it to
            assert refused == stalls, f"refused but runs: {topo}"
        foreseen += refused
    assert 0 < stalled <= foreseen < len(SETTINGS)


def _beat(node_id: str) -> m.Heartbeat:
    return m.Heartbeat(node_id=node_id, kind=node_id.rpartition("-")[0], incarnation="i", pid=1, t=0.0, version=0,
                       counters={}, gauges={}, hists={})


def test_sources_scaled_while_running_share_the_batch_anew_and_a_dead_one_keeps_its_share_for_a_while():
    from areal_bus.config.topology import parse_topology

    topo = parse_topology({"global_batch_size": 32, "trigger_batch_size": 16, "nodes": {"agent": {"replicas": 2}}})
    views = {name: (Sources(topo, name), Admission.of(topo, name)) for name in ("agent-0", "agent-1")}

    def total(names) -> int:
        return sum(views[n][1].batch_share for n in names)

    assert [a.batch_share for _, a in views.values()] == [8, 8]
    new = parse_topology({"global_batch_size": 32, "trigger_batch_size": 16, "nodes": {"agent": {"replicas": 3}}})
    views["agent-2"] = (Sources(new, "agent-2"), Admission.of(new, "agent-2"))  # started by supervisorctl update
    for name in ("agent-0", "agent-1"):
        src, adm = views[name]
        assert src.hear(_beat("agent-2"), adm, 0.0) and not src.hear(_beat("agent-2"), adm, 0.1)  # once
        assert not src.hear(_beat("rollout-0"), adm, 0.2) and not src.hear(_beat("gateway"), adm, 0.3)
        assert src.names == ["agent-0", "agent-1", "agent-2"]
    assert total(views) == 16 and sorted(a.batch_share for _, a in views.values()) == [5, 5, 6]
    # agent-1 is scaled away: it says it leaves; the others share its part
    left = m.Event(name="peer_left", node_id="agent-1", fields={"kind": "agent"})
    for name in ("agent-0", "agent-2"):
        assert views[name][0].hear(left, views[name][1], 1.0)
    assert total(["agent-0", "agent-2"]) == 16
    assert views["agent-0"][0].names == views["agent-2"][0].names == ["agent-0", "agent-2"]
    # one that dies without a word (kill -9) keeps its share while supervisord restarts it...
    src, adm = views["agent-0"]
    dead = m.Event(name="peer_dead", node_id="agent-2", fields={"kind": "agent"})
    assert not src.hear(dead, adm, 10.0) and not src.hear(left, adm, 11.0) and adm.batch_share == 8
    assert not src.hear(_beat("agent-2"), adm, 12.0)  # back: nothing changed
    # ...and is gone once dead for longer (removed while dead, or given up), until it beats again
    assert not src.hear(dead, adm, 20.0) and not src.hear(_beat("trainer-0"), adm, 20.0 + SOURCE_GONE_S)
    assert src.hear(_beat("trainer-0"), adm, 20.1 + SOURCE_GONE_S) and src.names == ["agent-0"]
    assert adm.batch_share == 16
    assert src.hear(_beat("agent-2"), adm, 500.0) and adm.batch_share == 8
