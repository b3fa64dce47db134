"""The static-cache decode path (``engines/cuda_decode``): the same tokens as the gather path and a naive
full-forward loop, logprobs equal to a full forward pass, continuous batching exact. CPU tests run the
step eagerly; the gpu tests replay it as CUDA graphs.

Run:  .venv/bin/python -m pytest -q tests/test_cuda_decode.py
      python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_cuda_decode.py   (GPU host, no pyzmq)
"""

import numpy as np
import pytest
import torch

from areal_bus.engines.cuda_decode import ATTENTION, buckets, decode_choices
from areal_bus.engines.torch_engine import TorchRolloutEngine
from areal_bus.model.modeling import (TINY_LLAMA, TINY_LLAMA31, TINY_MISTRAL, TINY_QWEN2, TINY_QWEN3, make_random_model,
                                save_pretrained)
from tests.test_torch_engine import PROMPTS, _full_logprobs, _model, _naive_greedy, _req, _run
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

# Small buckets, so short test sequences cross several lengths and pad the batch.
SMALL = ([2, 4], [8, 16, 32, 64])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _perturb_norms(model, seed: int) -> None:
    """Norm weights other than ones, so one in the wrong place (Qwen3's q norm on k, say) shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.5 * torch.randn(p.shape, generator=gen))


def _engine(model, static=True, **kw):
    kw = {"max_batch": 4, "max_len": 64, "eos_token_ids": [], "static_decode": static,
          "decode_buckets": SMALL if static else None} | kw
    return TorchRolloutEngine(model, **kw)


@pytest.mark.parametrize("cfg", [TINY_QWEN2, TINY_LLAMA, TINY_QWEN3, TINY_LLAMA31, TINY_MISTRAL],
                         ids=["qwen2", "llama", "qwen3", "llama3.1-rope", "mistral"])
def test_static_greedy_equals_gather_path_and_naive_loop(cfg):
    model = _model(cfg)
    _perturb_norms(model, seed=5)
    reqs = lambda: [_req(k, p, 30) for k, p in PROMPTS.items()]  # noqa: E731
    static, gather = _run(_engine(model), reqs()), _run(_engine(model, static=False), reqs())
    for k, p in PROMPTS.items():
        assert static[k].output_ids.tolist() == _naive_greedy(model, p, 30) == gather[k].output_ids.tolist()
        np.testing.assert_allclose(static[k].logprobs, gather[k].logprobs, atol=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "matmul", "flash_varlen"])
def test_static_logprobs_equal_full_forward_at_sampled_tokens(attention):
    model = _model()
    reqs = [_req("a", PROMPTS["a"], 24, temperature=0.7, top_p=0.9), _req("b", PROMPTS["b"], 24, temperature=1.3),
            _req("c", PROMPTS["c"], 24, temperature=0.0), _req("d", PROMPTS["d"], 24, temperature=1.0)]
    out = _run(_engine(model, attention=attention), reqs)
    for r in reqs:
        comp = out[r.request_id]
        assert comp.output_ids.size == 24
        np.testing.assert_allclose(comp.logprobs, _full_logprobs(model, r.prompt_ids, comp, r.temperature), atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_flash_varlen_reads_each_rows_own_keys_as_the_masked_attention_does(device):
    """The varlen call's arithmetic over the cache (sequences = (row, kv head), their grouped query heads
    as queries, seqused = position + 1) against the masked SDPA call: on CPU through varlen_reference, on
    CUDA through FlashAttention-2 (bfloat16, the 0.5B shape's head dimension). A row not decoding
    (position max_len - 1) reads one key, and nothing reads its output."""
    cuda = device == "cuda"
    d, dtype, tol = (64, torch.bfloat16, 2e-2) if cuda else (16, torch.float32, 1e-5)
    # the 0.5B shape's heads (14 over 2 kv heads)
    heads = TINY_QWEN2 | {"hidden_size": 14 * d, "num_attention_heads": 14, "num_key_value_heads": 2}
    dec = _engine(make_random_model(heads, seed=0, device=device, dtype=dtype), max_batch=6, max_len=40,
                  decode_buckets=([6], [32, 40]), device=device, dtype=dtype, static_decode=True).fast
    gen = torch.Generator().manual_seed(0)
    b, kv, group, max_len, bucket = 5, 2, 7, 40, 32
    q = torch.randn(b, kv, group, d, generator=gen).to(device, dtype)
    k, v = torch.randn(2, b, kv, max_len, d, generator=gen).to(device, dtype)
    pos = torch.tensor([3, 31, 0, max_len - 1, 17], device=device)
    prep_mask, sdpa = ATTENTION["sdpa"]
    prep_varlen, varlen = ATTENTION["flash_varlen"]
    cu_q, cu_k, used = prepared = prep_varlen(dec, pos, bucket)
    assert used.tolist() == [4, 4, 32, 32, 1, 1, 1, 1, 18, 18] and used.dtype == torch.int32
    assert cu_q.tolist() == list(range(0, 71, 7)) and cu_k.tolist() == list(range(0, 401, 40))
    want = sdpa(q, k, v, bucket, prep_mask(dec, pos, bucket))
    got = varlen(q, k, v, bucket, prepared)
    decoding = [0, 1, 2, 4]
    torch.testing.assert_close(got[decoding].float(), want[decoding].float(), atol=tol, rtol=tol)
    one = prep_varlen(dec, pos[:1], bucket)  # one row: the kernel takes only contiguous key counts
    assert one[2].tolist() == [4, 4] and one[2].is_contiguous()
    torch.testing.assert_close(varlen(q[:1], k[:1], v[:1], bucket, one).float(), want[:1].float(), atol=tol, rtol=tol)
    # a key past a row's position changes nothing; one within it does
    k2 = k.clone()
    k2[0, :, 4:] += 100.0
    torch.testing.assert_close(varlen(q, k2, v, bucket, prepared)[0].float(), got[0].float(), atol=tol, rtol=tol)
    k2[0, :, 3] += 100.0
    assert not torch.allclose(varlen(q, k2, v, bucket, prepared)[0], got[0])


@pytest.mark.parametrize("cfg", [TINY_QWEN2, TINY_QWEN3], ids=["qwen2", "qwen3"])
def test_fused_decode_step_gives_the_unfused_steps_tokens_and_logprobs(cfg):
    """rollout_engine.decode_compile: the residual adds with their RMSNorms, the rotary embedding (with
    Qwen3's q/k norms) and SiLU x up as torch.compile's fused kernels compute what the modules do."""
    model = _model(cfg)
    _perturb_norms(model, seed=7)
    reqs = lambda: [_req(k, p, 20, temperature=0.9) for k, p in PROMPTS.items()]  # noqa: E731
    fused_engine = _engine(model, fuse_decode=True)
    fused, plain = _run(fused_engine, reqs()), _run(_engine(model), reqs())
    assert fused_engine.fast.fuse
    for k in PROMPTS:
        assert fused[k].output_ids.tolist() == plain[k].output_ids.tolist(), k
        np.testing.assert_allclose(fused[k].logprobs, plain[k].logprobs, atol=1e-5)


def test_fused_decode_refuses_a_model_whose_norms_it_does_not_compute():
    model = _model()
    model.model.norm = torch.nn.LayerNorm(model.cfg.hidden_size)
    with pytest.raises(ValueError, match="decode fusion computes areal_bus.model.modeling.RMSNorm"):
        _engine(model, fuse_decode=True)


def test_flash_varlen_that_reads_past_a_rows_position_is_refused_before_any_decode(monkeypatch):
    """The decoder checks flash_varlen against the masked attention when it is made: a kernel that
    ignored each row's key count (here: attends the whole bucket) refuses to start, naming the gap."""
    from areal_bus.engines import cuda_decode

    assert _engine(_model(), attention="flash_varlen", decode_buckets=None).fast is not None  # one bucket: 64
    prepare, _ = cuda_decode.ATTENTION["flash_varlen"]
    unmasked = lambda q, k, v, length, prepared: cuda_decode._attend_sdpa(q, k, v, length, None)  # noqa: E731
    monkeypatch.setitem(cuda_decode.ATTENTION, "flash_varlen", (prepare, unmasked))
    with pytest.raises(RuntimeError, match="'flash_varlen' differs from the masked attention by"):
        _engine(_model(), attention="flash_varlen")


def test_decode_choices_try_what_was_asked_and_fall_back_only_from_automatic_ones():
    # rollout_engine's defaults (attention "auto", fusion None): on a GPU in half precision flash_varlen fused
    assert decode_choices("auto", None, True, True) == [("flash_varlen", True), ("sdpa", True),
                                                        ("flash_varlen", False), ("sdpa", False)]
    assert decode_choices("auto", None, True, False) == [("sdpa", True), ("sdpa", False)]  # float32 on a GPU
    assert decode_choices("auto", None, False, True) == [("sdpa", False)]  # CPU: nothing to fall back from
    assert decode_choices("flash_varlen", None, True, True) == [("flash_varlen", True), ("flash_varlen", False)]
    assert decode_choices("auto", True, True, True) == [("flash_varlen", True), ("sdpa", True)]
    assert decode_choices("sdpa", False, True, True) == [("sdpa", False)]  # explicit: refused means raised


def test_an_automatic_decode_choice_that_refuses_here_falls_back_with_a_warning(monkeypatch):
    """What "auto" tries on a GPU (decode_choices' list for CUDA in half precision), met on CPU by a torch
    build whose varlen kernel ignores each row's key count and a model with norms the fusion does not
    compute: each refusal is named through ``warn`` and the next choice tried, down to sdpa unfused, which
    decodes as the gather path does."""
    from areal_bus.engines import cuda_decode

    monkeypatch.setattr(cuda_decode, "decode_choices", lambda *_: [("flash_varlen", True), ("sdpa", True),
                                                                   ("flash_varlen", False), ("sdpa", False)])
    prepare, _ = cuda_decode.ATTENTION["flash_varlen"]
    unmasked = lambda q, k, v, length, prepared: cuda_decode._attend_sdpa(q, k, v, length, None)  # noqa: E731
    monkeypatch.setitem(cuda_decode.ATTENTION, "flash_varlen", (prepare, unmasked))
    model = _model()
    model.model.norm = torch.nn.LayerNorm(model.cfg.hidden_size)
    warned = []
    engine = _engine(model, warn=warned.append)
    assert (engine.fast.attention, engine.fast.fuse) == ("sdpa", False)
    assert [w.split(" refused")[0] for w in warned] == ["decode step flash_varlen+compile", "decode step sdpa+compile",
                                                        "decode step flash_varlen"]
    assert "other norms" in warned[0] and "differs from the masked attention" in warned[2]
    assert _run(engine, [_req("a", PROMPTS["a"], 8)])["a"].output_ids.tolist() == \
        _run(_engine(model, static=False), [_req("a", PROMPTS["a"], 8)])["a"].output_ids.tolist()
    monkeypatch.undo()
    warned.clear()
    assert (_engine(_model(), warn=warned.append).fast.attention, warned) == ("sdpa", [])  # CPU's own choice


@pytest.mark.gpu
@needs_cuda
def test_the_default_decode_on_a_gpu_in_half_precision_is_flash_varlen_fused():
    engine = TorchRolloutEngine(make_random_model(QWEN_HEADS, seed=0, device="cuda", dtype=torch.bfloat16),
                                max_batch=8, max_len=512, dtype=torch.bfloat16, device="cuda", eos_token_ids=[])
    assert (engine.fast.attention, engine.fast.fuse, engine.fast.graphs) == ("flash_varlen", True, True)
    # its logprobs: test_cuda_graph_bf16_logprobs_match_full_forward_as_closely_as_the_gather_path[auto-None]


def test_decode_attention_is_checked_when_the_decoder_is_made():
    with pytest.raises(ValueError, match="attention 'flash'"):
        _engine(_model(), attention="flash")
    with pytest.raises(ValueError, match="below 2"):
        _engine(_model(), attention="flash_varlen", max_batch=4096, max_len=1_000_000, static_decode=True,
                decode_buckets=([4096], [1_000_000]), device="meta")


@pytest.mark.parametrize("attention", ["sdpa", "flash_varlen"])
def test_requests_joining_and_leaving_mid_decode_match_running_alone(attention):
    model = _model()
    plan = {"a": (PROMPTS["c"], 20), "b": (PROMPTS["b"], 3), "c": (PROMPTS["a"], 25), "d": (PROMPTS["d"], 10),
            "e": (PROMPTS["b"], 6)}
    kw = {"attention": attention, "decode_buckets": ([1, 2, 4], SMALL[1])}  # alone: a batch of one row
    alone = {k: _run(_engine(model, **kw), [_req(k, p, n)])[k] for k, (p, n) in plan.items()}
    engine = _engine(model, **kw)
    out = {}

    def step():
        out.update({c.request_id: c for c in engine.step()})

    for k in "abc":
        engine.add_request(_req(k, *plan[k]))
    while "b" not in out:  # b leaves a hole in the middle of the running slots
        step()
    assert engine.free_slots == 2 and sorted(engine.running_ids) == ["a", "c"]
    engine.add_request(_req("d", *plan["d"]))  # a one-token prompt: fed as a decode row at once
    step()
    step()
    engine.add_request(_req("e", *plan["e"]))
    while len(out) < len(plan):
        step()
    for k, (p, n) in plan.items():
        assert out[k].output_ids.tolist() == alone[k].output_ids.tolist() == _naive_greedy(model, p, n), k
        np.testing.assert_allclose(out[k].logprobs, alone[k].logprobs, atol=1e-5)
    assert engine.free_slots == 4 and engine.running_ids == []


def test_sequence_filling_max_len_is_exact_beside_others():
    # Rows that are not decoding write at position max_len - 1: the sequence that fills the cache must
    # never read what they wrote there.
    model = _model()
    engine = _engine(model, max_len=16, decode_buckets=([4], [8, 16]))
    out = _run(engine, [_req("a", PROMPTS["a"], 50), _req("b", PROMPTS["b"], 4), _req("c", PROMPTS["d"], 50)])
    assert out["a"].output_ids.tolist() == _naive_greedy(model, PROMPTS["a"], 11)
    assert out["c"].output_ids.tolist() == _naive_greedy(model, PROMPTS["d"], 15)
    assert out["a"].finish_reason == out["c"].finish_reason == "length"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_weight_swap_reaches_the_static_decode_step(tmp_path, device):
    # The fused q/k/v and gate/up weights are copies: a swap that forgot them would decode with the
    # old weights. With recompute_kv_on_swap every token after the swap is the new weights' alone.
    old, new = _model(seed=0), _model(seed=1)
    save_pretrained(new, tmp_path)
    engine = _engine(_model(seed=0), recompute_kv_on_swap=True, device=device)
    engine.add_request(_req("a", PROMPTS["c"], 12, temperature=0.8))
    for _ in range(4):
        assert engine.step() == []
    engine.swap_weights(1, str(tmp_path))
    out = {}
    while not out:
        out = {c.request_id: c for c in engine.step()}
    comp = out["a"]
    assert comp.versions.tolist() == [0] * 4 + [1] * 8
    np.testing.assert_allclose(comp.logprobs[:4], _full_logprobs(old, PROMPTS["c"], comp, 0.8)[:4], atol=1e-4)
    np.testing.assert_allclose(comp.logprobs[4:], _full_logprobs(new, PROMPTS["c"], comp, 0.8)[4:], atol=1e-4)


def test_buckets_pad_by_at_most_a_quarter_and_end_at_the_limit():
    sizes = buckets(256, 1, 4)
    assert sizes[-1] == 256
    padded = {n: min(b for b in sizes if b >= n) for n in range(1, 257)}
    assert all(padded[n] - n <= n // 4 for n in padded)
    assert buckets(1000, 256, 2) == [256, 384, 512, 768, 1000]


# -- CUDA graphs -----------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_decode_matches_cpu_reference():
    model = _model()
    engine = _engine(_model(), device="cuda", max_batch=5, decode_buckets=([2, 4, 5], SMALL[1]))
    assert engine.fast is not None and engine.fast.graphs  # the default on CUDA
    reqs = [_req(k, p, 30) for k, p in PROMPTS.items()] + [_req("e", PROMPTS["a"], 30, temperature=1.0)]
    out = _run(engine, reqs)
    for k, p in PROMPTS.items():
        assert out[k].output_ids.tolist() == _naive_greedy(model, p, 30)
    for r in reqs:
        np.testing.assert_allclose(out[r.request_id].logprobs,
                                   _full_logprobs(model, r.prompt_ids, out[r.request_id], r.temperature), atol=1e-3)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_continuous_batching_matches_running_alone():
    model = _model().cuda()
    plan = {"a": (PROMPTS["c"], 20), "b": (PROMPTS["b"], 3), "c": (PROMPTS["a"], 25), "d": (PROMPTS["d"], 10)}
    alone = {k: _run(_engine(model, device="cuda"), [_req(k, p, n)])[k] for k, (p, n) in plan.items()}
    engine = _engine(model, device="cuda")
    out = {}
    for k in "abc":
        engine.add_request(_req(k, *plan[k]))
    while "b" not in out:
        out |= {c.request_id: c for c in engine.step()}
    engine.add_request(_req("d", *plan["d"]))
    while len(out) < len(plan):
        out |= {c.request_id: c for c in engine.step()}
    assert len(engine.fast.captured) >= 2  # several (batch, length) buckets were replayed
    for k in plan:
        assert out[k].output_ids.tolist() == alone[k].output_ids.tolist(), k
        np.testing.assert_allclose(out[k].logprobs, alone[k].logprobs, atol=1e-4)


# Qwen2-0.5B's attention shapes (14 heads of 64 over 2 kv heads), two layers, a small vocabulary.
QWEN_HEADS = TINY_QWEN2 | {"vocab_size": 2048, "hidden_size": 896, "intermediate_size": 1024,
                           "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 1024}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("attention, fuse", [("sdpa", False), ("matmul", False), ("flash_varlen", False),
                                             ("sdpa", True), ("flash_varlen", True), ("auto", None)])
def test_cuda_graph_bf16_logprobs_match_full_forward_as_closely_as_the_gather_path(attention, fuse):
    model = make_random_model(QWEN_HEADS, seed=0, device="cuda", dtype=torch.bfloat16)
    graphs, gather = graphs_and_gather_error(model, attention, fuse)
    assert graphs <= max(0.05, 2 * gather), (graphs, gather)


def graphs_and_gather_error(model, attention, fuse) -> tuple[float, float]:
    """The worst |logprob - a full forward's| over 12 long-tailed bf16 requests at temperature 1, decoded by the
    CUDA-graph step and by the eager gather path (also used by tests/test_lora_decode.py)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 2048, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 300, (12,), generator=gen)]
    reqs = [_req(f"r{i}", p, 300, temperature=1.0) for i, p in enumerate(prompts)]

    def worst(static):
        engine = TorchRolloutEngine(model, max_batch=16, max_len=640, dtype=torch.bfloat16, device="cuda",
                                    eos_token_ids=[], attention=attention, static_decode=static,
                                    fuse_decode=fuse and static)
        out = _run(engine, reqs)
        return max(float(np.abs(out[r.request_id].logprobs
                                - _full_logprobs(model, r.prompt_ids, out[r.request_id], 1.0)).max()) for r in reqs)

    return worst(True), worst(False)


def test_few_newcomers_wait_for_a_shared_prefill_and_still_match_running_alone():
    """A turn arriving beside a busy batch is prefilled with others, at most prefill_every decode
    steps later, and its output is what it would be alone."""
    model = _model()
    engine = _engine(model, max_batch=8, prefill_every=4, decode_buckets=([4, 8], SMALL[1]))
    busy = {k: _req(k, PROMPTS["c"], 30) for k in "abcdef"}
    for r in busy.values():
        engine.add_request(r)
    engine.step()  # the six prefill together
    late = _req("late", PROMPTS["a"], 5)
    engine.add_request(late)
    waited = 0
    out = {}
    while True:
        out.update({c.request_id: c for c in engine.step()})
        seq = engine._running["late"]
        if seq.cached:
            break
        waited += 1
    assert waited == 3  # one newcomer beside six decoding rows: three steps of waiting, fed on the fourth
    while len(out) < 7:
        out.update({c.request_id: c for c in engine.step()})
    alone = _run(_engine(model), [_req("late", PROMPTS["a"], 5)])["late"]
    assert out["late"].output_ids.tolist() == alone.output_ids.tolist()
    np.testing.assert_allclose(out["late"].logprobs, alone.logprobs, atol=1e-5)
    # A newcomer that is a quarter of the batch or more goes at once.
    engine2 = _engine(model, max_batch=8, prefill_every=4, decode_buckets=([4, 8], SMALL[1]))
    for k in "abcd":
        engine2.add_request(_req(k, PROMPTS["c"], 30))
    engine2.step()
    engine2.add_request(_req("x", PROMPTS["a"], 5))
    engine2.step()
    assert engine2._running["x"].cached > 0
