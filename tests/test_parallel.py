"""Trainer parallelism over gloo: FSDP2 data parallel (dp=2) and DTensor tensor parallel (tp=2) make
the update one process makes on the same batch (loss, weights, checkpoint); layouts the trainer does
not support are refused, naming what it does support.

Each parallel test is rank 0 itself (as the trainer node is) and starts the other rank as a child
process through the node's own path (``torch_parallel.start``)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from areal_bus.engines import torch_parallel
from areal_bus.engines.torch_train import TorchTrainEngine
from areal_bus.model.modeling import load_pretrained
from areal_bus.config.topology import TopologyError, dump_resolved, parse_topology
from tests.test_torch_train import _episodes, _topo

# A clip low enough to act on these gradients (asserted below), so the sharded norm is tested too.
GRAD_CLIP = 0.05
# Weights after AdamW steps of lr 1e-2: Adam divides by sqrt(v), so where a gradient is near zero the
# rounding of a sharded sum (another summation order) moves the step by up to ~1% (seen: 4e-5).
WEIGHT_ATOL = 1e-4


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


def _run(model_dir, tmp_path, trajs, resume=None, **layout):
    """(stats, full weights, checkpoint folder) after one update of ``trajs``: one process when
    ``layout`` is empty, else dp x tp ranks. ``resume``: start from this checkpoint (weights and
    optimizer) as the trainer node does."""
    # dp x tp written as the topology writes it: train_workers ranks, tp the layout inside them
    ranks = {"train_workers": layout.get("dp", 1) * layout.get("tp", 1), "parallelism": {"tp": layout.get("tp", 1)}}
    topo = _topo(model_dir, mini_batch_size=2, trainer_engine={"kind": "torch", "grad_clip": GRAD_CLIP},
                 **(ranks if layout else {}))
    start_from = resume or model_dir
    tmp_path.mkdir(parents=True, exist_ok=True)
    name = "_".join(f"{k}{v}" for k, v in layout.items()) or "single"
    if not layout:
        engine = TorchTrainEngine(topo, start_from)
        if resume:
            engine.load_optimizer(resume)
        stats = engine.train(trajs, version=0)
        return stats, engine.state_dict(), engine.save_checkpoint(tmp_path / name, 1, ["t"])
    resolved = tmp_path / f"{name}.json"
    resolved.write_text(json.dumps(dump_resolved(topo)))
    engine = torch_parallel.start(topo, resolved, start_from)
    try:
        if resume:
            engine.load_optimizer(resume)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            stats = engine.train(trajs, version=0)
        weights = engine.state_dict()
        folder = engine.save_checkpoint(tmp_path / name, 1, ["t"])
    finally:
        engine.close()
    # FSDP2 hooks its root's outputs for backward; a view among them would lose the hook to an in-place op
    assert not [w for w in seen if "returned a view tensor" in str(w.message)], [str(w.message) for w in seen]
    return stats, weights, folder


def _assert_same_update(single, parallel):
    (s_stats, s_weights, s_folder), (p_stats, p_weights, p_folder) = single, parallel
    assert s_stats["grad_norm"] > GRAD_CLIP  # clipping acted
    assert p_stats["loss"] == pytest.approx(s_stats["loss"], abs=1e-5)
    assert p_stats["grad_norm"] == pytest.approx(s_stats["grad_norm"], rel=1e-4)  # seen: 1e-5
    assert sorted(p_weights) == sorted(s_weights)
    for name, w in s_weights.items():
        assert torch.allclose(p_weights[name], w, atol=WEIGHT_ATOL), (name, float((p_weights[name] - w).abs().max()))
    assert torch.equal(p_weights["lm_head.weight"], p_weights["model.embed_tokens.weight"])  # still tied
    # The checkpoint: the same HF weights and the same optimizer state, in the single-process format.
    for name, w in load_pretrained(s_folder).state_dict().items():
        assert torch.allclose(load_pretrained(p_folder).state_dict()[name], w, atol=WEIGHT_ATOL), name
    s_opt, p_opt = (torch.load(f / "optimizer.pt", weights_only=True) for f in (s_folder, p_folder))
    assert p_opt["param_groups"] == s_opt["param_groups"]
    assert sorted(p_opt["state"]) == sorted(s_opt["state"])
    for i, entry in s_opt["state"].items():
        for k, v in entry.items():
            # AdamW's moments are tiny (|exp_avg| < 1e-3): compare relative to each tensor's scale.
            assert (p_opt["state"][i][k] - v).abs().max() <= 1e-3 * v.abs().max(), (i, k)  # seen: 1e-4


@pytest.mark.timeout(120)
def test_fsdp2_data_parallel_on_two_ranks_makes_the_single_process_update(model_dir, tmp_path):
    # 5 samples in mini-batches of at most 2: uneven splits (2, 2, 1), and a last mini-batch of one row,
    # so rank 1 joins that step with no rows of its own.
    trajs = _episodes(model_dir, n=8, group=4)[:5]
    _assert_same_update(_run(model_dir, tmp_path, trajs), _run(model_dir, tmp_path, trajs, dp=2))


@pytest.mark.timeout(120)
def test_tensor_parallel_on_two_ranks_makes_the_single_process_update(model_dir, tmp_path):
    trajs = _episodes(model_dir, n=8, group=4)[:5]
    _assert_same_update(_run(model_dir, tmp_path, trajs), _run(model_dir, tmp_path, trajs, tp=2))


@pytest.mark.timeout(120)
def test_a_single_process_checkpoint_resumes_under_fsdp2_with_the_same_next_update(model_dir, tmp_path):
    trajs = _episodes(model_dir, n=8, group=4)
    _, _, first = _run(model_dir, tmp_path / "a", trajs[:4])  # weights and AdamW moments after one update
    single = _run(model_dir, tmp_path / "b", trajs[4:], resume=first)
    parallel = _run(model_dir, tmp_path / "c", trajs[4:], resume=first, dp=2)
    _assert_same_update(single, parallel)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp2_and_tensor_parallel_on_four_ranks_make_the_single_process_update(model_dir, tmp_path):
    trajs = _episodes(model_dir, n=8, group=4)[:5]
    _assert_same_update(_run(model_dir, tmp_path, trajs), _run(model_dir, tmp_path, trajs, dp=2, tp=2))


# -- layouts the trainer does not support ------------------------------------------------------


@pytest.mark.parametrize("field", ["pp", "cp", "ep"])
def test_pipeline_context_and_expert_parallel_are_refused_naming_what_is_supported(field):
    with pytest.raises(TopologyError) as err:
        parse_topology({"parallelism": {field: 2}})
    msg = str(err.value)
    assert f"parallelism: Value error, parallelism.{field}: the trainer supports" in msg
    assert "dp (data parallel, FSDP2: train_workers / tp) and tp (tensor parallel, DTensor) only" in msg


def test_a_tp_that_does_not_divide_train_workers_is_refused():
    with pytest.raises(TopologyError, match=r"train_workers \(3\) must be a multiple of parallelism.tp \(2\)"):
        parse_topology({"train_workers": 3, "parallelism": {"tp": 2}})


def test_dp_is_derived_and_writing_it_names_the_fix():
    with pytest.raises(TopologyError, match=r"parallelism.dp is not written.*train_workers: 4, parallelism: \{tp: 2\}"):
        parse_topology({"parallelism": {"dp": 2, "tp": 2}})


def test_train_workers_alone_is_data_parallel_and_tp_splits_them():
    alone = parse_topology({"train_workers": 2})
    assert (alone.parallelism.dp, alone.parallelism.tp) == (2, 1)
    block = parse_topology({"train_workers": 4, "parallelism": {"tp": 2}})
    assert (block.parallelism.dp, block.parallelism.tp) == (2, 2)
    # The resolved topology the other ranks read parses back to the same layout.
    again = parse_topology(dump_resolved(block))
    assert (again.train_workers, again.parallelism.dp, again.parallelism.tp) == (4, 2, 2)


def test_a_tp_the_model_cannot_split_is_refused_before_any_rank_starts(model_dir, tmp_path):
    topo = _topo(model_dir, train_workers=4, parallelism={"tp": 4})  # the tiny model: 4 query heads, 2 kv heads
    with pytest.raises(ValueError, match=r"tp=4 does not divide num_key_value_heads \(2\).*supports: 1, 2"):
        torch_parallel.start(topo, tmp_path / "unused.json", model_dir)
