"""areal_bus.train.launch_replay: a kernel library's call run whole once per key, then replayed.

The library here is a small one of the same shape as flash-attn-4's entry points (host-side selection on
every call, allocations, a zero-filled accumulator, a scratch used through a view, kernels from per-function
compile caches, the first use compiling from a local variable); its "kernels" are opaque callables, as
tvm-ffi functions are. The real library is checked against its own whole calls on a GPU
(tests/test_train_model.py's FlashAttention-4 tests)."""

from __future__ import annotations

import gc
import types
import weakref
from typing import NamedTuple

import pytest
import torch

from areal_bus.train.launch_replay import LaunchReplay, compile_cache_owners


class Aux(NamedTuple):
    tensors: tuple | None = None
    scalars: tuple | None = None


class Kernel:
    """A compiled kernel: the recorder does not look inside."""

    def __init__(self, body):
        self.body = body

    def __call__(self, *args):
        self.body(*args)


def _make_library():
    lib = types.ModuleType("toylib")
    lib.selections = []

    def _pre_body(x, acc):
        acc.add_(x.float().sum(-1))

    def _main_body(x, w, acc, out, ws, scale, aux):
        out.copy_(x * w * scale + acc[:, None])
        ws.copy_(acc)

    def pre():
        pass

    def attention(x, w, scale, *, clone_input=False, aux_tensor=False, w_row=False):
        lib.selections.append(tuple(x.shape))  # the per-call host work a replay skips
        key = (x.dtype, x.shape[-1])
        acc = torch.zeros(x.shape[0], dtype=torch.float32)  # accumulated into: must start at zero
        out = torch.empty_like(x)
        ws = torch.empty((x.shape[0] + 7) // 8 * 8, dtype=torch.float32)[: x.shape[0]]
        if clone_input:
            x = x.clone()
        kernel = pre.compile_cache.get(key)
        if kernel is None:
            kernel = Kernel(_pre_body)
            pre.compile_cache[key] = kernel
        kernel(x.detach(), acc)
        kernel = attention.compile_cache.get(key)
        if kernel is None:
            kernel = Kernel(_main_body)
            attention.compile_cache[key] = kernel
        kernel(x.detach(), w.view(1, -1) if w_row else w, acc, out, ws, scale, Aux((w,) if aux_tensor else None, (scale,)))
        return out, acc

    pre.compile_cache = {}
    attention.compile_cache = {}
    lib.pre, lib.attention = pre, attention
    return lib


def _expected(x, w, scale):
    acc = x.float().sum(-1)
    return x * w * scale + acc[:, None], acc


def _call(replay, lib, x, w, scale, **kw):
    return replay(("attn", tuple(x.shape), scale, tuple(kw.items())), (x, w),
                  lambda: lib.attention(x, w, scale, **kw))


def test_a_replayed_call_matches_the_whole_call_and_skips_its_host_work():
    lib = _make_library()
    replay = LaunchReplay(compile_cache_owners([lib]))
    assert set(replay.owners) == {lib.pre, lib.attention}
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, generator=gen)
    for i in range(5):
        x = torch.randn(10, 6, generator=gen)
        out, acc = _call(replay, lib, x, w, 0.5)
        want_out, want_acc = _expected(x, w, 0.5)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(acc, want_acc)
    # first call compiles (its launch bypasses the cache: not recorded), the second records, three replay
    assert replay.stats == {"recorded": 1, "replayed": 3, "whole": 2, "refused": 0}
    assert len(lib.selections) == 2
    assert lib.pre.compile_cache and all(not type(c).__name__.startswith("_Recording")
                                         for c in (lib.pre.compile_cache, lib.attention.compile_cache))


@pytest.mark.parametrize("kw, why", [({"clone_input": True}, "aten::clone"),
                                     ({"aux_tensor": True}, "holding tensors")])
def test_a_call_doing_what_a_record_cannot_hold_always_runs_whole(kw, why):
    lib = _make_library()
    replay = LaunchReplay(compile_cache_owners([lib]))
    w = torch.randn(6)
    for _ in range(4):
        x = torch.randn(10, 6)
        out, _ = _call(replay, lib, x, w, 2.0, **kw)
        torch.testing.assert_close(out, _expected(x, w, 2.0)[0])
    assert replay.stats == {"recorded": 0, "replayed": 0, "whole": 4, "refused": 1}
    assert why in replay.last_refusal
    assert len(lib.selections) == 4


def test_a_record_keeps_no_tensor_of_the_call_it_was_made_from():
    lib = _make_library()
    replay = LaunchReplay(compile_cache_owners([lib]))
    w = torch.randn(6)
    _call(replay, lib, torch.randn(64, 6), w, 1.0)  # compiles
    x = torch.randn(64, 6)
    out, acc = _call(replay, lib, x, w, 1.0)  # records
    assert replay.stats["recorded"] == 1
    gone = [weakref.ref(t) for t in (x, out, acc)]
    del x, out, acc
    gc.collect()
    assert all(r() is None for r in gone)


def test_keys_are_recorded_apart_and_the_oldest_is_forgotten_beyond_capacity():
    lib = _make_library()
    replay = LaunchReplay(compile_cache_owners([lib]), capacity=2)
    w = torch.randn(6)
    _call(replay, lib, torch.randn(3, 6), w, 1.0)  # compiles the one kernel pair (keyed by dtype and width)
    for rows in (4, 5, 6, 4):
        for _ in range(2):
            x = torch.randn(rows, 6)
            torch.testing.assert_close(_call(replay, lib, x, w, 1.0)[0], _expected(x, w, 1.0)[0])
    # 4, 5 and 6 recorded then replayed once each; 4 forgotten (capacity 2) by then, so recorded again
    assert replay.stats == {"recorded": 4, "replayed": 4, "whole": 5, "refused": 0}
    assert len(replay.records) == 2


_TOY = _make_library()
_TOY_REPLAY = LaunchReplay(compile_cache_owners([_TOY]))


@torch.library.custom_op("areal_test::toy_attention", mutates_args=(), device_types="cpu")
def _toy_attention(x: torch.Tensor, w: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _call(_TOY_REPLAY, _TOY, x, w, scale)


@_toy_attention.register_fake
def _(x, w, scale):
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32)


def test_replay_works_inside_a_custom_operator_of_a_compiled_function():
    """Where the trainer uses it: an operator's kernel, called from a torch.compile'd layer."""
    f = torch.compile(lambda x, w: torch.ops.areal_test.toy_attention(x * 1.0, w, 0.25)[0] + 1, fullgraph=True)
    w = torch.randn(6)
    for _ in range(4):
        x = torch.randn(12, 6)
        torch.testing.assert_close(f(x, w), _expected(x, w, 0.25)[0] + 1)
    assert _TOY_REPLAY.stats["replayed"] >= 2 and _TOY_REPLAY.stats["refused"] == 0


def test_inputs_sharing_a_storage_are_recorded_apart_from_inputs_that_do_not():
    """The kernel gets a view of w that is not w's own (a row): where w and x share a storage, the record
    places it on that storage's first input, x. Replayed on inputs that share nothing, that would read x's
    storage past its end: the sharing is part of the key, so such a call is recorded anew."""
    lib = _make_library()
    replay = LaunchReplay(compile_cache_owners([lib]))

    def shared():
        buf = torch.randn(66)
        return buf[:60].view(10, 6), buf[60:]

    def apart():
        return torch.randn(10, 6), torch.randn(6)

    for make in (shared, shared, shared, apart, apart, shared, apart):
        x, w = make()
        out, acc = _call(replay, lib, x, w, 0.5, w_row=True)
        want_out, want_acc = _expected(x, w, 0.5)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(acc, want_acc)
    # shared: compiles, records, replays; apart: records, replays; then one replay each
    assert replay.stats == {"recorded": 2, "replayed": 4, "whole": 3, "refused": 0}
