"""The gateway alone in one process: the policy served by a LocalEngineBackend in this process, no bus.

For tests and benchmarks that need the gateway as a process of its own (its memory and file
descriptors measured apart from the clients', its log output captured whole), and for trying an agent
against the gateway without starting the system. Same app, same routes and limits as the gateway node;
only the backend differs (an engine thread here instead of rollout workers over ZeroMQ), and ended
sessions' trajectories are written, one JSON line each (ids, sizes, reward; not the tokens), to
``--trajectories`` instead of going to the trainer. With ``--wal`` (or ``--log-dir``, whose
``spool/gateway-standalone.wal.sqlite`` it then is) open sessions and ended ones survive a kill -9: a
restarted standalone gateway on the same WAL resumes the sessions (their keys keep working) and writes
the ended trajectories it had not written yet; a line in ``--trajectories`` is this process's "accepted".

    AREAL_BUS_ADMIN_TOKEN=$(openssl rand -hex 16) .venv/bin/python -m nodes.gateway.standalone \\
        --model models/tiny-guess --port 9000 --log-dir logs

The admin token comes only from the environment (never argv: ``ps`` shows argv to every user). Prints
``READY port=<port> pid=<pid>`` on stdout once it listens; SIGTERM or SIGINT ends every open session
(its trajectory written) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "models" / "tiny-guess"), help="HF checkpoint folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="TCP port; 0 picks a free one (printed in READY)")
    p.add_argument("--max-batch", type=int, default=64, help="engine batch: sequences decoded together")
    p.add_argument("--max-len", type=int, default=256, help="prompt + output tokens per sequence")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for a tiny model)")
    p.add_argument("--log-dir", type=Path, default=None, help="write gateway.log here (stdout otherwise)")
    p.add_argument("--trajectories", type=Path, default=None, help="append one JSON line per trajectory")
    p.add_argument("--wal", type=Path, default=None, help="the gateway's WAL (default: <log-dir>/spool/"
                   "gateway-standalone.wal.sqlite with --log-dir, none without)")
    p.add_argument("--config", default="{}", help="more GatewayConfig fields as a JSON object "
                   "(e.g. '{\"max_sessions\": 2000, \"max_pending_requests\": 64}')")
    return p.parse_args(argv)


def trajectory_line(traj) -> str:
    return json.dumps({"traj_id": traj.traj_id, "episode_id": traj.episode_id, "reward": traj.reward,
                       "prompt_tokens": int(traj.prompt_ids.size), "output_tokens": int(traj.output_ids.size),
                       "sampled_tokens": int(traj.loss_mask.sum()), "end_reason": traj.meta.get("end_reason")})


async def serve(args, log) -> None:
    # lazy: tests and benchmarks import Child from here into their own process, which must stay free of
    # torch, the engine and the gateway's app (they run in the child only)
    import torch

    from areal_bus.engines.torch_engine import TorchRolloutEngine
    from areal_bus.config.node_configs import GatewayConfig
    from areal_bus.tasks.runner import load_tokenizer
    from nodes.gateway.app import bound_port, make_app, start_server
    from nodes.gateway.backend import LocalEngineBackend
    from nodes.gateway.wal import GatewayWAL, wal_path

    torch.set_num_threads(args.threads)
    token = os.environ.get("AREAL_BUS_ADMIN_TOKEN", "")
    if not token:  # GatewayConfig takes an empty token as none; a gateway without one must not start
        raise SystemExit("AREAL_BUS_ADMIN_TOKEN is not set: export it (8+ characters) before starting the gateway")
    cfg = GatewayConfig(admin_token=token, host=args.host, port=args.port, max_context_tokens=args.max_len,
                        **json.loads(args.config))
    backend = LocalEngineBackend(TorchRolloutEngine(args.model, max_batch=args.max_batch, max_len=args.max_len))
    out = open(args.trajectories, "a", buffering=1) if args.trajectories else None
    path = args.wal or (wal_path(args.log_dir, "gateway-standalone") if args.log_dir else None)
    wal = GatewayWAL(path, fsync=cfg.wal_fsync) if path is not None and cfg.wal else None

    def emit(traj) -> None:
        if out is not None:
            out.write(trajectory_line(traj) + "\n")  # line-buffered: in the kernel once written
        if wal is not None:  # the file is this gateway's trainer: written is accepted
            wal.forget([traj.traj_id])

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = await start_server(make_app(cfg, backend, load_tokenizer(args.model), emit=emit, log=log, wal=wal), cfg)
    try:
        print(f"READY port={bound_port(runner)} pid={os.getpid()}", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()  # ends every open session: their trajectories are written
        backend.close()
        if out is not None:
            out.close()
        if wal is not None:
            wal.close()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (a killed test run
    leaves no gateway behind). Linux only; elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Child:
    """This gateway as a child process (tests, benchmarks): started with ``args`` (this module's options)
    and ``token`` in its environment, ready once it printed READY. Its stdout and stderr go to
    ``output`` (a file: a pipe nobody reads would block it). ``rss_bytes()`` and ``open_fds()`` read
    /proc; ``stop()`` sends SIGTERM (open sessions are ended and written) and waits."""

    def __init__(self, args: list[str], token: str, *, output: Path, ready_timeout_s: float = 120.0):
        import subprocess
        import time

        env = dict(os.environ, AREAL_BUS_ADMIN_TOKEN=token, PYTHONUNBUFFERED="1")
        self.output = output
        with open(output, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "nodes.gateway.standalone", *args], cwd=ROOT,
                                         env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + ready_timeout_s
        while b"READY port=" not in (text := output.read_bytes()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"standalone gateway not ready within {ready_timeout_s:.0f} s (exit "
                                   f"{self.proc.returncode}); its output: {output}")
            time.sleep(0.05)
        self.port = int(text.split(b"READY port=")[1].split()[0])
        self.url = f"http://127.0.0.1:{self.port}"

    def rss_bytes(self) -> int:
        for row in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if row.startswith("VmRSS:"):
                return int(row.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc status")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; the exit code."""
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def main(argv=None) -> int:
    args = parse_args(argv)
    if len(os.environ.get("AREAL_BUS_ADMIN_TOKEN", "")) < 8:
        print("standalone gateway: export AREAL_BUS_ADMIN_TOKEN (8+ characters) first", file=sys.stderr)
        return 2
    from areal_bus.runtime.logs import setup_logging  # lazy: as serve's imports, kept out of Child's importers

    log = setup_logging("gateway", args.log_dir, node="gateway-standalone")
    import uvloop

    uvloop.run(serve(args, log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
