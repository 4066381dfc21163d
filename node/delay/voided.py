"""Voided seqs: the records of a divergent suffix cut off the message log (node/delay/cuts.py),
kept as half-open seq ranges ``[lo, hi)``. A record whose seq is voided is not delivered, and
a lookup says so; a record that comes back (replicated again) is taken out of the ranges.

Pure functions over a list of ranges; ``DelayCore`` holds the list and persists it through
the shell (``voided.json``). Invariant: ranges never overlap, and seqs of one store epoch
grow with the log, so a cut voids one range per epoch.

Example: ranges ``[(10, 20)]``; seq 15 comes back -> ``[(10, 15), (16, 20)]``.
"""

from __future__ import annotations

import numpy as np

from node.store import records


def mask(ranges: list[tuple[int, int]], seq: np.ndarray) -> np.ndarray:
    """Per seq, whether it is voided."""
    out = np.zeros(len(seq), bool)
    for lo, hi in ranges:
        out |= (seq >= np.uint64(lo)) & (seq < np.uint64(hi))
    return out


def contains(ranges: list[tuple[int, int]], seq: int) -> bool:
    return any(lo <= seq < hi for lo, hi in ranges)


def ranges_of(seqs: np.ndarray) -> list[tuple[int, int]]:
    """The ranges that void ``seqs`` cut off the log: one per store epoch among them."""
    epochs = seqs >> np.uint64(records.SEQ_EPOCH_SHIFT)
    out = []
    for ep in np.unique(epochs).tolist():
        mine = seqs[epochs == ep]
        out.append((int(mine.min()), int(mine.max()) + 1))
    return out


def without(ranges: list[tuple[int, int]], seq: np.ndarray) -> tuple[list[tuple[int, int]], bool]:
    """``ranges`` with ``seq`` taken out, and whether that changed anything."""
    if not ranges or not len(seq):
        return ranges, False
    s = np.sort(seq)
    out: list[tuple[int, int]] = []
    changed = False
    for lo, hi in ranges:
        a, b = np.searchsorted(s, np.uint64(lo)), np.searchsorted(s, np.uint64(hi))
        if a == b:
            out.append((lo, hi))
            continue
        changed = True
        start = lo
        for x in [int(x) for x in s[a:b].tolist()]:
            if x > start:
                out.append((start, x))
            start = max(start, x + 1)
        if start < hi:
            out.append((start, hi))
    return (out if changed else ranges), changed
