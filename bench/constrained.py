"""Grammar-constrained decoding's cost in the torch engine: decode tokens/s with none, a quarter and all
of the batch constrained by a JSON-schema grammar, beside the unconstrained batch, in the same run.

Workload: ``--batch`` rows of 32-token random prompts, temperature 1, exactly ``--new`` tokens each. The
grammar is a JSON array of objects (a name string, an integer, a boolean, an optional array of enums)
with at least 100,000 items, so no constrained row can end early and every row decodes every step: the
rows compare at a fixed batch. Rows, each the median of ``--repeats`` interleaved runs after one warm-up
run of each (CUDA graph captures, xgrammar's Triton kernel):

  unconstrained   a fresh engine, no grammar ever seen: the baseline
  0% grammar      the same batch on an engine that has compiled the grammar and served it (its matcher
                  machinery exists): what rows without a grammar pay for the feature (nothing expected)
  25% grammar     every fourth row constrained
  100% grammar    every row constrained

tokens/s = rows x (new - 1) / the wall time of the decode steps (the first step, the prefill, is left
out); "mask ms/step" is the host time the step spends in ``grammar.TokenMask.apply`` (the matchers
filling the bitmask, its copy and the masking kernel's launch; on CUDA the kernel itself runs on the
device, in the step's time). The engine decodes through its static step on CUDA (CUDA graphs) and eagerly
on CPU. After the table: whether every constrained output so far is a prefix the grammar accepts.

Model: ``--model`` a checkpoint folder (default models/tiny-guess, its character-level tokenizer, 99
ids), or ``--shape``: random weights (bf16 on CUDA) over the vocabulary of ``--tokenizer`` (a folder;
default models/tiny-guess) rounded up to a multiple of 64, in Qwen2-0.5B's body (``0.5b``) or a 2-layer
one (``small``, for a CPU). Pass a real BPE tokenizer (SmolLM2's 49,152 ids: its tokenizer.json and
tokenizer_config.json in a folder) for the matchers' real work: it grows with the vocabulary, and with
the ids xgrammar counts as special (a vocabulary padded by 100k ids past its tokenizer's made each
accept 4x slower, ``grammar``'s docstring), which is why the vocabulary is the tokenizer's here.

Run:  .venv/bin/python bench/constrained.py                       (CPU: the tiny model, ~10 s)
      .venv/bin/python bench/constrained.py --shape small --tokenizer DIR --batch 16 --new 48   (CPU, a BPE vocabulary)
      python3 bench/constrained.py --device cuda --shape 0.5b --tokenizer DIR --batch 256 --new 256   (a CUDA host)

Needs torch, numpy, transformers and xgrammar (scripts/gpu-host/host_wheels.sh carries it to a GPU host).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import numpy as np  # noqa: E402
import torch  # noqa: E402
import xgrammar as xgr  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from areal_bus.engines.torch_engine import TorchRolloutEngine  # noqa: E402
from areal_bus.model.modeling import QWEN2_0_5B, ModelConfig, make_random_model  # noqa: E402
from areal_bus.wire.messages import GenerateRequest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "models" / "tiny-guess"
PROMPT_TOKENS = 32
ITEM = {"type": "object", "additionalProperties": False, "required": ["name", "n", "ok"],
        "properties": {"name": {"type": "string", "maxLength": 16}, "n": {"type": "integer"}, "ok": {"type": "boolean"},
                       "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 100_000}  # no row can complete it within --new tokens
GRAMMAR = str(xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False))
ROWS = (("unconstrained", None), ("0% grammar", 0.0), ("25% grammar", 0.25), ("100% grammar", 1.0))


def build_model(args, tokenizer, device, dtype):
    if args.shape is None:
        return args.model
    vocab = -(-len(tokenizer) // 64) * 64
    if args.shape == "0.5b":
        cfg = {**QWEN2_0_5B, "vocab_size": vocab}
    else:  # "small": a 2-layer body, for a CPU
        cfg = dataclasses.replace(ModelConfig.from_hf(TINY), vocab_size=vocab, hidden_size=256, intermediate_size=512,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return make_random_model(cfg, seed=0, std=0.02).to(device, dtype)


def run(make_engine, prompts, share: float | None, new: int, device) -> dict:
    """One batch to the end on a fresh engine; decode tokens/s and the mask's host ms a step."""
    engine = make_engine()
    if share is not None:  # the engine has served the grammar before this batch
        engine.add_request(_req("warm", prompts[0], 2, GRAMMAR))
        while not engine.step():
            pass
    every = round(1 / share) if share else 0
    constrained = {f"r{i}" for i in range(len(prompts)) if every and i % every == 0}
    for i, p in enumerate(prompts):
        engine.add_request(_req(f"r{i}", p, new, GRAMMAR if f"r{i}" in constrained else ""))
    engine.step()  # the prefill (and each row's first token)
    mask = engine.token_mask
    mask_s0 = mask.seconds if mask is not None else 0.0
    sync(device)
    t0, steps, done = time.perf_counter(), 0, []
    while len(done) < len(prompts):
        done += engine.step()
        steps += 1
    sync(device)
    wall = time.perf_counter() - t0
    mask_s = (mask.seconds if mask is not None else 0.0) - mask_s0
    return {"tok_s": len(prompts) * (new - 1) / wall, "mask_ms": mask_s / steps * 1e3,
            "valid": all(_accepted(engine, c.output_ids) for c in done if c.request_id in constrained)}


def _accepted(engine, ids) -> bool:
    """Whether a fresh matcher of the grammar accepts ``ids`` (the output so far, an incomplete document)."""
    matcher = engine.grammars.matcher(GRAMMAR)
    return all(matcher.accept_token(int(t)) for t in ids)


def _req(rid, prompt, new, grammar):
    return GenerateRequest(request_id=rid, episode_id=rid, ticket=0, min_version=0, max_tokens=new, temperature=1.0,
                           prompt_ids=prompt, grammar=grammar, ignore_eos=True)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 elsewhere")
    ap.add_argument("--model", default=str(TINY), help="a checkpoint folder (ignored with --shape)")
    ap.add_argument("--shape", choices=("0.5b", "small"), default=None)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: --model's, or tiny-guess's)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    tok_path = args.tokenizer or (args.model if args.shape is None else str(TINY))
    tokenizer = AutoTokenizer.from_pretrained(tok_path)
    model = build_model(args, tokenizer, device, dtype)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, len(tokenizer), PROMPT_TOKENS).astype(np.int32) for _ in range(args.batch)]

    def make_engine():
        return TorchRolloutEngine(model, max_batch=args.batch + 1, max_len=PROMPT_TOKENS + args.new + 2,
                                  device=device, dtype=dtype, seed=0, eos_token_ids=[], tokenizer=tokenizer)

    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"{dtype}, model {args.shape or args.model}, tokenizer {tok_path} ({len(tokenizer)} ids), "
          f"batch {args.batch}, {args.new} new tokens, grammar: JSON array of objects", flush=True)
    results = {name: [] for name, _ in ROWS}
    valid = True
    for rep in range(args.repeats + 1):  # the first round warms up (graphs, kernels) and is not counted
        for name, share in ROWS:
            out = run(make_engine, prompts, share, args.new, device)
            valid &= out["valid"]
            if rep:
                results[name].append(out)
    base = statistics.median(r["tok_s"] for r in results["unconstrained"])
    print(f"\n{'rows':<16}{'tokens/s':>12}{'vs free':>10}{'mask ms/step':>14}")
    for name, _ in ROWS:
        tok_s = statistics.median(r["tok_s"] for r in results[name])
        mask_ms = statistics.median(r["mask_ms"] for r in results[name])
        print(f"{name:<16}{tok_s:>12.0f}{tok_s / base:>10.3f}{mask_ms:>14.3f}")
    print(f"\nevery constrained output accepted by its grammar: {valid}")
    print("RESULT " + json.dumps({name: round(statistics.median(r["tok_s"] for r in results[name]), 1)
                                  for name, _ in ROWS} | {"valid": valid}))


if __name__ == "__main__":
    main()
