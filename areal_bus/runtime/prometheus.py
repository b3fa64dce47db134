"""Heartbeats -> Prometheus metric families: what the probe serves on GET /metrics.

Every node's heartbeat carries its counters, gauges and histograms (areal_bus/runtime/metrics.py). This
module maps the latest heartbeat of each node to Prometheus families at scrape time, through a
``prometheus_client`` custom collector: nothing is mirrored into client-side metric objects, so a
scrape always reads what the nodes last said, and a node's restart shows as a counter reset, which
``rate()`` handles. Every series carries ``node`` (``trainer-0``) and ``kind`` (``trainer``) labels.

The mapping, by heartbeat name (names are made Prometheus-safe: ``.`` and other signs become ``_``):

- counter ``x`` -> counter ``areal_bus_x_total``: ``samples`` and ``tokens`` (their ``rate()`` is the
  probe's samples/s and tokens/s), the trainer's ``busy_seconds`` (its ``rate()`` is the busy
  fraction), ``stale_dropped``, ``duplicates``, ``steps``, ``weight_swaps``, ...;
- counters with a reason after a known prefix become one family with a ``reason`` label:
  ``dropped.<reason>`` -> ``areal_bus_dropped_frames_total``, the gateway's ``http.rejected.<reason>``
  (4xx) and ``http.failed.<reason>`` (5xx) -> ``areal_bus_http_rejected_total`` and
  ``areal_bus_http_failed_total``; their unlabelled sums (``http.rejected``) are left out, as
  Prometheus sums by itself;
- gauge ``x`` -> gauge ``areal_bus_x``, except queue depths (``queue.*`` and ``*.pending``, what the
  probe shows as queues) -> ``areal_bus_queue_depth{queue="queue.buffered"}``;
- histogram ``x`` -> histogram ``areal_bus_x``: exact integer values (the trainer's ``staleness``, in
  versions) get one bucket per value from 0 to the largest seen; duration histograms
  (``Metrics.observe_seconds``: ``gateway.latency_seconds``) keep their fixed edges and their sum;
- per node: ``areal_bus_node_up`` (1 while it heartbeats), ``areal_bus_node_last_seen_timestamp_seconds``
  (the Unix time of its last heartbeat) and ``areal_bus_policy_version``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from areal_bus.runtime.metrics import INF_BUCKET

PREFIX = "areal_bus_"
LABELS = ("node", "kind")

REASON_FAMILIES = {
    "dropped.": ("dropped_frames", "Frames a node refused and dropped (malformed, wrong wire version, wrong "
                 "type), by reason."),
    "http.rejected.": ("http_rejected", "Gateway requests refused with a 4xx, by reason (the API error code)."),
    "http.failed.": ("http_failed", "Gateway requests that failed with a 5xx, by reason."),
}
"""Counter prefixes whose rest is a reason: one family with a ``reason`` label rather than a family per
reason. The prefix without its dot (``http.rejected``) is the node's own sum of them and is left out."""

MAX_VALUE_BUCKETS = 256
"""An integer histogram gets one bucket per value up to this (staleness stays under 64 versions); past it,
only the values seen, so that a wild value cannot make a scrape of millions of buckets."""

HELP = {
    "samples": "Samples (trajectories) the node produced or consumed; rate() is samples/s.",
    "tokens": "Tokens the node generated (rollout), recorded (agent, gateway) or trained on; rate() is tokens/s.",
    "busy_seconds": "Seconds the trainer spent in updates; rate() is its busy fraction.",
    "stale_dropped": "Trajectories the trainer dropped as over the staleness bound.",
    "duplicates": "Trajectories the trainer received again after accepting them (acknowledged, not trained twice).",
    "busy_fraction": "The trainer's busy fraction over the probe's last few heartbeats.",
    "staleness": "Policy versions a trained sample's oldest token lagged the update that trained it.",
    "gateway.latency_seconds": "Gateway chat requests answered, by seconds from arrival to their "
                               "completion (the request log's ms=); refusals are counted, not timed.",
    "weight_swap_seconds": "Seconds a rollout worker took to switch to a new policy version (from its acks).",
    "commit_latency_s": "Seconds from a version's announcement to every live rollout worker serving it (last one).",
}
"""HELP text of the names dashboards use; the others say which heartbeat name they carry."""

ZERO_COUNTERS = {"trainer": ("stale_dropped", "duplicates")}
"""Counters a dashboard alerts on, present at 0 before their first event (a node counts a name only once
it happens): ``increase()`` then has a series to read from the start."""


@dataclass(slots=True)
class NodeSample:
    """What the collector needs of one node: its latest heartbeat's metrics and whether it still beats."""

    node: str
    kind: str
    alive: bool
    last_seen: float  # Unix time of the heartbeat (the node's clock)
    version: int
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    hists: dict[str, dict[str, float]] = field(default_factory=dict)


def metric_name(name: str) -> str:
    """``queue.buffered`` -> ``areal_bus_queue_buffered``: Prometheus names allow [a-zA-Z0-9_:] only."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", name)


class _Families:
    """Families by name, each made on first use; one name never gets two types (the exposition would
    be refused), so a later family whose name is taken by another type gets its type as a suffix."""

    def __init__(self):
        self.by_name: dict[str, Metric] = {}

    def get(self, cls, name: str, doc: str, labels=LABELS) -> Metric:
        fam = self.by_name.get(name)
        if fam is not None and not isinstance(fam, cls):
            name = f"{name}_{cls.__name__.removesuffix('MetricFamily').lower()}"
            fam = self.by_name.get(name)
        if fam is None:
            fam = self.by_name[name] = cls(name, doc, labels=list(labels))
        return fam


def families(samples: Iterable[NodeSample]) -> list[Metric]:
    """The Prometheus families of these nodes' metrics (the mapping in the module docstring)."""
    fams = _Families()
    up = fams.get(GaugeMetricFamily, PREFIX + "node_up", "1 while the node heartbeats, 0 once it went silent.")
    seen = fams.get(GaugeMetricFamily, PREFIX + "node_last_seen_timestamp_seconds",
                    "Unix time of the node's last heartbeat.")
    version = fams.get(GaugeMetricFamily, PREFIX + "policy_version",
                       "The policy version the node serves or knows of (its heartbeat's version).")
    for s in samples:
        labels = [s.node, s.kind]
        up.add_metric(labels, 1.0 if s.alive else 0.0)
        seen.add_metric(labels, s.last_seen)
        version.add_metric(labels, float(s.version))
        _counters(fams, s, labels)
        _gauges(fams, s, labels)
        for name, buckets in sorted(s.hists.items()):
            _histogram(fams, name, buckets, s.counters.get(f"{name}.sum"), labels)
    return list(fams.by_name.values())


def _counters(fams: _Families, s: NodeSample, labels: list[str]) -> None:
    counters = {**dict.fromkeys(ZERO_COUNTERS.get(s.kind, ()), 0.0), **s.counters}
    for name, value in sorted(counters.items()):
        if name.endswith(".sum") and name[:-4] in s.hists:
            continue  # a duration histogram's sum: it rides with the histogram
        prefix = next((p for p in REASON_FAMILIES if name.startswith(p)), None)
        if prefix is not None:
            fam_name, doc = REASON_FAMILIES[prefix]
            fam = fams.get(CounterMetricFamily, PREFIX + fam_name, doc, (*LABELS, "reason"))
            fam.add_metric([*labels, name[len(prefix):]], value)
        elif name + "." not in REASON_FAMILIES:
            doc = HELP.get(name, f"Heartbeat counter {name}.")
            fams.get(CounterMetricFamily, metric_name(name), doc).add_metric(labels, value)


def _gauges(fams: _Families, s: NodeSample, labels: list[str]) -> None:
    for name, value in sorted(s.gauges.items()):
        if name.startswith("queue.") or name.endswith(".pending"):
            fam = fams.get(GaugeMetricFamily, PREFIX + "queue_depth", "Items waiting in a node's queue (unsent "
                           "requests, a sender's pending trajectories, the trainer's buffer), by queue.",
                           (*LABELS, "queue"))
            fam.add_metric([*labels, name], value)
        else:
            doc = HELP.get(name, f"Heartbeat gauge {name}.")
            fams.get(GaugeMetricFamily, metric_name(name), doc).add_metric(labels, value)


def _histogram(fams: _Families, name: str, buckets: dict[str, float], total: float | None,
               labels: list[str]) -> None:
    counts = {}
    for key, count in buckets.items():
        try:
            counts[float(key)] = counts.get(float(key), 0.0) + count
        except ValueError:
            return  # not a bucket we know how to read; a malformed histogram is skipped, not raised
    if INF_BUCKET not in buckets and all(k.is_integer() and 0 <= k <= MAX_VALUE_BUCKETS for k in counts):
        # Exact integer values (Metrics.observe): every value 0..max its own bucket, so that the bucket
        # set only grows as new values appear and the sum is exact.
        edges = [float(v) for v in range(int(max(counts, default=0)) + 1)]
        total = sum(k * c for k, c in counts.items())
    else:  # fixed edges (Metrics.observe_seconds), or values past a bucket each: the edges seen
        edges = sorted(k for k in counts if math.isfinite(k))
        if total is None:
            total = sum(k * c for k, c in counts.items() if math.isfinite(k))
    out, running = [], 0.0
    for edge in edges:
        running += counts.get(edge, 0.0)
        out.append((floatToGoString(edge), running))
    out.append((INF_BUCKET, sum(counts.values())))
    fam = fams.get(HistogramMetricFamily, metric_name(name), HELP.get(name, f"Heartbeat histogram {name}."))
    fam.add_metric(labels, out, sum_value=total)


class HeartbeatCollector:
    """A ``prometheus_client`` collector: at every scrape, the families of what ``latest()`` returns (the
    probe's newest heartbeat of each node). Register it with ``CollectorRegistry(auto_describe=False)``
    so that registering it does not scrape."""

    def __init__(self, latest: Callable[[], Iterable[NodeSample]]):
        self.latest = latest

    def collect(self) -> Iterator[Metric]:
        yield from families(self.latest())
