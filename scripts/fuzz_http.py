"""Fuzz the gateway's HTTP side for N minutes: the generators and checks of tests/test_fuzz_http.py, run in
rounds with fresh random seeds against one standalone gateway process, watching its memory and descriptors.

Each round sends --examples generated requests (valid OpenAI / Anthropic / session requests, mutated:
wrong types, missing fields, huge numbers, unicode junk, deep nesting, invalid UTF-8, oversized bodies,
garbage paths and methods, bad Authorization headers, broken framing) and checks every reply: below 500,
refusals in the API's error shape with Retry-After on a 429, each counted by the gateway. After each
round: the gateway's RSS and open descriptors, and its refusal counters against the replies seen.
Stops at the first failure, printing the request that caused it (hypothesis shrinks it first) and the
seed that replays it (--seed).

    .venv/bin/python scripts/fuzz_http.py --minutes 10
    .venv/bin/python scripts/fuzz_http.py --minutes 1 --examples 500     (a quick look)

The last line is ``RESULT minutes=... requests=... rejected=... failures=0 rss_mib=first/last
rss_growth_after_warmup_mib=... fds=first/last``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.test_fuzz_http import Target, fuzz, start_gateway  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long to fuzz")
    p.add_argument("--examples", type=int, default=2000, help="requests per round (a round has one seed)")
    p.add_argument("--seed", type=int, default=None, help="replay one round's seed (then one round only)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ab-fuzz-", dir="/tmp"))
    print(f"{time.strftime('%Y-%m-%d %H:%M')}: {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}; gateway "
          f"output in {work}", flush=True)
    target = Target(start_gateway(work))
    rows, failure, t0 = [], None, time.monotonic()
    print(f"{'round':>5}{'seed':>12}{'requests':>10}{'4xx':>7}{'counted':>9}{'RSS MiB':>9}{'fds':>5}{'elapsed s':>11}")
    try:
        while time.monotonic() - t0 < args.minutes * 60 and failure is None:
            seed = args.seed if args.seed is not None else random.randrange(2 ** 32)
            before = target.counters().get("http.rejected", 0)
            target.refused = target.unanswered = 0
            try:
                fuzz(target, args.examples, seed=seed)
            except Exception as exc:  # deliberately caught: reported with its seed, then the run stops
                failure = (seed, exc)
            counted = target.counters().get("http.rejected", 0) - before
            rows.append((seed, target.refused, counted, target.child.rss_bytes() >> 20, target.child.open_fds()))
            print(f"{len(rows):>5}{seed:>12}{args.examples:>10}{target.refused:>7}{counted:>9.0f}{rows[-1][3]:>9}"
                  f"{rows[-1][4]:>5}{time.monotonic() - t0:>11.0f}", flush=True)
            if failure is None and not target.refused <= counted <= target.refused + target.unanswered:
                failure = (seed, AssertionError(f"{target.refused} refusals seen, {counted:.0f} counted"))
            if failure is None and not target.child.alive():
                failure = (seed, AssertionError("the gateway process died"))
            if args.seed is not None:
                break
        failed_counters = {k: v for k, v in target.counters().items() if k.startswith("http.failed")}
        if failure is None and failed_counters:
            failure = (None, AssertionError(f"the gateway counted failures: {failed_counters}"))
    finally:
        code = target.child.stop()
    if failure is None and code != 0:
        failure = (None, AssertionError(f"the gateway exited {code}"))
    minutes = (time.monotonic() - t0) / 60
    rss = [r[3] for r in rows]
    warm = rss[min(2, len(rss) - 1)] if rss else 0
    if failure is not None:
        seed, exc = failure
        print(f"\nFAILED (replay with --seed {seed}): {exc}\ngateway output kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(f"RESULT minutes={minutes:.1f} requests={len(rows) * args.examples} rejected={sum(r[1] for r in rows)} "
          f"failures={int(failure is not None)} rss_mib={rss[0] if rss else 0}/{rss[-1] if rss else 0} "
          f"rss_growth_after_warmup_mib={(rss[-1] - warm) if rss else 0} "
          f"fds={rows[0][4] if rows else 0}/{rows[-1][4] if rows else 0}")
    return int(failure is not None)


if __name__ == "__main__":
    sys.exit(main())
