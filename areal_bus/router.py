"""The unified model channel: one base_url and one API key (from an environment variable) route the
policy, reward and judge models, with retries, and a log line per request.

    cfg = load_router_config("configs/router.yaml")     # RouterConfigError names file and field
    async with ModelRouter(cfg, log=log) as router:
        reply = await router.chat("judge_model", {"messages": [{"role": "user", "content": "..."}]})
    reply = ModelRouter(cfg).chat_sync("judge_model", request)   # from synchronous code

``chat`` takes a role (policy_model / reward_model / judge_model) or a configured model_id, sends an
OpenAI chat.completions request with that route's model_id and default temperature / max_tokens, and
retries 429 (honouring Retry-After), 5xx and timeouts with exponential backoff and jitter; other
failures raise ``RouterError`` at once. Each request leaves one line in the log:

    [gateway] routed role=judge_model model=gpt-4o-mini status=200 ms=812 retries=1 ts=14:23:01.221

The key never reaches a log or an error message: it is held as a SecretStr, sent only in the
Authorization header, and scrubbed from any upstream body that echoes it.

Check a channel by hand: areal-bus check-channel --config configs/router.yaml --model policy_model
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import os
import random
import re
import socket
import time

import aiohttp
import structlog
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError, field_validator

from areal_bus.gateway_client import describe_no_choices, describe_unreachable, http_problem
from areal_bus.config.topology import read_yaml

ROLES = ("policy_model", "reward_model", "judge_model")

BACKOFF_MAX_S = 8.0
"""Longest wait between two retries. Exponential backoff past this only delays a trajectory that is
already late; a rate limit lifts within seconds, an outage lasts longer than any sensible retry."""

BACKOFF_JITTER = 0.5
"""Each wait is drawn from [1 - jitter, 1] of the exponential value, so the rollout workers that were
refused together do not come back together ("equal jitter": never a near-zero wait)."""

RETRY_AFTER_MAX_S = 30.0
"""A 429's Retry-After is honoured up to this long; a longer one is capped (and the retry will likely
be refused again, ending in a clear 429 error rather than a silently stalled rollout)."""


class RouterConfigError(ValueError):
    """An unusable router YAML; the message names the file and the field, never the key."""


class RouterError(Exception):
    """A model request that failed. ``str(err)`` is one line, ``<what failed>: <fix>``.

    kind: unauthorized / unknown_model / unreachable / no_choices / upstream / timeout.
    status: the HTTP status (None when no reply came). body: the reply body, key scrubbed."""

    def __init__(self, kind: str, what: str, hint: str, status: int | None = None, body: str | None = None,
                 role: str = "", model: str = "", retries: int = 0):
        super().__init__(f"{what}: {hint}")
        self.kind, self.what, self.hint, self.status, self.body = kind, what, hint, status, body
        self.role, self.model, self.retries = role, model, retries


# -- configuration --------------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ApiGateway(_Strict):
    base_url: str = Field(description="The OpenAI-compatible endpoint every model call goes to, up to and "
                          "including /v1 (http://HOST:PORT/v1).")
    api_key: str = Field(pattern=r"^\$\{[A-Za-z_][A-Za-z0-9_]*\}$", description="Exactly ${NAME}: the key is "
                         "read from that environment variable at load. A literal key is refused.")
    timeout: float = Field(60.0, gt=0, le=3600, description="Seconds one attempt may take (connect to last "
                           "byte) before it counts as a timeout and is retried.")
    max_retries: int = Field(3, ge=0, le=20, description="Retries after the first attempt, on 429, 5xx and "
                             "timeouts. Other failures (401, 404, a body without choices) are not retried.")
    retry_backoff_s: float = Field(0.5, ge=0, le=60, description="Wait before the first retry; doubles on each "
                                   "one (with jitter, capped at 8 s). A 429's Retry-After replaces it.")

    @field_validator("base_url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not re.match(r"^https?://[^/\s]+", v):
            raise ValueError("must be an http(s) URL such as http://127.0.0.1:9000/v1")
        return v.rstrip("/")

    @property
    def key_env(self) -> str:
        return self.api_key[2:-1]


class ModelRoute(_Strict):
    model_id: str = Field(min_length=1, description="The model name sent upstream in the request's 'model'.")
    temperature: float = Field(1.0, ge=0, le=2, description="Default sampling temperature (a request's own wins).")
    max_tokens: int = Field(1024, ge=1, le=1_000_000, description="Default completion budget (a request's own wins).")
    timeout: float | None = Field(None, gt=0, le=3600, description="Per-attempt timeout for this model; "
                                  "default api_gateway.timeout (a judge reading a long transcript needs more).")


class ModelRouting(_Strict):
    policy_model: ModelRoute | None = Field(None, description="The policy being trained (served by the gateway).")
    reward_model: ModelRoute | None = Field(None, description="A scoring model behind the same base_url.")
    judge_model: ModelRoute | None = Field(None, description="An LLM judge for reward_source: judge.")


class RouterConfig(_Strict):
    api_gateway: ApiGateway
    model_routing: ModelRouting = Field(default_factory=ModelRouting)
    _key: SecretStr | None = PrivateAttr(None)
    _source: str = PrivateAttr("<router config>")

    @property
    def source(self) -> str:
        return self._source

    def resolve_key(self) -> SecretStr:
        """Read the key from its environment variable; RouterConfigError if unset, empty or padded."""
        if self._key is None:
            self._key = SecretStr(_read_key(self.api_gateway.key_env, self._source))
        return self._key

    def routes(self) -> dict[str, ModelRoute]:
        return {r: getattr(self.model_routing, r) for r in ROLES if getattr(self.model_routing, r) is not None}

    def route(self, name: str) -> tuple[str, ModelRoute]:
        """(role, route) for a role name or a configured model_id."""
        routes = self.routes()
        if name in routes:
            return name, routes[name]
        for role, r in routes.items():
            if r.model_id == name:
                return role, r
        known = ", ".join([*routes, *(r.model_id for r in routes.values())]) or "none configured"
        if name in ROLES:
            raise RouterError("unknown_model", f"no route for {name}",
                              f"add model_routing.{name} (model_id, temperature, max_tokens) to {self._source}",
                              model=name)
        raise RouterError("unknown_model", f"no route for model {name!r}",
                          f"use a role or a model_id configured in {self._source} ({known})", model=name)


_KEY_REF = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _read_key(name: str, source: str) -> str:
    where = f"{source}: api_gateway.api_key"
    value = os.environ.get(name)
    if value is None:
        raise RouterConfigError(f"{where}: environment variable ${name} is not set in this shell: "
                                f"export {name}=<key> (in the shell that starts the run)")
    if not value:
        raise RouterConfigError(f"{where}: environment variable ${name} is set but empty: export {name}=<key>")
    if value != value.strip() or re.search(r"\s", value):
        flaws = []
        if value.endswith("\n") or value.endswith("\r"):
            flaws.append("ends with a newline")
        elif value != value.rstrip():
            flaws.append("ends with whitespace")
        if value != value.lstrip():
            flaws.append("starts with whitespace")
        if re.search(r"\s", value.strip()):
            flaws.append("has whitespace inside")
        raise RouterConfigError(
            f"{where}: the key in ${name} ({len(value)} chars) {' and '.join(flaws)}, which the upstream would "
            f"refuse with 401: re-export it without: export {name}=\"$(printf %s \"${name}\" | tr -d '[:space:]')\"")
    return value


def _check_key_ref(data: dict, source: str) -> None:
    """Refuse a literal key before anything else sees the value (it must never be echoed)."""
    gw = data.get("api_gateway")
    if not isinstance(gw, dict) or "api_key" not in gw:
        return  # pydantic reports the missing field
    raw = gw["api_key"]
    where = f"{source}: api_gateway.api_key"
    if isinstance(raw, str) and _KEY_REF.match(raw):
        return
    if isinstance(raw, str) and "${" in raw:
        raise RouterConfigError(f"{where}: must be exactly ${{NAME}}, with nothing around it and no :-default "
                                f"(a default would be a literal key in the file): write api_key: ${{AREAL_BUS_API_KEY}}")
    raise RouterConfigError(f"{where}: a literal API key is refused (keys in files leak through git, copies "
                            f"and logs): write api_key: ${{AREAL_BUS_API_KEY}} and run "
                            f"`export AREAL_BUS_API_KEY=<key>` in the shell that starts the run")


def _expand(value, path: str, source: str):
    """${NAME} and ${NAME:-default} in every string but the key (resolved separately, never defaulted)."""
    if isinstance(value, str):
        def sub(m):
            if m.group(1) in os.environ:
                return os.environ[m.group(1)]
            if m.group(2) is not None:
                return m.group(2)
            raise RouterConfigError(f"{source}: {path}: environment variable ${{{m.group(1)}}} is not set "
                                    f"(export it in this shell, or write ${{{m.group(1)}:-default}})")
        return _ENV.sub(sub, value)
    if isinstance(value, dict):
        paths = {k: f"{path}.{k}" if path else str(k) for k in value}
        return {k: v if paths[k] == "api_gateway.api_key" else _expand(v, paths[k], source) for k, v in value.items()}
    return value


def parse_router_config(data, source: str = "<router config>", resolve_key: bool = True) -> RouterConfig:
    if not isinstance(data, dict):
        raise RouterConfigError(f"{source}: a router config is a YAML mapping with api_gateway and "
                                f"model_routing, got {type(data).__name__}")
    _check_key_ref(data, source)
    data = _expand(data, "", source)
    try:
        cfg = RouterConfig.model_validate(data)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
            got = e.get("input")
            shown = "" if e["type"] in ("extra_forbidden", "missing") or isinstance(got, dict) \
                or loc.endswith("api_key") else f" (got {got!r})"
            problems.append(f"{loc}: {e['msg']}{shown}")
        raise RouterConfigError(f"{source}: invalid router config: {'; '.join(problems)}") from None
    cfg._source = source
    if resolve_key:
        cfg.resolve_key()
    return cfg


def load_router_config(path: str | os.PathLike, resolve_key: bool = True) -> RouterConfig:
    """Read and validate a router YAML and read its key from the environment; RouterConfigError with
    one message naming the file and field otherwise."""
    data = read_yaml(path, "router config", RouterConfigError)
    return parse_router_config(data, str(path), resolve_key)


# -- the router -----------------------------------------------------------------------------------

def _retry_after_s(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


class ModelRouter:
    """Routes chat.completions requests by role over one aiohttp session. Use as an async context
    manager (or call ``close``); ``chat_sync`` opens a session of its own per call."""

    def __init__(self, cfg: RouterConfig, log=None):
        self.cfg = cfg
        self._key = cfg.resolve_key()
        self.url = f"{cfg.api_gateway.base_url}/chat/completions"
        self.log = log if log is not None else structlog.get_logger().bind(_tag="router")
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def chat(self, role_or_model: str, request: dict) -> dict:
        """Send one chat.completions request; the reply (with non-empty ``choices``) or RouterError."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return await self._chat(self._session, role_or_model, request)

    def chat_sync(self, role_or_model: str, request: dict) -> dict:
        """``chat`` for synchronous callers (the CLI, the reward node); not from inside an event loop."""
        async def once():
            async with aiohttp.ClientSession() as session:
                return await self._chat(session, role_or_model, request)
        return asyncio.run(once())

    # -- internals ------------------------------------------------------------------------------
    def _scrub(self, text: str) -> str:
        key = self._key.get_secret_value()
        return text.replace(key, "***") if key else text

    def _backoff_s(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, RETRY_AFTER_MAX_S)
        wait = min(BACKOFF_MAX_S, self.cfg.api_gateway.retry_backoff_s * 2 ** attempt)
        return wait * random.uniform(1 - BACKOFF_JITTER, 1)

    async def _chat(self, session: aiohttp.ClientSession, role_or_model: str, request: dict) -> dict:
        role, route = self.cfg.route(role_or_model)
        if request.get("stream"):
            raise ValueError("the router sends non-streamed requests: leave 'stream' out (or false)")
        payload = {**request, "model": route.model_id}
        payload.setdefault("temperature", route.temperature)
        payload.setdefault("max_tokens", route.max_tokens)
        gw = self.cfg.api_gateway
        timeout = aiohttp.ClientTimeout(total=route.timeout or gw.timeout)
        # The only place the key goes: this header, on the wire. Nothing logs request headers.
        headers = {"Authorization": f"Bearer {self._key.get_secret_value()}"}
        t0 = time.monotonic()
        retries = 0
        while True:
            status, text, retry_after, failure = None, "", None, None
            try:
                async with session.post(self.url, json=payload, headers=headers, timeout=timeout) as resp:
                    status, retry_after = resp.status, _retry_after_s(resp.headers.get("Retry-After"))
                    text = self._scrub(await resp.text(errors="replace"))
            except asyncio.TimeoutError:
                failure = "timeout"
            except aiohttp.ClientConnectorError as exc:
                # Not retried: nothing listening is a setup problem, and saying so at once is the fix.
                reason = "refused" if isinstance(exc.os_error, ConnectionRefusedError) else \
                    "dns" if isinstance(exc.os_error, socket.gaierror) else str(exc.os_error or exc)
                what, hint = describe_unreachable(gw.base_url, reason, config=self.cfg.source)
                raise self._fail(RouterError("unreachable", what, hint, role=role, model=route.model_id,
                                             retries=retries), t0) from None
            except aiohttp.ClientError as exc:
                failure = type(exc).__name__  # dropped connection mid-reply: transient, retried like a 5xx
            if failure is None and status < 500 and status != 429:
                break
            if retries >= gw.max_retries:
                break
            wait = self._backoff_s(retries, retry_after if status == 429 else None)
            self.log.warning("retry", role=role, model=route.model_id, attempt=retries + 1,
                             reason=failure or status, wait_ms=round(wait * 1000))
            await asyncio.sleep(wait)
            retries += 1
        ctx = dict(role=role, model=route.model_id, retries=retries)
        if failure == "timeout":
            t = route.timeout or gw.timeout
            knob = f"model_routing.{role}.timeout" if route.timeout else "api_gateway.timeout"
            raise self._fail(RouterError(
                "timeout", f"no reply from {self.url} for {route.model_id} within {t:g} s"
                f"{f' on any of {retries + 1} attempts' if retries else ''}",
                f"raise {knob} in {self.cfg.source} if the model is just slow, or check the upstream's load", **ctx), t0)
        if failure is not None:
            raise self._fail(RouterError("upstream", f"connection to {self.url} dropped ({failure}) "
                                         f"on all {retries + 1} attempts", "the upstream is restarting or "
                                         "overloaded; see its log", **ctx), t0)
        if not 200 <= status < 300:
            key_env = gw.key_env
            kind, what, hint = http_problem(
                status, text, url=self.url, model=route.model_id, key_env=key_env, config=self.cfg.source,
                field=f"model_routing.{role}.model_id", retries=retries,
                key_facts=f"key from ${key_env}: set, {len(self._key.get_secret_value())} chars, no whitespace")
            raise self._fail(RouterError(kind, what, hint, status, text, **ctx), t0)
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if not (isinstance(data, dict) and isinstance(data.get("choices"), list) and data["choices"]):
            what, hint = describe_no_choices(text, self.url)
            raise self._fail(RouterError("no_choices", what, hint, status, text, **ctx), t0)
        self.log.info("routed", role=role, model=route.model_id, status=status,
                      ms=round((time.monotonic() - t0) * 1000), retries=retries)
        return data

    def _fail(self, err: RouterError, t0: float) -> RouterError:
        self.log.warning("route_failed", role=err.role, model=err.model, status=err.status, kind=err.kind,
                         ms=round((time.monotonic() - t0) * 1000), retries=err.retries, error=str(err))
        return err


def reply_text(reply: dict) -> str:
    """The first choice's message text (chat) or text (completions)."""
    choice = reply["choices"][0]
    msg = choice.get("message") or {}
    return msg.get("content") or choice.get("text") or ""
