"""Trainer node: consumes trajectories, updates the policy whenever enough are ready, and hands each
new version to the weight broadcaster.

``TrainQueue`` (no sockets) is the consumption side of the scheduler: it suppresses duplicates by
trajectory id, bounds the buffer at queue_max_size, drops and counts anything over the staleness
bound, and forms batches oldest-first once trigger_batch_size samples are ready (exactly
global_batch_size in synchronous mode). The update itself runs on a compute thread; the main thread
keeps receiving, acknowledging and heartbeating meanwhile, so socket I/O never waits on training and
training never waits on sockets.

After max_steps updates the trainer publishes the finished run state and exits 0; supervisord's
run-end listener then stops the whole system.

Run: areal-bus node trainer --topology topology/default.yaml
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import time
from pathlib import Path

import zmq

from areal_bus import messages as m
from areal_bus.admission import is_over_stale, staleness_of
from areal_bus.channels import Receiver, open_socket
from areal_bus.constants import HEARTBEAT_INTERVAL_S, POLL_MS, SEEN_IDS_MAX
from areal_bus.engines.sim import SimTrainEngine
from areal_bus.node import NodeShell
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
        if writer is None:
            writer = ShmWeightWriter(topo.shm_name(base), state_dict)
        loc = writer.write(state_dict, version)
        return loc, writer.nbytes

    dp = None
    if topo.train_workers > 1:
        from areal_bus.engines.torch_dp import DataParallel

        # The other ranks read the resolved topology this node dumped at start (JSON is YAML).
        resolved = topo.log_dir(base) / "resolved" / "trainer-dp.json"
        resolved.parent.mkdir(parents=True, exist_ok=True)
        resolved.write_text(json.dumps(dump_resolved(topo)))
        dp = DataParallel.launch(topo.train_workers, str(resolved), str(path),
                                 backend="nccl" if topo.model.device.startswith("cuda") else "gloo")
    engine = TorchTrainEngine(topo, path, publish=publish, dp=dp)
    engine.release = lambda version: writer is not None and writer.mark_released(version)
    # At exit the run's weight buffers go (rollout workers copied what they serve into their own
    # parameters); a crash leaves them, and the next writer of the same name replaces them.
    engine.close_weights = lambda: writer is not None and writer.close()
    if topo.trainer_engine.eval_interval <= 0:
        return engine, None
    driver = GuessDriver(load_tokenizer(path), n=topo.agent.task_size, max_turns=topo.agent.max_turns)
    evaluator_engine = TorchRolloutEngine(path, max_batch=min(64, topo.trainer_engine.eval_episodes),
                                          max_len=topo.rollout_engine.max_len, device=topo.model.device,
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
    folder, version, consumed = resume_state(ckpt_dir) if resume else (None, 0, [])
    consumed_ids = collections.OrderedDict.fromkeys(consumed)
    for tid in consumed:
        queue.seen[tid] = None
    engine, evaluator = make_engine(topo, base, model_path=folder if folder and topo.trainer_engine.kind == "torch"
                                    else None)
    if folder is not None and topo.trainer_engine.kind == "torch":
        engine.load_optimizer(folder)
    shell.version = version
    # A resumed run's consumption count continues too: agents measure the batch from it.
    shell.metrics.inc("samples", len(consumed))
    busy_errors: tuple[type[Exception], ...] = ()
    if topo.trainer_engine.kind == "torch":
        from areal_bus.weights_shm import BufferBusy

        busy_errors = (BufferBusy,)
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compute")
    steps_file = open(shell.log_dir / "train_steps.jsonl", "a", buffering=1)
    shell.announce_start(engine=topo.trainer_engine.kind, mode="async" if topo.is_async else "sync",
                         trigger=queue.trigger, batch=queue.max_batch, staleness=queue.staleness,
                         max_steps=topo.max_steps, resumed_from=str(folder) if folder else "-", version=version)
    shell.start_heartbeat()
    poller = zmq.Poller()
    poller.register(shell.sub, zmq.POLLIN)
    poller.register(pull, zmq.POLLIN)
    job = None  # (future, batch, started)
    idle_since = time.monotonic()
    window = {"t": time.monotonic(), "samples": 0, "tokens": 0}
    committed = -1
    # Per episode source, [consumed, stale] in this incarnation: the admission totals of RunState.
    totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    last_state = 0.0

    def count(trajs, which: int) -> None:
        for t in trajs:
            totals[t.source][which] += 1

    def publish_state(finished=False):
        nonlocal last_state
        shell.publish(m.TOPIC_RUN, m.RunState(version=version, max_steps=topo.max_steps, finished=finished,
                                              consumed=int(shell.metrics.counters["samples"]),
                                              incarnation=shell.incarnation, sources=dict(totals)))
        last_state = time.monotonic()

    def drain_hub():
        nonlocal committed
        for _, msg in shell.drain_hub():
            if isinstance(msg, m.VersionCommitted) and msg.version > committed:
                committed = msg.version
                if hasattr(engine, "release"):
                    for v in range(max(0, msg.version - 2), msg.version):
                        engine.release(v)

    def export_weights(v: int) -> None:
        """Hand version v to the broadcaster. A shared-memory buffer is reused only once every
        rollout worker has left the version in it: wait (hub still served) until they have."""
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
        to_weights.send_multipart(shell.encoder.encode(
            m.WeightsReady(version=v, location=location, nbytes=nbytes), (v,)))

    def work(batch, v, wait, hist):
        stats = engine.train(batch, v) if batch else {}
        stats["_wait_s"] = wait
        stats["_staleness"] = {str(k): c for k, c in sorted(hist.items())}
        return stats

    try:
        if version > 0 or topo.trainer_engine.kind == "torch":
            export_weights(version)  # a resumed run serves its checkpoint; a fresh one its start weights
        if evaluator is not None and version == 0:
            ev = evaluator(0)
            shell.log.info("eval", step=0, **{k: round(v, 4) for k, v in ev.items()})
            steps_file.write(json.dumps({"step": -1, "t_end": time.time(), "train_s": 0.0, "wait_s": 0.0,
                                         "samples": 0, "tokens": 0, "staleness": {}, **ev}) + "\n")
        publish_state(finished=version >= topo.max_steps)
        while not shell.stopping.is_set() and version < topo.max_steps:
            drain_hub()
            while not queue.full:
                got = inbox.recv()
                if got is None:
                    break
                traj = got[1]
                if not isinstance(traj, m.Trajectory):
                    inbox.drop("wrong_type", type(traj).__name__)
                    continue
                if not queue.offer(traj):
                    shell.metrics.inc("duplicates")
                    shell.publish(m.TOPIC_TRAJ_ACK, m.TrajAck(trainer_version=version, consumed=[], stale=[],
                                                              duplicate=[traj.traj_id]))
            shell.metrics.gauge("queue.buffered", len(queue.buffer))
            if job is not None and job[0].done():
                future, batch, started = job
                stats = future.result()  # a training error propagates: the node crashes loudly
                job = None
                took = time.monotonic() - started
                version += 1
                shell.version = version
                export_weights(version)
                consumed_ids.update((t.traj_id, None) for t in batch)
                count(batch, 0)
                shell.publish(m.TOPIC_TRAJ_ACK, m.TrajAck(trainer_version=version, consumed=[t.traj_id for t in batch],
                                                          stale=[], duplicate=[]))
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
                publish_state(finished=version >= topo.max_steps)
                idle_since = time.monotonic()
            if job is None and version < topo.max_steps:
                stale = queue.drop_stale(version)
                if stale:
                    shell.metrics.inc("stale_dropped", len(stale))
                    consumed_ids.update((t.traj_id, None) for t in stale)
                    count(stale, 1)
                    shell.publish(m.TOPIC_TRAJ_ACK, m.TrajAck(trainer_version=version, consumed=[],
                                                              stale=[t.traj_id for t in stale], duplicate=[]))
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
                    save = topo.logging.save_interval and (v + 1) % topo.logging.save_interval == 0
                    evaluate_now = evaluator is not None and (v + 1) % topo.trainer_engine.eval_interval == 0
                    ids_then = list(consumed_ids) + [t.traj_id for t in batch]

                    def step(batch=batch, v=v, wait=wait, hist=hist, save=save, evaluate_now=evaluate_now,
                             ids_then=ids_then):
                        stats = work(batch, v, wait, hist)
                        if evaluate_now:
                            stats.update(evaluator(v + 1))
                        if save:
                            engine.save_checkpoint(ckpt_dir / f"step_{v + 1}", v + 1, ids_then)
                        return stats

                    job = (pool.submit(step), batch, time.monotonic())
            if time.monotonic() - last_state >= HEARTBEAT_INTERVAL_S:
                publish_state()  # a lost report heals; the bus caches the latest for late joiners
            shell.metrics.gauge("busy", 1.0 if job is not None else 0.0)
            poller.poll(POLL_MS if job is None else 5)
        if version >= topo.max_steps:
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
        steps_file.close()
        shell.close()
    return 0
