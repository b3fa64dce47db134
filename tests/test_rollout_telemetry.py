"""The rollout worker's running-batch series (nodes/rollout/core.py: BatchSeries): one record per
interval of what the engine runs, what is free and what waits for a version; the torch engine on the
shipped tiny model. The file the node writes is checked by tests/test_longtail.py's system run."""

from pathlib import Path

import numpy as np

from areal_bus.wire import messages as m
from areal_bus.engines.torch_engine import TorchRolloutEngine
from areal_bus.config.topology import load_topology
from nodes.rollout.core import BatchSeries, RolloutCore, StepLog
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

ROOT = Path(__file__).resolve().parents[1]
TOPO = load_topology(ROOT / "topology" / "sim.yaml")


def _req(rid, max_tokens, min_version=0):
    return m.GenerateRequest(request_id=rid, episode_id="ep-" + rid, ticket=0, min_version=min_version,
                             max_tokens=max_tokens, temperature=0.0, prompt_ids=np.asarray([5, 9, 14], np.int32))


def test_the_series_records_running_free_and_waiting_once_per_interval():
    engine = TorchRolloutEngine(ROOT / "models" / "tiny-guess", max_batch=4, max_len=64, eos_token_ids=[])
    core = RolloutCore(engine, "rollout-0", 1, StepLog(TOPO))
    series = BatchSeries(max_batch=4, every=0.5)
    first = series.sample(core, 10.0)
    assert (first["running"], first["free"], first["waiting"], first["max_batch"]) == (0, 4, 0, 4)
    for rid, n in (("a", 2), ("b", 6), ("c", 6)):
        core.on_request(_req(rid, n))
    core.on_request(_req("later", 4, min_version=1))  # held for a version the worker does not serve
    assert series.sample(core, 10.2) is None  # not due yet
    rec = series.sample(core, 10.5)
    assert (rec["running"], rec["free"], rec["waiting"], rec["tokens"]) == (3, 1, 1, 0)
    for _ in range(3):
        core.step()  # "a" (2 tokens) finishes
    rec = series.sample(core, 11.0)
    assert (rec["running"], rec["free"], rec["tokens"]) == (2, 2, 2)
    assert rec["t"] > 1e9  # wall time: series of several workers line up with the trainer's records
