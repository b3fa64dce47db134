"""The decoupled PPO loss and GRPO advantages against numbers worked out from the formulas.

Every expected value is written from AReaL's eq. 5 (or the GRPO normalisation) with plain numpy on
tiny float64 tensors, never by calling the code under test. Run: ``.venv/bin/pytest tests/test_loss.py``.
"""

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from areal_bus.train.loss import decoupled_ppo_loss, grpo_advantages, kl_penalty, masked_mean  # noqa: E402


def f64(x):
    return torch.tensor(x, dtype=torch.float64)


def inputs(ratio, weight, adv, mask=None, prox=-1.0):
    """Logprob tensors that realise the given ratios r and importance weights w exactly."""
    ratio, weight = np.asarray(ratio, float), np.asarray(weight, float)
    prox = np.full_like(ratio, prox)
    logp = f64(prox + np.log(ratio)).requires_grad_()
    mask = np.ones_like(ratio) if mask is None else np.asarray(mask, float)
    return logp, f64(prox), f64(prox - np.log(weight)), f64(adv), f64(mask)


def test_negative_advantage_is_clipped_only_below_one_minus_eps():
    # r = 0.5 < 0.8 with A = -1: the clipped term (0.8 * -1) is the min -> l = 0.8, no gradient.
    # r = 1.1 with A = -1 and r = 0.5 with A = +1 are not clipped: l = -r * A.
    logp, prox, behav, adv, mask = inputs([0.5, 1.1, 0.5], [1, 1, 1], [-1.0, -1.0, 1.0])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask)
    assert loss.item() == pytest.approx((0.8 + 1.1 - 0.5) / 3, abs=1e-12)
    assert stats["clip_fraction"] == pytest.approx(1 / 3)
    loss.backward()
    np.testing.assert_allclose(logp.grad.numpy(), [0.0, 1.1 / 3, -0.5 / 3], atol=1e-12)


def test_positive_advantage_is_clipped_only_above_one_plus_eps():
    # r = 1.5 > 1.2 with A = 2: l = -1.2 * 2; r = 1.5 with A = -2 is unclipped: l = -1.5 * -2 = 3.
    logp, prox, behav, adv, mask = inputs([1.5, 1.5], [1, 1], [2.0, -2.0])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask)
    assert loss.item() == pytest.approx((-2.4 + 3.0) / 2, abs=1e-12)
    assert stats["clip_fraction"] == pytest.approx(0.5)


def test_eps_clip_high_widens_only_the_upper_bound():
    # eps_clip = 0.2, eps_clip_high = 0.28: r = 1.25 (A=1) is inside, r = 1.4 (A=1) clips at 1.28,
    # r = 0.5 (A=-1) still clips at 0.8.
    logp, prox, behav, adv, mask = inputs([1.25, 1.4, 0.5], [1, 1, 1], [1.0, 1.0, -1.0])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2, eps_clip_high=0.28)
    assert loss.item() == pytest.approx((-1.25 - 1.28 + 0.8) / 3, abs=1e-12)
    assert stats["clip_fraction"] == pytest.approx(2 / 3)
    symmetric, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2)
    assert symmetric.item() == pytest.approx((-1.2 - 1.2 + 0.8) / 3, abs=1e-12)


def test_importance_weight_scales_each_token():
    logp, prox, behav, adv, mask = inputs([1.1, 0.9], [2.0, 0.5], [1.0, -3.0])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask)
    assert loss.item() == pytest.approx((-2.0 * 1.1 * 1.0 - 0.5 * 0.9 * -3.0) / 2, abs=1e-12)
    assert stats["mean_w"] == pytest.approx(1.25)
    assert stats["mean_r"] == pytest.approx(1.0)


def test_capped_token_leaves_the_numerator_but_stays_in_the_denominator():
    # w = [2, 6, 1] with cap 5: the middle token is dropped, the mean is still over 3 tokens.
    logp, prox, behav, adv, mask = inputs([1.1, 1.0, 0.9], [2.0, 6.0, 1.0], [1.0, 1.0, 1.0])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_imp_weight_cap=5.0)
    assert loss.item() == pytest.approx((-2.0 * 1.1 - 1.0 * 0.9) / 3, abs=1e-12)
    assert stats["capped_fraction"] == pytest.approx(1 / 3)
    assert stats["mean_w"] == pytest.approx(3.0)  # over every masked-in token, capped one included
    loss.backward()
    np.testing.assert_allclose(logp.grad.numpy(), [-2.2 / 3, 0.0, -0.9 / 3], atol=1e-12)


def test_cap_none_keeps_every_token():
    logp, prox, behav, adv, mask = inputs([1.1, 1.0, 0.9], [2.0, 600.0, 1.0], [1.0, 1.0, 1.0])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_imp_weight_cap=None)
    assert loss.item() == pytest.approx((-2.0 * 1.1 - 600.0 * 1.0 - 0.9) / 3, abs=1e-9)
    assert stats["capped_fraction"] == 0.0


def test_partial_mask_counts_only_masked_in_tokens():
    # The masked-out token would be both clipped and capped; it must change nothing.
    logp, prox, behav, adv, mask = inputs(
        [1.1, 3.0, 0.9, 1.0], [1, 50, 1, 1], [1.0, 9.0, 2.0, -1.0], mask=[1, 0, 1, 1]
    )
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask)
    assert loss.item() == pytest.approx((-1.1 - 1.8 + 1.0) / 3, abs=1e-12)
    assert stats["mean_r"] == pytest.approx((1.1 + 0.9 + 1.0) / 3)
    assert stats["capped_fraction"] == 0.0 and stats["clip_fraction"] == 0.0


def test_infinite_padding_under_the_mask_leaves_loss_and_grad_finite():
    logp = f64([-1.0, -np.inf]).requires_grad_()
    prox, behav = f64([-1.2, -np.inf]), f64([-1.1, 0.0])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, f64([1.0, 1.0]), f64([1.0, 0.0]))
    r, w = np.exp(0.2), np.exp(-0.1)
    assert loss.item() == pytest.approx(-w * min(r, 1.2), abs=1e-12)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[1].item() == 0.0
    assert all(np.isfinite(v) for v in stats.values())


def test_empty_mask_gives_zero_loss_that_still_backpropagates():
    logp, prox, behav, adv, mask = inputs([1.5, 0.5], [1, 1], [1.0, 1.0], [0, 0])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert logp.grad.abs().sum().item() == 0.0
    assert set(stats) >= {"clip_fraction", "capped_fraction", "mean_w", "mean_r", "approx_kl"}
    assert all(v == 0.0 for v in stats.values())


def test_gradient_is_analytic_and_skips_proximal_and_behavior():
    gen = torch.Generator().manual_seed(0)
    n = 64
    logp = (-torch.rand(n, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    prox = (logp.detach() + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)).requires_grad_()
    behav = (prox.detach() + 0.8 * torch.randn(n, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    mask = (torch.rand(n, generator=gen) < 0.8).to(torch.float64)
    loss, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2, behav_imp_weight_cap=2.0)
    loss.backward()

    lp, px, bh, a, m = (t.detach().numpy() for t in (logp, prox, behav, adv, mask))
    r, w = np.exp(lp - px), np.exp(px - bh)
    clipped = np.clip(r, 0.8, 1.2) * a < r * a
    kept = (m > 0) & (w <= 2.0)
    # d/dlogp of -w * r * A is -w * r * A; clipped and capped tokens contribute nothing.
    expected = np.where(kept & ~clipped, -w * r * a, 0.0) / m.sum()
    assert clipped[m > 0].any() and (~kept & (m > 0)).any()  # the draw exercises both branches
    np.testing.assert_allclose(logp.grad.numpy(), expected, atol=1e-12)
    assert prox.grad is None and behav.grad is None


def test_equals_standard_ppo_when_behavior_is_proximal():
    gen = torch.Generator().manual_seed(1)
    n = 32
    prox = -torch.rand(n, generator=gen, dtype=torch.float64) * 2
    logp = (prox + 0.4 * torch.randn(n, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    mask = (torch.rand(n, generator=gen) < 0.7).to(torch.float64)
    loss, stats = decoupled_ppo_loss(logp, prox, prox.clone(), adv, mask)

    r = np.exp(logp.detach().numpy() - prox.numpy())
    a, m = adv.numpy(), mask.numpy()
    ppo = -np.minimum(r * a, np.clip(r, 0.8, 1.2) * a)
    assert loss.item() == pytest.approx((ppo * m).sum() / m.sum(), abs=1e-12)
    assert stats["mean_w"] == pytest.approx(1.0) and stats["capped_fraction"] == 0.0


def test_approx_kl_is_k3_of_the_ratio():
    logp, prox, behav, adv, mask = inputs([1.1, 0.8], [1, 1], [1.0, 1.0])
    _, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask)
    expected = np.mean([r - 1 - np.log(r) for r in (1.1, 0.8)])
    assert stats["approx_kl"] == pytest.approx(expected, abs=1e-12)
    assert all(isinstance(v, float) for v in stats.values())


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match="advantages"):
        decoupled_ppo_loss(f64([0.0, 0.0]), f64([0.0, 0.0]), f64([0.0, 0.0]), f64([1.0]), f64([1.0, 1.0]))


def test_package_exports_the_loss_without_importing_torch_eagerly():
    from areal_bus import decoupled_ppo_loss as exported
    from areal_bus import grpo_advantages as exported_adv

    assert exported is decoupled_ppo_loss and exported_adv is grpo_advantages
    code = "import sys, areal_bus; assert 'torch' not in sys.modules; areal_bus.grpo_advantages"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_grpo_advantages_normalise_each_group():
    # group 7: [1, 0, 1, 0], mean 0.5, population std 0.5; group 3: all equal -> 0; group 9 singleton.
    rewards = f64([1.0, 5.0, 0.0, 5.0, 1.0, 2.0, 0.0])
    groups = torch.tensor([7, 3, 7, 3, 7, 9, 7])
    adv = grpo_advantages(rewards, groups)
    s = 0.5 + 1e-6
    np.testing.assert_allclose(adv.numpy(), [0.5 / s, 0, -0.5 / s, 0, 0.5 / s, 0, -0.5 / s], atol=1e-12)
    assert adv.shape == rewards.shape and adv.dtype == torch.float64


def test_grpo_advantages_without_std_division():
    adv = grpo_advantages(f64([3.0, 1.0, 2.0, 10.0]), ["a", "a", "a", "b"], std_normalize=False)
    np.testing.assert_allclose(adv.numpy(), [1.0, -1.0, 0.0, 0.0], atol=1e-12)


def test_grpo_leave_one_out_uses_mean_of_the_others_and_group_std():
    rewards = [1.0, 0.0, 0.0]
    no_std = grpo_advantages(f64(rewards), [0, 0, 0], std_normalize=False, leave_one_out=True)
    np.testing.assert_allclose(no_std.numpy(), [1.0 - 0.0, 0.0 - 0.5, 0.0 - 0.5], atol=1e-12)
    std = np.std(rewards)  # population std of the whole group: sqrt(2) / 3
    adv = grpo_advantages(f64(rewards), [0, 0, 0], leave_one_out=True)
    np.testing.assert_allclose(adv.numpy(), np.array([1.0, -0.5, -0.5]) / (std + 1e-6), atol=1e-12)
    # Leave-one-out is the plain advantage scaled by n / (n - 1).
    plain = grpo_advantages(f64(rewards), [0, 0, 0])
    np.testing.assert_allclose(adv.numpy(), 1.5 * plain.numpy(), atol=1e-12)


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("std_normalize", [False, True])
def test_grpo_singleton_group_gets_zero(std_normalize, leave_one_out):
    adv = grpo_advantages(f64([4.0, 1.0, 0.0]), [0, 1, 1], std_normalize, leave_one_out)
    assert adv[0].item() == 0.0
    assert torch.isfinite(adv).all()


def test_grpo_integer_rewards_become_float():
    adv = grpo_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]), std_normalize=False)
    assert adv.is_floating_point()
    np.testing.assert_allclose(adv.numpy(), [0.5, -0.5])


def test_kl_penalty_k1_and_k3():
    logp = f64([-1.0, -2.0]).requires_grad_()
    ref = f64([-1.5, -1.0]).requires_grad_()
    np.testing.assert_allclose(kl_penalty(logp, ref, "k1").detach().numpy(), [0.5, -1.0], atol=1e-12)
    k3 = kl_penalty(logp, ref, "k3")
    d = np.array([-0.5, 1.0])  # ref - logp
    np.testing.assert_allclose(k3.detach().numpy(), np.exp(d) - d - 1, atol=1e-12)
    k3.sum().backward()
    assert ref.grad is None
    np.testing.assert_allclose(logp.grad.numpy(), 1 - np.exp(d), atol=1e-12)
    with pytest.raises(ValueError, match="k2"):
        kl_penalty(logp, ref, "k2")


def test_masked_mean_ignores_masked_out_entries_and_empty_masks():
    x = f64([1.0, np.nan, 3.0]).requires_grad_()
    assert masked_mean(x, torch.tensor([True, False, True])).item() == pytest.approx(2.0)
    empty = masked_mean(x, torch.tensor([False, False, False]))
    assert empty.item() == 0.0 and empty.requires_grad


def test_tensor_stats_are_the_same_numbers_left_on_the_device():
    g = torch.Generator().manual_seed(3)
    lp, prox, behav = (torch.randn(40, generator=g) * 0.3 - 2.0 for _ in range(3))
    adv, mask = torch.randn(40, generator=g), (torch.rand(40, generator=g) > 0.3).float()
    loss_f, floats = decoupled_ppo_loss(lp, prox, behav, adv, mask, eps_clip=0.1, behav_imp_weight_cap=1.2)
    loss_t, tensors = decoupled_ppo_loss(lp, prox, behav, adv, mask, eps_clip=0.1, behav_imp_weight_cap=1.2,
                                         tensor_stats=True)
    assert loss_t.item() == loss_f.item()
    assert set(tensors) == set(floats) and all(isinstance(v, float) for v in floats.values())
    for k, v in tensors.items():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad
        assert v.item() == floats[k], k
    assert 0 < floats["clip_fraction"] < 1 and 0 < floats["capped_fraction"] < 1  # the case exercises both


def test_loglinear_proximal_interpolates_by_staleness():
    from areal_bus.train.loss import loglinear_proximal

    behav = torch.tensor([-2.0, -2.0, -2.0, -2.0])
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0], requires_grad=True)
    lag = torch.tensor([0.0, 1.0, 2.0, 3.0])
    prox = loglinear_proximal(behav, logp, lag)
    # versions: sampler v - lag, proximal v, optimised v + 1: alpha = lag / (lag + 1)
    torch.testing.assert_close(prox, torch.tensor([-2.0, -1.5, -2.0 + 2 / 3, -1.25]))
    assert not prox.requires_grad  # an anchor, not a path for the gradient
