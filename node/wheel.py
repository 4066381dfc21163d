"""The fine level of the timing wheel: an in-memory hashed wheel, pure.

What it owns
------------
The entries due within a short look-ahead window (``window_ms``, default 2 s),
and the answer to "what is due by ``now_ms``?". It owns no clock, no file and no
thread: time comes in as ``now_ms``, entries come in through ``add`` (new
messages whose second is already loaded) and ``load_second`` (whole seconds read
from the per-second schedule index by the shell), and what is due goes out of
``advance``. ``ref`` in a ``WheelEntry`` is the shell's location on disk; the
wheel never looks at it. ``TickState`` is the small record the shell persists
and ships to slaves so a new master can restore the cursor.

Time model
----------
Tick ``n`` covers ``[n * tick_ms, (n + 1) * tick_ms)``. Two positions move
forward only:

* ``cursor_ms``: every held entry due before it has been returned by
  ``advance``. It need not sit on a tick boundary (``advance(now_ms)`` moves it
  to ``now_ms + 1``).
* ``loaded_until_ms``: a whole second; every second before it has been loaded.
  ``advance`` never moves ``cursor_ms`` past it, so nothing on disk can be
  skipped: a cursor far behind the wall clock (restart, failover) catches up
  one loaded window at a time.

Invariants (asserted where cheap)
---------------------------------
* Every live entry is either *overdue* (``deliver_at_ms < cursor_ms``, in the
  overdue list, returned by the very next ``advance``) or *scheduled*
  (``cursor_ms <= deliver_at_ms < loaded_until_ms``, in slot
  ``tick % n_slots``).
* ``load_second`` only loads seconds inside the look-ahead window
  (``second * 1000 < cursor_ms + window_ms``), so
  ``loaded_until_ms < cursor_ms + window_ms + 1000`` and scheduled entries span
  fewer than ``n_slots`` ticks: one slot never mixes two laps, and emptying a
  slot whose tick has passed returns exactly that tick.
* Each slot is a heap of ``(deliver_at_ms, seq)``; the entry itself lives in
  ``seq -> entry`` (plus ``msg_id -> seq``). An item is live iff its seq is
  still held with the same ``deliver_at_ms``. ``cancel`` only deletes from the
  dicts (O(1)); the dead item is dropped when its tick passes, and a compaction
  keeps dead items no more numerous than live ones.
* ``advance`` deletes an entry from the dicts as it returns it, so nothing is
  returned twice and nothing cancelled is returned.

Cost: ``add`` is O(log k) (k = entries in one tick), ``cancel`` O(1),
``advance`` O(ticks crossed + entries returned * log k) with ticks crossed at
most ``n_slots``, never O(held entries).

Worked example (tick_ms=10, window_ms=2000)
-------------------------------------------
>>> w = TimingWheel(start_ms=1_234)          # cursor 1230, loaded_until 1000
>>> w.seconds_to_load()                      # seconds s with s*1000 < 1230 + 2000
[1, 2, 3]
>>> w.load_second(1, [WheelEntry(1_100, 7, "late"), WheelEntry(1_500, 8, "a")])
2
>>> w.add(WheelEntry(2_010, 9, "b"))         # second 2 not loaded: stays on disk
False
>>> w.load_second(2, [WheelEntry(2_010, 9, "b")])
1
>>> [e.msg_id for e in w.advance(1_499)]     # "late" was overdue: fires at once
['late']
>>> [e.msg_id for e in w.advance(5_000)]     # capped at loaded_until_ms = 3000
['a', 'b']
>>> w.cursor_ms, w.loaded_until_ms
(3000, 3000)
>>> w.state(completed_ms=3_000, dispatch_offset=42).tick
299
"""

from __future__ import annotations

import heapq
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from cluster.errors import CorruptRecord, Overloaded

__all__ = ["TickState", "TimingWheel", "WheelEntry"]

# Below this many dead items a compaction is not worth its O(n_slots) scan.
_DEAD_ITEMS_MIN = 4096


@dataclass(frozen=True, slots=True)
class WheelEntry:
    deliver_at_ms: int
    seq: int  # unique 64-bit sequence of the message
    msg_id: str
    ref: object = None  # opaque location on disk; the wheel never reads it


# magic, version, epoch, tick, index_in_second, dispatch_offset; then crc32.
_TICK_STATE_BODY = struct.Struct("<4sBqqIQ")
_TICK_STATE_CRC = struct.Struct("<I")
_TICK_STATE_MAGIC = b"HGTS"
_TICK_STATE_VERSION = 1
TICK_STATE_SIZE = _TICK_STATE_BODY.size + _TICK_STATE_CRC.size  # 37 bytes


@dataclass(frozen=True, slots=True)
class TickState:
    """Where dispatching stood; persisted locally and shipped to slaves.

    Layout (little-endian, 37 bytes): ``b"HGTS"``, u8 version = 1, i64 epoch,
    i64 tick, u32 index_in_second, u64 dispatch_offset, u32 zlib.crc32 of all
    the bytes before it.
    """

    epoch: int
    tick: int  # last fully dispatched tick; -1 = none
    index_in_second: int  # entries dispatched within the second containing `tick` (informational)
    dispatch_offset: int  # dispatch-log end offset when the state was taken

    def encode(self) -> bytes:
        if self.tick < -1:
            raise ValueError(f"tick {self.tick} < -1")
        try:
            body = _TICK_STATE_BODY.pack(
                _TICK_STATE_MAGIC,
                _TICK_STATE_VERSION,
                self.epoch,
                self.tick,
                self.index_in_second,
                self.dispatch_offset,
            )
        except struct.error as exc:
            raise ValueError(f"tick state field out of range: {exc}") from None
        return body + _TICK_STATE_CRC.pack(zlib.crc32(body))

    @classmethod
    def decode(cls, data: bytes) -> TickState:
        def corrupt(reason: str) -> CorruptRecord:
            return CorruptRecord(path="<tick-state>", offset=0, reason=reason)

        data = bytes(data)
        if len(data) != TICK_STATE_SIZE:
            raise corrupt(f"length {len(data)}, expected {TICK_STATE_SIZE}")
        body = data[: _TICK_STATE_BODY.size]
        (crc,) = _TICK_STATE_CRC.unpack_from(data, _TICK_STATE_BODY.size)
        if zlib.crc32(body) != crc:
            raise corrupt(f"crc mismatch: stored {crc:#010x}, computed {zlib.crc32(body):#010x}")
        magic, version, epoch, tick, index_in_second, dispatch_offset = _TICK_STATE_BODY.unpack(body)
        if magic != _TICK_STATE_MAGIC:
            raise corrupt(f"bad magic {magic!r}")
        if version != _TICK_STATE_VERSION:
            raise corrupt(f"unknown version {version}")
        if tick < -1:
            raise corrupt(f"tick {tick} < -1")
        return cls(epoch, tick, index_in_second, dispatch_offset)


class TimingWheel:
    """Hashed timing wheel over ``[cursor_ms, loaded_until_ms)``; see the module docstring."""

    def __init__(
        self,
        *,
        tick_ms: int = 10,
        window_ms: int = 2000,
        start_ms: int,
        entries_max: int = 2_000_000,
    ) -> None:
        if tick_ms <= 0 or 1000 % tick_ms != 0:
            raise ValueError(f"tick_ms must divide 1000, got {tick_ms}")
        if window_ms < 0:
            raise ValueError(f"window_ms must be >= 0, got {window_ms}")
        if entries_max <= 0:
            raise ValueError(f"entries_max must be > 0, got {entries_max}")
        if start_ms < 0:
            raise ValueError(f"start_ms must be >= 0, got {start_ms}")
        self.tick_ms = tick_ms
        self.window_ms = window_ms
        self.entries_max = entries_max
        self.epoch = 0
        self.cursor_ms = start_ms - start_ms % tick_ms
        self.loaded_until_ms = start_ms - start_ms % 1000
        # Scheduled entries satisfy loaded_until_ms < cursor_ms + window_ms + 1000
        # (see load_second), so they span at most (window_ms + 1000) / tick_ms + 1
        # ticks; one spare slot on top.
        self.n_slots = -(-(window_ms + 1000) // tick_ms) + 2
        self._slots: list[list[tuple[int, int]]] = [[] for _ in range(self.n_slots)]
        self._overdue: list[tuple[int, int]] = []
        self._by_seq: dict[int, WheelEntry] = {}
        self._seq_by_id: dict[str, int] = {}
        self._dead_items = 0  # cancelled items still sitting in a slot or the overdue list
        self._fired_per_tick: dict[int, int] = {}  # for TickState.index_in_second

    @classmethod
    def restore(
        cls,
        state: TickState,
        *,
        tick_ms: int = 10,
        window_ms: int = 2000,
        entries_max: int = 2_000_000,
    ) -> TimingWheel:
        """An empty wheel whose cursor is just after ``state.tick``; load seconds again from disk."""
        wheel = cls(
            tick_ms=tick_ms,
            window_ms=window_ms,
            start_ms=(state.tick + 1) * tick_ms,
            entries_max=entries_max,
        )
        wheel.epoch = state.epoch
        return wheel

    # --- loading -------------------------------------------------------------------

    def seconds_to_load(self, limit: int = 64) -> list[int]:
        """The next seconds the shell should read from disk and pass to ``load_second``, in order."""
        first = self.loaded_until_ms // 1000
        horizon_ms = self.cursor_ms + self.window_ms
        out: list[int] = []
        s = first
        while s * 1000 < horizon_ms and len(out) < limit:
            out.append(s)
            s += 1
        return out

    def load_second(self, second: int, entries: Iterable[WheelEntry]) -> int:
        """Load every entry of ``second`` (epoch seconds) read from disk; returns how many were added.

        Seconds must come in order and inside the look-ahead window. Seqs already
        held are skipped. On any error nothing changes.
        """
        if second != self.loaded_until_ms // 1000:
            raise ValueError(f"load_second({second}): next second to load is {self.loaded_until_ms // 1000}")
        if second * 1000 >= self.cursor_ms + self.window_ms:
            raise ValueError(
                f"load_second({second}): beyond the look-ahead window "
                f"(cursor_ms={self.cursor_ms}, window_ms={self.window_ms})"
            )
        lo, hi = second * 1000, second * 1000 + 1000
        fresh: dict[int, WheelEntry] = {}
        new_ids: dict[str, int] = {}
        for e in entries:
            if not lo <= e.deliver_at_ms < hi:
                raise ValueError(f"entry seq={e.seq} deliver_at_ms={e.deliver_at_ms} is not in second {second}")
            if e.seq in self._by_seq or e.seq in fresh:
                continue
            held = self._seq_by_id.get(e.msg_id, new_ids.get(e.msg_id))
            if held is not None:
                raise ValueError(f"msg_id {e.msg_id!r} already held with seq={held}, got seq={e.seq}")
            new_ids[e.msg_id] = e.seq
            fresh[e.seq] = e
        if len(self._by_seq) + len(fresh) > self.entries_max:
            raise Overloaded(
                f"timing wheel full: {len(self._by_seq)} held + {len(fresh)} in second {second} "
                f"> entries_max={self.entries_max}"
            )
        self.loaded_until_ms = hi
        for e in fresh.values():
            self._insert(e)
        return len(fresh)

    # --- adding and cancelling -------------------------------------------------------

    def add(self, entry: WheelEntry) -> bool:
        """Hold ``entry`` if its second is loaded (True); False means "keep it on disk, load_second brings it"."""
        if entry.deliver_at_ms >= self.loaded_until_ms:
            return False
        if entry.seq in self._by_seq:
            return True
        held = self._seq_by_id.get(entry.msg_id)
        if held is not None:
            raise ValueError(f"msg_id {entry.msg_id!r} already held with seq={held}, got seq={entry.seq}")
        if len(self._by_seq) >= self.entries_max:
            raise Overloaded(f"timing wheel full: entries_max={self.entries_max}")
        self._insert(entry)
        return True

    def _insert(self, e: WheelEntry) -> None:
        self._by_seq[e.seq] = e
        self._seq_by_id[e.msg_id] = e.seq
        item = (e.deliver_at_ms, e.seq)
        if e.deliver_at_ms < self.cursor_ms:
            self._overdue.append(item)
            return
        tick = e.deliver_at_ms // self.tick_ms
        assert tick - self.cursor_ms // self.tick_ms < self.n_slots, (e, self.cursor_ms, self.loaded_until_ms)
        heapq.heappush(self._slots[tick % self.n_slots], item)

    def cancel(self, msg_id: str) -> bool:
        """Remove the held entry with this id; False if the wheel does not hold it (fired, or still on disk)."""
        seq = self._seq_by_id.get(msg_id)
        if seq is None:
            return False
        return self.cancel_seq(seq)

    def cancel_seq(self, seq: int) -> bool:
        e = self._by_seq.pop(seq, None)
        if e is None:
            return False
        del self._seq_by_id[e.msg_id]
        self._dead_items += 1
        if self._dead_items > max(_DEAD_ITEMS_MIN, len(self._by_seq)):
            self._compact()
        return True

    def _compact(self) -> None:
        """Drop dead items everywhere: O(n_slots + items), run after as many cancels as live entries."""
        by_seq = self._by_seq
        kept = 0

        def live(items: list[tuple[int, int]]) -> list[tuple[int, int]]:
            nonlocal kept
            out = []
            seen: set[int] = set()  # a cancelled then re-added seq may sit twice with the same key
            for d, s in items:
                e = by_seq.get(s)
                if e is not None and e.deliver_at_ms == d and s not in seen:
                    seen.add(s)
                    out.append((d, s))
            kept += len(out)
            return out

        self._overdue = live(self._overdue)
        for i, heap in enumerate(self._slots):
            if heap:
                heap = live(heap)
                heapq.heapify(heap)
                self._slots[i] = heap
        assert kept == len(by_seq), (kept, len(by_seq))
        self._dead_items = 0

    # --- firing ------------------------------------------------------------------------

    def advance(self, now_ms: int) -> list[WheelEntry]:
        """Return every held entry due by ``now_ms`` (and every overdue one), sorted by (deliver_at_ms, seq).

        The horizon is ``h = max(cursor_ms, min(now_ms + 1, loaded_until_ms))``:
        entries due before ``h`` are returned and removed, and ``cursor_ms``
        becomes ``h``. So the cursor never passes ``loaded_until_ms`` and never
        moves back; a ``now_ms`` that went backwards returns only entries that
        were already overdue (none, unless ``add``/``load_second`` put some
        there since the last call).
        """
        end_ms = min(now_ms + 1, self.loaded_until_ms)
        if end_ms <= self.cursor_ms and not self._overdue:
            return []
        by_seq, seq_by_id, fired = self._by_seq, self._seq_by_id, self._fired_per_tick
        tick_ms = self.tick_ms
        out: list[WheelEntry] = []

        if self._overdue:
            self._overdue.sort()
            for d, s in self._overdue:
                e = by_seq.get(s)
                if e is None or e.deliver_at_ms != d:
                    self._dead_items -= 1
                    continue
                del by_seq[s]
                del seq_by_id[e.msg_id]
                out.append(e)
                t = d // tick_ms
                fired[t] = fired.get(t, 0) + 1
            self._overdue = []

        if end_ms > self.cursor_ms:
            first_tick = self.cursor_ms // tick_ms
            last_tick = (end_ms - 1) // tick_ms
            assert last_tick - first_tick < self.n_slots, (self.cursor_ms, end_ms)
            slots, n_slots = self._slots, self.n_slots
            heappop = heapq.heappop
            dead = 0
            for t in range(first_tick, last_tick + 1):
                heap = slots[t % n_slots]
                if not heap:
                    continue
                n_before = len(out)
                # Every item in this slot belongs to tick t (one lap only), so a
                # tick wholly behind end_ms is emptied; the last one may be partial.
                while heap and heap[0][0] < end_ms:
                    d, s = heappop(heap)
                    e = by_seq.get(s)
                    if e is None or e.deliver_at_ms != d:
                        dead += 1
                        continue
                    del by_seq[s]
                    del seq_by_id[e.msg_id]
                    out.append(e)
                if len(out) > n_before:
                    fired[t] = fired.get(t, 0) + len(out) - n_before
            self._dead_items -= dead
            self.cursor_ms = end_ms

        assert self._dead_items >= 0, self._dead_items
        if len(fired) > 4 * self.n_slots:
            self._prune_fired()
        return out

    def _prune_fired(self) -> None:
        # index_in_second is informational: keep counts for about two windows
        # behind the cursor, enough for a shell whose dispatching lags that much.
        oldest = self.cursor_ms // self.tick_ms - 2 * self.n_slots
        self._fired_per_tick = {t: n for t, n in self._fired_per_tick.items() if t >= oldest}

    # --- state -------------------------------------------------------------------------

    def state(self, *, completed_ms: int, dispatch_offset: int) -> TickState:
        """Tick state for the shell to persist.

        ``completed_ms`` is the time before which every entry ``advance``
        returned has been dispatched; ``tick = completed_ms // tick_ms - 1``,
        except that ``completed_ms`` is first lowered to the earliest held
        overdue entry (added or loaded behind the cursor, not returned yet), so
        the state never claims a tick whose entry is still undelivered.
        """
        if not 0 <= completed_ms <= self.cursor_ms:
            raise ValueError(f"completed_ms={completed_ms} outside [0, cursor_ms={self.cursor_ms}]")
        # An overdue entry added since the last advance has not fired, so its tick
        # is not done: never claim it, or a restore would not load its second again.
        for d, s in self._overdue:
            e = self._by_seq.get(s)
            if e is not None and e.deliver_at_ms == d and d < completed_ms:
                completed_ms = d
        tick = completed_ms // self.tick_ms - 1
        index = 0
        if tick >= 0:
            second_first_tick = (tick * self.tick_ms) // 1000 * 1000 // self.tick_ms
            index = sum(n for t, n in self._fired_per_tick.items() if second_first_tick <= t <= tick)
        return TickState(self.epoch, tick, index, dispatch_offset)

    def __len__(self) -> int:
        return len(self._by_seq)

    def __contains__(self, msg_id: object) -> bool:
        return msg_id in self._seq_by_id

    def __repr__(self) -> str:
        return (
            f"TimingWheel(cursor_ms={self.cursor_ms}, loaded_until_ms={self.loaded_until_ms}, "
            f"held={len(self._by_seq)}, epoch={self.epoch})"
        )
