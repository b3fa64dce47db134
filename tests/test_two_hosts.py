"""Two hosts: a run split across two network namespaces joined by a veth pair, over tcp with CURVE.

Host A (10.199.0.1) runs the bus, the agent and the trainer; host B (10.199.0.2) runs the reward node,
the weight broadcaster and the rollout worker. So trajectories cross the link twice (agent -> reward on
B -> trainer on A), generation requests and completions cross it, the trainer's WeightsReady goes to
the broadcaster on B and its announcements come back through the hub on A. A second test moves real
weights across: a shared-memory weight set on A, cut into chunks (weights_transfer.chunk_frames), sent over
a CURVE socket and assembled into a weight set on B whose tensors must be identical. A third checks
that a peer on B without the key gets nothing onto the bus.

The namespaces are made by ``unshare -n`` holder processes (nothing in the host's own network stack
changes) and vanish when their processes exit. Where they cannot be made (not root, no iproute2, a
kernel or container without network namespaces or veth), the tests skip and say which step failed.

Run: sudo .venv/bin/pytest tests/test_two_hosts.py      (about 30 s)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from areal_bus.wire.security import make_keys
from tests.fuzzing import venv_bin

REPO = Path(__file__).resolve().parents[1]
HOST_A, HOST_B = "10.199.0.1", "10.199.0.2"
PREFIX = 24
BASE_PORT = 25500  # fresh namespaces: nothing else listens there
MAX_STEPS = 12
"""Updates of the split run: at 0.25 s each, long enough for host B's rollout worker to be seen serving."""


def _run(cmd: list[str], what: str) -> None:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"two hosts need network namespaces: {what} failed ({exc})")
    if res.returncode != 0:
        pytest.skip(f"two hosts need network namespaces: {what} failed: `{' '.join(cmd)}` exited "
                    f"{res.returncode}: {res.stderr.strip() or res.stdout.strip()}")


class Hosts:
    """Two network namespaces, each held open by a sleeping process, joined by a veth pair."""

    def __init__(self):
        self.holders: dict[str, subprocess.Popen] = {}

    def make(self) -> None:
        for tool in ("unshare", "nsenter", "ip"):
            if shutil.which(tool) is None:
                pytest.skip(f"two hosts need network namespaces: no `{tool}` on PATH "
                            f"({'util-linux' if tool != 'ip' else 'iproute2'})")
        for host in ("a", "b"):
            holder = subprocess.Popen(["unshare", "-n", "sleep", "600"], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True)
            self.holders[host] = holder
            time.sleep(0.1)
            if holder.poll() is not None:
                why = holder.stderr.read().strip()
                pytest.skip(f"two hosts need network namespaces: `unshare -n` failed: {why} "
                            f"(it needs root or CAP_SYS_ADMIN; uid is {os.geteuid()})")
        a, b = self.holders["a"].pid, self.holders["b"].pid
        _run(["nsenter", "-t", str(a), "-n", "ip", "link", "add", "veth-a", "type", "veth", "peer", "name", "veth-b",
              "netns", str(b)], "creating the veth pair")
        for host, ip, dev in (("a", HOST_A, "veth-a"), ("b", HOST_B, "veth-b")):
            pid = str(self.holders[host].pid)
            _run(["nsenter", "-t", pid, "-n", "ip", "addr", "add", f"{ip}/{PREFIX}", "dev", dev], f"addressing {dev}")
            _run(["nsenter", "-t", pid, "-n", "ip", "link", "set", dev, "up"], f"bringing {dev} up")
            _run(["nsenter", "-t", pid, "-n", "ip", "link", "set", "lo", "up"], "bringing lo up")

    def cmd(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s network namespace (nsenter execs it: same pid)."""
        return ["nsenter", "-t", str(self.holders[host].pid), "-n", *argv]

    def close(self) -> None:
        for holder in self.holders.values():
            if holder.poll() is None:
                holder.kill()
            holder.wait(10)


@pytest.fixture(scope="module")
def hosts():
    h = Hosts()
    try:
        h.make()
        yield h
    finally:
        h.close()


@pytest.fixture
def work():
    path = Path(tempfile.mkdtemp(prefix="ab2h-", dir="/tmp"))
    yield path
    if not os.environ.get("KEEP_SYSTEM_DIR"):
        shutil.rmtree(path, ignore_errors=True)


def _topology(work: Path, key: Path) -> Path:
    data = {
        "name": "twohosts", "rollout_workers": 1, "staleness_threshold": 2, "queue_max_size": 64,
        "trigger_batch_size": 4, "global_batch_size": 8, "mini_batch_size": 4, "max_steps": MAX_STEPS,
        "logging": {"log_dir": "logs", "log_interval": 2, "save_interval": 0},
        "agent": {"framework": "sim", "max_turns": 1, "reward_source": "rule", "prompt_len": 16},
        "rollout_engine": {"kind": "sim", "max_batch": 8, "decode_step_s": 0.001, "decode_step_per_seq_s": 0.00001,
                           "swap_s": 0.001, "output_len": {"dist": "uniform", "min": 8, "max": 32}},
        "trainer_engine": {"kind": "sim", "time_per_token_s": 0.00001, "update_overhead_s": 0.25},
        "endpoints": {"transport": "tcp", "host": HOST_A, "base_port": BASE_PORT, "curve": {"key": str(key)}},
        "nodes": {"bus": {}, "agent": {"replicas": 1}, "trainer": {},
                  "reward": {"replicas": 1, "host": HOST_B}, "weights": {"host": HOST_B}},
    }
    path = work / "topology.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


PLACEMENT = {"a": ("bus", "trainer", "agent"), "b": ("weights", "reward", "rollout")}


@pytest.mark.timeout(150)
def test_a_run_split_across_two_hosts_trains_to_the_end_over_curve(hosts, work):
    _, key = make_keys(work / "keys")
    topo = _topology(work, key)
    (work / "out").mkdir()
    procs: dict[str, subprocess.Popen] = {}
    try:
        for host, kinds in PLACEMENT.items():
            for kind in kinds:
                with open(work / "out" / f"{kind}.log", "wb") as out:
                    procs[kind] = subprocess.Popen(
                        hosts.cmd(host, [str(venv_bin() / "areal-bus"), "node", kind, "--topology", str(topo)]),
                        cwd=work, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        # The trainer exits 0 by itself after max_steps: everything on the data path worked across the link.
        try:
            rc = procs["trainer"].wait(120)
        except subprocess.TimeoutExpired:
            rc = None
        logs = {k: (work / "out" / f"{k}.log").read_text()[-2000:] for k in procs}
        assert rc == 0, f"trainer exited {rc}\n" + "\n".join(f"--- {k}\n{t}" for k, t in logs.items())
        steps = [json.loads(line) for line in (work / "logs" / "train_steps.jsonl").read_text().splitlines()]
        assert len([s for s in steps if s.get("step", -1) >= 0]) == MAX_STEPS
        alive = {k: p.poll() for k, p in procs.items() if k != "trainer"}
        assert all(code is None for code in alive.values()), f"nodes died: {alive}\n{logs}"
        # Host B's broadcaster saw B's rollout worker serve versions that A's trainer made (the version
        # went A -> B as WeightsReady, back to A's hub as an announcement, to B's worker, and its ack
        # back through A to B).
        weights_log = (work / "logs" / "weights.log").read_text()
        assert re.search(r"committed version=([1-9]\d*) serving=1/1", weights_log), weights_log
        rollout_log = (work / "logs" / "rollout.log").read_text()
        assert "[rollout] step=" in rollout_log
        assert "Traceback" not in "".join(logs.values())
    finally:
        _stop(procs, 15)


_SENDER = """
import hashlib, json, sys, time, zmq, msgpack, torch
from areal_bus.wire.channels import open_socket
from areal_bus.runtime.metrics import Metrics
from areal_bus.wire.security import bus_context, load_keys
from areal_bus.weights.shm import ShmWeightWriter
from areal_bus.weights.transfer import chunk_frames
key, endpoint, name = sys.argv[1:4]
g = torch.Generator().manual_seed(11)
state = {"embed": torch.randn(400, 64, generator=g).bfloat16(), "proj": torch.randn(64, 64, generator=g),
         "bias": torch.randn(64, generator=g).half(), "steps": torch.arange(7)}
ctx = bus_context(load_keys(key), Metrics(), None)
push = open_socket(ctx, zmq.PUSH, endpoint, bind=False)
push.sndtimeo = 30_000
with ShmWeightWriter(name, state) as writer:
    sent = 0
    for header, payload in chunk_frames(writer.write(state, 3), chunk_bytes=4096):
        push.send_multipart([msgpack.packb(header), payload], copy=False)
        sent += 1
    time.sleep(0.5)  # the frames view the buffer: keep it until ZeroMQ has sent them
digest = {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for k, v in state.items()}
print(json.dumps({"chunks": sent, "digest": digest}))
ctx.destroy(linger=5000)
"""

_RECEIVER = """
import hashlib, json, sys, zmq, msgpack, torch
from areal_bus.wire.channels import open_socket
from areal_bus.runtime.metrics import Metrics
from areal_bus.wire.security import bus_context, load_keys
from areal_bus.weights.shm import ShmWeightReader
from areal_bus.weights.transfer import ChunkAssembler
key, endpoint, name = sys.argv[1:4]
ctx = bus_context(load_keys(key), Metrics(), None)
pull = open_socket(ctx, zmq.PULL, endpoint, bind=True)
print("ready", flush=True)
pull.rcvtimeo = 60_000
assembler, location, chunks = ChunkAssembler(name), None, 0
while location is None:
    head, payload = pull.recv_multipart(copy=False)
    location = assembler.add(msgpack.unpackb(head.bytes), payload)
    chunks += 1
reader = ShmWeightReader(name)
state = reader.open(location)
digest = {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for k, v in state.items()}
print(json.dumps({"location": location, "chunks": chunks, "digest": digest}), flush=True)
del state
reader.close()
assembler.close()
ctx.destroy(linger=0)
"""


@pytest.mark.timeout(120)
def test_weights_cross_from_one_host_to_the_other_over_curve(hosts, work):
    _, key = make_keys(work / "keys")
    name = f"ab2h_{os.getpid()}"
    endpoint = f"tcp://{HOST_B}:{BASE_PORT + 900}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    receiver = subprocess.Popen(hosts.cmd("b", [sys.executable, "-c", _RECEIVER, str(key), endpoint, name + "_b"]),
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout.readline().strip() == "ready", receiver.stderr.read()
        sender = subprocess.run(hosts.cmd("a", [sys.executable, "-c", _SENDER, str(key), endpoint, name + "_a"]),
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=90)
        assert sender.returncode == 0, sender.stderr
        out, err = receiver.communicate(timeout=60)
        assert receiver.returncode == 0, err
        sent, got = json.loads(sender.stdout), json.loads(out.strip().splitlines()[-1])
        assert got["location"] == f"shm:{name}_b.0@3"
        assert got["chunks"] == sent["chunks"] > 10
        assert got["digest"] == sent["digest"]
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait(10)
        for leftover in Path("/dev/shm").glob(f"{name}_*"):
            leftover.unlink(missing_ok=True)


_CACHED_VERSION = """
import sys, zmq
from areal_bus.wire import messages as m
from areal_bus.wire.channels import open_socket
from areal_bus.wire.codec import decode
from areal_bus.runtime.metrics import Metrics
from areal_bus.wire.security import bus_context, load_keys
ctx = bus_context(load_keys(sys.argv[1]), Metrics(), None)
sub = open_socket(ctx, zmq.SUB, sys.argv[2], bind=False, subscribe=(m.TOPIC_VERSION,))
print(decode(sub.recv_multipart()[1:])[1] if sub.poll(3000) else "nothing")
ctx.destroy(linger=0)
"""


@pytest.mark.timeout(90)
def test_a_peer_on_the_other_host_without_the_key_gets_nothing_onto_the_bus(hosts, work):
    _, key = make_keys(work / "keys")
    topo = _topology(work, key)
    with open(work / "bus.out", "wb") as out:
        bus = subprocess.Popen(hosts.cmd("a", [str(venv_bin() / "areal-bus"), "node", "bus", "--topology", str(topo)]),
                               cwd=work, stdout=out, stderr=subprocess.STDOUT)
    stranger = (
        "import sys, time, zmq\n"
        "from areal_bus.wire import messages as m\n"
        "from areal_bus.wire.codec import Encoder\n"
        "ctx = zmq.Context(); pub = ctx.socket(zmq.PUB); pub.linger = 0; pub.connect(sys.argv[1])\n"
        "frames = Encoder('weights-0').encode(m.VersionAnnounce(version=99, location='', nbytes=0, published_at=0.0))\n"
        "end = time.time() + 4\n"
        "while time.time() < end:\n"
        "    pub.send_multipart([m.TOPIC_VERSION, *frames]); time.sleep(0.05)\n"
    )
    try:
        time.sleep(1.0)
        res = subprocess.run(hosts.cmd("b", [sys.executable, "-c", stranger, f"tcp://{HOST_A}:{BASE_PORT}"]),
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, res.stderr
        deadline = time.monotonic() + 10
        log = work / "logs" / "bus.log"
        while "connection_refused" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, f"the bus never logged the refusal:\n{(work / 'bus.out').read_text()}"
            time.sleep(0.2)
        assert "reason=handshake" in log.read_text()
        # Had the stranger's announcement got through, the bus would have cached it and would replay it
        # to this subscriber (on host A, with the key) the moment it subscribes.
        hub_out = f"tcp://{HOST_A}:{BASE_PORT + 1}"
        res = subprocess.run(hosts.cmd("a", [sys.executable, "-c", _CACHED_VERSION, str(key), hub_out]), cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == "nothing", res.stdout
        assert bus.poll() is None
    finally:
        bus.send_signal(signal.SIGTERM)
        try:
            bus.wait(15)
        except subprocess.TimeoutExpired:
            bus.kill()
            bus.wait(10)


# -- the whole run across hosts: per-host renders, trainer ranks on both, real weights to host B --------

RUN_STEPS = 10
"""Updates of the final lineage (a trainer restarted without checkpoints starts over from model.path)."""


def _real_topology(folder: Path, key_rel: str) -> dict:
    return {
        "name": "twohosts-real", "rollout_workers": 2, "train_workers": 2, "staleness_threshold": 2,
        "queue_max_size": 128, "trigger_batch_size": 16, "global_batch_size": 32, "mini_batch_size": 16,
        "learning_rate": 3e-4, "max_steps": RUN_STEPS,
        "logging": {"log_dir": "logs", "log_interval": 2, "save_interval": 0},
        "model": {"path": "models/tiny-guess", "dtype": "float32", "device": "cpu", "threads": 1},
        "agent": {"via": "bus", "framework": "guess", "max_turns": 5, "task_size": 16, "group_size": 8},
        "rollout_engine": {"kind": "torch", "max_batch": 32, "max_len": 256},
        "trainer_engine": {"kind": "torch", "eval_interval": RUN_STEPS, "eval_episodes": 32},
        "endpoints": {"transport": "tcp", "host": HOST_A, "base_port": BASE_PORT + 1000,
                      "curve": {"key": key_rel}, "far_weights": "group"},
        "nodes": {"bus": {}, "agent": {"replicas": 1}, "reward": {"replicas": 1}, "weights": {},
                  "trainer": {"hosts": [HOST_A, HOST_B]}, "rollout": {"hosts": [HOST_A, HOST_B]}},
    }


def _host_folder(work: Path, name: str, keys: Path) -> Path:
    """What a user copies to each host: the topology, the model folder, the CURVE keys (and the venv)."""
    folder = work / name
    folder.mkdir()
    shutil.copytree(keys, folder / "keys")  # copy2 keeps the secret's mode 600
    (folder / "models").mkdir()
    (folder / "models" / "tiny-guess").symlink_to(REPO / "models" / "tiny-guess")
    (folder / ".venv").symlink_to(REPO / ".venv")
    (folder / "topology.yaml").write_text(yaml.safe_dump(_real_topology(folder, "keys/cluster.key_secret"),
                                                         sort_keys=False))
    return folder


def _stop(procs: dict, wait_s: float) -> None:
    """SIGTERM every process still running, then SIGKILL (with all it started) any that outlives ``wait_s``."""
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs.values():
        try:
            p.wait(wait_s)
        except subprocess.TimeoutExpired:
            for pid in _descendants(p.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(10)


def _descendants(pid: int) -> list[int]:
    kids = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def _lines(path: Path, event: str) -> list[dict]:
    """key=value fields of the log lines of ``event`` (``[tag] event k=v ...``)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        words = line.split()
        if len(words) > 1 and words[1] == event:
            out.append(dict(w.split("=", 1) for w in words[2:] if "=" in w))
    return out


def _wait(cond, timeout: float, what: str, show) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{show()}")
        time.sleep(0.3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_ranks_and_weights_span_two_hosts_and_a_killed_host_rejoins(hosts, work):
    from areal_bus.runtime.ledger import audit

    _, key = make_keys(work / "keys")
    a, b = _host_folder(work, "a", work / "keys"), _host_folder(work, "b", work / "keys")
    for folder, host in ((a, HOST_A), (b, HOST_B)):
        res = subprocess.run([str(venv_bin() / "areal-bus"), "render", "topology.yaml", "--host", host, "-o",
                              "supervisord.conf"], cwd=folder, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, folder: Path) -> None:
        out = open(work / f"supervisord-{name}-{len(procs)}.out", "wb")
        procs[name] = subprocess.Popen(hosts.cmd(name, [str(venv_bin() / "supervisord"), "-c",
                                                        str(folder / "supervisord.conf")]),
                                       cwd=folder, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env={k: v for k, v in os.environ.items() if k != "AREAL_BUS_RESUME"})

    def show() -> str:
        logs = [a / "logs" / n for n in ("train.log", "weights.log", "rollout.log")] + \
            [b / "logs" / n for n in ("rollout.log", "weights.log")] + \
            sorted((a / "logs" / "supervisor").glob("trainer-*.log")) + \
            sorted((b / "logs" / "supervisor").glob("*.log"))
        return "\n".join(f"--- {p}\n{p.read_text()[-1500:]}" for p in logs if p.exists())

    def steps() -> list[dict]:
        path = a / "logs" / "train_steps.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    try:
        start("a", a)
        start("b", b)
        _wait(lambda: len([s for s in steps() if s.get("step", -1) >= 3]) >= 1, 150, "3 updates", show)
        # Host B dies: its supervisord and every process under it, at once (kill -9).
        for pid in _descendants(procs["b"].pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        procs["b"].wait(10)
        # Rank 0 on A fails its next collective with rank 1 gone, and A's supervisord restarts it.
        trainer_out = a / "logs" / "supervisor" / "trainer-0.log"
        _wait(lambda: "cannot go on" in (trainer_out.read_text() if trainer_out.exists() else ""), 90,
              "rank 0 to give up its broken process group", show)
        start("b", b)  # the host comes back: its supervisord starts its programs again
        try:
            rc = procs["a"].wait(150)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not finish after host B came back\n{show()}") from None
        assert rc == 0, show()
        assert procs["b"].wait(30) == 0, show()
        result = audit(a / "logs")
        assert result["finished"] and result["lost"] == 0 and result["duplicated"] == 0, result
        # Every version B's far worker served was the trainer's, byte for byte (sha256).
        sent: dict[str, set] = {}
        for x in _lines(a / "logs" / "weights.log", "relay_sent"):
            sent.setdefault(x["version"], set()).add(x["sha256"])
        got = _lines(b / "logs" / "rollout.log", "weights_received")
        assert len({x["version"] for x in got}) >= 3, show()
        for x in got:
            assert x["sha256"] in sent.get(x["version"], ()), (x, sent)
        # They went over the weight group (endpoints.far_weights: group, gloo here): a generation formed
        # at the start, was lost when host B died, and a new one formed when it came back.
        formed = {int(x["gen"]) for x in _lines(a / "logs" / "weights.log", "group_formed")}
        lost = _lines(a / "logs" / "weights.log", "group_lost")
        assert len(formed) >= 2 and lost, show()
        assert {int(x["gen"]) for x in _lines(b / "logs" / "weights.log", "received")} & formed, show()
        # ...and tagged its tokens with those versions.
        tagged = {int(v) for v in re.findall(r"\[rollout\] step=\S+ .*?version=(\d+)",
                                             (b / "logs" / "rollout.log").read_text())}
        assert tagged and max(tagged) >= 1, tagged
        # It learns: the held-out reward of the final lineage goes up from its start.
        evals = [s for s in steps() if "eval_reward" in s]
        print("evals", evals)
        assert evals[-1]["eval_reward"] > evals[-2]["eval_reward"], evals
    finally:
        _stop(procs, 20)
