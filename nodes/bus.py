"""Bus node: the hub of the event plane, an XSUB/XPUB forwarder with a last-value cache.

Every node publishes into ``hub_in`` and subscribes from ``hub_out``, so no node needs to know who else
runs (workers come and go when the topology is scaled). For the topics in SNAPSHOT_TOPICS (the policy
version, the run state) the bus keeps the last message and replays it the moment a new subscription
arrives: a node starting mid-run learns the current version at once, with no slow-joiner sleep (the
ZeroMQ guide's "last value cache"). The bus forwards frames without decoding them; receivers validate.

Run: areal-bus node bus --topology topology/default.yaml
"""

from __future__ import annotations

import zmq

from areal_bus.wire import messages as m
from areal_bus.wire.channels import open_socket
from areal_bus.wire.codec import DecodeError, decode
from areal_bus.constants import POLL_MS, PUB_HWM
from areal_bus.runtime.node import NodeShell


_SNAPSHOT_TYPES = {m.TOPIC_VERSION: m.VersionAnnounce, m.TOPIC_RUN: m.RunState}


class SnapshotCache:
    """Last message per snapshot topic, replayed to new subscribers. Holds no sockets."""

    def __init__(self, topics=m.SNAPSHOT_TOPICS):
        self.topics = tuple(topics)
        self.last: dict[bytes, list[bytes]] = {}

    def observe(self, frames: list[bytes]) -> None:
        """Remember the last message of a snapshot topic. Only these few small messages are decoded
        here (everything else is forwarded blind): a garbled one must never replace a good snapshot."""
        if not frames or frames[0] not in self.topics:
            return
        try:
            _, msg = decode(frames[1:])
        except DecodeError:
            return
        if _SNAPSHOT_TYPES.get(frames[0]) is type(msg):
            self.last[frames[0]] = frames

    def replay_for(self, subscription: bytes) -> list[list[bytes]]:
        """Messages to replay for one XPUB subscription frame (b'\\x01' + prefix); none for unsubscribe."""
        if not subscription or subscription[0] != 1:
            return []
        prefix = subscription[1:]
        return [frames for topic, frames in self.last.items() if topic.startswith(prefix)]


def run(topo, replica: int = 0, base=None) -> int:
    shell = NodeShell(topo, "bus", replica, base=base)
    shell.install_signal_handlers()
    xsub = open_socket(shell.ctx, zmq.XSUB, shell.endpoint("hub_in"), bind=True, hwm=PUB_HWM)
    xpub = open_socket(shell.ctx, zmq.XPUB, shell.endpoint("hub_out"), bind=True, hwm=PUB_HWM)
    # Verbose: every subscription reaches us, not only the first per topic, so each joiner gets a replay.
    xpub.setsockopt(zmq.XPUB_VERBOSE, 1)
    xsub.send(b"\x01")  # subscribe upstream to everything; filtering happens at each SUB
    cache = SnapshotCache()
    shell.announce_start(hub_in=shell.endpoint("hub_in"), hub_out=shell.endpoint("hub_out"))
    shell.start_heartbeat()
    poller = zmq.Poller()
    poller.register(xsub, zmq.POLLIN)
    poller.register(xpub, zmq.POLLIN)
    try:
        while not shell.stopping.is_set():
            ready = dict(poller.poll(POLL_MS))
            if xsub in ready:
                for _ in range(1000):
                    try:
                        frames = xsub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    cache.observe(frames)
                    xpub.send_multipart(frames)
                    shell.metrics.inc("forwarded")
            if xpub in ready:
                for _ in range(1000):
                    try:
                        sub = xpub.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    for frames in cache.replay_for(sub):
                        xpub.send_multipart(frames)
                        shell.metrics.inc("replayed")
            shell.drain_hub()  # our own SUB: keeps the peer table for the probe-less case
    finally:
        shell.close()
    return 0
