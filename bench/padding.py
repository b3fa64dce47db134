"""How much of the trainer's computed tokens are padding, on the seed's workload (CPU, seconds).

The trainer pads each micro-batch to a multiple of ``trainer_engine.micro_batch_pad_tokens`` (1,024 on a
GPU) so that cuBLAS sees a few row counts again and again (areal_bus/train/packing.py). Padding is computed
like any token but trains nothing, so it is tokens/s lost one for one. This prints, for each micro-batch
cap and padding multiple, the padding as a share of the real tokens, the micro-batches per update and the
distinct padded lengths (the row counts cuBLAS meets): with the samples grouped in their order (the
trainer before 2026-12-04's session 18), regrouped within each mini-batch (``packing._groups``), and with
the mini-batches' totals aligned too (``packing.mini_batch_members``, then regrouped: what the trainer
does now).

Workload: bench/trainer.py's (``make_updates``: lengths lognormal, median 500, sigma 0.8, clipped to
200..3,000, ~65,536 tokens per update in 4 equal mini-batches).

Run:  .venv/bin/python bench/padding.py [--updates 200] [--caps 16384 32768] [--pads 1 128 256 512 1024]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from areal_bus.train.packing import _groups, mini_batch_members  # noqa: E402
from bench.trainer import make_updates  # noqa: E402


def measure(lengths_per_update: list[list[int]], mini: int, cap: int, pad: int, how: str) -> dict:
    """how: 'in order' | 'regrouped' (within each mini-batch) | 'aligned' (mini-batch totals too)."""
    real = padded = micro = 0
    shapes: set[int] = set()
    t0 = time.perf_counter()
    for lengths in lengths_per_update:
        size = math.ceil(len(lengths) / mini)  # the mini_batch_size bench/trainer.py gives the engine
        members = mini_batch_members(lengths, size, pad if how == "aligned" else 1)
        for mb in members:
            sizes = [lengths[i] for i in mb]
            for group in _groups(sizes, cap, 1 if how == "in order" else pad):
                n = sum(sizes[i] for i in group)
                real, padded, micro = real + n, padded + -(-n // pad) * pad, micro + 1
                shapes.add(-(-n // pad) * pad)
    host_ms = (time.perf_counter() - t0) / len(lengths_per_update) * 1e3
    return {"padding": (padded - real) / real, "micro": micro / len(lengths_per_update), "shapes": len(shapes),
            "host_ms": host_ms}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=200)
    ap.add_argument("--caps", type=int, nargs="+", default=[16384, 32768], help="micro_batch_tokens")
    ap.add_argument("--pads", type=int, nargs="+", default=[1, 128, 256, 512, 1024], help="micro_batch_pad_tokens")
    ap.add_argument("--mini-batches", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    draw = SimpleNamespace(seed=args.seed, warmup=0, steps=args.updates, update_tokens=65536, median=500,
                           min_len=200, max_len=3000)
    lengths = [[int(s["ids"].size) for s in u] for u in make_updates(draw, vocab=2)]
    print(f"# {args.updates} updates of bench/trainer.py's workload, {args.mini_batches} mini-batches each")
    print(f"{'cap':>6} {'pad':>5}  {'in order':>9} {'regrouped':>9} {'aligned':>9}  {'micro/update':>12} "
          f"{'shapes':>6} {'host ms/update':>14}")
    for cap in args.caps:
        for pad in args.pads:
            r = {how: measure(lengths, args.mini_batches, cap, pad, how)
                 for how in ("in order", "regrouped", "aligned")}
            now = r["aligned"]
            print(f"{cap:>6} {pad:>5}  {r['in order']['padding']:>9.2%} {r['regrouped']['padding']:>9.2%} "
                  f"{now['padding']:>9.2%}  {now['micro']:>12.2f} {now['shapes']:>6} {now['host_ms']:>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
