"""cluster/codec.py: the one batch codec. Round trips, subsets, validation, and
refusal of every malformed structure."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cluster.codec as codec
from cluster.codec import (COLUMN_BYTES, DAY_MS, DELAY_HORIZON_MS_DEFAULT, HEADER_SIZE, INVALID_ARGUMENT, KIND_CANCEL,
                           OK, PAYLOAD_TOO_LARGE, Batch, DispatchBatch, Limits, decode_extra, encode_extra, span_ms)
from cluster.errors import InvalidArgument

ids_st = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=20)
record_st = st.tuples(st.sampled_from(["a", "b.c", "orders-1"]), st.binary(max_size=40), ids_st,
                      st.integers(0, 2**62), st.lists(st.text(min_size=1, max_size=5), max_size=3),
                      st.dictionaries(st.text(min_size=1, max_size=5), st.text(max_size=5), max_size=3))


def build(rows):
    return Batch.build([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                       np.array([r[3] for r in rows], np.int64), seq=np.arange(len(rows), dtype=np.uint64) + 7,
                       extras=[encode_extra(tuple(r[4]), sorted(r[5].items())) for r in rows])


def as_rows(b: Batch):
    return [(b.subject(i), b.payload(i), b.id(i), int(b.deliver_at_ms[i]), list(b.extra(i)[0]), dict(b.extra(i)[1]))
            for i in range(b.n)]


@settings(max_examples=200, deadline=None)
@given(st.lists(record_st, max_size=30))
def test_round_trip(rows):
    b = Batch.decode(build(rows).encode())
    assert as_rows(b) == [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows]
    assert b.id_list() == [r[2] for r in rows] and b.payload_list() == [r[1] for r in rows]
    assert b.seq.tolist() == list(range(7, 7 + len(rows)))
    assert len(b.encode()) == HEADER_SIZE + COLUMN_BYTES * len(rows) + len(b.ids) + len(b.payloads) + len(
        b.extras) + sum(2 + len(s.encode()) for s in b.subjects)


@settings(max_examples=100, deadline=None)
@given(st.lists(record_st, min_size=1, max_size=30), st.data())
def test_take_and_concat_keep_records(rows, data):
    b = Batch.decode(build(rows).encode())
    idx = data.draw(st.lists(st.integers(0, len(rows) - 1), max_size=40))
    t = b.take(np.array(idx, np.int64))
    assert as_rows(t) == [as_rows(b)[i] for i in idx]
    c = Batch.concat([t, b])
    assert as_rows(Batch.decode(c.encode())) == as_rows(t) + as_rows(b)
    assert as_rows(b.take(slice(1, None))) == as_rows(b)[1:]
    parts = b.split_by_subject()
    assert sorted(i for p in parts.values() for i in p.tolist()) == list(range(len(rows)))
    assert all(b.subject(int(i)) == s for s, p in parts.items() for i in p)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(record_st, min_size=1, max_size=12), min_size=1, max_size=6), st.data(),
       st.integers(1, 8))
def test_gather_is_take_then_concat(sources, data, whole_max):
    """``Batch.gather`` (one firing round from many frames) gives exactly what taking from
    each source and concatenating gives, whether a source is joined whole or taken first,
    with subject tables that differ, blobs that are empty and repeated indices."""
    batches = []
    for rows in sources:
        b = Batch.decode(build(rows).encode())
        if data.draw(st.booleans()):  # a slice: columns are views, ends rebased
            b = b.take(slice(data.draw(st.integers(0, b.n - 1)), None))
        batches.append(b)
    parts = [(b, np.array(data.draw(st.lists(st.integers(0, b.n - 1), max_size=8)), np.int64)) for b in batches]
    want = as_rows(Batch.concat([b.take(i) for b, i in parts]))
    old, codec._GATHER_WHOLE_MAX = codec._GATHER_WHOLE_MAX, whole_max
    try:
        g = Batch.gather(parts)
    finally:
        codec._GATHER_WHOLE_MAX = old
    assert as_rows(Batch.decode(g.encode())) == want
    assert g.seq.tolist() == [int(b.seq[k]) for b, i in parts for k in i.tolist()]
    # due_order (a firing round): the stable sort by due time of the same gather, blobs cut once
    old, codec._GATHER_WHOLE_MAX = codec._GATHER_WHOLE_MAX, whole_max
    try:
        d = Batch.gather(parts, due_order=True)
    finally:
        codec._GATHER_WHOLE_MAX = old
    assert as_rows(Batch.decode(d.encode())) == as_rows(g.take(np.argsort(g.deliver_at_ms, kind="stable")))


COLUMNS = ("seq", "deliver_at_ms", "effective_ms", "store_ms", "id_end", "payload_end", "extra_end", "attempts",
           "subject_idx", "kind")
i64_st = st.integers(-2**63, 2**63 - 1)


@settings(max_examples=300, deadline=None)
@given(st.lists(record_st, max_size=40), st.data())
def test_packed_columns_decode_to_exactly_the_plain_ones(rows, data):
    """``encode(packed=True)`` (schedule frames) decodes to the same columns, dtypes and
    blobs as the plain layout, for any values (u64 seqs near the top, negative and extreme
    times, an effective time below the due time), and is never larger."""
    n = len(rows)
    col = lambda elem: np.array(data.draw(st.lists(elem, min_size=n, max_size=n)))  # noqa: E731
    small = data.draw(st.booleans())  # narrow spans (the usual frame) or anything at all
    seq0 = data.draw(st.integers(0, 2**64 - 1 - 70_000))
    seq = (np.uint64(seq0) + col(st.integers(0, 65_535 if small else 70_000)).astype(np.uint64)) if n else None
    times = (lambda: col(st.integers(0, 999)).astype(np.int64) + data.draw(st.integers(-2**40, 2**40))) if small \
        else (lambda: col(i64_st).astype(np.int64))
    b = build(rows)
    if n:
        b = b.replace(seq=seq, deliver_at_ms=times(), effective_ms=times(), store_ms=times(),
                      attempts=col(st.integers(0, 65_535)).astype(np.uint16),
                      kind=col(st.sampled_from([1, 2])).astype(np.uint8))
    plain, packed = b.encode(), b.encode(packed=True)
    assert len(packed) <= len(plain)
    p, q = Batch.decode(plain), Batch.decode(packed)
    for name in COLUMNS:
        a, c = getattr(p, name), getattr(q, name)
        assert a.dtype == c.dtype and a.tolist() == c.tolist(), name
    assert (p.ids, p.payloads, p.extras, p.subjects) == (q.ids, q.payloads, q.extras, q.subjects)
    if n:  # the matrix form writes the bytes the column-at-a-time form wrote (docs/format.md)
        assert codec._pack_columns(b) == _pack_columns_by_column(b)


def _pack_columns_by_column(b: Batch) -> bytes | None:
    """The packed block one column at a time (the form before issue 28's matrix): the reference."""
    n = b.n
    descr, bases, data, size = bytearray(len(COLUMNS)), [], [], len(COLUMNS)
    for k, name in enumerate(COLUMNS):
        v = getattr(b, name)
        if name in ("id_end", "payload_end", "extra_end"):
            e = v.astype(np.int64)
            v = e - np.concatenate(([0], e[:-1])).astype(np.int64)
        elif name == "effective_ms":
            v = v.astype(np.int64) - b.deliver_at_ms.astype(np.int64)
        else:
            v = v.astype(np.uint64 if name == "seq" else np.int64)
        lo, hi = int(v.min()), int(v.max())
        span = hi - lo
        w = 0 if span == 0 else 1 if span < 1 << 8 else 2 if span < 1 << 16 else 4 if span < 1 << 32 else 8
        descr[k] = w
        if lo:
            descr[k] |= 0x80
            bases.append((lo & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little"))
            size += 8
        if w:
            off = (v - v.dtype.type(lo)) if v.dtype == np.uint64 else (v - lo)
            data.append(off.astype(f"<u{w}").tobytes())
            size += n * w
    if size >= n * codec.COLUMN_BYTES:
        return None
    return b"".join((bytes(descr), *bases, *data))


def test_packed_frame_of_one_second_is_small_and_refuses_damage():
    n = 1000
    b = Batch.build("orders", [bytes(256)] * n, [f"id-{i:017d}" for i in range(n)],
                    np.full(n, 1_800_000_003_600_000, np.int64) + np.arange(n) % 1000,
                    seq=np.arange(n, dtype=np.uint64) + (3 << 40), store_ms=np.full(n, 1_800_000_000_000))
    plain, packed = b.encode(), b.encode(packed=True)
    assert packed[1] == 1 and plain[1] == 0  # the flag
    assert (len(plain) - len(packed)) / n > 44  # 49 bytes of columns -> seq and due as u16 offsets
    one = b.take(np.array([0]))
    assert one.encode(packed=True) == one.encode()  # too small to gain: plain
    rng = np.random.default_rng(5)
    cols_end = len(packed) - len(b.ids) - len(b.payloads) - 2 - len("orders")
    for _ in range(300):  # damage in the descriptor, bases and offsets: a clean refusal or a batch
        raw = bytearray(packed)
        raw[int(rng.integers(HEADER_SIZE, cols_end))] ^= 1 << int(rng.integers(8))
        try:
            Batch.decode(bytes(raw))
        except InvalidArgument:
            pass
    for raw in (packed[:HEADER_SIZE + 5], packed[:-1], bytes([2, 3]) + packed[2:]):
        with pytest.raises(InvalidArgument):
            Batch.decode(raw)


def test_decode_refuses_every_malformed_structure():
    good = Batch.build(["s", "t"], [b"ab", b"c"], ["i1", "i2"], [1, 2]).encode()
    Batch.decode(good)
    bad = [
        good[:-1],                                    # sizes do not add up
        good + b"\0",
        b"\x01" + good[1:],                           # unknown version
        good[:10],                                    # shorter than the header
    ]
    b = bytearray(good)
    off = HEADER_SIZE + 2 * 8 * 4                     # id_end column
    struct.pack_into("<I", b, off, 5)                 # first id ends past the second's end
    bad.append(bytes(b))
    b = bytearray(good)
    struct.pack_into("<H", b, HEADER_SIZE + 2 * (32 + 12 + 2), 9)  # subject index past the table
    bad.append(bytes(b))
    b = bytearray(good)
    b[HEADER_SIZE + 2 * (32 + 12 + 4)] = 7            # unknown kind
    bad.append(bytes(b))
    for raw in bad:
        with pytest.raises(InvalidArgument):
            Batch.decode(raw)


def test_subject_not_utf8_is_invalid_argument_naming_it():
    raw = Batch.build(["fine", "abcd"], [b"x", b"y"], ["a", "b"], [0, 0]).encode()
    bad = raw.replace(b"abcd", b"ab\xff\xfe")
    with pytest.raises(InvalidArgument) as info:
        Batch.decode(bad)
    assert info.value.field == "subject"
    assert str(info.value).startswith("invalid subject: subject 1 of the batch is not UTF-8 (invalid start byte "
                                      "at byte 2: b'ab\\xff\\xfe')")


def test_horizon_applies_to_the_millisecond_and_names_the_setting():
    assert Limits().delay_horizon_ms == DELAY_HORIZON_MS_DEFAULT == 732 * DAY_MS
    h = DELAY_HORIZON_MS_DEFAULT
    b = Batch.build("s", [b"x"] * 3, ["a", "b", "c"], [1000 + h - 1, 1000 + h, 1000 + h + 1])
    codes, reasons = b.validate(now_ms=1000)
    assert codes.tolist() == [OK, OK, INVALID_ARGUMENT]
    assert reasons[2] == ("deliver_at_ms: 63244800001 ms (732.000 days) ahead is beyond the delay horizon, "
                          "delay_horizon_ms = 63244800000 ms (732 days)")
    assert span_ms(999) == "999 ms" and span_ms(2 * DAY_MS) == f"{2 * DAY_MS} ms (2 days)"


def test_validate_refuses_per_message_and_keeps_the_rest():
    lim = Limits(payload_bytes_max=4, id_bytes_max=5, delay_horizon_ms=1000)
    b = Batch.build(["ok", "ok", "", "ok", "ok", "ok", "ok"],
                    [b"x", b"toolong", b"x", b"x", b"x", b"x", b"x"],
                    ["a", "b", "c", "b d", "waytoolong", "f", "g"],
                    [100, 100, 100, 100, 100, 100 + 5000, -1],
                    extras=[b"", b"", b"", b"", b"", b"", b""])
    codes, reasons = b.validate(now_ms=100, limits=lim)
    assert codes.tolist() == [OK, PAYLOAD_TOO_LARGE] + [INVALID_ARGUMENT] * 5
    assert set(reasons) == {1, 2, 3, 4, 5, 6}
    assert "printable ASCII" in reasons[3] and "horizon" in reasons[5]
    tags = Batch.build("s", [b"x"], ["a"], [0], extras=[encode_extra(tuple(f"t{i}" for i in range(20)))])
    assert tags.validate(now_ms=0)[0].tolist() == [INVALID_ARGUMENT]
    cancel = Batch.build("s", [b"x"], ["a"], [0], kind=KIND_CANCEL)
    assert cancel.validate(now_ms=0)[0].tolist() == [INVALID_ARGUMENT]  # producers send messages only


def test_extras_round_trip_and_refusal():
    raw = encode_extra(("eu", "vip"), [("k", "v"), ("x", "")])
    assert decode_extra(raw) == (("eu", "vip"), (("k", "v"), ("x", "")))
    assert decode_extra(b"") == ((), ())
    with pytest.raises(InvalidArgument):
        decode_extra(raw[:-1])


def test_dispatch_batch_round_trip_and_checks():
    d = DispatchBatch(np.array([1, 2], np.uint64), np.array([5, 6]), np.array([4, 6]), 99, 1)
    e = DispatchBatch.decode(d.encode())
    assert e.seq.tolist() == [1, 2] and e.effective_ms.tolist() == [5, 6] and e.deliver_at_ms.tolist() == [4, 6]
    assert (e.dispatched_ms, e.outcome) == (99, 1)
    with pytest.raises(InvalidArgument):
        DispatchBatch.decode(d.encode()[:-1])


@pytest.mark.parametrize("subject, ok", [
    ("orders", True), ("orders.a-b_c.9", True), ("9", True), ("a" * 200, True),
    ("orders.a\n", False), ("orders.a\r", False), ("\norders", False), ("orders\n.a", False),
    ("not a subject/\n../x", False), ("orders/x", False), (".orders", False), ("", False), ("a" * 201, False),
    ("ordérs", False), ("orders\x00", False),
])
def test_one_subject_rule_matches_the_whole_subject(subject, ok):
    """``$`` alone also matches before a trailing newline: the rule is matched whole, one
    function for every caller (``subject_problem``), the batch's check among them."""
    from cluster.codec import check_subject, subject_problem

    assert (subject_problem(subject) is None) == ok
    codes, reasons = Batch.build(subject, [b"x"], ["i"], [0]).validate(now_ms=0)
    assert codes.tolist() == ([OK] if ok else [INVALID_ARGUMENT]), reasons
    if not ok:
        with pytest.raises(InvalidArgument, match="invalid topic"):
            check_subject(subject, "topic")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_ack_ranges_of_small_batches_equal_the_array_rule(data):
    """The consumer's ack ranges (``client._subject_handles``) and ``wire.pack_ranges`` take a
    Python loop for small batches (most pulls); the bytes are those of the array rule."""
    import cluster.client as client
    import cluster.wire as wire

    n = data.draw(st.integers(1, wire.SMALL_RANGES_MAX))
    subjects = data.draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=n, max_size=n))
    handles = np.array(data.draw(st.lists(st.integers(0, 3 * n), min_size=n, max_size=n)), np.uint64)
    batch = Batch.build(subjects, [b"x"] * n, [f"m{i}" for i in range(n)], np.zeros(n, np.int64))
    small = [(h.subject, h.ranges) for h in client._subject_handles(batch, handles)]
    packed = wire.pack_ranges(handles)
    limit = wire.SMALL_RANGES_MAX
    try:
        client.SMALL_RANGES_MAX = wire.SMALL_RANGES_MAX = -1  # the array rule
        assert small == [(h.subject, h.ranges) for h in client._subject_handles(batch, handles)]
        assert packed == wire.pack_ranges(handles)
    finally:
        client.SMALL_RANGES_MAX = wire.SMALL_RANGES_MAX = limit
