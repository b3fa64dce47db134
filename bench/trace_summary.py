"""Where one trainer update's time goes, read from a torch profiler trace: is the GPU waiting for the host?

bench/trainer.py --trace FILE writes the chrome trace of one timed update (the engine marks its phases
with ``torch.profiler.record_function``: update.pack, update.proximal, update.forward, update.backward,
update.step). This prints, for that update:

* the window (first phase start to last kernel end), the device's busy time (the union of its kernels,
  copies and fills) and so its idle share;
* per phase: host time, the device time of the kernels launched in it, and the kernels' median
  *queue delay* (kernel start minus its launch call): a delay of microseconds means the device ran each
  kernel as soon as the host asked (host-bound), milliseconds mean the host ran ahead (device-bound);
* the longest device idle gaps and the phase whose launch ended each;
* the CUDA runtime calls by total host time (a launch that blocks shows here: the launch queue is full);
* the busiest kernels by device time.

The profiler's trace is the input because it is what torch writes; nothing here needs a GPU.

Run:  python3 bench/trainer.py --shapes 0.5b --paths engine:compute_copy+compile --steps 1 --trace /tmp/t.json
      python3 bench/trace_summary.py /tmp/t.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import defaultdict

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return [e for e in data.get("traceEvents", data) if e.get("ph") == "X" and "dur" in e]


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def innermost(phases: list[dict], ts: float) -> str:
    """The shortest phase (user annotation) that contains host time ``ts``."""
    best = None
    for p in phases:
        if p["ts"] <= ts <= p["ts"] + p["dur"] and (best is None or p["dur"] < best["dur"]):
            best = p
    return best["name"] if best else "(none)"


def summarise(events: list[dict], top: int = 10) -> str:
    phases = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("update.")]
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    if not device:
        return "no device events in the trace (a CPU run?)"
    launch_by_corr = {e["args"].get("correlation"): e for e in runtime if "args" in e}
    t0 = min([p["ts"] for p in phases] or [min(e["ts"] for e in device)])
    t1 = max(e["ts"] + e["dur"] for e in device)
    busy = union([(e["ts"], e["ts"] + e["dur"]) for e in device if e["ts"] + e["dur"] >= t0])
    busy_s = sum(e - s for s, e in busy) / 1e6
    window = (t1 - t0) / 1e6
    lines = [f"window {window:.3f} s, device busy {busy_s:.3f} s ({busy_s / window:.0%}), "
             f"{len(device)} device events, {len(runtime)} runtime calls"]

    per: dict[str, dict] = defaultdict(lambda: {"host": 0.0, "dev": 0.0, "delays": [], "n": 0})
    for p in phases:
        per[p["name"]]["host"] += p["dur"] / 1e6
    for k in device:
        launch = launch_by_corr.get(k.get("args", {}).get("correlation"))
        name = innermost(phases, launch["ts"]) if launch else "(no launch)"
        per[name]["dev"] += k["dur"] / 1e6
        per[name]["n"] += 1
        if launch:
            per[name]["delays"].append(k["ts"] - (launch["ts"] + launch["dur"]))
    lines.append(f"{'phase':22} {'host s':>7} {'device s':>8} {'kernels':>7} {'median queue delay':>19}")
    for name, v in sorted(per.items(), key=lambda kv: -kv[1]["dev"]):
        delay = f"{statistics.median(v['delays']) / 1e3:.2f} ms" if v["delays"] else "-"
        lines.append(f"{name:22} {v['host']:7.3f} {v['dev']:8.3f} {v['n']:7d} {delay:>19}")

    gaps = [(busy[i + 1][0] - busy[i][1], busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)]
    first_gap = (busy[0][0] - t0, t0, busy[0][0]) if busy else None
    idle = sum(g for g, _, _ in gaps) / 1e6 + (first_gap[0] / 1e6 if first_gap else 0)
    lines.append(f"device idle {idle:.3f} s in {len(gaps)} gaps between kernels (+{first_gap[0] / 1e3:.1f} ms before "
                 f"the first); gaps over 1 ms: {sum(1 for g, _, _ in gaps if g > 1e3)} totalling "
                 f"{sum(g for g, _, _ in gaps if g > 1e3) / 1e6:.3f} s; under 20 us: "
                 f"{sum(g for g, _, _ in gaps if g < 20) / 1e6:.3f} s")
    starts = {e["ts"]: e for e in device}
    lines.append("longest gaps (ms, at ms into the window, the phase that launched the kernel ending it):")
    for g, s, e in sorted(gaps, reverse=True)[:top]:
        k = starts.get(e)
        launch = launch_by_corr.get(k.get("args", {}).get("correlation")) if k else None
        where = innermost(phases, launch["ts"]) if launch else "?"
        lines.append(f"  {g / 1e3:7.2f} at {(s - t0) / 1e3:8.1f}  {where}  next: {(k or {}).get('name', '?')[:60]}")

    api: dict[str, list[float]] = defaultdict(list)
    for r in runtime:
        api[r["name"]].append(r["dur"])
    lines.append("runtime calls by host time: name, calls, total ms, median us, max us")
    for name, d in sorted(api.items(), key=lambda kv: -sum(kv[1]))[:8]:
        lines.append(f"  {name[:40]:40} {len(d):6d} {sum(d) / 1e3:9.1f} {statistics.median(d):8.1f} {max(d):9.1f}")

    kern: dict[str, list[float]] = defaultdict(list)
    for k in device:
        kern[k["name"]].append(k["dur"])
    lines.append("kernels by device time: calls, total ms, name")
    for name, d in sorted(kern.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {len(d):6d} {sum(d) / 1e3:8.1f}  {name[:90]}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a chrome trace (.json or .json.gz) from torch.profiler")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    print(summarise(load(args.trace), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
