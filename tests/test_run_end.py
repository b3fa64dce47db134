"""Runs end, and say how: the run-end listener's decisions (areal_bus/launch/runend.py) and ``areal-bus run``
(areal_bus/launch/run.py) under a real supervisord: a node that cannot run ends the run within seconds with a
non-zero exit and one line naming the node and its log; a good run exits 0; a new run moves the last
one's logs aside; the progress line reads train_steps.jsonl.

Run: .venv/bin/pytest tests/test_run_end.py      (the three whole runs are marked slow, about a minute)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from areal_bus.launch.run import StepTail, archive_previous, plain_line, summary
from areal_bus.launch.runend import CRASH_LIMIT, CRASH_WINDOW_S, EVENTS, START_TRIES, RunWatch, describe, last_error
from areal_bus.runtime.outcome import outcome_path
from bench.harness import check_outcome
from tests.test_system import ENV, REPO, VENV_BIN, System

EXITED, BACKOFF, FATAL = "PROCESS_STATE_EXITED", "PROCESS_STATE_BACKOFF", "PROCESS_STATE_FATAL"


def _proc(name: str, **extra) -> dict:
    return {"processname": name, "groupname": name, "from_state": "RUNNING", **extra}


# -- the listener's decisions -----------------------------------------------------------------------
@pytest.mark.parametrize("program", ["trainer", "trainer-0"])
@pytest.mark.parametrize("group", ["trainer", "trainer-0"])
def test_the_trainers_expected_exit_ends_the_run_ok_whatever_its_program_is_named(program, group):
    verdict = RunWatch(program).on_event(EXITED, {**_proc("trainer-0"), "groupname": group, "expected": "1"}, 0.0)
    assert verdict is not None and verdict.ok and "trainer-0" in verdict.reason


def test_another_programs_expected_exit_does_not_end_the_run():
    assert RunWatch("trainer").on_event(EXITED, _proc("agent-0", expected="1"), 0.0) is None


def test_a_process_that_keeps_failing_by_itself_ends_the_run_at_the_crash_limit():
    watch = RunWatch()
    verdicts = [watch.on_event(EXITED, _proc("rollout-1", expected="0"), t, "exit status 1")
                for t in range(CRASH_LIMIT)]
    assert verdicts[:-1] == [None] * (CRASH_LIMIT - 1)
    assert not verdicts[-1].ok and verdicts[-1].process == "rollout-1:rollout-1"
    assert verdicts[-1].reason == f"rollout-1 failed {CRASH_LIMIT} times in {CRASH_LIMIT - 1} s (exit status 1)"


def test_kills_from_outside_never_end_the_run():
    watch = RunWatch()  # kill -9 (bench/chaos.py, test_crash.py): supervisord restarts it, the run goes on
    assert all(watch.on_event(EXITED, _proc("trainer-0", expected="0"), t, "terminated by SIGKILL") is None
               for t in range(10 * CRASH_LIMIT))


def test_errors_further_apart_than_the_window_are_not_a_crash_loop():
    watch = RunWatch()
    assert all(watch.on_event(EXITED, _proc("reward-0", expected="0"), i * CRASH_WINDOW_S * 0.6, "exit status 1")
               is None for i in range(10))


def test_failed_starts_in_a_row_or_fatal_end_the_run():
    watch = RunWatch()
    assert watch.on_event(BACKOFF, _proc("gateway-0", tries=str(START_TRIES - 1)), 0.0) is None
    verdict = watch.on_event(BACKOFF, _proc("gateway-0", tries=str(START_TRIES)), 1.0)
    assert not verdict.ok and "gateway-0 could not start" in verdict.reason
    fatal = RunWatch().on_event(FATAL, _proc("bus-0"), 0.0)
    assert not fatal.ok and "bus-0" in fatal.reason and "FATAL" in fatal.reason


def test_starts_killed_by_a_signal_are_not_failed_starts():
    # The trainer's quarantine kills it on purpose (SIGSEGV in tests), and a fast engine dies within
    # startsecs of each restart: supervisord's BACKOFF tries grow, the run must go on.
    watch = RunWatch()
    for tries in range(1, 3 * START_TRIES):
        assert watch.on_event(BACKOFF, _proc("trainer-0", tries=str(tries)), tries, "terminated by SIGSEGV") is None
    # Error exits in the same streak still end it, counted apart from the signals.
    k = 3 * START_TRIES
    for i in range(START_TRIES - 1):
        assert watch.on_event(BACKOFF, _proc("trainer-0", tries=str(k + i)), k + i, "exit status 1") is None
    verdict = watch.on_event(BACKOFF, _proc("trainer-0", tries=str(k + START_TRIES - 1)), 99.0, "exit status 1")
    assert not verdict.ok and "trainer-0 could not start" in verdict.reason


def test_the_reason_names_the_log_and_quotes_the_last_traceback(tmp_path, monkeypatch):
    log = tmp_path / "logs" / "supervisor" / "trainer-0.log"
    log.parent.mkdir(parents=True)
    log.write_text("[train] start\nTraceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                   "    boom()\nOSError: [Errno 28] No space left on device\n[train] start\n")
    monkeypatch.chdir(tmp_path)
    verdict = RunWatch().on_event(FATAL, _proc("trainer-0"), 0.0)
    line = describe(verdict, log.resolve())
    assert line == ("run failed: trainer-0 could not start (FATAL: supervisord gave up on it); its log: "
                    "logs/supervisor/trainer-0.log (OSError: [Errno 28] No space left on device)")
    assert last_error(tmp_path / "missing.log") == ""


def test_the_outcome_file_is_found_beside_supervisords_socket_when_not_named():
    assert outcome_path({"AREAL_BUS_RUN_OUTCOME": "/x/o.json"}) == Path("/x/o.json")
    assert outcome_path({"SUPERVISOR_SERVER_URL": "unix:///r/logs/supervisor.sock"}) == Path("/r/logs/run_outcome.json")
    assert outcome_path({}) is None


# -- run folders and progress -----------------------------------------------------------------------
def test_a_new_run_moves_the_last_runs_logs_aside_and_keeps_checkpoints_and_spool(tmp_path):
    logs = tmp_path / "logs"
    for rel in ("train.log", "rollout.log", "train_steps.jsonl", "reward.png", "ledger/trainer-0.jsonl",
                "resolved/trainer-0.json", "supervisor/trainer-0.log", "supervisor/.gitkeep",
                "checkpoints/step_5/trainer_state.json", "spool/spool.sqlite"):
        (logs / rel).parent.mkdir(parents=True, exist_ok=True)
        (logs / rel).write_text(rel)
    (logs / "run_outcome.json").write_text(json.dumps({"run": "20261201-092752", "status": "ok"}))

    moved = archive_previous(logs)
    assert moved == logs / "runs" / "20261201-092752"
    assert (moved / "train_steps.jsonl").read_text() == "train_steps.jsonl"
    assert (moved / "supervisor" / "trainer-0.log").exists() and (moved / "ledger" / "trainer-0.jsonl").exists()
    assert sorted(p.name for p in logs.iterdir()) == ["checkpoints", "runs", "spool", "supervisor"]
    assert [p.name for p in (logs / "supervisor").iterdir()] == [".gitkeep"]
    assert archive_previous(logs) is None  # nothing of a run left to move


def test_progress_reads_updates_rate_eval_reward_and_eta_from_train_steps(tmp_path):
    path = tmp_path / "train_steps.jsonl"
    old = {"t_end": 50.0, "run": "a", "step": 7, "samples": 99}
    eval0 = {"t_end": 100.0, "run": "b", "step": -1, "samples": 0, "eval_reward": 0.25}
    rows = [{"t_end": 100.0 + 2 * s, "run": "b", "step": s, "samples": 8} for s in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in [old, eval0, *rows[:4]]) + json.dumps(rows[4])[:20])
    tail = StepTail(path, since=99.0)
    assert tail.poll()
    s = summary(tail.records, max_steps=10)
    assert s == {"done": 4, "max_steps": 10, "samples_per_s": 4.0, "eta_s": 12.0, "eval_reward": 0.25}
    with open(path, "a") as f:  # the trainer finishes the line it was writing
        f.write(json.dumps(rows[4])[20:] + "\n")
    assert tail.poll() and summary(tail.records, 10)["done"] == 5
    assert plain_line(s, 75.0, "7 of 7 nodes running") == \
        "update 4/10 · 4.0 samples/s · eval reward 0.250 · ETA 0:00:12 · 0:01:15 elapsed"


# -- under a real supervisord ------------------------------------------------------------------------
LISTENER_CONF = """\
[supervisord]
nodaemon=true
logfile=%(here)s/logs/supervisord.log
pidfile=%(here)s/logs/supervisord.pid
childlogdir=%(here)s/logs/supervisor

[unix_http_server]
file=%(here)s/logs/supervisor.sock

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[program:reward-0]
command={python} -c "raise RuntimeError('no reward model at /models/rm')"
startsecs=10
startretries=20
redirect_stderr=true
stdout_logfile=%(here)s/logs/supervisor/reward-0.log

[eventlistener:run_end]
command={bin}/areal-bus run-end --program trainer
events={events}
stderr_logfile=%(here)s/logs/supervisor/run_end.log
"""


@pytest.mark.timeout(60)
def test_a_program_that_fails_every_start_ends_supervisord_within_seconds_and_says_why(tmp_path):
    # supervisord started by hand (no `areal-bus run`): the listener finds log_dir from its socket.
    # startsecs 10: a loaded box can take over a second to start python, and each attempt must
    # fail within startsecs to be a failed start (BACKOFF) rather than an exit after running.
    (tmp_path / "logs" / "supervisor").mkdir(parents=True)
    conf = tmp_path / "supervisord.conf"
    conf.write_text(LISTENER_CONF.format(python=VENV_BIN / "python", bin=VENV_BIN, events=EVENTS))
    env = {k: v for k, v in ENV.items() if k != "AREAL_BUS_RUN_OUTCOME"}
    t0 = time.monotonic()
    proc = subprocess.Popen([str(VENV_BIN / "supervisord"), "-c", str(conf)], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(45)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    took = time.monotonic() - t0
    outcome = json.loads((tmp_path / "logs" / "run_outcome.json").read_text())
    assert outcome["status"] == "failed" and outcome["process"] == "reward-0:reward-0", outcome
    assert outcome["reason"] == (f"run failed: reward-0 could not start ({START_TRIES} tries, each exited before "
                                 f"startsecs); its log: logs/supervisor/reward-0.log "
                                 f"(RuntimeError: no reward model at /models/rm)"), outcome
    assert outcome["reason"] in (tmp_path / "logs" / "supervisor" / "run_end.log").read_text()
    assert took < 30, f"{took:.1f} s"  # supervisord's own startretries=20 backoff would take 3.5 minutes
    # supervisord itself exited 0: the benchmarks' harness reads the verdict, and a failed run is an error there.
    assert proc.returncode == 0
    with pytest.raises(RuntimeError, match=r"^bench-run: run failed: reward-0 could not start .*no reward model"):
        check_outcome(tmp_path / "logs", "bench-run")


def test_the_bench_harness_refuses_a_run_that_left_no_verdict(tmp_path):
    with pytest.raises(RuntimeError, match=r"^r: the run left no readable run_outcome.json"):
        check_outcome(tmp_path, "r")
    (tmp_path / "run_outcome.json").write_text('{"run": "x", "started": "2026')  # cut short
    with pytest.raises(RuntimeError, match=r"^r: the run left no readable run_outcome.json"):
        check_outcome(tmp_path, "r")


# -- whole runs under supervisord -------------------------------------------------------------------
RUN_S = 240
"""Bound on one `areal-bus run` here: a sim run takes 15-40 s; the broken model's run, three rounds of
eight processes importing torch on a loaded 2-core box, took 105 s."""


def _run(system: System, timeout: float = RUN_S) -> tuple[subprocess.CompletedProcess, float]:
    """`areal-bus run topology.yaml` in the system's folder; (result, wall seconds). On a hang: SIGTERM
    (which stops supervisord), then SIGKILL to what is left, then fail."""
    t0 = time.monotonic()
    proc = subprocess.Popen([str(VENV_BIN / "areal-bus"), "run", "topology.yaml", "-o", "supervisord.conf"],
                            cwd=system.dir, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
        pid = system.logs / "supervisord.pid"
        if pid.exists():
            try:
                os.kill(int(pid.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        raise AssertionError(f"areal-bus run still going after {timeout} s:\n{system.tail('supervisord.log')}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - t0



def _outcome(system: System) -> dict:
    return json.loads((system.logs / "run_outcome.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(RUN_S + 120)
def test_a_good_short_run_exits_0_with_progress_lines_and_one_run_in_its_steps(make_system):
    s = make_system()
    res, wall = _run(s)
    assert res.returncode == 0, res.stderr
    assert _outcome(s)["status"] == "ok"
    assert f"update {s.topo.max_steps}/{s.topo.max_steps}" in res.stdout, res.stdout  # not a terminal: plain lines
    assert re.search(rf"finished: {s.topo.max_steps} updates .*; logs in logs", res.stdout), res.stdout
    runs = {r["run"] for r in s.train_steps()}
    assert len(runs) == 1 and None not in runs, runs
    print(f"good run: exit 0 after {wall:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(RUN_S + 120)
def test_a_node_that_cannot_load_its_model_ends_the_run_naming_it_and_its_log(make_system):
    # A checkpoint cut short in copying: config.json is there (validation passes), the weights are not.
    model = Path(os.environ.get("TMPDIR", "/tmp")) / f"ab-broken-{os.getpid()}"
    s = make_system(model={"path": str(model), "dtype": "float32", "device": "cpu", "threads": 1},
               rollout_engine={"kind": "torch", "max_batch": 8, "max_len": 256},
               trainer_engine={"kind": "torch", "eval_interval": 0},
               agent={"framework": "guess", "max_turns": 5, "reward_source": "rule"})
    model.mkdir()
    try:
        for f in (REPO / "models" / "tiny-guess").iterdir():
            data = f.read_bytes()
            (model / f.name).write_bytes(data[:len(data) // 3] if f.suffix == ".safetensors" else data)
        res, wall = _run(s)
    finally:
        for f in model.iterdir():
            f.unlink()
        model.rmdir()
    assert res.returncode == 1, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    found = re.fullmatch(r"areal-bus run: run failed: (rollout-\d|trainer-0) .*; its log: (\S+) \((.+)\)", line)
    assert found, line
    assert found.group(2) == f"logs/supervisor/{found.group(1)}.log" and (s.dir / found.group(2)).exists()
    assert _outcome(s)["status"] == "failed" and _outcome(s)["reason"] == line.removeprefix("areal-bus run: ")
    print(f"broken model: exit 1 after {wall:.1f} s: {line}")


@pytest.mark.slow
@pytest.mark.timeout(RUN_S + 120)
def test_a_trainer_that_fails_at_its_third_update_ends_the_run_naming_it_and_its_log(make_system):
    # The checkpoint due after the third update cannot be written (logs/checkpoints is a file): the
    # real trainer raises there, every time supervisord restarts it.
    s = make_system(max_steps=50, logging={"log_dir": "logs", "log_interval": 2, "save_interval": 3})
    s.logs.mkdir(parents=True)
    (s.logs / "checkpoints").write_text("not a folder")
    res, wall = _run(s)
    assert res.returncode == 1, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    # Restarted, the (simulated) trainer resumes with batches already waiting and can reach its third
    # update within supervisord's startsecs (1 s): the run then ends as a start that keeps failing, with
    # the same node, log and error (a CI run on 2 cores saw it).
    assert re.fullmatch(r"areal-bus run: run failed: trainer-0 (failed \d+ times in \d+ s \(exit status 1\)|"
                        r"could not start \(\d+ tries, each exited before startsecs\)); "
                        r"its log: logs/supervisor/trainer-0\.log \((NotADirectoryError|FileExistsError): .+\)",
                        line), line
    assert 3 <= max(r["step"] for r in s.train_steps()) + 1 < s.topo.max_steps
    print(f"trainer failing at update 3: exit 1 after {wall:.1f} s: {line}")
