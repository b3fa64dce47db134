"""The gateway's policy chat path: ``PolicyChat``, the service that serves one chat request with the
policy being trained, from its messages to the response the API returns.

``PolicyChat.complete`` reads top to bottom as its steps:

1. the turn (``_turn``): the prompt's token ids (a session's turn continues the tokens its matching
   earlier turn was served with, so the trainer sees exactly what was sampled), refused with a 400 past
   the context, and the sampling parameters;
2. admission (``Pending.admit``): a 429 with Retry-After past ``max_pending_requests``;
3. generation and record (``_launch``): the ``n`` choices handed to the backend; a session's turn is
   generated and recorded (``sessions.SessionStore``) in a task of its own, which a disconnect does not
   cancel;
4. the live stream, when asked (``_relay``): text sent through a ``live.LiveStream`` (or the Responses
   one) as the backend reports tokens;
5. the outcome (``_outcome``): the post-processed choices (``shaping.Shaper.postprocess``: stop strings,
   the first call only, reasoning, tool calls), or the backend's failure as a 400 or 503;
6. the response (``_response``), logged (``_log_request``) and, on a stream, finished (``_finish_live``).

The OpenAI route (``openai_routes``), the Anthropic one (``anthropic_routes``) and the Responses one
(``responses_routes``) all end here. ``Pending`` (choices pending in the backend) and ``ResponseIds``
(ids of unrecorded responses) are shared with the completions route (``completions_routes``).

    chat = PolicyChat(cfg, backend, renderer, store, jobs=jobs, pending=Pending(cfg.max_pending_requests,
                      metrics), ids=ResponseIds(), max_context=1024, metrics=metrics, log=log)
    resp, outs = await chat.complete(parse_chat_request(body), who, time.monotonic())
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from areal_bus.config.node_configs import GatewayConfig
from nodes.gateway import structured
from nodes.gateway.backend import Backend, SamplingParams
from nodes.gateway.chat import ChatError, ChatRenderer, canonical
from nodes.gateway.feed import ReplyFeed
from nodes.gateway.live import LiveStream
from nodes.gateway.openai_api import ChatRequest, OpenAIError, completion_response, token_logprobs
from nodes.gateway.sessions import Choice, Session, SessionStore
from nodes.gateway.shaping import ChoiceOut, Shaper, Shaping

QUEUE_RETRY_AFTER_S = 1
"""Retry-After for a request refused because ``max_pending_requests`` generations are pending: about
the time a batch of short completions takes to drain, so a retried request usually finds room."""


class Pending:
    """Choices handed to the backend and not yet back (the chat and completions paths share one), shown
    as the ``http.pending`` gauge; past ``limit`` a request is refused rather than queued."""

    def __init__(self, limit: int, metrics):
        self.limit = limit
        self.metrics = metrics
        self.count = 0

    def admit(self, n: int) -> None:
        """Count ``n`` choices as pending, or refuse them with a 429 past the limit (one request is always
        admitted when nothing is pending, however large its ``n``)."""
        if self.count and self.count + n > self.limit:
            raise OpenAIError(429, f"The gateway has {self.count} generations pending (max_pending_requests="
                              f"{self.limit}); retry after {QUEUE_RETRY_AFTER_S} s.",
                              type="rate_limit_error", code="queue_full",
                              headers={"Retry-After": str(QUEUE_RETRY_AFTER_S)})
        self.add(n)

    def add(self, k: int) -> None:
        self.count += k
        self.metrics.gauges["http.pending"] = self.count


class ResponseIds:
    """Response ids of unrecorded requests (the admin's): unique, not secret, so a counter (no urandom
    per request)."""

    def __init__(self):
        self._prefix, self._count = secrets.token_hex(6), itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._count)}"


@dataclass(slots=True)
class Turn:
    """One chat request made ready for the backend: what to generate and what to record it under."""
    req: ChatRequest
    session: Session | None  # None: the admin's call, served and not recorded
    history: list  # the conversation, canonical (sessions match later turns against it)
    tools_key: str  # the tools offered, as JSON ("" for none): a branch continues only under the same tools
    shaping: Shaping
    base: object  # the session's branch this turn continues (sessions.Branch), or None
    env_ids: list | None  # the tokens the environment added since ``base`` (None: a fresh prompt)
    prompt: np.ndarray
    params: SamplingParams
    n: int


@dataclass(slots=True)
class Launched:
    """A turn handed to the backend: where its outcome comes from, and what a live stream needs."""
    result: asyncio.Future | None  # (outs, indices); None: generated later, in the handler (_outcome)
    rid: str | None  # None: named once recorded (a session's whole reply)
    feeds: list[ReplyFeed] | None  # per choice, when the backend streams tokens to a live reply
    tokens: asyncio.Queue | None  # (choice, start, ids) from the backend, then None when the turn is done


class PolicyChat:
    """Serving chat requests with the policy: prompt, admission, generation and record, the response."""

    def __init__(self, cfg: GatewayConfig, backend: Backend, renderer: ChatRenderer, store: SessionStore, *,
                 jobs: dict[str, set[asyncio.Task]], pending: Pending, ids: ResponseIds, max_context: int,
                 metrics, log):
        self.cfg = cfg  # default_max_tokens, and the shaper's tool_parser and reasoning_parser
        self.backend = backend
        self.renderer = renderer
        self.shaper = Shaper(renderer, cfg.tool_parser, cfg.reasoning_parser)
        tok = renderer.tok  # its special tokens, which no grammar can match (structured.compose)
        self.special = frozenset(tok.convert_ids_to_tokens(list(getattr(tok, "all_special_ids", ()))))
        self.store = store
        self.jobs = jobs  # per session, its turns in flight (ending a session waits for them: lifecycle)
        self.pending = pending
        self.ids = ids
        self.max_context = max_context
        self.metrics = metrics
        self.log = log

    async def complete(self, req: ChatRequest, who, t0: float, live: LiveStream | None = None,
                       request: web.Request | None = None):
        """Serve a policy request: (response dict, choices). With ``live`` the reply is streamed to
        ``request`` while it is generated, and finished here ((None, []) if it ended in an error)."""
        turn = self._turn(req, who, await self._grammar(req))
        self.pending.admit(turn.n)
        run = self._launch(turn, live)
        if live is not None:
            await live.open(request, run.rid, int(turn.prompt.size), turn.n)  # the client left: writes are no-ops
        reasoning = getattr(live, "reasoning", None)  # a live stream that shows reasoning as it comes
        if run.tokens is not None:
            await self._relay(run, live, reasoning)
        try:
            outs, indices = await self._outcome(turn, run)
        except Exception as exc:
            err = _backend_error(exc)
            if live is None:
                raise err from None
            await live.fail(err)
            return None, []
        resp = self._response(req, run.rid or f"chatcmpl-{turn.session.id}-{indices[0]}", outs, int(turn.prompt.size))
        self._log_request(turn, resp, t0, live is not None)
        if live is not None:
            await self._finish_live(live, reasoning, resp, outs, run.feeds)
        return resp, outs

    # -- the steps of complete, in order -----------------------------------------------------------

    def _turn(self, req: ChatRequest, who, grammar: str = "") -> Turn:
        """The request as a turn: its prompt (a 400 past the context) and sampling parameters (``grammar``:
        what its replies must follow, from ``_grammar``)."""
        session = who if isinstance(who, Session) else None
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        offered = req.tools and req.tool_choice != "none"  # tool_choice "none": no tools offered, none parsed
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if offered else None
        history = [canonical(m) for m in messages]
        tools_key = json.dumps(tools, sort_keys=True) if tools else ""
        shaping = self.shaper.shaping(req, bool(tools))
        base, env_ids, prompt = self._prompt(session, messages, tools, history, tools_key, shaping.forced)
        room = self.max_context - int(prompt.size)
        wanted = req.max_completion_tokens or req.max_tokens or self.cfg.default_max_tokens or room
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        params = SamplingParams(max_tokens=min(wanted, room), temperature=temperature,
                                top_p=1.0 if req.top_p is None else float(req.top_p),
                                stop_token_ids=tuple(self.renderer.stop_token_ids(req.stops)),
                                ticket=session.ticket if session is not None else 0,
                                grammar=grammar,
                                top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
                                seed=req.seed, top_k=max(req.top_k or 0, 0))
        return Turn(req, session, history, tools_key, shaping, base, env_ids, prompt, params, req.n or 1)

    async def _grammar(self, req: ChatRequest) -> str:
        """The grammar the request's replies follow (structured.grammar; "" for none), or a 400 naming the
        field whose schema xgrammar cannot build, or that asks for what this model's format cannot follow."""
        try:
            return await structured.grammar(req.wanted, self.shaper.formats, self.special)
        except structured.SchemaError as err:
            raise OpenAIError(400, str(err), param=err.param, code="invalid_schema") from None

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

    def _launch(self, turn: Turn, live: LiveStream | None) -> Launched:
        """Hand the turn to the backend. A session's turn is generated and recorded in a task of its own,
        which hands its outcome to a future of ours: a disconnect cancels this handler and that future,
        never the recording. An admin's streamed call runs in a task too (the handler writes while it
        generates); an admin's whole reply is generated later, in the handler."""
        loop = asyncio.get_running_loop()
        feeds = tokens = None
        if live is not None and getattr(self.backend, "streams_tokens", False):
            s = turn.shaping
            feeds = [ReplyFeed(self.renderer.decode, s.stops, s.tools, s.think, s.forced) for _ in range(turn.n)]
            tokens = asyncio.Queue()
        session, result, first = turn.session, None, None
        if session is not None:
            self.store.begin(session)
            if live is not None:  # the stream names its response id before the turn is recorded
                first = self.store.reserve(session, turn.n)
            result = loop.create_future()
            job = loop.create_task(self._generate_and_record(turn, result, first, tokens))
            self.jobs.setdefault(session.id, set()).add(job)
        elif live is not None:  # nothing to record, but the handler writes while it generates
            result = loop.create_task(self._generate_unrecorded(turn, tokens))
        rid = (f"chatcmpl-{self.ids.next()}" if session is None
               else f"chatcmpl-{session.id}-{first}" if first is not None else None)
        return Launched(result, rid, feeds, tokens)

    async def _relay(self, run: Launched, live, reasoning) -> None:
        """Stream each choice's text (and reasoning, where the stream shows it) as the backend reports its
        tokens, until the generation is done."""
        tokens, feeds = run.tokens, run.feeds
        run.result.add_done_callback(lambda _: tokens.put_nowait(None))
        while (item := await tokens.get()) is not None:
            i, start, ids = item
            thought, delta = feeds[i].feed(start, ids)
            if thought and reasoning is not None:
                await reasoning(i, thought)
            if delta:
                await live.text(i, delta)

    def _outcome(self, turn: Turn, run: Launched) -> Awaitable[tuple[list[ChoiceOut], list[int]]]:
        """What to await for (the post-processed choices, their recorded indices: none for the admin), or
        the backend's failure: the launched task's result, or an admin's whole reply generated right here
        (no task: a disconnect loses nothing, and no task's cost on the usual unrecorded call)."""
        return run.result if run.result is not None else self._generate_unrecorded(turn)

    def _response(self, req: ChatRequest, rid: str, outs: list[ChoiceOut], prompt_tokens: int) -> dict:
        """The OpenAI chat.completion for the post-processed choices (logprobs without the eos token)."""
        choices = []
        for out in outs:
            choice = {"message": out.message, "finish_reason": out.finish_reason}
            if out.stop is not None:  # as vLLM names it: which stop string ended the choice
                choice["stop_reason"] = out.stop
            if req.logprobs:
                c = out.completion
                ids = c.output_ids
                keep = ids.size - (1 if ids.size and int(ids[-1]) == self.renderer.eos_id else 0)
                choice["logprobs"] = token_logprobs(self.renderer.tok, ids[:keep], c.logprobs[:keep],
                                                    c.top_ids[:keep], c.top_logprobs[:keep])
            choices.append(choice)
        completion_tokens = sum(int(o.completion.output_ids.size) for o in outs)
        return completion_response(rid, req.model, choices, prompt_tokens, completion_tokens)

    def _log_request(self, turn: Turn, resp: dict, t0: float, stream: bool) -> None:
        self.metrics.observe_seconds("gateway.latency_seconds", time.monotonic() - t0)  # Prometheus' histogram
        # Rendered once this handler has handed its response to the transport (call_soon runs after the
        # current step; lines keep their order): the line costs the loop, not this request's latency.
        asyncio.get_running_loop().call_soon(functools.partial(
            self.log.info, "request", route="chat", model=turn.req.model, routed_to="policy",
            session=turn.session.id if turn.session is not None else "-", prompt_tokens=int(turn.prompt.size),
            completion_tokens=resp["usage"]["completion_tokens"], n=turn.n, stream=stream,
            ms=round((time.monotonic() - t0) * 1000)))

    async def _finish_live(self, live, reasoning, resp: dict, outs: list[ChoiceOut],
                           feeds: list[ReplyFeed] | None) -> None:
        """Send what the stream has not sent yet, then its closing events."""
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

    # -- generation ------------------------------------------------------------------------------

    async def _generate(self, sid: str, turn: Turn,
                        tokens: asyncio.Queue | None = None) -> tuple[list[ChoiceOut], BaseException | None]:
        """The choices that came back, post-processed, and the first failure (None if all came back).
        ``tokens``: a queue that gets (choice, start, ids) as the backend reports tokens."""
        prompt, params, n = turn.prompt, turn.params, turn.n

        def kw(i: int) -> dict:
            return {} if tokens is None else {"on_tokens": lambda start, ids: tokens.put_nowait((i, start, ids))}

        if n == 1:  # the usual request: no gather, whose task per choice costs a loop iteration or two
            try:
                comps, failed = [await self.backend.generate(sid, prompt, params, **kw(0))], None
            except Exception as exc:
                comps, failed = [], exc
        else:
            results = await asyncio.gather(*(self.backend.generate(sid, prompt, params.for_choice(i), **kw(i))
                                             for i in range(n)), return_exceptions=True)
            comps = [r for r in results if not isinstance(r, BaseException)]
            failed = next((r for r in results if isinstance(r, BaseException)), None)
        return [self.shaper.postprocess(c, turn.shaping) for c in comps], failed

    async def _generate_unrecorded(self, turn: Turn, tokens: asyncio.Queue | None = None) -> tuple[list, list]:
        """An admin call's generation (nothing recorded): (outs, []) or its failure."""
        try:
            outs, failed = await self._generate("", turn, tokens)
        finally:
            self.pending.add(-turn.n)
        if failed is not None:
            raise failed
        return outs, []

    async def _generate_and_record(self, turn: Turn, result: asyncio.Future, first: int | None = None,
                                   tokens: asyncio.Queue | None = None) -> None:
        """Generate a session's turn and record it (at the reserved indices from ``first``, if any); the
        outcome (outs, indices) or the failure goes to ``result`` unless the client left (then it is
        dropped: the record is what mattered)."""
        session = turn.session
        try:
            outs, failed = await self._generate(session.id, turn, tokens)
            indices = []
            if outs:
                choices = [Choice(o.completion, o.message, _closed(o.completion, self.renderer.eos_id),
                                  (*turn.history, canonical(o.message)), turn.params.temperature) for o in outs]
                indices = self.store.record(session, turn.base, turn.prompt, turn.env_ids, turn.tools_key, choices,
                                            first)
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
            self.pending.add(-turn.n)
            self.store.finish(session)
            jobs = self.jobs.get(session.id)
            if jobs is not None:
                jobs.discard(asyncio.current_task())


def _backend_error(exc: Exception) -> OpenAIError:
    """A generation's failure as the client sees it: the engine refused the request (a ValueError: 400),
    or the backend failed (no rollout worker, engine error: a 503, not the client's doing)."""
    if isinstance(exc, ValueError):
        return OpenAIError(400, f"The engine refused the request: {exc}", code="invalid_request")
    return OpenAIError(503, f"The policy backend could not generate: {exc}", type="server_error",
                       code="backend_unavailable")


def _closed(comp, eos_id: int) -> bool:
    return comp.output_ids.size > 0 and int(comp.output_ids[-1]) == eos_id
