"""Per-node metrics: counters (monotonic), gauges (current value) and integer histograms.

A node's main thread updates them; its heartbeat thread snapshots and publishes them. Plain dicts
are enough: CPython's dict copy is atomic under the GIL, and a counter read one increment late is
harmless. ``RateWindow`` turns successive snapshots into per-second rates for the probe.
"""

from __future__ import annotations

import collections


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
