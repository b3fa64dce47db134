"""The gateway closes connections that do not finish their request: a head (request line and headers)
not complete within header_timeout_s, a body not complete within body_timeout_s (a 408). Before these
(issue 17, item 10) aiohttp held a half-sent header for ever: 220 such connections stayed open 20 s and
more, each with its buffers.

Also here: a burst of malformed requests leaves the gateway's memory where it was.

Run: .venv/bin/python -m pytest tests/test_gateway_timeouts.py -q      (~30 s)
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from tests.test_gateway_openai import ADMIN, gateway  # noqa: F401 (fixture)

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
SLACK_S = 3.0  # a loaded 2-core box: the close may come a little after the deadline
CONNECTIONS = 50


async def _closed_after(port: int, data: bytes, wait_s: float) -> tuple[bool, bytes]:
    """(the server closed the connection within ``wait_s`` of ``data``, what it sent back)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        got = b""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                break
            if not chunk:
                return True, got
            got += chunk
        return False, got
    finally:
        writer.close()


@pytest.fixture
def serve(gateway):  # noqa: F811
    server = gateway(header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S)

    def run(coro_fn):
        return asyncio.run(asyncio.wait_for(coro_fn(server.port, server), 120))
    return run


def test_half_a_header_is_closed_within_the_header_timeout(serve):
    async def check(port, app):
        half = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        t0 = time.monotonic()
        results = await asyncio.gather(*(_closed_after(port, half, HEADER_TIMEOUT_S + SLACK_S)
                                         for _ in range(CONNECTIONS)))
        return time.monotonic() - t0, results
    elapsed, results = serve(check)
    assert all(closed for closed, _ in results), f"{sum(not c for c, _ in results)} of {CONNECTIONS} still open"
    assert elapsed < HEADER_TIMEOUT_S + SLACK_S


def test_a_silent_connection_is_closed_within_the_header_timeout(serve):
    async def check(port, app):
        return await _closed_after(port, b"", HEADER_TIMEOUT_S + SLACK_S)
    closed, _ = serve(check)
    assert closed


def test_a_body_short_of_its_length_is_a_408_and_the_connection_closes(serve):
    async def check(port, app):
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
                f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"model\":").encode()
        return await _closed_after(port, head, BODY_TIMEOUT_S + SLACK_S)
    closed, got = serve(check)
    assert closed and got.startswith(b"HTTP/1.1 408"), got[:200]


def test_a_slow_but_complete_request_is_served(serve):
    async def check(port, app):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for piece in (b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(HEADER_TIMEOUT_S / 4)
            return await asyncio.wait_for(reader.read(4096), 10)
        finally:
            writer.close()
    got = serve(check)
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
