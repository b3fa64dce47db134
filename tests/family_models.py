"""Tiny stand-ins for the model families the gateway's parsers serve (Qwen2.5 / Qwen3, Llama 3.1,
Mistral), built locally with no hub: each family's real chat template (tests/chat_templates/, as its
tokenizer_config.json ships it), a small byte-level BPE trained here that has the family's special
tokens (ids of their own, special or not as in the family's real vocabulary), and a random model of
the family's architecture sized to that vocabulary.

The BPE has merges, so a tool-call marker or a JSON key is several tokens and a streamed reply is cut
inside them, as with the real vocabularies. The architectures are the families' own: Qwen3's per-head q/k
norms, Llama 3.1's RoPE scaling, Mistral v0.3 (no sliding window).

    from tests.family_models import family_tokenizer, family_model
    tok = family_tokenizer("llama3.1"); model = family_model("llama3.1", tok)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"


@dataclass(frozen=True)
class Family:
    template: str  # file in tests/chat_templates
    arch: str  # which of areal_bus.model.modeling's tiny configs: qwen2, qwen3, llama3.1 (Llama 3.1's RoPE), mistral
    special: tuple[str, ...]  # special tokens (skipped when decoding), eos among them
    added: tuple[str, ...]  # added tokens that are not special (decoded as text)
    eos: str
    bos: str | None = None


FAMILIES = {
    "qwen2.5": Family("qwen2.5.jinja", "qwen2", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                      ("<tool_call>", "</tool_call>"), "<|im_end|>"),
    "qwen3": Family("qwen3.jinja", "qwen3", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                    ("<tool_call>", "</tool_call>", "<think>", "</think>"), "<|im_end|>"),
    "llama3.1": Family("llama3.1.jinja", "llama3.1", ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                                   "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"), (),
                       "<|eot_id|>", "<|begin_of_text|>"),
    "mistral": Family("mistral.jinja", "mistral", ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                                                 "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                                                 "[/TOOL_RESULTS]"), (), "</s>", "<s>"),
}

# What the BPE learns its merges from: JSON tool calls and English, so both come out in multi-character
# pieces.
_CORPUS = [
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{"name": "get_time", "parameters": {"zone": "UTC"}}',
    '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]',
    "Let me check the weather in Paris for you. It is sunny and the temperature is 24 degrees.",
    "The user asks about the weather, so I should call the tool first and then answer.",
    "You are a helpful assistant. Answer in one short sentence.",
] * 20


@functools.cache
def family_tokenizer(name: str):
    """The family's tokenizer (a transformers fast tokenizer with its chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    fam = FAMILIES[name]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=list(fam.special), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=fam.eos, bos_token=fam.bos,
                                  pad_token=fam.special[0], clean_up_tokenization_spaces=False)
    tok.add_special_tokens({"additional_special_tokens": [t for t in fam.special if t not in (fam.eos, fam.bos)]})
    if fam.added:
        tok.add_tokens(list(fam.added), special_tokens=False)
    tok.chat_template = (TEMPLATES / fam.template).read_text()
    return tok


def family_model(name: str, tok, seed: int = 0):
    """A random model of the family's architecture over ``tok``'s vocabulary (eos: the tokenizer's)."""
    from areal_bus.model.modeling import TINY_LLAMA31, TINY_MISTRAL, TINY_QWEN2, TINY_QWEN3, make_random_model

    arch = {"qwen2": TINY_QWEN2, "qwen3": TINY_QWEN3, "llama3.1": TINY_LLAMA31, "mistral": TINY_MISTRAL}
    base = arch[FAMILIES[name].arch]
    cfg = {**base, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id, "max_position_embeddings": 2048,
           "bos_token_id": tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id}
    return make_random_model(cfg, seed=seed, std=0.2)
