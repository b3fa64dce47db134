"""The run in TensorBoard and W&B (``logging.trackers``, areal_bus/runtime/trackers.py), read back with
each tool's own format: TensorBoard's event files with tensorboard's EventAccumulator, the offline W&B
run with wandb's own record type (``wandb_internal_pb2.Record``) read from its run file.

The fast tests feed the tracker module the records a real learning run's trainer wrote (the torch
engine on tiny-guess, tests/learning_runs: loss, reward, evaluations, clip and cap fractions, per-lag
importance weights, staleness) and start the real trainer node to see a tracker that cannot start stop
it; the slow test runs the sim topology under supervisord with both trackers on. W&B runs offline
(WANDB_MODE=offline) under a temp folder: nothing here reaches a network.

Run: .venv/bin/python -m pytest -q tests/test_trackers.py        (the slow one: add -m slow)
"""

from __future__ import annotations

import gzip
import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import yaml
from structlog.testing import capture_logs
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from areal_bus.config.topology import TopologyError, parse_topology
from areal_bus.runtime.trackers import TrackerError, Trackers
from tests.test_system import ENV, VENV_BIN

REPO = Path(__file__).resolve().parents[1]
RECORDS = json.loads(gzip.open(REPO / "tests" / "learning_runs" / "ltn-async-seed3.json.gz").read())["records"]
"""train_steps.jsonl of a real run: 64 updates of the torch trainer and 9 held-out evaluations."""
RUN = RECORDS[0]["run"]
TOKEN = "tracked-admin-token-0123"
"""The gateway's admin token: a secret the trackers' config must show as <redacted>."""


def _topology(*trackers: str) -> dict:
    return {"logging": {"trackers": list(trackers)},
            "nodes": {"gateway": {"replicas": 0, "config": {"admin_token": TOKEN}}}}


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, its files under a temp folder; returned: that folder."""
    folder = tmp_path / "wandb-dir"
    folder.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(folder))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return folder


def _scalars(folder: Path) -> EventAccumulator:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def _curve(acc: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def wandb_records(run_folder: Path) -> list:
    """The records of an offline W&B run, from its ``run-<id>.wandb`` file: wandb's transaction log, a
    7-byte header (":W&B", 0xBEE1, version 0) then LevelDB-log blocks of 32 KiB, each chunk a CRC32 of
    its type and data, its length and type (1 whole, 2 first, 3 middle, 4 last), every record one
    ``wandb_internal_pb2.Record`` (wandb 0.31 writes it from Go and ships no Python reader)."""
    from wandb.proto import wandb_internal_pb2 as pb  # the tests' import: wandb is the module under test's lazy one

    (path,) = run_folder.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:7] == struct.pack("<4sHB", b":W&B", 0xBEE1, 0), data[:7]
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left for a chunk header: the block is padded
            pos += block - pos % block
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0 and n == 0:
            break
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: bad chunk at {pos}"
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _of(records: list, kind: str) -> list:
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


def _items(update) -> dict:
    """{key: value} of a history row or a summary update (nested keys joined with /)."""
    return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in update}


# -- the topology ---------------------------------------------------------------------------------

def test_trackers_default_to_none_and_a_repeated_or_unknown_one_is_refused_naming_the_field():
    assert parse_topology({}).logging.trackers == []
    with pytest.raises(TopologyError, match=r"logging\.trackers: .*wandb listed twice"):
        parse_topology({"logging": {"trackers": ["wandb", "wandb"]}}, "t.yaml")
    with pytest.raises(TopologyError, match=r"logging\.trackers\.0: Input should be 'tensorboard' or 'wandb'"):
        parse_topology({"logging": {"trackers": ["mlflow"]}}, "t.yaml")


def test_a_trainer_without_trackers_loads_neither_tensorboard_nor_wandb():
    code = ("import sys; from areal_bus.config.topology import parse_topology; import nodes.trainer;"
            "from areal_bus.runtime.trackers import Trackers;"
            "t = Trackers.start(parse_topology({}), 'run', '/nonexistent'); t.log_record({'step': 0, 'samples': 1});"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'tensorboard')))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


# -- TensorBoard ----------------------------------------------------------------------------------

def test_every_record_of_a_real_run_reads_back_in_tensorboards_own_reader(tmp_path):
    trackers = Trackers.start(parse_topology(_topology("tensorboard")), RUN, tmp_path)
    for record in RECORDS:
        trackers.log_record(record)
    trackers.close()
    acc = _scalars(tmp_path / "tb" / RUN)
    updates = [r for r in RECORDS if r["samples"]]
    # x = the version the record ends at: the update train.log shows as step=N is at N + 1
    for key, tag in (("loss", "train/loss"), ("reward", "train/reward"), ("clip_fraction", "train/clip_fraction"),
                     ("capped_fraction", "train/capped_fraction"), ("mean_w", "train/mean_w"),
                     ("lag1.abs_log_w", "lag/lag1.abs_log_w"), ("lag2.clipped", "lag/lag2.clipped"),
                     ("stale_dropped", "staleness/stale_dropped"), ("train_s", "perf/train_s")):
        assert _curve(acc, tag) == pytest.approx({r["step"] + 1: r[key] for r in updates}), tag
    # the eval curve: the start weights' evaluation at 0, then every eval_interval updates
    evals = {r["step"] + 1: r["eval_reward"] for r in RECORDS if "eval_reward" in r}
    assert _curve(acc, "eval/reward") == pytest.approx(evals) and 0 in evals and len(evals) == 9
    rates = _curve(acc, "perf/samples_per_second")
    assert len(rates) == len(updates) - 1 and all(v > 0 for v in rates.values())  # none before the first update
    record = next(r for r in updates if len(r["staleness"]) == 3)
    hist = {h.step: h.histogram_value for h in acc.Histograms("staleness/histogram")}[record["step"] + 1]
    assert hist.bucket == [record["staleness"][k] for k in ("0", "1", "2")] and hist.num == record["samples"]
    assert _curve(acc, "staleness/share_2")[record["step"] + 1] == pytest.approx(
        record["staleness"]["2"] / record["samples"])


def test_a_trainer_restarted_within_its_run_shows_each_retrained_step_once_in_tensorboard(tmp_path):
    topo = parse_topology(_topology("tensorboard"))
    first = Trackers.start(topo, RUN, tmp_path)
    for record in RECORDS[:12]:  # the start weights' evaluation and updates 0..10; then the process dies
        first.log_record(record)
    first.close()
    # Its checkpoint was of version 6: the restarted trainer trains step 6 (x = 7) and on again, as
    # nodes/trainer's _start_trackers purges from start.version + 1.
    again = Trackers.start(topo, RUN, tmp_path, purge_step=7)
    retrained = [{**r, "loss": r["loss"] + 1.0} for r in RECORDS[7:9]]
    for record in retrained:
        again.log_record(record)
    again.close()
    loss = _curve(_scalars(tmp_path / "tb" / RUN), "train/loss")
    assert loss == pytest.approx({**{r["step"] + 1: r["loss"] for r in RECORDS[1:7]},
                                  **{r["step"] + 1: r["loss"] for r in retrained}})


def test_the_tensorboard_config_is_the_resolved_topology_with_the_secret_redacted(tmp_path):
    Trackers.start(parse_topology(_topology("tensorboard")), RUN, tmp_path).close()
    acc = _scalars(tmp_path / "tb" / RUN)
    (event,) = acc.Tensors("config/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert '"admin_token": "<redacted>"' in text and '"trackers": [' in text
    assert TOKEN.encode() not in b"".join(p.read_bytes() for p in (tmp_path / "tb" / RUN).iterdir())


# -- W&B, offline -----------------------------------------------------------------------------------

def test_an_offline_wandb_run_holds_the_redacted_config_and_every_records_scalars(tmp_path, offline_wandb):
    trackers = Trackers.start(parse_topology(_topology("wandb")), RUN, tmp_path / "logs")
    for record in RECORDS:
        trackers.log_record(record)
    trackers.close()
    (folder,) = (offline_wandb / "wandb").glob(f"offline-run-*-{RUN}")
    records = wandb_records(folder)
    (run,) = _of(records, "run")
    assert (run.run_id, run.display_name) == (RUN, RUN)
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["nodes"]["gateway"]["config"]["admin_token"] == "<redacted>"
    assert config["logging"]["trackers"] == ["wandb"] and config["max_steps"] == parse_topology({}).max_steps
    assert TOKEN.encode() not in b"".join(p.read_bytes() for p in folder.rglob("*") if p.is_file())
    rows = {row["_step"]: row for row in map(_items, (h.item for h in _of(records, "history")))}
    updates = [r for r in RECORDS if r["samples"]]
    assert {s: row["train/loss"] for s, row in rows.items() if "train/loss" in row} == pytest.approx(
        {r["step"] + 1: r["loss"] for r in updates})
    assert {s: row["eval/reward"] for s, row in rows.items() if "eval/reward" in row} == pytest.approx(
        {r["step"] + 1: r["eval_reward"] for r in RECORDS if "eval_reward" in r})
    last = updates[-1]
    hist = rows[last["step"] + 1]
    assert hist["staleness/histogram/_type"] == "histogram"
    assert hist["staleness/histogram/values"] == [last["staleness"].get(str(k), 0)
                                                  for k in range(len(hist["staleness/histogram/values"]))]
    assert sum(hist["staleness/histogram/values"]) == last["samples"]
    summary = {}
    for update in _of(records, "summary"):
        summary.update(_items(update.update))
    assert summary["train/loss"] == pytest.approx(last["loss"]) and summary["_step"] == last["step"] + 1
    assert _of(records, "exit") and _of(records, "exit")[0].exit_code == 0  # finished by close()


# -- failures ---------------------------------------------------------------------------------------

def test_a_tracker_failing_mid_run_is_logged_once_and_dropped_while_the_others_go_on(tmp_path, offline_wandb):
    trackers = Trackers.start(parse_topology(_topology("tensorboard", "wandb")), RUN, tmp_path)
    tensorboard = next(t for t in trackers.active if t.name == "tensorboard")
    for record in RECORDS[:10]:
        trackers.log_record(record)
    tensorboard.writer.file_writer.close()  # its event file closed underneath it: every write now raises
    with capture_logs() as logs:
        for record in RECORDS[10:]:
            trackers.log_record(record)  # never raises
    trackers.close()
    errors = [e for e in logs if e["log_level"] == "error"]
    assert len(errors) == 1 and errors[0]["event"] == "tracker_failed" and errors[0]["tracker"] == "tensorboard"
    assert errors[0]["step"] == RECORDS[10]["step"] and "closed" in errors[0]["error"]
    assert [t.name for t in trackers.active] == []  # closed at the end; tensorboard was dropped before
    assert max(_curve(_scalars(tmp_path / "tb" / RUN), "train/loss")) == RECORDS[9]["step"] + 1
    (folder,) = (offline_wandb / "wandb").glob(f"offline-run-*-{RUN}")
    steps = [row["_step"] for row in map(_items, (h.item for h in _of(wandb_records(folder), "history")))]
    assert steps[-1] == RECORDS[-1]["step"] + 1 and len(steps) == len(RECORDS)  # wandb got every record


def test_a_tracker_that_cannot_start_raises_naming_it_and_the_ones_started_before_are_finished(
        tmp_path, offline_wandb):
    (tmp_path / "tb").write_text("a file where the tensorboard folder goes")
    with pytest.raises(TrackerError, match=r"^logging\.trackers: tensorboard did not start: NotADirectoryError"):
        Trackers.start(parse_topology(_topology("wandb", "tensorboard")), RUN, tmp_path)
    (folder,) = (offline_wandb / "wandb").glob(f"offline-run-*-{RUN}")
    assert _of(wandb_records(folder), "exit")  # the W&B run started first is finished, not left open


def _trainer(folder: Path, trackers: list[str], env: dict) -> subprocess.CompletedProcess:
    """The trainer node alone (no bus: it stops before it needs one), as supervisord starts it."""
    (folder / "t.yaml").write_text(yaml.safe_dump({
        "name": "trk", "max_steps": 2, "logging": {"log_dir": "logs", "trackers": trackers},
        "trainer_engine": {"kind": "sim"}, "rollout_engine": {"kind": "sim"}, "agent": {"framework": "sim"},
        "endpoints": {"transport": "ipc", "ipc_dir": str(folder / "ipc")},
        "nodes": {"bus": {}, "agent": {}, "reward": {}, "trainer": {}, "weights": {}}}))
    return subprocess.run([str(VENV_BIN / "areal-bus"), "node", "trainer", "--topology", "t.yaml"], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=90)


@pytest.mark.timeout(120)
def test_a_tensorboard_that_cannot_write_stops_the_trainer_at_start_naming_it(ipc_dir):
    (ipc_dir / "logs").mkdir()
    (ipc_dir / "logs" / "tb").write_text("a file where the tensorboard folder goes")
    res = _trainer(ipc_dir, ["tensorboard"], ENV)
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]  # the line the run-end listener quotes
    assert last.startswith("areal_bus.runtime.trackers.TrackerError: logging.trackers: tensorboard did not start: "
                           "NotADirectoryError"), res.stderr[-2000:]
    assert "tracker_failed" in (ipc_dir / "logs" / "train.log").read_text()


@pytest.mark.timeout(120)
def test_wandb_online_without_a_login_stops_the_trainer_at_start_saying_how_to_log_in_or_go_offline(ipc_dir):
    env = {k: v for k, v in ENV.items() if not k.startswith("WANDB_")}
    # No login anywhere (a fresh HOME: no ~/.netrc), and were it to try, a W&B server that is a closed
    # loopback port: the key is checked before any connection.
    env.update(HOME=str(ipc_dir), WANDB_MODE="online", WANDB_BASE_URL="http://127.0.0.1:9")
    res = _trainer(ipc_dir, ["wandb"], env)
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]
    assert "TrackerError: logging.trackers: wandb did not start: UsageError: No API key configured" in last
    assert "WANDB_MODE=offline" in last and "wandb login" in last


# -- a whole run ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_sim_run_under_supervisord_writes_tensorboard_and_an_offline_wandb_run(make_system, monkeypatch):
    # The token as a run gets it: from the environment, never in the topology file.
    monkeypatch.setenv("AREAL_BUS_ADMIN_TOKEN", TOKEN)
    monkeypatch.setitem(ENV, "AREAL_BUS_ADMIN_TOKEN", TOKEN)
    monkeypatch.setitem(ENV, "WANDB_MODE", "offline")
    for name in [k for k in ENV if k.startswith("WANDB_") and k != "WANDB_MODE"]:
        monkeypatch.delitem(ENV, name)  # WANDB_DIR unset: the run goes under log_dir/wandb
    system = make_system(
        logging={"log_dir": "logs", "log_interval": 2, "save_interval": 0, "trackers": ["tensorboard", "wandb"]},
        nodes={"bus": {}, "agent": {"replicas": 1}, "reward": {"replicas": 1}, "trainer": {}, "weights": {},
               "gateway": {"replicas": 0, "config": {"admin_token": "${AREAL_BUS_ADMIN_TOKEN}"}}})
    system.start()
    try:
        assert system.proc.wait(120) == 0, system.tail("supervisord.log")
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the run did not end:\n{system.tail('train.log')}") from None
    steps = system.train_steps()
    assert [s["step"] for s in steps] == list(range(system.topo.max_steps))
    run = steps[0]["run"]
    loss = {s["step"] + 1: s["loss"] for s in steps}

    acc = _scalars(system.logs / "tb" / run)
    assert _curve(acc, "train/loss") == pytest.approx(loss)
    assert set(_curve(acc, "perf/samples")) == set(loss) and acc.Histograms("staleness/histogram")

    (folder,) = (system.logs / "wandb").glob(f"offline-run-*-{run}")
    records = wandb_records(folder)
    (meta,) = _of(records, "run")
    config = {i.key: json.loads(i.value_json) for i in meta.config.update}
    assert meta.display_name == run and config["nodes"]["gateway"]["config"]["admin_token"] == "<redacted>"
    assert config["name"] == system.topo.name and config["max_steps"] == system.topo.max_steps
    rows = [_items(h.item) for h in _of(records, "history")]
    assert {r["_step"]: r["train/loss"] for r in rows} == pytest.approx(loss)
    assert _of(records, "exit")
    assert TOKEN.encode() not in b"".join(p.read_bytes() for d in (folder, system.logs / "tb")
                                          for p in d.rglob("*") if p.is_file())
    train = "\n".join(system.lines("train.log"))
    assert f"[train] trackers run={run} tensorboard={system.logs / 'tb' / run} wandb={folder} " in train
    assert "tracker_failed" not in train and not system.tracebacks()
