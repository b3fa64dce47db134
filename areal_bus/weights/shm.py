"""Weight transport through shared memory: the trainer writes a policy version into one of two buffers
on the host, rollout workers map it without copying and serve from it directly.

One writer owns a weight set called ``name``. It keeps two segments, ``/dev/shm/<name>.0`` and
``/dev/shm/<name>.1`` (double buffering: while workers serve the version in one buffer, the next one
is written into the other). Each segment is self-describing, so a reader needs nothing but a location
string ``shm:<name>.<k>@<version>``:

    [0, 64)              header: 8 int64 words, see ``_H_*`` below
    [64, 64 + m)         manifest: JSON, the layout of the state dict (name, dtype, shape, offset, nbytes)
    [data_offset, ...)   tensor bytes, each tensor at a 64-byte aligned offset (data_offset is page aligned)

Consistency is a seqlock on the header: ``write`` makes the sequence word odd before touching the data
and even again after the version word is set, so a reader that sees an even sequence, the version it
was told and the same sequence again after mapping never hands out a half-written version. The
writer never overwrites a buffer that readers may still serve: ``BufferLedger`` only lets a write into
a buffer whose version every reader has acknowledged leaving (``mark_released``); otherwise ``write``
raises ``BufferBusy`` and the caller waits for acks. The header checks catch what the protocol cannot
see (a reader the broadcaster did not know about, a crashed writer's leftovers).

Ordering note: the header words are single aligned 8-byte stores and loads, and the data copy completes
(torch joins its copy threads) before the commit store, which is enough on x86-64's total store order.
A port to a weakly ordered CPU would need a fence between the data copy and the commit store.

No pickle anywhere: the manifest is JSON. Moving a version to another host is ``weights_transfer``'s
job (chunks written into a local writer through ``begin``/``commit``).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import threading
import warnings
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
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

COPY_THREADS_MAX = 8
"""Most threads a writer copies with. A few cores saturate a socket's memory bandwidth; more threads
only take cores from the trainer."""

COPY_PIECE_BYTES = 16 << 20
"""Large tensors are copied in pieces of this size, so that the copy threads share the work evenly
(one 272 MB embedding would otherwise keep one thread busy while the others idle)."""

# Header words (int64). SEQ is odd while a write is in progress; VERSION is -1 until the first commit.
_H_MAGIC, _H_SEQ, _H_VERSION, _H_DATA_OFFSET, _H_DATA_NBYTES, _H_MANIFEST_LEN, _H_LAYOUT_CRC, _H_FORMAT = range(8)

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


def _check_name(name: str) -> None:
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
        if int(h[_H_MAGIC]) != MAGIC or int(h[_H_FORMAT]) != FORMAT:
            raise WeightShmError(f"{path}: not a weight segment of format {FORMAT}")
        mlen, self.data_offset, self.data_nbytes = int(h[_H_MANIFEST_LEN]), int(h[_H_DATA_OFFSET]), int(h[_H_DATA_NBYTES])
        if HEADER_BYTES + mlen > self.data_offset or self.data_offset + self.data_nbytes > st.st_size:
            raise WeightShmError(f"{path}: header sizes do not fit the file")
        try:
            self.layout = Layout.from_manifest(self.mm[HEADER_BYTES:HEADER_BYTES + mlen])
        except (ValueError, TypeError) as exc:
            raise WeightShmError(f"{path}: bad manifest: {exc}") from None
        if self.layout.crc != int(h[_H_LAYOUT_CRC]) or self.layout.nbytes != self.data_nbytes:
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
        seq = int(self.header[_H_SEQ])
        version = int(self.header[_H_VERSION])
        if seq % 2 or version < 0 or int(self.header[_H_SEQ]) != seq:
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


def _create_segment(path: str, layout: Layout) -> MappedSegment:
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
    header[_H_SEQ] = 0
    header[_H_VERSION] = -1
    header[_H_DATA_OFFSET] = data_offset
    header[_H_DATA_NBYTES] = layout.nbytes
    header[_H_MANIFEST_LEN] = len(layout.manifest)
    header[_H_LAYOUT_CRC] = layout.crc
    header[_H_FORMAT] = FORMAT
    header[_H_MAGIC] = MAGIC  # last: a segment without its magic is never taken for a finished one
    del header
    mm.close()
    return MappedSegment(path, writable=True)


# ---------------------------------------------------------------------------------------------
# Writer side
# ---------------------------------------------------------------------------------------------


class BufferLedger:
    """Which version each buffer holds and whether the next write may take it. No memory, no I/O.

    A write goes into a buffer that does not hold the latest version (the latest is what readers are
    switching to, so it is never overwritten), and only if that buffer's version has been released:
    ``mark_released(v)`` says every reader has left every version <= v, which is what a VersionAck
    for a newer version from every live worker means.
    """

    def __init__(self, nbuffers: int = 2):
        self.holds: list[int | None] = [None] * nbuffers
        self.latest: int | None = None
        self.released = -1
        self.writing: tuple[int, int] | None = None  # (buffer, version) between claim and commit

    def next_buffer(self) -> int:
        others = [k for k in range(len(self.holds)) if self.latest is None or self.holds[k] != self.latest]
        return min(others, key=lambda k: -1 if self.holds[k] is None else self.holds[k])

    def claim(self, version: int) -> int:
        """The buffer ``version`` goes into. Raises BufferBusy (nothing changes) if it is still in use."""
        if self.writing is not None:
            raise WeightShmError(f"version {self.writing[1]} is still being written")
        if version < 0 or (self.latest is not None and version <= self.latest):
            raise ValueError(f"version {version} does not follow the latest version {self.latest}")
        k = self.next_buffer()
        held = self.holds[k]
        if held is not None and held > self.released:
            raise BufferBusy(f"buffer {k} still holds version {held}; readers have released up to {self.released}")
        self.holds[k] = None  # from here until commit the buffer holds no valid version
        self.writing = (k, version)
        return k

    def commit(self, version: int) -> int:
        if self.writing is None or self.writing[1] != version:
            raise WeightShmError(f"commit of version {version}, which is not being written")
        k, _ = self.writing
        self.holds[k] = version
        self.latest = version
        self.writing = None
        return k

    def abort(self) -> None:
        """A write failed: its buffer holds nothing valid (free to take again), the latest is unchanged."""
        self.writing = None

    def mark_released(self, version: int) -> None:
        self.released = max(self.released, version)


class ShmWeightWriter:
    """The trainer's side: owns both segments of weight set ``name`` and writes versions into them.

    ``template`` is a state dict (meta tensors will do) or a ``Layout``; every later write must match
    it. One writer per name: creating a writer replaces any segments left under that name.

    ``copy_threads`` (default: torch's intra-op thread count, at most COPY_THREADS_MAX) copy CPU
    tensors from a shared work list of pieces, with numpy, which drops the GIL while it copies. Not
    torch's own copy_: that splits every tensor across its threads and joins them again, a few hundred
    barriers per version, each of which waits for the slowest thread; on a busy host one descheduled
    thread then stalls the whole write, where a work list lets the other threads take its share.
    CUDA and non-contiguous tensors are copied with torch (a device copy needs no CPU threads).
    """

    def __init__(self, name: str, template: Mapping[str, torch.Tensor] | Layout, copy_threads: int | None = None):
        _check_name(name)
        self.name = name
        self.layout = template if isinstance(template, Layout) else Layout.from_state_dict(template)
        self.ledger = BufferLedger(2)
        self.copy_threads = max(1, copy_threads or min(torch.get_num_threads(), COPY_THREADS_MAX))
        self._pool = ThreadPoolExecutor(self.copy_threads - 1, "shm-copy") if self.copy_threads > 1 else None
        self._segments: list[MappedSegment] = []
        try:
            for k in range(2):
                self._segments.append(_create_segment(segment_path(name, k), self.layout))
        except BaseException:
            self.close()
            raise

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def latest(self) -> str | None:
        """Location of the newest committed version (what a late joiner should be told)."""
        led = self.ledger
        return None if led.latest is None else make_location(self.name, led.holds.index(led.latest), led.latest)

    def write(self, state_dict: Mapping[str, torch.Tensor], version: int) -> str:
        """Copy ``state_dict`` into a free buffer as ``version``; returns its location. Raises
        BufferBusy, without touching anything, if no buffer is free; ValueError if the dict does not
        match the layout."""
        self.layout.check(state_dict)
        k = self._begin(version)
        try:
            self._copy_in(self._segments[k], state_dict)
        except BaseException:
            self.abort()
            raise
        return self.commit(version)

    def _copy_in(self, seg: MappedSegment, state_dict: Mapping[str, torch.Tensor]) -> None:
        dst = seg.array()
        pieces: list[tuple[int, np.ndarray]] = []
        with torch.no_grad():
            for s in self.layout.specs:
                src = state_dict[s.name]
                if not s.nbytes:
                    continue
                if src.device.type != "cpu" or not src.is_contiguous():
                    seg.views()[s.name].copy_(src)
                    continue
                raw = src.detach().reshape(-1).view(torch.uint8).numpy()
                pieces += [(s.offset + i, raw[i:i + COPY_PIECE_BYTES]) for i in range(0, s.nbytes, COPY_PIECE_BYTES)]
        work = iter(pieces)
        lock = threading.Lock()

        def drain() -> None:
            while True:
                with lock:
                    item = next(work, None)
                if item is None:
                    return
                off, piece = item
                np.copyto(dst[off:off + piece.size], piece)

        helpers = [self._pool.submit(drain) for _ in range(self.copy_threads - 1)] if self._pool else []
        try:
            drain()
        finally:
            for f in helpers:
                f.result()  # joins every helper (and re-raises its error) before the commit store

    def begin(self, version: int) -> memoryview:
        """Start writing ``version``: claims a buffer (BufferBusy if none is free), marks it in
        progress and returns its data region for the caller to fill (``weights_transfer.ChunkAssembler`` does)."""
        return self._segments[self._begin(version)].data()

    def _begin(self, version: int) -> int:
        k = self.ledger.claim(version)
        seg = self._segments[k]
        seq = int(seg.header[_H_SEQ])
        seg.header[_H_SEQ] = seq + 1 if seq % 2 == 0 else seq + 2  # odd: readers keep out from here on
        seg.header[_H_VERSION] = version
        return k

    def commit(self, version: int) -> str:
        k = self.ledger.commit(version)
        seg = self._segments[k]
        seg.header[_H_VERSION] = version
        seg.header[_H_SEQ] = int(seg.header[_H_SEQ]) + 1  # even, written last: the version is whole
        return make_location(self.name, k, version)

    def abort(self) -> None:
        """Give up the write in progress. The buffer stays marked in progress, so no reader maps it."""
        self.ledger.abort()

    def mark_released(self, version: int) -> None:
        """Every reader has acknowledged leaving every version <= ``version``: their buffers may be reused."""
        self.ledger.mark_released(version)

    def close(self) -> None:
        """Unlink both segments. Readers that still map them keep their pages until they let go."""
        for k, seg in enumerate(self._segments):
            try:
                os.unlink(segment_path(self.name, k))
            except FileNotFoundError:
                pass
            seg.close()
        self._segments = []
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self) -> ShmWeightWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Reader side
# ---------------------------------------------------------------------------------------------


class ShmWeightReader:
    """A rollout worker's side: opens announced locations of weight set ``name`` as tensors that view
    the shared pages directly. Opening a version is O(1) after the first time a buffer is seen: the
    mapping and the tensor views are made once per buffer and reused, only the header is checked.

    Segments are mapped read-only: a stray in-place op in one worker would otherwise silently corrupt
    the weights every worker serves; read-only turns it into an immediate crash in that worker.
    """

    def __init__(self, name: str):
        _check_name(name)
        self.name = name
        self._segments: dict[int, MappedSegment] = {}
        self._open: dict[int, tuple[int, int]] = {}  # version -> (buffer, seq seen at open)

    def open(self, location: str) -> dict[str, torch.Tensor]:
        """The tensors of the version at ``location``, zero copy. Raises VersionUnavailable if that
        buffer now holds another version, is being written, or is gone with the trainer that wrote it
        (keep serving what you have and switch at the next announcement)."""
        name, k, version = parse_location(location)
        if name != self.name:
            raise ValueError(f"location {location!r} is not of weight set {self.name!r}")
        try:
            seg = self._segment(k)
        except FileNotFoundError:  # the writer went (a trainer crashed) before its replacement made it again
            raise VersionUnavailable(f"{location}: buffer {k} does not exist (its writer is gone)") from None
        state = seg.committed()
        if state is None or state[1] != version:
            raise VersionUnavailable(f"{location}: buffer {k} is being written or holds another version")
        views = seg.views()
        if int(seg.header[_H_SEQ]) != state[0]:
            raise VersionUnavailable(f"{location}: overwritten while opening")
        self._open[version] = (k, state[0])
        return dict(views)

    def verify(self, location: str) -> bool:
        """True if the version opened from ``location`` is still intact, i.e. nobody has begun to
        overwrite it since ``open``. Cheap (two loads); a worker can call it after serving a batch to
        prove the batch was computed on whole weights."""
        _, k, version = parse_location(location)
        opened = self._open.get(version)
        seg = self._segments.get(k)
        if opened is None or seg is None or opened[0] != k:
            return False
        return seg.committed() == (opened[1], version)

    def release(self, version: int) -> None:
        """This worker no longer serves ``version``. The tensors stay valid memory, but their content
        may change from now on; the VersionAck the worker sends next carries the release to the
        broadcaster."""
        self._open.pop(version, None)

    @property
    def held(self) -> list[int]:
        """Versions opened and not yet released."""
        return sorted(self._open)

    def locate(self, version: int) -> str | None:
        """Location of ``version`` in this weight set's segments now, or None: a host that receives
        versions over the network (a weight relay) puts them in either buffer, so a reader there knows
        the version it was told, not the buffer."""
        for k in (0, 1):
            try:
                state = self._segment(k).committed()
            except (FileNotFoundError, WeightShmError):
                continue
            if state is not None and state[1] == version:
                return make_location(self.name, k, version)
        return None

    def digest(self, location: str) -> str:
        """sha256 of the bytes of the version opened from ``location``; raises VersionUnavailable if
        it was overwritten meanwhile (then the digest means nothing)."""
        import hashlib

        _, k, _ = parse_location(location)
        with self._segments[k].data() as data:
            value = hashlib.sha256(data).hexdigest()
        if not self.verify(location):
            raise VersionUnavailable(f"{location}: overwritten while its digest was taken")
        return value

    def latest(self) -> str | None:
        """Location of the newest committed version in the segments now, or None. For a late joiner
        that has the weight set's name but missed the announcement; the bus snapshot is the normal way."""
        best = None
        for k in (0, 1):
            try:
                state = self._segment(k).committed()
            except (FileNotFoundError, WeightShmError):
                continue
            if state is not None and (best is None or state[1] > best[1]):
                best = (k, state[1])
        return None if best is None else make_location(self.name, *best)

    def _segment(self, k: int) -> MappedSegment:
        path = segment_path(self.name, k)
        seg = self._segments.get(k)
        st = os.stat(path)  # raises FileNotFoundError when no writer has this name
        if seg is None or seg.inode != (st.st_dev, st.st_ino):
            # First use, or the writer restarted and made a new file: map the one the name points to.
            # The old mapping is dropped, not closed, so tensors a caller still holds stay valid memory.
            seg = MappedSegment(path, writable=False)
            self._segments[k] = seg
        return seg

    def close(self) -> None:
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
        self._open.clear()
