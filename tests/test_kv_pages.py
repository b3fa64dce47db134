"""The torch engine's paged KV cache (engines/kv_pages.py, rollout_engine.kv_tokens): the same tokens and
log-probabilities as the dense cache on every decode path, more sequences in the same bytes, requests that
wait for pages instead of failing, preempted sequences that resume exactly, versions tagged across a swap,
LoRA adapters served as before.

Run:  .venv/bin/python -m pytest -q tests/test_kv_pages.py
      python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_kv_pages.py -m gpu   (GPU host, no pyzmq)
"""

import numpy as np
import pytest
import torch

from areal_bus.engines.cuda_decode import decode_choices
from areal_bus.engines.kv_pages import PagedKVCache, paged_kernel
from areal_bus.engines.torch_engine import TorchRolloutEngine
from areal_bus.model import adapters
from areal_bus.model.modeling import KVCache, make_random_model, save_pretrained
from tests.test_cuda_decode import QWEN_HEADS, needs_cuda
from tests.test_torch_engine import PROMPTS, _full_logprobs, _model, _req, _run
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

PATHS = {"eager": {}, "static-sdpa": {"static_decode": True, "attention": "sdpa"},
         "static-flash_paged": {"static_decode": True, "attention": "flash_paged"}}
"""Decode paths on CPU: the model's forward over gathered pages; the fixed-shape step over gathered pages;
the fixed-shape step through flash_paged's inputs (block tables, key counts), computed in plain torch."""


def _engine(model, **kw):
    kw = {"max_batch": 4, "max_len": 64, "eos_token_ids": [], "worker": "w0"} | kw
    return TorchRolloutEngine(model, **kw)


def _mixed(n=10, seed=0):
    """Requests of mixed prompt and output lengths (a 1-token prompt among them)."""
    rng = np.random.default_rng(seed)
    reqs = [_req(f"r{i}", rng.integers(3, 100, int(rng.integers(2, 25))).tolist(), int(rng.integers(4, 30)))
            for i in range(n - 1)]
    return reqs + [_req("one", [42], 9)]


def _continuous(engine, reqs, max_steps=2000):
    """Add requests whenever the engine has room (as the rollout node does), step until all finish;
    ({request_id: Completion}, the most sequences that ran at once)."""
    queue, out, peak = list(reqs), {}, 0
    for _ in range(max_steps):
        while queue and engine.free_slots > 0:
            engine.add_request(queue.pop(0))
        out |= {c.request_id: c for c in engine.step()}
        peak = max(peak, engine.in_cache)
        if len(out) == len(reqs):
            return out, peak
    raise AssertionError("did not finish")


def _same(got, want, tol=1e-5):
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].output_ids.tolist() == want[k].output_ids.tolist(), k
        np.testing.assert_allclose(got[k].logprobs, want[k].logprobs, atol=tol)
        assert got[k].finish_reason == want[k].finish_reason


@pytest.mark.parametrize("path", list(PATHS))
def test_paged_cache_gives_the_dense_caches_tokens_and_logprobs(path):
    model = _model()
    dense, _ = _continuous(_engine(model), _mixed())  # the dense cache, its eager path
    paged = _engine(model, kv_tokens=4 * 64, kv_page_tokens=8, **PATHS[path])
    out, _ = _continuous(paged, _mixed())
    _same(out, dense)
    assert paged.cache.free_pages == paged.cache.n_pages  # every page came back


@pytest.mark.parametrize("path", list(PATHS))
def test_a_pool_smaller_than_dense_runs_more_sequences_and_finishes_every_request(path):
    """128 tokens of cache: a dense cache of those bytes holds 2 sequences of max_len 64; the paged one runs
    as many as their tokens fit, preempting when they outgrow it, and every request ends as the dense
    engine ends it."""
    model = _model()
    reqs = lambda: [_req(f"r{i}", [3 + i, 7, 11, 5], 6 + i % 5) for i in range(12)]  # noqa: E731
    want = _run(_engine(model, max_batch=12), reqs())
    engine = _engine(model, max_batch=8, kv_tokens=128, kv_page_tokens=8, **PATHS[path])
    assert engine.cache.nbytes <= KVCache(model.cfg, 2, 64, "cpu", torch.float32).nbytes * 17 / 16  # + the null page
    out, peak = _continuous(engine, reqs())
    _same(out, want)
    assert peak >= 6, peak


@pytest.mark.parametrize("path", list(PATHS))
def test_pages_reused_under_pressure_never_mix_sequences(path):
    """Pages of 4 tokens, a pool of a quarter of the dense size, 16 requests of mixed lengths through 6
    slots: pages pass from sequence to sequence many times (preemptions, right-padded prefills beside
    longer prompts) and every output is still the dense engine's."""
    model = _model()
    reqs = _mixed(16)
    dense, _ = _continuous(_engine(model, max_batch=6), reqs)
    engine = _engine(model, max_batch=6, kv_tokens=96, kv_page_tokens=4, **PATHS[path])
    out, _ = _continuous(engine, reqs)
    _same(out, dense, tol=1e-4)
    assert engine.preemptions >= 3


def test_a_request_that_cannot_get_pages_waits_and_finishes_later():
    """One max_len of pool: a long prompt arriving while another sequence holds half of it waits, counted
    as held (running_ids, one slot fewer), not refused, and runs once the first ends."""
    model = _model()
    first, second = _req("first", list(range(3, 33)), 20), _req("second", list(range(50, 90)), 10)
    want = {k: _run(_engine(model), [r])[k] for k, r in (("first", first), ("second", second))}
    engine = _engine(model, kv_tokens=64, kv_page_tokens=8)
    engine.add_request(first)
    engine.step()
    engine.add_request(second)
    out = {c.request_id: c for c in engine.step()}
    assert engine.in_cache == 1 and "second" in engine.running_ids and engine.free_slots == 2
    # the rollout node's telemetry says so: one decoding, one admitted but waiting for memory
    from nodes.rollout.core import running_batch

    assert running_batch(engine) == 1 and len(engine.running_ids) - running_batch(engine) == 1
    order = []
    while len(out) < 2:
        done = engine.step()
        order += [c.request_id for c in done]
        out |= {c.request_id: c for c in done}
    assert order == ["first", "second"] and engine.preemptions == 0
    _same(out, want)


@pytest.mark.parametrize("path", list(PATHS))
def test_a_sequence_out_of_pages_preempts_the_youngest_which_resumes_exactly(path):
    """Two sequences that each fit but not together: the older one's next page preempts the younger, which
    waits with its tokens (still visible to streaming), is prefilled again and ends as it would alone."""
    model = _model()
    a, b = _req("a", PROMPTS["c"] + [9] * 11, 30), _req("b", PROMPTS["a"] + [8] * 15, 30, temperature=1.0)
    b.seed = 7  # its own generator: the same draws whoever it runs beside
    want = _run(_engine(model), [a, b])
    engine = _engine(model, kv_tokens=64, kv_page_tokens=8, **PATHS[path])
    engine.add_request(a)
    engine.add_request(b)
    out, seen_waiting = {}, []
    while len(out) < 2:
        out |= {c.request_id: c for c in engine.step()}
        if engine.preemptions and "b" not in out and engine.in_cache == 1:
            seen_waiting.append(len(engine.peek("b")))
    assert engine.preemptions >= 1 and seen_waiting and min(seen_waiting) > 0
    _same(out, want, tol=1e-4)


@pytest.mark.parametrize("recompute", [False, True])
def test_a_swap_mid_generation_tags_every_token_with_its_version(tmp_path, recompute):
    """Tokens sampled before the swap carry version 0, after it 1, preempted sequences included (they
    sample fewer tokens before it: they wait). With recompute_kv_on_swap every token's log-probability is
    its own version's full forward's, across preemptions and re-prefills on either side of the swap."""
    old, new = _model(seed=0), _model(seed=1)
    save_pretrained(new, tmp_path)
    reqs = [_req(k, p + [5] * 12, 30) for k, p in PROMPTS.items()]
    engine = _engine(_model(seed=0), recompute_kv_on_swap=recompute, kv_tokens=96, kv_page_tokens=8)
    for r in reqs:
        engine.add_request(r)
    out = {c.request_id: c for _ in range(6) for c in engine.step()}
    assert engine.preemptions >= 1 and not out
    before = {r.request_id: len(engine.peek(r.request_id)) for r in reqs}
    engine.swap_weights(1, str(tmp_path))
    while len(out) < len(reqs):
        out |= {c.request_id: c for c in engine.step()}
    for r in reqs:
        comp, k = out[r.request_id], before[r.request_id]
        assert comp.versions.tolist() == [0] * k + [1] * (30 - k), r.request_id
        if recompute:
            np.testing.assert_allclose(comp.logprobs[:k], _full_logprobs(old, r.prompt_ids, comp, 0.0)[:k], atol=1e-4)
            np.testing.assert_allclose(comp.logprobs[k:], _full_logprobs(new, r.prompt_ids, comp, 0.0)[k:], atol=1e-4)
    assert len(set(before.values())) > 1  # a preempted one had sampled fewer before the swap


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-step"])
def test_lora_adapters_are_served_over_a_paged_cache_as_over_a_dense_one(static):
    targets = list(adapters.PROJECTIONS)
    ref = adapters.attach(_model(), targets, 4, 2.0)
    gen = torch.Generator().manual_seed(1)
    state = {k: torch.randn(shape, generator=gen) * 0.1 for k, shape in sorted(adapters.wire_shapes(ref).items())}

    def run(**kw):
        engine = _engine(adapters.attach(_model(), targets, 4, 2.0), static_decode=static,
                         weight_loader=lambda loc: state, **kw)
        engine.swap_weights(1, "v1")
        return _continuous(engine, _mixed(8, seed=1))[0]

    out = run(kv_tokens=96, kv_page_tokens=8)
    _same(out, run(), tol=1e-4)
    assert all((c.versions == 1).all() for c in out.values())


def test_the_pool_must_hold_one_max_len_sequence():
    with pytest.raises(ValueError, match="kv_tokens=40 .* needs 8"):
        PagedKVCache(_model().cfg, 4, 64, 40, 8, "cpu", torch.float32)
    pydantic = pytest.importorskip("pydantic")  # the config (absent on a GPU host without the wheels)
    from areal_bus.config.engines import TorchRolloutEngineConfig

    with pytest.raises(pydantic.ValidationError, match="kv_tokens"):
        TorchRolloutEngineConfig(max_len=128, kv_tokens=100)
    assert TorchRolloutEngineConfig().kv_tokens is None  # the default: today's dense cache


def test_attention_kinds_follow_the_cache():
    assert decode_choices("auto", None, True, True, paged=True) == [("flash_paged", True), ("sdpa", True),
                                                                    ("flash_paged", False), ("sdpa", False)]
    assert decode_choices("auto", False, True, True)[0] == ("flash_varlen", False)
    with pytest.raises(ValueError, match="kv_tokens"):
        _engine(_model(), kv_tokens=64, kv_page_tokens=8, static_decode=True, attention="flash_varlen")
    with pytest.raises(ValueError, match="kv_tokens"):
        _engine(_model(), static_decode=True, attention="flash_paged")


# -- GPU ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_cuda_graphs_over_pages_match_the_dense_graphs_in_float32():
    model = _model().cuda()
    reqs = _mixed(12)
    dense, _ = _continuous(_engine(model, device="cuda", max_batch=6), reqs)
    engine = _engine(model, device="cuda", max_batch=6, kv_tokens=128, kv_page_tokens=16)
    assert engine.fast is not None and engine.fast.graphs and engine.fast.attention == "sdpa"  # float32: no flash
    out, peak = _continuous(engine, reqs)
    _same(out, dense, tol=1e-3)
    assert engine.preemptions >= 1 and peak > 128 // 64


@pytest.mark.gpu
@needs_cuda
def test_the_default_paged_decode_in_bfloat16_is_flash_paged_and_as_close_to_a_full_forward_as_the_dense_one():
    """At the 0.5B attention shape in bfloat16 with pages of 256: 'auto' picks FlashAttention's paged kernel
    (fused, graphs) where this torch or the flash-attn package has one, else the gathered sdpa step (the GPU
    host's torch 2.11 has neither: it ran that fallback on 2026-12-06); with a pool of 3 max_len sequences
    for 16 slots it preempts, and its log-probabilities are as close to a full forward's as the dense
    default's (flash_varlen) are."""
    model = make_random_model(QWEN_HEADS, seed=0, device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 2048, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 300, (16,), generator=gen)]
    reqs = [_req(f"r{i}", p, 300, temperature=1.0) for i, p in enumerate(prompts)]
    kw = {"max_batch": 16, "max_len": 768, "dtype": torch.bfloat16, "device": "cuda"}

    def worst(**more):
        engine = _engine(model, **kw, **more)
        out, peak = _continuous(engine, reqs)
        return engine, peak, max(float(np.abs(out[r.request_id].logprobs - _full_logprobs(
            model, r.prompt_ids, out[r.request_id], 1.0)).max()) for r in reqs)

    dense, _, dense_worst = worst()
    paged, peak, paged_worst = worst(kv_tokens=3 * 768)
    want = "flash_paged" if paged_kernel() else "sdpa"
    assert dense.fast.attention == "flash_varlen" and paged.fast.attention == want and paged.fast.graphs
    assert paged.preemptions >= 1 and peak > 3
    assert paged_worst <= max(0.05, 2 * dense_worst), (paged_worst, dense_worst)


def test_the_topology_knob_gives_the_worker_a_paged_cache(tmp_path):
    pytest.importorskip("pydantic")  # the config (absent on a GPU host without the wheels)
    from areal_bus.config.topology import parse_topology  # lazy: pydantic, as above
    from areal_bus.engines.rollout_factory import make_engine

    save_pretrained(_model(), tmp_path / "model")
    topo = parse_topology({
        "global_batch_size": 8, "trigger_batch_size": 4, "mini_batch_size": 4, "learning_rate": 1e-2,
        "model": {"path": str(tmp_path / "model")}, "agent": {"framework": "guess"},
        "rollout_engine": {"kind": "torch", "max_batch": 6, "max_len": 64, "kv_tokens": 96, "kv_page_tokens": 8},
        "trainer_engine": {"kind": "torch"}, "endpoints": {"ipc_dir": str(tmp_path / "ipc")}})
    engine = make_engine(topo, "rollout-0", 0).engine
    assert isinstance(engine.cache, PagedKVCache) and engine.cache.n_pages == 12
    _same(_continuous(engine, _mixed(8))[0], _continuous(_engine(_model(), max_batch=6), _mixed(8))[0])
