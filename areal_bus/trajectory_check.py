"""Is a trajectory one the model can train on? The check the trainer (and the gateway, before it
emits a session) runs on every trajectory that passed the wire checks.

The codec guarantees types, dtypes and bounds of each field on its own; what it cannot know is how
the fields must agree with one another and with the model: ``output_ids``, ``logprobs``,
``versions`` and ``loss_mask`` are aligned token for token, every id is in the model's vocabulary,
and no token claims a policy version the trainer has not made yet. A trajectory that breaks one of
these would crash the update (an index past the embedding is a device-side assert on a GPU, which
kills the process) or train on nonsense, so it is refused before it is accepted.

    reason = check_trajectory(traj, vocab_size=engine.vocab_size, newest_version=version)
    if reason is not None: ...   # "code: detail"; ``reason_code(reason)`` names the metric

Run: used by nodes/trainer/core.py and nodes/gateway/node.py; tests/test_poisoned.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from areal_bus.wire.messages import Trajectory

REASONS = ("empty", "misaligned", "bad_dtype", "bad_id", "bad_mask", "bad_version", "future_version", "bad_number")
"""Every reason code ``check_trajectory`` gives (the part before the colon): metrics are named by them."""


def model_vocab_size(model_path: str | Path) -> int | None:
    """The vocabulary (embedding rows) of the Hugging Face checkpoint at ``model_path``, from its
    config.json; None when there is none to read (then ids are not checked against one)."""
    try:
        size = json.loads((Path(model_path) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if type(size) is int and size > 0 else None


def reason_code(reason: str) -> str:
    """The code of a reason ``check_trajectory`` gave: ``"bad_id: ..."`` -> ``"bad_id"``."""
    return reason.split(":", 1)[0]


def check_trajectory(traj: Trajectory, vocab_size: int | None, newest_version: int | None) -> str | None:
    """None if the trajectory is consistent for the model, else why not (``"code: detail"``).
    ``vocab_size`` None: ids are only checked to be non-negative (a simulated engine has no
    vocabulary). ``newest_version`` None: versions are only checked to be -1 or non-negative."""
    n = traj.output_ids.size
    if traj.prompt_ids.size + n == 0:
        return "empty: no prompt and no output tokens"
    for name in ("logprobs", "versions", "loss_mask"):
        size = getattr(traj, name).size
        if size != n:
            return f"misaligned: output_ids has {n} tokens, {name} {size}"
    for name in ("prompt_ids", "output_ids", "versions", "loss_mask"):
        arr = getattr(traj, name)
        if arr.size and not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
            return f"bad_dtype: {name} is {arr.dtype}, not integers"
    if traj.logprobs.size and not np.issubdtype(traj.logprobs.dtype, np.floating):
        return f"bad_dtype: logprobs is {traj.logprobs.dtype}, not floats"
    for name in ("prompt_ids", "output_ids"):
        arr = getattr(traj, name)
        if not arr.size:
            continue
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0:
            return f"bad_id: {name} holds {lo}"
        if vocab_size is not None and hi >= vocab_size:
            return f"bad_id: {name} holds {hi}, vocabulary is {vocab_size}"
    if n == 0:
        return None
    mask = traj.loss_mask.astype(np.int64)
    if mask.min() < 0 or mask.max() > 1:
        return "bad_mask: loss_mask is not 0/1"
    if not np.isfinite(traj.logprobs).all():
        return "bad_number: logprobs not finite"
    versions = traj.versions.astype(np.int64)
    if versions.min() < -1 or (versions[mask == 1] < 0).any():
        return "bad_version: a trained token (loss_mask 1) without a version, or a version below -1"
    if newest_version is not None and int(versions.max()) > newest_version:
        return f"future_version: a token of version {int(versions.max())}, the trainer has made {newest_version}"
    return None
