"""Structured output, top_logprobs, seed and top_k through the gateway's other backend, the bus: the gateway
(make_app on a ``BusBackend``) sends each request over ZeroMQ to a rollout worker's DEALER, which generates
with the torch engine and the shipped tiny model, so grammar, top_logprobs, seed and top_k cross the wire
in GenerateRequest and the alternatives come back in Completion's arrays, as in a real run.

    .venv/bin/python -m pytest tests/test_gateway_structured_bus.py -q
"""

from __future__ import annotations

import threading
import time

import anthropic
import numpy as np
import pytest
import zmq

from areal_bus.runtime.metrics import Metrics
from areal_bus.wire.codec import Encoder, decode
from nodes.gateway.bus_backend import BusBackend
from tests.test_gateway_openai import GAME, POLICY, TEN, Server, policy, tokenizer
from tests.test_gateway_structured_sdk import Guess
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

pytestmark = pytest.mark.timeout(120)


class TorchWorker(threading.Thread):
    """A rollout worker's gateway side: a DEALER named by its node id, generating with the torch engine;
    keeps each request it got and each completion it sent."""

    def __init__(self, ctx: zmq.Context, endpoint: str, node_id: str = "rollout-0"):
        from areal_bus.engines.torch_engine import TorchRolloutEngine

        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.identity = node_id.encode()
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self.engine = TorchRolloutEngine(policy(), max_batch=16, max_len=512, tokenizer=tokenizer(), worker=node_id)
        self.enc = Encoder(node_id)
        self.requests, self.completions = [], []
        self.stop = threading.Event()

    def run(self):
        try:
            while not self.stop.is_set():
                while self.sock.poll(0 if self.engine.free_slots < 16 else 20):
                    _, req = decode(self.sock.recv_multipart())
                    self.requests.append(req)
                    self.engine.add_request(req)
                for comp in self.engine.step() if self.engine.free_slots < 16 else ():
                    self.completions.append(comp)
                    self.sock.send_multipart(self.enc.encode(comp))
        finally:
            self.sock.close(0)


@pytest.fixture
def bus_gateway(ctx, endpoint):
    where = endpoint("gwork")
    backend = BusBackend(ctx, where, Encoder("gw"), Metrics())
    worker = TorchWorker(ctx, where)
    worker.start()
    gw = Server(backend=backend, max_context_tokens=512)
    time.sleep(0.3)  # the DEALER's connect completes (ROUTER_MANDATORY refuses an unconnected peer)
    gw.call(lambda: backend.set_live({"rollout-0": "i0"}))
    yield gw, worker
    gw.call(backend.close)  # on its loop: a zmq.asyncio socket cannot close once the loop is gone
    gw.close()
    worker.stop.set()
    worker.join(5)


def test_a_structured_reply_over_the_bus_is_the_model_and_its_grammar_crossed_the_wire(bus_gateway):
    gw, worker = bus_gateway
    r = gw.client().chat.completions.parse(model=POLICY, messages=TEN, response_format=Guess, temperature=1,
                                           max_tokens=60)
    assert isinstance(r.choices[0].message.parsed, Guess)
    assert worker.requests[-1].grammar and worker.completions[-1].finish_reason == "stop"


def test_top_logprobs_over_the_bus_are_the_workers_arrays(bus_gateway):
    gw, worker = bus_gateway
    r = gw.client().chat.completions.create(model=POLICY, messages=TEN, temperature=1, logprobs=True, top_logprobs=3)
    comp = worker.completions[-1]
    assert worker.requests[-1].top_logprobs == 3 and comp.top_ids.shape == (comp.output_ids.size, 3)
    got = r.choices[0].logprobs.content
    assert got and [[a.token for a in t.top_logprobs] for t in got] == [
        [tokenizer().decode([int(i)]) for i in row] for row in comp.top_ids[:len(got)]]
    assert np.allclose([[a.logprob for a in t.top_logprobs] for t in got], comp.top_logprobs[:len(got)])


def test_the_same_seed_over_the_bus_gives_the_same_replies(bus_gateway):
    gw, worker = bus_gateway
    ask = dict(model=POLICY, messages=[{"role": "user", "content": GAME}], temperature=2, max_tokens=8, n=8, seed=77)
    first = [c.message.content for c in gw.client().chat.completions.create(**ask).choices]
    assert [c.message.content for c in gw.client().chat.completions.create(**ask).choices] == first
    assert sorted(r.seed for r in worker.requests[-8:]) == list(range(77, 85))


def test_anthropic_top_k_over_the_bus_reaches_the_worker_and_samples_the_most_likely(bus_gateway):
    gw, worker = bus_gateway
    client = anthropic.Anthropic(base_url=gw.url, api_key=gw.cfg.admin_token, max_retries=0, timeout=30)
    msgs = [{"role": "user", "content": GAME}]
    greedy = client.messages.create(model=POLICY, max_tokens=8, messages=msgs, extra_body={"temperature": 0})
    top1 = client.messages.create(model=POLICY, max_tokens=8, messages=msgs, extra_body={"temperature": 1, "top_k": 1})
    assert worker.requests[-1].top_k == 1 and top1.content[0].text == greedy.content[0].text
