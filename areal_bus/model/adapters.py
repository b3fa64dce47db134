"""LoRA adapters served unmerged by the rollout model (``modeling.CausalLM``): the base from model.path,
the adapter from each weight version.

With ``trainer_engine.lora`` the trainer trains low-rank adapters on a frozen base
(areal_bus/train/lora.py) and publishes the adapter alone. Each targeted projection of the rollout model
then computes

    y = base(x) + scale * (x @ A.T) @ B.T

with A [rank, in] and B [out, rank] buffers of the projection (``AdaptedLinear``), overwritten in place at
every swap: the CUDA-graph decode step (engines/cuda_decode.py) reads them by address, and its fused q/k/v
and gate/up matmuls get one fused adapter each (``fuse``: the A's stacked, the B's block-diagonal, so the
adapter of a fused group is two small matmuls). Until the first swap B is zero: the base alone, which is
version 0, as peft's initialisation makes it on the trainer's side.

The weight version's format (fixed): "<module>.lora_A.weight" [rank, in] and "<module>.lora_B.weight"
[out, rank] for every targeted module, named as in the Hugging Face checkpoint
("model.layers.0.self_attn.q_proj"), in model.dtype; scale = alpha / rank comes from the topology, on both
sides. Quick check::

    python -c "from areal_bus.model.modeling import *; from areal_bus.model import adapters
    m = make_random_model(TINY_QWEN2); adapters.attach(m, ['q_proj', 'down_proj'], 4, 2.0)
    print(sorted(adapters.wire_shapes(m))[:2])"
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from areal_bus.model.modeling import CausalLM, ModelConfig, check_state_dict, load_pretrained, model_from_state

PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
"""The projections of a decoder layer that can take an adapter, with the submodule that holds each."""


class AdaptedLinear(nn.Linear):
    """An nn.Linear (the same weight and bias Parameters, so the same names) with an adapter: A and B
    as buffers, left out of ``state_dict`` (the checkpoint's names stay the base's)."""

    def __init__(self, base: nn.Linear, rank: int, scale: float):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias
        w = base.weight
        self.register_buffer("lora_A", torch.zeros(rank, self.in_features, dtype=w.dtype, device=w.device),
                             persistent=False)
        self.register_buffer("lora_B", torch.zeros(self.out_features, rank, dtype=w.dtype, device=w.device),
                             persistent=False)
        self.scale = float(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # peft's LoRA Linear, in the same order: base, then B(A(x)) * scaling added
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale


def attach(model: CausalLM, targets, rank: int, scale: float) -> CausalLM:
    """Give ``model``'s ``targets`` projections (names of ``PROJECTIONS``) in every layer a zero adapter,
    in place; returns ``model``."""
    unknown = [t for t in targets if t not in PROJECTIONS]
    if unknown:
        raise ValueError(f"trainer_engine.lora.target_modules: the rollout model has no {', '.join(unknown)} "
                         f"(its projections: {', '.join(PROJECTIONS)})")
    for layer in model.model.layers:
        for name in targets:
            holder = getattr(layer, PROJECTIONS[name])
            module = getattr(holder, name)
            if not isinstance(module, AdaptedLinear):
                setattr(holder, name, AdaptedLinear(module, rank, scale))
    return model


def rollout_model(path: str | Path, lora, device: str | torch.device = "cpu",
                  dtype: torch.dtype | str = torch.float32, base: dict[str, torch.Tensor] | None = None) -> CausalLM:
    """The rollout model of a run: the checkpoint at ``path``, with zero adapters where ``lora``
    (trainer_engine.lora, or None) says. ``base``: the base's tensors to serve as they are (the trainer's
    shared base, areal_bus/model/shared_base.py: views, not copies) instead of loading ``path``'s."""
    model = (load_pretrained(path, device, dtype) if base is None
             else model_from_state(ModelConfig.from_hf(path), base))
    return model if lora is None else attach(model, lora.target_modules, lora.rank, lora.scale)


def adapted(model: nn.Module) -> dict[str, AdaptedLinear]:
    """{Hugging Face module name: projection} of every projection with an adapter."""
    return {name: m for name, m in model.named_modules() if isinstance(m, AdaptedLinear)}


def wire_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the tensors a weight version holds for ``model``'s adapters."""
    out = {}
    for name, m in adapted(model).items():
        out[f"{name}.lora_A.weight"] = tuple(m.lora_A.shape)
        out[f"{name}.lora_B.weight"] = tuple(m.lora_B.shape)
    return out


def load_weights(model: CausalLM, state: dict[str, torch.Tensor]) -> None:
    """A weight swap, in place: the adapter alone where ``model`` has adapters, else the full weights.
    Every name and shape is checked before anything is written, so a bad version never half-swaps."""
    modules = adapted(model)
    if not modules:
        state = check_state_dict(model, state)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(state[name])
        return
    want = wire_shapes(model)
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unexpected:
        full = any(k.endswith("proj.weight") for k in unexpected)
        raise KeyError(f"the adapter does not match the model's: missing {missing[:3]}, unexpected {unexpected[:3]}"
                       + (" (full weights: does the trainer train LoRA too?)" if full else ""))
    bad = [k for k, shape in want.items() if tuple(state[k].shape) != shape]
    if bad:
        raise ValueError(f"adapter shape mismatch: {bad[0]} {tuple(state[bad[0]].shape)} vs {want[bad[0]]} "
                         f"(trainer_engine.lora.rank differs between the trainer and this worker?)")
    with torch.no_grad():
        for name, m in modules.items():
            m.lora_A.copy_(state[f"{name}.lora_A.weight"])
            m.lora_B.copy_(state[f"{name}.lora_B.weight"])


class Fused(NamedTuple):
    """The adapters of projections that run as one matmul (q/k/v, gate/up): A [n x rank, in] (the
    adapted ones' A's stacked), B [sum of outs, n x rank] (block-diagonal; zero rows for a projection
    without one), and the scale."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float


def fuse(modules: list[nn.Linear]) -> Fused | None:
    """The fused adapter of ``modules`` (in their matmul's order), or None when none has one."""
    with_adapter = [m for m in modules if isinstance(m, AdaptedLinear)]
    if not with_adapter:
        return None
    rank, w = with_adapter[0].lora_A.shape[0], modules[0].weight
    A = torch.zeros(len(with_adapter) * rank, w.shape[1], dtype=w.dtype, device=w.device)
    B = torch.zeros(sum(m.out_features for m in modules), A.shape[0], dtype=w.dtype, device=w.device)
    out = Fused(A, B, with_adapter[0].scale)
    refresh(modules, out)
    return out


@torch.no_grad()
def refresh(modules: list[nn.Linear], fused: Fused | None) -> None:
    """Copy ``modules``' adapters into ``fused``, in place (after a swap: a captured graph holds its
    addresses)."""
    if fused is None:
        return
    row = col = 0
    for m in modules:
        if isinstance(m, AdaptedLinear):
            r = m.lora_A.shape[0]
            fused.A[col:col + r].copy_(m.lora_A)
            fused.B[row:row + m.out_features, col:col + r].copy_(m.lora_B)
            col += r
        row += m.out_features


def add(y: torch.Tensor, x: torch.Tensor, fused: Fused | None) -> torch.Tensor:
    """``y`` (the fused matmul of x) plus its fused adapter's output."""
    return y if fused is None else y + F.linear(F.linear(x, fused.A), fused.B) * fused.scale
