"""``areal-bus check-channel`` run for real (a subprocess, the shell's environment with and without the
key) against the stand-in upstream and a closed port; and the agent-side ``check_gateway``.

Every failure must be exactly one line, ``check-channel: <what failed>: <fix>``, with exit code 1.
The shipped ``configs/router.yaml`` is also run, as docs/gateway.md says, against a real gateway (the
standalone one, serving the shipped tiny policy).

Run: .venv/bin/pytest tests/test_check_channel.py -q
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from areal_bus.gateway_client import GatewayError, check_gateway, describe_http_error
from areal_bus.router import load_router_config
from areal_bus.config.topology import load_topology
from nodes.gateway.standalone import Child
from tests.test_router import KEY, KEY_ENV, StandIn, closed_port, router_yaml

pytestmark = pytest.mark.timeout(30)

CLI = str(Path(sys.executable).parent / "areal-bus")
REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "configs" / "router.yaml"


def check_channel(config: Path, model: str = "policy_model", key: str | None = KEY) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    if key is not None:
        env[KEY_ENV] = key
    p = subprocess.run([CLI, "check-channel", "--config", str(config), "--model", model, "--prompt", "Say hi"],
                       capture_output=True, text=True, env=env, timeout=20)
    return p.returncode, p.stdout, p.stderr


def one_failure_line(rc: int, out: str, err: str) -> str:
    assert rc == 1, (rc, out, err)
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, repr(err)
    assert err.startswith("check-channel: ")
    assert KEY not in err
    return err.strip()


@pytest.fixture
def upstream():
    server = StandIn().start()
    yield server
    server.stop()


@pytest.fixture
def config(tmp_path, upstream):
    def write(**kw) -> Path:
        path = tmp_path / "router.yaml"
        path.write_text(router_yaml(upstream.base_url, **kw))
        return path
    return write


def test_success_prints_the_reply(config):
    rc, out, err = check_channel(config())
    assert (rc, out, err) == (0, "hi from ok t=0.3 max=77\n", "")


def test_unset_key_variable(config):
    line = one_failure_line(*check_channel(config(), key=None))
    assert f"environment variable ${KEY_ENV} is not set in this shell: export {KEY_ENV}=<key>" in line


def test_literal_key_in_the_file(config):
    line = one_failure_line(*check_channel(config(key_ref=KEY)))
    assert "api_gateway.api_key: a literal API key is refused" in line and "${AREAL_BUS_API_KEY}" in line


def test_newline_in_the_key(config):
    line = one_failure_line(*check_channel(config(), key=KEY + "\n"))
    assert f"the key in ${KEY_ENV} ({len(KEY) + 1} chars) ends with a newline" in line


def test_wrong_key_is_401(config):
    line = one_failure_line(*check_channel(config(), key="sk-not-the-right-one"))
    assert "401 Invalid API key" in line and f"export {KEY_ENV}=" in line
    assert "sk-not-the-right-one" not in line


def test_unknown_model_id_is_404(config):
    line = one_failure_line(*check_channel(config(policy="missing")))
    assert "404 unknown model id 'missing'" in line and "model_routing.policy_model.model_id" in line


def test_body_without_choices_is_printed(config):
    line = one_failure_line(*check_channel(config(policy="nochoices")))
    assert "has no 'choices'" in line and '"message":"model overloaded, try later"' in line


def test_closed_port_names_host_port_and_the_gateway_log(tmp_path):
    port = closed_port()
    path = tmp_path / "router.yaml"
    path.write_text(router_yaml(f"http://127.0.0.1:{port}/v1"))
    line = one_failure_line(*check_channel(path))
    assert f"cannot reach 127.0.0.1:{port} (connection refused: nothing listens on that port)" in line
    assert f"api_gateway.base_url in {path}" in line
    assert "supervisorctl -c supervisord.conf status gateway-0" in line and "logs/supervisor/gateway-0.log" in line


# -- the shipped config against the shipped gateway -------------------------------------------------

def test_the_shipped_router_config_names_the_default_gateways_address_and_policy(monkeypatch):
    monkeypatch.setenv("AREAL_BUS_API_KEY", KEY)
    monkeypatch.delenv("AREAL_BUS_GATEWAY_PORT", raising=False)
    gw = load_topology(REPO / "topology" / "default.yaml").gateway_config()
    cfg = load_router_config(SHIPPED)
    assert cfg.api_gateway.base_url == f"http://127.0.0.1:{gw.port}/v1"
    assert cfg.model_routing.policy_model.model_id == gw.policy_model


@pytest.mark.timeout(180)
def test_the_shipped_router_config_gets_a_reply_from_a_real_gateway_with_the_readmes_key(tmp_path):
    """docs/gateway.md's check: the gateway's admin token exported as AREAL_BUS_API_KEY, then
    `areal-bus check-channel --config configs/router.yaml --model policy_model` (the gateway on a free
    port here, given as AREAL_BUS_GATEWAY_PORT): a reply from the policy, no 404."""
    token = secrets.token_hex(16)
    gateway = Child(["--port", "0"], token, output=tmp_path / "gateway.out")
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("AREAL_BUS_ADMIN_TOKEN", "AREAL_BUS_API_KEY")}
        env.update({"AREAL_BUS_API_KEY": token, "AREAL_BUS_GATEWAY_PORT": str(gateway.port)})
        p = subprocess.run([CLI, "check-channel", "--config", "configs/router.yaml", "--model", "policy_model",
                            "--prompt", "Guess my number (1-16) in 5 tries."], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
        assert (p.returncode, p.stderr) == (0, ""), (p.stdout, p.stderr)
        assert p.stdout.strip(), "no reply text"
        # The wrong key is named as such, not taken: the check really went through the gateway's keys.
        env["AREAL_BUS_API_KEY"] = "not-the-admin-token"
        p = subprocess.run([CLI, "check-channel", "--config", "configs/router.yaml", "--model", "policy_model"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 1 and "401" in p.stderr, p.stderr
    finally:
        assert gateway.stop() == 0, (tmp_path / "gateway.out").read_text()[-2000:]


# -- the agent side: check_gateway ----------------------------------------------------------------

def test_check_gateway_passes_on_an_openai_compatible_server(upstream):
    check_gateway(upstream.base_url, api_key=KEY)
    check_gateway(upstream.base_url)


def test_check_gateway_on_a_closed_port_says_nothing_listens():
    port = closed_port()
    with pytest.raises(GatewayError) as exc:
        check_gateway(f"http://127.0.0.1:{port}/v1", timeout=1.0)
    assert exc.value.kind == "unreachable"
    assert f"cannot reach 127.0.0.1:{port} (connection refused" in str(exc.value)
    assert "logs/supervisor/gateway-0.log" in str(exc.value) and "retry in a few seconds" in str(exc.value)


def test_check_gateway_on_a_port_held_by_another_http_server(upstream):
    upstream.models_reply = (404, {"detail": "Not Found"})
    with pytest.raises(GatewayError) as exc:
        check_gateway(upstream.base_url)
    assert exc.value.kind == "wrong_service"
    assert "answers, but not like an OpenAI-compatible gateway" in str(exc.value)
    assert f"ss -ltnp 'sport = :{upstream.port}'" in str(exc.value)


def test_check_gateway_on_a_port_held_by_something_that_is_not_http():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]

    def answer_garbage():
        conn, _ = srv.accept()  # the reachability probe
        conn.close()
        conn, _ = srv.accept()
        conn.recv(1024)
        conn.sendall(b"\x00\x01 not http at all\r\n\r\n")
        conn.close()

    t = threading.Thread(target=answer_garbage, daemon=True)
    t.start()
    try:
        with pytest.raises(GatewayError) as exc:
            check_gateway(f"http://127.0.0.1:{port}/v1", timeout=2.0)
        assert exc.value.kind == "wrong_service" and "does not speak HTTP" in str(exc.value)
    finally:
        t.join(5)
        srv.close()


def test_check_gateway_reports_a_gateway_still_loading_and_can_wait(upstream):
    upstream.models_reply = (503, {"error": "loading weights"})
    with pytest.raises(GatewayError) as exc:
        check_gateway(upstream.base_url, wait_s=0.6)
    assert exc.value.kind == "not_ready" and "not ready yet" in str(exc.value)
    # ready while it waits: returns
    timer = threading.Timer(0.3, lambda: setattr(upstream, "models_reply", (200, {"object": "list", "data": []})))
    timer.start()
    check_gateway(upstream.base_url, wait_s=5)
    timer.join()


def test_describe_http_error_is_one_line_with_the_body():
    text = describe_http_error(500, '<html>\n<body>Bad gateway</body>\n</html>', url="http://h:1/v1/chat/completions")
    assert "\n" not in text and "500 upstream error" in text and "<html> <body>Bad gateway</body> </html>" in text
