"""One-GPU end to end: an agent workload at a Qwen2 shape, torch (or vLLM) rollout and the torch trainer
on one GPU, asynchronous against synchronous in one run: samples/s, tokens/s, the ratio, the trainer's
busy fraction, the rollout engine's running batch over time, the staleness histogram and the drops.

The whole system runs as it does for a user: supervisord starts the bus, agents, one rollout worker,
reward, trainer and weight broadcaster as processes; the rollout worker and the trainer share the GPU
and hand each version over by CUDA IPC. The policy has the body of a shape of bench/trainer.py's table
(bench/shapes.py: ``--shape 0.5b`` Qwen2-0.5B, ``1.5b``, ``3b`` Qwen2.5-3B, ``7b`` Qwen2.5-7B, ``8b``
Llama-3.1-8B, ``qwen3-8b``; ``tiny``: the shipped model's own) with seeded random weights (drawn on the GPU)
and the shipped tiny model's character-level tokenizer (so the vocabulary, and the embedding, are the
tokenizer's 99 ids, not Qwen's 151,936 or Llama's 128,256: at 8B that leaves out ~1B parameters of
embedding and head, 2 GB in bf16 per copy): throughput is the point here, not what it learns.
``--lora RANK`` trains LoRA adapters (trainer_engine.lora, alpha 2 x RANK, all seven projections; the
rollout engine serves them unmerged and each version moves the adapter alone); ``--set KEY VALUE`` sets any
topology field in every run (e.g. ``trainer_engine.gradient_checkpointing true``, or a knob such as the
rollout engine's KV budget). Each run's GPU memory is sampled by nvidia-smi every second: the device's
peak, and each node process's where nvidia-smi lists processes.

Workloads (``--workload``):
  guess     the multi-turn guess-the-number task (a few tokens a turn, up to 5 turns);
  longtail  the seed's shape (areal_bus/tasks/longtail.py): one turn of max_tokens drawn per episode
            from a lognormal (``--median 500 --sigma 0.8``, clipped ``--min-len 200 --max-len 3000``),
            eos ignored, so the lengths are real generated tokens.

Runs (``--runs``, each ``MODE[:STALENESS[:DROP[:LEAD[:ORDER[:ATTN[:BATCH]]]]]]``, e.g. ``async:2:true async:2:false
async:4 sync``, ``async:2:true:adaptive`` for staleness.lead adaptive, ``async:2:true:bound:in_order`` for
staleness.in_order (ORDER ``arrival``, the default, or ``in_order``: each agent hands its groups on in
admission order), ``sync:::::sdpa async:2::::sdpa`` for the torch engine's
rollout_engine.decode_attention (ATTN, default ``--decode-attention``, itself ``auto``: the system's
default, flash_varlen with decode_compile on a GPU in half precision; an explicit ATTN has
rollout_engine.decode_compile off, ``ATTN+compile``, e.g. ``sync:::::sdpa+compile``, on; an async run's
ratio is over the sync run with the same ATTN), ``async:2:true::::384`` for the rollout engine's max_batch
(BATCH, default ``--rollout-batch``); an empty field takes its default;
default: every --modes x --staleness x --drop-at-consume, sync once; sync runs first): DROP is
``staleness.drop_at_consume`` (``true``, ``false``; docs/tuning.md) or ``per_token`` (the drop with
``staleness.per_token``: a sample's tokens past the bound masked, e.g. ``async:2:per_token``); a
synchronous run has neither. Every async run's ratio
is over the sync run of the same invocation. Samples/s and tokens/s (generated tokens) count what the
trainer consumed after the first ``--skip`` updates (CUDA start-up and warm-up excluded); the running
batch (rollout_batch-*.jsonl, a record every 0.5 s) is summarised over that same window: min / median /
max running sequences and the share of time below half of max_batch; "gen tok/s idle/train" is the
rollout workers' finished-token rate while the trainer waits and while an update runs (where the first
is the engine's full-batch rate and the trainer is mostly idle, rollout bounds the run; a second well
below the first is the two contending for the device). Under each run's row, the running batch over the
same window, one character per sixtieth of it (fewer where it holds fewer samples; ▁ under 1/8 of
max_batch .. █ from 7/8 on), with a ^ where an update ended: a synchronous run drains to ▁ before every
^, an asynchronous one should not. Then, where the later half of the counted updates ran more than 10% away
from the whole window, a "not steady" line with its samples/s and drop share: an asynchronous run's first
updates after the warm-up drain what rollout made while the first update compiled, so a short window reads
faster than the run goes on (2026-12-06, staleness 2: 3.8-4.2x over updates 2-5, 2.76x over updates 5-10).

Run:  python3 bench/gpu_e2e.py                    (on the GPU machine: guess at 0.5B, ~2-4 min)
      bash scripts/gpu-host/gpu_headline.sh                (issue 15's table: longtail at 0.5B, both policies)
      bash scripts/gpu-host/gpu_vllm.sh python3 bench/gpu_e2e.py --engine vllm      (vLLM installed by that script)
      python3 bench/gpu_e2e.py --device cuda:0 --trainer-device cuda:1   (two GPUs: rollout and trainer apart)
      python3 bench/gpu_e2e.py --shape 8b --lora 16 --workload longtail --batch 64 --median 250 --max-len 1000 \
          --set trainer_engine.gradient_checkpointing true   (issue 51: 8B-class with LoRA, lengths scaled)
      .venv/bin/python bench/gpu_e2e.py --shape tiny --device cpu --steps 4 --skip 1   (a CPU smoke run)
      .venv/bin/python bench/gpu_e2e.py --shape tiny --device cpu --workload longtail --batch 16 --steps 4 \\
          --skip 1 --median 24 --min-len 8 --max-len 96 --runs async:2:true async:2:false sync

The last line is ``RESULT workload=... engine=... <run>_sps=... <run>_ratio=... ...``.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from areal_bus.config.topology import TopologyError, parse_topology  # noqa: E402
from bench.harness import override, run_logged  # noqa: E402
from bench.shapes import body, random_model, shapes  # noqa: E402

SHAPES = {"tiny": {}, **{name: body(cfg) for name, cfg in shapes().items() if name != "tiny"}}
"""The policy's body: bench/trainer.py's table (bench/shapes.py), less the vocabulary; "tiny": the shipped
model's own."""

TEMPLATE_TOKENS = 16
"""Room for the chat template around a longtail prompt (areal_bus/tasks/longtail.py keeps the same)."""


def build_model(out: Path, shape: str, dtype: str, max_len: int, device: str = "cpu") -> int:
    """The tiny model's config and tokenizer with the chosen body, seeded random weights (drawn on the GPU
    where ``device`` is one: bench/shapes.py)."""
    from areal_bus.model.modeling import num_params, save_pretrained

    src = ROOT / "models" / "tiny-guess"
    cfg = json.loads((src / "config.json").read_text())
    if {"rope_theta", "rope_scaling"} & set(SHAPES[shape]):
        cfg.pop("rope_parameters", None)  # the body's RoPE, not the tiny model's (read before rope_theta)
    cfg.update(SHAPES[shape])
    # RoPE tables for the lengths the run can reach (not the shape's 32k-131k)
    cfg["max_position_embeddings"] = max(min(cfg["max_position_embeddings"], 4096), max_len)
    model = random_model(cfg, device if device.startswith("cuda") else "cpu", dtype)
    save_pretrained(model, out)
    n = num_params(model)
    del model
    if device.startswith("cuda"):
        import torch  # lazy: a CPU run's parent needs no torch

        torch.cuda.empty_cache()  # this process holds no weights while the runs go
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja", "vocab.json"):
            shutil.copy(f, out / f.name)
    return n


@dataclass(frozen=True)
class Run:
    mode: str  # async | sync
    staleness: int
    drop: bool
    lead: str = "bound"  # staleness.lead: bound | adaptive
    in_order: bool = False  # staleness.in_order
    attention: str = "auto"  # rollout_engine.decode_attention (torch engine), "+compile": decode_compile on
    rollout_batch: int = 0  # rollout_engine.max_batch; 0: --rollout-batch
    per_token: bool = False  # staleness.per_token (with the drop): the bound applies to each token

    @property
    def name(self) -> str:
        lead = "" if self.lead == "bound" else f"_{self.lead}"
        order = "_in_order" if self.in_order else ""
        attn = "" if self.attention == "auto" else f"_{self.attention.replace('+', '_')}"
        attn += f"_b{self.rollout_batch}" if self.rollout_batch else ""
        if self.mode == "sync":
            return f"sync{attn}"
        return f"async_s{self.staleness}_{self.policy}{lead}{order}{attn}"

    @property
    def label(self) -> str:
        attn = "" if self.attention == "auto" else f" {self.attention}"
        attn += f" b{self.rollout_batch}" if self.rollout_batch else ""
        if self.mode == "sync":
            return f"sync{attn}"
        lead = "" if self.lead == "bound" else f" {self.lead}"
        return f"async s{self.staleness} {self.policy}{lead}{' in_order' if self.in_order else ''}{attn}"

    @property
    def policy(self) -> str:
        """What happens to an over-stale sample: drop (whole), per_token (its tokens past the bound
        masked, dropped only when its newest is), keep (trained)."""
        return ("per_token" if self.per_token else "drop") if self.drop else "keep"


def parse_runs(args) -> list[Run]:
    def flag(text: str) -> bool:
        if text not in ("true", "false"):
            raise SystemExit(f"--drop-at-consume / --runs: {text!r} is not true or false (DROP in --runs: also per_token)")
        return text == "true"

    attention = args.decode_attention
    if args.runs:
        runs = []
        for spec in args.runs:
            # an empty field takes its default: "sync:::::flash_varlen" is sync with that attention
            parts = spec.split(":")
            parts += [""] * (7 - len(parts))
            mode, staleness, drop, lead, order, attn, batch = parts[:7]
            if (mode not in ("async", "sync") or len(parts) > 7 or lead not in ("", "bound", "adaptive")
                    or order not in ("", "arrival", "in_order")
                    or attn.removesuffix("+compile") not in ("", "auto", "sdpa", "matmul", "flash_varlen")
                    or not (staleness == "" or staleness.isdigit()) or not (batch == "" or batch.isdigit() and int(batch))):
                raise SystemExit(f"--runs {spec!r}: MODE[:STALENESS[:DROP[:LEAD[:ORDER[:ATTN[:BATCH]]]]]] with MODE async "
                                 f"or sync, LEAD bound or adaptive, ORDER arrival or in_order, ATTN auto, sdpa, "
                                 f"matmul or flash_varlen, +compile for decode_compile, BATCH a positive integer "
                                 f"(an empty field: its default)")
            if attn.startswith("+"):  # "+compile": the default attention, compiled
                attn = attention + attn
            runs.append(Run(mode, int(staleness) if staleness else args.staleness[0],
                            drop == "per_token" or (flag(drop) if drop else True), lead or "bound",
                            order == "in_order", attn or attention, int(batch or 0), drop == "per_token"))
        return runs
    runs = [Run("async", s, flag(d), attention=attention) for s in args.staleness for d in args.drop_at_consume] \
        if "async" in args.modes else []
    return runs + ([Run("sync", 0, True, attention=attention)] if "sync" in args.modes else [])


def baseline(results: dict[Run, Summary], run: Run) -> Summary | None:
    """The sync run an async run's ratio is over: the one with the same decode attention, else the first."""
    syncs = [(r, s) for r, s in results.items() if r.mode == "sync"]
    return next((s for r, s in syncs if r.attention == run.attention), syncs[0][1] if syncs else None)


def max_len_of(args) -> int:
    if args.workload == "guess":
        return 256
    return args.prompt_len + TEMPLATE_TOKENS + args.max_len + 16


def decode_step(run: Run) -> dict:
    """The torch engine's decode-step knobs of a run (the other engines take none)."""
    # auto: the system's default fusion (on a GPU); an explicit attention: off unless +compile
    return {"decode_attention": run.attention.removesuffix("+compile"),
            **({} if run.attention == "auto" else {"decode_compile": run.attention.endswith("+compile")})}


def topology(model: Path, run: Run, args) -> dict:
    topo = yaml.safe_load((ROOT / "topology" / "default.yaml").read_text())
    topo.update(
        name=f"e2e-{run.name}", rollout_workers=1, max_steps=args.steps, staleness_threshold=run.staleness,
        staleness={"drop_at_consume": run.drop, "per_token": run.per_token and run.mode == "async", "lead": run.lead,
                   "in_order": run.in_order and run.mode == "async"},
        experimental=(run.per_token and run.mode == "async") or run.lead != "bound",  # both experimental knobs
        queue_max_size=4 * args.batch, trigger_batch_size=args.trigger or args.batch // 2, global_batch_size=args.batch,
        mini_batch_size=args.batch // 2, logging={"log_dir": "logs", "log_interval": 5, "save_interval": 0},
        model={"path": str(model), "dtype": args.dtype, "device": args.device, "trainer_device": args.trainer_device,
               "threads": 1 if args.device == "cpu" else 4},
        rollout_engine={"kind": args.engine, "max_batch": run.rollout_batch or args.rollout_batch, "max_len": max_len_of(args),
                        "temperature": 1.0, **(decode_step(run) if args.engine == "torch" else {}),
                        **({"gpu_memory_utilization": args.gpu_memory_utilization} if args.engine == "vllm" else {})},
        trainer_engine={"kind": "torch", "eps_clip": 0.2, "behav_imp_weight_cap": 5.0, "eval_interval": 0},
        nodes={"bus": {}, "agent": {"replicas": args.agents}, "reward": {"replicas": 1}, "trainer": {}, "weights": {}},
    )
    topo["agent"] = {**topo["agent"], "via": "bus", "group_size": args.group_size}
    if args.workload == "longtail":
        topo["agent"].update(framework="longtail", max_turns=1, prompt_len=args.prompt_len)
        topo["rollout_engine"]["output_len"] = {"dist": "lognormal", "median": args.median, "sigma": args.sigma,
                                                "min": args.min_len, "max": args.max_len}
    topo["async"] = {"enabled": run.mode == "async"}
    # (a caller's namespace may predate --lora and --set)
    override(topo, getattr(args, "lora", 0), getattr(args, "set", None))
    return topo


# -- the GPU memory a run used ---------------------------------------------------------------------

class GpuMemory:
    """The GPU memory a run used, sampled by nvidia-smi every ``every`` s from a thread while the run goes:
    each device's peak of used memory, and each compute process's peak, named by its node (rollout-0,
    trainer-0) from its command line. Where nvidia-smi shows no processes (some containers), the devices'
    alone. Nothing without nvidia-smi (a CPU run)."""

    def __init__(self, every: float = 1.0):
        self.every, self.stop = every, threading.Event()
        self.device: dict[str, tuple[float, float]] = {}  # index: (peak used MiB, total MiB)
        self.process: dict[str, float] = {}  # node name: peak MiB
        self.names: dict[str, str] = {}
        self.thread = threading.Thread(target=self.loop, daemon=True) if shutil.which("nvidia-smi") else None

    def __enter__(self) -> "GpuMemory":
        if self.thread is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(10)

    def loop(self) -> None:
        while True:
            try:
                self.sample()
            except (OSError, ValueError, subprocess.SubprocessError):
                pass  # a sample missed (nvidia-smi slow or busy): the next one counts
            if self.stop.wait(self.every):
                return

    @staticmethod
    def query(what: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]

    def sample(self) -> None:
        for index, used, total in self.query("gpu=index,memory.used,memory.total"):
            self.device[index] = (max(float(used), self.device.get(index, (0.0, 0.0))[0]), float(total))
        for pid, used in self.query("compute-apps=pid,used_memory"):
            name = self.names.setdefault(pid, node_name(pid))
            self.process[name] = max(float(used), self.process.get(name, 0.0))

    def line(self) -> str:
        gib = lambda mib: mib / 1024
        devices = ", ".join(f"GPU {k} peak {gib(u):.1f} of {gib(t):.0f} GiB" for k, (u, t) in sorted(self.device.items()))
        procs = ", ".join(f"{k} {gib(v):.1f} GiB" for k, v in sorted(self.process.items()))
        return f"GPU memory (nvidia-smi, every {self.every:g} s): {devices or 'not sampled'}; per process peak: " \
               f"{procs or 'none shown (nvidia-smi lists no processes here)'}"

    def fields(self, run: str) -> list[str]:
        out = [f"{run}_gpu{k}_peak_gib={u / 1024:.1f}" for k, (u, _) in sorted(self.device.items())]
        return out + [f"{run}_mem_{k.replace('-', '_')}_gib={v / 1024:.1f}" for k, v in sorted(self.process.items())]


def node_name(pid: str) -> str:
    """A node's name from its command line (areal-bus node KIND ... --replica N: KIND-N), else the program's."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return f"pid {pid}"
    if "node" in argv and argv.index("node") + 1 < len(argv):
        kind = argv[argv.index("node") + 1]
        replica = argv[argv.index("--replica") + 1] if "--replica" in argv[:-1] else "0"
        return f"{kind}-{replica}"
    return f"{Path(argv[0]).name} {pid}"


# -- what a run left, summarised ------------------------------------------------------------------

@dataclass
class Summary:
    sps: float
    tps: float
    samples: int
    span: float
    busy: float
    batch: str
    below_half: float
    staleness: dict
    dropped: int
    over_bound: int
    trained: int
    gen_idle: float  # rollout tokens/s while the trainer waits
    gen_train: float  # rollout tokens/s while an update runs (the two share the GPU)
    timeline: tuple[str, str] = ("", "")  # batch_timeline: the running batch over the window, update ends
    later_sps: float = float("nan")  # samples/s over the later half of the counted updates (steady_note)
    later_dropped: float = float("nan")  # the share of finished samples dropped over that later half


def counted_steps(records: list[dict], skip: int) -> tuple[list[dict], float]:
    """The updates counted (after ``skip``) and the wall time their window starts at."""
    steps = sorted((r for r in records if r["step"] >= 0), key=lambda r: r["step"])
    if len(steps) <= skip:
        raise RuntimeError(f"only {len(steps)} updates; need more than --skip {skip}")
    t0 = steps[skip - 1]["t_end"] if skip else steps[0]["t_end"] - steps[0]["train_s"]
    return steps[skip:], t0


def batch_summary(series: dict[str, list[dict]], t0: float, t1: float) -> tuple[str, float]:
    """'min/median/max of max_batch' running sequences over [t0, t1], and the share of that time below
    half of max_batch (every worker's samples pooled)."""
    recs = [r for recs in series.values() for r in recs if t0 <= r["t"] <= t1]
    if not recs:
        return "-", float("nan")
    running = [r["running"] for r in recs]
    below = sum(r["running"] < r["max_batch"] / 2 for r in recs) / len(recs)
    return f"{min(running)}/{statistics.median(running):g}/{max(running)} of {recs[0]['max_batch']}", below


LEVELS = "▁▂▃▄▅▆▇█"
TIMELINE_KEY = "▁ < 1/8 of max_batch, █ >= 7/8; ^ an update ended"


def batch_timeline(series: dict[str, list[dict]], t0: float, t1: float, ends: list[float] = (),
                   cells: int = 60) -> tuple[str, str]:
    """The running batch over [t0, t1] as at most ``cells`` characters (no more than one worker's samples
    there), each the mean share of max_batch running in its slice of time (every worker's samples pooled):
    ▁ under 1/8 of max_batch .. █ from 7/8 on, '.' a slice without a sample. And a line under it with '^'
    at the slices where an update ended (``ends``): how empty rollout runs in the tail, and whether it
    empties before each update (synchronous) or not."""
    cells = max(1, min(cells, max((sum(t0 <= r["t"] <= t1 for r in recs) for recs in series.values()), default=1)))
    width = (t1 - t0) / cells if t1 > t0 else 0.0
    sums, counts = [0.0] * cells, [0] * cells
    for recs in series.values():
        for r in recs:
            if t0 <= r["t"] <= t1 and width > 0:
                i = min(cells - 1, int((r["t"] - t0) / width))
                sums[i] += r["running"] / r["max_batch"]
                counts[i] += 1
    line = "".join(LEVELS[min(len(LEVELS) - 1, int(sums[i] / counts[i] * len(LEVELS)))] if counts[i] else "."
                   for i in range(cells))
    marks = [" "] * cells
    for t in ends:
        if t0 <= t <= t1 and width > 0:
            marks[min(cells - 1, int((t - t0) / width))] = "^"
    return line, "".join(marks).rstrip()


def generation_split(series: dict[str, list[dict]], counted: list[dict], t0: float, t1: float) -> tuple[float, float]:
    """(tokens/s the rollout workers finished while the trainer was idle, while it trained) over [t0, t1]:
    each worker's series ('tokens' counts the output tokens of finished requests) differenced between
    neighbouring samples, each interval put on the side its midpoint falls on. Where the second is well
    below the first, rollout and trainer contend for the device; where the trainer is mostly idle and
    the first is the engine's full-batch rate, rollout bounds the run."""
    windows = [(r["t_end"] - r["train_s"], r["t_end"]) for r in counted]
    made = {False: 0.0, True: 0.0}
    spent = {False: 0.0, True: 0.0}
    for recs in series.values():
        pts = [r for r in recs if t0 <= r["t"] <= t1]
        for a, b in zip(pts, pts[1:]):
            mid = (a["t"] + b["t"]) / 2
            side = any(lo <= mid <= hi for lo, hi in windows)
            made[side] += b["tokens"] - a["tokens"]
            spent[side] += b["t"] - a["t"]
    n = max(1, len(series))  # each worker's time counted once per side
    rate = lambda side: made[side] / (spent[side] / n) if spent[side] else float("nan")
    return rate(False), rate(True)


def later_half(counted: list[dict], t0: float, before: dict | None) -> tuple[float, float]:
    """Samples/s and the share of finished samples dropped over the later half of the counted updates
    (at least one): a window still draining what rollout made during the first update's warm-up reads
    faster than the run goes on, so this beside the whole window's figure says whether it is steady."""
    half = counted[len(counted) // 2:]
    start = counted[len(counted) // 2 - 1]["t_end"] if len(counted) > 1 else t0
    prior = counted[len(counted) // 2 - 1] if len(counted) > 1 else before
    samples = sum(r["samples"] for r in half)
    dropped = half[-1].get("stale_dropped", 0) - (prior or {}).get("stale_dropped", 0)
    span = half[-1]["t_end"] - start
    return (samples / span if span > 0 else float("nan")), dropped / max(1, samples + dropped)


def steady_note(s: Summary, tolerance: float = 0.1) -> str:
    """A line for a row whose later half ran more than ``tolerance`` away from its whole window."""
    if not s.later_sps == s.later_sps or abs(s.later_sps / s.sps - 1) <= tolerance:
        return ""
    return (f"not steady: the later half of the counted updates ran at {s.later_sps:.1f} samples/s "
            f"({100 * s.later_sps / s.sps:.0f}% of the window's), {100 * s.later_dropped:.0f}% of its finished "
            f"samples dropped; count more updates (--steps, --skip) for the run's steady rate")


def summarise(logs, skip: int) -> Summary:
    counted, t0 = counted_steps(logs.records, skip)
    t1 = counted[-1]["t_end"]
    span = t1 - t0
    samples = sum(r["samples"] for r in counted)
    generated = sum(r.get("generated", r["tokens"]) for r in counted)
    hist = collections.Counter()
    for r in counted:
        hist.update({int(k): v for k, v in r.get("staleness", {}).items()})
    steps = [r for r in logs.records if r["step"] >= 0]
    batch, below = batch_summary(logs.batch, t0, t1)
    gen_idle, gen_train = generation_split(logs.batch, counted, t0, t1)
    timeline = batch_timeline(logs.batch, t0, t1, [r["t_end"] for r in counted])
    before = next((r for r in steps if r["step"] == counted[0]["step"] - 1), None)
    later_sps, later_dropped = later_half(counted, t0, before)
    return Summary(later_sps=later_sps, later_dropped=later_dropped,
                   gen_idle=gen_idle, gen_train=gen_train, timeline=timeline, sps=samples / span, tps=generated / span, samples=samples, span=span,
                   busy=sum(r["train_s"] for r in counted) / span, batch=batch, below_half=below,
                   staleness=dict(sorted(hist.items())), dropped=max((r.get("stale_dropped", 0) for r in steps), default=0),
                   over_bound=sum(r.get("over_bound", 0) for r in steps), trained=sum(r["samples"] for r in steps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--trainer-device", default=None, help="the trainer's GPU when not --device (e.g. cuda:1)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shape", default="0.5b", choices=sorted(SHAPES), help="the policy's Qwen2 body")
    ap.add_argument("--tiny", action="store_true", help="the same as --shape tiny (a smoke run)")
    ap.add_argument("--workload", default="guess", choices=["guess", "longtail"])
    ap.add_argument("--steps", type=int, default=12, help="updates per run")
    ap.add_argument("--skip", type=int, default=2, help="first updates left out of samples/s")
    ap.add_argument("--batch", type=int, default=128, help="global_batch_size (trigger = half)")
    ap.add_argument("--trigger", type=int, default=0, help="trigger_batch_size (default: half the batch)")
    ap.add_argument("--staleness", type=int, nargs="+", default=[2], help="staleness_threshold(s) of the async runs")
    ap.add_argument("--drop-at-consume", nargs="+", default=["true"], help="staleness.drop_at_consume: true, false or both")
    ap.add_argument("--modes", nargs="+", default=["async", "sync"], choices=["async", "sync"])
    ap.add_argument("--runs", nargs="+", default=None, help="MODE[:STALENESS[:DROP[:LEAD[:ORDER[:ATTN[:BATCH]]]]]] ... (overrides the three above)")
    ap.add_argument("--rollout-batch", type=int, default=256, help="the rollout engine's max_batch")
    ap.add_argument("--decode-attention", default="auto", choices=["auto", "sdpa", "matmul", "flash_varlen"],
                    help="torch engine: rollout_engine.decode_attention (auto: the system's default, with its "
                         "default decode_compile; an explicit one: decode_compile off)")
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8, help="GRPO group (samples per prompt)")
    ap.add_argument("--prompt-len", type=int, default=128, help="longtail: prompt characters (= tokens here)")
    ap.add_argument("--median", type=float, default=500.0, help="longtail: median output tokens")
    ap.add_argument("--sigma", type=float, default=0.8, help="longtail: lognormal shape")
    ap.add_argument("--min-len", type=int, default=200, help="longtail: shortest output (clip)")
    ap.add_argument("--max-len", type=int, default=3000, help="longtail: longest output (clip)")
    ap.add_argument("--keep-logs", type=Path, default=None, help="copy each run's whole log folder here")
    ap.add_argument("--save", type=Path, default=None, help="write each run's step records and running-batch "
                    "series here (RUN.json: small, unlike --keep-logs, whose spools hold every trajectory)")
    ap.add_argument("--engine", default="torch", choices=["torch", "vllm"], help="the rollout engine")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vllm: its share of the GPU")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK", help="trainer_engine.lora of this rank, alpha "
                    "2 x RANK, all seven projections (0: full fine-tuning); the rollout engine serves the adapter")
    ap.add_argument("--set", nargs=2, action="append", metavar=("KEY", "VALUE"), help="override a field of every "
                    "run's topology (dotted key, YAML value), after the rest: e.g. --set "
                    "trainer_engine.gradient_checkpointing true --set trainer_engine.micro_batch_tokens 8192")
    args = ap.parse_args()
    if args.tiny:
        args.shape = "tiny"
    if args.device == "cpu" and args.dtype == "bfloat16":
        args.dtype = "float32"
    # The sync baseline first, so each async row can print its ratio as it ends.
    runs = sorted(parse_runs(args), key=lambda r: r.mode != "sync")
    for run in runs:  # before building the model: e.g. agents whose whole groups never make a batch
        try:
            parse_topology(topology(Path("model"), run, args), f"the {run.name} run's topology")
        except TopologyError as err:
            ap.error(str(err))
    work = Path(tempfile.mkdtemp(prefix="ab-e2e-model-"))
    try:
        return bench(args, runs, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the policy's weights: 0.7 GB at 0.5B, 3 GB at 1.5B in fp32


def bench(args, runs: list[Run], work: Path) -> int:
    t_build = time.monotonic()
    n = build_model(work / "model", args.shape, args.dtype, max_len_of(args), args.device)
    t_build = time.monotonic() - t_build
    hw = platform.processor() or platform.machine()
    if args.device.startswith("cuda"):
        import torch

        hw = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}; rollout on " \
             f"{args.device}, trainer on {args.trainer_device or args.device}"
    lengths = (f"longtail: prompt {args.prompt_len}, outputs lognormal median {args.median:g} sigma {args.sigma:g} "
               f"clipped {args.min_len}..{args.max_len}, eos ignored" if args.workload == "longtail" else "guess")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {hw}; policy {args.shape} {n / 1e6:.0f}M params "
          f"({args.dtype}); {lengths}; global batch {args.batch}, trigger {args.trigger or args.batch // 2}, "
          f"{args.agents} agents, {args.steps} updates per run, first {args.skip} left out; rollout engine "
          f"{args.engine}, max_batch {args.rollout_batch}"
          + (f", decode attention {args.decode_attention}" if args.engine == "torch" else "")
          + (f"; LoRA rank {args.lora} alpha {2 * args.lora}" if args.lora else "; full fine-tuning")
          + "".join(f"; {k} {v}" for k, v in args.set or []) + f"; weights drawn in {t_build:.0f} s", flush=True)
    print(f"{'run':28s} {'samples/s':>9s} {'tokens/s':>9s} {'ratio':>5s} {'busy':>5s} {'running batch':>20s} "
          f"{'<half':>5s}  {'dropped':>12s} {'over_bound':>10s} {'gen tok/s idle/train':>20s}  staleness histogram "
          f"(counted updates)", flush=True)
    results: dict[Run, Summary] = {}
    failed, gpu_fields = [], []
    for run in runs:
        t0 = time.monotonic()
        try:
            with GpuMemory() as memory:
                logs = run_logged(topology(work / "model", run, args), run.name, args.keep_logs, timeout=args.timeout)
        except subprocess.TimeoutExpired:  # run_logged has stopped its system; the other runs still go
            print(f"{run.label:28s} not finished after --timeout {args.timeout:.0f} s: stopped, no row (a synchronous "
                  f"run waits for each batch's longest output: give it more time)", flush=True)
            failed.append(run)
            continue
        except RuntimeError as e:  # the run ended badly (a node crash-looping, a stall): its reason, then the rest
            print(f"{run.label:28s} failed: {e}", flush=True)
            failed.append(run)
            continue
        results[run] = s = summarise(logs, args.skip)
        if args.save is not None:
            args.save.mkdir(parents=True, exist_ok=True)
            (args.save / f"{run.name}.json").write_text(json.dumps(
                {"run": run.label, "args": {k: str(v) for k, v in vars(args).items()}, "records": logs.records,
                 "batch": logs.batch}))
        sync = baseline(results, run)
        ratio = f"{s.sps / sync.sps:5.2f}" if sync is not None and run.mode == "async" else "    -"
        seen = s.trained + s.dropped
        print(f"{run.label:28s} {s.sps:9.1f} {s.tps:9.0f} {ratio} {100 * s.busy:4.0f}% {s.batch:>20s} "
              f"{100 * s.below_half:4.0f}%  {s.dropped:5d} ({100 * s.dropped / max(1, seen):3.0f}%) {s.over_bound:10d} "
              f"{f'{s.gen_idle:.0f}/{s.gen_train:.0f}':>20s}  "
              f"{' '.join(f'{k}:{v}' for k, v in s.staleness.items())}   ({s.samples} samples in {s.span:.1f} s; "
              f"wall {logs.wall:.0f} s incl. start, {time.monotonic() - t0:.0f} s)", flush=True)
        line, marks = s.timeline
        print(f"{'':28s} running batch over those {s.span:.1f} s ({len(line)} slices, {TIMELINE_KEY}):\n"
              f"{'':28s} |{line}|\n{'':28s}  {marks}", flush=True)
        if note := steady_note(s):
            print(f"{'':28s} {note}", flush=True)
        if memory.device:
            print(f"{'':28s} {memory.line()}", flush=True)
            gpu_fields += memory.fields(run.name)
    sync = next((v for r, v in results.items() if r.mode == "sync"), None)
    fields = [f"workload={args.workload}", f"shape={args.shape}", f"engine={args.engine}"]
    for run, s in results.items():
        fields += [f"{run.name}_sps={s.sps:.2f}", f"{run.name}_tps={s.tps:.0f}", f"{run.name}_busy={s.busy:.2f}",
                   f"{run.name}_dropped={s.dropped}", f"{run.name}_over_bound={s.over_bound}",
                   f"{run.name}_gen_idle_tps={s.gen_idle:.0f}", f"{run.name}_gen_train_tps={s.gen_train:.0f}",
                   f"{run.name}_later_sps={s.later_sps:.2f}"]
        if run.mode == "async" and sync is not None:
            fields.append(f"{run.name}_ratio={s.sps / baseline(results, run).sps:.2f}")
    if sync is not None:  # the ratios of the first async run before any other (the old RESULT's keys)
        first = next((s for r, s in results.items() if r.mode == "async"), None)
        if first is not None:
            fields += [f"async_sps={first.sps:.2f}", f"sync_sps={sync.sps:.2f}", f"ratio={first.sps / sync.sps:.2f}"]
    fields += gpu_fields
    fields += [f"failed={','.join(r.name for r in failed)}"] if failed else []
    print("RESULT " + " ".join(fields))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
