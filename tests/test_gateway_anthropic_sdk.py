"""The real anthropic SDK against the gateway's Anthropic Messages API: first a tiny aiohttp server built
on the pure translation functions (tested one by one in tests/test_gateway_anthropic.py), then the
gateway's real app.

Both servers' models are deterministic test doubles for the policy: they echo the last user text,
call the offered tool, and report a tool's result back in words. The tiny server's double works on
OpenAI requests (and shows the system prompt in brackets); the real app's works on token ids.

    .venv/bin/python -m pytest tests/test_gateway_anthropic_sdk.py -q
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
    estimate_tokens,
    invalid_api_key,
    to_openai_request,
)
from nodes.gateway.anthropic_reply import format_sse, from_openai_response, stream_events
from tests.test_gateway_anthropic import MODEL, TOKEN, WEATHER, call, completion

pytestmark = pytest.mark.timeout(30)


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

        from areal_bus.wire.messages import Completion

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
