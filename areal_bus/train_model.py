"""The trainer's policy: transformers' own model classes, packed sequences, chunked log-probabilities.

The trainer builds the policy with ``AutoModelForCausalLM`` from the user's local folder, so every
architecture transformers knows trains (Qwen2/2.5/3, Llama 3.x with RoPE scaling, Mistral, SmolLM2,
...). The hand-written decoder in ``areal_bus.modeling`` stays where it earns its place: the CPU
rollout engine and the CUDA-graph decode path. Both sides take a token's log-probability from the
same function, ``modeling.logprobs_of`` (tempered full softmax), so the trainer's recompute and the
sampler's record agree by construction.

Three things here are written by hand because no library does them for this objective:

* ``pack``: a PPO mini-batch of variable-length trajectories becomes micro-batches of at most
  ``max_tokens`` tokens laid end to end in one row, position ids reset at every sample start. With no
  attention mask and ``use_cache=False``, transformers derives a block-diagonal causal mask from
  those position ids (``masking_utils.find_packed_sequence_indices``), so attention never crosses
  samples and no padding is computed.
* ``packed_logprobs``: the language-model head is applied to a chunk of positions at a time, and
  each chunk runs under activation checkpointing, so no [tokens, vocab] float32 tensor is ever whole
  (at Qwen2's 152k vocabulary, 16k tokens of logits would be 10 GB): memory is one chunk's logits.
* mixed precision: the weights and AdamW's state stay float32 (master weights); forward and
  backward run under ``torch.autocast`` in bfloat16. At RL learning rates (1e-6) an update is far
  below bfloat16's resolution of a weight, so pure-bf16 training rounds most updates away.

Quick check::

    python -c "from areal_bus.train_model import *; print(pack.__doc__)"
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from areal_bus.modeling import as_dtype, logprobs_of, scaled_logits

LOGIT_CHUNK_TOKENS = 4096
"""Positions whose logits exist at once: 4096 x 152k vocabulary x 4 bytes = 2.5 GB at Qwen2's
vocabulary, a small share of a GPU, while still one large matmul per chunk."""


def load_policy(path: str | Path, device: str | torch.device = "cpu", *, attn_implementation: str = "sdpa",
                gradient_checkpointing: bool = False):
    """The policy to train: float32 master weights from a local Hugging Face folder (config.json and
    safetensors), on ``device``. Raises with the folder's name when transformers cannot build it."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation,
                                                     local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"model.path {path}: transformers cannot build a causal LM from it ({exc})") from exc
    model.to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False  # training: a cache would also switch off the packed-sequence mask
    return model


def autocast(device: torch.device, compute_dtype: torch.dtype | str):
    """bf16 (or fp16) compute over float32 master weights; a no-op for float32."""
    dtype = as_dtype(compute_dtype)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def export_state_dict(model, dtype: torch.dtype | str) -> dict[str, torch.Tensor]:
    """The weights rollout serves, in its dtype: Hugging Face names, a tied lm_head left out (the
    rollout model ties it to the embedding itself)."""
    dtype = as_dtype(dtype)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return {k: v.detach().to(dtype) for k, v in model.state_dict().items()
            if not (tied and k == "lm_head.weight") and not k.endswith("rotary_emb.inv_freq")}


# -- packing ----------------------------------------------------------------------------------
@dataclass
class Packed:
    """One micro-batch: samples laid end to end in a single row.

    ``ids``/``positions`` are [1, N]; ``mask``/``behav``/``adv`` are [N], aligned with ``ids`` (entry t
    belongs to token t: its loss weight, the logprob the sampler recorded, its advantage); ``rows``
    holds each sample's index in the mini-batch and its span (start, length) in the row."""

    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    behav: torch.Tensor
    adv: torch.Tensor
    rows: list[tuple[int, int, int]]

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[1])

    def to(self, device) -> Packed:
        return Packed(self.ids.to(device), self.positions.to(device), self.mask.to(device), self.behav.to(device),
                      self.adv.to(device), self.rows)


def pack(samples: list[dict], max_tokens: int) -> list[Packed]:
    """Micro-batches of at most ``max_tokens`` tokens (a longer sample gets one of its own), in the
    samples' order. Each sample is a dict of numpy arrays: ``ids`` (prompt + output), ``mask``,
    ``behav`` and a scalar ``adv``, each array as long as ``ids``."""
    groups: list[list[int]] = []
    used = 0
    for i, s in enumerate(samples):
        n = int(s["ids"].size)
        if not groups or used + n > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return [_pack_group(samples, g) for g in groups]


def _pack_group(samples: list[dict], idx: list[int]) -> Packed:
    rows, start = [], 0
    for i in idx:
        n = int(samples[i]["ids"].size)
        rows.append((i, start, n))
        start += n
    cat = lambda key, dtype: torch.from_numpy(np.concatenate([np.asarray(samples[i][key], dtype) for i in idx]))
    adv = torch.from_numpy(np.concatenate([np.full(samples[i]["ids"].size, samples[i]["adv"], np.float32)
                                           for i in idx]))
    positions = torch.from_numpy(np.concatenate([np.arange(samples[i]["ids"].size) for i in idx]))
    return Packed(cat("ids", np.int64)[None], positions[None], cat("mask", np.float32), cat("behav", np.float32),
                  adv, rows)


# -- log-probabilities ------------------------------------------------------------------------
def _head_logprobs(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias, softcap, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logprobs_of(logits, targets, temperature)


def _head_entropy(hidden, weight, bias, softcap, temperature) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    z = scaled_logits(logits, temperature)
    return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)


def packed_logprobs(model, packed: Packed, temperature: float = 1.0, *, chunk: int = LOGIT_CHUNK_TOKENS,
                    entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([N] log p(ids[t] | the sample's tokens before t), [N] entropy of that distribution or None).

    Entry t is 0 where token t starts a sample (nothing predicts it). Differentiable in the model's
    parameters; the logits of one chunk of positions exist at a time, and are recomputed in backward
    (checkpointing) instead of kept."""
    decoder = getattr(model, model.base_model_prefix)
    hidden = decoder(input_ids=packed.ids, position_ids=packed.positions, use_cache=False).last_hidden_state[0]
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    targets = packed.ids[0, 1:]
    h = hidden[:-1]
    parts, ents = [], []
    for s in range(0, h.shape[0], chunk):
        args = (h[s:s + chunk], targets[s:s + chunk], head.weight, head.bias, softcap, temperature)
        if torch.is_grad_enabled():
            parts.append(checkpoint(_head_logprobs, *args, use_reentrant=False))
        else:
            parts.append(_head_logprobs(*args))
        if entropy:
            with torch.no_grad():
                ents.append(_head_entropy(h[s:s + chunk], head.weight, head.bias, softcap, temperature))
    zero = hidden.new_zeros(1, dtype=torch.float32)
    starts = packed.positions[0] == 0
    lp = torch.cat([zero, *parts]).masked_fill(starts, 0.0)
    ent = torch.cat([zero, *ents]).masked_fill(starts, 0.0) if entropy else None
    return lp, ent


def count_params(model) -> int:
    """Parameters counted once (a tied lm_head is the embedding)."""
    return sum(p.numel() for p in model.parameters())


def train_flops(model, tokens: int, seq_sq_sum: int, recompute: bool = True) -> float:
    """FLOPs of one update over ``tokens`` tokens: 6 N per token for forward and backward of the
    matmuls (N = parameters, the tied embedding counted once as the lm_head matmul), plus attention's
    12 * layers * hidden * sum(len^2) / 2 (causal), plus 2 N per token for the proximal forward when
    ``recompute``. Activation checkpointing's extra forward is not counted (MFU counts useful work)."""
    cfg = model.config
    n = count_params(model)
    attn = 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_sq_sum / 2
    fwd = 2 * n * tokens + attn / 3
    return 3 * fwd + (fwd if recompute else 0.0)
