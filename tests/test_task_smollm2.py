"""SmolLM2-135M-Instruct (the folder `areal-bus import-model smollm2` makes, from the smollm2_dir
fixture) on the built-in math task, end to end under supervisord on 2 CPU cores: topology/smollm2-math.yaml
as shipped, for a few asynchronous updates. The held-out evaluation runs before training and after
updates, and reports accuracy and the answers' lengths; the rewards are the exact checker's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smollm2_math_runs_a_few_updates_under_supervisord(smollm2_dir, tmp_path):
    sys.path.insert(0, str(ROOT))
    from bench.harness import run_system

    topo = yaml.safe_load((ROOT / "topology" / "smollm2-math.yaml").read_text())
    topo["model"]["path"] = str(smollm2_dir)
    for key in ("path", "eval_path"):
        topo["agent"]["dataset"][key] = str(ROOT / topo["agent"]["dataset"][key])
    topo["max_steps"] = 2
    records, wall = run_system(topo, "smollm2-math", keep=tmp_path, timeout=280)

    steps = [r for r in records if r["step"] >= 0]
    assert [r["step"] for r in steps] == [0, 1]
    assert all(r["samples"] >= topo["trigger_batch_size"] and r["tokens"] > 0 for r in steps)
    # Rewards are the checker's: 0 or 1 per answer, so a batch mean is a multiple of 1/samples.
    assert all(0.0 <= r["reward"] <= 1.0 and abs(r["reward"] * r["samples"] - round(r["reward"] * r["samples"])) < 1e-6
               for r in steps)
    evals = [r for r in records if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [-1, 1]  # before training, then every eval_interval updates
    for r in evals:
        assert 0.0 <= r["eval_accuracy"] <= 1.0 and r["eval_reward"] == pytest.approx(r["eval_accuracy"])
        assert 0 < r["eval_tokens_mean"] <= r["eval_tokens_max"] <= topo["agent"]["max_tokens"]
    print(f"smollm2-math: {len(steps)} updates in {wall:.0f} s; eval accuracy "
          f"{[round(r['eval_accuracy'], 3) for r in evals]}; answer tokens mean "
          f"{evals[0]['eval_tokens_mean']:.1f} max {evals[0]['eval_tokens_max']}")
