"""Built-in agent tasks: environments that play the user/tool side of a multi-turn episode and score
it with a verifiable reward in [0, 1]. Each task offers ``reset(seed) -> Episode`` and the token-level
helpers the agent uses to append environment turns without re-tokenising sampled ids."""

from areal_bus.tasks.guess import (
    EVAL_SEED_BASE,
    Episode,
    GuessTask,
    eval_seeds,
    is_eval_seed,
    render_assistant_turn,
    render_env_turn,
    render_prefix,
)

TASKS = {"guess": GuessTask}
"""Task classes by the name a topology or config uses."""


def make_task(name: str, **kwargs):
    """Build the task called ``name`` (see ``TASKS``) with its keyword arguments."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    return TASKS[name](**kwargs)


__all__ = [
    "EVAL_SEED_BASE", "Episode", "GuessTask", "TASKS", "eval_seeds", "is_eval_seed", "make_task",
    "render_assistant_turn", "render_env_turn", "render_prefix",
]
