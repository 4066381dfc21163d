"""docs/format.md must match the code that writes the bytes."""

from __future__ import annotations

from pathlib import Path

from node.realtime import store as rt_store
from cluster import codec
from node.store import idindex, log, schedule
from node import wheel

DOC = (Path(__file__).resolve().parent.parent / "docs" / "format.md").read_text()


def test_schedule_index_layout_documented():
    assert schedule.ENTRY.format in DOC
    assert schedule.ENTRY_SIZE == 48 and "48-byte" in DOC
    assert schedule.HEADS_MAGIC.decode() in DOC


def test_frame_header_documented():
    assert log.HEADER_SIZE == 12
    for field in ("u32 body_len", "u32 body_crc", "u32 header_crc"):
        assert field in DOC


def test_batch_record_documented():
    assert codec.VERSION == 2 and codec.HEADER.format in DOC and codec.HEADER_SIZE == 24
    assert codec.COLUMN_BYTES == 49 and "49 bytes per record" in DOC
    for field in ("seq", "deliver_at_ms", "effective_ms", "store_ms", "id_end", "payload_end", "extra_end",
                  "attempts", "subject_idx", "kind"):
        assert f"| {field} |" in DOC
    assert codec.DISPATCH_HEADER.size == 16 and "16 + 24 n bytes" in DOC


def test_tick_state_documented():
    assert '"HGTS"' in DOC
    assert len(wheel.TickState(1, 2, 3, 4).encode()) == 37


def test_id_index_layout_documented():
    assert idindex.ENTRY.format in DOC and idindex.ENTRY_SIZE == 40
    assert f'"{idindex.MAGIC.decode()}"' in DOC


def test_realtime_layout_documented():
    assert rt_store.ENTRY.format in DOC and rt_store.ENTRY.size == 32 and "32 bytes" in DOC
    for field in ('"committed"', '"next"', '"pending"'):
        assert field in DOC


def test_replication_files_documented():
    for name in ("messages.epochs", "dispatch.epochs", "voided.json", '"replicated"'):
        assert name in DOC
