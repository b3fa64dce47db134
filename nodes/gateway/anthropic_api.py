"""The Anthropic Messages API on the gateway, as pure translation to and from OpenAI chat.completions:
here the way in (errors, keys, the request's shapes and its translation, count_tokens); the way out
(an OpenAI completion as an Anthropic message, or as its stream of events) is ``anthropic_reply``.

Claude Code (and anything built on the anthropic SDK) joins training by setting
``ANTHROPIC_BASE_URL`` to the gateway and ``ANTHROPIC_API_KEY`` to a gateway token. The gateway's
``anthropic_routes`` own the HTTP; these modules own only the shapes, so every rule is testable without
a socket:

    POST /v1/messages               body -> to_openai_request -> (the gateway's completion path)
                                    -> anthropic_reply.from_openai_response (JSON)
                                    or anthropic_reply.StreamEvents + format_sse (SSE)
    POST /v1/messages/count_tokens  body -> count_tokens_request -> count the prompt -> count_tokens_response
    any failure                     AnthropicError(status, message): reply ``.body`` with ``.status``
                                    (inside an open stream: anthropic_reply.format_sse("error", err.body))

    .venv/bin/python -m pytest tests/test_gateway_anthropic.py -q
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Mapping, Optional, Union

import structlog
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

log = structlog.get_logger().bind(_tag="gateway")

# ---------------------------------------------------------------------------------------------------
# Errors, in Anthropic's shape (the SDK picks its exception class from the status, and shows the body)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict:
    """Anthropic's error body for an HTTP status: {"type": "error", "error": {"type", "message"}}."""
    if status in _ERROR_TYPES:
        kind = _ERROR_TYPES[status]
    else:
        kind = "api_error" if status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": message}}


class AnthropicError(Exception):
    """A request the gateway answers with an Anthropic error: reply ``body`` (JSON) with ``status`` and
    ``headers`` (Retry-After on a 429). ``code`` names the reason in the gateway's rejection counters."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code or error_body(status, "")["error"]["type"]
        self.headers = headers or {}
        self.body = error_body(status, message)


# ---------------------------------------------------------------------------------------------------
# Authentication: which token the client sent, and the messages users need when it is wrong

_KEY_HELP = (
    "point ANTHROPIC_BASE_URL at the gateway and set ANTHROPIC_API_KEY to the gateway token "
    "(is it exported in this shell? does the config use ${VAR} rather than a literal?)"
)


def api_key_from_headers(headers: Mapping[str, str]) -> str:
    """The token a client sent: ``x-api-key`` (ANTHROPIC_API_KEY), else ``Authorization: Bearer``
    (ANTHROPIC_AUTH_TOKEN). Raises a 401 AnthropicError when there is none, or when it is a claude.ai
    OAuth login rather than a gateway token."""
    lower = {k.lower(): v for k, v in headers.items()}
    key = lower.get("x-api-key")
    bearer = lower.get("authorization", "")
    if not key and bearer[:7].lower() == "bearer ":
        key = bearer[7:]
    oauth = "oauth-" in lower.get("anthropic-beta", "") or (key or "").startswith("sk-ant-oat")
    if oauth:
        raise AnthropicError(
            401,
            "Claude Code is authenticating with OAuth (a claude.ai login), not an API key: "
            + _KEY_HELP + ", then restart claude (run /logout first if it keeps the login).",
            "oauth_login",
        )
    if not key:
        raise AnthropicError(401, "no API key in x-api-key or Authorization: " + _KEY_HELP + ".", "invalid_api_key")
    return key


def invalid_api_key(key: str) -> AnthropicError:
    """The 401 for a token the gateway does not know. Never echoes the key."""
    if key != key.strip():
        why = "the key has leading or trailing whitespace or a newline; strip it"
    else:
        why = _KEY_HELP
    return AnthropicError(401, f"Invalid API key: {why}.", "invalid_api_key")


# ---------------------------------------------------------------------------------------------------
# The request, as pydantic models. Fields Claude Code sends that mean nothing to a plain policy model
# (cache_control, citations, ...) are ignored rather than refused, so new client releases keep working.


class _Shape(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _as_blocks(value: Any) -> Any:
    """Content may be a bare string: it means one text block."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content blocks")
    return value


class TextBlock(_Shape):
    type: Literal["text"] = Field(description="Block kind.")
    text: str = Field(description="The text; cache_control and citations on it are ignored.")


class ImageBlock(_Shape):
    type: Literal["image"] = Field(description="Block kind; refused: the policy model reads text only.")
    source: Optional[dict] = Field(None, description="base64 or url source; never read.")


class DocumentBlock(_Shape):
    type: Literal["document"] = Field(description="Block kind; refused: the policy model reads text only.")
    source: Optional[dict] = Field(None, description="PDF or text source; never read.")


class ToolUseBlock(_Shape):
    type: Literal["tool_use"] = Field(description="Block kind: a call the assistant made.")
    id: str = Field(min_length=1, description="Call id; the matching tool_result names it in tool_use_id.")
    name: str = Field(min_length=1, description="Name of the tool called, one of the request's tools.")
    input: dict[str, Any] = Field(description="Arguments, a JSON object matching the tool's input_schema.")


_ResultPart = Annotated[Union[TextBlock, ImageBlock, DocumentBlock], Field(discriminator="type")]


class ToolResultBlock(_Shape):
    type: Literal["tool_result"] = Field(description="Block kind: the outcome of a tool_use.")
    tool_use_id: str = Field(min_length=1, description="Id of the tool_use block this answers.")
    content: list[_ResultPart] = Field(default_factory=list, description="The result: a string or text blocks.")
    is_error: StrictBool = Field(False, description="The tool failed; the text says how.")

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, value: Any) -> Any:
        return [] if value is None else _as_blocks(value)


class ThinkingBlock(_Shape):
    type: Literal["thinking"] = Field(description="Block kind: earlier extended thinking; dropped.")
    thinking: str = Field("", description="The reasoning text.")


class RedactedThinkingBlock(_Shape):
    type: Literal["redacted_thinking"] = Field(description="Block kind: encrypted thinking; dropped.")


_Block = Annotated[
    Union[TextBlock, ImageBlock, DocumentBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
    Field(discriminator="type"),
]


class Message(_Shape):
    role: Literal["user", "assistant", "system"] = Field(description="Who spoke this turn. Claude Code 2.x "
                                                         "sends system entries mid-conversation (its "
                                                         "mid-conversation-system beta): folded into the "
                                                         "system prompt, in order.")
    content: list[_Block] = Field(description="A string, or a list of content blocks.")

    @field_validator("content", mode="before")
    @classmethod
    def _blocks(cls, value: Any) -> Any:
        return _as_blocks(value)


class Tool(_Shape):
    name: str = Field(min_length=1, max_length=128, description="Tool name the model calls it by.")
    description: Optional[str] = Field(None, description="What the tool does, shown to the model.")
    input_schema: Optional[dict[str, Any]] = Field(None, description="JSON Schema of the tool's input object.")
    type: Optional[str] = Field(None, description="'custom' or absent; Anthropic server tools are refused.")
    strict: Optional[StrictBool] = Field(None, description="true: the input always follows input_schema (a "
                                         "grammar constrains it whenever the model calls the tool).")


class ToolChoiceAuto(_Shape):
    type: Literal["auto"] = Field(description="The model decides whether to call a tool.")
    disable_parallel_tool_use: StrictBool = Field(False, description="At most one tool call per turn.")


class ToolChoiceAny(_Shape):
    type: Literal["any"] = Field(description="The model must call some tool.")
    disable_parallel_tool_use: StrictBool = Field(False, description="Exactly one tool call per turn.")


class ToolChoiceTool(_Shape):
    type: Literal["tool"] = Field(description="The model must call the named tool.")
    name: str = Field(min_length=1, description="The tool to call, one of the request's tools.")
    disable_parallel_tool_use: StrictBool = Field(False, description="Exactly one tool call per turn.")


class ToolChoiceNone(_Shape):
    type: Literal["none"] = Field(description="The model must not call tools.")


_ToolChoice = Annotated[
    Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone], Field(discriminator="type")
]


class Metadata(_Shape):
    user_id: Optional[str] = Field(None, description="Opaque end-user id; passed on as OpenAI's `user`.")


class Thinking(_Shape):
    type: Literal["enabled", "adaptive", "disabled"] = Field(
        description="enabled / adaptive: the policy's reasoning (a <think> block, for a family that writes "
        "one) comes back as thinking blocks; disabled: it is left out of the reply (still recorded).")
    budget_tokens: Optional[StrictInt] = Field(None, ge=1, description="Accepted, not enforced: the policy's "
                                               "reasoning is bounded only by max_tokens.")


class ContextEdit(_Shape):
    type: Literal["clear_thinking_20251015"] = Field(
        description="The only edit honoured, with keep 'all' (Claude Code's): keep every thinking block, "
        "which is what a recorded session does anyway. Other edits would rewrite the context the gateway "
        "continues from, so they are refused.")
    keep: Literal["all"] = Field(description="Only 'all'.")


class ContextManagement(_Shape):
    edits: list[ContextEdit] = Field(default_factory=list, description="Server-side context edits.")


class OutputFormat(_Shape):
    type: Literal["json_schema"] = Field(description="The only structured output format.")
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON Schema the reply's text follows.")


class OutputConfig(_Shape):
    effort: Optional[Literal["low", "medium", "high", "max"]] = Field(
        None, description="Accepted, no effect: the policy has no effort control (Claude Code always sends it).")
    format: Optional[OutputFormat] = Field(None, description="Structured output: the reply's text is JSON of "
                                           "this schema (a grammar constrains it).")


class MessagesRequest(_Shape):
    """POST /v1/messages. Top-level fields not named here (thinking, context_management, ...) are dropped."""

    model: str = Field(min_length=1, description="Model name the client asked for; echoed back in the reply.")
    max_tokens: StrictInt = Field(ge=1, description="Most tokens the reply may have.")
    messages: list[Message] = Field(min_length=1, description="The conversation so far, oldest first.")
    system: Optional[list[TextBlock]] = Field(None, description="System prompt: a string or text blocks.")
    tools: Optional[list[Tool]] = Field(None, description="Client tools the model may call.")
    tool_choice: Optional[_ToolChoice] = Field(None, description="How the model must use the tools.")
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0, description="Sampling temperature, 0 to 1.")
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: Optional[StrictInt] = Field(None, ge=0, description="Sample among the k most likely tokens.")
    stop_sequences: Optional[list[str]] = Field(None, description="Strings that end the reply.")
    stream: StrictBool = Field(False, description="Reply as server-sent events; read by the caller, not here.")
    metadata: Optional[Metadata] = Field(None, description="Request metadata; only user_id is used.")
    thinking: Optional[Thinking] = Field(None, description="Whether the reply shows the policy's reasoning.")
    context_management: Optional[ContextManagement] = Field(None, description="Context edits (keep-all only).")
    output_config: Optional[OutputConfig] = Field(None, description="effort (no effect) and format.")
    service_tier: Optional[str] = Field(None, description="Accepted, no effect: there is one tier.")

    @field_validator("system", mode="before")
    @classmethod
    def _system_blocks(cls, value: Any) -> Any:
        return value if value is None else _as_blocks(value)


# Why a field the client sent does not reach the policy model (logged once per field per process):
# block kinds dropped from the history (earlier thinking), never request fields (those are refused).
_DROPPED_WHY = {
    "thinking": "earlier thinking is not re-rendered: a session continues from the recorded tokens",
    "redacted_thinking": "earlier thinking is not re-rendered: a session continues from the recorded tokens",
}

REFUSED_WHY = {
    "container": "the gateway runs no code-execution container",
    "mcp_servers": "the gateway connects to no MCP servers",
    "inference_geo": "there is one place the policy runs",
}
"""Top-level request fields refused (a 400 naming them), and why; any field not in MessagesRequest is too."""
_noted: set[str] = set()
NOTED_MAX = 64
"""Distinct dropped field names noted per process: a client inventing a new name per request must not
grow this set (or the log) without bound. Names that are not plain identifiers are never noted."""
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def _note_dropped(fields: list[str]) -> None:
    for name in fields:
        if name not in _noted and len(_noted) < NOTED_MAX and _IDENTIFIER.fullmatch(name):
            _noted.add(name)
            why = _DROPPED_WHY.get(name, "not supported by the gateway")
            log.info("anthropic_field_dropped", field=name, why=why)


def _field_path(loc: tuple) -> str:
    """pydantic's error location as the request path a user can find: messages.1.content.0.input.

    Discriminated unions add the block's type as a step (content.0.tool_use.input); it is dropped."""
    parts = []
    for i, step in enumerate(loc):
        after_content_index = i >= 2 and isinstance(loc[i - 1], int) and loc[i - 2] == "content"
        if isinstance(step, str) and (after_content_index or (i >= 1 and loc[i - 1] == "tool_choice")):
            continue
        parts.append(str(step))
    return ".".join(parts)


def _validate(body: Any) -> MessagesRequest:
    if not isinstance(body, dict):
        raise AnthropicError(400, "request body must be a JSON object")
    try:
        return MessagesRequest.model_validate(body)
    except ValidationError as err:
        problems = []
        for e in err.errors()[:5]:
            msg = e["msg"].removeprefix("Value error, ")
            if e["type"] == "union_tag_not_found":
                msg = "needs a 'type'"
            elif e["type"] == "union_tag_invalid":
                msg = f"unsupported type {e['ctx']['tag']!r} (expected one of {e['ctx']['expected_tags']})"
            problems.append(f"{_field_path(e['loc'])}: {msg}" if e["loc"] else msg)
        raise AnthropicError(400, "; ".join(problems)) from None


# ---------------------------------------------------------------------------------------------------
# Anthropic request -> OpenAI request


def _join(texts) -> str:
    return "\n".join(texts)


def _refuse_media(block, where: str) -> None:
    if isinstance(block, (ImageBlock, DocumentBlock)):
        raise AnthropicError(
            400, f"{where}: {block.type} content is not supported by this gateway (the policy model reads text only)"
        )


def _tool_result_text(block: ToolResultBlock, where: str) -> str:
    for j, part in enumerate(block.content):
        _refuse_media(part, f"{where}.content.{j}")
    text = _join(part.text for part in block.content)
    # OpenAI tool messages have no error flag; the model still has to see that the call failed.
    return f"Error: {text}" if block.is_error else text


def _user_messages(blocks: list, where: str, known_calls: set[str]) -> list[dict]:
    """One user turn -> its tool results as role "tool" messages (they must follow the assistant's
    tool_calls directly), then the user's text, if any."""
    tools, texts = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        _refuse_media(block, at)
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in known_calls:
                raise AnthropicError(
                    400, f"{at}.tool_use_id: '{block.tool_use_id}' does not answer any earlier tool_use block"
                )
            tools.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _tool_result_text(block, at)})
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        else:
            raise AnthropicError(400, f"{at}: {block.type} blocks belong in an assistant message")
    if not blocks:
        raise AnthropicError(400, f"{where}.content: a user message must not be empty")
    return tools + ([{"role": "user", "content": _join(texts)}] if texts else [])


def _assistant_message(blocks: list, where: str, known_calls: set[str]) -> dict:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        _refuse_media(block, at)
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            known_calls.add(block.id)
            arguments = json.dumps(block.input, ensure_ascii=False)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif isinstance(block, ToolResultBlock):
            raise AnthropicError(400, f"{at}: tool_result blocks belong in a user message")
        else:
            _note_dropped([block.type])  # thinking: the policy never produced it, nothing to replay
    message: dict[str, Any] = {"role": "assistant", "content": _join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _tools(req: MessagesRequest) -> list[dict]:
    out = []
    for i, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise AnthropicError(
                400, f"tools.{i}: server tool '{tool.type}' is not supported by this gateway; only client tools"
            )
        if tool.input_schema is None:
            raise AnthropicError(400, f"tools.{i}.input_schema: Field required")
        function = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.strict is not None:
            function["strict"] = tool.strict
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(req: MessagesRequest, out: dict) -> None:
    choice = req.tool_choice
    if choice is None:
        return
    names = [tool.name for tool in req.tools or []]
    if choice.type in ("any", "tool") and not names:
        raise AnthropicError(400, f"tool_choice: type '{choice.type}' needs tools in the request")
    if choice.type == "auto":
        out["tool_choice"] = "auto"
    elif choice.type == "any":
        out["tool_choice"] = "required"
    elif choice.type == "none":
        out["tool_choice"] = "none"
    else:
        if choice.name not in names:
            raise AnthropicError(400, f"tool_choice.name: '{choice.name}' is not one of the request's tools")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    if getattr(choice, "disable_parallel_tool_use", False) and names:
        out["parallel_tool_calls"] = False


def to_openai_request(body: dict) -> dict:
    """Validate an Anthropic Messages request and translate it into an OpenAI chat.completions request.

    Never sets ``stream``: the caller reads ``body["stream"]`` and streams from the finished completion.
    Raises AnthropicError(400) naming the field for anything malformed or unsupported."""
    req = _validate(body)
    _refuse_fields(body, req)

    messages: list[dict] = []
    system = [block.text for block in req.system or ()]
    for i, message in enumerate(req.messages):  # system entries inside messages join the system prompt
        if message.role == "system":
            system += [_system_text(message.content, f"messages.{i}")]
    if system:
        messages.append({"role": "system", "content": _join(system)})
    known_calls: set[str] = set()
    # Consecutive turns of one role are kept as they are (the Anthropic API accepts and merges them).
    for i, message in enumerate(req.messages):
        where = f"messages.{i}"
        if message.role == "system":
            continue
        if message.role == "user":
            messages.extend(_user_messages(message.content, where, known_calls))
        else:
            messages.append(_assistant_message(message.content, where, known_calls))

    out: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens}
    if req.temperature is not None:
        out["temperature"] = req.temperature
    if req.top_p is not None:
        out["top_p"] = req.top_p
    if req.top_k is not None:
        out["top_k"] = req.top_k
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:  # Anthropic's structured output is always strict
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "output", "schema": fmt.schema_, "strict": True}}
    if req.stop_sequences:
        out["stop"] = list(req.stop_sequences)
    if req.metadata is not None and req.metadata.user_id:
        out["user"] = req.metadata.user_id
    if req.tools:
        out["tools"] = _tools(req)
    _tool_choice(req, out)
    return out


def _refuse_fields(body: dict, req: MessagesRequest) -> None:
    unknown = sorted(set(body) - set(MessagesRequest.model_fields))
    if isinstance(body.get("output_config"), dict):
        unknown += [f"output_config.{k}" for k in sorted(body["output_config"]) if k not in ("effort", "format")]
    for name in unknown:
        why = REFUSED_WHY.get(name) or ("the gateway does not act on this field, so it refuses it rather than "
                                        "ignore it")
        raise AnthropicError(400, f"{name}: not supported by this gateway: {why}", "unsupported_parameter")


_CHAT_PATHS = ((re.compile(r"response_format\.json_schema\.schema"), "output_config.format.schema"),
               (re.compile(r"tools\[(\d+)\]\.function\.parameters"), r"tools.\1.input_schema"),
               (re.compile(r"tools\[(\d+)\]\.function\."), r"tools.\1."))


def anthropic_path(text: str) -> str:
    """Chat-path parameter paths in ``text`` as the Anthropic request names them (a schema refused on the
    chat path: tools[0].function.parameters -> tools.0.input_schema)."""
    for pattern, name in _CHAT_PATHS:
        text = pattern.sub(name, text)
    return text


def shows_thinking(body: dict) -> bool:
    """Whether the reply carries thinking blocks: unless the request disabled thinking."""
    thinking = body.get("thinking") if isinstance(body, dict) else None
    return not (isinstance(thinking, dict) and thinking.get("type") == "disabled")


def _system_text(blocks: list, where: str) -> str:
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise AnthropicError(400, f"{where}.content.{j}: a system entry holds text only (got {block.type})")
        texts.append(block.text)
    return _join(texts)


# ---------------------------------------------------------------------------------------------------
# POST /v1/messages/count_tokens (Claude Code's /context uses it; optional for a gateway)


def count_tokens_request(body: dict) -> dict:
    """A count_tokens body (a Messages request without max_tokens) validated and translated like
    to_openai_request, minus max_tokens: render its messages and tools with the policy's chat template
    and count, or use estimate_tokens. Answer with count_tokens_response."""
    if not isinstance(body, dict):
        raise AnthropicError(400, "request body must be a JSON object")
    req = to_openai_request({"max_tokens": 1, **body})
    req.pop("max_tokens")
    return req


def count_tokens_response(input_tokens: int) -> dict:
    """The count_tokens reply body."""
    return {"input_tokens": int(input_tokens)}


# Characters per token for English and code under common BPE vocabularies; an estimate, for a gateway
# that has no tokenizer at hand.
_CHARS_PER_TOKEN = 4


def estimate_tokens(openai_request: dict) -> int:
    """A rough prompt size for count_tokens when no tokenizer is loaded: characters / 4."""
    text = json.dumps(openai_request.get("messages", []), ensure_ascii=False)
    text += json.dumps(openai_request.get("tools", []), ensure_ascii=False)
    return max(1, len(text) // _CHARS_PER_TOKEN)
