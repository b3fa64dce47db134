"""The vLLM rollout engine serving LoRA adapters (trainer_engine.lora; areal_bus/engines/vllm_engine.py, whose
module docstring says how): every part that does not need vLLM is tested here with plain data; the tests
that drive vLLM (marked gpu) skip, with the reason, where vLLM or a GPU is absent. Written against vLLM
0.25.1's source; the gpu tests have NOT yet run on a GPU. They share one engine (rank-4 adapters, alpha 8, on
all seven projections of models/tiny-guess) and run in file order: version 0 (the zero adapter) first, then
the swaps. Run the file in a process of its own on the GPU host (one vLLM engine per process, as
tests/test_vllm_engine.py has).

Run:  .venv/bin/python -m pytest -q tests/test_vllm_lora.py
      bash scripts/gpu-host/gpu_vllm.sh python3 -m pytest -q --noconftest tests/test_vllm_lora.py   (GPU host)
"""

from __future__ import annotations

import typing

import numpy as np
import pytest
import torch

from areal_bus.config.engines import LORA_TARGETS, LoraConfig
from areal_bus.config.topology import TopologyError, parse_topology
from areal_bus.engines import vllm_engine as ve
from areal_bus.engines import vllm_worker as vw
from areal_bus.model import adapters
from areal_bus.model.modeling import TINY_LLAMA, TINY_QWEN3, load_pretrained, make_random_model, save_pretrained
from areal_bus.weights.shm import ShmWeightWriter
from tests.test_vllm_engine import TINY, _recompute, _req, _run, shm_name, tiny_engine  # noqa: F401 (shm_name: a fixture)

TARGETS = list(LORA_TARGETS)
RANK = 4
LORA = LoraConfig(rank=RANK, alpha=8)  # scale 2: a scale applied twice, or not at all, shows
ADAPTER_STD = 0.06
"""Spread of the test adapters' A and B: on tiny-guess the served log-probabilities move by ~0.8 at most
from the base's, and by ~1.7 between scale 2 and scale 4, far past the 5e-2 of bfloat16 agreement."""


def _shapes(rank: int = RANK) -> dict[str, tuple[int, int]]:
    return vw.adapter_shapes(vw.checkpoint_shapes(TINY), TARGETS, rank)


def _adapter(seed: int, rank: int = RANK) -> dict[str, torch.Tensor]:
    """A random adapter for tiny-guess in the published format (A and B non-zero, bfloat16)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(s, generator=gen) * ADAPTER_STD).to(torch.bfloat16) for k, s in _shapes(rank).items()}


def _topology(rank=RANK, dtype="bfloat16"):
    return parse_topology({"agent": {"framework": "guess"},
                           "model": {"path": str(TINY), "device": "cuda", "dtype": dtype},
                           "rollout_engine": {"kind": "vllm"},
                           "trainer_engine": {"kind": "torch", "lora": {"rank": rank, "alpha": 2 * rank}}}, "topo.yaml")


# -- engine arguments ---------------------------------------------------------------------------------


def test_a_lora_engine_turns_on_vllms_lora_for_one_adapter_on_our_targets():
    spec = vw.lora_spec(LORA)
    assert spec == {"rank": 4, "alpha": 8.0, "target_modules": TARGETS}
    kw = ve.engine_kwargs("/m", max_batch=8, max_len=256, dtype="bfloat16", seed=0, lora=spec)
    assert (kw["enable_lora"], kw["max_loras"], kw["max_lora_rank"], kw["lora_target_modules"]) == (True, 1, 8, TARGETS)
    plain = ve.engine_kwargs("/m", max_batch=8, max_len=256, dtype="bfloat16", seed=0)
    assert {k: v for k, v in kw.items() if k not in plain} == {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8,
                                                               "lora_target_modules": TARGETS}
    assert all(kw[k] == v for k, v in plain.items())  # exact tags and logprobs as without LoRA
    assert vw.lora_spec(None) is None


@pytest.mark.parametrize("rank, served", [(1, 1), (2, 8), (8, 8), (9, 16), (64, 64), (300, 320), (512, 512)])
def test_the_served_rank_is_the_smallest_vllm_takes_that_holds_ours(rank, served):
    assert vw.max_lora_rank(rank) == served


def test_a_rank_past_vllms_largest_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"trainer_engine.lora.rank 513: vLLM serves adapters of rank 512 at most"):
        vw.max_lora_rank(513)


def test_a_vllm_without_the_lora_arguments_is_refused_when_lora_is_asked_for():
    kw = ve.engine_kwargs("/m", max_batch=2, max_len=64, dtype="bfloat16", seed=0, lora=vw.lora_spec(LORA))
    with pytest.raises(RuntimeError, match=r"lacks lora_target_modules: vLLM 0.25.1 \(its LoRA arguments\)"):
        ve.fit_engine_args(kw, set(kw) - {"lora_target_modules"})
    plain = ve.engine_kwargs("/m", max_batch=2, max_len=64, dtype="bfloat16", seed=0)
    assert ve.fit_engine_args(plain, set(plain)) == plain  # without LoRA nothing of it is needed


# -- the adapter's layout -----------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny-guess", "qwen3", "llama"])
@pytest.mark.parametrize("targets", [TARGETS, ["q_proj", "down_proj"]], ids=["all", "q-down"])
def test_the_expected_adapter_is_the_one_the_torch_engine_serves_on_the_same_checkpoint(tmp_path, model, targets):
    """The shapes come from the checkpoint's safetensors headers; the torch engine's adapters from its
    modules (areal_bus/model/adapters.py): the same names and shapes, for a head_dim of its own (qwen3) and
    fewer key/value heads (all three) too."""
    path = TINY
    if model != "tiny-guess":
        path = tmp_path / model
        save_pretrained(make_random_model({"qwen3": TINY_QWEN3, "llama": TINY_LLAMA}[model], 0), path)
    served = adapters.wire_shapes(adapters.attach(load_pretrained(path), targets, RANK, 2.0))
    assert vw.adapter_shapes(vw.checkpoint_shapes(path), targets, RANK) == served


def test_a_target_the_checkpoint_lacks_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"target_modules: the checkpoint has no c_attn layer"):
        vw.adapter_shapes(vw.checkpoint_shapes(TINY), ["q_proj", "c_attn"], RANK)


def test_the_zero_adapter_serves_the_base():
    """What the engine registers before its first request (version 0): the torch engine's loader takes it
    as an adapter of this checkpoint, and it leaves the base's logits as they are."""
    zero = dict(vw.zero_adapter(_shapes()))
    assert all(not t.any() for t in zero.values())
    model = adapters.rollout_model(TINY, LORA)
    adapters.load_weights(model, _adapter(0))
    adapters.load_weights(model, zero)
    ids = torch.randint(1, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), load_pretrained(TINY)(ids), atol=0, rtol=0)


def test_published_names_become_the_names_vllms_adapter_loader_reads():
    """vLLM's loader reads an adapter_model.safetensors' names: peft's, the Hugging Face module under
    "base_model.model.", which it strips before mapping the module to its own LoRA layer."""
    name = "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert vw.vllm_lora_name(name) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert vw.lora_module("model.layers.1.mlp.down_proj.lora_B.weight") == "model.layers.1.mlp.down_proj"
    with pytest.raises(ValueError, match="not an adapter tensor"):
        vw.vllm_lora_name("model.layers.0.self_attn.q_proj.weight")


def _vllm_layers(layers: int) -> tuple[list[str], dict[str, list[str]]]:
    """vLLM's LoRA layers of a Qwen2 / Llama model and the projections each packed one runs (its
    LoRA manager's ``modules`` and ``packed_modules``, vLLM 0.25.1)."""
    wrapped, packed = [], {}
    for i in range(layers):
        p = f"model.layers.{i}"
        wrapped += [f"{p}.self_attn.qkv_proj", f"{p}.self_attn.o_proj", f"{p}.mlp.gate_up_proj", f"{p}.mlp.down_proj"]
        packed[f"{p}.self_attn.qkv_proj"] = [f"{p}.self_attn.{x}_proj" for x in "qkv"]
        packed[f"{p}.mlp.gate_up_proj"] = [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"]
    return wrapped, packed


def test_adapter_modules_that_no_lora_layer_of_vllm_takes_are_named():
    modules = {vw.lora_module(k) for k in _shapes()}
    wrapped, packed = _vllm_layers(2)
    assert vw.unserved_modules(modules, wrapped, packed) == []
    assert vw.unserved_modules(modules | {"model.layers.0.mlp.c_fc"}, wrapped, packed) == ["model.layers.0.mlp.c_fc"]
    assert vw.unserved_modules(modules, *_vllm_layers(1)) == sorted(m for m in modules if ".layers.1." in m)


def test_a_wrong_adapter_is_refused_naming_what_differs_before_anything_reaches_vllm(shm_name):
    full = {k: v.detach() for k, v in load_pretrained(TINY).named_parameters()}
    cases = [(_adapter(1, rank=8), r"wrong shape \['model.layers.0.mlp.down_proj.lora_A.weight'"),
             (dict(list(_adapter(1).items())[1:]), r"missing \['model.layers.0.mlp.down_proj.lora_A.weight'\]"),
             (full, r"missing \[.*; unknown \[")]  # full weights, as from a trainer without LoRA
    for state, why in cases:
        with ShmWeightWriter(shm_name, state, copy_threads=1) as writer:
            location = writer.write(state, version=1)
            feed = vw.WeightFeed(_shapes(), tied=False, what="adapter")
            feed.attach({"kind": "shm", "name": shm_name})
            with pytest.raises(ValueError, match="adapter does not match the served checkpoint: .*" + why):
                feed.items(location)


# -- the topology --------------------------------------------------------------------------------------


def test_the_topology_accepts_lora_with_the_vllm_engine_and_hands_it_over(monkeypatch):
    topo = _topology()
    built = {}
    monkeypatch.setattr(ve, "VllmRolloutEngine", lambda path, **kw: built.update(kw, path=path) or "engine")
    assert ve.engine_from_topology(topo, "rollout-0", 0) == "engine"
    assert built["lora"] is topo.trainer_engine.lora and built["path"] == TINY


def test_a_rank_vllm_cannot_serve_is_refused_naming_the_field():
    assert _topology(rank=512).trainer_engine.lora.rank == 512
    with pytest.raises(TopologyError, match=r"trainer_engine.lora.rank 1024: rollout_engine.kind 'vllm' serves "
                                            r"adapters of rank 512 at most"):
        _topology(rank=1024)


def test_vllm_lora_in_float32_is_refused_naming_the_field():
    """vLLM's LoRA kernels (lora_shrink) take bfloat16 or float16 only."""
    with pytest.raises(TopologyError, match=r"vLLM's LoRA kernels take bfloat16 or float16, and model.dtype is "
                                            r"'float32'"):
        _topology(dtype="float32")
    assert _topology(dtype="float16").model.dtype == "float16"


# -- with vLLM on a GPU (written for vLLM 0.25.1; not yet run; skipped where vLLM or a GPU is missing) --


@pytest.fixture(scope="module")
def lora_engine():
    engine = tiny_engine(lora=LORA)
    yield engine
    del engine.llm


def _reference(adapter: dict[str, torch.Tensor] | None = None, b_times: float = 1.0):
    """What the trainer recomputes with ``adapter`` (its lora_B times ``b_times``): the rollout model of
    areal_bus/model/adapters.py, base + alpha / rank * B(A(x)), whose log-probabilities are the trainer's
    peft model's (tests/test_lora.py), on the GPU in bfloat16."""
    model = adapters.rollout_model(TINY, LORA, "cuda", torch.bfloat16)
    if adapter is not None:
        adapters.load_weights(model, {k: (v * b_times if ".lora_B." in k else v).to("cuda", torch.bfloat16)
                                      for k, v in adapter.items()})
    return model.eval()


def _swap_in(engine, shm_name: str, adapter: dict[str, torch.Tensor]) -> int:
    """Publish ``adapter`` as the engine's next version through shared memory and swap to it; its version."""
    version = engine.version + 1
    with ShmWeightWriter(shm_name, adapter, copy_threads=1) as writer:
        engine.attach_weights({"kind": "shm", "name": shm_name})
        engine.swap_weights(version, writer.write(adapter, version))
    return version


def _recorded_and_recomputed(done, reqs, model) -> tuple[np.ndarray, np.ndarray]:
    got = np.concatenate([done[r.request_id].logprobs for r in reqs])
    return got, np.concatenate([_recompute(model, r, done[r.request_id]) for r in reqs])


@pytest.mark.gpu
def test_vllm_holds_the_adapter_before_any_request_with_the_ranks_we_expect(lora_engine):
    from vllm.config.lora import MaxLoRARanks

    assert typing.get_args(MaxLoRARanks) == vw.VLLM_LORA_RANKS
    assert vw.LORA_ID in lora_engine.llm.list_loras()


@pytest.mark.gpu
def test_vllm_version_0_is_the_base(lora_engine):
    greedy, sampled = _req("g0", [1, 5, 7], 12, temperature=0.0), _req("t0", [3, 4], 12, temperature=0.7)
    done = _run(lora_engine, [greedy, sampled])
    base = _reference()
    for r in (greedy, sampled):
        comp = done[r.request_id]
        assert comp.versions.tolist() == [0] * comp.output_ids.size
        assert np.allclose(comp.logprobs, _recompute(base, r, comp), atol=5e-2)
    # the greedy tokens are the base's: each is its argmax, but for bfloat16 near-ties
    comp = done["g0"]
    ids = torch.tensor([list(greedy.prompt_ids) + comp.output_ids.tolist()], device="cuda")
    with torch.no_grad():
        logits = base(ids)[0, len(greedy.prompt_ids) - 1:-1].float()
    chosen = logits.gather(1, ids[0, len(greedy.prompt_ids):, None])[:, 0]
    assert ((logits.max(dim=1).values - chosen) < 0.05).all(), (logits.argmax(dim=1), comp.output_ids)


@pytest.mark.gpu
def test_vllm_serves_a_swapped_adapter_with_the_trainers_logprobs_scaled_once(lora_engine, shm_name):
    adapter = _adapter(1)
    version = _swap_in(lora_engine, shm_name, adapter)
    reqs = [_req("g1", [1, 5, 7], 12, temperature=0.0)] + [_req(f"s1{i}", [2 + i, 6], 12, temperature=1.0)
                                                         for i in range(3)]
    done = _run(lora_engine, reqs)
    assert all(done[r.request_id].versions.tolist() == [version] * 12 for r in reqs)
    got, once = _recorded_and_recomputed(done, reqs, _reference(adapter))
    _, twice = _recorded_and_recomputed(done, reqs, _reference(adapter, b_times=2.0))
    _, base = _recorded_and_recomputed(done, reqs, _reference())
    np.testing.assert_allclose(got, once, atol=5e-2)
    assert np.abs(got - twice).max() > 0.1  # alpha / rank applied once, not twice
    assert np.abs(got - base).max() > 0.1  # the adapter is what was served


@pytest.mark.gpu
def test_vllm_swaps_the_adapter_between_steps_of_running_requests_and_tags_tokens_by_version(lora_engine, shm_name):
    adapter = _adapter(2)
    old = lora_engine.version
    new = old + 1
    reqs = [_req(f"m{i}", [1 + i, 5, 7], 10, temperature=1.0) for i in range(3)]
    with ShmWeightWriter(shm_name, adapter, copy_threads=1) as writer:
        lora_engine.attach_weights({"kind": "shm", "name": shm_name})
        location = writer.write(adapter, new)
        done = _run(lora_engine, reqs, between=lambda i: i == 3 and lora_engine.swap_weights(new, location))
    for r in reqs:  # none was aborted: the old version's tokens first, then the new one's
        tags = done[r.request_id].versions.tolist()
        assert len(tags) == 10 and tags[0] == old and tags[-1] == new and tags == sorted(tags), tags
    fresh = _req("m-after", [2, 6], 8, temperature=1.0)
    comp = _run(lora_engine, [fresh])["m-after"]
    assert comp.versions.tolist() == [new] * 8
    assert np.allclose(comp.logprobs, _recompute(_reference(adapter), fresh, comp), atol=5e-2)


@pytest.mark.gpu
def test_vllm_refuses_a_wrong_adapter_and_keeps_serving_the_one_it_has(lora_engine, shm_name):
    good = _adapter(3)
    version = _swap_in(lora_engine, shm_name, good)
    loaded = lora_engine.weights_loaded
    full = {k: v.detach().to(torch.bfloat16) for k, v in load_pretrained(TINY).named_parameters()}
    for bad, why in ((_adapter(4, rank=8), "wrong shape"), (dict(list(_adapter(4).items())[1:]), "missing"),
                     (full, "unknown")):
        with ShmWeightWriter(shm_name, bad, copy_threads=1) as writer:
            lora_engine.attach_weights({"kind": "shm", "name": shm_name})
            with pytest.raises(ValueError, match="adapter does not match the served checkpoint: .*" + why):
                lora_engine.swap_weights(version + 1, writer.write(bad, version + 1))
        assert (lora_engine.version, lora_engine.weights_loaded) == (version, loaded)
    assert vw.LORA_ID in lora_engine.llm.list_loras()
    fresh = _req("w-after", [2, 6], 8, temperature=1.0)
    comp = _run(lora_engine, [fresh])["w-after"]
    assert comp.versions.tolist() == [version] * 8
    assert np.allclose(comp.logprobs, _recompute(_reference(good), fresh, comp), atol=5e-2)


def _cuda_adapter_publisher(conn) -> None:
    """The trainer's side of a CUDA IPC handoff, in its own process (a process cannot open its own CUDA
    IPC handles): ``_adapter(v)`` as version ``v`` for each ``v`` asked for; asked "check", the largest
    difference between what its buffer now holds and what it wrote there."""
    from areal_bus.weights.cuda import CudaWeightWriter, parse_location

    template = {k: torch.empty(s, dtype=torch.bfloat16, device="meta") for k, s in _shapes().items()}
    writer = CudaWeightWriter("vllmloratest", template, device="cuda")
    conn.send(writer.handles())
    written = None
    while (msg := conn.recv()) is not None:
        if msg == "check":
            k, state = written
            conn.send(max(float((writer.views(k)[name].float() - t.float()).abs().max()) for name, t in state.items()))
            continue
        state = {k: v.to("cuda") for k, v in _adapter(msg).items()}
        location = writer.write(state, msg)
        written = (parse_location(location)[1], state)
        conn.send(location)


@pytest.mark.gpu
def test_vllm_takes_an_adapter_over_cuda_ipc_and_leaves_the_published_buffer_as_it_was(lora_engine):
    """A CUDA IPC buffer is on this GPU, where ``Tensor.to`` hands a tensor over as it is: vLLM's in-place
    scaling of lora_B must land in the worker's own copy, never in the trainer's buffer."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_cuda_adapter_publisher, args=(there,), daemon=True)
    proc.start()
    try:
        lora_engine.attach_weights({"kind": "cuda", "handles": here.recv()})
        version = lora_engine.version + 1
        here.send(version)
        location = here.recv()
        assert location.startswith("cuda:vllmloratest.")
        lora_engine.swap_weights(version, location)
        here.send("check")
        assert here.recv() == 0.0
        fresh = _req("ipc", [2, 6], 8, temperature=1.0)
        comp = _run(lora_engine, [fresh])["ipc"]
        assert comp.versions.tolist() == [version] * 8
        assert np.allclose(comp.logprobs, _recompute(_reference(_adapter(version)), fresh, comp), atol=5e-2)
    finally:
        here.send(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
