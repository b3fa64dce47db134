"""What the gateway refuses before it looks at a request's meaning, and what it never writes to a log.

- ``check_json``: a body nested deeper than MAX_JSON_DEPTH, or (json's fallback path) holding a string
  that is not text, is a 400, before anything recursive (json.dumps, the chat template) meets it.
- ``RedactingLog``: the gateway's logger, with the admin token and session keys scrubbed from every
  string field and control characters escaped.
- ``ProtocolLog``: aiohttp's server logger for the gateway: a request that is not HTTP is counted and
  logged by the class of its error, never by aiohttp's text of it (which quotes the raw header, key and all).
"""

from __future__ import annotations

import re
import sys

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from nodes.gateway.openai_api import OpenAIError

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a request body may have. Real requests nest a dozen levels
(a tool's JSON Schema); a few hundred would overflow the recursion of json.dumps and the chat
template's tojson further down the path, a 500 instead of a 400."""


def too_deep() -> OpenAIError:
    return OpenAIError(400, f"The JSON body is nested more than {MAX_JSON_DEPTH} levels deep.", code="json_too_deep")


def check_json(data, strings: bool) -> None:
    """400 for a body nested deeper than MAX_JSON_DEPTH or (``strings``) holding a string that is not
    text (a lone surrogate, which the tokenizer and the log file cannot take). Iterative: no recursion."""
    stack = [(data, 1)]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, dict):
            items = obj.values()
            if strings:
                check_text(obj.keys())
        elif isinstance(obj, list):
            items = obj
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise too_deep()
        if strings:
            check_text(v for v in items if isinstance(v, str))
        stack.extend((v, depth + 1) for v in items if isinstance(v, (dict, list)))
    if strings and isinstance(data, str):
        check_text((data,))


def check_text(texts) -> None:
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise OpenAIError(400, "The JSON body has a string that is not valid Unicode (a lone UTF-16 surrogate "
                              "escape such as \\ud800).", code="invalid_unicode") from None


_SESSION_KEY = re.compile(r"(sess-[0-9a-f]{20})\.[A-Za-z0-9_\-]+")


class RedactingLog:
    """The gateway's logger with secrets scrubbed from every string field: the admin token, and the secret
    half of any session key (``sess-<id>.<secret>`` -> ``sess-<id>.<redacted>``); control characters and
    lone surrogates escaped. The gateway never logs a key on purpose: this guards the lines that quote what
    a client sent (a path, an exception's text), which must also not forge a line or break the file."""

    __slots__ = ("_log", "_token")

    def __init__(self, log, token: str):
        self._log, self._token = log, token

    def _clean(self, fields: dict) -> dict:
        for k, v in fields.items():
            if isinstance(v, str):
                if self._token in v or ("sess-" in v and "." in v):
                    v = fields[k] = _SESSION_KEY.sub(r"\1.<redacted>", v.replace(self._token, "<admin-token>"))
                if not v.isprintable():  # a newline in a path would forge a log line; a surrogate breaks the file
                    fields[k] = v.encode("unicode_escape").decode("ascii")
        return fields

    def info(self, event: str, **fields) -> None:
        self._log.info(event, **self._clean(fields))

    def warning(self, event: str, **fields) -> None:
        self._log.warning(event, **self._clean(fields))

    def error(self, event: str, **fields) -> None:
        self._log.error(event, **self._clean(fields))

    def bind(self, **fields) -> RedactingLog:
        return RedactingLog(self._log.bind(**self._clean(fields)), self._token)


class ProtocolLog:
    """aiohttp's server logger for the gateway (``RequestHandler(logger=...)``). What aiohttp reports is a
    request it could not parse as HTTP, or a connection that failed outside any handler; its exception
    text quotes the raw request line or header, key and all. So each is counted and logged as one line
    naming the exception's class, never its text or traceback."""

    def __init__(self, metrics, log):
        self.metrics, self.log = metrics, log

    def _report(self, msg, exc_info) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, web.RequestPayloadError):  # a body left unread (a 401 needs none) broke its framing
            self.log.info("unread_body_malformed", error=type(exc.__cause__ or exc).__name__)  # after the reply
        elif isinstance(exc, ConnectionError):  # the client left before aiohttp could write to it (100-continue)
            self.metrics.inc("http.client_gone")
        elif isinstance(exc, HttpProcessingError):
            status = exc.code if isinstance(exc.code, int) and 400 <= exc.code < 500 else 400
            self.metrics.inc("http.rejected")
            self.metrics.inc("http.rejected.bad_http")
            self.log.info("request_refused", status=status, code="bad_http", error=type(exc).__name__)
        else:
            self.metrics.inc("http.failed")
            self.metrics.inc("http.failed.server")
            self.log.warning("http_server_error", what=str(msg), error=type(exc).__name__ if exc else "-")

    def exception(self, msg, *args, exc_info=True, **kw) -> None:
        self._report(msg, exc_info)

    def debug(self, msg, *args, exc_info=None, **kw) -> None:
        if exc_info is not None:  # the first request of a connection was not HTTP (a TLS hello, a port scan)
            self._report(msg, exc_info)

    def error(self, msg, *args, **kw) -> None:
        self.log.warning("http_server_error", error=str(msg) % args if args else str(msg))

    warning = info = error
