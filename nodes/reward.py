"""Reward node: scores finished trajectories and passes them on to the trainer.

``reward_source: rule`` scores with the task's verifier (for the simulated task, a deterministic
pseudo-random score per episode, the same however often it is retried). Trajectories that already
carry a reward (an agent that scored its own episode) pass through unchanged. The node keeps what it
forwarded until the trainer acknowledges it, and resends if the trainer restarts.

Run: areal-bus node reward --topology topology/default.yaml --replica 0
"""

from __future__ import annotations

import hashlib
import time

import zmq

from areal_bus import messages as m
from areal_bus.channels import Receiver, ReliableSender, open_socket
from areal_bus.constants import POLL_MS
from areal_bus.node import NodeShell


class Scorer:
    """Sets ``traj.reward`` by the configured source. Holds no sockets. ``verifier`` scores a real
    task's trajectory (replaying its policy turns); without one, the simulated task's score is used."""

    def __init__(self, source: str, verifier=None):
        self.source = source
        self.verifier = verifier

    def score(self, traj: m.Trajectory) -> m.Trajectory:
        if traj.reward is not None or self.source == "passthrough":
            return traj
        if self.verifier is not None:
            traj.reward = float(self.verifier(traj))
            return traj
        digest = hashlib.blake2b(traj.episode_id.encode(), digest_size=4).digest()
        traj.reward = int.from_bytes(digest, "little") / 0xFFFFFFFF
        return traj


def make_scorer(topo, base=None) -> Scorer:
    if topo.agent.framework == "sim":
        return Scorer(topo.agent.reward_source)
    from areal_bus.tasks.runner import GuessDriver, load_tokenizer, verify

    driver = GuessDriver(load_tokenizer(topo.model_path(base)), n=topo.agent.task_size, max_turns=topo.agent.max_turns)
    return Scorer(topo.agent.reward_source, lambda traj: verify(driver, traj))


def run(topo, replica: int = 0, base=None) -> int:
    shell = NodeShell(topo, "reward", replica, base=base, watch=("trainer",), topics=(m.TOPIC_TRAJ_ACK,))
    shell.install_signal_handlers()
    pull = open_socket(shell.ctx, zmq.PULL, shell.endpoint("samples", replica), bind=True, hwm=topo.queue_max_size)
    push = open_socket(shell.ctx, zmq.PUSH, shell.endpoint("train"), bind=False, hwm=topo.queue_max_size)
    sender = ReliableSender(push, shell.encoder, shell.metrics, "out", capacity=topo.queue_max_size)
    inbox = Receiver(pull, shell.metrics, shell.log)
    scorer = make_scorer(topo, base)
    shell.announce_start(reward_source=topo.agent.reward_source)
    shell.start_heartbeat()
    poller = zmq.Poller()
    poller.register(shell.sub, zmq.POLLIN)
    poller.register(pull, zmq.POLLIN)
    t_last = time.monotonic()
    try:
        while not shell.stopping.is_set():
            for _, msg in shell.drain_hub():
                if isinstance(msg, m.TrajAck):
                    for ids in (msg.consumed, msg.stale, msg.duplicate):
                        sender.ack(ids)
                elif isinstance(msg, m.Event) and msg.name == "peer_restarted" and msg.fields.get("kind") == "trainer":
                    shell.log.warning("resent", trajectories=sender.resend(), reason=f"{msg.node_id} restarted")
            while not sender.full:  # stop reading when the trainer is not keeping up: backpressure
                got = inbox.recv()
                if got is None:
                    break
                env, traj = got
                if not isinstance(traj, m.Trajectory):
                    inbox.drop("wrong_type", type(traj).__name__)
                    continue
                try:
                    traj = scorer.score(traj)
                except ValueError as err:
                    # Tolerated: a trajectory the verifier cannot replay scores 0 (dropping it would
                    # only make its producer resend it); counted and logged like a bad frame.
                    inbox.drop("unverifiable", str(err))
                    traj.reward = 0.0
                sender.offer(traj.traj_id, traj, env.versions)
                shell.metrics.inc("samples")
                shell.metrics.inc("tokens", int(traj.output_ids.size))
            sender.flush()
            now = time.monotonic()
            if now - t_last > 1.0:
                sender.resend_overdue()
                t_last = now
            poller.poll(POLL_MS if not sender.pending else 5)
    finally:
        shell.close()
    return 0
