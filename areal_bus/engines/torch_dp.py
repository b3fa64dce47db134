"""The ranks of a multi-process trainer (train_workers > 1) over torch.distributed (gloo on CPU, NCCL
on GPUs): starting them, and rank 0's commands to them.

The trainer node is rank 0: it alone talks to the bus. It starts ranks 1..world-1 as child processes
(``python -m areal_bus.engines.torch_parallel``; supervisord's stopasgroup/killasgroup stop them with
it), and before each update broadcasts the padded batch to them as plain tensors (no pickling). What
each rank does with it (its share of every mini-batch, FSDP2 / tensor-parallel collectives) is
``torch_parallel``'s.

A rank whose parent (rank 0) dies exits on its own: it would otherwise wait in a collective forever.

Across hosts (``nodes.trainer.hosts``; areal_bus/config/placement.py) the ranks rendezvous through
torch.distributed's env:// as torchrun sets it: the rendered supervisord programs carry MASTER_ADDR,
MASTER_PORT (rank 0's TCPStore), WORLD_SIZE, NODE_RANK and LOCAL_WORLD_SIZE. Rank 0's host starts its
local ranks from the node, as on one host; every other host's supervisord runs this module's ``main``
(``python -m areal_bus.engines.torch_dp --topology T``, the program ``trainer-<node rank>``), which
starts that host's ranks and exits with the first one that fails, so its supervisord restarts them and
they rendezvous again with a restarted rank 0. gloo on CPU; on GPU hosts ``backend_for`` gives NCCL
(that path was written, not run: no multi-host GPUs here).
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from areal_bus.config.placement import HOST_ADDR_ENV
from areal_bus.config.topology import load_topology

_TENSORS = (("ids", torch.long), ("attn", torch.long), ("mask", torch.float32), ("behav", torch.float32),
            ("adv", torch.float32), ("lag", torch.float32))
CMD_TRAIN, CMD_STOP = 1, 0
"""Rank 0's command before each broadcast: a batch follows, or the ranks exit."""
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)
"""A rank waits this long in a collective; between updates ranks wait for rank 0's next batch, which
may take as long as rollout takes to produce one. Liveness is the parent watchdog's job, not this."""


EXIT_RANKS_LOST = 75
"""Rank 0's exit status when its process group broke (an error status: three in a row end the run)."""


def backend_for(device: str) -> str:
    """gloo for CPU tensors (the batch broadcast is always on CPU), NCCL for CUDA ones."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


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
        """Rank 0: start this host's ranks 1..k-1 (``python -m module``; k = world on one host) and
        join every rank, those of the other hosts through env:// (see the module docstring)."""
        env = rendezvous_env()
        if env is None:
            init, local = f"tcp://127.0.0.1:{_free_port()}", world
        else:
            init, local = "env://", env["local"]
            if env["node_rank"] != 0 or env["world"] != world:
                raise RuntimeError(f"the trainer node is rank 0 of {world} ranks, but its environment says "
                                   f"NODE_RANK={env['node_rank']} WORLD_SIZE={env['world']}: re-render this "
                                   f"host's conf (areal-bus render TOPOLOGY --host ADDR)")
            _refuse_resume_across_hosts(topology_path, model_path)
            _pin_interface()
        children = [_start_rank(module, topology_path, model_path, r, world, init, backend, local_rank=r)
                    for r in range(1, local)]
        dp = cls(0, world, init, backend)
        dp.children = children
        return dp

    def send(self, data: dict[str, torch.Tensor]) -> None:
        """Rank 0: hand every rank the batch of the next update."""
        B, T = data["ids"].shape
        dist.broadcast(torch.tensor([CMD_TRAIN, B, T], dtype=torch.long), src=0)
        for name, dtype in _TENSORS:
            dist.broadcast(data[name].to(dtype).contiguous(), src=0)

    def receive_command(self) -> tuple[int, dict[str, torch.Tensor] | None]:
        """Ranks > 0: rank 0's next command, with its batch when it is a train command."""
        head = torch.zeros(3, dtype=torch.long)
        dist.broadcast(head, src=0)
        cmd, B, T = (int(x) for x in head)
        if cmd != CMD_TRAIN:
            return cmd, None
        out = {}
        for name, dtype in _TENSORS:
            t = torch.zeros(B, T, dtype=dtype)
            dist.broadcast(t, src=0)
            out[name] = t
        return cmd, out

    def abort(self, exc: BaseException) -> None:
        """Rank 0, after an update raised: the other ranks wait in a collective this process will
        never finish (or one of them died: gloo's "Connection reset by peer"), so the group is gone.
        Exit at once with EXIT_RANKS_LOST: supervisord restarts the trainer, which resumes as after any
        crash (its batch in flight is a suspect, trained again), and the other hosts' launchers exit
        with their ranks and rendezvous with the new rank 0. Quarantining the batch instead would
        leave a trainer whose ranks can never agree again."""
        if self.world > 1:
            print(f"trainer rank 0: an update failed with {self.world} ranks ({type(exc).__name__}: "
                  f"{str(exc)[:300]}); the process group cannot go on: exiting so that every rank restarts",
                  file=sys.stderr, flush=True)
            for c in self.children:
                c.kill()
            os._exit(EXIT_RANKS_LOST)

    def close(self) -> None:
        if self.rank == 0:
            try:
                dist.broadcast(torch.tensor([CMD_STOP, 0, 0], dtype=torch.long), src=0)
            finally:
                for c in self.children:
                    try:
                        c.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        c.kill()
        dist.destroy_process_group()


def watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)  # rank 0 is gone: nothing will ever finish the collective we wait in


def rendezvous_env(environ=os.environ) -> dict | None:
    """torchrun's variables when the rendered conf set them (ranks on several hosts), else None."""
    if "MASTER_ADDR" not in environ:
        return None
    try:
        world, node_rank = int(environ["WORLD_SIZE"]), int(environ["NODE_RANK"])
        local = int(environ["LOCAL_WORLD_SIZE"])
        int(environ["MASTER_PORT"])
    except (KeyError, ValueError) as exc:
        raise RuntimeError(f"MASTER_ADDR is set but the rest of torch.distributed's env:// rendezvous is "
                           f"not (MASTER_PORT, WORLD_SIZE, NODE_RANK, LOCAL_WORLD_SIZE): {exc!r}") from None
    return {"world": world, "node_rank": node_rank, "local": local}


def _interface_of(addr: str) -> str | None:
    """The network interface that holds IPv4 address ``addr`` on this host, or None."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(got[20:24]) == addr:
                return name
    return None


def _pin_interface(environ=os.environ) -> None:
    """Point gloo and NCCL at the interface of this host's address (placement.HOST_ADDR_ENV), unless
    the user chose one: torch otherwise resolves the host name, which may well be 127.0.0.1, and the
    other hosts' ranks then fail to connect ("connectFullMesh ... Connection refused")."""
    addr = environ.get(HOST_ADDR_ENV)
    if not addr:
        return
    name = _interface_of(addr)
    if name is None:
        raise RuntimeError(f"no network interface of this host holds {addr} ({HOST_ADDR_ENV}, the trainer host "
                           f"the topology places here): render this host's conf with its own --host address")
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        environ.setdefault(var, name)


def _start_rank(module: str, topology_path, model_path, rank: int, world: int, init: str, backend: str,
                local_rank: int) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(local_rank)}
    return subprocess.Popen([sys.executable, "-m", module, "--topology", str(topology_path), "--model",
                             str(model_path), "--rank", str(rank), "--world", str(world), "--init", init,
                             "--backend", backend], env=env)


def _refuse_resume_across_hosts(topology_path, model_path) -> None:
    """The ranks of other hosts start from model.path on their own disk: a rank 0 resuming from a
    checkpoint (which only its host holds) would train shards of two different models."""
    topo = load_topology(topology_path)
    if Path(model_path).resolve() != topo.model_path().resolve():
        raise RuntimeError(f"trainer ranks on other hosts start from model.path ({topo.model.path}); rank 0 "
                           f"would resume from {model_path}, which they cannot read. Across hosts a restarted "
                           f"trainer starts over from model.path (logging.save_interval: 0; the spool re-trains "
                           f"what was accepted), or put log_dir on storage every trainer host mounts")


def main(argv=None) -> int:
    """A host's trainer ranks other than rank 0's host: start them, wait, and exit as the first that
    fails (its supervisord restarts us; they rendezvous again) or 0 once rank 0 stopped them all."""
    p = argparse.ArgumentParser(description="the trainer ranks of one host (NODE_RANK > 0), as supervisord "
                                "runs them from `areal-bus render TOPOLOGY --host ADDR`")
    p.add_argument("--topology", required=True)
    args = p.parse_args(argv)
    env = rendezvous_env()
    if env is None or env["node_rank"] < 1:
        print("torch_dp: this launcher runs the ranks of a host other than rank 0's: it needs MASTER_ADDR, "
              "MASTER_PORT, WORLD_SIZE, NODE_RANK (>= 1) and LOCAL_WORLD_SIZE (the rendered conf sets them)",
              file=sys.stderr)
        return 2
    topo = load_topology(args.topology)
    _pin_interface()
    first = env["node_rank"] * env["local"]
    children = [_start_rank("areal_bus.engines.torch_parallel", args.topology, topo.model_path(), first + i,
                            env["world"], "env://", backend_for(topo.trainer_device), local_rank=i)
                for i in range(env["local"])]
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    rc = 0
    try:
        while not stop and any(c.poll() is None for c in children):
            failed = [c.returncode for c in children if c.returncode not in (None, 0)]
            if failed:
                rc = failed[0] if failed[0] > 0 else 1
                break
            time.sleep(0.2)
        else:
            failed = [c.returncode for c in children if c.returncode not in (None, 0)]
            rc = (failed[0] if failed[0] > 0 else 1) if failed else 0
    finally:
        for c in children:
            if c.poll() is None:
                c.terminate()
        for c in children:
            try:
                c.wait(10)
            except subprocess.TimeoutExpired:
                c.kill()
    return rc


if __name__ == "__main__":
    sys.exit(main())
