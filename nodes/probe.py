"""Probe: attach to a running system at any time and see its throughput, per node.

It subscribes to the hub's heartbeats (which carry every node's metrics), so attaching costs the
running system nothing and needs no restart. Every interval it prints, per node: samples/s,
tokens/s, queue depths, the trainer's busy fraction and staleness histogram, and which nodes are
dead; ``--json`` prints one JSON object per node per interval instead, for machines. It also hears
the rollout workers' version acknowledgements, for their weight-swap times.

With a Prometheus port (the probe node's ``nodes.probe.config``, areal_bus/config/node_configs.py:
ProbeConfig, on 127.0.0.1:9400 by default) it serves GET /metrics: the latest heartbeat of every node
as Prometheus families (areal_bus/runtime/prometheus.py has the names), read at each scrape.

Run: areal-bus probe --topology topology/default.yaml [--json] [--interval 2] [--duration 30]
     (or as a node kind in a topology: nodes: {probe: {replicas: 1}}, which logs to probe.log and
     serves http://127.0.0.1:9400/metrics; the bound address is in log_dir/probe-0.metrics_url)
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import zmq
from prometheus_client import CollectorRegistry, start_http_server

from areal_bus.wire import messages as m
from areal_bus.runtime.metrics import Metrics, RateWindow
from areal_bus.runtime.node import NodeShell
from areal_bus.config.node_configs import ProbeConfig
from areal_bus.runtime.prometheus import HeartbeatCollector, NodeSample


class ProbeView:
    """Per-node rates and state from heartbeats, and rollout workers' weight-swap times from their
    version acks. Holds no sockets. The lock is for the Prometheus server's thread, which reads the
    view (``samples``) while the probe's loop adds to it."""

    def __init__(self):
        self.last: dict[str, m.Heartbeat] = {}
        self.windows: dict[str, RateWindow] = {}
        self.seen_at: dict[str, float] = {}
        self.swaps: dict[str, Metrics] = {}  # rollout worker -> its weight_swap_seconds histogram
        self.acked: dict[str, tuple[str, int]] = {}  # rollout worker -> (lineage, version) it last acked
        self.lock = threading.Lock()

    def add(self, hb: m.Heartbeat, now: float) -> None:
        with self.lock:
            prev = self.last.get(hb.node_id)
            if prev is None or prev.incarnation != hb.incarnation:
                self.windows[hb.node_id] = RateWindow()
            self.windows[hb.node_id].add(hb.t, hb.counters)
            self.last[hb.node_id] = hb
            self.seen_at[hb.node_id] = now

    def add_ack(self, ack: m.VersionAck) -> None:
        """A rollout worker serves ``ack.version``: a new version is a swap, timed by ``switch_seconds``.
        Workers repeat their ack every announcement (to heal a lost one): a repeat is no swap, and the
        first ack heard from a worker only sets where it stands (it may be such a repeat)."""
        now_serving = (ack.lineage, ack.version)
        with self.lock:
            before = self.acked.get(ack.node_id)
            self.acked[ack.node_id] = now_serving
            if before is not None and before != now_serving:
                self.swaps.setdefault(ack.node_id, Metrics()).observe_seconds("weight_swap_seconds",
                                                                              ack.switch_seconds)

    def samples(self, now: float, dead_after: float) -> list[NodeSample]:
        """Every node's latest metrics for the Prometheus collector, in the probe's row order; the
        trainer's busy fraction (over the rate window) and the swap histograms added."""
        with self.lock:
            out = []
            for node_id in sorted(self.last, key=_node_order):
                hb = self.last[node_id]
                counters, gauges, hists = dict(hb.counters), dict(hb.gauges), dict(hb.hists)
                if hb.kind == "trainer":
                    gauges["busy_fraction"] = min(1.0, self.windows[node_id].rate("busy_seconds"))
                if node_id in self.swaps:
                    swap_counters, _, swap_hists = self.swaps[node_id].snapshot()
                    counters.update(swap_counters)
                    hists.update(swap_hists)
                out.append(NodeSample(node=node_id, kind=hb.kind, alive=now - self.seen_at[node_id] <= dead_after,
                                      last_seen=hb.t, version=hb.version, counters=counters, gauges=gauges,
                                      hists=hists))
            return out

    def rows(self, now: float, dead_after: float) -> list[dict]:
        with self.lock:
            return self._rows(now, dead_after)

    def _rows(self, now: float, dead_after: float) -> list[dict]:
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


class MetricsServer:
    """GET /metrics on ``host:port`` (0: a free port), served by prometheus_client from its own thread:
    the view's latest heartbeats as Prometheus families at every scrape."""

    def __init__(self, view: ProbeView, dead_after: float, host: str, port: int):
        registry = CollectorRegistry(auto_describe=False)  # registering must not scrape
        registry.register(HeartbeatCollector(lambda: view.samples(time.monotonic(), dead_after)))
        try:
            self.httpd, self.thread = start_http_server(port, addr=host, registry=registry)
        except OSError as err:  # say which knob, not only errno
            raise OSError(err.errno, f"cannot serve Prometheus metrics on {host}:{port} ({err.strerror}); "
                          f"set nodes.probe.config.metrics_port (0: a free one) or metrics_host") from None
        bound = self.httpd.server_address
        self.url = f"http://{_url_host(bound[0])}:{bound[1]}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=2)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def attach(topo, *, interval: float = 2.0, duration: float | None = None, as_json: bool = False,
           out=sys.stdout, base=None, as_node: bool = False, replica: int = 0,
           prometheus: ProbeConfig | None = None) -> int:
    """Report every ``interval`` s until stopped (or ``duration`` s). ``prometheus``: also serve GET
    /metrics where it says (an attached probe prints the address on stderr; a probe node writes it to
    log_dir/<node>.metrics_url, so that tests and scrape configs find a port 0 picked)."""
    # A probe attached from a shell gets an id of its own, so it never shadows a probe node.
    shell = NodeShell(topo, "probe", replica if as_node else 1000 + os.getpid() % 100000, base=base,
                      echo=as_node, topics=(m.TOPIC_VERSION_ACK,))
    if as_node:
        shell.install_signal_handlers()
        shell.announce_start()
        shell.start_heartbeat()
    view = ProbeView()
    server = url_file = None
    poller = zmq.Poller()
    poller.register(shell.sub, zmq.POLLIN)
    t0 = next_report = time.monotonic()
    next_report += interval
    try:
        if prometheus is not None and prometheus.enabled:
            server = MetricsServer(view, shell.peers.timeout, prometheus.metrics_host, prometheus.metrics_port)
            if as_node:
                url_file = shell.log_dir / f"{shell.node_id}.metrics_url"
                _write_atomically(url_file, server.url + "\n")
                shell.log.info("prometheus", url=server.url)
            else:
                print(f"prometheus metrics at {server.url}", file=sys.stderr, flush=True)
        while not shell.stopping.is_set():
            poller.poll(100)
            now = time.monotonic()
            for _, msg in shell.drain_hub():
                if isinstance(msg, m.Heartbeat) and msg.node_id != shell.node_id:
                    view.add(msg, now)
                elif isinstance(msg, m.VersionAck):
                    view.add_ack(msg)
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
        if server is not None:
            server.close()
        if url_file is not None:
            url_file.unlink(missing_ok=True)  # a stale address would send a scraper to nothing, or to another run
        shell.close()
    return 0


def _write_atomically(path: Path, text: str) -> None:
    # A reader polling for the file never sees it half written.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def run(topo, replica: int = 0, base=None) -> int:
    cfg = topo.nodes.probe.config
    if cfg.metrics_port:  # replica N on metrics_port + N: replicas never fight over one port
        cfg = cfg.model_copy(update={"metrics_port": cfg.metrics_port + replica})
    return attach(topo, interval=5.0, base=base, as_node=True, replica=replica, prometheus=cfg)
