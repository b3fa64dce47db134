"""Claude Code 2.1.197's first request, replayed byte for byte (tests/claude_code_2.1.197_request.json:
its path, headers and body as captured, with 25 tools, a system entry inside ``messages``, adaptive
thinking, context_management and effort) against the real gateway on loopback, with a session key in
x-api-key as Claude Code sends ANTHROPIC_API_KEY. Served (200), streamed as Claude Code asked and
not, and recorded: the session's trajectory holds the prompt with the system entry folded into the
system prompt. tests/test_claude_code.py runs Claude Code itself, where it is installed.

    .venv/bin/python -m pytest tests/test_gateway_claude_replay.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.test_gateway_openai import ScriptedBackend, gateway, tokenizer  # noqa: F401
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

pytestmark = pytest.mark.timeout(60)

CAPTURED = json.loads((Path(__file__).resolve().parent / "claude_code_2.1.197_request.json").read_text())


def sse_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def replay(gw, key: str, **body_changes) -> httpx.Response:
    headers = {**CAPTURED["headers"], "x-api-key": key, "content-type": "application/json"}
    body = json.dumps({**CAPTURED["body"], **body_changes}).encode()
    return httpx.post(gw.url + CAPTURED["path"], content=body, headers=headers, timeout=60)


def test_the_captured_request_has_what_the_gateway_must_accept():
    body = CAPTURED["body"]
    assert [m["role"] for m in body["messages"]] == ["user", "system"]  # the entry 2.1.197's 400 was about
    assert body["stream"] is True and len(body["tools"]) == 25 and body["model"] == "policy"


def test_claude_codes_first_request_is_served_streamed_and_recorded_with_its_system_entry_folded_in(gateway):
    # char-level tokens: Claude Code's 87 kB request is ~90k of them
    gw = gateway(backend=ScriptedBackend(["Hello! How can I help?", "Hello again."]), max_context_tokens=200_000,
                 max_body_bytes=1 << 20)
    s = gw.open_session()
    r = replay(gw, s["api_key"])
    assert r.status_code == 200, r.text[:2000]
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    names = [e for e, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    text = "".join(d["delta"]["text"] for e, d in events if e == "content_block_delta" and d["delta"]["type"] ==
                   "text_delta")
    stop = next(d for e, d in events if e == "message_delta")
    assert text == "Hello! How can I help?" and stop["delta"]["stop_reason"] == "end_turn"

    whole = replay(gw, s["api_key"], stream=False)  # the same request unstreamed
    assert whole.status_code == 200, whole.text[:2000]
    msg = whole.json()
    assert msg["type"] == "message" and msg["content"] == [{"type": "text", "text": "Hello again."}]
    assert msg["model"] == "policy" and msg["usage"]["input_tokens"] == gw.backend.history[-1][0].size

    assert gw.post(f"/rl/sessions/{s['session_id']}/end").status_code == 200
    assert gw.emitted and all(t.loss_mask.sum() > 0 for t in gw.emitted)
    prompt = tokenizer().decode(gw.emitted[0].prompt_ids)
    system_entry = CAPTURED["body"]["messages"][1]["content"]
    system_entry = system_entry if isinstance(system_entry, str) else system_entry[0]["text"]
    assert prompt.startswith("<|im_start|>system\n") and prompt.count("<|im_start|>") == 3  # system, user, header
    user_turn = prompt.index("<|im_start|>user\n")
    assert prompt.index(system_entry[:200]) < user_turn  # folded into the system prompt, before the user turn
    assert prompt.index("You are a Claude agent") < user_turn
    assert prompt[user_turn:].endswith("hello<|im_end|>\n<|im_start|>assistant\n")
