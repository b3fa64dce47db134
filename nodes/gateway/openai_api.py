"""OpenAI's chat completions API as the gateway speaks it: request schema, error shape, responses.

Requests are validated strictly (a string where a number belongs is a 400 naming the field, as
OpenAI's own API does), and every field is either acted on or refused (``unsupported``): a field that
would change the reply and that the policy's engines cannot honour (penalties, ``logit_bias``, a modality
other than text, a JSON schema keyword the grammar cannot apply, ...) is a 400 naming it, as is a field
the gateway does not know; only bookkeeping fields with no effect on the reply (``user``, ``metadata``,
``store``, ...: ``BOOKKEEPING``) and no-op values (``frequency_penalty: 0``) pass. ``response_format``
and the schemas of forced or strict tool calls are checked here (``structured.wanted``, kept as
``ChatRequest.wanted``; the grammar is built when the request is served). docs/gateway.md's field
table lists each. Every client error is an ``OpenAIError``, rendered as ``{"error": {"message", "type",
"param", "code"}}`` with a 4xx status.
"""

from __future__ import annotations

import json
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from areal_bus.wire.messages import MAX_TOP_LOGPROBS
from nodes.gateway import structured
from nodes.gateway.backend import MAX_SEED

MAX_N = 16
"""Most choices one request may ask for: each is a sequence in the engine's batch."""

MAX_STOPS = 4
"""OpenAI's own limit on stop sequences."""

LOGPROB_FLOOR = -9999.0
"""A log-probability of -inf (a token the grammar or top_k ruled out) as it is written in a reply: JSON has
no infinity, and vLLM and OpenAI write this value."""


class OpenAIError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}
        self.reason: str | None = None  # counted as, when not ``code`` (an upstream's code is not ours)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_body(message: str, type: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- request schema -------------------------------------------------------------------------------

class _Lenient(BaseModel):
    # strict: no "5" for 5; extra allowed: fields we do not use are accepted and ignored.
    model_config = ConfigDict(extra="allow", strict=True)


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Lenient):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text" or self.text is None:
            raise ValueError(f"only text content parts are supported (got type {self.type!r})")
        return self


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Lenient):
    include_usage: bool | None = None


class ChatRequest(_Lenient):
    model: str
    messages: list[Message] = Field(min_length=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension (-1 and 0: off); the Anthropic route's top_k
    modalities: list[str] | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict | None = None
    _wanted: structured.Wanted = PrivateAttr(default=structured.NOTHING)

    @model_validator(mode="after")
    def _limits(self):
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        return self

    @property
    def forced_tool(self) -> tuple[bool, str | None]:
        """(a tool call is required, the function it must call or None): from tool_choice."""
        choice = self.tool_choice
        if choice == "required":
            return True, None
        if isinstance(choice, dict):
            return True, choice["function"]["name"]
        return False, None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def wanted(self) -> structured.Wanted:
        """The replies' shape as ``unsupported`` checked it (a JSON content, constrained calls)."""
        return self._wanted

    @property
    def offered_tools(self) -> list[dict] | None:
        """The tools offered to the policy, as dicts (None when there are none, or tool_choice is none)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "literal"}


def _param(loc: tuple) -> str:
    """pydantic's error location as OpenAI names a parameter: messages[2].content."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _TYPE_TAGS or part[:1].isupper() or part.startswith("literal["):
            continue  # a union member's tag, not a field
        else:
            out += f".{part}" if out else part
    return out or "body"


def validation_error(err: ValidationError) -> OpenAIError:
    # The deepest error is the most specific: for a union (content: str | list of parts) it is the
    # member the input was meant to be.
    first = max(err.errors(), key=lambda e: len(e["loc"]))
    param = _param(first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        return OpenAIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    got = first.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {json.dumps(got) if _jsonable(got) else type(got).__name__})"
    return OpenAIError(400, f"Invalid value for '{param}': {msg}{shown}.", param=param, code="invalid_value")


def _jsonable(value) -> bool:
    return isinstance(value, (str, int, float, bool)) or value is None


def parse_chat_request(data) -> ChatRequest:
    if not isinstance(data, dict):
        raise OpenAIError(400, f"The request body must be a JSON object, got {type(data).__name__}.",
                          code="invalid_body")
    try:
        req = ChatRequest.model_validate(data)
    except ValidationError as err:
        raise validation_error(err) from None
    unsupported(req)
    return req


# -- fields honoured or refused (docs/gateway.md's field table) ---------------------------------------

BOOKKEEPING = {
    "user": "an end-user id: no effect on the reply",
    "metadata": "the caller's tags: no effect on the reply",
    "store": "OpenAI-side storage: every session call is recorded anyway, whatever the value",
    "service_tier": "a billing tier: there is one",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache: none here",
    "safety_identifier": "an end-user id: no effect on the reply",
}
"""Fields accepted whatever their value: they say who asks or how to bill, never what to sample."""

REFUSED = {
    "reasoning_effort": "the policy has no reasoning-effort control",
    "functions": "the legacy functions API: send 'tools' instead",
    "function_call": "the legacy functions API: send 'tool_choice' instead",
    "audio": "the policy reads and writes text only",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "the gateway has no web search",
    "verbosity": "the policy has no verbosity control",
}
"""Fields refused whatever their value (a 400 naming them), and why."""


def _refuse(param: str, why: str, code: str = "unsupported_parameter") -> OpenAIError:
    return OpenAIError(400, f"Unsupported parameter: '{param}': {why}.", param=param, code=code)


def unsupported(req: ChatRequest) -> None:
    """Refuse (400 naming the field) whatever this gateway would otherwise silently ignore."""
    for name in (req.model_extra or {}):
        if name in BOOKKEEPING:
            continue
        raise _refuse(name, REFUSED.get(name, "the gateway does not act on this field, so it refuses it "
                                                "rather than ignore it"))
    if req.modalities is not None and set(req.modalities) - {"text"}:
        raise _refuse("modalities", f"the policy reads and writes text only: only [\"text\"] (got "
                      f"{json.dumps(req.modalities)})", code="unsupported_value")
    if req.top_logprobs and not req.logprobs:
        raise OpenAIError(400, "Invalid value for 'top_logprobs': it needs 'logprobs': true (the alternatives "
                          "come with each sampled token's log-probability).", param="top_logprobs",
                          code="invalid_value")
    _check_response_format(req.response_format)
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name):
            raise _refuse(name, "the policy's engines apply no penalties: only 0", code="unsupported_value")
    if req.logit_bias:
        raise _refuse("logit_bias", "the policy's engines apply no logit bias: only {}", code="unsupported_value")
    _check_tool_choice(req)
    try:
        req._wanted = structured.wanted(req.response_format, req.offered_tools, req.tool_choice,
                                        req.parallel_tool_calls)
    except structured.SchemaError as err:
        raise OpenAIError(400, str(err), param=err.param, code="invalid_schema") from None


_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def _check_response_format(fmt: dict | None) -> None:
    """response_format is text, json_object or json_schema ({"name", "schema", "strict", "description"})."""
    if fmt is None:
        return
    kind = fmt.get("type")

    def bad(param: str, why: str) -> OpenAIError:
        return OpenAIError(400, f"Invalid value for '{param}': {why}.", param=param, code="invalid_value")

    if kind not in ("text", "json_object", "json_schema"):
        raise bad("response_format.type", f"text, json_object or json_schema (got {json.dumps(kind)})")
    extra = sorted(set(fmt) - {"type", *(("json_schema",) if kind == "json_schema" else ())})
    if extra:
        raise OpenAIError(400, f"Unknown parameter: 'response_format.{extra[0]}'.", param=f"response_format.{extra[0]}",
                          code="unknown_parameter")
    if kind != "json_schema":
        return
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format.json_schema", "an object with 'name' and 'schema'")
    extra = sorted(set(spec) - _JSON_SCHEMA_KEYS)
    if extra:
        raise OpenAIError(400, f"Unknown parameter: 'response_format.json_schema.{extra[0]}'.",
                          param=f"response_format.json_schema.{extra[0]}", code="unknown_parameter")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad("response_format.json_schema.name", "a name is required (a string)")
    if "schema" in spec and not isinstance(spec["schema"], (dict, bool)):
        raise bad("response_format.json_schema.schema", "a JSON Schema object")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad("response_format.json_schema.strict", "true or false")


def _check_tool_choice(req: ChatRequest) -> None:
    choice, names = req.tool_choice, [t.function.name for t in req.tools or []]
    if choice is None or choice in ("auto", "none"):
        return
    if choice == "required" or isinstance(choice, dict):
        if not names:
            raise OpenAIError(400, "Invalid value for 'tool_choice': it asks for a tool call, but the request "
                              "has no 'tools'.", param="tool_choice", code="invalid_value")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if not isinstance(name, str):
                raise OpenAIError(400, "Invalid value for 'tool_choice': an object must be {\"type\": \"function\", "
                                  "\"function\": {\"name\": ...}}.", param="tool_choice", code="invalid_value")
            if name not in names:
                raise OpenAIError(400, f"Invalid value for 'tool_choice': function '{name}' is not one of the "
                                  f"request's tools ({', '.join(names)}).", param="tool_choice.function.name",
                                  code="invalid_value")
        return
    raise OpenAIError(400, f"Invalid value for 'tool_choice': {json.dumps(choice)} (expected 'none', 'auto', "
                      "'required' or a named function).", param="tool_choice", code="invalid_value")


RESPONSE_ID_KINDS = ("chatcmpl-", "resp_", "cmpl-")
"""How a session's response ids begin, each followed by ``<session id>-<n>``, n the index of its first
completion in the session; choice k of the response is completion n + k (a legacy completion's choices
run prompt by prompt, as its response lists them). Chat completions (and Anthropic messages, whose
``msg_`` id is not sent back), Responses, legacy completions."""


def _completion_first(cid, session_id: str) -> int | None:
    """The first completion index a response id of this session names, None if it is not one."""
    if not isinstance(cid, str):
        return None
    for kind in RESPONSE_ID_KINDS:
        prefix = f"{kind}{session_id}-"
        n = cid[len(prefix):]
        if cid.startswith(prefix) and n.isascii() and n.isdigit():  # no sign, no spaces, no other digits
            return int(n)
    return None


def reward_fields(body, session_id: str) -> tuple[float, int | None, float | None]:
    """(reward, completion index or None, discount or None) from a POST /rl/sessions/{id}/reward (or /end)
    body: {"reward": x} for the session, plus "completion_index": k or "completion_id": <response id>
    (chatcmpl-, resp_ or cmpl-<session>-<n>; with "choice": i for n > 1) for one completion, and
    "discount": g for per-turn discounting."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "The body must be a JSON object with 'reward'.", code="invalid_body")
    value = body.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OpenAIError(400, "Missing or invalid 'reward': a number is required.", param="reward",
                          code="invalid_value")
    discount = body.get("discount")
    if discount is not None and (isinstance(discount, bool) or not isinstance(discount, (int, float))):
        raise OpenAIError(400, "Invalid 'discount': a number in (0, 1].", param="discount", code="invalid_value")
    index = body.get("completion_index")
    cid = body.get("completion_id")
    if cid is not None:
        first = _completion_first(cid, session_id)
        if first is None:
            shapes = ", ".join(f"{kind}{session_id}-<n>" for kind in RESPONSE_ID_KINDS)
            raise OpenAIError(400, f"Invalid 'completion_id': expected a response id of this session "
                              f"({shapes}).", param="completion_id", code="invalid_value")
        choice = body.get("choice", 0)
        if isinstance(choice, bool) or not isinstance(choice, int) or choice < 0:
            raise OpenAIError(400, "Invalid 'choice': a choice index (>= 0).", param="choice", code="invalid_value")
        index = first + choice
    elif index is not None and (isinstance(index, bool) or not isinstance(index, int)):
        raise OpenAIError(400, "Invalid 'completion_index': an integer.", param="completion_index",
                          code="invalid_value")
    try:
        return float(value), index, None if discount is None else float(discount)
    except OverflowError:  # an integer past float's range (JSON allows any size)
        raise OpenAIError(400, "Invalid 'reward' or 'discount': a number within float range.", param="reward",
                          code="invalid_value") from None


def router_error(model: str, exc) -> OpenAIError:
    """A RouterError as the client sees it: the upstream's own OpenAI error body and status when it
    sent one, else a 4xx/5xx saying what failed."""
    status, body = exc.status, exc.body
    kind = getattr(exc, "kind", "")
    if kind == "unknown_model":
        return OpenAIError(404, f"The model '{model}' does not exist on this gateway: {exc}", code="model_not_found",
                           param="model")
    parsed = None
    if isinstance(body, str):
        try:
            parsed = json.loads(body)
        except ValueError:
            pass
    elif isinstance(body, dict):
        parsed = body
    err = parsed.get("error") if isinstance(parsed, dict) else None
    code = status if isinstance(status, int) and 400 <= status < 600 else (504 if kind == "timeout" else 502)
    if isinstance(err, dict) and "message" in err:
        return OpenAIError(code, str(err["message"]), type=str(err.get("type") or "upstream_error"),
                           param=err.get("param"), code=err.get("code"))
    return OpenAIError(code, f"Request to '{model}' failed: {exc}", type="upstream_error", code=kind or None)



# -- responses ------------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_logprobs(tokenizer, ids, logprobs, top_ids=None, top_logprobs=None) -> dict:
    """OpenAI's ``logprobs`` object for sampled tokens, each with its ``top_logprobs`` alternatives when the
    engine returned them (``top_ids`` / ``top_logprobs``: [tokens, k], most likely first)."""
    k = 0 if top_ids is None else top_ids.shape[1] if top_ids.ndim == 2 and top_ids.shape[0] else 0
    out = []
    for i, (t, lp) in enumerate(zip(ids, logprobs)):
        text = tokenizer.decode([int(t)])
        alts = [_alternative(tokenizer, top_ids[i, j], top_logprobs[i, j]) for j in range(k)]
        out.append({"token": text, "logprob": finite(lp), "bytes": list(text.encode()), "top_logprobs": alts})
    return {"content": out, "refusal": None}


def _alternative(tokenizer, tid, lp) -> dict:
    text = tokenizer.decode([int(tid)])
    return {"token": text, "logprob": finite(lp), "bytes": list(text.encode())}


def finite(lp) -> float:
    """A log-probability as a reply writes it (-inf as LOGPROB_FLOOR)."""
    return max(float(lp), LOGPROB_FLOOR)


def completion_response(rid: str, model: str, choices: list[dict], prompt_tokens: int,
                        completion_tokens: int, created: int | None = None) -> dict:
    """``choices``: dicts with message, finish_reason and optionally logprobs and stop_reason (the stop
    string that ended the choice, as vLLM names it; the Anthropic reply's stop_sequence)."""
    return {
        "id": rid, "object": "chat.completion", "created": created or int(time.time()), "model": model,
        "choices": [{"index": i, "message": c["message"], "logprobs": c.get("logprobs"),
                     "finish_reason": c["finish_reason"],
                     **({"stop_reason": c["stop_reason"]} if c.get("stop_reason") is not None else {})}
                    for i, c in enumerate(choices)],
        "usage": usage(prompt_tokens, completion_tokens),
        "system_fingerprint": None,
    }


class StreamChunks:
    """The chat.completion.chunk objects of one streamed reply, in the order they go out: ``opening``
    (a role chunk per choice), ``text`` (content deltas as they come), ``closing`` from the finished
    completion (per choice the rest of its content, its tool calls and its finish chunk; then a usage
    chunk with empty choices if asked for)."""

    def __init__(self, rid: str, model: str, created: int | None = None):
        self.base = {"id": rid, "object": "chat.completion.chunk", "created": created or int(time.time()),
                     "model": model, "system_fingerprint": None}

    def chunk(self, index: int, delta: dict, finish=None, logprobs=None) -> dict:
        return {**self.base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    def opening(self, n: int) -> list[dict]:
        return [self.chunk(i, {"role": "assistant", "content": ""}) for i in range(n)]

    def text(self, index: int, delta: str) -> list[dict]:
        return [self.chunk(index, {"content": delta})]

    def reasoning(self, index: int, delta: str) -> list[dict]:
        """A reasoning delta, as vLLM and DeepSeek stream it: ``delta.reasoning_content``."""
        return [self.chunk(index, {"reasoning_content": delta})]

    def closing(self, resp: dict, rest: list[list[str]], include_usage: bool) -> list[dict]:
        """``rest[i]``: choice i's content not yet sent, in pieces (the whole content, when nothing was)."""
        out = []
        for i, choice in enumerate(resp["choices"]):
            out += [self.chunk(i, {"content": p}) for p in rest[i] if p]
            for k, call in enumerate(choice["message"].get("tool_calls") or []):
                out.append(self.chunk(i, {"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                                          "function": call["function"]}]}))
            out.append(self.chunk(i, {}, choice["finish_reason"], choice.get("logprobs")))
        if include_usage:
            out.append({**self.base, "choices": [], "usage": resp.get("usage")})
        return out


def stream_chunks(resp: dict, include_usage: bool = False) -> list[dict]:
    """A whole chat.completion as OpenAI's stream of chunks (a reply routed to another model)."""
    chunks = StreamChunks(resp["id"], resp["model"], resp["created"])
    rest = [[c["message"].get("content") or ""] for c in resp["choices"]]
    thoughts = [chunks.reasoning(i, c["message"]["reasoning_content"]) for i, c in enumerate(resp["choices"])
                if c["message"].get("reasoning_content")]
    return [*chunks.opening(len(resp["choices"])), *(c for t in thoughts for c in t),
            *chunks.closing(resp, rest, include_usage)]


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def model_card(model_id: str, owned_by: str = "areal_bus") -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": owned_by}
