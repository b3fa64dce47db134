"""Every message that crosses the bus, in one place, each with its direction and channel.

A message is a plain dataclass. Scalar fields travel in a msgpack header; fields named in ``ARRAYS``
are numpy arrays that travel as raw buffers in extra zero-copy frames (see ``codec``), of any wire dtype
and shape unless ``ARRAY_KINDS`` fixes an array's dtype and rank. The envelope
around every message carries only the wire version, the type tag and the producer id; the policy
version a payload was made under is in the message itself (``Completion.versions``, one per token).

The life of one trajectory (channels as in the topology's ``endpoints``; "hub" is PUB -> bus -> SUB):

  1. agent    -> rollout  GenerateRequest    on ``work``     the episode's next turn (one per turn)
  2. rollout  -> agent    Completion         on ``replies``  tokens, logprobs and the version of each
  3. agent    -> reward   Trajectory         on ``samples``  the finished episode (straight on ``train``
                                                             when the topology has no reward node)
  4. reward   -> trainer  Trajectory         on ``train``    the same, with ``reward`` set
  5. trainer  -> agent, reward, gateway  TrajAck  on hub (``ack``)  ids taken for good: forget them
     trainer  -> all      RunState           on hub (``run``)  totals per source: admission reopens
  6. trainer  -> weights  WeightsReady       on ``weights``  update ``version`` is done, at ``location``
  7. weights  -> all      VersionAnnounce    on hub (``ver``)  rollout swaps at its next safe point
  8. rollout  -> weights  VersionAck         on hub (``vack``) this worker serves it now
  9. weights  -> trainer  VersionCommitted   on hub (``vcom``) every live worker does: old buffers free

The gateway's path replaces steps 1-3: each rollout worker connects a DEALER (named by its node id)
to every gateway's ROUTER on ``gwork``; the gateway sends GenerateRequest there, the worker answers on
the same connection with PartialCompletions while it generates (streamed requests only) and one
Completion, and the gateway sends the session's Trajectory on ``samples`` (or ``train``) as an agent
does. Every node sends Heartbeat (``hb``) and Event (``evt``) on the hub.

Channels (names as in areal_bus/config/topology.py CHANNEL_OWNERS; the owner binds, the others connect):
  hub_in   XSUB       all -> bus                 every hub message, topic in frame 0 (bus binds)
  hub_out  XPUB       bus -> all                 the same, filtered by topic at each SUB; ``ver`` and
                                                 ``run`` replayed to every new subscriber (bus binds)
  work     PUSH/PULL  agent -> rollout           generation requests (agent binds, one per replica)
  replies  PUSH/PULL  rollout -> agent           completions, to the agent that asked (agent binds)
  gwork    ROUTER/DEALER  gateway <-> rollout    requests out, partials and completions back
                                                 (gateway binds, one per replica)
  samples  PUSH/PULL  agent, gateway -> reward   finished episodes as trajectories (reward binds)
  train    PUSH/PULL  reward -> trainer          rewarded trajectories (trainer binds)
  weights  PUSH/PULL  trainer -> weights         a new policy version is ready (weights binds)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, NamedTuple

import numpy as np

# Hub topics. Short byte strings: SUB filters by prefix, and these never prefix one another.
TOPIC_HEARTBEAT = b"hb"
TOPIC_VERSION = b"ver"
TOPIC_VERSION_ACK = b"vack"
TOPIC_VERSION_COMMITTED = b"vcom"
TOPIC_TRAJ_ACK = b"ack"
TOPIC_EVENT = b"evt"
TOPIC_RUN = b"run"

# Topics whose last message the bus node replays to every new subscriber (late-joiner snapshot).
SNAPSHOT_TOPICS = (TOPIC_VERSION, TOPIC_RUN)

REGISTRY: dict[str, type] = {}


class IntRange(NamedTuple):
    """Bounds of an int field (``Annotated[int, IntRange(lo, hi)]``): the codec refuses a value
    outside them as malformed, as it refuses a value of the wrong type."""

    lo: int
    hi: int


Version = Annotated[int, IntRange(0, 2**31 - 1)]
"""A policy version. Every generated token carries one in an int32 array, so a version past int32
is malformed wherever it arrives (decode refuses it; it never reaches a node)."""
Ids = list[str]
"""Trajectory or request ids: nodes look them up in dicts, so each must be a string (checked at decode)."""


MAX_TOP_LOGPROBS = 20
"""The most alternatives per token a request may ask for (OpenAI's bound, and vLLM's default max_logprobs)."""

TOP_ARRAY_KINDS = {"top_ids": ("int32", 2), "top_logprobs": ("float32", 2)}
"""The dtype and rank the top-logprob arrays must have (a message's ``ARRAY_KINDS``; decode refuses
others): the gateway indexes them per token and per alternative and hands the ids to its tokenizer."""


def no_top_ids() -> np.ndarray:
    """``top_ids`` of a request that asked for no top logprobs."""
    return np.zeros((0, 0), np.int32)


def no_top_logprobs() -> np.ndarray:
    return np.zeros((0, 0), np.float32)


def message(tag: str):
    """Register a dataclass as a wire message under a short type tag."""

    def wrap(cls):
        if tag in REGISTRY:
            raise ValueError(f"duplicate message tag {tag!r}")
        cls.TAG = tag
        REGISTRY[tag] = cls
        return cls

    return wrap


# ---------------------------------------------------------------------------------------------
# Data path (PUSH/PULL)
# ---------------------------------------------------------------------------------------------


@message("gen")
@dataclass(slots=True)
class GenerateRequest:
    """agent -> rollout (channel ``work``). One episode's generation call.

    ``ticket`` is the sample's slot in consumption order (slots of samples dropped as stale are given
    back and reused): ticket // batch is the train step this sample is meant for, which is what rollout
    logs call their step. ``min_version``: the worker must serve
    at least this policy version before it starts (synchronous mode uses it to wait for new weights).
    """

    TAG: ClassVar[str]
    ARRAYS: ClassVar[tuple[str, ...]] = ("prompt_ids",)
    request_id: str
    episode_id: str
    ticket: int
    min_version: Version
    max_tokens: int
    temperature: float
    prompt_ids: np.ndarray
    reply_to: int = 0
    group_id: str = ""
    top_p: float = 1.0
    stop: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    stream: bool = False
    """Send PartialCompletions while it runs (gateway streams only; agents wait for the whole)."""
    ignore_eos: bool = False
    """Generate through the model's eos token(s): only ``stop`` ids and ``max_tokens`` end the request
    (the longtail workload: every output is exactly max_tokens real generated tokens)."""
    grammar: str = ""
    """xgrammar EBNF (what ``str(xgrammar.Grammar)`` prints) every output must follow; "" = unconstrained.
    The gateway builds it (from a JSON schema or a tool's parameters) and checks it; the worker compiles
    it for its own tokenizer (cached by the text) and masks each step's logits with it. The request ends
    with finish_reason "stop" when the grammar is complete and a stop token was sampled."""
    top_logprobs: Annotated[int, IntRange(0, MAX_TOP_LOGPROBS)] = 0
    """The k most likely tokens of the distribution each token was sampled from, per output token
    (Completion.top_ids / top_logprobs); 0: none."""
    seed: Annotated[int, IntRange(-1, 2**63 - 1)] = -1
    """-1: the worker's own generator. Else a generator of this request's own, seeded with it: the
    same seed and inputs give the same tokens on the same engine, whatever else runs beside them."""
    top_k: Annotated[int, IntRange(0, 2**31 - 1)] = 0
    """0: off. Else sample among the k most likely tokens (after the grammar's mask)."""


@message("comp")
@dataclass(slots=True)
class Completion:
    """rollout -> agent (channel ``replies``, to agent replica ``reply_to`` of the request). The exact
    token ids sampled, each with its log-probability and the policy version that produced it."""

    TAG: ClassVar[str]
    ARRAYS: ClassVar[tuple[str, ...]] = ("output_ids", "logprobs", "versions", "top_ids", "top_logprobs")
    ARRAY_KINDS: ClassVar[dict[str, tuple[str, int]]] = TOP_ARRAY_KINDS
    request_id: str
    episode_id: str
    ticket: int
    worker: str
    output_ids: np.ndarray
    logprobs: np.ndarray
    """Per token, the behaviour log-probability: log p(token) under the distribution it was actually
    sampled from (temperature, the grammar's mask and top_k applied and renormalised; see the engine's
    docstring for top_p)."""
    versions: np.ndarray
    finish_reason: str = "length"
    gen_seconds: float = 0.0
    error: str = ""
    """Non-empty when the worker refused the request (why: a prompt longer than its cache, ...); no tokens."""
    top_ids: np.ndarray = field(default_factory=no_top_ids)
    """int32 [tokens, k] with k the request's ``top_logprobs``: the k most likely ids of each token's
    distribution, most likely first ([0, 0] when the request asked for none)."""
    top_logprobs: np.ndarray = field(default_factory=no_top_logprobs)
    """float32 [tokens, k]: their log-probabilities under that distribution, descending (-inf for a
    token the grammar's mask or top_k left out)."""


@message("part")
@dataclass(slots=True)
class PartialCompletion:
    """rollout -> gateway (channel ``gwork``), only for a request with ``stream`` set: the tokens it has
    sampled since the last one, while it runs, so the gateway can stream text as it is made. Best
    effort: one may be dropped (a full queue) and the Completion that ends the request carries every
    token anyway. ``start`` is the index of ``output_ids[0]`` in the request's output."""

    TAG: ClassVar[str]
    ARRAYS: ClassVar[tuple[str, ...]] = ("output_ids", "top_ids", "top_logprobs")
    ARRAY_KINDS: ClassVar[dict[str, tuple[str, int]]] = TOP_ARRAY_KINDS
    request_id: str
    start: Annotated[int, IntRange(0, 2**31 - 1)]
    output_ids: np.ndarray
    top_ids: np.ndarray = field(default_factory=no_top_ids)
    """As Completion's, for these tokens."""
    top_logprobs: np.ndarray = field(default_factory=no_top_logprobs)


@message("traj")
@dataclass(slots=True)
class Trajectory:
    """agent -> reward (``samples``) and reward -> trainer (``train``). One finished episode.

    ``traj_id`` is unique per episode: the trainer consumes each id once. ``output_ids`` is everything
    after the first prompt: the policy's sampled tokens and, between turns, the environment's reply
    tokens. Arrays are aligned: policy token ``output_ids[i]`` was sampled with log-probability
    ``logprobs[i]`` by policy version ``versions[i]`` and has ``loss_mask[i] = 1``; environment tokens
    have loss_mask 0, logprob 0 and version -1. ``reward`` is None until the reward node (or the
    agent) sets it.
    """

    TAG: ClassVar[str]
    ARRAYS: ClassVar[tuple[str, ...]] = ("prompt_ids", "output_ids", "logprobs", "versions", "loss_mask")
    traj_id: str
    episode_id: str
    ticket: int
    worker: str
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    loss_mask: np.ndarray
    reward: float | None = None
    group_id: str = ""
    finish_reason: str = "length"
    gen_seconds: float = 0.0
    meta: dict = field(default_factory=dict)
    source: str = ""  # the episode source (agent or gateway incarnation) whose admission slot this is

    @property
    def start_version(self) -> int:
        """The oldest policy version that produced any token: staleness is measured from here."""
        policy = self.versions[self.versions >= 0]
        return int(policy.min()) if policy.size else 0

    @property
    def end_version(self) -> int:
        """The newest policy version that produced any token (a long output's weights change under it):
        with ``staleness.per_token`` a sample is over the bound only when this one is."""
        policy = self.versions[self.versions >= 0]
        return int(policy.max()) if policy.size else 0

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_ids.size + self.output_ids.size)


@message("wready")
@dataclass(slots=True)
class WeightsReady:
    """trainer -> weights (channel ``weights``). The trainer finished update ``version``; its weights
    are at ``location`` (a shared-memory name, a path, or "" for simulated engines).

    ``lineage`` names the trainer process that made them; lineages sort by start time. A restarted
    trainer resumes from its checkpoint, so its versions may be lower than the last ones announced:
    (lineage, version) is what only ever goes up."""

    TAG: ClassVar[str]
    version: Version
    location: str
    nbytes: int
    lineage: str = ""


# ---------------------------------------------------------------------------------------------
# Hub (PUB -> bus -> SUB)
# ---------------------------------------------------------------------------------------------


@message("hb")
@dataclass(slots=True)
class Heartbeat:
    """every node -> all (topic ``hb``), every HEARTBEAT_INTERVAL_S, from a thread of its own so that
    a long compute step never silences it. Carries the node's metrics for the probe.

    ``incarnation`` changes every time the process starts: peers use it to notice a restart (and
    producers then resend what that consumer never acknowledged). ``inflight``: request ids a rollout
    worker is generating, so the agent can reissue them if the worker dies.
    """

    TAG: ClassVar[str]
    node_id: str
    kind: str
    incarnation: str
    pid: int
    t: float
    version: Version
    counters: dict[str, float]
    gauges: dict[str, float]
    hists: dict[str, dict[str, float]]
    inflight: Ids = field(default_factory=list)


@message("ver")
@dataclass(slots=True)
class VersionAnnounce:
    """weights -> all (topic ``ver``, snapshot-cached by the bus). Policy ``version`` is available at
    ``location``; rollout workers switch at their next safe point and answer with VersionAck."""

    TAG: ClassVar[str]
    version: Version
    location: str
    nbytes: int
    published_at: float
    lineage: str = ""  # as in WeightsReady: a worker switches when (lineage, version) goes up


@message("vack")
@dataclass(slots=True)
class VersionAck:
    """rollout -> weights (topic ``vack``). ``node_id`` now serves ``version`` and has left every
    older buffer, which the broadcaster may then reuse."""

    TAG: ClassVar[str]
    node_id: str
    version: Version
    switch_seconds: float = 0.0
    lineage: str = ""


@message("vcom")
@dataclass(slots=True)
class VersionCommitted:
    """weights -> trainer (topic ``vcom``). Every live rollout worker serves ``version``: the buffers
    of older versions may be overwritten."""

    TAG: ClassVar[str]
    version: Version
    lineage: str = ""


@message("ack")
@dataclass(slots=True)
class TrajAck:
    """trainer -> producers and agents (topic ``ack``). Ids the trainer has taken for good: trained
    on (``consumed``), dropped as over-stale (``stale``), already seen (``duplicate``), or, with a
    durable spool, committed to it (``accepted``: a restarted trainer re-queues it), or refused as
    unfit for the model or quarantined after its update failed (``rejected``: never trained; the
    trainer counts it in its source's stale total, so its admission slot comes back). Producers
    forget these. Admission counts come from RunState.sources, which a lost ack cannot skew."""

    TAG: ClassVar[str]
    trainer_version: Version
    consumed: Ids
    stale: Ids
    duplicate: Ids
    accepted: Ids = field(default_factory=list)
    rejected: Ids = field(default_factory=list)


@message("evt")
@dataclass(slots=True)
class Event:
    """any node -> all (topic ``evt``). Something a person should see: a dead or restarted peer,
    sustained backpressure, the run finishing. ``fields`` is free-form and logged as is."""

    TAG: ClassVar[str]
    name: str
    node_id: str
    fields: dict = field(default_factory=dict)


@message("run")
@dataclass(slots=True)
class RunState:
    """trainer -> all (topic ``run``, snapshot-cached by the bus). Where training stands.

    Published after every update and stale drop and repeated every heartbeat interval, so a lost one
    heals. ``sources`` maps each episode source (Trajectory.source) to its running totals
    ``[consumed, stale]`` in this trainer ``incarnation``: admission is computed from these totals,
    never from individual acks (PUB/SUB may lose a message; a total repeated is idempotent). With a
    durable spool ``incarnation`` is the run's epoch, kept across trainer restarts: a restarted trainer
    restores the totals of its checkpoint and re-trains the spool, so the totals catch up exactly and
    agents count on; without one each trainer process is an epoch of its own (agents rebase)."""

    TAG: ClassVar[str]
    version: Version
    max_steps: int
    finished: bool
    consumed: int
    incarnation: str = ""
    sources: dict = field(default_factory=dict)
    lineage: str = ""  # the lineage of ``version`` (areal_bus.version.PolicyVersion)
    ready: int = 0  # samples accepted and waiting to be trained (staleness.lead: adaptive reads it)
