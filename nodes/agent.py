"""Agent node: starts episodes, under the staleness admission rule, and sees each one through.

``EpisodeSource`` (no sockets) decides what to start and tracks every request until the data path owns
it: admitted -> claimed by a rollout worker (its heartbeat lists the request) -> done (the worker
finished generating; from here on trajectories are protected by acks and resends) -> acked by the
trainer. A request held by a worker that dies, or never claimed while a worker died, is issued again
under the same id, so the trainer still trains on it at most once.

With ``agent.framework: sim`` episodes are synthetic prompts; real agent tasks arrive with the RL issue
and reach the rollout workers the same way.

Run: areal-bus node agent --topology topology/default.yaml --replica 0
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import numpy as np
import zmq

from areal_bus import messages as m
from areal_bus.admission import Admission
from areal_bus.channels import open_socket
from areal_bus.constants import POLL_MS, REISSUE_UNCLAIMED_S, WORK_HWM
from areal_bus.node import NodeShell


@dataclass(slots=True)
class _Req:
    msg: m.GenerateRequest
    issued_at: float
    claimed_by: str | None = None
    done: bool = False


class EpisodeSource:
    def __init__(self, topo, replica: int, replicas: int):
        self.topo = topo
        self.replica = replica
        self.cfg = topo.agent
        self.admission = Admission(topo.effective_staleness, topo.effective_trigger, replicas, replica)
        self.rng = np.random.default_rng(self.cfg.seed * 1000 + replica)
        self.prefix = f"a{replica}-{uuid.uuid4().hex[:8]}"
        self.tickets = 0
        self.version = 0
        self.finished = False
        self.requests: dict[str, _Req] = {}  # admitted, not yet acked by the trainer
        self.to_send: list[m.GenerateRequest] = []  # admitted or reissued, not yet taken by ZeroMQ

    def new_requests(self, now: float) -> list[m.GenerateRequest]:
        """Admit as many new episodes as the rule allows (none while unsent ones wait)."""
        if self.finished or self.to_send:
            return []
        n = self.admission.capacity(self.version)
        group = self.cfg.group_size
        n -= n % group  # a GRPO group is admitted whole or not at all
        out = []
        for _ in range(n // group):
            gid = f"{self.prefix}-g{self.tickets}"
            prompt = self.rng.integers(0, 32000, self.cfg.prompt_len, dtype=np.int32)
            for k in range(group):
                rid = f"{self.prefix}-{self.tickets}"
                self.tickets += 1
                # The slot in consumption order (stale drops give theirs back): slot // batch is the
                # train step this sample is meant for, at most staleness steps ahead of training.
                slot = self.admission.admitted + len(out)
                req = m.GenerateRequest(
                    request_id=rid, episode_id=rid, ticket=slot * self.topo.replicas("agent") + self.replica,
                    min_version=self.version, max_tokens=self.topo.rollout_engine.output_len.max,
                    temperature=1.0, prompt_ids=prompt, group_id=gid)
                self.requests[rid] = _Req(req, now)
                out.append(req)
        self.admission.admit(len(out))
        self.to_send.extend(out)
        return out

    def on_ack(self, ack: m.TrajAck) -> None:
        for rid in ack.consumed:
            self.requests.pop(rid, None)
        mine = [rid for rid in ack.stale if self.requests.pop(rid, None) is not None]
        self.admission.give_back(len(mine))
        for rid in ack.duplicate:
            self.requests.pop(rid, None)

    def on_done(self, done: m.GenDone) -> None:
        for rid in done.request_ids:
            req = self.requests.get(rid)
            if req is not None:
                req.done = True

    def on_claims(self, worker: str, inflight: list) -> None:
        for rid in inflight:
            req = self.requests.get(rid)
            if req is not None and not req.done:
                req.claimed_by = worker

    def reissue(self, dead_worker: str | None, now: float) -> list[m.GenerateRequest]:
        """Requests to issue again: those the dead worker held, and those nobody claimed for long.
        When a worker dies, unclaimed requests may have been sitting in its pipe: reissue those too."""
        out = []
        waiting = {r.request_id for r in self.to_send}
        for rid, req in self.requests.items():
            if req.done or rid in waiting:
                continue
            held_by_dead = dead_worker is not None and req.claimed_by == dead_worker
            unclaimed = req.claimed_by is None and (dead_worker is not None or now - req.issued_at > REISSUE_UNCLAIMED_S)
            if held_by_dead or unclaimed:
                req.claimed_by, req.issued_at = None, now
                out.append(req.msg)
        self.to_send.extend(out)
        return out

    @property
    def running(self) -> int:
        return sum(1 for r in self.requests.values() if not r.done)


def run(topo, replica: int = 0, base=None) -> int:
    shell = NodeShell(topo, "agent", replica, base=base, watch=("rollout",),
                      topics=(m.TOPIC_VERSION, m.TOPIC_TRAJ_ACK, m.TOPIC_GEN_DONE, m.TOPIC_RUN))
    shell.install_signal_handlers()
    work = open_socket(shell.ctx, zmq.PUSH, shell.endpoint("work", replica), bind=True, hwm=WORK_HWM)
    src = EpisodeSource(topo, replica, topo.replicas("agent"))
    shell.announce_start(mode="async" if topo.is_async else "sync", staleness=topo.effective_staleness,
                         batch=src.admission.batch_share)
    shell.start_heartbeat()
    poller = zmq.Poller()
    poller.register(shell.sub, zmq.POLLIN)
    try:
        while not shell.stopping.is_set():
            now = time.monotonic()
            for env, msg in shell.drain_hub():
                if isinstance(msg, m.VersionAnnounce):
                    src.version = max(src.version, msg.version)
                elif isinstance(msg, m.TrajAck):
                    src.on_ack(msg)
                elif isinstance(msg, m.GenDone):
                    src.on_done(msg)
                elif isinstance(msg, m.Heartbeat) and msg.kind == "rollout":
                    src.on_claims(msg.node_id, msg.inflight)
                elif isinstance(msg, m.Event) and msg.name == "peer_dead" and msg.fields.get("kind") == "rollout":
                    again = src.reissue(msg.node_id, now)
                    if again:
                        shell.log.warning("reissued", requests=len(again), dead_worker=msg.node_id)
                elif isinstance(msg, m.RunState) and msg.finished and not src.finished:
                    src.finished = True
                    shell.log.info("run_finished", version=msg.version, admitted=src.tickets)
            again = src.reissue(None, now)
            if again:
                shell.log.warning("reissued", requests=len(again), reason="unclaimed")
            admitted = src.new_requests(now)
            shell.metrics.inc("admitted", len(admitted))
            while src.to_send:
                try:
                    work.send_multipart(shell.encoder.encode(src.to_send[0], (src.to_send[0].min_version,)),
                                        flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break  # every worker is busy: the request waits here, counted as queued
                src.to_send.pop(0)
                shell.metrics.inc("sent")
            shell.metrics.gauge("queue.unsent", len(src.to_send))
            shell.metrics.gauge("running", src.running)
            shell.metrics.gauge("capacity", src.admission.capacity(src.version))
            shell.inflight = []
            timeout = POLL_MS if not src.to_send else 2  # retry sends soon when workers are busy
            poller.poll(timeout)
    finally:
        shell.close()
    return 0
