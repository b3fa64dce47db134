"""The gateway's memory comes back after a burst of malformed requests (issue 17 item 10: it grew 57 MB
after 256 malformed requests and stayed).

A real standalone gateway process (nodes/gateway/standalone.py: the node's app and limits, the tiny
policy in-process) gets 384 bad requests, 32 at a time over loopback, of six kinds: a body that is not
JSON (almost max_body_bytes), a body over max_body_bytes (413), JSON nested past the depth limit,
bytes that are not HTTP, a head left half-sent (closed by the header timeout) and a body short of its
Content-Length (408 at the body timeout). Its RSS (/proc) is read before (after a warm-up of every
kind, so imports and caches are in the baseline), right after, and once the timeouts have closed
every held connection; it must settle within SETTLE_BOUND_BYTES of the baseline, and good requests
are still served.

Run: .venv/bin/python -m pytest -q tests/test_gateway_memory.py      (~30 s)
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import pytest

from nodes.gateway.standalone import Child

ADMIN = "memory-test-admin-token"
MAX_BODY = 512 * 1024
TIMEOUT_S = 1.0
BURST = 384
SETTLE_S = 20.0
SETTLE_BOUND_BYTES = 24 << 20
"""How far above the baseline the settled RSS may be. The burst moves ~100 MB through the process
(64 near-limit bodies read whole, 64 refused larger ones); what is freed goes back to malloc's arenas,
which glibc returns to the system only in part (it keeps a heap's top and per-thread arenas, and how
much depends on which of the 32 client connections' server threads ran where). A leak of the issue's
size (57 MB for 256 requests: ~85 MB for this burst) is 3.5 times this; malloc's retention measured on
this 2-core machine: +2 MB (2026-12-01), then -1, +2, +8 and +9 MB in four runs of 2026-12-06 (the last in
a whole-suite run, failing the 8 MB bound this had until then)."""


def _request(port: int, data: bytes, wait_s: float = 5.0) -> bytes:
    """Send ``data``, read until the server closes or ``wait_s``; what came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        try:
            sock.sendall(data)
        except OSError:  # the server refused the rest (413) and closed: what it said is still readable
            pass
        got = b""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, OSError):
                break
            if not chunk:
                break
            got += chunk
        return got


def _post(path: str, body: bytes, length: int | None = None, key: str = ADMIN) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\nConnection: close\r\n\r\n").encode() + body


KINDS = {
    "not_json": lambda i: _post("/v1/chat/completions", b"{" + bytes([97 + i % 26]) * (MAX_BODY - 64)),
    "too_large": lambda i: _post("/v1/chat/completions", b"x" * (2 * MAX_BODY)),
    "too_deep": lambda i: _post("/v1/chat/completions", b"[" * 5000 + b"]" * 5000),
    "not_http": lambda i: bytes(range(256)) * 64 + b"\r\n\r\n",
    "half_head": lambda i: b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ",
    "short_body": lambda i: _post("/v1/chat/completions", b'{"model": "policy", "messages": [', length=MAX_BODY - 1),
}
EXPECT = {"not_json": b" 400 ", "too_large": b" 413 ", "too_deep": b" 400 ", "not_http": b" 400 ",
          "half_head": b"", "short_body": b" 408 "}


def _burst(port: int, n: int) -> dict[str, int]:
    """``n`` bad requests, the kinds in turn, 32 at a time: {kind: replies with the expected status}."""
    names = list(KINDS)
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        jobs = [(names[i % len(names)], pool.submit(_request, port, KINDS[names[i % len(names)]](i),
                                                    TIMEOUT_S * 5)) for i in range(n)]
        ok = dict.fromkeys(names, 0)
        for kind, job in jobs:
            got = job.result()
            ok[kind] += EXPECT[kind] in got.split(b"\r\n", 1)[0] + b" " if EXPECT[kind] else got == b""
    return ok


def _chat(port: int) -> bytes:
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "Guess"}],
                       "max_tokens": 2}).encode()
    return _request(port, _post("/v1/chat/completions", body), 30.0).split(b"\r\n", 1)[0]


@pytest.mark.timeout(180)
def test_memory_returns_near_the_baseline_after_a_burst_of_malformed_requests(tmp_path):
    child = Child(["--log-dir", str(tmp_path), "--max-len", "64", "--max-batch", "8", "--config", json.dumps({
        "max_body_bytes": MAX_BODY, "header_timeout_s": TIMEOUT_S, "body_timeout_s": TIMEOUT_S})],
        ADMIN, output=tmp_path / "output.log")
    try:
        assert b" 200 " in _chat(child.port) + b" "
        _burst(child.port, 2 * len(KINDS) * 4)  # warm-up: every kind's code paths and buffers once
        time.sleep(TIMEOUT_S * 3)
        baseline = child.rss_bytes()
        ok = _burst(child.port, BURST)
        after = child.rss_bytes()
        assert ok == dict.fromkeys(KINDS, BURST // len(KINDS)), ok  # each refused as it should be
        deadline = time.monotonic() + SETTLE_S
        while (settled := child.rss_bytes()) > baseline + SETTLE_BOUND_BYTES and time.monotonic() < deadline:
            time.sleep(0.5)
        print(f"rss baseline={baseline >> 20} MB after_burst={after >> 20} MB settled={settled >> 20} MB")
        assert settled <= baseline + SETTLE_BOUND_BYTES, (baseline, after, settled)
        assert b" 200 " in _chat(child.port) + b" ", "good requests are served after the burst"
        assert child.alive()
    finally:
        child.stop()
