"""The real trainer engine: staleness-aware PPO on a Qwen2/Llama checkpoint, in plain torch.

One ``train(batch, version)`` is one policy update (one version):
  1. GRPO advantages per trajectory from its reward and its group (the n samples of one task instance);
  2. the batch is padded into [B, T] tensors: prompt + output tokens, with the loss mask (policy tokens
     only: prompt and environment tokens are 0), the behaviour log-probabilities the engine recorded;
  3. proximal log-probabilities are recomputed once, with the weights as they stand before this update;
  4. ``ppo_epochs`` passes of mini-batch steps of ``decoupled_ppo_loss`` (AdamW, gradient clipping).

Checkpoints are ordinary Hugging Face folders (config.json + model.safetensors + the tokenizer files
copied from the start checkpoint), plus ``trainer_state.json`` (version, consumed trajectory ids) and
``optimizer.pt`` (AdamW's state, torch's own format, written and read only by this trainer on this
host: nothing that crossed a socket). An engine built from a checkpoint folder, then ``load_optimizer``
(what ``train_engine.build_train_engine(checkpoint=...)`` does), restores all three, so the version
sequence continues.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from areal_bus.loss import decoupled_ppo_loss, grpo_advantages, kl_penalty, masked_mean
from areal_bus.messages import Trajectory
from areal_bus.modeling import as_dtype, load_pretrained, save_pretrained, token_logprobs

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")


def pad_batch(batch: list[Trajectory], advantages: torch.Tensor) -> dict[str, torch.Tensor]:
    """[B, T] tensors for a batch: ids, attention mask, loss mask, behaviour logprobs, advantages.
    Right padding; position t of a row holds the token whose log-probability ``token_logprobs`` puts
    at t, so the engine's per-token records line up with the trainer's recompute by construction."""
    lengths = [t.prompt_ids.size + t.output_ids.size for t in batch]
    B, T = len(batch), max(lengths)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.float32)
    behav = torch.zeros(B, T, dtype=torch.float32)
    adv = torch.zeros(B, T, dtype=torch.float32)
    for i, t in enumerate(batch):
        p, n = t.prompt_ids.size, t.output_ids.size
        ids[i, :p + n] = torch.from_numpy(np.concatenate([t.prompt_ids, t.output_ids]).astype(np.int64))
        attn[i, :p + n] = 1
        mask[i, p:p + n] = torch.from_numpy(t.loss_mask.astype(np.float32))
        behav[i, p:p + n] = torch.from_numpy(t.logprobs.astype(np.float32))
        adv[i, p:p + n] = advantages[i]
    return {"ids": ids, "attn": attn, "mask": mask, "behav": behav, "adv": adv}


class TorchTrainEngine:
    """Implements areal_bus.engines.train_engine.TrainEngine."""

    def __init__(self, topo, model_path: str | Path, *, publisher=None, dp=None, device=None):
        cfg = topo.trainer_engine
        self.cfg = cfg
        self.topo = topo
        self.model_path = Path(model_path)
        self.device = torch.device(device or topo.trainer_device)
        self.dtype = as_dtype(topo.model.dtype)
        torch.manual_seed(topo.model.seed)
        self.model = self._prepare_model(
            load_pretrained(self.model_path, self.device, self.dtype).train().requires_grad_(True))
        self.ref = None
        if cfg.kl_coef > 0:
            self.ref = load_pretrained(self.model_path, self.device, self.dtype).eval().requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=topo.learning_rate, betas=(0.9, 0.999),
                                     weight_decay=0.0)
        self.temperature = topo.rollout_engine.temperature
        self.mini_batch = topo.mini_batch_size
        self.publisher = publisher  # train_engine.WeightPublisher: the buffers rollout workers read; None: no export
        self.dp = dp  # the other ranks (torch_dp.DataParallel) a parallel engine hands each batch to
        self._evaluator = None  # HeldOutEvaluator, made at the first evaluation

    # -- what a parallel layout (torch_parallel.ParallelTrainEngine) replaces ------------------
    def _prepare_model(self, model):
        """The model to train; a parallel engine shards it here, before the optimizer takes its parameters."""
        return model

    def _data_shard(self) -> tuple[int, int]:
        """(index, count): this rank trains rows index::count of every mini-batch."""
        return 0, 1

    def _sync_grads(self, loss: torch.Tensor) -> torch.Tensor:
        """Make this rank's gradients the mini-batch's; returns the mini-batch's loss (each rank's
        ``loss`` is already weighted by its token share, so the sum over ranks)."""
        return loss

    def _clip_grads(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))

    # -- one update ----------------------------------------------------------------------------
    def train(self, batch: list[Trajectory], version: int) -> dict:
        rewards = torch.tensor([float(t.reward or 0.0) for t in batch])
        adv = grpo_advantages(rewards, [t.group_id or t.traj_id for t in batch],
                              std_normalize=self.cfg.adv_std_normalize, leave_one_out=self.cfg.adv_leave_one_out)
        data = pad_batch(batch, adv)
        if self.dp is not None:
            self.dp.send(data)  # every rank gets the whole padded batch and takes its own rows
        out = self.update(data)
        out["reward"] = float(rewards.mean())
        return out

    def update(self, data: dict[str, torch.Tensor]) -> dict:
        """The update on this rank's rows of ``data``. With data parallelism each rank holds rows
        rank::world of every mini-batch and scales its loss by its share of the mini-batch's tokens, so
        the all-reduced gradient is exactly the single-process gradient of the mini-batch."""
        t0 = time.perf_counter()
        rank, world = self._data_shard()
        data = {k: v.to(self.device) for k, v in data.items()}
        B = data["ids"].shape[0]
        # This rank's rows: its share of every mini-batch (not rows rank::world of the whole batch,
        # which differ as soon as world does not divide the mini-batch size).
        mine = torch.cat([torch.arange(s, min(B, s + self.mini_batch))[rank::world]
                          for s in range(0, B, self.mini_batch)])
        # A rank without rows of its own still runs every forward and backward, on a stand-in row
        # weighted 0: sharded weights (FSDP, tensor parallel) are gathered inside them by all ranks.
        run = mine if len(mine) else torch.arange(1)
        prox = torch.zeros_like(data["behav"])
        ref = torch.zeros_like(data["behav"]) if self.ref is not None else None
        with torch.no_grad():  # proximal policy: the weights before this update
            self.model.eval()
            lp = token_logprobs(self.model, data["ids"][run], data["attn"][run], self.temperature)
            prox[mine] = lp[:len(mine)]
            if ref is not None and len(mine):
                ref[mine] = token_logprobs(self.ref, data["ids"][mine], data["attn"][mine], self.temperature)
        self.model.train()
        acc: dict[str, float] = {}
        steps = 0
        for _ in range(self.cfg.ppo_epochs):
            for start in range(0, B, self.mini_batch):
                mb = torch.arange(start, min(B, start + self.mini_batch))
                rows = mb[rank::world]
                share = float(data["mask"][rows].sum() / data["mask"][mb].sum().clamp(min=1))
                if not len(rows):
                    rows = mb[:1]  # the stand-in row (share 0, see above)
                self.opt.zero_grad(set_to_none=False)
                logp = token_logprobs(self.model, data["ids"][rows], data["attn"][rows], self.temperature)
                loss, stats = decoupled_ppo_loss(
                    logp, prox[rows], data["behav"][rows], data["adv"][rows], data["mask"][rows],
                    eps_clip=self.cfg.eps_clip, eps_clip_high=self.cfg.eps_clip_high,
                    behav_imp_weight_cap=self.cfg.behav_imp_weight_cap)
                if ref is not None:
                    kl = masked_mean(kl_penalty(logp, ref[rows], "k3"), data["mask"][rows])
                    loss = loss + self.cfg.kl_coef * kl
                    stats["kl"] = float(kl)
                (loss * share).backward()
                loss = self._sync_grads(loss.detach() * share)
                stats["grad_norm"] = self._clip_grads()
                self.opt.step()
                stats["loss"] = float(loss.detach())
                for k, v in stats.items():
                    acc[k] = acc.get(k, 0.0) + float(v)
                steps += 1
        out = {k: v / steps for k, v in acc.items()}
        out["tokens"] = int(data["mask"].sum())
        out["compute_s"] = time.perf_counter() - t0
        return out

    # -- weights out ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def export_weights(self, version: int) -> tuple[str, int]:
        """(location, nbytes) of ``version`` in the rollout workers' buffers; WeightsBusy while none is free."""
        if self.publisher is None:
            return "", 0
        return self.publisher.publish(self.state_dict(), version)

    def release(self, version: int) -> None:
        if self.publisher is not None:
            self.publisher.release(version)

    def evaluate(self, version: int) -> dict | None:
        """The held-out games played greedily on the current weights; None without eval_interval."""
        if self.cfg.eval_interval <= 0:
            return None
        if self._evaluator is None:
            self._evaluator = HeldOutEvaluator(self.topo, self.model_path, self.state_dict)
        return self._evaluator(version)

    def close(self, in_flight: bool = False) -> None:
        if self.dp is not None and not in_flight:
            self.dp.close()  # tell the other ranks to stop (mid-update, killasgroup stops them)
        if self.publisher is not None:
            self.publisher.close()

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, folder: Path, version: int, consumed: list[str]) -> Path:
        """An HF checkpoint of ``version`` plus what resuming needs; written to a temp folder and
        renamed, so a crash mid-save never leaves a half checkpoint that resume would pick."""
        folder = Path(folder)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
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
        save_pretrained(self.model, folder)

    def optimizer_state(self) -> dict:
        """AdamW's state as ``optimizer.pt`` holds it (keyed by parameter index: layout-independent)."""
        return self.opt.state_dict()

    def load_optimizer(self, folder: Path) -> None:
        state = torch.load(Path(folder) / "optimizer.pt", map_location=self.device, weights_only=True)
        self._load_optimizer_state(state)

    def _load_optimizer_state(self, state: dict) -> None:
        self.opt.load_state_dict(state)



class HeldOutEvaluator:
    """Plays the held-out games greedily with the trainer's current weights (``weights()``), in a
    rollout engine of its own on the trainer's device; it runs on the compute thread between updates."""

    def __init__(self, topo, model_path: Path, weights):
        from areal_bus.engines.torch_engine import TorchRolloutEngine
        from areal_bus.tasks.runner import GuessDriver, load_tokenizer

        self.episodes = topo.trainer_engine.eval_episodes
        self.driver = GuessDriver(load_tokenizer(model_path), n=topo.agent.task_size, max_turns=topo.agent.max_turns)
        self.engine = TorchRolloutEngine(model_path, max_batch=min(64, self.episodes),
                                         max_len=topo.rollout_engine.max_len, device=topo.trainer_device,
                                         dtype=topo.model.dtype, worker="eval", weight_loader=lambda _: weights())

    def __call__(self, version: int) -> dict:
        from areal_bus.tasks.runner import evaluate

        self.engine.swap_weights(version, "trainer")
        return evaluate(self.engine, self.driver, k=self.episodes)
