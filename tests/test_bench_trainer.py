"""bench/trainer.py still drives today's trainer engine: one tiny update on CPU through the script as the
GPU runs call it. The script builds the engine's topology by hand (the old tree's engine takes it too),
so a knob the engine starts reading must reach it; it went unnoticed for two sessions once, until a GPU
call found the script failing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(180)
def test_the_trainer_bench_runs_todays_engine_on_cpu():
    res = subprocess.run([sys.executable, "bench/trainer.py", "--device", "cpu", "--shapes", "tiny",
                          "--update-tokens", "2000", "--warmup", "0", "--steps", "1", "--median", "200",
                          "--max-len", "400", "--paths", "engine:compute_copy,engine:compute_copy+loglinear"],
                         cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert res.returncode == 0, res.stderr[-3000:]
    result = next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))
    speeds = dict(re.findall(r"tiny_(engine_\w+?)_tokens_per_s=(\S+)", result))
    assert set(speeds) == {"engine_compute_copy", "engine_compute_copy_loglinear"}, result
    assert all(float(v) > 0 for v in speeds.values()), (result, res.stdout[-3000:], res.stderr[-3000:])


@pytest.mark.timeout(120)
def test_the_padding_bench_reports_less_padding_regrouped_and_aligned():
    """bench/padding.py (the padding share of the trainer's micro-batches on bench/trainer.py's workload)
    runs; regrouping within mini-batches pads less where a mini-batch makes several micro-batches, and
    aligning the mini-batches' totals less again, at either cap."""
    res = subprocess.run([sys.executable, "bench/padding.py", "--updates", "20", "--caps", "16384", "32768",
                          "--pads", "1", "1024"], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {(int(r[0]), int(r[1])): [float(x.rstrip("%")) for x in r[2:6]]
            for r in (line.split() for line in res.stdout.splitlines()) if r and r[0].isdigit()}
    assert set(rows) == {(16384, 1), (16384, 1024), (32768, 1), (32768, 1024)}, res.stdout
    assert rows[(16384, 1)][:3] == rows[(32768, 1)][:3] == [0.0, 0.0, 0.0]
    in_order, regrouped, aligned, micro = rows[(16384, 1024)]
    assert micro > 4 and 0 < aligned < regrouped < in_order, res.stdout  # some mini-batches make two micro-batches
    in_order, regrouped, aligned, micro = rows[(32768, 1024)]
    assert micro == 4 and 0 < aligned < regrouped == in_order, res.stdout  # one micro-batch each: nothing to regroup
