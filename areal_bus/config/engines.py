"""``rollout_engine`` and ``trainer_engine``: one schema per engine kind, chosen by ``kind``.

Each kind takes the fields it reads and no others: the fields every kind of a side uses sit in its base
(``RolloutEngineBase``: sampling, batch, sequence length, output lengths), the rest on the kind that
reads them. A field of another kind is refused by name (``check_kind``: "rollout_engine.swap_s is a
'sim' engine field; rollout_engine.kind is 'torch'"), not silently ignored. ``kind`` may be left out:
it is 'sim' then, as it always was. What each knob is for, with its measurements: docs/knob-notes.md.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from areal_bus.config.base import Strict, experimental


class LengthDistribution(Strict):
    dist: Literal["lognormal", "uniform", "fixed"] = Field("lognormal", description="Output length distribution.")
    median: float = Field(500.0, gt=0, description="lognormal: median output length in tokens.")
    sigma: float = Field(0.8, ge=0, le=5, description="lognormal: shape; 0.8 gives a long tail.")
    min: int = Field(200, ge=1, description="Shortest output (clip).")
    max: int = Field(3000, ge=1, description="Longest output (clip; also max_tokens).")

    @model_validator(mode="after")
    def _order(self):
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


# -- rollout ---------------------------------------------------------------------------------------

_ROLLOUT_KIND = ("Generation engine, which chooses the fields marked with a kind: 'sim' models decode time; 'torch' "
                 "generates with model.path (KV cache, continuous batching); 'vllm' with vLLM on a GPU "
                 "(pip install 'areal-bus[vllm]').")

class RolloutEngineBase(Strict):
    """The fields every rollout engine kind reads."""

    kind: str = Field(..., description=_ROLLOUT_KIND)  # each kind's Literal (first in dumps, as it was)
    max_len: int = Field(1024, ge=8, le=1_000_000, description="Tokens per sequence (prompt + output): the "
                         "torch engine's KV-cache length, vLLM's context, and the gateway's context unless "
                         "nodes.gateway.config.max_context_tokens is set.")
    temperature: float = Field(1.0, ge=0, le=10, description="Sampling temperature for training episodes.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass for training episodes.")
    max_batch: int = Field(16, ge=1, le=4096, description="Sequences one worker decodes at once (continuous batching).")
    output_len: LengthDistribution = Field(default_factory=LengthDistribution, description="Output lengths: "
                                           "what the sim engine generates, and the longtail task's and the "
                                           "sim agent's token budgets.")


class SimRolloutEngineConfig(RolloutEngineBase):
    kind: Literal["sim"] = Field("sim", description=_ROLLOUT_KIND)
    decode_step_s: float = Field(0.001, ge=0, le=10, description="Time of one decode step at batch 1.")
    decode_step_per_seq_s: float = Field(0.00001, ge=0, le=1, description="Extra step time per sequence in the batch.")
    swap_s: float = Field(0.005, ge=0, le=60, description="Pause to switch to new weights at a safe point.")


class TorchRolloutEngineConfig(RolloutEngineBase):
    kind: Literal["torch"] = Field("torch", description=_ROLLOUT_KIND)
    decode_attention: Literal["auto", "sdpa", "matmul", "flash_varlen", "flash_paged"] = Field(
        "auto", description="On CUDA, the decode step's attention: 'flash_varlen' reads each row's own cache "
        "length (FlashAttention-2 varlen; bfloat16/float16), 'sdpa' every row up to the longest's bucket, "
        "'matmul' two batched matmuls (a reference); with kv_tokens, 'flash_paged' (FlashAttention's paged "
        "kernel) in place of flash_varlen. 'auto': the flash kind where it runs, else sdpa.")
    decode_compile: bool | None = Field(None, description="On CUDA, fuse the decode step's elementwise work "
                                        "(norms, rotary, SiLU) with torch.compile. None: on where it runs, "
                                        "else off with a warning.")
    kv_tokens: int | None = Field(None, ge=16, le=1_000_000_000, description="Tokens the KV cache holds for all "
                                  "running sequences together, in pages each takes as it grows and frees when it "
                                  "ends: the running batch is bounded by tokens, and a request waits (never fails) "
                                  "until its pages are free. At least max_len. None: a dense max_batch x max_len "
                                  "cache.")
    kv_page_tokens: int = Field(256, ge=1, le=65536, description="Tokens per page of the kv_tokens cache. The CUDA "
                                "decode step's FlashAttention paged kernel needs a multiple of 256 ('auto' falls "
                                "back to sdpa otherwise); smaller pages waste less of each sequence's last page.")

    @model_validator(mode="after")
    def _kv_pool(self):
        if self.kv_tokens is not None and self.kv_tokens < self.max_len:
            raise ValueError(f"kv_tokens ({self.kv_tokens}) must hold one sequence of max_len ({self.max_len}) tokens")
        return self


class VllmRolloutEngineConfig(RolloutEngineBase):
    kind: Literal["vllm"] = Field("vllm", description=_ROLLOUT_KIND)
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="Fraction of the GPU vLLM takes for "
                                          "weights, activations and KV cache; leave the trainer room.")
    prefix_caching: bool = Field(True, description="Reuse the keys/values of a prompt prefix computed under "
                                 "the same weights (a multi-turn agent's earlier turns); never across a weight swap.")


ROLLOUT_KINDS = {"sim": SimRolloutEngineConfig, "torch": TorchRolloutEngineConfig, "vllm": VllmRolloutEngineConfig}


# -- trainer ---------------------------------------------------------------------------------------

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a decoder layer in the Qwen2 / Llama / Mistral family: LoRA's default targets."""


class LoraConfig(Strict):
    """``trainer_engine.lora``: train low-rank adapters on a frozen base instead of every weight
    (areal_bus/train/lora.py). What moves to the rollout workers and into checkpoints is the adapter alone."""

    rank: int = Field(..., ge=1, le=4096, description="The adapters' rank r: each targeted projection W "
                      "[out, in] gains B [out, r] @ A [r, in].")
    alpha: float | None = Field(None, gt=0, le=1_000_000, description="LoRA's alpha: the adapters' output is "
                                "scaled by alpha / rank. None: 2 x rank (a scale of 2).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input in training (the "
                           "rollout engines apply none); above 0 every update makes its own proximal pass.")
    target_modules: list[str] = Field(list(LORA_TARGETS), min_length=1, max_length=64, description="Names of "
                                      "the decoder layers' linear layers that get adapters (default: all "
                                      "seven); `areal-bus validate` checks the model has each. Not lm_head: "
                                      "the chunked head reads its weight directly.")

    @model_validator(mode="after")
    def _targets(self):
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"target_modules names a layer twice: {self.target_modules}")
        outside = [t for t in self.target_modules if t in ("lm_head", "embed_tokens")]
        if outside:
            raise ValueError(f"target_modules: {outside[0]!r} cannot take an adapter (the trainer's chunked head "
                             f"reads lm_head's weight and the embedding directly); adapters go on the decoder "
                             f"layers' linear layers: {', '.join(LORA_TARGETS)}")
        return self

    @property
    def scale(self) -> float:
        """alpha / rank: what the adapters' output is multiplied by, on both sides of the run."""
        return (self.alpha if self.alpha is not None else 2.0 * self.rank) / self.rank


_TRAINER_KIND = ("Training engine, which chooses the fields marked with a kind: 'sim' models time per token; 'torch' "
                 "trains model.path with the decoupled PPO objective.")

class TrainerEngineBase(Strict):
    kind: str = Field(..., description=_TRAINER_KIND)  # each kind's Literal (first in dumps, as it was)


class SimTrainerEngineConfig(TrainerEngineBase):
    kind: Literal["sim"] = Field("sim", description=_TRAINER_KIND)
    time_per_token_s: float = Field(2e-5, ge=0, le=1, description="Training time per token on one train worker, "
                                    "divided across train_workers.")
    update_overhead_s: float = Field(0.01, ge=0, le=60, description="Fixed cost per update (weight export, sync).")


class TorchTrainerEngineConfig(TrainerEngineBase):
    kind: Literal["torch"] = Field("torch", description=_TRAINER_KIND)
    attn_implementation: str = Field("areal_varlen", min_length=1, json_schema_extra=experimental(["areal_varlen_fa4"]),
                                     description="Attention over the trainer's packed rows: 'areal_varlen' "
                                     "(within each sample; FlashAttention varlen on CUDA), 'areal_varlen_fa4' "
                                     "(the same with FlashAttention-4, Hopper or newer), or a name transformers "
                                     "knows ('sdpa', 'flex_attention', ...).")
    micro_batch_tokens: int = Field(16384, ge=16, le=10_000_000, description="Tokens packed into one forward "
                                    "and backward; gradients accumulate over a mini-batch's micro-batches.")
    micro_batch_pad_tokens: int | None = Field(None, ge=1, le=1_000_000, description="Pad each micro-batch "
                                               "to a multiple of this many tokens, so the GPU's matmuls meet "
                                               "few shapes. None: 1024 on CUDA, 1 (no padding) on CPU.")
    logit_chunk_tokens: int = Field(4096, ge=16, le=1_000_000, description="Positions whose logits exist at "
                                    "once: the lm_head runs chunk by chunk, so no [tokens, vocab] tensor is whole.")
    logit_grad_keep_gib: float | None = Field(None, ge=0, le=1024, description="GiB of lm_head logit gradients "
                                              "kept from forward to backward per micro-batch; chunks past it "
                                              "recompute their logits. None: a tenth of the GPU, at most 8 "
                                              "(1 on CPU); 0: always recompute.")
    gradient_checkpointing: bool = Field(False, description="Recompute each decoder layer's activations in "
                                         "backward (less memory, ~1/3 more compute).")
    mixed_precision: Literal["compute_copy", "autocast"] = Field(
        "compute_copy", description="With model.dtype bfloat16/float16: 'compute_copy' runs on a copy of the "
        "weights in that dtype, refreshed once per optimizer step; 'autocast' casts at every use. Parallel "
        "layouts always autocast.")
    prox_logp_method: Literal["recompute", "loglinear"] = Field(
        "recompute", json_schema_extra=experimental(),
        description="The proximal policy's log-probabilities (AReaL's actor.prox_logp_method): 'recompute' "
        "runs a forward pass for them; 'loglinear' interpolates between the sampler's and the training "
        "forward's by each token's staleness.")
    compile: bool = Field(False, description="torch.compile each decoder layer of the trainer's policy "
                          "(worth it on a GPU; the first update pays the compilation).")
    eps_clip: float = Field(0.2, gt=0, le=1, description="PPO clip range (low side, and high side unless eps_clip_high).")
    eps_clip_high: float | None = Field(None, gt=0, le=10, description="PPO clip range on the high side (DAPO's clip-higher).")
    behav_imp_weight_cap: float | None = Field(5.0, gt=1, description="Tokens whose behaviour importance weight "
                                               "exceeds this are left out of the loss (None: no cap).")
    loss_token_norm: int | None = Field(None, ge=1, le=10_000_000, description="How a mini-batch's per-token "
                                        "terms become its loss. None: their mean (token-mean); N: their sum "
                                        "over (samples x N), Dr. GRPO's constant normaliser.")
    adv_std_normalize: bool = Field(True, description="GRPO: divide advantages by the group's reward std.")
    adv_leave_one_out: bool = Field(False, description="GRPO: baseline is the mean of the other samples.")
    kl_coef: float = Field(0.0, ge=0, le=10, description="KL penalty against the initial policy; 0 = off.")
    ppo_epochs: int = Field(1, ge=1, le=16, description="Passes over each batch per update.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    eval_interval: int = Field(0, ge=0, description="Evaluate greedily on the held-out set every this many "
                               "updates (0 = never).")
    eval_episodes: int = Field(64, ge=1, le=100_000, description="Held-out task instances per evaluation.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters on a frozen base in model.dtype "
                                    "(rank, alpha, dropout, target_modules); None: full fine-tuning.")


TRAINER_KINDS = {"sim": SimTrainerEngineConfig, "torch": TorchTrainerEngineConfig}


def _kind_of(value) -> str:
    # Both sides default to the simulated engines when kind is left out.
    return value.get("kind", "sim") if isinstance(value, dict) else getattr(value, "kind", "sim")


RolloutEngineConfig = Annotated[Union[Annotated[SimRolloutEngineConfig, Tag("sim")],
                                      Annotated[TorchRolloutEngineConfig, Tag("torch")],
                                      Annotated[VllmRolloutEngineConfig, Tag("vllm")]], Discriminator(_kind_of)]
"""``rollout_engine``: the schema of its ``kind``."""
TrainerEngineConfig = Annotated[Union[Annotated[SimTrainerEngineConfig, Tag("sim")],
                                      Annotated[TorchTrainerEngineConfig, Tag("torch")]], Discriminator(_kind_of)]
"""``trainer_engine``: the schema of its ``kind``."""


def _names(items, last: str = "or") -> str:
    items = [f"'{i}'" for i in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {last} {items[-1]}"


def check_kind(section: str, kinds: dict, data):
    """``data`` for ``section`` (rollout_engine / trainer_engine) as written, before validation: a kind
    that is not one of ``kinds``, or a field that belongs to another kind, is a ValueError naming both."""
    if not isinstance(data, dict):
        return data
    kind = _kind_of(data)
    if kind not in kinds:
        raise ValueError(f"{section}.kind must be {_names(kinds)} (got {kind!r})")
    own = kinds[kind].model_fields
    foreign: dict[tuple[str, ...], list[str]] = {}
    for key in data:
        owners = tuple(k for k, model in kinds.items() if key in model.model_fields)
        if key not in own and owners:
            foreign.setdefault(owners, []).append(key)
    if foreign:
        said = [f"{' and '.join(keys)} {'is a' if len(keys) == 1 else 'are'} {_names(owners)} engine "
                f"field{'' if len(keys) == 1 else 's'}" for owners, keys in foreign.items()]
        raise ValueError(f"{section}.{'; '.join(said)}; {section}.kind is {kind!r} (set the kind they belong "
                         f"to, or leave them out)")
    return data
