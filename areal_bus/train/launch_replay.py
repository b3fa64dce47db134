"""Replaying a kernel library's launches without its per-call host work.

flash-attn-4's entry points (``_flash_attn_fwd``, ``_flash_attn_bwd``: CuTe DSL kernels behind tvm-ffi) select
a configuration, validate every argument, build a compile key and an argument list on every call: 0.22 ms
of host time per forward on an H100 through the trainer's operator, where torch's FlashAttention-2 takes
0.14 ms (0.06 ms replayed; bench/RESULTS.md). The trainer calls attention ~384 times per update (24
layers x 10 forwards and 6 backwards at the 0.5B shape) and its update has no host time to spare, so
FlashAttention-4's faster kernels made the forwards host-bound
(bench/RESULTS.md, "Why FlashAttention-4 does not pay in every process"). Yet within one micro-batch all
24 layers call attention with the same shapes, lengths and scalars: the host's decisions are the same.

``LaunchReplay`` records, per key of the facts a call's host decisions rest on (the caller builds it:
shapes, strides, dtypes, scalars), what one real call did, in order: the tensors it allocated (empty or
zero-filled, with their sizes and strides) and the compiled kernels it launched, with each argument
placed as an input of the call, a tensor the call allocated, or a constant. A later call with the same
key runs that record against its own inputs: the same allocations and launches, none of the selection.

A record is kept only where the whole call is visible:

* every tensor operation outside a launch must be an allocation, a zero fill or a view (a
  ``TorchDispatchMode`` watches); anything else (a copy, arithmetic, a read back to the host) refuses the
  key, whose calls then always run whole;
* every kernel launch must go through one of the library's compile caches (the ``compile_cache``
  attribute of its functions, swapped for a recording one during the call); a call that compiles a
  kernel is not recorded (the library launches a fresh compile from a local variable), the next one is;
* every tensor argument must be an input or something the call allocated; containers holding tensors are
  refused.

Every other argument is replayed as the recording call passed it, so whatever the host decisions rest on
must be in the key. The CUDA stream is not among the arguments for flash-attn-4 (4.0.0b40): its kernels
are compiled with tvm-ffi's environment stream and take torch's current stream at each launch, replayed
or not. A library that passed its stream as an argument would need the stream in the key.

What the record holds is descriptions, never the recording call's tensors (a record must not keep a
micro-batch's activations alive). Records are kept for the last ``capacity`` keys. Not thread-safe: the
compile caches are swapped while a call records (the trainer calls attention from one thread).

Written by hand: no library caches these entry points, and CUDA graphs (torch's) need fixed shapes where
packed micro-batches change shape every call.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALLOCATIONS = {
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
}
_ZERO_ALLOCATIONS = {"aten::zeros", "aten::zeros_like", "aten::new_zeros"}


class Refused(Exception):
    """What the call did cannot be replayed (the message says why)."""


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _view(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


def _holds_tensor(value, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth > 3:
        return False
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v, depth + 1) for v in value.values())
    return any(_holds_tensor(v, depth + 1) for v in getattr(value, "__dict__", {}).values())


class _Log:
    """One recorded call, in order: ("alloc", j, shape, stride, dtype, device), ("zero", spec) and
    ("launch", fn, arg specs, kwarg specs), each tensor placed as it stood at that moment."""

    def __init__(self, inputs: Sequence[torch.Tensor | None]):
        self.events: list = []
        self.inputs: dict[int, list] = {}  # storage pointer -> [(input index, view)] (views may share one)
        self.allocs: dict[int, int] = {}  # storage pointer -> allocation index (the latest there)
        self.count = 0
        self.compiled = False
        self.in_launch = 0
        self.refused: str | None = None
        for i, t in enumerate(inputs):
            if t is None:
                continue
            if t.numel() == 0:
                self.refused = "an empty input"
            self.inputs.setdefault(_storage(t), []).append((i, _view(t)))

    def place(self, value):
        """An argument as the replay rebuilds it: ("const", v), ("in", i, view) or ("tmp", j, view)."""
        if isinstance(value, torch.Tensor):
            ptr = _storage(value)
            if ptr in self.inputs:
                view = _view(value)
                views = self.inputs[ptr]
                return ("in", next((i for i, v in views if v == view), views[0][0]), view)
            if ptr in self.allocs:
                return ("tmp", self.allocs[ptr], _view(value))
            raise Refused("a tensor neither an input nor allocated in the call")
        if _holds_tensor(value):
            raise Refused(f"a {type(value).__name__} holding tensors among the kernel arguments")
        return ("const", value)

    def launched(self, fn, args, kwargs) -> None:
        if self.refused:
            return
        try:
            self.events.append(("launch", fn, tuple(self.place(a) for a in args),
                                {k: self.place(v) for k, v in kwargs.items()}))
        except Refused as why:
            self.refused = str(why)


class _Watch(TorchDispatchMode):
    """Sees every tensor operation of the recorded call outside its launches."""

    def __init__(self, log: _Log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        log = self.log
        if log.in_launch or log.refused:
            return out
        name = func._schema.name
        if name in _ALLOCATIONS or name in _ZERO_ALLOCATIONS:
            if not isinstance(out, torch.Tensor) or out.numel() == 0 or out.storage_offset() != 0:
                log.refused = "an empty or offset allocation"
                return out
            log.allocs[_storage(out)] = log.count
            log.events.append(("alloc", log.count, tuple(out.shape), tuple(out.stride()), out.dtype, out.device))
            if name in _ZERO_ALLOCATIONS:
                log.events.append(("zero", ("tmp", log.count, _view(out))))
            log.count += 1
        elif name == "aten::zero_" or (name == "aten::fill_" and not isinstance(args[1], torch.Tensor)
                                       and args[1] == 0):
            try:
                spec = log.place(args[0])
            except Refused as why:
                log.refused = str(why)
                return out
            if spec[0] != "tmp":
                log.refused = f"{name} of an input"
            else:
                log.events.append(("zero", spec))
        elif not func.is_view:
            log.refused = f"tensor operation {name} outside a kernel launch"
        return out


class _RecordingKernel:
    def __init__(self, fn, log: _Log):
        self.fn, self.log = fn, log

    def __call__(self, *args, **kwargs):
        self.log.launched(self.fn, args, kwargs)
        self.log.in_launch += 1
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.log.in_launch -= 1

    def __getattr__(self, name):
        return getattr(self.fn, name)


class _RecordingCache:
    """Stands in for one compile cache while a call records: launches through it are logged."""

    def __init__(self, inner, log: _Log):
        self.inner, self.log = inner, log

    def __contains__(self, key) -> bool:
        return key in self.inner

    def __getitem__(self, key):
        return _RecordingKernel(self.inner[key], self.log)

    def get(self, key, default=None):
        fn = self.inner.get(key)
        return default if fn is None else _RecordingKernel(fn, self.log)

    def __setitem__(self, key, fn) -> None:
        self.log.compiled = True
        self.inner[key] = fn

    def __getattr__(self, name):
        return getattr(self.inner, name)


def compile_cache_owners(modules: Sequence[Any]) -> list:
    """The functions of ``modules`` that carry a ``compile_cache`` (flash-attn-4's convention)."""
    owners = []
    for module in modules:
        for value in vars(module).values():
            cache = getattr(value, "compile_cache", None)
            if callable(value) and cache is not None and hasattr(cache, "get") and value not in owners:
                owners.append(value)
    return owners


class _Record:
    """One call's allocations, zero fills and launches, as descriptions (no tensor of the call)."""

    def __init__(self, log: _Log, result):
        if log.refused:
            raise Refused(log.refused)
        if not any(ev[0] == "launch" for ev in log.events):
            raise Refused("no kernel launch went through the compile caches")
        if not isinstance(result, tuple):
            raise Refused("the call's result is not a tuple")
        self.steps = log.events
        self.result = tuple(log.place(r) for r in result)
        self.n_allocs = log.count

    def replay(self, inputs: Sequence[torch.Tensor | None]) -> tuple:
        tmps: list = [None] * self.n_allocs
        for step in self.steps:
            kind = step[0]
            if kind == "launch":
                _, fn, args, kwargs = step
                fn(*(_build(a, inputs, tmps) for a in args), **{k: _build(v, inputs, tmps) for k, v in kwargs.items()})
            elif kind == "alloc":
                _, j, shape, stride, dtype, device = step
                tmps[j] = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            else:
                _build(step[1], inputs, tmps).zero_()
        return tuple(_build(r, inputs, tmps) for r in self.result)


def _build(spec, inputs, tmps):
    kind = spec[0]
    if kind == "const":
        return spec[1]
    t = inputs[spec[1]] if kind == "in" else tmps[spec[1]]
    shape, stride, offset = spec[2]
    if t.shape == shape and t.stride() == stride and t.storage_offset() == offset:
        return t
    return t.as_strided(shape, stride, offset)


class LaunchReplay:
    """Calls ``run`` whole once per key, then replays what it did (see the module docstring).

    ``owners``: the library's functions whose ``compile_cache`` its launches go through."""

    def __init__(self, owners: Sequence[Any], capacity: int = 64):
        self.owners = list(owners)
        self.capacity = capacity
        self.records: OrderedDict[Any, _Record | None] = OrderedDict()
        self.stats = {"recorded": 0, "replayed": 0, "whole": 0, "refused": 0}
        self.last_refusal: str | None = None

    def __call__(self, key, inputs: Sequence[torch.Tensor | None], run: Callable[[], tuple]) -> tuple:
        """``run()`` makes the library's call on ``inputs`` and returns a tuple of tensors (or None). Equal
        keys must mean equal host decisions: the caller puts in the key every fact they rest on (which
        inputs share a storage is added here)."""
        inputs = [t.detach() if t is not None and t.requires_grad else t for t in inputs]
        # Which inputs share a storage is part of the key: a record places a view it cannot match to an
        # input's own view on the first input of its storage, which holds only where the sharing is the same.
        ptrs = [None if t is None else _storage(t) for t in inputs]
        key = (key, tuple(ptrs.index(p) for p in ptrs))
        if key in self.records:
            record = self.records[key]
            self.records.move_to_end(key)
            if record is not None:
                self.stats["replayed"] += 1
                return record.replay(inputs)
            self.stats["whole"] += 1
            return run()
        log = _Log(inputs)
        saved = [owner.compile_cache for owner in self.owners]
        for owner, cache in zip(self.owners, saved):
            owner.compile_cache = _RecordingCache(cache, log)
        try:
            with _Watch(log):
                result = run()
        finally:
            for owner, cache in zip(self.owners, saved):
                owner.compile_cache = cache
        self.stats["whole"] += 1
        if log.compiled:
            return result  # a fresh compile is launched from a local variable, unseen: record the next call
        try:
            self.records[key] = _Record(log, result)
            self.stats["recorded"] += 1
        except Refused as why:
            self.records[key] = None
            self.stats["refused"] += 1
            self.last_refusal = str(why)
        if len(self.records) > self.capacity:
            self.records.popitem(last=False)
        return result
