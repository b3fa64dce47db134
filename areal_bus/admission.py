"""The two staleness rules, as pure functions and one small state holder.

Admission (AReaL's capacity rule): an episode may start only if it could be consumed within
``staleness`` policy versions. With ``batch`` samples consumed per version, by the time the trainer
reaches version ``v + staleness + 1`` it has consumed ``(v + staleness + 1) * batch`` samples, so at
version ``v`` no more than that many may have been admitted in total:

    capacity = (staleness + v + 1) * batch - (accepted + running)

Here ``accepted + running`` is every admitted episode not returned (dropped as stale at the trainer,
which gives its slot back), and ``batch`` is global_batch_size, what one update consumes when data is
plentiful (AReaL's consumer batch size). Synchronous mode is staleness 0: exactly one batch is
admitted per version.

The rule bounds staleness exactly only if samples finish in admission order; with long-tailed output
lengths a long sample can be overtaken by later short ones and reach the trainer later than its slot.
That is what the consumption check is for.

A second, tighter bound keeps the trainer's queue short: an episode source holds new admissions while
the episodes it has finished but the trainer has not yet consumed (``in_data_path``) already fill two
updates (the one training now and the next). Past that, more finished samples only wait in the
queue and grow old; holding them back costs no throughput while the trainer has its next batch, and
keeps waiting time (and staleness drops of long samples) low when the trainer is the bottleneck.

Consumption: a trajectory whose oldest token was generated more than ``staleness`` versions before
the trainer's current version is dropped and counted, never trained on.
"""

from __future__ import annotations


def capacity(version: int, staleness: int, batch: int, admitted: int) -> int:
    """New episodes that may start now. Never negative."""
    return max(0, (staleness + version + 1) * batch - admitted)


def staleness_of(trainer_version: int, start_version: int) -> int:
    return trainer_version - start_version


def is_over_stale(trainer_version: int, start_version: int, staleness: int) -> bool:
    return staleness_of(trainer_version, start_version) > staleness


class Admission:
    """Admission state of one episode source. With several sources (agent replicas) each takes an
    equal share of the batch, so together they never exceed the rule."""

    def __init__(self, staleness: int, batch: int, sources: int = 1, source_index: int = 0):
        if batch < 1 or sources < 1 or not 0 <= source_index < sources:
            raise ValueError("batch and sources must be >= 1 and source_index in range")
        self.staleness = staleness
        # Integer shares that add up to batch exactly: the first (batch % sources) sources take one more.
        self.batch_share = batch // sources + (1 if source_index < batch % sources else 0)
        self.admitted = 0  # accepted + running, as in the rule
        self.returned = 0

    def capacity(self, version: int, in_data_path: int = 0) -> int:
        ready_room = 2 * self.batch_share - in_data_path
        return max(0, min(capacity(version, self.staleness, self.batch_share, self.admitted), ready_room))

    def admit(self, n: int = 1) -> None:
        self.admitted += n

    def give_back(self, n: int = 1) -> None:
        """Slots of episodes that will never be trained on (dropped as stale) return to the pool."""
        self.admitted -= n
        self.returned += n
