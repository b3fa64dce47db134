"""Tool-call and reasoning formats per model family, through the real gateway on loopback and the stock
openai / anthropic SDKs: Hermes/Qwen2.5 ``<tool_call>`` blocks, Llama 3.1 JSON calls, Mistral
``[TOOL_CALLS] [...]`` and the ``<think>`` reasoning split (Qwen3), streamed and not, on tiny stand-ins
built locally with each family's real chat template (tests/family_models.py) and on SmolLM2's real
tokenizer. The format is read from the template, and GatewayConfig.tool_parser / reasoning_parser
override it. Whatever the parse, the recorded trajectory is the exact sampled ids.

Scripted replies (a policy that says what it is told, as token ids of the family's tokenizer) show each
format's parse; the random family models, sampled greedily, show that a stream adds up to the
unstreamed reply and that the record is what the engine sampled, whatever that text is.

    .venv/bin/python -m pytest tests/test_gateway_parsers.py -q
"""

from __future__ import annotations

import json

import anthropic
import numpy as np
import pytest

import tests.test_gateway_openai as gwt
from tests.family_models import family_model, family_tokenizer
from tests.test_gateway_stream import StreamingScript
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

pytestmark = pytest.mark.timeout(120)

POLICY = gwt.POLICY
WEATHER = gwt.WEATHER
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                         "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
ANTHROPIC_TOOLS = [{"name": f["function"]["name"], "description": f["function"]["description"],
                    "input_schema": f["function"]["parameters"]} for f in (WEATHER, TIME)]

HERMES_ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
MISTRAL_ONE = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'

# family -> (a reply with text and two calls, the content the client gets, a reply with one call)
REPLIES = {
    "qwen2.5": ('Let me check.\n' + HERMES_ONE + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
                "Let me check.", HERMES_ONE),
    "llama3.1": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                 '{"name": "get_time", "parameters": {}}', None, LLAMA_ONE),
    "mistral": ('Let me check.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]', "Let me check.", MISTRAL_ONE),
}
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.fixture
def family_gateway(monkeypatch):
    """``family_gateway(tokenizer, backend, **GatewayConfig fields)``: the real gateway (test_gateway_openai's
    Server) with that tokenizer, for its template and for the scripted backend's ids."""
    servers = []

    def start(tok, backend, **cfg):
        monkeypatch.setattr(gwt, "tokenizer", lambda: tok)
        servers.append(gwt.Server(backend=backend, **cfg))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or []]


def streamed(client, **kw):
    """(content, reasoning, tool calls, finish) of a streamed chat completion, from its deltas."""
    content, reasoning, calls, finish = [], [], [], None
    for chunk in client.chat.completions.create(model=POLICY, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return "".join(content), "".join(reasoning), calls, finish


def sampled_ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


# -- each family's tool-call format ---------------------------------------------------------------------

@pytest.mark.parametrize("family", list(REPLIES))
def test_each_familys_tool_calls_come_back_as_tool_calls_streamed_and_not_and_the_record_is_the_sampled_ids(
        family_gateway, family):
    tok = family_tokenizer(family)
    reply, content, _ = REPLIES[family]
    gw = family_gateway(tok, StreamingScript([reply, reply]))
    s = gw.open_session()
    r = gw.client(key=s["api_key"]).chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER, TIME])
    msg = r.choices[0].message
    assert calls_of(msg.tool_calls) == CALLS and msg.content == content
    assert r.choices[0].finish_reason == "tool_calls"
    if family == "mistral":  # Mistral's template refuses any other id shape when the calls come back
        assert all(len(c.id) == 9 and c.id.isalnum() for c in msg.tool_calls)

    text, _, deltas, finish = streamed(gw.client(), messages=ASK, tools=[WEATHER, TIME])
    assert text == (content or "") and finish == "tool_calls"
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == CALLS

    gw.post(f"/rl/sessions/{s['session_id']}/end")
    [t] = gw.emitted
    prompt, comp = gw.backend.history[0]
    assert t.prompt_ids.tolist() == prompt.tolist()
    assert t.output_ids.tolist() == comp.output_ids.tolist() == sampled_ids(tok, reply)  # markers included


@pytest.mark.parametrize("family", list(REPLIES))
def test_a_familys_tool_call_sent_back_continues_the_recorded_tokens(family_gateway, family):
    tok = family_tokenizer(family)
    backend = StreamingScript([REPLIES[family][2], "It is sunny."])
    gw = family_gateway(tok, backend)
    s = gw.open_session()
    client = gw.client(key=s["api_key"])
    r = client.chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER])
    msg = r.choices[0].message
    assert calls_of(msg.tool_calls) == CALLS[:1]
    history = [*ASK, msg.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"}]
    assert client.chat.completions.create(model=POLICY, messages=history, tools=[WEATHER]).choices[0].message.content \
        == "It is sunny."
    (p1, c1), (p2, _) = backend.history
    assert p2[:p1.size + c1.output_ids.size].tolist() == [*p1.tolist(), *c1.output_ids.tolist()]
    assert "sunny" in tok.decode(p2[p1.size + c1.output_ids.size:])
    gw.post(f"/rl/sessions/{s['session_id']}/end")
    [t] = gw.emitted  # one trajectory: the second turn extended the first
    assert t.meta["turns"] == 2


@pytest.mark.parametrize("family", list(REPLIES))
def test_the_anthropic_sdk_gets_each_familys_calls_as_tool_use_blocks_streamed_and_not(family_gateway, family):
    tok = family_tokenizer(family)
    reply, content, _ = REPLIES[family]
    gw = family_gateway(tok, StreamingScript([reply, reply]))
    client = anthropic.Anthropic(base_url=gw.url, api_key=gwt.ADMIN, max_retries=0, timeout=30)
    kw = dict(model=POLICY, max_tokens=200, tools=ANTHROPIC_TOOLS, messages=ASK)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    for msg in (whole, final):
        assert msg.stop_reason == "tool_use"
        assert [b.text for b in msg.content if b.type == "text"] == ([content] if content else [])
        assert [(b.name, b.input) for b in msg.content if b.type == "tool_use"] == CALLS


# -- the format is read from the template; the knob overrides it ---------------------------------------

def test_the_tool_format_is_read_from_the_template_and_the_knob_overrides_it(family_gateway):
    llama = family_tokenizer("llama3.1")
    auto = family_gateway(llama, gwt.ScriptedBackend([HERMES_ONE, LLAMA_ONE]))
    r = auto.client().chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER])
    assert r.choices[0].message.content == HERMES_ONE and not r.choices[0].message.tool_calls  # not Llama's format
    r = auto.client().chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER])
    assert calls_of(r.choices[0].message.tool_calls) == CALLS[:1]

    knob = family_gateway(llama, gwt.ScriptedBackend([HERMES_ONE, LLAMA_ONE]), tool_parser="hermes")
    r = knob.client().chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER])
    assert calls_of(r.choices[0].message.tool_calls) == CALLS[:1]
    r = knob.client().chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER])
    assert r.choices[0].message.content == LLAMA_ONE and not r.choices[0].message.tool_calls

    mistral = family_gateway(family_tokenizer("qwen2.5"), gwt.ScriptedBackend([MISTRAL_ONE, MISTRAL_ONE]))
    r = mistral.client().chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER])
    assert not r.choices[0].message.tool_calls  # Qwen's template: hermes
    knob = family_gateway(family_tokenizer("qwen2.5"), gwt.ScriptedBackend([MISTRAL_ONE]), tool_parser="mistral")
    r = knob.client().chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER])
    assert calls_of(r.choices[0].message.tool_calls) == CALLS[:1]


THOUGHT = "The user wants the weather.\nI will answer from memory."
THINKING_REPLY = f"<think>\n{THOUGHT}\n</think>\n\nIt is sunny in Paris."


def test_reasoning_is_split_when_the_template_knows_think_and_the_knob_overrides_it(family_gateway):
    qwen3, qwen25 = family_tokenizer("qwen3"), family_tokenizer("qwen2.5")
    r = family_gateway(qwen3, gwt.ScriptedBackend([THINKING_REPLY])).client().chat.completions.create(
        model=POLICY, messages=ASK)
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert r.choices[0].message.reasoning_content == THOUGHT
    r = family_gateway(qwen3, gwt.ScriptedBackend([THINKING_REPLY]), reasoning_parser="none").client() \
        .chat.completions.create(model=POLICY, messages=ASK)
    assert r.choices[0].message.content == THINKING_REPLY and getattr(r.choices[0].message, "reasoning_content",
                                                                      None) is None
    r = family_gateway(qwen25, gwt.ScriptedBackend([THINKING_REPLY])).client().chat.completions.create(
        model=POLICY, messages=ASK)
    assert r.choices[0].message.content == THINKING_REPLY  # Qwen2.5's template has no <think>
    r = family_gateway(qwen25, gwt.ScriptedBackend([THINKING_REPLY]), reasoning_parser="think").client() \
        .chat.completions.create(model=POLICY, messages=ASK)
    assert r.choices[0].message.reasoning_content == THOUGHT


# -- the reasoning split, streamed and not --------------------------------------------------------------

def test_reasoning_content_streams_apart_from_the_content_and_adds_up_to_the_unstreamed_reply(family_gateway):
    tok = family_tokenizer("qwen3")
    reply = f"<think>\n{THOUGHT}\n</think>\n\n" + HERMES_ONE
    gw = family_gateway(tok, StreamingScript([THINKING_REPLY, THINKING_REPLY, reply, reply]))
    s = gw.open_session()
    whole = gw.client(key=s["api_key"]).chat.completions.create(model=POLICY, messages=ASK).choices[0]
    content, reasoning, _, finish = streamed(gw.client(), messages=ASK)
    assert (content, reasoning, finish) == (whole.message.content, whole.message.reasoning_content, "stop")
    assert reasoning == THOUGHT and "<think>" not in content + reasoning and "</think>" not in content + reasoning

    # reasoning, then a call: no content at all
    called = gw.client().chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER]).choices[0]
    assert called.message.reasoning_content == THOUGHT and called.message.content is None
    assert calls_of(called.message.tool_calls) == CALLS[:1]
    content, reasoning, deltas, finish = streamed(gw.client(), messages=ASK, tools=[WEATHER])
    assert (content, reasoning, finish) == ("", THOUGHT, "tool_calls")
    assert [d.function.name for d in deltas] == ["get_weather"]

    gw.post(f"/rl/sessions/{s['session_id']}/end")
    [t] = gw.emitted
    assert t.output_ids.tolist() == sampled_ids(tok, THINKING_REPLY)  # the reasoning is recorded, as sampled


def test_the_anthropic_sdk_gets_reasoning_as_a_thinking_block_streamed_and_not_unless_disabled(family_gateway):
    gw = family_gateway(family_tokenizer("qwen3"), StreamingScript([THINKING_REPLY] * 3))
    client = anthropic.Anthropic(base_url=gw.url, api_key=gwt.ADMIN, max_retries=0, timeout=30)
    whole = client.messages.create(model=POLICY, max_tokens=200, messages=ASK)
    thoughts = []
    with client.messages.stream(model=POLICY, max_tokens=200, messages=ASK) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                thoughts.append(event.delta.thinking)
        final = stream.get_final_message()
    for msg in (whole, final):
        assert [b.type for b in msg.content] == ["thinking", "text"]
        assert msg.content[0].thinking == THOUGHT and msg.content[1].text == "It is sunny in Paris."
    assert "".join(thoughts) == THOUGHT
    off = client.messages.create(model=POLICY, max_tokens=200, messages=ASK, thinking={"type": "disabled"})
    assert [(b.type, b.text) for b in off.content] == [("text", "It is sunny in Paris.")]


# -- random family models: the stream is the reply, the record is what was sampled ------------------------

@pytest.mark.parametrize("family", ["qwen2.5", "llama3.1", "mistral"])
def test_a_random_family_model_streams_its_unstreamed_reply_and_records_exactly_what_it_sampled(family_gateway,
                                                                                                 family):
    from areal_bus.engines.torch_engine import TorchRolloutEngine
    from nodes.gateway.backend import LocalEngineBackend
    from nodes.gateway.chat import ChatRenderer

    tok = family_tokenizer(family)
    backend = LocalEngineBackend(TorchRolloutEngine(family_model(family, tok), max_batch=2, max_len=1024,
                                                    tokenizer=tok), keep_history=True)
    gw = family_gateway(tok, backend, max_context_tokens=1024)
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=POLICY, messages=ASK, tools=[WEATHER], tool_choice=named, temperature=0, max_tokens=24)
    a, b = gw.open_session(), gw.open_session()
    whole = gw.client(key=a["api_key"]).chat.completions.create(**kw).choices[0]
    content, _, deltas, _ = streamed(gw.client(key=b["api_key"]), **{k: v for k, v in kw.items() if k != "model"})
    assert content == (whole.message.content or "")
    assert calls_of(deltas) == calls_of(whole.message.tool_calls)
    for s in (a, b):
        gw.post(f"/rl/sessions/{s['session_id']}/end")
    forced = ChatRenderer(tok).encode(gw.gateway.chat.shaper.formats.tools.forced_prefix("get_weather"))
    (p1, c1), (p2, c2) = backend.history
    assert p1.tolist() == p2.tolist() and c1.output_ids.tolist() == c2.output_ids.tolist()  # greedy: one path
    for t in gw.emitted:
        assert t.prompt_ids.tolist() == p1.tolist() and t.prompt_ids[-len(forced):].tolist() == forced
        assert t.output_ids.tolist() == c1.output_ids.tolist() and np.all(t.loss_mask == 1)
        np.testing.assert_array_equal(t.logprobs, c1.logprobs)


# -- SmolLM2's real tokenizer -----------------------------------------------------------------------------

def test_smollm2s_real_bpe_gets_hermes_calls_and_the_think_split_under_the_knob(family_gateway, smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    reply = f"<think>\n{THOUGHT}\n</think>\n\n" + HERMES_ONE
    auto = family_gateway(tok, StreamingScript([reply]))  # its template shows neither format: hermes, no split
    r = auto.client().chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER]).choices[0]
    assert calls_of(r.message.tool_calls) == CALLS[:1] and r.message.content == f"<think>\n{THOUGHT}\n</think>"

    gw = family_gateway(tok, StreamingScript([reply, reply]), reasoning_parser="think")
    s = gw.open_session()
    whole = gw.client(key=s["api_key"]).chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER])
    msg = whole.choices[0].message
    assert msg.reasoning_content == THOUGHT and msg.content is None and calls_of(msg.tool_calls) == CALLS[:1]
    content, reasoning, deltas, finish = streamed(gw.client(), messages=ASK, tools=[WEATHER])
    assert (content, reasoning, finish) == ("", THOUGHT, "tool_calls") and calls_of(deltas) == CALLS[:1]
    gw.post(f"/rl/sessions/{s['session_id']}/end")
    [t] = gw.emitted
    assert t.output_ids.tolist() == sampled_ids(tok, reply)
    assert len(tok.encode(reply, add_special_tokens=False)) > 20  # real BPE pieces, cut up by the stream
