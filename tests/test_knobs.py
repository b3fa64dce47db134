"""The knob reference: docs/knobs.md is what `areal-bus knobs --markdown` prints today, every field of the
schema says what it does, and an experimental knob needs the topology's ``experimental: true``.

Run: .venv/bin/python -m pytest -q tests/test_knobs.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from areal_bus.config import knobs
from areal_bus.config.base import tagged_kinds
from areal_bus.config.root import Topology
from areal_bus.config.topology import TopologyError, parse_topology
from areal_bus.launch.cli import main

ROOT = Path(__file__).resolve().parent.parent
TORCH = {"agent": {"framework": "guess"}, "rollout_engine": {"kind": "torch"}, "trainer_engine": {"kind": "torch"}}
EXPERIMENTAL = {  # each experimental knob, set to an experimental value in a topology that is otherwise valid
    "staleness.per_token": {"staleness": {"per_token": True}},
    "staleness.lead": {"staleness": {"lead": "adaptive"}},
    "trainer_engine.attn_implementation": {**TORCH, "trainer_engine": {"kind": "torch",
                                                                        "attn_implementation": "areal_varlen_fa4"}},
    "trainer_engine.prox_logp_method": {**TORCH, "trainer_engine": {"kind": "torch", "prox_logp_method": "loglinear"}},
}


def test_docs_knobs_md_is_what_the_schema_says_today():
    written = (ROOT / "docs" / "knobs.md").read_text()
    assert written == knobs.markdown() + "\n", f"docs/knobs.md is stale: refresh it with `{knobs.REFRESH}`"


def test_the_knobs_command_prints_every_knob(capsys):
    assert main(["knobs"]) == 0
    out = capsys.readouterr().out
    rows = knobs.knobs()
    assert all(f"{k.path}: " in out for k in rows)
    assert "rollout_engine.swap_s: float = 0.005  [>= 0, <= 60]  (kind sim)" in out
    assert "staleness.lead: 'bound' | 'adaptive' = 'bound'  EXPERIMENTAL" in out


def _models(model: type[BaseModel], seen: set) -> None:
    if model in seen:
        return
    seen.add(model)
    for info in model.model_fields.values():
        inner = list((tagged_kinds(info.annotation) or {}).values())
        inner += [a for a in (info.annotation, *getattr(info.annotation, "__args__", ()))
                  if isinstance(a, type) and issubclass(a, BaseModel)]
        for sub in inner:
            _models(sub, seen)


def test_every_field_of_the_schema_has_a_description():
    seen: set = set()
    _models(Topology, seen)
    missing = [f"{m.__name__}.{n}" for m in seen for n, f in m.model_fields.items() if not (f.description or "").strip()]
    assert not missing, f"fields without a description: {missing}"


def test_the_experimental_list_is_the_schemas():
    assert sorted(EXPERIMENTAL) == sorted(k.path for k in knobs.knobs() if k.experimental)


@pytest.mark.parametrize("path", sorted(EXPERIMENTAL))
def test_an_experimental_value_is_refused_without_the_opt_in_naming_field_and_opt_in(path):
    with pytest.raises(TopologyError) as err:
        parse_topology(EXPERIMENTAL[path], "t.yaml")
    assert path in str(err.value) and "experimental: true" in str(err.value)
    assert parse_topology({**EXPERIMENTAL[path], "experimental": True})


def test_an_experimental_knob_at_its_default_or_a_stable_value_needs_no_opt_in():
    assert parse_topology({"staleness": {"lead": "bound", "per_token": False}})
    assert parse_topology({**TORCH, "trainer_engine": {"kind": "torch", "attn_implementation": "sdpa"}})


@pytest.mark.parametrize("section, field, kind, owner", [
    ("rollout_engine", "swap_s", "torch", "sim"), ("rollout_engine", "prefix_caching", "sim", "vllm"),
    ("rollout_engine", "decode_attention", "vllm", "torch"), ("trainer_engine", "eps_clip", "sim", "torch"),
    ("trainer_engine", "time_per_token_s", "torch", "sim")])
def test_a_field_of_another_engine_kind_is_refused_naming_the_kind_it_belongs_to(section, field, kind, owner):
    with pytest.raises(TopologyError) as err:
        parse_topology({section: {"kind": kind, field: 1}}, "t.yaml")
    assert f"{section}.{field} is a '{owner}' engine field; {section}.kind is '{kind}'" in str(err.value)


def test_each_count_is_written_in_one_place_and_the_other_names_it():
    cases = [({"nodes": {"rollout": {"replicas": 3}}}, "write rollout_workers: 3"),
             ({"parallelism": {"dp": 2}}, "parallelism.dp is not written"),
             ({"nodes": {"reward": {"config": {"reward_source": "judge"}}}}, "write agent.reward_source: judge")]
    for data, says in cases:
        with pytest.raises(TopologyError, match=says):
            parse_topology(data, "t.yaml")
    assert parse_topology({"rollout_workers": 3}).replicas("rollout") == 3
