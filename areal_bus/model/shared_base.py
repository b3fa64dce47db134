"""One copy of the frozen base: with LoRA the trainer and the rollout engines of its device read the same
base weights (``model.share_base``), and only the adapter moves per version.

With ``trainer_engine.lora`` the base never changes in a run (areal_bus/train/lora.py freezes it; every
version is an adapter, areal_bus/model/adapters.py). So the trainer puts its base, once, into one buffer that
the rollout engines map instead of loading a copy of their own:

* on a GPU, one device allocation of the trainer's, exported by CUDA IPC (``weights/cuda.export_handle``;
  the handle travels as ``<ipc_dir>/<name>.base-handles``, beside the per-version handles file);
* on CPU, one shared-memory segment ``/dev/shm/<name>.base`` (``weights/layout.create_segment``), which
  readers map read-only.

The buffer is laid out fused: each layer's q/k/v projections are one ``self_attn.qkv_proj`` tensor (rows q,
then k, then v; weight and bias) and its gate/up one ``mlp.gate_up_proj`` (``fused_layout``). The trainer's
q, k, v, gate and up parameters become row slices of those (``split``: views, frozen, so no optimizer or
gradient sees the difference), the rollout model's too, and the engine's fused decode step
(engines/cuda_decode.py) takes the fused tensor itself (``fused_rows``: a view when its parts are consecutive
rows of one buffer) where it would otherwise concatenate a second copy. One copy of the base on the card:
what the trainer holds is what every engine reads.

When: ``model.share_base: true``, or left out on a GPU where it can (``enabled``), which needs all of:
trainer_engine.lora, the torch engines on both sides, one trainer process (train_workers 1) and the trainer on
model.device (``refusal`` names what is missing). Its CUDA IPC path ran on one H100 in the 8B system of
2026-12-06 (one copy of the base: the card's peak 39 GiB with trainer and rollout on it, bench/RESULTS.md); on
CPU it is opt-in (it saves RAM), and CI tests the mechanism through it. A rollout replica on a host without
shared memory with the trainer, or on another GPU, loads its own copy.

Order: a rollout worker that shares waits (``WAIT_S``) for the trainer to publish the base, which it does
right after loading it; the buffer names the base (``identity``: model.path's files and model.dtype), so a
leftover of an earlier run of another base is never taken.

Quick check::

    python -c "from areal_bus.model.modeling import *; from areal_bus.model import shared_base as sb
    print(sb.fused_layout(param_shapes(TINY_QWEN2), 'float32').specs[1])"
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from areal_bus.config import placement
from areal_bus.weights.layout import (H_SEQ, H_VERSION, SHM_DIR, Layout, MappedSegment, TensorSpec, WeightShmError,
                                      create_segment)

GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
)
"""(submodule, fused name, its projections in row order): the matmuls the engine's decode step fuses."""

WAIT_S = 900.0
"""How long a rollout worker waits for the trainer to publish the base: the trainer loads the model first
(a minute or more for an 8B base from a cold disk), and both start at once."""
POLL_S = 0.5

HANDLES_FORMAT = 1

_MEMBER = {proj: (holder, fused, i) for holder, fused, projs in GROUPS for i, proj in enumerate(projs)}


# -- the fused layout ----------------------------------------------------------------------------

def _parse(name: str) -> tuple[str, str, int, str] | None:
    """"model.layers.3.self_attn.k_proj.weight" -> ("model.layers.3.self_attn", "qkv_proj", 1, "weight")."""
    parts = name.split(".")
    if len(parts) < 3 or parts[-2] not in _MEMBER or parts[-3] != _MEMBER[parts[-2]][0]:
        return None
    _, fused, index = _MEMBER[parts[-2]]
    return ".".join(parts[:-2]), fused, index, parts[-1]


def fuse_plan(shapes: list[tuple[str, tuple[int, ...]]]) -> tuple[list[tuple[str, tuple[int, ...]]], dict]:
    """(fused (name, shape) list, in the order of ``shapes`` with each group at its first member;
    {Hugging Face name: (fused name, first row, last row + 1)} of the grouped ones)."""
    out: list[tuple[str, tuple[int, ...]]] = []
    where: dict[str, tuple[str, int, int]] = {}
    groups: dict[str, list[tuple[int, str, tuple[int, ...]]]] = {}
    order: list[str] = []
    for name, shape in shapes:
        parsed = _parse(name)
        if parsed is None:
            order.append(name)
            out.append((name, tuple(shape)))
            continue
        prefix, fused, index, kind = parsed
        key = f"{prefix}.{fused}.{kind}"
        if key not in groups:
            groups[key] = []
            order.append(key)
            out.append((key, ()))
        groups[key].append((index, name, tuple(shape)))
    final = []
    for key, shape in out:
        if key not in groups:
            final.append((key, shape))
            continue
        members = sorted(groups[key])
        rows = 0
        for _, name, s in members:
            where[name] = (key, rows, rows + s[0])
            rows += s[0]
        final.append((key, (rows, *members[0][2][1:])))
    return final, where


def fused_layout(shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype | str) -> Layout:
    """The buffer's layout for a base of these (Hugging Face name, shape) pairs, every tensor in ``dtype``."""
    dtype = getattr(torch, str(dtype).removeprefix("torch.")) if not isinstance(dtype, torch.dtype) else dtype
    fused, _ = fuse_plan(shapes)
    return Layout.from_state_dict({name: torch.empty(shape, dtype=dtype, device="meta") for name, shape in fused})


def split(fused: Mapping[str, torch.Tensor], shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """{Hugging Face name: tensor} viewing the fused buffer's tensors (row slices: no copy)."""
    _, where = fuse_plan(shapes)
    out = {}
    for name, _ in shapes:
        if name in where:
            key, a, b = where[name]
            out[name] = fused[key][a:b]
        else:
            out[name] = fused[name]
    return out


def fused_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` -- or, when the parts already are consecutive rows of one buffer (a shared base),
    the view of those rows, with no copy. The engine's decode step fuses q/k/v and gate/up through this."""
    first = parts[0]
    if _consecutive(parts):
        return first.as_strided((sum(p.shape[0] for p in parts), *first.shape[1:]), first.stride(),
                                first.storage_offset())
    return torch.cat(parts)


def _consecutive(parts: list[torch.Tensor]) -> bool:
    first = parts[0]
    if not all(p.is_contiguous() and p.dtype == first.dtype and p.device == first.device
               and p.shape[1:] == first.shape[1:] for p in parts):
        return False
    if len({p.untyped_storage().data_ptr() for p in parts}) != 1:
        return False
    return all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in zip(parts, parts[1:]))


# -- when, and what names the base -----------------------------------------------------------------

def _same_device(a: str, b: str) -> bool:
    norm = lambda d: "cuda:0" if d == "cuda" else d
    return norm(a) == norm(b)


def refusal(topo) -> str | None:
    """Why this topology cannot share the base (a sentence naming the field), or None when it can."""
    lora = getattr(topo.trainer_engine, "lora", None)
    if lora is None:
        return "it needs trainer_engine.lora (with full fine-tuning every version moves every weight)"
    if topo.rollout_engine.kind != "torch" or topo.trainer_engine.kind != "torch":
        return "it needs rollout_engine.kind and trainer_engine.kind 'torch'"
    if topo.train_workers != 1:
        return f"train_workers is {topo.train_workers}: a sharded trainer holds no whole base to share"
    if not _same_device(topo.trainer_device, topo.model.device):
        return (f"the trainer is on {topo.trainer_device}, the rollout engines on model.device "
                f"{topo.model.device}: only processes on one device can share its memory")
    return None


def enabled(topo) -> bool:
    """Whether the run shares the base: model.share_base as set, or, left out (None), on a GPU wherever
    ``refusal`` finds nothing against it (measured there: the 8B system on one H100, bench/RESULTS.md), and off
    on CPU, where a second copy costs host memory only."""
    asked = getattr(topo.model, "share_base", None)
    if asked is not None:
        return bool(asked)
    return topo.model.device.startswith("cuda") and refusal(topo) is None


def shares(topo, replica: int) -> bool:
    """Whether rollout replica ``replica`` serves the trainer's base: the run shares it (``enabled``) and the
    replica runs on the trainer's host and GPU (or both on the CPU). Raises ValueError naming the field
    when model.share_base is true and the topology cannot share (``refusal``)."""
    if not enabled(topo):
        return False
    why = refusal(topo)
    if why is not None:
        raise ValueError(f"model.share_base is true, but {why}: leave model.share_base out (or false)")
    if placement.host_of(topo, "rollout", replica) != placement.host_of(topo, "trainer"):
        return False
    if not topo.model.device.startswith("cuda"):
        return True
    return _gpu(topo, "rollout", replica, topo.model.device) == _gpu(topo, "trainer", 0, topo.trainer_device)


def _gpu(topo, kind: str, replica: int, device: str) -> int:
    """The GPU a program of ``kind`` runs on: its entry of nodes.<kind>.gpus, else the index of ``device``."""
    own = placement.gpus_of(topo, kind, replica)
    return own[0] if own else (int(device.split(":")[1]) if ":" in device else 0)


def identity(path: str | Path, dtype: str) -> int:
    """A 62-bit number naming the base: its safetensors files (names, sizes, mtimes) and the dtype. Cheap
    (no bytes read), so a worker can tell the trainer's buffer of this base from an old run's."""
    h = hashlib.sha256(str(dtype).encode())
    for f in sorted(Path(path).glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return int.from_bytes(h.digest()[:8], "little") >> 2


def segment_file(name: str) -> str:
    return os.path.join(SHM_DIR, f"{name}.base")


def handles_file(ipc_dir, name: str) -> Path:
    return Path(ipc_dir) / f"{name}.base-handles"


# -- the trainer's side -------------------------------------------------------------------------

def _hf_name(name: str) -> str:
    return name.replace(".base_layer.", ".")  # peft's LoRA layer keeps the projection as .base_layer


class SharedBase:
    """The trainer's published base: ``publish`` makes it, the trainer's frozen parameters then view it.
    Keep the object for the life of the process (on a GPU the allocation is what the handle exports)."""

    def __init__(self, layout: Layout, views: dict[str, torch.Tensor], nbytes: int, where: str, owner=None):
        self.layout, self.views, self.nbytes, self.where, self._owner = layout, views, nbytes, where, owner

    def close(self) -> None:
        if self.where.startswith(SHM_DIR):
            try:
                os.unlink(self.where)
            except FileNotFoundError:
                pass


@torch.no_grad()
def publish(model: torch.nn.Module, name: str, ident: int, ipc_dir=None) -> SharedBase:
    """Put the frozen (non-adapter) parameters of the trainer's ``model`` into one fused buffer on their
    device and make them views of it, in place. On CPU a shared-memory segment; on a GPU one allocation
    whose CUDA IPC handle is saved in ``ipc_dir``. Returns the SharedBase (keep it)."""
    params = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    if not params:
        raise ValueError("model.share_base: the model has no frozen parameters (is trainer_engine.lora set?)")
    shapes = [(_hf_name(n), tuple(p.shape)) for n, p in params]
    dtype, device = params[0][1].dtype, params[0][1].device
    if any(p.dtype != dtype or p.device != device for _, p in params):
        raise ValueError("model.share_base: the frozen base must be in one dtype on one device")
    layout = fused_layout(shapes, dtype)
    if device.type == "cuda":
        # lazy: CUDA IPC only where the trainer is on a GPU
        from areal_bus.weights.cuda import export_handle, layout_views, save_handles

        buf = torch.empty(max(layout.nbytes, 1), dtype=torch.uint8, device=device)
        fused = layout_views(layout, buf)
        owner = buf
    else:
        seg = create_segment(segment_file(name), layout)
        fused = seg.views()
        owner = seg
    views = split(fused, shapes)
    for (n, p), (hf, _) in zip(params, shapes):
        views[hf].copy_(p.data)
        p.data = views[hf]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        path = handles_file(ipc_dir, name)
        save_handles(path, {"format": HANDLES_FORMAT, "identity": ident, "manifest": layout.manifest.decode(),
                            "buffer": export_handle(buf)})
        torch.cuda.empty_cache()  # the base's old copy goes back to the card, not only to the allocator's cache
        where = str(path)
    else:
        seg.header[H_VERSION] = ident
        seg.header[H_SEQ] = 2  # even and past 0, written last: the base is whole
        where = segment_file(name)
    return SharedBase(layout, views, layout.nbytes, where, owner)


# -- the rollout engine's side --------------------------------------------------------------------

def open_base(name: str, ident: int, shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, device,
              ipc_dir=None, wait_s: float = WAIT_S, log=None) -> dict[str, torch.Tensor]:
    """{Hugging Face name: tensor} viewing the trainer's published base (read-only on CPU), waiting up to
    ``wait_s`` for it to appear. Raises WeightShmError naming what was found when it does not, or when
    the trainer's base is not this worker's model (another shape or dtype)."""
    want = fused_layout(shapes, dtype)
    deadline, told = time.monotonic() + wait_s, False
    while True:
        found = _try_open(name, ident, want, torch.device(device), ipc_dir)
        if isinstance(found, dict):
            return split(found, shapes)
        if time.monotonic() > deadline:
            raise WeightShmError(f"model.share_base: the trainer did not publish the base within {wait_s:.0f} s "
                                 f"({found}); is the trainer running with trainer_engine.lora on this device?")
        if log is not None and not told:
            log.info("waiting_for_base", detail=found)
            told = True
        time.sleep(POLL_S)


def _try_open(name: str, ident: int, want: Layout, device: torch.device, ipc_dir):
    """The fused views, or a sentence saying why not yet."""
    if device.type == "cuda":
        # lazy: CUDA IPC only where the rollout engine is on a GPU
        from areal_bus.weights.cuda import layout_views, load_handles, open_handle

        path = handles_file(ipc_dir, name)
        if not path.exists():
            return f"no {path} yet"
        doc = load_handles(path)
        if doc.get("format") != HANDLES_FORMAT or doc.get("identity") != ident:
            return f"{path} is another base's (an earlier run's?)"
        _check_layout(Layout.from_manifest(doc["manifest"]), want)
        buf = open_handle(doc["buffer"])
        if device.index is None:  # "cuda": this process's current GPU
            device = torch.device("cuda", torch.cuda.current_device())
        if buf.device != device:
            raise WeightShmError(f"model.share_base: the trainer's base is on {buf.device}, this engine on {device}")
        return layout_views(want, buf)
    path = segment_file(name)
    if not os.path.exists(path):
        return f"no {path} yet"
    seg = MappedSegment(path, writable=False)
    state = seg.committed()
    if state is None or state[1] != ident:
        return f"{path} is being written, or is another base's (an earlier run's?)"
    _check_layout(seg.layout, want)
    return seg.views()  # the views hold the mapping: it lives as long as the model's tensors


def _check_layout(have: Layout, want: Layout) -> None:
    if have.manifest != want.manifest:
        diff = next(((a, b) for a, b in zip(have.specs, want.specs) if a != b), None)
        raise WeightShmError(f"model.share_base: the trainer's base does not match this rollout model "
                             f"({_spec(diff[0]) if diff else len(have.specs)} vs {_spec(diff[1]) if diff else len(want.specs)})")


def _spec(s: TensorSpec) -> str:
    return f"{s.name} {s.dtype} {list(s.shape)}"


def held_bytes(model: torch.nn.Module, shared: Mapping[str, torch.Tensor] | None = None,
               fast=None) -> tuple[int, int]:
    """(bytes of weights this process holds itself, bytes it maps from the trainer's base): the model's
    parameters and buffers, and the fused q/k/v and gate/up tensors of its decode step (``fast``, a
    cuda_decode.StaticDecoder) where they are copies."""
    mapped_ptrs = {t.untyped_storage().data_ptr() for t in (shared or {}).values()}
    tensors = list(model.parameters()) + list(model.buffers())
    if fast is not None:
        tensors += [t for t in (*fast.w_qkv, *fast.b_qkv, *fast.w_gate_up) if t is not None]
    held = mapped = 0
    seen = set()
    for t in tensors:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        n = t.numel() * t.element_size()
        if t.untyped_storage().data_ptr() in mapped_ptrs:
            mapped += n
        else:
            held += n
    return held, mapped
