"""Faults other than a clean kill (issue 17 items 1-5), each injected into a real system, with the counts.

One small simulated topology (bench/chaos.py's: bus, agent, 2 rollout workers, reward, trainer, weight
broadcaster; no gateway) under a real supervisord per scenario; the fault is injected mid-run, the run
must finish by itself, and the ledger audit (areal_bus.runtime.ledger.audit) gives the counts:

  baseline      no fault (the counts every other row is compared with)
  poisoned      two trajectories pushed on the train channel: one misaligned (refused on arrival), one
                valid that kills the trainer in its update (the test-only fault AREAL_BUS_TEST_CRASH_ON,
                a SIGSEGV in the update: nodes/trainer/wiring.py); quarantined after it is alone
  garbled_ckpt  the newest checkpoint's run_state.json overwritten with garbage, then the trainer kill -9:
                recovery passes it over (logged at error) and loads the one before; the spool still holds
                what that one does not cover
  rollout_fast  rollout-0 kill -9, restarted by supervisord within the 2 s liveness window
  forged_ver    VersionAnnounce messages on the hub from outside: a lineage that sorts higher as a string,
                and a version 10^6 ahead; refused (counted as version_refused.* by every rollout worker)
  supervisord   supervisord and every node kill -9 (a host crash), then a new supervisord with
                AREAL_BUS_RESUME=1 (what `areal-bus run --resume` passes): the run resumes from the spool

Columns: accepted, trained, rejected (refused on arrival), quarantined (accepted, then failed or killed
the trainer), lost, duplicated (both must be 0), recovered (what the scenario's recovery did: trainer
restarts, checkpoints skipped, refused announcements, resumed runs). Not here, tested instead: the
ledger on a full disk (tests/test_ledger.py, a 64 KB tmpfs) and a gateway killed with acknowledged
sessions (tests/test_gateway_wal.py).

Run: .venv/bin/python bench/faults.py                  (about 4 minutes on 2 cores)
     .venv/bin/python bench/faults.py --only poisoned  (one scenario)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from areal_bus.wire import messages as m  # noqa: E402
from areal_bus.wire.codec import Encoder, pack_topic  # noqa: E402
from areal_bus.runtime.ledger import audit  # noqa: E402
from bench.chaos import BIN, Supervised, topology  # noqa: E402

STEPS = 80
SAVE_INTERVAL = 5
RUN_TIMEOUT_S = 240


def _steps(sysm: Supervised) -> list[dict]:
    path = sysm.dir / "logs" / "train_steps.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)
    return got


def _version(sysm: Supervised) -> int:
    steps = [s for s in _steps(sysm) if s.get("samples")]
    return steps[-1]["step"] + 1 if steps else 0


def _traj(traj_id: str, version: int, n: int = 6, logprobs: int | None = None) -> m.Trajectory:
    return m.Trajectory(traj_id=traj_id, episode_id=traj_id, ticket=0, worker="rollout-0",
                        prompt_ids=np.arange(1, 9, dtype=np.int32), output_ids=np.arange(10, 10 + n, dtype=np.int32),
                        logprobs=np.full(n if logprobs is None else logprobs, -0.5, np.float32),
                        versions=np.full(n, version, np.int32), loss_mask=np.ones(n, np.int32), reward=1.0,
                        source="faults:1")


def _push(endpoint: str, frames_list: list[list], pub: bool = False) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB if pub else zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    try:
        sock.connect(endpoint)
        if pub:
            time.sleep(0.5)  # the hub's side of the connection, before anything is published
        for frames in frames_list:
            sock.send_multipart(frames)
    finally:
        sock.close()
        ctx.term()


def _log_count(sysm: Supervised, name: str, needle: str) -> int:
    path = sysm.dir / "logs" / name
    return sum(needle in line for line in path.read_text().splitlines()) if path.exists() else 0


# -- the faults ------------------------------------------------------------------------------------
def baseline(sysm: Supervised) -> dict:
    return {}


def poisoned(sysm: Supervised) -> dict:
    _wait(lambda: _version(sysm) >= 5, 120, "five updates")
    v = _version(sysm)
    enc = Encoder("faults/bench")
    _push(sysm.topo.endpoint("train"), [enc.encode(_traj("poison-misaligned", v, logprobs=2)),
                                        enc.encode(_traj("killer-1", v))])
    return {}


def garbled_ckpt(sysm: Supervised) -> dict:
    ckpts = sysm.dir / "logs" / "checkpoints"
    _wait(lambda: len(list(ckpts.glob("step_*/manifest.json"))) >= 3, 120, "three sealed checkpoints")
    newest = max(ckpts.glob("step_*/manifest.json"), key=lambda p: int(p.parent.name[5:])).parent
    (newest / "run_state.json").write_bytes(b"\x00garbled{" * 8)
    sysm.kill("trainer-0")
    return {}


def rollout_fast(sysm: Supervised) -> dict:
    _wait(lambda: _version(sysm) >= 5, 120, "five updates")
    t0 = time.monotonic()
    sysm.kill("rollout-0")
    return {"restart_s": round(time.monotonic() - t0, 2)}


def forged_ver(sysm: Supervised) -> dict:
    _wait(lambda: _version(sysm) >= 5, 120, "five updates")
    enc = Encoder("weights/forged")
    forged = [m.VersionAnnounce(version=_version(sysm) + 1, location="shm:forged@1", nbytes=0,
                                published_at=time.time(), lineage="~" * 30),
              m.VersionAnnounce(version=10**6, location="shm:forged@2", nbytes=0, published_at=time.time(),
                                lineage="0")]
    _push(sysm.topo.endpoint("hub_in"), [pack_topic(m.TOPIC_VERSION, enc.encode(f)) for f in forged], pub=True)
    return {}


def supervisord(sysm: Supervised) -> dict:
    _wait(lambda: _version(sysm) >= 8, 120, "eight updates")
    pids = [pid for _, pid in sysm.status().values() if pid]
    sysm.proc.send_signal(signal.SIGKILL)
    sysm.proc.wait(10)
    for pid in pids:  # the host went down: every node with it (they would outlive a killed supervisord)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(1.0)
    sysm.env = {**sysm.env, "AREAL_BUS_RESUME": "1"}
    sysm.start()
    return {"resumed": 1}


SCENARIOS = {"baseline": baseline, "poisoned": poisoned, "garbled_ckpt": garbled_ckpt,
             "rollout_fast": rollout_fast, "forged_ver": forged_ver, "supervisord": supervisord}


def run(name: str) -> dict:
    topo = topology(f"faults-{name}", True, STEPS, Path("/tmp"), False, SAVE_INTERVAL)
    topo["staleness_threshold"] = 4  # an injected row carries the version at injection: let it train
    sysm = Supervised(topo, f"faults-{name}")
    if name == "poisoned":
        sysm.env["AREAL_BUS_TEST_CRASH_ON"] = "killer-"
    try:
        sysm.start()
        sysm.wait_all_running(60)
        extra = SCENARIOS[name](sysm)
        wall = sysm.wait(RUN_TIMEOUT_S)
        result = audit(sysm.dir / "logs")
        recovered = {"trainer_starts": result["trainer_incarnations"],
                     "ckpt_skipped": _log_count(sysm, "train.log", "checkpoint_skipped"),
                     "version_refused_lines": _log_count(sysm, "rollout.log", "version_refused"), **extra}
        return {"fault": name, "wall_s": round(wall, 1), "accepted": result["accepted"], "trained": result["trained"],
                "rejected": result["rejected"], "quarantined": result["quarantined"], "lost": result["lost"],
                "duplicated": result["duplicated"], "stale": result["dropped_stale"],
                "unconsumed": result["unconsumed_at_end"],
                "finished": result["finished"], "recovered": recovered}
    finally:
        sysm.cleanup(None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=list(SCENARIOS), action="append", help="run only these scenarios")
    args = ap.parse_args()
    rows = []
    for name in args.only or list(SCENARIOS):
        print(f"- {name} ...", flush=True)
        try:
            rows.append(run(name))
        except (RuntimeError, subprocess.SubprocessError) as err:
            rows.append({"fault": name, "error": str(err)[:200]})
        print(f"  {rows[-1]}", flush=True)
    cols = ("accepted", "trained", "rejected", "quarantined", "lost", "duplicated", "stale")
    print(f"\n{'fault':<14}" + "".join(f"{c:>12}" for c in cols) + "  recovered")
    for r in rows:
        if "error" in r:
            print(f"{r['fault']:<14}  FAILED: {r['error']}")
            continue
        rec = ", ".join(f"{k}={v}" for k, v in r["recovered"].items() if v)
        print(f"{r['fault']:<14}" + "".join(f"{r[c]:>12}" for c in cols) + f"  {rec}")
    bad = [r["fault"] for r in rows if "error" in r or r["lost"] or r["duplicated"] or not r["finished"]]
    print(f"\n{'every run finished, lost 0, duplicated 0' if not bad else 'NOT CLEAN: ' + ', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
