"""The gateway's Anthropic Messages API: the pure translation functions; the real anthropic SDK
talking to a tiny aiohttp server that uses them; and the same SDK against the gateway's real app.

Both servers' models are deterministic test doubles for the policy: they echo the last user text,
call the offered tool, and report a tool's result back in words. The tiny server's double works on
OpenAI requests (and shows the system prompt in brackets); the real app's works on token ids.

    .venv/bin/python -m pytest tests/test_gateway_anthropic.py -q
"""

from __future__ import annotations

import asyncio
import json
import threading

import anthropic
import pytest
from aiohttp import web

from nodes.gateway.anthropic_api import (
    AnthropicError,
    api_key_from_headers,
    count_tokens_request,
    count_tokens_response,
    error_body,
    estimate_tokens,
    invalid_api_key,
    to_openai_request,
)
from nodes.gateway.anthropic_reply import format_sse, from_openai_response, stream_events

pytestmark = pytest.mark.timeout(30)

MODEL = "areal-policy"  # any name: the gateway routes it, and echoes it back
TOKEN = "gw-test-token"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def request(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **fields}


def completion(content=None, tool_calls=None, finish="stop", **choice_extra) -> dict:
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": "chatcmpl-abc123",
        "object": "chat.completion",
        "model": "policy",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, **choice_extra}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
    }


def call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"), (529, "overloaded_error"),
])
def test_error_body_has_anthropics_shape_and_type_for_the_status(status, kind):
    assert error_body(status, "why") == {"type": "error", "error": {"type": kind, "message": "why"}}


def test_anthropic_error_carries_status_and_body():
    err = AnthropicError(400, "max_tokens: Field required")
    assert err.status == 400
    assert err.body["error"] == {"type": "invalid_request_error", "message": "max_tokens: Field required"}


# ---------------------------------------------------------------------------------------------------
# to_openai_request


def test_system_string_becomes_the_first_system_message():
    out = to_openai_request(request(system="Be terse."))
    assert out["messages"] == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]


def test_system_text_blocks_become_one_system_message():
    system = [{"type": "text", "text": "You are Claude Code."},
              {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}]
    out = to_openai_request(request(system=system))
    assert out["messages"][0] == {"role": "system", "content": "You are Claude Code.\nUse tools."}


def test_no_system_means_no_system_message():
    assert [m["role"] for m in to_openai_request(request())["messages"]] == ["user"]


def test_string_and_text_block_content_translate_alike():
    as_blocks = request(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert to_openai_request(as_blocks) == to_openai_request(request())


def test_request_keeps_model_and_max_tokens_and_never_sets_stream():
    out = to_openai_request(request(stream=True))
    assert out["model"] == MODEL and out["max_tokens"] == 64
    assert "stream" not in out


def test_tool_use_becomes_assistant_tool_calls_with_json_arguments_and_the_same_id():
    out = to_openai_request(request(messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "18C"}]},
    ], tools=[WEATHER]))
    assistant = out["messages"][1]
    assert assistant["role"] == "assistant" and assistant["content"] == "Checking."
    [tool_call] = assistant["tool_calls"]
    assert tool_call["id"] == "toolu_01" and tool_call["type"] == "function"
    assert tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Paris"}
    assert out["messages"][2] == {"role": "tool", "tool_call_id": "toolu_01", "content": "18C"}


def test_assistant_turn_with_only_tool_use_has_null_content():
    out = to_openai_request(request(messages=[
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
    ]))
    assert out["messages"][1]["content"] is None
    assert out["messages"][2] == {"role": "tool", "tool_call_id": "t1", "content": ""}


def test_tool_results_come_before_the_users_text_and_block_content_is_joined():
    out = to_openai_request(request(messages=[
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "ls", "input": {}},
            {"type": "tool_use", "id": "t2", "name": "cat", "input": {"path": "x"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1",
             "content": [{"type": "text", "text": "a.py"}, {"type": "text", "text": "b.py"}]},
            {"type": "tool_result", "tool_use_id": "t2", "content": "no such file", "is_error": True},
            {"type": "text", "text": "now summarise"},
        ]},
    ]))
    assert out["messages"][2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "a.py\nb.py"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: no such file"},
        {"role": "user", "content": "now summarise"},
    ]


def test_tools_become_openai_function_tools():
    out = to_openai_request(request(tools=[WEATHER, {"name": "ls", "input_schema": {"type": "object"}}]))
    assert out["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                          "parameters": WEATHER["input_schema"]}},
        {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}},
    ]


@pytest.mark.parametrize("choice, expected", [
    ({"type": "auto"}, "auto"),
    ({"type": "any"}, "required"),
    ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
])
def test_tool_choice_maps_to_openai(choice, expected):
    out = to_openai_request(request(tools=[WEATHER], tool_choice=choice))
    assert out["tool_choice"] == expected
    assert "parallel_tool_calls" not in out


def test_disable_parallel_tool_use_turns_off_parallel_tool_calls():
    out = to_openai_request(request(tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": True}))
    assert out["parallel_tool_calls"] is False


def test_sampling_fields_translate_and_top_k_is_dropped():
    out = to_openai_request(request(temperature=0.5, top_p=0.9, top_k=40, stop_sequences=["\n\nHuman:"],
                                    metadata={"user_id": "session-7"}))
    assert out["temperature"] == 0.5 and out["top_p"] == 0.9
    assert out["stop"] == ["\n\nHuman:"] and out["user"] == "session-7"
    assert "top_k" not in out


def test_claude_code_extras_are_accepted_and_dropped():
    out = to_openai_request(request(
        thinking={"type": "enabled", "budget_tokens": 1024},
        context_management={"edits": []},
        messages=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                              {"type": "redacted_thinking", "data": "xx"},
                                              {"type": "text", "text": "a"}]},
            {"role": "user", "content": [{"type": "text", "text": "more", "cache_control": {"type": "ephemeral"}}]},
        ],
    ))
    assert out["messages"] == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"},
    ]
    assert "thinking" not in out and "context_management" not in out


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model: Field required"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "max_tokens: Field required"),
    (request(max_tokens="5"), "max_tokens: Input should be a valid integer"),
    (request(max_tokens=0), "max_tokens: Input should be greater than or equal to 1"),
    (request(messages=[]), "messages: List should have at least 1 item"),
    (request(messages=[{"role": "system", "content": "x"}]), "messages.0.role"),
    (request(messages=[{"role": "user", "content": 5}]), "messages.0.content: must be a string or a list"),
    (request(messages=[{"role": "user", "content": [{"text": "x"}]}]), "messages.0.content.0: needs a 'type'"),
    (request(messages=[{"role": "user", "content": [{"type": "audio"}]}]),
     "messages.0.content.0: unsupported type 'audio'"),
    (request(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "ls"}]}]), "messages.1.content.0.input: Field required"),
    (request(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]),
     "messages.0.content.0.tool_use_id: 'nope' does not answer any earlier tool_use"),
    (request(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "t1", "name": "ls", "input": {}}]}]),
     "messages.0.content.0: tool_use blocks belong in an assistant message"),
    (request(system=[{"type": "image"}]), "system.0.type"),
    (request(temperature=1.5), "temperature: Input should be less than or equal to 1"),
    (request(tools=[{"name": "ls"}]), "tools.0.input_schema: Field required"),
    (request(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools.0: server tool"),
    (request(tool_choice={"type": "tool"}, tools=[WEATHER]), "tool_choice.name: Field required"),
    (request(tool_choice={"type": "tool", "name": "nope"}, tools=[WEATHER]), "tool_choice.name: 'nope'"),
    (request(tool_choice={"type": "any"}), "tool_choice: type 'any' needs tools"),
    ([1, 2], "request body must be a JSON object"),
])
def test_malformed_request_raises_400_naming_the_field(body, field):
    with pytest.raises(AnthropicError) as caught:
        to_openai_request(body)
    assert caught.value.status == 400
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert field in caught.value.body["error"]["message"]


@pytest.mark.parametrize("block", [
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
    {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}},
])
def test_images_and_documents_are_refused_clearly(block):
    with pytest.raises(AnthropicError, match=r"messages.0.content.1: \w+ content is not supported"):
        to_openai_request(request(messages=[{"role": "user", "content": [{"type": "text", "text": "see"}, block]}]))


def test_image_inside_a_tool_result_is_refused_naming_the_path():
    body = request(messages=[
        {"role": "user", "content": "shot"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
    ])
    with pytest.raises(AnthropicError, match=r"messages.2.content.0.content.0: image content is not supported"):
        to_openai_request(body)


# ---------------------------------------------------------------------------------------------------
# from_openai_response


def test_text_completion_becomes_an_anthropic_message():
    msg = from_openai_response(completion("Hello."), MODEL)
    assert msg == {
        "id": "msg_abc123", "type": "message", "role": "assistant", "model": MODEL,
        "content": [{"type": "text", "text": "Hello."}],
        "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 11, "output_tokens": 7},
    }


def test_tool_calls_become_tool_use_blocks_after_the_text():
    resp = completion("Let me check.", [call("call_1", "get_weather", '{"city": "Paris"}'),
                                        call("call_2", "ls", "")], finish="tool_calls")
    msg = from_openai_response(resp, MODEL)
    assert msg["content"] == [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "ls", "input": {}},
    ]
    assert msg["stop_reason"] == "tool_use"


def test_unparseable_tool_arguments_are_passed_on_under_one_key():
    msg = from_openai_response(completion(None, [call("c1", "ls", '{"path": ')], finish="tool_calls"), MODEL)
    assert msg["content"] == [
        {"type": "tool_use", "id": "c1", "name": "ls", "input": {"_unparsed_arguments": '{"path": '}},
    ]


@pytest.mark.parametrize("finish, extra, stop_reason, stop_sequence", [
    ("stop", {}, "end_turn", None),
    ("length", {}, "max_tokens", None),
    ("tool_calls", {}, "tool_use", None),
    ("stop", {"stop_reason": "END"}, "stop_sequence", "END"),
    ("stop", {"stop_reason": 151645}, "end_turn", None),  # vLLM: an EOS token id, not a stop string
    ("content_filter", {}, "refusal", None),
])
def test_finish_reason_maps_to_stop_reason(finish, extra, stop_reason, stop_sequence):
    msg = from_openai_response(completion("x", finish=finish, **extra), MODEL)
    assert (msg["stop_reason"], msg["stop_sequence"]) == (stop_reason, stop_sequence)


def test_response_without_choices_raises_502_showing_the_body():
    upstream = {"error": {"message": "model 'policy' not loaded", "type": "invalid_request_error"}}
    with pytest.raises(AnthropicError) as caught:
        from_openai_response(upstream, MODEL)
    assert caught.value.status == 502
    assert caught.value.body["error"]["type"] == "api_error"
    assert "model 'policy' not loaded" in caught.value.body["error"]["message"]


# ---------------------------------------------------------------------------------------------------
# stream_events, format_sse


def test_stream_events_follow_the_anthropic_event_order():
    resp = completion("Checking.", [call("call_1", "get_weather", '{"city":"Paris"}')], finish="tool_calls")
    events = stream_events(resp, MODEL)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] == 11
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert events[2][1]["delta"] == {"type": "text_delta", "text": "Checking."}
    assert events[4][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    assert events[5][1]["index"] == 1
    assert events[5][1]["delta"]["type"] == "input_json_delta"
    assert json.loads(events[5][1]["delta"]["partial_json"]) == {"city": "Paris"}
    assert events[7][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[7][1]["usage"] == {"output_tokens": 7}


def test_empty_completion_streams_no_content_blocks():
    names = [name for name, _ in stream_events(completion(""), MODEL)]
    assert names == ["message_start", "message_delta", "message_stop"]


def test_format_sse_is_one_event_with_json_data():
    raw = format_sse("message_stop", {"type": "message_stop", "note": "é"})
    assert raw == 'event: message_stop\ndata: {"type":"message_stop","note":"é"}\n\n'.encode()


# ---------------------------------------------------------------------------------------------------
# authentication


def test_api_key_comes_from_x_api_key_or_bearer():
    assert api_key_from_headers({"X-Api-Key": "k1", "anthropic-version": "2023-06-01"}) == "k1"
    assert api_key_from_headers({"Authorization": "Bearer k2"}) == "k2"


def test_missing_key_is_a_401_saying_what_to_set():
    with pytest.raises(AnthropicError) as caught:
        api_key_from_headers({"anthropic-version": "2023-06-01"})
    assert caught.value.status == 401
    assert caught.value.body["error"]["type"] == "authentication_error"
    assert "ANTHROPIC_API_KEY" in caught.value.message


@pytest.mark.parametrize("headers", [
    {"Authorization": "Bearer sk-ant-oat01-xyz", "anthropic-beta": "claude-code-20250219,oauth-2025-04-20"},
    {"Authorization": "Bearer sk-ant-oat01-xyz"},
])
def test_claude_code_oauth_login_is_a_401_pointing_at_the_gateway_token(headers):
    with pytest.raises(AnthropicError) as caught:
        api_key_from_headers(headers)
    assert caught.value.status == 401
    assert "OAuth" in caught.value.message and "ANTHROPIC_BASE_URL" in caught.value.message
    assert "sk-ant-oat01-xyz" not in caught.value.message


def test_invalid_key_message_never_echoes_the_key_and_names_stray_whitespace():
    plain, padded = invalid_api_key("wrong-key"), invalid_api_key("gw-token\n")
    assert plain.status == 401 and "wrong-key" not in plain.message and "${VAR}" in plain.message
    assert "whitespace" in padded.message and "gw-token" not in padded.message


# ---------------------------------------------------------------------------------------------------
# count_tokens


def test_count_tokens_request_needs_no_max_tokens():
    out = count_tokens_request({"model": MODEL, "system": "s", "messages": [{"role": "user", "content": "hi"}],
                                "tools": [WEATHER]})
    assert "max_tokens" not in out
    assert [m["role"] for m in out["messages"]] == ["system", "user"] and out["tools"]
    assert count_tokens_response(estimate_tokens(out))["input_tokens"] > 0


# ---------------------------------------------------------------------------------------------------
# Fit with the rest of the gateway: its OpenAI request schema, and session history matching


def test_translated_requests_pass_the_gateways_openai_validation():
    from nodes.gateway.openai_api import parse_chat_request

    parse_chat_request(to_openai_request(request(
        system="s", tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, temperature=1,
        stop_sequences=["END"], metadata={"user_id": "u"},
        messages=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": "s"}]},
            {"role": "user", "content": "again"},
        ],
    )))


@pytest.mark.parametrize("content, tool_calls", [
    ("Done.", None),
    (None, [call("call_1", "get_weather", '{"city": "Paris", "units": "C"}')]),
    ("Let me look.", [call("call_1", "ls", "{}"), call("call_2", "cat", '{"path":"a.py"}')]),
])
def test_a_reply_sent_back_in_history_matches_what_the_session_recorded(content, tool_calls):
    """Claude Code sends each reply back verbatim in the next request; once translated it must be the
    same message (chat.canonical) the gateway returned, or the session restarts its token record."""
    from nodes.gateway.chat import canonical

    returned = completion(content, tool_calls, "tool_calls" if tool_calls else "stop")
    reply = from_openai_response(returned, MODEL)
    history = request(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": reply["content"]}])
    assert canonical(to_openai_request(history)["messages"][1]) == canonical(returned["choices"][0]["message"])


# ---------------------------------------------------------------------------------------------------
# The real anthropic SDK against a loopback server built on the functions above


def fake_policy(req: dict) -> dict:
    """The test double for the model: deterministic, and visibly shaped by the request it got."""
    msgs = req["messages"]
    last = msgs[-1]
    if last["role"] == "tool":
        return completion(f"the tool said: {last['content']}")
    if req.get("tools") and req.get("tool_choice") != "none":
        choice = req.get("tool_choice")
        name = choice["function"]["name"] if isinstance(choice, dict) else req["tools"][0]["function"]["name"]
        return completion(None, [call("toolu_fake1", name, json.dumps({"city": last["content"]}))], "tool_calls")
    system = next((m["content"] for m in msgs if m["role"] == "system"), None)
    text = f"[{system}] {last['content']}" if system else last["content"]
    for stop in req.get("stop", []):
        if stop in text:
            return completion(text[: text.index(stop)], stop_reason=stop)
    words = text.split(" ")
    if len(words) > req["max_tokens"]:
        return completion(" ".join(words[: req["max_tokens"]]), finish="length")
    return completion(text)


SEEN = web.AppKey("seen", list)  # (lower-cased headers, OpenAI request) per accepted /v1/messages call


async def _messages(request: web.Request) -> web.StreamResponse:
    seen = request.app[SEEN]
    try:
        if api_key_from_headers(request.headers) != TOKEN:
            raise invalid_api_key(api_key_from_headers(request.headers))
        body = await request.json()
        openai_request = to_openai_request(body)
        seen.append(({k.lower(): v for k, v in request.headers.items()}, openai_request))
        resp = fake_policy(openai_request)
        if not body.get("stream"):
            return web.json_response(from_openai_response(resp, body["model"]))
        events = stream_events(resp, body["model"])
    except AnthropicError as err:
        return web.json_response(err.body, status=err.status)
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
    for name, data in events:
        await out.write(format_sse(name, data))
    await out.write_eof()
    return out


async def _count_tokens(request: web.Request) -> web.Response:
    try:
        return web.json_response(count_tokens_response(estimate_tokens(count_tokens_request(await request.json()))))
    except AnthropicError as err:
        return web.json_response(err.body, status=err.status)


def double_app() -> web.Application:
    app = web.Application()
    app[SEEN] = []
    app.router.add_post("/v1/messages", _messages)
    app.router.add_post("/v1/messages/count_tokens", _count_tokens)
    return app


class LoopbackServer:
    """An aiohttp app on a random loopback port, served from its own thread and event loop."""

    def __init__(self, app: web.Application | None = None):
        self.loop = asyncio.new_event_loop()
        app = app if app is not None else double_app()
        self.seen = app.get(SEEN)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = "http://127.0.0.1:%d" % self.runner.addresses[0][1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


@pytest.fixture(scope="module")
def server():
    srv = LoopbackServer()
    yield srv
    srv.close()


@pytest.fixture
def client(server):
    server.seen.clear()
    with anthropic.Anthropic(base_url=server.url, api_key=TOKEN, max_retries=0, timeout=5.0) as c:
        yield c


def test_sdk_create_returns_the_models_text_and_usage(client, server):
    msg = client.messages.create(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "hello there"}])
    assert isinstance(msg, anthropic.types.Message)
    assert msg.content[0].type == "text" and msg.content[0].text == "hello there"
    assert msg.model == MODEL and msg.stop_reason == "end_turn" and msg.id.startswith("msg_")
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (11, 7)
    headers, _ = server.seen[-1]
    # anthropic-python 2.x sends the api_key as a Bearer token; Claude Code sends x-api-key (tested below).
    assert TOKEN in (headers.get("x-api-key"), headers.get("authorization", "").removeprefix("Bearer "))
    assert headers["anthropic-version"]


@pytest.mark.parametrize("system", [
    "Be terse.",
    [{"type": "text", "text": "Be"}, {"type": "text", "text": "terse."}],
])
def test_sdk_system_prompt_reaches_the_model(client, server, system):
    msg = client.messages.create(model=MODEL, max_tokens=64, system=system,
                                 messages=[{"role": "user", "content": "hi"}])
    expected = "Be terse." if isinstance(system, str) else "Be\nterse."
    assert msg.content[0].text == f"[{expected}] hi"
    assert server.seen[-1][1]["messages"][0] == {"role": "system", "content": expected}


def test_sdk_stop_reasons_for_max_tokens_and_stop_sequences(client):
    long = client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "a b c d"}])
    assert (long.stop_reason, long.content[0].text) == ("max_tokens", "a b")
    stopped = client.messages.create(model=MODEL, max_tokens=64, stop_sequences=["STOP"],
                                     messages=[{"role": "user", "content": "go STOP now"}])
    assert (stopped.stop_reason, stopped.stop_sequence, stopped.content[0].text) == ("stop_sequence", "STOP", "go ")


def test_sdk_stream_text_is_assembled_into_the_final_message(client):
    with client.messages.stream(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "stream me"}]) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == "stream me"
    assert final.content[0].text == "stream me" and final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (11, 7)


def test_sdk_stream_tool_use_block_is_assembled_with_its_input(client):
    with client.messages.stream(model=MODEL, max_tokens=64, tools=[WEATHER],
                                messages=[{"role": "user", "content": "Paris"}]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    [block] = final.content
    assert block.type == "tool_use" and block.id == "toolu_fake1" and block.name == "get_weather"
    assert block.input == {"city": "Paris"}


def test_sdk_tool_result_follow_up_reaches_the_model_as_a_tool_message(client, server):
    first = client.messages.create(model=MODEL, max_tokens=64, tools=[WEATHER],
                                   messages=[{"role": "user", "content": "Paris"}])
    tool_use = first.content[0]
    assert first.stop_reason == "tool_use" and tool_use.input == {"city": "Paris"}
    follow_up = [
        {"role": "user", "content": "Paris"},
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "18C, sunny"}]},
    ]
    second = client.messages.create(model=MODEL, max_tokens=64, tools=[WEATHER], messages=follow_up)
    assert second.content[0].text == "the tool said: 18C, sunny" and second.stop_reason == "end_turn"
    sent = server.seen[-1][1]["messages"]
    assert sent[-2]["tool_calls"][0]["id"] == tool_use.id
    assert sent[-1] == {"role": "tool", "tool_call_id": tool_use.id, "content": "18C, sunny"}


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}],
     "messages.0.content.0: image content is not supported by this gateway"),
    ([{"role": "user", "content": "q"},
      {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "n"}]}],
     "messages.1.content.0.input: Field required"),
])
def test_sdk_malformed_request_raises_bad_request_with_the_gateways_message(client, messages, message):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=64, messages=messages)
    assert caught.value.status_code == 400
    assert caught.value.body["error"]["message"].startswith(message)
    assert message in str(caught.value)


def test_sdk_bad_key_raises_authentication_error(server):
    with anthropic.Anthropic(base_url=server.url, api_key="not-the-token", max_retries=0, timeout=5.0) as c:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            c.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 401
    assert caught.value.body["error"]["type"] == "authentication_error"
    assert "Invalid API key" in caught.value.body["error"]["message"]


def test_sdk_auth_token_is_accepted_as_a_bearer(server):
    with anthropic.Anthropic(base_url=server.url, auth_token=TOKEN, max_retries=0, timeout=5.0) as c:
        msg = c.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert msg.content[0].text == "hi"


def test_sdk_count_tokens_gets_a_positive_count(client):
    counted = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hello there"}])
    assert counted.input_tokens > 0


def test_claude_code_shaped_streaming_request_is_served(server, monkeypatch):
    """Headers, query and body fields as Claude Code sends them: x-api-key, anthropic-version
    2023-06-01, anthropic-beta, ?beta=true, cache_control, thinking, metadata.user_id, stream."""
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    headers = {"x-api-key": TOKEN, "anthropic-version": "2023-06-01", "x-app": "cli",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    server.seen.clear()
    with anthropic.Anthropic(base_url=server.url, api_key=None, default_headers=headers,
                             max_retries=0, timeout=5.0) as c:
        with c.messages.stream(
            model="claude-sonnet-4-6", max_tokens=32000, extra_query={"beta": "true"},
            system=[{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            tools=[{**WEATHER, "cache_control": {"type": "ephemeral"}}],
            metadata={"user_id": "user_abc_session_1"},
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>context</system-reminder>"},
                {"type": "text", "text": "Paris", "cache_control": {"type": "ephemeral"}}]}],
            extra_body={"temperature": 1, "thinking": {"type": "enabled", "budget_tokens": 1024}},
        ) as s:
            final = s.get_final_message()
    assert final.model == "claude-sonnet-4-6" and final.stop_reason == "tool_use"
    assert final.content[0].input == {"city": "<system-reminder>context</system-reminder>\nParis"}
    seen_headers, openai_request = server.seen[-1]
    assert seen_headers["x-api-key"] == TOKEN and "authorization" not in seen_headers
    assert openai_request["user"] == "user_abc_session_1" and "thinking" not in openai_request


# ---------------------------------------------------------------------------------------------------
# The same SDK calls against the gateway's real app (nodes/gateway/app.py): its sessions, chat template
# and error middleware, with the shipped tiny model's (character-level) tokenizer. The backend is a
# deterministic test double for the policy engine, speaking token ids as the real one does.

ADMIN_TOKEN = "admin-token-for-tests"


class EchoBackend:
    """Replies to the rendered prompt like fake_policy does: echo, call the offered tool, or report
    the tool's result; as token ids ending in eos, as the engine returns them."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    async def generate(self, session_id, prompt_ids, params):
        import numpy as np

        from areal_bus.messages import Completion

        prompt = self.tok.decode([int(t) for t in prompt_ids])
        last = prompt.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0]
        if "<tool_response>" in last:
            reply = "the tool said: " + last.split("<tool_response>")[1].split("</tool_response>")[0].strip()
        elif "<tools>" in prompt:
            call_json = json.dumps({"name": "get_weather", "arguments": {"city": last}})
            reply = f"<tool_call>\n{call_json}\n</tool_call>"
        else:
            reply = last
        ids = np.array(self.tok.encode(reply) + [self.tok.eos_token_id], np.int32)
        return Completion(request_id="r", episode_id=session_id, ticket=0, worker="echo", output_ids=ids,
                          logprobs=np.zeros(ids.size, np.float32), versions=np.zeros(ids.size, np.int32),
                          finish_reason="stop")


@pytest.fixture(scope="module")
def gateway():
    app_module = pytest.importorskip("nodes.gateway.app")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained("models/tiny-guess")
    cfg = app_module.GatewayConfig(admin_token=ADMIN_TOKEN, port=0, max_context_tokens=4096, policy_model=MODEL)
    srv = LoopbackServer(app_module.make_app(cfg, EchoBackend(tokenizer), tokenizer))
    srv.tokenizer = tokenizer
    yield srv
    srv.close()


def _admin(gateway, method: str, path: str) -> dict:
    import urllib.request

    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
    req = urllib.request.Request(gateway.url + path, method=method, headers=headers,
                                 data=b"{}" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


@pytest.fixture
def session_client(gateway):
    """A Claude-Code-like client (x-api-key) holding a fresh session's key; yields (client, session id)."""
    opened = _admin(gateway, "POST", "/rl/sessions")
    headers = {"x-api-key": opened["api_key"], "anthropic-version": "2023-06-01"}
    with anthropic.Anthropic(base_url=gateway.url, api_key=None, default_headers=headers,
                             max_retries=0, timeout=5.0) as c:
        yield c, opened["session_id"]


def test_app_create_and_stream_echo_through_the_real_gateway(session_client):
    client, _ = session_client
    msg = client.messages.create(model=MODEL, max_tokens=64, system="Be terse.",
                                 messages=[{"role": "user", "content": "hello there"}])
    assert (msg.content[0].text, msg.stop_reason, msg.model) == ("hello there", "end_turn", MODEL)
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens == len("hello there") + 1
    with client.messages.stream(model=MODEL, max_tokens=64,
                                messages=[{"role": "user", "content": "streamed"}]) as s:
        assert "".join(s.text_stream) == "streamed"
        assert s.get_final_message().stop_reason == "end_turn"


def test_app_tool_round_trip_extends_one_session_record(session_client, gateway):
    """tool_use out, tool_result back: the gateway recognises its own reply in the history, so the
    episode stays one token record (one segment) rather than restarting."""
    client, sid = session_client
    with client.messages.stream(model=MODEL, max_tokens=200, tools=[WEATHER],
                                messages=[{"role": "user", "content": "Paris"}]) as s:
        first = s.get_final_message()
    assert first.stop_reason == "tool_use"
    tool_use = first.content[-1]
    assert (tool_use.name, tool_use.input) == ("get_weather", {"city": "Paris"})
    second = client.messages.create(model=MODEL, max_tokens=200, tools=[WEATHER], messages=[
        {"role": "user", "content": "Paris"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "18C"}]},
    ])
    assert second.content[0].text == "the tool said: 18C"
    state = _admin(gateway, "GET", f"/rl/sessions/{sid}")
    assert (state["completions"], state["segments"], state["branches"]) == (2, 1, 1)


def test_app_errors_reach_the_sdk_in_anthropic_shape(session_client, gateway):
    client, _ = session_client
    with pytest.raises(anthropic.BadRequestError, match="messages.0.content.0: image content is not supported"):
        client.messages.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-sonnet-4-6", max_tokens=8,
                               messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    with anthropic.Anthropic(base_url=gateway.url, api_key="wrong-key", max_retries=0, timeout=5.0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as denied:
            bad.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert denied.value.body["error"]["type"] == "authentication_error"
    assert "Invalid API key" in denied.value.body["error"]["message"]


def test_app_count_tokens_counts_the_prompt_the_policy_would_see(session_client, gateway):
    client, _ = session_client
    counted = client.messages.count_tokens(model=MODEL, system="s", messages=[{"role": "user", "content": "hello"}])
    prompt = gateway.tokenizer.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}], add_generation_prompt=True)
    assert counted.input_tokens == len(prompt if isinstance(prompt, list) else prompt["input_ids"])
