"""Packing a PPO mini-batch for the trainer: variable-length trajectories laid end to end in one row.

A mini-batch of trajectories becomes micro-batches of at most ``max_tokens`` tokens, each one row with
position ids reset at every sample start and the samples' cumulative lengths, which the trainer's
attention (``train_model.VARLEN``) takes so that attention never crosses samples and no padding is
computed (transformers' own packed path, sdpa with position ids alone, derives the same block-diagonal
mask from the position ids). Written by hand because no library packs RL trajectories with their
per-token loss weights, behaviour log-probabilities, advantages and staleness, and names the tokens
the loss reads (``loss_only``: the lm_head runs on those alone). On a GPU micro-batches are padded to a
few lengths for cuBLAS's sake; which samples make each mini-batch (``mini_batch_members``) and each
micro-batch (``_pad_aware``) is chosen to need little of that padding, a subset-sum search done by hand
too (AReaL's and verl's balancers even out token counts, which is another goal).

Quick check::

    python -c "from areal_bus.train.packing import pack; print(pack.__doc__)"
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass
class Packed:
    """One micro-batch: samples laid end to end in a single row.

    ``ids``/``positions`` are [1, N]; ``mask``/``behav``/``adv``/``lag`` are [N], aligned with ``ids``
    (entry t belongs to token t: its loss weight, the logprob the sampler recorded, its advantage, how
    many versions before the trained weights it was sampled); ``rows``
    holds each sample's index in the mini-batch and its span (start, length) in the row; ``cu`` the
    segments' cumulative lengths ([segments + 1], int32: what varlen attention takes), made with the rest
    so that a forward on a GPU copies nothing from the host; ``longest`` the longest segment. A padded
    micro-batch (``pack(pad_to=...)``) ends in one more segment, of padding: in ``cu``, not in ``rows``,
    loss weight 0. ``head`` (``pack(loss_only=True)``; None: every position): the tokens whose
    log-probability is computed, those of loss weight != 0 that do not start a sample, in order, then
    sentinels N, N+1, ... up to a multiple of ``HEAD_PAD_ROWS`` (on a padded micro-batch): the
    lm_head runs on these rows only (``train_model.PackedLM``)."""

    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    behav: torch.Tensor
    adv: torch.Tensor
    rows: list[tuple[int, int, int]]
    cu: torch.Tensor
    lag: torch.Tensor
    longest: int
    head: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[1])

    def to(self, device) -> Packed:
        """On ``device``; the copies are queued (non_blocking), not waited for: the host goes on
        launching work while the last update still runs (stream order makes it safe). To a GPU they go
        from page-locked memory (torch's caching host allocator): a copy from pageable memory is staged
        by the driver, which may wait for the stream's queued kernels first (the profile in
        bench/RESULTS.md: ~260 us of host time per copy)."""
        cuda = torch.device(device).type == "cuda"
        move = lambda t: (t.pin_memory() if cuda else t).to(device, non_blocking=True)
        return Packed(move(self.ids), move(self.positions), move(self.mask), move(self.behav), move(self.adv),
                      self.rows, move(self.cu), move(self.lag), self.longest,
                      None if self.head is None else move(self.head))


def mini_batches(count: int, size: int) -> list[range]:
    """The update's ``count`` samples as ``ceil(count / size)`` PPO mini-batches of equal size (the first
    ``count % n`` one sample larger), in order: never larger than ``size``, and no tail of a few samples.

    Each mini-batch is an optimizer step, and AdamW's step is about as large from 8 samples as from 64:
    an asynchronous update of whole GRPO groups takes between trigger_batch_size and global_batch_size
    samples, so cutting it into full mini-batches of ``size`` left a remainder (72 samples at size 64:
    64 and 8) whose step was mostly noise. Equal parts keep every step's gradient an average over as
    many samples as the update allows (72: 36 and 36)."""
    if count <= 0:
        return []
    n = -(-count // max(1, size))
    base, extra = divmod(count, n)
    starts = [i * base + min(i, extra) for i in range(n + 1)]
    return [range(starts[i], starts[i + 1]) for i in range(n)]


SWAP_WINDOW = 4
"""``mini_batch_members``: how many of a mini-batch's last samples may trade places with as many of the
next one's first."""


def mini_batch_members(lengths: list[int], size: int, pad_to: int = 1) -> list[list[int]]:
    """The update's samples (their token counts, in order) as the PPO mini-batches of ``mini_batches``:
    as many, of the same sizes; with ``pad_to`` > 1 up to ``SWAP_WINDOW`` samples at each boundary
    trade places, so that every mini-batch but the last totals just short of a multiple of ``pad_to``.
    Each mini-batch ends, counted in tokens from the update's start, within ``pad_to`` of where it ends
    in order (its total within twice that of its total in order), and no sample lands more than one
    mini-batch from its own. A mini-batch's micro-batches are padded to such multiples and grouped so
    that all but one end just short of one (``_pad_aware``); what the mini-batch's own total leaves
    over no grouping inside it can remove, and with the totals aligned only the last mini-batch's is
    left. On the seed's lengths at 16k micro-batches padded to 1,024: padding 3.2% of the real tokens
    -> 1.1% (``bench/padding.py``).

    Which samples share a mini-batch changes which optimizer step trains them, not the objective: the
    advantages are the whole update's (its GRPO groups), each step averages over as many samples, and
    a trade is between neighbours (AReaL goes further: it balances its mini-batches' tokens over all
    the samples)."""
    parts = [list(r) for r in mini_batches(len(lengths), size)]
    if pad_to <= 1 or len(parts) <= 1:
        return parts
    rest, out = list(range(len(lengths))), []
    for k in range(len(parts) - 1):
        count = len(parts[k])
        carried = sum(1 for i in rest[:count] if i < parts[k][0])  # the last one's, left to this one: kept
        w = min(SWAP_WINDOW, count - carried, len(parts[k + 1]))
        fixed, pool = rest[:count - w], rest[count - w:count + w]
        # Samples 0..end of this part in order are the rest's first ``count``: taking them keeps this
        # mini-batch's end where it is in order (in tokens); a trade may move it by up to pad_to.
        in_order = sum(lengths[i] for i in rest[:count])
        base = sum(lengths[i] for i in fixed)
        best = None  # (padding, distance from the in-order end), members
        for take in itertools.combinations(pool, w):
            total = base + sum(lengths[i] for i in take)
            if abs(total - in_order) <= pad_to:
                key = (-total % pad_to, abs(total - in_order))
                best = min(best, (key, take)) if best else (key, take)
        members = sorted(fixed + list(best[1]))  # rest[:count] itself is always a candidate
        out.append(members)
        chosen = set(members)
        rest = [i for i in rest if i not in chosen]
    out.append(rest)
    return out


def pack(samples: list[dict], max_tokens: int, pad_to: int = 1, loss_only: bool = False) -> list[Packed]:
    """Micro-batches of at most ``max_tokens`` tokens (a longer sample gets one of its own): as few as
    filling them in the samples' order makes, balanced, and with ``pad_to`` > 1 regrouped to pad less
    (``_groups``). Each sample is a dict of 1-D arrays (numpy or torch) as long as its tokens: ``ids``
    (prompt + output), ``mask`` (loss weight), ``behav`` (the sampler's logprobs), ``adv``, and
    optionally ``lag`` (0 when absent).

    ``pad_to`` > 1 rounds each micro-batch's length up to a multiple of it with a segment of padding
    (token 0, loss weight 0, attention of its own), so that a GPU's matmuls see a few row counts again
    and again: cuBLAS chooses a kernel for every new shape, ~5 ms of host time each on an H200, during
    which the GPU waits (bench/RESULTS.md). The padding may take a micro-batch past ``max_tokens``.
    Which samples share a micro-batch does not change the update (the mini-batch's gradient is the sum
    of its micro-batches'), so with padding they are grouped to need as little of it as they can.

    ``loss_only``: the micro-batches name the tokens the loss reads (``Packed.head``), and the lm_head
    computes their log-probabilities only; every other entry is 0. The objective reads nothing else
    (every term is weighted by the loss mask), so the update is the same; prompts, tool outputs and
    padding skip the head's matmul, forward and backward, and its passes over [tokens, vocab]."""
    return [_pack_group(samples, g, pad_to, loss_only)
            for g in _groups([len(s["ids"]) for s in samples], max_tokens, pad_to)]


def _groups(lengths: list[int], max_tokens: int, pad_to: int = 1) -> list[list[int]]:
    """Consecutive samples in as few groups of at most ``max_tokens`` tokens as fit them (a longer
    sample alone), balanced: the groups' largest is as small as that count allows. A mini-batch just
    over the cap makes two halves, not a full micro-batch and a sliver: on a GPU each micro-batch costs
    its launches, which a sliver's few tokens cannot hide (bench/RESULTS.md). With ``pad_to`` > 1, as
    many groups regrouped to need less padding where they can (``_pad_aware``)."""
    groups = _fill(lengths, max_tokens)
    if len(groups) <= 1:
        return groups
    lo, hi = max(1, -(-sum(lengths) // max(1, len(groups)))), max_tokens
    while lo < hi:  # the smallest cap that still needs no more groups
        mid = (lo + hi) // 2
        if len(_fill(lengths, mid)) <= len(groups):
            hi = mid
        else:
            lo = mid + 1
    groups = _fill(lengths, hi) if hi < max_tokens else groups
    return _pad_aware(lengths, groups, max_tokens, pad_to) if pad_to > 1 else groups


def _padding(lengths: list[int], groups: list[list[int]], pad_to: int) -> int:
    return sum(-sum(lengths[i] for i in g) % pad_to for g in groups)


def _pad_aware(lengths: list[int], groups: list[list[int]], max_tokens: int, pad_to: int) -> list[list[int]]:
    """``groups`` (balanced, in order) regrouped, as many, each within ``max_tokens``, so that every
    group but the last ends just short of a multiple of ``pad_to``: padded to it, it wastes a few
    tokens, not up to ``pad_to`` - 1. A mini-batch's own remainder (its tokens modulo ``pad_to``) stays,
    in the last group. Each group takes an even share of what is left, less at most ``pad_to`` or a
    quarter of the share (whichever is less), more at most a quarter: no sliver appears, and what the
    groups leave spreads over the ones after them instead of piling up past the cap in the last.
    Returned only when it pads less than ``groups``; a sample over the cap keeps ``groups``. On the
    seed's lengths at 16k micro-batches padded to 1,024 it cuts the padding from 4.7% of the real
    tokens to 3.2%, for 0.2 ms of host time per update (``bench/padding.py``).

    Each group is a subset sum over a pool, the first samples left (in order) up to twice the group's
    largest allowed size: the sums reachable with the pool's first j samples are the bits of one
    integer (Python's own arbitrary-precision bit operations), which also recover the subset. The pool
    keeps the work per group bounded, so a mini-batch of hundreds of micro-batches costs milliseconds."""
    if len(groups) <= 1 or max(lengths) > max_tokens:
        return groups
    rest, out = sorted(i for g in groups for i in g), []
    total = sum(lengths)
    for left in range(len(groups), 1, -1):
        share = total / left
        lo = max(int(0.75 * share), int(share) - pad_to, total - (left - 1) * max_tokens)
        hi = min(max_tokens, int(1.25 * share))
        pool, pooled = [], 0
        for i in rest:
            if pooled >= 2 * hi:
                break
            pool.append(i)
            pooled += lengths[i]
        reach = [1]  # reach[j]: bit s set if some subset of the pool's first j samples sums to s
        for i in pool:
            reach.append(reach[-1] | (reach[-1] << lengths[i]))
        best = None  # (padding, distance from the share), sum
        for top in range(-(-max(lo, 1) // pad_to) * pad_to, hi + pad_to, pad_to):
            below = reach[-1] & ((1 << (min(top, hi) + 1)) - 1)
            s = below.bit_length() - 1  # the largest reachable sum <= min(top, hi)
            if s >= lo and s > top - pad_to:
                key = (top - s, abs(s - share))
                best = min(best, (key, s)) if best else (key, s)
        if best is None:
            return groups
        s, take = best[1], []
        for j in range(len(pool) - 1, -1, -1):
            if not reach[j] >> s & 1:  # s needs sample j
                take.append(pool[j])
                s -= lengths[pool[j]]
        out.append(sorted(take))
        chosen = set(take)
        rest = [i for i in rest if i not in chosen]
        total -= sum(lengths[i] for i in take)
    if not rest or sum(lengths[i] for i in rest) > max_tokens:
        return groups
    out.append(rest)
    return sorted(out) if _padding(lengths, out, pad_to) < _padding(lengths, groups, pad_to) else groups


def _fill(lengths: list[int], cap: int) -> list[list[int]]:
    """Consecutive samples, each group filled up to ``cap`` tokens (a longer sample alone)."""
    groups: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if not groups or used + n > cap:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


def pack_rows(data: dict[str, torch.Tensor], rows: torch.Tensor, max_tokens: int, pad_to: int = 1,
              loss_only: bool = False) -> list[Packed]:
    """``pack`` over rows of a right-padded batch (``ids``, ``attn``, ``mask``, ``behav``, ``adv`` and
    optionally ``lag``, [B, T]): each row's tokens up to its length. One gather per field and micro-batch
    (the batch's rows are right-padded, so row-major order of the real tokens is the samples laid end
    to end), not a slice and a copy per sample and field: it runs on the host before the update's first
    kernel, while the GPU waits."""
    lengths = data["attn"][rows].sum(1).tolist()
    out = []
    for group in _groups(lengths, max_tokens, pad_to):
        idx = rows[group]
        real = data["attn"][idx].bool()
        fields = {k: data[k][idx][real] for k in ("ids", "mask", "behav", "adv", "lag") if k in data}
        out.append(_packed(fields, group, [lengths[i] for i in group], pad_to, loss_only))
    return out


def _pack_group(samples: list[dict], idx: list[int], pad_to: int = 1, loss_only: bool = False) -> Packed:
    keys = [k for k in ("ids", "mask", "behav", "adv", "lag") if all(k in samples[i] for i in idx)]
    fields = {k: torch.cat([torch.as_tensor(samples[i][k]) for i in idx]) for k in keys}
    return _packed(fields, idx, [len(samples[i]["ids"]) for i in idx], pad_to, loss_only)


HEAD_PAD_ROWS = 128
"""On a padded micro-batch (``pad_to`` > 1) the head's rows are rounded up to a multiple of this: the
last logit chunk then has one of a few lengths, whose matmuls cuBLAS soon knows (as for
``pad_to``), for at most 127 rows computed in vain."""


def _packed(fields: dict[str, torch.Tensor], idx: list[int], sizes: list[int], pad_to: int,
            loss_only: bool = False) -> Packed:
    """A micro-batch from its samples' fields laid end to end (``lag`` optional: 0 without it), the
    samples' indices and lengths: padded to a multiple of ``pad_to``, positions restarting per segment;
    with ``loss_only`` the head's rows (``Packed.head``)."""
    start = list(itertools.accumulate([0] + sizes))
    pad = -start[-1] % max(1, pad_to)
    segments = sizes + ([pad] if pad else [])
    total = start[-1] + pad
    field = lambda key, dtype: torch.cat([fields[key].to(dtype), torch.zeros(pad, dtype=dtype)])
    n = torch.tensor(segments, dtype=torch.long)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)])
    positions = torch.arange(total) - torch.repeat_interleave(cu[:-1], n)
    lag = field("lag", torch.float32) if "lag" in fields else torch.zeros(total, dtype=torch.float32)
    mask = field("mask", torch.float32)
    head = None
    if loss_only:
        head = torch.nonzero((mask != 0) & (positions != 0)).flatten()
        granule = min(max(1, pad_to), HEAD_PAD_ROWS)
        extra = -head.numel() % granule if head.numel() else granule  # one row at least
        head = torch.cat([head, total + torch.arange(extra)])  # sentinels: computed, then dropped
    return Packed(field("ids", torch.long)[None], positions[None], mask,
                  field("behav", torch.float32), field("adv", torch.float32),
                  [(i, start[j], sizes[j]) for j, i in enumerate(idx)], cu.to(torch.int32), lag, max(segments),
                  head)
