"""The node shell: what every node process has, whatever its kind.

A shell owns the ZeroMQ context, the node's hub sockets (a PUB into the bus node, a SUB out of it),
its logger and metrics, a heartbeat thread, the table of live peers and the node's view of the
current policy version. Node kinds (``nodes/``) keep their logic in a core class that owns no
sockets and use a shell to reach the bus.

The heartbeat thread has a PUB socket of its own (ZeroMQ sockets are not thread-safe), so a node in
a long compute step (a trainer update) keeps heartbeating and is not taken for dead. It goes on after
SIGTERM until the node closes or ``leave``s, so a node finishing its work on the way out (a rollout
worker removed by a rescale) is not taken for dead meanwhile. A node that exits on purpose says so
(``leave``, which ``close`` does): peers take it for dead at once instead of after the liveness
timeout, so what it held is reissued now. A node killed outright says nothing; the timeout covers it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import zmq

from areal_bus.wire import messages as m
from areal_bus.wire.channels import Receiver, open_socket
from areal_bus.wire.codec import Encoder, pack_topic
from areal_bus.constants import HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS, LINGER_MS, PUB_HWM
from areal_bus.runtime.logs import log_failures, setup_logging
from areal_bus.runtime.metrics import Metrics
from areal_bus.wire.security import bus_context
from areal_bus.config.topology import Topology, dump_resolved
from areal_bus.version import PolicyVersion, VersionTrust


@dataclass
class Peer:
    node_id: str
    kind: str
    incarnation: str
    last_seen: float
    version: int
    inflight: list
    alive: bool = True
    left: bool = False  # said it was leaving: its incarnation's late heartbeats are stale


LEFT = "node_left"
"""The Event a node publishes on the heartbeat topic as it goes (``NodeShell.leave``). On that topic
because every node subscribes to it: liveness news travels with liveness."""

LEAVING = "node_leaving"
"""The Event a rollout worker told to stop sends each gateway over ``gwork`` before it finishes what it
runs: ``fields["held"]`` lists the requests it will still answer; the gateway sends it no new work and
sends its other requests for that worker elsewhere at once."""


class PeerTable:
    """Who is alive, from heartbeats. Pure: time is passed in, so tests drive it directly."""

    def __init__(self, timeout: float = HEARTBEAT_INTERVAL_S * HEARTBEAT_LIVENESS):
        self.timeout = timeout
        self.peers: dict[str, Peer] = {}

    def update(self, hb: m.Heartbeat, now: float) -> str | None:
        """Record a heartbeat. Returns 'joined', 'restarted' or 'revived' when that happened, 'stale'
        for a heartbeat of an incarnation that left (sent before it said so, arriving after: the
        heartbeat thread's socket is not the one that said it), which is not recorded."""
        peer = self.peers.get(hb.node_id)
        if peer is not None and peer.left and peer.incarnation == hb.incarnation:
            return "stale"
        change = None
        if peer is None:
            change = "joined"
        elif peer.incarnation != hb.incarnation:
            change = "restarted"
        elif not peer.alive:
            change = "revived"
        self.peers[hb.node_id] = Peer(hb.node_id, hb.kind, hb.incarnation, now, hb.version, list(hb.inflight))
        return change

    def expire(self, now: float) -> list[Peer]:
        """Peers silent for longer than the timeout, each reported once until it comes back."""
        dead = []
        for peer in self.peers.values():
            if peer.alive and now - peer.last_seen > self.timeout:
                peer.alive = False
                dead.append(peer)
        return dead

    def leave(self, node_id: str, incarnation: str) -> Peer | None:
        """A peer said it is going: dead from now on (returned, once), not after the timeout."""
        peer = self.peers.get(node_id)
        if peer is None or peer.incarnation != incarnation or peer.left:
            return None
        peer.left = True
        if not peer.alive:  # already expired: reported as dead then
            return None
        peer.alive = False
        return peer

    def alive(self, kind: str | None = None) -> list[Peer]:
        return [p for p in self.peers.values() if p.alive and (kind is None or p.kind == kind)]


class NodeShell:
    def __init__(self, topo: Topology, kind: str, replica: int = 0, *, topics: tuple[bytes, ...] = (),
                 watch: tuple[str, ...] = (), base: Path | None = None, echo: bool = True,
                 own_policy: bool = False):
        self.topo = topo
        self.kind = kind
        self.replica = replica
        self.node_id = f"{kind}-{replica}"
        self.incarnation = uuid.uuid4().hex[:12]
        self.base = base or Path.cwd()
        self.log_dir = topo.log_dir(self.base)
        self.log = setup_logging(kind, self.log_dir, echo=echo, node=self.node_id)
        self.metrics = Metrics()
        # The run's CURVE keys ride on the context: every socket open_socket makes uses them.
        self.ctx = bus_context(topo.curve_keys(self.base), self.metrics, self.log)
        self.encoder = Encoder(self.node_id)
        self.policy = PolicyVersion()  # the newest policy this node knows of (serves, for rollout)
        # A node that sets ``policy`` itself (rollout: what it serves, the trainer: what it made) is not
        # moved by announcements, so its heartbeat never claims a version it does not have yet.
        self.own_policy = own_policy
        self.peers = PeerTable()
        # Announcements are followed only as the trainer's RunState vouches for them (VersionTrust): a
        # node that follows versions hears the run state too.
        self.trust = VersionTrust()
        self._refusals_logged: set[str] = set()
        if m.TOPIC_VERSION in topics and m.TOPIC_RUN not in topics:
            topics = (*topics, m.TOPIC_RUN)
        self.watch = set(watch)
        self.inflight: list = []  # read by the heartbeat thread; nodes replace it, never mutate it
        self.stopping = threading.Event()  # set on SIGTERM: the main loop winds down
        self._hb_stop = threading.Event()  # set when the node closes or leaves: heartbeats end
        self._left = False
        self.pub = open_socket(self.ctx, zmq.PUB, self.endpoint("hub_in"), bind=False, hwm=PUB_HWM)
        self.sub = open_socket(self.ctx, zmq.SUB, self.endpoint("hub_out"), bind=False, hwm=PUB_HWM,
                               subscribe=(m.TOPIC_HEARTBEAT, *topics))
        self.hub = Receiver(self.sub, self.metrics, self.log, topic=True)
        self._hb_thread: threading.Thread | None = None
        self._started = time.time()

    @property
    def version(self) -> int:
        """The version number of ``policy`` (what the heartbeat reports)."""
        return self.policy.version

    # -- setup ----------------------------------------------------------------------------------
    def endpoint(self, channel: str, replica: int = 0) -> str:
        return self.topo.endpoint(channel, replica, self.base)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT ask the main loop to finish; supervisord stops nodes this way."""
        def stop(signum, _frame):
            self.stopping.set()
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)

    def announce_start(self, **extra) -> None:
        self.log.info("node_start", pid=os.getpid(), incarnation=self.incarnation, **extra)
        cfg_path = self.log_dir / "resolved" / f"{self.node_id}.json"
        cfg_path.parent.mkdir(parents=True, exist_ok=True)
        cfg_path.write_text(json.dumps(dump_resolved(self.topo), indent=2, sort_keys=True))

    def start_heartbeat(self) -> None:
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._hb_thread.start()

    def _heartbeat_loop(self) -> None:
        sock = open_socket(self.ctx, zmq.PUB, self.endpoint("hub_in"), bind=False, hwm=PUB_HWM)
        enc = Encoder(self.node_id + "/hb")
        try:
            # The first one at once, not an interval later: a node restarted under its name must be seen
            # as a new incarnation (peers resend what the old one held) before its old heartbeats are
            # missed for long enough to call it dead, and every half second counts in that window.
            while True:
                sock.send_multipart(pack_topic(m.TOPIC_HEARTBEAT, enc.encode(self.heartbeat())), copy=False)
                if self._hb_stop.wait(HEARTBEAT_INTERVAL_S):
                    break
        finally:
            sock.close()

    def heartbeat(self) -> m.Heartbeat:
        counters, gauges, hists = self.metrics.snapshot()
        gauges["uptime_s"] = time.time() - self._started
        # Log lines this process could not write (ENOSPC, a closed stdout) are dropped, never raised: the
        # heartbeat is where someone sees that its log went quiet (areal_bus_log_failures_total).
        counters["log.failures"] = log_failures()
        return m.Heartbeat(node_id=self.node_id, kind=self.kind, incarnation=self.incarnation, pid=os.getpid(),
                           t=time.time(), version=self.version, counters=counters, gauges=gauges, hists=hists,
                           inflight=list(self.inflight))

    # -- hub ------------------------------------------------------------------------------------
    def publish(self, topic: bytes, msg) -> None:
        self.pub.send_multipart(pack_topic(topic, self.encoder.encode(msg)), copy=False)

    def event(self, name: str, **fields) -> None:
        """Log something a person should see and put it on the bus for the probe."""
        self.log.warning(name, **fields)
        self.publish(m.TOPIC_EVENT, m.Event(name=name, node_id=self.node_id, fields=fields))

    def leave(self) -> None:
        """Say on the hub that this incarnation is going, after its last heartbeat: peers take it for
        dead at once (what it held is reissued now, not after the liveness timeout). ``close`` does it
        for every node; a node calls it itself once nothing is left to answer, before closing."""
        if self._left:
            return
        self._left = True
        self._stop_heartbeat()
        self.publish(m.TOPIC_HEARTBEAT, m.Event(name=LEFT, node_id=self.node_id,
                                                fields={"kind": self.kind, "incarnation": self.incarnation}))

    def drain_hub(self) -> list:
        """Hub messages waiting now. Heartbeats update the peer table (and are returned too); a peer's
        leaving notice comes out as a ``peer_left`` Event (kind in its fields) for a watched kind."""
        out = []
        now = time.monotonic()
        for env, msg in self.hub.drain():
            if isinstance(msg, m.Event) and msg.name == LEFT:
                peer = self.peers.leave(msg.node_id, str(msg.fields.get("incarnation", "")))
                if peer is not None and peer.kind in self.watch:
                    self.log.info("peer_left", peer=peer.node_id)
                    out.append((env, m.Event(name="peer_left", node_id=peer.node_id, fields={"kind": peer.kind})))
                continue
            if isinstance(msg, m.Heartbeat):
                if msg.node_id == self.node_id:
                    continue
                change = self.peers.update(msg, now)
                if change == "stale":
                    continue
                if change and msg.kind in self.watch:
                    if change == "joined":
                        self.log.info("peer_joined", peer=msg.node_id)
                    else:
                        self.event(f"peer_{change}", peer=msg.node_id)
                    out.append((env, m.Event(name=f"peer_{change}", node_id=msg.node_id, fields={"kind": msg.kind})))
            elif isinstance(msg, m.VersionAnnounce):
                verdict = self.trust.judge(msg, env.producer, now, carry=(env, msg))
                if verdict:  # held (out with the RunState that names its lineage), superseded or refused
                    self._refused(verdict, producer=env.producer, version=msg.version, lineage=msg.lineage)
                    continue
                self._follow(msg)
            elif isinstance(msg, m.RunState):
                out.append((env, msg))
                released, refused = self.trust.on_run_state(msg, now)
                for why, ann in refused:
                    self._refused(why, version=ann.version, lineage=ann.lineage)
                for env_ann in released:
                    self._follow(env_ann[1])
                    out.append(env_ann)
                continue
            out.append((env, msg))
        for peer in self.peers.expire(now):
            if peer.kind in self.watch:
                self.event("peer_dead", peer=peer.node_id, silent_s=round(now - peer.last_seen, 1))
                out.append((None, m.Event(name="peer_dead", node_id=peer.node_id, fields={"kind": peer.kind})))
        return out

    def _follow(self, ann: m.VersionAnnounce) -> None:
        """A trusted announcement: the newest policy, unless this node sets its own. Its lineage is the
        trainer's current one, so a new lineage is followed even where its number is lower."""
        if not self.own_policy and (ann.lineage != self.policy.lineage or ann.version > self.policy.version):
            self.policy = PolicyVersion.of(ann)

    def _refused(self, why: str, **fields) -> None:
        """Count an announcement not followed; an error (the first of each kind: later ones are in the
        counters) unless merely held or superseded, which a trainer restart makes."""
        if why == "held":
            return
        self.metrics.inc("version_superseded" if why == "superseded" else f"version_refused.{why}")
        if why != "superseded" and why not in self._refusals_logged:
            self._refusals_logged.add(why)
            self.log.error("version_refused", reason=why, **fields,
                           trainer_lineage=self.trust.lineage or "-", trainer_version=self.trust.version,
                           note=f"later ones are counted as version_refused.{why} only")

    # -- teardown -------------------------------------------------------------------------------
    def _stop_heartbeat(self) -> None:
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=2)

    def close(self) -> None:
        self.stopping.set()
        self.leave()
        # destroy() closes every socket made from this context, the node's own data sockets included.
        self.ctx.destroy(linger=LINGER_MS)
