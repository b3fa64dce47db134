"""Torch rollout engine decode speed on CUDA, beside Hugging Face transformers ``generate`` on the same
GPU in the same run, and a check of the engine's logprobs against a full forward pass.

Model: Qwen2-0.5B's shape (24 layers, hidden 896, 14 heads over 2 kv heads, vocabulary 151936), or
another of bench/trainer.py's table (``--shape``, bench/shapes.py: 1.5b, 3b, 7b, 8b Llama-3.1-8B, qwen3-8b;
the transformers rows take Qwen2 shapes only: --no-hf for the others), random weights (std 0.02; drawn
on the GPU), bf16. Workload: a batch of 128-token random prompts, exactly ``--new``
new tokens each (no EOS stop), greedy. Rows, each after one warm-up run of the same shape:

  hf generate     transformers Qwen2ForCausalLM holding the same weights, sdpa attention, greedy,
                  min_new_tokens = max_new_tokens (the warm-up is a 4-token generate)
  engine          TorchRolloutEngine: static cache, decode steps replayed as CUDA graphs (the default
                  on CUDA); "cold s" is its warm-up run, graph captures included
  engine T=1      the same at temperature 1 (batched sampling on the device)
  engine matmul   the same with attention as two batched matmuls instead of SDPA (--variants; also
                  "engine flash_varlen": FlashAttention-2's varlen kernel over each row's own length,
                  rollout_engine.decode_attention)
  engine +compile the same with the step's elementwise work fused by torch.compile (--variants; for sdpa
                  and, on CUDA, flash_varlen; rollout_engine.decode_compile)
  engine eager    the static-cache step without graphs (--variants)
  engine gather   the older path: a per-step gather of each slot's cache (--variants)

tokens/s = batch x new tokens / wall time from the first add_request (or the generate call) to the
last completion, prefill included. On CUDA a "bandwidth bound (decode)" row per batch: the card's device
copy rate is measured first (a 2 GiB device-to-device copy, bytes read + written per second), and the
batch's decode steps can go no faster than reading, each step, the weights once (an untied input
embedding left out: a step reads its rows only) and every running row's keys and values so far, at that
rate; prefill is not counted, so the bound is generous. Each engine row says its share of it; with
``--profile`` the profiled step's own bound (its rows' cached tokens) beside the step's time. ``--longtail``: each row's new tokens drawn instead (lognormal, median
500, sigma 0.8, clipped 200..3,000 and seeded, as the headline's workload; no HF row), so the batch
drains as rows finish and the longest rows set the length bucket: where the decode attention's cost per
row (the bucket's length, or the row's own) shows; tokens/s counts the tokens drawn. Then the logprob
check: 8 prompts sampled at temperature 1 for ``--new`` tokens; the logprobs the engine recorded vs
``modeling.token_logprobs`` of prompt + output (the trainer's recompute, bf16) and vs transformers' full
forward; the gather path's gap beside it.

With ``--vllm``: the vLLM engine on the same weights (written as a checkpoint folder) and the same
prompts, in a process of its own (bench/vllm_engine.py): a "vllm T=1" row beside "engine T=1" (same
sampling: temperature 1, top_p 1, the sampled token's logprob recorded by both), its logprob gap, and
with ``--swap`` / ``--prefix`` the CUDA IPC weight swap and the 5-turn prefix-caching rows.
``--shape 1.5b`` takes Qwen2-1.5B's body (28 layers, hidden 1536, 12 heads over 2 kv heads).

Needs torch, numpy and transformers (not pyzmq, pydantic or structlog); ``--vllm`` needs vLLM.

Run:  python3 bench/engine.py                          (CUDA host: about 2 minutes)
      python3 bench/engine.py --no-hf --vllm --swap --prefix     (+ vLLM; scripts/gpu-host/gpu_vllm.sh installs it)
      python3 bench/engine.py --no-hf --vllm --new 2048 --batches 256      (the long-output shape)
      python3 bench/engine.py --variants               (+ the other attentions, eager and gather rows)
      python3 bench/engine.py --shape 8b --no-hf --batches 64 256 --profile    (8B-class decode against its bound)
      python3 bench/engine.py --no-hf --longtail --batches 256 --variants   (long-tailed lengths)
      python3 bench/engine.py --no-hf --longtail --batches 256 --variants --rows engine 'engine flash_varlen' \
          'engine sdpa+compile' 'engine flash_varlen+compile'          (the attentions and fusion alone)
      ... --profile        (then each row's decode step: replay time, kernels a step, their device time)
      .venv/bin/python bench/engine.py --tiny --device cpu     (anywhere: a tiny model, end to end)

The last line is ``RESULT ...`` with tokens/s, the ratios to HF, and the logprob gaps; the target is
>= 10x HF at batch 256.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import numpy as np  # noqa: E402
import torch  # noqa: E402

from areal_bus.engines.cuda_decode import ATTENTION  # noqa: E402
from areal_bus.engines.torch_engine import TorchRolloutEngine  # noqa: E402
from areal_bus.wire.messages import GenerateRequest  # noqa: E402
from areal_bus.model.modeling import TINY_QWEN2, kv_bytes_per_token, make_random_model, token_logprobs  # noqa: E402
from bench.shapes import random_model, shapes  # noqa: E402

LOGPROB_BATCH = 8
SHAPES = {k: v for k, v in shapes().items() if k != "tiny"}  # bench/trainer.py's table (bench/shapes.py)


def run_vllm(model, args, prompts: dict[int, torch.Tensor], lp_prompts: torch.Tensor) -> dict:
    """bench/vllm_engine.py on these weights and prompts, in its own process; its VLLM_JSON result."""
    from areal_bus.model.modeling import save_pretrained

    work = Path(tempfile.mkdtemp(prefix="ab-vllm-bench-"))
    save_pretrained(model, work / "model")
    np.savez(work / "prompts.npz", logprob=lp_prompts.cpu().numpy().astype(np.int32),
             **{f"b{b}": p.cpu().numpy().astype(np.int32) for b, p in prompts.items()})
    cmd = [sys.executable, str(Path(__file__).with_name("vllm_engine.py")), "--model", str(work / "model"),
           "--prompts", str(work / "prompts.npz"), "--new", str(args.new)]
    cmd += ["--swap"] * args.swap + ["--prefix"] * args.prefix
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.vllm_timeout)
    lines = proc.stdout.splitlines()
    print("\n".join("    | " + ln for ln in lines if not ln.startswith("VLLM_JSON ")), flush=True)
    found = [ln for ln in lines if ln.startswith("VLLM_JSON ")]
    if proc.returncode or not found:
        raise RuntimeError(f"bench/vllm_engine.py failed (exit {proc.returncode}); its output is above")
    return json.loads(found[-1].removeprefix("VLLM_JSON "))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def hf_model(model, device, dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**model.cfg.to_hf(dtype), attn_implementation="sdpa")
    with torch.device(device):
        hf = Qwen2ForCausalLM(config).to(dtype)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"HF model does not take our weights: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return hf.eval()


@torch.inference_mode()
def run_hf(hf, prompts: torch.Tensor, new: int) -> float:
    """Seconds for one greedy generate of exactly ``new`` tokens per row (after a short warm-up)."""
    kw = dict(attention_mask=torch.ones_like(prompts), do_sample=False, pad_token_id=0)
    hf.generate(prompts, max_new_tokens=4, min_new_tokens=4, **kw)
    sync(prompts.device)
    t0 = time.perf_counter()
    out = hf.generate(prompts, max_new_tokens=new, min_new_tokens=new, **kw)
    sync(prompts.device)
    assert out.shape[1] == prompts.shape[1] + new, out.shape
    return time.perf_counter() - t0


def requests(prompts: torch.Tensor, new: int | list[int], temperature: float, tag: str) -> list[GenerateRequest]:
    """One request per prompt for ``new`` tokens (a count per row, or one for all)."""
    lengths = new if isinstance(new, list) else [new] * len(prompts)
    return [GenerateRequest(request_id=f"{tag}{i}", episode_id=f"{tag}{i}", ticket=0, min_version=0,
                            max_tokens=n, temperature=temperature, prompt_ids=p.cpu().numpy().astype(np.int32))
            for i, (p, n) in enumerate(zip(prompts, lengths))]


def longtail_lengths(batch: int, seed: int = 0) -> list[int]:
    """New tokens per row as the headline draws them (engines.sim.draw_length: lognormal, median 500,
    sigma 0.8, clipped 200..3,000), seeded."""
    from areal_bus.engines.sim import draw_length
    from areal_bus.config.topology import LengthDistribution

    dist = LengthDistribution(dist="lognormal", median=500, sigma=0.8, min=200, max=3000)
    rng = np.random.default_rng(seed)
    return [draw_length(dist, rng) for _ in range(batch)]


def generate(engine: TorchRolloutEngine, reqs: list[GenerateRequest]) -> tuple[float, dict]:
    """Seconds from the first add_request to the last completion, and the completions by id."""
    sync(engine.device)
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    out = {}
    while len(out) < len(reqs):
        out |= {c.request_id: c for c in engine.step()}
    sync(engine.device)
    return time.perf_counter() - t0, out


def copy_rate(device: torch.device, gib: float = 2.0, reps: int = 7) -> float:
    """The card's measured device copy rate, bytes moved (read + written) per second: the median of
    ``reps`` device-to-device copies of ``gib`` GiB, after one untimed."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    free(device)
    return 2 * gib * 2**30 / float(np.median(times[1:]))


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter once, less an untied input embedding (a
    step reads only its rows); a tied one is the head, read whole."""
    cfg = model.cfg
    n = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied embedding once
    emb = model.model.embed_tokens.weight
    return n - (0 if cfg.tie_word_embeddings else emb.numel() * emb.element_size())


def decode_bound_s(model, prompt: int, lengths: list[int], rate: float, dtype: torch.dtype) -> tuple[float, float]:
    """(seconds, bytes) the decode steps of one batch need at least at ``rate``: each step reads the weights
    once and every running row's keys and values (its prompt and the tokens so far); the first token of
    each row comes from its prefill, not counted (so the bound leaves prefill out: a generous bound)."""
    per_token = kv_bytes_per_token(model.cfg, dtype)
    w = weight_bytes(model)
    total = 0
    for t in range(1, max(lengths)):  # step t feeds each running row its t-th token
        rows = [n for n in lengths if n > t]
        total += w + per_token * sum(prompt + t for _ in rows)
    return total / rate, total


def row_key(what: str) -> str:
    """A row's name as a RESULT key: "engine sdpa+compile" -> engine_sdpa_compile, "engine T=1" -> engine_t1."""
    return what.replace(" ", "_").replace("=", "").replace("+", "_").lower()


def make_engine(model, args, batch: int, mode: str, attention: str | None = None) -> TorchRolloutEngine:
    # A round cache length keeps the length buckets multiples of 128 (the fused attention kernel
    # wants the mask's length a multiple of 16, or pads it).
    # ``attention`` "ATTN+compile": that attention with the step's elementwise work fused.
    max_len = -(-(args.prompt + (3000 if args.longtail else args.new) + 1) // 128) * 128
    attention, _, fused = (attention or args.attention).partition("+")
    return TorchRolloutEngine(model, max_batch=batch, max_len=max_len, device=args.device,
                              dtype=model.lm_head.weight.dtype, eos_token_ids=[], static_decode=mode != "gather",
                              cuda_graphs=mode == "graphs", attention=attention, fuse_decode=fused == "compile",
                              max_prefill_tokens=16384)


def run_engine(model, args, prompts: torch.Tensor, mode: str, temperature: float = 0.0,
               attention: str | None = None) -> tuple[float, float]:
    """(warm seconds, cold seconds) for one batch at ``mode``: the cold run captures the graphs."""
    engine = make_engine(model, args, len(prompts), mode, attention)
    new = longtail_lengths(len(prompts)) if args.longtail else args.new
    cold, _ = generate(engine, requests(prompts, new, temperature, "w"))
    warm, out = generate(engine, requests(prompts, new, temperature, "t"))
    want = new if isinstance(new, list) else [new] * len(prompts)
    assert all(out[f"t{i}"].output_ids.size == n for i, n in enumerate(want))
    del engine
    free(torch.device(args.device))
    return warm, cold


@torch.inference_mode()
def profile_step(model, args, batch: int, attention: str | None) -> dict:
    """Where one decode step's time goes, for ``batch`` rows half-way through the long tail (each row at
    prompt + half its drawn length; the longest sets the length bucket): the step as the engine runs it
    (a CUDA graph replay on CUDA; median of 20, wall time to a device sync), and the same step run eagerly under
    torch.profiler: its kernels (ops on CPU) per step, their summed device time, and the heaviest kinds.
    Device time well under the replay's says the step waits between small kernels, not in them."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    engine = make_engine(model, args, batch, "graphs" if cuda and not args.no_graphs else "eager", attention)
    fast = engine.fast
    gen = torch.Generator().manual_seed(2)
    slots = list(range(batch))
    ids = torch.randint(0, model.cfg.vocab_size, (batch,), generator=gen).tolist()
    positions = [min(args.prompt + n // 2, engine.max_len - 2) for n in longtail_lengths(batch)]
    for _ in range(3):  # capture (and compile) first
        fast.decode(slots, ids, positions)
    sync(device)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        fast.decode(slots, ids, positions)
        sync(device)
        times.append(time.perf_counter() - t0)
    b = fast.batch_buckets[np.searchsorted(fast.batch_buckets, batch)]
    length = fast.len_buckets[np.searchsorted(fast.len_buckets, max(positions) + 1)]
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    activities = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    reps = 3
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(reps):
            fast._forward(b, length)
        sync(device)
    # On CUDA the device events are the kernels (and copies); on CPU the top-level aten ops stand for them.
    events = [e for e in prof.events() if e.device_type == kind and (cuda or (e.cpu_parent is None
                                                                             and e.name.startswith("aten::")))]
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name, []).append(e.device_time if cuda else e.cpu_time)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:6]
    del engine, fast
    free(device)
    return {"step_ms": float(np.median(times)) * 1e3, "bucket": (b, length), "kernels": len(events) / reps,
            "kv_tokens": sum(p + 1 for p in positions),
            "kernel_ms": sum(sum(v) for v in by_name.values()) / reps / 1e3,
            "top": [(name, sum(v) / reps / 1e3, len(v) // reps) for name, v in top]}


def logprob_gaps(model, hf, args, prompts: torch.Tensor, mode: str) -> dict[str, float]:
    """The engine's recorded logprobs (temperature 1) vs full forward passes of prompt + output."""
    engine = make_engine(model, args, len(prompts), mode)
    _, out = generate(engine, requests(prompts, args.new, 1.0, "lp"))
    del engine
    ids = torch.stack([torch.cat([p, torch.from_numpy(out[f"lp{i}"].output_ids).long().to(p.device)])
                       for i, p in enumerate(prompts)])
    recorded = torch.from_numpy(np.stack([out[f"lp{i}"].logprobs for i in range(len(prompts))])).to(ids.device)
    n = prompts.shape[1]
    with torch.inference_mode():
        ours = token_logprobs(model, ids, temperature=1.0)[:, n:].float()
        logits = hf(input_ids=ids).logits[:, n - 1:-1].float()
        theirs = torch.log_softmax(logits, -1).gather(-1, ids[:, n:, None]).squeeze(-1)
    gap, gap_hf = (recorded - ours).abs(), (recorded - theirs).abs()
    free(torch.device(args.device))
    return {"max": gap.max().item(), "mean": gap.mean().item(), "max_hf": gap_hf.max().item(),
            "mean_hf": gap_hf.mean().item()}


def efficient_sdpa_ok(model, device) -> str:
    """Whether SDPA's memory-efficient kernel accepts what StaticDecoder gives it (grouped queries,
    a strided view of the cache, a broadcast additive mask); if not, SDPA falls back to math."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg, b, length = model.cfg, 4, 256
    kv, g, d = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
    cache = torch.randn(b, kv, 512, d, device=device, dtype=torch.bfloat16)
    q = torch.randn(b, kv, g, d, device=device, dtype=torch.bfloat16)
    mask = torch.zeros(b, 1, 1, length, device=device, dtype=torch.bfloat16)
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q, cache[:, :, :length], cache[:, :, :length], attn_mask=mask)
        return "yes"
    except RuntimeError as e:  # deliberately tolerated: this is the question being asked
        return f"no ({str(e).splitlines()[0][:120]})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny test model (batches 4, 8; 16-token prompts)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 64 256 (tiny: 4 8)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128; tiny: 16)")
    ap.add_argument("--new", type=int, default=None, help="new tokens per prompt (default 256; tiny: 16)")
    ap.add_argument("--attention", default="sdpa", choices=sorted(ATTENTION))
    ap.add_argument("--variants", action="store_true", help="add the other attentions, eager and gather rows")
    ap.add_argument("--longtail", action="store_true", help="new tokens per row drawn as the headline's (lognormal "
                    "median 500, 200..3,000), not --new for every row; no HF row")
    ap.add_argument("--rows", nargs="+", default=None, help="only these rows, by name (e.g. engine 'engine "
                    "sdpa+compile'); default all that the other flags ask for")
    ap.add_argument("--profile", action="store_true", help="after the rows: where one decode step's time goes, "
                    "for each engine row's attention at the largest batch (profile_step)")
    ap.add_argument("--no-graphs", action="store_true", help="the engine row without CUDA graphs")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (ratios are then not printed)")
    ap.add_argument("--shape", default="0.5b", choices=sorted(SHAPES), help="the model body (random weights)")
    ap.add_argument("--vllm", action="store_true", help="add the vLLM engine's rows (bench/vllm_engine.py)")
    ap.add_argument("--swap", action="store_true", help="--vllm: time a CUDA IPC weight swap mid-generation")
    ap.add_argument("--prefix", action="store_true", help="--vllm: prefill per turn of a 5-turn agent, cache on/off")
    ap.add_argument("--vllm-timeout", type=float, default=400)
    args = ap.parse_args()
    args.batches = args.batches or ([4, 8] if args.tiny else [64, 256])
    args.prompt = args.prompt or (16 if args.tiny else 128)
    args.new = args.new or (16 if args.tiny else 256)
    args.no_hf = args.no_hf or args.longtail  # HF generate makes one length for every row
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if device.type == "cpu":
        torch.set_num_threads(min(4, torch.get_num_threads()))
    cfg = TINY_QWEN2 if args.tiny else SHAPES[args.shape]
    t0 = time.perf_counter()
    if not args.tiny and cfg["model_type"] != "qwen2" and not args.no_hf:
        raise SystemExit(f"--shape {args.shape}: the transformers rows take Qwen2 shapes only; add --no-hf")
    model = (make_random_model(cfg, seed=0, device=device, dtype=dtype, std=0.2) if args.tiny
             else random_model(cfg, device, dtype))
    hf = None if args.no_hf else hf_model(model, device, dtype)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    name = "tiny qwen2" if args.tiny else f"{args.shape} shape ({cfg['model_type']})"
    print(f"model {name} {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"params {str(dtype).removeprefix('torch.')} on {gpu}; torch {torch.__version__}; prompts {args.prompt} "
          f"tokens, {'long-tailed new tokens (median 500, 200..3,000)' if args.longtail else f'{args.new} new tokens'} "
          f"each; built in {time.perf_counter() - t0:.1f} s", flush=True)
    main_mode = "eager" if args.no_graphs or device.type != "cuda" else "graphs"
    if device.type == "cuda":
        print(f"SDPA memory-efficient kernel takes the decode step's shapes: {efficient_sdpa_ok(model, device)}")
    gen = torch.Generator().manual_seed(1)
    result = {}
    batch_prompts = {}
    rate = None
    if device.type == "cuda":  # the memory-bandwidth bound's denominator
        rate = copy_rate(device)
        print(f"device copy rate (2 GiB d2d, read + written) {rate / 1e12:.2f} TB/s; decode reads per step: weights "
              f"{weight_bytes(model) / 1e9:.2f} GB + {kv_bytes_per_token(model.cfg, dtype) / 1e3:.1f} KB of keys and "
              f"values per cached token", flush=True)
        result["copy_tb_s"] = round(rate / 1e12, 3)
    print(f"{'batch':>5}  {'what':<27} {'tokens/s':>10} {'x hf':>6} {'warm s':>7} {'cold s':>7}", flush=True)
    for batch in args.batches:
        prompts = torch.randint(0, model.cfg.vocab_size, (batch, args.prompt), generator=gen).to(device)
        batch_prompts[batch] = prompts
        lengths = longtail_lengths(batch) if args.longtail else [args.new] * batch
        tokens = sum(lengths)
        hf_tps = None
        bound_tps = None
        if rate is not None:
            bound_s, moved = decode_bound_s(model, args.prompt, lengths, rate, dtype)
            bound_tps = tokens / bound_s
            print(f"{batch:>5}  {'bandwidth bound (decode)':<27} {bound_tps:>10.0f} {'':>6} {bound_s:>7.2f} {'':>7}   "
                  f"({moved / 1e9:.1f} GB read by {max(lengths) - 1} decode steps; prefill not counted)", flush=True)
            result[f"bound_tok_s_{batch}"] = round(bound_tps)
        if hf is not None:
            secs = run_hf(hf, prompts, args.new)
            hf_tps = tokens / secs
            print(f"{batch:>5}  {'hf generate':<27} {hf_tps:>10.0f} {1.0:>6.2f} {secs:>7.2f} {'':>7}", flush=True)
            result[f"hf_tok_s_{batch}"] = round(hf_tps)
        todo = [("engine", main_mode, 0.0, None), ("engine T=1", main_mode, 1.0, None)]
        if args.variants:
            todo += [(f"engine {other}", main_mode, 0.0, other) for other in sorted(ATTENTION)
                     if other != args.attention and (other != "flash_varlen" or device.type == "cuda" or args.tiny)]
            todo += [(f"engine {a}+compile", main_mode, 0.0, f"{a}+compile")
                     for a in dict.fromkeys([args.attention] + (["flash_varlen"] if device.type == "cuda" else []))]
            todo += [("engine gather", "gather", 0.0, None)]
            if main_mode == "graphs":
                todo.insert(-1, ("engine eager", "eager", 0.0, None))
        if args.rows:
            todo = [t for t in todo if t[0] in args.rows]
        for what, mode, temperature, attention in todo:
            warm, cold = run_engine(model, args, prompts, mode, temperature, attention)
            tps = tokens / warm
            ratio = tps / hf_tps if hf_tps else float("nan")
            of_bound = f"   {tps / bound_tps:.0%} of the bound" if bound_tps else ""
            print(f"{batch:>5}  {what:<27} {tps:>10.0f} {ratio:>6.2f} {warm:>7.2f} {cold:>7.2f}{of_bound}", flush=True)
            result[f"{row_key(what)}_tok_s_{batch}"] = round(tps)
            if bound_tps:
                result[f"{row_key(what)}_of_bound_{batch}"] = round(tps / bound_tps, 3)
            if what == "engine" and hf_tps:
                result[f"ratio_{batch}"] = round(ratio, 2)
    if args.profile:
        batch = max(args.batches)
        unit = "kernels" if device.type == "cuda" else "ops"
        for what, _, _, attention in dict.fromkeys((t for t in todo if t[1] == main_mode and t[2] == 0.0)):
            p = profile_step(model, args, batch, attention)
            print(f"profile {what} at batch {batch}, bucket {p['bucket']}: step {p['step_ms']:.2f} ms "
                  f"({'graph replay' if main_mode == 'graphs' else 'eager'}); eager {p['kernels']:.0f} {unit} a step, "
                  f"{p['kernel_ms']:.2f} ms of device time", flush=True)
            if rate is not None:  # the same step's bound: the weights and these rows' keys and values, read once
                step_bytes = weight_bytes(model) + kv_bytes_per_token(model.cfg, dtype) * p["kv_tokens"]
                bound_ms = step_bytes / rate * 1e3
                print(f"    bandwidth bound of this step: {step_bytes / 1e9:.2f} GB in {bound_ms:.2f} ms; the step takes "
                      f"{p['step_ms'] / bound_ms:.2f}x that ({bound_ms / p['step_ms']:.0%} of the bound)", flush=True)
                result[f"{row_key(what)}_step_bound_ms"] = round(bound_ms, 2)
            for name, ms, count in p["top"]:
                print(f"    {ms:>7.3f} ms  {count:>4} x  {name[:90]}", flush=True)
            key = row_key(what)
            result |= {f"{key}_step_ms": round(p["step_ms"], 2), f"{key}_kernels": round(p["kernels"]),
                       f"{key}_kernel_ms": round(p["kernel_ms"], 2)}
    lp_prompts = torch.randint(0, model.cfg.vocab_size, (LOGPROB_BATCH, args.prompt), generator=gen).to(device)
    if args.vllm:
        free(device)
        v = run_vllm(model, args, batch_prompts, lp_prompts)
        for batch, row in v["rows"].items():
            torch_tps = result.get(f"engine_t1_tok_s_{batch}")
            print(f"{int(batch):>5}  {'vllm T=1':<19} {row['tok_s']:>10.0f} {'':>6} {row['warm_s']:>7.2f} "
                  f"{row['cold_s']:>7.2f}   ({row['tok_s'] / torch_tps:.2f}x engine T=1)", flush=True)
            result[f"vllm_t1_tok_s_{batch}"] = round(row["tok_s"])
        result |= {"vllm": v["vllm"], "vllm_start_s": round(v["start_s"]),
                   "vllm_logprob_max_abs_diff": f"{v['logprob']['max']:.3g}",
                   "vllm_logprob_mean_abs_diff": f"{v['logprob']['mean']:.3g}"}
        for version, sw in v.get("swap", {}).items():
            print(f"vllm swap to v{version} over CUDA IPC mid-generation: load_weights {sw['swap_ms']:.1f} ms, "
                  f"publish to serving {sw['publish_to_serving_ms']:.1f} ms, tags {'ok' if sw['tags_ok'] else 'WRONG'}")
            result[f"vllm_swap_ms_v{version}"] = round(sw["swap_ms"], 1)
            result[f"vllm_publish_to_serving_ms_v{version}"] = round(sw["publish_to_serving_ms"], 1)
            result["vllm_swap_tags_ok"] = result.get("vllm_swap_tags_ok", True) and sw["tags_ok"]
        if "prefix" in v:
            print("5-turn agent, per conversation: prompt tokens / prefilled tokens / turn seconds")
            for mode, turns in v["prefix"].items():
                print(f"  {mode:<8} " + "  ".join(f"t{i + 1}: {t['prompt_tokens']}/{t['prefilled']}/{t['turn_s']:.2f}s"
                                                  for i, t in enumerate(turns)))
            for mode in ("cache", "no_cache"):
                result[f"prefill_per_turn_{mode}"] = "/".join(str(t["prefilled"]) for t in v["prefix"][mode])
    if hf is None:
        print("logprob check needs transformers (drop --no-hf)")
    else:
        print(f"logprobs at temperature 1, {LOGPROB_BATCH} x {args.new} tokens: |recorded - full forward|", flush=True)
        gaps = {mode: logprob_gaps(model, hf, args, lp_prompts, mode) for mode in dict.fromkeys([main_mode, "gather"])}
        for mode, g in gaps.items():
            print(f"  {mode:<7} vs ours: max {g['max']:.2e} mean {g['mean']:.2e}   vs transformers: "
                  f"max {g['max_hf']:.2e} mean {g['mean_hf']:.2e}", flush=True)
        g = gaps[main_mode]
        # bf16 tolerance: no worse than the gather path (the reference the CPU tests pin to float32
        # exactness) by more than bf16 noise.
        tol = max(0.05 if dtype == torch.bfloat16 else 1e-4, 2 * gaps["gather"]["max"])
        ok = g["max"] <= tol
        print(f"  {main_mode} path within tolerance {tol:.4f}: {'PASS' if ok else 'FAIL'}", flush=True)
        result |= {"logprob_max_abs_diff": f"{g['max']:.3g}", "logprob_mean_abs_diff": f"{g['mean']:.3g}",
                   "logprob_max_abs_diff_hf": f"{g['max_hf']:.3g}", "logprob_ok": ok}
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    return 0 if result.get("logprob_ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
