"""Live streaming: a completion's text sent while the rollout worker is still generating it.

The backend reports each run of sampled tokens (``on_tokens``); a ``TextFeed`` per choice turns them
into text that is certain to begin the final reply, and a ``LiveStream`` writes it in the API's
server-sent events (OpenAI's or Anthropic's). When the completion is done the stream is finished from
the gateway's final reply (the same ``resp`` a non-streamed request gets): the text not yet sent,
tool calls, finish reason, usage. So the concatenated deltas always equal the final content, and a
request served by a backend that cannot stream (or whose partial reports were dropped) is finished
the same way, just in fewer, later pieces. The events themselves are built by
``openai_api.StreamChunks`` and ``anthropic_reply.StreamEvents``; ``LiveStream`` writes them.

What a feed holds back until it is sure: an incomplete UTF-8 character (the decoder's U+FFFD), the
end of the text that could be the beginning of a stop string or of a ``<tool_call>`` block, and with
tools, text from a tool call block on (it becomes tool_calls, not content) and whitespace that
``parse_tool_calls`` would strip.

    live = LiveStream(model, include_usage=True)       # or LiveStream(model, anthropic=True)
    await live.open(request, rid, prompt_tokens, n)    # headers and the opening events
    await live.text(i, feed.add(start, ids))           # as tokens arrive (feed = TextFeed(...))
    await live.finish(resp, [[feed.rest(content)]])    # the rest, tool calls, finish, usage, end
"""

from __future__ import annotations

from aiohttp import web

from nodes.gateway import anthropic_api, anthropic_reply
from nodes.gateway.chat import TOOL_OPEN
from nodes.gateway.openai_api import SSE_DONE, OpenAIError, StreamChunks, sse
from nodes.gateway.server import SSE_HEADERS


class TextFeed:
    """One choice's streamed text. ``add`` takes tokens as reported and returns the new text safe to
    send; ``rest`` the remainder once the final content is known."""

    def __init__(self, decode, stops: list[str], tools: bool):
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.tools = tools
        self.marks = [*self.stops, TOOL_OPEN] if tools else self.stops
        self.ids: list[int] = []
        self.text = ""  # the text of ids[:read], which ends on a whole character
        self.window = self.read = 0  # ids[window:read] are the last decoded run: context for the next
        self.sent = ""
        self.done = False  # a stop string or a tool call block began: nothing more is content
        self.mismatched = False

    def add(self, start: int, ids) -> str:
        if start > len(self.ids):  # a report was dropped: the rest comes with the final reply
            self.done = True
        if self.done:
            return ""
        self.ids.extend(int(t) for t in ids[len(self.ids) - start:])
        text = self._decoded()
        cut = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character decodes to U+FFFD for now
        for mark in self.marks:
            at = text.find(mark)
            if at >= 0:
                cut, self.done = min(cut, at), True
        text = text[:cut]
        if not self.done:
            text = text[:len(text) - _partial_mark(text, self.marks)]
        if self.tools:  # parse_tool_calls strips the content around tool calls: send no edge whitespace
            if text[:1].isspace():
                return ""  # leading whitespace stays only if no call parses: wait for the final reply
            text = text.rstrip()
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""  # nothing new, or the decoder reshaped earlier text: wait
        new, self.sent = text[len(self.sent):], text
        return new

    def _decoded(self) -> str:
        """The text of every id so far. Only the new ids and the run before them are decoded (as vLLM's
        incremental detokenizer does), so an update costs what it adds, not the length of the reply."""
        before = self.decode(self.ids[self.window:self.read]) if self.read > self.window else ""
        after = self.decode(self.ids[self.window:])
        if not after.startswith(before):  # the decoder reshapes earlier text in context: decode it all
            self.text, self.window, self.read = "", 0, 0
            before, after = "", self.decode(self.ids)
        text = self.text + after[len(before):]
        if not after.endswith("\ufffd"):  # ends on a whole character: the next window starts here
            self.text, self.window, self.read = text, self.read, len(self.ids)
        return text

    def rest(self, content: str | None) -> str:
        content = content or ""
        if content.startswith(self.sent):
            return content[len(self.sent):]
        self.mismatched = True  # cannot happen by the rules above; if it does, the client gets the tail
        common = 0
        while common < min(len(content), len(self.sent)) and content[common] == self.sent[common]:
            common += 1
        return content[common:]


def _partial_mark(text: str, marks: list[str]) -> int:
    """How many characters at the end of ``text`` could begin one of ``marks``."""
    for k in range(min(len(text), max((len(m) for m in marks), default=1) - 1), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in marks):
            return k
    return 0


class LiveStream:
    """One streamed reply on the wire, in OpenAI's shape (``anthropic=False``) or Anthropic's. A client
    that leaves is not an error: later writes do nothing (a session's turn is recorded all the same)."""

    def __init__(self, model: str, *, anthropic: bool = False, include_usage: bool = False):
        self.model, self.anthropic, self.include_usage = model, anthropic, include_usage
        self.stream: web.StreamResponse | None = None
        self.events = anthropic_reply.StreamEvents(model) if anthropic else None
        self.chunks: StreamChunks | None = None
        self.gone = False

    async def open(self, request: web.Request, rid: str, prompt_tokens: int, n: int) -> None:
        """Send the headers and the opening events (the client sees the reply has begun)."""
        self.stream = web.StreamResponse(headers=SSE_HEADERS)
        try:
            await self.stream.prepare(request)
        except (ConnectionError, RuntimeError):
            self.gone = True
        if self.anthropic:
            await self._write(_events(self.events.opening(rid, prompt_tokens)))
        else:
            self.chunks = StreamChunks(rid, self.model)
            await self._write(_chunks(self.chunks.opening(n)))

    async def text(self, index: int, delta: str) -> None:
        if not self.gone:
            await self._write(_events(self.events.text(delta)) if self.anthropic
                              else _chunks(self.chunks.text(index, delta)))

    async def reasoning(self, index: int, delta: str) -> None:
        """A reasoning delta (OpenAI ``reasoning_content``, an Anthropic thinking block; feed.ReplyFeed)."""
        if not self.gone and delta:
            await self._write(_events(self.events.thought(delta)) if self.anthropic
                              else _chunks(self.chunks.reasoning(index, delta)))

    async def finish(self, resp: dict, rest: list[list[str]]) -> None:
        """The rest of every choice's text (``rest[i]``, in pieces), tool calls, finish, usage, the end."""
        await self._write(_events(self.events.closing(resp, rest[0])) if self.anthropic
                          else _chunks(self.chunks.closing(resp, rest, self.include_usage)) + SSE_DONE, eof=True)

    async def fail(self, err: OpenAIError) -> None:
        """An error after the stream has begun: in the API's own shape, then the end."""
        await self._write(_events([("error", anthropic_api.error_body(err.status, err.message))]) if self.anthropic
                          else sse(err.body()) + SSE_DONE, eof=True)

    async def _write(self, data: bytes, eof: bool = False) -> None:
        if self.gone:
            return
        try:
            await self.stream.write(data)
            if eof:
                await self.stream.write_eof()
        except (ConnectionError, RuntimeError):  # the client left (aiohttp raises one or the other)
            self.gone = True


def _events(events: list[tuple[str, dict]]) -> bytes:
    return b"".join(anthropic_reply.format_sse(e, d) for e, d in events)


def _chunks(chunks: list[dict]) -> bytes:
    return b"".join(sse(c) for c in chunks)
