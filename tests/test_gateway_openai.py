"""Gateway, OpenAI side: the real openai SDK and LangChain's ChatOpenAI against the aiohttp server on a
loopback port, serving the shipped tiny policy (models/tiny-guess) through LocalEngineBackend.

    .venv/bin/python -m pytest tests/test_gateway_openai.py -q
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from areal_bus.wire.messages import Completion
from areal_bus.config.node_configs import GatewayConfig
from nodes.gateway.app import GATEWAY, bound_port, make_app, start_server
from nodes.gateway.backend import LocalEngineBackend
from nodes.gateway.chat import ChatRenderer, parse_tool_calls

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "tiny-guess"
ADMIN = "test-admin-token"
POLICY = "policy"
GAME = "Guess my number (1-16) in 5 tries. I say higher or lower."
# With greedy sampling the tiny policy answers this conversation "10" then eos: three tokens.
TEN = [{"role": "user", "content": GAME}, {"role": "assistant", "content": "8"},
       {"role": "user", "content": "higher (10-16)"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@functools.cache
def policy():
    from areal_bus.model.modeling import load_pretrained

    return load_pretrained(MODEL_DIR, torch.device("cpu"), torch.float32)


def torch_backend(max_batch: int = 32, max_len: int = 512) -> LocalEngineBackend:
    from areal_bus.engines.torch_engine import TorchRolloutEngine

    return LocalEngineBackend(TorchRolloutEngine(policy(), max_batch=max_batch, max_len=max_len, tokenizer=tokenizer()),
                              keep_history=True)


class ScriptedBackend:
    """A policy that says what it is told: each reply's text becomes its sampled ids (+ eos)."""

    def __init__(self, replies: list[str], delay_s: float = 0.0):
        self.replies = list(replies)
        self.delay_s = delay_s
        self.history: list[tuple[np.ndarray, Completion]] = []
        self.max_context_tokens = 4096  # char-level tokens: the tools text alone is ~600

    async def generate(self, session_id, prompt_ids, params):
        await asyncio.sleep(self.delay_s)
        tok = tokenizer()
        ids = np.asarray(tok.encode(self.replies.pop(0), add_special_tokens=False) + [tok.eos_token_id], np.int32)
        comp = Completion(f"r{len(self.history)}", session_id, 0, "scripted", ids,
                          np.full(ids.size, -0.5, np.float32), np.full(ids.size, 7, np.int32), "stop")
        self.history.append((np.asarray(prompt_ids), comp))
        return comp

    def close(self):
        pass


class Server:
    """The gateway in a background thread with its own uvloop event loop, on a free loopback port."""

    def __init__(self, backend=None, router=None, admission=None, emit=None, **cfg):
        self.backend = backend or torch_backend()
        self.cfg = GatewayConfig(admin_token=ADMIN, port=0, **cfg)
        self.emitted: list = []
        self._ready = threading.Event()
        self._kw = dict(router=router, admission=admission, emit=emit or self.emitted.append)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise AssertionError("gateway did not start within 10 s")
        if self._error is not None:
            raise self._error

    def _serve(self):
        import uvloop

        self._error = None
        self.loop = uvloop.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.app = make_app(self.cfg, self.backend, tokenizer(), **self._kw)
            self.gateway = self.app[GATEWAY]
            self.runner = self.loop.run_until_complete(start_server(self.app, self.cfg))
            self.port = bound_port(self.runner)
        except Exception as exc:  # reported to the test thread
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str = ADMIN, prefix: str = "/v1", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + prefix, api_key=key, **{"max_retries": 0, "timeout": 30, **kw})

    def post(self, path: str, body=None, key: str | None = ADMIN, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=30, **kw)

    def open_session(self, **body) -> dict:
        r = self.post("/rl/sessions", body or None)
        assert r.status_code == 201, r.text
        return r.json()

    def call(self, fn):
        """Run ``fn()`` on the server's loop thread and return its result (store access in tests)."""
        done = threading.Event()
        out = {}

        def run():
            out["v"] = fn()
            done.set()
        self.loop.call_soon_threadsafe(run)
        assert done.wait(10)
        return out["v"]

    def close(self):
        """Stop serving: the app shuts down (open sessions are ended and emitted), then the backend."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        self.backend.close()


@pytest.fixture
def gateway():
    """``gateway(backend=None, router=None, admission=None, emit=None, **GatewayConfig fields)`` -> a running
    Server (emitted trajectories collect in ``.emitted`` unless ``emit`` is given)."""
    servers = []

    def start(**kw):
        servers.append(Server(**kw))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


def ask(client, messages=TEN, **kw):
    return client.chat.completions.create(model=POLICY, messages=messages, temperature=0, **kw)


# -- chat completions ---------------------------------------------------------------------------------

def test_chat_completion_answers_with_usage_equal_to_the_engines_token_counts(gateway):
    gw = gateway()
    r = ask(gw.client())
    prompt, comp = gw.backend.history[-1]
    assert r.choices[0].message.content == "10" and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == prompt.size
    assert r.usage.completion_tokens == comp.output_ids.size == 3  # "1", "0", eos
    assert r.usage.total_tokens == prompt.size + 3


def test_streaming_yields_the_same_text_then_usage_then_done(gateway):
    gw = gateway()
    chunks = list(ask(gw.client(), stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == "10" and finish == ["stop"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_stream_ends_with_done_on_the_wire(gateway):
    gw = gateway()
    r = gw.post("/v1/chat/completions", {"model": POLICY, "messages": TEN, "temperature": 0, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_n_returns_n_choices_each_a_sequence_of_the_batch(gateway):
    gw = gateway()
    r = gw.client().chat.completions.create(model=POLICY, messages=TEN, n=2, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == sum(c.output_ids.size for _, c in gw.backend.history[-2:])
    chunks = list(gw.client().chat.completions.create(model=POLICY, messages=TEN, n=2, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_caps_the_output_and_finishes_with_length(gateway, param):
    gw = gateway()
    r = ask(gw.client(), **{param: 1})
    assert r.choices[0].message.content == "1" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 1 == gw.backend.history[-1][1].output_ids.size


def test_single_token_stop_ends_generation_in_the_engine(gateway):
    gw = gateway()
    r = ask(gw.client(), stop="0")
    assert r.choices[0].message.content == "1" and r.choices[0].finish_reason == "stop"
    assert gw.backend.history[-1][1].output_ids.size == 2  # the engine stopped on "0": no eos sampled
    assert r.usage.completion_tokens == 2


def test_multi_token_stop_cuts_the_text_before_it(gateway):
    gw = gateway()
    r = ask(gw.client(), stop=["10", "zz"])
    assert r.choices[0].message.content == "" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 2  # "1" "0": through the token that completed the stop


def test_models_lists_the_policy(gateway):
    gw = gateway()
    assert [m.id for m in gw.client().models.list()] == [POLICY]
    assert gw.client().models.retrieve(POLICY).id == POLICY


def test_gateway_prefix_serves_the_same_api(gateway):
    gw = gateway()
    client = gw.client(prefix="/gateway/v1")
    assert ask(client).choices[0].message.content == "10"
    assert [m.id for m in client.models.list()] == [POLICY]


def test_logprobs_are_the_sampled_tokens_logprobs(gateway):
    gw = gateway()
    r = ask(gw.client(), logprobs=True)
    comp = gw.backend.history[-1][1]
    got = [t.logprob for t in r.choices[0].logprobs.content]
    assert [t.token for t in r.choices[0].logprobs.content] == ["1", "0"]
    assert np.allclose(got, comp.logprobs[:2])


def test_langchain_chat_openai_invokes_and_streams(gateway):
    from langchain_openai import ChatOpenAI

    gw = gateway()
    llm = ChatOpenAI(model=POLICY, base_url=gw.url + "/v1", api_key=ADMIN, temperature=0, max_retries=0)
    msgs = [("user", GAME), ("assistant", "8"), ("user", "higher (10-16)")]
    assert llm.invoke(msgs).content == "10"
    assert "".join(c.content for c in llm.stream(msgs)) == "10"


# -- bad input: a 4xx in OpenAI's error shape, and the server keeps serving ---------------------------

BAD = [
    ("bad_json", b"{not json", None, 400, "invalid_json", None),
    ("not_object", b"[1, 2]", None, 400, "invalid_body", None),
    ("no_messages", {"model": POLICY}, None, 400, "missing_required_parameter", "messages"),
    ("no_model", {"messages": TEN}, None, 400, "missing_required_parameter", "model"),
    ("temperature_string", {"model": POLICY, "messages": TEN, "temperature": "hot"}, None, 400, "invalid_value",
     "temperature"),
    ("max_tokens_string", {"model": POLICY, "messages": TEN, "max_tokens": "5"}, None, 400, "invalid_value",
     "max_tokens"),
    ("content_number", {"model": POLICY, "messages": [{"role": "user", "content": 5}]}, None, 400, "invalid_value",
     "messages[0].content"),
    ("bad_role", {"model": POLICY, "messages": [{"role": "robot", "content": "x"}]}, None, 400, "invalid_value",
     "messages[0].role"),
    ("image_part", {"model": POLICY, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400,
     "invalid_value", "messages[0].content[0]"),
    ("n_zero", {"model": POLICY, "messages": TEN, "n": 0}, None, 400, "invalid_value", "n"),
    ("unknown_model", {"model": "gpt-5", "messages": TEN}, None, 404, "model_not_found", "model"),
    ("too_long", {"model": POLICY, "messages": [{"role": "user", "content": "x" * 600}]}, None, 400,
     "context_length_exceeded", "messages"),
    ("bad_key", {"model": POLICY, "messages": TEN}, "sk-wrong", 401, "invalid_api_key", None),
    ("no_key", {"model": POLICY, "messages": TEN}, "", 401, "invalid_api_key", None),
    ("too_large", {"model": POLICY, "messages": [{"role": "user", "content": "x" * 5000}]}, None, 413,
     "request_too_large", None),
]


@pytest.mark.parametrize("body, key, status, code, param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_is_a_4xx_in_openai_error_shape_and_the_server_keeps_serving(gateway, body, key, status, code,
                                                                                  param):
    gw = gateway(max_body_bytes=4096)
    headers = {"Authorization": f"Bearer {key if key is not None else ADMIN}"} if key != "" else {}
    kw = {"content": body, "headers": {**headers, "Content-Type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body, "headers": headers}
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["code"] == code and err["param"] == param
    assert ask(gw.client()).choices[0].message.content == "10"


def test_sdk_raises_the_matching_exception_classes(gateway):
    gw = gateway()
    with pytest.raises(openai.AuthenticationError, match="whitespace or a newline"):
        ask(gw.client(key="nope"))
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        gw.client().chat.completions.create(model="gpt-5", messages=TEN)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512 tokens"):
        gw.client().chat.completions.create(model=POLICY, messages=[{"role": "user", "content": "y" * 600}])


class FailingBackend(ScriptedBackend):
    async def generate(self, session_id, prompt_ids, params):
        if not self.replies:
            raise RuntimeError("no rollout worker alive after 30 s")
        return await super().generate(session_id, prompt_ids, params)


def test_a_backend_failure_is_a_503_in_openai_shape_and_the_next_request_is_served(gateway):
    gw = gateway(backend=FailingBackend([]))
    r = gw.post("/v1/chat/completions", {"model": POLICY, "messages": TEN})
    assert r.status_code == 503 and "no rollout worker" in r.json()["error"]["message"]
    gw.backend.replies.append("fine")
    assert ask(gw.client()).choices[0].message.content == "fine"


def test_unknown_route_and_wrong_method_are_openai_errors(gateway):
    gw = gateway()
    r = httpx.get(gw.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    r = httpx.get(gw.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


# -- router for other models ---------------------------------------------------------------------------

class FakeRouter:
    class Error(Exception):
        def __init__(self, status, body, kind="upstream"):
            super().__init__(f"upstream said {status}")
            self.status, self.body, self.kind = status, body, kind

    def __init__(self):
        self.calls = []

    async def chat(self, model, request):
        self.calls.append((model, request))
        if model == "judge-down":
            raise self.Error(503, json.dumps({"error": {"message": "overloaded", "type": "server_error"}}))
        if model == "nobody":
            raise self.Error(None, None, kind="unknown_model")
        return {"id": "cmpl-x", "object": "chat.completion", "created": 1, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "judged: 7/10"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}


def test_other_models_go_to_the_router_streamed_or_not(gateway):
    router = FakeRouter()
    gw = gateway(router=router)
    r = gw.client().chat.completions.create(model="judge", messages=TEN)
    assert r.choices[0].message.content == "judged: 7/10"
    text = "".join(c.choices[0].delta.content or "" for c in
                   gw.client().chat.completions.create(model="judge", messages=TEN, stream=True) if c.choices)
    assert text == "judged: 7/10"
    assert all("stream" not in req for _, req in router.calls)


def test_router_errors_keep_their_status_in_openai_shape(gateway):
    gw = gateway(router=FakeRouter())
    r = gw.post("/v1/chat/completions", {"model": "judge-down", "messages": TEN})
    assert r.status_code == 503 and r.json()["error"]["message"] == "overloaded"
    r = gw.post("/v1/chat/completions", {"model": "nobody", "messages": TEN})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# -- tool calls -----------------------------------------------------------------------------------------

def test_parser_reads_qwen_tool_call_blocks_into_openai_tool_calls():
    content, calls = parse_tool_calls('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                      '{"city": "Paris"}}\n</tool_call>\n<tool_call>{"name": "now"}</tool_call>')
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("now", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize("text", ["no tools here", "<tool_call>{not json}</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "x"'])
def test_parser_leaves_anything_but_well_formed_calls_as_content(text):
    assert parse_tool_calls(text) == (text, [])


def test_tools_are_written_into_the_system_message_when_the_template_ignores_them():
    r = ChatRenderer(tokenizer())
    assert not r.template_tools
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = r.decode(r.prompt_ids(convo, [WEATHER]))
    assert text.startswith("system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in text
    assert 'assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "user\n<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("assistant\n")


TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTOOLS:' }}{%- for t in tools %}{{- t.function.name + ';' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{- 'CALL ' + c.function.name + ' ' + (c.function.arguments | tojson) }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_template_that_knows_tools_gets_them_as_structured_data():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    tok.chat_template = TOOL_TEMPLATE
    r = ChatRenderer(tok)
    assert r.template_tools and r.template_tool_calls
    convo = [{"role": "user", "content": "w?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "rain"}]
    text = r.decode(r.prompt_ids(convo, [WEATHER]))
    assert text == ('system\nTOOLS:get_weather;\nuser\nw?\nassistant\nCALL get_weather {"city": "Oslo"}\n'
                    'tool\nrain\nassistant\n')


def test_continuation_is_the_template_text_after_the_previous_assistant_turn():
    r = ChatRenderer(tokenizer())
    first = [{"role": "user", "content": GAME}]
    sampled = r.encode("8") + [r.eos_id]
    later = [{"role": "user", "content": "higher (9-16)"}]
    ids = r.prompt_ids(first) + sampled + r.continuation_ids(later, None, closed=True)
    assert ids == r.prompt_ids(first + [{"role": "assistant", "content": "8"}] + later)
    cut = r.prompt_ids(first) + r.encode("8") + r.continuation_ids(later, None, closed=False)
    assert cut == ids  # a turn cut short gets the eos the template would have put there


def test_tool_call_round_trip_through_the_sdk_and_langchain(gateway):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    backend = ScriptedBackend([call, "Sunny in Paris.", call, call, "Sunny."])
    gw = gateway(backend=backend)
    s = gw.open_session()
    client = gw.client(key=s["api_key"])
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=POLICY, messages=msgs, tools=[WEATHER])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
    msgs += [msg.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"}]
    r2 = client.chat.completions.create(model=POLICY, messages=msgs, tools=[WEATHER])
    assert r2.choices[0].message.content == "Sunny in Paris."
    # the second turn continued the first: its prompt is the first prompt + sampled ids + the tool result
    (p1, c1), (p2, _) = backend.history
    assert np.array_equal(p2[:p1.size + c1.output_ids.size], np.concatenate([p1, c1.output_ids]))
    assert "<tool_response>\nsunny\n</tool_response>" in tokenizer().decode(p2[p1.size + c1.output_ids.size:])

    streamed = list(gw.client().chat.completions.create(model=POLICY, messages=msgs[:1], tools=[WEATHER], stream=True))
    deltas = [tc for c in streamed if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and streamed[-1].choices[0].finish_reason == "tool_calls"

    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return "sunny"

    s2 = gw.open_session()  # LangChain sends its history back re-serialised: it must still match
    llm = ChatOpenAI(model=POLICY, base_url=gw.url + "/v1", api_key=s2["api_key"], max_retries=0)
    llm = llm.bind_tools([get_weather])
    ai = llm.invoke([HumanMessage("Weather in Paris?")])
    assert ai.tool_calls[0]["name"] == "get_weather" and ai.tool_calls[0]["args"] == {"city": "Paris"}
    assert llm.invoke([HumanMessage("Weather in Paris?"), ai,
                       ToolMessage("sunny", tool_call_id=ai.tool_calls[0]["id"])]).content == "Sunny."
    (p1, c1), (p2, _) = backend.history[-2:]
    assert np.array_equal(p2[:p1.size + c1.output_ids.size], np.concatenate([p1, c1.output_ids]))


def test_anthropic_messages_route_serves_the_policy(gateway):
    import anthropic

    gw = gateway()
    client = anthropic.Anthropic(base_url=gw.url, api_key=ADMIN, max_retries=0)
    msg = client.messages.create(model=POLICY, max_tokens=8, extra_body={"temperature": 0},
                                 messages=[{"role": "user", "content": GAME}, {"role": "assistant", "content": "8"},
                                           {"role": "user", "content": "higher (10-16)"}])
    assert msg.content[0].text == "10" and msg.stop_reason == "end_turn"
    with pytest.raises(anthropic.NotFoundError, match="ANTHROPIC_MODEL"):
        client.messages.create(model="claude-sonnet-4", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
