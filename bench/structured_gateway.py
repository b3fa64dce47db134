"""What a json_schema request costs the gateway: the first request of a schema (checked and compiled into a
grammar) and the same schema again (cached), against the same request without a schema, in one run.

The gateway (make_app) serves on a loopback port from this process's event loop, in front of a policy
that answers at once with a fixed reply (no engine: the gateway's own work is what is timed; the rollout
worker compiles the grammar for its tokenizer on its side, measured by bench/constrained.py). One client,
one request at a time, the modes taking turns request by request, so whatever else loads this shared
machine hits them alike:

    plain        POST /v1/chat/completions, no response_format                       (the baseline)
    first        the same with a json_schema seen for the first time (a property name made unique per
                 request): the schema checked, converted to a grammar by xgrammar, cached
    cached       the same with one schema sent every time: a cache hit
    tools        the tool below, not strict, tool_choice auto: no grammar         (the forced baseline)
    forced first / forced cached   tool_choice required with a strict tool of that schema: the schema
                 compiled as the arguments and composed with the family's call format (structural tags)

Two schemas: ``small`` (a pydantic model of 2 fields, as chat.completions.parse sends it) and ``large``
(16 properties: nested objects, arrays, enums, bounded strings and numbers, an optional field, a $ref).
Added = mode p50 - baseline p50 (and p99): plain's for first and cached, tools' for the forced modes (the
same tool rendered into the prompt, with no grammar). Below the table, the request's checks and grammar
timed as function calls (no HTTP): ``parse_chat_request`` + ``structured.compose`` with no schema, a new
one and a cached one. Not in the table: the first structured request of a gateway process also imports
xgrammar (and with it torch), in the compile's worker thread (about 2.3 s on this box, once).

Run:  .venv/bin/python bench/structured_gateway.py                     (about 30 s on 2 cores)
      .venv/bin/python bench/structured_gateway.py --requests 50       (smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import platform
import statistics
import time
from pathlib import Path

import aiohttp
import numpy as np
from transformers import AutoTokenizer

from areal_bus.config.node_configs import GatewayConfig
from areal_bus.wire.messages import Completion
from nodes.gateway import structured
from nodes.gateway.app import make_app, start_server
from nodes.gateway.openai_api import parse_chat_request
from nodes.gateway.parsers import TOOL_FORMATS, Formats
from nodes.gateway.server import bound_port

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-guess"
ADMIN = "bench-admin"
MESSAGES = [{"role": "user", "content": "Guess my number (1-16)."}]

SMALL = {"type": "object", "title": "Guess", "additionalProperties": False, "required": ["number", "direction"],
         "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 16, "title": "Number"},
                        "direction": {"type": "string", "enum": ["higher", "lower"], "title": "Direction"}}}

LARGE = {
    "type": "object", "additionalProperties": False,
    "$defs": {"Point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                        "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}},
    "properties": {
        "id": {"type": "string", "format": "uuid"}, "name": {"type": "string", "maxLength": 40},
        "kind": {"type": "string", "enum": ["a", "b", "c", "d"]}, "count": {"type": "integer", "minimum": 0},
        "score": {"type": "number", "minimum": 0, "maximum": 1}, "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "where": {"$ref": "#/$defs/Point"}, "path": {"type": "array", "items": {"$ref": "#/$defs/Point"}},
        "note": {"anyOf": [{"type": "string", "maxLength": 80}, {"type": "null"}]},
        "when": {"type": "string", "format": "date-time"}, "email": {"type": "string", "format": "email"},
        "level": {"type": "integer", "minimum": 1, "maximum": 5},
        "meta": {"type": "object", "additionalProperties": False, "required": ["source", "version"],
                 "properties": {"source": {"type": "string", "pattern": "^[a-z]+$"},
                                "version": {"type": "integer"}}},
        "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
        "mode": {"const": "fast"}}}
LARGE["required"] = list(LARGE["properties"])


class InstantPolicy:
    """A policy that answers every request at once with the same reply (the gateway's work is what is timed)."""

    streams_tokens = False
    max_context_tokens = 4096

    def __init__(self, tok):
        self.ids = np.asarray([*tok.encode('{"number": 8, "direction": "higher"}', add_special_tokens=False),
                               tok.eos_token_id], np.int32)

    async def generate(self, session_id, prompt_ids, params):
        n = self.ids.size
        return Completion("r", session_id, 0, "instant", self.ids, np.zeros(n, np.float32), np.zeros(n, np.int32),
                          "stop")

    def close(self):
        pass


def renamed(schema: dict, k: int) -> dict:
    """``schema`` with a property name of its own: a schema the gateway has not seen."""
    props = {(f"p{k}_{name}" if i == 0 else name): v for i, (name, v) in enumerate(schema["properties"].items())}
    required = [f"p{k}_{schema['required'][0]}", *schema["required"][1:]]
    return {**schema, "properties": props, "required": required}


def body(mode: str, schema: dict | None) -> dict:
    out = {"model": "policy", "messages": MESSAGES, "max_tokens": 40}
    if mode == "plain":
        return out
    if mode == "tools" or mode.startswith("forced"):
        tool = {"type": "function", "function": {"name": "answer", "parameters": schema, "strict": mode != "tools"}}
        return {**out, "tools": [tool], "tool_choice": "auto" if mode == "tools" else "required"}
    return {**out, "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                                              "strict": True}}}


async def measure(requests: int, schemas: dict) -> dict:
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    cfg = GatewayConfig(admin_token=ADMIN, port=0, max_context_tokens=4096)
    app = make_app(cfg, InstantPolicy(tok), tok, emit=lambda t: None)
    runner = await start_server(app, cfg)
    url = f"http://127.0.0.1:{bound_port(runner)}/v1/chat/completions"
    fresh = itertools.count()
    modes = ["plain", "first", "cached", "tools", "forced first", "forced cached"]
    times = {(name, m): [] for name in schemas for m in modes}
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as http:
            for name, schema in schemas.items():
                for mode in modes:  # warm every path once (imports, first compiles of the fixed schemas)
                    async with http.post(url, json=body(mode, schema)) as r:
                        assert r.status == 200, await r.text()
                for _ in range(requests):
                    for mode in modes:
                        s = renamed(schema, next(fresh)) if mode.endswith("first") else schema
                        payload = json.dumps(body(mode, s)).encode()
                        t0 = time.perf_counter()
                        async with http.post(url, data=payload, headers={"Content-Type": "application/json"}) as r:
                            await r.read()
                        times[(name, mode)].append(time.perf_counter() - t0)
                        assert r.status == 200
    finally:
        await runner.cleanup()
    return times


def direct(schema: dict, repeats: int) -> tuple[float, float, float]:
    """(plain, new schema, cached schema) ms of parse_chat_request + structured.compose, as function calls:
    the checks, the compile and the composition without HTTP."""
    fmt = Formats(TOOL_FORMATS["hermes"], None)
    plain, new, hit = [], [], []
    for k in range(repeats):
        for out, b in ((plain, body("plain", None)), (new, body("first", renamed(schema, 10**6 + k))),
                       (hit, body("cached", schema))):
            t0 = time.perf_counter()
            structured.compose(parse_chat_request(b).wanted, fmt)
            out.append(time.perf_counter() - t0)
    return tuple(statistics.median(x) * 1e3 for x in (plain, new, hit))


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests of each mode and schema")
    args = ap.parse_args()
    schemas = {"small": SMALL, "large": LARGE}
    times = asyncio.run(measure(args.requests, schemas))
    print(f"# {time.strftime('%Y-%m-%d')} {platform.node()} {platform.processor() or platform.machine()}, "
          f"{args.requests} requests per row, sequential, one client")
    print("| schema | mode | p50 ms | p99 ms | added p50 ms | added p99 ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    result = []
    for name in schemas:
        for mode in ("plain", "first", "cached", "tools", "forced first", "forced cached"):
            base = "tools" if mode.startswith("forced") else "plain"
            base50, base99 = pct(times[(name, base)], 50), pct(times[(name, base)], 99)
            p50, p99 = pct(times[(name, mode)], 50), pct(times[(name, mode)], 99)
            added = "- | -" if mode in ("plain", "tools") else f"{p50 - base50:+.2f} | {p99 - base99:+.2f}"
            print(f"| {name} | {mode} | {p50:.2f} | {p99:.2f} | {added} |")
            if mode not in ("plain", "tools"):
                result.append(f"{name}_{mode.replace(' ', '_')}_added_p50_ms={p50 - base50:.2f}")
    for name, schema in schemas.items():
        plain, new, hit = direct(schema, 50)
        print(f"{name}: parse_chat_request + structured.compose as calls (median): no schema {plain:.3f} ms, "
              f"new schema {new:.2f} ms, cached {hit:.3f} ms")
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
