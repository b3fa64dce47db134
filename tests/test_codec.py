"""Wire codec: messages survive the trip (through decode and through real sockets) without copies,
and anything that is not a valid message of this wire version is a DecodeError, never a crash and
never code run on the receiver's behalf."""

from __future__ import annotations

import os
import pickle

import ml_dtypes
import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_bus.wire import messages as m
from areal_bus.wire.channels import open_socket
from areal_bus.wire.codec import DTYPES, DecodeError, Encoder, decode
from areal_bus.constants import MAX_FRAMES, MAX_HEADER_BYTES, WIRE_VERSION

ARRAY_FIELDS = m.Trajectory.ARRAYS


def _frames(msg) -> list[bytes]:
    return [bytes(f) for f in Encoder("rollout-0").encode(msg)]


def _assert_same_trajectory(got: m.Trajectory, sent: m.Trajectory) -> None:
    for name in ARRAY_FIELDS:
        a, b = getattr(got, name), getattr(sent, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        # Compare bits, not values: exact for every dtype (bfloat16 and NaN included).
        assert a.tobytes() == np.ascontiguousarray(b).tobytes(), name
    for name in ("traj_id", "episode_id", "ticket", "worker", "reward", "group_id", "finish_reason",
                 "gen_seconds", "meta"):
        assert getattr(got, name) == getattr(sent, name), name


def _assert_valid(decoded) -> None:
    env, msg = decoded
    assert type(msg) is m.REGISTRY[env.tag]
    for name in getattr(type(msg), "ARRAYS", ()):
        assert getattr(msg, name).dtype in DTYPES.values()


@pytest.fixture
def pipe(ctx, endpoint):
    pull = open_socket(ctx, zmq.PULL, endpoint("codec"), bind=True)
    push = open_socket(ctx, zmq.PUSH, endpoint("codec"), bind=False)
    return push, pull


# -- round trips -----------------------------------------------------------------------------------

def test_trajectory_with_int32_and_float32_arrays_round_trips(make_traj):
    sent = make_traj("a", ticket=7, versions=(3, 3, 4), reward=0.5, meta={"turns": 2})
    _, got = decode(_frames(sent))
    _assert_same_trajectory(got, sent)


def test_bfloat16_arrays_round_trip_bit_exact(make_traj):
    sent = make_traj(versions=(0, 1, 2, 3), logprob_dtype=ml_dtypes.bfloat16)
    sent.logprobs[1] = np.nan
    _, got = decode(_frames(sent))
    assert got.logprobs.dtype == np.dtype(ml_dtypes.bfloat16)
    _assert_same_trajectory(got, sent)


def test_empty_arrays_round_trip(make_traj):
    sent = make_traj(versions=(), prompt_len=0)
    _, got = decode(_frames(sent))
    assert all(getattr(got, name).size == 0 for name in ARRAY_FIELDS)
    _assert_same_trajectory(got, sent)


def test_multidimensional_and_strided_arrays_round_trip(make_traj):
    sent = make_traj()
    sent.prompt_ids = np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2]  # not contiguous
    _, got = decode(_frames(sent))
    assert got.prompt_ids.shape == (4, 3)
    np.testing.assert_array_equal(got.prompt_ids, sent.prompt_ids)


def test_envelope_carries_wire_version_tag_and_producer(make_traj):
    env, _ = decode(Encoder("reward-0").encode(make_traj("a")))
    assert (env.wire_version, env.tag, env.producer) == (WIRE_VERSION, "traj", "reward-0")


def test_the_same_message_encodes_to_the_same_bytes(make_traj):
    # Nothing per-send in the envelope (no sequence number, no random id): a resent message is the
    # same bytes, and encoding draws no randomness.
    enc, sent = Encoder("reward-0"), make_traj("a")
    assert [bytes(f) for f in enc.encode(sent)] == [bytes(f) for f in enc.encode(sent)]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("case", ["int32", "float32", "bfloat16", "empty"])
def test_trajectory_round_trips_through_push_pull(case, pipe, make_traj, send_within, recv_within):
    sent = {
        "int32": lambda: make_traj(versions=tuple(range(50))),
        "float32": lambda: make_traj(versions=(1,) * 5000),  # above pyzmq's copy threshold
        "bfloat16": lambda: make_traj(versions=(2,) * 300, logprob_dtype=ml_dtypes.bfloat16),
        "empty": lambda: make_traj(versions=(), prompt_len=0),
    }[case]()
    push, pull = pipe
    send_within(push, Encoder("rollout-0").encode(sent))
    _, got = decode(recv_within(pull))
    _assert_same_trajectory(got, sent)


@pytest.mark.timeout(10)
def test_received_arrays_are_views_of_the_received_frames(pipe, make_traj, send_within, recv_within):
    push, pull = pipe
    send_within(push, Encoder("rollout-0").encode(make_traj(versions=(0,) * 5000)))
    frames = recv_within(pull)
    _, got = decode(frames)
    for name, frame in zip(ARRAY_FIELDS, frames[1:]):
        assert np.shares_memory(getattr(got, name), np.frombuffer(frame.buffer, np.uint8)), name


def test_encoding_does_not_copy_arrays(make_traj):
    sent = make_traj(versions=(0,) * 100)
    frames = Encoder("rollout-0").encode(sent)
    for name, frame in zip(ARRAY_FIELDS, frames[1:]):
        assert np.shares_memory(getattr(sent, name), np.frombuffer(frame, np.uint8)), name


def test_dtype_that_cannot_cross_the_wire_is_refused_at_encode(make_traj):
    bad = make_traj()
    bad.logprobs = np.array([object()], dtype=object)
    with pytest.raises(TypeError, match="cannot cross the wire"):
        Encoder("rollout-0").encode(bad)


# -- sampling options and top logprobs ------------------------------------------------------------

def _completion(n=3, k=2):
    return m.Completion(request_id="r", episode_id="e", ticket=0, worker="w",
                        output_ids=np.arange(n, dtype=np.int32), logprobs=-np.arange(n, dtype=np.float32),
                        versions=np.zeros(n, np.int32), finish_reason="stop",
                        top_ids=np.arange(n * k, dtype=np.int32).reshape(n, k),
                        top_logprobs=-np.arange(n * k, dtype=np.float32).reshape(n, k))


def test_a_requests_grammar_top_logprobs_seed_and_top_k_round_trip():
    sent = m.GenerateRequest(request_id="r", episode_id="e", ticket=0, min_version=0, max_tokens=4, temperature=1.0,
                             prompt_ids=np.arange(3, dtype=np.int32), grammar='root ::= "{" [a-z]* "}"',
                             top_logprobs=m.MAX_TOP_LOGPROBS, seed=2**63 - 1, top_k=40)
    _, got = decode(_frames(sent))
    assert (got.grammar, got.top_logprobs, got.seed, got.top_k) == (sent.grammar, 20, 2**63 - 1, 40)
    _, plain = decode(_frames(m.GenerateRequest("r", "e", 0, 0, 4, 1.0, np.arange(3, dtype=np.int32))))
    assert (plain.grammar, plain.top_logprobs, plain.seed, plain.top_k) == ("", 0, -1, 0)


def test_top_ids_and_top_logprobs_round_trip_in_completions_and_partials():
    for sent in (_completion(), m.PartialCompletion("r", 5, np.arange(3, dtype=np.int32),
                                                    np.ones((3, 4), np.int32), np.zeros((3, 4), np.float32))):
        _, got = decode(_frames(sent))
        for name in ("top_ids", "top_logprobs"):
            a, b = getattr(got, name), getattr(sent, name)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    _, empty = decode(_frames(m.PartialCompletion("r", 0, np.arange(2, dtype=np.int32))))
    assert empty.top_ids.shape == empty.top_logprobs.shape == (0, 0)


def _top_ids_meta(edit):
    frames = _frames(_completion())
    header = msgpack.unpackb(frames[0])
    edit(header[4][3], frames)  # [name, dtype, shape] of top_ids, and the frames (top_ids is frames[4])
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


@pytest.mark.parametrize("edit,reason", [
    (lambda meta, fr: meta.__setitem__(1, "float32"), "bad_array_kind"),  # same bytes, another dtype
    (lambda meta, fr: meta.__setitem__(2, [6]), "bad_array_kind"),  # the same ids, flattened
    (lambda meta, fr: meta.__setitem__(2, [3, 3]), "array_size"),  # wider than its bytes
    (lambda meta, fr: fr.__setitem__(4, fr[4][:-4]), "array_size"),
    (lambda meta, fr: meta.__setitem__(0, "top_logprobs"), "bad_array_meta"),
], ids=["float_ids", "one_dimensional", "shape_past_its_bytes", "truncated", "misnamed"])
def test_a_malformed_top_ids_array_is_a_decode_error(edit, reason):
    with pytest.raises(DecodeError) as err:
        decode(_top_ids_meta(edit))
    assert err.value.reason == reason


def test_top_logprobs_out_of_range_are_a_decode_error():
    frames = _frames(m.GenerateRequest("r", "e", 0, 0, 4, 1.0, np.arange(3, dtype=np.int32)))
    for field, value in (("top_logprobs", 21), ("seed", -2), ("top_k", -1)):
        header = msgpack.unpackb(frames[0])
        header[3][field] = value
        with pytest.raises(DecodeError) as err:
            decode([msgpack.packb(header, use_bin_type=True), *frames[1:]])
        assert err.value.reason == "out_of_range", field


def test_top_arrays_of_another_dtype_or_rank_are_refused_at_encode():
    bad = _completion()
    bad.top_ids = bad.top_ids.reshape(-1)
    with pytest.raises(TypeError, match="top_ids: 1-d int32, must be 2-d int32"):
        Encoder("rollout-0").encode(bad)


# -- pickle is never unpickled --------------------------------------------------------------------

class _Exploit:
    """Unpickling this creates ``path``: proof that a pickle ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_header_is_refused_and_never_run(protocol, tmp_path):
    flag = tmp_path / "pwned"
    with pytest.raises(DecodeError):
        decode([pickle.dumps(_Exploit(flag), protocol=protocol)])
    assert not flag.exists()


def test_pickle_in_an_object_dtype_array_frame_is_refused_and_never_run(make_traj, tmp_path):
    flag = tmp_path / "pwned"
    frames = _frames(make_traj())
    header = msgpack.unpackb(frames[0])
    header[4][2][1] = "object"  # logprobs: ask the receiver to unpickle
    frames[0] = msgpack.packb(header, use_bin_type=True)
    frames[3] = pickle.dumps(np.array([_Exploit(flag)], dtype=object))
    with pytest.raises(DecodeError) as err:
        decode(frames)
    assert err.value.reason == "bad_dtype"
    assert not flag.exists()


@pytest.mark.timeout(10)
def test_pickle_sent_over_a_socket_is_refused_and_never_run(pipe, tmp_path, send_within, recv_within):
    flag = tmp_path / "pwned"
    push, pull = pipe
    send_within(push, [pickle.dumps(_Exploit(flag))])
    with pytest.raises(DecodeError):
        decode(recv_within(pull))
    assert not flag.exists()


# -- malformed input: one DecodeError, with the reason ----------------------------------------------

def _valid():
    traj = m.Trajectory(traj_id="a", episode_id="a", ticket=0, worker="w",
                        prompt_ids=np.arange(4, dtype=np.int32), output_ids=np.arange(3, dtype=np.int32),
                        logprobs=np.zeros(3, np.float32), versions=np.zeros(3, np.int32),
                        loss_mask=np.ones(3, np.uint8))
    frames = _frames(traj)
    return msgpack.unpackb(frames[0]), frames[1:]


def _with_header(edit):
    header, arrays = _valid()
    edit(header)
    return [msgpack.packb(header, use_bin_type=True), *arrays]


def _with_arrays(edit):
    header, arrays = _valid()
    return [msgpack.packb(header, use_bin_type=True), *edit(arrays)]


def _empty_prompt_of_shape(shape):
    header, arrays = _valid()
    header[4][0][2] = shape
    return [msgpack.packb(header, use_bin_type=True), b"", *arrays[1:]]


MALFORMED = {
    "empty": (lambda: [], "empty"),
    "garbled": (lambda: [b"\xc1\xc1\xc1 not msgpack"], "bad_msgpack"),
    "truncated_header": (lambda: [_with_header(lambda h: None)[0][:-5]], "bad_msgpack"),
    "header_not_an_envelope": (lambda: [msgpack.packb({"tag": "traj"})], "bad_envelope"),
    "header_too_large": (lambda: [msgpack.packb(b"x" * MAX_HEADER_BYTES)], "header_too_large"),
    "too_many_frames": (lambda: _with_arrays(lambda a: a + [b""] * MAX_FRAMES), "too_many_frames"),
    "unknown_wire_version": (lambda: _with_header(lambda h: h.__setitem__(0, WIRE_VERSION + 1)), "wire_version"),
    "unknown_type": (lambda: _with_header(lambda h: h.__setitem__(1, "exec")), "unknown_type"),
    "producer_not_a_string": (lambda: _with_header(lambda h: h.__setitem__(2, 7)), "bad_envelope"),
    "envelope_with_an_extra_item": (lambda: _with_header(lambda h: h.insert(3, 1)), "bad_envelope"),
    "field_of_wrong_type": (lambda: _with_header(lambda h: h[3].__setitem__("ticket", "7")), "bad_field"),
    "bool_for_an_int_field": (lambda: _with_header(lambda h: h[3].__setitem__("ticket", True)), "bad_field"),
    "missing_field": (lambda: _with_header(lambda h: h[3].pop("traj_id")), "missing_field"),
    "extra_field": (lambda: _with_header(lambda h: h[3].__setitem__("cmd", "rm -rf /")), "unknown_field"),
    "extra_field_with_bytes_key": (lambda: _with_header(lambda h: h[3].__setitem__(b"cmd", 1)), "unknown_field"),
    "array_size_mismatch": (lambda: _with_arrays(lambda a: [a[0][:-1], *a[1:]]), "array_size"),
    "array_frame_missing": (lambda: _with_arrays(lambda a: a[:-1]), "array_count"),
    "array_frame_extra": (lambda: _with_arrays(lambda a: a + [b""]), "array_count"),
    "array_meta_misnamed": (lambda: _with_header(lambda h: h[4][0].__setitem__(0, "output_ids")), "bad_array_meta"),
    "unknown_dtype": (lambda: _with_header(lambda h: h[4][0].__setitem__(1, "complex128")), "bad_dtype"),
    "negative_dim": (lambda: _with_header(lambda h: h[4][0].__setitem__(2, [-4])), "bad_shape"),
    "bool_dim": (lambda: _with_header(lambda h: h[4][0].__setitem__(2, [True])), "bad_shape"),
    # 2**32 * 2**32 wraps to 0 in int64: an empty frame must still be a size mismatch, not a reshape crash.
    "shape_overflowing_int64": (lambda: _empty_prompt_of_shape([2**32, 2**32]), "array_size"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_frames_raise_decode_error_with_reason(case):
    build, reason = MALFORMED[case]
    with pytest.raises(DecodeError) as err:
        decode(build())
    assert err.value.reason == reason


def test_decode_error_is_a_value_error_carrying_its_reason():
    with pytest.raises(ValueError, match="^unknown_type"):
        decode(_with_header(lambda h: h.__setitem__(1, "nope")))


# -- fuzzing: DecodeError or a valid message, nothing else -------------------------------------------

@settings(max_examples=300)
@given(st.lists(st.binary(max_size=64), max_size=MAX_FRAMES + 2))
def test_random_frames_decode_to_decode_error_or_valid_message(frames):
    try:
        _assert_valid(decode(frames))
    except DecodeError:
        pass


@st.composite
def _mutated_frames(draw):
    header, arrays = _valid()
    frames = [msgpack.packb(header, use_bin_type=True), *arrays]
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(frames) - 1)) if frames else 0
        op = draw(st.sampled_from(["flip", "truncate", "insert", "drop_frame", "add_frame"]))
        if op == "add_frame" or not frames:
            frames.insert(i, draw(st.binary(max_size=16)))
        elif op == "drop_frame":
            frames.pop(i)
        else:
            data = bytearray(frames[i])
            pos = draw(st.integers(0, len(data)))
            if op == "flip" and data:
                data[min(pos, len(data) - 1)] ^= draw(st.integers(1, 255))
            elif op == "truncate":
                del data[pos:]
            else:
                data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
            frames[i] = bytes(data)
    return frames


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated_frames())
def test_mutated_valid_frames_decode_to_decode_error_or_valid_message(frames):
    try:
        _assert_valid(decode(frames))
    except DecodeError:
        pass


_any_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4) | st.binary(max_size=4),
                                                               inner, max_size=4),
    max_leaves=10,
)
_dims = st.lists(st.integers(-1, 2**64 - 1) | st.integers(0, 8) | st.booleans(), max_size=3)


@st.composite
def _hostile_frames(draw):
    """A valid trajectory's frames with hostile values swapped in where a sender controls them."""
    header, arrays = _valid()
    for key in draw(st.lists(st.sampled_from(sorted(header[3])) | st.text(max_size=4) | st.binary(max_size=4),
                             max_size=3)):
        header[3][key] = draw(_any_value)
    for meta in header[4]:
        if draw(st.booleans()):
            part = draw(st.integers(0, 2))
            meta[part] = draw([st.sampled_from(ARRAY_FIELDS) | _any_value,
                               st.sampled_from([*DTYPES, "object", "<i4"]) | _any_value,
                               _dims | _any_value][part])
    for pos in range(1, 5):  # tag, producer, body, metas
        if draw(st.integers(0, 7)) == 0:
            header[pos] = draw(_any_value)
    arrays = draw(st.just(arrays) | st.lists(st.binary(max_size=24), max_size=6))
    return [msgpack.packb(header, use_bin_type=True), *arrays]


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(_hostile_frames())
def test_hostile_headers_decode_to_decode_error_or_valid_message(frames):
    try:
        _assert_valid(decode(frames))
    except DecodeError:
        pass
