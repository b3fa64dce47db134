"""The bus node: a real ``areal-bus node bus`` process forwards the event plane and hands every new
subscriber the last policy version and run state at once (late-joiner snapshot); SnapshotCache, the
part that decides what to replay, is tested on its own below."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zmq

from areal_bus.wire import messages as m
from areal_bus.wire.channels import open_socket
from areal_bus.wire.codec import Encoder, decode, pack_topic
from areal_bus.config.topology import load_topology
from nodes.bus import SnapshotCache

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bus():
    """A bus node process on short ipc paths; yields its topology. Stopped with SIGTERM, as supervisord does."""
    work = Path(tempfile.mkdtemp(prefix="abt-bus-", dir="/tmp"))
    path = work / "topology.yaml"
    path.write_text(f"endpoints: {{transport: ipc, ipc_dir: {work / 'ipc'}}}\nlogging: {{log_dir: {work / 'logs'}}}\n")
    with open(work / "stdout.txt", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "areal_bus.launch.cli", "node", "bus", "--topology", str(path)],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield load_topology(path)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)
    assert rc == 0, f"bus node exited with {rc}"


def _recv(sock: zmq.Socket, deadline: float):
    """The next ``(topic, envelope, message)`` from a SUB socket; None once ``deadline`` passes."""
    if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLIN):
        return None
    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
    return (frames[0].bytes, *decode(frames[1:]))


def _next_on(sock: zmq.Socket, topic: bytes, deadline: float):
    """The next ``(envelope, message)`` on ``topic``, skipping others; None once ``deadline`` passes."""
    while (got := _recv(sock, deadline)) is not None:
        if got[0] == topic:
            return got[1:]
    return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("topic, msg", [
    (m.TOPIC_VERSION, m.VersionAnnounce(version=7, location="shm://w7", nbytes=1024, published_at=1.0)),
    (m.TOPIC_RUN, m.RunState(version=7, max_steps=20, finished=False, consumed=224)),
])
def test_late_subscriber_receives_the_cached_message_at_once(bus, ctx, topic, msg):
    hub_in, hub_out = bus.endpoint("hub_in"), bus.endpoint("hub_out")
    pub = open_socket(ctx, zmq.PUB, hub_in, bind=False)
    early = open_socket(ctx, zmq.SUB, hub_out, bind=False, subscribe=(topic, m.TOPIC_EVENT))
    enc = Encoder("weights-0")

    published = [bytes(f) for f in pack_topic(topic, enc.encode(msg))]

    # Publish until an early subscriber sees it: the bus is up and has forwarded (and cached) it.
    deadline, seen = time.monotonic() + 30, None
    while seen is None:
        assert time.monotonic() < deadline, "the bus never forwarded the message"
        pub.send_multipart(published)
        seen = _next_on(early, topic, time.monotonic() + 0.2)
    # A fence on the same pipe: once it is through, every copy published above has been forwarded,
    # so whatever the late subscriber gets on ``topic`` can only be the bus's replay.
    pub.send_multipart(pack_topic(m.TOPIC_EVENT, enc.encode(m.Event(name="fence", node_id="test"))))
    while (got := _recv(early, time.monotonic() + 10)) is not None and got[0] != m.TOPIC_EVENT:
        pass
    assert got is not None, "fence never arrived"

    joined = time.monotonic()
    late = open_socket(ctx, zmq.SUB, hub_out, bind=False, subscribe=(topic,))
    assert late.poll(1000, zmq.POLLIN), "no snapshot within 1 s of subscribing"
    replayed = late.recv_multipart(zmq.NOBLOCK)
    assert time.monotonic() - joined < 1.5
    assert replayed == published  # the bus replays the frames it forwarded, byte for byte
    assert decode(replayed[1:])[1] == msg


@pytest.mark.timeout(60)
def test_bus_forwards_published_messages_to_subscribers(bus, ctx):
    pub = open_socket(ctx, zmq.PUB, bus.endpoint("hub_in"), bind=False)
    sub = open_socket(ctx, zmq.SUB, bus.endpoint("hub_out"), bind=False, subscribe=(m.TOPIC_TRAJ_ACK,))
    msg = m.TrajAck(trainer_version=3, consumed=["t-1", "t-2"], stale=["t-0"], duplicate=[])
    deadline, got = time.monotonic() + 30, None
    while got is None:
        assert time.monotonic() < deadline, "nothing forwarded"
        pub.send_multipart(pack_topic(m.TOPIC_TRAJ_ACK, Encoder("trainer-0").encode(msg)))
        got = _next_on(sub, m.TOPIC_TRAJ_ACK, time.monotonic() + 0.2)
    assert got[1] == msg


# -- SnapshotCache ---------------------------------------------------------------------------------

_ENC = Encoder("test")


def _version(v: int) -> list:
    msg = m.VersionAnnounce(version=v, location="", nbytes=0, published_at=0.0)
    return [bytes(f) for f in pack_topic(m.TOPIC_VERSION, _ENC.encode(msg))]


def _run(v: int) -> list:
    msg = m.RunState(version=v, max_steps=10, finished=False, consumed=0)
    return [bytes(f) for f in pack_topic(m.TOPIC_RUN, _ENC.encode(msg))]


def test_cache_keeps_the_last_message_of_each_snapshot_topic():
    cache = SnapshotCache()
    v1, v2, r1 = _version(1), _version(2), _run(1)
    for frames in (v1, v2, r1):
        cache.observe(frames)
    assert cache.replay_for(b"\x01" + m.TOPIC_VERSION) == [v2]
    assert cache.replay_for(b"\x01" + m.TOPIC_RUN) == [r1]


def test_cache_ignores_topics_that_are_not_snapshots():
    cache = SnapshotCache()
    cache.observe([m.TOPIC_HEARTBEAT, b"hb"])
    cache.observe([m.TOPIC_VERSION_ACK, b"vack"])
    assert cache.replay_for(b"\x01") == []


def test_a_garbled_version_never_replaces_the_cached_snapshot():
    cache = SnapshotCache()
    good = _version(3)
    cache.observe(good)
    cache.observe([m.TOPIC_VERSION, b"\xc1garbage"])
    cache.observe([m.TOPIC_VERSION, *_run(4)[1:]])  # a valid message, but not a version
    assert cache.replay_for(b"\x01" + m.TOPIC_VERSION) == [good]


def test_cache_replays_everything_cached_to_a_subscribe_all():
    cache = SnapshotCache()
    v, r = _version(1), _run(1)
    cache.observe(v)
    cache.observe(r)
    assert sorted(cache.replay_for(b"\x01")) == sorted([v, r])


def test_cache_replays_nothing_to_other_topics_or_unsubscribes():
    cache = SnapshotCache()
    cache.observe(_version(1))
    assert cache.replay_for(b"\x01" + m.TOPIC_HEARTBEAT) == []
    assert cache.replay_for(b"\x01" + m.TOPIC_VERSION_ACK) == []
    assert cache.replay_for(b"\x00" + m.TOPIC_VERSION) == []
    assert cache.replay_for(b"") == []


def test_cache_with_nothing_observed_replays_nothing():
    assert SnapshotCache().replay_for(b"\x01" + m.TOPIC_VERSION) == []
