"""supervisord event listener that ends the run: when training ends, and when a node cannot run.

supervisord restarts a program that exits unexpectedly and retries one that fails to start, which is
right for a node killed mid-run but leaves a node that fails every time (a broken model folder, a
bug) crash-looping for ever while the main command waits. This listener ends the run either way:

- the trainer (program ``trainer`` or ``trainer-<n>``) exits expectedly, after max_steps: ok;
- a program goes FATAL, fails START_TRIES starts in a row (BACKOFF), or exits with an error status
  CRASH_LIMIT times within CRASH_WINDOW_S: failed, with one line naming the process and its log. A
  process killed by a signal counts as neither, however soon after its start it died.

The outcome (status, reason, process, log) goes to stderr (``logs/supervisor/run_end.log``) and to
``<log_dir>/run_outcome.json``, then supervisord is asked to shut down; ``areal-bus run``
(areal_bus/launch/run.py) turns the file into its exit status. Rendered into every supervisord.conf as
``[eventlistener:run_end]`` with ``events=`` EVENTS.

Run (what supervisord runs): areal-bus run-end --program trainer
"""

from __future__ import annotations

import collections
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from supervisor import childutils

from areal_bus.runtime.outcome import outcome_path, write_outcome
from areal_bus.launch.watchdog import Watchdog

CRASH_LIMIT = 3
"""Error exits of one process, within CRASH_WINDOW_S, that end the run. One is what a restart is for
(a transient error); a node that fails the same way three times will fail the fourth. A process
killed by a signal (kill -9, the OOM killer, bench/chaos.py) is not counted: supervisord restarting
it is the designed answer, and the trainer's crash recovery relies on it."""
CRASH_WINDOW_S = 300.0
"""Long enough to hold three attempts of a node that loads a large model before failing; short
enough that rare, unrelated errors over a long run never add up to a crash loop."""
START_TRIES = 3
"""Failed starts in a row (exits within the program's startsecs) that end the run: supervisord's own
default for startretries. The rendered startretries (20, with a growing backoff) would take minutes."""
EVENTS = "PROCESS_STATE_EXITED,PROCESS_STATE_BACKOFF,PROCESS_STATE_FATAL"
"""What the listener subscribes to (the rendered ``events=``): exits, failed starts, and giving up."""
"""The run-outcome file in log_dir: written by ``areal-bus run`` at start, completed by this listener."""
LOG_TAIL_BYTES = 65536
"""How much of a log is read back for the line a reason quotes: a traceback fits many times over."""


@dataclass
class Verdict:
    """How the run ended: ``ok`` (the trainer finished) or not, which process decided it, and why."""

    ok: bool
    process: str  # supervisorctl's name, group:process (e.g. "trainer-0:trainer-0")
    reason: str


def _is(names: tuple[str, str], program: str) -> bool:
    # By group or process name, and by prefix: "trainer" and "trainer-0" each match the trainer whether
    # it is rendered as the program "trainer" (numprocs, process trainer-0) or "trainer-0".
    return any(n == program or n.startswith(program + "-") for n in names)


class RunWatch:
    """The listener's decisions, from supervisord's process-state events; owns no socket or file.
    ``on_event`` returns a Verdict once the run is over, else None."""

    def __init__(self, program: str = "trainer"):
        self.program = program
        self.crashes: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        # Of the failed starts in the current streak, those killed by a signal (not the node failing).
        self.signal_starts: dict[str, int] = collections.defaultdict(int)
        self.verdict: Verdict | None = None

    def on_event(self, eventname: str, fields: dict, now: float, exit_status: str | None = None) -> Verdict | None:
        """``exit_status``, for an unexpected EXITED or a BACKOFF: supervisord's words for the exit
        ("exit status 1", "terminated by SIGKILL"), None when unknown (then it counts as an error).
        A signal is not the node failing: the trainer's quarantine kills it on purpose, and on a fast
        engine it dies within startsecs of its restart (a BACKOFF) as often as after it."""
        if self.verdict is not None:
            return None  # decided: the events of the shutdown change nothing
        name, group = fields.get("processname", "?"), fields.get("groupname", "?")
        process = f"{group}:{name}"
        signal = exit_status is not None and exit_status.startswith("terminated by")
        if eventname == "PROCESS_STATE_BACKOFF":
            tries = int(fields.get("tries", 0))
            if tries <= 1:  # supervisord counts from 1 again once the process has run: a new streak
                self.signal_starts[process] = 0
            if signal:
                self.signal_starts[process] += 1
        if eventname == "PROCESS_STATE_EXITED" and fields.get("expected") == "1":
            if _is((group, name), self.program):
                self.verdict = Verdict(True, process, f"{name} finished (exited 0)")
        elif signal:
            return None  # killed by a signal: restarting it is supervisord's job (FATAL still ends the run)
        elif eventname == "PROCESS_STATE_EXITED":
            times = self.crashes[process]
            times.append(now)
            while now - times[0] > CRASH_WINDOW_S:
                times.popleft()
            if len(times) >= CRASH_LIMIT:
                self.verdict = Verdict(False, process, f"{name} failed {len(times)} times in "
                                                       f"{now - times[0]:.0f} s ({exit_status or 'exit status ?'})")
        elif eventname == "PROCESS_STATE_BACKOFF" and tries - self.signal_starts[process] >= START_TRIES:
            self.verdict = Verdict(False, process, f"{name} could not start ({fields['tries']} tries, "
                                                   "each exited before startsecs)")
        elif eventname == "PROCESS_STATE_FATAL":
            self.verdict = Verdict(False, process, f"{name} could not start (FATAL: supervisord gave up on it)")
        return self.verdict


def should_stop(headers: dict, payload: str, program: str) -> bool:
    """Whether this one event is ``program`` finishing (the trainer's expected exit)."""
    fields, _ = childutils.eventdata(payload + "\n")
    verdict = RunWatch(program).on_event(headers.get("eventname", ""), fields, 0.0)
    return verdict is not None and verdict.ok


# -- what the verdict quotes, asked of supervisord --------------------------------------------------
def _rpc():
    # A new proxy for each call: a call that failed leaves xmlrpc's transport unusable for the next
    # (CannotSendRequest), and the shutdown that follows must not depend on it.
    return childutils.getRPCInterface(os.environ)


def exit_status(name: str) -> str | None:
    """How ``name`` last exited, from supervisord's own log line ("exited: NAME (exit status 1; not
    expected)"). The EXITED event does not carry it, and by the time we could ask getProcessInfo
    supervisord may have respawned the process, which clears its exitstatus; the log line is
    written before the event is sent."""
    try:
        tail = _rpc().supervisor.readLog(-LOG_TAIL_BYTES, 0)
    except Exception:  # noqa: BLE001 -- no main log (logfile=NONE, syslog): an unknown status counts as an error
        return None
    found = re.findall(rf"exited: {re.escape(name)} \(([^;)]+)", tail)
    return found[-1] if found else None


def last_error(log: Path) -> str:
    """The exception line of the last traceback in ``log`` (what the reason quotes), or ""."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    after = lines[starts[-1] + 1:] if starts else []
    return next((line.strip()[:240] for line in after if line and not line[0].isspace()), "")


def process_log(process: str) -> Path | None:
    try:
        log = _rpc().supervisor.getProcessInfo(process).get("stdout_logfile")
    except Exception:  # noqa: BLE001 -- the reason still names the process without its log
        return None
    return Path(log) if log else None


def describe(verdict: Verdict, log: Path | None) -> str:
    """The one line: ``run failed: NAME ...; its log: PATH (LAST ERROR)``."""
    if verdict.ok:
        return f"run finished: {verdict.reason}"
    where = ""
    if log is not None:
        shown = os.path.relpath(log) if log.is_absolute() and log.is_relative_to(Path.cwd()) else str(log)
        err = last_error(log)
        where = f"; its log: {shown}" + (f" ({err})" if err else "")
    return f"run failed: {verdict.reason}{where}"


def end(verdict: Verdict, outcome: Path | None) -> str:
    log = None if verdict.ok else process_log(verdict.process)
    line = describe(verdict, log)
    print(f"run_end: {line}; shutting supervisord down", file=sys.stderr, flush=True)
    if outcome is not None:
        write_outcome(outcome, status="ok" if verdict.ok else "failed", reason=line, process=verdict.process,
                      log=str(log) if log else None, ended=time.strftime("%Y-%m-%dT%H:%M:%S"))
    _rpc().supervisor.shutdown()
    return line


def listen(program: str = "trainer") -> int:
    watch = RunWatch(program)
    outcome = outcome_path()
    Watchdog(_rpc).start()  # stalled nodes (heartbeat gone, process there): areal_bus/launch/watchdog.py
    while True:
        headers, payload = childutils.listener.wait(sys.stdin, sys.stdout)
        childutils.listener.ok(sys.stdout)
        fields, _ = childutils.eventdata(payload + "\n")
        event = headers.get("eventname", "")
        unexpected = (event == "PROCESS_STATE_EXITED" and fields.get("expected") == "0"
                      or event == "PROCESS_STATE_BACKOFF")
        status = exit_status(fields.get("processname", "")) if unexpected else None
        verdict = watch.on_event(event, fields, time.monotonic(), status)
        if verdict is not None:
            end(verdict, outcome)
