"""The trainer's LoRA (``trainer_engine.lora``): peft's adapters on a frozen base, the adapter as the
published version and as the checkpoint.

The policy is transformers' model (``train_model.load_policy``) loaded in model.dtype, with peft's LoRA
layers injected in place (``inject``: ``peft.inject_adapter_in_model``, so the module tree stays
transformers' and ``PackedLM`` runs it unchanged). The base is frozen in model.dtype: no float32 master,
no gradient, no optimizer state for it; the adapters are float32 masters with AdamW's state. Compute: the
base is already in the compute dtype, so no compute copy (``ComputeCopy``) is made; ``torch.autocast``
runs the adapters' matmuls in model.dtype too, casting their float32 masters at each use (a few
kilobytes to megabytes a layer: nothing next to the base's matmuls), exactly the arithmetic of the
rollout model, which holds the adapter in model.dtype.

What leaves the trainer is the adapter alone:

* each version, ``wire_weights``: "<module>.lora_A.weight" [rank, in] and "<module>.lora_B.weight"
  [out, rank] in model.dtype, the format areal_bus/model/adapters.py serves (through the same weight
  transport as full weights: shared memory, CUDA IPC);
* each checkpoint, ``save``: the float32 adapter in peft's own format (``adapter_config.json`` +
  ``adapter_model.safetensors``: a folder ``PeftModel.from_pretrained`` loads) and ``lora_base.json``,
  the base's folder and the sha256 of its safetensors files (``base_checksum``, computed once per
  process). A resume checks that record against model.path (``check_start``) and refuses another base,
  naming both.

``areal-bus export`` (areal_bus/launch/export.py) turns such a checkpoint into an ordinary Hugging Face
folder (base + merged adapter) or a standalone peft adapter.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import torch

ADAPTER = "default"
"""peft's name for the one adapter (its parameters: ``...q_proj.lora_A.default.weight``)."""
PEFT_PREFIX = "base_model.model."
"""What peft's saved adapter puts before a module's Hugging Face name."""
ADAPTER_FILE, ADAPTER_CONFIG, BASE_RECORD = "adapter_model.safetensors", "adapter_config.json", "lora_base.json"
HASH_CHUNK = 1 << 22
"""Bytes read at a time when hashing the base's weights (any size works; 4 MiB keeps the reads few)."""


def peft_config(lora, base_path: str | Path | None = None):
    """peft's LoraConfig for ``lora`` (trainer_engine.lora)."""
    from peft import LoraConfig  # lazy: peft (a second to import) only where a run trains LoRA

    return LoraConfig(r=lora.rank, lora_alpha=lora.scale * lora.rank, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=None if base_path is None else str(base_path))


def inject(model, lora) -> None:
    """Add ``lora``'s adapters to the transformers model ``model`` in place, frozen base, float32 adapters
    (peft's init: A random, B zero, so the policy starts as the base)."""
    from peft import inject_adapter_in_model  # lazy: as peft_config

    try:
        inject_adapter_in_model(peft_config(lora), model, adapter_name=ADAPTER)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"trainer_engine.lora.target_modules {lora.target_modules}: {exc}") from exc
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
        if is_adapter(name):
            p.data = p.data.float()
    # peft casts each LoRA layer's input to its adapter's dtype (float32) before the adapter's matmuls,
    # which autocast then casts back to model.dtype: two passes over the activations per projection for
    # the same numbers (bf16 -> float32 -> bf16 is exact). The trainer always runs the adapters under
    # autocast (or all in float32), so the input goes to them as it is.
    from peft.tuners.lora import LoraLayer  # lazy: as peft_config

    for m in model.modules():
        if isinstance(m, LoraLayer):
            m.cast_input_dtype_enabled = False


def is_adapter(name: str) -> bool:
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def wire_name(name: str) -> str:
    """peft's parameter name -> the published one ("...q_proj.lora_A.default.weight" -> "...q_proj.lora_A.weight")."""
    return name.replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(f".lora_B.{ADAPTER}.", ".lora_B.")


def wire_weights(masters: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The version the rollout workers serve: the adapters (``masters``: peft's names -> float32) under
    the published names, in ``dtype`` (model.dtype)."""
    return {wire_name(k): v.detach().to(dtype) for k, v in masters.items()}


@contextlib.contextmanager
def adapters_off(model):
    """The base alone for the duration (the KL reference): each LoRA layer skips its adapter. peft's own
    switch (``enable_adapters(False)``) also sets the adapters' requires_grad, which the optimizer and
    FSDP hold on to; this sets only the flag its forward reads."""
    from peft.tuners.lora import LoraLayer  # lazy: as peft_config

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


def decoder_linear_names(path: str | Path) -> set[str]:
    """The names of the linear layers inside the decoder layers of the model at ``path`` (built on the meta
    device from its config.json: no weight is read)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: `areal-bus validate` imports this module

    cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    layers = getattr(model, model.base_model_prefix).layers
    return {name.rsplit(".", 1)[-1] for name, m in layers.named_modules() if isinstance(m, torch.nn.Linear)}


# -- the base -------------------------------------------------------------------------------------

_CHECKSUMS: dict[tuple, str] = {}


def base_checksum(path: str | Path) -> str:
    """sha256 over the base's ``*.safetensors`` files (each file's name, then its bytes, in name order):
    computed once per process and folder state (a few seconds per 10 GB)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    key = (str(Path(path).resolve()), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if key not in _CHECKSUMS:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                while chunk := fh.read(HASH_CHUNK):
                    h.update(chunk)
        _CHECKSUMS[key] = h.hexdigest()
    return _CHECKSUMS[key]


def is_adapter_checkpoint(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_FILE).is_file() and (Path(folder) / BASE_RECORD).is_file()


def base_record(folder: str | Path) -> dict:
    """{"path": the base's folder, "sha256": its checksum} as the checkpoint in ``folder`` recorded them."""
    return json.loads((Path(folder) / BASE_RECORD).read_text())


def check_start(folder: str | Path, lora, base_path: str | Path) -> None:
    """Refuse (ValueError, naming both sides) to start the trainer from checkpoint ``folder`` when it
    does not fit: an adapter checkpoint without trainer_engine.lora, a full-weight one with it, another
    base than model.path (``base_path``), or another rank / alpha / set of targets."""
    folder, base_path = Path(folder), Path(base_path)
    if folder.resolve() == base_path.resolve():
        return
    if lora is None:
        if is_adapter_checkpoint(folder):
            raise ValueError(f"checkpoint {folder} holds a LoRA adapter (a run with trainer_engine.lora): set "
                             f"trainer_engine.lora as that run had it, or start a new run (areal-bus run --new-run)")
        return
    if not is_adapter_checkpoint(folder):
        raise ValueError(f"checkpoint {folder} holds no LoRA adapter ({ADAPTER_FILE} + {BASE_RECORD}): it is a full "
                         f"fine-tuning run's, which trainer_engine.lora cannot resume; leave trainer_engine.lora out, "
                         f"or start a new run (areal-bus run --new-run)")
    record, theirs = base_record(folder), json.loads((folder / ADAPTER_CONFIG).read_text())
    mine = base_checksum(base_path)
    if record.get("sha256") != mine:
        raise ValueError(f"checkpoint {folder} holds an adapter trained on the base {record.get('path')} (sha256 "
                         f"{str(record.get('sha256'))[:16]}...), but model.path is {base_path} (sha256 "
                         f"{mine[:16]}...): an adapter only means something on its own base; point model.path at {record.get('path')}, "
                         f"or start a new run (areal-bus run --new-run)")
    said = {"rank": (theirs.get("r"), lora.rank), "alpha": (theirs.get("lora_alpha"), lora.scale * lora.rank),
            "target_modules": (sorted(theirs.get("target_modules") or []), sorted(lora.target_modules))}
    differ = [f"{k} {a} (topology: {b})" for k, (a, b) in said.items() if a != b]
    if differ:
        raise ValueError(f"checkpoint {folder} holds an adapter of {', '.join(differ)}: trainer_engine.lora must "
                         f"be as the run that wrote it had it")


# -- checkpoints ----------------------------------------------------------------------------------

def save(folder: str | Path, masters: dict[str, torch.Tensor], lora, base_path: str | Path, base_sha: str) -> None:
    """The adapter of a checkpoint into ``folder``: peft's adapter folder (float32 masters) and the base's
    record."""
    from safetensors.torch import save_file  # lazy: as load_into

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    peft_config(lora, Path(base_path).resolve()).save_pretrained(str(folder))
    tensors = {PEFT_PREFIX + wire_name(k): v.detach().float().contiguous().cpu() for k, v in masters.items()}
    save_file(tensors, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
    (folder / BASE_RECORD).write_text(json.dumps({"path": str(Path(base_path).resolve()), "sha256": base_sha}))


def load_into(model, folder: str | Path) -> None:
    """The adapter of the checkpoint in ``folder`` into ``model``'s LoRA parameters (in place; every
    name and shape checked first)."""
    from safetensors.torch import load_file  # lazy: the rest of the module runs without it (validate)

    saved = load_file(str(Path(folder) / ADAPTER_FILE))
    params = {PEFT_PREFIX + wire_name(n): p for n, p in model.named_parameters() if is_adapter(n)}
    missing, unexpected = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
    if missing or unexpected:
        raise KeyError(f"{folder}/{ADAPTER_FILE} does not match trainer_engine.lora: missing {missing[:3]}, "
                       f"unexpected {unexpected[:3]}")
    bad = [k for k, p in params.items() if saved[k].shape != p.shape]
    if bad:
        raise ValueError(f"{folder}/{ADAPTER_FILE}: {bad[0]} is {tuple(saved[bad[0]].shape)}, the model's "
                         f"{tuple(params[bad[0]].shape)}")
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(saved[k])


def adapter_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """{published name: float32 tensor} of the adapter checkpoint in ``folder``."""
    from safetensors.torch import load_file  # lazy: as load_into

    return {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(Path(folder) / ADAPTER_FILE)).items()}


# -- one copy of the base -------------------------------------------------------------------------

def share_base(model, topo, base=None, log=None):
    """With model.share_base (areal_bus/model/shared_base.py), put the frozen base of the trainer's ``model``
    into the buffer the rollout engines of its device map (in place: the base's parameters become views of
    it) and return that SharedBase, to keep for the life of the process; None when the run does not share.
    Logs ``weights_memory``: the bytes of weights this process holds and of the shared base."""
    # lazy: the shared base imports the weight transport, which `areal-bus validate` (importing this) never needs
    from areal_bus.model import shared_base

    if not shared_base.enabled(topo):
        return None
    why = shared_base.refusal(topo)
    if why is not None:
        raise ValueError(f"model.share_base is true, but {why}: leave model.share_base out (or false)")
    ipc_dir = topo.ipc_dir(base)
    ipc_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    shared = shared_base.publish(model, topo.shm_name(base), shared_base.identity(topo.model_path(base), topo.model.dtype),
                                 ipc_dir)
    held, mapped = shared_base.held_bytes(model, shared.views)
    if log is not None:
        log.info("weights_memory", held_bytes=held, shared_base_bytes=mapped, shared_at=shared.where)
    return shared
