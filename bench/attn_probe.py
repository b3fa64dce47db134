"""Probe: can torch's cuDNN ragged attention (aten._cudnn_attention_forward/backward with cumulative
lengths) run forward and backward here, and how fast against FlashAttention-2 varlen (forward only, and
forward+backward), on a 0.5B-shaped micro-batch. Prints what it finds; run on the GPU host."""
import sys
import time

import numpy as np
import torch

sys.path.insert(0, "bench")
from attn_varlen import lengths  # noqa: E402
from torch.nn.attention.varlen import varlen_attn  # noqa: E402

dev = "cuda"
rng = np.random.default_rng(0)
sizes = lengths(rng, 16384, 500, 200, 3000)
cu = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int32, device=dev)
N, L = int(cu[-1]), max(sizes)
for hq, hkv, D in ((14, 2, 64), (12, 2, 128)):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(N, hq, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(N, hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(N, hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
    go = torch.randn(N, hq, D, device=dev, dtype=torch.bfloat16, generator=g)
    s = D ** -0.5

    def timeit(fn, iters=20):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / iters * 1e3

    fa = lambda: varlen_attn(q, k, v, cu, cu, L, L, scale=s, window_size=(-1, 0))
    cd = lambda kk, vv: torch.ops.aten._cudnn_attention_forward(q, kk, vv, None, cu, cu, L, L, True, 0.0, True, False,
                                                                scale=s)
    print(f"# {hq}/{hkv}x{D}: fwd flash {timeit(fa):.3f} ms, cudnn gqa {timeit(lambda: cd(k, v)):.3f} ms", flush=True)
    out, lse, _, _, _, _, seed, off, _ = cd(k, v)
    ref = fa()
    print("  fwd max diff cudnn vs flash", float((out - ref).abs().max()))
    for name, bias in (("None", None), ("empty0", torch.empty(0, device=dev)), ("empty4d", torch.empty(0, 0, 0, 0, device=dev))):
        try:
            dq, dk, dv = torch.ops.aten._cudnn_attention_backward(go, q, k, v, out, lse, seed, off, bias, cu, cu, L, L,
                                                                  0.0, True, scale=s)
            qq, kk2, vv2 = (t.detach().requires_grad_(True) for t in (q, k, v))
            o2 = varlen_attn(qq, kk2, vv2, cu, cu, L, L, scale=s, window_size=(-1, 0))
            rq, rk, rv = torch.autograd.grad(o2, (qq, kk2, vv2), go)
            print(f"  bwd bias={name}: ok, max diff dq {float((dq-rq).abs().max()):.4f} dk "
                  f"{float((dk-rk).abs().max()):.4f} dv {float((dv-rv).abs().max()):.4f}")
            t_c = timeit(lambda: torch.ops.aten._cudnn_attention_backward(go, q, k, v, out, lse, seed, off, bias, cu, cu,
                                                                           L, L, 0.0, True, scale=s))
            def fb():
                o2 = varlen_attn(qq, kk2, vv2, cu, cu, L, L, scale=s, window_size=(-1, 0))
                torch.autograd.grad(o2, (qq, kk2, vv2), go)
            print(f"  bwd cudnn {t_c:.3f} ms; flash fwd+bwd {timeit(fb):.3f} ms", flush=True)
            break
        except Exception as e:  # noqa: BLE001
            print(f"  bwd bias={name}: {type(e).__name__}: {str(e)[:240]}", flush=True)
