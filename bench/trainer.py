"""The trainer's update at real sizes on one GPU: today's path against the packed path, same data, same run.

Workload (the seed's): sample lengths lognormal (median 500, sigma 0.8) clipped to 200..3000 tokens,
the first 64 of each a prompt outside the loss, gathered into updates of ~--update-tokens tokens (64k),
each update --mini-batches PPO mini-batches (one optimizer step each), random token ids, advantages
+1/-1, behaviour log-probabilities -log(vocab) (a random-weight model's, so importance weights ~1).
Both paths run the same decoupled PPO objective with a proximal-logprob forward before the steps.

  baseline  today's trainer path (areal_bus/engines/torch_train.py before the packed path): the
            hand-written decoder (areal_bus/modeling.py) in pure bf16 (weights and AdamW state, the
            README's GPU advice), rows right-padded to the longest of their forward, full [rows, T,
            vocab] float32 logits. A mini-batch is forwarded --baseline-rows rows at a time (gradient
            accumulated), because the whole mini-batch padded does not fit in memory at 3000 tokens.
            CAVEAT (measured 2026-12-01): this re-implementation runs ~3x slower than the old engine
            itself (bench/trainer_parallel.py at 7adbcb8 on similar rows), so its ratios overstate the
            packed path's gain; bench/RESULTS.md has the same-run comparison against the real engine.
  packed    transformers' Qwen2ForCausalLM (areal_bus/train_model.py) with float32 master weights and
            AdamW state, bf16 autocast compute, samples packed end to end into micro-batches of
            <= --micro-tokens tokens (attention within each sample: --attn areal_varlen, torch's FlashAttention varlen
            kernel, or transformers' sdpa / flex_attention), the
            log-probabilities by chunks of the lm_head under checkpointing; --checkpointing adds
            activation checkpointing, --compile compiles each decoder layer.

FLOPs (for MFU): 6 N per token (forward + backward, N = parameters with the tied embedding once as the
lm_head matmul) + 2 N per token for the proximal forward, + causal attention (2 x layers x hidden x
sum len^2 per forward, x3 with backward), all over real (unpadded) tokens; peak 989 TFLOP/s (H100/H200
dense bf16 datasheet). Printed per shape and path: tokens/s, MFU, seconds per update, peak memory, and
the packed/baseline ratio. Last line: ``RESULT ...``.

Run:  python3 bench/trainer.py                                    (one GPU; 0.5B and 1.5B shapes, ~3 min)
      python3 bench/trainer.py --shapes 0.5b --paths packed --attn sdpa
      .venv/bin/python bench/trainer.py --device cpu --shapes tiny --update-tokens 4000 --steps 1   (checks the script)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
# Before torch: the baseline's padded logits come in many sizes; segments that grow avoid fragmentation.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from areal_bus.loss import decoupled_ppo_loss  # noqa: E402
from areal_bus.modeling import QWEN2_0_5B, TINY_QWEN2, make_random_model, token_logprobs  # noqa: E402
from areal_bus.train_model import VARLEN, Packed, _register_varlen, autocast, pack, packed_logprobs, train_flops  # noqa: E402

PEAK_BF16 = 989e12
PROMPT = 64
SHAPES = {
    "tiny": {**TINY_QWEN2, "max_position_embeddings": 4096},
    "0.5b": QWEN2_0_5B,
    "1.5b": {**QWEN2_0_5B, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2},
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
    per = math.ceil(len(samples) / k)
    return [samples[i:i + per] for i in range(0, len(samples), per)]


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


# -- the packed path --------------------------------------------------------------------------
class PackedPath:
    def __init__(self, cfg: dict, args, device):
        import transformers

        hf = transformers.Qwen2Config(**{k: v for k, v in cfg.items() if k != "model_type"})
        _register_varlen()
        torch.manual_seed(0)
        self.model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.float32,
                                                                   attn_implementation=args.attn).to(device)
        self.model.config.use_cache = False
        if args.checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if args.compile:
            for layer in self.model.model.layers:
                layer.compile(dynamic=True)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6, weight_decay=0.0, fused=device.type == "cuda")
        self.micro = args.micro_tokens
        self.k = args.mini_batches
        self.device = device

    def update(self, samples: list[dict]) -> float:
        losses = []
        for mb in mini_batches(samples, self.k):
            packs: list[Packed] = [p.to(self.device) for p in pack(mb, self.micro)]
            with torch.no_grad(), autocast(self.device, torch.bfloat16):
                prox = [packed_logprobs(self.model, p)[0] for p in packs]
            total = sum(float(p.mask.sum()) for p in packs)
            self.opt.zero_grad(set_to_none=True)
            for p, q in zip(packs, prox):
                with autocast(self.device, torch.bfloat16):
                    lp, _ = packed_logprobs(self.model, p)
                loss, _ = decoupled_ppo_loss(lp, q, p.behav, p.adv, p.mask)
                (loss * float(p.mask.sum()) / total).backward()
                losses.append(float(loss.detach()))
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
        return float(np.mean(losses))


def measure(path_cls, cfg, updates, args, device) -> dict:
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    engine = path_cls(cfg, args, device)
    times, losses = [], []
    for i, samples in enumerate(updates):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(engine.update(samples))
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    timed = updates[args.warmup:]
    tokens = sum(s["ids"].size for u in timed for s in u)
    sq = sum(int(s["ids"].size) ** 2 for u in timed for s in u)
    n_params = sum(p.numel() for p in engine.model.parameters())  # a tied embedding once
    flops = train_flops(n_params, cfg["num_hidden_layers"], cfg["hidden_size"], tokens, sq, recompute=True)
    secs = sum(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    del engine
    gc.collect()
    return {"params": n_params, "tokens_per_s": tokens / secs, "mfu": flops / secs / PEAK_BF16, "s_per_update": secs / len(times),
            "peak_gib": peak, "loss": losses[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="0.5b,1.5b", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--paths", default="baseline,packed")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--update-tokens", type=int, default=65536)
    ap.add_argument("--mini-batches", type=int, default=4, help="PPO mini-batches (optimizer steps) per update")
    ap.add_argument("--micro-tokens", type=int, default=16384, help="packed: tokens per micro-batch")
    ap.add_argument("--baseline-rows", type=int, default=8, help="baseline: padded rows per forward")
    ap.add_argument("--attn", default=VARLEN, help=f"packed: transformers attn_implementation ({VARLEN}: "
                    f"FlashAttention varlen, areal_bus/train_model.py; or sdpa, flex_attention)")
    ap.add_argument("--checkpointing", action="store_true", help="packed: activation checkpointing")
    ap.add_argument("--compile", action="store_true", help="packed: torch.compile each decoder layer")
    ap.add_argument("--median", type=float, default=500)
    ap.add_argument("--min-len", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    print(f"# bench/trainer.py {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"update ~{args.update_tokens} tokens in {args.mini_batches} mini-batches, attn {args.attn}, "
          f"checkpointing {args.checkpointing}, compile {args.compile}")
    print(f"{'shape':6} {'path':9} {'tokens/s':>10} {'MFU':>6} {'s/update':>9} {'peak GiB':>9} {'loss':>8}")
    result = {}
    for shape in args.shapes.split(","):
        cfg = SHAPES[shape]
        updates = make_updates(args, cfg["vocab_size"])
        row = {}
        for name in args.paths.split(","):
            try:
                r = measure({"baseline": Baseline, "packed": PackedPath}[name], cfg, updates, args, device)
            except torch.OutOfMemoryError:
                gc.collect()
                torch.cuda.empty_cache()
                print(f"{shape:6} {name:9} out of GPU memory", flush=True)
                result[f"{shape}_{name}_tokens_per_s"] = "oom"
                continue
            row[name] = r
            print(f"{shape:6} {name:9} {r['tokens_per_s']:10.0f} {r['mfu']:6.1%} {r['s_per_update']:9.3f} "
                  f"{r['peak_gib']:9.1f} {r['loss']:8.4f}", flush=True)
            result[f"{shape}_{name}_tokens_per_s"] = round(r["tokens_per_s"])
            result[f"{shape}_{name}_mfu"] = round(r["mfu"], 3)
        if "baseline" in row and "packed" in row:
            ratio = row["packed"]["tokens_per_s"] / row["baseline"]["tokens_per_s"]
            print(f"{shape:6} packed/baseline {ratio:.2f}x")
            result[f"{shape}_ratio"] = round(ratio, 2)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
