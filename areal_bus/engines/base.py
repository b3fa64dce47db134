"""The engine interfaces the rollout and trainer nodes drive. The simulated engines (``sim``) and the
real ones (torch, vLLM) implement the same methods, so the nodes, the scheduler and the staleness rules
run the same code paths whichever engine is selected in the topology."""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from areal_bus.constants import STREAM_EVERY_S
from areal_bus.wire.messages import Completion, GenerateRequest, PartialCompletion


class RolloutEngine(Protocol):
    version: int
    """Policy version of the weights generating right now; every token is tagged with it."""

    @property
    def free_slots(self) -> int:
        """How many more requests may join the running batch (continuous batching)."""

    @property
    def running_ids(self) -> list[str]:
        """Request ids in the running batch."""

    def add_request(self, req: GenerateRequest) -> None:
        """Join the running batch at the next step. ValueError, naming what, for a request this engine
        cannot run as asked (a prompt past its cache; an option it cannot honour, such as a grammar on the
        simulated engine): the rollout node answers it as the request's Completion.error, never running
        it without the option."""

    def step(self) -> list[Completion]:
        """One decode step for every running sequence; returns those that finished."""

    def peek(self, request_id: str) -> list[int]:
        """Optional (an engine without it streams nothing until a request ends): the output ids a
        running request has so far, for live streaming through the gateway."""

    def peek_top(self, request_id: str, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Optional, with ``peek``: the top_ids and top_logprobs (Completion's) of the running request's
        output tokens from ``start`` on; [0, 0] arrays when it asked for none."""

    def swap_weights(self, version: int, location: str) -> float:
        """Switch to ``version`` between two steps (the safe point). Returns seconds the swap took.
        Sequences keep running; their later tokens carry the new version."""


class TokenStreams:
    """Which running requests' new tokens are due to be reported (live streaming, through an engine's
    ``peek``): a request's first tokens at once, then at most every STREAM_EVERY_S. The rollout node
    sends them to a gateway; the gateway's in-process backend hands them to a callback.

        streams.add(rid, dest)                          # dest: where its tokens go (the caller's)
        for rid, dest, start, ids in streams.due(engine.peek):
            ...deliver...; streams.mark(rid, start + len(ids))   # unmarked (not delivered): due again
        streams.discard(rid)                            # finished
    """

    def __init__(self):
        self._state: dict[str, list] = {}  # request id -> [dest, tokens delivered, when last delivered]

    def __bool__(self) -> bool:
        return bool(self._state)

    def add(self, request_id: str, dest=None) -> None:
        self._state[request_id] = [dest, 0, 0.0]

    def discard(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def clear(self) -> None:
        self._state.clear()

    def due(self, peek) -> list[tuple[str, object, int, np.ndarray]]:
        now = time.monotonic()
        out = []
        for rid, (dest, sent, last) in self._state.items():
            if sent and now - last < STREAM_EVERY_S:
                continue
            ids = peek(rid)
            if len(ids) > sent:
                out.append((rid, dest, sent, np.asarray(ids[sent:], dtype=np.int32)))
        return out

    def mark(self, request_id: str, delivered: int) -> None:
        st = self._state.get(request_id)
        if st is not None:
            st[1], st[2] = delivered, time.monotonic()


def partial_completion(engine, request_id: str, start: int, ids: np.ndarray) -> PartialCompletion:
    """The PartialCompletion of a running request's output tokens ``ids`` (from ``TokenStreams.due``),
    with their top logprobs when the request asked for them and the engine keeps them (``peek_top``)."""
    peek_top = getattr(engine, "peek_top", None)
    if peek_top is None:
        return PartialCompletion(request_id=request_id, start=start, output_ids=ids)
    top_ids, top_logprobs = peek_top(request_id, start)
    if top_ids.size:
        top_ids, top_logprobs = top_ids[:ids.size], top_logprobs[:ids.size]
    return PartialCompletion(request_id=request_id, start=start, output_ids=ids, top_ids=top_ids,
                             top_logprobs=top_logprobs)
