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

Across hosts, ``render(..., host=H)`` (`areal-bus render T --host H`) writes H's conf: the programs
areal_bus/config/placement.py places on H (the trainer's rank launcher ``trainer-<node rank>`` and a weight relay
``weights-<i>`` where the topology needs them), the endpoints of the others in its header, and
torchrun's environment (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, NODE_RANK) on the trainer's programs.

Where the topology places GPUs (``nodes.rollout.gpus``, ``nodes.trainer.gpus``), each rollout worker and
trainer program gets its CUDA_VISIBLE_DEVICES (placement.visible_gpus); a topology without them renders
as it always did.
"""

from __future__ import annotations

import os
from pathlib import Path

from areal_bus.config import placement
from areal_bus.launch.runend import EVENTS
from areal_bus.config.topology import CHANNEL_OWNERS, Topology

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


def _command(kind: str, replica: int, topo_rel: str, host: str | None) -> str:
    if host is not None and kind == "trainer" and replica > 0:
        # The trainer's ranks on another host than rank 0's: a launcher that starts them (torch_dp).
        return f"python -m areal_bus.engines.torch_dp --topology %(here)s/{topo_rel}"
    return f"areal-bus node {kind} --topology %(here)s/{topo_rel} --replica {replica}"


def _environment(topo: Topology, kind: str, replica: int, host: str | None) -> str:
    env = placement.rank_env(topo, replica) if host is not None and kind == "trainer" else {}
    gpus = placement.visible_gpus(topo, kind, replica)
    if gpus is not None:  # its GPUs (nodes.<kind>.gpus); a trainer's ranks inherit them from this program
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    return PATH_ENV + "".join(f',{k}="{v}"' for k, v in env.items())


def _program(kind: str, replica: int, topo_rel: str, sup: str, topo: Topology, host: str | None = None) -> list[str]:
    # Nothing here may depend on the number of replicas: a line that did would change every
    # replica's config on a rescale, and `update` would restart them all.
    name = program_name(kind, replica)
    return [
        f"[program:{name}]",
        f"command={_command(kind, replica, topo_rel, host)}",
        "directory=%(here)s",
        _environment(topo, kind, replica, host),
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


def _watched(topo: Topology, host: str | None, programs: list[tuple[str, int]]) -> str:
    """The program whose expected exit ends this host's run: the trainer (rank 0) on its host, a rank
    launcher (its ranks exit 0 when rank 0 stops them), else a weight relay (it exits 0 when the
    trainer's run state says finished)."""
    for kind in ("trainer", "weights"):
        mine = sorted(r for k, r in programs if k == kind)
        if mine:
            return program_name(kind, mine[0])
    return program_name("trainer", 0)


def _host_header(topo: Topology, host: str) -> list[str]:
    lines = [f"; Host {host} of {', '.join(placement.hosts(topo))}: only the programs the topology places here.",
             "; Copy the same topology, its model folder and the CURVE key folder to every host; render and",
             "; start each host's own conf there (`supervisord -c` it, or `areal-bus run` it).",
             "; Where this host finds the others (as every node computes them from the topology):"]
    for channel in sorted(CHANNEL_OWNERS, key=lambda c: (CHANNEL_OWNERS[c], c)):
        if topo.replicas(CHANNEL_OWNERS[channel]) == 0:
            continue
        lines.append(f";   {channel:8s} {topo.endpoint(channel)}  ({CHANNEL_OWNERS[channel]})")
    if len(placement.trainer_hosts(topo)) > 1:
        addr, port = placement.rendezvous(topo)
        lines.append(f";   trainer ranks rendezvous (torch.distributed env://) at {addr}:{port}, "
                     f"{placement.ranks_per_host(topo)} per host on {', '.join(placement.trainer_hosts(topo))}")
    for far in placement.far_rollout_hosts(topo):
        lines.append(f";   weights for rollout on {far} (no shared memory with the trainer): "
                     f"{placement.relay_endpoint(topo, far)}")
    return lines + [""]


def render(topo: Topology, topology_path: str | os.PathLike, conf_dir: str | os.PathLike,
           host: str | None = None) -> str:
    """The supervisord.conf for every program (``host`` None: one host runs everything, today's
    single file) or for the programs the topology places on ``host`` (raises ValueError for a host
    it does not name)."""
    topo_rel = os.path.relpath(Path(topology_path).resolve(), Path(conf_dir).resolve())
    if host is not None and host not in placement.hosts(topo):
        raise ValueError(f"--host {host}: the topology places nothing there; its hosts are "
                         f"{', '.join(placement.hosts(topo))}")
    if host is None and placement.multi_host(topo) and any(
            placement.gpus_of(topo, k, 0) is not None for k in ("rollout", "trainer")):
        raise ValueError(f"nodes.rollout.gpus / nodes.trainer.gpus index the GPUs of each host, and this topology "
                         f"spans {', '.join(placement.hosts(topo))}: render each host's conf (--host ADDR)")
    programs = placement.programs_on(topo, host)
    log_dir = _here(topo.logging.log_dir.rstrip("/"))
    sup = f"{log_dir}/supervisor"
    how = f"areal-bus render {topo_rel}" + ("" if host is None else f" --host {host}")
    out = [
        f"; areal_bus {topo.name}: rendered from {topo_rel} by `{how}`.",
        "; Do not edit: edit the topology, re-render, then `supervisorctl -c supervisord.conf update`.",
        "",
        *(_host_header(topo, host) if host is not None else []),
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
    for kind, replica in sorted(programs, key=lambda p: (PRIORITY[p[0]], p[0], p[1])):
        out += _program(kind, replica, topo_rel, sup, topo, host)
    out += [
        "[eventlistener:run_end]",
        f"command=areal-bus run-end --program {_watched(topo, host, programs)}",
        f"events={EVENTS}",
        "directory=%(here)s",
        PATH_ENV,
        "autorestart=true",
        f"stderr_logfile={sup}/run_end.log",
        "",
    ]
    return "\n".join(out)


def write_conf(topo: Topology, topology_path, out_path, host: str | None = None) -> Path:
    out_path = Path(out_path)
    text = render(topo, topology_path, out_path.parent, host)
    # supervisord refuses to start if its log folders are missing; make them next to the conf.
    log_dir = Path(topo.logging.log_dir)
    (log_dir if log_dir.is_absolute() else out_path.parent / log_dir).joinpath("supervisor").mkdir(
        parents=True, exist_ok=True)
    out_path.write_text(text)
    return out_path
