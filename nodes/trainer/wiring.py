"""The trainer core's hands: its sockets, its files and its compute thread.

``TrainerIO.apply(out)`` does what a ``TrainerCore`` method returned (ledger, weight export, hub
messages, log lines, the next job). The update runs on one compute thread, so the main thread keeps
receiving, acknowledging and heartbeating meanwhile: socket I/O never waits on training, and training
never waits on sockets.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
import traceback

import zmq

from areal_bus.wire import messages as m
from areal_bus.wire.channels import Receiver, open_socket
from areal_bus.constants import POLL_MS
from areal_bus.engines.train_engine import TrainEngine, WeightsBusy
from areal_bus.runtime.ledger import Ledger, ledger_path
from areal_bus.runtime.node import NodeShell
from areal_bus.runtime.trackers import Trackers
from nodes.trainer.core import Job, Out, TrainerCore
from nodes.trainer.recovery import write_run_state

READERS_WARN_S = 10.0
"""Waiting this long for rollout workers to leave a weight buffer is logged (and again each period)."""
CRASH_ON_ENV = "AREAL_BUS_TEST_CRASH_ON"
"""Test-only fault: set to an id prefix, and an update whose batch holds a trajectory with that prefix
kills the trainer process with SIGSEGV, as a crash in a native kernel would (no exception, no cleanup).
No input of the project's models does that on CPU; tests/test_quarantine_system.py and bench/faults.py
set it to show such a trajectory quarantined. Unset (always, outside those), it costs one lookup."""


class TrainFailed(Exception):
    """The engine's update raised (on the compute thread): ``error`` one line, ``trace`` the traceback."""

    def __init__(self, error: str, trace: str):
        super().__init__(error)
        self.error, self.trace = error, trace


class TrainerIO:
    def __init__(self, shell: NodeShell, engine: TrainEngine, core: TrainerCore, trackers: Trackers | None = None):
        self.shell, self.engine, self.core = shell, engine, core
        self.trackers = trackers or Trackers([], shell.log)  # logging.trackers: each record also goes there
        # What the core checks token ids against: the engine it drives knows the model's vocabulary.
        core.vocab_size = getattr(engine, "vocab_size", None)
        topo = shell.topo
        pull = open_socket(shell.ctx, zmq.PULL, shell.endpoint("train"), bind=True, hwm=topo.queue_max_size)
        self.to_weights = open_socket(shell.ctx, zmq.PUSH, shell.endpoint("weights"), bind=False, hwm=16)
        self.inbox = Receiver(pull, shell.metrics, shell.log)
        self.poller = zmq.Poller()
        self.poller.register(shell.sub, zmq.POLLIN)
        self.poller.register(pull, zmq.POLLIN)
        self.ledger = Ledger(ledger_path(shell.log_dir, shell.node_id))
        self.steps = open(shell.log_dir / "train_steps.jsonl", "a", buffering=1)
        self.ckpt_dir = shell.log_dir / "checkpoints"
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.job: tuple[concurrent.futures.Future, Job] | None = None
        self.unsent: m.WeightsReady | None = None  # the broadcaster's pipe was full: sent again next turn

    # -- doing what the core says ---------------------------------------------------------------
    def apply(self, out: Out) -> None:
        self.shell.policy = self.core.policy
        for ev, fields in out.ledger:
            self.ledger.write(ev, **fields)
        if out.export is not None:
            self.export(out.export)
        for topic, msg in out.publish:
            self.shell.publish(topic, msg)
        if out.ready is not None:
            self.send_ready(out.ready)
        for version in out.release:
            self.engine.release(version)
        for level, name, fields in out.logs:
            getattr(self.shell.log, level)(name, **fields)
        for line in out.steps:  # "run": the run epoch, so `areal-bus plot` never splices two runs
            record = {"t_end": time.time(), "run": self.core.epoch, **line}
            self.steps.write(json.dumps(record) + "\n")
            self.trackers.log_record(record)  # one that fails is logged and dropped: it never raises
        if out.job is not None:
            self.job = self.pool.submit(self._work, out.job), out.job

    def export(self, version: int) -> None:
        """Hand ``version`` to the broadcaster. A weight buffer is reused only once every rollout worker
        has left the version in it: wait, the hub still served (its VersionCommitted frees one)."""
        since = time.monotonic()
        while True:
            try:
                location, nbytes = self.engine.export_weights(version)
                break
            except WeightsBusy:
                if self.shell.stopping.is_set():
                    raise
                if time.monotonic() - since > READERS_WARN_S:
                    self.shell.log.warning("waiting_for_readers", version=version, committed=self.core.committed)
                    since = time.monotonic()
                self.poller.poll(5)
                self.apply(self.core.on_hub(self.hub()))
                # The buffer frees once the version before commits, which a lost WeightsReady would stop.
                self.apply(self.core.resend_ready(time.monotonic()))
        self.apply(self.core.on_exported(version, location, nbytes))

    def send_ready(self, ready: m.WeightsReady) -> None:
        try:  # never blocks: a broadcaster that is down gets it when it is back (or resent on restart)
            self.to_weights.send_multipart(self.shell.encoder.encode(ready), flags=zmq.NOBLOCK, copy=False)
            self.unsent = None
        except zmq.Again:
            self.unsent = ready

    # -- what happened --------------------------------------------------------------------------
    def hub(self) -> list:
        if self.unsent is not None:
            self.send_ready(self.unsent)
        return [msg for _, msg in self.shell.drain_hub()]

    def receive(self, room: int) -> list[m.Trajectory]:
        got = []
        while len(got) < room:
            item = self.inbox.recv()
            if item is None:
                break
            if isinstance(item[1], m.Trajectory):
                got.append(item[1])
            else:
                self.inbox.drop("wrong_type", type(item[1]).__name__)
        return got

    @property
    def idle(self) -> bool:
        return self.job is None

    def finished_job(self) -> Out:
        """The core's answer to the job that finished, if one did. A failed save propagates: the node
        crashes loudly. A failed update is the batch's fault as far as the trainer can tell (the
        trajectories passed every check, yet the model raised on them): tolerated, the batch is
        quarantined with the exception and the run goes on; replaying it after a crash would only
        crash again. A failed evaluation after a good update is not the batch's: it propagates."""
        if self.job is None or not self.job[0].done():
            return Out()
        future, job = self.job
        self.job = None
        if job.kind == "save":
            future.result()
            return self.core.on_saved(job, time.monotonic())
        try:
            stats = future.result()
        except TrainFailed as failed:
            self.shell.log.error("train_exception", step=job.version, traceback=failed.trace[-4000:])
            return self.core.on_train_failed(job, failed.error, time.monotonic())
        return self.core.on_trained(job, stats, time.monotonic())

    def _work(self, job: Job) -> dict:
        """On the compute thread: the update (and the evaluation due after it), or a checkpoint."""
        if job.kind == "save":
            folder = self.ckpt_dir / f"step_{job.version}"
            self.engine.save_checkpoint(folder, job.version, job.state["consumed"])
            write_run_state(folder, job.state)
            return {}
        if (marker := os.environ.get(CRASH_ON_ENV)) and any(t.traj_id.startswith(marker) for t in job.batch):
            os.kill(os.getpid(), signal.SIGSEGV)
        try:
            stats = self.engine.train(job.batch, job.version, job.baseline)
        except Exception as exc:  # noqa: BLE001 -- any error of the update is the batch's: see finished_job
            raise TrainFailed(f"{type(exc).__name__}: {exc}", traceback.format_exc()) from exc
        if job.evaluate:
            stats.update(self.engine.evaluate(job.version + 1) or {})
        return stats

    def wait(self, due: float | None) -> None:
        """Until a message arrives, the spool is due, or (while a job runs) a short while."""
        self.shell.metrics.gauge("busy", 0.0 if self.idle else 1.0)
        poll_ms = POLL_MS if self.idle else 5
        self.poller.poll(poll_ms if due is None else min(poll_ms, max(1, int(due * 1000))))

    def close(self) -> None:
        in_flight = self.job is not None and not self.job[0].done()
        if self.job is not None:
            self.job[0].cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close(in_flight=in_flight)
        spool = self.core.spool
        if spool is not None:
            if spool.commits:
                self.shell.log.info("spool", commits=spool.commits, busy_ms=round(spool.busy_seconds * 1000, 1),
                                    rows=len(spool))
            spool.close()
        self.ledger.close()
        self.steps.close()
        self.trackers.close()
        self.shell.close()
