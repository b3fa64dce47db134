"""Cross-host weight transfer (areal_bus.weights.transfer): a committed shared-memory version cut into
chunks, sent over a real ZeroMQ PUSH/PULL pair and assembled into another weight set with identical
tensors; a corrupt chunk abandons its version, which is never committed. Across two network namespaces
over CURVE: tests/test_two_hosts.py."""

from __future__ import annotations

import msgpack
import pytest
import torch
import zmq

from areal_bus.weights.shm import ShmWeightReader, ShmWeightWriter, VersionUnavailable
from areal_bus.weights.transfer import ChunkAssembler, ChunkError, chunk_frames
from tests.test_weights_shm import assert_same, name, small_state  # noqa: F401 (name: fixture)


def _pair(ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    pull.rcvtimeo = 10_000
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.sndtimeo = 10_000
    push.connect(f"tcp://127.0.0.1:{port}")
    return push, pull


def test_chunked_transfer_over_zeromq_maps_identical_tensors_on_the_remote_side(name):
    state = small_state(seed=5)
    state["big"] = torch.randn(300, 100, generator=torch.Generator().manual_seed(6)).bfloat16()
    remote = name + "_remote"
    ctx = zmq.Context()
    push, pull = _pair(ctx)
    assembler = ChunkAssembler(remote)
    try:
        with ShmWeightWriter(name, state) as writer:
            loc = writer.write(state, 4)
            sent = 0
            for header, payload in chunk_frames(loc, chunk_bytes=4096):
                push.send_multipart([msgpack.packb(header), payload], copy=False)
                sent += 1
            assert sent > 10
            local = None
            for _ in range(sent):
                head, payload = pull.recv_multipart(copy=False)
                local = assembler.add(msgpack.unpackb(head.bytes), payload)
        assert local == f"shm:{remote}.0@4"
        reader = ShmWeightReader(remote)
        assert_same(reader.open(local), state)
        reader.close()
    finally:
        assembler.close()
        push.close()
        pull.close()
        ctx.term()


def test_corrupted_chunk_is_refused_and_its_version_never_committed(name):
    state = small_state()
    remote = name + "_remote"
    assembler = ChunkAssembler(remote)
    try:
        with ShmWeightWriter(name, state) as writer:
            chunks = [(h, bytes(p)) for h, p in chunk_frames(writer.write(state, 1), chunk_bytes=512)]
        head, payload = chunks[1]
        chunks[1] = (head, bytes([payload[0] ^ 0xFF]) + payload[1:])
        assert assembler.add(*chunks[0]) is None
        with pytest.raises(ChunkError):
            assembler.add(*chunks[1])
        for chunk in chunks[2:]:
            with pytest.raises(ChunkError):
                assembler.add(*chunk)
        reader = ShmWeightReader(remote)
        assert reader.latest() is None
        with pytest.raises(VersionUnavailable):
            reader.open(f"shm:{remote}.0@1")
        reader.close()
    finally:
        assembler.close()
