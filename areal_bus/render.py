"""Render a topology to a supervisord.conf: one program per node kind, numprocs for replicas.

Every path in the output is relative to the conf's own folder through supervisord's ``%(here)s``, so
the checked-in supervisord.conf is the same bytes on every machine (a test keeps it equal to the
render of topology/default.yaml). Programs restart only on unexpected exits; the trainer exits 0
after max_steps, and the ``run_end`` event listener then shuts supervisord down, so a run ends by
itself. Scaling: edit the topology, re-render, ``supervisorctl -c supervisord.conf update``.
"""

from __future__ import annotations

import os
from pathlib import Path

from areal_bus.topology import Topology

# Start order: the hub first, consumers before producers (ZeroMQ reconnects either way; this only
# shortens the first seconds).
PRIORITY = {"bus": 10, "weights": 20, "trainer": 20, "reward": 25, "rollout": 30, "gateway": 35, "agent": 40,
            "probe": 50}
STOP_WAIT_S = 10
"""Seconds supervisord waits after SIGTERM before SIGKILL. Nodes exit within a poll interval plus
LINGER_MS; a trainer mid-update finishes its step first, which the simulated and tiny models do fast."""


# The nodes find `areal-bus` in the checkout's venv first. This goes on each program, not in
# [supervisord] environment: supervisord feeds that section's variables back into its own ENV_*
# expansions, so a PATH referring to %(ENV_PATH)s there grows on every re-read and `supervisorctl
# update` would see every program as changed and restart them all.
PATH_ENV = 'environment=PATH="%(here)s/.venv/bin:%(ENV_PATH)s"'


def _here(path: str) -> str:
    return path if os.path.isabs(path) else f"%(here)s/{path}"


def render(topo: Topology, topology_path: str | os.PathLike, conf_dir: str | os.PathLike) -> str:
    topo_rel = os.path.relpath(Path(topology_path).resolve(), Path(conf_dir).resolve())
    log_dir = _here(topo.logging.log_dir.rstrip("/"))
    sup = f"{log_dir}/supervisor"
    out = [
        f"; areal_bus {topo.name}: rendered from {topo_rel} by `areal-bus render {topo_rel}`.",
        "; Do not edit: edit the topology, re-render, then `supervisorctl -c supervisord.conf update`.",
        "",
        "[supervisord]",
        "nodaemon=true",
        f"logfile={log_dir}/supervisord.log",
        f"pidfile={log_dir}/supervisord.pid",
        f"childlogdir={sup}",
        "directory=%(here)s",
        'environment=PYTHONUNBUFFERED="1"',
        "",
        "[unix_http_server]",
        f"file={log_dir}/supervisor.sock",
        "chmod=0700",
        "",
        "[rpcinterface:supervisor]",
        "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
        "",
        "[supervisorctl]",
        f"serverurl=unix://{log_dir}/supervisor.sock",
        "",
    ]
    for kind in sorted(PRIORITY, key=lambda k: (PRIORITY[k], k)):
        n = topo.replicas(kind)
        if n == 0:
            continue
        out += [
            f"[program:{kind}]",
            f"command=areal-bus node {kind} --topology %(here)s/{topo_rel} --replica %(process_num)d",
            "process_name=%(program_name)s-%(process_num)d",
            f"numprocs={n}",
            "directory=%(here)s",
            PATH_ENV,
            f"priority={PRIORITY[kind]}",
            "autostart=true",
            "autorestart=unexpected",
            "exitcodes=0",
            "startsecs=1",
            "startretries=20",
            "stopsignal=TERM",
            f"stopwaitsecs={STOP_WAIT_S}",
            "stopasgroup=true",
            "killasgroup=true",
            "redirect_stderr=true",
            f"stdout_logfile={sup}/%(program_name)s-%(process_num)d.log",
            "stdout_logfile_maxbytes=20MB",
            "stdout_logfile_backups=2",
            "",
        ]
    out += [
        "[eventlistener:run_end]",
        "command=areal-bus run-end --program trainer",
        "events=PROCESS_STATE_EXITED",
        "directory=%(here)s",
        PATH_ENV,
        "autorestart=true",
        f"stderr_logfile={sup}/run_end.log",
        "",
    ]
    return "\n".join(out)


def write_conf(topo: Topology, topology_path, out_path) -> Path:
    out_path = Path(out_path)
    text = render(topo, topology_path, out_path.parent)
    # supervisord refuses to start if its log folders are missing; make them next to the conf.
    log_dir = Path(topo.logging.log_dir)
    (log_dir if log_dir.is_absolute() else out_path.parent / log_dir).joinpath("supervisor").mkdir(
        parents=True, exist_ok=True)
    out_path.write_text(text)
    return out_path
