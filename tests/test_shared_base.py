"""One copy of the base (model.share_base, areal_bus/model/shared_base.py): with LoRA the rollout engine serves
the trainer's own frozen base, mapped, and its fused q/k/v and gate/up are views of that buffer too.

CPU (shared memory): the trainer engine publishes its base; a rollout engine built by the rollout factory
serves it with no copy (every base tensor lies in the trainer's segment, a write through the trainer's
tensor shows in the engine's); its outputs and logprobs equal an engine that loaded its own copy, eager and
on the static decode step. GPU (CUDA IPC, marked gpu): the same across two processes.

Run:  .venv/bin/python -m pytest -q tests/test_shared_base.py
GPU host: python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_shared_base.py -m gpu
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from areal_bus.engines.rollout_factory import make_engine
from areal_bus.engines.torch_engine import TorchRolloutEngine
from areal_bus.model import adapters, shared_base
from areal_bus.model.modeling import TINY_QWEN2, TINY_QWEN3, ModelConfig, make_random_model, param_shapes, save_pretrained

REPO = Path(__file__).resolve().parent.parent
PROMPTS = {"a": [1, 5, 9, 14, 3], "b": [7, 2], "c": [11, 4, 4, 8, 20, 33, 6, 17, 5]}
LORA = {"rank": 4, "alpha": 8}


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "model"
    save_pretrained(make_random_model(TINY_QWEN2, seed=0, std=0.2), path)
    return path


def _topo(model_dir, tmp_path, **model):
    from areal_bus.config.topology import parse_topology  # lazy: pydantic, absent on the GPU host

    return parse_topology({
        "global_batch_size": 8, "trigger_batch_size": 4, "mini_batch_size": 4, "learning_rate": 1e-2,
        "model": {"path": str(model_dir), **model}, "agent": {"framework": "guess"},
        "rollout_engine": {"kind": "torch", "max_batch": 6, "max_len": 64},
        "trainer_engine": {"kind": "torch", "lora": LORA},
        "endpoints": {"ipc_dir": str(tmp_path / f"ab-{uuid.uuid4().hex[:8]}")}})


def topo_layers(ckpt) -> int:
    return ModelConfig.from_hf(ckpt).num_hidden_layers


def _req(rid, prompt, n=12, temperature=0.0):
    from areal_bus.wire.messages import GenerateRequest

    return GenerateRequest(request_id=rid, episode_id="e" + rid, ticket=0, min_version=0, max_tokens=n,
                           temperature=temperature, prompt_ids=np.asarray(prompt, dtype=np.int32))


def _run(engine):
    for k, p in PROMPTS.items():
        engine.add_request(_req(k, p))
        engine.add_request(_req(k + "-t", p, temperature=1.0))
    out = {}
    for _ in range(200):
        out.update({c.request_id: c for c in engine.step()})
        if len(out) == 2 * len(PROMPTS):
            return out
    raise AssertionError("did not finish")


def _adapter(model, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) * 0.1 for k, s in sorted(adapters.wire_shapes(model).items())}


@pytest.mark.parametrize("cfg", [TINY_QWEN2, TINY_QWEN3], ids=["qwen2-bias", "qwen3-qknorm"])
def test_fused_layout_puts_each_group_in_consecutive_rows(cfg):
    shapes = param_shapes(cfg)
    layout = shared_base.fused_layout(shapes, torch.float32)
    names = [s.name for s in layout.specs]
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.1.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)
    c = ModelConfig.from_hf(cfg)
    qkv = layout.by_name["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == ((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size)
    flat = torch.arange(layout.nbytes // 4, dtype=torch.float32)
    fused = {s.name: flat[s.offset // 4:(s.offset + s.nbytes) // 4].view(s.shape) for s in layout.specs}
    views = shared_base.split(fused, shapes)
    assert [(n, tuple(v.shape)) for n, v in views.items()] == shapes
    a = [views[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    whole = shared_base.fused_rows(a)
    assert whole.data_ptr() == a[0].data_ptr() and torch.equal(whole, torch.cat(a))  # a view, same values
    apart = [t.clone() for t in a]
    assert shared_base.fused_rows(apart).data_ptr() not in {t.data_ptr() for t in apart}  # a copy otherwise


def test_rollout_engine_serves_the_trainers_base_without_a_copy_and_the_same_tokens(ckpt, tmp_path, one_torch_thread):
    from areal_bus.engines.torch_train import TorchTrainEngine
    from areal_bus.engines.train_engine import WeightPublisher
    from areal_bus.train import lora

    topo = _topo(ckpt, tmp_path, share_base=True)
    trainer = TorchTrainEngine(topo, ckpt, publisher=WeightPublisher(topo), base_model=ckpt)
    try:
        assert trainer.shared_base is not None and os.path.exists(trainer.shared_base.where)
        segment = os.path.getsize(trainer.shared_base.where)
        built = make_engine(topo, "rollout-0", 0)
        engine = built.engine
        base = {n: p for n, p in engine.model.named_parameters()}
        # the fused buffer's storages: q/k/v share one per layer, gate/up another (views, not tensors of their own)
        ptrs = {p.untyped_storage().data_ptr() for p in base.values()}
        assert len(ptrs) <= len(base) - 3 * topo_layers(ckpt)
        assert sum(p.numel() * p.element_size() for p in base.values()) <= segment
        # shared, not copied: a write through the trainer's tensor is what the engine reads
        q_trainer = trainer.model.get_parameter("model.layers.0.self_attn.q_proj.base_layer.weight")
        q_engine = base["model.layers.0.self_attn.q_proj.weight"]
        assert not q_trainer.requires_grad
        with torch.no_grad():
            saved = q_trainer[0, 0].item()
            q_trainer[0, 0] = 123.0
            assert q_engine[0, 0].item() == 123.0
            q_trainer[0, 0] = saved

        own = TorchRolloutEngine(adapters.rollout_model(ckpt, topo.trainer_engine.lora), max_batch=6, max_len=64)
        state = lora.wire_weights({n: p for n, p in trainer.model.named_parameters() if lora.is_adapter(n)},
                                  torch.float32)
        state = {k: v + 0.05 for k, v in state.items()}  # B != 0: the adapter changes the tokens
        adapters.load_weights(engine.model, state)
        adapters.load_weights(own.model, state)
        got, want = _run(engine), _run(own)
        for k in want:
            assert got[k].output_ids.tolist() == want[k].output_ids.tolist(), k
            np.testing.assert_array_equal(got[k].logprobs, want[k].logprobs)
        where = trainer.shared_base.where
        trainer.close()  # the run's end: the base's segment goes with the trainer (the engine keeps its pages)
        assert not os.path.exists(where) and engine.model.get_parameter("model.layers.0.self_attn.q_proj.weight")[0, 0] \
            == saved
    finally:
        if trainer.shared_base is not None:
            trainer.shared_base.close()


def test_the_static_decode_step_fuses_the_shared_base_by_view(ckpt, tmp_path, one_torch_thread):
    """The decode step's fused q/k/v and gate/up: views of the shared buffer (no second copy), and its tokens
    and logprobs those of the step over an engine's own copy."""
    from areal_bus.engines.torch_train import TorchTrainEngine
    from areal_bus.engines.train_engine import WeightPublisher

    topo = _topo(ckpt, tmp_path, share_base=True)
    trainer = TorchTrainEngine(topo, ckpt, publisher=WeightPublisher(topo), base_model=ckpt)
    try:
        shapes = param_shapes(ModelConfig.from_hf(ckpt))
        views = shared_base.open_base(topo.shm_name(), shared_base.identity(ckpt, "float32"), shapes, torch.float32,
                                      "cpu", wait_s=5)
        lora_cfg = topo.trainer_engine.lora
        model = adapters.rollout_model(ckpt, lora_cfg, base=views)
        state = {k: v for k, v in _adapter(model).items()}
        engines = [TorchRolloutEngine(m, max_batch=6, max_len=64, static_decode=True, decode_buckets=([2, 6], [16, 64]))
                   for m in (model, adapters.rollout_model(ckpt, lora_cfg))]
        fast = engines[0].fast
        for i, layer in enumerate(model.model.layers):
            assert fast.w_qkv[i].data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
            assert fast.b_qkv[i].data_ptr() == layer.self_attn.q_proj.bias.data_ptr()
            assert fast.w_gate_up[i].data_ptr() == layer.mlp.gate_proj.weight.data_ptr()
        held, mapped = shared_base.held_bytes(model, views, fast)
        own_held, _ = shared_base.held_bytes(engines[1].model, None, engines[1].fast)
        assert mapped > 0 and held < 0.2 * own_held
        for e in engines:
            adapters.load_weights(e.model, state)
            e.fast.refresh()  # what a swap does: a no-op for the shared views, a copy for the own ones
        got, want = _run(engines[0]), _run(engines[1])
        for k in want:
            assert got[k].output_ids.tolist() == want[k].output_ids.tolist(), k
            np.testing.assert_allclose(got[k].logprobs, want[k].logprobs, atol=1e-6)
    finally:
        trainer.shared_base.close()


def test_a_worker_refuses_another_base_and_waits_with_a_clear_error(ckpt, tmp_path):
    shapes = param_shapes(ModelConfig.from_hf(ckpt))
    name = f"ab-test-{uuid.uuid4().hex[:8]}"
    with pytest.raises(Exception, match="did not publish the base within 0 s"):
        shared_base.open_base(name, 7, shapes, torch.float32, "cpu", wait_s=0)
    model = adapters.attach(make_random_model(TINY_QWEN2, seed=0).requires_grad_(False), ["q_proj"], 2, 1.0)
    for n, p in model.named_parameters():
        p.requires_grad_("lora" in n)
    shared = shared_base.publish(model, name, 7)
    try:
        with pytest.raises(Exception, match="another base"):
            shared_base.open_base(name, 8, shapes, torch.float32, "cpu", wait_s=0)
        with pytest.raises(Exception, match="does not match this rollout model"):
            shared_base.open_base(name, 7, shapes, torch.bfloat16, "cpu", wait_s=0)
        got = shared_base.open_base(name, 7, shapes, torch.float32, "cpu", wait_s=0)
        assert all(torch.equal(got[n], p) for n, p in model.named_parameters() if n in got)
    finally:
        shared.close()


def test_share_base_true_without_lora_is_refused_naming_the_field(ckpt, tmp_path):
    from areal_bus.config.topology import parse_topology

    topo = _topo(ckpt, tmp_path, share_base=True)
    data = topo.model_dump(by_alias=True)
    data["trainer_engine"].pop("lora")
    with pytest.raises(ValueError, match="model.share_base is true, but it needs trainer_engine.lora"):
        shared_base.shares(parse_topology(data), 0)
    assert not shared_base.enabled(_topo(ckpt, tmp_path))  # left out on CPU: off


def test_left_out_it_is_on_where_a_gpu_run_can_share_and_off_where_it_cannot(ckpt, tmp_path):
    from areal_bus.config.topology import parse_topology

    data = _topo(ckpt, tmp_path, device="cuda").model_dump(by_alias=True)
    data["model"].pop("share_base", None)
    assert shared_base.enabled(parse_topology(data)) and shared_base.shares(parse_topology(data), 0)
    full = {**data, "trainer_engine": {k: v for k, v in data["trainer_engine"].items() if k != "lora"}}
    assert not shared_base.enabled(parse_topology(full))  # full fine-tuning: no frozen base, and no error
    assert not shared_base.enabled(parse_topology({**data, "model": {**data["model"], "share_base": False}}))


def test_on_a_gpu_a_worker_shares_the_base_only_on_the_trainers_gpu(ckpt, tmp_path):
    from areal_bus.config.topology import parse_topology

    data = _topo(ckpt, tmp_path, device="cuda", share_base=True).model_dump(by_alias=True)
    assert shared_base.shares(parse_topology(data), 0)  # rollout and trainer on cuda:0
    data["rollout_workers"] = 2
    data["nodes"] = {"rollout": {"gpus": [0, 1]}, "trainer": {"gpus": [0]}}
    topo = parse_topology(data)
    assert shared_base.shares(topo, 0) and not shared_base.shares(topo, 1)  # replica 1 holds its own copy


# -- GPU: the same through CUDA IPC, trainer and engine in two processes ------------------------------

_READER = r"""
import sys, torch
from areal_bus.model import adapters, shared_base
from areal_bus.model.modeling import ModelConfig, param_shapes
from areal_bus.engines.torch_engine import TorchRolloutEngine
ckpt, name, ipc = sys.argv[1:4]
shapes = param_shapes(ModelConfig.from_hf(ckpt))
views = shared_base.open_base(name, 11, shapes, torch.bfloat16, "cuda", ipc_dir=ipc, wait_s=60)
model = adapters.rollout_model(ckpt, None, "cuda", torch.bfloat16, base=views)
e = TorchRolloutEngine(model, max_batch=4, max_len=64, device="cuda", dtype=torch.bfloat16)
layer = model.model.layers[0]
assert e.fast.w_qkv[0].data_ptr() == layer.self_attn.q_proj.weight.data_ptr(), "fused q/k/v copied"
held, mapped = shared_base.held_bytes(model, views, e.fast)
logits = model(torch.tensor([[1, 5, 9, 14, 3]], device="cuda"))
print("HELD", held, "MAPPED", mapped, "SUM", float(logits.float().sum()), "MEM", torch.cuda.memory_allocated())
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_base_is_served_by_another_process_without_a_copy(tmp_path):
    ckpt = tmp_path / "model"
    save_pretrained(make_random_model(TINY_QWEN2, seed=0, std=0.2), ckpt)
    model = make_random_model(TINY_QWEN2, seed=0, std=0.2, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    name, ipc = f"ab-{uuid.uuid4().hex[:8]}", tmp_path / "ipc"
    ipc.mkdir()
    shared = shared_base.publish(model, name, 11, ipc)
    want = float(model(torch.tensor([[1, 5, 9, 14, 3]], device="cuda")).float().sum())
    out = subprocess.run([sys.executable, "-c", _READER, str(ckpt), name, str(ipc)], capture_output=True, text=True,
                         timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    held, mapped, got = int(words[words.index("HELD") + 1]), int(words[words.index("MAPPED") + 1]), \
        float(words[words.index("SUM") + 1])
    assert mapped >= shared.nbytes * 0.99 and held < 0.01 * mapped, out.stdout
    assert got == pytest.approx(want, rel=1e-3, abs=1e-3)
    print(out.stdout)
