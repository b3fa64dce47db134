"""Models other than the policy: ``Upstream`` sends their chat requests to the model router
(``areal_bus.router.ModelRouter``, when the gateway's ``router_config`` names one) and lists the models
the gateway serves.

A request for another model is never recorded: it is answered as the router answers it (its errors in
the API's shape, counted as ``http.rejected.upstream`` or ``http.failed.upstream``), or with a 404
model_not_found when no router is given. The OpenAI, Anthropic and Responses routes all end here for
such a model.

    upstream = Upstream(router, cfg.policy_model, metrics=metrics, log=log)
    resp = await upstream.chat(model, openai_request, t0)   # an OpenAI chat.completion
"""

from __future__ import annotations

import json
import time

from nodes.gateway.openai_api import OpenAIError, router_error


class Upstream:
    """The router for other models (None: only the policy is served), and the policy's model id."""

    def __init__(self, router, policy_model: str, *, metrics, log):
        self.router = router
        self.policy_model = policy_model
        self.metrics = metrics
        self.log = log

    async def chat(self, model: str, data: dict, t0: float) -> dict:
        """``data`` (an OpenAI chat request, streamed or not) answered by ``model`` through the router,
        as a whole chat.completion; a 404 without a router."""
        if self.router is None:
            raise OpenAIError(404, f"The model '{model}' does not exist on this gateway; it serves "
                              f"'{self.policy_model}' (the policy being trained).", code="model_not_found",
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

    def model_ids(self) -> list[str]:
        """The policy's id first, then each model the router routes to."""
        ids = [self.policy_model]
        routes = getattr(getattr(self.router, "cfg", None), "routes", None)
        if callable(routes):
            for route in routes().values():
                if route.model_id not in ids:
                    ids.append(route.model_id)
        return ids
