"""Authentication on the bus: tcp between hosts uses ZeroMQ CURVE with the cluster keypair that
``areal-bus keys`` makes. A peer holding the key is served; a peer with no key, an unknown key or
another cluster's key is refused before any of its messages reaches a node, and the refusing node
counts (``auth.refused_key`` / ``auth.refused_handshake``) and logs it. Real sockets on loopback tcp,
real node processes.

Run: .venv/bin/pytest tests/test_curve.py
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
import zmq

from areal_bus.wire import messages as m
from areal_bus.wire.channels import open_socket
from areal_bus.launch.cli import main as cli_main
from areal_bus.wire.codec import Encoder, decode, pack_topic
from areal_bus.runtime.metrics import Metrics
from areal_bus.wire.security import CurveKeyError, bus_context, load_keys, make_keys, secure
from areal_bus.config.topology import TopologyError, load_topology, parse_topology

ROOT = Path(__file__).resolve().parent.parent


def free_base_port(offsets=(0, 1), tries: int = 50) -> int:
    """A base port whose ``base + offset`` ports are all free on loopback now (other tests and other
    runs share the machine, so a fixed port would collide sooner or later)."""
    for _ in range(tries):
        base = random.randrange(20000, 50000)
        held = []
        try:
            for off in offsets:
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", base + off))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise AssertionError("no free port range on loopback")


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return got


@pytest.fixture
def key_dir(ipc_dir):
    """The test's folder for keys, logs and ipc sockets (conftest's: short, under /tmp, removed after)."""
    return ipc_dir


@pytest.fixture
def keys(key_dir):
    _, secret = make_keys(key_dir / "keys")
    return load_keys(secret)


@pytest.fixture
def server(keys, log):
    """A CURVE PULL server on a random loopback port: ``(socket, endpoint, metrics)``."""
    metrics = Metrics()
    ctx = bus_context(keys, metrics, log)
    pull = open_socket(ctx, zmq.PULL, "tcp://127.0.0.1:0", bind=True)
    yield pull, pull.getsockopt(zmq.LAST_ENDPOINT).decode(), metrics
    ctx.destroy(linger=0)


@pytest.fixture
def stranger():
    """A context for peers that do not hold the cluster key. Its sockets linger 0: one that the test
    drops is closed by the garbage collector before destroy() could set it, and a message that can
    never be delivered would otherwise hold term() forever."""
    ctx = zmq.Context()
    ctx.linger = 0
    yield ctx
    ctx.destroy(linger=0)


def _assert_refused(pull, metrics, log, counter: str):
    wait_for(lambda: metrics.counters.get(counter, 0) >= 1, 10, f"{counter} to be counted")
    assert not pull.poll(500, zmq.POLLIN), "a refused peer's message was delivered"
    refusals = [f for level, event, f in log.records if event == "connection_refused"]
    assert refusals and refusals[0]["reason"] == counter.rsplit("_", 1)[1]


# -- keys -------------------------------------------------------------------------------------------

def test_keys_command_writes_a_keypair_only_its_owner_can_read(key_dir, capsys):
    out = key_dir / "keys"
    assert cli_main(["keys", "--out", str(out)]) == 0
    secret, public = out / "cluster.key_secret", out / "cluster.key"
    assert secret.stat().st_mode & 0o777 == 0o600
    assert out.stat().st_mode & 0o077 == 0  # the folder too
    assert "secret-key" not in public.read_text()
    keys = load_keys(secret)
    assert len(keys.public) == len(keys.secret) == 40
    assert zmq.auth.load_certificate(public) == (keys.public, None)
    assert keys.secret.decode() not in repr(keys)
    printed = capsys.readouterr().out
    assert f"curve: {{key: {secret}}}" in printed and "every host" in printed


def test_keys_command_refuses_to_replace_the_clusters_keys(key_dir, capsys):
    out = key_dir / "keys"
    assert cli_main(["keys", "--out", str(out)]) == 0
    before = (out / "cluster.key_secret").read_bytes()
    assert cli_main(["keys", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert (out / "cluster.key_secret").read_bytes() == before
    assert cli_main(["keys", "--out", str(out), "--force"]) == 0
    assert (out / "cluster.key_secret").read_bytes() != before


def test_a_secret_key_readable_by_others_is_refused_with_the_fix(key_dir):
    _, secret = make_keys(key_dir / "keys")
    secret.chmod(0o644)
    with pytest.raises(CurveKeyError, match=r"readable by other users \(mode 644\); run `chmod 600 "):
        load_keys(secret)


def test_the_public_file_or_a_missing_file_is_refused_as_the_node_key(key_dir):
    public, _ = make_keys(key_dir / "keys")
    public.chmod(0o600)
    with pytest.raises(CurveKeyError, match="public key only; endpoints.curve.key names the .key_secret file"):
        load_keys(public)
    with pytest.raises(CurveKeyError, match="no such key file .*areal-bus keys --out"):
        load_keys(key_dir / "nope" / "cluster.key_secret")


# -- topology ---------------------------------------------------------------------------------------

def test_tcp_beyond_loopback_without_curve_is_refused_naming_the_fix():
    with pytest.raises(TopologyError) as err:
        parse_topology({"endpoints": {"transport": "tcp", "host": "10.1.2.3"}}, "t.yaml")
    msg = str(err.value)
    assert msg.startswith("t.yaml: invalid topology")
    assert "endpoints.host 10.1.2.3 is not a loopback address" in msg
    assert "areal-bus keys --out keys" in msg and "endpoints.curve.key" in msg and "allow_insecure" in msg
    with pytest.raises(TopologyError, match="nodes.trainer.host 10.1.2.4 is not a loopback address"):
        parse_topology({"endpoints": {"transport": "tcp"}, "nodes": {"trainer": {"host": "10.1.2.4"}}})


@pytest.mark.parametrize("endpoints", [
    {"transport": "tcp"},                                                  # loopback
    {"transport": "tcp", "host": "10.1.2.3", "curve": {"key": "keys/cluster.key_secret"}},
    {"transport": "tcp", "host": "10.1.2.3", "allow_insecure": True},
    {"transport": "ipc"},
])
def test_loopback_curve_or_an_explicit_opt_out_is_accepted(endpoints):
    parse_topology({"endpoints": endpoints})


def test_channels_live_at_the_host_of_the_kind_that_binds_them():
    topo = parse_topology({"endpoints": {"transport": "tcp", "host": "10.0.0.1", "base_port": 30000,
                                         "curve": {"key": "k"}},
                           "nodes": {"trainer": {"host": "10.0.0.2"}, "bus": {}}})
    assert topo.endpoint("train") == "tcp://10.0.0.2:30300"
    assert topo.endpoint("hub_in") == "tcp://10.0.0.1:30000"
    assert topo.endpoint("work", 1) == "tcp://10.0.0.1:30101"


# -- sockets ----------------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_peer_holding_the_cluster_key_is_served(server, keys, log):
    pull, ep, metrics = server
    cctx = bus_context(keys, Metrics(), log)
    try:
        push = open_socket(cctx, zmq.PUSH, ep, bind=False)
        push.send(b"hello")
        assert pull.poll(5000, zmq.POLLIN)
        assert pull.recv() == b"hello"
    finally:
        cctx.destroy(linger=0)
    assert not any(k.startswith("auth.") for k in metrics.counters)


@pytest.mark.timeout(30)
def test_peer_without_curve_is_refused_and_counted(server, stranger, log):
    pull, ep, metrics = server
    push = stranger.socket(zmq.PUSH)
    push.connect(ep)
    push.send(b"let me in", zmq.NOBLOCK)  # queued: delivered if the connection were ever accepted
    _assert_refused(pull, metrics, log, "auth.refused_handshake")


@pytest.mark.timeout(30)
def test_peer_with_an_unknown_key_is_refused_by_zap_and_counted(server, stranger, keys, log):
    pull, ep, metrics = server
    push = stranger.socket(zmq.PUSH)
    push.curve_publickey, push.curve_secretkey = zmq.curve_keypair()
    push.curve_serverkey = keys.public  # public keys are public: knowing it is not enough
    push.connect(ep)
    push.send(b"let me in", zmq.NOBLOCK)
    _assert_refused(pull, metrics, log, "auth.refused_key")


@pytest.mark.timeout(30)
def test_peer_of_another_cluster_is_refused_and_counted(server, key_dir, log):
    pull, ep, metrics = server
    _, other_secret = make_keys(key_dir / "other")
    octx = bus_context(load_keys(other_secret), Metrics(), log)
    try:
        push = octx.socket(zmq.PUSH)
        push.linger = 0
        secure(octx, push, bind=False)
        push.connect(ep)
        push.send(b"let me in", zmq.NOBLOCK)
        _assert_refused(pull, metrics, log, "auth.refused_handshake")
    finally:
        octx.destroy(linger=0)


@pytest.mark.timeout(30)
def test_pub_sub_over_curve_through_open_socket(keys, log):
    sctx, cctx = bus_context(keys, Metrics(), log), bus_context(keys, Metrics(), log)
    try:
        pub = open_socket(sctx, zmq.PUB, "tcp://127.0.0.1:0", bind=True)
        sub = open_socket(cctx, zmq.SUB, pub.getsockopt(zmq.LAST_ENDPOINT).decode(), bind=False,
                          subscribe=(m.TOPIC_EVENT,))
        enc, msg = Encoder("t"), m.Event(name="hello", node_id="t", fields={})
        # PUB drops until the subscription has arrived: publish until it is seen.
        def seen():
            pub.send_multipart(pack_topic(m.TOPIC_EVENT, enc.encode(msg)))
            return sub.poll(100, zmq.POLLIN)
        wait_for(seen, 10, "the subscriber to receive over CURVE")
        assert decode(sub.recv_multipart()[1:])[1] == msg
    finally:
        cctx.destroy(linger=0)
        sctx.destroy(linger=0)


# -- nodes ------------------------------------------------------------------------------------------

def _write_topology(work: Path, endpoints: dict) -> Path:
    path = work / "topology.yaml"
    path.write_text(yaml.safe_dump({"endpoints": endpoints, "logging": {"log_dir": str(work / "logs")}}))
    return path


@pytest.mark.timeout(60)
def test_node_whose_key_file_is_missing_exits_with_one_line_naming_it(key_dir):
    path = _write_topology(key_dir, {"transport": "tcp", "base_port": free_base_port(),
                                     "curve": {"key": str(key_dir / "absent.key_secret")}})
    res = subprocess.run([sys.executable, "-m", "areal_bus.launch.cli", "node", "bus", "--topology", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith(f"areal-bus: {key_dir / 'absent.key_secret'}: no such key")
    assert "Traceback" not in res.stderr


@pytest.mark.timeout(90)
def test_bus_node_over_curve_serves_the_cluster_and_counts_strangers(key_dir, keys, stranger, log):
    path = _write_topology(key_dir, {"transport": "tcp", "base_port": free_base_port(),
                                     "curve": {"key": str(key_dir / "keys" / "cluster.key_secret")}})
    topo = load_topology(path)
    with open(key_dir / "bus.out", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "areal_bus.launch.cli", "node", "bus", "--topology", str(path)],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    ctx = bus_context(keys, Metrics(), log)
    try:
        sub = open_socket(ctx, zmq.SUB, topo.endpoint("hub_out"), bind=False,
                          subscribe=(m.TOPIC_HEARTBEAT, m.TOPIC_VERSION))
        # A stranger publishes a version announcement into the hub: the bus must never forward it.
        evil = stranger.socket(zmq.PUB)
        evil.connect(topo.endpoint("hub_in"))
        fake = Encoder("weights-0").encode(m.VersionAnnounce(version=99, location="", nbytes=0, published_at=0.0))
        deadline, refused = time.monotonic() + 45, 0
        while time.monotonic() < deadline and refused < 1:
            evil.send_multipart(pack_topic(m.TOPIC_VERSION, fake))
            if not sub.poll(200, zmq.POLLIN):
                continue
            frames = sub.recv_multipart()
            assert frames[0] != m.TOPIC_VERSION, "the bus forwarded a stranger's message"
            _, hb = decode(frames[1:])
            if hb.node_id == "bus-0":  # the bus's own heartbeat reached us over CURVE
                refused = hb.counters.get("auth.refused_handshake", 0)
        assert proc.poll() is None, (key_dir / "bus.out").read_text()
        assert refused >= 1, "the bus's heartbeat never counted the stranger"
        logged = (key_dir / "logs" / "bus.log").read_text()
        assert "connection_refused reason=handshake" in logged
    finally:
        ctx.destroy(linger=0)
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait(timeout=10)
    assert rc == 0, (key_dir / "bus.out").read_text()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_system_runs_to_the_end_over_tcp_with_curve(key_dir):
    from tests.test_system import System

    base = free_base_port(offsets=(0, 1, 100, 200, 300, 400, 500))
    _, secret = make_keys(key_dir / "keys")
    system = System({"endpoints": {"transport": "tcp", "host": "127.0.0.1", "base_port": base,
                                   "curve": {"key": str(secret)}}})
    try:
        system.start()
        rc = system.proc.wait(120)
        assert rc == 0, system.tail("supervisord.log")
        assert len(system.train_steps()) == system.topo.max_steps
        assert not system.tracebacks()
    finally:
        system.cleanup()
