"""The rollout engine a topology names, built with its weight transport: what a rollout worker drives.

``make_engine(topo, worker, replica, base)`` returns a ``BuiltRolloutEngine``: the engine (the
``RolloutEngine`` interface of ``engines.base``) and ``release_upto``, which lets go of the weight
buffers the engine no longer reads. The worker calls both the same way whatever the engine's kind,
so the choice of engine (sim, torch, vLLM) and of weight transport (shared memory, CUDA IPC, and on a
host without shared memory with the trainer the weight set its relay receives) is made here and
nowhere else.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from areal_bus.engines.base import RolloutEngine
from areal_bus.engines.sim import SimRolloutEngine
from areal_bus.config import placement


class WeightsUnavailable(RuntimeError):
    """The weights of an announced version cannot be opened (their buffer is gone with a trainer that
    crashed, or already holds another version). Not the worker's fault: it keeps serving the weights it
    has and swaps at the next announcement."""


class WeightsNotYetHere(WeightsUnavailable):
    """On a host without shared memory with the trainer: the announced version has not reached this
    host's weight relay yet (it restarted, or the announcement overtook the relay's ack). Unlike
    WeightsUnavailable it is tried again at the broadcaster's next repeat of the announcement."""

    retry = True


class BuiltRolloutEngine(NamedTuple):
    engine: RolloutEngine
    """Generates: continuous batching, every token tagged with the version that produced it."""
    release_upto: Callable[[int], None]
    """``release_upto(version)``: the engine has copied the weights of ``version`` into its own
    parameters, so the buffers of it and of every older version may go back to the broadcaster."""


def _keeps_nothing(version: int) -> None:
    """For engines that hold no transport buffer after a swap (simulated weights; vLLM, whose worker
    copies each version into its parameters and lets the buffer go itself)."""


def make_engine(topo, worker: str, replica: int, base=None, log=None) -> BuiltRolloutEngine:
    """The engine ``topo.rollout_engine`` configures for rollout replica ``replica`` (node id ``worker``).
    Raises FileNotFoundError for a torch engine whose model.path holds no checkpoint, and ImportError
    (naming the extra to install) for vLLM where it is not installed."""
    cfg = topo.rollout_engine
    if cfg.kind == "sim":
        # Simulated tokens stay inside the run's model vocabulary where there is one (a gateway serves
        # them through its tokenizer, and the gateway and trainer refuse ids past it).
        from areal_bus.trajectory_check import model_vocab_size

        vocab = model_vocab_size(topo.model_path(base))
        engine = SimRolloutEngine(cfg, worker) if vocab is None else SimRolloutEngine(cfg, worker, vocab_size=vocab)
        return BuiltRolloutEngine(engine, _keeps_nothing)
    if cfg.kind == "vllm":
        # lazy: vLLM (and CUDA) load only in a worker that runs them; sim workers stay light
        from areal_bus.engines.vllm_engine import engine_from_topology

        return BuiltRolloutEngine(engine_from_topology(topo, worker, replica, base), _keeps_nothing)
    return _torch_engine(topo, worker, replica, base, log)


def relay_weight_set(topo, base=None) -> str:
    """The weight set a host's relay writes the versions it receives into (on a far host)."""
    return f"{topo.shm_name(base)}-relay"


def _far_loader(topo, base, replica: int, log):
    """The weight loader of a rollout worker on a host without shared memory with the trainer, or None
    on the trainer's host. The announcement names the trainer's buffer; here the version is looked up
    in this host's relayed weight set (areal_bus/config/placement.py, nodes/weights.py), and the sha256 of
    what is served is logged (``weights_received``), to compare with the broadcaster's."""
    # lazy: shared-memory weights import torch, which a sim worker never loads
    from areal_bus.weights.shm import ShmWeightReader, WeightShmError, parse_location

    if placement.host_of(topo, "rollout", replica) not in placement.far_rollout_hosts(topo):
        return None
    reader = ShmWeightReader(relay_weight_set(topo, base))

    def load(location: str):
        _, _, version = parse_location(location)
        try:
            local = reader.locate(version)
            if local is None:
                raise WeightsNotYetHere(f"{location}: version {version} is not on this host yet (its relay "
                                        f"{reader.name} has not received it)")
            state = reader.open(local)
            digest = reader.digest(local)
        except (OSError, WeightShmError) as exc:
            raise WeightsNotYetHere(f"{location}: {exc}") from exc
        if log is not None:
            log.info("weights_received", version=version, local=local, sha256=digest)
        return state

    return reader, load


def _torch_engine(topo, worker: str, replica: int, base, log=None) -> BuiltRolloutEngine:
    # lazy: the torch engine and its weight readers import torch, which a sim worker never loads
    from areal_bus.engines.torch_engine import TorchRolloutEngine
    from areal_bus.model import shared_base
    from areal_bus.model.adapters import rollout_model
    from areal_bus.model.memory import check_at_start
    from areal_bus.model.modeling import ModelConfig, as_dtype, param_shapes
    from areal_bus.weights.shm import ShmWeightReader, WeightShmError

    cfg = topo.rollout_engine
    path = topo.model_path(base)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model.path {path} holds no checkpoint (config.json); build the default with "
                                f"`python scripts/warmstart.py --out {topo.model.path}` or point model.path at one")
    import torch

    torch.set_num_threads(topo.model.threads)
    reader = ShmWeightReader(topo.shm_name(base))
    cuda_reader = None  # (mtime of the handles file, CudaWeightReader), opened on the first "cuda:" location

    def load_weights(location: str):
        try:
            return _open(location)
        except (OSError, WeightShmError) as exc:  # the writer's buffers (or handles file) are gone or reused
            raise WeightsUnavailable(f"{location}: {exc}") from exc

    def _open(location: str):
        # "cuda:..." when the trainer's writer is on a GPU (CUDA IPC, handles opened once), else shared memory.
        nonlocal cuda_reader
        if not location.startswith("cuda:"):
            return reader.open(location)
        # lazy: CUDA IPC only when the trainer's writer is on a GPU
        from areal_bus.weights.cuda import CudaWeightReader, handles_path, load_handles

        handles = handles_path(topo.ipc_dir(base), topo.shm_name(base))
        stamp = handles.stat().st_mtime_ns
        if cuda_reader is None or cuda_reader[0] != stamp:  # a restarted trainer exports new buffers
            # On another GPU than the trainer's, each version is copied into this one (peer access): logged.
            copied = None if log is None else (lambda **kw: log.info("weights_copied", **kw))
            own = topo.model.device if topo.model.device.startswith("cuda") else None
            cuda_reader = (stamp, CudaWeightReader(load_handles(handles), own, on_copy=copied))
        return cuda_reader[1].open(location)

    far = _far_loader(topo, base, replica, log)
    if far is not None:  # a host without shared memory with the trainer: its relay's weight set
        reader, load_weights = far
    fallback = None if log is None else (lambda msg: log.warning("decode_fallback", detail=msg))
    # The plan against this card before anything is allocated: a clear refusal, not an OOM mid-run.
    check_at_start(topo, f"rollout-{replica}", topo.model.device, base, log)
    # With trainer_engine.lora the base is model.path's and every version an adapter (model/adapters.py);
    # with model.share_base it is the trainer's own copy, mapped (model/shared_base.py).
    base_views = None
    if far is None and shared_base.shares(topo, replica):
        shapes = param_shapes(ModelConfig.from_hf(path))
        base_views = shared_base.open_base(topo.shm_name(base), shared_base.identity(path, topo.model.dtype), shapes,
                                           as_dtype(topo.model.dtype), topo.model.device, topo.ipc_dir(base), log=log)
    model = rollout_model(path, topo.trainer_engine.lora, topo.model.device, topo.model.dtype, base=base_views)
    engine = TorchRolloutEngine(model, max_batch=cfg.max_batch, max_len=cfg.max_len, device=topo.model.device,
                                dtype=topo.model.dtype, seed=topo.model.seed * 1000 + replica, worker=worker,
                                weight_loader=load_weights, attention=cfg.decode_attention,
                                fuse_decode=cfg.decode_compile, warn=fallback, kv_tokens=cfg.kv_tokens,
                                kv_page_tokens=cfg.kv_page_tokens)
    if engine.fast is not None and log is not None:
        log.info("decode_step", attention=engine.fast.attention, compile=engine.fast.fuse, graphs=engine.fast.graphs)
    if log is not None:
        held, mapped = shared_base.held_bytes(engine.model, base_views, engine.fast)
        log.info("weights_memory", held_bytes=held, mapped_bytes=mapped, kv_cache_bytes=getattr(getattr(engine, "cache", None), "nbytes", None),
                 device=topo.model.device)

    def release_upto(version: int) -> None:
        # The engine copies weights into its own parameters at the swap: older buffers are free now.
        for held in reader.held:
            if held <= version:
                reader.release(held)

    return BuiltRolloutEngine(engine, release_upto)
