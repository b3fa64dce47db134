"""The gateway's Anthropic Messages routes (Claude Code and the anthropic SDK):

    POST /v1/messages              anthropic_messages      translated to an OpenAI request (anthropic_api),
                                                           served by the policy or the router, answered
                                                           as a Message or its events (anthropic_reply)
    POST /v1/messages/count_tokens anthropic_count_tokens  the prompt's size under the policy's template

Keys come from ``x-api-key`` or ``Authorization: Bearer`` and are checked like the OpenAI routes'; every
failure is an ``AnthropicError`` in Anthropic's shape (a model that is not served says which setting
picks it). ``AnthropicRoutes`` holds what they need (``Keys``, ``PolicyChat``, ``Upstream``, the
renderer, the config) and adds its routes with ``register``; ``app.make_app`` registers each route group
under "" and "/gateway".
"""

from __future__ import annotations

import time

from aiohttp import web

from areal_bus.config.node_configs import GatewayConfig
from nodes.gateway import anthropic_api, anthropic_reply
from nodes.gateway.chat import ChatError, ChatRenderer
from nodes.gateway.keys import Keys
from nodes.gateway.live import LiveStream
from nodes.gateway.openai_api import OpenAIError, parse_chat_request
from nodes.gateway.policy_chat import PolicyChat
from nodes.gateway.server import _reason, json_response, read_json, sse_reply
from nodes.gateway.upstream import Upstream


class AnthropicRoutes:
    """POST /v1/messages and /v1/messages/count_tokens."""

    def __init__(self, cfg: GatewayConfig, keys: Keys, chat: PolicyChat, upstream: Upstream,
                 renderer: ChatRenderer):
        self.cfg = cfg
        self.keys = keys
        self.chat = chat
        self.upstream = upstream
        self.renderer = renderer

    def register(self, router: web.UrlDispatcher, prefix: str) -> None:
        router.add_post(f"{prefix}/v1/messages", self.anthropic_messages)
        router.add_post(f"{prefix}/v1/messages/count_tokens", self.anthropic_count_tokens)

    async def anthropic_messages(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        try:
            who = self._anthropic_principal(request)
            body = await read_json(request, self.cfg)
            who = self._anthropic_principal(request)
            if not isinstance(body, dict):
                raise anthropic_api.AnthropicError(400, "request body must be a JSON object")
            oa = anthropic_api.to_openai_request(body)
            model = oa["model"]
            if model != self.cfg.policy_model:
                resp = await self.upstream.chat(model, oa, t0)
            else:
                live = LiveStream(model, anthropic=True) if body.get("stream") else None
                if live is not None:
                    live.events.thinking = anthropic_api.shows_thinking(body)
                resp, _ = await self.chat.complete(parse_chat_request(oa), who, t0, live, request)
                if live is not None:
                    return live.stream
        except OpenAIError as err:
            hint = " (Claude Code: set ANTHROPIC_MODEL to it)" if err.code == "model_not_found" else ""
            message = err.message
            if err.code == "invalid_schema":  # starts with the field's path, as Anthropic's messages do
                message = f"{anthropic_api.anthropic_path(err.param)}: {anthropic_api.anthropic_path(message)}"
            raise anthropic_api.AnthropicError(err.status, message + hint, _reason(err), err.headers) from None
        thinking = anthropic_api.shows_thinking(body)
        if body.get("stream"):
            events = anthropic_reply.stream_events(resp, model, thinking)
            return await sse_reply(request, b"".join(anthropic_reply.format_sse(e, d) for e, d in events))
        return json_response(anthropic_reply.from_openai_response(resp, model, thinking))

    async def anthropic_count_tokens(self, request: web.Request) -> web.Response:
        try:
            self._anthropic_principal(request)
            body = await read_json(request, self.cfg)
            oa = anthropic_api.count_tokens_request(body)
            req = parse_chat_request({**oa, "max_tokens": 1})
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            n = len(self.renderer.prompt_ids(messages, tools))
        except ChatError as exc:
            raise anthropic_api.AnthropicError(400, str(exc), "invalid_messages") from None
        except OpenAIError as err:
            raise anthropic_api.AnthropicError(err.status, err.message, _reason(err), err.headers) from None
        return json_response(anthropic_api.count_tokens_response(n))

    def _anthropic_principal(self, request: web.Request):
        key = anthropic_api.api_key_from_headers(request.headers)
        try:
            return self.keys.principal(request, key)
        except OpenAIError as err:
            if err.code == "invalid_api_key":
                raise anthropic_api.invalid_api_key(key) from None
            raise anthropic_api.AnthropicError(err.status, err.message, _reason(err)) from None
