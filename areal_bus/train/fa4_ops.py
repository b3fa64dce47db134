"""FlashAttention-4 as torch operators: ``areal_bus::fa4_varlen_fwd`` and ``areal_bus::fa4_varlen_bwd``.

What ``attn_implementation: areal_varlen_fa4`` (``train_model.VARLEN_FA4``) calls on CUDA: causal attention
within each packed sample, the key/value heads grouped as they are, one cu_seqlens for queries and keys.
flash-attn-4's own entry point is an autograd.Function over CuTe DSL launches, which torch.compile cannot
trace: inside a compiled decoder layer it would break the graph at every layer. Declared as custom
operators (their shapes given for tracing, the backward registered), the compiled layer keeps one graph
and calls the kernels as opaque nodes, as it does torch's own varlen_attn. Written here because the
package declares none.

The package is imported only inside the CUDA kernels, so these register (and the CPU tests run) without
it. Its entry points are run whole on a key's first call and replayed after (``FA4_REPLAY``,
``areal_bus.train.launch_replay``).

Quick check (on a Hopper GPU with flash-attn-4)::

    python -c "import torch, areal_bus.train.fa4_ops; print(torch.ops.areal_bus.fa4_varlen_fwd)"
"""

from __future__ import annotations

import torch

from areal_bus.train.launch_replay import LaunchReplay, compile_cache_owners

FA4_REPLAY = True
"""Whether the FlashAttention-4 operators run flash-attn-4's entry points whole on a key's first call only
and replay its allocations and kernel launches after (``areal_bus.train.launch_replay``): its entry points
spend ~0.22 ms of host per forward on an H100 (0.06 ms replayed) choosing what the 24 layers of a micro-batch all choose alike. False runs
them whole every time (bench/trainer.py's ``+fa4whole``)."""

_FA4_LAUNCHES = None


def _fa4_replay():
    global _FA4_LAUNCHES
    if _FA4_LAUNCHES is None:
        import flash_attn.cute.interface as fa4  # lazy: an optional package, present on Hopper hosts only

        _FA4_LAUNCHES = LaunchReplay(compile_cache_owners([fa4]))
    return _FA4_LAUNCHES


def fa4_replay_stats() -> dict:
    """How many FlashAttention-4 calls ran whole, were recorded, replayed, or refused a record."""
    if _FA4_LAUNCHES is None:
        return {}
    why = _FA4_LAUNCHES.last_refusal
    return {**_FA4_LAUNCHES.stats, **({"last_refusal": why} if why else {})}


def _facts(*tensors) -> tuple:
    # What flash-attn-4's choices rest on, tensor by tensor: shape, layout, dtype, device, whether it needs
    # a gradient (the forward's configuration depends on it) and its alignment.
    return tuple((t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad, t.data_ptr() % 128)
                 for t in tensors)


@torch.library.custom_op("areal_bus::fa4_varlen_fwd", mutates_args=(), device_types="cuda",
                         schema="(Tensor q, Tensor k, Tensor v, Tensor cu, SymInt longest, float scale) "
                                "-> (Tensor, Tensor)")
def _fa4_fwd(q, k, v, cu, longest, scale):
    """(out [N, Hq, D], log-sum-exp [Hq, N] float32) of causal attention within each cu segment."""
    from flash_attn.cute.interface import _flash_attn_fwd

    def run():
        return tuple(_flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                     max_seqlen_k=longest, softmax_scale=scale, causal=True, return_lse=True)[:2])

    if not FA4_REPLAY:
        return run()
    return _fa4_replay()(("fwd", longest, scale, *_facts(q, k, v, cu)), (q, k, v, cu), run)


@_fa4_fwd.register_fake
def _fa4_fwd_shapes(q, k, v, cu, longest, scale):
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("areal_bus::fa4_varlen_bwd", mutates_args=(), device_types="cuda",
                         schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu, "
                                "SymInt longest, float scale) -> (Tensor, Tensor, Tensor)")
def _fa4_bwd(dout, q, k, v, out, lse, cu, longest, scale):
    from flash_attn.cute.interface import _flash_attn_bwd

    def run():
        return tuple(_flash_attn_bwd(q, k, v, out, dout, lse, scale, True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=longest, max_seqlen_k=longest)[:3])

    if not FA4_REPLAY:
        return run()
    return _fa4_replay()(("bwd", longest, scale, *_facts(dout, q, k, v, out, lse, cu)),
                         (dout, q, k, v, out, lse, cu), run)


@_fa4_bwd.register_fake
def _fa4_bwd_shapes(dout, q, k, v, out, lse, cu, longest, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fa4_setup(ctx, inputs, output):
    q, k, v, cu, longest, scale = inputs
    ctx.save_for_backward(q, k, v, cu, *output)
    ctx.longest, ctx.scale = longest, scale


def _fa4_backward(ctx, dout, _dlse):
    q, k, v, cu, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.areal_bus.fa4_varlen_bwd(dout.contiguous(), q, k, v, out, lse, cu, ctx.longest, ctx.scale)
    return dq, dk, dv, None, None, None


_fa4_fwd.register_autograd(_fa4_backward, setup_context=_fa4_setup)
