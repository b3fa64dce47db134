"""Trainer node: consumes trajectories, updates the policy whenever enough are ready, and hands each
new version to the weight broadcaster.

``TrainQueue`` (no sockets) is the consumption side of the scheduler: it suppresses duplicates by
trajectory id, bounds the buffer at queue_max_size, drops and counts anything over the staleness
bound, and forms batches oldest-first once trigger_batch_size samples are ready (exactly
global_batch_size in synchronous mode). The update itself runs on a compute thread; the main thread
keeps receiving, acknowledging and heartbeating meanwhile, so socket I/O never waits on training and
training never waits on sockets.

Crash safety (``durability.spool``, on by default): a received trajectory is accepted only once
committed to the spool (areal_bus/spool.py), and only then do producers forget it. Checkpoints carry
the consumed ids and admission totals; rows leave the spool once a checkpoint on disk covers them. A
trainer that supervisord restarts resumes from the run's newest checkpoint, re-queues every spooled
row that checkpoint does not cover, keeps the run's epoch (so agents count on, not over) and
announces a new weight lineage (rollout workers roll back with it). Every accepted, trained and
dropped id goes to ``logs/ledger/trainer-0.jsonl`` (areal_bus/ledger.py), which bench/chaos.py audits.

After max_steps updates (and the checkpoint due then) the trainer publishes the finished run state
and exits 0; supervisord's run-end listener then stops the whole system.

Run: areal-bus node trainer --topology topology/default.yaml
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from areal_bus import messages as m
from areal_bus.admission import is_over_stale, staleness_of
from areal_bus.channels import Receiver, open_socket
from areal_bus.constants import HEARTBEAT_INTERVAL_S, POLL_MS, SEEN_IDS_MAX
from areal_bus.engines.sim import SimTrainEngine
from areal_bus.ledger import Ledger, ledger_path
from areal_bus.node import NodeShell
from areal_bus.version import PolicyVersion
from areal_bus.spool import Spool
from areal_bus.topology import dump_resolved


class TrainQueue:
    def __init__(self, capacity: int, trigger: int, max_batch: int, staleness: int, exact: bool):
        self.capacity = capacity
        self.trigger = trigger
        self.max_batch = max_batch
        self.staleness = staleness
        self.exact = exact  # synchronous mode: a batch is exactly max_batch samples
        self.buffer: dict[str, m.Trajectory] = {}
        self.seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.duplicates = 0
        self.stale = 0

    @property
    def full(self) -> bool:
        return len(self.buffer) >= self.capacity

    def offer(self, traj: m.Trajectory) -> bool:
        """Take a trajectory; False if its id was already taken (a duplicate, counted and ignored)."""
        if traj.traj_id in self.seen:
            self.duplicates += 1
            return False
        self.seen[traj.traj_id] = None
        if len(self.seen) > SEEN_IDS_MAX:
            self.seen.popitem(last=False)
        self.buffer[traj.traj_id] = traj
        return True

    def seen_before(self, traj_id: str) -> bool:
        """True, and a duplicate counted, if this id was taken already."""
        if traj_id in self.seen:
            self.duplicates += 1
            return True
        return False

    def drop_stale(self, version: int) -> list[m.Trajectory]:
        out = [t for t in self.buffer.values() if is_over_stale(version, t.start_version, self.staleness)]
        for t in out:
            del self.buffer[t.traj_id]
        self.stale += len(out)
        return out

    def take_batch(self, version: int) -> list[m.Trajectory] | None:
        """A batch if one is ready: oldest policy versions first (they are closest to the bound),
        then admission order."""
        need = self.max_batch if self.exact else self.trigger
        if len(self.buffer) < need:
            return None
        ordered = sorted(self.buffer.values(), key=lambda t: (t.start_version, t.ticket))
        batch = ordered[: self.max_batch]
        for t in batch:
            del self.buffer[t.traj_id]
        return batch


def make_engine(topo, base=None, model_path=None):
    """(engine, evaluator or None). The evaluator plays the held-out games greedily on the trainer's
    current weights; it runs on the compute thread between updates."""
    if topo.trainer_engine.kind == "sim":
        return SimTrainEngine(topo.trainer_engine, topo.train_workers), None
    from areal_bus.engines.torch_engine import TorchRolloutEngine
    from areal_bus.engines.torch_train import TorchTrainEngine
    from areal_bus.tasks.runner import GuessDriver, evaluate, load_tokenizer
    from areal_bus.weights_shm import ShmWeightWriter

    path = model_path or topo.model_path(base)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model.path {path} holds no checkpoint (config.json); build the default with "
                                f"`python scripts/warmstart.py --out {topo.model.path}` or point model.path at one")
    import torch

    torch.set_num_threads(topo.model.threads)
    writer = None

    def publish(state_dict, version):
        nonlocal writer
        if writer is None and topo.trainer_device.startswith("cuda"):
            # One host, one or more GPUs: CUDA IPC, device to device. The handles go to the rollout
            # workers once, as a file beside the ipc sockets; each version is then an in-place copy.
            from areal_bus.weights_cuda import CudaWeightWriter, handles_path, save_handles

            writer = CudaWeightWriter(topo.shm_name(base), state_dict, device=next(iter(state_dict.values())).device)
            save_handles(handles_path(topo.ipc_dir(base), writer.name), writer.handles())
        elif writer is None:
            writer = ShmWeightWriter(topo.shm_name(base), state_dict)
        loc = writer.write(state_dict, version)
        return loc, writer.nbytes

    if topo.train_workers > 1:  # parallelism dp x tp ranks (FSDP2, DTensor); this node is rank 0
        from areal_bus.engines import torch_parallel

        # The other ranks read the resolved topology this node dumped at start (JSON is YAML).
        resolved = topo.log_dir(base) / "resolved" / "trainer-dp.json"
        resolved.parent.mkdir(parents=True, exist_ok=True)
        resolved.write_text(json.dumps(dump_resolved(topo)))
        engine = torch_parallel.start(topo, resolved, path, publish=publish)
    else:
        engine = TorchTrainEngine(topo, path, publish=publish)
    engine.release = lambda version: writer is not None and writer.mark_released(version)
    # At exit the run's weight buffers go (rollout workers copied what they serve into their own
    # parameters); a crash leaves them, and the next writer of the same name replaces them.
    engine.close_weights = lambda: writer is not None and hasattr(writer, "close") and writer.close()
    if topo.trainer_engine.eval_interval <= 0:
        return engine, None
    driver = GuessDriver(load_tokenizer(path), n=topo.agent.task_size, max_turns=topo.agent.max_turns)
    evaluator_engine = TorchRolloutEngine(path, max_batch=min(64, topo.trainer_engine.eval_episodes),
                                          max_len=topo.rollout_engine.max_len, device=topo.trainer_device,
                                          dtype=topo.model.dtype, worker="eval",
                                          weight_loader=lambda _: engine.state_dict())

    def evaluator(version: int) -> dict:
        evaluator_engine.swap_weights(version, "trainer")
        return evaluate(evaluator_engine, driver, k=topo.trainer_engine.eval_episodes)

    return engine, evaluator


def resume_state(ckpt_dir: Path) -> tuple[Path | None, int, list[str]]:
    """(checkpoint folder, version, consumed ids) of the newest complete checkpoint, or a fresh start."""
    done = [p for p in ckpt_dir.glob("step_*") if (p / "trainer_state.json").exists()] if ckpt_dir.exists() else []
    if not done:
        return None, 0, []
    folder = max(done, key=lambda p: int(p.name.split("_")[1]))
    state = json.loads((folder / "trainer_state.json").read_text())
    return folder, int(state["version"]), list(state["consumed"])


# -- crash recovery ---------------------------------------------------------------------------------
RUN_STATE = "run_state.json"
"""What the trainer adds to each checkpoint folder, atomically, once the engine's save has returned:
the run epoch, the incarnation that wrote it, the consumed ids and the per-source totals. A
checkpoint counts for crash recovery only once this file is there, so a trainer killed mid-save
recovers from the checkpoint before."""


def write_run_state(folder: Path, state: dict) -> None:
    tmp = folder / (RUN_STATE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the spool rows it covers are pruned
    os.replace(tmp, folder / RUN_STATE)


def recovery_point(ckpt_dir: Path, epoch: str) -> tuple[Path | None, dict]:
    """The newest checkpoint of run ``epoch`` with its run state, or (None, {}): the run's start."""
    best: tuple[Path | None, dict] = (None, {})
    for folder in ckpt_dir.glob("step_*") if ckpt_dir.exists() else []:
        try:
            state = json.loads((folder / RUN_STATE).read_text())
        except (OSError, ValueError):
            continue  # no run state: a save that did not finish, or another run's checkpoint
        if state.get("epoch") == epoch and (best[0] is None or state["version"] > best[1]["version"]):
            best = folder, state
    return best


def supervisor_instance() -> str:
    """The supervisord that started this process (pid and start time), "" when none did. A trainer
    restarted by the supervisord that started its run recovers that run; a new supervisord starts a
    new run (``--resume`` continues an old one on purpose)."""
    if not os.environ.get("SUPERVISOR_ENABLED"):
        return ""
    ppid = os.getppid()
    try:
        started = Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "?"
    return f"{ppid}:{started}"


@dataclass
class Start:
    """Where a trainer process starts: a fresh run, a checkpoint (``--resume``), or a crash recovery."""

    epoch: str  # names the run in RunState: agents count on across trainer restarts of one epoch
    folder: Path | None = None  # checkpoint to load
    version: int = 0
    consumed: list = field(default_factory=list)  # ids trained on or dropped as stale, in that lineage
    sources: dict = field(default_factory=dict)  # per-source [consumed, stale] at that checkpoint
    trained: int = 0
    ckpt_inc: str | None = None  # the incarnation that wrote the checkpoint
    recovering: bool = False  # re-queue the spool's rows the checkpoint does not cover
    finished: bool = False  # the run had already finished: nothing to do


def plan_start(spool: Spool | None, ckpt_dir: Path, resume: bool, incarnation: str, owner: str) -> Start:
    """Restarted by the supervisord (``owner``) that started the spool's run: recover that run (or
    say it finished). ``--resume``: continue the spool's unfinished run, else the newest checkpoint.
    Otherwise a new run, with an empty spool."""

    def from_state(epoch, folder, state, recovering) -> Start:
        return Start(epoch, folder, int(state.get("version", 0)), list(state.get("consumed", [])),
                     dict(state.get("sources", {})), int(state.get("trained", len(state.get("consumed", [])))),
                     state.get("inc"), recovering)

    meta = spool.meta() if spool is not None else {}
    if spool is not None and meta.get("epoch") and owner and meta.get("owner") == owner:
        if meta.get("finished") == "1":
            return Start(meta["epoch"], finished=True)
        folder, state = recovery_point(ckpt_dir, meta["epoch"])
        return from_state(meta["epoch"], folder, state, recovering=True)
    if resume and spool is not None and meta.get("epoch") and meta.get("finished") != "1":
        # Continue the spool's unfinished run on purpose (e.g. after the whole machine went down).
        spool.set_meta(owner=owner)
        folder, state = recovery_point(ckpt_dir, meta["epoch"])
        return from_state(meta["epoch"], folder, state, recovering=True)
    if resume:
        # The newest checkpoint of any run, as a new epoch (without a spool, or its run had finished).
        folder, version, consumed = resume_state(ckpt_dir)
        if spool is not None:
            spool.start_run(epoch=incarnation, owner=owner, finished=0)
        return from_state(incarnation, folder, {"version": version, "consumed": consumed}, recovering=False)
    if spool is not None:
        spool.start_run(epoch=incarnation, owner=owner, finished=0)
    return Start(incarnation)


# -- the node ---------------------------------------------------------------------------------------
def run(topo, replica: int = 0, base=None, resume: bool = False) -> int:
    shell = NodeShell(topo, "trainer", replica, base=base, watch=("weights",),
                      topics=(m.TOPIC_VERSION, m.TOPIC_VERSION_COMMITTED))
    shell.install_signal_handlers()
    pull = open_socket(shell.ctx, zmq.PULL, shell.endpoint("train"), bind=True, hwm=topo.queue_max_size)
    to_weights = open_socket(shell.ctx, zmq.PUSH, shell.endpoint("weights"), bind=False, hwm=16)
    inbox = Receiver(pull, shell.metrics, shell.log)
    queue = TrainQueue(topo.queue_max_size, topo.effective_trigger, topo.global_batch_size,
                       topo.effective_staleness, exact=not topo.is_async)
    ckpt_dir = shell.log_dir / "checkpoints"
    dur = topo.durability
    spool = Spool(shell.log_dir / "spool" / "spool.sqlite", dur.sync_every_ms, dur.batch_rows, dur.fsync) \
        if dur.spool else None
    ledger = Ledger(ledger_path(shell.log_dir, shell.node_id))
    start = plan_start(spool, ckpt_dir, resume, shell.incarnation, supervisor_instance())
    if start.finished:
        # Killed between finishing and exiting: say so again (agents stop) and end as a finished run does.
        shell.log.info("run_already_finished", epoch=start.epoch)
        shell.publish(m.TOPIC_RUN, m.RunState(version=topo.max_steps, max_steps=topo.max_steps, finished=True,
                                              consumed=0, incarnation=start.epoch))
        time.sleep(HEARTBEAT_INTERVAL_S)  # the hub gets it before the socket goes
        spool.close()
        ledger.close()
        shell.close()
        return 0
    folder, version = start.folder, start.version
    consumed_ids = collections.OrderedDict.fromkeys(start.consumed)  # this lineage's trained and stale ids
    for tid in start.consumed:
        queue.seen[tid] = None
    engine, evaluator = make_engine(topo, base, model_path=folder if folder and topo.trainer_engine.kind == "torch"
                                    else None)
    if folder is not None and topo.trainer_engine.kind == "torch":
        engine.load_optimizer(folder)
    # A resumed run's consumption count continues too: agents measure the batch from it.
    shell.metrics.inc("samples", start.trained)
    # Per episode source, [consumed, stale] in this run epoch: the admission totals of RunState.
    totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    totals.update({k: list(v) for k, v in start.sources.items()})
    # Weights of this process's lineage: a restart rolls the policy back to its checkpoint, and rollout
    # workers must follow even though the version number goes down. Ordered by start time.
    lineage = f"{time.time_ns():020d}-{shell.incarnation}"
    shell.policy = PolicyVersion(lineage, version)
    ledger.write("start", inc=shell.incarnation, epoch=start.epoch, resumed_step=version, ckpt_inc=start.ckpt_inc,
                 spool=spool is not None)
    unpruned: list[str] = []  # consumed since the last checkpoint was started: its rows may go after it
    if spool is not None and start.recovering:
        covered = set(consumed_ids)
        spool.prune([tid for tid in spool.ids() if tid in covered])
        backlog, bad = spool.load(skip=covered)
        if bad:
            shell.metrics.inc("spool_bad_rows", len(bad))
            shell.log.error("spool_bad_rows", count=len(bad), ids=",".join(bad[:5]))
        for traj in backlog:
            queue.offer(traj)
        # Accepted again by this incarnation: the ledger line of the one that died may not have been written.
        ledger.write("accepted", inc=shell.incarnation, ids=[t.traj_id for t in backlog])
        shell.log.warning("recovered", epoch=start.epoch, version=version, checkpoint=str(folder or "-"),
                          requeued=len(backlog), spooled=len(spool))
    busy_errors: tuple[type[Exception], ...] = ()
    if topo.trainer_engine.kind == "torch":
        from areal_bus.weights_shm import BufferBusy

        busy_errors = (BufferBusy,)
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compute")
    steps_file = open(shell.log_dir / "train_steps.jsonl", "a", buffering=1)
    shell.announce_start(engine=topo.trainer_engine.kind, mode="async" if topo.is_async else "sync",
                         trigger=queue.trigger, batch=queue.max_batch, staleness=queue.staleness,
                         max_steps=topo.max_steps, resumed_from=str(folder) if folder else "-", version=version,
                         spool="on" if spool is not None else "off", epoch=start.epoch)
    shell.start_heartbeat()
    poller = zmq.Poller()
    poller.register(shell.sub, zmq.POLLIN)
    poller.register(pull, zmq.POLLIN)
    job = None  # (future, "train", batch, started) or (future, "save", ids it covers, started)
    idle_since = time.monotonic()
    window = {"t": time.monotonic(), "samples": 0, "tokens": 0}
    committed = -1
    ready: m.WeightsReady | None = None  # the newest version, kept for a broadcaster that restarts
    ready_unsent = False
    last_state = 0.0

    def count(trajs, which: int) -> None:
        for t in trajs:
            totals[t.source][which] += 1

    def publish_state(finished=False):
        nonlocal last_state
        shell.publish(m.TOPIC_RUN, m.RunState(version=version, max_steps=topo.max_steps, finished=finished,
                                              consumed=int(shell.metrics.counters["samples"]),
                                              incarnation=start.epoch, sources=dict(totals), lineage=lineage))
        last_state = time.monotonic()

    def ack(**ids) -> None:
        shell.publish(m.TOPIC_TRAJ_ACK, m.TrajAck(trainer_version=version, **{
            "consumed": [], "stale": [], "duplicate": [], **ids}))

    def accept(trajs) -> None:
        """Durable now (or the spool is off): record, queue, and let producers forget them."""
        if not trajs:
            return
        ids = [t.traj_id for t in trajs]
        ledger.write("accepted", inc=shell.incarnation, ids=ids)
        for t in trajs:
            queue.offer(t)
        if spool is not None:  # without a spool, producers keep a trajectory until it is trained
            ack(accepted=ids)

    def send_ready() -> None:
        nonlocal ready_unsent
        try:  # never blocks: a broadcaster that is down gets it when it is back (or resent on restart)
            to_weights.send_multipart(shell.encoder.encode(ready, (ready.version,)), flags=zmq.NOBLOCK, copy=False)
            ready_unsent = False
        except zmq.Again:
            ready_unsent = True

    def drain_hub():
        nonlocal committed
        for _, msg in shell.drain_hub():
            if isinstance(msg, m.VersionCommitted) and msg.lineage == lineage and msg.version > committed:
                committed = msg.version
                if hasattr(engine, "release"):
                    for v in range(max(0, msg.version - 2), msg.version):
                        engine.release(v)
            elif isinstance(msg, m.Event) and msg.name == "peer_restarted" and ready is not None:
                send_ready()  # a restarted broadcaster knows no version until it is told

    def export_weights(v: int) -> None:
        """Hand version v to the broadcaster. A shared-memory buffer is reused only once every
        rollout worker has left the version in it: wait (hub still served) until they have."""
        nonlocal ready
        from_busy = time.monotonic()
        while True:
            try:
                location, nbytes = engine.export_weights(v)
                break
            except busy_errors:
                if shell.stopping.is_set():
                    raise
                if time.monotonic() - from_busy > 10:
                    shell.log.warning("waiting_for_readers", version=v, committed=committed)
                    from_busy = time.monotonic()
                poller.poll(5)
                drain_hub()
        ready = m.WeightsReady(version=v, location=location, nbytes=nbytes, lineage=lineage)
        send_ready()

    def work(batch, v, wait, hist):
        stats = engine.train(batch, v) if batch else {}
        stats["_wait_s"] = wait
        stats["_staleness"] = {str(k): c for k, c in sorted(hist.items())}
        return stats

    def save(v: int, state: dict) -> dict:
        folder = ckpt_dir / f"step_{v}"
        engine.save_checkpoint(folder, v, state["consumed"])
        write_run_state(folder, state)
        return {}

    try:
        # A resumed run serves its checkpoint, a fresh one its start weights; either way every rollout
        # worker switches to this lineage.
        export_weights(version)
        if evaluator is not None and version == 0:
            ev = evaluator(0)
            shell.log.info("eval", step=0, **{k: round(v, 4) for k, v in ev.items()})
            steps_file.write(json.dumps({"step": -1, "t_end": time.time(), "train_s": 0.0, "wait_s": 0.0,
                                         "samples": 0, "tokens": 0, "staleness": {}, **ev}) + "\n")
        publish_state()
        while not shell.stopping.is_set() and (version < topo.max_steps or job is not None):
            drain_hub()
            if ready_unsent:
                send_ready()
            fresh = []
            room = queue.capacity - len(queue.buffer) - (spool.staged if spool is not None else 0)
            while room > 0:
                got = inbox.recv()
                if got is None:
                    break
                traj = got[1]
                if not isinstance(traj, m.Trajectory):
                    inbox.drop("wrong_type", type(traj).__name__)
                    continue
                if queue.seen_before(traj.traj_id):
                    shell.metrics.inc("duplicates")
                    ack(duplicate=[traj.traj_id])  # it is durable (or trained) already: forget it
                elif spool is None:
                    fresh.append(traj)
                    room -= 1
                elif not spool.is_staged(traj.traj_id):  # a staged one's acceptance is on its way
                    spool.stage(traj)
                    room -= 1
            accept(fresh)
            if spool is not None and spool.due_in(time.monotonic()) == 0:
                accept(spool.commit())
            shell.metrics.gauge("queue.buffered", len(queue.buffer))
            if job is not None and job[0].done() and job[1] == "save":
                future, _, covers, v_saved = job
                future.result()  # a failed save propagates: the node crashes loudly
                job = None
                ledger.write("checkpoint", inc=shell.incarnation, version=v_saved)
                if spool is not None:
                    spool.prune(covers)
                    accept(spool.commit())
                publish_state()
            if job is not None and job[1] == "train" and job[0].done():
                future, _, batch, started = job
                stats = future.result()  # a training error propagates: the node crashes loudly
                job = None
                took = time.monotonic() - started
                version += 1
                shell.policy = PolicyVersion(lineage, version)
                export_weights(version)
                ids = [t.traj_id for t in batch]
                consumed_ids.update((tid, None) for tid in ids)
                unpruned.extend(ids)
                count(batch, 0)
                ledger.write("step", inc=shell.incarnation, step=version - 1, ids=ids)  # before producers forget
                ack(consumed=ids)
                tokens = sum(t.num_tokens for t in batch)
                shell.metrics.inc("samples", len(batch))
                shell.metrics.inc("tokens", tokens)
                shell.metrics.inc("busy_seconds", took)
                shell.metrics.inc("steps")
                window["samples"] += len(batch)
                window["tokens"] += tokens
                line = {"step": version - 1, "updated": len(batch), "loss": round(stats.get("loss", 0.0), 4),
                        "reward": round(stats.get("reward", 0.0), 4), "train_s": round(took, 3)}
                if "eval_reward" in stats:
                    line["eval_reward"] = round(stats["eval_reward"], 4)
                shell.log.info("step", **line)
                steps_file.write(json.dumps({"step": version - 1, "t_end": time.time(), "train_s": took,
                                             "wait_s": stats.get("_wait_s", 0.0), "samples": len(batch),
                                             "tokens": tokens, "stale_dropped": queue.stale,
                                             "duplicates": queue.duplicates,
                                             **{k: v for k, v in stats.items() if k[0] != "_"},
                                             "staleness": stats.get("_staleness", {})}) + "\n")
                if version % topo.logging.log_interval == 0:
                    dt = time.monotonic() - window["t"]
                    shell.log.info("throughput", samples_per_second=round(window["samples"] / dt, 2),
                                   tokens_per_second=round(window["tokens"] / dt, 1), step=version - 1,
                                   stale_dropped=queue.stale, duplicates=queue.duplicates)
                    window.update(t=time.monotonic(), samples=0, tokens=0)
                if topo.logging.save_interval and version % topo.logging.save_interval == 0:
                    # Saved after the step is recorded and acknowledged, on the compute thread (the
                    # next update waits for it, as it would inside the step).
                    state = {"version": version, "epoch": start.epoch, "inc": shell.incarnation,
                             "consumed": list(consumed_ids), "sources": {k: list(v) for k, v in totals.items()},
                             "trained": int(shell.metrics.counters["samples"])}
                    job = (pool.submit(save, version, state), "save", list(unpruned), version)
                    unpruned.clear()
                publish_state()
                idle_since = time.monotonic()
            if job is None and version < topo.max_steps:
                stale = queue.drop_stale(version)
                if stale:
                    ids = [t.traj_id for t in stale]
                    shell.metrics.inc("stale_dropped", len(stale))
                    consumed_ids.update((tid, None) for tid in ids)
                    unpruned.extend(ids)
                    count(stale, 1)
                    ledger.write("stale", inc=shell.incarnation, version=version, ids=ids)
                    ack(stale=ids)
                    publish_state()
                    shell.log.warning("stale_dropped", count=len(stale), version=version)
                batch = queue.take_batch(version)
                if batch is not None:
                    hist = collections.Counter(staleness_of(version, t.start_version) for t in batch)
                    for s, c in hist.items():
                        shell.metrics.observe("staleness", s, c)
                    wait = time.monotonic() - idle_since
                    shell.metrics.inc("idle_seconds", wait)
                    v = version
                    evaluate_now = evaluator is not None and (v + 1) % topo.trainer_engine.eval_interval == 0

                    def step(batch=batch, v=v, wait=wait, hist=hist, evaluate_now=evaluate_now):
                        stats = work(batch, v, wait, hist)
                        if evaluate_now:
                            stats.update(evaluator(v + 1))
                        return stats

                    job = (pool.submit(step), "train", batch, time.monotonic())
            if time.monotonic() - last_state >= HEARTBEAT_INTERVAL_S:
                publish_state()  # a lost report heals; the bus caches the latest for late joiners
            shell.metrics.gauge("busy", 1.0 if job is not None else 0.0)
            due = spool.due_in(time.monotonic()) if spool is not None else None
            poll_ms = 5 if job is not None else POLL_MS
            poller.poll(poll_ms if due is None else min(poll_ms, max(1, int(due * 1000))))
        if version >= topo.max_steps:
            # In this order: the ledger's final word, then the spool's mark (a trainer killed in
            # between finishes again), then the state that stops the agents.
            ledger.write("finished", inc=shell.incarnation, version=version, unconsumed=list(queue.buffer))
            if spool is not None:
                spool.set_meta(finished=1)
            publish_state(finished=True)
            shell.log.info("run_finished", steps=version, samples=int(shell.metrics.counters["samples"]),
                           stale_dropped=queue.stale, duplicates=queue.duplicates)
    finally:
        if job is not None:
            job[0].cancel()
        pool.shutdown(wait=False, cancel_futures=True)
        if getattr(engine, "dp", None) is not None and job is None:
            engine.dp.close()  # tell the other ranks to stop (mid-update, killasgroup stops them)
        if hasattr(engine, "close_weights"):
            engine.close_weights()
        if spool is not None:
            if spool.commits:
                shell.log.info("spool", commits=spool.commits, busy_ms=round(spool.busy_seconds * 1000, 1),
                               rows=len(spool))
            spool.close()
        ledger.close()
        steps_file.close()
        shell.close()
    return 0
