"""How a chat request's completions become the replies the client sees: ``Shaper``.

``Shaper.shaping`` reads what a request asks for (stop strings, tools, a forced tool call,
parallel_tool_calls) into a ``Shaping``; ``Shaper.postprocess`` turns one backend completion into the
choice the client sees (``ChoiceOut``): cut at a string stop, cut after the first call (parallel_tool_calls
false), reasoning split off, tool calls parsed in the family's format (``parsers``), finish reason. The
stream feeds (``feed.ReplyFeed``) follow the same ``Shaping`` while the reply is generated.

A forced tool call (tool_choice "required" or a named function; Anthropic any / tool) is the opening of
the family's call format (``<tool_call>\\n{"name": "`` and, for a named function, its name and
``"arguments": ``) appended to the prompt, after the assistant header: the policy samples only the
rest. Those tokens are GIVEN, not sampled: they are part of the recorded prompt (a turn's env tokens
in a session), with no log-probability and no loss, because the policy did not choose them; counting
them as sampled would credit the policy with a choice the gateway made, and their behaviour
log-probabilities would not be what was sampled under. The session's next turn continues from prompt
+ sampled ids, so the model's context holds the forced opening exactly as it saw it. The reply the
client gets is parsed from the forced text + the sampled text. The rest of the call is sampled under a
grammar (nodes/gateway/structured.py: one of the tools' names, arguments valid for its schema, the
family's call end), so it completes unless max_tokens cuts it; a call that does not parse (cut, or from a
backend that applies no grammar) comes back as content, as with any garbled call, so the reward can see it.

parallel_tool_calls false (Anthropic disable_parallel_tool_use): a reply holding more than one call is
cut after the token that completes the first, like a stop string: the record ends there (the turn is
closed by an eos the next turn's continuation adds) and the tokens sampled after it are dropped, so
the trainer and the next turn see the one call the client got, never calls it did not.

    shaper = Shaper(renderer, cfg.tool_parser, cfg.reasoning_parser)
    shaping = shaper.shaping(req, tools=True)
    out = shaper.postprocess(completion, shaping)       # out.message, out.finish_reason
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nodes.gateway import parsers
from nodes.gateway.chat import ChatRenderer
from nodes.gateway.openai_api import ChatRequest


@dataclass(slots=True)
class ChoiceOut:
    """One choice after the gateway's post-processing."""
    completion: object  # areal_bus.wire.messages.Completion, cut at a string stop
    message: dict
    finish_reason: str
    stop: str | None = None  # the stop string that ended it, if one did


@dataclass(frozen=True, slots=True)
class Shaping:
    """How a request's completions become the replies: what ``Shaper.postprocess`` and the stream feeds do."""
    stops: list[str]
    tools: parsers.ToolFormat | None  # None: no tool calls are parsed
    think: parsers.ThinkFormat | None
    forced: tuple[int, ...] = ()  # a forced call's opening, given at the end of the prompt
    single_call: bool = False  # parallel_tool_calls false


def cut_completion(comp, keep: int):
    """A completion cut after its first ``keep`` tokens (where a stop string or the first call ends)."""
    return dataclasses.replace(comp, output_ids=comp.output_ids[:keep], logprobs=comp.logprobs[:keep],
                               versions=comp.versions[:keep], top_ids=comp.top_ids[:keep],
                               top_logprobs=comp.top_logprobs[:keep], finish_reason="stop")


class Shaper:
    """The policy's reply formats (tool calls, reasoning) applied to its completions."""

    def __init__(self, renderer: ChatRenderer, tool_parser: str | None, reasoning_parser: str | None):
        self.renderer = renderer
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self._formats: parsers.Formats | None = None

    @property
    def formats(self) -> parsers.Formats:
        """The policy's tool-call and reasoning formats: the config's knobs, or read from its template
        (on first use)."""
        if self._formats is None:
            r = self.renderer
            self._formats = parsers.choose(r.template, r.generation_prompt, self.tool_parser,
                                           self.reasoning_parser, r.template_tools)
        return self._formats

    def shaping(self, req: ChatRequest, tools: bool) -> Shaping:
        """What ``req`` asks of its replies; ``tools``: whether tools are offered (and parsed)."""
        formats = self.formats
        required, name = req.forced_tool
        forced: tuple[int, ...] = ()
        if tools and required:
            text = formats.tools.forced_prefix(name)
            if formats.think is not None and formats.think.starts_open:  # the prompt opened a <think>: close it
                text = parsers.ThinkFormat.CLOSE + "\n\n" + text
            forced = tuple(self.renderer.encode(text))
        return Shaping(req.stops, formats.tools if tools else None, formats.think, forced,
                       tools and req.parallel_tool_calls is False)

    def postprocess(self, comp, shaping: Shaping) -> ChoiceOut:
        """One backend completion as the choice the client sees (the completion cut where the reply ends)."""
        ids, forced, r = comp.output_ids, shaping.forced, self.renderer
        keep, text, stopped, matched = r.stop_cut(ids, shaping.stops, forced)
        if shaping.single_call and shaping.tools is not None:
            cut = self._first_call_cut(ids[:keep], text, shaping)
            if cut is not None:
                keep, text, stopped, matched = cut, r.decode([*forced, *ids[:cut]]), False, None
        if keep < ids.size:
            comp = cut_completion(comp, keep)
        reasoning, content = shaping.think.split(text) if shaping.think is not None else (None, text)
        content, calls = shaping.tools.parse(content) if shaping.tools is not None else (content, [])
        message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        finish = "tool_calls" if calls else "stop" if stopped else comp.finish_reason
        return ChoiceOut(comp, message, finish, matched if stopped and not calls else None)

    def _first_call_cut(self, ids, text: str, shaping: Shaping) -> int | None:
        """For parallel_tool_calls false: how many of ``ids`` to keep so the reply ends with its first
        call, when it holds more than one (None: keep them all)."""
        reasoning, content = shaping.think.split(text) if shaping.think is not None else (None, text)
        if len(shaping.tools.parse(content)[1]) < 2:
            return None
        offset = len(text) - len(content)  # the content is the text's tail
        end = shaping.tools.first_call_end(content)
        if end is None:
            return None
        upto = text[:offset + end]
        return self.renderer.first_holding(ids, lambda t: t.startswith(upto), shaping.forced)
