"""The ledger on a full disk: a record is written whole or its write raises (the node fails loudly and
supervisord restarts it); the reader resynchronises over a damaged record and never loses the whole
records around it; after the disk fills mid-run and space returns, the audit's counts match what was
written. Logging is best effort: a log line that cannot be written is counted and dropped, and a
gateway reply is never lost to it.

The full disk is real: a tmpfs of 64 KB mounted for the test (root only; skipped elsewhere), where a
write that crosses into a page the filesystem cannot allocate returns short, then ENOSPC.

Run: .venv/bin/pytest tests/test_ledger.py
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import structlog

from areal_bus.runtime import logs
from areal_bus.runtime.ledger import Ledger, LedgerWriteError, audit, ledger_path, read

TINY_FS = "size=64k"
WHOLE_LINE = re.compile(r"^\[train\] .*ts=\d\d:\d\d:\d\d\.\d{3}$")


@pytest.fixture
def tiny_fs():
    """A 64 KB tmpfs, unmounted afterwards; ``fill(path)`` takes all of its free space."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder = Path(tempfile.mkdtemp(prefix="abl-", dir="/tmp"))
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", TINY_FS, "tmpfs", str(folder)], capture_output=True,
                         text=True, timeout=30)
    if res.returncode != 0:
        folder.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], timeout=30)  # lazy: a failed test may hold a file open
    folder.rmdir()


def _fill(path: Path) -> None:
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC


def _ids(first: int, n: int) -> list[str]:
    return [f"traj-{i:06d}" for i in range(first, first + n)]


def test_a_record_is_written_whole_or_its_write_raises_on_a_full_disk(tiny_fs):
    path = tiny_fs / "ledger" / "trainer-0.jsonl"
    ledger = Ledger(path)
    written, raised = 0, None
    for k in range(10_000):  # ~64 KB of records of ~350 bytes: the disk fills within 200
        try:
            ledger.write("accepted", inc="a", ids=_ids(k * 25, 25))
        except OSError as err:
            raised = err
            break
        written += 1
        assert path.read_bytes().endswith(b"\n"), f"record {k} was torn, yet its write returned"
    ledger.close()
    assert isinstance(raised, LedgerWriteError) and raised.errno == errno.ENOSPC
    assert str(path) in str(raised) and "no space" in str(raised).lower()
    recs, damaged = read(path)
    assert len(recs) == written and damaged == (0 if path.read_bytes().endswith(b"\n") else 1)


def test_the_reader_resyncs_over_a_record_torn_in_the_middle(tmp_path):
    """What a short write without a newline left before this fix: a torn record with the next
    incarnation's first record glued to it, mid-file."""
    path = tmp_path / "trainer-0.jsonl"
    whole = [json.dumps({"ev": "accepted", "inc": "a", "ids": _ids(k * 3, 3)}, separators=(",", ":")) for k in range(4)]
    torn = whole[1][: len(whole[1]) // 2]
    path.write_text(f"{whole[0]}\n{torn}{whole[2]}\n{whole[3]}\n")
    recs, damaged = read(path)
    assert [r["ids"] for r in recs] == [json.loads(w)["ids"] for w in (whole[0], whole[2], whole[3])]
    assert damaged == 1  # the torn one, counted, and none of its ids attributed to anything


def test_garbage_inside_a_line_is_one_damaged_record_and_whole_records_around_it_stay(tmp_path):
    path = tmp_path / "x.jsonl"
    a, b = (json.dumps({"ev": "step", "inc": "a", "step": s, "ids": [f"t{s}"]}, separators=(",", ":")) for s in (0, 1))
    path.write_bytes(f"{a}".encode() + b"\x00\xff garbage " + f"{b}\n".encode())
    recs, damaged = read(path)
    assert [r["step"] for r in recs] == [0, 1] and damaged == 1


def test_a_full_disk_mid_run_then_space_returning_leaves_an_audit_that_matches(tiny_fs):
    """A trainer's ledger: the disk fills (its write raises, the trainer dies), space returns, the
    restarted trainer (a fresh start: no checkpoint) accepts its backlog again and trains it all."""
    ballast = tiny_fs / "ballast"
    ballast.write_bytes(b"\0" * 40960)  # what is freed when "space returns"
    path = ledger_path(tiny_fs, "trainer-0")
    ledger = Ledger(path)
    ledger.write("start", inc="a", epoch=0, resumed_step=0, ckpt_inc=None)
    accepted, k = [], 0
    with pytest.raises(LedgerWriteError):
        while True:  # accept a batch, then train it, until the disk is full
            ids = _ids(k * 20, 20)
            ledger.write("accepted", inc="a", ids=ids)
            accepted += ids
            ledger.write("step", inc="a", step=k, ids=ids)
            k += 1
    ledger.close()
    assert not path.read_bytes().endswith(b"\n"), "the disk filled at a record boundary: no torn record to test"
    with pytest.raises(LedgerWriteError):  # restarted while the disk is still full: it fails again, loudly
        Ledger(path).write("start", inc="b", epoch=1, resumed_step=0, ckpt_inc=None)

    ballast.unlink()
    ledger = Ledger(path)  # restarted once space returned
    ledger.write("start", inc="b", epoch=1, resumed_step=0, ckpt_inc=None)
    ledger.write("accepted", inc="b", ids=accepted)
    for step in range(0, len(accepted), 20):
        ledger.write("step", inc="b", step=step // 20, ids=accepted[step:step + 20])
    ledger.write("finished", inc="b", version=len(accepted) // 20, unconsumed=[])
    ledger.close()

    got = audit(tiny_fs)
    assert (got["accepted"], got["trained"], got["lost"], got["duplicated"], got["unknown"]) == \
        (len(accepted), len(accepted), 0, 0, 0), got
    assert got["torn_lines"] == 1 and got["trainer_incarnations"] == 2 and got["finished"], got


def test_a_log_line_on_a_full_disk_is_counted_and_dropped(tiny_fs):
    log = logs.setup_logging("trainer", tiny_fs, echo=False, node="trainer-0")
    log.info("step", step=0)
    _fill(tiny_fs / "ballast")  # the log file's last page still has room: some lines fit, then none
    before = logs.log_failures()
    try:
        for step in range(1, 200):
            log.info("step", step=step, loss=0.5)
        log.warning("something_to_see", detail="x" * 200)
    finally:
        structlog.reset_defaults()
    failed = logs.log_failures() - before
    whole = [line for line in (tiny_fs / "train.log").read_text().splitlines() if WHOLE_LINE.match(line)]
    assert failed > 0 and len(whole) + failed == 201, (len(whole), failed)  # every line: written or counted
    assert whole[0].startswith("[train] step=0 ")


@pytest.mark.timeout(120)
def test_a_gateway_session_opens_and_ends_with_2xx_while_its_log_disk_is_full(tiny_fs):
    from tests.test_gateway_openai import ScriptedBackend, Server

    logs.setup_logging("gateway", tiny_fs, echo=False, node="gateway-0")  # the gateway's default logger
    _fill(tiny_fs / "ballast")
    before = logs.log_failures()
    server = Server(backend=ScriptedBackend(["8", "10"]))
    try:
        session = server.open_session(meta={"task": "guess"})
        chat = server.client(session["api_key"]).chat.completions.create(
            model=session["model"], messages=[{"role": "user", "content": "Guess my number"}])
        assert chat.choices[0].message.content == "8"
        r = server.post(f"/rl/sessions/{session['session_id']}/end", {"reward": 1.0})
        assert r.status_code == 200, r.text
        assert [t.episode_id for t in server.emitted] == [session["session_id"]]
    finally:
        server.close()
        structlog.reset_defaults()
    assert logs.log_failures() > before
