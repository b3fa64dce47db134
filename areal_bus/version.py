"""The policy version in its one form: (lineage, version).

A trainer process names its weights with a lineage (its start time and incarnation, so lineages
sort by start time) and numbers them with a version. A restarted trainer resumes from its
checkpoint as a new lineage, so the version number alone can go down while (lineage, version)
only ever goes up. Every node that compares versions (rollout, weights, trainer, shell, agent,
gateway, admission) compares ``PolicyVersion``s, never bare ints.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_bus.constants import LINEAGE_WAIT_S, VERSION_AHEAD_MAX


@dataclass(frozen=True, order=True, slots=True)
class PolicyVersion:
    lineage: str = ""  # "" before any trainer has announced one: older than every real lineage
    version: int = 0

    @classmethod
    def of(cls, msg) -> PolicyVersion:
        """The version a message carries (any message with ``lineage`` and ``version`` fields)."""
        return cls(msg.lineage, msg.version)

    def __str__(self) -> str:
        return f"{self.version}@{self.lineage or '-'}"


NONE = PolicyVersion("", -1)
"""Below every version: what a node serves before it has loaded any."""


WEIGHTS_KIND = "weights"
"""The node kind that owns announcements: the broadcaster, told each version by the trainer."""


class VersionTrust:
    """Which VersionAnnounce a node may follow, judged against the trainer's own RunState. Pure: the
    producer (the envelope's) and the time are passed in, so tests drive it directly.

    An announcement is followed only if (1) its producer is a weights node (where CURVE is on only
    holders of the cluster key reach the hub at all, but any of them could publish one), (2) its
    lineage is the one the trainer's newest RunState names, compared as an identity: a lineage that
    merely compares higher as a string is nobody's, and (3) its version is at most VERSION_AHEAD_MAX
    ahead of that RunState's. One of a lineage no RunState has named yet (a node starting before the
    first RunState reaches it; a restarted trainer's start weights, exported just before its first
    RunState) is held, and released the moment a RunState names its lineage; refused if none does
    within LINEAGE_WAIT_S. One of a lineage an earlier RunState named is superseded (the broadcaster
    repeats the old lineage until the restarted trainer's first export reaches it): dropped, not an
    error. The broadcaster repeats its announcement every heartbeat, so a good one refused in a race
    heals at the next repeat.
    """

    HELD_MAX = 4
    """Lineages held at once, waiting for a RunState; one more is refused at once (a flood of them is
    nobody's: a restart makes one new lineage)."""

    def __init__(self, ahead_max: int | None = None, wait_s: float | None = None):
        self.ahead_max = VERSION_AHEAD_MAX if ahead_max is None else ahead_max
        self.wait_s = LINEAGE_WAIT_S if wait_s is None else wait_s
        self.lineage = ""  # the lineage the trainer's newest RunState names ("": none yet)
        self.version = 0  # and that RunState's version
        self.past: set[str] = set()  # lineages earlier RunStates named
        self.held: dict[str, tuple] = {}  # lineage no RunState named yet -> (newest announcement, carry, since)

    def judge(self, msg, producer: str, now: float, carry=None) -> str:
        """"" to follow ``msg`` now; "held" (``carry`` is kept and handed back by ``on_run_state`` once
        a RunState names its lineage); "superseded" (an old lineage's: drop it quietly); else the reason
        it is refused."""
        if producer.rpartition("-")[0] != WEIGHTS_KIND:
            return "not_weights_node"
        if msg.lineage in self.past:
            return "superseded"
        if msg.lineage != self.lineage or not self.lineage:
            if msg.lineage not in self.held and len(self.held) >= self.HELD_MAX:
                return "unknown_lineage"
            since = self.held[msg.lineage][2] if msg.lineage in self.held else now
            self.held[msg.lineage] = (msg, carry, since)
            return "held"
        return self._ahead(msg)

    def on_run_state(self, state, now: float) -> tuple[list, list[str]]:
        """A RunState from the trainer: (the ``carry`` of the held announcement its lineage releases, if
        not too far ahead; (reason, announcement) of each held one refused now)."""
        if state.lineage and state.lineage != self.lineage:  # "": a finished run's last word names none
            if self.lineage:
                self.past.add(self.lineage)
            self.lineage = state.lineage
        if state.lineage == self.lineage:
            self.version = state.version
        released, refused = [], []
        for lineage, (msg, carry, since) in list(self.held.items()):
            if lineage == self.lineage:
                del self.held[lineage]
                why = self._ahead(msg)
                if why:
                    refused.append((why, msg))
                else:
                    released.append(carry)
            elif lineage in self.past:
                del self.held[lineage]
            elif now - since >= self.wait_s:  # no RunState named it in time: nobody's
                del self.held[lineage]
                refused.append(("unknown_lineage", msg))
        return released, refused

    def _ahead(self, msg) -> str:
        return "ahead" if msg.version > self.version + self.ahead_max else ""
