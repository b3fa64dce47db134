"""``Topology``: the root of the schema, its top-level knobs (the names users know from AReaL), the
checks that span sections, and what the rest of the code derives from it (replica counts, endpoints,
paths). The sections it holds are in config/sections.py and config/engines.py; loading a file, with
errors that name it, is config/loading.py. Import all of it from ``areal_bus.config.topology``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from areal_bus.admission import group_stall
from areal_bus.config import placement
from areal_bus.config.base import Strict, experimental_in_use
from areal_bus.config.engines import (ROLLOUT_KINDS, TRAINER_KINDS, RolloutEngineConfig, SimRolloutEngineConfig,
                                      SimTrainerEngineConfig, TrainerEngineConfig, check_kind)
from areal_bus.config.node_configs import GatewayConfig, RewardNodeConfig
from areal_bus.config.sections import (AgentConfig, AsyncConfig, DurabilityConfig, Endpoints, LoggingConfig,
                                       ModelSpec, Nodes, Parallelism, StalenessConfig)


class Topology(Strict):
    name: str = Field("default", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Run name.")
    experimental: bool = Field(False, description="Opt in to the knobs marked experimental (docs/knobs.md); "
                               "without it a non-default value of one is refused.")
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async", description="Asynchronous or "
                                "synchronous mode.")
    rollout_workers: int = Field(4, ge=0, le=1024, description="Rollout worker processes (edit to scale); the "
                                 "one place their count is written.")
    train_workers: int = Field(1, ge=1, le=1024, description="Trainer ranks (processes): train_workers / "
                               "parallelism.tp data-parallel groups of tp tensor-parallel ranks.")
    staleness_threshold: int = Field(2, ge=0, le=64, description="Policy versions a trajectory may lag when "
                                     "consumed; 1 is nearly synchronous, 2-4 recommended.")
    staleness: StalenessConfig = Field(default_factory=StalenessConfig, description="How staleness_threshold is "
                                       "enforced beyond admission.")
    queue_max_size: int = Field(256, ge=1, le=1_000_000, description="Trajectory queue capacity; past it producers "
                                "see backpressure, never silent loss.")
    trigger_batch_size: int = Field(16, ge=1, le=1_000_000, description="Ready samples that trigger one update "
                                    "(async mode; start at global_batch_size / 2), and the batch of the "
                                    "staleness admission rule.")
    global_batch_size: int = Field(32, ge=1, le=1_000_000, description="Most samples one update consumes "
                                   "(exactly what it consumes in synchronous mode).")
    whole_groups: bool = Field(True, description="Async: an update takes GRPO groups whole, never a group's early "
                               "finishers without the rest, unless the queue holds a whole global batch without "
                               "enough whole groups (then oldest first).")
    mini_batch_size: int = Field(8, ge=1, le=1_000_000, description="PPO mini-batch: an update of B samples takes "
                                 "ceil(B / mini_batch_size) optimizer steps on equal parts of it.")
    learning_rate: float = Field(1e-5, gt=0, le=1, description="Optimizer learning rate.")
    max_steps: int = Field(20, ge=1, le=10_000_000, description="Updates before the run ends by itself.")
    parallelism: Parallelism = Field(default_factory=Parallelism, description="The layout inside train_workers.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Log folder and intervals.")
    durability: DurabilityConfig = Field(default_factory=DurabilityConfig, description="The trainer's spool and "
                                         "the watchdog.")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="What plays episodes and scores them.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="The policy checkpoint and where it runs.")
    rollout_engine: RolloutEngineConfig = Field(default_factory=SimRolloutEngineConfig, description="How rollout "
                                                "workers generate; its fields depend on its kind.")
    trainer_engine: TrainerEngineConfig = Field(default_factory=SimTrainerEngineConfig, description="How the "
                                                "trainer trains; its fields depend on its kind.")
    endpoints: Endpoints = Field(default_factory=Endpoints, description="Where the nodes meet (ipc or tcp).")
    nodes: Nodes = Field(default_factory=Nodes, description="Node kinds to run; kinds left out get their defaults.")

    @field_validator("staleness", mode="before")
    @classmethod
    def _staleness_is_a_section(cls, value):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            raise ValueError(f"staleness is a section ({{drop_at_consume: true|false}}); the threshold itself is "
                             f"staleness_threshold: {value}")
        return value

    @field_validator("rollout_engine", mode="before")
    @classmethod
    def _rollout_kind(cls, value):
        return check_kind("rollout_engine", ROLLOUT_KINDS, value)

    @field_validator("trainer_engine", mode="before")
    @classmethod
    def _trainer_kind(cls, value):
        return check_kind("trainer_engine", TRAINER_KINDS, value)

    @model_validator(mode="after")
    def _experimental_opt_in(self):
        used = [] if self.experimental else experimental_in_use(self)
        if used:
            one = len(used) == 1
            raise ValueError(f"{' and '.join(used)} {'is' if one else 'are'} experimental: opt in with "
                             f"experimental: true at the top of the topology (docs/knob-notes.md says what is "
                             f"known of {'it' if one else 'them'}), or leave {'it' if one else 'them'} at the default")
        return self

    @model_validator(mode="after")
    def _coherent(self):
        tp = self.parallelism.tp  # train_workers is the count, tp the layout inside it, dp derived
        if self.train_workers % tp:
            raise ValueError(f"train_workers ({self.train_workers}) must be a multiple of parallelism.tp ({tp}): "
                             f"the trainer runs train_workers / tp data-parallel groups of tp ranks (dp 2 x tp "
                             f"{tp}: train_workers: {2 * tp})")
        self.parallelism._dp = self.train_workers // tp
        if self.trigger_batch_size > self.global_batch_size:
            raise ValueError(f"trigger_batch_size ({self.trigger_batch_size}) must be <= global_batch_size "
                             f"({self.global_batch_size})")
        if self.mini_batch_size > self.global_batch_size:
            raise ValueError(f"mini_batch_size ({self.mini_batch_size}) must be <= global_batch_size "
                             f"({self.global_batch_size})")
        if self.global_batch_size > self.queue_max_size:
            raise ValueError(f"global_batch_size ({self.global_batch_size}) must fit in queue_max_size "
                             f"({self.queue_max_size}) or no update could ever trigger")
        if (self.rollout_engine.kind == "sim") != (self.trainer_engine.kind == "sim"):
            raise ValueError("rollout_engine.kind and trainer_engine.kind must both be 'sim', or 'torch'/'vllm' "
                             "with 'torch'")
        if self.trainer_device.startswith("cuda") and not self.model.device.startswith("cuda"):
            raise ValueError(f"model.trainer_device {self.trainer_device!r} is a GPU but model.device "
                             f"{self.model.device!r} is not: a trainer on a GPU hands its weights over by CUDA IPC, "
                             f"so the rollout workers must be on a GPU of the same host too")
        engine = self.rollout_engine
        if engine.kind == "vllm" and not re.fullmatch(r"cuda(:0)?", self.model.device):
            raise ValueError(f"rollout_engine.kind 'vllm' runs on the first GPU the process sees: model.device "
                             f"must be 'cuda' (choose the GPU with CUDA_VISIBLE_DEVICES), got {self.model.device!r}")
        if engine.kind == "torch":
            self._torch_decode_step(engine)
        if getattr(self.trainer_engine, "lora", None) is not None:
            self._lora_served()
        if (self.agent.framework == "sim") != (engine.kind == "sim"):
            raise ValueError("agent.framework 'sim' goes with the sim engines, a real task with the torch engines")
        if self.agent.via == "gateway" and (self.replicas("gateway") < 1 or self.agent.framework == "sim"):
            raise ValueError("agent.via 'gateway' needs a gateway node (nodes.gateway) and a real task "
                             "(agent.framework 'guess', 'math' or a task of your own)")
        if self.staleness.in_order and self.agent.via != "bus":
            raise ValueError("staleness.in_order orders the bus agent's groups (agent.via 'bus'); with agent.via "
                             "'gateway' episodes go through the gateway's sessions, which it does not reorder: "
                             "set agent.via 'bus' or leave in_order out")
        if self.agent.reward_source == "reward_model" and not self.reward_config().model_path:
            raise ValueError("agent.reward_source reward_model needs nodes.reward.config.model_path (a "
                             "sequence-classification checkpoint)")
        stall = group_stall(self)  # whole GRPO groups that can never add up to an update
        if stall:
            raise ValueError(stall)
        gateway = self.nodes.gateway.config
        if gateway.max_context_tokens is None:  # the engine's sequence length is the gateway's context
            gateway.max_context_tokens = engine.max_len
        for kind in ("bus", "trainer", "weights"):
            spec = self.nodes.get(kind)
            if spec is not None and spec.replicas not in (None, 1):
                raise ValueError(f"nodes.{kind}.replicas must be 1 (one {kind} per run; "
                                 f"trainer ranks are set by train_workers)")
        ep = self.endpoints
        if ep.transport == "tcp" and ep.curve is None and not ep.allow_insecure:
            hosts = [("endpoints.host", ep.host)] + [(f"nodes.{k}.host", spec.host) for k, spec in self.nodes.items()
                                                     if spec.host != "localhost"]
            exposed = [(f, h) for f, h in hosts if not _loopback(h)]
            if exposed:
                field, host = exposed[0]
                raise ValueError(f"{field} {host} is not a loopback address, so tcp between hosts must use CURVE: "
                                 f"run `areal-bus keys --out keys`, copy keys/ to every host, and set "
                                 f"endpoints.curve.key: keys/cluster.key_secret (or endpoints.allow_insecure: "
                                 f"true on a network you trust entirely)")
        return self

    def _lora_served(self) -> None:
        """trainer_engine.lora needs a layout that trains adapters and a rollout engine that serves them: the
        torch engine adds them to its base unmerged; the vLLM engine through vLLM's own LoRA layers, which
        hold a rank up to vLLM's largest max_lora_rank and run in bfloat16 or float16 only."""
        if self.rollout_engine.kind == "vllm":
            from areal_bus.engines.vllm_worker import VLLM_LORA_RANKS  # lazy: only a vLLM topology needs it

            rank = self.trainer_engine.lora.rank
            if rank > VLLM_LORA_RANKS[-1]:
                raise ValueError(f"trainer_engine.lora.rank {rank}: rollout_engine.kind 'vllm' serves adapters of rank "
                                 f"{VLLM_LORA_RANKS[-1]} at most (vLLM's max_lora_rank): lower the rank, or set "
                                 f"rollout_engine.kind 'torch'")
            if self.model.dtype not in ("bfloat16", "float16"):
                raise ValueError(f"trainer_engine.lora with rollout_engine.kind 'vllm': vLLM's LoRA kernels take "
                                 f"bfloat16 or float16, and model.dtype is {self.model.dtype!r}: set model.dtype "
                                 f"bfloat16, or rollout_engine.kind 'torch'")
        if self.parallelism.tp > 1:
            raise ValueError(f"trainer_engine.lora with parallelism.tp {self.parallelism.tp}: tensor parallelism "
                             f"does not split the adapters; use data parallelism (train_workers with tp 1), or "
                             f"leave trainer_engine.lora out")

    def _torch_decode_step(self, engine) -> None:
        tuned = [k for k, on in (("decode_attention", engine.decode_attention in ("matmul", "flash_varlen")),
                                 ("decode_compile", engine.decode_compile is True)) if on]
        if tuned and not self.model.device.startswith("cuda"):
            raise ValueError(f"rollout_engine.{' and '.join(tuned)} tune the torch engine's decode step on a GPU "
                             f"(CUDA graphs); with rollout_engine.kind 'torch' on model.device "
                             f"{self.model.device!r} they would do nothing: set device 'cuda', or leave them out")
        if engine.decode_attention == "flash_varlen" and self.model.dtype not in ("bfloat16", "float16"):
            raise ValueError(f"rollout_engine.decode_attention 'flash_varlen' runs FlashAttention, which takes "
                             f"bfloat16 or float16: set model.dtype to one of them (got {self.model.dtype!r}), or "
                             f"decode_attention 'sdpa'")

    @model_validator(mode="after")
    def _placement(self):
        # Hosts and placement (areal_bus/config/placement.py); the trainer node binds at its first host.
        placement.check(self)
        trainer = self.nodes.get("trainer")
        if trainer is not None and trainer.hosts:
            trainer.host = trainer.hosts[0]
        ep = self.endpoints
        spread = [h for _, spec in self.nodes.items() for h in (spec.hosts or [])]
        if ep.transport == "tcp" and ep.curve is None and not ep.allow_insecure:
            exposed = [h for h in spread if not _loopback(h)]
            if exposed:
                raise ValueError(f"nodes.*.hosts: {exposed[0]} is not a loopback address, so tcp between hosts "
                                 f"must use CURVE: run `areal-bus keys --out keys`, copy keys/ to every host, and "
                                 f"set endpoints.curve.key: keys/cluster.key_secret")
        return self

    # -- derived ------------------------------------------------------------------------------
    def replicas(self, kind: str) -> int:
        """Processes of ``kind`` this topology runs. A kind listed under ``nodes`` without replicas runs
        one (rollout: rollout_workers, always); the optional kinds (gateway, probe) run only when listed."""
        if kind == "rollout":
            return self.rollout_workers
        spec = self.nodes.get(kind)
        if spec is not None and spec.replicas is not None:
            return spec.replicas
        if kind in ("gateway", "probe"):
            return 1 if spec is not None else 0
        return 1

    def admission_sources(self) -> list[str]:
        """The nodes that start episodes, which share the admission rule's budget: agents that reach
        the rollout workers over the bus, and gateways (whose sessions are episodes)."""
        agents = [f"agent-{i}" for i in range(self.replicas("agent"))] if self.agent.via == "bus" else []
        return agents + [f"gateway-{i}" for i in range(self.replicas("gateway"))]

    def gateway_config(self) -> GatewayConfig:
        """``nodes.gateway.config``, typed (its defaults when the gateway is not listed)."""
        return self.nodes.gateway.config

    def reward_config(self) -> RewardNodeConfig:
        """``nodes.reward.config``, typed."""
        return self.nodes.reward.config

    def reward_source(self) -> str:
        """What the reward node scores with: agent.reward_source (the one place it is written)."""
        return self.agent.reward_source

    @property
    def trainer_device(self) -> str:
        """Where the trainer (its rank 0) runs: model.trainer_device, else model.device."""
        return self.model.trainer_device or self.model.device

    @property
    def is_async(self) -> bool:
        return self.async_.enabled

    @property
    def effective_staleness(self) -> int:
        """Synchronous mode is staleness 0 on the same machinery."""
        return self.staleness_threshold if self.is_async else 0

    @property
    def effective_trigger(self) -> int:
        return self.trigger_batch_size if self.is_async else self.global_batch_size

    @staticmethod
    def resolve(path: str | os.PathLike, base: Path | None = None) -> Path:
        """A topology path as a file: relative ones are relative to ``base``, the supervisord.conf's
        folder (the cwd of `areal-bus render`, `validate` and of every node supervisord starts)."""
        p = Path(path)
        return p if p.is_absolute() else (base or Path.cwd()) / p

    def log_dir(self, base: Path | None = None) -> Path:
        return self.resolve(self.logging.log_dir, base)

    def ipc_dir(self, base: Path | None = None) -> Path:
        """The ipc folder's name (channels.open_socket makes it, owner-only, through security.private_dir)."""
        if self.endpoints.ipc_dir:
            return Path(self.endpoints.ipc_dir)
        # ipc paths are limited to ~107 bytes by the kernel, so not under a deep checkout.
        digest = hashlib.sha1(str(self.log_dir(base).resolve()).encode()).hexdigest()[:10]
        return Path("/tmp") / f"areal_bus-{digest}"

    def shm_name(self, base: Path | None = None) -> str:
        """Name of this run's shared-memory weight buffers (unique per log_dir, like ipc_dir)."""
        return self.ipc_dir(base).name

    def model_path(self, base: Path | None = None) -> Path:
        return self.resolve(self.model.path, base)

    def needs_model(self) -> bool:
        """Whether a node will load model.path: the torch/vllm engines, and a gateway (its tokenizer)."""
        return self.rollout_engine.kind != "sim" or self.trainer_engine.kind != "sim" or self.replicas("gateway") > 0

    def endpoint(self, channel: str, replica: int = 0, base: Path | None = None) -> str:
        """Address of ``channel`` (as bound by its owner; connectors use the same string)."""
        if channel not in CHANNEL_OWNERS:
            raise KeyError(channel)
        if self.endpoints.transport == "tcp":
            spec = self.nodes.get(CHANNEL_OWNERS[channel])
            host = spec.host if spec is not None and spec.host != "localhost" else self.endpoints.host
            return f"tcp://{host}:{self.endpoints.base_port + _PORT_OFFSETS[channel] + replica}"
        # Only the name: channels.open_socket makes (or checks) the folder, through security.private_dir,
        # before any socket binds or connects in it.
        return f"ipc://{self.ipc_dir(base)}/{channel}-{replica}.sock"

    def curve_keys(self, base: Path | None = None):
        """The cluster's CURVE keys (security.CurveKeys), or None when the run does not use CURVE.
        Raises security.CurveKeyError naming the file and the fix."""
        if self.endpoints.curve is None:
            return None
        from areal_bus.wire.security import load_keys  # lazy: pyzmq stays out of processes that only read a topology

        return load_keys(self.resolve(self.endpoints.curve.key, base))


CHANNEL_OWNERS = {"hub_in": "bus", "hub_out": "bus", "work": "agent", "replies": "agent", "samples": "reward",
                  "train": "trainer", "weights": "weights", "gwork": "gateway"}
"""The node kind that binds each channel: with tcp, the channel lives at that kind's host."""
_PORT_OFFSETS = {"hub_in": 0, "hub_out": 1, "work": 100, "samples": 200, "train": 300, "weights": 400,
                 "replies": 500, "gwork": 600}


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name, or '*' (every interface)
