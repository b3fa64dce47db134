"""Shared by the benchmarks: run a whole areal_bus system from a topology dict under a real supervisord,
in a fresh short temp folder, until it ends by itself; return the trainer's step records (``run_system``),
or those with the rollout workers' running-batch series (``run_logged``); and the command line's topology
overrides (``override``: --lora RANK, --set KEY VALUE)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from areal_bus.launch.render import write_conf
from areal_bus.runtime.outcome import OUTCOME
from areal_bus.config.topology import parse_topology


@dataclass
class RunLogs:
    """What a finished run left: the trainer's step records, the wall time, and per rollout worker its
    running-batch series (logs/rollout_batch-<node>.jsonl: nodes/rollout/core.py BatchSeries)."""

    records: list[dict]
    wall: float
    batch: dict[str, list[dict]] = field(default_factory=dict)


def override(topo: dict, lora: int = 0, sets=None) -> None:
    """A bench's --lora RANK (trainer_engine.lora, alpha 2 x RANK, every projection) and then its --set KEY
    VALUE pairs (dotted key, YAML value; the last word on any field, trainer_engine.lora.* included) into
    the topology dict ``topo``."""
    if lora:
        topo.setdefault("trainer_engine", {})["lora"] = {"rank": lora, "alpha": 2 * lora}
    for key, value in sets or []:
        *parents, leaf = key.split(".")
        node = topo
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)


def run_system(topo: dict, name: str, keep: Path | None = None, timeout: float = 3600) -> tuple[list[dict], float]:
    """(records of logs/train_steps.jsonl, wall seconds). ``keep``: copy the logs to keep/name."""
    logs = run_logged(topo, name, keep, timeout)
    return logs.records, logs.wall


def check_outcome(log_dir: Path, name: str) -> None:
    """Raise unless the run ended well. supervisord exits 0 however the run ended (areal_bus/launch/runend.py
    asks it to shut down); the verdict is in log_dir's outcome file. A run that failed (a node
    crash-looping, a stalled node) is an error, not a short run whose few records would pass as its result."""
    try:
        outcome = json.loads((log_dir / OUTCOME).read_text())
    except (OSError, ValueError) as e:
        raise RuntimeError(f"{name}: the run left no readable {OUTCOME} ({e})") from None
    if outcome.get("status") != "ok":
        raise RuntimeError(f"{name}: {outcome.get('reason') or outcome}")


def run_logged(topo: dict, name: str, keep: Path | None = None, timeout: float = 3600) -> RunLogs:
    """``run_system`` with the rollout workers' running-batch series too."""
    work = Path(tempfile.mkdtemp(prefix=f"ab-{name}-", dir="/tmp"))  # ipc paths must stay short
    try:
        path = work / "topology.yaml"
        path.write_text(yaml.safe_dump(topo, sort_keys=False))
        conf = write_conf(parse_topology(topo, str(path)), path, work / "supervisord.conf")
        # The nodes find `areal-bus` next to this interpreter (the conf puts %(here)s/.venv/bin first).
        env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
        t0 = time.monotonic()
        supervisord = Path(sys.executable).parent / "supervisord"
        if not supervisord.exists():  # installed elsewhere (e.g. pip --target on the GPU host): the PATH's
            supervisord = Path(shutil.which("supervisord") or "supervisord")
        proc = subprocess.Popen([str(supervisord), "-c", str(conf)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:  # hung: SIGTERM makes supervisord stop its programs before it exits
            proc.terminate()               # (a SIGKILL would leave them running, holding their GPU memory)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{name}: supervisord exited {proc.returncode}")
        check_outcome(work / "logs", name)
        lines = (work / "logs" / "train_steps.jsonl").read_text().splitlines()
        batch = {f.name[len("rollout_batch-"):-len(".jsonl")]: [json.loads(x) for x in f.read_text().splitlines() if x]
                 for f in sorted((work / "logs").glob("rollout_batch-*.jsonl"))}
        return RunLogs([json.loads(line) for line in lines], wall, batch)
    finally:
        if keep is not None and (work / "logs").exists():
            shutil.copytree(work / "logs", keep / name, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
