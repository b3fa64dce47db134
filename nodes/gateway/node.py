"""Gateway node: the HTTP gateway (``app``) wired to the bus.

Policy-model requests go to the rollout workers through ``BusBackend`` (sticky per session); ended
sessions leave as trajectories to the reward node (or the trainer), kept until the trainer acknowledges
them and resent if their consumer restarts. With ``wal`` on (the default) they are kept on disk too, as
are open sessions (nodes/gateway/wal.py): a restarted gateway resumes its sessions and resends what the
trainer has not acknowledged. New sessions pass the same staleness admission as the agent
node's episodes (they share the rule's budget); while the system is too far ahead, POST /rl/sessions
answers 429 with Retry-After. Requests for other models go through the model router when
``nodes.gateway.config.router_config`` names one.

Run: areal-bus node gateway --topology topology/gateway.yaml
     (nodes.gateway.config: admin_token: ${AREAL_BUS_ADMIN_TOKEN}, port: 9000, ...)
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import zmq

from areal_bus.wire import messages as m
from areal_bus.admission import Admission, Sources
from areal_bus.wire.channels import ReliableSender, open_socket
from areal_bus.runtime.ledger import Ledger, ledger_path
from areal_bus.router import ModelRouter, load_router_config
from areal_bus.runtime.node import NodeShell
from areal_bus.tasks.runner import load_tokenizer
from areal_bus.trajectory_check import check_trajectory, model_vocab_size, reason_code
from areal_bus.version import PolicyVersion
from nodes.gateway.app import GATEWAY, make_app, start_server
from nodes.gateway.bus_backend import BusBackend
from nodes.gateway.wal import GatewayWAL, wal_path

HUB_TICK_S = 0.02
"""How often the event loop drains the hub and flushes the trajectory sender: fast enough that a
version or an ack is seen within a decode step or two, cheap enough to be invisible in latency."""

ADMISSION_RETRY_S = 1.0
"""Retry-After for a refused session: about one update on the default, when capacity reopens."""


def _is_self(base_url: str, cfg) -> bool:
    """Whether a router's base_url is this gateway's own address (loopback or its host, its port)."""
    url = urlsplit(base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    return port == cfg.port and url.hostname in {"127.0.0.1", "localhost", "::1", "0.0.0.0", cfg.host}


def admit_session(admission: Admission, version: int, metrics) -> tuple[int | None, float]:
    """POST /rl/sessions' admission, the trainer having made ``version`` updates: (the new session's
    ticket, 0), or (None, Retry-After) while the rule allows no more (counted as sessions_refused).
    The ticket says which update the session is admitted for; it rides on every request of the
    session, so the rollout workers' ``[rollout] step`` means the same as with agents on the bus."""
    if admission.capacity(version) > 0:
        return admission.admit(1), 0.0
    metrics.inc("sessions_refused")
    return None, ADMISSION_RETRY_S


def _router(shell, topo, cfg, base):
    """The model router for other models than the policy (None without router_config); False when the
    router would send requests back to this gateway (refused with the fix)."""
    if not cfg.router_config:
        return None
    router_cfg = load_router_config(topo.resolve(cfg.router_config, base))
    if _is_self(router_cfg.api_gateway.base_url, cfg):
        shell.log.error("router_is_this_gateway", router_config=cfg.router_config,
                        fix="requests for other models would come back here for ever: point the router's "
                        "api_gateway.base_url at a provider (configs/router.yaml as shipped is for clients "
                        "of this gateway, not for its router_config)")
        return False
    return ModelRouter(router_cfg, log=shell.log)


class GatewayWiring:
    """The gateway application's ends on the bus: trajectories out (to reward or the trainer, kept until
    acknowledged), acknowledgements and run state in, admission, the ledger of what it produced."""

    def __init__(self, shell: NodeShell, topo, replica: int, base):
        self.shell = shell
        n_reward = topo.replicas("reward")
        targets = [shell.endpoint("samples", i) for i in range(n_reward)] if n_reward else [shell.endpoint("train")]
        self.consumer_kind = "reward" if n_reward else "trainer"
        self.sender = ReliableSender(open_socket(shell.ctx, zmq.PUSH, targets, bind=False, hwm=topo.queue_max_size),
                                     shell.encoder, shell.metrics, "out", capacity=topo.queue_max_size)
        self.admission = Admission.of(topo, f"gateway-{replica}")  # one budget with the agents
        self.sources = Sources(topo, f"gateway-{replica}")  # who shares it, as scaling changes it
        self.source = f"{shell.node_id}:{shell.incarnation}"  # names our sessions in the trainer's totals
        self.ledger = Ledger(ledger_path(shell.log_dir, shell.node_id))  # what we produced, for the audit
        self.vocab_size = model_vocab_size(topo.model_path(base))
        self.backend = BusBackend(shell.ctx, shell.endpoint("gwork", replica), shell.encoder, shell.metrics)
        self.app = None

    def admit(self) -> tuple[int | None, float]:
        return admit_session(self.admission, self.shell.version, self.shell.metrics)

    def emit(self, traj: m.Trajectory) -> None:
        shell = self.shell
        if traj.traj_id != traj.episode_id:  # a session's extra branch (n > 1, rewritten history): one more sample
            self.admission.admit(1)
        # The trainer's own check (ids against the policy's vocabulary; versions it checks itself, as
        # ours may lag): one it would refuse never leaves, and its slot comes back at once.
        if (reason := check_trajectory(traj, self.vocab_size, None)) is not None:
            self.admission.abandon(1)
            shell.metrics.inc(f"rejected.{reason_code(reason)}")
            shell.log.error("trajectory_rejected", session=traj.episode_id, traj=traj.traj_id, reason=reason)
            self.app[GATEWAY].lifecycle.settled([traj.traj_id])
            return
        traj.source = self.source
        self.ledger.write("produced", ids=[traj.traj_id])
        self.sender.offer(traj.traj_id, traj)
        shell.metrics.inc("samples")
        shell.metrics.inc("tokens", int(traj.loss_mask.sum()))

    def hub_tick(self) -> None:
        shell, sender = self.shell, self.sender
        now = time.monotonic()
        for _, msg in shell.drain_hub():
            if self.sources.hear(msg, self.admission, now):  # agents or gateways scaled (or gone) while running
                shell.log.info("admission_sources", sources=",".join(self.sources.names),
                               share=self.admission.batch_share)
            if isinstance(msg, m.TrajAck):
                sender.settle(msg)
                self.app[GATEWAY].lifecycle.settled([*msg.consumed, *msg.stale, *msg.duplicate, *msg.accepted,
                                                     *msg.rejected])
            elif isinstance(msg, m.RunState):
                shell.policy = max(shell.policy, PolicyVersion(msg.lineage, msg.version))
                self.admission.follow(msg, self.source)  # totals, not acks: a lost hub message leaks no slot
            elif (isinstance(msg, m.Event) and msg.name == "peer_restarted"
                  and msg.fields.get("kind") == self.consumer_kind):
                shell.log.warning("resent", trajectories=sender.resend(), reason=f"{msg.node_id} restarted")
        self.backend.set_live({p.node_id: p.incarnation for p in shell.peers.alive("rollout")})  # a restart shows
        sender.flush()
        shell.metrics.gauge("queue.unacked", len(sender.unacked))
        shell.metrics.gauge("capacity", self.admission.capacity(shell.version))
        shell.metrics.gauge("lead", self.admission.lead)

    def close(self) -> None:
        self.backend.close()
        self.ledger.close()


def run(topo, replica: int = 0, base=None) -> int:
    shell = NodeShell(topo, "gateway", replica, base=base,
                      watch=("rollout", "reward", "trainer", "agent", "gateway"),
                      topics=(m.TOPIC_VERSION, m.TOPIC_TRAJ_ACK, m.TOPIC_RUN))
    shell.install_signal_handlers()
    cfg = topo.gateway_config()  # validated with the topology; max_context_tokens is the engine's max_len
    if cfg.admin_token is None:
        shell.log.error("no_admin_token", fix="export AREAL_BUS_ADMIN_TOKEN (8+ characters) in the shell that "
                        "starts supervisord (scripts/run_default.sh makes one per run)")
    router = _router(shell, topo, cfg, base) if cfg.admin_token is not None else False
    if router is False:
        shell.close()
        return 2
    tokenizer = load_tokenizer(topo.model_path(base))
    bus = GatewayWiring(shell, topo, replica, base)
    wal = GatewayWAL(wal_path(shell.log_dir, shell.node_id), fsync=cfg.wal_fsync) if cfg.wal else None

    async def main() -> None:
        bus.app = make_app(cfg, bus.backend, tokenizer, router=router, emit=bus.emit, admission=bus.admit,
                           log=shell.log, metrics=shell.metrics, wal=wal)
        restored = bus.app[GATEWAY].lifecycle
        # Sessions resumed and trajectories resent from the WAL were admitted by the incarnation that
        # died: this one's counts start at zero, and the trainer will count them under our source.
        bus.admission.admit(restored.resumed + sum(t.traj_id == t.episode_id for t in restored.resend))
        runner = await start_server(bus.app, cfg)
        bus.backend.start()
        shell.announce_start(host=cfg.host, port=cfg.port, policy_model=cfg.policy_model,
                             router=cfg.router_config or "-")
        shell.start_heartbeat()
        last_resend = time.monotonic()
        try:
            while not shell.stopping.is_set():
                bus.hub_tick()
                if time.monotonic() - last_resend > 1.0:
                    bus.sender.resend_overdue()
                    last_resend = time.monotonic()
                await asyncio.sleep(HUB_TICK_S)
        finally:
            await runner.cleanup()  # ends every open session and emits its trajectories
            bus.sender.flush()  # hand them to ZeroMQ before the context goes (LINGER_MS gives them time)
            if router is not None:
                await router.close()

    try:
        import uvloop

        uvloop.run(main())
    finally:
        bus.close()
        if wal is not None:
            wal.close()
        shell.close()
    return 0
