"""The gateway's RL routes: open, inspect, reward and end sessions, the metrics view and /health.

``RLRoutes`` holds what they need, passed by the Gateway: ``Keys``, the session store, the
``lifecycle.SessionLifecycle`` (which ends sessions), ``admission``, the ``policy_chat.Pending`` count
(for the metrics view), the config, metrics and log; it adds its routes with ``register``
(``app.make_app``, under "" and "/gateway"). ``admission()`` returns ``(ticket, retry_after_s)``: the
admitted session's ticket (``Admission.admit``), or None and how long to wait. The routes (each also
under ``/gateway``; the full table is in ``app``'s docstring)::

    POST /rl/sessions              create_session   admin token: open a session; returns its key
    GET  /rl/sessions/{id}         get_session      admin token or the session key: where it stands
    POST /rl/sessions/{id}/reward  reward_session   reward one completion or the whole session
    POST /rl/sessions/{id}/end     end              end it (an optional last reward in the body)
    GET  /rl/metrics               metrics_view     admin token: counters and gauges
    GET  /health                   health           liveness, no key needed
"""

from __future__ import annotations

import json
import math
import sys

from aiohttp import web

from areal_bus.config.node_configs import GatewayConfig
from nodes.gateway.keys import Keys
from nodes.gateway.lifecycle import SessionLifecycle
from nodes.gateway.openai_api import OpenAIError, reward_fields
from nodes.gateway.policy_chat import Pending
from nodes.gateway.server import ADMIN, json_response, read_json
from nodes.gateway.sessions import Session, SessionStore

MAX_META_BYTES = 16384
"""Largest session ``meta`` (as JSON): it rides on every trajectory of the session to the trainer, and
a thousand open sessions must not hold a megabyte each."""

MAX_GROUP_ID_CHARS = 256
"""Longest session ``group_id`` (the GRPO group the trajectory belongs to)."""


class RLRoutes:
    """The /rl/* session routes and /health."""

    def __init__(self, cfg: GatewayConfig, keys: Keys, store: SessionStore, lifecycle: SessionLifecycle, *,
                 admission=None, pending: Pending, metrics, log):
        self.cfg = cfg
        self.keys = keys
        self.store = store
        self.lifecycle = lifecycle
        self.admission = admission
        self.pending = pending
        self.metrics = metrics
        self.log = log

    def register(self, router: web.UrlDispatcher, prefix: str) -> None:
        router.add_post(f"{prefix}/rl/sessions", self.create_session)
        router.add_get(f"{prefix}/rl/sessions/{{sid}}", self.get_session)
        router.add_post(f"{prefix}/rl/sessions/{{sid}}/reward", self.reward_session)
        router.add_post(f"{prefix}/rl/sessions/{{sid}}/end", self.end)
        router.add_get(f"{prefix}/rl/metrics", self.metrics_view)
        router.add_get(f"{prefix}/health", self.health)

    async def create_session(self, request: web.Request) -> web.Response:
        if self.keys.principal(request) is not ADMIN:
            raise OpenAIError(403, "Opening a session needs the admin token ($AREAL_BUS_ADMIN_TOKEN), not a "
                              "session key.", code="forbidden")
        body = await read_json(request, self.cfg) or {}
        if not isinstance(body, dict):
            raise OpenAIError(400, "The body must be a JSON object (or empty).", code="invalid_body")
        meta, group_id = body.get("meta", {}), body.get("group_id", "")
        if not isinstance(meta, dict):
            raise OpenAIError(400, "Invalid value for 'meta': must be an object.", param="meta", code="invalid_value")
        if not isinstance(group_id, str) or len(group_id) > MAX_GROUP_ID_CHARS:
            raise OpenAIError(400, f"Invalid value for 'group_id': must be a string of at most {MAX_GROUP_ID_CHARS} "
                              f"characters.", param="group_id", code="invalid_value")
        if meta and len(json.dumps(meta)) > MAX_META_BYTES:
            raise OpenAIError(400, f"Invalid value for 'meta': more than {MAX_META_BYTES} bytes as JSON.",
                              param="meta", code="invalid_value")
        if len(self.store.sessions) >= self.cfg.max_sessions:  # before admission, which counts the session
            raise OpenAIError(429, f"{len(self.store.sessions)} sessions are open (max_sessions="
                              f"{self.cfg.max_sessions}); end finished sessions, or wait for idle ones to expire "
                              f"(after {self.cfg.session_idle_timeout_s:g} s).", type="rate_limit_error",
                              code="too_many_sessions", headers={"Retry-After": "1"})
        ticket = None  # no admission (a gateway alone): the store numbers its sessions
        if self.admission is not None:
            ticket, retry_after = self.admission()
            if ticket is None:
                wait = max(0.0, float(retry_after))
                raise OpenAIError(429, f"Not admitting new sessions: rollout is as far ahead of training as "
                                  f"staleness_threshold allows. Retry after {wait:.1f} s.", type="rate_limit_error",
                                  code="staleness_limit",
                                  headers={"Retry-After": str(max(1, math.ceil(wait))),
                                           "retry-after-ms": str(int(wait * 1000))})
        # The ticket (the update the session is admitted for) rides on each of its GenerateRequests
        # and on its trajectories: the rollout worker's [rollout] step is read from it.
        session, key = self.store.create(meta=meta, group_id=group_id, ticket=ticket)
        self.log.info("session_opened", session=session.id, open=len(self.store.sessions))
        return json_response({"session_id": session.id, "api_key": key, "model": self.cfg.policy_model,
                              "idle_timeout_s": self.cfg.session_idle_timeout_s}, status=201)

    def _session_for(self, request: web.Request) -> Session:
        """The session named in the path, for the admin or that session's own key."""
        who = self.keys.principal(request)
        sid = request.match_info["sid"]
        session = self.store.get(sid)
        if who is not ADMIN and (session is None or who is not session):
            raise OpenAIError(403, f"This key does not belong to session {sid}.", code="forbidden")
        if session is None:
            gone = self.store.ended.get(sid)
            raise OpenAIError(404 if gone is None else 409,
                              f"No open session {sid}" + (f" (it ended: {gone[1]})." if gone else "."),
                              code="session_not_found" if gone is None else "session_ended")
        return session

    async def get_session(self, request: web.Request) -> web.Response:
        s = self._session_for(request)
        return json_response({
            "session_id": s.id, "completions": s.completions, "branches": len(s.branches),
            "segments": s.segments, "inflight": s.inflight,
            "idle_s": round(self.store.clock() - s.last_active, 3), "reward": s.outcome,
            "completion_rewards": {str(k): v for k, v in s.rewards.items()}, "discount": s.discount})

    async def reward_session(self, request: web.Request) -> web.Response:
        session = self._session_for(request)
        value, index = self._reward(session, await read_json(request, self.cfg))
        return json_response({"session_id": session.id, "completion_index": index, "reward": value,
                              "discount": session.discount})

    def _reward(self, session: Session, body) -> tuple[float, int | None]:
        """Record a reward given in a request body, with the client errors it can raise."""
        value, index, discount = reward_fields(body, session.id)
        try:
            self.store.reward(session, value, index, discount)
        except KeyError as exc:
            raise OpenAIError(404, exc.args[0], param="completion_index", code="completion_not_found") from None
        except ValueError as exc:
            raise OpenAIError(400, str(exc), code="invalid_value") from None
        return value, index

    async def end(self, request: web.Request) -> web.Response:
        session = self._session_for(request)
        body = await read_json(request, self.cfg)
        if body:  # optional: a last reward ({"reward": ..., "completion_index"?: ..., "discount"?: ...})
            self._reward(session, body)
        trajs = await self.lifecycle.end_session(session, "ended")
        return json_response({"session_id": session.id, "trajectories": [t.traj_id for t in trajs],
                              "completions": session.completions})

    async def metrics_view(self, request: web.Request) -> web.Response:
        if self.keys.principal(request) is not ADMIN:
            raise OpenAIError(403, "The metrics need the admin token, not a session key.", code="forbidden")
        counters, gauges, _ = self.metrics.snapshot()
        # python.blocks: the interpreter's live allocations, a count no allocator arena blurs (RSS does),
        # so a leak of Python objects shows as growth between quiet moments.
        gauges.update({"sessions.open": len(self.store.sessions), "http.pending": self.pending.count,
                       "python.blocks": sys.getallocatedblocks()})
        return json_response({"counters": counters, "gauges": gauges})

    async def health(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok", "sessions": len(self.store.sessions),
                              "policy_model": self.cfg.policy_model})
