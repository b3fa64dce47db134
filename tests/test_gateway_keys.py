"""Gateway keys: one session's key can neither read, reward nor end another session; keys and the admin
token never reach a log line. Real servers on loopback: the in-process gateway of test_gateway_openai for
the isolation rules, the standalone gateway process (whose whole output can be read) for the logs.

    .venv/bin/python -m pytest tests/test_gateway_keys.py -q
"""

from __future__ import annotations

import secrets
import socket

import anthropic
import httpx
import openai
import pytest

from nodes.gateway.standalone import Child
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)
from tests.test_gateway_openai import ADMIN, GAME, POLICY, gateway  # noqa: F401

CHAT = {"model": POLICY, "messages": [{"role": "user", "content": GAME}], "max_tokens": 2}


def get(gw, path: str, key: str) -> httpx.Response:
    return httpx.get(gw.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def two_sessions(gw):
    a, b = gw.open_session(), gw.open_session()
    gw.client(key=b["api_key"]).chat.completions.create(**CHAT)  # B has something to read and reward
    return a, b


@pytest.mark.parametrize("prefix", ["", "/gateway"])
def test_a_session_key_cannot_read_reward_or_end_another_session(gateway, prefix):
    gw = gateway()
    a, b = two_sessions(gw)
    base = f"{prefix}/rl/sessions/{b['session_id']}"
    read = get(gw, base, a["api_key"])
    assert read.status_code == 403 and read.json()["error"]["code"] == "forbidden"
    assert b["session_id"] not in read.text.replace(f"session {b['session_id']}", "")  # no data, just the refusal
    assert gw.post(f"{base}/reward", {"reward": 1.0}, key=a["api_key"]).status_code == 403
    assert gw.post(f"{base}/end", key=a["api_key"]).status_code == 403
    state = gw.post(f"{base}/end", key=b["api_key"]).json()  # B's own key: B is still open, unrewarded
    assert state["completions"] == 1
    [t] = gw.emitted
    assert t.traj_id == b["session_id"] and t.reward is None and t.meta["end_reason"] == "ended"


def test_a_session_key_cannot_reward_another_sessions_completion_through_its_own_session(gateway):
    gw = gateway()
    a, b = two_sessions(gw)
    theirs = f"chatcmpl-{b['session_id']}-0"
    r = gw.post(f"/rl/sessions/{a['session_id']}/reward", {"reward": 1.0, "completion_id": theirs}, key=a["api_key"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "completion_id"
    gw.post(f"/rl/sessions/{b['session_id']}/end")
    assert gw.emitted[-1].reward is None


def test_a_key_spliced_from_one_sessions_id_and_anothers_secret_is_refused(gateway):
    gw = gateway()
    a, b = two_sessions(gw)
    spliced = f"{b['session_id']}.{a['api_key'].split('.', 1)[1]}"
    with pytest.raises(openai.AuthenticationError, match="Invalid API key"):
        gw.client(key=spliced).chat.completions.create(**CHAT)
    assert get(gw, f"/rl/sessions/{b['session_id']}", spliced).status_code == 401


def test_a_session_key_records_only_into_its_own_session_on_both_apis(gateway):
    gw = gateway()
    a, b = two_sessions(gw)
    gw.client(key=a["api_key"]).chat.completions.create(**CHAT)
    with anthropic.Anthropic(base_url=gw.url, api_key=a["api_key"], max_retries=0, timeout=30) as claude:
        claude.messages.create(model=POLICY, max_tokens=2, messages=[{"role": "user", "content": GAME}])
    counts = {s["session_id"]: gw.post(f"/rl/sessions/{s['session_id']}/end").json()["completions"] for s in (a, b)}
    assert counts == {a["session_id"]: 2, b["session_id"]: 1}


def test_a_session_key_cannot_open_sessions_or_read_the_metrics(gateway):
    gw = gateway()
    a = gw.open_session()
    assert gw.post("/rl/sessions", key=a["api_key"]).status_code == 403
    assert get(gw, "/rl/metrics", a["api_key"]).status_code == 403
    r = get(gw, "/rl/metrics", ADMIN)
    assert r.status_code == 200 and r.json()["counters"]["http.rejected.forbidden"] == 2


def test_an_ended_sessions_key_opens_nothing(gateway):
    gw = gateway()
    a, b = two_sessions(gw)
    gw.post(f"/rl/sessions/{a['session_id']}/end", key=a["api_key"])
    for path in (f"/rl/sessions/{a['session_id']}", f"/rl/sessions/{b['session_id']}"):
        r = get(gw, path, a["api_key"])
        assert r.status_code == 401 and r.json()["error"]["code"] == "session_ended"
    assert gw.post(f"/rl/sessions/{b['session_id']}/end", key=a["api_key"]).status_code == 401


def test_x_api_key_is_read_wherever_a_key_is_and_the_anthropic_sdk_lists_the_models(gateway):
    gw = gateway()
    s = gw.open_session()
    with anthropic.Anthropic(base_url=gw.url, api_key=s["api_key"], max_retries=0, timeout=30) as claude:
        assert [m.id for m in claude.models.list()] == [POLICY]
        assert claude.models.retrieve(POLICY).id == POLICY
    key = {"x-api-key": s["api_key"]}
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=key, timeout=30).status_code == 200
    assert httpx.post(gw.url + "/v1/responses", json={"model": POLICY, "input": GAME, "max_output_tokens": 2},
                      headers=key, timeout=30).status_code == 200
    state = httpx.get(gw.url + f"/rl/sessions/{s['session_id']}", headers=key, timeout=30)
    assert state.status_code == 200 and state.json()["completions"] == 2
    wrong = httpx.get(gw.url + "/v1/models", headers={"x-api-key": "sk-wrong"}, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"


def _ended_errors(gw, key: str) -> tuple:
    with pytest.raises(openai.AuthenticationError) as chat:
        gw.client(key=key).chat.completions.create(**CHAT)
    with pytest.raises(openai.AuthenticationError) as responses:
        gw.client(key=key).responses.create(model=POLICY, input=GAME)
    with anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=30) as claude:
        with pytest.raises(anthropic.AuthenticationError) as messages:
            claude.messages.create(model=POLICY, max_tokens=2, messages=[{"role": "user", "content": GAME}])
    return chat.value, responses.value, messages.value


def test_an_ended_sessions_key_gets_session_ended_and_an_unknown_key_the_invalid_key_advice(gateway):
    gw = gateway()
    s = gw.open_session()
    gw.post(f"/rl/sessions/{s['session_id']}/end")
    chat, responses, messages = _ended_errors(gw, s["api_key"])
    for err in (chat, responses):
        assert err.code == "session_ended" and "Open a new session" in err.message and "Check:" not in err.message
    assert f"Session {s['session_id']} has ended" in messages.message and "Check:" not in messages.message
    with pytest.raises(openai.AuthenticationError) as unknown:
        gw.client(key="sk-" + secrets.token_urlsafe(16)).responses.create(model=POLICY, input=GAME)
    assert unknown.value.code == "invalid_api_key" and "Check:" in unknown.value.message


def test_after_a_gateway_restart_a_key_of_a_session_the_restart_ended_gets_session_ended(gateway):
    first = gateway()
    s = first.open_session()
    first.client(key=s["api_key"]).chat.completions.create(**CHAT)
    first.close()  # the shutdown ends the open session (no WAL here: nothing is resumed)
    assert first.emitted[-1].meta["end_reason"] == "shutdown"
    second = gateway()
    chat, responses, messages = _ended_errors(second, s["api_key"])
    for err in (chat, responses):
        assert err.code == "session_ended" and "restarted" in err.message and "Check:" not in err.message
    assert "has ended" in messages.message and "restarted" in messages.message
    sid, _, secret = s["api_key"].partition(".")
    for forged in (f"{sid}.{secret[:-1]}A" if secret[-1] != "A" else f"{sid}.{secret[:-1]}B",
                   f"{sid}.{secrets.token_urlsafe(48)}"):  # a wrong tag, or none: an invalid key, not an ended one
        with pytest.raises(openai.AuthenticationError) as err:
            second.client(key=forged).chat.completions.create(**CHAT)
        assert err.value.code == "invalid_api_key"
    fresh = second.open_session()
    assert second.client(key=fresh["api_key"]).chat.completions.create(**CHAT).choices


def test_a_key_with_bytes_that_are_not_utf8_is_a_401_not_an_error(gateway):
    gw = gateway()
    for header in (b"Authorization: Bearer \xff\xfe", b"x-api-key: " + ADMIN.encode() + b"\xe9"):
        for path in (b"/v1/chat/completions", b"/v1/messages"):
            with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as s:
                s.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + header
                          + b"\r\nContent-Length: 2\r\n\r\n{}")
                reply = b"".join(iter(lambda: s.recv(65536), b""))
            assert reply.startswith(b"HTTP/1.1 401"), reply[:300]


# -- logs ---------------------------------------------------------------------------------------------

def test_keys_and_the_admin_token_never_reach_the_gateway_log_output(tmp_path):
    """Keys used every way a client uses them (and misuses them: in paths, in query strings, with stray
    bytes, too long, for the wrong session), then a shutdown; the log file, stdout and stderr of the
    gateway process hold none of them."""
    admin = "adm-" + secrets.token_urlsafe(24)
    child = Child(["--log-dir", str(tmp_path), "--max-len", "256"], admin, output=tmp_path / "output.log")
    try:
        url, auth = child.url, {"Authorization": f"Bearer {admin}"}
        opened = [httpx.post(f"{url}/rl/sessions", headers=auth, timeout=30).json() for _ in range(3)]
        keys = [s["api_key"] for s in opened]
        a, b, c = opened
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key=a["api_key"], max_retries=0, timeout=30)
        oa.chat.completions.create(**CHAT)
        oa.chat.completions.create(**CHAT, stream=True).close()
        with anthropic.Anthropic(base_url=url, api_key=b["api_key"], max_retries=0, timeout=30) as claude:
            claude.messages.create(model=POLICY, max_tokens=2, messages=[{"role": "user", "content": GAME}])
            claude.messages.count_tokens(model=POLICY, messages=[{"role": "user", "content": GAME}])
        openai.OpenAI(base_url=f"{url}/v1", api_key=admin, max_retries=0, timeout=30).chat.completions.create(**CHAT)
        misuses = [
            ("GET", f"/rl/sessions/{b['session_id']}", {"Authorization": f"Bearer {a['api_key']}"}),
            ("POST", f"/rl/sessions/{b['session_id']}/end", {"x-api-key": a["api_key"]}),
            ("GET", f"/v1/{a['api_key']}", auth), ("GET", f"/rl/sessions/{a['api_key']}", auth),
            ("GET", f"/v1/models?key={a['api_key']}&admin={admin}", {}), ("GET", f"/{admin}", {}),
            ("POST", "/v1/chat/completions", {"Authorization": f"Token {admin}"}),
            ("POST", "/v1/messages", {"x-api-key": f"{admin}x"}),
            ("POST", "/v1/chat/completions", {"Authorization": f"Bearer {a['api_key'][:-3]}"}),
        ]
        for method, path, headers in misuses:
            assert httpx.request(method, url + path, headers=headers, json={"model": a["api_key"]}, timeout=30
                                 ).status_code in (401, 403, 404, 405)
        for raw in (f"Authorization: Bearer {c['api_key']}\x01", f"x-api-key: {admin}\x7f",
                    f"x-api-key: {c['api_key']}" + "z" * 9000):  # headers aiohttp itself refuses
            with socket.create_connection(("127.0.0.1", child.port), timeout=30) as s:
                s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n" + raw.encode() + b"\r\n\r\n")
                assert b" 400 " in s.recv(65536).partition(b"\r\n")[0]
        httpx.post(f"{url}/rl/sessions/{a['session_id']}/end", headers={"Authorization": f"Bearer {a['api_key']}"},
                   timeout=30)
        with pytest.raises(openai.AuthenticationError):
            oa.chat.completions.create(**CHAT)
    finally:
        assert child.stop() == 0  # shutdown ends b and c: their lines are written too
    out = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert b"session_ended" in out and b"request_refused" in out and b"bad_http" in out  # the lines were written
    for secret in [admin, *keys, *(k.split(".", 1)[1] for k in keys)]:
        assert secret.encode() not in out, f"a key reached the gateway's output: {secret[:12]}..."
