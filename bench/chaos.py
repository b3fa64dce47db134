"""Chaos: kill -9 random nodes of a running system mid-run, let supervisord restart them, and audit
that every trajectory the trainer accepted was trained on exactly once or dropped as over-stale.

Three whole systems of one small simulated topology (bus, agent, gateway, 2 rollout workers, reward,
trainer, weight broadcaster) under a real supervisord:

  off    durability.spool false, no kills: the throughput baseline
  on     durability.spool true, no kills: what durability costs
  chaos  durability.spool true, N kills -9, spread over every node kind present (gateway, agent,
         rollout, reward, trainer, weights), one at a time, each process back up before the next

The audit (areal_bus.runtime.ledger.audit) reads the ledger under logs/ledger/: ids each episode source
produced, ids the trainer accepted (committed to its spool), and the ids of every update and stale
drop with the trainer incarnation that made it; the final lineage is followed back through the
checkpoints each restarted trainer resumed from. lost = accepted but neither trained nor dropped in
the final lineage nor waiting at the end; duplicated = trained or dropped twice in it. Both must be 0.
Throughput is trained samples per second of the whole run (first trainer start to finish), so the
chaos run's figure includes the restarts and the re-training of what a killed trainer lost.

Run: .venv/bin/python bench/chaos.py --kills 24          (about 4 minutes on 2 cores)
     .venv/bin/python bench/chaos.py --kills 6 --quick   (a smoke test)
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from areal_bus.runtime.ledger import audit, read  # noqa: E402
from areal_bus.launch.render import program_name, write_conf  # noqa: E402
from areal_bus.config.topology import NODE_KINDS, parse_topology  # noqa: E402

BIN = Path(sys.executable).parent

RESTART_TIMEOUT_S = 60
"""How long a killed process may take to be RUNNING again: supervisord's startsecs (1 s) plus a
loaded 2-core box."""


def topology(name: str, spool: bool, steps: int, ipc_dir: Path, gateway: bool, save_interval: int) -> dict:
    nodes = {"bus": {}, "agent": {"replicas": 1}, "reward": {"replicas": 1}, "trainer": {}, "weights": {}}
    if gateway:  # idle (nobody opens a session) but a real node: its restart is what is tested
        nodes["gateway"] = {"config": {"port": 0, "admin_token": "chaos-bench-token"}}
    return {
        "name": name, "rollout_workers": 2, "staleness_threshold": 2, "queue_max_size": 64,
        "trigger_batch_size": 4, "global_batch_size": 8, "mini_batch_size": 4, "max_steps": steps,
        "logging": {"log_dir": "logs", "log_interval": 10, "save_interval": save_interval},
        "durability": {"spool": spool},
        "model": {"path": str(ROOT / "models" / "tiny-guess")},  # the gateway's tokenizer
        "agent": {"framework": "sim", "max_turns": 1, "reward_source": "rule", "prompt_len": 16},
        "rollout_engine": {"kind": "sim", "max_batch": 8, "decode_step_s": 0.002, "decode_step_per_seq_s": 0.00001,
                           "swap_s": 0.001, "output_len": {"dist": "uniform", "min": 8, "max": 48}},
        "trainer_engine": {"kind": "sim", "time_per_token_s": 0.00002, "update_overhead_s": 0.02},
        "endpoints": {"transport": "ipc", "ipc_dir": str(ipc_dir)},
        "nodes": nodes,
    }


class Supervised:
    """One supervisord-run system in a short temp folder (ipc paths must stay short)."""

    def __init__(self, topo: dict, name: str):
        self.dir = Path(tempfile.mkdtemp(prefix=f"ab-{name}-", dir="/tmp"))
        topo["endpoints"]["ipc_dir"] = str(self.dir / "ipc")
        self.topo_path = self.dir / "topology.yaml"
        self.topo_path.write_text(yaml.safe_dump(topo, sort_keys=False))
        self.topo = parse_topology(topo, str(self.topo_path))
        self.conf = write_conf(self.topo, self.topo_path, self.dir / "supervisord.conf")
        self.env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([str(BIN / "supervisord"), "-c", str(self.conf)], cwd=self.dir, env=self.env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def status(self) -> dict[str, tuple[str, int | None]]:
        out = subprocess.run([str(BIN / "supervisorctl"), "-c", str(self.conf), "status"], cwd=self.dir,
                             env=self.env, capture_output=True, text=True, timeout=30).stdout
        got = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] in self.processes():
                pid = int(parts[3].rstrip(",")) if len(parts) > 3 and parts[2] == "pid" else None
                got[parts[0]] = (parts[1], pid)
        return got

    def processes(self) -> list[str]:
        # A supervisord program per replica, named as its node (areal_bus.launch.render.program_name).
        return [program_name(k, i) for k in NODE_KINDS for i in range(self.topo.replicas(k))]

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait_all_running(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.running():
            st = self.status()
            if all(st.get(p, ("",))[0] == "RUNNING" for p in self.processes()):
                return st
            time.sleep(0.3)
        raise RuntimeError(f"not every process RUNNING within {timeout:.0f} s: {self.status()}")

    def kill(self, process: str) -> bool:
        """kill -9 the process and wait until supervisord has it RUNNING again under a new pid.
        False if the run ended meanwhile."""
        state, pid = self.status().get(process, (None, None))
        if state != "RUNNING" or pid is None:
            return False
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.running():
                return True  # the trainer finished meanwhile: the kill still happened
            state, new = self.status().get(process, (None, None))
            if state == "RUNNING" and new not in (None, pid):
                return True
            time.sleep(0.2)
        raise RuntimeError(f"{process} not restarted within {RESTART_TIMEOUT_S} s")

    def wait(self, timeout: float) -> float:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise RuntimeError(f"{self.dir}: the run did not finish within {timeout:.0f} s") from None
        if rc != 0:
            raise RuntimeError(f"{self.dir}: supervisord exited {rc}")
        return time.monotonic() - self.t0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def tracebacks(self) -> dict[str, str]:
        """Process log -> the last line of its last traceback (the exception)."""
        out = {}
        for p in sorted((self.dir / "logs" / "supervisor").glob("*.log")):
            text = p.read_text()
            if "Traceback" in text:
                lines = [x for x in text.rsplit("Traceback", 1)[1].splitlines() if x.strip()]
                out[p.stem] = lines[-1][:160] if lines else "?"
        return out

    def cleanup(self, keep: Path | None) -> None:
        self.stop()
        if keep is not None:
            shutil.copytree(self.dir / "logs", keep, dirs_exist_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def throughput(log_dir: Path, trained: int) -> float:
    """Trained samples (final lineage) per second from the first trainer start to the finish."""
    recs, _ = read(log_dir / "ledger" / "trainer-0.jsonl")
    t0 = min(r["t"] for r in recs if r["ev"] == "start")
    t1 = max(r["t"] for r in recs if r["ev"] == "finished")
    return trained / max(t1 - t0, 1e-9)


def one_run(name: str, topo: dict, kills: int, rng: random.Random, keep: Path | None, gap: tuple[float, float],
            timeout: float) -> dict:
    sysm = Supervised(topo, name)
    done: collections.Counter = collections.Counter()
    try:
        sysm.start()
        sysm.wait_all_running(60)
        procs = sysm.processes()
        kinds = sorted({p.rsplit("-", 1)[0] for p in procs} - {"bus", "probe"})
        # Every kind at least once (in random order), then kinds at random; a replica at random.
        plan = rng.sample(kinds, len(kinds)) + [rng.choice(kinds) for _ in range(max(0, kills - len(kinds)))]
        for kind in plan[:kills]:
            time.sleep(rng.uniform(*gap))
            if not sysm.running():
                break
            target = rng.choice([p for p in procs if p.rsplit("-", 1)[0] == kind])
            if sysm.kill(target):
                done[kind] += 1
                print(f"  {name}: kill -9 {target} ({sum(done.values())}/{kills})", flush=True)
        wall = sysm.wait(timeout)
        logs = sysm.dir / "logs"
        result = audit(logs)
        result.update(run=name, wall_s=wall, kills=sum(done.values()), killed=dict(done),
                      samples_per_s=throughput(logs, result["trained"]), tracebacks=sysm.tracebacks(),
                      spool=topo["durability"]["spool"],
                      trainer_spool_ms=trainer_spool_ms((logs / "train.log").read_text().splitlines()))
        return result
    finally:
        sysm.cleanup(keep / name if keep else None)


def spool_cost(tokens: int, rows: int = 512, batch: int = 64) -> float:
    """Microseconds the trainer spends per accepted trajectory of ``tokens`` output tokens on durability
    (encoding it into the spool and its share of a batched commit), measured on this machine."""
    import numpy as np

    from areal_bus.wire import messages as m
    from areal_bus.runtime.spool import Spool

    folder = Path(tempfile.mkdtemp(prefix="ab-spool-", dir="/tmp"))
    try:
        spool = Spool(folder / "s.sqlite", batch_rows=batch)
        trajs = [m.Trajectory(traj_id=f"t{i}", episode_id=f"e{i}", ticket=i, worker="w",
                              prompt_ids=np.arange(128, dtype=np.int32), output_ids=np.arange(tokens, dtype=np.int32),
                              logprobs=np.zeros(tokens, np.float32), versions=np.zeros(tokens, np.int32),
                              loss_mask=np.ones(tokens, np.uint8)) for i in range(rows)]
        for i, t in enumerate(trajs):
            spool.stage(t)
            if (i + 1) % batch == 0:
                spool.commit()
        spool.commit()
        cost = spool.busy_seconds / rows * 1e6
        spool.close()
        return cost
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def trainer_spool_ms(log_dir_lines: list[str]) -> float:
    return sum(float(x.split("busy_ms=")[1].split()[0]) for x in log_dir_lines if x.startswith("[train] spool "))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=24, help="kills in the chaos run (every kind at least once)")
    ap.add_argument("--steps", type=int, default=150, help="updates in the no-kill runs")
    ap.add_argument("--repeats", type=int, default=2, help="no-kill runs of each mode (alternating off, on)")
    ap.add_argument("--gap", type=float, nargs=2, default=(1.0, 3.0), metavar=("MIN", "MAX"),
                    help="seconds between one restart and the next kill")
    ap.add_argument("--save-interval", type=int, default=5, help="checkpoint every this many updates")
    ap.add_argument("--no-gateway", action="store_true", help="leave the gateway node out")
    ap.add_argument("--unsafe", action="store_true", help="also run the chaos with durability off (expect losses)")
    ap.add_argument("--quick", action="store_true", help="fewer steps and one repeat: a smoke test")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", type=Path, default=None, help="copy each run's logs under this folder")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    steps, repeats = (40, 1) if args.quick else (args.steps, args.repeats)
    gw = not args.no_gateway
    mk = lambda name, spool, n: topology(name, spool, n, Path("/tmp"), gw, args.save_interval)  # noqa: E731

    rows = []
    for k in range(repeats):
        for mode, spool in (("off", False), ("on", True)):
            name = f"{mode}-{k + 1}"
            print(f"{name}: durability.spool={spool}, {steps} updates, no kills", flush=True)
            rows.append(one_run(name, mk(name, spool, steps), 0, rng, args.keep, tuple(args.gap), 600))
    mean = lambda mode: sum(r["samples_per_s"] for r in rows if r["run"].startswith(mode + "-")) / repeats  # noqa: E731
    base, durable = mean("off"), mean("on")
    # Long enough for every kill: the no-kill rate times the kill schedule (gap + restart), with room
    # for the trainer restarts' re-training.
    rate = steps / (sum(r["wall_s"] for r in rows if r["spool"]) / repeats)
    chaos_steps = max(steps, int(rate * args.kills * (sum(args.gap) / 2 + 2.5) * 1.3))
    for name, spool in [("chaos", True)] + ([("chaos-unsafe", False)] if args.unsafe else []):
        print(f"{name}: durability.spool={spool}, {chaos_steps} updates, {args.kills} kills", flush=True)
        rows.append(one_run(name, mk(name, spool, chaos_steps), args.kills, rng, args.keep, tuple(args.gap),
                            1800))

    print()
    print(f"{'run':<13} {'kills':>5} {'wall_s':>7} {'produced':>8} {'accepted':>8} {'trained':>7} "
          f"{'stale':>5} {'at_end':>6} {'unaccepted':>10} {'lost':>4} {'dup':>3} {'retrained':>9} "
          f"{'samples/s':>9} {'vs off':>7}")
    for r in rows:
        print(f"{r['run']:<13} {r['kills']:>5} {r['wall_s']:>7.1f} {r['produced']:>8} {r['accepted']:>8} "
              f"{r['trained']:>7} {r['dropped_stale']:>5} {r['unconsumed_at_end']:>6} {r['not_accepted']:>10} "
              f"{r['lost']:>4} {r['duplicated']:>3} {r['retrained']:>9} {r['samples_per_s']:>9.1f} "
              f"{(r['samples_per_s'] / base - 1) * 100:>+6.1f}%")
    print("(stale: dropped as over-stale, counted; at_end: accepted, untrained when max_steps came; unaccepted:"
          " produced but in flight at the end or lost with a killed producer before the trainer accepted it)")
    for r in rows:
        if r["kills"]:
            print(f"{r['run']}: kills by kind {r['killed']}; trainer incarnations {r['trainer_incarnations']}, "
                  f"final lineage over {r['lineage_segments']} of them")
        if r["tracebacks"]:
            print(f"{r['run']}: tracebacks in {r['tracebacks']}")
        if r["unknown"] or r["torn_lines"]:
            print(f"{r['run']}: settled but never accepted {r['unknown']}, torn ledger lines {r['torn_lines']}")
    on_rows = [r for r in rows if r["run"].startswith("on-")]
    in_run = sum(r["trainer_spool_ms"] for r in on_rows) * 1000 / max(1, sum(r["accepted"] for r in on_rows))
    micro = {n: spool_cost(n) for n in (500, 3000)}
    print(f"durability cost: end to end {(durable / base - 1) * 100:+.1f}% samples/s (on {durable:.1f} vs off "
          f"{base:.1f}, mean of {repeats}); trainer time in the spool {in_run:.0f} us per trajectory in these runs; "
          + ", ".join(f"{v:.0f} us per {n}-token trajectory" for n, v in micro.items()) + " (stage + batched commit)")
    chaos = next(r for r in rows if r["run"] == "chaos")
    print(f"RESULT kills={chaos['kills']} kinds={len(chaos['killed'])} lost={chaos['lost']} "
          f"duplicated={chaos['duplicated']} off_samples_per_s={base:.1f} on_samples_per_s={durable:.1f} "
          f"spool_us_per_traj_3000={micro[3000]:.0f}")
    ok = all(r["lost"] == 0 and r["duplicated"] == 0 and r["finished"] for r in rows if r["spool"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
