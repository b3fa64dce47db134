"""The weight group on the bus: the broadcaster's side (``GroupSender``) and a far host's relay's side
(``GroupReceiver``) of areal_bus/weights/dist_group.py, as nodes/weights.py runs them with
``endpoints.far_weights`` group (or auto with the trainer on a GPU).

The sender forms a generation of itself (rank 0) and every live relay (ranks 1.., by node id), and forms
the next whenever that set changes by the bus's liveness (a relay silent for HEARTBEAT_INTERVAL_S x
HEARTBEAT_LIVENESS, or a new incarnation), so a vanished host is noticed in about 2 s, not after a
collective's timeout. Control messages, one msgpack frame each on the relay's CURVE chunk channel
(``placement.relay_endpoint``; a chunk is two frames):

    group    {kind, gen, rank, size, addr, port, backend, token}: join generation ``gen`` (repeated
             every HEARTBEAT_INTERVAL_S while it forms, so one lost to a reconnect heals)
    version  {kind, gen, token, version, lineage, total, bucket, manifest, layout_crc}: the buckets of
             this version come next, ``total`` bytes in broadcasts of ``bucket``
    done     {kind, gen, token, version, lineage, sha256}: every bucket went out and the trainer's
             buffer still held the version; on CPU, the sha256 of its bytes (empty on a GPU)

A relay commits a version once every bucket landed and the ``done`` came (and its sha256 matches), then
acks it on the hub as with chunks; the broadcaster announces a version once every live relay acked it
(nodes/weights.py). A version not acked is broadcast again after ``resend_s``.
"""

from __future__ import annotations

import hashlib
import time

import msgpack
import zmq

from areal_bus.config import placement
from areal_bus.constants import HEARTBEAT_INTERVAL_S
from areal_bus.runtime.node import NodeShell
from areal_bus.version import PolicyVersion
from areal_bus.wire import messages as m


def group_backend(topo) -> str | None:
    """'nccl' or 'gloo' when versions reach the far hosts over the weight group, None when over the
    chunk channel (or when there is nothing to send: no far host, or simulated engines)."""
    if not placement.far_rollout_hosts(topo) or topo.rollout_engine.kind == "sim":
        return None
    gpu = topo.trainer_device.startswith("cuda")
    if topo.endpoints.far_weights == "chunks" or (topo.endpoints.far_weights == "auto" and not gpu):
        return None
    return "nccl" if gpu else "gloo"


def _control(sock, doc: dict) -> bool:
    """A control message of the weight group (one msgpack frame; chunks are two). False if it did not fit."""
    try:
        sock.send(msgpack.packb(doc), flags=zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


class GroupSender:
    """The broadcaster's side of the weight group (areal_bus/weights/dist_group.py): a generation of itself
    (rank 0) and every live relay, formed again whenever that set changes (by the bus's liveness, so a
    vanished host is noticed in HEARTBEAT_INTERVAL_S x HEARTBEAT_LIVENESS), and the current version
    broadcast to it, in buckets, whenever a member lacks it."""

    def __init__(self, shell: NodeShell, relays: dict, backend: str, resend_s: float, base=None):
        from areal_bus.weights import dist_group  # lazy: torch, which the chunk path's broadcaster never loads

        self.dg, self.shell, self.relays, self.backend, self.base = dist_group, shell, relays, backend, base
        self.resend_s = resend_s
        self.addr = placement.host_of(shell.topo, "weights")
        self.port = shell.topo.endpoints.base_port + placement.WEIGHT_GROUP_PORT_OFFSET
        self.store = dist_group.serve_store(self.addr, self.port)
        self.token = dist_group.new_token()
        self.n, self.gen, self.members = 0, None, {}  # members: relay node id -> its incarnation
        self.planned_at = self.next_form = 0.0
        self.transfer = self.src = None
        self.sent: tuple | None = None  # (PolicyVersion, generation, when) of the last whole broadcast
        self.cuda = None  # (handles file stamp, CudaWeightReader): a GPU trainer's buffers, opened once

    def step(self, cur: m.VersionAnnounce | None, now: float) -> None:
        live = {p.node_id: p.incarnation for p in self.shell.peers.alive("weights") if p.node_id in self.relays}
        if self.gen is not None:
            state = self.gen.poll()
            if state in ("failed", "aborted"):
                self._lose(self.gen.error, now)
            elif live != self.members:
                gone = sorted(n for n in self.members if live.get(n) != self.members[n])
                self._lose(f"members changed (gone or restarted: {', '.join(gone) or 'none'}; "
                           f"new: {', '.join(sorted(set(live) - set(self.members))) or 'none'})", now)
        if self.gen is None and live and now >= self.next_form:
            self._form(live, now)
        if self.gen is None or self.gen.poll() != "ready":
            if self.gen is not None and now - self.planned_at >= HEARTBEAT_INTERVAL_S:
                self._send_plans(now)  # repeated while forming: a plan lost to a reconnecting relay heals
            return
        if self.gen.formed_s is not None and self.planned_at >= 0:
            self.planned_at = -1.0  # logged once per generation
            self.shell.metrics.inc("group_formed")
            self.shell.log.info("group_formed", gen=self.gen.gen, size=self.gen.size, ms=round(self.gen.formed_s * 1000, 1))
        if self.transfer is None and cur is not None and cur.location and self._due(cur, now):
            self._start(cur, now)
        if self.transfer is not None:
            try:
                whole = self.transfer.pump()
            except self.dg.GroupError as exc:
                self._lose(str(exc), now)
                return
            if whole:
                self._finish(now)

    def _due(self, cur: m.VersionAnnounce, now: float) -> bool:
        pv = PolicyVersion.of(cur)
        if all(self.relays[n].holds == pv for n in self.members):
            return False
        return self.sent is None or self.sent[:2] != (pv, self.gen.gen) or now - self.sent[2] > self.resend_s

    def _device(self):
        import torch  # lazy: as in __init__

        if self.backend != "nccl":
            return torch.device("cpu")
        reader = self._cuda_reader()
        return None if reader is None else reader.device

    def _cuda_reader(self):
        # lazy: CUDA IPC only for a GPU trainer
        from areal_bus.weights.cuda import CudaWeightReader, handles_path, load_handles

        path = handles_path(self.shell.topo.ipc_dir(self.base), self.shell.topo.shm_name(self.base))
        if not path.exists():
            return None  # the trainer has not published yet
        stamp = path.stat().st_mtime_ns
        if self.cuda is None or self.cuda[0] != stamp:  # a restarted trainer exports new buffers
            self.cuda = (stamp, CudaWeightReader(load_handles(path)))
        return self.cuda[1]

    def _form(self, live: dict[str, str], now: float) -> None:
        device = self._device()
        if device is None:
            return
        self.n += 1
        self.members = dict(sorted(live.items()))
        self.gen = self.dg.Generation(self.n, 0, 1 + len(live), self.backend, token=self.token, addr=self.addr,
                                      port=self.port, my_addr=self.addr, store=self.store, device=device)
        self.shell.log.info("group_forming", gen=self.n, backend=self.backend, members=",".join(self.members))
        self._send_plans(now)

    def _send_plans(self, now: float) -> None:
        for rank, node_id in enumerate(self.members, start=1):
            _control(self.relays[node_id].sock, self.dg.plan(self.gen.gen, rank, self.gen.size, self.addr,
                                                             self.port, self.backend, self.token))
        self.planned_at = now

    def _lose(self, reason: str, now: float) -> None:
        self.shell.metrics.inc("group_lost")
        self.shell.log.warning("group_lost", gen=self.gen.gen, members=",".join(self.members), reason=reason[:300])
        self.gen.abort(reason)
        self.gen, self.members = None, {}
        self._close_src()
        self.next_form = now + HEARTBEAT_INTERVAL_S  # not a tight loop of generations that cannot form

    def _start(self, cur: m.VersionAnnounce, now: float) -> None:
        if cur.location.startswith("cuda:"):
            from areal_bus.weights.cuda import parse_location  # lazy: as _cuda_reader

            reader = self._cuda_reader()
            _, k, version = parse_location(cur.location)
            flat, total = reader.buffers[k][:reader.layout.nbytes], reader.layout.nbytes
            layout, digest, source, check, close = reader.layout, None, (lambda o, n: flat[o:o + n]), None, None
        else:
            from areal_bus.weights.shm import MappedSegment, parse_location, segment_path  # lazy: as __init__

            name, k, version = parse_location(cur.location)
            seg = MappedSegment(segment_path(name, k), writable=False)
            state = seg.committed()
            if state is None or state[1] != version:  # the buffer moved on: a newer version follows
                seg.close()
                return
            data = seg.data()
            flat, total, layout, digest = self.dg.bytes_tensor(data, writable=False), len(data), seg.layout, hashlib.sha256()

            def source(off: int, n: int):
                digest.update(data[off:off + n])  # in order: the sha256 of the trainer's bytes, for the relay's check
                return flat[off:off + n]

            def check() -> bool:
                return seg.committed() == state

            def close() -> None:
                nonlocal flat
                flat = None
                try:
                    data.release()
                except BufferError:  # tolerated: an aborted collective still views it; unmapped with its last view
                    pass
                seg.close()
        head = {"kind": "version", "gen": self.gen.gen, "token": self.token, "version": version,
                "lineage": cur.lineage, "total": total, "bucket": self.dg.BUCKET_BYTES,
                "manifest": layout.manifest.decode(), "layout_crc": layout.crc}
        if not all(_control(self.relays[n].sock, head) for n in self.members):
            if close is not None:
                close()
            self._lose("a member's control channel is full", now)
            return
        self.src = (cur, digest, check, close)
        self.transfer = self.dg.Transfer(self.gen, total, source)
        self.shell.metrics.inc("relay_sends")

    def _finish(self, now: float) -> None:
        cur, digest, check, _ = self.src
        secs = self.transfer.seconds
        if check is not None and not check():
            self.shell.log.warning("relay_overwritten", version=cur.version, detail="the buffer moved on mid-broadcast")
            self._close_src()
            return
        sha = digest.hexdigest() if digest is not None else ""
        done = {"kind": "done", "gen": self.gen.gen, "token": self.token, "version": cur.version,
                "lineage": cur.lineage, "sha256": sha}
        for node_id in self.members:
            _control(self.relays[node_id].sock, done)
            self.shell.log.info("relay_sent", version=cur.version, lineage=cur.lineage, to=self.relays[node_id].host,
                                sha256=sha, gen=self.gen.gen, buckets=self.transfer.count, ms=round(secs * 1000, 1),
                                gbps=round(self.transfer.total / max(secs, 1e-9) / 1e9, 3))
        self.sent = (PolicyVersion.of(cur), self.gen.gen, now)
        self._close_src()

    def _close_src(self) -> None:
        self.transfer = None
        if self.src is not None and self.src[3] is not None:
            self.src[3]()
        self.src = None


class GroupReceiver:
    """A relay's side of the weight group: joins each generation the broadcaster plans, receives each
    version's buckets straight into a free buffer of this host's weight set (through a device staging
    buffer over NCCL), and commits it once whole and, where a sha256 came, matching. A member that
    already holds the version (the others lacked it) takes the buckets into scratch buffers."""

    def __init__(self, shell: NodeShell, name: str, host: str):
        import torch  # lazy: torch, which the chunk path's relay loads only with its first chunk

        from areal_bus.weights import dist_group  # lazy: as torch

        self.torch, self.dg, self.shell, self.name, self.host = torch, dist_group, shell, name, host
        self.gen, self.plan = None, None
        self.writer, self.lineage = None, None
        self.rx: dict | None = None  # the version being received
        dev = shell.topo.model.device
        self.device = torch.device("cpu") if not dev.startswith("cuda") else torch.device(dev)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)

    def control(self, doc: dict, holds: PolicyVersion) -> None:
        """A control message from the broadcaster (ValueError for a malformed one)."""
        kind = doc.get("kind")
        if kind == "group":
            p = self.dg.check_plan(doc)
            if self.plan is not None and (p["token"], p["gen"]) == (self.plan["token"], self.plan["gen"]):
                return  # the plan repeated while the generation forms
            self.drop("a newer generation is planned")
            self.plan = p
            self.gen = self.dg.Generation(p["gen"], p["rank"], p["size"], p["backend"], token=p["token"],
                                          addr=p["addr"], port=p["port"], my_addr=self.host,
                                          device=self.device if p["backend"] == "nccl" else None)
            self.shell.log.info("group_joining", gen=p["gen"], rank=p["rank"], size=p["size"], backend=p["backend"])
        elif kind in ("version", "done"):
            if self.plan is None or (doc.get("token"), doc.get("gen")) != (self.plan["token"], self.plan["gen"]):
                raise ValueError(f"{kind} of generation {doc.get('gen')}, not this relay's")
            if kind == "version":
                self._begin(doc, holds)
            elif self.rx is not None and (doc.get("version"), doc.get("lineage")) == (self.rx["version"],
                                                                                       self.rx["lineage"]):
                self.rx["sha256"] = str(doc.get("sha256", ""))
        else:
            raise ValueError(f"unknown control message kind {kind!r}")

    def _begin(self, doc: dict, holds: PolicyVersion) -> None:
        from areal_bus.weights.shm import Layout, ShmWeightWriter, WeightShmError  # lazy: as __init__

        try:
            version, lineage, total, bucket = (int(doc["version"]), str(doc["lineage"]), int(doc["total"]),
                                               int(doc["bucket"]))
            manifest, crc = str(doc["manifest"]), int(doc["layout_crc"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed version message: {exc!r}") from None
        if not 0 < bucket <= 1 << 32 or total <= 0:
            raise ValueError(f"version message out of range: total {total}, bucket {bucket}")
        self._abandon()
        if lineage != self.lineage:  # a restarted trainer: its own versions from here
            self._close_writer()
            self.lineage = lineage
        if self.writer is not None and self.writer.layout.crc != crc:
            self._close_writer()
        if self.writer is None:
            self.writer = ShmWeightWriter(self.name, Layout.from_manifest(manifest))
        if total != self.writer.nbytes:
            raise ValueError(f"version {version}: {total} bytes for a layout of {self.writer.nbytes}")
        latest = self.writer.ledger.latest
        data = None
        if PolicyVersion(lineage, version) > holds and (latest is None or version > latest):
            try:
                data = self.writer.begin(version)
            except WeightShmError as exc:  # tolerated: local readers hold both buffers; sent again later
                self.shell.log.warning("group_busy", version=version, error=str(exc)[:200])
        torch, n = self.torch, min(bucket, total)
        dst = None if data is None else self.dg.bytes_tensor(data)
        if dst is not None and self.device.type == "cpu":
            source, landed = (lambda o, k: dst[o:o + k]), None
        else:  # a device staging buffer per bucket in flight (NCCL), or scratch for a version not kept
            slots = [torch.empty(n, dtype=torch.uint8, device=self.device if self.plan["backend"] == "nccl" else "cpu")
                     for _ in range(self.dg.INFLIGHT)]

            def source(o: int, k: int):
                return slots[(o // bucket) % len(slots)][:k]

            def landed(o: int, k: int, t) -> None:
                if dst is not None:
                    dst[o:o + k].copy_(t)
        self.rx = {"version": version, "lineage": lineage, "data": data, "sha256": None, "t0": time.monotonic(),
                   "transfer": self.dg.Transfer(self.gen, total, source, landed, bucket_bytes=bucket)}

    def step(self) -> tuple[PolicyVersion, str, str] | None:
        """Pump the version in flight; (version, local location, sha256) once one is committed."""
        if self.gen is None:
            return None
        home = self.shell.peers.peers.get("weights-0")
        if home is not None and not home.alive:
            self.drop("the broadcaster is gone")
            return None
        state = self.gen.poll()
        if state in ("failed", "aborted"):
            self.drop(self.gen.error)
            return None
        if self.gen.formed_s is not None and not self.plan.get("logged"):
            self.plan["logged"] = True
            self.shell.log.info("group_formed", gen=self.gen.gen, ms=round(self.gen.formed_s * 1000, 1))
        rx = self.rx
        if state != "ready" or rx is None:
            return None
        try:
            whole = rx["transfer"].pump()
        except self.dg.GroupError as exc:
            self.drop(str(exc))
            return None
        if not whole or rx["sha256"] is None:
            return None
        self.rx = None
        if rx["data"] is None:
            return None  # held already (or no free buffer): nothing to commit
        got = hashlib.sha256(rx["data"]).hexdigest()
        rx["transfer"] = None
        if rx["sha256"] and got != rx["sha256"]:
            self.shell.metrics.inc("relay_versions_refused")
            self.shell.log.warning("group_refused", version=rx["version"], got=got[:16], sent=rx["sha256"][:16])
            self._release(rx)
            self.writer.abort()
            return None
        self._release(rx)
        location = self.writer.commit(rx["version"])
        self.shell.log.info("received", version=rx["version"], location=location, sha256=got, nbytes=self.writer.nbytes,
                            gen=self.gen.gen, ms=round((time.monotonic() - rx["t0"]) * 1000, 1))
        return PolicyVersion(rx["lineage"], rx["version"]), location, got

    def busy(self) -> bool:
        return self.rx is not None

    def drop(self, reason: str) -> None:
        """Leave the generation (a newer one is planned, or it failed): the version in flight is abandoned."""
        if self.gen is not None:
            self.shell.metrics.inc("group_lost")
            self.shell.log.warning("group_lost", gen=self.gen.gen, reason=reason[:300])
            self.gen.abort(reason)
        self.gen, self.plan = None, None
        self._abandon()

    def _abandon(self) -> None:
        if self.rx is not None:
            rx, self.rx = self.rx, None
            rx["transfer"] = None
            if rx["data"] is not None:
                self._release(rx)
                self.writer.abort()

    @staticmethod
    def _release(rx: dict) -> None:
        try:
            rx["data"].release()
        except BufferError:  # tolerated: an aborted collective still views it; the mapping goes with it
            pass

    def _close_writer(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def close(self) -> None:
        self.drop("closing")
        self._close_writer()


__all__ = ["GroupReceiver", "GroupSender", "group_backend"]
