"""`[rollout] step` on the default topology (sessions through the gateway) runs ahead of `[train] step`,
as the README's check that async is on says, and never further than the staleness bound lets it.

A short real run under supervisord: topology/default.yaml as shipped (the tiny policy, torch engines,
the built-in agent playing through the gateway with the openai SDK), only shorter (4 updates, no
evaluation, no checkpoints) and on a free gateway port. Measured (2026-12-01, the shared 2-core box,
10 updates): of 191 [rollout] lines, 158 led by 3 (= staleness_threshold + 1), 17 by 2, 16 by 1.

The exact bound. A session is admitted for update ``v + k``, where ``v`` is the number of updates the
gateway knows the trainer has made and ``k <= staleness_threshold`` (areal_bus/admission.py: the
rule lets a source hold fewer than its ``(staleness + 1) * batch`` allowance in flight). The trainer
logs ``[train] step=N`` for the update that made version ``N + 1``, so when the gateway knows ``v``
the last ``[train]`` line says ``v - 1`` (or none yet: -1). Hence, for every ``[rollout]`` line,
step - (the last [train] step logged at or before it) <= staleness_threshold + 1, reached when the
pipeline is full; a synchronous run shows exactly 1 (samples for the next update only), so a lead of
2 or more is what asynchrony looks like. (The trainer publishes its new version a few microseconds
before it writes the line; a session admitted on it, generated and logged within that gap is not
possible, and equal millisecond stamps count the [train] line first.)

Run: .venv/bin/pytest tests/test_rollout_step.py -q     (about two minutes on 2 cores; marked slow)
"""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest
import yaml


pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[1]
TS = r"ts=(\d\d):(\d\d):(\d\d)\.(\d{3})$"
TRAIN = re.compile(rf"^\[train\] step=(\d+) updated=\d+ .*{TS}")
ROLLOUT = re.compile(rf"^\[rollout\] step=(\d+) generated=\d+ tokens=\d+ version=(\d+) .*{TS}")
RUN_S = 300
"""The run's limit: about two minutes on a busy 2-core box (a minute of it before the first update)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_like() -> dict:
    """topology/default.yaml's settings, 4 updates long, over what tests.test_system's System shrinks."""
    d = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    nodes = {k: v for k, v in d["nodes"].items() if k != "probe"}
    # A literal token in a temp file only: the nodes read the topology, not the test's environment.
    nodes["gateway"] = {"config": {"port": free_port(), "admin_token": "rollout-step-test-token"}}
    return dict(
        rollout_workers=d["rollout_workers"], staleness_threshold=d["staleness_threshold"],
        queue_max_size=d["queue_max_size"], trigger_batch_size=d["trigger_batch_size"],
        global_batch_size=d["global_batch_size"], mini_batch_size=d["mini_batch_size"], max_steps=4,
        model={**d["model"], "path": str(REPO / d["model"]["path"])}, agent=d["agent"],
        rollout_engine=d["rollout_engine"], trainer_engine={**d["trainer_engine"], "eval_interval": 0},
        logging={**d["logging"], "save_interval": 0}, nodes=nodes)


def _ms(match: re.Match, first: int) -> int:
    h, m, s, ms = (int(x) for x in match.groups()[-4:])
    t = ((h * 60 + m) * 60 + s) * 1000 + ms
    return t + 86_400_000 if t < first - 43_200_000 else t  # the run crossed midnight


def leads(train_lines: list[str], rollout_lines: list[str]) -> list[tuple[int, int]]:
    """(rollout step, the last [train] step logged at or before it; -1 before the first), in time order."""
    train = [m for line in train_lines if (m := TRAIN.match(line))]
    rollout = [m for line in rollout_lines if (m := ROLLOUT.match(line))]
    first = min(_ms(m, 1 << 40) for m in train + rollout)
    # At equal stamps the [train] line comes first (0 before 1): the order that cannot overstate the lead.
    events = sorted([(_ms(m, first), 0, int(m.group(1))) for m in train] +
                    [(_ms(m, first), 1, int(m.group(1))) for m in rollout])
    out, last = [], -1
    for _, kind, step in events:
        if kind == 0:
            last = step
        else:
            out.append((step, last))
    return out


def test_rollout_step_leads_train_step_by_at_most_staleness_plus_one_in_gateway_mode(make_system):
    system = make_system(**default_like())
    assert system.topo.agent.via == "gateway" and "gateway" in system.data["nodes"]
    system.start()
    try:
        rc = system.proc.wait(RUN_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"run not over after {RUN_S} s:\n{system.tail('train.log')}") from None
    assert rc == 0, system.tail("supervisord.log")
    pairs = leads(system.lines("train.log"), system.lines("rollout.log"))
    s = system.topo.staleness_threshold
    assert pairs, system.tail("rollout.log")
    worst = max(r - t for r, t in pairs)
    assert worst <= s + 1, f"[rollout] step more than staleness_threshold + 1 = {s + 1} ahead: {pairs}"
    # Asynchrony shows: while updates are being made, rollout works on samples past the next one.
    assert max(r - t for r, t in pairs if t >= 0) >= 2, pairs
    # The serving version stays in the line (what gateway-mode lines used to call their step).
    versions = [int(m.group(2)) for line in system.lines("rollout.log") if (m := ROLLOUT.match(line))]
    assert len(versions) == len(pairs) and max(versions) <= system.topo.max_steps
    assert not system.tracebacks()


def test_the_lead_is_read_against_the_last_train_line_before_each_rollout_line():
    train = ["[train] step=0 updated=32 loss=0.1 reward=0.5 train_s=1 node=trainer-0 ts=10:00:01.000",
             "[train] step=1 updated=32 loss=0.1 reward=0.5 train_s=1 node=trainer-0 ts=10:00:02.000"]
    rollout = ["[rollout] step=2 generated=16 tokens=40 version=0 node=rollout-0 ts=10:00:00.500",
               "[rollout] step=3 generated=16 tokens=40 version=1 node=rollout-0 ts=10:00:01.000",
               "[rollout] step=4 generated=16 tokens=40 version=2 node=rollout-1 ts=10:00:02.001"]
    assert leads(train, rollout) == [(2, -1), (3, 0), (4, 1)]
