"""The agent node's core: plays episodes under the staleness admission rule and records each as a
trajectory, owning no sockets (``node.run`` wires it to the bus).

``EpisodeSource`` decides when an episode may start (AReaL's capacity rule), turns each
turn into a GenerateRequest, folds each Completion into the episode's token record, and emits the
finished episode as one Trajectory. It tracks every generation request until its completion arrives:
a request held by a rollout worker that dies (or sitting in its pipe) is issued again under the same
id; a completion that arrives twice is ignored. Episodes stay admitted until the trainer's run state
counts them (consumed, or dropped as over-stale, which gives the slot back); those totals are repeated,
so a lost hub message never leaks a slot.

With ``staleness.in_order`` (asynchronous mode) finished episodes are handed on by whole GRPO group
in the order the groups were admitted (``deliver``, a reorder buffer): a group that finished waits
for those admitted before it, so the trainer's batches are the groups admitted together, not the ones
that finished first. A group that has waited GROUP_WAIT_S behind an unfinished one goes anyway (an
episode that never ends must not hold the rest), and an episode a worker refused leaves its group
one member short. Held trajectories are in memory, like the ones the sender keeps until the trainer
acknowledges them: a crash of the agent loses them as it loses its running episodes.

A driver plays the task: ``sim`` (synthetic single-turn prompts, output lengths drawn by the simulated
engine) here; every real task (guess, math, a user's ``package.module:Class``) through
areal_bus.tasks.driver.TaskDriver, which has the same ``new_seed`` / ``start`` / ``advance``
(``make_driver``).
"""

from __future__ import annotations

import collections
import uuid
from dataclasses import dataclass, field

import numpy as np

from areal_bus.wire import messages as m
from areal_bus.admission import Admission, Sources
from areal_bus.constants import GROUP_WAIT_S, REISSUE_UNCLAIMED_S
from areal_bus.episode import EpisodeRecord
from areal_bus.version import PolicyVersion
from areal_bus.tasks.plugins import make_driver as make_task_driver


class SimDriver:
    """Synthetic single-turn episodes; the reward node scores them."""

    def __init__(self, topo):
        self.prompt_len = topo.agent.prompt_len
        self.max_tokens = topo.rollout_engine.output_len.max

    def new_seed(self, rng: np.random.Generator) -> int:
        return int(rng.integers(0, 2**31))

    def start(self, rng: np.random.Generator, index: int, seed: int | None = None):
        """(task state, first prompt ids, meta) for a new task instance; the same ``seed`` gives the
        same instance (a GRPO group plays one instance several times)."""
        seed = self.new_seed(rng) if seed is None else seed
        prompt = np.random.default_rng(seed).integers(0, 32000, self.prompt_len, dtype=np.int32)
        return None, prompt, {"task": "sim", "seed": seed}

    def advance(self, state, record: EpisodeRecord, comp: m.Completion):
        """After a turn: (environment reply ids or None, done, reward or None)."""
        return None, True, None


@dataclass(slots=True)
class _Req:
    msg: m.GenerateRequest
    issued_at: float
    claimed_by: str | None = None


@dataclass(slots=True)
class _Episode:
    record: EpisodeRecord
    state: object
    request_id: str


@dataclass(slots=True)
class _Group:
    """A GRPO group held for admission order (``staleness.in_order``)."""

    left: int  # members still playing
    done: list = field(default_factory=list)  # finished trajectories
    finished_at: float | None = None  # when its last member finished


class EpisodeSource:
    def __init__(self, topo, replica: int, replicas: int, driver=None, source: str = ""):
        self.topo = topo
        self.source = source or f"agent-{replica}"  # names our episodes in the trainer's totals
        self.replica = replica
        self.driver = driver or SimDriver(topo)
        self.admission = Admission.of(topo, f"agent-{replica}")
        self.sources = Sources(topo, f"agent-{replica}")  # who shares the batch, as scaling changes it
        self.rng = np.random.default_rng(topo.agent.seed * 1000 + replica)
        self.prefix = f"a{replica}-{uuid.uuid4().hex[:8]}"
        self.count = 0
        self.policy = PolicyVersion()  # the newest the trainer or the broadcaster announced
        self.finished = False
        self.abandoned = 0  # episodes given up because a worker refused a turn
        self.requests: dict[str, _Req] = {}  # generation requests not yet completed
        self.episodes: dict[str, _Episode] = {}  # episodes being played
        self.to_send: list[m.GenerateRequest] = []  # requests ZeroMQ has not taken yet
        self.in_order = topo.is_async and topo.staleness.in_order
        self.held: collections.OrderedDict[str, _Group] = collections.OrderedDict()  # in admission order

    @property
    def version(self) -> int:
        """The number of the newest policy version (what admission counts in)."""
        return self.policy.version

    # -- admission -------------------------------------------------------------------------------
    def start_episodes(self, now: float) -> int:
        """Admit as many new episodes as the rule allows (none while unsent requests wait)."""
        if self.finished or self.to_send:
            return 0
        group = self.topo.agent.group_size
        n = self.admission.capacity(self.version)
        n -= n % group  # a GRPO group is admitted whole or not at all
        for _ in range(n // group):
            seed = self.driver.new_seed(self.rng)
            gid = f"{self.prefix}-g{self.count}"
            if self.in_order:
                self.held[gid] = _Group(group)
            for _ in range(group):
                state, prompt, meta = self.driver.start(self.rng, self.count, seed=seed)
                eid = f"{self.prefix}-{self.count}"
                self.count += 1
                # The admission ticket: ticket // trigger is the update this sample is admitted for, at
                # most staleness_threshold ahead of training whatever batch the trainer takes (the
                # gateway's sessions get theirs the same way).
                slot = self.admission.admit(1)
                rec = EpisodeRecord(eid, prompt, group_id=gid, ticket=slot, meta=meta)
                self.episodes[eid] = _Episode(rec, state, "")
                self._request(eid, now)
        return n

    def _request(self, eid: str, now: float) -> None:
        ep = self.episodes[eid]
        rid = f"{eid}-t{ep.record.turns}"
        ep.request_id = rid
        req = m.GenerateRequest(
            # Synchronous mode must generate with the version that will train the sample; asynchronous
            # mode takes whatever the worker serves (its tokens are tagged with it).
            request_id=rid, episode_id=eid, ticket=ep.record.ticket,
            min_version=0 if self.topo.is_async else self.version,
            # An episode may set its own turn length and generate through eos (tasks/driver.py).
            max_tokens=int(getattr(ep.state, "max_tokens", 0) or self.driver.max_tokens),
            ignore_eos=bool(getattr(ep.state, "ignore_eos", False)), temperature=self.topo.rollout_engine.temperature,
            top_p=self.topo.rollout_engine.top_p, prompt_ids=ep.record.next_prompt(),
            reply_to=self.replica, group_id=ep.record.group_id)
        self.requests[rid] = _Req(req, now)
        self.to_send.append(req)

    # -- events ----------------------------------------------------------------------------------
    def on_completion(self, comp: m.Completion, now: float) -> m.Trajectory | None:
        """Fold a completion into its episode; the finished Trajectory when the episode is over."""
        if self.requests.pop(comp.request_id, None) is None:
            return None  # a reissued request completed twice, or a stranger's: already handled
        if comp.error:  # a worker refused the turn: the episode cannot go on; its slot is free again
            ep = self.episodes.pop(comp.episode_id, None)
            if ep is not None:
                self._member_done(ep.record.group_id, None, now)
            self.admission.abandon(1)
            self.abandoned += 1
            return None
        ep = self.episodes[comp.episode_id]
        ep.record.add_completion(comp)
        env_ids, done, reward = self.driver.advance(ep.state, ep.record, comp)
        if not done:
            ep.record.add_env(env_ids)
            self._request(comp.episode_id, now)
            return None
        del self.episodes[comp.episode_id]
        traj = ep.record.to_trajectory(reward)
        traj.source = self.source
        self._member_done(traj.group_id, traj, now)
        return traj

    def deliver(self, traj: m.Trajectory | None, now: float) -> list[m.Trajectory]:
        """What to hand on now, after ``on_completion`` returned ``traj`` (None: nothing finished).
        Without in_order, ``traj`` itself. With it, the finished groups at the head of admission order,
        and any finished group that has waited GROUP_WAIT_S behind an unfinished one."""
        if not self.in_order:
            return [traj] if traj is not None else []
        out: list[m.Trajectory] = []
        head = True
        for gid, g in list(self.held.items()):
            if g.left and head:
                head = False
            elif not g.left and (head or now - g.finished_at >= GROUP_WAIT_S):
                out += g.done
                del self.held[gid]
        return out

    def _member_done(self, gid: str, traj: m.Trajectory | None, now: float) -> None:
        g = self.held.get(gid) if self.in_order else None
        if g is None:
            return
        g.left -= 1
        if traj is not None:
            g.done.append(traj)
        if not g.left:
            g.finished_at = now

    def on_version(self, msg) -> None:
        """A VersionAnnounce or RunState: follow the policy when (lineage, version) goes up (a resumed
        trainer's new lineage is newer even where its number is lower)."""
        self.policy = max(self.policy, PolicyVersion.of(msg))

    def on_run_state(self, state: m.RunState) -> None:
        # The trainer's own version: admission must not wait on the broadcaster being up.
        self.on_version(state)
        self.admission.follow(state, self.source)

    def on_claims(self, worker: str, inflight: list) -> None:
        for rid in inflight:
            req = self.requests.get(rid)
            if req is not None:
                req.claimed_by = worker

    def reissue(self, dead_worker: str | None, now: float) -> int:
        """Issue again what the dead worker held, and what nobody claimed (when a worker dies,
        unclaimed requests may have been sitting in its pipe; otherwise only after a long wait)."""
        waiting = {r.request_id for r in self.to_send}
        again = 0
        for rid, req in self.requests.items():
            if rid in waiting:
                continue
            held_by_dead = dead_worker is not None and req.claimed_by == dead_worker
            unclaimed = req.claimed_by is None and (dead_worker is not None or now - req.issued_at > REISSUE_UNCLAIMED_S)
            if held_by_dead or unclaimed:
                req.claimed_by, req.issued_at = None, now
                self.to_send.append(req.msg)
                again += 1
        return again


def make_driver(topo, base=None):
    """The driver of ``agent.framework``: SimDriver for 'sim', else the task's TaskDriver (a built-in
    task or the user's ``package.module:Class``, areal_bus/tasks/plugins.py)."""
    if topo.agent.framework == "sim":
        return SimDriver(topo)
    return make_task_driver(topo, base)
