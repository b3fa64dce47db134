"""Asynchronous vs synchronous RL on the same code, through the real bus and real processes.

Each mode is a whole areal_bus system (bus, agent, 8 rollout workers, reward, trainer with 4 train
workers, weight broadcaster) started by supervisord from a rendered topology; the only difference is
``async.enabled``. Rollout and training use the simulated engines, whose costs are printed below: decode
time per step is nearly flat in batch size (memory-bound GPU decoding), output lengths are long-tailed
between 200 and 3,000 tokens, and training a batch costs time proportional to its tokens (a real share
of a synchronous step). Throughput is measured from the trainer's own step records over the steady
state (the first steps, while the pipeline fills, are left out). "change" is the mean |difference| of
an update's tokens per sample from one update to the next: how clumped by length the batches are
(sync's mix every length; async in arrival order alternates short and long batches).

Run:   .venv/bin/python bench/async_vs_sync.py            (about 3 minutes on 2 cores)
       .venv/bin/python bench/async_vs_sync.py --quick    (smaller, for a smoke test)
       .venv/bin/python bench/async_vs_sync.py --group-size 8 --in-order   (GRPO groups of 8, and one more
              async run with staleness.in_order: about 5 minutes)
       .venv/bin/python bench/async_vs_sync.py --policies keep per_token   (more async runs with the other
              over-stale policies: staleness.drop_at_consume false, staleness.per_token true; "tok/sample"
              shows which lengths each one trains)
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from areal_bus.engines.sim import draw_length  # noqa: E402
from areal_bus.config.topology import parse_topology  # noqa: E402
from bench.harness import run_system  # noqa: E402

WORKLOAD = {
    "rollout_workers": 8,
    "train_workers": 4,
    "global_batch_size": 64,
    "trigger_batch_size": 32,
    "mini_batch_size": 16,
    "staleness_threshold": 2,
    "queue_max_size": 256,
    "logging": {"log_interval": 5},
    "agent": {"framework": "sim", "prompt_len": 128, "reward_source": "rule"},
    "rollout_engine": {
        "kind": "sim", "max_batch": 32, "decode_step_s": 0.001, "decode_step_per_seq_s": 0.00001, "swap_s": 0.005,
        "output_len": {"dist": "lognormal", "median": 500, "sigma": 0.8, "min": 200, "max": 3000},
    },
    "trainer_engine": {"kind": "sim", "time_per_token_s": 0.0001, "update_overhead_s": 0.05},
}


POLICIES = {"drop": {}, "keep": {"drop_at_consume": False}, "per_token": {"per_token": True}}


def topology(mode: str, steps: int, scale: float, lead: str = "bound", group: int = 1,
             in_order: bool = False, policy: str = "drop") -> dict:
    topo = json.loads(json.dumps(WORKLOAD))
    topo["name"] = f"bench-{mode}"
    topo["staleness"] = {"lead": lead, **POLICIES[policy]}
    topo["experimental"] = lead != "bound" or policy == "per_token"  # lead adaptive, per_token: experimental
    if in_order:
        topo["staleness"]["in_order"] = True
    topo["agent"]["group_size"] = group
    topo["async"] = {"enabled": mode == "async"}
    topo["max_steps"] = steps
    re, te = topo["rollout_engine"], topo["trainer_engine"]
    re["decode_step_s"] *= scale
    re["decode_step_per_seq_s"] *= scale
    te["time_per_token_s"] *= scale
    te["update_overhead_s"] *= scale
    return topo


def describe(topo_dict: dict) -> list[str]:
    topo = parse_topology(topo_dict)
    re, te = topo.rollout_engine, topo.trainer_engine
    rng = np.random.default_rng(0)
    lens = np.array([draw_length(re.output_len, rng) for _ in range(200_000)])
    B = topo.global_batch_size
    maxes = lens[: (len(lens) // B) * B].reshape(-1, B).max(axis=1)
    tokens = B * (lens.mean() + topo.agent.prompt_len)
    train_s = te.update_overhead_s + tokens * te.time_per_token_s / topo.train_workers
    step = lambda b: re.decode_step_s + re.decode_step_per_seq_s * b  # noqa: E731
    sync_step = maxes.mean() * step(B / topo.rollout_workers) + train_s
    return [
        f"output lengths: lognormal median {re.output_len.median:g} sigma {re.output_len.sigma:g}, clipped "
        f"[{re.output_len.min}, {re.output_len.max}]: mean {lens.mean():.0f}, p50 {np.median(lens):.0f}, "
        f"p90 {np.percentile(lens, 90):.0f}, p99 {np.percentile(lens, 99):.0f}; longest of a {B}-batch "
        f"averages {maxes.mean():.0f} ({maxes.mean() / lens.mean():.1f}x the mean)",
        f"decode step: {step(1) * 1e3:.3f} ms at batch 1, {step(8) * 1e3:.3f} ms at 8, {step(32) * 1e3:.3f} ms at 32 "
        f"(nearly flat, as memory-bound decoding is)",
        f"training: {te.time_per_token_s * 1e6:.0f} us/token on one worker / {topo.train_workers} workers "
        f"+ {te.update_overhead_s * 1e3:.0f} ms per update = {train_s:.2f} s per {B}-sample batch, "
        f"{100 * train_s / sync_step:.0f}% of a modelled synchronous step ({sync_step:.2f} s)",
        f"layout: {topo.rollout_workers} rollout workers x {topo.rollout_engine.max_batch} slots, "
        f"{topo.train_workers} train workers, global batch {B}, trigger {topo.trigger_batch_size}, "
        f"staleness {topo.staleness_threshold}, queue {topo.queue_max_size}",
    ]


def run_mode(mode: str, steps: int, scale: float, keep: Path | None, lead: str = "bound", group: int = 1,
             in_order: bool = False, policy: str = "drop") -> list[dict]:
    label = f"{mode}-in_order" if in_order else mode
    label += "" if policy == "drop" else f"-{policy}"
    records, wall = run_system(topology(mode, steps, scale, lead, group, in_order, policy), label, keep, timeout=900)
    if len(records) < steps:
        raise RuntimeError(f"{label}: only {len(records)} of {steps} steps recorded")
    print(f"  {label}: {len(records)} steps in {wall:.1f} s wall (incl. start-up and shut-down)", flush=True)
    return records


def summarize(records: list[dict], warmup: int) -> dict:
    steady = records[warmup:]
    t0 = records[warmup - 1]["t_end"]
    t1 = steady[-1]["t_end"]
    samples = sum(r["samples"] for r in steady)
    tokens = sum(r["tokens"] for r in steady)
    train = sum(r["train_s"] for r in steady)
    wait = sum(r["wait_s"] for r in steady)
    hist: collections.Counter = collections.Counter()
    for r in records:
        hist.update({int(k): v for k, v in r["staleness"].items()})
    consumed = sum(r["samples"] for r in records)
    per_sample = np.array([r["tokens"] / max(r["samples"], 1) for r in steady])
    return {
        "mean_tokens": float(per_sample.mean()),
        "change": float(np.abs(np.diff(per_sample)).mean()) if per_sample.size > 1 else 0.0,
        "samples_per_s": samples / (t1 - t0), "tokens_per_s": tokens / (t1 - t0),
        "idle_fraction": wait / (wait + train), "staleness": dict(sorted(hist.items())),
        "stale_dropped": records[-1]["stale_dropped"], "consumed": consumed, "steps": len(records),
        "max_staleness": max(hist) if hist else 0,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--async-steps", type=int, default=40)
    p.add_argument("--sync-steps", type=int, default=12)
    p.add_argument("--scale", type=float, default=1.0, help="multiply every modelled time (2 = half the CPU load)")
    p.add_argument("--quick", action="store_true", help="few steps, for a smoke test")
    p.add_argument("--keep-logs", type=Path, default=None, help="copy each mode's logs here")
    p.add_argument("--lead", choices=("bound", "adaptive"), default="bound", help="staleness.lead of the async run")
    p.add_argument("--group-size", type=int, default=1, help="agent.group_size (GRPO groups) of every run")
    p.add_argument("--in-order", action="store_true", help="also an async run with staleness.in_order")
    p.add_argument("--policies", nargs="+", default=[], choices=("keep", "per_token"),
                   help="also an async run for each: keep (staleness.drop_at_consume false), per_token "
                        "(staleness.per_token true; the default async run drops whole samples at consumption)")
    args = p.parse_args()
    if args.quick:
        args.async_steps, args.sync_steps = 12, 5
    print("workload (simulated engines, real bus, real processes under supervisord):")
    for line in describe(topology("async", 1, args.scale, group=args.group_size)):
        print("  " + line)
    print("running:", flush=True)
    res = {}
    for mode, steps, warmup in (("async", args.async_steps, 4), ("sync", args.sync_steps, 2)):
        res[mode] = summarize(run_mode(mode, steps, args.scale, args.keep_logs, args.lead, args.group_size), warmup)
    if args.in_order:
        res["async in_order"] = summarize(run_mode("async", args.async_steps, args.scale, args.keep_logs, args.lead,
                                                   args.group_size, True), 4)
    for policy in args.policies:
        res[f"async {policy}"] = summarize(run_mode("async", args.async_steps, args.scale, args.keep_logs, args.lead,
                                                    args.group_size, policy=policy), 4)
    ratio = res["async"]["samples_per_s"] / res["sync"]["samples_per_s"]
    staleness = WORKLOAD["staleness_threshold"]
    print()
    width = max(len(k) for k in res)
    print(f"{'mode':<{width}} {'samples/s':>10} {'tokens/s':>10} {'trainer idle':>13} {'consumed':>9} "
          f"{'stale-dropped':>14} {'tok/sample':>10} {'change':>7}  staleness histogram")
    for mode, r in res.items():
        print(f"{mode:<{width}} {r['samples_per_s']:>10.2f} {r['tokens_per_s']:>10.0f} "
              f"{100 * r['idle_fraction']:>12.1f}% {r['consumed']:>9} {r['stale_dropped']:>14} "
              f"{r['mean_tokens']:>10.0f} {r['change']:>7.0f}  {r['staleness']}")
    over = sum(v for k, v in res["async"]["staleness"].items() if k > staleness)
    print(f"\nasync / sync samples/s: {ratio:.2f}x   (target >= 3.0; trainer idle in async <= 10%; "
          f"consumed over the staleness bound of {staleness}: {over})")
    extra = ""
    if "async in_order" in res:
        in_order = res["async in_order"]["samples_per_s"] / res["sync"]["samples_per_s"]
        print(f"async in_order / sync samples/s: {in_order:.2f}x")
        extra = f" in_order_ratio={in_order:.2f}"
    for policy in args.policies:
        r = res[f"async {policy}"]
        late = sum(v for k, v in r["staleness"].items() if k > staleness)
        print(f"async {policy} / sync samples/s: {r['samples_per_s'] / res['sync']['samples_per_s']:.2f}x, "
              + (f"consumed over the bound: {late}" if policy == "keep" else
                 f"started more than {staleness} versions back: {late} (their tokens past the bound masked)"))
        extra += f" {policy}_ratio={r['samples_per_s'] / res['sync']['samples_per_s']:.2f}"
    print(f"RESULT ratio={ratio:.2f} async_samples_per_s={res['async']['samples_per_s']:.2f} "
          f"sync_samples_per_s={res['sync']['samples_per_s']:.2f} "
          f"async_trainer_idle={res['async']['idle_fraction']:.3f} "
          f"sync_trainer_idle={res['sync']['idle_fraction']:.3f} over_stale_consumed={over} "
          f"stale_dropped={res['async']['stale_dropped']}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
