"""The torch rollout engine's paged KV cache: one pool of pages that the running sequences take as they grow.

A dense cache (``modeling.KVCache``) holds ``max_batch x max_len`` tokens whatever runs: at a Llama-3.1-8B
shape (131 KB of keys and values a token) 256 slots of 3,200 tokens are 107 GB, though long-tailed outputs
average ~650 tokens. ``PagedKVCache`` holds ``tokens`` (rollout_engine.kv_tokens) in pages of ``page_size``
tokens (rollout_engine.kv_page_tokens). A sequence takes a page when its next token needs one and gives all
of them back when it ends, so what bounds the running batch is the tokens its sequences hold, as in vLLM.

Layout: ``k``, ``v`` [layers, pages + 1, page_size, kv_heads, head_dim]: a layer's pool is the shape
FlashAttention's paged kernel reads ([num_blocks, page_block_size, kv_heads, head_dim]). Page 0 is the null
page: never handed out, it is where every unused entry of the block table points, so the writes nobody
reads (a right-padded prefill's pad positions past a row's pages, the rows of a fixed-shape decode step
that are not decoding) land there. ``table`` [max_batch, max_pages] (int32, on the host) maps each slot's
logical pages to physical ones; a freed slot's row is zeroed.

When the pool runs out (the engine's policy, torch_engine.TorchRolloutEngine._admit):
- A request is admitted with the pages its tokens need now, not prompt + max_tokens: reserving for the
  longest possible output is the dense cache again, one sequence at a time. A request that cannot get
  them waits in the engine's queue (it counts against max_batch, as a running one does) and is never
  refused; the queue is first in, first out, so short prompts do not starve a long one.
- A running sequence that needs its next page when none is free preempts the youngest running sequence
  (vLLM's recompute preemption, possibly itself): its pages go back, it returns to the front of the
  queue with everything it has (tokens, logprobs, versions, a grammar's state), and when pages free up
  it is prefilled again from its tokens and carries on. Recompute rather than a copy to host memory:
  one prefill of a few hundred tokens costs a few decode steps and needs no host buffers; the youngest,
  because it has the least work to redo and because the oldest can always run to its end (the pool holds
  at least one ``max_len`` sequence, checked here), so the engine never deadlocks. No request is admitted
  in a step that preempted (it would be the next one preempted). The keys/values a re-prefill computes
  are those of the weights in force then (as ``recompute_kv_on_swap`` makes them); the tokens already
  sampled keep their versions.

Attention over pages: the model's forward (prefill, and the eager decode path) reads a row's pages through
``PagedView`` (a gather of its pages); the fixed-shape decode step (cuda_decode.StaticDecoder) takes a
block table as a static input and either gathers the pages into the [rows, kv, length, d] layout its
masked kernels read ("sdpa", "matmul") or runs FlashAttention's paged kernel over the pool in place
("flash_paged": ``attend_flash``; FlashAttention-2 needs pages of a multiple of 256 tokens).

Quick check (CPU)::

    python -c "
    import numpy as np; from areal_bus.model.modeling import make_random_model, TINY_QWEN2
    from areal_bus.engines.torch_engine import TorchRolloutEngine; from areal_bus.wire.messages import GenerateRequest
    e = TorchRolloutEngine(make_random_model(TINY_QWEN2, 0, std=0.2), max_batch=4, max_len=64, eos_token_ids=[],
                           kv_tokens=64, kv_page_tokens=8)
    e.add_request(GenerateRequest('r0', 'e0', 0, 0, 8, 0.0, np.array([1, 5, 7], np.int32)))
    while not (done := e.step()): pass
    print(done[0].output_ids, e.cache.free_pages)"
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import numpy as np
import torch

FLASH_PAGE_MULTIPLE = 256
"""FlashAttention-2's paged kernel (torch's own build and the flash-attn 2.x package) reads pages of a
multiple of this many tokens, and refuses others."""


class PagedKVCache:
    """``n_pages`` pages of ``page_size`` tokens (enough for ``tokens``) shared by ``max_batch`` slots, each
    sequence at most ``max_len`` tokens. ``grow(slot, n)`` gives a slot pages for its first ``n`` tokens
    (False, taking nothing, when the pool has too few); ``release(slot)`` takes them back."""

    def __init__(self, cfg, max_batch: int, max_len: int, tokens: int, page_size: int, device, dtype: torch.dtype):
        if page_size < 1:
            raise ValueError(f"rollout_engine.kv_page_tokens={page_size}: need at least 1")
        self.page_size, self.max_batch, self.max_len = page_size, max_batch, max_len
        self.max_pages = -(-max_len // page_size)  # the pages of one max_len sequence
        self.n_pages = -(-tokens // page_size)
        if self.n_pages < self.max_pages:
            raise ValueError(f"rollout_engine.kv_tokens={tokens} holds {self.n_pages} pages of {page_size} tokens; "
                             f"one sequence of max_len={max_len} needs {self.max_pages}: give it at least "
                             f"{self.max_pages * page_size} (or lower max_len)")
        shape = (cfg.num_hidden_layers, self.n_pages + 1, page_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.table = np.zeros((max_batch, self.max_pages), dtype=np.int32)
        self.held = [0] * max_batch  # pages each slot holds
        self._free = list(range(self.n_pages, 0, -1))  # a stack: the lowest page first
        self._table_t = torch.zeros(max_batch, self.max_pages, dtype=torch.int32, device=device)
        self._stale = False  # the device copy of the table lags the host's

    @property
    def span(self) -> int:
        """Token positions one slot's block table spans (max_len rounded up to whole pages)."""
        return self.max_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def grow(self, slot: int, tokens: int) -> bool:
        """Pages for ``slot``'s first ``tokens`` tokens; False (taking none) if the pool has too few."""
        have, need = self.held[slot], self.pages_for(tokens)
        if need <= have:
            return True
        if need - have > len(self._free):
            return False
        for j in range(have, need):
            self.table[slot, j] = self._free.pop()
        self.held[slot] = need
        self._stale = True
        return True

    def release(self, slot: int) -> None:
        n = self.held[slot]
        self._free += self.table[slot, :n][::-1].tolist()
        self.table[slot, :n] = 0
        self.held[slot] = 0
        self._stale = True

    def device_table(self) -> torch.Tensor:
        """The block table on the cache's device (copied when it changed)."""
        if self._stale:
            self._table_t.copy_(torch.from_numpy(self.table))
            self._stale = False
        return self._table_t

    def view(self, slots: torch.Tensor, positions: torch.Tensor, length: int) -> PagedView:
        """What one forward of the model (``modeling.CausalLM.hidden_states``) reads and writes."""
        return PagedView(self, self.device_table()[slots].long(), positions, length)


@dataclass(slots=True)
class PagedView:
    """The model's cache view over pages: tokens at ``positions`` [B, T] of the rows whose block tables are
    ``table`` [B, max_pages] (int64), attending over keys 0..length-1."""

    cache: PagedKVCache
    table: torch.Tensor
    positions: torch.Tensor
    length: int

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        # k, v [B, kv_heads, T, D] -> each token's (page, offset); a pad position past a row's pages reads
        # a zero table entry: the null page
        size = self.cache.page_size
        page, at = self.table.gather(1, self.positions // size), self.positions % size
        self.cache.k[layer][page, at] = k.transpose(1, 2)
        self.cache.v[layer][page, at] = v.transpose(1, 2)
        if k.shape[2] == self.length:  # consecutive positions reaching length - 1 in T tokens: 0..T-1, its own
            return k, v
        n = -(-self.length // size)
        return (gather(self.cache.k[layer], self.table[:, :n], self.length),
                gather(self.cache.v[layer], self.table[:, :n], self.length))


def gather(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """Rows' keys (or values) [B, kv, length, d] from a layer's ``pool`` [pages, size, kv, d] through their
    block tables ``table`` [B, n] (n x size >= length): a copy, in the layout the masked kernels read."""
    b, n = table.shape
    _, size, kv, d = pool.shape
    return pool[table.long()].view(b, n * size, kv, d)[:, :length].transpose(1, 2)


def write(pool: torch.Tensor, at: torch.Tensor, x: torch.Tensor) -> None:
    """One token per row into a layer's ``pool`` [pages, size, kv, d]: ``x`` [B, kv, d] at flat token
    indices ``at`` [B] (page x size + offset). In place, fixed shapes: a CUDA graph captures it."""
    pool.view(-1, *pool.shape[2:]).index_copy_(0, at, x)


def paged_kernel() -> str | None:
    """FlashAttention's paged kernel here: "torch" (torch's own build, when its
    ``_flash_attention_forward`` takes a block table), "flash_attn" (the flash-attn 2.x package), or None."""
    if "block_table" in str(torch.ops.aten._flash_attention_forward.default._schema):
        return "torch"
    return "flash_attn" if importlib.util.find_spec("flash_attn") is not None else None  # optional, GPU hosts


def attend_flash(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                 used: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, kernel: str | None) -> torch.Tensor:
    """One query per row over its pages, in place: q [B, heads, d] (heads grouped over the pools' kv heads
    as in GQA), ``table`` [B, n] int32 block tables, ``used`` [B] int32 keys each row reads; cu_q / cu_k
    the varlen offsets torch's kernel takes (0..B, and 0, n x size, ...). Returns [B, heads, d]. On CPU
    (``q`` not CUDA) the same computation in plain torch (``paged_reference``)."""
    if not q.is_cuda:
        return paged_reference(q, k_pool, v_pool, table, used)
    if kernel == "torch":
        span = table.shape[1] * k_pool.shape[1]
        return torch.ops.aten._flash_attention_forward(q, k_pool, v_pool, cu_q, cu_k, 1, span, 0.0, False, False,
                                                       seqused_k=used, block_table=table)[0]
    from flash_attn import flash_attn_with_kvcache  # lazy: an optional package (paged_kernel chose it)

    return flash_attn_with_kvcache(q[:, None], k_pool, v_pool, cache_seqlens=used, block_table=table)[:, 0]


def paged_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                    used: torch.Tensor) -> torch.Tensor:
    """What ``attend_flash`` computes, in plain torch (float32 scores): q [B, heads, d]; returns [B, heads, d]."""
    b, heads, d = q.shape
    n, kv = table.shape[1], k_pool.shape[2]
    span = n * k_pool.shape[1]
    k, v = gather(k_pool, table, span).float(), gather(v_pool, table, span).float()  # [B, kv, span, d]
    qg = q.view(b, kv, heads // kv, d).float()
    scores = qg @ k.transpose(-1, -2) * d ** -0.5  # [B, kv, group, span]
    keep = torch.arange(span, device=q.device)[None] < used[:, None].long()
    scores = scores.masked_fill(~keep[:, None, None], float("-inf"))
    return (scores.softmax(-1) @ v).to(q.dtype).view(b, heads, d)


def check_flash(kernel: str | None, kv: int, heads: int, d: int, size: int, device, dtype: torch.dtype) -> None:
    """One ``attend_flash`` call on random pages against ``paged_reference`` before any decode: a kernel
    that refuses these shapes (pages not a multiple of 256, a torch without the block table) or ignores the
    table refuses to start here, naming why, instead of sampling every token from wrong logits."""
    device = torch.device(device)
    if device.type == "cuda":
        if kernel is None:
            raise RuntimeError("no paged FlashAttention here (torch's _flash_attention_forward takes no block_table "
                               "and flash-attn is not installed)")
        if size % FLASH_PAGE_MULTIPLE:
            raise ValueError(f"FlashAttention's paged kernel reads pages of a multiple of {FLASH_PAGE_MULTIPLE} "
                             f"tokens, not {size} (rollout_engine.kv_page_tokens)")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, heads, d, generator=gen).to(device, dtype)
    k_pool, v_pool = torch.randn(2, 6, size, kv, d, generator=gen).to(device, dtype)
    table = torch.tensor([[3, 1], [0, 0], [5, 2]], dtype=torch.int32, device=device)
    used = torch.tensor([size + 1, 1, 2 * size], dtype=torch.int32, device=device)
    rows = torch.arange(4, dtype=torch.int32, device=device)
    try:
        got = attend_flash(q, k_pool, v_pool, table, used, rows[:4], rows[:4] * 2 * size, kernel).float()
    except (RuntimeError, ImportError, TypeError) as exc:  # refused shapes; flash-attn without its 2.x API
        raise RuntimeError(f"decode attention 'flash_paged' does not run here ({exc}); use 'sdpa'") from exc
    worst = float((got - paged_reference(q, k_pool, v_pool, table, used).float()).abs().max())
    if not worst <= (0.05 if dtype in (torch.bfloat16, torch.float16) else 1e-4):
        raise RuntimeError(f"decode attention 'flash_paged' differs from the reference by {worst:.3g} on this "
                           f"machine (torch {torch.__version__}); use 'sdpa'")
