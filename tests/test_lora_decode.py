"""The torch rollout engine serving LoRA adapters unmerged (areal_bus/model/adapters.py) on every decode path:
the eager gather path, the static step run eagerly (CPU) and replayed as CUDA graphs (GPU), where the
fused q/k/v and gate/up matmuls carry fused adapters. Each swap overwrites the adapters in place, so a
graph captured before a swap decodes with the new adapter after it.

Run:  .venv/bin/python -m pytest -q tests/test_lora_decode.py
      python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_lora_decode.py   (GPU host, no pyzmq)
"""

import numpy as np
import pytest
import torch

from areal_bus.engines.torch_engine import TorchRolloutEngine
from areal_bus.model import adapters
from areal_bus.model.modeling import make_random_model
from tests.test_cuda_decode import QWEN_HEADS, SMALL, graphs_and_gather_error, needs_cuda
from tests.test_torch_engine import PROMPTS, _full_logprobs, _model, _naive_greedy, _req, _run
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

TARGETS = list(adapters.PROJECTIONS)
RANK, SCALE = 4, 2.0


def _adapter(model, seed: int, std: float = 0.1) -> dict[str, torch.Tensor]:
    """A random adapter for ``model`` in the published format (both A and B non-zero)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=gen) * std for k, shape in sorted(adapters.wire_shapes(model).items())}


def _with(model, state):
    adapters.load_weights(model, state)
    return model


@pytest.mark.parametrize("device, static", [("cpu", False), ("cpu", True),
                                            pytest.param("cuda", True, marks=[pytest.mark.gpu, needs_cuda])],
                         ids=["cpu-gather", "cpu-static-step", "cuda-graphs"])
def test_each_swapped_adapter_is_what_every_decode_path_serves(device, static):
    ref = adapters.attach(_model(), TARGETS, RANK, SCALE)  # the CPU reference: full forwards
    first, second = _adapter(ref, 1), _adapter(ref, 2)
    versions = {"v1": first, "v2": second}
    engine = TorchRolloutEngine(adapters.attach(_model(), TARGETS, RANK, SCALE), max_batch=5, max_len=64,
                                eos_token_ids=[], device=device, static_decode=static,
                                decode_buckets=([2, 4, 5], SMALL[1]) if static else None,
                                weight_loader=lambda loc: {k: v.to(device) for k, v in versions[loc].items()})
    reqs = lambda: [_req(k, p, 20) for k, p in PROMPTS.items()] + [_req("e", PROMPTS["a"], 20, temperature=1.0)]
    tol = 1e-3 if device == "cuda" else 1e-5
    outs = []
    for version, loc in enumerate(("v1", "v2"), start=1):
        engine.swap_weights(version, loc)
        out = _run(engine, reqs())
        want = _with(ref, versions[loc])
        for r in reqs():
            comp = out[r.request_id]
            assert (comp.versions == version).all()
            if r.temperature == 0:
                assert comp.output_ids.tolist() == _naive_greedy(want, r.prompt_ids, 20), (loc, r.request_id)
            np.testing.assert_allclose(comp.logprobs, _full_logprobs(want, r.prompt_ids, comp, r.temperature), atol=tol)
        outs.append(out)
        if device == "cuda":
            assert engine.fast.captured  # the second version replays graphs captured under the first
    assert any(outs[0][k].output_ids.tolist() != outs[1][k].output_ids.tolist() for k in PROMPTS)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("attention, fuse", [("sdpa", False), ("auto", None)])
def test_cuda_graph_bf16_adapters_match_full_forward_as_closely_as_the_gather_path(attention, fuse):
    """At the 0.5B attention shape in bfloat16, the default decode (flash_varlen, fused, graphs) with an
    adapter on every projection: its log-probabilities are as close to a full forward's as the eager
    gather path's are."""
    model = adapters.attach(make_random_model(QWEN_HEADS, seed=0, device="cuda", dtype=torch.bfloat16),
                            TARGETS, 16, SCALE)
    adapters.load_weights(model, {k: v.to("cuda", torch.bfloat16) for k, v in _adapter(model, 3, 0.02).items()})
    graphs, gather = graphs_and_gather_error(model, attention, fuse)
    assert graphs <= max(0.05, 2 * gather), (graphs, gather)
