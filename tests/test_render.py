"""Rendering a topology to supervisord.conf, and the run-end listener's decision.

The first test is what keeps the checked-in supervisord.conf in sync with topology/default.yaml: after
editing the topology, run `areal-bus render topology/default.yaml` and commit both.

Run: .venv/bin/pytest tests/test_render.py
"""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

from areal_bus.launch.render import render, write_conf
from areal_bus.launch.runend import EVENTS, should_stop
from areal_bus.config.topology import load_topology, parse_topology

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "topology" / "default.yaml"


def _parse(text: str) -> configparser.ConfigParser:
    # supervisord's %(here)s and %(process_num)d are its own expansions: read the text as written.
    conf = configparser.ConfigParser(interpolation=None)
    conf.read_string(text)
    return conf


def _programs(conf: configparser.ConfigParser) -> dict[str, configparser.SectionProxy]:
    return {s.split(":", 1)[1]: conf[s] for s in conf.sections() if s.startswith("program:")}


def _render(data: dict, tmp_path: Path) -> configparser.ConfigParser:
    return _parse(render(parse_topology(data), tmp_path / "topo.yaml", tmp_path))


def test_checked_in_conf_is_the_render_of_the_default_topology():
    rendered = render(load_topology(DEFAULT), DEFAULT, REPO)
    assert (REPO / "supervisord.conf").read_bytes() == rendered.encode(), (
        "supervisord.conf is out of date: run `areal-bus render topology/default.yaml` and commit it")


def test_every_replica_is_a_program_of_its_own_named_kind_and_replica(tmp_path):
    programs = _programs(_render({"rollout_workers": 3, "nodes": {"reward": {"replicas": 2}}}, tmp_path))
    assert {"rollout-0", "rollout-1", "rollout-2", "reward-0", "reward-1", "trainer-0"} <= set(programs)
    for name, prog in programs.items():
        kind, replica = name.rsplit("-", 1)
        assert prog["command"].endswith(f"--replica {replica}"), name
        assert "numprocs" not in prog and "process_name" not in prog, name  # one process, named as its program
        assert prog["stdout_logfile"] == f"%(here)s/logs/supervisor/{name}.log", name


def test_no_group_section_gathers_replicas_into_one_restartable_group(tmp_path):
    conf = _render({"rollout_workers": 4, "nodes": {"gateway": {"replicas": 2}, "agent": {"replicas": 2}}}, tmp_path)
    assert not [s for s in conf.sections() if s.startswith("group:")], conf.sections()


def test_a_replicas_program_reads_the_same_whatever_the_replica_count(tmp_path):
    # What lets `supervisorctl update` leave the replicas that stay alone when a kind is rescaled.
    small = _programs(_render({"rollout_workers": 2}, tmp_path))
    large = _programs(_render({"rollout_workers": 5}, tmp_path))
    assert set(large) - set(small) == {"rollout-2", "rollout-3", "rollout-4"}
    for name, prog in small.items():
        assert dict(prog) == dict(large[name]), name


def test_kind_with_zero_replicas_is_left_out(tmp_path):
    programs = _programs(_render({"rollout_workers": 0, "nodes": {"reward": {"replicas": 0}}}, tmp_path))
    kinds = {name.rsplit("-", 1)[0] for name in programs}
    assert "reward" not in kinds
    assert "rollout" not in kinds
    assert "probe" not in kinds  # probe defaults to 0 replicas
    assert {"bus", "trainer", "weights", "agent"} <= kinds


def test_every_program_restarts_only_on_unexpected_exit_and_stops_as_a_group(tmp_path):
    programs = _programs(_render({"rollout_workers": 2, "nodes": {"probe": {"replicas": 1}}}, tmp_path))
    assert set(programs) == {"bus-0", "agent-0", "rollout-0", "rollout-1", "reward-0", "trainer-0", "weights-0",
                             "probe-0"}
    for name, prog in programs.items():
        assert prog["autorestart"] == "unexpected", name
        assert prog["exitcodes"] == "0", name
        assert prog["stopasgroup"] == "true", name
        assert prog["killasgroup"] == "true", name
        kind = name.rsplit("-", 1)[0]
        assert prog["command"].startswith(f"areal-bus node {kind} --topology %(here)s/topo.yaml"), name


def test_run_end_listener_is_rendered(tmp_path):
    conf = _render({}, tmp_path)
    listener = conf["eventlistener:run_end"]
    assert listener["command"] == "areal-bus run-end --program trainer-0"
    assert listener["events"] == EVENTS  # the trainer's exit, and a node that cannot run
    assert conf["supervisord"]["nodaemon"] == "true"


def test_rereading_the_conf_leaves_every_program_unchanged(tmp_path):
    # `supervisorctl update` restarts each program whose config differs from the running one. A
    # conf whose expansions drift on a re-read (as a self-referencing [supervisord] PATH did) makes
    # scaling the rollout workers restart the trainer and everything else.
    from supervisor.options import ServerOptions

    topo_path = tmp_path / "topo.yaml"
    topo_path.write_text("name: t\nrollout_workers: 2\n")
    conf = write_conf(load_topology(topo_path), topo_path, tmp_path / "supervisord.conf")
    options = ServerOptions()
    options.realize(args=["-c", str(conf)])
    first = options.process_group_configs
    options.process_config(do_usage=False)  # what supervisord does on `update`
    assert [g.name for g in options.process_group_configs] == [g.name for g in first]
    for before, after in zip(first, options.process_group_configs):
        assert before == after, before.name
    path = first[0].process_configs[0].environment["PATH"]
    assert path.startswith(f"{tmp_path}/.venv/bin:") and path.count(".venv/bin") == 1


def test_rescaling_adds_and_removes_only_the_replicas_that_changed(tmp_path):
    # supervisord's own diff of a running config against a re-read one, which `update` acts on.
    from supervisor.options import ServerOptions
    from supervisor.supervisord import Supervisor

    topo_path = tmp_path / "topo.yaml"

    def groups(workers: int) -> list:
        topo_path.write_text(f"name: t\nrollout_workers: {workers}\nnodes: {{gateway: {{replicas: 1}}}}\n")
        conf = write_conf(load_topology(topo_path), topo_path, tmp_path / "supervisord.conf")
        options = ServerOptions()
        options.realize(args=["-c", str(conf)])
        return options.process_group_configs

    running = groups(2)
    for workers, expect_added, expect_removed in ((4, {"rollout-2", "rollout-3"}, set()),
                                                  (1, set(), {"rollout-1", "rollout-2", "rollout-3"})):
        supervisor = Supervisor(ServerOptions())
        supervisor.process_groups = {g.name: _Running(g) for g in running}
        supervisor.options.process_group_configs = groups(workers)
        added, changed, removed = supervisor.diff_to_active()
        assert {g.name for g in added} == expect_added, workers
        assert {g.name for g in removed} == expect_removed, workers
        assert changed == [], [g.name for g in changed]  # nobody restarted
        running = supervisor.options.process_group_configs


class _Running:
    """What diff_to_active reads of a running process group: its config."""

    def __init__(self, config):
        self.config = config


def test_write_conf_creates_the_log_folders_supervisord_needs(tmp_path):
    topo_path = tmp_path / "topo.yaml"
    topo_path.write_text("name: t\nlogging: {log_dir: out/logs}\n")
    out = write_conf(load_topology(topo_path), topo_path, tmp_path / "supervisord.conf")
    assert (tmp_path / "out" / "logs" / "supervisor").is_dir()
    assert "childlogdir=%(here)s/out/logs/supervisor" in out.read_text()


# -- run-end listener ---------------------------------------------------------------------------

EXITED = {"eventname": "PROCESS_STATE_EXITED"}


def _exited(program: str, expected: int) -> str:
    # A program per replica: supervisord names the group and the process alike.
    return f"processname:{program} groupname:{program} from_state:RUNNING expected:{expected} pid:4242"


@pytest.mark.parametrize("headers, payload, stop", [
    pytest.param(EXITED, _exited("trainer-0", 1), True, id="trainer-finished"),
    pytest.param(EXITED, _exited("trainer-0", 0), False, id="trainer-crashed"),
    pytest.param(EXITED, _exited("rollout-0", 1), False, id="other-program-exited"),
    pytest.param(EXITED, _exited("rollout-0", 0), False, id="other-program-crashed"),
    pytest.param({"eventname": "PROCESS_STATE_RUNNING"},
                 "processname:trainer-0 groupname:trainer-0 from_state:STARTING pid:4242", False, id="other-event"),
])
def test_run_end_stops_only_when_the_trainer_exits_as_expected(headers, payload, stop):
    assert should_stop(headers, payload, "trainer-0") is stop
