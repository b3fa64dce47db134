"""TorchRolloutEngine: generation equals a naive full-forward loop, logprobs and versions are exact.

Its helpers (``_model``, ``_req``, ``_run``, ``_naive_greedy``, ``_full_logprobs``) work on any device;
tests/test_cuda_decode.py uses them too."""

import numpy as np
import pytest
import torch

from areal_bus.engines.torch_engine import TorchRolloutEngine
from areal_bus.wire.messages import GenerateRequest
from areal_bus.model.modeling import (TINY_LLAMA, TINY_LLAMA31, TINY_MISTRAL, TINY_QWEN2, TINY_QWEN3, KVCache,
                                make_random_model, save_pretrained, token_logprobs)
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

PROMPTS = {"a": [1, 5, 9, 14, 3], "b": [7, 2], "c": [11, 4, 4, 8, 20, 33, 6, 17, 5], "d": [42]}


def _model(cfg=TINY_QWEN2, seed=0):
    return make_random_model(cfg, seed=seed, std=0.2)


def _req(rid, prompt, max_tokens=12, temperature=0.0, top_p=1.0, stop=()):
    return GenerateRequest(request_id=rid, episode_id="ep-" + rid, ticket=0, min_version=0, max_tokens=max_tokens,
                           temperature=temperature, prompt_ids=np.asarray(prompt, dtype=np.int32), top_p=top_p,
                           stop=list(stop))


def _engine(model, **kw):
    kw = {"max_batch": 4, "max_len": 64, "eos_token_ids": [], "worker": "w0"} | kw
    return TorchRolloutEngine(model, **kw)


def _run(engine, reqs, max_steps=300):
    """Add ``reqs`` and step until all finish; {request_id: Completion}."""
    for r in reqs:
        engine.add_request(r)
    out = {}
    for _ in range(max_steps):
        for t in engine.step():
            out[t.request_id] = t
        if len(out) == len(reqs):
            return out
    raise AssertionError("did not finish")


def _naive_greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids], device=model.lm_head.weight.device))[0, -1].argmax()))
    return ids[len(prompt):]


def _full_ids(prompt, comp):
    return torch.from_numpy(np.concatenate([np.asarray(prompt), comp.output_ids])).long()[None]


def _full_logprobs(model, prompt, comp, temperature):
    """What the trainer recomputes: token_logprobs of prompt + output, at the output tokens."""
    with torch.no_grad():
        lp = token_logprobs(model, _full_ids(prompt, comp).to(model.lm_head.weight.device), temperature=temperature)
    return lp[0, len(prompt):].float().cpu().numpy()


@pytest.mark.parametrize("cfg", [TINY_QWEN2, TINY_LLAMA, TINY_QWEN3, TINY_LLAMA31, TINY_MISTRAL],
                         ids=["qwen2", "llama", "qwen3", "llama3.1-rope", "mistral"])
def test_greedy_batch_equals_naive_full_forward_loop(cfg):
    model = _model(cfg)
    out = _run(_engine(model), [_req(k, p) for k, p in PROMPTS.items()])
    for k, p in PROMPTS.items():
        assert out[k].output_ids.tolist() == _naive_greedy(model, p, 12)
        assert out[k].finish_reason == "length"


def test_prefill_batching_budget_does_not_change_outputs():
    model = _model()
    reqs = lambda: [_req(k, p) for k, p in PROMPTS.items()]  # noqa: E731
    one_by_one = _run(_engine(model, max_prefill_tokens=1), reqs())
    batched = _run(_engine(model, max_prefill_tokens=8192), reqs())
    for k in PROMPTS:
        assert one_by_one[k].output_ids.tolist() == batched[k].output_ids.tolist()
        np.testing.assert_allclose(one_by_one[k].logprobs, batched[k].logprobs, atol=1e-5)


def test_logprobs_equal_full_forward_log_softmax_at_sampled_tokens():
    model = _model()
    reqs = [_req("a", PROMPTS["a"], 16, temperature=0.7, top_p=0.9), _req("b", PROMPTS["b"], 16, temperature=1.3),
            _req("c", PROMPTS["c"], 16, temperature=0.0)]
    out = _run(_engine(model), reqs)
    for r in reqs:
        comp = out[r.request_id]
        assert comp.logprobs.dtype == np.float32 and comp.logprobs.shape == comp.output_ids.shape
        np.testing.assert_allclose(comp.logprobs, _full_logprobs(model, r.prompt_ids, comp, r.temperature), atol=1e-4)


def test_fixed_seed_reproduces_sampling():
    model = _model()

    def sample(seed):
        reqs = [_req(k, p, 20, temperature=1.0, top_p=0.95) for k, p in PROMPTS.items()]
        return {k: t.output_ids.tolist() for k, t in _run(_engine(model, seed=seed), reqs).items()}

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_top_p_keeps_only_the_nucleus():
    model = _model()
    # A tiny nucleus is always just the most likely token: sampling becomes greedy.
    out = _run(_engine(model, seed=3), [_req("a", PROMPTS["a"], 10, temperature=1.0, top_p=1e-6)])
    assert out["a"].output_ids.tolist() == _naive_greedy(model, PROMPTS["a"], 10)


def test_request_joining_mid_run_matches_running_alone():
    model = _model()
    alone = {k: _run(_engine(model), [_req(k, PROMPTS[k], 15)])[k].output_ids.tolist() for k in ("a", "c")}
    engine = _engine(model, max_batch=2)
    engine.add_request(_req("a", PROMPTS["a"], 15))
    for _ in range(5):
        assert engine.step() == []
    assert engine.free_slots == 1
    engine.add_request(_req("c", PROMPTS["c"], 15))
    assert engine.free_slots == 0 and sorted(engine.running_ids) == ["a", "c"]
    out = {}
    while len(out) < 2:
        out |= {t.request_id: t.output_ids.tolist() for t in engine.step()}
    assert out == alone
    assert engine.free_slots == 2 and engine.running_ids == []


def test_freed_slot_is_reused_by_a_later_request():
    model = _model()
    engine = _engine(model, max_batch=1)
    first = _run(engine, [_req("a", PROMPTS["c"], 6)])["a"]
    second = _run(engine, [_req("b", PROMPTS["b"], 6)])["b"]  # same slot, stale cache past its length
    assert first.output_ids.tolist() == _naive_greedy(model, PROMPTS["c"], 6)
    assert second.output_ids.tolist() == _naive_greedy(model, PROMPTS["b"], 6)


def test_adding_beyond_max_batch_is_refused():
    engine = _engine(_model(), max_batch=1)
    engine.add_request(_req("a", PROMPTS["a"]))
    with pytest.raises(RuntimeError, match="no free slot"):
        engine.add_request(_req("b", PROMPTS["b"]))


def test_stop_token_ends_the_sequence_and_is_kept():
    model = _model()
    greedy = _naive_greedy(model, PROMPTS["a"], 12)
    stop = greedy[4]
    cut = greedy.index(stop) + 1
    out = _run(_engine(model), [_req("a", PROMPTS["a"], 12, stop=[stop, "a string stop is the gateway's"])])["a"]
    assert out.output_ids.tolist() == greedy[:cut] and out.finish_reason == "stop"
    eos = _run(_engine(model, eos_token_ids=[stop]), [_req("a", PROMPTS["a"], 12)])["a"]
    assert eos.output_ids.tolist() == greedy[:cut] and eos.finish_reason == "stop"


def test_max_tokens_and_max_len_bound_the_output():
    model = _model()
    out = _run(_engine(model), [_req("a", PROMPTS["a"], 3)])["a"]
    assert out.output_ids.size == 3 and out.finish_reason == "length"
    short = _run(_engine(model, max_len=8), [_req("a", PROMPTS["a"], 50)])["a"]  # 5 prompt tokens
    assert short.output_ids.size == 3 and short.finish_reason == "length"


def _swap_run(tmp_path, recompute_kv_on_swap, k=4, n=10):
    old, new = _model(seed=0), _model(seed=1)
    save_pretrained(new, tmp_path)
    engine = _engine(_model(seed=0), recompute_kv_on_swap=recompute_kv_on_swap)
    engine.add_request(_req("a", PROMPTS["c"], n, temperature=0.8))
    for _ in range(k):
        assert engine.step() == []
    assert engine.swap_weights(1, str(tmp_path)) >= 0 and engine.version == 1
    out = {}
    while not out:
        out = {t.request_id: t for t in engine.step()}
    return old, new, out["a"]


def test_weight_swap_mid_generation_switches_versions_and_keeps_the_cache(tmp_path):
    k, n = 4, 10
    old, new, comp = _swap_run(tmp_path, recompute_kv_on_swap=False, k=k, n=n)
    prompt = PROMPTS["c"]
    assert comp.versions.tolist() == [0] * k + [1] * (n - k)
    np.testing.assert_allclose(comp.logprobs[:k], _full_logprobs(old, prompt, comp, 0.8)[:k], atol=1e-4)
    # After the swap the new weights read keys/values the old ones cached: positions before the
    # swap's first fed token come from ``old``, the rest from ``new``.
    ids = _full_ids(prompt, comp)
    split = len(prompt) + k - 1  # the last pre-swap token is fed (cached) after the swap
    cache = KVCache(old.cfg, 1, 64, "cpu", torch.float32)
    slot = torch.tensor([0])
    with torch.no_grad():
        old.hidden_states(ids[:, :split], torch.arange(split)[None], cache=cache, slots=slot)
        h = new.hidden_states(ids[:, split:-1], torch.arange(split, ids.shape[1] - 1)[None], cache=cache, slots=slot)
        want = torch.log_softmax(new.lm_head(h)[0] / 0.8, -1).gather(-1, ids[0, split + 1:, None]).squeeze(-1)
    np.testing.assert_allclose(comp.logprobs[k:], want.numpy(), atol=1e-4)
    assert not np.allclose(comp.logprobs[k:], _full_logprobs(old, prompt, comp, 0.8)[k:], atol=1e-3)


def test_weight_swap_with_recompute_matches_the_new_weights_exactly(tmp_path):
    k, n = 4, 10
    old, new, comp = _swap_run(tmp_path, recompute_kv_on_swap=True, k=k, n=n)
    prompt = PROMPTS["c"]
    assert comp.versions.tolist() == [0] * k + [1] * (n - k)
    np.testing.assert_allclose(comp.logprobs[:k], _full_logprobs(old, prompt, comp, 0.8)[:k], atol=1e-4)
    np.testing.assert_allclose(comp.logprobs[k:], _full_logprobs(new, prompt, comp, 0.8)[k:], atol=1e-4)


def test_engine_loads_a_checkpoint_path(tmp_path):
    model = _model(TINY_LLAMA)
    save_pretrained(model, tmp_path)
    out = _run(_engine(str(tmp_path)), [_req("a", PROMPTS["a"], 8)])["a"]
    assert out.output_ids.tolist() == _naive_greedy(model, PROMPTS["a"], 8)
    assert (out.worker, out.episode_id, out.ticket) == ("w0", "ep-a", 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_greedy_and_logprobs_match_cpu_reference():
    model = _model()
    engine = _engine(_model(), device="cuda")
    reqs = [_req(k, p, 12, temperature=0.0) for k, p in PROMPTS.items()]
    out = _run(engine, reqs)
    for k, p in PROMPTS.items():
        assert out[k].output_ids.tolist() == _naive_greedy(model, p, 12)
        np.testing.assert_allclose(out[k].logprobs, _full_logprobs(model, p, out[k], 0.0), atol=1e-3)
