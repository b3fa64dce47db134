"""``areal-bus plot`` (areal_bus/launch/plot.py): curves from train_steps.jsonl, one run at a time.

Run: .venv/bin/pytest tests/test_plot.py
"""

from __future__ import annotations

import json

import pytest

from areal_bus.launch.cli import main
from areal_bus.launch.plot import load_steps, plot


def _write(log_dir, records) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "train_steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _steps(run, steps, reward, t0=0.0) -> list[dict]:
    rows = [{"t_end": t0 + s, "step": s, "samples": 8, "loss": 0.1, "reward": reward, "staleness": {"0": 8}}
            for s in steps]
    return [{**r, "run": run} for r in rows] if run is not None else rows


def test_a_file_holding_two_runs_is_plotted_for_the_newest_only_and_says_so(tmp_path):
    _write(tmp_path, _steps("aaa", range(10), 0.2) + _steps("bbb", range(4), 0.9, t0=100))
    run = load_steps(tmp_path)
    assert run.run == "bbb" and [r["step"] for r in run.records] == [0, 1, 2, 3]
    assert {r["reward"] for r in run.records} == {0.9}  # nothing of run aaa spliced in
    out, note = plot(tmp_path, "reward", tmp_path / "reward.png")
    assert out.stat().st_size > 0
    assert note == "the file holds 2 runs; plotted the newest, run bbb (steps 0-3), not aaa"


def test_a_trainer_restarted_within_its_run_keeps_the_last_record_of_each_step_with_no_note(tmp_path):
    # Crash recovery re-trains from its checkpoint in the same run epoch: steps 3 and 4 come twice.
    _write(tmp_path, _steps("aaa", range(5), 0.2) + _steps("aaa", range(3, 8), 0.5, t0=50))
    run = load_steps(tmp_path)
    assert [r["step"] for r in run.records] == list(range(8)) and run.note is None
    assert [r["reward"] for r in run.records[2:5]] == [0.2, 0.5, 0.5]


def test_records_from_before_runs_were_named_count_as_an_older_run(tmp_path):
    _write(tmp_path, _steps(None, range(6), 0.2) + _steps("ccc", range(2), 0.7, t0=100))
    assert load_steps(tmp_path).note == "the file holds 2 runs; plotted the newest, run ccc (steps 0-1), not (unnamed)"


def test_the_command_prints_the_note_and_still_writes_the_plot(tmp_path, capsys):
    _write(tmp_path, _steps("aaa", range(3), 0.2) + _steps("bbb", range(3), 0.9, t0=100))
    assert main(["plot", "--log-dir", str(tmp_path), "--metric", "throughput"]) == 0
    got = capsys.readouterr()
    assert "plotted the newest, run bbb" in got.err and (tmp_path / "throughput.png").exists()


@pytest.mark.parametrize("body, message", [
    (None, "not found"),
    ("", "no train steps recorded yet"),
    ('{"step": 0}\nnot json\n', "train_steps.jsonl:2: not a JSON record"),
])
def test_a_missing_empty_or_garbled_file_is_one_clear_error(tmp_path, capsys, body, message):
    if body is not None:
        (tmp_path / "train_steps.jsonl").write_text(body)
    assert main(["plot", "--log-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
