"""An episode's token record: how a multi-turn conversation becomes one trajectory.

The record keeps the exact token ids the engine sampled, turn by turn, with their log-probabilities
and policy versions, and appends the environment's reply tokens between turns with loss mask 0. The
next turn's prompt is the record's ids so far, never a re-tokenisation of the chat text, so what the
trainer sees is exactly what the engine saw and produced. Used by the agent node (and by the gateway,
which records sessions the same way).
"""

from __future__ import annotations

import numpy as np

from areal_bus.wire.messages import Completion, Trajectory


class EpisodeRecord:
    def __init__(self, episode_id: str, prompt_ids: np.ndarray, *, group_id: str = "", ticket: int = 0,
                 meta: dict | None = None):
        self.episode_id = episode_id
        self.prompt_ids = np.asarray(prompt_ids, dtype=np.int32)
        self.group_id = group_id
        self.ticket = ticket
        self.meta = dict(meta or {})
        self.turns = 0
        self.worker = ""
        self.gen_seconds = 0.0
        self.finish_reason = "stop"
        self._ids: list[np.ndarray] = []
        self._logprobs: list[np.ndarray] = []
        self._versions: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []

    def add_completion(self, comp: Completion) -> None:
        n = comp.output_ids.size
        self._ids.append(np.asarray(comp.output_ids, dtype=np.int32))
        self._logprobs.append(np.asarray(comp.logprobs, dtype=np.float32))
        self._versions.append(np.asarray(comp.versions, dtype=np.int32))
        self._mask.append(np.ones(n, dtype=np.uint8))
        self.turns += 1
        self.worker = comp.worker
        self.gen_seconds += comp.gen_seconds
        self.finish_reason = comp.finish_reason

    def add_env(self, ids) -> None:
        ids = np.asarray(ids, dtype=np.int32)
        self._ids.append(ids)
        self._logprobs.append(np.zeros(ids.size, dtype=np.float32))
        self._versions.append(np.full(ids.size, -1, dtype=np.int32))
        self._mask.append(np.zeros(ids.size, dtype=np.uint8))

    def next_prompt(self) -> np.ndarray:
        """Prompt for the next turn: the first prompt plus every token since, exactly."""
        return np.concatenate([self.prompt_ids, *self._ids]) if self._ids else self.prompt_ids

    def to_trajectory(self, reward: float | None = None) -> Trajectory:
        def cat(parts, dtype):
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)

        return Trajectory(
            traj_id=self.episode_id, episode_id=self.episode_id, ticket=self.ticket, worker=self.worker,
            prompt_ids=self.prompt_ids, output_ids=cat(self._ids, np.int32),
            logprobs=cat(self._logprobs, np.float32), versions=cat(self._versions, np.int32),
            loss_mask=cat(self._mask, np.uint8), reward=reward, group_id=self.group_id,
            finish_reason=self.finish_reason, gen_seconds=self.gen_seconds,
            meta={**self.meta, "turns": self.turns})
