"""Weight transport through CUDA IPC on one host: the trainer writes a policy version into one of two
device buffers, rollout processes on the same GPU serve from it directly, with no copy of their own.

The writer owns two flat ``uint8`` device buffers laid out by ``weights_shm.Layout`` (each tensor at a
64-byte aligned offset, the state dict's order). Each buffer's CUDA IPC handle is exported once, as
plain data (``handles()``: ints, bytes and str, fit for msgpack), and each reader opens both buffers
once (``CudaWeightReader``) and keeps zero-copy views of them for the life of the process. From then on
a new version costs:

    writer   ``write(state_dict, version)``: in-place device copies of the trainer's tensors into the
             free buffer (``torch._foreach_copy_`` on the current stream), waited for with an event,
             returns the location ``cuda:<name>.<k>@<version>`` to announce (VersionAnnounce).
    reader   ``open(location)``: the views of buffer k (a buffer flip: the rollout model's tensors now
             point at the other buffer; nothing is copied or mapped), then ``drain()`` before acking.

Reuse rule: ``weights_shm.BufferLedger``, unchanged. A write never takes the buffer that holds the
latest version, nor one whose version some reader may still serve: the broadcaster calls
``mark_released(v)`` once every reader has acknowledged a version newer than ``v`` (VersionAck), and
until then ``write`` raises ``BufferBusy``. A reader's ack must mean it has left the old buffer on the
device too, not only in Python: kernels it queued may still read it, hence ``drain()`` first.

What a handle holds (``export_handle``), the eight values ``UntypedStorage._share_cuda_()`` returns,
under names; the reader passes them back to ``UntypedStorage._new_shared_cuda`` in the same order:

    device               int    CUDA device index of the allocation (the same index in every process
                                of the host that sees the same devices)
    handle               bytes  cudaIpcMemHandle_t of the allocation block the buffer lives in, as torch
                                serialises it (opaque)
    size                 int    bytes of the buffer (the storage)
    offset               int    bytes from the block's start to the buffer (the caching allocator may
                                place the buffer inside a larger block)
    ref_counter_handle   bytes  name of torch's shared-memory file of IPC reference counts: the writer's
                                allocator keeps the block alive while a reader holds it open
    ref_counter_offset   int    this buffer's slot in that file
    event_handle         bytes  cudaIpcEventHandle_t recorded after the buffer's allocation; the reader
                                waits on it once at open
    event_sync_required  bool   whether that wait is needed

The handles and the layout manifest are the only things that cross a socket, and they are plain
values: no pickle (torch's own ``reduce_tensor`` route pickles a rebuild function).

A reader on another GPU of the host (a rollout worker beside a trainer on one GPU each): the handles
name the writer's GPU by UUID (``uuid``; indices differ between processes with other
CUDA_VISIBLE_DEVICES), and a reader whose own GPU is another one opens the buffers on its own device
(CUDA maps them there as peer memory, ``cudaIpcMemLazyEnablePeerAccess``; the writer's GPU need not be
visible to it) and ``open`` copies the version, one flat copy over NVLink or PCIe, into a buffer of its
own GPU, timed: ``received`` (and ``on_copy``) give the version, bytes and seconds of each copy.

Bucketed writes: ``begin_views(version)`` claims the free buffer and hands out its views to be filled in
place (a sharded trainer gathers its weights into them a bucket at a time, never holding a full copy:
engines/torch_parallel.py), then ``commit(version)`` or ``abort()``; ``write`` is that with one copy.

Limits: readers must be on the writer's host; a handle is valid while the writer process lives. A CUDA
process cannot open its own IPC handles, so readers are other processes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping

import torch

from areal_bus.weights.shm import BufferBusy, BufferLedger, Layout, WeightShmError

__all__ = [
    "BufferBusy", "CudaWeightReader", "CudaWeightWriter", "HANDLE_FIELDS", "device_uuid", "export_handle",
    "make_location", "open_handle", "parse_location",
]

HANDLES_FORMAT = 1
"""Bumped on any incompatible change to the handles dict; a reader refuses other formats."""

HANDLE_FIELDS: tuple[tuple[str, type], ...] = (
    ("device", int), ("handle", bytes), ("size", int), ("offset", int),
    ("ref_counter_handle", bytes), ("ref_counter_offset", int), ("event_handle", bytes),
    ("event_sync_required", bool),
)
"""The names and types of ``UntypedStorage._share_cuda_()``'s eight values, in its order."""

_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
_LOCATION_RE = re.compile(r"cuda:(?P<name>[A-Za-z0-9_.-]+)\.(?P<k>[01])@(?P<version>\d+)")


def make_location(name: str, k: int, version: int) -> str:
    return f"cuda:{name}.{k}@{version}"


def parse_location(location: str) -> tuple[str, int, int]:
    """``cuda:<name>.<k>@<version>`` to ``(name, k, version)``; ValueError on anything else."""
    match = _LOCATION_RE.fullmatch(location)
    if match is None:
        raise ValueError(f"not a CUDA weight location: {location!r}")
    return match["name"], int(match["k"]), int(match["version"])


def handle_to_dict(shared: tuple) -> dict:
    """``_share_cuda_()``'s tuple to a dict of plain values (see the module docstring)."""
    if len(shared) != len(HANDLE_FIELDS):
        raise ValueError(f"expected {len(HANDLE_FIELDS)} values from _share_cuda_, got {len(shared)}")
    out = {}
    for (name, kind), value in zip(HANDLE_FIELDS, shared):
        if kind is bytes and isinstance(value, (bytes, bytearray, memoryview)):
            value = bytes(value)
        elif kind is int and not isinstance(value, bool):
            value = int(value)
        elif kind is bool:
            value = bool(value)
        out[name] = value
    return check_handle(out)


def check_handle(doc: object) -> dict:
    """Validate a handle dict from the wire (types only: whether it opens is CUDA's to say)."""
    if not isinstance(doc, dict) or set(doc) != {n for n, _ in HANDLE_FIELDS}:
        raise ValueError("not a CUDA IPC handle dict")
    for name, kind in HANDLE_FIELDS:
        value = doc[name]
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if not ok or (kind is int and value < 0):
            raise ValueError(f"handle field {name!r}: expected {kind.__name__}, got {value!r:.40}")
    return doc


def handle_args(doc: Mapping) -> tuple:
    """A checked handle dict back to the argument tuple of ``UntypedStorage._new_shared_cuda``."""
    check_handle(dict(doc))
    return tuple(doc[name] for name, _ in HANDLE_FIELDS)


def export_handle(buf: torch.Tensor) -> dict:
    """The CUDA IPC handle of ``buf``'s storage as a plain dict. Call once per buffer: the handle stays
    valid for the storage's life, and every export adds a reference-count slot."""
    if buf.device.type != "cuda":
        raise ValueError(f"only CUDA tensors have IPC handles, not {buf.device}")
    return handle_to_dict(buf.untyped_storage()._share_cuda_())


def open_handle(doc: Mapping) -> torch.Tensor:
    """Open an exported buffer in this (other) process: a flat uint8 tensor over the same device memory."""
    device, _, size, *_ = args = handle_args(doc)
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(*args)
    out = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device))
    return out.set_(storage, 0, (size,), (1,))


def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device ``index``: the same GPU has the same UUID in every process,
    whatever its CUDA_VISIBLE_DEVICES makes of its index."""
    return str(torch.cuda.get_device_properties(index).uuid)


def layout_views(layout: Layout, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors viewing the flat uint8 ``buf`` without copying, one per spec."""
    out = {}
    for s in layout.specs:
        dtype = getattr(torch, s.dtype)
        out[s.name] = buf[s.offset:s.offset + s.nbytes].view(dtype).view(s.shape)
    return out


class CudaWeightWriter:
    """The trainer's side: two device buffers for weight set ``name`` and the ledger of what they hold.

    ``template`` is a state dict (meta tensors will do) or a ``Layout``; every later write must match it.
    ``device`` may be a CPU for tests of the write path; only CUDA buffers can be exported.
    """

    def __init__(self, name: str, template: Mapping[str, torch.Tensor] | Layout, device: str | torch.device = "cuda"):
        if not _NAME_RE.fullmatch(name) or len(name) > 200:
            raise ValueError(f"bad weight set name {name!r}: letters, digits, '_', '-', '.' only")
        self.name = name
        self.layout = template if isinstance(template, Layout) else Layout.from_state_dict(template)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.ledger = BufferLedger(2)
        # Two separate allocations, never resized or freed while the writer lives: readers hold their
        # handles for the life of the process, so these buffers must stay where they are.
        self.buffers = [torch.empty(max(self.layout.nbytes, 1), dtype=torch.uint8, device=self.device) for _ in range(2)]
        self._views = [layout_views(self.layout, b) for b in self.buffers]
        self._handles: dict | None = None

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def handles(self) -> dict:
        """What a reader needs, as plain values (msgpack-safe): format, name, layout manifest, and one
        handle dict per buffer. Exported on the first call, then the same dict every time."""
        if self._handles is None:
            self._handles = {
                "format": HANDLES_FORMAT, "name": self.name, "manifest": self.layout.manifest.decode(),
                "buffers": [export_handle(b) for b in self.buffers],
                "uuid": device_uuid(self.device.index),  # which GPU, for readers that number it otherwise
            }
        return self._handles

    def views(self, k: int) -> dict[str, torch.Tensor]:
        return self._views[k]

    def write(self, state_dict: Mapping[str, torch.Tensor], version: int) -> str:
        """Copy ``state_dict`` into the free buffer as ``version`` and return its location; returns
        once the copy is complete on the device, so the location may be announced at once.
        Raises BufferBusy (nothing written) while that buffer's version is not released."""
        self.layout.check(state_dict)
        dst = list(self.begin_views(version).values())
        try:
            src = [state_dict[s.name] for s in self.layout.specs]
            if all(t.device == self.device for t in src):
                torch._foreach_copy_(dst, src)  # one launch per group of tensors, not per tensor
            else:
                for d, t in zip(dst, src):
                    d.copy_(t, non_blocking=True)
        except BaseException:
            self.abort()
            raise
        return self.commit(version)

    def begin_views(self, version: int) -> dict[str, torch.Tensor]:
        """Claim the free buffer for ``version`` and return its views, to be filled in place (in the
        layout's order or any other) on this device's current stream; then ``commit`` or ``abort``.
        Raises BufferBusy (nothing claimed) while that buffer's version is not released."""
        return self._views[self.ledger.claim(version)]

    def commit(self, version: int) -> str:
        """The views handed out for ``version`` are filled: wait for the copies queued on the current
        stream, then record the version; returns its location, which may be announced at once."""
        if self.device.type == "cuda":
            # Only the copies need to be waited for, not other work the trainer queued elsewhere.
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()
        k = self.ledger.commit(version)
        return make_location(self.name, k, version)

    def abort(self) -> None:
        """Give up the write in progress: its buffer holds nothing valid and may be claimed again."""
        self.ledger.abort()

    def mark_released(self, version: int) -> None:
        """Every reader has left every version <= ``version`` (acked a newer one): its buffer may be reused."""
        self.ledger.mark_released(version)


class CudaWeightReader:
    """A rollout process's side: opens both buffers of a writer once, then switches versions by
    pointing at the other buffer's views, or, on another GPU than the writer's, by copying the version
    into a buffer of its own GPU.

    ``device``: this process's GPU (default: the current one). Handles that name the writer's GPU
    (``uuid``) are opened on it; those of an older writer on the index they carry. ``copy``: copy every
    version into this GPU even on the writer's own (a benchmark of the copy path on one GPU); on another
    GPU it always copies. ``on_copy(version=, nbytes=, seconds=)`` is called after each copy."""

    def __init__(self, handles: Mapping, device: str | torch.device | int | None = None, *, copy: bool = False,
                 on_copy=None):
        if not isinstance(handles, Mapping) or handles.get("format") != HANDLES_FORMAT:
            raise WeightShmError(f"not a CUDA weight handles dict of format {HANDLES_FORMAT}")
        name, bufs = handles.get("name"), handles.get("buffers")
        if not isinstance(name, str) or not isinstance(bufs, (list, tuple)) or len(bufs) != 2:
            raise WeightShmError("CUDA weight handles lack a name or two buffers")
        try:
            self.layout = Layout.from_manifest(handles.get("manifest", ""))
        except (ValueError, TypeError) as exc:
            raise WeightShmError(f"bad manifest: {exc}") from None
        self.name = name
        uuid = handles.get("uuid")
        if uuid is not None and not isinstance(uuid, str):
            raise WeightShmError(f"CUDA weight handles: uuid {uuid!r:.40} is not a string")
        if uuid is None and device is None:  # an older writer's handles: open them where they say
            self.peer = False
        else:
            own = _own_device(device)
            # On another GPU the buffers are opened on this one, as peer memory (see the module docstring).
            self.peer = uuid is not None and device_uuid(own.index) != uuid
            bufs = [{**b, "device": own.index} for b in bufs]
        self.buffers = [open_handle(b) for b in bufs]
        if any(b.numel() < self.layout.nbytes for b in self.buffers):
            raise WeightShmError("a CUDA weight buffer is smaller than its layout")
        self.device = self.buffers[0].device
        self._views = [layout_views(self.layout, b) for b in self.buffers]
        self.copies = self.peer or copy
        # One buffer of this GPU holds the copied version: the engines copy a version into their own
        # parameters when they swap, so its views are needed only until the next ``open``.
        self.local: torch.Tensor | None = None  # that buffer (flat uint8), when copying
        self._local_views: dict[str, torch.Tensor] | None = None
        if self.copies:
            self.local = torch.empty(max(self.layout.nbytes, 1), dtype=torch.uint8, device=self.device)
            self._local_views = layout_views(self.layout, self.local)
        self.on_copy = on_copy
        self.received: tuple[int, int, float] | None = None  # (version, bytes, seconds) of the last copy
        self.serving: int | None = None

    def views(self, k: int) -> dict[str, torch.Tensor]:
        return self._views[k]

    def open(self, location: str) -> dict[str, torch.Tensor]:
        """The views of the buffer ``location`` names: the flip, or the copy into this GPU (views valid
        until the next ``open``). The caller trusts the announcement (the writer committed the version
        before announcing it; the ledger keeps it there until this reader acks a newer one)."""
        name, k, version = parse_location(location)
        if name != self.name:
            raise ValueError(f"location {location!r} is not of weight set {self.name!r}")
        if self.local is not None:
            n = self.layout.nbytes
            # On the current stream, after whatever still reads the local buffer (the last swap's copies):
            # waited for first, so that the time is the copy's alone.
            stream = torch.cuda.current_stream(self.device)
            stream.synchronize()
            t0 = time.perf_counter()
            self.local[:n].copy_(self.buffers[k][:n], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
            done.synchronize()  # whole before the caller serves it (and before it acks the writer's buffer)
            self.received = (version, n, time.perf_counter() - t0)
            if self.on_copy is not None:
                self.on_copy(version=version, nbytes=n, seconds=self.received[2])
            self.serving = version
            return self._local_views
        self.serving = version
        return self._views[k]

    def drain(self) -> None:
        """Wait for every kernel this process queued on the device, so none still reads the buffer it
        has left. Call before acking a version."""
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self._views.clear()
        self.buffers.clear()
        self.local = self._local_views = None


def _own_device(device) -> torch.device:
    """This process's GPU as a ``cuda:<index>`` device: ``device`` (an index, "cuda", "cuda:k"), or the
    current one."""
    torch.cuda._lazy_init()
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"a CUDA weight reader needs a CUDA device, not {device!r}")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


# -- how the nodes meet: the handles travel once, as a file beside the run's ipc sockets ----------

def handles_path(ipc_dir, name: str):
    """Where the trainer leaves its writer's handles for the rollout workers of the same host (CUDA IPC
    is same-host only, like the ipc sockets in that folder)."""
    from pathlib import Path

    return Path(ipc_dir) / f"{name}.cuda-handles"


def save_handles(path, handles: Mapping) -> None:
    """msgpack, written to a temp name and renamed, so a reader never sees half a file."""
    import os

    import msgpack

    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(msgpack.packb(dict(handles), use_bin_type=True))
    os.replace(tmp, path)


def load_handles(path) -> dict:
    import msgpack

    try:
        with open(path, "rb") as f:
            doc = msgpack.unpackb(f.read(), raw=False)
    except (OSError, ValueError, msgpack.ExtraData) as exc:
        raise WeightShmError(f"cannot read CUDA weight handles at {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise WeightShmError(f"{path} holds no CUDA weight handles")
    return doc
