"""The agent node through the gateway (``agent.via: gateway``): episodes played as a user's agent would.

Each episode opens a session on the gateway (admin token; the task's seed and the GRPO group travel as
session metadata, so the reward node can verify the episode), then talks to the policy with the stock
``openai`` SDK given only ``base_url`` and the session key, turn by turn, and ends the session: the
gateway records the exact tokens and emits the trajectory. A refused session (HTTP 429: the system is
as far ahead of training as the staleness bound allows) is retried after the gateway's Retry-After.
Where the gateway listens and its admin token are the topology's ``nodes.gateway.config`` (GatewayConfig).

Run: areal-bus node agent --topology topology/default.yaml   (with agent.via: gateway)
"""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np

from areal_bus.wire import messages as m
from areal_bus.runtime.node import NodeShell
from areal_bus.tasks.driver import combine_reward
from areal_bus.gateway_client import check_gateway
from nodes.agent.core import make_driver

MAX_GROUPS_IN_FLIGHT = 8
"""Task instances played at once by one agent; the gateway's admission is the real limit, this only
bounds the agent's own memory and connections."""


async def play_episode(shell, openai_mod, base_url: str, admin: str, driver, seed: int, group_id: str,
                       cfg) -> float:
    """One episode through the gateway (``driver``: the task's tasks.driver.TaskDriver, of which only
    the text level is used: the gateway does the tokens); returns its reward as the agent saw it (for
    the log only: the reward node verifies the episode itself)."""
    headers = {"Authorization": f"Bearer {admin}"}
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.post(f"{base_url}/rl/sessions", headers=headers,
                                 json={"meta": {"task": driver.name, "seed": seed}, "group_id": group_id}) as r:
                body = await r.json()
                if r.status == 429:
                    shell.metrics.inc("sessions_refused")
                    await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                    continue
                if r.status != 201:
                    raise RuntimeError(f"gateway refused a session: {r.status} {body}")
                break
        client = openai_mod.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=body["api_key"], max_retries=3)
        ep = driver.reset(seed)
        try:
            done = False
            while not done:
                resp = await client.chat.completions.create(model=body["model"], messages=ep.messages,
                                                            max_tokens=driver.max_tokens, temperature=cfg.temperature,
                                                            top_p=cfg.top_p)
                _, done = ep.step(resp.choices[0].message.content or "")
        finally:
            await client.close()
            async with http.post(f"{base_url}/rl/sessions/{body['session_id']}/end", headers=headers) as r:
                if r.status >= 300:
                    shell.log.warning("session_end_failed", status=r.status, body=(await r.text())[:200])
    shell.metrics.inc("episodes")
    # The task's own reward, for the log (a reward function of the user's may be async: the reward
    # node runs it, not this event loop).
    reward = getattr(ep, "reward", None)
    return combine_reward(reward)[0] if reward is not None else float("nan")


class GatewayAgent:
    """Plays GRPO groups through the gateway until the trainer's run state says the run is over."""

    def __init__(self, topo, replica: int, shell, openai_mod, driver):
        gw = topo.gateway_config()
        self.base_url, self.admin = gw.base_url, gw.admin_token
        self.shell, self.openai, self.replica = shell, openai_mod, replica
        self.sampling = topo.rollout_engine
        self.driver = driver
        self.rng = np.random.default_rng(topo.agent.seed * 1000 + replica)
        self.group = topo.agent.group_size
        self.finished = asyncio.Event()

    async def watch_hub(self) -> None:
        while not self.shell.stopping.is_set():
            for _, msg in self.shell.drain_hub():
                if isinstance(msg, m.RunState) and msg.finished:
                    self.finished.set()
            await asyncio.sleep(0.05)
        self.finished.set()

    async def play_group(self, index: int) -> None:
        seed = self.driver.new_seed(self.rng)  # a training instance, never a held-out one
        gid = f"agent{self.replica}-g{index}"
        rewards = await asyncio.gather(*(play_episode(self.shell, self.openai, self.base_url, self.admin,
                                                      self.driver, seed, gid, self.sampling) for _ in range(self.group)))
        self.shell.metrics.inc("groups")
        if index % 8 == 0:
            self.shell.log.info("group", index=index, seed=seed, mean_reward=round(float(np.mean(rewards)), 3))

    async def main(self) -> None:
        shell = self.shell
        hub = asyncio.create_task(self.watch_hub())
        await asyncio.to_thread(check_gateway, f"{self.base_url}/v1", 5.0, self.admin, 120.0)  # waits while it starts
        running: set[asyncio.Task] = set()
        index = 0
        while not self.finished.is_set():
            while len(running) < MAX_GROUPS_IN_FLIGHT and not self.finished.is_set():
                running.add(asyncio.create_task(self.play_group(index)))
                index += 1
            done, running_left = await asyncio.wait(running, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            running = set(running_left)
            for t in done:
                if t.exception() is not None and not self.finished.is_set():
                    shell.log.warning("episode_failed", error=repr(t.exception())[:300])
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        hub.cancel()
        shell.log.info("run_finished", groups=index)
        while not shell.stopping.is_set():  # stay up (idle) until supervisord stops the run
            await asyncio.sleep(0.2)


def run(topo, replica: int = 0, base=None) -> int:
    import openai
    import uvloop

    shell = NodeShell(topo, "agent", replica, base=base, watch=("gateway",), topics=(m.TOPIC_RUN,))
    shell.install_signal_handlers()
    agent = GatewayAgent(topo, replica, shell, openai, make_driver(topo, base))
    if agent.admin is None:  # the gateway will not start either: say so here too, with the fix
        shell.log.error("no_admin_token", fix="export AREAL_BUS_ADMIN_TOKEN (8+ characters) in the shell that "
                        "starts supervisord; nodes.gateway.config.admin_token reads it")
        shell.close()
        return 2
    shell.announce_start(via="gateway", base_url=agent.base_url, group_size=agent.group)
    shell.start_heartbeat()
    try:
        uvloop.run(agent.main())
    finally:
        shell.close()
    return 0
