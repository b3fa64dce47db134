"""ProbeView, what ``areal-bus probe`` shows: per-node rates from successive heartbeats, a fresh
start when a node restarts, the trainer's busy fraction and staleness histogram, and dead nodes."""

from __future__ import annotations

from areal_bus.wire import messages as m
from areal_bus.wire.codec import Encoder, decode
from areal_bus.runtime.metrics import Metrics
from nodes.probe import ProbeView, format_table


def _hb(node_id="rollout-0", t=0.0, incarnation="a", counters=None, gauges=None, hists=None, version=0):
    return m.Heartbeat(node_id=node_id, kind=node_id.rpartition("-")[0], incarnation=incarnation, pid=1,
                       t=t, version=version, counters=counters or {}, gauges=gauges or {}, hists=hists or {})


def _row(view, node_id, now=0.0, dead_after=2.0):
    return next(r for r in view.rows(now, dead_after) if r["node"] == node_id)


def test_rates_come_from_successive_heartbeats():
    view = ProbeView()
    for t, samples, tokens in [(100.0, 0, 0), (101.0, 10, 5_000), (102.0, 30, 15_000)]:
        view.add(_hb("reward-0", t, counters={"samples": samples, "tokens": tokens}), now=t)
    row = _row(view, "reward-0", now=102.0)
    assert row["samples_per_second"] == 15.0
    assert row["tokens_per_second"] == 7_500.0


def test_a_single_heartbeat_shows_no_rate_yet():
    view = ProbeView()
    view.add(_hb(counters={"samples": 500}), now=0.0)
    assert _row(view, "rollout-0")["samples_per_second"] == 0.0


def test_a_restarted_node_starts_its_rates_afresh():
    view = ProbeView()
    view.add(_hb(t=10.0, incarnation="old", counters={"samples": 0}), now=10.0)
    view.add(_hb(t=11.0, incarnation="old", counters={"samples": 900}), now=11.0)
    view.add(_hb(t=12.0, incarnation="new", counters={"samples": 5}), now=12.0)
    assert _row(view, "rollout-0", now=12.0)["samples_per_second"] == 0.0  # not (5 - 0) / 2, not negative
    view.add(_hb(t=13.0, incarnation="new", counters={"samples": 25}), now=13.0)
    assert _row(view, "rollout-0", now=13.0)["samples_per_second"] == 20.0


def test_trainer_row_shows_its_busy_fraction():
    view = ProbeView()
    view.add(_hb("trainer-0", 0.0, counters={"busy_seconds": 0.0}), now=0.0)
    view.add(_hb("trainer-0", 2.0, counters={"busy_seconds": 1.5}), now=2.0)
    assert _row(view, "trainer-0", now=2.0)["busy_fraction"] == 0.75


def test_trainer_row_shows_its_staleness_histogram_in_version_order():
    view = ProbeView()
    view.add(_hb("trainer-0", hists={"staleness": {"10": 1, "0": 5, "2": 3}},
                 counters={"stale_dropped": 4, "duplicates": 2}), now=0.0)
    row = _row(view, "trainer-0")
    assert list(row["staleness"].items()) == [("0", 5), ("2", 3), ("10", 1)]
    assert row["stale_dropped"] == 4 and row["duplicates"] == 2


def test_only_the_trainer_row_has_trainer_fields():
    view = ProbeView()
    view.add(_hb("rollout-0"), now=0.0)
    assert "busy_fraction" not in _row(view, "rollout-0") and "staleness" not in _row(view, "rollout-0")


def test_staleness_histogram_survives_the_wire_from_node_metrics():
    metrics = Metrics()
    metrics.observe("staleness", 0, 6)
    metrics.observe("staleness", 1, 2)
    counters, gauges, hists = metrics.snapshot()
    hb = _hb("trainer-0", counters=counters, gauges=gauges, hists=hists)
    _, received = decode(Encoder("trainer-0/hb").encode(hb))
    view = ProbeView()
    view.add(received, now=0.0)
    assert _row(view, "trainer-0")["staleness"] == {"0": 6, "1": 2}


def test_a_silent_node_is_shown_dead():
    view = ProbeView()
    view.add(_hb("reward-0"), now=10.0)
    assert _row(view, "reward-0", now=11.0, dead_after=2.0)["alive"]
    assert not _row(view, "reward-0", now=12.5, dead_after=2.0)["alive"]
    assert "DEAD" in format_table(view.rows(12.5, 2.0))


def test_queues_and_dropped_frames_are_shown():
    view = ProbeView()
    view.add(_hb("trainer-0", gauges={"queue.buffered": 12, "train.pending": 3, "uptime_s": 9.0},
                 counters={"dropped.bad_msgpack": 2, "dropped.wire_version": 1}), now=0.0)
    row = _row(view, "trainer-0")
    assert row["queues"] == {"queue.buffered": 12, "train.pending": 3}
    assert row["dropped_frames"] == 3


def test_rows_follow_the_pipeline_then_replica_number():
    view = ProbeView()
    for node_id in ("trainer-0", "rollout-10", "bus-0", "rollout-2", "agent-0"):
        view.add(_hb(node_id), now=0.0)
    assert [r["node"] for r in view.rows(0.0, 2.0)] == ["agent-0", "rollout-2", "rollout-10", "trainer-0", "bus-0"]
