"""The longtail workload (areal_bus/tasks/longtail.py): per-episode max_tokens drawn from
rollout_engine.output_len, eos ignored so the lengths are real generated tokens, the target-share
reward; the torch engine through the same request path as the agent's; and a few updates of the whole
system under supervisord on the tiny model."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from areal_bus.wire import messages as m
from areal_bus.tasks.plugins import check_agent, make_driver
from areal_bus.tasks.runner import load_tokenizer, verify
from areal_bus.config.topology import parse_topology
from nodes.agent.core import EpisodeSource

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "models" / "tiny-guess"


def _topo(**over) -> object:
    data = {"agent": {"framework": "longtail", "prompt_len": 24},
            "model": {"path": str(TINY)},
            "rollout_engine": {"kind": "torch", "max_len": 512, "max_batch": 8,
                               "output_len": {"dist": "lognormal", "median": 40, "sigma": 0.8, "min": 8, "max": 120}},
            "trainer_engine": {"kind": "torch"}, "global_batch_size": 8, "trigger_batch_size": 4,
            "mini_batch_size": 4, "nodes": {"bus": {}, "agent": {"replicas": 1}, "rollout": {}, "trainer": {}}}
    for k, v in over.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
    return parse_topology(data)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TINY)


def test_each_episode_draws_its_own_max_tokens_from_output_len_and_ignores_eos(tok):
    topo = _topo(agent={"group_size": 4})
    driver = make_driver(topo, tokenizer=tok)
    src = EpisodeSource(topo, 0, 1, driver)
    src.start_episodes(0.0)
    reqs = src.to_send
    assert len(reqs) >= 8
    assert all(r.ignore_eos and 8 <= r.max_tokens <= 120 for r in reqs)
    assert len({r.max_tokens for r in reqs}) > 3  # a spread of lengths, not one
    # A GRPO group plays one prompt, each member with a length of its own (drawn per request, as the sim).
    groups = {}
    for r in reqs:
        groups.setdefault(r.group_id, []).append(r)
    for members in groups.values():
        assert len({tuple(r.prompt_ids) for r in members}) == 1
    assert any(len({r.max_tokens for r in members}) > 1 for members in groups.values())
    ep = next(iter(src.episodes.values())).state
    assert len(ep.messages[0]["content"]) == 24


def test_lengths_follow_the_lognormal_median_and_clip():
    topo = _topo(rollout_engine={"output_len": {"dist": "lognormal", "median": 500, "sigma": 0.8,
                                                "min": 200, "max": 3000}, "max_len": 4096})
    from areal_bus.tasks.driver import TaskContext
    from areal_bus.tasks.longtail import LongtailTask

    task = LongtailTask(TaskContext(tokenizer=None, topology=topo))
    lengths = np.array([task.reset(s).max_tokens for s in range(2000)])
    assert lengths.min() == 200 and lengths.max() == 3000  # both clips are hit
    assert 430 < np.median(lengths) < 570
    assert task.reset(7).messages == task.reset(7).messages  # the seed is the prompt


def test_reward_is_the_share_of_target_characters_in_the_output(tok):
    driver = make_driver(_topo(), tokenizer=tok)
    ep = driver.reset(3)
    ep.step("7" * 30 + "a" * 10)
    assert driver.score(ep)[0] == pytest.approx(0.75)
    empty = driver.reset(3)
    empty.step("")  # all special tokens: nothing to score
    assert driver.score(empty)[0] == 0.0
    other = make_driver(_topo(agent={"task_options": {"target": "ab"}}), tokenizer=tok).reset(3)
    other.step("ab" * 5)
    assert other.reward == 1.0


def test_a_topology_whose_max_len_cannot_hold_the_longest_output_is_refused_naming_the_field():
    problems = check_agent(_topo(rollout_engine={"max_len": 100}))
    assert len(problems) == 1 and problems[0].startswith("rollout_engine.max_len (100)")
    assert check_agent(_topo()) == []


def test_the_torch_engine_generates_exactly_max_tokens_through_eos(tok, one_torch_thread):
    """The agent's own requests, run by the torch engine: every output is max_tokens long, though the
    shipped policy (trained to answer a number and eos) samples eos early; the same requests without
    ignore_eos stop there. The reward node's verifier scores the trajectory by its text."""
    from areal_bus.engines.torch_engine import TorchRolloutEngine

    topo = _topo()
    driver = make_driver(topo, tokenizer=tok)
    src = EpisodeSource(topo, 0, 1, driver)
    src.start_episodes(0.0)
    reqs = src.to_send[:4]

    def run(requests):
        engine = TorchRolloutEngine(TINY, max_batch=4, max_len=512, seed=0)
        for req in requests:
            engine.add_request(req)
        done = []
        while engine.running_ids:
            done += engine.step()
        return {c.request_id: c for c in done}

    by_id = run(reqs)
    for req in reqs:
        comp = by_id[req.request_id]
        assert comp.output_ids.size == req.max_tokens and comp.finish_reason == "length"
    assert any((c.output_ids == tok.eos_token_id).any() for c in by_id.values())  # eos was sampled, and ignored
    stopped = run([dataclasses.replace(r, ignore_eos=False) for r in reqs])
    assert any(c.finish_reason == "stop" and c.output_ids.size < r.max_tokens
               for r, c in ((r, stopped[r.request_id]) for r in reqs))
    comp = by_id[reqs[0].request_id]
    traj = src.on_completion(comp, 1.0)
    assert traj is not None and int(traj.loss_mask.sum()) == reqs[0].max_tokens
    ep = driver.reset(traj.meta["seed"])
    ep.step(tok.decode(comp.output_ids, skip_special_tokens=True))
    assert verify(driver, traj) == pytest.approx(ep.reward)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("in_order", [False, True])
def test_longtail_trains_a_few_updates_under_supervisord(tmp_path, in_order):
    """The tiny policy on longtail, asynchronously, under supervisord, in GRPO groups of 4: each
    update's samples are of the drawn lengths (generated tokens within the clip), rewards in [0, 1].
    With staleness.in_order the agent hands its groups on in the order it admitted them, whole."""
    sys.path.insert(0, str(ROOT))
    from bench.harness import run_system

    topo = yaml.safe_load((ROOT / "topology" / "default.yaml").read_text())
    topo.update(
        name="longtail-test", rollout_workers=1, max_steps=3, staleness_threshold=2, queue_max_size=32,
        trigger_batch_size=4, global_batch_size=8, mini_batch_size=4,
        logging={"log_dir": "logs", "log_interval": 1, "save_interval": 0},
        model={**topo["model"], "path": str(TINY), "device": "cpu", "dtype": "float32", "threads": 1},
        rollout_engine={"kind": "torch", "max_batch": 8, "max_len": 256, "temperature": 1.0,
                        "output_len": {"dist": "lognormal", "median": 24, "sigma": 0.8, "min": 8, "max": 96}},
        trainer_engine={"kind": "torch", "eval_interval": 0},
        nodes={"bus": {}, "agent": {"replicas": 1}, "reward": {"replicas": 1}, "trainer": {}, "weights": {}},
    )
    topo["agent"] = {"framework": "longtail", "prompt_len": 32, "max_turns": 1, "reward_source": "rule", "via": "bus",
                     "group_size": 4}
    topo["staleness"] = {"in_order": in_order}
    records, wall = run_system(topo, "longtail", keep=tmp_path, timeout=110)
    steps = [r for r in records if r["step"] >= 0]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        assert r["samples"] >= 4 and 8 * r["samples"] <= r["generated"] <= 96 * r["samples"]
        assert 0.0 <= r["reward"] <= 1.0
    # The rollout worker's running-batch series was written where the bench reads it.
    series = list((tmp_path / "longtail").glob("rollout_batch-*.jsonl"))
    assert series and series[0].read_text().strip()
    if in_order:  # episode ids count up in admission order, a group's members consecutive
        ledger = next((tmp_path / "longtail").rglob("ledger/agent-0.jsonl")).read_text().splitlines()
        produced = [int(i.rsplit("-", 1)[1]) for line in ledger if '"produced"' in line for i in json.loads(line)["ids"]]
        groups = [n // 4 for n in produced]
        assert len(produced) >= 12 and groups == sorted(groups) and all(groups.count(g) == 4 for g in set(groups))


def test_the_vllm_engine_is_asked_for_the_same_thing():
    """vLLM's SamplingParams for a longtail request: eos left out of the stop ids (vLLM's own eos check
    is always off), so only max_tokens ends it; a plain request still stops at eos."""
    from areal_bus.engines import vllm_engine as ve

    req = m.GenerateRequest(request_id="r", episode_id="e", ticket=0, min_version=0, max_tokens=700,
                            temperature=1.0, prompt_ids=np.arange(1, 9, dtype=np.int32), ignore_eos=True, stop=[7])
    spec = ve.sampling_spec(req, eos_token_ids=[2])
    assert spec["ignore_eos"] and spec["stop_token_ids"] == [7] and spec["max_tokens"] == 700
    assert ve.sampling_spec(dataclasses.replace(req, ignore_eos=False), eos_token_ids=[2])["stop_token_ids"] == [2, 7]


def test_ignore_eos_crosses_the_wire():
    from areal_bus.wire.codec import Encoder, decode

    req = m.GenerateRequest(request_id="r", episode_id="e", ticket=3, min_version=0, max_tokens=9,
                            temperature=1.0, prompt_ids=np.arange(1, 5, dtype=np.int32), ignore_eos=True)
    _, back = decode([bytes(f) for f in Encoder("agent-0").encode(req)])
    assert back.ignore_eos is True and back.max_tokens == 9
    _, plain = decode([bytes(f) for f in Encoder("agent-0").encode(dataclasses.replace(req, ignore_eos=False))])
    assert plain.ignore_eos is False
