"""Simulated engines: real scheduling, real messages, modelled compute.

``SimRolloutEngine`` models memory-bound GPU decoding: a decode step costs ``decode_step_s`` plus a
small ``decode_step_per_seq_s`` per sequence in the batch (nearly flat in batch size), and each request
draws its output length from the configured long-tailed distribution (seeded by the request id, so a
reissued request generates the same length). ``SimTrainEngine`` models an update as time per token
divided over the data-parallel train workers, plus a fixed overhead. Both keep time with deadlines
rather than bare sleeps, so Python overhead is absorbed into the modelled step instead of added to it.

The modelled tokens come from a generator seeded by the request's ``seed`` when it has one (else by its
id), with ``top_logprobs`` modelled too (the sampled token and k - 1 others, probabilities that sum
below 1, most likely first); ``top_k`` changes nothing (the modelled distribution has no shape to cut).
A ``grammar`` is refused (ValueError, which the rollout node answers as the request's Completion.error):
modelled tokens cannot follow one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from areal_bus.wire.messages import Completion, GenerateRequest, Trajectory
from areal_bus.config.topology import LengthDistribution, SimRolloutEngineConfig, SimTrainerEngineConfig


def draw_length(dist: LengthDistribution, rng: np.random.Generator) -> int:
    if dist.dist == "fixed":
        n = dist.max
    elif dist.dist == "uniform":
        n = int(rng.integers(dist.min, dist.max + 1))
    else:
        n = int(round(dist.median * float(np.exp(dist.sigma * rng.standard_normal()))))
    return int(min(max(n, dist.min), dist.max))


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _request_seed(req: GenerateRequest) -> int:
    return _seed(f"seed:{req.seed}") if req.seed >= 0 else _seed(req.request_id)


def modelled_top(ids: np.ndarray, logprobs: np.ndarray, k: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Modelled top_ids / top_logprobs [n, k] for sampled ``ids`` with ``logprobs``: the sampled token and
    k - 1 others sharing half, a quarter, ... of the remaining mass, most likely first ([0, 0] for k = 0)."""
    if not k:
        return np.zeros((0, 0), np.int32), np.zeros((0, 0), np.float32)
    n = ids.size
    others = (ids[:, None].astype(np.int64) + np.arange(1, k)[None]) % vocab_size
    rest = -np.expm1(logprobs.astype(np.float64))[:, None] * 0.5 ** np.arange(1, k)[None]
    top_ids = np.concatenate([ids[:, None], others], axis=1).astype(np.int32).reshape(n, k)
    top_lps = np.concatenate([logprobs[:, None].astype(np.float64), np.log(rest)], axis=1).reshape(n, k)
    order = np.argsort(-top_lps, axis=1, kind="stable")
    return np.take_along_axis(top_ids, order, 1), np.take_along_axis(top_lps, order, 1).astype(np.float32)


@dataclass(slots=True)
class _Seq:
    req: GenerateRequest
    length: int
    start_step: int
    started_at: float


class SimRolloutEngine:
    def __init__(self, cfg: SimRolloutEngineConfig, worker: str, vocab_size: int = 32000):
        self.cfg = cfg
        self.worker = worker
        self.vocab_size = vocab_size
        self._version = 0
        self.steps = 0
        self._running: dict[str, _Seq] = {}
        self._finish_at: dict[int, list[str]] = {}  # step number -> request ids finishing there
        self._version_changes: list[tuple[int, int]] = [(0, 0)]  # (first step, version)
        self._deadline = time.perf_counter()

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, version: int) -> None:
        """Tokens from the next step on carry ``version``."""
        self._version = version
        self._version_changes.append((self.steps, version))

    @property
    def free_slots(self) -> int:
        return self.cfg.max_batch - len(self._running)

    @property
    def running_ids(self) -> list[str]:
        return list(self._running)

    def add_request(self, req: GenerateRequest) -> None:
        if req.grammar:
            raise ValueError(f"request {req.request_id}: grammar: the simulated engine cannot constrain its "
                             "modelled tokens (rollout_engine.kind torch or vllm can)")
        rng = np.random.default_rng(_request_seed(req))
        length = min(draw_length(self.cfg.output_len, rng), req.max_tokens)
        self._running[req.request_id] = _Seq(req, length, self.steps, time.time())
        self._finish_at.setdefault(self.steps + length, []).append(req.request_id)

    def step(self) -> list[Completion]:
        if not self._running:
            return []
        cost = self.cfg.decode_step_s + self.cfg.decode_step_per_seq_s * len(self._running)
        now = time.perf_counter()
        # A step cannot start before the previous one ended; if we fell behind (idle, or overhead),
        # restart the clock from now rather than bursting to catch up.
        self._deadline = max(self._deadline, now) + cost
        delay = self._deadline - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        self.steps += 1
        return [self._finish(rid) for rid in self._finish_at.pop(self.steps, ())]

    def swap_weights(self, version: int, location: str) -> float:
        t0 = time.perf_counter()
        if self.cfg.swap_s:
            time.sleep(self.cfg.swap_s)
        self.version = version
        return time.perf_counter() - t0

    def _token_versions(self, start: int, length: int) -> np.ndarray:
        out = np.empty(length, dtype=np.int32)
        # Step s produced token s - start; the version in force at step s is the last change <= s-1.
        bounds = self._version_changes
        for i, (first, version) in enumerate(bounds):
            end = bounds[i + 1][0] if i + 1 < len(bounds) else start + length
            lo, hi = max(first, start), min(end, start + length)
            if lo < hi:
                out[lo - start:hi - start] = version
        return out

    def _finish(self, rid: str) -> Completion:
        seq = self._running.pop(rid)
        rng = np.random.default_rng(_request_seed(seq.req) ^ 0x5EED)
        n = seq.length
        ids = rng.integers(0, self.vocab_size, n, dtype=np.int32)
        logprobs = (-rng.exponential(1.0, n)).astype(np.float32)
        top_ids, top_logprobs = modelled_top(ids, logprobs, seq.req.top_logprobs, self.vocab_size)
        return Completion(
            request_id=rid, episode_id=seq.req.episode_id, ticket=seq.req.ticket, worker=self.worker,
            output_ids=ids, logprobs=logprobs, versions=self._token_versions(seq.start_step, n),
            finish_reason="length" if n >= seq.req.max_tokens else "stop",
            gen_seconds=time.time() - seq.started_at, top_ids=top_ids, top_logprobs=top_logprobs,
        )


class SimTrainEngine:
    """Implements areal_bus.engines.train_engine.TrainEngine with modelled update times and no weights:
    nothing to export, release, evaluate or close."""

    vocab_size = None  # no embedding to index: any non-negative id trains

    def __init__(self, cfg: SimTrainerEngineConfig, train_workers: int):
        self.cfg = cfg
        self.train_workers = train_workers

    def modelled_seconds(self, tokens: int) -> float:
        return self.cfg.update_overhead_s + tokens * self.cfg.time_per_token_s / self.train_workers

    def train(self, batch: list[Trajectory], version: int, baseline=()) -> dict:  # no advantages: baseline unused
        tokens = sum(t.num_tokens for t in batch)
        time.sleep(self.modelled_seconds(tokens))
        rewards = [t.reward for t in batch if t.reward is not None]
        mean_reward = float(np.mean(rewards)) if rewards else 0.0
        # A stand-in loss that moves like a real one would (down with steps), so curves and logs have
        # a realistic shape; the real objective is areal_bus.train.loss.decoupled_ppo_loss.
        loss = float(1.0 / (1.0 + 0.05 * version) - 0.1 * mean_reward)
        return {"loss": loss, "tokens": tokens, "reward": mean_reward}

    def export_weights(self, version: int) -> tuple[str, int]:
        return "", 0

    def save_checkpoint(self, folder, version: int, consumed: list[str]):
        """Simulated weights have nothing to save but the trainer state that resuming needs; written to a
        temp folder and renamed, as the torch engine's, so a folder saved over is never half old."""
        folder = Path(folder)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "trainer_state.json").write_text(json.dumps({"version": version, "consumed": consumed}))
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        return folder

    def release(self, version: int) -> None:
        pass

    def load_optimizer(self, folder) -> None:
        pass  # no optimizer: trainer_state.json, which the trainer reads itself, is the whole checkpoint

    def evaluate(self, version: int) -> dict | None:
        return None

    def close(self, in_flight: bool = False) -> None:
        pass
