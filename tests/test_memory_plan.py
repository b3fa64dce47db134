"""The memory plan (areal_bus/model/memory.py): itemised budgets per GPU from config.json alone, and the
refusals that name the numbers (`areal-bus plan`, `areal-bus validate`).

Run:  .venv/bin/python -m pytest -q tests/test_memory_plan.py
"""

from __future__ import annotations

import json

import pytest

from areal_bus.config.topology import parse_topology
from areal_bus.launch.cli import main
from areal_bus.model import memory

QWEN3_8B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960, "tie_word_embeddings": False}


def _topo(tmp_path, model=None, rollout=None, trainer=None, **over):
    return parse_topology(_data(tmp_path, model, rollout, trainer, **over))


def _data(tmp_path, model=None, rollout=None, trainer=None, **over):
    path = tmp_path / "q8"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(QWEN3_8B))
    data = {"global_batch_size": 8, "trigger_batch_size": 4, "mini_batch_size": 4, "rollout_workers": 1,
            "model": {"path": str(path), "dtype": "bfloat16", "device": "cuda", **(model or {})},
            "agent": {"framework": "guess"},
            "rollout_engine": {"kind": "torch", "max_batch": 64, "max_len": 2048, **(rollout or {})},
            "trainer_engine": {"kind": "torch", "lora": {"rank": 16, "alpha": 32}, "gradient_checkpointing": True,
                               "micro_batch_tokens": 8192, **(trainer or {})}, **over}
    return data


def _item(budget, start):
    return next(n for what, n in budget.items if what.startswith(start))


def test_lora_on_one_card_shares_the_base_and_counts_what_each_holds(tmp_path):
    plan = memory.make_plan(_topo(tmp_path, model={"share_base": True}))
    trainer, rollout = plan.budgets
    assert trainer.device == rollout.device == "127.0.0.1:gpu0" or trainer.device == rollout.device
    params = 8.19e9
    assert _item(trainer, "base weights") == pytest.approx(params * 2, rel=0.01)  # bf16, frozen, no master
    assert _item(trainer, "LoRA r16") < 1e9
    assert _item(rollout, "base weights: mapped") == 0 and not any(w.startswith("weights") for w, _ in rollout.items)
    # 144 KiB a token at this shape (36 layers x 8 kv heads x 128 x 2 x 2 B) over 64 x 2048 tokens
    assert _item(rollout, "KV cache") == 36 * 8 * 128 * 2 * 2 * 64 * 2048


def test_full_fine_tuning_counts_masters_gradients_and_adamw(tmp_path):
    topo = _topo(tmp_path, trainer={"lora": None})
    trainer, rollout = memory.make_plan(topo).budgets
    n = _item(trainer, "master weights fp32") / 4
    assert _item(trainer, "gradients fp32") == 4 * n and _item(trainer, "AdamW state") == 8 * n
    assert _item(trainer, "compute copy") == 4 * n  # bf16 copy and its gradients
    assert _item(rollout, "weights") == 2 * n and _item(rollout, "decode step's fused") > 0  # its own copy


def test_a_plan_over_the_card_is_refused_naming_the_numbers(tmp_path, capsys):
    topo = _topo(tmp_path, model={"gpu_memory_gib": 80}, rollout={"max_batch": 256, "max_len": 3200})
    over = memory.make_plan(topo).over()
    assert len(over) == 1 and "rollout-0" in over[0] and "> model.gpu_memory_fraction 0.92 x 80.00 GiB" in over[0]
    fits = _topo(tmp_path, model={"gpu_memory_gib": 80})
    assert memory.make_plan(fits).over() == []
    # the same through the command line, and validate's one-line summary
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_data(tmp_path, model={"gpu_memory_gib": 80}, rollout={"max_batch": 256, "max_len": 3200})))
    assert main(["plan", str(path)]) == 2
    out = capsys.readouterr()
    assert "KV cache: 144 KiB/token x 819200 tokens (max_batch 256 x max_len 3200)" in out.out
    assert "does not fit" in out.err and "rollout-0" in out.err


def test_plan_fraction_bounds_the_knob(tmp_path):
    with pytest.raises(Exception, match="gpu_memory_fraction"):
        _topo(tmp_path, model={"gpu_memory_fraction": 1.5})


def test_a_paged_cache_is_planned_at_its_token_budget(tmp_path):
    _, rollout = memory.make_plan(_topo(tmp_path, rollout={"max_batch": 256, "max_len": 3200,
                                                           "kv_tokens": 65536})).budgets
    assert _item(rollout, "KV cache") == 36 * 8 * 128 * 2 * 2 * 65536
    assert any("rollout_engine.kv_tokens" in what for what, _ in rollout.items)
