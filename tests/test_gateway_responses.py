"""Gateway, Responses API: the openai SDK's ``client.responses`` (create, stream) and the OpenAI Agents
SDK against the real gateway on a loopback port, serving the tiny policy (models/tiny-guess) or a
scripted one where a tool call must come out for sure. Each call is recorded like a chat completion.

    .venv/bin/python -m pytest tests/test_gateway_responses.py -q
"""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import openai
import pytest

from tests.test_gateway_openai import ADMIN, GAME, POLICY, TEN, ScriptedBackend, gateway  # noqa: F401
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def sampled(traj) -> np.ndarray:
    return traj.output_ids[traj.loss_mask == 1]


def whole(traj) -> np.ndarray:
    return np.concatenate([traj.prompt_ids, traj.output_ids])


def end(gw, session) -> list:
    r = gw.post(f"/rl/sessions/{session['session_id']}/end")
    assert r.status_code == 200, r.text
    return [t for t in gw.emitted if t.episode_id == session["session_id"]]


def test_responses_create_answers_as_the_chat_path_does_with_the_engines_token_counts(gateway):
    gw = gateway()
    r = gw.client().responses.create(model=POLICY, input=TEN, temperature=0)
    prompt, comp = gw.backend.history[-1]
    assert r.output_text == "10" and r.status == "completed" and r.id.startswith("resp_")
    assert r.usage.input_tokens == prompt.size and r.usage.output_tokens == comp.output_ids.size == 3
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"


def test_a_conversation_through_previous_response_id_is_one_trajectory_of_exactly_the_served_tokens(gateway):
    gw = gateway()
    s = gw.open_session()
    client = gw.client(key=s["api_key"])
    kw = {"model": POLICY, "instructions": "Play the game.", "temperature": 0, "max_output_tokens": 3}
    r1 = client.responses.create(input=GAME, **kw)
    r2 = client.responses.create(input="higher (10-16)", previous_response_id=r1.id, **kw)
    with client.responses.stream(input="lower", previous_response_id=r2.id, **kw) as stream:
        r3 = stream.get_final_response()
    [traj] = end(gw, s)
    assert traj.meta["segments"] == 1 and traj.meta["completions"] == [0, 1, 2]
    served = gw.backend.history[-3:]
    # Each turn's prompt is the turn before it, token for token, plus the new input: the same prefix.
    for (p0, c0), (p1, _) in zip(served, served[1:]):
        assert np.array_equal(p1[:p0.size + c0.output_ids.size], np.concatenate([p0, c0.output_ids]))
    last_prompt, last = served[-1]
    assert np.array_equal(whole(traj), np.concatenate([last_prompt, last.output_ids]))
    assert np.array_equal(sampled(traj), np.concatenate([c.output_ids for _, c in served]))
    assert np.allclose(traj.logprobs[traj.loss_mask == 1], np.concatenate([c.logprobs for _, c in served]))
    assert r3.usage.input_tokens == last_prompt.size and r3.output_text == r3.output[0].content[0].text


def test_a_stream_sends_the_responses_event_sequence_and_its_text_adds_up(gateway):
    gw = gateway()
    with gw.client().responses.stream(model=POLICY, input=TEN, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(deltas) == final.output_text == "10" and final.usage.output_tokens == 3
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_function_call_streams_its_arguments_and_the_tool_output_continues_the_same_trajectory(gateway):
    gw = gateway(backend=ScriptedBackend([CALL, "Sunny in Paris."]))
    s = gw.open_session()
    client = gw.client(key=s["api_key"])
    with client.responses.stream(model=POLICY, input="Weather in Paris?", tools=[WEATHER]) as stream:
        events = list(stream)
        r1 = stream.get_final_response()
    kinds = [e.type for e in events]
    assert ["response.function_call_arguments.delta", "response.function_call_arguments.done"] == \
        [k for k in kinds if k.startswith("response.function_call_arguments")]
    [call] = r1.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    # The client sends everything back (as the Agents SDK does), the call's output appended.
    r2 = client.responses.create(model=POLICY, tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris?"}, *[o.model_dump(exclude_none=True) for o in r1.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}])
    assert r2.output_text == "Sunny in Paris."
    [traj] = end(gw, s)
    assert traj.meta["segments"] == 1 and traj.meta["completions"] == [0, 1]
    (p0, c0), (p1, c1) = gw.backend.history
    assert np.array_equal(p1[:p0.size + c0.output_ids.size], np.concatenate([p0, c0.output_ids]))
    assert np.array_equal(whole(traj), np.concatenate([p1, c1.output_ids]))


def test_the_openai_agents_sdk_runs_an_agent_with_a_function_tool_into_one_trajectory(gateway):
    import agents

    gw = gateway(backend=ScriptedBackend([CALL, "It is sunny in Paris."]))
    s = gw.open_session()
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        calls.append(city)
        return "sunny, 24 C"

    async def play():
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=s["api_key"], max_retries=0, timeout=30)
        model = agents.OpenAIResponsesModel(model=POLICY, openai_client=client)
        agent = agents.Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather], model=model)
        try:
            return await agents.Runner.run(agent, "What is the weather in Paris?",
                                           run_config=agents.RunConfig(tracing_disabled=True))
        finally:
            await client.close()

    result = asyncio.run(play())
    assert calls == ["Paris"] and result.final_output == "It is sunny in Paris."
    [traj] = end(gw, s)
    assert traj.meta["segments"] == 1 and traj.meta["completions"] == [0, 1]
    prompt, last = gw.backend.history[-1]
    assert np.array_equal(whole(traj), np.concatenate([prompt, last.output_ids]))


def test_an_unknown_or_another_sessions_previous_response_id_is_a_404_naming_the_field(gateway):
    gw = gateway()
    a, b = gw.open_session(), gw.open_session()
    theirs = gw.client(key=b["api_key"]).responses.create(model=POLICY, input=GAME, max_output_tokens=2)
    for rid in ("resp_nothing", theirs.id):
        with pytest.raises(openai.NotFoundError, match="Send the whole conversation") as err:
            gw.client(key=a["api_key"]).responses.create(model=POLICY, input="x", previous_response_id=rid)
        assert err.value.body["param"] == "previous_response_id"


def test_store_false_keeps_no_conversation_to_continue(gateway):
    gw = gateway()
    r = gw.client().responses.create(model=POLICY, input=GAME, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        gw.client().responses.create(model=POLICY, input="x", previous_response_id=r.id)


class FullDisk:
    def response(self, *args):
        raise OSError(28, "No space left on device")


def test_a_conversation_the_wal_cannot_store_is_a_503_or_a_response_failed_event_never_a_cut_stream(gateway):
    """Before: a streamed reply whose conversation's WAL write failed ended without response.completed
    or response.failed (the SDK saw a stream cut short), and a plain one was a 500 'internal_error'."""
    gw = gateway()
    s = gw.open_session()
    client = gw.client(key=s["api_key"])
    gw.call(lambda: setattr(gw.gateway.conversations, "wal", FullDisk()))
    with pytest.raises(openai.InternalServerError) as err:
        client.responses.create(model=POLICY, input=GAME, max_output_tokens=2)
    assert err.value.status_code == 503 and err.value.body["code"] == "store_failed"
    assert "No space left on device" in err.value.body["message"]
    with client.responses.stream(model=POLICY, input=GAME, max_output_tokens=2) as stream:
        kinds = [e.type for e in stream]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-2:] == ["error", "response.failed"] and "response.completed" not in kinds
    counted = gw.call(lambda: dict(gw.gateway.metrics.counters))
    assert counted["http.failed.store_failed"] == 2
    gw.call(lambda: setattr(gw.gateway.conversations, "wal", None))
    # both turns were recorded (the reply was generated): the session ends with them
    assert gw.post(f"/rl/sessions/{s['session_id']}/end").json()["completions"] == 2


REFUSED = [
    ("background", {"background": True}, "background"),
    ("truncation", {"truncation": "auto"}, "truncation"),
    ("reasoning", {"reasoning": {"effort": "high"}}, "reasoning"),
    ("hosted_tool", {"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ("include", {"include": ["file_search_call.results"]}, "include[0]"),
    ("unknown", {"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ("image", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ("item_type", {"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
    ("verbosity", {"text": {"verbosity": "low"}}, "text.verbosity"),
    ("temperature", {"temperature": "hot"}, "temperature"),
]


@pytest.mark.parametrize("extra, param", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_a_field_the_gateway_cannot_honour_is_a_400_naming_it_and_nothing_is_recorded(gateway, extra, param):
    gw = gateway()
    s = gw.open_session()
    with pytest.raises(openai.BadRequestError) as err:
        gw.client(key=s["api_key"]).responses.create(**{"model": POLICY, "input": GAME, **extra})
    assert err.value.body["param"] == param and err.value.body["message"]
    assert gw.post(f"/rl/sessions/{s['session_id']}/end").json()["completions"] == 0


def test_responses_are_served_under_the_gateway_prefix_with_usage_on_the_wire(gateway):
    gw = gateway()
    r = httpx.post(gw.url + "/gateway/v1/responses", json={"model": POLICY, "input": TEN, "temperature": 0},
                   headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "response" and body["output"][0]["content"][0]["text"] == "10"
    assert body["usage"]["total_tokens"] == body["usage"]["input_tokens"] + 3


def test_streamed_reasoning_is_its_own_output_item_before_the_message():
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from nodes.gateway.responses_api import StreamEvents

    chat = {"id": "chatcmpl-x-0", "usage": {"prompt_tokens": 5, "completion_tokens": 9}, "choices": [{
        "finish_reason": "stop", "message": {"role": "assistant", "content": "It is 10.",
                                             "reasoning_content": "Higher than 8, so 10."}}]}
    ev = StreamEvents({"model": POLICY, "input": "x"}, "resp_x-0")
    events = [*ev.opening(), *ev.reasoning("Higher than 8"), *ev.reasoning(", so 10."), *ev.text("It is"),
              *ev.closing(chat, [" 10."])]
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(data) for _, data in events]  # the SDK's own types
    added = [(e.output_index, e.item.type) for e in parsed if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    thought = "".join(e.delta for e in parsed if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in parsed if e.type == "response.output_text.delta")
    assert thought == "Higher than 8, so 10." and text == "It is 10."
    final = parsed[-1].response
    assert final.status == "completed" and [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output_text == "It is 10." and final.usage.output_tokens == 9


def test_text_format_and_logprobs_go_through_the_chat_paths_rules_named_as_responses_fields(gateway):
    gw = gateway()
    with pytest.raises(openai.BadRequestError) as err:  # a keyword the grammar cannot apply: refused, not ignored
        gw.client().responses.create(model=POLICY, input=GAME, text={"format": {
            "type": "json_schema", "name": "w", "schema": {"type": "array", "uniqueItems": True}}})
    assert err.value.body["param"] == "text.format.schema.uniqueItems"
    assert "'text.format.schema'" in err.value.body["message"]
    r = gw.client().responses.create(model=POLICY, input=TEN, temperature=0, include=["message.output_text.logprobs"])
    comp = gw.backend.history[-1][1]
    got = r.output[0].content[0].logprobs
    assert [t.token for t in got] == ["1", "0"] and np.allclose([t.logprob for t in got], comp.logprobs[:2])
