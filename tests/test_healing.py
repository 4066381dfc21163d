"""Derived data heals itself: a schedule bucket that fails a check is rebuilt from the
message log, nothing lost, nothing delivered twice (node/delay/heal.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cluster.errors import TooLate
from node.store.schedule import REBUILT_MARKER, ScheduleLog
from tests.test_delay_store import SMALL, T0, Harness, msg

HOUR = 3_600_000


def bucket_dir(root: Path, start_ms: int) -> Path:
    return Path(root) / "schedule" / f"{start_ms:018d}"


def flip(path: Path, at: int | None = None) -> int:
    """Flip one bit of a byte in the middle of ``path`` (or at ``at``); returns the position."""
    data = bytearray(path.read_bytes())
    pos = len(data) // 2 if at is None else at
    data[pos] ^= 0x10
    path.write_bytes(bytes(data))
    return pos


def data_segment(root: Path, start_ms: int) -> Path:
    (seg,) = sorted((bucket_dir(root, start_ms) / "data").glob("*.log"))
    return seg


def scenario(tmp_path, due_base: int, n: int = 60) -> Harness:
    """n messages due over 6 s from ``due_base`` in 6 batches; m3 cancelled."""
    h = Harness(tmp_path)
    for k in range(6):
        h.send([msg(i, due_base + 1_000 * (1 + i % 6) + i) for i in range(k * n // 6, (k + 1) * n // 6)])
    h.store.cancel("m3", now_ms=h.now)
    h.store.flush_messages()
    h.store.iterate(limit=None)
    return h


def test_flipped_byte_in_current_bucket_is_rebuilt_at_open(tmp_path):
    h = scenario(tmp_path, T0)
    h.run_until(T0 + 3_500)  # about half delivered
    first = list(h.delivered)
    assert first and "m3" not in first
    h.store.checkpoint()
    flip(data_segment(tmp_path, T0))
    h.crash()
    assert h.store.healer.counters["buckets_rebuilt"] == 1
    assert (bucket_dir(tmp_path, T0) / REBUILT_MARKER).exists()
    assert h.store.lookup("m3").status == "cancelled"
    assert h.store.lookup(first[0]).status == "dispatched"
    h.delivered = []
    h.run_until(T0 + 10_000)
    everything = first + h.delivered
    assert sorted(everything) == sorted(f"m{i}" for i in range(60) if i != 3)
    assert len(everything) == len(set(everything))  # nothing delivered twice


def test_flipped_byte_in_future_bucket_heals_on_lookup_and_cancel(tmp_path):
    future = T0 + 2 * HOUR
    h = scenario(tmp_path, future)
    h.store.checkpoint()
    flip(data_segment(tmp_path, future))  # under the running store: found by the next read
    assert h.store.healer.counters["buckets_rebuilt"] == 0
    statuses = {i: h.store.lookup(f"m{i}").status for i in range(60)}  # every id of the hour answers
    assert statuses == {i: "cancelled" if i == 3 else "pending" for i in range(60)}
    assert h.store.healer.counters["buckets_rebuilt"] == 1
    assert h.store.cancel("m11", now_ms=h.now) > 0
    assert h.store.lookup("m3").status == "cancelled"
    assert h.store.healer.counters["buckets_rebuilt"] == 1
    h.store.flush_messages()
    h.store.iterate(limit=None)
    h.crash()  # the rebuilt bucket survives a restart as it is
    assert h.store.healer.counters["buckets_rebuilt"] == 0
    assert h.store.lookup("m11").status == "cancelled"
    h.now = future
    h.run_until(future + 10_000, step=50)
    assert sorted(h.delivered) == sorted(f"m{i}" for i in range(60) if i not in (3, 11))


def test_lazy_rebuild_while_running_when_the_wheel_reaches_the_hour(tmp_path):
    nxt = T0 + HOUR
    h = scenario(tmp_path, nxt)
    # corrupt the index while the bucket is open (a bad disk): the chain walk fails, the wheel heals it
    b = h.store.schedule.bucket(nxt)
    os.pwrite(b._index_fd, b"\xff\xff\xff\x7f", 8)  # entry 0's prev points forward: chain broken
    h.now = nxt
    h.run_until(nxt + 10_000, step=50)
    assert h.store.healer.counters["buckets_rebuilt"] == 1
    assert sorted(h.delivered) == sorted(f"m{i}" for i in range(60) if i != 3)
    with pytest.raises(TooLate):
        h.store.cancel("m5", now_ms=h.now)


@pytest.mark.parametrize("part", ["index", "heads"])
def test_flipped_index_or_heads_of_current_bucket_is_rebuilt(tmp_path, part):
    h = scenario(tmp_path, T0 + 20_000)
    h.store.checkpoint()
    h.store.schedule.close()
    path = bucket_dir(tmp_path, T0) / part
    size = path.stat().st_size
    if part == "index":
        flip(path, 48 * 3 + 24)  # entry 3's last_seq: the replay mark would skip records
    else:
        heads = path.read_bytes()
        nonzero = [i for i in range(32, size, 4) if heads[i:i + 4] != b"\0\0\0\0"]
        flip(path, nonzero[2])
    h.crash()
    assert h.store.healer.counters["buckets_rebuilt"] == 1
    h.run_until(T0 + 30_000, step=50)
    assert sorted(h.delivered) == sorted(f"m{i}" for i in range(60) if i != 3)


def test_healthy_store_rebuilds_nothing(tmp_path):
    h = scenario(tmp_path, T0)
    h.run_until(T0 + 3_500)
    h.restart()
    h.crash()
    assert h.store.healer.counters == {"corrupt_found": 0, "buckets_rebuilt": 0, "frames_rebuilt": 0}


def test_an_interrupted_swap_is_finished_or_discarded_at_open(tmp_path):
    root = tmp_path / "schedule"
    sl = ScheduleLog(root)
    sl.bucket(T0)
    sl.close()
    (root / f"{T0:018d}.rebuild").mkdir()          # incomplete: discarded
    ready = root / f"{T0 + HOUR:018d}.ready"        # complete: swapped in
    ready.mkdir()
    (ready / "marker").write_text("x")
    ScheduleLog(root).close()
    assert not (root / f"{T0:018d}.rebuild").exists()
    assert (root / f"{T0 + HOUR:018d}" / "marker").exists()
    assert (root / f"{T0:018d}").exists()
