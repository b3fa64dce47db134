"""Topology files: the shipped ones validate; a broken one gives ONE TopologyError whose message
names the file, the field path and what is allowed, and ``areal-bus validate`` exits 2 with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_bus.launch.cli import main
from areal_bus.config.topology import Topology, TopologyError, load_topology

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "topology").glob("*.yaml"))


@pytest.fixture
def write(tmp_path):
    """``write(yaml_text)`` -> path of a topology file holding it."""
    def _write(text: str, name: str = "topo.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path
    return _write


def _error(path: Path) -> str:
    with pytest.raises(TopologyError) as err:
        load_topology(path)
    return str(err.value)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_topologies_validate(path):
    assert isinstance(load_topology(path), Topology)


def test_default_topology_is_the_documented_one():
    topo = load_topology(ROOT / "topology" / "default.yaml")
    assert topo.is_async and topo.effective_staleness == topo.staleness_threshold
    assert topo.trigger_batch_size <= topo.global_batch_size <= topo.queue_max_size


def test_empty_file_gives_the_defaults(write):
    assert load_topology(write("")) == Topology()


def test_unknown_field_names_file_path_and_allowed_fields(write):
    msg = _error(write("stalenes_threshold: 2\n"))
    assert "topo.yaml" in msg
    assert "stalenes_threshold: unknown field" in msg
    assert "staleness_threshold" in msg.split("allowed here:")[1]


def test_unknown_nested_field_lists_the_fields_allowed_there(write):
    msg = _error(write("rollout_engine:\n  output_len: {mediam: 300}\n"))
    assert "rollout_engine.output_len.mediam: unknown field; allowed here: dist, max, median, min, sigma" in msg


def test_unknown_field_of_a_node_lists_the_node_fields(write):
    msg = _error(write("nodes:\n  trainer: {replica: 1}\n"))
    assert "nodes.trainer.replica: unknown field; allowed here: " in msg
    assert "replicas" in msg.split("allowed here:")[1]


def test_out_of_range_value_names_the_bound_and_the_value(write):
    msg = _error(write("staleness_threshold: 100\n"))
    assert "staleness_threshold" in msg and "less than or equal to 64" in msg and "(got 100)" in msg


def test_wrong_enum_value_lists_the_choices(write):
    msg = _error(write("endpoints: {transport: udp}\n"))
    assert "endpoints.transport" in msg and "'ipc' or 'tcp'" in msg and "(got 'udp')" in msg


def test_unknown_node_kind_lists_the_kinds(write):
    msg = _error(write("nodes: {gpu_worker: {}}\n"))
    assert "nodes.gpu_worker: unknown field; allowed here: " in msg
    assert {"trainer", "rollout", "gateway"} <= set(msg.split("allowed here: ")[1].split(", "))


def test_trigger_larger_than_global_batch_is_refused(write):
    msg = _error(write("trigger_batch_size: 64\nglobal_batch_size: 32\n"))
    assert "trigger_batch_size (64) must be <= global_batch_size (32)" in msg


def test_global_batch_larger_than_the_queue_is_refused(write):
    msg = _error(write("global_batch_size: 512\ntrigger_batch_size: 16\n"))
    assert "queue_max_size" in msg


@pytest.mark.parametrize("spec, bad, good, says", [
    ("async: {{enabled: false}}\nagent: {{group_size: 8}}\nnodes: {{agent: {{replicas: 3}}}}\nglobal_batch_size: {}\n",
     32, 48, ["global_batch_size (32)", "multiple of 3 x 8 (e.g. 48)", "agent-2"]),
    ("async: {{enabled: true}}\nagent: {{group_size: 8}}\nnodes: {{agent: {{replicas: 4}}}}\nstaleness_threshold: 1\n"
     "global_batch_size: 64\ntrigger_batch_size: {}\n", 8, 15, ["trigger_batch_size (8)", "would stall", "e.g. to 15"]),
], ids=["sync-batch", "async-trigger"])
def test_agents_whose_whole_groups_can_never_make_an_update_are_refused_with_a_setting_that_works(
        write, spec, bad, good, says):
    msg = _error(write(spec.format(bad)))
    assert all(s in msg for s in says), msg
    load_topology(write(spec.format(good), "fixed.yaml"))  # the setting the message names validates


def test_singleton_node_with_replicas_is_refused(write):
    msg = _error(write("nodes: {trainer: {replicas: 2}}\n"))
    assert "nodes.trainer.replicas must be 1" in msg


def test_every_problem_is_reported_in_one_error(write):
    path = write("staleness_threshold: -1\nlearning_rate: 0\nasync: {enable: true}\n")
    msg = _error(path)
    assert msg.startswith(f"{path}: invalid topology (3 problems)")
    for path in ("staleness_threshold", "learning_rate", "async.enable"):
        assert f"  {path}: " in msg


def test_yaml_syntax_error_names_the_file(write):
    path = write("name: [unclosed\n")
    msg = _error(path)
    assert msg.startswith(str(path)) and "not valid YAML" in msg


def test_a_list_instead_of_a_mapping_is_refused(write):
    assert "a topology is a YAML mapping" in _error(write("- name: x\n"))


def test_missing_file_is_a_topology_error(tmp_path):
    assert "cannot read topology" in _error(tmp_path / "nope.yaml")


def test_environment_variables_are_expanded(write, monkeypatch):
    monkeypatch.setenv("AREAL_TEST_RUN", "nightly")
    monkeypatch.setenv("AREAL_TEST_STALENESS", "3")
    topo = load_topology(write("name: run-${AREAL_TEST_RUN}\nstaleness_threshold: ${AREAL_TEST_STALENESS}\n"))
    assert topo.name == "run-nightly" and topo.staleness_threshold == 3


def test_environment_default_is_used_when_unset(write, monkeypatch):
    monkeypatch.delenv("AREAL_TEST_UNSET", raising=False)
    topo = load_topology(write("logging: {log_dir: '${AREAL_TEST_UNSET:-/tmp/areal-logs}'}\n"))
    assert topo.logging.log_dir == "/tmp/areal-logs"


def test_unset_environment_variable_names_the_field(write, monkeypatch):
    monkeypatch.delenv("AREAL_TEST_UNSET", raising=False)
    path = write("logging: {log_dir: '${AREAL_TEST_UNSET}/logs'}\n")
    msg = _error(path)
    assert msg.startswith(f"{path}: logging.log_dir: ")
    assert "${AREAL_TEST_UNSET} is not set" in msg


def test_expanded_value_is_validated_like_a_written_one(write, monkeypatch):
    monkeypatch.setenv("AREAL_TEST_STALENESS", "99")
    assert "staleness_threshold" in _error(write("staleness_threshold: ${AREAL_TEST_STALENESS}\n"))


# -- the CLI -------------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_validate_cli_exits_2_with_the_message_on_stderr(write):
    path = write("staleness_threshold: 100\n")
    proc = subprocess.run([sys.executable, "-m", "areal_bus.launch.cli", "validate", str(path)],
                          capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert str(path) in proc.stderr and "staleness_threshold" in proc.stderr and "(got 100)" in proc.stderr


def test_validate_cli_prints_the_resolved_topology(write, capsys):
    assert main(["validate", str(write("rollout_workers: 3\n"))]) == 0
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["rollout_workers"] == 3 and resolved["async"]["enabled"] is True


def test_validate_cli_on_a_missing_file_exits_2(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "not found" in capsys.readouterr().err


def test_trainer_device_defaults_to_the_models_and_a_gpu_trainer_needs_gpu_rollout(write):
    assert load_topology(write("model: {device: cuda}\n")).trainer_device == "cuda"
    assert load_topology(write("model: {device: 'cuda:0', trainer_device: 'cuda:1'}\n")).trainer_device == "cuda:1"
    msg = _error(write("model: {device: cpu, trainer_device: 'cuda:1'}\n"))
    assert "model.trainer_device" in msg and "CUDA IPC" in msg


def test_flash_varlen_decode_wants_a_half_precision_model_on_a_gpu(write):
    engines = "rollout_engine: {kind: torch, decode_attention: flash_varlen}\ntrainer_engine: {kind: torch}\n" \
              "agent: {framework: guess}\n"
    msg = _error(write(engines + "model: {device: cuda, dtype: float32}\n"))
    assert "decode_attention 'flash_varlen'" in msg and "bfloat16 or float16" in msg and "'float32'" in msg
    assert load_topology(write(engines + "model: {device: cuda, dtype: bfloat16}\n")).rollout_engine.decode_attention \
        == "flash_varlen"
    # the decode step's knobs act only on the torch engine's CUDA path: elsewhere they are refused, not ignored
    msg = _error(write(engines + "model: {device: cpu}\n"))
    assert "rollout_engine.decode_attention tune" in msg and "'cpu'" in msg
    sim = "rollout_engine: {kind: sim, decode_attention: flash_varlen, decode_compile: true}\n"
    assert "decode_attention and decode_compile" in _error(write(sim)) and "'sim'" in _error(write(sim))
    assert load_topology(write("rollout_engine: {kind: torch, decode_compile: true}\ntrainer_engine: {kind: torch}\n"
                               "agent: {framework: guess}\nmodel: {device: cuda}\n")).rollout_engine.decode_compile
    assert "'sdpa', 'matmul', 'flash_varlen' or 'flash_paged'" in _error(write("rollout_engine: {kind: torch, decode_attention: flash}\n"))
