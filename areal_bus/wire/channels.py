"""Sockets and the two ways messages move on them.

``open_socket`` makes a socket with the options every channel needs (linger, high-water marks,
IMMEDIATE on PUSH so nothing queues for a peer that is not connected, a bound on a frame's size, CURVE
when the run uses it: see ``security``). ``Receiver`` decodes what
arrives and counts, logs and drops anything malformed instead of raising. ``ReliableSender`` is the
PUSH side of a data channel: it keeps every trajectory until the consumer acknowledges it, holds what
ZeroMQ will not take (backpressure, visible in metrics) and resends what a restarted consumer lost.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

import zmq

from areal_bus.wire.codec import DecodeError, Encoder, decode
from areal_bus.constants import DROPS_PER_RECV, LINGER_MS, MAX_FRAME_BYTES, RESEND_AFTER_S
from areal_bus.runtime.metrics import Metrics
from areal_bus.wire.security import private_dir, secure


def open_socket(ctx: zmq.Context, stype: int, endpoint: str | list[str], *, bind: bool,
                hwm: int | None = None, subscribe: tuple[bytes, ...] = (), identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(stype)
    sock.linger = LINGER_MS
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a bigger frame disconnects its sender, unbuffered
    if identity is not None:
        sock.identity = identity
    # A node's context carries the run's CURVE keys (security.bus_context): a socket that binds
    # serves only peers holding them, one that connects proves it holds them. No keys: no change.
    secure(ctx, sock, bind=bind)
    if hwm is not None:
        sock.sndhwm = hwm
        sock.rcvhwm = hwm
    if stype == zmq.PUSH:
        # Queue only to peers whose connection is complete: a message for a worker that has not
        # connected yet (or has died) stays with us, where ReliableSender can see it.
        sock.setsockopt(zmq.IMMEDIATE, 1)
    if stype == zmq.SUB:
        for topic in subscribe:
            sock.setsockopt(zmq.SUBSCRIBE, topic)
    for ep in [endpoint] if isinstance(endpoint, str) else endpoint:
        if ep.startswith("ipc://"):
            # Owner only: whoever can connect to an ipc socket can put messages on the bus. The one
            # place the folder is made or checked (refused if another user owns it or may write in it).
            private_dir(Path(ep[len("ipc://"):]).parent)
        sock.bind(ep) if bind else sock.connect(ep)
    return sock


class Receiver:
    """Decodes messages from one socket. Malformed input is counted under ``dropped.<reason>``, logged
    (at most once a second per reason, so a flood cannot flood the log) and dropped."""

    def __init__(self, sock: zmq.Socket, metrics: Metrics, log, *, topic: bool = False):
        self.sock = sock
        self.metrics = metrics
        self.log = log
        self.topic = topic
        self._last_logged: dict[str, float] = {}

    def recv(self, flags: int = zmq.NOBLOCK):
        """One message as ``(envelope, msg)``; None if nothing is waiting. Malformed messages met on
        the way are dropped (at most DROPS_PER_RECV of them: then None, and the caller's loop goes on)."""
        for _ in range(DROPS_PER_RECV):
            try:
                frames = self.sock.recv_multipart(flags, copy=False)
            except zmq.Again:
                return None
            if self.topic:
                frames = frames[1:]
            try:
                return decode(frames)
            except DecodeError as err:
                self.drop(err.reason, str(err))
            flags |= zmq.NOBLOCK  # a blocking call waits for the first message only
        return None

    def drain(self, limit: int = 1000):
        """Everything waiting now (at most ``limit``)."""
        out = []
        for _ in range(limit):
            got = self.recv()
            if got is None and not self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                break
            if got is not None:
                out.append(got)
        return out

    def drop(self, reason: str, detail: str):
        self.metrics.inc(f"dropped.{reason}")
        now = time.monotonic()
        if now - self._last_logged.get(reason, 0.0) >= 1.0:
            self._last_logged[reason] = now
            self.log.warning("dropped_frame", reason=reason, detail=detail[:200],
                             total=int(self.metrics.counters[f"dropped.{reason}"]))


class ReliableSender:
    """PUSH side of a data channel with acknowledgements.

    ``offer`` hands a message to ZeroMQ if it will take it without blocking; otherwise the message
    waits in ``pending`` (the high-water mark is reached: backpressure, counted and timed). Sent
    messages stay in ``unacked`` until ``ack`` names them. ``resend`` puts unacked messages back in
    line, for when the consumer restarted (its queue died with it) or an ack is long overdue. The
    frames kept here reference the message's numpy buffers, which keeps them alive for zero-copy
    sends until ZeroMQ and the consumer are done with them.
    """

    def __init__(self, sock: zmq.Socket, encoder: Encoder, metrics: Metrics, name: str, capacity: int,
                 track_acks: bool = True):
        self.sock = sock
        self.track_acks = track_acks  # False: forget a message once ZeroMQ has taken it
        self.encoder = encoder
        self.metrics = metrics
        self.name = name
        self.capacity = capacity
        self.pending: collections.OrderedDict[str, list] = collections.OrderedDict()
        self.unacked: collections.OrderedDict[str, tuple[list, float]] = collections.OrderedDict()
        self._blocked_since: float | None = None

    @property
    def full(self) -> bool:
        """True when the caller should stop producing: the consumer is not keeping up."""
        return len(self.pending) >= self.capacity

    def offer(self, key: str, msg) -> None:
        self.pending[key] = self.encoder.encode(msg)
        self.flush()

    def flush(self) -> int:
        sent = 0
        while self.pending:
            key, frames = next(iter(self.pending.items()))
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if self._blocked_since is None:
                    self._blocked_since = time.monotonic()
                    self.metrics.inc(f"{self.name}.backpressure_events")
                break
            self.pending.popitem(last=False)
            if self.track_acks:
                self.unacked[key] = (frames, time.monotonic())
                self.unacked.move_to_end(key)
            sent += 1
        if not self.pending and self._blocked_since is not None:
            self.metrics.inc(f"{self.name}.blocked_seconds", time.monotonic() - self._blocked_since)
            self._blocked_since = None
        self.metrics.inc(f"{self.name}.sent", sent)
        self.metrics.gauge(f"{self.name}.pending", len(self.pending))
        self.metrics.gauge(f"{self.name}.unacked", len(self.unacked))
        return sent

    def ack(self, keys) -> int:
        n = 0
        for key in keys:
            if self.unacked.pop(key, None) is not None or self.pending.pop(key, None) is not None:
                n += 1
        return n

    def settle(self, ack) -> int:
        """Forget every trajectory a TrajAck names: trained on, dropped as stale, a duplicate, accepted
        into the trainer's durable spool, or rejected (inconsistent for the model: quarantined)."""
        return (self.ack(ack.consumed) + self.ack(ack.stale) + self.ack(ack.duplicate) + self.ack(ack.accepted)
                + self.ack(ack.rejected))

    def resend(self, older_than: float | None = None) -> int:
        """Queue unacked messages again: all of them, or those sent more than ``older_than`` s ago."""
        now = time.monotonic()
        again = [k for k, (_, t) in self.unacked.items() if older_than is None or now - t > older_than]
        for key in again:
            frames, _ = self.unacked.pop(key)
            self.pending[key] = frames
        if again:
            self.metrics.inc(f"{self.name}.resent", len(again))
            self.flush()
        return len(again)

    def resend_overdue(self) -> int:
        return self.resend(older_than=RESEND_AFTER_S)
