"""What the vLLM rollout engine (areal_bus/engines/vllm_engine.py) runs inside vLLM's worker: the weight
feed each version is loaded from (shared memory or CUDA IPC, checked against the served checkpoint before
any tensor is copied) and the worker extension vLLM mixes in (``WeightLoadExtension``); and LoRA.

LoRA: with ``trainer_engine.lora`` every version is the adapter alone, the trainer's "<module>.lora_A.weight" [rank,
in] and "<module>.lora_B.weight" [out, rank] (Hugging Face module names, model.dtype), through the same weight
feed as full weights, never a file. The engine turns on vLLM's own LoRA (``enable_lora``, ``max_loras=1``,
``max_lora_rank`` the smallest of vLLM's ranks that holds ours, ``lora_target_modules`` our targets, so vLLM
wraps exactly those layers) and every request carries one ``LoRARequest`` of a fixed id (``LORA_ID``). Before
the engine takes a request, the worker registers the zero adapter (B = 0: version 0 is the base) under that id
and pins it. A swap checks the adapter's names and shapes against the checkpoint's projections
(``adapter_shapes``, from its safetensors headers) before touching anything, then installs it in place under
the same id as vLLM's own in-place reload does (``LRUCacheWorkerLoRAManager.add_adapter`` with
``load_inplace``), but from the tensors in memory: ``LoRAModel.from_lora_tensors`` (peft's names,
``base_model.model.``..., the model's ``hf_to_vllm_mapper`` without its stacking, as vLLM's loader), then the
model manager's ``remove_adapter``, ``add_adapter`` (which packs q/k/v and gate/up and folds alpha / rank into
lora_B once, ``LoRALayerWeights.optimize``), ``activate_adapter`` (each LoRA layer's ``set_lora`` copies into
its slot's buffers in place, which CUDA graphs read by address) and ``pin_adapter``. The tensors handed to
vLLM are this worker's own copies (the scaling is in place and must never reach the published buffer). An
adapter tensor no LoRA layer of vLLM takes (vLLM would skip it and serve the base there) is refused. vLLM
loads an adapter from its request's path when it does not hold the id; ours is an absolute path where nothing
is (``LORA_PATH``: never a hub download, and a load from it fails loudly), and after every swap the engine
checks, through ``LLMEngine.list_loras``, that the id is still registered. The prefix-cache salt changes at
every swap, as for full weights. vLLM's internals this relies on, read from vLLM 0.25.1's source (its wheel's
vllm/lora/*.py and vllm/v1/worker/lora_model_runner_mixin.py): the model runner's ``lora_manager`` and its
``_adapter_manager`` (``modules``, ``packed_modules``, ``lora_config``, ``device``, ``model``,
``add_adapter``, ``remove_adapter``, ``activate_adapter``, ``pin_adapter``),
``vllm.lora.lora_model.LoRAModel.from_lora_tensors``, ``vllm.lora.peft_helper.PEFTHelper`` and
``WeightsMapper.get_unstacked_mapper``; a vLLM without one is refused, naming it. vLLM's LoRA kernels take
bfloat16 or float16 only (the topology refuses model.dtype float32 with LoRA). Written against vLLM 0.25.1's
source; this LoRA path has NOT yet run on a GPU. The pure parts (ranks, shapes, names, refusals) are tested
without vLLM (tests/test_vllm_lora.py), beside the GPU tests its first run must pass.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes for ``max_lora_rank`` (``MaxLoRARanks`` in vLLM 0.25.1's vllm/config/lora.py). Its
LoRA layers hold an adapter in buffers of that rank, zero past ours, so any rank up to the largest is
served exactly; above it, none."""

LORA_ID = 1000
"""The id of the one adapter every request names. Not 1..max_loras: the ids vLLM's start-up warm-up gives
its dummy adapters (removed again before the engine takes requests)."""
LORA_NAME = "areal-bus-policy"
LORA_PATH = "/nonexistent/areal-bus/adapter-in-memory"
"""The path ``LoRARequest`` must carry, where nothing is: the adapter only ever comes from memory. Absolute,
because vLLM takes a relative path that does not exist for a Hugging Face repository and downloads it."""


LORA_ARGS = frozenset({"enable_lora", "max_loras", "max_lora_rank", "lora_target_modules"})
"""Engine arguments of a LoRA engine (vLLM 0.25.1's names), required when LoRA is asked for."""


def lora_engine_args(spec: Mapping | None) -> dict:
    """``vllm.EngineArgs`` keyword arguments that serve adapters of ``spec`` (``lora_spec``; {} for None): one at
    a time (every request names the same one), LoRA layers where the trainer has adapters only."""
    if spec is None:
        return {}
    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": max_lora_rank(spec["rank"]),
            "lora_target_modules": list(spec["target_modules"])}


def lora_request():
    """The ``LoRARequest`` every request carries: the one adapter, by its fixed id."""
    from vllm.lora.request import LoRARequest  # lazy: vLLM, where an engine runs

    return LoRARequest(lora_name=LORA_NAME, lora_int_id=LORA_ID, lora_path=LORA_PATH)


def check_held(llm) -> None:
    """vLLM's worker loads an adapter from its request's path when it does not hold the request's id; ours
    has no path, so the id must still be registered (``LLMEngine.list_loras``, public)."""
    held = llm.list_loras()
    if LORA_ID not in held:
        raise RuntimeError(f"vLLM no longer holds the adapter (id {LORA_ID}; it holds {sorted(held)}): a request "
                           f"would make it load {LORA_PATH}, where nothing is")


def lora_spec(lora) -> dict | None:
    """What the engine and its worker need of trainer_engine.lora (``LoraConfig``), as plain data: rank,
    alpha (scale x rank, as the trainer's peft config) and target_modules; None for full fine-tuning."""
    if lora is None:
        return None
    return {"rank": int(lora.rank), "alpha": float(lora.scale * lora.rank), "target_modules": list(lora.target_modules)}


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM takes that holds adapters of ``rank``; ValueError, naming the
    field, past vLLM's largest."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"trainer_engine.lora.rank {rank}: vLLM serves adapters of rank {VLLM_LORA_RANKS[-1]} at "
                         f"most (its max_lora_rank takes {', '.join(map(str, VLLM_LORA_RANKS))})")
    return fits[0]


def adapter_shapes(checkpoint: Mapping[str, Iterable[int]], targets: Iterable[str],
                   rank: int) -> dict[str, tuple[int, int]]:
    """{published name: shape} of the adapter the trainer publishes for a checkpoint whose tensors have
    the shapes ``checkpoint`` (``checkpoint_shapes``): for every targeted projection's weight
    "<module>.weight" [out, in], "<module>.lora_A.weight" [rank, in] and "<module>.lora_B.weight" [out, rank]
    (peft's adapters on the same layers, areal_bus/train/lora.py). ValueError naming a target that is no
    layer of the checkpoint."""
    targets = list(targets)
    out, found = {}, set()
    for name, shape in checkpoint.items():
        module, _, leaf = name.rpartition(".")
        kind = module.rpartition(".")[2]
        if leaf != "weight" or kind not in targets or len(tuple(shape)) != 2:
            continue
        rows, cols = tuple(shape)
        out[f"{module}.lora_A.weight"] = (rank, cols)
        out[f"{module}.lora_B.weight"] = (rows, rank)
        found.add(kind)
    absent = [t for t in targets if t not in found]
    if absent:
        raise ValueError(f"trainer_engine.lora.target_modules: the checkpoint has no {', '.join(absent)} layer")
    return dict(sorted(out.items()))


def zero_adapter(shapes: Mapping[str, Iterable[int]]) -> list[tuple[str, object]]:
    """The adapter served before the first version: zeros of ``shapes`` (``adapter_shapes``), so that
    B = 0 and version 0 is the base, as peft's initialisation makes it on the trainer's side."""
    import torch  # lazy (see changed_handles)

    return [(k, torch.zeros(tuple(v))) for k, v in shapes.items()]


def lora_module(name: str) -> str:
    """The module a published adapter tensor belongs to ("...q_proj.lora_A.weight" -> "...q_proj")."""
    for leaf in (".lora_A.weight", ".lora_B.weight"):
        if name.endswith(leaf):
            return name[:-len(leaf)]
    raise ValueError(f"{name!r} is not an adapter tensor (<module>.lora_A.weight or <module>.lora_B.weight)")


def vllm_lora_name(name: str) -> str:
    """A published adapter tensor's name as vLLM's adapter loader reads it: peft's saved name (what an
    adapter_model.safetensors holds), the Hugging Face name under "base_model.model.", which vLLM strips
    before it maps the module to its own (``parse_fine_tuned_lora_name``)."""
    from areal_bus.train.lora import PEFT_PREFIX  # lazy: torch (see changed_handles)

    lora_module(name)  # refuses what is not an adapter tensor
    return PEFT_PREFIX + name


def unserved_modules(modules: Iterable[str], wrapped: Iterable[str], packed: Mapping[str, Iterable[str]]) -> list[str]:
    """The adapter's modules that no LoRA layer of vLLM takes: ``wrapped`` are the modules vLLM made LoRA
    layers of, ``packed`` their parts where one layer runs several projections (qkv_proj: q_proj, k_proj,
    v_proj). vLLM skips the tensors of any other module without a word and serves the base there."""
    takes = set(wrapped) | {part for parts in packed.values() for part in parts}
    return sorted(set(modules) - takes)


# -- weights (pure of vLLM) ---------------------------------------------------------------------------


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a checkpoint folder's ``*.safetensors``, from the file headers
    (an 8-byte little-endian length, then JSON), without reading any tensor."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    shapes = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        shapes |= {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    return shapes


def check_layout(got: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], tied: bool,
                 what: str = "weight set") -> None:
    """Raise ValueError naming what differs between a published weight set (``what``: or an adapter) and
    what the checkpoint vLLM loaded expects. Checked before any tensor is copied: a wrong weight set must
    not half-swap the model.

    Our names are Hugging Face's, which is what vLLM's ``load_weights`` takes (it fuses q/k/v and
    gate/up itself). A tied ``lm_head`` is the embedding (vLLM skips it); ``rotary_emb.inv_freq`` in
    old checkpoints is not a weight."""
    def norm(d):
        return {k: tuple(v) for k, v in d.items()
                if "rotary_emb.inv_freq" not in k and not (tied and k == "lm_head.weight")}

    got, expected = norm(got), norm(expected)
    missing, unknown = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
    if missing or unknown or wrong:
        parts = [f"{what} {names[:5]}{' ...' if len(names) > 5 else ''}"
                 for what, names in (("missing", missing), ("unknown", unknown), ("wrong shape", wrong)) if names]
        raise ValueError(f"{what} does not match the served checkpoint: " + "; ".join(parts))


def weight_items(views: Mapping, tied: bool) -> list[tuple[str, object]]:
    """``(name, tensor)`` pairs for ``load_weights``, in the publisher's order."""
    return [(k, t) for k, t in views.items() if not (tied and k == "lm_head.weight")]


def handles_on_device(handles: Mapping, index: int) -> dict:
    """``weights_cuda`` handles with every buffer's device replaced by ``index``, this process's index of
    the same GPU: processes with different CUDA_VISIBLE_DEVICES number it differently (vLLM's
    rlhf_utils.rebuild_ipc makes the same substitution)."""
    return {**handles, "buffers": [{**b, "device": int(index)} for b in handles["buffers"]]}


def changed_handles(path: str | Path, stamp: int | None) -> tuple[int, dict | None]:
    """The trainer's CUDA handles file (``weights_cuda.save_handles``) if it changed since ``stamp``
    (its mtime in ns when last read), else None; and its current stamp."""
    # lazy (here and below): this module imports without torch, as a host without vLLM reads it; the
    # weight readers import torch
    from areal_bus.weights.cuda import load_handles

    now = Path(path).stat().st_mtime_ns
    return now, (None if now == stamp else load_handles(path))


class WeightFeed:
    """Where published weights come from, inside vLLM's worker: the run's shared-memory buffers, or a
    trainer's CUDA IPC buffers (opened once; ``weights_cuda``). ``items(location)`` gives the tensors of
    one version, checked against the checkpoint; ``done(location)`` lets the version go once copied.
    ``what`` names a version in errors: a "weight set", or with LoRA an "adapter"."""

    def __init__(self, expected: Mapping[str, Iterable[int]], tied: bool, what: str = "weight set"):
        self.expected = {k: tuple(v) for k, v in expected.items()}
        self.tied = tied
        self.what = what
        self.shm = None  # ShmWeightReader
        self.cuda = None  # CudaWeightReader

    def attach(self, source: Mapping, device_index: int | None = None) -> None:
        """``{"kind": "shm", "name": <weight set>}`` or ``{"kind": "cuda", "handles": <CudaWeightWriter.handles()>}``."""
        kind = source.get("kind")
        if kind == "shm":
            from areal_bus.weights.shm import ShmWeightReader  # lazy: torch (see changed_handles)
            self.shm = ShmWeightReader(source["name"])
        elif kind == "cuda":
            from areal_bus.weights.cuda import CudaWeightReader  # lazy: torch (see changed_handles)
            handles = source["handles"]
            if self.cuda is not None:  # a restarted trainer exported new buffers: the old ones are gone
                self.cuda.close()
            self.cuda = CudaWeightReader(handles if device_index is None else handles_on_device(handles, device_index))
        else:
            raise ValueError(f"unknown weight source kind {kind!r} (shm or cuda)")

    def _reader(self, location: str):
        scheme = location.split(":", 1)[0]
        reader = {"shm": self.shm, "cuda": self.cuda}.get(scheme)
        if reader is None:
            raise ValueError(f"no {scheme} weight source attached for {location!r}: "
                             f"attach_weights({{'kind': '{scheme}', ...}}) first")
        return reader

    def items(self, location: str) -> list[tuple[str, object]]:
        views = self._reader(location).open(location)
        check_layout({k: tuple(t.shape) for k, t in views.items()}, self.expected, self.tied, self.what)
        return weight_items(views, self.tied)

    def done(self, location: str) -> None:
        reader = self._reader(location)
        if reader is self.shm:  # copied into vLLM's parameters: this worker no longer needs the buffer
            reader.release(int(location.rsplit("@", 1)[1]))


_MANAGER_NEEDS = ("model", "modules", "packed_modules", "lora_config", "device",
                  "add_adapter", "remove_adapter", "activate_adapter", "pin_adapter")
"""What the LoRA swap uses of vLLM's LoRA model manager (``LRUCacheLoRAModelManager``, vLLM 0.25.1)."""


def _vllm_version() -> str:
    import vllm  # lazy: inside vLLM's worker only

    return getattr(vllm, "__version__", "?")


def lora_model_manager(model_runner):
    """vLLM's LoRA model manager inside the worker: the model runner's ``lora_manager`` (the worker's
    ``LRUCacheWorkerLoRAManager``) and its ``_adapter_manager``, internals of vLLM read from 0.25.1: a vLLM
    that moved any of them is refused, naming what it lacks."""
    worker = getattr(model_runner, "lora_manager", None)
    if worker is None:
        raise RuntimeError("vLLM's model runner has no lora_manager: the engine was started without enable_lora")
    manager = getattr(worker, "_adapter_manager", None)
    lacks = ["_adapter_manager"] if manager is None else [a for a in _MANAGER_NEEDS if not hasattr(manager, a)]
    if lacks:
        raise RuntimeError(f"vLLM {_vllm_version()}: its LoRA manager lacks {', '.join(lacks)}, which the in-memory "
                           f"adapter swap uses (written against vLLM 0.25.1's vllm/lora/worker_manager.py and "
                           f"model_manager.py)")
    return manager


def install_adapter(manager, items: list[tuple[str, object]], spec: Mapping) -> None:
    """Serve the adapter ``items`` (published names, checked against the checkpoint) under ``LORA_ID`` in
    place of the one registered there, from memory: vLLM's own in-place reload (vLLM 0.25.1,
    ``LRUCacheWorkerLoRAManager.add_adapter`` with ``load_inplace``: remove, add, activate) with a
    ``LoRAModel`` built from the tensors instead of read from a path. Everything that can refuse the
    adapter runs before the old one is removed."""
    try:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
    except ImportError as exc:
        raise RuntimeError(f"vLLM {_vllm_version()}: {exc}, which the in-memory adapter swap uses (written "
                           f"against vLLM 0.25.1's vllm/lora/lora_model.py and peft_helper.py)") from exc
    helper = PEFTHelper(r=spec["rank"], lora_alpha=spec["alpha"], target_modules=list(spec["target_modules"]))
    helper.validate_legal(manager.lora_config)  # the rank fits max_lora_rank
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        if not hasattr(mapper, "get_unstacked_mapper"):
            raise RuntimeError(f"vLLM {_vllm_version()}: the model's hf_to_vllm_mapper lacks get_unstacked_mapper "
                               f"(written against vLLM 0.25.1)")
        # As vLLM's own adapter loader: keep q_proj, k_proj, ... apart (not qkv_proj) for its packing
        mapper = mapper.get_unstacked_mapper()
    dtype = manager.lora_config.lora_dtype
    # Copies of our own: add_adapter scales lora_B in place, which must never reach the published buffer
    # (a CUDA IPC buffer on this device, which .to() alone would hand over as it is).
    tensors = {vllm_lora_name(name): t.to(device=manager.device, dtype=dtype, copy=True) for name, t in items}
    adapter = LoRAModel.from_lora_tensors(lora_model_id=LORA_ID, tensors=tensors, peft_helper=helper,
                                          device=manager.device, dtype=dtype, weights_mapper=mapper)
    stray = unserved_modules(adapter.loras, manager.modules, manager.packed_modules)
    if stray:
        raise ValueError(f"adapter: vLLM has no LoRA layer for {stray[:5]}{' ...' if len(stray) > 5 else ''}, so it "
                         f"would serve the base there (its LoRA layers: {sorted(manager.modules)[:5]} ...)")
    # A failure from here on leaves no adapter under LORA_ID; it is no WeightsUnavailable, so it ends the
    # rollout node, and supervisord's restart serves the current version again from a new engine.
    manager.remove_adapter(LORA_ID)
    manager.add_adapter(adapter)  # packs q/k/v and gate/up; folds alpha / rank into lora_B, once
    manager.activate_adapter(LORA_ID)  # set_lora: copies into the slot's buffers in place
    manager.pin_adapter(LORA_ID)  # never evicted, so never loaded from its (empty) path


class WeightLoadExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls``; called through ``collective_rpc``.
    ``self.model_runner`` and ``self.device`` are the worker's (as in vLLM's rlhf_utils examples)."""

    def areal_bus_attach(self, source: dict, expected: dict, tied: bool, what: str = "weight set") -> None:
        feed = getattr(self, "_areal_bus_feed", None)
        if feed is None:
            feed = self._areal_bus_feed = WeightFeed(expected, tied, what)
        feed.attach(source, getattr(getattr(self, "device", None), "index", None))

    def areal_bus_serve_lora(self, spec: dict, shapes: dict) -> None:
        """Serve adapters (``lora_spec``) from now on, starting with the zero adapter of ``shapes``
        (B = 0: the base, version 0), before any request names it."""
        import torch

        self._areal_bus_lora = dict(spec)
        install_adapter(lora_model_manager(self.model_runner), zero_adapter(shapes), spec)
        torch.cuda.synchronize()

    def areal_bus_load(self, location: str) -> int:
        import torch

        feed = self._areal_bus_feed
        items = feed.items(location)
        lora = getattr(self, "_areal_bus_lora", None)
        if lora is not None:  # the adapter alone, into vLLM's LoRA layers
            install_adapter(lora_model_manager(self.model_runner), items, lora)
        else:
            model = self.model_runner.model
            model.load_weights(weights=items)
            try:  # vLLM's RLHF example runs it after every update (little to do for unquantized weights)
                from vllm.model_executor.model_loader.utils import process_weights_after_loading
            except ImportError:  # older vLLM: load_weights alone is the whole update
                pass
            else:
                process_weights_after_loading(model, self.model_config, self.device)
        torch.cuda.synchronize()  # the copies are done: the source buffer may be reused once we ack
        feed.done(location)
        return len(items)
