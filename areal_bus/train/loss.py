"""The trainer's objective: AReaL's staleness-aware (decoupled) PPO loss and GRPO advantages.

Pure torch functions, no sockets and no state, shared by whichever node trains (and by tests and
benchmarks). Everything is element-wise over tokens: callers pass tensors of one shape (usually
``[batch, seq]`` or a packed ``[tokens]``) with a ``loss_mask`` selecting the generated tokens.

Why a *decoupled* objective (AReaL, arXiv 2505.24298, eq. 5): in asynchronous RL the rollout engine
samples with weights that may be several versions older than the trainer's. Standard PPO uses the
sampling policy both as the trust-region anchor and as the importance-sampling denominator; AReaL
splits those two roles:

* the *behavior* policy ``pi_behav`` is the one that actually sampled each token (its logprobs come
  back from the rollout engine with the sample, possibly from different versions within one
  trajectory). Off-policy correction against it is the importance weight
  ``w = pi_prox / pi_behav``.
* the *proximal* policy ``pi_prox`` is the trainer's current weights *before* this update step; the
  trainer recomputes its logprobs in one forward pass. PPO's clip keeps ``pi_theta`` close to it,
  so the trust region is measured from where the trainer is, not from a stale sampler.

Tokens sampled under a constraint (a request's ``grammar``, or its ``top_k``) are trained as they
were sampled, with one rule for which distribution each log-probability belongs to:

* ``behavior_logprobs`` are what the rollout engine recorded: the distribution the token was drawn
  from, i.e. the model's with the grammar's mask (and top_k) applied and renormalised over the
  allowed tokens, ``mu(a) = pi(a) / Z`` where ``Z`` is the mass ``pi`` gave the allowed set;
* ``proximal_logprobs`` and ``logprobs`` are the trainer's recompute of the **unconstrained** model:
  the mask does not enter them. The policy being trained is the model itself, which will later be
  sampled with or without a grammar; the grammar is part of how this sample was collected, not of
  the policy, and the trainer does not even have it (a Trajectory carries tokens, not grammars).

So the decoupled objective's behaviour weight ``w = pi_prox / mu = Z`` (on fresh samples) is exactly
the off-policy correction for the constraint: at most 1, never capped by ``behav_imp_weight_cap``,
and small where the model put little mass on what the grammar allowed (a token it was forced to
emit teaches it little until it would emit it unforced). The ratio ``r = pi_theta / pi_prox`` and its
clip are unchanged: both are the unconstrained model's. tests/test_constrained_decode.py runs a real
update on constrained samples and checks that its ``mean_w`` is the mean of ``pi_prox / mu`` with the
engine's recorded ``mu``.

The module imports torch, so ``areal_bus`` exposes its public names lazily (see ``__init__``):
nodes that never train do not pay for the import.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["LAG_BUCKETS", "decoupled_ppo_loss", "grpo_advantages", "kl_penalty", "masked_mean"]

LAG_BUCKETS = (0, 1, 2, 3)
"""``decoupled_ppo_loss``'s per-lag diagnostics: tokens sampled 0, 1, 2 and 3 or more versions before the
proximal weights (the last bucket open-ended)."""


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(mask * x) / sum(mask)``; 0 (keeping ``x``'s graph) when the mask selects nothing.

    ``mask`` may be bool or a float weight of ``x``'s shape. Masked-out entries are replaced rather
    than multiplied by 0, so a NaN or inf in padding cannot poison the result.
    """
    m = mask.to(x.dtype)
    num = torch.where(m != 0, x * m, torch.zeros_like(x)).sum()
    den = m.sum()
    return num / torch.where(den != 0, den, torch.ones_like(den))


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    behav_imp_weight_cap: float | None = 5.0,
    *,
    tensor_stats: bool = False,
    lag: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """AReaL's decoupled PPO loss (eq. 5) and its diagnostics.

    Arguments (one shape, element-wise over tokens):

    * ``logprobs`` -- ``log pi_theta(a_t)`` under the weights being optimised; the only input that
      receives a gradient.
    * ``proximal_logprobs`` -- ``log pi_prox(a_t)``: the trainer's weights *before* this update step,
      recomputed by the trainer. It is the PPO trust-region anchor. Detached here.
    * ``behavior_logprobs`` -- ``log pi_behav(a_t)``: the logprobs the rollout engine sampled with,
      possibly several policy versions old (and mixed within one trajectory); for a constrained token
      the masked, renormalised distribution's (the module docstring). Detached here.
    * ``advantages`` -- ``A_t``, e.g. from :func:`grpo_advantages` broadcast over a sample's tokens.
      Detached here (advantages are constants of the objective).
    * ``loss_mask`` -- bool or 0/1: which tokens are trained on (generated tokens, not prompt or
      padding). Padding must hold finite numbers only if it is masked *in*; masked-out entries never
      reach the loss or its gradient.

    Per token, with ``r = exp(logprobs - proximal_logprobs)`` and
    ``eps_high = eps_clip if eps_clip_high is None else eps_clip_high``::

        l = -w * min(r * A, clip(r, 1 - eps_clip, 1 + eps_high) * A)
        w = exp(proximal_logprobs - behavior_logprobs)

    ``r`` is PPO's ratio measured from the proximal policy, so clipping bounds how far one step
    moves the trainer from where it is. ``w`` is the importance weight that corrects for the tokens
    having been sampled by ``pi_behav`` rather than ``pi_prox``; it scales the token's term but gets
    no gradient (it does not depend on ``theta``). ``eps_clip_high > eps_clip`` is the asymmetric
    ("clip-higher") variant that lets the probability of good low-probability tokens rise further.

    Tokens with ``w > behav_imp_weight_cap`` are left out of the sum: a huge weight means the sampler
    and the trainer disagree so much that the token's estimate is dominated by variance (``None``
    disables the cap). They still count in the denominator, so dropping a token never inflates the
    weight of the others::

        loss = sum(loss_mask * keep * l) / sum(loss_mask),   keep = (w <= cap)

    and ``loss`` is 0 (with a graph back to ``logprobs``) when ``sum(loss_mask) == 0``.

    Returns ``(loss, stats)``; ``stats`` are python floats computed without gradient, each over the
    masked-in tokens (``loss_mask`` weights, the capped tokens included), 0.0 when there are none
    (with ``tensor_stats``, 0-d tensors on the inputs' device instead: no host synchronisation, so a
    trainer on a GPU can queue the next micro-batch while this one runs):

    * ``clip_fraction`` -- fraction of tokens whose clipped term is strictly smaller than the
      unclipped one, ``clip(r) * A < r * A``: those where the clipped term is the active min and the
      token therefore passes no gradient (``r > 1 + eps_high`` with ``A > 0``, or ``r < 1 - eps_clip``
      with ``A < 0``). Ties (``r`` inside the range, or ``A == 0``) are not clipped.
    * ``capped_fraction`` -- fraction of tokens with ``w > behav_imp_weight_cap`` (0 when the cap is
      None).
    * ``mean_w`` -- mean importance weight ``w``: how far the sampler has drifted from the trainer.
    * ``mean_r`` -- mean ratio ``r``; 1 on the first minibatch of a step.
    * ``approx_kl`` -- mean of ``(r - 1) - log r`` (Schulman's k3 estimator, always >= 0) of
      ``KL(pi_prox || pi_theta)`` on the sampled tokens: how far this step has moved the policy.

    With ``lag`` (per token, how many versions before the proximal weights its sampler was), the same
    quantities per lag bucket (``LAG_BUCKETS``: 0, 1, 2, 3+), named ``lag0``..``lag3+``: ``.tokens`` (the
    bucket's share of the masked-in tokens), ``.abs_log_w`` (mean ``|log w|``: how far that sampler had
    drifted), ``.capped`` and ``.clipped`` (shares within the bucket): which lags drift, and how much of
    their signal the cap and the clip remove.
    """
    shape = logprobs.shape
    for name, t in (
        ("proximal_logprobs", proximal_logprobs),
        ("behavior_logprobs", behavior_logprobs),
        ("advantages", advantages),
        ("loss_mask", loss_mask),
    ):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs has {tuple(shape)}")
    if eps_clip_high is None:
        eps_clip_high = eps_clip

    prox = proximal_logprobs.detach()
    behav = behavior_logprobs.detach()
    adv = advantages.detach().to(logprobs.dtype)
    mask = loss_mask.detach().to(logprobs.dtype)
    on = mask != 0
    zeros = torch.zeros_like(logprobs)

    # Differences are zeroed where masked out *before* exp: padding may hold -inf or garbage, and an
    # inf there would turn the (zero) gradient into NaN through exp's backward.
    log_r = torch.where(on, logprobs - prox, zeros)
    r = torch.exp(log_r)
    w = torch.exp(torch.where(on, prox - behav, zeros))
    keep = on if behav_imp_weight_cap is None else on & (w <= behav_imp_weight_cap)

    surr = r * adv
    surr_clipped = torch.clamp(r, 1.0 - eps_clip, 1.0 + eps_clip_high) * adv
    # Capped tokens get weight 0 rather than w: w may have overflowed to inf, and inf * 0 = NaN.
    w_used = torch.where(keep, w, zeros)
    per_token = -w_used * torch.minimum(surr, surr_clipped)

    num = torch.where(keep, per_token * mask, zeros).sum()
    den = mask.sum()
    loss = num / torch.where(den != 0, den, torch.ones_like(den))

    with torch.no_grad():
        capped = on & ~keep
        clipped = on & (surr_clipped < surr)
        stats = {
            "clip_fraction": masked_mean(clipped.to(mask.dtype), mask),
            "capped_fraction": masked_mean(capped.to(mask.dtype), mask),
            "mean_w": masked_mean(w, mask),
            "mean_r": masked_mean(r, mask),
            "approx_kl": masked_mean(r - 1.0 - log_r, mask),
        }
        if lag is not None:
            log_w = torch.where(on, prox - behav, zeros).abs()
            for k in LAG_BUCKETS:
                last = k == LAG_BUCKETS[-1]
                m = mask * ((lag >= k) if last else (lag == k)).to(mask.dtype)
                name = f"lag{k}+" if last else f"lag{k}"
                stats[f"{name}.tokens"] = m.sum() / den.clamp(min=1)
                stats[f"{name}.abs_log_w"] = masked_mean(log_w, m)
                stats[f"{name}.capped"] = masked_mean(capped.to(mask.dtype), m)
                stats[f"{name}.clipped"] = masked_mean(clipped.to(mask.dtype), m)
    if not tensor_stats:
        stats = {k: v.item() for k, v in stats.items()}
    return loss, stats


def loglinear_proximal(behavior_logprobs: torch.Tensor, logprobs: torch.Tensor, lag: torch.Tensor) -> torch.Tensor:
    """AReaL's ``prox_logp_method: loglinear``: ``log pi_prox`` approximated without a forward pass, by
    interpolating in log space between the behaviour policy (version v - lag) and the policy being
    optimised (v + 1, the version this update makes) at the proximal policy's version v:
    ``behav + alpha (logp - behav)``, ``alpha = lag / (lag + 1)``. A token its sampler made with the
    proximal weights (lag 0) gets its behaviour log-probability. ``logprobs`` is taken as a constant."""
    alpha = lag.clamp(min=0) / (lag.clamp(min=0) + 1)
    return behavior_logprobs + alpha * (logprobs.detach() - behavior_logprobs)


def grpo_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: torch.Tensor | Sequence,
    std_normalize: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages: each reward normalised within the group of samples of one task instance.

    ``rewards[i]`` belongs to group ``group_ids[i]`` (any integers, or any hashable values when not a
    tensor; groups need not be contiguous or equal in size). For a group of ``n`` rewards with mean
    ``mu`` and *population* standard deviation ``sigma = sqrt(mean((R - mu) ** 2))`` (divisor ``n``)::

        A_i = (R_i - baseline_i) / (sigma + eps)      if std_normalize
        A_i =  R_i - baseline_i                       otherwise

    where ``baseline_i = mu`` by default, or with ``leave_one_out`` the mean of the *other* ``n - 1``
    rewards of the group (RLOO), so a sample never serves as its own baseline.

    ``sigma`` is always the population std of the whole group, leave-one-out or not: the scale is one
    property of the group shared by all its samples, so ``leave_one_out`` only changes the centring,
    and since ``R_i - mean_{-i} = n / (n - 1) * (R_i - mu)`` it yields exactly ``n / (n - 1)`` times
    the default advantages. (A per-sample std of the other ``n - 1`` rewards would give every sample
    its own scale and be 0 for every pair, ``n = 2``.) Population rather than sample (``n - 1``) std
    so the group's spread is described, not estimated, and ``n = 2`` stays well defined.

    A group of size 1 has no baseline to compare with and gets advantage 0; a group whose rewards are
    all equal gets 0 as well. The result is a detached floating tensor aligned with ``rewards``
    (integer rewards become the default float dtype).
    """
    r = torch.as_tensor(rewards).detach()
    if not r.is_floating_point():
        r = r.to(torch.get_default_dtype())
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(r.shape)}")
    if isinstance(group_ids, torch.Tensor):
        _, inverse = torch.unique(group_ids, return_inverse=True)
    else:
        index: dict = {}
        inverse = torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)
    inverse = inverse.to(r.device).reshape(-1)
    if inverse.numel() != r.numel():
        raise ValueError(f"{inverse.numel()} group ids for {r.numel()} rewards")

    groups = int(inverse.max()) + 1 if r.numel() else 0
    count = torch.zeros(groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros_like(count).index_add_(0, inverse, r)
    n = count[inverse]
    mean = (total / count)[inverse]
    if leave_one_out:
        # n == 1 gives 0 / 0 here; the final where() maps singletons to 0.
        baseline = (total[inverse] - r) / torch.where(n > 1, n - 1, torch.ones_like(n))
    else:
        baseline = mean
    adv = r - baseline
    if std_normalize:
        var = torch.zeros_like(count).index_add_(0, inverse, (r - mean) ** 2) / count
        adv = adv / (var.sqrt()[inverse] + eps)
    return torch.where(n > 1, adv, torch.zeros_like(adv))


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of ``KL(pi_theta || pi_ref)`` on tokens sampled from (roughly) ``pi_theta``.

    Optional regulariser towards a frozen reference policy; callers leave it off by default (AReaL
    trains without it). Reduce with :func:`masked_mean` and add ``beta *`` it to the loss.

    * ``"k1"``: ``logprobs - ref_logprobs``, unbiased but per-token signed and high variance.
    * ``"k3"``: ``exp(ref - logp) - (ref - logp) - 1``, unbiased, always >= 0, lower variance
      (Schulman, "Approximating KL divergence").

    Gradient flows through ``logprobs`` only; the reference is detached.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"ref_logprobs has shape {tuple(ref_logprobs.shape)}, logprobs has {tuple(logprobs.shape)}"
        )
    log_ratio = ref_logprobs.detach() - logprobs
    if kind == "k1":
        return -log_ratio
    if kind == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"kind must be 'k1' or 'k3', got {kind!r}")
