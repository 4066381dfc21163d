"""The delay node's rule for messages the real-time side refused for good
(node/delay/deadletter.py): retried with a doubling wait, dead-lettered after
``attempts_max`` refusals, or at once when already bound for the dead-letter subject."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.codec import Batch
from cluster.proto import hourglass_pb2 as pb
from node.delay import deadletter
from node.realtime.store import DLQ_SUBJECT


def batch(subjects: list[str]) -> Batch:
    n = len(subjects)
    b = Batch.build(subjects, [b"p%d" % i for i in range(n)], [f"id{i}" for i in range(n)], [1000 + i for i in range(n)],
                    attempts=[2] * n)
    b.seq[:] = np.arange(10, 10 + n, dtype=b.seq.dtype)
    return b


def test_a_refusal_is_retried_with_a_doubling_wait_then_dead_lettered():
    b = batch(["orders", "orders"])
    failures: dict[int, int] = {}
    waits = []
    for _ in range(2):
        r = deadletter.sort_refused(b, np.array([0, 1]), failures, attempts_max=3, backoff_ms_max=10_000)
        assert r.dead == [] and r.again == [0, 1]
        waits.append(r.again_ms)
    assert waits == [100, 200]
    r = deadletter.sort_refused(b, np.array([0]), failures, attempts_max=3, backoff_ms_max=10_000)
    assert r.dead == [0] and r.again == [] and r.again_ms == 0
    assert failures == {10: 3, 11: 2}


def test_the_wait_is_capped_and_a_dead_letter_is_never_retried():
    b = batch(["orders", DLQ_SUBJECT])
    failures = {10: 20}
    r = deadletter.sort_refused(b, np.array([0, 1]), failures, attempts_max=100, backoff_ms_max=2_000)
    assert r.again == [0] and r.again_ms == 2_000
    assert r.dead == [1]  # bound for the dead-letter subject: no loop of dead letters


def test_a_dead_letter_says_where_it_was_bound_and_why():
    b = batch(["orders", "payments"])
    why = {1: (pb.UNKNOWN_SUBJECT, "x" * 900)}
    dlq = deadletter.dead_letters(b, [1], why)
    assert dlq.n == 1 and dlq.subject(0) == DLQ_SUBJECT
    assert (dlq.id(0), dlq.payload(0), int(dlq.deliver_at_ms[0]), int(dlq.attempts[0])) == ("id1", b"p1", 1001, 2)
    _, props = dlq.extra(0)
    props = dict(props)
    assert props["dlq.subject"] == "payments" and props["dlq.code"] == "UNKNOWN_SUBJECT"
    assert props["dlq.reason"] == "x" * deadletter.REASON_CHARS_MAX


@settings(max_examples=200, deadline=None)
@given(rounds=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True), max_size=12),
       attempts_max=st.integers(1, 6), dlq_at=st.sets(st.integers(0, 5), max_size=2))
def test_the_rule_matches_a_count_of_refusals(rounds, attempts_max, dlq_at):
    """Against a naive model: each message is dead-lettered exactly when its refusals reach
    ``attempts_max`` (or at its first refusal if bound for the dead-letter subject), and the
    wait is the cap of 50 ms doubled per refusal of the most refused message tried again."""
    b = batch([DLQ_SUBJECT if i in dlq_at else "s" for i in range(6)])
    failures: dict[int, int] = {}
    model: dict[int, int] = {}
    done: set[int] = set()
    for idx in rounds:
        idx = [i for i in idx if i not in done]
        if not idx:
            continue
        r = deadletter.sort_refused(b, np.array(idx), failures, attempts_max=attempts_max, backoff_ms_max=3_000)
        for i in idx:
            model[i] = model.get(i, 0) + 1
        want_dead = [i for i in idx if model[i] >= attempts_max or i in dlq_at]
        assert r.dead == want_dead
        assert r.again == [i for i in idx if i not in want_dead]
        if r.again:
            assert r.again_ms == min(3_000, 50 * 2 ** max(model[i] for i in r.again))
        done.update(want_dead)
    assert {int(b.seq[i]) - 10: n for i, n in model.items()} == {int(s) - 10: n for s, n in failures.items()}
