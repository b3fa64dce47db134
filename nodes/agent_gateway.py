"""The agent node's gateway mode (``agent.via: gateway``): episodes played as a user's agent would.

Each episode opens a session on the gateway (admin token; the task's seed and the GRPO group travel as
session metadata, so the reward node can verify the episode), then talks to the policy with the stock
``openai`` SDK given only ``base_url`` and the session key, turn by turn, and ends the session: the
gateway records the exact tokens and emits the trajectory. A refused session (HTTP 429: the system is
as far ahead of training as the staleness bound allows) is retried after the gateway's Retry-After.

Run: areal-bus node agent --topology topology/default.yaml   (with agent.via: gateway)
"""

from __future__ import annotations

import asyncio
import os

import aiohttp
import numpy as np

from areal_bus import messages as m
from areal_bus.node import NodeShell
from areal_bus.tasks.guess import EVAL_SEED_BASE, GuessTask

MAX_GROUPS_IN_FLIGHT = 8
"""Task instances played at once by one agent; the gateway's admission is the real limit, this only
bounds the agent's own memory and connections."""


async def play_episode(shell, openai_mod, base_url: str, admin: str, task: GuessTask, seed: int, group_id: str,
                       cfg) -> float:
    """One episode through the gateway; returns its reward as the agent saw it (for the log only)."""
    headers = {"Authorization": f"Bearer {admin}"}
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.post(f"{base_url}/rl/sessions", headers=headers,
                                 json={"meta": {"task": "guess", "seed": seed}, "group_id": group_id}) as r:
                body = await r.json()
                if r.status == 429:
                    shell.metrics.inc("sessions_refused")
                    await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                    continue
                if r.status != 201:
                    raise RuntimeError(f"gateway refused a session: {r.status} {body}")
                break
        client = openai_mod.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=body["api_key"], max_retries=3)
        ep = task.reset(seed)
        try:
            done = False
            while not done:
                resp = await client.chat.completions.create(model=body["model"], messages=ep.messages,
                                                            max_tokens=8, temperature=cfg.temperature,
                                                            top_p=cfg.top_p)
                _, done = ep.step(resp.choices[0].message.content or "")
        finally:
            await client.close()
            async with http.post(f"{base_url}/rl/sessions/{body['session_id']}/end", headers=headers) as r:
                if r.status >= 300:
                    shell.log.warning("session_end_failed", status=r.status, body=(await r.text())[:200])
    shell.metrics.inc("episodes")
    return ep.reward


def run(topo, replica: int = 0, base=None) -> int:
    import openai

    shell = NodeShell(topo, "agent", replica, base=base, watch=("gateway",), topics=(m.TOPIC_RUN,))
    shell.install_signal_handlers()
    gw = topo.node_config("gateway")
    base_url = f"http://{gw.get('host', '127.0.0.1')}:{gw.get('port', 9000)}"
    admin = gw.get("admin_token") or os.environ.get("AREAL_BUS_ADMIN_TOKEN", "")
    task = GuessTask(topo.agent.task_size, topo.agent.max_turns)
    rng = np.random.default_rng(topo.agent.seed * 1000 + replica)
    group = topo.agent.group_size
    finished = asyncio.Event()
    shell.announce_start(via="gateway", base_url=base_url, group_size=group)
    shell.start_heartbeat()

    async def watch_hub():
        while not shell.stopping.is_set():
            for _, msg in shell.drain_hub():
                if isinstance(msg, m.RunState) and msg.finished:
                    finished.set()
            await asyncio.sleep(0.05)
        finished.set()

    async def play_group(index: int):
        seed = int(rng.integers(0, EVAL_SEED_BASE))
        gid = f"agent{replica}-g{index}"
        rewards = await asyncio.gather(*(play_episode(shell, openai, base_url, admin, task, seed, gid,
                                                      topo.rollout_engine) for _ in range(group)))
        shell.metrics.inc("groups")
        if index % 8 == 0:
            shell.log.info("group", index=index, seed=seed, mean_reward=round(float(np.mean(rewards)), 3))

    async def main():
        from areal_bus.gateway_client import check_gateway

        hub = asyncio.create_task(watch_hub())
        await asyncio.to_thread(check_gateway, f"{base_url}/v1", 5.0, admin, 120.0)  # waits while it starts
        running: set[asyncio.Task] = set()
        index = 0
        while not finished.is_set():
            while len(running) < MAX_GROUPS_IN_FLIGHT and not finished.is_set():
                running.add(asyncio.create_task(play_group(index)))
                index += 1
            done, running_left = await asyncio.wait(running, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            running = set(running_left)
            for t in done:
                if t.exception() is not None and not finished.is_set():
                    shell.log.warning("episode_failed", error=repr(t.exception())[:300])
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        hub.cancel()
        shell.log.info("run_finished", groups=index)
        while not shell.stopping.is_set():  # stay up (idle) until supervisord stops the run
            await asyncio.sleep(0.2)

    try:
        import uvloop

        uvloop.run(main())
    finally:
        shell.close()
    return 0
