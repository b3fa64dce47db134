"""Weights from a sharded trainer: with dp=2 (FSDP2) or tp=2 (DTensor) over gloo, a published version is
gathered a bucket at a time straight into the publish buffer, and the segment rollout reads holds the
tensors a single process publishes: bitwise before any update (the same init), bitwise the sharded
trainer's own full weights after one, and within the parity tests' tolerance of the single process's
update (FSDP2 sums the ranks' gradients in another order: tests/test_parallel.py). LoRA publishes the
adapters alone, as one process does. The CUDA IPC reader's copy path (another GPU, or ``copy=True`` on
the writer's) runs on a CUDA host only (``gpu`` marker).

Run:  .venv/bin/python -m pytest tests/test_sharded_publish.py -q
"""

from __future__ import annotations

import json
import multiprocessing as mp
import weakref

import pytest
import torch

from areal_bus.config.topology import dump_resolved
from areal_bus.engines import torch_parallel
from areal_bus.engines.torch_train import TorchTrainEngine
from areal_bus.engines.train_engine import WeightPublisher, WeightsBusy
from areal_bus.model.modeling import TINY_QWEN2, make_random_model, save_pretrained
from areal_bus.train.train_model import export_state_dict
from areal_bus.weights.cuda import CudaWeightReader, CudaWeightWriter, handles_path, load_handles
from areal_bus.weights.layout import BufferBusy, MappedSegment, parse_location, segment_path
from areal_bus.weights.shm import ShmWeightReader, ShmWeightWriter
from tests.test_torch_train import _episodes, _topo
from tests.torch_threads import one_torch_thread

LORA = {"rank": 4, "alpha": 8}
ATOL = 1e-4  # tests/test_parallel.py's WEIGHT_ATOL: one AdamW step on sharded sums vs one process
SMALL_BUCKET = 4096  # bytes: the tiny model's tensors (up to 16 KB) then make many buckets, some of one tensor

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "model"
    save_pretrained(make_random_model(TINY_QWEN2, seed=0, std=0.2), path)
    return path


@pytest.fixture(scope="module")
def trajs(model_dir):
    with one_torch_thread():
        return _episodes(model_dir, n=8, group=4)[:5]


def _read(topo, base, location: str) -> tuple[bytes, dict[str, torch.Tensor]]:
    """(manifest, tensors) of a published version, read as a rollout worker reads it."""
    reader = ShmWeightReader(topo.shm_name(base))
    try:
        tensors = {n: v.clone() for n, v in reader.open(location).items()}
    finally:
        reader.close()
    name, k, _ = parse_location(location)
    seg = MappedSegment(segment_path(name, k), writable=False)
    manifest = seg.layout.manifest
    seg.close()
    return manifest, tensors


def _publish_run(model_dir, base, trajs, lora=False, dtype="float32", **layout) -> dict:
    """Publish version 1 (the initial weights), train once, publish version 2; in one process when
    ``layout`` is empty, else on dp x tp gloo ranks (this process rank 0, as the trainer node)."""
    ranks = layout.get("dp", 1) * layout.get("tp", 1)
    engine_cfg = {"kind": "torch", "grad_clip": 0.05, **({"lora": LORA} if lora else {})}
    topo = _topo(model_dir, mini_batch_size=2, trainer_engine=engine_cfg,
                 model={"path": str(model_dir), "dtype": dtype},
                 **({"train_workers": ranks, "parallelism": {"tp": layout.get("tp", 1)}} if layout else {}))
    base.mkdir(parents=True, exist_ok=True)
    publisher = WeightPublisher(topo, base)
    out = {}
    with one_torch_thread():
        if not layout:
            engine = TorchTrainEngine(topo, model_dir, publisher=publisher, base_model=model_dir)
        else:
            resolved = base / "topo.json"
            resolved.write_text(json.dumps(dump_resolved(topo)))
            engine = torch_parallel.start(topo, resolved, model_dir, publisher=publisher, base_model=model_dir)
        try:
            loc1, nbytes = engine.export_weights(1)
            out["v1"] = _read(topo, base, loc1)
            engine.train(trajs, version=0)
            loc2, _ = engine.export_weights(2)
            out["v2"] = _read(topo, base, loc2)
            out["nbytes"] = nbytes
            # What the engine's existing full gather (checkpoints, evaluation) makes of the same weights.
            out["served"] = {k: v.clone() for k, v in engine.served().items()}
            if layout:
                # Both buffers hold unreleased versions: the next export is refused before any rank gathers,
                # and the ranks are still in step after it (the export that follows a release works).
                with pytest.raises(WeightsBusy):
                    engine.export_weights(3)
                engine.release(1)
                out["v3"] = _read(topo, base, engine.export_weights(3)[0])
                out["buckets"] = _record_buckets(engine)
        finally:
            engine.close()
    return out


def _record_buckets(engine) -> list[dict]:
    """One publish gather on every rank with a small bucket on rank 0, each bucket as the sink saw it:
    its gathered bytes, its tensors (copied out), and whether the previous bucket's were all freed."""
    seen: list[dict] = []
    alive: list[weakref.ref] = []

    def sink(bucket):
        freed = all(r() is None for r in alive)
        alive.clear()
        alive.extend(weakref.ref(t) for _, t in bucket)
        sharded = {n for n, t in torch_parallel.served_params(engine.model, engine.lora is not None)
                   if isinstance(t, torch_parallel.DTensor)}
        seen.append({"gathered": sum(t.numel() * t.element_size() for n, t in bucket if n in sharded),
                     "tensors": {n: t.clone() for n, t in bucket}, "previous_freed": freed})

    engine.group.request(torch_parallel.CMD_PUBLISH)
    engine.publish_gather(sink, bucket_bytes=SMALL_BUCKET)
    return seen


def _equal(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ in any bit (dtype, shape or value), or that only one side has."""
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]


@pytest.fixture(scope="module")
def single(model_dir, trajs, tmp_path_factory):
    return _publish_run(model_dir, tmp_path_factory.mktemp("single"), trajs)


@pytest.fixture(scope="module")
def dp2(model_dir, trajs, tmp_path_factory):
    return _publish_run(model_dir, tmp_path_factory.mktemp("dp2"), trajs, dp=2)


@pytest.mark.timeout(120)
def test_dp2_publishes_bitwise_the_single_process_version_of_the_same_weights(single, dp2):
    (s_manifest, s1), (p_manifest, p1) = single["v1"], dp2["v1"]
    assert p_manifest == s_manifest  # the same names, order, dtypes, shapes and offsets
    assert dp2["nbytes"] == single["nbytes"]
    assert _equal(p1, s1) == []


@pytest.mark.timeout(120)
def test_dp2_publishes_after_an_update_bitwise_its_own_full_weights_and_close_to_one_process(single, dp2):
    p2, s2 = dp2["v2"][1], single["v2"][1]
    assert _equal(p2, dp2["served"]) == []  # the bucketed gather == the whole gather, bit for bit
    assert _equal(single["served"], s2) == []
    moved = [k for k in p2 if not torch.equal(p2[k], dp2["v1"][1][k])]
    assert moved  # the update reached the published version
    for k, w in s2.items():
        assert torch.allclose(p2[k], w, atol=ATOL), (k, float((p2[k] - w).abs().max()))


@pytest.mark.timeout(120)
def test_a_busy_buffer_refuses_the_export_before_any_rank_gathers(dp2):
    assert _equal(dp2["v3"][1], dp2["v2"][1]) == []  # the refused export left every rank in step


@pytest.mark.timeout(120)
def test_the_publish_gather_holds_one_bucket_at_a_time(dp2):
    buckets = dp2["buckets"]
    largest = max(t.numel() * t.element_size() for b in buckets for t in b["tensors"].values())
    assert largest > SMALL_BUCKET  # some tensor is larger than a bucket: it is a bucket of its own
    assert len(buckets) > 3
    assert max(b["gathered"] for b in buckets) <= max(SMALL_BUCKET, largest)
    assert all(b["gathered"] <= SMALL_BUCKET or len(b["tensors"]) == 1 for b in buckets)
    assert all(b["previous_freed"] for b in buckets)  # nothing of the last bucket survives into the next
    got = {k: v for b in buckets for k, v in b["tensors"].items()}
    assert _equal(got, dp2["served"]) == []  # every served tensor, once


@pytest.mark.timeout(120)
def test_tp2_publishes_bitwise_the_single_process_version_of_the_same_weights(model_dir, trajs, tmp_path, single):
    tp2 = _publish_run(model_dir, tmp_path, trajs, tp=2)
    assert tp2["v1"][0] == single["v1"][0]
    assert _equal(tp2["v1"][1], single["v1"][1]) == []
    assert _equal(tp2["v2"][1], tp2["served"]) == []
    for k, w in single["v2"][1].items():
        assert torch.allclose(tp2["v2"][1][k], w, atol=ATOL), k


@pytest.mark.timeout(120)
def test_dp2_in_bfloat16_casts_each_shard_before_the_gather_bitwise_as_one_process_casts(model_dir, trajs,
                                                                                       tmp_path):
    one = _publish_run(model_dir, tmp_path / "one", trajs, dtype="bfloat16")
    two = _publish_run(model_dir, tmp_path / "two", trajs, dtype="bfloat16", dp=2)
    assert two["v1"][0] == one["v1"][0]
    assert all(t.dtype == torch.bfloat16 for t in two["v1"][1].values())
    assert _equal(two["v1"][1], one["v1"][1]) == []
    assert _equal(two["v2"][1], two["served"]) == []


@pytest.mark.timeout(120)
def test_lora_on_dp2_publishes_the_adapters_alone_as_one_process_does(model_dir, trajs, tmp_path):
    one = _publish_run(model_dir, tmp_path / "one", trajs, lora=True)
    two = _publish_run(model_dir, tmp_path / "two", trajs, lora=True, dp=2)
    assert two["v1"][0] == one["v1"][0]
    assert all(".lora_A." in k or ".lora_B." in k for k in two["v1"][1])
    assert _equal(two["v1"][1], one["v1"][1]) == []
    assert _equal(two["v2"][1], two["served"]) == []
    for k, w in one["v2"][1].items():
        assert torch.allclose(two["v2"][1][k], w, atol=ATOL), k


# -- the writers' in-place (bucketed) write ---------------------------------------------------------


def _template():
    return {"a": torch.empty(7, 5, device="meta"), "b": torch.empty(3, dtype=torch.bfloat16, device="meta")}


def test_a_cuda_writer_filled_in_place_commits_and_an_aborted_fill_frees_its_buffer():
    w = CudaWeightWriter("t", _template(), device="cpu")
    views = w.begin_views(1)
    views["a"].fill_(1.5)
    views["b"].fill_(2)
    assert w.commit(1) == "cuda:t.0@1"
    w.begin_views(2)["a"].fill_(9)
    w.abort()  # a gather that failed: buffer 1 holds nothing valid, and may be claimed again
    assert w.write({"a": torch.full((7, 5), 3.0), "b": torch.zeros(3, dtype=torch.bfloat16)}, 2) == "cuda:t.1@2"
    with pytest.raises(BufferBusy):  # buffer 0 still holds version 1: claimed by nobody until released
        w.begin_views(3)
    assert torch.equal(w.views(0)["a"], torch.full((7, 5), 1.5))


def test_a_shared_memory_writer_filled_in_place_is_read_whole():
    name = f"sharded-publish-test-{id(object())}"
    with ShmWeightWriter(name, _template()) as w:
        views = w.begin_views(1)
        views["a"].copy_(torch.arange(35.0).view(7, 5))
        views["b"].fill_(-1)
        location = w.commit(1)
        reader = ShmWeightReader(name)
        try:
            got = reader.open(location)
            assert torch.equal(got["a"], torch.arange(35.0).view(7, 5))
            assert torch.equal(got["b"], torch.full((3,), -1, dtype=torch.bfloat16))
        finally:
            reader.close()


# -- CUDA IPC: a reader that copies each version into its own GPU (CUDA host only) -------------------


def _copying_reader(handles: dict, device: int, copy: bool, locations: list[str], out) -> None:
    received = []
    reader = CudaWeightReader(handles, device, copy=copy,
                              on_copy=lambda **kw: received.append((kw["version"], kw["nbytes"], kw["seconds"])))
    sums = []
    for loc in locations:
        views = reader.open(loc)
        assert all(v.device == torch.device("cuda", device) for v in views.values())
        sums.append({k: v.float().sum().item() for k, v in views.items()})
    reader.drain()
    out.put({"peer": reader.peer, "copies": reader.copies, "sums": sums, "received": received})


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(180)
def test_cuda_readers_that_copy_get_each_version_whole_with_bytes_and_time_per_version():
    """Two readers of one writer: one copying into the writer's own GPU (``copy=True``: what one GPU can
    run), and, on a host of two or more GPUs, one on cuda:1 (peer access)."""
    dev = torch.device("cuda", 0)
    state = [{"w": torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16) * i,
              "b": torch.full((77,), float(i), device=dev)} for i in (1, 2)]
    w = CudaWeightWriter("t", {k: v.to("meta") for k, v in state[0].items()}, device=dev)
    locs = [w.write(state[0], 1), w.write(state[1], 2)]
    readers = [(0, True)] + ([(1, False)] if torch.cuda.device_count() > 1 else [])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_copying_reader, args=(w.handles(), d, c, locs, out)) for d, c in readers]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    want = [{k: v.float().sum().item() for k, v in s.items()} for s in state]
    for r in results:
        assert r["copies"] and r["sums"] == want
        assert [v for v, *_ in r["received"]] == [1, 2] and all(n == w.nbytes for _, n, _ in r["received"])
        print(f"reader peer={r['peer']}: per version " + ", ".join(
            f"v{v} {n / 1e6:.1f} MB in {s * 1e3:.3f} ms" for v, n, s in r["received"]))
    assert sorted(r["peer"] for r in results) == ([False, True] if len(readers) > 1 else [False])


def _tensors_reader(handles: dict, device: int, locations: list[str], out) -> None:
    reader = CudaWeightReader(handles, device)
    got = [{k: v.cpu() for k, v in reader.open(loc).items()} for loc in locations]
    out.put({"peer": reader.peer, "tensors": got, "received": reader.received})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.timeout(300)
def test_dp2_on_two_gpus_publishes_over_cuda_ipc_to_a_reader_on_the_other_gpu(model_dir, trajs, tmp_path):
    """FSDP2 over NCCL on cuda:0 and cuda:1: rank 0 gathers each version into its CUDA IPC buffer, and a
    reader on cuda:1 copies it into its own GPU (peer access), bitwise what the trainer serves."""
    topo = _topo(model_dir, mini_batch_size=2, trainer_engine={"kind": "torch"}, train_workers=2,
                 model={"path": str(model_dir), "dtype": "bfloat16", "device": "cuda"})
    resolved = tmp_path / "topo.json"
    resolved.write_text(json.dumps(dump_resolved(topo)))
    engine = torch_parallel.start(topo, resolved, model_dir, publisher=WeightPublisher(topo, tmp_path))
    try:
        served = []
        loc1, _ = engine.export_weights(1)
        served.append({k: v.cpu() for k, v in engine.served().items()})
        engine.train(trajs, version=0)
        loc2, _ = engine.export_weights(2)
        served.append({k: v.cpu() for k, v in engine.served().items()})
        handles = load_handles(handles_path(topo.ipc_dir(tmp_path), topo.shm_name(tmp_path)))
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        p = ctx.Process(target=_tensors_reader, args=(handles, 1, [loc1, loc2], out))
        p.start()
        try:
            got = out.get(timeout=120)
        finally:
            p.join(30)
            if p.is_alive():
                p.kill()
    finally:
        engine.close()
    assert got["peer"] and got["received"][0] == 2
    assert _equal(got["tensors"][0], served[0]) == [] and _equal(got["tensors"][1], served[1]) == []
