"""The de-duplication window of a real-time node (pure: time comes in as ``store_ms``/``now_ms``).

A message whose (subject, id) was stored less than ``window_ms`` ago is a duplicate: it
is answered with the first copy's seq and not stored again. RAM per stored message is
one dict entry ``key_of(subject, id) -> seq`` (the window itself takes any hashable key);
the expiry order is kept **per frame** (one deque entry per appended batch: its store_ms,
keys, seqs, log offset and generation), so nothing per message is created besides the dict
entry, and every dict operation runs over a whole batch at once (``map(dict.get, keys)``,
``dict.update(zip(keys, seqs))``).

**Generations, not one dict.** The entries live in dicts of at most ``gen_entries_max``
entries each (``GENERATION_ENTRIES_MAX``, 131,072, or an eighth of a smaller
``entries_max``; more only for one frame bigger than that): new frames go into the newest;
expiry deletes from the one a frame went into; a dict emptied is dropped. One dict of two
million entries that is both filled and emptied paused the node for 100-500 ms whenever
CPython rebuilt it (a growth past two thirds of its table, or a table full of deleted
slots: at 175k, 350k, 700k and 1.4M entries, then every ~40 s at 20,000 msgs/s;
docs/benchmarks.md, "The dedup window in generations"). A sealed generation only loses
entries, which never rebuilds a dict, and the one being filled stays small, so the
largest rebuild is of about 87,000 entries.

**A filter in front of the generations.** Asking each of 16 dicts about every key would
cost 16 cache misses a key. Each generation has a row of a Bloom filter
(``FILTER_BITS_PER_ENTRY`` bits per entry it may hold, ``FILTER_PROBES`` probes from the
key's own ``hash``, which CPython keeps in the str): one numpy gather over all rows says which generations may hold
a key, and only those dicts are asked (a false hit costs one dict lookup, about one key in
a thousand over 16 rows; never a wrong answer: the dict decides). A row is cleared when its
generation is emptied.

Invariants: every key in a generation belongs to a frame still in the order deque that
went into that generation; frames in the deque are in log order with non-decreasing
``store_ms``; ``len(self) <= entries_max`` after every ``add``. A key re-added later (after
its first frame expired or was truncated, or twice by a replay after an early eviction)
is deleted only by the frame that holds its current seq in that generation; a lookup finds
the newest copy.

Example::

    d = DedupWindow(window_ms=1000, entries_max=10)
    d.add([key_of("s", "a")], [7], store_ms=0, offset=0)
    d.lookup(keys_of(["s", "s"], ["a", "b"]))    # -> [7, None]
    d.expire(now_ms=1000)                 # stored 1000 ms ago, not less: "a" is gone
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

GENERATION_ENTRIES_MAX = 131_072  # entries per generation dict: bounds its largest rebuild (module docstring)
GENERATIONS_MIN = 8  # a smaller window is still split this many ways
FILTER_BITS_PER_ENTRY = 32  # filter bits per entry a generation may hold: ~0.07% false hits with 3 probes
FILTER_PROBES = 3
_PROBE_STEPS = np.arange(FILTER_PROBES, dtype=np.uint64)[:, None]
_LOW32 = np.uint64(0xFFFF_FFFF)
KEY_SEPARATOR = "\x00"  # never in a subject (``codec.SUBJECT_RE``), so the first one splits a key


def key_of(subject: str, msg_id: str) -> str:
    """The window's key of a message: one str, whose hash CPython computes once and keeps, so
    the filter and every dict it sends a key to cost no hashing (a (subject, id) tuple is
    hashed anew each time)."""
    return subject + KEY_SEPARATOR + msg_id


def keys_of(subjects: Iterable[str], ids: Iterable[str]) -> list[str]:
    """``key_of`` of every message, in one C-level pass."""
    return list(map(KEY_SEPARATOR.join, zip(subjects, ids)))


class DedupWindow:
    __slots__ = ("window_ms", "entries_max", "gen_entries_max", "gens", "numbers", "order", "_n",
                 "_by_number", "_next_number", "_filter", "_mask", "_free_rows", "_active", "_pos_keys", "_pos")

    def __init__(self, *, window_ms: int, entries_max: int) -> None:
        self.window_ms = window_ms
        self.entries_max = entries_max
        self.gen_entries_max = max(1, min(GENERATION_ENTRIES_MAX, entries_max // GENERATIONS_MIN))
        bits = 1 << max(6, (self.gen_entries_max * FILTER_BITS_PER_ENTRY - 1).bit_length())
        self._mask = np.uint64(bits - 1)
        rows = -(-entries_max // self.gen_entries_max) + 3  # grown (rarely) when frames outsize generations
        self._filter = np.zeros((rows, bits // 8), np.uint8)  # one row of bits per generation
        self._free_rows = list(range(rows - 1, 0, -1))
        self.numbers: deque[int] = deque([0])  # the generations' numbers, oldest first; new frames go to the last
        self._by_number: dict[int, tuple[dict, int]] = {0: ({}, 0)}  # number -> (its dict, its filter row)
        self._next_number = 1
        self.gens: list[dict] = []  # derived from numbers (_generations_changed): the dicts, oldest first
        self._active = np.zeros(0, np.intp)  # ... and their filter rows
        self._generations_changed()
        self._pos_keys, self._pos = None, None  # the last keys the filter hashed, and their positions
        # (store_ms, keys, seqs, log offset of the frame, its generation's number) per frame,
        # oldest first; keys and seqs as numpy arrays (object, uint64) and a number, not the
        # dict: nothing in a frame is a container the cyclic GC walks (``add``)
        self.order: deque[tuple[int, np.ndarray, np.ndarray, int, int]] = deque()
        self._n = 0  # entries over all generations

    def __len__(self) -> int:
        return self._n

    def room(self) -> int:
        return max(0, self.entries_max - self._n)

    # ------------------------------------------------------------------ the filter

    def _generations_changed(self) -> None:
        self.gens = [self._by_number[n][0] for n in self.numbers]
        self._active = np.array([self._by_number[n][1] for n in self.numbers], np.intp)

    def _positions(self, keys: Sequence) -> np.ndarray:
        """(FILTER_PROBES, len(keys)) bit positions of ``keys`` in a row (double hashing). An
        append asks ``isdisjoint`` then ``add`` with the same list: hashed once."""
        if keys is self._pos_keys and len(keys) == self._pos.shape[1]:  # the same list, not changed in size
            return self._pos
        h = np.fromiter(map(hash, keys), np.int64, len(keys)).view(np.uint64)
        pos = ((h & _LOW32) + _PROBE_STEPS * ((h >> np.uint64(32)) | np.uint64(1))) & self._mask
        self._pos_keys, self._pos = keys, pos
        return pos

    def _maybe(self, keys: Sequence) -> np.ndarray:
        """(generations, len(keys)) bools: which generations may hold each key (oldest first)."""
        pos = self._positions(keys)
        byte = (pos >> np.uint64(3)).astype(np.intp).ravel()
        bit = np.left_shift(np.uint8(1), (pos & np.uint64(7)).astype(np.uint8)).ravel()
        rows = self._active * self._filter.shape[1]  # one take from the flat filter: cheaper than a 2-d index
        got = np.take(self._filter.reshape(-1), rows[:, None] + byte[None, :]) & bit
        return got.reshape(len(rows), FILTER_PROBES, len(keys)).min(axis=1) != 0

    def _mark(self, row: int, keys: Sequence) -> None:
        pos = self._positions(keys).ravel()
        np.bitwise_or.at(self._filter[row], (pos >> np.uint64(3)).astype(np.intp),
                         np.left_shift(1, (pos & np.uint64(7)).astype(np.uint8), dtype=np.uint8))

    # ------------------------------------------------------------------ lookups

    def get(self, key, default=None):
        """The seq stored for ``key`` inside the window (its newest copy), or ``default``."""
        gens = self.gens
        for i in range(len(gens) - 1, -1, -1):
            seq = gens[i].get(key)
            if seq is not None:
                return seq
        return default

    def get_many(self, keys: Sequence, default=None) -> list:
        """``get`` of every key: the filter first, then only the dicts it names."""
        out = [default] * len(keys)
        if not self._n or not keys:
            return out
        gens = self.gens
        found = [False] * len(keys)
        maybe = self._maybe(keys)
        for g in range(len(gens) - 1, -1, -1):  # newest first: a re-added key's newest copy wins
            hits = np.flatnonzero(maybe[g])
            if not len(hits):
                continue
            d = gens[g]
            for k in hits.tolist():
                if not found[k]:
                    seq = d.get(keys[k])
                    if seq is not None:
                        out[k], found[k] = seq, True
        return out

    def isdisjoint(self, keys: Sequence) -> bool:
        """No key of ``keys`` is in the window (the common case of an append: one filter pass)."""
        if not self._n or not keys:
            return True
        maybe = self._maybe(keys)
        if not maybe.any():
            return True
        gens = self.gens
        for g, k in zip(*(a.tolist() for a in np.nonzero(maybe))):
            if keys[k] in gens[g]:
                return False
        return True

    def lookup(self, keys: Sequence) -> list[int | None]:
        """The seq stored for each key inside the window, or None."""
        return self.get_many(keys, None)

    # ------------------------------------------------------------------ frames in, frames out

    def add(self, keys: list, seqs: Sequence[int] | np.ndarray, *, store_ms: int, offset: int) -> int:
        """Remember one frame's keys (``seqs``: a list or an int array, copied); evicts the
        oldest frames beyond ``entries_max``. Returns how many entries were evicted early
        (before their window ended)."""
        if not len(keys):
            return 0
        seq_arr = np.array(seqs, dtype=np.uint64)  # a copy: the caller's array is its own (seqs are uint64)
        seqs = seq_arr.tolist()
        number = self.numbers[-1]
        gen, row = self._by_number[number]
        if gen and len(gen) + len(keys) > self.gen_entries_max:
            gen, number, row = {}, self._next_number, self._take_row()
            self._next_number += 1
            self.numbers.append(number)
            self._by_number[number] = (gen, row)
            self._generations_changed()
        before = len(gen)
        gen.update(zip(keys, seqs))
        self._mark(row, keys)
        self._n += len(gen) - before
        # numpy arrays, never tracked by the cyclic GC, so no collection walks a key of the
        # window. Lists were walked by every full collection (68 ms at 20,000 msgs/s); tuples
        # only by the first collection that meets them, but in a node whose allocations
        # balance its frees, that one comes minutes later and walked two minutes of frames
        # at once: ~3M references, 90-200 ms (docs/benchmarks.md, "The real-time stall near
        # 115 s is a garbage collection")
        self.order.append((store_ms, np.fromiter(keys, object, len(keys)), seq_arr, offset, number))
        evicted = 0
        while self._n > self.entries_max and len(self.order) > 1:
            evicted += self._pop_left()
        return evicted

    def expire(self, now_ms: int) -> None:
        cutoff = now_ms - self.window_ms
        order = self.order
        while order and order[0][0] <= cutoff:
            self._pop_left()

    def oldest_offset(self) -> int | None:
        """Log offset of the oldest frame still in the window (replay restarts there)."""
        return self.order[0][3] if self.order else None

    def oldest_store_ms(self) -> int | None:
        """When the oldest frame still in the window was stored."""
        return self.order[0][0] if self.order else None

    def truncate(self, offset: int) -> None:
        """Forget frames at or after ``offset`` (a divergent log suffix was cut)."""
        while self.order and self.order[-1][3] >= offset:
            _, keys, seqs, _, number = self.order.pop()
            self._forget(number, keys, seqs)

    def _take_row(self) -> int:
        if not self._free_rows:  # frames bigger than a generation: more generations than planned
            grow = len(self._filter)
            self._filter = np.concatenate([self._filter, np.zeros_like(self._filter)])
            self._free_rows = list(range(2 * grow - 1, grow - 1, -1))
        return self._free_rows.pop()

    def _pop_left(self) -> int:
        _, keys, seqs, _, number = self.order.popleft()
        return self._forget(number, keys, seqs)

    def _forget(self, number: int, keys: np.ndarray, seqs: np.ndarray) -> int:
        got = self._by_number.get(number)
        if got is None:  # emptied and dropped already (by the frames that held its other keys)
            return 0
        gen, row = got
        keys = keys.tolist()  # the frame's arrays as lists: faster to walk than the arrays
        current = map(gen.get, keys)
        gone = [k for k, c, s in zip(keys, current, seqs.tolist()) if c == s]
        deque(map(gen.pop, gone), maxlen=0)  # delete them at C speed
        self._n -= len(gone)
        if not gen:
            self._filter[row] = 0  # nothing in it: its bits would only be false hits
            if len(self.numbers) > 1:  # an emptied generation goes (usually the oldest); one stays
                self.numbers.remove(number)
                del self._by_number[number]
                self._free_rows.append(row)
                self._generations_changed()
        return len(gone)
