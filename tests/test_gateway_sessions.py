"""Gateway sessions: the pure SessionStore (keys, branches, rewards, expiry, limits), then sessions over
HTTP with the openai SDK: a multi-turn session becomes one trajectory of exactly what the engine saw
and produced; rewards; idle expiry; disconnects; admission; 200 concurrent sessions, none lost.

    .venv/bin/python -m pytest tests/test_gateway_sessions.py -q
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import numpy as np
import openai
import pytest

from areal_bus.wire.messages import Completion
from nodes.gateway.sessions import Choice, SessionLimitError, SessionStore
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)
from tests.test_gateway_openai import (ADMIN, GAME, POLICY, ScriptedBackend,  # noqa: F401
                                       gateway)

EOS = 2


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def comp(ids, version=0) -> Completion:
    ids = np.asarray(ids, np.int32)
    return Completion("r", "e", 0, "w", ids, -np.arange(1, ids.size + 1, dtype=np.float32) / 10,
                      np.full(ids.size, version, np.int32), "stop")


def turn(store, session, history, reply_ids, base=None, env=(), prompt=(10, 11, 12), text="x", n=1):
    """Record one turn of ``n`` identical choices; history is a list of (role, text) pairs."""
    hist = tuple((r, t, ()) for r, t in history)
    choices = [Choice(comp(reply_ids), {"role": "assistant", "content": text}, reply_ids[-1] == EOS,
                      (*hist, ("assistant", text, ()))) for _ in range(n)]
    return store.record(session, base, np.asarray(prompt, np.int32), np.asarray(env, np.int32), "", choices)


# -- the store, no sockets ------------------------------------------------------------------------------

def test_a_key_opens_only_its_own_session_and_only_its_hash_is_kept():
    store = SessionStore()
    a, key_a = store.create()
    b, _ = store.create()
    assert store.authenticate(key_a) == (a, "")
    assert store.authenticate(key_a + "x") == (None, "invalid")
    assert store.authenticate(f"{b.id}.{key_a.split('.')[1]}") == (None, "invalid")
    assert key_a.split(".")[1] not in repr(vars(a))


def test_an_ended_sessions_key_says_it_ended():
    store = SessionStore()
    s, key = store.create()
    store.end(s, "idle")
    assert store.authenticate(key) == (None, "idle")


def test_turns_that_continue_the_history_extend_one_branch_into_one_trajectory():
    store = SessionStore()
    s, _ = store.create()
    turn(store, s, [("user", "q")], [5, EOS], text="a")
    turn(store, s, [("user", "q"), ("assistant", "a"), ("user", "more")], [6, 7, EOS],
         base=store.match(s, [("user", "q", ()), ("assistant", "a", ()), ("user", "more", ())], ""), env=[20, 21])
    [t] = store.end(s)
    assert t.traj_id == s.id and t.reward is None and t.meta["turns"] == 2
    assert t.prompt_ids.tolist() == [10, 11, 12]
    assert t.output_ids.tolist() == [5, EOS, 20, 21, 6, 7, EOS]
    assert t.loss_mask.tolist() == [1, 1, 0, 0, 1, 1, 1]
    assert t.versions.tolist() == [0, 0, -1, -1, 0, 0, 0]


def test_history_that_does_not_match_starts_a_new_segment():
    store = SessionStore()
    s, _ = store.create()
    turn(store, s, [("user", "q")], [5, EOS], text="a")
    rewritten = [("user", "q", ()), ("assistant", "EDITED", ()), ("user", "more", ())]
    assert store.match(s, rewritten, "") is None
    turn(store, s, [("user", "q"), ("assistant", "EDITED"), ("user", "more")], [6, EOS], prompt=(30, 31))
    trajs = store.end(s)
    assert [t.traj_id for t in trajs] == [f"{s.id}-b0", f"{s.id}-b1"]
    assert all(t.episode_id == s.id and t.meta["history_rewritten"] for t in trajs)
    assert trajs[1].prompt_ids.tolist() == [30, 31] and trajs[1].meta["segment"] == 2


def test_n_choices_fork_and_the_one_continued_is_extended():
    store = SessionStore()
    s, _ = store.create()
    turn(store, s, [("user", "q")], [5, EOS], text="a", n=2)
    assert len(s.branches) == 2
    base = store.match(s, [("user", "q", ()), ("assistant", "a", ()), ("user", "go", ())], "")
    turn(store, s, [("user", "q"), ("assistant", "a"), ("user", "go")], [8, EOS], base=base, env=[20])
    trajs = store.end(s)
    assert sorted(t.meta["turns"] for t in trajs) == [1, 2]  # the other choice ends as its own sample


def test_a_turn_sent_again_after_it_was_recorded_forks_from_where_it_started():
    store = SessionStore()
    s, _ = store.create()
    turn(store, s, [("user", "q")], [5, EOS], text="a")
    again = [("user", "q", ()), ("assistant", "a", ()), ("user", "b", ())]
    turn(store, s, [("user", "q"), ("assistant", "a"), ("user", "b")], [6, EOS], base=store.match(s, again, ""),
         env=[20])
    retry = store.match(s, again, "")  # e.g. the SDK retried after a timeout: same messages again
    assert retry is not None and retry.completion_indices == [0]
    turn(store, s, [("user", "q"), ("assistant", "a"), ("user", "b")], [7, EOS], base=retry, env=[20])
    trajs = store.end(s)
    assert [t.output_ids.tolist() for t in trajs] == [[5, EOS, 20, 6, EOS], [5, EOS, 20, 7, EOS]]
    assert not any(t.meta["history_rewritten"] for t in trajs)


def test_whole_session_reward_with_discount_gives_discounted_returns():
    store = SessionStore()
    s, _ = store.create()
    turn(store, s, [("user", "q")], [5, EOS], text="a")
    base = store.match(s, [("user", "q", ()), ("assistant", "a", ()), ("user", "b", ())], "")
    turn(store, s, [("user", "q"), ("assistant", "a"), ("user", "b")], [6, EOS], base=base, env=[20])
    store.reward(s, 1.0, discount=0.5)
    [t] = store.end(s)
    assert t.meta["turn_returns"] == [0.5, 1.0] and t.reward == 0.5


def test_reward_for_one_completion_lands_on_that_turn():
    store = SessionStore()
    s, _ = store.create()
    turn(store, s, [("user", "q")], [5, EOS], text="a")
    base = store.match(s, [("user", "q", ()), ("assistant", "a", ()), ("user", "b", ())], "")
    turn(store, s, [("user", "q"), ("assistant", "a"), ("user", "b")], [6, EOS], base=base, env=[20])
    store.reward(s, 0.25, completion_index=0)
    with pytest.raises(KeyError):
        store.reward(s, 1.0, completion_index=2)
    [t] = store.end(s)
    assert t.meta["turn_returns"] == [0.25, 0.0] and t.reward == 0.25


def test_only_sessions_idle_past_the_timeout_and_not_busy_expire():
    clock = Clock()
    store = SessionStore(idle_timeout_s=10, clock=clock)
    idle, _ = store.create()
    busy, _ = store.create()
    fresh, _ = store.create()
    for s in (idle, busy):
        turn(store, s, [("user", "q")], [5, EOS])
    store.begin(busy)
    clock.t += 11
    store.touch(fresh)
    assert [t.traj_id for t in store.expire_idle()] == [idle.id]
    assert set(store.sessions) == {busy.id, fresh.id}


def test_open_sessions_are_limited():
    store = SessionStore(max_sessions=2)
    store.create()
    s, _ = store.create()
    with pytest.raises(SessionLimitError, match="max_sessions=2"):
        store.create()
    store.end(s)
    store.create()


def test_a_session_that_never_generated_ends_with_no_trajectory():
    store = SessionStore()
    s, _ = store.create()
    assert store.end(s) == []


# -- over HTTP --------------------------------------------------------------------------------------

def play(client, turns: int, replies=("higher (9-16)", "lower (9-11)")):
    msgs = [{"role": "user", "content": GAME}]
    out = []
    for k in range(turns):
        r = client.chat.completions.create(model=POLICY, messages=msgs, temperature=0, max_tokens=4)
        out.append(r)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": replies[k % len(replies)]}]
    return out


def test_a_three_turn_session_is_one_trajectory_of_exactly_what_the_engine_saw_and_produced(gateway):
    gw = gateway()
    s = gw.open_session(meta={"task": "guess"})
    play(gw.client(key=s["api_key"]), 3)
    assert gw.post(f"/rl/sessions/{s['session_id']}/end").status_code == 200
    [t] = gw.emitted
    seen = gw.backend.history[-3:]  # (prompt ids, completion) of each turn, as the engine had them
    assert t.traj_id == s["session_id"] and t.meta["task"] == "guess" and t.meta["turns"] == 3
    assert np.array_equal(t.prompt_ids, seen[0][0])
    full = np.concatenate([t.prompt_ids, t.output_ids])
    sampled = np.zeros(full.size, bool)
    for prompt, c in seen:
        start = prompt.size
        assert np.array_equal(full[:start], prompt)  # each turn's prompt is the record so far, exactly
        assert np.array_equal(full[start:start + c.output_ids.size], c.output_ids)
        sampled[start:start + c.output_ids.size] = True
        at = start - t.prompt_ids.size
        assert np.array_equal(t.logprobs[at:at + c.output_ids.size], c.logprobs)
        assert np.array_equal(t.versions[at:at + c.output_ids.size], c.versions)
    assert np.array_equal(t.loss_mask.astype(bool), sampled[t.prompt_ids.size:])
    assert t.reward is None  # no reward given: the reward node scores it


def test_reward_endpoint_for_the_session_one_completion_and_with_discount(gateway):
    gw = gateway()
    results = {}
    for name, body in [("session", {"reward": 1.0}), ("completion", {"reward": 0.5, "completion_index": 1}),
                       ("discount", {"reward": 1.0, "discount": 0.5})]:
        s = gw.open_session()
        rs = play(gw.client(key=s["api_key"]), 2)
        if name == "completion":
            body = {"reward": 0.5, "completion_id": rs[1].id}
        r = gw.post(f"/rl/sessions/{s['session_id']}/reward", body, key=s["api_key"])
        assert r.status_code == 200, r.text
        gw.post(f"/rl/sessions/{s['session_id']}/end")
        results[name] = gw.emitted[-1]
    assert results["session"].reward == 1.0
    assert results["completion"].reward == 0.5 and results["completion"].meta["turn_returns"] == [0.5, 0.5]
    assert results["discount"].reward == 0.5 and results["discount"].meta["turn_returns"] == [0.5, 1.0]


def test_bad_reward_requests_are_4xx(gateway):
    gw = gateway()
    s = gw.open_session()
    play(gw.client(key=s["api_key"]), 1)
    path = f"/rl/sessions/{s['session_id']}/reward"
    assert gw.post(path, {"reward": "high"}).json()["error"]["param"] == "reward"
    assert gw.post(path, {"reward": 1, "completion_index": 5}).status_code == 404
    assert gw.post(path, {"reward": 1, "discount": 1.5}).status_code == 400
    other = gw.open_session()
    assert gw.post(path, {"reward": 1}, key=other["api_key"]).status_code == 403


def test_an_idle_session_is_ended_and_its_trajectory_emitted(gateway):
    gw = gateway(session_idle_timeout_s=0.3)
    s = gw.open_session()
    play(gw.client(key=s["api_key"]), 1)
    for _ in range(40):
        if gw.emitted:
            break
        time.sleep(0.05)
    [t] = gw.emitted
    assert t.traj_id == s["session_id"] and t.meta["end_reason"] == "idle"
    with pytest.raises(openai.AuthenticationError, match="has ended"):
        play(gw.client(key=s["api_key"]), 1)


def test_a_trajectory_the_bus_refused_is_emitted_again_at_the_next_sweep(gateway):
    got, calls = [], []

    def flaky_emit(traj):
        calls.append(traj.traj_id)
        if len(calls) == 1:
            raise RuntimeError("queue full")
        got.append(traj)

    gw = gateway(emit=flaky_emit, session_idle_timeout_s=2.0)  # sweeps every 0.5 s
    s = gw.open_session()
    play(gw.client(key=s["api_key"]), 1)
    assert gw.post(f"/rl/sessions/{s['session_id']}/end").status_code == 200
    for _ in range(40):
        if got:
            break
        time.sleep(0.05)
    assert [t.traj_id for t in got] == [s["session_id"]] and len(calls) == 2


def test_a_client_that_disconnects_mid_request_loses_nothing(gateway):
    backend = ScriptedBackend(["42"], delay_s=0.5)
    gw = gateway(backend=backend)
    s = gw.open_session()
    with pytest.raises(openai.APITimeoutError):
        gw.client(key=s["api_key"], timeout=0.1).chat.completions.create(
            model=POLICY, messages=[{"role": "user", "content": GAME}])
    r = gw.post(f"/rl/sessions/{s['session_id']}/end")  # waits for the turn in flight
    assert r.json()["completions"] == 1
    [t] = gw.emitted
    assert np.array_equal(t.output_ids, backend.history[0][1].output_ids)


def test_a_cancelled_request_handler_still_records_its_turn(gateway):
    # aiohttp can cancel a handler when its client leaves (handler_cancellation) and does at shutdown:
    # the turn is recorded all the same.
    from nodes.gateway.openai_api import parse_chat_request

    backend = ScriptedBackend(["42"], delay_s=0.5)
    gw = gateway(backend=backend)
    s = gw.open_session()
    session = gw.call(lambda: gw.gateway.store.get(s["session_id"]))
    req = parse_chat_request({"model": POLICY, "messages": [{"role": "user", "content": GAME}]})
    handler = asyncio.run_coroutine_threadsafe(gw.gateway.chat.complete(req, session, time.monotonic()), gw.loop)
    time.sleep(0.1)
    handler.cancel()
    with pytest.raises(concurrent.futures.CancelledError):
        handler.result(timeout=5)
    r = gw.post(f"/rl/sessions/{s['session_id']}/end")  # waits for the turn in flight
    assert r.json()["completions"] == 1
    [t] = gw.emitted
    assert np.array_equal(t.output_ids, backend.history[0][1].output_ids)


def test_rewritten_history_is_recorded_as_a_new_segment(gateway):
    gw = gateway()
    s = gw.open_session()
    client = gw.client(key=s["api_key"])
    play(client, 1)
    client.chat.completions.create(model=POLICY, temperature=0, max_tokens=4, messages=[
        {"role": "user", "content": GAME}, {"role": "assistant", "content": "16"},
        {"role": "user", "content": "lower (1-15)"}])
    gw.post(f"/rl/sessions/{s['session_id']}/end")
    assert [t.meta["segment"] for t in gw.emitted] == [1, 2]
    assert all(t.meta["history_rewritten"] for t in gw.emitted)


def test_admission_gates_new_sessions_with_429_and_retry_after(gateway):
    gw = gateway(admission=lambda: (None, 2.5))
    r = gw.post("/rl/sessions")
    assert r.status_code == 429 and r.headers["Retry-After"] == "3"
    assert r.json()["error"]["code"] == "staleness_limit"


def test_every_request_of_a_session_carries_the_ticket_admission_gave_it(gateway):
    """The rollout worker's [rollout] step is read off GenerateRequest.ticket: each turn of a session
    must carry the session's admission ticket (the engine copies it into its Completion), its
    trajectory too; an unrecorded admin call carries 0."""
    tickets = iter([97, 3])
    gw = gateway(admission=lambda: (next(tickets), 0.0))
    first, second = gw.open_session(), gw.open_session()
    play(gw.client(key=first["api_key"]), 2)
    play(gw.client(key=second["api_key"]), 1)
    play(gw.client(), 1)
    assert [c.ticket for _, c in gw.backend.history] == [97, 97, 3, 0]
    for s in (first, second):
        gw.post(f"/rl/sessions/{s['session_id']}/end")
    assert {t.traj_id: t.ticket for t in gw.emitted} == {first["session_id"]: 97, second["session_id"]: 3}


def test_the_gateway_admits_sessions_for_updates_at_most_staleness_ahead_of_the_trainer():
    """The gateway node's admission on the default topology (sessions through the gateway, no socket):
    ticket // trigger_batch_size is the update a session is admitted for. Before the trainer has
    measured its batch, global_batch_size sessions per update; then the trainer's reports move it on,
    and never past the trainer's version + staleness_threshold."""
    from pathlib import Path

    from areal_bus.admission import Admission
    from areal_bus.wire.messages import RunState
    from areal_bus.runtime.metrics import Metrics
    from areal_bus.config.topology import load_topology
    from nodes.gateway.node import admit_session

    topo = load_topology(Path(__file__).resolve().parents[1] / "topology" / "default.yaml")
    s, trigger, glob = topo.staleness_threshold, topo.trigger_batch_size, topo.global_batch_size
    adm, metrics = Admission.of(topo, "gateway-0"), Metrics()

    def open_all(version):
        updates = []
        while (got := admit_session(adm, version, metrics))[0] is not None:
            updates.append(got[0] // trigger)
        assert got[1] > 0 and metrics.counters["sessions_refused"] >= 1
        return updates

    assert open_all(0) == [u for u in range(s + 1) for _ in range(glob)]
    consumed = 0
    for version in range(1, 8):  # the trainer takes trigger_batch_size an update, as rollout-bound runs do
        consumed += trigger
        adm.follow(RunState(version=version, max_steps=60, finished=False, consumed=consumed, incarnation="t",
                            sources={"gw": [consumed, 0]}), "gw")
        updates = open_all(version)
        assert all(version <= u <= version + s for u in updates), (version, updates)
    assert updates == [version + s] * trigger  # the pipeline stays full: a batch for the update s ahead


def test_session_limit_is_a_429_saying_what_to_do(gateway):
    gw = gateway(max_sessions=1)
    gw.open_session()
    r = gw.post("/rl/sessions")
    assert r.status_code == 429 and "max_sessions=1" in r.json()["error"]["message"]


def test_only_the_admin_token_opens_sessions(gateway):
    gw = gateway()
    s = gw.open_session()
    assert gw.post("/rl/sessions", key=s["api_key"]).status_code == 403
    assert gw.post("/rl/sessions", key="wrong").status_code == 401


def test_shutdown_ends_open_sessions_and_emits_them(gateway):
    gw = gateway()
    s = gw.open_session()
    play(gw.client(key=s["api_key"]), 1)
    gw.close()
    [t] = gw.emitted
    assert t.meta["end_reason"] == "shutdown"


def test_two_hundred_concurrent_sessions_each_emit_one_trajectory(gateway):
    import aiohttp

    gw = gateway(max_sessions=200)
    admin = {"Authorization": f"Bearer {ADMIN}"}

    async def one(http: aiohttp.ClientSession):
        async with http.post("/rl/sessions", headers=admin) as r:
            s = await r.json()
        body = {"model": POLICY, "messages": [{"role": "user", "content": GAME}], "max_tokens": 4}
        async with http.post("/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {s['api_key']}"}) as r:
            assert r.status == 200 and (await r.json())["choices"][0]["finish_reason"] in ("stop", "length")
        async with http.post(f"/rl/sessions/{s['session_id']}/end", headers=admin) as r:
            assert r.status == 200
        return s["session_id"]

    async def main():
        connector = aiohttp.TCPConnector(limit=200)
        async with aiohttp.ClientSession(gw.url, connector=connector, timeout=aiohttp.ClientTimeout(60)) as http:
            return await asyncio.gather(*(one(http) for _ in range(200)))

    ids = asyncio.run(main())
    assert len(set(ids)) == 200
    assert sorted(t.traj_id for t in gw.emitted) == sorted(ids)
    assert all(t.loss_mask.sum() == t.output_ids.size > 0 for t in gw.emitted)
    # continuous batching: requests that arrive while others decode join the running batch
    assert gw.backend.engine.steps < sum(t.output_ids.size for t in gw.emitted) / 2


def test_a_long_session_keeps_extending_one_branch_and_a_retry_forks_at_its_turn():
    store = SessionStore()
    session, _ = store.create()
    history, turns = [("user", "start", ())], 300
    points = []
    for t in range(turns):
        base = store.match(session, history, "")
        assert (base is None) == (t == 0) and (base is None or len(base.history) == len(history) - 1)
        reply = ("assistant", f"reply {t}", ())
        comp = Completion(f"r{t}", session.id, 0, "w", np.array([t], np.int32), np.zeros(1, np.float32),
                          np.zeros(1, np.int32), "stop")
        store.record(session, base, np.array([1, 2], np.int32), [7], "",
                     [Choice(comp, {"role": "assistant", "content": reply[1]}, True, (*history, reply))])
        points.append(list(history))
        history = [*history, reply, ("user", f"feedback {t}", ())]
    assert len(session.branches) == 1 and session.segments == 1
    retry = store.match(session, points[120], "")  # turn 120's request again: continues from turn 119's reply
    assert retry is not None and len(retry.history) == len(points[120]) - 1
    assert store.match(session, points[120], "other tools") is None
    [traj] = store.end(session)
    assert traj.meta["completions"] == list(range(turns))
