"""A real rollout engine in plain torch: static or paged KV cache, continuous batching, version-tagged tokens.

``TorchRolloutEngine`` implements ``RolloutEngine`` (see ``base``) over ``areal_bus.model.modeling``. It is
small enough to read in one sitting and exact enough to test against a full forward pass: the
reference for correctness that runs anywhere torch does (a vLLM engine is the one for throughput).

One ``step()``:
  1. admits pending requests into free cache slots (with a paged cache, those its pages can hold: below);
  2. feeds every running sequence the tokens whose keys/values are not cached yet: whole prompts for
     newcomers (batched prefill, right-padded, grouped by length under ``max_prefill_tokens``), one
     token for the rest (ONE batched decode forward, each row attending to its own slot up to its
     own position);
  3. samples one token per sequence from those logits, tags it with its log-probability and the
     policy version in force, and returns the sequences that finished.
So every running sequence gains exactly one token per step, prefill or decode alike.

The KV cache: dense by default, ``max_batch x max_len`` tokens, a slot per sequence (``modeling.KVCache``);
with ``kv_tokens`` a pool of pages the running sequences take as they grow and give back when they end
(``kv_pages.PagedKVCache``), so the running batch is bounded by the tokens it holds. A request its pages
cannot hold yet waits in the queue (never refused); a running sequence that needs a page when none is free
preempts the youngest, which goes back to the queue with its tokens and is prefilled again later (the
policy and why: ``kv_pages``'s docstring). ``preemptions`` counts them.

Two decode paths, the same results: on CUDA the decode step runs ``cuda_decode.StaticDecoder`` (a
fixed-shape step over the static cache, rows = slots, replayed as CUDA graphs); elsewhere it runs
through the model with a per-step gather of each slot's cache (``static_decode=True`` selects the
static path on CPU too, without graphs: that is how the CPU tests check it). Sampling is
``sampling.sample`` for both: batched on the device, one transfer to the host per step.

The recorded log-probability is what ``modeling.logprobs_of`` computes: log-softmax of float32 logits divided by
the request's temperature (temperature 0 = greedy scales by 1), taken BEFORE top-p truncation; the
trainer recomputes the same quantity with ``modeling.token_logprobs``. A request with a ``grammar`` or
``top_k`` records it under the distribution it was drawn from: its logits masked to what the grammar
allows next (``grammar``: one xgrammar matcher per such request, the mask applied to its row after the
forward) and cut to its top_k, renormalised (``sampling``; the trainer's use: areal_bus/train/loss.py).
``top_logprobs`` are that distribution's most likely tokens; ``seed`` gives the request a generator of
its own.

``swap_weights`` runs between steps (the safe point): parameters are overwritten in place, running
sequences keep their cached keys/values (computed by the old weights) and carry on; every token
sampled afterwards is tagged with the new version. ``recompute_kv_on_swap=True`` instead re-prefills
running sequences under the new weights (as an engine that flushes its cache on update would).

Quick check::

    python -c "
    import numpy as np; from areal_bus.model.modeling import make_random_model, TINY_QWEN2
    from areal_bus.engines.torch_engine import TorchRolloutEngine; from areal_bus.wire.messages import GenerateRequest
    e = TorchRolloutEngine(make_random_model(TINY_QWEN2, 0, std=0.2), max_batch=2, max_len=64, eos_token_ids=[])
    e.add_request(GenerateRequest('r0', 'e0', 0, 0, 8, 0.0, np.array([1, 5, 7], np.int32)))
    while not (done := e.step()): pass
    print(done[0].output_ids, done[0].logprobs)"
"""

from __future__ import annotations

import heapq
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from areal_bus.engines.cuda_decode import static_decoder
from areal_bus.engines.kv_pages import PagedKVCache
from areal_bus.engines.sampling import sample, top_p_filter
from areal_bus.wire.messages import MAX_TOP_LOGPROBS, Completion, GenerateRequest, no_top_ids, no_top_logprobs
from areal_bus.model.adapters import load_weights
from areal_bus.model.modeling import CausalLM, KVCache, as_dtype, load_pretrained, load_safetensors

__all__ = ["TorchRolloutEngine", "make_output", "top_p_filter"]


@dataclass(slots=True)
class _Seq:
    req: GenerateRequest
    tokens: list[int]  # prompt followed by the output so far
    prompt_len: int
    stop_ids: frozenset[int]
    started_at: float
    slot: int = -1
    cached: int = 0  # leading tokens whose keys/values are in the slot's cache
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    matcher: object = None  # the grammar's xgrammar GrammarMatcher (None: unconstrained)
    grammar_stops: frozenset[int] = frozenset()  # the tokens that end its grammar (allowed once it is complete)
    generator: torch.Generator | None = None  # the request's own (its seed), else the engine's
    top: list[list[float]] = field(default_factory=list)  # per token: k top ids, then their k logprobs

    @property
    def n_out(self) -> int:
        return len(self.tokens) - self.prompt_len


PREFILL_SHARE = 4
"""Newcomers at least a quarter of the decoding batch are prefilled at once (see prefill_every)."""


class TorchRolloutEngine:
    """Continuous-batching generation over a ``CausalLM`` (a model object, or a checkpoint path).

    ``eos_token_ids``: ids that end a sequence (None: the checkpoint's ``eos_token_id``; []: none).
    ``weight_loader(location) -> state dict`` feeds ``swap_weights`` (default: safetensors at the
    path ``location``, a file or a directory). ``max_prefill_tokens`` bounds one prefill forward's
    padded size (rows x longest prompt); a longer prompt is prefilled alone. A model object passed in
    is used, moved and updated in place, not copied.

    ``static_decode`` (None: on CUDA only) decodes through ``cuda_decode.StaticDecoder``;
    ``cuda_graphs`` (None: whenever the static path runs on CUDA) replays its steps as CUDA graphs;
    ``attention`` ("sdpa", "matmul" or "flash_varlen"; "auto": flash_varlen on CUDA in half precision, else
    sdpa) is its attention kernel; ``fuse_decode`` fuses the step's elementwise work with torch.compile
    (rollout_engine.decode_compile; None: on CUDA); an automatic choice that refuses to run here falls back,
    through ``warn`` (``cuda_decode.static_decoder``); ``decode_buckets`` (batch sizes, lengths) its padded
    shapes (None: its defaults).

    ``tokenizer`` (a Hugging Face tokenizer or a folder; None: the checkpoint folder ``model``, if it is
    one) is what a request's grammar is compiled for (``grammar.Grammars``), when the first one comes.

    ``prefill_every`` (None: 8 on the static path, 1 otherwise): while sequences are decoding, a few
    newcomers wait up to this many decode steps to be prefilled together, unless they are at least
    ``1/PREFILL_SHARE`` of the running batch. A prefill runs eagerly (not as a graph) and costs several
    graph-replayed decode steps, so prefilling every multi-turn agent's next turn the step it arrives
    would make prefills most of the GPU's work; batching them trades a few decode steps of a new turn's
    latency for several times the throughput. 1 prefills every arrival at once.

    ``kv_tokens`` (None: a dense cache of ``max_batch x max_len``) sizes a paged cache
    (``kv_pages.PagedKVCache``) in tokens, in pages of ``kv_page_tokens``; ``max_batch`` still bounds the
    requests the engine holds, running or waiting for pages.
    """

    def __init__(self, model: CausalLM | str | Path, max_batch: int = 16, max_len: int = 2048,
                 device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32,
                 seed: int = 0, eos_token_ids: list[int] | None = None, worker: str = "rollout",
                 weight_loader: Callable[[str], dict[str, torch.Tensor]] | None = None,
                 version: int = 0, recompute_kv_on_swap: bool = False, max_prefill_tokens: int = 8192,
                 static_decode: bool | None = None, cuda_graphs: bool | None = None, attention: str = "auto",
                 fuse_decode: bool | None = None, decode_buckets: tuple[list[int], list[int]] | None = None,
                 prefill_every: int | None = None, warn: Callable[[str], None] | None = None, tokenizer=None,
                 kv_tokens: int | None = None, kv_page_tokens: int = 256):
        self.device = torch.device(device)
        dtype = as_dtype(dtype)
        if isinstance(model, (str, Path)):
            tokenizer = model if tokenizer is None else tokenizer
            model = load_pretrained(model, self.device, dtype)
        self.tokenizer = tokenizer
        self.grammars = None  # grammar.Grammars, made at the first request with a grammar
        self.token_mask = None  # grammar.TokenMask, the same
        self.model = model.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.cfg = model.cfg
        self.max_batch, self.max_len = max_batch, max_len
        self.worker = worker
        self.version = version
        self.recompute_kv_on_swap = recompute_kv_on_swap
        self.max_prefill_tokens = max_prefill_tokens
        if eos_token_ids is None:
            eos = self.cfg.eos_token_id
            eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.weight_loader = weight_loader or (lambda location: load_safetensors(location, self.device))
        self.cache = (KVCache(self.cfg, max_batch, max_len, self.device, dtype) if kv_tokens is None else
                      PagedKVCache(self.cfg, max_batch, max_len, kv_tokens, kv_page_tokens, self.device, dtype))
        self.paged = kv_tokens is not None
        self.preemptions = 0  # running sequences sent back to the queue for want of a page (paged cache)
        if static_decode is None:
            static_decode = self.device.type == "cuda"
        if cuda_graphs is None:
            cuda_graphs = static_decode and self.device.type == "cuda"
        batch_buckets, len_buckets = decode_buckets or (None, None)
        self.fast = (static_decoder(self.model, self.cache, graphs=cuda_graphs, attention=attention,
                                    fuse=fuse_decode, batch_buckets=batch_buckets, len_buckets=len_buckets,
                                    warn=warn or (lambda msg: warnings.warn(msg, RuntimeWarning, stacklevel=3)))
                     if static_decode else None)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.steps = 0
        self.prefill_every = max(1, prefill_every if prefill_every is not None else 8 if static_decode else 1)
        self._prefill_waited = 0  # decode steps the oldest unprefilled newcomer has waited
        # A heap: the lowest free slot goes first, so running slots stay dense (the static decode
        # step pads the batch to the highest running slot).
        self._free = list(range(max_batch))
        self._pending: list[_Seq] = []
        self._running: dict[str, _Seq] = {}

    # -- RolloutEngine interface ------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return len(self._free) - len(self._pending)

    @property
    def running_ids(self) -> list[str]:
        return list(self._running) + [s.req.request_id for s in self._pending]

    @property
    def in_cache(self) -> int:
        """Sequences in the running batch (holding cache), requests waiting for memory excluded."""
        return len(self._running)

    def add_request(self, req: GenerateRequest) -> None:
        prompt = [int(t) for t in np.asarray(req.prompt_ids).reshape(-1)]
        if self.free_slots <= 0:
            raise RuntimeError(f"no free slot for {req.request_id} (max_batch={self.max_batch})")
        if req.request_id in self._running or any(s.req.request_id == req.request_id for s in self._pending):
            raise ValueError(f"request {req.request_id} is already running")
        if not 1 <= len(prompt) < self.max_len:
            raise ValueError(f"request {req.request_id}: prompt of {len(prompt)} tokens, need 1..{self.max_len - 1}")
        if req.max_tokens < 1:
            raise ValueError(f"request {req.request_id}: max_tokens={req.max_tokens} < 1")
        # String stops need a tokenizer and are the gateway's to apply; ints are token ids.
        stops = frozenset(int(s) for s in req.stop if isinstance(s, (int, np.integer)))
        stops |= frozenset() if req.ignore_eos else self.eos_token_ids
        seq = _Seq(req, prompt, len(prompt), stops, time.time())
        check_options(req)
        if req.seed >= 0:
            seq.generator = torch.Generator(device=self.device).manual_seed(req.seed)
        if req.grammar:
            seq.matcher = self._grammar_matcher(req.grammar)
            seq.grammar_stops = frozenset(seq.matcher.stop_token_ids)
        self._pending.append(seq)

    def peek(self, request_id: str) -> list[int]:
        """The output ids a running request has so far ([] if it is not running)."""
        s = self._held(request_id)
        return s.tokens[s.prompt_len:] if s is not None else []

    def peek_top(self, request_id: str, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The top_ids and top_logprobs of the tokens ``peek`` gives, from output token ``start`` on
        (shape [0, 0] if the request asked for none or is not running)."""
        s = self._held(request_id)
        return top_arrays(s, start) if s is not None else (no_top_ids(), no_top_logprobs())

    def _held(self, request_id: str) -> _Seq | None:
        # a preempted sequence waits in the queue with the tokens it has
        s = self._running.get(request_id)
        return s if s is not None else next((p for p in self._pending if p.req.request_id == request_id), None)

    @torch.inference_mode()
    def step(self) -> list[Completion]:
        self._admit()
        if not self._running:
            return []
        seqs = list(self._running.values())
        # A sequence is either fresh (nothing cached: a newcomer, or all of it after a recompute
        # swap) or has exactly its last sampled token to feed. A one-token prompt is fed as a decode.
        fresh = sorted((s for s in seqs if s.cached == 0 and len(s.tokens) > 1), key=lambda s: len(s.tokens))
        decode = [s for s in seqs if len(s.tokens) - s.cached == 1]
        if fresh and decode and self._prefill_waited + 1 < self.prefill_every \
                and len(fresh) * PREFILL_SHARE < len(decode):
            self._prefill_waited += 1  # a few newcomers: let more gather while the others decode
            fresh = []
        elif fresh:
            self._prefill_waited = 0
        fed, logits = [], []
        for group in self._prefill_groups(fresh):
            logits.append(self._prefill_fresh(group))
            fed += group
        if decode:
            logits.append(self._decode(decode))
            fed += decode
        logits = torch.cat(logits) if len(logits) > 1 else logits[0]
        # Rows with a grammar: each matcher takes the row's last token (none yet after a prefill) and masks
        # the row, with the forward launched (on CUDA the host's work overlaps the GPU's), before sampling.
        constrained = [(i, s.matcher, s.tokens[-1] if s.n_out else None) for i, s in enumerate(fed)
                       if s.matcher is not None]
        if constrained:
            self.token_mask.apply(logits, constrained)
        top = max(s.req.top_logprobs for s in fed)
        out = sample(logits, [float(s.req.temperature) for s in fed], [float(s.req.top_p) for s in fed],
                     self.generator, top_ks=[s.req.top_k for s in fed] if any(s.req.top_k for s in fed) else None,
                     generators=[s.generator for s in fed] if any(s.generator for s in fed) else None, top=top)
        # One transfer to the host (token ids are exact in float64): per row its token, its logprob and,
        # when asked for, its top ids and their logprobs.
        parts = [out.tokens.double()[:, None], out.logprobs.double()[:, None]]
        if top:
            parts += [out.top_ids.double(), out.top_logprobs.double()]
        rows = torch.cat(parts, dim=1).tolist()
        self.steps += 1
        finished = []
        for s, row in zip(fed, rows):
            tok = int(row[0])
            s.tokens.append(tok)
            s.logprobs.append(row[1])
            s.versions.append(self.version)
            if s.req.top_logprobs:
                k = s.req.top_logprobs
                s.top.append(row[2:2 + k] + row[2 + top:2 + top + k])
            if tok in s.stop_ids or tok in s.grammar_stops:
                finished.append(self._finish(s, "stop"))
            elif s.n_out >= s.req.max_tokens or len(s.tokens) >= self.max_len:
                finished.append(self._finish(s, "length"))
        return finished

    def swap_weights(self, version: int, location: str) -> float:
        t0 = time.perf_counter()
        # The full weights, or with LoRA the adapter alone (model/adapters.py), copied in place; every name
        # and shape checked before touching a weight: a bad version must not half-swap.
        load_weights(self.model, self.weight_loader(location))
        if self.fast is not None:
            self.fast.refresh()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.version = version
        if self.recompute_kv_on_swap:
            for s in self._running.values():
                s.cached = 0
        return time.perf_counter() - t0

    # -- internals --------------------------------------------------------------------------

    def _admit(self) -> None:
        """Queued requests into the running batch. Dense: each takes a slot. Paged (the policy and why:
        kv_pages's docstring): first every running sequence gets the pages its tokens of this step need,
        oldest first, preempting the youngest while the pool has too few; then, unless that preempted,
        queued requests in order while a slot and their pages are free (the first that does not fit waits,
        and so do those behind it)."""
        if not self.paged:
            while self._pending:
                self._start(self._pending.pop(0), heapq.heappop(self._free))
            return
        preempted = False
        for s in list(self._running.values()):
            while s.slot >= 0 and not self.cache.grow(s.slot, len(s.tokens)):
                self._preempt(next(reversed(self._running.values())))
                preempted = True
        while self._pending and not preempted and self.cache.grow(self._free[0], len(self._pending[0].tokens)):
            self._start(self._pending.pop(0), heapq.heappop(self._free))

    def _start(self, seq: _Seq, slot: int) -> None:
        seq.slot = slot
        self._running[seq.req.request_id] = seq

    def _preempt(self, s: _Seq) -> None:
        """Back to the front of the queue, its pages and slot freed, its keys/values to be computed again
        (a prefill of all its tokens when it is admitted again)."""
        del self._running[s.req.request_id]
        self.cache.release(s.slot)
        heapq.heappush(self._free, s.slot)
        s.slot, s.cached = -1, 0
        self._pending.insert(0, s)
        self.preemptions += 1

    def _grammar_matcher(self, grammar: str):
        if self.grammars is None:
            # lazy: xgrammar (and the tokenizer it reads) cost a second or more to import and load; a
            # worker that never gets a grammar never pays it
            from areal_bus.engines.grammar import Grammars, TokenMask

            self.grammars = Grammars(self.tokenizer, self.cfg.vocab_size, sorted(self.eos_token_ids))
            self.token_mask = TokenMask(self.max_batch, self.cfg.vocab_size, self.device)
        return self.grammars.matcher(grammar)

    def _prefill_groups(self, fresh: list[_Seq]) -> list[list[_Seq]]:
        """Split length-sorted newcomers so each batch's padded size stays within the budget."""
        groups: list[list[_Seq]] = []
        for s in fresh:
            if groups and (len(groups[-1]) + 1) * len(s.tokens) <= self.max_prefill_tokens:
                groups[-1].append(s)
            else:
                groups.append([s])
        return groups

    def _prefill_fresh(self, seqs: list[_Seq]) -> torch.Tensor:
        """Prefill empty slots in one right-padded causal forward; logits [B, V] at each last token.

        Padding is harmless: a pad sits after its row's real tokens, so no real token attends to it,
        and the keys/values it writes land past the row's length, where decoding overwrites them
        before anything reads them."""
        lens = [len(s.tokens) for s in seqs]
        width = max(lens)
        ids = torch.tensor([s.tokens + [0] * (width - n) for s, n in zip(seqs, lens)], device=self.device)
        pos = torch.arange(width, device=self.device).expand(len(seqs), width)
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        h = self.model.hidden_states(ids, pos, cache=self.cache, slots=slots)
        for s in seqs:
            s.cached = len(s.tokens)
        last = torch.tensor(lens, device=self.device) - 1
        return self.model.lm_head(h[torch.arange(len(seqs), device=self.device), last])

    def _decode(self, seqs: list[_Seq]) -> torch.Tensor:
        """One batched forward of each sequence's last token; logits [B, V]."""
        if self.fast is not None:
            logits = self.fast.decode([s.slot for s in seqs], [s.tokens[-1] for s in seqs], [s.cached for s in seqs])
            for s in seqs:
                s.cached += 1
            return logits
        ids = torch.tensor([[s.tokens[-1]] for s in seqs], device=self.device)
        pos = torch.tensor([[s.cached] for s in seqs], device=self.device)
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        h = self.model.hidden_states(ids, pos, cache=self.cache, slots=slots)
        for s in seqs:
            s.cached += 1
        return self.model.lm_head(h[:, -1])

    def _finish(self, s: _Seq, reason: str) -> Completion:
        del self._running[s.req.request_id]
        if self.paged:
            self.cache.release(s.slot)
        heapq.heappush(self._free, s.slot)
        return make_output(s, reason, self.worker)


def check_options(req: GenerateRequest) -> None:
    """ValueError, naming the field, for sampling options out of their range (the codec bounds them on
    the wire; a request built in process, as the gateway's local backend does, is checked here)."""
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"request {req.request_id}: top_logprobs={req.top_logprobs}, need 0..{MAX_TOP_LOGPROBS}")
    if not -1 <= req.seed < 2**63:
        raise ValueError(f"request {req.request_id}: seed={req.seed}, need -1 (none) or 0..2**63-1")
    if req.top_k < 0:
        raise ValueError(f"request {req.request_id}: top_k={req.top_k}, need 0 (off) or more")


def top_arrays(s: _Seq, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(top_ids int32, top_logprobs float32), [tokens, k], of a sequence's output tokens from ``start``."""
    k = s.req.top_logprobs
    if not k:
        return no_top_ids(), no_top_logprobs()
    rows = s.top[start:]
    table = np.asarray(rows, dtype=np.float64).reshape(len(rows), 2 * k)
    return table[:, :k].astype(np.int32), table[:, k:].astype(np.float32)


def make_output(s: _Seq, finish_reason: str, worker: str) -> Completion:
    """The message a finished sequence becomes."""
    req = s.req
    top_ids, top_logprobs = top_arrays(s)
    return Completion(
        request_id=req.request_id, episode_id=req.episode_id, ticket=req.ticket, worker=worker,
        output_ids=np.asarray(s.tokens[s.prompt_len:], dtype=np.int32),
        logprobs=np.asarray(s.logprobs, dtype=np.float32),
        versions=np.asarray(s.versions, dtype=np.int32),
        finish_reason=finish_reason, gen_seconds=time.time() - s.started_at,
        top_ids=top_ids, top_logprobs=top_logprobs,
    )
