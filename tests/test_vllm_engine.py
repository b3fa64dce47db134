"""The vLLM rollout engine: every part that does not need vLLM is tested here with plain data (vLLM's
outputs are reproduced as dataclasses of the same shape: what is tested is our conversion code); the
tests that drive vLLM itself (marked gpu) skip, with the reason, where vLLM or a GPU is absent: CI's
machines. They run on the GPU host with vLLM 0.25.1 from scripts/gpu-host/gpu_vllm.sh (docs/gpus.md;
results in bench/RESULTS.md). They share one engine (a vLLM start is ~30 s) and run in file order: the
logprob test first, on the checkpoint's own weights, then the tests that swap weights in."""

from __future__ import annotations

import importlib
import json
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from areal_bus.engines import vllm_engine as ve
from areal_bus.engines import vllm_worker as vw
from areal_bus.wire.messages import GenerateRequest
from areal_bus.config.topology import TopologyError, parse_topology
from areal_bus.weights.shm import ShmWeightWriter, segment_path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "models" / "tiny-guess"
NO_VLLM = "vLLM is not installed (pip install 'areal-bus[vllm]' on a CUDA host)"


def _req(rid="r0", prompt=(1, 5, 7), max_tokens=8, temperature=1.0, top_p=1.0, stop=()):
    return GenerateRequest(request_id=rid, episode_id="ep-" + rid, ticket=3, min_version=0, max_tokens=max_tokens,
                           temperature=temperature, prompt_ids=np.asarray(prompt, dtype=np.int32), top_p=top_p,
                           stop=list(stop))


# Plain dataclasses shaped like vllm.logprobs.Logprob, vllm.outputs.CompletionOutput / RequestOutput.
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass
class CompletionOutput:
    token_ids: list
    logprobs: list | None
    finish_reason: str | None = None
    index: int = 0


@dataclass
class RequestOutput:
    request_id: str
    outputs: list
    finished: bool = False


def _out(rid, tokens, lps, finished=False, reason=None, extra=None):
    """One step's DELTA output: ``tokens`` new this step, each with its logprob (plus ``extra`` top-k)."""
    dicts = [{t: Logprob(lp, 1)} | (extra or {}) for t, lp in zip(tokens, lps)]
    return RequestOutput(rid, [CompletionOutput(list(tokens), dicts, reason)], finished)


# -- the checkpoint ---------------------------------------------------------------------------------------

def test_what_the_engine_reads_of_a_checkpoint_comes_from_transformers_for_any_architecture(tmp_path):
    """Before: the engine built areal_bus.model.modeling's config for it, so a Qwen3 or Llama 3.1 checkpoint (and any
    architecture that decoder does not run) was refused before vLLM saw it."""
    import transformers

    from areal_bus.model.modeling import TINY_LLAMA31, TINY_QWEN3, make_random_model, save_pretrained

    save_pretrained(make_random_model(TINY_QWEN3, 0), tmp_path / "qwen3")
    save_pretrained(make_random_model({**TINY_LLAMA31, "eos_token_id": [2, 5, 7]}, 0), tmp_path / "llama3.1")
    gemma = transformers.Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, eos_token_id=1)
    transformers.Gemma2ForCausalLM(gemma).save_pretrained(tmp_path / "gemma2")  # no decoder of ours runs it
    assert ve.served_facts(tmp_path / "qwen3") == (True, [2])
    assert ve.served_facts(tmp_path / "llama3.1") == (False, [2, 5, 7])
    assert ve.served_facts(tmp_path / "gemma2") == (True, [1])


# -- requests -----------------------------------------------------------------------------------------


def test_request_becomes_sampling_parameters_that_stop_on_eos_and_integer_stops():
    spec = ve.sampling_spec(_req(temperature=0.7, top_p=0.9, max_tokens=5, stop=[9, "</s>", 4]), eos_token_ids=[2])
    assert spec == {"n": 1, "temperature": 0.7, "top_p": 0.9, "max_tokens": 5, "logprobs": 0, "top_k": 0, "seed": None,
                    "ignore_eos": True, "stop_token_ids": [2, 4, 9], "detokenize": False}


def test_grammar_top_logprobs_seed_and_top_k_map_onto_vllms_sampling_parameters():
    grammar = 'root ::= "{" [a-z]* "}"'
    req = _req()
    req.grammar, req.top_logprobs, req.seed, req.top_k = grammar, 5, 1234, 40
    spec = ve.sampling_spec(req, eos_token_ids=[2])
    assert (spec["logprobs"], spec["seed"], spec["top_k"]) == (5, 1234, 40)
    assert spec["structured_outputs"] == {"grammar": grammar}  # StructuredOutputsParams(grammar=...)
    assert "structured_outputs" not in ve.sampling_spec(_req(), eos_token_ids=[2])
    req.seed = 0  # a seed of 0 is a seed
    assert ve.sampling_spec(req, eos_token_ids=[2])["seed"] == 0


def test_prompts_the_torch_engine_refuses_are_refused_naming_the_request():
    assert ve.prompt_of(_req(prompt=[3, 4]), max_len=8) == [3, 4]
    for req in (_req(prompt=[]), _req(prompt=list(range(8))), _req(max_tokens=0)):
        with pytest.raises(ValueError, match="request r0"):
            ve.prompt_of(req, max_len=8)


# -- outputs, logprobs and versions -------------------------------------------------------------------


def test_the_sampled_tokens_logprob_is_taken_from_each_dict():
    dicts = [{5: Logprob(-0.5), 8: Logprob(-0.1)}, {6: Logprob(-2.0)}]
    assert ve.sampled_logprobs([5, 6], dicts) == [-0.5, -2.0]


def test_missing_logprobs_are_an_error_not_a_silent_zero():
    with pytest.raises(ValueError, match="logprobs must be 0"):
        ve.sampled_logprobs([5], None)
    with pytest.raises(ValueError, match="no logprob for sampled token 5"):
        ve.sampled_logprobs([5], [{8: Logprob(-0.1)}])


def test_top_logprobs_are_the_k_ranked_entries_with_the_sampled_token_kept_apart_when_outside_them():
    # vLLM's dict: the k most likely by rank 1..k, plus the sampled token with its own rank when it is not one
    dicts = [{7: Logprob(-0.2, 1), 3: Logprob(-1.9, 2)},
             {9: Logprob(-4.0, 5), 1: Logprob(-0.5, 1), 2: Logprob(-1.5, 2)}]
    assert ve.top_arrays([7, 9], dicts, 2) == ([[7, 3], [1, 2]], [[-0.2, -1.9], [-0.5, -1.5]])
    with pytest.raises(ValueError, match="1 top logprobs for token 5, 2 were asked for"):
        ve.top_arrays([5], [{5: Logprob(-0.1, 1)}], 2)


def test_a_request_with_top_logprobs_completes_and_streams_them():
    req = _req()
    req.top_logprobs = 2
    running = {"r0": ve.Generation(req, 0.0)}
    ve.absorb_outputs(running, [_out("r0", [11], [-0.1], extra={12: Logprob(-2.5, 2)})], 0, "w")
    assert running["r0"].top(0)[0].tolist() == [[11, 12]]
    step2 = RequestOutput("r0", [CompletionOutput([4], [{4: Logprob(-3.0, 3), 5: Logprob(-0.3, 1),
                                                        6: Logprob(-1.4, 2)}], "length")], finished=True)
    (c,) = ve.absorb_outputs(running, [step2], 0, "w")
    assert c.top_ids.tolist() == [[11, 12], [5, 6]] and c.top_ids.dtype == np.int32
    np.testing.assert_allclose(c.top_logprobs, [[-0.1, -2.5], [-0.3, -1.4]])
    plain = ve.absorb_outputs({"r1": ve.Generation(_req("r1"), 0.0)}, [_out("r1", [3], [-1.0], True, "stop")], 0, "w")
    assert plain[0].top_ids.shape == plain[0].top_logprobs.shape == (0, 0)


def test_tokens_carry_the_version_in_force_when_their_step_ran():
    running = {"r0": ve.Generation(_req(), started_at=0.0)}
    assert ve.absorb_outputs(running, [_out("r0", [11], [-0.1])], version=3, worker="w") == []
    assert ve.absorb_outputs(running, [_out("r0", [12], [-0.2], extra={99: Logprob(-0.01)})], 3, "w") == []
    # the rollout node swapped weights here, between two steps
    done = ve.absorb_outputs(running, [_out("r0", [13, 2], [-0.3, -0.4], finished=True, reason="stop")], 4, "w")
    assert running == {}
    (c,) = done
    assert (c.request_id, c.episode_id, c.ticket, c.worker, c.finish_reason) == ("r0", "ep-r0", 3, "w", "stop")
    assert c.output_ids.tolist() == [11, 12, 13, 2] and c.output_ids.dtype == np.int32
    assert c.versions.tolist() == [3, 3, 4, 4]
    assert np.allclose(c.logprobs, [-0.1, -0.2, -0.3, -0.4]) and c.logprobs.dtype == np.float32


def test_requests_finish_independently_and_only_finished_ones_are_returned():
    running = {r: ve.Generation(_req(r), 0.0) for r in ("a", "b")}
    done = ve.absorb_outputs(running, [_out("a", [4], [-1.0], finished=True, reason="length"),
                                       _out("b", [5], [-1.0])], 0, "w")
    assert [c.request_id for c in done] == ["a"] and done[0].finish_reason == "length"
    assert list(running) == ["b"]


# -- engine arguments ---------------------------------------------------------------------------------


def test_engine_arguments_pin_what_exact_tags_and_logprobs_need():
    kw = ve.engine_kwargs("/m", max_batch=32, max_len=256, dtype="bfloat16", seed=7)
    assert (kw["model"], kw["max_num_seqs"], kw["max_model_len"], kw["dtype"], kw["seed"]) == ("/m", 32, 256,
                                                                                              "bfloat16", 7)
    assert kw["enable_prefix_caching"] is True and kw["async_scheduling"] is False and kw["stream_interval"] == 1
    assert kw["skip_tokenizer_init"] is False
    off = ve.engine_kwargs("/m", max_batch=32, max_len=256, dtype="bfloat16", seed=7, prefix_caching=False,
                           skip_tokenizer_init=True)
    assert off["enable_prefix_caching"] is False and off["skip_tokenizer_init"] is True
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["generation_config"] == "vllm"
    module, name = kw["worker_extension_cls"].rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is vw.WeightLoadExtension


def test_the_cache_salt_names_the_weights_loaded_so_no_prefix_is_shared_across_a_swap():
    assert ve.cache_salt(0) != ve.cache_salt(1)
    assert ve.cache_salt(3) == ve.cache_salt(3)
    stats = ve.PrefillStats(requests=2, prompt_tokens=100, cached_tokens=32)
    assert stats.prefilled == 68


def test_the_topology_turns_prefix_caching_off_when_asked():
    assert _vllm_topology().rollout_engine.prefix_caching is True
    assert _vllm_topology(rollout_engine={"prefix_caching": False}).rollout_engine.prefix_caching is False


def test_an_older_vllm_drops_optional_arguments_but_refuses_without_required_ones():
    kw = ve.engine_kwargs("/m", max_batch=2, max_len=64, dtype="bfloat16", seed=0)
    fitted = ve.fit_engine_args(kw, set(kw) - {"async_scheduling", "stream_interval"})
    assert "async_scheduling" not in fitted and fitted["logprobs_mode"] == "processed_logprobs"
    with pytest.raises(RuntimeError, match=r"lacks logprobs_mode.*vLLM >= 0.10.2"):
        ve.fit_engine_args(kw, set(kw) - {"logprobs_mode"})


def test_eos_ids_accept_every_form_a_config_uses():
    assert (ve.eos_ids(None), ve.eos_ids(2), ve.eos_ids([2, 7])) == ([], [2], [2, 7])


# -- weights ------------------------------------------------------------------------------------------


def test_checkpoint_shapes_come_from_the_safetensors_headers(tmp_path):
    from safetensors.torch import save_file

    save_file({"a.weight": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "model-1.safetensors"))
    save_file({"c": torch.zeros(2, 2, 2, dtype=torch.bfloat16)}, str(tmp_path / "model-2.safetensors"))
    assert vw.checkpoint_shapes(tmp_path) == {"a.weight": (3, 4), "b": (5,), "c": (2, 2, 2)}


def test_the_shipped_checkpoint_matches_its_own_layout():
    from areal_bus.model.modeling import load_pretrained

    model = load_pretrained(TINY)
    got = {k: tuple(v.shape) for k, v in model.named_parameters()}  # what the trainer publishes
    vw.check_layout(got, vw.checkpoint_shapes(TINY), tied=model.cfg.tie_word_embeddings)


def test_a_weight_set_that_differs_from_the_checkpoint_is_refused_before_loading():
    expected = {"embed.weight": (10, 4), "lm_head.weight": (10, 4), "x.rotary_emb.inv_freq": (2,), "w": (4, 4)}
    vw.check_layout({"embed.weight": (10, 4), "w": (4, 4)}, expected, tied=True)  # tied head, rotary buffer: fine
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        vw.check_layout({"embed.weight": (10, 4), "w": (4, 4)}, expected, tied=False)
    with pytest.raises(ValueError, match=r"unknown \['v'\]; wrong shape \['w'\]"):
        vw.check_layout({"embed.weight": (10, 4), "w": (4, 5), "v": (1,)}, expected, tied=True)


def test_cuda_handles_are_moved_to_this_process_device_index():
    handles = {"format": 1, "name": "p", "manifest": "{}", "buffers": [{"device": 3, "size": 8}, {"device": 3, "size": 8}]}
    moved = vw.handles_on_device(handles, 0)
    assert [b["device"] for b in moved["buffers"]] == [0, 0] and moved["buffers"][0]["size"] == 8
    assert handles["buffers"][0]["device"] == 3  # the caller's dict is left alone


def test_cuda_handles_are_read_again_only_when_the_trainer_rewrites_them(tmp_path):
    from areal_bus.weights.cuda import save_handles

    path = tmp_path / "policy.cuda-handles"
    save_handles(path, {"format": 1, "name": "policy", "buffers": []})
    stamp, handles = vw.changed_handles(path, None)
    assert handles == {"format": 1, "name": "policy", "buffers": []}
    assert vw.changed_handles(path, stamp) == (stamp, None)
    save_handles(path, {"format": 1, "name": "policy2", "buffers": []})  # a restarted trainer
    os.utime(path, ns=(stamp + 1, stamp + 1))  # a distinct mtime even on a coarse clock
    assert vw.changed_handles(path, stamp)[1]["name"] == "policy2"


@pytest.fixture
def shm_name():
    n = f"test_{uuid.uuid4().hex[:12]}"
    yield n
    for k in (0, 1):
        try:
            Path(segment_path(n, k)).unlink()
        except FileNotFoundError:
            pass


def test_a_shared_memory_version_reaches_load_weights_whole_and_is_let_go_after(shm_name):
    state = {"embed.weight": torch.randn(10, 4), "w": torch.randn(4, 4)}
    expected = {"embed.weight": [10, 4], "lm_head.weight": [10, 4], "w": [4, 4]}
    with ShmWeightWriter(shm_name, state, copy_threads=1) as writer:
        location = writer.write(state, version=5)
        feed = vw.WeightFeed(expected, tied=True)
        feed.attach({"kind": "shm", "name": shm_name})
        items = feed.items(location)
        assert [k for k, _ in items] == ["embed.weight", "w"]
        assert all(torch.equal(t, state[k]) for k, t in items)
        assert feed.shm.held == [5]
        feed.done(location)
        assert feed.shm.held == []


def test_a_location_without_its_source_attached_names_the_fix():
    feed = vw.WeightFeed({}, tied=False)
    with pytest.raises(ValueError, match=r"no cuda weight source attached.*attach_weights"):
        feed.items("cuda:policy.0@3")
    with pytest.raises(ValueError, match="unknown weight source kind"):
        feed.attach({"kind": "nfs"})


# -- wiring without vLLM ------------------------------------------------------------------------------


def _vllm_topology(**over):
    doc = {"agent": {"framework": "guess"}, "model": {"path": str(TINY), "device": "cuda", "dtype": "bfloat16"},
           "rollout_engine": {"kind": "vllm"}, "trainer_engine": {"kind": "torch"}}
    for key, value in over.items():
        doc[key] = doc.get(key, {}) | value
    return parse_topology(doc, "topo.yaml")


def test_topology_accepts_vllm_on_cuda_and_refuses_it_elsewhere():
    assert _vllm_topology().rollout_engine.kind == "vllm"
    with pytest.raises(TopologyError, match=r"model.device must be 'cuda'.*CUDA_VISIBLE_DEVICES.*got 'cpu'"):
        _vllm_topology(model={"device": "cpu"})
    with pytest.raises(TopologyError, match="got 'cuda:1'"):
        _vllm_topology(model={"device": "cuda:1"})
    with pytest.raises(TopologyError, match="'torch'/'vllm' with 'torch'"):
        _vllm_topology(trainer_engine={"kind": "sim"})


def test_without_vllm_the_rollout_node_names_the_extra_to_install(monkeypatch):
    from areal_bus.engines.rollout_factory import make_engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed, whether or not it is
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ImportError, match=r"pip install 'areal-bus\[vllm\]'"):
        make_engine(_vllm_topology(), "rollout-0", 0)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # in-process engine core: exact version tags


# -- with vLLM on a GPU (run on an H200 with vLLM 0.25.1; skipped where either is missing) -----------


def tiny_engine(**more) -> ve.VllmRolloutEngine:
    """A vLLM engine on the tiny checkpoint (4 slots, 128 tokens, bf16, no stop token: every request runs to
    max_tokens); the test skips where vLLM or a GPU is missing. ``more``: other engine arguments."""
    pytest.importorskip("vllm", reason=NO_VLLM)
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return ve.VllmRolloutEngine(TINY, max_batch=4, max_len=128, dtype="bfloat16", worker="w0", eos_token_ids=[],
                                gpu_memory_utilization=0.3, **more)


@pytest.fixture(scope="module")
def vllm_engine():
    engine = tiny_engine()
    yield engine
    del engine.llm


def _run(engine, reqs, between=None, max_steps=500):
    for r in reqs:
        engine.add_request(r)
    done = {}
    for i in range(max_steps):
        if between is not None:
            between(i)
        done |= {c.request_id: c for c in engine.step()}
        if len(done) == len(reqs):
            return done
    raise AssertionError("did not finish")


def _recompute(model, req, comp):
    from areal_bus.model.modeling import token_logprobs

    ids = torch.tensor([list(req.prompt_ids) + comp.output_ids.tolist()], device="cuda")
    with torch.no_grad():
        lp = token_logprobs(model, ids, temperature=req.temperature)[0, len(req.prompt_ids):]
    return lp.float().cpu().numpy()


@pytest.mark.gpu
def test_vllm_logprobs_are_what_the_trainer_recomputes(vllm_engine):
    from areal_bus.model.modeling import load_pretrained

    reqs = [_req("g", [1, 5, 7], 12, temperature=0.0), _req("t", [3, 4], 12, temperature=0.7)]
    done = _run(vllm_engine, reqs)
    model = load_pretrained(TINY, "cuda", torch.bfloat16)
    for r in reqs:
        assert done[r.request_id].versions.tolist() == [0] * done[r.request_id].output_ids.size
        assert np.allclose(done[r.request_id].logprobs, _recompute(model, r, done[r.request_id]), atol=5e-2)


@pytest.mark.gpu
def test_vllm_swap_between_steps_tags_later_tokens_and_serves_the_new_weights(vllm_engine, shm_name):
    from areal_bus.model.modeling import load_pretrained

    model = load_pretrained(TINY, "cuda", torch.bfloat16)
    state = {k: (v.float() + 0.05 * torch.randn_like(v.float())).cpu() for k, v in model.named_parameters()}
    with ShmWeightWriter(shm_name, state, copy_threads=1) as writer:
        location = writer.write(state, version=1)
        vllm_engine.attach_weights({"kind": "shm", "name": shm_name})
        req = _req("s", [1, 5, 7], 10, temperature=1.0)
        swap_at = 3
        done = _run(vllm_engine, [req], between=lambda i: i == swap_at and vllm_engine.swap_weights(1, location))
        versions = done["s"].versions.tolist()
        assert versions == [0] * swap_at + [1] * (len(versions) - swap_at)
        fresh = _req("f", [2, 6], 8, temperature=1.0)
        comp = _run(vllm_engine, [fresh])["f"]
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(state[k])
        assert comp.versions.tolist() == [1] * comp.output_ids.size
        assert np.allclose(comp.logprobs, _recompute(model, fresh, comp), atol=5e-2)


def _cached(engine, rid, prompt):
    """Prompt tokens vLLM served from its prefix cache for one request of ``prompt``."""
    before = engine.prefill.cached_tokens
    _run(engine, [_req(rid, prompt, 4, temperature=1.0)])
    return engine.prefill.cached_tokens - before


@pytest.mark.gpu
def test_vllm_reuses_an_earlier_turns_prefix_but_never_across_a_swap(vllm_engine, shm_name):
    from areal_bus.model.modeling import load_pretrained

    prompt = [1 + (7 * i) % 90 for i in range(40)]  # two full 16-token blocks and some
    assert _cached(vllm_engine, "c0", prompt) == 0
    # the next turn continues the same tokens: its first full blocks come from the cache
    assert _cached(vllm_engine, "c1", prompt + [3, 4, 5]) >= 32
    model = load_pretrained(TINY, "cpu", torch.float32)
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    with ShmWeightWriter(shm_name, state, copy_threads=1) as writer:
        vllm_engine.attach_weights({"kind": "shm", "name": shm_name})
        vllm_engine.swap_weights(vllm_engine.version + 1, writer.write(state, version=vllm_engine.version + 1))
    # the same tokens after the swap: nothing computed by the weights before it is reused (the weights
    # here are the same values, so only the salt can have prevented the hit) ...
    assert _cached(vllm_engine, "c2", prompt) == 0
    # ... and what the new weights computed is reused from then on
    assert _cached(vllm_engine, "c3", prompt + [6]) >= 32


def _cuda_publisher(conn) -> None:
    """The trainer's side of a CUDA IPC handoff, in its own process (a process cannot open its own
    CUDA IPC handles): the tiny checkpoint plus noise as version ``v`` for each ``v`` asked for."""
    from areal_bus.model.modeling import load_pretrained
    from areal_bus.weights.cuda import CudaWeightWriter

    model = load_pretrained(TINY, "cuda", torch.bfloat16)
    base = {k: v.detach() for k, v in model.named_parameters()}
    writer = CudaWeightWriter("vllmtest", {k: v.to("meta") for k, v in base.items()}, device="cuda")
    conn.send(writer.handles())
    while (version := conn.recv()) is not None:
        gen = torch.Generator(device="cuda").manual_seed(version)
        state = {k: v + 0.05 * torch.randn(v.shape, generator=gen, device="cuda", dtype=v.dtype) for k, v in base.items()}
        conn.send((writer.write(state, version), {k: v.float().cpu() for k, v in state.items()}))


@pytest.mark.gpu
def test_vllm_grammar_requests_follow_their_schema_with_top_logprobs_and_a_seed_that_repeats(vllm_engine):
    schema = {"type": "object", "required": ["n", "ok"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}
    grammar = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    tok = AutoTokenizer.from_pretrained(TINY)

    def req(rid, seed):
        r = _req(rid, tok.encode("<|im_start|>user\nform<|im_end|>\n<|im_start|>assistant\n"), 60, temperature=1.0,
                 stop=[tok.eos_token_id])  # this fixture's engine has no eos of its own
        r.grammar, r.top_logprobs, r.seed = grammar, 3, seed
        return r

    done = _run(vllm_engine, [req(f"j{i}", i) for i in range(3)])
    for comp in done.values():
        ids = comp.output_ids.tolist()
        assert comp.finish_reason == "stop" and ids[-1] == tok.eos_token_id, tok.decode(ids)
        jsonschema.validate(json.loads(tok.decode(ids[:-1])), schema)
        assert comp.top_ids.shape == comp.top_logprobs.shape == (len(ids), 3)
        assert (np.diff(comp.top_logprobs, axis=1) <= 0).all()
    assert _run(vllm_engine, [req("again", 0)])["again"].output_ids.tolist() == done["j0"].output_ids.tolist()


@pytest.mark.gpu
def test_vllm_takes_weights_from_another_process_over_cuda_ipc_mid_generation(vllm_engine):
    import multiprocessing as mp

    from areal_bus.model.modeling import load_pretrained

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_cuda_publisher, args=(there,), daemon=True)
    proc.start()
    try:
        vllm_engine.attach_weights({"kind": "cuda", "handles": here.recv()})
        old = vllm_engine.version
        new = old + 1
        published = {}

        def swap_at(step):
            if step == 3:
                here.send(new)
                location, published["state"] = here.recv()
                assert location.startswith("cuda:vllmtest.")
                vllm_engine.swap_weights(new, location)

        reqs = [_req(f"x{i}", [1 + i, 5, 7], 10, temperature=1.0) for i in range(3)]
        done = _run(vllm_engine, reqs, between=swap_at)
        for r in reqs:  # running requests were not aborted: the first tokens are the old version's, then the new
            tags = done[r.request_id].versions.tolist()
            assert len(tags) == 10 and tags[0] == old and tags[-1] == new and tags == sorted(tags), tags
        fresh = _req("y", [2, 6], 8, temperature=1.0)
        comp = _run(vllm_engine, [fresh])["y"]
        model = load_pretrained(TINY, "cuda", torch.bfloat16)
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(published["state"][k])
        assert comp.versions.tolist() == [new] * comp.output_ids.size
        assert np.allclose(comp.logprobs, _recompute(model, fresh, comp), atol=5e-2)
    finally:
        here.send(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
