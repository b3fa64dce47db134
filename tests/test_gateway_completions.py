"""Gateway, legacy completions: the openai SDK's ``client.completions`` against the real gateway on a
loopback port, serving the tiny policy (models/tiny-guess). Token ids in are the prompt exactly, and a
session records each call with the tokens served.

    .venv/bin/python -m pytest tests/test_gateway_completions.py -q
"""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.test_gateway_openai import ADMIN, POLICY, TEN, gateway, tokenizer  # noqa: F401
from tests.torch_threads import one_torch_thread_per_module  # noqa: F401 (autouse)

IDS = [40, 41, 42, 43, 44]


def ended(gw, s) -> list:
    assert gw.post(f"/rl/sessions/{s['session_id']}/end").status_code == 200
    return [t for t in gw.emitted if t.episode_id == s["session_id"]]


def test_token_ids_are_the_prompt_exactly_and_the_session_records_the_served_tokens(gateway):
    gw = gateway()
    s = gw.open_session()
    r = gw.client(key=s["api_key"]).completions.create(model=POLICY, prompt=IDS, max_tokens=4, temperature=0)
    prompt, comp = gw.backend.history[-1]
    assert prompt.tolist() == IDS
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == comp.output_ids.size
    assert r.choices[0].text == tokenizer().decode(comp.output_ids.tolist(), skip_special_tokens=True)
    [traj] = ended(gw, s)
    assert traj.prompt_ids.tolist() == IDS and traj.output_ids.tolist() == comp.output_ids.tolist()
    assert np.allclose(traj.logprobs, comp.logprobs) and traj.loss_mask.all()


def test_a_prompt_extending_the_last_call_continues_its_branch_with_the_new_ids_as_environment(gateway):
    gw = gateway()
    s = gw.open_session()
    client = gw.client(key=s["api_key"])
    client.completions.create(model=POLICY, prompt=IDS, max_tokens=3)
    _, first = gw.backend.history[-1]
    env = [45, 46]
    follow = IDS + first.output_ids.tolist() + env
    client.completions.create(model=POLICY, prompt=follow, max_tokens=3)
    prompt, second = gw.backend.history[-1]
    assert prompt.tolist() == follow
    [traj] = ended(gw, s)
    assert traj.meta["segments"] == 1 and traj.meta["completions"] == [0, 1]
    assert traj.prompt_ids.tolist() == IDS
    assert traj.output_ids.tolist() == first.output_ids.tolist() + env + second.output_ids.tolist()
    assert traj.loss_mask.tolist() == [1] * first.output_ids.size + [0, 0] + [1] * second.output_ids.size


def test_a_prompt_that_does_not_extend_the_session_starts_a_new_segment(gateway):
    gw = gateway()
    s = gw.open_session()
    client = gw.client(key=s["api_key"])
    client.completions.create(model=POLICY, prompt=IDS, max_tokens=2)
    client.completions.create(model=POLICY, prompt=[50, 51], max_tokens=2)
    trajs = ended(gw, s)
    assert sorted(t.prompt_ids.tolist() for t in trajs) == [IDS, [50, 51]]
    assert all(t.meta["history_rewritten"] for t in trajs)


def test_a_list_of_prompts_gets_n_choices_each_in_openais_order(gateway):
    gw = gateway()
    r = gw.client().completions.create(model=POLICY, prompt=[IDS, [50, 51, 52]], n=2, max_tokens=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    prompts = [p.tolist() for p, _ in gw.backend.history[-4:]]
    assert sorted(prompts) == sorted([IDS, IDS, [50, 51, 52], [50, 51, 52]])
    assert r.usage.prompt_tokens == 8
    assert r.usage.completion_tokens == sum(c.output_ids.size for _, c in gw.backend.history[-4:])


def test_a_text_prompt_is_tokenised_once_and_stop_cuts_the_text(gateway):
    gw = gateway()
    text = tokenizer().apply_chat_template(TEN, tokenize=False, add_generation_prompt=True)  # greedy: "10", eos
    r = gw.client().completions.create(model=POLICY, prompt=text, max_tokens=8, temperature=0)
    prompt, comp = gw.backend.history[-1]
    assert prompt.tolist() == tokenizer().encode(text)
    assert r.choices[0].text == "10" and r.choices[0].finish_reason == "stop"
    cut = gw.client().completions.create(model=POLICY, prompt=text, max_tokens=8, temperature=0, stop="0")
    assert cut.choices[0].text == "1" and cut.choices[0].finish_reason == "stop"


def test_logprobs_zero_returns_the_sampled_tokens_logprobs_in_the_legacy_format(gateway):
    gw = gateway()
    r = gw.client().completions.create(model=POLICY, prompt=IDS, max_tokens=4, logprobs=0)
    comp = gw.backend.history[-1][1]
    lp = r.choices[0].logprobs
    keep = comp.output_ids.size - (1 if comp.output_ids[-1] == tokenizer().eos_token_id else 0)
    assert np.allclose(lp.token_logprobs, comp.logprobs[:keep]) and lp.top_logprobs is None
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_a_stream_adds_up_to_the_same_text_then_usage_then_done(gateway):
    gw = gateway()
    plain = gw.client().completions.create(model=POLICY, prompt=IDS, max_tokens=6, temperature=0)
    chunks = list(gw.client().completions.create(model=POLICY, prompt=IDS, max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    raw = httpx.post(gw.url + "/gateway/v1/completions", json={"model": POLICY, "prompt": IDS, "stream": True},
                     headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert raw.text.rstrip().endswith("data: [DONE]")


REFUSED = [
    ("echo", {"echo": True}, "echo"),
    ("top_logprobs", {"logprobs": 21}, "logprobs"),
    ("suffix", {"suffix": "x"}, "suffix"),
    ("best_of", {"best_of": 3}, "best_of"),
    ("penalty", {"presence_penalty": 0.5}, "presence_penalty"),
    ("logit_bias", {"logit_bias": {"40": 5}}, "logit_bias"),
    ("seed", {"seed": -1}, "seed"),
    ("unknown", {"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ("id_past_vocab", {"prompt": [40, 10 ** 6]}, "prompt"),
    ("empty", {"prompt": []}, "prompt"),
    ("too_long", {"prompt": [40] * 600}, "prompt"),
]


@pytest.mark.parametrize("extra, param", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_what_cannot_be_honoured_is_a_400_naming_the_field_and_nothing_is_recorded(gateway, extra, param):
    gw = gateway()
    s = gw.open_session()
    with pytest.raises(openai.BadRequestError) as err:
        gw.client(key=s["api_key"]).completions.create(**{"model": POLICY, "prompt": IDS, "max_tokens": 2, **extra})
    assert err.value.body["param"] == param and err.value.body["message"]
    assert gw.post(f"/rl/sessions/{s['session_id']}/end").json()["completions"] == 0
