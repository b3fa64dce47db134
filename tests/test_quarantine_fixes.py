"""Issue 17's small fixes: a node whose log lines cannot be written says so in its heartbeat.

The log file is a link to /dev/full, where every write fails with ENOSPC, as on a full disk.

Run: .venv/bin/python -m pytest -q tests/test_quarantine_fixes.py
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import structlog

from areal_bus.runtime.node import NodeShell
from areal_bus.config.topology import parse_topology


@pytest.fixture
def work():
    path = Path(tempfile.mkdtemp(prefix="abq-", dir="/tmp"))  # ipc paths must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(60)
def test_the_heartbeat_reports_the_log_lines_its_node_could_not_write(work):
    (work / "logs").mkdir()
    (work / "logs" / "probe.log").symlink_to("/dev/full")
    topo = parse_topology({"logging": {"log_dir": str(work / "logs")},
                           "endpoints": {"transport": "ipc", "ipc_dir": str(work / "ipc")}}, str(work / "t.yaml"))
    shell = NodeShell(topo, "probe", echo=False, base=work)
    try:
        before = shell.heartbeat().counters["log.failures"]
        for i in range(5):
            shell.log.info("something", i=i)
        assert shell.heartbeat().counters["log.failures"] == before + 5
    finally:
        shell.close()
        structlog.reset_defaults()
