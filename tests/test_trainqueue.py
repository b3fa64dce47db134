"""TrainQueue, the trainer's consumption side: each trajectory id is trained on at most once,
over-stale samples are dropped and counted, and batches form oldest-first once enough are ready
(a trigger in async mode, exactly one global batch in sync mode)."""

from __future__ import annotations

from nodes.trainer.queue import TrainQueue


def _queue(capacity=64, trigger=2, max_batch=4, staleness=2, exact=False):
    return TrainQueue(capacity, trigger, max_batch, staleness, exact)


def test_duplicate_ids_are_counted_and_ignored(make_traj):
    q = _queue()
    assert q.offer(make_traj("a"))
    assert not q.offer(make_traj("a", ticket=9))
    assert q.duplicates == 1
    assert list(q.buffer) == ["a"]
    assert q.buffer["a"].ticket == 0  # the first copy is kept


def test_an_id_already_trained_on_is_still_a_duplicate(make_traj):
    q = _queue(trigger=1, max_batch=1)
    q.offer(make_traj("a"))
    assert [t.traj_id for t in q.take_batch(0)] == ["a"]
    assert not q.offer(make_traj("a"))  # a producer's resend after the ack was lost
    assert q.duplicates == 1 and not q.buffer


def test_over_stale_trajectories_are_dropped_and_counted(make_traj):
    q = _queue(staleness=2)
    q.offer(make_traj("too-old", versions=(2, 3)))   # 5 - 2 = 3 > 2
    q.offer(make_traj("at-bound", versions=(3, 4)))  # 5 - 3 = 2
    q.offer(make_traj("fresh", versions=(5,)))
    dropped = q.drop_stale(version=5)
    assert [t.traj_id for t in dropped] == ["too-old"]
    assert q.stale == 1
    assert sorted(q.buffer) == ["at-bound", "fresh"]


def test_staleness_counts_from_the_oldest_policy_token(make_traj):
    q = _queue(staleness=1)
    q.offer(make_traj("mixed", versions=(1, 3, 3)))  # started under 1, finished under 3
    assert [t.traj_id for t in q.drop_stale(version=3)] == ["mixed"]


def test_environment_tokens_do_not_make_a_trajectory_stale(make_traj):
    q = _queue(staleness=0)
    q.offer(make_traj("tool-use", versions=(-1, 4, -1, 4)))  # -1: environment/tool tokens
    assert q.drop_stale(version=4) == []


def test_batches_are_taken_oldest_version_first_then_in_ticket_order(make_traj):
    q = _queue(trigger=4, max_batch=4)
    for traj_id, ticket, v in [("c", 1, 3), ("a", 5, 1), ("d", 0, 3), ("b", 9, 2), ("e", 2, 4)]:
        q.offer(make_traj(traj_id, ticket=ticket, versions=(v,)))
    assert [t.traj_id for t in q.take_batch(4)] == ["a", "b", "d", "c"]
    assert list(q.buffer) == ["e"]


def test_async_batch_forms_at_the_trigger(make_traj):
    q = _queue(trigger=2, max_batch=4)
    q.offer(make_traj("a"))
    assert q.take_batch(0) is None
    q.offer(make_traj("b"))
    assert len(q.take_batch(0)) == 2


def test_async_batch_takes_at_most_the_global_batch(make_traj):
    q = _queue(trigger=2, max_batch=4)
    for i in range(6):
        q.offer(make_traj(f"t-{i}", ticket=i))
    assert len(q.take_batch(0)) == 4
    assert len(q.buffer) == 2


def test_sync_batch_waits_for_exactly_the_global_batch(make_traj):
    q = _queue(trigger=2, max_batch=4, exact=True)
    for i in range(3):
        q.offer(make_traj(f"t-{i}", ticket=i))
    assert q.take_batch(0) is None  # past the trigger but short of a full batch
    q.offer(make_traj("t-3", ticket=3))
    assert len(q.take_batch(0)) == 4


def test_queue_is_full_at_capacity_and_not_after_a_batch(make_traj):
    q = _queue(capacity=3, trigger=1, max_batch=2)
    for i in range(3):
        assert not q.full
        q.offer(make_traj(f"t-{i}", ticket=i))
    assert q.full
    q.take_batch(0)
    assert not q.full


def _member(make_traj, group: str, i: int, ticket: int, version: int = 0):
    return make_traj(f"{group}-{i}", ticket=ticket, versions=(version,), group_id=group)


def test_async_batches_take_grpo_groups_whole_never_their_early_finishers(make_traj):
    q = TrainQueue(64, trigger=4, max_batch=8, staleness=2, exact=False, group_size=4)
    for i in range(3):  # g1's first three finish first (the short answers)
        q.offer(_member(make_traj, "g1", i, ticket=i))
    for i in range(4):
        q.offer(_member(make_traj, "g2", i, ticket=10 + i))
    assert sorted(t.traj_id for t in q.take_batch(0)) == [f"g2-{i}" for i in range(4)]
    assert q.take_batch(0) is None  # g1 waits for its last member
    q.offer(_member(make_traj, "g1", 3, ticket=3))
    assert sorted(t.traj_id for t in q.take_batch(0)) == [f"g1-{i}" for i in range(4)]


def test_a_member_dropped_as_stale_still_completes_its_group(make_traj):
    q = TrainQueue(64, trigger=3, max_batch=8, staleness=2, exact=False, group_size=4)
    q.offer(_member(make_traj, "g", 0, ticket=0, version=0))  # started 3 versions back: over the bound
    for i in range(1, 4):
        q.offer(_member(make_traj, "g", i, ticket=i, version=1))
    assert [t.traj_id for t in q.drop_stale(version=3)] == ["g-0"]
    assert sorted(t.traj_id for t in q.take_batch(3)) == ["g-1", "g-2", "g-3"]
    assert not q.left  # every member gone: nothing kept for the group


def test_the_rewards_of_members_dropped_as_stale_go_with_their_group(make_traj):
    """The slow members are the ones a consume-time drop takes: their rewards stay in the group's
    baseline (engine.train's ``baseline``), handed out with the group's batch; nothing is kept once
    every member has gone."""
    q = TrainQueue(64, trigger=2, max_batch=8, staleness=2, exact=False, group_size=4)
    for i in range(2):  # two long answers, started 3 versions back, both wrong
        q.offer(make_traj(f"g-{i}", ticket=i, versions=(0,), group_id="g", reward=0.0))
    for i in range(2, 4):
        q.offer(make_traj(f"g-{i}", ticket=i, versions=(1,), group_id="g", reward=1.0))
    q.offer(make_traj("h-0", ticket=9, versions=(0,), group_id="h", reward=0.5))  # a group all dropped
    assert sorted(t.traj_id for t in q.drop_stale(version=3)) == ["g-0", "g-1", "h-0"]
    batch = q.take_batch(3)
    assert sorted(t.traj_id for t in batch) == ["g-2", "g-3"]
    assert q.baseline == [("g", 0.0), ("g", 0.0)]
    assert "g" not in q.gone_rewards  # g is done
    for i in range(1, 4):  # h's other members: dropped too, nothing kept once the group is gone
        q.offer(make_traj(f"h-{i}", ticket=10 + i, versions=(0,), group_id="h", reward=0.5))
    q.drop_stale(version=3)
    assert not q.gone_rewards and not q.left


def test_a_global_batch_of_incomplete_groups_is_taken_oldest_first(make_traj):
    """A member that never comes (its episode failed upstream) must not hold the queue for ever."""
    q = TrainQueue(64, trigger=2, max_batch=4, staleness=2, exact=False, group_size=4)
    for g, base in (("a", 0), ("b", 10)):
        for i in range(3):
            q.offer(_member(make_traj, g, i, ticket=base + i))
    assert [t.traj_id for t in q.take_batch(0)] == ["a-0", "a-1", "a-2", "b-0"]
    assert q.split == 2  # both groups taken in part
    q.offer(_member(make_traj, "a", 3, ticket=3))  # the late members: whole groups now, with those taken
    q.offer(_member(make_traj, "b", 3, ticket=13))
    assert [t.traj_id for t in q.take_batch(0)] == ["a-3", "b-1", "b-2", "b-3"]
    assert q.split == 0  # their rest: each group counted once
    assert not q.left and not q.buffer


def test_the_rest_of_a_group_taken_in_part_has_the_first_parts_rewards_as_its_baseline(make_traj):
    """On a long tail the short answers come first and the overflow trains them; the long ones, taken
    later, are judged against the whole group (every member gone before them), not among themselves."""
    q = TrainQueue(64, trigger=2, max_batch=4, staleness=2, exact=False, group_size=4)
    for g, base in (("a", 0), ("b", 10)):
        for i in range(3):
            q.offer(make_traj(f"{g}-{i}", ticket=base + i, group_id=g, reward=1.0))
    first = q.take_batch(0)
    assert [t.traj_id for t in first] == ["a-0", "a-1", "a-2", "b-0"] and q.baseline == []
    q.offer(make_traj("a-3", ticket=3, group_id="a", reward=0.0))
    q.offer(make_traj("b-3", ticket=13, group_id="b", reward=0.0))
    assert [t.traj_id for t in q.take_batch(0)] == ["a-3", "b-1", "b-2", "b-3"]
    assert q.baseline == [("a", 1.0)] * 3 + [("b", 1.0)]
    assert not q.gone_rewards and not q.left  # both done: nothing kept


def test_each_later_part_of_a_group_gets_every_member_gone_before_it(make_traj):
    q = TrainQueue(64, trigger=1, max_batch=2, staleness=2, exact=False, group_size=4)
    q.offer(make_traj("g-0", ticket=0, versions=(0,), group_id="g", reward=0.0))
    q.drop_stale(version=3)  # over the bound
    for i in (1, 2):
        q.offer(make_traj(f"g-{i}", ticket=i, versions=(2,), group_id="g", reward=float(i)))
    # a global batch and no whole group: the overflow takes g in part
    assert [t.traj_id for t in q.take_batch(3)] == ["g-1", "g-2"] and q.baseline == [("g", 0.0)]
    q.offer(make_traj("g-3", ticket=3, versions=(2,), group_id="g", reward=3.0))
    assert [t.traj_id for t in q.take_batch(3)] == ["g-3"]
    assert q.baseline == [("g", 0.0), ("g", 1.0), ("g", 2.0)]  # the dropped one too, a second time
    assert not q.gone_rewards


def test_ungrouped_trajectories_and_sync_batches_form_as_before(make_traj):
    q = TrainQueue(64, trigger=2, max_batch=4, staleness=2, exact=False, group_size=4)
    q.offer(make_traj("x", ticket=0))
    q.offer(make_traj("y", ticket=1))
    assert [t.traj_id for t in q.take_batch(0)] == ["x", "y"]  # no group_id: each is its own group
    s = TrainQueue(64, trigger=2, max_batch=4, staleness=2, exact=True, group_size=4)
    for i in range(4):
        s.offer(_member(make_traj, "g", i, ticket=i) if i < 2 else make_traj(f"z{i}", ticket=i))
    assert len(s.take_batch(0)) == 4


def test_a_group_waits_for_its_last_member_at_most_group_wait_s(make_traj):
    """With a small staleness bound the queue may never fill past a global batch: the wait is timed."""
    from areal_bus.constants import GROUP_WAIT_S

    clock = [100.0]
    q = TrainQueue(64, trigger=2, max_batch=8, staleness=0, exact=False, group_size=4, clock=lambda: clock[0])
    for i in range(3):
        q.offer(_member(make_traj, "g", i, ticket=i))
    clock[0] += GROUP_WAIT_S - 1
    assert q.take_batch(0) is None
    clock[0] += 1
    assert [t.traj_id for t in q.take_batch(0)] == ["g-0", "g-1", "g-2"]
    assert not q.arrived


def test_a_member_refused_on_arrival_completes_its_group(make_traj):
    q = TrainQueue(64, trigger=3, max_batch=8, staleness=2, exact=False, group_size=4)
    for i in range(3):
        q.offer(_member(make_traj, "g", i, ticket=i))
    assert q.take_batch(0) is None
    q.member_lost(_member(make_traj, "g", 3, ticket=3))
    assert len(q.take_batch(0)) == 3


def test_a_restarted_trainers_backlog_goes_without_waiting_for_group_mates(make_traj):
    """After a restart the queue cannot know which members the dead process trained: its backlog's
    groups are taken as they are, new groups still whole."""
    q = TrainQueue(64, trigger=2, max_batch=8, staleness=2, exact=False, group_size=4)
    for i in range(2):
        q.offer(_member(make_traj, "old", i, ticket=i), recovered=True)
    q.offer(_member(make_traj, "new", 0, ticket=10))
    assert sorted(t.traj_id for t in q.take_batch(0)) == ["old-0", "old-1"]
    assert not q.released
