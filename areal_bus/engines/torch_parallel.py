"""Trainer parallelism over torch.distributed: data parallel with FSDP2, tensor parallel with DTensor.

The topology's ``train_workers`` ranks are laid out by ``parallelism.tp``, with ``dp = train_workers / tp``
(areal_bus/config/root.py derives it). The ranks form a 2-D
DeviceMesh ("dp", "tp") with rank = dp_index * tp + tp_index, so the ranks of one tensor-parallel
group are neighbours: on one host, the GPUs with the fastest links between them.

* tp (DTensor, ``parallelize_module``): in every decoder layer q/k/v and gate/up are split by output
  feature (ColwiseParallel: each rank holds heads/tp query heads, kv_heads/tp kv heads and
  intermediate/tp MLP channels) and o/down by input feature (RowwiseParallel, output all-reduced), so
  attention and MLP each cost one all-reduce forward and one backward. The embedding, the norms and
  lm_head stay whole on every tp rank: their inputs' gradients are all-reduced by the parallel
  linears, so every tp rank computes the same (full) gradient for them.
* dp (FSDP2, ``fully_shard``): each decoder layer, then the root (embedding, final norm, lm_head), is
  sharded over the mesh's dp dimension; on a 2-D mesh the tp shards are sharded again over dp.

The update is ``TorchTrainEngine.update``, unchanged: the same loss, the same mini-batches. Every rank
receives the whole padded batch (torch_dp's broadcast); dp coordinate i trains rows i::dp of every
mini-batch (the tp ranks of one coordinate the same rows) with its loss weighted by its share of the
mini-batch's tokens, so the sum of the ranks' gradients (FSDP2's average times dp) is the
single-process gradient of the mini-batch; gradient clipping takes the norm of the full gradient over
every shard (``clip_grad_norm_``).

Rank 0 (the trainer node) alone talks to the bus. Full (unsharded) weights for checkpoints and
evaluation, and AdamW's full state for checkpoints, are gathered by all ranks together: rank 0 tells
the others when with a command on the batch channel (``RankGroup``). A published version (what rollout
serves) is gathered the same way but a bucket at a time, straight into the publish buffer
(``gather_in_buckets``): rank 0 claims the free buffer, every rank casts each shard to model.dtype and
gathers it whole, and rank 0 copies each bucket into the buffer's views and drops it before the next;
no rank ever holds a second full copy of the model, and rollout workers read that buffer as they read
a single-process trainer's (CUDA IPC on GPUs, across GPUs too; shared memory on CPU). Checkpoints keep
the single-process format (an HF folder and an index-keyed ``optimizer.pt``), so a run resumes under any
layout.

Ranks > 0 run ``python -m areal_bus.engines.torch_parallel`` (started by rank 0; see torch_dp).
Check on CPU: ``pytest tests/test_parallel.py``; on GPUs: ``python bench/trainer_parallel.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import AutoConfig

from areal_bus.config.topology import load_topology
from areal_bus.engines.torch_dp import CMD_STOP, CMD_TRAIN, DataParallel, backend_for, watch_parent
from areal_bus.engines.torch_train import TorchTrainEngine, load_optimizer_keeping_options
from areal_bus.train.lora import wire_name as lora_wire_name
from areal_bus.train.train_model import PackedLM, save_weights

CMD_WEIGHTS, CMD_OPTIMIZER, CMD_LOAD_OPTIMIZER, CMD_PUBLISH = 2, 3, 4, 5
"""Rank 0's commands besides train and stop: gather the full weights / AdamW's full state; load
AdamW's state from the checkpoint the ranks started from (resume); gather a version into the publish
buffer, a bucket at a time."""

PUBLISH_BUCKET_BYTES = 512 << 20
"""Most bytes of gathered (whole) tensors a rank holds at once while publishing, unless one tensor is
larger (Qwen2-7B's embedding is 1.1 GB in bfloat16). Each tensor is one all-gather whatever the bucket;
the bucket bounds memory, and a few hundred MB is already far past the size where a gather's bandwidth
stops growing."""

# Which linear of a decoder layer is split which way under tensor parallelism.
_TP_PLAN = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
            "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"}


# ---------------------------------------------------------------------------------------------
# The layout: pure functions on a model and a mesh (the benchmark uses them as they are)
# ---------------------------------------------------------------------------------------------


def check_tp(cfg, tp: int, model: str = "the model") -> None:
    """Tensor parallelism splits attention heads, kv heads and the MLP's channels evenly: refuse a tp
    that does not divide all three, naming the ones that would work."""
    sizes = {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
             "intermediate_size": cfg.intermediate_size}
    bad = [f"{k} ({v})" for k, v in sizes.items() if v % tp]
    if bad:
        ok = [d for d in range(1, cfg.num_key_value_heads + 1) if all(v % d == 0 for v in sizes.values())]
        raise ValueError(f"parallelism.tp={tp} does not divide {', '.join(bad)} of {model}: tensor parallel "
                         f"splits query heads, kv heads and the MLP's intermediate size evenly across the tp "
                         f"ranks; tp this model supports: {', '.join(map(str, ok))}")


def rank_device(device: str, rank: int) -> torch.device:
    """This rank's device: ``cpu``, or GPU ``k + rank`` for ``cuda`` / ``cuda:k`` (one GPU per rank)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    index = (dev.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"trainer rank {rank} needs GPU cuda:{index} (trainer device {device!r}, one GPU per "
                         f"rank) but this host has {torch.cuda.device_count()}")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def make_mesh(dp: int, tp: int, device_type: str) -> DeviceMesh:
    if dist.get_world_size() != dp * tp:
        raise ValueError(f"dp x tp = {dp} x {tp} = {dp * tp} ranks, but the process group has "
                         f"{dist.get_world_size()}")
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))


def parallelize(policy: PackedLM, mesh: DeviceMesh, reshard_after_forward: bool = True) -> PackedLM:
    """Shard ``policy`` (the transformers model inside a PackedLM) in place over ``mesh`` ("dp", "tp"):
    tensor parallel first, then FSDP2 (``reshard_after_forward``: parallelism.reshard_after_forward)."""
    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    layers = getattr(policy.lm, policy.lm.base_model_prefix).layers
    if tp > 1:
        check_tp(policy.config, tp)
        plan = {name: ColwiseParallel() if kind == "col" else RowwiseParallel() for name, kind in _TP_PLAN.items()}
        for layer in layers:
            # The projections then yield this rank's heads only; transformers' attention infers the
            # head count from head_dim, so nothing else changes.
            parallelize_module(layer, mesh["tp"], plan)
    if dp > 1:
        for layer in layers:
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        # The root (embedding, final norm, lm_head): PackedLM's forward runs the chunked head too, so
        # its unit gathers them for the whole computation; needed again at once by backward: kept.
        fully_shard(policy, mesh=mesh["dp"], reshard_after_forward=False)
    return policy


def clip_grad_norm_(params, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` over gradients that are sharded (FSDP2, tp: DTensors on
    different meshes) or replicated (plain tensors), mixed: the 2-norm of the full gradient, the same
    number on every rank. Returns the norm before clipping."""
    world = dist.get_world_size()
    grads, locals_, copies = [], [], []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                raise RuntimeError(f"gradient with a partial placement {g.placements}: not reduced yet")
            # Every placement but Replicate splits (Shard, and _StridedShard, which is not a Shard in
            # every torch version): the ranks along Replicate dims, and outside the mesh, hold copies.
            shards = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if not pl.is_replicate())
            locals_.append(g.to_local())
            copies.append(world // shards)  # ranks that hold this same shard
        else:
            locals_.append(g)
            copies.append(world)
        grads.append(g)
    dev = locals_[0].device if locals_ else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=dev)
    for t, c in zip(locals_, copies):
        total += t.float().pow(2).sum() / c
    dist.all_reduce(total)
    norm = float(total.sqrt())
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        with torch.no_grad():
            for g in grads:
                g.mul_(coef)
    return norm


def full_state_dict(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
    """The whole, unsharded weights under their Hugging Face names (tied ones under both), as CPU
    tensors on rank 0 and None elsewhere; ``trainable_only``: those that require grad (LoRA's adapters).
    A collective: every rank calls it, in step."""
    keep = dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if trainable_only and not p.requires_grad:
                continue
            if id(p) in seen:
                if keep:
                    out[name] = out[seen[id(p)]]
                continue
            seen[id(p)] = name
            full = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
            if keep:
                out[name] = full.to("cpu", copy=not isinstance(p, DTensor))  # never alias a live parameter
    return out if keep else None


def served_params(model: torch.nn.Module, lora: bool) -> list[tuple[str, torch.Tensor]]:
    """What rollout serves of a (sharded) model, in the order a single process publishes it: the state
    dict under its Hugging Face names, a tied lm_head left out (``train_model.export_state_dict``); with
    LoRA the adapters alone under their published names (``lora.wire_weights``). The same list on every
    rank; its tensors are this rank's parameters (DTensors where sharded), not copies."""
    if lora:
        return [(lora_wire_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return [(n, t) for n, t in model.state_dict(keep_vars=True).items()
            if not (tied and n == "lm_head.weight") and not n.endswith("rotary_emb.inv_freq")]


def gather_in_buckets(items: list[tuple[str, torch.Tensor]], dtype: torch.dtype, bucket_bytes: int,
                      sink=None) -> None:
    """Every tensor of ``items`` whole and in ``dtype``, a bucket at a time. A collective: every rank
    calls it with the same ``items``, in step. A DTensor is cast on its shard (at bfloat16 half the
    bytes to gather) and gathered (``full_tensor``); a plain tensor (replicated) is passed as it is,
    for the sink's copy to cast. Buckets are cut before gathering, from the tensors' global sizes:
    ``sink(bucket)`` (rank 0; None on the others, which drop each tensor at once) receives
    [(name, tensor)] holding at most ``bucket_bytes`` of gathered tensors (or one larger tensor), must
    copy them out and keep none, and the next bucket is gathered only after it returns."""
    bucket: list[tuple[str, torch.Tensor]] = []
    held = 0
    with torch.no_grad():
        for name, t in items:
            n = t.numel() * dtype.itemsize if isinstance(t, DTensor) else 0  # a plain tensor costs nothing new
            if bucket and held + n > bucket_bytes:
                sink(bucket)
                bucket, held = [], 0
            full = t.detach().to(dtype).full_tensor() if isinstance(t, DTensor) else t.detach()
            if sink is not None:
                bucket.append((name, full))
                held += n
            del full
        if bucket:
            sink(bucket)


def copy_into(views: dict[str, torch.Tensor]):
    """A ``gather_in_buckets`` sink that copies each tensor into its view of the publish buffer (a CUDA
    copy is queued on the current stream, where the next gather's memory is then reused in order)."""
    def sink(bucket: list[tuple[str, torch.Tensor]]) -> None:
        for name, full in bucket:
            views[name].copy_(full)
    return sink


# ---------------------------------------------------------------------------------------------
# The ranks and the engine
# ---------------------------------------------------------------------------------------------


class RankGroup(DataParallel):
    """torch_dp's ranks (launch, batch broadcast, stop) plus rank 0's gather commands: a sharded
    tensor is gathered by every rank together, so the others must hear when rank 0 wants one."""

    def request(self, cmd: int) -> None:
        """Rank 0: have every rank run ``cmd`` with it."""
        dist.broadcast(torch.tensor([cmd, 0, 0], dtype=torch.long), src=0)


class ParallelTrainEngine(TorchTrainEngine):
    """TorchTrainEngine on dp x tp ranks. Rank 0's instance serves the node exactly as the single-process
    engine does; the others follow its commands (``main``)."""

    def __init__(self, topo, model_path: str | Path, *, group: RankGroup, publisher=None, base_model=None):
        par = self.parallelism = topo.parallelism
        self.dp_size, self.tp_size = par.dp, par.tp
        self.group = group
        # LOCAL_RANK (set by torch_dp) picks this host's GPU when the ranks span hosts.
        device = rank_device(topo.trainer_device, int(os.environ.get("LOCAL_RANK", group.rank)))
        self.mesh = make_mesh(par.dp, par.tp, device.type)
        self._weights: dict[str, torch.Tensor] | None = None  # rank 0: the gathered weights of this version
        self._template: dict[str, torch.Tensor] | None = None  # rank 0: the published layout, as meta tensors
        super().__init__(topo, model_path, publisher=publisher, dp=group, device=device, base_model=base_model)
        self._step_one_by_one()

    def train(self, batch, version: int, baseline=()) -> dict:
        # An update that raises leaves the other ranks inside a collective (or a rank is gone): the
        # group cannot go on, so the process exits and supervisord restarts every rank (torch_dp).
        try:
            return super().train(batch, version, baseline)
        except Exception as exc:  # noqa: BLE001 -- any: the ranks are out of step whatever it was
            self.group.abort(exc)
            raise

    def _prepare_model(self, policy):
        check_tp(policy.config, self.tp_size, f"model.path {self.model_path}")
        return parallelize(policy, self.mesh, getattr(self.parallelism, "reshard_after_forward", True))

    def _step_one_by_one(self) -> None:
        # With tp the layers' projections are DTensors beside tensors of another kind (plain, or on the
        # dp mesh); AdamW's multi-tensor path (CUDA's default) refuses to mix them in one call, so step
        # them one by one (the path CPU takes by default, which the gloo parity tests check). Set on the
        # groups, not saved: load_state_dict brings back the checkpoint's (single-process) options.
        if self.tp_size > 1:
            for group in self.opt.param_groups:
                group["foreach"] = False

    def _data_shard(self) -> tuple[int, int]:
        return self.mesh.get_local_rank("dp"), self.dp_size

    def _use_compute_copy(self) -> bool:
        return False  # sharded (FSDP2) or split (tp) weights: autocast over each rank's float32 shards

    def _sync_grads(self, loss: torch.Tensor) -> torch.Tensor:
        # FSDP2 has reduce-scattered the gradients in backward (tp needs no reduction), averaging over
        # dp; each rank's loss is already weighted by its share, so the sum is wanted. (A gradient
        # divide factor of 1 would do it inside the collective, but as PREMUL_SUM, which gloo lacks.)
        loss = loss.detach().clone()
        if self.dp_size > 1:
            with torch.no_grad():
                for p in self.trainable():
                    if p.grad is not None:
                        p.grad.mul_(self.dp_size)
            dist.all_reduce(loss, group=self.mesh.get_group("dp"))
        return loss

    def _clip_grads(self) -> float:
        return clip_grad_norm_(self.trainable(), self.cfg.grad_clip)

    def _fused_optimizer(self) -> bool:
        return False

    def update(self, data: dict[str, torch.Tensor]) -> dict:
        self._weights = None
        return super().update(data)

    # -- a version for rollout, gathered into the publish buffer ----------------------------------
    def export_weights(self, version: int) -> tuple[str, int]:
        """Rank 0: ``version`` gathered from the shards straight into the free publish buffer, a bucket
        at a time (WeightsBusy, before any rank gathers, while no buffer is free)."""
        if self.publisher is None:
            return "", 0
        if self._template is None:  # names, global shapes and the rollout dtype: no gather needed
            self._template = {name: torch.empty(t.shape, dtype=self.dtype, device="meta")
                              for name, t in served_params(self.model, self.lora is not None)}
        return self.publisher.publish_into(self._template, version, self._gather_published, self.device)

    def _gather_published(self, views: dict[str, torch.Tensor]) -> None:
        self.group.request(CMD_PUBLISH)
        try:
            self.publish_gather(copy_into(views))
        except Exception as exc:  # noqa: BLE001 -- any: a rank left mid-gather leaves the group out of step
            self.group.abort(exc)
            raise

    def publish_gather(self, sink=None, bucket_bytes: int = PUBLISH_BUCKET_BYTES) -> None:
        """Every rank, together (rank 0 on CMD_PUBLISH's word): the served tensors whole in model.dtype,
        bucket by bucket to ``sink`` (rank 0; see ``gather_in_buckets``)."""
        gather_in_buckets(served_params(self.model, self.lora is not None), self.dtype, bucket_bytes, sink)

    # -- full state, gathered by all ranks ------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """Rank 0: the full weights, with LoRA the adapters' alone (gathered once per version: evaluation
        and checkpoint share them; a published version is gathered into its buffer, ``export_weights``).
        Other ranks: take part in the gather, get None."""
        if self.group.rank == 0:
            if self._weights is not None:
                return self._weights
            self.group.request(CMD_WEIGHTS)
        sd = full_state_dict(self.model, trainable_only=self.lora is not None)
        if self.group.rank == 0:
            self._weights = sd
        return sd

    def optimizer_state(self) -> dict | None:
        """Rank 0: AdamW's state with full tensors, in the single-process format. Others: None."""
        if self.group.rank == 0:
            self.group.request(CMD_OPTIMIZER)
        sd = self.opt.state_dict()  # index-keyed; sharded parameters' moments are DTensors
        keep = self.group.rank == 0
        state = {}
        with torch.no_grad():
            for i in sorted(sd["state"]):
                entry = {}
                for k in sorted(sd["state"][i]):
                    v = sd["state"][i][k]
                    v = v.full_tensor() if isinstance(v, DTensor) else v
                    entry[k] = v.to("cpu", copy=True) if keep else None
                state[i] = entry
        groups = [{**g, "foreach": None} for g in sd["param_groups"]]  # as the single-process engine saves them
        return {"state": state, "param_groups": groups} if keep else None

    def _save_weights(self, folder: Path) -> None:
        save_weights(self.model.config, self.state_dict(), folder)

    def load_optimizer(self, folder: Path) -> None:
        """Every rank loads ``folder``/optimizer.pt, on rank 0's word: the folder the ranks started
        from (the checkpoint a run resumes), which is the only path they know."""
        if self.group.rank == 0:
            if Path(folder).resolve() != self.model_path.resolve():
                raise ValueError(f"the trainer ranks started from {self.model_path}; they can resume "
                                 f"the optimizer only from there, not from {folder}")
            self.group.request(CMD_LOAD_OPTIMIZER)
        super().load_optimizer(folder)

    def _load_optimizer_state(self, state: dict) -> None:
        """Every rank, together: shard the full (single-process format) state like the parameters."""
        params = self.trainable()
        if len(state["param_groups"][0]["params"]) != len(params):
            raise ValueError(f"optimizer.pt holds {len(state['param_groups'][0]['params'])} parameters, "
                             f"the model has {len(params)}")
        sharded = {}
        for i in sorted(state["state"]):
            p = params[i]
            entry = {}
            for k, v in state["state"][i].items():
                if isinstance(p, DTensor) and v.shape == p.shape:
                    v = distribute_tensor(v.to(p.device, p.dtype), p.device_mesh, p.placements)
                entry[k] = v
            sharded[i] = entry
        load_optimizer_keeping_options(self.opt, {"state": sharded, "param_groups": state["param_groups"]})
        self._step_one_by_one()


def start(topo, topology_path: str | Path, model_path: str | Path, publisher=None,
          base_model=None) -> ParallelTrainEngine:
    """Rank 0 (the trainer node): check the layout against the model, start ranks 1..N-1, and build
    this rank's engine. ``model_path``: where the ranks start (model.path or a checkpoint); with LoRA
    the weights are ``base_model``'s (default model.path from the cwd) and a checkpoint the adapter."""
    if topo.parallelism.tp > 1:  # (with LoRA a checkpoint has no config.json; LoRA refuses tp > 1)
        check_tp(AutoConfig.from_pretrained(model_path, local_files_only=True), topo.parallelism.tp,
                 f"model.path {model_path}")
    group = RankGroup.launch(topo.train_workers, str(topology_path), str(model_path), backend_for(topo.trainer_device))
    return ParallelTrainEngine(topo, model_path, group=group, publisher=publisher, base_model=base_model)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="a trainer rank > 0 (started by the trainer node)")
    p.add_argument("--topology", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--backend", default="gloo")
    args = p.parse_args(argv)
    threading.Thread(target=watch_parent, args=(os.getppid(),), daemon=True).start()
    topo = load_topology(args.topology)
    torch.set_num_threads(topo.model.threads)
    group = RankGroup(args.rank, args.world, args.init, args.backend)
    try:
        engine = ParallelTrainEngine(topo, args.model, group=group)
        while True:
            cmd, data = group.receive_command()
            if cmd == CMD_STOP:
                break
            if cmd == CMD_TRAIN:
                engine.update(data)
            elif cmd == CMD_WEIGHTS:
                engine.state_dict()
            elif cmd == CMD_OPTIMIZER:
                engine.optimizer_state()
            elif cmd == CMD_LOAD_OPTIMIZER:
                engine.load_optimizer(args.model)
            elif cmd == CMD_PUBLISH:
                engine.publish_gather()
            else:
                raise RuntimeError(f"unknown command {cmd} from rank 0")
    finally:
        group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
