"""The rollout worker's logic, without sockets: ``RolloutCore`` takes hub messages and generation
requests and drives the engine's decode steps; each call returns what to send and to whom.

    core = RolloutCore(engine, "rollout-0", n_agents=2, steplog=StepLog(topo), log=log)
    acks = core.on_hub(hub_messages)          # the safe point: a newer announced version is swapped in
    replies = core.start_waiting()            # requests that waited for that version begin
    while core.has_room:                      # and the wiring's outboxes have room
        replies += core.on_request(req, gateway=None or j)
    replies += core.step()                    # one decode step: (ReplyTo, Completion) of those that ended
    for j, part in core.partials(): ...       # streamed gateway requests' new tokens

``BatchSeries`` samples the running batch over time (``rollout_batch-<node>.jsonl`` in the log folder:
how empty the engine gets in a long tail; bench/gpu_e2e.py summarises it). ``nodes.rollout.node`` wires
it all to the bus.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Literal, NamedTuple

import numpy as np
import structlog

from areal_bus.wire import messages as m
from areal_bus.engines.base import RolloutEngine, TokenStreams, partial_completion
from areal_bus.engines.rollout_factory import WeightsUnavailable
from areal_bus.runtime.metrics import Metrics
from areal_bus.version import NONE, PolicyVersion


class ReplyTo(NamedTuple):
    """Where a request's Completion goes: agent replica ``index`` (channel ``replies``) or gateway
    replica ``index`` (back over its ``gwork`` DEALER)."""

    kind: Literal["agent", "gateway"]
    index: int


Reply = tuple[ReplyTo, m.Completion]


class StepLog:
    """Rollout log lines: one per trigger_batch_size / rollout_workers completions of this worker, so
    all workers together log about once per update. ``step`` is the update the samples were admitted
    for (ticket // trigger_batch_size: ``Admission`` hands out tickets in those units, agents' and
    gateway sessions' alike), the highest seen so far: it runs ahead of ``[train] step`` by at most
    staleness_threshold + 1. The version serving them goes in the line as ``version=``."""

    def __init__(self, topo):
        self.every = max(1, topo.effective_trigger // max(1, topo.replicas("rollout")))
        self.batch = topo.effective_trigger  # admission slots per policy version
        self.generated = self.tokens = 0
        self.step = 0

    def add(self, comp: m.Completion, version: int) -> dict | None:
        """Count one finished completion; the line's fields when one is due. ``version`` (the one
        serving it, which the caller logs as ``version=``) is not the step: in gateway mode it trails
        the update the samples are for by up to the staleness bound."""
        self.generated += 1
        self.tokens += int(comp.output_ids.size)
        # The highest so far: samples finish out of admission order, and a line should not step back.
        self.step = max(self.step, comp.ticket // self.batch)
        if self.generated < self.every:
            return None
        line = {"step": self.step, "generated": self.generated, "tokens": self.tokens}
        self.generated = self.tokens = 0
        return line


BATCH_SAMPLE_S = 0.5
"""How often the running batch is sampled: fine enough to see a batch drain in the tail of a round of
long outputs (seconds on a GPU), coarse enough that a long run's series stays small (7,200 lines an hour)."""


class BatchSeries:
    """The running batch over time, one record per ``every`` seconds: wall time ``t``, ``running``
    (sequences in the engine), ``free`` (slots), ``waiting`` (requests held for a version),
    ``max_batch``, the ``version`` served and ``tokens`` (output tokens of finished requests so far)."""

    def __init__(self, max_batch: int, every: float = BATCH_SAMPLE_S):
        self.max_batch = max_batch
        self.every = every
        self.next_at = float("-inf")

    def sample(self, core: "RolloutCore", now: float) -> dict | None:
        """The record due at monotonic time ``now``, or None."""
        if now < self.next_at:
            return None
        self.next_at = now + self.every
        engine = core.engine
        record = {"t": round(time.time(), 3), "running": running_batch(engine), "free": int(engine.free_slots),
                  "waiting": len(core.waiting), "max_batch": self.max_batch, "version": int(engine.version),
                  "tokens": int(core.metrics.counters.get("tokens", 0))}
        if getattr(engine, "paged", False):  # admitted but waiting for KV pages, and preemptions so far
            record.update(waiting_memory=len(engine.running_ids) - engine.in_cache, preemptions=engine.preemptions)
        return record


def running_batch(engine) -> int:
    """Sequences decoding now: with a paged KV cache (rollout_engine.kv_tokens) those holding pages, not the
    requests admitted to the engine that wait for memory (they count against max_batch, but do not run)."""
    return engine.in_cache if getattr(engine, "paged", False) else len(engine.running_ids)


class RolloutCore:
    """One rollout worker's state: the version it serves, the requests it runs or holds back, and
    where each one's answer goes.

    Every method is called between two decode steps (the safe point), so a weight swap never lands
    inside one: tokens sampled before it carry the old version, tokens after it the new one.
    """

    def __init__(self, engine: RolloutEngine, worker: str, n_agents: int, steplog: StepLog, *,
                 release_upto: Callable[[int], None] = lambda version: None,
                 metrics: Metrics | None = None, log=None):
        self.engine = engine
        self.worker = worker
        self.n_agents = n_agents
        self.steplog = steplog
        self.release_upto = release_upto
        self.metrics = metrics if metrics is not None else Metrics()
        self.log = log if log is not None else structlog.get_logger()
        self.peek = getattr(engine, "peek", None)  # live streaming, where the engine can show a running output
        self.streams = TokenStreams()  # streamed gateway requests, each with the index of its gateway
        self.waiting: list[m.GenerateRequest] = []  # requests whose min_version we do not serve yet
        self.reply_to: dict[str, ReplyTo] = {}  # every request we run or hold: where its answer goes
        self.announced = NONE  # the newest version announced (NONE: none yet), and where its weights are
        self.location = ""
        self.serving = PolicyVersion("", engine.version)  # the weights this worker decodes with
        self.unavailable = NONE  # an announced version whose weights would not open: not tried again

    # -- what the wiring asks ---------------------------------------------------------------------

    @property
    def has_room(self) -> bool:
        """A free slot for one more request (slots the waiting requests will need are taken)."""
        return self.engine.free_slots > len(self.waiting)

    @property
    def inflight(self) -> list[str]:
        """Request ids this worker holds, for its heartbeat: an agent reissues them if it dies."""
        return self.engine.running_ids + [r.request_id for r in self.waiting]

    @property
    def idle(self) -> bool:
        return not self.engine.running_ids

    # -- versions -----------------------------------------------------------------------------------

    def on_hub(self, msgs: Iterable) -> list[m.VersionAck]:
        """Hub messages (anything other than VersionAnnounce is ignored). Swaps to the newest
        announced version if it is newer than the one served, and acks it; an announce of the version
        already served is acked again."""
        repeated = False
        for msg in msgs:
            if isinstance(msg, m.VersionAnnounce):
                repeated = True
                if PolicyVersion.of(msg) > self.announced:
                    self.announced, self.location = PolicyVersion.of(msg), msg.location
        # (lineage, version) only goes up; the version alone goes down when a restarted trainer
        # resumes from its checkpoint as a new lineage.
        if self.announced > self.serving and self.announced != self.unavailable:
            return self._swap()
        if repeated and self.announced in (self.serving, self.unavailable):
            # The broadcaster repeats the current version every heartbeat; answering each time heals
            # a lost ack and tells a restarted broadcaster what we serve.
            return [m.VersionAck(node_id=self.worker, version=self.serving.version, lineage=self.serving.lineage)]
        return []

    def _swap(self) -> list[m.VersionAck]:
        before = self.engine.version
        if self.location:
            try:
                took = self.engine.swap_weights(self.announced.version, self.location)
            except WeightsUnavailable as exc:
                # Tolerated: a trainer that crashed took its buffers along. What we serve is still
                # whole (the engine copied it); the restarted trainer announces a newer lineage.
                # On a far host the version may only not have arrived yet: tried again at the next repeat.
                if getattr(exc, "retry", False):
                    self.metrics.inc("weight_swaps_not_yet_here")
                    return []
                self.unavailable = self.announced
                self.metrics.inc("weight_swaps_unavailable")
                self.log.warning("weights_unavailable", version=self.announced.version,
                                 lineage=self.announced.lineage, serving=self.serving.version, error=str(exc)[:300])
                return []
            self.release_upto(max(self.engine.version, before))
        else:  # nothing to load (simulated weights, or the checkpoint the worker started from)
            self.engine.version, took = self.announced.version, 0.0
        self.serving = PolicyVersion(self.announced.lineage, self.engine.version)
        self.metrics.inc("weight_swaps")
        return [m.VersionAck(node_id=self.worker, version=self.serving.version, switch_seconds=took,
                             lineage=self.serving.lineage)]

    # -- requests -------------------------------------------------------------------------------------

    def malformed(self, msg, gateway: int | None = None) -> str:
        """Why ``msg``, read from gateway ``gateway`` (None: from the agents' work channel), must be
        dropped; "" if it is a request we can answer."""
        if not isinstance(msg, m.GenerateRequest):
            return "wrong_type"
        if gateway is None and not 0 <= msg.reply_to < self.n_agents:
            return "bad_reply_to"
        return ""

    def on_request(self, req: m.GenerateRequest, gateway: int | None = None) -> list[Reply]:
        """A request from gateway ``gateway`` or (None) from agent ``req.reply_to``: into the batch,
        or held until its ``min_version`` is served. A resend of one we already hold is ignored."""
        if req.request_id in self.reply_to:
            return []
        to = ReplyTo("agent", req.reply_to) if gateway is None else ReplyTo("gateway", gateway)
        self.reply_to[req.request_id] = to
        if req.stream and gateway is not None and self.peek is not None:
            self.streams.add(req.request_id, gateway)
        if req.min_version > self.engine.version:
            self.waiting.append(req)
            return []
        return self._begin(req)

    def start_waiting(self) -> list[Reply]:
        """Begin the held requests whose min_version is now served."""
        ready = [r for r in self.waiting if r.min_version <= self.engine.version]
        self.waiting = [r for r in self.waiting if r.min_version > self.engine.version]
        return [reply for req in ready for reply in self._begin(req)]

    def _begin(self, req: m.GenerateRequest) -> list[Reply]:
        """Into the running batch, or, for a request the engine cannot run (a prompt longer than its
        cache, ...), an answer saying why: never an exception, which would end this worker and then,
        resent, every other."""
        try:
            self.engine.add_request(req)
        except ValueError as exc:
            self.metrics.inc("requests_refused")
            self.log.warning("request_refused", request=req.request_id, error=str(exc)[:300])
            empty = np.zeros(0, np.int32)
            return [self._answer(m.Completion(
                request_id=req.request_id, episode_id=req.episode_id, ticket=req.ticket, worker=self.worker,
                output_ids=empty, logprobs=np.zeros(0, np.float32), versions=empty, finish_reason="error",
                error=str(exc)[:1000]))]
        return []

    def _answer(self, comp: m.Completion) -> Reply:
        self.streams.discard(comp.request_id)
        # Every request we run has its entry; agent 0 stands in should an engine end one it never got.
        return self.reply_to.pop(comp.request_id, ReplyTo("agent", 0)), comp

    # -- decoding -------------------------------------------------------------------------------------

    def step(self) -> list[Reply]:
        """One decode step of the running batch (none if nothing runs): the requests that finished,
        each with where its Completion goes."""
        finished = [self._answer(comp) for comp in (self.engine.step() if self.engine.running_ids else [])]
        for _, comp in finished:
            self.metrics.inc("samples")
            self.metrics.inc("tokens", int(comp.output_ids.size))
            line = self.steplog.add(comp, self.engine.version)
            if line:
                self.log.info("step", **line, version=self.engine.version)
        self.metrics.gauge("running", running_batch(self.engine))
        self.metrics.gauge("queue.waiting_version", len(self.waiting))
        return finished

    def partials(self) -> list[tuple[int, m.PartialCompletion]]:
        """New tokens of streamed gateway requests that are due: (gateway index, PartialCompletion).
        Tell ``reported`` whether each was delivered; one not delivered is due again next step."""
        return [(j, partial_completion(self.engine, rid, start, ids))
                for rid, j, start, ids in (self.streams.due(self.peek) if self.streams else ())]

    def reported(self, part: m.PartialCompletion, delivered: bool) -> None:
        if not delivered:  # best effort: the Completion that ends the request carries every token anyway
            self.metrics.inc("stream.partials_dropped")
            return
        self.streams.mark(part.request_id, part.start + part.output_ids.size)
        self.metrics.inc("stream.partials")
