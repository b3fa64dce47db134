"""A streamed reply split as the final one will be: reasoning deltas and content deltas, for any model
family's formats (``parsers``), and a forced tool-call opening given before the sampled tokens.

``ReplyFeed`` is ``live.TextFeed`` (its incremental decoding) with the rules of ``parsers``: what it
sends is always the start of the final reply's ``reasoning_content`` and ``content``, and
``rest_reasoning`` / ``rest`` give what is left once the final reply is known, so the deltas add up to
the unstreamed reply whatever the split.

    feed = ReplyFeed(renderer.decode, stops, formats.tools, formats.think, prefix_ids=forced)
    reasoning, content = feed.feed(start, ids)       # as the backend reports tokens
"""

from __future__ import annotations

from nodes.gateway.live import TextFeed, _partial_mark
from nodes.gateway.parsers import ThinkFormat, ToolFormat


class ReplyFeed(TextFeed):
    def __init__(self, decode, stops: list[str], tools: ToolFormat | None, think: ThinkFormat | None,
                 prefix_ids=()):
        super().__init__(decode, stops, tools=False)
        self.format, self.think = tools, think
        self.prefix = [int(t) for t in prefix_ids]
        self.prefix_text = decode(self.prefix) if self.prefix else ""
        self.ids = list(self.prefix)
        self.sent_reasoning = ""

    def feed(self, start: int, ids) -> tuple[str, str]:
        """(new reasoning, new content) safe to send after the tokens of the output from ``start``."""
        have = len(self.ids) - len(self.prefix)
        if start > have:  # a report was dropped: the rest comes with the final reply
            self.done = True
        if self.done:
            return "", ""
        self.ids.extend(int(t) for t in ids[have - start:])
        text = self._decoded()
        cut = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character decodes to U+FFFD for now
        skip = len(self.prefix_text)
        stopped = False
        for stop in self.stops:
            at = text.find(stop, skip)
            if at >= 0:
                cut, stopped = min(cut, at), True
        text = text[:cut]
        if not stopped:
            text = text[:len(text) - _partial_mark(text[skip:], tuple(self.stops))]
        reasoning, content = self.think.partial(text) if self.think is not None else ("", text)
        new_reasoning = ""
        if len(reasoning) > len(self.sent_reasoning) and reasoning.startswith(self.sent_reasoning):
            new_reasoning, self.sent_reasoning = reasoning[len(self.sent_reasoning):], reasoning
        new_content = ""
        if content is not None:
            if self.format is not None:
                if self.format.call_begins(content):
                    stopped = True  # a call begins: nothing after it is content
                content = content[:self.format.content_end(content)]
                if content[:1].isspace():  # content around calls is stripped: only the final reply knows
                    content = ""
                content = content.rstrip()
            if len(content) > len(self.sent) and content.startswith(self.sent):
                new_content, self.sent = content[len(self.sent):], content
        self.done = stopped
        return new_reasoning, new_content

    def rest_reasoning(self, reasoning: str | None) -> str:
        reasoning = reasoning or ""
        if reasoning.startswith(self.sent_reasoning):
            return reasoning[len(self.sent_reasoning):]
        self.mismatched = True
        return reasoning
