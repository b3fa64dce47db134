"""Longtail: the seed workload's long-tailed output lengths on the real engines (issue 15).

One turn per episode. The prompt is ``agent.prompt_len`` characters of random lowercase words (that
many tokens with the project's character-level tokenizer; fewer with a BPE one), drawn from the
episode seed (a GRPO group plays one prompt). Each episode's ``max_tokens`` is drawn afresh out of
``rollout_engine.output_len`` (the simulated engines' length model, ``engines.sim.draw_length``:
lognormal, median 500, clipped to 200..3000 by default; seeded by the episode seed and the count of
episodes this task has started, so the members of a group get lengths of their own, as the sim draws
one per request), and
the request ignores eos (``GenerateRequest.ignore_eos``), so every output is exactly that many tokens
the policy really generated: synchronous RL waits for the longest of them, as on real agent traces.

Reward (a real function of what was generated, so PPO has a signal): the share of the output text's
characters that are target ones, ``task_options.target`` (default the digits 0-9),

    reward = (target characters in the output text) / (characters in it)     (0 for an empty text)

in [0, 1]; with a character-level tokenizer, the fraction of generated tokens that are target ones
among those that are not special (eos and the chat markers decode to nothing). A random policy over the
tiny tokenizer's 99 ids scores about 0.1. The reward reads only the text, so the reward node's replay
(from the seed and the sampled text) needs no length.

Use it with ``agent.framework: longtail`` (rollout_engine.max_len must hold prompt_len, the chat
template's few tokens and output_len.max: ``check_limits``). bench/gpu_e2e.py --workload longtail runs
it at the Qwen2-0.5B / 1.5B shapes.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field

import numpy as np

from areal_bus.engines.sim import draw_length
from areal_bus.tasks.driver import TaskContext

DEFAULT_TARGET = string.digits
"""Characters the reward counts (``task_options.target`` overrides)."""

TEMPLATE_TOKENS = 16
"""Tokens the chat template adds around a one-turn prompt (ChatML: about 10); room kept in max_len."""

_LETTERS = np.array(list(string.ascii_lowercase))


def random_prompt(rng: np.random.Generator, chars: int) -> str:
    """``chars`` characters of random lowercase words (2-8 letters) separated by spaces."""
    out, n = [], 0
    while n < chars:
        word = "".join(_LETTERS[rng.integers(0, 26, int(rng.integers(2, 9)))])
        out.append(word)
        n += len(word) + 1
    return " ".join(out)[:chars]


@dataclass
class LongtailEpisode:
    """One turn: ``max_tokens`` real tokens generated through eos, scored by ``reward``."""

    messages: list[dict]
    max_tokens: int
    target: str
    ignore_eos: bool = True
    """The agent sends the turn with GenerateRequest.ignore_eos: only max_tokens ends it."""
    output: str = ""
    done: bool = False
    _target: frozenset = field(default=frozenset(), repr=False)

    def __post_init__(self) -> None:
        self._target = frozenset(self.target)

    def step(self, assistant_text: str) -> tuple[str | None, bool]:
        if self.done:
            raise RuntimeError("step() on a finished episode")
        self.messages.append({"role": "assistant", "content": assistant_text})
        self.output, self.done = assistant_text, True
        return None, True

    @property
    def reward(self) -> float:
        """Share of target characters (see the module docstring); 0.0 before the turn."""
        hits = sum(ch in self._target for ch in self.output)
        return hits / len(self.output) if self.output else 0.0


class LongtailTask:
    """``agent.framework: longtail``: built with a TaskContext whose ``topology`` gives
    ``rollout_engine.output_len`` and ``agent.prompt_len``."""

    name = "longtail"

    def __init__(self, ctx: TaskContext):
        topo = getattr(ctx, "topology", None)
        if topo is None:
            raise ValueError("the longtail task needs the topology (TaskContext.topology) for "
                             "rollout_engine.output_len and agent.prompt_len")
        self.lengths = topo.rollout_engine.output_len
        self.prompt_len = topo.agent.prompt_len
        self.target = str(ctx.options.get("target", DEFAULT_TARGET))
        if not self.target:
            raise ValueError("agent.task_options.target: the longtail reward needs at least one target character")
        self.max_tokens = self.lengths.max  # the driver's per-turn default; each episode draws its own
        self.started = 0  # episodes reset so far: with the seed, what a length is drawn from

    def reset(self, seed: int, row: dict | None = None) -> LongtailEpisode:
        """The episode of ``seed``: its prompt (the same every time), and a max_tokens of its own."""
        prompt = random_prompt(np.random.default_rng(seed), self.prompt_len)
        self.started += 1
        max_tokens = draw_length(self.lengths, np.random.default_rng([seed, self.started]))
        return LongtailEpisode([{"role": "user", "content": prompt}], max_tokens, self.target)


def check_limits(topo) -> list[str]:
    """Problems with a longtail topology's limits, each naming its field (empty: fine)."""
    need = topo.agent.prompt_len + TEMPLATE_TOKENS + topo.rollout_engine.output_len.max
    if topo.rollout_engine.kind != "sim" and topo.rollout_engine.max_len < need:
        return [f"rollout_engine.max_len ({topo.rollout_engine.max_len}) must hold agent.prompt_len "
                f"({topo.agent.prompt_len}) + {TEMPLATE_TOKENS} template tokens + rollout_engine.output_len.max "
                f"({topo.rollout_engine.output_len.max}) = {need} for agent.framework 'longtail'"]
    return []
