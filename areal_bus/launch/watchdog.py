"""The watchdog: notices a node whose heartbeat stops while its process lives (stopped with SIGSTOP, hung
in a system call, deadlocked), logs it at error level, and, if ``durability.watchdog_restart_s`` says
so, has supervisord kill it so that it restarts as after any crash.

A killed node needs no watchdog: supervisord sees it exit and restarts it. A stopped one holds its
sockets, its pid and its supervisord state (RUNNING) while the run stalls behind it (a stopped trainer
trains nothing, a stopped bus carries nothing). The watchdog runs in the run-end listener (a thread of
``areal-bus run-end``): it has supervisord's XML-RPC already, and it is no node, so a stopped bus is
noticed too. It subscribes to the hub's heartbeats; while the bus itself is silent every other node is
silent with it, so then only the bus is judged. What it watches is every node program supervisord
has RUNNING (getAllProcessInfo), not only those heard from: one stopped before its first heartbeat
reached the watchdog is noticed too.

Started by areal_bus/launch/runend.py's ``listen``; the topology comes from supervisord's own config (each
node's command names it).
"""

from __future__ import annotations

import re
import shlex
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import zmq

from areal_bus.config.topology import load_topology
from areal_bus.constants import HEARTBEAT_INTERVAL_S, WATCHDOG_FIRST_BEAT_S, WATCHDOG_SILENT_S
from areal_bus.runtime.metrics import Metrics
from areal_bus.wire import messages as m
from areal_bus.wire.channels import open_socket
from areal_bus.wire.codec import DecodeError, decode
from areal_bus.wire.security import bus_context


@dataclass
class _Seen:
    kind: str
    pid: int
    incarnation: str
    last: float
    reported: bool = False  # this silence has been logged
    restarted: bool = False  # and acted on: wait for a new incarnation
    heard: bool = False  # a heartbeat of this process has arrived


class HeartbeatWatch:
    """Which nodes fell silent, from heartbeats. Pure: time and process liveness are passed in.

    ``check`` returns (node, action, silent_s) for each node silent past WATCHDOG_SILENT_S whose process
    still lives: "stalled" once per silence, then "restart" once it has been silent ``restart_s``
    (0: never). A node whose process is gone is supervisord's business, not ours; a new incarnation
    (restarted) starts afresh."""

    def __init__(self, restart_s: float = 0.0, silent_s: float = WATCHDOG_SILENT_S):
        self.restart_s = restart_s
        self.silent_s = silent_s
        self.nodes: dict[str, _Seen] = {}

    def running(self, procs: dict[str, int], now: float) -> None:
        """supervisord's RUNNING node programs, {name (= node id, <kind>-<n>): pid}. A program not heard
        from yet is judged silent from now on: one stopped or hung before its first heartbeat (or
        whose heartbeat never reached this SUB) is still noticed. One no longer RUNNING (stopped,
        exited, restarting) is supervisord's business and leaves the watch."""
        for node, pid in procs.items():
            seen = self.nodes.get(node)
            if seen is None or seen.pid != pid:
                self.nodes[node] = _Seen(node.rsplit("-", 1)[0], pid, "", now)
        for node in [n for n in self.nodes if n not in procs]:
            del self.nodes[node]

    def beat(self, node_id: str, kind: str, pid: int, incarnation: str, now: float) -> None:
        seen = self.nodes.get(node_id)
        if seen is None or seen.incarnation != incarnation or seen.pid != pid:
            self.nodes[node_id] = _Seen(kind, pid, incarnation, now, heard=True)
            return
        seen.last, seen.reported, seen.restarted, seen.heard = now, False, False, True

    def check(self, now: float, alive) -> list[tuple[str, str, float]]:
        """``alive(pid)``: whether that process still exists (and is not a zombie)."""
        bus = [n for n, s in self.nodes.items() if s.kind == "bus"]
        bus_silent = any(now - self.nodes[n].last > self.silent_s for n in bus)
        out = []
        for node, seen in self.nodes.items():
            silent = now - seen.last
            # A node loads its engine before its first heartbeat (vLLM takes 26-42 s, a large checkpoint
            # minutes): before it has been heard it is only reported, late, and never killed.
            limit = self.silent_s if seen.heard else max(self.silent_s, WATCHDOG_FIRST_BEAT_S)
            if silent <= limit or seen.restarted or (bus_silent and seen.kind != "bus"):
                continue  # (every heartbeat comes through the bus: with it silent, only it is to blame)
            if not alive(seen.pid):
                continue
            if not seen.reported:
                seen.reported = True
                out.append((node, "stalled", silent))
            if self.restart_s > 0 and silent >= self.restart_s and seen.heard:
                seen.restarted = True
                out.append((node, "restart", silent))
        return out


def process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a stopped one counts as alive: that is the point)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def topology_from_supervisord(rpc) -> Path | None:
    """The topology a node's command names (--topology), from supervisord's config."""
    for info in rpc.supervisor.getAllConfigInfo():
        argv = shlex.split(info.get("command", ""))
        if "node" in argv and "--topology" in argv:
            return Path(argv[argv.index("--topology") + 1])
    return None


NODE_PROGRAM = re.compile(r"^[a-z_]+-\d+$")
"""A node's supervisord program: <kind>-<n> (the run_end listener and anything else are no nodes)."""


def running_nodes(rpc) -> dict[str, int]:
    """{program: pid} for each node program supervisord has RUNNING."""
    return {p["name"]: p["pid"] for p in rpc.supervisor.getAllProcessInfo()
            if p["statename"] == "RUNNING" and NODE_PROGRAM.match(p["name"])}


class Watchdog(threading.Thread):
    """The thread: a SUB on the hub's heartbeats, ``HeartbeatWatch`` each half second, and its actions
    carried out through supervisord (``rpc()`` makes a fresh XML-RPC proxy for each call)."""

    def __init__(self, rpc, out=sys.stderr):
        super().__init__(name="watchdog", daemon=True)
        self.rpc = rpc
        self.out = out
        self.stop = threading.Event()

    def say(self, level: str, event: str, **fields) -> None:
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        print(f"[watchdog] {level} {event} {text} ts={time.strftime('%H:%M:%S')}", file=self.out, flush=True)

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # deliberately tolerated: the listener must go on ending runs without us
            self.say("error", "watchdog_failed", error=repr(exc)[:300])

    def _run(self) -> None:
        path = None
        while path is None and not self.stop.is_set():  # supervisord's socket may not answer yet
            try:
                path = topology_from_supervisord(self.rpc())
            except Exception:  # noqa: BLE001 -- not up yet: asked again shortly
                pass
            if path is None:
                self.stop.wait(1.0)
        if path is None:
            return
        topo = load_topology(path)
        restart_s = topo.durability.watchdog_restart_s
        base = Path.cwd()  # the listener runs where the nodes do (directory=%(here)s)
        ctx = bus_context(topo.curve_keys(base), Metrics(), structlog.get_logger())
        sub = open_socket(ctx, zmq.SUB, topo.endpoint("hub_out", 0, base), bind=False, subscribe=(m.TOPIC_HEARTBEAT,))
        watch = HeartbeatWatch(restart_s)
        self.say("info", "watchdog_start", topology=path, silent_s=watch.silent_s, restart_s=restart_s or "off")
        announced: tuple[list[str], list[str]] = ([], [])
        try:
            while not self.stop.is_set():
                deadline = time.monotonic() + HEARTBEAT_INTERVAL_S
                # Until the deadline, never longer: heartbeats arriving steadily must not starve the check.
                while time.monotonic() < deadline and sub.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                    try:
                        _, hb = decode(sub.recv_multipart(zmq.NOBLOCK, copy=False)[1:])
                    except (DecodeError, zmq.Again):
                        continue
                    if isinstance(hb, m.Heartbeat):
                        watch.beat(hb.node_id, hb.kind, hb.pid, hb.incarnation, time.monotonic())
                try:
                    watch.running(running_nodes(self.rpc()), time.monotonic())
                except Exception:  # noqa: BLE001 -- supervisord busy or shutting down: judged on heartbeats this round
                    pass
                # What it watches and which of those it has heard (only a node heard from is ever
                # killed), for whoever reads this log.
                now_watching = (sorted(watch.nodes), sorted(n for n, s in watch.nodes.items() if s.heard))
                if watch.nodes and now_watching != announced:
                    announced = now_watching
                    self.say("info", "watching", nodes=",".join(announced[0]), heard=",".join(announced[1]) or "-")
                for node, action, silent in watch.check(time.monotonic(), process_alive):
                    self._act(node, action, silent, watch)
        finally:
            sub.close(0)
            ctx.term()

    def _act(self, node: str, action: str, silent: float, watch: HeartbeatWatch) -> None:
        pid = watch.nodes[node].pid
        if action == "stalled":
            self.say("error", "node_stalled", node=node, pid=pid, silent_s=round(silent, 1),
                     why="its heartbeat stopped while its process lives (stopped, hung or deadlocked)",
                     action=f"kill and restart after {watch.restart_s:.0f} s" if watch.restart_s else "none "
                     "(durability.watchdog_restart_s: 0)")
            return
        name = f"{node}:{node}"  # one supervisord program per replica, named <kind>-<n>
        try:
            # SIGKILL, not stopProcess: a stopped process never answers the SIGTERM stopProcess sends
            # first. supervisord restarts it (autorestart=unexpected), as after any kill.
            self.rpc().supervisor.signalProcess(name, "KILL")
            self.say("error", "node_restarted", node=node, pid=pid, silent_s=round(silent, 1), how="SIGKILL")
        except Exception as exc:  # noqa: BLE001 -- not supervisord's (a node run by hand), or gone meanwhile
            self.say("error", "node_restart_failed", node=node, pid=pid, error=re.sub(r"\s+", " ", str(exc))[:200])
