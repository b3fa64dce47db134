"""CUDA IPC weight handoff: 1.5B bf16 parameters (about 3.1 GB) from the trainer to 4 rollout processes,
beside a plain device-to-device copy of the same bytes in the same run; by default all on one GPU.

The trainer's weights are a Qwen2-1.5B-shaped state dict (28 layers, hidden 1536, tied 151936-token
embedding: 338 tensors, 1.54B parameters), slices of one flat random bf16 buffer. The trainer process
owns a ``CudaWeightWriter``; reader processes (spawn) each open its two buffers once from the plain
handle dict (``CudaWeightReader``; the open time is reported) and keep a gather index of every
tensor's first element. One round of each mode:

  handoff  from the trainer calling ``write`` (338 in-place device copies into the free buffer, waited
           for) through a VersionAnnounce to each reader, each reader flipping its model to the new
           buffer's views (``open``), reading the first element of every tensor (one gather; each must
           equal this version's marker) and one small matmul, ``drain()``, then a VersionAck, to the
           last reader's ack. Then ``mark_released`` of the previous version.
  d2d      ``dst.copy_(flat)``: the same bytes, one device-to-device copy, synchronized.

Readers on other GPUs (``--reader-gpus 1,2,3``: reader i on the i-th listed GPU, round robin) open the
handles on their own GPU and copy each version into it (peer access over NVLink or PCIe), as rollout
workers beside a trainer on one GPU each do; ``--copy`` makes readers on the writer's GPU copy too (the
copy path on one GPU). Each reader reports the bytes and time of every copy; the table gives each
receiver's median per version.

Control messages travel on multiprocessing Pipes as plain dicts of the areal_bus message fields: this
benchmark needs only torch and the standard library on the GPU host (no pyzmq there). Two warm-up
versions first, then --rounds rounds with the two modes' order alternating; medians are reported.

Run:  python3 bench/weights_cuda.py                      (on a CUDA host; ~40 s, ~13 GB of GPU memory)
      python3 bench/weights_cuda.py --layers 4 --readers 2 --rounds 3
      python3 bench/weights_cuda.py --readers 2 --copy       (two receivers copying on one GPU, +6 GB)
      python3 bench/weights_cuda.py --readers 7 --reader-gpus 1,2,3,4,5,6,7   (8 GPUs: one per receiver)

The last line is ``RESULT cuda_handoff_ms=... d2d_copy_ms=... readers=4 gb=...``; target <= 10 ms.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import torch  # noqa: E402

from areal_bus.wire import messages as m  # noqa: E402
from areal_bus.model.modeling import param_shapes  # noqa: E402
from areal_bus.weights.cuda import CudaWeightReader, CudaWeightWriter  # noqa: E402

QWEN2_15B = dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)  # Qwen2-1.5B
ACK_TIMEOUT_S = 120.0  # a reader silent this long is dead or stuck (its first open includes CUDA init)
STOP = -1


def qwen15_shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    return param_shapes(dict(QWEN2_15B, num_hidden_layers=layers))


def marker(version: int) -> float:
    return float(version % 200)  # integers up to 256 are exact in bf16


# ---------------------------------------------------------------------------------------------
# Reader (rollout worker) process
# ---------------------------------------------------------------------------------------------


def reader_main(idx: int, conn, handles: dict, gpu: int, copy: bool) -> None:
    node_id = f"rollout-{idx}"
    torch.cuda.set_device(gpu)
    t0 = time.perf_counter()
    reader = CudaWeightReader(handles, gpu, copy=copy)
    open_s = time.perf_counter() - t0
    # Element index of each tensor's first element in a bf16 view of a whole buffer (offsets are 64-aligned).
    first = torch.tensor([s.offset // 2 for s in reader.layout.specs], device=reader.device)
    n = reader.layout.nbytes // 2 * 2
    flat = [b[:n].view(torch.bfloat16) for b in reader.buffers]
    if reader.local is not None:  # every version is copied into this GPU's buffer: check that one
        flat = [reader.local[:n].view(torch.bfloat16)] * 2
    probe = "model.layers.0.self_attn.q_proj.weight"
    x = torch.ones(1, QWEN2_15B["hidden_size"], dtype=torch.bfloat16, device=reader.device)
    conn.send({"tag": "ready", "node_id": node_id, "open_s": open_s, "peer": reader.peer, "copies": reader.copies})
    model: dict[str, torch.Tensor] = {}
    while True:
        ann = m.VersionAnnounce(**conn.recv())
        if ann.version == STOP:
            break
        t0 = time.perf_counter()
        model = reader.open(ann.location)  # the flip: the model now views the other buffer
        k = int(ann.location.split(".")[-1].split("@")[0])
        firsts = flat[k].index_select(0, first)
        y = x @ model[probe].T  # a small piece of real serving work on the new weights
        ok = bool((firsts == marker(ann.version)).all()) and bool(torch.isfinite(y).all())
        reader.drain()  # no queued kernel still reads the buffer left behind
        if not ok:
            conn.send({"tag": "bad", "node_id": node_id, "version": ann.version})
            break
        ack = m.VersionAck(node_id=node_id, version=ann.version, switch_seconds=time.perf_counter() - t0)
        got = reader.received if reader.copies else None  # (version, bytes, seconds) of this version's copy
        conn.send({"tag": "ack", **dataclasses.asdict(ack), "copy_bytes": got[1] if got else 0,
                   "copy_s": got[2] if got else 0.0})
    model.clear()
    reader.close()
    conn.close()


# ---------------------------------------------------------------------------------------------
# Trainer + broadcaster (this process)
# ---------------------------------------------------------------------------------------------


def recv_all(conns, version: int | None = None) -> list[dict]:
    out = []
    for c in conns:
        if not c.poll(ACK_TIMEOUT_S):
            raise RuntimeError(f"a reader was silent for {ACK_TIMEOUT_S} s")
        msg = c.recv()
        if msg["tag"] == "bad" or (version is not None and msg.get("version") != version):
            raise RuntimeError(f"reader answered {msg} to version {version}")
        out.append(msg)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28, help="decoder layers (28: Qwen2-1.5B)")
    ap.add_argument("--readers", type=int, default=4, help="rollout processes on this GPU")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds; medians are reported")
    ap.add_argument("--reader-gpus", default="0", help="GPUs of the readers, comma-separated, round robin "
                    "(the writer is on GPU 0; a reader elsewhere copies each version into its GPU)")
    ap.add_argument("--copy", action="store_true", help="readers on GPU 0 copy each version too")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    gpus = [int(g) for g in args.reader_gpus.split(",")]
    if max(gpus) >= torch.cuda.device_count():
        sys.exit(f"--reader-gpus {args.reader_gpus}: this host has {torch.cuda.device_count()} GPU(s)")
    reader_gpus = [gpus[i % len(gpus)] for i in range(args.readers)]
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)

    shapes = qwen15_shapes(args.layers)
    numels = [math.prod(s) for _, s in shapes]
    numel = sum(numels)
    flat = torch.randn(numel, dtype=torch.bfloat16, device=dev)  # the trainer's weights: random, never zeros
    state, off = {}, 0
    for (name, shape), n in zip(shapes, numels):
        state[name] = flat[off:off + n].view(shape)
        off += n
    firsts = torch.tensor([0] + list(itertools.accumulate(numels))[:-1], device=dev)
    dst = torch.empty_like(flat)
    nbytes = numel * 2

    writer = CudaWeightWriter("policy", {k: v.to("meta") for k, v in state.items()}, device=dev)
    t0 = time.perf_counter()
    handles = writer.handles()
    export_s = time.perf_counter() - t0

    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for i in range(args.readers):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=reader_main, args=(i, child, handles, reader_gpus[i], args.copy), daemon=True)
        p.start()
        conns.append(parent)
        procs.append(p)
    ready = recv_all(conns)
    open_ms = [r["open_s"] * 1e3 for r in ready]

    def announce(version: int, location: str) -> None:
        ann = m.VersionAnnounce(version=version, location=location, nbytes=nbytes, published_at=time.time())
        for c in conns:
            c.send(dataclasses.asdict(ann))

    received: list[list[tuple[int, float]]] = [[] for _ in conns]  # per reader: (bytes, seconds) per version

    def handoff(version: int) -> tuple[float, float, float]:
        flat.index_fill_(0, firsts, marker(version))  # the trainer's step: new weights, new markers
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        location = writer.write(state, version)
        t1 = time.perf_counter()
        announce(version, location)
        acks = recv_all(conns, version)
        t2 = time.perf_counter()
        writer.mark_released(version - 1)  # every reader acked `version`: the older buffer is free
        for mine, a in zip(received, acks):
            mine.append((a["copy_bytes"], a["copy_s"]))
        return (t2 - t0) * 1e3, (t1 - t0) * 1e3, max(a["switch_seconds"] for a in acks) * 1e3

    def d2d() -> float:
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        dst.copy_(flat)
        torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) * 1e3

    version = 0
    for _ in range(2):  # warm-up: both buffers written and read once, kernels loaded
        version += 1
        handoff(version)
        d2d()
    rows = {"handoff": [], "write": [], "switch": [], "d2d": []}
    for mine in received:
        mine.clear()  # the warm-up's copies are not counted
    for r in range(args.rounds):
        for mode in (("handoff", "d2d") if r % 2 == 0 else ("d2d", "handoff")):
            if mode == "d2d":
                rows["d2d"].append(d2d())
            else:
                version += 1
                total, write, switch = handoff(version)
                rows["handoff"].append(total)
                rows["write"].append(write)
                rows["switch"].append(switch)
    announce(STOP, "")
    for p in procs:
        p.join(30)

    med = {k: statistics.median(v) for k, v in rows.items()}
    gb = nbytes / 1e9
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; {len(shapes)} tensors, "
          f"{numel / 1e9:.3f}B params, {gb:.3f} GB; {args.readers} readers; {args.rounds} rounds")
    print(f"handles: export {export_s * 1e3:.2f} ms once; open in each reader (both buffers) "
          f"{statistics.median(open_ms):.2f} ms median, {max(open_ms):.2f} ms max, once")
    print(f"{'mode':<34}{'median ms':>10}{'min ms':>9}{'max ms':>9}")
    labels = {"handoff": "handoff: publish -> last ack", "write": "  of which write (device copy)",
              "switch": "  slowest reader flip+touch+drain", "d2d": "d2d copy of the same bytes"}
    for k, label in labels.items():
        print(f"{label:<34}{med[k]:>10.3f}{min(rows[k]):>9.3f}{max(rows[k]):>9.3f}")
    print(f"bandwidth counting bytes read and written: d2d {2 * nbytes / med['d2d'] / 1e9:.2f} TB/s, "
          f"write {2 * nbytes / med['write'] / 1e9:.2f} TB/s")
    copy_ms = []
    print(f"{'receiver':<12}{'gpu':>4}  {'mode':<6}{'GB/version':>11}{'median ms':>10}{'max ms':>9}{'GB/s':>8}")
    for i, (r, mine) in enumerate(zip(ready, received)):
        mode = "peer" if r["peer"] else "copy" if r["copies"] else "view"
        if not r["copies"]:
            print(f"rollout-{i:<4}{reader_gpus[i]:>4}  {mode:<6}{0.0:>11.3f}{'-':>10}{'-':>9}{'-':>8}")
            continue
        ms = statistics.median(s for _, s in mine) * 1e3
        copy_ms.append(ms)
        print(f"rollout-{i:<4}{reader_gpus[i]:>4}  {mode:<6}{mine[0][0] / 1e9:>11.3f}{ms:>10.3f}"
              f"{max(s for _, s in mine) * 1e3:>9.3f}{mine[0][0] / ms / 1e6:>8.1f}")
    copies = f" receiver_copy_ms={max(copy_ms):.3f}" if copy_ms else ""
    print(f"RESULT cuda_handoff_ms={med['handoff']:.3f} d2d_copy_ms={med['d2d']:.3f} "
          f"write_ms={med['write']:.3f} ratio={med['handoff'] / med['d2d']:.2f} "
          f"open_ms={statistics.median(open_ms):.2f} readers={args.readers} gb={gb:.3f}{copies}")


if __name__ == "__main__":
    main()
