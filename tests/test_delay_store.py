"""DelayStore on real files with a fake clock: ingest -> schedule -> wheel -> dispatch -> restart."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from cluster import status
from cluster.errors import AlreadyExists, InvalidArgument, NotFound, PayloadTooLarge, TooLate
from node.delay.store import DelayStore, StoreSettings
from node.store.records import Limits, Message

T0 = 1_800_000_000_000
SMALL = StoreSettings(message_segment_bytes=1 << 16, dispatch_segment_bytes=1 << 14, schedule_segment_bytes=1 << 16,
                      id_slots=256, id_entries_max=4096, limits=Limits(payload_bytes_max=1024))


def msg(i, due, subject="orders.cancel", payload=b"x", **kw):
    return Message(seq=0, store_ms=0, deliver_at_ms=due, msg_id=f"m{i}", subject=subject, payload=payload, **kw)


@dataclass
class Accepted:
    seq: int
    deliver_at_ms: int
    duplicate: bool


def per_message(res) -> list:
    """A batch answer as one Accepted or exception per message (what a producer sees)."""
    return [Accepted(int(res.seqs[i]), int(res.deliver_at_ms[i]), bool(res.duplicates[i])) if res.codes[i] == 0
            else status.from_code(int(res.codes[i]), res.errors.get(i, "")) for i in range(res.n)]


def fire(store, now):
    """poll_due and acknowledge everything: the ids fired, in order."""
    ids = []
    for d in store.poll_due(now_ms=now):
        assert (d.batch.effective_ms <= now).all()
        ids += d.batch.id_list()
        store.ack_dispatched(d.unit, np.arange(d.batch.n), now_ms=now)
    return ids


class Harness:
    """Drives a store like the service does, with time passed in."""

    def __init__(self, path, settings=SMALL, now=T0):
        self.path = path
        self.settings = settings
        self.now = now
        self.store = DelayStore.open(path, settings, now_ms=now)
        self.delivered: list[str] = []
        self.sent = 0  # messages sent so far (``model_step`` numbers ids from it)

    def send(self, msgs):
        res = self.store.accept(msgs, now_ms=self.now)
        self.store.flush_messages()
        self.store.iterate(limit=None)
        return per_message(res)

    def run_until(self, t, step=10):
        while self.now < t:
            self.now = min(t, self.now + step)
            self.delivered += fire(self.store, self.now)

    def cancel(self, msg_id: str) -> None:
        """Cancel now, the tombstone durable and filed (what a model-driven test steps through)."""
        self.store.cancel(msg_id, now_ms=self.now)
        self.store.flush_messages()
        self.store.iterate(limit=None)

    def run_forgetting(self, t, pending: dict, step=10) -> None:
        """``run_until(t)``, then drop every delivered id from the model's ``pending``."""
        self.run_until(t, step=step)
        for mid in self.delivered:
            pending.pop(mid, None)

    def model_step(self, op: str, x: int, model: dict, batch_of, value_of) -> None:
        """One step of a model-driven test: ``send`` the batch ``batch_of(x, first_index)``
        (its messages into ``model`` as ``value_of(msg)``), ``cancel`` one of the model's ids,
        ``run`` forward (delivered ids leave the model), ``checkpoint``, ``restart`` or
        ``crash``. The model holds every message neither delivered nor cancelled."""
        if op == "send":
            batch = batch_of(x, self.sent)
            self.sent += len(batch)
            self.send(batch)
            model.update({m.msg_id: value_of(m) for m in batch})
        elif op == "cancel" and model:
            mid = sorted(model)[x % len(model)]
            self.cancel(mid)
            del model[mid]
        elif op == "run":
            self.run_forgetting(self.now + x % 200_000, model, step=997)
        elif op == "checkpoint":
            self.store.checkpoint()
        elif op == "restart":
            self.restart()
        elif op == "crash":
            self.crash()

    def crash(self):
        """Reopen without close(): whatever was written is in the page cache, as after a kill."""
        self.store = DelayStore.open(self.path, self.settings, now_ms=self.now)

    def restart(self):
        self.store.close()
        self.store = DelayStore.open(self.path, self.settings, now_ms=self.now)


def test_delivers_each_message_at_its_time_in_order(tmp_path):
    h = Harness(tmp_path)
    rnd = random.Random(3)
    dues = {f"m{i}": T0 + rnd.randrange(0, 10_000) for i in range(500)}
    h.send([msg(i, dues[f"m{i}"]) for i in range(500)])
    fired_at = {}
    while h.now < T0 + 11_000:
        h.now += 10
        for mid in fire(h.store, h.now):
            fired_at[mid] = h.now
    assert set(fired_at) == set(dues)
    for mid, t in fired_at.items():
        assert dues[mid] <= t < dues[mid] + 10  # fired within one poll step of its due time


def test_past_due_means_now(tmp_path):
    h = Harness(tmp_path)
    h.send([msg(1, T0 - 3_600_000)])
    h.run_until(T0 + 10)
    assert h.delivered == ["m1"]


def test_restart_delivers_pending_and_never_redelivers_dispatched(tmp_path):
    h = Harness(tmp_path)
    h.send([msg(i, T0 + 100 * i) for i in range(100)])
    h.run_until(T0 + 5_000)
    first = list(h.delivered)
    assert first == [f"m{i}" for i in range(51)]
    h.crash()
    h.run_until(T0 + 20_000)
    assert h.delivered[len(first):] == [f"m{i}" for i in range(51, 100)]


def test_crash_before_checkpoint_replays_without_duplicates(tmp_path):
    h = Harness(tmp_path)
    h.send([msg(i, T0 + 2_000 + i) for i in range(50)])
    h.store.checkpoint()
    h.send([msg(i, T0 + 2_000 + i) for i in range(50, 80)])  # filed, not checkpointed
    h.crash()
    h.run_until(T0 + 5_000)
    assert sorted(h.delivered) == sorted(f"m{i}" for i in range(80))
    assert len(h.delivered) == 80


def test_long_delays_cross_buckets(tmp_path):
    h = Harness(tmp_path)
    h.send([msg(1, T0 + 3 * 3_600_000 + 5), msg(2, T0 + 3_599_999), msg(3, T0 + 3_600_000)])
    h.restart()
    h.run_until(T0 + 3 * 3_600_000 + 100, step=1000)
    assert h.delivered == ["m2", "m3", "m1"]


def test_cancel_before_and_after_due(tmp_path):
    h = Harness(tmp_path)
    h.send([msg(1, T0 + 500), msg(2, T0 + 600), msg(3, T0 + 30_000)])
    h.run_until(T0 + 100)  # m1, m2 are in the wheel window now
    assert h.store.cancel("m1", now_ms=h.now) > 0
    assert h.store.cancel("m3", now_ms=h.now) > 0  # still on disk only
    h.store.flush_messages()
    h.store.iterate(limit=None)
    assert h.store.lookup("m1").status == "cancelled"
    h.run_until(T0 + 1_000)
    assert h.delivered == ["m2"]
    with pytest.raises(TooLate):
        h.store.cancel("m2", now_ms=h.now)
    with pytest.raises(NotFound):
        h.store.cancel("nope", now_ms=h.now)
    h.crash()  # tombstones survive a restart
    h.run_until(T0 + 40_000, step=100)
    assert h.delivered == ["m2"]
    assert h.store.lookup("m2").status == "dispatched"
    assert h.store.lookup("m3").status == "cancelled"


def test_cancel_of_unfiled_message(tmp_path):
    h = Harness(tmp_path)
    h.store.accept([msg(1, T0 + 200)], now_ms=h.now)
    assert h.store.lookup("m1").status == "pending"
    h.store.cancel("m1", now_ms=h.now)  # before the iterator filed it
    h.store.flush_messages()
    h.store.iterate(limit=None)
    h.run_until(T0 + 1_000)
    assert h.delivered == []


def test_idempotent_ids(tmp_path):
    h = Harness(tmp_path)
    (a,) = h.send([msg(1, T0 + 100)])
    (b,) = h.send([msg(1, T0 + 100)])
    assert b.duplicate and b.seq == a.seq
    (c,) = h.send([msg(1, T0 + 200)])
    assert isinstance(c, AlreadyExists)
    h.run_until(T0 + 1000)
    (d,) = h.send([msg(1, T0 + 100)])  # resend after dispatch: still a duplicate, not a second delivery
    assert d.duplicate
    h.run_until(T0 + 2000)
    assert h.delivered == ["m1"]


def test_resending_a_cancelled_id_says_it_was_cancelled(tmp_path):
    h = Harness(tmp_path)
    h.send([msg(1, T0 + 60_000), msg(2, T0 + 60_000)])
    h.store.cancel("m1", now_ms=h.now)
    (same,) = h.send([msg(1, T0 + 60_000)])  # unfiled tombstone
    assert isinstance(same, AlreadyExists)
    assert str(same) == "id 'm1' was cancelled; a cancelled id cannot be reused"
    h.store.iterate(limit=None)
    (other,) = h.send([msg(1, T0 + 90_000, payload=b"y")])  # filed tombstone, other content
    assert "was cancelled" in str(other)
    (reused,) = h.send([msg(2, T0 + 90_000)])  # a live message's id: still "used for another message"
    assert str(reused) == "id 'm2' was used for another message"


def test_horizon_is_exact_and_named(tmp_path):
    horizon = SMALL.limits.delay_horizon_ms
    h = Harness(tmp_path)
    at, over = per_message(h.store.accept([msg(1, T0 + horizon), msg(2, T0 + horizon + 1)], now_ms=h.now))
    assert isinstance(at, Accepted) and isinstance(over, InvalidArgument)
    assert str(over) == ("invalid request: deliver_at_ms: 63244800001 ms (732.000 days) ahead is beyond the delay "
                         "horizon, delay_horizon_ms = 63244800000 ms (732 days)")


def test_retry_of_a_relative_delay_is_a_duplicate(tmp_path):
    # delay_ms=5000 sent at T0 and retried 700 ms later: the absolute time moved with the arrival
    h = Harness(tmp_path)
    (a,) = h.send([msg(7, h.now + 5000)])
    h.now += 700
    (b,) = h.send([msg(7, h.now + 5000)])
    assert b.duplicate and b.seq == a.seq
    (c,) = h.send([msg(7, h.now + 6000)])  # another delay: a different message
    assert isinstance(c, AlreadyExists)


def test_bad_input_changes_nothing(tmp_path):
    h = Harness(tmp_path)
    end = h.store.messages.end_offset
    res = per_message(h.store.accept([msg(1, T0, subject=""), msg(2, T0, payload=b"x" * 2000),
                                      msg(3, T0 + 10 ** 12), Message(0, 0, T0, "bad id", "s")], now_ms=h.now))
    assert [type(r) for r in res] == [InvalidArgument, PayloadTooLarge, InvalidArgument, InvalidArgument]
    assert h.store.messages.end_offset == end
    (ok,) = h.send([msg(5, T0 + 10)])
    assert ok.seq > 0


def test_seq_never_reused_across_restarts(tmp_path):
    h = Harness(tmp_path)
    (a,) = h.send([msg(1, T0 + 10)])
    h.crash()
    (b,) = h.send([msg(2, T0 + 10)])
    h.restart()
    (c,) = h.send([msg(3, T0 + 10)])
    assert a.seq < b.seq < c.seq


def test_message_arriving_after_its_second_was_dispatched_survives_a_crash(tmp_path):
    h = Harness(tmp_path)
    h.run_until(T0 + 2_000)
    h.store.checkpoint()  # persisted completed_ms is now about T0 + 2000
    h.send([msg(1, T0 + 500)])  # due in an already dispatched second
    h.crash()
    h.run_until(T0 + 3_000)
    assert h.delivered == ["m1"]


def test_in_flight_message_is_redelivered_after_crash(tmp_path):
    h = Harness(tmp_path)
    h.send([msg(1, T0 + 100)])
    h.now = T0 + 200
    (d,) = h.store.poll_due(now_ms=h.now)  # fired, never acknowledged by the real-time side
    assert d.batch.id_list() == ["m1"]
    h.store.checkpoint()
    h.crash()
    h.run_until(T0 + 1_000)
    assert h.delivered == ["m1"]


def test_restart_after_long_downtime_catches_up(tmp_path):
    h = Harness(tmp_path)
    h.send([msg(i, T0 + i * 60_000) for i in range(60)])  # one a minute for an hour
    h.restart()
    h.now = T0 + 2 * 3_600_000  # the node was down for two hours
    h.store = DelayStore.open(tmp_path, SMALL, now_ms=h.now)
    got = []
    for _ in range(100):
        got += fire(h.store, h.now)
        if len(got) == 60:
            break
    assert got == [f"m{i}" for i in range(60)]


def test_pending_by_bucket_counts_survive_restart_and_crash(tmp_path):
    s = StoreSettings(message_segment_bytes=1 << 16, dispatch_segment_bytes=1 << 14, schedule_segment_bytes=1 << 16,
                      id_slots=256, id_entries_max=4096, bucket_ms=10_000)
    h = Harness(tmp_path, settings=s)
    # 30 in the first bucket (due 1..3 s), 20 in the next one
    h.send([msg(i, T0 + 1000 + i * 60) for i in range(30)] + [msg(100 + i, T0 + 12_000 + i) for i in range(20)])
    b0, b1 = T0 - T0 % 10_000, T0 - T0 % 10_000 + 10_000
    assert h.store.pending_by_bucket() == {b0: 30, b1: 20}
    h.store.cancel("m100", now_ms=h.now)
    h.store.flush_messages()
    h.store.iterate(limit=None)
    assert h.store.pending_by_bucket() == {b0: 30, b1: 19}
    h.run_until(T0 + 1000 + 15 * 60)  # m0..m15 fired
    assert h.store.pending_by_bucket() == {b0: 14, b1: 19}
    h.store.checkpoint()
    h.crash()
    assert h.store.pending_by_bucket() == {b0: 14, b1: 19}
    h.restart()
    assert h.store.pending_by_bucket() == {b0: 14, b1: 19}
    h.run_until(T0 + 13_000)
    assert h.store.pending_by_bucket() == {}


def test_one_frame_per_batch_and_one_schedule_frame_per_second(tmp_path):
    h = Harness(tmp_path)
    h.send([msg(i, T0 + 1_005 + 1_000 * (i // 4)) for i in range(8)])  # four due at once in each of two seconds
    assert sum(1 for _ in h.store.messages.iterate()) == 1
    frames = h.store.schedule.load_second((T0 + 1_000) // 1000) + h.store.schedule.load_second((T0 + 2_000) // 1000)
    assert sorted(f.batch.n for f in frames) == [4, 4]
    h.run_until(T0 + 3_000)
    assert h.delivered == [f"m{i}" for i in range(8)]
    assert sum(1 for _ in h.store.dispatch.iterate()) == 2  # one record per group fired together


def test_release_gives_messages_back_and_partial_acks_settle_once(tmp_path):
    h = Harness(tmp_path)
    h.send([msg(i, T0 + 100) for i in range(4)])
    h.now = T0 + 100
    (d,) = h.store.poll_due(now_ms=h.now)
    assert h.store.inflight == 4
    assert h.store.ack_dispatched(d.unit, np.array([0, 1]), now_ms=h.now) == 2
    assert h.store.ack_dispatched(d.unit, np.array([1]), now_ms=h.now) == 0  # settled already
    h.store.release(d.unit, np.array([2, 3]))
    assert h.store.inflight == 0
    h.run_until(T0 + 200)
    assert sorted(h.delivered) == ["m2", "m3"]
    assert h.store.lookup("m0").status == "dispatched"


def test_duplicate_id_inside_one_batch_is_refused(tmp_path):
    h = Harness(tmp_path)
    a, b = h.send([msg(1, T0 + 100), msg(1, T0 + 100)])
    assert a.seq > 0 and isinstance(b, AlreadyExists)


def test_message_and_its_cancel_filed_in_one_round_never_fire(tmp_path):
    # accepted and cancelled before the iterator ran: both batches are filed together
    h = Harness(tmp_path)
    h.run_until(T0 + 50)
    h.store.accept([msg(1, T0 + 300), msg(2, T0 + 300)], now_ms=h.now)
    h.store.cancel("m1", now_ms=h.now)
    h.store.flush_messages()
    assert h.store.iterate(limit=None) == 3
    h.run_until(T0 + 1_000)
    assert h.delivered == ["m2"]


def test_a_busy_second_loads_a_few_frames_per_poll_and_keeps_what_is_filed_meanwhile(tmp_path):
    """A second of many frames is merged LOAD_STEP_FRAMES at a time over several polls (no
    one long stall of the event loop); messages and cancels filed into it while it loads are
    still taken: everything fires once, in due order, the cancelled message never."""
    from node.delay.store import LOAD_STEP_FRAMES

    h = Harness(tmp_path)
    due = T0 + 10_000
    n = LOAD_STEP_FRAMES * 2 + 20
    for i in range(n):  # one frame each
        h.send([msg(i, due + (i * 7) % 1000)])
    h.run_until(due - 500 + 10)  # the first poll inside the window: the load has started, not finished
    assert h.store._loading is not None and h.store._loading.second == due // 1000
    assert (due // 1000) * 1000 >= h.store.wheel.loaded_until_ms  # not in the wheel yet
    h.send([msg(n, due + 3), msg(n + 1, due + 999)])  # filed into the second while it loads
    assert h.store.cancel("m5", now_ms=h.now) > 0
    h.store.flush_messages()
    h.store.iterate(limit=None)
    h.run_until(due - 500 + 40)
    assert h.store._loading is None and h.store.wheel.loaded_until_ms > due
    h.run_until(due + 1_000)
    expected = sorted((d, f"m{i}") for i, d in [*((i, due + (i * 7) % 1000) for i in range(n)),
                                                 (n, due + 3), (n + 1, due + 999)] if i != 5)
    assert sorted(h.delivered) == sorted(i for _, i in expected) and len(h.delivered) == len(expected)
    dues = {i: d for d, i in expected}
    p0 = due - 500 + 40  # polls every 10 ms from here on: a message fires at the first poll at or after its due time
    polls = [-(-(dues[i] - p0) // 10) for i in h.delivered]
    assert polls == sorted(polls)  # in due order, up to the messages of one poll (one dispatch round)


def test_a_cancel_holds_while_its_tombstone_is_not_filed_yet(tmp_path):
    """Chaos run starved-kills seed 19 (issue 26): a cancel answered OK, then the message was
    delivered anyway. On a starved master filing lags: the message's second was loaded into
    the wheel after the cancel was answered but before its tombstone was filed, so the load
    did not see the tombstone (and the wheel's cancel had nothing to cancel yet)."""
    h = Harness(tmp_path)
    h.send([msg(1, T0 + 30_000), msg(2, T0 + 30_100)])   # filed, far outside the wheel's window
    h.store.iterate(limit=None)
    assert h.store.cancel("m1", now_ms=h.now) > 0        # the tombstone is appended, not filed
    h.store.flush_messages()
    fired = fire(h.store, T0 + 31_000)                   # the second loads and fires before any filing
    assert fired == ["m2"]
    h.store.iterate(limit=None)
    assert h.store.lookup("m1").status == "cancelled"
    assert fire(h.store, T0 + 32_000) == []


def test_polling_only_when_the_wheel_asks_fires_every_message_at_its_due_time(tmp_path):
    """Issue 28: the shell sleeps until ``wheel_wake_ms`` (at most a second), not a tick at a
    time. Driven that way, with seconds to load far ahead of the first load, every message
    fires at a poll at its own due time, and the wheel never asks for fewer than a few polls
    a second while nothing is due."""
    h = Harness(tmp_path)
    rnd = random.Random(28)
    dues = {f"m{i}": T0 + rnd.randrange(0, 8_000) for i in range(300)}
    dues["late"] = T0 + 7_000  # filed after the wheel loaded its second
    h.send([msg(i, dues[f"m{i}"]) for i in range(300)])
    fired_at, polls, t, late_sent = {}, 0, T0, False
    while t < T0 + 12_000 and polls < 10_000:
        if t >= T0 + 6_500 and not late_sent:  # its second is loaded by now: it goes into the wheel
            h.now, late_sent = t, True
            h.send([Message(seq=0, store_ms=0, deliver_at_ms=dues["late"], msg_id="late", subject="s", payload=b"")])
        for mid in fire(h.store, t):
            fired_at[mid] = t
        polls += 1
        wake = h.store.wheel_wake_ms()
        t = min(t + 1000, max(t + 1, wake if wake is not None else t + 1000))
    assert set(fired_at) == set(dues)
    assert all(fired_at[m] == dues[m] for m in dues)  # each at a poll at its due time, none early
    assert polls < 300 + 12 * 3  # about one poll per due time plus the seconds to load


def test_checkpoint_key_moves_with_writes_not_with_the_clock(tmp_path):
    h = Harness(tmp_path)
    h.send([msg(1, T0 + 500), msg(2, T0 + 3_600_000)])
    h.store.checkpoint()
    rest = h.store.checkpoint_key()
    h.run_until(T0 + 400)  # time passes, nothing due: only completed_ms moves
    assert h.store.checkpoint_key() == rest
    h.run_until(T0 + 600)  # m1 dispatched
    assert h.delivered == ["m1"]
    assert h.store.checkpoint_key() != rest
    dispatched = h.store.checkpoint_key()
    h.send([msg(3, T0 + 7_200_000)])
    assert h.store.checkpoint_key() != dispatched
