"""Failover at the storage level, deterministic: a master DelayStore and a follower fed by
byte copies of its message and dispatch logs plus its checkpoints (what the replication
stream carries), the master killed at a seeded moment, the follower promoted.

Checks: every message acknowledged by the master (and replicated: sync mode) and not
cancelled is delivered by the master before the kill or by the promoted follower after
it; the follower's logs are byte-identical prefixes of the master's; duplicates are
counted and come only from the window just before the kill; a divergent suffix is
truncated and voided.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from cluster.errors import NotFound, TooLate
from node.delay.store import DelayStore, StoreSettings
from node.store.records import Limits, Message

T0 = 1_800_000_000_000
S = StoreSettings(message_segment_bytes=1 << 16, dispatch_segment_bytes=1 << 13, schedule_segment_bytes=1 << 16,
                  id_slots=256, id_entries_max=1 << 14, bucket_ms=10_000, limits=Limits(payload_bytes_max=1024))


def ship(src, dst, log_name):
    a, b = getattr(src, log_name), getattr(dst, log_name)
    while b.end_offset < a.end_offset:
        data = a.read_bytes(b.end_offset, 8192)
        b.append_raw(b.end_offset, data)
    b.flush()


def replicate(master: DelayStore, follower: DelayStore) -> None:
    ship(master, follower, "messages")
    ship(master, follower, "dispatch")
    follower.appended()
    follower.follow(master.replication_doc())  # what a fetch answer carries
    follower.iterate(limit=None)


@pytest.mark.parametrize("in_place", [True, False], ids=["promote", "reopen"])
@pytest.mark.parametrize("seed", range(12))
def test_promoted_follower_delivers_everything_acknowledged(tmp_path, seed, in_place):
    rnd = random.Random(seed)
    now = T0
    m = DelayStore.open(tmp_path / "m", S, now_ms=now)
    f = DelayStore.open(tmp_path / "f", S, now_ms=now, follower=True)
    f.follow()
    acked: dict[str, int] = {}
    cancelled: dict[str, int] = {}  # id -> the seq its cancel answered
    delivered: list[str] = []
    kill_at = T0 + rnd.randint(2_000, 12_000)
    inflight = []
    i = 0
    while now < kill_at:
        now += 10
        if rnd.random() < 0.5:
            batch = [Message(seq=0, store_ms=0, deliver_at_ms=now + rnd.randint(-3000, 8000), msg_id=f"k{i + j}",
                             subject="s", payload=b"p") for j in range(rnd.randint(1, 5))]
            i += len(batch)
            m.accept(batch, now_ms=now)
            m.flush_messages()
            if rnd.random() < 0.7:  # sync mode: acknowledged once the follower holds the bytes
                replicate(m, f)
                acked.update({b.msg_id: b.deliver_at_ms for b in batch})
        if acked and rnd.random() < 0.05:
            victim = rnd.choice(sorted(acked))
            # the model: a message handed to the real-time side (in flight or delivered) is too
            # late to cancel; anything else cancels, a second time with the first answer
            handed = set(delivered).union(*(d.batch.id_list() for d in inflight))
            if victim in handed:
                with pytest.raises(TooLate):
                    m.cancel(victim, now_ms=now)
            else:
                seq = m.cancel(victim, now_ms=now)
                assert m.lookup(victim).status == "cancelled"
                assert cancelled.setdefault(victim, seq) == seq  # idempotent
                m.flush_messages()
                replicate(m, f)
        m.iterate(limit=None)
        inflight += m.poll_due(now_ms=now)
        # the real-time side answers late and in pieces: messages stay in flight for a while
        if inflight and rnd.random() < 0.3:
            k = rnd.randint(1, len(inflight))
            done, inflight = inflight[:k], inflight[k:]
            for d in done:
                delivered += d.batch.id_list()
                m.ack_dispatched(d.unit, np.arange(d.batch.n), now_ms=now)
        if rnd.random() < 0.2:
            m.checkpoint()
        if rnd.random() < 0.3:
            replicate(m, f)  # the replication stream runs on its own schedule
    # the master dies here (its memory is gone); the follower's logs are prefixes of its logs
    for name in ("messages", "dispatch"):
        a, b = getattr(m, name), getattr(f, name)
        assert b.end_offset <= a.end_offset
        off = b.start_offset
        while off < b.end_offset:  # byte-identical prefix, record by record
            chunk = b.read_bytes(off, 1 << 16)
            assert a.read_bytes(off, len(chunk))[: len(chunk)] == chunk
            off += len(chunk)
    # promotion, possibly with a clock that is behind or ahead of the old master's: in place
    # (what a replicated node does) or by a close and an open as master (a restart)
    skew = rnd.choice([0, -1500, 1500])
    now += rnd.randint(50, 3000) + skew
    if in_place:
        epoch = f.epoch
        f.promote(now)
        p = f
        last = p.ids.last_seq()  # the old master's seqs, filed here: the new epoch is past them, bumped once
        assert not p.follower and p.epoch == max(epoch + 1, (last >> 40) + 1 if last >= 0 else 0)
    else:
        f.checkpoint()
        f.close()
        p = DelayStore.open(tmp_path / "f", S, now_ms=now)
    end = max(acked.values(), default=now) + 5000
    while now < end:
        now += 10
        p.iterate(limit=None)
        for d in p.poll_due(now_ms=now):
            assert (d.batch.effective_ms <= now).all()
            delivered += d.batch.id_list()
            p.ack_dispatched(d.unit, np.arange(d.batch.n), now_ms=now)
    lost = set(acked) - cancelled.keys() - set(delivered)
    assert not lost, f"seed {seed}: {len(lost)} acknowledged messages lost, e.g. {sorted(lost)[:5]}"
    after_cancel = [x for x in delivered if x in cancelled]  # by the master or the promoted follower
    assert not after_cancel, f"seed {seed}: delivered after an acknowledged cancel: {after_cancel[:5]}"
    dupes = len(delivered) - len(set(delivered))
    # duplicates only for messages due close to the kill (their dispatch records had not been replicated)
    assert dupes <= 60, dupes
    p.close()
    m.close()


def run_master(m: DelayStore, now: int, *, ticks: int, step_ms: int = 100) -> tuple[list[str], int]:
    """Run a master ``ticks`` steps: file, fire, acknowledge every dispatch; returns the ids it
    delivered and the time it reached."""
    got: list[str] = []
    for _ in range(ticks):
        now += step_ms
        m.iterate(limit=None)
        for d in m.poll_due(now_ms=now):
            got += d.batch.id_list()
            m.ack_dispatched(d.unit, np.arange(d.batch.n), now_ms=now)
    return got, now


def pair_with_two_accepted(tmp_path) -> tuple[int, DelayStore, DelayStore]:
    """A master that accepted and filed m0 and m1 (due in 1.5 s) and its slave, which holds
    nothing yet; returns (now, master, slave)."""
    now = T0
    a = DelayStore.open(tmp_path / "a", S, now_ms=now)
    b = DelayStore.open(tmp_path / "b", S, now_ms=now, follower=True)
    b.follow()
    accept_durable(a, "m", 2, now + 1500, now)
    a.iterate(limit=None)
    return now, a, b


def pair_with_two_filed(tmp_path) -> tuple[int, DelayStore, DelayStore]:
    """A master and its slave, both holding m0 and m1 (due in 1.5 s) filed where the master
    filed them; returns (now, master, slave)."""
    now, a, b = pair_with_two_accepted(tmp_path)
    a.checkpoint()
    replicate(a, b)
    return now, a, b


def accept_durable(m: DelayStore, prefix: str, n: int, due_ms: int, now: int) -> None:
    """Accept ``n`` messages ``{prefix}0..`` due at ``due_ms`` and make them durable (log + checkpoint)."""
    m.accept([Message(seq=0, store_ms=0, deliver_at_ms=due_ms, msg_id=f"{prefix}{i}", subject="s", payload=b"p")
              for i in range(n)], now_ms=now)
    m.flush_messages()
    m.checkpoint()


def test_divergent_suffix_is_truncated_and_voided(tmp_path):
    now = T0
    m = DelayStore.open(tmp_path / "m", S, now_ms=now)
    f = DelayStore.open(tmp_path / "f", S, now_ms=now, follower=True)
    f.follow()
    accept_durable(m, "a", 10, now + 5000, now)
    replicate(m, f)
    cut = f.messages.end_offset
    # the old master goes on alone: these records never reach the new master
    m.accept([Message(seq=0, store_ms=0, deliver_at_ms=now + 5000, msg_id=f"b{i}", subject="s", payload=b"p")
              for i in range(5)], now_ms=now)
    m.flush_messages()
    m.iterate(limit=None)
    m.checkpoint()
    assert m.lookup("b1").status == "pending"
    m.truncate_messages(cut)
    m.close()
    old = DelayStore.open(tmp_path / "m", S, now_ms=now)  # as a master again later
    assert old.messages.end_offset == cut
    with pytest.raises(NotFound):
        old.lookup("b1")
    assert old.lookup("a1").status == "pending"
    now += 6000
    got = [i for d in old.poll_due(now_ms=now) for i in d.batch.id_list()]
    assert sorted(got) == sorted(f"a{i}" for i in range(10))
    old.close()
    f.close()


def test_follower_truncated_then_promoted_in_place_never_delivers_the_voided_suffix(tmp_path):
    now = T0
    m = DelayStore.open(tmp_path / "m", S, now_ms=now)
    f = DelayStore.open(tmp_path / "f", S, now_ms=now, follower=True)
    f.follow()
    accept_durable(m, "a", 10, now + 5000, now)
    replicate(m, f)
    cut = f.messages.end_offset
    # a suffix the follower got from a master that then lost its seat: the next master never had it
    accept_durable(m, "b", 5, now + 5000, now)
    replicate(m, f)
    assert f.messages.end_offset > cut
    f.truncate_messages(cut)
    f.promote(now + 100)
    now += 6000
    got = [i for d in f.poll_due(now_ms=now) for i in d.batch.id_list()]
    assert sorted(got) == sorted(f"a{i}" for i in range(10))
    with pytest.raises(NotFound):
        f.lookup("b1")
    f.close()
    m.close()


def test_records_cut_and_fetched_again_are_delivered(tmp_path):
    """Issue 26's loss, at the storage level: a member cuts records that the new master also
    holds (the cut lands too early: the master's epoch history attributed them to an older
    term) and fetches the very same bytes again. The old rule voided "from the first cut seq
    to the end of its store epoch" and kept them voided once they were back in the log:
    lookup said "no message with id", and when that member became master again they never
    fired, although every member held them. Voiding now names exactly what the log lacks."""
    now = T0
    m = DelayStore.open(tmp_path / "m", S, now_ms=now)
    f = DelayStore.open(tmp_path / "f", S, now_ms=now, follower=True)
    f.follow()
    accept_durable(m, "a", 10, now + 5000, now)
    replicate(m, f)
    cut = f.messages.end_offset
    accept_durable(m, "b", 10, now + 5000, now)  # acknowledged: the slave below holds them too
    replicate(m, f)
    # the master is told to cut at ``cut`` (too early) and fetches the same bytes back from f
    m.truncate_messages(cut)
    ship(f, m, "messages")
    m.appended()
    m.iterate(limit=None)
    assert m.lookup("b3").status == "pending"
    m.close()
    again = DelayStore.open(tmp_path / "m", S, now_ms=now)  # master again later
    now += 6000
    got = [i for d in again.poll_due(now_ms=now) for i in d.batch.id_list()]
    assert sorted(got) == sorted([f"a{i}" for i in range(10)] + [f"b{i}" for i in range(10)])
    again.close()
    f.close()


def test_a_voided_range_covers_only_the_records_cut(tmp_path):
    """Seqs of the same store epoch after the cut suffix (issued later by a store reopened in
    that epoch, or another member's term in a colliding epoch) are not voided by it."""
    now = T0
    m = DelayStore.open(tmp_path / "m", S, now_ms=now)
    accept_durable(m, "a", 5, now + 5000, now)
    cut = m.messages.end_offset
    accept_durable(m, "b", 5, now + 5000, now)
    seqs = [m.lookup(f"b{i}").seq for i in range(5)]
    m.truncate_messages(cut)
    assert m.voided == [(min(seqs), max(seqs) + 1)]
    m.close()


def test_an_older_terms_record_fetched_after_a_cut_is_filed(tmp_path):
    """Chaos run meta-pause seed 3 (issue 26): a cancel's tombstone, written by the old master
    in its term (store epoch 2) and never replicated, survived on it; the other member had
    meanwhile been master (store epoch 3) and filed records of that term into the same
    bucket. When it cut those (divergent) and fetched the old master's tail, the tombstone's
    seq was below the bucket's and the id index's high-water marks: it was skipped. That
    member then answered the cancel's retry TOO_LATE ("dispatched") for a message that was
    cancelled and never delivered. Records below a cut's seqs are now checked one by one."""
    now = T0
    a = DelayStore.open(tmp_path / "a", S, now_ms=now)           # master, term 1
    b = DelayStore.open(tmp_path / "b", S, now_ms=now, follower=True)
    b.follow()
    accept_durable(a, "m", 3, now + 5000, now)
    replicate(a, b)
    cut = b.messages.end_offset
    a.cancel("m1", now_ms=now)                                   # the tail b never got
    a.flush_messages()
    a.iterate(limit=None)
    a.checkpoint()
    b.promote(now + 10, store_epoch=a.epoch + 5)                  # b's own term: newer seqs
    b.accept([Message(seq=0, store_ms=0, deliver_at_ms=now + 5000, msg_id=f"n{i}", subject="s", payload=b"p")
              for i in range(5)], now_ms=now + 10)
    b.flush_messages()
    b.iterate(limit=None)
    b.checkpoint()
    b.close()
    b = DelayStore.open(tmp_path / "b", S, now_ms=now + 20, follower=True)  # deposed: a follower of a
    b.follow()
    b.truncate_messages(cut)                                     # b's term never reached a
    ship(a, b, "messages")
    b.appended()
    b.follow(a.last_checkpoint)
    b.iterate(limit=None)
    assert b.lookup("m1").status == "cancelled"
    b.promote(now + 30, store_epoch=a.epoch + 10)
    with pytest.raises(NotFound):
        b.lookup("n1")
    now += 6000
    got = [i for d in b.poll_due(now_ms=now) for i in d.batch.id_list()]
    assert sorted(got) == ["m0", "m2"]
    a.close()
    b.close()


def test_a_dispatch_cut_brings_the_replicated_dispatch_offset_back(tmp_path):
    """Chaos meta-pause seeds 20 and 22 (issue 26): a follower cut its dispatch log's divergent
    suffix, but its tick state kept the old master's dispatch offset, past the cut; once the new
    master's bytes filled that range, the offset pointed into the middle of a record and the
    promotion failed ("header checksum mismatch"), as in the issue's evidence at 10:10:02."""
    now = T0
    f = DelayStore.open(tmp_path / "f", S, now_ms=now, follower=True)
    f.follow()
    f.dispatch.append([b"a" * 40, b"b" * 40, b"c" * 40])  # the old master's records, replicated
    f.dispatch.flush()
    end = f.dispatch.end_offset
    f.follow({"iterate_offset": f.iterate_offset, "completed_ms": now, "dispatch_offset": end})
    f.checkpoint()
    cut = 52  # after the first record: the rest was never the new master's
    f.truncate_dispatch(cut)
    assert f.replicated["dispatch_offset"] == cut
    f.close()
    again = DelayStore.open(tmp_path / "f", S, now_ms=now + 2000, follower=True)
    assert int(again.persisted_doc.get("dispatch_offset", 0)) <= cut  # the checkpoint says so too
    again.close()


def test_a_record_the_old_master_filed_behind_survives_two_failovers(tmp_path):
    """Chaos meta-pause seed 29 (issue 26, finding 8): one record, two effective times. The
    old master filed a past-due retry under its floor; the new master filed the same bytes at
    its promotion under the floor it restored, later. Its wheel then held the record at that
    later time, and the tick state it shipped passed the old master's time for it. When the old
    master was promoted again, it restored that tick state and took its own copy for delivered:
    neither member ever fired it."""
    now = T0
    a = DelayStore.open(tmp_path / "a", S, now_ms=now)           # master, term 1
    b = DelayStore.open(tmp_path / "b", S, now_ms=now, follower=True)
    b.follow()

    def ship_all(src, dst):
        for name in ("messages", "dispatch"):
            ship(src, dst, name)
        dst.appended()

    def answer(src, dst):  # one fetch answer: the bytes and the master's document with them
        ship_all(src, dst)
        dst.follow(src.replication_doc())
        dst.iterate(limit=None)

    accept_durable(a, "early", 3, now + 1000, now)
    answer(a, b)
    while now < T0 + 3000:  # a runs: fires, checkpoints, ships
        now += 100
        a.iterate(limit=None)
        for d in a.poll_due(now_ms=now):
            a.ack_dispatched(d.unit, np.arange(d.batch.n), now_ms=now)
        if now % 1000 == 500:  # checkpoints are rarer than answers: the live tick state runs ahead
            a.checkpoint()
        answer(a, b)
    # a retry of a message due a second ago: acknowledged once b holds its bytes (sync mode);
    # a files it under its floor, and dies before its next answer to b
    a.accept([Message(seq=0, store_ms=0, deliver_at_ms=now - 1000, msg_id="late0", subject="s", payload=b"p")],
             now_ms=now)
    a.flush_messages()
    ship_all(a, b)
    a.iterate(limit=None)
    now += 100
    b.promote(now, store_epoch=a.epoch + 1)                      # b's term
    b.iterate(limit=None)
    fired = b.poll_due(now_ms=now)                               # in flight, never answered (b is fenced)
    assert [i for d in fired for i in d.batch.id_list()] == ["late0"]
    a.close()
    a = DelayStore.open(tmp_path / "a", S, now_ms=now, follower=True)  # a restarts as b's slave
    a.follow()
    for _ in range(3):
        now += 100
        b.poll_due(now_ms=now)
        answer(b, a)
    b.close()                                                    # b dies with the record in flight
    now += 100
    a.promote(now, store_epoch=b.epoch + 1)
    got, now = run_master(a, now, ticks=30)
    assert got == ["late0"]
    a.close()


def test_a_cancel_reaches_a_copy_filed_in_another_second(tmp_path):
    """A tombstone is filed in the second of its message's effective time on the member that
    answered the cancel. A slave that filed the message later, under a higher floor (the
    master had cancelled it, so its tick state passed it), holds the message in another
    second: the tombstone must still meet it when the promoted slave loads that second."""
    now, a, b = pair_with_two_accepted(tmp_path)
    a.cancel("m0", now_ms=now + 100)
    a.flush_messages()
    while now < T0 + 3000:  # the master moves past the cancelled message; its slave lags
        now += 100
        a.iterate(limit=None)
        for d in a.poll_due(now_ms=now):
            a.ack_dispatched(d.unit, np.arange(d.batch.n), now_ms=now)
        a.checkpoint()
    assert a.completed_ms > T0 + 1500
    for name in ("messages", "dispatch"):
        ship(a, b, name)
    b.appended()
    b.follow(a.replication_doc())
    b.iterate(limit=None)                                        # m0, its tombstone and m1 at once
    assert b.lookup("m0").status == "cancelled"
    a.close()
    now += 100
    b.promote(now, store_epoch=a.epoch + 1)
    got, now = run_master(b, now, ticks=30)
    # m0 was cancelled. m1 was delivered by the master; the slave filed it after that under a
    # higher floor, so its dispatch record is before the restored dispatch offset: a duplicate
    assert "m0" not in got and got.count("m1") <= 1
    b.close()


# seeds 12 and 43 found finding 8 (the live tick state shipped), 82 the tombstone filed in another
# second than its message; HOURGLASS_SIM_SEEDS=N runs seeds 0..N-1 instead (docs/testing.md)
SIM_SEEDS = (range(int(os.environ["HOURGLASS_SIM_SEEDS"])) if os.environ.get("HOURGLASS_SIM_SEEDS")
             else [*range(8), 12, 43, 82])


@pytest.mark.parametrize("seed", SIM_SEEDS)
def test_terms_that_alternate_lose_nothing_acknowledged(tmp_path, seed):
    """Two members whose roles alternate over several terms, the seeded schedule of a paused
    master: fetch answers (bytes and the master's document) at their own times, checkpoints,
    late retries of what was not acknowledged, cancels, deliveries that stay in flight. At each
    failover the slave is promoted with what it holds; the deposed master checkpoints, reopens
    as the slave and cuts the suffix the new master never had (what its role loop does).

    Checks: every acknowledged message is delivered unless a cancel of it was tried (one not
    answered may still take effect); nothing is delivered after its cancel was acknowledged."""
    rnd = random.Random(1000 + seed)
    kill_rnd = random.Random(seed)  # apart from rnd: the seeds named above keep their schedule
    now = T0
    roots = [tmp_path / "x", tmp_path / "y"]
    master = DelayStore.open(roots[0], S, now_ms=now)
    slave = DelayStore.open(roots[1], S, now_ms=now, follower=True)
    slave.follow()
    acked: dict[str, int] = {}
    unacked: dict[str, int] = {}   # sent, never acknowledged: the producer retries them
    cancel_acked: dict[str, int] = {}  # id -> when its cancel was acknowledged
    cancel_tried: set[str] = set()
    delivered: dict[str, list[int]] = {}
    handed: set[str] = set()  # delivered or in flight at some master
    inflight: list = []
    n = 0
    epoch_next = 10
    short_term = False

    def answer():
        if rnd.random() < 0.2:  # a slave catching up: one chunk of the message log, not all of it
            lg, dst = master.messages, slave.messages
            if dst.end_offset < lg.end_offset:
                dst.append_raw(dst.end_offset, lg.read_bytes(dst.end_offset, rnd.randint(1, 600)))
                dst.flush()
        else:
            for name in ("messages", "dispatch"):
                ship(master, slave, name)
        slave.appended()
        slave.follow(master.replication_doc())

    for _term in range(rnd.randint(4, 10)):
        term_end = now + rnd.randint(200, 2_500)
        if short_term:
            term_end = now + 10
        # from here on the master is fenced (its lease in doubt): what it fires stays in flight,
        # while its slave keeps fetching bytes and tick state from it
        fenced_at = term_end - rnd.choice([0, rnd.randint(0, 1_000)])
        while now < term_end:
            now += 10
            r = rnd.random()
            if r < 0.3:  # a send: new messages, or a retry of unacknowledged ones
                if unacked and rnd.random() < 0.4:
                    ids = rnd.sample(sorted(unacked), min(len(unacked), rnd.randint(1, 4)))
                else:
                    ids = [f"k{n + j}" for j in range(rnd.randint(1, 5))]
                    n += len(ids)
                    unacked.update({i: now + rnd.randint(-2_000, 3_000) for i in ids})
                res = master.accept([Message(seq=0, store_ms=0, deliver_at_ms=unacked[i], msg_id=i, subject="s",
                                             payload=b"p") for i in ids], now_ms=now)
                master.flush_messages()
                if rnd.random() < 0.7:  # sync mode: answered OK once the slave holds the bytes
                    answer()
                if slave.messages.end_offset >= master.messages.end_offset:
                    for i, code in zip(ids, res.codes.tolist()):
                        if code == 0:
                            acked[i] = unacked.pop(i)
            elif r < 0.33 and acked:
                victim = rnd.choice(sorted(acked))
                try:
                    master.cancel(victim, now_ms=now)
                except TooLate:
                    pass
                else:
                    cancel_tried.add(victim)  # unanswered, it may still take effect
                    master.flush_messages()
                    if rnd.random() < 0.7:
                        answer()
                    if slave.messages.end_offset >= master.messages.end_offset:
                        cancel_acked.setdefault(victim, now)
            if rnd.random() < 0.8:
                master.iterate(limit=None)
            if rnd.random() < 0.9:
                due = master.poll_due(now_ms=now)
                inflight += due
                handed.update(i for d in due for i in d.batch.id_list())
            if inflight and now < fenced_at and rnd.random() < 0.3:
                k = rnd.randint(1, len(inflight))
                done, inflight = inflight[:k], inflight[k:]
                for d in done:
                    for i in d.batch.id_list():
                        delivered.setdefault(i, []).append(now)
                    master.ack_dispatched(d.unit, np.arange(d.batch.n), now_ms=now)
            if rnd.random() < 0.03:
                master.checkpoint()
            if rnd.random() < 0.3:
                answer()
            if rnd.random() < 0.2:
                slave.iterate(limit=None)
        # failover: the master is paused (its in-flight deliveries never answered), the slave wins
        inflight = []
        cut = {name: getattr(slave, name).end_offset for name in ("messages", "dispatch")}
        now += rnd.randint(50, 1_500)
        epoch_next += 5
        slave.promote(now, store_epoch=epoch_next)
        if kill_rnd.random() < 0.5:  # SIGKILLed: it reopens from what its files hold, no close()
            master.checkpoint()
            master.close()
        roots.reverse()  # roots[0] is the master's folder
        master = slave
        slave = DelayStore.open(roots[1], S, now_ms=now, follower=True)
        slave.follow()
        slave.truncate_dispatch(cut["dispatch"])
        slave.truncate_messages(cut["messages"])
        short_term = kill_rnd.random() < 0.2
        if not short_term:
            answer()
        # else the new master dies before its first answer, the next term is one step: the
        # deposed master may be promoted again with only its own tick state (chaos seed 18)
    # the last master runs until everything acknowledged is due, answers everything it fires
    end = max(list(acked.values()) + [now]) + 5_000
    while now < end:
        now += 10
        master.iterate(limit=None)
        for d in master.poll_due(now_ms=now):
            for i in d.batch.id_list():
                delivered.setdefault(i, []).append(now)
            master.ack_dispatched(d.unit, np.arange(d.batch.n), now_ms=now)
    lost = sorted(set(acked) - cancel_tried - delivered.keys())
    assert not lost, f"seed {seed}: {len(lost)} acknowledged messages lost, e.g. {lost[:5]}"
    late = sorted(i for i, t in cancel_acked.items() if any(d > t for d in delivered.get(i, [])))
    assert not late, f"seed {seed}: delivered after an acknowledged cancel: {late[:5]}"
    master.close()
    slave.close()


def test_a_tick_state_is_taken_only_with_the_bytes_it_rests_on(tmp_path):
    """Chaos meta-pause seed 7 (issue 26): the master cancelled a message (its tombstone not
    replicated yet, so the cancel was never acknowledged) and its checkpoint passed the
    message's time. A slave catching up after a restart took that tick state with the first
    chunk of bytes, before it held the tombstone; the master died, the slave was promoted and
    took the message for delivered. A slave now takes a tick state only once it holds the
    master's log up to where it was when the state was taken."""
    now, a, b = pair_with_two_filed(tmp_path)
    before_cancel = a.messages.end_offset
    a.cancel("m0", now_ms=now + 100)
    a.flush_messages()
    while now < T0 + 3000:  # the master moves past the message it cancelled
        now += 100
        a.iterate(limit=None)
        for d in a.poll_due(now_ms=now):
            a.ack_dispatched(d.unit, np.arange(d.batch.n), now_ms=now)
        a.checkpoint()
    assert a.replication_doc()["completed_ms"] > T0 + 1500
    # b catches up in chunks: the answer that carries the tick state ends before the tombstone
    while b.messages.end_offset < before_cancel:
        data = a.messages.read_bytes(b.messages.end_offset, before_cancel - b.messages.end_offset)
        b.messages.append_raw(b.messages.end_offset, data)
    b.messages.flush()
    ship(a, b, "dispatch")
    b.appended()
    b.follow(a.replication_doc())
    a.close()  # the master dies; its cancel was never acknowledged
    now += 100
    b.promote(now, store_epoch=a.epoch + 1)
    got, now = run_master(b, now, ticks=30)
    assert "m0" in got  # acknowledged, and its cancel never was: it must be delivered
    b.close()


def test_a_cut_tombstone_brings_the_replicated_tick_state_back_below_its_message(tmp_path):
    """The tick state a slave took from a master that then lost its term may rest on a
    tombstone of the suffix the new master never had; when that suffix is cut, the message
    (before the cut) is due again at a promotion."""
    now, a, b = pair_with_two_filed(tmp_path)
    cut = a.messages.end_offset
    a.cancel("m0", now_ms=now + 100)
    a.flush_messages()
    while now < T0 + 3000:
        now += 100
        a.iterate(limit=None)
        for d in a.poll_due(now_ms=now):
            a.ack_dispatched(d.unit, np.arange(d.batch.n), now_ms=now)
        a.checkpoint()
    replicate(a, b)                       # b holds the tombstone and the tick state past m0
    assert b.replicated["completed_ms"] > T0 + 1500
    b.truncate_messages(cut)              # the new master never had the tombstone
    assert b.replicated["completed_ms"] <= T0 + 1500
    b.close()
    again = DelayStore.open(tmp_path / "b", S, now_ms=now, follower=True)
    assert int(again.replicated["completed_ms"]) <= T0 + 1500  # persisted
    again.close()
    a.close()


def test_a_tick_state_offset_inside_a_dispatch_record_starts_at_that_record(tmp_path):
    """Chaos meta-pause seed 28 (issue 26): a promotion failed with "corrupt record ... in
    dispatch/ ... header checksum mismatch": the replicated tick state's dispatch offset was
    the old master's, and this member's dispatch log held other bytes there (its own divergent
    suffix, not cut yet), so the offset fell inside a record. The wheel is now restored from the
    record that holds that offset: its messages were delivered, and are not delivered again."""
    now, a, b = pair_with_two_filed(tmp_path)
    got, now = run_master(a, now, ticks=20)
    assert sorted(got) == ["m0", "m1"]  # one dispatch record holds both
    a.checkpoint()
    replicate(a, b)
    assert b.dispatch.end_offset > 8
    # a tick state from before the delivery, with a dispatch offset inside that record
    b.follow({"iterate_offset": b.iterate_offset, "completed_ms": T0, "dispatch_offset": 5, "log_end": 0})
    b.checkpoint()
    assert not b.dispatch.is_boundary(5) and b.dispatch.boundary_at_or_before(5) == 0
    b.promote(now, store_epoch=a.epoch + 1)
    again, now = run_master(b, now, ticks=30)
    assert again == []  # delivered by the record it starts at
    b.close()
    a.close()


def test_a_record_boundary_at_or_before_any_offset(tmp_path):
    """``boundary_at_or_before``: the start of the record that holds an offset, across segments."""
    from node.store.log import SegmentedLog
    log_ = SegmentedLog.open(tmp_path / "l", segment_bytes_max=200)
    offs = log_.append([bytes([i]) * (10 + 7 * i) for i in range(20)])
    starts = sorted(set(offs) | {log_.end_offset})
    for x in range(0, log_.end_offset + 1):
        want = max(s for s in starts if s <= x)
        assert log_.boundary_at_or_before(x) == want, x
        assert log_.is_boundary(x) == (x in starts)
    log_.close()


def test_a_cut_tombstone_of_its_own_term_brings_a_returning_masters_tick_state_back(tmp_path):
    """Chaos meta-pause seed 18 (issue 26, 14 messages lost): a master cancelled messages (the
    tombstones never reached its slave, so no cancel was acknowledged), passed their time and
    checkpointed, and was killed. It came back as a slave of the other member, which never had
    its term: the suffix was cut, tombstones included, but the tick state it had restored was its
    own checkpoint (no document from the new master yet) and kept the passed time. Promoted again
    before a document arrived, it took the messages for delivered, and a retried cancel was
    answered "too late". The cut tombstones' messages are now due again on that path too."""
    now, a, b = pair_with_two_filed(tmp_path)
    cut = b.messages.end_offset, b.dispatch.end_offset
    a.cancel("m0", now_ms=now + 100)
    a.flush_messages()
    got, now = run_master(a, now, ticks=30)
    a.checkpoint()
    assert got == ["m1"] and a.replication_doc()["completed_ms"] > T0 + 1500
    # a is killed (no close) and comes back as a slave of b, which never had a's term
    a = DelayStore.open(tmp_path / "a", S, now_ms=now, follower=True)
    a.follow()
    a.truncate_dispatch(cut[1])
    a.truncate_messages(cut[0])
    assert int(a.persisted_doc["dispatch_offset"]) <= cut[1]  # not inside the bytes b will send there
    # b dies before its first answer reaches a; a is promoted again
    b.close()
    a.promote(now, store_epoch=a.epoch_floor() + 5)
    assert a.lookup("m0").status == "pending"  # its cancel was cut: not delivered, not cancelled
    again, now = run_master(a, now, ticks=30)
    assert "m0" in again
    a.close()


def test_a_returning_master_files_the_new_masters_bytes_after_its_cut(tmp_path):
    """Chaos meta-pause seed 8 (third session): a returning master's own tick state, taken as
    its replicated document at a dispatch cut, kept its own iterate offset, past the message
    cut. The new master's bytes filled that range; the offset fell inside one of its records,
    and filing failed ("record ends past end of segment"), at every restart too."""
    now, a, b = pair_with_two_filed(tmp_path)
    cut = b.messages.end_offset, b.dispatch.end_offset
    accept_durable(a, "x", 7, now + 60_000, now)  # a's own term: bytes b never gets
    a.cancel("m0", now_ms=now + 100)
    a.flush_messages()
    got, now = run_master(a, now, ticks=30)
    a.checkpoint()
    assert a.persisted_doc["iterate_offset"] > cut[0]
    b.promote(now, store_epoch=a.epoch + 5)
    mark = a.persisted_doc["iterate_offset"]
    k = 0
    while b.messages.end_offset <= mark + 200 and k < 100:  # other bytes there, one record at a time
        accept_durable(b, f"longer-ids-of-the-new-master-{k}-", 1, now + 60_000, now)
        k += 1
    assert not b.messages.is_boundary(mark)  # a's offset falls inside one of b's records
    got_b, now = run_master(b, now, ticks=30)
    b.checkpoint()
    a = DelayStore.open(tmp_path / "a", S, now_ms=now, follower=True)  # killed, back as b's slave
    a.follow()
    a.truncate_dispatch(cut[1])
    a.truncate_messages(cut[0])
    ship(b, a, "messages")
    ship(b, a, "dispatch")
    a.appended()
    a.iterate(limit=None)  # no document of b's yet: files what it may, and fails on nothing
    a.checkpoint()
    a.close()
    a = DelayStore.open(tmp_path / "a", S, now_ms=now, follower=True)  # and opens again
    a.follow(b.replication_doc())
    a.iterate(limit=None)
    assert a.lookup("longer-ids-of-the-new-master-0-0").status == "pending"
    a.close()
    b.close()


def test_a_delivered_message_behind_the_persisted_tick_state_is_too_late_to_cancel(tmp_path):
    """Chaos meta-pause seed 7 on 02f403d (third session): a cancel was answered OK for a
    message the real-time node already held (its dispatch record written 300 ms before). Its
    entry among the delivered seqs was pruned (behind the persisted tick state) and the live
    completed_ms had stepped back below it while an older message was in flight
    (``_advance_completed``): it looked pending. Behind the persisted value, a message not in
    flight is delivered."""
    now, a, _b = pair_with_two_filed(tmp_path)
    got, now = run_master(a, now, ticks=30)
    assert sorted(got) == ["m0", "m1"]
    for _ in range(3):  # the persisted value passes them, their entries are pruned
        a.checkpoint()
        run_master(a, now, ticks=1)
    assert a.persisted_completed_ms > T0 + 1500
    a.completed_ms = T0 + 1000  # as while an older message is in flight
    with pytest.raises(TooLate):
        a.cancel("m0", now_ms=now)
    assert a.lookup("m1").status == "dispatched"
    a.close()


def test_a_returning_master_killed_before_any_document_opens_on_its_files(tmp_path):
    """The returning master of the test above, without a cancel (nothing lowers its own tick
    state) and killed again before the new master's first document: its checkpoint must not
    send the next open into the middle of the new master's bytes."""
    now, a, b = pair_with_two_filed(tmp_path)
    cut = b.messages.end_offset, b.dispatch.end_offset
    accept_durable(a, "x", 7, now + 60_000, now)
    got, now = run_master(a, now, ticks=30)
    a.checkpoint()
    b.promote(now, store_epoch=a.epoch + 5)
    mark = a.persisted_doc["iterate_offset"]
    k = 0
    while b.messages.end_offset <= mark + 200 and k < 100:
        accept_durable(b, f"longer-ids-of-the-new-master-{k}-", 1, now + 60_000, now)
        k += 1
    assert not b.messages.is_boundary(mark)
    b.iterate(limit=None)
    b.checkpoint()
    a = DelayStore.open(tmp_path / "a", S, now_ms=now, follower=True)
    a.follow()
    a.truncate_dispatch(cut[1])
    a.truncate_messages(cut[0])
    ship(b, a, "messages")
    a.appended()
    a = DelayStore.open(tmp_path / "a", S, now_ms=now, follower=True)  # killed again: no close()
    a.follow(b.replication_doc())
    a.iterate(limit=None)
    assert a.lookup("longer-ids-of-the-new-master-0-0").status == "pending"
    a.close()
    b.close()


@pytest.mark.parametrize("how", ["promote", "reopen", "promote-restart"])
def test_a_slave_that_files_after_the_master_delivered_does_not_deliver_again(tmp_path, how):
    """A slave that files records only after its master delivered them (a new replica catching
    up, a slave that was down) files them overdue, at the master's completed_ms, not at their
    due time. The dispatch records replayed at promotion (from the replicated dispatch_offset
    on) do not name them, nor match their effective time: the promoted store must still know
    them for delivered, fire only what was not, and count only that as pending."""
    now = T0
    m = DelayStore.open(tmp_path / "m", S, now_ms=now)
    accept_durable(m, "m", 4, now + 1000, now)  # m0..m3: delivered by the master
    m.accept([Message(seq=0, store_ms=0, deliver_at_ms=now + 60_000, msg_id=f"m{i}", subject="s", payload=b"p")
              for i in range(4, 9)], now_ms=now)  # m4..m8: not due before the failover
    m.flush_messages()
    m.checkpoint()
    got, now = run_master(m, now, ticks=30)
    assert sorted(got) == ["m0", "m1", "m2", "m3"]
    for _ in range(3):  # the persisted completed_ms passes them
        m.checkpoint()
        _, now = run_master(m, now, ticks=1)
    m.checkpoint()
    assert m.persisted_completed_ms > T0 + 1000
    f = DelayStore.open(tmp_path / "f", S, now_ms=now, follower=True)  # a slave that files late
    f.follow()
    replicate(m, f)
    f.check_invariants()
    if how == "reopen":  # promoted by a close and an open as master
        f.close()
        f = DelayStore.open(tmp_path / "f", S, now_ms=now)
    else:
        f.promote(now)
    if how == "promote-restart":  # the new master restarts before its tick state passes them
        f.close()
        f = DelayStore.open(tmp_path / "f", S, now_ms=now)
    f.check_invariants()
    assert sum(f.pending_by_bucket().values()) == 5
    fired, now = run_master(f, now, ticks=20)
    fired += run_master(f, now + 60_000, ticks=5)[0]
    assert sorted(fired) == [f"m{i}" for i in range(4, 9)]
    for i in range(4):
        assert f.lookup(f"m{i}").status == "dispatched"
    f.close()
    m.close()


def test_late_filed_records_are_found_across_dispatch_segments(tmp_path):
    """The test above with a dispatch log of several segments: the master delivers a stream of
    messages for 60 s and m0..m3, accepted 40 s in, in the middle of it. A new replica files
    all of them late (at the master's completed_ms); the promotion finds every one of them in
    the dispatch log (late_filed.py): only m4..m8 fire, 5 pending."""
    now = T0
    m = DelayStore.open(tmp_path / "m", S, now_ms=now)
    for k in range(60):  # a stream delivered 1 s apart, over several dispatch segments
        accept_durable(m, f"x{k}-", 16, now + 1000 * (k + 1), now)
    got: list[str] = []

    def run(ticks: int) -> None:
        nonlocal now
        for _ in range(ticks // 5):
            g, now = run_master(m, now, ticks=5, step_ms=500)
            got.extend(g)
            m.checkpoint()
    run(80)
    accept_durable(m, "m", 4, now + 2000, now)  # m0..m3: delivered in the middle of the stream
    m.accept([Message(seq=0, store_ms=0, deliver_at_ms=now + 600_000, msg_id=f"m{i}", subject="s", payload=b"p")
              for i in range(4, 9)], now_ms=now)
    m.flush_messages()
    m.checkpoint()
    run(50)
    assert sorted(x for x in got if x.startswith("m")) == ["m0", "m1", "m2", "m3"] and len(got) == 964
    assert len(m.dispatch.segment_bases()) >= 3
    f = DelayStore.open(tmp_path / "f", S, now_ms=now, follower=True)
    f.follow()
    replicate(m, f)
    f.promote(now)
    f.check_invariants()
    assert sum(f.pending_by_bucket().values()) == 5
    fired = run_master(f, now, ticks=20)[0] + run_master(f, now + 600_000, ticks=5)[0]
    assert sorted(fired) == [f"m{i}" for i in range(4, 9)]
    f.close()
    m.close()
