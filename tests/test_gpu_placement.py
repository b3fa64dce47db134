"""GPU placement in the topology: ``nodes.rollout.gpus`` (one GPU per rollout worker) and
``nodes.trainer.gpus`` (one per rank), indices on the host each process runs on; the render gives each
such program its CUDA_VISIBLE_DEVICES (areal_bus/config/placement.py). CPU only: nothing here opens a GPU.

Run: .venv/bin/pytest tests/test_gpu_placement.py
"""

from __future__ import annotations

import configparser
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from areal_bus.config.files import check_files
from areal_bus.config.topology import TopologyError, load_topology, parse_topology
from areal_bus.launch.render import render
from tests.fuzzing import venv_bin

REPO = Path(__file__).resolve().parents[1]
EIGHT = REPO / "topology" / "eight-gpus.yaml"
TWO_HOSTS = REPO / "topology" / "two-hosts-gpus.yaml"
A, B = "10.0.0.1", "10.0.0.2"


def _gpus_by_program(text: str) -> dict[str, str | None]:
    """Each program's CUDA_VISIBLE_DEVICES as rendered (None: not set)."""
    conf = configparser.ConfigParser(interpolation=None)
    conf.read_string(text)
    out = {}
    for section in conf.sections():
        if section.startswith("program:"):
            found = re.search(r'CUDA_VISIBLE_DEVICES="([^"]*)"', conf[section]["environment"])
            out[section.split(":", 1)[1]] = found.group(1) if found else None
    return out


def _env(text: str, program: str) -> dict[str, str]:
    conf = configparser.ConfigParser(interpolation=None)
    conf.read_string(text)
    return dict(re.findall(r'(\w+)="([^"]*)"', conf[f"program:{program}"]["environment"]))


def _gpu_run(**over) -> dict:
    """A GPU topology on one host (torch engines), with ``over`` merged into it."""
    data = {"rollout_workers": 4, "train_workers": 4, "parallelism": {"tp": 2},
            "model": {"device": "cuda", "dtype": "bfloat16"}, "agent": {"framework": "guess"},
            "rollout_engine": {"kind": "torch"}, "trainer_engine": {"kind": "torch"},
            "nodes": {"bus": {}, "agent": {}, "reward": {}, "weights": {}, "trainer": {"gpus": [4, 5, 6, 7]},
                      "rollout": {"gpus": [0, 1, 2, 3]}}}
    for key, value in over.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and key in data else value
    return data


def _error(data: dict) -> str:
    with pytest.raises(TopologyError) as err:
        parse_topology(data)
    return str(err.value)


# -- what renders ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [p for p in sorted((REPO / "topology").glob("*.yaml"))
                                  if p not in (EIGHT, TWO_HOSTS)], ids=lambda p: p.name)
def test_a_topology_without_gpus_sets_no_cuda_visible_devices(path):
    # Today's layouts (one GPU shared, or model.device alone) render as they always did.
    text = render(load_topology(path), path, REPO)
    assert "CUDA_VISIBLE_DEVICES" not in text


def test_eight_gpus_gives_each_rollout_worker_its_gpu_and_the_trainer_its_ranks_gpus():
    gpus = _gpus_by_program(render(load_topology(EIGHT), EIGHT, REPO))
    assert gpus == {"bus-0": None, "agent-0": None, "agent-1": None, "reward-0": None, "weights-0": None,
                    "rollout-0": "0", "rollout-1": "1", "rollout-2": "2", "rollout-3": "3",
                    # the trainer node is rank 0; its ranks 1-3 inherit this and take cuda:LOCAL_RANK
                    "trainer-0": "4,5,6,7"}


def test_eight_gpus_validates_with_the_files_it_names():
    topo = load_topology(EIGHT)
    assert (topo.rollout_workers, topo.train_workers, topo.parallelism.dp, topo.parallelism.tp) == (4, 4, 2, 2)
    assert check_files(topo, REPO, source=str(EIGHT)) == []


def test_two_hosts_each_host_renders_its_own_programs_gpus():
    topo = load_topology(TWO_HOSTS)
    on_a = _gpus_by_program(render(topo, TWO_HOSTS, REPO, host=A))
    on_b = _gpus_by_program(render(topo, TWO_HOSTS, REPO, host=B))
    # rollout replica r runs on hosts[r % 2] and its GPU is r // 2 of that host
    assert on_a == {"bus-0": None, "agent-0": None, "agent-1": None, "reward-0": None, "weights-0": None,
                    "rollout-0": "0", "rollout-2": "1", "rollout-4": "2", "rollout-6": "3", "trainer-0": "4,5,6,7"}
    assert on_b == {"rollout-1": "0", "rollout-3": "1", "rollout-5": "2", "rollout-7": "3", "weights-1": None}


def test_two_hosts_cli_renders_host_b_and_refuses_one_conf_for_both(tmp_path):
    (tmp_path / "t.yaml").write_text(TWO_HOSTS.read_text())
    (tmp_path / "models").symlink_to(REPO / "models")
    bin_ = str(venv_bin() / "areal-bus")
    res = subprocess.run([bin_, "render", "t.yaml", "--host", B], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert _gpus_by_program((tmp_path / f"supervisord.{B}.conf").read_text())["rollout-7"] == "3"
    # One conf for both hosts would put two workers on each GPU index of one machine.
    res = subprocess.run([bin_, "render", "t.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "--host" in res.stderr and "nodes.rollout.gpus" in res.stderr


def test_a_trainer_over_two_hosts_gives_each_hosts_ranks_their_gpus():
    data = _gpu_run(endpoints={"transport": "tcp", "host": A, "curve": {"key": "keys/cluster.key_secret"}})
    data["nodes"] = {**data["nodes"], "trainer": {"hosts": [A, B], "gpus": [0, 1, 0, 1]},
                     "rollout": {"gpus": [2, 3, 4, 5]}}
    topo = parse_topology(data)
    on_a, on_b = render(topo, "t.yaml", REPO, host=A), render(topo, "t.yaml", REPO, host=B)
    assert _gpus_by_program(on_a)["trainer-0"] == "0,1"
    launcher = _env(on_b, "trainer-1")  # B's rank launcher: ranks 2 and 3, LOCAL_RANK 0 and 1
    assert launcher["CUDA_VISIBLE_DEVICES"] == "0,1" and launcher["NODE_RANK"] == "1"
    assert launcher["LOCAL_WORLD_SIZE"] == "2"


def test_a_rollout_worker_and_a_trainer_rank_may_share_a_gpu():
    topo = parse_topology(_gpu_run(rollout_workers=1, train_workers=1, parallelism={"tp": 1},
                                   nodes={"rollout": {"gpus": [0]}, "trainer": {"gpus": [0]}}))
    gpus = _gpus_by_program(render(topo, "t.yaml", REPO))
    assert gpus["rollout-0"] == gpus["trainer-0"] == "0"


def test_a_workers_program_keeps_its_gpu_when_workers_are_added():
    # `supervisorctl update` restarts only programs whose config changed: appending workers (and their
    # GPUs) leaves the running ones alone.
    small = _gpus_by_program(render(parse_topology(_gpu_run(rollout_workers=2, nodes={"rollout": {"gpus": [0, 1]}})),
                                    "t.yaml", REPO))
    large = _gpus_by_program(render(parse_topology(_gpu_run()), "t.yaml", REPO))
    assert {k: large[k] for k in small} == small


# -- validation --------------------------------------------------------------------------------------

@pytest.mark.parametrize("over, message", [
    ({"nodes": {"rollout": {"gpus": [0, 1, 2]}}}, "nodes.rollout.gpus: 3 entries for rollout_workers 4"),
    ({"nodes": {"trainer": {"gpus": [4, 5, 6]}}}, "nodes.trainer.gpus: 3 entries for train_workers 4"),
    ({"nodes": {"rollout": {"gpus": [0, 1, 1, 2]}}}, "nodes.rollout.gpus: GPU 1 is given to rollout workers 1 and 2"),
    ({"nodes": {"trainer": {"gpus": [4, 5, 4, 6]}}}, "nodes.trainer.gpus: GPU 4 is given to trainer ranks 0 and 2"),
    ({"nodes": {"rollout": {"gpus": [0, [1, 2], 3, 4]}}}, r"nodes.rollout.gpus\[1\]: \[1, 2\] spans 2 GPUs"),
    ({"nodes": {"rollout": {"gpus": [0, 1, -1, 3]}}}, r"nodes.rollout.gpus\[2\]: GPU index -1"),
    ({"model": {"device": "cuda:1"}}, "model.device 'cuda:1' with nodes.rollout.gpus"),
    ({"model": {"trainer_device": "cuda:4"}}, "model.trainer_device 'cuda:4' with nodes.trainer.gpus"),
    ({"model": {"trainer_device": "cpu"}}, "nodes.trainer.gpus .* model.trainer_device is 'cpu'"),
])
def test_a_gpu_placement_that_cannot_run_names_its_field(over, message):
    data = _gpu_run()
    for key, value in over.items():
        data[key] = {**data[key], **value}
    assert re.search(message, _error(data))


def test_gpus_with_a_cpu_model_device_are_refused():
    data = _gpu_run(model={"device": "cpu", "dtype": "float32"})
    data["nodes"] = {**data["nodes"], "trainer": {}}
    assert "nodes.rollout.gpus places each rollout worker on a GPU but model.device is 'cpu'" in _error(data)


def test_the_same_gpu_index_on_two_hosts_is_two_gpus_but_twice_on_one_host_is_refused():
    tcp = {"transport": "tcp", "host": A, "curve": {"key": "keys/cluster.key_secret"}}
    data = _gpu_run(endpoints=tcp, rollout_engine={"kind": "sim"}, trainer_engine={"kind": "sim"},
                    agent={"framework": "sim"})
    data["nodes"] = {**data["nodes"], "rollout": {"hosts": [A, B], "gpus": [0, 0, 1, 1]}}
    parse_topology(data)  # replicas 0, 2 on A (GPUs 0, 1); 1, 3 on B (GPUs 0, 1)
    data["nodes"]["rollout"]["gpus"] = [0, 1, 0, 2]  # replicas 0 and 2 both on A's GPU 0
    assert f"nodes.rollout.gpus: GPU 0 of host {A} is given to rollout workers 0 and 2" in _error(data)


@pytest.mark.parametrize("kind", ["bus", "weights", "reward"])
def test_only_rollout_and_trainer_take_gpus(kind):
    data = _gpu_run()
    data["nodes"] = {**data["nodes"], kind: {"gpus": [0]}}
    assert f"nodes.{kind}.gpus" in _error(data)


def test_the_shipped_gpu_topologies_are_written_as_the_docs_show_them():
    # docs/across-hosts.md shows these two files' placement; keep them together.
    doc = (REPO / "docs" / "across-hosts.md").read_text()
    for path in (EIGHT, TWO_HOSTS):
        nodes = yaml.safe_load(path.read_text())["nodes"]
        assert f"topology/{path.name}" in doc
        assert f"gpus: {nodes['rollout']['gpus']}".replace("'", "") in doc
