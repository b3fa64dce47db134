"""No secret in any file the project writes: the gateway's admin token and the session keys it issues
appear nowhere in a run's folder (logs, resolved-config dumps, the rendered supervisord.conf, the ipc
folder), and `areal-bus validate` does not print the token either.

The whole-run test runs every node of the default topology (bus, gateway, agent, two rollout workers,
reward, trainer, weights) on the simulated engines, with the shipped model's tokenizer for the
gateway, and drives sessions through the gateway's HTTP API as an orchestrator does, so it knows the
keys it was issued. (An agent that plays through the gateway needs the torch engines, minutes on two
cores; sessions are the gateway's either way.)

Run: .venv/bin/pytest tests/test_secrets.py      (the whole run: about a minute)
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from areal_bus.config.topology import NODE_KINDS, dump_resolved, parse_topology
from tests.test_system import ENV, System, wait_until

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "tiny-guess"
TOKEN = "secret-admin-token-4f1c9a7e2b"
SESSION_KEY = re.compile(rb"sess-[0-9a-f]{20}\.[A-Za-z0-9_-]{43,}")  # the secret, then its HMAC tag
"""Any key the gateway issues (sessions.SessionStore.create: the session id, a dot, 32 random bytes):
any key is found by its shape, the ones the test opened by their value too."""

SESSIONS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gateway_topology(port: int = 9000, token: str = TOKEN) -> dict:
    return {"model": {"path": str(MODEL)},
            "nodes": {"bus": {}, "gateway": {"config": {"port": port, "admin_token": token}},
                      "agent": {"replicas": 1}, "reward": {"replicas": 1}, "trainer": {}, "weights": {}}}


def _post(url: str, token: str, body: dict | None = None, patience_s: float = 60.0) -> tuple[int, dict]:
    """POST as an orchestrator does: a 429 (the agent's episodes hold the admission budget until the
    trainer consumes them) is waited out for its Retry-After, as the openai and anthropic SDKs do."""
    deadline = time.monotonic() + patience_s
    while True:
        req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            if err.code != 429 or time.monotonic() > deadline:
                raise
            time.sleep(float(err.headers.get("Retry-After") or 1.0))


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _files_holding(folder: Path, needles: list[bytes]) -> dict[str, list[str]]:
    """{file: what it holds} for every file under ``folder`` holding a needle or a session key."""
    found = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()):
        if path.suffix == ".sock":
            continue
        data = path.read_bytes()
        hits = [n.decode() for n in needles if n in data] + [k.decode() for k in SESSION_KEY.findall(data)]
        if hits:
            found[str(path.relative_to(folder))] = hits
    return found


def test_the_resolved_dump_redacts_the_admin_token_and_reads_back_without_it(tmp_path):
    topo = parse_topology(_gateway_topology(), str(tmp_path / "t.yaml"))
    assert topo.gateway_config().admin_token == TOKEN  # the nodes that use it still get it
    dump = dump_resolved(topo)
    assert TOKEN not in json.dumps(dump)
    assert dump["nodes"]["gateway"]["config"]["admin_token"] == "<redacted>"  # set, and not shown
    # Read back (the trainer's other ranks do), the token is unset: a gateway from a dump refuses to
    # start, rather than accept the marker as its token.
    assert parse_topology(dump, "dump").gateway_config().admin_token is None


@pytest.mark.timeout(60)
def test_validate_prints_the_resolved_config_without_the_token(tmp_path):
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(_gateway_topology()))
    res = subprocess.run([sys.executable, "-m", "areal_bus.launch.cli", "validate", str(path)], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=50)
    assert res.returncode == 0, res.stderr
    assert '"admin_token": "<redacted>"' in res.stdout and TOKEN not in res.stdout + res.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_whole_gateway_run_writes_neither_the_admin_token_nor_a_session_key(monkeypatch):
    if not (MODEL / "config.json").exists():
        pytest.fail(f"{MODEL} missing: it ships with the repo")
    port = _free_port()
    # As topology/default.yaml and scripts/run_default.sh do: the token comes from the environment of
    # the shell that starts the run, so the topology file in the run's folder does not hold it either.
    monkeypatch.setenv("AREAL_BUS_ADMIN_TOKEN", TOKEN)
    monkeypatch.setitem(ENV, "AREAL_BUS_ADMIN_TOKEN", TOKEN)
    system = System({**_gateway_topology(port, "${AREAL_BUS_ADMIN_TOKEN}"), "max_steps": 1_000_000})
    keys = []
    try:
        system.start()
        wait_until(lambda: _healthy(port), 90, "the gateway to listen")
        for _ in range(SESSIONS):  # as an orchestrator does: open, two turns with the key, end
            status, body = _post(f"http://127.0.0.1:{port}/rl/sessions", TOKEN, {"meta": {"task": "probe"}})
            assert status == 201 and SESSION_KEY.fullmatch(body["api_key"].encode()), body
            keys.append(body["api_key"])
            for turn in ("guess", "higher"):
                status, _ = _post(f"http://127.0.0.1:{port}/v1/chat/completions", keys[-1],
                                  {"model": body["model"], "messages": [{"role": "user", "content": turn}],
                                   "max_tokens": 4})
                assert status == 200
            status, _ = _post(f"http://127.0.0.1:{port}/rl/sessions/{body['session_id']}/end", TOKEN,
                              {"reward": 1.0})
            assert status == 200
        wait_until(lambda: len(system.train_steps()) >= 4, 60, "4 updates")
        system.stop()  # as `supervisorctl shutdown`: every node writes what it writes on the way out
        assert system.proc.returncode == 0, system.tail("supervisord.log")
        resolved = sorted(p.name for p in (system.logs / "resolved").glob("*.json"))
        # Every node dumped its resolved config (8 files: the 8 that held the token before the fix).
        assert len(resolved) == sum(system.topo.replicas(k) for k in NODE_KINDS) == 8, resolved
        # The run's folder holds the logs, the resolved dumps, the rendered conf and the ipc folder.
        assert (system.dir / "supervisord.conf").exists() and (system.dir / "ipc").is_dir()
        needles = [TOKEN.encode()] + [k.encode() for key in keys for k in (key, key.rpartition(".")[2])]
        leaks = _files_holding(system.dir, needles)
        assert not leaks, f"secrets written in {len(leaks)} files: {leaks}"
    finally:
        system.cleanup()
