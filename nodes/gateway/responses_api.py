"""OpenAI's Responses API as the gateway speaks it: a Responses request -> the gateway's chat request,
and the chat completion -> a Response object or its stream of events. No sockets here.

The Responses API is a translation layer over the chat path (as anthropic_api is for Messages), so a
Responses call is served, recorded, admitted and checked exactly as a chat completion is:

- ``input`` (a string, or items): ``message`` items (roles user / system / developer / assistant, with
  input_text / output_text parts) become chat messages; ``function_call`` items become the tool_calls of
  the assistant message they follow; ``function_call_output`` items become ``tool`` messages;
  ``reasoning`` items ride on the next assistant message as ``reasoning_content``. ``instructions`` is a
  system message first. What the conversation held before (``previous_response_id``) goes in between:
  the caller passes it as ``history``.
- ``tools`` (function tools only, ``strict`` as the chat tool's), ``tool_choice``,
  ``parallel_tool_calls``, ``temperature``, ``top_p``, ``max_output_tokens``, ``text.format`` (->
  ``response_format``), ``top_logprobs`` and ``include: ["message.output_text.logprobs"]`` (->
  ``logprobs``) go to the chat request, whose checks apply (a field the chat path refuses is refused
  here with the chat path's message, the field named as this request names it: ``responses_param``).
  So ``text.format`` json_schema and a ``strict`` tool's arguments are enforced by a grammar
  (nodes/gateway/structured.py), as on the chat path.
- A field the gateway cannot honour is a 400 naming it (``background``, ``conversation``, ``prompt``,
  ``truncation: "auto"``, ``reasoning.effort``, non-function tools, an ``include`` it cannot fill, ...),
  and so is a field it does not know. ``store: false`` keeps nothing for ``previous_response_id``;
  ``metadata``, ``user``, ``safety_identifier`` and ``prompt_cache_key`` are echoed back and do nothing
  else.

The reply: ``response_object`` builds the Response (output items: reasoning, the message with its
output_text, one ``function_call`` per tool call; ``status`` "incomplete" with reason
``max_output_tokens`` when the budget ran out) and ``StreamEvents`` the SSE events a streamed one sends,
in the order OpenAI's server sends them (response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta ... done,
response.function_call_arguments.delta / done, response.output_item.done, response.completed).
"""

from __future__ import annotations

import json
import re
import time

from nodes.gateway.openai_api import OpenAIError

_ACCEPTED = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p",
             "max_output_tokens", "text", "top_logprobs", "include", "stream", "stream_options", "store",
             "previous_response_id", "metadata", "user", "safety_identifier", "prompt_cache_key", "truncation",
             "reasoning", "service_tier"}
"""Request fields the gateway acts on (or checks and echoes). Anything else is a 400 naming it."""

_REFUSED = {
    "background": "background responses are not kept: send the request without background and wait for it",
    "conversation": "the Conversations API is not served: send previous_response_id, or the whole input",
    "prompt": "stored prompt templates are not served: send instructions and input",
    "max_tool_calls": "the gateway does not cap tool calls per response (parallel_tool_calls: false gives one)",
    "context_management": "server-side compaction is not done: the trainer needs the tokens as sent",
    "prompt_cache_retention": "there is no prompt cache to keep",
    "prompt_cache_options": "there is no prompt cache to configure",
    "moderation": "no moderation model runs here",
    "image": "images are not served",
    "access_programs": "no access programs here",
    "background_options": "background responses are not kept",
}
"""Fields that do something on OpenAI's server the gateway cannot do: a 400 when sent with a value."""

INCLUDE_LOGPROBS = "message.output_text.logprobs"


def _bad(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def _text_of(parts, param: str, allowed: tuple[str, ...]) -> str:
    """The text of a message's content: a string or a list of text parts of the ``allowed`` types."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise _bad(param, f"Invalid value for '{param}': a string or a list of content parts.")
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed or not isinstance(part.get("text"), str):
            raise _bad(f"{param}[{j}]", f"Invalid content part '{param}[{j}]' (type {kind!r}): the policy reads "
                       f"text only, as parts of type {' / '.join(allowed)} with a 'text' string.")
        out.append(part["text"])
    return "".join(out)


def input_messages(body: dict) -> list[dict]:
    """The request's ``input`` as chat messages (without ``instructions``)."""
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input", "Missing or invalid 'input': a string, or a non-empty list of input items.",
                   "missing_required_parameter" if items is None else "invalid_value")
    out: list[dict] = []
    reasoning = None
    for i, item in enumerate(items):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(p, f"Invalid value for '{p}': an input item is an object.")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{p}.role", f"Invalid value for '{p}.role': user, system, developer or assistant "
                           f"(got {role!r}).")
            allowed = ("output_text",) if role == "assistant" else ("input_text",)
            if role == "assistant" and isinstance(item.get("content"), list) and any(
                    isinstance(c, dict) and c.get("type") == "input_text" for c in item["content"]):
                allowed = ("output_text", "input_text")
            msg = {"role": role, "content": _text_of(item.get("content"), f"{p}.content", allowed)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            for field in ("call_id", "name", "arguments"):
                if not isinstance(item.get(field), str):
                    raise _bad(f"{p}.{field}", f"Missing or invalid '{p}.{field}': a string.")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)  # the calls of the reply they came with
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                out.append(msg)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{p}.call_id", f"Missing or invalid '{p}.call_id': a string.")
            text = _text_of(item.get("output"), f"{p}.output", ("input_text", "output_text"))
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            texts = [c.get("text") for c in (item.get("content") or []) if isinstance(c, dict)]
            texts = texts or [c.get("text") for c in (item.get("summary") or []) if isinstance(c, dict)]
            if item.get("encrypted_content"):
                raise _bad(f"{p}.encrypted_content", "Encrypted reasoning is not produced or read here.")
            reasoning = "".join(t for t in texts if isinstance(t, str))
        else:
            raise _bad(f"{p}.type", f"Unsupported input item type {kind!r} in '{p}': the gateway takes message, "
                       f"function_call, function_call_output and reasoning items.")
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "Invalid value for 'tools': a list of function tools.")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _bad(f"tools[{i}].type", f"Unsupported tool type {kind!r} in 'tools[{i}]': the policy can call "
                       f"function tools only (hosted tools such as web_search run on OpenAI's servers).")
        if not isinstance(tool.get("name"), str):
            raise _bad(f"tools[{i}].name", f"Missing or invalid 'tools[{i}].name': a string.")
        fn = {"name": tool["name"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        if tool.get("parameters") is not None:
            fn["parameters"] = tool["parameters"]
        if tool.get("strict") is not None:
            fn["strict"] = tool["strict"]
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else type(choice).__name__
    raise _bad("tool_choice", f"Unsupported 'tool_choice' {kind!r}: auto, none, required or "
               f"{{\"type\": \"function\", \"name\": ...}}.")


def _response_format(text):
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text", "Invalid value for 'text': an object with 'format'.")
    for key in text:
        if key == "verbosity" and text[key] is not None:
            raise _bad("text.verbosity", "'text.verbosity' cannot be honoured: the policy has no verbosity control.")
        if key not in ("format", "verbosity"):
            raise _bad(f"text.{key}", f"Unknown parameter: 'text.{key}'.", "unknown_parameter")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise _bad("text.format", "Invalid 'text.format': a type of text, json_object or json_schema.")


def check_fields(body: dict) -> None:
    """400 for a field the gateway does not know or cannot honour (see the module doc)."""
    for key, value in body.items():
        if key in _REFUSED:
            if value not in (None, False, [], {}):
                raise _bad(key, f"'{key}' cannot be honoured by this gateway: {_REFUSED[key]}.", "unsupported_parameter")
        elif key not in _ACCEPTED:
            raise _bad(key, f"Unknown parameter: '{key}'.", "unknown_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise _bad("truncation", "'truncation: auto' cannot be honoured: the gateway never drops input (the trainer "
                   "needs the tokens as sent); shorten the input instead.", "unsupported_parameter")
    reasoning = body.get("reasoning")
    if reasoning is not None and (not isinstance(reasoning, dict)
                                  or any(v is not None for v in reasoning.values())):
        raise _bad("reasoning", "'reasoning' cannot be honoured: the policy has no reasoning effort or summary "
                   "setting (send it without reasoning).", "unsupported_parameter")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise _bad("service_tier", "'service_tier' must be auto or default here: the gateway has one tier.")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or opts.get("include_obfuscation")):
        raise _bad("stream_options", "'stream_options.include_obfuscation' cannot be honoured: events are not "
                   "padded.", "unsupported_parameter")
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list):
            raise _bad("include", "Invalid value for 'include': a list.")
        for i, what in enumerate(include):
            if what != INCLUDE_LOGPROBS:
                raise _bad(f"include[{i}]", f"'include[{i}]' ({what!r}) cannot be filled: the gateway can include "
                           f"only {INCLUDE_LOGPROBS!r}.", "unsupported_parameter")
    meta = body.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or len(meta) > 16
                             or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise _bad("metadata", "Invalid value for 'metadata': at most 16 string keys with string values.")
    for key in ("instructions", "previous_response_id", "user", "safety_identifier", "prompt_cache_key"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise _bad(key, f"Invalid value for '{key}': a string.")


def to_chat_request(body, history: list[dict] | None = None) -> tuple[dict, list[dict]]:
    """(the chat request, the request's own new messages: its input as chat messages). ``history``:
    the messages the previous response's conversation held (instructions not included)."""
    if not isinstance(body, dict):
        raise OpenAIError(400, f"The request body must be a JSON object, got {type(body).__name__}.",
                          code="invalid_body")
    check_fields(body)
    new = input_messages(body)
    messages = [*(history or []), *new]
    if body.get("instructions"):
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    chat = {"model": body.get("model"), "messages": messages}
    if chat["model"] is None:
        raise _bad("model", "Missing required parameter: 'model'.", "missing_required_parameter")
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    for src, dst in (("tool_choice", "tool_choice"), ("parallel_tool_calls", "parallel_tool_calls"),
                     ("temperature", "temperature"), ("top_p", "top_p"), ("max_output_tokens", "max_completion_tokens"),
                     ("top_logprobs", "top_logprobs"), ("stream", "stream")):
        if body.get(src) is not None:
            chat[dst] = _tool_choice(body[src]) if src == "tool_choice" else body[src]
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if INCLUDE_LOGPROBS in (body.get("include") or ()) or body.get("top_logprobs"):
        chat["logprobs"] = True
    return chat, new


_PARAMS = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens", "messages": "input"}

_NESTED = (("response_format.json_schema.", "text.format."), ("response_format.", "text.format."))
"""Chat parameter paths whose Responses name differs below the top (tools[i].function.x: tools[i].x)."""


def responses_param(param: str | None) -> str | None:
    """A chat request's parameter as the Responses request names it (response_format -> text.format,
    response_format.json_schema.schema.x -> text.format.schema.x, tools[0].function.parameters ->
    tools[0].parameters)."""
    if not param:
        return param
    for chat, responses in _NESTED:
        if param.startswith(chat):
            return responses + param[len(chat):]
    if param.startswith("tools[") and "].function." in param:
        return param.replace("].function.", "].", 1)
    head, sep, tail = param.partition(".")
    root = head.split("[", 1)[0]
    if root in _PARAMS:
        return "input" if root == "messages" else _PARAMS[root] + head[len(root):] + sep + tail
    return param


def responses_message(message: str) -> str:
    """A chat-path error message with the nested parameter paths it quotes named as in ``responses_param``."""
    for chat, responses in _NESTED:
        message = message.replace(f"'{chat}", f"'{responses}")
    return _TOOL_PATH.sub(r"'tools[\1].", message)


_TOOL_PATH = re.compile(r"'tools\[(\d+)\]\.function\.")


# -- the reply ------------------------------------------------------------------------------------

def response_id(chat_id: str) -> str:
    return "resp_" + chat_id.removeprefix("chatcmpl-")


def usage(chat_usage: dict | None) -> dict:
    u = chat_usage or {}
    i, o = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
    return {"input_tokens": i, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0}, "output_tokens": o,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": i + o}


def _logprobs(choice: dict) -> list[dict]:
    content = (choice.get("logprobs") or {}).get("content") or []
    return [{"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes"),
             "top_logprobs": t.get("top_logprobs") or []} for t in content]


def message_item(rid: str, text: str, logprobs: list | None = None, status: str = "completed") -> dict:
    return {"id": f"msg_{rid[5:]}", "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def call_item(rid: str, k: int, call: dict, status: str = "completed") -> dict:
    return {"id": f"fc_{rid[5:]}_{k}", "type": "function_call", "status": status, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"].get("arguments") or "{}"}


def reasoning_item(rid: str, text: str) -> dict:
    return {"id": f"rs_{rid[5:]}", "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(rid: str, choice: dict) -> list[dict]:
    """A chat choice's message as Response output items: reasoning, the message, its function calls."""
    msg = choice["message"]
    items = []
    if msg.get("reasoning_content"):
        items.append(reasoning_item(rid, msg["reasoning_content"]))
    if msg.get("content") or not msg.get("tool_calls"):
        items.append(message_item(rid, msg.get("content") or "", _logprobs(choice)))
    items += [call_item(rid, k, c) for k, c in enumerate(msg.get("tool_calls") or [])]
    return items


def response_object(body: dict, rid: str, chat: dict | None, output: list[dict] | None = None,
                    status: str | None = None, created: float | None = None) -> dict:
    """The Response for request ``body``: ``chat`` is the chat completion it was served as (None while
    a streamed one is in progress)."""
    choice = chat["choices"][0] if chat else None
    if status is None:
        status = "incomplete" if choice and choice["finish_reason"] == "length" else "completed" if chat else "in_progress"
    tools = [{"type": "function", "name": t["name"], "description": t.get("description"),
              "parameters": t.get("parameters"), "strict": t.get("strict")} for t in body.get("tools") or ()]
    return {
        "id": rid, "object": "response", "created_at": created or time.time(), "status": status,
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "model": body.get("model"), "output": output if output is not None else (output_items(rid, choice) if choice else []),
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": body.get("previous_response_id"),
        "reasoning": None, "store": body.get("store", True), "temperature": body.get("temperature"),
        "text": {"format": body.get("text", {}).get("format") or {"type": "text"}} if isinstance(body.get("text"), dict)
        else {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"), "tools": tools, "top_p": body.get("top_p"),
        "top_logprobs": body.get("top_logprobs"), "truncation": body.get("truncation") or "disabled",
        "usage": usage(chat.get("usage")) if chat else None, "user": body.get("user"),
        "metadata": body.get("metadata") or {}, "safety_identifier": body.get("safety_identifier"),
        "prompt_cache_key": body.get("prompt_cache_key"), "service_tier": body.get("service_tier") or "default",
    }


class StreamEvents:
    """The Responses SSE events of one streamed response, in the order they go out: ``opening``
    (response.created, response.in_progress), ``text`` (the message item opened at the first delta,
    then output_text deltas), ``closing`` from the finished chat completion (the rest of the text,
    the message closed, each function call's item with its arguments, response.completed)."""

    def __init__(self, body: dict, rid: str):
        self.body, self.rid, self.created, self.seq = body, rid, time.time(), 0
        self.items: list[dict] = []  # output items as they are finished, in output order
        self.text_open = False
        self.sent = ""
        self.thinking = None  # the reasoning item's output index while it streams
        self.thought = ""
        self.thought_done = False

    def _ev(self, kind: str, **fields) -> tuple[str, dict]:
        self.seq += 1
        return kind, {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _resp(self, status: str, chat=None) -> dict:
        return response_object(self.body, self.rid, chat, self.items if chat else [], status, self.created)

    def opening(self) -> list[tuple[str, dict]]:
        return [self._ev("response.created", response=self._resp("in_progress")),
                self._ev("response.in_progress", response=self._resp("in_progress"))]

    def _close_reasoning(self, text: str) -> list[tuple[str, dict]]:
        """The streamed reasoning item's last delta (what it did not send of ``text``) and its done events."""
        out = []
        if text.startswith(self.thought) and len(text) > len(self.thought):
            out += self.reasoning(text[len(self.thought):])
        item, at = reasoning_item(self.rid, text), self.thinking
        self.thinking, self.thought_done = None, True
        self.items.append(item)
        return out + [self._ev("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0,
                               text=text),
                      self._ev("response.output_item.done", output_index=at, item=item)]

    def _open_text(self) -> list[tuple[str, dict]]:
        out = self._close_reasoning(self.thought) if self.thinking is not None else []
        self.text_open = True
        item = {**message_item(self.rid, "", status="in_progress"), "content": []}
        return out + [self._ev("response.output_item.added", output_index=len(self.items), item=item),
                      self._ev("response.content_part.added", item_id=item["id"], output_index=len(self.items),
                               content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                      "logprobs": []})]

    def text(self, delta: str) -> list[tuple[str, dict]]:
        if not delta:
            return []
        out = [] if self.text_open else self._open_text()
        self.sent += delta
        return out + [self._ev("response.output_text.delta", item_id=f"msg_{self.rid[5:]}", output_index=len(self.items),
                               content_index=0, delta=delta, logprobs=[])]

    def reasoning(self, delta: str) -> list[tuple[str, dict]]:
        """A reasoning delta (before any text: reasoning models think first)."""
        if not delta or self.text_open or self.thought_done:
            return []
        out = []
        rid = f"rs_{self.rid[5:]}"
        if self.thinking is None:
            self.thinking = len(self.items)
            out.append(self._ev("response.output_item.added", output_index=self.thinking,
                                item={**reasoning_item(self.rid, ""), "content": []}))
        self.thought += delta
        return out + [self._ev("response.reasoning_text.delta", item_id=rid, output_index=self.thinking,
                               content_index=0, delta=delta)]

    def closing(self, chat: dict, rest: list[str]) -> list[tuple[str, dict]]:
        choice = chat["choices"][0]
        msg = choice["message"]
        out = []
        if self.thinking is not None:  # close the streamed reasoning item with what it did not send yet
            out += self._close_reasoning(msg.get("reasoning_content") or self.thought)
        elif msg.get("reasoning_content") and any(i["type"] == "reasoning" for i in self.items):
            at = next(k for k, i in enumerate(self.items) if i["type"] == "reasoning")  # closed when text began:
            self.items[at] = reasoning_item(self.rid, msg["reasoning_content"])  # the final reply has it whole
        elif msg.get("reasoning_content"):
            item = reasoning_item(self.rid, msg["reasoning_content"])
            out += [self._ev("response.output_item.added", output_index=len(self.items), item={**item, "content": []}),
                    self._ev("response.reasoning_text.delta", item_id=item["id"], output_index=len(self.items),
                             content_index=0, delta=msg["reasoning_content"]),
                    self._ev("response.reasoning_text.done", item_id=item["id"], output_index=len(self.items),
                             content_index=0, text=msg["reasoning_content"]),
                    self._ev("response.output_item.done", output_index=len(self.items), item=item)]
            self.items.append(item)
        for piece in rest:
            out += self.text(piece)
        if self.text_open or msg.get("content") or not msg.get("tool_calls"):
            if not self.text_open:
                out += self._open_text()
            item = message_item(self.rid, msg.get("content") or "", _logprobs(choice))
            at = len(self.items)
            part = item["content"][0]
            out += [self._ev("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                             text=part["text"], logprobs=part["logprobs"]),
                    self._ev("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                             part=part),
                    self._ev("response.output_item.done", output_index=at, item=item)]
            self.items.append(item)
        for k, call in enumerate(msg.get("tool_calls") or []):
            item, at = call_item(self.rid, k, call), len(self.items)
            out += [self._ev("response.output_item.added", output_index=at,
                             item={**item, "arguments": "", "status": "in_progress"}),
                    self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                             delta=item["arguments"]),
                    self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                             name=item["name"], arguments=item["arguments"]),
                    self._ev("response.output_item.done", output_index=at, item=item)]
            self.items.append(item)
        final = self._resp("incomplete" if choice["finish_reason"] == "length" else "completed", chat)
        return out + [self._ev(f"response.{final['status']}", response=final)]

    def error(self, err: OpenAIError) -> list[tuple[str, dict]]:
        return [self._ev("error", code=err.code, message=err.message, param=err.param),
                self._ev("response.failed", response={**self._resp("failed"), "error": {
                    "code": "server_error" if err.status >= 500 else "invalid_prompt", "message": err.message}})]

    def whole(self, chat: dict) -> list[tuple[str, dict]]:
        """Every event of a response already complete (one routed to another model)."""
        content = chat["choices"][0]["message"].get("content") or ""
        return [*self.opening(), *self.closing(chat, [content] if content else [])]


def format_sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
