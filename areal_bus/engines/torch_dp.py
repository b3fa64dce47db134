"""The ranks of a multi-process trainer (train_workers > 1) over torch.distributed (gloo on CPU, NCCL
on GPUs): starting them, and rank 0's commands to them.

The trainer node is rank 0: it alone talks to the bus. It starts ranks 1..world-1 as child processes
(``python -m areal_bus.engines.torch_parallel``; supervisord's stopasgroup/killasgroup stop them with
it), and before each update broadcasts the padded batch to them as plain tensors (no pickling). What
each rank does with it (its share of every mini-batch, FSDP2 / tensor-parallel collectives) is
``torch_parallel``'s.

A rank whose parent (rank 0) dies exits on its own: it would otherwise wait in a collective forever.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist

_TENSORS = (("ids", torch.long), ("attn", torch.long), ("mask", torch.float32), ("behav", torch.float32),
            ("adv", torch.float32))
_CMD_TRAIN, _CMD_STOP = 1, 0
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)
"""A rank waits this long in a collective; between updates ranks wait for rank 0's next batch, which
may take as long as rollout takes to produce one. Liveness is the parent watchdog's job, not this."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DataParallel:
    def __init__(self, rank: int, world: int, init_method: str, backend: str = "gloo"):
        self.rank, self.world = rank, world
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
        self.children: list[subprocess.Popen] = []

    @classmethod
    def launch(cls, world: int, topology_path: str, model_path: str, backend: str = "gloo",
               module: str = "areal_bus.engines.torch_parallel") -> DataParallel:
        """Rank 0: start ranks 1..world-1 (``python -m module``) and join them."""
        init = f"tcp://127.0.0.1:{_free_port()}"
        children = [subprocess.Popen([sys.executable, "-m", module, "--topology", topology_path,
                                      "--model", str(model_path), "--rank", str(r), "--world", str(world),
                                      "--init", init, "--backend", backend])
                    for r in range(1, world)]
        dp = cls(0, world, init, backend)
        dp.children = children
        return dp

    def send(self, data: dict[str, torch.Tensor]) -> None:
        """Rank 0: hand every rank the batch of the next update."""
        B, T = data["ids"].shape
        dist.broadcast(torch.tensor([_CMD_TRAIN, B, T], dtype=torch.long), src=0)
        for name, dtype in _TENSORS:
            dist.broadcast(data[name].to(dtype).contiguous(), src=0)

    def receive_command(self) -> tuple[int, dict[str, torch.Tensor] | None]:
        """Ranks > 0: rank 0's next command, with its batch when it is a train command."""
        head = torch.zeros(3, dtype=torch.long)
        dist.broadcast(head, src=0)
        cmd, B, T = (int(x) for x in head)
        if cmd != _CMD_TRAIN:
            return cmd, None
        out = {}
        for name, dtype in _TENSORS:
            t = torch.zeros(B, T, dtype=dtype)
            dist.broadcast(t, src=0)
            out[name] = t
        return cmd, out

    def close(self) -> None:
        if self.rank == 0:
            try:
                dist.broadcast(torch.tensor([_CMD_STOP, 0, 0], dtype=torch.long), src=0)
            finally:
                for c in self.children:
                    try:
                        c.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        c.kill()
        dist.destroy_process_group()


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)  # rank 0 is gone: nothing will ever finish the collective we wait in
