"""bench/learning.py --combine: the seeds' summary read back from saved pairs of runs (five SmolLM2 records
of 2026-12-04, kept in tests/learning_runs/, as bench/RESULTS.md quotes them), run as a script."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "tests" / "learning_runs"


def test_combine_prints_each_seeds_gap_at_equal_samples_and_the_standard_error_of_their_mean(tmp_path):
    for seed in (3, 7):
        for mode, stem in (("async", "ltn-in_order-async"), ("sync", "ltn-sync")):
            (tmp_path / f"{mode}-seed{seed}.json").write_bytes(gzip.decompress((RUNS / f"{stem}-seed{seed}.json.gz")
                                                                              .read_bytes()))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "learning.py"), "--combine", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    # RESULTS' table: seed 3 +0.030, seed 7 +0.075 at sync's 5,120 samples (their mean 0.0525 prints +0.052)
    assert "async - sync at equal samples, per seed: +0.030 +0.075; mean +0.052 (sd over seeds 0.032, " \
           "standard error 0.022)" in out.stdout, out.stdout
    result = out.stdout.splitlines()[-1]
    assert result.startswith("RESULT ") and "equal_samples_gap_mean=+0.052 equal_samples_gap_se=0.022" in result


def test_combine_averages_the_gap_over_syncs_evaluations_from_the_window_given(tmp_path):
    for seed in (3, 7):
        for mode, stem in (("async", "ltn-in_order-async"), ("sync", "ltn-sync")):
            (tmp_path / f"{mode}-seed{seed}.json").write_bytes(gzip.decompress((RUNS / f"{stem}-seed{seed}.json.gz")
                                                                              .read_bytes()))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "learning.py"), "--combine", str(tmp_path),
                          "--window-from", "4096"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    # sync's evaluations at 4,096 and 5,120 samples, async interpolated there: seed 3 -0.032 and +0.030,
    # seed 7 +0.136 and +0.075 (the default window, from half of 5,120, adds the evaluation at 3,072:
    # -0.024 +0.105); a window from 5,120 leaves only the last
    assert "mean over sync's evaluations from 4096 samples, per seed: -0.001 +0.106; mean +0.052" in out.stdout, \
        out.stdout
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "learning.py"), "--combine", str(tmp_path),
                          "--window-from", "5120"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "mean over sync's evaluations from 5120 samples, per seed: +0.030 +0.075; mean +0.052" in out.stdout, \
        out.stdout


def test_combine_pairs_a_later_folders_async_runs_with_an_earlier_folders_sync_runs(tmp_path):
    both, async_only = tmp_path / "both", tmp_path / "in_order"
    for folder, files in ((both, (("async", "ltn-async"), ("sync", "ltn-sync"))),
                          (async_only, (("async", "ltn-in_order-async"),))):
        folder.mkdir()
        for mode, stem in files:
            (folder / f"{mode}-seed3.json").write_bytes(gzip.decompress((RUNS / f"{stem}-seed3.json.gz").read_bytes()))
    run = lambda *dirs: subprocess.run([sys.executable, str(ROOT / "bench" / "learning.py"), "--combine",  # noqa: E731
                                        *map(str, dirs)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    # seed 3 at sync's 5,120 samples: in_order's async +0.030 (the ten-seed table), default order's another
    assert "per seed: +0.030;" in run(both, async_only).stdout
    assert "per seed: +0.030;" not in run(async_only, both).stdout
