"""The run in TensorBoard and W&B (``logging.trackers``): every train_steps.jsonl record, as the trainer
writes it.

The trainer (nodes/trainer/wiring.py) hands each record it appends to ``log_dir/train_steps.jsonl`` to
``Trackers.log_record``. Its numbers become scalars under five sections (``scalars``): ``train/`` (loss,
reward, clip and cap fractions, importance weights, KL, gradient norm, entropy), ``eval/`` (the held-out
evaluation: ``eval_reward`` is ``eval/reward``), ``perf/`` (update and wait times, samples, tokens,
and samples/s and tokens/s between consecutive updates), ``staleness/`` (stale drops, duplicates,
samples over the bound, the mean staleness and each staleness's share of the batch) and ``lag/`` (the
per-lag importance-weight statistics, ``lag1.abs_log_w`` and so on, as the record names them); its
staleness counts become a histogram (``staleness/histogram``). The x axis is the policy version a
record ends at, i.e. the updates done: the start weights' evaluation is at 0 and the update train.log
shows as ``step=N`` at N + 1 (as verl counts: step 1 is the first update).

- tensorboard: event files in ``log_dir/tb/<run id>`` (``torch.utils.tensorboard``) and the resolved
  config as text; ``tensorboard --logdir logs/tb`` shows the runs side by side. A trainer restarted
  within its run (crash recovery) trains some steps again: its writer purges them from the earlier file.
- wandb: one W&B run per training run, id and name the run id, in project $WANDB_PROJECT (default
  ``areal_bus``), its config the resolved topology as every node dumps it (``dump_resolved``: secrets
  show as ``<redacted>``). wandb's own environment is honoured: WANDB_MODE=offline keeps the run on disk
  under $WANDB_DIR (default log_dir)/wandb/ for ``wandb sync``; online it needs ``wandb login`` or
  WANDB_API_KEY. A restarted trainer continues its W&B run (W&B ignores the steps it trains again).

The run id is the trainer's run epoch: the ``run`` every train_steps record carries, kept across trainer
restarts and ``areal-bus run --resume``.

A tracker that cannot start raises ``TrackerError`` naming it and what to do: the trainer stops at
start, since a run asked to be tracked is not to run untracked. One that raises later is logged once as
an error and dropped; training never stops for a tracker, and train_steps.jsonl keeps every record.

Run: list them in the topology (``logging: {trackers: [tensorboard, wandb]}``), then
  tensorboard --logdir logs/tb
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import structlog

from areal_bus.config.topology import dump_resolved

WANDB_PROJECT = "areal_bus"
"""The W&B project when $WANDB_PROJECT is unset."""

_NOT_SCALARS = frozenset({"t_end", "run", "step", "staleness"})
"""Record fields that are no scalar: the wall time and the step (the x axis), the run (the run's name)
and the staleness counts (a histogram, and the staleness/ shares)."""
_PERF = frozenset({"train_s", "wait_s", "compute_s", "samples", "tokens", "generated"})
_STALENESS = frozenset({"stale_dropped", "duplicates", "over_bound", "split_groups", "tokens_over_bound"})


class TrackerError(RuntimeError):
    """A tracker that ``logging.trackers`` lists did not start; the message names it and what to do."""


def tag(key: str) -> str:
    """The tracker name of a train_steps record field: ``loss`` -> ``train/loss``, ``eval_reward`` ->
    ``eval/reward``, ``lag1.abs_log_w`` -> ``lag/lag1.abs_log_w``, ``train_s`` -> ``perf/train_s``,
    ``stale_dropped`` -> ``staleness/stale_dropped``."""
    if key.startswith("eval_"):
        return f"eval/{key[len('eval_'):]}"
    if key.startswith("lag") and "." in key:
        return f"lag/{key}"
    if key in _PERF:
        return f"perf/{key}"
    if key in _STALENESS:
        return f"staleness/{key}"
    return f"train/{key}"


def staleness_counts(record: dict) -> dict[int, int]:
    """{staleness: samples} of the record's batch (the record holds it with string keys, as JSON does)."""
    return {int(k): int(v) for k, v in (record.get("staleness") or {}).items()}


def scalars(record: dict, previous_t: float | None = None, levels: int = 0) -> dict[str, float]:
    """The record's numbers under their tracker names (``tag``), plus what is derived from it: samples/s
    and tokens/s since the update before (``previous_t``: its ``t_end``, None for the first update a
    process writes), and the staleness mean and each staleness's share of the batch, for every
    staleness up to the highest seen so far (``levels``: how many; a share that drops to 0 still shows)."""
    out = {tag(k): float(v) for k, v in record.items()
           if k not in _NOT_SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool)}
    if not record.get("samples"):  # the start weights' evaluation: no update, so only its eval/ values
        return {k: v for k, v in out.items() if k.startswith("eval/")}
    counts = staleness_counts(record)
    total = sum(counts.values())
    if total:
        out["staleness/mean"] = sum(k * c for k, c in counts.items()) / total
        for k in range(max(levels, max(counts) + 1)):
            out[f"staleness/share_{k}"] = counts.get(k, 0) / total
    t_end = record.get("t_end")
    if previous_t is not None and t_end is not None and t_end > previous_t:
        out["perf/samples_per_second"] = record["samples"] / (t_end - previous_t)
        out["perf/tokens_per_second"] = record.get("tokens", 0) / (t_end - previous_t)
    return out


class TensorBoard:
    """Event files in ``folder`` (log_dir/tb/<run id>), flushed after every record."""

    name = "tensorboard"

    def __init__(self, folder: Path, config: dict, purge_step: int | None):
        # Lazy: torch.utils.tensorboard loads tensorboard and protobuf; a trainer without trackers never does.
        from torch.utils.tensorboard import SummaryWriter

        self.where = str(folder)
        self.writer = SummaryWriter(str(folder), purge_step=purge_step)
        # Indented: TensorBoard's text tab renders markdown, and an indented block is shown as written.
        text = json.dumps(config, indent=1)
        self.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)
        self.writer.flush()

    def log(self, step: int, values: dict[str, float], counts: dict[int, int]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        if counts:
            levels = range(max(counts) + 1)
            total = sum(counts.values())
            self.writer.add_histogram_raw(
                "staleness/histogram", min=min(counts), max=max(counts), num=total,
                sum=sum(k * c for k, c in counts.items()), sum_squares=sum(k * k * c for k, c in counts.items()),
                bucket_limits=[k + 0.5 for k in levels], bucket_counts=[counts.get(k, 0) for k in levels],
                global_step=step)
        # Each record at once: a live TensorBoard shows the update just made (records are seconds apart),
        # and a write that failed in the writer's thread is raised here, not lost.
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    """One W&B run, id and name ``run``; wandb's environment (WANDB_MODE, WANDB_DIR, WANDB_PROJECT,
    WANDB_ENTITY, WANDB_API_KEY) is honoured."""

    name = "wandb"

    def __init__(self, run: str, config: dict, log_dir: Path):
        # Lazy: wandb is a large import and starts a service process; only a run that lists it pays.
        import wandb

        self.wandb = wandb
        # mode and dir read here: wandb reads its environment once per process, at its first run.
        # console "off": the trainer's output stays as it is (its log lines are in train.log), unwrapped.
        # resume "allow": a trainer restarted in the same run continues its W&B run rather than clash.
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or WANDB_PROJECT, id=run, name=run,
                              config=config, mode=os.environ.get("WANDB_MODE") or None,
                              dir=os.environ.get("WANDB_DIR") or str(log_dir), resume="allow",
                              settings=wandb.Settings(console="off"))
        self.where = self.run.url or self.run.settings.sync_dir  # offline: no url, the run's folder

    def log(self, step: int, values: dict[str, float], counts: dict[int, int]) -> None:
        row: dict = dict(values)
        if counts:
            levels = range(max(counts) + 1)
            edges = [k - 0.5 for k in levels] + [levels[-1] + 0.5]
            row["staleness/histogram"] = self.wandb.Histogram(
                np_histogram=([counts.get(k, 0) for k in levels], edges))
        self.run.log(row, step=step)

    def close(self) -> None:
        self.run.finish()


def _start(name: str, run: str, log_dir: Path, config: dict, purge_step: int | None):
    hint = {"tensorboard": f"; it writes to {log_dir / 'tb' / run}, which must be a folder it can write",
            "wandb": "; log in first (`wandb login`, or WANDB_API_KEY in the environment that starts the run), "
                     "or set WANDB_MODE=offline to keep the run on disk (`wandb sync` uploads it later)"}[name]
    try:
        if name == "tensorboard":
            return TensorBoard(log_dir / "tb" / run, config, purge_step)
        return WandB(run, config, log_dir)
    except ImportError as exc:
        raise TrackerError(f"logging.trackers lists {name}, which is not installed in this environment ({exc}): "
                           f"pip install {name}") from exc
    except Exception as exc:  # noqa: BLE001 -- whatever stops a tracker at start is the run's error, named here
        raise TrackerError(f"logging.trackers: {name} did not start: {type(exc).__name__}: {exc}{hint}") from exc


class Trackers:
    """The trackers of one trainer process: ``log_record`` each train_steps record, ``close`` at the end."""

    def __init__(self, active: list, log=None):
        self.active = active
        self.log = log or structlog.get_logger()
        self.previous_t: float | None = None  # t_end of the record before: samples/s between updates
        self.levels = 0  # stalenesses seen so far, 0..levels-1: their shares go on showing

    @classmethod
    def start(cls, topo, run: str, log_dir: str | Path, log=None, purge_step: int | None = None) -> Trackers:
        """Start each tracker ``topo.logging.trackers`` lists (none: nothing is imported), or raise
        TrackerError (those already started are closed first). Their config is the resolved topology
        with its secrets redacted (``dump_resolved``), never the topology itself. ``purge_step``: a
        trainer restarted within its run writes again from this step; TensorBoard hides what the
        earlier process wrote from there on."""
        started = []
        if topo.logging.trackers:
            config = dump_resolved(topo)
            try:
                for name in topo.logging.trackers:
                    started.append(_start(name, run, Path(log_dir), config, purge_step))
            except TrackerError:
                for tracker in started:
                    tracker.close()
                raise
        return cls(started, log)

    def log_record(self, record: dict) -> None:
        """One train_steps record to every tracker; one that raises is logged once and dropped."""
        if not self.active:
            return
        step = int(record["step"]) + 1  # the policy version the record ends at: see the module docstring
        values = scalars(record, self.previous_t, self.levels)
        counts = staleness_counts(record)
        if record.get("samples"):  # an update (the start weights' evaluation is none: no rate from it)
            self.previous_t = record.get("t_end", self.previous_t)
        self.levels = max(self.levels, max(counts, default=-1) + 1)
        for tracker in list(self.active):
            try:
                tracker.log(step, values, counts)
            except Exception as exc:  # noqa: BLE001 -- a tracker never stops training: logged once, then dropped
                self.active.remove(tracker)
                self.log.error("tracker_failed", tracker=tracker.name, step=record["step"],
                               error=f"{type(exc).__name__}: {exc}"[:500],
                               next="dropped for the rest of this run; training goes on and "
                                    "train_steps.jsonl keeps every record")

    def close(self) -> None:
        """Flush and close each tracker (a W&B run is finished); one that fails is logged, never raised."""
        for tracker in self.active:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 -- closing happens on the way out: it must not stop it
                self.log.error("tracker_close_failed", tracker=tracker.name, error=f"{type(exc).__name__}: {exc}"[:500])
        self.active = []

