"""Version announcements are followed only as the trainer's own RunState vouches for them: from a weights
node, of the lineage the newest RunState names (an identity, not a string order), at most one version
ahead of it. A forged or garbled one is refused, counted and logged; a restarted trainer's new lineage
(at a lower version) is still followed.

VersionTrust is driven directly first; then a real bus process carries announcements from a weights
publisher and a stranger to a rollout worker's shell and core (sim engine), as in a run.

    .venv/bin/python -m pytest tests/test_version_trust.py -q
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zmq

from areal_bus.wire import messages as m
from areal_bus.wire.channels import open_socket
from areal_bus.wire.codec import Encoder, pack_topic
from areal_bus.constants import LINEAGE_WAIT_S
from areal_bus.engines.sim import SimRolloutEngine
from areal_bus.runtime.node import NodeShell
from areal_bus.config.topology import SimRolloutEngineConfig, load_topology
from areal_bus.version import PolicyVersion, VersionTrust
from nodes.rollout.core import RolloutCore, StepLog

ROOT = Path(__file__).resolve().parent.parent
L1, L2 = "00000000001700000000-aaaaaaaaaaaa", "00000000001800000000-bbbbbbbbbbbb"


def ann(version: int, lineage: str = L1) -> m.VersionAnnounce:
    return m.VersionAnnounce(version=version, location="", nbytes=0, published_at=0.0, lineage=lineage)


def state(version: int, lineage: str = L1) -> m.RunState:
    return m.RunState(version=version, max_steps=100, finished=False, consumed=0, lineage=lineage)


# -- VersionTrust on its own ----------------------------------------------------------------------

def test_an_announcement_from_a_node_other_than_the_weights_node_is_refused():
    trust = VersionTrust()
    trust.on_run_state(state(3), 0.0)
    assert trust.judge(ann(3), "agent-0", 0.0) == "not_weights_node"
    assert trust.judge(ann(3), "weights", 0.0) == "not_weights_node"
    assert trust.judge(ann(3), "weights-0", 0.0) == ""


def test_an_announcement_more_than_one_version_ahead_of_the_run_state_is_refused():
    trust = VersionTrust()
    trust.on_run_state(state(3), 0.0)
    assert trust.judge(ann(4), "weights-0", 0.0) == ""  # exported just before the RunState saying 4
    assert trust.judge(ann(5), "weights-0", 0.0) == "ahead"
    assert trust.judge(ann(2**31 - 1), "weights-0", 0.0) == "ahead"


def test_a_lineage_that_compares_higher_as_a_string_is_nobodys_and_is_refused_in_time():
    trust = VersionTrust()
    trust.on_run_state(state(3), 0.0)
    forged = ann(3, lineage="~" + L1)  # above every real lineage as a string
    assert PolicyVersion.of(forged) > PolicyVersion(L1, 3)
    assert trust.judge(forged, "weights-0", 1.0) == "held"  # could be a restarted trainer's, until a RunState says
    assert trust.on_run_state(state(3), 2.0) == ([], [])
    released, refused = trust.on_run_state(state(3), 1.0 + LINEAGE_WAIT_S)
    assert released == [] and [why for why, _ in refused] == ["unknown_lineage"]
    assert trust.on_run_state(state(3), 100.0) == ([], [])  # refused once, never adopted


def test_a_restarted_trainers_new_lineage_at_a_lower_version_is_followed_and_the_old_one_superseded():
    trust = VersionTrust()
    trust.on_run_state(state(30), 0.0)
    assert trust.judge(ann(30), "weights-0", 0.0) == ""
    # The new trainer's start weights reach the broadcaster before its first RunState reaches us.
    assert trust.judge(ann(25, L2), "weights-0", 1.0, carry="start weights") == "held"
    assert trust.judge(ann(30), "weights-0", 1.1) == ""  # the broadcaster still repeats the old one
    assert trust.on_run_state(state(25, L2), 1.2) == (["start weights"], [])
    assert trust.judge(ann(30), "weights-0", 1.3) == "superseded"  # the old lineage's repeat, quietly dropped
    assert trust.judge(ann(26, L2), "weights-0", 1.4) == ""


def test_an_announcement_before_any_run_state_waits_for_the_first_run_state():
    trust = VersionTrust()
    assert trust.judge(ann(7), "weights-0", 0.0, carry="a") == "held"
    assert trust.on_run_state(state(7, lineage=""), 0.1) == ([], [])  # a RunState naming no lineage vouches for none
    assert trust.on_run_state(state(7), 0.2) == (["a"], [])


def test_a_held_announcement_too_far_ahead_is_refused_when_its_run_state_comes():
    trust = VersionTrust()
    assert trust.judge(ann(90), "weights-0", 0.0) == "held"
    released, refused = trust.on_run_state(state(7), 0.1)
    assert released == [] and [why for why, _ in refused] == ["ahead"]


# -- a rollout worker's shell and core behind a real bus ------------------------------------------

@pytest.fixture
def bus():
    work = Path(tempfile.mkdtemp(prefix="abvt-", dir="/tmp"))
    path = work / "topology.yaml"
    path.write_text(f"endpoints: {{transport: ipc, ipc_dir: {work / 'ipc'}}}\nlogging: {{log_dir: {work / 'logs'}}}\n")
    with open(work / "bus.out", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "areal_bus.launch.cli", "node", "bus", "--topology", str(path)],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield load_topology(path), work
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


class _Worker:
    """A rollout worker's hub side, as nodes.rollout.node wires it: the shell's drain into the core."""

    def __init__(self, topo, base: Path):
        self.shell = NodeShell(topo, "rollout", 0, base=base, topics=(m.TOPIC_VERSION,), own_policy=True, echo=False)
        self.core = RolloutCore(SimRolloutEngine(SimRolloutEngineConfig(), "rollout-0"), "rollout-0", 1, StepLog(topo),
                                metrics=self.shell.metrics, log=self.shell.log)

    def turn(self) -> None:
        self.core.on_hub(msg for _, msg in self.shell.drain_hub())


def _publish_until(worker: _Worker, pubs: list[tuple[zmq.Socket, Encoder, bytes, object]], done, what: str,
                   timeout: float = 20) -> None:
    """Publish every message each turn (as the trainer and broadcaster repeat theirs) until ``done()``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for sock, enc, topic, msg in pubs:
            sock.send_multipart(pack_topic(topic, enc.encode(msg)))
        time.sleep(0.05)
        worker.turn()
        if done():
            return
    raise AssertionError(f"timed out waiting for {what}; serving {worker.core.serving}, "
                         f"counters {dict(worker.shell.metrics.counters)}")


@pytest.mark.timeout(90)
def test_forged_announcements_on_the_hub_are_refused_by_a_rollout_worker_and_a_trainer_restart_is_followed(bus):
    topo, base = bus
    ctx = zmq.Context()
    ctx.linger = 0
    pub = open_socket(ctx, zmq.PUB, topo.endpoint("hub_in", 0, base), bind=False)
    trainer, weights, stranger = Encoder("trainer-0"), Encoder("weights-0"), Encoder("agent-0")
    worker = _Worker(topo, base)
    counters = worker.shell.metrics.counters
    try:
        good = [(pub, trainer, m.TOPIC_RUN, state(3)), (pub, weights, m.TOPIC_VERSION, ann(3))]
        _publish_until(worker, good, lambda: worker.core.serving == PolicyVersion(L1, 3), "version 3 served")
        forged = [(pub, stranger, m.TOPIC_VERSION, ann(4)),  # the right lineage, one ahead, from the wrong node
                  (pub, weights, m.TOPIC_VERSION, ann(1000)),  # a version far ahead
                  (pub, weights, m.TOPIC_VERSION, ann(3, lineage=L1.replace("-a", "-q")))]  # one bit flipped
        _publish_until(worker, good + forged, lambda: counters.get("version_refused.unknown_lineage", 0) >= 1
                       and counters.get("version_refused.ahead", 0) >= 1
                       and counters.get("version_refused.not_weights_node", 0) >= 1,
                       "each forgery counted", timeout=LINEAGE_WAIT_S + 20)
        assert worker.core.serving == PolicyVersion(L1, 3), "a forged announcement was adopted"
        # The trainer restarts from its checkpoint: a new lineage at a lower version, then its weights.
        restart = [(pub, trainer, m.TOPIC_RUN, state(2, L2)), (pub, weights, m.TOPIC_VERSION, ann(2, L2))]
        _publish_until(worker, restart, lambda: worker.core.serving == PolicyVersion(L2, 2), "the new lineage served")
        logged = (base / "logs" / "rollout.log").read_text()
        refusals = [line for line in logged.splitlines() if "version_refused" in line]
        # Logged once per kind of refusal, at error level; counted every time.
        assert sorted(line.split("reason=")[1].split()[0] for line in refusals) == \
            ["ahead", "not_weights_node", "unknown_lineage"], refusals
        assert counters["version_refused.ahead"] > 1
    finally:
        worker.shell.close()
        pub.close(0)
        ctx.term()
