"""The fine level of the timing wheel: a pure wheel over numpy arrays.

What it owns
------------
The entries due within a short look-ahead window (``window_ms``: 2 s when the wheel is
built alone, as in the worked example below; a delay node's store passes
``StoreSettings.window_ms``, 500 ms),
and the answer to "what is due by ``now_ms``?". It owns no clock, no file and no
thread: time comes in as ``now_ms``, entries come in as ``Chunk`` s of numpy
arrays through ``add`` (new frames whose second is already loaded) and
``load_second`` (whole seconds read from the per-second schedule index by the
shell), and what is due goes out of ``advance`` as ``Fired`` chunks. No Python
object exists per entry: the batch is the unit. ``ref`` (the store's frame) is
opaque; the wheel never looks at it. ``TickState`` is the small record the
shell persists and ships to slaves so a new master can restore the cursor.

Time model
----------
Tick ``n`` covers ``[n * tick_ms, (n + 1) * tick_ms)``. Two positions move
forward only:

* ``cursor_ms``: every held entry due before it has been returned by
  ``advance``, except *overdue* ones put behind it since (they are returned by
  the very next ``advance``). It need not sit on a tick boundary
  (``advance(now_ms)`` moves it to ``now_ms + 1``).
* ``loaded_until_ms``: a whole second; every second before it has been loaded.
  ``advance`` never moves ``cursor_ms`` past it, so nothing on disk can be
  skipped: a cursor far behind the wall clock (restart, failover) catches up
  one loaded window at a time.

Layout
------
Held entries live in *runs*: a run is one sorted-by-due copy of the arrays of
all the chunks of one ``load_second``, or of the chunks given to ``add`` since
the last ``advance`` (``add`` only stages them; ``advance``, ``cancel`` and
``next_due_ms`` merge what is staged, and so does ``add`` past
``INDEX_PENDING_MAX`` staged entries). A ``refno`` column says which chunk each
entry came from. Merging matters when firing: a step visits each run whose
head is due, so a second of a thousand small frames is one run to visit, not a
thousand. A run has a read position ``pos``: entries before it were returned. A
heap of ``(due_ms at pos, run id)`` orders the runs. ``advance`` pops the runs
whose head is due, takes ``[pos : searchsorted(due, horizon))`` of each with
numpy and groups it by ``ref`` (one stable argsort for a merged second).
``cancel`` finds entries through a seq index (a few sorted runs of ``seq ->
(run id, position)``, built lazily) and marks them in the run's ``dead`` mask,
which ``advance`` applies to what it slices. The run and the seq index are
``node/wheel_runs.py``'s; the ``TickState`` codec is ``node/tickstate.py``'s.

Invariants (asserted where cheap)
---------------------------------
* Every held entry is due before ``loaded_until_ms``: ``add`` holds exactly the
  entries of a chunk with ``due_ms < loaded_until_ms`` and ``load_second(s)``
  only entries of second ``s``. So nothing due past an unloaded second fires.
* ``load_second`` only loads seconds inside the look-ahead window
  (``second * 1000 < cursor_ms + window_ms``), so held entries span at most
  ``window_ms + 1000`` ms ahead of the cursor.
* A held entry is *live* iff it sits at or after its run's ``pos`` and is not
  marked dead; ``len(self)`` counts live entries, exactly. ``advance`` moves
  ``pos`` past what it returns, so nothing is returned twice and nothing
  cancelled is returned.
* A seq is held (live) at most once: the caller's guarantee (seqs are unique,
  and an entry is given back with ``add`` only after it was returned).
* The seq index may hold stale mappings (fired, cancelled); every hit is
  checked against the run, and the index is rebuilt from the live entries once
  stale mappings outnumber live ones.

Cost: ``add`` O(chunk) numpy; ``load_second`` and merging staged chunks O(n)
numpy (a radix sort: a second's dues span less than ``_RADIX_SPAN_MS``) plus
O(chunks) Python; ``advance`` O(runs touched + refs returned) Python plus
O(entries returned) numpy, never O(held entries); ``cancel`` O(len(seqs)) plus
merging and indexing at most ``INDEX_PENDING_MAX`` entries each (indexing is
amortized O(log held) numpy per entry). The floor of ``advance`` is one
``Fired`` per ref touched: firing in 10 ms steps entries of frames spread over
a second returns about one ``Fired`` per entry, so it pays to step coarser when
many are due.

Worked example (tick_ms=10, window_ms=2000)
-------------------------------------------
>>> def C(due, seq, ref):                    # a chunk of frame `ref`, idx 0..n-1
...     return Chunk(np.array(due), np.array(seq, np.uint64), np.arange(len(due), dtype=np.int32), ref)
>>> w = TimingWheel(tick_ms=10, window_ms=2000, start_ms=1_234)  # cursor 1230, loaded_until 1000
>>> w.seconds_to_load()                      # seconds s with s*1000 < 1230 + 2000
[1, 2, 3]
>>> w.load_second(1, [C([1_500, 1_100], [8, 7], "f1")])  # 1_100 is overdue
2
>>> w.add(C([2_010], [9], "f2"))             # second 2 not loaded: stays on disk
0
>>> w.load_second(2, [C([2_010], [9], "f2")])
1
>>> w.next_due_ms()
1100
>>> [(f.ref, f.idx.tolist()) for f in w.advance(1_234)]  # the overdue one fires at once
[('f1', [1])]
>>> w.cancel([8])                            # f1[0], due 1_500, never fires
1
>>> [(f.ref, f.seq.tolist()) for f in w.advance(5_000)]  # capped at loaded_until_ms = 3000
[('f2', [9])]
>>> w.cursor_ms, w.loaded_until_ms, len(w)
(3000, 3000, 0)
>>> w.state(completed_ms=3_000, dispatch_offset=42).tick
299
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from cluster.errors import Overloaded
from node.store.settings import STORE_DEFAULTS
from node.tickstate import TICK_STATE_SIZE, TickState
from node.wheel_runs import Run, SeqIndex

__all__ = ["INDEX_PENDING_MAX", "TICK_STATE_SIZE", "Chunk", "Fired", "TickState", "TimingWheel"]

# Entries added since the seq index was last brought up to date; past this many
# they are indexed at once, so a cancel never indexes more than this (latency bound).
INDEX_PENDING_MAX = 65_536
# Below this many stale mappings a rebuild of the seq index is not worth it.
_INDEX_STALE_MIN = 65_536
# Runs whose dues span less than this sort with a 16-bit radix sort (a loaded second always does).
_RADIX_SPAN_MS = 1 << 16
# Ticks of per-tick fired counts kept behind the cursor (for TickState.index_in_second),
# in windows: enough for a shell whose dispatching lags about that much.
_FIRED_COUNTS_WINDOWS = 2


@dataclass(slots=True)
class Chunk:
    """Entries that share one opaque ``ref`` (the store's frame, on disk or in memory)."""

    due_ms: np.ndarray  # int64, effective due time of each entry; any order (the wheel sorts)
    seq: np.ndarray  # uint64, unique message sequence
    idx: np.ndarray  # int32, position of each entry inside the ref'd frame
    ref: object  # opaque to the wheel

    def __len__(self) -> int:
        return len(self.due_ms)


@dataclass(slots=True)
class Fired:
    """What ``advance`` returns: the due entries of one chunk, in due order (ties in input order).

    The arrays may be read-only views of the wheel's own copy: do not write to them.
    """

    ref: object
    idx: np.ndarray  # int32
    seq: np.ndarray  # uint64
    due_ms: np.ndarray  # int64, non-decreasing

    def __len__(self) -> int:
        return len(self.due_ms)


def _columns(chunk: Chunk) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The chunk's arrays with the wheel's dtypes; ValueError if they do not line up."""
    due = np.asarray(chunk.due_ms, np.int64)
    seq = np.asarray(chunk.seq, np.uint64)
    idx = np.asarray(chunk.idx, np.int32)
    if due.ndim != 1 or due.shape != seq.shape or due.shape != idx.shape:
        raise ValueError(
            f"chunk arrays must be 1-D of one length: due_ms {due.shape}, seq {seq.shape}, idx {idx.shape}"
        )
    return due, seq, idx


class TimingWheel:
    """Timing wheel over ``[cursor_ms, loaded_until_ms)`` holding numpy runs; see the module docstring."""

    def __init__(
        self,
        *,
        tick_ms: int = STORE_DEFAULTS.tick_ms,
        window_ms: int = STORE_DEFAULTS.window_ms,
        start_ms: int,
        entries_max: int = STORE_DEFAULTS.wheel_entries_max,
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
        self._runs: dict[int, Run] = {}  # run id -> run, until its last entry is returned
        self._heap: list[tuple[int, int]] = []  # (due_ms at run.pos, run id)
        self._next_rid = 0
        self._live = 0  # held entries neither returned nor cancelled
        self._index = SeqIndex()
        self._unindexed: list[Run] = []  # runs added since the index was last brought up to date
        self._unindexed_entries = 0
        self._staged: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # added, not in a run yet
        self._staged_refs: list[object] = []
        self._staged_entries = 0
        # Held entries span at most window_ms + 1000 ms ahead of the cursor.
        self._window_ticks = -(-(window_ms + 1000) // tick_ms) + 1
        self._fired_per_tick: dict[int, int] = {}  # for TickState.index_in_second

    @classmethod
    def restore(
        cls,
        state: TickState,
        *,
        tick_ms: int = STORE_DEFAULTS.tick_ms,
        window_ms: int = STORE_DEFAULTS.window_ms,
        entries_max: int = STORE_DEFAULTS.wheel_entries_max,
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

    def seconds_to_load(self, limit: int | None = None) -> list[int]:
        """The next seconds the shell should read from disk and pass to ``load_second``, in order.

        Seconds ``s`` not loaded yet with ``s * 1000 < cursor_ms + window_ms``
        (at most ``window_ms / 1000 + 1`` of them), at most ``limit``; none
        while the wheel holds ``entries_max`` entries or more.
        """
        if self._live >= self.entries_max:
            return []
        first = self.loaded_until_ms // 1000
        end = -(-(self.cursor_ms + self.window_ms) // 1000)  # first s with s * 1000 >= horizon
        if limit is not None:
            end = min(end, first + max(limit, 0))
        return list(range(first, end))

    def load_second(self, second: int, chunks: Iterable[Chunk]) -> int:
        """Load every entry of ``second`` (epoch seconds) read from disk; returns how many were added.

        Seconds must come in order (``second == loaded_until_ms // 1000``) and
        inside the look-ahead window; every ``due_ms`` must lie in the second.
        Entries due before ``cursor_ms`` are overdue: the next ``advance``
        returns them. The chunks are merged into one run. On any error
        (``ValueError``, ``Overloaded`` past ``entries_max``) nothing changes.
        """
        if second != self.loaded_until_ms // 1000:
            raise ValueError(f"load_second({second}): next second to load is {self.loaded_until_ms // 1000}")
        if second * 1000 >= self.cursor_ms + self.window_ms:
            raise ValueError(
                f"load_second({second}): beyond the look-ahead window "
                f"(cursor_ms={self.cursor_ms}, window_ms={self.window_ms})"
            )
        lo, hi = second * 1000, second * 1000 + 1000
        cols: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        refs: list[object] = []
        for chunk in chunks:
            due, seq, idx = _columns(chunk)
            if not len(due):
                continue
            d_min, d_max = int(due.min()), int(due.max())
            if d_min < lo or d_max >= hi:
                bad = d_min if d_min < lo else d_max
                raise ValueError(f"chunk ref={chunk.ref!r}: due_ms={bad} is not in second {second}")
            cols.append((due, seq, idx))
            refs.append(chunk.ref)
        n = sum(len(c[0]) for c in cols)
        if self._live + n > self.entries_max:
            raise Overloaded(
                f"timing wheel full: {self._live} held + {n} in second {second} > entries_max={self.entries_max}"
            )
        self.loaded_until_ms = hi
        self._live += n
        self._hold(cols, refs)
        return n

    # --- adding and cancelling -------------------------------------------------------

    def add(self, chunk: Chunk) -> int:
        """Hold the entries of ``chunk`` whose second is loaded; returns how many it holds.

        Contract: the wheel holds exactly the entries with ``due_ms <
        loaded_until_ms`` (returned count ``k``); the others are not held and
        must reach the wheel through ``load_second`` of their second, which is
        not loaded yet (the shell reads them from disk then). So ``0`` means
        "keep it all on disk" and ``len(chunk)`` "all held"; the count is
        truthy iff something is held. Entries due before ``cursor_ms`` are
        overdue and fire at the next ``advance``. ``add`` never refuses: what
        it is given is already on disk in a loaded second and would not come
        back before a restart; ``entries_max`` is enforced by loading (no
        second is offered while the wheel holds that many), so the excess is
        bounded by what arrives for the loaded seconds.
        """
        due, seq, idx = _columns(chunk)
        held = due < self.loaded_until_ms
        k = int(np.count_nonzero(held))
        if not k:
            return 0
        if k < len(due):
            due, seq, idx = due[held], seq[held], idx[held]
        # Staged, not sorted yet: the next advance, cancel or next_due_ms merges every
        # staged chunk into one run, so a burst of small chunks costs one sort and one
        # run to visit per step instead of one per chunk.
        self._staged.append((due, seq, idx))
        self._staged_refs.append(chunk.ref)
        self._staged_entries += k
        self._live += k
        if self._staged_entries >= INDEX_PENDING_MAX:  # bounds what a cancel may have to sort
            self._hold_staged()
        return k

    def _hold_staged(self) -> None:
        cols, refs = self._staged, self._staged_refs
        self._staged, self._staged_refs, self._staged_entries = [], [], 0
        self._hold(cols, refs)

    def _hold(self, cols: list[tuple[np.ndarray, np.ndarray, np.ndarray]], refs: list) -> None:
        """Make one run of the non-empty ``cols`` (a ``refno`` column when there are several)."""
        if not cols:
            return
        if len(cols) == 1:
            (due, seq, idx), refno = cols[0], None
        else:
            due = np.concatenate([c[0] for c in cols])
            seq = np.concatenate([c[1] for c in cols])
            idx = np.concatenate([c[2] for c in cols])
            # uint16 when it fits: advance groups by refno with a radix sort then
            refno_dtype = np.uint16 if len(cols) <= 1 << 16 else np.int32
            refno = np.repeat(np.arange(len(cols), dtype=refno_dtype), [len(c[0]) for c in cols])
        lo = int(due.min())
        if int(due.max()) - lo < _RADIX_SPAN_MS:  # always within one second: a radix sort, O(n)
            order = np.argsort((due - lo).astype(np.uint16), kind="stable")
        else:
            order = np.argsort(due, kind="stable")
        rid = self._next_rid
        self._next_rid += 1
        run = Run(rid, due[order], seq[order], idx[order], refs, None if refno is None else refno[order], order)
        self._runs[rid] = run
        heapq.heappush(self._heap, (int(run.due[0]), rid))
        self._unindexed.append(run)
        self._unindexed_entries += len(order)
        if self._unindexed_entries >= INDEX_PENDING_MAX:
            self._bring_index_up_to_date()

    def _bring_index_up_to_date(self) -> None:
        """Index the live entries of runs added since last time, or rebuild when stale mappings dominate."""
        runs = [r for r in self._unindexed if r.rid in self._runs]
        self._unindexed = []
        self._unindexed_entries = 0
        index = self._index
        fresh = sum(len(r.due) - r.pos for r in runs)
        if index.size + fresh > 2 * self._live + _INDEX_STALE_MIN:
            index.reset()  # more stale than live: start over from what is held
            runs = list(self._runs.values())
        parts = [(r.rid, r.live_in_input_order()) for r in runs]
        parts = [(rid, p) for rid, p in parts if len(p)]
        if not parts:
            return
        seq = np.concatenate([self._runs[rid].seq[p] for rid, p in parts])
        rids = np.repeat(np.array([rid for rid, _ in parts], np.int64), [len(p) for _, p in parts])
        pos = np.concatenate([p for _, p in parts])
        index.append(seq, rids, pos)

    def cancel(self, seqs) -> int:
        """Held entries with these seqs never fire; returns how many held entries that cancelled.

        Seqs not held (fired, never added, still on disk) are ignored: the
        shell cancels on disk too. A cancelled seq may be added again later.
        O(len(seqs)) plus at most ``INDEX_PENDING_MAX`` entries to index.
        """
        seqs = np.unique(np.asarray(seqs, np.uint64).ravel())
        if not len(seqs) or not self._live:
            return 0
        if self._staged:
            self._hold_staged()
        if self._unindexed:
            self._bring_index_up_to_date()
        rids, poss = self._index.lookup(seqs)
        if not len(rids):
            return 0
        order = np.argsort(rids, kind="stable")
        rids, poss = rids[order], poss[order]
        cuts = np.flatnonzero(np.diff(rids)) + 1
        killed = 0
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(rids)]):
            run = self._runs.get(int(rids[a]))
            if run is None:
                continue  # every entry of that run was returned
            p = np.unique(poss[a:b])
            p = p[p >= run.pos]
            if run.dead is not None:
                p = p[~run.dead[p]]
            if not len(p):
                continue
            if run.dead is None:
                run.dead = np.zeros(len(run.due), bool)
            run.dead[p] = True
            killed += len(p)
        self._live -= killed
        assert self._live >= 0, self._live
        return killed

    # --- firing ------------------------------------------------------------------------

    def advance(self, now_ms: int) -> list[Fired]:
        """Return every held entry due by ``now_ms`` (and every overdue one), as one ``Fired`` per ref touched.

        The horizon is ``h = max(cursor_ms, min(now_ms + 1, loaded_until_ms))``:
        live entries due before ``h`` are returned and let go, and
        ``cursor_ms`` becomes ``h``. So the cursor never passes
        ``loaded_until_ms`` and never moves back; a ``now_ms`` that went
        backwards returns only entries that were already overdue. Each
        ``Fired`` is in due order; the list is ordered by each run's first due
        entry, not globally (a merged second yields one ``Fired`` per ref).
        """
        if self._staged:
            self._hold_staged()
        h = max(self.cursor_ms, min(now_ms + 1, self.loaded_until_ms))
        heap, runs = self._heap, self._runs
        out: list[Fired] = []
        dues: list[np.ndarray] = []
        while heap and heap[0][0] < h:
            _, rid = heap[0]
            run = runs[rid]
            a = run.pos
            b = a + int(run.due[a:].searchsorted(h))  # due < h
            run.pos = b
            if b < len(run.due):
                heapq.heapreplace(heap, (int(run.due[b]), rid))
            else:
                heapq.heappop(heap)
                del runs[rid]
            due, seq, idx, refno = run.due[a:b], run.seq[a:b], run.idx[a:b], run.refno
            if refno is not None:
                refno = refno[a:b]
            if run.dead is not None:
                keep = ~run.dead[a:b]
                if not keep.all():
                    due, seq, idx = due[keep], seq[keep], idx[keep]
                    if refno is not None:
                        refno = refno[keep]
                    if not len(due):
                        continue
            dues.append(due)
            if refno is None:
                out.append(Fired(run.refs[0], idx, seq, due))
                continue
            by_ref = np.argsort(refno, kind="stable")  # keeps due order inside each ref
            refno, due, seq, idx = refno[by_ref], due[by_ref], seq[by_ref], idx[by_ref]
            starts = np.flatnonzero(refno[1:] != refno[:-1]) + 1
            refs = run.refs
            cuts = starts.tolist()
            for r, i, j in zip(refno[np.r_[0, starts]].tolist(), [0, *cuts], [*cuts, len(refno)]):
                out.append(Fired(refs[r], idx[i:j], seq[i:j], due[i:j]))
        self.cursor_ms = h
        if dues:
            self._live -= sum(len(d) for d in dues)
            assert self._live >= 0, self._live
            self._count_fired(dues)
        return out

    def _count_fired(self, dues: list[np.ndarray]) -> None:
        ticks = (np.concatenate(dues) if len(dues) > 1 else dues[0]) // self.tick_ms
        oldest = self.cursor_ms // self.tick_ms - _FIRED_COUNTS_WINDOWS * self._window_ticks
        t0 = int(ticks.min())
        if t0 < oldest:  # long overdue: too old for index_in_second to matter
            ticks = ticks[ticks >= oldest]
            if not len(ticks):
                return
            t0 = int(ticks.min())
        counts = np.bincount(ticks - t0)
        fired = self._fired_per_tick
        for i in np.flatnonzero(counts).tolist():
            fired[t0 + i] = fired.get(t0 + i, 0) + int(counts[i])
        if len(fired) > 2 * _FIRED_COUNTS_WINDOWS * self._window_ticks:
            self._fired_per_tick = {t: c for t, c in fired.items() if t >= oldest}

    def next_due_ms(self) -> int | None:
        """The earliest ``due_ms`` held (the shell sleeps exactly until then); None if empty.

        May be before ``cursor_ms`` (an overdue entry: advance now).
        """
        if self._staged:
            self._hold_staged()
        heap, runs = self._heap, self._runs
        while heap:
            due_ms, rid = heap[0]
            run = runs[rid]
            if run.dead is None or not run.dead[run.pos]:
                return due_ms
            live = run.live_from(run.pos)  # head cancelled: skip the cancelled prefix, once
            if len(live):
                run.pos = int(live[0])
                heapq.heapreplace(heap, (int(run.due[run.pos]), rid))
            else:
                run.pos = len(run.due)
                heapq.heappop(heap)
                del runs[rid]
        return None

    # --- state -------------------------------------------------------------------------

    def state(self, *, completed_ms: int, dispatch_offset: int) -> TickState:
        """Tick state for the shell to persist.

        ``completed_ms`` is the time before which every entry ``advance``
        returned has been dispatched; ``tick = completed_ms // tick_ms - 1``,
        except that ``completed_ms`` is first lowered to the earliest held
        entry (an overdue one, added or loaded behind the cursor and not
        returned yet), so the state never claims a tick whose entry is still
        undelivered.
        """
        if not 0 <= completed_ms <= self.cursor_ms:
            raise ValueError(f"completed_ms={completed_ms} outside [0, cursor_ms={self.cursor_ms}]")
        earliest = self.next_due_ms()
        if earliest is not None and earliest < completed_ms:
            completed_ms = earliest
        tick = completed_ms // self.tick_ms - 1
        index = 0
        if tick >= 0:
            second_first_tick = (tick * self.tick_ms) // 1000 * 1000 // self.tick_ms
            index = sum(n for t, n in self._fired_per_tick.items() if second_first_tick <= t <= tick)
        return TickState(self.epoch, tick, index, dispatch_offset)

    def __len__(self) -> int:
        return self._live

    def __repr__(self) -> str:
        return (
            f"TimingWheel(cursor_ms={self.cursor_ms}, loaded_until_ms={self.loaded_until_ms}, "
            f"held={self._live}, runs={len(self._runs)}, epoch={self.epoch})"
        )
