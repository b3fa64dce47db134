"""Weight transport through shared memory: the trainer writes a policy version into one of two buffers
on the host, rollout workers map it without copying and serve from it directly.

One writer owns a weight set called ``name``. It keeps two segments, ``/dev/shm/<name>.0`` and
``/dev/shm/<name>.1`` (double buffering: while workers serve the version in one buffer, the next one
is written into the other). Each segment is self-describing, so a reader needs nothing but a location
string ``shm:<name>.<k>@<version>``:

    [0, 64)              header: 8 int64 words
    [64, 64 + m)         manifest: JSON, the layout of the state dict
    [data_offset, ...)   tensor bytes, 64-byte aligned

(the format: areal_bus/weights/layout.py).

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

No pickle anywhere: the manifest is JSON. Moving a version to another host is ``areal_bus/weights/transfer.py``'s
job (chunks written into a local writer through ``begin``/``commit``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from areal_bus.weights.layout import (H_SEQ, H_VERSION, BufferBusy, Layout, MappedSegment, VersionUnavailable,
                                      WeightShmError, check_name, create_segment, make_location, parse_location,
                                      segment_path)

COPY_THREADS_MAX = 8
"""Most threads a writer copies with. A few cores saturate a socket's memory bandwidth; more threads
only take cores from the trainer."""

COPY_PIECE_BYTES = 16 << 20
"""Large tensors are copied in pieces of this size, so that the copy threads share the work evenly
(one 272 MB embedding would otherwise keep one thread busy while the others idle)."""

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
        check_name(name)
        self.name = name
        self.layout = template if isinstance(template, Layout) else Layout.from_state_dict(template)
        self.ledger = BufferLedger(2)
        self.copy_threads = max(1, copy_threads or min(torch.get_num_threads(), COPY_THREADS_MAX))
        self._pool = ThreadPoolExecutor(self.copy_threads - 1, "shm-copy") if self.copy_threads > 1 else None
        self._segments: list[MappedSegment] = []
        try:
            for k in range(2):
                self._segments.append(create_segment(segment_path(name, k), self.layout))
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

    def begin_views(self, version: int) -> dict[str, torch.Tensor]:
        """``begin``, with the claimed buffer as writable tensors of the layout, to be filled in place
        (a sharded trainer gathers its weights into them a bucket at a time: engines/torch_parallel.py);
        then ``commit`` or ``abort``. The copies must be complete (synchronous CPU copies) at commit."""
        return self._segments[self._begin(version)].views()

    def _begin(self, version: int) -> int:
        k = self.ledger.claim(version)
        seg = self._segments[k]
        seq = int(seg.header[H_SEQ])
        seg.header[H_SEQ] = seq + 1 if seq % 2 == 0 else seq + 2  # odd: readers keep out from here on
        seg.header[H_VERSION] = version
        return k

    def commit(self, version: int) -> str:
        k = self.ledger.commit(version)
        seg = self._segments[k]
        seg.header[H_VERSION] = version
        seg.header[H_SEQ] = int(seg.header[H_SEQ]) + 1  # even, written last: the version is whole
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
        check_name(name)
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
        if int(seg.header[H_SEQ]) != state[0]:
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
