"""Wire codec: messages to ZeroMQ frames and back. msgpack only; nothing here can unpickle.

Frames of one message: ``[header, buf_0, buf_1, ...]`` where header is a msgpack array

    [wire_version, tag, producer, body, arrays]

``body`` maps scalar field names to values; ``arrays`` lists ``[name, dtype, shape]`` for each raw
buffer frame that follows, in order. Arrays are sent without copying (pyzmq copies small frames
anyway, below its copy threshold) and decoded with ``np.frombuffer`` on the received frame: no copy
on either side. Every check a hostile or garbled frame could fail raises ``DecodeError``, which
channels count, log and drop.

The envelope carries only what a receiver acts on: the wire version (refuse what it cannot read), the
tag (which message) and the producer (who sent it, for logs and tests). No sequence number, message id
or policy versions: nothing read them, and the message id cost an ``os.urandom`` per message. The
policy version a payload was made under is part of the message itself (``Trajectory.versions``,
``VersionAnnounce.lineage``/``version``), where the node that needs it reads it.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import MISSING, dataclass, fields

import ml_dtypes
import msgpack
import numpy as np

from areal_bus.constants import MAX_FRAMES, MAX_HEADER_BYTES, WIRE_VERSION
from areal_bus.wire.messages import REGISTRY, IntRange

# The only dtypes that may cross the wire. bfloat16 comes from ml_dtypes (numpy has none).
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in ("bool", "int8", "uint8", "int16", "uint16", "int32", "int64", "float16", "float32", "float64")
}
DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
_DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}


class DecodeError(ValueError):
    """A frame set that is not a valid message of this wire version. Always caught by the receiver,
    counted under ``reason`` and dropped."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(slots=True, frozen=True)
class Envelope:
    wire_version: int
    tag: str
    producer: str


class _Spec:
    """Per-message-type field layout, worked out once from the dataclass."""

    def __init__(self, cls):
        hints = typing.get_type_hints(cls, include_extras=True)
        self.cls = cls
        self.arrays = tuple(cls.ARRAYS) if hasattr(cls, "ARRAYS") else ()
        # Per array: (dtype name, rank) it must have, or None (any wire dtype, any shape).
        kinds = getattr(cls, "ARRAY_KINDS", {})
        self.kinds = tuple(kinds.get(name) for name in self.arrays)
        # (name, allowed types, those types as a set, required, contents check or None). decode accepts
        # a value whose exact type is in the set without calling _check_scalar: what msgpack produces
        # is always an exact builtin type, and an exact match passes that check (bool only matches
        # where bool is allowed). The contents check is there only for hints that say more than a
        # type (list[str], dict[str, float], a bounded int): the free-form fields cost nothing.
        self.scalars = []
        for f in fields(cls):
            if f.name in self.arrays:
                continue
            required = f.default is MISSING and f.default_factory is MISSING
            allowed = _allowed(hints[f.name])
            self.scalars.append((f.name, allowed, frozenset(allowed), required, _contents_check(hints[f.name])))
        self.scalar_order = tuple(n for n, _, _, _, _ in self.scalars)
        self.scalar_names = frozenset(self.scalar_order)


def _allowed(hint) -> tuple[type, ...]:
    if typing.get_origin(hint) is typing.Annotated:
        return _allowed(typing.get_args(hint)[0])
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        out: tuple[type, ...] = ()
        for h in typing.get_args(hint):
            out += _allowed(h)
        return out
    if hint is type(None):
        return (type(None),)
    if hint is float:
        return (float, int)
    origin = typing.get_origin(hint)
    return (origin or hint,)


def _contents_check(hint):
    """For a field whose hint says more than its type: a function ``(name, value)`` that raises
    DecodeError when the value (already of the right type) breaks it; None otherwise. Nodes use these
    values as dict keys, array entries and counts: a TrajAck id that is a list, or a policy version
    past int32, must be refused here rather than crash the node that trusts it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        bounds = next((a for a in args[1:] if isinstance(a, IntRange)), None)
        if bounds is None:
            return _contents_check(args[0])
        lo, hi = bounds

        def in_range(name, value):
            if not lo <= value <= hi:
                raise DecodeError("out_of_range", f"{name}={value}"[:64])
        return in_range
    if (origin is list and args) or (origin is dict and args):
        ok = _element_test(hint)

        def contents(name, value):
            if not ok(value):
                raise DecodeError("bad_field", f"{name} holds values other than {hint}"[:64])
        return contents
    return None


def _element_test(hint):
    """A predicate: does a decoded value match ``hint`` (str, int, float, bool, list[X], dict[str, X])."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list and args:
        item = _element_test(args[0])
        return lambda v: type(v) is list and all(item(x) for x in v)
    if origin is dict and args:
        key, val = _element_test(args[0]), _element_test(args[1])
        return lambda v: type(v) is dict and all(key(k) and val(x) for k, x in v.items())
    if hint is float:
        return lambda v: type(v) is float or type(v) is int
    return lambda v: type(v) is hint  # exact: a bool is not an int here either


_SPECS = {tag: _Spec(cls) for tag, cls in REGISTRY.items()}


def _check_scalar(name: str, value, allowed: tuple[type, ...]):
    # bool is an int subclass: an int field must not silently accept True.
    if isinstance(value, bool) and bool not in allowed:
        raise DecodeError("bad_field", f"{name} is a bool")
    if not isinstance(value, allowed):
        raise DecodeError("bad_field", f"{name} has type {type(value).__name__}")


class Encoder:
    """Turns messages into frames for one producer."""

    def __init__(self, producer: str):
        self.producer = producer
        self._packer = msgpack.Packer(use_bin_type=True)

    def encode(self, msg) -> list:
        spec = _SPECS[msg.TAG]
        body = {name: getattr(msg, name) for name in spec.scalar_order}
        metas, bufs = [], []
        for name, kind in zip(spec.arrays, spec.kinds):
            arr = np.ascontiguousarray(getattr(msg, name))
            dname = _DTYPE_NAMES.get(arr.dtype)
            if dname is None:
                raise TypeError(f"{msg.TAG}.{name}: dtype {arr.dtype} cannot cross the wire")
            if kind is not None and (dname, arr.ndim) != kind:
                raise TypeError(f"{msg.TAG}.{name}: {arr.ndim}-d {dname}, must be {kind[1]}-d {kind[0]}")
            metas.append([name, dname, list(arr.shape)])
            # A flat uint8 view, still no copy: memoryview cannot export ml_dtypes types (bfloat16).
            bufs.append(memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else b"")
        header = self._packer.pack([WIRE_VERSION, msg.TAG, self.producer, body, metas])
        return [header, *bufs]


def decode(frames: typing.Sequence) -> tuple[Envelope, object]:
    """Frames (bytes, memoryview or zmq.Frame) to ``(Envelope, message)``. Raises DecodeError.

    This is every receiver's hot path (a trajectory is nine scalar fields and five arrays, thousands of
    times a second), so the per-field checks take short cuts (an exact-type set, plain loops instead
    of generators) that reach the same verdict, with the same reason, as the general ones.
    """
    if not frames:
        raise DecodeError("empty")
    if len(frames) > MAX_FRAMES:
        raise DecodeError("too_many_frames", str(len(frames)))
    head = _bytes_of(frames[0])
    if len(head) > MAX_HEADER_BYTES:
        raise DecodeError("header_too_large", str(len(head)))
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage; all mean the same
        raise DecodeError("bad_msgpack", type(exc).__name__) from None
    if not isinstance(header, list) or len(header) != 5:
        raise DecodeError("bad_envelope")
    wire_version, tag, producer, body, metas = header
    if wire_version != WIRE_VERSION:
        raise DecodeError("wire_version", repr(wire_version)[:32])
    spec = _SPECS.get(tag) if isinstance(tag, str) else None
    if spec is None:
        raise DecodeError("unknown_type", repr(tag)[:32])
    if not isinstance(producer, str):
        raise DecodeError("bad_envelope", "producer")
    if not isinstance(body, dict) or not isinstance(metas, list):
        raise DecodeError("bad_envelope", "body/arrays")
    kwargs = {}
    for name, allowed, exact, required, contents in spec.scalars:
        if name in body:
            value = body[name]
            if type(value) not in exact:
                _check_scalar(name, value, allowed)
            if contents is not None and value is not None:
                contents(name, value)
            kwargs[name] = value
        elif required:
            raise DecodeError("missing_field", name)
    if len(body) != len(kwargs):
        raise DecodeError("unknown_field", ",".join(sorted(map(str, set(body) - spec.scalar_names)))[:64])
    if len(metas) != len(spec.arrays) or len(frames) != 1 + len(metas):
        raise DecodeError("array_count", f"{len(metas)} metas, {len(frames) - 1} frames")
    for expected, kind, meta, frame in zip(spec.arrays, spec.kinds, metas, frames[1:]):
        kwargs[expected] = _array(expected, meta, frame, kind)
    env = Envelope(wire_version, tag, producer)
    return env, spec.cls(**kwargs)


def _array(expected: str, meta, frame, kind: tuple[str, int] | None = None) -> np.ndarray:
    if not (isinstance(meta, list) and len(meta) == 3 and meta[0] == expected):
        raise DecodeError("bad_array_meta", expected)
    _, dname, shape = meta
    dtype = DTYPES.get(dname) if isinstance(dname, str) else None
    if dtype is None:
        raise DecodeError("bad_dtype", repr(dname)[:32])
    if not (isinstance(shape, list) and len(shape) <= 8):
        raise DecodeError("bad_shape", expected)
    if kind is not None and (dname != kind[0] or len(shape) != kind[1]):
        raise DecodeError("bad_array_kind", f"{expected}: {len(shape)}-d {dname}"[:64])
    for d in shape:  # a loop, not all(<generator>): this runs for every array of every message
        # bool is an int subclass, but numpy will not reshape by one.
        if not (isinstance(d, int) and not isinstance(d, bool) and d >= 0):
            raise DecodeError("bad_shape", expected)
    buf = _buffer_of(frame)
    count = math.prod(shape)  # Python ints: a hostile shape must not wrap around in int64
    if buf.nbytes != count * dtype.itemsize:
        raise DecodeError("array_size", f"{expected}: {buf.nbytes} bytes for {shape} {dname}")
    arr = np.frombuffer(buf, dtype, count)
    if len(shape) == 1:
        return arr  # frombuffer is already 1-D
    try:
        return arr.reshape(shape)
    except ValueError:  # an empty array "shaped" [0, 2**63]: dimensions past what numpy can index
        raise DecodeError("bad_shape", f"{expected}: {shape}"[:64]) from None


def _buffer_of(frame) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame received with copy=False
    return buf if buf is not None else memoryview(frame)


def _bytes_of(frame) -> bytes | memoryview:
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else frame


def pack_topic(topic: bytes, frames: list) -> list:
    """Frames for a PUB socket: the topic first, so SUB prefix filtering works on it alone."""
    return [topic, *frames]
