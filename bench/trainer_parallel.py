"""Trainer parallelism on GPUs: one update loop at the Qwen2-0.5B shape (random weights, bf16) run as
dp=1 on one GPU, dp=2 (FSDP2) and tp=2 (DTensor) in the same invocation, on the same data.

Each layout runs the trainer's own engine (``TorchTrainEngine`` for dp=1, ``ParallelTrainEngine`` for
the others: the same decoupled PPO loss, mini-batches, token-share weighting, gradient clipping and
AdamW) for --steps updates; every rank builds the same batches from the step number (the trainer node
would broadcast them). A batch is --batch rows of up to --seq tokens (lengths uniform in [seq/2, seq],
the first seq/8 a prompt outside the loss), token ids uniform over the vocabulary, advantages +1/-1,
and behaviour log-probabilities -log(vocab): what a random-weight model samples with, so the
importance weights are about 1 as for fresh samples.

Printed: the loss of every update per layout (parity: the layouts make the same updates, up to bf16
rounding of a different summation order), tokens/s over the updates after --warmup, and each
layout's ratio to dp=1 (ideal: its GPU count for dp, less for tp, which trades compute for an
all-reduce per attention and MLP block).

``--shape`` takes bench/trainer.py's table (bench/shapes.py: 0.5b, 1.5b, 3b, 7b, 8b, qwen3-8b); ``--longtail``
draws the seed's row lengths (lognormal, median 500, sigma 0.8, clipped 200..--seq) where the default is
uniform in [seq/2, seq]; ``--lora RANK`` trains LoRA adapters (trainer_engine.lora, alpha 2 x RANK; dp only).
MFU per GPU: the update's FLOPs (areal_bus/train/train_model.train_flops: 6 N per token, the proximal
forward, causal attention; full fine-tuning's count) over seconds x ranks x 989 TFLOP/s (H100/H200 bf16).

Run:  python3 bench/trainer_parallel.py                           (2+ GPUs, NCCL; ~2 min)
      python3 bench/trainer_parallel.py --shape 1.5b --longtail --seq 3000 --batch 128 --layouts 1x1,2x1,4x1,8x1
      python3 bench/trainer_parallel.py --layouts 1x1,2x1,1x2,4x1,2x2 --steps 8
      .venv/bin/python bench/trainer_parallel.py --device cpu --tiny   (gloo, tiny shape: checks the script)

Layouts are DPxTP. Needs torch, numpy and safetensors only (no pyzmq, pydantic or structlog: the GPU
host lacks them). NVLink multicast stays off in every process it starts (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1): on the shared GPU hosts it can take the GPUs out of service.
The last line is ``RESULT dp1_tokens_per_s=... dp2_tokens_per_s=... dp2_scaling=... ...``.
"""

from __future__ import annotations

import os

# Before torch: every process this script starts inherits them (spawned ranks included).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import math  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402

from areal_bus.engines.torch_dp import backend_for  # noqa: E402
from areal_bus.engines.torch_parallel import ParallelTrainEngine, RankGroup  # noqa: E402
from areal_bus.engines.torch_train import TorchTrainEngine  # noqa: E402
from areal_bus.model.modeling import QWEN2_0_5B, TINY_QWEN2, make_random_model, save_pretrained  # noqa: E402
from areal_bus.train.train_model import train_flops  # noqa: E402

PEAK_BF16 = 989e12
"""H100/H200 dense bf16 datasheet FLOP/s, as bench/trainer.py's MFU."""

RANK_TIMEOUT_S = 600  # a layout whose ranks have not finished by then has hung in a collective


def bench_topology(args, dp: int, tp: int) -> SimpleNamespace:
    """The topology fields the trainer engines read, with the schema's defaults (areal_bus/config/topology.py;
    pydantic is not on the GPU host, so not the schema itself)."""
    return SimpleNamespace(
        is_async=False, staleness_threshold=2, staleness=SimpleNamespace(per_token=False, drop_at_consume=True),
        trainer_engine=SimpleNamespace(kl_coef=0.0, ppo_epochs=1, eps_clip=0.2, eps_clip_high=None,
                                       behav_imp_weight_cap=5.0, grad_clip=1.0, adv_std_normalize=True,
                                       adv_leave_one_out=False, attn_implementation="areal_varlen",
                                       micro_batch_tokens=16384, logit_chunk_tokens=4096,
                                       micro_batch_pad_tokens=None, prox_logp_method="recompute",
                                       logit_grad_keep_gib=None, loss_token_norm=None, lora=_lora(args),
                                       gradient_checkpointing=getattr(args, "checkpointing", False),
                                       mixed_precision=getattr(args, "mixed_precision", "compute_copy"),
                                       compile=getattr(args, "compile", False)),
        model=SimpleNamespace(device=args.device, dtype=args.dtype, seed=0, threads=1),
        rollout_engine=SimpleNamespace(temperature=1.0),
        trainer_device=args.device, learning_rate=args.lr, mini_batch_size=args.mini_batch, train_workers=dp * tp,
        parallelism=SimpleNamespace(dp=dp, tp=tp, reshard_after_forward=not args.keep_gathered))


def _lora(args):
    if not getattr(args, "lora", 0):
        return None
    from areal_bus.config.engines import LoraConfig  # lazy: pydantic only for --lora (the GPU host carries it)

    return LoraConfig(rank=args.lora, alpha=2 * args.lora)


def make_batch(step: int, rows: int, seq: int, vocab: int, longtail: bool = False) -> dict[str, torch.Tensor]:
    """The padded batch of update ``step`` (pad_batch's layout), the same on every rank and layout."""
    g = torch.Generator().manual_seed(1000 + step)
    if longtail:  # the seed's lengths (bench/trainer.py): lognormal, median 500, sigma 0.8, 200..seq
        lengths = (torch.randn(rows, generator=g) * 0.8 + math.log(500)).exp().clamp(min(200, seq), seq).long()
    else:
        lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=g)
    pos = torch.arange(seq)[None, :]
    attn = (pos < lengths[:, None]).long()
    mask = ((pos >= seq // 8) & (attn == 1)).float()
    ids = torch.randint(0, vocab, (rows, seq), generator=g) * attn
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(rows)])[:, None] * mask
    return {"ids": ids, "attn": attn, "mask": mask, "behav": torch.full((rows, seq), -math.log(vocab)) * mask,
            "adv": adv}


def rank_main(rank: int, dp: int, tp: int, args, model_path: str, init: str, queue) -> None:
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    topo = bench_topology(args, dp, tp)
    world = dp * tp
    if world == 1:
        engine = TorchTrainEngine(topo, model_path, base_model=model_path if args.lora else None)
    else:
        group = RankGroup(rank, world, init, backend_for(args.device))
        engine = ParallelTrainEngine(topo, model_path, group=group, base_model=model_path if args.lora else None)
    dev = engine.device
    vocab = engine.model.config.vocab_size
    out = []
    prof = None
    if args.profile and rank == 0:  # the updates after warm-up, on rank 0: where a layout's time goes
        from torch.profiler import ProfilerActivity, profile, schedule

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        prof = profile(activities=acts, schedule=schedule(wait=args.warmup, warmup=0, active=args.steps - args.warmup))
        prof.start()
    for step in range(args.steps):
        data = make_batch(step, args.batch, args.seq, vocab, args.longtail)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        stats = engine.update(data)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        lens = data["attn"].sum(1)
        out.append({"loss": stats["loss"], "grad_norm": stats["grad_norm"], "s": time.perf_counter() - t0,
                    "tokens": int(lens.sum()), "sq": int((lens ** 2).sum())})
        if prof is not None:
            prof.step()
    if prof is not None:
        prof.stop()
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(f"# profile dp={dp} tp={tp}, rank 0, updates {args.warmup + 1}..{args.steps}", flush=True)
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60), flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60),
              flush=True)
    if rank == 0:
        mem = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0
        queue.put({"steps": out, "max_mem_gib": mem})
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def run_layout(dp: int, tp: int, args, model_path: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = tmp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=rank_main, args=(r, dp, tp, args, model_path, f"tcp://127.0.0.1:{port}", queue))
             for r in range(dp * tp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + RANK_TIMEOUT_S
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if hung or failed or queue.empty():
        raise RuntimeError(f"layout dp={dp} tp={tp}: {len(hung)} rank(s) hung, exit codes {failed}")
    return queue.get()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (one GPU per rank, NCCL) or cpu (gloo)")
    p.add_argument("--tiny", action="store_true", help="the tiny test shape instead of Qwen2-0.5B")
    p.add_argument("--shape", default="0.5b", help="a shape of bench/trainer.py's table (bench/shapes.py)")
    p.add_argument("--longtail", action="store_true", help="row lengths lognormal (median 500, sigma 0.8, "
                   "200..--seq) instead of uniform in [seq/2, seq]")
    p.add_argument("--lora", type=int, default=0, metavar="RANK", help="trainer_engine.lora of this rank (dp only)")
    p.add_argument("--checkpointing", action="store_true", help="trainer_engine.gradient_checkpointing (8B-class)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--layouts", default="1x1,2x1,1x2", help="DPxTP,...; the first is the baseline")
    p.add_argument("--steps", type=int, default=None, help="updates per layout (default 6; --tiny 4)")
    p.add_argument("--warmup", type=int, default=2, help="updates left out of tokens/s")
    p.add_argument("--batch", type=int, default=None, help="rows per update (default 16; --tiny 8)")
    p.add_argument("--seq", type=int, default=None, help="longest row in tokens (default 1024; --tiny 64)")
    p.add_argument("--mini-batch", type=int, default=None, help="rows per optimizer step (default 8; --tiny 4)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=1, help="cpu: torch threads per rank")
    p.add_argument("--keep-gathered", action="store_true", help="dp: parallelism.reshard_after_forward false")
    p.add_argument("--mixed-precision", default="compute_copy", choices=["compute_copy", "autocast"],
                   help="trainer_engine.mixed_precision (dp=1; parallel layouts autocast)")
    p.add_argument("--compile", action="store_true", help="trainer_engine.compile: torch.compile each decoder layer")
    p.add_argument("--profile", action="store_true", help="print rank 0's torch profile of each layout's timed updates")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.steps = args.steps or (4 if args.tiny else 6)
    args.batch = args.batch or (8 if args.tiny else 16)
    args.seq = args.seq or (64 if args.tiny else 1024)
    args.mini_batch = args.mini_batch or (4 if args.tiny else 8)
    args.warmup = min(args.warmup, args.steps - 1)
    layouts = [tuple(int(x) for x in spec.lower().split("x")) for spec in args.layouts.split(",")]
    if args.device.startswith("cuda"):
        need = max(dp * tp for dp, tp in layouts)
        if torch.cuda.device_count() < need:
            raise SystemExit(f"layouts {args.layouts} need {need} GPUs; this host has {torch.cuda.device_count()}")
        hardware = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    else:
        hardware = f"cpu ({os.cpu_count()} cores)"
    if args.tiny or args.shape == "0.5b":
        shape = TINY_QWEN2 if args.tiny else QWEN2_0_5B
    else:
        from bench.shapes import shapes  # lazy: the table's module loads bench/trainer.py (pydantic)

        shape = shapes()[args.shape]
    label = "tiny" if args.tiny else args.shape
    print(f"# trainer parallelism: {label} shape, {args.dtype}, {hardware}, "
          f"torch {torch.__version__}, {datetime.date.today()}" + (f", LoRA r{args.lora}" if args.lora else ""))
    print(f"# {args.steps} updates of {args.batch} rows x <= {args.seq} tokens, mini-batch {args.mini_batch}, "
          f"tokens/s over updates {args.warmup + 1}..{args.steps}")
    with tempfile.TemporaryDirectory(prefix="trainer_parallel-") as work:
        model_path = str(Path(work) / "model")
        if args.device.startswith("cuda") and not args.tiny and args.shape != "0.5b":
            from bench.shapes import random_model  # lazy: as above; draws the weights on the GPU (8B in seconds)

            model = random_model(shape, "cuda", args.dtype).cpu()
            torch.cuda.empty_cache()
        else:
            model = make_random_model(shape, seed=0, dtype=args.dtype)
        save_pretrained(model, model_path)
        n_params = sum(p.numel() for p in model.parameters())  # a tied embedding once
        del model
        results = {}
        for dp, tp in layouts:
            r = run_layout(dp, tp, args, model_path)
            timed = r["steps"][args.warmup:]
            r["tokens_per_s"] = sum(s["tokens"] for s in timed) / sum(s["s"] for s in timed)
            flops = sum(train_flops(n_params, shape["num_hidden_layers"], shape["hidden_size"], s["tokens"], s["sq"])
                        for s in timed)
            r["mfu"] = flops / sum(s["s"] for s in timed) / (PEAK_BF16 * dp * tp)
            results[(dp, tp)] = r
    base = results[layouts[0]]
    # scaling efficiency: tokens/s per GPU against the baseline's per GPU (1.0 = linear)
    per_gpu = lambda r, key: r["tokens_per_s"] / (key[0] * key[1])
    scaling = lambda r, key: per_gpu(r, key) / per_gpu(base, layouts[0])
    name = {(dp, tp): f"dp{dp}" if tp == 1 else (f"tp{tp}" if dp == 1 else f"dp{dp}tp{tp}") for dp, tp in layouts}
    print(f"{'layout':<8} {'ranks':>5} {'loss per update':<{9 * args.steps}} {'max|dloss|':>10} "
          f"{'tokens/s':>10} {'vs ' + name[layouts[0]]:>8} {'per GPU':>7} {'MFU':>6} {'GiB':>6}")
    worst = 0.0
    for key in layouts:
        r = results[key]
        losses = [s["loss"] for s in r["steps"]]
        diff = max(abs(a - b["loss"]) for a, b in zip(losses, base["steps"]))
        worst = max(worst, diff)
        print(f"{name[key]:<8} {key[0] * key[1]:>5} {' '.join(f'{x:8.5f}' for x in losses):<{9 * args.steps}} "
              f"{diff:>10.2e} {r['tokens_per_s']:>10.0f} {r['tokens_per_s'] / base['tokens_per_s']:>7.2f}x "
              f"{scaling(r, key):>7.2f} {r['mfu']:>6.1%} {r['max_mem_gib']:>6.1f}")
    fields = [f"{name[k]}_tokens_per_s={results[k]['tokens_per_s']:.0f}" for k in layouts]
    fields += [f"{name[k]}_scaling={results[k]['tokens_per_s'] / base['tokens_per_s']:.2f}" for k in layouts[1:]]
    fields += [f"{name[k]}_efficiency={scaling(results[k], k):.2f}" for k in layouts[1:]]
    fields += [f"{name[k]}_mfu={results[k]['mfu']:.3f}" for k in layouts]
    print("RESULT " + " ".join(fields) + f" max_loss_diff={worst:.2e} device={args.device} dtype={args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
