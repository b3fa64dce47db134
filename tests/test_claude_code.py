"""Claude Code, unmodified, through the gateway (scripts/claude_code_demo.py): its requests become a
session's trajectories. Needs the `claude` CLI (Node; `npm install --prefix /tmp/cc
@anthropic-ai/claude-code`), found through AREAL_BUS_CLAUDE or PATH; skipped where it is absent
(CI installs no Node packages).

Run: AREAL_BUS_CLAUDE=/tmp/cc/node_modules/.bin/claude .venv/bin/pytest tests/test_claude_code.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLAUDE = os.environ.get("AREAL_BUS_CLAUDE") or shutil.which("claude")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not CLAUDE, reason="the claude CLI is not installed (set AREAL_BUS_CLAUDE or put it on PATH)")
def test_claude_code_plays_an_episode_that_becomes_trajectories():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "claude_code_demo.py"), "--claude", CLAUDE],
                          capture_output=True, text=True, timeout=220)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["claude_exit"] == 0 and result["ok"], result
    assert result["reward_status"] == 200 and result["end_status"] == 200
    for traj in result["trajectories"]:
        assert traj["prompt_tokens"] > 0 and traj["reward"] == 1.0 and traj["versions"] == [0]
