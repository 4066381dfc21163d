"""What the timing wheel (``node/wheel.py``) holds its entries in: runs of numpy arrays
sorted by due, and a seq index over them. Pure, no clock and no I/O; the wheel owns
which runs exist, their heap and when the index is brought up to date or rebuilt.

* ``Run``: one sorted-by-due copy of the arrays of the chunks one ``load_second`` (or one
  merge of staged ``add`` s) held; ``[pos:]`` not returned yet, ``dead`` marks cancelled
  entries. Its arrays are read-only (``frozen``): ``Fired`` hands out views of them.
  Invariant: ``in_pos`` is the inverse of the sort order (the run position of each entry
  in input order), so the live entries can be listed in input order for the index.
* ``SeqIndex``: ``seq -> (run id, position)`` as a few sorted runs (an LSM in numpy);
  O(log n) runs, each mapping merged O(log n) times. Mappings are never deleted, so a
  hit may be stale and the wheel checks every one against its run.
"""

from __future__ import annotations

import numpy as np


def frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class Run:
    """Held entries sorted by due; ``[pos:]`` not returned yet. See ``node/wheel.py``'s docstring."""

    __slots__ = ("rid", "due", "seq", "idx", "refs", "refno", "in_pos", "pos", "dead")

    def __init__(self, rid: int, due, seq, idx, refs: list, refno: np.ndarray | None, order: np.ndarray) -> None:
        self.rid = rid
        # Position in the run of each entry in input order. Frames list seqs in increasing
        # order, so seqs taken in input order are a few sorted stretches: the seq index
        # sorts them with timsort in a fraction of the time a random order would take.
        in_pos = np.empty(len(order), np.int32)
        in_pos[order] = np.arange(len(order), dtype=np.int32)
        self.in_pos = in_pos
        self.due = frozen(due)
        self.seq = frozen(seq)
        self.idx = frozen(idx)
        self.refs = refs  # one ref, or the refs that refno points into
        self.refno = refno  # None: every entry is of refs[0]
        self.pos = 0
        self.dead: np.ndarray | None = None  # bool per entry, made by the first cancel that hits the run

    def live_from(self, pos: int) -> np.ndarray:
        """Positions >= pos not cancelled."""
        if self.dead is None:
            return np.arange(pos, len(self.due))
        return pos + np.flatnonzero(~self.dead[pos:])

    def live_in_input_order(self) -> np.ndarray:
        """Positions of the live entries, in input order."""
        p = self.in_pos
        if self.pos:
            p = p[p >= self.pos]
        if self.dead is not None:
            p = p[~self.dead[p]]
        return p


class SeqIndex:
    """``seq -> (run id, position)`` as a few sorted runs, newest last (an LSM, in numpy).

    A new batch becomes a run; the last two runs merge while the older one is at
    most twice the newer, so there are O(log n) runs and each mapping is merged
    O(log n) times. Mappings are never deleted: a hit may be stale (fired or
    cancelled) and the caller checks it. Within a run, equal seqs keep their
    insertion order, so the last one is the newest.
    """

    __slots__ = ("runs", "size")

    def __init__(self) -> None:
        self.runs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.size = 0

    def reset(self) -> None:
        self.runs = []
        self.size = 0

    def append(self, seq: np.ndarray, rid: np.ndarray, pos: np.ndarray) -> None:
        """Index a batch of live entries (no seq twice), best in frame order (sorted stretches)."""
        order = np.argsort(seq, kind="stable")  # timsort: O(n log stretches)
        runs = self.runs
        runs.append((seq[order], rid[order], pos[order]))
        self.size += len(seq)
        while len(runs) >= 2 and len(runs[-2][0]) <= 2 * len(runs[-1][0]):
            (s1, r1, p1), (s2, r2, p2) = runs[-2], runs[-1]
            s = np.concatenate([s1, s2])
            order = np.argsort(s, kind="stable")  # a merge of two sorted runs: O(n) for timsort
            runs[-2:] = [(s[order], np.concatenate([r1, r2])[order], np.concatenate([p1, p2])[order])]

    def lookup(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Candidate (run id, position) pairs of ``seqs``: the newest mapping per index run."""
        rids, poss = [], []
        for keys, rid, pos in self.runs:
            i = keys.searchsorted(seqs, side="right") - 1
            ok = i >= 0
            i = i[ok]
            i = i[keys[i] == seqs[ok]]
            if len(i):
                rids.append(rid[i])
                poss.append(pos[i])
        if not rids:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return np.concatenate(rids), np.concatenate(poss)
