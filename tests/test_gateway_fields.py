"""Every request field is honoured or refused (issue 16 item 3; docs/gateway.md's field table): the stock
openai and anthropic SDKs against the real gateway on loopback, the policy a scripted backend that
replies with exactly the token ids it is told (the shipped tiny model's tokenizer, whose template
ignores tools, so the gateway describes them in Hermes' format and reads Hermes calls back).

Honoured fields show their effect: a forced tool call (tool_choice "required" / a named function,
Anthropic any / tool) comes back as a call of that function, and its opening is given, not sampled:
part of the recorded prompt (a later turn's env tokens, loss 0), the sampled ids after it recorded as
sampled; parallel_tool_calls false (disable_parallel_tool_use) returns and records the first call
only; tool_choice none offers no tools. Refused fields are a 400 naming the field (``param``), and the
session loses nothing.

    .venv/bin/python -m pytest tests/test_gateway_fields.py -q
"""

from __future__ import annotations

import json

import anthropic
import numpy as np
import openai
import pytest

from tests.test_gateway_openai import ADMIN, POLICY, WEATHER, ScriptedBackend, gateway, tokenizer  # noqa: F401
from tests.test_gateway_stream import StreamingScript
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

pytestmark = pytest.mark.timeout(60)

ASK = [{"role": "user", "content": "Weather in Paris?"}]
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                         "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
REQUIRED_OPENING = '<tool_call>\n{"name": "'
NAMED_OPENING = '<tool_call>\n{"name": "get_weather", "arguments": '
ANTHROPIC_TOOLS = [{"name": f["function"]["name"], "description": f["function"]["description"],
                    "input_schema": f["function"]["parameters"]} for f in (WEATHER, TIME)]


def ids(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False)


def eos() -> int:
    return tokenizer().eos_token_id


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or []]


def end(gw, s) -> list:
    before = len(gw.emitted)
    assert gw.post(f"/rl/sessions/{s['session_id']}/end").status_code == 200
    return gw.emitted[before:]


# -- tool_choice ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("choice, opening, rest", [
    ("required", REQUIRED_OPENING, 'get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ({"type": "function", "function": {"name": "get_weather"}}, NAMED_OPENING, '{"city": "Paris"}}\n</tool_call>'),
], ids=["required", "named"])
def test_a_forced_tool_call_comes_back_as_that_call_and_its_opening_is_recorded_as_given(gateway, choice, opening,
                                                                                         rest):
    gw = gateway(backend=ScriptedBackend([rest]))
    s = gw.open_session()
    r = gw.client(key=s["api_key"]).chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER, TIME],
                                                             tool_choice=choice)
    assert calls_of(r.choices[0].message.tool_calls) == [("get_weather", {"city": "Paris"})]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    prompt, comp = gw.backend.history[-1]
    assert prompt[-len(ids(opening)):].tolist() == ids(opening)  # the opening ends the prompt the policy saw
    assert r.usage.completion_tokens == comp.output_ids.size == len(ids(rest)) + 1  # only the sampled ids
    [t] = end(gw, s)
    assert t.prompt_ids.tolist() == prompt.tolist() and t.output_ids.tolist() == [*ids(rest), eos()]
    assert np.all(t.loss_mask == 1)


def test_a_forced_opening_in_a_later_turn_is_env_tokens_with_no_loss(gateway):
    rest = '{"city": "Paris"}}\n</tool_call>'
    gw = gateway(backend=ScriptedBackend(["Let me think.", rest]))
    s = gw.open_session()
    client = gw.client(key=s["api_key"])
    first = client.chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER])
    history = [*ASK, {"role": "assistant", "content": first.choices[0].message.content},
               {"role": "user", "content": "Call the tool."}]
    r = client.chat.completions.create(model=POLICY, messages=history, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert calls_of(r.choices[0].message.tool_calls) == [("get_weather", {"city": "Paris"})]
    [t] = end(gw, s)
    (p1, c1), (p2, c2) = gw.backend.history
    full = [*t.prompt_ids.tolist(), *t.output_ids.tolist()]
    assert full == [*p2.tolist(), *c2.output_ids.tolist()]  # one record: turn 2 continued turn 1
    forced_at = p2.size - len(ids(NAMED_OPENING)) - t.prompt_ids.size  # where the opening sits in the output
    assert t.output_ids[forced_at:forced_at + len(ids(NAMED_OPENING))].tolist() == ids(NAMED_OPENING)
    mask = t.loss_mask.astype(bool)
    n1 = c1.output_ids.size
    assert mask[:n1].all() and not mask[n1:forced_at + len(ids(NAMED_OPENING))].any()  # given, not sampled
    assert mask[forced_at + len(ids(NAMED_OPENING)):].all() and mask.sum() == n1 + c2.output_ids.size


def test_a_forced_call_the_model_does_not_complete_comes_back_as_its_text(gateway):
    gw = gateway(backend=ScriptedBackend(["no idea"]))
    r = gw.client().chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER], tool_choice="required")
    assert r.choices[0].message.content == REQUIRED_OPENING + "no idea" and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_a_forced_call_streams_as_a_tool_call_delta(gateway):
    gw = gateway(backend=StreamingScript(['{"city": "Oslo"}}\n</tool_call>']))
    chunks = list(gw.client().chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER], stream=True,
                                                      tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}}))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls_of(deltas) == [("get_weather", {"city": "Oslo"})]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_offers_no_tools_and_parses_none(gateway):
    gw = gateway(backend=ScriptedBackend([CALL]))
    r = gw.client().chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert "get_weather" not in tokenizer().decode(gw.backend.history[-1][0])  # the prompt names no tool


def test_tool_choice_auto_offers_the_tools_and_the_model_decides(gateway):
    gw = gateway(backend=ScriptedBackend([CALL, "It is sunny."]))
    client = gw.client()
    r = client.chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER], tool_choice="auto")
    assert calls_of(r.choices[0].message.tool_calls) == [("get_weather", {"city": "Paris"})]
    assert "get_weather" in tokenizer().decode(gw.backend.history[-1][0])
    r = client.chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER], tool_choice="auto")
    assert r.choices[0].message.content == "It is sunny." and not r.choices[0].message.tool_calls


def test_parallel_tool_calls_false_returns_and_records_only_the_first_call(gateway):
    two = f"{CALL}\n{TIME_CALL}"
    gw = gateway(backend=ScriptedBackend([two, two]))
    s = gw.open_session()
    client = gw.client(key=s["api_key"])
    both = client.chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER, TIME])
    assert [n for n, _ in calls_of(both.choices[0].message.tool_calls)] == ["get_weather", "get_time"]
    one = client.chat.completions.create(model=POLICY, messages=ASK, tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert calls_of(one.choices[0].message.tool_calls) == [("get_weather", {"city": "Paris"})]
    assert one.choices[0].finish_reason == "tool_calls" and one.usage.completion_tokens == len(ids(CALL))
    records = end(gw, s)  # the two requests are two branches of one history
    outputs = sorted(t.output_ids.tolist() for t in records)
    assert outputs == sorted([[*ids(two), eos()], ids(CALL)])  # cut after the first call: what the client got


# -- refused: a 400 naming the field, and nothing lost ----------------------------------------------------

REFUSED = [
    ("frequency_penalty", 0.5),
    ("presence_penalty", -0.5),
    ("logit_bias", {"42": 5}),
    ("reasoning_effort", "high"),
    ("functions", [WEATHER["function"]]),
    ("function_call", "auto"),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}),
    ("verbosity", "low"),
    ("no_such_field", 1),
]


@pytest.mark.parametrize("field, value", REFUSED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(REFUSED)])
def test_a_field_the_gateway_cannot_honour_is_a_400_naming_it_and_the_session_loses_nothing(gateway, field, value):
    gw = gateway(backend=ScriptedBackend(["fine"]))
    s = gw.open_session()
    client = gw.client(key=s["api_key"])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=POLICY, messages=ASK, extra_body={field: value})
    assert err.value.param == field and field in err.value.message
    assert err.value.code in ("unsupported_parameter", "unsupported_value")
    assert gw.backend.history == []  # nothing generated
    assert client.chat.completions.create(model=POLICY, messages=ASK).choices[0].message.content == "fine"
    [t] = end(gw, s)
    assert t.meta["turns"] == 1


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "text"}}, {"top_logprobs": 0, "logprobs": True}, {"frequency_penalty": 0},
    {"presence_penalty": 0}, {"logit_bias": {}}, {"parallel_tool_calls": True, "tools": [WEATHER]},
    {"user": "u1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto", "prompt_cache_key": "c",
     "safety_identifier": "s"}, {"modalities": ["text"]},
], ids=["format-text", "top_logprobs-0", "frequency-0", "presence-0", "logit_bias-empty", "parallel-true",
        "bookkeeping", "modalities-text"])
def test_a_no_op_value_and_bookkeeping_fields_are_served(gateway, fields):
    gw = gateway(backend=ScriptedBackend(["fine"]))
    r = gw.client().chat.completions.create(model=POLICY, messages=ASK, extra_body=fields)
    assert r.choices[0].message.content == "fine"


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
     "tool_choice.function.name"),
    ({"tool_choice": {"type": "function"}, "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {}, "extra": 1}}},
     "response_format.json_schema.extra"),
], ids=["required-no-tools", "named-no-tools", "named-unknown", "named-no-name", "unknown-string", "top-21",
        "top-without-logprobs", "seed-negative", "seed-too-big", "format-unknown", "format-no-schema",
        "format-no-name", "format-unknown-key"])
def test_a_tool_choice_or_a_value_that_cannot_be_met_is_a_400_naming_it(gateway, body, param):
    gw = gateway(backend=ScriptedBackend([]))
    r = gw.post("/v1/chat/completions", {"model": POLICY, "messages": ASK, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_logprobs_true_returns_each_sampled_tokens_logprob(gateway):
    gw = gateway(backend=ScriptedBackend(["ok"]))
    r = gw.client().chat.completions.create(model=POLICY, messages=ASK, logprobs=True, top_logprobs=0)
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == ["o", "k"] and [t.logprob for t in content] == [-0.5, -0.5]


# -- Anthropic: tool_choice any / tool / none, disable_parallel_tool_use, refusals, stop_sequence ----------

def claude(gw, key: str = ADMIN) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=30)


@pytest.mark.parametrize("choice, rest", [
    ({"type": "any"}, 'get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ({"type": "tool", "name": "get_weather"}, '{"city": "Paris"}}\n</tool_call>'),
], ids=["any", "tool"])
def test_anthropic_any_and_tool_force_a_call_of_that_tool_streamed_and_not(gateway, choice, rest):
    gw = gateway(backend=StreamingScript([rest, rest]))
    s = gw.open_session()
    kw = dict(model=POLICY, max_tokens=200, tools=ANTHROPIC_TOOLS, messages=ASK, tool_choice=choice)
    msg = claude(gw, s["api_key"]).messages.create(**kw)
    with claude(gw).messages.stream(**kw) as stream:
        final = stream.get_final_message()
    for m in (msg, final):
        assert m.stop_reason == "tool_use"
        assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    [t] = end(gw, s)
    assert t.output_ids.tolist() == [*ids(rest), eos()]
    opening = REQUIRED_OPENING if choice["type"] == "any" else NAMED_OPENING
    assert t.prompt_ids[-len(ids(opening)):].tolist() == ids(opening)


def test_anthropic_tool_choice_none_and_auto(gateway):
    gw = gateway(backend=ScriptedBackend([CALL, CALL]))
    kw = dict(model=POLICY, max_tokens=200, tools=ANTHROPIC_TOOLS, messages=ASK)
    none = claude(gw).messages.create(tool_choice={"type": "none"}, **kw)
    assert [(b.type, b.text) for b in none.content] == [("text", CALL)] and none.stop_reason == "end_turn"
    auto = claude(gw).messages.create(tool_choice={"type": "auto"}, **kw)
    assert [b.type for b in auto.content] == ["tool_use"] and auto.stop_reason == "tool_use"


@pytest.mark.parametrize("choice", [{"type": "auto", "disable_parallel_tool_use": True},
                                    {"type": "any", "disable_parallel_tool_use": True}], ids=["auto", "any"])
def test_anthropic_disable_parallel_tool_use_returns_one_tool_use(gateway, choice):
    two = f"{CALL}\n{TIME_CALL}"
    reply = two if choice["type"] == "auto" else two[len(REQUIRED_OPENING):]
    gw = gateway(backend=ScriptedBackend([reply]))
    msg = claude(gw).messages.create(model=POLICY, max_tokens=200, tools=ANTHROPIC_TOOLS, messages=ASK,
                                     tool_choice=choice)
    assert [(b.name, b.input) for b in msg.content if b.type == "tool_use"] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("extra, named", [
    ({"top_k": -1}, "top_k"),
    ({"output_config": {"format": {"type": "xml", "schema": {}}}}, "output_config.format"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "string", "not": {}}}}},
     "output_config.format.schema.not"),
    ({"container": "c1"}, "container"),
    ({"mcp_servers": []}, "mcp_servers"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": ANTHROPIC_TOOLS}, "tool_choice.name"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "context_management"),
    ({"inference_geo": "us"}, "inference_geo"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    ({"messages": [{"role": "user", "content": [{"type": "image",
                                                 "source": {"type": "url", "url": "http://x/y.png"}}]}]},
     "messages.0.content.0"),
], ids=["top_k", "output_format", "output_schema", "container", "mcp_servers", "unknown", "any-no-tools", "tool-unknown",
        "context-edit", "inference_geo", "server-tool", "image"])
def test_an_anthropic_field_the_gateway_cannot_honour_is_a_400_naming_it(gateway, extra, named):
    gw = gateway(backend=ScriptedBackend(["fine"]))
    with pytest.raises(anthropic.BadRequestError) as err:
        claude(gw).messages.create(model=POLICY, max_tokens=20, messages=ASK, extra_body=extra)
    assert err.value.body["error"]["message"].startswith(named), err.value.body
    assert gw.backend.history == []
    assert claude(gw).messages.create(model=POLICY, max_tokens=20, messages=ASK).content[0].text == "fine"


def test_anthropic_accepted_fields_that_change_nothing_are_served(gateway):
    gw = gateway(backend=ScriptedBackend(["fine"]))
    msg = claude(gw).messages.create(
        model=POLICY, max_tokens=20, messages=ASK, metadata={"user_id": "u"}, service_tier="auto",
        extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}, "output_config": {"effort": "high"},
                    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}})
    assert msg.content[0].text == "fine"


def test_anthropic_stop_sequences_end_with_stop_sequence_named_streamed_and_not(gateway):
    reply = "The answer is 42. END and more"
    gw = gateway(backend=StreamingScript([reply, reply]))
    kw = dict(model=POLICY, max_tokens=200, messages=ASK, stop_sequences=["NOPE", "END"])
    msg = claude(gw).messages.create(**kw)
    with claude(gw).messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    for m in (msg, final):
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "END")
        assert m.content[0].text == "The answer is 42. "
    assert text == "The answer is 42. "
    # without a stop sequence matched: end_turn and no stop_sequence
    gw2 = gateway(backend=ScriptedBackend(["no stop here"]))
    plain = claude(gw2).messages.create(**kw)
    assert (plain.stop_reason, plain.stop_sequence) == ("end_turn", None)


# -- Responses: the fields test_gateway_responses.py does not already show -------------------------------

@pytest.mark.parametrize("field, value", [
    ("conversation", "conv_1"), ("prompt", {"id": "pmpt_1"}), ("max_tool_calls", 2),
    ("context_management", [{"type": "compaction"}]), ("service_tier", "flex"), ("seed", 1),
], ids=["conversation", "prompt", "max_tool_calls", "context_management", "service_tier-flex", "seed"])
def test_a_responses_field_the_gateway_cannot_honour_is_a_400_naming_it(gateway, field, value):
    gw = gateway(backend=ScriptedBackend([]))
    with pytest.raises(openai.BadRequestError) as err:
        gw.client().responses.create(model=POLICY, input="hi", extra_body={field: value})
    assert err.value.param == field, err.value.body


def test_responses_bookkeeping_fields_are_accepted_and_echoed_and_strict_is_accepted(gateway):
    gw = gateway(backend=ScriptedBackend(["fine"]))
    tool = {"type": "function", "name": "get_weather", "description": "Weather.", "strict": True,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                           "additionalProperties": False}}
    r = gw.client().responses.create(model=POLICY, input="hi", tools=[tool], metadata={"run": "7"}, user="u1",
                                     safety_identifier="s1", prompt_cache_key="k1", service_tier="auto",
                                     truncation="disabled")
    assert r.output_text == "fine"
    assert (r.metadata, r.user, r.safety_identifier, r.prompt_cache_key) == ({"run": "7"}, "u1", "s1", "k1")
