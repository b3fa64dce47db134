"""One torch intra-op thread for test modules of tiny models: on a shared 2-core box threads only add
contention (100x slower under load). Kept out of conftest.py, which imports pyzmq: the GPU host runs the
engine tests with --noconftest. A module takes it by importing it (it is autouse):

    from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)
"""

import contextlib

import pytest
import torch


@contextlib.contextmanager
def one_torch_thread():
    """torch.set_num_threads(1) inside, the setting before restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread_per_module():
    with one_torch_thread():
        yield
