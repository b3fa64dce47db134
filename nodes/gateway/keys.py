"""Who is calling the gateway: ``Keys.principal`` reads a request's key and answers with ADMIN, a live
session (``sessions.Session``), or a 401 that says what to check.

The key is ``Authorization: Bearer`` (the openai SDK) or else ``x-api-key`` (the anthropic SDK), on
every route. The admin token and the session keys are compared as sha256 digests with
``hmac.compare_digest``; no key ever appears in a message or a log line. A session's key that no
longer works says why (ended, idle, the gateway restarted) rather than "invalid".

    keys = Keys(cfg.admin_token, store)      # store: the gateway's sessions.SessionStore
    who = keys.principal(request)            # ADMIN, a Session, or OpenAIError(401)
"""

from __future__ import annotations

import hmac

from aiohttp import web

from nodes.gateway.openai_api import OpenAIError
from nodes.gateway.server import ADMIN
from nodes.gateway.sessions import SessionStore, key_digest

KEY_HELP = ("Check: is the environment variable holding the key set in this shell (echo ${#VAR} prints "
            "its length)? Does the config say ${VAR} rather than a literal? Is there stray whitespace or a "
            "newline in the key? Session keys come from POST /rl/sessions; the admin token is "
            "$AREAL_BUS_ADMIN_TOKEN of the shell that started the gateway.")

_ENDED_WHY = {"idle": "idle for longer than session_idle_timeout_s", "ended": "ended by POST /rl/sessions/{id}/end",
              "shutdown": "the gateway shut down",
              "gone": "this gateway no longer holds it: it was open on a gateway that has restarted since, or it "
                      "ended long ago"}


class Keys:
    """The admin token's digest and the session store: who a request's key names."""

    def __init__(self, admin_token: str, store: SessionStore):
        self._admin_digest = key_digest(admin_token)
        self.store = store

    def principal(self, request: web.Request, key: str | None = None):
        """ADMIN, a live Session, or a 401 saying what to check. ``key``: already read from the headers
        (the Anthropic routes read it their way); None reads it here. Keys never appear in a message
        or log."""
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
