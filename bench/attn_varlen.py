"""Packed (varlen) causal attention on one GPU, torch's FlashAttention-2 varlen kernel (what the trainer's
``areal_varlen`` attention calls), forward and backward, on the trainer's own micro-batches: with the
key/value heads repeated to the query's (``repeat``: the engine where torch's ``varlen_attn`` has no
``enable_gqa``, torch 2.11) and as they are (``gqa``: the kernel's own grouped-query support).

Workload: sample lengths as bench/trainer.py draws them (lognormal, median 500, sigma 0.8, clipped to
200..3,000) packed into micro-batches of --tokens tokens, at a shape's attention (Qwen2-0.5B: 14 query
heads, 2 key/value heads, head_dim 64; 1.5B: 12 / 2 / 128), bf16; and FlashAttention-4 (``fa4``: the
flash-attn-4 package through the trainer's operators; ``fa4c``: the same inside a compiled function;
``fa4w``: ``fa4`` with the package's entry points run whole on every call instead of replayed,
``areal_bus.train.launch_replay``), where the package is installed. Checked first: each backend's output and
gradients against float32 attention computed sample by sample (max abs error). Timed:
--iters forward+backward passes after --warmup, CUDA events, and the attention FLOPs (causal: 2 x 2 x
sum len^2 x heads x head_dim / 2 per forward, x 2.5 more for backward); and the host's own time per
forward+backward, the same calls queued behind a sleeping kernel (a backend whose host work exceeds its
device time cannot keep the GPU busy, whatever its kernels' speed; keep --iters at a few dozen: more
forward+backward calls fill the launch queue behind the sleep, and then the host blocks).

--cprofile N: after the timings, each backend's host time per forward (N forwards, no gradient, at most
300, queued behind a sleeping kernel) and their Python profile (cProfile), its 15 costliest functions
by own time (stderr): where a backend's host time per call goes.

Run (GPU):  python3 bench/attn_varlen.py                 (both shapes, ~1 min)
            python3 bench/attn_varlen.py --shapes 0.5b --cprofile 200
Prints one line per shape and backend and a ``RESULT`` line; a backend that cannot run says why.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128)}


def lengths(rng, total: int, median: float, lo: int, hi: int) -> list[int]:
    out: list[int] = []
    while sum(out) < total:
        n = int(np.clip(rng.lognormal(np.log(median), 0.8), lo, hi))
        out.append(min(n, total - sum(out)) if sum(out) + n > total else n)
    return [n for n in out if n > 0]


def _varlen(q, k, v, cu, longest, scale, **extra):
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    extra.update({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})
    return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, **extra)


def fa2_repeat(q, k, v, cu, longest, scale):
    """The key/value heads repeated to the query's (the engine on a torch without varlen GQA)."""
    rep = q.shape[1] // k.shape[1]
    return _varlen(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), cu, longest, scale)


def fa2_gqa(q, k, v, cu, longest, scale):
    """The key/value heads as they are: FlashAttention-2 itself takes fewer of them."""
    from torch.nn.attention.varlen import varlen_attn

    extra = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
    return _varlen(q, k, v, cu, longest, scale, **extra)


def _register_fa4():
    """areal_bus.train.fa4_ops (importing it registers the operators), imported once, not on every timed call."""
    if "areal_bus.train.fa4_ops" not in sys.modules:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        import areal_bus.train.fa4_ops  # noqa: F401
    return sys.modules["areal_bus.train.fa4_ops"]


def fa4(q, k, v, cu, longest, scale):
    """FlashAttention-4 (the flash-attn-4 package) through the trainer's own operators
    (``areal_bus::fa4_varlen_fwd``/``_bwd``, what ``attn_implementation: areal_varlen_fa4`` calls)."""
    _register_fa4()
    return torch.ops.areal_bus.fa4_varlen_fwd(q, k, v, cu, longest, scale)[0]


def fa4_compiled(q, k, v, cu, longest, scale):
    """The same operator inside a torch.compile'd function (fullgraph: no graph break allowed), as a
    compiled decoder layer calls it."""
    global _COMPILED
    if _COMPILED is None:
        _register_fa4()  # outside the compiled function: the import is no graph
        op = lambda q, k, v, cu, n, s: torch.ops.areal_bus.fa4_varlen_fwd(q * 1.0, k, v, cu, n, s)[0]
        _COMPILED = torch.compile(op, fullgraph=True, dynamic=True)
    return _COMPILED(q, k, v, cu, longest, scale)


_COMPILED = None
BACKENDS = (("repeat", fa2_repeat), ("gqa", fa2_gqa), ("fa4", fa4), ("fa4w", fa4), ("fa4c", fa4_compiled))


def select(name: str) -> None:
    """``fa4w``: the FlashAttention-4 operators with flash-attn-4's entry points run whole on every call
    (``fa4_ops.FA4_REPLAY`` off, forward and backward); every other backend: as the trainer runs them."""
    if name.startswith("fa4"):
        _register_fa4().FA4_REPLAY = name != "fa4w"


def reference(q, k, v, sizes, scale):
    """float32 causal attention sample by sample: [N, H, D]."""
    outs, s = [], 0
    for n in sizes:
        qs, ks, vs = (t[s:s + n].float().transpose(0, 1) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))
        s += n
    return torch.cat(outs)


def run(fn, q, k, v, cu, longest, scale, g):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = fn(q, k, v, cu, longest, scale)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), g)
    return o, dq, dk, dv


def host_profile(backends, calls: int, inputs) -> None:
    """Forward calls alone (no gradient), ``calls`` of them queued behind a sleeping kernel so the host
    never waits for the device (a forward is one or two launches: a few hundred stay far below the
    launch queue's ~1,000, which a forward+backward loop fills, and then the host blocks). Per backend:
    the host's ms per forward, timed plain, then cProfile's 15 functions with the most own time (stderr)."""
    import cProfile
    import io
    import pstats

    q, k, v, cu, longest, scale, _ = inputs
    calls = min(calls, 300)
    for name, fn in backends:
        select(name)
        try:
            with torch.no_grad():
                fn(q, k, v, cu, longest, scale)  # compiled and warm
                torch.cuda.synchronize()
                torch.cuda._sleep(int(3e9))
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn(q, k, v, cu, longest, scale)
                plain_ms = (time.perf_counter() - t0) * 1e3 / calls
                torch.cuda.synchronize()
                torch.cuda._sleep(int(3e9))
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(calls):
                    fn(q, k, v, cu, longest, scale)
                prof.disable()
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            print(f"# host profile of {name}: cannot run: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        print(f"# host profile of {name}: {plain_ms:.3f} ms of host per forward ({calls} calls, no profiler); "
              f"cProfile of the same calls:\n" + "\n".join(
                  line for line in out.getvalue().splitlines() if line.strip()), file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="0.5b,1.5b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--check-tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cprofile", type=int, default=0, help="time and profile this many forwards of each backend's host work (<= 300)")
    ap.add_argument("--backends", default=",".join(n for n, _ in BACKENDS))
    args = ap.parse_args()
    backends = [(n, fn) for n, fn in BACKENDS if n in args.backends.split(",")]
    dev = torch.device("cuda")
    print(f"# bench/attn_varlen.py {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"micro-batches of {args.tokens} tokens")
    result = []
    for shape in args.shapes.split(","):
        hq, hkv, d = SHAPES[shape]
        scale = d ** -0.5
        rng = np.random.default_rng(0)
        for n_tok, timed in ((args.check_tokens, False), (args.tokens, True)):
            sizes = lengths(rng, n_tok, 500, 200, 3000)
            cu = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int32, device=dev)
            n, longest = int(cu[-1]), max(sizes)
            gen = torch.Generator(device=dev).manual_seed(1)
            q = torch.randn(n, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
            k = torch.randn(n, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
            v = torch.randn(n, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
            g = torch.randn(n, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
            if not timed:  # correctness against float32
                ref = run(lambda q, k, v, *_: reference(q, k, v, sizes, scale), q, k, v, cu, longest, scale, g.float())
                for name, fn in backends:
                    select(name)
                    try:
                        got = run(fn, q, k, v, cu, longest, scale, g)
                        errs = [float((a.float() - b).abs().max()) for a, b in zip(got, ref)]
                        print(f"{shape:5} {name:6} check   max abs err out {errs[0]:.4f} dq {errs[1]:.4f} "
                              f"dk {errs[2]:.4f} dv {errs[3]:.4f}")
                        result.append(f"{shape}_{name}_err={max(errs):.4f}")
                    except Exception as exc:  # noqa: BLE001 - the backend's reason is the result
                        print(f"{shape:5} {name:6} check   cannot run: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            sq = sum(s * s for s in sizes)
            flops = 2 * 2 * sq * hq * d / 2 * (1 + 2.5)  # causal: half of the square
            for name, fn in backends:
                select(name)
                try:
                    for _ in range(args.warmup):
                        run(fn, q, k, v, cu, longest, scale, g)
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                    torch.cuda.synchronize()
                    ev[0].record()
                    for _ in range(args.iters):
                        run(fn, q, k, v, cu, longest, scale, g)
                    ev[1].record()
                    torch.cuda.synchronize()
                    ms = ev[0].elapsed_time(ev[1]) / args.iters
                    # The host's own time per call: the same calls queued behind a long sleep kernel, so
                    # the host never waits for the device (a call that synchronizes shows the sleep).
                    torch.cuda._sleep(int(2e9))
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        run(fn, q, k, v, cu, longest, scale, g)
                    host_ms = (time.perf_counter() - t0) * 1e3 / args.iters
                    torch.cuda.synchronize()
                    print(f"{shape:5} {name:6} {n} tokens, {len(sizes)} samples: fwd+bwd {ms:.2f} ms, "
                          f"{flops / ms / 1e9:.0f} TFLOP/s; host {host_ms:.2f} ms a call")
                    result.append(f"{shape}_{name}_ms={ms:.3f} {shape}_{name}_host_ms={host_ms:.3f}")
                except Exception as exc:  # noqa: BLE001
                    print(f"{shape:5} {name:6} timed   cannot run: {type(exc).__name__}: {str(exc)[:200]}")
            if args.cprofile and shape == args.shapes.split(",")[0]:
                host_profile(backends, args.cprofile, (q, k, v, cu, longest, scale, g))
    print("RESULT " + " ".join(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
