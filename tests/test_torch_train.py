"""The real trainer engine: one update moves the weights the right way, the proximal recompute matches
what the engine recorded, and a checkpoint resumes exactly (weights, optimizer, version, consumed ids)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from areal_bus.engines.torch_engine import TorchRolloutEngine
from areal_bus.engines.torch_train import TorchTrainEngine, pad_batch
from areal_bus.episode import EpisodeRecord
from areal_bus.wire.messages import GenerateRequest
from areal_bus.model.modeling import load_pretrained, token_logprobs
from areal_bus.config.topology import parse_topology
from nodes.trainer.recovery import resume_state


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


def _topo(model_dir, **over):
    data = {"async": {"enabled": True}, "global_batch_size": 8, "trigger_batch_size": 4, "mini_batch_size": 4,
            "learning_rate": 1e-2, "model": {"path": str(model_dir)},
            "agent": {"framework": "guess"}, "rollout_engine": {"kind": "torch", "temperature": 1.0},
            "trainer_engine": {"kind": "torch"}}
    data.update(over)
    return parse_topology(data)


def _episodes(model_dir, n=8, group=4, outputs=None):
    """Real completions from the engine, as the agent would record them (one turn each); ``outputs``:
    each one's length (6 tokens each otherwise)."""
    engine = TorchRolloutEngine(model_dir, max_batch=n, max_len=64, eos_token_ids=[], seed=1)
    prompts = np.random.default_rng(0).integers(1, 50, (n // group, 6)).astype(np.int32)
    for i in range(n):
        engine.add_request(GenerateRequest(f"r{i}", f"e{i}", i, 0, outputs[i] if outputs else 6, 1.0,
                                           prompts[i // group], group_id=f"g{i // group}"))
    done = []
    while len(done) < n:
        done += engine.step()
    trajs = []
    for comp in sorted(done, key=lambda c: c.request_id):
        i = int(comp.request_id[1:])
        rec = EpisodeRecord(comp.episode_id, prompts[i // group], group_id=f"g{i // group}", ticket=i)
        rec.add_completion(comp)
        trajs.append(rec.to_trajectory(reward=float(i % 2)))  # half of each group wins
    return trajs


def test_proximal_recompute_matches_the_engines_recorded_logprobs(model_dir):
    trajs = _episodes(model_dir)
    data = pad_batch(trajs, torch.zeros(len(trajs)))
    model = load_pretrained(model_dir)
    with torch.no_grad():
        prox = token_logprobs(model, data["ids"], data["attn"], 1.0)
    mask = data["mask"].bool()
    assert torch.allclose(prox[mask], data["behav"][mask], atol=1e-4)


def test_an_update_raises_the_likelihood_of_rewarded_samples(model_dir):
    trajs = _episodes(model_dir)
    engine = TorchTrainEngine(_topo(model_dir), model_dir)
    data = pad_batch(trajs, torch.zeros(len(trajs)))
    before = load_pretrained(model_dir)

    def seq_logp(model):
        with torch.no_grad():
            lp = token_logprobs(model, data["ids"], data["attn"], 1.0)
        return (lp * data["mask"]).sum(-1)

    lp0 = seq_logp(before)
    stats = engine.train(trajs, version=0)
    lp1 = seq_logp(engine.model.eval())
    won = torch.tensor([t.reward == 1.0 for t in trajs])
    assert np.isfinite(stats["loss"]) and stats["reward"] == pytest.approx(0.5)
    assert (lp1 - lp0)[won].mean() > (lp1 - lp0)[~won].mean()
    assert stats["mean_w"] == pytest.approx(1.0, abs=1e-3)  # behaviour == proximal: fresh samples


def test_dropped_members_rewards_move_their_groups_baseline(model_dir):
    """A group's survivors judged against the whole group: with two dropped losers (reward 0) in each
    group's baseline, the winners' advantage grows and the losers' shrinks in size: a different update."""
    from areal_bus.train.loss import grpo_advantages

    trajs = _episodes(model_dir)
    baseline = [(g, 0.0) for g in ("g0", "g1") for _ in range(2)]
    rewards = [t.reward for t in trajs]
    alone = grpo_advantages(rewards, [t.group_id for t in trajs])
    whole = grpo_advantages(rewards + [0.0] * 4, [t.group_id for t in trajs] + [g for g, _ in baseline])[:8]
    assert (whole > alone).all()  # winners 1.0 -> 1.41, losers -1.0 -> -0.71
    first = TorchTrainEngine(_topo(model_dir), model_dir)
    second = TorchTrainEngine(_topo(model_dir), model_dir)
    a = first.train(trajs, version=0)
    b = second.train(trajs, version=0, baseline=baseline)
    assert a["loss"] != pytest.approx(b["loss"], rel=1e-3)
    moved = [not torch.equal(p, q) for p, q in zip(first.model.parameters(), second.model.parameters())]
    assert any(moved)


def test_first_mini_batchs_forward_as_its_proximal_pass_makes_the_same_update(model_dir):
    """Two mini-batches, two PPO epochs: taking the first mini-batch's proximal log-probabilities from its
    own training forward (no dropout, no step yet) trains exactly as a separate proximal pass does."""
    from areal_bus.engines.torch_train import dropout_free

    trajs = _episodes(model_dir)
    topo = _topo(model_dir, trainer_engine={"kind": "torch", "ppo_epochs": 2})
    runs = []
    for reuse in (True, False):
        engine = TorchTrainEngine(topo, model_dir)
        assert engine.forward_is_proximal and dropout_free(engine.model)
        engine.forward_is_proximal = reuse
        runs.append(_trained(engine, trajs))
    _assert_same_update(*runs)
    moved = torch.cat([p.flatten() for p in TorchTrainEngine(topo, model_dir).model.parameters()])
    assert not torch.allclose(runs[0][1], moved)  # the update did move the weights


def _trained(engine, trajs) -> tuple[dict, torch.Tensor]:
    """(one update's diagnostics, the weights after it, flat)."""
    stats = engine.train(trajs, version=0)
    return stats, torch.cat([p.detach().flatten() for p in engine.model.parameters()])


def _assert_same_update(a, b) -> None:
    for k in ("loss", "entropy", "mean_r", "mean_w", "clip_fraction", "grad_norm"):
        assert a[0][k] == pytest.approx(b[0][k], rel=1e-5, abs=1e-7), k
    torch.testing.assert_close(a[1], b[1], atol=1e-6, rtol=1e-5)


def test_per_lag_diagnostics_split_tokens_by_how_stale_their_sampler_was(model_dir):
    """Half the trajectories sampled two versions before the trained weights, with behaviour logprobs
    0.5 off the policy's: the update's lag diagnostics put their tokens in lag2 with |log w| = 0.5 and
    the fresh half in lag0 with |log w| ~ 0; no token has lag 1 or 3+."""
    import dataclasses

    trajs = _episodes(model_dir)
    mixed = []
    for i, t in enumerate(trajs):
        if i % 2:  # stale: sampled at version 3 for the update of version 5, logprobs off by 0.5
            t = dataclasses.replace(t, versions=np.full_like(t.versions, 3), logprobs=t.logprobs - 0.5)
        else:
            t = dataclasses.replace(t, versions=np.full_like(t.versions, 5))
        mixed.append(t)
    stats = TorchTrainEngine(_topo(model_dir), model_dir).train(mixed, version=5)
    assert stats["lag0.tokens"] + stats["lag2.tokens"] == pytest.approx(1.0)
    assert stats["lag2.tokens"] == pytest.approx(0.5, abs=0.2)  # equal-length outputs: about half
    assert stats["lag1.tokens"] == 0.0 and stats["lag3+.tokens"] == 0.0
    assert stats["lag0.abs_log_w"] < 1e-3
    assert stats["lag2.abs_log_w"] == pytest.approx(0.5, abs=1e-3)
    assert stats["lag0.capped"] == 0.0 and stats["lag2.capped"] == 0.0  # w = e^0.5 < 5


def test_a_model_with_dropout_keeps_its_own_proximal_pass(model_dir):
    from areal_bus.engines.torch_train import dropout_free

    engine = TorchTrainEngine(_topo(model_dir), model_dir)
    engine.model.config.attention_dropout = 0.1
    assert not dropout_free(engine.model)


def test_bf16_compute_copy_and_autocast_make_the_same_update_over_float32_masters(model_dir):
    """model.dtype bfloat16: both mixed-precision modes keep float32 masters and AdamW state and make the
    update the float32 engine makes, up to bf16 rounding; the copy is the masters cast after the step."""
    trajs = _episodes(model_dir)
    deltas = {}
    for name, over in {"fp32": {}, "copy": {"dtype": "bfloat16"},
                       "autocast": {"dtype": "bfloat16"}}.items():
        topo = _topo(model_dir, learning_rate=1e-3, model={"path": str(model_dir), **over},
                     trainer_engine={"kind": "torch", "mixed_precision": "autocast" if name == "autocast" else
                                     "compute_copy"})
        engine = TorchTrainEngine(topo, model_dir)
        assert (engine.copy is not None) == (name == "copy")
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        stats = engine.train(trajs, version=0)
        assert np.isfinite(stats["loss"])
        assert all(v.dtype == torch.float32 for v in engine.state_dict().values())
        assert all(s["exp_avg"].dtype == torch.float32 for s in engine.opt.state.values())
        deltas[name] = torch.cat([(engine.state_dict()[k] - before[k]).flatten() for k in before])
        if engine.copy is not None:
            for k, v in engine.run.lm.state_dict().items():
                assert torch.equal(v, engine.state_dict()[k].to(v.dtype)), k
    for name in ("copy", "autocast"):
        cos = torch.nn.functional.cosine_similarity(deltas[name], deltas["fp32"], dim=0)
        assert cos > 0.95, (name, float(cos))


def test_checkpoint_resumes_weights_optimizer_version_and_consumed_ids(model_dir, tmp_path):
    trajs = _episodes(model_dir)
    topo = _topo(model_dir)
    engine = TorchTrainEngine(topo, model_dir)
    engine.train(trajs, version=0)
    ckpt_dir = tmp_path / "checkpoints"
    engine.save_checkpoint(ckpt_dir / "step_1", 1, [t.traj_id for t in trajs])
    assert (ckpt_dir / "step_1" / "config.json").exists() and not (ckpt_dir / "step_1.tmp").exists()

    folder, version, consumed = resume_state(ckpt_dir)
    assert (folder, version, consumed) == (ckpt_dir / "step_1", 1, [t.traj_id for t in trajs])
    resumed = TorchTrainEngine(topo, folder)
    resumed.load_optimizer(folder)
    for (name, a), b in zip(engine.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    # The same next update from both gives the same weights: the optimizer state came back too.
    engine.train(trajs, version=1)
    resumed.train(trajs, version=1)
    for (name, a), b in zip(engine.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["version"] == 1


def test_resume_state_of_an_empty_folder_is_a_fresh_start(tmp_path):
    assert resume_state(tmp_path / "none") == (None, 0, [])


@pytest.mark.parametrize("saved_fused,own_fused", [(False, True), (True, False)])
def test_optimizer_state_loads_across_step_kernels_keeping_this_processs_own(saved_fused, own_fused):
    # A checkpoint of the multi-tensor path resumed by a fused optimizer (one GPU), and the other way
    # round: the state comes back, the step options stay this optimizer's, and it steps on.
    from areal_bus.engines.torch_train import load_optimizer_keeping_options

    torch.manual_seed(0)
    src = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    saver = torch.optim.AdamW(src, lr=1e-2, fused=saved_fused or None)
    for _ in range(3):
        sum((p ** 2).sum() for p in src).backward()
        saver.step()
        saver.zero_grad()
    dst = [torch.nn.Parameter(p.detach().clone()) for p in src]
    loader = torch.optim.AdamW(dst, lr=1e-2, fused=own_fused or None)
    load_optimizer_keeping_options(loader, copy.deepcopy(saver.state_dict()))  # as optimizer.pt would hold it
    assert bool(loader.param_groups[0]["fused"]) == own_fused
    for a, b in zip(src, dst):
        torch.testing.assert_close(loader.state[b]["exp_avg"], saver.state[a]["exp_avg"])
        assert float(loader.state[b]["step"]) == 3.0
    for params, opt in ((src, saver), (dst, loader)):  # one more step each: the same weights
        sum((p ** 2).sum() for p in params).backward()
        opt.step()
    for a, b in zip(src, dst):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_padded_micro_batches_make_the_same_update(model_dir):
    """trainer_engine.micro_batch_pad_tokens rounds each micro-batch up with a masked segment of its own:
    the update, its diagnostics and the entropy are those of the unpadded micro-batches."""
    trajs = _episodes(model_dir)
    runs = []
    for pad in (1, 48):
        engine_cfg = {"kind": "torch", "micro_batch_tokens": 40, "micro_batch_pad_tokens": pad}
        topo = _topo(model_dir, trainer_engine=engine_cfg)
        engine = TorchTrainEngine(topo, model_dir)
        assert engine.pad_to == pad
        runs.append(_trained(engine, trajs))
    _assert_same_update(*runs)


def test_micro_batches_regrouped_to_pad_less_make_the_same_update(model_dir):
    """With padding, a mini-batch's samples are grouped into micro-batches to need less of it (not in
    their order): the update is the unpadded one in order."""
    from areal_bus.train.packing import _groups

    outputs = [2, 3, 9, 2, 8, 1, 4, 3]  # + 6 prompt tokens: 8 9 15 8 | 14 7 10 9
    lengths = [6 + n for n in outputs]
    for mb in (lengths[:4], lengths[4:]):
        assert _groups(mb, 24, pad_to=8) != _groups(mb, 24)  # regrouped: the case under test
    trajs = _episodes(model_dir, outputs=outputs)
    assert [t.prompt_ids.size + t.output_ids.size for t in trajs] == lengths
    runs = []
    for pad in (1, 8):
        engine_cfg = {"kind": "torch", "micro_batch_tokens": 24, "micro_batch_pad_tokens": pad}
        topo = _topo(model_dir, trainer_engine=engine_cfg)
        runs.append(_trained(TorchTrainEngine(topo, model_dir), trajs))
    _assert_same_update(*runs)


def test_mini_batches_aligned_to_the_padding_make_the_update_of_their_members(model_dir):
    """With padding, neighbouring mini-batches trade samples so their totals need less of it: the update
    is the unpadded one whose in-order mini-batches are those members (the optimizer steps see the
    samples the alignment chose, and nothing else changes)."""
    from areal_bus.train.packing import mini_batch_members

    outputs = [2, 3, 9, 3, 8, 1, 4, 2]  # + 6 prompt tokens: 8 9 15 9 | 14 7 10 8
    lengths = [6 + n for n in outputs]
    members = mini_batch_members(lengths, 4, pad_to=8)
    assert members != [[0, 1, 2, 3], [4, 5, 6, 7]]  # traded: the case under test
    trajs = _episodes(model_dir, outputs=outputs)
    cfg = lambda pad: {"kind": "torch", "micro_batch_tokens": 64, "micro_batch_pad_tokens": pad}
    aligned = _trained(TorchTrainEngine(_topo(model_dir, trainer_engine=cfg(8)), model_dir), trajs)
    reordered = [trajs[i] for m in members for i in m]
    in_order = _trained(TorchTrainEngine(_topo(model_dir, trainer_engine=cfg(1)), model_dir), reordered)
    _assert_same_update(aligned, in_order)
    unaligned = _trained(TorchTrainEngine(_topo(model_dir, trainer_engine=cfg(1)), model_dir), trajs)
    assert not torch.allclose(unaligned[1], aligned[1], atol=1e-6, rtol=1e-5)  # the members matter


def test_kept_logit_gradients_make_the_same_update(model_dir):
    """trainer_engine.logit_grad_keep_gib: the head's logit gradients made in the forward and kept
    (default on CPU: 1 GiB) or recomputed in backward (0): the same update."""
    trajs = _episodes(model_dir)
    runs = []
    for keep in (0, None):
        engine = TorchTrainEngine(_topo(model_dir, trainer_engine={"kind": "torch", "logit_grad_keep_gib": keep}),
                                  model_dir)
        assert engine.keep_bytes == (0 if keep == 0 else 2**30)
        runs.append(_trained(engine, trajs))
    for k in ("loss", "entropy", "mean_r", "mean_w", "clip_fraction", "grad_norm"):
        assert runs[0][0][k] == pytest.approx(runs[1][0][k], rel=1e-5, abs=1e-7), k
    # float32 sums in another order (the upstream gradient applied to the hidden states, not the logits')
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=1e-5, rtol=1e-4)


def test_the_head_on_the_loss_tokens_only_makes_the_same_update(model_dir, monkeypatch):
    """The engine packs with loss_only: the lm_head runs on the loss's tokens (not the prompts), and the
    update, its diagnostics and the entropy are those of the head over every position."""
    import areal_bus.engines.torch_train as torch_train
    from areal_bus.train import packing

    trajs = _episodes(model_dir)
    runs, head_rows = [], []
    for loss_only in (False, True):
        def packs(*args, _flag=loss_only, loss_only=True, **kwargs):
            out = packing.pack_rows(*args, loss_only=_flag, **kwargs)
            head_rows.append(sum(p.tokens if p.head is None else p.head.numel() for p in out))
            return out
        monkeypatch.setattr(torch_train, "pack_rows", packs)
        runs.append(_trained(TorchTrainEngine(_topo(model_dir), model_dir), trajs))
    _assert_same_update(*runs)
    half = len(head_rows) // 2
    assert sum(head_rows[half:]) < sum(head_rows[:half])  # the prompts' rows skipped the head


def test_loglinear_proximal_makes_the_recomputed_update_on_fresh_samples_with_one_forward_per_micro_batch(model_dir):
    """trainer_engine.prox_logp_method loglinear (AReaL's): no proximal pass. On samples of the trained
    version (lag 0) the interpolated anchor is the sampler's own log-probability, which the recompute
    matches (test_proximal_recompute_matches_the_engines_recorded_logprobs): the same update, with one
    forward per micro-batch where the recompute makes one more for every mini-batch after the first."""
    trajs = _episodes(model_dir)
    runs, forwards = [], []
    for method in ("recompute", "loglinear"):
        engine = TorchTrainEngine(_topo(model_dir, trainer_engine={"kind": "torch", "prox_logp_method": method},
                                        experimental=True), model_dir)  # loglinear is experimental
        calls = []
        engine.run.register_forward_pre_hook(lambda *_: calls.append(1))
        runs.append(_trained(engine, trajs))
        forwards.append(len(calls))
    assert forwards == [3, 2]  # two mini-batches of one micro-batch each
    # (The entropy differs: without a proximal pass the second mini-batch's is read after the first step.)
    for k in ("loss", "mean_w", "grad_norm"):
        assert runs[0][0][k] == pytest.approx(runs[1][0][k], rel=1e-3, abs=1e-5), k
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=1e-5, rtol=1e-4)


def test_the_engine_steps_on_equal_mini_batches(model_dir):
    """6 samples at mini_batch_size 4: two optimizer steps of 3 samples each (not 4 and 2)."""
    trajs = _episodes(model_dir)[:6]
    engine = TorchTrainEngine(_topo(model_dir), model_dir)
    plans, _ = engine._plans(pad_batch(trajs, torch.zeros(len(trajs))))
    assert [sum(len(p.rows) for p, _ in plans[k]) for k in range(len(plans))] == [3, 3]
    steps = []
    engine.opt.register_step_post_hook(lambda *_: steps.append(1))
    engine.train(trajs, version=0)
    assert len(steps) == 2


def test_per_token_bound_masks_the_tokens_over_it_and_trains_the_rest(model_dir):
    """staleness.per_token on the engine: at version 3 with bound 1, tokens sampled by versions 0-1 are left
    out of the loss (counted as tokens_over_bound); the update equals one on the same samples with those
    tokens' loss mask 0 by hand, and differs from the unmasked update."""
    base = _episodes(model_dir)[:4]
    aged = []
    for t in base:
        t = copy.deepcopy(t)
        n = t.versions.size
        t.versions = np.where(np.arange(n) < n // 2, 1, 3).astype(np.int32)  # first half two versions behind
        aged.append(t)
    bounded = {"staleness_threshold": 1, "staleness": {"drop_at_consume": True, "per_token": True},
               "experimental": True}  # staleness.per_token is experimental
    runs = {}
    for name, over, trajs in (("per_token", bounded, aged), ("whole", {"staleness_threshold": 1}, aged)):
        engine = TorchTrainEngine(_topo(model_dir, learning_rate=1e-3, **over), model_dir)
        stats = engine.train(trajs, version=3)
        runs[name] = (stats, engine.state_dict())
    by_hand = []
    for t in aged:
        t = copy.deepcopy(t)
        t.loss_mask = np.where(t.versions >= 2, t.loss_mask, 0).astype(np.uint8)
        by_hand.append(t)
    engine = TorchTrainEngine(_topo(model_dir, learning_rate=1e-3, staleness_threshold=1), model_dir)
    hand_stats = engine.train(by_hand, version=3)
    assert runs["per_token"][0]["tokens_over_bound"] == sum(int((t.versions < 2).sum()) for t in aged) > 0
    assert "tokens_over_bound" not in runs["whole"][0]
    assert runs["per_token"][0]["loss"] == pytest.approx(hand_stats["loss"], abs=1e-6)
    for k, w in engine.state_dict().items():
        torch.testing.assert_close(runs["per_token"][1][k], w, atol=1e-7, rtol=1e-6)
    assert any(not torch.allclose(runs["whole"][1][k], w) for k, w in engine.state_dict().items())


def test_loss_token_norm_weighs_a_sample_alike_whatever_shares_its_mini_batch(model_dir):
    """trainer_engine.loss_token_norm (Dr. GRPO's constant normaliser): sample A's gradient is the same
    beside a short or a long zero-advantage sample B; with the default token-mean, B's tokens dilute it.
    The constant's loss is the token-mean loss x tokens / (samples x N), in one micro-batch or several."""
    a, b = _episodes(model_dir)[:2]
    short = copy.deepcopy(b)
    for name in ("output_ids", "logprobs", "versions", "loss_mask"):
        setattr(short, name, getattr(short, name)[:2].copy())
    adv = torch.tensor([1.0, 0.0])
    seen = {}
    for norm in (None, 8):
        for tag, other in (("short", short), ("long", b)):
            for micro in (16384, 16):
                te = {"kind": "torch", "loss_token_norm": norm, "micro_batch_tokens": micro}
                engine = TorchTrainEngine(_topo(model_dir, mini_batch_size=2, trainer_engine=te), model_dir)
                seen[norm, tag, micro] = engine.update(pad_batch([a, other], adv, 0))
    for tag in ("short", "long"):
        for micro in (16384, 16):
            assert seen[8, tag, micro]["grad_norm"] == pytest.approx(seen[8, "short", 16384]["grad_norm"], rel=1e-4)
            tokens = a.output_ids.size + (short if tag == "short" else b).output_ids.size
            assert seen[8, tag, micro]["loss"] == pytest.approx(seen[None, tag, micro]["loss"] * tokens / (2 * 8),
                                                                rel=1e-4, abs=1e-7)
    assert seen[None, "long", 16384]["grad_norm"] < 0.9 * seen[None, "short", 16384]["grad_norm"]
