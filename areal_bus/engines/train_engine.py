"""The trainer's engine: the one interface the trainer node drives, and the factory that builds it.

The node never asks which engine it holds. ``build_train_engine`` picks, from the topology, the
simulated engine (``sim``), the single-process torch engine, or the parallel torch engine (dp x tp
ranks, this process rank 0), resumed from a checkpoint folder when one is given, and wires the torch
engines to the weight buffers the rollout workers read (CUDA IPC on a GPU, shared memory on CPU).

    engine = build_train_engine(topo, base, checkpoint=start.folder)
    stats = engine.train(batch, version)              # one update: version -> version + 1
    location, nbytes = engine.export_weights(version + 1)   # WeightsBusy: retry once readers let go
    engine.release(committed_version)                 # every rollout worker has left it
    engine.save_checkpoint(folder, version, consumed)
    engine.close()
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from areal_bus.wire.messages import Trajectory
from areal_bus.engines.sim import SimTrainEngine
from areal_bus.config.topology import dump_resolved


class WeightsBusy(RuntimeError):
    """``export_weights`` could not write: every weight buffer still holds a version some rollout
    worker reads. Nothing was written; retry once a ``release`` has freed one (the trainer keeps
    serving the hub meanwhile, which is where the releases come from)."""


class TrainEngine(Protocol):
    vocab_size: int | None
    """Rows of the model's embedding: a token id must be below it (None: any id, a simulated engine)."""

    def train(self, batch: list[Trajectory], version: int, baseline: Sequence[tuple[str, float]] = ()) -> dict:
        """One policy update on ``batch``, from the weights of ``version`` to those of ``version + 1``.
        ``baseline``: (group_id, reward) of members of the batch's GRPO groups that are not in it (dropped
        as over-stale, or trained in an earlier batch that took the group in part): they count in their
        group's advantage baseline and spread, never in the loss.
        Returns stats (``loss``, ``reward``, ``tokens`` and whatever else the engine measures)."""

    def export_weights(self, version: int) -> tuple[str, int]:
        """Make the current weights (with LoRA the adapter alone) readable as ``version``: (location for
        WeightsReady, bytes).
        Raises WeightsBusy (nothing written) while no buffer is free."""

    def release(self, version: int) -> None:
        """No rollout worker reads ``version`` any more: its buffer may be written again."""

    def save_checkpoint(self, folder: Path, version: int, consumed: list[str]) -> Path:
        """A complete checkpoint of ``version`` in ``folder`` (written whole or not at all) holding what
        resuming needs: the weights (with LoRA the adapter, and which base it belongs to), the optimizer
        state and ``trainer_state.json`` (version, consumed ids)."""

    def load_optimizer(self, folder: Path) -> None:
        """Restore the optimizer state of the checkpoint in ``folder`` (the weights were loaded when the
        engine was built from it). ``build_train_engine(checkpoint=...)`` calls it."""

    def evaluate(self, version: int) -> dict | None:
        """Held-out evaluation of the current weights (greedy games) as stats, or None when the run has
        no evaluation (``trainer_engine.eval_interval`` 0, or an engine without one)."""

    def close(self, in_flight: bool = False) -> None:
        """End of the run: the weight buffers go (rollout workers copied what they serve), and the other
        ranks of a parallel engine are told to stop. ``in_flight``: an update or save may still run on
        another thread; the ranks are then left to be stopped with the process group (a stop command
        now would interleave with that update's collectives)."""


class WeightPublisher:
    """Where a torch engine writes each version for the rollout workers: made on the first write, as the
    weights' layout is known only then. On a GPU, CUDA IPC (device to device; the handles go to the
    rollout workers once, as a file beside the ipc sockets, and each version is an in-place copy); on
    CPU, shared memory."""

    def __init__(self, topo, base=None):
        self.topo = topo
        self.base = base
        self.writer = None

    def publish(self, state_dict, version: int) -> tuple[str, int]:
        # lazy: torch, which this module's sim engine never needs
        from areal_bus.weights.shm import BufferBusy

        self._make_writer(state_dict, next(iter(state_dict.values())).device)
        try:
            location = self.writer.write(state_dict, version)
        except BufferBusy as exc:
            raise WeightsBusy(str(exc)) from exc
        return location, self.writer.nbytes

    def publish_into(self, template, version: int, fill, device) -> tuple[str, int]:
        """``publish`` for weights that are never whole in one place (a sharded trainer): claim the free
        buffer (WeightsBusy, before ``fill`` runs, while none is free), ``fill(views)`` it in place, commit.
        ``template``: the published tensors' names, shapes and dtypes (meta tensors); ``device``: where
        the trainer's tensors are (a CUDA writer's buffers go there)."""
        # lazy: torch, as above
        from areal_bus.weights.shm import BufferBusy

        self._make_writer(template, device)
        try:
            views = self.writer.begin_views(version)
        except BufferBusy as exc:
            raise WeightsBusy(str(exc)) from exc
        try:
            fill(views)
        except BaseException:
            self.writer.abort()
            raise
        return self.writer.commit(version), self.writer.nbytes

    def _make_writer(self, template, device) -> None:
        if self.writer is not None:
            return
        if self.topo.trainer_device.startswith("cuda"):
            # lazy: CUDA IPC only for a trainer on a GPU
            from areal_bus.weights.cuda import CudaWeightWriter, handles_path, save_handles

            self.writer = CudaWeightWriter(self.topo.shm_name(self.base), template, device=device)
            save_handles(handles_path(self.topo.ipc_dir(self.base), self.writer.name), self.writer.handles())
        else:
            # lazy: torch, as above
            from areal_bus.weights.shm import ShmWeightWriter

            self.writer = ShmWeightWriter(self.topo.shm_name(self.base), template)

    def release(self, version: int) -> None:
        if self.writer is not None:
            self.writer.mark_released(version)

    def close(self) -> None:
        # A crash leaves the buffers; the next writer of the same name replaces them. CUDA IPC memory
        # goes with the process.
        if self.writer is not None and hasattr(self.writer, "close"):
            self.writer.close()


def build_train_engine(topo, base=None, checkpoint: Path | None = None) -> TrainEngine:
    """The engine ``topo.trainer_engine.kind`` names, started from ``checkpoint`` (weights and optimizer)
    when given, else from ``model.path``."""
    if topo.trainer_engine.kind == "sim":
        return SimTrainEngine(topo.trainer_engine, topo.train_workers)
    # lazy: torch and the torch engine load only in a trainer that trains with them (not in a sim run)
    import torch

    from areal_bus.engines.torch_train import TorchTrainEngine

    path = Path(checkpoint) if checkpoint is not None else topo.model_path(base)
    lora = topo.trainer_engine.lora  # LoRA: a checkpoint holds the adapter, the weights are model.path's
    weights = topo.model_path(base) if lora is not None else path
    if checkpoint is not None:  # before any rank starts: another base, or the other kind of run's checkpoint
        from areal_bus.train.lora import check_start  # lazy: as the torch engine above

        check_start(path, lora, topo.model_path(base))
    if not (weights / "config.json").exists():
        raise FileNotFoundError(f"model.path {weights} holds no checkpoint (config.json); build the default with "
                                f"`python scripts/warmstart.py --out {topo.model.path}` or point model.path at one")
    torch.set_num_threads(topo.model.threads)
    publisher = WeightPublisher(topo, base)
    if topo.train_workers > 1:  # parallelism dp x tp ranks (FSDP2, DTensor); this process is rank 0
        from areal_bus.engines import torch_parallel  # lazy: FSDP2/DTensor only for a parallel layout

        # The other ranks read the resolved topology dumped here (JSON is YAML).
        resolved = topo.log_dir(base) / "resolved" / "trainer-dp.json"
        resolved.parent.mkdir(parents=True, exist_ok=True)
        resolved.write_text(json.dumps(dump_resolved(topo)))
        engine = torch_parallel.start(topo, resolved, path, publisher=publisher, base_model=topo.model_path(base))
    else:
        engine = TorchTrainEngine(topo, path, publisher=publisher, base_model=topo.model_path(base))
    if checkpoint is not None:
        engine.load_optimizer(path)
    return engine
