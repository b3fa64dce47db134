"""Which host runs which process of a topology: what `areal-bus render --host` writes for each host, where
the trainer's ranks rendezvous, and which hosts need the weights sent to them.

A host is named by its address, as the topology writes it (``endpoints.host`` for every kind without
its own; ``nodes.<kind>.host``; ``nodes.trainer.hosts`` / ``nodes.rollout.hosts`` for kinds spread
over several). ZeroMQ binds addresses, not names, so the address is the name.

- Trainer ranks (``train_workers`` = dp x tp) go in equal contiguous blocks over ``nodes.trainer.hosts``:
  host i runs ranks ``i*k .. i*k+k-1`` (k = ranks per host) as torchrun's NODE_RANK i would, so the
  ranks of one tensor-parallel group stay on one host. Rank 0 is the trainer node (the only rank on
  the bus) and binds the rendezvous (MASTER_ADDR = the first host, MASTER_PORT = base_port +
  RENDEZVOUS_PORT_OFFSET). Each other host runs one launcher program, ``trainer-<node rank>``
  (``python -m areal_bus.engines.torch_dp``), which starts that host's ranks.
- Rollout replica r runs on ``nodes.rollout.hosts[r % n]``.
- GPUs (``nodes.rollout.gpus``: one index per replica; ``nodes.trainer.gpus``: one per rank) are indices
  on the host each process runs on. The render sets every such program's CUDA_VISIBLE_DEVICES
  (``visible_gpus``): a rollout worker's own GPU first; a trainer program's the GPUs of its host's ranks
  in local rank order, so rank LOCAL_RANK takes cuda:LOCAL_RANK (torch_parallel.rank_device). Without
  ``gpus`` nothing is set: ``model.device`` / ``model.trainer_device`` place them, as before.
- A host that runs rollout and is not the trainer's (rank 0's) host shares no memory with it: it runs a
  weight relay, ``weights-<i>`` (i >= 1, the i-th such host), which receives every version over the
  bus's chunked CURVE transfer (areal_bus/weights/transfer.py) into that host's shared memory.

Every function takes a validated ``Topology`` (or, for ``check``, one being validated: config/root.py
calls it); this module never imports the schema, which imports it.
"""

from __future__ import annotations

from areal_bus.config.base import NODE_KINDS

RENDEZVOUS_PORT_OFFSET = 700
"""torch.distributed's TCPStore on the trainer's first host: base_port + 700 (the bus's channels take
offsets 0-699, the weight relays RELAY_PORT_OFFSET)."""
RELAY_PORT_OFFSET = 800
"""Each far host's weight relay binds its chunk channel at base_port + 800 on its own address."""
WEIGHT_GROUP_PORT_OFFSET = 810
"""The weight group's store (areal_bus/weights/dist_group.py), served by the broadcaster at base_port + 810
on its host; the relays of far hosts connect to it (``endpoints.far_weights``)."""
SPREAD_KINDS = ("trainer", "rollout")
HOST_ADDR_ENV = "AREAL_BUS_HOST_ADDR"
"""This host's address, on the trainer's programs: gloo and NCCL are told the interface that holds it
(GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME), since the host name may resolve to loopback."""
"""The kinds whose processes may be spread over several hosts (``nodes.<kind>.hosts``)."""


def default_host(topo) -> str:
    return topo.endpoints.host


def host_of(topo, kind: str, replica: int = 0) -> str:
    """The host that runs ``kind``'s replica ``replica`` (for the trainer: its rank 0, the node)."""
    spec = topo.nodes.get(kind)
    if spec is not None and spec.hosts:
        return spec.hosts[0] if kind == "trainer" else spec.hosts[replica % len(spec.hosts)]
    if spec is not None and spec.host != "localhost":
        return spec.host
    return default_host(topo)


def trainer_hosts(topo) -> list[str]:
    """The trainer's hosts by node rank (NODE_RANK i runs on element i)."""
    spec = topo.nodes.get("trainer")
    return list(spec.hosts) if spec is not None and spec.hosts else [host_of(topo, "trainer")]


def ranks_per_host(topo) -> int:
    return topo.train_workers // len(trainer_hosts(topo))


def rendezvous(topo) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) of the trainer's ranks when they span hosts."""
    return trainer_hosts(topo)[0], topo.endpoints.base_port + RENDEZVOUS_PORT_OFFSET


def multi_host(topo) -> bool:
    return len(hosts(topo)) > 1


def hosts(topo) -> list[str]:
    """Every host that runs a process of this topology, the bus's first."""
    seen: list[str] = []
    for host, _ in _processes(topo):
        if host not in seen:
            seen.append(host)
    return seen


def far_rollout_hosts(topo) -> list[str]:
    """Hosts that run rollout but not the trainer's rank 0: the weights must be sent to them."""
    home = host_of(topo, "trainer")
    far: list[str] = []
    for r in range(topo.replicas("rollout")):
        h = host_of(topo, "rollout", r)
        if h != home and h not in far:
            far.append(h)
    return far


def relay_replica(topo, host: str) -> int | None:
    """The weights replica that relays versions to ``host`` (1, 2, ...), or None if it needs none."""
    far = far_rollout_hosts(topo)
    return far.index(host) + 1 if host in far else None


def relay_host(topo, replica: int) -> str:
    """The far host weights replica ``replica`` (>= 1) relays to."""
    far = far_rollout_hosts(topo)
    if not 1 <= replica <= len(far):
        raise ValueError(f"weights replica {replica}: this topology has {len(far)} far rollout host(s) "
                         f"({', '.join(far) or 'none'}); replica 0 is the broadcaster")
    return far[replica - 1]


def relay_endpoint(topo, host: str) -> str:
    return f"tcp://{host}:{topo.endpoints.base_port + RELAY_PORT_OFFSET}"


def _processes(topo):
    """(host, (kind, replica)) of every process; kind 'trainer' replicas > 0 are the rank launchers of
    the trainer's other hosts (node rank = replica)."""
    for kind in NODE_KINDS:
        for replica in range(topo.replicas(kind)):
            yield host_of(topo, kind, replica), (kind, replica)
    for node_rank, host in enumerate(trainer_hosts(topo)[1:], start=1):
        yield host, ("trainer", node_rank)
    for i, host in enumerate(far_rollout_hosts(topo), start=1):
        yield host, ("weights", i)


def programs_on(topo, host: str | None) -> list[tuple[str, int]]:
    """(kind, replica) of every program ``host`` runs; None: every program on one host (today's single
    conf, which runs no relay and no rank launcher: its trainer starts all its ranks itself)."""
    if host is None:
        return [(k, r) for k in NODE_KINDS for r in range(topo.replicas(k))]
    return [p for h, p in _processes(topo) if h == host]


def rank_env(topo, node_rank: int) -> dict[str, str]:
    """torchrun's environment for the ranks of ``node_rank`` (rank 0's host: 0), or {} when the trainer
    runs on one host (its ranks then rendezvous on loopback, torch_dp picks the port)."""
    if len(trainer_hosts(topo)) == 1:
        return {}
    addr, port = rendezvous(topo)
    return {"MASTER_ADDR": addr, "MASTER_PORT": str(port), "WORLD_SIZE": str(topo.train_workers),
            "NODE_RANK": str(node_rank), "LOCAL_WORLD_SIZE": str(ranks_per_host(topo)),
            HOST_ADDR_ENV: trainer_hosts(topo)[node_rank]}


def gpus_of(topo, kind: str, replica: int) -> list[int] | None:
    """The GPUs, by index on its host, the topology gives rollout replica ``replica`` or trainer
    program ``replica`` (node rank n: the ranks n*k .. n*k+k-1 of its host, in local rank order), or
    None where it gives none (``nodes.<kind>.gpus`` absent: today's ``model.device`` placement)."""
    spec = topo.nodes.get(kind)
    gpus = getattr(spec, "gpus", None) if spec is not None else None
    if not gpus:
        return None
    if kind == "trainer":
        k = ranks_per_host(topo)
        return list(gpus[replica * k:(replica + 1) * k])
    entry = gpus[replica]
    return list(entry) if isinstance(entry, list) else [entry]


def visible_gpus(topo, kind: str, replica: int) -> list[int] | None:
    """CUDA_VISIBLE_DEVICES of program ``<kind>-<replica>``: its own GPUs, so ``cuda`` (cuda:0) is its
    first; None leaves the variable as the host has it. Only its own: a rollout worker opens the
    trainer's CUDA IPC weight buffers on its own GPU as peer memory (areal_bus/weights/cuda.py), and
    cudaIpcOpenMemHandle opens handles of GPUs the process does not see."""
    return gpus_of(topo, kind, replica)


def _check_gpus(topo) -> None:
    """``nodes.rollout.gpus`` / ``nodes.trainer.gpus``: one entry per process, on a GPU device, no GPU
    given twice to one kind on one host (a rollout worker and a trainer rank may share one)."""
    rollout, trainer = topo.nodes.get("rollout"), topo.nodes.get("trainer")
    kinds = []
    if rollout is not None and rollout.gpus:
        kinds.append(("rollout", rollout.gpus, "rollout_workers", topo.rollout_workers, "model.device",
                      topo.model.device, lambda r: host_of(topo, "rollout", r), "rollout worker"))
    if trainer is not None and trainer.gpus:
        device_field = "model.trainer_device" if topo.model.trainer_device else "model.device"
        kinds.append(("trainer", trainer.gpus, "train_workers", topo.train_workers, device_field,
                      topo.trainer_device, lambda r: trainer_hosts(topo)[r // ranks_per_host(topo)], "trainer rank"))
    for kind, gpus, count_field, count, device_field, device, host, who in kinds:
        field = f"nodes.{kind}.gpus"
        if len(gpus) != count:
            raise ValueError(f"{field}: {len(gpus)} entries for {count_field} {count}; give one GPU index per "
                             f"{who}")
        if not device.startswith("cuda"):
            raise ValueError(f"{field} places each {who} on a GPU but {device_field} is {device!r}: set "
                             f"{device_field}: cuda, or leave {field} out")
        if device not in ("cuda", "cuda:0"):
            raise ValueError(f"{device_field} {device!r} with {field}: each {who} sees its own GPUs from cuda:0 "
                             f"on (the render sets CUDA_VISIBLE_DEVICES), so write {device_field}: cuda")
        seen: dict[tuple[str, int], int] = {}
        for r, entry in enumerate(gpus):
            indices = entry if isinstance(entry, list) else [entry]
            if len(indices) > 1:
                raise ValueError(f"{field}[{r}]: {indices} spans {len(indices)} GPUs, but a {who} runs its engine "
                                 f"on one (no rollout engine splits a model over several yet); give one index per "
                                 f"{who}")
            for g in indices:
                if (host(r), g) in seen:
                    where = f" of host {host(r)}" if len(hosts(topo)) > 1 else ""
                    raise ValueError(f"{field}: GPU {g}{where} is given to {who}s {seen[host(r), g]} and {r}; "
                                     f"give each {who} a GPU of its own (a rollout worker and a trainer rank may "
                                     f"share one)")
                seen[host(r), g] = r


def check(topo) -> None:
    """Raise ValueError naming the field when the placement cannot run."""
    for kind, spec in topo.nodes.items():
        if not spec.hosts:
            continue
        field = f"nodes.{kind}.hosts"
        if kind not in SPREAD_KINDS:
            raise ValueError(f"{field}: only {' and '.join(SPREAD_KINDS)} spread over several hosts; "
                             f"give {kind} one host (nodes.{kind}.host)")
        if len(set(spec.hosts)) != len(spec.hosts):
            raise ValueError(f"{field} lists a host twice: {spec.hosts}")
        if spec.host != "localhost" and spec.host != spec.hosts[0]:
            raise ValueError(f"nodes.{kind}.host ({spec.host}) and {field}[0] ({spec.hosts[0]}) disagree; "
                             f"set one of them")
        if kind == "trainer" and topo.train_workers % len(spec.hosts):
            raise ValueError(f"{field}: {topo.train_workers} trainer ranks (train_workers = dp x tp) do not "
                             f"split evenly over {len(spec.hosts)} hosts")
        if kind == "trainer" and topo.parallelism.tp > 1 and ranks_per_host(topo) % topo.parallelism.tp:
            raise ValueError(f"{field}: a tensor-parallel group (tp={topo.parallelism.tp}) must stay on one "
                             f"host; {ranks_per_host(topo)} ranks per host")
    _check_gpus(topo)
    if len(hosts(topo)) > 1 and topo.endpoints.transport != "tcp":
        raise ValueError(f"nodes on several hosts ({', '.join(hosts(topo))}) need endpoints.transport: tcp "
                         f"(ipc reaches only this host)")
    far = far_rollout_hosts(topo)
    if far and topo.rollout_engine.kind != "sim":
        if host_of(topo, "weights") != host_of(topo, "trainer"):
            raise ValueError(f"nodes.weights.host ({host_of(topo, 'weights')}) must be the trainer's host "
                             f"({host_of(topo, 'trainer')}): the broadcaster reads each version from the "
                             f"trainer's shared memory to send it to {', '.join(far)}")
        if topo.trainer_device.startswith("cuda") and topo.endpoints.far_weights == "chunks":
            raise ValueError(f"endpoints.far_weights: chunks reads the trainer's shared memory, and a trainer on "
                             f"a GPU publishes over CUDA IPC; rollout on {', '.join(far)} needs 'group' (or 'auto')")


__all__ = ["host_of", "hosts", "programs_on", "far_rollout_hosts", "rank_env", "rendezvous",
           "relay_endpoint", "relay_host", "relay_replica", "gpus_of", "visible_gpus", "check"]
