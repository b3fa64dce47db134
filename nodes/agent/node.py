"""The agent node over the bus (``agent.via: bus``): the EpisodeSource wired to the rollout workers.

Generation requests go out on the agent's ``work`` channel (PUSH, so idle workers take them),
completions come back on ``replies``; finished episodes go to the reward node (or the trainer) through
a ReliableSender, kept until the trainer acknowledges them and resent when their consumer restarts. The
hub brings versions, acks, the run state, the workers' claims (their heartbeats) and peer deaths or
departures (a worker removed by a rescale says it leaves), after which what that worker held is issued
again.

Run: areal-bus node agent --topology topology/sim.yaml --replica 0
"""

from __future__ import annotations

import time

import zmq

from areal_bus.wire import messages as m
from areal_bus.wire.channels import Receiver, ReliableSender, open_socket
from areal_bus.constants import POLL_MS, WORK_HWM
from areal_bus.runtime.ledger import Ledger, ledger_path
from areal_bus.runtime.node import NodeShell
from nodes.agent.core import EpisodeSource, make_driver

RESEND_EVERY_S = 1.0
"""How often trajectories the trainer has not acknowledged in time are offered again."""


def downstream(topo, shell) -> list[str]:
    """Where finished episodes go: every reward replica (PUSH round-robins), or the trainer."""
    n = topo.replicas("reward")
    return [shell.endpoint("samples", i) for i in range(n)] if n else [shell.endpoint("train")]


def on_hub(shell, src: EpisodeSource, sender: ReliableSender, consumer_kind: str, now: float) -> None:
    for _, msg in shell.drain_hub():
        if src.sources.hear(msg, src.admission, now):  # agents or gateways scaled (or gone) while the run goes on
            shell.log.info("admission_sources", sources=",".join(src.sources.names), share=src.admission.batch_share)
        if isinstance(msg, m.VersionAnnounce):
            src.on_version(msg)
        elif isinstance(msg, m.TrajAck):
            sender.settle(msg)  # admission counts come from the run state, not from acks
        elif isinstance(msg, m.Heartbeat) and msg.kind == "rollout":
            src.on_claims(msg.node_id, msg.inflight)
        elif isinstance(msg, m.Event) and msg.name in ("peer_dead", "peer_left", "peer_restarted") \
                and msg.fields.get("kind") == "rollout":
            # A worker that left (scaled away) answered what it could first: the rest is ours again now. One
            # restarted under its name (seen before it was missed for long enough to be dead) holds nothing:
            # the new process never heard of what the old one ran. Its heartbeat (after this Event) claims
            # only what the new process runs.
            n = src.reissue(msg.node_id, now)
            if n:
                shell.log.warning("reissued", requests=n, dead_worker=msg.node_id, why=msg.name)
        elif isinstance(msg, m.Event) and msg.name == "peer_restarted" and msg.fields.get("kind") == consumer_kind:
            shell.log.warning("resent", trajectories=sender.resend(), reason=f"{msg.node_id} restarted")
        elif isinstance(msg, m.RunState):
            src.on_run_state(msg)
            if msg.finished and not src.finished:
                src.finished = True
                shell.log.info("run_finished", version=msg.version, episodes=src.count)


def on_completions(shell, src: EpisodeSource, inbox: Receiver, sender: ReliableSender, ledger: Ledger,
                   now: float) -> None:
    for _, comp in inbox.drain():
        if not isinstance(comp, m.Completion):
            inbox.drop("wrong_type", type(comp).__name__)
            continue
        abandoned = src.abandoned
        traj = src.on_completion(comp, now)
        if src.abandoned > abandoned:
            shell.metrics.inc("episodes_abandoned")
            shell.log.warning("episode_abandoned", episode=comp.episode_id, worker=comp.worker, error=comp.error[:200])
        hand_on(shell, src.deliver(traj, now), sender, ledger)
    hand_on(shell, src.deliver(None, now), sender, ledger)  # with staleness.in_order: groups held too long


def hand_on(shell, trajs: list, sender: ReliableSender, ledger: Ledger) -> None:
    for traj in trajs:
        ledger.write("produced", ids=[traj.traj_id])
        sender.offer(traj.traj_id, traj)
        shell.metrics.inc("samples")
        shell.metrics.inc("tokens", int(traj.loss_mask.sum()))


def send_work(shell, src: EpisodeSource, work) -> None:
    while src.to_send:
        try:
            work.send_multipart(shell.encoder.encode(src.to_send[0]), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            break  # every worker is busy: the request waits here, counted as queued
        src.to_send.pop(0)


def run(topo, replica: int = 0, base=None) -> int:
    shell = NodeShell(topo, "agent", replica, base=base, watch=("rollout", "reward", "trainer", "agent", "gateway"),
                      topics=(m.TOPIC_VERSION, m.TOPIC_TRAJ_ACK, m.TOPIC_RUN))
    shell.install_signal_handlers()
    work = open_socket(shell.ctx, zmq.PUSH, shell.endpoint("work", replica), bind=True, hwm=WORK_HWM)
    replies = open_socket(shell.ctx, zmq.PULL, shell.endpoint("replies", replica), bind=True,
                          hwm=topo.queue_max_size)
    out = open_socket(shell.ctx, zmq.PUSH, downstream(topo, shell), bind=False, hwm=topo.queue_max_size)
    sender = ReliableSender(out, shell.encoder, shell.metrics, "out", capacity=topo.queue_max_size)
    inbox = Receiver(replies, shell.metrics, shell.log)
    src = EpisodeSource(topo, replica, topo.replicas("agent"), make_driver(topo, base),
                        source=f"{shell.node_id}:{shell.incarnation}")
    consumer_kind = "reward" if topo.replicas("reward") else "trainer"
    ledger = Ledger(ledger_path(shell.log_dir, shell.node_id))  # what we produced, for the audit
    shell.announce_start(mode="async" if topo.is_async else "sync", staleness=topo.effective_staleness,
                         batch=src.admission.batch_share, framework=topo.agent.framework)
    shell.start_heartbeat()
    poller = zmq.Poller()
    poller.register(shell.sub, zmq.POLLIN)
    poller.register(replies, zmq.POLLIN)
    t_resend = time.monotonic()
    try:
        while not shell.stopping.is_set():
            now = time.monotonic()
            on_hub(shell, src, sender, consumer_kind, now)
            on_completions(shell, src, inbox, sender, ledger, now)
            n = src.reissue(None, now)
            if n:
                shell.log.warning("reissued", requests=n, reason="unclaimed")
            if not sender.full:  # backpressure: no new episodes while the data path is backed up
                shell.metrics.inc("admitted", src.start_episodes(now))
            send_work(shell, src, work)
            sender.flush()
            if now - t_resend > RESEND_EVERY_S:
                sender.resend_overdue()
                t_resend = now
            shell.metrics.gauge("queue.unsent", len(src.to_send))
            shell.metrics.gauge("running", len(src.requests))
            shell.metrics.gauge("held", sum(len(g.done) for g in src.held.values()))
            shell.metrics.gauge("capacity", src.admission.capacity(src.version))
            shell.metrics.gauge("lead", src.admission.lead)
            shell.metrics.gauge("admission_batch", src.admission.batch)
            poller.poll(POLL_MS if not (src.to_send or sender.pending) else 2)
    finally:
        ledger.close()
        shell.close()
    return 0
