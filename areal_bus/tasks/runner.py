"""Playing a task through token ids: the agent node's driver, the reward node's verifier and the
trainer's held-out evaluation all use this one module, so they cannot disagree about an episode.

``verify`` replays a finished trajectory's policy turns (the loss-masked spans) through a fresh
episode of the same seed and scores it (agent.reward_source's function, else the task's reward).
``evaluate`` plays the held-out instances greedily through any RolloutEngine, all at once in its
continuous batch, and reports the mean reward, the accuracy and the completions' lengths.
``GuessDriver`` is the driver (tasks.driver.TaskDriver) of guess-the-number.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from areal_bus.wire.messages import GenerateRequest, Trajectory
from areal_bus.tasks.driver import TaskDriver
from areal_bus.tasks.guess import GuessTask
from areal_bus.model.tokenizer import CHAT_TEMPLATE

MAX_TOKENS_PER_TURN = GuessTask.max_tokens


def load_tokenizer(model_path: str | Path):
    """The policy's tokenizer. A tokenizer without a chat template gets the project's ChatML one
    (areal_bus.model.tokenizer.CHAT_TEMPLATE), so every task renders its turns the same way."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    if not getattr(tok, "chat_template", None):
        tok.chat_template = CHAT_TEMPLATE
    return tok


class GuessDriver(TaskDriver):
    """The guess-the-number driver (what ``agent.framework: guess`` builds)."""

    def __init__(self, tokenizer, n: int = 16, max_turns: int = 5, max_tokens: int | None = None, reward_fn=None):
        super().__init__(GuessTask(n, max_turns), tokenizer, name="guess", max_tokens=max_tokens, reward_fn=reward_fn)


def policy_turns(traj: Trajectory) -> list[np.ndarray]:
    """The policy's sampled spans of a trajectory, in order (maximal runs of loss_mask == 1)."""
    mask = traj.loss_mask.astype(bool)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [traj.output_ids[a:b] for a, b in zip(edges[::2], edges[1::2])]


def replay(driver: TaskDriver, traj: Trajectory):
    """The trajectory's episode, replayed from its seed and its policy turns (ValueError without a seed)."""
    seed = traj.meta.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"trajectory {traj.traj_id} carries no task seed")
    return driver.replay(seed, [driver.tok.decode(ids, skip_special_tokens=True) for ids in policy_turns(traj)])


def verify(driver: TaskDriver, traj: Trajectory) -> float:
    """The trajectory's reward by the task's rules (or agent.reward_source's function). A dict of
    components is summed; the components are kept on the trajectory (``meta['reward_components']``)
    for the trainer to log."""
    reward, parts = driver.score(replay(driver, traj))
    if parts is not None:
        traj.meta["reward_components"] = parts
    return reward


def evaluate(engine, driver: TaskDriver, seeds: list[int] | None = None, k: int = 64) -> dict:
    """Greedy play of the held-out instances, concurrently through ``engine``: ``eval_reward`` (mean
    reward), ``eval_accuracy`` (share of episodes the task marks ``correct``, when it does),
    ``eval_turns`` (policy turns per episode) and the completions' token counts (mean, max)."""
    seeds = seeds if seeds is not None else driver.eval_seeds(k)
    rng = np.random.default_rng(0)
    games = {}
    queue = []
    for i, seed in enumerate(seeds):
        ep, prompt, _ = driver.start(rng, i, seed=seed)
        games[f"eval-{i}"] = [ep, prompt, 0]
        queue.append(f"eval-{i}")
    turns, lengths = 0, []
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
            lengths.append(int(comp.output_ids.size))
            if not done:
                games[gid] = [ep, np.concatenate([ids, comp.output_ids, env]).astype(np.int32), t + 1]
                queue.append(gid)
    episodes = [g[0] for g in games.values()]
    out = {"eval_reward": float(np.mean([driver.score(ep)[0] for ep in episodes])) if episodes else 0.0,
           "eval_turns": turns / max(1, len(games)),
           "eval_tokens_mean": float(np.mean(lengths)) if lengths else 0.0,
           "eval_tokens_max": int(max(lengths, default=0))}
    if episodes and all(hasattr(ep, "correct") for ep in episodes):
        out["eval_accuracy"] = float(np.mean([bool(ep.correct) for ep in episodes]))
    return out
