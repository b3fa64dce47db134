"""The ipc folder a run's sockets live in is its own: made owner-only (0700) when new, and one that
exists with another owner or with group/other write permission is refused, not used. Its default
name (/tmp/areal_bus-<hash of log_dir>) can be guessed, so another local user could make it first.

Run: .venv/bin/pytest tests/test_ipc_dir.py
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
import zmq

from areal_bus.wire.channels import open_socket
from areal_bus.runtime.node import NodeShell
from areal_bus.wire.security import IpcDirError
from areal_bus.config.topology import parse_topology

NOBODY = 65534


@pytest.fixture
def work():
    path = Path(tempfile.mkdtemp(prefix="abi-", dir="/tmp"))  # ipc paths must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _topo(work: Path, ipc_dir: Path | None):
    data = {"logging": {"log_dir": str(work / "logs")},
            "endpoints": {"transport": "ipc", **({"ipc_dir": str(ipc_dir)} if ipc_dir else {})}}
    return parse_topology(data, str(work / "topology.yaml"))


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_new_ipc_folder_is_made_owner_only_whatever_the_umask(work):
    topo = _topo(work, work / "ipc")
    old = os.umask(0)
    try:
        shell = NodeShell(topo, "probe", echo=False, base=work)
        shell.close()
    finally:
        os.umask(old)
    assert _mode(work / "ipc") == 0o700 and os.lstat(work / "ipc").st_uid == os.geteuid()


def test_a_world_writable_ipc_folder_is_refused_naming_it_and_the_fix(work):
    (work / "ipc").mkdir()
    os.chmod(work / "ipc", 0o777)
    with pytest.raises(IpcDirError) as err:
        NodeShell(_topo(work, work / "ipc"), "probe", echo=False, base=work)
    assert str(work / "ipc") in str(err.value) and "0777" in str(err.value) and "rm -r" in str(err.value)
    assert not list((work / "ipc").iterdir()), "a socket was made in the refused folder"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_an_ipc_folder_of_another_user_is_refused(work):
    (work / "ipc").mkdir(mode=0o700)
    os.chown(work / "ipc", NOBODY, NOBODY)
    with pytest.raises(IpcDirError) as err:
        NodeShell(_topo(work, work / "ipc"), "probe", echo=False, base=work)
    assert f"uid {NOBODY}" in str(err.value) and str(work / "ipc") in str(err.value)


def test_the_default_guessable_folder_made_by_someone_else_is_refused(work):
    topo = _topo(work, None)
    default = topo.ipc_dir(work)
    assert default.parent == Path("/tmp") and default.name.startswith("areal_bus-")
    default.mkdir(mode=0o700)
    try:
        os.chmod(default, 0o777)  # what another local user's `mkdir -m 777` leaves
        with pytest.raises(IpcDirError), zmq.Context() as ctx:
            open_socket(ctx, zmq.PUB, topo.endpoint("hub_in", 0, work), bind=True)
    finally:
        shutil.rmtree(default, ignore_errors=True)


def test_our_own_folder_that_others_may_only_read_is_tightened_to_0700(work):
    (work / "ipc").mkdir()
    os.chmod(work / "ipc", 0o755)  # nobody else could have written in it
    with zmq.Context() as ctx:
        open_socket(ctx, zmq.PUB, _topo(work, work / "ipc").endpoint("hub_in", 0, work), bind=True).close()
    assert _mode(work / "ipc") == 0o700


@pytest.mark.timeout(60)
def test_a_node_refuses_to_start_in_a_world_writable_folder(work):
    (work / "ipc").mkdir()
    os.chmod(work / "ipc", 0o777)
    path = work / "topology.yaml"
    path.write_text(yaml.safe_dump({"logging": {"log_dir": "logs"},
                                    "endpoints": {"transport": "ipc", "ipc_dir": str(work / "ipc")}}))
    res = subprocess.run([sys.executable, "-m", "areal_bus.launch.cli", "node", "bus", "--topology", str(path)],
                         cwd=work, capture_output=True, text=True, timeout=50)
    assert res.returncode != 0 and f"ipc folder {work / 'ipc'} has mode 0777" in res.stderr
    assert not list((work / "ipc").iterdir())
