"""The project's own tokenizer: character level over printable ASCII plus three ChatML specials.

Why character level: the embedded default model is tiny and trained here from scratch, so a vocabulary
of ~100 ids keeps its embedding table negligible, and a tokenizer without merges is *concatenative*
(the ids of ``a + b`` are the ids of ``a`` followed by the ids of ``b``). That makes the multi-turn
token bookkeeping in ``areal_bus.tasks`` trivially exact; the no-re-tokenisation rule (train on the
ids the engine sampled) still holds for any tokenizer, this one just cannot hide a violation.

The files it writes (tokenizer.json, tokenizer_config.json, chat template) load with
``transformers.AutoTokenizer.from_pretrained(path)``; eos is ``<|im_end|>`` as in Qwen chat models.

    python -c "from areal_bus.model.tokenizer import build_tokenizer; build_tokenizer('models/tok')"
"""

from __future__ import annotations

import json
import string
from pathlib import Path

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# Every printable ASCII character and newline; other characters are dropped by the tokenizer. The
# order fixes the ids, so it must never change for a saved model to stay readable.
ALPHABET = ["\n"] + [c for c in string.printable if c not in string.whitespace] + [" "]

# Qwen's ChatML layout without its default system prompt: `<|im_start|>role\ncontent<|im_end|>\n`.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _byte_level(ch: str) -> str:
    """GPT-2's byte-to-unicode map for one ASCII character: printable ones stand for themselves, the
    others (space, newline) are shifted past 255 ('Ġ', 'Ċ'), as in every Qwen/GPT-2 vocabulary."""
    b = ord(ch)
    if 33 <= b <= 126:
        return ch
    shifted = [x for x in range(256) if not (33 <= x <= 126 or 161 <= x <= 172 or 174 <= x <= 255)]
    return chr(256 + shifted.index(b))


def make_tokenizer():
    """The tokenizer in memory; ``build_tokenizer`` saves it.

    It is a ``Qwen2Tokenizer`` (byte-level BPE) with a ~100-entry vocabulary and no merges, which makes
    it character level. Being exactly the class ``AutoTokenizer`` picks for a ``qwen2`` model folder
    matters: transformers rebuilds a qwen2 tokenizer's pre-tokenizer and decoder from its class, so any
    other pipeline saved in tokenizer.json would be silently replaced on load (spaces dropped)."""
    from transformers import Qwen2Tokenizer

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({_byte_level(c): len(SPECIAL_TOKENS) + i for i, c in enumerate(ALPHABET)})
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tokenizer(path: str | Path):
    """Write the tokenizer files into ``path`` (created if missing) and return the tokenizer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    tok.save_pretrained(str(path))
    # Readers other than this transformers (older releases, vLLM, plain-json loaders) look for the
    # template inside tokenizer_config.json and for special_tokens_map.json.
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(chat_template=CHAT_TEMPLATE, additional_special_tokens=[IM_START])
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    special = {"eos_token": IM_END, "pad_token": ENDOFTEXT, "unk_token": ENDOFTEXT,
               "additional_special_tokens": [IM_START]}
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return tok
