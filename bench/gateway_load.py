"""1,000 concurrent agent sessions on the gateway, then a soak: sessions/s, turn latency, memory, descriptors.

The gateway is a process of its own (nodes/gateway/standalone.py: the gateway node's app, with the shipped
tiny policy generating in that process through LocalEngineBackend, continuous batching across requests),
so its RSS and open file descriptors are read from /proc apart from the clients'. The clients are agents
in this process on one aiohttp session whose connection pool is capped (--connections): the sessions are
concurrent on the gateway (all open at once), their requests share the pool as agents behind one egress do.

    baseline  agents one at a time (--baseline sessions): unloaded turn latency, and GET /health (the HTTP floor)
    burst     --sessions sessions opened together (the gateway's gauge must read them all open at once), each
              plays --turns chat turns (each continuing the last: the session's record grows, no rewrite) with
              max_tokens --max-tokens, then ends with a reward
    soak      --minutes of --concurrency agents in closed loop, session after session; RSS and descriptors
              sampled every --sample-s

Every session must end as exactly one trajectory (the gateway writes one line per trajectory); a 429 is
honoured (Retry-After) and counted. The table gives sessions/s, a chat turn's p50/p99 on the wire
(against the baseline's), the agents' wait for a connection (FIFO), and RSS / descriptors at the start,
middle and end of each phase.

Run:  .venv/bin/python bench/gateway_load.py                         (1,000 sessions + a 2-minute soak, ~4 min)
      .venv/bin/python bench/gateway_load.py --minutes 10            (the long soak)
      .venv/bin/python bench/gateway_load.py --sessions 200 --minutes 0.2   (smoke test, ~40 s)

The last line is ``RESULT sessions=... burst_sessions_per_s=... burst_p50_ms=... burst_p99_ms=...
soak_sessions_per_s=... soak_p50_ms=... soak_p99_ms=... baseline_p50_ms=... rss_mib=start/peak/end
fds=start/peak/end soak_rss_growth_mib=... soak_fd_growth=... lost=... duplicated=...``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nodes.gateway.standalone import Child  # noqa: E402

GAME = "Guess my number (1-16) in 5 tries. I say higher or lower."
FEEDBACK = ["higher", "lower", "higher (9-16)", "lower (1-7)"]
REQUEST_TIMEOUT_S = 120.0  # one request behind a thousand others on 2 cores; longer means stuck: fail
MAX_RETRIES_429 = 20


@dataclass
class Tally:
    """What the agents saw: chat turn latencies on the wire (s), waits for a connection (s), sessions
    ended, 429s honoured."""

    turns: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)
    retried_429: int = 0


class FairGate:
    """At most ``n`` requests in flight, granted first come first served. aiohttp's own pool limit is not
    fair to closed-loop agents: one that frees a connection and at once asks again takes it back before
    the waiter it woke runs, so a waiter can starve (a 120 s timeout was seen with 200 agents on 100
    connections). Here a freed slot is handed straight to the oldest waiter."""

    def __init__(self, n: int):
        self.free = n
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self) -> None:
        if self.free and not self.waiters:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a slot as it was cancelled: pass it on
                self.release()
            raise

    def release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1


class Agents:
    """Agents on one aiohttp session: each session opened with the admin token, played with its own key
    as an OpenAI client would (POST /v1/chat/completions), and ended with a reward. ``connections``
    requests at most are in flight (FairGate; the session's pool should allow as many)."""

    def __init__(self, http: aiohttp.ClientSession, admin: str, turns: int, max_tokens: int, connections: int):
        self.http, self.turns, self.max_tokens = http, turns, max_tokens
        self.admin = {"Authorization": f"Bearer {admin}"}
        self.gate = FairGate(connections)

    async def _post(self, tally: Tally, path: str, headers: dict, body=None, want: int = 200) -> dict:
        for _ in range(MAX_RETRIES_429):
            t0 = time.perf_counter()
            await self.gate.acquire()
            tally.waits.append(time.perf_counter() - t0)
            try:
                t0 = time.perf_counter()
                async with self.http.post(path, headers=headers, json=body) as r:
                    data = await r.read()
                if path.endswith("/chat/completions") and r.status == 200:
                    tally.turns.append(time.perf_counter() - t0)
            finally:
                self.gate.release()
            if r.status == 429:  # honoured as the SDKs do
                tally.retried_429 += 1
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            if r.status != want:
                raise RuntimeError(f"POST {path} answered {r.status}: {data[:300]!r}")
            return json.loads(data)
        raise RuntimeError(f"POST {path}: still 429 after {MAX_RETRIES_429} tries")

    async def open(self, tally: Tally) -> dict:
        return await self._post(tally, "/rl/sessions", self.admin, want=201)

    async def play(self, tally: Tally, session: dict) -> None:
        key = {"Authorization": f"Bearer {session['api_key']}"}
        messages = [{"role": "user", "content": GAME}]
        for turn in range(self.turns):
            reply = await self._post(tally, "/v1/chat/completions", key, {
                "model": "policy", "messages": messages, "max_tokens": self.max_tokens})
            messages = [*messages, reply["choices"][0]["message"], {"role": "user", "content": FEEDBACK[turn % 4]}]

    async def end(self, tally: Tally, session: dict) -> None:
        await self._post(tally, f"/rl/sessions/{session['session_id']}/end", self.admin, {"reward": 1.0})
        tally.ended.append(session["session_id"])

    async def one(self, tally: Tally) -> None:
        session = await self.open(tally)
        await self.play(tally, session)
        await self.end(tally, session)


class Sampler:
    """The gateway process's RSS (MiB) and open descriptors, with its count of open sessions, over time.
    ``http`` is a session of its own: behind the agents' pool a sample would wait for their requests."""

    def __init__(self, child: Child, http: aiohttp.ClientSession, admin: str):
        self.child, self.http, self.admin = child, http, {"Authorization": f"Bearer {admin}"}
        self.rows: list[tuple[float, float, int, int, int]] = []  # (t, rss MiB, fds, open sessions, py blocks)

    async def sample(self) -> tuple[float, float, int, int, int]:
        async with self.http.get("/rl/metrics", headers=self.admin) as r:
            gauges = (await r.json())["gauges"]
        row = (time.monotonic(), self.child.rss_bytes() / 2 ** 20, self.child.open_fds(), int(gauges["sessions.open"]),
               int(gauges["python.blocks"]))
        self.rows.append(row)
        return row

    async def every(self, seconds: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample()
            try:
                await asyncio.wait_for(stop.wait(), seconds)
            except asyncio.TimeoutError:
                pass


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1e3 if xs else float("nan")


async def baseline(agents: Agents, http: aiohttp.ClientSession, n: int) -> tuple[Tally, list[float]]:
    tally, floor = Tally(), []
    for _ in range(n):
        await agents.one(tally)
        t0 = time.perf_counter()
        async with http.get("/health") as r:
            await r.read()
        floor.append(time.perf_counter() - t0)
    return tally, floor


async def burst(agents: Agents, sampler: Sampler, n: int) -> tuple[Tally, float, tuple]:
    """n sessions open together, then all play, then all end; (tally, wall s, sample with all open)."""
    tally = Tally()
    t0 = time.perf_counter()
    sessions = await asyncio.gather(*(agents.open(tally) for _ in range(n)))
    peak = await sampler.sample()  # every session open at once (the gauge counts them)
    await asyncio.gather(*(agents.play(tally, s) for s in sessions))
    await sampler.sample()
    await asyncio.gather(*(agents.end(tally, s) for s in sessions))
    return tally, time.perf_counter() - t0, peak


async def soak(agents: Agents, sampler: Sampler, concurrency: int, seconds: float,
               sample_s: float) -> tuple[Tally, float]:
    tally = Tally()
    stop_at = time.perf_counter() + seconds
    stop = asyncio.Event()

    async def agent():
        while time.perf_counter() < stop_at:
            await agents.one(tally)
    t0 = time.perf_counter()
    sampling = asyncio.create_task(sampler.every(sample_s, stop))
    await asyncio.gather(*(agent() for _ in range(concurrency)))
    stop.set()
    await sampling
    await sampler.sample()
    return tally, time.perf_counter() - t0


def trajectories(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def run(args, work: Path, admin: str) -> dict:
    traj_path = work / "trajectories.jsonl"
    child = Child(["--log-dir", str(work), "--trajectories", str(traj_path), "--max-batch", str(args.max_batch),
                   "--max-len", "256", "--config", json.dumps({"max_sessions": max(1000, args.sessions)})],
                  admin, output=work / "output.log")
    try:
        connector = aiohttp.TCPConnector(limit=args.connections)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(child.url, connector=connector, timeout=timeout) as http, \
                aiohttp.ClientSession(child.url, timeout=timeout) as monitor:
            agents = Agents(http, admin, args.turns, args.max_tokens, args.connections)
            sampler = Sampler(child, monitor, admin)
            warm, _ = await baseline(agents, http, 20)  # warm-up: allocators, caches, code paths
            base, floor = await baseline(agents, http, args.baseline)
            start = await sampler.sample()
            print(f"baseline: turn p50 {pct(base.turns, 50):.1f} ms, GET /health p50 {pct(floor, 50):.2f} ms; "
                  f"gateway RSS {start[1]:.0f} MiB, {start[2]} fds", flush=True)
            b_tally, b_wall, peak = await burst(agents, sampler, args.sessions)
            after_burst = await sampler.sample()
            print(f"burst: {args.sessions} sessions open at once (gauge {peak[3]}) in {b_wall:.1f} s; RSS "
                  f"{start[1]:.0f} -> {peak[1]:.0f} (all open) -> {after_burst[1]:.0f} MiB, fds {start[2]} -> "
                  f"{peak[2]} -> {after_burst[2]}", flush=True)
            soak_rows_from = len(sampler.rows)
            s_tally, s_wall = await soak(agents, sampler, args.concurrency, args.minutes * 60, args.sample_s)
            soak_rows = sampler.rows[soak_rows_from:]
    finally:
        code = child.stop()
    if code != 0:
        raise RuntimeError(f"gateway exited {code}; output in {work / 'output.log'}")
    ended = {sid for tally in (warm, base, b_tally, s_tally) for sid in tally.ended}
    made = trajectories(traj_path)
    ids = [t["traj_id"] for t in made]
    return {"base": base, "floor": floor, "start": start, "burst": (b_tally, b_wall, peak, after_burst),
            "soak": (s_tally, s_wall, soak_rows), "lost": len(ended - set(ids)),
            "duplicated": len(ids) - len(set(ids)) + len(set(ids) - ended), "trajectories": made}


def report(args, res: dict) -> None:
    b_tally, b_wall, peak, after_burst = res["burst"]
    s_tally, s_wall, rows = res["soak"]
    start = res["start"]
    soak_start = rows[0] if rows else after_burst
    mid = rows[len(rows) // 2] if rows else after_burst
    end = rows[-1] if rows else after_burst

    def line(name, tally, rate, rss, fds):
        print(f"{name:<9}{len(tally.ended):>9}{rate:>8}{pct(tally.turns, 50):>9.1f}{pct(tally.turns, 99):>9.1f}"
              f"{pct(tally.waits, 99):>10.1f}{max(tally.waits, default=0) * 1e3:>10.1f}{tally.retried_429:>6}  "
              f"{rss:<24}{fds}")
    print(f"\n{'phase':<9}{'sessions':>9}{'sess/s':>8}{'turn p50':>9}{'turn p99':>9}{'wait p99':>10}{'wait max':>10}"
          f"{'429s':>6}  {'RSS MiB start/mid/end':<24}fds start/mid/end")
    line("baseline", res["base"], "-", f"{start[1]:.0f}", f"{start[2]}")
    line("burst", b_tally, f"{len(b_tally.ended) / b_wall:.1f}",
         f"{start[1]:.0f}/{peak[1]:.0f}/{after_burst[1]:.0f}", f"{start[2]}/{peak[2]}/{after_burst[2]}")
    line("soak", s_tally, f"{len(s_tally.ended) / s_wall:.1f}",
         f"{soak_start[1]:.0f}/{mid[1]:.0f}/{end[1]:.0f}", f"{soak_start[2]}/{mid[2]}/{end[2]}")
    print(f"(ms; turn: a chat turn on the wire, {args.turns} per session, max_tokens {args.max_tokens}; wait: an "
          f"agent's wait for one of the {args.connections} connections, FIFO. burst: {args.sessions} sessions, its "
          f"middle sample taken with all of them open; soak: {args.concurrency} agents for {s_wall:.0f} s, "
          f"{len(rows)} samples. GET /health p50 {pct(res['floor'], 50):.2f} ms)")
    if len(rows) >= 4:  # growth over the soak: the slope of RSS and fds against time, not two noisy points
        t = np.array([r[0] - rows[0][0] for r in rows])
        rss_slope = float(np.polyfit(t, [r[1] for r in rows], 1)[0]) * 60
        fd_slope = float(np.polyfit(t, [r[2] for r in rows], 1)[0]) * 60
        print(f"soak trend: RSS {rss_slope:+.2f} MiB/min, fds {fd_slope:+.2f}/min; RSS range "
              f"{min(r[1] for r in rows):.0f}-{max(r[1] for r in rows):.0f} MiB, fds "
              f"{min(r[2] for r in rows)}-{max(r[2] for r in rows)}")
    if rows and s_tally.ended:  # both quiet moments (no session open): the Python heap's growth a session
        print(f"python blocks: {after_burst[4]} after the burst -> {end[4]} after the soak, "
              f"{(end[4] - after_burst[4]) / len(s_tally.ended):+.1f} a session (~5 is the bounded record of "
              f"ended sessions)")
    print(f"trajectories: {len(res['trajectories'])} written, lost {res['lost']}, duplicated {res['duplicated']}; "
          f"load at the end {os.getloadavg()[0]:.1f}")
    print(f"RESULT sessions={args.sessions} burst_sessions_per_s={len(b_tally.ended) / b_wall:.1f} "
          f"burst_p50_ms={pct(b_tally.turns, 50):.1f} burst_p99_ms={pct(b_tally.turns, 99):.1f} "
          f"soak_sessions_per_s={len(s_tally.ended) / s_wall:.1f} soak_p50_ms={pct(s_tally.turns, 50):.1f} "
          f"soak_p99_ms={pct(s_tally.turns, 99):.1f} baseline_p50_ms={pct(res['base'].turns, 50):.1f} "
          f"rss_mib={start[1]:.0f}/{peak[1]:.0f}/{end[1]:.0f} fds={start[2]}/{peak[2]}/{end[2]} "
          f"soak_rss_growth_mib={end[1] - soak_start[1]:.1f} soak_fd_growth={end[2] - soak_start[2]} "
          f"lost={res['lost']} duplicated={res['duplicated']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=1000, help="sessions open together in the burst")
    p.add_argument("--turns", type=int, default=2, help="chat turns per session")
    p.add_argument("--max-tokens", type=int, default=4, help="completion tokens per turn at most")
    p.add_argument("--connections", type=int, default=100, help="the clients' connection pool")
    p.add_argument("--max-batch", type=int, default=64, help="the engine's batch (sequences decoded together)")
    p.add_argument("--minutes", type=float, default=2.0, help="soak length")
    p.add_argument("--concurrency", type=int, default=200, help="agents in the soak")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS / fd samples in the soak")
    p.add_argument("--baseline", type=int, default=30, help="sessions played one at a time for the baseline")
    args = p.parse_args()
    admin = secrets.token_urlsafe(24)
    work = Path(tempfile.mkdtemp(prefix="ab-gwload-", dir="/tmp"))
    print(f"{time.strftime('%Y-%m-%d %H:%M')} {platform.node()}: {os.cpu_count()} cpus, load "
          f"{os.getloadavg()[0]:.1f}; python {platform.python_version()}, aiohttp {aiohttp.__version__}; "
          f"gateway (standalone, tiny-guess, max_batch {args.max_batch}) in {work}", flush=True)
    try:
        import uvloop
        res = uvloop.run(run(args, work, admin))
    except BaseException:
        print(f"gateway output kept in {work}", file=sys.stderr)
        raise
    report(args, res)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if res["lost"] == 0 and res["duplicated"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
