"""The two staleness rules, as pure functions and one small state holder; who shares the rule's batch
(``Sources``); and which settings of it whole GRPO groups could never satisfy (``group_stall``).

Admission (AReaL's capacity rule): an episode may start only if it could be consumed within
``staleness`` policy versions. With ``batch`` samples consumed per version, by the time the trainer
reaches version ``v + staleness + 1`` it has consumed ``(v + staleness + 1) * batch`` samples, so at
version ``v`` no more than that many may have been admitted in total:

    capacity = (staleness + v + 1) * batch - (accepted + running)

Here ``accepted + running`` is every admitted episode not returned (dropped as stale at the trainer,
which gives its slot back). Synchronous mode is staleness 0 with batch = global_batch_size: exactly
one batch per version.

Our trainer takes between trigger_batch_size and global_batch_size samples per update, depending on
what is ready, so "batch" is not a constant. Written in terms of what has been consumed, the rule is

    capacity = consumed + (staleness + 1) * batch - (accepted + running)

which is AReaL's exactly when every update consumes ``batch``. With several episode sources (agents,
gateways) each counts its own consumed and admitted episodes and takes its share of the in-flight
allowance ``(staleness + 1) * batch``: a source is never held back by what others did or did not send. ``Admission`` uses this form with
``batch`` measured: the samples per update over the last few updates, clamped to [trigger, global].
A trainer that is the bottleneck takes full batches and gets a pipeline deep enough to stay busy; a
trainer that outpaces rollout takes small ones, versions advance faster, and admission tightens so a
sample still reaches the trainer within ``staleness`` versions. Until the trainer has reported,
``batch`` is global_batch_size, AReaL's consumer batch size (starting from the small end would be
self-fulfilling: a shallow pipeline only ever fills small batches).

The rule bounds staleness exactly only if samples finish in admission order; with long-tailed output
lengths a long sample can be overtaken by later short ones and reach the trainer later than its slot.
That is what the consumption check is for.

Tickets: ``admit`` hands each episode the update it is admitted for, as a ticket in units of
``1 / min_batch`` of an update (``ticket // trigger_batch_size`` is that update, which is what
``[rollout] step`` logs). The update is the trainer's last reported version plus the updates' worth
of this source's episodes already in flight ahead of it (its in-flight allowance, the rule's
``(staleness + 1) * batch`` share, spread over staleness + 1 updates). The rule keeps that at most
``v + staleness``; ``[train] step`` names the update just done (``v - 1``), so rollout runs at most
``staleness + 1`` ahead, whatever batch the trainer takes. A dense slot divided by a fixed batch
would not: when the trainer takes more than trigger_batch_size per update, slots run ahead of
updates without bound. With every update taking trigger_batch_size, the ticket is the dense slot.

Lead (``staleness.lead: adaptive``): the rule lets rollout run ``staleness`` versions ahead whether or
not that buys anything. Where the trainer is the bottleneck it does not: samples wait in its queue, and
every one is trained ``staleness`` versions old (bench/RESULTS.md: on the CPU default, staleness 2
trained 98% of its samples at lag 2 and staleness 1 made as many samples per second, all at lag 1). With
an adaptive lead the rule uses ``lead`` in place of ``staleness`` (admission and tickets; the trainer's
drop still checks the configured bound). ``lead`` starts at the bound and moves by one after each
update the trainer reports, from the samples waiting in its queue then (RunState.ready): two batches or
more after ``LEAD_DOWN_AFTER`` updates in a row, a whole update more than the next one needs, steps down
(never below 1: rollout keeps overlapping training); fewer than ``trigger_batch_size``, the trainer is
about to wait, steps up at once (never above the bound). Every source reads the same reports, so their
leads move together (a lost report can leave one a step apart until the next change).

Versions: the trainer's progress is ordered by ``PolicyVersion`` (lineage, version), as everywhere.
A restarted trainer resumes from its checkpoint as a new lineage whose version numbers may be lower
than the last ones reported; ``observe`` takes its reports as newer and measures the batch from its
own start (numbers of two lineages do not subtract). The rule itself and the staleness of a sample
take plain version numbers: there a version is a count of updates (the number a checkpoint resumes
at is the updates it holds), and a sample's versions are the int32 numbers its tokens carry.
"""

from __future__ import annotations

from areal_bus.wire import messages as m
from areal_bus.constants import SOURCE_GONE_S
from areal_bus.version import PolicyVersion


def capacity(version: int, staleness: int, batch: int, admitted: int) -> int:
    """New episodes that may start now. Never negative."""
    return max(0, (staleness + version + 1) * batch - admitted)


def staleness_of(trainer_version: int, start_version: int) -> int:
    return trainer_version - start_version


def is_over_stale(trainer_version: int, start_version: int, staleness: int) -> bool:
    return staleness_of(trainer_version, start_version) > staleness


LEAD_DOWN_AFTER = 3
"""Updates in a row that must find two batches waiting at the trainer before an adaptive lead steps
down: with long-tailed outputs samples arrive in bursts, and one full queue is no proof that a
shallower pipeline would keep the trainer fed (stepping down on every one, the simulated long tail of
bench/async_vs_sync.py flapped between leads: the trainer idle 7% instead of 0.1%, twice the drops).
A step up takes one update that found less than a trigger's worth: a trainer about to wait."""

BATCH_WINDOW = 4
"""Updates over which the trainer's batch size is averaged: long enough to smooth one odd update,
short enough to follow a change of bottleneck within a few seconds."""


class Admission:
    """Admission state of one episode source. With several sources (agent replicas) each takes an
    equal share of the batch, so together they never exceed the rule."""

    def __init__(self, staleness: int, batch: int, sources: int = 1, source_index: int = 0,
                 max_batch: int | None = None, adaptive: bool = False):
        if batch < 1 or sources < 1 or not 0 <= source_index < sources:
            raise ValueError("batch and sources must be >= 1 and source_index in range")
        self.staleness = staleness
        self.adaptive = adaptive and staleness > 1  # a lead of 1 is as low as it goes
        self.lead = staleness  # versions ahead admission allows: the bound, or less when adaptive
        self._surplus = 0  # updates in a row that found two batches waiting
        self.sources = sources
        self.source_index = source_index
        self.min_batch = batch
        self.max_batch = max(batch, max_batch or batch)
        self.batch_share = self._share(batch)
        self.admitted = 0  # accepted + running, as in the rule
        self.returned = 0
        self.consumed = 0  # this source's episodes the trainer has trained on
        self.history: list[tuple[PolicyVersion, int]] = []  # (version, consumed) as one trainer lineage reported them
        self._epoch: str | None = None  # the trainer incarnation whose totals we follow
        self._base = (0, 0)  # (consumed, returned) when that incarnation started counting

    def _share(self, n: float) -> int:
        # Integer shares that add up to n exactly: the first (n % sources) sources take one more.
        n = int(n)
        return n // self.sources + (1 if self.source_index < n % self.sources else 0)

    def observe(self, policy: PolicyVersion, consumed: int, ready: int | None = None) -> None:
        """The trainer's progress: ``consumed`` samples trained on by the time it reached ``policy``,
        ``ready`` samples waiting in its queue then (None: not reported). A report older than the last
        is ignored (a late or replayed one); a newer lineage (a restarted trainer) starts the
        measurement over. With an adaptive lead, a newer version's ``ready`` moves the lead."""
        if self.history:
            last = self.history[-1][0]
            if policy <= last:
                return
            if policy.lineage != last.lineage:
                self.history = []
        self.history = [*self.history, (policy, consumed)][-(BATCH_WINDOW + 1):]
        if self.adaptive and ready is not None and len(self.history) >= 2:
            self._surplus = self._surplus + 1 if ready >= 2 * self.batch else 0
            if self._surplus >= LEAD_DOWN_AFTER:
                self.lead, self._surplus = max(1, self.lead - 1), 0
            elif ready < self.min_batch:
                self.lead = min(self.staleness, self.lead + 1)

    @property
    def batch(self) -> int:
        """Samples per update: measured over the last updates, clamped to [trigger, global]."""
        if len(self.history) < 2:
            return self.max_batch
        (v0, c0), (v1, c1) = self.history[0], self.history[-1]
        return int(min(self.max_batch, max(self.min_batch, round((c1 - c0) / (v1.version - v0.version)))))

    def capacity(self, version: int) -> int:
        """Episodes that may start now, the trainer having made ``version`` updates (a count: see the
        module docstring for why a plain number is right here)."""
        by_version = capacity(version, self.lead, self._share(self.max_batch), self.admitted)
        if not self.history:
            return by_version
        by_consumption = self.consumed + self._share((self.lead + 1) * self.batch) - self.admitted
        if self.sources == 1 or self.staleness == 0:
            # AReaL's form at the largest batch is never exceeded either: it keeps synchronous mode
            # from starting a batch before the version that trains it, and a lone source from
            # settling into a pipeline too shallow to ever fill a full batch. With several sources
            # it is left out: a source's share of versions would cap it even when it alone is busy.
            return max(0, min(by_version, by_consumption))
        return max(0, by_consumption)

    def follow(self, state, source: str) -> None:
        """Take in a RunState: the trainer's progress and this source's totals (a malformed entry
        is ignored; the next report, half a second later, carries the same totals)."""
        self.observe(PolicyVersion.of(state), state.consumed, getattr(state, "ready", None))
        entry = state.sources.get(source) if isinstance(state.sources, dict) else None
        if isinstance(entry, list | tuple) and len(entry) == 2 and all(type(x) is int and x >= 0 for x in entry):
            self.sync(state.incarnation, entry[0], entry[1])

    def sync(self, epoch: str, consumed: int, stale: int) -> None:
        """The trainer's running totals for this source (RunState.sources): trained on, dropped as
        stale. Totals, not deltas, so a lost or repeated report changes nothing. A restarted trainer
        (new ``epoch``) counts from zero again: its totals add to what the last one reported."""
        if epoch != self._epoch:
            self._epoch = epoch
            self._base = (self.consumed, self.returned)
        consumed += self._base[0]
        returned = stale + self._base[1]
        if consumed > self.consumed:
            self.consume(consumed - self.consumed)
        if returned > self.returned:
            self.give_back(returned - self.returned)

    def consume(self, n: int = 1) -> None:
        """The trainer trained on ``n`` of this source's episodes."""
        self.consumed += n

    def ticket(self) -> int:
        """The next episode's ticket: the update it would be admitted for, in units of
        ``1 / min_batch`` of an update (so ``ticket // min_batch`` is the update; see the module
        docstring). Ordered like admission within one trainer lineage; not unique."""
        if not self.history:  # AReaL's form alone: this source's share of global_batch_size per update
            return self.admitted * self.min_batch // max(1, self._share(self.max_batch))
        # The consumption form lets this source hold fewer than ``allowed`` in flight over staleness + 1
        # updates: each allowed / (staleness + 1) of them ahead of it is one more update to wait for.
        allowed = max(1, self._share((self.lead + 1) * self.batch))
        ahead = max(0, self.admitted - self.consumed) * (self.lead + 1)
        return self.history[-1][0].version * self.min_batch + ahead * self.min_batch // allowed

    def admit(self, n: int = 1) -> int:
        """Count ``n`` episodes as admitted; the first one's ticket."""
        ticket = self.ticket()
        self.admitted += n
        return ticket

    def abandon(self, n: int = 1) -> None:
        """Slots of episodes this source gave up before the trainer saw them (a rollout worker refused
        a turn): free again. Not ``give_back``, whose count follows the trainer's stale totals."""
        self.admitted -= n

    def give_back(self, n: int = 1) -> None:
        """Slots of episodes that will never be trained on (dropped as stale) return to the pool."""
        self.admitted -= n
        self.returned += n

    def reshare(self, sources: int, source_index: int) -> None:
        """Another count of sources shares the batch from now on (one was scaled up or down while the
        run goes on: ``Sources``). What this source has admitted and had consumed stays its own."""
        if sources < 1 or not 0 <= source_index < sources:
            raise ValueError("sources must be >= 1 and source_index in range")
        self.sources, self.source_index = sources, source_index
        self.batch_share = self._share(self.min_batch)

    @classmethod
    def of(cls, topo, source: str) -> Admission:
        """The admission state of ``source`` (an agent's or gateway's name, e.g. ``agent-0``) in ``topo``:
        all its sources share the rule's batch."""
        sources = topo.admission_sources()
        return cls(topo.effective_staleness, topo.effective_trigger, len(sources), sources.index(source),
                   max_batch=topo.global_batch_size, adaptive=topo.staleness.lead == "adaptive")


class Sources:
    """The episode sources that share the rule's batch, as one of them (``me``) sees them while the run
    goes on, in ``Topology.admission_sources``'s order (agents, then gateways, by replica). At start the
    topology's; then a source whose heartbeat comes that is not among them joins (the topology was scaled
    up and ``supervisorctl update`` started it: it read the new topology, the running ones did not), and
    one that says on the hub that it leaves goes (scaled down: update stops it with SIGTERM). A source
    that dies without a word keeps its share for ``SOURCE_GONE_S``: supervisord restarts it, and its share
    handed to the others meanwhile would overshoot the rule when it came back; dead longer, it is gone
    (removed while dead, or given up by supervisord) until a heartbeat of it comes again. Pure (time is
    passed in): nodes/agent and nodes/gateway feed it their hub's heartbeats, deaths and leaving notices."""

    def __init__(self, topo, me: str):
        self.kinds = ("agent", "gateway") if topo.agent.via == "bus" else ("gateway",)
        self.names = list(topo.admission_sources())
        self.me = me
        self.dead: dict[str, float] = {}  # source -> when its death was noticed

    def _key(self, name: str) -> tuple[int, int]:
        kind, _, replica = name.rpartition("-")
        return self.kinds.index(kind), int(replica)

    def joined(self, node_id: str, kind: str) -> bool:
        """A source's heartbeat: True if it is new to the set."""
        if kind not in self.kinds or node_id in self.names or not node_id.startswith(kind + "-") \
                or not node_id.rpartition("-")[2].isdigit():
            return False
        self.names = sorted([*self.names, node_id], key=self._key)
        return True

    def left(self, node_id: str) -> bool:
        """A source said it leaves: True if it was in the set."""
        if node_id == self.me or node_id not in self.names:
            return False
        self.names.remove(node_id)
        return True

    def hear(self, msg, admission: Admission, now: float) -> bool:
        """A message of ``NodeShell.drain_hub`` at ``now`` (monotonic): a source's heartbeat, its
        ``peer_left`` notice or ``peer_dead`` (the node must watch the source kinds) changes the set and
        ``admission``'s share with it, as does a death older than ``SOURCE_GONE_S``. True if so."""
        changed = False
        if isinstance(msg, m.Heartbeat):
            self.dead.pop(msg.node_id, None)
            changed = self.joined(msg.node_id, msg.kind)
        elif isinstance(msg, m.Event) and msg.name == "peer_left":
            changed = self.left(msg.node_id)
        elif isinstance(msg, m.Event) and msg.name == "peer_dead" and msg.node_id in self.names:
            self.dead.setdefault(msg.node_id, now)
        for name in [n for n, t in self.dead.items() if now - t > SOURCE_GONE_S]:
            del self.dead[name]
            changed = self.left(name) or changed
        if changed:
            admission.reshare(len(self.names), self.names.index(self.me))
        return changed


def group_stall(topo) -> str | None:
    """Why ``topo``'s episode sources could stop the run for good, or None. A bus agent admits a GRPO
    group (agent.group_size episodes) whole or not at all, so of its share of the rule's allowance it
    uses only whole groups (a gateway admits session by session and uses all of its share). Where the
    whole groups cannot add up to what the trainer waits for, rollout waits for an update that waits
    for rollout, and nothing says so:

    - before the first update (AReaL's form: staleness + 1 shares of global_batch_size each); in
      synchronous mode this is every update: exactly global_batch_size samples, each source's share,
      so an agent whose share is no multiple of the group leaves every batch short;
    - asynchronous, when the trainer has been taking trigger_batch_size samples per update: the
      allowance is then (lead + 1) x trigger_batch_size. The lead is staleness_threshold, or with
      ``staleness.lead: adaptive`` 2 at the least (the bound if lower): a lead steps down only while the
      trainer holds spare batches and back up after any update that leaves it less than a trigger, so
      a run that stalls had its last update raise it from 1.

    tests/test_admission.py plays the rule's sources against a trainer over thousands of settings: every
    stalled one is refused here, and with a fixed lead nothing else is."""
    group = topo.agent.group_size
    sources = topo.admission_sources()
    agents = [s for s in sources if s.startswith("agent-")]
    if group == 1 or not agents:
        return None
    states = {s: Admission.of(topo, s) for s in sources}
    usable = lambda s, n: n - n % group if s in agents else n  # noqa: E731 (an agent starts whole groups)
    trigger = topo.effective_trigger
    start = sum(usable(s, (a.staleness + 1) * a._share(a.max_batch)) for s, a in states.items())
    if start < trigger and not topo.is_async:
        shares = {s: a._share(a.max_batch) for s, a in states.items()}
        step = len(sources) * group
        return (f"a synchronous update takes exactly global_batch_size ({trigger}) samples, which "
                f"{len(sources)} episode sources share as {sorted(set(shares.values()), reverse=True)}; an agent "
                f"admits whole groups of agent.group_size ({group}), so "
                f"{', '.join(s for s in agents if shares[s] % group)} can never fill a share and the run would "
                f"wait for ever: make global_batch_size a multiple of {len(sources)} x {group} (e.g. "
                f"{-(-trigger // step) * step}), or change the agent replicas or agent.group_size")
    if start < trigger:
        return (f"before the first update the staleness rule lets {len(sources)} episode sources start {start} "
                f"samples in whole groups of agent.group_size ({group}), fewer than the trigger_batch_size "
                f"({trigger}) it waits for: the run would never train; raise global_batch_size, or run fewer "
                f"agent replicas or a smaller agent.group_size")

    def steady(trigger: int) -> int:
        lead = lambda a: min(2, a.staleness) if a.adaptive else a.staleness  # noqa: E731
        return sum(usable(s, a._share((lead(a) + 1) * trigger)) for s, a in states.items())

    if steady(trigger) >= trigger:
        return None
    enough = next((t for t in range(trigger, topo.global_batch_size + 1) if steady(t) >= t), None)
    fix = (f"raise trigger_batch_size (e.g. to {enough}), or " if enough else "") + \
        "run fewer agent replicas or a smaller agent.group_size"
    return (f"when the trainer takes trigger_batch_size ({trigger}) samples per update, the staleness rule lets "
            f"{len(sources)} episode sources keep {steady(trigger)} samples in flight in whole groups of "
            f"agent.group_size ({group}), fewer than the {trigger} an update waits for: the run would stall "
            f"(rollout waiting for an update that waits for rollout); {fix}")
