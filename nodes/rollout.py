"""Rollout node: a generation worker. Pulls requests, decodes them in a continuous batch, tags every
token with the policy version that produced it, and sends each completion back to the agent that
asked for it.

The loop has one rhythm, the engine's decode step. Between two steps (the safe point) the worker
drains the hub, switches to a newly announced policy version without stopping the running batch
(tokens after the switch carry the new version), and lets new requests join while it has free slots.
It reads work only when it has a free slot and its outbox has room, so a slow agent turns into
backpressure, never into loss. Its heartbeat lists the requests it holds, so the agent can reissue
them if this worker dies. A gateway request marked ``stream`` also gets its tokens as they are made
(PartialCompletion), for the gateway to stream to its client.

Run: areal-bus node rollout --topology topology/default.yaml --replica 0
"""

from __future__ import annotations

import numpy as np
import zmq

from areal_bus import messages as m
from areal_bus.channels import Receiver, ReliableSender, open_socket
from areal_bus.constants import POLL_MS, WORK_HWM
from areal_bus.engines.base import TokenStreams
from areal_bus.engines.sim import SimRolloutEngine
from areal_bus.node import NodeShell
from areal_bus.version import PolicyVersion


def make_engine(topo, worker: str, replica: int, base=None):
    """The configured engine, and a function to let go of the weight buffers up to a version."""
    cfg = topo.rollout_engine
    if cfg.kind == "sim":
        return SimRolloutEngine(cfg, worker), lambda version: None
    if cfg.kind == "vllm":
        from areal_bus.engines.vllm_engine import engine_from_topology

        # vLLM copies each version into its own parameters and its worker lets the buffer go itself.
        return engine_from_topology(topo, worker, replica, base), lambda version: None
    from areal_bus.engines.torch_engine import TorchRolloutEngine
    from areal_bus.weights_shm import ShmWeightReader

    path = topo.model_path(base)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model.path {path} holds no checkpoint (config.json); build the default with "
                                f"`python scripts/warmstart.py --out {topo.model.path}` or point model.path at one")
    import torch

    torch.set_num_threads(topo.model.threads)
    reader = ShmWeightReader(topo.shm_name(base))
    cuda_reader = None

    def load_weights(location: str):
        # "cuda:..." when the trainer's writer is on a GPU (CUDA IPC, handles opened once), else shared memory.
        nonlocal cuda_reader
        if not location.startswith("cuda:"):
            return reader.open(location)
        from areal_bus.weights_cuda import CudaWeightReader, handles_path, load_handles

        path = handles_path(topo.ipc_dir(base), topo.shm_name(base))
        stamp = path.stat().st_mtime_ns
        if cuda_reader is None or cuda_reader[0] != stamp:  # a restarted trainer exports new buffers
            cuda_reader = (stamp, CudaWeightReader(load_handles(path)))
        return cuda_reader[1].open(location)

    engine = TorchRolloutEngine(path, max_batch=cfg.max_batch, max_len=cfg.max_len, device=topo.model.device,
                                dtype=topo.model.dtype, seed=topo.model.seed * 1000 + replica, worker=worker,
                                weight_loader=load_weights)

    def release_upto(version: int) -> None:
        # The engine copies weights into its own parameters at the swap: older buffers are free now.
        for held in reader.held:
            if held <= version:
                reader.release(held)

    return engine, release_upto


class StepLog:
    """Rollout log lines: one per trigger_batch_size / rollout_workers completions of this worker, so
    all workers together log about once per update. ``step`` is the train step the samples are
    meant for (their slot // batch): rollout runs ahead of training by up to the staleness bound."""

    def __init__(self, topo):
        self.every = max(1, topo.effective_trigger // max(1, topo.replicas("rollout")))
        self.batch = topo.effective_trigger  # admission slots per policy version
        self.generated = self.tokens = 0
        self.step = 0

    def add(self, comp: m.Completion, version: int) -> dict | None:
        self.generated += 1
        self.tokens += int(comp.output_ids.size)
        # Gateway requests carry no admission slot (ticket 0): the version serving them stands in.
        self.step = max(self.step, comp.ticket // self.batch, version)
        if self.generated < self.every:
            return None
        line = {"step": self.step, "generated": self.generated, "tokens": self.tokens}
        self.generated = self.tokens = 0
        return line


def run(topo, replica: int = 0, base=None) -> int:
    shell = NodeShell(topo, "rollout", replica, base=base, watch=("agent", "weights"), topics=(m.TOPIC_VERSION,))
    shell.install_signal_handlers()
    n_agents = topo.replicas("agent")
    work = open_socket(shell.ctx, zmq.PULL, [shell.endpoint("work", i) for i in range(n_agents)], bind=False,
                       hwm=WORK_HWM)
    replies = [ReliableSender(open_socket(shell.ctx, zmq.PUSH, shell.endpoint("replies", i), bind=False,
                                          hwm=topo.queue_max_size),
                              shell.encoder, shell.metrics, f"reply{i}", capacity=topo.rollout_engine.max_batch,
                              track_acks=False)
               for i in range(n_agents)]
    inbox = Receiver(work, shell.metrics, shell.log)
    # Gateways address workers directly (sticky sessions): a DEALER per gateway, named by our node id,
    # carries its requests in and the completions back.
    n_gw = topo.replicas("gateway")
    gsocks = []
    for j in range(n_gw):
        sock = open_socket(shell.ctx, zmq.DEALER, shell.endpoint("gwork", j), bind=False, hwm=topo.queue_max_size,
                           identity=shell.node_id.encode())
        sock.linger = 0
        gsocks.append(sock)
    gw_in = [Receiver(sock, shell.metrics, shell.log) for sock in gsocks]
    gw_out = [ReliableSender(sock, shell.encoder, shell.metrics, f"gw{j}", capacity=topo.rollout_engine.max_batch,
                             track_acks=False) for j, sock in enumerate(gsocks)]
    engine, release_upto = make_engine(topo, shell.node_id, replica, base)
    steplog = StepLog(topo)
    peek = getattr(engine, "peek", None)  # live streaming, where the engine can show a running output
    streams = TokenStreams()  # streamed gateway requests, each with the index of its gateway
    waiting: list[m.GenerateRequest] = []  # requests whose min_version we do not serve yet
    reply_of: dict[str, int] = {}  # request id -> agent replica that asked (-1 - j: gateway j)
    announced = None
    serving = ("", engine.version)  # (lineage, version) of the weights this worker decodes with

    def answer(comp: m.Completion) -> None:
        to = reply_of.pop(comp.request_id, 0)
        streams.discard(comp.request_id)
        (replies[to] if to >= 0 else gw_out[-1 - to]).offer(
            comp.request_id, comp, (int(comp.versions.min(initial=0)),))

    def begin(req: m.GenerateRequest) -> None:
        """Into the running batch, or, for a request the engine cannot run (a prompt longer than its
        cache, ...), an answer saying why: never an exception, which would end this worker and then,
        resent, every other."""
        try:
            engine.add_request(req)
        except ValueError as exc:
            shell.metrics.inc("requests_refused")
            shell.log.warning("request_refused", request=req.request_id, error=str(exc)[:300])
            empty = np.zeros(0, np.int32)
            answer(m.Completion(request_id=req.request_id, episode_id=req.episode_id, ticket=req.ticket,
                                worker=shell.node_id, output_ids=empty, logprobs=np.zeros(0, np.float32),
                                versions=empty, finish_reason="error", error=str(exc)[:1000]))

    shell.announce_start(engine=topo.rollout_engine.kind, max_batch=topo.rollout_engine.max_batch)
    shell.start_heartbeat()
    poller = zmq.Poller()
    poller.register(shell.sub, zmq.POLLIN)
    poller.register(work, zmq.POLLIN)
    for sock in gsocks:
        poller.register(sock, zmq.POLLIN)
    try:
        while not shell.stopping.is_set():
            repeated = False
            for _, msg in shell.drain_hub():
                if isinstance(msg, m.VersionAnnounce):
                    repeated = True
                    if announced is None or (msg.lineage, msg.version) > (announced.lineage, announced.version):
                        announced = msg
            # Safe point: between two decode steps. (lineage, version) only goes up; the version alone
            # goes down when a restarted trainer resumes from its checkpoint as a new lineage.
            if announced is not None and (announced.lineage, announced.version) > serving:
                before = engine.version
                if announced.location:
                    took = engine.swap_weights(announced.version, announced.location)
                    release_upto(max(engine.version, before))
                else:  # nothing to load (simulated weights, or the checkpoint the worker started from)
                    engine.version, took = announced.version, 0.0
                serving = (announced.lineage, engine.version)
                shell.policy = PolicyVersion(*serving)
                shell.publish(m.TOPIC_VERSION_ACK, m.VersionAck(node_id=shell.node_id, version=engine.version,
                                                               switch_seconds=took, lineage=serving[0]))
                shell.metrics.inc("weight_swaps")
            elif repeated and announced is not None and (announced.lineage, announced.version) == serving:
                # The broadcaster repeats the current version every heartbeat; answering each time heals
                # a lost ack and tells a restarted broadcaster what we serve.
                shell.publish(m.TOPIC_VERSION_ACK, m.VersionAck(node_id=shell.node_id, version=engine.version,
                                                               lineage=serving[0]))
            for req in [r for r in waiting if r.min_version <= engine.version]:
                waiting.remove(req)
                begin(req)
            backed_up = any(r.full for r in (*replies, *gw_out))
            # Gateway requests first: a person (or an agent) is waiting on each of them.
            for j, rx in [*enumerate(gw_in), (None, inbox)]:
                while engine.free_slots > len(waiting) and not backed_up:
                    got = rx.recv()
                    if got is None:
                        break
                    req = got[1]
                    if not isinstance(req, m.GenerateRequest) or (j is None and not 0 <= req.reply_to < n_agents):
                        rx.drop("wrong_type" if not isinstance(req, m.GenerateRequest) else "bad_reply_to",
                                type(req).__name__)
                        continue
                    if req.request_id in reply_of:  # a resend of what we already run
                        continue
                    reply_of[req.request_id] = req.reply_to if j is None else -1 - j
                    if req.stream and j is not None and peek is not None:
                        streams.add(req.request_id, j)
                    (waiting.append if req.min_version > engine.version else begin)(req)
            shell.inflight = engine.running_ids + [r.request_id for r in waiting]
            finished = engine.step() if engine.running_ids else []
            for comp in finished:
                answer(comp)
                shell.metrics.inc("samples")
                shell.metrics.inc("tokens", int(comp.output_ids.size))
                line = steplog.add(comp, engine.version)
                if line:
                    shell.log.info("step", **line, version=engine.version)
            for rid, j, start, ids in streams.due(peek) if streams else ():
                # Best effort: a gateway whose queue is full misses this one (due again next step; the
                # Completion that ends the request carries every token anyway).
                part = m.PartialCompletion(request_id=rid, start=start, output_ids=ids)
                try:
                    gsocks[j].send_multipart(shell.encoder.encode(part), flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    shell.metrics.inc("stream.partials_dropped")
                    continue
                streams.mark(rid, start + ids.size)
                shell.metrics.inc("stream.partials")
            for r in (*replies, *gw_out):
                r.flush()
            shell.metrics.gauge("running", len(engine.running_ids))
            shell.metrics.gauge("queue.waiting_version", len(waiting))
            if not engine.running_ids:
                poller.poll(POLL_MS if not any(r.pending for r in (*replies, *gw_out)) else 5)
    finally:
        shell.close()
    return 0
