"""The default topology with ``trainer_engine.lora: {rank: 8, alpha: 16}`` under supervisord, to its end: the
trainer trains the adapters, every version the rollout workers and the held-out evaluation serve is the
adapter (moved through shared memory), the checkpoints hold the adapter and its base's record, and
`areal-bus export --merge` of the last one is a folder transformers loads.

Shorter than the default's 60 updates (10, a checkpoint and an evaluation every 5), through the gateway
as the default plays. Run: .venv/bin/pytest tests/test_lora_system.py -q   (a few minutes on 2 cores; slow)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from areal_bus.launch.cli import main

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-guess"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_default_topology_with_lora_runs_to_its_end_serving_adapters(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT))
    monkeypatch.setenv("AREAL_BUS_ADMIN_TOKEN", "test-admin-token-0123456789")  # the gateway's; as run_default.sh
    from bench.harness import run_system
    from areal_bus.train.lora import base_checksum

    topo = yaml.safe_load((ROOT / "topology" / "default.yaml").read_text())
    topo["model"]["path"] = str(MODEL)
    topo["max_steps"] = 10
    topo["logging"]["save_interval"] = 5
    topo["trainer_engine"].update(eval_interval=5, eval_episodes=16, lora={"rank": 8, "alpha": 16})
    records, _ = run_system(topo, "lora-test", keep=tmp_path, timeout=560)  # raises unless the run ended well

    steps = [r for r in records if r["step"] >= 0]
    assert [r["step"] for r in steps] == list(range(10))
    assert [r["step"] for r in records if "eval_reward" in r] == [-1, 4, 9]
    logs = tmp_path / "lora-test"
    # The rollout workers served the trained versions (each an adapter swapped in from shared memory; a
    # version the workers could not load would have crashed them or been logged unavailable). The last one
    # (10, exported as the trainer finishes) may be announced after the trainer exited and took its buffers
    # with it: a worker that had not swapped yet logs it unavailable, as with full weights; any earlier is a bug.
    rollout = (logs / "rollout.log").read_text()
    served = {int(v) for v in re.findall(r"^\[rollout\] step=\d+ .*version=(\d+) ", rollout, re.M)}
    unavailable = {int(v) for v in re.findall(r"^\[rollout\] weights_unavailable version=(\d+) ", rollout, re.M)}
    assert max(served) >= 5 and unavailable <= {10}, (sorted(served), sorted(unavailable))
    assert not [p.name for p in (logs / "supervisor").glob("*.log") if "Traceback" in p.read_text()]
    ckpt = logs / "checkpoints" / "step_10"
    assert not (ckpt / "model.safetensors").exists() and (ckpt / "adapter_model.safetensors").exists()
    assert json.loads((ckpt / "lora_base.json").read_text())["sha256"] == base_checksum(MODEL)
    assert main(["export", "--merge", str(ckpt), str(tmp_path / "merged")]) == 0
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
