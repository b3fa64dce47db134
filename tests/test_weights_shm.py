"""Shared-memory weight transport: exact round trips, zero-copy readers in other processes, no torn
reads under a continuously writing trainer, buffer reuse only after release. The cross-host chunked
transfer is tests/test_weights_transfer.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import uuid

import pytest
import torch

from areal_bus.weights.shm import (
    BufferBusy,
    BufferLedger,
    Layout,
    ShmWeightReader,
    ShmWeightWriter,
    VersionUnavailable,
    parse_location,
    segment_path,
)

SPAWN = mp.get_context("spawn")
PROC_TIMEOUT_S = 60  # a child that has not finished by then is stuck: fail rather than hang the suite


@pytest.fixture
def name():
    n = f"test_{uuid.uuid4().hex[:12]}"
    yield n
    for k in (0, 1):  # a test that failed half-way must not leave RAM behind in /dev/shm
        try:
            os.unlink(segment_path(n, k))
        except FileNotFoundError:
            pass


def small_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(33, 16, generator=g).bfloat16(),
        "layer.0.q.weight": torch.randn(16, 16, generator=g),
        "layer.0.q.bias": torch.randn(16, generator=g).half(),
        "layer.0.norm": torch.randn(7, generator=g, dtype=torch.float64),
        "positions": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(1.5, dtype=torch.float32),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
    }


def constant_state(version: int, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # version % 200 stays exact in bf16 and fp16 (integers up to 256 are).
    return {k: torch.full_like(t, version % 200) for k, t in template.items()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k], t), k


# ---------------------------------------------------------------------------------------------
# Layout and the reuse rule (pure)
# ---------------------------------------------------------------------------------------------


def test_layout_offsets_are_aligned_and_manifest_round_trips():
    layout = Layout.from_state_dict(small_state())
    assert all(s.offset % 64 == 0 for s in layout.specs)
    assert [s.name for s in layout.specs] == list(small_state())
    again = Layout.from_manifest(layout.manifest)
    assert again.specs == layout.specs and again.crc == layout.crc


def test_layout_accepts_meta_tensors_as_template():
    meta = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in small_state().items()}
    assert Layout.from_state_dict(meta).specs == Layout.from_state_dict(small_state()).specs


def test_ledger_alternates_buffers():
    led = BufferLedger()
    seen = []
    for v in (1, 2, 3, 4):
        k = led.claim(v)
        led.commit(v)
        led.mark_released(v - 1)
        seen.append(k)
    assert seen == [0, 1, 0, 1]


def test_ledger_refuses_buffer_until_released():
    led = BufferLedger()
    for v in (1, 2):
        led.claim(v)
        led.commit(v)
    with pytest.raises(BufferBusy):
        led.claim(3)
    led.mark_released(1)
    assert led.claim(3) == 0


def test_ledger_never_overwrites_latest_even_with_gaps():
    led = BufferLedger()
    led.claim(1)
    led.commit(1)
    led.mark_released(1)  # even if every reader somehow left it, the latest stays put
    assert led.claim(3) == 1


def test_ledger_refuses_versions_that_do_not_increase():
    led = BufferLedger()
    led.claim(5)
    led.commit(5)
    with pytest.raises(ValueError):
        led.claim(5)


def test_ledger_aborted_write_frees_its_buffer():
    led = BufferLedger()
    for v in (1, 2):
        led.claim(v)
        led.commit(v)
    led.mark_released(1)
    assert led.claim(3) == 0
    led.abort()
    assert led.latest == 2 and led.holds[0] is None
    assert led.claim(4) == 0


# ---------------------------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------------------------


def test_round_trip_is_exact(name):
    state = small_state()
    with ShmWeightWriter(name, state) as writer:
        loc = writer.write(state, 1)
        assert parse_location(loc) == (name, 0, 1)
        reader = ShmWeightReader(name)
        assert_same(reader.open(loc), state)
        reader.close()


def test_round_trip_is_exact_for_large_and_strided_tensors_with_several_copy_threads(name):
    g = torch.Generator().manual_seed(1)
    state = {
        "big": torch.randn(5_000_001, generator=g),  # ~20 MB: split into pieces across the threads
        "strided": torch.randn(64, 48, generator=g).bfloat16().t(),  # not contiguous: copied by torch
        "tail": torch.randn(3, generator=g).bfloat16(),
    }
    with ShmWeightWriter(name, state, copy_threads=3) as writer:
        reader = ShmWeightReader(name)
        assert_same(reader.open(writer.write(state, 1)), state)
        reader.close()


def test_reader_tensors_view_shared_memory_without_copy(name):
    state = small_state()
    with ShmWeightWriter(name, state) as writer:
        reader = ShmWeightReader(name)
        first = reader.open(writer.write(constant_state(1, state), 1))
        writer.write(constant_state(2, state), 2)
        assert_same(first, constant_state(1, state))  # the other buffer took version 2
        writer.mark_released(1)
        writer.write(constant_state(3, state), 3)  # reuses version 1's buffer
        assert_same(first, constant_state(3, state))  # same pages: the reader never had a copy
        reader.close()


def test_write_raises_buffer_busy_over_unreleased_buffer(name):
    state = small_state()
    with ShmWeightWriter(name, state) as writer:
        reader = ShmWeightReader(name)
        loc1 = writer.write(constant_state(1, state), 1)
        held = reader.open(loc1)
        writer.write(constant_state(2, state), 2)
        with pytest.raises(BufferBusy):
            writer.write(constant_state(3, state), 3)
        assert_same(held, constant_state(1, state))  # the refused write touched nothing
        assert reader.verify(loc1)
        writer.mark_released(1)
        writer.write(constant_state(3, state), 3)
        assert not reader.verify(loc1)
        reader.close()


def test_open_refuses_a_write_in_progress(name):
    state = small_state()
    with ShmWeightWriter(name, state) as writer:
        reader = ShmWeightReader(name)
        writer.begin(1)
        with pytest.raises(VersionUnavailable):
            reader.open(f"shm:{name}.0@1")
        loc = writer.commit(1)
        reader.open(loc)
        reader.close()


def test_open_refuses_an_overwritten_location(name):
    state = small_state()
    with ShmWeightWriter(name, state) as writer:
        loc1 = writer.write(state, 1)
        writer.write(state, 2)
        writer.mark_released(1)
        writer.write(state, 3)
        reader = ShmWeightReader(name)
        with pytest.raises(VersionUnavailable):
            reader.open(loc1)
        reader.close()


def test_write_rejects_a_state_dict_of_another_layout(name):
    state = small_state()
    with ShmWeightWriter(name, state) as writer:
        bad = dict(state, **{"layer.0.q.weight": torch.zeros(16, 17)})
        with pytest.raises(ValueError, match="layer.0.q.weight"):
            writer.write(bad, 1)
        writer.write(state, 1)  # nothing was claimed by the refused write


def test_late_joiner_finds_the_latest_version(name):
    state = small_state()
    with ShmWeightWriter(name, state) as writer:
        for v in (1, 2, 3):
            writer.write(constant_state(v, state), v)
            writer.mark_released(v - 1)
        reader = ShmWeightReader(name)
        assert reader.latest() == writer.latest == f"shm:{name}.0@3"
        assert_same(reader.open(reader.latest()), constant_state(3, state))
        reader.close()


def test_close_unlinks_segments(name):
    writer = ShmWeightWriter(name, small_state())
    assert all(os.path.exists(segment_path(name, k)) for k in (0, 1))
    writer.close()
    assert not any(os.path.exists(segment_path(name, k)) for k in (0, 1))


def _crash_after_writing(name: str) -> None:
    state = small_state()
    writer = ShmWeightWriter(name, state)
    writer.write(constant_state(7, state), 7)
    os._exit(0)  # no close, no cleanup: what a killed trainer leaves behind


def test_crashed_writers_segments_are_replaced_on_create(name):
    proc = SPAWN.Process(target=_crash_after_writing, args=(name,))
    proc.start()
    proc.join(PROC_TIMEOUT_S)
    assert proc.exitcode == 0
    reader = ShmWeightReader(name)
    assert reader.latest() == f"shm:{name}.0@7"  # leftovers are there ...
    state = small_state()
    with ShmWeightWriter(name, state) as writer:  # ... and a new writer of the same name replaces them
        assert reader.latest() is None
        loc = writer.write(constant_state(1, state), 1)
        assert_same(reader.open(loc), constant_state(1, state))
    reader.close()


# ---------------------------------------------------------------------------------------------
# Other processes
# ---------------------------------------------------------------------------------------------


def _read_in_child(name: str, location: str, results) -> None:
    reader = ShmWeightReader(name)
    tensors = reader.open(location)
    results.put({k: [str(t.dtype), list(t.shape), t.float().reshape(-1).tolist()] for k, t in tensors.items()})
    reader.close()


def test_reader_in_another_process_sees_the_values(name):
    state = small_state(seed=3)
    with ShmWeightWriter(name, state) as writer:
        loc = writer.write(state, 1)
        results = SPAWN.Queue()
        proc = SPAWN.Process(target=_read_in_child, args=(name, loc, results))
        proc.start()
        got = results.get(timeout=PROC_TIMEOUT_S)
        proc.join(PROC_TIMEOUT_S)
    assert proc.exitcode == 0
    assert list(got) == list(state)
    for k, t in state.items():
        assert got[k] == [str(t.dtype), list(t.shape), t.float().reshape(-1).tolist()], k


def _torn_state() -> dict[str, torch.Tensor]:
    # A few MB, so that writing one version takes long enough to overlap the reader's checks.
    return {
        "a": torch.zeros(1024, 1024, dtype=torch.bfloat16),
        "b": torch.zeros(512, 1024, dtype=torch.float32),
        "c": torch.zeros(4097, dtype=torch.int32),
    }


def _write_continuously(name: str, versions: int, announce, releases, results, finished) -> None:
    template = _torn_state()
    writer = ShmWeightWriter(name, template)
    version, busy = 0, 0
    releases.get(timeout=PROC_TIMEOUT_S)  # the reader is up (a READY barrier, not a sleep)
    try:
        while version < versions:
            state = constant_state(version + 1, template)
            while True:
                try:
                    loc = writer.write(state, version + 1)
                    break
                except BufferBusy:  # the reader has not left the buffer: wait for its release
                    busy += 1
                    writer.mark_released(releases.get(timeout=PROC_TIMEOUT_S))
            version += 1
            announce.put(loc)
            while True:  # take releases as they come, without waiting
                try:
                    writer.mark_released(releases.get_nowait())
                except queue.Empty:
                    break
        announce.put("")
        results.put({"versions": version, "busy": busy})
        finished.wait(PROC_TIMEOUT_S)  # keep the segments until the reader is done with them
    finally:
        writer.close()


def _read_continuously(name: str, announce, releases, results) -> None:
    reader = ShmWeightReader(name)
    releases.put(-1)
    serving, checked, torn, unavailable = None, 0, [], 0
    done = False
    while not done:
        loc = announce.get(timeout=PROC_TIMEOUT_S)
        while True:  # skip to the latest announcement
            try:
                loc = announce.get_nowait()
            except queue.Empty:
                break
        if loc == "":
            done = True
            break
        try:
            tensors = reader.open(loc)
        except VersionUnavailable:
            unavailable += 1
            continue
        version = parse_location(loc)[2]
        for k, t in tensors.items():
            if not bool((t == version % 200).all()):
                torn.append((version, k, t.reshape(-1)[:1].item(), t.reshape(-1)[-1:].item()))
        if not reader.verify(loc):
            torn.append((version, "verify", 0, 0))
        checked += 1
        if serving is not None:
            reader.release(serving)
        serving = version
        releases.put(version - 1)  # like a VersionAck(version): every older buffer is left
    results.put({"checked": checked, "torn": torn[:5], "unavailable": unavailable})
    reader.close()


def test_no_torn_reads_while_a_writer_process_writes_continuously(name):
    announce, releases, results, reader_results = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Queue(), SPAWN.Queue()
    finished = SPAWN.Event()
    writer = SPAWN.Process(target=_write_continuously, args=(name, 40, announce, releases, results, finished))
    writer.start()
    reader = SPAWN.Process(target=_read_continuously, args=(name, announce, releases, reader_results))
    reader.start()
    try:
        wrote = results.get(timeout=PROC_TIMEOUT_S)
        read = reader_results.get(timeout=PROC_TIMEOUT_S)
    finally:
        finished.set()
        for proc in (writer, reader):
            proc.join(PROC_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
    assert writer.exitcode == 0 and reader.exitcode == 0
    assert read["torn"] == []
    assert read["unavailable"] == 0  # a reader that releases what it left is never overwritten
    assert read["checked"] >= 20, read
    assert wrote["busy"] > 0, wrote  # the writer did run into the reader's buffer and waited
