"""docs/format.md must match the code that writes the bytes."""

from __future__ import annotations

from pathlib import Path

from node.store import log, records, schedule
from node import wheel

DOC = (Path(__file__).resolve().parent.parent / "docs" / "format.md").read_text()


def test_schedule_index_layout_documented():
    assert schedule.ENTRY.format in DOC
    assert schedule.ENTRY_SIZE == 40 and "40-byte" in DOC
    assert schedule.HEADS_MAGIC.decode() in DOC


def test_frame_header_documented():
    assert log.HEADER_SIZE == 12
    for field in ("u32 body_len", "u32 body_crc", "u32 header_crc"):
        assert field in DOC


def test_record_fields_documented():
    assert records.VERSION == 1
    for field in ("version", "kind", "attempts", "seq", "store_ms", "deliver_at_ms", "payload"):
        assert f"| {field} |" in DOC
    assert records._DISPATCH.size == 25 and "25 bytes" in DOC


def test_tick_state_documented():
    assert '"HGTS"' in DOC
    assert len(wheel.TickState(1, 2, 3, 4).encode()) == 37
