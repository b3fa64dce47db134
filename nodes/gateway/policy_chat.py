"""The gateway's policy chat path: one chat request served by the policy being trained, from messages
to the response the API returns.

``complete`` builds the prompt (a session's turn continues the tokens its matching earlier turn was
served with, so the trainer sees exactly what was sampled), refuses what does not fit (context length,
``max_pending_requests``), hands the ``n`` choices to the backend, streams their text through a
``live.LiveStream`` when asked, records a session's turn (``sessions.SessionStore``) and builds the
OpenAI response. ``_postprocess`` turns one backend completion into the choice the client sees: cut at
a string stop, cut after the first call (parallel_tool_calls false), reasoning split off, tool calls
parsed in the family's format (``parsers``), finish reason.

A forced tool call (tool_choice "required" or a named function; Anthropic any / tool) is the opening of
the family's call format (``<tool_call>\n{"name": "`` and, for a named function, its name and
``"arguments": ``) appended to the prompt, after the assistant header: the policy samples only the
rest. Those tokens are GIVEN, not sampled: they are part of the recorded prompt (a turn's env tokens
in a session), with no log-probability and no loss, because the policy did not choose them; counting
them as sampled would credit the policy with a choice the gateway made, and their behaviour
log-probabilities would not be what was sampled under. The session's next turn continues from prompt
+ sampled ids, so the model's context holds the forced opening exactly as it saw it. The reply the
client gets is parsed from the forced text + the sampled text. The opening guarantees the format
starts, not that the model completes it: a call that does not parse comes back as content (finish
"stop"), as with any garbled call, so the reward can see it.

parallel_tool_calls false (Anthropic disable_parallel_tool_use): a reply holding more than one call is
cut after the token that completes the first, like a stop string: the record ends there (the turn is
closed by an eos the next turn's continuation adds) and the tokens sampled after it are dropped, so
the trainer and the next turn see the one call the client got, never calls it did not.

``PolicyChat`` is a mixin of ``app.Gateway`` (as ``rl_routes.RLRoutes`` is); it holds no state of its
own and relies on the Gateway's ``cfg``, ``backend``, ``tok``, ``renderer``, ``store``, ``jobs``,
``max_context``, ``pending``, ``metrics``, ``log`` and its response-id counter. The OpenAI route
(``app.Gateway.chat_completions``) and the Anthropic one (``anthropic_routes``) both end here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from nodes.gateway import parsers
from nodes.gateway.backend import SamplingParams
from nodes.gateway.chat import ChatError, canonical
from nodes.gateway.feed import ReplyFeed
from nodes.gateway.live import LiveStream
from nodes.gateway.openai_api import ChatRequest, OpenAIError, completion_response, token_logprobs
from nodes.gateway.sessions import Choice, Session

QUEUE_RETRY_AFTER_S = 1
"""Retry-After for a request refused because ``max_pending_requests`` generations are pending: about
the time a batch of short completions takes to drain, so a retried request usually finds room."""


@dataclass(slots=True)
class ChoiceOut:
    """One choice after the gateway's post-processing."""
    completion: object  # areal_bus.wire.messages.Completion, cut at a string stop
    message: dict
    finish_reason: str
    stop: str | None = None  # the stop string that ended it, if one did


@dataclass(frozen=True, slots=True)
class Shaping:
    """How a request's completions become the replies: what ``_postprocess`` and the stream feeds do."""
    stops: list[str]
    tools: parsers.ToolFormat | None  # None: no tool calls are parsed
    think: parsers.ThinkFormat | None
    forced: tuple[int, ...] = ()  # a forced call's opening, given at the end of the prompt
    single_call: bool = False  # parallel_tool_calls false


class PolicyChat:
    """Serving chat requests with the policy, for the Gateway that mixes this class in."""

    async def complete(self, req: ChatRequest, who, t0: float, live: LiveStream | None = None,
                       request: web.Request | None = None):
        """Serve a policy request: (response dict, choices). With ``live`` the reply is streamed to
        ``request`` while it is generated, and finished here ((None, []) if it ended in an error)."""
        session = who if isinstance(who, Session) else None
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        # tool_choice "none": no tools offered, none parsed
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
        history = [canonical(m) for m in messages]
        tools_key = json.dumps(tools, sort_keys=True) if tools else ""
        shaping = self._shaping(req, bool(tools))
        base, env_ids, prompt = self._prompt(session, messages, tools, history, tools_key, shaping.forced)
        room = self.max_context - int(prompt.size)
        wanted = req.max_completion_tokens or req.max_tokens or self.cfg.default_max_tokens or room
        stops = req.stops
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        params = SamplingParams(max_tokens=min(wanted, room), temperature=temperature,
                                top_p=1.0 if req.top_p is None else float(req.top_p),
                                stop_token_ids=tuple(self.renderer.stop_token_ids(stops)),
                                ticket=session.ticket if session is not None else 0)
        n = req.n or 1
        self._admit(n)

        loop = asyncio.get_running_loop()
        feeds = tokens = None
        if live is not None and getattr(self.backend, "streams_tokens", False):
            feeds = [ReplyFeed(self.renderer.decode, stops, shaping.tools, shaping.think, shaping.forced)
                     for _ in range(n)]
            tokens = asyncio.Queue()  # (choice, start, ids) from the backend, then None when the turn is done
        result = first = None
        if session is not None:
            # The turn is generated and recorded in a task of its own, which hands its outcome to a
            # future of ours: a disconnect cancels this handler and that future, never the recording.
            self.store.begin(session)
            if live is not None:  # the stream names its response id before the turn is recorded
                first = self.store.reserve(session, n)
            result = loop.create_future()
            job = loop.create_task(self._generate_and_record(session, base, prompt, env_ids, history, tools_key, n,
                                                             params, shaping, result, first, tokens))
            self.jobs.setdefault(session.id, set()).add(job)
        elif live is not None:  # nothing to record, but the handler writes while it generates
            result = loop.create_task(self._generate_unrecorded(prompt, params, n, shaping, tokens))
        rid = (f"chatcmpl-{self._rid_prefix}{next(self._rids)}" if session is None
               else f"chatcmpl-{session.id}-{first}" if first is not None else None)
        if live is not None:
            await live.open(request, rid, int(prompt.size), n)  # the client left: the live writes are no-ops
        reasoning = getattr(live, "reasoning", None)  # a live stream that shows reasoning as it comes
        if tokens is not None:
            result.add_done_callback(lambda _: tokens.put_nowait(None))
            while (item := await tokens.get()) is not None:
                i, start, ids = item
                thought, delta = feeds[i].feed(start, ids)
                if thought and reasoning is not None:
                    await reasoning(i, thought)
                if delta:
                    await live.text(i, delta)
        try:
            if result is not None:
                outs, indices = await result
            else:  # nothing to record: generated right here (no task), and a disconnect loses nothing
                try:
                    outs, failed = await self._generate("", prompt, params, n, shaping)
                finally:
                    self._add_pending(-n)
                if failed is not None:
                    raise failed
                indices = []
        except ValueError as exc:  # the backend refused the request
            err = OpenAIError(400, f"The engine refused the request: {exc}", code="invalid_request")
            if live is None:
                raise err from None
            await live.fail(err)
            return None, []
        except Exception as exc:  # the backend failed (no rollout worker, engine error): not the client's doing
            err = OpenAIError(503, f"The policy backend could not generate: {exc}", type="server_error",
                              code="backend_unavailable")
            if live is None:
                raise err from None
            await live.fail(err)
            return None, []

        resp = self._response(req, rid or f"chatcmpl-{session.id}-{indices[0]}", outs, int(prompt.size))
        completion_tokens = resp["usage"]["completion_tokens"]
        self.metrics.observe_seconds("gateway.latency_seconds", time.monotonic() - t0)  # Prometheus' histogram
        # Rendered once this handler has handed its response to the transport (call_soon runs after the
        # current step; lines keep their order): the line costs the loop, not this request's latency.
        loop.call_soon(functools.partial(
            self.log.info, "request", route="chat", model=req.model, routed_to="policy",
            session=session.id if session is not None else "-", prompt_tokens=int(prompt.size),
            completion_tokens=completion_tokens, n=n, stream=live is not None,
            ms=round((time.monotonic() - t0) * 1000)))
        if live is not None:
            if feeds is not None:  # what the feeds have not sent yet
                thoughts = [feed.rest_reasoning(o.message.get("reasoning_content")) for feed, o in zip(feeds, outs)]
                rest = [[feed.rest(o.message.get("content"))] for feed, o in zip(feeds, outs)]
                if any(feed.mismatched for feed in feeds):
                    self.metrics.inc("gateway.stream_mismatch")
            else:  # a backend that cannot stream: the whole text now, cut where tokens end
                thoughts = [o.message.get("reasoning_content") or "" for o in outs]
                rest = [self.renderer.text_pieces(o.completion.output_ids, o.message.get("content") or "")
                        for o in outs]
            for i, thought in enumerate(thoughts):
                if thought and reasoning is not None:
                    await reasoning(i, thought)
            await live.finish(resp, rest)
        return resp, outs

    @property
    def formats(self) -> parsers.Formats:
        """The policy's tool-call and reasoning formats: the config's knobs, or read from its template."""
        formats = getattr(self, "_formats", None)
        if formats is None:
            r = self.renderer
            formats = self._formats = parsers.choose(r.template, r.generation_prompt, self.cfg.tool_parser,
                                                     self.cfg.reasoning_parser, r.template_tools)
        return formats

    def _shaping(self, req: ChatRequest, tools: bool) -> Shaping:
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

    def _prompt(self, session: Session | None, messages: list[dict], tools: list[dict] | None, history: list,
                tools_key: str, forced: tuple[int, ...] = ()):
        """(base, env_ids, prompt): the prompt's token ids, refused with a 400 past the context. A
        session's turn that continues an earlier one (``base``) reuses the tokens that turn was served
        with and renders only what the environment added since (``env_ids``). ``forced``: a forced tool
        call's opening, given after the assistant header (env tokens of the turn)."""
        base = self.store.match(session, history, tools_key) if session is not None else None
        try:
            if base is not None:
                env_ids = [*self.renderer.continuation_ids(messages[base.depth:], tools, base.closed), *forced]
                prompt = np.concatenate([base.next_prompt(), np.asarray(env_ids, dtype=np.int32)])
            else:
                env_ids = None
                prompt = np.asarray([*self.renderer.prompt_ids(messages, tools), *forced], dtype=np.int32)
        except ChatError as exc:
            raise OpenAIError(400, str(exc), param=exc.param, code="invalid_messages") from None
        if prompt.size >= self.max_context:
            raise OpenAIError(400, f"This model's maximum context length is {self.max_context} tokens. However, "
                              f"your messages resulted in {prompt.size} tokens"
                              f"{' (the session so far included)' if base is not None else ''}. Please reduce "
                              f"the length of the messages.", param="messages", code="context_length_exceeded")
        return base, env_ids, prompt

    def _response(self, req: ChatRequest, rid: str, outs: list[ChoiceOut], prompt_tokens: int) -> dict:
        """The OpenAI chat.completion for the post-processed choices (logprobs without the eos token)."""
        choices = []
        for out in outs:
            choice = {"message": out.message, "finish_reason": out.finish_reason}
            if out.stop is not None:  # as vLLM names it: which stop string ended the choice
                choice["stop_reason"] = out.stop
            if req.logprobs:
                ids, lps = out.completion.output_ids, out.completion.logprobs
                keep = ids.size - (1 if ids.size and int(ids[-1]) == self.renderer.eos_id else 0)
                choice["logprobs"] = token_logprobs(self.tok, ids[:keep], lps[:keep])
            choices.append(choice)
        completion_tokens = sum(int(o.completion.output_ids.size) for o in outs)
        return completion_response(rid, req.model, choices, prompt_tokens, completion_tokens)

    def _admit(self, n: int) -> None:
        """Count ``n`` choices as pending, or refuse them with a 429 past ``max_pending_requests`` (one
        request is always admitted when nothing is pending, however large its ``n``)."""
        if self.pending and self.pending + n > self.cfg.max_pending_requests:
            raise OpenAIError(429, f"The gateway has {self.pending} generations pending (max_pending_requests="
                              f"{self.cfg.max_pending_requests}); retry after {QUEUE_RETRY_AFTER_S} s.",
                              type="rate_limit_error", code="queue_full",
                              headers={"Retry-After": str(QUEUE_RETRY_AFTER_S)})
        self._add_pending(n)

    def _add_pending(self, k: int) -> None:
        self.pending += k
        self.metrics.gauges["http.pending"] = self.pending

    async def _generate(self, sid: str, prompt, params, n: int, shaping: Shaping,
                        tokens: asyncio.Queue | None = None) -> tuple[list[ChoiceOut], BaseException | None]:
        """The choices that came back, post-processed, and the first failure (None if all came back).
        ``tokens``: a queue that gets (choice, start, ids) as the backend reports tokens."""
        def kw(i: int) -> dict:
            return {} if tokens is None else {"on_tokens": lambda start, ids: tokens.put_nowait((i, start, ids))}

        if n == 1:  # the usual request: no gather, whose task per choice costs a loop iteration or two
            try:
                comps, failed = [await self.backend.generate(sid, prompt, params, **kw(0))], None
            except Exception as exc:
                comps, failed = [], exc
        else:
            results = await asyncio.gather(*(self.backend.generate(sid, prompt, params, **kw(i)) for i in range(n)),
                                           return_exceptions=True)
            comps = [r for r in results if not isinstance(r, BaseException)]
            failed = next((r for r in results if isinstance(r, BaseException)), None)
        return [self._postprocess(c, shaping) for c in comps], failed

    async def _generate_unrecorded(self, prompt, params, n: int, shaping: Shaping, tokens) -> tuple[list, list]:
        """An admin call's streamed generation (nothing recorded): (outs, []) or its failure."""
        try:
            outs, failed = await self._generate("", prompt, params, n, shaping, tokens)
        finally:
            self._add_pending(-n)
        if failed is not None:
            raise failed
        return outs, []

    async def _generate_and_record(self, session, base, prompt, env_ids, history, tools_key, n, params,
                                   shaping: Shaping, result: asyncio.Future, first: int | None = None,
                                   tokens: asyncio.Queue | None = None) -> None:
        """Generate a session's turn and record it (at the reserved indices from ``first``, if any); the
        outcome (outs, indices) or the failure goes to ``result`` unless the client left (then it is
        dropped: the record is what mattered)."""
        try:
            outs, failed = await self._generate(session.id, prompt, params, n, shaping, tokens)
            indices = []
            if outs:
                choices = [Choice(o.completion, o.message, _closed(o.completion, self.renderer.eos_id),
                                  (*history, canonical(o.message)), params.temperature) for o in outs]
                indices = self.store.record(session, base, prompt, env_ids, tools_key, choices, first)
            if failed is not None:
                raise failed
            if not result.done():
                result.set_result((outs, indices))
        except Exception as exc:  # handed to the handler, which answers with it
            if not result.done():
                result.set_exception(exc)
        except BaseException:  # cancelled (the loop is closing): the handler must not wait forever
            result.cancel()
            raise
        finally:
            self._add_pending(-n)
            self.store.finish(session)
            jobs = self.jobs.get(session.id)
            if jobs is not None:
                jobs.discard(asyncio.current_task())

    def _postprocess(self, comp, shaping: Shaping) -> ChoiceOut:
        ids, forced, r = comp.output_ids, shaping.forced, self.renderer
        keep, text, stopped, matched = r.stop_cut(ids, shaping.stops, forced)
        if shaping.single_call and shaping.tools is not None:
            cut = self._first_call_cut(ids[:keep], text, shaping)
            if cut is not None:
                keep, text, stopped, matched = cut, r.decode([*forced, *ids[:cut]]), False, None
        if keep < ids.size:
            comp = dataclasses.replace(comp, output_ids=ids[:keep], logprobs=comp.logprobs[:keep],
                                       versions=comp.versions[:keep], finish_reason="stop")
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


def _closed(comp, eos_id: int) -> bool:
    return comp.output_ids.size > 0 and int(comp.output_ids[-1]) == eos_id
