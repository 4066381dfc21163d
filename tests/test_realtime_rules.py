"""The real-time node's rules as pure functions (issue 29: no rule in a servicer):
``node/realtime/immediate.py`` (a message due later belongs on a delay node) and
``node/realtime/nack.py`` (a nacked message is retried through a delay node or dead-lettered).
Examples plus Hypothesis properties against a naive model; no clock, no I/O."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.codec import Batch, encode_extra
from cluster.proto import hourglass_pb2 as pb
from cluster.wire import BatchResult
from node.realtime.immediate import DUE_LATER, due_later, refuse_due_later
from node.realtime.nack import NACKED_BY, ORIGIN_ID, ORIGIN_ID_CHARS_MAX, is_dead, nack_copies, other_groups_retries
from node.realtime.store import DLQ_SUBJECT

# ---------------------------------------------------------------------------------- immediate


def test_due_later_example():
    due = np.array([0, 1000, 1001], np.int64)
    assert due_later(due, now_ms=1000, immediate=False).tolist() == [2]
    assert due_later(due, now_ms=1000, immediate=True).tolist() == []


@settings(max_examples=200, deadline=None)
@given(due=st.lists(st.integers(-10**6, 10**6), max_size=30), now=st.integers(-10**6, 10**6),
       immediate=st.booleans())
def test_due_later_refuses_exactly_the_messages_due_after_now_unless_immediate(due, now, immediate):
    late = due_later(np.array(due, np.int64), now_ms=now, immediate=immediate)
    assert late.tolist() == ([] if immediate else [i for i, d in enumerate(due) if d > now])


@settings(max_examples=200, deadline=None)
@given(due=st.lists(st.integers(0, 2000), max_size=30), now=st.integers(0, 2000), data=st.data())
def test_the_answer_keeps_the_stores_answers_in_place_and_refuses_the_late_ones(due, now, data):
    deliver = np.array(due, np.int64)
    late = due_later(deliver, now_ms=now, immediate=False)
    keep = np.setdiff1d(np.arange(len(due)), late)
    stored = BatchResult.sized(len(keep))  # what a store answered: some OK, some refused, some duplicates
    for j in range(len(keep)):
        stored.seqs[j] = 100 + j
        stored.duplicates[j] = data.draw(st.integers(0, 1))
        if data.draw(st.booleans()):
            stored.refuse(j, pb.UNKNOWN_SUBJECT, f"subject: refused {j}")
    res = refuse_due_later(deliver, keep, stored, late)
    assert res.n == len(due) and res.deliver_at_ms.tolist() == due
    for j, i in enumerate(keep.tolist()):  # the store's answer, at the message's own place
        assert (res.codes[i], res.seqs[i], res.duplicates[i]) == (stored.codes[j], stored.seqs[j],
                                                                   stored.duplicates[j])
        assert res.errors.get(i) == stored.errors.get(j)
    for i in late.tolist():  # refused, nothing stored, "field: reason"
        assert res.codes[i] == pb.INVALID_ARGUMENT and res.seqs[i] == 0
        assert res.errors[i] == f"delay_ms: {DUE_LATER.reason}" and "delay node" in res.errors[i]


# ---------------------------------------------------------------------------------- nack


def nacked(rows) -> Batch:
    """rows: (subject, id, attempts, tags, props)."""
    return Batch.build([r[0] for r in rows], [f"p-{r[1]}".encode() for r in rows], [r[1] for r in rows],
                       np.zeros(len(rows), np.int64), attempts=np.array([r[2] for r in rows], np.uint16),
                       extras=[encode_extra(r[3], sorted(r[4].items())) for r in rows])


def test_nack_example_retry_then_dead_letter():
    b = nacked([("orders", "a", 0, ("eu",), {}), ("orders", "b~r2", 2, (), {ORIGIN_ID: "b"})])
    retry, dead = nack_copies(b, now_ms=1000, retry_after_ms=5000, max_attempts=3)
    assert retry.id_list() == ["a~r1"] and retry.subject(0) == "orders"
    assert int(retry.attempts[0]) == 1 and int(retry.deliver_at_ms[0]) == 6000
    assert retry.extra(0) == (("eu",), ((ORIGIN_ID, "a"),)) and retry.payload(0) == b"p-a"
    assert dead.id_list() == ["b~r3"] and dead.subject(0) == DLQ_SUBJECT
    assert int(dead.attempts[0]) == 3 and int(dead.deliver_at_ms[0]) == 1000
    assert dict(dead.extra(0)[1]) == {ORIGIN_ID: "b", "dlq.subject": "orders", "dlq.reason": "3 delivery attempts"}


def test_a_negative_retry_after_counts_as_zero_and_nothing_nacked_sends_nothing():
    retry, _ = nack_copies(nacked([("s", "x", 0, (), {})]), now_ms=50, retry_after_ms=-10, max_attempts=5)
    assert retry.deliver_at_ms.tolist() == [50]
    retry, dead = nack_copies(Batch.empty(), now_ms=50, retry_after_ms=0, max_attempts=5)
    assert retry.n == dead.n == 0


def test_the_new_id_cuts_a_long_origin():
    retry, _ = nack_copies(nacked([("s", "x" * 128, 0, (), {})]), now_ms=0, retry_after_ms=0, max_attempts=5)
    assert retry.id(0) == "x" * ORIGIN_ID_CHARS_MAX + "~r1"
    assert dict(retry.extra(0)[1])[ORIGIN_ID] == "x" * 128  # the whole original id travels


_rows = st.lists(st.tuples(st.sampled_from(["orders", "billing", "a.b"]),
                           st.text("abc~r0123", min_size=1, max_size=12),
                           st.integers(0, 40),
                           st.lists(st.sampled_from(["eu", "us"]), max_size=2, unique=True).map(tuple),
                           st.dictionaries(st.sampled_from(["k", ORIGIN_ID]), st.text("xyz", min_size=1, max_size=4),
                                           max_size=2)),
                 max_size=20)


@settings(max_examples=200, deadline=None)
@given(rows=_rows, now=st.integers(0, 10**12), retry_after=st.integers(-10**6, 10**7), max_attempts=st.integers(1, 45))
def test_every_nacked_message_gets_exactly_one_copy_by_the_rule(rows, now, retry_after, max_attempts):
    retry, dead = nack_copies(nacked(rows), now_ms=now, retry_after_ms=retry_after, max_attempts=max_attempts)
    # the naive model: in order, each message to exactly one of the two
    want_retry, want_dead = [], []
    for subject, id_, attempts, tags, props in rows:
        origin = props.get(ORIGIN_ID, id_)
        n = attempts + 1
        copy_props = {**props, ORIGIN_ID: origin}
        if n >= max_attempts:
            copy_props |= {"dlq.subject": subject, "dlq.reason": f"{n} delivery attempts"}
            want_dead.append((DLQ_SUBJECT, f"{origin[:100]}~r{n}", n, now, tags, copy_props, f"p-{id_}".encode()))
        else:
            want_retry.append((subject, f"{origin[:100]}~r{n}", n, now + max(0, retry_after), tags, copy_props,
                               f"p-{id_}".encode()))

    def seen(b: Batch):
        return [(b.subject(i), b.id(i), int(b.attempts[i]), int(b.deliver_at_ms[i]), b.extra(i)[0],
                 dict(b.extra(i)[1]), b.payload(i)) for i in range(b.n)]
    assert seen(retry) == want_retry
    assert seen(dead) == want_dead
    assert is_dead(np.array([r[2] for r in rows], np.int64), max_attempts).sum() == dead.n


# ------------------------------------------------------------ retries of other groups' nacks


def test_other_groups_retries_example():
    b = nacked([("orders", "a", 0, (), {}),
                ("orders", "b~r1", 1, (), {ORIGIN_ID: "b", NACKED_BY: "billing"}),
                ("orders", "c~r1", 1, (), {ORIGIN_ID: "c", NACKED_BY: "mail"}),
                ("orders", "d~r1", 1, (), {ORIGIN_ID: "d"}),  # an old copy: no nacked_by
                (DLQ_SUBJECT, "e~r5", 5, (), {ORIGIN_ID: "e", NACKED_BY: "billing", "dlq.subject": "orders"}),
                ("orders", "f", 0, (), {NACKED_BY: "billing"})])  # a first attempt is never filtered
    assert other_groups_retries(b, "mail").tolist() == [False, True, False, False, False, False]
    assert other_groups_retries(b, "billing").tolist() == [False, False, True, False, False, False]
    assert other_groups_retries(Batch.empty(), "mail").tolist() == []


def test_a_retry_copy_is_filtered_for_every_group_but_the_nacking_one():
    b = nacked([("orders", "a", 0, (), {}), ("orders", "b", 2, (), {})])
    retry, _ = nack_copies(b, now_ms=0, retry_after_ms=0, max_attempts=5, group="billing")
    assert other_groups_retries(retry, "billing").tolist() == [False, False]
    assert other_groups_retries(retry, "mail").tolist() == [True, True]
    _, dead = nack_copies(b, now_ms=0, retry_after_ms=0, max_attempts=1, group="billing")
    assert other_groups_retries(dead, "mail").tolist() == [False, False]  # dead letters reach every reader


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(st.sampled_from(["orders", DLQ_SUBJECT]), st.integers(0, 3),
                               st.sampled_from([None, "", "g1", "g2"])), max_size=20),
       group=st.sampled_from(["g1", "g2", "g3"]))
def test_other_groups_retries_by_the_rule(rows, group):
    b = nacked([(s, f"m{i}", a, (), {} if by is None else {NACKED_BY: by}) for i, (s, a, by) in enumerate(rows)])
    want = [s != DLQ_SUBJECT and a > 0 and bool(by) and by != group for s, a, by in rows]
    assert other_groups_retries(b, group).tolist() == want
