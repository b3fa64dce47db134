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

import zmq

from areal_bus import messages as m
from areal_bus.admission import is_over_stale, staleness_of
from areal_bus.channels import Receiver, open_socket
from areal_bus.constants import POLL_MS, SEEN_IDS_MAX
from areal_bus.engines.sim import SimTrainEngine
from areal_bus.node import NodeShell


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


def make_engine(topo):
    if topo.trainer_engine.kind == "sim":
        return SimTrainEngine(topo.trainer_engine, topo.train_workers)
    raise ValueError(f"unknown trainer engine {topo.trainer_engine.kind!r}")


def run(topo, replica: int = 0, base=None) -> int:
    shell = NodeShell(topo, "trainer", replica, base=base, watch=("weights",), topics=(m.TOPIC_VERSION,))
    shell.install_signal_handlers()
    pull = open_socket(shell.ctx, zmq.PULL, shell.endpoint("train"), bind=True, hwm=topo.queue_max_size)
    to_weights = open_socket(shell.ctx, zmq.PUSH, shell.endpoint("weights"), bind=False, hwm=16)
    inbox = Receiver(pull, shell.metrics, shell.log)
    queue = TrainQueue(topo.queue_max_size, topo.effective_trigger, topo.global_batch_size,
                       topo.effective_staleness, exact=not topo.is_async)
    engine = make_engine(topo)
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compute")
    version = 0
    steps_path = shell.log_dir / "train_steps.jsonl"
    steps_file = open(steps_path, "a", buffering=1)
    shell.announce_start(engine=topo.trainer_engine.kind, mode="async" if topo.is_async else "sync",
                         trigger=queue.trigger, batch=queue.max_batch, staleness=queue.staleness,
                         max_steps=topo.max_steps)
    shell.start_heartbeat()
    poller = zmq.Poller()
    poller.register(shell.sub, zmq.POLLIN)
    poller.register(pull, zmq.POLLIN)
    job = None  # (future, batch, started)
    idle_since = time.monotonic()
    window = {"t": time.monotonic(), "samples": 0, "tokens": 0}

    def publish_state(finished=False):
        shell.publish(m.TOPIC_RUN, m.RunState(version=version, max_steps=topo.max_steps, finished=finished,
                                              consumed=int(shell.metrics.counters["samples"])))

    try:
        publish_state()
        while not shell.stopping.is_set():
            shell.drain_hub()
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
                location, nbytes = engine.export_weights(version)
                to_weights.send_multipart(shell.encoder.encode(
                    m.WeightsReady(version=version, location=location, nbytes=nbytes, step_seconds=took), (version,)))
                shell.publish(m.TOPIC_TRAJ_ACK, m.TrajAck(trainer_version=version, consumed=[t.traj_id for t in batch],
                                                          stale=[], duplicate=[]))
                tokens = sum(t.num_tokens for t in batch)
                shell.metrics.inc("samples", len(batch))
                shell.metrics.inc("tokens", tokens)
                shell.metrics.inc("busy_seconds", took)
                shell.metrics.inc("steps")
                window["samples"] += len(batch)
                window["tokens"] += tokens
                shell.log.info("step", step=version - 1, updated=len(batch), loss=round(stats["loss"], 4),
                               reward=round(stats.get("reward", 0.0), 4), train_s=round(took, 3))
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
                if version >= topo.max_steps:
                    shell.log.info("run_finished", steps=version, samples=int(shell.metrics.counters["samples"]),
                                   stale_dropped=queue.stale, duplicates=queue.duplicates)
                    break
            if job is None:
                stale = queue.drop_stale(version)
                if stale:
                    shell.metrics.inc("stale_dropped", len(stale))
                    shell.publish(m.TOPIC_TRAJ_ACK, m.TrajAck(trainer_version=version, consumed=[],
                                                              stale=[t.traj_id for t in stale], duplicate=[]))
                    shell.log.warning("stale_dropped", count=len(stale), version=version)
                batch = queue.take_batch(version)
                if batch is not None:
                    hist = collections.Counter(staleness_of(version, t.start_version) for t in batch)
                    for s, c in hist.items():
                        shell.metrics.observe("staleness", s, c)
                    wait = time.monotonic() - idle_since
                    shell.metrics.inc("idle_seconds", wait)
                    v = version

                    def work(batch=batch, v=v, wait=wait, hist=hist):
                        stats = engine.train(batch, v)
                        stats["_wait_s"] = wait
                        stats["_staleness"] = {str(k): c for k, c in sorted(hist.items())}
                        return stats

                    job = (pool.submit(work), batch, time.monotonic())
            shell.metrics.gauge("busy", 1.0 if job is not None else 0.0)
            poller.poll(POLL_MS if job is None else 5)
    finally:
        if job is not None:
            job[0].cancel()
        pool.shutdown(wait=False, cancel_futures=True)
        steps_file.close()
        shell.close()
    return 0
