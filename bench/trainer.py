"""The trainer's update at real sizes on one GPU: the old engine, a re-implementation of the old path, and
today's engine with its precision and compile knobs, on the same updates, each in a process of its own.

Workload (the seed's): sample lengths lognormal (median 500, sigma 0.8) clipped to 200..3000 tokens,
the first 64 of each a prompt outside the loss, gathered into updates of ~--update-tokens tokens (64k),
each update --mini-batches PPO mini-batches (one optimizer step each), random token ids, advantages
+1/-1, behaviour log-probabilities -log(vocab) (a random-weight model's, so importance weights ~1).
Every path runs the decoupled PPO objective with a proximal-logprob forward before the steps, from
the same random float32 weights (a Hugging Face folder written once per shape).

  old       the trainer engine before this work (``--old-tree``: a folder holding ``git archive 7adbcb8
            areal_bus``), its own ``TorchTrainEngine.update`` on the padded batch: the hand-written
            decoder in pure bf16, rows right-padded, full float32 logits, the proximal pass over the
            whole batch at once. On this workload it runs out of memory (95 rows x 3,000 x 152k logits).
  baseline  that path re-implemented here so it fits: the same model and padding, forwarded
            --baseline-rows rows at a time (gradient accumulated). CAVEAT (measured 2026-12-01): it runs
            ~3x slower than the old engine on rows the old engine can take, so ratios against it
            overstate a gain; compare with ``old`` on bench/trainer_parallel.py's short rows too.
  old:M     the engine of --old-tree with trainer_engine.mixed_precision M (a tree of the same
            engine API, e.g. ``git archive HEAD areal_bus``: a same-run baseline for a change to it).
  engine:M  today's ``TorchTrainEngine.update`` (transformers' Qwen2ForCausalLM, float32 master weights
            and AdamW state, samples packed into micro-batches of <= --micro-tokens with FlashAttention
            varlen, chunked lm_head logprobs) with trainer_engine.mixed_precision M: ``autocast`` (bf16
            autocast over the masters) or ``compute_copy`` (a bf16 copy refreshed once per optimizer
            step); ``+compile`` sets trainer_engine.compile (each decoder layer compiled), ``+loglinear``
            trainer_engine.prox_logp_method loglinear (no proximal forward; none counted in MFU either),
            ``+nokeep`` trainer_engine.logit_grad_keep_gib 0 (the lm_head's logits recomputed in backward
            instead of their gradient kept from the forward), ``+chunk8k`` trainer_engine.logit_chunk_tokens
            8192 (4096 otherwise), ``+padN`` trainer_engine.micro_batch_pad_tokens N, ``+keepN``
            trainer_engine.logit_grad_keep_gib N, ``+ckpt`` / ``+nockpt`` activation checkpointing on / off
            (else --checkpointing), ``+microN`` micro-batches of N tokens (else --micro-tokens),
            ``+fa4`` trainer_engine.attn_implementation
            areal_varlen_fa4 (FlashAttention-4's kernels; needs the flash-attn-4 package), ``+fa4whole``
            the same with its entry points run whole on every call (areal_bus.train.fa4_ops.FA4_REPLAY off);
            bench-only tries of inductor's settings with +compile: ``+cppwrap`` (cpp_wrapper), ``+combo``
            (combo_kernels), ``+autotune`` (max_autotune_gemm), ``+noguard`` (after the warm-up,
            torch.compiler.set_stance's skip_guard_eval_unsafe), ``+gcfreeze`` (after the warm-up,
            gc.collect() and gc.freeze(): what the warm-up made left out of later collections).
            Micro-batches are padded as the engine does (--pad-tokens: micro_batch_pad_tokens).

--lora RANK: every engine path trains LoRA adapters of that rank (alpha 2 x RANK: scale 2) on all seven
projections of each layer (trainer_engine.lora: the base frozen in bf16, the adapters float32 with AdamW;
compute_copy then makes no copy, so engine:compute_copy and engine:autocast run the same), to measure
tokens/s and peak GiB beside a full fine-tuning run of the same paths (run the script twice, with and
without it). baseline and old paths ignore it. The LoRA rows' MFU counts what LoRA computes, not 6 N:
forward 2 N_base per token plus the adapters, backward 2 N_base per token (the activations' gradients
flow through the frozen base; no weight gradient is made for it) plus the adapters' 4 per parameter
(``train_model.train_flops(adapter=...)``); attention and the head's tokens as below.

FLOPs (for MFU): 6 N per token (forward + backward, N = parameters with the tied embedding once as the
lm_head matmul, which is counted on the loss's tokens only: the prompts' log-probabilities are no work
the update needs, and since 2026-12-04 the engine computes none; tables before that date counted the
head on every token, ~1 point of MFU more for the same speed) + 2 N per token for the proximal forward
of every mini-batch but an update's first
(whose training forward, before any step, is its proximal pass), + causal attention (2 x layers x hidden x
sum len^2 per forward, x3 with backward), all over real (unpadded) tokens; peak 989 TFLOP/s (H100/H200
dense bf16 datasheet). Printed per shape and path: tokens/s, MFU, seconds per timed update, the first
update's seconds (compilation), peak memory, loss, and the ratio to the first path that ran. Last line:
``RESULT ...``. Each path's process also prints (stderr) its timed updates' seconds, and for ``+fa4``
how many kernels FlashAttention-4 had compiled after the warm-up and at the end. --profile prints each path's torch profile of its first timed update (stderr).

Run:  mkdir -p /tmp/old && git archive 7adbcb8 areal_bus | tar -x -C /tmp/old
      python3 bench/trainer.py --old-tree /tmp/old                 (one GPU; both shapes, every path, ~6 min)
      python3 bench/trainer.py --shapes 0.5b --paths engine:autocast,engine:compute_copy --profile
      .venv/bin/python bench/trainer.py --device cpu --shapes tiny --update-tokens 4000 --steps 1 \
          --median 300 --max-len 600 --old-tree /tmp/old            (checks the script, ~3 min)
      python3 bench/trainer.py --shapes 0.5b,1.5b --paths engine:autocast --lora 16   (LoRA; then without)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
# Before torch: the baseline's padded logits come in many sizes; segments that grow avoid fragmentation.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from areal_bus.train.loss import decoupled_ppo_loss  # noqa: E402
from areal_bus.model.modeling import QWEN2_0_5B, TINY_QWEN2, make_random_model, token_logprobs  # noqa: E402
from areal_bus.model.modeling import CausalLM, ModelConfig, save_pretrained  # noqa: E402
from areal_bus.train.fa4_ops import fa4_replay_stats  # noqa: E402
from areal_bus.train.train_model import VARLEN, VARLEN_FA4, train_flops  # noqa: E402
from areal_bus.train.packing import mini_batches as split  # noqa: E402

PEAK_BF16 = 989e12
WORKER_TIMEOUT_S = 420  # one path at one shape, compilation included; past it the path reports no result
PROMPT = 64
SHAPES = {
    "tiny": {**TINY_QWEN2, "max_position_embeddings": 4096},
    "0.5b": QWEN2_0_5B,
    "1.5b": {**QWEN2_0_5B, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2},
    # Qwen2.5-3B and -7B (random weights at the real shapes, as the others)
    "3b": {**QWEN2_0_5B, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
           "num_attention_heads": 16, "num_key_value_heads": 2},
    "7b": {**QWEN2_0_5B, "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
           "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False},
    # Llama-3.1-8B: llama3 rope scaling, untied head, 128k vocabulary
    "8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
           "bos_token_id": 128000, "eos_token_id": 128009},
}


def make_updates(args, vocab: int) -> list[list[dict]]:
    rng = np.random.default_rng(args.seed)
    updates = []
    for _ in range(args.warmup + args.steps):
        samples, total = [], 0
        while total < args.update_tokens:
            n = int(np.clip(rng.lognormal(math.log(args.median), 0.8), args.min_len, args.max_len))
            mask = np.r_[np.zeros(PROMPT), np.ones(n - PROMPT)].astype(np.float32)
            samples.append({"ids": rng.integers(0, vocab, n), "mask": mask,
                            "behav": np.full(n, -math.log(vocab), np.float32) * mask,
                            "adv": np.full(n, rng.choice([-1.0, 1.0]), np.float32) * mask})
            total += n
        updates.append(samples)
    return updates


def mini_batches(samples: list[dict], k: int) -> list[list[dict]]:
    """The update's mini-batches as the engine splits it (equal parts) at --mini-batches k."""
    return [samples[r.start:r.stop] for r in split(len(samples), math.ceil(len(samples) / k))]


# -- today's path -----------------------------------------------------------------------------
def pad(rows: list[dict], device) -> dict:
    T = max(r["ids"].size for r in rows)
    out = {k: torch.zeros(len(rows), T, dtype=torch.long if k in ("ids", "attn") else torch.float32)
           for k in ("ids", "attn", "mask", "behav", "adv")}
    for i, r in enumerate(rows):
        n = r["ids"].size
        out["ids"][i, :n] = torch.from_numpy(r["ids"])
        out["attn"][i, :n] = 1
        out["mask"][i, :n] = torch.from_numpy(r["mask"])
        out["behav"][i, :n] = torch.from_numpy(r["behav"])
        out["adv"][i, :n] = torch.from_numpy(r["adv"])
    return {k: v.to(device) for k, v in out.items()}


class Baseline:
    def __init__(self, cfg: dict, args, device):
        self.model = make_random_model(cfg, 0, device=device, dtype=torch.bfloat16).train().requires_grad_(True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6, weight_decay=0.0)
        self.rows = args.baseline_rows
        self.k = args.mini_batches
        self.device = device

    def update(self, samples: list[dict]) -> float:
        losses = []
        for mb in mini_batches(samples, self.k):
            groups = [pad(mb[i:i + self.rows], self.device) for i in range(0, len(mb), self.rows)]
            with torch.no_grad():
                prox = [token_logprobs(self.model, g["ids"], g["attn"]) for g in groups]
            total = sum(float(g["mask"].sum()) for g in groups)
            self.opt.zero_grad(set_to_none=True)
            for g, p in zip(groups, prox):
                lp = token_logprobs(self.model, g["ids"], g["attn"])
                loss, _ = decoupled_ppo_loss(lp, p, g["behav"], g["adv"], g["mask"])
                (loss * float(g["mask"].sum()) / total).backward()
                losses.append(float(loss.detach()))
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
        return float(np.mean(losses))


# -- the engines themselves ------------------------------------------------------------------
def bench_topology(args, device, mini_batch: int, variant: str) -> SimpleNamespace:
    """The topology fields the trainer engines read (today's and the old one's: a superset), with the
    schema's defaults; ``variant`` is trainer_engine.mixed_precision, '+compile' adds trainer_engine.compile,
    '+loglinear' sets trainer_engine.prox_logp_method: loglinear (no proximal forward), '+nokeep'
    trainer_engine.logit_grad_keep_gib: 0 (the head's logits recomputed in backward), '+chunk8k'
    trainer_engine.logit_chunk_tokens: 8192 (else 4096, the default), '+padN' (e.g. +pad256)
    trainer_engine.micro_batch_pad_tokens N (else --pad-tokens), '+keepN' trainer_engine.logit_grad_keep_gib
    N (GiB), '+fa4' trainer_engine.attn_implementation areal_varlen_fa4 (else --attn), '+fa4whole' the same
    with fa4_ops.FA4_REPLAY off (set in this process: each path runs in one of its own), '+ckpt' / '+nockpt'
    trainer_engine.gradient_checkpointing on / off (else --checkpointing), '+microN' trainer_engine.micro_batch_tokens
    N (else --micro-tokens): one invocation compares them on one random folder."""
    mp, *flags = variant.split("+")
    number = lambda prefix: {f: float(f[len(prefix):]) for f in flags
                             if f.startswith(prefix) and f[len(prefix):].replace(".", "", 1).isdigit()}
    pad_flags, keep_flags, lora_flags, micro_flags = number("pad"), number("keep"), number("lora"), number("micro")
    pads, keeps = [int(n) for n in pad_flags.values()], list(keep_flags.values())
    known = {"compile", "loglinear", "nokeep", "chunk8k", "fa4", "fa4whole", *INDUCTOR_FLAGS, "noguard", "gcfreeze",
             "ckpt", "nockpt"}
    whole_pads = all(n.is_integer() for n in pad_flags.values())
    micros = [int(n) for n in micro_flags.values()]
    if set(flags) - known - set(pad_flags) - set(keep_flags) - set(lora_flags) - set(micro_flags) or len(pads) > 1 \
            or len(keeps) > 1 or len(micros) > 1 or not whole_pads or {"ckpt", "nockpt"} <= set(flags):
        raise SystemExit(f"--paths: unknown flag in {variant!r} ({', '.join(sorted(known))}, padN, keepN, loraN, "
                         f"microN)")
    checkpointing = "ckpt" in flags or (args.checkpointing and "nockpt" not in flags)
    keep = 0 if "nokeep" in flags else (keeps[0] if keeps else None)
    if "fa4whole" in flags:
        from areal_bus.train import fa4_ops

        fa4_ops.FA4_REPLAY = False
    prox = "loglinear" if "loglinear" in flags else "recompute"
    # Today's schema's defaults under the fields set here, so a knob added to the engine later reads its
    # default instead of failing here (the old tree's engine reads the explicit ones).
    from areal_bus.config.engines import LoraConfig
    from areal_bus.config.topology import StalenessConfig, TorchTrainerEngineConfig

    return SimpleNamespace(
        is_async=False, staleness_threshold=2, staleness=SimpleNamespace(**StalenessConfig().model_dump()),
        trainer_engine=SimpleNamespace(**{**TorchTrainerEngineConfig().model_dump(), **dict(
            kl_coef=0.0, ppo_epochs=1, eps_clip=0.2, eps_clip_high=None, behav_imp_weight_cap=5.0, grad_clip=1.0,
            adv_std_normalize=True, adv_leave_one_out=False,
            attn_implementation=VARLEN_FA4 if {"fa4", "fa4whole"} & set(flags) else args.attn,
            micro_batch_tokens=micros[0] if micros else args.micro_tokens,
            logit_chunk_tokens=8192 if "chunk8k" in flags else 4096,
            micro_batch_pad_tokens=pads[0] if pads else args.pad_tokens, prox_logp_method=prox,
            logit_grad_keep_gib=keep, gradient_checkpointing=checkpointing,
            mixed_precision=mp or "compute_copy", compile="compile" in flags, eval_interval=0,
            lora=LoraConfig(rank=args.lora, alpha=2 * args.lora) if args.lora else None)}),
        model=SimpleNamespace(device=str(device), dtype="bfloat16" if device.type == "cuda" else args.cpu_dtype,
                              seed=0, threads=1),
        rollout_engine=SimpleNamespace(temperature=1.0),
        trainer_device=str(device), learning_rate=1e-6, mini_batch_size=mini_batch, train_workers=1,
        parallelism=SimpleNamespace(dp=1, tp=1, reshard_after_forward=True))


def padded(samples: list[dict]) -> dict[str, torch.Tensor]:
    """An update as ``torch_train.pad_batch`` hands it to the engine: [B, T] right-padded rows."""
    return pad(samples, torch.device("cpu"))


class EnginePath:
    """``TorchTrainEngine.update`` itself, from a folder of random weights. ``old`` imports the engine
    from another tree (--old-tree: a ``git archive`` of the trainer before this work) instead of this one."""

    def __init__(self, cfg: dict, args, device, variant: str = "compute_copy", old: bool = False):
        if old:
            sys.path.insert(0, str(Path(args.old_tree).resolve()))
            for name in [m for m in sys.modules if m == "areal_bus" or m.startswith("areal_bus.")]:
                del sys.modules[name]
        from areal_bus.engines.torch_train import TorchTrainEngine

        self.args, self.device, self.variant = args, device, variant
        lora = {"base_model": args.model_dir} if args.lora and not old else {}  # (the old tree has no LoRA)
        self.engine = TorchTrainEngine(bench_topology(args, device, 1, variant), args.model_dir, device=device, **lora)
        self.model = self.engine.model

    def update(self, samples: list[dict]) -> float:
        self.engine.mini_batch = math.ceil(len(samples) / self.args.mini_batches)  # --mini-batches steps
        return float(self.engine.update(padded(samples))["loss"])


def make_path(name: str, cfg: dict, args, device):
    """baseline | old | engine:<mixed_precision>[+compile][+loglinear]"""
    if name == "baseline":
        return Baseline(cfg, args, device)
    if name == "old":
        return EnginePath(cfg, args, device, old=True)
    kind, _, variant = name.partition(":")
    if kind not in ("engine", "old"):
        raise SystemExit(f"--paths: {name!r} is none of baseline, old, engine:<compute_copy|autocast>[+compile], "
                         f"old:<compute_copy|autocast>[+compile]")
    return EnginePath(cfg, args, device, variant or "compute_copy", old=kind == "old")


def first_mini_batch(path, samples: list[dict], k: int) -> set[int]:
    """The samples of an update's first mini-batch as the path's engine makes it: the first equal part,
    or, where the engine's tree has ``packing.mini_batch_members`` (since 2026-12-04), its members (on a
    padded GPU path neighbouring mini-batches trade a few samples)."""
    size = math.ceil(len(samples) / k)
    engine = getattr(path, "engine", None)
    members = getattr(sys.modules.get(type(engine).__module__), "mini_batch_members", None) if engine else None
    if members is None:
        return set(range(len(mini_batches(samples, k)[0])))
    return set(members([int(s["ids"].size) for s in samples], size, engine.pad_to)[0])


def measure(name: str, cfg: dict, updates, args, device) -> dict:
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    engine = make_path(name, cfg, args, device)
    times, losses = [], []
    first_s = None
    kernels = []  # FlashAttention-4's compiled kernels in this process, after the warm-up and at the end
    pauses = GcPauses()
    for i, samples in enumerate(updates):
        prof = None
        if i == args.warmup and "+fa4" in name:
            kernels.append(fa4_kernels())
        if i == args.warmup and "+gcfreeze" in name:  # what the warm-up made (compiled code) out of the collector's way
            gc.collect()
            gc.freeze()
        if i == args.warmup:
            gc.callbacks.append(pauses.observe)
        if i == args.warmup and "+noguard" in name:  # the warm-up compiled every graph: differentiating guards only
            torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        if args.profile and i == args.warmup:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            prof = profile(activities=acts)
            prof.start()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(engine.update(samples))
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        first_s = dt if first_s is None else first_s
        if i >= args.warmup:
            times.append(dt)
        if prof is not None:
            prof.stop()
            if args.trace:
                prof.export_chrome_trace(args.trace)
            key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            print(f"# profile of {name}, update {i + 1} ({dt:.3f} s)", file=sys.stderr)
            events = prof.key_averages()
            cpu_s = sum(e.self_cpu_time_total for e in events) / 1e6
            # Device time as the table's "Self CUDA time total": the kernels' own events only (an aten op's
            # device time is its kernels', so summing every event would count it twice).
            dev_s = sum(e.self_device_time_total for e in events
                        if e.device_type != torch.autograd.DeviceType.CPU) / 1e6
            syncs = sum(e.count for e in events if "Synchronize" in e.key)
            launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
            print(f"# {name}: host (self CPU) {cpu_s:.3f} s, device {dev_s:.3f} s, {launches} kernel launches, "
                  f"{syncs} synchronizations", file=sys.stderr)
            print(events.table(sort_by=key, row_limit=18, max_name_column_width=50), file=sys.stderr)
            print(events.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=50), file=sys.stderr)
    timed = updates[args.warmup:]
    tokens = sum(s["ids"].size for u in timed for s in u)
    sq = sum(int(s["ids"].size) ** 2 for u in timed for s in u)
    n_params = sum(p.numel() for p in engine.model.parameters())  # a tied embedding once
    # LoRA: the frozen base's parameters and the adapters' (trainable) apart, as train_flops counts them
    adapter = sum(p.numel() for p in engine.model.parameters() if p.requires_grad) if args.lora else 0
    # The proximal forward is counted for the samples outside each update's first mini-batch only: today's
    # engine takes the first one's from its training forward, so the old engines' extra pass is not work.
    later = [s for u in timed for i, s in enumerate(u) if i not in first_mini_batch(engine, u, args.mini_batches)]
    if "loglinear" in name:  # no proximal forward at all
        later = []
    proximal = (sum(s["ids"].size for s in later), sum(int(s["ids"].size) ** 2 for s in later))
    loss_tokens = lambda samples: sum(int((s["mask"][1:] != 0).sum()) for s in samples)  # a sample's first: none
    head = (cfg["vocab_size"] * cfg["hidden_size"], loss_tokens([s for u in timed for s in u]), loss_tokens(later))
    flops = train_flops(n_params - adapter, cfg["num_hidden_layers"], cfg["hidden_size"], tokens, sq, proximal, head,
                        adapter=adapter)
    if "+fa4" in name:
        kernels.append(fa4_kernels())
    secs = sum(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"params": n_params, "tokens_per_s": tokens / secs, "mfu": flops / secs / PEAK_BF16,
            "s_per_update": secs / len(times), "first_s": first_s, "peak_gib": peak, "loss": losses[-1],
            "update_s": [round(t, 3) for t in times], "fa4_kernels": kernels, "fa4_replay": fa4_replay_stats(),
            "gc": pauses.summary()}


class GcPauses:
    """Python's garbage collections during the timed updates: how many of each generation and their
    seconds (a full collection over torch.compile's and the CuTe DSL's millions of objects is long)."""

    def __init__(self):
        self.count, self.secs, self.t0 = [0, 0, 0], [0.0, 0.0, 0.0], 0.0

    def observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.secs[info["generation"]] += time.perf_counter() - self.t0

    def summary(self) -> str:
        return " ".join(f"gen{g} {n}x {s:.3f}s" for g, (n, s) in enumerate(zip(self.count, self.secs)))


def fa4_kernels() -> int:
    """How many kernels FlashAttention-4 has compiled in this process (its in-memory caches): a count that
    grows during the timed updates means a JIT compilation (seconds) inside them."""
    from flash_attn.cute import interface

    caches = [getattr(f, "compile_cache", None) for f in vars(interface).values() if callable(f)]
    return sum(len(getattr(c, "cache", c)) for c in caches if c is not None)  # JITCache keeps a dict


# Inductor settings a path may try on top of +compile (bench-only, to see whether they pay before any
# becomes an engine knob): the generated wrapper in C++ instead of Python (fewer host microseconds per
# launch), independent kernels combined into one launch, matmul templates autotuned against cuBLAS.
INDUCTOR_FLAGS = {"cppwrap": {"cpp_wrapper": True}, "combo": {"combo_kernels": True},
                  "autotune": {"max_autotune_gemm": True}}


def worker(args, device) -> int:
    """One path at one shape, in a process of its own (memory, compiled code and CUDA state start clean)."""
    cfg = SHAPES[args.shapes]
    import torch._inductor.config as inductor_config

    for flag in args.worker.split("+")[1:]:
        for key, value in INDUCTOR_FLAGS.get(flag, {}).items():
            setattr(inductor_config, key, value)
    # As the trainer node does (train_engine.build_train_engine: model.threads, default 1). torch's default,
    # one thread per core, slows every host-side op of the update (the profile in bench/RESULTS.md).
    torch.set_num_threads(args.threads)
    updates = make_updates(args, cfg["vocab_size"])
    lora = [int(f[4:]) for f in args.worker.split("+")[1:] if f.startswith("lora") and f[4:].isdigit()]
    args.lora = lora[0] if lora else args.lora  # +loraN: this path's rank (0: full fine-tuning)
    try:
        r = measure(args.worker, cfg, updates, args, device)
    except torch.OutOfMemoryError as exc:
        r = {"error": f"out of GPU memory ({str(exc).splitlines()[0][:90]})"}
    with contextlib.suppress(Exception):  # graph breaks and recompilations in compiled paths
        from torch._dynamo.utils import counters
        print(f"# {args.worker}: graph breaks {sum(counters['graph_break'].values())} "
              f"{dict(list(counters['graph_break'].items())[:3])}, recompiles "
              f"{sum(counters['recompiles'].values())}, unique graphs {counters['stats']['unique_graphs']}",
              file=sys.stderr)
    if "update_s" in r:
        print(f"# {args.worker}: timed updates (s) {r['update_s']}"
              + (f", FlashAttention-4 kernels compiled after the warm-up / at the end {r['fa4_kernels']}"
                 if r["fa4_kernels"] else "")
              + (f", FlashAttention-4 calls {r['fa4_replay']}" if r["fa4_replay"] else "")
              + f", garbage collections {r['gc']}", file=sys.stderr)
    print("WORKER " + json.dumps(r), flush=True)
    return 0


BIG = ("7b", "8b")  # shapes whose random folder is written in bfloat16 (float32 would be 30+ GB on disk)


def random_folder(cfg: dict, path: str, device, dtype: str) -> None:
    """Seeded random weights in the Hugging Face layout at ``path``. Float32 ones come from
    ``make_random_model`` on the CPU (as every table before 2026-12-06); bfloat16 ones (the 7B/8B shapes) are
    drawn on the GPU, where a CPU draw of 8 billion numbers would cost minutes of the lent machine."""
    if dtype == "float32" or device.type != "cuda":
        save_pretrained(make_random_model(cfg, seed=0, dtype=dtype), path)
        return
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.device(device):
        model = CausalLM(ModelConfig.from_hf(cfg)).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=gen)
    save_pretrained(model, path)
    del model
    torch.cuda.empty_cache()


def run_path(name: str, shape: str, model_dir: str, argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, *argv, "--shapes", shape, "--worker", name, "--model-dir", model_dir]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"no result in {WORKER_TIMEOUT_S} s"}
    noise = ("Loading weights", "W1", "I1")
    sys.stderr.write(proc.stderr[-6000:] if proc.returncode else
                     "".join(line + "\n" for line in proc.stderr.splitlines() if line.strip() and not line.startswith(noise)))
    for line in proc.stdout.splitlines():
        if line.startswith("WORKER "):
            return json.loads(line[len("WORKER "):])
    return {"error": f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or ['?'])[-1][:120]}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="0.5b,1.5b", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--paths", default="baseline,old,engine:autocast,engine:compute_copy,engine:compute_copy+compile",
                    help="comma list: baseline (the old path re-implemented), old (the engine of --old-tree), "
                         "engine:<compute_copy|autocast>[+compile][+loglinear][+nokeep][+chunk8k][+padN][+keepN]"
                         "[+fa4] (today's engine and its knobs); the first that runs is the base of the last column")
    ap.add_argument("--old-tree", default=None, help="a folder holding the old areal_bus/ (for the path 'old')")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cpu-dtype", default="float32", help="cpu: model.dtype of the engine paths")
    ap.add_argument("--update-tokens", type=int, default=65536)
    ap.add_argument("--mini-batches", type=int, default=4, help="PPO mini-batches (optimizer steps) per update")
    ap.add_argument("--micro-tokens", type=int, default=16384, help="engine: trainer_engine.micro_batch_tokens")
    ap.add_argument("--pad-tokens", type=int, default=None, help="engine: trainer_engine.micro_batch_pad_tokens "
                    "(default: the engine's own, 1024 on CUDA)")
    ap.add_argument("--baseline-rows", type=int, default=8, help="baseline: padded rows per forward")
    ap.add_argument("--attn", default=VARLEN, help=f"engine: trainer_engine.attn_implementation ({VARLEN}: "
                    f"FlashAttention varlen, areal_bus/train/train_model.py; or sdpa, flex_attention)")
    ap.add_argument("--checkpointing", action="store_true", help="engine: trainer_engine.gradient_checkpointing")
    ap.add_argument("--weights-dtype", default=None, help="dtype of the random folder (float32; bfloat16 for 7b/8b)")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK", help="engine: trainer_engine.lora of this rank, "
                    "alpha 2 x RANK, all seven projections (0: full fine-tuning)")
    ap.add_argument("--profile", action="store_true", help="print each path's torch profile of its first timed update")
    ap.add_argument("--trace", default=None, help="with --profile (one path): write the chrome trace of the profiled "
                    "update to this file (read it with bench/trace_summary.py)")
    ap.add_argument("--median", type=float, default=500)
    ap.add_argument("--min-len", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of each path's process (the "
                    "trainer node's model.threads, default 1)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.worker:
        return worker(args, device)
    paths = args.paths.split(",")
    if "old" in paths and not args.old_tree:
        raise SystemExit("--paths old needs --old-tree DIR (mkdir DIR && git archive 7adbcb8 areal_bus | tar -x -C DIR)")
    argv = list(sys.argv[1:])
    for flag in ("--shapes", "--paths"):  # the parent's own: each worker gets one shape and one path
        while flag in argv:
            i = argv.index(flag)
            del argv[i:i + 2]
    print(f"# bench/trainer.py {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"updates of ~{args.update_tokens} tokens in {args.mini_batches} mini-batches, lengths lognormal median "
          f"{args.median:g} in {args.min_len}..{args.max_len}, attn {args.attn}, checkpointing {args.checkpointing}"
          + (f", LoRA rank {args.lora} alpha {2 * args.lora}" if args.lora else ", full fine-tuning"),
          flush=True)
    print(f"{'shape':6} {'path':30} {'tokens/s':>9} {'MFU':>6} {'s/update':>8} {'1st s':>6} {'peak GiB':>8} "
          f"{'loss':>8} {'vs 1st':>7}", flush=True)
    result = {}
    for shape in args.shapes.split(","):
        cfg = SHAPES[shape]
        base = None
        with tempfile.TemporaryDirectory(prefix="bench-trainer-") as work:
            random_folder(cfg, work, device, args.weights_dtype or ("bfloat16" if shape in BIG else "float32"))
            for name in paths:
                r = run_path(name, shape, work, argv)
                key = f"{shape}_{name.replace(':', '_').replace('+', '_')}"
                if "error" in r:
                    print(f"{shape:6} {name:30} {r['error']}", flush=True)
                    result[f"{key}_tokens_per_s"] = "none"
                    continue
                base = base or r["tokens_per_s"]
                print(f"{shape:6} {name:30} {r['tokens_per_s']:9.0f} {r['mfu']:6.1%} {r['s_per_update']:8.3f} "
                      f"{r['first_s']:6.1f} {r['peak_gib']:8.1f} {r['loss']:8.4f} {r['tokens_per_s'] / base:6.2f}x",
                      flush=True)
                result[f"{key}_tokens_per_s"] = round(r["tokens_per_s"])
                result[f"{key}_mfu"] = round(r["mfu"], 3)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
