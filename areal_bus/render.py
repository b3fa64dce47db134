"""Render a topology to a supervisord.conf: one program per process, ``<kind>-<replica>``.

Why a program per replica and not one per kind with ``numprocs``: ``supervisorctl update`` compares
each process group's whole config with the running one, and a program with numprocs is one group, so
changing its count restarts every process of it. Each replica being a group of its own (no
``[group:...]`` section gathering them, which would be one group again), scaling a kind only adds or
removes the groups of the replicas that came or went: the others' configs are the same, and they keep
running. Every path in the output is relative to the conf's own folder through supervisord's ``%(here)s``, so
the checked-in supervisord.conf is the same bytes on every machine (a test keeps it equal to the
render of topology/default.yaml). Programs restart only on unexpected exits; the trainer exits 0
after max_steps, and the ``run_end`` event listener then shuts supervisord down, so a run ends by
itself. Scaling: edit the topology, re-render, ``supervisorctl -c supervisord.conf update``: added
replicas start, removed ones get SIGTERM (a rollout worker finishes what it runs and leaves, so what
it held is answered or handed back at once), nothing else is touched.
"""

from __future__ import annotations

import os
from pathlib import Path

from areal_bus.runend import EVENTS
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


def program_name(kind: str, replica: int) -> str:
    """The supervisord program (and process) of one replica: also its node id and its log's name."""
    return f"{kind}-{replica}"


def _program(kind: str, replica: int, topo_rel: str, sup: str) -> list[str]:
    # Nothing here may depend on the number of replicas: a line that did would change every
    # replica's config on a rescale, and `update` would restart them all.
    name = program_name(kind, replica)
    return [
        f"[program:{name}]",
        f"command=areal-bus node {kind} --topology %(here)s/{topo_rel} --replica {replica}",
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
        f"stdout_logfile={sup}/{name}.log",
        "stdout_logfile_maxbytes=20MB",
        "stdout_logfile_backups=2",
        "",
    ]


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
        for replica in range(topo.replicas(kind)):
            out += _program(kind, replica, topo_rel, sup)
    out += [
        "[eventlistener:run_end]",
        f"command=areal-bus run-end --program {program_name('trainer', 0)}",
        f"events={EVENTS}",
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
