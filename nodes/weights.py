"""Weight broadcaster node: turns "the trainer finished version v" into "every rollout worker may
serve v", and knows when they all do.

It receives WeightsReady from the trainer, announces the version on the hub (the bus caches it for late
joiners, and this node repeats it every heartbeat so a lost announcement heals within half a second),
and collects VersionAcks from rollout workers: a version is committed once every live worker serves
it, which is when the buffer of the version before it may be reused. Versions are ordered by
(lineage, version): a restarted trainer starts a new lineage from its checkpoint, possibly at a lower
version, and that is announced as newer. A restarted broadcaster announces nothing until the trainer
tells it the current version (the trainer resends it when it sees the restart). Simulated engines carry no
weights (location "").

Hosts without shared memory with the trainer (areal_bus/config/placement.py: a host that runs rollout but not
the trainer's rank 0) each run a relay, ``weights-<i>`` (this module, replica i >= 1). The broadcaster
(replica 0, on the trainer's host) sends every version to each relay over the bus's chunked,
checksummed transfer (areal_bus/weights/transfer.py; CURVE between hosts, as every socket), and
announces it only once every live relay holds it, so a far worker never hears of a version its host
lacks. A relay writes what it receives into its host's shared memory (the far workers map it there,
areal_bus/engines/rollout_factory.py), checks the sender's sha256 before committing, acks on the hub,
and frees a buffer when the version after it is committed. A relay that restarts (or missed chunks)
is sent the current version again (RELAY_RESEND_S); it exits 0 when the trainer says the run finished.

With ``endpoints.far_weights`` group (``auto`` with the trainer on a GPU), versions go to the relays
over a torch.distributed weight group instead (areal_bus/weights/dist_group.py, NCCL between GPUs, gloo
on CPU): the broadcaster (rank 0) and every live relay form a generation, broadcast each version in
buckets, and form a new generation whenever the set of live relays changes (a relay dead by the bus's
liveness, a new incarnation, a host back). Which generation, and which version's buckets come next, are
control messages on the same CURVE channel as the chunks; the relay commits a version (and acks it) only
once every bucket landed and, on CPU, its sha256 matches the one sent after the last bucket.

Run: areal-bus node weights --topology topology/default.yaml [--replica i]   (i >= 1: a relay)
"""

from __future__ import annotations

import time

import msgpack
import zmq

from areal_bus.wire import messages as m
from areal_bus.config import placement
from areal_bus.wire.channels import Receiver, open_socket
from areal_bus.constants import HEARTBEAT_INTERVAL_S, POLL_MS
from areal_bus.runtime.node import NodeShell
from areal_bus.version import NONE, PolicyVersion
from areal_bus.engines.rollout_factory import relay_weight_set
from areal_bus.weights.group_link import GroupReceiver, GroupSender, group_backend

RELAY_RESEND_S = 10.0
"""A live relay that has not acked the current version this long after it was sent gets it again (it
restarted mid-transfer, or a chunk failed its checks). Long next to a version's transfer at the tiny
shape (milliseconds) and at 1.5B over 100 Gb/s (~0.3 s); a slower link needs a longer one."""
RELAY_HWM = 4
"""Chunks queued per relay socket: at 64 MB each, 256 MB of a version in flight per far host."""


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


class RelayLink:
    """The broadcaster's end towards one far host's relay: which version it holds (from its acks) and
    the chunks of the version being sent, pumped without blocking so the hub is still served."""

    def __init__(self, shell: NodeShell, host: str, replica: int):
        self.host, self.node_id = host, f"weights-{replica}"
        self.sock = open_socket(shell.ctx, zmq.PUSH, placement.relay_endpoint(shell.topo, host), bind=False,
                                hwm=RELAY_HWM)
        self.log = shell.log
        self.holds = NONE
        self.chunks = None  # iterator of (header, payload) being sent
        self.pending: tuple | None = None  # a chunk that did not fit the queue yet
        self.sent_at = -1e9
        self.sending: PolicyVersion | None = None

    def start(self, ann: m.VersionAnnounce, now: float) -> None:
        # lazy (here and in run_relay): the transfer reads shared memory through torch, which a
        # broadcaster on one host never loads
        from areal_bus.weights.transfer import chunk_frames

        self.chunks = chunk_frames(ann.location, extra={"lineage": ann.lineage})
        self.pending, self.sent_at, self.sending = None, now, PolicyVersion.of(ann)

    def pump(self) -> bool:
        """Send what fits; True once the whole version is queued (or there is nothing to send)."""
        from areal_bus.weights.shm import WeightShmError  # lazy: torch (see start)

        while self.chunks is not None:
            if self.pending is None:
                try:
                    self.pending = next(self.chunks)
                except StopIteration:
                    self.chunks = None
                    break
                except WeightShmError:  # the buffer moved on under us: a newer version follows
                    self.chunks = self.pending = None
                    break
            header, payload = self.pending
            try:
                self.sock.send_multipart([msgpack.packb(header), payload], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            self.pending = None
            if "sha256" in header:  # the last chunk: the digest of the trainer's bytes, for the record
                self.log.info("relay_sent", version=header["version"], lineage=header.get("lineage", ""),
                              to=self.host, sha256=header["sha256"], chunks=header["count"],
                              ms=round((time.monotonic() - self.sent_at) * 1000, 1))
        return True


def run(topo, replica: int = 0, base=None) -> int:
    if replica > 0:
        return run_relay(topo, replica, base)
    shell = NodeShell(topo, "weights", replica, base=base, watch=("rollout", "trainer", "weights"),
                      topics=(m.TOPIC_VERSION_ACK,))
    shell.install_signal_handlers()
    pull = open_socket(shell.ctx, zmq.PULL, shell.endpoint("weights"), bind=True, hwm=16)
    inbox = Receiver(pull, shell.metrics, shell.log)
    book = VersionBook()
    relays = {f"weights-{i}": RelayLink(shell, host, i)
              for i, host in enumerate(placement.far_rollout_hosts(topo), start=1)}
    backend = group_backend(topo)
    sender = GroupSender(shell, relays, backend, RELAY_RESEND_S, base) if backend is not None else None
    announced = None  # the VersionAnnounce last made public (book.current waits for the relays)
    shell.announce_start()
    shell.start_heartbeat()
    poller = zmq.Poller()
    poller.register(shell.sub, zmq.POLLIN)
    poller.register(pull, zmq.POLLIN)
    last_announce = 0.0
    try:
        while not shell.stopping.is_set():
            for _, msg in shell.drain_hub():
                if isinstance(msg, m.VersionAck) and msg.node_id in relays:
                    link = relays[msg.node_id]
                    link.holds = max(link.holds, PolicyVersion(msg.lineage, msg.version)) \
                        if msg.lineage == link.holds.lineage else PolicyVersion(msg.lineage, msg.version)
                elif isinstance(msg, m.VersionAck):
                    book.ack(msg.node_id, msg.version, msg.lineage)
            for _, msg in inbox.drain():
                if not isinstance(msg, m.WeightsReady):
                    inbox.drop("wrong_type", type(msg).__name__)
                    continue
                if book.offer(msg) is not None:
                    last_announce = 0.0
            now = time.monotonic()
            cur = book.current
            if sender is not None:
                sender.step(cur, now)
            if cur is not None and relays and cur.location:
                live = {p.node_id for p in shell.peers.alive("weights")}
                for link in relays.values() if sender is None else ():
                    if link.node_id in live and link.holds != PolicyVersion.of(cur) and (
                            link.sending != PolicyVersion.of(cur) or now - link.sent_at > RELAY_RESEND_S):
                        link.start(cur, now)
                        shell.metrics.inc("relay_sends")
                    link.pump()
                # Announce once every live relay holds it: a far worker never hears of a version its
                # host lacks (a dead relay's host has no live worker to wait for).
                if any(link.node_id in live and link.holds != PolicyVersion.of(cur) for link in relays.values()):
                    cur = announced
            if cur is not None and cur is not announced:
                announced, last_announce = cur, 0.0
                if relays and cur.location:
                    shell.log.info("relays_hold", version=cur.version,
                                   ms=round((time.time() - cur.published_at) * 1000, 1))
            if announced is not None and now - last_announce >= HEARTBEAT_INTERVAL_S:
                shell.publish(m.TOPIC_VERSION, announced)
                shell.policy = PolicyVersion.of(announced)
                last_announce = now
            workers = [p.node_id for p in shell.peers.alive("rollout")]
            v = book.newly_committed(workers) if announced is book.current else None
            if v is not None:
                lag = time.time() - book.current.published_at
                shell.metrics.inc("versions_committed")
                shell.publish(m.TOPIC_VERSION_COMMITTED, m.VersionCommitted(version=v, lineage=book.current.lineage))
                shell.metrics.gauge("commit_latency_s", lag)
                shell.log.info("committed", version=v, serving=f"{len(workers)}/{len(workers)}",
                               latency_ms=round(lag * 1000, 1))
            poller.poll(1 if sender is not None and sender.transfer is not None else POLL_MS)  # buckets in flight: pump often
    finally:
        shell.close()
    return 0


def run_relay(topo, replica: int, base=None) -> int:
    """A far host's relay (see the module docstring): versions in over the network, into this host's
    shared memory, acked on the hub."""
    from areal_bus.weights.shm import WeightShmError  # lazy: torch (see Sender.start)
    from areal_bus.weights.transfer import ChunkAssembler

    host = placement.relay_host(topo, replica)
    shell = NodeShell(topo, "weights", replica, base=base, own_policy=True,
                      topics=(m.TOPIC_VERSION_COMMITTED, m.TOPIC_RUN))
    shell.install_signal_handlers()
    pull = open_socket(shell.ctx, zmq.PULL, placement.relay_endpoint(topo, host), bind=True, hwm=RELAY_HWM)
    name = relay_weight_set(topo, base)
    assembler, lineage = ChunkAssembler(name), None
    holds, t_first = NONE, None
    receiver = GroupReceiver(shell, name, host) if group_backend(topo) is not None else None
    shell.announce_start(host=host, weight_set=name, group=receiver is not None)
    shell.start_heartbeat()
    last_ack = 0.0
    finished = False
    try:
        while not shell.stopping.is_set() and not finished:
            for _, msg in shell.drain_hub():
                writer = receiver.writer if receiver is not None else assembler.writer
                if isinstance(msg, m.VersionCommitted) and msg.lineage == holds.lineage and writer:
                    writer.mark_released(msg.version - 1)  # every worker serves msg.version
                elif isinstance(msg, m.RunState) and msg.finished:
                    finished = True
            while pull.poll(0):
                frames = pull.recv_multipart(copy=False)
                if len(frames) == 1 or receiver is not None:  # a control message of the weight group
                    try:
                        if receiver is None or len(frames) != 1:
                            raise ValueError(f"{len(frames)} frame(s): this relay takes "
                                             f"{'group control messages' if receiver else 'chunks'} only")
                        doc = msgpack.unpackb(frames[0].bytes)
                        if not isinstance(doc, dict):
                            raise ValueError("a control message is a map")
                        receiver.control(doc, holds)
                    except (ValueError, TypeError, msgpack.UnpackException, WeightShmError) as exc:
                        # Tolerated: counted and dropped; the broadcaster repeats what matters.
                        shell.metrics.inc("relay_control_refused")
                        shell.log.warning("control_refused", error=str(exc)[:300])
                    continue
                if len(frames) != 2:
                    shell.metrics.inc("relay_chunks_refused")
                    continue
                head, payload = frames
                try:
                    header = msgpack.unpackb(head.bytes)
                    if not isinstance(header, dict):
                        raise ValueError("a chunk header is a map")
                    if header.get("lineage") != lineage:  # a restarted trainer: its own versions from here
                        assembler.close()
                        assembler, lineage = ChunkAssembler(name), header.get("lineage")
                    if header.get("index") == 0:
                        t_first = time.monotonic()
                    location = assembler.add(header, payload)
                except (ValueError, TypeError, msgpack.UnpackException, WeightShmError) as exc:
                    # Tolerated: the version is not committed; the broadcaster sends it again.
                    shell.metrics.inc("relay_chunks_refused")
                    shell.log.warning("chunk_refused", error=str(exc)[:300])
                    continue
                if location is not None:
                    holds = PolicyVersion(lineage or "", int(header["version"]))
                    shell.policy = holds
                    took = time.monotonic() - (t_first or time.monotonic())
                    shell.metrics.inc("versions_received")
                    shell.log.info("received", version=holds.version, location=location, sha256=assembler.digest,
                                   nbytes=int(header["total"]), ms=round(took * 1000, 1))
                    last_ack = 0.0
            got = receiver.step() if receiver is not None else None
            if got is not None:
                holds = shell.policy = got[0]
                shell.metrics.inc("versions_received")
                last_ack = 0.0
            now = time.monotonic()
            if holds != NONE and now - last_ack >= HEARTBEAT_INTERVAL_S:  # repeated: heals a lost ack
                shell.publish(m.TOPIC_VERSION_ACK, m.VersionAck(node_id=shell.node_id, version=holds.version,
                                                                lineage=holds.lineage))
                last_ack = now
            pull.poll(1 if receiver is not None and receiver.busy() else POLL_MS)  # buckets in flight: pump often
    finally:
        if receiver is not None:
            receiver.close()
        assembler.close()
        shell.close()
    return 0
