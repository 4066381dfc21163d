"""Consumer-group positions in the offsets log (node/realtime/offsets.py) on real files: one
record per commit round, replay after a kill, torn tail, corruption, compaction, the old
one-file-per-group layout, and the documents a replica takes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cluster.codec import Batch
from cluster.errors import CorruptRecord
from cluster.wire import pack_ranges, unpack_ranges
from node.realtime.offsets import OffsetsLog, decode_record
from node.realtime.store import RealtimeSettings, RealtimeStore
from node.store import checkpoint

T0 = 1_800_000_000_000
SUBJECTS = [f"s{i}" for i in range(16)]


def doc(subject: str, group: str, committed: int, nxt: int | None = None, pending=()) -> dict:
    return {"version": 1, "subject": subject, "group": group, "start": "earliest", "committed": committed,
            "next": committed if nxt is None else nxt, "pending": [list(p) for p in pending]}


def records(directory) -> list[tuple[bool, list[dict]]]:
    lg, _ = OffsetsLog.open(directory)
    try:
        return [decode_record(body, "", off) for off, body in lg.log.iterate()]
    finally:
        lg.close()


def fill(st: RealtimeStore, per_subject: int, now: int = T0) -> None:
    n = per_subject * len(SUBJECTS)
    subjects = [SUBJECTS[k % len(SUBJECTS)] for k in range(n)]
    st.append(Batch.build(subjects, [b"x"] * n, [f"m{k}" for k in range(n)], np.full(n, now, np.int64)), now_ms=now)


def pull_all(st: RealtimeStore, group: str, now: int) -> tuple[Batch, np.ndarray]:
    return st.pull(SUBJECTS, group, "c", max_messages=1000, now_ms=now)


def ack_by_subject(st: RealtimeStore, group: str, b: Batch, h: np.ndarray, now: int) -> None:
    for s in SUBJECTS:
        mine = h[[b.subject(i) == s for i in range(b.n)]]
        if len(mine):
            st.ack(s, group, unpack_ranges(pack_ranges(mine)), now_ms=now)


def test_an_ack_round_over_16_subjects_is_one_record(tmp_path):
    st = RealtimeStore.open(tmp_path, now_ms=T0)
    fill(st, 4)
    b, h = pull_all(st, "g", T0)
    st.write_groups_async(st.snapshot_groups(st.dirty_groups())).result()
    before = len(records(tmp_path / "groups"))
    ack_by_subject(st, "g", b, h, T0)
    items = st.snapshot_groups(st.dirty_groups())
    assert len(items) == 16
    st.write_groups_async(items).result()
    recs = records(tmp_path / "groups")
    assert len(recs) == before + 1
    assert {(d["subject"], d["committed"]) for d in recs[-1][1]} == {(s, 4) for s in SUBJECTS}
    st.close()


def test_positions_are_replayed_after_a_kill(tmp_path):
    st = RealtimeStore.open(tmp_path, now_ms=T0)
    fill(st, 5)
    st.flush()
    b, h = pull_all(st, "g", T0)
    keep = np.array([b.subject(i) != "s3" or int(h[i]) < 2 for i in range(b.n)])  # s3: handles 2..4 in flight
    ack_by_subject(st, "g", b.take(np.flatnonzero(keep)), h[keep], T0)
    st.write_groups_async(st.snapshot_groups(st.dirty_groups())).result()
    # killed: no close, no flush; the store is just dropped
    st2 = RealtimeStore.open(tmp_path, now_ms=T0 + 10)
    assert [st2.committed(s, "g") for s in SUBJECTS] == [2 if s == "s3" else 5 for s in SUBJECTS]
    again, ah = pull_all(st2, "g", T0 + 10)
    assert again.id_list() == [i for i, k in zip(b.id_list(), keep) if not k]  # only s3's unacked come back
    assert ah.tolist() == [2, 3, 4]
    st2.close()


def test_acks_not_yet_committed_are_redelivered_after_a_kill(tmp_path):
    st = RealtimeStore.open(tmp_path, now_ms=T0)
    fill(st, 2)
    st.flush()
    b, h = pull_all(st, "g", T0)
    ack_by_subject(st, "g", b, h, T0)  # acked in memory, never committed
    st2 = RealtimeStore.open(tmp_path, now_ms=T0 + 10)
    assert pull_all(st2, "g", T0 + 10)[0].n == 32  # at-least-once
    st2.close()


def test_a_torn_tail_of_the_offsets_log_loses_only_the_last_round(tmp_path):
    lg, _ = OffsetsLog.open(tmp_path)
    lg.commit([doc("a", "g", 1), doc("b", "g", 7)]).result()
    lg.commit([doc("a", "g", 2)]).result()
    lg.close()
    seg = sorted(tmp_path.glob("*.log"))[-1]
    data = seg.read_bytes()
    seg.write_bytes(data[:-3])  # the last record lost its end (power cut mid-write)
    lg, docs = OffsetsLog.open(tmp_path)
    assert lg.log.recovery is not None and lg.log.recovery.bytes_dropped > 0
    assert docs[("a", "g")]["committed"] == 1 and docs[("b", "g")]["committed"] == 7
    lg.commit([doc("a", "g", 3)]).result()  # appends after the cut
    lg.close()
    assert OffsetsLog.open(tmp_path)[1][("a", "g")]["committed"] == 3


def test_a_flipped_bit_inside_the_offsets_log_is_corruption(tmp_path):
    lg, _ = OffsetsLog.open(tmp_path)
    for k in range(3):
        lg.commit([doc("a", "g", k)]).result()
    lg.close()
    seg = sorted(tmp_path.glob("*.log"))[0]
    data = bytearray(seg.read_bytes())
    data[20] ^= 0x10  # inside the first record's body
    seg.write_bytes(bytes(data))
    with pytest.raises(CorruptRecord):
        OffsetsLog.open(tmp_path)


def test_a_record_this_module_did_not_write_is_corruption(tmp_path):
    lg, _ = OffsetsLog.open(tmp_path)
    lg.log.append([json.dumps({"v": 99, "groups": []}).encode()])
    lg.close()
    with pytest.raises(CorruptRecord):
        OffsetsLog.open(tmp_path)


def test_compaction_bounds_the_log_and_keeps_the_newest_position_of_every_group(tmp_path):
    limit = 8192
    lg, _ = OffsetsLog.open(tmp_path, compact_bytes=limit)
    want = {}
    for r in range(2000):
        d = doc(f"s{r % 7}", "g", r, r + 3, [(r, r + 1)])
        want[(d["subject"], "g")] = d
        lg.commit([d, doc("quiet", "g", 5)] if r == 0 else [d])
    lg.commit([]).result()  # the writer thread is in order: everything before is on disk
    assert lg.snapshots > 0
    assert lg.log.size_bytes < 2 * limit  # about 1.25 * limit plus a snapshot
    lg.close()
    lg, docs = OffsetsLog.open(tmp_path, compact_bytes=limit)
    assert docs == {**want, ("quiet", "g"): doc("quiet", "g", 5)}  # a group untouched since the start survives
    lg.close()


def test_replay_through_segments_left_by_a_crash_during_compaction(tmp_path):
    """The snapshot is fsynced before old segments are deleted: a crash in between leaves
    them, and replaying them before the snapshot gives the same positions."""
    lg, _ = OffsetsLog.open(tmp_path, compact_bytes=8192)
    lg.log.delete_before = lambda offset: 0  # the crash: the deletion never happens
    for r in range(1500):
        lg.commit([doc(f"s{r % 5}", "g", r)])
    lg.commit([]).result()
    assert lg.snapshots > 0 and len(list(tmp_path.glob("*.log"))) > 4
    lg.close()
    _, docs = OffsetsLog.open(tmp_path)
    assert {k: d["committed"] for k, d in docs.items()} == {(f"s{k}", "g"): 1495 + k for k in range(5)}


def test_old_group_files_are_migrated_into_the_offsets_log(tmp_path):
    st = RealtimeStore.open(tmp_path, now_ms=T0)
    fill(st, 3)
    st.close()
    # the old layout: one checkpoint file per (subject, group), no offsets records for them
    for p in (tmp_path / "groups").glob("*.log"):
        p.unlink()
    (tmp_path / "groups" / "s1").mkdir()
    checkpoint.write_atomic(tmp_path / "groups" / "s1" / "old.json", doc("s1", "old", 2, 3, [(2, 3)]))
    st = RealtimeStore.open(tmp_path, now_ms=T0 + 1)
    assert st.committed("s1", "old") == 2
    assert not (tmp_path / "groups" / "s1").exists()
    b, h = st.pull(["s1"], "old", "c", max_messages=10, now_ms=T0 + 1)
    assert h.tolist() == [2]  # pending in the old file: redelivered at once
    st.close()
    st = RealtimeStore.open(tmp_path, now_ms=T0 + 2)  # migrated once: now from the log
    assert st.committed("s1", "old") == 2
    st.close()


def test_a_replica_commits_shipped_documents_and_keeps_them_after_promotion(tmp_path):
    m = RealtimeStore.open(tmp_path / "m", now_ms=T0)
    r = RealtimeStore.open(tmp_path / "r", now_ms=T0)
    fill(m, 4)
    b, h = pull_all(m, "g", T0)
    ack_by_subject(m, "g", b, h, T0)
    m.write_groups_async(m.snapshot_groups(m.dirty_groups())).result()
    lg = r.messages
    lg.append_raw(lg.end_offset, m.messages.read_bytes(0, 1 << 20))
    r.index_appended(now_ms=T0)
    before = len(records(tmp_path / "r" / "groups"))
    r.apply_group_docs([m.group_doc(*k) for k in m.changed_groups(-1)])
    assert len(records(tmp_path / "r" / "groups")) == before + 1  # one record for the whole answer
    r.close()
    m.close()
    p = RealtimeStore.open(tmp_path / "r", now_ms=T0 + 1)
    assert [p.committed(s, "g") for s in SUBJECTS] == [4] * 16
    assert pull_all(p, "g", T0 + 1)[0].n == 0
    p.close()


def test_settings_name_the_compaction_limit(tmp_path):
    st = RealtimeStore.open(tmp_path, RealtimeSettings(offsets_compact_bytes=4096), now_ms=T0)
    fill(st, 1)
    for k in range(300):
        b, h = pull_all(st, f"g{k % 3}", T0)
        ack_by_subject(st, f"g{k % 3}", b, h, T0)
        st.flush()
    assert st._offsets.snapshots > 0
    st.close()
