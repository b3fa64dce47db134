"""The trainer's logic without sockets: what it accepts, when it trains, what it tells the others.

The consumption side (duplicates, the queue bound, the staleness bound, batch forming) is
``TrainQueue`` (nodes/trainer/queue.py).

``TrainerCore`` holds the run's protocol state (version and lineage, the run epoch, the consumed ids,
the trained total and the per-source totals that admission is computed from) and the spool. Each
method takes what happened (trajectories received, hub messages, a spool commit due, a finished
update or save) and returns an ``Out``: what to write to the ledger, what to publish, which weights to
export, what to start on the compute thread. The node (``nodes/trainer/__init__.py``) does it.

The order that makes the run crash-safe lives here: a trajectory is acknowledged ``accepted`` only
once the spool has committed it (without a spool, never: producers keep it until it is trained); a
ledger record goes out before the acknowledgement it explains; spool rows are pruned only once a
checkpoint that covers them is sealed (``recovery.write_run_state``'s manifest) and the next one is too, so a
newest checkpoint found damaged at recovery costs nothing: the one before it is loaded and the spool
still holds every row that one does not cover. A spool row that no longer decodes is lost: counted in
its source's stale total (the admission slot comes back), logged as an error, and pruned with the rest.

What the model cannot train on never gets that far: each received trajectory is checked
(``areal_bus.trajectory_check``: aligned arrays, ids in the vocabulary, no version from the future)
and a bad one is *rejected*: moved to the spool's dead letters, counted in its source's stale total
(so its admission slot comes back, and stays back after a crash: a recovering trainer counts the
dead letters its checkpoint does not cover), recorded in the ledger and acknowledged ``rejected``.
An update that raises is handled the same way for its whole batch (``on_train_failed``): one failed
try, then quarantine, never a replay into a crash loop.

An update can also kill the process (a segfault or an OOM kill in the engine): nothing raises. So each
batch is marked in flight in the spool before its update starts (``next_job``) and cleared when it
returns. A recovering trainer that finds a batch in flight holds its rows apart as *suspects*, each
with the number of times a trainer died with it in flight (``begin``), and trains them before anything
else in probes of their own: the suspects that died most often, half of them at a time (after a half
that trained, the other half whole). A probe that trains clears its rows; a process that dies again
narrows the set; a row that was in flight alone when the process died is the one that kills it: it is
quarantined (dead letters, ``rejected`` acknowledgement, its admission slot back, ``quarantined`` in
the metrics) and the other suspects go back to the queue. A batch of n rows with one such row costs
1 + log2(n) or so restarts, never a loop; a trainer killed from outside mid-update (kill -9) costs two
smaller updates and loses nothing.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import msgpack

from areal_bus.wire import messages as m
from areal_bus.admission import staleness_of
from areal_bus.constants import HEARTBEAT_INTERVAL_S
from areal_bus.runtime.metrics import Metrics
from areal_bus.runtime.spool import Spool
from areal_bus.trajectory_check import check_trajectory, reason_code
from areal_bus.version import WEIGHTS_KIND, PolicyVersion
from nodes.trainer.queue import TrainQueue
from nodes.trainer.recovery import Start


READY_RESEND_S = 2.0
"""How long the broadcaster's heartbeats may report one version, older than the trainer's newest export,
before the trainer sends that export again. The resend on ``peer_restarted`` is one message: should it be
lost (sent into the pipe of the incarnation that died, say), rollout would stay on the old weights and the
run would stall. The heartbeat says what the broadcaster holds every HEARTBEAT_INTERVAL_S, so the state is
checked, not only the event; normally it catches up in milliseconds, and a resend it already has changes
nothing (an offer not newer than its current version is ignored)."""
BROADCASTER = f"{WEIGHTS_KIND}-0"
"""The broadcaster's node id: replica 0 of the weights kind (replicas >= 1 are relays the trainer never
tells)."""

QUARANTINE_CODES = frozenset({"train_failed", "killed_trainer"})
"""Dead-letter reasons of rows accepted, then found unfit in training (the others were refused on arrival)."""


@dataclass
class Job:
    """Work for the compute thread: one update (``train``) or one checkpoint save (``save``)."""

    kind: str  # "train" or "save"
    version: int  # train: the weights it updates; save: the version it saves
    started: float  # monotonic time it was handed out
    batch: list = field(default_factory=list)  # train: the trajectories
    evaluate: bool = False  # train: evaluate the new weights after the update
    wait_s: float = 0.0  # train: how long the trainer sat idle before it
    baseline: list = field(default_factory=list)  # train: (group, reward) of the groups' dropped members
    staleness: dict = field(default_factory=dict)  # train: {staleness: samples} of the batch
    state: dict = field(default_factory=dict)  # save: the run state the checkpoint gets (write_run_state)
    covers: list = field(default_factory=list)  # save: spool rows it covers, pruned once the next one is sealed
    probe: str = ""  # train: "" a batch; "half" or "whole" of the suspects that died most often (TrainerCore.begin)
    over_bound: int = 0  # train: samples over staleness_threshold in the batch (drop_at_consume false only)
    split_groups: int = 0  # train: GRPO groups the batch takes in part, the rest of their members to come


@dataclass
class Out:
    """What to do, in this order: ledger records, the weights to export (then ``on_exported``), hub
    messages, the WeightsReady to (re)send, buffers to release, log lines, train_steps.jsonl lines (the
    node adds the wall-clock ``t_end`` and the run epoch ``run``), and the job to start on the compute
    thread."""

    ledger: list[tuple[str, dict]] = field(default_factory=list)  # (event, fields)
    export: int | None = None
    publish: list[tuple[bytes, object]] = field(default_factory=list)  # (topic, message)
    ready: m.WeightsReady | None = None
    release: list[int] = field(default_factory=list)
    logs: list[tuple[str, str, dict]] = field(default_factory=list)  # (level, event, fields)
    steps: list[dict] = field(default_factory=list)
    job: Job | None = None

    def add(self, other: Out) -> Out:
        self.ledger += other.ledger
        self.export = other.export if other.export is not None else self.export
        self.publish += other.publish
        self.ready = other.ready or self.ready
        self.release += other.release
        self.logs += other.logs
        self.steps += other.steps
        self.job = other.job or self.job
        return self


class TrainerCore:
    def __init__(self, topo, start: Start, spool: Spool | None, incarnation: str, lineage: str,
                 metrics: Metrics | None = None, now: float = 0.0, vocab_size: int | None = None):
        self.topo = topo
        self.vocab_size = vocab_size  # the engine's: a token id must be below it (None: not checked)
        self.start = start
        self.spool = spool
        self.incarnation = incarnation  # this process
        self.epoch = start.epoch  # the run: kept across crash recoveries, so agents count on
        self.metrics = metrics or Metrics()
        self.queue = TrainQueue(topo.queue_max_size, topo.effective_trigger, topo.global_batch_size,
                                topo.effective_staleness, exact=not topo.is_async,
                                group_size=topo.agent.group_size if topo.whole_groups else 1,
                                per_token=topo.staleness.per_token)
        # Weights of this process's lineage: a restart rolls the policy back to its checkpoint, and
        # rollout workers must follow even though the version number goes down.
        self.policy = PolicyVersion(lineage, start.version)
        self.consumed = collections.OrderedDict.fromkeys(start.consumed)  # this lineage's trained and stale ids
        for tid in start.consumed:
            self.queue.remember(tid)
        self.trained = start.trained  # samples trained on in this run: RunState.consumed, agents size batches by it
        # Groups split across the checkpoint: their members gone before it, and those members' rewards.
        self.queue.left.update(start.group_left)
        self.queue.gone_rewards.update(start.gone_rewards)
        # Per episode source, [consumed, stale] in this run epoch: the admission totals of RunState.
        self.totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        self.totals.update({k: list(v) for k, v in start.sources.items()})
        self.unpruned: list[str] = []  # consumed since the last checkpoint was started: its rows may go after it
        self.behind: list[str] = []  # rows the newest sealed checkpoint covers: pruned once the next one is sealed
        self.committed = -1  # newest version of this lineage every rollout worker serves
        # The newest version this run has made, in any lineage: a token may carry no newer one. Above
        # the checkpoint's after a crash (in-flight samples of the lost versions are still good), so
        # the spool keeps it.
        meta = spool.meta() if spool is not None and start.recovering else {}
        self.newest = max(start.version, int(meta.get("newest", 0) or 0))
        self.ready: m.WeightsReady | None = None  # the newest export, kept for a broadcaster that restarts
        self.broadcaster_version: int | None = None  # what the broadcaster's last heartbeat said it holds
        self.behind_since: float | None = None  # since when it has said the same version, older than self.ready
        self.broadcaster_beats = 0  # its heartbeats heard: a resend goes only to one that is still beating
        self.beats_then = 0  # the count when the wait started (or the last resend went)
        # Rows that were in flight when a trainer process died: id -> (trajectory, deaths), trained
        # apart from the queue (next_job's probes) until they train or one is found to kill the trainer.
        self.suspects: dict[str, tuple[m.Trajectory, int]] = {}
        self.probe_whole = False  # the last probe, half of the top suspects, trained: the other half goes whole
        self.idle_since = now
        self.last_state = float("-inf")
        self.window = {"t": now, "samples": 0, "tokens": 0}

    @property
    def version(self) -> int:
        return self.policy.version

    @property
    def done(self) -> bool:
        return self.version >= self.topo.max_steps

    def room(self) -> int:
        """How many more trajectories to take in now (staged spool rows count: they are on their way)."""
        return self.queue.capacity - len(self.queue.buffer) - len(self.suspects) \
            - (self.spool.staged if self.spool is not None else 0)

    # -- start ----------------------------------------------------------------------------------
    def begin(self) -> Out:
        """The start record, and after a crash the spool's rows the checkpoint does not cover, queued
        again; then the start weights are exported (a resumed run serves its checkpoint, a fresh one
        its start weights; either way every rollout worker switches to this lineage)."""
        out = Out(ledger=[("start", {"inc": self.incarnation, "epoch": self.epoch, "resumed_step": self.version,
                                     "ckpt_inc": self.start.ckpt_inc, "spool": self.spool is not None})],
                  export=self.version)
        for folder, why in self.start.skipped:  # checkpoints newer than the one loaded, that failed verification
            self.metrics.inc("checkpoints_skipped")
            out.logs.append(("error", "checkpoint_skipped", {"checkpoint": str(folder), "reason": why,
                                                             "loaded": str(self.start.folder or "-")}))
        if self.start.set_aside is not None:
            out.logs.append(("warning", "checkpoints_set_aside", {"to": str(self.start.set_aside)}))
        if self.spool is None or not self.start.recovering:
            return out
        covered = set(self.consumed)
        # Kept until the next checkpoint is sealed: should this one be found damaged, the one before it
        # is loaded instead, and these rows are what it does not cover.
        self.behind = [tid for tid in self.spool.ids() if tid in covered]
        backlog, bad = self.spool.load(skip=covered)
        if bad:
            out.add(self._lost(bad))
        crashed = self.spool.take_in_flight()  # the batch the dead process was training, if any
        deaths = self.spool.suspects()
        for traj in backlog:
            if traj.traj_id in deaths:
                self.queue.remember(traj.traj_id)  # a resend is a duplicate, as for any accepted row
                self.suspects[traj.traj_id] = (traj, deaths[traj.traj_id])
            else:
                self.queue.offer(traj, recovered=True)
        if gone := [tid for tid in deaths if tid not in self.suspects]:  # trained into a checkpoint since
            self.spool.acquit(gone)
        if crashed:
            self.metrics.inc("train_deaths")
            out.logs.append(("error", "died_in_update", {
                "samples": len(crashed), "ids": ",".join(crashed[:5]), "suspects": len(self.suspects),
                "next": "trained apart, halving; a row in flight alone when the trainer dies is quarantined"}))
        # Rejected after the checkpoint: their stale count (the slot given back) went with the process.
        dead = [d for d in self.spool.dead_letters(self.epoch) if d["traj_id"] not in covered]
        for d in dead:
            self.queue.remember(d["traj_id"])
            self._count(d["traj_id"], d["source"], 1)
        if len(crashed) == 1 and crashed[0] in self.suspects:  # after the count above: it is one more
            out.add(self._quarantine_killer(crashed[0]))
        # Accepted again by this incarnation: the ledger line of the one that died may not have been written.
        out.ledger.append(("accepted", {"inc": self.incarnation, "ids": [t.traj_id for t in backlog]}))
        out.logs.append(("warning", "recovered", {"epoch": self.epoch, "version": self.version,
                                                  "checkpoint": str(self.start.folder or "-"),
                                                  "requeued": len(backlog), "spooled": len(self.spool)}))
        return out

    def on_evaluated(self, version: int, stats: dict) -> Out:
        """The evaluation of the start weights (version 0), before any update."""
        return Out(logs=[("info", "eval", {"step": version, **{k: round(v, 4) for k, v in stats.items()}})],
                   steps=[{"step": version - 1, "train_s": 0.0, "wait_s": 0.0, "samples": 0,
                           "tokens": 0, "staleness": {}, **stats}])

    # -- input ----------------------------------------------------------------------------------
    def receive(self, trajs: list[m.Trajectory]) -> Out:
        """Trajectories off the train channel. A seen id is acknowledged as a duplicate (it is durable,
        or trained, already); with a spool a new one is staged (accepted once committed: ``tick``),
        without one it is accepted at once."""
        out, fresh = Out(), []
        for traj in trajs:
            if self.queue.seen_before(traj.traj_id):
                self.metrics.inc("duplicates")
                out.publish.append(self._ack(duplicate=[traj.traj_id]))
            elif (reason := check_trajectory(traj, self.vocab_size, self.newest)) is not None:
                out.add(self.reject([traj], reason))
            elif self.spool is None:
                fresh.append(traj)
            elif not self.spool.is_staged(traj.traj_id):  # a staged one's acceptance is on its way
                self.spool.stage(traj)
        return out.add(self._accept(fresh))

    def on_hub(self, msgs) -> Out:
        """Hub messages: a committed version frees the buffers of older ones; a restarted broadcaster
        knows no version until it is told again."""
        out = Out()
        for msg in msgs:
            if isinstance(msg, m.VersionCommitted) and msg.lineage == self.policy.lineage \
                    and msg.version > self.committed:
                self.committed = msg.version
                out.release += range(max(0, msg.version - 2), msg.version)
            elif isinstance(msg, m.Event) and msg.name == "peer_restarted" and self.ready is not None:
                out.ready = self.ready
            elif isinstance(msg, m.Heartbeat) and msg.node_id == BROADCASTER:
                self.broadcaster_beats += 1
                if msg.version != self.broadcaster_version:
                    self.broadcaster_version, self.behind_since = msg.version, None  # it moved: the wait starts anew
        return out

    def resend_ready(self, now: float) -> Out:
        """The newest export again when the broadcaster has said the same older version for READY_RESEND_S
        (each heartbeat carries the version it announces: a lost WeightsReady heals here). While training
        outpaces the heartbeats the version it says is older but moving: no resend then; nor to a
        broadcaster not heard since the last decision (stopped or dead: its restart is resent to)."""
        behind = self.ready is not None and self.broadcaster_version is not None \
            and self.broadcaster_version < self.ready.version
        if not behind:
            self.behind_since = None
            return Out()
        if self.behind_since is None:
            self.behind_since, self.beats_then = now, self.broadcaster_beats
            return Out()
        if now - self.behind_since < READY_RESEND_S or self.broadcaster_beats == self.beats_then:
            return Out()
        # The next one READY_RESEND_S later, if heartbeats still come and still say behind.
        self.behind_since, self.beats_then = now, self.broadcaster_beats
        self.metrics.inc("weights_ready_resent")
        return Out(ready=self.ready, logs=[("warning", "weights_ready_resent", {
            "version": self.ready.version, "broadcaster_version": self.broadcaster_version})])

    def tick(self, now: float) -> Out:
        """Time passing: commit the spool when due, repeat the run state every heartbeat interval (a lost
        report heals; the bus caches the latest for late joiners)."""
        out = self.resend_ready(now)
        if self.spool is not None and self.spool.due_in(now) == 0:
            out.add(self._accept(self.spool.commit()))
        self.metrics.gauge("queue.buffered", len(self.queue.buffer))
        if now - self.last_state >= HEARTBEAT_INTERVAL_S:
            out.publish.append(self.run_state(now))
        return out

    def due_in(self, now: float) -> float | None:
        """Seconds until ``tick`` must commit the spool; None when nothing waits."""
        return self.spool.due_in(now) if self.spool is not None else None

    # -- training -------------------------------------------------------------------------------
    def next_job(self, now: float) -> Out:
        """With the compute thread idle: drop what is over the staleness bound, then hand out the next
        update if a batch is ready."""
        out = Out()
        if self.done:
            return out
        drop = self.topo.staleness.drop_at_consume
        stale = self.queue.drop_stale(self.version) if drop else []
        if stale:
            out.add(self._drop_stale(stale, now))
        if over := [t for t, _ in self.suspects.values() if drop and self.queue.over(t, self.version)]:
            for t in over:
                del self.suspects[t.traj_id]
            out.add(self._drop_stale(over, now))
        probe, batch = self._probe()
        batch = batch or self.queue.take_batch(self.version)
        if batch is None:
            return out
        if probe:
            out.logs.append(("warning", "suspects_probed", {"samples": len(batch), "suspects": len(self.suspects),
                                                            "deaths": self.suspects[batch[0].traj_id][1]}))
        if self.spool is not None:  # durable before the update starts: a process that dies in it leaves the mark
            self.spool.set_in_flight([t.traj_id for t in batch])
        hist = collections.Counter(staleness_of(self.version, t.start_version) for t in batch)
        for s, c in hist.items():
            self.metrics.observe("staleness", s, c)
        # Samples trained over the bound: none when dropping (per_token: their tokens over it are masked,
        # counted by the engine as tokens_over_bound).
        over_bound = 0 if drop else sum(c for s, c in hist.items() if s > self.queue.staleness)
        split = 0 if probe else self.queue.split  # set by take_batch just above
        if over_bound:
            self.metrics.inc("trained_over_bound", over_bound)
        wait = now - self.idle_since
        self.metrics.inc("idle_seconds", wait)
        every = getattr(self.topo.trainer_engine, "eval_interval", 0)  # a torch-engine field (the sim engine has no eval)
        out.job = Job("train", self.version, now, batch=batch, evaluate=every > 0 and (self.version + 1) % every == 0,
                      baseline=[] if probe else self.queue.baseline,
                      wait_s=wait, staleness={str(k): c for k, c in sorted(hist.items())}, probe=probe,
                      over_bound=over_bound, split_groups=split)
        if split:
            self.metrics.inc("split_groups", split)
        return out

    def _probe(self) -> tuple[str, list[m.Trajectory] | None]:
        """The next probe of the suspects, if any: those that died most often (the narrowest set known to
        have been in flight when a trainer died), half of them, or all once a half has trained."""
        if not self.suspects:
            return "", None
        top = max(n for _, n in self.suspects.values())
        group = [t for t, n in self.suspects.values() if n == top]
        if self.probe_whole or len(group) == 1:
            return "whole", group
        return "half", group[: (len(group) + 1) // 2]

    def _drop_stale(self, stale: list[m.Trajectory], now: float) -> Out:
        ids = [t.traj_id for t in stale]
        self.metrics.inc("stale_dropped", len(stale))
        self._consume(stale, 1)
        return Out(ledger=[("stale", {"inc": self.incarnation, "version": self.version, "ids": ids})],
                   publish=[self._ack(stale=ids), self.run_state(now)],
                   logs=[("warning", "stale_dropped", {"count": len(stale), "version": self.version})])

    def _settled(self, job: Job) -> None:
        """The update of ``job`` returned: nothing is in flight, and its rows are suspects no more."""
        if self.spool is not None:
            self.spool.clear_in_flight([t.traj_id for t in job.batch] if job.probe else ())
        for t in job.batch:
            self.suspects.pop(t.traj_id, None)
        self.probe_whole = job.probe == "half" and bool(self.suspects)

    def _quarantine_killer(self, traj_id: str) -> Out:
        """``traj_id`` was in flight alone when the trainer died: quarantined; the other suspects were in
        flight with it, so they go back to the queue."""
        traj, deaths = self.suspects.pop(traj_id)
        out = self.reject([traj], f"killed_trainer: the trainer process died {deaths} times while training it, "
                                  "the last time alone", quarantined=True)
        released = list(self.suspects)
        for tid, (t, _) in self.suspects.items():
            self.queue.buffer[tid] = t  # its id is remembered already: offer would count a duplicate
        self.suspects.clear()
        self.spool.acquit(released)
        out.logs.append(("error", "quarantined_killer", {"traj": traj_id, "source": traj.source, "deaths": deaths,
                                                         "released": len(released)}))
        return out

    def on_trained(self, job: Job, stats: dict, now: float) -> Out:
        """An update finished: the new version is exported, its samples recorded and acknowledged as
        consumed, a checkpoint started when one is due."""
        took = now - job.started
        self._settled(job)
        self.policy = PolicyVersion(self.policy.lineage, job.version + 1)
        if self.version > self.newest:
            self.newest = self.version
            if self.spool is not None:  # before the export: no token of this version exists yet
                self.spool.set_meta(newest=self.newest)
        step, ids = job.version, [t.traj_id for t in job.batch]
        tokens = sum(t.num_tokens for t in job.batch)
        self._consume(job.batch, 0)
        self.trained += len(job.batch)
        for name, by in (("samples", len(job.batch)), ("tokens", tokens), ("busy_seconds", took), ("steps", 1)):
            self.metrics.inc(name, by)
        out = Out(ledger=[("step", {"inc": self.incarnation, "step": step, "ids": ids})],  # before producers forget
                  export=self.version, publish=[self._ack(consumed=ids)])
        line = {"step": step, "updated": len(job.batch), "loss": round(stats.get("loss", 0.0), 4),
                "reward": round(stats.get("reward", 0.0), 4), "train_s": round(took, 3)}
        if "eval_reward" in stats:
            line["eval_reward"] = round(stats["eval_reward"], 4)
        out.logs.append(("info", "step", line))
        out.steps.append({"step": step, "train_s": took, "wait_s": job.wait_s,
                          "samples": len(job.batch), "tokens": tokens, "stale_dropped": self.queue.stale,
                          "duplicates": self.queue.duplicates, **stats, "staleness": job.staleness,
                          "over_bound": job.over_bound, "split_groups": job.split_groups,
                          "generated": sum(int(t.loss_mask.sum()) for t in job.batch)})
        self.window["samples"] += len(job.batch)
        self.window["tokens"] += tokens
        if self.version % self.topo.logging.log_interval == 0:
            dt = max(now - self.window["t"], 1e-9)
            out.logs.append(("info", "throughput", {
                "samples_per_second": round(self.window["samples"] / dt, 2),
                "tokens_per_second": round(self.window["tokens"] / dt, 1), "step": step,
                "stale_dropped": self.queue.stale, "duplicates": self.queue.duplicates}))
            self.window.update(t=now, samples=0, tokens=0)
        every = self.topo.logging.save_interval
        if every and self.version % every == 0:
            # Saved after the step is recorded and acknowledged, on the compute thread (the next update
            # waits for it, as it would inside the step).
            state = {"version": self.version, "epoch": self.epoch, "inc": self.incarnation,
                     "consumed": list(self.consumed), "sources": {k: list(v) for k, v in self.totals.items()},
                     "trained": self.trained,
                     "gone_rewards": {g: list(r) for g, r in self.queue.gone_rewards.items()},
                     "group_left": dict(self.queue.left)}
            out.job = Job("save", self.version, now, state=state, covers=list(self.unpruned))
            self.unpruned.clear()
        out.publish.append(self.run_state(now))
        self.idle_since = now
        return out

    def on_train_failed(self, job: Job, error: str, now: float) -> Out:
        """The update of ``job`` raised: its batch is quarantined after this one try and the run goes
        on with the next batch, at the same version (an update that failed in a later mini-batch has
        stepped the weights on the earlier ones: they stay, as a partial update of the same policy)."""
        self.idle_since = now
        self._settled(job)
        self.metrics.inc("train_failures")
        out = self.reject(job.batch, f"train_failed: {error}", quarantined=True)
        out.logs.append(("error", "train_failed", {"step": job.version, "samples": len(job.batch),
                                                   "error": error[:500]}))
        return out

    def reject(self, trajs: list[m.Trajectory], reason: str, quarantined: bool = False) -> Out:
        """Refuse these for good: dead letters first (durable before the acknowledgement, and never
        re-queued), their sources' stale totals (the admission slots come back), the ledger, then the
        ``rejected`` acknowledgement (producers forget them) and the run state that carries the totals.
        ``quarantined``: accepted, then failed in training (counted as ``quarantined`` too)."""
        ids = [t.traj_id for t in trajs]
        if self.spool is not None:
            self.spool.quarantine(trajs, reason, self.epoch)
        for t in trajs:
            self.queue.remember(t.traj_id)  # a resend is a duplicate: acknowledged, never checked again
            if not quarantined:  # refused on arrival: its group is whole without it (a quarantined one left in a batch)
                self.queue.member_lost(t)
            self._count(t.traj_id, t.source, 1)
        self.metrics.inc(f"rejected.{reason_code(reason)}", len(trajs))
        if quarantined:
            self.metrics.inc("quarantined", len(trajs))
        return Out(ledger=[("rejected", {"inc": self.incarnation, "ids": ids, "reason": reason[:500]})],
                   publish=[self._ack(rejected=ids), self.run_state(self.last_state)],
                   logs=[("warning", "rejected", {"count": len(ids), "ids": ",".join(ids[:5]),
                                                  "reason": reason[:500]})])

    def on_saved(self, job: Job, now: float) -> Out:
        """A checkpoint is sealed (write_run_state returned): the rows the one before it covers may go."""
        out = Out(ledger=[("checkpoint", {"inc": self.incarnation, "version": job.version})])
        if self.spool is not None:
            self.spool.prune(self.behind)
            self.behind = list(job.covers)
            out.add(self._accept(self.spool.commit()))
        out.publish.append(self.run_state(now))
        return out

    def on_exported(self, version: int, location: str, nbytes: int) -> Out:
        self.ready = m.WeightsReady(version=version, location=location, nbytes=nbytes, lineage=self.policy.lineage)
        return Out(ready=self.ready)

    # -- the end --------------------------------------------------------------------------------
    def finish(self) -> Out:
        """The ledger's final word. Then ``finished``: the spool's mark, then the state that stops the
        agents, in that order (a trainer killed in between finishes again)."""
        return Out(ledger=[("finished", {"inc": self.incarnation, "version": self.version,
                                         "unconsumed": [*self.queue.buffer, *self.suspects]})])

    def finished(self, now: float) -> Out:
        if self.spool is not None:
            self.spool.set_meta(finished=1)
        return Out(publish=[self.run_state(now, finished=True)],
                   logs=[("info", "run_finished", {"steps": self.version, "samples": self.trained,
                                                   "stale_dropped": self.queue.stale,
                                                   "duplicates": self.queue.duplicates})])

    # -- helpers --------------------------------------------------------------------------------
    def run_state(self, now: float, finished: bool = False) -> tuple[bytes, m.RunState]:
        self.last_state = now
        return m.TOPIC_RUN, m.RunState(version=self.version, max_steps=self.topo.max_steps, finished=finished,
                                       consumed=self.trained, incarnation=self.epoch, sources=dict(self.totals),
                                       lineage=self.policy.lineage, ready=len(self.queue.buffer))

    def _ack(self, **ids) -> tuple[bytes, m.TrajAck]:
        return m.TOPIC_TRAJ_ACK, m.TrajAck(trainer_version=self.version, **{
            "consumed": [], "stale": [], "duplicate": [], "rejected": [], **ids})

    def _accept(self, trajs: list[m.Trajectory]) -> Out:
        """Durable now (or the spool is off): record and queue them; with a spool, producers may now
        forget them (without one they keep a trajectory until it is trained)."""
        if not trajs:
            return Out()
        ids = [t.traj_id for t in trajs]
        for t in trajs:
            self.queue.offer(t)
        out = Out(ledger=[("accepted", {"inc": self.incarnation, "ids": ids})])
        if self.spool is not None:
            out.publish.append(self._ack(accepted=ids))
        return out

    def _lost(self, bad: list[str]) -> Out:
        """Spool rows that no longer decode (a damaged disk): never trainable, so their admission slots
        come back (stale totals of the source their header still names) and the next checkpoints prune
        them. They stay accepted-and-lost in the ledger's audit, which is the truth."""
        sources = collections.Counter()
        for tid in bad:
            source = _row_source(self.spool, tid)
            sources[source] += 1
            self.queue.remember(tid)  # a resend is a duplicate: it was accepted once already
            self._count(tid, source, 1)
        self.metrics.inc("spool_bad_rows", len(bad))
        return Out(ledger=[("lost", {"inc": self.incarnation, "ids": bad, "reason": "spool row does not decode"})],
                   logs=[("error", "spool_bad_rows", {"count": len(bad), "ids": ",".join(bad[:5]),
                                                      "sources": dict(sources)})])

    def _consume(self, trajs: list[m.Trajectory], which: int) -> None:
        """Trained on (``which`` 0) or dropped as stale (1): in this lineage's consumed ids, the
        per-source totals, and the ids the next checkpoint lets the spool forget."""
        for t in trajs:
            self._count(t.traj_id, t.source, which)

    def _count(self, traj_id: str, source: str, which: int) -> None:
        """One id consumed (0) or given back (1: stale, or rejected, which the totals count alike)."""
        self.consumed[traj_id] = None
        self.unpruned.append(traj_id)
        self.totals[source][which] += 1


def _row_source(spool: Spool, traj_id: str) -> str:
    """The episode source a spool row's header names, read without decoding the row (its arrays may be
    what is damaged): "" when even the header is gone, and then no source gets the slot back."""
    row = spool.db.execute("SELECT frames FROM spool WHERE traj_id = ?", (traj_id,)).fetchone()
    try:
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(row[0])
        unpacker.read_array_header()
        header = msgpack.unpackb(unpacker.unpack(), raw=False)
        source = header[3]["source"]
    except Exception:  # noqa: BLE001 -- any damage means the same: no source to give the slot back to
        return ""
    return source if isinstance(source, str) else ""
