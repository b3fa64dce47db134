"""A rollout engine on vLLM: the same ``RolloutEngine`` interface as the torch engine, for throughput on
a CUDA host. An optional extra: ``pip install 'areal-bus[vllm]'``; select it with
``rollout_engine.kind: vllm`` and ``model.device: cuda`` in the topology.

Run on one H200 with vLLM 0.25.1 (2026-12-01; installed there by scripts/gpu-host/gpu_vllm.sh): the GPU tests
of tests/test_vllm_engine.py pass (logprobs against the trainer's recompute, a swap mid-request, the
prefix cache and its salt, a CUDA IPC swap from another process), and bench/engine.py --vllm and
bench/gpu_e2e.py --engine vllm measured it beside the torch engine (bench/RESULTS.md). The pure parts
below (request to sampling parameters, outputs to completions, version tags, engine arguments, weight
names and buffers) are also tested without vLLM, where CI runs. Serving LoRA adapters (the LoRA item
below) is written against vLLM 0.25.1's source and has not yet run on a GPU.

How it maps onto vLLM (v1 engine; written for vLLM >= 0.10.2, run on 0.25.1):

- Generation goes through ``vllm.LLMEngine`` (``from_engine_args`` / ``add_request`` / ``step``), the
  offline step-at-a-time engine (docs.vllm.ai: examples/offline_inference/llm_engine_example.py). The
  request id is ours (vLLM keeps the caller's id on ``RequestOutput.request_id``, vllm PR #27987), the
  prompt is token ids (``TokensPrompt``), and ``SamplingParams(logprobs=0, output_kind=DELTA)`` returns,
  per step, only the new tokens with the log-probability of each sampled token.
- Version tags are exact (tests/test_vllm_engine.py checks them on the GPU): one
  ``step()`` here is one model step and nothing runs between two calls: the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), asynchronous
  scheduling is off (it would return a batch one step late, across a swap) and outputs stream every
  step (``stream_interval=1``). A token returned by ``step()`` was computed by the weights in force
  when that ``step()`` ran, so it carries ``self.version``, and ``swap_weights`` (called between
  steps by the rollout node) changes both together.
- The recorded log-probability is vLLM's ``processed_logprobs`` mode: log-softmax of the float32
  logits after temperature (``modeling.logprobs_of``'s quantity, greedy scaled by 1). It equals what
  the torch engine records and the trainer recomputes whenever ``top_p == 1``. With ``top_p < 1``
  vLLM takes it after the nucleus cut, renormalised over the nucleus (the probability the token was
  actually drawn with), where the torch engine takes it before the cut: the two differ by the log of
  the nucleus' mass. Training episodes use ``rollout_engine.top_p`` (1.0 by default). ``top_k`` is in
  both engines' records of rows sampled at a temperature above 0, and so is a grammar's mask:
  vLLM's model runner applies the structured-output bitmask to the logits before its sampler, so
  even its raw logprobs are the masked distribution's, renormalised over the allowed tokens, as the
  torch engine records them (areal_bus/train/loss.py says how the trainer uses them).
- A request's options map onto ``SamplingParams`` (``sampling_spec``): ``grammar`` (xgrammar EBNF) to
  ``structured_outputs=StructuredOutputsParams(grammar=...)`` (vLLM >= 0.11; the older
  ``guided_decoding`` is gone from the vLLMs that run here: on a vLLM without the new class, or an engine
  that skips its tokenizer, a grammar request is refused, never run unconstrained);
  ``top_logprobs`` to ``logprobs`` (vLLM returns the sampled token and the k most likely, each with
  its rank, of the same processed distribution; ``top_arrays``); ``seed`` to ``seed`` (a generator of
  the request's own); ``top_k`` to ``top_k`` (0 is off in both).
- Weight updates use vLLM's worker extension and ``collective_rpc``, the route of vLLM's RLHF
  examples (examples/offline_inference/rlhf_utils.py, ``ColocateWorkerExtension``: tensors rebuilt from
  CUDA IPC handles inside the worker, then ``model_runner.model.load_weights`` and
  ``process_weights_after_loading``). Only plain data crosses the RPC: once, where the weights live
  (this run's shared-memory name, or the ``weights_cuda`` handles a trainer with CUDA buffers leaves in
  a file beside the ipc sockets); then, per version, the location string. vLLM's newer native weight transfer API (docs.vllm.ai/en/latest/training/weight_transfer,
  ``WeightTransferConfig(backend="ipc")``) sends pickled handles with every update
  (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), which this project refuses; ``weights_cuda``'s
  double-buffered handles are opened once instead. ``load_weights`` copies into vLLM's own (fused)
  parameters, so once the swap returns nothing reads the published buffer any more.
- Running sequences keep the keys/values the old weights computed (the torch engine's default).
  Prefix caching is on (``rollout_engine.prefix_caching``), so a multi-turn agent's next turn, whose
  prompt continues the tokens of its earlier turns, prefills only its new tokens. Every request carries a
  ``cache_salt`` naming the weights in force when it was added, and vLLM only matches a prefix between
  requests of the same salt: after a swap no new request reuses keys/values the older weights computed
  (a reset would have to wait for running requests, or preempt them; the salt needs neither, and the
  old blocks age out of the cache as any unused block does).
- Stops: ``ignore_eos`` plus an explicit ``stop_token_ids`` (the checkpoint config's ``eos_token_id``
  and the request's integer stops; the eos ids left out for a request with ``ignore_eos``), and vLLM's generation_config defaults are not loaded
  (``generation_config="vllm"``): the request alone says how to sample, as with the torch engine. The
  stop token is part of the output, as there.
- LoRA (``trainer_engine.lora``): vLLM's own LoRA layers serve the adapter, replaced in place from
  memory at each swap: areal_bus/engines/vllm_worker.py says how. Written against vLLM 0.25.1's source;
  NOT yet run on a GPU.

Limits: one GPU (no tensor parallelism), the first one the process sees (choose it with
``CUDA_VISIBLE_DEVICES``); the model families vLLM and ``modeling`` both know (Qwen2, Llama).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from areal_bus.engines.vllm_worker import (
    LORA_ARGS, adapter_shapes, changed_handles, check_held, checkpoint_shapes, lora_engine_args, lora_request,
    lora_spec,
)
from areal_bus.wire.messages import Completion, GenerateRequest, no_top_ids, no_top_logprobs

INSTALL_HINT = "pip install 'areal-bus[vllm]'"

EXTENSION_CLS = "areal_bus.engines.vllm_worker.WeightLoadExtension"
"""Fully qualified name vLLM imports and mixes into its worker class (``worker_extension_cls``)."""

DEFAULT_GPU_MEMORY_UTILIZATION = 0.5
"""vLLM takes this fraction of the GPU for weights, activations and KV cache. Not vLLM's 0.9: CUDA IPC
weights mean the trainer shares this GPU, and it needs room for the model, gradients and optimizer."""

_REQUIRED_ARGS = frozenset({
    "model", "dtype", "seed", "max_model_len", "max_num_seqs", "gpu_memory_utilization",
    "enable_prefix_caching", "logprobs_mode", "worker_extension_cls", "generation_config", "disable_log_stats",
})
"""Engine arguments the exactness of logprobs, stops and weights depends on: a vLLM without one is too old."""


# -- requests and outputs (pure) --------------------------------------------------------------------


def prompt_of(req: GenerateRequest, max_len: int) -> list[int]:
    """The request's prompt as ints; ValueError, naming the request, for what the torch engine refuses too."""
    prompt = [int(t) for t in np.asarray(req.prompt_ids).reshape(-1)]
    if not 1 <= len(prompt) < max_len:
        raise ValueError(f"request {req.request_id}: prompt of {len(prompt)} tokens, need 1..{max_len - 1}")
    if req.max_tokens < 1:
        raise ValueError(f"request {req.request_id}: max_tokens={req.max_tokens} < 1")
    return prompt


def sampling_spec(req: GenerateRequest, eos_token_ids: Iterable[int]) -> dict:
    """``SamplingParams`` keyword arguments for ``req`` (all but ``output_kind``, an enum of vLLM's).

    String stops need a tokenizer and are the gateway's to apply; integer stops are token ids."""
    stops = {int(s) for s in req.stop if isinstance(s, (int, np.integer)) and not isinstance(s, bool)}
    spec = {
        "n": 1, "temperature": float(req.temperature), "top_p": float(req.top_p), "max_tokens": int(req.max_tokens),
        # 0 = only the sampled token's log-probability; k = it and the k most likely
        "logprobs": int(req.top_logprobs), "top_k": int(req.top_k), "seed": None if req.seed < 0 else int(req.seed),
        "ignore_eos": True, "stop_token_ids": sorted(stops | (set() if req.ignore_eos else {int(t) for t in eos_token_ids})),
        "detokenize": False,  # token ids are the product; text would cost CPU per step
    }
    if req.grammar:  # StructuredOutputsParams keyword arguments (a class of vLLM's: the engine makes it)
        spec["structured_outputs"] = {"grammar": req.grammar}
    return spec


def sampled_logprobs(token_ids: list[int], logprobs) -> list[float]:
    """The log-probability of each sampled token, from a ``CompletionOutput.logprobs`` sequence (one
    ``{token_id: Logprob}`` mapping per token; more entries when top-k logprobs were asked for)."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise ValueError(f"vLLM returned {'no' if logprobs is None else len(logprobs)} logprob entries for "
                         f"{len(token_ids)} tokens (SamplingParams.logprobs must be 0, or the top_logprobs asked for)")
    out = []
    for tok, entry in zip(token_ids, logprobs):
        lp = entry.get(tok) if entry is not None else None
        if lp is None:
            raise ValueError(f"vLLM returned no logprob for sampled token {tok}")
        out.append(float(getattr(lp, "logprob", lp)))
    return out


def top_arrays(token_ids: list[int], logprobs, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """Per token, the ids and log-probabilities of the ``k`` most likely tokens, most likely first, from
    a ``CompletionOutput.logprobs`` sequence asked for with ``logprobs=k`` (each mapping holds them, by
    ``rank`` 1..k, and the sampled token, with its own rank, when it is not one of them)."""
    ids, lps = [], []
    for tok, entry in zip(token_ids, logprobs):
        ranked = sorted(((lp.rank if lp.rank is not None else float("inf"), -lp.logprob, t, lp.logprob)
                         for t, lp in (entry or {}).items()))[:k]
        if len(ranked) < k:
            raise ValueError(f"vLLM returned {len(ranked)} top logprobs for token {tok}, {k} were asked for")
        ids.append([int(t) for _, _, t, _ in ranked])
        lps.append([float(lp) for _, _, _, lp in ranked])
    return ids, lps


@dataclass(slots=True)
class Generation:
    """One running request: what it has produced so far, the version of each token and, when the
    request asked for them, each token's top ids and their logprobs."""

    req: GenerateRequest
    started_at: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def top(self, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(top_ids int32, top_logprobs float32) [tokens, k] from output token ``start`` on; [0, 0]
        when the request asked for none."""
        k = self.req.top_logprobs
        if not k:
            return no_top_ids(), no_top_logprobs()
        n = max(0, len(self.top_ids) - start)
        return (np.asarray(self.top_ids[start:], dtype=np.int32).reshape(n, k),
                np.asarray(self.top_logprobs[start:], dtype=np.float32).reshape(n, k))

    def completion(self, finish_reason: str, worker: str) -> Completion:
        req = self.req
        top_ids, top_logprobs = self.top()
        return Completion(
            request_id=req.request_id, episode_id=req.episode_id, ticket=req.ticket, worker=worker,
            output_ids=np.asarray(self.tokens, dtype=np.int32), logprobs=np.asarray(self.logprobs, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int32), finish_reason=finish_reason,
            gen_seconds=time.time() - self.started_at, top_ids=top_ids, top_logprobs=top_logprobs,
        )


def absorb_outputs(running: dict[str, Generation], outputs, version: int, worker: str) -> list[Completion]:
    """Fold one step's ``RequestOutput``s (DELTA kind: only the tokens new this step) into ``running``,
    tagging every new token with ``version``; finished requests leave ``running`` as Completions."""
    finished = []
    for out in outputs:
        gen = running.get(out.request_id)
        if gen is None:  # not one of ours: this engine adds every request it steps, so never expected
            continue
        comp = out.outputs[0]
        new = [int(t) for t in comp.token_ids]
        gen.logprobs += sampled_logprobs(new, comp.logprobs)
        if gen.req.top_logprobs:
            ids, lps = top_arrays(new, comp.logprobs, gen.req.top_logprobs)
            gen.top_ids += ids
            gen.top_logprobs += lps
        gen.tokens += new
        gen.versions += [version] * len(new)
        if out.finished:
            del running[out.request_id]
            # vLLM says "stop" for a stop token and "length" for max_tokens or the model length.
            finished.append(gen.completion(str(comp.finish_reason or "length"), worker))
    return finished


# -- engine arguments (pure) -------------------------------------------------------------------------


def engine_kwargs(model_path: str | Path, *, max_batch: int, max_len: int, dtype: str, seed: int,
                  gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION, prefix_caching: bool = True,
                  skip_tokenizer_init: bool = False, lora: Mapping | None = None) -> dict:
    """``vllm.EngineArgs`` keyword arguments: the model, our limits, and what exact tags need.

    ``skip_tokenizer_init``: vLLM loads no tokenizer (prompts are token ids and nothing is detokenized
    here; a checkpoint with random weights and no tokenizer files can be served). ``lora``: ``lora_spec``
    of trainer_engine.lora, to serve its adapters (one at a time: every request names the same one)."""
    return lora_engine_args(lora) | {
        "model": str(model_path), "dtype": dtype, "seed": seed,
        "max_model_len": max_len, "max_num_seqs": max_batch, "gpu_memory_utilization": gpu_memory_utilization,
        # Each request carries its weights' cache salt (VllmRolloutEngine.add_request), so a prefix is
        # reused only by requests that started under the same loaded weights.
        "enable_prefix_caching": prefix_caching,
        "logprobs_mode": "processed_logprobs",  # after temperature, as modeling.logprobs_of (module docstring)
        "worker_extension_cls": EXTENSION_CLS,
        "generation_config": "vllm",  # no sampling defaults from generation_config.json: the request decides
        "disable_log_stats": True,
        "async_scheduling": False,  # would hand back a step's tokens one step() later, across a swap
        "stream_interval": 1,  # every step's tokens in that step's outputs, none held back
        "skip_tokenizer_init": skip_tokenizer_init,
    }


def fit_engine_args(kwargs: dict, known: Iterable[str]) -> dict:
    """``kwargs`` restricted to the fields this vLLM's EngineArgs has. A missing optional field is
    dropped (vLLMs that predate it behave as asked: no asynchronous scheduling, streaming every step);
    a missing required one means a vLLM too old for exact tags, and is an error."""
    known = set(known)
    missing = sorted((_REQUIRED_ARGS | LORA_ARGS) & (set(kwargs) - known))
    if missing:
        need = "0.25.1 (its LoRA arguments)" if set(missing) & LORA_ARGS else ">= 0.10.2"
        raise RuntimeError(f"this vLLM's EngineArgs lacks {', '.join(missing)}: vLLM {need} is needed "
                           f"({INSTALL_HINT})")
    return {k: v for k, v in kwargs.items() if k in known}


def served_facts(model_path: str | Path) -> tuple[bool, list[int]]:
    """(whether the checkpoint's lm_head is its embedding, its eos ids), from its config.json as
    transformers reads it (class defaults included): any architecture vLLM and the trainer's
    transformers model serve, not only those areal_bus.model.modeling's own decoder runs."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    text = cfg.get_text_config()  # a multimodal checkpoint's language model
    tied = getattr(cfg, "tie_word_embeddings", None)
    eos = getattr(text, "eos_token_id", None)
    return bool(getattr(text, "tie_word_embeddings", False) if tied is None else tied), \
        eos_ids(getattr(cfg, "eos_token_id", None) if eos is None else eos)


def eos_ids(eos) -> list[int]:
    """A config's ``eos_token_id`` (None, an int or a list) as a list."""
    return [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]


# -- the engine --------------------------------------------------------------------------------------


def cache_salt(weights_loaded: int) -> str:
    """vLLM's per-request prefix-cache salt for the ``weights_loaded``-th weights this engine serves.
    vLLM mixes the salt into the hash of a prompt's first block, so the chain of block hashes, and any
    prefix hit, is only ever shared by requests with the same salt: a request added after a swap never
    reuses keys/values computed by the weights before it (a counter, not the version: a new lineage
    starts its versions again at 0)."""
    return f"w{weights_loaded}"


@dataclass(slots=True)
class PrefillStats:
    """Prompt tokens added and how many of them vLLM served from its prefix cache (``num_cached_tokens``
    of each request's first output): ``prompt_tokens - cached_tokens`` were prefilled."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def import_vllm():
    """vLLM, imported for an engine that steps in this process (see the module docstring)."""
    # Set before vLLM reads its environment. Forced, not defaulted: with the engine core in a
    # background process, step() would return tokens computed before a swap after it.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"rollout_engine.kind 'vllm' needs vLLM, which is not installed ({exc}); "
                          f"on a CUDA host: {INSTALL_HINT}") from exc
    return vllm


class VllmRolloutEngine:
    """``RolloutEngine`` over vLLM's ``LLMEngine``, for the checkpoint folder ``model_path``.

    ``weights``: where published versions come from (``WeightFeed.attach``); more can be attached
    later with ``attach_weights``. ``cuda_handles_file``: where a trainer with CUDA buffers leaves their
    handles (``weights_cuda.handles_path``); read at the first ``cuda:`` location and again whenever it
    changes. ``lora``: trainer_engine.lora (a ``LoraConfig``), when every version is an adapter on the
    checkpoint's weights (module docstring)."""

    def __init__(self, model_path: str | Path, *, max_batch: int = 16, max_len: int = 2048, dtype: str = "bfloat16",
                 seed: int = 0, worker: str = "rollout", version: int = 0, eos_token_ids: list[int] | None = None,
                 gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION, weights: Mapping | None = None,
                 cuda_handles_file: str | Path | None = None, prefix_caching: bool = True,
                 skip_tokenizer_init: bool = False, lora=None):
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._vllm, self._prompt, self._delta = vllm, TokensPrompt, RequestOutputKind.DELTA
        try:
            from vllm.sampling_params import StructuredOutputsParams
        except ImportError:  # a vLLM before 0.11: its guided_decoding is not supported here; grammars are refused
            StructuredOutputsParams = None
        self._structured = StructuredOutputsParams
        self.skip_tokenizer_init = skip_tokenizer_init
        self.tied, eos = served_facts(model_path)
        self.eos_token_ids = eos if eos_token_ids is None else [int(t) for t in eos_token_ids]
        self.lora = lora_spec(lora)
        shapes = checkpoint_shapes(model_path)
        if self.lora is not None:  # every version is an adapter of these shapes
            shapes = adapter_shapes(shapes, self.lora["target_modules"], self.lora["rank"])
        self.expected = {k: list(v) for k, v in shapes.items()}
        self.max_batch, self.max_len, self.worker, self.version = max_batch, max_len, worker, version
        kwargs = engine_kwargs(model_path, max_batch=max_batch, max_len=max_len, dtype=dtype, seed=seed,
                               gpu_memory_utilization=gpu_memory_utilization, prefix_caching=prefix_caching,
                               skip_tokenizer_init=skip_tokenizer_init, lora=self.lora)
        args = fit_engine_args(kwargs, (f.name for f in dataclasses.fields(vllm.EngineArgs)))
        self.llm = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**args))
        self._lora_request = None
        if self.lora is not None:
            # Registered (the zero adapter) before the first request names it: vLLM never looks at the path.
            self.llm.collective_rpc("areal_bus_serve_lora", args=(self.lora, self.expected))
            check_held(self.llm)
            self._lora_request = lora_request()
        self.steps = 0
        self.weights_loaded = 0  # swaps so far: the cache salt of the weights in force (cache_salt)
        self.prefill = PrefillStats()
        self._running: dict[str, Generation] = {}
        self._uncounted: set[str] = set()  # running requests whose prefix-cache hit is not yet known
        self.cuda_handles_file, self._handles_stamp = cuda_handles_file, None
        if weights is not None:
            self.attach_weights(weights)

    def attach_weights(self, source: Mapping) -> None:
        """Open a weight source in vLLM's worker: ``{"kind": "shm", "name": ...}`` or
        ``{"kind": "cuda", "handles": CudaWeightWriter.handles()}`` (plain data only crosses)."""
        self.llm.collective_rpc("areal_bus_attach", args=(dict(source), self.expected, self.tied,
                                                          "weight set" if self.lora is None else "adapter"))

    # -- RolloutEngine interface ------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self._running)

    @property
    def running_ids(self) -> list[str]:
        return list(self._running)

    def add_request(self, req: GenerateRequest) -> None:
        if self.free_slots <= 0:
            raise RuntimeError(f"no free slot for {req.request_id} (max_batch={self.max_batch})")
        if req.request_id in self._running:
            raise ValueError(f"request {req.request_id} is already running")
        prompt = prompt_of(req, self.max_len)
        spec = sampling_spec(req, self.eos_token_ids)
        if "structured_outputs" in spec:
            spec["structured_outputs"] = self._structured_outputs(req, spec["structured_outputs"])
        params = self._vllm.SamplingParams(**spec, output_kind=self._delta)
        self.llm.add_request(req.request_id, self._prompt(prompt_token_ids=prompt, cache_salt=cache_salt(self.weights_loaded)),
                             params, lora_request=self._lora_request)
        self._running[req.request_id] = Generation(req, time.time())
        self._uncounted.add(req.request_id)
        self.prefill.requests += 1
        self.prefill.prompt_tokens += len(prompt)

    def peek(self, request_id: str) -> list[int]:
        """The output ids a running request has so far ([] if it is not running)."""
        gen = self._running.get(request_id)
        return list(gen.tokens) if gen is not None else []

    def peek_top(self, request_id: str, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The top_ids and top_logprobs of ``peek``'s tokens from ``start`` on ([0, 0] if none)."""
        gen = self._running.get(request_id)
        return gen.top(start) if gen is not None else (no_top_ids(), no_top_logprobs())

    def _structured_outputs(self, req: GenerateRequest, kwargs: dict):
        """vLLM's StructuredOutputsParams for a request's grammar; ValueError where this engine cannot
        honour one (the rollout node answers it as the request's error: never run unconstrained)."""
        if self._structured is None:
            raise ValueError(f"request {req.request_id}: grammar needs vLLM >= 0.11 (StructuredOutputsParams); "
                             f"this vLLM is {getattr(self._vllm, '__version__', '?')}")
        if self.skip_tokenizer_init:
            raise ValueError(f"request {req.request_id}: grammar needs the tokenizer, which this engine skips "
                             "(skip_tokenizer_init)")
        return self._structured(**kwargs)

    def step(self) -> list[Completion]:
        if not self._running:
            return []
        outputs = self.llm.step()
        self.steps += 1
        for out in outputs:  # a request's hit is known from its first output on
            if out.request_id in self._uncounted:
                self._uncounted.discard(out.request_id)
                self.prefill.cached_tokens += int(out.num_cached_tokens or 0)
        return absorb_outputs(self._running, outputs, self.version, self.worker)

    def swap_weights(self, version: int, location: str) -> float:
        """Load ``location`` into vLLM's parameters (with LoRA: its adapter into vLLM's LoRA layers)
        between two steps; running sequences carry on."""
        t0 = time.perf_counter()
        if location.startswith("cuda:") and self.cuda_handles_file is not None:
            self._handles_stamp, handles = changed_handles(self.cuda_handles_file, self._handles_stamp)
            if handles is not None:
                self.attach_weights({"kind": "cuda", "handles": handles})
        self.llm.collective_rpc("areal_bus_load", args=(location,))
        if self.lora is not None:
            check_held(self.llm)
        self.version = version
        self.weights_loaded += 1  # requests added from now on reuse no keys/values of the old weights
        return time.perf_counter() - t0


def engine_from_topology(topo, worker: str, replica: int, base=None) -> VllmRolloutEngine:
    """The rollout node's vLLM engine: the topology's model and limits, fed with what the trainer
    publishes: shared-memory buffers, or CUDA buffers whose handles it leaves next to the ipc sockets
    (with trainer_engine.lora, the adapter alone)."""
    from areal_bus.weights.cuda import handles_path  # lazy: torch (see changed_handles)

    cfg, model = topo.rollout_engine, topo.model
    path = topo.model_path(base)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model.path {path} holds no checkpoint (config.json)")
    # model.device is 'cuda' or 'cuda:0' here: the topology refuses anything else for this engine.
    return VllmRolloutEngine(path, max_batch=cfg.max_batch, max_len=cfg.max_len, dtype=model.dtype,
                             seed=model.seed * 1000 + replica, worker=worker,
                             gpu_memory_utilization=cfg.gpu_memory_utilization, prefix_caching=cfg.prefix_caching,
                             weights={"kind": "shm", "name": topo.shm_name(base)},
                             cuda_handles_file=handles_path(topo.ipc_dir(base), topo.shm_name(base)),
                             lora=getattr(topo.trainer_engine, "lora", None))
