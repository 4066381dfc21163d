"""The de-duplication window of a real-time node (pure: time comes in as ``store_ms``/``now_ms``).

A message whose (subject, id) was stored less than ``window_ms`` ago is a duplicate: it
is answered with the first copy's seq and not stored again. RAM per stored message is
one dict entry ``key_of(subject, id) -> seq`` (the window itself takes any hashable key); the expiry order is kept **per frame** (one
deque entry per appended batch: its store_ms, keys, seqs, log offset and generation), so
nothing per message is created besides the dict entry, and every dict operation runs over
a whole batch at once (``map(dict.get, keys)``, ``dict.update(zip(keys, seqs))``).

**Generations, not one dict.** The entries live in a few dicts of at most
``entries_max // GENERATIONS`` entries each (one more for a frame bigger than that): new
frames go into the newest; expiry deletes from the one a frame went into; a dict emptied
is dropped. One dict of two million entries that is both filled and emptied paused the
node for 130-450 ms whenever CPython rebuilt it (a growth past two thirds of its table,
or a table full of deleted slots: every 40 s at 20,000 msgs/s; docs/benchmarks.md, "The
dedup window in generations"). A sealed generation only loses entries, which never
rebuilds a dict, and the one being filled stays small, so the largest rebuild is of
``entries_max // GENERATIONS`` entries. A lookup asks the generations newest first.

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

GENERATIONS = 2  # entries_max is split over this many dicts (module docstring)
KEY_SEPARATOR = "\x00"  # never in a subject (``codec.SUBJECT_RE``), so the first one splits a key


def key_of(subject: str, msg_id: str) -> str:
    """The window's key of a message: one str, whose hash CPython computes once and keeps, so
    a lookup in every generation costs no hashing (a (subject, id) tuple is hashed anew each
    time)."""
    return subject + KEY_SEPARATOR + msg_id


def keys_of(subjects: Iterable[str], ids: Iterable[str]) -> list[str]:
    """``key_of`` of every message, in one C-level pass."""
    return list(map(KEY_SEPARATOR.join, zip(subjects, ids)))


class DedupWindow:
    __slots__ = ("window_ms", "entries_max", "gen_entries_max", "gens", "numbers", "order", "_n", "_by_number",
                 "_next_number")

    def __init__(self, *, window_ms: int, entries_max: int) -> None:
        self.window_ms = window_ms
        self.entries_max = entries_max
        self.gen_entries_max = max(1, entries_max // GENERATIONS)
        self.gens: deque[dict] = deque([{}])  # oldest first; new frames go to gens[-1]
        self.numbers: deque[int] = deque([0])  # gens[i]'s number
        self._by_number: dict[int, dict] = {0: self.gens[0]}  # generation number -> its dict
        self._next_number = 1
        # (store_ms, keys, seqs, log offset of the frame, its generation's number) per frame,
        # oldest first; a number, not the dict: a frame's tuple stays untracked by the cyclic GC
        self.order: deque[tuple[int, tuple, tuple, int, int]] = deque()
        self._n = 0  # entries over all generations

    def __len__(self) -> int:
        return self._n

    def room(self) -> int:
        return max(0, self.entries_max - self._n)

    def get(self, key, default=None):
        """The seq stored for ``key`` inside the window (its newest copy), or ``default``."""
        gens = self.gens
        for i in range(len(gens) - 1, -1, -1):
            seq = gens[i].get(key)
            if seq is not None:
                return seq
        return default

    def isdisjoint(self, keys: Iterable) -> bool:
        """No key of ``keys`` is in the window (the common case of an append: one pass per generation)."""
        if len(self.gens) == 1:
            return self.gens[0].keys().isdisjoint(keys)
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        return all(g.keys().isdisjoint(keys) for g in self.gens)

    def lookup(self, keys: Sequence) -> list[int | None]:
        """The seq stored for each key inside the window, or None."""
        if len(self.gens) == 1:
            return list(map(self.gens[0].get, keys))
        return list(map(self.get, keys))

    def add(self, keys: list, seqs: list[int], *, store_ms: int, offset: int) -> int:
        """Remember one frame's keys; evicts the oldest frames beyond ``entries_max``.
        Returns how many entries were evicted early (before their window ended)."""
        if not keys:
            return 0
        gen = self.gens[-1]
        number = self.numbers[-1]
        if gen and len(gen) + len(keys) > self.gen_entries_max:
            gen, number = {}, self._next_number
            self._next_number += 1
            self.gens.append(gen)
            self.numbers.append(number)
            self._by_number[number] = gen
        before = len(gen)
        gen.update(zip(keys, seqs))
        self._n += len(gen) - before
        # tuples, not the caller's lists: a tuple of strs and ints is untracked by the cyclic GC
        # after its first collection, so a full collection does not walk every key of the
        # window (lists would be walked each time: 68 ms at 20,000 msgs/s, docs/benchmarks.md)
        self.order.append((store_ms, tuple(keys), tuple(seqs), offset, number))
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

    def _pop_left(self) -> int:
        _, keys, seqs, _, number = self.order.popleft()
        return self._forget(number, keys, seqs)

    def _forget(self, number: int, keys: Sequence, seqs: Sequence) -> int:
        gen = self._by_number.get(number)
        if gen is None:  # emptied and dropped already (by the frames that held its other keys)
            return 0
        current = map(gen.get, keys)
        gone = [k for k, c, s in zip(keys, current, seqs) if c == s]
        deque(map(gen.pop, gone), maxlen=0)  # delete them at C speed
        self._n -= len(gone)
        if not gen and len(self.gens) > 1:  # an emptied generation goes (usually the oldest); one stays
            i = self.numbers.index(number)
            del self.gens[i], self.numbers[i]
            del self._by_number[number]
        return len(gone)
