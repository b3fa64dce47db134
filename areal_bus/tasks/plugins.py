"""The agent's plug-ins, named in the topology: ``agent.framework`` (a built-in task name or
``package.module:Class``), ``agent.reward_source`` (``rule``, ``passthrough`` or
``package.module:function``) and ``agent.dataset``.

``check_agent`` is what ``areal-bus validate`` (through ``topology_files.check_files``) runs: it
imports the named module, finds the class or function, checks its signature against the interface
(tasks.driver) and loads the dataset, so a typo is one message naming the field, not a crash loop.
``make_driver`` builds the TaskDriver every node plays or verifies with.

Modules are imported from the Python path and from the folder of the supervisord.conf (the run's
folder, where a user's ``my_reward.py`` is most likely to sit), which is appended to ``sys.path``.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

from areal_bus.tasks.dataset import DatasetError, DatasetSplits
from areal_bus.tasks.driver import TaskContext, TaskDriver
from areal_bus.tasks.guess import GuessTask
from areal_bus.tasks.longtail import LongtailTask, check_limits
from areal_bus.tasks.math_task import MathTask
from areal_bus.tasks.runner import load_tokenizer

BUILTIN_TASKS = ("guess", "math", "longtail")
"""Built-in task names (besides ``sim``, the simulated engines' synthetic prompts)."""


class PluginError(ValueError):
    """A plug-in path that does not resolve or does not fit; the message names the field."""


def is_plugin_path(value: str) -> bool:
    module, sep, name = value.partition(":")
    return bool(sep) and all(p.isidentifier() for p in module.split(".")) and name.isidentifier()


def resolve(field: str, path: str, base: Path | None = None):
    """The object ``package.module:Name`` names; PluginError naming ``field`` otherwise."""
    if not is_plugin_path(path):
        raise PluginError(f"{field}: {path!r} is not package.module:Name")
    module_name, _, name = path.partition(":")
    folder = str((base or Path.cwd()).resolve())
    if folder not in sys.path:
        sys.path.append(folder)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise PluginError(f"{field}: cannot import {module_name!r} ({err}); put it on PYTHONPATH or in "
                          f"{folder}") from None
    except Exception as err:  # the user's module raised while importing: say which and what
        raise PluginError(f"{field}: importing {module_name!r} raised {type(err).__name__}: {err}") from None
    if not hasattr(module, name):
        raise PluginError(f"{field}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no {name!r}")
    return getattr(module, name)


def _binds(fn, *args) -> bool:
    try:
        inspect.signature(fn).bind(*args)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): let the call decide
        return True
    return True


def check_task_class(field: str, path: str, cls) -> None:
    """A task class: built with one TaskContext, ``reset(seed, row)`` returning an episode."""
    if not inspect.isclass(cls):
        raise PluginError(f"{field}: {path} is a {type(cls).__name__}, not a class (the task interface: "
                          f"areal_bus/tasks/driver.py)")
    if not _binds(cls, object()):
        raise PluginError(f"{field}: {path}{inspect.signature(cls)} cannot be built as {cls.__name__}(ctx) "
                          f"with one TaskContext")
    reset = getattr(cls, "reset", None)
    if not callable(reset):
        raise PluginError(f"{field}: {path} has no reset(seed, row) method")
    if not _binds(reset, object(), 0, None):
        raise PluginError(f"{field}: {path}.reset{inspect.signature(reset)} does not take (seed, row)")


def check_reward_fn(field: str, path: str, fn) -> None:
    """A reward function: called with one episode (sync or async)."""
    if not callable(fn) or inspect.isclass(fn):
        raise PluginError(f"{field}: {path} is a {type(fn).__name__}, not a function")
    if not _binds(fn, object()):
        raise PluginError(f"{field}: {path}{inspect.signature(fn)} cannot be called with one episode")


def task_class(agent, base: Path | None = None):
    """The class ``agent.framework`` names (checked), and the name trajectories carry in meta."""
    fw = agent.framework
    if fw == "guess":
        return GuessTask, "guess"
    if fw == "math":
        return MathTask, "math"
    if fw == "longtail":
        return LongtailTask, "longtail"
    cls = resolve("agent.framework", fw, base)
    check_task_class("agent.framework", fw, cls)
    return cls, fw


def reward_fn(agent, base: Path | None = None):
    """The function ``agent.reward_source`` names (checked), or None for a source that names none."""
    src = agent.reward_source
    if src in ("rule", "passthrough", "judge", "reward_model"):  # the last two: the reward node scores
        return None
    fn = resolve("agent.reward_source", src, base)
    check_reward_fn("agent.reward_source", src, fn)
    return fn


def load_dataset(agent, base: Path | None = None) -> DatasetSplits | None:
    if getattr(agent, "dataset", None) is None:
        return None
    required = agent.framework == "math" or "answer_field" in agent.dataset.model_fields_set
    return DatasetSplits(agent.dataset, base, answer_required=required)


def check_agent(topo, base: Path | None = None) -> list[str]:
    """Problems with the agent's plug-ins and dataset, each naming its field (empty: all fine)."""
    agent = topo.agent
    if agent.framework == "sim":
        return []
    problems = []
    for check in (task_class, reward_fn, load_dataset):
        try:
            check(agent, base)
        except (PluginError, DatasetError) as err:
            problems.append(str(err))
    if agent.framework == "longtail":
        problems += check_limits(topo)
    return problems


def make_driver(topo, base: Path | None = None, tokenizer=None) -> TaskDriver:
    """The driver of ``agent.framework`` with its dataset and reward function, on the policy's
    tokenizer (loaded from model.path unless given)."""
    if tokenizer is None:
        tokenizer = load_tokenizer(topo.model_path(base))
    agent = topo.agent
    cls, name = task_class(agent, base)
    dataset = load_dataset(agent, base)
    ctx = TaskContext(tokenizer=tokenizer, max_turns=agent.max_turns, dataset=dataset,
                      options=dict(getattr(agent, "task_options", {})), agent=agent, topology=topo)
    task = cls(agent.task_size, agent.max_turns) if name == "guess" else cls(ctx)
    return TaskDriver(task, tokenizer, name=name, dataset=dataset, max_tokens=getattr(agent, "max_tokens", None),
                      reward_fn=reward_fn(agent, base))
