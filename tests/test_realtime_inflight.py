"""The pure parts of the real-time store: in-flight ranges against a dict of handles, the dedup
window against a dict with timestamps, the accept decision against a loop over the batch, and
the index entry codec (round trip, every bit flip), a group's resume decision."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cluster.errors import CorruptRecord
from node.store.records import make_seq
from node.realtime.accept import assign_seqs
from node.realtime.dedup import DedupWindow
from node.realtime.groups import Resume, resume_of
from node.realtime.index import ENTRY_SIZE, decode_entries, encode_entries, frame_runs
from node.realtime.inflight import InflightRanges
from node.realtime.span_crc import SPAN_CRC_N_MIN, span_crcs

TIMEOUT = 100

ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 6)),
    st.tuples(st.just("remove"), st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)), max_size=3)),
    st.tuples(st.just("touch"), st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)), max_size=3)),
    st.tuples(st.just("due"), st.integers(1, 8)),
    st.tuples(st.just("tick"), st.sampled_from([1, 50, 100])),
    st.tuples(st.just("truncate"), st.integers(0, 40)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_inflight_ranges_against_a_dict(script):
    f = InflightRanges()
    model: dict[int, int] = {}  # handle -> pulled_at
    nxt, now = 0, 0
    for op, arg in script:
        if op == "add":
            f.add(nxt, nxt + arg, now)
            model.update(dict.fromkeys(range(nxt, nxt + arg), now))
            nxt += arg
        elif op == "remove":
            rs = [(a, a + ln) for a, ln in arg]
            gone = {h for a, b in rs for h in range(a, b) if h in model}
            assert f.remove(rs) == len(gone)
            for h in gone:
                del model[h]
        elif op == "touch":
            rs = [(a, a + ln) for a, ln in arg]
            got = [h for a, b in f.touch(rs, now) for h in range(a, b)]
            want = {h for a, b in rs for h in range(a, b) if h in model}
            assert sorted(set(got)) == sorted(want)
            model.update(dict.fromkeys(want, now))
        elif op == "due":
            got = [h for a, b in f.take_due(now - TIMEOUT, arg, now_ms=now) for h in range(a, b)]
            due = sorted((t, h) for h, t in model.items() if t <= now - TIMEOUT)
            assert got == [h for _, h in due[:arg]]  # oldest pull first, then lowest handle
            model.update(dict.fromkeys(got, now))
        elif op == "tick":
            now += arg
        else:
            f.truncate(arg)
            model = {h: t for h, t in model.items() if h < arg}
            nxt = max(nxt, arg)
        f.check()
        assert len(f) == len(model)
        assert f.committed(nxt) == min(model, default=nxt)
        assert [h for a, b in f.runs() for h in range(a, b)] == sorted(model)


def test_dedup_window_expires_by_time_and_evicts_whole_frames_by_size():
    d = DedupWindow(window_ms=1000, entries_max=4)
    d.add([("s", "a"), ("s", "b")], [1, 2], store_ms=0, offset=0)
    d.add([("s", "c")], [3], store_ms=500, offset=100)
    assert d.lookup([("s", "a"), ("s", "c"), ("t", "a")]) == [1, 3, None]
    assert d.room() == 1
    d.expire(999)
    assert len(d) == 3
    d.expire(1000)  # stored 1000 ms ago: outside the window
    assert d.lookup([("s", "a"), ("s", "c")]) == [None, 3] and d.oldest_offset() == 100
    assert d.add([("s", "d"), ("s", "e"), ("s", "f"), ("s", "g")], [4, 5, 6, 7], store_ms=600, offset=200) == 1
    assert len(d) == 4 and d.oldest_offset() == 200
    assert d.add([("s", "h")], [8], store_ms=700, offset=300) == 4  # the whole oldest frame goes
    assert d.lookup([("s", "d"), ("s", "h")]) == [None, 8]
    d.truncate(250)  # a divergent suffix from offset 250 was cut
    assert d.lookup([("s", "h")]) == [None]
    d.expire(1700)
    assert len(d) == 0 and d.oldest_offset() is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "expire", "truncate"]),
                          st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=5, unique=True),
                          st.integers(0, 400)), max_size=40),
       st.integers(1, 12))
def test_dedup_window_in_generations_against_one_dict(ops, entries_max):
    """The generations answer every lookup as one dict of frames would (the model: frames
    in order, a key's newest copy wins, expiry by store time, early eviction of whole
    oldest frames beyond entries_max, truncation of a log suffix), and none grows past
    its share but for one frame bigger than that."""
    d = DedupWindow(window_ms=1000, entries_max=entries_max)
    frames, now, off, seq = [], 0, 0, 0  # model: [store_ms, offset, {key: seq}] oldest first

    def model_len():
        return len({(k, s) for *_, m in frames for k, s in m.items() if current(k) == s})

    def current(k):
        for *_, m in reversed(frames):
            if k in m:
                return m[k]
        return None

    for op, ids, arg in ops:
        if op == "add":
            now += arg
            d.expire(now)
            frames[:] = [f for f in frames if f[0] > now - 1000]
            keys = [("s", i) for i in ids if d.get(("s", i)) is None]  # what an append stores: the new ones
            assert [k for k in keys if current(k) is not None] == []
            if not keys:
                continue
            seqs = list(range(seq, seq + len(keys)))
            seq += len(keys)
            d.add(keys, seqs, store_ms=now, offset=off)
            frames.append([now, off, dict(zip(keys, seqs))])
            off += 10
            while model_len() > entries_max and len(frames) > 1:
                frames.pop(0)
        elif op == "expire":
            now += arg
            d.expire(now)
            frames[:] = [f for f in frames if f[0] > now - 1000]
        else:
            cut = off - 10 * (arg % 3)
            d.truncate(cut)
            frames[:] = [f for f in frames if f[1] < cut]
        every = [("s", i) for i in "abcdefgh"]
        assert d.lookup(every) == [current(k) for k in every] == [d.get(k) for k in every]
        assert d.isdisjoint(every) == all(current(k) is None for k in every)
        assert len(d) == model_len() <= max(entries_max, len(frames[-1][2]) if frames else 0)
        assert d.oldest_offset() == (frames[0][1] if frames else None)
        assert all(len(g) <= max(d.gen_entries_max, 5) for g in d.gens) and len(d.gens) >= 1


def test_dedup_window_frames_that_outsize_generations_grow_the_filter_and_lose_no_key():
    """entries_max 80: generations of 10; frames of 6 keys each take a generation of their
    own, so 13 are alive where 11 filter rows were planned: the filter grows, every key of
    the window is still found and none of the forgotten ones is."""
    d = DedupWindow(window_ms=10**9, entries_max=80)
    rows = len(d._filter)
    for f in range(40):
        d.add([f"s\x00{f}-{i}" for i in range(6)], list(range(f * 6, f * 6 + 6)), store_ms=f, offset=f)
    assert len(d.gens) == 13 and len(d._filter) > rows and len(d) == 78
    keys = [f"s\x00{f}-{i}" for f in range(40) for i in range(6)]
    assert d.lookup(keys) == [None] * 162 + list(range(162, 240))
    assert not d.isdisjoint(keys[-1:]) and d.isdisjoint(keys[:162])
    d.expire(10**9 + 38)  # all but the last frame (stored at 39)
    assert len(d) == 6 and len(d.gens) == 1 and d.lookup(keys[-6:]) == list(range(234, 240))


def test_index_entries_round_trip_and_every_bit_flip_is_detected():
    raw = encode_entries(offset=1 << 40, index=np.array([3, 9]), visible_ms=-5, masks=np.array([1, 1 << 63], np.uint64))
    e = decode_entries(raw, path="p", first_pos=0)
    assert e["offset"].tolist() == [1 << 40] * 2 and e["index"].tolist() == [3, 9]
    assert e["visible_ms"].tolist() == [-5, -5] and e["mask"].tolist() == [1, 1 << 63]
    for bit in range(ENTRY_SIZE * 8 * 2):
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptRecord) as err:
            decode_entries(bytes(flipped), path="p", first_pos=7)
        assert err.value.offset == (7 + bit // (ENTRY_SIZE * 8)) * ENTRY_SIZE


def test_frame_runs_split_a_frame_by_subject_in_frame_order():
    runs = frame_runs(offset=64, subject_idx=np.array([1, 0, 1, 1, 0], np.uint16), visible_ms=9,
                      masks=np.arange(5, dtype=np.uint64))
    assert sorted(runs) == [0, 1]
    r1 = decode_entries(runs[1], path="p", first_pos=0)
    assert r1["index"].tolist() == [0, 2, 3] and r1["mask"].tolist() == [0, 2, 3] and set(r1["offset"]) == {64}
    assert decode_entries(runs[0], path="p", first_pos=0)["index"].tolist() == [1, 4]


def test_dedup_window_entries_are_not_walked_by_the_cyclic_gc():
    """A full collection walks every tracked container: with the keys of a 10-minute window
    held in lists, each one paused a real-time node for tens of ms. Tuples of strs and ints
    are untracked by the collections that meet them (inner ones first), lists never."""
    import gc

    d = DedupWindow(window_ms=60_000, entries_max=100_000)
    for f in range(50):
        keys = [("orders", f"id-{f}-{i}") for i in range(100)]
        d.add(keys, list(range(f * 100, f * 100 + 100)), store_ms=f, offset=f * 1000)
    # one collection untracks a tuple only if its items are untracked already when it is
    # visited; a collection that merges generations can visit an entry before its keys tuple
    # and that one before its (subject, id) pairs: three levels, so three collections at most
    for _ in range(3):
        gc.collect()
    assert not any(gc.is_tracked(entry) for entry in d.order)
    assert not any(gc.is_tracked(g) for g in d.gens)
    assert d.lookup([("orders", "id-3-7"), ("orders", "nope")]) == [307, None]


def test_dedup_window_frames_hold_nothing_a_collection_must_walk():
    """Untracked only after the first collection that meets them is too late: in a node whose
    allocations balance its frees the first collection came two minutes into a run and
    walked every frame's keys at once (a 90-200 ms pause at 115 s into every long run).
    A frame's keys and seqs are never tracked, with no collection at all."""
    import gc

    gc.disable()
    try:
        d = DedupWindow(window_ms=60_000, entries_max=100_000)
        for f in range(20):
            keys = [f"orders\x00id-{f}-{i}" for i in range(100)]
            d.add(keys, np.arange(f * 100, f * 100 + 100, dtype=np.uint64), store_ms=f, offset=f * 1000)
        d.add([("orders", "a tuple key")], [7], store_ms=20, offset=20_000)  # any hashable key, seqs as a list
        walked = sum(len(gc.get_referents(x)) for entry in d.order for x in entry if gc.is_tracked(x))
        assert walked == 0
        assert d.lookup(["orders\x00id-3-7", ("orders", "a tuple key"), "nope"]) == [307, 7, None]
        d.expire(now_ms=60_010)  # frames 0..10 expired: their arrays still name the right entries
        assert d.lookup(["orders\x00id-3-7", "orders\x00id-11-0"]) == [None, 1100] and len(d) == 901
        d.truncate(15_000)
        assert d.lookup(["orders\x00id-14-99", "orders\x00id-15-0"]) == [1499, None] and len(d) == 400
    finally:
        gc.enable()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from("abcdef"), max_size=12), st.dictionaries(st.sampled_from("abcdef"),
                                                                         st.integers(0, 1 << 50), max_size=4),
       st.integers(0, 1000))
def test_assign_seqs_against_a_loop_over_the_batch(ids, known, counter):
    """Known ids answer with their stored seq, an id repeated in the batch with its first
    copy's, every other message gets the next seq in batch order."""
    keys = [("s", i) for i in ids]
    known = {("s", i): q for i, q in known.items()}
    window = DedupWindow(window_ms=1000, entries_max=8)  # generations of one entry: one per known key
    for off, (k, q) in enumerate(known.items()):
        window.add([k], [q], store_ms=0, offset=off)
    seqs, dup, new = assign_seqs(keys, window, epoch=3, counter=counter)
    want, want_dup, want_new, seen, nxt = [], [], [], dict(known), counter
    for pos, key in enumerate(keys):
        if key in seen:
            want.append(seen[key])
            want_dup.append(True)
        else:
            seen[key] = make_seq(3, nxt)
            nxt += 1
            want.append(seen[key])
            want_dup.append(False)
            want_new.append(pos)
    assert seqs.tolist() == want and dup.tolist() == want_dup and new.tolist() == want_new


def test_a_group_resumes_only_when_idle_or_behind_what_retention_kept():
    assert resume_of(idle=False, committed=120, live_from=100) is None  # active, still on disk
    assert resume_of(idle=False, committed=100, live_from=100) is None
    assert resume_of(idle=False, committed=40, live_from=100) == Resume(was_idle=False, live_from=100, skip=True)
    assert resume_of(idle=True, committed=40, live_from=100) == Resume(was_idle=True, live_from=100, skip=True)
    assert resume_of(idle=True, committed=120, live_from=100) == Resume(was_idle=True, live_from=100, skip=False)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 200).flatmap(lambda n: st.tuples(st.just(n), st.binary(min_size=n * 32, max_size=n * 32 + 7))))
def test_span_crcs_equal_zlib_per_span(case):
    """The table CRC (``node/realtime/span_crc.py``) is zlib.crc32 of each span, on both
    sides of SPAN_CRC_N_MIN and for random bytes (entries on disk are any bytes)."""
    n, raw = case
    want = [zlib.crc32(raw[i * 32:i * 32 + 28]) for i in range(n)]
    got = span_crcs(raw, n, span=28, stride=32)
    assert got.dtype == np.uint32 and got.tolist() == want


def test_span_crcs_of_encoded_entries_check_on_decode():
    """A frame's runs of every size (table path included) decode with their CRCs intact."""
    for n in (1, SPAN_CRC_N_MIN - 1, SPAN_CRC_N_MIN, 500):
        raw = encode_entries(offset=7, index=np.arange(n), visible_ms=np.arange(n) * 3, masks=np.full(n, 5, np.uint64))
        e = decode_entries(raw, path="x", first_pos=0)
        assert e["index"].tolist() == list(range(n))
        bad = bytearray(raw)
        bad[(n - 1) * ENTRY_SIZE + 3] ^= 1
        with pytest.raises(CorruptRecord):
            decode_entries(bytes(bad), path="x", first_pos=0)
