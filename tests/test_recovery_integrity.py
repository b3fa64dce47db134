"""Checkpoints and the spool checked end to end, and a restarted supervisord that finds the last run
(issue 17 items 2 and 5).

A checkpoint that fails verification (a garbled run_state.json, truncated weights) is passed over with
an error naming it, and no accepted trajectory is lost: the spool keeps every row the checkpoint before
it does not cover. Undecodable spool rows give their admission slots back (RunState.sources). Over an
unfinished run, `areal-bus run` refuses without --new-run (which moves the run aside) or --resume
(which continues it), and refuses while the old run's processes are alive; a bare supervisord's
trainer refuses too, and the run ends saying why.

Run: .venv/bin/pytest tests/test_recovery_integrity.py   (the whole runs are marked slow, ~2 minutes)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from areal_bus.wire import messages as m
from areal_bus.engines.sim import SimTrainEngine
from areal_bus.runtime.ledger import audit
from areal_bus.runtime.spool import Spool
from areal_bus.config.topology import parse_topology
from nodes.trainer.core import TrainerCore
from nodes.trainer.recovery import plan_start, recovery_point, write_run_state
from tests.test_system import ENV, REPO, VENV_BIN, System, wait_until

SOURCE = "agent-0:a1"


def _topo(**over):
    data = {"async": {"enabled": True}, "global_batch_size": 2, "trigger_batch_size": 2, "mini_batch_size": 2,
            "staleness_threshold": 1, "max_steps": 100, "logging": {"save_interval": 2},
            "trainer_engine": {"kind": "sim", "time_per_token_s": 0.0, "update_overhead_s": 0.0}}
    data.update(over)
    return parse_topology(data)


class Trainer:
    """A trainer process without sockets: its core, the sim engine's saves and the seal, done in the
    order nodes/trainer/wiring.py does them. ``accepted`` collects every id acknowledged as accepted."""

    def __init__(self, spool: Spool, ckpt: Path, inc: str, owner: str = "sup-1", resume: bool = False):
        self.topo = _topo()
        self.ckpt, self.spool = ckpt, spool
        self.start = plan_start(spool, ckpt, resume, inc, owner)
        self.core = TrainerCore(self.topo, self.start, spool, inc, f"00{inc}")
        self.engine = SimTrainEngine(self.topo.trainer_engine, 1)
        self.accepted: list[str] = []
        self.logs: list[tuple[str, str, dict]] = []
        self.take(self.core.begin())

    def take(self, out) -> None:
        self.logs += out.logs
        self.accepted += [i for _, msg in out.publish if isinstance(msg, m.TrajAck) for i in msg.accepted]

    def step(self, make_traj, n: int = 2, tag: str = "") -> None:
        """Receive n trajectories, commit them, train one update (and save when one is due)."""
        v = self.core.version
        self.core.receive([make_traj(f"t{tag}-{v}-{i}", versions=(v,), source=SOURCE) for i in range(n)])
        self.take(self.core.tick(time.monotonic() + 1.0))
        job = self.core.next_job(1.0).job
        out = self.core.on_trained(job, {"loss": 0.1}, 1.0)
        self.take(out)
        if out.job is not None:
            folder = self.ckpt / f"step_{out.job.version}"
            self.engine.save_checkpoint(folder, out.job.version, out.job.state["consumed"])
            write_run_state(folder, out.job.state)
            self.take(self.core.on_saved(out.job, 1.0))

    def held(self) -> set[str]:
        """What the run still has of its accepted trajectories: its lineage's consumed ids and its queue."""
        return set(self.core.consumed) | set(self.core.queue.buffer)


@pytest.fixture
def spool(tmp_path):
    made = Spool(tmp_path / "spool" / "spool.sqlite")
    yield made
    made.close()


def _crash_with_a_damaged_newest_checkpoint(tmp_path, spool, make_traj, damage) -> tuple[Trainer, Trainer]:
    ckpt = tmp_path / "checkpoints"
    first = Trainer(spool, ckpt, "inc1")
    for _ in range(5):  # checkpoints at versions 2 and 4, then one update more
        first.step(make_traj)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_2", "step_4"]
    damage(ckpt / "step_4")
    return first, Trainer(spool, ckpt, "inc2")  # restarted by the same supervisord: crash recovery


def _garble_run_state(folder: Path) -> None:
    state = (folder / "run_state.json").read_bytes()
    (folder / "run_state.json").write_bytes(state[:40] + b"\x00garbled" + state[48:])


def test_a_garbled_newest_run_state_falls_back_to_the_previous_checkpoint_and_loses_nothing(tmp_path, spool,
                                                                                             make_traj):
    first, again = _crash_with_a_damaged_newest_checkpoint(tmp_path, spool, make_traj, _garble_run_state)
    assert again.start.folder == tmp_path / "checkpoints" / "step_2" and again.core.version == 2
    lost = set(first.accepted) - again.held()
    assert not lost, f"{len(lost)} of {len(first.accepted)} accepted trajectories lost: {sorted(lost)}"
    errors = [(name, f) for level, name, f in again.logs if level == "error"]
    assert [name for name, _ in errors] == ["checkpoint_skipped"], again.logs
    assert errors[0][1]["checkpoint"].endswith("step_4") and "run_state.json" in errors[0][1]["reason"]


def test_truncated_weights_in_the_newest_checkpoint_fall_back_and_lose_nothing(tmp_path, spool, make_traj):
    def truncate(folder: Path) -> None:  # the sim engine's one file stands for model.safetensors here
        data = (folder / "trainer_state.json").read_bytes()
        (folder / "trainer_state.json").write_bytes(data[: len(data) // 2])

    first, again = _crash_with_a_damaged_newest_checkpoint(tmp_path, spool, make_traj, truncate)
    assert again.core.version == 2 and not set(first.accepted) - again.held()
    reasons = [f["reason"] for level, _, f in again.logs if level == "error"]
    assert len(reasons) == 1 and reasons[0].startswith("trainer_state.json is "), reasons


def test_a_truncated_safetensors_checkpoint_is_not_a_recovery_point(tmp_path, one_torch_thread):
    from areal_bus.engines.torch_train import TorchTrainEngine

    topo = parse_topology({"model": {"path": str(REPO / "models" / "tiny-guess"), "device": "cpu", "threads": 1},
                           "rollout_engine": {"kind": "torch"}, "agent": {"framework": "guess"}, "trainer_engine": {"kind": "torch", "eval_interval": 0}})
    engine = TorchTrainEngine(topo, REPO / "models" / "tiny-guess")
    ckpt = tmp_path / "checkpoints"
    for version in (2, 4):
        engine.save_checkpoint(ckpt / f"step_{version}", version, [])
        write_run_state(ckpt / f"step_{version}", {"version": version, "epoch": "e1", "inc": "i1", "consumed": []})
    weights = ckpt / "step_4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    folder, state, skipped = recovery_point(ckpt, "e1")
    assert folder == ckpt / "step_2" and state["version"] == 2
    assert [(f.name, why.split(" ")[0]) for f, why in skipped] == [("step_4", "model.safetensors")]


def test_the_spool_keeps_what_the_newest_checkpoint_covers_until_the_next_is_sealed(tmp_path, spool, make_traj):
    trainer = Trainer(spool, tmp_path / "checkpoints", "inc1")
    for _ in range(6):  # checkpoints at 2, 4, 6: the rows of updates 4 and 5 are what step_4 lacks
        trainer.step(make_traj)
    spool.commit()
    assert sorted(spool.ids()) == sorted(f"t-{v}-{i}" for v in (4, 5) for i in range(2))


def _garble_rows(path: Path, ids: list[str], cut: bool) -> None:
    """Damage spool rows in place, as a bad disk would: the tail cut off, or bytes flipped mid-row."""
    db = sqlite3.connect(path)
    for tid in ids:
        blob = db.execute("SELECT frames FROM spool WHERE traj_id = ?", (tid,)).fetchone()[0]
        bad = blob[: len(blob) - 20] if cut else blob[:6] + bytes(b ^ 0xFF for b in blob[6:30]) + blob[30:]
        db.execute("UPDATE spool SET frames = ? WHERE traj_id = ?", (bad, tid))
    db.commit()
    db.close()


def test_undecodable_spool_rows_give_their_admission_slots_back(tmp_path, spool, make_traj):
    ckpt = tmp_path / "checkpoints"
    first = Trainer(spool, ckpt, "inc1")
    for _ in range(2):
        first.step(make_traj)  # checkpoint at 2
    v = first.core.version
    first.core.receive([make_traj(f"late-{i}", versions=(v,), source=SOURCE) for i in range(5)])
    first.take(first.core.tick(time.monotonic() + 1.0))  # accepted, then the trainer dies untrained
    _garble_rows(spool.path, ["late-0", "late-1", "late-2"], cut=True)
    _garble_rows(spool.path, ["late-3"], cut=False)  # its header too: no source left to give the slot to
    again = Trainer(spool, ckpt, "inc2")
    consumed, given_back = again.core.run_state(2.0)[1].sources[SOURCE]
    assert (consumed, given_back) == (4, 3), "the undecodable rows' slots must come back"
    assert set(again.core.queue.buffer) == {"late-4"}
    errors = [f for level, name, f in again.logs if level == "error" and name == "spool_bad_rows"]
    assert errors and errors[0]["count"] == 4 and errors[0]["sources"] == {SOURCE: 3, "": 1}, again.logs
    # They count once: two checkpoints later the rows are gone, and the totals keep them.
    for _ in range(4):
        again.step(make_traj, tag="b")
    spool.commit()
    assert not {f"late-{i}" for i in range(4)} & set(spool.ids())
    third = Trainer(spool, ckpt, "inc3")
    assert third.core.run_state(3.0)[1].sources[SOURCE][1] == 3


# -- item 5: a new start over an unfinished run --------------------------------------------------------
def test_a_new_supervisords_trainer_refuses_to_start_over_an_unfinished_runs_data(tmp_path, spool, make_traj):
    from nodes.trainer.recovery import UnfinishedRun

    ckpt = tmp_path / "checkpoints"
    first = Trainer(spool, ckpt, "inc1", owner="sup-1")
    for _ in range(3):
        first.step(make_traj)
    rows = len(spool)
    with pytest.raises(UnfinishedRun, match=r"areal-bus run --resume.*areal-bus run --new-run"):
        plan_start(spool, ckpt, resume=False, incarnation="inc2", owner="sup-2")
    assert len(spool) == rows and (ckpt / "step_2" / "manifest.json").exists()  # nothing emptied or moved
    resumed = Trainer(spool, ckpt, "inc3", owner="sup-2", resume=True)
    assert (resumed.core.epoch, resumed.core.version) == ("inc1", 2) and not set(first.accepted) - resumed.held()


def test_a_fresh_start_after_a_finished_run_sets_its_checkpoints_aside(tmp_path, spool, make_traj):
    ckpt = tmp_path / "checkpoints"
    first = Trainer(spool, ckpt, "inc1", owner="sup-1")
    for _ in range(2):
        first.step(make_traj)
    spool.set_meta(finished=1)
    fresh = Trainer(spool, ckpt, "inc2", owner="sup-2")
    assert fresh.core.version == 0 and not ckpt.exists()
    assert (tmp_path / "runs" / "inc1" / "checkpoints" / "step_2" / "manifest.json").exists()
    assert ("warning", "checkpoints_set_aside") in [(lvl, name) for lvl, name, _ in fresh.logs]


def _leave_an_unfinished_run(logs: Path, make_traj) -> None:
    """What a supervisord that died mid-run leaves: a spool of accepted rows and a checkpoint."""
    spool = Spool(logs / "spool" / "spool.sqlite")
    spool.start_run(epoch="old-epoch", owner="999:1", finished=0)
    for i in range(3):
        spool.stage(make_traj(f"old-{i}", source=SOURCE))
    spool.commit()
    spool.close()
    folder = logs / "checkpoints" / "step_5"
    SimTrainEngine(_topo().trainer_engine, 1).save_checkpoint(folder, 5, [])
    write_run_state(folder, {"version": 5, "epoch": "old-epoch", "inc": "old-inc", "consumed": []})


def _spool_rows(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT count(*) FROM spool").fetchone()[0]
    finally:
        db.close()


def _areal_bus_run(system: System, *flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "areal-bus"), "run", "topology.yaml", "-o", "supervisord.conf", *flags],
                          cwd=system.dir, env=ENV, capture_output=True, text=True, timeout=timeout)



@pytest.mark.timeout(120)
def test_areal_bus_run_refuses_over_an_unfinished_run_naming_both_ways_on(make_system, make_traj):
    s = make_system()
    _leave_an_unfinished_run(s.logs, make_traj)
    res = _areal_bus_run(s, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "unfinished run old-epoch (3 accepted trajectories in spool/, 1 checkpoints)" in res.stderr, res.stderr
    assert "areal-bus run --resume" in res.stderr and "areal-bus run --new-run" in res.stderr
    assert _spool_rows(s.logs / "spool" / "spool.sqlite") == 3 and (s.logs / "checkpoints" / "step_5").is_dir()
    assert _areal_bus_run(s, "--resume", "--new-run", timeout=60).returncode == 2  # one or the other


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_new_run_moves_the_unfinished_run_aside_and_runs_a_new_one(make_system, make_traj):
    s = make_system()
    _leave_an_unfinished_run(s.logs, make_traj)
    res = _areal_bus_run(s, "--new-run")
    assert res.returncode == 0, res.stderr
    aside = [p for p in (s.logs / "runs").iterdir() if (p / "spool" / "spool.sqlite").exists()]
    assert len(aside) == 1 and _spool_rows(aside[0] / "spool" / "spool.sqlite") == 3, res.stderr
    assert (aside[0] / "checkpoints" / "step_5" / "manifest.json").exists()
    assert {r["run"] for r in s.train_steps()} != {"old-epoch"} and len(s.train_steps()) > 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_bare_supervisord_over_an_unfinished_run_ends_it_naming_both_ways_on_and_destroys_nothing(make_system,
                                                                                                     make_traj):
    s = make_system()
    _leave_an_unfinished_run(s.logs, make_traj)
    s.start()  # supervisord -c supervisord.conf, as by hand
    try:
        s.proc.wait(180)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the run did not end:\n{s.tail('train.log')}") from None
    outcome = json.loads((s.logs / "run_outcome.json").read_text())
    assert outcome["status"] == "failed" and outcome["process"].startswith("trainer-0"), outcome
    assert "UnfinishedRun" in outcome["reason"] and "--resume" in outcome["reason"] \
        and "--new-run" in outcome["reason"], outcome
    assert any("unfinished_run" in line for line in s.lines("train.log"))
    assert _spool_rows(s.logs / "spool" / "spool.sqlite") == 3 and (s.logs / "checkpoints" / "step_5").is_dir()


def _audit_across(logs: Path) -> dict:
    """The ledger audit over the run's two parts: the ledger the dead supervisord's run wrote (moved to
    runs/<id>/ledger by the resumed run's start) and the resumed run's."""
    merged = logs.parent / "audit"
    for part in [*sorted((logs / "runs").glob("*/ledger")), logs / "ledger"]:
        for f in part.glob("*.jsonl"):
            (merged / "ledger").mkdir(parents=True, exist_ok=True)
            with open(merged / "ledger" / f.name, "a") as out:
                out.write(f.read_text())
    return audit(merged)


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_run_whose_supervisord_died_is_refused_while_its_orphans_live_then_resumed_losing_nothing(make_system):
    from areal_bus.launch.run import orphans
    from tests.test_crash import CHECKPOINTED

    s = make_system(**CHECKPOINTED)
    s.render()
    first = subprocess.Popen([str(VENV_BIN / "areal-bus"), "run", "supervisord.conf"], cwd=s.dir, env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(s.train_steps()) >= 12 and list(s.logs.glob("checkpoints/step_*/manifest.json")),
                   120, "12 updates and a sealed checkpoint")
        os.kill(int((s.logs / "supervisord.pid").read_text()), signal.SIGKILL)  # the host's supervisord dies
        time.sleep(0.5)
        left = orphans(s.logs)
        for pid, _ in left:  # frozen, so an orphaned trainer cannot finish the run meanwhile
            os.kill(pid, signal.SIGSTOP)
        first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    try:
        if left:  # what survives its supervisord (the bus did, in the issue): no new start beside it
            res = _areal_bus_run(s, "--resume", timeout=60)
            assert res.returncode == 2 and "still alive" in res.stderr and str(left[0][0]) in res.stderr, res.stderr
    finally:
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    wait_until(lambda: not orphans(s.logs), 30, "the orphans to go")
    refused = _areal_bus_run(s, timeout=60)
    assert refused.returncode == 2 and "--resume" in refused.stderr, refused.stderr
    res = _areal_bus_run(s, "--resume")
    assert res.returncode == 0, res.stderr
    recovered = [line for line in s.lines("train.log") if line.startswith("[train] recovered ")]
    assert len(recovered) == 1 and " version=0 " not in recovered[0], recovered
    result = _audit_across(s.logs)
    assert result["finished"] and result["lost"] == 0 and result["duplicated"] == 0, result
    print(f"orphans after supervisord's death: {[cmd.split(' --')[0] for _, cmd in left]}; audit: {result}")
