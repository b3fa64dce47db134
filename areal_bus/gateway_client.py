"""Agent-side helpers for talking to the gateway, and the one-line failure descriptions shared with
the model router and ``areal-bus check-channel``.

An agent joins training by pointing its OpenAI client at the gateway. When that fails, the SDK says
little more than "connection error" (or Claude Code's "local proxy failed"); ``check_gateway`` says
which of the usual causes it is: nothing listening on the port, the port held by some other program,
or a gateway that is not ready yet.

    from areal_bus.gateway_client import check_gateway
    check_gateway("http://127.0.0.1:9000/v1", wait_s=30)     # raises GatewayError with the fix
    client = openai.OpenAI(base_url="http://127.0.0.1:9000/v1", api_key=os.environ["AREAL_BUS_API_KEY"])

Only the standard library is used here, so an agent process needs nothing of ours but this module.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from urllib.parse import urlsplit

GATEWAY_LOG = "logs/supervisor/gateway-0.log"
"""Where supervisord keeps the gateway's output (``<log_dir>/supervisor/<program>-<n>.log``, from the
rendered supervisord.conf) with the default log_dir; the first place to look when it will not start."""

GATEWAY_STATUS_CMD = "supervisorctl -c supervisord.conf status gateway-0"

BODY_SHOWN_CHARS = 600
"""An upstream's error body is shown on one line, cut here: enough for any provider's error object,
short enough that a stray HTML page does not flood the terminal."""

WAIT_POLL_S = 0.5
"""check_gateway(wait_s=...) probes this often while the gateway is starting."""


class GatewayError(ConnectionError):
    """The gateway (or the upstream behind a base_url) cannot be used. ``str(err)`` is one line,
    ``<what failed>: <fix>``; ``kind`` is one of unreachable / wrong_service / not_ready /
    unauthorized / unknown_model / no_choices / upstream / timeout."""

    def __init__(self, kind: str, what: str, hint: str, status: int | None = None, body: str | None = None):
        super().__init__(f"{what}: {hint}")
        self.kind, self.what, self.hint, self.status, self.body = kind, what, hint, status, body


# -- one-line descriptions ------------------------------------------------------------------------

def one_line(body, limit: int = BODY_SHOWN_CHARS) -> str:
    """A response body on one line: JSON re-dumped compactly, anything else with whitespace collapsed."""
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if not isinstance(body, str):
        body = json.dumps(body, separators=(",", ":"), default=str)
    else:
        try:
            body = json.dumps(json.loads(body), separators=(",", ":"))
        except ValueError:
            body = " ".join(body.split())
    if not body:
        return "(empty body)"
    return body if len(body) <= limit else body[:limit] + f"... ({len(body)} chars)"


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "?", parts.port or (443 if parts.scheme == "https" else 80)


def describe_unreachable(url: str, reason: str, timeout: float | None = None, config: str = "") -> tuple[str, str]:
    """(what, fix) for a base_url nobody answers on. ``reason``: refused / dns / timeout / other text;
    ``config``: the router YAML the base_url came from, if any."""
    host, port = host_port(url)
    base_url = f"api_gateway.base_url in {config}" if config else "base_url"
    if reason == "refused":
        return (f"cannot reach {host}:{port} (connection refused: nothing listens on that port)",
                f"start the gateway or fix {base_url}; `{GATEWAY_STATUS_CMD}` says whether it runs and "
                f"{GATEWAY_LOG} why it stopped; if it was just started it may still be loading, retry in a few seconds")
    if reason == "dns":
        return f"cannot resolve host {host!r} of {url}", f"fix the host name in {base_url}"
    if reason == "timeout":
        return (f"{host}:{port} did not accept a connection within {timeout:g} s",
                f"check the host and port in {base_url}, and that no firewall drops the connection")
    return f"cannot reach {host}:{port} ({reason})", f"check {base_url}, and `{GATEWAY_STATUS_CMD}`"


def http_problem(status: int, body, *, url: str = "", model: str = "", key_env: str = "", config: str = "",
                 field: str = "", retries: int | None = None, key_facts: str = "") -> tuple[str, str, str]:
    """(kind, what, fix) for a non-2xx reply. Context arguments make the fix name the exact knob:
    ``model`` (the model id sent), ``key_env`` (the variable the key came from), ``config`` and
    ``field`` (the router YAML and the route's path in it), ``retries`` (attempts already retried),
    ``key_facts`` (what was verified about the key, never the key)."""
    shown = one_line(body)
    after = f" after {retries} retr{'y' if retries == 1 else 'ies'}" if retries else ""
    where = f" from {url}" if url else ""
    in_file = f" in {config}" if config else ""
    if status in (401, 403):
        var = f"${key_env}" if key_env else "the key's environment variable"
        ref = f"${{{key_env}}}" if key_env else "${NAME}"
        if key_facts:  # the caller already ruled out an unset variable, a literal and whitespace
            return ("unauthorized", f"{status} Invalid API key{where} ({key_facts})",
                    f"the upstream does not accept that key: export {key_env or 'NAME'}=<the gateway's key> in "
                    f"this shell (api_gateway.api_key{in_file} reads {ref}, as it should)")
        return ("unauthorized", f"{status} Invalid API key{where}",
                f"is {var} set in this shell to the gateway's key (export {key_env or 'NAME'}=...)? does "
                f"api_gateway.api_key{in_file} read {ref} rather than a literal key? does the key carry stray "
                f"whitespace or a newline?")
    if status == 404:
        if "model" in shown.lower():
            knob = f"set {field}{in_file} to" if field else "use"
            return ("unknown_model", f"404 unknown model id {model!r}{where} (body: {shown})",
                    f"{knob} a model id the upstream serves (GET <base_url>/models lists them)")
        return ("upstream", f"404 Not Found{where} (body: {shown})",
                "that path does not exist there: base_url normally ends in /v1 (http://HOST:PORT/v1)")
    if status == 429:
        return ("upstream", f"429 rate limited{where}{after} (body: {shown})",
                "send fewer requests at once, or raise api_gateway.max_retries to wait longer")
    if status >= 500:
        return ("upstream", f"{status} upstream error{where}{after} (body: {shown})",
                "the upstream failed (its log says why); the router retries 5xx up to api_gateway.max_retries")
    return ("upstream", f"{status} request refused{where} (body: {shown})",
            "the upstream refused the request as sent; the body says why (a bad parameter, a too-long prompt)")


def describe_http_error(status: int, body, **context) -> str:
    """``<what failed>: <fix>`` for a non-2xx reply, on one line (see ``http_problem`` for context)."""
    _, what, fix = http_problem(status, body, **context)
    return f"{what}: {fix}"


def describe_no_choices(body, url: str = "") -> tuple[str, str]:
    where = f" from {url}" if url else ""
    return (f"reply{where} has no 'choices' (body: {one_line(body)})",
            "the upstream answered with an error body instead of a completion; it says what went wrong")


# -- the agent side -------------------------------------------------------------------------------

def _models_url(base_url: str) -> tuple[str, int, str, bool]:
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise GatewayError("wrong_service", f"base_url {base_url!r} is not an http(s) URL",
                           "write it as http://HOST:PORT/v1")
    host, port = host_port(base_url)
    return host, port, parts.path.rstrip("/") + "/models", parts.scheme == "https"


def _probe(base_url: str, timeout: float, api_key: str | None) -> None:
    host, port, path, tls = _models_url(base_url)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except ConnectionRefusedError:
        raise GatewayError("unreachable", *describe_unreachable(base_url, "refused")) from None
    except socket.gaierror:
        raise GatewayError("unreachable", *describe_unreachable(base_url, "dns")) from None
    except (socket.timeout, TimeoutError):
        raise GatewayError("unreachable", *describe_unreachable(base_url, "timeout", timeout)) from None
    conn_cls = http.client.HTTPSConnection if tls else http.client.HTTPConnection
    conn = conn_cls(host, port, timeout=timeout)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    other = (f"{host}:{port} answers, but not like an OpenAI-compatible gateway",
             f"another program holds the port: find it with `ss -ltnp 'sport = :{port}'`, stop it or move the "
             f"gateway to a free port (and base_url with it)")
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        status, text = resp.status, resp.read(64 * 1024).decode("utf-8", "replace")
    except (socket.timeout, TimeoutError):
        raise GatewayError("not_ready", f"{host}:{port} accepted the connection but sent no reply within {timeout:g} s",
                           f"the gateway may still be starting (retry in a few seconds) or be stuck: see {GATEWAY_LOG}") from None
    except (http.client.HTTPException, ConnectionError, OSError) as exc:
        raise GatewayError("wrong_service", f"{other[0]} (it does not speak HTTP: {type(exc).__name__})", other[1]) from None
    finally:
        conn.close()
    if status == 503:
        raise GatewayError("not_ready", f"{host}:{port} says 503 Service Unavailable (body: {one_line(text)})",
                           "the gateway is not ready yet (still loading); retry in a few seconds")
    if status in (401, 403):
        if not api_key:
            return  # it speaks HTTP and wants a key: a gateway; the key is checked when one is given
        kind, what, fix = http_problem(status, text, url=f"{base_url.rstrip('/')}/models")
        raise GatewayError(kind, what, fix, status, text)
    try:
        data = json.loads(text) if status == 200 else None
    except ValueError:
        data = None
    if not (isinstance(data, dict) and isinstance(data.get("data"), list)):
        raise GatewayError("wrong_service", f"{other[0]} (GET {path} -> {status}, body: {one_line(text, 200)})",
                           other[1], status, text)


def check_gateway(base_url: str, timeout: float = 2.0, api_key: str | None = None, wait_s: float = 0.0) -> None:
    """Raise ``GatewayError`` (one line: what failed and the fix) unless ``base_url`` is an
    OpenAI-compatible gateway ready to serve. ``wait_s`` > 0 keeps probing while the gateway is
    starting (nothing listening yet, or 503) and raises the last failure when that time is up."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _probe(base_url, timeout, api_key)
        except GatewayError as err:
            if err.kind not in ("unreachable", "not_ready") or time.monotonic() + WAIT_POLL_S > deadline:
                raise
        time.sleep(WAIT_POLL_S)
