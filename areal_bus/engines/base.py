"""The engine interfaces the rollout and trainer nodes drive. The simulated engines (``sim``) and the
real ones (torch, vLLM) implement the same methods, so the nodes, the scheduler and the staleness rules
run the same code paths whichever engine is selected in the topology."""

from __future__ import annotations

from typing import Protocol

from areal_bus.messages import Completion, GenerateRequest, Trajectory


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
        """Join the running batch at the next step."""

    def step(self) -> list[Completion]:
        """One decode step for every running sequence; returns those that finished."""

    def peek(self, request_id: str) -> list[int]:
        """Optional (an engine without it streams nothing until a request ends): the output ids a
        running request has so far, for live streaming through the gateway."""

    def swap_weights(self, version: int, location: str) -> float:
        """Switch to ``version`` between two steps (the safe point). Returns seconds the swap took.
        Sequences keep running; their later tokens carry the new version."""


class TrainEngine(Protocol):
    def train(self, batch: list[Trajectory], version: int) -> dict:
        """One policy update on ``batch`` (made with weights ``version``); returns stats incl. loss."""

    def export_weights(self, version: int) -> tuple[str, int]:
        """Make the weights of ``version`` available to readers; returns (location, nbytes)."""
