"""The delay node's pacing rules (``node/delay/pacing.py``) in seeded simulations on one
millisecond clock: the firing loop's spacing never makes a message late and adds no round in
the steady state; the filer's linger never holds a record past its room or its linger."""

from __future__ import annotations

import random

import pytest

from node.delay.pacing import linger_wait_ms, round_wait_ms

pytestmark = pytest.mark.unit

LEAD, INTERVAL = 60, 40
URGENT = LEAD - INTERVAL  # as DelayNode._wheel_loop derives it


def _fire(arrivals: list[tuple[int, int]], end_ms: int) -> tuple[dict[int, int], list[tuple[int, bool]]]:
    """Run the firing loop a millisecond at a time over messages ``(arrival, due)`` (put in the
    wheel at ``arrival``). A round fires when ``round_wait_ms`` says so and something is due
    within the lead, takes everything due within it, and sets the spacing. Returns each
    message's dispatch time and the rounds as ``(time, urgent)``."""
    held: dict[int, int] = {}  # message -> due
    sent: dict[int, int] = {}
    rounds: list[tuple[int, bool]] = []
    next_round = 0
    by_arrival = sorted(range(len(arrivals)), key=lambda k: arrivals[k][0])
    i = 0
    for t in range(end_ms):
        while i < len(by_arrival) and arrivals[by_arrival[i]][0] <= t:
            held[by_arrival[i]] = arrivals[by_arrival[i]][1]
            i += 1
        earliest = min(held.values(), default=None)
        if round_wait_ms(t, next_round, earliest, URGENT) > 0:
            continue
        due = [k for k, d in held.items() if d <= t + LEAD]
        if not due:  # nothing within the lead: the loop sleeps on (the spacing is not reset)
            continue
        rounds.append((t, t < next_round))
        for k in due:
            sent[k] = t
            del held[k]
        next_round = t + INTERVAL
    return sent, rounds


def _arrivals(seed: int, n: tuple[int, int], short: tuple[float, int], long: tuple[int, int]) -> list[tuple[int, int]]:
    """``(arrival, due)`` at random times in 0..3 s: a share ``short[0]`` due within ``short[1]``
    ms (a short delay, a catch-up), the others ``long`` ms later."""
    rnd = random.Random(seed)
    out = []
    for _ in range(rnd.randint(*n)):
        a = rnd.randint(0, 3000)
        out.append((a, a + (rnd.randint(0, short[1]) if rnd.random() < short[0] else rnd.randint(*long))))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_the_spacing_never_makes_a_message_late_and_never_fires_before_the_lead(seed):
    arrivals = _arrivals(seed, (50, 400), (0.2, 50), (100, 2000))
    sent, rounds = _fire(arrivals, 6000)
    assert len(sent) == len(arrivals)
    for k, (a, due) in enumerate(arrivals):
        d = sent[k]
        assert d >= a and d >= due - LEAD, (k, a, due, d)  # never before it is in the wheel or within the lead
        assert d <= max(a, due - URGENT), (k, a, due, d)  # the spacing never holds it past due - URGENT
    # a round closer than the spacing only for a message that could not wait
    for t, early in rounds:
        if early:
            assert any(sent[k] == t and due - URGENT <= t for k, (a, due) in enumerate(arrivals)), t


@pytest.mark.parametrize("seed", range(10))
def test_in_the_steady_state_the_spacing_alone_paces_the_rounds(seed):
    """Messages put in the wheel well ahead of their due time (the common case: a delay of
    seconds, loaded half a second ahead): every round is a full spacing after the last, so the
    urgency rule adds no round, and each message still leaves at least URGENT ms early."""
    rnd = random.Random(seed)
    arrivals = []
    for k in range(2000):
        due = 1000 + rnd.randint(0, 3000)
        arrivals.append((due - 500, due))
    sent, rounds = _fire(arrivals, 5000)
    gaps = [b[0] - a[0] for a, b in zip(rounds, rounds[1:])]
    assert not any(early for _, early in rounds)
    assert min(gaps) >= INTERVAL
    assert all(sent[k] <= due - URGENT for k, (_, due) in enumerate(arrivals))


def test_a_message_due_at_once_fires_a_round_inside_the_spacing():
    sent, rounds = _fire([(0, 1000), (945, 1000), (950, 950)], 2000)
    assert sent[0] == 940  # due - LEAD: the first round
    assert sent[2] == 950 and (950, True) in rounds  # due now: does not wait for 940 + INTERVAL
    assert sent[1] == 950  # went with it (due within the lead)


LINGER = 20
ROOM = LEAD + LINGER + 50  # as DelayNode._file_linger derives it (FILE_URGENT_MARGIN_MS 50)


def _file(writes: list[tuple[int, int]], end_ms: int) -> dict[int, int]:
    """The filer over writes ``(time, earliest due)``: woken by a write, it lingers while
    ``linger_wait_ms`` says so (each write looks again), then files everything written."""
    filed: dict[int, int] = {}
    waiting: list[int] = []
    deadline = None
    order = sorted(range(len(writes)), key=lambda k: writes[k][0])
    i = 0
    for t in range(end_ms):
        while i < len(order) and writes[order[i]][0] <= t:
            waiting.append(order[i])
            i += 1
        if not waiting:
            continue
        if deadline is None:
            deadline = t + LINGER  # the first write the filer woke for
        if linger_wait_ms(t, deadline, min(writes[k][1] for k in waiting), ROOM) > 0:
            continue
        for k in waiting:
            filed[k] = t
        waiting, deadline = [], None
    return filed


@pytest.mark.parametrize("seed", range(30))
def test_the_filer_lingers_at_most_its_linger_and_never_into_a_records_room(seed):
    writes = _arrivals(seed, (20, 300), (0.3, 200), (1000, 5000))
    filed = _file(writes, 4000)
    assert len(filed) == len(writes)
    for k, (a, due) in enumerate(writes):
        assert a <= filed[k] <= a + LINGER, (a, due, filed[k])
        assert filed[k] <= max(a, due - ROOM), (a, due, filed[k])
    # it does batch: writes 10 ms apart due seconds later share rounds
    steady = _file([(10 * k, 10 * k + 2000) for k in range(100)], 2000)
    assert len(set(steady.values())) <= 100 // 2 + 1


def test_nothing_in_memory_is_filed_at_once():
    assert linger_wait_ms(0, 20, None, ROOM) == 0.0
