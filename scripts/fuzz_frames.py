"""Fuzz the bus for minutes: garbled and mutated frames into decode and into every socket the nodes of
a simulated system bind (tests/test_fuzz_frames.py is the bounded run of the same thing).

Each round: mutated messages straight into ``decode`` (anything but a DecodeError is a bug), then
refused frames into every data channel and onto the hub (every node must count each exactly once),
and junk that cannot be counted exactly (other topics, XPUB subscriptions, raw bytes into the ipc
paths); after it every node must be alive and training must have gone on. The last fifth of the time
sends well-typed messages with extreme values (survival only: some are state a node rightly acts on).
No node's resident memory may grow past --rss-mb over the run. Prints a line per round and ends with
``RESULT ...``; exits 1 on the first failure, naming the seed.

    .venv/bin/python scripts/fuzz_frames.py --minutes 10 [--seed 7] [--per-round 300]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_bus.wire.codec import DecodeError, decode  # noqa: E402
from tests.fuzzing import Fuzzer, FuzzSystem, Mutator  # noqa: E402


def decode_round(mut: Mutator, n: int) -> int:
    """``n`` mutated messages into decode; returns how many it refused."""
    refused = 0
    for i in range(n):
        frames = mut.garble() if i % 4 else mut.odd_values()
        try:
            decode(frames)
        except DecodeError:
            refused += 1
    return refused


def settled_drops(system: FuzzSystem, quiet_s: float = 2.0, timeout: float = 60) -> dict[str, int]:
    """Every node's drop count once none has changed for ``quiet_s`` (four heartbeats)."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        system.poll_beats(250)
        system.assert_alive()
        now = {k: system.dropped(k) for k in system.procs}
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
    raise AssertionError(f"drop counts never settled: {last}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="how long to fuzz")
    ap.add_argument("--seed", type=int, default=int(time.time()), help="replays a run exactly (default: the clock)")
    ap.add_argument("--per-round", type=int, default=300, help="refused frames per channel per round")
    ap.add_argument("--rss-mb", type=float, default=64.0, help="most a node's resident memory may grow over the run")
    ap.add_argument("--keep", action="store_true", help="keep the system's folder (logs) afterwards")
    args = ap.parse_args()

    system = FuzzSystem()
    print(f"fuzz_frames seed={args.seed} minutes={args.minutes} dir={system.dir}", flush=True)
    ok, rounds, sent, decoded = False, 0, 0, 0
    try:
        system.start(timeout=120)
        system.wait(lambda: system.version() >= 2, 120, "the system to train two updates")
        system.poll_beats(600)
        rss0 = {k: system.rss_mb(k) for k in system.procs}
        expected = {k: system.dropped(k) for k in system.procs}
        mut = Mutator(random.Random(args.seed))
        start = time.monotonic()
        odd_from, end = start + 0.8 * args.minutes * 60, start + args.minutes * 60
        while time.monotonic() < odd_from:
            rounds += 1
            t0 = time.monotonic()
            decoded += decode_round(mut, 10 * args.per_round)
            version = system.version()
            fuzz = Fuzzer(system, args.seed * 1_000_003 + rounds)
            try:
                more = fuzz.counted(args.per_round)
                expected = {k: expected[k] + more[k] for k in expected}
                system.wait(lambda: all(system.dropped(k) >= expected[k] for k in expected), 120,
                            f"round {rounds}: every refused frame to be counted (expected {expected})")
                time.sleep(1.0)
                system.poll_beats(600)
                counted = {k: system.dropped(k) for k in expected}
                assert counted == expected, f"round {rounds}: counted {counted}, expected {expected}"
                fuzz.uncounted(args.per_round // 5)
                system.wait(lambda: system.version() > version, 120, f"round {rounds}: training to go on")
            finally:
                fuzz.close()
            # Uncounted and odd frames may have added drops: the next round counts from where they settle.
            expected = settled_drops(system)
            sent += sum(more.values())
            grown = {k: round(system.rss_mb(k) - rss0[k], 1) for k in system.procs}
            print(f"round={rounds} s={time.monotonic() - t0:.1f} counted_total={sent} decode_refused={decoded} "
                  f"version={system.version()} rss_growth_mb={grown}", flush=True)
            assert max(grown.values()) < args.rss_mb, f"resident memory grew past {args.rss_mb} MB: {grown}"
        # Last: well-typed messages with extreme values. Some are plausible state (a RunState saying the
        # run finished, a version from far ahead) that a node rightly acts on, so from here on only
        # survival and memory are checked, not progress.
        odd = Fuzzer(system, args.seed * 1_000_003)
        try:
            while time.monotonic() < end:
                odd.odd(args.per_round)
                t0 = time.monotonic()
                while time.monotonic() - t0 < 2.0:
                    system.poll_beats(200)
                    system.assert_alive()
                grown = {k: round(system.rss_mb(k) - rss0[k], 1) for k in system.procs}
                print(f"odd round: rss_growth_mb={grown}", flush=True)
                assert max(grown.values()) < args.rss_mb, f"resident memory grew past {args.rss_mb} MB: {grown}"
        finally:
            odd.close()
        ok = True
    except AssertionError as err:
        print(f"FAIL seed={args.seed}: {err}", flush=True)
    except Exception:  # a bug in decode or the harness: show it whole
        traceback.print_exc()
        print(f"FAIL seed={args.seed}", flush=True)
    finally:
        codes = system.stop()
        if any(codes.values()):
            ok = False
            print(f"FAIL nodes exited with {codes}; logs in {system.dir}", flush=True)
        system.cleanup(keep=args.keep or not ok)
    print(f"RESULT ok={int(ok)} seed={args.seed} rounds={rounds} counted_frames={sent} decode_refused={decoded}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
