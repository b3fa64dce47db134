"""Rollout node: a generation worker. Pulls requests, decodes them in a continuous batch, tags every
token with the policy version that produced it, and sends each completion back to the agent (or the
gateway) that asked for it.

The loop has one rhythm, the engine's decode step. Between two steps (the safe point) the worker
drains the hub, switches to a newly announced policy version without stopping the running batch
(tokens after the switch carry the new version), and lets new requests join while it has free slots.
It reads work only when it has a free slot and its outbox has room, so a slow agent turns into
backpressure, never into loss. Its heartbeat lists the requests it holds, so the agent can reissue
them if this worker dies. A gateway request marked ``stream`` also gets its tokens as they are made
(PartialCompletion), for the gateway to stream to its client.

``core`` holds that logic without sockets (``RolloutCore``, ``ReplyTo``, ``StepLog``); ``node`` wires it
to the bus (``run``). The engine itself is built by ``areal_bus.engines.rollout_factory``.

Run: areal-bus node rollout --topology topology/default.yaml --replica 0
"""

from __future__ import annotations

from nodes.rollout.node import run as run_node


def run(topo, replica: int = 0, base=None) -> int:
    return run_node(topo, replica, base)
