"""Gateway node: the HTTP front door (OpenAI and Anthropic APIs) through which agents join training.

``app`` composes the gateway (``Gateway``) and builds the aiohttp application (``make_app``; its
config, ``GatewayConfig``, is in areal_bus/config/node_configs.py with the topology's other node
configs). Its pieces, each given what it uses: ``keys`` who a request's key names; ``sessions`` records
each session's tokens and ends it into trajectories; ``lifecycle`` ends sessions (asked, idle,
shutdown), emits their trajectories and restores what the WAL kept; ``policy_chat`` the service that
serves a chat request with the policy; ``shaping`` a completion post-processed into the reply
(stops, tool calls, reasoning); ``upstream`` other models, through the router. The route groups, each
holding what it needs and adding its own routes: ``openai_routes`` chat completions and models;
``anthropic_routes`` the Anthropic Messages API (``anthropic_api``, ``anthropic_reply`` its request and
reply); ``responses_routes`` the OpenAI Responses API (``responses_api``); ``completions_routes``
legacy completions; ``rl_routes`` the /rl session routes and /health. Around them: ``server`` the HTTP
plumbing (body reading, the error middleware, ``start_server``); ``live`` and ``feed`` streaming as it
generates; ``chat`` renders conversations through the policy's chat template; ``parsers`` the
tool-call and reasoning formats; ``openai_api`` the OpenAI schema; ``guard`` the input limits and the
log redaction; ``backend`` defines where generations come from; ``bus_backend`` gets them from rollout
workers; ``wal`` the local WAL; ``node`` wires it all to the bus; ``standalone`` runs the gateway alone
in one process with the policy in it (tests, benchmarks).

Run: areal-bus node gateway --topology topology/default.yaml --replica 0
"""

from __future__ import annotations


def run(topo, replica: int = 0, base=None) -> int:
    # lazy: the CLI imports this package to dispatch by name; the node (zmq, the app) loads only when run
    from nodes.gateway.node import run as run_node

    return run_node(topo, replica, base)
