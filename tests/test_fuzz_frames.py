"""Fuzzing frames: garbled and mutated messages, first into ``decode`` (which must refuse them with a
DecodeError and nothing else), then through real sockets into every socket the nodes of a small
simulated system bind. Each node must stay up, keep training, hold its memory, and count every frame
it refused (``dropped.<reason>`` in its heartbeat) exactly once. The mutations live in tests/fuzzing.py;
the same run for minutes: scripts/fuzz_frames.py.

Run: .venv/bin/pytest tests/test_fuzz_frames.py       (FUZZ_SEED=n replays another socket run)
"""

from __future__ import annotations

import os
import time

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_bus.wire import messages as m
from areal_bus.wire.codec import DecodeError, Encoder, decode
from areal_bus.constants import MAX_FRAMES, MAX_HEADER_BYTES, WIRE_VERSION
from tests.fuzzing import HUGE_DECLARED, Fuzzer, FuzzSystem, Mutator, as_bytes, sample

SEED = int(os.environ.get("FUZZ_SEED", "0"))
PER_CHANNEL = 150
"""Refused frames sent into each data channel and onto the hub: enough to cover every mutation many
times, few enough that a run takes seconds on a shared 2-core box."""
RSS_GROWTH_MB = 40.0
"""A node's resident memory may grow this much over a fuzz run (allocator slack, first-use caches);
a leak of even a few hundred bytes per refused frame over the longer script would exceed it."""


def _decodes_or_refuses(frames) -> None:
    try:
        env, msg = decode(frames)
    except DecodeError as err:
        assert err.reason and isinstance(err.reason, str)
        return
    assert type(msg) in m.REGISTRY.values() and env.tag == msg.TAG


# -- decode ---------------------------------------------------------------------------------------

@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(rnd=st.randoms(use_true_random=False))
def test_decode_refuses_mutated_messages_with_decode_error_only(rnd):
    mut = Mutator(rnd)
    _decodes_or_refuses(mut.garble())


@settings(max_examples=200)
@given(rnd=st.randoms(use_true_random=False))
def test_decode_accepts_odd_but_well_typed_values(rnd):
    frames = Mutator(rnd).odd_values()
    env, msg = decode(frames)  # every field has its declared type: this must decode
    assert env.tag == msg.TAG


@settings(max_examples=200)
@given(frames=st.lists(st.binary(max_size=64), max_size=MAX_FRAMES + 4))
def test_decode_refuses_random_frames_with_decode_error_only(frames):
    _decodes_or_refuses(frames)


_PACKABLE = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats()
    | st.text(max_size=12) | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16)


@settings(max_examples=200)
@given(tag=st.sampled_from(sorted(m.REGISTRY)), slot=st.integers(0, 4), value=_PACKABLE)
def test_decode_refuses_an_envelope_with_any_slot_replaced(tag, slot, value):
    frames = as_bytes(Encoder("p").encode(sample(m.REGISTRY[tag])))
    head = msgpack.unpackb(frames[0], raw=False)
    head[slot] = value
    _decodes_or_refuses([msgpack.packb(head, use_bin_type=True), *frames[1:]])


@pytest.mark.parametrize("prefix", HUGE_DECLARED, ids=["bin32", "str32", "array32", "map32", "ext32"])
def test_a_header_declaring_4_gib_is_refused_without_allocating_it(prefix):
    with pytest.raises(DecodeError) as err:
        decode([prefix + b"\x00" * 16])
    assert err.value.reason == "bad_msgpack"


def test_a_header_over_the_cap_is_refused_before_parsing():
    with pytest.raises(DecodeError) as err:
        decode([bytes(MAX_HEADER_BYTES + 1)])
    assert err.value.reason == "header_too_large"


@pytest.mark.parametrize("shape", [[0, 2**64 - 1], [0, 2**63], [0, 2**62], [2**40, 0, 2**40, 2**40]])
def test_an_empty_array_with_absurd_dimensions_is_refused(shape):
    # Found by this fuzzer: numpy's reshape raised ValueError, which no receiver caught.
    msg = m.Completion(request_id="r", episode_id="e", ticket=0, worker="w", output_ids=np.zeros(0, np.int32),
                       logprobs=np.zeros(0, np.float32), versions=np.zeros(0, np.int32))
    frames = as_bytes(Encoder("p").encode(msg))
    head = msgpack.unpackb(frames[0], raw=False)
    head[4][0][2] = shape
    with pytest.raises(DecodeError) as err:
        decode([msgpack.packb(head), *frames[1:]])
    assert err.value.reason == "bad_shape"


def test_an_ack_naming_an_id_that_is_not_a_string_is_refused():
    # Found by this fuzzer: the agent and the reward node looked such an id up in a dict and crashed.
    frames = as_bytes(Encoder("p").encode(m.TrajAck(trainer_version=1, consumed=["t-1", {"a": 1}], stale=[],
                                                    duplicate=[])))
    with pytest.raises(DecodeError) as err:
        decode(frames)
    assert err.value.reason == "bad_field"


@pytest.mark.parametrize("version", [-1, 2**31, 2**63 - 1])
def test_a_policy_version_outside_int32_is_refused(version):
    # Found by this fuzzer: a rollout worker took the announced version and crashed writing it into
    # the int32 version of every token.
    msg = m.VersionAnnounce(version=version, location="", nbytes=0, published_at=0.0)
    with pytest.raises(DecodeError) as err:
        decode(as_bytes(Encoder("p").encode(msg)))
    assert err.value.reason == "out_of_range"


def test_wire_version_is_what_the_samples_carry():
    assert msgpack.unpackb(as_bytes(Encoder("p").encode(sample(m.Event)))[0])[0] == WIRE_VERSION


# -- real nodes -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def system():
    sysm = FuzzSystem()
    try:
        sysm.start(timeout=90)
        sysm.wait(lambda: sysm.version() >= 2, 60, "the system to train two updates")
        yield sysm
    finally:
        sysm.stop()
        sysm.cleanup(keep=bool(os.environ.get("KEEP_SYSTEM_DIR")))


@pytest.mark.timeout(120)
def test_garbled_frames_into_every_bound_socket_are_dropped_and_counted(system):
    system.poll_beats(600)
    before = {kind: system.dropped(kind) for kind in system.procs}
    rss_before = {kind: system.rss_mb(kind) for kind in system.procs}
    version_before = system.version()
    fuzz = Fuzzer(system, SEED)
    try:
        more = fuzz.counted(PER_CHANNEL)
        expected = {kind: before[kind] + more[kind] for kind in before}
        try:
            system.wait(lambda: all(system.dropped(k) >= expected[k] for k in expected), 30,
                        "every refused frame to be counted")
        except AssertionError as err:
            raise AssertionError(f"{err}: expected {expected}, counted {({k: system.dropped(k) for k in expected})}, "
                                 f"by reason {system.drop_reasons()}") from None
        time.sleep(1.0)  # anything counted twice would show up by now
        system.poll_beats(600)
        assert {k: system.dropped(k) for k in expected} == expected
        fuzz.uncounted(20)
        system.wait(lambda: system.version() >= version_before + 3, 60, "training to go on after the fuzz")
    finally:
        fuzz.close()
    grown = {k: round(system.rss_mb(k) - rss_before[k], 1) for k in system.procs}
    assert all(g < RSS_GROWTH_MB for g in grown.values()), f"resident memory grew (MB): {grown}"


@pytest.mark.timeout(120)
def test_well_typed_messages_with_odd_values_crash_no_node(system):
    rss_before = {kind: system.rss_mb(kind) for kind in system.procs}
    fuzz = Fuzzer(system, SEED + 1)
    try:
        fuzz.odd(PER_CHANNEL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # a few main-loop turns of every node over what it got
            system.poll_beats(200)
            system.assert_alive()
    finally:
        fuzz.close()
    grown = {k: round(system.rss_mb(k) - rss_before[k], 1) for k in system.procs}
    assert all(g < RSS_GROWTH_MB for g in grown.values()), f"resident memory grew (MB): {grown}"
    codes = system.stop()
    assert codes == {kind: 0 for kind in system.procs}, f"nodes did not stop cleanly after the fuzz: {codes}"
