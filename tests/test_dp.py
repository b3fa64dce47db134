"""Data parallelism as the trainer node runs it (train_workers: 2 alone means dp=2, FSDP2 over gloo):
two ranks (this process and a child started by ``torch_parallel.start``) produce the update one
process makes on the same batch."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from areal_bus.engines import torch_parallel
from areal_bus.engines.torch_train import TorchTrainEngine
from areal_bus.config.topology import dump_resolved
from tests.test_torch_train import _episodes, _topo


@pytest.mark.timeout(120)
def test_two_gloo_ranks_match_one_process(model_dir, tmp_path, one_torch_thread):
    trajs = _episodes(model_dir, n=8, group=4)
    single = TorchTrainEngine(_topo(model_dir), model_dir)
    s_stats = single.train(trajs, version=0)

    topo = _topo(model_dir, train_workers=2)
    resolved = tmp_path / "topo.json"
    resolved.write_text(json.dumps(dump_resolved(topo)))
    parallel = torch_parallel.start(topo, resolved, model_dir)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            p_stats = parallel.train(trajs, version=0)
        p_weights = parallel.state_dict()  # gathered from the shards (rank 0)
    finally:
        parallel.close()
    # FSDP2 hooks its root's outputs for backward; a view among them would lose the hook to an in-place op
    assert not [w for w in seen if "returned a view tensor" in str(w.message)], [str(w.message) for w in seen]
    assert p_stats["loss"] == pytest.approx(s_stats["loss"], abs=1e-5)
    for name, a in single.model.state_dict().items():
        assert torch.allclose(a, p_weights[name], atol=1e-5), name
