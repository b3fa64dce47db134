"""``areal-bus run``: the main command. Runs a topology's supervisord in the foreground with a live
progress line, and exits 0 when training finished, 1 with a one-line reason when a node could not run.

  areal-bus run                        the checked-in supervisord.conf (topology/default.yaml)
  areal-bus run topology/sim.yaml      validate and render it to sim.conf (-o to choose), then run it
  areal-bus run other.conf
  areal-bus run --resume               continue the unfinished run in log_dir (its spool and checkpoints)
  areal-bus run --new-run              move the unfinished run in log_dir aside, then start a new one

Before it starts, a previous run's logs in log_dir move to ``log_dir/runs/<its run id>/``, so every
log in log_dir is this run's and none is appended to. Its spool/ and checkpoints/ go there too unless
``--resume`` continues from them. Over a run that did not finish (its spool says so, and it left
accepted trajectories or checkpoints) it refuses without ``--resume`` or ``--new-run``: nothing of an
unfinished run is emptied or overwritten by accident. It refuses as well while the processes of an
earlier run in log_dir live on (an orphan of a supervisord that died: it would share the run's
sockets and files), naming them. ``log_dir/run_outcome.json`` says how the run went:
``running``, then ``ok`` or ``failed`` with the reason, written by the run-end listener
(areal_bus/launch/runend.py) that ends the run, or here when supervisord stopped without it.

The progress line (update N of max_steps, samples/s, eval reward, ETA) comes from
``train_steps.jsonl``; a live ``rich`` line on a terminal, a plain line every few seconds elsewhere
(CI logs). The nodes' own logs stay in their files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from areal_bus.runtime.outcome import OUTCOME, OUTCOME_ENV, RESUME_ENV, write_outcome
from areal_bus.config.topology import Topology, load_topology
from areal_bus.config.files import check_files
from areal_bus.launch.render import write_conf

POLL_S = 0.5
"""How often the progress line re-reads train_steps.jsonl and supervisord's state: live to a person,
nothing to the nodes (a few hundred bytes read per poll)."""
PLAIN_EVERY_S = 5.0
"""Without a terminal, a plain progress line at most this often, and only when an update landed..."""
PLAIN_QUIET_S = 30.0
"""...or after this long without one, so a CI log shows the run is still alive."""
RATE_WINDOW = 10
"""Updates the samples/s and the ETA are measured over: recent enough to follow a change of pace."""
STOP_S = 60.0
"""How long supervisord may take to stop every node after Ctrl-C (each node's stopwaitsecs is 10 s)."""
RUN_FILES = ("*.log", "*.log.[0-9]", "*.jsonl", "*.png", OUTCOME)
RUN_FOLDERS = ("resolved", "ledger", "supervisor")
"""What a run writes in log_dir and leaves for the next one to move aside (checkpoints/ and spool/
are not in it: see the module docstring)."""
RUN_DATA = ("spool", "checkpoints")
"""What a run keeps for ``--resume``: moved aside with its logs when a new run starts instead."""
@dataclass
class Target:
    conf: Path
    topology: Path
    topo: Topology

    @property
    def log_dir(self) -> Path:
        return self.topo.log_dir(self.conf.parent)


class RunError(Exception):
    """What stops the run before it starts, as the one line to print."""


def resolve(target: str, output: str | None = None) -> Target:
    """A topology (validated, its files checked, rendered to ``output`` or ``<stem>.conf``) or a
    rendered conf (its topology read back from its programs' ``--topology``)."""
    path = Path(target)
    if path.suffix in (".yaml", ".yml"):
        conf = Path(output or f"{path.stem}.conf").resolve()
        topo = load_topology(path)
        check_files(topo, conf.parent, source=str(path))
        write_conf(topo, path, conf)
        return Target(conf, path.resolve(), topo)
    conf = path.resolve()
    found = re.search(r"--topology (\S+)", conf.read_text())
    if found is None:
        raise RunError(f"{target}: no `areal-bus node ... --topology` program in it: is it a rendered conf?")
    topo_path = Path(found.group(1).replace("%(here)s", str(conf.parent)))
    topo = load_topology(topo_path)
    check_files(topo, conf.parent, source=str(topo_path))
    return Target(conf, topo_path, topo)


def supervisord_running(log_dir: Path) -> bool:
    sock = log_dir / "supervisor.sock"
    if not sock.exists():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(sock))
            return True
        except OSError:  # a stale socket of a supervisord that is gone
            return False


def previous_run(log_dir: Path) -> dict | None:
    """The run whose spool is in log_dir: {epoch, finished, rows, checkpoints}, None without a spool.
    Read from the spool's own metadata (sqlite; the trainer that wrote it is gone)."""
    path = log_dir / "spool" / "spool.sqlite"
    if not path.exists():
        return None
    db = sqlite3.connect(path, timeout=5)  # read only (a read-only open cannot read a crashed run's WAL)
    try:
        meta = dict(db.execute("SELECT key, value FROM meta"))
        rows = db.execute("SELECT count(*) FROM spool").fetchone()[0]
    except sqlite3.DatabaseError:  # not a spool of this code's: nothing to say about its run
        return None
    finally:
        db.close()
    ckpts = [p for p in (log_dir / "checkpoints").glob("step_*") if p.is_dir()] \
        if (log_dir / "checkpoints").is_dir() else []
    return {"epoch": meta.get("epoch", ""), "finished": meta.get("finished") == "1", "rows": rows,
            "checkpoints": len(ckpts)}


def unfinished(prev: dict | None) -> bool:
    """A run that did not finish and left something a new start would destroy."""
    return bool(prev and prev["epoch"] and not prev["finished"] and (prev["rows"] or prev["checkpoints"]))


def orphans(log_dir: Path) -> list[tuple[int, str]]:
    """(pid, command line) of live processes that a supervisord of log_dir started (their environment
    names its socket) while none answers there: what a supervisord that died left running."""
    url = f"unix://{os.path.realpath(log_dir / 'supervisor.sock')}".encode()
    mine = {os.getpid(), os.getppid()}
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or another user's
            continue
        for var in env:
            if var.startswith(b"SUPERVISOR_SERVER_URL="):
                got = var.split(b"=", 1)[1]
                if got.startswith(b"unix://") and \
                        f"unix://{os.path.realpath(got[7:].decode(errors='replace'))}".encode() == url:
                    if int(proc.name) not in mine and cmd:
                        found.append((int(proc.name), cmd))
                break
    return sorted(found)


def move_run_data(log_dir: Path, dest: Path) -> list[Path]:
    """Move the folders spool/ and checkpoints/ into ``dest`` (the folder the run's logs went to); what
    moved. Anything else of those names is no run's data and stays where it is."""
    moved = []
    for name in RUN_DATA:
        if (log_dir / name).is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            os.replace(log_dir / name, dest / name)
            moved.append(dest / name)
    return moved


def _run_id(log_dir: Path) -> str:
    """The id of the run whose logs are in log_dir: as its start recorded it, else from its oldest log."""
    try:
        return json.loads((log_dir / OUTCOME).read_text())["run"]
    except (OSError, ValueError, KeyError):
        pass
    times = [p.stat().st_mtime for pat in RUN_FILES for p in log_dir.glob(pat)]
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(min(times) if times else time.time()))


def archive_previous(log_dir: Path) -> Path | None:
    """Move the previous run's logs to log_dir/runs/<run id>/; returns that folder (None: nothing to move)."""
    files = [p for pat in RUN_FILES for p in log_dir.glob(pat) if p.is_file()]
    folders = [log_dir / f for f in RUN_FOLDERS if (log_dir / f).is_dir()]
    sup = log_dir / "supervisor"
    # supervisor/ itself stays (supervisord needs it; a checkout keeps its .gitkeep): its logs move.
    moving = files + [p for p in folders if p != sup] + [p for p in sup.glob("*") if p.name != ".gitkeep"]
    if not moving:
        return None
    run_id = _run_id(log_dir)
    dest = log_dir / "runs" / run_id
    n = 1
    while dest.exists():
        n += 1
        dest = log_dir / "runs" / f"{run_id}-{n}"
    for p in moving:
        to = dest / p.relative_to(log_dir)
        to.parent.mkdir(parents=True, exist_ok=True)
        os.replace(p, to)
    return dest


# -- progress ---------------------------------------------------------------------------------------
class StepTail:
    """The records of train_steps.jsonl written since ``since`` (wall clock), read as they come."""

    def __init__(self, path: Path, since: float):
        self.path, self.since, self.offset, self.partial = path, since, 0, b""
        self.records: list[dict] = []

    def poll(self) -> bool:
        """Read what was appended; True if a record came."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return False
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()  # a line the trainer has not finished writing
        before = len(self.records)
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # not a record: the plot refuses such a file, the progress line need not
            if rec.get("t_end", 0) >= self.since:
                self.records.append(rec)
        return len(self.records) > before


def summary(records: list[dict], max_steps: int) -> dict:
    """done (updates), samples_per_s and eta_s (over the last RATE_WINDOW updates), eval_reward."""
    updates = [r for r in records if r.get("step", -1) >= 0]
    out = {"done": max((r["step"] + 1 for r in updates), default=0), "max_steps": max_steps,
           "samples_per_s": None, "eta_s": None, "eval_reward": None}
    evals = [r for r in records if r.get("eval_reward") is not None]
    if evals:
        out["eval_reward"] = evals[-1]["eval_reward"]
    window = updates[-RATE_WINDOW - 1:]
    if len(window) >= 2 and window[-1]["t_end"] > window[0]["t_end"]:
        dt = window[-1]["t_end"] - window[0]["t_end"]
        out["samples_per_s"] = sum(r.get("samples", 0) for r in window[1:]) / dt
        out["eta_s"] = max(0, max_steps - out["done"]) * dt / (len(window) - 1)
    return out


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def plain_line(s: dict, elapsed: float, running: str) -> str:
    """``update 12/60 · 18.3 samples/s · eval reward 0.81 · ETA 0:01:30 · 0:00:42 elapsed``."""
    if s["done"] == 0:
        return f"starting: {running}, waiting for the first update · {_clock(elapsed)} elapsed"
    parts = [f"update {s['done']}/{s['max_steps']}"]
    parts.append(f"{s['samples_per_s']:.1f} samples/s" if s["samples_per_s"] is not None else "? samples/s")
    if s["eval_reward"] is not None:
        parts.append(f"eval reward {s['eval_reward']:.3f}")
    parts += [f"ETA {_clock(s['eta_s'])}", f"{_clock(elapsed)} elapsed"]
    return " · ".join(parts)


class ProgressLine:
    """A live rich progress bar on a terminal; plain lines now and then elsewhere."""

    def __init__(self, max_steps: int, stream=None):
        from rich.console import Console

        self.console = Console(file=stream or sys.stdout)
        self.live = self.console.is_terminal
        self.last_print, self.last_done = float("-inf"), -1
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(bar_width=24),
                                TextColumn("{task.fields[text]}"), console=self.console, transient=False)
            self.task = self.bar.add_task("run", total=max_steps, text="starting")
            self.bar.start()

    def show(self, s: dict, elapsed: float, running: str) -> None:
        line = plain_line(s, elapsed, running)
        if self.live:
            head, _, rest = line.partition(" · ")
            self.bar.update(self.task, completed=s["done"], description=head if s["done"] else "starting",
                            text=rest if s["done"] else line.partition(": ")[2])
            return
        now = time.monotonic()
        due = s["done"] != self.last_done and now - self.last_print >= PLAIN_EVERY_S
        if due or now - self.last_print >= PLAIN_QUIET_S:
            print(line, file=self.console.file, flush=True)
            self.last_print, self.last_done = now, s["done"]

    def close(self, s: dict, elapsed: float, running: str) -> None:
        if self.live:
            self.show(s, elapsed, running)
            self.bar.stop()
        else:
            print(plain_line(s, elapsed, running), file=self.console.file, flush=True)


def _nodes_running(sock: Path) -> str:
    from supervisor import childutils

    # A new proxy each time: one whose call failed (no socket yet) stays broken (CannotSendRequest).
    rpc = childutils.getRPCInterface({"SUPERVISOR_SERVER_URL": f"unix://{sock}"})
    try:
        states = [p["statename"] for p in rpc.supervisor.getAllProcessInfo() if p["group"] != "run_end"]
    except Exception:  # noqa: BLE001 -- supervisord still starting (no socket yet): nothing to count
        return "supervisord starting"
    return f"{states.count('RUNNING')} of {len(states)} nodes running"


# -- the run ----------------------------------------------------------------------------------------
def _supervisord() -> str:
    here = Path(sys.executable).parent / "supervisord"  # the venv this command runs from
    return str(here) if here.exists() else (shutil.which("supervisord") or "supervisord")


def run(target: str, output: str | None = None, new_run: bool = False, resume: bool = False) -> int:
    if new_run and resume:
        raise RunError("--new-run and --resume exclude each other: start anew, or continue the last run")
    t = resolve(target, output)
    log_dir = t.log_dir
    if supervisord_running(log_dir):
        raise RunError(f"a run is already going on in {log_dir} (its supervisord answers on "
                       f"{log_dir / 'supervisor.sock'}): wait for it, or stop it with "
                       f"`supervisorctl -c {t.conf} shutdown`")
    if left := orphans(log_dir):
        shown = "; ".join(f"pid {pid}: {cmd[:80]}" for pid, cmd in left[:4]) + ("; ..." if len(left) > 4 else "")
        raise RunError(f"{len(left)} processes of an earlier run in {log_dir} are still alive, though its "
                       f"supervisord is gone ({shown}): stop them first: kill {' '.join(str(p) for p, _ in left)}")
    prev = previous_run(log_dir)
    if unfinished(prev) and not (new_run or resume):
        raise RunError(f"{log_dir} holds the unfinished run {prev['epoch']} ({prev['rows']} accepted trajectories "
                       f"in spool/, {prev['checkpoints']} checkpoints): `areal-bus run --resume` continues it, "
                       f"`areal-bus run --new-run` moves it to {log_dir / 'runs'}/<its run id>/ and starts a new run")
    if t.topo.replicas("gateway") and t.topo.gateway_config().admin_token is None:
        raise RunError("nodes.gateway.config.admin_token is empty: the gateway will not start without one; "
                       "export AREAL_BUS_ADMIN_TOKEN (8+ characters) first")
    moved = archive_previous(log_dir)
    (log_dir / "supervisor").mkdir(parents=True, exist_ok=True)
    if moved is not None:
        print(f"areal-bus run: the previous run's logs are now in {os.path.relpath(moved)}", file=sys.stderr)
    if not resume:  # a new run: the last one's spool and checkpoints go with its logs, never under the new one
        dest = moved or log_dir / "runs" / (prev["epoch"] if prev and prev["epoch"] else _run_id(log_dir))
        for path in move_run_data(log_dir, dest):
            print(f"areal-bus run: the previous run's {path.name}/ is now in {os.path.relpath(dest)}", file=sys.stderr)
    started = time.time()
    run_id = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    outcome = log_dir / OUTCOME
    write_outcome(outcome, run=run_id, status="running", started=time.strftime("%Y-%m-%dT%H:%M:%S"),
                  conf=str(t.conf), topology=str(t.topology))
    env = {**{k: v for k, v in os.environ.items() if k != RESUME_ENV}, OUTCOME_ENV: str(outcome),
           # The nodes and the listener run `areal-bus` from this command's own environment.
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           **({RESUME_ENV: "1"} if resume else {})}
    with open(log_dir / "supervisor" / "supervisord.out", "wb") as console:
        # Its own session: Ctrl-C reaches this command, which stops supervisord in order.
        proc = subprocess.Popen([_supervisord(), "-n", "-c", str(t.conf)], cwd=t.conf.parent, env=env,
                                stdout=console, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    interrupted, last = _wait(proc, t, started)
    return _finish(proc.returncode, outcome, log_dir, interrupted, last, time.time() - started)


def _wait(proc: subprocess.Popen, t: Target, started: float) -> tuple[str | None, dict]:
    """Show progress until supervisord exits: (the signal that interrupted the run or None, the last summary)."""
    got: list[tuple[str, float]] = []

    def stop(signum, _frame):
        got.append((signal.Signals(signum).name, time.monotonic()))
        proc.send_signal(signal.SIGTERM)  # supervisord stops every node, by priority, and exits

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    tail = StepTail(t.log_dir / "train_steps.jsonl", started)
    line = ProgressLine(t.topo.max_steps)
    running = "supervisord starting"
    try:
        while proc.poll() is None:
            tail.poll()
            running = _nodes_running(t.log_dir / "supervisor.sock")
            line.show(summary(tail.records, t.topo.max_steps), time.time() - started, running)
            try:
                proc.wait(POLL_S)
            except subprocess.TimeoutExpired:
                pass
            if got and time.monotonic() - got[0][1] > STOP_S:
                proc.kill()  # stuck stopping: supervisord only (each node is in a process group of its own)
                proc.wait()
    finally:
        tail.poll()
        last = summary(tail.records, t.topo.max_steps)
        line.close(last, time.time() - started, running)
        for s, handler in old.items():
            signal.signal(s, handler)
    return (got[0][0] if got else None), last


def _finish(rc: int, outcome: Path, log_dir: Path, interrupted: str | None, last: dict, took: float) -> int:
    try:
        record = json.loads(outcome.read_text())
    except (OSError, ValueError):
        record = {}
    if record.get("status") == "ok":
        reward = f", eval reward {last['eval_reward']:.3f}" if last["eval_reward"] is not None else ""
        print(f"areal-bus run: finished: {last['done']} updates{reward} in {_clock(took)}; "
              f"logs in {os.path.relpath(log_dir)}")
        return 0
    if record.get("status") == "failed":
        print(f"areal-bus run: {record['reason']}", file=sys.stderr)
        return 1
    if interrupted:
        reason = f"run stopped: interrupted by {interrupted} before it finished"
    elif rc != 0:
        reason = (f"run failed: supervisord exited with status {rc}: "
                  f"{_last_line(log_dir / 'supervisor' / 'supervisord.out')}")
    else:  # an old conf's listener, or `supervisorctl shutdown`: ended with no word on the outcome
        reason = (f"run failed: supervisord stopped before the trainer finished and no node was reported "
                  f"failing; see {os.path.relpath(log_dir / 'supervisord.log')}")
    write_outcome(outcome, status="failed", reason=reason, ended=time.strftime("%Y-%m-%dT%H:%M:%S"))
    print(f"areal-bus run: {reason}", file=sys.stderr)
    return 130 if interrupted else 1


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no output)"
    return lines[-1][:240] if lines else "(no output)"
