"""Scaling while a run goes on: `supervisorctl update` after a rescale starts only the added rollout
workers and stops only the removed ones, and a removed worker leaves cleanly (it takes no more work,
finishes what it runs, and says it left, so what it still held is reissued at once).

First the pieces, with real sockets: the peer table takes a worker that said it left for dead at once
and ignores its late heartbeats; the gateway's backend sends a leaving worker nothing new and moves its
other requests at once. Then the whole thing under a real supervisord: rollout 2 -> 4 -> 1 during a
run, a client driving the gateway throughout (no 5xx), training never stalling, the workers that stay
keeping their pid, and the ledger audit finding nothing lost or trained twice.

Run: .venv/bin/python -m pytest tests/test_scaling.py      (the system test is marked slow, ~60 s)
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import xmlrpc.client

import yaml
import zmq
from supervisor.xmlrpc import SupervisorTransport

from areal_bus.wire import messages as m
from areal_bus.wire.codec import Encoder, decode
from areal_bus.constants import HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS, ROLLOUT_DRAIN_S
from areal_bus.runtime.ledger import audit
from areal_bus.runtime.metrics import Metrics
from areal_bus.runtime.node import LEAVING, PeerTable
from areal_bus.launch.render import STOP_WAIT_S
from areal_bus.config.topology import NODE_KINDS, load_topology
from nodes.gateway.backend import SamplingParams
from nodes.gateway.bus_backend import REQUEST_DEADLINE_S, BusBackend
from tests.test_system import ENV, REPO, VENV_BIN, small_topology, wait_until

LIVENESS_S = HEARTBEAT_INTERVAL_S * HEARTBEAT_LIVENESS


# -- the peer table -------------------------------------------------------------------------------

def _hb(node_id: str, incarnation: str) -> m.Heartbeat:
    return m.Heartbeat(node_id=node_id, kind="rollout", incarnation=incarnation, pid=1, t=0.0, version=0,
                       counters={}, gauges={}, hists={})


def test_a_peer_that_left_is_dead_at_once_and_its_late_heartbeats_do_not_revive_it():
    table = PeerTable()
    table.update(_hb("rollout-1", "aaa"), now=0.0)
    assert table.leave("rollout-1", "bbb") is None  # another incarnation's notice: not this one's
    assert table.leave("rollout-1", "aaa").node_id == "rollout-1"
    assert table.alive("rollout") == []
    assert table.update(_hb("rollout-1", "aaa"), now=0.1) == "stale"  # sent before the notice, came after
    assert table.alive("rollout") == [] and table.expire(now=100.0) == []  # reported once, as left
    assert table.update(_hb("rollout-1", "ccc"), now=0.2) == "restarted"  # scaled up again: a new process
    assert [p.node_id for p in table.alive("rollout")] == ["rollout-1"]


# -- the gateway's backend and a leaving worker -------------------------------------------------------

class _HoldingWorker(threading.Thread):
    """A rollout worker's gateway side that holds every request until told to answer or to leave."""

    def __init__(self, ctx, endpoint: str, node_id: str):
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.identity = node_id.encode()
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self.node_id, self.enc = node_id, Encoder(node_id)
        self.held: list[m.GenerateRequest] = []
        self.todo: collections.deque = collections.deque()  # ("answer", rid) / ("leave", held ids)
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            if self.sock.poll(10):
                self.held.append(decode(self.sock.recv_multipart())[1])
            while self.todo:
                what, arg = self.todo.popleft()
                if what == "leave":
                    self.sock.send_multipart(self.enc.encode(m.Event(name=LEAVING, node_id=self.node_id,
                                                                     fields={"held": arg})))
                    continue
                req = next(r for r in self.held if r.request_id == arg)
                ids = np.array([7], np.int32)
                self.sock.send_multipart(self.enc.encode(m.Completion(
                    request_id=req.request_id, episode_id=req.episode_id, ticket=0, worker=self.node_id,
                    output_ids=ids, logprobs=np.zeros(1, np.float32), versions=np.zeros(1, np.int32))))
        self.sock.close(0)


@pytest.mark.timeout(30)
def test_a_leaving_worker_gets_nothing_new_and_its_unfinished_requests_move_at_once(ctx, endpoint):
    ep = endpoint("gwork")
    backend = BusBackend(ctx, ep, Encoder("gateway-0"), Metrics())
    leaver, stayer = _HoldingWorker(ctx, ep, "rollout-0"), _HoldingWorker(ctx, ep, "rollout-1")
    params = SamplingParams(max_tokens=4, temperature=0.0)

    async def main():
        leaver.start(), stayer.start()
        await asyncio.sleep(0.3)  # the DEALERs' connects complete
        backend.set_live({"rollout-0"})  # only the leaver, so both requests go to it
        first = asyncio.create_task(backend.generate("s1", np.arange(3, dtype=np.int32), params))
        second = asyncio.create_task(backend.generate("s2", np.arange(3, dtype=np.int32), params))
        await asyncio.sleep(0.3)
        backend.set_live({"rollout-0", "rollout-1"})
        assert len(leaver.held) == 2 and stayer.held == []
        keep = leaver.held[0].request_id
        t0 = time.monotonic()
        leaver.todo.append(("leave", [keep]))  # it will finish the first, not the second
        await asyncio.sleep(0.3)
        assert [r.request_id for r in stayer.held] == [leaver.held[1].request_id], "the unfinished one moved"
        third = asyncio.create_task(backend.generate("s1", np.arange(3, dtype=np.int32), params))
        await asyncio.sleep(0.3)
        assert len(leaver.held) == 2 and len(stayer.held) == 2, "a leaving worker takes no new request"
        leaver.todo.append(("answer", keep))
        for r in list(stayer.held):
            stayer.todo.append(("answer", r.request_id))
        done = await asyncio.wait_for(asyncio.gather(first, second, third), 5)
        return done, time.monotonic() - t0

    try:
        (a, b, c), took = asyncio.run(main())
    finally:
        for w in (leaver, stayer):
            w.stop.set()
            w.join(2)
        backend.close()
    assert (a.worker, b.worker, c.worker) == ("rollout-0", "rollout-1", "rollout-1")
    assert took < LIVENESS_S < REQUEST_DEADLINE_S  # moved on the notice, not after any timeout


@pytest.mark.timeout(30)
def test_a_worker_known_before_its_dealer_connects_gets_the_request_once_it_does(ctx, endpoint):
    # A worker's heartbeat can reach the gateway before its DEALER has (re)connected: the gateway just
    # started, or the worker just joined. That is no reason for a 503.
    ep = endpoint("gwork")
    backend = BusBackend(ctx, ep, Encoder("gateway-0"), Metrics())
    workers = []

    async def main():
        backend.set_live({"rollout-0"})
        task = asyncio.create_task(backend.generate("s", np.arange(3, dtype=np.int32),
                                                    SamplingParams(max_tokens=4, temperature=0.0)))
        await asyncio.sleep(0.3)
        assert not task.done()
        workers.append(_HoldingWorker(ctx, ep, "rollout-0"))
        workers[0].start()
        while not workers[0].held:
            await asyncio.sleep(0.02)
        workers[0].todo.append(("answer", workers[0].held[0].request_id))
        return await asyncio.wait_for(task, 5)

    try:
        comp = asyncio.run(main())
    finally:
        for w in workers:
            w.stop.set()
            w.join(2)
        backend.close()
    assert comp.worker == "rollout-0"


# -- the whole system under supervisord ------------------------------------------------------------

MAX_STEPS = 260
"""Updates in the run. At least one update_overhead_s (0.05 s) each, so the run lasts 13 s or more
whatever the machine: the rescales (at step 15, then once the new workers are serving) are done well
before it ends; on a loaded 2-core box it is about a minute."""

GAP_FLOOR_S = 1.5
"""The least the bound on a gap between two updates while scaling may be: three quarters of the
liveness timeout (2 s), a tenth of the 15.3 s stall the restart of every worker cost before. Above it
the bound is GAP_FACTOR times the longest gap of the same run outside the scaling (before the first
rescale, past the start-up updates, and after the last one has settled): a shared 2-core box stalls
every process now and then, and such a stall is no scaling stall."""

GAP_FACTOR = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:  # not listening yet
        return False
    finally:
        conn.close()


class _Client(threading.Thread):
    """Drives the gateway the way the README's example does, over plain HTTP (no SDK retries that
    would hide a 5xx): open a session with the admin token, one chat completion (every other one
    streamed), a reward, end. Counts every status, and every error event inside a stream."""

    ADMIN = "scaling-test-admin-token"

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port = port
        self.statuses: collections.Counter = collections.Counter()
        self.stream_errors: list[str] = []
        self.completions = 0
        self.stop = threading.Event()
        self.failure: BaseException | None = None

    def _call(self, method: str, path: str, key: str, body: dict | None = None) -> tuple[int, bytes, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, body=json.dumps(body or {}),
                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            self.statuses[resp.status] += 1
            return resp.status, data, dict(resp.getheaders())
        finally:
            conn.close()

    def _episode(self, n: int) -> None:
        status, data, headers = self._call("POST", "/rl/sessions", self.ADMIN)
        if status == 429:  # rollout as far ahead as the staleness bound allows: come back shortly
            time.sleep(min(0.2, float(headers.get("retry-after-ms", 200)) / 1000))
            return
        if status != 201:
            return
        s = json.loads(data)
        stream = n % 2 == 1
        status, data, _ = self._call("POST", "/v1/chat/completions", s["api_key"], {
            "model": "policy", "messages": [{"role": "user", "content": "Guess my number (1-16)."}],
            "max_tokens": 24, "stream": stream})
        if status == 200:
            self.completions += 1
            if stream:
                for line in data.decode(errors="replace").splitlines():
                    if line.startswith("data: {") and '"error"' in line:
                        self.stream_errors.append(line[:300])
        self._call("POST", f"/rl/sessions/{s['session_id']}/reward", self.ADMIN, {"reward": 1.0})
        self._call("POST", f"/rl/sessions/{s['session_id']}/end", self.ADMIN)

    def run(self):
        n = 0
        try:
            while not self.stop.is_set():
                self._episode(n)
                n += 1
        except BaseException as exc:  # reported by the test, which reads it after join
            self.failure = exc

    @property
    def server_errors(self) -> int:
        return sum(c for s, c in self.statuses.items() if s >= 500) + len(self.stream_errors)


class _Run:
    """One supervisord-run system in a short temp folder (ipc paths must stay short)."""

    def __init__(self, data: dict):
        self.dir = Path(tempfile.mkdtemp(prefix="ab-scale-", dir="/tmp"))
        self.topo_path = self.dir / "topology.yaml"
        self.conf = self.dir / "supervisord.conf"
        self.proc: subprocess.Popen | None = None
        self.write(small_topology(self.dir / "ipc", **data))

    def write(self, data: dict) -> None:
        self.data = data
        self.topo_path.write_text(yaml.safe_dump(data, sort_keys=False))
        self.topo = load_topology(self.topo_path)
        res = subprocess.run([str(VENV_BIN / "areal-bus"), "render", str(self.topo_path), "-o", str(self.conf)],
                             cwd=self.dir, env=ENV, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr

    def ctl(self, *args) -> str:
        res = subprocess.run([str(VENV_BIN / "supervisorctl"), "-c", str(self.conf), *args], cwd=self.dir, env=ENV,
                             capture_output=True, text=True, timeout=60)
        return res.stdout + res.stderr

    def start(self) -> None:
        self.proc = subprocess.Popen([str(VENV_BIN / "supervisord"), "-c", str(self.conf)], cwd=self.dir, env=ENV,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def status(self) -> dict[str, tuple[str, int | None]]:
        """{process: (state, pid)}, asked of supervisord over its socket (what supervisorctl status does,
        without a Python start per call: this polls while the test measures the trainer's pace)."""
        rpc = xmlrpc.client.ServerProxy("http://localhost", transport=SupervisorTransport(
            None, None, f"unix://{self.dir}/logs/supervisor.sock"))
        try:
            infos = rpc.supervisor.getAllProcessInfo()
        except OSError:  # not listening yet
            return {}
        return {i["name"]: (i["statename"], i["pid"] or None) for i in infos}

    def all_running(self) -> dict | None:
        """The nodes' status once every node the topology asks for, and no other, is RUNNING."""
        assert self.proc.poll() is None, f"supervisord exited {self.proc.returncode}:\n{self.tail('supervisord.log')}"
        st = {k: v for k, v in self.status().items() if k != "run_end"}  # the listener is no node
        want = {f"{k}-{i}" for k in NODE_KINDS for i in range(self.topo.replicas(k))}
        return st if set(st) == want and all(s == "RUNNING" for s, _ in st.values()) else None

    @property
    def logs(self) -> Path:
        latest = self.dir / "logs" / "latest"  # a folder per run, where the logs have one
        return latest if latest.is_dir() else self.dir / "logs"

    def lines(self, name: str) -> list[str]:
        for folder in (self.logs, self.dir / "logs"):
            if (folder / name).exists():
                return (folder / name).read_text().splitlines()
        return []

    def tail(self, name: str, n: int = 40) -> str:
        return "\n".join(self.lines(name)[-n:])

    def t_ends(self) -> list[float]:
        return [json.loads(line)["t_end"] for line in self.lines("train_steps.jsonl")]

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if os.environ.get("KEEP_SYSTEM_DIR"):
            print(f"kept {self.dir}")
            return
        shutil.rmtree(self.dir, ignore_errors=True)


def _rescale(run: _Run, workers: int) -> tuple[str, float]:
    run.write({**run.data, "rollout_workers": workers})
    t = time.time()
    return run.ctl("update"), t


def _gaps(t_ends: list[float], t0: float, t1: float) -> tuple[float, float]:
    """(the longest time between two consecutive updates the later of which ended within [t0, t1],
    so a stall that starts with the rescale counts; the longest of the others, past the first 5)."""
    gaps = [(t_ends[i] - t_ends[i - 1], t0 <= t_ends[i] <= t1) for i in range(6, len(t_ends))]
    return max(g for g, inside in gaps if inside), max(g for g, inside in gaps if not inside)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rollout_scales_2_to_4_to_1_mid_run_restarting_nobody_and_losing_nothing():
    port = _free_port()
    run = _Run({
        "max_steps": MAX_STEPS, "rollout_workers": 2,
        "model": {"path": str(REPO / "models" / "tiny-guess")},  # the gateway's tokenizer
        "logging": {"log_dir": "logs", "log_interval": 10, "save_interval": 0},
        "rollout_engine": {"kind": "sim", "max_batch": 8, "decode_step_s": 0.004, "decode_step_per_seq_s": 0.00001,
                           "swap_s": 0.001, "output_len": {"dist": "uniform", "min": 8, "max": 32}},
        "trainer_engine": {"kind": "sim", "time_per_token_s": 0.00001, "update_overhead_s": 0.05},
        "nodes": {"bus": {}, "agent": {"replicas": 1}, "reward": {"replicas": 1}, "trainer": {}, "weights": {},
                  "gateway": {"config": {"port": port, "admin_token": _Client.ADMIN}}},
    })
    client = _Client(port)
    try:
        run.start()
        wait_until(run.all_running, 60, "every process RUNNING")
        wait_until(lambda: _healthy(port), 60, "the gateway to listen")
        client.start()
        wait_until(lambda: len(run.t_ends()) >= 15 and client.completions >= 3, 60,
                   "15 updates and the client's first completions")
        before = run.all_running()

        # 2 -> 4: two programs added, nothing else touched.
        out, t_up = _rescale(run, 4)
        assert sorted(out.splitlines()) == ["rollout-2: added process group", "rollout-3: added process group"], out
        st = wait_until(run.all_running, 60, "rollout-2 and rollout-3 RUNNING")
        assert {k: pid for k, (_, pid) in st.items() if k in before} == {k: pid for k, (_, pid) in before.items()}, \
            "a process that was running before the rescale has a new pid"
        wait_until(lambda: {"rollout-2", "rollout-3"} <= {line.rsplit("node=", 1)[-1].split()[0]
                                                          for line in run.lines("rollout.log") if "node=" in line
                                                          and line.startswith("[rollout] step=")},
                   60, "the new workers to log generated samples")
        steps_at_4 = len(run.t_ends())
        wait_until(lambda: len(run.t_ends()) >= steps_at_4 + 10, 60, "10 updates with 4 workers")

        # 4 -> 1: three programs removed (each leaves cleanly), rollout-0 and everything else untouched.
        out, t_down = _rescale(run, 1)
        removed = [f"rollout-{i}" for i in (1, 2, 3)]
        assert sorted(out.splitlines()) == sorted([f"{w}: stopped" for w in removed]
                                                  + [f"{w}: removed process group" for w in removed]), out
        st = wait_until(run.all_running, 60, "the system with one rollout worker")
        assert {k: pid for k, (_, pid) in st.items()} == {k: pid for k, (_, pid) in before.items() if k in st}
        steps_at_1 = len(run.t_ends())
        wait_until(lambda: len(run.t_ends()) >= steps_at_1 + 10, 60, "10 updates with 1 worker")
        t_after = time.time()
        client.stop.set()
        client.join(40)

        try:
            rc = run.proc.wait(120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not end by itself:\n{run.tail('train.log')}") from None
        assert rc == 0, run.tail("supervisord.log")

        gap, steady = _gaps(run.t_ends(), t_up, t_after)
        bound = max(GAP_FLOOR_S, GAP_FACTOR * steady)
        sup_log = run.tail("supervisord.log", 400)
        print(f"\nscaling 2 -> 4 -> 1: {client.server_errors} gateway 5xx of {sum(client.statuses.values())} "
              f"requests ({dict(client.statuses)}), {client.completions} completions; longest gap between updates "
              f"while scaling {gap:.2f} s (bound {bound:.2f} s; longest outside it {steady:.2f} s)")
        assert client.failure is None, repr(client.failure)
        assert client.server_errors == 0, (dict(client.statuses), client.stream_errors[:3])
        assert gap <= bound, f"training stalled {gap:.2f} s while scaling (bound {bound:.2f} s)"
        for w in removed:  # each exited by itself on SIGTERM, within stopwaitsecs
            assert f"stopped: {w} (exit status 0)" in sup_log, sup_log
        assert "SIGKILL" not in sup_log, f"a node outlived stopwaitsecs={STOP_WAIT_S}:\n{sup_log}"
        leaving = [line for line in run.lines("rollout.log") if line.startswith("[rollout] leaving ")]
        assert len(leaving) >= 3, run.tail("rollout.log")
        drains = [int(line.split("drain_ms=")[1].split()[0]) for line in leaving]
        assert max(drains) <= ROLLOUT_DRAIN_S * 1000 + 500, leaving

        result = audit(run.logs)
        assert result["finished"], result
        assert result["lost"] == 0 and result["duplicated"] == 0 and result["unknown"] == 0, result
        assert result["trained"] > 0
    finally:
        client.stop.set()
        run.cleanup()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_agents_scaled_1_to_2_to_1_mid_run_share_the_admission_batch_anew_restarting_nobody():
    """Before: a running agent kept the share it computed at its start, so after 1 -> 2 the two admitted
    1.5 batches' worth between them (agent-0 the whole, agent-1 half), and after 2 -> 1 agent-0 only
    half, for the rest of the run."""
    run = _Run({"max_steps": MAX_STEPS, "rollout_workers": 2})
    share = lambda: [line.split("share=")[1].split()[0] for line in run.lines("agent.log")  # noqa: E731
                     if "admission_sources" in line and "node=agent-0" in line]
    try:
        run.start()
        before = wait_until(run.all_running, 60, "every process RUNNING")
        wait_until(lambda: len(run.t_ends()) >= 10, 60, "10 updates")
        trigger = run.topo.trigger_batch_size

        out = _rescale_agents(run, 2)
        assert out.strip() == "agent-1: added process group", out
        st = wait_until(run.all_running, 60, "agent-1 RUNNING")
        assert {k: pid for k, (_, pid) in st.items() if k in before} == {k: pid for k, (_, pid) in before.items()}
        wait_until(lambda: share() == [str(trigger // 2)], 30, "agent-0 to share the batch with agent-1")
        steps = len(run.t_ends())
        wait_until(lambda: len(run.t_ends()) >= steps + 10, 60, "10 updates with 2 agents")
        assert any("node=agent-1" in line and line.startswith("[agent] node_start") for line in run.lines("agent.log"))

        out = _rescale_agents(run, 1)
        assert sorted(out.splitlines()) == ["agent-1: removed process group", "agent-1: stopped"], out
        wait_until(lambda: share() == [str(trigger // 2), str(trigger)], 30, "agent-0 to take the whole batch again")
        steps = len(run.t_ends())
        wait_until(lambda: len(run.t_ends()) >= steps + 10, 60, "10 updates with 1 agent again")
        assert run.all_running() and run.all_running()["agent-0"][1] == before["agent-0"][1]
        try:
            assert run.proc.wait(120) == 0, run.tail("supervisord.log")
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not end by itself:\n{run.tail('train.log')}") from None
        result = audit(run.logs)
        assert result["finished"] and result["lost"] == 0 and result["duplicated"] == 0, result
    finally:
        run.cleanup()


def _rescale_agents(run: _Run, agents: int) -> str:
    run.write({**run.data, "nodes": {**run.data["nodes"], "agent": {"replicas": agents}}})
    return run.ctl("update")
