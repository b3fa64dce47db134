"""Weights to a host without shared memory with the trainer: time per version through the bus's chunked,
checksummed, CURVE-encrypted transfer (areal_bus/weights/transfer.py, as nodes/weights.py sends it), with
a plain copy of the same bytes in the same run as the baseline, and the projection to 1.5B over 100 Gb/s.

One round: the trainer's version is in shared memory (``ShmWeightWriter``); the sender cuts it into
chunks (CRC32 each, sha256 of the whole) and pushes them over a CURVE socket on tcp loopback to a
receiver thread (its own ZeroMQ context, as on another host), whose ``ChunkAssembler`` writes them
into that host's weight set, checks the sha256 and commits; timed from the first chunk sent to the
commit. Loopback has no link limit, so this measures the CPU cost per byte (encryption, checksums,
copies); the projection adds nothing for the link and takes the larger of the two:
``max(bytes / link, bytes x measured s/byte)``, since the chunks stream (sending one while the
next is hashed), and says which bound it is.

Run:  .venv/bin/python bench/weights_cross_host.py                  (tiny shape and 256 MB, ~20 s)
      .venv/bin/python bench/weights_cross_host.py --mb 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import torch
import zmq

from areal_bus.wire.channels import open_socket
from areal_bus.runtime.metrics import Metrics
from areal_bus.wire.security import bus_context, load_keys, make_keys
from areal_bus.weights.shm import ShmWeightWriter
from areal_bus.weights.transfer import ChunkAssembler, chunk_frames

PARAMS_1_5B = 1.54e9  # Qwen2-1.5B's parameters, sent in bf16 (the rollout dtype)
LINK_BYTES_S = 100e9 / 8


def _tiny_state() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folder = Path(__file__).resolve().parents[1] / "models" / "tiny-guess"
    return {k: v.contiguous() for k, v in load_file(str(folder / "model.safetensors")).items()}


def _flat_state(mb: int) -> dict[str, torch.Tensor]:
    n = mb * (1 << 20) // 2
    return {"w": torch.randn(n // 1024, 1024).bfloat16()}


def _round_trip(state, rounds: int, keys, port: int, tag: str) -> tuple[list[float], list[float], int]:
    ctx_a, ctx_b = bus_context(keys, Metrics(), None), bus_context(keys, Metrics(), None)
    endpoint = f"tcp://127.0.0.1:{port}"
    pull = open_socket(ctx_b, zmq.PULL, endpoint, bind=True, hwm=4)
    push = open_socket(ctx_a, zmq.PUSH, endpoint, bind=False, hwm=4)
    done: list[tuple[str, float]] = []
    assembler = ChunkAssembler(f"xh_{tag}_recv")

    def receive(n: int) -> None:
        while len(done) < n:
            head, payload = pull.recv_multipart(copy=False)
            loc = assembler.add(msgpack.unpackb(head.bytes), payload)
            if loc is not None:
                done.append((loc, time.perf_counter()))
                assembler.writer.mark_released(int(loc.rsplit("@", 1)[1]))

    transfer, copy = [], []
    nbytes = 0
    with ShmWeightWriter(f"xh_{tag}_send", state) as writer:
        rx = threading.Thread(target=receive, args=(rounds + 1,), daemon=True)
        rx.start()
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        for v in range(rounds + 1):  # version 0 warms the connection and the receiver's buffers
            location = writer.write(state, v)
            writer.mark_released(v)
            nbytes = writer.nbytes
            t0 = time.perf_counter()
            for header, payload in chunk_frames(location, chunk_bytes=64 << 20):
                push.send_multipart([msgpack.packb(header), payload], copy=False)
            while len(done) <= v:
                time.sleep(0.0005)
            if v:
                transfer.append(done[v][1] - t0)
                t1 = time.perf_counter()
                for k, t in state.items():
                    dst[k].copy_(t)
                copy.append(time.perf_counter() - t1)
        rx.join(10)
    assembler.close()
    for s in (push, pull):
        s.close(linger=0)
    ctx_a.term(), ctx_b.term()
    return transfer, copy, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=256, help="size of the larger version, MB")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        _, secret = make_keys(Path(tmp) / "keys")
        keys = load_keys(secret)
        rows = []
        for tag, state, port in (("tiny", _tiny_state(), 29871), (f"{args.mb}MB", _flat_state(args.mb), 29872)):
            transfer, copy, nbytes = _round_trip(state, args.rounds, keys, port, tag.lower())
            rows.append((tag, nbytes, statistics.median(transfer), statistics.median(copy)))
    print(f"{'shape':>8} {'bytes':>12} {'transfer_ms':>12} {'copy_ms':>9} {'GB/s':>6}  ({platform.processor() or platform.machine()})")
    for tag, nbytes, t, c in rows:
        print(f"{tag:>8} {nbytes:>12,} {t * 1e3:>12.2f} {c * 1e3:>9.2f} {nbytes / t / 1e9:>6.2f}")
    big_bytes, big_t = rows[-1][1], rows[-1][2]
    target = PARAMS_1_5B * 2
    cpu_s, link_s = target * big_t / big_bytes, target / LINK_BYTES_S
    print(f"1.5B bf16 = {target / 1e9:.2f} GB: link {link_s:.3f} s at 100 Gb/s, this CPU path {cpu_s:.3f} s "
          f"({big_bytes / big_t / 1e9:.2f} GB/s) -> about {max(cpu_s, link_s):.2f} s per version "
          f"({'CPU' if cpu_s > link_s else 'link'}-bound)")
    print(f"RESULT tiny_ms={rows[0][2] * 1e3:.2f} big_gbps={big_bytes / big_t / 1e9:.3f} "
          f"projected_1_5b_s={max(cpu_s, link_s):.2f}")


if __name__ == "__main__":
    main()
