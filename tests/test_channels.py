"""Channels: a Receiver drops and counts what is not a message and keeps going; a ReliableSender
never blocks its node, shows backpressure, and delivers everything once, in order, when the consumer
catches up, resending what was never acknowledged."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from areal_bus.wire.channels import ReliableSender, Receiver, open_socket
from areal_bus.wire.codec import Encoder, decode
from areal_bus.constants import MAX_FRAME_BYTES
from areal_bus.runtime.metrics import Metrics
from areal_bus.weights.transfer import DEFAULT_CHUNK_BYTES

pytestmark = pytest.mark.timeout(20)

# Big enough that the kernel's socket buffers hold only a few: the high-water mark is reached quickly.
TOKENS = 16_384


def _connected_pair(ctx, address, hwm):
    pull = open_socket(ctx, zmq.PULL, address, bind=True, hwm=hwm)
    push = open_socket(ctx, zmq.PUSH, address, bind=False, hwm=hwm)
    assert push.poll(5000, zmq.POLLOUT), "PUSH never connected"  # IMMEDIATE: writable once connected
    return push, pull


@pytest.fixture
def pipe(ctx, endpoint):
    """A bound PULL (the consumer) and a connected PUSH (the producer) with tiny high-water marks."""
    push, pull = _connected_pair(ctx, endpoint("train"), hwm=2)
    yield push, pull
    # Read whatever is still in flight before the context goes: libzmq 4.3.5 can abort
    # ("Resource temporarily unavailable", session_base.cpp:233; libzmq#3442) when a socket is torn
    # down halfway through writing a multipart message to a peer that stopped reading.
    while pull.poll(100, zmq.POLLIN):
        pull.recv_multipart(zmq.NOBLOCK)


@pytest.fixture
def wide_pipe(ctx, endpoint):
    """The same with room for a flood to queue up before anyone reads."""
    return _connected_pair(ctx, endpoint("samples"), hwm=1000)


def _receive(receiver: Receiver, n: int, *, sender: ReliableSender | None = None, timeout_s: float = 10.0):
    """``n`` decoded messages, flushing ``sender`` as room appears; AssertionError past the deadline."""
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, f"received {len(got)} of {n}"
        receiver.sock.poll(50, zmq.POLLIN)
        got.extend(receiver.drain())
        if sender is not None:
            sender.flush()
    return got


# -- Receiver ----------------------------------------------------------------------------------------

def test_receiver_counts_each_malformed_frame_under_its_reason(wide_pipe, log, make_traj, send_within):
    push, pull = wide_pipe
    metrics = Metrics()
    receiver = Receiver(pull, metrics, log)
    good = Encoder("rollout-0").encode(make_traj())
    send_within(push, [b"\xc1 garbage"])
    send_within(push, good[:-1])  # an array frame short
    send_within(push, good)
    assert _receive(receiver, 1)[0][1].traj_id == "t-0"
    assert metrics.counters["dropped.bad_msgpack"] == 1
    assert metrics.counters["dropped.array_count"] == 1


def test_receiver_survives_a_garbage_flood_then_receives_a_valid_message(wide_pipe, log, make_traj, send_within):
    push, pull = wide_pipe
    metrics = Metrics()
    receiver = Receiver(pull, metrics, log)
    rng = np.random.default_rng(0)
    for i in range(300):
        send_within(push, [rng.bytes(int(rng.integers(0, 64))) for _ in range(1 + i % 40)])
    send_within(push, Encoder("rollout-0").encode(make_traj("after-flood")))
    got = _receive(receiver, 1)
    assert got[0][1].traj_id == "after-flood"
    assert sum(v for k, v in metrics.counters.items() if k.startswith("dropped.")) == 300


def test_a_frame_over_the_size_bound_disconnects_its_sender_and_the_receiver_keeps_going(ctx, endpoint, make_traj,
                                                                                          send_within):
    pull = open_socket(ctx, zmq.PULL, endpoint("big"), bind=True, hwm=100)
    assert pull.getsockopt(zmq.MAXMSGSIZE) == MAX_FRAME_BYTES
    rogue = ctx.socket(zmq.PUSH)  # a raw socket: no size bound of its own, as a hostile peer's would be
    rogue.connect(endpoint("big"))
    send_within(rogue, [Encoder("x").encode(make_traj("too-big"))[0], bytes(MAX_FRAME_BYTES + 1)])
    honest = open_socket(ctx, zmq.PUSH, endpoint("big"), bind=False, hwm=100)
    assert honest.poll(5000, zmq.POLLOUT)
    send_within(honest, Encoder("rollout-0").encode(make_traj("after-big")))
    arrived = []
    while pull.poll(1000, zmq.POLLIN):  # raw frames, so a big message dropped by decoding would show too
        arrived.append(pull.recv_multipart(zmq.NOBLOCK, copy=False))
    assert [decode(frames)[1].traj_id for frames in arrived] == ["after-big"]  # the big one never came in
    assert MAX_FRAME_BYTES >= DEFAULT_CHUNK_BYTES  # the largest frame we send ourselves passes


def test_receiver_logs_a_flood_of_one_reason_at_most_once_a_second(wide_pipe, log, make_traj, send_within):
    push, pull = wide_pipe
    receiver = Receiver(pull, Metrics(), log)
    started = time.monotonic()
    for _ in range(200):
        send_within(push, [b"\xc1"])
    send_within(push, Encoder("rollout-0").encode(make_traj()))
    _receive(receiver, 1)
    warnings = [r for r in log.records if r[1] == "dropped_frame"]
    assert 1 <= len(warnings) <= 1 + int(time.monotonic() - started)
    assert warnings[0][2]["reason"] == "bad_msgpack"


def test_receiver_of_a_subscription_ignores_the_topic_frame(wide_pipe, log, make_traj, send_within):
    push, pull = wide_pipe
    receiver = Receiver(pull, Metrics(), log, topic=True)
    send_within(push, [b"ver", *Encoder("rollout-0").encode(make_traj("topical"))])
    assert _receive(receiver, 1)[0][1].traj_id == "topical"


# -- ReliableSender ----------------------------------------------------------------------------------

def _sender(push, capacity=5):
    return ReliableSender(push, Encoder("reward-0"), Metrics(), "train", capacity=capacity)


def _offer(sender, make_traj, n):
    versions = (0,) * TOKENS
    for i in range(n):
        sender.offer(f"t-{i}", make_traj(f"t-{i}", ticket=i, versions=versions))


def test_offer_never_blocks_when_the_consumer_stops_reading(pipe, make_traj):
    push, _ = pipe
    sender = _sender(push)
    started = time.monotonic()
    _offer(sender, make_traj, 30)
    assert time.monotonic() - started < 5.0
    assert len(sender.pending) > 0
    assert len(sender.pending) + len(sender.unacked) == 30


def test_backpressure_makes_the_sender_full_and_shows_in_metrics(pipe, make_traj):
    push, _ = pipe
    sender = _sender(push, capacity=5)
    _offer(sender, make_traj, 30)
    assert sender.full
    assert sender.metrics.counters["train.backpressure_events"] >= 1
    assert sender.metrics.gauges["train.pending"] == len(sender.pending) >= 5


def test_offer_without_a_connected_consumer_keeps_the_message_pending(ctx, endpoint, make_traj, log):
    push = open_socket(ctx, zmq.PUSH, endpoint("nobody"), bind=False, hwm=2)
    sender = _sender(push)
    sender.offer("t-0", make_traj("t-0"))
    assert list(sender.pending) == ["t-0"]
    pull = open_socket(ctx, zmq.PULL, endpoint("nobody"), bind=True, hwm=2)
    got = _receive(Receiver(pull, Metrics(), log), 1, sender=sender)
    assert got[0][1].traj_id == "t-0" and not sender.pending


def test_everything_arrives_once_in_order_when_the_consumer_drains(pipe, make_traj, log):
    push, pull = pipe
    sender = _sender(push)
    _offer(sender, make_traj, 30)
    got = _receive(Receiver(pull, Metrics(), log), 30, sender=sender)
    assert [msg.traj_id for _, msg in got] == [f"t-{i}" for i in range(30)]
    assert pull.poll(200, zmq.POLLIN) == 0  # nothing more: no duplicates
    assert not sender.pending and not sender.full
    assert sender.metrics.gauges["train.pending"] == 0
    assert sender.metrics.counters["train.blocked_seconds"] > 0


def test_acknowledged_messages_are_not_resent(pipe, make_traj, log):
    push, pull = pipe
    sender = _sender(push)
    receiver = Receiver(pull, Metrics(), log)
    for i in range(3):
        sender.offer(f"t-{i}", make_traj(f"t-{i}"))
    _receive(receiver, 3, sender=sender)
    assert sender.ack(["t-0", "t-2", "never-sent"]) == 2
    assert sender.resend() == 1
    assert [msg.traj_id for _, msg in _receive(receiver, 1, sender=sender)] == ["t-1"]


def test_acknowledging_a_pending_message_means_it_is_never_sent(ctx, endpoint, make_traj):
    push = open_socket(ctx, zmq.PUSH, endpoint("nobody"), bind=False, hwm=2)
    sender = _sender(push)
    sender.offer("t-0", make_traj("t-0"))
    assert sender.ack(["t-0"]) == 1
    assert not sender.pending and not sender.unacked


def test_resend_delivers_unacknowledged_messages_again(pipe, make_traj, log):
    push, pull = pipe
    sender = _sender(push)
    receiver = Receiver(pull, Metrics(), log)
    for i in range(3):
        sender.offer(f"t-{i}", make_traj(f"t-{i}"))
    first = _receive(receiver, 3, sender=sender)
    assert sender.resend() == 3
    again = _receive(receiver, 3, sender=sender)
    assert [msg.traj_id for _, msg in again] == [msg.traj_id for _, msg in first]
    # The frames kept since the first send go out again (not a re-encoding): same arrays, bit for bit.
    assert [msg.logprobs.tobytes() for _, msg in again] == [msg.logprobs.tobytes() for _, msg in first]
    assert sender.metrics.counters["train.resent"] == 3


def test_resend_older_than_leaves_recent_messages_alone(pipe, make_traj, log):
    push, pull = pipe
    sender = _sender(push)
    sender.offer("t-0", make_traj("t-0"))
    _receive(Receiver(pull, Metrics(), log), 1, sender=sender)
    assert sender.resend(older_than=60.0) == 0
    assert list(sender.unacked) == ["t-0"]
