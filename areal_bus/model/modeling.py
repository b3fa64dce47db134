"""A minimal decoder for the Qwen2 / Qwen3 / Llama / Mistral family in plain torch, shared by rollout and trainer.

Both sides of the RL loop need the same model and, above all, the same definition of a token's
log-probability: the rollout engine records it while sampling, the trainer recomputes it (proximal
policy) and differentiates it (PPO ratio). Keeping the network, the weight names and
``token_logprobs`` in one module is what makes those numbers comparable.

Parameter names are Hugging Face's (``model.layers.{i}.self_attn.q_proj.weight`` ...), so
``load_pretrained`` reads a checkpoint directory of these families as is and ``save_pretrained`` writes one
that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

Supported: RMSNorm, RoPE (``rope_theta``) with the scaling types whose frequencies do not change with
the sequence's length (``ROPE_TYPES``: "linear", "llama3" as Llama 3.1-3.3 ship it, "yarn"; their
frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS``), grouped-query attention, SwiGLU MLP,
q/k/v bias (Qwen2 always, Llama / Qwen3 when ``attention_bias``), Qwen3's per-head q/k RMSNorm, tied or
untied ``lm_head``. Not supported (refused with an error, never silently wrong): RoPE types that change
with the length ("dynamic", "longrope"), sliding-window attention, MLP bias.

Quick check::

    python -c "from areal_bus.model.modeling import *; m = make_random_model(TINY_QWEN2, 0); print(m)"
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# A Qwen2-0.5B-shaped config (random weights: for GPU benchmarks, no hub needed).
QWEN2_0_5B: dict = {
    "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645,
}
# Tiny shapes for CPU tests: GQA (4 query heads over 2 kv heads), two layers.
TINY_QWEN2: dict = {
    "model_type": "qwen2", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}
TINY_LLAMA: dict = {
    "model_type": "llama", "vocab_size": 160, "hidden_size": 48, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 512,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}

TINY_QWEN3: dict = {
    "model_type": "qwen3", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 512,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}
# Llama 3.1's RoPE scaling (its config.json's numbers), on the tiny shape.
TINY_LLAMA31: dict = {**TINY_LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
TINY_MISTRAL: dict = {**TINY_LLAMA, "model_type": "mistral", "sliding_window": None, "rope_theta": 1000000.0}

_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "mistral": "MistralForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE types computed here: fixed frequencies (the others rescale them with the sequence's length)."""
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accept "bfloat16" / "float32" ... as written in YAML configs, or a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    out = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(out, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return out


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str  # "qwen2" | "llama" | "qwen3" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's queries and keys before RoPE
    rope_scaling: tuple = ()  # (key, value) pairs of a non-default RoPE type's parameters, rope_type among them

    @classmethod
    def from_hf(cls, src: str | Path | dict) -> ModelConfig:
        """From a Hugging Face config: a dict, a config.json path, or a checkpoint directory."""
        if isinstance(src, dict):
            d = src
        else:
            p = Path(src)
            d = json.loads((p / "config.json" if p.is_dir() else p).read_text())
        model_type = d.get("model_type", "")
        if model_type not in _ARCHITECTURES:
            raise ValueError(f"model_type {model_type!r} not supported ({', '.join(_ARCHITECTURES)})")
        # transformers >= 5 writes rope_parameters; older configs (and real checkpoints) rope_theta.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"RoPE type {rope_type!r} not supported ({', '.join(ROPE_TYPES)})")
        if d.get("use_sliding_window") or (model_type == "mistral" and d.get("sliding_window") is not None):
            raise ValueError("sliding-window attention not supported")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias not supported")
        heads = d["num_attention_heads"]
        return cls(
            model_type=model_type, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v bias (its config has no switch); the others only when asked.
            attention_bias=True if model_type == "qwen2" else bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            qk_norm=model_type == "qwen3",
            rope_scaling=() if rope_type == "default" else tuple(sorted(
                {k: v for k, v in rope.items() if k not in ("type", "rope_theta")}.items()
                | {("rope_type", rope_type)})),
        )

    def to_hf(self, dtype: torch.dtype = torch.float32) -> dict:
        """A config.json dict that transformers' Qwen2Config / LlamaConfig accept (4.x and 5.x)."""
        d = {
            "architectures": [_ARCHITECTURES[self.model_type]], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "torch_dtype": _DTYPE_NAMES[dtype], "use_cache": True,
        }
        if self.model_type in ("qwen2", "qwen3"):
            d |= {"use_sliding_window": False, "sliding_window": None,
                  "max_window_layers": self.num_hidden_layers}
        if self.model_type != "qwen2":
            d |= {"attention_bias": self.attention_bias, "mlp_bias": False, "pretraining_tp": 1}
        if self.model_type == "mistral":
            d["sliding_window"] = None
        if self.rope_scaling:
            rope = dict(self.rope_scaling)
            d |= {"rope_scaling": rope, "rope_parameters": {**rope, "rope_theta": self.rope_theta}}
        return d

    def rope_frequencies(self, device=None) -> tuple[torch.Tensor, float]:
        """(RoPE's inverse frequencies [head_dim / 2] in float32, the factor its cos and sin are
        scaled by). The default's in closed form; a scaled type's from transformers' own function for it
        (``ROPE_INIT_FUNCTIONS``), so the numbers are the trainer's model's."""
        if not self.rope_scaling:
            steps = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
            return 1.0 / self.rope_theta ** steps, 1.0
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf = AutoConfig.for_model(**self.to_hf())
        inv_freq, scale = ROPE_INIT_FUNCTIONS[dict(self.rope_scaling)["rope_type"]](hf, device)
        return inv_freq.float(), float(scale)


# ---------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32 and cast back before the weight, as HF does, so bf16 results agree. (Also
    what cuda_decode's fused decode step compiles.)"""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype):
    """cos, sin of shape [B, 1, T, head_dim] for integer ``positions`` [B, T] (HF's half-split layout)."""
    inv_freq, scale = _frequencies(cfg, positions.device)
    freqs = positions.float()[..., None] * inv_freq  # [B, T, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


_FREQUENCIES: dict[tuple, tuple[torch.Tensor, float]] = {}


def _frequencies(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, float]:
    """``cfg.rope_frequencies`` on ``device``, computed once per RoPE and device (a scaled type goes
    through transformers' config machinery, too slow for every forward)."""
    key = (cfg.model_type, cfg.head_dim, cfg.hidden_size, cfg.num_attention_heads, cfg.rope_theta,
           cfg.max_position_embeddings, cfg.rope_scaling, str(device))
    if key not in _FREQUENCIES:
        _FREQUENCIES[key] = cfg.rope_frequencies(device)
    return _FREQUENCIES[key]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class KVCache:
    """Static key/value cache: one slot per running sequence, preallocated for ``max_len`` tokens.

    Layout ``k``, ``v``: [layers, slots, kv_heads, max_len, head_dim]. Layer first so that one layer's
    cache is a single contiguous block, already in the [batch, heads, seq, dim] shape attention reads.
    Slot contents past a sequence's length are stale (from earlier occupants) and are masked out, so
    freeing a slot costs nothing.
    """

    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, device, dtype: torch.dtype):
        shape = (cfg.num_hidden_layers, slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def view(self, slots: torch.Tensor, positions: torch.Tensor, length: int) -> _CacheView:
        """What one forward reads and writes (a paged cache, engines/kv_pages.py, gives its own)."""
        return _CacheView(self, slots, positions, length)


@dataclass(slots=True)
class _CacheView:
    """What one forward pass reads and writes in a KVCache: these slots, at these positions."""

    cache: KVCache
    slots: torch.Tensor  # [B]
    positions: torch.Tensor  # [B, T]
    length: int  # keys to attend over: max position + 1

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        # k, v: [B, kv_heads, T, D]. Advanced indices around a slice put (B, T) first: [B, T, H, D].
        idx = (self.slots[:, None], slice(None), self.positions)
        self.cache.k[layer][idx] = k.transpose(1, 2)
        self.cache.v[layer][idx] = v.transpose(1, 2)
        return (self.cache.k[layer, :, :, :self.length].index_select(0, self.slots),
                self.cache.v[layer, :, :, :self.length].index_select(0, self.slots))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:  # Qwen3: each head's queries and keys normalised before RoPE
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, cos, sin, mask, layer: int, cache: _CacheView | None):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        gqa = self.n_kv != self.n_heads
        if mask is None:  # causal over the whole sequence: the fused (flash) kernel on CUDA
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif cache is not None:  # decode: a few queries against a slot's cache
            o = grouped_attention(q, k, v, mask)
        else:  # padded training batch
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked attention for few queries over a cache, GQA without copying keys/values per head.

    q [B, H, T, D]; k, v [B, KV, L, D]; mask [B, 1, T, L] (True = attend). The H query heads are
    grouped by the kv head they share (head i reads kv head i // (H / KV), as in HF's repeat_kv) and
    each group runs one matmul against its kv head. Why not SDPA: with a mask whose length changes
    every decode step, CUDA picks cuDNN, which builds a new graph per shape (~2 ms a layer).
    """
    b, h, t, d = q.shape
    kv, length = k.shape[1], k.shape[2]
    g = h // kv
    qg = q.reshape(b, kv, g * t, d)
    scores = (qg @ k.transpose(-1, -2)).float() * d ** -0.5  # [B, KV, g*T, L]
    scores = scores.view(b, kv, g, t, length).masked_fill(~mask[:, :, None], float("-inf"))
    probs = scores.softmax(-1).to(v.dtype).view(b, kv, g * t, length)
    return (probs @ v).reshape(b, h, t, d)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, layer, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, layer, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Qwen2 / Qwen3 / Llama / Mistral causal LM. Module tree and parameter names match Hugging Face's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None, cache: KVCache | None = None,
                      slots: torch.Tensor | None = None) -> torch.Tensor:
        """Final normed hidden states [B, T, hidden].

        Without ``cache``: a full-sequence pass. ``attention_mask`` [B, T] (1 = token, 0 = padding)
        may pad on either side; ``positions`` default to the count of real tokens before each one.
        With ``cache``: tokens at ``positions`` [B, T] (consecutive within a row) of cache ``slots``
        [B] are written to the cache and attend to every cached position of their slot up to their
        own (prefill and decode alike).
        """
        b, t = input_ids.shape
        dev = input_ids.device
        view = None
        if cache is not None:
            if positions is None or slots is None:
                raise ValueError("a cached forward needs positions and slots")
            first, last = (int(x) for x in positions.aminmax())
            view = cache.view(slots, positions, last + 1)
            if first == 0 and last == t - 1 and t > 1:
                mask = None  # fresh prefill: its keys are exactly its own tokens, plain causal
            else:
                key_pos = torch.arange(last + 1, device=dev)
                mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, L]
        else:
            if positions is None:
                positions = (torch.arange(t, device=dev).expand(b, t) if attention_mask is None
                             else (attention_mask.long().cumsum(-1) - 1).clamp(min=0))
            mask = None  # causal in sequence order
            if attention_mask is not None:
                q_idx = torch.arange(t, device=dev)
                # Padding keys are hidden; the diagonal stays open so a padding query row is never
                # fully masked (that would give NaN); its output is ignored anyway.
                keys = attention_mask.bool()[:, None, :] | torch.eye(t, dtype=torch.bool, device=dev)
                mask = ((q_idx[None, :] <= q_idx[:, None]) & keys)[:, None]  # [B, 1, T, T]
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.cfg, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, i, view)
        return self.model.norm(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Full-sequence logits [B, T, vocab] (training and reference passes)."""
        return self.lm_head(self.hidden_states(input_ids, positions, attention_mask))


# ---------------------------------------------------------------------------------------------
# Log-probabilities: ONE definition for the engine that samples and the trainer that recomputes
# ---------------------------------------------------------------------------------------------


def scaled_logits(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """The logits a token's recorded log-probability is taken from: float32, divided by the sampling
    temperature. Temperature 0 (greedy) scales by 1: the greedy "distribution" is a point mass whose
    log-probability is always 0 and would teach the trainer nothing, so the plain softmax stands in.
    Top-p truncation is NOT applied: the logprob is that of the tempered full distribution, which the
    trainer can recompute from logits alone."""
    logits = logits.float()
    if isinstance(temperature, torch.Tensor):
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
        return logits / t.view(-1, *([1] * (logits.dim() - 1)))
    # Temperature 1 (and 0) is the plain softmax: no division, one pass over [tokens, vocab] fewer.
    return logits / temperature if temperature > 0 and temperature != 1 else logits


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """log p(tokens) under ``scaled_logits(logits, temperature)``; logits [..., V], tokens [...]."""
    return logprobs_and_normaliser(logits, tokens, temperature)[0]


def logprobs_and_normaliser(logits: torch.Tensor, tokens: torch.Tensor,
                            temperature: float | torch.Tensor = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(``logprobs_of``, the logsumexp it subtracts): the trainer's chunked head keeps the second for its
    backward (softmax = exp(z - logsumexp)) instead of reading the logits once more."""
    z = scaled_logits(logits, temperature)
    lse = torch.logsumexp(z, dim=-1)
    # Gather minus logsumexp: never materialises a second [..., V] float32 tensor.
    return z.gather(-1, tokens[..., None].long()).squeeze(-1) - lse, lse


def token_logprobs(model: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Per-token log-probabilities [B, T], aligned with ``input_ids``: ``out[b, t]`` is
    log p(input_ids[b, t] | input_ids[b, :t]), as the rollout engine recorded it when it sampled that
    token with ``temperature`` (a float, or one per row). ``out[:, 0]`` and padding positions are 0.
    Differentiable. ``model`` is this module's CausalLM or a transformers causal LM (the trainer's)."""
    if isinstance(model, CausalLM):
        logits = model(input_ids, attention_mask=attention_mask)
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(logits.device)
    lp = logprobs_of(logits[:, :-1], input_ids[:, 1:], temperature)
    out = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    return out if attention_mask is None else out * attention_mask.to(out.dtype)


# ---------------------------------------------------------------------------------------------
# Checkpoints: Hugging Face layout (config.json + *.safetensors)
# ---------------------------------------------------------------------------------------------

# Keys some older checkpoints carry that are recomputed here, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_safetensors(path: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, or of all ``*.safetensors`` in a directory (shards)."""
    from safetensors.torch import load_file

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {p}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f), device=str(device)))
    return out


def check_state_dict(model: CausalLM, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of ``sd`` that are ``model``'s parameters, after checking none is missing or
    misshapen (so a bad checkpoint fails before any weight is touched)."""
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    out = {k: v for k, v in sd.items() if k in params}
    missing = sorted(set(params) - set(out))
    unexpected = sorted(k for k in sd if k not in params and not k.endswith(_IGNORED_SUFFIXES)
                        and not (k == "lm_head.weight" and model.cfg.tie_word_embeddings))
    if missing or unexpected:
        raise KeyError(f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    bad = [k for k, v in out.items() if v.shape != params[k].shape]
    if bad:
        raise ValueError(f"shape mismatch for {bad[:5]}: e.g. {bad[0]} {tuple(out[bad[0]].shape)} "
                         f"vs {tuple(params[bad[0]].shape)}")
    return out


def load_pretrained(path: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype | str = torch.float32) -> CausalLM:
    """A CausalLM from a Hugging Face checkpoint directory (config.json + safetensors)."""
    cfg = ModelConfig.from_hf(path)
    dtype = as_dtype(dtype)
    return model_from_state(cfg, {k: v.to(dtype) for k, v in load_safetensors(path, device).items()})


def model_from_state(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> CausalLM:
    """A CausalLM whose parameters ARE the tensors of ``sd`` (assigned, not copied: views of a shared
    base stay views, areal_bus/model/shared_base.py), after checking names and shapes."""
    with torch.device("meta"):
        model = CausalLM(cfg)  # no random init of weights that are about to be replaced
    model.load_state_dict(check_state_dict(model, sd), strict=False, assign=True)
    model.tie_weights()  # assign=True replaced the Parameter objects: tie them again
    return model.eval()


def save_pretrained(model: CausalLM, path: str | Path) -> None:
    """Write config.json + model.safetensors that transformers' AutoModelForCausalLM loads."""
    save_state_dict(model.cfg, model.state_dict(), path)


def save_state_dict(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], path: str | Path) -> None:
    """``save_pretrained`` from a full state dict rather than a model: what a sharded trainer gathers."""
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(state_dict.values())).dtype
    (p / "config.json").write_text(json.dumps(cfg.to_hf(dtype), indent=2))
    sd = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # safetensors refuses shared storage; HF re-ties on load
    save_file(sd, str(p / "model.safetensors"), metadata={"format": "pt"})


def make_random_model(cfg: dict | ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
                      dtype: torch.dtype | str = torch.float32, std: float = 0.02) -> CausalLM:
    """A model with seeded random weights: normal(0, std) everywhere but the norms (ones).
    Deterministic for a given seed on CPU; built on CPU and then moved so the seed means the same
    weights on every device."""
    cfg = cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_hf(cfg)
    gen = torch.Generator().manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:  # biases too are random (not zero) so tests notice a missing or misplaced one
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.to(device=device, dtype=as_dtype(dtype)).eval()


def param_shapes(cfg: dict | ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter a checkpoint of ``cfg`` holds, in the model's order (a tied
    lm_head once, as the embedding). Built on the meta device: no memory, whatever the size."""
    cfg = cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_hf(cfg)
    with torch.device("meta"):
        model = CausalLM(cfg)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """Cache bytes one token takes (K and V, all layers): for sizing ``max_batch * max_len``."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


__all__ = [
    "QWEN2_0_5B", "TINY_QWEN2", "TINY_LLAMA", "TINY_QWEN3", "TINY_LLAMA31", "TINY_MISTRAL", "ROPE_TYPES",
    "ModelConfig", "CausalLM", "KVCache", "as_dtype",
    "scaled_logits", "logprobs_of", "logprobs_and_normaliser", "token_logprobs", "load_safetensors", "check_state_dict",
    "load_pretrained", "model_from_state", "save_pretrained", "save_state_dict", "make_random_model", "num_params", "kv_bytes_per_token",
]
