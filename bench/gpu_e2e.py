"""One-GPU end to end: the guess-the-number agent task at the Qwen2-0.5B shape, torch engines on one
GPU, asynchronous against synchronous, samples/s of each and the ratio, in one run.

The whole system runs as it does for a user: supervisord starts the bus, agents, one rollout worker,
reward, trainer and weight broadcaster as processes; the rollout worker and the trainer share the GPU
and hand each version over by CUDA IPC. The policy has the Qwen2-0.5B body (hidden 896, 24 layers,
14 heads, 2 kv heads, intermediate 4864) with seeded random weights in bf16 and the shipped tiny
model's character-level tokenizer (so the vocabulary, and the embedding, are the tokenizer's, not
Qwen's 151,936): throughput is the point here, not what it learns. Samples/s counts the samples the
trainer consumed after the first ``--skip`` updates (CUDA start-up and warm-up excluded).

``--engine vllm`` puts the rollout worker on vLLM (``rollout_engine.kind: vllm``, prefix caching on,
weights loaded from the trainer's CUDA IPC buffers into vLLM's own between steps) instead of the torch
engine; everything else is the same.

Run:  python3 bench/gpu_e2e.py                    (on the GPU machine: ~2-4 min)
      bash scripts/gpu_vllm.sh python3 bench/gpu_e2e.py --engine vllm      (vLLM installed by that script)
      python3 bench/gpu_e2e.py --device cuda:0 --trainer-device cuda:1   (two GPUs: rollout and trainer apart)
      .venv/bin/python bench/gpu_e2e.py --tiny --device cpu --steps 4 --skip 1   (a CPU smoke run)

The last line is ``RESULT async_sps=... sync_sps=... ratio=...``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import run_system  # noqa: E402

QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, max_position_embeddings=4096)


def build_model(out: Path, tiny: bool, dtype: str) -> int:
    """The tiny model's config and tokenizer with the 0.5B body, seeded random weights."""
    import shutil

    from areal_bus.modeling import make_random_model, num_params, save_pretrained

    src = ROOT / "models" / "tiny-guess"
    cfg = json.loads((src / "config.json").read_text())
    if not tiny:
        cfg.update(QWEN2_05B)
    model = make_random_model(cfg, seed=0, dtype=dtype)
    save_pretrained(model, out)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja", "vocab.json"):
            shutil.copy(f, out / f.name)
    return num_params(model)


def topology(model: Path, mode: str, args) -> dict:
    topo = yaml.safe_load((ROOT / "topology" / "default.yaml").read_text())
    topo.update(
        name=f"e2e-{mode}", rollout_workers=1, max_steps=args.steps, staleness_threshold=args.staleness,
        queue_max_size=4 * args.batch, trigger_batch_size=args.trigger or args.batch // 2, global_batch_size=args.batch,
        mini_batch_size=args.batch // 2, logging={"log_dir": "logs", "log_interval": 5, "save_interval": 0},
        model={"path": str(model), "dtype": args.dtype, "device": args.device, "trainer_device": args.trainer_device,
               "threads": 1 if args.device == "cpu" else 4},
        rollout_engine={"kind": args.engine, "max_batch": args.rollout_batch, "max_len": 256, "temperature": 1.0,
                        **({"gpu_memory_utilization": args.gpu_memory_utilization} if args.engine == "vllm" else {})},
        trainer_engine={"kind": "torch", "eps_clip": 0.2, "behav_imp_weight_cap": 5.0, "eval_interval": 0},
        nodes={"bus": {}, "agent": {"replicas": args.agents}, "reward": {"replicas": 1}, "trainer": {}, "weights": {}},
    )
    topo["agent"] = {**topo["agent"], "via": "bus"}
    topo["async"] = {"enabled": mode == "async"}
    return topo


def samples_per_second(records: list[dict], skip: int) -> tuple[float, int, float]:
    steps = sorted((r for r in records if r["step"] >= 0), key=lambda r: r["step"])
    if len(steps) <= skip:
        raise RuntimeError(f"only {len(steps)} updates; need more than --skip {skip}")
    counted = steps[skip:]
    t0 = steps[skip - 1]["t_end"] if skip else steps[0]["t_end"] - steps[0]["train_s"]
    span = counted[-1]["t_end"] - t0
    samples = sum(r["samples"] for r in counted)
    return samples / span, samples, span


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--trainer-device", default=None, help="the trainer's GPU when not --device (e.g. cuda:1)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="the tiny model's own shape (a smoke run)")
    ap.add_argument("--steps", type=int, default=12, help="updates per mode")
    ap.add_argument("--skip", type=int, default=2, help="first updates left out of samples/s")
    ap.add_argument("--batch", type=int, default=128, help="global_batch_size (trigger = half)")
    ap.add_argument("--trigger", type=int, default=0, help="trigger_batch_size (default: half the batch)")
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--rollout-batch", type=int, default=256, help="the rollout engine's max_batch")
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--keep-logs", type=Path, default=None)
    ap.add_argument("--engine", default="torch", choices=["torch", "vllm"], help="the rollout engine")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vllm: its share of the GPU")
    ap.add_argument("--modes", nargs="+", default=["async", "sync"], choices=["async", "sync"])
    args = ap.parse_args()
    if args.device == "cpu" and args.dtype == "bfloat16":
        args.dtype = "float32"
    work = Path(tempfile.mkdtemp(prefix="ab-e2e-model-"))
    n = build_model(work / "model", args.tiny, args.dtype)
    hw = platform.processor() or platform.machine()
    if args.device.startswith("cuda"):
        import torch

        hw = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}; rollout on " \
             f"{args.device}, trainer on {args.trainer_device or args.device}"
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {hw}; policy {n / 1e6:.0f}M params ({args.dtype}), "
          f"global batch {args.batch}, trigger {args.trigger or args.batch // 2}, staleness {args.staleness}, "
          f"{args.agents} agents, {args.steps} updates per mode, first {args.skip} "
          f"left out; rollout engine {args.engine}", flush=True)
    out = {}
    for mode in args.modes:
        t0 = time.monotonic()
        records, wall = run_system(topology(work / "model", mode, args), mode, args.keep_logs, timeout=900)
        sps, samples, span = samples_per_second(records, args.skip)
        train_s = sum(r["train_s"] for r in records if r["step"] >= args.skip)
        out[mode] = sps
        print(f"{mode:6s} {sps:9.1f} samples/s  ({samples} samples in {span:.1f} s; trainer busy "
              f"{100 * train_s / span:.0f}%; wall {wall:.0f} s incl. start, {time.monotonic() - t0:.0f} s)", flush=True)
    ratio = out["async"] / out["sync"] if len(out) == 2 else float("nan")
    print(f"RESULT engine={args.engine} " + " ".join(f"{m}_sps={v:.2f}" for m, v in out.items()) + f" ratio={ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
