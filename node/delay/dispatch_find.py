"""When a dispatched message fired: its dispatch record, found in the dispatch log (the trace, issue 31).

The dispatch log (``{root}/dispatch/``, ``DispatchBatch`` records, ``docs/design.md``) holds
one record per settled dispatch round: the seqs, their effective times, ``dispatched_ms``
and the outcome (delivered or dead-lettered). No index maps a seq to its record, and none is
added: a lookup is rare, and the records are appended in firing order, which is the order of
effective time up to retries (a message given back to the wheel fires again later). So:

1. pick the segment: the last one whose first record's smallest effective time is before
   the message's (strictly: a backlog filed under one floor time spans segments with the
   same effective time, and the message may be in the first of them), by a binary search
   over the segments (one record read per step);
2. read on from that segment's start, at most ``DISPATCH_SCAN_RECORDS_MAX`` records, until
   a record holds the seq; stop early at a record whose every effective time is more than
   ``RETRY_SLACK_MS`` past the message's. A message given back to the wheel and fired
   again later is recorded further on, after records of later effective times: the scan
   reaches it while it is within the bound.

Bounded: ``log2(segments) + 1 + DISPATCH_SCAN_RECORDS_MAX`` record reads. Not found within
the bound (a segment busier than that, or retention deleted the record): ``None``, and the
Lookup answers ``dispatched_ms`` 0 ("not known"). The record format is unchanged: records
written before this module are read the same way.

Worked example: segments based at 0, 5000 and 9000, their first records' smallest
effective times 1000, 9000 and 9050; a message filed under 9050 starts the scan at segment
5000 (9000 < 9050; 9050 is not before it), reads records in order and answers the
``dispatched_ms`` of the record holding its seq.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cluster.codec import OUTCOME_DEAD_LETTER, DispatchBatch
from cluster.errors import HourglassError

DISPATCH_SCAN_RECORDS_MAX = 4096  # dispatch records read at most by one lookup
RETRY_SLACK_MS = 60_000           # a record this far past the message's effective time ends the scan


@dataclass(frozen=True, slots=True)
class Dispatched:
    dispatched_ms: int
    dead_lettered: bool


def _first_eff(log, base: int) -> int | None:
    """The smallest effective time of the first record of the segment at ``base``."""
    try:
        body, _ = log.read(base)
        d = DispatchBatch.decode(body)
    except (HourglassError, OSError):
        return None
    return int(d.effective_ms.min()) if d.n else None


def start_segment(bases: list[int], first_eff, effective_ms: int) -> int:
    """Index into ``bases`` of the segment to scan from (pure: ``first_eff(base)`` reads)."""
    lo, hi = 0, len(bases) - 1
    pick = 0
    while lo <= hi:
        mid = (lo + hi) // 2
        eff = first_eff(bases[mid])
        if eff is not None and eff < effective_ms:
            pick, lo = mid, mid + 1
        else:
            hi = mid - 1
    return pick


def find_in(records, seq: int, effective_ms: int, records_max: int = DISPATCH_SCAN_RECORDS_MAX) -> Dispatched | None:
    """The dispatch of ``seq`` among ``records`` (``(offset, body)`` in log order; pure)."""
    want = np.uint64(seq)
    for k, (_, body) in enumerate(records):
        if k >= records_max:
            return None
        d = DispatchBatch.decode(body)
        if not d.n:
            continue
        if (d.seq == want).any():
            return Dispatched(int(d.dispatched_ms), d.outcome == OUTCOME_DEAD_LETTER)
        if int(d.effective_ms.min()) > effective_ms + RETRY_SLACK_MS:
            return None
    return None


def dispatched_at(log, seq: int, effective_ms: int, records_max: int = DISPATCH_SCAN_RECORDS_MAX) -> Dispatched | None:
    """``Dispatched`` for message ``seq`` filed under ``effective_ms`` from the dispatch log ``log``
    (a ``SegmentedLog``), or None (not found within the bound)."""
    if log.end_offset <= log.start_offset:
        return None
    bases = [b for b in log.segment_bases() if b >= log.start_offset]
    if not bases:
        return None
    i = start_segment(bases, lambda b: _first_eff(log, b), effective_ms)
    try:
        return find_in(log.iterate(bases[i]), seq, effective_ms, records_max)
    except (HourglassError, OSError):
        return None  # a corrupt record on the way: the time is "not known", the lookup still answers


__all__ = ["DISPATCH_SCAN_RECORDS_MAX", "Dispatched", "dispatched_at", "find_in", "start_segment"]
