"""Reward node: scores finished trajectories and passes them on to the trainer.

``reward_source: rule`` scores with the task's verifier (for the simulated task, a deterministic
pseudo-random score per episode, the same however often it is retried). Trajectories that already
carry a reward (an agent that scored its own episode) pass through unchanged. The node keeps what it
forwarded until the trainer acknowledges it, and resends if the trainer restarts.

Two more sources, ``agent.reward_source: judge`` and ``reward_model``, take their settings from the
reward node's own config (``nodes.reward.config`` in the topology, schema ``RewardNodeConfig`` in
areal_bus/config/node_configs.py, checked by ``areal-bus validate`` with the router file it names):

    agent:
      reward_source: judge                   # an LLM judge through the model router
    nodes:
      reward:
        config:
          router_config: configs/router.yaml # its judge_model route; the key from ${AREAL_BUS_API_KEY}
          rubric: "..."                      # optional; {task} and {transcript} are filled in
          score_scale: 10                    # the judge scores 0..score_scale; reward = score / scale
      # or, with agent.reward_source: reward_model (a local sequence-classification checkpoint)
          model_path: models/my-rm           # reward = sigmoid(logit)
          device: cpu

A judge reply with no number in it scores 0 and is counted (metric ``judge_unparsed``). A judge that
cannot be reached raises RouterError (one line naming the failure and its fix) and stops the node:
scoring 0 by default would silently train on wrong rewards.

Run: areal-bus node reward --topology topology/default.yaml --replica 0
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from pathlib import Path

import zmq

from areal_bus.wire import messages as m
from areal_bus.wire.channels import Receiver, ReliableSender, open_socket
from areal_bus.constants import POLL_MS
from areal_bus.runtime.node import NodeShell
from areal_bus.config.node_configs import DEFAULT_RUBRIC
from areal_bus.tasks.plugins import make_driver
from areal_bus.tasks.runner import verify


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


# -- reward_source judge / reward_model (nodes.reward.config: RewardNodeConfig) --------------------------

class EpisodeText:
    """(task, transcript) of a trajectory: ``meta['task']`` / ``meta['transcript']`` when the agent
    recorded them, else the prompt and output tokens decoded with the policy's tokenizer."""

    def __init__(self, tokenizer=None):
        self.tok = tokenizer

    def _decode(self, ids) -> str:
        if self.tok is None:
            return f"({int(ids.size)} tokens of a simulated episode)"
        return self.tok.decode(ids, skip_special_tokens=True)

    def __call__(self, traj: m.Trajectory) -> tuple[str, str]:
        task = traj.meta.get("task")
        transcript = traj.meta.get("transcript")
        return (task if isinstance(task, str) else self._decode(traj.prompt_ids),
                transcript if isinstance(transcript, str) else self._decode(traj.output_ids))


def parse_score(text: str, scale: float = 10.0) -> float | None:
    """The first number in ``text`` over ``scale``, clipped to [0, 1]; None if there is none."""
    found = re.search(r"-?\d+(?:\.\d+)?", text or "")
    if found is None:
        return None
    return min(1.0, max(0.0, float(found.group()) / scale))


class Judge:
    """An LLM judge: asks the router's judge route to grade the episode with ``rubric`` and parses the
    first number of its reply. Unparseable replies score 0 and are counted in ``unparsed``."""

    def __init__(self, router, rubric: str = DEFAULT_RUBRIC, scale: float = 10.0, route: str = "judge_model",
                 text_of=None, metrics=None):
        self.router, self.rubric, self.scale, self.route = router, rubric, scale, route
        self.text_of = text_of or EpisodeText()
        self.metrics = metrics
        self.unparsed = 0

    def prompt(self, traj: m.Trajectory) -> str:
        task, transcript = self.text_of(traj)
        if "{task}" not in self.rubric and "{transcript}" not in self.rubric:
            return f"{self.rubric}\n\nTask:\n{task}\n\nTranscript:\n{transcript}"
        # str.replace, not str.format: a rubric may well contain other braces (JSON examples).
        return self.rubric.replace("{task}", task).replace("{transcript}", transcript)

    def __call__(self, traj: m.Trajectory) -> float:
        from areal_bus.router import reply_text  # lazy: the router's HTTP client, for a judging node only

        reply = self.router.chat_sync(self.route, {"messages": [{"role": "user", "content": self.prompt(traj)}]})
        score = parse_score(reply_text(reply), self.scale)
        if score is None:
            self.unparsed += 1
            if self.metrics is not None:
                self.metrics.inc("judge_unparsed")
            return 0.0
        return score


class RewardModel:
    """A local scoring model: a Hugging Face sequence-classification checkpoint; reward =
    sigmoid(logit) of a one-logit head (of a multi-label head: the softmax of the last label)."""

    def __init__(self, path: str | Path, device: str = "cpu", max_length: int = 2048, text_of=None):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModelForSequenceClassification.from_pretrained(str(path)).to(device).eval()
        self.device, self.max_length = device, max_length
        self.text_of = text_of or EpisodeText()

    def __call__(self, traj: m.Trajectory) -> float:
        task, transcript = self.text_of(traj)
        enc = self.tok(f"{task}\n{transcript}", truncation=True, max_length=self.max_length, return_tensors="pt")
        with self.torch.no_grad():
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits[0].float()
        if logits.numel() == 1:
            return 1.0 / (1.0 + math.exp(-float(logits[0])))
        return float(self.torch.softmax(logits, -1)[-1])


def _episode_text(topo, base) -> EpisodeText:
    if topo.agent.framework == "sim":
        return EpisodeText()
    from areal_bus.tasks.runner import load_tokenizer  # lazy: transformers, only for a real task

    return EpisodeText(load_tokenizer(topo.model_path(base)))


def make_scorer(topo, base=None, metrics=None, log=None) -> Scorer:
    """The scorer for ``agent.reward_source`` (judge / reward_model: with nodes.reward.config). ``metrics``
    counts unparseable judge replies; ``log`` gets the router's per-request lines."""
    cfg = topo.reward_config()  # validated with the topology (areal_bus/config/node_configs.py)
    source = topo.reward_source()
    if source == "judge":
        from areal_bus.router import ModelRouter, load_router_config  # lazy: see Judge.__call__

        router = ModelRouter(load_router_config(topo.resolve(cfg.router_config, base)), log=log)
        router.cfg.route(cfg.judge_model)  # an unknown route fails at start, not on the first episode
        return Scorer(source, Judge(router, cfg.rubric, cfg.score_scale, cfg.judge_model,
                                    _episode_text(topo, base), metrics))
    if source == "reward_model":  # the schema requires model_path with this source
        return Scorer(source, RewardModel(topo.resolve(cfg.model_path, base), cfg.device, cfg.max_length,
                                          _episode_text(topo, base)))
    return _rule_scorer(topo, source, base)


def _rule_scorer(topo, source: str, base=None) -> Scorer:
    if topo.agent.framework == "sim":
        return Scorer(source)
    # The task's driver replays the episode and scores it: the task's rule, or agent.reward_source's
    # function (package.module:function) when it names one (areal_bus/tasks/plugins.py).
    driver = make_driver(topo, base)
    return Scorer(source, lambda traj: verify(driver, traj))


def run(topo, replica: int = 0, base=None) -> int:
    shell = NodeShell(topo, "reward", replica, base=base, watch=("trainer",), topics=(m.TOPIC_TRAJ_ACK,))
    shell.install_signal_handlers()
    pull = open_socket(shell.ctx, zmq.PULL, shell.endpoint("samples", replica), bind=True, hwm=topo.queue_max_size)
    push = open_socket(shell.ctx, zmq.PUSH, shell.endpoint("train"), bind=False, hwm=topo.queue_max_size)
    sender = ReliableSender(push, shell.encoder, shell.metrics, "out", capacity=topo.queue_max_size)
    inbox = Receiver(pull, shell.metrics, shell.log)
    scorer = make_scorer(topo, base, metrics=shell.metrics, log=shell.log)
    shell.announce_start(reward_source=scorer.source)
    shell.start_heartbeat()
    poller = zmq.Poller()
    poller.register(shell.sub, zmq.POLLIN)
    poller.register(pull, zmq.POLLIN)
    t_last = time.monotonic()
    try:
        while not shell.stopping.is_set():
            for _, msg in shell.drain_hub():
                if isinstance(msg, m.TrajAck):
                    sender.settle(msg)
                    sender.ack(msg.rejected)  # refused for good: resending it would only be refused again
                elif isinstance(msg, m.Event) and msg.name == "peer_restarted" and msg.fields.get("kind") == "trainer":
                    shell.log.warning("resent", trajectories=sender.resend(), reason=f"{msg.node_id} restarted")
            while not sender.full:  # stop reading when the trainer is not keeping up: backpressure
                got = inbox.recv()
                if got is None:
                    break
                _, traj = got
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
                sender.offer(traj.traj_id, traj)
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
