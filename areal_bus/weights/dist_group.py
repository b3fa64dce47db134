"""Weights across hosts over torch.distributed: the weight broadcaster (rank 0) and one relay per far
rollout host form a *generation* of a process group and broadcast each version in buckets (NCCL between
GPUs, gloo on CPU), where the chunked CURVE transfer (``transfer``) would send them one host at a time.

A generation is a process group built directly on a store, never the global default group, so that a
new one can form whenever the membership changes (a host dies, restarts or joins): rank 0 serves one
``TCPStore`` for its whole life, and generation n meets under the prefix ``<token>/gen<n>`` of it
(``token`` names the store's incarnation). Who is in generation n, and which version's buckets come
next, travel as small msgpack control messages over the bus's own (CURVE) sockets; what crosses the
store is torch.distributed's own rendezvous, no pickle and no object collective anywhere.

A collective waits on the network, so nothing here blocks the caller's loop: ``Generation`` forms in a
thread of its own (``state``: forming, ready, failed, aborted), and ``Transfer`` issues a version's
buckets asynchronously and is ``pump``-ed, a few buckets in flight, each bounded by BUCKET_TIMEOUT_S.
The caller aborts a generation as soon as the bus's liveness says a member is gone (within
HEARTBEAT_INTERVAL_S x HEARTBEAT_LIVENESS, 2 s), not after the collective's timeout: a host that vanishes
without closing its sockets would otherwise hold the group for the whole timeout.

Trust: the group's sockets are torch.distributed's (plain TCP, like the trainer's own ranks across hosts,
``placement.rendezvous``); the sha256 of each version travels over the CURVE channel, and a relay on CPU
commits only bytes that match it.

Used by nodes/weights.py; tests/test_dist_group.py checks it on loopback (two processes, bitwise, a
member stopped and a new generation formed), tests/test_two_hosts.py in a whole run across namespaces.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import warnings
from collections import deque
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

BUCKET_BYTES = 64 << 20
"""Bytes per broadcast: large enough that a collective's fixed cost vanishes (gloo on loopback is within
a few percent of its best from 16 MiB up), small enough that a GPU receiver's staging buffers
(INFLIGHT of them) stay small next to the model."""
INFLIGHT = 2
"""Buckets issued before the oldest completes: the next one is queued while one is on the wire."""
FORM_TIMEOUT_S = 30.0
"""How long a generation may take to form (every member connects to the store and to each other).
A member that never shows up (its plan was lost, it died meanwhile) fails the generation after this, and
the caller forms the next one with whoever is alive then."""
BUCKET_TIMEOUT_S = 60.0
"""The bound on one bucket's collective: a backstop only. 64 MiB takes ~0.1 s at 5 Gb/s; a member that
dies is noticed on the bus within 2 s, and its generation aborted, long before this."""

STATES = ("forming", "ready", "failed", "aborted")


class GroupError(RuntimeError):
    """A generation that failed or was aborted: a collective errored or timed out, or a member is gone.
    The caller forms a new generation; the version in transfer is not committed."""


def serve_store(host: str, port: int, timeout_s: float = FORM_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's store, for the life of the process: every generation meets under its own prefix."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), use_libuv=True)


def new_token() -> str:
    """Names one incarnation of rank 0's store: a restarted broadcaster's generations never meet an old one's."""
    return uuid.uuid4().hex[:12]


def plan(gen: int, rank: int, size: int, addr: str, port: int, backend: str, token: str) -> dict:
    """The control message that puts a member in generation ``gen`` (plain values, for msgpack)."""
    return {"kind": "group", "gen": gen, "rank": rank, "size": size, "addr": addr, "port": port,
            "backend": backend, "token": token}


def check_plan(doc) -> dict:
    """A plan that crossed a socket, checked field by field; ValueError names what is wrong."""
    if not isinstance(doc, dict):
        raise ValueError("a group plan is a map")
    types = {"gen": int, "rank": int, "size": int, "addr": str, "port": int, "backend": str, "token": str}
    for key, typ in types.items():
        if not isinstance(doc.get(key), typ):
            raise ValueError(f"group plan field {key!r}: expected {typ.__name__}, got {doc.get(key)!r}")
    if not 0 < doc["rank"] < doc["size"] or doc["backend"] not in ("gloo", "nccl") or not 0 < doc["port"] < 65536:
        raise ValueError(f"group plan out of range: rank {doc['rank']} of {doc['size']}, backend {doc['backend']}, "
                         f"port {doc['port']}")
    return doc


class Generation:
    """One formation of the weight group: ``rank`` of ``size`` over ``backend``, built in a thread.

    ``store``: rank 0 passes the store it serves; the others pass None and a client store is opened to
    ``addr:port``. ``my_addr`` is the address this member's gloo device binds (the host's address as
    the topology writes it: a host name may resolve to loopback). ``device``: the CUDA device for NCCL.
    """

    def __init__(self, gen: int, rank: int, size: int, backend: str, *, token: str, addr: str, port: int,
                 my_addr: str, store: dist.Store | None = None, device: torch.device | None = None):
        self.gen, self.rank, self.size, self.backend = gen, rank, size, backend
        self.device = device if device is not None else torch.device("cpu")
        self.pg = None
        self.state = "forming"
        self.error = ""
        self.started = time.monotonic()
        self.formed_s: float | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._form, args=(token, addr, port, my_addr, store),
                                        name=f"weight-group-gen{gen}", daemon=True)
        self._thread.start()

    def _form(self, token, addr, port, my_addr, store) -> None:
        timeout = timedelta(seconds=BUCKET_TIMEOUT_S)
        try:
            if store is None:
                store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=FORM_TIMEOUT_S),
                                      use_libuv=True)
            prefixed = dist.PrefixStore(f"{token}/gen{self.gen}", store)
            if self.backend == "nccl":
                # A member that dies is aborted by the caller (bus liveness); NCCL's watchdog must not
                # tear the process down first, should its own timeout come before.
                os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                pg = dist.ProcessGroupNCCL(prefixed, self.rank, self.size, opts)
                torch.cuda.set_device(self.device)
                probe = torch.zeros(1, dtype=torch.uint8, device=self.device)
                # The communicator is made at the first collective: make it here, off the caller's loop.
                self._bcast(pg, probe).wait()
            else:
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timeout
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=my_addr)]
                pg = dist.ProcessGroupGloo(prefixed, self.rank, self.size, opts)
            with self._lock:
                if self.state == "aborted":
                    _bury(pg)
                    return
                self.pg, self.state, self.formed_s = pg, "ready", time.monotonic() - self.started
        except Exception as exc:  # tolerated: reported as state "failed"; the caller forms the next generation
            with self._lock:
                if self.state == "forming":
                    self.state, self.error = "failed", f"{type(exc).__name__}: {str(exc)[:300]}"

    @staticmethod
    def _bcast(pg, tensor: torch.Tensor):
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return pg.broadcast([tensor], opts)

    def poll(self) -> str:
        """The state now; a generation still forming after FORM_TIMEOUT_S is failed here."""
        with self._lock:
            if self.state == "forming" and time.monotonic() - self.started > FORM_TIMEOUT_S + 5:
                self.state, self.error = "failed", f"not formed within {FORM_TIMEOUT_S:.0f} s"
            return self.state

    def abort(self, reason: str) -> None:
        """Give the generation up (a member is gone, or a newer one forms): collectives in flight are
        aborted where the backend can, and the group is dropped off the caller's thread."""
        with self._lock:
            if self.state in ("failed", "aborted"):
                return
            self.state, self.error = "aborted", reason
            pg, self.pg = self.pg, None
        if pg is not None:
            _bury(pg)

    def broadcast(self, tensor: torch.Tensor):
        if self.state != "ready":
            raise GroupError(f"generation {self.gen} is {self.state}: {self.error}")
        return self._bcast(self.pg, tensor)


def _bury(pg) -> None:
    """Abort and drop a process group in a daemon thread: a backend's destructor joins its worker
    threads, which may sit in a collective until it errors or times out."""
    def go():
        try:
            pg.abort()
        except Exception:  # tolerated: the group is going anyway (gloo's abort may be unsupported)
            pass
    threading.Thread(target=go, name="weight-group-abort", daemon=True).start()


class Transfer:
    """One version's bytes over one generation, as buckets of ``bucket_bytes``, pumped without blocking.

    ``source(off, n)`` gives the tensor bucket [off, off+n) is broadcast from (rank 0) or into (the
    others): a view of the whole version where the bytes can land in place (shared memory on CPU, the
    trainer's CUDA IPC buffer on rank 0), or a staging buffer (a GPU receiver). ``landed(off, n, t)``,
    when given, is called in order as each bucket completes (a GPU receiver copies it to the host). A
    staging source gets at most INFLIGHT buckets out at once, so INFLIGHT buffers suffice.
    """

    def __init__(self, gen: Generation, total: int, source: Callable[[int, int], torch.Tensor],
                 landed: Callable[[int, int, torch.Tensor], None] | None = None, bucket_bytes: int = BUCKET_BYTES):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive (got {bucket_bytes})")
        self.gen, self.total, self.bucket = gen, total, bucket_bytes
        self.count = max(1, -(-total // bucket_bytes))
        self.source, self.landed = source, landed
        self._next = 0
        self._flight: deque = deque()  # (index, work, off, n, tensor, issued_at)
        self.done = 0
        self.started = time.monotonic()

    def pump(self) -> bool:
        """Complete what finished and issue what fits; True once every bucket is through. Raises
        GroupError if a collective failed or outlived BUCKET_TIMEOUT_S, or the generation is gone."""
        now = time.monotonic()
        while self._flight:
            i, work, off, n, t, at = self._flight[0]
            if self.gen.state != "ready":
                raise GroupError(f"generation {self.gen.gen} {self.gen.state}: {self.gen.error}")
            if not work.is_completed():
                if now - at > BUCKET_TIMEOUT_S:
                    raise GroupError(f"bucket {i}/{self.count} not through in {BUCKET_TIMEOUT_S:.0f} s")
                break
            try:
                work.wait()  # completed: returns at once, or raises what the collective failed with
            except RuntimeError as exc:
                raise GroupError(f"bucket {i}/{self.count}: {str(exc)[:300]}") from None
            if self.landed is not None:
                self.landed(off, n, t)
            self._flight.popleft()
            self.done += 1
        while len(self._flight) < INFLIGHT and self._next < self.count:
            off = self._next * self.bucket
            n = min(self.bucket, self.total - off)
            t = self.source(off, n)
            try:
                work = self.gen.broadcast(t)
            except GroupError:
                raise
            except RuntimeError as exc:  # the backend refused at once (a peer already gone)
                raise GroupError(f"bucket {self._next}/{self.count}: {str(exc)[:300]}") from None
            self._flight.append((self._next, work, off, n, t, time.monotonic()))
            self._next += 1
        return self.done == self.count

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started


def bytes_tensor(buf, writable: bool = True) -> torch.Tensor:
    """A uint8 tensor over a buffer (a shared-memory segment's memoryview), no copy. Rank 0 sends from
    a read-only mapping: torch warns that writes would fail, and gloo's root only reads it."""
    if writable:
        return torch.frombuffer(buf, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


__all__ = ["BUCKET_BYTES", "Generation", "GroupError", "Transfer", "bytes_tensor", "check_plan", "new_token",
           "plan", "serve_store"]
