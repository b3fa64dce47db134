"""Gateway node: the HTTP front door (OpenAI and Anthropic APIs) through which agents join training.

``app`` builds the aiohttp application (``make_app``) and serves the chat APIs (its config,
``GatewayConfig``, is in areal_bus/config/node_configs.py with the topology's other node configs);
``policy_chat`` a chat request served by the policy; ``anthropic_api``, ``anthropic_reply`` and
``anthropic_routes`` the Anthropic Messages API in, out and its routes; ``live`` streaming as it
generates; ``rl_routes`` the /rl session routes; ``server`` the HTTP plumbing (error middleware, ``start_server``); ``sessions``
records each session's tokens and ends it into trajectories; ``chat`` renders conversations through
the policy's chat template; ``guard`` holds the input limits and the log redaction; ``backend`` defines
where generations come from; ``bus_backend`` gets them from rollout workers; ``node`` wires it all to the
bus; ``standalone`` runs the gateway alone in one process with the policy in it (tests, benchmarks).

Run: areal-bus node gateway --topology topology/default.yaml --replica 0
"""

from __future__ import annotations


def run(topo, replica: int = 0, base=None) -> int:
    from nodes.gateway.node import run as run_node

    return run_node(topo, replica, base)
