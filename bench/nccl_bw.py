"""NCCL all-gather and all-reduce bandwidth between this host's GPUs: the collectives FSDP2 (dp) and
tensor parallelism (tp) lean on, measured alone, to read bench/trainer_parallel.py's scaling against.

Run:  python3 bench/nccl_bw.py        (2+ GPUs; ~20 s; one GPU runs too, as a smoke test)

Prints, per size (MiB per rank), the time of one collective and the bytes per rank per second. The last
line is ``RESULT gpus=... all_gather_gib_s=... all_reduce_gib_s=...`` at the largest size.
"""

from __future__ import annotations

import os
import socket
import time

# NVLink multicast (NVLS) stays off, as on every run of this project's lent machines (their KINDS.md says
# why); set before torch loads NCCL.
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

SIZES_MIB = (1, 16, 256)
WARMUP, TIMED = 3, 10


def rank(r: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(r)
    dist.init_process_group("nccl", rank=r, world_size=world)
    best = {}
    for mib in SIZES_MIB:
        x = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(world * x.numel(), dtype=x.dtype, device="cuda")
        ops = {"all_gather": lambda: dist.all_gather_into_tensor(out, x), "all_reduce": lambda: dist.all_reduce(x)}
        for name, op in ops.items():
            for _ in range(WARMUP):
                op()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(TIMED):
                op()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / TIMED
            best[name] = mib / 1024 / dt
            if r == 0:
                print(f"{name:10s} {mib:4d} MiB/rank  {dt * 1e3:8.3f} ms  {best[name]:7.1f} GiB/s per rank", flush=True)
    if r == 0:
        print(f"RESULT gpus={world} all_gather_gib_s={best['all_gather']:.1f} all_reduce_gib_s={best['all_reduce']:.1f}",
              flush=True)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    world = torch.cuda.device_count()
    if world < 1:
        raise SystemExit("nccl_bw.py needs CUDA GPUs")
    peer = torch.cuda.can_device_access_peer(0, 1) if world > 1 else None
    print(f"{world} x {torch.cuda.get_device_name(0)}, peer access 0->1: {peer}", flush=True)
    mp.spawn(rank, args=(world, free_port()), nprocs=world)
