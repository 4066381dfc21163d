"""Retention (issue 14 A): the pure rules, the delay store applying them, crashes midway."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from cluster.errors import NotFound, TooLate
from node.delay import retention as DR
from node.delay.store import DelayStore, StoreSettings
from node.store import retention as R
from node.store.log import SegmentedLog
from node.store.records import Limits, Message

T0 = 1_800_000_000_000
BMS = 10_000
SET = StoreSettings(bucket_ms=BMS, message_segment_bytes=4096, dispatch_segment_bytes=2048,
                    schedule_segment_bytes=1 << 16, id_slots=64, id_entries_max=64, dedupe_window_ms=30_000,
                    limits=Limits(payload_bytes_max=1024))
REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------- pure rules

def test_segment_cut_stops_at_the_lowest_hold_and_keeps_the_active_segment():
    bases = [0, 100, 200, 300]
    assert R.segment_cut(bases, 350, {"checkpoint": 250, "slave:b": 120}) == R.SegmentCut(100, "slave:b", 100)
    assert R.segment_cut(bases, 350, {"checkpoint": 250}) == R.SegmentCut(200, "checkpoint", 200)
    assert R.segment_cut(bases, 350, {"checkpoint": 350}) == R.SegmentCut(300, R.ACTIVE, 300)
    assert R.segment_cut(bases, 350, {}) == R.SegmentCut(300, R.ACTIVE, 300)
    assert R.segment_cut([0], 10, {"checkpoint": 0}).offset == 0


def test_aged_cut_needs_age_or_size_and_every_hold():
    segs = [(0, 100, 1_000), (100, 100, 5_000), (200, 100, 9_000), (300, 10, 9_500)]
    # age 3 s at now 10 s: segments written at 1 s and 5 s are old enough, 9 s is not
    cut = R.aged_segment_cut(segs, 310, {}, now_ms=10_000, age_ms_max=3_000, bytes_max=None)
    assert cut.offset == 200 and cut.held_by == "age/size"
    # a group at 150 holds segment 100 whatever its age
    cut = R.aged_segment_cut(segs, 310, {"group:s/g": 150}, now_ms=10_000, age_ms_max=3_000, bytes_max=None)
    assert cut == R.SegmentCut(100, "group:s/g", 100)
    # size: 310 bytes over a 150-byte limit: the two oldest go
    cut = R.aged_segment_cut(segs, 310, {}, now_ms=0, age_ms_max=None, bytes_max=150)
    assert cut.offset == 200


def test_bucket_and_id_rules():
    bc = R.bucket_cut([0, 10_000, 20_000], 10_000, 20_000)
    assert bc.drop == [0, 10_000] and bc.held_start == 20_000
    starts = np.array([0, 10_000, 20_000], np.int64)
    gone = R.id_entries_gone(starts, bucket_ms=10_000, completed_ms=20_000, now_ms=35_000, dedupe_window_ms=20_000)
    assert gone.tolist() == [True, False, False]  # bucket 10_000 ended at 20_000: window runs to 40_000
    acts = R.id_file_actions([(0, 10, 10), (10, 10, 6), (20, 10, 2), (30, 0, 0)], compact_ratio_min=0.5)
    assert [(a.first_seq, a.action, a.keep) for a in acts] == [(0, "delete", 0), (10, "compact", 4)]


def test_slave_holds():
    fetched = {"b": {"messages": 500}, "gone": {"messages": 10}}
    assert R.slave_holds(["b", "c"], fetched, "messages", known=True) == {"slave:b": 500, "slave:c": 0}
    assert R.slave_holds([], fetched, "messages", known=False) == {"membership unknown": 0}


# ---------------------------------------------------------------------- the delay store

def msg(i, due, payload=b"p" * 100):
    return Message(seq=0, store_ms=0, deliver_at_ms=due, msg_id=f"m{i}", subject="s", payload=payload)


class Node:
    """A store driven like the service drives it, with a fake clock."""

    def __init__(self, path, now=T0):
        self.path, self.now = path, now
        self.store = DelayStore.open(path, SET, now_ms=now)
        self.delivered: list[str] = []

    def send(self, msgs):
        res = self.store.accept(msgs, now_ms=self.now)
        self.store.flush_messages()
        self.store.iterate(limit=None)
        return res

    def run_until(self, t, step=50):
        while self.now < t:
            self.now = min(t, self.now + step)
            for d in self.store.poll_due(now_ms=self.now):
                self.delivered += d.batch.id_list()
                self.store.ack_dispatched(d.unit, np.arange(d.batch.n), now_ms=self.now)
        self.store.checkpoint()

    def retention(self, slave_holds=None):
        work, report = DR.plan(self.store, now_ms=self.now, slave_holds=slave_holds,
                               dedupe_window_ms=SET.dedupe_window_ms, id_compact_ratio_min=SET.id_compact_ratio_min)
        work.run()
        DR.finish(self.store, work, same_store=True)
        return report


def test_delivered_data_goes_ids_stay_for_the_dedupe_window(tmp_path):
    n = Node(tmp_path)
    for k in range(30):  # 300 messages due over 40 s: several message segments, buckets, id files
        n.send([msg(k * 10 + j, T0 + 1_000 + (k * 10 + j) * 130) for j in range(10)])
    pending = n.store.pending_by_bucket()
    assert sum(pending.values()) == 300
    n.store.checkpoint()
    before = DR.disk_usage(tmp_path)
    # a slave that fetched nothing holds every message segment
    report = n.retention(slave_holds={"messages": {"slave:b": 0}})
    assert n.store.messages.start_offset == 0 and report.held_by["messages"] == "slave:b"
    n.retention()  # filed and checkpointed: the message log goes, the buckets stay (all pending)
    assert n.store.messages.start_offset > 0
    assert len(n.store.schedule.bucket_starts()) >= 4
    n.run_until(T0 + 60_000)
    assert sorted(n.delivered) == sorted(f"m{i}" for i in range(300))
    report = n.retention()
    assert n.store.schedule.bucket_starts() == [] or report.held_by["schedule"] == "pending messages"
    assert all(s + BMS > n.store.persisted_doc["completed_ms"] for s in n.store.schedule.bucket_starts())
    # inside the dedupe window a re-send is a duplicate, though its bucket is gone
    # (m299's bucket ended at T0+40 s: its window runs to T0+70 s; m0's ran out at T0+40 s)
    res = n.send([msg(299, T0 + 1_000 + 299 * 130)])
    assert res.duplicates[0] == 1 and res.codes[0] == 0
    with pytest.raises(NotFound, match="expired"):
        n.store.lookup("m299")
    with pytest.raises(TooLate):
        n.store.cancel("m299", now_ms=n.now)
    ids_before = n.store.ids.file_count()
    n.now = T0 + 200_000  # past every bucket's end + window
    n.retention()
    assert n.store.ids.file_count() < ids_before
    after = DR.disk_usage(tmp_path)
    assert after["messages"] < before["messages"] and after.get("ids", 0) < before["ids"]
    # a new message with an old id (past the window) is taken as new
    res = n.send([msg(5, n.now + 5_000)])
    assert res.codes[0] == 0 and res.duplicates[0] == 0
    n.store.close()
    n2 = Node(tmp_path, now=n.now)  # reopens: replay from the checkpoint, nothing missing
    n2.run_until(n.now + 10_000)
    assert n2.delivered == ["m5"]
    n2.store.close()


def test_compaction_keeps_pending_ids(tmp_path):
    n = Node(tmp_path)
    # 64 ids per file: each file holds 60 messages due soon and 4 due much later
    for k in range(4):
        n.send([msg(k * 64 + j, T0 + 1_000 + j * 10) for j in range(60)]
               + [msg(k * 64 + 60 + j, T0 + 500_000) for j in range(4)])
    n.send([msg(9999, T0 + 500_000)])  # rolls into a new file: the four above are sealed
    n.run_until(T0 + 20_000)
    n.now = T0 + 100_000
    n.retention()
    counts = {fs: used for fs, used, *_ in n.store.ids.sealed_bucket_counts()}
    assert counts and all(used == 4 for used in counts.values())  # compacted to the pending ones
    for k in range(4):
        assert n.store.lookup(f"m{k * 64 + 61}").status == "pending"
    n.store.close()
    n2 = Node(tmp_path, now=T0 + 100_000)
    assert n2.store.lookup("m62").status == "pending"
    n2.run_until(T0 + 501_000, step=1000)
    assert len(n2.delivered) == 17
    n2.store.close()


def test_crash_between_rename_and_unlink_leaves_a_node_that_starts(tmp_path):
    n = Node(tmp_path)
    for k in range(20):
        n.send([msg(k * 10 + j, T0 + 500 + j * 100) for j in range(10)])
    n.run_until(T0 + 30_000)
    work, _ = DR.plan(n.store, now_ms=n.now + 100_000, dedupe_window_ms=SET.dedupe_window_ms,
                      id_compact_ratio_min=0.5)
    assert work.segments and work.buckets
    # killed here: renamed, not deleted. Also "un-rename" the oldest segment, as a power cut may
    seg_dir, paths = work.segments["messages"]
    os.replace(paths[0], str(paths[0])[: -len(".deleting")])
    del n.store  # no close: whatever was written is in the page cache, as after a kill
    n2 = Node(tmp_path, now=T0 + 30_000)
    assert not list(tmp_path.rglob("*.deleting"))
    assert n2.store.messages.start_offset > 0
    n2.send([msg(500, T0 + 31_000)])
    n2.run_until(T0 + 32_000)
    assert n2.delivered == ["m500"]
    n2.store.close()


CHILD = textwrap.dedent("""
    import json, sys, numpy as np
    sys.path.insert(0, {repo!r})
    from tests.test_retention import Node, msg, DR, SET, T0
    n = Node({path!r}, now={now})
    acked = open({acked!r}, "a")
    rnd = np.random.default_rng({seed})
    k = {start}
    while True:
        batch = [msg(k + j, n.now + int(rnd.integers(0, 20_000))) for j in range(20)]
        res = n.send(batch)  # flushed: acknowledged
        acked.write(json.dumps([[m.msg_id, m.deliver_at_ms] for m in batch]) + "\\n"); acked.flush()
        k += 20
        n.run_until(n.now + 500)
        work, _ = DR.plan(n.store, now_ms=n.now, dedupe_window_ms=SET.dedupe_window_ms, id_compact_ratio_min=0.5)
        work.run()
        DR.finish(n.store, work, same_store=True)
""")


@pytest.mark.integration  # tier: a subprocess killed with SIGKILL
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_during_retention_loses_nothing_acknowledged(tmp_path, seed):
    """A child process sends, delivers and runs retention in a loop; it is SIGKILLed at a
    seeded moment, three times; every acknowledged message is then delivered or still
    pending (or its id is remembered as done), and the node starts every time."""
    rnd = random.Random(seed)
    data, acked = tmp_path / "data", tmp_path / "acked.jsonl"
    now, start = T0, 0
    for round_ in range(3):
        code = CHILD.format(repo=str(REPO), path=str(data), now=now, acked=str(acked), seed=seed * 10 + round_,
                            start=start)
        before = acked.stat().st_size if acked.exists() else 0
        p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, start_new_session=True)
        try:
            # the seeded moment counts from the child's first acknowledged batch: on a starved
            # machine its start alone took longer than the 1.5-3 s (no file, nothing to check)
            deadline = time.monotonic() + 300
            while (p.poll() is None and time.monotonic() < deadline
                   and (acked.stat().st_size if acked.exists() else 0) <= before):
                time.sleep(0.05)
            assert p.poll() is None, f"the child exited with {p.returncode} before its first batch"
            time.sleep(rnd.uniform(1.5, 3.0))
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        lines = [json.loads(x) for x in acked.read_text().splitlines() if x.endswith("]")]
        start = 100_000 * (round_ + 1)
        n = Node(data, now=now)  # starts after the kill
        n.now = n.store.completed_ms
        n.run_until(n.now + 25_000, step=200)  # every acknowledged message is due by then
        now = n.now
        got = set(n.delivered)
        for line in lines:
            for mid, due in line:
                if mid in got:
                    continue
                try:
                    st = n.store.lookup(mid).status
                except NotFound as e:
                    # done before the kill: its bucket deleted, and its id too once the window passed
                    forgotten = due - due % BMS + BMS + SET.dedupe_window_ms <= n.now
                    assert "expired" in str(e) or forgotten, mid
                    continue
                assert st == "dispatched", (mid, st)
        n.store.close()
