"""The trainer's policy: transformers' own model classes, packed sequences, chunked log-probabilities.

The trainer builds the policy with ``AutoModelForCausalLM`` from the user's local folder, so every
architecture transformers knows trains (Qwen2/2.5/3, Llama 3.x with RoPE scaling, Mistral, SmolLM2,
...). The hand-written decoder in ``areal_bus.model.modeling`` stays where it earns its place: the CPU
rollout engine and the CUDA-graph decode path. Both sides take a token's log-probability from the
same function, ``modeling.logprobs_of`` (tempered full softmax; the trainer's chunked head calls its
``logprobs_and_normaliser``), so the trainer's recompute and the sampler's record agree by construction.

The micro-batches it runs are packed by ``areal_bus.train.packing`` (samples end to end in one row, position
ids reset per sample, attention within each sample: ``VARLEN``). Three things here are written by hand
because no library does them for this objective or this use:

* ``packed_logprobs``: the language-model head is applied to a chunk of positions at a time, forward
  and backward (``HeadLogprobs``), so no [tokens, vocab] float32 tensor is ever whole (at Qwen2's 152k
  vocabulary, 16k tokens of logits would be 10 GB): memory is one chunk's logits, plus, within a
  budget, the bf16 gradient of the logits made in the forward for the backward (beyond it the chunk's
  logits are recomputed in backward). On a GPU the per-chunk softmax arithmetic is compiled into one pass
  over the bf16 logits each way, where eager torch made six float32 passes (cast, max, subtract, exp,
  sum, and as many back).
* FlashAttention-4 as torch operators (``areal_bus.train.fa4_ops``, for ``VARLEN_FA4``): the flash-attn-4
  package declares none, and torch.compile cannot trace its own entry point, so without them a compiled
  decoder layer would break its graph at every attention.
* mixed precision: the weights and AdamW's state stay float32 (master weights). At RL learning rates
  (1e-6) an update is far below bfloat16's resolution of a weight, so pure-bf16 training rounds most
  updates away. Compute is bf16 in one of two ways: ``ComputeCopy`` (the default in one process) keeps
  a bf16 copy of the network, refreshed from the masters once per optimizer step, runs forward and
  backward on it and adds its gradients into float32 master gradients at the end of each backward
  -- what FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` does per all-gather, for a model that
  is not sharded; or ``torch.autocast`` over the masters (the parallel layouts), which casts every
  weight again at every use, in the proximal pass, the forward and the head's recompute (the
  profile in bench/RESULTS.md: 12,800 copy/cast kernels per two updates). With LoRA
  (``trainer_engine.lora``, areal_bus/train/lora.py) the base is frozen in the compute dtype already
  and only the adapters have float32 masters: no compute copy, autocast casts the adapters at each use.

Quick check::

    python -c "from areal_bus.train.train_model import *; print(packed_logprobs.__doc__)"
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from areal_bus.train import fa4_ops  # noqa: F401  (registers areal_bus::fa4_varlen_fwd/_bwd)
from areal_bus.train import lora as lora_adapters
from areal_bus.model.modeling import as_dtype, logprobs_and_normaliser, scaled_logits
from areal_bus.train.packing import Packed

VARLEN = "areal_varlen"
"""The attention implementation the trainer registers with transformers: causal attention within each
packed sample, from the samples' cumulative lengths. On CUDA it is torch's FlashAttention varlen kernel
(``torch.nn.attention.varlen``), which touches only the diagonal blocks; on CPU a loop of causal SDPA
per sample. transformers' own packed path (sdpa with position ids) builds an [N, N] mask and computes
every block of it: at 16k tokens of ~500-token samples that is 30x the attention work."""

LOGIT_CHUNK_TOKENS = 4096
"""Positions whose logits exist at once: 4096 x 152k vocabulary x 4 bytes = 2.5 GB at Qwen2's
vocabulary, a small share of a GPU, while still one large matmul per chunk."""


VARLEN_FA4 = "areal_varlen_fa4"
"""VARLEN with FlashAttention-4's kernels (the ``flash-attn-4`` package, written in NVIDIA's CuTe DSL, for
Hopper and Blackwell GPUs) in place of torch's FlashAttention-2: the same attention, forward and
backward, by faster kernels. Opt-in (``trainer_engine.attn_implementation``): the package is a beta that
the project does not install; the trainer refuses this name where it is missing or the GPU is older
than Hopper. On CPU there is no such kernel: use VARLEN."""


def _varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, _kernel="fa2",
                      **kwargs):
    """transformers' attention-function signature: query [1, Hq, N, D], key/value [1, Hkv, N, D]; returns
    ([1, N, Hq, D], None). The samples' boundaries come as ``cu_seq_lens_q`` (FlashAttention's kwargs).
    ``_kernel`` ("fa2" or "fa4"): which FlashAttention runs on CUDA."""
    name = VARLEN_FA4 if _kernel == "fa4" else VARLEN
    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    # Unpacked rows: each row is one sample. transformers hands a registered custom attention no mask,
    # so right padding is exact (causal attention never reaches the pads after a row's tokens); left
    # padding would not be, and nothing here pads on the left.
    if cu is None and attention_mask is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                               enable_gqa=True)
        return out.transpose(1, 2), None
    if cu is None or query.shape[0] != 1:
        raise ValueError(f"attn_implementation {name!r} runs packed rows (one row, cu_seq_lens_q given) or "
                         f"unpadded ones; padded rows need 'sdpa'")
    if getattr(module, "sliding_window", None):
        raise ValueError(f"attn_implementation {name!r} has no sliding window; use 'sdpa' for this model")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, H, D]
    if q.is_cuda:
        out = _cuda_varlen(q, k, v, cu, int(longest), scaling, _kernel)
    else:
        parts = []
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            o = torch.nn.functional.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True,
                scale=scaling, enable_gqa=True)
            parts.append(o.transpose(0, 1))
        out = torch.cat(parts)
    return out[None], None


def _cuda_varlen(q, k, v, cu, longest: int, scaling, kernel: str = "fa2"):
    from torch.nn.attention.varlen import varlen_attn

    # FlashAttention takes bf16/fp16 only; under autocast RoPE hands q and k back in float32.
    half = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.bfloat16
    q, k, v = (t.to(half) for t in (q, k, v))
    cu = cu.to(torch.int32)
    if kernel == "fa4":
        scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
        return torch.ops.areal_bus.fa4_varlen_fwd(q.contiguous(), k.contiguous(), v.contiguous(), cu, longest,
                                                  scale)[0]
    return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **_varlen_options())


def _varlen_attention_fa4(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    return _varlen_attention(module, query, key, value, attention_mask, scaling, dropout, _kernel="fa4", **kwargs)


def check_fa4(device: str | torch.device) -> None:
    """Raises ValueError, saying what is missing, unless VARLEN_FA4 can run on ``device``: a CUDA GPU of
    compute capability 9 or newer (Hopper, Blackwell) with the flash-attn-4 package importable."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"attn_implementation {VARLEN_FA4!r} runs on a CUDA GPU (Hopper or newer), not on "
                         f"{dev.type}; use {VARLEN!r}")
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 9:
        raise ValueError(f"attn_implementation {VARLEN_FA4!r}: FlashAttention-4's backward needs compute "
                         f"capability 9.0 or newer (Hopper, Blackwell), this GPU has {major}.{minor}; use {VARLEN!r}")
    try:
        import flash_attn.cute.interface  # noqa: F401
    except Exception as exc:  # ImportError, or the CuTe DSL failing to load its libraries
        raise ValueError(f"attn_implementation {VARLEN_FA4!r} needs the flash-attn-4 package (pip install --pre "
                         f"flash-attn-4), which did not import: {type(exc).__name__}: {exc}") from exc


_VARLEN_OPTIONS: dict = {}


def _varlen_options() -> dict:
    """The keywords this torch's ``varlen_attn`` takes for causal attention with the key/value heads as
    they are, read from its signature once, outside any compiled code (a compiled layer traces through
    a dict read, not through ``inspect``). FlashAttention-2 takes fewer key/value heads than query heads
    itself; torch's wrapper asks for enable_gqa where it has the flag (2.13) and passes them through
    where it has not (2.11: the same results as repeating them to the query's count, 25% less attention
    time at the Qwen2-0.5B shape on an H200 without the copies and their backward sums,
    bench/attn_varlen.py in bench/RESULTS.md)."""
    if not _VARLEN_OPTIONS:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        _VARLEN_OPTIONS.update({"enable_gqa": True} if "enable_gqa" in params else {})
        _VARLEN_OPTIONS.update({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})
    return _VARLEN_OPTIONS


def _register_varlen() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, _varlen_attention)
    AttentionInterface.register(VARLEN_FA4, _varlen_attention_fa4)
    with contextlib.suppress(ImportError):  # a torch without it has no CUDA varlen path to call
        _varlen_options()


def load_policy(path: str | Path, device: str | torch.device = "cpu", *, attn_implementation: str = VARLEN,
                gradient_checkpointing: bool = False, lora=None, dtype: torch.dtype | str = torch.float32):
    """The policy to train: float32 master weights from a local Hugging Face folder (config.json and
    safetensors), on ``device``. With ``lora`` (trainer_engine.lora): the base frozen in ``dtype``
    (model.dtype) with float32 adapters (areal_bus/train/lora.py). Raises with the folder's name when
    transformers cannot build it."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    _register_varlen()
    if attn_implementation == VARLEN_FA4:
        check_fa4(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=as_dtype(dtype) if lora else torch.float32,
                                                     attn_implementation=attn_implementation, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"model.path {path}: transformers cannot build a causal LM from it ({exc})") from exc
    if lora is not None:
        lora_adapters.inject(model, lora)
    model.to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def autocast(device: torch.device, compute_dtype: torch.dtype | str):
    """bf16 (or fp16) compute over float32 master weights; a no-op for float32."""
    dtype = as_dtype(compute_dtype)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def _accumulate(master_grads: torch.Tensor, grads: torch.Tensor) -> None:
    """master_grads += grads; grads = 0. Compiled on a GPU into one vectorised pass: eager torch adds a
    bfloat16 tensor into a float32 one with an element-at-a-time casting kernel (17 ms of an update at
    0.5B in bench/RESULTS.md's profile) and zeroes in a second pass."""
    master_grads.add_(grads)
    grads.zero_()


class ComputeCopy:
    """A copy of ``master`` (a module with float32 parameters) in ``dtype`` that forward and backward
    run on, while the optimizer steps ``master``. The copy's gradients live in one flat buffer in
    ``dtype``, the masters' (their ``.grad``) in one flat float32 buffer; at the end of every backward
    (an autograd callback, queued by the first gradient that lands) the copy's buffer is added into
    the masters' and zeroed in one pass (``_accumulate``), so gradient accumulation over micro-batches
    happens in float32. Numerically the same as adding each weight's gradient as backward makes it,
    in one pass instead of two kernels per weight (the profile in bench/RESULTS.md: ~1,760 small adds
    per update at 0.5B, each behind a Python hook). The price: the copy's gradients stay allocated
    (2 bytes per parameter). After each optimizer step of the masters, ``refresh`` casts
    them into the copy: one cast per weight per step. Buffers (RoPE's inv_freq) are copied as they
    are."""

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype):
        self.module = copy.deepcopy(master)  # ties survive deepcopy: a tied lm_head stays the embedding
        for p in self.module.parameters():
            p.data = p.data.to(dtype)
        pairs = list(zip(master.named_parameters(), self.module.named_parameters()))
        if any(a[0] != b[0] for a, b in pairs):
            raise RuntimeError("ComputeCopy: the copy's parameters do not line up with the master's")
        self._pairs = [(m, c) for (_, m), (_, c) in pairs]
        total = sum(m.numel() for m, _ in self._pairs)
        device = self._pairs[0][0].device if self._pairs else torch.device("cpu")
        self._grads = torch.zeros(total, dtype=dtype, device=device)
        self._master_grads = torch.zeros(total, dtype=torch.float32, device=device)
        self._views: list[torch.Tensor] = []  # each master's .grad: its slice of _master_grads
        offset = 0
        for m, c in self._pairs:
            n = m.numel()
            c.grad = self._grads[offset:offset + n].view_as(c)  # backward accumulates into it in place
            self._views.append(self._master_grads[offset:offset + n].view_as(m))
            offset += n
        self._queued = False
        for _, c in self._pairs:
            c.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, _param: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._into_masters)

    @torch.no_grad()
    def _into_masters(self) -> None:
        self._queued = False
        for (m, _), view in zip(self._pairs, self._views):
            if m.grad is not view:  # set to None (zero_grad's default) or replaced: take it back into the buffer
                view.copy_(m.grad) if m.grad is not None else view.zero_()
                m.grad = view
        _kernel(_accumulate, self._grads.device)(self._master_grads, self._grads)

    @torch.no_grad()
    def refresh(self) -> None:
        """The copy := the masters, cast (after every optimizer step and every load of the masters):
        one multi-tensor copy (a few kernels, not one per weight)."""
        copies, masters = [c for _, c in self._pairs], [m for m, _ in self._pairs]
        try:
            torch._foreach_copy_(copies, masters)
        except (RuntimeError, NotImplementedError):  # a build without the multi-tensor copy of mixed dtypes
            for c, m in zip(copies, masters):
                c.copy_(m)


def export_state_dict(state_dict: dict[str, torch.Tensor], config, dtype: torch.dtype | str) -> dict[str, torch.Tensor]:
    """The weights rollout serves, in its dtype: Hugging Face names, a tied lm_head left out (the
    rollout model ties it to the embedding itself)."""
    dtype = as_dtype(dtype)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return {k: v.detach().to(dtype) for k, v in state_dict.items()
            if not (tied and k == "lm_head.weight") and not k.endswith("rotary_emb.inv_freq")}


def save_weights(config, state_dict: dict[str, torch.Tensor], folder: str | Path) -> None:
    """A Hugging Face folder (config.json + model.safetensors, float32) from full weights: what
    ``AutoModelForCausalLM.from_pretrained`` and the rollout engines load. Takes the gathered weights
    of a sharded model too, which ``save_pretrained`` cannot."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    tensors = export_state_dict(state_dict, config, torch.float32)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})


# -- log-probabilities ------------------------------------------------------------------------
def _capped(logits: torch.Tensor, softcap) -> torch.Tensor:
    """The head's logits as the sampler saw them before its temperature: soft-capped (in float32) where
    the model says so (Gemma 2's final_logit_softcapping), else as they are."""
    return torch.tanh(logits.float() / softcap) * softcap if softcap else logits


def _chunk_logprobs(logits, targets, temperature: float, softcap, entropy: bool):
    """(log p(targets), logsumexp, entropy or None) of one chunk: ``modeling.logprobs_of``, the rollout
    engines' own definition, with its normaliser kept for the backward."""
    z = scaled_logits(_capped(logits, softcap), temperature)
    lp, lse = logprobs_and_normaliser(z, targets)
    return lp, lse, (lse - (torch.exp(z - lse[:, None]) * z).sum(-1)) if entropy else None


def _chunk_grad_logits(logits, targets, lse, grad, temperature: float, softcap):
    """d(sum grad * log p(targets)) / d logits, in the logits' dtype: grad * (onehot - softmax), through
    the temperature and the soft cap. ``grad`` None: d log p(targets) / d logits itself (a grad of 1)."""
    z = scaled_logits(_capped(logits, softcap), temperature)
    hit = torch.arange(z.shape[-1], device=z.device)[None, :] == targets[:, None]
    d = hit.to(z.dtype) - torch.exp(z - lse[:, None])
    if grad is not None:
        d = d * grad[:, None]
    if temperature > 0 and temperature != 1:
        d = d / temperature
    if softcap:
        d = d * (1 - torch.tanh(logits.float() / softcap) ** 2)
    return d.to(logits.dtype)


def _chunk_logprobs_kept(logits, targets, temperature: float, softcap, entropy: bool):
    """``_chunk_logprobs`` and, from the same logits, d log p(targets) / d logits (what
    ``HeadLogprobs`` keeps for its backward instead of recomputing the chunk's logits there)."""
    lp, lse, ent = _chunk_logprobs(logits, targets, temperature, softcap, entropy)
    return lp, lse, ent, _chunk_grad_logits(logits, targets, lse, None, temperature, softcap)


_FUSED: dict = {}


def _kernel(fn, device: torch.device):
    """``fn`` compiled for a GPU, or ``fn`` itself on CPU. For the head's passes inductor fuses the
    cast, the soft cap, the temperature, the logsumexp and the gather into one pass over the chunk's
    logits (eager runs each as its own pass over a [chunk, vocab] float32 tensor). Shapes are static
    until one changes (torch's automatic dynamic shapes): the head's chunk length becomes dynamic (the
    last chunk of a micro-batch is shorter), and the vocabulary never does. Compiled for a dynamic
    vocabulary (every index a division by a runtime value) the two passes took 34 and 26 ms of an
    update at the 0.5B shape on an H200, 16 and 19 ms with it static (bench/RESULTS.md)."""
    if device.type != "cuda":
        return fn
    if fn not in _FUSED:
        _FUSED[fn] = torch.compile(fn, dynamic=None)
    return _FUSED[fn]


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    dev = weight.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype


class HeadLogprobs(torch.autograd.Function):
    """log p(targets[t] | hidden[t]) through the lm_head, a chunk of positions at a time, forward and
    backward, the weight's gradient summed over chunks in float32. With ``entropy`` the forward also
    returns each position's entropy (no gradient) from the same read of the logits. Written by hand
    because the loss of each token is PPO's, not a cross-entropy (the fused linear-cross-entropy
    kernels of Liger and others reduce to a scalar loss inside their forward). Under autocast the
    weight is cast once per call, not once per chunk.

    The backward of a chunk needs ``onehot - softmax`` of its logits (through temperature and soft
    cap), times the upstream gradient per position. Up to ``keep_bytes`` of it is made in the forward,
    from the logits the forward already has, and kept in the compute dtype: the backward of such a chunk
    is then two matmuls, the upstream gradient applied to the [chunk, hidden] side of each
    (d hidden = g * (D @ W), d W = D^T @ (g * hidden)). The chunks beyond the budget, and every chunk
    with ``keep_bytes`` 0, recompute their logits in backward (one more matmul and a pass over them):
    only one chunk's logits exist at a time. Keeping costs chunk x vocab x 2 bytes per chunk (5 GB
    for 16k positions at Qwen2's 152k vocabulary) and saves a quarter of the head's matmul work.
    Saves [tokens] float32 normalisers besides the inputs."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int, temperature: float, softcap, entropy: bool,
                keep_bytes: int = 0):
        cd = _compute_dtype(weight)
        w, b = weight.to(cd), (None if bias is None else bias.to(cd))
        h = hidden.to(cd)
        lp = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        lse = torch.empty_like(lp)
        ent = torch.empty_like(lp) if entropy else None
        fwd = _kernel(_chunk_logprobs, h.device)
        fwd_kept = _kernel(_chunk_logprobs_kept, h.device)
        budget = keep_bytes  # 0 where no backward comes: head_logprobs decides (needs_input_grad cannot)
        kept: list[torch.Tensor] = []  # d log p / d logits of the first len(kept) chunks
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], chunk):
                logits = torch.nn.functional.linear(h[s:s + chunk], w, b)
                size = logits.numel() * logits.element_size()
                if size <= budget and len(kept) == s // chunk:
                    e = fwd_kept(logits, targets[s:s + chunk], temperature, softcap, entropy)
                    kept.append(e[3])
                    budget -= size
                else:
                    e = fwd(logits, targets[s:s + chunk], temperature, softcap, entropy)
                del logits
                lp[s:s + chunk], lse[s:s + chunk] = e[0], e[1]
                if entropy:
                    ent[s:s + chunk] = e[2]
        ctx.save_for_backward(hidden, weight, bias, targets, lse, *kept)
        ctx.meta = (chunk, temperature, softcap, cd)
        if not entropy:
            return lp
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad, *_entropy_grad):
        hidden, weight, bias, targets, lse, *kept = ctx.saved_tensors
        chunk, temperature, softcap, cd = ctx.meta
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w, b = weight.to(cd), (None if bias is None else bias.to(cd))
        h = hidden.to(cd)
        gh = torch.empty_like(hidden) if need_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        bwd = _kernel(_chunk_grad_logits, h.device)
        grad = grad.float()
        with torch.autocast(h.device.type, enabled=False):
            for c, s in enumerate(range(0, h.shape[0], chunk)):
                hs, g = h[s:s + chunk], grad[s:s + chunk]
                if c < len(kept):  # d log p / d logits kept from the forward: the upstream gradient goes on
                    d = kept[c]    # the [chunk, hidden] side of each matmul
                    if gh is not None:
                        gh[s:s + chunk] = (d @ w).float() * g[:, None]
                    if gw is not None:
                        gw += d.t() @ (hs.float() * g[:, None]).to(cd)
                    if gb is not None:
                        gb += (g.to(cd)[None, :] @ d)[0].float()
                    continue
                d = bwd(torch.nn.functional.linear(hs, w, b), targets[s:s + chunk], lse[s:s + chunk], g,
                        temperature, softcap)
                if gh is not None:
                    gh[s:s + chunk] = d @ w
                if gw is not None:
                    gw += d.t() @ hs
                if gb is not None:
                    gb += d.sum(0, dtype=torch.float32)
        return (gh, None if gw is None else gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype),
                None, None, None, None, None, None)


def head_logprobs(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias=None, *,
                  temperature: float = 1.0, softcap=None, chunk: int = LOGIT_CHUNK_TOKENS,
                  entropy: bool = False, keep_bytes: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([N] log p(targets[t]) under ``scaled_logits(lm_head(hidden[t]))``, [N] entropy of that
    distribution (no gradient) or None) for hidden [N, d], targets [N]; differentiable in hidden,
    weight and bias (``HeadLogprobs``; ``keep_bytes``: its budget for gradients kept from the forward)."""
    # No backward to come (the proximal pass runs under no_grad, where a Function's forward still sees
    # its inputs' requires_grad): nothing to keep.
    wanted = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    out = HeadLogprobs.apply(hidden, weight, bias, targets, chunk, float(temperature), softcap, entropy,
                             int(keep_bytes) if wanted else 0)
    return out if entropy else (out, None)


class PackedLM(torch.nn.Module):
    """A transformers causal LM (``lm``) whose forward is the packed log-probabilities. It is the module
    the trainer calls, so a sharding wrapper put on it (FSDP2's root unit) gathers the embedding, the
    final norm and the lm_head for the whole computation, the chunked head included."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    @property
    def config(self):
        return self.lm.config

    def forward(self, ids, positions, cu, longest: int, temperature, chunk: int, entropy: bool,
                keep_bytes: int = 0, head=None):
        lm = self.lm
        decoder = getattr(lm, lm.base_model_prefix)
        hidden = decoder(input_ids=ids, position_ids=positions, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                         max_length_q=longest, max_length_k=longest).last_hidden_state[0]
        out = lm.get_output_embeddings()
        softcap = getattr(lm.config, "final_logit_softcapping", None)
        n = hidden.shape[0]
        if head is None:  # every position: token t from hidden t - 1
            rows, targets = hidden[:-1], ids[0, 1:]
        else:  # the named tokens only; sentinels (>= n) read the last position and land past the end
            real = head.clamp(max=n - 1)
            rows, targets = hidden[(real - 1).clamp(min=0)], ids[0, real]
        lp, ent = head_logprobs(rows, targets, out.weight, out.bias, temperature=temperature, softcap=softcap,
                                chunk=chunk, entropy=entropy, keep_bytes=keep_bytes)
        if head is None:
            zero = hidden.new_zeros(1, dtype=torch.float32)
            starts = positions[0] == 0
            lp = torch.cat([zero, lp]).masked_fill(starts, 0.0)
            ent = torch.cat([zero, ent]).masked_fill(starts, 0.0) if entropy else None
            return lp, ent
        # a copy, not the slice: FSDP2 hooks the root's outputs for backward, and an in-place op on a view
        # it returned would drop that hook (torch warns of it)
        spread = lambda v: hidden.new_zeros(n + head.numel(), dtype=torch.float32).index_copy(0, head, v)[:n].clone()
        return spread(lp), (spread(ent) if entropy else None)


def packed_logprobs(model, packed: Packed, temperature: float = 1.0, *, chunk: int = LOGIT_CHUNK_TOKENS,
                    entropy: bool = False, keep_bytes: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([N] log p(ids[t] | the sample's tokens before t), [N] entropy of that distribution or None).

    ``model``: a PackedLM, or a transformers causal LM. The entropy (with ``entropy``) carries no
    gradient; it comes from the same read of the logits as the log-probabilities. Entry t is 0 where
    token t starts a sample (nothing predicts it), and, for a micro-batch packed with ``loss_only``, where
    its loss weight is 0 (not computed). Differentiable in the model's parameters; the logits of one
    chunk of positions exist at a time, and backward recomputes them, except for the chunks whose logits'
    gradient fits in ``keep_bytes`` (made in the forward and kept: ``HeadLogprobs``)."""
    policy = model if isinstance(model, PackedLM) else PackedLM(model)
    return policy(packed.ids, packed.positions, packed.cu, packed.longest, temperature, chunk, entropy,
                  keep_bytes, packed.head)


def train_flops(n_params: int, layers: int, hidden: int, tokens: int, seq_sq_sum: int,
                proximal: tuple[int, int] | None = None, head: tuple[int, int, int] | None = None,
                adapter: int = 0) -> float:
    """FLOPs of one update over ``tokens`` real tokens: 6 N per token for forward and backward of the
    matmuls (N = parameters, a tied embedding counted once, as the lm_head matmul), causal attention's
    2 x layers x hidden x sum(len^2) per forward (x3 with backward), and one more forward for the
    proximal log-probabilities of ``proximal`` = (tokens, sum(len^2)) (default: all of them; the engine
    takes the first mini-batch's from its training forward). ``head`` = (the lm_head's parameters,
    the tokens whose log-probability the loss reads, those of them in the proximal pass): the head's
    matmul counted on those tokens only (the engine computes no other; None: on every token).
    ``adapter``: with LoRA, the adapters' parameters, and ``n_params`` the frozen base's: the base's
    matmuls cost 2 N per token forward and 2 N backward (the activations' gradients flow through them;
    no weight gradient is made), 4 N instead of 6 N; the adapters 6 per parameter and token as any
    trained weight (2 in the proximal forward); attention as without.
    Recomputation (the head's in backward, activation checkpointing) is not counted: MFU counts useful
    work."""
    hp, head_tokens, prox_head_tokens = head or (0, 0, 0)
    matmuls = lambda n, h: 2 * (n_params - hp) * n + 2 * hp * h  # one forward of the base's matmuls
    attention = lambda sq: 2 * layers * hidden * sq  # one forward
    prox = proximal or (tokens, seq_sq_sum)
    if head is None:
        head_tokens, prox_head_tokens = tokens, prox[0]
    passes = 2 if adapter else 3  # through the base's matmuls: forward, activation gradients, weight gradients
    return (passes * matmuls(tokens, head_tokens) + 3 * attention(seq_sq_sum) + 6 * adapter * tokens
            + matmuls(prox[0], prox_head_tokens) + attention(prox[1]) + 2 * adapter * prox[0])
