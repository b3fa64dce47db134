"""Latency the HTTP gateway adds in front of a rollout worker (p50, p99), and requests/s, in one run.

A small real system runs as processes of its own: the bus, the weights node, one rollout worker
(torch engine, the shipped tiny model) and the gateway node. Nothing trains (no trainer, agent or
reward node), so the requests below are the system's only work. The topology declares two gateway
replicas: the gateway node is replica 0, and this process binds replica 1's ``gwork`` endpoint with a
``BusBackend`` of its own, so every mode reaches the same worker over the same kind of socket:

    direct      BusBackend.generate(prompt ids), in this process             (the baseline)
    gateway     POST /v1/chat/completions to the gateway node with the admin token (served, not recorded)
    session     the same request with a session key, as agents make it: recorded into the session.
                The key comes from POST /rl/sessions (admin token); every SESSION_TURNS turns the
                session is ended (its trajectories emitted) and a new one opened, outside the timing
    lean session  the session requests from a minimal HTTP/1.1 client (LeanHTTP: keep-alive, the request's
                bytes written as they are, the reply read by Content-Length), as wrk or h2load measure a
                server: the gateway's latency without an HTTP library's per-request cost on the client
    in-process  the session request to the same gateway app (make_app) served from this process's
                event loop on this process's BusBackend: the gateway's code without its process
    http floor  GET /health on the gateway node: an HTTP round trip to it, no work behind it (lean floor:
                the same from LeanHTTP)

Every mode does the same work: the same prompt ids (the chat rendered by the policy's template; the
gateway's usage.prompt_tokens is checked against them) and max_tokens 2 at temperature 0 (greedy, so
the same completion; checked too). A session's turns all send the same conversation, so each turn is
recorded as a new segment of the session (a rewritten history: match, record and canonical() all run)
rather than a growing one, which would make its prompt, and so the worker's work, differ from direct's.
Each round sends --requests requests of every mode one at a time, the modes taking turns request by
request (so whatever else loads this shared machine hits them alike), then runs each mode with
--clients concurrent clients for --seconds (requests/s; a session client's include its session ends
and opens). Latency percentiles are over all rounds' requests; requests/s is the median of the rounds, its ratio to
direct the median of the rounds' ratios. Where the time goes: CPU per request of each process under
load (/proc) and of this process per sequential request, and the stages of the in-process gateway's
sequential requests (perf_counter around its methods; the wrappers cost microseconds).

Run:  .venv/bin/python bench/gateway.py                                      (~2 min on 2 cores)
      .venv/bin/python bench/gateway.py --rounds 2 --requests 100 --seconds 1  (smoke test, ~45 s)

The last line is ``RESULT added_p50_ms=... added_p99_ms=... direct_p50_ms=... gateway_p50_ms=...
direct_p99_ms=... gateway_p99_ms=... gateway_rps=... direct_rps=... rps_ratio=... inproc_added_p50_ms=...``
for the session path (the one agents take; ``admin_added_p50_ms`` is the admin token's), then
``lean_added_p50_ms`` / ``lean_added_p99_ms`` for the same path from the lean client. The target is <= 1 ms
added at p50: lean_added_p50_ms is what the gateway adds; added_p50_ms also carries aiohttp's client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import yaml
import zmq
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from areal_bus.wire.codec import Encoder  # noqa: E402
from areal_bus.runtime.logs import setup_logging  # noqa: E402
from areal_bus.runtime.metrics import Metrics  # noqa: E402
from areal_bus.tasks.runner import load_tokenizer  # noqa: E402
from areal_bus.config.topology import parse_topology  # noqa: E402
from nodes.gateway.app import GATEWAY, bound_port, make_app, start_server  # noqa: E402
from nodes.gateway.backend import SamplingParams  # noqa: E402
from nodes.gateway.bus_backend import BusBackend, NoWorker  # noqa: E402
from nodes.gateway.chat import ChatRenderer  # noqa: E402

AREAL_BUS = Path(sys.executable).parent / "areal-bus"
if not AREAL_BUS.exists():  # a host without the venv (scripts/gpu-host/host_gateway.sh puts a launcher on PATH)
    AREAL_BUS = Path(shutil.which("areal-bus") or AREAL_BUS)
MODEL = ROOT / "models" / "tiny-guess"
MESSAGES = [{"role": "user", "content": "Guess the number: it is between 1 and 16."}]
MODES = ("direct", "gateway", "session", "lean session", "in-process")
SESSION_TURNS = 4  # turns per session before it is ended and a new one opened (an episode of a short game)
WORKER = "rollout-0"
START_TIMEOUT_S = 180.0  # first start imports torch and transformers in several processes on 2 cores
REQUEST_TIMEOUT_S = 30.0  # one tiny completion; longer means a stuck node: fail, do not hang
STOP_WAIT_S = 15.0  # SIGTERM, then this long, then SIGKILL (a node's own shutdown takes about a second)
CLK_TCK = os.sysconf("SC_CLK_TCK")


def topology(work: Path, port: int) -> dict:
    return {
        "name": "bench-gateway",
        "rollout_workers": 1,
        # Nothing trains, so no update ever reopens session admission: a budget no run here exhausts.
        "staleness_threshold": 64, "queue_max_size": 1_000_000, "trigger_batch_size": 1_000_000,
        "global_batch_size": 1_000_000, "mini_batch_size": 1,
        "logging": {"log_dir": str(work / "logs")},
        "model": {"path": str(MODEL), "threads": 1},
        "agent": {"framework": "guess"},
        "rollout_engine": {"kind": "torch", "max_batch": 32, "max_len": 256},
        "trainer_engine": {"kind": "torch"},
        # ipc sockets in the run's own folder; its unique name also names the (here unused) weight buffers.
        "endpoints": {"transport": "ipc", "ipc_dir": str(work)},
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
    """The node processes, each in a process group of its own (stopping one stops its children)."""

    def __init__(self, topo_path: Path, work: Path, env: dict):
        self.topo_path, self.work, self.env = topo_path, work, env
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, kind: str, replica: int = 0) -> None:
        cmd = [str(AREAL_BUS), "node", kind, "--topology", str(self.topo_path), "--replica", str(replica)]
        with open(self.work / f"{kind}-{replica}.out", "wb") as out:
            self.procs[f"{kind}-{replica}"] = subprocess.Popen(
                cmd, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.work / f"{name}.out").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")

    def cpu_s(self, name: str) -> float:
        """CPU seconds (user + system) the node's process has used so far."""
        fields = Path(f"/proc/{self.procs[name].pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime: fields 14 and 15 of proc(5)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class Stages:
    """perf_counter around the in-process gateway's stages, one row per timed request."""

    def __init__(self, app):
        gw = app[GATEWAY]
        self.on = False
        self.row: dict[str, float] = {}
        self.rows: list[dict[str, float]] = []
        chat = gw.chat  # the policy chat service every chat route holds: timing it times them all
        chat.complete = self._timed("complete", chat.complete)
        chat.renderer.prompt_ids = self._timed("template", chat.renderer.prompt_ids)
        chat.shaper.postprocess = self._timed("decode", chat.shaper.postprocess)
        chat.backend = _TimedBackend(chat.backend, self)

        @web.middleware
        async def timed_handler(request, handler):  # the innermost middleware: times the route handler
            t0 = time.perf_counter()
            try:
                return await handler(request)
            finally:
                self.add("handler", t0)
        app.middlewares.append(timed_handler)

    def add(self, name: str, t0: float) -> None:
        if self.on:
            self.row[name] = self.row.get(name, 0.0) + time.perf_counter() - t0

    def _timed(self, name, fn):
        if asyncio.iscoroutinefunction(fn):
            async def timed(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    self.add(name, t0)
        else:
            def timed(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.add(name, t0)
        return timed

    def end(self, e2e: float) -> None:
        if self.on:
            self.rows.append({**self.row, "e2e": e2e})
        self.row = {}


class _TimedBackend:
    def __init__(self, backend, stages: Stages):
        self.generate = stages._timed("generate", backend.generate)


class LeanHTTP:
    """The least an HTTP/1.1 client can do per request (as wrk or h2load do, in Python): one keep-alive
    connection, the request's bytes written as they are, the response read by its Content-Length. What
    it measures is the gateway's own latency, without an HTTP library's per-request cost on the client
    (aiohttp's client alone is a few tenths of a millisecond here; the openai SDK's httpx more)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def request(self, method: str, path: str, headers: dict, body: bytes = b"") -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {len(body)}",
                 *(f"{k}: {v}" for k, v in headers.items())]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line[:15].lower() == b"content-length:")
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Clients:
    """One request of each mode, made as a client of that path would make it."""

    def __init__(self, backend: BusBackend, http: aiohttp.ClientSession, urls: dict[str, str], token: str,
                 prompt_ids: np.ndarray, max_tokens: int):
        self.backend, self.http, self.urls = backend, http, urls
        self.prompt_ids = prompt_ids
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0)
        self.body = json.dumps({"model": "policy", "messages": MESSAGES, "max_tokens": max_tokens,
                                "temperature": 0.0}).encode()
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.lean = self.lean_client()

    def lean_client(self) -> LeanHTTP:
        return LeanHTTP("127.0.0.1", int(self.urls["gateway"].rpartition(":")[2]))

    async def direct(self):
        return await self.backend.generate("", self.prompt_ids, self.params)

    async def chat(self, mode: str, headers: dict | None = None, lean: LeanHTTP | None = None) -> dict:
        if lean is not None:
            status, raw = await lean.request("POST", "/v1/chat/completions", headers, self.body)
            if status != 200:
                raise RuntimeError(f"{mode} answered {status}: {raw[:500]!r}")
            return json.loads(raw)
        url = f"{self.urls[mode]}/v1/chat/completions"
        async with self.http.post(url, data=self.body, headers=headers or self.headers) as r:
            raw = await r.read()
            if r.status != 200:
                raise RuntimeError(f"{mode} answered {r.status}: {raw[:500]!r}")
            return json.loads(raw)

    async def admin(self, mode: str, path: str, status: int) -> dict:
        async with self.http.post(f"{self.urls[mode]}{path}", headers=self.headers) as r:
            raw = await r.read()
            if r.status != status:
                raise RuntimeError(f"POST {path} to {mode} answered {r.status}: {raw[:500]!r}")
            return json.loads(raw)

    async def gateway(self) -> dict:
        return await self.chat("gateway")

    async def lean_health(self) -> None:
        status, _ = await self.lean.request("GET", "/health", {})
        if status != 200:
            raise RuntimeError(f"GET /health answered {status}")

    async def health(self) -> None:
        async with self.http.get(f"{self.urls['gateway']}/health") as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"GET /health answered {r.status}")


class Agent:
    """One agent's sessions on one gateway: a session key for its chat calls, renewed (the session
    ended, a new one opened) every SESSION_TURNS turns."""

    def __init__(self, clients: Clients, mode: str):
        self.clients, self.mode = clients, mode
        self.url = "in-process" if mode == "in-process" else "gateway"  # sessions are opened with aiohttp
        self.sid, self.headers, self.turns = None, None, 0
        self.lean = clients.lean_client() if mode == "lean session" else None  # a connection of its own

    async def renew_if_due(self) -> None:
        if self.sid is not None and self.turns < SESSION_TURNS:
            return
        if self.sid is not None:
            await self.clients.admin(self.url, f"/rl/sessions/{self.sid}/end", 200)
        opened = await self.clients.admin(self.url, "/rl/sessions", 201)
        self.sid, self.turns = opened["session_id"], 0
        self.headers = {"Authorization": f"Bearer {opened['api_key']}", "Content-Type": "application/json"}

    async def turn(self) -> dict:
        await self.renew_if_due()  # done beforehand (untimed) in the sequential requests
        self.turns += 1
        return await self.clients.chat(self.url, self.headers, self.lean)


async def wait_ready(system: System, clients: Clients) -> tuple:
    """Until both paths answer (the worker's DEALER connected to both ROUTERs, the gateway node seeing
    the worker's heartbeats); one answer of each, to check that they did the same work."""
    deadline = time.monotonic() + START_TIMEOUT_S
    comp = resp = None
    while comp is None or resp is None:
        system.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"system not ready after {START_TIMEOUT_S:.0f} s; logs in {system.work}")
        try:
            if comp is None:
                # This process hears no heartbeats: name the worker; NoWorker while its DEALER is not connected.
                clients.backend.set_live({WORKER})
                comp = await asyncio.wait_for(clients.direct(), REQUEST_TIMEOUT_S)
            if resp is None:
                resp = await asyncio.wait_for(clients.gateway(), REQUEST_TIMEOUT_S)
        except (NoWorker, aiohttp.ClientError, asyncio.TimeoutError, RuntimeError):  # not up yet: try again
            await asyncio.sleep(0.5)
    return comp, resp


async def concurrent(make_call, clients: int, seconds: float, cpu=dict) -> tuple[float, dict[str, float]]:
    """Requests/s of ``clients`` closed-loop clients over ``seconds`` (each client's requests made by
    its own ``make_call()``; a session client's include its session ends and opens), and the CPU
    seconds per request of each process ``cpu()`` reads."""
    done = 0
    cpu0 = cpu()
    t0 = time.perf_counter()
    stop_at = t0 + seconds

    async def client():
        nonlocal done
        call = make_call()
        while time.perf_counter() < stop_at:
            await asyncio.wait_for(call(), REQUEST_TIMEOUT_S)
            done += 1

    await asyncio.gather(*(client() for _ in range(clients)))
    rate = done / (time.perf_counter() - t0)
    return rate, {name: (used - cpu0[name]) / done for name, used in cpu().items()}


@dataclass
class Results:
    lat: dict[str, list[list[float]]]  # mode -> per round, each sequential request's latency (s)
    here_cpu: dict[str, list[float]]  # mode -> each sequential request's CPU seconds in this process
    rps: dict[str, list[float]]  # mode -> per round, requests/s with --clients clients
    cpu: dict[str, list[dict[str, float]]]  # mode -> per round, CPU seconds per request of each process
    stages: Stages


async def measure(args, system: System, clients: Clients, stages: Stages) -> Results:
    comp, resp = await wait_ready(system, clients)
    usage = resp["usage"]
    if usage["prompt_tokens"] != clients.prompt_ids.size or usage["completion_tokens"] != comp.output_ids.size:
        raise RuntimeError(f"the modes do different work: gateway usage {usage} vs direct prompt "
                           f"{clients.prompt_ids.size} / completion {comp.output_ids.size} tokens")
    agents = {mode: Agent(clients, mode) for mode in ("session", "lean session", "in-process")}
    for mode, agent in agents.items():
        if (await agent.turn())["usage"] != usage:
            raise RuntimeError(f"the {mode} path does different work from the gateway node's admin path")
    print(f"ready: prompt {clients.prompt_ids.size} tokens, completion {comp.output_ids.size} tokens "
          f"({comp.finish_reason}) in every mode", flush=True)
    calls = {"direct": clients.direct, "gateway": clients.gateway, "session": agents["session"].turn,
             "lean session": agents["lean session"].turn, "in-process": agents["in-process"].turn,
             "http floor": clients.health, "lean floor": clients.lean_health}
    prep = {mode: agent.renew_if_due for mode, agent in agents.items()}  # untimed: session end and open

    def per_client(mode: str):  # concurrent clients: each session mode's client is an agent of its own
        return (lambda: Agent(clients, mode).turn) if mode in agents else (lambda: calls[mode])
    for mode in MODES:  # warm-up: connections open, code paths and allocators warm
        for _ in range(50):
            if mode in prep:
                await prep[mode]()
            await calls[mode]()
        await concurrent(per_client(mode), args.clients, 0.3)
    res = Results({mode: [] for mode in calls}, {mode: [] for mode in calls}, {mode: [] for mode in MODES},
                  {mode: [] for mode in MODES}, stages)
    lat = res.lat

    def cpu_now() -> dict[str, float]:  # this process: the clients, its ZeroMQ I/O thread, the in-process app
        return {"this process": time.process_time(), "gateway node": system.cpu_s("gateway-0"),
                "rollout worker": system.cpu_s(WORKER)}
    for r in range(args.rounds):
        order = [*MODES[r % len(MODES):], *MODES[:r % len(MODES)], "http floor", "lean floor"]  # places by turns
        for mode in order:
            lat[mode].append([])
        for _ in range(args.requests):
            for mode in order:
                if mode in prep:
                    await prep[mode]()
                stages.on = mode == "in-process"
                t0, c0 = time.perf_counter(), time.process_time()
                await calls[mode]()
                lat[mode][-1].append(time.perf_counter() - t0)
                res.here_cpu[mode].append(time.process_time() - c0)
                stages.end(lat[mode][-1][-1])
        stages.on = False
        for mode in order[:-2]:
            rate, used = await concurrent(per_client(mode), args.clients, args.seconds, cpu_now)
            res.rps[mode].append(rate)
            res.cpu[mode].append(used)
        print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
            f"{mode} {pct(lat[mode][-1], 50):.2f} ms {res.rps[mode][-1]:.0f} req/s" for mode in MODES)
            + f"; load {os.getloadavg()[0]:.1f}", flush=True)
    return res


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1e3


def report(args, res: Results) -> None:
    lat, rps, cpu = res.lat, res.rps, res.cpu
    pooled = {mode: [x for rnd in rounds for x in rnd] for mode, rounds in lat.items()}
    p50 = {mode: pct(xs, 50) for mode, xs in pooled.items()}
    p99 = {mode: pct(xs, 99) for mode, xs in pooled.items()}
    med_rps = {mode: statistics.median(xs) for mode, xs in rps.items()}
    ratio = {mode: statistics.median(m / d for m, d in zip(rps[mode], rps["direct"])) for mode in MODES}
    per_round = {mode: [pct(m, 50) - pct(d, 50) for m, d in zip(lat[mode], lat["direct"])] for mode in MODES}
    print(f"\n{'mode':<13}{'p50 ms':>9}{'p99 ms':>9}{'+p50 ms':>9}{'+p99 ms':>9}{'req/s':>8}{'x direct':>9}"
          f"   +p50 ms per round")
    for mode in lat:
        if mode == "direct":
            extra = f"{'-':>9}{'-':>9}{med_rps[mode]:>8.0f}{'-':>9}"
        elif mode.endswith("floor"):
            extra = f"{'-':>9}{'-':>9}{'-':>8}{'-':>9}"
        else:
            extra = (f"{p50[mode] - p50['direct']:>+9.2f}{p99[mode] - p99['direct']:>+9.2f}{med_rps[mode]:>8.0f}"
                     f"{ratio[mode]:>9.2f}   {' '.join(f'{x:+.2f}' for x in per_round[mode])}")
        print(f"{mode:<13}{p50[mode]:>9.2f}{p99[mode]:>9.2f}{extra}")
    print(f"(p50 / p99 over {len(pooled['direct'])} sequential requests per mode; +: minus direct; req/s with "
          f"{args.clients} clients, median of {args.rounds} rounds; x direct: median of the rounds' ratios)")
    procs = list(cpu["direct"][0])
    print(f"\nCPU ms per request with {args.clients} clients (median of the rounds; the gateway node's in direct "
          f"and in-process mode is its idle cost):")
    print(f"{'mode':<13}" + "".join(f"{name:>16}" for name in procs))
    for mode in MODES:
        print(f"{mode:<13}" + "".join(f"{1e3 * statistics.median(c[name] for c in cpu[mode]):>16.3f}" for name in procs))

    # Per request, then the median of each stage: where the in-process gateway's time goes.
    rows = res.stages.rows
    parts = {
        "HTTP: aiohttp client + server, outside the handler": [r["e2e"] - r["handler"] for r in rows],
        "handler outside complete(): auth, body, parse, JSON response": [r["handler"] - r["complete"] for r in rows],
        "chat template + tokenize (renderer.prompt_ids)": [r["template"] for r in rows],
        "decode the completion (_postprocess)": [r["decode"] for r in rows],
        "rest of complete(): session task, response dict, log call": [
            r["complete"] - r["generate"] - r["template"] - r["decode"] for r in rows],
        "backend.generate from the gateway, minus direct p50": [r["generate"] - p50["direct"] / 1e3 for r in rows],
    }
    print(f"\nwhere the in-process gateway's +{p50['in-process'] - p50['direct']:.2f} ms go (median per stage over "
          f"{len(rows)} requests; medians do not add up exactly):")
    for name, xs in parts.items():
        print(f"  {name:<62}{pct(xs, 50):>7.3f} ms")
    added_p50, added_p99 = p50["session"] - p50["direct"], p99["session"] - p99["direct"]
    lean_p50, lean_p99 = p50["lean session"] - p50["direct"], p99["lean session"] - p99["direct"]
    admin_p50 = p50["gateway"] - p50["direct"]
    inproc = p50["in-process"] - p50["direct"]
    here = {mode: pct(res.here_cpu[mode], 50) for mode in ("direct", "in-process")}
    print(f"CPU of this process per sequential request (p50): direct {here['direct']:.2f} ms, in-process "
          f"{here['in-process']:.2f} ms: +{here['in-process'] - here['direct']:.2f} ms of CPU against +{inproc:.2f} ms "
          f"of latency")
    print(f"gateway node, session key +p50 {added_p50:.2f} ms (target <= 1 ms; admin token {admin_p50:+.2f} ms) = its "
          f"code +{inproc:.2f} ms (in-process) and its "
          f"own process on the path {added_p50 - inproc:+.2f} ms (an HTTP round trip to it alone: "
          f"{p50['http floor']:.2f} ms). Load at the end: {os.getloadavg()[0]:.1f}")
    print(f"the same session requests from a lean HTTP client: +p50 {lean_p50:.2f} ms, +p99 {lean_p99:.2f} ms (its bare "
          f"round trip to the gateway: {p50['lean floor']:.2f} ms): the gateway's own share of the aiohttp figure")
    print(f"RESULT added_p50_ms={added_p50:.3f} added_p99_ms={added_p99:.3f} direct_p50_ms={p50['direct']:.3f} "
          f"gateway_p50_ms={p50['session']:.3f} direct_p99_ms={p99['direct']:.3f} gateway_p99_ms={p99['session']:.3f} "
          f"gateway_rps={med_rps['session']:.1f} direct_rps={med_rps['direct']:.1f} rps_ratio={ratio['session']:.3f} "
          f"inproc_added_p50_ms={inproc:.3f} admin_added_p50_ms={admin_p50:.3f} lean_added_p50_ms={lean_p50:.3f} "
          f"lean_added_p99_ms={lean_p99:.3f}")


async def run(args, work: Path, token: str):
    port = free_port()
    topo_dict = topology(work, port)
    topo_path = work / "topology.yaml"
    topo_path.write_text(yaml.safe_dump(topo_dict, sort_keys=False))
    # The file says ${AREAL_BUS_ADMIN_TOKEN} (the nodes get it from their environment); parsed here with it.
    topo = parse_topology(json.loads(json.dumps(topo_dict).replace("${AREAL_BUS_ADMIN_TOKEN}", token)), str(topo_path))
    tokenizer = load_tokenizer(MODEL)
    prompt_ids = np.asarray(ChatRenderer(tokenizer).prompt_ids(MESSAGES, None), dtype=np.int32)
    env = dict(os.environ, AREAL_BUS_ADMIN_TOKEN=token, PYTHONUNBUFFERED="1",
               PATH=f"{AREAL_BUS.parent}:{os.environ.get('PATH', '')}")
    system = System(topo_path, work, env)
    ctx = zmq.Context()
    # Bound before the worker starts, so that its DEALER for gateway replica 1 connects at once.
    backend = BusBackend(ctx, topo.endpoint("gwork", 1), Encoder("bench-direct"), Metrics())
    # The in-process gateway: the node's app and config, logging to a file as the node does.
    cfg = topo.gateway_config().model_copy(update={"port": 0})  # max_context_tokens: the engine's max_len
    app = make_app(cfg, backend, tokenizer, log=setup_logging("gateway", work / "inproc", echo=False))
    stages = Stages(app)
    runner = None
    try:
        for kind in ("bus", "weights", "rollout", "gateway"):
            system.start(kind)
        runner = await start_server(app, cfg)
        urls = {"gateway": f"http://127.0.0.1:{port}", "in-process": f"http://127.0.0.1:{bound_port(runner)}"}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as http:
            clients = Clients(backend, http, urls, token, prompt_ids, args.max_tokens)
            res = await measure(args, system, clients, stages)
    finally:
        if runner is not None:
            await runner.cleanup()
        system.stop()
        backend.close()
        ctx.destroy(linger=0)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="rounds; each runs every mode")
    p.add_argument("--requests", type=int, default=300, help="sequential requests per mode per round (p50/p99)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients for requests/s")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds of concurrent load per mode per round")
    p.add_argument("--max-tokens", type=int, default=2, help="completion tokens per request (greedy)")
    args = p.parse_args()
    token = secrets.token_urlsafe(24)
    work = Path(tempfile.mkdtemp(prefix="ab-gw-", dir="/tmp"))  # ipc paths must stay short
    print(f"{time.strftime('%Y-%m-%d %H:%M')} {platform.node()}: {os.cpu_count()} cpus, load "
          f"{os.getloadavg()[0]:.1f}; python {platform.python_version()}, aiohttp {aiohttp.__version__}, "
          f"pyzmq {zmq.__version__}")
    print(f"{args.rounds} rounds x {args.requests} sequential requests per mode (taking turns) + {args.clients} "
          f"clients for {args.seconds:g} s per mode; max_tokens {args.max_tokens}, temperature 0; bus, weights, "
          f"rollout (torch, {MODEL.name}) and gateway nodes in {work}", flush=True)
    try:
        try:
            import uvloop
        except ImportError:
            res = asyncio.run(run(args, work, token))
        else:
            res = uvloop.run(run(args, work, token))  # the gateway node runs on uvloop too
    except BaseException:
        print(f"node logs kept in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
    report(args, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
