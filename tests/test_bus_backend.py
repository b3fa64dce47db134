"""The gateway's bus backend against real DEALER peers driven by the simulated rollout engine: requests
reach a live worker, stick to it per session, move to another worker when theirs dies, and fail with
NoWorker (a 503 for the client) when no worker is left."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import zmq

from areal_bus.wire.codec import Encoder, decode
from areal_bus.engines.sim import SimRolloutEngine
from areal_bus.runtime.metrics import Metrics
from areal_bus.config.topology import LengthDistribution, SimRolloutEngineConfig
from nodes.gateway.backend import SamplingParams
from nodes.gateway.bus_backend import BusBackend, NoWorker


class Worker(threading.Thread):
    """A rollout worker's gateway side: a DEALER named by node id that generates with the sim engine."""

    def __init__(self, ctx, endpoint: str, node_id: str, answer: bool = True):
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.identity = node_id.encode()
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self.node_id, self.answer = node_id, answer
        self.engine = SimRolloutEngine(SimRolloutEngineConfig(decode_step_s=0.0, output_len=LengthDistribution(
            dist="fixed", min=1, max=3)), node_id)
        self.seen: list[str] = []
        self.stop = threading.Event()
        self.enc = Encoder(node_id)

    def run(self):
        try:
            while not self.stop.is_set():
                if self.sock.poll(20):
                    _, req = decode(self.sock.recv_multipart())
                    self.seen.append(req.request_id)
                    if self.answer:
                        self.engine.add_request(req)
                for comp in self.engine.step():
                    self.sock.send_multipart(self.enc.encode(comp))
        finally:
            self.sock.close(0)


@pytest.fixture
def setup(ctx, endpoint):
    zmq_ctx, ipc_endpoint = ctx, endpoint("gwork")
    backend = BusBackend(zmq_ctx, ipc_endpoint, Encoder("gw"), Metrics())
    workers = []

    def worker(node_id, answer=True):
        w = Worker(zmq_ctx, ipc_endpoint, node_id, answer)
        w.start()
        workers.append(w)
        return w

    yield backend, worker
    for w in workers:
        w.stop.set()
        w.join(2)
    backend.close()


def _params():
    return SamplingParams(max_tokens=3, temperature=0.0)


async def _wait_connected(backend, names):
    await asyncio.sleep(0.3)  # the DEALERs' connects complete; ROUTER_MANDATORY would refuse before
    backend.set_live(set(names))


@pytest.mark.timeout(20)
def test_a_request_reaches_a_live_worker_and_sessions_stick(setup):
    backend, worker = setup
    a, b = worker("rollout-0"), worker("rollout-1")

    async def main():
        await _wait_connected(backend, {"rollout-0", "rollout-1"})
        prompt = np.arange(5, dtype=np.int32)
        first = await backend.generate("sess-1", prompt, _params())
        for _ in range(3):
            await backend.generate("sess-1", prompt, _params())
        return first

    comp = asyncio.run(main())
    assert comp.output_ids.size == 3 and comp.worker in ("rollout-0", "rollout-1")
    holder = a if comp.worker == "rollout-0" else b
    assert len(holder.seen) == 4  # every turn of the session went to the same worker


@pytest.mark.timeout(20)
def test_a_request_held_by_a_dead_worker_moves_to_a_live_one(setup):
    backend, worker = setup
    worker("rollout-0", answer=False)  # takes the request and never answers, like a worker that died
    live = worker("rollout-1")

    async def main():
        await _wait_connected(backend, {"rollout-0"})
        task = asyncio.create_task(backend.generate("s", np.arange(4, dtype=np.int32), _params()))
        await asyncio.sleep(0.3)
        backend.set_live({"rollout-1"})  # the hub says rollout-0 is gone
        return await asyncio.wait_for(task, 5)

    comp = asyncio.run(main())
    assert comp.worker == "rollout-1" and len(live.seen) == 1


@pytest.mark.timeout(20)
def test_no_worker_left_fails_the_request_instead_of_hanging(setup):
    backend, worker = setup
    worker("rollout-0", answer=False)

    async def main():
        await _wait_connected(backend, {"rollout-0"})
        task = asyncio.create_task(backend.generate("s", np.arange(4, dtype=np.int32), _params()))
        await asyncio.sleep(0.3)
        backend.set_live(set())
        with pytest.raises(NoWorker):
            await asyncio.wait_for(task, 5)

    asyncio.run(main())
