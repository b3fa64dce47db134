"""Tool-call and reasoning formats per model family: how a policy's reply text becomes OpenAI
``tool_calls`` / ``reasoning_content`` (and Anthropic tool_use / thinking blocks), and what a forced
tool call begins with.

Tool-call formats (``ToolFormat``), chosen from the chat template or ``GatewayConfig.tool_parser``:

    hermes       Qwen2.5, Qwen3, Hermes:  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    llama3_json  Llama 3.1 / 3.2 / 3.3:   {"name": "f", "parameters": {...}}  (the whole reply; an optional
                                          <|python_tag|> first; several calls separated by ';')
    mistral      Mistral v0.3 ("v3"):     [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]

Parsing is all or nothing: a reply with one malformed call is plain content, so a garbled call reaches
the client (and the reward) as the text the model wrote. Each format also says

- ``forced_prefix(name)``: the text a reply must begin with to be a call (of ``name``, if given), which
  the gateway appends to the prompt for tool_choice "required" / a named function (shaping);
- ``first_call_end(text)``: where the first complete call ends, for parallel_tool_calls false;
- ``content_end(text)``: how much of a partial reply is surely content (streaming holds back the rest).

Reasoning (``ThinkFormat``): ``<think>...</think>`` (Qwen3, DeepSeek-R1, QwQ). A template whose
generation prompt already opens ``<think>`` (DeepSeek-R1) starts the reply inside it. The split is a
pure function of the text, so the streamed reasoning and content deltas add up to the final reply's.
The recorded trajectory is the sampled token ids whatever the split: parsing only shapes the reply.

    .venv/bin/python -m pytest tests/test_gateway_parsers.py -q
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass

_DECODER = json.JSONDecoder()


def _call(name: str, args, call_id: str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}


def _call_object(obj, args_keys: tuple[str, ...]) -> tuple[str, object] | None:
    """(name, arguments) of a decoded call object, None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            return (obj["name"], args) if isinstance(args, (dict, str)) else None
    return obj["name"], {}


def _partial_mark(text: str, marks: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could begin one of ``marks``."""
    for k in range(min(len(text), max((len(m) for m in marks), default=1) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in marks):
            return k
    return 0


class ToolFormat:
    name = ""
    marks: tuple[str, ...] = ()
    """Strings that begin a call anywhere in the reply."""
    special: tuple[str, ...] = ()
    """Special tokens of the format that decoding must keep (they are skipped by default)."""
    # The calls of a reply, as a grammar writes them (structured.py) and forced_prefix begins them:
    # head, then per call call_open + name + '", "<args_key>": ' + arguments + call_close, calls joined
    # by separator, then tail; trigger: what begins the calls in free text.
    head = ""
    call_open = '{"name": "'
    args_key = "arguments"
    call_close = "}"
    separator = ""
    tail = ""
    trigger = ""

    def call_head(self, name: str) -> str:
        """A call's text up to its arguments object (``name`` JSON-escaped, as json.dumps writes it)."""
        return f'{self.call_open}{json.dumps(name)[1:-1]}", "{self.args_key}": '

    def call_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        raise NotImplementedError

    def forced_prefix(self, name: str | None) -> str:
        """The text a forced call's reply begins with: the calls' head and the call's opening (up to
        its arguments, for a named function)."""
        return self.head + (self.call_head(name) if name else self.call_open)

    def first_call_end(self, text: str) -> int | None:
        raise NotImplementedError

    def call_begins(self, text: str) -> bool:
        """A call surely begins in ``text`` (a reply so far): streaming sends no more content."""
        return any(mark in text for mark in self.marks)

    def content_end(self, text: str) -> int:
        """Characters of ``text`` (a reply so far) that are content whatever follows."""
        cut = len(text)
        for mark in self.marks:
            at = text.find(mark)
            if at >= 0:
                cut = min(cut, at)
        if cut == len(text):
            cut -= _partial_mark(text, self.marks)
        return cut


class HermesFormat(ToolFormat):
    name = "hermes"
    marks = ("<tool_call>",)
    call_open = '<tool_call>\n{"name": "'
    call_close = "}\n</tool_call>"
    separator = "\n"
    trigger = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
    CLOSE = "</tool_call>"

    def parse(self, text):
        blocks = list(self._BLOCK.finditer(text))
        if not blocks:
            return text, []
        calls = []
        for block in blocks:
            try:
                call = _call_object(json.loads(block.group(1)), ("arguments", "parameters"))
            except ValueError:
                return text, []
            if call is None:
                return text, []
            calls.append(_call(*call, self.call_id()))
        rest = self._BLOCK.sub("", text).strip()
        return rest or None, calls

    def first_call_end(self, text):
        block = self._BLOCK.search(text)
        return block.end() if block else None


class Llama3JsonFormat(ToolFormat):
    """Llama 3.x JSON tool calls: the reply is the call(s), nothing else (Meta's format: the model
    answers either in text or with a JSON call)."""
    name = "llama3_json"
    special = ("<|python_tag|>",)
    args_key = "parameters"
    separator = "; "
    trigger = '{"name": '
    TAG = "<|python_tag|>"

    def _objects(self, text: str):
        """(start of the calls, [(name, args, end)]) or None: the reply as ';'-separated call objects."""
        s = text.lstrip()
        at = len(text) - len(s)
        if s.startswith(self.TAG):
            at += len(self.TAG)
        out = []
        while True:
            while at < len(text) and text[at].isspace():
                at += 1
            try:
                obj, end = _DECODER.raw_decode(text, at)
            except ValueError:
                return out or None, False
            call = _call_object(obj, ("parameters", "arguments"))
            if call is None:
                return None, False
            out.append((*call, end))
            at = end
            while at < len(text) and text[at].isspace():
                at += 1
            if at == len(text):
                return out, True
            if text[at] != ";":
                return out, False
            at += 1

    def parse(self, text):
        calls, whole = self._objects(text)
        if not calls or not whole:
            return text, []
        return None, [_call(name, args, self.call_id()) for name, args, _ in calls]

    def first_call_end(self, text):
        calls, _ = self._objects(text)
        return calls[0][2] if calls else None

    def call_begins(self, text):
        s = text.lstrip()
        return s.startswith("{") or s.startswith(self.TAG)

    def content_end(self, text):
        s = text.lstrip()
        if not s or s.startswith("{") or s.startswith(self.TAG) or self.TAG.startswith(s):
            return 0  # may be a call: nothing is content until the reply is known
        return len(text)


class MistralFormat(ToolFormat):
    name = "mistral"
    marks = ("[TOOL_CALLS]",)
    special = ("[TOOL_CALLS]",)
    MARK = "[TOOL_CALLS]"
    head = "[TOOL_CALLS] ["
    separator = ", "
    tail = "]"
    trigger = "[TOOL_CALLS]"
    _ALNUM = string.ascii_letters + string.digits

    def call_id(self) -> str:  # Mistral's template refuses any other id shape
        return "".join(secrets.choice(self._ALNUM) for _ in range(9))

    def _array(self, text: str):
        at = text.find(self.MARK)
        if at < 0:
            return None
        i = at + len(self.MARK)
        while i < len(text) and text[i].isspace():
            i += 1
        return at, i

    def parse(self, text):
        found = self._array(text)
        if found is None:
            return text, []
        at, i = found
        try:
            arr, end = _DECODER.raw_decode(text, i)
        except ValueError:
            return text, []
        if not isinstance(arr, list) or not arr or text[end:].strip():
            return text, []
        calls = []
        for obj in arr:
            call = _call_object(obj, ("arguments", "parameters"))
            if call is None:
                return text, []
            calls.append(_call(*call, self.call_id()))
        return text[:at].strip() or None, calls

    def first_call_end(self, text):
        found = self._array(text)
        if found is None or found[1] >= len(text) or text[found[1]] != "[":
            return None
        i = found[1] + 1
        while i < len(text) and text[i].isspace():
            i += 1
        try:
            _, end = _DECODER.raw_decode(text, i)
        except ValueError:
            return None
        return end


TOOL_FORMATS = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat())}

SPECIAL = tuple(t for f in TOOL_FORMATS.values() for t in f.special)
"""Special tokens every renderer decodes as text (chat.ChatRenderer.keep_special): a format's markers,
which a tokenizer that has them would otherwise skip along with eos."""


@dataclass(frozen=True)
class ThinkFormat:
    """``<think>reasoning</think>content``. ``starts_open``: the generation prompt already opened the
    block, so the reply begins inside it."""
    starts_open: bool = False
    OPEN = "<think>"
    CLOSE = "</think>"

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole reply. Reasoning loses its edge newlines, content
        the newlines after </think>; a reply cut inside the block is all reasoning."""
        body = self._body(text)
        if body is None:
            return None, text
        end = body.find(self.CLOSE)
        if end < 0:
            return body.strip("\n"), ""
        return body[:end].strip("\n"), body[end + len(self.CLOSE):].lstrip("\n")

    def _body(self, text: str) -> str | None:
        if self.starts_open:
            return text[len(self.OPEN):] if text.startswith(self.OPEN) else text
        s = text.lstrip()
        if s.startswith(self.OPEN):
            return s[len(self.OPEN):]
        return None

    def partial(self, text: str) -> tuple[str, str | None]:
        """For a reply so far: (the reasoning that is surely the start of the final one, the content so
        far, or None while it cannot be content yet: inside the block, or before it may open)."""
        if self.starts_open and text and self.OPEN.startswith(text) and text != self.OPEN:
            return "", None  # the model may be repeating the opening the prompt gave
        if not self.starts_open:
            s = text.lstrip()
            if not s or (self.OPEN.startswith(s) and s != self.OPEN):
                return "", None  # may still open a block
        body = self._body(text)
        if body is None:
            return "", text
        end = body.find(self.CLOSE)
        if end < 0:
            return body[:len(body) - _partial_mark(body, (self.CLOSE,))].strip("\n"), None
        return body[:end].strip("\n"), body[end + len(self.CLOSE):].lstrip("\n")


@dataclass(frozen=True)
class Formats:
    tools: ToolFormat
    think: ThinkFormat | None

    @property
    def special(self) -> tuple[str, ...]:
        return self.tools.special


def detect_tool_format(template: str) -> str:
    """The tool-call format a chat template writes (hermes when it shows none of the others)."""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"


def choose(template: str, generation_prompt: str, tool_parser: str = "auto", reasoning_parser: str = "auto",
           template_tools: bool = True) -> Formats:
    """The formats for a chat template (and the text of its generation prompt). A template that does
    not render tools gets the gateway's own hermes description of them (chat.TOOLS_SYSTEM_TEXT), so
    its replies are parsed as hermes unless the knob says otherwise."""
    name = tool_parser if tool_parser != "auto" else detect_tool_format(template) if template_tools else "hermes"
    think = None
    if reasoning_parser == "think" or (reasoning_parser == "auto" and ThinkFormat.OPEN in template):
        think = ThinkFormat(starts_open=generation_prompt.rstrip().endswith(ThinkFormat.OPEN))
    return Formats(TOOL_FORMATS[name], think)
