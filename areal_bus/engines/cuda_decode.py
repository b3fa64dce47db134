"""The torch engine's fast decode: a fixed-shape step over the static KV cache, replayed as CUDA graphs.

Eager decoding of a small model is bound by the CPU, not the GPU: a 24-layer step is ~900 kernel
launches, and a cache read through ``index_select`` copies every running slot's keys each layer. Here
one decode step is a function of fixed shapes that reads the cache in place, so it can be captured
once in a CUDA graph and replayed with a single launch:

- Rows are slots. Decode row ``r`` is cache slot ``r``, so a layer's attention reads
  ``cache.k[layer, :B, :, :L]``, a view, never a gather. ``B`` is the smallest batch bucket that holds the
  highest running slot (the engine hands out the lowest free slot, which keeps running slots dense);
  ``L`` the smallest length bucket that holds the furthest running position. One (B, L) pair is one
  graph, captured the first time it is needed and replayed after. All graphs share one memory pool
  and the same static inputs (token ids and positions, ``io``) and output (``logits``).
- Rows that are not decoding this step (free slots, bucket padding, sequences being prefilled) still
  run: their position is ``max_len - 1``, where they write a key and a value that nothing ever reads.
  A sequence ends once it holds ``max_len`` tokens, so the last position it feeds is ``max_len - 2``.
- With a paged cache (rollout_engine.kv_tokens, ``kv_pages``) rows are still slots, and the slots' block
  tables are a static input too: a row writes its key and value into its page, and reads its pages
  gathered ("sdpa", "matmul") or in place through FlashAttention's paged kernel ("flash_paged"). A row
  not decoding feeds position 0 of the null page instead.
- Keys past a row's own position are masked (an additive mask on SDPA); the query heads that share a
  kv head are grouped as that head's queries (``[B, KV, H / KV, D]``), so GQA needs no copy of keys.
- The q/k/v and the gate/up projections run as one matmul each over concatenated weights. Those are
  copies of the model's parameters: ``refresh()`` (the engine calls it after every weight swap)
  copies them again, in place, because a captured graph holds their addresses. With LoRA
  (trainer_engine.lora) each fused group adds its fused adapter (model/adapters.py: the A's stacked, the
  B's block-diagonal), copied in place at the same refresh; o_proj's and down_proj's adapters are buffers
  of their modules, which a swap overwrites in place.

- ``fuse`` (rollout_engine.decode_compile): the step's elementwise work between the matmuls (each RMSNorm
  with the residual add before it, the rotary embedding of q and k with Qwen3's q/k norms, SiLU x up)
  runs as kernels torch.compile fuses, each piece compiled once for every batch size (``dynamic``) and
  captured in the graphs like any kernel. Eager, one RMSNorm is seven kernels and the rotary embedding
  five per tensor, each reading and writing the activations: ~38 kernels a layer; fused, ~13. On one H100
  at batch 256 (0.5B shape) that took 1.4-1.6 ms of device time off a step of 4.7-7.6 ms (bench/RESULTS.md).
  The pieces compute what the model's modules do, in the same order and with the same casts
  (``emulate_precision_casts``), so the logits agree with the unfused step to rounding. It needs
  torch.compile's toolchain (Triton on CUDA, a C++ compiler on CPU), tried once when the decoder is made
  (so a missing one refuses to start, and ``static_decoder``'s automatic choice falls back), and costs a
  few seconds of compiling when the first graph is captured (8 s on that H100, graph captures included).

Prefill stays outside the graphs (the engine's batched, right-padded prefill through the model), and so
does everything after the logits: a grammar's token mask (``grammar``) and sampling (``sampling.sample``:
batched on the device, one transfer to the host per step).

On CPU the same step runs eagerly (``graphs=False``): that is what the CPU tests check against a
full forward pass. Quick check (CPU)::

    python -c "
    import numpy as np; from areal_bus.model.modeling import make_random_model, TINY_QWEN2
    from areal_bus.engines.torch_engine import TorchRolloutEngine; from areal_bus.wire.messages import GenerateRequest
    e = TorchRolloutEngine(make_random_model(TINY_QWEN2, 0, std=0.2), max_batch=2, max_len=64, eos_token_ids=[],
                           static_decode=True)
    e.add_request(GenerateRequest('r0', 'e0', 0, 0, 8, 0.0, np.array([1, 5, 7], np.int32)))
    while not (done := e.step()): pass
    print(done[0].output_ids, done[0].logprobs)"
"""

from __future__ import annotations

import bisect
import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from areal_bus.engines import kv_pages
from areal_bus.engines.kv_pages import PagedKVCache
from areal_bus.model import adapters, shared_base
from areal_bus.model.modeling import CausalLM, KVCache, RMSNorm, apply_rope, rms_norm, rope_cos_sin

# The smallest length bucket: below it attention costs nothing next to the weights, and fewer
# buckets mean fewer graphs to capture.
MIN_LEN_BUCKET = 256


def _add_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual stream ``x + delta`` and its RMSNorm: one fused kernel."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def _rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _norm_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float):
    """Qwen3: each head's queries and keys normalised, then rotated."""
    return apply_rope(rms_norm(q, q_weight, eps), cos, sin), apply_rope(rms_norm(k, k_weight, eps), cos, sin)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@functools.cache
def _fused(fn):
    """``fn`` compiled once per process for every batch size; the casts to the model's dtype kept where
    the eager modules make them, so fused and eager agree to rounding."""
    return torch.compile(fn, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})


def buckets(limit: int, first: int, per_doubling: int) -> list[int]:
    """Sizes from ``first`` up to ``limit`` (always included), ``per_doubling`` of them between two
    powers of two: padding to the next one wastes at most 1 / per_doubling of the work."""
    out, b = [], first
    while b < limit:
        out.append(b)
        b += max(1, (1 << (b.bit_length() - 1)) // per_doubling)
    return out + [limit]


# Decode attention. Every kind gets one step's queries grouped by kv head, q [b, kv, heads / kv, d], the
# layer's whole cache rows k, v [b, kv, max_len, d] (views), the length bucket and what its ``prepare``
# made once per step (from the decoder and the rows' positions [b]); it returns [b, kv, heads / kv, d].


def _mask(dec: StaticDecoder, pos: torch.Tensor, length: int) -> torch.Tensor:
    """Additive mask [b, 1, 1, length]: keys past a row's position are -inf (broadcast over kv heads and
    the grouped query heads)."""
    b = pos.shape[0]
    return torch.zeros(b, 1, 1, length, dtype=dec.dtype, device=pos.device).masked_fill_(
        (dec.key_pos[:length][None] > pos[:, None])[:, None, None], float("-inf"))


def _attend_sdpa(q, k, v, length, mask):
    return F.scaled_dot_product_attention(q, k[:, :, :length], v[:, :, :length], attn_mask=mask)


def _attend_matmul(q, k, v, length, mask):
    scores = (q @ k[:, :, :length].transpose(-1, -2)).float() * q.shape[-1] ** -0.5 + mask
    return scores.softmax(-1).to(v.dtype) @ v[:, :, :length]


def _varlen_inputs(dec: StaticDecoder, pos: torch.Tensor, length: int):
    """flash_varlen's per-step inputs for its sequences, the (row, kv head) pairs with kv heads fastest:
    the offsets of their queries and of their keys (views of the decoder's static ``arange``s, so the step
    launches nothing for them) and the keys each reads, int32: the row's position + 1, or 1 for a row not
    decoding (its position is max_len - 1, past every bucket, and nobody reads its output). ``expand``,
    not ``repeat_interleave``: that one syncs with the host, which a CUDA graph capture cannot; then
    ``contiguous``, which the kernel requires and a reshape alone does not give for one row (a stride-0 view)."""
    b, kv = pos.shape[0], dec.kv_heads
    used = torch.where(pos == dec.max_len - 1, 1, pos + 1).to(torch.int32)
    return (dec.cu_queries[:b * kv + 1], dec.cu_keys[:b * kv + 1],
            used[:, None].expand(b, kv).contiguous().view(b * kv))


def _attend_flash_varlen(q, k, v, length, prepared):
    """FlashAttention-2's variable-length kernel (torch's own build) over the cache as it lies: each (row,
    kv head) is one sequence, its ``max_len`` cache slots the keys of which the first ``seqused`` are read,
    and the heads / kv query heads that share the kv head its queries (as the grouped SDPA call has them:
    one block reads the keys once for all of them). The work is each row's own length, not the bucket's
    for every row: on a long tail, where one long sequence sets the bucket, most rows are far shorter. No
    mask is built. CUDA in bfloat16 or float16 only (``StaticDecoder`` checks); on CPU the same
    computation in plain torch (``varlen_reference``), with which the CPU tests check the arithmetic."""
    b, kv, group, d = q.shape
    rows, max_len = b * kv, k.shape[2]
    cu_q, cu_k, seqused = prepared
    qs = q.reshape(rows * group, 1, d)
    ks, vs = k.view(rows * max_len, 1, d), v.view(rows * max_len, 1, d)  # the cache rows, not a copy
    if q.is_cuda:
        out = torch.ops.aten._flash_attention_forward(qs, ks, vs, cu_q, cu_k, group, length, 0.0, False, False,
                                                      seqused_k=seqused)[0]
    else:
        out = varlen_reference(qs, ks, vs, cu_q, cu_k, seqused, group, length)
    return out.view(b, kv, group, d)


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     seqused: torch.Tensor, max_q: int, max_k: int) -> torch.Tensor:
    """What FlashAttention's varlen forward computes without a causal mask, in plain torch, one head: q
    [total_q, 1, d] holding sequence j's queries from ``cu_q[j]`` to ``cu_q[j + 1]`` (at most ``max_q``),
    k and v [total_k, 1, d] its keys from ``cu_k[j]``, of which the first ``seqused[j]`` (at most
    ``max_k``) are attended; softmax scale 1/sqrt(d). Returns [total_q, 1, d]. Refuses what the kernel
    refuses of its offsets and key counts (non-contiguous), so CPU tests meet it too."""
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k), ("seqused_k", seqused)):
        if not t.is_contiguous():
            raise RuntimeError(f"{name} must be contiguous")
    n = seqused.shape[0]
    steps_q, steps_k = torch.arange(max_q, device=q.device), torch.arange(max_k, device=q.device)
    q_at = cu_q[:n, None].long() + steps_q[None]  # [n, max_q] rows of q
    q_in = q_at < cu_q[1:, None]
    k_at = (cu_k[:n, None].long() + steps_k[None]).clamp_(max=k.shape[0] - 1)  # [n, max_k] rows of k
    queries = q[q_at.clamp(max=q.shape[0] - 1), 0].float()  # [n, max_q, d]
    scores = queries @ k[k_at, 0].float().transpose(1, 2) * q.shape[-1] ** -0.5  # [n, max_q, max_k]
    scores = scores.masked_fill(~(steps_k[None] < seqused[:, None])[:, None], float("-inf"))
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    out[q_at[q_in], 0] = (scores.softmax(-1) @ v[k_at, 0].float())[q_in]
    return out.to(q.dtype)


ATTENTION = {"sdpa": (_mask, _attend_sdpa), "matmul": (_mask, _attend_matmul),
             "flash_varlen": (_varlen_inputs, _attend_flash_varlen)}


def _paged_inputs(dec: StaticDecoder, pos: torch.Tensor, length: int):
    """flash_paged's per-step inputs: the keys each row reads (its position + 1; 1 for a row not decoding,
    whose position is 0 and whose block table is the null page's) and the varlen offsets (static views)."""
    b = pos.shape[0]
    return (pos + 1).to(torch.int32), dec.cu_queries[:b + 1], dec.cu_keys[:b + 1]


# With a paged cache (kv_pages): the masked kinds read the rows' pages gathered (kv_pages.gather), flash_paged
# reads the pool in place (kv_pages.attend_flash, which StaticDecoder._attention calls).
PAGED_ATTENTION = {"sdpa": (_mask, _attend_sdpa), "matmul": (_mask, _attend_matmul),
                   "flash_paged": (_paged_inputs, None)}


def decode_choices(attention: str, fuse: bool | None, cuda: bool, half: bool,
                   paged: bool = False) -> list[tuple[str, bool]]:
    """(attention, fuse) pairs to try in turn: what was asked, with "auto" attention as flash_varlen
    (flash_paged with a paged cache) where the cache is bfloat16/float16 on CUDA (else sdpa) and None
    fusion as on on CUDA; then, for what was chosen automatically only, sdpa and unfused as fallbacks. A
    choice asked for explicitly has none."""
    flash = "flash_paged" if paged else "flash_varlen"
    attn = (flash if cuda and half else "sdpa") if attention == "auto" else attention
    fz = cuda if fuse is None else fuse
    attns = [attn, "sdpa"] if attention == "auto" else [attn]
    fuses = [fz, False] if fuse is None else [fz]
    return list(dict.fromkeys((a, f) for f in fuses for a in attns))


def static_decoder(model: CausalLM, cache: KVCache | PagedKVCache, graphs: bool = False, attention: str = "auto",
                   fuse: bool | None = None, batch_buckets: list[int] | None = None,
                   len_buckets: list[int] | None = None, warn: Callable[[str], None] | None = None) -> StaticDecoder:
    """A ``StaticDecoder`` with ``attention`` "auto" and ``fuse`` None chosen here (rollout_engine's
    defaults, ``decode_choices``): flash_varlen and fused on CUDA in half precision. On one H100
    (bench/RESULTS.md, session 30) the two made the long-tail headline's synchronous run 1.95x and its
    asynchronous one 1.56x faster than sdpa unfused. An automatic choice that refuses here (a torch
    build without FlashAttention's varlen kernel, no Triton, norms the fusion does not compute) falls
    back to the next, naming why through ``warn``; the last one's refusal is raised."""
    tries = decode_choices(attention, fuse, cache.k.device.type == "cuda",
                           cache.k.dtype in (torch.bfloat16, torch.float16), isinstance(cache, PagedKVCache))
    for i, (attn, fz) in enumerate(tries):
        try:
            return StaticDecoder(model, cache, graphs=graphs, attention=attn, fuse=fz,
                                 batch_buckets=batch_buckets, len_buckets=len_buckets)
        except (RuntimeError, ValueError) as exc:
            if i == len(tries) - 1:
                raise
            if warn is not None:
                (a, f), (b, g) = tries[i], tries[i + 1]
                warn(f"decode step {a}{'+compile' * f} refused ({exc}); trying {b}{'+compile' * g}")
    raise AssertionError("unreachable: the last choice returns or raises")


class StaticDecoder:
    """Decode steps over ``cache`` for ``model``: ``decode(slots, ids, positions)`` -> logits.

    ``graphs``: capture each (batch bucket, length bucket) step in a CUDA graph (CUDA only).
    ``attention``: "sdpa" (fused, memory-efficient kernel on CUDA, over the length bucket with a mask),
    "matmul" (two batched matmuls, the same) or "flash_varlen" (FlashAttention-2's varlen kernel over each
    row's own length: ``_attend_flash_varlen``; bfloat16 or float16 on CUDA, plain torch on CPU; checked
    against the masked call once, here, before any decode).
    ``fuse``: the elementwise work between the matmuls as torch.compile's fused kernels (the module
    docstring).
    With a paged cache (``kv_pages.PagedKVCache``) rows are still slots, and each slot's block table is a
    static input too: "sdpa" and "matmul" read the rows' pages gathered, "flash_paged" FlashAttention's
    paged kernel over the pool (its only length bucket is the table's span: it reads each row's own length).
    ``batch_buckets`` / ``len_buckets``: the padded shapes (default: 4 per doubling of the batch,
    2 per doubling of the length from ``MIN_LEN_BUCKET``).
    """

    def __init__(self, model: CausalLM, cache: KVCache | PagedKVCache, graphs: bool = False, attention: str = "sdpa",
                 fuse: bool = False, batch_buckets: list[int] | None = None, len_buckets: list[int] | None = None):
        cfg = model.cfg
        self.model, self.cache, self.cfg = model, cache, cfg
        self.device, self.dtype = cache.k.device, cache.k.dtype
        self.paged = isinstance(cache, PagedKVCache)
        # paged: positions up to the block table's span; a row not decoding feeds position 0 of the null page
        self.max_batch, self.max_len = ((cache.max_batch, cache.span) if self.paged
                                        else (cache.k.shape[1], cache.max_len))
        self.idle_pos = 0 if self.paged else self.max_len - 1
        if graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.graphs = graphs
        kinds = PAGED_ATTENTION if self.paged else ATTENTION
        if attention not in kinds:
            raise ValueError(f"attention {attention!r} with a {'paged' if self.paged else 'dense'} KV cache "
                             f"(rollout_engine.kv_tokens): one of {', '.join(kinds)}")
        if attention == "flash_varlen" and self.device.type == "cuda" and self.dtype not in (torch.bfloat16,
                                                                                              torch.float16):
            raise ValueError(f"attention 'flash_varlen' runs FlashAttention in bfloat16 or float16, not {self.dtype}")
        if attention == "flash_varlen" and self.max_batch * cfg.num_key_value_heads * self.max_len >= 2 ** 31:
            raise ValueError("attention 'flash_varlen' addresses the cache with int32 offsets: max_batch x kv heads "
                             "x max_len must stay below 2^31")
        self.attention = attention
        self.prepare, self.attend = kinds[attention]
        if attention == "flash_paged":
            self.kernel = kv_pages.paged_kernel()
            kv_pages.check_flash(self.kernel, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim,
                                 cache.page_size, self.device, self.dtype)
        self.fuse = fuse
        if fuse:
            layers = model.model.layers
            norms = [model.model.norm] + [n for layer in layers
                                          for n in (layer.input_layernorm, layer.post_attention_layernorm)]
            if cfg.qk_norm:
                norms += [n for layer in layers for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)]
            if not all(type(n) is RMSNorm for n in norms):
                raise ValueError("decode fusion computes areal_bus.model.modeling.RMSNorm; this model has other norms")
            try:  # compiled here, not at the first decode step, so a missing toolchain refuses to start
                _fused(_silu_mul)(torch.zeros(2, 2 * cfg.intermediate_size, device=cache.k.device,
                                              dtype=cache.k.dtype))
            except Exception as exc:  # torch.compile fails in many types (missing Triton, no C++ compiler)
                raise RuntimeError(f"decode fusion needs torch.compile, which fails here: "
                                   f"{type(exc).__name__}: {str(exc)[:300]}") from exc
        self.batch_buckets = sorted(batch_buckets or buckets(self.max_batch, 1, 4))
        self.len_buckets = sorted(len_buckets or buckets(self.max_len, min(MIN_LEN_BUCKET, self.max_len), 2))
        if self.paged:  # whole pages (the gather reads pages); flash_paged needs no bucket but the span
            size = cache.page_size
            self.len_buckets = ([self.max_len] if attention == "flash_paged" else
                                sorted({min(-(-n // size) * size, self.max_len) for n in self.len_buckets}))
        if self.batch_buckets[-1] != self.max_batch or self.len_buckets[-1] != self.max_len:
            raise ValueError("the largest buckets must be max_batch and max_len")
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.splits = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        dev = self.device
        # Static inputs (per row: token id, position) and output, shared by every graph. Rows are
        # filled in a host buffer (pinned on CUDA, so the copy is one asynchronous memcpy).
        self.io = torch.zeros(self.max_batch, 2, dtype=torch.long, device=dev)
        self._stage_t = torch.zeros(self.max_batch, 2, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._stage = self._stage_t.numpy()
        if self.paged:  # the slots' block tables, staged the same way (a row not decoding: all null page)
            self.table = torch.zeros(self.max_batch, cache.max_pages, dtype=torch.int32, device=dev)
            self._table_stage_t = torch.zeros(self.max_batch, cache.max_pages, dtype=torch.int32,
                                              pin_memory=dev.type == "cuda")
            self._table_stage = self._table_stage_t.numpy()
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None
        self.logits = torch.empty(self.max_batch, cfg.vocab_size, dtype=self.dtype, device=dev)
        self.key_pos = torch.arange(self.max_len, device=dev)
        # flash_varlen's sequence offsets, for every batch bucket at once (_varlen_inputs takes views);
        # flash_paged's: one sequence per row, its keys the row's block table's span.
        seqs = torch.arange(self.max_batch * self.kv_heads + 1, dtype=torch.int32, device=dev)
        self.cu_queries, self.cu_keys = seqs * (self.heads // self.kv_heads), seqs * self.max_len
        if self.paged:
            self.cu_queries = seqs[:self.max_batch + 1]
        # The same values rope_cos_sin gives the model's own forward (computed in float32, then cast).
        cos, sin = rope_cos_sin(self.key_pos[None], cfg, self.dtype)
        self.cos, self.sin = cos[0, 0], sin[0, 0]  # [max_len, head_dim]
        with torch.no_grad():
            self.w_qkv, self.b_qkv, self.w_gate_up = [], [], []
            # LoRA adapters (model/adapters.py) of the fused q/k/v and gate/up matmuls: one fused adapter each,
            # None without; o_proj's and down_proj's run inside their modules
            self.lora_qkv, self.lora_gate_up = [], []
            for layer in model.model.layers:
                a, m = layer.self_attn, layer.mlp
                # fused_rows: a view, not a copy, where the parts are rows of one buffer (a shared base)
                self.w_qkv.append(shared_base.fused_rows([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
                self.b_qkv.append(shared_base.fused_rows([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
                                  if a.q_proj.bias is not None else None)
                self.w_gate_up.append(shared_base.fused_rows([m.gate_proj.weight, m.up_proj.weight]))
                self.lora_qkv.append(adapters.fuse([a.q_proj, a.k_proj, a.v_proj]))
                self.lora_gate_up.append(adapters.fuse([m.gate_proj, m.up_proj]))
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        if attention == "flash_varlen":
            self._check_against_masked_attention()

    def _check_against_masked_attention(self) -> None:
        """One flash_varlen call on random keys against the masked SDPA call, before any decode: a torch
        build whose kernel ignored ``seqused_k`` (or rejected these shapes) would otherwise sample every
        token from wrong logits, silently. Refuses to start, naming the difference, instead."""
        gen = torch.Generator().manual_seed(0)
        b, kv, group, d = min(3, self.max_batch), self.kv_heads, self.heads // self.kv_heads, self.head_dim
        length = self.len_buckets[0]
        q = torch.randn(b, kv, group, d, generator=gen).to(self.device, self.dtype)
        k, v = torch.randn(2, b, kv, self.max_len, d, generator=gen).to(self.device, self.dtype)
        # the last position a row feeds within the bucket, the first, one between (max_len - 1 is a row
        # not decoding, which the two kinds treat differently and nobody reads)
        pos = torch.tensor([min(length, self.max_len - 1) - 1, 0, length // 2][:b], device=self.device)
        worst = 0.0
        try:
            with torch.no_grad(), self._sdpa_backends():
                for n in sorted({1, b}):  # one row too: its inputs are shaped otherwise (the tail of a batch)
                    args = q[:n], k[:n], v[:n], length
                    got = ATTENTION["flash_varlen"][1](*args, _varlen_inputs(self, pos[:n], length)).float()
                    want = _attend_sdpa(*args, _mask(self, pos[:n], length)).float()
                    worst = max(worst, float((got - want).abs().max()))
        except RuntimeError as exc:
            raise RuntimeError(f"decode attention 'flash_varlen' does not run here ({exc}); use 'sdpa'") from exc
        if not worst <= (0.05 if self.dtype in (torch.bfloat16, torch.float16) else 1e-4):
            raise RuntimeError(f"decode attention 'flash_varlen' differs from the masked attention by {worst:.3g} "
                               f"on this machine (torch {torch.__version__}); use 'sdpa'")

    @property
    def captured(self) -> list[tuple[int, int]]:
        """The (batch, length) buckets captured so far."""
        return sorted(self._graphs)

    def refresh(self) -> None:
        """Copy the model's q/k/v and gate/up weights into the fused ones (after a weight swap). With LoRA
        adapters a swap writes the adapters alone (adapters.load_weights): the base, fixed for the run, is
        not copied again."""
        base = not adapters.adapted(self.model)
        with torch.inference_mode():
            for i, layer in enumerate(self.model.model.layers):
                a, m = layer.self_attn, layer.mlp
                if base:
                    torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], out=self.w_qkv[i])
                    if self.b_qkv[i] is not None:
                        torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], out=self.b_qkv[i])
                    torch.cat([m.gate_proj.weight, m.up_proj.weight], out=self.w_gate_up[i])
                adapters.refresh([a.q_proj, a.k_proj, a.v_proj], self.lora_qkv[i])
                adapters.refresh([m.gate_proj, m.up_proj], self.lora_gate_up[i])

    def decode(self, slots: list[int], ids: list[int], positions: list[int]) -> torch.Tensor:
        """Feed token ``ids[i]`` at ``positions[i]`` of cache slot ``slots[i]``; logits [len(slots), V]
        in the order given (a view of the static output when the slots are 0..n-1 in order)."""
        b = self.batch_buckets[bisect.bisect_left(self.batch_buckets, max(slots) + 1)]
        length = self.len_buckets[bisect.bisect_left(self.len_buckets, max(positions) + 1)]
        # Streams, events and captures below act on the current device: make it this cache's.
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            self._step(b, length, slots, ids, positions)
        if slots == list(range(len(slots))):
            return self.logits[:len(slots)]
        return self.logits[torch.as_tensor(slots, device=self.device)]

    def _step(self, b: int, length: int, slots: list[int], ids: list[int], positions: list[int]) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the host buffer
        stage = self._stage[:b]
        stage[:, 0] = 0
        stage[:, 1] = self.idle_pos  # rows not decoding write where nothing reads
        stage[slots, 0] = ids
        stage[slots, 1] = positions
        self.io[:b].copy_(self._stage_t[:b], non_blocking=True)
        if self.paged:
            table = self._table_stage[:b]
            table[:] = 0
            table[slots] = self.cache.table[slots]
            self.table[:b].copy_(self._table_stage_t[:b], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if not self.graphs:
            self._forward(b, length)
        elif (b, length) in self._graphs:
            self._graphs[b, length].replay()
        else:
            self._graphs[b, length] = self._capture(b, length)
            self._graphs[b, length].replay()

    def _capture(self, b: int, length: int) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream first (cuBLAS workspaces, kernel selection), as torch's docs ask.
        # The warm-up runs write the same keys/values the replay will: same tokens, same positions.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(b, length)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA call (none expected) must not invalidate the capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._forward(b, length)
        if self._pool is None:
            self._pool = graph.pool()
        return graph

    def _where(self, pos: torch.Tensor, length: int):
        """Once per step: where each row's key and value go (dense: its position in its slot; paged: the flat
        index of its page's slot in the pool) and what ``prepare`` makes for the attention."""
        b = pos.shape[0]
        if not self.paged:
            write = pos.view(b, 1, 1, 1).expand(b, self.kv_heads, 1, self.head_dim)
        else:
            size = self.cache.page_size
            write = self.table[:b].gather(1, (pos // size)[:, None])[:, 0].long() * size + pos % size
        return write, self.prepare(self, pos, length)

    def _attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, where):
        """Layer ``i``: write the rows' key and value to the cache, attend; q [b, heads, d], k [b, kv, d],
        v [b, kv x d]; returns [b, kv, heads / kv, d]."""
        b, kv, d = k.shape
        write, prepared = where
        grouped = q.view(b, kv, self.heads // kv, d)
        if not self.paged:
            k_cache, v_cache = self.cache.k[i, :b], self.cache.v[i, :b]  # [b, kv, max_len, d], views
            k_cache.scatter_(2, write, k[:, :, None])
            v_cache.scatter_(2, write, v.reshape(b, kv, 1, d))
            return self.attend(grouped, k_cache, v_cache, length, prepared)
        k_pool, v_pool = self.cache.k[i], self.cache.v[i]
        kv_pages.write(k_pool, write, k)
        kv_pages.write(v_pool, write, v.view(b, kv, d))
        if self.attention == "flash_paged":
            used, cu_q, cu_k = prepared
            out = kv_pages.attend_flash(q, k_pool, v_pool, self.table[:b], used, cu_q, cu_k, self.kernel)
            return out.view(b, kv, self.heads // kv, d)
        table = self.table[:b, :length // self.cache.page_size]
        return self.attend(grouped, kv_pages.gather(k_pool, table, length), kv_pages.gather(v_pool, table, length),
                           length, prepared)

    def _forward(self, b: int, length: int) -> None:
        """One decode step for rows 0..b-1 reading keys 0..length-1: logits into ``self.logits[:b]``."""
        if self.fuse:
            return self._forward_fused(b, length)
        model = self.model
        h_, kv, d = self.heads, self.kv_heads, self.head_dim
        ids, pos = self.io[:b, 0], self.io[:b, 1]
        x = model.model.embed_tokens(ids)  # [b, hidden]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [b, 1, d]
        where = self._where(pos, length)  # where the step writes, and the mask or flash's offsets and key counts
        with self._sdpa_backends():
            for i, layer in enumerate(model.model.layers):
                attn = layer.self_attn
                h = layer.input_layernorm(x)
                qkv = adapters.add(F.linear(h, self.w_qkv[i], self.b_qkv[i]), h, self.lora_qkv[i])
                q, k, v = qkv.split(self.splits, dim=-1)
                q, k = q.view(b, h_, d), k.view(b, kv, d)
                if attn.qk_norm:  # Qwen3
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                o = self._attention(i, q, k, v, length, where)
                x = x + attn.o_proj(o.reshape(b, h_ * d))
                h = layer.post_attention_layernorm(x)
                gate, up = adapters.add(F.linear(h, self.w_gate_up[i]), h, self.lora_gate_up[i]).chunk(2, dim=-1)
                x = x + layer.mlp.down_proj(F.silu(gate) * up)
        torch.mm(model.model.norm(x), model.lm_head.weight.t(), out=self.logits[:b])

    def _forward_fused(self, b: int, length: int) -> None:
        """``_forward`` with each residual add and the RMSNorm after it, the rotary embedding (with
        Qwen3's q/k norms) and SiLU x up as fused kernels: the same arithmetic, fewer kernels."""
        model = self.model
        h_, kv, d = self.heads, self.kv_heads, self.head_dim
        add_norm, silu_mul = _fused(_add_norm), _fused(_silu_mul)
        rope = _fused(_norm_rope_qk if self.cfg.qk_norm else _rope_qk)
        ids, pos = self.io[:b, 0], self.io[:b, 1]
        x = model.model.embed_tokens(ids)  # [b, hidden]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [b, 1, d]
        where = self._where(pos, length)
        delta = torch.zeros_like(x)  # what the previous layer adds to the stream (none before the first)
        with self._sdpa_backends():
            for i, layer in enumerate(model.model.layers):
                attn, norm = layer.self_attn, layer.input_layernorm
                x, h = add_norm(x, delta, norm.weight, norm.eps)
                qkv = adapters.add(F.linear(h, self.w_qkv[i], self.b_qkv[i]), h, self.lora_qkv[i])
                q, k, v = qkv.split(self.splits, dim=-1)
                q, k = q.view(b, h_, d), k.view(b, kv, d)
                if attn.qk_norm:
                    q, k = rope(q, k, cos, sin, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
                else:
                    q, k = rope(q, k, cos, sin)
                o = self._attention(i, q, k, v, length, where)
                norm = layer.post_attention_layernorm
                x, h = add_norm(x, attn.o_proj(o.reshape(b, h_ * d)), norm.weight, norm.eps)
                delta = layer.mlp.down_proj(silu_mul(adapters.add(F.linear(h, self.w_gate_up[i]), h,
                                                                  self.lora_gate_up[i])))
            norm = model.model.norm
            _, h = add_norm(x, delta, norm.weight, norm.eps)
        torch.mm(h, model.lm_head.weight.t(), out=self.logits[:b])

    def _sdpa_backends(self):
        # With a mask, flash attention is out; keep cuDNN out too (it builds a plan per shape and its
        # graph capture is the least travelled path): the memory-efficient kernel, else math.
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
