"""A rollout worker restarted within the liveness window (same name, new incarnation) loses the gateway
nothing: the requests the old process held are sent again at once, not after the request deadline.

Real processes: a bus, a gateway and one rollout worker (sim engine, slow enough that a request is in
flight when the worker is killed). The worker is killed with SIGKILL and its replacement, already
imported and waiting, starts the same ``areal-bus node rollout --replica 0`` at once, so the gateway
sees a restart (a heartbeat of a new incarnation), never a death.

    .venv/bin/python -m pytest tests/test_gateway_restart.py -q
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml
import zmq

from areal_bus.wire import messages as m
from areal_bus.wire.codec import DecodeError, decode

REPO = Path(__file__).resolve().parent.parent
ADMIN = "restart-test-admin-token"

WAITING = """
import sys, time
from pathlib import Path
from areal_bus.launch import cli
import nodes.rollout.node  # the slow imports happen now, before the old worker is killed
flag = Path(sys.argv[1])
Path(sys.argv[1] + ".ready").touch()
while not flag.exists():
    time.sleep(0.005)
sys.exit(cli.main(["node", "rollout", "--topology", sys.argv[2], "--replica", "0"]))
"""
"""The replacement worker: everything imported, it runs the node command the moment ``flag`` exists."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(port: int, method: str, path: str, key: str, body: dict | None = None, timeout: float = 30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=json.dumps(body or {}),
                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class _Run:
    """bus, gateway and rollout-0 as child processes in a temp dir (short ipc paths), and a SUB on the
    hub that keeps each node's latest heartbeat."""

    def __init__(self, port: int):
        self.dir = Path(tempfile.mkdtemp(prefix="abgr-", dir="/tmp"))
        self.topo = self.dir / "topology.yaml"
        self.topo.write_text(yaml.safe_dump({
            "name": "gwrestart", "rollout_workers": 1, "staleness_threshold": 2, "queue_max_size": 64,
            "trigger_batch_size": 4, "global_batch_size": 8, "mini_batch_size": 4, "max_steps": 1000,
            "logging": {"log_dir": "logs", "log_interval": 50, "save_interval": 0},
            "model": {"path": str(REPO / "models" / "tiny-guess")},  # the gateway's tokenizer
            # 300 tokens at 10 ms a step: a request is in flight for about three seconds.
            "rollout_engine": {"kind": "sim", "max_batch": 8, "decode_step_s": 0.01, "decode_step_per_seq_s": 0.0,
                               "swap_s": 0.001, "output_len": {"dist": "fixed", "min": 300, "max": 300}},
            "trainer_engine": {"kind": "sim", "time_per_token_s": 0.00001, "update_overhead_s": 0.05},
            "endpoints": {"transport": "ipc", "ipc_dir": str(self.dir / "ipc")},
            "nodes": {"bus": {}, "trainer": {}, "gateway": {"config": {"port": port, "admin_token": ADMIN}}},
        }, sort_keys=False))
        self.procs: dict[str, subprocess.Popen] = {}
        self.ctx = zmq.Context()
        self.ctx.linger = 0
        self.beats: dict[str, m.Heartbeat] = {}
        self.sub = None

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.dir / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(argv, cwd=self.dir, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs[name] = proc
        return proc

    def node(self, kind: str) -> subprocess.Popen:
        return self.spawn(kind, [sys.executable, "-m", "areal_bus.launch.cli", "node", kind, "--topology", str(self.topo),
                                 "--replica", "0"])

    def start(self) -> None:
        for kind in ("bus", "gateway", "rollout"):
            self.node(kind)
        from areal_bus.config.topology import load_topology

        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, m.TOPIC_HEARTBEAT)
        self.sub.connect(load_topology(self.topo).endpoint("hub_out", 0, self.dir))

    def poll(self) -> None:
        while self.sub.poll(20, zmq.POLLIN):
            try:
                _, hb = decode(self.sub.recv_multipart(zmq.NOBLOCK)[1:])
            except DecodeError:
                continue
            if isinstance(hb, m.Heartbeat):
                self.beats[hb.node_id] = hb

    def beat(self, node: str) -> m.Heartbeat | None:
        self.poll()
        return self.beats.get(node)

    def log(self, node: str) -> str:
        path = self.dir / "logs" / f"{node.split('-')[0]}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self.sub is not None:
            self.sub.close(0)
        self.ctx.term()
        if not os.environ.get("KEEP_SYSTEM_DIR"):
            shutil.rmtree(self.dir, ignore_errors=True)


def _ask(port: int, key: str, result: dict) -> None:
    try:
        result["reply"] = _call(port, "POST", "/v1/chat/completions", key, {
            "model": "policy", "messages": [{"role": "user", "content": "Guess my number (1-16)."}],
            "max_tokens": 1000}, timeout=40)
    except Exception as exc:  # the client's own timeout: the test reports it
        result["error"] = exc
    result["t"] = time.monotonic()


def _kill_and_restart(run: _Run, port: int, key: str, attempt: int) -> tuple[dict, str, float]:
    """A request in flight on rollout-0, rollout-0 killed and its waiting replacement started at once:
    (the client's result, what the gateway logged meanwhile, when the kill was)."""
    flag = run.dir / f"go-{attempt}"
    run.spawn(f"rollout-{attempt}", [sys.executable, "-c", WAITING, str(flag), str(run.topo)])
    _wait(lambda: Path(f"{flag}.ready").exists(), 60, "the replacement to be imported")
    logged = len(run.log("gateway-0"))
    old = run.procs.pop("rollout")
    result: dict = {}
    client = threading.Thread(target=_ask, args=(port, key, result), daemon=True)
    client.start()
    _wait(lambda: (b := run.beat("rollout-0")) is not None and b.inflight, 30, "rollout-0 to hold the request")
    first = run.beats["rollout-0"].incarnation
    time.sleep(0.5)  # well into its ~3 s generation
    run.beats.pop("rollout-0")
    _wait(lambda: run.beat("rollout-0"), 5, "a fresh heartbeat of rollout-0")  # its liveness window starts now
    os.kill(old.pid, signal.SIGKILL)
    flag.touch()
    t_kill = time.monotonic()
    old.wait(timeout=10)
    run.procs["rollout"] = run.procs.pop(f"rollout-{attempt}")
    _wait(lambda: (b := run.beat("rollout-0")) is not None and b.incarnation != first, 20, "the replacement's heartbeat")
    client.join(timeout=45)
    return result, run.log("gateway-0")[logged:], t_kill


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_request_held_by_a_worker_restarted_under_its_name_is_sent_again_at_once():
    port = _free_port()
    run = _Run(port)
    try:
        run.start()
        _wait(lambda: run.beat("rollout-0") and run.beat("gateway-0"), 60, "heartbeats of the gateway and rollout-0")
        _, body = _wait(lambda: (lambda r: r if r[0] == 201 else None)(_call(port, "POST", "/rl/sessions", ADMIN)),
                        60, "the gateway to open a session")
        key = json.loads(body)["api_key"]
        # A replacement that took longer than the liveness window (a loaded machine) is a death, which the
        # gateway has always handled: only a restart seen as a restart tells, so try up to three times.
        for attempt in range(3):
            result, logged, t_kill = _kill_and_restart(run, port, key, attempt)
            if "peer_dead" not in logged:
                break
        assert "peer_restarted" in logged and "peer_dead" not in logged, \
            f"no restart within the liveness window in 3 tries: {logged}"
        assert "reply" in result, f"the request never completed: {result.get('error')!r}"
        status, body = result["reply"]
        assert status == 200, body[:300]
        took = result["t"] - t_kill
        # ~0.5 s to see the new heartbeat and a fresh 3 s generation; the request deadline is 120 s.
        assert took < 10, f"the request took {took:.1f} s after the restart"
        print(f"\nrequest completed {took:.1f} s after its worker was killed and restarted (attempt {attempt + 1})")
    finally:
        run.stop()
