"""Live streaming: text reaches the client while the policy is still generating it, through the real
openai and anthropic SDKs (gateway on loopback, the tiny policy in LocalEngineBackend) and across
processes (a rollout node's PartialCompletions to the gateway's bus backend); what is streamed always
adds up to the final reply.

    .venv/bin/python -m pytest tests/test_gateway_stream.py -q
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_bus.wire.codec import Encoder, decode
from areal_bus.engines.torch_engine import TorchRolloutEngine
from areal_bus.wire.messages import Completion, PartialCompletion
from areal_bus.runtime.metrics import Metrics
from nodes.gateway.backend import LocalEngineBackend, SamplingParams
from nodes.gateway.bus_backend import BusBackend, StreamBroken
from nodes.gateway.chat import ChatRenderer, parse_tool_calls
from nodes.gateway.live import TextFeed
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)
from tests.test_gateway_openai import (ADMIN, GAME, POLICY, TEN, WEATHER, ScriptedBackend, gateway,  # noqa: F401
                                      policy, tokenizer)


# -- TextFeed: what is sent is always the start of the final content ----------------------------------

def _byte_decode(ids) -> str:  # a byte-level tokenizer: one id per UTF-8 byte, so characters split across ids
    return bytes(ids).decode("utf-8", errors="replace")


def _final(text: str, stops: list[str], tools: bool) -> str | None:
    """The content the gateway returns for ``text`` (as Shaper.postprocess makes it)."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    if hits:
        text = text[:min(hits)]
    return parse_tool_calls(text)[0] if tools else text


PIECES = ["hello", " ", "wörld", "🙂", "\n", "STOP", "<tool_call>", '{"name": "f", "arguments": {}}', "</tool_call>",
          "<tool", "ST", "  "]


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(PIECES), max_size=12), cuts=st.lists(st.integers(1, 7), max_size=40),
       stops=st.sampled_from([[], ["STOP"], ["STOP", "\n\n"]]), tools=st.booleans())
def test_streamed_deltas_and_the_rest_always_add_up_to_the_final_content(parts, cuts, stops, tools):
    text = "".join(parts)
    ids = list(text.encode())
    feed, sent, at = TextFeed(_byte_decode, stops, tools), [], 0
    for n in cuts:
        if at >= len(ids):
            break
        sent.append(feed.add(at, ids[at:at + n]))
        at += n
    assert feed.done or feed._decoded() == _byte_decode(ids[:at])  # decoded a window at a time, the same text
    content = _final(_byte_decode(ids[:at]), stops, tools)
    assert "".join(sent) + feed.rest(content) == (content or "")
    assert not feed.mismatched
    assert "\ufffd" not in "".join(sent)  # never half a character


def test_renderer_decodes_exactly_as_the_tokenizer_does():
    tok = tokenizer()
    renderer = ChatRenderer(tok)
    assert renderer._fast_decode is not None  # the shipped tokenizer takes the direct path
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 7, 50, 300):
        ids = rng.integers(0, len(tok), n)
        assert renderer.decode(ids) == renderer.decode(ids.tolist()) == tok.decode(ids.tolist(), skip_special_tokens=True)
    # The feed decodes a window at a time: the same text as decoding the whole reply.
    ids = rng.integers(0, len(tok), 400).tolist()
    feed, at = TextFeed(renderer.decode, [], tools=False), 0
    while at < len(ids):
        n = int(rng.integers(1, 9))
        feed.add(at, ids[at:at + n])
        at += n
        assert feed._decoded() == renderer.decode(ids[:at])


def test_feed_holds_back_a_possible_stop_string_until_it_is_ruled_out():
    feed = TextFeed(_byte_decode, ["END"], tools=False)
    assert feed.add(0, list(b"abcE")) == "abc"
    assert feed.add(4, list(b"N")) == ""
    assert feed.add(5, list(b"x")) == "ENx"
    assert feed.add(6, list(b" END more")) == " "  # the stop string came: nothing after it is content


def test_a_dropped_report_sends_nothing_more_and_the_final_reply_fills_in():
    feed = TextFeed(_byte_decode, [], tools=False)
    assert feed.add(0, list(b"ab")) == "ab"
    assert feed.add(5, list(b"fg")) == ""  # tokens 2..4 never arrived
    assert feed.rest("abcdefg") == "cdefg"


# -- through the SDKs: the first text arrives while the engine is held mid-generation -----------------

class HeldEngine(TorchRolloutEngine):
    """The tiny policy that stops stepping once a request has HOLD_AT tokens, until ``release`` is set:
    a client that sees text before then got it live, not after the completion."""

    HOLD_AT = 6

    def __init__(self):
        super().__init__(policy(), max_batch=8, max_len=512, eos_token_ids=[])  # no eos: every reply runs long
        self.release = threading.Event()

    def step(self):
        if any(s.n_out >= self.HOLD_AT for s in self._running.values()) and not self.release.is_set():
            if not self.release.wait(30):
                raise AssertionError("the test never released the engine")
        return super().step()


@pytest.mark.timeout(60)
def test_openai_sdk_stream_delivers_text_while_the_policy_is_still_generating(gateway):
    engine = HeldEngine()
    gw = gateway(backend=LocalEngineBackend(engine))
    sess = gw.open_session()
    client = gw.client(sess["api_key"])
    stream = client.chat.completions.create(model=POLICY, messages=TEN, max_tokens=40, temperature=1.0, stream=True,
                                            stream_options={"include_usage": True})
    texts, early = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if early is None:
                early = not engine.release.is_set()  # this text came while the engine was held
                engine.release.set()
            texts.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert early is True  # text before the release: the engine could not have finished the reply
    assert usage.completion_tokens == 40
    record = gw.call(lambda: gw.gateway.store.get(sess["session_id"]).branches[0])
    comp = record.parts[-1][1]
    assert "".join(texts) == tokenizer().decode(comp.output_ids.tolist(), skip_special_tokens=True)
    # The streamed turn's response id names its recorded completion, for a per-completion reward.
    r = gw.post(f"/rl/sessions/{sess['session_id']}/reward", {"reward": 1.0, "completion_id": chunk.id},
                key=sess["api_key"])
    assert r.status_code == 200 and r.json()["completion_index"] == 0, r.text


@pytest.mark.timeout(60)
def test_anthropic_sdk_stream_delivers_text_while_the_policy_is_still_generating(gateway):
    import anthropic

    engine = HeldEngine()
    gw = gateway(backend=LocalEngineBackend(engine))
    client = anthropic.Anthropic(base_url=gw.url, api_key=ADMIN, max_retries=0)
    early = None
    with client.messages.stream(model=POLICY, max_tokens=40, messages=[{"role": "user", "content": GAME}]) as stream:
        for text in stream.text_stream:
            if text and early is None:
                early = not engine.release.is_set()
                engine.release.set()
        final = stream.get_final_message()
    assert early is True
    assert final.usage.output_tokens == 40 and final.stop_reason == "max_tokens"
    assert final.content[0].type == "text" and final.content[0].text


class StreamingScript(ScriptedBackend):
    """ScriptedBackend that reports its reply's tokens three at a time before returning it, as a rollout
    worker does for a streamed request."""

    streams_tokens = True

    async def generate(self, session_id, prompt_ids, params, on_tokens=None):
        comp = await super().generate(session_id, prompt_ids, params)
        ids = comp.output_ids.tolist()
        for start in range(0, len(ids) - 1, 3):  # all but the last token, then the whole completion
            if on_tokens is not None:
                on_tokens(start, np.asarray(ids[start:min(start + 3, len(ids) - 1)], np.int32))
            await asyncio.sleep(0)
        return comp


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_streamed_text_then_tool_call_matches_the_unstreamed_reply_in_both_sdks(gateway):
    import anthropic

    reply = "Let me check the weather. " + CALL
    gw = gateway(backend=StreamingScript([reply] * 3))
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    whole = gw.client().chat.completions.create(model=POLICY, messages=msgs, tools=[WEATHER]).choices[0].message
    chunks = list(gw.client().chat.completions.create(model=POLICY, messages=msgs, tools=[WEATHER], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert text == whole.content == "Let me check the weather." and len(pieces) > 1  # sent in several pieces
    assert "<tool" not in text and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    client = anthropic.Anthropic(base_url=gw.url, api_key=ADMIN, max_retries=0)
    tools = [{"name": "get_weather", "description": "Weather in a city.",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    with client.messages.stream(model=POLICY, max_tokens=200, tools=tools, messages=msgs) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[0].text == "Let me check the weather." and final.content[1].input == {"city": "Paris"}


def test_a_stream_whose_engine_cannot_report_tokens_is_sent_whole_at_the_end(gateway):
    gw = gateway()
    gw.backend.streams_tokens = False  # as a backend without peek
    chunks = list(gw.client().chat.completions.create(model=POLICY, messages=TEN, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "10"


# -- across processes: a rollout node's partial completions reach the gateway's bus backend ------------

class FakeWorker(threading.Thread):
    """A worker's gateway side that streams a fixed reply in two partials, then the completion."""

    def __init__(self, ctx, endpoint, node_id, finish=True):
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.identity, self.sock.linger = node_id.encode(), 0
        self.sock.connect(endpoint)
        self.enc, self.node_id, self.finish = Encoder(node_id), node_id, finish
        self.got = threading.Event()

    def run(self):
        try:
            if not self.sock.poll(10_000):
                return
            _, req = decode(self.sock.recv_multipart())
            assert req.stream
            ids = np.array([5, 6, 7, 8], np.int32)
            for start, stop in ((0, 1), (1, 3)):
                self.sock.send_multipart(self.enc.encode(PartialCompletion(req.request_id, start, ids[start:stop])))
            self.got.set()
            if self.finish:
                self.sock.send_multipart(self.enc.encode(Completion(
                    req.request_id, req.episode_id, 0, self.node_id, ids, np.zeros(4, np.float32),
                    np.zeros(4, np.int32), "stop")))
            else:
                self.sock.poll(3000)
        finally:
            self.sock.close(0)


@pytest.mark.timeout(30)
def test_bus_backend_hands_partials_to_on_tokens_and_a_broken_stream_fails(ctx, endpoint):
    ep = endpoint("gwork")
    backend = BusBackend(ctx, ep, Encoder("gw"), Metrics())

    async def scenario():
        backend.start()
        seen = []
        w = FakeWorker(ctx, ep, "rollout-0")
        w.start()
        await asyncio.sleep(0.3)
        backend.set_live({"rollout-0"})
        comp = await backend.generate("s", np.array([1, 2], np.int32), SamplingParams(max_tokens=4),
                                      on_tokens=lambda start, ids: seen.append((start, ids.tolist())))
        assert seen == [(0, [5]), (1, [6, 7])] and comp.output_ids.tolist() == [5, 6, 7, 8]
        # A worker that dies after streaming: the request fails instead of moving to another worker.
        dead = FakeWorker(ctx, ep, "rollout-1", finish=False)
        dead.start()
        await asyncio.sleep(0.3)
        backend.set_live({"rollout-1"})
        task = asyncio.ensure_future(backend.generate("t", np.array([1], np.int32), SamplingParams(max_tokens=4),
                                                      on_tokens=lambda start, ids: None))
        while not dead.got.is_set():
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        backend.set_live({"rollout-0"})  # rollout-1 left the hub's list
        with pytest.raises(StreamBroken):
            await task
        w.join(5)
        dead.join(5)

    try:
        asyncio.run(scenario())
    finally:
        backend.close()


@pytest.fixture(scope="module")
def rollout_node():
    """Real bus, weights and rollout node processes (bench/gateway.py's system, gateway node left out):
    (topology, system). Each test binds the gateway's side of gwork itself (a BusBackend)."""
    from bench.gateway import System, topology
    from areal_bus.config.topology import parse_topology

    work = Path(tempfile.mkdtemp(prefix="ab-st-", dir="/tmp"))
    token = secrets.token_urlsafe(16)
    topo_dict = topology(work, 0)
    topo_dict["nodes"]["gateway"]["replicas"] = 1
    (work / "topology.yaml").write_text(yaml.safe_dump(topo_dict, sort_keys=False))
    topo = parse_topology(json.loads(json.dumps(topo_dict).replace("${AREAL_BUS_ADMIN_TOKEN}", token)),
                          str(work / "topology.yaml"))
    system = System(work / "topology.yaml", work, dict(os.environ, AREAL_BUS_ADMIN_TOKEN=token, PYTHONUNBUFFERED="1"))
    try:
        for kind in ("bus", "weights", "rollout"):
            system.start(kind)
        yield topo, system
    finally:
        system.stop()
    shutil.rmtree(work, ignore_errors=True)


def _ask_node(topo, system, calls):
    """Run ``await calls(backend)`` against the rollout node once its DEALER has connected to us."""
    from bench.gateway import WORKER

    ctx = zmq.Context()
    backend = BusBackend(ctx, topo.endpoint("gwork", 0), Encoder("test"), Metrics())
    prompt = np.asarray(ChatRenderer(tokenizer()).prompt_ids(TEN, None), np.int32)

    async def run():
        for _ in range(600):  # until the worker's DEALER is connected (it starts after torch imports)
            backend.set_live({WORKER})
            try:
                await backend.generate("", prompt, SamplingParams(max_tokens=1, temperature=0.0))
                break
            except Exception:  # NoWorker while the worker is not up yet
                system.check()
                await asyncio.sleep(0.3)
        else:
            raise AssertionError(f"the rollout worker never answered; logs in {system.work}")
        return await calls(backend, prompt)

    try:
        return asyncio.run(run())
    finally:
        backend.close()
        ctx.destroy(linger=0)


@pytest.mark.timeout(240)
def test_a_rollout_node_streams_its_first_token_before_the_completion(rollout_node):
    async def calls(backend, prompt):
        seen = []
        comp = await backend.generate("", prompt, SamplingParams(max_tokens=8, temperature=0.0),
                                      on_tokens=lambda start, ids: seen.append((start, ids.tolist())))
        return comp, seen

    comp, seen = _ask_node(*rollout_node, calls)
    assert comp.output_ids.size >= 2, comp  # "10" then eos at temperature 0
    assert seen and seen[0] == (0, [int(comp.output_ids[0])])
    got = [t for _, ids in seen for t in ids]
    assert got == comp.output_ids[:len(got)].tolist() and len(got) < comp.output_ids.size


@pytest.mark.timeout(240)
def test_a_rollout_node_answers_a_request_it_cannot_run_and_keeps_serving(rollout_node):
    topo, system = rollout_node

    async def calls(backend, prompt):
        too_long = np.ones(topo.rollout_engine.max_len + 5, np.int32)
        with pytest.raises(ValueError, match="prompt of"):
            await backend.generate("", too_long, SamplingParams(max_tokens=4))
        return await backend.generate("", prompt, SamplingParams(max_tokens=4, temperature=0.0))

    comp = _ask_node(topo, system, calls)
    assert comp.output_ids.size >= 1 and not comp.error
    system.check()  # the worker is still the one that started: it did not exit
