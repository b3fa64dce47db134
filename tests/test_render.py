"""Rendering a topology to supervisord.conf, and the run-end listener's decision.

The first test is what keeps the checked-in supervisord.conf in sync with topology/default.yaml: after
editing the topology, run `areal-bus render topology/default.yaml` and commit both.

Run: .venv/bin/pytest tests/test_render.py
"""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

from areal_bus.render import render, write_conf
from areal_bus.runend import should_stop
from areal_bus.topology import load_topology, parse_topology

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


def test_rollout_workers_set_the_rollout_numprocs(tmp_path):
    programs = _programs(_render({"rollout_workers": 8}, tmp_path))
    assert programs["rollout"]["numprocs"] == "8"
    assert "--replica %(process_num)d" in programs["rollout"]["command"]
    assert programs["rollout"]["process_name"] == "%(program_name)s-%(process_num)d"
    assert programs["trainer"]["numprocs"] == "1"


def test_kind_with_zero_replicas_is_left_out(tmp_path):
    programs = _programs(_render({"rollout_workers": 0, "nodes": {"reward": {"replicas": 0}}}, tmp_path))
    assert "reward" not in programs
    assert "rollout" not in programs
    assert "probe" not in programs  # probe defaults to 0 replicas
    assert {"bus", "trainer", "weights", "agent"} <= set(programs)


def test_every_program_restarts_only_on_unexpected_exit_and_stops_as_a_group(tmp_path):
    programs = _programs(_render({"nodes": {"probe": {"replicas": 1}}}, tmp_path))
    assert set(programs) == {"bus", "agent", "rollout", "reward", "trainer", "weights", "probe"}
    for name, prog in programs.items():
        assert prog["autorestart"] == "unexpected", name
        assert prog["exitcodes"] == "0", name
        assert prog["stopasgroup"] == "true", name
        assert prog["killasgroup"] == "true", name
        assert prog["command"].startswith(f"areal-bus node {name} --topology %(here)s/topo.yaml"), name


def test_run_end_listener_is_rendered(tmp_path):
    conf = _render({}, tmp_path)
    listener = conf["eventlistener:run_end"]
    assert listener["command"] == "areal-bus run-end --program trainer"
    assert listener["events"] == "PROCESS_STATE_EXITED"
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


def test_write_conf_creates_the_log_folders_supervisord_needs(tmp_path):
    topo_path = tmp_path / "topo.yaml"
    topo_path.write_text("name: t\nlogging: {log_dir: out/logs}\n")
    out = write_conf(load_topology(topo_path), topo_path, tmp_path / "supervisord.conf")
    assert (tmp_path / "out" / "logs" / "supervisor").is_dir()
    assert "childlogdir=%(here)s/out/logs/supervisor" in out.read_text()


# -- run-end listener ---------------------------------------------------------------------------

EXITED = {"eventname": "PROCESS_STATE_EXITED"}


def _exited(group: str, expected: int) -> str:
    return f"processname:{group}-0 groupname:{group} from_state:RUNNING expected:{expected} pid:4242"


@pytest.mark.parametrize("headers, payload, stop", [
    pytest.param(EXITED, _exited("trainer", 1), True, id="trainer-finished"),
    pytest.param(EXITED, _exited("trainer", 0), False, id="trainer-crashed"),
    pytest.param(EXITED, _exited("rollout", 1), False, id="other-program-exited"),
    pytest.param(EXITED, _exited("rollout", 0), False, id="other-program-crashed"),
    pytest.param({"eventname": "PROCESS_STATE_RUNNING"},
                 "processname:trainer-0 groupname:trainer from_state:STARTING pid:4242", False, id="other-event"),
])
def test_run_end_stops_only_when_the_trainer_exits_as_expected(headers, payload, stop):
    assert should_stop(headers, payload, "trainer") is stop
