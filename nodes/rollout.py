"""Rollout node: a generation worker. Pulls requests, decodes them in a continuous batch, tags every
token with the policy version that produced it, and pushes finished trajectories downstream.

The loop has one rhythm, the engine's decode step. Between two steps (the safe point) the worker
drains the hub, switches to a newly announced policy version without stopping the running batch
(tokens after the switch carry the new version), and lets new requests join while it has free slots.
It reads work only when it has a free slot and its outbox has room, so a slow consumer downstream
turns into backpressure all the way up to the agent, never into loss.

Run: areal-bus node rollout --topology topology/default.yaml --replica 0
"""

from __future__ import annotations

import time

import zmq

from areal_bus import messages as m
from areal_bus.channels import Receiver, ReliableSender, open_socket
from areal_bus.constants import POLL_MS, WORK_HWM
from areal_bus.engines.sim import SimRolloutEngine
from areal_bus.node import NodeShell


def make_engine(topo, worker: str):
    if topo.rollout_engine.kind == "sim":
        return SimRolloutEngine(topo.rollout_engine, worker)
    raise ValueError(f"unknown rollout engine {topo.rollout_engine.kind!r}")


def downstream(topo, shell) -> tuple[list[str], str]:
    """Where finished trajectories go: every reward replica (PUSH round-robins), or the trainer."""
    n = topo.replicas("reward")
    if n:
        return [shell.endpoint("samples", i) for i in range(n)], "reward"
    return [shell.endpoint("train")], "trainer"


class StepLog:
    """Rollout log lines: one per trigger_batch_size / rollout_workers samples this worker finishes,
    so all workers together log about once per train step. ``step`` is the train step the samples
    are scheduled for (their admission ticket // batch): rollout runs ahead of training by up to the
    staleness bound, and the log shows it."""

    def __init__(self, topo):
        self.every = max(1, topo.effective_trigger // max(1, topo.replicas("rollout")))
        self.batch = topo.effective_trigger
        self.generated = self.tokens = 0
        self.step = 0
        self.lines = 0

    def add(self, traj: m.Trajectory) -> dict | None:
        self.generated += 1
        self.tokens += int(traj.output_ids.size)
        self.step = max(self.step, traj.ticket // self.batch)
        if self.generated < self.every:
            return None
        line = {"step": self.step, "generated": self.generated, "tokens": self.tokens}
        self.generated = self.tokens = 0
        self.lines += 1
        return line


def run(topo, replica: int = 0, base=None) -> int:
    shell = NodeShell(topo, "rollout", replica, base=base, watch=("reward", "trainer", "weights"),
                      topics=(m.TOPIC_VERSION, m.TOPIC_TRAJ_ACK))
    shell.install_signal_handlers()
    agents = [shell.endpoint("work", i) for i in range(topo.replicas("agent"))]
    work = open_socket(shell.ctx, zmq.PULL, agents, bind=False, hwm=WORK_HWM)
    targets, consumer_kind = downstream(topo, shell)
    out_sock = open_socket(shell.ctx, zmq.PUSH, targets, bind=False, hwm=topo.queue_max_size)
    sender = ReliableSender(out_sock, shell.encoder, shell.metrics, "out", capacity=topo.rollout_engine.max_batch)
    inbox = Receiver(work, shell.metrics, shell.log)
    engine = make_engine(topo, shell.node_id)
    steplog = StepLog(topo)
    waiting: list[m.GenerateRequest] = []  # requests whose min_version we do not serve yet
    announced = None
    shell.announce_start(engine=topo.rollout_engine.kind, max_batch=topo.rollout_engine.max_batch,
                         downstream=consumer_kind)
    shell.start_heartbeat()
    poller = zmq.Poller()
    poller.register(shell.sub, zmq.POLLIN)
    poller.register(work, zmq.POLLIN)
    t_last = time.monotonic()
    try:
        while not shell.stopping.is_set():
            for _, msg in shell.drain_hub():
                if isinstance(msg, m.VersionAnnounce):
                    if announced is None or msg.version > announced.version:
                        announced = msg
                elif isinstance(msg, m.TrajAck):
                    sender.ack(msg.consumed)
                    sender.ack(msg.stale)
                    sender.ack(msg.duplicate)
                elif isinstance(msg, m.Event) and msg.name == "peer_restarted" and msg.fields.get("kind") == consumer_kind:
                    n = sender.resend()
                    shell.log.warning("resent", trajectories=n, reason=f"{msg.node_id} restarted")
            # Safe point: between two decode steps.
            if announced is not None and announced.version > engine.version:
                took = engine.swap_weights(announced.version, announced.location)
                shell.version = engine.version
                shell.publish(m.TOPIC_VERSION_ACK, m.VersionAck(node_id=shell.node_id, version=engine.version,
                                                               switch_seconds=took))
                shell.metrics.inc("weight_swaps")
            ready = [r for r in waiting if r.min_version <= engine.version]
            waiting = [r for r in waiting if r.min_version > engine.version]
            for req in ready:
                engine.add_request(req)
            while engine.free_slots > len(waiting) and not sender.full:
                got = inbox.recv()
                if got is None:
                    break
                req = got[1]
                if not isinstance(req, m.GenerateRequest):
                    inbox.drop("wrong_type", type(req).__name__)
                    continue
                if req.min_version > engine.version:
                    waiting.append(req)
                else:
                    engine.add_request(req)
            shell.inflight = engine.running_ids + [r.request_id for r in waiting]
            finished = engine.step() if engine.running_ids else []
            for traj in finished:
                sender.offer(traj.traj_id, traj, (traj.start_version, int(traj.versions.max(initial=0))))
                shell.metrics.inc("samples")
                shell.metrics.inc("tokens", int(traj.output_ids.size))
                line = steplog.add(traj)
                if line:
                    shell.log.info("step", **line, version=engine.version)
            if finished:
                shell.publish(m.TOPIC_GEN_DONE, m.GenDone(worker=shell.node_id,
                                                          request_ids=[t.traj_id for t in finished],
                                                          tokens=sum(int(t.output_ids.size) for t in finished)))
            sender.flush()
            now = time.monotonic()
            if now - t_last > 1.0:
                sender.resend_overdue()
                t_last = now
            shell.metrics.gauge("running", len(engine.running_ids))
            shell.metrics.gauge("queue.waiting_version", len(waiting))
            if not engine.running_ids:
                poller.poll(POLL_MS if not sender.pending else 5)
    finally:
        shell.close()
    return 0
