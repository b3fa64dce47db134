"""Learning, asynchronous vs synchronous, on the embedded default (a tiny Qwen2 on guess-the-number).

Runs topology/default.yaml twice under supervisord, identical but for ``async.enabled``: same warm-start
model, same seed, same sample budget (max_steps x global_batch_size). The trainer evaluates greedily on
the same 64 held-out games every ``eval_interval`` updates. Prints both curves (eval reward by step, with
wall-clock time), the final rewards and the wall-clock ratio, and saves both curves in one plot.

Run:   .venv/bin/python bench/learning.py                  (about 4 minutes on 2 cores)
       .venv/bin/python bench/learning.py --via gateway    (the agent through the HTTP gateway, as the default)
       .venv/bin/python bench/learning.py --repeats 3      (3 pairs of runs, seeds 0..2: mean and spread
                                                           per mode, and async vs sync at equal samples)
       ... --seeds 1 --save DIR    (the pair of seed 1 only; each run's curve and summary as DIR/<mode>-seed1.json,
                                    written as each run ends)
       ... --seeds 3 4 5 6 --parallel 4   (four runs at a time, each its own supervisord; on one GPU they
                                    share it, so compare their curves by samples, not their speed; a run
                                    that fails, e.g. out of GPU memory, is named and its seed left out)
       ... --lora 16 --set learning_rate 1e-4   (LoRA adapters of rank 16 instead of every weight)
       .venv/bin/python bench/learning.py --combine DIR1 DIR2   (no runs: the seeds' summary over saved pairs,
                                                           e.g. one pair per GPU call)

Every run also prints what the system did (bench/gpu_e2e.py's summary over the updates after the first):
samples/s, generated tokens/s, the trainer's busy share, the rollout engine's running batch (and, on three
lines, that running batch over time with the updates' ends marked), the staleness histogram, drops and
samples trained over the bound, and the rollouts' output lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from areal_bus.config.topology import parse_topology  # noqa: E402
from bench.gpu_e2e import TIMELINE_KEY, summarise  # noqa: E402
from bench.harness import override, run_logged  # noqa: E402


def run_mode(mode: str, base: dict, model: Path, keep: Path | None, tag: str = "",
             async_steps: int | None = None) -> dict:
    """One run: its step records, wall time, curve and system summary (a JSON-able dict).
    ``async_steps``: the async run's updates, where they differ from the topology's max_steps."""
    topo = json.loads(json.dumps(base))
    if mode == "async" and async_steps:
        topo["max_steps"] = async_steps
    topo["name"] = f"learn-{mode}"
    topo["async"] = {"enabled": mode == "async"}
    topo["model"]["path"] = str(model)
    topo["logging"]["save_interval"] = 0
    logs = run_logged(topo, f"{mode}{tag}", keep)
    records = logs.records
    print(f"  {mode}{tag}: {sum(1 for r in records if r['step'] >= 0)} updates in {logs.wall:.0f} s wall", flush=True)
    print(f"  {mode}{tag}: {lengths(records)}", flush=True)
    try:
        summary = summarise(logs, 1)
    except RuntimeError as exc:
        summary, system = None, f"no system summary ({exc})"
    else:
        system = system_line(logs, summary)
    print(f"  {mode}{tag}: {system}", flush=True)
    if summary is not None:
        line, marks = summary.timeline
        print(f"  {mode}{tag}: running batch over the updates after the first ({len(line)} slices of "
              f"{summary.span / len(line):.1f} s, {TIMELINE_KEY}):\n  {mode}{tag}: |{line}|\n  {mode}{tag}:  {marks}",
              flush=True)
    if lags := lag_line(records):
        print(f"  {mode}{tag}: {lags}", flush=True)
    return {"mode": mode, "wall": logs.wall, "curve": curve(records), "points": by_samples(records),
            "samples": sum(r.get("samples", 0) for r in records if r["step"] >= 0), "system": system,
            "records": records}


def lag_line(records: list[dict]) -> str:
    """The trainer's per-lag diagnostics (loss.decoupled_ppo_loss's lag buckets) as means over the updates: each lag
    bucket's share of the trained tokens, its mean |log w| (how far the sampler had drifted from the
    proximal policy), and its shares capped and clipped; empty for an engine that logs none."""
    steps = [r for r in records if r["step"] >= 0 and "lag0.tokens" in r]
    if not steps:
        return ""
    mean = lambda k: sum(r.get(k, 0.0) for r in steps) / len(steps)
    parts = []
    for name in ("lag0", "lag1", "lag2", "lag3+"):
        share = mean(f"{name}.tokens")
        if share > 0:
            parts.append(f"{name} {share:.0%} of tokens |log w| {mean(name + '.abs_log_w'):.3f} capped "
                         f"{mean(name + '.capped'):.1%} clipped {mean(name + '.clipped'):.1%}")
    return "by lag: " + "; ".join(parts)


def system_line(logs, s) -> str:
    """What the system did over the updates after the first (``s``: bench/gpu_e2e.py's summary of that
    window, evaluations inside it included)."""
    steps = [r for r in logs.records if r["step"] >= 0]
    outs = [r["generated"] / r["samples"] for r in steps if r.get("generated") and r.get("samples")]
    out = f", output tokens per sample {min(outs):.0f}..{max(outs):.0f} (update means)" if outs else ""
    if len(outs) > 1:  # how unlike one update's batch is the next's: async batches clump by output length
        out += f", mean change {sum(abs(a - b) for a, b in zip(outs, outs[1:])) / (len(outs) - 1):.0f} update to update"
    if split := sum(r.get("split_groups", 0) for r in steps):  # groups trained in part (the trainer's overflow)
        out += f", groups taken in part {split}"
    if masked := sum(r.get("tokens_over_bound", 0) for r in steps):  # staleness.per_token
        trained = sum(r.get("tokens", 0) for r in steps)
        out += f", tokens over the bound masked {masked} ({masked / max(1, masked + trained):.1%} of the samples' loss tokens)"
    return (f"{s.sps:.1f} samples/s, {s.tps:.0f} generated tokens/s, trainer busy {s.busy:.0%}, running batch "
            f"{s.batch} (below half {s.below_half:.0%}), staleness {s.staleness}, dropped {s.dropped}, "
            f"over bound {s.over_bound}{out}")


def by_samples(records: list[dict]) -> list[tuple[int, float]]:
    """(samples trained so far, eval metric) at every evaluation."""
    key = "eval_accuracy" if any(r.get("eval_accuracy") is not None for r in records) else "eval_reward"
    done, out = 0, []
    for r in sorted(records, key=lambda r: r["step"]):  # step -1: the warm start's evaluation
        done += r.get("samples", 0) if r["step"] >= 0 else 0
        if r.get(key) is not None:
            out.append((done, r[key]))
    return out


def at_samples(points: list[tuple[int, float]], n: int) -> float:
    """The metric at ``n`` samples, linear between the evaluations around it (the last one past them)."""
    prev = (0, points[0][1])
    for cur in points:
        if cur[0] >= n:
            span = cur[0] - prev[0]
            return cur[1] if span == 0 else prev[1] + (cur[1] - prev[1]) * (n - prev[0]) / span
        prev = cur
    return points[-1][1]


def curve(records: list[dict]) -> list[tuple[int, float, float]]:
    """(updates done, seconds since the first record, eval metric) for every evaluation: held-out
    accuracy where the task marks episodes correct (math), else the eval reward."""
    t0 = records[0]["t_end"]
    key = "eval_accuracy" if any(r.get("eval_accuracy") is not None for r in records) else "eval_reward"
    return [(r["step"] + 1, r["t_end"] - t0, r[key]) for r in records if r.get(key) is not None]


def lengths(records: list[dict]) -> str:
    """Answer-length statistics of the evaluations (tokens per answer), where the trainer logs them."""
    means = [r["eval_tokens_mean"] for r in records if r.get("eval_tokens_mean") is not None]
    maxes = [r["eval_tokens_max"] for r in records if r.get("eval_tokens_max") is not None]
    if not means:
        return "no answer lengths logged"
    return (f"eval answer tokens: mean {means[0]:.0f} at the first evaluation, {means[-1]:.0f} at the last; "
            f"longest seen {max(maxes) if maxes else 'n/a'}")


def save_plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    for mode, pts in curves.items():
        a.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=mode)
        b.plot([p[1] for p in pts], [p[2] for p in pts], "o-", label=mode)
    a.set_xlabel("updates")
    b.set_xlabel("wall-clock seconds")
    for ax in (a, b):
        ax.set_ylabel("held-out greedy eval reward")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("guess-the-number, tiny Qwen2, async vs sync (same seed and sample budget)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", type=Path, default=ROOT / "topology" / "default.yaml")
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-guess")
    p.add_argument("--steps", type=int, default=None, help="updates per mode (default: the topology's max_steps)")
    p.add_argument("--async-steps", type=int, default=None,
                   help="updates in the async runs (default: as sync's): e.g. as many as async fits in sync's "
                        "wall time, to see whether it reaches sync's final accuracy sooner")
    p.add_argument("--plot", type=Path, default=ROOT / "bench" / "learning.png")
    p.add_argument("--keep-logs", type=Path, default=None)
    p.add_argument("--set", nargs=2, action="append", metavar=("KEY", "VALUE"),
                   help="override a topology field (dotted key, YAML value), e.g. --set learning_rate 5e-6")
    p.add_argument("--lora", type=int, default=0, metavar="RANK", help="train LoRA adapters of this rank (trainer_engine."
                   "lora: alpha 2 x RANK, all seven projections; a --set of trainer_engine.lora.* after it wins); "
                   "0: the topology's own (full fine-tuning unless it says otherwise)")
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs (async then sync), seed k in the k-th "
                   "(model.seed and agent.seed): mean and spread per mode instead of one pair's curves")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="one pair of runs per seed given (as --repeats, with the seeds named)")
    p.add_argument("--modes", nargs="+", choices=("async", "sync"), default=["async", "sync"],
                   help="with --seeds: run only these modes (e.g. an async variant against a saved sync run)")
    p.add_argument("--parallel", type=int, default=1,
                   help="with --seeds: run this many of the seeds' runs at once (on one GPU they share it: compare "
                        "their curves by samples, not their speed; and its memory: six SmolLM2 runs of "
                        "topology/smollm2-math-gpu.yaml overfilled an H200's 140 GiB and an H100's 80 GiB, "
                        "four fit the H200, two the H100; a run failing on CUDA out of memory is reported and "
                        "its seed left out)")
    p.add_argument("--save", type=Path, default=None, help="write each run's curve and summary as JSON here")
    p.add_argument("--combine", type=Path, nargs="+", default=None,
                   help="run nothing: the seeds' summary over --save folders of earlier invocations; a later "
                        "folder's run of a seed and mode replaces an earlier one's, so `--combine BOTH ASYNC_ONLY` "
                        "pairs the second's async runs (say with staleness.in_order) with the first's sync runs")
    p.add_argument("--window-from", type=int, default=None, metavar="SAMPLES",
                   help="the seeds' summary also averages async - sync over sync's evaluations from this many "
                        "trained samples on (default: from half the samples compared), e.g. the plateau of "
                        "longer runs, where one run's lead or lag on the rise no longer counts")
    p.add_argument("--via", choices=("bus", "gateway"), default="bus",
                   help="how the agent reaches the policy (the default topology uses the gateway; 'bus' "
                        "skips the HTTP layer, which on 2 cores costs a third of the throughput)")
    args = p.parse_args()
    if args.parallel < 1:
        p.error("--parallel: at least 1")
    if args.combine:
        return report(load_pairs(args.combine), args.window_from)
    if not (args.model / "config.json").exists():
        print(f"no model at {args.model}: run `python scripts/warmstart.py --out {args.model}` first", file=sys.stderr)
        return 2
    base = yaml.safe_load(args.topology.read_text())
    if args.steps:
        base["max_steps"] = args.steps
    override(base, args.lora, args.set)  # e.g. --lora 16 --set learning_rate 5e-6
    dataset = base.get("agent", {}).get("dataset") or {}
    for key in ("path", "eval_path"):  # the systems run from a temporary folder: the repo's data by full path
        if dataset.get(key) and not Path(dataset[key]).is_absolute():
            dataset[key] = str(ROOT / dataset[key])
    base.setdefault("agent", {})["via"] = args.via
    if args.via == "bus":
        base.get("nodes", {}).pop("gateway", None)
    elif not os.environ.get("AREAL_BUS_ADMIN_TOKEN"):
        os.environ["AREAL_BUS_ADMIN_TOKEN"] = secrets.token_urlsafe(24)
    parsed = parse_topology(base, str(args.topology))
    print(f"workload: {parsed.model.path} -> {args.model}, {parsed.rollout_workers} rollout workers, "
          f"global batch {parsed.global_batch_size} (GRPO groups of {parsed.agent.group_size}), "
          f"{parsed.max_steps} updates = {parsed.max_steps * parsed.global_batch_size} samples per mode, "
          f"staleness {parsed.staleness_threshold}, eval every {parsed.trainer_engine.eval_interval} updates on "
          f"{parsed.trainer_engine.eval_episodes} held-out games, learning rate {parsed.learning_rate:g}, "
          + (f"LoRA rank {parsed.trainer_engine.lora.rank} scale {parsed.trainer_engine.lora.scale:g}"
             if parsed.trainer_engine.lora else "full fine-tuning"))
    seeds = args.seeds if args.seeds is not None else (list(range(args.repeats)) if args.repeats > 1 else None)
    if seeds is not None:
        return repeated(args, base, seeds)
    res = {mode: run_mode(mode, base, args.model.resolve(), args.keep_logs, async_steps=args.async_steps)
           for mode in ("async", "sync")}
    if args.save:
        save_runs(args.save, res, None)
    print()
    print(f"{'update':>6}  {'async t(s)':>10} {'async eval':>10}  {'sync t(s)':>9} {'sync eval':>9}")
    a, s = res["async"]["curve"], res["sync"]["curve"]
    for i in range(max(len(a), len(s))):
        ca = f"{a[i][1]:>10.0f} {a[i][2]:>10.3f}" if i < len(a) else " " * 21
        cs = f"{s[i][1]:>9.0f} {s[i][2]:>9.3f}" if i < len(s) else ""
        print(f"{(a[i] if i < len(a) else s[i])[0]:>6}  {ca}  {cs}")
    start = a[0][2]
    fa, fs = a[-1][2], s[-1][2]
    # Greedy play of one secret is deterministic, so the 64 held-out games are 16 distinct games
    # four times over: one game changing moves the eval by 0.0625. The mean of the last three
    # evaluations is the steadier "final".
    ma, ms = (sum(p[2] for p in x[-3:]) / len(x[-3:]) for x in (a, s))
    wa, ws = res["async"]["wall"], res["sync"]["wall"]
    print(f"\nwarm start {start:.3f} -> async {fa:.3f} (+{fa - start:.3f}), sync {fs:.3f} (+{fs - start:.3f}); "
          f"|async - sync| = {abs(fa - fs):.3f}")
    print(f"mean of the last 3 evaluations: async {ma:.3f}, sync {ms:.3f}; |async - sync| = {abs(ma - ms):.3f}")
    print(f"wall clock: async {wa:.0f} s, sync {ws:.0f} s, async {ws / wa:.2f}x faster; "
          f"samples: async {res['async']['samples']}, sync {res['sync']['samples']}")
    save_plot({m: r["curve"] for m, r in res.items()}, args.plot)
    print(f"plot: {args.plot}")
    print(f"RESULT warm_start={start:.3f} async_final={fa:.3f} sync_final={fs:.3f} gap={abs(fa - fs):.3f} "
          f"last3_gap={abs(ma - ms):.3f} async_wall_s={wa:.0f} sync_wall_s={ws:.0f} speedup={ws / wa:.2f}")
    return 0


def save_runs(folder: Path, pair: dict, seed: int | None) -> None:
    """Each run of a pair as ``folder/<mode>[-seed<k>].json`` (what ``--combine`` reads back)."""
    folder.mkdir(parents=True, exist_ok=True)
    for mode, run in pair.items():
        name = f"{mode}.json" if seed is None else f"{mode}-seed{seed}.json"
        (folder / name).write_text(json.dumps({**run, "seed": seed}))


def load_pairs(folders: list[Path]) -> dict[int, dict]:
    """{seed: {mode: run}} from ``--save`` folders, a later folder's run of a seed and mode replacing an
    earlier one's; a seed needs both modes."""
    pairs: dict[int, dict] = {}
    for folder in folders:
        for f in sorted(folder.glob("*-seed*.json")):
            run = json.loads(f.read_text())
            pairs.setdefault(run["seed"], {})[run["mode"]] = run
    whole = {k: v for k, v in pairs.items() if set(v) == {"async", "sync"}}
    if not whole:
        raise SystemExit(f"--combine: no seed with both an async and a sync run in {', '.join(map(str, folders))}")
    return dict(sorted(whole.items()))


def repeated(args, base: dict, seeds: list[int]) -> int:
    """One pair of runs (async then sync) per seed (model.seed and agent.seed), then ``report``."""
    from concurrent.futures import ThreadPoolExecutor

    def one(job: tuple[int, str]) -> dict | None:
        k, mode = job
        topo = json.loads(json.dumps(base))
        topo.setdefault("model", {})["seed"] = k
        topo.setdefault("agent", {})["seed"] = k
        try:
            run = run_mode(mode, topo, args.model.resolve(), args.keep_logs, tag=f"-seed{k}",
                           async_steps=args.async_steps)
        except (RuntimeError, subprocess.TimeoutExpired) as e:  # failed (bench/harness.py says why) or hung:
            print(f"  {mode}-seed{k}: FAILED: {e}", flush=True)    # left out, the others go on
            return None
        if args.save:  # each run as it ends: an invocation cut short keeps the runs that finished
            save_runs(args.save, {mode: run}, k)
        return run

    jobs = [(k, mode) for k in seeds for mode in args.modes]
    pairs: dict[int, dict] = {}
    # Each run is its own supervisord in its own folder (endpoints and weight buffers named after it), so
    # runs may share a machine: --parallel N runs N at once (on one GPU they share it, so their samples/s
    # and wall times are not a lone run's; the curves by trained samples are what to compare).
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        for (k, mode), run in zip(jobs, pool.map(one, jobs)):
            if run is not None:
                pairs.setdefault(k, {})[mode] = run
    failed = [f"{mode}-seed{k}" for k, mode in jobs if mode not in pairs.get(k, {})]
    if set(args.modes) != {"async", "sync"}:
        return 1 if failed else 0  # one mode: its runs printed above, and saved for --combine with the other's
    whole = {k: pair for k, pair in pairs.items() if len(pair) == 2}
    if failed:
        print(f"failed, and their seeds left out of the comparison: {' '.join(failed)}", flush=True)
    if not whole:
        return 1
    report(whole, args.window_from)
    return 1 if failed else 0


def report(pairs: dict[int, dict], window_from: int | None = None) -> int:
    """Each run's final and last-three metric, wall time and samples; per mode the mean and standard
    deviation over seeds; per seed async - sync at equal samples (sync's metric against async's at the
    same count of trained samples, where async trained fewer), the same averaged over sync's evaluations
    from ``window_from`` samples on (default: half the samples compared), and the wall time async took to
    first reach sync's final last-three mean."""
    import statistics

    rows = {"async": [], "sync": []}
    gaps, late_gaps, catch = [], [], []
    for k, pair in pairs.items():
        for mode in ("async", "sync"):
            run = pair[mode]
            pts = [tuple(x) for x in run["points"]]
            last3 = sum(v for _, v in pts[-3:]) / len(pts[-3:])
            rows[mode].append((pts[-1][1], last3, run["wall"], pts[-1][0]))
            print(f"  seed {k} {mode}: start {pts[0][1]:.3f} final {pts[-1][1]:.3f} last-3 {last3:.3f}, "
                  f"{run['wall']:.0f} s, {pts[-1][0]} samples; {run.get('system', '')}", flush=True)
        a, s = ([tuple(x) for x in pair[m]["points"]] for m in ("async", "sync"))
        n = min(a[-1][0], s[-1][0])
        gaps.append(at_samples(a, n) - at_samples(s, n))
        # The same over every sync evaluation in the window: one evaluation's noise averaged out.
        lo = n / 2 if window_from is None else window_from
        later = [(done, v) for done, v in s if lo <= done <= n] or [(n, at_samples(s, n))]  # evals too sparse
        late_gaps.append(sum(at_samples(a, done) - v for done, v in later) / len(later))
        sync_curve = pair["sync"]["curve"]
        for key, target in (("last3", rows["sync"][-1][1]), ("final", sync_curve[-1][2])):
            reached = [t for _, t, v in pair["async"]["curve"] if v >= target]
            catch.append((key, reached[0] if reached else None, sync_curve[-1][1]))
    print()
    sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0
    fields = []
    for mode, rs in rows.items():
        f, l3, w = ([r[i] for r in rs] for i in range(3))
        print(f"{mode:5s}: final {statistics.mean(f):.3f} +- {sd(f):.3f}, last-3 {statistics.mean(l3):.3f} +- "
              f"{sd(l3):.3f}, wall {statistics.mean(w):.0f} +- {sd(w):.0f} s over {len(rs)} seeds")
        fields += [f"{mode}_final_mean={statistics.mean(f):.3f}", f"{mode}_final_sd={sd(f):.3f}",
                   f"{mode}_last3_mean={statistics.mean(l3):.3f}", f"{mode}_wall_s={statistics.mean(w):.0f}"]
    # The standard error of a mean gap over independent seeds: a 2-point claim needs it well under 0.02.
    se = lambda xs: sd(xs) / len(xs) ** 0.5  # noqa: E731
    print(f"async - sync at equal samples, per seed: {' '.join(f'{g:+.3f}' for g in gaps)}; mean "
          f"{statistics.mean(gaps):+.3f} (sd over seeds {sd(gaps):.3f}, standard error {se(gaps):.3f})")
    window = "half its samples" if window_from is None else f"{window_from} samples"
    print(f"async - sync at equal samples, mean over sync's evaluations from {window}, per seed: "
          f"{' '.join(f'{g:+.3f}' for g in late_gaps)}; mean {statistics.mean(late_gaps):+.3f} "
          f"(sd over seeds {sd(late_gaps):.3f}, standard error {se(late_gaps):.3f})")
    for key, label in (("last3", "final last-3 mean"), ("final", "final evaluation")):
        got = [(c, end) for k, c, end in catch if k == key]
        print(f"async first at sync's {label}, per seed (t from the warm start's evaluation; sync's t at its "
              "final in brackets): " + " ".join(("never" if c is None else f"{c:.0f} s") + f" [{end:.0f} s]"
                                                for c, end in got))
    sooner = sum(1 for k, c, end in catch if k == "final" and c is not None and c < end)
    fields.append(f"async_reached_sync_final_sooner={sooner}/{len(pairs)}")
    print("RESULT " + " ".join(fields) + f" equal_samples_gap_mean={statistics.mean(gaps):+.3f}"
          f" equal_samples_gap_se={se(gaps):.3f} late_gap_mean={statistics.mean(late_gaps):+.3f}"
          f" late_gap_se={se(late_gaps):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
