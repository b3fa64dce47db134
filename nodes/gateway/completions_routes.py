"""The gateway's legacy completions route (eval harnesses, token-in/token-out RL clients):

    POST /v1/completions   completions_create   a prompt (text, texts, token ids, lists of token ids),
                                                no chat template: the ids given are the prompt, exactly

``prompt`` as a string or list of strings is tokenised as the engine's own completions endpoint does
(the tokenizer's special tokens added); as token ids it is used as sent, never decoded and re-encoded.
Each prompt gets ``n`` choices (OpenAI's order: prompt 0's choices first). ``max_tokens`` (16 if unset,
as OpenAI's), ``temperature``, ``top_p``, ``stop`` (up to 4 strings: the text is cut before the
earliest, the ids run through the token that completed it), ``logprobs: k`` (the sampled tokens'
log-probabilities in the legacy format, with the k most likely alternatives of each and the sampled one,
k <= 20), ``seed`` (choice c of a prompt samples with seed + c), ``stream`` (+
``stream_options.include_usage``), ``user``. Refused with a 400 naming the field: ``echo: true``,
``suffix``, ``best_of`` > 1, non-zero penalties, ``logit_bias``, and any field it does not know.

Recording (a session key): each prompt's choices are one turn of the session, with the prompt ids
exactly as sent. A prompt whose ids begin with everything one of the session's completions branches
holds (its prompt, completions and the ids between) continues that branch: the ids after it are
recorded as environment tokens, so a token-in/token-out client's multi-turn episode is one trajectory.
Any other prompt starts a new segment of the session.

``CompletionsRoutes`` holds what it needs, passed by the Gateway: ``Keys``, the backend, the renderer
(its tokenizer), the session store, the turns in flight (``jobs``, which an ending session waits for),
the ``policy_chat.Pending`` count and ``ResponseIds`` it shares with the chat path, the context length,
the config, metrics and log; it adds its route with ``register`` (``app.make_app``, under "" and
"/gateway"). It does not go through PolicyChat: no chat template, no tool or reasoning parsing.
"""

from __future__ import annotations

import asyncio
import functools
import time

import numpy as np
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from areal_bus.config.node_configs import GatewayConfig
from areal_bus.wire.messages import MAX_TOP_LOGPROBS
from nodes.gateway.backend import MAX_SEED, Backend, SamplingParams
from nodes.gateway.chat import ChatRenderer
from nodes.gateway.keys import Keys
from nodes.gateway.live import TextFeed
from nodes.gateway.openai_api import MAX_N, MAX_STOPS, SSE_DONE, OpenAIError, finite, sse, usage, validation_error
from nodes.gateway.policy_chat import Pending, ResponseIds
from nodes.gateway.server import ADMIN, SSE_HEADERS, json_response, read_json
from nodes.gateway.sessions import Choice, Session, SessionStore
from nodes.gateway.shaping import cut_completion

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for a completions request that names no max_tokens (the chat API's is the rest of
the context): a harness that relies on it gets what it gets elsewhere."""

COMPLETIONS_BRANCH = "completions"
"""The ``tools_key`` of branches recorded by this route: chat turns (whose key is their tools' JSON)
never continue them, nor they a chat turn."""

MAX_PROMPTS = 64
"""Prompts one request may batch: each is n sequences in the engine's batch."""


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None
    stream: bool | None = None
    stream_options: dict | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    user: str | None = None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


_CANNOT = [
    ("echo", lambda r: r.echo, "echo: true is not served: the gateway returns only what the policy sampled "
     "(score a prompt's own tokens with the trainer's model)"),
    ("suffix", lambda r: r.suffix is not None, "suffix (fill-in-the-middle) is not served"),
    ("best_of", lambda r: (r.best_of or 1) > 1, "best_of > 1 is not served: ask for n choices and pick"),
    ("presence_penalty", lambda r: bool(r.presence_penalty), "penalties are not applied by the rollout engines"),
    ("frequency_penalty", lambda r: bool(r.frequency_penalty), "penalties are not applied by the rollout engines"),
    ("logit_bias", lambda r: bool(r.logit_bias), "logit_bias is not applied by the rollout engines"),
    ("stream_options", lambda r: bool(set(r.stream_options or {}) - {"include_usage"}),
     "stream_options takes include_usage only"),
]


def parse_completion_request(data) -> CompletionRequest:
    if not isinstance(data, dict):
        raise OpenAIError(400, f"The request body must be a JSON object, got {type(data).__name__}.",
                          code="invalid_body")
    unknown = [k for k in data if k not in CompletionRequest.model_fields]
    if unknown:
        raise OpenAIError(400, f"Unknown parameter: '{unknown[0]}'.", param=unknown[0], code="unknown_parameter")
    try:
        req = CompletionRequest.model_validate(data)
    except ValidationError as err:
        raise validation_error(err) from None
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOPS:
        raise OpenAIError(400, f"Invalid value for 'stop': at most {MAX_STOPS} stop sequences.", param="stop",
                          code="invalid_value")
    if isinstance(req.prompt, list) and not 0 < len(req.prompt) <= MAX_PROMPTS:
        raise OpenAIError(400, f"Invalid value for 'prompt': a non-empty list of token ids, or 1 to {MAX_PROMPTS} "
                          f"prompts.", param="prompt", code="invalid_value")
    for field, refused, why in _CANNOT:
        if refused(req):
            raise OpenAIError(400, f"'{field}' cannot be honoured: {why}.", param=field, code="unsupported_parameter")
    return req


def legacy_logprobs(decode, ids, lps, top_ids=None, top_lps=None) -> dict:
    """OpenAI's completions ``logprobs`` for the sampled tokens; with ``top_ids`` / ``top_lps`` ([tokens, k], k > 0),
    per token the k most likely alternatives and the sampled token, text -> log-probability (OpenAI's up
    to k + 1 entries), else ``top_logprobs`` null."""
    tokens = [decode([int(t)]) for t in ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top = None
    if top_ids is not None:
        top = []
        for i, text in enumerate(tokens):
            alts = {decode([int(t)]): finite(lp) for t, lp in zip(top_ids[i], top_lps[i])}
            alts.setdefault(text, finite(lps[i]))
            top.append(alts)
    return {"tokens": tokens, "token_logprobs": [finite(x) for x in lps], "top_logprobs": top,
            "text_offset": offsets}


class CompletionsRoutes:
    """POST /v1/completions."""

    def __init__(self, cfg: GatewayConfig, keys: Keys, backend: Backend, renderer: ChatRenderer,
                 store: SessionStore, *, jobs: dict[str, set[asyncio.Task]], pending: Pending, ids: ResponseIds,
                 max_context: int, metrics, log):
        self.cfg = cfg
        self.keys = keys
        self.backend = backend
        self.renderer = renderer
        self.tok = renderer.tok
        self.store = store
        self.jobs = jobs
        self.pending = pending
        self.ids = ids
        self.max_context = max_context
        self.metrics = metrics
        self.log = log

    def register(self, router: web.UrlDispatcher, prefix: str) -> None:
        router.add_post(f"{prefix}/v1/completions", self.completions_create)

    async def completions_create(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        who = self.keys.principal(request)
        data = await read_json(request, self.cfg)
        if who is not ADMIN and who.closing:
            who = self.keys.principal(request)
        req = parse_completion_request(data)
        if req.model != self.cfg.policy_model:
            raise OpenAIError(404, f"The model '{req.model}' does not exist for completions on this gateway; it "
                              f"serves '{self.cfg.policy_model}' (the policy being trained).", param="model",
                              code="model_not_found")
        session = who if isinstance(who, Session) else None
        prompts = self._completion_prompts(req)
        n = req.n or 1
        stops = req.stops
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        params = [SamplingParams(max_tokens=min(req.max_tokens or DEFAULT_MAX_TOKENS, self.max_context - p.size),
                                 temperature=temperature, top_p=1.0 if req.top_p is None else float(req.top_p),
                                 stop_token_ids=tuple(self.renderer.stop_token_ids(stops)),
                                 ticket=session.ticket if session is not None else 0,
                                 top_logprobs=req.logprobs or 0, seed=req.seed) for p in prompts]
        total = len(prompts) * n
        self.pending.admit(total)
        loop = asyncio.get_running_loop()
        tokens = asyncio.Queue() if req.stream and getattr(self.backend, "streams_tokens", False) else None
        first = None
        if session is not None:
            self.store.begin(session)
            first = self.store.reserve(session, total)
        job = loop.create_task(self._complete_all(session, prompts, params, n, stops, temperature, first, tokens))
        if session is not None:  # a disconnect cancels this handler, never the recording
            self.jobs.setdefault(session.id, set()).add(job)
        rid = f"cmpl-{session.id}-{first}" if session is not None else f"cmpl-{self.ids.next()}"
        created = int(time.time())
        if req.stream:
            return await self._stream_completion(request, req, rid, created, job, tokens, prompts, stops)
        outs = await asyncio.shield(job)
        resp = self._completion_response(req, rid, created, prompts, outs)
        self._log_completion(req, session, prompts, resp, t0)
        return json_response(resp)

    def _completion_prompts(self, req: CompletionRequest) -> list[np.ndarray]:
        p = req.prompt
        if isinstance(p, str):
            raw = [self.tok.encode(p)]
        elif p and isinstance(p[0], int):
            raw = [p]
        elif p and isinstance(p[0], str):
            raw = [self.tok.encode(s) for s in p]
        else:
            raw = p
        vocab = len(self.tok)
        out = []
        for i, ids in enumerate(raw):
            param = "prompt" if len(raw) == 1 else f"prompt[{i}]"
            if not ids:
                raise OpenAIError(400, f"Invalid value for '{param}': an empty prompt.", param=param, code="invalid_value")
            arr = np.asarray(ids, dtype=np.int64)
            if arr.min() < 0 or arr.max() >= vocab:
                raise OpenAIError(400, f"Invalid value for '{param}': token ids must be in [0, {vocab}) (the policy's "
                                  f"vocabulary); got {int(arr.min())}..{int(arr.max())}.", param=param,
                                  code="invalid_value")
            if arr.size >= self.max_context:
                raise OpenAIError(400, f"This model's maximum context length is {self.max_context} tokens. However, "
                                  f"your prompt resulted in {arr.size} tokens.", param=param,
                                  code="context_length_exceeded")
            out.append(arr.astype(np.int32))
        return out

    async def _complete_all(self, session, prompts, params, n, stops, temperature, first, tokens) -> list:
        """Every choice of every prompt, cut at string stops, recorded into ``session`` (one turn per
        prompt) before the reply. Runs as a task of its own: see completions_create."""
        try:
            def kw(k: int) -> dict:
                return {} if tokens is None else {"on_tokens": lambda s, ids: tokens.put_nowait((k, s, ids))}

            sid = session.id if session is not None else ""
            results = await asyncio.gather(*(
                self.backend.generate(sid, prompts[k // n], params[k // n].for_choice(k % n), **kw(k))
                for k in range(len(prompts) * n)), return_exceptions=True)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            outs = [None if isinstance(r, BaseException) else self._cut(r, stops) for r in results]
            if session is not None:
                for p, prompt in enumerate(prompts):
                    comps = outs[p * n:(p + 1) * n]
                    if any(c is None for c in comps):
                        continue
                    self._record_completions(session, prompt, comps, temperature, first + p * n)
            if isinstance(failed, ValueError):
                raise OpenAIError(400, f"The engine refused the request: {failed}", code="invalid_request")
            if failed is not None:
                raise OpenAIError(503, f"The policy backend could not generate: {failed}", type="server_error",
                                  code="backend_unavailable")
            return outs
        finally:
            self.pending.add(-len(prompts) * n)
            if tokens is not None:
                tokens.put_nowait(None)
            if session is not None:
                self.store.finish(session)
                jobs = self.jobs.get(session.id)
                if jobs is not None:
                    jobs.discard(asyncio.current_task())

    def _cut(self, comp, stops: list[str]):
        """(completion cut after the token that completed a stop string, its text, finish reason)."""
        ids = comp.output_ids
        if stops:
            keep, text, stopped = self.renderer.apply_stop(ids, stops)
            if keep < ids.size:
                comp = cut_completion(comp, keep)
        else:
            text, stopped = self.renderer.decode(ids), False
        return comp, text, "stop" if stopped else comp.finish_reason

    def _record_completions(self, session: Session, prompt: np.ndarray, comps: list, temperature: float,
                            first: int) -> None:
        base, best = None, -1
        for b in session.branches:  # the longest completions branch the prompt extends
            if b.tools_key != COMPLETIONS_BRANCH:
                continue
            ids = b.next_prompt()
            if best < ids.size <= prompt.size and np.array_equal(prompt[:ids.size], ids):
                base, best = b, ids.size
        env = prompt[best:] if base is not None else None
        before = base.history if base is not None else ()
        added = int(prompt.size - max(best, 0))
        choices = [Choice(c, {"role": "assistant", "content": text}, _ends_eos(c, self.renderer.eos_id),
                          (*before, ("completion", added, int(c.output_ids.size))), temperature)
                   for c, text, _ in comps]
        self.store.record(session, base, prompt, env, COMPLETIONS_BRANCH, choices, first)

    def _choice(self, req: CompletionRequest, index: int, out) -> dict:
        comp, text, finish = out
        lp = None
        if req.logprobs is not None:
            ids = comp.output_ids
            keep = ids.size - (1 if ids.size and int(ids[-1]) == self.renderer.eos_id else 0)
            top = (comp.top_ids[:keep], comp.top_logprobs[:keep]) if req.logprobs else (None, None)
            lp = legacy_logprobs(self.renderer.decode, ids[:keep], comp.logprobs[:keep], *top)
        return {"text": text, "index": index, "logprobs": lp, "finish_reason": finish}

    def _completion_response(self, req, rid: str, created: int, prompts, outs) -> dict:
        completion_tokens = sum(int(o[0].output_ids.size) for o in outs)
        return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                "choices": [self._choice(req, k, o) for k, o in enumerate(outs)],
                "usage": usage(sum(int(p.size) for p in prompts), completion_tokens),
                "system_fingerprint": None}

    async def _stream_completion(self, request, req, rid, created, job, tokens, prompts, stops):
        base = {"id": rid, "object": "text_completion", "created": created, "model": req.model}

        def chunk(k: int, text: str, finish=None, lp=None) -> bytes:
            return sse({**base, "choices": [{"text": text, "index": k, "logprobs": lp, "finish_reason": finish}]})

        stream = web.StreamResponse(headers=SSE_HEADERS)
        gone = False

        async def write(data: bytes, eof: bool = False) -> None:
            nonlocal gone
            if gone:
                return
            try:
                await stream.write(data)
                if eof:
                    await stream.write_eof()
            except (ConnectionError, RuntimeError):  # the client left: the turn is recorded all the same
                gone = True

        try:
            await stream.prepare(request)
        except (ConnectionError, RuntimeError):
            gone = True
        feeds = [TextFeed(self.renderer.decode, stops, False) for _ in range(len(prompts) * (req.n or 1))]
        if tokens is not None:
            while (item := await tokens.get()) is not None:
                k, start, ids = item
                delta = feeds[k].add(start, ids)
                if delta:
                    await write(chunk(k, delta))
        try:
            outs = await asyncio.shield(job)
        except OpenAIError as err:
            await write(sse(err.body()) + SSE_DONE, eof=True)
            return stream
        data = b""
        for k, out in enumerate(outs):
            choice = self._choice(req, k, out)
            rest = feeds[k].rest(choice["text"])
            if rest:
                data += chunk(k, rest)
            data += chunk(k, "", choice["finish_reason"], choice["logprobs"])
        if (req.stream_options or {}).get("include_usage"):
            data += sse({**base, "choices": [], "usage": usage(
                sum(int(p.size) for p in prompts), sum(int(o[0].output_ids.size) for o in outs))})
        await write(data + SSE_DONE, eof=True)
        return stream

    def _log_completion(self, req, session, prompts, resp, t0) -> None:
        self.metrics.observe_seconds("gateway.latency_seconds", time.monotonic() - t0)
        asyncio.get_running_loop().call_soon(functools.partial(
            self.log.info, "request", route="completions", model=req.model, routed_to="policy",
            session=session.id if session is not None else "-", prompt_tokens=int(sum(p.size for p in prompts)),
            completion_tokens=resp["usage"]["completion_tokens"], n=req.n or 1, stream=bool(req.stream),
            ms=round((time.monotonic() - t0) * 1000)))


def _ends_eos(comp, eos_id: int) -> bool:
    return comp.output_ids.size > 0 and int(comp.output_ids[-1]) == eos_id
