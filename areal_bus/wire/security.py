"""Transport security on the bus: who may connect to a node's sockets.

On one host the bus uses ipc sockets (in a folder only this user may enter: ``private_dir`` makes it
0700, and refuses one another user made or may write in) or tcp on loopback, which nothing outside the
host reaches. Between hosts every socket speaks ZeroMQ's CURVE (RFC 26: the
connection is encrypted and both ends prove a key) with one keypair per cluster:
``areal-bus keys --out keys`` writes it, ``endpoints.curve.key`` in the topology names it, and every
host holds a copy. A socket that binds is a CURVE server with that keypair and, through a ZAP handler
(RFC 27: pyzmq's ThreadAuthenticator), accepts only clients that prove they hold the same key; a socket
that connects is a CURVE client with it. A peer with no key, another key, or plain ZeroMQ never
completes a handshake, so nothing it sends reaches a node. Every refusal is counted in the refusing
node's metrics (``auth.refused_key``: a CURVE client with a key that is not the cluster's;
``auth.refused_handshake``: no CURVE, or the wrong server key) and logged at most once a second.

Nodes get this without asking: ``NodeShell`` makes its context with ``bus_context`` and
``channels.open_socket`` calls ``secure`` on every socket it makes.

Run: areal-bus keys --out keys
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.sugar import context as _pyzmq_context
from zmq.utils.monitor import recv_monitor_message

from areal_bus.constants import LINGER_MS

KEY_NAME = "cluster"
"""``areal-bus keys`` writes ``<out>/cluster.key`` (public) and ``<out>/cluster.key_secret`` (0600)."""

WATCH_POLL_MS = 200
"""How often the handshake watcher looks for newly bound sockets and for stop; refusals themselves
wake it at once."""

_HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_WHY = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "the peer does not speak CURVE (no key configured)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "the peer's handshake fails decryption (it holds another "
                                           "cluster's key)",
}


def _why(ev: dict) -> str:
    if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # the value is an errno
        return (f"the handshake broke off ({os.strerror(ev['value'])}): most likely the peer does not "
                f"use CURVE (no endpoints.curve in its topology)")
    return _WHY.get(ev["value"], f"ZMTP protocol error 0x{ev['value']:x}")


class CurveKeyError(ValueError):
    """A key file that is missing, not a CURVE certificate, public only, or readable by other users."""


@dataclass(frozen=True)
class CurveKeys:
    """The cluster keypair, Z85-encoded as ZeroMQ takes it. The secret is kept out of reprs and logs."""

    public: bytes
    secret: bytes = field(repr=False)


def make_keys(out_dir: str | os.PathLike, name: str = KEY_NAME, force: bool = False) -> tuple[Path, Path]:
    """Write a new CURVE keypair as ``<out_dir>/<name>.key`` and ``<name>.key_secret`` (ZeroMQ's
    certificate format, so zmq.auth and czmq tools read them). Returns (public file, secret file).
    Refuses to replace existing keys unless ``force``: that would lock every host out of the cluster."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    public_file, secret_file = out / f"{name}.key", out / f"{name}.key_secret"
    if not force and (public_file.exists() or secret_file.exists()):
        raise FileExistsError(f"{secret_file} or {public_file} exists; every host of the cluster uses it "
                              f"(pass --force to replace it, then copy the new keys to every host)")
    # pyzmq writes certificates with the process umask. They are written inside a private folder
    # (mkdtemp makes it 0700) and made 0600 before they move next to the user's files, so the secret
    # is never readable by anyone else, not even for an instant.
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        pub, sec = zmq.auth.create_certificates(tmp, name)
        os.chmod(sec, 0o600)
        os.chmod(pub, 0o644)
        os.replace(sec, secret_file)
        os.replace(pub, public_file)
    return public_file, secret_file


def load_keys(path: str | os.PathLike) -> CurveKeys:
    """The keypair in a secret certificate file. Raises CurveKeyError with the fix in its message."""
    p = Path(path)
    try:
        mode = p.stat().st_mode & 0o777
    except FileNotFoundError:
        raise CurveKeyError(f"{p}: no such key file (make the cluster's keys with `areal-bus keys --out "
                            f"{p.parent}` and copy them to every host)") from None
    if mode & 0o077:
        raise CurveKeyError(f"{p}: the secret key file is readable by other users (mode {mode:o}); "
                            f"run `chmod 600 {p}`")
    try:
        public, secret = zmq.auth.load_certificate(p)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"{p}: not a CURVE certificate ({exc})") from None
    if not secret:
        raise CurveKeyError(f"{p}: holds a public key only; endpoints.curve.key names the .key_secret file")
    for what, key in (("public", public), ("secret", secret)):
        if len(key) != 40:
            raise CurveKeyError(f"{p}: the {what} key is not a 40-character Z85 CURVE key")
    return CurveKeys(public=public, secret=secret)


class IpcDirError(PermissionError):
    """An ipc folder that another user owns or may write in: whoever can write there can bind a
    socket of the bus, or plant a file a node reads (the CUDA weight handles), before the run does."""


def private_dir(path: str | os.PathLike) -> Path:
    """The ipc folder ``path``, made owner-only if it is new, checked if it exists: a directory (not a
    link), owned by this user, with no group or other write bit. The default name
    (/tmp/areal_bus-<hash of log_dir>) can be guessed, so another local user may have made it first;
    such a folder is refused (IpcDirError naming it and the fix), never used. A folder of ours that
    others may only read or enter (0755, from an older release or a umask) is tightened to 0700: nobody
    else can have put anything in it. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    fix = (f"remove it (rm -r {path}) if no run of yours uses it, or set endpoints.ipc_dir to a folder of "
           f"your own")
    if not stat.S_ISDIR(st.st_mode):
        raise IpcDirError(f"ipc folder {path} is not a directory (a link or a file): {fix}")
    if st.st_uid != os.geteuid():
        raise IpcDirError(f"ipc folder {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
                          f"another user may have made it to catch the bus's sockets; {fix}")
    if st.st_mode & 0o022:
        raise IpcDirError(f"ipc folder {path} has mode {stat.S_IMODE(st.st_mode):04o}: other users may write "
                          f"in it, so what is in it cannot be trusted; {fix}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


class BusContext(zmq.Context):
    """A ZeroMQ context that knows the run's CURVE keys (None: no CURVE) and owns the guard that
    authenticates clients of its server sockets. ``destroy`` stops the guard before closing sockets,
    because the guard's threads own sockets of this context."""

    curve: CurveKeys | None = None
    metrics = None
    log = None
    _guard: _Guard | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Every socket of this context, including one made without channels.open_socket (which sets
        # its own), waits at most LINGER_MS at close for its queued messages: a socket closed with
        # ZeroMQ's default (for ever) holding a message for a peer that is gone makes term() block.
        self.setsockopt(zmq.LINGER, LINGER_MS)

    def guard(self) -> _Guard:
        if self._guard is None:
            self._guard = _Guard(self, self.curve, self.metrics, self.log)
        return self._guard

    def stop_guard(self) -> None:
        if self._guard is not None:
            self._guard.stop()
            self._guard = None

    def destroy(self, linger: int | None = None) -> None:
        self.stop_guard()
        super().destroy(linger)

    def term(self) -> None:
        self.stop_guard()
        super().term()

    def __del__(self) -> None:
        # A context dropped without destroy() (a failed start, a test's) must not hold the garbage
        # collector, wherever it runs: pyzmq's own __del__ calls term(), which waits for every socket
        # of the context, also one whose Python object is garbage in the same cycle (its weak reference
        # in _sockets is already cleared, so destroy() cannot close it; this hung the suite in the
        # middle of unrelated tests). So: close what can be closed at once, and term() in a daemon
        # thread, which finishes when the stragglers' own finalizers have closed them.
        # At interpreter exit nothing is done, as pyzmq does (its atexit flag): threads cannot start
        # then, nothing can be imported, and the process is going anyway.
        if getattr(self, "_shadow", False) or self.closed or getattr(_pyzmq_context, "_exiting", True):
            return
        try:
            self.stop_guard()
            for sock in list(getattr(self, "_sockets", None) or ()):
                if not sock.closed:
                    sock.close(linger=0)
            threading.Thread(target=self._term_quietly, name="zmq-term", daemon=True).start()
        except Exception:  # deliberately tolerated: nothing can be raised out of __del__
            pass

    def _term_quietly(self) -> None:
        try:
            zmq.Context.term(self)
        except zmq.ZMQError:  # deliberately tolerated: the context was garbage; nothing waits on it
            pass


def bus_context(curve: CurveKeys | None, metrics, log) -> BusContext:
    """A node's context: its sockets (made by ``open_socket``) use ``curve`` when it is given, and
    refusals are counted in ``metrics`` and logged to ``log``."""
    ctx = BusContext()
    ctx.curve, ctx.metrics, ctx.log = curve, metrics, log
    return ctx


def secure(ctx: zmq.Context, sock: zmq.Socket, *, bind: bool) -> None:
    """Make ``sock`` a CURVE server (``bind``) or client when ``ctx`` carries keys; otherwise nothing.
    Call before binding or connecting: ZeroMQ reads these options when a connection starts."""
    keys = getattr(ctx, "curve", None)
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    if bind:
        ctx.guard().watch(sock)
        sock.curve_server = True
    else:
        sock.curve_serverkey = keys.public


class _Guard:
    """One context's ZAP handler (which admits only the cluster's key) and a watcher of the handshake
    failures that never reach ZAP (a client without CURVE, or with the wrong server key)."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys, metrics, log):
        self.ctx = ctx
        self.keys = keys
        self.metrics = metrics
        self.log = log
        self._last_logged: dict[str, float] = {}
        self._new: queue.Queue[zmq.Socket] = queue.Queue()
        self._stop = threading.Event()
        # pyzmq logs every decision at debug level to 'zmq.auth'; ours are counted and logged below.
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("areal_bus.zap"))
        self.auth.configure_curve_callback("*", credentials_provider=self)
        # Bound before any server socket exists: a handshake that found no ZAP handler would be let in.
        self.auth.start()
        self._watcher = threading.Thread(target=self._watch_loop, name="handshake-watch", daemon=True)
        self._watcher.start()

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP: admit a CURVE client only if its (proven) public key is the cluster's."""
        if hmac.compare_digest(client_key, self.keys.public):
            return True
        self._refused("key", f"client key {client_key[:8].decode(errors='replace')}... is not this cluster's")
        return False

    def watch(self, sock: zmq.Socket) -> None:
        """Count handshake failures on a server socket (call before it binds)."""
        addr = f"inproc://areal-bus-monitor-{id(sock):x}-{time.monotonic_ns()}"
        sock.monitor(addr, _HANDSHAKE_FAILURES)
        mon = self.ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
        mon.linger = 0
        mon.connect(addr)
        self._new.put(mon)  # the queue's lock is the memory barrier a socket needs to change threads

    def _watch_loop(self) -> None:
        poller = zmq.Poller()
        mons: list[zmq.Socket] = []
        try:
            while not self._stop.is_set():
                while not self._new.empty():
                    mon = self._new.get_nowait()
                    poller.register(mon, zmq.POLLIN)
                    mons.append(mon)
                for mon, _ in poller.poll(WATCH_POLL_MS):
                    try:
                        ev = recv_monitor_message(mon, zmq.NOBLOCK)
                    except zmq.Again:
                        continue
                    self._refused("handshake", f"on {ev['endpoint'].decode(errors='replace')}: {_why(ev)}")
        finally:
            for mon in mons:
                mon.close()
            while not self._new.empty():
                self._new.get_nowait().close()

    def _refused(self, reason: str, detail: str) -> None:
        # Each counter is written by one thread only (key: the ZAP thread, handshake: the watcher),
        # so no increment is lost; the heartbeat's dict() copy of the counters is atomic under the GIL.
        name = f"auth.refused_{reason}"
        if self.metrics is not None:
            self.metrics.inc(name)
        now = time.monotonic()
        if self.log is not None and now - self._last_logged.get(reason, 0.0) >= 1.0:
            self._last_logged[reason] = now
            total = int(self.metrics.counters[name]) if self.metrics is not None else None
            self.log.warning("connection_refused", reason=reason, detail=detail, total=total)

    def stop(self) -> None:
        self._stop.set()
        self._watcher.join(timeout=2)
        self.auth.stop()
