"""Weight broadcaster node: turns "the trainer finished version v" into "every rollout worker may
serve v", and knows when they all do.

It receives WeightsReady from the trainer, announces the version on the hub (the bus caches it for late
joiners, and this node repeats it every heartbeat so a lost announcement heals within half a second),
and collects VersionAcks from rollout workers: a version is committed once every live worker serves
it, which is when the buffer of the version before it may be reused. Versions are ordered by
(lineage, version): a restarted trainer starts a new lineage from its checkpoint, possibly at a lower
version, and that is announced as newer. A restarted broadcaster announces nothing until the trainer
tells it the current version (the trainer resends it when it sees the restart). Simulated engines carry no
weights (location ""); the shared-memory transport arrives with the RL issue.

Run: areal-bus node weights --topology topology/default.yaml
"""

from __future__ import annotations

import time

import zmq

from areal_bus import messages as m
from areal_bus.channels import Receiver, open_socket
from areal_bus.constants import HEARTBEAT_INTERVAL_S, POLL_MS
from areal_bus.node import NodeShell
from areal_bus.version import NONE, PolicyVersion


class VersionBook:
    """Which worker serves which version. Holds no sockets. Every comparison is of PolicyVersions:
    a restarted trainer's lineage is newer even where its version number is lower."""

    def __init__(self):
        self.current: m.VersionAnnounce | None = None  # nothing to announce until the trainer says
        self.serving: dict[str, PolicyVersion] = {}  # worker -> the version it serves
        self.committed: PolicyVersion = NONE

    def offer(self, ready: m.WeightsReady) -> m.VersionAnnounce | None:
        """Take a WeightsReady if it is newer than the current version; the announcement, or None."""
        if self.current is not None and PolicyVersion.of(ready) <= PolicyVersion.of(self.current):
            return None
        self.current = m.VersionAnnounce(version=ready.version, location=ready.location, nbytes=ready.nbytes,
                                         published_at=time.time(), lineage=ready.lineage)
        return self.current

    def ack(self, node_id: str, version: int, lineage: str = "") -> None:
        """``node_id`` serves (lineage, version) now; a late ack of an older one changes nothing."""
        self.serving[node_id] = max(PolicyVersion(lineage, version), self.serving.get(node_id, NONE))

    def newly_committed(self, live_workers: list[str]) -> int | None:
        """The current version's number, once, when every live worker serves it (at once if none is
        alive: nobody holds an older buffer, and a worker that joins maps the current one)."""
        if self.current is None:
            return None
        cur = PolicyVersion.of(self.current)
        if cur <= self.committed:
            return None
        if all(self.serving.get(w, NONE) >= cur for w in live_workers):
            self.committed = cur
            return cur.version
        return None


def run(topo, replica: int = 0, base=None) -> int:
    shell = NodeShell(topo, "weights", replica, base=base, watch=("rollout", "trainer"),
                      topics=(m.TOPIC_VERSION_ACK,))
    shell.install_signal_handlers()
    pull = open_socket(shell.ctx, zmq.PULL, shell.endpoint("weights"), bind=True, hwm=16)
    inbox = Receiver(pull, shell.metrics, shell.log)
    book = VersionBook()
    shell.announce_start()
    shell.start_heartbeat()
    poller = zmq.Poller()
    poller.register(shell.sub, zmq.POLLIN)
    poller.register(pull, zmq.POLLIN)
    last_announce = 0.0
    try:
        while not shell.stopping.is_set():
            for _, msg in shell.drain_hub():
                if isinstance(msg, m.VersionAck):
                    book.ack(msg.node_id, msg.version, msg.lineage)
            for _, msg in inbox.drain():
                if not isinstance(msg, m.WeightsReady):
                    inbox.drop("wrong_type", type(msg).__name__)
                    continue
                if book.offer(msg) is not None:
                    last_announce = 0.0
            now = time.monotonic()
            if book.current is not None and now - last_announce >= HEARTBEAT_INTERVAL_S:
                shell.publish(m.TOPIC_VERSION, book.current)
                shell.policy = PolicyVersion.of(book.current)
                last_announce = now
            workers = [p.node_id for p in shell.peers.alive("rollout")]
            v = book.newly_committed(workers)
            if v is not None:
                lag = time.time() - book.current.published_at
                shell.metrics.inc("versions_committed")
                shell.publish(m.TOPIC_VERSION_COMMITTED, m.VersionCommitted(version=v, lineage=book.current.lineage))
                shell.metrics.gauge("commit_latency_s", lag)
                shell.log.info("committed", version=v, serving=f"{len(workers)}/{len(workers)}",
                               latency_ms=round(lag * 1000, 1))
            poller.poll(POLL_MS)
    finally:
        shell.close()
    return 0
