"""``areal-bus export``: a LoRA run's checkpoint made usable outside the run.

    areal-bus export --merge logs/checkpoints/step_60 out/merged      # an ordinary Hugging Face folder
    areal-bus export --adapter logs/checkpoints/step_60 out/adapter   # peft's adapter folder alone

A LoRA checkpoint (trainer_engine.lora; areal_bus/train/lora.py) holds the float32 adapter, its optimizer
state and a record of its base (folder and sha256 of its weights). ``--merge`` writes the base with the
adapter merged into its weights (W + alpha / rank * B @ A, computed in float32 and stored in the base's
dtype), its config, tokenizer and chat template: a folder ``AutoModelForCausalLM.from_pretrained`` (or
vLLM, or the run itself as model.path) loads without peft. ``--adapter`` writes ``adapter_config.json``
and ``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(base, folder)`` loads. The base
is the one the checkpoint names (``--base`` points elsewhere, e.g. after moving it); either way its
sha256 must match the record, or nothing is written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from areal_bus.engines.torch_train import TOKENIZER_FILES
from areal_bus.train import lora


class ExportError(ValueError):
    """The checkpoint cannot be exported (not a LoRA checkpoint, its base missing or changed, the output
    in the way); the message says which and what to do."""


def _checked(checkpoint: Path, out: Path, base: Path | None, force: bool) -> Path:
    """The base of ``checkpoint`` (checked against its record), once ``out`` is free to write."""
    if not lora.is_adapter_checkpoint(checkpoint):
        full = (checkpoint / "config.json").is_file()
        what = "a full fine-tuning checkpoint, already a Hugging Face folder" if full else "no checkpoint"
        raise ExportError(f"{checkpoint} holds no LoRA adapter ({lora.ADAPTER_FILE} + {lora.BASE_RECORD}): it is "
                          f"{what}; export is for runs with trainer_engine.lora")
    if out.exists() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty: choose another folder, or --force to replace it")
    record = lora.base_record(checkpoint)
    base = Path(base) if base is not None else Path(record["path"])
    if not (base / "config.json").is_file():
        raise ExportError(f"the base {base} (recorded in {checkpoint / lora.BASE_RECORD}) is not a model folder "
                          f"any more: pass --base with where it is now")
    if lora.base_checksum(base) != record["sha256"]:
        raise ExportError(f"the base {base} is not the one {checkpoint} was trained on (sha256 "
                          f"{lora.base_checksum(base)[:16]}..., recorded {record['sha256'][:16]}...): pass --base "
                          f"with the folder of that base")
    if out.exists():
        shutil.rmtree(out)
    return base


def export_adapter(checkpoint: str | Path, out: str | Path, base: str | Path | None = None,
                   force: bool = False) -> Path:
    """peft's adapter folder (adapter_config.json + adapter_model.safetensors, float32) at ``out``."""
    checkpoint, out = Path(checkpoint), Path(out)
    _checked(checkpoint, out, base, force)
    out.mkdir(parents=True)
    for name in (lora.ADAPTER_CONFIG, lora.ADAPTER_FILE):
        shutil.copy(checkpoint / name, out / name)
    return out


def export_merged(checkpoint: str | Path, out: str | Path, base: str | Path | None = None,
                  force: bool = False) -> Path:
    """The base with the adapter merged in, as a Hugging Face folder at ``out`` (weights in the base's
    dtype, config, tokenizer files, chat template)."""
    # lazy: transformers (seconds to import) only for this subcommand
    from transformers import AutoModelForCausalLM

    checkpoint, out = Path(checkpoint), Path(out)
    base = _checked(checkpoint, out, base, force)
    config = json.loads((checkpoint / lora.ADAPTER_CONFIG).read_text())
    scale = float(config["lora_alpha"]) / int(config["r"])
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32, local_files_only=True)
    stored = _stored_dtype(base)
    modules = dict(model.named_modules())
    adapter = lora.adapter_tensors(checkpoint)
    with torch.no_grad():
        for key, a in adapter.items():
            if ".lora_A." not in key:
                continue
            name = key.removesuffix(".lora_A.weight")
            b = adapter[f"{name}.lora_B.weight"]
            if name not in modules:
                raise ExportError(f"{checkpoint}: the adapter's {name} is no module of the base {base}")
            modules[name].weight += scale * (b.float() @ a.float())
    model.to(stored).save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (base / name).exists():
            shutil.copy(base / name, out / name)
    return out


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _stored_dtype(base: Path) -> torch.dtype:
    """The dtype the base's safetensors hold its weights in (its first tensor's; float32 if unknown)."""
    from safetensors import safe_open  # lazy: as export_merged

    with safe_open(str(sorted(base.glob("*.safetensors"))[0]), framework="pt") as f:
        keys = list(f.keys())
        return _SAFETENSORS_DTYPES.get(f.get_slice(keys[0]).get_dtype(), torch.float32) if keys else torch.float32
