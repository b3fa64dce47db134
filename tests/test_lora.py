"""LoRA end to end on CPU (trainer_engine.lora): an update moves the adapters alone, the torch rollout engine
serves the published adapter with the trainer's own log-probabilities, checkpoints hold the adapter and
resume it (on its own base only), `areal-bus export` gives a folder transformers and peft load, and the
layouts and fields that cannot work are refused, naming the field."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from areal_bus.config.topology import TopologyError, dump_resolved, parse_topology
from areal_bus.engines import torch_parallel
from areal_bus.engines.torch_engine import TorchRolloutEngine
from areal_bus.engines.torch_train import TorchTrainEngine, pad_batch
from areal_bus.engines.train_engine import build_train_engine
from areal_bus.launch.cli import main
from areal_bus.model import adapters
from areal_bus.model.modeling import TINY_QWEN2, load_safetensors, make_random_model, save_pretrained, token_logprobs
from areal_bus.train import lora
from areal_bus.wire.messages import GenerateRequest
from tests.test_torch_train import _episodes, _topo
from tests.test_validate import MODEL

LORA = {"rank": 4, "alpha": 8}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


def _lora_topo(model_dir, lora_cfg=None, engine=None, **over):
    return _topo(model_dir, trainer_engine={"kind": "torch", "lora": lora_cfg or LORA, **(engine or {})}, **over)


def _trained(model_dir, trajs=None, **over):
    """A LoRA engine after one update (lr 1e-2: the adapters move visibly)."""
    engine = TorchTrainEngine(_lora_topo(model_dir, **over), model_dir, base_model=model_dir)
    engine.train(trajs or _episodes(model_dir), version=0)
    return engine


def _base_weights(model_dir, dtype=torch.float32):
    return {k: v.to(dtype) for k, v in load_safetensors(model_dir).items()}


# -- the trainer -------------------------------------------------------------------------------------


def test_an_update_moves_only_the_adapters_and_the_optimizer_holds_only_theirs(model_dir):
    engine = _trained(model_dir)
    disk = _base_weights(model_dir)
    params = dict(engine.model.named_parameters())
    frozen = {k: p for k, p in params.items() if not lora.is_adapter(k)}
    for name, p in frozen.items():  # bitwise the checkpoint's: no update, no float32 master
        assert not p.requires_grad and p.grad is None, name
        assert torch.equal(p, disk[name.replace(".base_layer.", ".")]), name
    adapter = {k: p for k, p in params.items() if lora.is_adapter(k)}
    assert len(adapter) == 2 * len(TARGETS) * 2  # A and B of 7 projections in 2 layers
    assert all(p.dtype == torch.float32 for p in adapter.values())
    assert any(p.abs().sum() > 0 for k, p in adapter.items() if ".lora_B." in k)  # B left zero: moved
    held = [p for g in engine.opt.param_groups for p in g["params"]]
    assert {id(p) for p in held} == {id(p) for p in adapter.values()}
    assert {id(p) for p in engine.opt.state} == {id(p) for p in adapter.values()}


def test_bf16_lora_keeps_the_base_in_bf16_the_adapters_in_float32_and_publishes_bf16(model_dir):
    engine = _trained(model_dir, model={"path": str(model_dir), "dtype": "bfloat16"})
    assert engine.copy is None  # no compute copy: the base already is the compute dtype
    for name, p in engine.model.named_parameters():
        assert p.dtype == (torch.float32 if lora.is_adapter(name) else torch.bfloat16), name
    served = engine.served()
    rollout = adapters.attach(make_random_model(TINY_QWEN2), TARGETS, 4, 2.0)
    assert {k: tuple(v.shape) for k, v in served.items()} == adapters.wire_shapes(rollout)
    assert {v.dtype for v in served.values()} == {torch.bfloat16}


def test_the_kl_reference_of_a_lora_policy_is_its_base(model_dir):
    """The reference runs the policy with its adapters off: KL 0 in the first update (one optimizer step,
    taken after its forward: B is still zero there), above it in the next, and the adapters are back on
    (and trainable) after each reference pass."""
    trajs = _episodes(model_dir)
    topo = _lora_topo(model_dir, engine={"kl_coef": 0.1}, mini_batch_size=8)  # one step per update
    engine = TorchTrainEngine(topo, model_dir, base_model=model_dir)
    first = engine.train(trajs, version=0)
    second = engine.train(trajs, version=1)
    assert abs(first["kl"]) < 1e-6 < second["kl"]
    assert all(p.requires_grad for p in engine.trainable()) and len(engine.opt.state) == len(engine.trainable())


def test_activation_checkpointing_makes_the_same_lora_update(model_dir):
    trajs = _episodes(model_dir)
    plain = _trained(model_dir, trajs)
    ckpt = _trained(model_dir, trajs, engine={"gradient_checkpointing": True})
    for (name, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


# -- the rollout engine serves the adapter -----------------------------------------------------------


@pytest.mark.parametrize("static_decode", [False, True], ids=["eager", "static-step"])
def test_the_torch_engine_serves_the_adapter_with_the_trainers_logprobs(model_dir, static_decode):
    """The published version (the adapter alone) swapped into a rollout engine built on the base: its
    recorded log-probabilities are the trainer's recompute (peft on transformers) of the same tokens, and
    not the base's."""
    engine = _trained(model_dir)
    served = engine.served()
    rollout = TorchRolloutEngine(adapters.rollout_model(model_dir, engine.lora), max_batch=4, max_len=64,
                                 eos_token_ids=[], seed=3, weight_loader=lambda _: served, static_decode=static_decode)
    rollout.swap_weights(1, "trainer")
    prompts = np.random.default_rng(1).integers(1, 50, (4, 5)).astype(np.int32)
    for i, p in enumerate(prompts):
        rollout.add_request(GenerateRequest(f"r{i}", f"e{i}", i, 0, 8, 1.0, p))
    done = []
    while len(done) < 4:
        done += rollout.step()
    done.sort(key=lambda c: c.request_id)
    ids = torch.from_numpy(np.stack([np.concatenate([prompts[i], c.output_ids]) for i, c in enumerate(done)])).long()
    recorded = torch.tensor(np.stack([c.logprobs for c in done]))
    assert all((c.versions == 1).all() for c in done)
    with torch.no_grad():
        trainer = token_logprobs(engine.model.eval(), ids)[:, 5:]
        with lora.adapters_off(engine.model):
            base = token_logprobs(engine.model, ids)[:, 5:]
    torch.testing.assert_close(recorded, trainer, atol=1e-4, rtol=0)
    assert (recorded - base).abs().max() > 1e-2  # the adapter changed what was served


def test_a_rollout_model_with_adapters_refuses_full_weights_and_a_wrong_rank(model_dir):
    model = adapters.rollout_model(model_dir, parse_topology({"trainer_engine": {"kind": "torch", "lora": LORA},
                                                              "rollout_engine": {"kind": "torch"},
                                                              "agent": {"framework": "guess"}}).trainer_engine.lora)
    with pytest.raises(KeyError, match="does the trainer train LoRA too"):
        adapters.load_weights(model, load_safetensors(model_dir))
    other = adapters.attach(make_random_model(TINY_QWEN2), TARGETS, 8, 2.0)
    wrong = {k: torch.zeros(s) for k, s in adapters.wire_shapes(other).items()}
    with pytest.raises(ValueError, match="adapter shape mismatch"):
        adapters.load_weights(model, wrong)


# -- checkpoints -------------------------------------------------------------------------------------


def test_a_lora_checkpoint_holds_the_adapter_and_resumes_the_same_next_update(model_dir, tmp_path):
    trajs = _episodes(model_dir)
    engine = _trained(model_dir, trajs[:4])
    folder = engine.save_checkpoint(tmp_path / "step_1", 1, ["t"])
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["adapter_config.json", "adapter_model.safetensors", "lora_base.json", "optimizer.pt", "trainer_state.json"])
    record = json.loads((folder / "lora_base.json").read_text())
    assert record == {"path": str(model_dir.resolve()), "sha256": lora.base_checksum(model_dir)}
    opt = torch.load(folder / "optimizer.pt", weights_only=True)
    assert len(opt["state"]) == len(engine.trainable())  # the adapters' moments only
    resumed = build_train_engine(engine.topo, checkpoint=folder)
    for (name, a), b in zip(engine.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    a, b = engine.train(trajs[4:], version=1), resumed.train(trajs[4:], version=1)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-7)
    for (name, x), y in zip(engine.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(x, y), name  # the same AdamW moments and step: the same next update, exactly


def test_resuming_a_lora_checkpoint_on_another_base_is_refused_naming_both(model_dir, tmp_path):
    folder = _trained(model_dir).save_checkpoint(tmp_path / "step_1", 1, [])
    other = tmp_path / "other-base"
    save_pretrained(make_random_model(TINY_QWEN2, seed=1, std=0.2), other)
    topo = _lora_topo(other)
    with pytest.raises(ValueError) as err:
        build_train_engine(topo, checkpoint=folder)
    msg = str(err.value)
    assert f"trained on the base {model_dir.resolve()}" in msg and f"model.path is {other}" in msg


def test_a_lora_run_refuses_a_full_checkpoint_and_a_full_run_an_adapter(model_dir, tmp_path):
    full = TorchTrainEngine(_topo(model_dir), model_dir).save_checkpoint(tmp_path / "full", 1, [])
    with pytest.raises(ValueError, match="holds no LoRA adapter"):
        build_train_engine(_lora_topo(model_dir), checkpoint=full)
    adapter = _trained(model_dir).save_checkpoint(tmp_path / "adapter", 1, [])
    with pytest.raises(ValueError, match="holds a LoRA adapter"):
        build_train_engine(_topo(model_dir), checkpoint=adapter)
    with pytest.raises(ValueError, match=r"rank 4 \(topology: 8\)"):
        build_train_engine(_lora_topo(model_dir, {"rank": 8}), checkpoint=adapter)


# -- export ------------------------------------------------------------------------------------------


def test_export_merge_writes_a_folder_transformers_loads_to_the_same_logits(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = _trained(model_dir)
    folder = engine.save_checkpoint(tmp_path / "step_1", 1, [])
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # a base with a tokenizer
        (model_dir / name).write_text((MODEL / name).read_text())
    assert main(["export", "--merge", str(folder), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = engine.model.eval()(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got - base).abs().max() > 1e-3  # the adapter is in it
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").chat_template  # tokenizer and template came along
    assert main(["export", "--merge", str(folder), str(tmp_path / "merged")]) == 2  # never over a folder silently


def test_export_adapter_writes_a_folder_peft_loads_onto_the_base(model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine = _trained(model_dir)
    folder = engine.save_checkpoint(tmp_path / "step_1", 1, [])
    assert main(["export", "--adapter", str(folder), str(tmp_path / "adapter")]) == 0
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                         "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, engine.model.eval()(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)


def test_export_refuses_a_changed_base_and_a_full_checkpoint(model_dir, tmp_path, capsys):
    folder = _trained(model_dir).save_checkpoint(tmp_path / "step_1", 1, [])
    full = TorchTrainEngine(_topo(model_dir), model_dir).save_checkpoint(tmp_path / "full", 1, [])
    assert main(["export", "--merge", str(full), str(tmp_path / "a")]) == 2
    assert "holds no LoRA adapter" in capsys.readouterr().err
    other = tmp_path / "other-base"
    save_pretrained(make_random_model(TINY_QWEN2, seed=1, std=0.2), other)
    assert main(["export", "--merge", str(folder), str(tmp_path / "b"), "--base", str(other)]) == 2
    assert f"the base {other} is not the one" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# -- validation --------------------------------------------------------------------------------------


def _with_lora(tmp_path, monkeypatch, capsys, lora_yaml: str, extra: str = "") -> tuple[int, str]:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "topo.yaml").write_text(
        f"model: {{path: '{MODEL}'}}\nagent: {{framework: guess}}\nrollout_engine: {{kind: torch}}\n"
        f"trainer_engine: {{kind: torch, lora: {lora_yaml}}}\n{extra}")
    return main(["validate", "topo.yaml"]), capsys.readouterr().err


def test_validate_accepts_lora_on_the_shipped_model(tmp_path, monkeypatch, capsys):
    assert _with_lora(tmp_path, monkeypatch, capsys, "{rank: 8, alpha: 16}")[0] == 0


def test_a_target_module_the_model_lacks_is_refused_naming_the_field(tmp_path, monkeypatch, capsys):
    status, err = _with_lora(tmp_path, monkeypatch, capsys, "{rank: 8, target_modules: [q_proj, c_attn]}")
    assert status == 2
    assert "trainer_engine.lora.target_modules: 'c_attn' is not a linear layer of the decoder layers" in err
    assert "q_proj" in err.split("(it has")[1]


def test_a_rank_below_one_is_refused_naming_the_field(tmp_path, monkeypatch, capsys):
    status, err = _with_lora(tmp_path, monkeypatch, capsys, "{rank: 0}")
    assert status == 2 and "trainer_engine.lora.rank: Input should be greater than or equal to 1 (got 0)" in err


def test_lm_head_as_a_target_is_refused_naming_the_field(tmp_path, monkeypatch, capsys):
    status, err = _with_lora(tmp_path, monkeypatch, capsys, "{rank: 8, target_modules: [q_proj, lm_head]}")
    assert status == 2 and "trainer_engine.lora: Value error, target_modules: 'lm_head' cannot take an adapter" in err


def test_lora_with_tensor_parallel_is_refused_naming_the_field():
    with pytest.raises(TopologyError, match=r"trainer_engine.lora with parallelism.tp 2"):
        parse_topology({"train_workers": 2, "parallelism": {"tp": 2}, "agent": {"framework": "guess"},
                        "rollout_engine": {"kind": "torch"}, "trainer_engine": {"kind": "torch", "lora": LORA}})


# -- data parallel (FSDP2 over gloo) ------------------------------------------------------------------

GRAD_CLIP = 0.05  # low enough to act on these gradients (asserted), so the sharded norm is tested too


def _run(model_dir, tmp_path, trajs, dp=1, resume=None, **over):
    """(stats, adapters, checkpoint folder) after one LoRA update of ``trajs`` in one process or on ``dp``
    FSDP2 ranks (this process rank 0, as the trainer node), from ``resume`` when given."""
    topo = _lora_topo(model_dir, engine={"grad_clip": GRAD_CLIP}, mini_batch_size=2,
                      **({"train_workers": dp} if dp > 1 else {}), **over)
    start = resume or model_dir
    tmp_path.mkdir(parents=True, exist_ok=True)
    if dp == 1:
        engine = TorchTrainEngine(topo, start, base_model=model_dir)
        if resume:
            engine.load_optimizer(resume)
        stats = engine.train(trajs, version=0)
        return stats, engine.state_dict(), engine.save_checkpoint(tmp_path / "single", 1, ["t"])
    resolved = tmp_path / "topo.json"
    resolved.write_text(json.dumps(dump_resolved(topo)))
    engine = torch_parallel.start(topo, resolved, start, base_model=model_dir)
    try:
        if resume:
            engine.load_optimizer(resume)
        stats = engine.train(trajs, version=0)
        return stats, engine.state_dict(), engine.save_checkpoint(tmp_path / f"dp{dp}", 1, ["t"])
    finally:
        engine.close()


def _assert_same_update(single, parallel, atol=1e-4):
    (s_stats, s_weights, s_folder), (p_stats, p_weights, p_folder) = single, parallel
    assert s_stats["grad_norm"] > GRAD_CLIP  # clipping acted
    assert p_stats["loss"] == pytest.approx(s_stats["loss"], abs=1e-5)
    assert p_stats["grad_norm"] == pytest.approx(s_stats["grad_norm"], rel=1e-4)
    assert sorted(p_weights) == sorted(s_weights) and all(lora.is_adapter(k) for k in s_weights)
    for name, w in s_weights.items():
        assert torch.allclose(p_weights[name], w, atol=atol), (name, float((p_weights[name] - w).abs().max()))
    s_ad, p_ad = lora.adapter_tensors(s_folder), lora.adapter_tensors(p_folder)
    assert sorted(s_ad) == sorted(p_ad) and all(torch.allclose(p_ad[k], v, atol=atol) for k, v in s_ad.items())
    s_opt, p_opt = (torch.load(f / "optimizer.pt", weights_only=True) for f in (s_folder, p_folder))
    assert p_opt["param_groups"] == s_opt["param_groups"] and sorted(p_opt["state"]) == sorted(s_opt["state"])
    for i, entry in s_opt["state"].items():
        for k, v in entry.items():
            assert (p_opt["state"][i][k] - v).abs().max() <= 1e-3 * v.abs().max(), (i, k)


@pytest.mark.timeout(180)
def test_lora_on_two_fsdp2_ranks_makes_the_single_process_update(model_dir, tmp_path):
    trajs = _episodes(model_dir, n=8, group=4)[:5]  # mini-batches 2, 2, 1: rank 1 joins the last with no row
    _assert_same_update(_run(model_dir, tmp_path / "a", trajs), _run(model_dir, tmp_path / "b", trajs, dp=2))


@pytest.mark.timeout(180)
def test_a_single_process_lora_checkpoint_resumes_under_fsdp2_with_the_same_next_update(model_dir, tmp_path):
    trajs = _episodes(model_dir, n=8, group=4)
    _, _, first = _run(model_dir, tmp_path / "a", trajs[:4])
    single = _run(model_dir, tmp_path / "b", trajs[4:], resume=first)
    parallel = _run(model_dir, tmp_path / "c", trajs[4:], dp=2, resume=first)
    _assert_same_update(single, parallel)
