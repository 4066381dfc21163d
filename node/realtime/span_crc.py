"""CRC-32 (``zlib.crc32``) of many equal-length spans at once, in numpy (pure).

An index entry's CRC covers its first 28 bytes (``node/realtime/index.py``); an append writes
one entry per message, a read at open checks one per entry. ``zlib.crc32`` per entry costs a
slice and a call each (~0.22 us per entry, ~90 us per 400-message frame). Over a fixed
length the CRC is affine in the input bits: ``crc(x) = crc(0...0) ^ XOR_q T[q][x_q]``,
``T[q][v]`` being the part that the 16-bit word ``v`` at word position ``q`` contributes
(``crc(word at q) ^ crc(zeros)``). Table lookups over all entries and one XOR reduction
give every CRC (~3x faster at 400 entries). Same answer as ``zlib.crc32`` for every input
(tests/test_realtime_inflight.py checks it against zlib with hypothesis).

The tables take ``span / 2 * 65536 * 4`` bytes (3.5 MiB for 28 bytes) and are built on the
first call (a few milliseconds); below ``SPAN_CRC_N_MIN`` spans the per-span loop is
cheaper (the lookups' fixed cost) and is used instead.

Example::

    raw = bytes(64)                                   # two 32-byte entries
    span_crcs(raw, 2, span=28, stride=32)             # == [zlib.crc32(raw[0:28]), zlib.crc32(raw[32:60])]
"""

from __future__ import annotations

import zlib

import numpy as np

SPAN_CRC_N_MIN = 64  # fewer spans than this: one zlib.crc32 per span (cheaper than the lookups)

_tables: dict[int, tuple[np.uint32, np.ndarray, np.ndarray]] = {}  # span -> (crc of zeros, T, word positions)


def _byte_tables(span: int) -> tuple[int, np.ndarray]:
    """``(crc of span zero bytes, B)``: ``B[p][v]`` = what byte value ``v`` at position ``p`` adds."""
    c0 = zlib.crc32(bytes(span))
    b = np.zeros((span, 256), np.uint32)
    buf = bytearray(span)
    for p in range(span):
        for v in range(256):
            buf[p] = v
            b[p, v] = zlib.crc32(buf) ^ c0
        buf[p] = 0
    return c0, b


def _word_tables(span: int) -> tuple[np.uint32, np.ndarray, np.ndarray]:
    got = _tables.get(span)
    if got is None:
        c0, b = _byte_tables(span)
        v = np.arange(1 << 16)
        words = span // 2  # little-endian 16-bit words: low byte first in the input
        t = np.empty((words, 1 << 16), np.uint32)
        for q in range(words):
            t[q] = b[2 * q][v & 0xFF] ^ b[2 * q + 1][v >> 8]
        got = _tables[span] = (np.uint32(c0), t, np.arange(words))
    return got


def span_crcs(raw: bytes, n: int, *, span: int, stride: int) -> np.ndarray:
    """u32 ``zlib.crc32(raw[i * stride:i * stride + span])`` for ``i`` in ``range(n)``
    (``span`` even, at most ``stride``; ``raw`` holds at least ``n * stride`` bytes)."""
    if n < SPAN_CRC_N_MIN:
        crc = zlib.crc32
        return np.fromiter(map(crc, [raw[p:p + span] for p in range(0, n * stride, stride)]), np.uint32, n)
    c0, t, cols = _word_tables(span)
    w = np.frombuffer(raw, "<u2", n * stride // 2).reshape(n, stride // 2)[:, :span // 2]
    return np.bitwise_xor.reduce(t[cols, w], axis=1) ^ c0


__all__ = ["SPAN_CRC_N_MIN", "span_crcs"]
