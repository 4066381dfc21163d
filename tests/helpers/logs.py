"""Reading whole logs in tests (byte-for-byte comparisons of replicas)."""

from __future__ import annotations

from node.store.log import SegmentedLog


def log_bytes(path) -> bytes:
    """Every framed record of the segmented log at ``path``, concatenated."""
    lg = SegmentedLog.open(path, segment_bytes_max=64 * 1024 * 1024)
    try:
        out, off = bytearray(), lg.start_offset
        while off < lg.end_offset:
            chunk = lg.read_bytes(off, 1 << 20)
            out += chunk
            off += len(chunk)
        return bytes(out)
    finally:
        lg.close()
