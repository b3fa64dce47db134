"""The plain-torch Qwen2 / Qwen3 / Llama / Mistral decoder agrees with transformers and round-trips HF
checkpoints, RoPE scaling included."""

import pytest
import torch

from areal_bus.model.modeling import (TINY_LLAMA, TINY_LLAMA31, TINY_MISTRAL, TINY_QWEN2, TINY_QWEN3, KVCache, ModelConfig,
                                load_pretrained, make_random_model, save_pretrained, token_logprobs)
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

transformers = pytest.importorskip("transformers")


def _ids(cfg: dict, b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg["vocab_size"], (b, t), generator=torch.Generator().manual_seed(seed))


LINEAR = {**TINY_LLAMA, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
YARN = {**TINY_LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}


@pytest.mark.parametrize("cfg,hf_class", [
    (TINY_QWEN2, "Qwen2ForCausalLM"), (TINY_LLAMA, "LlamaForCausalLM"), (TINY_QWEN3, "Qwen3ForCausalLM"),
    (TINY_LLAMA31, "LlamaForCausalLM"), (TINY_MISTRAL, "MistralForCausalLM"), (LINEAR, "LlamaForCausalLM"),
    (YARN, "LlamaForCausalLM")],
    ids=["qwen2", "llama", "qwen3", "llama3.1-rope", "mistral", "linear-rope", "yarn-rope"])
def test_logits_match_transformers(tmp_path, cfg, hf_class):
    ours = make_random_model(cfg, seed=1, std=0.2)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norms other than ones, so a norm in the wrong place (q's on k) shows
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.5 * torch.randn(p.shape, generator=gen))
    save_pretrained(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(hf).__name__ == hf_class
    assert hf.model.rotary_emb.rope_type == dict(cfg.get("rope_scaling") or {"rope_type": "default"})["rope_type"]
    ids = _ids(cfg, 2, 150)  # past the scaled types' original 64 / 128 positions
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)


def test_right_padded_batch_matches_transformers(tmp_path):
    ours = make_random_model(TINY_QWEN2, seed=2, std=0.2)
    save_pretrained(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = _ids(TINY_QWEN2, 3, 16)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    with torch.no_grad():
        a, b = ours(ids, attention_mask=mask), hf(ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.allclose(a[real], b[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("cfg,config_class,model_class", [
    (TINY_QWEN2, "Qwen2Config", "Qwen2ForCausalLM"), (TINY_QWEN3, "Qwen3Config", "Qwen3ForCausalLM"),
    (TINY_LLAMA31, "LlamaConfig", "LlamaForCausalLM")], ids=["qwen2", "qwen3", "llama3.1-rope"])
def test_loads_checkpoint_written_by_transformers(tmp_path, cfg, config_class, model_class):
    hf_cfg = getattr(transformers, config_class)(**{k: v for k, v in cfg.items() if k != "model_type"})
    torch.manual_seed(3)
    hf = getattr(transformers, model_class)(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ids = _ids(cfg, 2, 100)
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("cfg", [TINY_QWEN2, TINY_LLAMA, TINY_QWEN3, TINY_LLAMA31],
                         ids=["tied", "untied", "qwen3", "llama3.1-rope"])
def test_save_load_round_trip_is_exact(tmp_path, cfg):
    model = make_random_model(cfg, seed=4, std=0.2)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    assert loaded.cfg == model.cfg
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == cfg["tie_word_embeddings"]
    ids = _ids(cfg, 1, 8)
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))


def test_config_reads_legacy_and_v5_rope_fields():
    legacy = ModelConfig.from_hf({**TINY_QWEN2, "rope_theta": 123.0})
    v5 = ModelConfig.from_hf({k: v for k, v in TINY_QWEN2.items() if k != "rope_theta"}
                             | {"rope_parameters": {"rope_type": "default", "rope_theta": 123.0}})
    assert legacy.rope_theta == v5.rope_theta == 123.0
    assert legacy.attention_bias and not ModelConfig.from_hf(TINY_LLAMA).attention_bias


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "made-up"])
def test_config_refuses_rope_scaling_that_changes_with_length_or_is_unknown(rope_type):
    with pytest.raises(ValueError, match=f"RoPE type '{rope_type}' not supported"):
        ModelConfig.from_hf({**TINY_LLAMA, "rope_scaling": {"rope_type": rope_type, "factor": 8.0}})


def test_config_refuses_sliding_window_and_unknown_architectures():
    with pytest.raises(ValueError, match="sliding-window"):
        ModelConfig.from_hf({**TINY_MISTRAL, "sliding_window": 4096})  # Mistral 7B v0.1
    with pytest.raises(ValueError, match="model_type 'gemma' not supported"):
        ModelConfig.from_hf({**TINY_LLAMA, "model_type": "gemma"})


def test_token_logprobs_are_tempered_log_softmax_of_next_token():
    model = make_random_model(TINY_QWEN2, seed=5, std=0.2)
    ids = _ids(TINY_QWEN2, 2, 10)
    with torch.no_grad():
        lp = token_logprobs(model, ids, temperature=0.7)
        want = torch.log_softmax(model(ids)[:, :-1] / 0.7, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        greedy = token_logprobs(model, ids, temperature=0.0)
        plain = token_logprobs(model, ids, temperature=1.0)
    assert lp.shape == ids.shape and torch.all(lp[:, 0] == 0)
    assert torch.allclose(lp[:, 1:], want, atol=1e-5)
    assert torch.equal(greedy, plain)  # temperature 0 reports the untempered distribution


def test_token_logprobs_of_a_padded_row_equal_the_unpadded_row():
    model = make_random_model(TINY_LLAMA, seed=6, std=0.2)
    ids = _ids(TINY_LLAMA, 2, 12)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        batch = token_logprobs(model, ids, attention_mask=mask, temperature=0.9)
        alone = token_logprobs(model, ids[1:, :7], temperature=0.9)
    assert torch.allclose(batch[1, :7], alone[0], atol=1e-5)
    assert torch.all(batch[1, 7:] == 0)


def test_token_logprobs_are_differentiable():
    model = make_random_model(TINY_QWEN2, seed=7, std=0.2).requires_grad_(True)
    token_logprobs(model, _ids(TINY_QWEN2, 1, 6)).sum().backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_cached_chunked_forward_matches_full_forward():
    model = make_random_model(TINY_QWEN2, seed=8, std=0.2)
    ids = _ids(TINY_QWEN2, 1, 14)
    cache = KVCache(model.cfg, slots=3, max_len=32, device="cpu", dtype=torch.float32)
    slot = torch.tensor([2])
    with torch.no_grad():
        full = model(ids)
        parts = []
        for lo, hi in [(0, 5), (5, 6), (6, 14)]:  # a prefill, one decode step, a chunk
            pos = torch.arange(lo, hi)[None]
            parts.append(model.lm_head(model.hidden_states(ids[:, lo:hi], pos, cache=cache, slots=slot)))
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)


def test_param_shapes_are_the_models_own_parameters_without_building_it():
    from areal_bus.model.modeling import param_shapes

    model = make_random_model(TINY_QWEN2)
    assert param_shapes(TINY_QWEN2) == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
