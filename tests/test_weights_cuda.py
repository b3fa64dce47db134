"""CUDA IPC weight handoff: the plain-data parts on any machine, the device parts on a CUDA host only.

Run:  .venv/bin/python -m pytest tests/test_weights_cuda.py -q          (gpu tests skip without CUDA)
"""

from __future__ import annotations

import multiprocessing as mp

import msgpack
import pytest
import torch

from areal_bus.weights.cuda import (
    BufferBusy, CudaWeightReader, CudaWeightWriter, HANDLE_FIELDS, check_handle, handle_args,
    handle_to_dict, make_location, parse_location,
)
from areal_bus.weights.layout import ALIGN

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")

FAKE_SHARED = (0, b"\x01" * 66, 3 << 20, 2 << 20, b"/torch_123_456_0", 7, b"\x02" * 64, True)


def template() -> dict[str, torch.Tensor]:
    return {
        "embed": torch.empty(37, 16, dtype=torch.bfloat16, device="meta"),
        "bias": torch.empty(3, dtype=torch.bfloat16, device="meta"),
        "norm": torch.empty(5, dtype=torch.float32, device="meta"),
    }


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(t.shape, generator=g).to(t.dtype) for k, t in template().items()}


def test_views_sit_at_aligned_offsets_of_one_buffer():
    w = CudaWeightWriter("t", template(), device="cpu")
    base = w.buffers[0].data_ptr()
    for t in w.views(0).values():
        assert (t.data_ptr() - base) % ALIGN == 0
    assert w.nbytes >= sum(t.numel() * t.element_size() for t in template().values())


def test_handle_dict_survives_msgpack_and_rebuilds_the_same_arguments():
    doc = handle_to_dict(FAKE_SHARED)
    assert [n for n, _ in HANDLE_FIELDS] == list(doc)
    back = msgpack.unpackb(msgpack.packb(doc), raw=False)
    assert handle_args(back) == FAKE_SHARED


@pytest.mark.parametrize("field,bad", [("size", -1), ("handle", "text"), ("device", True), ("event_sync_required", 1)])
def test_malformed_handle_is_refused(field, bad):
    doc = handle_to_dict(FAKE_SHARED)
    doc[field] = bad
    with pytest.raises(ValueError):
        check_handle(doc)


def test_location_round_trips_and_rejects_others():
    assert parse_location(make_location("policy", 1, 42)) == ("policy", 1, 42)
    with pytest.raises(ValueError):
        parse_location("shm:policy.1@42")


def test_write_alternates_buffers_and_waits_for_release():
    w = CudaWeightWriter("t", template(), device="cpu")
    s1, s2, s3 = state(1), state(2), state(3)
    assert w.write(s1, 1) == "cuda:t.0@1"
    assert w.write(s2, 2) == "cuda:t.1@2"
    with pytest.raises(BufferBusy):  # buffer 0 still holds version 1, which no reader has left
        w.write(s3, 3)
    w.mark_released(1)
    assert w.write(s3, 3) == "cuda:t.0@3"
    assert all(torch.equal(w.views(0)[k], s3[k]) for k in s3)
    assert all(torch.equal(w.views(1)[k], s2[k]) for k in s2)


def test_write_refuses_a_state_dict_of_another_layout():
    w = CudaWeightWriter("t", template(), device="cpu")
    bad = state(1)
    bad["bias"] = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        w.write(bad, 1)
    assert w.write(state(1), 1) == "cuda:t.0@1"  # a refused write leaves the ledger as it was


def _reader_child(handles: dict, locations: list[str], out: mp.Queue) -> None:
    reader = CudaWeightReader(handles)
    got = []
    for loc in locations:
        views = reader.open(loc)
        got.append({k: v.float().sum().item() for k, v in views.items()})
    reader.drain()
    out.put(got)


@pytest.mark.gpu
@needs_cuda
def test_reader_in_another_process_sees_each_version_without_copying():
    w = CudaWeightWriter("t", template(), device="cuda")
    s1, s2 = ({k: v.cuda() for k, v in state(i).items()} for i in (1, 2))
    locs = [w.write(s1, 1), w.write(s2, 2)]
    handles = msgpack.unpackb(msgpack.packb(w.handles()), raw=False)  # only plain data crosses
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_reader_child, args=(handles, locs, out))
    p.start()
    try:
        got = out.get(timeout=90)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    want = [{k: v.float().sum().item() for k, v in s.items()} for s in (s1, s2)]
    assert got == want
