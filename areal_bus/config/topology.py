"""The topology: one pydantic tree holds every knob a run has, validated with errors that name the file,
the field path and what is allowed. Import it from here; it is written in parts:

- config/base.py      TopologyError, the strict model base, NODE_KINDS, the experimental mark
- config/sections.py  the sections (staleness, agent, model, endpoints, nodes, ...)
- config/engines.py   rollout_engine and trainer_engine: one schema per kind, chosen by ``kind``
- config/root.py      ``Topology``: the top-level knobs, checks across sections, derived values
- config/loading.py   load_topology / parse_topology (``${NAME}`` expanded), dump_resolved (redacted)
- config/knobs.py     every knob listed (``areal-bus knobs``, docs/knobs.md)

A topology YAML says which nodes run (kind, replicas, host, per-node config), where they meet
(``endpoints``) and the training knobs users know from AReaL (async.enabled, staleness_threshold,
trigger_batch_size, ...). Each kind's ``config`` has its schema in config/node_configs.py. Load with
``load_topology(path)``; ``files.check_files(topo, base)`` then checks what the run will read from
disk (the model folder, the router files), which ``areal-bus validate``, ``render`` and ``node`` do.
Knobs marked experimental need ``experimental: true`` at the top of the file (docs/knob-notes.md).
"""

from __future__ import annotations

from areal_bus.config.base import NODE_KINDS, TopologyError
from areal_bus.config.engines import (LengthDistribution, RolloutEngineConfig, SimRolloutEngineConfig,
                                      SimTrainerEngineConfig, TorchRolloutEngineConfig, TorchTrainerEngineConfig,
                                      TrainerEngineConfig, VllmRolloutEngineConfig)
from areal_bus.config.loading import dump_resolved, load_topology, parse_topology, read_yaml
from areal_bus.config.root import CHANNEL_OWNERS, Topology
from areal_bus.config.sections import (AgentConfig, DatasetConfig, Endpoints, ModelSpec, NodeSpec, Parallelism,
                                       StalenessConfig)

__all__ = ["NODE_KINDS", "CHANNEL_OWNERS", "TopologyError", "Topology", "load_topology", "parse_topology",
           "read_yaml", "dump_resolved", "LengthDistribution", "RolloutEngineConfig", "TrainerEngineConfig",
           "SimRolloutEngineConfig", "TorchRolloutEngineConfig", "VllmRolloutEngineConfig",
           "SimTrainerEngineConfig", "TorchTrainerEngineConfig", "AgentConfig", "DatasetConfig", "Endpoints",
           "ModelSpec", "NodeSpec", "Parallelism", "StalenessConfig"]
