"""How the gateway's sessions end and their trajectories leave: ``SessionLifecycle``.

A session ends when its owner says so (POST /rl/sessions/{id}/end), when it has been idle longer than
``session_idle_timeout_s`` (a sweeper, at least once a second), or at shutdown (``end_reason``
"shutdown"). Ending waits for the session's turns in flight (``jobs``: their completions are
recorded), then hands its trajectories to ``emit``; one that ``emit`` refuses is kept and retried at
the next sweep. A full disk under the ledger is the exception: the process exits 1 (see ``emit``).

Durability: on a ``wal`` (``wal.GatewayWAL``), the lifecycle made on an existing file resumes its open
sessions into the store (their keys keep working) and their Responses conversations, and, once the
server starts, emits again every ended trajectory not yet settled; ``settled`` (the node calls it with
each TrajAck) makes the WAL forget them.

    life = SessionLifecycle(cfg, store, conversations, jobs, wal=wal, emit=send, log=log, metrics=metrics)
    app.on_startup.append(life.on_startup); app.on_shutdown.append(life.on_shutdown)
    trajs = await life.end_session(session, "ended")
"""

from __future__ import annotations

import asyncio
import os

from areal_bus.config.node_configs import GatewayConfig
from areal_bus.runtime.ledger import LedgerWriteError
from nodes.gateway.responses_routes import Conversations
from nodes.gateway.sessions import Session, SessionStore

EXPIRY_SWEEP_MAX_S = 1.0
"""The idle sweeper runs at least this often (more often for short timeouts: a quarter of the timeout),
so a session ends within ~1 s of its idle deadline at the cost of one dict scan per second."""


class SessionLifecycle:
    """Ending sessions (asked, idle, shutdown), emitting their trajectories, and what a WAL brings back.

    ``jobs``: per session id, the tasks generating and recording its turns (the chat and completions
    paths add them, and discard them when done); shared with those paths, so an ending waits for them.
    ``resumed`` and ``resend`` say what a restart found in the WAL (the node admits them again)."""

    def __init__(self, cfg: GatewayConfig, store: SessionStore, conversations: Conversations,
                 jobs: dict[str, set[asyncio.Task]], *, wal=None, emit=None, log, metrics):
        self.cfg = cfg
        self.store = store
        self.conversations = conversations
        self.jobs = jobs
        self.wal = wal
        self.emit_to = emit
        self.log = log
        self.metrics = metrics
        self.resumed, self.resend = 0, []  # what a restart found in the WAL (on_startup emits ``resend``)
        if wal is not None:
            self._restore()
        self.unemitted: list = []
        self._sweeper: asyncio.Task | None = None

    def _restore(self) -> None:
        self.resumed, failed = self.store.restore()
        for sid, why in failed:
            self.log.error("wal_session_not_resumed", session=sid, error=why,
                           fix=f"its rows stay in {self.wal.path} (tables sessions, journal)")
        for owner, rid, parent, messages in self.wal.responses():
            if owner in self.store.sessions:  # a resumed session's (a failed one's stay with its rows)
                self.conversations.restore(owner, rid, parent, messages)
        self.resend, bad = self.wal.pending()
        if bad:
            self.log.error("wal_rows_undecodable", trajectories=bad, path=str(self.wal.path))
        if self.resumed or self.resend:
            self.log.warning("wal_restored", sessions_resumed=self.resumed, trajectories_resent=len(self.resend),
                             path=str(self.wal.path))
        self.metrics.inc("wal.sessions_resumed", self.resumed)
        self.metrics.inc("wal.trajectories_resent", len(self.resend))

    def emit(self, trajectories) -> None:
        """Hand ``trajectories`` (and any a failed emit kept) to ``emit``."""
        pending, self.unemitted = [*self.unemitted, *trajectories], []
        for traj in pending:
            try:
                if self.emit_to is not None:
                    self.emit_to(traj)
            except LedgerWriteError as exc:
                # A full disk: the record that explains the send cannot be written, and retrying at every
                # sweep hid it. Fail loudly instead: exit 1, which supervisord restarts and the run-end
                # listener counts (a disk that stays full ends the run naming this node). The WAL holds
                # every ended session; the restarted gateway resends them once there is space.
                self.log.error("ledger_write_failed", traj=traj.traj_id, error=str(exc),
                               fix="free space on the log_dir's disk; nothing acknowledged is lost (WAL)")
                os._exit(1)
            except Exception as exc:  # deliberately tolerated: kept and retried at the next sweep
                self.log.error("emit_failed", traj=traj.traj_id, error=repr(exc))
                self.unemitted.append(traj)

    def settled(self, traj_ids) -> None:
        """The trainer has these trajectories (accepted, consumed, stale, duplicate or rejected): the WAL
        forgets them. Ids that are not ours (acks go to every producer) cost nothing."""
        if self.wal is not None:
            self.wal.forget(traj_ids)

    async def end_session(self, session: Session, reason: str, reward: float | None = None) -> list:
        """Wait for the session's in-flight turns (their completions are recorded), then end it."""
        session.closing = True
        jobs = list(self.jobs.get(session.id, ()))
        if jobs:
            await asyncio.gather(*jobs, return_exceptions=True)
        trajs = self.store.end(session, reason, reward)
        self.jobs.pop(session.id, None)
        self.emit(trajs)
        self.log.info("session_ended", session=session.id, reason=reason, trajectories=len(trajs),
                      completions=session.completions, tokens=sum(int(t.loss_mask.sum()) for t in trajs))
        return trajs

    async def sweep(self) -> None:
        interval = min(EXPIRY_SWEEP_MAX_S, self.cfg.session_idle_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            trajs = self.store.expire_idle()
            for sid in {t.episode_id for t in trajs}:
                self.jobs.pop(sid, None)
                self.log.info("session_expired", session=sid, idle_timeout_s=self.cfg.session_idle_timeout_s)
            if trajs or self.unemitted:
                self.emit(trajs)

    async def on_startup(self, app) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self.sweep())
        resend, self.resend = self.resend, []
        self.emit(resend)

    async def on_shutdown(self, app) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for session in list(self.store.sessions.values()):
            await self.end_session(session, "shutdown")
