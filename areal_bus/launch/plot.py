"""``areal-bus plot``: curves from a run's logs, as a PNG.

Reads ``<log_dir>/train_steps.jsonl`` (one record per update, written by the trainer) and plots one
metric against the train step, for one run only: each record carries its run (the trainer's run
epoch, ``run``), and a file holding several runs (supervisord started twice by hand on one log_dir)
gets its newest plotted, with a note naming the others; ``areal-bus run`` moves a previous run's logs
to ``<log_dir>/runs/`` first, so there the file holds one run.

  loss        the update's loss
  reward      mean training reward per update, and the held-out evaluation reward where recorded
  throughput  samples per second between consecutive updates
  staleness   stacked share of each staleness (versions behind) among the samples of each update

Run: areal-bus plot --log-dir logs --metric reward --output reward.png
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

METRICS = ("loss", "reward", "throughput", "staleness")


@dataclass
class Steps:
    """The records of one run (the last of each step), and what else the file held."""

    records: list[dict]
    run: str | None  # the run epoch; None for records written before the trainer named its run
    others: list[str] = field(default_factory=list)  # the older runs left out, oldest first

    @property
    def note(self) -> str | None:
        """The words for the runs left out, or None when the file held only this one."""
        if not self.others:
            return None
        return (f"the file holds {len(self.others) + 1} runs; plotted the newest, run {self.run or '(unnamed)'} "
                f"(steps {self.records[0]['step']}-{self.records[-1]['step']}), not "
                f"{', '.join(r or '(unnamed)' for r in self.others)}")


def load_steps(log_dir: str | Path) -> Steps:
    path = Path(log_dir) / "train_steps.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is --log-dir the run's logging.log_dir?")
    runs: dict[str | None, list[dict]] = {}  # in order of first appearance; the newest is the last record's
    last = None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{n}: not a JSON record") from None
            if "step" in rec:
                last = rec.get("run")
                runs.setdefault(last, []).append(rec)
    # A trainer that supervisord restarted re-trains from its checkpoint in the same run: keep the
    # last record of each step.
    by_step = {r["step"]: r for r in runs.get(last, [])}
    return Steps([by_step[s] for s in sorted(by_step)], last, [r for r in runs if r != last])


def plot(log_dir: str | Path, metric: str, output: str | Path) -> tuple[Path, str | None]:
    """Write the PNG; returns its path and the note on runs left out (None when there were none)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    run = load_steps(log_dir)
    steps = run.records
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
    ax.set_title(f"{metric} — {Path(log_dir).resolve().name}" + (f", run {run.run}" if run.others else ""))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    output = Path(output)
    fig.savefig(output)
    plt.close(fig)
    return output, run.note
