"""Per-node metrics: counters (monotonic), gauges (current value) and histograms.

A node's main thread updates them; its heartbeat thread snapshots and publishes them. Plain dicts
are enough: CPython's dict copy is atomic under the GIL, and a counter read one increment late is
harmless. ``RateWindow`` turns successive snapshots into per-second rates for the probe.

Histograms come in two shapes, both cumulative over the node's life and both ``{bucket: count}`` on
the wire: ``observe`` counts exact integer values (staleness in versions: every value its own bucket),
``observe_seconds`` counts durations into the fixed upper edges ``SECONDS_BUCKETS`` plus ``+Inf``
(every edge present, zeros included, so each scrape sees the same buckets) and keeps their sum in the
counter ``<name>.sum``. areal_bus/runtime/prometheus.py turns either into a Prometheus histogram.
"""

from __future__ import annotations

import bisect
import collections

SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Upper edges (seconds) of ``observe_seconds`` histograms: Prometheus' default buckets stretched to two
minutes, because a gateway request waits on whole generations and a weight swap on a large copy."""
INF_BUCKET = "+Inf"

class Metrics:
    def __init__(self):
        self.counters: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.gauges: dict[str, float] = {}
        self.hists: dict[str, collections.Counter] = {}

    def inc(self, name: str, by: float = 1.0) -> None:
        self.counters[name] += by

    def gauge(self, name: str, value: float) -> None:
        self.gauges[name] = value

    def observe(self, name: str, bucket: int, count: int = 1) -> None:
        self.hists.setdefault(name, collections.Counter())[bucket] += count

    def observe_seconds(self, name: str, seconds: float) -> None:
        """Count one duration into ``name``'s fixed buckets and add it to the counter ``<name>.sum``."""
        hist = self.hists.get(name)
        if hist is None:
            hist = self.hists[name] = collections.Counter({str(e): 0 for e in (*SECONDS_BUCKETS, INF_BUCKET)})
        i = bisect.bisect_left(SECONDS_BUCKETS, seconds)  # the first edge >= seconds (le is inclusive)
        hist[str(SECONDS_BUCKETS[i]) if i < len(SECONDS_BUCKETS) else INF_BUCKET] += 1
        self.counters[f"{name}.sum"] += seconds

    def snapshot(self) -> tuple[dict, dict, dict]:
        # msgpack map keys must be str for strict decoding: histogram buckets are sent as strings.
        return (dict(self.counters), dict(self.gauges),
                {name: {str(k): v for k, v in dict(h).items()} for name, h in list(self.hists.items())})


class RateWindow:
    """Rates of a node's counters between its last two heartbeats, smoothed over ``span`` beats."""

    def __init__(self, span: int = 4):
        self.samples: collections.deque[tuple[float, dict]] = collections.deque(maxlen=span + 1)

    def add(self, t: float, counters: dict) -> None:
        if self.samples and t <= self.samples[-1][0]:
            self.samples.clear()  # the node restarted (its clock of counters went back)
        self.samples.append((t, counters))

    def rate(self, name: str) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        if t1 <= t0:
            return 0.0
        return max(0.0, (c1.get(name, 0.0) - c0.get(name, 0.0)) / (t1 - t0))
