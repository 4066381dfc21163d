"""Restart with 1,000,000 pending messages (issue 2): a real DelayStore in a subprocess
accepts them (due in about an hour), is SIGKILLed without closing, and the reopened
store serves: lookups of a sample, a cancel, and the messages of a due second.

Behaviour only; how long the restart takes is measured by ``bench/bench_restart.py``.
Run alone: ``python -m pytest -q tests/test_restart_large.py``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cluster.errors import NotFound, TooLate
from node.delay.store import DelayStore, StoreSettings
from node.store.records import Message

T0 = 1_800_000_000_000
DUE0 = T0 + 3_600_000         # first due second, one hour after the writer's clock
SPREAD_S = 3600                # message i is due in second i % SPREAD_S after DUE0
N = 1_000_000
BATCH = 10_000
CHECKPOINT_EVERY = 100_000     # like the service: checkpoints lag behind ingest
UNCHECKPOINTED_TAIL = 150_000  # accepted and durable after the last checkpoint: replayed on reopen
WRITER_TIMEOUT_S = 300.0
REPO = Path(__file__).resolve().parent.parent


def due_of(i: int) -> int:
    return DUE0 + (i % SPREAD_S) * 1000 + 7


def msg_id(i: int) -> str:
    return f"big-{i:07d}"


def writer(root: str) -> None:
    """Child process: accept N messages, checkpoint periodically, then wait to be killed."""
    store = DelayStore.open(root, StoreSettings(), now_ms=T0)
    payload = b"p" * 16
    last_ckpt = 0
    for start in range(0, N, BATCH):
        batch = [Message(seq=0, store_ms=0, deliver_at_ms=due_of(i), msg_id=msg_id(i), subject="big.s",
                         payload=payload) for i in range(start, min(N, start + BATCH))]
        res = store.accept(batch, now_ms=T0)
        assert not res.codes.any(), res.errors
        store.flush_messages()  # durable: this is the acknowledgement
        done = start + len(batch)
        if done <= N - UNCHECKPOINTED_TAIL:
            store.iterate(limit=None)
            if done - last_ckpt >= CHECKPOINT_EVERY:
                store.checkpoint()
                last_ckpt = done
    print(f"ready {N}", flush=True)
    time.sleep(WRITER_TIMEOUT_S)  # bounded: the parent kills us long before


@pytest.fixture
def killed_store_dir(tmp_path):
    root = tmp_path / "delay"
    proc = subprocess.Popen([sys.executable, __file__, "writer", str(root)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = b""
        deadline = time.monotonic() + WRITER_TIMEOUT_S
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith(b"ready") or not line:
                break
        assert line.startswith(b"ready"), f"writer failed: {proc.stderr.read().decode()[-2000:]}"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return root


def test_restart_after_sigkill_with_a_million_pending(killed_store_dir):
    now = T0 + 60_000
    store = DelayStore.open(killed_store_dir, StoreSettings(), now_ms=now)
    try:
        rnd = random.Random(7)
        # a sample from everywhere, including the replayed tail that no checkpoint covered
        sample = rnd.sample(range(N), 300) + list(range(N - 50, N))
        for i in sample:
            r = store.lookup(msg_id(i))
            assert (r.status, r.deliver_at_ms, r.subject) == ("pending", due_of(i), "big.s"), (i, r)
        with pytest.raises(NotFound):
            store.lookup("big-never-sent")
        # the replay walked everything after the last checkpoint (some of it already filed: the
        # first due second below holds messages from that stretch exactly once)
        last_ckpt = (N - UNCHECKPOINTED_TAIL) // CHECKPOINT_EVERY * CHECKPOINT_EVERY
        assert store.counters["filed"] == N - last_ckpt
        assert any(last_ckpt <= i < N - UNCHECKPOINTED_TAIL for i in range(0, N, SPREAD_S))

        # cancel one message of the first due second (from the replayed tail) and one of a later second
        first_second = [i for i in range(0, N, SPREAD_S)]
        cancelled = first_second[-1]
        assert cancelled >= N - UNCHECKPOINTED_TAIL
        store.cancel(msg_id(cancelled), now_ms=now)
        store.cancel(msg_id(5), now_ms=now)
        store.flush_messages()
        store.iterate(limit=None)
        assert store.lookup(msg_id(cancelled)).status == "cancelled"
        assert store.lookup(msg_id(5)).status == "cancelled"

        # nothing is due before DUE0
        assert store.poll_due(now_ms=now) == []
        # the first due second loads, minus the cancelled one, each message once
        fired: list[str] = []
        t = DUE0 - 1000
        while t <= DUE0 + 999:
            for d in store.poll_due(now_ms=t):
                fired += d.batch.id_list()
                store.ack_dispatched(d.unit, np.arange(d.batch.n), now_ms=t)
            t += 10
        assert sorted(fired) == sorted(msg_id(i) for i in first_second if i != cancelled)
        assert store.lookup(msg_id(0)).status == "dispatched"
        with pytest.raises(TooLate):
            store.cancel(msg_id(0), now_ms=t)
        assert store.lookup(msg_id(1)).status == "pending"  # due one second later
    finally:
        store.close()


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "writer":
    writer(sys.argv[2])
