"""HTTP fuzzing of the gateway: random and mutated requests into a real gateway process (hypothesis).

Bodies start from valid OpenAI, Anthropic and session requests and are mutated (wrong types, missing
fields, huge and negative numbers, unicode junk, deep nesting, invalid UTF-8, truncation, oversized),
then sent with random methods, paths, content types and Authorization headers, some with broken HTTP
framing, over a raw socket (nothing a client library would refuse to send is out of reach). The
gateway is the standalone process (nodes/gateway/standalone.py: the same app as the node, the shipped
tiny policy in-process). Every answer must be below 500; every refusal of a well-formed HTTP request
a 4xx in OpenAI's error shape (Anthropic's under /v1/messages), with Retry-After on a 429; every refusal
counted in the gateway's metrics; and the gateway still serves afterwards, its memory and descriptors
level. A request that is not HTTP at all gets aiohttp's own plain-text 400 (no route is known yet).

    .venv/bin/python -m pytest tests/test_fuzz_http.py -q        (~1 min on 2 shared cores)
    .venv/bin/python scripts/fuzz_http.py --minutes 10            (the long run, same generators)
"""

from __future__ import annotations

import copy
import json
import secrets
import socket
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodes.gateway.standalone import Child

ADMIN = "fuzz-admin-" + secrets.token_hex(8)
MAX_BODY = 65536  # the gateway's max_body_bytes here: oversized bodies stay cheap to send
MAX_LEN = 128  # engine context: most fuzzed prompts are too long, some are served
IDLE_S = 3.0  # fuzzed sessions expire quickly, so the open-session limit is exercised but not stuck
SOCKET_TIMEOUT_S = 30.0  # one request to a live gateway; longer means it hangs: a failure
GATEWAY_ARGS = ["--max-len", str(MAX_LEN), "--max-batch", "32", "--config", json.dumps({
    "max_body_bytes": MAX_BODY, "session_idle_timeout_s": IDLE_S, "max_sessions": 64, "max_pending_requests": 32})]


# -- a raw HTTP/1.1 client: sends exactly the bytes it is given -----------------------------------------

@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


def exchange(port: int, data: bytes, half_close: bool = False, timeout_s: float = SOCKET_TIMEOUT_S) -> Reply | None:
    """Send ``data`` on a fresh connection and read the reply until the server closes (every request here
    says Connection: close). ``half_close`` shuts our sending side after the data, so a body shorter than
    its Content-Length ends. None if the server closed without a reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):  # the server answered and closed before all of it
            pass
        chunks = []
        try:
            while chunk := sock.recv(1 << 16):
                chunks.append(chunk)
        except ConnectionResetError:  # closed with our unread bytes in its buffer: the reply came first
            pass
    return parse_reply(b"".join(chunks))


def parse_reply(raw: bytes) -> Reply | None:
    if not raw:
        return None
    head, _, body = raw.partition(b"\r\n\r\n")
    while head.startswith(b"HTTP/1.1 1"):  # an interim reply (100 Continue): the real one follows
        head, _, body = body.partition(b"\r\n\r\n")
    if not head:
        return None
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size.split(b";")[0] or b"0", 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        body = out
    elif "content-length" in headers:
        body = body[:int(headers["content-length"])]
    return Reply(status, headers, body)


# -- what is sent ---------------------------------------------------------------------------------------

@dataclass
class Request:
    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    framing: str = "ok"  # ok | short (Content-Length past the body, then EOF) | chunked | bad-chunked
    broken: bool = False  # not valid HTTP: any 4xx will do, in aiohttp's own shape
    note: list[str] = field(default_factory=list)

    def wire(self) -> bytes:
        head = [self.method + b" " + self.target + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
        head += [k + b": " + v for k, v in self.headers]
        body = self.body
        if self.framing == "ok":
            head.append(b"Content-Length: %d" % len(body))
        elif self.framing == "short":
            head.append(b"Content-Length: %d" % (len(body) + 10))
        elif self.framing in ("chunked", "bad-chunked"):
            head.append(b"Transfer-Encoding: chunked")
            if self.framing == "chunked":
                body = (b"%x\r\n" % len(body) + body + b"\r\n" if body else b"") + b"0\r\n\r\n"
            else:
                body = b"zz\r\n" + body + b"\r\n0\r\n\r\n"
        return b"\r\n".join(head) + b"\r\n\r\n" + body

    @property
    def path(self) -> str:
        return urllib.parse.unquote(self.target.decode("latin-1").partition("?")[0])

    def anthropic(self) -> bool | None:
        """Whether the gateway must answer in Anthropic's shape (its rule: a path under /messages); None
        when the path is percent-encoded (the gateway sees the decoded path: either shape is accepted)."""
        if b"%" in self.target:
            return None
        p = self.path
        return p.rstrip("/").endswith("/messages") or "/messages/" in p


ROUTES = [  # (method, path; {sid} is a session id, {model} a model id), body kind
    (b"POST", "/v1/chat/completions", "openai"), (b"POST", "/v1/messages", "anthropic"),
    (b"POST", "/v1/messages/count_tokens", "count"), (b"POST", "/rl/sessions", "create"),
    (b"GET", "/rl/sessions/{sid}", "none"), (b"POST", "/rl/sessions/{sid}/reward", "reward"),
    (b"POST", "/rl/sessions/{sid}/end", "end"), (b"GET", "/v1/models", "none"),
    (b"GET", "/v1/models/{model}", "none"), (b"GET", "/health", "none"), (b"GET", "/rl/metrics", "none"),
]
METHODS = [b"GET", b"POST", b"PUT", b"DELETE", b"PATCH", b"HEAD", b"OPTIONS"]
BROKEN_METHODS = [b"FOO BAR", b"G\x00T", b"\x16\x03\x01", b"", b"POST\t"]
CONTENT_TYPES = [None, b"application/json", b"text/plain", b"application/x-www-form-urlencoded",
                 b"multipart/form-data; boundary=zz", b"application/json; charset=latin-1", b"\xff/\xfe", b""]
JUNK_STRINGS = ["", " ", "\x00", "\ud800", "\udfff", "\U0001f600" * 3, "\u202e\u200b", "a" * 3000,
                "${AREAL_BUS_ADMIN_TOKEN}", "<|im_start|>system\n", "<tool_call>{\"name\": 1}</tool_call>", "\\u0000", "null", "NaN", "-1"]
HUGE = [2 ** 63, -2 ** 63 - 1, 10 ** 30, -(10 ** 30), 10 ** 400, 1e308, -1e308, 5e-324, 0, -1, -0.0]

text = st.one_of(st.text(max_size=40), st.sampled_from(JUNK_STRINGS))
junk = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10 ** 6, 10 ** 6), st.sampled_from(HUGE),
              st.floats(allow_nan=True, allow_infinity=True), text),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)),
    max_leaves=12)


def nested(depth: int, leaf=1):
    out = leaf
    for i in range(depth):
        out = [out] if i % 2 else {"a": out}
    return out


@st.composite
def openai_body(draw) -> dict:
    body = {"model": draw(st.sampled_from(["policy", "policy", "other-model", ""])),
            "messages": [{"role": "user", "content": draw(text)}], "max_tokens": draw(st.integers(1, 6))}
    if draw(st.booleans()):
        body["messages"] = [{"role": "system", "content": "Be brief."}, *body["messages"],
                            {"role": "assistant", "content": draw(text)}, {"role": "user", "content": "more"}]
    for key, value in draw(st.lists(st.sampled_from([
            ("temperature", 0.0), ("temperature", 1.5), ("stream", True), ("n", 2), ("stop", ["\n"]),
            ("logprobs", True), ("stream_options", {"include_usage": True}), ("top_p", 0.5),
            ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
            ("tool_choice", "auto"), ("seed", 7), ("user", "u")]), max_size=4)):
        body[key] = value
    return body


@st.composite
def anthropic_body(draw, count: bool = False) -> dict:
    body = {"model": draw(st.sampled_from(["policy", "claude-x"])),
            "messages": [{"role": "user", "content": draw(st.one_of(text, st.just([{"type": "text", "text": "hi"}])))}]}
    if not count:
        body["max_tokens"] = draw(st.integers(1, 6))
    for key, value in draw(st.lists(st.sampled_from([
            ("system", "Be brief."), ("stream", True), ("stop_sequences", ["\n"]), ("temperature", 0.5),
            ("tools", [{"name": "f", "input_schema": {"type": "object"}}]), ("tool_choice", {"type": "auto"}),
            ("thinking", {"type": "enabled"}), ("metadata", {"user_id": "u"}), ("top_k", 5)]), max_size=3)):
        body[key] = value
    return body


BODIES = {
    "openai": openai_body(), "anthropic": anthropic_body(), "count": anthropic_body(count=True),
    "create": st.one_of(st.just({}), st.fixed_dictionaries({"meta": st.dictionaries(text, junk, max_size=3),
                                                            "group_id": text})),
    "reward": st.fixed_dictionaries({"reward": st.one_of(st.floats(-2, 2), st.sampled_from(HUGE))},
                                    optional={"completion_index": st.integers(-2, 3), "discount": st.floats(0, 1.5)}),
    "end": st.one_of(st.just({}), st.fixed_dictionaries({"reward": st.floats(-1, 1)})),
    "none": st.just(None),
}


def _paths(value, at=()):
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*at, i))


@st.composite
def mutated(draw, value):
    """``value`` with up to three structural mutations: a node replaced by junk, deleted, wrapped in a
    list, given a stray key, made huge or negative, or nested very deep."""
    value = copy.deepcopy(value)  # strategies share their examples' objects (st.just, sampled_from)
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.sampled_from(list(_paths(value))))
        action = draw(st.sampled_from(["junk", "delete", "wrap", "extra", "huge", "deep"]))
        node = value
        for step in at:
            node = node[step]
        if action == "extra":
            if isinstance(node, dict):
                node[draw(text)] = draw(junk)
            continue
        if action == "delete":
            if at:
                parent = value
                for step in at[:-1]:
                    parent = parent[step]
                del parent[at[-1]]
            continue
        new = {"junk": lambda: draw(junk), "huge": lambda: draw(st.sampled_from(HUGE)), "wrap": lambda: [node],
               "deep": lambda: nested(draw(st.sampled_from([10, 63, 64, 65, 200, 900])))}[action]()
        if not at:
            value = new
            continue
        parent = value
        for step in at[:-1]:
            parent = parent[step]
        parent[at[-1]] = new
    return value


def encode(draw, value) -> bytes:
    if value is None:
        return b""
    raw = json.dumps(value, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    how = draw(st.sampled_from(["as is"] * 6 + ["truncate", "insert", "binary", "oversize", "empty", "not json"]))
    if how == "truncate":
        raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    elif how == "insert":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff\xfe", b"\x00", b"\xc3", b"\xed\xa0\x80", b"}", b'"'])) + raw[at:]
    elif how == "binary":
        raw = draw(st.binary(max_size=64))
    elif how == "oversize":
        raw = raw + b" " * (MAX_BODY + 1 - len(raw))
    elif how == "empty":
        raw = b""
    elif how == "not json":
        raw = draw(st.sampled_from([b"NaN", b"[]", b"1e999", b'"text"', b"null", b"{'a': 1}", b"{\"a\":1}{"]))
    return raw


@st.composite
def requests(draw, keys: dict) -> Request:
    """A request for the gateway; ``keys`` names live credentials: admin, session, other (a second
    session) and their ids (sid, other_sid)."""
    method, path, kind = draw(st.sampled_from(ROUTES))
    sid = draw(st.sampled_from([keys["sid"], keys["other_sid"], "sess-00000000000000000000", "x", "%ff%fe",
                                "..", "a" * 300]))
    path = path.replace("{sid}", sid).replace("{model}", draw(st.sampled_from(["policy", "nope", "%00"])))
    # Rare choices are written as one in many list entries (hypothesis favours a range's ends, so
    # ``integers(0, 39) == 0`` would not be rare): most requests are valid HTTP and reach the app.
    req = Request(method, b"", [], b"")
    if draw(st.sampled_from([False] * 9 + [True])):
        req.method = draw(st.sampled_from(METHODS))
    if draw(st.sampled_from([False] * 39 + [True])):
        req.method, req.broken = draw(st.sampled_from(BROKEN_METHODS)), True
    shape = draw(st.sampled_from(["as is"] * 12 + ["prefix"] * 2 + ["suffix", "slash", "query", "random"] * 2
                                 + ["long", "space"]))
    if shape == "prefix":
        path = "/gateway" + path
    elif shape == "suffix":
        path += "/" + urllib.parse.quote(draw(text), safe="", errors="surrogatepass")
    elif shape == "slash":
        path = path.replace("/", "//", 1) if draw(st.booleans()) else path + "/"
    elif shape == "query":
        path += "?" + urllib.parse.quote(draw(text), safe="=&", errors="surrogatepass")
    elif shape == "random":
        path = "/" + urllib.parse.quote(draw(text), safe="/%", errors="surrogatepass")
    elif shape == "long":
        path = "/v1/" + "x" * draw(st.sampled_from([1000, 9000]))
        req.broken |= len(path) > 8000  # past aiohttp's request-line limit
    elif shape == "space":
        path, req.broken = path + " x", True
    req.target = path.encode("utf-8", "surrogatepass")

    body = draw(mutated(draw(BODIES[kind]))) if kind != "none" or draw(st.integers(0, 4)) == 0 else None
    if kind == "none" and body is None and draw(st.booleans()):
        body = draw(junk)
    req.body = encode(draw, body)

    auth = draw(st.sampled_from(["admin"] * 4 + ["session"] * 4 + ["other", "x-api-key"] * 2 + [
        "none", "bare", "partial", "basic", "lower", "both", "bad-bytes", "literal", "space", "oauth", "random"]
        + ["long", "ctl"] * (draw(st.sampled_from([False] * 9 + [True])))))
    token = {"admin": ADMIN, "session": keys["session"], "other": keys["other"]}
    key = token.get(draw(st.sampled_from(list(token))))
    hdr = {"admin": (b"Authorization", b"Bearer " + ADMIN.encode()),
           "session": (b"Authorization", b"Bearer " + keys["session"].encode()),
           "other": (b"Authorization", b"Bearer " + keys["other"].encode()),
           "bare": (b"Authorization", b"Bearer"), "partial": (b"Authorization", b"Bearer " + key.encode()[:-5]),
           "basic": (b"Authorization", b"Basic " + key.encode()),
           "lower": (b"authorization", b"bearer " + key.encode()), "x-api-key": (b"x-api-key", key.encode()),
           "bad-bytes": (b"Authorization", b"Bearer " + key.encode() + b"\xff"),
           "long": (b"x-api-key", key.encode() * (9000 // len(key))), "literal": (b"x-api-key", b"${ADMIN_TOKEN}"),
           "space": (b"Authorization", b"Bearer " + key.encode() + b" "),
           "ctl": (b"Authorization", b"Bearer " + key.encode() + b"\x01"),
           "random": (b"Authorization", draw(st.binary(max_size=40)).replace(b"\r", b"").replace(b"\n", b"")),
           "oauth": (b"x-api-key", b"sk-ant-oat01-" + key.encode())}.get(auth)
    if auth == "both":
        req.headers += [(b"x-api-key", key.encode()), (b"Authorization", b"Bearer " + ADMIN.encode())]
    elif hdr is not None:
        req.headers.append(hdr)
    if auth in ("long", "ctl") or (auth == "random" and any(b < 32 and b != 9 or b == 127 for b in hdr[1])):
        req.broken = True  # a header line aiohttp refuses (too long, control characters)
    ctype = draw(st.sampled_from(CONTENT_TYPES))
    if ctype is not None:
        req.headers.append((b"Content-Type", ctype))
    extra = draw(st.sampled_from([None] * 16 + ["gzip", "expect"] * 2 + ["dup-length"]))
    if extra == "gzip":
        req.headers.append((b"Content-Encoding", b"gzip"))
    elif extra == "expect":
        req.headers.append((b"Expect", b"100-continue"))
    req.framing = draw(st.sampled_from(["ok"] * 24 + ["short", "chunked"] * 2 + ["bad-chunked"]))
    if extra == "dup-length" and req.framing == "ok":
        req.headers.append((b"Content-Length", b"%d" % (len(req.body) + 1)))
        req.broken = True
    if req.framing == "bad-chunked":
        req.broken = True
    req.note = [kind, shape, auth, extra or "-", req.framing]
    return req


# -- what must come back --------------------------------------------------------------------------------

def check_reply(req: Request, reply: Reply | None) -> None:
    """The rules every answer obeys; AssertionError naming what broke."""
    assert reply is not None, f"no reply (connection dropped) to {req.note}: {req.wire()[:300]!r}"
    assert reply.status < 500, f"{reply.status} to {req.note}: {reply.body[:500]!r}\nrequest: {req.wire()[:500]!r}"
    if reply.status == 429:
        assert "retry-after" in reply.headers, f"429 without Retry-After: {reply.body[:300]!r}"
    if reply.status < 400 or req.method == b"HEAD":
        return
    if req.broken and reply.headers.get("content-type", "").startswith("text/plain"):
        return  # not HTTP: aiohttp answered before any route was known
    body = json.loads(reply.body)
    anthropic = req.anthropic()
    if "type" in body and body.get("type") == "error":
        assert anthropic is not False, f"Anthropic error shape off /messages: {req.target!r} {body}"
        assert set(body) == {"type", "error"} and isinstance(body["error"]["type"], str)
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    else:
        assert anthropic is not True, f"OpenAI error shape under /messages: {req.target!r} {body}"
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, body
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)


class Target:
    """The fuzzed gateway and what the test knows of it: live session keys (renewed before they idle
    out), and the count of refusals it saw, to check against the gateway's own counters."""

    def __init__(self, child: Child):
        self.child = child
        self.refused = 0  # 4xx replies received
        self.unanswered = 0  # requests cut short on purpose, which got no reply
        self.keys: dict[str, str] = {}
        self.opened_at = 0.0

    def call(self, method: str, path: str, key: str | None = ADMIN, body=None) -> Reply:
        data = b"" if body is None else json.dumps(body).encode()
        headers = [(b"Authorization", b"Bearer " + key.encode())] if key else []
        reply = exchange(self.child.port, Request(method.encode(), path.encode(), headers, data).wire())
        assert reply is not None and reply.status < 500, reply
        self.refused += reply.status >= 400
        return reply

    def fresh_keys(self) -> dict[str, str]:
        if time.monotonic() - self.opened_at > IDLE_S / 2:
            for name in ("session", "other"):
                reply = self.call("POST", "/rl/sessions")
                if reply.status == 201:
                    s = json.loads(reply.body)
                    self.keys[name] = s["api_key"]
                    self.keys["sid" if name == "session" else "other_sid"] = s["session_id"]
                else:  # the open-session limit, hit by fuzzed opens: keep the last keys (they may have expired)
                    self.keys.setdefault(name, f"sess-{'0' * 20}.nokey")
                    self.keys.setdefault("sid" if name == "session" else "other_sid", f"sess-{'0' * 20}")
            self.opened_at = time.monotonic()
        return self.keys

    def send(self, req: Request) -> Reply | None:
        reply = exchange(self.child.port, req.wire(), half_close=req.framing == "short")
        if reply is None and req.framing == "short":
            # The body ended (we shut our side) before its Content-Length: aiohttp closes the connection, so
            # no answer can reach us. The gateway counts it (incomplete_body) if its handler had started.
            self.unanswered += 1
            return None
        check_reply(req, reply)
        self.refused += reply.status >= 400
        return reply

    def counters(self) -> dict[str, float]:
        reply = self.call("GET", "/rl/metrics")
        return json.loads(reply.body)["counters"]


def start_gateway(tmp: Path) -> Child:
    return Child(["--log-dir", str(tmp), "--trajectories", str(tmp / "trajectories.jsonl"), *GATEWAY_ARGS], ADMIN,
                 output=tmp / "output.log")


def fuzz(target: Target, examples: int, seed: int | None = None) -> None:
    """Send ``examples`` generated requests, checking each reply."""
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              report_multiple_bugs=False)
    @given(data=st.data())
    def one(data):
        req = data.draw(requests(target.fresh_keys()))
        target.send(req)
    if seed is not None:
        one = hypothesis.seed(seed)(one)
    one()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    child = start_gateway(tmp_path_factory.mktemp("fuzz"))
    yield Target(child)
    code = child.stop()
    assert code == 0, f"gateway exited {code}; its output: {child.output}"


def test_fuzzed_requests_get_no_5xx_and_every_refusal_is_a_counted_4xx_in_the_apis_shape(target):
    before = target.counters().get("http.rejected", 0)
    rss0, fds0 = target.child.rss_bytes(), target.child.open_fds()
    target.refused = target.unanswered = 0
    fuzz(target, examples=1500)
    counters = target.counters()
    assert target.child.rss_bytes() - rss0 < 64 << 20 and target.child.open_fds() <= fds0 + 2
    counted = counters.get("http.rejected", 0) - before
    assert target.refused <= counted <= target.refused + target.unanswered, (counted, target.refused, target.unanswered)
    assert not any(k.startswith("http.failed") for k in counters), counters
    reasons = [k.removeprefix("http.rejected.") for k in counters if k.startswith("http.rejected.")]
    assert all(r.replace("_", "").isalnum() and r.islower() for r in reasons), reasons  # codes, never free text
    assert target.child.alive() and target.call("GET", "/health").status == 200
    deadline = time.monotonic() + 10  # every generation handed to the policy came back and was given up
    while json.loads(target.call("GET", "/rl/metrics").body)["gauges"]["http.pending"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert json.loads(target.call("GET", "/rl/metrics").body)["gauges"]["http.pending"] == 0


def test_a_request_that_is_not_http_gets_a_400_and_is_counted(target):
    before = target.counters().get("http.rejected.bad_http", 0)
    for data in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
                 b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n", b"HELLO\r\n\r\n"):
        reply = exchange(target.child.port, data, timeout_s=10)
        assert reply is not None and reply.status == 400, (data, reply)
    assert target.counters()["http.rejected.bad_http"] - before == 4


def test_memory_and_descriptors_level_off_under_the_heaviest_refusals(target):
    """Rounds of the most expensive things a client can send (near-limit bodies, each prompt distinct so
    nothing is shared; oversized and deeply nested bodies; sessions opened and left to expire): the
    gateway's RSS grows in the first rounds (caches, allocator arenas) and then stays level."""

    admin = [(b"Authorization", b"Bearer " + ADMIN.encode())]

    def round_(r: int) -> None:
        for i in range(30):
            text = f"{r}-{i} " + "word " * (MAX_BODY // 5 - 100)  # distinct, just under the body limit
            body = json.dumps({"model": "policy", "max_tokens": 2, "messages": [{"role": "user", "content": text}]})
            for path in (b"/v1/chat/completions", b"/v1/messages"):
                assert target.send(Request(b"POST", path, admin, body.encode())).status == 400  # too long
            assert target.send(Request(b"POST", b"/v1/chat/completions", admin, b" " * (MAX_BODY + 1))).status == 413
            assert target.send(Request(b"POST", b"/v1/chat/completions", admin,
                                       b"[" * 5000 + b"]" * 5000)).status == 400
            target.call("POST", "/rl/sessions", body={"meta": {"i": text[:8000]}})

    samples = []
    for r in range(6):
        round_(r)
        samples.append((target.child.rss_bytes() >> 20, target.child.open_fds()))
    rss, fds = [s[0] for s in samples], [s[1] for s in samples]
    print(f"RSS per round {rss} MiB, open descriptors {fds}")
    assert rss[-1] - rss[2] <= 8, f"RSS grew after warm-up: {rss} MiB"
    assert max(fds) - min(fds) <= 2, f"open descriptors changed: {fds}"
