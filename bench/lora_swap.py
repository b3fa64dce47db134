"""Publish to the first token of the new version in the torch rollout engine, over CUDA IPC on one GPU:
the LoRA adapter alone (ranks 16 and 64, all seven projections of every layer) beside the full weights of
the same shape, in one run (issue 50 item 6).

Per shape (``--shapes``, bench/shapes.py: Qwen2-0.5B and Qwen2-1.5B by default) and per mode (``full``,
``r16``, ``r64``): this process is the rollout worker, a ``TorchRolloutEngine`` as the system builds it on
a GPU (bf16, the static decode step replayed as CUDA graphs, its default attention and fusion; with LoRA
the model's projections carry adapters, ``adapters.attach``, served unmerged), its weight loader a
``CudaWeightReader`` over the publisher's handles. A publisher process (spawn: CUDA IPC needs two
processes) is the trainer's side: a ``CudaWeightWriter`` laid out as what a version holds (every weight;
or the adapter's A and B, ``adapters.wire_shapes``), random bf16 tensors changed before each version.

One round: ``--batch`` requests of 128-token prompts decode ``--new`` tokens each (no stop); after
``--swap-at`` decode steps the worker asks for a version, the publisher notes the time and writes it
(``write``: device copies into the free buffer, waited for) and hands the location over a pipe, the
worker swaps between two steps as the rollout node does (``swap_weights``: the reader's views, the copy
into the engine's own weights or adapters, the decode step's fused copies refreshed, a sync) and runs the
next step. Timed: publish (the publisher's clock before ``write``) to that step's tokens on the host,
tagged with the new version (one clock: time.monotonic is the host's across processes). Left out: the
VersionAnnounce's hop over the bus (well under a millisecond) and the wait for the current step to end
(up to one decode step: a worker picks an announce up between steps). Every request's tags must be the
old version, then the new one. A warm-up round (graphs captured, the swap path run once), then ``--rounds``
rounds; medians.

Needs torch only on the GPU host (no pyzmq, pydantic or structlog: control messages are plain pipe values).

Run:  python3 bench/lora_swap.py                              (one GPU; both shapes, ~2 min)
      python3 bench/lora_swap.py --shapes 0.5b --ranks 16 --rounds 2 --no-compile     (a smoke run)

Last line: ``RESULT <shape>_<mode>_publish_to_token_ms=... <shape>_<mode>_write_ms=... ...``.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import numpy as np  # noqa: E402
import torch  # noqa: E402

from areal_bus.engines.torch_engine import TorchRolloutEngine  # noqa: E402
from areal_bus.model import adapters  # noqa: E402
from areal_bus.model.modeling import param_shapes  # noqa: E402
from areal_bus.weights.cuda import CudaWeightReader, CudaWeightWriter  # noqa: E402
from areal_bus.wire.messages import GenerateRequest  # noqa: E402
from bench.shapes import random_model, shapes  # noqa: E402

PROMPT = 128
TIMEOUT_S = 120.0  # the publisher silent this long is dead


def publisher(template: dict[str, tuple[int, ...]], conn) -> None:
    """The trainer's side: a writer laid out as ``template``; per "next" a changed version, timed."""
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(1)
    state = {k: torch.randn(shape, generator=gen, device=dev, dtype=torch.bfloat16) * 0.02 for k, shape in template.items()}
    writer = CudaWeightWriter("loraswap", {k: v.to("meta") for k, v in state.items()}, device=dev)
    conn.send(writer.handles())
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        version = int(msg)
        for v in state.values():  # the trainer's step: new numbers (not timed)
            v.mul_(0.99)
        torch.cuda.synchronize(dev)
        if version > 1:  # the worker copied the previous version into its own weights at its swap
            writer.mark_released(version - 1)
        t_publish = time.monotonic()
        location = writer.write(state, version)
        conn.send((location, t_publish, time.monotonic() - t_publish))
    conn.close()


def requests(batch: int, new: int, vocab: int, tag: str, seed: int) -> list[GenerateRequest]:
    rng = np.random.default_rng(seed)
    return [GenerateRequest(request_id=f"{tag}{i}", episode_id=f"{tag}{i}", ticket=0, min_version=0, max_tokens=new,
                            temperature=1.0, prompt_ids=rng.integers(0, vocab, PROMPT).astype(np.int32))
            for i in range(batch)]


def one_round(engine: TorchRolloutEngine, conn, version: int, args, vocab: int) -> dict:
    """A batch decoding with a swap to ``version`` after --swap-at steps: the swap's times and the tags."""
    for r in requests(args.batch, args.new, vocab, f"v{version}-", version):
        engine.add_request(r)
    done, steps, out = {}, 0, {}
    while len(done) < args.batch:
        if steps == args.swap_at:
            conn.send(version)
            if not conn.poll(TIMEOUT_S):
                raise RuntimeError(f"the publisher was silent for {TIMEOUT_S} s")
            location, t_publish, write_s = conn.recv()
            out["swap_ms"] = engine.swap_weights(version, location) * 1e3
            got = engine.step()  # its tokens are the first of the new version (.tolist() waited for them)
            out["publish_to_token_ms"] = (time.monotonic() - t_publish) * 1e3
            out["write_ms"] = write_s * 1e3
        else:
            got = engine.step()
        steps += 1
        done |= {c.request_id: c for c in got}
    tags = [list(c.versions) for c in done.values()]
    out["tags_ok"] = all(t[0] == version - 1 and t[-1] == version and t == sorted(t) for t in tags)
    return out


def measure(shape: str, cfg: dict, rank: int, args) -> dict:
    """One engine at ``shape`` (LoRA of ``rank`` on every projection, or the full weights at rank 0)."""
    dev = torch.device("cuda", 0)
    model = random_model(cfg, dev, torch.bfloat16)
    if rank:
        adapters.attach(model, list(adapters.PROJECTIONS), rank, 2.0)
        template = adapters.wire_shapes(model)
    else:
        template = dict(param_shapes(cfg))
    nbytes = sum(math.prod(s) for s in template.values()) * 2
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=publisher, args=(template, there), daemon=True)
    proc.start()
    try:
        if not here.poll(TIMEOUT_S):
            raise RuntimeError("the publisher sent no handles")
        reader = CudaWeightReader(here.recv())
        max_len = -(-(PROMPT + args.new + 1) // 128) * 128
        engine = TorchRolloutEngine(model, max_batch=args.batch, max_len=max_len, device=dev, dtype=torch.bfloat16,
                                    eos_token_ids=[], weight_loader=reader.open, max_prefill_tokens=16384,
                                    fuse_decode=False if args.no_compile else None)
        vocab = model.cfg.vocab_size
        t0 = time.perf_counter()
        one_round(engine, here, 1, args, vocab)  # warm-up: graphs captured, the reader's first open
        warm_s = time.perf_counter() - t0
        rounds = [one_round(engine, here, v, args, vocab) for v in range(2, 2 + args.rounds)]
        here.send("stop")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    del engine, model
    torch.cuda.empty_cache()
    med = {k: statistics.median(r[k] for r in rounds) for k in ("publish_to_token_ms", "write_ms", "swap_ms")}
    return {**med, "max_ms": max(r["publish_to_token_ms"] for r in rounds),
            "tags_ok": all(r["tags_ok"] for r in rounds), "nbytes": nbytes, "tensors": len(template), "warm_s": warm_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="0.5b,1.5b", help="comma list of bench/shapes.py's shapes")
    ap.add_argument("--ranks", default="16,64", help="LoRA ranks (comma list), each beside the full weights")
    ap.add_argument("--batch", type=int, default=64, help="requests decoding at the swap")
    ap.add_argument("--new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--swap-at", type=int, default=24, help="decode steps into each round before the swap")
    ap.add_argument("--rounds", type=int, default=5, help="timed swaps per mode (after a warm-up round)")
    ap.add_argument("--no-compile", action="store_true", help="rollout_engine.decode_compile off (faster start)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    if not 0 < args.swap_at < args.new - 1:
        sys.exit("--swap-at must fall inside the round: 0 < --swap-at < --new - 1")
    table = shapes()
    modes = [0] + [int(r) for r in args.ranks.split(",") if r]
    print(f"# bench/lora_swap.py {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}; {args.batch} requests decoding, swap after {args.swap_at} steps, "
          f"{args.rounds} rounds (medians); LoRA on all seven projections, alpha 2 x rank", flush=True)
    print(f"{'shape':6} {'what':8} {'tensors':>7} {'MB':>8} {'write ms':>9} {'swap ms':>8} {'publish->token ms':>18} "
          f"{'max ms':>7} {'tags':>5}", flush=True)
    result = {}
    for shape in args.shapes.split(","):
        for rank in modes:
            what = f"r{rank}" if rank else "full"
            r = measure(shape, table[shape], rank, args)
            print(f"{shape:6} {what:8} {r['tensors']:7d} {r['nbytes'] / 1e6:8.1f} {r['write_ms']:9.2f} {r['swap_ms']:8.2f} "
                  f"{r['publish_to_token_ms']:18.2f} {r['max_ms']:7.2f} {'ok' if r['tags_ok'] else 'WRONG':>5}", flush=True)
            key = f"{shape.replace('.', '_')}_{what}"
            result |= {f"{key}_publish_to_token_ms": round(r["publish_to_token_ms"], 2),
                       f"{key}_write_ms": round(r["write_ms"], 2), f"{key}_swap_ms": round(r["swap_ms"], 2),
                       f"{key}_mb": round(r["nbytes"] / 1e6, 1), f"{key}_tags_ok": r["tags_ok"]}
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    return 0 if all(v for k, v in result.items() if k.endswith("tags_ok")) else 1


if __name__ == "__main__":
    sys.exit(main())
