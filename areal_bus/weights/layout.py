"""The shared-memory weight segment's format: its header words, the JSON manifest of the state dict's
layout (``Layout``), the location strings that name a version in a buffer, and one mapped segment
(``MappedSegment``). The double-buffer protocol over two such segments is ``areal_bus/weights/shm.py``'s.

    [0, 64)              header: 8 int64 words, see ``H_*`` below
    [64, 64 + m)         manifest: JSON, the layout of the state dict (name, dtype, shape, offset, nbytes)
    [data_offset, ...)   tensor bytes, each tensor at a 64-byte aligned offset (data_offset is page aligned)

No pickle anywhere: the manifest is JSON.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

SHM_DIR = "/dev/shm"
"""Where segments live: tmpfs, so they are RAM and vanish on reboot; named files (not anonymous
memory) so that a process that was never forked from the writer can map them by name."""

ALIGN = 64
"""Tensor offsets are multiples of a cache line: no tensor shares a line with another, and every dtype
(up to float64) is naturally aligned for vectorised copies and for torch views."""

MAGIC = int.from_bytes(b"ARLWSHM1", "little")
FORMAT = 1
"""Bumped on any incompatible change to the header or manifest; a reader refuses other formats."""

HEADER_BYTES = 64

# Header words (int64). SEQ is odd while a write is in progress; VERSION is -1 until the first commit.
H_MAGIC, H_SEQ, H_VERSION, H_DATA_OFFSET, H_DATA_NBYTES, H_MANIFEST_LEN, H_LAYOUT_CRC, H_FORMAT = range(8)

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")
}
_DTYPE_NAMES = {dt: name for name, dt in _DTYPES.items()}
_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
_LOCATION_RE = re.compile(r"shm:(?P<name>[A-Za-z0-9_.-]+)\.(?P<k>[01])@(?P<version>\d+)")


class WeightShmError(RuntimeError):
    """Base of every error this module raises on purpose."""


class BufferBusy(WeightShmError):
    """The buffer a write would overwrite still holds a version some reader has not acknowledged
    leaving. Wait for acks (``mark_released``) and write again."""


class VersionUnavailable(WeightShmError):
    """A location can no longer be opened: a newer version took its buffer, or a write is in progress
    there. The reader should switch to the latest announced location instead."""


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # from the start of the data region
    nbytes: int


class Layout:
    """Where each tensor of a state dict lives in a buffer, in the state dict's order."""

    def __init__(self, specs: list[TensorSpec]):
        self.specs = tuple(specs)
        self.by_name = {s.name: s for s in self.specs}
        if len(self.by_name) != len(self.specs):
            raise ValueError("duplicate tensor name in layout")
        self.nbytes = max((s.offset + s.nbytes for s in self.specs), default=0)
        self.manifest = json.dumps(
            {"format": FORMAT, "tensors": [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.specs]},
            separators=(",", ":"),
        ).encode()
        self.crc = zlib.crc32(self.manifest)

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor]) -> Layout:
        """Shapes and dtypes only: meta tensors (``device="meta"``) make a fine template."""
        specs, offset = [], 0
        for name, t in state_dict.items():
            dname = _DTYPE_NAMES.get(t.dtype)
            if dname is None:
                raise ValueError(f"{name}: dtype {t.dtype} is not supported in shared memory")
            nbytes = t.numel() * t.element_size()
            specs.append(TensorSpec(name, dname, tuple(t.shape), offset, nbytes))
            offset = _align(offset + nbytes, ALIGN)
        return cls(specs)

    @classmethod
    def from_manifest(cls, raw: bytes | str) -> Layout:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("tensors"), list):
            raise ValueError("not a weight manifest of this format")
        specs = []
        for entry in doc["tensors"]:
            name, dname, shape, offset, nbytes = entry
            if dname not in _DTYPES or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"bad manifest entry for {name!r}")
            if math.prod(shape) * _DTYPES[dname].itemsize != nbytes or offset % ALIGN:
                raise ValueError(f"inconsistent manifest entry for {name!r}")
            specs.append(TensorSpec(name, dname, tuple(shape), offset, nbytes))
        layout = cls(specs)
        if layout.manifest != (raw.encode() if isinstance(raw, str) else bytes(raw)):
            raise ValueError("manifest is not in canonical form")
        return layout

    def check(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Raise ValueError naming the first tensor that does not fit this layout."""
        if len(state_dict) != len(self.specs):
            missing = sorted(set(self.by_name) - set(state_dict))[:3]
            extra = sorted(set(state_dict) - set(self.by_name))[:3]
            raise ValueError(f"state dict does not match layout: missing {missing}, unexpected {extra}")
        for s in self.specs:
            t = state_dict.get(s.name)
            if t is None:
                raise ValueError(f"state dict lacks {s.name!r}")
            if tuple(t.shape) != s.shape or _DTYPE_NAMES.get(t.dtype) != s.dtype:
                raise ValueError(f"{s.name}: {t.dtype} {tuple(t.shape)} does not match layout {s.dtype} {s.shape}")

    def views(self, buf, data_offset: int) -> dict[str, torch.Tensor]:
        """Tensors viewing ``buf`` (an mmap) without copying, one per spec."""
        out = {}
        with warnings.catch_warnings():
            # Readers map read-only on purpose (see ShmWeightReader); torch warns about that each time.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for s in self.specs:
                dtype = _DTYPES[s.dtype]
                if s.nbytes == 0:  # frombuffer refuses a zero count; an empty tensor views nothing anyway
                    out[s.name] = torch.empty(s.shape, dtype=dtype)
                    continue
                count = s.nbytes // dtype.itemsize
                out[s.name] = torch.frombuffer(buf, dtype=dtype, count=count, offset=data_offset + s.offset).view(s.shape)
        return out


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# ---------------------------------------------------------------------------------------------
# Locations and segments
# ---------------------------------------------------------------------------------------------


def make_location(name: str, k: int, version: int) -> str:
    return f"shm:{name}.{k}@{version}"


def parse_location(location: str) -> tuple[str, int, int]:
    """``shm:<name>.<k>@<version>`` to ``(name, k, version)``; ValueError on anything else."""
    match = _LOCATION_RE.fullmatch(location)
    if match is None:
        raise ValueError(f"not a shared-memory weight location: {location!r}")
    return match["name"], int(match["k"]), int(match["version"])


def segment_path(name: str, k: int) -> str:
    return os.path.join(SHM_DIR, f"{name}.{k}")


def check_name(name: str) -> None:
    if not _NAME_RE.fullmatch(name) or len(name) > 200:
        raise ValueError(f"bad weight set name {name!r}: letters, digits, '_', '-', '.' only")


class MappedSegment:
    """One segment mapped into this process, header parsed. Readers keep these for the life of the
    process: the pages stay the same when the writer rewrites them, so switching versions never maps
    or faults again."""

    def __init__(self, path: str, *, writable: bool):
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            st = os.fstat(fd)
            self.inode = (st.st_dev, st.st_ino)
            if st.st_size < HEADER_BYTES:
                raise WeightShmError(f"{path}: too small to be a weight segment")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self.mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        self.header = np.frombuffer(self.mm, dtype=np.int64, count=8)
        h = self.header
        if int(h[H_MAGIC]) != MAGIC or int(h[H_FORMAT]) != FORMAT:
            raise WeightShmError(f"{path}: not a weight segment of format {FORMAT}")
        mlen, self.data_offset, self.data_nbytes = int(h[H_MANIFEST_LEN]), int(h[H_DATA_OFFSET]), int(h[H_DATA_NBYTES])
        if HEADER_BYTES + mlen > self.data_offset or self.data_offset + self.data_nbytes > st.st_size:
            raise WeightShmError(f"{path}: header sizes do not fit the file")
        try:
            self.layout = Layout.from_manifest(self.mm[HEADER_BYTES:HEADER_BYTES + mlen])
        except (ValueError, TypeError) as exc:
            raise WeightShmError(f"{path}: bad manifest: {exc}") from None
        if self.layout.crc != int(h[H_LAYOUT_CRC]) or self.layout.nbytes != self.data_nbytes:
            raise WeightShmError(f"{path}: manifest does not match its header")
        self._views: dict[str, torch.Tensor] | None = None
        self._array: np.ndarray | None = None

    def views(self) -> dict[str, torch.Tensor]:
        if self._views is None:
            self._views = self.layout.views(self.mm, self.data_offset)
        return self._views

    def data(self) -> memoryview:
        return memoryview(self.mm)[self.data_offset:self.data_offset + self.data_nbytes]

    def array(self) -> np.ndarray:
        """The data region as flat bytes (writable only in the writer's mapping)."""
        if self._array is None:
            self._array = np.frombuffer(self.mm, dtype=np.uint8, count=self.data_nbytes, offset=self.data_offset)
        return self._array

    def committed(self) -> tuple[int, int] | None:
        """``(seq, version)`` if the buffer holds a committed version now, else None."""
        seq = int(self.header[H_SEQ])
        version = int(self.header[H_VERSION])
        if seq % 2 or version < 0 or int(self.header[H_SEQ]) != seq:
            return None
        return seq, version

    def close(self) -> None:
        """Unmap now if nothing still views the pages; otherwise the mapping goes with its last view."""
        self._views = None
        self._array = None
        self.header = None
        try:
            self.mm.close()
        except BufferError:  # a caller still holds tensors from this buffer: they keep it mapped
            pass


def create_segment(path: str, layout: Layout) -> MappedSegment:
    data_offset = _align(HEADER_BYTES + len(layout.manifest), mmap.PAGESIZE)
    size = data_offset + max(layout.nbytes, 1)
    try:
        # A crashed writer's leftover. Replace it rather than reuse it: a reader still mapping the old
        # file keeps its pages until it lets go, and nobody opening by name can find it any more.
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # fallocate reserves the RAM now, so a full /dev/shm is an error here and not a SIGBUS in the
        # middle of a copy; MAP_POPULATE maps every page up front so the first write pays no faults.
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    mm[HEADER_BYTES:HEADER_BYTES + len(layout.manifest)] = layout.manifest
    header = np.frombuffer(mm, dtype=np.int64, count=8)
    header[H_SEQ] = 0
    header[H_VERSION] = -1
    header[H_DATA_OFFSET] = data_offset
    header[H_DATA_NBYTES] = layout.nbytes
    header[H_MANIFEST_LEN] = len(layout.manifest)
    header[H_LAYOUT_CRC] = layout.crc
    header[H_FORMAT] = FORMAT
    header[H_MAGIC] = MAGIC  # last: a segment without its magic is never taken for a finished one
    del header
    mm.close()
    return MappedSegment(path, writable=True)
