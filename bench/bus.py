"""Data-path throughput: one 3,000-token Trajectory through encode, PUSH, PULL, decode, beside raw pyzmq.

Two processes, one real pipe between them: this process encodes with ``areal_bus.wire.codec.Encoder`` and
sends on a PUSH socket; a spawned receiver takes the frames off a PULL socket (``copy=False``, as
``channels.Receiver`` does) and decodes them with ``areal_bus.wire.codec.decode``. The baseline is raw
pyzmq moving the same frames (the same byte sizes, pre-built bytes, the same send and receive calls)
between the same two processes with no encode or decode. Sockets come from ``channels.open_socket``
with the topology's default queue_max_size as high-water mark, like the samples and train channels.

Runs are interleaved (raw, bus in even rounds, bus, raw in odd ones, per transport) and each mode's
median over the rounds is reported, because the machine is shared and absolute rates drift. The rate
is taken at the receiver: messages decoded from the first arrival to the end marker. The receiver
checks that it got every message sent and that the last one decoded equals what was sent.

Run:  .venv/bin/python bench/bus.py                          (~45 s: 5 rounds x ipc,tcp x raw,bus x 2 s)
      .venv/bin/python bench/bus.py --seconds 1 --rounds 3 --transport ipc

The last line is ``RESULT bus_msgs_per_s=... raw_msgs_per_s=... ratio=... us_per_msg=...`` for the
first transport given (ipc by default); the target is ratio >= 0.5.
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
import typing

import numpy as np
import zmq

from areal_bus.wire.channels import open_socket
from areal_bus.wire.codec import Encoder, decode
from areal_bus.wire.messages import Trajectory
from areal_bus.config.topology import Topology

PROMPT_TOKENS = 128
OUTPUT_TOKENS = 3000
HWM = Topology.model_fields["queue_max_size"].default  # what the samples/train channels use by default
END = b"END"  # one-frame end-of-run marker; no message of either mode has a single frame
RECV_TIMEOUT_MS = 10_000  # a receiver that hears nothing for this long means a lost peer: fail, do not hang


class Sample(typing.NamedTuple):
    rate: float  # messages per second at the receiver
    tx_cpu_us: float  # sender process CPU time per message
    rx_cpu_us: float  # receiver process CPU time per message


def make_trajectory() -> Trajectory:
    """The same realistic trajectory in both processes (fixed seed), so the receiver can check it."""
    rng = np.random.default_rng(1234)
    return Trajectory(
        traj_id="req-00000042-7f3a9c1e", episode_id="ep-00000042", ticket=42, worker="rollout-0",
        prompt_ids=rng.integers(0, 151_936, PROMPT_TOKENS, dtype=np.int32),
        output_ids=rng.integers(0, 151_936, OUTPUT_TOKENS, dtype=np.int32),
        logprobs=-rng.exponential(0.5, OUTPUT_TOKENS).astype(np.float32),
        versions=np.repeat(np.array([4, 5], np.int32), [OUTPUT_TOKENS // 3, OUTPUT_TOKENS - OUTPUT_TOKENS // 3]),
        loss_mask=(rng.random(OUTPUT_TOKENS) < 0.9).astype(np.uint8),
        reward=1.0, group_id="grp-00000042", finish_reason="stop", gen_seconds=3.25,
    )


def check_last(env, msg) -> str:
    """'' if the last decoded message is the one sent, else what differs. (That every message arrived
    is checked by count: the end marker carries how many were sent.)"""
    ref = make_trajectory()
    if (env.tag, env.producer) != (Trajectory.TAG, "rollout-0"):
        return f"envelope {env.tag}/{env.producer}"
    for name in Trajectory.ARRAYS:
        got, want = getattr(msg, name), getattr(ref, name)
        if got.dtype != want.dtype or not np.array_equal(got, want):
            return f"array {name} differs"
    for name in ("traj_id", "episode_id", "ticket", "worker", "reward", "group_id", "finish_reason", "gen_seconds"):
        if getattr(msg, name) != getattr(ref, name):
            return f"field {name} differs"
    return ""


# ---------------------------------------------------------------------------------------------
# Receiver process
# ---------------------------------------------------------------------------------------------


def receiver(conn, ipc_dir: str, transports: list[str], copy: bool) -> None:
    ctx = zmq.Context()
    socks, endpoints = {}, {}
    for transport in transports:
        ep = f"ipc://{ipc_dir}/b" if transport == "ipc" else "tcp://127.0.0.1:*"
        sock = open_socket(ctx, zmq.PULL, ep, bind=True, hwm=HWM)
        sock.rcvtimeo = RECV_TIMEOUT_MS
        socks[transport], endpoints[transport] = sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
    conn.send(endpoints)
    try:
        while (cmd := conn.recv()) is not None:
            mode, transport = cmd
            conn.send(_receive_run(socks[transport], mode, copy))
    finally:
        for sock in socks.values():
            sock.close(linger=0)
        ctx.term()


def _receive_run(sock: zmq.Socket, mode: str, copy: bool) -> dict:
    # Timing starts when the first message arrives, so the wait for the sender is not counted; the
    # count then covers every message received up to the end marker.
    frames = sock.recv_multipart(copy=copy)
    t0, cpu0 = time.perf_counter(), time.process_time()
    n, last = 0, None
    if mode == "bus":
        while len(frames) != 1:
            last = decode(frames)
            n += 1
            frames = sock.recv_multipart(copy=copy)
    else:
        while len(frames) != 1:
            last = frames
            n += 1
            frames = sock.recv_multipart(copy=copy)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    sent = int(bytes(frames[0])[len(END):])
    error = "" if n == sent else f"received {n} of {sent}"
    if not error and mode == "bus":
        error = check_last(*last)
    return {"count": n, "seconds": elapsed, "cpu": cpu, "error": error,
            "last_sizes": [len(f) for f in last] if mode == "raw" else None}


# ---------------------------------------------------------------------------------------------
# Sender (this process)
# ---------------------------------------------------------------------------------------------


def send_run(sock: zmq.Socket, mode: str, seconds: float, raw_frames: list[bytes]) -> int:
    traj = make_trajectory()
    encoder = Encoder("rollout-0")
    n = 0
    deadline = time.perf_counter() + seconds
    if mode == "bus":
        while True:
            for _ in range(64):
                sock.send_multipart(encoder.encode(traj), copy=False)
            n += 64
            if time.perf_counter() >= deadline:
                break
    else:
        while True:
            for _ in range(64):
                sock.send_multipart(raw_frames, copy=False)
            n += 64
            if time.perf_counter() >= deadline:
                break
    sock.send(END + str(n).encode())
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="length of one run (one mode, one transport)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    ap.add_argument("--transport", default="ipc,tcp", help="comma list of ipc, tcp; the first is the RESULT")
    ap.add_argument("--recv-copy", action="store_true",
                    help="receive with copy=True (bytes) in both modes instead of copy=False (zmq.Frame), "
                         "which channels.Receiver uses")
    args = ap.parse_args()
    transports = [t.strip() for t in args.transport.split(",") if t.strip()]
    if not transports or set(transports) - {"ipc", "tcp"}:
        ap.error("--transport takes ipc, tcp or both")

    sample = Encoder("rollout-0").encode(make_trajectory())
    raw_frames = [bytes(f) for f in sample]
    msg_bytes = sum(len(f) for f in raw_frames)

    ipc_dir = tempfile.mkdtemp(prefix="abbench-", dir="/tmp")  # ipc paths must stay under ~100 chars
    spawn = mp.get_context("spawn")
    conn, child_conn = spawn.Pipe()
    proc = spawn.Process(target=receiver, args=(child_conn, ipc_dir, transports, args.recv_copy), daemon=True)
    proc.start()
    ctx = zmq.Context()
    samples: dict[tuple[str, str], list[Sample]] = {(t, m): [] for t in transports for m in ("raw", "bus")}
    try:
        if not conn.poll(30):
            raise RuntimeError("receiver did not start")
        endpoints = conn.recv()
        socks = {t: open_socket(ctx, zmq.PUSH, endpoints[t], bind=False, hwm=HWM) for t in transports}

        def run(transport: str, mode: str, seconds: float) -> Sample:
            conn.send((mode, transport))
            cpu0 = time.process_time()  # this process, its ZeroMQ I/O thread included
            sent = send_run(socks[transport], mode, seconds, raw_frames)
            tx_cpu = time.process_time() - cpu0
            if not conn.poll(RECV_TIMEOUT_MS / 1000 + seconds + 5):
                raise RuntimeError(f"receiver gave no result for {transport}/{mode}")
            res = conn.recv()
            if res["error"]:
                raise RuntimeError(f"{transport}/{mode}: {res['error']}")
            if res["last_sizes"] is not None and res["last_sizes"] != [len(f) for f in raw_frames]:
                raise RuntimeError(f"{transport}/raw: frame sizes {res['last_sizes']}")
            assert res["count"] == sent
            n = res["count"]
            return Sample(n / res["seconds"], 1e6 * tx_cpu / n, 1e6 * res["cpu"] / n)

        for transport in transports:  # warm-up: connections up, caches and allocators warm
            for mode in ("raw", "bus"):
                run(transport, mode, min(0.3, args.seconds))
        print(f"{time.strftime('%Y-%m-%d %H:%M')} {platform.node()}: {os.cpu_count()} cpus, load "
              f"{os.getloadavg()[0]:.1f}; python {platform.python_version()}, pyzmq {zmq.__version__}, "
              f"libzmq {zmq.zmq_version()}")
        print(f"message: {len(raw_frames)} frames, {msg_bytes} bytes ({PROMPT_TOKENS}+{OUTPUT_TOKENS} tokens); "
              f"{args.rounds} rounds x {args.seconds:g} s per mode; recv copy={args.recv_copy}; "
              "receiver checked count and last message")
        for r in range(args.rounds):
            for transport in transports:
                for mode in ("raw", "bus") if r % 2 == 0 else ("bus", "raw"):
                    samples[transport, mode].append(run(transport, mode, args.seconds))
    finally:
        conn.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)

    # CPU columns: CPU time each process spent per message, its ZeroMQ I/O thread included. They say
    # which side limits the rate, and drift less than the rate when others load the machine.
    print(f"\n{'mode':<10}{'msgs/s':>10}{'us/msg':>9}{'MB/s':>9}{'tx cpu us':>11}{'rx cpu us':>11}   msgs/s per round")
    med = {}
    for (transport, mode), runs in samples.items():
        med[transport, mode] = rate = statistics.median(s.rate for s in runs)
        tx = statistics.median(s.tx_cpu_us for s in runs)
        rx = statistics.median(s.rx_cpu_us for s in runs)
        rounds = " ".join(f"{s.rate:.0f}" for s in runs)
        print(f"{transport + ' ' + mode:<10}{rate:>10.0f}{1e6 / rate:>9.1f}{rate * msg_bytes / 1e6:>9.1f}"
              f"{tx:>11.1f}{rx:>11.1f}   {rounds}")
    print()
    for transport in transports:
        pairs = zip(samples[transport, "bus"], samples[transport, "raw"])
        paired = " ".join(f"{b.rate / r.rate:.2f}" for b, r in pairs)
        print(f"ratio bus/raw ({transport}): {med[transport, 'bus'] / med[transport, 'raw']:.2f}   per round {paired}")
    print(f"load at the end: {os.getloadavg()[0]:.1f} (others' work on this machine skews single rounds)")
    t = transports[0]
    bus, raw = med[t, "bus"], med[t, "raw"]
    print(f"RESULT bus_msgs_per_s={bus:.0f} raw_msgs_per_s={raw:.0f} ratio={bus / raw:.3f} us_per_msg={1e6 / bus:.1f}")


if __name__ == "__main__":
    main()
