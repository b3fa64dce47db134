"""The trainer's consumption side, without sockets: it suppresses duplicates by trajectory id,
bounds the buffer at queue_max_size, drops anything over the staleness bound (with
``staleness.drop_at_consume``, the default), and forms batches oldest-first once trigger_batch_size
samples are ready (exactly global_batch_size in synchronous mode).

The staleness bound, in the two senses ``staleness.drop_at_consume`` chooses between: true, no sample
is trained whose oldest token is more than staleness_threshold versions behind the weights it updates
(it is dropped when its batch forms; with ``staleness.per_token``, no token: a sample goes only when
its newest token is over, and the engine masks its tokens that are); false, the bound is AReaL's admission rule alone (no episode
starts unless it could be consumed within staleness_threshold versions), every admitted sample is
trained, and those trained over the threshold are counted per update (``over_bound`` in
train_steps.jsonl, the ``trained_over_bound`` metric) beside the batch's staleness histogram.
A GRPO group's members that left the queue before the rest still count in the rest's advantage
baseline (their rewards go with each later batch of the group as ``Job.baseline``): one dropped as
over-stale (the drop takes the slow answers, and the survivors judged among themselves would be
compared with the fast ones only), and one trained in an earlier batch, where the queue's overflow took a
group in part (on a long tail the short answers come first: the late part judged among itself alone
would never learn that it came out worse than the early one).
"""

from __future__ import annotations

import collections
import time

from areal_bus.wire import messages as m
from areal_bus.admission import is_over_stale
from areal_bus.constants import GROUP_WAIT_S, SEEN_IDS_MAX


class TrainQueue:
    def __init__(self, capacity: int, trigger: int, max_batch: int, staleness: int, exact: bool,
                 group_size: int = 1, clock=time.monotonic, per_token: bool = False):
        self.capacity = capacity
        self.per_token = per_token  # staleness.per_token: over the bound when even the newest token is
        self.trigger = trigger
        self.max_batch = max_batch
        self.staleness = staleness
        self.exact = exact  # synchronous mode: a batch is exactly max_batch samples
        self.buffer: dict[str, m.Trajectory] = {}
        self.seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.duplicates = 0
        self.stale = 0
        # Async batches take GRPO groups whole: a group's advantages are its rewards against each other,
        # and the members that finish first are the short ones, so a batch of early finishers would
        # compare short answers only with short ones and the next batch long with long (the signal
        # "shorter wins" lost). A group is whole when group_size of its members have come, counting
        # those that left the buffer already (dropped as stale, or taken when the queue overflowed).
        self.group_size = group_size
        # group -> members gone (saved with each checkpoint's run state, as gone_rewards below)
        self.left: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.arrived: dict[str, float] = {}  # group -> when its first waiting member came
        self.released: set[str] = set()  # groups taken as they are (a restart's backlog: some members trained before)
        # Rewards of a group's members gone before the rest (dropped as over-stale, or trained in an earlier
        # batch that took the group in part), until every member has gone: each later batch of the group
        # has them in its GRPO baseline, so the late members are judged against the whole group. Saved
        # with each checkpoint's run state (``TrainerCore``), so a group split across a crash keeps them.
        self.gone_rewards: dict[str, list[float]] = {}
        self.split = 0  # groups the last batch took in part (take_batch's overflow or timeout)
        self.baseline: list[tuple[str, float]] = []  # the last batch's (group, reward) of members gone before
        self.clock = clock

    @property
    def full(self) -> bool:
        return len(self.buffer) >= self.capacity

    def offer(self, traj: m.Trajectory, recovered: bool = False) -> bool:
        """Take a trajectory; False if its id was already taken (a duplicate, counted and ignored).
        ``recovered``: a row of a restarted trainer's backlog, whose group-mates may have been trained
        by the process that died (what left them is not known after a restart): its group goes as it is."""
        if traj.traj_id in self.seen:
            self.duplicates += 1
            return False
        self.remember(traj.traj_id)
        self.buffer[traj.traj_id] = traj
        if traj.group_id:
            self.arrived.setdefault(traj.group_id, self.clock())
            if recovered:
                self.released.add(traj.group_id)
        return True

    def member_lost(self, traj: m.Trajectory) -> None:
        """A member of a group that will never be in the buffer (refused on arrival): its group is whole
        without it."""
        if traj.group_id and self.group_size > 1 and traj.traj_id not in self.buffer:
            self._gone(traj.group_id)

    def remember(self, traj_id: str) -> None:
        """Count ``traj_id`` as taken (a resumed run's consumed ids), so a resend of it is a duplicate."""
        self.seen[traj_id] = None
        if len(self.seen) > SEEN_IDS_MAX:
            self.seen.popitem(last=False)

    def seen_before(self, traj_id: str) -> bool:
        """True, and a duplicate counted, if this id was taken already."""
        if traj_id in self.seen:
            self.duplicates += 1
            return True
        return False

    def drop_stale(self, version: int) -> list[m.Trajectory]:
        out = [t for t in self.buffer.values() if self.over(t, version)]
        self._remove(out)
        self.stale += len(out)
        return out

    def over(self, traj: m.Trajectory, version: int) -> bool:
        """Over the staleness bound at ``version``: its oldest token, or with per_token its newest."""
        return is_over_stale(version, traj.end_version if self.per_token else traj.start_version, self.staleness)

    def take_batch(self, version: int) -> list[m.Trajectory] | None:
        """A batch if one is ready: oldest policy versions first (they are closest to the bound),
        then admission order. Async with groups: whole groups only, unless none make a batch and the
        buffer holds a whole global batch or a group has waited GROUP_WAIT_S (a member that never
        comes must not hold the rest). Sets ``split`` and ``baseline`` (engine.train's: the rewards of
        the batch's groups' members gone before it) for the batch."""
        need = self.max_batch if self.exact else self.trigger
        if len(self.buffer) < need:
            return None
        ordered = sorted(self.buffer.values(), key=lambda t: (t.start_version, t.ticket))
        batch = ordered[: self.max_batch]
        if not self.exact and self.group_size > 1:
            whole = self._whole(ordered, need)
            now = self.clock()
            waited = now - min(self.arrived.get(t.group_id, now) for t in ordered)
            if not whole and len(self.buffer) < self.max_batch and waited < GROUP_WAIT_S:
                return None
            batch = whole or batch  # overflow or timeout: oldest first, groups as they are
        members = collections.Counter(t.group_id for t in batch if t.group_id)  # group -> its members in the batch
        self.split = self._split(members)
        self.baseline = [(g, r) for g in members for r in self.gone_rewards.get(g, ())]
        self._remove(batch)
        return batch

    def _split(self, members: collections.Counter) -> int:
        """Groups of a batch (``members``: group -> its members in it) trained in part: some of their
        members have not come yet (counted once, at the batch that takes the first part; a restart's
        backlog groups are not known, not counted)."""
        if self.group_size <= 1:
            return 0
        return sum(1 for g, n in members.items()
                   if g not in self.released and n + self.left.get(g, 0) < self.group_size)

    def _whole(self, ordered: list[m.Trajectory], need: int) -> list[m.Trajectory]:
        """Whole groups, oldest first, as many as fit in max_batch; [] if they come to fewer than ``need``."""
        groups: dict[str, list[m.Trajectory]] = {}
        for t in ordered:
            groups.setdefault(t.group_id or t.traj_id, []).append(t)
        batch: list[m.Trajectory] = []
        for key, members in groups.items():
            whole = (not members[0].group_id or key in self.released
                     or len(members) + self.left.get(key, 0) >= self.group_size)
            if whole and len(batch) + len(members) <= self.max_batch:
                batch += members
        return batch if len(batch) >= need else []

    def _remove(self, trajs: list[m.Trajectory]) -> None:
        for t in trajs:
            del self.buffer[t.traj_id]
            if t.group_id and self.group_size > 1:
                if t.reward is not None:
                    self.gone_rewards.setdefault(t.group_id, []).append(float(t.reward))
                self._gone(t.group_id)
        waiting = {t.group_id for t in self.buffer.values() if t.group_id}
        for key in [k for k in self.arrived if k not in waiting]:
            del self.arrived[key]  # the clock restarts with the group's next waiting member
        self.released &= waiting

    def _gone(self, group: str) -> None:
        self.left[group] = self.left.get(group, 0) + 1
        self.left.move_to_end(group)
        if self.left[group] >= self.group_size:
            del self.left[group]  # every member has gone: the group is done, no batch will need its rewards
            self.gone_rewards.pop(group, None)
        while len(self.left) > SEEN_IDS_MAX:
            self.gone_rewards.pop(self.left.popitem(last=False)[0], None)
