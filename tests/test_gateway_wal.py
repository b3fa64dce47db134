"""A 2xx from the gateway is durable: every recorded turn and every ended session is in the gateway's WAL
(nodes/gateway/wal.py) before the reply, and stays there until the trainer acknowledges the trajectory.
A gateway killed with SIGKILL and restarted resumes its open sessions (their keys keep working) and
resends the ended trajectories nobody acknowledged.

Before the WAL (issue 17, item 7): with the reward node down, a kill -9 of the gateway lost every
acknowledged session it still held, and every open session's recorded turns.

Run: .venv/bin/python -m pytest tests/test_gateway_wal.py -q   (the system test is marked slow, ~1-2 min)
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from areal_bus.wire import messages as m
from areal_bus.runtime.ledger import read
from nodes.gateway.sessions import Choice, SessionStore
from nodes.gateway.standalone import Child
from nodes.gateway.wal import GatewayWAL, wal_path
from tests.test_system import REPO, System, wait_until

N_ENDED = 5
M_OPEN = 5
HTTP_TIMEOUT_S = 60


def call(url: str, path: str, key: str, body: dict | None = None, method: str = "POST") -> tuple[int, dict]:
    req = urllib.request.Request(url + path, method=method, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def turn(url: str, key: str, messages: list[dict]) -> dict:
    status, resp = call(url, "/v1/chat/completions", key, {"model": "policy", "messages": messages, "max_tokens": 4})
    assert status == 200, resp
    return resp


def open_session(url: str, admin: str) -> tuple[str, str]:
    status, resp = call(url, "/rl/sessions", admin, {})
    assert status == 201, resp
    return resp["session_id"], resp["api_key"]


def _completion(n: int, version: int = 0) -> m.Completion:
    return m.Completion("r", "e", 0, "w", np.arange(n, dtype=np.int32), np.full(n, -0.5, np.float32),
                        np.full(n, version, np.int32), "stop")


# -- the WAL itself -------------------------------------------------------------------------------------

def test_a_store_replayed_from_its_wal_holds_the_same_sessions_keys_and_trajectories(tmp_path):
    wal = GatewayWAL(tmp_path / "gw.wal.sqlite")
    store = SessionStore(wal=wal)
    s, key = store.create(meta={"task": "t"}, group_id="g")
    h1 = (("user", "hi", ()), ("assistant", "a", ()))
    store.record(s, None, [1, 2, 3], None, "", [Choice(_completion(2), {}, True, h1)])
    h2 = (*h1, ("user", "more", ()), ("assistant", "b", ()))
    base = store.match(s, list(h2[:3]), "")
    assert base is not None
    store.record(s, base, None, [7, 8], "", [Choice(_completion(3), {}, True, h2), Choice(_completion(1), {}, False, h2)])
    store.reward(s, 1.5, 0, discount=0.5)
    wal.close()

    again = SessionStore(wal=GatewayWAL(tmp_path / "gw.wal.sqlite"))
    assert again.restore() == (1, [])
    resumed, why = again.authenticate(key)
    assert why == "" and resumed.id == s.id and resumed.completions == 3 and resumed.meta == {"task": "t"}
    assert again.match(resumed, list(h2[:3]), "") is not None, "the history index was not rebuilt"
    got = again.end(resumed, "ended")
    store.wal = None  # the first store (its WAL closed) ends in memory, for comparison
    mine = store.end(s, "ended")
    assert [t.traj_id for t in got] == [t.traj_id for t in mine] == [f"{s.id}-b0", f"{s.id}-b1"]
    for a, b in zip(got, mine):
        assert np.array_equal(a.output_ids, b.output_ids) and np.array_equal(a.loss_mask, b.loss_mask)
        assert a.reward == b.reward and a.meta == b.meta
    assert [t.traj_id for t in again.wal.pending()[0]] == [t.traj_id for t in got]
    again.wal.forget([t.traj_id for t in got])
    assert again.wal.counts() == {"sessions": 0, "journal": 0, "ended": 0, "responses": 0}


def test_a_sessions_responses_are_kept_as_answered_and_go_with_the_session(tmp_path):
    wal = GatewayWAL(tmp_path / "gw.wal.sqlite")
    said = [{"role": "user", "content": [{"type": "input_text", "text": "é 🎲"}], "n": 2**70},
            {"role": "assistant", "content": "7", "tool_calls": None}]
    wal.response("s1", "r1", None, said)
    wal.response("s1", "r2", "r1", said[1:])
    wal.response("s2", "r3", None, said[:1])
    again = GatewayWAL(tmp_path / "gw.wal.sqlite")
    assert again.responses() == [("s1", "r1", None, said), ("s1", "r2", "r1", said[1:]), ("s2", "r3", None, said[:1])]
    again.ended("s1", [])
    assert [r[1] for r in again.responses()] == ["r3"]


def test_a_wal_commit_costs_a_small_part_of_a_turn(tmp_path):
    wal = GatewayWAL(tmp_path / "gw.wal.sqlite")
    store = SessionStore(wal=wal)
    s, _ = store.create()
    hist, base, n = (), None, 200
    t0 = time.perf_counter()
    for i in range(n):
        hist = (*hist, ("user", f"u{i}", ()), ("assistant", f"a{i}", ()))
        base_ids = [5] * 64 if base is None else None
        store.record(s, base, base_ids, None if base is None else [9] * 16, "",
                     [Choice(_completion(32), {}, True, hist)])
        base = store.match(s, [*hist, ("user", "next", ())], "")
    per_turn_ms = (time.perf_counter() - t0) / n * 1000
    t0 = time.perf_counter()
    store.end(s)
    end_ms = (time.perf_counter() - t0) * 1000
    print(f"\nWAL: {per_turn_ms:.3f} ms per recorded turn (record + commit), {end_ms:.2f} ms for /end of a "
          f"{n}-turn session")
    assert per_turn_ms < 5.0, f"a recorded turn costs {per_turn_ms:.2f} ms with the WAL"


# -- a standalone gateway killed with SIGKILL ----------------------------------------------------------

@pytest.mark.timeout(300)
def test_a_killed_standalone_gateway_resumes_its_open_sessions_and_their_keys_keep_working(tmp_path):
    admin = "wal-" + secrets.token_hex(12)
    traj_file, wal = tmp_path / "trajectories.jsonl", tmp_path / "gw.wal.sqlite"
    args = ["--wal", str(wal), "--trajectories", str(traj_file), "--max-len", "256"]
    gw = Child(args, admin, output=tmp_path / "out1.log")
    sessions = []
    try:
        for i in range(M_OPEN):
            sid, key = open_session(gw.url, admin)
            msgs = [{"role": "user", "content": f"guess {i}"}]
            resp = turn(gw.url, key, msgs)
            sessions.append((sid, key, [*msgs, resp["choices"][0]["message"]], resp["usage"]["completion_tokens"]))
        os.kill(gw.proc.pid, signal.SIGKILL)
        gw.proc.wait(30)
    finally:
        gw.stop()
    gw = Child(args, admin, output=tmp_path / "out2.log")
    try:
        for sid, key, msgs, tokens in sessions:
            status, info = call(gw.url, f"/rl/sessions/{sid}", key, method="GET")
            assert status == 200, f"session {sid}'s key after the restart: {status} {info}"
            assert info["completions"] == 1
            resp = turn(gw.url, key, [*msgs, {"role": "user", "content": "again"}])
            status, ended = call(gw.url, f"/rl/sessions/{sid}/end", key, {"reward": 1.0})
            assert status == 200 and ended["trajectories"] == [sid] and ended["completions"] == 2, ended
        lines = {r["traj_id"]: r for r in map(json.loads, traj_file.read_text().splitlines())}
        assert set(lines) == {sid for sid, *_ in sessions}
        assert all(lines[sid]["reward"] == 1.0 for sid, *_ in sessions)
        assert all(lines[sid]["sampled_tokens"] >= tokens for sid, _, _, tokens in sessions)
    finally:
        assert gw.stop() == 0


@pytest.mark.timeout(300)
def test_a_responses_conversation_continues_by_previous_response_id_across_a_kill_of_the_gateway(tmp_path):
    """Before: the conversations were held in memory only, so the follow-up was a 404 asking for the whole
    input although the WAL had resumed the session."""
    import openai

    admin = "wal-" + secrets.token_hex(12)
    wal = tmp_path / "gw.wal.sqlite"
    args = ["--wal", str(wal), "--trajectories", str(tmp_path / "trajectories.jsonl"), "--max-len", "256"]
    kw = {"model": "policy", "instructions": "Play the game.", "temperature": 0, "max_output_tokens": 4}
    gw = Child(args, admin, output=tmp_path / "out1.log")
    try:
        sid, key = open_session(gw.url, admin)
        first = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0).responses.create(
            input="guess a number from 1 to 16", **kw)
        os.kill(gw.proc.pid, signal.SIGKILL)
        gw.proc.wait(30)
    finally:
        gw.stop()
    assert GatewayWAL(wal).counts()["responses"] == 1
    gw = Child(args, admin, output=tmp_path / "out2.log")
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        client.responses.create(input="higher", previous_response_id=first.id, **kw)
        status, info = call(gw.url, f"/rl/sessions/{sid}", key, method="GET")
        # the follow-up continued the recorded prefix: one segment, one branch, both turns in it
        assert status == 200 and (info["completions"], info["segments"], info["branches"]) == (2, 1, 1), info
        with pytest.raises(openai.NotFoundError):  # another session's key cannot continue it
            _, other = open_session(gw.url, admin)
            openai.OpenAI(base_url=gw.url + "/v1", api_key=other, max_retries=0).responses.create(
                input="x", previous_response_id=first.id, **kw)
        status, ended = call(gw.url, f"/rl/sessions/{sid}/end", key, {"reward": 1.0})
        assert status == 200 and ended["trajectories"] == [sid], ended
    finally:
        assert gw.stop() == 0
    assert GatewayWAL(wal).counts()["responses"] == 0  # gone with the ended session


# -- the gateway node under supervisord, the reward node down ----------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_killed_gateway_node_loses_no_acknowledged_or_open_session():
    admin = "wal-" + secrets.token_hex(12)
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    system = System({
        "max_steps": 1000,
        "model": {"path": str(REPO / "models" / "tiny-guess")},  # the gateway's tokenizer
        # No agent: its episodes would take the admission budget the test's sessions need, and with the
        # reward node stopped nothing is consumed to free it.
        "nodes": {"bus": {}, "agent": {"replicas": 0}, "reward": {"replicas": 1}, "trainer": {}, "weights": {},
                  "gateway": {"config": {"port": port, "admin_token": admin}}},
    })
    url = f"http://127.0.0.1:{port}"
    try:
        system.start()
        wait_until(system.all_running, 90, "every process RUNNING")
        wait_until(lambda: _healthy(url), 60, "the gateway to listen")
        system.ctl("stop", "reward-0")  # nothing reaches the trainer: the gateway holds every trajectory
        ended, open_ = [], []
        for i in range(N_ENDED + M_OPEN):
            sid, key = open_session(url, admin)
            msgs = [{"role": "user", "content": f"guess {i}"}]
            resp = turn(url, key, msgs)
            if i < N_ENDED:
                status, body = call(url, f"/rl/sessions/{sid}/end", key, {"reward": 1.0})
                assert status == 200, body
                ended.append(sid)
            else:
                open_.append((sid, key, [*msgs, resp["choices"][0]["message"]]))
        old = system.pid("gateway-0")
        os.kill(old, signal.SIGKILL)

        def restarted():
            state, pid = system.status().get("gateway-0", (None, None))
            return state == "RUNNING" and pid not in (None, old) and _healthy(url)
        wait_until(restarted, 60, "supervisord to restart gateway-0")
        for sid, key, msgs in open_:  # resumed: the old keys work, and the sessions end whole
            turn(url, key, [*msgs, {"role": "user", "content": "again"}])
            status, body = call(url, f"/rl/sessions/{sid}/end", key, {"reward": 1.0})
            assert status == 200 and body["completions"] == 2, body
        system.ctl("start", "reward-0")
        want = set(ended) | {sid for sid, *_ in open_}
        ledger = system.logs / "ledger" / "trainer-0.jsonl"

        def accepted():
            if not ledger.exists():
                return set()
            return want & {i for r in read(ledger)[0] if r.get("ev") == "accepted" for i in r["ids"]}
        try:
            wait_until(lambda: accepted() == want, 90, "every acknowledged session accepted by the trainer")
        except AssertionError:
            lost = sorted(want - accepted())
            raise AssertionError(f"{len(lost)} of {len(want)} acknowledged sessions never reached the trainer "
                                 f"(ended before the kill: {len(set(lost) & set(ended))}/{len(ended)}): {lost}") from None
        wal = wal_path(system.logs, "gateway-0")
        wait_until(lambda: GatewayWAL(wal).counts()["ended"] == 0, 30, "the gateway's WAL to forget what the "
                   "trainer acknowledged")
    finally:
        system.cleanup()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False
