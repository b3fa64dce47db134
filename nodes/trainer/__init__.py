"""Trainer node: consumes trajectories, updates the policy whenever enough are ready, and hands each
new version to the weight broadcaster.

The pieces: ``core.TrainerCore`` (no sockets) decides (batch forming, stale drop, duplicate
suppression, spool-before-ack, checkpoint-covers-then-prune) and ``queue.TrainQueue`` holds the
buffer; ``recovery`` plans where a process starts; ``wiring.TrainerIO`` does what the core says, with
the update on a compute thread; the engine (sim, torch, parallel torch) is
``areal_bus.engines.train_engine.build_train_engine``'s.

Crash safety (``durability.spool``, on by default): a received trajectory is accepted only once
committed to the spool (areal_bus/runtime/spool.py), and only then do producers forget it. Checkpoints carry
the consumed ids and admission totals; rows leave the spool once a checkpoint on disk covers them. A
trainer that supervisord restarts resumes from the run's newest checkpoint that verifies (a damaged
one is passed over and logged as an error; the spool keeps rows until the checkpoint after the one
covering them is sealed), re-queues every spooled row that checkpoint does not cover, keeps the run's
epoch (so agents count on, not over) and announces a new weight lineage (rollout workers roll back
with it). A trainer started by a new supervisord over an unfinished run refuses to start
(``recovery.UnfinishedRun``) unless it resumes (``--resume``, or ``AREAL_BUS_RESUME=1`` in its
environment: what ``areal-bus run --resume`` sets). Every accepted, trained and
dropped id goes to ``logs/ledger/trainer-0.jsonl`` (areal_bus/runtime/ledger.py), which bench/chaos.py audits.
Every update's record goes to ``logs/train_steps.jsonl``, and to TensorBoard and W&B when
``logging.trackers`` lists them (areal_bus/runtime/trackers.py).

After max_steps updates (and the checkpoint due then) the trainer publishes the finished run state
and exits 0; supervisord's run-end listener then stops the whole system.

Run: areal-bus node trainer --topology topology/default.yaml
"""

from __future__ import annotations

import os
import time

from areal_bus.wire import messages as m
from areal_bus.constants import HEARTBEAT_INTERVAL_S
from areal_bus.engines.train_engine import build_train_engine
from areal_bus.runtime.node import NodeShell
from areal_bus.runtime.outcome import RESUME_ENV, outcome_path, write_outcome
from areal_bus.runtime.spool import Spool
from areal_bus.runtime.trackers import TrackerError, Trackers
from areal_bus.trajectory_check import reason_code
from nodes.trainer.core import QUARANTINE_CODES, TrainerCore
from nodes.trainer.queue import TrainQueue
from nodes.trainer.recovery import Start, UnfinishedRun, plan_start, resume_state, supervisor_instance, write_run_state
from nodes.trainer.wiring import TrainerIO

__all__ = ["run", "TrainerCore", "TrainQueue", "Start", "plan_start", "resume_state", "write_run_state"]


def run(topo, replica: int = 0, base=None, resume: bool = False) -> int:
    shell = NodeShell(topo, "trainer", replica, base=base, watch=("weights",), own_policy=True,
                      topics=(m.TOPIC_VERSION, m.TOPIC_VERSION_COMMITTED))
    shell.install_signal_handlers()
    dur = topo.durability
    spool = Spool(shell.log_dir / "spool" / "spool.sqlite", dur.sync_every_ms, dur.batch_rows, dur.fsync) \
        if dur.spool else None
    resume = resume or os.environ.get(RESUME_ENV) == "1"
    try:
        start = plan_start(spool, shell.log_dir / "checkpoints", resume, shell.incarnation, supervisor_instance())
    except UnfinishedRun as err:  # logged, then raised: the run-end listener quotes it as the run's end
        shell.log.error("unfinished_run", reason=str(err))
        raise
    if start.finished:
        return _finished_already(shell, start, spool)
    trackers = _start_trackers(shell, start)
    engine = build_train_engine(topo, base, checkpoint=start.folder)
    # Lineages sort by start time: a restarted trainer's weights are newer even at a lower version.
    lineage = f"{time.time_ns():020d}-{shell.incarnation}"
    core = TrainerCore(topo, start, spool, shell.incarnation, lineage, shell.metrics, now=time.monotonic())
    shell.policy = core.policy
    io = TrainerIO(shell, engine, core, trackers)
    try:
        shell.announce_start(engine=topo.trainer_engine.kind, mode="async" if topo.is_async else "sync",
                             trigger=core.queue.trigger, batch=core.queue.max_batch, staleness=core.queue.staleness,
                             max_steps=topo.max_steps, resumed_from=str(start.folder or "-"), version=core.version,
                             spool="on" if spool is not None else "off", epoch=core.epoch)
        shell.start_heartbeat()
        io.apply(core.begin())
        if core.version == 0 and (stats := engine.evaluate(0)):
            io.apply(core.on_evaluated(0, stats))
        while not shell.stopping.is_set() and not (core.done and io.idle):
            io.apply(core.on_hub(io.hub()))
            io.apply(core.receive(io.receive(core.room())))
            io.apply(core.tick(time.monotonic()))
            io.apply(io.finished_job())
            if io.idle:
                io.apply(core.next_job(time.monotonic()))
            io.wait(core.due_in(time.monotonic()))
        if core.done:
            io.apply(core.finish())
            io.apply(core.finished(time.monotonic()))
            _record_outcome(core)
    finally:
        io.close()
    return 0


def _start_trackers(shell: NodeShell, start: Start) -> Trackers:
    """logging.trackers (TensorBoard, W&B), before the model loads: one that cannot start stops the
    trainer at once, with the reason. A trainer restarted within its run trains again from its
    checkpoint's version (at version 0, from the start weights' evaluation): purged from there."""
    purge = (start.version + 1 if start.version else 0) if start.recovering else None
    try:
        trackers = Trackers.start(shell.topo, start.epoch, shell.log_dir, shell.log, purge_step=purge)
    except TrackerError as err:  # logged, then raised: the run-end listener quotes it as the run's end
        shell.log.error("tracker_failed", reason=str(err))
        raise
    if trackers.active:
        shell.log.info("trackers", run=start.epoch, **{t.name: t.where for t in trackers.active})
    return trackers


def _record_outcome(core: TrainerCore) -> None:
    """The run's data counts in log_dir/run_outcome.json (``trainer``: beside what ``areal-bus run`` and
    the run-end listener write), so a run that refused or quarantined rows says so where its end is.
    From the spool's dead letters of this run (every incarnation's), else this process's counters."""
    path = outcome_path()
    if path is None or not path.parent.is_dir():
        return
    counters = core.metrics.counters
    if core.spool is not None:
        reasons = [reason_code(d["reason"]) for d in core.spool.dead_letters(core.epoch)]
        quarantined = sum(r in QUARANTINE_CODES for r in reasons)
        rejected = len(reasons) - quarantined
    else:
        quarantined = int(counters.get("quarantined", 0))
        rejected = int(sum(v for k, v in counters.items() if k.startswith("rejected."))) - quarantined
    write_outcome(path, trainer={"trained": core.trained, "steps": core.version, "stale_dropped": core.queue.stale,
                                 "duplicates": core.queue.duplicates, "rejected": rejected, "quarantined": quarantined})


def _finished_already(shell: NodeShell, start: Start, spool: Spool) -> int:
    """Killed between finishing and exiting: say so again (agents stop) and end as a finished run does."""
    topo = shell.topo
    shell.log.info("run_already_finished", epoch=start.epoch)
    shell.publish(m.TOPIC_RUN, m.RunState(version=topo.max_steps, max_steps=topo.max_steps, finished=True,
                                          consumed=0, incarnation=start.epoch))
    time.sleep(HEARTBEAT_INTERVAL_S)  # the hub gets it before the socket goes
    spool.close()
    shell.close()
    return 0
