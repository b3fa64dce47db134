"""Latency the HTTP gateway adds in front of a rollout worker (p50, p99), and requests/s, in one run.

A small real system runs as processes of its own: the bus, the weights node, one rollout worker
(torch engine, the shipped tiny model) and the gateway node. Nothing trains (no trainer, agent or
reward node), so the machine's load is these requests. The topology declares two gateway replicas:
the real gateway node is replica 0; this process binds replica 1's ``gwork`` endpoint with a
``BusBackend`` of its own, so both paths reach the same worker over the same kind of socket:

    gateway  POST /v1/chat/completions (aiohttp client, admin token: served, not recorded)
             -> gateway node (auth, parse, chat template, BusBackend, decode, JSON) -> rollout-0
    direct   BusBackend.generate(prompt ids) in this process -> rollout-0

Both ask for the same work: the same prompt ids (the same chat rendered by the same template; checked
against the gateway's usage.prompt_tokens), max_tokens 2, temperature 0 (greedy, so the same output;
checked too). So the difference is what the gateway costs: HTTP, JSON, the template, decoding.

Measured in rounds, the modes interleaved (direct first in even rounds, gateway first in odd ones):
per round, each mode serves --requests requests one at a time (latency p50 / p99), then --clients
concurrent clients for --seconds (requests/s). A third, informational row ``http floor`` times GET
/health on the gateway (aiohttp server + client round trip, no work). Reported: per mode the median of
the rounds, and "added" as the median over rounds of (gateway - direct) in the same round.

Run:  .venv/bin/python bench/gateway.py                       (~90 s on 2 cores)
      .venv/bin/python bench/gateway.py --rounds 2 --requests 100 --seconds 1    (smoke test)
      .venv/bin/python bench/gateway.py --profile /tmp/gw.prof  (gateway under cProfile: slower; prints
                                                                 where its time goes)

The last line is ``RESULT added_p50_ms=... added_p99_ms=... direct_p50_ms=... gateway_p50_ms=...
gateway_rps=... direct_rps=... rps_ratio=...``; the target is added_p50_ms <= 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import pstats
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import yaml
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from areal_bus.codec import Encoder  # noqa: E402
from areal_bus.metrics import Metrics  # noqa: E402
from areal_bus.tasks.runner import load_tokenizer  # noqa: E402
from areal_bus.topology import parse_topology  # noqa: E402
from nodes.gateway.backend import SamplingParams  # noqa: E402
from nodes.gateway.bus_backend import BusBackend, NoWorker  # noqa: E402
from nodes.gateway.chat import ChatRenderer  # noqa: E402

AREAL_BUS = Path(sys.executable).parent / "areal-bus"
MODEL = ROOT / "models" / "tiny-guess"
MESSAGES = [{"role": "user", "content": "Guess the number: it is between 1 and 16."}]
START_TIMEOUT_S = 180.0  # first start imports torch and transformers in three processes on 2 cores
REQUEST_TIMEOUT_S = 30.0  # one tiny completion; longer means a stuck node: fail, do not hang
STOP_WAIT_S = 15.0  # SIGTERM, then this long, then SIGKILL (the node's own shutdown takes < 1 s)
MODES = ("direct", "gateway")


def topology(work: Path, port: int) -> dict:
    return {
        "name": "bench-gateway",
        "rollout_workers": 1,
        "logging": {"log_dir": str(work / "logs")},
        "model": {"path": str(MODEL), "threads": 1},
        "agent": {"framework": "guess"},
        "rollout_engine": {"kind": "torch", "max_batch": 32, "max_len": 256},
        "trainer_engine": {"kind": "torch"},
        "endpoints": {"transport": "ipc", "ipc_dir": str(work / "ipc")},
        "nodes": {
            "bus": {}, "weights": {}, "agent": {"replicas": 0}, "reward": {"replicas": 0},
            "gateway": {"replicas": 2, "config": {"admin_token": "${AREAL_BUS_ADMIN_TOKEN}", "port": port}},
        },
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class System:
    """The node processes, each in a process group of its own so that stopping it stops its children."""

    def __init__(self, topo_path: Path, work: Path, env: dict, profile: Path | None):
        self.topo_path, self.work, self.env, self.profile = topo_path, work, env, profile
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, kind: str, replica: int = 0) -> None:
        cmd = [str(AREAL_BUS), "node", kind, "--topology", str(self.topo_path), "--replica", str(replica)]
        if kind == "gateway" and self.profile is not None:
            cmd = [sys.executable, "-m", "cProfile", "-o", str(self.profile), *cmd]
        with open(self.work / f"{kind}-{replica}.out", "wb") as out:
            self.procs[f"{kind}-{replica}"] = subprocess.Popen(
                cmd, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.work / f"{name}.out").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):  # the gateway first: it ends cleanly (and profiles)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class Clients:
    """One request of each mode, as a client of that path would make it."""

    def __init__(self, backend: BusBackend, http: aiohttp.ClientSession, url: str, token: str,
                 prompt_ids: np.ndarray, max_tokens: int):
        self.backend, self.http, self.url = backend, http, url
        self.prompt_ids = prompt_ids
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0)
        self.body = json.dumps({"model": "policy", "messages": MESSAGES, "max_tokens": max_tokens,
                                "temperature": 0.0}).encode()
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    async def direct(self):
        return await self.backend.generate("", self.prompt_ids, self.params)

    async def gateway(self) -> dict:
        async with self.http.post(f"{self.url}/v1/chat/completions", data=self.body, headers=self.headers) as r:
            raw = await r.read()
            if r.status != 200:
                raise RuntimeError(f"gateway answered {r.status}: {raw[:500]!r}")
            return json.loads(raw)

    async def health(self) -> None:
        async with self.http.get(f"{self.url}/health") as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"GET /health answered {r.status}")


async def wait_ready(system: System, clients: Clients) -> tuple:
    """Both paths answer (the worker's DEALER is connected to both ROUTERs, the gateway sees the worker
    alive); returns one answer of each, to check that they did the same work."""
    deadline = time.monotonic() + START_TIMEOUT_S
    comp = resp = None
    while comp is None or resp is None:
        system.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"system not ready after {START_TIMEOUT_S:.0f} s; logs in {system.work}")
        try:
            if comp is None:
                clients.backend.set_live({"rollout-0"})  # the worker's id: its DEALER may not be connected yet
                comp = await asyncio.wait_for(clients.direct(), REQUEST_TIMEOUT_S)
            if resp is None:
                resp = await asyncio.wait_for(clients.gateway(), REQUEST_TIMEOUT_S)
        except (NoWorker, aiohttp.ClientError, asyncio.TimeoutError, RuntimeError):
            await asyncio.sleep(0.5)
    return comp, resp


async def sequential(call, n: int) -> list[float]:
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        lat.append(time.perf_counter() - t0)
    return lat


async def concurrent(call, clients: int, seconds: float) -> float:
    done = 0
    t0 = time.perf_counter()
    stop_at = t0 + seconds

    async def client():
        nonlocal done
        while time.perf_counter() < stop_at:
            await asyncio.wait_for(call(), REQUEST_TIMEOUT_S)
            done += 1

    await asyncio.gather(*(client() for _ in range(clients)))
    return done / (time.perf_counter() - t0)


def pct(lat: list[float], q: float) -> float:
    return float(np.percentile(lat, q)) * 1e3


async def measure(args, system: System, clients: Clients) -> dict:
    comp, resp = await wait_ready(system, clients)
    usage = resp["usage"]
    if usage["prompt_tokens"] != clients.prompt_ids.size or usage["completion_tokens"] != comp.output_ids.size:
        raise RuntimeError(f"the modes do different work: gateway usage {usage} vs direct prompt "
                           f"{clients.prompt_ids.size} / completion {comp.output_ids.size} tokens")
    print(f"ready: prompt {clients.prompt_ids.size} tokens, completion {comp.output_ids.size} tokens "
          f"({comp.finish_reason}) in both modes; worker generation {comp.gen_seconds * 1e3:.2f} ms", flush=True)
    calls = {"direct": clients.direct, "gateway": clients.gateway}
    for mode in MODES:  # warm-up: connections open, code paths and allocators warm
        await sequential(calls[mode], 50)
        await concurrent(calls[mode], args.clients, 0.3)
    rounds = {mode: [] for mode in (*MODES, "http floor")}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            lat = await sequential(calls[mode], args.requests)
            rps = await concurrent(calls[mode], args.clients, args.seconds)
            rounds[mode].append((pct(lat, 50), pct(lat, 99), rps))
        lat = await sequential(clients.health, args.requests)
        rounds["http floor"].append((pct(lat, 50), pct(lat, 99), float("nan")))
        d, g = rounds["direct"][-1], rounds["gateway"][-1]
        print(f"  round {r + 1}/{args.rounds}: direct p50 {d[0]:.2f} ms {d[2]:.0f} req/s, gateway p50 {g[0]:.2f} ms "
              f"{g[2]:.0f} req/s; load {os.getloadavg()[0]:.1f}", flush=True)
    return rounds


def report(args, rounds: dict) -> None:
    med = {mode: [statistics.median(col) for col in zip(*rs)] for mode, rs in rounds.items()}
    paired = list(zip(rounds["direct"], rounds["gateway"]))
    added_p50 = statistics.median(g[0] - d[0] for d, g in paired)
    added_p99 = statistics.median(g[1] - d[1] for d, g in paired)
    ratio = statistics.median(g[2] / d[2] for d, g in paired)
    print(f"\n{'mode':<11}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}   p50 ms per round")
    for mode, (p50, p99, rps) in med.items():
        per = " ".join(f"{r[0]:.2f}" for r in rounds[mode])
        shown = "-" if mode == "http floor" else f"{rps:.0f}"
        print(f"{mode:<11}{p50:>9.2f}{p99:>9.2f}{shown:>9}   {per}")
    print(f"\nadded by the gateway: p50 {added_p50:+.2f} ms, p99 {added_p99:+.2f} ms (target p50 <= 1 ms); "
          f"per round p50 {' '.join(f'{g[0] - d[0]:+.2f}' for d, g in paired)}")
    print(f"gateway / direct req/s with {args.clients} clients: {ratio:.2f}   per round "
          f"{' '.join(f'{g[2] / d[2]:.2f}' for d, g in paired)}")
    print(f"http floor (GET /health) is {med['http floor'][0]:.2f} ms of the added p50; the rest is the chat "
          f"handler (auth, JSON, template, decode). Load at the end: {os.getloadavg()[0]:.1f}")
    print(f"RESULT added_p50_ms={added_p50:.3f} added_p99_ms={added_p99:.3f} direct_p50_ms={med['direct'][0]:.3f} "
          f"gateway_p50_ms={med['gateway'][0]:.3f} direct_p99_ms={med['direct'][1]:.3f} "
          f"gateway_p99_ms={med['gateway'][1]:.3f} gateway_rps={med['gateway'][2]:.1f} "
          f"direct_rps={med['direct'][2]:.1f} rps_ratio={ratio:.3f}")


def print_profile(path: Path, top: int = 25) -> None:
    print(f"\ngateway profile ({path}; cProfile slows the gateway: the figures above are inflated), "
          f"top {top} by own time:")
    stats = pstats.Stats(str(path))
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


async def run(args, work: Path, token: str) -> dict:
    port = free_port()
    topo_dict = topology(work, port)
    topo_path = work / "topology.yaml"
    topo_path.write_text(yaml.safe_dump(topo_dict, sort_keys=False))
    # In this process only, for endpoint(): the file keeps ${AREAL_BUS_ADMIN_TOKEN}, the nodes get it from env.
    topo = parse_topology(json.loads(json.dumps(topo_dict).replace("${AREAL_BUS_ADMIN_TOKEN}", token)), str(topo_path))
    (work / "ipc").mkdir()
    renderer = ChatRenderer(load_tokenizer(MODEL))
    prompt_ids = np.asarray(renderer.prompt_ids(MESSAGES, None), dtype=np.int32)
    env = dict(os.environ, AREAL_BUS_ADMIN_TOKEN=token, PYTHONUNBUFFERED="1",
               PATH=f"{AREAL_BUS.parent}:{os.environ.get('PATH', '')}")
    system = System(topo_path, work, env, args.profile)
    ctx = zmq.Context()
    # Bound before the worker starts, so its DEALER for gateway replica 1 connects at once.
    backend = BusBackend(ctx, topo.endpoint("gwork", 1), Encoder("bench-direct"), Metrics())
    try:
        for kind in ("bus", "weights", "rollout", "gateway"):
            system.start(kind)
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as http:
            clients = Clients(backend, http, f"http://127.0.0.1:{port}", token, prompt_ids, args.max_tokens)
            return await measure(args, system, clients)
    finally:
        system.stop()
        backend.close()
        ctx.destroy(linger=0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="rounds; each runs both modes (interleaved)")
    p.add_argument("--requests", type=int, default=300, help="sequential requests per mode per round (p50/p99)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients for requests/s")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds of concurrent load per mode per round")
    p.add_argument("--max-tokens", type=int, default=2, help="completion tokens per request (greedy)")
    p.add_argument("--profile", type=Path, default=None, help="run the gateway under cProfile, write the "
                   "stats here and print the top functions")
    args = p.parse_args()
    token = secrets.token_urlsafe(24)
    work = Path(tempfile.mkdtemp(prefix="ab-gw-", dir="/tmp"))  # ipc paths must stay short
    print(f"{time.strftime('%Y-%m-%d %H:%M')} {platform.node()}: {os.cpu_count()} cpus, load "
          f"{os.getloadavg()[0]:.1f}; python {platform.python_version()}, aiohttp {aiohttp.__version__}, "
          f"pyzmq {zmq.__version__}")
    print(f"{args.rounds} rounds x (direct, gateway) x ({args.requests} sequential requests + {args.clients} "
          f"clients for {args.seconds:g} s); max_tokens {args.max_tokens}, temperature 0; starting bus, weights, "
          f"rollout (torch, {MODEL.name}) and gateway nodes in {work}", flush=True)
    try:
        try:
            import uvloop
            rounds = uvloop.run(run(args, work, token))  # the gateway node runs on uvloop too
        except ImportError:
            rounds = asyncio.run(run(args, work, token))
    except BaseException:
        print(f"logs kept in {work}", file=sys.stderr)
        raise
    if args.profile is not None:
        print_profile(args.profile)
    shutil.rmtree(work, ignore_errors=True)
    report(args, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
