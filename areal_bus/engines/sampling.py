"""The torch engine's sampler: one token per row of a step's logits, its log-probability, and the most
likely alternatives, batched on the device with one transfer to the host per step (by the caller).

Per row, in this order (each step only where some row of the batch asks for it):
  1. the grammar's mask, already applied to the logits by the engine (``grammar.TokenMask``): tokens
     the grammar does not allow next are -inf;
  2. temperature (``modeling.scaled_logits``: float32, divided by it; greedy scales by 1);
  3. ``top_k``: tokens below the k-th largest are -inf (ties with it stay);
  -> the **recorded distribution**: the softmax of these logits, renormalised over what the mask and
     top_k left. The token's recorded log-probability and the row's ``top_logprobs`` are taken from it;
  4. ``top_p``: the smallest set of most likely tokens whose mass reaches top_p (``top_p_filter``);
  5. the draw: greedy (argmax) at temperature 0, else ``torch.multinomial`` with the request's own
     generator (``seed``) or the engine's.

Why top_p is not in the recorded distribution while the mask and top_k are: it was never, and a row
without the new options must record bit for bit what it recorded before (the trainer's recompute,
``modeling.token_logprobs``, equals it when top_p == 1, tests/test_torch_engine.py). The mask and top_k
are new: what they remove the token could never have been, and the importance weight against the
trainer's unconstrained policy must see it (areal_bus/train/loss.py). vLLM's ``processed_logprobs``
takes top_p in too (areal_bus/engines/vllm_engine.py).

A row's draw depends only on its own distribution and its generator: ``torch.multinomial`` draws one
sample per row from exponential noise of the whole [B, V] batch, each row's from its own slice, so a
seeded row redrawn alone with its own generator is the same whatever shares its step, and the other
rows draw what they drew before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areal_bus.model.modeling import scaled_logits


@dataclass(slots=True)
class Sampled:
    """One step's draw, on the device: ``tokens`` and ``logprobs`` [B]; with ``top`` > 0, ``top_ids``
    and ``top_logprobs`` [B, top] (each row's most likely tokens of its recorded distribution, most
    likely first), else None."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside the smallest set whose mass reaches ``top_p`` (per row); the most
    likely token always stays. Not renormalised: ``torch.multinomial`` does not need it."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    # Rows with top_p >= 1 keep everything, even if rounding lets the cumulative sum pass 1.
    limit = torch.where(top_p < 1, top_p, torch.full_like(top_p, float("inf")))
    sorted_p = sorted_p.masked_fill(mass_before > limit[:, None], 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)


def top_k_filter_(z: torch.Tensor, top_ks: list[int]) -> None:
    """Set, in place, each row's logits below its k-th largest to -inf (``top_ks[i]`` = 0, or at least
    the vocabulary: the row is left as it is). Ties with the k-th stay, as in vLLM."""
    vocab = z.shape[-1]
    ks = [k if 0 < k < vocab else 0 for k in top_ks]
    if not any(ks):
        return
    dev = z.device
    kth = z.topk(max(ks), dim=-1).values.gather(-1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None])
    cut = torch.tensor([k > 0 for k in ks], device=dev)[:, None] & (z < kth)
    z.masked_fill_(cut, float("-inf"))


def sample(logits: torch.Tensor, temperatures: list[float], top_ps: list[float], generator: torch.Generator,
           top_ks: list[int] | None = None, generators: list[torch.Generator | None] | None = None,
           top: int = 0) -> Sampled:
    """One token per row of ``logits`` [B, V] (the grammar's mask already in them), as the module
    docstring says. ``top_ks`` (None: all 0) and ``generators`` (None: all the engine's ``generator``)
    per row; ``top``: how many alternatives to return per row (the most any row asked for; 0: none).

    Only the work a batch needs is done: an all-greedy batch without top_k is one argmax and one
    logsumexp over the vocabulary, and a row without the new options gets, bit for bit, the token and
    log-probability it got before they existed.
    """
    dev = logits.device
    sampled = [t > 0 for t in temperatures]
    if len(set(temperatures)) == 1:  # one temperature for all: scale by a number, no tensor to build
        z = scaled_logits(logits, float(temperatures[0]))
    else:
        z = scaled_logits(logits, torch.tensor(temperatures, dtype=torch.float32, device=dev))
    if top_ks is not None and any(top_ks):
        if z.data_ptr() == logits.data_ptr():  # float32 at temperature 1 is the logits themselves: keep them
            z = z.clone()
        top_k_filter_(z, top_ks)
    log_norm = torch.logsumexp(z, dim=-1)
    tokens = z.argmax(-1)
    if any(sampled):
        probs = (z - log_norm[:, None]).exp_()
        if any(p < 1 for p, s in zip(top_ps, sampled) if s):
            probs = top_p_filter(probs, torch.tensor(top_ps, dtype=torch.float32, device=dev))
        draw = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        own = [i for i, g in enumerate(generators or ()) if g is not None and sampled[i]]
        if own:  # seeded rows: redrawn from their own generators (their draws above are discarded)
            mine = torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=generators[i])[0] for i in own])
            draw = draw.index_copy(0, torch.tensor(own, device=dev), mine)
        tokens = draw if all(sampled) else torch.where(torch.tensor(sampled, device=dev), draw, tokens)
    out = Sampled(tokens, z.gather(-1, tokens[:, None]).squeeze(1) - log_norm)
    if top:
        values, out.top_ids = z.topk(min(top, z.shape[-1]), dim=-1)
        out.top_logprobs = values - log_norm[:, None]
    return out
