"""Data parallelism over gloo: two ranks (this process and a child) produce exactly the update one
process makes on the same batch."""

from __future__ import annotations

import json

import pytest
import torch

from areal_bus.engines.torch_dp import DataParallel
from areal_bus.engines.torch_train import TorchTrainEngine
from areal_bus.topology import dump_resolved
from tests.test_torch_train import _episodes, _topo


@pytest.mark.timeout(120)
def test_two_gloo_ranks_match_one_process(model_dir, tmp_path, one_torch_thread):
    trajs = _episodes(model_dir, n=8, group=4)
    single = TorchTrainEngine(_topo(model_dir), model_dir)
    s_stats = single.train(trajs, version=0)

    topo = _topo(model_dir, train_workers=2)
    resolved = tmp_path / "topo.json"
    resolved.write_text(json.dumps(dump_resolved(topo)))
    dp = DataParallel.launch(2, str(resolved), str(model_dir))
    try:
        parallel = TorchTrainEngine(topo, model_dir, dp=dp)
        p_stats = parallel.train(trajs, version=0)
    finally:
        dp.close()
    assert p_stats["loss"] == pytest.approx(s_stats["loss"], abs=1e-5)
    for (name, a), b in zip(single.model.state_dict().items(), parallel.model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), name
