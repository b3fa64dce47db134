"""``areal-bus plot``: curves from a run's logs, as a PNG.

Reads ``<log_dir>/train_steps.jsonl`` (one record per update, written by the trainer) and plots one
metric against the train step:

  loss        the update's loss
  reward      mean training reward per update, and the held-out evaluation reward where recorded
  throughput  samples per second between consecutive updates
  staleness   stacked share of each staleness (versions behind) among the samples of each update

Run: areal-bus plot --log-dir logs --metric reward --output reward.png
"""

from __future__ import annotations

import json
from pathlib import Path

METRICS = ("loss", "reward", "throughput", "staleness")


def load_steps(log_dir: str | Path) -> list[dict]:
    path = Path(log_dir) / "train_steps.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is --log-dir the run's logging.log_dir?")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{n}: not a JSON record") from None
    # A resumed run appends to the same file: keep the last record of each step.
    by_step = {r["step"]: r for r in records if "step" in r}
    return [by_step[s] for s in sorted(by_step)]


def plot(log_dir: str | Path, metric: str, output: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    steps = load_steps(log_dir)
    if not steps:
        raise ValueError(f"{log_dir}: no train steps recorded yet")
    x = [r["step"] for r in steps]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if metric == "loss":
        ax.plot(x, [r.get("loss", float("nan")) for r in steps], label="loss")
    elif metric == "reward":
        ax.plot(x, [r.get("reward", float("nan")) for r in steps], label="train reward (mean per update)", alpha=0.6)
        ev = [(r["step"], r["eval_reward"]) for r in steps if r.get("eval_reward") is not None]
        if ev:
            ax.plot(*zip(*ev), "o-", label="held-out eval reward (greedy)")
    elif metric == "throughput":
        t = [r["t_end"] for r in steps]
        rates = [s["samples"] / (t1 - t0) for s, t0, t1 in zip(steps[1:], t, t[1:]) if t1 > t0]
        ax.plot(x[1:len(rates) + 1], rates, label="samples/s")
    else:
        levels = sorted({int(k) for r in steps for k in r.get("staleness", {})})
        bottom = [0.0] * len(steps)
        for lvl in levels:
            share = []
            for r in steps:
                hist = r.get("staleness", {})
                total = sum(hist.values()) or 1
                share.append(hist.get(str(lvl), 0) / total)
            ax.bar(x, share, bottom=bottom, label=f"staleness {lvl}", width=1.0)
            bottom = [b + s for b, s in zip(bottom, share)]
    ax.set_xlabel("train step")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} — {Path(log_dir).resolve().name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    output = Path(output)
    fig.savefig(output)
    plt.close(fig)
    return output
