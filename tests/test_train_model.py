"""The trainer's policy on transformers' model classes: every architecture users bring trains on CPU
with a tiny random config (packed log-probabilities equal the unpacked ones, one PPO step, a
checkpoint that reloads to the same numbers), the torch rollout engine's own decoder gives the same
log-probabilities for each, and float32 master weights keep an lr 1e-6 update that pure bfloat16 loses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from areal_bus.train.loss import decoupled_ppo_loss
from areal_bus.model.modeling import load_pretrained, logprobs_of, token_logprobs
from areal_bus.train.packing import pack
from areal_bus.engines.torch_train import compile_layers
from areal_bus.train.train_model import (VARLEN, VARLEN_FA4, ComputeCopy, PackedLM, autocast, export_state_dict,
                                   head_logprobs, load_policy, packed_logprobs, train_flops)
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)


_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256)
ARCHITECTURES = {
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=8, tie_word_embeddings=True)),
    "llama3": ("LlamaConfig", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64},
                                   tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(sliding_window=None, tie_word_embeddings=False)),
    "smollm2": ("LlamaConfig", dict(tie_word_embeddings=True, rms_norm_eps=1e-5)),  # SmolLM2 is a Llama
}


def _save_random(kind: str, folder) -> None:
    import transformers

    cls_name, extra = ARCHITECTURES[kind]
    cfg = getattr(transformers, cls_name)(**_COMMON, **extra)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)


def _samples(rng, lengths, vocab=96) -> list[dict]:
    out = []
    for n in lengths:
        prompt = n // 3
        mask = np.r_[np.zeros(prompt), np.ones(n - prompt)].astype(np.float32)
        out.append({"ids": rng.integers(3, vocab, n), "mask": mask, "behav": -np.ones(n, np.float32) * mask,
                    "adv": np.full(n, rng.standard_normal(), np.float32) * mask})
    return out


def _unpacked_logprobs(model, ids: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(ids.astype(np.int64))[None]
    logits = model(input_ids=x, use_cache=False).logits
    return torch.cat([torch.zeros(1), logprobs_of(logits[0, :-1], x[0, 1:])])


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_each_architecture_packs_trains_and_reloads(kind, tmp_path):
    _save_random(kind, tmp_path / "start")
    model = load_policy(tmp_path / "start")  # the trainer's own varlen attention
    assert next(model.parameters()).dtype == torch.float32
    samples = _samples(np.random.default_rng(1), [11, 7, 19])
    (packed,) = pack(samples, max_tokens=64)
    lp, _ = packed_logprobs(model, packed, chunk=8)
    with torch.no_grad():
        lp_nograd, ent = packed_logprobs(model, packed, chunk=8, entropy=True)
    torch.testing.assert_close(lp_nograd, lp.detach())
    for i, start, n in packed.rows:  # attention never crosses samples: packed == one by one
        torch.testing.assert_close(lp[start:start + n], _unpacked_logprobs(model, samples[i]["ids"]),
                                   atol=2e-5, rtol=1e-5)
    assert ent is not None and bool((ent[packed.mask > 0] > 0).all())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss, _ = decoupled_ppo_loss(lp, lp.detach(), packed.behav, packed.adv, packed.mask)
    loss.backward()
    opt.step()
    after, _ = packed_logprobs(model, packed)
    assert not torch.allclose(after, lp.detach())  # the step changed the policy
    model.save_pretrained(tmp_path / "ckpt")
    again = load_policy(tmp_path / "ckpt")
    with torch.no_grad():
        torch.testing.assert_close(packed_logprobs(again, packed)[0], after.detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_the_rollout_decoder_samples_with_the_trainers_log_probabilities_for_each_architecture(kind, tmp_path):
    """The behaviour log-probabilities the torch engine records (areal_bus/model/modeling.py, from the checkpoint
    transformers wrote) are what the trainer recomputes: its importance weights start at 1."""
    _save_random(kind, tmp_path / "m")
    trainer, rollout = load_policy(tmp_path / "m"), load_pretrained(tmp_path / "m")
    with torch.no_grad():
        for sample in _samples(np.random.default_rng(2), [9, 70, 130]):  # past llama3's 64 original positions
            ours = token_logprobs(rollout, torch.from_numpy(sample["ids"].astype(np.int64))[None])[0]
            torch.testing.assert_close(ours, _unpacked_logprobs(trainer, sample["ids"]), atol=2e-5, rtol=1e-5)


def test_transformers_sdpa_packed_path_agrees_with_the_varlen_attention(tmp_path):
    _save_random("qwen3", tmp_path / "m")
    (packed,) = pack(_samples(np.random.default_rng(5), [13, 21, 9]), max_tokens=64)
    with torch.no_grad():
        ours = packed_logprobs(load_policy(tmp_path / "m"), packed)[0]
        theirs = packed_logprobs(load_policy(tmp_path / "m", attn_implementation="sdpa"), packed)[0]
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


def test_packing_caps_micro_batches_and_keeps_order():
    samples = _samples(np.random.default_rng(2), [30, 30, 50, 90, 10])
    parts = pack(samples, max_tokens=64)
    assert [[r[0] for r in p.rows] for p in parts] == [[0, 1], [2], [3], [4]]  # 90 > 64 goes alone
    assert [p.tokens for p in parts] == [60, 50, 90, 10]
    first = parts[0]
    assert first.positions[0, :31].tolist() == list(range(30)) + [0]  # positions restart per sample


def test_packing_balances_micro_batches_without_adding_any():
    """A mini-batch just over the cap makes two halves (not a full micro-batch and a sliver), in as many
    micro-batches as filling each to the cap makes, none over the cap, the samples in order."""
    from areal_bus.train.packing import _fill, _groups

    assert [p.tokens for p in pack(_samples(np.random.default_rng(2), [20, 20, 20, 10]), max_tokens=64)] == [40, 30]
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = [int(n) for n in np.clip(rng.lognormal(np.log(500), 0.8, rng.integers(1, 40)), 200, 3000)]
        cap = int(rng.integers(200, 20000))
        groups, filled = _groups(lengths, cap), _fill(lengths, cap)
        assert [i for g in groups for i in g] == list(range(len(lengths)))
        assert len(groups) == len(filled)
        sizes = [sum(lengths[i] for i in g) for g in groups]
        assert all(s <= cap or len(g) == 1 for s, g in zip(sizes, groups))
        assert max(sizes) <= max(sum(lengths[i] for i in g) for g in filled)


def test_padded_packing_regroups_samples_to_pad_less():
    """With pad_to > 1 a mini-batch's samples are regrouped so that every micro-batch but one ends just
    short of a multiple of pad_to: as many micro-batches as in order, none over the cap, every sample
    once, never more padding than in order, and over the seed's lengths much less."""
    from areal_bus.train.packing import _groups, _padding

    assert _groups([4, 5, 3, 4], 9) == [[0, 1], [2, 3]]  # in order: 9 and 7, padded to 16 and 8
    assert _groups([4, 5, 3, 4], 9, pad_to=8) == [[0, 3], [1, 2]]  # 8 and 8: no padding
    parts = pack(_samples(np.random.default_rng(1), [4, 5, 3, 4]), max_tokens=9, pad_to=8)
    assert [p.tokens for p in parts] == [8, 8] and [[r[0] for r in p.rows] for p in parts] == [[0, 3], [1, 2]]
    rng = np.random.default_rng(0)
    saved = padded_in_order = 0
    for _ in range(200):
        lengths = [int(n) for n in np.clip(rng.lognormal(np.log(500), 0.8, rng.integers(1, 40)), 200, 3000)]
        cap, pad = int(rng.integers(3000, 20000)), int(rng.choice([64, 256, 1024]))
        groups, in_order = _groups(lengths, cap, pad), _groups(lengths, cap)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert len(groups) == len(in_order) and all(sum(lengths[i] for i in g) <= cap for g in groups)
        assert _padding(lengths, groups, pad) <= _padding(lengths, in_order, pad)
        saved += _padding(lengths, in_order, pad) - _padding(lengths, groups, pad)
        padded_in_order += _padding(lengths, in_order, pad)
    assert saved > padded_in_order / 4
    # A mini-batch of hundreds of micro-batches (each group's subset sum is over a bounded pool)
    lengths = [int(n) for n in np.clip(rng.lognormal(np.log(8000), 0.8, 2048), 50, 32000)]
    groups, in_order = _groups(lengths, 65536, 1024), _groups(lengths, 65536)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths))) and len(groups) == len(in_order) > 300
    assert all(sum(lengths[i] for i in g) <= 65536 for g in groups)
    assert _padding(lengths, groups, 1024) < _padding(lengths, in_order, 1024) / 10


def test_padded_mini_batches_trade_boundary_samples_to_align_their_totals():
    """With pad_to > 1, neighbouring mini-batches trade up to SWAP_WINDOW samples at their boundary so
    that each but the last totals just short of a multiple of pad_to: as many mini-batches, of the same
    sizes, every sample once, each ending (in tokens) within pad_to of its in-order end, no sample more
    than one mini-batch from its own; without padding, the in-order mini-batches themselves."""
    from areal_bus.train.packing import SWAP_WINDOW, mini_batch_members, mini_batches

    assert mini_batch_members([8, 9, 15, 9, 14, 7, 10, 8], 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mini_batch_members([8, 9, 15, 9, 14, 7, 10, 8], 4, pad_to=8)[0] != [0, 1, 2, 3]
    rng = np.random.default_rng(5)
    waste = {"in order": 0, "traded": 0}
    for _ in range(100):
        lengths = [int(n) for n in np.clip(rng.lognormal(np.log(500), 0.8, rng.integers(2, 120)), 200, 3000)]
        size, pad = int(rng.integers(1, 40)), int(rng.choice([128, 1024]))
        parts, members = mini_batches(len(lengths), size), mini_batch_members(lengths, size, pad)
        assert [len(m) for m in members] == [len(r) for r in parts]
        assert sorted(i for m in members for i in m) == list(range(len(lengths)))
        home = {i: k for k, r in enumerate(parts) for i in r}
        end = end_in_order = 0
        for k, (m, r) in enumerate(zip(members, parts)):
            assert all(abs(home[i] - k) <= 1 for i in m) and len(set(m) - set(r)) <= 2 * SWAP_WINDOW
            total, in_order = sum(lengths[i] for i in m), sum(lengths[i] for i in r)
            end, end_in_order = end + total, end_in_order + in_order
            assert abs(end - end_in_order) <= pad
            if k < len(parts) - 1:
                waste["in order"] += -in_order % pad
                waste["traded"] += -total % pad
    assert waste["traded"] < waste["in order"] / 2, waste  # small mini-batches have little to trade


def test_chunked_logprobs_equal_whole_logits_and_their_gradients(tmp_path):
    _save_random("qwen2", tmp_path / "m")
    model = load_policy(tmp_path / "m")
    (packed,) = pack(_samples(np.random.default_rng(3), [40, 25]), max_tokens=128)
    grads = []
    for chunk in (7, 10_000):
        model.zero_grad()
        lp, _ = packed_logprobs(model, packed, temperature=0.7, chunk=chunk)
        (lp * packed.mask).sum().backward()
        grads.append((lp.detach(), model.model.embed_tokens.weight.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("keep_chunks", [0, 2, 5])
@pytest.mark.parametrize("temperature,softcap,bias", [(1.0, None, False), (0.7, None, True), (1.3, 5.0, False),
                                                      (0.0, None, False)])
def test_chunked_head_gradients_equal_whole_logits_in_float64(temperature, softcap, bias, keep_chunks):
    """keep_chunks: how many of the 5 chunks keep their logits' gradient from the forward (the rest
    recompute their logits in backward): the gradients are the definition's either way."""
    g = torch.Generator().manual_seed(7)
    n, d, vocab = 23, 6, 41
    hidden = torch.randn(n, d, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(vocab, d, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(vocab, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    targets = torch.randint(0, vocab, (n,), generator=g)
    upstream = torch.randn(n, dtype=torch.float64, generator=g)

    def whole():  # the definition: every logit at once, autograd through it
        logits = torch.nn.functional.linear(hidden, weight, b)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logprobs_of(logits, targets, temperature).double()

    inputs = [hidden, weight] + ([b] if bias else [])
    ref = whole()
    ref_grads = torch.autograd.grad((ref * upstream).sum(), inputs)
    keep = keep_chunks * 5 * vocab * 8  # float64 bytes of that many 5-position chunks
    lp, ent = head_logprobs(hidden, targets, weight, b, temperature=temperature, softcap=softcap, chunk=5,
                            keep_bytes=keep)
    assert ent is None
    assert len(lp.grad_fn.saved_tensors) == 5 + keep_chunks  # the inputs, the normalisers, the kept chunks
    grads = torch.autograd.grad((lp * upstream).sum(), inputs)
    torch.testing.assert_close(lp.double(), ref, atol=1e-6, rtol=1e-6)  # the forward is float32, as sampled
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # With the entropy (the trainer's first mini-batch: its forward is also the proximal pass) the
    # log-probabilities keep their gradient.
    lp2, ent2 = head_logprobs(hidden, targets, weight, b, temperature=temperature, softcap=softcap, chunk=5,
                              entropy=True, keep_bytes=keep)
    assert not ent2.requires_grad
    for got, want in zip(torch.autograd.grad((lp2 * upstream).sum(), inputs), ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        logits = torch.nn.functional.linear(hidden, weight, b)
        z = (torch.tanh(logits / softcap) * softcap if softcap else logits) / (temperature or 1.0)
        want_ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    torch.testing.assert_close(lp2.double(), ref.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent2.double(), want_ent, atol=2e-5, rtol=1e-4)  # float32 sums


def test_the_head_keeps_no_logit_gradients_without_a_backward_to_come(monkeypatch):
    """Under no_grad (the proximal pass) the weights still require grad, but no backward will come:
    the forward makes no logit gradients (their compute and memory would be wasted)."""
    import areal_bus.train.train_model as tm

    calls = []
    kept = tm._chunk_logprobs_kept
    monkeypatch.setattr(tm, "_chunk_logprobs_kept", lambda *a: calls.append(1) or kept(*a))
    hidden, weight = torch.randn(12, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    targets = torch.randint(0, 9, (12,))
    with torch.no_grad():
        head_logprobs(hidden, targets, weight, chunk=5, keep_bytes=2**30)
    assert calls == []
    head_logprobs(hidden, targets, weight, chunk=5, keep_bytes=2**30)
    assert len(calls) == 3  # every chunk, with a backward to come


def test_fp32_master_weights_keep_an_lr_1e6_update_that_pure_bf16_loses(tmp_path):
    _save_random("llama3", tmp_path / "m")
    (packed,) = pack(_samples(np.random.default_rng(4), [24, 24]), max_tokens=64)

    def one_step(model, compute_dtype):
        before = {k: v.detach().float().clone() for k, v in model.named_parameters()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
        with autocast(torch.device("cpu"), compute_dtype):
            lp, _ = packed_logprobs(model, packed)
            loss = -(lp * packed.adv * packed.mask).sum() / packed.mask.sum()
        loss.backward()
        opt.step()
        return {k: v.detach().float() - before[k] for k, v in model.named_parameters()}

    def one_step_on_a_copy(model):
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        policy = PackedLM(model)
        run = ComputeCopy(policy, torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
        for half in (packed.mask * (torch.arange(packed.tokens) < 24), packed.mask * (torch.arange(packed.tokens) >= 24)):
            lp, _ = packed_logprobs(run.module, packed)  # two backwards: the masters' grads accumulate
            (-(lp * packed.adv * half).sum() / packed.mask.sum()).backward()
        assert all(not p.grad.any() for p in run.module.parameters())  # each went into its master's
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        opt.step()
        run.refresh()
        for (k, m), c in zip(model.named_parameters(), run.module.lm.parameters()):
            assert c.dtype == torch.bfloat16 and torch.equal(c, m.detach().to(torch.bfloat16)), k
        return {k: v.detach() - before[k] for k, v in model.named_parameters()}

    reference = one_step(load_policy(tmp_path / "m"), torch.float32)
    master = one_step(load_policy(tmp_path / "m"), torch.bfloat16)  # fp32 weights, bf16 autocast
    copied = one_step_on_a_copy(load_policy(tmp_path / "m"))  # fp32 weights, a bf16 compute copy
    pure = one_step(load_policy(tmp_path / "m").to(torch.bfloat16), torch.bfloat16)
    name = "model.layers.0.mlp.down_proj.weight"
    ref = reference[name]
    moved = lambda delta: float((delta != 0).float().mean())
    for delta in (master[name], copied[name]):
        assert moved(ref) > 0.99 and moved(delta) > 0.99
        # Adam's first step moves each weight by ~lr in the gradient's sign: bf16 compute keeps the signs.
        assert float((torch.sign(delta) == torch.sign(ref)).float().mean()) > 0.9
        torch.testing.assert_close(delta.abs().mean(), ref.abs().mean(), rtol=0.05, atol=0)
    assert moved(pure[name]) < 0.05  # bf16 weights: a 1e-6 step is below their resolution, rounded away


def test_exported_weights_drop_a_tied_head_and_take_the_rollout_dtype(tmp_path):
    _save_random("qwen2", tmp_path / "m")
    model = load_policy(tmp_path / "m")
    sd = export_state_dict(model.state_dict(), model.config, "bfloat16")
    assert "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd
    assert {v.dtype for v in sd.values()} == {torch.bfloat16}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_varlen_packing_matches_one_by_one_in_bf16_with_its_gradients(tmp_path):
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    samples = _samples(np.random.default_rng(6), [300, 17, 1000, 64], vocab=512)
    (packed,) = pack(samples, max_tokens=4096)
    packed = packed.to("cuda")
    dev = torch.device("cuda")
    ours = load_policy(tmp_path / "m", dev)  # FlashAttention varlen
    theirs = load_policy(tmp_path / "m", dev, attn_implementation="sdpa")
    with autocast(dev, torch.bfloat16):
        lp, _ = packed_logprobs(ours, packed, chunk=256)
    (lp * packed.mask).sum().backward()
    for i, start, n in packed.rows:
        x = torch.as_tensor(samples[i]["ids"], device=dev)[None]
        with autocast(dev, torch.bfloat16):
            logits = theirs(input_ids=x, use_cache=False).logits
        one = torch.cat([torch.zeros(1, device=dev), logprobs_of(logits[0, :-1], x[0, 1:])])
        (one * packed.mask[start:start + n]).sum().backward()
        torch.testing.assert_close(lp[start:start + n].detach(), one.detach(), atol=0.05, rtol=0.02)
    g_ours = ours.model.layers[0].self_attn.q_proj.weight.grad
    g_theirs = theirs.model.layers[0].self_attn.q_proj.weight.grad
    cos = torch.nn.functional.cosine_similarity(g_ours.flatten(), g_theirs.flatten(), dim=0)
    assert float(cos) > 0.99


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("keep_bytes", [0, 2**30])
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, 30.0)])
def test_cuda_compiled_head_matches_the_float32_definition(temperature, softcap, keep_bytes):
    """On a GPU the head's softmax arithmetic is compiled: bf16 weights and hidden states, a vocabulary
    and chunk count of real shape, against every logit at once in float32 on the same inputs; the
    logits' gradient recomputed in backward, or made in the forward and kept."""
    g = torch.Generator().manual_seed(3)
    n, d, vocab = 3000, 128, 32000
    hidden = (torch.randn(n, d, generator=g) * 0.5).bfloat16().cuda().requires_grad_(True)
    weight = (torch.randn(vocab, d, generator=g) * 0.1).bfloat16().cuda().requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=g).cuda()
    upstream = torch.randn(n, generator=g).cuda()
    lp, _ = head_logprobs(hidden, targets, weight, temperature=temperature, softcap=softcap, chunk=1024,
                          keep_bytes=keep_bytes)
    assert len(lp.grad_fn.saved_tensors) == 5 + (3 if keep_bytes else 0)
    gh, gw = torch.autograd.grad((lp * upstream).sum(), [hidden, weight])
    h32, w32 = hidden.detach().float().requires_grad_(True), weight.detach().float().requires_grad_(True)
    logits = h32 @ w32.t()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    ref = logprobs_of(logits, targets, temperature)
    rh, rw = torch.autograd.grad((ref * upstream).sum(), [h32, w32])
    torch.testing.assert_close(lp, ref, atol=0.05, rtol=0.02)  # bf16 logits
    for got, want in ((gh, rh), (gw, rw)):
        cos = torch.nn.functional.cosine_similarity(got.float().flatten(), want.flatten(), dim=0)
        assert float(cos) > 0.999


def _segment_attention(q, k, v, cu, scale):
    """float32 causal attention within each segment of cu: (out [N, Hq, D], log-sum-exp [Hq, N])."""
    outs, lses = [], []
    bounds = cu.tolist()
    rep = q.shape[1] // k.shape[1]
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs = q[s:e].float().transpose(0, 1)
        ks, vs = (t[s:e].float().transpose(0, 1).repeat_interleave(rep, 0) for t in (k, v))
        scores = (qs @ ks.transpose(1, 2)) * scale
        scores = scores.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(scores, -1)
        outs.append((torch.exp(scores - lse[..., None]) @ vs).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses, 1)


def test_the_fa4_operators_differentiate_and_compile_without_a_graph_break():
    """``areal_bus::fa4_varlen_fwd``/``_bwd`` (FlashAttention-4's kernels on CUDA) wired as torch operators:
    with a float32 reference kernel registered for CPU in their place, the forward, the registered backward
    (dq, dk, dv from the saved inputs, output and log-sum-exp) and a fullgraph torch.compile through them
    give plain autograd's attention and its gradients."""
    lib = torch.library.Library("areal_bus", "IMPL")  # the CPU kernels live as long as this test

    def fwd(q, k, v, cu, longest, scale):
        return _segment_attention(q, k, v, cu, scale)

    def bwd(dout, q, k, v, out, lse, cu, longest, scale):  # attention's backward from the saved out and lse
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        rep = q.shape[1] // k.shape[1]
        bounds = cu.tolist()
        for s, e in zip(bounds[:-1], bounds[1:]):
            qs, o, do = (t[s:e].float().transpose(0, 1) for t in (q, out, dout))
            ks, vs = (t[s:e].float().transpose(0, 1).repeat_interleave(rep, 0) for t in (k, v))
            p = torch.exp((qs @ ks.transpose(1, 2)) * scale - lse[:, s:e, None]).tril()
            dp = do @ vs.transpose(1, 2)
            ds = p * (dp - (do * o).sum(-1, keepdim=True))
            dq[s:e] = (ds @ ks * scale).transpose(0, 1)
            dk[s:e] = (ds.transpose(1, 2) @ qs * scale).unflatten(0, (-1, rep)).sum(1).transpose(0, 1)
            dv[s:e] = (p.transpose(1, 2) @ do).unflatten(0, (-1, rep)).sum(1).transpose(0, 1)
        return dq, dk, dv

    lib.impl("fa4_varlen_fwd", fwd, "CPU")
    lib.impl("fa4_varlen_bwd", bwd, "CPU")
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 7, 20, 23], dtype=torch.int32)
    q, k, v = (torch.randn(23, h, 8, generator=g) for h in (4, 2, 2))
    upstream = torch.randn(23, 4, 8, generator=g)

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        return [out.detach(), *torch.autograd.grad(out, leaves, upstream)]

    want = grads(lambda q, k, v: _segment_attention(q, k, v, cu, 0.3)[0])
    op = lambda q, k, v: torch.ops.areal_bus.fa4_varlen_fwd(q, k, v, cu, 13, 0.3)[0]
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: op(q * 1.0, k, v), fullgraph=True, backend="aot_eager")
    for fn in (op, compiled):
        for got, ref in zip(grads(fn), want):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_fa4_attention_is_refused_with_what_it_needs_off_a_hopper_gpu(tmp_path):
    _save_random("qwen2", tmp_path / "m")
    with pytest.raises(ValueError, match="areal_varlen_fa4.*CUDA GPU.*not on cpu"):
        load_policy(tmp_path / "m", "cpu", attn_implementation=VARLEN_FA4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper or newer CUDA device")
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_fa4_attention_matches_fa2_in_the_model_with_its_gradients(tmp_path, compiled):
    """attn_implementation areal_varlen_fa4 (FlashAttention-4) against areal_varlen (torch's
    FlashAttention-2) on one packed micro-batch through a tiny Qwen2 (head_dim 64, grouped key/value
    heads), compute copy in bf16: the same log-probabilities and weight gradients, compiled layers too
    (with no graph break)."""
    pytest.importorskip("flash_attn.cute.interface")
    import transformers
    from torch._dynamo.utils import counters

    cfg = transformers.Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    samples = _samples(np.random.default_rng(6), [300, 17, 1000, 64, 700], vocab=512)
    (packed,) = pack(samples, max_tokens=4096, pad_to=1024)
    dev = torch.device("cuda")
    packed = packed.to(dev)
    results = []
    torch._dynamo.reset()
    counters.clear()
    for attn in (VARLEN, VARLEN_FA4):
        master = PackedLM(load_policy(tmp_path / "m", dev, attn_implementation=attn))
        copy = ComputeCopy(master, torch.bfloat16)
        if compiled:
            compile_layers(copy.module)
        lp, _ = packed_logprobs(copy.module, packed, chunk=256)
        (lp * packed.mask).sum().backward()
        # The copy's gradients go into the masters' (float32) at the end of backward; the copy's are zeroed.
        results.append((lp.detach().float(), dict((n, p.grad.clone()) for n, p in master.named_parameters())))
    (lp2, g2), (lp4, g4) = results
    torch.testing.assert_close(lp4, lp2, atol=0.02, rtol=0.01)
    assert all(bool(g.any()) for n, g in g2.items() if not n.endswith("k_proj.bias"))  # none lost on the way
    for name, want in g2.items():
        if name.endswith("k_proj.bias"):  # a key bias shifts a query's scores alike: its gradient is 0, as noise
            continue
        cos = torch.nn.functional.cosine_similarity(g4[name].flatten(), want.flatten(), dim=0)
        assert float(cos) > 0.999, name
    if compiled:
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper or newer CUDA device")
@pytest.mark.parametrize("heads, dim", [((14, 2), 64), ((12, 2), 128), ((8, 8), 64)])
def test_cuda_fa4_replayed_calls_give_what_whole_calls_give(monkeypatch, heads, dim):
    """The FlashAttention-4 operators replaying flash-attn-4's launches (``fa4_ops.FA4_REPLAY``) against
    its entry points run whole: bit for bit the same outputs, log-sum-exps and gradients, over micro-batches
    of several shapes, each called as the layers of a micro-batch call it (recorded once, then replayed),
    with and without gradients (the gradients to the backward's own run-to-run noise)."""
    pytest.importorskip("flash_attn.cute.interface")
    from areal_bus.train import fa4_ops

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rng = np.random.default_rng(3)
    for lengths in ([500, 300, 1200, 90], [16384 // 32] * 32, list(rng.integers(200, 3000, 12)), [1]):
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=dev)
        n, longest = int(cu[-1]), int(max(lengths))
        for layer in range(3):
            q, k, v = (torch.randn(n, h, dim, generator=g, device=dev, dtype=torch.bfloat16)
                       for h in (heads[0], heads[1], heads[1]))
            upstream = torch.randn(n, heads[0], dim, generator=g, device=dev, dtype=torch.bfloat16)
            results = []
            for replay in (False, True):
                monkeypatch.setattr(fa4_ops, "FA4_REPLAY", replay)
                with torch.no_grad():
                    plain = torch.ops.areal_bus.fa4_varlen_fwd(q, k, v, cu, longest, dim ** -0.5)
                leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
                out, lse = torch.ops.areal_bus.fa4_varlen_fwd(*leaves, cu, longest, dim ** -0.5)
                grads = torch.autograd.grad(out, leaves, upstream)
                results.append([*plain, out.detach(), lse.detach(), *grads])
            whole, replayed = results
            for a, b in zip(whole[:4], replayed[:4]):  # the forward is deterministic
                assert torch.equal(a, b), (lengths[:4], layer)
            for a, b in zip(whole[4:], replayed[4:]):  # the backward adds into float32 in no fixed order
                torch.testing.assert_close(b, a, atol=2e-3, rtol=1e-2)
    stats = fa4_ops.fa4_replay_stats()
    assert stats["refused"] == 0, fa4_ops._FA4_LAUNCHES.last_refusal
    assert stats["replayed"] >= 4 * 3  # at least every shape's third layer, three kinds of call


def test_a_padded_micro_batch_has_the_same_log_probabilities_and_loss(tmp_path):
    _save_random("qwen2", tmp_path / "m")
    model = load_policy(tmp_path / "m")
    samples = _samples(np.random.default_rng(6), [13, 21, 9])
    (plain,) = pack(samples, max_tokens=64)
    (padded,) = pack(samples, max_tokens=64, pad_to=16)
    assert (plain.tokens, padded.tokens) == (43, 48)  # 43 tokens, rounded up to a multiple of 16
    assert padded.rows == plain.rows  # the padding is no sample
    assert padded.cu.tolist() == [0, 13, 34, 43, 48] and padded.longest == 21
    assert float(padded.mask[43:].abs().sum()) == 0.0  # out of the loss
    lp_plain, _ = packed_logprobs(model, plain)
    lp_padded, _ = packed_logprobs(model, padded)
    torch.testing.assert_close(lp_padded[:43], lp_plain, atol=1e-6, rtol=1e-6)
    losses = [decoupled_ppo_loss(lp, lp.detach() - 0.1, p.behav, p.adv, p.mask)[0]
              for lp, p in ((lp_plain, plain), (lp_padded, padded))]
    torch.testing.assert_close(losses[1], losses[0])


@pytest.mark.parametrize("pad_to", [1, 16])
def test_the_head_on_the_loss_tokens_only_gives_their_log_probabilities_and_gradients(tmp_path, pad_to):
    """pack(loss_only=True): the lm_head runs on the tokens of loss weight != 0 (and, padded, on
    sentinel rows dropped after it); those tokens' log-probabilities, entropies and the gradient of any
    loss over them equal the head over every position; every other entry is 0."""
    _save_random("qwen2", tmp_path / "m")
    model = load_policy(tmp_path / "m")
    samples = _samples(np.random.default_rng(8), [13, 21, 9])
    samples[1]["mask"][:] = 0.0  # a sample wholly out of the loss
    results = []
    for loss_only in (False, True):
        (packed,) = pack(samples, max_tokens=64, pad_to=pad_to, loss_only=loss_only)
        model.zero_grad()
        lp, ent = packed_logprobs(model, packed, temperature=0.8, chunk=5, entropy=True)
        (lp * packed.mask * torch.linspace(-1, 1, packed.tokens)).sum().backward()
        results.append((packed, lp.detach(), ent, [p.grad.clone() for p in model.parameters()]))
    (full, lp_full, ent_full, g_full), (sel, lp_sel, ent_sel, g_sel) = results
    on = (full.mask != 0) & (full.positions[0] != 0)
    real = sel.head[sel.head < sel.tokens]
    assert real.tolist() == torch.nonzero(on).flatten().tolist()
    assert sel.head.numel() % pad_to == 0 and sel.head.numel() - real.numel() < pad_to  # the sentinels
    torch.testing.assert_close(lp_sel[on], lp_full[on], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent_sel[on], ent_full[on], atol=1e-6, rtol=1e-6)
    assert float(lp_sel[~on].abs().sum()) == 0.0 and float(ent_sel[~on].abs().sum()) == 0.0
    for a, b in zip(g_sel, g_full):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_micro_batch_with_no_loss_token_still_runs_the_head_on_one_row(tmp_path):
    """Every rank of a parallel layout runs the head's forward and backward, a stand-in row of weight 0
    included: a micro-batch without loss tokens gets one sentinel row, and its gradient is 0."""
    _save_random("qwen2", tmp_path / "m")
    model = load_policy(tmp_path / "m")
    samples = _samples(np.random.default_rng(9), [12])
    samples[0]["mask"][:] = 0.0
    (packed,) = pack(samples, max_tokens=64, loss_only=True)
    assert packed.head.tolist() == [12]
    lp, _ = packed_logprobs(model, packed)
    (lp * packed.mask).sum().backward()
    assert float(lp.detach().abs().sum()) == 0.0
    assert float(model.lm_head.weight.grad.abs().sum()) == 0.0


def test_padding_longer_than_every_sample_still_bounds_the_attention():
    (packed,) = pack(_samples(np.random.default_rng(7), [5, 6]), max_tokens=64, pad_to=32)
    assert packed.tokens == 32 and packed.longest == 21  # max_length_q covers the padding segment


@pytest.mark.parametrize("pad_to", [1, 16])
def test_packing_rows_of_a_padded_batch_equals_packing_the_samples(pad_to):
    from areal_bus.train.packing import pack_rows

    samples = _samples(np.random.default_rng(8), [30, 7, 50, 90, 12, 3])
    for s, v in zip(samples, range(len(samples))):
        s["lag"] = np.full(len(s["ids"]), float(v), np.float32)
    T = max(len(s["ids"]) for s in samples)
    data = {k: torch.zeros(len(samples), T, dtype=torch.long if k in ("ids", "attn") else torch.float32)
            for k in ("ids", "attn", "mask", "behav", "adv", "lag")}
    for r, s in enumerate(samples):
        n = len(s["ids"])
        data["attn"][r, :n] = 1
        for k in ("ids", "mask", "behav", "adv", "lag"):
            data[k][r, :n] = torch.as_tensor(s[k])
    rows = torch.tensor([5, 0, 2, 3, 1])  # a rank's share, in its own order
    want = pack([samples[r] for r in rows.tolist()], max_tokens=64, pad_to=pad_to)
    got = pack_rows(data, rows, max_tokens=64, pad_to=pad_to)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.rows == w.rows and g.longest == w.longest
        for k in ("ids", "positions", "mask", "behav", "adv", "cu", "lag"):
            assert torch.equal(getattr(g, k), getattr(w, k)), k


def test_train_flops_count_the_head_on_the_tokens_it_runs_on():
    """MFU's count: the lm_head's matmul on the loss's tokens only when ``head`` says how many."""
    base = train_flops(1000, 2, 8, 100, 5000, proximal=(60, 3000))
    assert base == 3 * (2 * 1000 * 100 + 2 * 2 * 8 * 5000) + 2 * 1000 * 60 + 2 * 2 * 8 * 3000
    assert train_flops(1000, 2, 8, 100, 5000, proximal=(60, 3000), head=(300, 100, 60)) == base
    fewer = train_flops(1000, 2, 8, 100, 5000, proximal=(60, 3000), head=(300, 90, 50))
    assert base - fewer == 6 * 300 * 10 + 2 * 300 * 10


def test_an_update_is_cut_into_equal_mini_batches_never_a_tail():
    """Each mini-batch is an optimizer step: an async update of 72 samples at mini_batch_size 64 is two
    steps of 36, not 64 and a step on 8 samples; never more steps than ceil(count / size), never a part
    over ``size``, parts differing by one sample at most, the samples in order."""
    from areal_bus.train.packing import mini_batches

    assert [len(r) for r in mini_batches(72, 64)] == [36, 36]
    assert [len(r) for r in mini_batches(128, 64)] == [64, 64]  # a full synchronous batch as before
    assert [len(r) for r in mini_batches(7, 3)] == [3, 2, 2]
    assert mini_batches(0, 4) == []
    for count in range(1, 200):
        for size in (1, 2, 3, 8, 32, 64, 500):
            parts = mini_batches(count, size)
            assert [i for r in parts for i in r] == list(range(count))
            assert len(parts) == -(-count // size)
            assert max(map(len, parts)) <= size and max(map(len, parts)) - min(map(len, parts)) <= 1
