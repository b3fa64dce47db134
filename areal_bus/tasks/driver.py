"""The episode-driver interface: what a task is, what it gets, what it returns, and the one generic
driver that plays any task through token ids. Guess-the-number (``guess``), the dataset task
(``math``) and a user's own class (``agent.framework: package.module:Class``) all go through it.

A task is a class built once per node with a ``TaskContext``:

    class MyTask:
        max_tokens = 128                     # tokens per policy turn (agent.max_tokens overrides)

        def __init__(self, ctx: TaskContext): ...
        def reset(self, seed: int, row: dict | None): ...   # -> an episode (below)
        def eval_seeds(self, k: int) -> list[int]: ...       # optional: the held-out instances

What a task gets:
  - ``ctx.tokenizer``: the policy's tokenizer (``apply_chat_template`` renders chats: the model's own
    chat template when it has one, the project's ChatML otherwise); tasks rarely need it, the driver
    does all the token work;
  - ``ctx.dataset``: the ``agent.dataset`` rows (``tasks.dataset.DatasetSplits``: ``prompt(row)`` fills
    the prompt template, ``answer(row)`` reads the answer field) or None;
  - ``ctx.max_turns``, ``ctx.options`` (``agent.task_options``), ``ctx.agent`` (the whole AgentConfig),
    ``ctx.topology`` (the whole Topology);
  - in ``reset``: the instance's ``seed`` and, with a dataset, its ``row`` (seed i < EVAL_SEED_BASE is
    training row i of the shuffled train split; EVAL_SEED_BASE + i is held-out row i), else None.

What an episode returns (``reset``'s result; ``guess.Episode`` and ``math_task.MathEpisode`` are two):
  - ``messages``: the OpenAI-style chat so far, starting with the prompt (a system and/or user turn);
  - ``step(assistant_text) -> (reply | None, done)``: plays one policy turn; ``reply`` is the next
    user turn's text (multi-turn feedback), None when the episode ended with this turn;
  - ``reward``: a float, or a dict of named components (the reward is their sum; each component is
    kept on the trajectory as ``meta['reward_components']`` and logged per update as
    ``reward.<name>``);
  - optionally ``correct`` (bool): the held-out evaluation reports its mean as ``eval_accuracy``;
  - optionally ``max_tokens`` (int): this episode's tokens per turn, over the driver's (the longtail
    task draws one per episode), and ``ignore_eos`` (bool): its turns generate through eos, ended only
    by max_tokens (agents over the bus honour both).

``agent.reward_source: package.module:function`` replaces the episode's own ``reward``:
``function(episode)`` (sync or ``async def``) gets the finished episode, replayed from the
trajectory's seed and its policy turns, and returns a float or a dict of components as above.

Token bookkeeping (the no-re-tokenisation rule) is the driver's, never the task's: a turn's prompt
is the previous prompt + exactly the ids the engine sampled + the ids of the environment's reply
(``render_env_turn``, taken from the chat template itself), and only the sampled spans are trained.
``render_prefix(tok, messages)`` + sampled + ``render_env_turn(...)`` equals the tokenisation of
the chat template applied to the whole conversation (tests/test_task.py checks it for the project's
tokenizer, tests/test_task_math.py for SmolLM2's BPE one).
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field

import numpy as np

from areal_bus.wire.messages import Completion

EVAL_SEED_BASE = 2_000_000_000
"""Seeds at or above this are held-out instances; training draws seeds below it. Kept under 2**31 so
a seed fits any int32 field on the wire."""

DEFAULT_MAX_TOKENS = 128
"""Tokens per policy turn for a task that names no ``max_tokens`` (and no agent.max_tokens)."""


@dataclass
class TaskContext:
    """What a task class is built with (see the module docstring)."""

    tokenizer: object
    max_turns: int = 1
    dataset: object | None = None
    options: dict = field(default_factory=dict)
    agent: object | None = None
    topology: object | None = None
    """The whole Topology (the longtail task reads rollout_engine.output_len from it)."""


# --- token-level helpers: the driver appends ids, it never re-tokenises what the engine sampled ------

def render_prefix(tokenizer, episode_or_messages) -> list[int]:
    """Prompt ids of the conversation so far, ending with the generation prompt (assistant header)."""
    messages = getattr(episode_or_messages, "messages", episode_or_messages)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def render_env_turn(tokenizer, reply_text: str, role: str = "user") -> list[int]:
    """Ids to append after the assistant's sampled ids (which end with eos) to close that turn, add the
    environment reply and open the next assistant turn. Taken from the chat template itself, so it
    matches whatever the template puts between turns (for ChatML:
    "\\n<|im_start|>user\\nhigher<|im_end|>\\n<|im_start|>assistant\\n")."""
    marker = "\x00"  # a character no template or reply contains: locates the end of the assistant turn
    convo = [{"role": "assistant", "content": marker}, {"role": role, "content": reply_text}]
    text = tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    after_marker = text[text.index(marker) + 1:]
    if not after_marker.startswith(tokenizer.eos_token):
        raise ValueError("chat template does not end an assistant turn with the eos token")
    return tokenizer.encode(after_marker[len(tokenizer.eos_token):], add_special_tokens=False)


def render_assistant_turn(tokenizer, text: str) -> list[int]:
    """The ids a sampler would emit for ``text``: its tokens then eos. For demonstrations only; in RL
    the engine's own sampled ids are used as they are."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


# --- rewards -----------------------------------------------------------------------------------------

def combine_reward(value) -> tuple[float, dict[str, float] | None]:
    """(reward, components) of what a task or reward function returned: a number is the reward; a
    dict of named numbers is summed (its parts are the components). Anything else is a ValueError."""
    if isinstance(value, dict):
        parts = {}
        for k, v in value.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"a reward dict maps names to numbers, got {k!r}: {v!r}")
            parts[k] = float(v)
        return float(sum(parts.values())), parts
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"a reward is a number or a dict of named numbers, got {type(value).__name__}")
    return float(value), None


class RewardFn:
    """``agent.reward_source: package.module:function`` made callable on an episode, sync or async
    (an ``async def`` runs on an event loop of its own, one per scorer, in the calling thread)."""

    def __init__(self, fn):
        self.fn = fn
        self._loop = None

    def __call__(self, episode):
        out = self.fn(episode)
        if inspect.isawaitable(out):
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            out = self._loop.run_until_complete(out)
        return out


# --- the driver --------------------------------------------------------------------------------------

class TaskDriver:
    """Plays a text-level task through token ids: the agent node's episodes, the reward node's replay
    and the trainer's held-out evaluation all use one driver, so they cannot disagree.

    ``start``/``advance`` are what the agent's EpisodeSource calls (the sim task has a driver of its
    own with the same two methods); ``replay`` and ``score`` are the verifier's."""

    def __init__(self, task, tokenizer, *, name: str, dataset=None, max_tokens: int | None = None,
                 reward_fn=None):
        self.task = task
        self.tok = tokenizer
        self.name = name
        self.dataset = dataset
        self.max_tokens = int(max_tokens or getattr(task, "max_tokens", None) or DEFAULT_MAX_TOKENS)
        self.reward_fn = RewardFn(reward_fn) if reward_fn is not None else None
        self.eos = tokenizer.eos_token_id
        self._order = None  # the next training row (a dataset is walked through, epoch after epoch)

    # -- instances ------------------------------------------------------------------------------
    def new_seed(self, rng: np.random.Generator) -> int:
        """A training instance: below EVAL_SEED_BASE, so never a held-out one. With a dataset, the rows
        of the (shuffled) train split in turn, from a place ``rng`` picks."""
        pick = getattr(self.task, "train_seed", None)
        if pick is not None:
            return int(pick(rng))
        if self.dataset is None:
            return int(rng.integers(0, EVAL_SEED_BASE))
        n = self.dataset.train_size
        if self._order is None:
            self._order = int(rng.integers(0, n))
        seed, self._order = self._order % n, self._order + 1
        return seed

    def eval_seeds(self, k: int) -> list[int]:
        """The held-out instances: the task's own, else the first ``k`` rows of the eval split, else
        ``k`` seeds from EVAL_SEED_BASE."""
        own = getattr(self.task, "eval_seeds", None)
        if own is not None:
            return list(own(k))
        n = k if self.dataset is None else min(k, self.dataset.eval_size)
        return [EVAL_SEED_BASE + i for i in range(n)]

    def reset(self, seed: int):
        """The episode of ``seed``: the same seed is the same instance (a GRPO group plays it n times)."""
        row = self.dataset.row(seed) if self.dataset is not None else None
        return self.task.reset(seed, row)

    # -- playing (the agent) --------------------------------------------------------------------
    def start(self, rng: np.random.Generator, index: int, seed: int | None = None):
        """(episode, first prompt ids, meta) for a new instance."""
        seed = self.new_seed(rng) if seed is None else seed
        ep = self.reset(seed)
        return ep, np.asarray(render_prefix(self.tok, ep), dtype=np.int32), {"task": self.name, "seed": seed}

    def advance(self, ep, record, comp: Completion):
        """After a turn: (environment reply ids or None, done, reward). The reward is left to the
        reward node (None), which verifies the trajectory independently."""
        ids = comp.output_ids
        reply, done = ep.step(self.tok.decode(ids, skip_special_tokens=True))
        if done:
            return None, True, None
        env = render_env_turn(self.tok, reply)
        if ids.size == 0 or int(ids[-1]) != self.eos:
            env = [self.eos, *env]  # the turn hit max_tokens: close it as the template would
        return np.asarray(env, dtype=np.int32), False, None

    # -- verifying (the reward node, the evaluation) --------------------------------------------
    def replay(self, seed: int, turns: list[str]):
        """The episode of ``seed`` with the policy's turns (texts) played again in order."""
        ep = self.reset(seed)
        for text in turns:
            if ep.done:
                break
            ep.step(text)
        return ep

    def score(self, ep) -> tuple[float, dict[str, float] | None]:
        """(reward, components) of a finished episode: agent.reward_source's function, else the task's
        own ``reward``."""
        return combine_reward(self.reward_fn(ep) if self.reward_fn is not None else ep.reward)
