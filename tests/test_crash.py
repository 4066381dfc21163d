"""Crash test: a real subprocess appending, iterating and dispatching is SIGKILLed
at seeded random moments; after every restart nothing acknowledged is lost,
nothing is filed twice, nothing recorded in the dispatch log is delivered again."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from cluster.codec import Batch, DispatchBatch
from node.store.log import SegmentedLog

ROOT = Path(__file__).resolve().parent.parent
KILLS = int(os.environ.get("HOURGLASS_CRASH_KILLS", "20"))
SEED = int(os.environ.get("HOURGLASS_CRASH_SEED", "7"))


WORKER_START_S_MAX = 60.0  # how long a starved machine may take to start a worker


def _run(data: Path, run: int, extra: list[str], *, kill_after_s: float | None, log_path: Path) -> int:
    size_before = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as logf:
        p = subprocess.Popen([sys.executable, "-m", "tests.helpers.crash_worker", str(data), str(run), str(SEED), *extra],
                             cwd=ROOT, stdout=logf, stderr=subprocess.PIPE)
        try:
            if kill_after_s is None:
                _, err = p.communicate(timeout=60)
            else:
                # the kill lands kill_after_s into the worker's work, not into its start-up: on a
                # starved machine a worker killed by the clock alone may not have sent anything yet
                # in any run (then the test had nothing to check); wait for its first line, bounded
                started = time.monotonic()
                while (time.monotonic() - started < WORKER_START_S_MAX and p.poll() is None
                       and log_path.stat().st_size <= size_before):
                    time.sleep(0.02)
                time.sleep(kill_after_s)
                p.send_signal(signal.SIGKILL)
                _, err = p.communicate(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    if kill_after_s is None or p.returncode not in (-signal.SIGKILL,):
        assert p.returncode in (0, -signal.SIGKILL), err.decode()[-3000:]
    return p.returncode


def _dispatched_seqs(data: Path) -> set[int]:
    log = SegmentedLog.open(data / "dispatch", segment_bytes_max=16 * 1024)
    try:
        return {s for _, b in log.iterate() for s in DispatchBatch.decode(b).seq.tolist()}
    finally:
        log.close()


def test_sigkill_loop_loses_nothing_and_redelivers_nothing(tmp_path):
    rnd = random.Random(SEED)
    data = tmp_path / "data"
    out = tmp_path / "worker.log"
    violations: list[str] = []
    seen_dispatched: set[int] = set()
    for run in range(KILLS):
        before = out.read_text().count("\n") if out.exists() else 0
        _run(data, run, [], kill_after_s=rnd.uniform(0.15, 1.2), log_path=out)
        lines = out.read_text().splitlines()[before:]
        # what this run delivered must not include anything the dispatch log held at its start
        for ln in lines:
            if ln.startswith("DLV "):
                _, _, seq = ln.split()
                if int(seq) in seen_dispatched:
                    violations.append(f"run {run}: seq {seq} delivered again after being in the dispatch log")
        seen_dispatched = _dispatched_seqs(data)
    # drain: run without new sends until everything due has fired
    lines = out.read_text().splitlines()
    latest_due = max(int(ln.split()[2]) for ln in lines if ln.startswith("ACK "))
    before = len(lines)
    _run(data, KILLS, ["--drain", str(latest_due + 1500)], kill_after_s=None, log_path=out)
    lines = out.read_text().splitlines()
    for ln in lines[before:]:
        if ln.startswith("DLV ") and int(ln.split()[2]) in seen_dispatched:
            violations.append(f"drain: {ln} delivered again")
    acked = {ln.split()[1] for ln in lines if ln.startswith("ACK ")}
    cancelled = {ln.split()[1] for ln in lines if ln.startswith("CXL ")}
    delivered = Counter(ln.split()[1] for ln in lines if ln.startswith("DLV "))
    # a cancel the worker was killed in the middle of may have taken effect (its tombstone was
    # written, its answer never given): such a message may be delivered or not
    tried = {ln.split()[1] for ln in lines if ln.startswith("CXLTRY ")}
    answered = cancelled | {ln.split()[1] for ln in lines if ln.startswith("CXLFAIL ")}
    unknown = tried - answered
    lost = sorted(acked - cancelled - unknown - set(delivered))
    assert not lost, f"{len(lost)} acknowledged messages never delivered, e.g. {lost[:5]}"
    assert not violations, violations[:10]
    # no delivery printed after the cancel of that id was acknowledged
    cxl_at = {ln.split()[1]: i for i, ln in enumerate(lines) if ln.startswith("CXL ")}
    late = [ln for i, ln in enumerate(lines) if ln.startswith("DLV ") and cxl_at.get(ln.split()[1], 1 << 60) < i]
    assert not late, f"delivered after an acknowledged cancel: {late[:5]}"
    assert cxl_at, "the workload cancelled nothing"
    # each message is filed in the schedule log once
    seqs: Counter[int] = Counter()
    for bucket in (data / "schedule").iterdir():
        if not bucket.is_dir():
            continue
        log = SegmentedLog.open(bucket / "data", segment_bytes_max=64 * 1024)
        for _, body in log.iterate():
            seqs.update(Batch.decode(body).seq.tolist())
        log.close()
    twice = [s for s, n in seqs.items() if n > 1]
    assert not twice, f"{len(twice)} records filed twice"
    assert len(acked) > 100 and sum(delivered.values()) > 100
