"""Agent node: plays episodes under the staleness admission rule and records each as a trajectory.

``core`` holds the socket-free EpisodeSource and the task drivers; ``node`` wires them to the rollout
workers over the bus (``agent.via: bus``); ``via_gateway`` plays the episodes through the gateway node
with the stock openai SDK instead (``agent.via: gateway``), as a user's agent would.

Run: areal-bus node agent --topology topology/default.yaml --replica 0
"""

from __future__ import annotations

from nodes.agent.core import EpisodeSource, SimDriver, make_driver

__all__ = ["EpisodeSource", "SimDriver", "make_driver", "run"]


def run(topo, replica: int = 0, base=None) -> int:
    if topo.agent.via == "gateway":
        # lazy: only the path this run takes loads (the gateway agent pulls aiohttp and the openai SDK)
        from nodes.agent.via_gateway import run as run_via_gateway

        return run_via_gateway(topo, replica, base)
    from nodes.agent.node import run as run_over_bus  # lazy: as via_gateway above

    return run_over_bus(topo, replica, base)
