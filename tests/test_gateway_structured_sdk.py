"""Structured output, forced and strict tool calls, top_logprobs, seed and top_k through the real gateway on
loopback, with the clients as they ship: the openai SDK (``chat.completions.parse``, streams, Responses),
the OpenAI Agents SDK (``output_type=``), LangChain (``with_structured_output``) and the anthropic SDK.
The policy is the shipped tiny model (models/tiny-guess) in the torch engine: it was trained on a number
game, knows no JSON and no tools, and the grammar alone makes its replies valid. Each session's episode
reaches the trainer token-exact: the trajectory is the prompt and the ids the engine sampled, nothing
re-tokenised.

    .venv/bin/python -m pytest tests/test_gateway_structured_sdk.py -q
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import anthropic
import jsonschema
import numpy as np
import openai
import pydantic
import pytest
from xgrammar.testing import _is_grammar_accept_string as accepts

from tests.test_gateway_openai import GAME, POLICY, TEN, gateway, tokenizer, torch_backend  # noqa: F401
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

pytestmark = pytest.mark.timeout(120)

ROOM = 2048
"""Engine and gateway context for tool calls: the tools' description alone is ~600 of the tiny model's
character tokens."""


class Guess(pydantic.BaseModel):
    number: int = pydantic.Field(ge=1, le=16)
    direction: Literal["higher", "lower"]


SAY = {"type": "function", "function": {
    "name": "say", "description": "Say a word.", "strict": True,
    "parameters": {"type": "object", "properties": {"word": {"type": "string", "enum": ["hi", "bye"]},
                                                    "times": {"type": "integer", "minimum": 1, "maximum": 3}},
                   "required": ["word", "times"], "additionalProperties": False}}}
SAY_SCHEMA = SAY["function"]["parameters"]
ASK = [{"role": "user", "content": "Say hi."}]


class Recording:
    """The torch backend, keeping the sampling parameters each completion was asked with."""

    def __init__(self, backend):
        self.backend, self.params = backend, []
        self.streams_tokens = backend.streams_tokens
        self.history = backend.history

    @property
    def max_context_tokens(self):
        return self.backend.max_context_tokens

    async def generate(self, session_id, prompt_ids, params, **kw):
        self.params.append(params)
        return await self.backend.generate(session_id, prompt_ids, params, **kw)

    def close(self):
        self.backend.close()


def roomy(gateway, **kw):
    return gateway(backend=Recording(torch_backend(max_len=ROOM)), max_context_tokens=ROOM, **kw)


def end(gw, s) -> list:
    assert gw.post(f"/rl/sessions/{s['session_id']}/end").status_code == 200
    return [t for t in gw.emitted if t.episode_id == s["session_id"]]


def assert_token_exact(traj, turns) -> None:
    """``traj`` is the engine's turns exactly: each turn's prompt is the record so far, its output the ids
    the engine sampled (with their log-probabilities and versions), and only those carry loss."""
    full = np.concatenate([traj.prompt_ids, traj.output_ids])
    sampled = np.zeros(full.size, bool)
    for prompt, c in turns:
        start = prompt.size
        assert np.array_equal(full[:start], prompt)
        assert np.array_equal(full[start:start + c.output_ids.size], c.output_ids)
        at = start - traj.prompt_ids.size
        assert np.array_equal(traj.logprobs[at:at + c.output_ids.size], c.logprobs)
        assert np.array_equal(traj.versions[at:at + c.output_ids.size], c.versions)
        sampled[start:start + c.output_ids.size] = True
    assert np.array_equal(traj.loss_mask.astype(bool), sampled[traj.prompt_ids.size:])


# -- structured output: openai SDK, Agents SDK, LangChain ---------------------------------------------

def test_chat_completions_parse_returns_the_model_and_the_episode_is_token_exact(gateway):
    gw = gateway()
    s = gw.open_session()
    client = gw.client(key=s["api_key"])
    for _ in range(3):  # sampled at temperature 1: the grammar, not luck, makes each one valid
        r = client.chat.completions.parse(model=POLICY, messages=TEN, response_format=Guess, temperature=1,
                                          max_tokens=60)
        assert isinstance(r.choices[0].message.parsed, Guess) and r.choices[0].finish_reason == "stop"
    trajs = end(gw, s)
    assert sum(t.meta["turns"] for t in trajs) == 3
    for t in trajs:  # three retries of one first turn: three branches, each exactly what was sampled
        prompt, comp = next((p, c) for p, c in gw.backend.history if np.array_equal(
            np.concatenate([p, c.output_ids]), np.concatenate([t.prompt_ids, t.output_ids])))
        assert_token_exact(t, [(prompt, comp)])


def test_a_streamed_structured_reply_parses_and_adds_up_to_the_reply(gateway):
    gw = gateway()
    with gw.client().chat.completions.stream(model=POLICY, messages=TEN, response_format=Guess, temperature=1,
                                             max_tokens=60) as stream:
        text = "".join(e.delta for e in stream if e.type == "content.delta")
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Guess) and text == final.choices[0].message.content
    assert tokenizer().decode(gw.backend.history[-1][1].output_ids, skip_special_tokens=True) == text


def test_json_object_is_a_json_object(gateway):
    gw = gateway()
    r = gw.client().chat.completions.create(model=POLICY, messages=TEN, response_format={"type": "json_object"},
                                            temperature=0, max_tokens=100)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_the_agents_sdk_with_an_output_type_gets_the_model_and_one_token_exact_trajectory(gateway):
    import agents

    gw = gateway()
    s = gw.open_session()

    async def play():
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=s["api_key"], max_retries=0, timeout=30)
        model = agents.OpenAIResponsesModel(model=POLICY, openai_client=client)
        agent = agents.Agent(name="guesser", instructions="Guess.", output_type=Guess, model=model,
                             model_settings=agents.ModelSettings(temperature=1.0, max_tokens=60))
        try:
            return await agents.Runner.run(agent, GAME, run_config=agents.RunConfig(tracing_disabled=True))
        finally:
            await client.close()

    result = asyncio.run(play())
    assert isinstance(result.final_output, Guess)
    [traj] = end(gw, s)
    assert_token_exact(traj, gw.backend.history[-1:])


def test_langchain_with_structured_output_gets_the_model_and_one_token_exact_trajectory(gateway):
    from langchain_openai import ChatOpenAI

    gw = gateway()
    s = gw.open_session()
    llm = ChatOpenAI(model=POLICY, base_url=gw.url + "/v1", api_key=s["api_key"], temperature=1, max_tokens=60,
                     max_retries=0)
    guess = llm.with_structured_output(Guess, method="json_schema").invoke([("user", GAME)])
    assert isinstance(guess, Guess)
    [traj] = end(gw, s)
    assert_token_exact(traj, gw.backend.history[-1:])


# -- forced and strict tool calls -----------------------------------------------------------------------

@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "say"}}],
                         ids=["required", "named"])
def test_a_forced_call_from_the_tiny_policy_is_always_a_whole_valid_call_recorded_as_sampled(gateway, choice):
    gw = roomy(gateway)
    s = gw.open_session()
    r = gw.client(key=s["api_key"]).chat.completions.create(model=POLICY, messages=ASK, tools=[SAY],
                                                             tool_choice=choice, temperature=1, n=4, max_tokens=80)
    for c in r.choices:
        [call] = c.message.tool_calls
        assert c.finish_reason == "tool_calls" and call.function.name == "say"
        jsonschema.validate(json.loads(call.function.arguments), SAY_SCHEMA)
    trajs = end(gw, s)
    for t, (prompt, comp) in zip(sorted(trajs, key=lambda t: t.output_ids.tolist()),
                                 sorted(gw.backend.history, key=lambda h: h[1].output_ids.tolist())):
        assert_token_exact(t, [(prompt, comp)])  # the opening is in the prompt: given, no loss


def test_anthropic_any_and_tool_come_back_as_a_valid_tool_use(gateway):
    gw = roomy(gateway)
    client = anthropic.Anthropic(base_url=gw.url, api_key=gw.cfg.admin_token, max_retries=0, timeout=30)
    tools = [{"name": "say", "description": "Say a word.", "input_schema": SAY_SCHEMA, "strict": True}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "say"}):
        msg = client.messages.create(model=POLICY, max_tokens=80, messages=ASK, tools=tools, tool_choice=choice)
        [use] = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and use.name == "say"
        jsonschema.validate(use.input, SAY_SCHEMA)


def test_responses_tool_choice_required_gives_a_valid_function_call(gateway):
    gw = roomy(gateway)
    tool = {"type": "function", "name": "say", "parameters": SAY_SCHEMA, "strict": True}
    r = gw.client().responses.create(model=POLICY, input="Say hi.", tools=[tool], tool_choice="required",
                                     max_output_tokens=80)
    [item] = [i for i in r.output if i.type == "function_call"]
    jsonschema.validate(json.loads(item.arguments), SAY_SCHEMA)


def test_a_strict_tool_under_auto_reaches_the_engine_as_a_grammar_that_constrains_its_call(gateway):
    gw = roomy(gateway)
    gw.client().chat.completions.create(model=POLICY, messages=ASK, tools=[SAY], max_tokens=20)
    grammar = gw.backend.params[-1].grammar
    assert accepts(grammar, "Free text.") and accepts(grammar, '<tool_call>\n{"name": "say", "arguments": '
                                                                '{"word": "hi", "times": 2}}\n</tool_call>')
    assert not accepts(grammar, '<tool_call>\n{"name": "say", "arguments": {"word": "yo", "times": 2}}\n</tool_call>')
    gw.client().chat.completions.create(model=POLICY, messages=ASK, tools=[{"type": "function", "function": {
        **SAY["function"], "strict": False}}], max_tokens=20)
    assert gw.backend.params[-1].grammar == ""  # nothing strict, nothing asked: the policy is free


def test_a_schema_keyword_the_grammar_cannot_apply_is_a_400_named_as_each_api_names_it(gateway):
    gw = gateway()
    bad = {"type": "object", "properties": {"w": {"type": "string", "not": {"const": "x"}}}, "required": ["w"]}
    with pytest.raises(openai.BadRequestError) as err:
        gw.client().chat.completions.create(model=POLICY, messages=TEN, response_format={
            "type": "json_schema", "json_schema": {"name": "o", "schema": bad}})
    assert err.value.body["param"] == "response_format.json_schema.schema.properties.w.not"
    with pytest.raises(openai.BadRequestError) as err:
        gw.client().responses.create(model=POLICY, input=GAME, tools=[
            {"type": "function", "name": "f", "parameters": bad, "strict": True}])
    assert err.value.body["param"] == "tools[0].parameters.properties.w.not"
    client = anthropic.Anthropic(base_url=gw.url, api_key=gw.cfg.admin_token, max_retries=0, timeout=30)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=POLICY, max_tokens=8, messages=ASK, tool_choice={"type": "any"},
                               tools=[{"name": "f", "input_schema": bad}])
    assert err.value.body["error"]["message"].startswith("tools.0.input_schema.properties.w.not: ")
    assert gw.backend.history == []  # nothing generated


# -- top_logprobs, seed, top_k --------------------------------------------------------------------------

def engine_top(gw, k: int):
    """(decoded alternatives, their log-probabilities) per output token of the engine's last completion."""
    comp = gw.backend.history[-1][1]
    assert comp.top_ids.shape == (comp.output_ids.size, k)
    return ([[tokenizer().decode([int(t)]) for t in row] for row in comp.top_ids], comp.top_logprobs.tolist())


def test_chat_top_logprobs_are_the_engines_k_most_likely_tokens_streamed_and_not(gateway):
    gw = gateway()
    r = gw.client().chat.completions.create(model=POLICY, messages=TEN, temperature=1, logprobs=True, top_logprobs=3)
    tokens, lps = engine_top(gw, 3)
    got = r.choices[0].logprobs.content
    assert len(got) == len(r.choices[0].message.content)  # the tiny tokenizer: one character a token, eos left out
    for i, t in enumerate(got):
        assert [a.token for a in t.top_logprobs] == tokens[i]
        assert np.allclose([a.logprob for a in t.top_logprobs], lps[i])
        assert lps[i] == sorted(lps[i], reverse=True)
    chunks = list(gw.client().chat.completions.create(model=POLICY, messages=TEN, temperature=1, logprobs=True,
                                                      top_logprobs=2, stream=True))
    tokens, lps = engine_top(gw, 2)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [[a.token for a in t.top_logprobs] for t in streamed] == tokens[:len(streamed)] and streamed


def test_completions_logprobs_k_gives_the_k_alternatives_and_the_sampled_token(gateway):
    gw = gateway()
    prompt = tokenizer().apply_chat_template(TEN, add_generation_prompt=True, tokenize=False)
    r = gw.client().completions.create(model=POLICY, prompt=prompt, max_tokens=4, logprobs=2, temperature=1)
    tokens, lps = engine_top(gw, 2)
    lp = r.choices[0].logprobs
    assert lp.top_logprobs
    for i, top in enumerate(lp.top_logprobs):
        assert set(tokens[i]) <= set(top) <= {*tokens[i], lp.tokens[i]}
        assert np.isclose(top[lp.tokens[i]], lp.token_logprobs[i])


def test_responses_top_logprobs_come_with_the_output_text_logprobs(gateway):
    gw = gateway()
    r = gw.client().responses.create(model=POLICY, input=TEN, top_logprobs=4, temperature=1,
                                     include=["message.output_text.logprobs"])
    tokens, _ = engine_top(gw, 4)
    got = r.output[0].content[0].logprobs
    assert got and [[a.token for a in t.top_logprobs] for t in got] == tokens[:len(got)]


def test_the_same_seed_gives_the_same_tokens_and_n_seeded_choices_differ_from_each_other(gateway):
    gw = gateway()
    client = gw.client()
    ask = dict(model=POLICY, messages=[{"role": "user", "content": GAME}], temperature=2, max_tokens=8, n=8)

    def replies(**kw) -> list[str]:
        return [c.message.content for c in client.chat.completions.create(**{**ask, **kw}).choices]

    seeded = replies(seed=1234)
    assert replies(seed=1234) == seeded and len(set(seeded)) > 1  # choice i samples with seed + i
    assert replies(seed=1234, n=1) == seeded[:1]
    assert replies() != replies()  # without a seed, sampling goes on as before
    prompt = tokenizer().apply_chat_template(ask["messages"], add_generation_prompt=True, tokenize=False)
    legacy = dict(model=POLICY, prompt=prompt, max_tokens=8, temperature=2, n=8, seed=9)
    first = [c.text for c in client.completions.create(**legacy).choices]
    assert [c.text for c in client.completions.create(**legacy).choices] == first


def test_anthropic_top_k_1_samples_the_most_likely_token(gateway):
    gw = gateway()
    client = anthropic.Anthropic(base_url=gw.url, api_key=gw.cfg.admin_token, max_retries=0, timeout=30)
    msgs = [{"role": "user", "content": GAME}]
    greedy = client.messages.create(model=POLICY, max_tokens=8, messages=msgs, extra_body={"temperature": 0})
    for _ in range(6):  # the tiny policy's first token is "1" or "8", nearly evenly, at temperature 1
        top1 = client.messages.create(model=POLICY, max_tokens=8, messages=msgs, extra_body={"temperature": 1,
                                                                                              "top_k": 1})
        assert top1.content[0].text == greedy.content[0].text
