"""TrainQueue, the trainer's consumption side: each trajectory id is trained on at most once,
over-stale samples are dropped and counted, and batches form oldest-first once enough are ready
(a trigger in async mode, exactly one global batch in sync mode)."""

from __future__ import annotations

from nodes.trainer.core import TrainQueue


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
