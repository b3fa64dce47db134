"""Frame fuzzing shared by tests/test_fuzz_frames.py and scripts/fuzz_frames.py: valid messages of
every registered type, a mutator that garbles them the ways a broken or hostile peer would, and a
small simulated system of real node processes to throw them at.

Mutations (``Mutator.garble``): truncated, flipped, spliced, dropped, duplicated, swapped and extra
frames; an empty or a frame-flooded multipart; envelopes with a slot replaced (wire version, tag,
producer, body, array metas); bodies with a field of the wrong type, missing or
unknown; array metas with another or an unknown dtype, wrong or absurd shapes (negative, bool,
float, 2**64 - 1), the wrong name; array frames of the wrong size; headers that are not msgpack,
msgpack of junk, msgpack that declares a 4 GiB string, array or map, and headers over the size cap.
``Mutator.odd_values`` keeps every field's type (so the message decodes) but fills it with extremes
and junk: the input a node must survive without the codec's help.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

import msgpack
import numpy as np
import yaml
import zmq

from areal_bus.wire import messages as m
from areal_bus.wire.codec import DTYPES, DecodeError, Encoder, decode
from areal_bus.constants import MAX_FRAMES, MAX_HEADER_BYTES, WIRE_VERSION

REPO = Path(__file__).resolve().parents[1]
EXTREME_INTS = (0, 1, -1, 2**31 - 1, -(2**31), 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1)
ODD_FLOATS = (0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e308, -1e-308, 5e-324)
# msgpack prefixes that declare a 4 GiB payload: bin32, str32, array32, map32, ext32.
HUGE_DECLARED = (b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
                 b"\xdf\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01")


# -- valid messages ---------------------------------------------------------------------------------

def sample(cls, n: int = 3):
    """A valid instance of message class ``cls``, every field filled from its type hint, so that new
    fields in messages.py are covered without touching this file."""
    hints = typing.get_type_hints(cls)
    arrays = set(getattr(cls, "ARRAYS", ()))
    kinds = getattr(cls, "ARRAY_KINDS", {})
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in kinds:  # an array of a fixed dtype and rank
            dtype, rank = kinds[f.name]
            kwargs[f.name] = np.arange(n * 2 ** (rank - 1), dtype=dtype).reshape((n,) + (2,) * (rank - 1))
            continue
        if f.name in arrays:
            kwargs[f.name] = np.arange(n, dtype=np.int32)
            continue
        hint = hints[f.name]
        args = typing.get_args(hint)
        base = typing.get_origin(hint) or hint
        if type(None) in args:
            kwargs[f.name] = None
        elif base is str:
            kwargs[f.name] = f"{f.name}-0"
        elif base is bool:
            kwargs[f.name] = False
        elif base is int:
            kwargs[f.name] = 1
        elif base is float:
            kwargs[f.name] = 0.5
        elif base is list:
            kwargs[f.name] = []
        elif base is dict:
            kwargs[f.name] = {}
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no sample for {hint}")
    return cls(**kwargs)


def samples() -> list:
    return [sample(cls) for cls in m.REGISTRY.values()]


def as_bytes(frames) -> list[bytes]:
    return [bytes(f) for f in frames]


def verdict(frames) -> str | None:
    """The tag of the message ``frames`` decode to, or None if decode refuses them."""
    try:
        return decode(frames)[1].TAG
    except DecodeError:
        return None


# -- mutations --------------------------------------------------------------------------------------

class Mutator:
    """Garbles frame lists; every choice comes from ``rnd``, so a seed replays a run exactly."""

    def __init__(self, rnd: random.Random):
        self.rnd = rnd
        self.enc = Encoder("fuzz-0")
        self.valid = samples()

    # values ----------------------------------------------------------------------------------------
    def junk(self, depth: int = 0):
        r = self.rnd
        kind = r.randrange(11 if depth < 2 else 8)
        if kind == 0:
            return None
        if kind == 1:
            return r.random() < 0.5
        if kind == 2:
            return r.choice(EXTREME_INTS)
        if kind == 3:
            return r.randrange(-1000, 1000)
        if kind == 4:
            return r.choice(ODD_FLOATS)
        if kind == 5:
            chars = (chr(r.choice((r.randrange(32, 127), r.randrange(0xA0, 0xD7FF)))) for _ in range(r.randrange(12)))
            return "".join(chars)
        if kind == 6:
            return r.randbytes(r.randrange(12))
        if kind == 7:
            return msgpack.ExtType(r.randrange(128), r.randbytes(r.randrange(6)))
        if kind == 8:
            return [self.junk(depth + 1) for _ in range(r.randrange(4))]
        if kind == 9:
            return {self.junk_key(): self.junk(depth + 1) for _ in range(r.randrange(4))}
        return r.choice(list(m.REGISTRY))  # a real tag in the wrong place

    def junk_key(self):
        return self.rnd.choice(("", "node_id", "kind", "version", "x" * self.rnd.randrange(1, 40)))

    def junk_shape(self):
        r = self.rnd
        return r.choice([
            [r.choice(EXTREME_INTS)], [0, 2**64 - 1], [2**32, 2**32], [-1], [True], [1.5], ["3"], [[3]],
            [1] * r.randrange(9, 12), [], 3, None, [0, 2**62], [r.randrange(5) for _ in range(r.randrange(1, 4))],
        ])

    # one mutation ----------------------------------------------------------------------------------
    def garble(self, frames: list[bytes] | None = None) -> list[bytes]:
        """One to three mutations of a valid message's frames (a random one if none is given)."""
        r = self.rnd
        frames = list(frames) if frames is not None else as_bytes(self.enc.encode(r.choice(self.valid)))
        for _ in range(r.randrange(1, 4)):
            op = r.choice(self._OPS)
            frames = op(self, frames)
        return frames

    def _truncate(self, fr):
        i = self.rnd.randrange(len(fr)) if fr else None
        if i is None:
            return fr
        fr[i] = fr[i][:self.rnd.randrange(len(fr[i]) + 1)]
        return fr

    def _flip(self, fr):
        i = self.rnd.randrange(len(fr)) if fr else None
        if i is None or not fr[i]:
            return fr
        b = bytearray(fr[i])
        for _ in range(self.rnd.randrange(1, 5)):
            b[self.rnd.randrange(len(b))] ^= 1 << self.rnd.randrange(8)
        fr[i] = bytes(b)
        return fr

    def _splice(self, fr):
        if not fr:
            return [self.rnd.randbytes(8)]
        i = self.rnd.randrange(len(fr))
        at = self.rnd.randrange(len(fr[i]) + 1)
        fr[i] = fr[i][:at] + self.rnd.randbytes(self.rnd.randrange(1, 16)) + fr[i][at:]
        return fr

    def _frames(self, fr):
        r = self.rnd
        how = r.randrange(6)
        if how == 0 and fr:
            del fr[r.randrange(len(fr))]
        elif how == 1 and fr:
            fr.insert(r.randrange(len(fr) + 1), fr[r.randrange(len(fr))])
        elif how == 2:
            fr.insert(r.randrange(len(fr) + 1), r.randbytes(r.randrange(40)))
        elif how == 3 and len(fr) > 1:
            i, j = r.sample(range(len(fr)), 2)
            fr[i], fr[j] = fr[j], fr[i]
        elif how == 4:
            fr = fr + [b""] * r.randrange(MAX_FRAMES - len(fr) + 1, MAX_FRAMES + 8)
        else:
            fr = [] if r.random() < 0.5 else [b""]
        return fr

    def _header(self, fr):
        """Replace one slot of the envelope, or reshape the envelope list itself."""
        head = self._unpacked(fr)
        if head is None:
            return fr
        r = self.rnd
        slot = r.randrange(6)
        if slot == 5:
            head = head[:r.randrange(len(head))] if r.random() < 0.5 else head + [self.junk()]
        elif slot == 0:
            head[0] = r.choice((0, WIRE_VERSION + 1, -1, 2**64 - 1, "1", 1.0, None))
        elif slot == 1:
            head[1] = r.choice((r.choice(list(m.REGISTRY)), "", "nope", 7, None, b"traj"))
        else:
            head[slot] = self.junk()
        return [self._pack(head), *fr[1:]]

    def _body(self, fr):
        head = self._unpacked(fr)
        if head is None or not isinstance(head[3], dict):
            return fr
        body, r = head[3], self.rnd
        how = r.randrange(4)
        if how == 0 and body:
            body[r.choice(list(body))] = self.junk()
        elif how == 1 and body:
            del body[r.choice(list(body))]
        elif how == 2:
            body[self.junk_key()] = self.junk()
        else:
            head[3] = self.junk()
        return [self._pack(head), *fr[1:]]

    def _metas(self, fr):
        head = self._unpacked(fr)
        if head is None or not isinstance(head[4], list):
            return fr
        metas, r = head[4], self.rnd
        if not metas or r.random() < 0.15:
            head[4] = metas + [["extra", "int32", [1]]] if r.random() < 0.5 else self.junk()
            return [self._pack(head), *fr[1:]]
        i = r.randrange(len(metas))
        meta = metas[i]
        how = r.randrange(6) if isinstance(meta, list) and len(meta) == 3 else 3
        if how == 0:
            meta[1] = r.choice((*DTYPES, "object", "complex128", "<U4", "", 5, None))
        elif how == 1:
            meta[2] = self.junk_shape()
        elif how == 2:
            meta[0] = r.choice(("", "prompt_ids", "output_ids", "versions", 7))
        elif how == 3:
            metas[i] = self.junk()
        elif how == 4 and 1 + i < len(fr):  # an array frame of another size than its meta says
            fr = list(fr)
            fr[1 + i] = r.randbytes(r.randrange(0, 64))
        else:  # same bytes, another dtype of the same item size: decodes, with other values
            meta[1] = r.choice([n for n, d in DTYPES.items() if d.itemsize == 4] or ["int32"])
        return [self._pack(head), *fr[1:]]

    def _not_msgpack(self, fr):
        r = self.rnd
        how = r.randrange(4)
        if how == 0:
            head = r.randbytes(r.randrange(1, 64))
        elif how == 1:
            head = self._pack(self.junk())
        elif how == 2:
            head = r.choice(HUGE_DECLARED) + r.randbytes(r.randrange(8))
        else:
            head = b"\xc6" + (MAX_HEADER_BYTES + 1).to_bytes(4, "big") + bytes(MAX_HEADER_BYTES + 1)
        return [head, *fr[1:]]

    def _unpacked(self, fr):
        if not fr:
            return None
        try:
            head = msgpack.unpackb(fr[0], raw=False, strict_map_key=False)
        except Exception:  # already garbled by an earlier mutation
            return None
        return head if isinstance(head, list) and len(head) == 8 else None

    @staticmethod
    def _pack(obj) -> bytes:
        return msgpack.packb(obj, use_bin_type=True)

    _OPS = (_truncate, _flip, _splice, _frames, _header, _header, _body, _body, _metas, _metas, _not_msgpack)

    # decodable oddities -----------------------------------------------------------------------------
    def odd_values(self, cls=None):
        """A message of a random (or the given) type whose fields all keep their declared types and
        bounds, filled with extremes and junk: it decodes, and the node that gets it must cope.
        Returns its frames."""
        r = self.rnd
        cls = cls or r.choice(list(m.REGISTRY.values()))
        msg = sample(cls)
        hints = typing.get_type_hints(cls, include_extras=True)
        arrays = set(getattr(cls, "ARRAYS", ()))
        kinds = getattr(cls, "ARRAY_KINDS", {})
        for f in dataclasses.fields(cls):
            if r.random() < 0.4:
                continue
            if f.name in arrays:
                shapes = ((0,), (r.randrange(1, 20),), (2, 3), (1, 1, 2), (0, 4))
                dt = r.choice(list(DTYPES.values()))
                if f.name in kinds:  # its dtype and rank are fixed: only the sizes may be odd
                    dt = DTYPES[kinds[f.name][0]]
                    shapes = tuple(s for s in shapes if len(s) == kinds[f.name][1])
                shape = r.choice(shapes)
                setattr(msg, f.name, np.full(shape, r.choice((-1, 0, 1, 127)), dtype=np.int64).astype(dt))
            else:
                setattr(msg, f.name, self._odd(hints[f.name]))
        return as_bytes(self.enc.encode(msg))

    def _odd(self, hint, depth: int = 0):
        r = self.rnd
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is typing.Annotated:
            bounds = next((a for a in args[1:] if isinstance(a, m.IntRange)), None)
            if bounds is None:
                return self._odd(args[0], depth)
            return r.choice((bounds.lo, bounds.hi, bounds.lo + 1, bounds.hi - 1, r.randrange(bounds.lo, bounds.hi)))
        if args and type(None) in args:
            return None if r.random() < 0.3 else self._odd(next(a for a in args if a is not type(None)), depth)
        if origin is list:
            return [self._odd(args[0], depth + 1) if args else self.junk(depth + 1) for _ in range(r.randrange(5))]
        if origin is dict or hint is dict:
            value = args[1] if args else None
            return {self.junk_key(): self._odd(value, depth + 1) if value is not None else self.junk(depth + 1)
                    for _ in range(r.randrange(5))}
        if hint is list:
            return [self.junk(depth + 1) for _ in range(r.randrange(5))]
        if hint is str:
            return r.choice(("", "x" * r.randrange(1, 2000), "rollout-0", "trainer-0", "\u2603", "../../etc/passwd",
                             "shm:nope.0@1"))
        if hint is bool:
            return r.random() < 0.5
        if hint is int:
            return r.choice(EXTREME_INTS)
        if hint is float:
            return r.choice(ODD_FLOATS)
        raise TypeError(f"no odd value for {hint}")


# -- a system of real node processes ----------------------------------------------------------------

def venv_bin() -> Path:
    here = Path(sys.executable).parent
    return here if (here / "areal-bus").exists() else REPO / ".venv" / "bin"


def sim_topology(ipc_dir: Path, **overrides) -> dict:
    """A simulated run that never ends by itself, with every node kind that binds a data channel."""
    data = {
        "name": "fuzz", "rollout_workers": 1, "staleness_threshold": 2, "queue_max_size": 64,
        "trigger_batch_size": 4, "global_batch_size": 8, "mini_batch_size": 4, "max_steps": 10_000_000,
        "logging": {"log_dir": "logs", "log_interval": 50, "save_interval": 0},
        "agent": {"framework": "sim", "max_turns": 1, "reward_source": "rule", "prompt_len": 16},
        "rollout_engine": {"kind": "sim", "max_batch": 8, "decode_step_s": 0.001, "decode_step_per_seq_s": 0.00001,
                           "swap_s": 0.001, "output_len": {"dist": "uniform", "min": 8, "max": 32}},
        "trainer_engine": {"kind": "sim", "time_per_token_s": 0.00001, "update_overhead_s": 0.05},
        "endpoints": {"transport": "ipc", "ipc_dir": str(ipc_dir)},
        "nodes": {"bus": {}, "agent": {"replicas": 1}, "reward": {"replicas": 1}, "trainer": {}, "weights": {},
                  # The gateway binds the gwork ROUTER that rollout workers' DEALERs join; it needs the
                  # shipped model's tokenizer, and an HTTP port nobody else has (0: any free one).
                  "gateway": {"config": {"port": 0, "admin_token": "fuzz-admin-token"}}},
        "model": {"path": str(REPO / "models" / "tiny-guess")},
    }
    data.update(overrides)
    return data


KINDS = ("bus", "weights", "trainer", "reward", "rollout", "agent", "gateway")

# Sockets each node kind binds, as (channel, replica, what it receives). PUSH sockets (the agent's
# work channel) receive nothing a peer sends: only raw bytes can be thrown at them.
BOUND = {"bus": [("hub_in", 0, "xsub"), ("hub_out", 0, "xpub")], "agent": [("replies", 0, "pull"), ("work", 0, "push")],
         "reward": [("samples", 0, "pull")], "trainer": [("train", 0, "pull")], "weights": [("weights", 0, "pull")],
         "gateway": [("gwork", 0, "router")]}
ACCEPTS = {"replies": m.Completion.TAG, "samples": m.Trajectory.TAG, "train": m.Trajectory.TAG,
           "weights": m.WeightsReady.TAG, "gwork": None}
"""The one message type each data channel takes; anything else that arrives there is dropped and
counted as ``dropped.*``. The gateway counts a well-formed reply it did not ask for under
``gateway.unexpected_replies`` instead, so gwork gets only frames that fail to decode (None)."""


class FuzzSystem:
    """The nodes of ``sim_topology`` as direct child processes (no supervisord: the test wants their pids),
    in a temp dir under /tmp (ipc paths must stay short), and a SUB on the hub that keeps each node's
    latest heartbeat, trusted only if it carries the pid of a process we started."""

    def __init__(self, **overrides):
        from areal_bus.config.topology import load_topology

        self.dir = Path(tempfile.mkdtemp(prefix="abfz-", dir="/tmp"))
        self.topo_path = self.dir / "topology.yaml"
        self.topo_path.write_text(yaml.safe_dump(sim_topology(self.dir / "ipc", **overrides), sort_keys=False))
        self.topo = load_topology(self.topo_path)
        self.procs: dict[str, subprocess.Popen] = {}
        self.ctx = zmq.Context()
        self.ctx.linger = 0
        self.beats: dict[str, m.Heartbeat] = {}
        self.sub = None

    def start(self, timeout: float = 60) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        (self.dir / "out").mkdir()
        for kind in KINDS:
            with open(self.dir / "out" / f"{kind}.log", "wb") as out:
                self.procs[kind] = subprocess.Popen(
                    [str(venv_bin() / "areal-bus"), "node", kind, "--topology", str(self.topo_path), "--replica", "0"],
                    cwd=self.dir, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, m.TOPIC_HEARTBEAT)
        self.sub.connect(self.endpoint("hub_out"))
        self.wait(lambda: len(self.beats) == len(KINDS), timeout, "a heartbeat from every node")

    def endpoint(self, channel: str, replica: int = 0) -> str:
        return self.topo.endpoint(channel, replica, self.dir)

    def pids(self) -> dict[str, int]:
        return {kind: p.pid for kind, p in self.procs.items()}

    def poll_beats(self, timeout_ms: int = 100) -> None:
        pids = {p.pid: kind for kind, p in self.procs.items()}
        while self.sub.poll(timeout_ms, zmq.POLLIN):
            timeout_ms = 0
            frames = self.sub.recv_multipart(zmq.NOBLOCK)
            try:
                _, hb = decode(frames[1:])
            except DecodeError:
                continue  # our own fuzz, on the heartbeat topic
            if isinstance(hb, m.Heartbeat) and hb.pid in pids and hb.node_id == f"{pids[hb.pid]}-0":
                self.beats[pids[hb.pid]] = hb

    def wait(self, pred, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            self.poll_beats()
            self.assert_alive()
            got = pred()
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")

    def dropped(self, kind: str) -> int:
        hb = self.beats.get(kind)
        return int(sum(v for k, v in hb.counters.items() if k.startswith("dropped."))) if hb else 0

    def drop_reasons(self) -> dict[str, dict[str, int]]:
        return {kind: {k: int(v) for k, v in hb.counters.items() if k.startswith("dropped.")}
                for kind, hb in self.beats.items()}

    def assert_alive(self) -> None:
        dead = {kind: p.returncode for kind, p in self.procs.items() if p.poll() is not None}
        if dead:
            tails = {k: (self.dir / "out" / f"{k}.log").read_text()[-3000:] for k in dead}
            raise AssertionError(f"node(s) exited: {dead}\n" + "\n".join(f"--- {k}\n{t}" for k, t in tails.items()))

    def rss_mb(self, kind: str) -> float:
        for line in Path(f"/proc/{self.procs[kind].pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError(f"no VmRSS for {kind}")

    def version(self) -> int:
        hb = self.beats.get("trainer")
        return hb.version if hb else -1

    def stop(self) -> dict[str, int]:
        """SIGTERM every node (as supervisord stops them); SIGKILL what does not exit. Exit codes."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {}
        for kind, p in self.procs.items():
            try:
                codes[kind] = p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[kind] = p.wait(10)
        if not self.ctx.closed:
            self.ctx.destroy(linger=0)
        return codes

    def cleanup(self, keep: bool = False) -> None:
        if keep:
            return
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def raw_garbage(path: str, rnd: random.Random, count: int) -> None:
    """Bytes that are not ZMTP at all, straight into a bound ipc socket: libzmq's handshake must
    refuse them without disturbing the node."""
    import socket

    for _ in range(count):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(1)
        try:
            s.connect(path)
            greeting = b"\xff" + bytes(8) + b"\x7f\x03" if rnd.random() < 0.5 else b""  # a ZMTP 3 signature, sometimes
            s.sendall(greeting + rnd.randbytes(rnd.randrange(1, 512)))
        except OSError:
            pass  # the peer may close on us mid-write: that is the point
        finally:
            s.close()


def refused_batch(mut: Mutator, accepts: str | None, n: int, rnd: random.Random) -> list[list[bytes]]:
    """``n`` frame lists a receiver taking ``accepts`` must refuse: garbled ones (decode refuses them)
    and, unless ``accepts`` is None, some valid messages of another type (the node refuses those)."""
    out = []
    while len(out) < n:
        if accepts is not None and rnd.random() < 0.1:
            frames = as_bytes(mut.enc.encode(sample(rnd.choice([c for c in m.REGISTRY.values() if c.TAG != accepts]))))
        else:
            frames = mut.garble() or [b""]  # ZeroMQ has no empty multipart; an empty frame is its nearest
        tag = verdict(frames)
        if tag is None or (accepts is not None and tag != accepts):
            out.append(frames)
    return out


def send_all(sock: zmq.Socket, batch, prefix: list[bytes] = ()) -> None:
    for frames in batch:
        if not sock.poll(5000, zmq.POLLOUT):
            raise AssertionError("the node stopped taking frames (its socket stayed full for 5 s)")
        sock.send_multipart([*prefix, *frames], zmq.NOBLOCK)


def hub_publisher(system: FuzzSystem, ctx: zmq.Context) -> zmq.Socket:
    """A PUB into the bus whose messages are known to flow: a PUB drops everything until the bus's
    subscription has reached it, so publish an event until it comes back out of the bus."""
    pub = ctx.socket(zmq.PUB)
    pub.connect(system.endpoint("hub_in"))
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, m.TOPIC_EVENT)
    sub.connect(system.endpoint("hub_out"))
    ping = Encoder("fuzz-0").encode(m.Event(name="fuzz_ready", node_id="fuzz-0"))
    deadline = time.monotonic() + 20
    while True:
        assert time.monotonic() < deadline, "the bus never forwarded our event"
        pub.send_multipart([m.TOPIC_EVENT, *ping])
        if sub.poll(100, zmq.POLLIN):
            sub.close()
            return pub


HUB_TOPICS = {m.Heartbeat: m.TOPIC_HEARTBEAT, m.VersionAnnounce: m.TOPIC_VERSION, m.VersionAck: m.TOPIC_VERSION_ACK,
              m.TrajAck: m.TOPIC_TRAJ_ACK, m.VersionCommitted: m.TOPIC_VERSION_COMMITTED, m.Event: m.TOPIC_EVENT,
              m.RunState: m.TOPIC_RUN}
"""The topic each hub message travels on."""


class Fuzzer:
    """Rounds of fuzz against a FuzzSystem, from one seeded random source. Its sockets live until
    ``close``: a socket dropped early is closed at once, and (linger 0) so is what it had not sent."""

    def __init__(self, system: FuzzSystem, seed: int):
        self.system = system
        self.rnd = random.Random(seed)
        self.mut = Mutator(self.rnd)
        self.ctx = zmq.Context()
        self.ctx.linger = 0
        self.pushes: dict[tuple[str, int], zmq.Socket] = {}
        self.pub = hub_publisher(system, self.ctx)

    def push(self, channel: str, replica: int = 0) -> zmq.Socket:
        """A socket that sends into ``channel``: a PUSH to a PULL, a DEALER (as a rollout worker is)
        to the gateway's ROUTER."""
        if (channel, replica) not in self.pushes:
            stype = zmq.DEALER if channel == "gwork" else zmq.PUSH
            sock = self.pushes[(channel, replica)] = self.ctx.socket(stype)
            sock.connect(self.system.endpoint(channel, replica))
        return self.pushes[(channel, replica)]

    def counted(self, n: int) -> dict[str, int]:
        """``n`` refused frames into every data channel (PUSH/PULL loses nothing) and onto the hub's
        heartbeat topic (every node's SUB takes it, the bus's own too). Returns how many more
        ``dropped.*`` each node must count."""
        more = dict.fromkeys(self.system.procs, 0)
        for kind, sockets in BOUND.items():
            for channel, replica, stype in sockets:
                if stype in ("pull", "router"):
                    send_all(self.push(channel, replica), refused_batch(self.mut, ACCEPTS[channel], n, self.rnd))
                    more[kind] += n
        send_all(self.pub, refused_batch(self.mut, None, n, self.rnd), prefix=[m.TOPIC_HEARTBEAT])
        return {kind: k + n for kind, k in more.items()}

    def uncounted(self, n: int) -> None:
        """Refused frames on every other topic (only that topic's subscribers see them), subscription
        junk into the bus's XPUB from an XSUB peer (the bus decodes no subscription), and bytes that
        are not ZeroMQ into every bound ipc path (random bytes after a ZMTP signature sometimes parse
        as a peer's frames, so none of these can be counted exactly). The nodes must survive them."""
        rnd = self.rnd
        for topic in (*(t for t in HUB_TOPICS.values() if t != m.TOPIC_HEARTBEAT), b"", b"zz"):
            send_all(self.pub, refused_batch(self.mut, None, n, rnd), prefix=[topic])
        xsub = self.ctx.socket(zmq.XSUB)
        xsub.connect(self.system.endpoint("hub_out"))
        for _ in range(n):
            xsub.send_multipart([rnd.choice((b"\x01", b"\x00", b"\x02", b"")) + rnd.randbytes(rnd.randrange(40))]
                                + [rnd.randbytes(8)] * rnd.randrange(2))
        time.sleep(0.1)
        xsub.close()  # its junk subscriptions go with it
        for sockets in BOUND.values():
            for channel, replica, _ in sockets:
                raw_garbage(self.system.endpoint(channel, replica)[len("ipc://"):], rnd, max(1, n // 10))

    def odd(self, n: int) -> None:
        """``n`` well-typed messages with extreme values into every data channel and onto the hub."""
        for sockets in BOUND.values():
            for channel, replica, stype in sockets:
                if stype in ("pull", "router"):
                    send_all(self.push(channel, replica), [self.mut.odd_values() for _ in range(n)])
        for _ in range(n):
            cls = self.rnd.choice(list(HUB_TOPICS))
            send_all(self.pub, [self.mut.odd_values(cls)], prefix=[HUB_TOPICS[cls]])

    def close(self) -> None:
        self.ctx.destroy(linger=0)
