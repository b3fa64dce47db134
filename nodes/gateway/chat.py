"""Chat messages <-> token ids: the chat template, the no-re-tokenisation rule, tool calls, stops.

``ChatRenderer`` wraps a Hugging Face tokenizer with a chat template:

- ``prompt_ids(messages, tools)``: a whole conversation (OpenAI format: system / developer / user /
  assistant with tool_calls / tool) rendered by the template, ending with the assistant header.
- ``continuation_ids(new_messages, tools, closed)``: for turn k > 1 of a session, ONLY the tokens
  that follow the previous assistant turn's sampled ids: the template's end of that turn, the new
  messages and the next assistant header. Found as ``areal_bus.tasks.guess.render_env_turn`` does:
  render ``[assistant "\\x00", *new_messages]`` and take the text after the marker's eos. The
  session's next prompt is then ``recorded ids + these``, never a re-tokenisation of sampled text.
  The render starts with a stand-in user turn before the marker, so templates that insist on
  user/assistant alternation (Mistral) or that put tools in the first user turn (Llama 3.1) render
  the continuation as they would mid-conversation.
- ``parse_tool_calls(text)``: Qwen-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks in the model's output -> OpenAI ``tool_calls`` (other families' formats: ``parsers``).
- ``stop_cut(ids, stops, prefix)`` (``apply_stop``): where string stops cut a completion, in text and in sampled ids.
- ``keep_special(tokens)``: special tokens that decoding keeps (a format's markers, ``[TOOL_CALLS]``),
  where every other special token is skipped.

Tools with a template that ignores them (the shipped tiny model's ChatML template renders only role
and content): the tool definitions are written into the system message in Qwen2.5's layout (a
``<tools>`` block of JSON signatures and the ``<tool_call>`` reply format), an assistant turn's
tool_calls become ``<tool_call>`` blocks in its content, and a tool result becomes a user turn
``<tool_response>\\n...\\n</tool_response>``. Templates that know tools (Qwen2.5, Qwen3, Llama 3.1)
get them through ``apply_chat_template(..., tools=...)`` and render them their own way.
"""

from __future__ import annotations

import collections
import json

import numpy as np
from jinja2 import TemplateError

from nodes.gateway.parsers import SPECIAL, TOOL_FORMATS

try:  # optional: faster keys for the render cache (json's otherwise; either is exact)
    import orjson
except ImportError:
    orjson = None

MARKER = "\x00"
"""A character no template or message contains: locates the end of the previous assistant turn."""

_PROBE_TOOL = {"type": "function", "function": {
    "name": "areal_probe_fn", "description": "probe", "parameters": {"type": "object", "properties": {}}}}

TOOLS_SYSTEM_TEXT = (
    "# Tools\n\nYou may call one or more functions to help with the user's request.\n\n"
    "The available functions are listed as JSON signatures inside <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, reply with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")
"""System text describing tools for a template that ignores ``tools=`` (Qwen2.5's layout)."""

TOOL_OPEN = "<tool_call>"

_PROBE_CALL_ID = "a1b2c3d4e"
"""A tool-call id every template accepts (Mistral's insists on 9 alphanumerics)."""

_HELLO = {"role": "user", "content": "hi"}


class ChatError(ValueError):
    """A conversation the template cannot render (bad shape for this model): a 400 for the client."""

    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message)
        self.param = param


def message_text(content) -> str:
    """The text of an OpenAI message content: a string, a list of text parts, or None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content)


def _canonical_args(arguments) -> str:
    """Tool-call arguments in one spelling, so a client that re-serialises them still matches."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"))


def canonical(message: dict) -> tuple:
    """What must be equal for a message the client sends back to be the one that was recorded: role,
    text and tool calls (name and arguments; not the call ids, which clients may rewrite)."""
    role = "system" if message["role"] == "developer" else message["role"]
    calls = tuple((c["function"]["name"], _canonical_args(c["function"].get("arguments", "{}")))
                  for c in message.get("tool_calls") or ())
    return role, message_text(message.get("content")), calls


def tool_call_block(name: str, arguments) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split model output into (content, OpenAI tool_calls), Hermes/Qwen blocks. All or nothing: if
    any block is not a JSON object with a "name", the output is returned as plain content with no tool
    calls, so a garbled call reaches the client (and the reward) as the text the model wrote."""
    return TOOL_FORMATS["hermes"].parse(text)


RENDER_CACHE_SIZE = 4096
"""Rendered prompts kept (LRU): enough for every distinct first prompt and environment reply of a
run's recent episodes."""

RENDER_CACHE_BYTES = 32 << 20
"""...and at most this many bytes of keys and ids: the count alone would let 4,096 near-limit bodies
(1 MB each) hold 4 GB. An entry larger than a sixteenth of it is rendered but not kept."""


class ChatRenderer:
    """A tokenizer's chat template, used the way the session rule needs it (see the module doc)."""

    def __init__(self, tokenizer):
        self._render_cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_bytes = 0
        self.tok = tokenizer
        # A tokenizers-backed tokenizer that does no clean-up decodes exactly as its Rust backend does:
        # call that directly (transformers' wrapper costs more than the decoding, on every reply and on
        # every streamed update).
        backend = getattr(tokenizer, "_tokenizer", None)
        self._fast_decode = (backend.decode if callable(getattr(backend, "decode", None))
                             and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False else None)
        if tokenizer.eos_token is None or tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; the gateway needs it to close assistant turns")
        self.eos = tokenizer.eos_token
        self.eos_id = int(tokenizer.eos_token_id)
        hello = [_HELLO]
        self._skip_ids: frozenset[int] | None = None  # keep_special: the special ids decoding skips
        self.keep_special(SPECIAL)
        template = getattr(tokenizer, "chat_template", None)
        self.template = template if isinstance(template, str) else json.dumps(template or "")
        self.generation_prompt = self._render(hello, None)
        self.template_tools = "areal_probe_fn" in self._render(hello, [_PROBE_TOOL])
        self.template_tool_calls = self._renders_tool_calls()
        after = self._render([_HELLO, {"role": "assistant", "content": MARKER}, *hello], None).split(MARKER, 1)[1]
        if not after.startswith(self.eos):
            raise ValueError("the chat template does not end an assistant turn with the eos token "
                             f"({self.eos!r}); the gateway cannot continue sessions without re-tokenising")

    def _render(self, messages: list[dict], tools: list[dict] | None) -> str:
        try:
            return self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                add_generation_prompt=True)
        except TemplateError as exc:
            raise ChatError(f"the model's chat template refused this conversation: {exc}") from None

    def _renders_tool_calls(self) -> bool:
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"id": _PROBE_CALL_ID, "type": "function", "function": {"name": "areal_probe_fn", "arguments": {}}}]}
        try:
            return "areal_probe_fn" in self._render([{"role": "user", "content": "hi"}, call], [_PROBE_TOOL])
        except (ChatError, TypeError):
            return False

    # -- messages as the template gets them -----------------------------------------------------

    def template_messages(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        """OpenAI messages -> what this template can render (see the module doc for the fallback)."""
        out = []
        for msg in messages:
            role, text = msg["role"], message_text(msg.get("content"))
            if role == "developer":
                role = "system"
            if role == "assistant" and msg.get("tool_calls"):
                calls = msg["tool_calls"]
                if self.template_tool_calls:
                    out.append({"role": "assistant", "content": text, "tool_calls": [
                        {**({"id": c["id"]} if c.get("id") else {}), "type": "function",
                         "function": {"name": c["function"]["name"],
                                      "arguments": _args_object(c["function"].get("arguments"))}}
                        for c in calls]})
                else:
                    blocks = "\n".join(tool_call_block(c["function"]["name"], c["function"].get("arguments", {}))
                                       for c in calls)
                    out.append({"role": "assistant", "content": f"{text}\n{blocks}" if text else blocks})
            elif role == "tool" and not self.template_tools:
                out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
            else:
                item = {"role": role, "content": text}
                if role == "tool" and msg.get("tool_call_id"):
                    item["tool_call_id"] = msg["tool_call_id"]
                if msg.get("name"):
                    item["name"] = msg["name"]
                out.append(item)
        if tools and not self.template_tools:
            spec = TOOLS_SYSTEM_TEXT.format(tools="\n".join(json.dumps(t) for t in tools))
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{spec}"}
            else:
                out.insert(0, {"role": "system", "content": spec})
        return out

    def _template_tools(self, tools: list[dict] | None) -> list[dict] | None:
        return tools if tools and self.template_tools else None

    # -- ids ---------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def keep_special(self, tokens) -> None:
        """Decode these special tokens as their text (a tool-call format's markers); every other
        special token is still skipped."""
        vocab = self.tok.get_vocab()
        keep = {vocab[t] for t in tokens if t in vocab}
        if not keep:
            return
        special = {int(i) for i, t in getattr(self.tok, "added_tokens_decoder", {}).items() if t.special}
        self._skip_ids = frozenset((special | set(self.tok.all_special_ids)) - keep)

    def decode(self, ids) -> str:
        ids = ids.tolist() if isinstance(ids, np.ndarray) else [int(t) for t in ids]
        if self._skip_ids is not None:
            ids = [t for t in ids if t not in self._skip_ids]
            if self._fast_decode is not None:
                return self._fast_decode(ids, skip_special_tokens=False)
            return self.tok.decode(ids, skip_special_tokens=False)
        if self._fast_decode is not None:
            return self._fast_decode(ids, skip_special_tokens=True)
        return self.tok.decode(ids, skip_special_tokens=True)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """A whole conversation, ready for the assistant's reply."""
        return list(self._cached("p", messages, tools, self._prompt_ids))

    def _prompt_ids(self, messages, tools) -> tuple[int, ...]:
        text = self._render(self.template_messages(messages, tools), self._template_tools(tools))
        return tuple(self.encode(text))

    def continuation_ids(self, new_messages: list[dict], tools: list[dict] | None, closed: bool) -> list[int]:
        """Ids to append after a recorded assistant turn: its end (an eos first if the sampled ids did
        not end with one), the new messages and the next assistant header."""
        ids = list(self._cached("c", new_messages, tools, self._continuation_ids))
        return ids if closed else [self.eos_id, *ids]

    def _continuation_ids(self, new_messages, tools) -> tuple[int, ...]:
        convo = [_HELLO, {"role": "assistant", "content": MARKER}, *self.template_messages(new_messages, None)]
        text = self._render(convo, self._template_tools(tools))
        after = text[text.index(MARKER) + 1:]
        return tuple(self.encode(after[len(self.eos):]))

    def _cached(self, kind: str, messages, tools, render) -> tuple[int, ...]:
        """Rendering is the gateway's largest CPU cost per request, and agents repeat themselves: a
        GRPO group sends one first prompt n times, every game sends the same few environment replies.
        The key is the exact JSON of what is rendered, so a hit is the same token ids by construction."""
        try:
            key = (kind, _key(messages), _key(tools) if tools else "")
        except (TypeError, ValueError):  # not JSON-able: render uncached
            return render(messages, tools)
        hit = self._render_cache.get(key)
        if hit is not None:
            self._render_cache.move_to_end(key)
            return hit
        hit = render(messages, tools)
        size = _entry_bytes(key, hit)
        if size <= RENDER_CACHE_BYTES // 16:
            self._render_cache[key] = hit
            self._cache_bytes += size
            while len(self._render_cache) > RENDER_CACHE_SIZE or self._cache_bytes > RENDER_CACHE_BYTES:
                old_key, old_ids = self._render_cache.popitem(last=False)
                self._cache_bytes -= _entry_bytes(old_key, old_ids)
        return hit

    def apply_stop(self, ids, stops: list[str]) -> tuple[int, str, bool]:
        """(ids to keep, text for the client, stopped): ``stop_cut`` without a prefix or the match."""
        return self.stop_cut(ids, stops)[:3]

    def stop_cut(self, ids, stops: list[str], prefix=()) -> tuple[int, str, bool, str | None]:
        """(ids to keep, text for the client, stopped, the stop string matched) for a completion and
        string stops. ``prefix``: ids given before the sampled ones (a forced tool-call opening), part
        of the text but never searched for stops. The text ends before the earliest stop string (as
        OpenAI's does); the ids run through the token that completed it, so the record holds exactly
        what was sampled up to the cut."""
        prefix = [int(t) for t in prefix]
        ids_list = [int(t) for t in ids]
        text = self.decode(prefix + ids_list)
        start = len(self.decode(prefix)) if prefix else 0
        hits = sorted((i, s) for i, s in ((text.find(s, start), s) for s in stops if s) if i >= 0)
        if not hits:
            return len(ids), text, False, None
        at, matched = hits[0]
        return self.first_holding(ids_list, lambda t: any(s and s in t[start:] for s in stops), prefix), \
            text[:at], True, matched

    def first_holding(self, ids, holds, prefix=()) -> int:
        """The fewest of ``ids`` whose text (after ``prefix``) ``holds(text)`` is true of (len(ids) if
        only all of them do): where a completion is cut so the record ends at the token that made it so."""
        prefix = [int(t) for t in prefix]
        ids = [int(t) for t in ids]
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if holds(self.decode(prefix + ids[:mid])):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def stop_token_ids(self, stops: list[str]) -> list[int]:
        """String stops that are exactly one token: the engine can stop on them by id."""
        out = []
        for s in stops:
            ids = self.encode(s) if s else []
            if len(ids) == 1:
                out.append(ids[0])
        return out

    def text_pieces(self, ids, content: str) -> list[str]:
        """``content`` cut where token boundaries fall (for streaming deltas); a piece is emitted only
        when it decodes to whole characters."""
        pieces, buf = [], []
        for t in ids:
            buf.append(int(t))
            piece = self.decode(buf)
            if piece and not piece.endswith("\ufffd"):
                pieces.append(piece)
                buf = []
        if buf:
            pieces.append(self.decode(buf))
        out, total = [], 0
        for p in pieces:
            if total + len(p) > len(content):
                p = p[:len(content) - total]
            if p:
                out.append(p)
                total += len(p)
        if "".join(out) != content:  # the text was reshaped (tool calls taken out): one delta
            return [content] if content else []
        return out


def _entry_bytes(key: tuple, ids: tuple) -> int:
    """About what a render-cache entry holds: its key's JSON, and per id a tuple slot and an int object."""
    return len(key[1]) + len(key[2]) + 40 * len(ids) + 200


def _key(obj):
    """The exact JSON of ``obj`` (keys sorted) as a cache key; TypeError / ValueError if it is not JSON."""
    if orjson is not None:
        try:
            key = orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)
        except TypeError:  # what json encodes besides (int keys, huge ints) or refuses as well
            key = b"null"
        if b"null" not in key:  # orjson writes NaN and inf as null too: json's spelling keeps them apart
            return key
    return json.dumps(obj, sort_keys=True)


def _args_object(arguments):
    """HF templates expect tool-call arguments as an object; OpenAI sends a JSON string."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments if arguments is not None else {}
