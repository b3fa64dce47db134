"""The memory plan: what the trainer and each rollout engine need on their GPU at the run's shape, from
config.json alone, and the check that it fits, at ``areal-bus validate`` / ``areal-bus plan`` and at node start.

One card may hold the trainer and rollout workers side by side (issue 51: an 8B policy with LoRA on one 80 GB
GPU). Without a plan such a run dies of an out-of-memory error minutes in, in whichever process allocates
last. Here every process's budget is an itemised sum, per device, checked against ``model.gpu_memory_fraction``
of the card (the rest is the allocator's fragmentation and other processes):

trainer (per rank)
  LoRA: the base in model.dtype (frozen) + the adapters' float32 masters, gradients and AdamW state
  (16 bytes a parameter); full fine-tuning: float32 masters, gradients, AdamW state (16 bytes a parameter,
  divided over dp ranks when sharded), plus the compute copy and its gradients in model.dtype
  (mixed_precision compute_copy) and the KL reference (kl_coef > 0). Activations at micro_batch_tokens:
  per token and layer (4 h + 2 q + 2 kv + 3 i) x dtype bytes (h hidden, q query width, kv key/value width,
  i the MLP's), all layers, or with gradient_checkpointing one layer plus each layer's input; the chunked
  head: logit_chunk_tokens x vocab x 8 bytes plus logit_grad_keep_gib.
rollout (per worker)
  the weights in model.dtype, unless shared with the trainer (model.share_base: mapped, not held); on a GPU
  the decode step's fused q/k/v and gate/up copies (none with a shared base); the adapters; the KV cache,
  kv bytes per token x cache tokens (rollout_engine.kv_tokens, else the dense cache's max_batch x max_len); the decode step's workspace
  (logits, sampling, a step's activations at max_batch) and a prefill's (activations at 8192 tokens).
  vLLM takes gpu_memory_utilization of the card, whatever the shape.
each CUDA process: ``CUDA_CONTEXT_BYTES`` for its context and kernels.

The activation coefficients are fitted to bench/trainer.py's peaks on one H100 (1.5B full fine-tuning at
16k tokens: 65.9 GiB measured; 3B with checkpointing at 8k: 62.7 GiB) and err on the high side by a few
percent; a plan that fits with little room is a plan to measure. Quick check::

    areal-bus plan topology/default.yaml
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from areal_bus.config import placement
from areal_bus.model import shared_base
from areal_bus.model.modeling import ModelConfig, as_dtype, kv_bytes_per_token, param_shapes

GIB = 2 ** 30
CUDA_CONTEXT_BYTES = 1 * GIB
"""A CUDA process's context, cuBLAS/cuDNN workspaces and loaded kernels: 0.5-1 GiB on an H100."""
PREFILL_TOKENS = 8192
"""The torch engine's max_prefill_tokens default: one prefill forward's padded size."""
CACHE_TOKEN_KNOBS = ("kv_tokens",)
"""rollout_engine fields that bound the torch engine's cache in tokens (its paged cache's kv_tokens), if set;
else the dense cache's max_batch x max_len."""


class MemoryPlanError(ValueError):
    """The plan does not fit its card; the message names every number."""


@dataclass
class Budget:
    who: str  # "trainer" / "rollout-0"
    device: str  # "localhost:gpu0"
    items: list[tuple[str, int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(b for _, b in self.items)

    def add(self, what: str, nbytes: float) -> None:
        if nbytes:
            self.items.append((what, int(nbytes)))


@dataclass
class Plan:
    budgets: list[Budget]
    fraction: float
    card_bytes: int | None  # the card's memory where known (model.gpu_memory_gib, or the device at node start)

    def devices(self) -> dict[str, list[Budget]]:
        out: dict[str, list[Budget]] = {}
        for b in self.budgets:
            out.setdefault(b.device, []).append(b)
        return out

    def over(self, card_bytes: int | None = None) -> list[str]:
        """A sentence per GPU whose budgets exceed fraction x the card, naming the numbers."""
        card = card_bytes or self.card_bytes
        if card is None:
            return []
        limit = self.fraction * card
        out = []
        for dev, budgets in self.devices().items():
            if not dev.split(":", 1)[-1].startswith("gpu"):
                continue
            total = sum(b.total for b in budgets)
            if total > limit:
                parts = " + ".join(f"{b.who} {gib(b.total)}" for b in budgets)
                out.append(f"{dev}: {parts} = {gib(total)} > model.gpu_memory_fraction {self.fraction} x "
                           f"{gib(card)} = {gib(limit)}")
        return out

    def lines(self) -> list[str]:
        out = []
        for dev, budgets in self.devices().items():
            total = sum(b.total for b in budgets)
            card = f" of {gib(self.card_bytes)} x {self.fraction} = {gib(self.fraction * self.card_bytes)}" \
                if self.card_bytes and dev.split(":", 1)[-1].startswith("gpu") else ""
            out.append(f"{dev}: {gib(total)}{card}")
            for b in budgets:
                out.append(f"  {b.who}: {gib(b.total)}")
                out += [f"    {gib(n):>10}  {what}" for what, n in b.items]
        return out


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _dtype_bytes(dtype: str) -> int:
    return as_dtype(dtype).itemsize


def _widths(cfg: ModelConfig) -> tuple[int, int, int, int]:
    return (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim,
            cfg.intermediate_size)


def layer_activation_elems(cfg: ModelConfig) -> int:
    """Elements a decoder layer keeps per token for its backward (or a forward's transient peak)."""
    h, q, kv, i = _widths(cfg)
    return 4 * h + 2 * q + 2 * kv + 3 * i


def lora_params(cfg: ModelConfig, lora) -> int:
    shapes = dict(param_shapes(cfg))
    total = 0
    for layer in range(cfg.num_hidden_layers):
        for name, shape in shapes.items():
            parts = name.split(".")
            if name.startswith(f"model.layers.{layer}.") and parts[-1] == "weight" and parts[-2] in lora.target_modules:
                total += lora.rank * (shape[0] + shape[1])
    return total


def trainer_budget(topo, cfg: ModelConfig, device: str, card_bytes: int | None) -> Budget:
    te, b = topo.trainer_engine, _dtype_bytes(topo.model.dtype)
    out = Budget("trainer", device)
    n = sum(math_prod(s) for _, s in param_shapes(cfg))
    dp = max(1, topo.train_workers // topo.parallelism.tp)
    shard = f" (/{dp} ranks)" if dp > 1 else ""
    if te.lora is not None:
        a = lora_params(cfg, te.lora)
        out.add(f"base weights, {n / 1e9:.2f}B params x {b} B ({topo.model.dtype}, frozen){shard}", n * b / dp)
        out.add(f"LoRA r{te.lora.rank} adapters, {a / 1e6:.1f}M params x 16 B (fp32 master, grad, AdamW)", a * 16)
    else:
        out.add(f"master weights fp32, {n / 1e9:.2f}B params x 4 B{shard}", n * 4 / dp)
        out.add(f"gradients fp32{shard}", n * 4 / dp)
        out.add(f"AdamW state fp32 (2 x 4 B){shard}", n * 8 / dp)
        copy = te.mixed_precision == "compute_copy" and b < 4 and dp == 1
        if copy:
            out.add(f"compute copy + its gradients ({topo.model.dtype})", n * 2 * b)
        if te.kl_coef > 0:
            out.add("KL reference model", n * (b if copy else 4))
    tokens = te.micro_batch_tokens
    per_layer = layer_activation_elems(cfg) * b
    if te.gradient_checkpointing:
        out.add(f"activations, {tokens} tokens: each layer's input + one layer's (checkpointing)",
                tokens * (cfg.num_hidden_layers * cfg.hidden_size * b + per_layer))
    else:
        out.add(f"activations, {tokens} tokens x {cfg.num_hidden_layers} layers x {per_layer} B",
                tokens * cfg.num_hidden_layers * per_layer)
    gpu = device.split(":", 1)[-1].startswith("gpu")
    keep = te.logit_grad_keep_gib
    if keep is None:
        keep = min(8.0, card_bytes / GIB / 10) if gpu and card_bytes else 8.0 if gpu else 1.0
    # the kept logit gradients are a micro-batch's at most (2 B each), whatever the budget allows
    kept = min(keep * GIB, tokens * cfg.vocab_size * 2)
    out.add(f"chunked head: {te.logit_chunk_tokens} x {cfg.vocab_size} vocab x 8 B + kept logit gradients "
            f"(logit_grad_keep_gib {keep:g}, a micro-batch's at most)", te.logit_chunk_tokens * cfg.vocab_size * 8 + kept)
    if gpu:
        out.add("CUDA context", CUDA_CONTEXT_BYTES)
    return out


def cache_tokens(engine) -> tuple[int, str]:
    for knob in CACHE_TOKEN_KNOBS:
        value = getattr(engine, knob, None)
        if value:
            return int(value), f"rollout_engine.{knob}"
    return engine.max_batch * engine.max_len, f"max_batch {engine.max_batch} x max_len {engine.max_len}"


def rollout_budget(topo, cfg: ModelConfig, who: str, device: str, shared: bool, card_bytes: int | None) -> Budget:
    eng, b = topo.rollout_engine, _dtype_bytes(topo.model.dtype)
    out = Budget(who, device)
    gpu = device.split(":", 1)[-1].startswith("gpu")
    if eng.kind == "vllm":
        if card_bytes:
            out.add(f"vLLM gpu_memory_utilization {eng.gpu_memory_utilization}", eng.gpu_memory_utilization * card_bytes)
        else:
            out.add("vLLM: gpu_memory_utilization of the card (set model.gpu_memory_gib to count it)", 0)
        return out
    shapes = param_shapes(cfg)
    n = sum(math_prod(s) for _, s in shapes)
    if shared:
        out.items.append(("base weights: mapped from the trainer (model.share_base), not held", 0))
    else:
        out.add(f"weights, {n / 1e9:.2f}B params x {b} B ({topo.model.dtype})", n * b)
        if gpu:
            fused = sum(math_prod(s) for name, s in shapes if re.search(r"\.(q|k|v|gate|up)_proj\.", name))
            out.add("decode step's fused q/k/v + gate/up copies", fused * b)
    lora = getattr(topo.trainer_engine, "lora", None)
    if lora is not None:
        out.add(f"LoRA r{lora.rank} adapters (+ fused copies)", lora_params(cfg, lora) * b * 2)
    tokens, how = cache_tokens(eng)
    per = kv_bytes_per_token(cfg, as_dtype(topo.model.dtype))
    out.add(f"KV cache: {per / 1024:.0f} KiB/token x {tokens} tokens ({how})", per * tokens)
    out.add(f"decode workspace: logits + sampling at batch {eng.max_batch}, a step's activations",
            eng.max_batch * (cfg.vocab_size * (b + 8) + layer_activation_elems(cfg) * b))
    out.add(f"prefill workspace: {PREFILL_TOKENS} tokens x one layer", PREFILL_TOKENS * (layer_activation_elems(cfg)
                                                                                      + cfg.hidden_size) * b)
    if gpu:
        out.add("CUDA context + graph pool", CUDA_CONTEXT_BYTES)
    return out


def math_prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _device_label(host: str, device: str, gpus: list[int] | None) -> str:
    if gpus:
        return f"{host}:gpu{gpus[0]}"
    if device.startswith("cuda"):
        return f"{host}:gpu{int(device.split(':', 1)[1]) if ':' in device else 0}"
    return f"{host}:{device}"


def make_plan(topo, base=None, card_bytes: int | None = None) -> Plan | None:
    """The run's plan, or None where there is nothing to plan (sim engines, no config.json at model.path)."""
    if topo.rollout_engine.kind == "sim" and topo.trainer_engine.kind == "sim":
        return None
    path = topo.model_path(base)
    if not (path / "config.json").exists():
        return None
    cfg = ModelConfig.from_hf(path)
    if card_bytes is None and topo.model.gpu_memory_gib:
        card_bytes = int(topo.model.gpu_memory_gib * GIB)
    budgets = []
    t_host = placement.host_of(topo, "trainer")
    t_dev = _device_label(t_host, topo.trainer_device, placement.gpus_of(topo, "trainer", 0))
    if topo.trainer_engine.kind == "torch":
        budgets.append(trainer_budget(topo, cfg, t_dev, card_bytes))
    sharing = shared_base.enabled(topo)
    if topo.rollout_engine.kind != "sim":
        for r in range(topo.rollout_workers):
            dev = _device_label(placement.host_of(topo, "rollout", r), topo.model.device,
                                placement.gpus_of(topo, "rollout", r))
            budgets.append(rollout_budget(topo, cfg, f"rollout-{r}", dev, sharing and dev == t_dev, card_bytes))
    return Plan(budgets, topo.model.gpu_memory_fraction, card_bytes)


def check_at_start(topo, who: str, device, base=None, log=None) -> Plan | None:
    """At node start on a GPU: the plan against this card (``torch.cuda.mem_get_info``). Raises
    MemoryPlanError, naming the numbers, when the budgets of this device exceed the fraction of the card, or
    when this process's own budget exceeds the memory free now (others on the card took it)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    plan = make_plan(topo, base, card_bytes=total)
    if plan is None:
        return None
    mine = next((b for b in plan.budgets if b.who == who), None)
    if mine is None:
        return plan
    if log is not None:
        log.info("memory_plan", who=who, need_gib=round(mine.total / GIB, 2), free_gib=round(free / GIB, 2),
                 card_gib=round(total / GIB, 2))
    over = [line for line in plan.over(total) if line.startswith(mine.device + ":")]
    if over:
        raise MemoryPlanError(f"the memory plan does not fit ({over[0]}); `areal-bus plan TOPOLOGY` itemises it: "
                              f"lower rollout_engine.max_batch / max_len or trainer_engine.micro_batch_tokens, set "
                              f"trainer_engine.gradient_checkpointing or trainer_engine.lora, or raise "
                              f"model.gpu_memory_fraction")
    if mine.total > free:
        raise MemoryPlanError(f"{who} needs {gib(mine.total)} on {device} but {gib(free)} of {gib(total)} is free "
                              f"now (other processes hold the rest); `areal-bus plan TOPOLOGY` itemises the need")
    return plan
