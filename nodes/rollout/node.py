"""The rollout worker on the bus: ``RolloutCore`` wired to its sockets.

It reads the agents' ``work`` channel (PULL), answers on each agent's ``replies`` channel (PUSH), and
holds a DEALER per gateway on ``gwork`` (named by its node id, so a gateway can address it: sticky
sessions) that carries that gateway's requests in and their completions and stream parts back.

Leaving (SIGTERM: a rescale removed this worker, or the run stops): it takes no more work (its ``work``
PULL closes, so the agents' PUSH sends elsewhere; each gateway is told over ``gwork`` which requests it
will still answer, and sends the others to the remaining workers now), finishes what it runs within
ROLLOUT_DRAIN_S while anyone is there to take the answers, then says on the hub that it left: what it
still held (cut off by the deadline, or waiting for a version) is reissued at once.

Telemetry: every BATCH_SAMPLE_S it appends a record of its running batch (running, free slots, waiting,
version, tokens) to ``rollout_batch-<node>.jsonl`` in the log folder (nodes/rollout/core.py: BatchSeries).

Run: areal-bus node rollout --topology topology/default.yaml --replica 0
"""

from __future__ import annotations

import json
import time

import zmq

from areal_bus.wire import messages as m
from areal_bus.wire.channels import Receiver, ReliableSender, open_socket
from areal_bus.constants import POLL_MS, ROLLOUT_DRAIN_S, WORK_HWM
from areal_bus.engines.rollout_factory import make_engine
from areal_bus.runtime.node import LEAVING, NodeShell
from nodes.rollout.core import BatchSeries, Reply, RolloutCore, StepLog


class _Sockets:
    """The worker's data sockets: where requests come from and where each answer goes."""

    def __init__(self, shell: NodeShell, topo):
        slots = topo.rollout_engine.max_batch  # a reply outbox as deep as the batch
        n_agents = topo.replicas("agent")
        self.work = open_socket(shell.ctx, zmq.PULL, [shell.endpoint("work", i) for i in range(n_agents)],
                                bind=False, hwm=WORK_HWM)
        self.agents = [ReliableSender(open_socket(shell.ctx, zmq.PUSH, shell.endpoint("replies", i), bind=False,
                                                  hwm=topo.queue_max_size),
                                      shell.encoder, shell.metrics, f"reply{i}", capacity=slots, track_acks=False)
                       for i in range(n_agents)]
        self.gsocks = [open_socket(shell.ctx, zmq.DEALER, shell.endpoint("gwork", j), bind=False,
                                   hwm=topo.queue_max_size, identity=shell.node_id.encode())
                       for j in range(topo.replicas("gateway"))]
        for sock in self.gsocks:
            sock.linger = 0
        self.gateways = [ReliableSender(sock, shell.encoder, shell.metrics, f"gw{j}", capacity=slots, track_acks=False)
                         for j, sock in enumerate(self.gsocks)]
        # Gateway requests first: a person (or an agent) is waiting on each of them.
        self.sources = [*((j, Receiver(s, shell.metrics, shell.log)) for j, s in enumerate(self.gsocks)),
                        (None, Receiver(self.work, shell.metrics, shell.log))]
        self.poller = zmq.Poller()
        for sock in (shell.sub, self.work, *self.gsocks):
            self.poller.register(sock, zmq.POLLIN)
        self.encoder = shell.encoder
        self.node_id = shell.node_id

    @property
    def outboxes(self) -> list[ReliableSender]:
        return [*self.agents, *self.gateways]

    def send(self, replies: list[Reply]) -> None:
        for to, comp in replies:
            (self.agents if to.kind == "agent" else self.gateways)[to.index].offer(comp.request_id, comp)

    def stop_taking(self, held: list[str]) -> None:
        """Take no more work. Closing the PULL ends its pipes, so the agents' PUSH round robin skips this
        worker from now on; what sat unread in them is lost here and reissued by the agents when we
        leave. The gateways address workers by name: each is told what we will still answer."""
        for sock in (self.work, *self.gsocks):  # unread requests must not wake the poll from now on
            self.poller.unregister(sock)
        self.work.close(linger=0)
        self.sources = []
        notice = self.encoder.encode(m.Event(name=LEAVING, node_id=self.node_id, fields={"held": held}))
        for sock in self.gsocks:
            try:
                sock.send_multipart(notice, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:  # a full queue to that gateway: it learns when we leave, on the hub
                pass

    def send_partial(self, j: int, part: m.PartialCompletion) -> bool:
        """Best effort: False if gateway ``j``'s queue is full (the part is due again next step)."""
        try:
            self.gsocks[j].send_multipart(self.encoder.encode(part), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True


def _turn(shell: NodeShell, bus: _Sockets, core: RolloutCore) -> None:
    """One turn of the loop, at the safe point between two decode steps: versions, new work (from the
    sources still open), a decode step, answers out."""
    for ack in core.on_hub(msg for _, msg in shell.drain_hub()):
        shell.publish(m.TOPIC_VERSION_ACK, ack)
    shell.policy = core.serving  # what the heartbeat reports: served, not merely announced
    if bus.sources:  # leaving: requests still waiting for a version are handed back, not begun
        bus.send(core.start_waiting())
    # Read work only with a free slot and room in every outbox: a slow consumer becomes backpressure.
    for gateway, rx in bus.sources:
        while core.has_room and not any(r.full for r in bus.outboxes):
            got = rx.recv()
            if got is None:
                break
            why = core.malformed(got[1], gateway)
            if why:
                rx.drop(why, type(got[1]).__name__)
            else:
                bus.send(core.on_request(got[1], gateway))
    shell.inflight = core.inflight
    bus.send(core.step())
    for j, part in core.partials():
        core.reported(part, bus.send_partial(j, part))
    for r in bus.outboxes:
        r.flush()
    if core.idle:
        bus.poller.poll(POLL_MS if not any(r.pending for r in bus.outboxes) else 5)


def _requesters(shell: NodeShell) -> bool:
    """Someone is there to take answers: at the end of a run the agents and gateways stop first."""
    return bool(shell.peers.alive("agent") or shell.peers.alive("gateway"))


def _leave(shell: NodeShell, bus: _Sockets, core: RolloutCore) -> None:
    """Stop taking work, finish what runs (bounded), hand the rest back, say so on the hub."""
    running = list(core.engine.running_ids)  # in the decode batch: these we finish
    bus.stop_taking(running)
    t0 = time.monotonic()
    deadline = t0 + ROLLOUT_DRAIN_S
    while time.monotonic() < deadline and _requesters(shell) and (
            not core.idle or any(r.pending for r in bus.outboxes)):
        _turn(shell, bus, core)
    shell.log.info("leaving", running=len(running), handed_back=len(core.inflight),
                   drain_ms=round((time.monotonic() - t0) * 1000))
    shell.leave()  # the agents reissue what we still hold, the gateways resend it


def run(topo, replica: int = 0, base=None) -> int:
    shell = NodeShell(topo, "rollout", replica, base=base, watch=("agent", "weights"), topics=(m.TOPIC_VERSION,),
                      own_policy=True)
    shell.install_signal_handlers()
    bus = _Sockets(shell, topo)
    engine, release_upto = make_engine(topo, shell.node_id, replica, base, log=shell.log)
    core = RolloutCore(engine, shell.node_id, topo.replicas("agent"), StepLog(topo), release_upto=release_upto,
                       metrics=shell.metrics, log=shell.log)
    shell.announce_start(engine=topo.rollout_engine.kind, max_batch=topo.rollout_engine.max_batch)
    shell.start_heartbeat()
    series = BatchSeries(topo.rollout_engine.max_batch)
    # Appended (a restarted worker continues the file), a line at a time: bench reads it after the run.
    series_file = open(shell.log_dir / f"rollout_batch-{shell.node_id}.jsonl", "a", buffering=1)
    try:
        while not shell.stopping.is_set():
            _turn(shell, bus, core)
            if (rec := series.sample(core, time.monotonic())) is not None:
                series_file.write(json.dumps(rec) + "\n")
        _leave(shell, bus, core)
    finally:
        series_file.close()
        shell.close()
    return 0
