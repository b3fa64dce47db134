"""Guess-the-number: the built-in multi-turn agent task.

The environment holds a secret in 1..n (drawn from the episode seed). Each assistant turn is a guess;
the environment answers as the user with "higher", "lower" or, for a turn with no number in it,
"invalid" (a wasted turn), followed by the range still possible, e.g. "higher (9-16)". The episode
ends when the guess is right or after ``max_turns`` guesses.

Why the reply carries the range: it puts the game's state in the last message, so a model of a few
hundred thousand parameters, trained for two minutes on two CPU cores, can play from it. What remains
to learn, and what RL improves, is the strategy: which number to pick from that range.

Reward (verifiable, in [0, 1]): 1.0 if the secret was guessed within ``max_turns``, else 0.0. We keep
it binary on purpose: it is exactly the solve rate, which is what the learning benchmark reports, and
a per-turn discount would let a lucky early guess out-score a sound strategy.

Episode lengths vary with the strategy and the secret: a right first guess is one turn (2 generated
tokens with this project's tokenizer), a miss runs ``max_turns`` turns; midpoint search on 1..16 needs
up to 5 guesses, so the default ``max_turns=5`` lets a perfect player always win.

Token bookkeeping (the no-re-tokenisation rule): the agent keeps one id list per episode,

    ids = render_prefix(tok, ep)                  # prompt, ends with '<|im_start|>assistant\\n'
    ids += sampled                                # exactly what the engine sampled, ends with eos
    ids += render_env_turn(tok, reply)            # closes the turn, opens the next assistant turn

and trains only on the ``sampled`` spans. ``ids`` equals the tokenisation of the chat template applied
to ``ep.messages`` (tests/test_task.py checks it), so training sees what generation saw.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from areal_bus.tasks.driver import (  # noqa: F401  (re-exported: the guess task's old home of them)
    EVAL_SEED_BASE,
    render_assistant_turn,
    render_env_turn,
    render_prefix,
)

HIGHER, LOWER, INVALID = "higher", "lower", "invalid"

_NUMBER = re.compile(r"\d+")


def parse_guess(text: str) -> int | None:
    """The guess in an assistant turn: its last run of digits ("8", "My guess: 8." -> 8); None if none."""
    found = _NUMBER.findall(text)
    return int(found[-1]) if found else None


def secret_for(seed: int, n: int) -> int:
    """The secret of episode ``seed`` (stable across Python versions: ``random.Random`` of an int)."""
    return random.Random(seed).randint(1, n)


@dataclass
class Episode:
    """One game. ``messages`` is the OpenAI-style conversation so far; ``step`` plays one turn."""

    secret: int
    n: int
    max_turns: int
    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    solved: bool = False
    done: bool = False
    lo: int = 1
    """Lowest number still consistent with the feedback so far (for players and diagnostics)."""
    hi: int = 0
    """Highest number still consistent with the feedback so far."""

    def __post_init__(self) -> None:
        self.hi = self.hi or self.n

    def step(self, assistant_text: str) -> tuple[str | None, bool]:
        """Play ``assistant_text`` as one guess. Returns (environment reply, done); reply is None when
        the episode ended with this turn (solved, or out of turns)."""
        if self.done:
            raise RuntimeError("step() on a finished episode")
        self.messages.append({"role": "assistant", "content": assistant_text})
        self.turns += 1
        guess = parse_guess(assistant_text)
        if guess == self.secret:
            self.solved = self.done = True
            return None, True
        if guess is None:
            reply = INVALID
        elif guess < self.secret:
            reply = HIGHER
            self.lo = max(self.lo, guess + 1)
        else:
            reply = LOWER
            self.hi = min(self.hi, guess - 1)
        if self.turns >= self.max_turns:
            self.done = True
            return None, True
        reply = f"{reply} ({self.lo}-{self.hi})"
        self.messages.append({"role": "user", "content": reply})
        return reply, False

    @property
    def reward(self) -> float:
        """1.0 if solved within max_turns, else 0.0 (also 0.0 while the episode is still running)."""
        return 1.0 if self.solved else 0.0

    @property
    def correct(self) -> bool:
        """Solved (the evaluation's accuracy)."""
        return self.solved


class GuessTask:
    """Factory of guess-the-number episodes; ``reset(seed)`` is deterministic in the seed."""

    name = "guess"
    max_tokens = 8
    """A guess is a number and eos (2-3 tokens); 8 leaves room for a chatty policy without letting a
    broken one ramble through the whole context."""

    def __init__(self, n: int = 16, max_turns: int = 5) -> None:
        if n < 2 or max_turns < 1:
            raise ValueError(f"GuessTask needs n >= 2 and max_turns >= 1, got n={n} max_turns={max_turns}")
        self.n = n
        self.max_turns = max_turns

    def prompt(self) -> str:
        return f"Guess my number (1-{self.n}) in {self.max_turns} tries. I say higher or lower."

    def reset(self, seed: int, row: dict | None = None) -> Episode:
        """The game of ``seed`` (``row`` is unused: guess has no dataset)."""
        ep = Episode(secret=secret_for(seed, self.n), n=self.n, max_turns=self.max_turns)
        ep.messages.append({"role": "user", "content": self.prompt()})
        return ep

    def eval_seeds(self, k: int) -> list[int]:
        return eval_seeds(k, self.n)


def eval_seeds(k: int, n: int = 16) -> list[int]:
    """``k`` held-out seeds (all >= EVAL_SEED_BASE, so disjoint from training seeds), stratified so the
    secrets cycle through 1..n: with k a multiple of n the greedy eval is the exact solve rate over
    uniform secrets rather than a noisy sample of it."""
    seeds, seed = [], EVAL_SEED_BASE
    for i in range(k):
        want = 1 + i % n
        while secret_for(seed, n) != want:
            seed += 1
        seeds.append(seed)
        seed += 1
    return seeds


def is_eval_seed(seed: int) -> bool:
    return seed >= EVAL_SEED_BASE


def bisect_guess(ep: Episode) -> str:
    """The reference player: midpoint of the feasible interval (always solves 1..16 in 5 turns)."""
    return str((ep.lo + ep.hi) // 2)
