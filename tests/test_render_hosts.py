"""`areal-bus render TOPOLOGY --host ADDR`: one supervisord.conf per host, holding the programs the
topology places there (areal_bus/config/placement.py), with torchrun's environment on the trainer's ranks.

Run: .venv/bin/pytest tests/test_render_hosts.py
"""

from __future__ import annotations

import configparser
import subprocess

import pytest
import yaml

from areal_bus.launch.render import render
from areal_bus.config.topology import TopologyError, parse_topology
from tests.fuzzing import venv_bin

A, B = "10.0.0.1", "10.0.0.2"


def _two_hosts(**nodes) -> dict:
    return {"rollout_workers": 3, "train_workers": 4,
            "rollout_engine": {"kind": "torch"}, "trainer_engine": {"kind": "torch"}, "agent": {"framework": "guess"},
            "endpoints": {"transport": "tcp", "host": A, "curve": {"key": "keys/cluster.key_secret"}},
            "nodes": {"bus": {}, "agent": {}, "reward": {}, "weights": {},
                      "trainer": {"hosts": [A, B]}, "rollout": {"hosts": [A, B]}, **nodes}}


def _programs(text: str) -> dict[str, configparser.SectionProxy]:
    conf = configparser.ConfigParser(interpolation=None)
    conf.read_string(text)
    return {s.split(":", 1)[1]: conf[s] for s in conf.sections() if s.startswith(("program:", "eventlistener:"))}


def test_each_host_gets_its_own_programs_and_the_single_conf_keeps_them_all(tmp_path):
    topo = parse_topology(_two_hosts())
    on_a = _programs(render(topo, tmp_path / "t.yaml", tmp_path, host=A))
    on_b = _programs(render(topo, tmp_path / "t.yaml", tmp_path, host=B))
    assert set(on_a) == {"bus-0", "agent-0", "reward-0", "weights-0", "trainer-0", "rollout-0", "rollout-2", "run_end"}
    assert set(on_b) == {"trainer-1", "rollout-1", "weights-1", "run_end"}
    # The trainer node is rank 0 with its host's rank 1 as a child; B's launcher starts ranks 2 and 3.
    for progs, node_rank in ((on_a, "0"), (on_b, "1")):
        env = progs[f"trainer-{node_rank}"]["environment"]
        for part in (f'MASTER_ADDR="{A}"', 'MASTER_PORT="26200"', 'WORLD_SIZE="4"', f'NODE_RANK="{node_rank}"',
                     'LOCAL_WORLD_SIZE="2"'):
            assert part in env, env
    assert on_b["trainer-1"]["command"].startswith("python -m areal_bus.engines.torch_dp --topology")
    assert on_b["weights-1"]["command"].endswith("--replica 1")  # the relay of B's weights
    assert "--program trainer-0" in on_a["run_end"]["command"]
    assert "--program trainer-1" in on_b["run_end"]["command"]
    # Without --host: today's file, every node on one host, no relay and no launcher.
    single = _programs(render(topo, tmp_path / "t.yaml", tmp_path))
    assert set(single) == {"bus-0", "agent-0", "reward-0", "weights-0", "trainer-0", "rollout-0", "rollout-1",
                           "rollout-2", "run_end"}
    assert "MASTER_ADDR" not in single["trainer-0"]["environment"]


def test_a_host_the_topology_does_not_name_is_refused_with_the_ones_it_does(tmp_path):
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(_two_hosts() | {"rollout_engine": {"kind": "sim"},
                                                                     "trainer_engine": {"kind": "sim"},
                                                                     "agent": {"framework": "sim"}}))
    res = subprocess.run([str(venv_bin() / "areal-bus"), "render", "t.yaml", "--host", "10.0.0.9"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "10.0.0.9" in res.stderr and A in res.stderr and B in res.stderr
    assert not (tmp_path / "supervisord.10.0.0.9.conf").exists()


@pytest.mark.parametrize("change, field", [
    ({"trainer": {"hosts": [A, B, "10.0.0.3"]}}, "nodes.trainer.hosts"),     # 4 ranks over 3 hosts
    ({"reward": {"hosts": [A, B]}}, "nodes.reward.hosts"),                    # only trainer and rollout spread
    ({"weights": {"host": B}}, "nodes.weights.host"),                         # must read the trainer's memory
    ({"trainer": {"hosts": [A, B], "host": B}}, "nodes.trainer.host"),
])
def test_a_placement_that_cannot_run_names_its_field(change, field):
    with pytest.raises(TopologyError, match=field.replace(".", r"\.")):
        parse_topology(_two_hosts(**change))


def test_hosts_need_tcp_and_curve():
    data = _two_hosts()
    with pytest.raises(TopologyError, match="transport: tcp"):
        parse_topology({**data, "endpoints": {"transport": "ipc"}})
    with pytest.raises(TopologyError, match="CURVE"):
        parse_topology({**data, "endpoints": {"transport": "tcp", "host": A}})
