"""Probe: attach to a running system at any time and see its throughput, per node.

It subscribes to the hub's heartbeats (which carry every node's metrics), so attaching costs the
running system nothing and needs no restart. Every interval it prints, per node: samples/s,
tokens/s, queue depths, the trainer's busy fraction and staleness histogram, and which nodes are
dead; ``--json`` prints one JSON object per node per interval instead, for machines.

Run: areal-bus probe --topology topology/default.yaml [--json] [--interval 2] [--duration 30]
     (or as a node kind in a topology: nodes: {probe: {replicas: 1}}, which logs to probe.log)
"""

from __future__ import annotations

import json
import os
import sys
import time

import zmq

from areal_bus import messages as m
from areal_bus.metrics import RateWindow
from areal_bus.node import NodeShell


class ProbeView:
    """Per-node rates and state from heartbeats. Holds no sockets."""

    def __init__(self):
        self.last: dict[str, m.Heartbeat] = {}
        self.windows: dict[str, RateWindow] = {}
        self.seen_at: dict[str, float] = {}

    def add(self, hb: m.Heartbeat, now: float) -> None:
        prev = self.last.get(hb.node_id)
        if prev is None or prev.incarnation != hb.incarnation:
            self.windows[hb.node_id] = RateWindow()
        self.windows[hb.node_id].add(hb.t, hb.counters)
        self.last[hb.node_id] = hb
        self.seen_at[hb.node_id] = now

    def rows(self, now: float, dead_after: float) -> list[dict]:
        out = []
        for node_id in sorted(self.last, key=_node_order):
            hb, w = self.last[node_id], self.windows[node_id]
            row = {
                "node": node_id, "kind": hb.kind, "alive": now - self.seen_at[node_id] <= dead_after,
                "version": hb.version,
                "samples_per_second": round(w.rate("samples"), 3),
                "tokens_per_second": round(w.rate("tokens"), 1),
                "queues": {k: v for k, v in hb.gauges.items() if k.startswith("queue.") or k.endswith(".pending")},
                "dropped_frames": int(sum(v for k, v in hb.counters.items() if k.startswith("dropped."))),
            }
            if hb.kind == "trainer":
                row["busy_fraction"] = round(min(1.0, w.rate("busy_seconds")), 3)
                row["staleness"] = {k: int(v) for k, v in sorted(hb.hists.get("staleness", {}).items(),
                                                                  key=lambda kv: int(kv[0]))}
                row["stale_dropped"] = int(hb.counters.get("stale_dropped", 0))
                row["duplicates"] = int(hb.counters.get("duplicates", 0))
            out.append(row)
        return out


_ORDER = {k: i for i, k in enumerate(("agent", "rollout", "reward", "trainer", "weights", "bus", "probe"))}


def _node_order(node_id: str):
    kind, _, idx = node_id.rpartition("-")
    return (_ORDER.get(kind, 99), kind, int(idx) if idx.isdigit() else 0)


def format_table(rows: list[dict]) -> str:
    head = f"{'node':<12} {'ver':>4} {'samples/s':>10} {'tokens/s':>10} {'busy':>5}  queues / staleness"
    lines = [head]
    for r in rows:
        busy = f"{r['busy_fraction']:.2f}" if "busy_fraction" in r else "-"
        extra = " ".join(f"{k}={int(v)}" for k, v in r["queues"].items())
        if "staleness" in r:
            extra += f" staleness={r['staleness']} stale_dropped={r['stale_dropped']}"
        if not r["alive"]:
            extra = "DEAD " + extra
        lines.append(f"{r['node']:<12} {r['version']:>4} {r['samples_per_second']:>10.2f} "
                     f"{r['tokens_per_second']:>10.0f} {busy:>5}  {extra}")
    return "\n".join(lines)


def attach(topo, *, interval: float = 2.0, duration: float | None = None, as_json: bool = False,
           out=sys.stdout, base=None, as_node: bool = False, replica: int = 0) -> int:
    # A probe attached from a shell gets an id of its own, so it never shadows a probe node.
    shell = NodeShell(topo, "probe", replica if as_node else 1000 + os.getpid() % 100000, base=base,
                      echo=as_node)
    if as_node:
        shell.install_signal_handlers()
        shell.announce_start()
        shell.start_heartbeat()
    view = ProbeView()
    poller = zmq.Poller()
    poller.register(shell.sub, zmq.POLLIN)
    t0 = next_report = time.monotonic()
    next_report += interval
    try:
        while not shell.stopping.is_set():
            poller.poll(100)
            now = time.monotonic()
            for _, msg in shell.drain_hub():
                if isinstance(msg, m.Heartbeat) and msg.node_id != shell.node_id:
                    view.add(msg, now)
            if now >= next_report:
                next_report += interval
                rows = view.rows(now, shell.peers.timeout)
                if as_node:
                    for r in rows:
                        shell.log.info("node", **{k: v for k, v in r.items() if k != "node"}, of=r["node"])
                elif as_json:
                    for r in rows:
                        out.write(json.dumps({"t": time.time(), **r}) + "\n")
                else:
                    out.write(format_table(rows) + "\n\n")
                out.flush()
            if duration is not None and now - t0 >= duration:
                break
    finally:
        shell.close()
    return 0


def run(topo, replica: int = 0, base=None) -> int:
    return attach(topo, interval=5.0, base=base, as_node=True, replica=replica)
