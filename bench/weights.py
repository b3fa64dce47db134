"""Weight broadcast through shared memory: 0.5B bf16 parameters (about 1 GB) from the trainer to 4
rollout workers on one host, beside a plain 1 GB copy of the same bytes in the same run.

The trainer's weights are a Qwen2-0.5B-shaped state dict (24 layers, hidden 896, the vocabulary sized
so the total matches --gb) whose tensors are slices of one flat bf16 buffer. Reader processes each
hold a "model" (a dict of tensors) and a ``ShmWeightReader``. One round of each mode:

  weights  from the trainer calling ``ShmWeightWriter.write`` (its tensors copied into the free
           shared-memory buffer) through a VersionAnnounce on a real PUB/SUB pair (areal_bus codec,
           ipc in a short /tmp dir), each reader opening the location (zero copy: its model now
           views the shared pages), reading the two marker values the trainer set for this version,
           releasing the version it served before and answering with a VersionAck on PUSH/PULL,
           to the last reader's ack. Then the broadcaster's part: ``mark_released`` of the previous
           version, so the next write may reuse its buffer.
  memcpy   ``dst.copy_(flat)``: the same bytes from the trainer's buffer into an ordinary
           preallocated one (on --device cuda, a device-to-host copy like the write's).

Two warm-up versions first (each reader maps both buffers once, as a long-running worker does), then
--rounds rounds with the order of the two modes alternating; medians are reported, because the
machine is shared and absolute times drift. Readers connect behind a READY barrier (a version-0
announcement repeated until every reader has answered), never a sleep.

Run:  .venv/bin/python bench/weights.py                  (~30 s; ~4 GB RAM: trainer 1, shm 2, copy 1)
      .venv/bin/python bench/weights.py --gb 1.0 --readers 4 --rounds 5 --device cpu
      .venv/bin/python bench/weights.py --threads 1         (both copies single-threaded)

The write copies 290 tensors (the writer's copy threads take pieces from a shared work list), the
baseline one tensor with torch's copy_; both use torch's intra-op thread count, which --threads sets.

The last line is ``RESULT weights_ms=... memcpy_ms=... ratio=... readers=4 gb=...``; the target is
ratio <= 3.0.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import tempfile
import time

import torch
import zmq

from areal_bus.wire import messages as m
from areal_bus.wire.channels import open_socket
from areal_bus.wire.codec import Encoder, decode, pack_topic
from areal_bus.model.modeling import param_shapes
from areal_bus.weights.shm import ShmWeightReader, ShmWeightWriter

HIDDEN, LAYERS = 896, 24
QWEN2_05B = dict(model_type="qwen2", hidden_size=HIDDEN, intermediate_size=4864, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)  # Qwen2-0.5B
ACK_TIMEOUT_S = 60.0  # a reader silent for this long is dead or stuck: fail rather than hang
SYNC_EVERY_S = 0.02  # the READY barrier repeats its probe this often until every reader answers
STOP = -1  # announced version that tells readers to exit


def qwen_like_shapes(target_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2-0.5B's tensor list (tied embedding), layers and vocabulary scaled to ``target_bytes``."""
    params = target_bytes // 2
    layers = max(1, min(LAYERS, round(LAYERS * params / 494_032_768)))  # 494M: the real model
    per_layer = sum(_numel(s) for n, s in param_shapes(dict(QWEN2_05B, num_hidden_layers=1)) if ".layers." in n)
    vocab = max(1, (params - layers * per_layer - HIDDEN) // HIDDEN)
    return param_shapes(dict(QWEN2_05B, num_hidden_layers=layers, vocab_size=vocab))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def marker(version: int) -> float:
    return float(version % 200)  # integers up to 256 are exact in bf16


# ---------------------------------------------------------------------------------------------
# Reader (rollout worker) process
# ---------------------------------------------------------------------------------------------


def reader_main(idx: int, name: str, ipc_dir: str, first: str, last: str) -> None:
    torch.set_num_threads(1)  # a worker switching weights does no compute; do not fight the writer
    node_id = f"rollout-{idx}"
    ctx = zmq.Context()
    sub = open_socket(ctx, zmq.SUB, f"ipc://{ipc_dir}/ver", bind=False, subscribe=(m.TOPIC_VERSION,))
    sub.rcvtimeo = int(ACK_TIMEOUT_S * 1000)
    push = open_socket(ctx, zmq.PUSH, f"ipc://{ipc_dir}/ack", bind=False)
    enc = Encoder(node_id)
    reader = ShmWeightReader(name)
    model: dict[str, torch.Tensor] = {}
    serving = -1
    try:
        while True:
            try:
                frames = sub.recv_multipart(copy=False)
            except zmq.Again:
                return  # the trainer is gone
            t0 = time.perf_counter()
            _, ann = decode(frames[1:])
            if ann.version == STOP:
                return
            if ann.version <= serving:
                continue  # a repeated announcement: already serving it
            if ann.location:  # version 0 is the READY probe: no weights behind it
                model = reader.open(ann.location)  # the switch: O(1), the model views the new pages
                got = (model[first].view(-1)[0].item(), model[last].view(-1)[-1].item())
                if got != (marker(ann.version),) * 2:
                    push.send_multipart(enc.encode(m.Event(name="bad_weights", node_id=node_id,
                                                           fields={"version": ann.version, "got": list(got)})))
                    return
                reader.release(serving)
            serving = ann.version
            ack = m.VersionAck(node_id=node_id, version=serving, switch_seconds=time.perf_counter() - t0)
            push.send_multipart(enc.encode(ack))
    finally:
        model.clear()
        reader.close()
        sub.close()
        push.close()
        ctx.term()


# ---------------------------------------------------------------------------------------------
# Trainer + broadcaster (this process)
# ---------------------------------------------------------------------------------------------


def wait_acks(pull: zmq.Socket, version: int, readers: int) -> float:
    """Block until every reader acked ``version``; returns the largest switch time a reader reported."""
    acked: dict[str, float] = {}
    deadline = time.monotonic() + ACK_TIMEOUT_S
    while len(acked) < readers:
        if not pull.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            raise RuntimeError(f"version {version}: {len(acked)}/{readers} readers acked within {ACK_TIMEOUT_S} s")
        _, msg = decode(pull.recv_multipart(copy=False))
        if isinstance(msg, m.Event):
            raise RuntimeError(f"{msg.node_id}: {msg.name} {msg.fields}")
        if msg.version == version:
            acked[msg.node_id] = msg.switch_seconds
    return max(acked.values())


def ready_barrier(pub: zmq.Socket, pull: zmq.Socket, enc: Encoder, readers: int) -> None:
    """Repeat a version-0 announcement until every reader answers: only then are all subscriptions
    live (a PUB drops what it sends before a SUB's subscription has arrived)."""
    acked: set[str] = set()
    deadline = time.monotonic() + ACK_TIMEOUT_S
    probe = m.VersionAnnounce(version=0, location="", nbytes=0, published_at=time.time())
    while len(acked) < readers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(acked)}/{readers} readers came up")
        pub.send_multipart(pack_topic(m.TOPIC_VERSION, enc.encode(probe)))
        while pull.poll(int(SYNC_EVERY_S * 1000)):
            _, msg = decode(pull.recv_multipart(copy=False))
            if isinstance(msg, m.VersionAck) and msg.version == 0:
                acked.add(msg.node_id)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="weights size in 1e9 bytes (bf16: 0.5B params per GB)")
    ap.add_argument("--readers", type=int, default=4, help="rollout worker processes on this host")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    ap.add_argument("--device", default="cpu", help="where the trainer's weights live (cpu, cuda)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads for both copies (0: torch's default); the same for both modes")
    args = ap.parse_args()
    if args.gb <= 0 or args.readers < 1 or args.rounds < 1:
        ap.error("--gb, --readers and --rounds must be positive")
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    shapes = qwen_like_shapes(int(args.gb * 1e9))
    numel = sum(_numel(s) for _, s in shapes)
    flat = torch.empty(numel, dtype=torch.bfloat16, device=device)
    pattern = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(device)
    for i in range(0, numel, pattern.numel()):  # realistic bytes at memcpy speed, not randn's
        n = min(pattern.numel(), numel - i)
        flat[i:i + n] = pattern[:n]
    state, off = {}, 0
    for key, shape in shapes:
        n = _numel(shape)
        state[key] = flat[off:off + n].view(shape)
        off += n
    nbytes = numel * 2
    dst = torch.empty(numel, dtype=torch.bfloat16)  # the memcpy baseline's target, touched by warm-up
    first, last = shapes[0][0], shapes[-1][0]

    name = f"abbench_w_{os.getpid()}"
    ipc_dir = tempfile.mkdtemp(prefix="abw-", dir="/tmp")  # ipc paths must stay under ~100 chars
    ctx = zmq.Context()
    pub = open_socket(ctx, zmq.PUB, f"ipc://{ipc_dir}/ver", bind=True)
    pull = open_socket(ctx, zmq.PULL, f"ipc://{ipc_dir}/ack", bind=True)
    writer = ShmWeightWriter(name, state)
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=reader_main, args=(i, name, ipc_dir, first, last), daemon=True)
             for i in range(args.readers)]
    enc = Encoder("weights-0")
    version = 0
    rows: list[dict] = []
    try:
        for p in procs:
            p.start()
        ready_barrier(pub, pull, enc, args.readers)

        def weights_round() -> dict:
            nonlocal version
            version += 1
            flat[0] = flat[-1] = marker(version)  # the trainer's "update": untimed
            sync()
            t0 = time.perf_counter()
            loc = writer.write(state, version)
            t1 = time.perf_counter()
            ann = m.VersionAnnounce(version=version, location=loc, nbytes=nbytes, published_at=time.time())
            pub.send_multipart(pack_topic(m.TOPIC_VERSION, enc.encode(ann)), copy=False)
            switch = wait_acks(pull, version, args.readers)
            t2 = time.perf_counter()
            writer.mark_released(version - 1)  # every reader acked `version`: older buffers are free
            return {"write_ms": (t1 - t0) * 1e3, "ack_ms": (t2 - t1) * 1e3, "weights_ms": (t2 - t0) * 1e3,
                    "switch_ms": switch * 1e3}

        def memcpy_round() -> float:
            sync()
            t0 = time.perf_counter()
            dst.copy_(flat)
            sync()
            return (time.perf_counter() - t0) * 1e3

        for _ in range(2):  # warm-up: both buffers mapped by every reader, dst's pages touched
            weights_round()
        memcpy_round()
        for r in range(args.rounds):
            if r % 2 == 0:
                row = {"memcpy_ms": memcpy_round(), **weights_round(), "order": "memcpy,weights"}
            else:
                row = {**weights_round(), "memcpy_ms": memcpy_round(), "order": "weights,memcpy"}
            rows.append(row)
        pub.send_multipart(pack_topic(m.TOPIC_VERSION, enc.encode(
            m.VersionAnnounce(version=STOP, location="", nbytes=0, published_at=time.time()))))
        for p in procs:
            p.join(10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        writer.close()
        pub.close(linger=0)
        pull.close(linger=0)
        ctx.term()
        shutil.rmtree(ipc_dir, ignore_errors=True)

    print(f"weights: {len(shapes)} tensors, {numel / 1e9:.3f}B params, {nbytes / 1e9:.3f} GB bf16 on {device}; "
          f"{args.readers} readers; {args.rounds} rounds after 2 warm-up versions")
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), load avg {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M')}")
    cols = ("memcpy_ms", "write_ms", "ack_ms", "weights_ms", "switch_ms")
    print(f"{'round':>5}  {'order':<15}" + "".join(f"{c:>12}" for c in cols) + f"{'ratio':>8}")
    for i, row in enumerate(rows):
        print(f"{i:>5}  {row['order']:<15}" + "".join(f"{row[c]:>12.1f}" for c in cols)
              + f"{row['weights_ms'] / row['memcpy_ms']:>8.2f}")
    med = {c: statistics.median(r[c] for r in rows) for c in cols}
    ratio = med["weights_ms"] / med["memcpy_ms"]
    print(f"{'med':>5}  {'':<15}" + "".join(f"{med[c]:>12.1f}" for c in cols) + f"{ratio:>8.2f}")
    print("write: trainer tensors -> shm buffer; ack: announce -> last reader's ack; weights = write + ack; "
          "switch: slowest reader's open+verify")
    print(f"RESULT weights_ms={med['weights_ms']:.1f} memcpy_ms={med['memcpy_ms']:.1f} ratio={ratio:.2f} "
          f"readers={args.readers} gb={nbytes / 1e9:.2f}")


if __name__ == "__main__":
    main()
