"""Claude Code, unmodified, playing one episode through the gateway: its requests become a trajectory.

Starts the gateway on a loopback port in this process, serving the shipped tiny policy
(models/tiny-guess, torch engine), opens a session with the admin token, and runs the `claude` CLI in
print mode with ANTHROPIC_BASE_URL set to the gateway and ANTHROPIC_API_KEY set to the session key:
nothing else about Claude Code changes. Then it rewards and ends the session and prints the
trajectories the gateway emitted (prompt tokens, sampled tokens, their policy versions).

The tiny policy has a character-level tokenizer and was trained on 512-token games (served here with a
2,048-token cache: Claude Code adds ~500 characters of its own), so Claude Code runs with a short system
prompt and no built-in tools (its full tool set is tens of thousands of characters); a real policy takes
Claude Code's defaults. Needs Node 18+ and Claude Code:

    npm install --prefix /tmp/cc @anthropic-ai/claude-code
    .venv/bin/python scripts/claude_code_demo.py --claude /tmp/cc/node_modules/.bin/claude

Prints one JSON line ``RESULT {...}`` last; exits 0 when Claude Code finished and the session ended
as at least one trajectory with sampled tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import torch  # noqa: E402

from areal_bus.engines.torch_engine import TorchRolloutEngine  # noqa: E402
from areal_bus.model.modeling import load_pretrained  # noqa: E402
from areal_bus.config.node_configs import GatewayConfig  # noqa: E402
from areal_bus.tasks.runner import load_tokenizer  # noqa: E402
from nodes.gateway.app import bound_port, make_app, start_server  # noqa: E402
from nodes.gateway.backend import LocalEngineBackend  # noqa: E402

MODEL = REPO / "models" / "tiny-guess"
ADMIN = "claude-code-demo-admin"
PROMPT = "Guess my number (1-16) in 5 tries. I say higher or lower. Your first guess?"


async def main(args) -> int:
    claude = args.claude or shutil.which("claude")
    if not claude or not Path(claude).exists():
        print("Claude Code not found: npm install --prefix /tmp/cc @anthropic-ai/claude-code, then pass "
              "--claude /tmp/cc/node_modules/.bin/claude", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    emitted = []
    backend = LocalEngineBackend(TorchRolloutEngine(load_pretrained(MODEL, torch.device("cpu"), torch.float32),
                                                    max_batch=4, max_len=2048))
    cfg = GatewayConfig(admin_token=ADMIN, port=0)
    app = make_app(cfg, backend, load_tokenizer(MODEL), emit=emitted.append)
    runner = await start_server(app, cfg)
    url = f"http://127.0.0.1:{bound_port(runner)}"
    admin = {"Authorization": f"Bearer {ADMIN}"}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/rl/sessions", headers=admin) as r:
                session = await r.json()
            with tempfile.TemporaryDirectory() as home:  # Claude Code's config and history stay out of ~
                env = {**os.environ, "HOME": home, "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": session["api_key"],
                       "ANTHROPIC_MODEL": session["model"], "ANTHROPIC_DEFAULT_HAIKU_MODEL": session["model"],
                       "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1"}
                proc = await asyncio.create_subprocess_exec(
                    claude, "-p", PROMPT, "--system-prompt", "You play a number guessing game.", "--tools", "",
                    "--max-turns", "1", "--output-format", "json", env=env,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                out, err = await asyncio.wait_for(proc.communicate(), args.timeout)
            answer = json.loads(out or b"{}")
            print(f"claude exit {proc.returncode}: result={answer.get('result')!r} "
                  f"usage={answer.get('usage', {}).get('input_tokens')}/{answer.get('usage', {}).get('output_tokens')}")
            if proc.returncode != 0:
                print(err.decode(errors="replace")[-2000:], file=sys.stderr)
            sid = session["session_id"]
            async with http.post(f"{url}/rl/sessions/{sid}/reward", headers=admin, json={"reward": 1.0}) as r:
                rewarded = r.status
            async with http.post(f"{url}/rl/sessions/{sid}/end", headers=admin) as r:
                ended = r.status
    finally:
        await runner.cleanup()
        backend.close()
    trajs = [{"traj_id": t.traj_id, "prompt_tokens": int(t.prompt_ids.size), "sampled": int(t.loss_mask.sum()),
              "versions": sorted({int(v) for v in t.versions[t.loss_mask > 0]}), "reward": t.reward} for t in emitted]
    ok = proc.returncode == 0 and not answer.get("is_error") and any(t["sampled"] > 0 for t in trajs)
    print("RESULT " + json.dumps({"ok": ok, "claude_exit": proc.returncode, "result": answer.get("result"),
                                  "reward_status": rewarded, "end_status": ended, "trajectories": trajs}))
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--claude", help="path to the claude CLI (default: the one on PATH)")
    ap.add_argument("--timeout", type=float, default=120.0)
    import uvloop

    sys.exit(uvloop.run(main(ap.parse_args())))
