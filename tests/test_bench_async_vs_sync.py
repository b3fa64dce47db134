"""bench/async_vs_sync.py: each over-stale policy's async run renders a topology the system accepts, with
exactly that policy's staleness fields."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from areal_bus.config.topology import parse_topology  # noqa: E402
from bench.async_vs_sync import POLICIES, topology  # noqa: E402


def test_each_policy_renders_its_own_staleness_fields_and_parses():
    seen = {}
    for policy in POLICIES:
        topo = parse_topology(topology("async", 10, 1.0, policy=policy))
        seen[policy] = (topo.staleness.drop_at_consume, topo.staleness.per_token)
        assert topo.async_.enabled
    assert seen == {"drop": (True, False), "keep": (False, False), "per_token": (True, True)}
