"""The topology's sections (``staleness``, ``agent``, ``model``, ``endpoints``, ``nodes``, ...): one strict
pydantic model each, a one- or two-sentence description per field. The engines' sections are in
config/engines.py, the root that holds them all (and the checks across sections) in config/root.py.
Why a knob has its default, and what was measured: docs/knob-notes.md.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PrivateAttr, field_validator, model_serializer, model_validator

from areal_bus.config.base import NODE_KINDS, Strict, experimental
from areal_bus.config.node_configs import GatewayConfig, NoConfig, ProbeConfig, RewardNodeConfig
from areal_bus.constants import WATCHDOG_RESTART_MAX_S


class AsyncConfig(Strict):
    enabled: bool = Field(True, description="Asynchronous mode. false: the synchronous baseline on the same "
                          "code (one batch generated, trained, weights published, then the next).")


class Parallelism(Strict):
    """``parallelism``: the layout inside the trainer's ``train_workers`` ranks (dp x tp, dp derived)."""

    tp: int = Field(1, ge=1, le=64, description="Tensor-parallel degree: ranks that split each layer "
                    "(DTensor). The trainer runs train_workers / tp data-parallel (FSDP2) groups of them.")
    reshard_after_forward: bool = Field(True, description="Data parallel: free each layer's gathered weights "
                                        "after its forward and gather them again for backward (FSDP2's default, "
                                        "least memory); false keeps them, half the all-gathers.")
    _dp: int = PrivateAttr(1)  # set by Topology from train_workers / tp: written in one place only

    @property
    def dp(self) -> int:
        """Data-parallel degree: train_workers / tp (derived, never written)."""
        return self._dp

    @model_validator(mode="before")
    @classmethod
    def _one_place(cls, data):
        if not isinstance(data, dict):
            return data
        if "dp" in data:
            raise ValueError("parallelism.dp is not written: it is train_workers / parallelism.tp. Write the "
                             "trainer's ranks as train_workers and the layout inside them as parallelism.tp "
                             "(dp 2 x tp 2: train_workers: 4, parallelism: {tp: 2})")
        unsupported = [k for k in ("pp", "cp", "ep") if k in data]
        if unsupported:
            raise ValueError(f"{' and '.join(f'parallelism.{k}' for k in unsupported)}: the trainer supports dp "
                             f"(data parallel, FSDP2: train_workers / tp) and tp (tensor parallel, DTensor) only; "
                             f"remove {' and '.join(unsupported)}")
        return data


class LoggingConfig(Strict):
    log_dir: str = Field("logs", description="Where node logs, supervisord's logs and checkpoints go; relative "
                         "to the supervisord.conf's folder.")
    log_interval: int = Field(5, ge=1, le=100_000, description="A throughput line every this many train steps.")
    save_interval: int = Field(0, ge=0, le=1_000_000, description="Checkpoint every this many steps; 0 = never.")
    trackers: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list, description="Where the trainer also writes each train_steps.jsonl "
        "record as it goes (areal_bus/runtime/trackers.py): tensorboard (event files in log_dir/tb/<run>: "
        "`tensorboard --logdir logs/tb`), wandb (a W&B run named by the run id, the resolved config as its "
        "config; WANDB_MODE=offline keeps it on disk). One that cannot start stops the trainer at start; one "
        "that fails later is logged and dropped, training goes on. []: neither.")

    @field_validator("trackers")
    @classmethod
    def _each_once(cls, trackers: list[str]) -> list[str]:
        if twice := sorted({t for t in trackers if trackers.count(t) > 1}):
            raise ValueError(f"{', '.join(twice)} listed twice; list each tracker once")
        return trackers


class DurabilityConfig(Strict):
    spool: bool = Field(True, description="Keep every trajectory the trainer accepts in a SQLite spool under "
                        "log_dir until a checkpoint covers it, so a restarted trainer loses and repeats nothing. "
                        "false: producers keep trajectories until trained, and a restarted trainer starts over.")
    sync_every_ms: float = Field(5.0, ge=0, le=10_000, description="Accepted trajectories are committed together "
                                 "at most this long after the first of them arrived (producers forget them then).")
    batch_rows: int = Field(64, ge=1, le=100_000, description="Accepted trajectories are also committed as "
                            "soon as this many are waiting.")
    fsync: bool = Field(False, description="Flush to disk at every spool commit (SQLite synchronous=FULL): "
                        "survives power loss too, not only process crashes.")
    watchdog_restart_s: float = Field(30.0, ge=0, le=WATCHDOG_RESTART_MAX_S, description="A node whose heartbeat "
                                      "stopped while its process lives is killed (supervisord restarts it) once "
                                      "silent this long; 0: only logged as stalled.")


class StalenessConfig(Strict):
    """``staleness``: how staleness_threshold is enforced beyond admission."""

    drop_at_consume: bool = Field(True, description="true: the trainer also drops (counts, acknowledges as "
                                  "stale) every sample whose oldest token is over staleness_threshold versions "
                                  "old when its batch forms. false: AReaL's admission rule only; a late sample "
                                  "is trained and counted (over_bound).")
    per_token: bool = Field(False, json_schema_extra=experimental(), description="With drop_at_consume: the "
                            "bound applies to each token, not to a sample's oldest; a sample is dropped only "
                            "when its newest token is over it, and its tokens over it are left out of the loss.")
    in_order: bool = Field(False, description="The bus agent hands finished GRPO groups on in the order they "
                           "were admitted (a reorder buffer), so batches are the groups admitted together, as in "
                           "sync; a long group holds the finished ones behind it (GROUP_WAIT_S at most).")
    lead: Literal["bound", "adaptive"] = Field(
        "bound", json_schema_extra=experimental(), description="How far ahead of the trainer rollout may start "
        "episodes: 'bound' as far as staleness_threshold allows (AReaL's rule); 'adaptive' one version less "
        "while the trainer is the bottleneck, back up when it would wait (areal_bus/admission.py).")

    @model_validator(mode="after")
    def _per_token_drops(self):
        if self.per_token and not self.drop_at_consume:
            raise ValueError("per_token applies the bound to each token when the trainer drops at consumption: "
                             "set drop_at_consume: true, or leave per_token out (false trains every admitted "
                             "token, as AReaL)")
        return self


PLUGIN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*"


class DatasetConfig(Strict):
    """``agent.dataset``: problems from a local jsonl or parquet file (areal_bus/tasks/dataset.py)."""

    path: str = Field(..., min_length=1, description="The rows: a local .jsonl / .json / .parquet file (never "
                      "from a hub), relative to the supervisord.conf's folder.")
    eval_path: str | None = Field(None, min_length=1, description="Held-out rows in a second file; None: "
                                  "eval_fraction of path's rows are held out.")
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="Without eval_path: the share of path's rows held "
                                 "out for evaluation (split with shuffle_seed).")
    prompt_template: str = Field("{question}", min_length=1, description="The user message of a row: str.format "
                                 "over its fields ('Solve: {problem}'; '{{' for a literal brace).")
    answer_field: str = Field("answer", min_length=1, description="The row field holding the answer the 'math' "
                              "task checks (a task plug-in reads it as ctx.dataset.answer(row)).")
    shuffle_seed: int = Field(0, description="Seed of the train/eval split and of the order training rows are played in.")


class AgentConfig(Strict):
    framework: str = Field("sim", pattern=rf"^(sim|guess|math|longtail|{PLUGIN})$", description="What plays "
                           "episodes: 'sim' (synthetic prompts, sim engines), 'guess' (guess-the-number, "
                           "multi-turn), 'math' (agent.dataset's rows, answers checked exactly), 'longtail' "
                           "(areal_bus/tasks/longtail.py), or 'package.module:Class' (areal_bus/tasks/driver.py).")
    max_turns: int = Field(1, ge=1, le=1000, description="Turns per episode.")
    max_tokens: int | None = Field(None, ge=1, le=1_000_000, description="Tokens per policy turn; None: the task's "
                                   "own (guess 8, math 128).")
    via: Literal["bus", "gateway"] = Field("bus", description="How the agent reaches the policy: 'bus' (requests "
                                           "straight to rollout workers) or 'gateway' (the stock openai SDK "
                                           "against the gateway node, as a user's agent would).")
    reward_source: str = Field(
        "rule", pattern=rf"^(rule|passthrough|judge|reward_model|{PLUGIN})$",
        description="What scores a trajectory: 'rule' (the task's verifier), 'passthrough' (the agent's own "
        "reward), 'judge' or 'reward_model' (the reward node, set up in nodes.reward.config), or "
        "'package.module:function' (your verifier, returning a float or a dict of named components).")
    dataset: DatasetConfig | None = Field(None, description="Problems from a local jsonl/parquet file "
                                          "(needed by 'math'; offered to a task plug-in as ctx.dataset).")
    task_options: dict = Field(default_factory=dict, description="Passed to the task as ctx.options (math: "
                               "system_prompt).")
    task_size: int = Field(16, ge=2, le=1_000_000, description="guess: the secret is in 1..task_size.")
    prompt_len: int = Field(128, ge=1, le=1_000_000, description="Prompt tokens per simulated episode "
                            "(longtail: prompt characters).")
    group_size: int = Field(1, ge=1, le=1024, description="Samples per task instance (GRPO group).")
    seed: int = Field(0, description="Seed for simulated prompts and rewards.")

    @model_validator(mode="after")
    def _dataset_needed(self):
        if self.framework == "math" and self.dataset is None:
            raise ValueError("agent.framework 'math' needs agent.dataset (path, prompt_template, answer_field)")
        return self


class ModelSpec(Strict):
    path: str = Field("models/tiny-guess", description="Local Hugging Face checkpoint (Qwen2 or Llama family), "
                      "relative to the supervisord.conf's folder; the torch and vllm engines and a gateway "
                      "need it (`areal-bus validate` checks).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Generation weights dtype "
                                                             "and the trainer's compute dtype; the trainer "
                                                             "keeps float32 master weights and AdamW state.")
    device: str = Field("cpu", description="torch device for the rollout and trainer engines ('cpu', 'cuda', 'cuda:1').")
    trainer_device: str | None = Field(None, description="torch device for the trainer when it is not "
                                       "model.device (rank r takes the GPU r places after it). None: model.device.")
    seed: int = Field(0, description="Seed for sampling and initialisation.")
    threads: int = Field(1, ge=1, le=256, description="torch CPU threads per node process (one each avoids "
                         "oversubscription where several nodes share the cores).")
    share_base: bool | None = Field(None, description="With trainer_engine.lora, rollout engines on the "
                                    "trainer's device serve the trainer's frozen base (CUDA IPC on a GPU, shared "
                                    "memory on CPU) instead of a copy of their own. None: on wherever it can be "
                                    "on a GPU (LoRA, the torch engines, one trainer process, trainer and rollout "
                                    "on one GPU), off on CPU; true: on, refused with the reason where it cannot.")
    gpu_memory_fraction: float = Field(0.92, gt=0.05, le=1.0, description="Share of each GPU's memory the memory "
                                       "plan (`areal-bus plan`) may fill with the trainer and the rollout engines "
                                       "placed on it; checked at node start, refused with the numbers if over.")
    gpu_memory_gib: float | None = Field(None, gt=0, le=100_000, description="The GPU's memory in GiB, for "
                                         "`areal-bus validate` / `plan` to check the plan without a GPU. None: "
                                         "checked at node start only, against the card.")


class CurveConfig(Strict):
    key: str = Field(..., min_length=1, description="The cluster's CURVE secret key file (`areal-bus keys --out "
                     "DIR` makes DIR/cluster.key_secret), copied to every host; relative to the "
                     "supervisord.conf's folder.")


class Endpoints(Strict):
    transport: Literal["ipc", "tcp"] = Field("ipc", description="ipc:// on one host (default), tcp:// across hosts.")
    ipc_dir: str | None = Field(None, description="Folder for ipc sockets; default /tmp/areal_bus-<hash of log_dir>.")
    host: str = Field("127.0.0.1", description="tcp: the IP address channels bind and connect to (loopback by "
                      "default); a kind with its own nodes.<kind>.host binds there instead.")
    base_port: int = Field(25500, ge=1024, le=60000, description="tcp: first port; channels take fixed offsets from it.")
    curve: CurveConfig | None = Field(None, description="Authenticate and encrypt every socket with ZeroMQ CURVE "
                                      "(required for tcp beyond loopback, unless allow_insecure).")
    allow_insecure: bool = Field(False, description="tcp beyond loopback without CURVE: anyone who reaches the "
                                 "ports can inject trajectories or weights. Only for a network you trust entirely.")
    far_weights: Literal["auto", "group", "chunks"] = Field("auto", description="How versions reach a rollout host "
        "without the trainer's memory: 'group' broadcasts them in buckets over a torch.distributed group (NCCL on "
        "GPUs, gloo on CPU), 'chunks' sends them over the CURVE chunk channel; 'auto' is group with the trainer "
        "on a GPU, else chunks.")


# -- nodes -----------------------------------------------------------------------------------------

class _NodePlacement(Strict):
    host: str = Field("localhost", description="Host the node runs on; with tcp, the IP address this kind's "
                      "channels bind at ('localhost': endpoints.host).")
    hosts: list[str] | None = Field(None, min_length=1, max_length=1024, description="trainer and rollout only: "
                                    "the hosts this kind is spread over (areal_bus/config/placement.py).")
    config: NoConfig = Field(default_factory=NoConfig, description="Node-specific settings: none for this kind.")


class _Replicas(Strict):
    replicas: int | None = Field(None, ge=0, le=1024, description="Processes of this kind (0 = not started).")


class NodeSpec(_NodePlacement, _Replicas):  # bases in this order: replicas comes first, as it always did
    pass


MAX_GPU_INDEX = 1023
"""The largest GPU index ``nodes.<kind>.gpus`` takes (a bound, not a host's count: render checks no GPU)."""


def _gpu_indices(field: str, gpus: list) -> list:
    for i, entry in enumerate(gpus):
        for g in entry if isinstance(entry, list) else [entry]:
            if not 0 <= g <= MAX_GPU_INDEX:
                raise ValueError(f"{field}[{i}]: GPU index {g} is out of 0..{MAX_GPU_INDEX}")
        if isinstance(entry, list) and not entry:
            raise ValueError(f"{field}[{i}]: an empty list; give the worker's GPU index (or indices)")
    return gpus


class RolloutSpec(_NodePlacement):
    """``nodes.rollout``: where the rollout workers run; how many is ``rollout_workers``, in one place."""

    gpus: list[int | list[int]] | None = Field(
        None, min_length=1, max_length=1024, description="The GPU of each rollout worker (one index per "
        "rollout_workers, on the host it runs on; a list, for a worker over several GPUs, waits for an engine "
        "that splits a model): its CUDA_VISIBLE_DEVICES, so model.device is 'cuda'. None: model.device places them.")

    @field_validator("gpus")
    @classmethod
    def _gpu_bounds(cls, gpus):
        return gpus if gpus is None else _gpu_indices("nodes.rollout.gpus", gpus)

    @model_validator(mode="before")
    @classmethod
    def _count_is_rollout_workers(cls, data):
        if isinstance(data, dict) and "replicas" in data:
            raise ValueError(f"nodes.rollout.replicas: the rollout workers are counted by the top-level "
                             f"rollout_workers; write rollout_workers: {data['replicas']} instead")
        return data


class TrainerSpec(NodeSpec):
    """``nodes.trainer``: where the trainer's ranks run; how many is ``train_workers``."""

    gpus: list[int] | None = Field(
        None, min_length=1, max_length=1024, description="The GPU of each trainer rank (one index per "
        "train_workers, on the host the rank runs on): CUDA_VISIBLE_DEVICES of each host's ranks, so "
        "model.trainer_device is 'cuda'. None: rank r on the trainer device's GPU index + r.")

    @field_validator("gpus")
    @classmethod
    def _gpu_bounds(cls, gpus):
        return gpus if gpus is None else _gpu_indices("nodes.trainer.gpus", gpus)


class GatewaySpec(NodeSpec):
    config: GatewayConfig = Field(default_factory=GatewayConfig, description="The gateway's settings "
                                  "(areal_bus/config/node_configs.py: GatewayConfig).")


class RewardSpec(NodeSpec):
    config: RewardNodeConfig = Field(default_factory=RewardNodeConfig, description="The judge's or reward "
                                     "model's settings (areal_bus/config/node_configs.py: RewardNodeConfig).")


class ProbeSpec(NodeSpec):
    config: ProbeConfig = Field(default_factory=ProbeConfig, description="The probe's Prometheus endpoint "
                                "(areal_bus/config/node_configs.py: ProbeConfig).")


class Nodes(Strict):
    """``nodes``: the node kinds to run, each with its own config schema. A kind left out keeps its
    defaults (and runs, but for the optional gateway and probe: see ``Topology.replicas``)."""

    bus: NodeSpec = Field(default_factory=NodeSpec, description="The hub every node's events and versions pass.")
    gateway: GatewaySpec = Field(default_factory=GatewaySpec, description="The HTTP gateway (runs only when listed).")
    agent: NodeSpec = Field(default_factory=NodeSpec, description="Plays episodes (agent.*).")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rollout workers (rollout_engine.*; "
                                 "their count is rollout_workers).")
    reward: RewardSpec = Field(default_factory=RewardSpec, description="Scores trajectories.")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="The trainer (trainer_engine.*; its ranks "
                              "are train_workers).")
    weights: NodeSpec = Field(default_factory=NodeSpec, description="The weight broadcaster.")
    probe: ProbeSpec = Field(default_factory=ProbeSpec, description="The throughput probe and its Prometheus "
                             "endpoint (runs only when listed).")

    def get(self, kind: str) -> NodeSpec | RolloutSpec | None:
        """The spec of ``kind`` if the topology lists it, else None."""
        return getattr(self, kind) if kind in self.model_fields_set else None

    def items(self) -> list[tuple[str, NodeSpec | RolloutSpec]]:
        """(kind, spec) of the listed kinds."""
        return [(k, getattr(self, k)) for k in NODE_KINDS if k in self.model_fields_set]

    @model_serializer(mode="wrap")
    def _listed_only(self, handler):
        # Only the listed kinds: a dump read back must run the same nodes (a listed gateway runs).
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}
