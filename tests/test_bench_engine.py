"""bench/engine.py still runs today's engine end to end on CPU through the script as the GPU calls run it:
the tiny model, the plain and the fused decode step (rollout_engine.decode_compile) as rows, and
``--profile``'s step breakdown, so a GPU call does not find the script broken."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_the_engine_bench_runs_plain_and_fused_rows_and_profiles_their_steps_on_cpu():
    res = subprocess.run([sys.executable, "bench/engine.py", "--tiny", "--device", "cpu", "--no-hf", "--batches", "4",
                          "--variants", "--rows", "engine", "engine sdpa+compile", "--profile"],
                         cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert res.returncode == 0, res.stderr[-3000:]
    result = dict(re.findall(r"(\w+)=(\S+)", next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))))
    assert float(result["engine_tok_s_4"]) > 0 and float(result["engine_sdpa_compile_tok_s_4"]) > 0, result
    assert "engine_t1_tok_s_4" not in result  # --rows keeps only the rows named
    # the fused step runs fewer (aten) ops than the plain one: the norms, rotary and SiLU are compiled
    assert 0 < int(result["engine_sdpa_compile_kernels"]) < int(result["engine_kernels"]), result
    assert float(result["engine_step_ms"]) > 0, result
    assert re.search(r"profile engine sdpa\+compile at batch 4, bucket \(4, \d+\): step", res.stdout), res.stdout
