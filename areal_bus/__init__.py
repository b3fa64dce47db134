"""areal_bus: fully asynchronous RL for LLM agents on a ZeroMQ message bus.

The library every node shares: wire messages and codec, channels, the node shell, the topology schema
and its rendering to supervisord, admission and staleness rules, engines and metrics. It knows nothing
of any one node's logic (those live in ``nodes/``)."""

__version__ = "0.1.0"
