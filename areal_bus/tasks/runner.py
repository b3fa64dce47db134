"""Playing a task through token ids: the agent node's driver, the reward node's verifier and the
trainer's held-out evaluation all use this one module, so they cannot disagree about an episode.

``GuessDriver`` turns engine completions into environment turns without ever re-tokenising what the
engine sampled: the next prompt is the previous ids + the sampled ids + the environment's reply ids.
``verify`` replays a finished trajectory's policy turns (the loss-masked spans) through a fresh
episode of the same seed and returns its reward. ``evaluate`` plays a fixed set of held-out episodes
greedily through any RolloutEngine, all at once in its continuous batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from areal_bus.messages import Completion, GenerateRequest, Trajectory
from areal_bus.tasks.guess import EVAL_SEED_BASE, GuessTask, eval_seeds, render_env_turn, render_prefix

MAX_TOKENS_PER_TURN = 8
"""A guess is a number and eos (2-3 tokens); 8 leaves room for a chatty policy without letting a
broken one ramble through the whole context."""


def load_tokenizer(model_path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


class GuessDriver:
    max_tokens = MAX_TOKENS_PER_TURN

    def __init__(self, tokenizer, n: int = 16, max_turns: int = 5):
        self.tok = tokenizer
        self.task = GuessTask(n, max_turns)
        self.eos = tokenizer.eos_token_id

    def new_seed(self, rng: np.random.Generator) -> int:
        """A training game: seeds below EVAL_SEED_BASE, so never one of the held-out games."""
        return int(rng.integers(0, EVAL_SEED_BASE))

    def start(self, rng: np.random.Generator, index: int, seed: int | None = None):
        """(episode, first prompt ids, meta) for a new game; the same seed is the same game."""
        seed = self.new_seed(rng) if seed is None else seed
        ep = self.task.reset(seed)
        return ep, np.asarray(render_prefix(self.tok, ep), dtype=np.int32), {"task": "guess", "seed": seed}

    def advance(self, ep, record, comp: Completion):
        """After a turn: (environment reply ids or None, done, reward). The reward is left to the
        reward node (None), which verifies the trajectory independently."""
        ids = comp.output_ids
        text = self.tok.decode(ids, skip_special_tokens=True)
        reply, done = ep.step(text)
        if done:
            return None, True, None
        env = render_env_turn(self.tok, reply)
        if ids.size == 0 or int(ids[-1]) != self.eos:
            env = [self.eos, *env]  # the turn hit max_tokens: close it as the template would
        return np.asarray(env, dtype=np.int32), False, None


def policy_turns(traj: Trajectory) -> list[np.ndarray]:
    """The policy's sampled spans of a trajectory, in order (maximal runs of loss_mask == 1)."""
    mask = traj.loss_mask.astype(bool)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [traj.output_ids[a:b] for a, b in zip(edges[::2], edges[1::2])]


def verify(driver: GuessDriver, traj: Trajectory) -> float:
    """The trajectory's reward by the task's rules, replayed from its seed and its policy turns."""
    seed = traj.meta.get("seed")
    if not isinstance(seed, int):
        raise ValueError(f"trajectory {traj.traj_id} carries no task seed")
    ep = driver.task.reset(seed)
    for ids in policy_turns(traj):
        if ep.done:
            break
        ep.step(driver.tok.decode(ids, skip_special_tokens=True))
    return ep.reward


def evaluate(engine, driver: GuessDriver, seeds: list[int] | None = None, k: int = 64) -> dict:
    """Greedy solve rate on held-out games, played concurrently through ``engine``."""
    seeds = seeds if seeds is not None else eval_seeds(k, driver.task.n)
    rng = np.random.default_rng(0)
    games = {}
    queue = []
    for i, seed in enumerate(seeds):
        ep, prompt, _ = driver.start(rng, i, seed=seed)
        games[f"eval-{i}"] = [ep, prompt, 0]
        queue.append(f"eval-{i}")
    turns = 0
    while queue or engine.running_ids:
        while queue and engine.free_slots > 0:
            gid = queue.pop()
            ep, ids, t = games[gid]
            engine.add_request(GenerateRequest(
                request_id=f"{gid}-t{t}", episode_id=gid, ticket=0, min_version=0,
                max_tokens=driver.max_tokens, temperature=0.0, prompt_ids=ids))
        for comp in engine.step():
            gid = comp.episode_id
            ep, ids, t = games[gid]
            env, done, _ = driver.advance(ep, None, comp)
            turns += 1
            if not done:
                games[gid] = [ep, np.concatenate([ids, comp.output_ids, env]).astype(np.int32), t + 1]
                queue.append(gid)
    solved = [games[g][0].reward for g in games]
    return {"eval_reward": float(np.mean(solved)), "eval_turns": turns / max(1, len(games))}
