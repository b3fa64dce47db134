"""NCCL all-gather and all-reduce bandwidth between this host's GPUs: the collectives FSDP2 (dp) and
tensor parallelism (tp) lean on, measured alone, to read bench/trainer_parallel.py's scaling against.

Run:  python3 bench/nccl_bw.py        (2+ GPUs; ~20 s; NVLink multicast off as on every run here)
Prints per size (MiB per rank) the time of one collective and the bytes per rank per second.
"""
import os, sys, time
os.environ["NCCL_NVLS_ENABLE"] = "0"; os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"; os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
import torch, torch.distributed as dist, torch.multiprocessing as mp
def rank(r, n, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(r)
    dist.init_process_group("nccl", rank=r, world_size=n)
    for mb in (1, 16, 256):
        x = torch.ones(mb * 2**20 // 2, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(n * x.numel(), dtype=x.dtype, device="cuda")
        for op in ("all_gather", "all_reduce"):
            f = (lambda: dist.all_gather_into_tensor(out, x)) if op == "all_gather" else (lambda: dist.all_reduce(x))
            for _ in range(3): f()
            torch.cuda.synchronize(); t = time.perf_counter(); k = 10
            for _ in range(k): f()
            torch.cuda.synchronize(); dt = (time.perf_counter() - t) / k
            if r == 0: print(f"{op:10s} {mb:4d} MiB/rank  {dt*1e3:8.3f} ms  {mb/1024/dt:7.1f} GiB/s per rank", flush=True)
    dist.destroy_process_group()
if __name__ == "__main__":
    n = torch.cuda.device_count()
    print("devices", n, "peer access 0->1:", torch.cuda.can_device_access_peer(0, 1) if n > 1 else None, flush=True)
    mp.spawn(rank, args=(n, 29511), nprocs=n)
