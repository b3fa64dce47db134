"""The real trainer engine: staleness-aware PPO on any Hugging Face causal LM, in plain torch.

The policy is transformers' own model class for the checkpoint (``areal_bus.train.train_model``): float32
master weights and AdamW state, compute in ``model.dtype`` (``trainer_engine.mixed_precision``: a
compute copy refreshed once per optimizer step, or autocast; ``trainer_engine.compile`` compiles each
decoder layer). With ``trainer_engine.lora`` (areal_bus/train/lora.py) the base is frozen in model.dtype
and only peft's adapters are trained (float32 masters and AdamW state, autocast compute): what is
published and checkpointed is then the adapter alone. One ``train(batch, version)`` is one policy update
(one version):
  1. GRPO advantages per trajectory from its reward and its group (the n samples of one task instance);
  2. the batch is right-padded into [B, T] tensors (prompt + output tokens, the loss mask: policy tokens
     only, the behaviour log-probabilities the engine recorded): the form the parallel ranks receive;
  3. each mini-batch's rows (this rank's share) are packed without padding into micro-batches of at most
     ``micro_batch_tokens`` tokens (attention within each sample: ``train_model.VARLEN``); the lm_head
     runs on the loss's tokens only (prompts and tool outputs skip it: ``pack(loss_only=True)``); on a
     GPU each is rounded up to a multiple of ``micro_batch_pad_tokens``, and the mini-batches' members
     and micro-batches are chosen to need little of it (``packing.mini_batch_members``, ``pack``);
  4. proximal log-probabilities are recomputed once, with the weights as they stand before this update
     (the entropy of the policy is logged from the same pass); the first mini-batch's training forward,
     made before any optimizer step, is its own proximal pass (``trainer_engine.prox_logp_method:
     loglinear`` makes no proximal pass: the later mini-batches interpolate theirs, ``loss.loglinear_proximal``);
  5. ``ppo_epochs`` passes of mini-batch steps of ``decoupled_ppo_loss``, gradients accumulated over the
     micro-batches, each weighted by its share of the mini-batch's tokens (AdamW, gradient clipping), or
     with ``trainer_engine.loss_token_norm: N`` by its tokens over (the mini-batch's samples x N).

Checkpoints are ordinary Hugging Face folders (config.json + model.safetensors + the tokenizer files
copied from the start checkpoint), plus ``trainer_state.json`` (version, consumed trajectory ids) and
``optimizer.pt`` (AdamW's state, torch's own format, written and read only by this trainer on this
host: nothing that crossed a socket). An engine built from a checkpoint folder, then ``load_optimizer``
(what ``train_engine.build_train_engine(checkpoint=...)`` does), restores all three, so the version
sequence continues. With LoRA a checkpoint holds the adapter (peft's adapter folder, float32) and the
base's folder and sha256 (``lora_base.json``) instead of the weights; the engine then starts from model.path
and loads the adapter, after checking the base is the one it was trained on.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import structlog
import torch

from areal_bus.train.loss import decoupled_ppo_loss, grpo_advantages, kl_penalty, loglinear_proximal, masked_mean
from areal_bus.wire.messages import Trajectory
from areal_bus.model.memory import check_at_start
from areal_bus.model.modeling import as_dtype
from areal_bus.train.packing import Packed, mini_batch_members, pack_rows
from areal_bus.train.train_model import (ComputeCopy, PackedLM, autocast, export_state_dict, load_policy, packed_logprobs,
                                   save_weights)
from areal_bus.engines.torch_engine import TorchRolloutEngine
from areal_bus.model.adapters import rollout_model
from areal_bus.train import lora as lora_adapters
from areal_bus.tasks.plugins import make_driver
from areal_bus.tasks.runner import evaluate, load_tokenizer

# Names of the update's phases in a torch profile (bench/trainer.py --trace, bench/trace_summary.py): a few
# host-side markers per update, a microsecond each while no profiler runs.
phase = torch.profiler.record_function

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")


def pad_batch(batch: list[Trajectory], advantages: torch.Tensor, version: int | None = None) -> dict[str, torch.Tensor]:
    """[B, T] tensors for a batch: ids, attention mask, loss mask, behaviour logprobs, advantages, and
    each policy token's lag (``version`` minus the version that sampled it; 0 without ``version``).
    Right padding; position t of a row holds the token whose log-probability ``token_logprobs`` puts
    at t, so the engine's per-token records line up with the trainer's recompute by construction."""
    lengths = [t.prompt_ids.size + t.output_ids.size for t in batch]
    B, T = len(batch), max(lengths)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.float32)
    behav = torch.zeros(B, T, dtype=torch.float32)
    adv = torch.zeros(B, T, dtype=torch.float32)
    lag = torch.zeros(B, T, dtype=torch.float32)
    for i, t in enumerate(batch):
        p, n = t.prompt_ids.size, t.output_ids.size
        ids[i, :p + n] = torch.from_numpy(np.concatenate([t.prompt_ids, t.output_ids]).astype(np.int64))
        attn[i, :p + n] = 1
        mask[i, p:p + n] = torch.from_numpy(t.loss_mask.astype(np.float32))
        behav[i, p:p + n] = torch.from_numpy(t.logprobs.astype(np.float32))
        adv[i, p:p + n] = advantages[i]
        if version is not None:  # environment tokens (version -1) stay 0: they are out of the loss
            lag[i, p:p + n] = torch.from_numpy(np.where(t.versions >= 0, version - t.versions, 0).astype(np.float32))
    return {"ids": ids, "attn": attn, "mask": mask, "behav": behav, "adv": adv, "lag": lag}


def reward_components(batch: list[Trajectory]) -> dict[str, float]:
    """``reward.<name>``: the batch's mean of each named component a reward function returned (the
    reward node keeps them in ``meta['reward_components']``; a trajectory without one counts 0, and
    anything but a number is left out: meta crossed a socket)."""
    parts = [t.meta.get("reward_components") for t in batch]
    parts = [{k: float(v) for k, v in p.items() if isinstance(k, str) and isinstance(v, (int, float))}
             if isinstance(p, dict) else {} for p in parts]
    names = sorted({k for p in parts for k in p})
    return {f"reward.{k}": float(np.mean([p.get(k, 0.0) for p in parts])) for k in names}


class TorchTrainEngine:
    """Implements areal_bus.engines.train_engine.TrainEngine."""

    def __init__(self, topo, model_path: str | Path, *, publisher=None, dp=None, device=None, base_model=None):
        cfg = topo.trainer_engine
        self.cfg = cfg
        self.topo = topo
        self.model_path = Path(model_path)  # where it starts: model.path, or a checkpoint it resumes
        self.device = torch.device(device or topo.trainer_device)
        self.dtype = as_dtype(topo.model.dtype)
        self.lora = cfg.lora  # trainer_engine.lora: adapters on a frozen base (train/lora.py), or None
        # The folder the policy's weights come from: the start folder, except that with LoRA they are
        # model.path's (``base_model``: it resolved; ranks > 0 resolve it from their cwd, as supervisord's)
        # and a checkpoint holds the adapter alone.
        self.base_path = self.model_path if self.lora is None else Path(base_model or topo.model_path())
        self.base_sha = None  # LoRA: the base's sha256, recorded in every checkpoint (rank 0 computes it)
        if self.lora is not None and (dp is None or dp.rank == 0):
            lora_adapters.check_start(self.model_path, self.lora, self.base_path)
            self.base_sha = lora_adapters.base_checksum(self.base_path)
        torch.manual_seed(topo.model.seed)
        load = lambda lora=None: load_policy(self.base_path, self.device, attn_implementation=cfg.attn_implementation,
                                             gradient_checkpointing=cfg.gradient_checkpointing, lora=lora,
                                             dtype=self.dtype)
        if publisher is not None:  # the memory plan against this card first: a refusal naming numbers, not an OOM
            check_at_start(topo, "trainer", self.device, getattr(publisher, "base", None), structlog.get_logger())
        lm = load(self.lora).train()
        # model.share_base: the frozen base moves into the buffer the rollout engines map (model/shared_base.py)
        self.shared_base = (lora_adapters.share_base(lm, topo, getattr(publisher, "base", None), structlog.get_logger())
                            if self.lora is not None and publisher is not None and dp is None else None)
        if self.lora is None:
            lm.requires_grad_(True)
        elif self.model_path.resolve() != self.base_path.resolve():
            lora_adapters.load_into(lm, self.model_path)  # before a parallel layout shards it
        # What the update calls (a parallel layout shards it); ``model`` is the transformers model inside.
        self.policy = self._prepare_model(PackedLM(lm))
        self.model = self.policy.lm
        # What forward and backward run on: a copy in the compute dtype (the optimizer steps the float32
        # masters above and refreshes it), or the masters themselves under autocast.
        self.copy = ComputeCopy(self.policy, self.dtype) if self._use_compute_copy() else None
        self.run = self.copy.module if self.copy is not None else self.policy
        if cfg.compile:
            compile_layers(self.run)
        # Ids at or past it index outside the embedding (on a GPU a device-side assert that ends the
        # process): the trainer refuses such trajectories before accepting them.
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        # Without dropout a forward in training mode is the proximal pass's (eval mode) exactly, so the
        # first mini-batch's training forward, made before any optimizer step, serves as its proximal pass:
        # one forward fewer per update (half the proximal work at two mini-batches).
        self.forward_is_proximal = dropout_free(self.model)
        # 'loglinear': no proximal pass at all; each later mini-batch interpolates its anchor (loss.py).
        self.recompute_proximal = cfg.prox_logp_method == "recompute"
        # The KL reference: the initial policy. With LoRA that is the base, which the policy runs with its
        # adapters switched off (``_reference``): no second copy.
        self.ref = None if cfg.kl_coef <= 0 else self.run if self.lora else load().eval().requires_grad_(False)
        if self.ref is not None and self.copy is not None:
            self.ref.to(self.dtype)  # never trained: its compute copy is all it needs
        # One process on a GPU: AdamW's fused kernel (a few launches per step for every weight); a
        # sharded layout keeps the multi-tensor default, which takes its DTensors.
        fused = {"fused": True} if self.device.type == "cuda" and self._fused_optimizer() else {}
        self.opt = torch.optim.AdamW(self.trainable(), lr=topo.learning_rate, betas=(0.9, 0.999),
                                     weight_decay=0.0, **fused)
        self.micro_tokens = cfg.micro_batch_tokens
        self.pad_to = cfg.micro_batch_pad_tokens or (1024 if self.device.type == "cuda" else 1)
        self.keep_bytes = int(logit_grad_keep_gib(cfg.logit_grad_keep_gib, self.device) * 2**30)
        self.temperature = topo.rollout_engine.temperature
        self.mini_batch = topo.mini_batch_size
        # staleness.per_token (the topology refuses it without drop_at_consume): the lag a trained token may have
        self.token_bound = topo.staleness_threshold if topo.is_async and topo.staleness.per_token else None
        self.publisher = publisher  # train_engine.WeightPublisher: the buffers rollout workers read; None: no export
        self.dp = dp  # the other ranks (torch_dp.DataParallel) a parallel engine hands each batch to
        self._evaluator = None  # HeldOutEvaluator, made at the first evaluation

    # -- what a parallel layout (torch_parallel.ParallelTrainEngine) replaces ------------------
    def _prepare_model(self, policy: PackedLM) -> PackedLM:
        """The policy to train; a parallel engine shards it here, before the optimizer takes its parameters."""
        return policy

    def _fused_optimizer(self) -> bool:
        return True

    def _data_shard(self) -> tuple[int, int]:
        """(index, count): this rank trains rows index::count of every mini-batch."""
        return 0, 1

    def _sync_grads(self, loss: torch.Tensor) -> torch.Tensor:
        """Make this rank's gradients the mini-batch's; returns the mini-batch's loss (each rank's
        ``loss`` is already weighted by its token share, so the sum over ranks)."""
        return loss

    def _clip_grads(self) -> torch.Tensor:
        """The gradient norm before clipping, as a 0-d tensor (read with the other diagnostics)."""
        return torch.nn.utils.clip_grad_norm_(self.trainable(), self.cfg.grad_clip)

    def _use_compute_copy(self) -> bool:
        """A sharded model takes its precision from the layout (autocast over the shards), not a copy; with
        LoRA the base already is in the compute dtype and the adapters are cast at each use (autocast)."""
        return self.cfg.mixed_precision == "compute_copy" and self.dtype != torch.float32 and self.lora is None

    def trainable(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer steps: all of them, or with LoRA the adapters' (the base is frozen)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def _reference(self):
        """The context the KL reference's forward runs in: with LoRA, the policy's adapters off."""
        return lora_adapters.adapters_off(self.model) if self.lora is not None else contextlib.nullcontext()

    def _compute(self):
        """The context forward and backward run in: autocast over the masters, or nothing (the copy
        already is the compute dtype)."""
        return autocast(self.device, self.dtype) if self.copy is None else contextlib.nullcontext()

    # -- one update ----------------------------------------------------------------------------
    def train(self, batch: list[Trajectory], version: int, baseline=()) -> dict:
        rewards = torch.tensor([float(t.reward or 0.0) for t in batch])
        # Members of these groups gone before this batch (``baseline``: dropped, or trained in an earlier
        # part) still belong to their group's mean and spread: a group is judged as a whole, never by its
        # fast answers alone nor its slow ones alone.
        everyone = torch.cat([rewards, torch.tensor([float(r) for _, r in baseline])])
        adv = grpo_advantages(everyone, [t.group_id or t.traj_id for t in batch] + [g for g, _ in baseline],
                              std_normalize=self.cfg.adv_std_normalize,
                              leave_one_out=self.cfg.adv_leave_one_out)[: len(batch)]
        data = pad_batch(batch, adv, version)
        over = 0
        if self.token_bound is not None:  # staleness.per_token: no token trained over the bound
            stale = (data["lag"] > self.token_bound) & (data["mask"] != 0)
            over = int(stale.sum())
            data["mask"][stale] = 0.0
        if self.dp is not None:
            self.dp.send(data)  # every rank gets the whole padded batch and takes its own rows
        out = self.update(data)
        out["reward"] = float(rewards.mean())
        if self.token_bound is not None:
            out["tokens_over_bound"] = over
        out.update(reward_components(batch))
        return out

    def update(self, data: dict[str, torch.Tensor]) -> dict:
        """The update on this rank's rows of ``data``. With data parallelism each rank holds rows
        rank::world of every mini-batch and scales its loss by its share of the mini-batch's tokens, so
        the all-reduced gradient is exactly the single-process gradient of the mini-batch.

        Nothing in it waits for the device until the end: the micro-batches' inputs are copied without
        waiting, and the diagnostics (loss, ratios, entropy, gradient norm) stay 0-d tensors on the
        device, summed there and read once, after the last optimizer step. On a GPU the host then runs
        ahead launching the next micro-batch's kernels while the last one computes, instead of the two
        taking turns."""
        t0 = time.perf_counter()
        plans, ent_tokens = self._plans(data)
        zero = lambda: torch.zeros((), device=self.device)
        ent_sum = zero()
        # per mini-batch and micro-batch: (proximal logprobs, reference logprobs); None: a mini-batch with
        # no proximal pass (its training forward makes them), not packed until it trains
        prox: list[list | None] = []
        recompute = lambda i: self.recompute_proximal and (i > 0 or not self.forward_is_proximal)
        with torch.no_grad(), phase("update.proximal"):  # proximal policy: the weights before this update
            self.run.eval()
            for i in range(len(plans)):
                if self.ref is None and not recompute(i):
                    prox.append(None)
                    continue
                prox.append([])
                for p, share in plans[i]:
                    lp = None  # made by the training forward: the first mini-batch's, or interpolated
                    if recompute(i):
                        with self._compute():
                            lp, ent = packed_logprobs(self.run, p, self.temperature,
                                                      chunk=self.cfg.logit_chunk_tokens, entropy=True)
                        if share > 0:  # a stand-in row is not this rank's data
                            ent_sum = ent_sum + (ent * p.mask).sum()
                    ref_lp = None
                    if self.ref is not None:
                        with self._compute(), self._reference():
                            ref_lp = packed_logprobs(self.ref, p, self.temperature,
                                                     chunk=self.cfg.logit_chunk_tokens)[0]
                    prox[-1].append((lp, ref_lp))
        self.run.train()
        acc: dict[str, torch.Tensor] = {}  # summed over optimizer steps, on the device
        steps = 0
        for _ in range(self.cfg.ppo_epochs):
            for i, plan in enumerate(plans):
                if prox[i] is None:
                    prox[i] = [(None, None)] * len(plan)
                prox_mb = prox[i]
                self.opt.zero_grad(set_to_none=False)
                loss_sum = zero()
                mb_stats: dict[str, torch.Tensor] = {}
                for j, ((p, share), (prox_lp, ref_lp)) in enumerate(zip(plan, prox_mb)):
                    first = prox_lp is None  # the first epoch's forward of a mini-batch without a proximal pass
                    with self._compute(), phase("update.forward"):
                        logp, ent = packed_logprobs(self.run, p, self.temperature, chunk=self.cfg.logit_chunk_tokens,
                                                    entropy=first, keep_bytes=self.keep_bytes)
                    if first:  # before any step the first mini-batch's forward is its proximal pass, exactly
                        exact = i == 0 and self.forward_is_proximal
                        prox_lp = logp.detach() if exact else loglinear_proximal(p.behav, logp, p.lag)
                        prox_mb[j] = (prox_lp, ref_lp)  # later epochs anchor to it too
                        if share > 0:
                            ent_sum = ent_sum + (ent * p.mask).sum()
                    loss, stats = decoupled_ppo_loss(
                        logp, prox_lp, p.behav, p.adv, p.mask, eps_clip=self.cfg.eps_clip,
                        eps_clip_high=self.cfg.eps_clip_high, behav_imp_weight_cap=self.cfg.behav_imp_weight_cap,
                        tensor_stats=True, lag=p.lag)
                    if ref_lp is not None:
                        kl = masked_mean(kl_penalty(logp, ref_lp, "k3"), p.mask)
                        loss = loss + self.cfg.kl_coef * kl
                        stats["kl"] = kl.detach()
                    with phase("update.backward"):
                        (loss * share).backward()
                    loss_sum = loss_sum + loss.detach() * share
                    for k, v in stats.items():
                        mb_stats[k] = mb_stats.get(k, 0.0) + v * share
                loss_sum = self._sync_grads(loss_sum)
                mine = sum(share for _, share in plan)  # this rank's part of the mini-batch's tokens
                if mine > 0:  # the diagnostics as this rank's token means (the loss is the mini-batch's)
                    mb_stats = {k: v / mine for k, v in mb_stats.items()}
                with phase("update.step"):
                    mb_stats["grad_norm"] = self._clip_grads()
                    self.opt.step()
                    if self.copy is not None:
                        self.copy.refresh()
                mb_stats["loss"] = loss_sum
                for k, v in mb_stats.items():
                    acc[k] = acc.get(k, 0.0) + torch.as_tensor(v, device=self.device, dtype=torch.float32)
                steps += 1
        names = list(acc)
        values = torch.stack([acc[k] for k in names] + [ent_sum]).tolist() if names else [float(ent_sum)]
        out = {k: v / steps for k, v in zip(names, values)}
        out["tokens"] = int(data["mask"].sum())
        out["entropy"] = values[-1] / max(1.0, ent_tokens)  # this rank's tokens (with dp, rank 0's share)
        out["compute_s"] = time.perf_counter() - t0
        return out

    def _plans(self, data: dict[str, torch.Tensor]) -> tuple[_Plans, float]:
        """Per mini-batch, this rank's micro-batches on the device, each with its share of the mini-batch's
        tokens (packed when first asked for: ``_Plans``); and how many loss tokens this rank's entropy is
        averaged over."""
        rank, world = self._data_shard()
        # Equal parts, no tail; padded, neighbours trade samples to need less padding (not with dp > 1: a
        # rank's rows of a mini-batch make one micro-batch, whose total no trade aligns).
        members = mini_batch_members(data["attn"].sum(1).tolist(), self.mini_batch, self.pad_to if world == 1 else 1)
        batches = [torch.tensor(m, dtype=torch.long) for m in members]
        ent_tokens = sum(float(data["mask"][mb[rank::world]].sum()) for mb in batches)
        return _Plans(lambda k: self._plan(data, batches[k], rank, world), len(batches)), ent_tokens

    def _plan(self, data: dict[str, torch.Tensor], mb: torch.Tensor, rank: int,
              world: int) -> list[tuple[Packed, float]]:
        with phase("update.pack"):
            rows = mb[rank::world]
            # A rank without rows of its own still runs every forward and backward, on a stand-in row
            # weighted 0: sharded weights (FSDP, tensor parallel) are gathered inside them by all ranks.
            # For the same reason, with dp > 1 a rank's rows make one micro-batch: every rank must run
            # as many forwards as the others.
            packs = pack_rows(data, rows if len(rows) else mb[:1], self.micro_tokens if world == 1 else 1 << 62,
                              self.pad_to, loss_only=True)
            # The mini-batch's loss = sum of its tokens' terms / total: its loss tokens (token-mean), or its
            # samples x trainer_engine.loss_token_norm (a constant per sample, whatever else is in it).
            norm = self.cfg.loss_token_norm
            total = float(len(mb) * norm) if norm else float(data["mask"][mb].sum().clamp(min=1))
            return [(p.to(self.device), float(p.mask.sum()) / total if len(rows) else 0.0) for p in packs]

    # -- weights out ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The float32 master weights under their Hugging Face names; with LoRA the adapters' alone (under
        peft's names: ``...q_proj.lora_A.default.weight``)."""
        if self.lora is not None:
            return {k: v.detach() for k, v in self.model.named_parameters() if v.requires_grad}
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def served(self) -> dict[str, torch.Tensor]:
        """What the rollout workers serve of the current weights, in model.dtype: the full weights, or with
        LoRA the adapter alone in its published format (model/adapters.py)."""
        if self.lora is not None:
            return lora_adapters.wire_weights(self.state_dict(), self.dtype)
        return export_state_dict(self.state_dict(), self.model.config, self.dtype)

    def export_weights(self, version: int) -> tuple[str, int]:
        """(location, nbytes) of ``version`` in the rollout workers' buffers, in the rollout dtype
        (model.dtype); WeightsBusy while none is free."""
        if self.publisher is None:
            return "", 0
        return self.publisher.publish(self.served(), version)

    def release(self, version: int) -> None:
        if self.publisher is not None:
            self.publisher.release(version)

    def evaluate(self, version: int) -> dict | None:
        """The held-out games played greedily on the current weights; None without eval_interval."""
        if self.cfg.eval_interval <= 0:
            return None
        if self._evaluator is None:
            self._evaluator = HeldOutEvaluator(self.topo, self.base_path,
                                               self.served if self.lora is not None else self.state_dict)
        return self._evaluator(version)

    def close(self, in_flight: bool = False) -> None:
        if self.dp is not None and not in_flight:
            self.dp.close()  # tell the other ranks to stop (mid-update, killasgroup stops them)
        if self.publisher is not None:
            self.publisher.close()
        if getattr(self, "shared_base", None) is not None:  # the base's segment (CPU): the workers that map it keep their pages
            self.shared_base.close()

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, folder: Path, version: int, consumed: list[str]) -> Path:
        """An HF checkpoint of ``version`` plus what resuming needs; written to a temp folder and
        renamed, so a crash mid-save never leaves a half checkpoint that resume would pick."""
        folder = Path(folder)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if self.lora is not None:  # the adapter and the base's record; the base stays where it is
            lora_adapters.save(tmp, self.state_dict(), self.lora, self.base_path, self.base_sha)
        else:
            self._save_weights(tmp)
            for name in TOKENIZER_FILES:
                if (self.model_path / name).exists():
                    shutil.copy(self.model_path / name, tmp / name)
        torch.save(self.optimizer_state(), tmp / "optimizer.pt")
        (tmp / "trainer_state.json").write_text(json.dumps({"version": version, "consumed": consumed}))
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        return folder

    def _save_weights(self, folder: Path) -> None:
        save_weights(self.model.config, self.state_dict(), folder)

    def optimizer_state(self) -> dict:
        """AdamW's state as ``optimizer.pt`` holds it (keyed by parameter index: layout-independent)."""
        return self.opt.state_dict()

    def load_optimizer(self, folder: Path) -> None:
        state = torch.load(Path(folder) / "optimizer.pt", map_location=self.device, weights_only=True)
        self._load_optimizer_state(state)

    def _load_optimizer_state(self, state: dict) -> None:
        load_optimizer_keeping_options(self.opt, state)
        if self.copy is not None:
            self.copy.refresh()



STEP_OPTIONS = ("fused", "foreach", "capturable", "differentiable")
"""How an optimizer steps, not what it has learned: this process's choice (a fused kernel on one GPU, the
multi-tensor or one-by-one path elsewhere), never a checkpoint's, which may come from another layout."""


def load_optimizer_keeping_options(opt: torch.optim.Optimizer, state: dict) -> None:
    """``opt.load_state_dict(state)``, keeping ``opt``'s own STEP_OPTIONS (load_state_dict would take
    the checkpoint's), with a fused optimizer's step counts where its kernel wants them: float32 on the
    parameter's device (a checkpoint of the multi-tensor path keeps them on the host)."""
    own = [{k: g[k] for k in STEP_OPTIONS if k in g} for g in opt.param_groups]
    opt.load_state_dict(state)
    for group, options in zip(opt.param_groups, own):
        group.update(options)
        if group.get("fused") or group.get("capturable"):
            for p in group["params"]:
                st = opt.state.get(p)
                if st and "step" in st:
                    st["step"] = torch.as_tensor(st["step"], dtype=torch.float32).to(p.device)


class _Plans:
    """An update's mini-batches, packed (on the host) and queued for the device when first asked for,
    then kept: the device starts on the first proximal forward while the host packs the next
    mini-batch, where packing all of them first left it idle throughout (+1% at the Qwen2-0.5B shape on
    an H200, within one call's noise: bench/RESULTS.md); a mini-batch with no proximal pass is packed
    when it trains."""

    def __init__(self, make, count: int):
        self._make, self._count = make, count
        self._done: dict[int, list] = {}

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: int) -> list:
        if i not in self._done:
            self._done[i] = self._make(i)
        return self._done[i]

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def dropout_free(model) -> bool:
    """No dropout anywhere in ``model``: no Dropout module with p > 0 and none in its config (transformers'
    attention functions take ``config.attention_dropout`` in training mode)."""
    cfg = model.config
    rates = [getattr(cfg, k, 0.0) or 0.0 for k in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop",
                                                   "embd_pdrop", "attn_pdrop")]
    return not any(float(r) > 0 for r in rates) and not any(
        isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def logit_grad_keep_gib(configured: float | None, device: torch.device) -> float:
    """trainer_engine.logit_grad_keep_gib, or its default: on CUDA a tenth of the device's memory, at
    most 8 GiB (all of a 16k-token micro-batch's at Qwen2's vocabulary on an 80 GB or larger GPU; a
    24 GB one keeps 2.4 GiB and recomputes the rest); 1 GiB on CPU."""
    if configured is not None:
        return configured
    if device.type == "cuda":
        return min(8.0, torch.cuda.get_device_properties(device).total_memory / 2**30 / 10)
    return 1.0


def compile_layers(policy: PackedLM) -> None:
    """``torch.compile`` each decoder layer (dynamic shapes: packed micro-batches differ in length), so
    the norms, rotary embedding, activations and residual adds around the matmuls fuse into a few
    kernels. The first update pays the compilation (8 s at 0.5B and at 1.5B on an H200, bench/RESULTS.md).
    The whole decoder as one graph had not finished its first update after two minutes at the
    Qwen2-0.5B shape (bench/RESULTS.md); one layer's graph serves all of them."""
    for layer in getattr(policy.lm, policy.lm.base_model_prefix).layers:
        layer.compile(dynamic=True)


class HeldOutEvaluator:
    """Plays the configured task's held-out instances (agent.framework's eval seeds: guess's stratified
    games, agent.dataset's eval split) greedily with the trainer's current weights (``weights()``: the full
    weights, or with LoRA the adapter, served on the base as rollout serves it), in
    a rollout engine of its own on the trainer's device; it runs on the compute thread between updates.
    Its output: eval_reward, eval_accuracy (when the task marks episodes correct), eval_turns and the
    completions' token counts (areal_bus/tasks/runner.py: evaluate)."""

    def __init__(self, topo, model_path: Path, weights):
        self.episodes = topo.trainer_engine.eval_episodes
        # The trainer's folder is the supervisord.conf's (the cwd): the task's dataset and plug-ins
        # resolve from it as in every other node.
        self.driver = make_driver(topo, Path.cwd(), tokenizer=load_tokenizer(model_path))
        self.seeds = self.driver.eval_seeds(self.episodes)
        model = rollout_model(model_path, topo.trainer_engine.lora, topo.trainer_device, topo.model.dtype)
        self.engine = TorchRolloutEngine(model, max_batch=min(64, max(1, len(self.seeds))),
                                         max_len=topo.rollout_engine.max_len, device=topo.trainer_device,
                                         dtype=topo.model.dtype, worker="eval", weight_loader=lambda _: weights())

    def __call__(self, version: int) -> dict:
        self.engine.swap_weights(version, "trainer")
        return evaluate(self.engine, self.driver, seeds=self.seeds)
