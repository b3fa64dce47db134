"""The gateway's generations from rollout workers over the bus.

Each rollout worker connects a DEALER named by its node id to the gateway's ROUTER (channel ``gwork``),
so the gateway can address a worker: requests of one session go to the same worker while it lives
(sticky, so its prefix cache stays useful), new sessions go to the least loaded live worker. Workers
are known from their heartbeats on the hub. A request whose worker dies (or that no worker answers
within a deadline) is sent to another worker under the same id; a late duplicate answer is dropped.
A worker restarted under its name (a new incarnation, seen before the old one's heartbeats were missed
for long enough to call it dead) lost what it held just the same: its requests are sent again at once.
A worker that is leaving (scaled away) says so first, with the requests it will still finish: it gets
no new work, and what it will not finish goes to another worker at once (the rest when it is gone).
A streamed request (``on_tokens``) gets the worker's PartialCompletions as they come; one whose worker
dies after some of its tokens went out fails instead (another worker would sample other tokens, and
what the client saw cannot be taken back).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import uuid
from collections.abc import Iterable, Mapping

import numpy as np
import zmq
import zmq.asyncio

from areal_bus.wire import messages as m
from areal_bus.wire.codec import DecodeError, Encoder, decode
from areal_bus.runtime.node import LEAVING
from areal_bus.wire.security import secure
from nodes.gateway.backend import SamplingParams

REQUEST_DEADLINE_S = 120.0
"""A request unanswered this long is sent to another worker. Generation of a few thousand tokens
takes seconds on a GPU; two minutes only fires for a worker that is stuck without being dead."""

NO_WORKER_WAIT_S = 30.0
"""How long a request waits for any rollout worker to be alive before the client gets an error."""

UNREACHABLE_RETRY_S = 0.05
"""How soon a request is tried again when every live worker refused it as not connected: a worker is
known from its heartbeat before its DEALER has (re)connected to us (the gateway just started, the
worker just joined), and ZeroMQ reconnects every 100 ms. Tried for up to NO_WORKER_WAIT_S."""


class NoWorker(RuntimeError):
    """No rollout worker is alive: the client gets a 503 with this message."""


class Unreachable(NoWorker):
    """Workers are alive but none has its DEALER connected to us (yet): worth trying again shortly."""


class StreamBroken(RuntimeError):
    """A streamed request lost its worker after part of it had been streamed."""


class _Pending:
    __slots__ = ("fut", "worker", "frames", "on_tokens", "streamed")

    def __init__(self, fut, worker, frames, on_tokens):
        self.fut, self.worker, self.frames, self.on_tokens = fut, worker, frames, on_tokens
        self.streamed = False


class BusBackend:
    streams_tokens = True
    """generate takes ``on_tokens`` (the gateway streams live text through it)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, encoder: Encoder, metrics):
        self.actx = zmq.asyncio.Context.shadow(ctx)
        self.sock = self.actx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown worker raises instead of dropping
        self.sock.linger = 0
        secure(ctx, self.sock, bind=True)  # CURVE server when the run uses it (the shadow has no keys)
        self.sock.bind(endpoint)
        self.encoder = encoder
        self.metrics = metrics
        self.live: set[str] = set()
        self.incarnations: dict[str, str] = {}  # worker -> the incarnation its requests went to
        self.leaving: set[str] = set()  # live, finishing what they hold, taking nothing new
        self.load: collections.Counter[str] = collections.Counter()
        self.sticky: dict[str, str] = {}
        self.pending: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._task: asyncio.Task | None = None

    # -- workers -----------------------------------------------------------------------------------
    def set_live(self, workers: Mapping[str, str] | Iterable[str]) -> None:
        """The live rollout workers, from the hub: worker name -> incarnation (a bare set of names cannot
        show a restart). Requests held by a worker that left, or that restarted under its name, are
        resent: the new process never heard of them."""
        incarnations = dict(workers) if isinstance(workers, Mapping) else {}
        names = set(workers)
        restarted = {w for w, inc in incarnations.items()
                     if w in self.live and self.incarnations.get(w, inc) != inc}
        gone = (self.live - names) | restarted
        self.live = names
        self.incarnations = incarnations
        # One gone from the hub is done leaving; a new one of that name (or a new incarnation) starts afresh.
        self.leaving &= self.live - restarted
        if restarted:
            self.metrics.inc("gateway.workers_restarted", len(restarted))
        self._move_from(gone)

    def on_leaving(self, worker: str, held: set[str]) -> None:
        """``worker`` takes no new work and answers only ``held``: the rest of its requests move now."""
        self.leaving.add(worker)
        self._move_from({worker}, keep=held)

    def _move_from(self, workers: set[str], keep: set[str] = frozenset()) -> None:
        """Resend the requests held by ``workers`` (but those in ``keep``) to other workers."""
        if not workers:
            return
        for session, worker in list(self.sticky.items()):
            if worker in workers:
                del self.sticky[session]
        for rid, p in list(self.pending.items()):
            if p.worker in workers and rid not in keep and not p.fut.done():
                self.metrics.inc("gateway.moved")
                self._place(rid, p.fut, p.frames, None, p.on_tokens)

    def _place(self, rid: str, fut: asyncio.Future, frames: list, session: str | None, on_tokens=None,
               give_up_at: float | None = None) -> None:
        """Send, or, while live workers are not connected yet, try again every UNREACHABLE_RETRY_S
        until ``give_up_at``; the client's error only when no worker is alive (or a stream broke)."""
        if fut.done():
            return
        loop = fut.get_loop()
        give_up_at = loop.time() + NO_WORKER_WAIT_S if give_up_at is None else give_up_at
        try:
            self._send(rid, fut, frames, session, on_tokens)
        except Unreachable as err:
            if loop.time() >= give_up_at:
                fut.set_exception(err)
                return
            self.metrics.inc("gateway.unreachable_retries")
            loop.call_later(UNREACHABLE_RETRY_S, self._place, rid, fut, frames, session, on_tokens, give_up_at)
        except (NoWorker, StreamBroken) as err:  # the last worker went: this client gets a 503 now
            fut.set_exception(err)

    @property
    def candidates(self) -> list[str]:
        """Workers that may take a new request: live and not leaving."""
        return sorted(self.live - self.leaving)

    def _pick(self, session: str | None, options: list[str]) -> str:
        if session and self.sticky.get(session) in options:
            return self.sticky[session]
        worker = min(options, key=lambda w: self.load[w])
        if session:
            self.sticky[session] = worker
        return worker

    def _send(self, rid: str, fut: asyncio.Future, frames: list, session: str | None, on_tokens=None) -> None:
        old = self.pending.get(rid)
        if old is not None and old.streamed:
            raise StreamBroken("the rollout worker streaming this completion is gone; what was streamed cannot "
                               "be continued by another worker: retry the request")
        options = self.candidates
        if not options:
            raise NoWorker("no rollout worker is alive")
        while options:
            worker = self._pick(session, options)
            # zmq.asyncio does not raise a failed send: a NOBLOCK send is tried at once and its error
            # (EHOSTUNREACH from ROUTER_MANDATORY: the worker's DEALER is not connected) is set on the
            # returned future, already done. Unchecked, the request would wait out REQUEST_DEADLINE_S.
            sent = self.sock.send_multipart([worker.encode(), *frames], flags=zmq.NOBLOCK, copy=False)
            if sent.done() and sent.exception() is not None:  # not connected (yet, or any more): try the next
                options = [w for w in options if w != worker]
                if session and self.sticky.get(session) == worker:
                    del self.sticky[session]
                continue
            if old is not None:
                self.load[old.worker] -= 1
            self.pending[rid] = _Pending(fut, worker, frames, on_tokens)
            self.load[worker] += 1
            return
        raise Unreachable("no rollout worker is reachable")

    def start(self) -> None:
        """Read gwork from now on, not from the first request: a frame that arrives earlier (a stray
        reply, junk) is taken and counted instead of waiting unseen in the socket."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._recv_loop())

    # -- the Backend protocol ----------------------------------------------------------------------
    async def generate(self, session_id: str, prompt_ids: np.ndarray, params: SamplingParams,
                       on_tokens=None) -> m.Completion:
        """The whole completion; ``on_tokens(start, ids)`` (if given) is called with each run of tokens
        the worker reports while it generates (``start``: their index in the output)."""
        self.start()
        waited = 0.0
        while not self.candidates:
            if waited >= NO_WORKER_WAIT_S:
                raise NoWorker(f"no rollout worker alive after {NO_WORKER_WAIT_S:.0f} s")
            await asyncio.sleep(0.1)
            waited += 0.1
        rid = f"gw-{self._prefix}-{next(self._ids)}"
        req = params.request(rid, session_id or rid, prompt_ids, on_tokens is not None)
        frames = self.encoder.encode(req)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._place(rid, fut, frames, session_id or None, on_tokens)

        def overdue():  # one timer per request (cheaper than wait_for): resend to another worker
            nonlocal timer
            if not fut.done():
                self.metrics.inc("gateway.resent")
                self._place(rid, fut, frames, None, on_tokens)
                timer = loop.call_later(REQUEST_DEADLINE_S, overdue)

        timer = loop.call_later(REQUEST_DEADLINE_S, overdue)
        try:
            return await fut
        finally:
            timer.cancel()
            entry = self.pending.pop(rid, None)
            if entry is not None:
                self.load[entry.worker] -= 1

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                _, comp = decode(frames[1:])
            except DecodeError as err:
                self.metrics.inc(f"dropped.{err.reason}")
                continue
            if isinstance(comp, m.Event) and comp.name == LEAVING:
                held = comp.fields.get("held")
                if not isinstance(held, list):  # not a notice we understand: nothing is kept back
                    self.metrics.inc("dropped.bad_leaving_notice")
                    held = []
                # Named by its DEALER identity (what we address it by), not by what the message says.
                self.on_leaving(frames[0].bytes.decode(errors="replace"), {str(rid) for rid in held})
                continue
            entry = self.pending.get(getattr(comp, "request_id", ""))
            if isinstance(comp, m.PartialCompletion) and entry is not None and entry.on_tokens is not None:
                # Only from the worker the request is with now (not a late one it was taken from).
                if not entry.fut.done() and comp.output_ids.size and frames[0].bytes == entry.worker.encode():
                    entry.streamed = True
                    try:
                        entry.on_tokens(comp.start, comp.output_ids)
                    except Exception as exc:  # deliberately tolerated: one stream's consumer must not end this loop
                        self.metrics.inc("gateway.stream_callback_failed")
                        entry.fut.set_exception(exc)
                continue
            if not isinstance(comp, m.Completion) or entry is None or entry.fut.done():
                self.metrics.inc("gateway.unexpected_replies")
                continue
            if comp.error:  # the worker refused it: the client's request, answered as a 400
                entry.fut.set_exception(ValueError(comp.error))
            else:
                entry.fut.set_result(comp)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.sock.close(0)
