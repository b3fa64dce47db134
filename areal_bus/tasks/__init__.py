"""Agent tasks: environments that play the user/tool side of an episode and score it with a
verifiable reward. The interface a task implements, and the driver that plays any task through
token ids, is in ``driver`` (its docstring is the reference); ``guess`` is guess-the-number, ``longtail``
the long-tailed one-turn workload of the GPU benchmarks, ``math``
(``math_task``) the built-in dataset task with an exact answer checker and ``arith`` its problem
generator; ``dataset`` reads ``agent.dataset``; ``plugins`` resolves what the topology names
(``agent.framework: package.module:Class``, ``agent.reward_source: package.module:function``);
``runner`` verifies and evaluates."""

from areal_bus.tasks.driver import (
    EVAL_SEED_BASE,
    TaskContext,
    TaskDriver,
    combine_reward,
    render_assistant_turn,
    render_env_turn,
    render_prefix,
)
from areal_bus.tasks.guess import Episode, GuessTask, eval_seeds, is_eval_seed
from areal_bus.tasks.longtail import LongtailEpisode, LongtailTask
from areal_bus.tasks.math_task import MathEpisode, MathTask

TASKS = {"guess": GuessTask, "math": MathTask, "longtail": LongtailTask}
"""Task classes by the name a topology or config uses."""


def make_task(name: str, **kwargs):
    """Build the task called ``name`` (see ``TASKS``) with its keyword arguments."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    return TASKS[name](**kwargs)


__all__ = [
    "EVAL_SEED_BASE", "Episode", "GuessTask", "LongtailEpisode", "LongtailTask", "MathEpisode", "MathTask", "TASKS", "TaskContext", "TaskDriver",
    "combine_reward", "eval_seeds", "is_eval_seed", "make_task", "render_assistant_turn", "render_env_turn",
    "render_prefix",
]
