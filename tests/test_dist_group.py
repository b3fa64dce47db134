"""The weight group (areal_bus/weights/dist_group.py) on loopback, over gloo: this process is rank 0 and
serves the store; a member is another process. A version broadcast in buckets lands bitwise; a member
that stops answering (SIGSTOP: its sockets stay open, so no collective fails) is noticed by its
heartbeats going silent (the bus's PeerTable and liveness window), not by the collective's timeout, and
a new generation forms with a fresh member and carries the version whole.

Run: .venv/bin/python -m pytest tests/test_dist_group.py -q      (about 10 s)
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq

from areal_bus.constants import HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS
from areal_bus.runtime.node import PeerTable
from areal_bus.weights import dist_group as dg
from areal_bus.wire.codec import decode

REPO = Path(__file__).resolve().parents[1]

_MEMBER = """
import hashlib, os, sys, threading, time, torch, zmq
from areal_bus.constants import HEARTBEAT_INTERVAL_S
from areal_bus.wire import messages as m
from areal_bus.wire.codec import Encoder
from areal_bus.weights.dist_group import Generation, Transfer
port, token, gen, total, bucket, hb = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
backend = sys.argv[7] if len(sys.argv) > 7 else "gloo"
device = torch.device("cuda", 1) if backend == "nccl" else torch.device("cpu")
ctx = zmq.Context(); push = ctx.socket(zmq.PUSH); push.linger = 0; push.connect(hb)
enc, lock = Encoder(f"weights-{gen}"), threading.Lock()
def beat():  # the node shell's heartbeat, on a socket of its own thread
    while True:
        push.send_multipart(enc.encode(m.Heartbeat(node_id="weights-1", kind="weights", incarnation=f"inc{gen}",
                            pid=os.getpid(), t=time.time(), version=0, counters={}, gauges={}, hists={})))
        time.sleep(HEARTBEAT_INTERVAL_S)
threading.Thread(target=beat, daemon=True).start()
g = Generation(gen, 1, 2, backend, token=token, addr="127.0.0.1", port=int(port), my_addr="127.0.0.1", device=device)
while g.poll() == "forming":
    time.sleep(0.01)
print("state", g.state, g.error, flush=True)
dst = torch.empty(total, dtype=torch.uint8, device=device)
t = Transfer(g, total, lambda o, n: dst[o:o + n], bucket_bytes=bucket)
while not t.pump():
    time.sleep(0.001)
print("sha256", hashlib.sha256(dst.cpu().numpy()).hexdigest(), t.count, flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rank0:
    """This process's side: the store, a heartbeat inbox (PULL) fed to a PeerTable, and members started."""

    def __init__(self):
        self.port = _free_port()
        self.store = dg.serve_store("127.0.0.1", self.port)
        self.token = dg.new_token()
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.linger = 0
        hb_port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.hb = f"tcp://127.0.0.1:{hb_port}"
        self.peers = PeerTable()
        self.members: list[subprocess.Popen] = []

    def member(self, gen: int, total: int, bucket: int, backend: str = "gloo") -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", _MEMBER, str(self.port), self.token, str(gen), str(total),
                              str(bucket), self.hb, backend], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.members.append(p)
        return p

    def generation(self, gen: int, backend: str = "gloo", device=None) -> dg.Generation:
        g = dg.Generation(gen, 0, 2, backend, token=self.token, addr="127.0.0.1", port=self.port,
                          my_addr="127.0.0.1", store=self.store, device=device)
        deadline = time.monotonic() + 60
        while g.poll() == "forming":
            assert time.monotonic() < deadline, "generation did not form"
            self.heartbeats()
            time.sleep(0.01)
        assert g.state == "ready", g.error
        return g

    def heartbeats(self) -> None:
        while self.pull.poll(0):
            _, hb = decode(self.pull.recv_multipart())
            self.peers.update(hb, time.monotonic())
        self.peers.expire(time.monotonic())

    def close(self) -> None:
        for p in self.members:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            p.stdout.close()
            p.stderr.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def rank0():
    r = Rank0()
    yield r
    r.close()


def _send(g: dg.Generation, src: torch.Tensor, bucket: int, until=None) -> dg.Transfer:
    t = dg.Transfer(g, src.numel(), lambda o, n: src[o:o + n], bucket_bytes=bucket)
    deadline = time.monotonic() + 60
    while not t.pump():
        assert time.monotonic() < deadline, "transfer did not finish"
        if until is not None and until():
            break
        time.sleep(0.001)
    return t


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one per rank)")])])
def test_a_version_broadcast_in_buckets_lands_bitwise(rank0, backend):
    total, bucket = (5 << 20) + 123, 1 << 20  # the last bucket is short
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    device = torch.device("cuda", 0) if backend == "nccl" else None
    member = rank0.member(1, total, bucket, backend)
    g = rank0.generation(1, backend, device)
    t = _send(g, src if device is None else src.to(device), bucket)
    out, err = member.communicate(timeout=60)
    assert member.returncode == 0, err
    _, digest, count = out.strip().splitlines()[-1].split()
    assert int(count) == t.count == 6
    assert digest == hashlib.sha256(src.numpy()).hexdigest()


@pytest.mark.timeout(120)
def test_a_member_gone_silent_is_noticed_within_the_liveness_window_and_a_new_generation_forms(rank0):
    total, bucket = 64 << 20, 8 << 20  # more than loopback's socket buffers: sends to a stopped member block
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    first = rank0.member(1, total, bucket)
    g1 = rank0.generation(1)
    assert first.stdout.readline().startswith("state ready")
    first.send_signal(signal.SIGSTOP)  # a host that vanishes: no RST, no error, only silence
    stopped = time.monotonic()
    t = _send(g1, src, bucket, until=lambda: (rank0.heartbeats(), not rank0.peers.alive("weights"))[1])
    noticed = time.monotonic() - stopped
    window = HEARTBEAT_INTERVAL_S * HEARTBEAT_LIVENESS
    assert t.done < t.count, "the broadcast should be stuck behind the stopped member"
    assert noticed < window + 2 * HEARTBEAT_INTERVAL_S + 1.0, noticed
    assert noticed < dg.BUCKET_TIMEOUT_S / 10
    g1.abort("weights-1 is gone")
    with pytest.raises(dg.GroupError):
        t.pump()
    first.kill()
    # The host comes back: generation 2 forms with the new member and carries the version whole.
    second = rank0.member(2, total, bucket)
    g2 = rank0.generation(2)
    _send(g2, src, bucket)
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert out.strip().splitlines()[-1].split()[1] == hashlib.sha256(src.numpy()).hexdigest()
    rank0.heartbeats()
    assert rank0.peers.peers["weights-1"].incarnation == "inc2"  # the host's new incarnation was heard


def test_a_plan_that_crossed_a_socket_is_checked_field_by_field():
    good = dg.plan(3, 1, 2, "10.0.0.1", 26310, "gloo", "abc")
    assert dg.check_plan(dict(good)) == good
    for key, bad in (("rank", 0), ("rank", 2), ("backend", "mpi"), ("port", "26310"), ("gen", None)):
        with pytest.raises(ValueError, match=key):
            dg.check_plan({**good, key: bad})
    with pytest.raises(ValueError, match="map"):
        dg.check_plan([1, 2])


def test_a_gpu_trainer_with_rollout_on_another_host_validates_over_the_group_and_chunks_are_refused():
    # The group replaced the refusal ("an NCCL broadcast group is not written"); chunks cannot read CUDA IPC.
    from areal_bus.config.topology import TopologyError, parse_topology
    from areal_bus.weights.group_link import group_backend

    a, b = "10.0.0.1", "10.0.0.2"
    doc = {"rollout_workers": 2, "rollout_engine": {"kind": "torch"}, "trainer_engine": {"kind": "torch"},
           "agent": {"framework": "guess"}, "model": {"device": "cuda"},
           "endpoints": {"transport": "tcp", "host": a, "curve": {"key": "keys/cluster.key_secret"}},
           "nodes": {"bus": {}, "agent": {}, "reward": {}, "weights": {}, "trainer": {}, "rollout": {"hosts": [a, b]}}}
    assert group_backend(parse_topology(doc)) == "nccl"
    with pytest.raises(TopologyError, match=r"endpoints\.far_weights"):
        parse_topology({**doc, "endpoints": {**doc["endpoints"], "far_weights": "chunks"}})
    cpu = {**doc, "model": {"device": "cpu"}}
    assert group_backend(parse_topology(cpu)) is None  # auto on CPU: the chunks, as before
    assert group_backend(parse_topology({**cpu, "endpoints": {**doc["endpoints"], "far_weights": "group"}})) == "gloo"
