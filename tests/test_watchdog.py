"""The watchdog: a node whose heartbeat stops while its process lives (SIGSTOP) is logged as stalled and,
with durability.watchdog_restart_s, killed so that supervisord restarts it; the run then finishes.
HeartbeatWatch, the part that decides, is driven directly first; then a short sim run under supervisord
has its weights node stopped mid-run.

    .venv/bin/python -m pytest tests/test_watchdog.py -q
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from areal_bus.constants import WATCHDOG_FIRST_BEAT_S, WATCHDOG_SILENT_S
from areal_bus.launch.watchdog import HeartbeatWatch, process_alive
from tests.test_system import System, wait_until


def test_a_silent_node_whose_process_lives_is_reported_once_then_restarted():
    watch = HeartbeatWatch(restart_s=10.0)
    for node in ("bus-0", "weights-0"):
        watch.beat(node, node.split("-")[0], 100, "a", 0.0)
    watch.beat("bus-0", "bus", 100, "a", 6.0)
    assert watch.check(WATCHDOG_SILENT_S - 0.1, lambda pid: True) == []
    assert watch.check(6.0, lambda pid: True) == [("weights-0", "stalled", 6.0)]
    watch.beat("bus-0", "bus", 100, "a", 11.0)
    assert watch.check(8.0, lambda pid: True) == []  # reported once per silence
    assert watch.check(11.0, lambda pid: True) == [("weights-0", "restart", 11.0)]
    assert watch.check(30.0, lambda pid: True) == [("bus-0", "stalled", 19.0), ("bus-0", "restart", 19.0)]


def test_a_dead_process_or_a_new_incarnation_is_not_the_watchdogs_business():
    watch = HeartbeatWatch(restart_s=0.0)  # 0: only log
    watch.beat("bus-0", "bus", 1, "a", 0.0)
    watch.beat("trainer-0", "trainer", 2, "a", 0.0)
    watch.beat("bus-0", "bus", 1, "a", 9.0)
    assert watch.check(9.0, lambda pid: pid != 2) == []  # gone: supervisord restarts it
    watch.beat("trainer-0", "trainer", 3, "b", 9.0)  # restarted
    assert watch.check(9.5, lambda pid: True) == []
    assert watch.check(20.0, lambda pid: True) == [("bus-0", "stalled", 11.0)]  # never a restart at 0


def test_while_the_bus_is_silent_only_the_bus_is_blamed():
    watch = HeartbeatWatch(restart_s=8.0)
    for node in ("bus-0", "reward-0", "trainer-0"):
        watch.beat(node, node.split("-")[0], 1, "a", 0.0)
    assert [(n, a) for n, a, _ in watch.check(9.0, lambda pid: True)] == [("bus-0", "stalled"), ("bus-0", "restart")]


def test_a_running_program_never_heard_from_is_reported_late_and_never_killed():
    # Nodes build their engine before their first heartbeat (vLLM: 26-42 s): such a node is reported
    # only after WATCHDOG_FIRST_BEAT_S and never killed, however restart_s is set.
    watch = HeartbeatWatch(restart_s=8.0)
    watch.running({"bus-0": 1, "weights-0": 2}, 0.0)  # supervisord: both RUNNING, no heartbeat yet
    watch.beat("bus-0", "bus", 1, "a", 0.0)
    watch.beat("bus-0", "bus", 1, "a", 60.0)
    assert watch.check(60.0, lambda pid: True) == []  # a minute of loading: nothing said
    late = WATCHDOG_FIRST_BEAT_S + 1
    watch.beat("bus-0", "bus", 1, "a", late)
    assert watch.check(late, lambda pid: True) == [("weights-0", "stalled", late)]  # reported, not killed
    watch.running({"bus-0": 1, "weights-0": 3}, late + 1)  # restarted by supervisord: a new pid starts afresh
    watch.beat("bus-0", "bus", 1, "a", late + 3)
    assert watch.check(late + 3, lambda pid: True) == []
    watch.running({"bus-0": 1}, late + 20)  # no longer RUNNING (stopped, exited): not watched
    watch.beat("bus-0", "bus", 1, "a", late + 20)
    assert watch.check(late + 20, lambda pid: True) == []


def test_a_node_heard_from_then_silent_is_reported_then_killed():
    watch = HeartbeatWatch(restart_s=8.0)
    watch.running({"bus-0": 1, "weights-0": 2}, 0.0)
    for t in (0.0, 1.0):
        watch.beat("bus-0", "bus", 1, "a", t)
        watch.beat("weights-0", "weights", 2, "w", t)
    watch.beat("bus-0", "bus", 1, "a", 7.0)
    assert watch.check(7.0, lambda pid: True) == [("weights-0", "stalled", 6.0)]
    watch.beat("bus-0", "bus", 1, "a", 9.5)
    assert watch.check(9.5, lambda pid: True) == [("weights-0", "restart", 8.5)]


def test_a_stopped_process_counts_as_alive_and_a_missing_one_does_not():
    assert process_alive(os.getpid())
    assert not process_alive(2**22 + 12345)


def _heard(log: str) -> list[str]:
    """The nodes the watchdog's last ``watching`` line says it has heard from."""
    lines = re.findall(r"\[watchdog\] info watching nodes=\S+ heard=(\S+)", log)
    return lines[-1].split(",") if lines else []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stopped_weights_node_is_noticed_restarted_and_the_run_finishes():
    run = System({"max_steps": 40, "durability": {"spool": True, "watchdog_restart_s": 8},
                  "rollout_engine": {"kind": "sim", "max_batch": 8, "decode_step_s": 0.003,
                                     "decode_step_per_seq_s": 0.00001, "swap_s": 0.001,
                                     "output_len": {"dist": "uniform", "min": 8, "max": 32}}})
    try:
        run.start()
        wait_until(run.all_running, 60, "every process RUNNING")
        wait_until(lambda: len(run.train_steps()) >= 5, 60, "5 updates")
        listener = run.logs / "supervisor" / "run_end.log"
        # A node the watchdog has not heard from yet is only reported late, never killed (it may be
        # loading its engine): stop it once the watchdog's own log says it has heard it.
        wait_until(lambda: "weights-0" in _heard(listener.read_text()), 30, "the watchdog to hear weights-0")
        pid = run.pid("weights-0")
        os.kill(pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        wait_until(lambda: "node_stalled node=weights-0" in listener.read_text(), 30, "the watchdog to notice")
        noticed = time.monotonic() - t_stop
        wait_until(lambda: "node_restarted node=weights-0" in listener.read_text(), 30, "the watchdog's restart")
        restarted = time.monotonic() - t_stop
        rc = run.proc.wait(120)
        print(f"\nstalled weights node noticed after {noticed:.1f} s, killed after {restarted:.1f} s; "
              f"run ended with {rc}, {len(run.train_steps())} updates")
        assert noticed < WATCHDOG_SILENT_S + 5
        assert rc == 0 and len(run.train_steps()) >= 40, run.tail("supervisor/run_end.log")
        assert not process_alive(pid)  # the stopped process was killed, not left behind
    finally:
        try:
            os.kill(pid, signal.SIGCONT)  # never leave a stopped process behind, whatever failed
        except (ProcessLookupError, UnboundLocalError):
            pass
        run.cleanup()
