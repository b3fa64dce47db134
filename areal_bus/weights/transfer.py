"""Weight transfer across hosts: a committed shared-memory version cut into checksummed chunks for
ZeroMQ, and written back into a local weight set on the receiving host.

What it is for: a rollout worker on another host than the trainer cannot map the trainer's
``/dev/shm`` segments (``weights_shm``). The sending host cuts a committed version into chunks
(``chunk_frames``), sends each as two frames (a msgpack header, a zero-copy payload) over a socket that
speaks CURVE between hosts (``security.bus_context``: the run's keys ride on every socket), and the
receiving host's ``ChunkAssembler`` writes them into a local ``ShmWeightWriter``'s free buffer, where
local readers map the version as usual. Every chunk carries a CRC32 and the layout's checksum, so a
corrupt, foreign or overwritten chunk abandons its version instead of committing it.

The last chunk also carries the sha256 of the whole version, hashed as the chunks are cut; the
assembler hashes what it wrote and commits only on a match, so a far host serves the trainer's bytes
or nothing. The weight broadcaster (nodes/weights.py) sends each version with it to a relay on every
host that runs rollout and shares no memory with the trainer (areal_bus/config/placement.py).
tests/test_weights_transfer.py checks it in one process and tests/test_two_hosts.py across two network
namespaces over CURVE, in a whole run. No pickle anywhere: the manifest is JSON, chunk headers are
plain dicts for msgpack.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from collections.abc import Iterator, Mapping

from areal_bus.constants import MAX_FRAME_BYTES
from areal_bus.weights.shm import (
    Layout,
    MappedSegment,
    ShmWeightWriter,
    VersionUnavailable,
    WeightShmError,
    parse_location,
    segment_path,
)

DEFAULT_CHUNK_BYTES = 64 << 20
"""Chunk size: large enough that per-message overhead vanishes next to the bytes, small enough that a
lost or corrupt chunk costs little and the sender's memory is not pinned in one frame."""


class ChunkError(WeightShmError):
    """A chunk that does not fit the transfer in progress (bad checksum, size or layout). The
    receiving node counts and drops it; the version it belongs to is never committed."""


def chunk_frames(location: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 extra: Mapping | None = None) -> Iterator[tuple[dict, memoryview]]:
    """The version at ``location`` as ``(header, payload)`` pairs to send as two frames each (header
    through msgpack, payload zero copy). Payloads view the shared buffer, so the version must stay
    unreleased until ZeroMQ has sent them; each carries a CRC32, so a buffer overwritten under a send
    in flight is caught by the receiver. Chunk 0 carries the manifest.

    Raises VersionUnavailable if the location cannot be opened, or, at the end, if it was overwritten
    while the chunks were being cut.
    """
    if not 0 < chunk_bytes <= MAX_FRAME_BYTES:  # the payload is one frame: it must pass every socket's bound
        raise ValueError(f"chunk_bytes must be positive and at most {MAX_FRAME_BYTES} (got {chunk_bytes})")
    name, k, version = parse_location(location)
    seg = MappedSegment(segment_path(name, k), writable=False)
    state = seg.committed()
    if state is None or state[1] != version:
        raise VersionUnavailable(f"{location}: buffer {k} is being written or holds another version")
    data = seg.data()
    total = len(data)
    count = max(1, math.ceil(total / chunk_bytes))
    digest = hashlib.sha256()
    for i in range(count):
        off = i * chunk_bytes
        payload = data[off:off + chunk_bytes]
        header = {**(extra or {}), "version": version, "index": i, "count": count, "offset": off,
                  "nbytes": len(payload), "total": total, "crc": zlib.crc32(payload), "layout_crc": seg.layout.crc}
        digest.update(payload)
        if i == 0:
            header["manifest"] = seg.layout.manifest.decode()
        if i == count - 1:
            header["sha256"] = digest.hexdigest()
        yield header, payload
    if seg.committed() != state:
        raise VersionUnavailable(f"{location}: overwritten while being sent")


class ChunkAssembler:
    """The receiving host's side of a cross-host transfer: writes chunks from ``chunk_frames`` into
    a local writer's free buffer and commits the version once every byte has arrived and checked out.

    The local writer (weight set ``name`` on this host) is created from the manifest in the first
    chunk, or passed in. ``add`` returns the local location when a version is complete, else None.
    A chunk of a newer version abandons an unfinished older one, and a chunk that fails its checks
    abandons its version (raising ChunkError): an abandoned version is never committed, and the next
    announced version heals the host.
    """

    def __init__(self, name: str, writer: ShmWeightWriter | None = None):
        self.name = name
        self.writer = writer
        self._version: int | None = None
        self._data: memoryview | None = None
        self._seen: set[int] = set()
        self._received = 0
        self._expect: tuple[int, int] | None = None  # (count, total) of the version in progress
        self._abandoned = -1  # newest version given up on: its late chunks are refused, not restarted
        self.digest = ""  # sha256 of the newest committed version, when its sender gave one

    def add(self, header: Mapping, payload) -> str | None:
        try:
            version, index, count = int(header["version"]), int(header["index"]), int(header["count"])
            off, nbytes, total = int(header["offset"]), int(header["nbytes"]), int(header["total"])
            crc, layout_crc = int(header["crc"]), int(header["layout_crc"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ChunkError(f"malformed chunk header: {exc!r}") from None
        buf = payload.buffer if hasattr(payload, "buffer") else memoryview(payload)  # zmq.Frame or bytes-like
        if self.writer is None:
            if "manifest" not in header:
                raise ChunkError(f"chunk {index} of version {version} before any manifest")
            try:
                layout = Layout.from_manifest(header["manifest"])
            except (ValueError, TypeError) as exc:
                raise ChunkError(f"bad manifest: {exc}") from None
            self.writer = ShmWeightWriter(self.name, layout)
        if layout_crc != self.writer.layout.crc or total != self.writer.nbytes:
            raise ChunkError(f"version {version}: layout differs from this host's weight set {self.name!r}")
        if index == 0 and version == self._version:  # a resend from the start: begin the version again
            self._drop(abandon=False)
        elif index == 0 and version == self._abandoned:  # a resend of a version given up on: welcome
            self._abandoned = version - 1
        if self._version is None or version > self._version:
            if self._version is not None:
                self._drop()
            latest = self.writer.ledger.latest
            if version <= max(self._abandoned, -1 if latest is None else latest):
                raise ChunkError(f"chunk of version {version}, which is already committed or abandoned")
            self._data = self.writer.begin(version)  # BufferBusy propagates: local readers must let go first
            self._version, self._expect = version, (count, total)
        elif version < self._version:
            raise ChunkError(f"chunk of version {version} while assembling {self._version}")
        if (count, total) != self._expect or not 0 <= index < count or index in self._seen:
            self._drop()
            raise ChunkError(f"version {version}: chunk {index}/{count} unexpected or repeated; version abandoned")
        if buf.nbytes != nbytes or off < 0 or off + nbytes > total or zlib.crc32(buf) != crc:
            self._drop()
            raise ChunkError(f"version {version}: chunk {index} fails its size or checksum; version abandoned")
        self._data[off:off + nbytes] = buf.cast("B") if buf.format != "B" else buf
        self._seen.add(index)
        self._received += nbytes
        if len(self._seen) < count:
            return None
        if self._received != total:
            raise ChunkError(f"version {version}: {self._received} bytes for a total of {total}")
        if "sha256" in header:
            got = hashlib.sha256(self._data).hexdigest()
            if got != header["sha256"]:
                self._drop()
                raise ChunkError(f"version {version}: sha256 {got[:16]} of what arrived is not the sender's "
                                 f"{str(header['sha256'])[:16]}; version abandoned")
            self.digest = got
        self._reset()
        return self.writer.commit(version)

    def _drop(self, abandon: bool = True) -> None:
        """Give up the version in progress: it is never committed, and (``abandon``) its remaining
        chunks are refused until it is sent again from its first chunk."""
        if abandon:
            self._abandoned = max(self._abandoned, self._version)
        self.writer.abort()
        self._reset()

    def _reset(self) -> None:
        if self._data is not None:
            self._data.release()
        self._data, self._version, self._expect = None, None, None
        self._seen, self._received = set(), 0

    def close(self) -> None:
        if self._version is not None:
            self._drop()
        if self.writer is not None:
            self.writer.close()
