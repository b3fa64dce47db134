"""POST /rl/sessions/{id}/reward's completion_id names a completion by the id its response carried, on
every API: a chat completion (chatcmpl-<session>-<n>), a Responses call (resp_<session>-<n>) and a
legacy completion (cmpl-<session>-<n>, with "choice" for n > 1). The real gateway on loopback, the
stock openai SDK; an id of another session, or not of this shape, is a 400 naming completion_id.

    .venv/bin/python -m pytest tests/test_gateway_reward_ids.py -q
"""

from __future__ import annotations

import pytest

from tests.test_gateway_openai import POLICY, ScriptedBackend, gateway  # noqa: F401
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

pytestmark = pytest.mark.timeout(60)


def reward(gw, s, **body):
    return gw.post(f"/rl/sessions/{s['session_id']}/reward", {"reward": 0.5, **body}, key=s["api_key"])


def test_a_responses_id_rewards_its_completion(gateway):
    gw = gateway(backend=ScriptedBackend(["8", "12"]))
    s = gw.open_session()
    client = gw.client(key=s["api_key"])
    first = client.responses.create(model=POLICY, input="Guess my number (1-16).")
    second = client.responses.create(model=POLICY, input="higher", previous_response_id=first.id)
    assert second.id == f"resp_{s['session_id']}-1"
    r = reward(gw, s, completion_id=second.id)
    assert r.status_code == 200 and r.json()["completion_index"] == 1, r.text
    gw.post(f"/rl/sessions/{s['session_id']}/end")
    [t] = gw.emitted
    assert t.reward == 0.5 and t.meta["turn_returns"] == [0.5, 0.5]  # the reward came at turn 2


def test_a_legacy_completions_id_and_choice_reward_that_choice(gateway):
    gw = gateway(backend=ScriptedBackend(["a", "b", "c"]))
    s = gw.open_session()
    client = gw.client(key=s["api_key"])
    one = client.completions.create(model=POLICY, prompt="x", max_tokens=2)
    two = client.completions.create(model=POLICY, prompt="y", max_tokens=2, n=2)
    assert (one.id, two.id) == (f"cmpl-{s['session_id']}-0", f"cmpl-{s['session_id']}-1")
    r = reward(gw, s, completion_id=two.id, choice=1)
    assert r.status_code == 200 and r.json()["completion_index"] == 2, r.text
    gw.post(f"/rl/sessions/{s['session_id']}/end")
    rewarded = [t for t in gw.emitted if t.reward is not None]
    assert len(rewarded) == 1 and rewarded[0].reward == 0.5
    prompt_text = gw.backend.history[2][0]  # the third completion: choice 1 of prompt "y"
    assert rewarded[0].prompt_ids.tolist() == prompt_text.tolist()
    assert rewarded[0].output_ids.tolist() == gw.backend.history[2][1].output_ids.tolist()


def test_a_chat_completion_id_still_rewards_its_completion(gateway):
    gw = gateway(backend=ScriptedBackend(["8"]))
    s = gw.open_session()
    r0 = gw.client(key=s["api_key"]).chat.completions.create(model=POLICY, messages=[{"role": "user", "content": "go"}])
    r = reward(gw, s, completion_id=r0.id)
    assert r.status_code == 200 and r.json()["completion_index"] == 0


@pytest.mark.parametrize("make_id", [
    lambda sid, other: f"resp_{other}-0", lambda sid, other: f"cmpl-{other}-0", lambda sid, other: f"cmpl-{sid}-x",
    lambda sid, other: f"cmpl-{sid}-\u00b2", lambda sid, other: f"cmpl-{sid}--1", lambda sid, other: f"msg_{sid}-0",
    lambda sid, other: 7,
], ids=["resp-other", "cmpl-other", "not-a-number", "superscript", "negative", "msg", "not-a-string"])
def test_an_id_not_of_this_session_is_a_400_naming_completion_id(gateway, make_id):
    gw = gateway(backend=ScriptedBackend(["8"]))
    s, other = gw.open_session(), gw.open_session()
    gw.client(key=s["api_key"]).completions.create(model=POLICY, prompt="x", max_tokens=2)
    r = reward(gw, s, completion_id=make_id(s["session_id"], other["session_id"]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "completion_id", r.text
    assert "resp_" in r.json()["error"]["message"] and "cmpl-" in r.json()["error"]["message"]
