"""The gateway's Anthropic Messages API, its pure translation functions (anthropic_api the way in,
anthropic_reply the way out), without a socket. The real anthropic SDK against a server built on them,
and against the gateway's real app, is tests/test_gateway_anthropic_sdk.py.

    .venv/bin/python -m pytest tests/test_gateway_anthropic.py -q
"""

from __future__ import annotations

import json

import pytest

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


def test_sampling_fields_translate():
    out = to_openai_request(request(temperature=0.5, top_p=0.9, stop_sequences=["\n\nHuman:"],
                                    metadata={"user_id": "session-7"}))
    assert out["temperature"] == 0.5 and out["top_p"] == 0.9
    assert out["stop"] == ["\n\nHuman:"] and out["user"] == "session-7"


def test_top_k_output_format_and_a_strict_tool_translate():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = to_openai_request(request(top_k=40, output_config={"effort": "high", "format": {
        "type": "json_schema", "schema": schema}}, tools=[{**WEATHER, "strict": True}]))
    assert out["top_k"] == 40 and out["tools"][0]["function"]["strict"] is True
    assert out["response_format"] == {"type": "json_schema",
                                      "json_schema": {"name": "output", "schema": schema, "strict": True}}


@pytest.mark.parametrize("extra, field", [
    ({"output_config": {"effort": "high", "verbosity": "low"}}, "output_config.verbosity"),
    ({"mcp_servers": []}, "mcp_servers"),
    ({"some_future_field": 1}, "some_future_field"),
])
def test_fields_the_gateway_cannot_honour_are_refused_naming_them(extra, field):
    with pytest.raises(AnthropicError) as caught:
        to_openai_request(request(**extra))
    assert caught.value.status == 400 and caught.value.message.startswith(f"{field}: not supported")


def test_system_entries_inside_messages_join_the_system_prompt_in_order():
    out = to_openai_request(request(system="top", messages=[
        {"role": "user", "content": "q"}, {"role": "system", "content": [{"type": "text", "text": "mid"}]}]))
    assert out["messages"] == [{"role": "system", "content": "top\nmid"}, {"role": "user", "content": "q"}]


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
    (request(messages=[{"role": "tool", "content": "x"}]), "messages.0.role"),
    (request(context_management={"edits": [{"type": "clear_tool_uses_20250919"}]}),
     "context_management.edits.0.type"),
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
