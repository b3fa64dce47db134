"""The policy version in its one form: (lineage, version).

A trainer process names its weights with a lineage (its start time and incarnation, so lineages
sort by start time) and numbers them with a version. A restarted trainer resumes from its
checkpoint as a new lineage, so the version number alone can go down while (lineage, version)
only ever goes up. Every node that compares versions (rollout, weights, trainer, shell, agent,
gateway, admission) compares ``PolicyVersion``s, never bare ints.
"""

from __future__ import annotations

from dataclasses import dataclass


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
