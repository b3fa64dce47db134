"""``areal-bus validate`` checks every knob of a run, not only the topology's own fields: each node kind's
``nodes.<kind>.config`` against its schema (areal_bus/config/node_configs.py), the router YAML a gateway or a
judging reward node names, and the model folder the engines and the gateway load. Each problem is one
message on stderr naming the file, the field path and the fix, and the exit status is 2.

Paths are relative to the folder supervisord.conf is in, which is the cwd of `areal-bus validate` and
`render`: every test here runs in its own tmp_path.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from areal_bus.launch.cli import main
from areal_bus.config.topology import dump_resolved, load_topology, parse_topology

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny-guess"
KEY_ENV = "AREAL_TEST_VALIDATE_KEY"


def router_yaml(base_url: str, route: str = "judge_model") -> str:
    return (f"api_gateway:\n  base_url: {base_url}\n  api_key: ${{{KEY_ENV}}}\n"
            f"model_routing:\n  {route}: {{model_id: judge-model}}\n")


@pytest.fixture
def run_in(tmp_path, monkeypatch, capsys):
    """``run_in(topology_text, **files)`` -> (exit status, stderr) of `areal-bus validate topo.yaml`,
    run in tmp_path with ``files`` (name -> text) written there."""
    monkeypatch.chdir(tmp_path)

    def _run(text: str, command: str = "validate", **files: str) -> tuple[int, str]:
        for name, body in files.items():
            (tmp_path / name).write_text(body)
        (tmp_path / "topo.yaml").write_text(text)
        argv = [command, "topo.yaml"] + (["-o", "supervisord.conf"] if command == "render" else [])
        return main(argv), capsys.readouterr().err
    return _run


def _gateway_topology(config: str) -> str:
    return f"model: {{path: '{MODEL}'}}\nnodes:\n  gateway:\n    config: {config}\n"


def test_a_gateway_port_out_of_range_and_an_unknown_key_are_named_with_their_path(run_in):
    status, err = run_in(_gateway_topology("{port: -1, colour: blue, admin_token: a-good-token}"))
    assert status == 2
    assert "topo.yaml: invalid topology (2 problems)" in err
    assert "  nodes.gateway.config.port: Input should be greater than or equal to 0 (got -1)" in err
    allowed = err.split("nodes.gateway.config.colour: unknown field; allowed here: ")[1].splitlines()[0]
    assert {"port", "admin_token", "router_config", "max_sessions"} <= set(allowed.split(", "))


def test_a_padded_admin_token_is_refused_without_echoing_it(run_in):
    status, err = run_in(_gateway_topology("{admin_token: ' padded-token '}"))
    assert status == 2
    assert "nodes.gateway.config.admin_token: Value error, has leading or trailing whitespace" in err
    assert "padded-token" not in err


def test_an_unexpanded_admin_token_is_refused(run_in):
    status, err = run_in(_gateway_topology("{admin_token: 'tok${AREAL_TEST_UNCLOSED'}"))
    assert status == 2 and "nodes.gateway.config.admin_token: Value error, looks like an unexpanded ${VAR}" in err


def test_a_bad_reward_config_is_named_with_its_path(run_in):
    status, err = run_in("nodes:\n  reward:\n    config: {score_scale: 0, rubrik: x}\n")
    assert status == 2
    assert "nodes.reward.config.score_scale: Input should be greater than 0 (got 0)" in err
    assert "nodes.reward.config.rubrik: unknown field; allowed here: " in err and "rubric" in err


def test_a_reward_model_source_without_its_checkpoint_is_refused(run_in):
    status, err = run_in("agent: {reward_source: reward_model}\n")
    assert status == 2 and "agent.reward_source reward_model needs nodes.reward.config.model_path" in err


def test_a_node_kind_without_settings_refuses_any(run_in):
    status, err = run_in("nodes:\n  trainer:\n    config: {lr: 0.1}\n")
    assert status == 2 and "nodes.trainer.config.lr: unknown field; this node kind takes no config" in err


def test_a_bad_router_file_of_the_gateway_names_both_files_and_the_router_field(run_in, tmp_path):
    status, err = run_in(_gateway_topology("{admin_token: a-good-token, router_config: router.yaml}"),
                         **{"router.yaml": router_yaml("127.0.0.1:9000")})
    assert status == 2
    assert err.startswith("areal-bus: topo.yaml: files the run needs (1 problem)")
    assert (f"nodes.gateway.config.router_config: {tmp_path / 'router.yaml'}: invalid router config: "
            "api_gateway.base_url: Value error, must be an http(s) URL") in err


def test_a_missing_router_file_is_named(run_in, tmp_path):
    status, err = run_in(_gateway_topology("{admin_token: a-good-token, router_config: configs/nope.yaml}"))
    assert status == 2
    assert f"nodes.gateway.config.router_config: {tmp_path / 'configs' / 'nope.yaml'}: cannot read router config" in err


def test_a_judge_without_its_route_in_the_router_file_is_refused(run_in):
    router = router_yaml("http://127.0.0.1:9/v1", route="reward_model")
    status, err = run_in("agent: {reward_source: judge}\nnodes:\n  reward:\n    config: {router_config: r.yaml}\n",
                         **{"r.yaml": router})
    assert status == 2
    assert "nodes.reward.config.router_config: no route for judge_model: add model_routing.judge_model" in err
    assert "r.yaml" in err


def test_a_good_router_file_validates_and_an_unset_key_variable_is_named(run_in, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    status, err = run_in("agent: {reward_source: judge}\nnodes:\n  reward:\n    config: {router_config: r.yaml}\n",
                         **{"r.yaml": router_yaml("http://127.0.0.1:9/v1")})
    assert status == 0
    assert f"${KEY_ENV} is not set in this shell" in err and f"export {KEY_ENV}=<key>" in err


def test_a_missing_model_folder_names_the_field_the_resolved_path_and_the_fix(run_in, tmp_path):
    text = ("model: {path: models/nope}\nrollout_engine: {kind: torch}\ntrainer_engine: {kind: torch}\n"
            "agent: {framework: guess}\n")
    status, err = run_in(text)
    assert status == 2
    assert f"model.path: no model at {tmp_path / 'models' / 'nope'} (no such folder)" in err
    assert "`python scripts/warmstart.py --out models/nope`" in err


def test_a_model_folder_without_config_json_is_refused(run_in, tmp_path):
    (tmp_path / "empty").mkdir()
    status, err = run_in(_gateway_topology("{admin_token: a-good-token}").replace(str(MODEL), "empty"))
    assert status == 2 and f"model.path: no model at {tmp_path / 'empty'} (no config.json in it)" in err


def test_an_architecture_the_torch_engine_cannot_run_is_refused_naming_what_would_run_it(run_in, tmp_path):
    import transformers

    gemma = transformers.Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    transformers.Gemma2ForCausalLM(gemma).save_pretrained(tmp_path / "gemma")
    text = ("model: {path: gemma}\nrollout_engine: {kind: torch}\ntrainer_engine: {kind: torch, eval_interval: 5}\n"
            "agent: {framework: guess}\n")
    status, err = run_in(text)
    assert status == 2 and "model_type 'gemma2' not supported" in err, err
    assert "rollout_engine.kind 'torch' and trainer_engine.eval_interval > 0" in err and "'vllm'" in err


def test_render_refuses_a_missing_model_folder_and_writes_no_conf(run_in, tmp_path):
    status, err = run_in("model: {path: nope}\nrollout_engine: {kind: torch}\ntrainer_engine: {kind: torch}\n"
                         "agent: {framework: guess}\n", command="render")
    assert status == 2 and "model.path: no model at" in err
    assert not (tmp_path / "supervisord.conf").exists()


def test_the_sim_engines_need_no_model_folder(run_in):
    assert run_in("model: {path: nowhere}\n")[0] == 0


IMPORTED = "models/smollm2-135m-instruct"
"""Where the SmolLM2 topologies expect `areal-bus import-model smollm2`'s folder (git-ignored)."""


@pytest.mark.parametrize("path", sorted((ROOT / "topology").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_topologies_pass_validate_with_their_files(path, monkeypatch, tmp_path, request):
    monkeypatch.chdir(ROOT)
    doc = yaml.safe_load(path.read_text())
    if doc.get("model", {}).get("path") == IMPORTED and not (ROOT / IMPORTED / "config.json").exists():
        # The model a user imports first: validated against the tests' converted copy, everything else
        # (the dataset under data/) as shipped.
        doc["model"]["path"] = str(request.getfixturevalue("smollm2_dir"))
        for key in ("path", "eval_path"):
            if doc.get("agent", {}).get("dataset", {}).get(key):
                doc["agent"]["dataset"][key] = str(ROOT / doc["agent"]["dataset"][key])
        copy = tmp_path / path.name
        copy.write_text(yaml.safe_dump(doc))
        assert main(["validate", str(copy)]) == 0
        return
    assert main(["validate", str(path.relative_to(ROOT))]) == 0


def test_the_gateway_config_is_typed_and_its_context_is_the_engines_max_len():
    topo = parse_topology({"rollout_engine": {"max_len": 300}, "nodes": {"gateway": {"config": {"port": 9100}}}})
    cfg = topo.gateway_config()
    assert (cfg.port, cfg.max_context_tokens, cfg.admin_token) == (9100, 300, None)
    assert cfg.base_url == "http://127.0.0.1:9100"


def test_a_resolved_dump_reads_back_to_the_same_nodes():
    topo = load_topology(ROOT / "topology" / "default.yaml")
    again = parse_topology(dump_resolved(topo))
    assert again == topo
    assert again.replicas("gateway") == 1 and again.replicas("probe") == 0


def test_checking_a_sim_topologys_files_does_not_import_torch(tmp_path):
    # A node starts by checking its topology's files; with the sim rollout engine the decoder check does
    # not apply, and importing torch for it cost ~1.8 s on 2 cores: a rollout worker restarted under its
    # name then missed the peers' 2 s liveness window (tests/test_gateway_restart.py).
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({
        "model": {"path": str(MODEL)},
        "rollout_engine": {"kind": "sim"}, "trainer_engine": {"kind": "sim"},
        # the gateway needs the model (its tokenizer), so the model's files are checked
        "nodes": {"bus": {}, "trainer": {}, "gateway": {"config": {"admin_token": "validate-test-admin-token"}}}}))
    code = ("import sys\nfrom areal_bus.launch.cli import _load\n_load(sys.argv[1])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t.yaml")], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
