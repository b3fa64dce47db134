"""The gateway's Responses route (the openai SDK's ``client.responses``, the OpenAI Agents SDK, Codex):

    POST /v1/responses   responses_create   translated to a chat request (responses_api), served by the
                                            policy through PolicyChat.complete (recorded into the
                                            session, exact tokens) or by the router, answered as a
                                            Response or its SSE events

``previous_response_id``: the gateway keeps each response's conversation (``Conversations``: the
messages its request added and the reply, linked to the response it continued), per session, so a
follow-up that sends only its new items is the same chat conversation a client resending everything
would send, and continues the same recorded token prefix. Only the session that made a response (or the
admin, for its own unrecorded calls) can continue it; the conversations go with their session. A
session's are written to the gateway's WAL (nodes/gateway/wal.py, table ``responses``) before the reply,
like its turns: a gateway restarted after a kill -9 resumes the session and a follow-up by
previous_response_id continues where it was. The admin's own conversations are held in memory only (an
unknown id after a restart is a 404 saying to send the whole input).

``ResponsesRoutes`` holds what it needs (``Keys``, ``PolicyChat``, ``Upstream``, the ``Conversations``,
the session store, the config, metrics and log) and adds its route with ``register``; ``app.make_app``
registers each route group under "" and "/gateway". ``Conversations`` is made by the Gateway (which
hands it the WAL); ``lifecycle`` restores a resumed session's conversations into it.
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict

from aiohttp import web

from areal_bus.config.node_configs import GatewayConfig
from nodes.gateway import responses_api
from nodes.gateway.keys import Keys
from nodes.gateway.openai_api import OpenAIError, parse_chat_request
from nodes.gateway.policy_chat import PolicyChat
from nodes.gateway.server import ADMIN, SSE_HEADERS, count_refusal, json_response, read_json, sse_reply
from nodes.gateway.sessions import Session, SessionStore
from nodes.gateway.upstream import Upstream

RESPONSES_KEPT_PER_SESSION = 4096
"""Responses whose conversation a session (or the admin) can continue by previous_response_id: more
turns than an agent's episode takes; the oldest go first (a follow-up to one gets a 404)."""


class Conversations:
    """Per owner (a session id, or "" for the admin), each kept response's id -> (the response it
    continued, the messages it added: its request's input and the reply). Linked, so a session of T
    turns holds O(T) messages, not O(T^2)."""

    def __init__(self, per_owner: int = RESPONSES_KEPT_PER_SESSION, wal=None):
        self.per_owner = per_owner
        self.wal = wal  # a GatewayWAL: a session's responses go on disk before the reply
        self.by_owner: dict[str, OrderedDict[str, tuple[str | None, list[dict]]]] = {}

    def history(self, owner: str, rid: str | None) -> list[dict] | None:
        """The messages of response ``rid``'s conversation (instructions not included), or a 404."""
        if rid is None:
            return None
        kept = self.by_owner.get(owner, {})
        chain, at = [], rid
        while at is not None:
            entry = kept.get(at)
            if entry is None:
                gone = at != rid
                raise OpenAIError(404, f"Previous response with id '{rid}' not found"
                                  + (f" (its conversation reaches back to '{at}', which is no longer kept)" if gone
                                     else ": this gateway keeps the responses of this key's open session (the "
                                     "admin's in memory only, so none from before a restart)")
                                  + ". Send the whole conversation as input instead.",
                                  param="previous_response_id", code="previous_response_not_found")
            chain.append(entry[1])
            at = entry[0]
        return [m for part in reversed(chain) for m in part]

    def keep(self, owner: str, rid: str, parent: str | None, messages: list[dict], live: dict) -> None:
        if owner and self.wal is not None:  # a session's: on disk before the reply, as its turn is
            self.wal.response(owner, rid, parent, messages)
        self.restore(owner, rid, parent, messages)
        if len(self.by_owner) > 2 * len(live) + 64:  # amortised: ended sessions' conversations go
            for sid in [s for s in self.by_owner if s and s not in live]:
                del self.by_owner[sid]

    def restore(self, owner: str, rid: str, parent: str | None, messages: list[dict]) -> None:
        """Hold a response (one answered now, or one the WAL kept) for previous_response_id."""
        kept = self.by_owner.setdefault(owner, OrderedDict())
        kept[rid] = (parent, messages)
        while len(kept) > self.per_owner:
            kept.popitem(last=False)


class ResponsesLive:
    """A streamed Response on the wire, written as PolicyChat.complete generates it (the duck type of
    live.LiveStream: ``open``, ``text``, ``finish``, ``fail``, ``stream``). ``on_done(chat)`` runs
    before the last events go out, so a follow-up sent on response.completed finds the conversation; if it
    raises an OpenAIError (the conversation could not be stored) the stream ends in response.failed instead
    and the error is kept in ``failed`` for the handler to count."""

    def __init__(self, body: dict, on_done):
        self.body, self.on_done = body, on_done
        self.stream: web.StreamResponse | None = None
        self.events: responses_api.StreamEvents | None = None
        self.gone = False
        self.failed: OpenAIError | None = None

    async def open(self, request: web.Request, rid: str, prompt_tokens: int, n: int) -> None:
        self.events = responses_api.StreamEvents(self.body, responses_api.response_id(rid))
        self.stream = web.StreamResponse(headers=SSE_HEADERS)
        try:
            await self.stream.prepare(request)
        except (ConnectionError, RuntimeError):
            self.gone = True
        await self._write(self.events.opening())

    async def text(self, index: int, delta: str) -> None:
        await self._write(self.events.text(delta))

    async def reasoning(self, index: int, delta: str) -> None:
        await self._write(self.events.reasoning(delta))

    async def finish(self, resp: dict, rest: list[list[str]]) -> None:
        try:
            self.on_done(resp)
        except OpenAIError as err:
            self.failed = err
            await self.fail(err)
            return
        await self._write(self.events.closing(resp, rest[0]), eof=True)

    async def fail(self, err: OpenAIError) -> None:
        await self._write(self.events.error(err), eof=True)

    async def _write(self, events, eof: bool = False) -> None:
        if self.gone:
            return
        try:
            await self.stream.write(b"".join(responses_api.format_sse(e, d) for e, d in events))
            if eof:
                await self.stream.write_eof()
        except (ConnectionError, RuntimeError):  # the client left: the turn is recorded all the same
            self.gone = True


class ResponsesRoutes:
    """POST /v1/responses."""

    def __init__(self, cfg: GatewayConfig, keys: Keys, chat: PolicyChat, upstream: Upstream,
                 conversations: Conversations, store: SessionStore, *, metrics, log):
        self.cfg = cfg
        self.keys = keys
        self.chat = chat
        self.upstream = upstream
        self.conversations = conversations
        self.store = store  # its open sessions: the conversations of ended ones go
        self.metrics = metrics
        self.log = log

    def register(self, router: web.UrlDispatcher, prefix: str) -> None:
        router.add_post(f"{prefix}/v1/responses", self.responses_create)

    async def responses_create(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        who = self.keys.principal(request)
        body = await read_json(request, self.cfg)
        if who is not ADMIN and who.closing:  # the session ended while the body arrived: say how, as a 401
            who = self.keys.principal(request)
        if not isinstance(body, dict):
            raise OpenAIError(400, "The request body must be a JSON object.", code="invalid_body")
        owner = who.id if isinstance(who, Session) else ""
        parent = body.get("previous_response_id") if isinstance(body.get("previous_response_id"), str) else None
        chat, new = responses_api.to_chat_request(body, self.conversations.history(owner, parent))
        try:
            req = parse_chat_request(chat)
        except OpenAIError as err:  # the chat path's refusal, named as the Responses request names the field
            raise _renamed(err) from None
        stream = bool(body.get("stream"))
        done = functools.partial(self._keep, body, owner, parent, new)  # the reply's conversation, kept

        if req.model == self.cfg.policy_model:
            live = ResponsesLive(body, done) if stream else None
            try:
                resp, _ = await self.chat.complete(req, who, t0, live, request)
            except OpenAIError as err:  # refused before anything was sent (a field this model cannot honour)
                raise _renamed(err) from None
            if live is not None:
                if live.failed is not None:  # answered on the stream (response.failed): counted here
                    count_refusal(self.metrics, self.log, request, live.failed.status, live.failed.code)
                return live.stream
        else:
            resp = await self.upstream.chat(req.model, chat, t0)
        done(resp)
        rid = responses_api.response_id(resp["id"])
        if stream:
            events = responses_api.StreamEvents(body, rid).whole(resp)
            return await sse_reply(request, b"".join(responses_api.format_sse(e, d) for e, d in events))
        return json_response(responses_api.response_object(body, rid, resp))

    def _keep(self, body: dict, owner: str, parent: str | None, new: list[dict], resp: dict) -> None:
        """Keep the reply's conversation for previous_response_id (unless ``store`` is false), or a 503 if
        it could not be stored."""
        if body.get("store", True) is False:
            return
        try:
            self.conversations.keep(owner, responses_api.response_id(resp["id"]), parent,
                                    [*new, resp["choices"][0]["message"]], self.store.sessions)
        except Exception as exc:  # the WAL's write (disk full, I/O error): the turn is recorded, not this
            self.log.error("response_not_stored", session=owner or "-", error=repr(exc))
            raise OpenAIError(503, "The reply was generated and the turn recorded, but its conversation could "
                              f"not be stored ({type(exc).__name__}: {exc}), so previous_response_id cannot "
                              "continue it; retry sending the whole input.", type="server_error",
                              code="store_failed") from None


def _renamed(err: OpenAIError) -> OpenAIError:
    """A chat-path error with the field named as the Responses request names it (responses_param)."""
    named = responses_api.responses_param(err.param)
    if named != err.param and err.param:
        err.message = err.message.replace(f"'{err.param}'", f"'{named}'")
    err.message = responses_api.responses_message(err.message)
    err.param = named
    return err
