"""The gateway's OpenAI chat and model routes (the openai SDK's ``chat.completions`` and ``models``):

    POST /v1/chat/completions   chat_completions   the policy's (through PolicyChat: JSON or SSE, n, tools,
                                                   stop, usage) or another model's (through Upstream)
    GET  /v1/models             list_models        the policy model and the router's models; the
    GET  /v1/models/{model}     get_model          anthropic SDK's page shape when it asks (anthropic-version)

``OpenAIRoutes`` holds what they need (``Keys``, ``PolicyChat``, ``Upstream``, the config) and adds its
routes with ``register``; ``app.make_app`` registers each route group under "" and "/gateway".
"""

from __future__ import annotations

import time

from aiohttp import web

from areal_bus.config.node_configs import GatewayConfig
from nodes.gateway.keys import Keys
from nodes.gateway.live import LiveStream
from nodes.gateway.openai_api import SSE_DONE, OpenAIError, model_card, parse_chat_request, sse, stream_chunks
from nodes.gateway.policy_chat import PolicyChat
from nodes.gateway.server import ADMIN, json_response, read_json, sse_reply
from nodes.gateway.upstream import Upstream


class OpenAIRoutes:
    """POST /v1/chat/completions and GET /v1/models[/{model}]."""

    def __init__(self, cfg: GatewayConfig, keys: Keys, chat: PolicyChat, upstream: Upstream):
        self.cfg = cfg
        self.keys = keys
        self.chat = chat
        self.upstream = upstream

    def register(self, router: web.UrlDispatcher, prefix: str) -> None:
        router.add_post(f"{prefix}/v1/chat/completions", self.chat_completions)
        router.add_get(f"{prefix}/v1/models", self.list_models)
        router.add_get(f"{prefix}/v1/models/{{model}}", self.get_model)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        who = self.keys.principal(request)  # a bad key is a 401 before anything else is looked at
        data = await read_json(request, self.cfg)
        if who is not ADMIN and who.closing:  # the session ended while the body arrived: say how, as a 401
            who = self.keys.principal(request)
        req = parse_chat_request(data)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.model == self.cfg.policy_model:
            live = LiveStream(req.model, include_usage=include_usage) if req.stream else None
            resp, _ = await self.chat.complete(req, who, t0, live, request)
            return live.stream if live is not None else json_response(resp)
        resp = await self.upstream.chat(req.model, data, t0)
        if not req.stream:
            return json_response(resp)
        return await sse_reply(request, b"".join(sse(c) for c in stream_chunks(resp, include_usage)) + SSE_DONE)

    async def list_models(self, request: web.Request) -> web.Response:
        self.keys.principal(request)
        ids = self.upstream.model_ids()
        if _anthropic_client(request):  # the anthropic SDK's models.list(): its own page shape
            return json_response({"data": [anthropic_model_card(m) for m in ids], "has_more": False,
                                  "first_id": ids[0], "last_id": ids[-1]})
        return json_response({"object": "list", "data": [model_card(m) for m in ids]})

    async def get_model(self, request: web.Request) -> web.Response:
        self.keys.principal(request)
        model = request.match_info["model"]
        if model not in self.upstream.model_ids():
            raise OpenAIError(404, f"The model '{model}' does not exist on this gateway.", code="model_not_found",
                              param="model")
        return json_response(anthropic_model_card(model) if _anthropic_client(request) else model_card(model))


def _anthropic_client(request: web.Request) -> bool:
    """The anthropic SDK (and Claude Code) send ``anthropic-version`` on every request; the openai SDK never."""
    return "anthropic-version" in request.headers


def anthropic_model_card(model_id: str) -> dict:
    return {"type": "model", "id": model_id, "display_name": model_id, "created_at": "1970-01-01T00:00:00Z"}
