"""bench/gpu_e2e.py: the running batch over time (``batch_timeline``), the runs' fields, and the bench's CPU
smoke run, which starts the whole system under supervisord and prints its row with the timeline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402

import pytest  # noqa: E402

from bench.gpu_e2e import Run, Summary, baseline, batch_timeline, later_half, parse_runs, steady_note, topology  # noqa: E402


def test_timeline_is_the_mean_share_of_max_batch_per_slice_with_the_updates_marked():
    # two workers of max_batch 8, a sample each per second over 0..7 s: full, then draining, then empty
    running = [8, 8, 6, 4, 2, 0, 0, 0]
    series = {w: [{"t": float(t), "running": n, "max_batch": 8} for t, n in enumerate(running)] for w in "ab"}
    line, marks = batch_timeline(series, 0.0, 8.0, ends=[1.5, 5.2, 9.0], cells=8)
    assert line == "██▇▅▃▁▁▁"  # 6/8 is level 6 of 0..7 (▇); 2/8 level 2 (▃); 0 the lowest
    assert marks == " ^   ^"  # the end at 9.0 s is outside the window
    # a window with more slices asked than samples gets one slice per sample; a slice with none is '.'
    line, _ = batch_timeline(series, 0.0, 8.0, cells=60)
    assert len(line) == 8
    gappy = {"a": [{"t": 0.0, "running": 8, "max_batch": 8}, {"t": 7.9, "running": 0, "max_batch": 8}]}
    assert batch_timeline(gappy, 0.0, 8.0, cells=2)[0] == "█▁"
    sparse = {"a": gappy["a"] + [{"t": 7.95, "running": 0, "max_batch": 8}, {"t": 7.99, "running": 0, "max_batch": 8}]}
    assert batch_timeline(sparse, 0.0, 8.0, cells=3)[0] == "█.▁"


def test_runs_take_a_decode_attention_and_an_async_ratio_is_over_the_sync_run_with_the_same_one():
    args = argparse.Namespace(staleness=[2], drop_at_consume=["true"], modes=["async", "sync"],
                              decode_attention="auto", runs=["sync", "sync:::::flash_varlen", "async:4:false",
                                                             "async:2::::flash_varlen", "async:2:true:adaptive:in_order"])
    runs = parse_runs(args)
    assert runs == [Run("sync", 2, True), Run("sync", 2, True, attention="flash_varlen"), Run("async", 4, False),
                    Run("async", 2, True, attention="flash_varlen"), Run("async", 2, True, "adaptive", True)]
    assert [r.name for r in runs] == ["sync", "sync_flash_varlen", "async_s4_keep", "async_s2_drop_flash_varlen",
                                      "async_s2_drop_adaptive_in_order"]
    results = dict(zip(runs[:2], ["auto's sync", "flash's sync"]))
    assert baseline(results, runs[3]) == "flash's sync" and baseline(results, runs[2]) == "auto's sync"
    assert baseline({runs[1]: "flash's sync"}, runs[2]) == "flash's sync"  # none with its attention: the first
    compiled = parse_runs(argparse.Namespace(**{**vars(args), "runs": ["sync:::::sdpa+compile",
                                                                       "async:2::::flash_varlen+compile"]}))
    assert [r.attention for r in compiled] == ["sdpa+compile", "flash_varlen+compile"]
    assert [r.name for r in compiled] == ["sync_sdpa_compile", "async_s2_drop_flash_varlen_compile"]  # no '+' in a file name
    assert baseline({runs[0]: "auto's sync", compiled[0]: "compiled sync"}, Run("async", 2, True, attention="sdpa+compile")) \
        == "compiled sync"
    # auto leaves decode_compile to the system's default; an explicit attention has it off unless +compile
    topo_args = argparse.Namespace(engine="torch", rollout_batch=8, workload="guess", dtype="float32", device="cuda",
                                   trainer_device=None, steps=2, trigger=0, batch=16, agents=1, group_size=8)
    engines = [topology(Path("m"), r, topo_args)["rollout_engine"] for r in (runs[0], runs[1], compiled[0])]
    assert [(e["decode_attention"], e.get("decode_compile")) for e in engines] == \
        [("auto", None), ("flash_varlen", False), ("sdpa", True)]
    # DROP per_token: the drop with staleness.per_token
    per_token = parse_runs(argparse.Namespace(**{**vars(args), "runs": ["async:2:per_token", "async:2:false"]}))
    assert per_token[0] == Run("async", 2, True, per_token=True) and per_token[0].name == "async_s2_per_token"
    assert [topology(Path("m"), r, topo_args)["staleness"]["per_token"] for r in per_token + runs[:1]] == \
        [True, False, False]
    assert per_token[1].name == "async_s2_keep" and runs[2].name == "async_s4_keep"
    # BATCH: the rollout engine's max_batch for that run alone
    batched = parse_runs(argparse.Namespace(**{**vars(args), "runs": ["async:2:true::::384"]}))[0]
    assert batched == Run("async", 2, True, rollout_batch=384) and batched.name == "async_s2_drop_b384"
    assert topology(Path("m"), batched, topo_args)["rollout_engine"]["max_batch"] == 384
    assert topology(Path("m"), runs[0], topo_args)["rollout_engine"]["max_batch"] == 8
    for bad in ("async:2::::flash", "async:x", "async:2:true:bound:arrival:sdpa:more", "sync:::::sdpa+fuse",
                "async:2:true::::0", "async:2:true::::384:1"):
        with pytest.raises(SystemExit, match="MODE"):
            parse_runs(argparse.Namespace(**{**vars(args), "runs": [bad]}))
    with pytest.raises(SystemExit, match="also per_token"):
        parse_runs(argparse.Namespace(**{**vars(args), "runs": ["async:2:per-token"]}))


def test_a_window_still_draining_the_warm_up_backlog_is_flagged_by_its_later_half():
    # four counted updates of 128 after a skipped one: the first two back to back (a backlog), the later
    # two waiting on rollout, with drops (cumulative stale_dropped) only there
    ends, dropped = [10.0, 11.0, 12.0, 16.0, 20.0], [0, 0, 0, 20, 40]
    records = [{"step": i, "t_end": t, "samples": 128, "stale_dropped": d} for i, (t, d) in enumerate(zip(ends, dropped))]
    counted = records[1:]
    sps, share = later_half(counted, 10.0, records[0])
    assert sps == 256 / 8.0 and share == 40 / (256 + 40)
    whole = 512 / 10.0
    row = Summary(sps=whole, tps=0, samples=512, span=10, busy=0.5, batch="", below_half=0, staleness={}, dropped=40,
                  over_bound=0, trained=640, gen_idle=0, gen_train=0, later_sps=sps, later_dropped=share)
    note = steady_note(row)
    assert note.startswith("not steady") and "32.0 samples/s" in note and "(62% of the window's), 14% of its finished" in note, note
    steady = Summary(**{**vars(row), "later_sps": whole * 1.05})
    assert steady_note(steady) == ""
    # one counted update: its half is itself, from the window's start
    assert later_half(records[1:2], 10.0, records[0]) == (128 / 1.0, 0.0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_cpu_smoke_run_prints_a_runs_row_and_its_running_batch_over_time():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_e2e.py"), "--shape", "tiny", "--device", "cpu",
                          "--workload", "longtail", "--batch", "16", "--steps", "3", "--skip", "1", "--median", "24",
                          "--min-len", "8", "--max-len", "96", "--runs", "async:2:true"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    for label in ("async s2 drop",):  # one run: each run's lines come from the same code
        row = next(i for i, x in enumerate(lines) if x.startswith(label + " "))
        assert "running batch over those" in lines[row + 1], out.stdout
        bar = lines[row + 2].strip()
        assert bar[0] == bar[-1] == "|" and set(bar[1:-1]) <= set("▁▂▃▄▅▆▇█."), out.stdout
        assert "^" in lines[row + 3], out.stdout  # the counted updates' ends
    assert lines[-1].startswith("RESULT ") and "async_s2_drop_sps=" in lines[-1]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_run_past_its_timeout_is_stopped_and_reported_and_the_next_run_still_goes():
    """A run that outlives --timeout (a GPU call's RUN_TIMEOUT set too short for a synchronous run) says so
    in its row, its system is stopped, and the runs after it still run; the exit status says one failed."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_e2e.py"), "--shape", "tiny", "--device", "cpu",
                          "--workload", "longtail", "--batch", "16", "--steps", "50", "--skip", "1", "--median", "24",
                          "--min-len", "8", "--max-len", "96", "--timeout", "4", "--runs", "sync", "async:2:true"],
                         capture_output=True, text=True, timeout=190, cwd=ROOT)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stdout.splitlines()
    assert any(x.startswith("sync ") and "not finished after --timeout 4 s: stopped, no row" in x for x in lines), out.stdout
    assert any(x.startswith("async s2 drop ") and "not finished" in x for x in lines), out.stdout  # it was tried too
    assert lines[-1].startswith("RESULT ") and "failed=sync,async_s2_drop" in lines[-1], out.stdout
