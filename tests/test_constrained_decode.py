"""Grammar-constrained decoding in the torch engine (xgrammar): every output follows its JSON schema even at
temperature 1, rows without a grammar sample what they sample alone, the recorded log-probability is the
masked distribution's, and the trainer takes those records as its behaviour log-probabilities while its
own (proximal, current) stay the unconstrained model's.

On the shipped tiny model (models/tiny-guess: a character-level tokenizer) and SmolLM2's BPE one."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from areal_bus.config.topology import load_topology, parse_topology
from areal_bus.engines.grammar import tokenizer_info
from areal_bus.engines.sim import SimRolloutEngine
from areal_bus.engines.torch_engine import TorchRolloutEngine
from areal_bus.engines.torch_train import TorchTrainEngine, pad_batch
from areal_bus.episode import EpisodeRecord
from areal_bus.model.modeling import ModelConfig, load_pretrained, make_random_model, token_logprobs
from areal_bus.wire.messages import GenerateRequest
from nodes.rollout.core import ReplyTo, RolloutCore, StepLog
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "tiny-guess"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "color", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3}}}
# What the gateway sends: the schema as xgrammar EBNF (compact JSON, so a tiny model's outputs end).
GRAMMAR = str(xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False))
TOK = AutoTokenizer.from_pretrained(TINY)
PROMPT = TOK.encode("<|im_start|>user\nfill the form<|im_end|>\n<|im_start|>assistant\n")
EOS = TOK.eos_token_id


def _req(rid, grammar=GRAMMAR, max_tokens=120, temperature=1.0, seed=-1, prompt=PROMPT, **kw):
    return GenerateRequest(request_id=rid, episode_id="ep-" + rid, ticket=0, min_version=0, max_tokens=max_tokens,
                           temperature=temperature, prompt_ids=np.asarray(prompt, np.int32), grammar=grammar,
                           seed=seed, **kw)


def _run(engine, reqs, max_steps=1000):
    """Run ``reqs`` to the end, each joining when a slot is free; {request_id: Completion}."""
    waiting, out = list(reqs), {}
    for _ in range(max_steps):
        while waiting and engine.free_slots > 0:
            engine.add_request(waiting.pop(0))
        out |= {c.request_id: c for c in engine.step()}
        if len(out) == len(reqs):
            return out
    raise AssertionError("did not finish")


def _json_of(comp) -> dict:
    ids = comp.output_ids.tolist()
    assert comp.finish_reason == "stop" and ids[-1] == EOS, (comp.finish_reason, TOK.decode(ids))
    return json.loads(TOK.decode(ids[:-1]))


def _masked_logprobs(model, prompt, comp, grammar, tokenizer, temperature=1.0) -> np.ndarray:
    """What the engine should have recorded: a full forward of prompt + output, each output position's
    logits masked by a fresh matcher that has accepted the tokens before it, log-softmax at the token."""
    ids = torch.tensor([list(prompt) + comp.output_ids.tolist()], device=model.lm_head.weight.device)
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1:-1].float().cpu()
    vocab = logits.shape[-1]
    info = tokenizer_info(tokenizer, vocab, [tokenizer.eos_token_id])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    out = []
    for row, tok in zip(logits, comp.output_ids.tolist()):
        matcher.fill_next_token_bitmask(bitmask)
        row = row[None].clone()
        xgr.apply_token_bitmask_inplace(row, bitmask)
        out.append(float(torch.log_softmax(row / temperature, -1)[0, tok]))
        assert matcher.accept_token(tok)
    return np.asarray(out, np.float32)


def test_a_json_schema_grammar_makes_every_output_valid_json_for_the_schema_at_temperature_one():
    engine = TorchRolloutEngine(TINY, max_batch=16, max_len=256, seed=0)
    out = _run(engine, [_req(f"r{i}", seed=i) for i in range(32)])
    docs = [_json_of(c) for c in out.values()]
    for doc in docs:
        jsonschema.validate(doc, SCHEMA)
    assert len({json.dumps(d) for d in docs}) > 16  # sampled, not one forced answer
    assert engine.grammars.compiles == 1  # one text, compiled once for all 32 requests


def test_the_static_decode_step_masks_the_same_way():
    """The CUDA-graph step's path (static decode), run eagerly on CPU: the mask is applied to its logits."""
    out = _run(TorchRolloutEngine(TINY, max_batch=8, max_len=256, static_decode=True),
               [_req(f"r{i}", seed=i) for i in range(8)])
    for comp in out.values():
        jsonschema.validate(_json_of(comp), SCHEMA)


def test_rows_without_a_grammar_sample_bit_for_bit_what_they_sample_beside_unconstrained_rows():
    """The same batch twice, its last three rows with a grammar or without (10 tokens each: none ends
    earlier, so every step has the same rows): the free rows' tokens and log-probabilities are the same
    bits, drawn from the engine's own generator."""
    def run(grammar):
        reqs = [_req(f"free{i}", grammar="", max_tokens=30) for i in range(3)]
        reqs += [_req(f"other{i}", grammar=grammar, max_tokens=10) for i in range(3)]
        return _run(TorchRolloutEngine(TINY, max_batch=8, max_len=256, eos_token_ids=[], seed=5), reqs)

    unconstrained, constrained = run(""), run(GRAMMAR)
    for i in range(3):
        a, b = unconstrained[f"free{i}"], constrained[f"free{i}"]
        assert a.output_ids.tolist() == b.output_ids.tolist() and a.logprobs.tobytes() == b.logprobs.tobytes()
    assert all(TOK.decode(constrained[f"other{i}"].output_ids).startswith('{"name": "') for i in range(3))
    assert not any(TOK.decode(unconstrained[f"other{i}"].output_ids).startswith("{") for i in range(3))


def test_seeded_rows_sample_what_they_sample_without_constrained_rows_beside_them():
    free = lambda: [_req(f"free{i}", grammar="", seed=100 + i, max_tokens=40) for i in range(3)]  # noqa: E731
    alone = _run(TorchRolloutEngine(TINY, max_batch=8, max_len=256, eos_token_ids=[]), free())
    mixed = _run(TorchRolloutEngine(TINY, max_batch=8, max_len=256, eos_token_ids=[]),
                 free() + [_req(f"json{i}", seed=i) for i in range(3)])
    for rid, comp in alone.items():
        assert mixed[rid].output_ids.tolist() == comp.output_ids.tolist()
        # a batch of another size rounds the forward's last bits otherwise (CPU matmul blocking)
        np.testing.assert_allclose(mixed[rid].logprobs, comp.logprobs, atol=1e-5)
    for i in range(3):
        jsonschema.validate(_json_of(mixed[f"json{i}"]), SCHEMA)


def test_the_recorded_logprob_is_the_masked_distributions_renormalised_over_the_allowed_tokens():
    model = load_pretrained(TINY)
    for temperature in (1.0, 0.7):
        out = _run(TorchRolloutEngine(model, max_batch=4, max_len=256, tokenizer=TOK),
                   [_req(f"r{i}", seed=i, temperature=temperature) for i in range(3)])
        for comp in out.values():
            want = _masked_logprobs(model, PROMPT, comp, GRAMMAR, TOK, temperature)
            np.testing.assert_allclose(comp.logprobs, want, atol=1e-4)
            unmasked = token_logprobs(model, torch.tensor([PROMPT + comp.output_ids.tolist()]),
                                      temperature=temperature)[0, len(PROMPT):].numpy()
            assert (comp.logprobs >= unmasked - 1e-5).all()  # renormalised over fewer tokens: never less likely
            assert (comp.logprobs > unmasked + 1e-3).mean() > 0.5  # and on most tokens the mask cut real mass


def test_a_bpe_tokenizer_grammar_yields_valid_json(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    # SmolLM2's tokenizer with a small random model of its vocabulary: the mask works on BPE pieces.
    cfg = dataclasses.replace(ModelConfig.from_hf(smollm2_dir), num_hidden_layers=1, hidden_size=64,
                              intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = make_random_model(cfg, seed=0, std=0.05)
    prompt = tok.encode("Fill the form as JSON.")
    engine = TorchRolloutEngine(model, max_batch=4, max_len=256, tokenizer=tok, eos_token_ids=[tok.eos_token_id])
    out = _run(engine, [_req(f"r{i}", seed=i, prompt=prompt) for i in range(4)])
    for comp in out.values():
        ids = comp.output_ids.tolist()
        assert comp.finish_reason == "stop" and ids[-1] == tok.eos_token_id
        jsonschema.validate(json.loads(tok.decode(ids[:-1])), SCHEMA)


def test_a_grammar_the_engine_cannot_compile_or_has_no_tokenizer_for_is_refused_naming_why():
    engine = TorchRolloutEngine(TINY, max_batch=2, max_len=64)
    with pytest.raises(ValueError, match="grammar does not compile"):
        engine.add_request(_req("bad", grammar="root ::= undefined_rule"))
    bare = TorchRolloutEngine(load_pretrained(TINY), max_batch=2, max_len=64)  # a model object, no tokenizer
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.add_request(_req("r"))
    assert engine.running_ids == [] and bare.running_ids == []


def test_the_simulated_engine_answers_a_grammar_request_with_an_error_naming_it():
    topo = load_topology(ROOT / "topology" / "sim.yaml")
    engine = SimRolloutEngine(topo.rollout_engine.model_copy(update={"decode_step_s": 0.0}), "rollout-0")
    core = RolloutCore(engine, "rollout-0", 1, StepLog(topo))
    [(to, comp)] = core.on_request(_req("g"), gateway=0)
    assert to == ReplyTo("gateway", 0) and comp.finish_reason == "error" and comp.output_ids.size == 0
    assert "grammar" in comp.error and "simulated" in comp.error


# -- the trainer ----------------------------------------------------------------------------------------


def test_the_trainer_takes_the_masked_logprobs_as_behaviour_and_its_own_unconstrained(tmp_path):
    """Fresh samples: the proximal weights are the sampler's, so without a mask w = pi_prox / pi_behav
    would be 1 (tests/test_torch_train.py). With one, the behaviour log-probability is the masked
    distribution's and the proximal one the unconstrained model's: w is each token's allowed mass,
    below 1, and the update's mean_w is exactly its mean over the tokens."""
    model_dir = tmp_path / "model"
    shutil.copytree(TINY, model_dir)
    engine = TorchRolloutEngine(model_dir, max_batch=8, max_len=256)
    out = _run(engine, [_req(f"r{i}", seed=i, max_tokens=80, group_id="g") for i in range(8)])
    trajs = []
    for i, comp in enumerate(sorted(out.values(), key=lambda c: c.request_id)):
        rec = EpisodeRecord(comp.episode_id, np.asarray(PROMPT, np.int32), group_id="g", ticket=i)
        rec.add_completion(comp)
        trajs.append(rec.to_trajectory(reward=float(i % 2)))
    data = pad_batch(trajs, torch.zeros(len(trajs)))
    mask = data["mask"].bool()
    with torch.no_grad():
        unconstrained = token_logprobs(load_pretrained(model_dir), data["ids"], data["attn"], 1.0)
    assert torch.equal(data["behav"][mask], torch.from_numpy(np.concatenate([t.logprobs for t in trajs])))
    w = torch.exp(unconstrained[mask] - data["behav"][mask])
    assert float(w.max()) <= 1 + 1e-4 and float(w.mean()) < 0.99

    topo = parse_topology({"async": {"enabled": True}, "global_batch_size": 8, "trigger_batch_size": 8,
                           "mini_batch_size": 8, "learning_rate": 1e-3, "model": {"path": str(model_dir)},
                           "agent": {"framework": "guess"}, "rollout_engine": {"kind": "torch", "temperature": 1.0},
                           "trainer_engine": {"kind": "torch", "behav_imp_weight_cap": None}})
    stats = TorchTrainEngine(topo, model_dir).train(trajs, version=0)
    assert stats["mean_w"] == pytest.approx(float(w.mean()), abs=1e-4)
    assert np.isfinite(stats["loss"])


# -- on a GPU: the CUDA-graph step ----------------------------------------------------------------------


@pytest.mark.gpu
def test_on_cuda_the_graph_replayed_step_masks_constrained_rows_beside_free_ones():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    engine = TorchRolloutEngine(TINY, max_batch=16, max_len=256, device="cuda", dtype=torch.bfloat16)
    assert engine.fast is not None and engine.fast.graphs  # decode steps replayed as CUDA graphs
    reqs = [_req(f"json{i}", seed=i, top_logprobs=3) for i in range(8)]
    reqs += [_req(f"free{i}", grammar="", seed=50 + i, max_tokens=30, top_k=20, ignore_eos=True) for i in range(8)]
    out = _run(engine, reqs)
    model = load_pretrained(TINY, "cuda", torch.bfloat16)
    for i in range(8):
        comp = out[f"json{i}"]
        jsonschema.validate(_json_of(comp), SCHEMA)
        assert comp.top_ids.shape == (comp.output_ids.size, 3)
        np.testing.assert_allclose(comp.logprobs, _masked_logprobs(model, PROMPT, comp, GRAMMAR, TOK), atol=5e-2)
        assert out[f"free{i}"].output_ids.size == 30
