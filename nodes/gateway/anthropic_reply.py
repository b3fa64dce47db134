"""The way out of the gateway's Anthropic Messages API: an OpenAI chat.completion as an Anthropic
Message (``from_openai_response``), or as the server-sent events of a streamed reply (``StreamEvents``,
``stream_events``, ``format_sse``). Pure shapes, no socket; the way in is ``anthropic_api``.

Streaming (``StreamEvents``): message_start when generation starts, the thinking block's and the text
block's deltas while the policy generates (nodes/gateway/feed.py decides what is safe to send), then
the rest from the finished completion: tool_use blocks, stop reason and usage.

    .venv/bin/python -m pytest tests/test_gateway_anthropic.py -q
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from nodes.gateway.anthropic_api import AnthropicError



def _first_choice(resp: Any) -> dict:
    choices = resp.get("choices") if isinstance(resp, dict) else None
    if not choices or not isinstance(choices[0], dict):
        shown = json.dumps(resp, ensure_ascii=False, default=str)[:2000]
        raise AnthropicError(502, f"upstream returned no choices (an error body?): {shown}")
    return choices[0]


def _text_of(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def _parse_arguments(arguments: Any) -> dict:
    """A tool call's JSON arguments as the tool_use input object.

    A policy in training emits broken JSON now and then; passing it on under one key lets the agent
    report the bad call back to the model (a learning signal) instead of failing the whole request."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except (TypeError, ValueError):
        parsed = None
    return parsed if isinstance(parsed, dict) else {"_unparsed_arguments": str(arguments)}


def _stop(choice: dict, has_tool_use: bool) -> tuple[str, Optional[str]]:
    finish = choice.get("finish_reason")
    if finish == "length":
        return "max_tokens", None
    if has_tool_use or finish in ("tool_calls", "function_call"):
        return "tool_use", None
    matched = choice.get("stop_reason")  # vLLM names the stop string that ended generation here
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    if finish == "content_filter":
        return "refusal", None
    return "end_turn", None


def _message_id(resp: dict) -> str:
    rid = str(resp.get("id") or uuid.uuid4().hex)
    return rid if rid.startswith("msg_") else "msg_" + rid.removeprefix("chatcmpl-")


def from_openai_response(resp: dict, model: str, thinking: bool = True) -> dict:
    """An OpenAI chat.completion as an Anthropic Message: a thinking block (the reply's
    ``reasoning_content``, unless ``thinking`` is false: the request disabled it), the text, then one
    tool_use per tool call (same ids), stop_reason from finish_reason (stop_sequence from the choice's
    ``stop_reason``, the stop string that matched), usage from prompt/completion tokens. ``model`` is
    the name the client asked for. Raises AnthropicError(502) showing the body when it has no choices."""
    choice = _first_choice(resp)
    message = choice.get("message") or {}
    content: list[dict] = []
    if thinking and message.get("reasoning_content"):
        # No signature: nothing signs the policy's reasoning (a client sending it back has it dropped).
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    text = _text_of(message.get("content"))
    if text:
        content.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append({
            "type": "tool_use",
            "id": call.get("id") or "toolu_" + uuid.uuid4().hex[:24],
            "name": function.get("name", ""),
            "input": _parse_arguments(function.get("arguments")),
        })
    stop_reason, stop_sequence = _stop(choice, any(block["type"] == "tool_use" for block in content))
    usage = resp.get("usage") or {}
    return {
        "id": _message_id(resp),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": int(usage.get("prompt_tokens") or 0),
            "output_tokens": int(usage.get("completion_tokens") or 0),
        },
    }


class StreamEvents:
    """The server-sent events of one streamed reply, built in the order they go out: ``opening``
    (message_start), ``thought`` (a thinking block's deltas) and ``text`` (the text block's deltas),
    each block opened on its first delta, then ``closing`` from the finished completion (the rest of
    the thinking and the text, the open block's stop, a tool_use block per call, message_delta with stop
    reason and output tokens, message_stop). Write each with format_sse. ``thinking`` false: thinking
    deltas are not sent (the request disabled thinking)."""

    def __init__(self, model: str, thinking: bool = True):
        self.model = model
        self.thinking = thinking
        self.open: str | None = None  # the kind of block being streamed
        self.index = -1

    @property
    def text_open(self) -> bool:
        return self.open == "text"

    def opening(self, rid: str, input_tokens: int) -> list[tuple[str, dict]]:
        start = {"id": _message_id({"id": rid}), "type": "message", "role": "assistant", "model": self.model,
                 "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
        return [("message_start", {"type": "message_start", "message": start})]

    def _block(self, kind: str, block: dict) -> list[tuple[str, dict]]:
        events = self._close()
        self.index += 1
        self.open = kind
        return events + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})]

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def thought(self, delta: str) -> list[tuple[str, dict]]:
        if not self.thinking or not delta:
            return []
        events = [] if self.open == "thinking" else self._block(
            "thinking", {"type": "thinking", "thinking": "", "signature": ""})
        return events + [("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                  "delta": {"type": "thinking_delta", "thinking": delta}})]

    def text(self, delta: str) -> list[tuple[str, dict]]:
        events = [] if self.open == "text" else self._block("text", {"type": "text", "text": ""})
        return events + [("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                  "delta": {"type": "text_delta", "text": delta}})]

    def closing(self, resp: dict, rest: list[str], rest_thinking: str = "") -> list[tuple[str, dict]]:
        """``rest``: the pieces of the text not yet sent (the whole text, when nothing was);
        ``rest_thinking``: the reasoning not yet sent."""
        message = from_openai_response(resp, self.model, self.thinking)
        events = self.thought(rest_thinking)
        events += [e for piece in rest if piece for e in self.text(piece)]
        events += self._close()
        for block in message["content"]:
            if block["type"] != "tool_use":
                continue
            opening = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            # The parsed input, re-serialised: the SDK parses the concatenated partial_json, so it
            # must be valid JSON even when the model's own arguments were not.
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
            events += self._block("tool_use", opening)
            events.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                   "delta": delta}))
            events += self._close()
        events.append(("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
            "usage": {"output_tokens": message["usage"]["output_tokens"]},
        }))
        events.append(("message_stop", {"type": "message_stop"}))
        return events


def stream_events(resp: dict, model: str, thinking: bool = True) -> list[tuple[str, dict]]:
    """The server-sent events of a streamed Anthropic reply carrying the finished completion ``resp``
    (a reply routed to another model, or built by a test's stand-in upstream)."""
    events = StreamEvents(model, thinking)
    message = _first_choice(resp).get("message", {})
    text = _text_of(message.get("content"))
    input_tokens = int((resp.get("usage") or {}).get("prompt_tokens") or 0)
    return [*events.opening(str(resp.get("id") or uuid.uuid4().hex), input_tokens),
            *events.closing(resp, [text], message.get("reasoning_content") or "")]


def format_sse(event: str, data: dict) -> bytes:
    """One server-sent event as bytes: ``event: <name>\\ndata: <json>\\n\\n``."""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {payload}\n\n".encode("utf-8")
