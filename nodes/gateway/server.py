"""The gateway's HTTP plumbing: reading a request's JSON body, JSON and SSE replies, the error middleware
and its refusal counts, and binding the server to its port.

Every route group (``openai_routes``, ``anthropic_routes``, ``responses_routes``, ``completions_routes``,
``rl_routes``) builds on what is here; ``app`` re-exports the public names (``json_response``,
``start_server``, ``bound_port``, ``GatewayStartError``, ``GATEWAY``), so callers import them from
``nodes.gateway.app`` as before. This module never imports ``app``: the middleware reaches the Gateway
through ``request.app[GATEWAY]`` (its ``metrics`` and ``log``).

    data = await read_json(request, cfg)              # the body as JSON (None if empty), or a 4xx
    app = make_app(cfg, backend, tokenizer)           # nodes.gateway.app; installs the _errors middleware
    runner = await start_server(app, cfg)             # binds host:port; GatewayStartError if it cannot
    port = bound_port(runner)                         # the port picked, when cfg.port is 0
"""

from __future__ import annotations

import asyncio
import errno
import json
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from nodes.gateway import anthropic_api
from nodes.gateway.guard import MAX_JSON_DEPTH, ProtocolLog, check_json, too_deep
from nodes.gateway.openai_api import OpenAIError, error_body

if TYPE_CHECKING:
    from areal_bus.config.node_configs import GatewayConfig

try:  # optional: a JSON codec several times faster than json's, on every request and response body
    import orjson
except ImportError:
    orjson = None


class GatewayStartError(RuntimeError):
    """The server could not start listening; the message says why and what to do."""


GATEWAY = web.AppKey("gateway", object)
"""``app[GATEWAY]``: the Gateway behind an application (its store, metrics, log and route groups)."""

ADMIN = object()
"""The principal of a request made with the admin token."""


def json_response(data, status: int = 200, headers: dict | None = None) -> web.Response:
    """web.json_response, with orjson when it is installed and can encode ``data`` (json otherwise)."""
    if orjson is not None:
        try:
            body = orjson.dumps(data)
        except TypeError:  # a type orjson does not encode (numpy scalar, non-str key): json's rules
            body = json.dumps(data).encode()
    else:
        body = json.dumps(data).encode()
    return web.Response(body=body, status=status, headers=headers, content_type="application/json", charset="utf-8")


async def read_json(request: web.Request, cfg: GatewayConfig):
    """The request's body as JSON (None if empty), or the 4xx that says why not: too slow to arrive
    (``cfg.body_timeout_s``), too large (``cfg.max_body_bytes``), broken framing, not JSON, nested too
    deep, or holding a string that is not text."""
    try:
        raw = await asyncio.wait_for(request.read(), cfg.body_timeout_s)
    except TimeoutError:
        # The rest of the body is not wanted: marked ended, aiohttp does not linger reading it after
        # the 408 (whose reply closes the connection: _errors).
        request.content.feed_eof()
        raise OpenAIError(408, f"The request body did not arrive within {cfg.body_timeout_s:g} s "
                          f"(body_timeout_s in the gateway config).", code="body_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise OpenAIError(413, f"Request body is larger than the gateway's limit of {cfg.max_body_bytes} "
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


def count_refusal(metrics, log, request: web.Request, status: int, reason: str) -> None:
    """A refused request, counted in ``metrics`` as ``http.rejected.<reason>`` (a 4xx) or
    ``http.failed.<reason>`` (a 5xx), and logged with its route."""
    kind = "rejected" if status < 500 else "failed"
    metrics.inc(f"http.{kind}")
    metrics.inc(f"http.{kind}.{reason}")
    log.info("request_refused", route=request.path, status=status, code=reason)


SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def sse_reply(request: web.Request, data: bytes) -> web.StreamResponse:
    """A whole server-sent event stream (``data``, its events already formatted) as the reply; a
    client that left is not an error (what it asked for is recorded)."""
    stream = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await stream.prepare(request)
        await stream.write(data)
        await stream.write_eof()
    except (ConnectionError, RuntimeError):
        pass
    return stream


@web.middleware
async def _errors(request: web.Request, handler):
    """Every error in the API's own shape: Anthropic's under /messages, OpenAI's everywhere else; each
    counted by reason (count_refusal)."""
    gw = request.app[GATEWAY]
    gw.metrics.inc("http.requests")
    anthropic = request.path.rstrip("/").endswith("/messages") or "/messages/" in request.path
    try:
        return await handler(request)
    except OpenAIError as err:
        count_refusal(gw.metrics, gw.log, request, err.status, _reason(err))
        if err.status == 408:  # the body did not arrive in time: what is left of it is not worth reading
            resp = json_response(err.body(), status=err.status, headers=err.headers)
            resp.force_close()
            return resp
        if anthropic:
            return json_response(anthropic_api.error_body(err.status, err.message), status=err.status,
                                 headers=err.headers)
        return json_response(err.body(), status=err.status, headers=err.headers)
    except anthropic_api.AnthropicError as err:
        count_refusal(gw.metrics, gw.log, request, err.status, err.code)
        return json_response(err.body, status=err.status, headers=err.headers)
    except web.HTTPException as exc:  # aiohttp's own: unknown route, wrong method, body too large
        if exc.status < 400:
            raise
        message = {404: f"Unknown route {request.method} {request.path}. The gateway serves /v1/chat/completions, "
                        "/v1/models, /v1/messages and /rl/sessions (also under /gateway).",
                   405: f"Method {request.method} is not allowed on {request.path}.",
                   413: "Request body too large."}.get(exc.status, exc.reason)
        code = {404: "unknown_url", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        count_refusal(gw.metrics, gw.log, request, exc.status, code or f"http_{exc.status}")
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        if anthropic:
            return json_response(anthropic_api.error_body(exc.status, message), status=exc.status, headers=headers)
        return json_response(error_body(message, code=code), status=exc.status, headers=headers)
    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # deliberately tolerated: a bug of ours (or a library's panic, which is no
        # Exception) is a 500 in the API's shape, not a dropped connection
        gw.metrics.inc("http.failed")
        gw.metrics.inc("http.failed.internal_error")
        gw.log.error("internal_error", route=request.path, error=repr(exc))
        message = f"The gateway failed to handle the request ({type(exc).__name__}: {exc}); see the gateway log."
        if anthropic:
            return json_response(anthropic_api.error_body(500, message), status=500)
        return json_response(error_body(message, "server_error"), status=500)


def _reason(err: OpenAIError) -> str:
    """What a refusal is counted as: the gateway's own error code (a small fixed set), never free text."""
    return getattr(err, "reason", None) or err.code or f"http_{err.status}"


class _HeaderDeadline(RequestHandler):
    """aiohttp's connection handler with a deadline on each request's head. aiohttp closes a connection
    that sends nothing (its keep-alive timer), but cancels that timer at the first byte and then waits
    for the rest of the headers for ever: a client that sends half a header holds the connection and
    its buffers (issue 17: 220 held for 20 s and more). Here the head must be complete within
    ``header_timeout_s`` of the connection opening or of the first byte after a reply. Relies on
    aiohttp's ``_messages`` (parsed requests not yet handled) and ``_current_request``, as of 3.14;
    tests/test_gateway_timeouts.py fails if they change meaning."""

    __slots__ = ("_deadline", "_header_timeout_s", "_on_timeout")

    def __init__(self, *args, header_timeout_s: float, on_timeout, **kw):
        super().__init__(*args, **kw)
        self._header_timeout_s, self._on_timeout, self._deadline = header_timeout_s, on_timeout, None

    def _waiting_for_head(self) -> bool:
        return self._current_request is None and not self._messages

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self._loop.call_later(self._header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self._waiting_for_head() and self.transport is not None:
            self._on_timeout()
            self.force_close()  # closes the transport; the parser's buffers go with the handler

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._waiting_for_head():
            self._arm()  # a head begun (or still incomplete): it has until the deadline
        else:
            self._disarm()  # a whole head parsed, or bytes of a body being read: the body has its own

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


class _Factory:
    """The server's protocol factory, making ``_HeaderDeadline`` handlers with what aiohttp's
    ``Server.__call__`` gives its own (``runner.server`` stays the one aiohttp shuts down)."""

    def __init__(self, server, header_timeout_s: float, on_timeout):
        self.server, self.header_timeout_s, self.on_timeout = server, header_timeout_s, on_timeout

    def __call__(self) -> RequestHandler:
        return _HeaderDeadline(self.server, loop=self.server._loop, header_timeout_s=self.header_timeout_s,
                               on_timeout=self.on_timeout, **self.server._kwargs)


class _Site(web.TCPSite):
    """web.TCPSite listening with ``_Factory``'s handlers (TCPSite.start, the factory swapped)."""

    def __init__(self, runner, host, port, factory: _Factory):
        super().__init__(runner, host, port)
        self._factory = factory

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._factory, self._host, self._port,
                                                backlog=self._backlog, reuse_address=self._reuse_address,
                                                reuse_port=self._reuse_port)
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]


async def start_server(app: web.Application, cfg: GatewayConfig) -> web.AppRunner:
    """Listen on cfg.host:cfg.port (``bound_port(runner)`` says which, for port 0). GatewayStartError
    with what to do if the port is taken or the address is wrong. A request head not complete within
    ``cfg.header_timeout_s`` closes its connection (counted as http.rejected.header_timeout); the body's
    deadline (``cfg.body_timeout_s``) is kept where it is read (``read_json``)."""
    gw = app[GATEWAY]
    runner = web.AppRunner(app, access_log=None, handle_signals=False, logger=ProtocolLog(gw.metrics, gw.log))
    await runner.setup()

    def timed_out() -> None:
        gw.metrics.inc("http.rejected")
        gw.metrics.inc("http.rejected.header_timeout")

    site = _Site(runner, cfg.host, cfg.port, _Factory(runner.server, cfg.header_timeout_s, timed_out))
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        if exc.errno == errno.EADDRINUSE:
            raise GatewayStartError(f"gateway cannot listen on {cfg.host}:{cfg.port}: the port is in use (another "
                                    f"gateway still running? `ss -ltnp | grep :{cfg.port}` shows who); stop it or "
                                    f"set nodes.gateway.config.port") from None
        raise GatewayStartError(f"gateway cannot listen on {cfg.host}:{cfg.port}: {exc.strerror}") from None
    return runner


def bound_port(runner: web.AppRunner) -> int:
    return runner.addresses[0][1]
