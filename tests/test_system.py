"""System tests: whole areal_bus runs under a real supervisord, driven as a user drives them.

Each system lives in a short temp dir under /tmp (ipc socket paths must stay under ~107 bytes) with
its own small topology (simulated engines, tiny timings), rendered with `areal-bus render` and started
with `supervisord -c supervisord.conf`. The first test runs to max_steps and checks the run ends by
itself and what it leaves in the logs. The others share one long-running system (a module fixture,
started once to keep the suite fast on 2 cores) and, in file order: attach the probe, scale the rollout
workers, kill -9 a worker, and finally shut the system down and check it stopped cleanly.

Run: .venv/bin/pytest tests/test_system.py      (about a minute; all tests are marked slow)
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

from areal_bus.launch.render import STOP_WAIT_S
from areal_bus.config.topology import NODE_KINDS, load_topology

REPO = Path(__file__).resolve().parents[1]


def _venv_bin() -> Path:
    here = Path(sys.executable).parent  # the interpreter running pytest, normally .venv/bin/python
    return here if (here / "areal-bus").exists() else REPO / ".venv" / "bin"


VENV_BIN = _venv_bin()

# The rendered conf puts %(here)s/.venv/bin first on the nodes' PATH, and a temp dir has no .venv.
# Rather than symlinking one in (which would make the temp dir pose as a checkout, and breaks if the
# venv lives elsewhere), we prepend the venv's bin dir to the PATH supervisord itself gets: the conf
# appends %(ENV_PATH)s, so `areal-bus` resolves to this venv for every node and the run_end listener,
# whatever shell PATH pytest was started from; supervisorctl and the probe run from the same env.
ENV = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}

TS = r"ts=\d\d:\d\d:\d\d\.\d{3}"
TRAIN_STEP = re.compile(rf"^\[train\] step=(\d+) updated=(\d+) loss=(\S+) .*{TS}$")
THROUGHPUT = re.compile(rf"^\[train\] throughput samples_per_second=(\S+) .*{TS}$")
ROLLOUT_STEP = re.compile(rf"^\[rollout\] step=(\d+) generated=(\d+) tokens=(\d+) .*node=(\S+) {TS}$")
LINE_END = re.compile(rf" {TS}$")
STATUS = re.compile(r"^(\S+)\s+([A-Z]+)\s*(?:pid (\d+))?")

SHUTDOWN_S = 30
"""How long a clean shutdown may take: supervisord stops the priority levels one after another, each
node within a poll interval plus LINGER_MS; 30 s leaves room for a loaded 2-core box."""


def small_topology(ipc_dir: Path, **overrides) -> dict:
    """topology/default.yaml shrunk so a run is seconds long: tiny batches, short outputs, fast steps."""
    data = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    data.update(
        name="systest", rollout_workers=2, staleness_threshold=2, queue_max_size=64,
        trigger_batch_size=4, global_batch_size=8, mini_batch_size=4, max_steps=8,
        logging={"log_dir": "logs", "log_interval": 2, "save_interval": 0},
        agent={"framework": "sim", "max_turns": 1, "reward_source": "rule", "prompt_len": 16},
        rollout_engine={"kind": "sim", "max_batch": 8, "decode_step_s": 0.001, "decode_step_per_seq_s": 0.00001,
                        "swap_s": 0.001, "output_len": {"dist": "uniform", "min": 8, "max": 32}},
        trainer_engine={"kind": "sim", "time_per_token_s": 0.00001, "update_overhead_s": 0.01},
        # Explicit, so the probe (run from any cwd) finds the same sockets as the nodes.
        endpoints={"transport": "ipc", "ipc_dir": str(ipc_dir)},
        # The bus system alone: the default's gateway (and its HTTP agent) need the real model.
        nodes={"bus": {}, "agent": {"replicas": 1}, "reward": {"replicas": 1}, "trainer": {}, "weights": {}},
    )
    data.update(overrides)
    return data


def wait_until(pred, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class System:
    """One supervisord-run system in its own temp dir."""

    def __init__(self, topology: dict):
        self.dir = Path(tempfile.mkdtemp(prefix="ab-", dir="/tmp"))
        self.topo_path = self.dir / "topology.yaml"
        self.conf = self.dir / "supervisord.conf"
        self.logs = self.dir / "logs"
        self.proc: subprocess.Popen | None = None
        self.write_topology(small_topology(self.dir / "ipc", **topology))
        longest = max(len(self.topo.endpoint(ch, 9)) for ch in ("hub_in", "hub_out", "work", "samples", "train"))
        assert longest < 100, f"ipc path too long for the kernel: {longest} bytes"

    # -- topology -------------------------------------------------------------------------------
    def write_topology(self, data: dict) -> None:
        self.data = data
        self.topo_path.write_text(yaml.safe_dump(data, sort_keys=False))
        self.topo = load_topology(self.topo_path)

    def render(self) -> None:
        self.cli("render", str(self.topo_path), "-o", str(self.conf))

    # -- processes ------------------------------------------------------------------------------
    def cli(self, *args, timeout: float = 30) -> subprocess.CompletedProcess:
        res = subprocess.run([str(VENV_BIN / "areal-bus"), *args], cwd=self.dir, env=ENV, capture_output=True,
                             text=True, timeout=timeout)
        assert res.returncode == 0, f"areal-bus {' '.join(args)} exited {res.returncode}:\n{res.stderr}"
        return res

    def ctl(self, *args, timeout: float = 30) -> str:
        # Exit status is non-zero whenever some process is not RUNNING; callers read the output.
        res = subprocess.run([str(VENV_BIN / "supervisorctl"), "-c", str(self.conf), *args], cwd=self.dir,
                             env=ENV, capture_output=True, text=True, timeout=timeout)
        return res.stdout + res.stderr

    def start(self) -> None:
        self.render()
        out = open(self.dir / "supervisord.out", "wb")
        self.proc = subprocess.Popen([str(VENV_BIN / "supervisord"), "-c", str(self.conf)], cwd=self.dir, env=ENV,
                                     stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        out.close()

    def status(self) -> dict[str, tuple[str, int | None]]:
        """supervisorctl status as {process: (state, pid)}, e.g. {'rollout-0': ('RUNNING', 4242)} (a program
        per replica: supervisorctl names each by itself; the run_end listener is no node)."""
        out = {}
        for line in self.ctl("status").splitlines():
            m = STATUS.match(line)
            if m and m.group(1) != "run_end":
                out[m.group(1)] = (m.group(2), int(m.group(3)) if m.group(3) else None)
        return out

    def pid(self, process: str) -> int:
        return int(self.ctl("pid", process).strip())

    def all_running(self) -> dict | None:
        """The status once every node process the current topology asks for is RUNNING, else None."""
        self.assert_alive()
        st = self.status()
        expect = sum(self.topo.replicas(kind) for kind in NODE_KINDS)
        return st if len(st) == expect and all(state == "RUNNING" for state, _ in st.values()) else None

    def assert_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"supervisord exited with {self.proc.returncode}:\n{self.tail('supervisord.log')}")

    def stop(self) -> None:
        """Teardown, whatever state the system is in: SIGTERM (what `supervisorctl shutdown` does), then
        SIGKILL to supervisord's children by pid and to supervisord if that hangs. Never raises."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(SHUTDOWN_S)
            return
        except subprocess.TimeoutExpired:
            pass
        for pid in _children(self.proc.pid):
            try:  # supervisord puts each child in a process group of its own (stopasgroup relies on it)
                os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait(10)

    def cleanup(self) -> None:
        self.stop()
        if os.environ.get("KEEP_SYSTEM_DIR"):
            print(f"kept {self.dir}")
            return
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- logs -----------------------------------------------------------------------------------
    def lines(self, name: str) -> list[str]:
        path = self.logs / name
        return path.read_text().splitlines() if path.exists() else []

    def tail(self, name: str, n: int = 30) -> str:
        return "\n".join(self.lines(name)[-n:])

    def train_steps(self) -> list[dict]:
        return [json.loads(line) for line in self.lines("train_steps.jsonl")]

    def tracebacks(self) -> dict[str, str]:
        return {p.name: p.read_text() for p in sorted((self.logs / "supervisor").glob("*.log"))
                if "Traceback" in p.read_text()}

    def probe(self, duration: float, interval: float) -> list[dict]:
        res = self.cli("probe", "--topology", str(self.topo_path), "--json", "--duration", str(duration),
                       "--interval", str(interval), timeout=duration + 30)
        return [json.loads(line) for line in res.stdout.splitlines() if line.strip()]

    def probe_until(self, pred, timeout: float, what: str) -> dict:
        """Stream probe rows until one satisfies ``pred``; return it."""
        cmd = [str(VENV_BIN / "areal-bus"), "probe", "--topology", str(self.topo_path), "--json",
               "--interval", "0.5", "--duration", str(timeout)]
        seen = []
        with subprocess.Popen(cmd, cwd=self.dir, env=ENV, stdout=subprocess.PIPE, text=True) as probe:
            try:
                for line in probe.stdout:  # the probe's --duration bounds this loop
                    row = json.loads(line)
                    seen.append(row)
                    if pred(row):
                        return row
            finally:
                probe.terminate()
                probe.wait(10)
        raise AssertionError(f"probe never showed {what} in {timeout}s; last rows: {seen[-8:]}")


def _children(ppid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == ppid:
            out.append(int(stat.parent.name))
    return out


def _latest(rows: list[dict]) -> dict[str, dict]:
    """The last row the probe printed for each node."""
    return {r["node"]: r for r in rows}



# -- a whole run ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(120)
def test_run_ends_by_itself_after_max_steps_with_clean_logs(make_system):
    system = make_system()
    system.start()
    # The trainer exits 0 after max_steps and the run_end listener shuts supervisord down.
    try:
        rc = system.proc.wait(90)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"supervisord still running after 90 s:\n{system.tail('train.log')}") from None
    assert rc == 0, system.tail("supervisord.log")
    assert "exited: trainer-0 (exit status 0; expected)" in system.tail("supervisord.log", 100)

    steps = [s["step"] for s in system.train_steps()]
    assert steps == list(range(system.topo.max_steps)), "trainer.jsonl must show max_steps steps, once each"

    train = system.lines("train.log")
    updates = [TRAIN_STEP.match(line) for line in train if TRAIN_STEP.match(line)]
    assert [int(u.group(1)) for u in updates] == steps
    for u in updates:  # async mode: an update fires at trigger_batch_size and takes at most global_batch_size
        assert system.topo.trigger_batch_size <= int(u.group(2)) <= system.topo.global_batch_size
        float(u.group(3))
    rates = [float(t.group(1)) for line in train if (t := THROUGHPUT.match(line))]
    assert rates and all(r > 0 for r in rates), "\n".join(train)

    generated = [r for line in system.lines("rollout.log") if (r := ROLLOUT_STEP.match(line))]
    assert generated, system.tail("rollout.log")
    assert {r.group(4) for r in generated} == {"rollout-0", "rollout-1"}
    assert all(int(r.group(2)) > 0 and int(r.group(3)) > 0 for r in generated)

    for log in sorted(system.logs.glob("*.log")):
        if log.name == "supervisord.log":
            continue
        bad = [line for line in log.read_text().splitlines() if not LINE_END.search(line)]
        assert not bad, f"{log.name}: lines without a trailing ts=HH:MM:SS.mmm: {bad[:3]}"
    assert not system.tracebacks()


# -- one long-running system for the probe, scaling, restart and shutdown tests --------------------

@pytest.fixture(scope="module")
def running():
    # Decoding somewhat slower than the run above: this system runs for the rest of the module, and
    # longer decode sleeps keep it light on 2 cores.
    system = System({"max_steps": 1_000_000, "rollout_engine": {
        "kind": "sim", "max_batch": 8, "decode_step_s": 0.004, "decode_step_per_seq_s": 0.00001,
        "swap_s": 0.001, "output_len": {"dist": "uniform", "min": 16, "max": 48}}})
    try:
        system.start()
        wait_until(lambda: system.all_running(), 30, "every process RUNNING")
        wait_until(lambda: len(system.train_steps()) >= 3, 30, "the trainer to complete 3 steps")
        yield system
    finally:
        system.cleanup()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_probe_reports_throughput_busy_fraction_and_bounded_staleness(running):
    rows = running.probe(duration=4, interval=1)
    latest = _latest(rows)
    assert {"trainer-0", "rollout-0", "rollout-1"} <= set(latest), sorted(latest)
    trainer = latest["trainer-0"]
    assert trainer["alive"] and trainer["samples_per_second"] > 0, trainer
    assert 0 < trainer["busy_fraction"] <= 1, trainer
    assert trainer["staleness"], trainer
    # Nothing is ever consumed over the staleness bound, in any report.
    for row in rows:
        if row["node"] == "trainer-0":
            assert all(int(k) <= running.topo.staleness_threshold for k in row["staleness"]), row
    assert sum(latest[w]["tokens_per_second"] for w in ("rollout-0", "rollout-1")) > 0, latest


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_scaling_rollout_workers_adds_a_worker_without_restarting_the_others(running):
    before = {k: pid for k, (_, pid) in running.status().items()}
    steps_before = len(running.train_steps())

    running.write_topology({**running.data, "rollout_workers": 3})
    running.render()
    out = running.ctl("update")
    # A program per replica: supervisord adds the new one and touches nothing else.
    assert out.splitlines() == ["rollout-2: added process group"], out

    st = wait_until(running.all_running, 30, "rollout-2 and every other process RUNNING")
    assert st["rollout-2"][0] == "RUNNING"
    assert {k: pid for k, (_, pid) in st.items() if k in before} == before, "a running process was restarted"
    wait_until(lambda: any((r := ROLLOUT_STEP.match(line)) and r.group(4) == "rollout-2"
                           for line in running.lines("rollout.log")), 30, "rollout-2 to log generated samples")
    wait_until(lambda: len(running.train_steps()) > steps_before + 3, 30, "training to go on after scaling")
    assert running.pid("trainer-0") == before["trainer-0"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killed_rollout_worker_is_restarted_and_serves_the_current_version(running):
    old = running.pid("rollout-0")
    version_at_kill = len(running.train_steps())  # the trainer's version = updates done
    os.kill(old, signal.SIGKILL)

    def restarted():
        running.assert_alive()
        state, pid = running.status().get("rollout-0", (None, None))
        return state == "RUNNING" and pid not in (None, old) and pid
    new = wait_until(restarted, 30, "supervisord to restart rollout-0")
    assert "exited: rollout-0 (terminated by SIGKILL; not expected)" in running.tail("supervisord.log", 200)

    # The old process has been silent for over a second (startsecs), so every rollout-0 heartbeat a
    # fresh probe sees comes from the new one. Its first must already carry a version at least as new
    # as the one current when the old worker died: a late joiner learns the version on joining (the
    # bus replays the last VersionAnnounce; the weights node repeats it every heartbeat), it does not
    # serve version 0 until the next update.
    row = running.probe_until(lambda r: r["node"] == "rollout-0", 15, "a heartbeat from the restarted rollout-0")
    assert row["alive"] and row["version"] >= version_at_kill, (row, version_at_kill)

    # And it produces under that version: its first generated-samples line carries it.
    def first_line_version():
        lines = running.lines("rollout.log")
        starts = [i for i, line in enumerate(lines) if "node_start" in line and f"pid={new} " in line]
        for line in lines[starts[-1]:] if starts else []:
            r = ROLLOUT_STEP.match(line)
            if r and r.group(4) == "rollout-0":
                return [int(re.search(r" version=(\d+) ", line).group(1))]
        return None
    versions = wait_until(first_line_version, 30, "the restarted rollout-0 to log generated samples")
    assert versions[0] >= version_at_kill, (versions, version_at_kill)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_shutdown_stops_every_node_cleanly(running):
    # Last in this file on purpose: it ends the shared system.
    running.assert_alive()
    st = running.status()
    assert all(state == "RUNNING" for state, _ in st.values()), st
    names = list(st)
    running.ctl("shutdown")
    try:
        rc = running.proc.wait(SHUTDOWN_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"supervisord did not exit within {SHUTDOWN_S}s:\n"
                             f"{running.tail('supervisord.log')}") from None
    assert rc == 0
    log = running.tail("supervisord.log", 400)
    assert "with SIGKILL" not in log, f"a node outlived stopwaitsecs={STOP_WAIT_S} and was killed:\n{log}"
    for name in names:
        assert f"stopped: {name} (exit status 0)" in log, f"{name} did not exit 0 on SIGTERM:\n{log}"
    assert not running.tracebacks()
