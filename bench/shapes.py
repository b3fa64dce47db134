"""The model shapes the GPU benchmarks share, and seeded random weights at a big shape drawn on the GPU.

``shapes()`` is bench/trainer.py's table (0.5b, 1.5b, 3b: Qwen2/Qwen2.5; 7b: Qwen2.5-7B; 8b: Llama-3.1-8B)
plus ``qwen3-8b`` (Qwen3-8B's config.json: 36 layers, hidden 4096, 32 heads over 8 kv heads, head_dim 128,
q/k norms, untied 151,936-token head), so bench/gpu_e2e.py and bench/engine.py take the same shapes as the
trainer's table without a second copy of it. ``body(shape)`` is a shape without its vocabulary (what
bench/gpu_e2e.py puts on the tiny tokenizer's): its layers, widths, heads and RoPE.

``random_model`` draws on the device where it is a GPU: make_random_model draws every number on the CPU in
float32 (32 GB and minutes of the lent machine at 8B), then moves them.
"""

from __future__ import annotations

import os

QWEN3_8B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
            "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645}
"""Qwen3-8B's config.json (the numbers that shape it)."""

VOCAB_KEYS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
"""What a shape says about its vocabulary (left out by ``body``)."""


def shapes() -> dict[str, dict]:
    """{name: Hugging Face config fields} of every shape: bench/trainer.py's table and qwen3-8b."""
    before = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    # lazy: bench/trainer.py imports torch and the trainer at import time, and sets the CUDA allocator's
    # environment for its own processes; only the table is wanted here, so the environment is put back
    from bench.trainer import SHAPES

    if before is None:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    else:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = before
    return {**SHAPES, "qwen3-8b": QWEN3_8B}


def body(cfg: dict) -> dict:
    """``cfg`` without its vocabulary: the decoder's shape and RoPE."""
    return {k: v for k, v in cfg.items() if k not in VOCAB_KEYS}


def random_model(cfg: dict, device, dtype, seed: int = 0, std: float = 0.02):
    """A ``modeling.CausalLM`` at ``cfg`` with seeded random weights (normal(0, std), norms ones), drawn on
    ``device`` when it is a GPU (the same seed gives other numbers than make_random_model's CPU draw)."""
    import torch

    from areal_bus.model.modeling import CausalLM, ModelConfig, as_dtype, make_random_model

    device = torch.device(device)
    if device.type != "cuda":
        return make_random_model(cfg, seed=seed, device=device, dtype=dtype, std=std)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = CausalLM(ModelConfig.from_hf(cfg)).to(as_dtype(dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, std, generator=gen)
    return model.eval()
