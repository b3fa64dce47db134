"""Grammar-constrained decoding for the torch engine: an xgrammar matcher per constrained request, one
token bitmask per step.

A request's ``grammar`` is xgrammar EBNF (the gateway writes it, from a JSON schema or a tool's
parameters). ``Grammars`` compiles it for this engine's tokenizer once and keeps it by its text (an
agent's schemas come back every turn), and gives each request a ``GrammarMatcher`` of its own: the
grammar's state after the tokens the request has so far. Each step, ``TokenMask.apply`` has every
constrained row's matcher write which tokens may come next into a shared bitmask (on the host: the
matchers are CPU automata; on CUDA this overlaps the forward the step just launched), copies it to the
logits' device and sets the other tokens' logits of those rows to -inf (xgrammar's kernel: Triton on
CUDA, C++ on CPU), in place, after the (graph-replayed) forward and before sampling. Rows without a
grammar are not touched, and a step without a constrained row does none of this. Each matcher accepts
the token its row sampled at the start of the next step, with that step's forward already launched, so
on CUDA this work too runs while the GPU computes; a row that sampled one of the grammar's stop tokens
(allowed only once the grammar is complete) ends there, with finish_reason "stop".

The mask is the first thing applied to the logits, before temperature, top_k and top_p
(``sampling.sample``), so top_k picks among allowed tokens, and the log-probability the engine records
is that of the masked distribution, renormalised over the allowed tokens: the distribution the token
was actually drawn from (see areal_bus/train/loss.py for how the trainer uses it).

Special tokens (the tokenizer's ``all_special_ids``, and ids past its vocabulary) are never grammar
text: xgrammar would otherwise match ``<|im_start|>`` inside a JSON string as those 12 characters. The
stop tokens are the engine's eos ids (the tokenizer's eos when it has none): the grammar may end only
with one, and only once the grammar is complete.

Costs, measured on a 2-vCPU box (bench/constrained.py and bench/RESULTS.md for the step): the tokenizer
info is built once per engine (0.13 s for SmolLM2's 49k vocabulary), a JSON-schema grammar compiles in
~7 ms for it and is cached after, and a matcher accepts a token and fills its row of the bitmask in ~5 us
each. Both grow with the ids xgrammar counts as special (it searches them on every accept): a model whose
vocabulary is padded far past its tokenizer's (100k ids) pays ~25 us an accept.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch
import xgrammar as xgr
from transformers import AutoTokenizer

GRAMMAR_CACHE_SIZE = 256
"""Compiled grammars an engine keeps, least recently used dropped first. A compiled JSON-schema grammar
is tens of KB for a 50k vocabulary (55 KB for a three-field schema on SmolLM2); an agent run reuses a few
schemas, a gateway serving many clients more: 256 bounds the cache to a few tens of MB at most."""


class Grammars:
    """Grammar texts compiled for one tokenizer, cached by text; ``matcher(text)`` for each request.

    ``tokenizer``: a Hugging Face tokenizer, or a folder to load one from (at the first grammar, not
    before: an engine that never sees one never pays for it). ``vocab_size``: the model's (the width of
    its logits, which may exceed the tokenizer's). ``stop_token_ids``: ids that may end a grammar (none:
    the tokenizer's eos)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids=(), cache_size: int = GRAMMAR_CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.cache_size = cache_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self.compiles = 0  # grammars compiled (cache misses), for tests and logs

    def matcher(self, grammar: str) -> xgr.GrammarMatcher:
        """A fresh matcher for ``grammar``. ValueError, saying why, for a grammar that does not compile
        or an engine that cannot constrain (no tokenizer, no stop token)."""
        return xgr.GrammarMatcher(self.compiled(grammar))

    def compiled(self, grammar: str) -> xgr.CompiledGrammar:
        hit = self._compiled.get(grammar)
        if hit is not None:
            self._compiled.move_to_end(grammar)
            return hit
        compiler = self._compiler or self._make_compiler()
        try:
            out = compiler.compile_grammar(grammar)
        except RuntimeError as exc:  # xgrammar's parse errors; the text is the client's (via the gateway)
            raise ValueError(f"grammar does not compile: {str(exc)[:500]}") from None
        self.compiles += 1
        self._compiled[grammar] = out
        if len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return out

    def _make_compiler(self) -> xgr.GrammarCompiler:
        tok = self.tokenizer
        if tok is None:
            raise ValueError("this engine has no tokenizer to compile a grammar for (give it a checkpoint folder "
                             "with tokenizer files, or tokenizer=...)")
        if not hasattr(tok, "get_vocab"):  # a folder
            tok = self.tokenizer = AutoTokenizer.from_pretrained(str(tok))
        self._compiler = xgr.GrammarCompiler(tokenizer_info(tok, self.vocab_size, self.stop_token_ids),
                                             cache_enabled=False)  # ours is the cache, bounded and by text
        return self._compiler


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of ``tokenizer`` over the model's ``vocab_size`` ids, with its special tokens
    (all but the stop tokens) blanked so that no grammar text can match them."""
    stops = stop_token_ids or None
    if stops is None and getattr(tokenizer, "eos_token_id", None) is None:
        raise ValueError("a grammar needs a stop token to end on: this engine has no eos id and its "
                         "tokenizer names none")
    base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
    vocab = [""] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size:
            vocab[i] = token
    for i in getattr(tokenizer, "all_special_ids", ()):
        if i < vocab_size:
            vocab[i] = ""  # an empty token is a special one to xgrammar: never grammar text
    return xgr.TokenizerInfo(vocab, vocab_type=base.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=base.stop_token_ids, add_prefix_space=base.add_prefix_space)


class TokenMask:
    """The bitmask one step fills for its constrained rows (up to ``max_rows``), and its application to
    the step's logits on ``device``."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.seconds = 0.0  # host time spent in apply (bench/constrained.py reports it per step)
        self.host = xgr.allocate_token_bitmask(max_rows, vocab_size)  # int32 [rows, ceil(V / 32)]
        self.device_mask = None
        if device.type != "cpu":
            # Pinned, so the copy is asynchronous. Reused every step: the step's sampling reads its
            # tokens back to the host (a synchronisation) before the next step fills it again.
            self.host = self.host.pin_memory()
            self.device_mask = torch.empty_like(self.host, device=device)

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, xgr.GrammarMatcher, int | None]]) -> None:
        """Mask row ``i`` of ``logits`` [B, V] (in place) with the tokens matcher ``m`` allows next, once it
        has accepted ``last`` (the row's token of the step before; None: none yet), for each ``(i, m,
        last)`` in ``rows``; the other rows are left as they are. The engine calls this with the step's
        forward launched: on CUDA the matchers' work (accept and fill, ~5 us each a row for a 49k BPE
        vocabulary) overlaps the GPU's. RuntimeError if a matcher refuses the token its mask allowed."""
        t0 = time.perf_counter()
        for i, m, last in rows:
            if last is not None and not m.accept_token(last):
                raise RuntimeError(f"a grammar refused token {last}, which its mask had allowed")
            m.fill_next_token_bitmask(self.host, i)
        n = logits.shape[0]
        mask = self.host[:n]
        if self.device_mask is not None:
            mask = self.device_mask[:n]
            mask.copy_(self.host[:n], non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=[i for i, _, _ in rows])
        self.seconds += time.perf_counter() - t0
