"""The topology schema: one pydantic model holds every knob a run has, validated with errors that
name the file, the field path and what is allowed.

A topology YAML says which nodes run (kind, replicas, host, per-node config), where they meet
(``endpoints``) and the training knobs users know from AReaL (async.enabled, staleness_threshold,
trigger_batch_size, ...). ``${NAME}`` and ``${NAME:-default}`` in any string are expanded from the
environment. Each kind's ``config`` has its schema in areal_bus/config/node_configs.py. Load with
``load_topology(path)``; ``topology_files.check_files(topo, base)`` then checks what the run will read
from disk (the model folder, the router files), which ``areal-bus validate``, ``render`` and ``node`` do.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import types
from pathlib import Path
from typing import Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from areal_bus.admission import group_stall
from areal_bus.constants import WATCHDOG_RESTART_MAX_S
from areal_bus.config.node_configs import REDACTED, SECRET, GatewayConfig, NoConfig, ProbeConfig, RewardNodeConfig

NODE_KINDS = ("bus", "gateway", "agent", "rollout", "reward", "trainer", "weights", "probe")


class TopologyError(ValueError):
    """An invalid topology file; the message names the file, the field and what is allowed."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class AsyncConfig(_Strict):
    enabled: bool = Field(True, description="Asynchronous mode. false = the synchronous baseline on the same code: "
                          "one batch generated, trained, weights published, then the next.")


class Parallelism(_Strict):
    dp: int = Field(1, ge=1, le=1024, description="Data-parallel degree of the trainer.")
    tp: int = Field(1, ge=1, le=64, description="Tensor-parallel degree of the trainer.")
    pp: int = Field(1, ge=1, le=64, description="Pipeline-parallel degree of the trainer.")
    cp: int = Field(1, ge=1, le=64, description="Context-parallel degree of the trainer.")
    ep: int = Field(1, ge=1, le=64, description="Expert-parallel degree of the trainer.")
    reshard_after_forward: bool = Field(True, description="dp: free each layer's gathered weights after its "
                                        "forward and gather them again for backward (FSDP2's default: least "
                                        "memory). false keeps them to backward: half the all-gathers and their "
                                        "copies, for a model whose full weights fit each GPU many times over.")

    @model_validator(mode="after")
    def _supported(self):
        unsupported = [f"{k}={getattr(self, k)}" for k in ("pp", "cp", "ep") if getattr(self, k) > 1]
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)} not supported by the trainer; it supports dp (data "
                             f"parallel, FSDP2) and tp (tensor parallel, DTensor), with pp, cp and ep 1")
        return self


class LoggingConfig(_Strict):
    log_dir: str = Field("logs", description="Where node logs (train.log, rollout.log, ...), supervisord's "
                         "logs and checkpoints go. Relative paths are relative to the supervisord.conf's folder.")
    log_interval: int = Field(5, ge=1, le=100_000, description="A throughput line every this many train steps.")
    save_interval: int = Field(0, ge=0, le=1_000_000, description="Checkpoint every this many steps; 0 = never.")


class DurabilityConfig(_Strict):
    spool: bool = Field(True, description="Keep every trajectory the trainer accepts in a SQLite (WAL) spool under "
                        "log_dir until a checkpoint covers it; a trainer that supervisord restarts resumes from its "
                        "newest checkpoint and re-queues the spool, so nothing accepted is lost or trained twice. "
                        "false: producers keep trajectories until trained, and a restarted trainer starts over.")
    sync_every_ms: float = Field(5.0, ge=0, le=10_000, description="Accepted trajectories are committed together "
                                 "at most this long after the first of them arrived (producers forget them then).")
    batch_rows: int = Field(64, ge=1, le=100_000, description="...or as soon as this many are waiting.")
    fsync: bool = Field(False, description="Flush to disk at every commit (SQLite synchronous=FULL): survives power "
                        "loss too, not only process crashes (kill -9), at one disk flush per commit.")
    watchdog_restart_s: float = Field(30.0, ge=0, le=WATCHDOG_RESTART_MAX_S, description="A node whose heartbeat "
                                      "stopped while its process lives (SIGSTOP, a hang) is logged as stalled by the "
                                      "watchdog in the run-end listener after WATCHDOG_SILENT_S, and killed (supervisord "
                                      "restarts it) once silent this long. 0: only logged.")


class StalenessConfig(_Strict):
    """``staleness``: how staleness_threshold is enforced beyond admission (README: Knobs)."""

    drop_at_consume: bool = Field(True, description="true: besides AReaL's admission rule, the trainer drops (counts "
                                  "and acknowledges as stale; the admission slot comes back) every sample whose "
                                  "oldest token is more than staleness_threshold versions behind when its batch "
                                  "forms, so no trained sample is over the bound. false: the admission rule only, "
                                  "as in AReaL: a sample that finished late (a long output overtaken by short "
                                  "ones) is trained anyway, its staleness counted (over_bound per update), and the "
                                  "decoupled objective's behav_imp_weight_cap masks its tokens whose behaviour "
                                  "importance weight is too far off.")
    per_token: bool = Field(False, description="With drop_at_consume: the bound applies to each token, not "
                            "to a sample's oldest. A long output's tokens come from the versions the weights "
                            "went through while it was generated; the trainer drops a sample only when even its "
                            "newest token is over staleness_threshold, and leaves the tokens over it out of the "
                            "loss (masked, counted as tokens_over_bound per update): no token is trained over the "
                            "bound, and the late part of a long output still is (the whole-sample drop takes "
                            "the long outputs, and with them what makes an answer short).")
    in_order: bool = Field(False, description="The agent hands finished GRPO groups on in the order they were "
                           "admitted (a reorder buffer): the trainer's batches are the groups admitted together, "
                           "as in synchronous mode, not the ones that happened to finish first (short answers "
                           "first, long ones clumped together and late), and AReaL's admission rule, exact when "
                           "samples finish in admission order, holds more nearly (half the consume-time drops on "
                           "the SmolLM2 runs: a held group still ages). The cost is "
                           "head-of-line blocking: a long group holds the finished ones behind it (for "
                           "GROUP_WAIT_S, 60 s, at most). Asynchronous mode with agent.via 'bus' (refused with "
                           "'gateway', whose sessions it does not reorder; nothing to reorder in synchronous mode).")
    lead: Literal["bound", "adaptive"] = Field(
        "bound", description="How far ahead of the trainer rollout may start episodes. 'bound': as far as "
        "staleness_threshold allows (AReaL's rule). 'adaptive': starts at the bound, steps down one version "
        "when the trainer has held two batches' worth of samples after three updates in a row (it is the "
        "bottleneck: a deeper pipeline adds staleness, not throughput) and back up after an update that "
        "left it less than trigger_batch_size (it would wait); never below 1, never above the bound "
        "(areal_bus/admission.py).")

    @model_validator(mode="after")
    def _per_token_drops(self):
        if self.per_token and not self.drop_at_consume:
            raise ValueError("per_token applies the bound to each token when the trainer drops at consumption: "
                             "set drop_at_consume: true, or leave per_token out (false trains every admitted "
                             "token, as AReaL)")
        return self


_PLUGIN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*"


class DatasetConfig(_Strict):
    """``agent.dataset``: problems from a local jsonl or parquet file (areal_bus/tasks/dataset.py)."""

    path: str = Field(..., min_length=1, description="The rows: a local .jsonl / .json / .parquet file, read "
                      "with the datasets library (never from a hub). Relative to the supervisord.conf's folder.")
    eval_path: str | None = Field(None, min_length=1, description="Held-out rows in a second file; None: "
                                  "eval_fraction of path's rows are held out.")
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="Without eval_path: the share of path's rows held "
                                 "out for evaluation (split with shuffle_seed).")
    prompt_template: str = Field("{question}", min_length=1, description="The user message of a row: str.format "
                                 "over its fields ('{question}', 'Solve: {problem}'; '{{' for a literal brace).")
    answer_field: str = Field("answer", min_length=1, description="The row field holding the answer the 'math' "
                              "task checks (and a task plug-in reads as ctx.dataset.answer(row)).")
    shuffle_seed: int = Field(0, description="Seed of the train/eval split and of the order training rows are played in.")


class AgentConfig(_Strict):
    framework: str = Field("sim", description="What plays episodes. 'sim': synthetic prompts for the simulated "
                           "engines; 'guess': the built-in guess-the-number game (multi-turn, higher/lower "
                           "feedback); 'math': the built-in dataset task (agent.dataset's rows, the final answer "
                           "checked exactly; 'Wrong, try again.' between turns when max_turns > 1); 'longtail': "
                           "one turn of max_tokens drawn from rollout_engine.output_len, eos ignored, rewarded "
                           "by the share of target characters (areal_bus/tasks/longtail.py); or "
                           "'package.module:Class', a task of your own (the interface: areal_bus/tasks/driver.py).",
                           pattern=rf"^(sim|guess|math|longtail|{_PLUGIN})$")
    max_turns: int = Field(1, ge=1, le=1000, description="Turns per episode.")
    max_tokens: int | None = Field(None, ge=1, le=1_000_000, description="Tokens per policy turn; None: the task's "
                                   "own (guess 8, math 128).")
    via: Literal["bus", "gateway"] = Field("bus", description="How the agent reaches the policy: 'bus' (generation "
                                           "requests straight to rollout workers) or 'gateway' (the stock openai "
                                           "SDK against the gateway node, as a user's agent would).")
    reward_source: str = Field(
        "rule", pattern=rf"^(rule|passthrough|{_PLUGIN})$",
        description="'rule': the task's verifier scores each trajectory; 'passthrough': keep the agent's reward; "
        "'package.module:function': your verifier, called with the replayed episode (sync or async), returning "
        "a float or a dict of named components (summed; each logged as reward.<name>).")
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


class LengthDistribution(_Strict):
    dist: Literal["lognormal", "uniform", "fixed"] = Field("lognormal", description="Output length distribution.")
    median: float = Field(500.0, gt=0, description="lognormal: median output length in tokens.")
    sigma: float = Field(0.8, ge=0, le=5, description="lognormal: shape; 0.8 gives a long tail.")
    min: int = Field(200, ge=1, description="Shortest output (clip).")
    max: int = Field(3000, ge=1, description="Longest output (clip; also max_tokens).")

    @model_validator(mode="after")
    def _order(self):
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


class ModelSpec(_Strict):
    path: str = Field("models/tiny-guess", description="Local Hugging Face checkpoint (Qwen2 or Llama family: "
                      "config.json, *.safetensors, tokenizer files). Relative to the supervisord.conf's folder. "
                      "Must exist for the torch and vllm engines and for a gateway (`areal-bus validate` checks); "
                      "build the project's tiny one with `python scripts/warmstart.py --out PATH`.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Generation weights dtype, and "
                                                             "the trainer's compute dtype (autocast): the trainer "
                                                             "keeps float32 master weights and AdamW state whatever "
                                                             "this is, so an lr 1e-6 update is not rounded away.")
    device: str = Field("cpu", description="torch device for the rollout and trainer engines ('cpu', 'cuda', 'cuda:1').")
    trainer_device: str | None = Field(None, description="torch device for the trainer when it is not model.device: "
                                       "e.g. rollout on 'cuda:0' (device) and the trainer on 'cuda:1'. With "
                                       "parallelism, rank r takes the GPU r places after it. None: model.device.")
    seed: int = Field(0, description="Seed for sampling and initialisation.")
    threads: int = Field(1, ge=1, le=256, description="torch CPU threads per node process. Several nodes share "
                         "the cores: one thread each avoids oversubscription on small machines.")


class RolloutEngineConfig(_Strict):
    kind: Literal["sim", "torch", "vllm"] = Field("sim", description="Generation engine. 'sim' models decode time; "
                                                  "'torch' generates with the model at model.path (KV cache, continuous "
                                                  "batching); 'vllm' does so with vLLM (pip install 'areal-bus[vllm]'; "
                                                  "model.device cuda; the GPU engine, run on an H200: see the README's 'On a GPU').")
    max_len: int = Field(1024, ge=8, le=1_000_000, description="torch: KV-cache length per sequence (prompt + output).")
    temperature: float = Field(1.0, ge=0, le=10, description="Sampling temperature for training episodes.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass for training episodes.")
    max_batch: int = Field(16, ge=1, le=4096, description="Sequences one worker decodes at once (continuous batching).")
    decode_attention: Literal["auto", "sdpa", "matmul", "flash_varlen"] = Field(
        "auto", description="torch on CUDA: the decode step's attention. 'sdpa' reads every running row's "
        "cache up to the longest one's length bucket (masked); 'flash_varlen' (bfloat16/float16) reads each "
        "row's own length with FlashAttention-2's varlen kernel, torch's own build: on long-tailed outputs "
        "most rows are far shorter than the longest; 'matmul' two batched matmuls (a reference); 'auto' "
        "flash_varlen where the model is bfloat16/float16, else sdpa, and sdpa (with a warning in the "
        "rollout log) where flash_varlen does not run.")
    decode_compile: bool | None = Field(None, description="torch on CUDA: fuse the decode step's elementwise work "
                                        "(RMSNorms with their residual adds, rotary embedding, SiLU x up) with "
                                        "torch.compile: ~13 kernels a layer instead of ~38, the same arithmetic, a "
                                        "few seconds of compiling at start. Needs torch.compile with Triton. None "
                                        "(default): on, and off (with a warning) where it does not run.")
    decode_step_s: float = Field(0.001, ge=0, le=10, description="sim: time of one decode step at batch 1. "
                                 "Memory-bound GPU decode is nearly flat in batch size.")
    decode_step_per_seq_s: float = Field(0.00001, ge=0, le=1, description="sim: extra step time per sequence in the batch.")
    swap_s: float = Field(0.005, ge=0, le=60, description="sim: pause to switch to new weights at a safe point.")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vllm: fraction of the GPU vLLM takes for "
                                          "weights, activations and KV cache; the trainer shares the GPU, leave it room.")
    prefix_caching: bool = Field(True, description="vllm: reuse the keys/values of a prompt prefix an earlier "
                                 "request computed under the same weights (a multi-turn agent's earlier turns); "
                                 "never across a weight swap (areal_bus/engines/vllm_engine.py).")
    output_len: LengthDistribution = Field(default_factory=LengthDistribution)


class TrainerEngineConfig(_Strict):
    kind: Literal["sim", "torch"] = Field("sim", description="Training engine. 'sim' models time per token; "
                                          "'torch' trains model.path with the decoupled PPO objective.")
    attn_implementation: str = Field("areal_varlen", min_length=1, description="torch: transformers' attention "
                                     "for the trainer's packed rows. 'areal_varlen': attention within each sample "
                                     "(FlashAttention varlen on CUDA, causal SDPA per sample on CPU; "
                                     "areal_bus/train/train_model.py); 'areal_varlen_fa4': the same with "
                                     "FlashAttention-4's kernels (the flash-attn-4 package, Hopper or newer; "
                                     "opt-in, bench/RESULTS.md); or a name transformers knows ('sdpa' builds an "
                                     "[N, N] block mask and computes every block of it: 3x slower on CPU, more "
                                     "on GPUs; 'flex_attention', 'flash_attention_2', ...).")
    micro_batch_tokens: int = Field(16384, ge=16, le=10_000_000, description="torch: tokens packed into one "
                                    "forward and backward (gradients accumulate over a mini-batch's micro-batches). "
                                    "A longer sample gets one of its own; a mini-batch over it is split into "
                                    "balanced micro-batches (as many as filling each to it makes). "
                                    "With parallelism.dp > 1 each rank packs "
                                    "its share of a mini-batch into one (every rank must run as many as the others).")
    micro_batch_pad_tokens: int | None = Field(None, ge=1, le=1_000_000, description="torch: each micro-batch is "
                                               "padded to a multiple of this many tokens (a masked segment of its "
                                               "own), so a GPU's matmuls meet a few row counts again and again: "
                                               "cuBLAS chooses a kernel for each new one, ~5 ms during which the "
                                               "GPU waits (bench/RESULTS.md). Mini-batches trade a few boundary "
                                               "samples and group their micro-batches to need little of it. None: "
                                               "1024 on CUDA, 1 (no padding) on CPU.")
    logit_chunk_tokens: int = Field(4096, ge=16, le=1_000_000, description="torch: positions whose logits exist at "
                                    "once; the lm_head runs chunk by chunk, forward and backward, so no "
                                    "[tokens, vocab] float32 tensor is ever whole.")
    logit_grad_keep_gib: float | None = Field(None, ge=0, le=1024, description="torch: GiB of the lm_head's logit "
                                              "gradients (d log p / d logits, model.dtype) a training forward makes "
                                              "and keeps for its backward, per micro-batch; chunks beyond it "
                                              "recompute their logits in backward (one matmul more, ~5% of an "
                                              "update at the Qwen2-0.5B shape). Keeping costs micro-batch tokens x "
                                              "vocab x 2 bytes (5 GB at 16k tokens and a 152k vocabulary). "
                                              "None: a tenth of the GPU's memory, at most 8; 1 on CPU; 0: always recompute.")
    gradient_checkpointing: bool = Field(False, description="torch: recompute each decoder layer's activations in "
                                         "backward (less memory, ~1/3 more compute).")
    mixed_precision: Literal["compute_copy", "autocast"] = Field(
        "compute_copy", description="torch, model.dtype bfloat16/float16: how compute runs in that dtype over the "
        "float32 master weights and AdamW state. 'compute_copy': forward and backward on a copy of the weights in "
        "model.dtype, cast from the masters once per optimizer step, gradients added into float32 at the end "
        "of each backward. 'autocast': torch.autocast over the masters (every weight cast at every use). "
        "Parallel layouts (parallelism.dp/tp > 1) always autocast.")
    prox_logp_method: Literal["recompute", "loglinear"] = Field(
        "recompute", description="torch: the proximal policy's log-probabilities (the decoupled objective's "
        "anchor: the weights before this update), AReaL's actor.prox_logp_method. 'recompute': a forward pass "
        "of every mini-batch before the first step (the first mini-batch's is its training forward). "
        "'loglinear': no such pass; interpolated between the sampler's recorded log-probability and the "
        "training forward's by the token's staleness (areal_bus/train/loss.py: loglinear_proximal), exact for "
        "tokens of the current version; the logged entropy then comes from each mini-batch's training forward. "
        "One forward fewer per later mini-batch (AReaL reports 1.27x).")
    compile: bool = Field(False, description="torch: torch.compile each decoder layer of the trainer's policy "
                          "(fuses norms, rotary and activations; the first update pays ~10 s of compilation "
                          "on an H200). Worth it on a GPU (+48% at the Qwen2-0.5B shape, bench/RESULTS.md); "
                          "leave off on CPU.")
    eps_clip: float = Field(0.2, gt=0, le=1, description="PPO clip range (low side, and high side unless eps_clip_high).")
    eps_clip_high: float | None = Field(None, gt=0, le=10, description="PPO clip range on the high side (DAPO's clip-higher).")
    behav_imp_weight_cap: float | None = Field(5.0, gt=1, description="Tokens whose behaviour importance weight "
                                               "exceeds this are left out of the loss (None: no cap).")
    loss_token_norm: int | None = Field(None, ge=1, le=10_000_000, description="torch: how a mini-batch's "
                                        "per-token terms are summed into its loss. None: their mean over its loss "
                                        "tokens (token-mean), so a token weighs less the more tokens the other "
                                        "samples of its mini-batch have. N: their sum divided by (the mini-batch's "
                                        "samples x N), Dr. GRPO's constant normaliser (verl's loss_agg_mode "
                                        "seq-mean-token-sum-norm): a sample's weight is its own whatever shares "
                                        "its mini-batch. Asynchronous batches take the groups that are complete "
                                        "and clump by output length where synchronous ones mix "
                                        "(bench/RESULTS.md). Set N near the longest output (agent.max_tokens x "
                                        "max_turns).")
    adv_std_normalize: bool = Field(True, description="GRPO: divide advantages by the group's reward std.")
    adv_leave_one_out: bool = Field(False, description="GRPO: baseline is the mean of the other samples.")
    kl_coef: float = Field(0.0, ge=0, le=10, description="KL penalty against the initial policy; 0 = off.")
    ppo_epochs: int = Field(1, ge=1, le=16, description="Passes over each batch per update.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    eval_interval: int = Field(0, ge=0, description="Evaluate greedily on the held-out set every this many "
                               "updates (0 = never).")
    eval_episodes: int = Field(64, ge=1, le=100_000, description="Held-out task instances per evaluation.")
    time_per_token_s: float = Field(2e-5, ge=0, le=1, description="sim: training time per token on one train worker "
                                    "(forward, backward, optimizer, proximal recompute), divided across train_workers.")
    update_overhead_s: float = Field(0.01, ge=0, le=60, description="sim: fixed cost per update (weight export, sync).")


class CurveConfig(_Strict):
    key: str = Field(..., min_length=1, description="The cluster's CURVE secret key file, made by `areal-bus keys "
                     "--out DIR` (DIR/cluster.key_secret, mode 600) and copied to every host. Every socket that "
                     "binds serves with it and admits only peers proving they hold it; every socket that connects "
                     "proves it. Relative to the supervisord.conf's folder; may use ${ENV}.")


class Endpoints(_Strict):
    transport: Literal["ipc", "tcp"] = Field("ipc", description="ipc:// on one host (default), tcp:// across hosts.")
    ipc_dir: str | None = Field(None, description="Folder for ipc sockets; default /tmp/areal_bus-<hash of log_dir>.")
    host: str = Field("127.0.0.1", description="tcp: the IP address channels bind and connect to (ZeroMQ binds "
                      "addresses, not names); loopback by default. A node kind with its own nodes.<kind>.host "
                      "binds its channels at that address instead.")
    base_port: int = Field(25500, ge=1024, le=60000, description="tcp: first port; channels take fixed offsets from it.")
    curve: CurveConfig | None = Field(None, description="Authenticate and encrypt every socket with ZeroMQ CURVE. "
                                      "Required for tcp beyond loopback (unless allow_insecure).")
    allow_insecure: bool = Field(False, description="tcp beyond loopback without CURVE: anyone who reaches the "
                                 "ports can inject trajectories or weights and read the traffic. Only for a "
                                 "network you trust entirely.")


class NodeSpec(_Strict):
    replicas: int | None = Field(None, ge=0, le=1024, description="Processes of this kind (0 = not started).")
    host: str = Field("localhost", description="Host the node runs on. With tcp, the IP address this kind's "
                      "channels bind at and its peers connect to ('localhost': endpoints.host).")
    hosts: list[str] | None = Field(None, min_length=1, max_length=1024, description="trainer and rollout only: "
                                    "the hosts this kind is spread over (areal_bus/config/placement.py). trainer: its "
                                    "ranks in equal contiguous blocks, rank 0 (the node) on the first; rollout: "
                                    "replica r on hosts[r % len]. `areal-bus render --host H` writes H's programs.")
    config: NoConfig = Field(default_factory=NoConfig, description="Node-specific settings: none for this kind.")


class GatewaySpec(NodeSpec):
    config: GatewayConfig = Field(default_factory=GatewayConfig, description="The gateway's settings "
                                  "(areal_bus/config/node_configs.py: GatewayConfig).")


class RewardSpec(NodeSpec):
    config: RewardNodeConfig = Field(default_factory=RewardNodeConfig, description="How the reward node scores "
                                     "(areal_bus/config/node_configs.py: RewardNodeConfig).")


class ProbeSpec(NodeSpec):
    config: ProbeConfig = Field(default_factory=ProbeConfig, description="The probe's Prometheus endpoint "
                                "(areal_bus/config/node_configs.py: ProbeConfig).")


class Nodes(_Strict):
    """``nodes``: the node kinds to run, each with its own config schema. A kind left out keeps its
    defaults (and runs, but for the optional gateway and probe: see ``Topology.replicas``)."""

    bus: NodeSpec = Field(default_factory=NodeSpec, description="The hub every node's events and versions pass.")
    gateway: GatewaySpec = Field(default_factory=GatewaySpec, description="The HTTP gateway (runs only when listed).")
    agent: NodeSpec = Field(default_factory=NodeSpec, description="Plays episodes (agent.*).")
    rollout: NodeSpec = Field(default_factory=NodeSpec, description="Rollout workers (rollout_engine.*).")
    reward: RewardSpec = Field(default_factory=RewardSpec, description="Scores trajectories.")
    trainer: NodeSpec = Field(default_factory=NodeSpec, description="The trainer (trainer_engine.*).")
    weights: NodeSpec = Field(default_factory=NodeSpec, description="The weight broadcaster.")
    probe: ProbeSpec = Field(default_factory=ProbeSpec, description="The throughput probe and its Prometheus "
                             "endpoint (runs only when listed).")

    def get(self, kind: str) -> NodeSpec | None:
        """The spec of ``kind`` if the topology lists it, else None."""
        return getattr(self, kind) if kind in self.model_fields_set else None

    def items(self) -> list[tuple[str, NodeSpec]]:
        """(kind, spec) of the listed kinds."""
        return [(k, getattr(self, k)) for k in NODE_KINDS if k in self.model_fields_set]

    @model_serializer(mode="wrap")
    def _listed_only(self, handler):
        # Only the listed kinds: a dump read back must run the same nodes (a listed gateway runs).
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


class Topology(_Strict):
    name: str = Field("default", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Run name.")
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    rollout_workers: int = Field(4, ge=0, le=1024, description="Rollout worker processes (edit to scale).")
    train_workers: int = Field(1, ge=1, le=1024, description="Trainer ranks: parallelism.dp x parallelism.tp. "
                               "Set either: left at 1, one follows the other (train_workers alone is dp).")
    staleness_threshold: int = Field(2, ge=0, le=64, description="Policy versions a trajectory may lag when consumed; "
                                     "1 is nearly synchronous, 8 risks divergence, 2-4 recommended.")
    staleness: StalenessConfig = Field(default_factory=StalenessConfig, description="How staleness_threshold is "
                                       "enforced: at admission always, at consumption too unless "
                                       "drop_at_consume is false.")

    @field_validator("staleness", mode="before")
    @classmethod
    def _staleness_is_a_section(cls, value):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            raise ValueError(f"staleness is a section ({{drop_at_consume: true|false}}); the threshold itself is "
                             f"staleness_threshold: {value}")
        return value
    queue_max_size: int = Field(256, ge=1, le=1_000_000, description="Trajectory queue capacity; past it producers "
                                "see backpressure (high-water marks and bounded node queues), never silent loss.")
    trigger_batch_size: int = Field(16, ge=1, le=1_000_000, description="Ready samples that trigger one update "
                                    "(async mode; suggested start global_batch_size / 2), and the batch of the "
                                    "staleness admission rule.")
    global_batch_size: int = Field(32, ge=1, le=1_000_000, description="Most samples one update consumes "
                                   "(exactly what it consumes in synchronous mode).")
    whole_groups: bool = Field(True, description="Async: an update takes GRPO groups (agent.group_size samples "
                               "sharing a group_id) whole, never the early finishers of a group without the rest: "
                               "a group's advantages compare its members, and the short ones finish first. A group "
                               "waits for its last member unless the queue holds a whole global batch without "
                               "enough whole groups (then oldest first, as with false).")
    mini_batch_size: int = Field(8, ge=1, le=1_000_000,
                                 description="PPO mini-batch within an update: an update of B samples takes "
                                 "ceil(B / mini_batch_size) optimizer steps on equal parts of it.")
    learning_rate: float = Field(1e-5, gt=0, le=1, description="Optimizer learning rate.")
    max_steps: int = Field(20, ge=1, le=10_000_000, description="Updates before the run ends by itself.")
    parallelism: Parallelism = Field(default_factory=Parallelism)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    durability: DurabilityConfig = Field(default_factory=DurabilityConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    model: ModelSpec = Field(default_factory=ModelSpec)
    rollout_engine: RolloutEngineConfig = Field(default_factory=RolloutEngineConfig)
    trainer_engine: TrainerEngineConfig = Field(default_factory=TrainerEngineConfig)
    endpoints: Endpoints = Field(default_factory=Endpoints)
    nodes: Nodes = Field(default_factory=Nodes, description="Node kinds to run; kinds left out get their defaults.")

    @model_validator(mode="after")
    def _coherent(self):
        par = self.parallelism  # one trainer rank per (dp, tp) pair; a side left at 1 follows the other
        if par.dp * par.tp == 1:
            par.dp = self.train_workers
        elif self.train_workers == 1:
            self.train_workers = par.dp * par.tp
        elif self.train_workers != par.dp * par.tp:
            raise ValueError(f"train_workers ({self.train_workers}) and parallelism dp x tp ({par.dp} x {par.tp} "
                             f"= {par.dp * par.tp}) disagree: the trainer runs one rank per (dp, tp) pair; set "
                             f"train_workers to {par.dp * par.tp} or leave it at 1")
        if self.trigger_batch_size > self.global_batch_size:
            raise ValueError(f"trigger_batch_size ({self.trigger_batch_size}) must be <= global_batch_size "
                             f"({self.global_batch_size})")
        if self.mini_batch_size > self.global_batch_size:
            raise ValueError(f"mini_batch_size ({self.mini_batch_size}) must be <= global_batch_size "
                             f"({self.global_batch_size})")
        if self.global_batch_size > self.queue_max_size:
            raise ValueError(f"global_batch_size ({self.global_batch_size}) must fit in queue_max_size "
                             f"({self.queue_max_size}) or no update could ever trigger")
        rollout = self.nodes.get("rollout")
        if rollout is not None and rollout.replicas is not None and rollout.replicas != self.rollout_workers \
                and "rollout_workers" in self.model_fields_set:
            raise ValueError(f"nodes.rollout.replicas ({rollout.replicas}) and rollout_workers "
                             f"({self.rollout_workers}) disagree; set one of them")
        if (self.rollout_engine.kind == "sim") != (self.trainer_engine.kind == "sim"):
            raise ValueError("rollout_engine.kind and trainer_engine.kind must both be 'sim', or 'torch'/'vllm' "
                             "with 'torch'")
        if self.trainer_device.startswith("cuda") and not self.model.device.startswith("cuda"):
            raise ValueError(f"model.trainer_device {self.trainer_device!r} is a GPU but model.device "
                             f"{self.model.device!r} is not: a trainer on a GPU hands its weights over by CUDA IPC, "
                             f"so the rollout workers must be on a GPU of the same host too")
        if self.rollout_engine.kind == "vllm" and not re.fullmatch(r"cuda(:0)?", self.model.device):
            raise ValueError(f"rollout_engine.kind 'vllm' runs on the first GPU the process sees: model.device "
                             f"must be 'cuda' (choose the GPU with CUDA_VISIBLE_DEVICES), got {self.model.device!r}")
        engine = self.rollout_engine
        tuned = [k for k, on in (("decode_attention", engine.decode_attention in ("matmul", "flash_varlen")),
                                 ("decode_compile", engine.decode_compile is True)) if on]
        if tuned and (self.rollout_engine.kind != "torch" or not self.model.device.startswith("cuda")):
            raise ValueError(f"rollout_engine.{' and '.join(tuned)} tune the torch engine's decode step on a GPU "
                             f"(CUDA graphs); with rollout_engine.kind {self.rollout_engine.kind!r} on model.device "
                             f"{self.model.device!r} they would do nothing: set kind 'torch' and device 'cuda', "
                             f"or leave them out")
        # (named flash_varlen is the torch engine on a GPU by now: the check above)
        if self.rollout_engine.decode_attention == "flash_varlen" and self.model.dtype not in ("bfloat16", "float16"):
            raise ValueError(f"rollout_engine.decode_attention 'flash_varlen' runs FlashAttention, which takes "
                             f"bfloat16 or float16: set model.dtype to one of them (got {self.model.dtype!r}), or "
                             f"decode_attention 'sdpa'")
        if (self.agent.framework == "sim") != (self.rollout_engine.kind == "sim"):
            raise ValueError("agent.framework 'sim' goes with the sim engines, a real task with the torch engines")
        if self.agent.via == "gateway" and (self.replicas("gateway") < 1 or self.agent.framework == "sim"):
            raise ValueError("agent.via 'gateway' needs a gateway node (nodes.gateway) and a real task "
                             "(agent.framework 'guess', 'math' or a task of your own)")
        if self.staleness.in_order and self.agent.via != "bus":
            raise ValueError("staleness.in_order orders the bus agent's groups (agent.via 'bus'); with agent.via "
                             "'gateway' episodes go through the gateway's sessions, which it does not reorder: "
                             "set agent.via 'bus' or leave in_order out")
        stall = group_stall(self)  # whole GRPO groups that can never add up to an update
        if stall:
            raise ValueError(stall)
        gateway = self.nodes.gateway.config
        if gateway.max_context_tokens is None:  # the engine's sequence length is the gateway's context
            gateway.max_context_tokens = self.rollout_engine.max_len
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

    @model_validator(mode="after")
    def _placement(self):
        # Hosts and placement (areal_bus/config/placement.py); the trainer node binds at its first host.
        from areal_bus.config import placement

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
        one (rollout: rollout_workers); the optional kinds (gateway, probe) run only when listed."""
        spec = self.nodes.get(kind)
        if spec is not None and spec.replicas is not None:
            return spec.replicas
        if kind == "rollout":
            return self.rollout_workers
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
        """What the reward node scores with: nodes.reward.config.reward_source, else agent.reward_source."""
        return self.reward_config().reward_source or self.agent.reward_source

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
        from areal_bus.wire.security import load_keys

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


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _expand(value, path: str, source: str):
    if isinstance(value, str):
        def sub(m):
            name, default = m.group(1), m.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            raise TopologyError(f"{source}: {path}: environment variable ${{{name}}} is not set "
                                f"(export it in this shell, or write ${{{name}:-default}})")
        return _ENV.sub(sub, value)
    if isinstance(value, dict):
        return {k: _expand(v, f"{path}.{k}" if path else str(k), source) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, f"{path}[{i}]", source) for i, v in enumerate(value)]
    return value


def _format_errors(source: str, err: ValidationError, model=Topology) -> str:
    lines = [f"{source}: invalid topology ({err.error_count()} problem{'s' if err.error_count() > 1 else ''})"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            allowed = _allowed_fields(model, e["loc"][:-1])
            msg = f"unknown field; allowed here: {', '.join(allowed)}" if allowed else \
                "unknown field; this node kind takes no config (its knobs are top-level fields)"
        got = e.get("input")
        shown = "" if e["type"] in ("extra_forbidden", "missing") or isinstance(got, dict) \
            or loc.endswith("admin_token") else f" (got {got!r})"
        lines.append(f"  {loc}: {msg}{shown}")
    return "\n".join(lines)


def _model_of(ann):
    """The pydantic model an annotation holds (``X``, ``X | None``), else None."""
    if get_origin(ann) in (Union, types.UnionType):
        models = [a for a in get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _allowed_fields(model, loc) -> list[str]:
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        field = model.model_fields.get(part) or next(
            (f for f in model.model_fields.values() if f.alias == part), None)
        ann = getattr(field, "annotation", None)
        if get_origin(ann) is dict and parts:
            parts.pop(0)  # the key: every value of the mapping has one schema
            ann = get_args(ann)[1]
        model = _model_of(ann)
        if model is None:
            return []
    return sorted(f.alias or n for n, f in model.model_fields.items())


def parse_topology(data, source: str = "<topology>") -> Topology:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise TopologyError(f"{source}: a topology is a YAML mapping of fields, got {type(data).__name__}")
    data = _expand(data, "", source)
    try:
        return Topology.model_validate(data)
    except ValidationError as err:
        raise TopologyError(_format_errors(source, err)) from None


def read_yaml(path: str | os.PathLike, what: str, error: type[Exception]):
    """A YAML file's data, or ``error`` with one message naming the file (shared by every config)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"{path}: cannot read {what} ({exc.strerror})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None


def load_topology(path: str | os.PathLike) -> Topology:
    """Read, expand and validate a topology file. Raises TopologyError with one clear message."""
    return parse_topology(read_yaml(path, "topology", TopologyError), str(path))


def dump_resolved(topo: Topology) -> dict:
    """The fully resolved configuration, as logged at node start (logs/resolved/<node>.json) and printed
    by `areal-bus validate`, with every secret-marked field (node_configs.SECRET: the gateway's
    admin_token) shown as REDACTED: these files are read by people and tools, and outlive the run.
    Read back, a redacted token is unset (the trainer's other ranks need none)."""
    return _redact(topo, topo.model_dump(mode="json", by_alias=True))


def _redact(model: BaseModel, dumped: dict) -> dict:
    for name, info in type(model).model_fields.items():
        key = info.alias or name
        if key not in dumped:  # Nodes dumps only the listed kinds
            continue
        value = getattr(model, name)
        if isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get(SECRET):
            dumped[key] = None if value is None else REDACTED
        elif isinstance(value, BaseModel) and isinstance(dumped[key], dict):
            _redact(value, dumped[key])
    return dumped
