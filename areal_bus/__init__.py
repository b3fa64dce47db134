"""areal_bus: fully asynchronous RL for LLM agents on a ZeroMQ message bus.

The library every node shares: wire messages and codec, channels, the node shell, the topology schema
and its rendering to supervisord, admission and staleness rules, engines and metrics. It knows nothing
of any one node's logic (those live in ``nodes/``)."""

__version__ = "0.1.0"

# The loss needs torch, and importing torch costs seconds and hundreds of MB: every node imports
# areal_bus, but only the trainer trains. So these names resolve on first access (PEP 562) instead of
# the eager ``from areal_bus.train.loss import decoupled_ppo_loss, grpo_advantages``.
_LAZY = {"decoupled_ppo_loss": "areal_bus.train.loss", "grpo_advantages": "areal_bus.train.loss"}

__all__ = ["__version__", "decoupled_ppo_loss", "grpo_advantages"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # cache: later accesses skip this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
