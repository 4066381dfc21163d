"""Atomic checkpoint files: small JSON documents guarded by a CRC.

Layout: one line of JSON, a newline, then ``crc32=<8 hex digits>`` over the JSON
bytes. Written as a fresh owner-only (0600) temp file -> fsync -> rename -> fsync(dir)
(``cluster.files.write_atomic``), so a reader sees either the old or the new document, never
a mix. A file failing its check raises ``CorruptRecord`` naming the file.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

from cluster import files
from cluster.errors import CorruptRecord


def write_atomic(path: str | os.PathLike, doc: dict[str, Any]) -> None:
    p = Path(path)
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    data = body + b"\ncrc32=%08x\n" % zlib.crc32(body)
    files.write_atomic(p, data, mode=files.DATA_MODE)


def read(path: str | os.PathLike) -> dict[str, Any] | None:
    """The document, or None if the file does not exist."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        return None
    body, sep, tail = data.rstrip(b"\n").rpartition(b"\n")
    if not sep or not tail.startswith(b"crc32="):
        raise CorruptRecord(str(p), 0, "checkpoint has no crc line")
    try:
        want = int(tail[6:], 16)
    except ValueError:
        raise CorruptRecord(str(p), len(body) + 1, "checkpoint crc is not hex") from None
    if zlib.crc32(body) != want:
        raise CorruptRecord(str(p), 0, "checkpoint crc mismatch")
    return json.loads(body)
