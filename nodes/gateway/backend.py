"""Where the gateway's generations come from: the ``Backend`` protocol and a local-engine backend.

The gateway turns each chat request into token ids and awaits ``backend.generate(...)``, which returns
the engine's ``Completion``: the exact ids it sampled, each with its log-probability and the policy
version that produced it. Two backends implement the protocol:

- ``LocalEngineBackend`` (here) drives a ``RolloutEngine`` (e.g. ``TorchRolloutEngine``) in a thread of
  its own, with continuous batching across concurrent HTTP requests: a request that arrives while
  others are decoding joins the running batch at the next engine step. Used by tests and by a
  single-process gateway.
- ``BusBackend`` (the lead's, in the gateway node's wiring) sends ``GenerateRequest``s to rollout
  workers over ZeroMQ and resolves the same futures from their replies.

    python -c "
    import asyncio, numpy as np; from areal_bus.engines.torch_engine import TorchRolloutEngine
    from nodes.gateway.backend import LocalEngineBackend, SamplingParams
    b = LocalEngineBackend(TorchRolloutEngine('models/tiny-guess', max_batch=4, max_len=256))
    print(asyncio.run(b.generate('', np.array([1, 40, 41], np.int32), SamplingParams(max_tokens=4)))); b.close()"
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from areal_bus.engines.base import TokenStreams
from areal_bus.wire.messages import Completion, GenerateRequest

MAX_SEED = 2**63 - 1
"""The largest seed GenerateRequest takes (a signed 64-bit generator seed)."""

ENGINE_IDLE_WAIT_S = 0.05
"""How long the engine thread blocks waiting for work when nothing is running. Short enough that
``close()`` returns promptly; a request arriving meanwhile wakes the thread at once (queue.get)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one completion (one choice of a chat request)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the completion (as well as the engine's eos). String stops that are not a
    single token are applied by the gateway after generation."""
    meta: dict = field(default_factory=dict)
    """Free-form request metadata for the backend (e.g. the GRPO group); engines may ignore it."""
    ticket: int = 0
    """The session's admission ticket (``sessions.Session.ticket``), sent as ``GenerateRequest.ticket``:
    the rollout worker logs ticket // trigger_batch_size as its step. 0 outside a session."""
    grammar: str = ""
    """xgrammar EBNF every output must follow (nodes/gateway/structured.py builds it); "" for none."""
    top_logprobs: int = 0
    """The k most likely alternatives to return per output token (Completion.top_ids / top_logprobs)."""
    seed: int | None = None
    """A generator of the request's own, seeded with this (None: the engine's shared one)."""
    top_k: int = 0
    """Sample among the k most likely tokens (0: off)."""

    def for_choice(self, i: int) -> "SamplingParams":
        """Choice ``i`` of a request: with a seed, seed + i, so n seeded choices differ (as vLLM's do) and
        the same request with the same seed gives the same n replies."""
        if self.seed is None or i == 0:
            return self
        return dataclasses.replace(self, seed=(self.seed + i) % (MAX_SEED + 1))

    def request(self, request_id: str, episode_id: str, prompt_ids: np.ndarray, stream: bool) -> GenerateRequest:
        """The wire request for one completion of ``prompt_ids`` with these parameters."""
        return GenerateRequest(
            request_id=request_id, episode_id=episode_id, ticket=self.ticket, min_version=0,
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32), stop=list(self.stop_token_ids), meta=dict(self.meta),
            stream=stream, grammar=self.grammar, top_logprobs=self.top_logprobs,
            seed=-1 if self.seed is None else self.seed, top_k=max(self.top_k, 0))


class Backend(Protocol):
    async def generate(self, session_id: str, prompt_ids: np.ndarray, params: SamplingParams) -> Completion:
        """Generate one completion of ``prompt_ids``. ``session_id`` is "" outside a session.

        Raises ValueError for a request the engine refuses (prompt too long, ...). A backend whose
        ``streams_tokens`` is true also takes ``on_tokens=fn``: ``fn(start, ids)`` is called on the
        event loop with each run of tokens sampled while the request runs (``start``: the index of
        ``ids[0]`` in the output), so the gateway can stream text as it is made."""


class LocalEngineBackend:
    """A ``RolloutEngine`` in a background thread, shared by every HTTP request of the gateway.

    The thread admits queued requests while the engine has free slots, runs ``engine.step()`` while
    anything is running, and resolves each request's asyncio future from the engine thread with
    ``loop.call_soon_threadsafe``. ``keep_history=True`` keeps every (prompt ids, Completion) pair the
    engine handled, for tests that check a trajectory against what the engine really saw.
    """

    def __init__(self, engine, *, keep_history: bool = False, name: str = "gateway-engine"):
        self.streams_tokens = hasattr(engine, "peek")
        self.engine = engine
        self.history: list[tuple[np.ndarray, Completion]] | None = [] if keep_history else None
        self._inbox: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def max_context_tokens(self) -> int | None:
        """Prompt + output tokens one sequence may hold (the engine's ``max_len``), if it says."""
        return getattr(self.engine, "max_len", None)

    async def generate(self, session_id: str, prompt_ids: np.ndarray, params: SamplingParams,
                       on_tokens=None) -> Completion:
        if self._stop.is_set():
            raise RuntimeError("backend is closed")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        rid = f"gw-{next(self._ids)}"
        req = params.request(rid, session_id or rid, prompt_ids, on_tokens is not None)
        self._inbox.put((req, loop, fut, on_tokens))
        return await fut

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    # -- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        waiting: deque = deque()  # requests taken from the inbox that found no free slot yet
        inflight: dict[str, tuple] = {}  # request id -> (request, loop, future, on_tokens)
        streamed = TokenStreams()  # requests with an on_tokens callback
        while not self._stop.is_set():
            block = not (waiting or inflight)
            try:
                while True:
                    waiting.append(self._inbox.get(timeout=ENGINE_IDLE_WAIT_S) if block else self._inbox.get_nowait())
                    block = False
            except queue.Empty:
                pass
            while waiting and self.engine.free_slots > 0:
                req, loop, fut, on_tokens = waiting.popleft()
                try:
                    self.engine.add_request(req)
                except (ValueError, RuntimeError) as exc:  # refused request: the caller's error, not ours
                    _resolve(loop, fut, exc=exc)
                    continue
                inflight[req.request_id] = (req, loop, fut, on_tokens)
                if on_tokens is not None:
                    streamed.add(req.request_id)
            if not inflight:
                continue
            try:
                done = self.engine.step()
            except Exception as exc:  # deliberately tolerated: fail what was running, keep serving
                for _, loop, fut, _ in inflight.values():
                    _resolve(loop, fut, exc=RuntimeError(f"engine step failed: {exc!r}"))
                inflight.clear()
                streamed.clear()
                continue
            for comp in done:
                req, loop, fut, _ = inflight.pop(comp.request_id)
                streamed.discard(comp.request_id)
                if self.history is not None:
                    self.history.append((req.prompt_ids, comp))
                _resolve(loop, fut, result=comp)
            for rid, _, start, ids in streamed.due(self.engine.peek) if streamed else ():
                _, loop, fut, on_tokens = inflight[rid]
                _call(loop, fut, on_tokens, start, ids)
                streamed.mark(rid, start + ids.size)
        for req, loop, fut, _ in [*waiting, *inflight.values()]:
            _resolve(loop, fut, exc=RuntimeError("backend closed"))


def _call(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, fn, *args) -> None:
    def call():
        if not fut.done():
            fn(*args)

    try:
        loop.call_soon_threadsafe(call)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result=None, exc=None) -> None:
    def settle():
        if fut.done():  # the awaiting task was cancelled (client gone): nothing to deliver
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass
