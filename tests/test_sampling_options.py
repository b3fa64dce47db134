"""The torch engine's per-request sampling options: top_logprobs (the sampled-from distribution's top k per
token, in the Completion and while streaming), seed (a generator per request) and top_k; rows that use none
of them record bit for bit what they recorded before; the simulated engine models them too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from areal_bus.config.topology import load_topology
from areal_bus.engines.base import TokenStreams, partial_completion
from areal_bus.engines.sim import SimRolloutEngine
from areal_bus.engines.torch_engine import TorchRolloutEngine
from areal_bus.model.modeling import TINY_QWEN2, make_random_model
from areal_bus.wire.messages import GenerateRequest
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = {"a": [1, 5, 9, 14, 3], "b": [7, 2], "c": [11, 4, 4, 8, 20, 33, 6, 17, 5]}
MODEL = make_random_model(TINY_QWEN2, seed=0, std=0.2)


def _req(rid, prompt=None, max_tokens=12, temperature=1.0, **kw):
    return GenerateRequest(request_id=rid, episode_id="ep-" + rid, ticket=0, min_version=0, max_tokens=max_tokens,
                           temperature=temperature, prompt_ids=np.asarray(prompt or PROMPTS[rid[0]], np.int32), **kw)


def _engine(seed=0, **kw):
    return TorchRolloutEngine(MODEL, **({"max_batch": 4, "max_len": 64, "eos_token_ids": [], "seed": seed} | kw))


def _run(engine, reqs):
    for r in reqs:
        engine.add_request(r)
    out = {}
    while len(out) < len(reqs):
        out |= {c.request_id: c for c in engine.step()}
    return out


def _full_log_softmax(prompt, comp, temperature=1.0) -> torch.Tensor:
    """[n, V]: the tempered log-softmax the model gives each output position."""
    ids = torch.tensor([list(prompt) + comp.output_ids.tolist()])
    with torch.no_grad():
        logits = MODEL(ids)[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1)


# -- top_logprobs ----------------------------------------------------------------------------------------


def test_top_logprobs_are_k_wide_sorted_and_agree_with_the_sampled_tokens_logprob():
    out = _run(_engine(), [_req("a", top_logprobs=5, temperature=0.8), _req("b", top_logprobs=2),
                           _req("c", temperature=0.0, top_logprobs=20)])
    for rid, k in (("a", 5), ("b", 2), ("c", 20)):
        comp = out[rid]
        n = comp.output_ids.size
        assert comp.top_ids.shape == comp.top_logprobs.shape == (n, k)
        assert comp.top_ids.dtype == np.int32 and comp.top_logprobs.dtype == np.float32
        assert (np.diff(comp.top_logprobs, axis=1) <= 0).all()  # most likely first
        assert all(len(set(row)) == k for row in comp.top_ids.tolist())
        for tok, lp, ids, lps in zip(comp.output_ids, comp.logprobs, comp.top_ids, comp.top_logprobs):
            assert lp <= lps[0]
            if tok in ids:  # the same number, not merely close
                assert lps[list(ids).index(tok)] == lp
    # greedy: the token is the top one
    assert (out["c"].top_ids[:, 0] == out["c"].output_ids).all()


def test_top_logprobs_are_the_top_of_the_distribution_sampled_from():
    comp = _run(_engine(), [_req("a", top_logprobs=4, temperature=0.7)])["a"]
    values, ids = _full_log_softmax(PROMPTS["a"], comp, 0.7).topk(4, -1)
    np.testing.assert_allclose(comp.top_logprobs, values.numpy(), atol=1e-4)
    assert comp.top_ids.tolist() == ids.tolist()


def test_a_request_without_top_logprobs_gets_empty_top_arrays():
    comp = _run(_engine(), [_req("a")])["a"]
    assert comp.top_ids.shape == comp.top_logprobs.shape == (0, 0)


def test_streamed_tokens_carry_their_top_logprobs():
    engine = _engine()
    engine.add_request(_req("a", top_logprobs=3, max_tokens=6))
    streams = TokenStreams()
    streams.add("a")
    parts = []
    done = []
    while not done:
        done = engine.step()
        for rid, _, start, ids in streams.due(engine.peek):
            parts.append(partial_completion(engine, rid, start, ids))
            streams.mark(rid, start + ids.size)
    comp = done[0]
    assert parts and parts[0].start == 0
    for part in parts:
        rows = slice(part.start, part.start + part.output_ids.size)
        assert part.top_ids.tolist() == comp.top_ids[rows].tolist()
        assert part.top_logprobs.tobytes() == comp.top_logprobs[rows].tobytes()


# -- seed -------------------------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_tokens_whatever_the_engine_seed_and_different_seeds_differ():
    def sample(seed, engine_seed, companions):
        reqs = [_req("a", seed=seed, max_tokens=20)] + [_req(c, max_tokens=20) for c in companions]
        return _run(_engine(engine_seed), reqs)["a"].output_ids.tolist()

    first = sample(7, 0, ["b"])
    assert sample(7, 1, ["b"]) == first  # the engine's generator is not the request's
    assert sample(7, 2, ["b", "c"]) == first  # nor are other rows' draws
    assert sample(8, 0, ["b"]) != first


def test_unseeded_requests_follow_the_engines_seed():
    def sample(engine_seed):
        return _run(_engine(engine_seed), [_req("a", max_tokens=20)])["a"].output_ids.tolist()

    assert sample(3) == sample(3) != sample(4)


# -- top_k ------------------------------------------------------------------------------------------------


def test_top_k_one_is_greedy():
    greedy = _run(_engine(), [_req("a", temperature=0.0, max_tokens=15)])["a"]
    for seed in range(3):
        comp = _run(_engine(seed), [_req("a", temperature=1.3, top_k=1, max_tokens=15)])["a"]
        assert comp.output_ids.tolist() == greedy.output_ids.tolist()
        assert (comp.logprobs == 0).all()  # the one token left has all the mass


def test_top_k_samples_among_the_k_most_likely_and_records_their_renormalised_logprob():
    for seed in range(3):
        comp = _run(_engine(seed), [_req("a", top_k=3, max_tokens=20, top_logprobs=5)])["a"]
        full = _full_log_softmax(PROMPTS["a"], comp)
        top3 = full.topk(3, -1)
        tokens = torch.from_numpy(comp.output_ids).long()
        assert (top3.indices == tokens[:, None]).any(-1).all()
        renormalised = full.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(top3.values, -1)
        np.testing.assert_allclose(comp.logprobs, renormalised.numpy(), atol=1e-4)
        assert np.isneginf(comp.top_logprobs[:, 3:]).all()  # past k: outside the distribution sampled from


# -- rows without the options, and what is refused ---------------------------------------------------------


def test_rows_without_the_new_options_record_the_same_bits_beside_rows_with_them():
    def run(options):
        reqs = [_req("a", max_tokens=16), _req("b", max_tokens=16, temperature=0.7, top_p=0.9),
                _req("c", max_tokens=16, **options)]
        return _run(_engine(11), reqs)

    plain, optioned = run({}), run({"top_k": 4, "seed": 5, "top_logprobs": 3})
    for rid in ("a", "b"):
        assert plain[rid].output_ids.tolist() == optioned[rid].output_ids.tolist()
        assert plain[rid].logprobs.tobytes() == optioned[rid].logprobs.tobytes()
    assert plain["c"].output_ids.tolist() != optioned["c"].output_ids.tolist()


@pytest.mark.parametrize("field,value", [("top_logprobs", 21), ("top_logprobs", -1), ("seed", -2), ("seed", 2**63),
                                         ("top_k", -1)])
def test_options_out_of_range_are_refused_naming_the_field(field, value):
    engine = _engine()
    with pytest.raises(ValueError, match=f"{field}={value}"):
        engine.add_request(_req("a", **{field: value}))
    assert engine.running_ids == []


# -- the simulated engine -------------------------------------------------------------------------------


def test_the_simulated_engine_models_top_logprobs_and_follows_the_seed():
    topo = load_topology(ROOT / "topology" / "sim.yaml")
    cfg = topo.rollout_engine.model_copy(update={"decode_step_s": 0.0})

    def run(rid, **kw):
        engine = SimRolloutEngine(cfg, "rollout-0", vocab_size=100)
        return _run(engine, [_req(rid, max_tokens=8, **kw)])[rid]

    comp = run("a1", top_logprobs=4, seed=3)
    n = comp.output_ids.size
    assert comp.top_ids.shape == comp.top_logprobs.shape == (n, 4)
    assert (np.diff(comp.top_logprobs, axis=1) <= 0).all()
    assert (np.exp(comp.top_logprobs.astype(np.float64)).sum(1) <= 1 + 1e-6).all()
    for tok, lp, ids, lps in zip(comp.output_ids, comp.logprobs, comp.top_ids, comp.top_logprobs):
        assert lps[list(ids).index(tok)] == lp
    assert run("a2", seed=3).output_ids.tolist() == comp.output_ids.tolist()  # the seed, not the request id
    assert run("a3").top_ids.shape == (0, 0)
