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

Keys are read from ``Authorization: Bearer`` or ``x-api-key`` on every route. Who may call: the admin
token works everywhere (chat calls with it are served but not recorded: handy
for smoke tests); a session key works for chat calls (recorded into its session) and for its own
session's /rl routes. Policy requests go to ``backend`` (backend.Backend); other models go to
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
committed to it before the reply, and ended trajectories stay there until ``settled`` names them (the
node calls it with each TrajAck). A Gateway made on an existing WAL resumes its open sessions (their keys
keep working) and, once serving, emits again every ended trajectory not yet settled.

Here: the Gateway (keys and bodies, session lifecycle, the OpenAI chat and model routes) and ``make_app``;
its config, ``GatewayConfig``, is in areal_bus/config/node_configs.py. The Gateway is put together from mixins,
one module each: ``policy_chat.PolicyChat`` serves a chat request with the policy (prompt, generation,
recording, choice post-processing, the response), ``anthropic_routes.AnthropicRoutes`` the Anthropic
Messages routes, ``responses_routes.ResponsesRoutes`` the Responses route (through PolicyChat),
``completions_routes.CompletionsRoutes`` the legacy completions route, ``rl_routes.RLRoutes`` the /rl
routes and /health. The HTTP plumbing (``json_response``,
the error middleware, ``start_server``) is in ``server``, its public names re-exported here.

Build and serve (the gateway node's ``run`` does this with the bus backend)::

    app = make_app(GatewayConfig(admin_token=..., max_context_tokens=1024), backend, tokenizer, emit=send)
    runner = await start_server(app, cfg)            # binds host:port; GatewayStartError if it cannot
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import secrets
import time

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from areal_bus.runtime.metrics import Metrics
from areal_bus.config.node_configs import GatewayConfig
from nodes.gateway.anthropic_routes import AnthropicRoutes
from nodes.gateway.backend import Backend
from nodes.gateway.chat import ChatRenderer
from nodes.gateway.completions_routes import CompletionsRoutes
from nodes.gateway.guard import MAX_JSON_DEPTH, RedactingLog, check_json, too_deep
from nodes.gateway.live import LiveStream
from nodes.gateway.openai_api import (SSE_DONE, OpenAIError, model_card, parse_chat_request, router_error, sse,
                                      stream_chunks)
from nodes.gateway.policy_chat import PolicyChat
from nodes.gateway.responses_routes import Conversations, ResponsesRoutes
from nodes.gateway.rl_routes import RLRoutes
from nodes.gateway.server import ADMIN, GATEWAY, _errors, json_response, sse_reply
from nodes.gateway.server import GatewayStartError, bound_port, start_server  # noqa: F401 (re-exported)
from nodes.gateway.sessions import Session, SessionStore, key_digest

try:  # optional: a JSON codec several times faster than json's, on every request and response body
    import orjson
except ImportError:
    orjson = None

EXPIRY_SWEEP_MAX_S = 1.0
"""The idle sweeper runs at least this often (more often for short timeouts: a quarter of the timeout),
so a session ends within ~1 s of its idle deadline at the cost of one dict scan per second."""

KEY_HELP = ("Check: is the environment variable holding the key set in this shell (echo ${#VAR} prints "
            "its length)? Does the config say ${VAR} rather than a literal? Is there stray whitespace or a "
            "newline in the key? Session keys come from POST /rl/sessions; the admin token is "
            "$AREAL_BUS_ADMIN_TOKEN of the shell that started the gateway.")


SESSION_TAG_CONTEXT = "areal_bus/session-key-tag\0"
"""Prefixed to the admin token to derive the session keys' tag key (sessions.key_tag): a gateway
restarted with the same token recognises the keys it minted before (their sessions ended)."""

_ENDED_WHY = {"idle": "idle for longer than session_idle_timeout_s", "ended": "ended by POST /rl/sessions/{id}/end",
              "shutdown": "the gateway shut down",
              "gone": "this gateway no longer holds it: it was open on a gateway that has restarted since, or it "
                      "ended long ago"}


class Gateway(PolicyChat, AnthropicRoutes, ResponsesRoutes, CompletionsRoutes, RLRoutes):
    """The gateway behind one aiohttp application: its keys, sessions and routes (see the module
    docstring for which mixin serves which)."""

    def __init__(self, cfg: GatewayConfig, backend: Backend, tokenizer, *, router=None, emit=None,
                 admission=None, log=None, metrics=None, wal=None):
        if not cfg.admin_token:
            raise ValueError("nodes.gateway.config.admin_token is not set: export AREAL_BUS_ADMIN_TOKEN (8+ "
                             "characters) in the shell that starts the run, and write ${AREAL_BUS_ADMIN_TOKEN}")
        self.cfg = cfg
        self.backend = backend
        self.tok = tokenizer
        self.renderer = ChatRenderer(tokenizer)
        self.router = router
        self.emit = emit
        self.admission = admission
        self.log = RedactingLog(log if log is not None else structlog.get_logger().bind(_tag="gateway"),
                                cfg.admin_token)
        self.metrics = metrics if metrics is not None else Metrics()
        self._admin_digest = key_digest(cfg.admin_token)
        self.pending = 0  # choices handed to the backend and not yet back (max_pending_requests)
        ctx = cfg.max_context_tokens or getattr(backend, "max_context_tokens", None)
        if not ctx:
            raise ValueError("GatewayConfig.max_context_tokens is not set and the backend does not say "
                             "(set it to the engine's max_len)")
        self.max_context = int(ctx)
        self.store = SessionStore(cfg.max_sessions, cfg.session_idle_timeout_s, wal=wal,
                                  tag_key=key_digest(SESSION_TAG_CONTEXT + cfg.admin_token))
        self.conversations = Conversations(wal=wal)  # responses_routes: what previous_response_id continues
        self.wal = wal
        self.resumed, self.resend = 0, []  # what a restart found in the WAL (on_startup emits ``resend``)
        if wal is not None:
            self._restore()
        self.jobs: dict[str, set[asyncio.Task]] = {}
        self.unemitted: list = []
        self._sweeper: asyncio.Task | None = None
        # Response ids of unrecorded requests: unique, not secret, so a counter (no urandom per request).
        self._rid_prefix, self._rids = secrets.token_hex(6), itertools.count()

    # -- plumbing -------------------------------------------------------------------------------

    async def read_json(self, request: web.Request):
        try:
            raw = await asyncio.wait_for(request.read(), self.cfg.body_timeout_s)
        except TimeoutError:
            # The rest of the body is not wanted: marked ended, aiohttp does not linger reading it after
            # the 408 (whose reply closes the connection: server._errors).
            request.content.feed_eof()
            raise OpenAIError(408, f"The request body did not arrive within {self.cfg.body_timeout_s:g} s "
                              f"(body_timeout_s in the gateway config).", code="body_timeout") from None
        except web.HTTPRequestEntityTooLarge:
            raise OpenAIError(413, f"Request body is larger than the gateway's limit of {self.cfg.max_body_bytes} "
                              f"bytes (max_body_bytes in the gateway config).", code="request_too_large") from None
        except (HttpProcessingError, web.RequestPayloadError) as exc:  # a body breaking its framing (chunks, gzip)
            raise OpenAIError(400, f"The request body could not be read ({type(exc).__name__}).",
                              code="bad_body") from None
        except (ConnectionError, asyncio.IncompleteReadError):  # the client left mid-body: nobody to answer
            raise OpenAIError(400, "The request body ended before its length.", code="incomplete_body") from None
        if not raw:
            return None
        if orjson is not None:
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError:  # what json accepts besides (NaN, huge ints) or the error it names
                pass
            else:  # orjson's strings are valid UTF-8; only the nesting needs a look, and only when it could be deep
                if raw.count(b"{") + raw.count(b"[") > MAX_JSON_DEPTH:
                    check_json(data, strings=False)
                return data
        try:
            data = json.loads(raw)
        except RecursionError:
            raise too_deep() from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise OpenAIError(400, f"We could not parse the JSON body of your request ({exc}). The body must be "
                              f"a JSON object.", code="invalid_json") from None
        check_json(data, strings=True)  # json.loads takes "\ud800" (a lone surrogate: no text) where orjson does not
        return data

    def principal(self, request: web.Request, key: str | None = None):
        """ADMIN, a live Session, or a 401 saying what to check. The key is ``Authorization: Bearer`` (the
        openai SDK) or else ``x-api-key`` (the anthropic SDK), on every route. Keys never appear in a
        message or log."""
        if key is None:
            scheme, _, key = request.headers.get("Authorization", "").partition(" ")
            if scheme and scheme.lower() != "bearer":
                raise OpenAIError(401, "The Authorization header must be 'Bearer <key>'.", code="invalid_api_key")
            if not scheme:
                key = request.headers.get("x-api-key", "")
        if not key.strip():
            raise OpenAIError(401, "You didn't provide an API key. Pass the session key (or the admin token) as the "
                              "api_key: the openai SDK sends it as 'Authorization: Bearer <key>', the anthropic SDK "
                              "as 'x-api-key: <key>'. " + KEY_HELP, code="invalid_api_key")
        if key != key.strip():
            raise OpenAIError(401, "Invalid API key: it has leading or trailing whitespace or a newline; strip it. "
                              + KEY_HELP, code="invalid_api_key")
        if hmac.compare_digest(key_digest(key), self._admin_digest):  # digests: equal lengths, no early exit
            return ADMIN
        session, why = self.store.authenticate(key)
        if session is not None:
            return session
        if why != "invalid":
            sid = key.rpartition(".")[0]
            raise OpenAIError(401, f"Session {sid} has ended ({_ENDED_WHY.get(why, why)}); its key is no longer "
                              f"valid. Open a new session with POST /rl/sessions (the orchestrator's admin token) "
                              f"and use its api_key.", code="session_ended")
        literal = " The key is the literal text '${...}': it was never expanded." if key.startswith("${") else ""
        raise OpenAIError(401, f"Invalid API key.{literal} " + KEY_HELP, code="invalid_api_key")

    def count_refusal(self, request: web.Request, status: int, reason: str) -> None:
        kind = "rejected" if status < 500 else "failed"
        self.metrics.inc(f"http.{kind}")
        self.metrics.inc(f"http.{kind}.{reason}")
        self.log.info("request_refused", route=request.path, status=status, code=reason)

    def _emit(self, trajectories) -> None:
        import os

        from areal_bus.runtime.ledger import LedgerWriteError

        pending, self.unemitted = [*self.unemitted, *trajectories], []
        for traj in pending:
            try:
                if self.emit is not None:
                    self.emit(traj)
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
        self._emit(trajs)
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
                self._emit(trajs)

    async def on_startup(self, app) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self.sweep())
        resend, self.resend = self.resend, []
        self._emit(resend)

    async def on_shutdown(self, app) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for session in list(self.store.sessions.values()):
            await self.end_session(session, "shutdown")

    # -- chat completions -----------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        who = self.principal(request)  # a bad key is a 401 before anything else is looked at
        data = await self.read_json(request)
        if who is not ADMIN and who.closing:  # the session ended while the body arrived: say how, as a 401
            who = self.principal(request)
        req = parse_chat_request(data)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.model == self.cfg.policy_model:
            live = LiveStream(req.model, include_usage=include_usage) if req.stream else None
            resp, _ = await self.complete(req, who, t0, live, request)
            return live.stream if live is not None else json_response(resp)
        resp = await self.routed(req.model, data, t0)
        if not req.stream:
            return json_response(resp)
        return await sse_reply(request, b"".join(sse(c) for c in stream_chunks(resp, include_usage)) + SSE_DONE)

    async def routed(self, model: str, data: dict, t0: float) -> dict:
        if self.router is None:
            raise OpenAIError(404, f"The model '{model}' does not exist on this gateway; it serves "
                              f"'{self.cfg.policy_model}' (the policy being trained).", code="model_not_found",
                              param="model")
        body = {k: v for k, v in data.items() if k not in ("stream", "stream_options")}
        try:
            resp = await self.router.chat(model, body)
        except Exception as exc:
            if not hasattr(exc, "status") or not hasattr(exc, "body"):
                raise
            err = router_error(model, exc)
            err.reason = "upstream"  # the upstream's own code is not ours to count by
            raise err from None
        if not isinstance(resp, dict) or not resp.get("choices"):
            shown = json.dumps(resp, default=str)[:2000]
            raise OpenAIError(502, f"The upstream for '{model}' returned a response without choices: {shown}",
                              type="upstream_error", code="no_choices")
        self.metrics.observe_seconds("gateway.latency_seconds", time.monotonic() - t0)  # Prometheus' histogram
        self.log.info("request", route="chat", model=model, routed_to="router",
                      ms=round((time.monotonic() - t0) * 1000))
        return resp

    # -- models -----------------------------------------------------------------------------------

    def model_ids(self) -> list[str]:
        ids = [self.cfg.policy_model]
        routes = getattr(getattr(self.router, "cfg", None), "routes", None)
        if callable(routes):
            for route in routes().values():
                if route.model_id not in ids:
                    ids.append(route.model_id)
        return ids

    async def list_models(self, request: web.Request) -> web.Response:
        self.principal(request)
        ids = self.model_ids()
        if _anthropic_client(request):  # the anthropic SDK's models.list(): its own page shape
            return json_response({"data": [anthropic_model_card(m) for m in ids], "has_more": False,
                                  "first_id": ids[0], "last_id": ids[-1]})
        return json_response({"object": "list", "data": [model_card(m) for m in ids]})

    async def get_model(self, request: web.Request) -> web.Response:
        self.principal(request)
        model = request.match_info["model"]
        if model not in self.model_ids():
            raise OpenAIError(404, f"The model '{model}' does not exist on this gateway.", code="model_not_found",
                              param="model")
        return json_response(anthropic_model_card(model) if _anthropic_client(request) else model_card(model))


def _anthropic_client(request: web.Request) -> bool:
    """The anthropic SDK (and Claude Code) send ``anthropic-version`` on every request; the openai SDK never."""
    return "anthropic-version" in request.headers


def anthropic_model_card(model_id: str) -> dict:
    return {"type": "model", "id": model_id, "display_name": model_id, "created_at": "1970-01-01T00:00:00Z"}


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
    for prefix in ("", "/gateway"):
        app.router.add_post(f"{prefix}/v1/chat/completions", gw.chat_completions)
        app.router.add_get(f"{prefix}/v1/models", gw.list_models)
        app.router.add_get(f"{prefix}/v1/models/{{model}}", gw.get_model)
        app.router.add_post(f"{prefix}/v1/responses", gw.responses_create)
        app.router.add_post(f"{prefix}/v1/completions", gw.completions_create)
        app.router.add_post(f"{prefix}/v1/messages", gw.anthropic_messages)
        app.router.add_post(f"{prefix}/v1/messages/count_tokens", gw.anthropic_count_tokens)
        app.router.add_post(f"{prefix}/rl/sessions", gw.create_session)
        app.router.add_get(f"{prefix}/rl/sessions/{{sid}}", gw.get_session)
        app.router.add_post(f"{prefix}/rl/sessions/{{sid}}/reward", gw.reward_session)
        app.router.add_post(f"{prefix}/rl/sessions/{{sid}}/end", gw.end)
        app.router.add_get(f"{prefix}/rl/metrics", gw.metrics_view)
        app.router.add_get(f"{prefix}/health", gw.health)
    app.on_startup.append(gw.on_startup)
    app.on_shutdown.append(gw.on_shutdown)
    return app
