"""The gateway's HTTP server: OpenAI (and Anthropic) chat APIs in front of the policy, with RL sessions.

An agent joins training by pointing its SDK at the gateway: ``base_url=http://HOST:9000/v1`` and
``api_key=<session key>``. Routes (each also under ``/gateway``):

    POST /v1/chat/completions      OpenAI chat completions: JSON or SSE, n, tools, stop, usage
    POST /v1/responses             OpenAI Responses, translated to a chat request (responses_api): items,
                                   function tools, previous_response_id, the Responses SSE events
    POST /v1/completions           legacy completions: text or token ids in, recorded exactly
                                   (completions_routes: no chat template)
    GET  /v1/models[/{id}]         the policy model (and the router's models, if one is given); the
                                   anthropic SDK's page shape when it asks (anthropic-version)
    POST /v1/messages              Anthropic Messages, translated by anthropic_api (Claude Code)
    POST /v1/messages/count_tokens Anthropic token count, with the policy's template
    POST /rl/sessions              admin token: open a session (an episode); returns its key
    GET  /rl/sessions/{id}         admin token or the session key: where the session stands
    POST /rl/sessions/{id}/reward  reward one completion or the whole session (optional discount)
    POST /rl/sessions/{id}/end     end it: its trajectories go to ``emit`` (see sessions.py)
    GET  /rl/metrics               admin token: the counters (requests, refusals by reason) and gauges
    GET  /health                   liveness, no key needed

Keys are read from ``Authorization: Bearer`` or ``x-api-key`` on every route (``keys``). Who may call:
the admin token works everywhere (chat calls with it are served but not recorded: handy for smoke
tests); a session key works for chat calls (recorded into its session) and for its own session's /rl
routes. Policy requests go to ``backend`` (backend.Backend); other models go to
``router.chat(model, request)`` when a router is given, else 404 model_not_found.

Limits, each a 4xx in the API's own error shape, counted in ``metrics`` as ``http.rejected.<reason>``:
the body size (413), JSON nesting (MAX_JSON_DEPTH), open sessions (429), generations pending in the
backend (``max_pending_requests``: 429 with Retry-After, which the openai and anthropic SDKs honour,
rather than a queue that grows with the load). A request aiohttp cannot parse as HTTP at all (a bad
request line or header) is answered by aiohttp itself with a plain-text 400 before any route is known,
and counted as ``http.rejected.bad_http``. Keys: the admin token and session keys are compared as
sha256 digests with ``hmac.compare_digest``, and every log line passes through ``RedactingLog``.

Recording never depends on the client: a session turn's generation and its recording run in a task of
their own, which a disconnect does not cancel (an admin call, with nothing to record, is generated in
its handler). Sessions idle longer than ``session_idle_timeout_s`` are
ended by a sweeper; at shutdown every open session is ended (``end_reason`` "shutdown") and emitted.

Durability: given a ``wal`` (``wal.GatewayWAL``), a turn, a reward, an opened and an ended session are
committed to it before the reply, and ended trajectories stay there until ``lifecycle.settled`` names
them (the node calls it with each TrajAck). A Gateway made on an existing WAL resumes its open sessions
(their keys keep working) and, once serving, emits again every ended trajectory not yet settled.

Here: the ``Gateway``, which composes the pieces, and ``make_app``, which serves them; its config,
``GatewayConfig``, is in areal_bus/config/node_configs.py. No piece reaches another through the Gateway:
each gets what it uses in its constructor.

    keys.Keys                           who a request's key names (ADMIN, a session, or a 401)
    sessions.SessionStore               the open sessions, recorded token for token
    lifecycle.SessionLifecycle          ending sessions (asked, idle, shutdown), emitting, the WAL's restore
    policy_chat.PolicyChat              a chat request served by the policy (prompt, admission, generation
                                        and record, the response), with Pending and ResponseIds
    upstream.Upstream                   other models, through the router
    openai_routes.OpenAIRoutes          /v1/chat/completions, /v1/models        (hold PolicyChat)
    anthropic_routes.AnthropicRoutes    /v1/messages, /v1/messages/count_tokens (hold PolicyChat)
    responses_routes.ResponsesRoutes    /v1/responses                           (hold PolicyChat)
    completions_routes.CompletionsRoutes  /v1/completions (no chat template)
    rl_routes.RLRoutes                  /rl/sessions..., /rl/metrics, /health

Each route group adds its own routes (``register``). The HTTP plumbing (``read_json``, ``json_response``,
the error middleware, ``start_server``) is in ``server``, its public names re-exported here.

Build and serve (the gateway node's ``run`` does this with the bus backend)::

    app = make_app(GatewayConfig(admin_token=..., max_context_tokens=1024), backend, tokenizer, emit=send)
    runner = await start_server(app, cfg)            # binds host:port; GatewayStartError if it cannot
"""

from __future__ import annotations

import structlog
from aiohttp import web

from areal_bus.config.node_configs import GatewayConfig
from areal_bus.runtime.metrics import Metrics
from nodes.gateway.anthropic_routes import AnthropicRoutes
from nodes.gateway.backend import Backend
from nodes.gateway.chat import ChatRenderer
from nodes.gateway.completions_routes import CompletionsRoutes
from nodes.gateway.guard import RedactingLog
from nodes.gateway.keys import Keys
from nodes.gateway.lifecycle import SessionLifecycle
from nodes.gateway.openai_routes import OpenAIRoutes
from nodes.gateway.policy_chat import Pending, PolicyChat, ResponseIds
from nodes.gateway.responses_routes import Conversations, ResponsesRoutes
from nodes.gateway.rl_routes import RLRoutes
from nodes.gateway.server import GATEWAY, _errors
from nodes.gateway.server import GatewayStartError, bound_port, json_response, start_server  # noqa: F401 (re-exported)
from nodes.gateway.sessions import SessionStore, key_digest
from nodes.gateway.upstream import Upstream

SESSION_TAG_CONTEXT = "areal_bus/session-key-tag\0"
"""Prefixed to the admin token to derive the session keys' tag key (sessions.key_tag): a gateway
restarted with the same token recognises the keys it minted before (their sessions ended)."""


class Gateway:
    """The gateway behind one aiohttp application: its pieces, made here and handed to one another.

    ``store``, ``conversations``, ``lifecycle``, ``pending`` (choices pending in the backend), ``chat``
    (the policy chat service), ``routes`` (the route groups, in the order their routes are added),
    ``metrics`` and ``log`` (the error middleware and ``start_server`` use them)."""

    def __init__(self, cfg: GatewayConfig, backend: Backend, tokenizer, *, router=None, emit=None,
                 admission=None, log=None, metrics=None, wal=None):
        if not cfg.admin_token:
            raise ValueError("nodes.gateway.config.admin_token is not set: export AREAL_BUS_ADMIN_TOKEN (8+ "
                             "characters) in the shell that starts the run, and write ${AREAL_BUS_ADMIN_TOKEN}")
        renderer = ChatRenderer(tokenizer)
        self.cfg = cfg
        self.log = RedactingLog(log if log is not None else structlog.get_logger().bind(_tag="gateway"),
                                cfg.admin_token)
        self.metrics = metrics if metrics is not None else Metrics()
        ctx = cfg.max_context_tokens or getattr(backend, "max_context_tokens", None)
        if not ctx:
            raise ValueError("GatewayConfig.max_context_tokens is not set and the backend does not say "
                             "(set it to the engine's max_len)")
        max_context = int(ctx)
        self.store = SessionStore(cfg.max_sessions, cfg.session_idle_timeout_s, wal=wal,
                                  tag_key=key_digest(SESSION_TAG_CONTEXT + cfg.admin_token))
        self.conversations = Conversations(wal=wal)  # responses_routes: what previous_response_id continues
        jobs: dict = {}  # per session id, the tasks generating and recording its turns
        self.lifecycle = SessionLifecycle(cfg, self.store, self.conversations, jobs, wal=wal, emit=emit,
                                          log=self.log, metrics=self.metrics)
        self.pending = Pending(cfg.max_pending_requests, self.metrics)
        keys, ids = Keys(cfg.admin_token, self.store), ResponseIds()
        upstream = Upstream(router, cfg.policy_model, metrics=self.metrics, log=self.log)
        self.chat = PolicyChat(cfg, backend, renderer, self.store, jobs=jobs, pending=self.pending, ids=ids,
                               max_context=max_context, metrics=self.metrics, log=self.log)
        self.routes = (
            OpenAIRoutes(cfg, keys, self.chat, upstream),
            ResponsesRoutes(cfg, keys, self.chat, upstream, self.conversations, self.store, metrics=self.metrics,
                            log=self.log),
            CompletionsRoutes(cfg, keys, backend, renderer, self.store, jobs=jobs, pending=self.pending, ids=ids,
                              max_context=max_context, metrics=self.metrics, log=self.log),
            AnthropicRoutes(cfg, keys, self.chat, upstream, renderer),
            RLRoutes(cfg, keys, self.store, self.lifecycle, admission=admission, pending=self.pending,
                     metrics=self.metrics, log=self.log),
        )

    def register(self, app: web.Application) -> None:
        """Every route group's routes, at the root and under /gateway; the lifecycle's start and stop."""
        for prefix in ("", "/gateway"):
            for group in self.routes:
                group.register(app.router, prefix)
        app.on_startup.append(self.lifecycle.on_startup)
        app.on_shutdown.append(self.lifecycle.on_shutdown)


def make_app(cfg: GatewayConfig, backend: Backend, tokenizer, *, router=None, emit=None, admission=None,
             log=None, metrics=None, wal=None) -> web.Application:
    """The gateway as an aiohttp application.

    backend: serves the policy (``backend.Backend``). tokenizer: the policy's HF tokenizer (chat
    template). router: ``await router.chat(model, request) -> response`` for other models (raises with
    ``.status`` / ``.body`` on failure). emit: ``emit(trajectory)`` for each ended session's
    trajectories, called on the event loop's thread (must not block; an exception keeps the trajectory
    for a retry at the next sweep). admission: ``admission() -> (ticket | None, retry_after_s)``, consulted
    once per POST /rl/sessions (a ticket means the session is admitted, with that admission slot, which
    its requests carry; None means refused: a 429 with Retry-After). log: a structlog logger.
    metrics: an ``areal_bus.runtime.metrics.Metrics`` for the gateway's counters (the node's, so that they ride
    on its heartbeats; a fresh one if None). wal: a ``wal.GatewayWAL`` that makes every 2xx durable
    (None: sessions and unacknowledged trajectories live in memory only).
    """
    gw = Gateway(cfg, backend, tokenizer, router=router, emit=emit, admission=admission, log=log, metrics=metrics,
                 wal=wal)
    app = web.Application(middlewares=[_errors], client_max_size=cfg.max_body_bytes)
    app[GATEWAY] = gw
    gw.register(app)
    return app
