"""Store side of real-time replication without the network: the follower appends the master's
frames byte for byte, reindexes them, takes the group documents, cuts a divergent suffix, and is
promoted by a reopen."""

from __future__ import annotations

import numpy as np

from cluster.codec import Batch
from cluster.wire import pack_ranges, unpack_ranges
from node.realtime.store import RealtimeStore


def batch(subjects, ids, payloads, t) -> Batch:
    return Batch.build(subjects, payloads, ids, t)


def ship(master: RealtimeStore, replica: RealtimeStore, since_seq: int, now: int) -> int:
    """What the Replicate stream does: bytes, then the changed group docs."""
    lg = replica.messages
    while lg.end_offset < master.messages.end_offset:
        lg.append_raw(lg.end_offset, master.messages.read_bytes(lg.end_offset, 4096))
    lg.flush()
    replica.index_appended(now_ms=now)
    for key in master.changed_groups(since_seq):
        replica.apply_group_doc(master.group_doc(*key))
    return master.group_seq


def ranges(handles):
    return unpack_ranges(pack_ranges(handles))


def test_replica_indexes_shipped_frames_keeps_group_offsets_and_cuts_a_divergent_tail(tmp_path):
    t = 1_000_000
    for _ in range(3):  # the master's store epoch (3) is above the replica's own (1)
        RealtimeStore.open(tmp_path / "m", now_ms=t).close()
    m = RealtimeStore.open(tmp_path / "m", now_ms=t)
    r = RealtimeStore.open(tmp_path / "r", now_ms=t)
    for part in range(3):  # three frames, two subjects interleaved
        ks = range(20 * part, 20 * part + 20)
        m.append(batch(["s1" if k % 3 else "s2" for k in ks], [f"a{k}" for k in ks], [b"x" * k for k in ks], t),
                 now_ms=t)
    b, h = m.pull(["s1"], "g", "c", max_messages=10, now_ms=t)
    m.ack("s1", "g", ranges(h[:6]), now_ms=t)   # 4 stay in flight
    m.persist_group("s1", "g")
    seq = ship(m, r, -1, t)
    assert r.messages.end_offset == m.messages.end_offset
    assert r.counters["reindexed"] == 60
    for s in ("s1", "s2"):
        assert (tmp_path / "r" / "index" / s / "entries").read_bytes() == \
            (tmp_path / "m" / "index" / s / "entries").read_bytes()
    assert r.append(batch("s1", ["a5"], [b"dup"], t), now_ms=t).duplicates[0] == 1  # dedup map rebuilt
    # divergent tail: the replica (an old master) holds frames the new master never had
    cut = r.messages.end_offset
    r.append(batch("s1", [f"b{k}" for k in range(5)], [b"y"] * 5, t), now_ms=t)
    r.flush()
    assert r.truncate_log(cut) > 0
    assert r.messages.end_offset == cut
    assert (tmp_path / "r" / "index" / "s1" / "entries").read_bytes() == \
        (tmp_path / "m" / "index" / "s1" / "entries").read_bytes()
    assert r.append(batch("s1", ["b0"], [b"y"], t), now_ms=t).duplicates[0] == 0  # its dedup entry went too
    r.truncate_log(cut)
    m.ack("s1", "g", ranges(h[6:7]), now_ms=t)
    m.persist_group("s1", "g")
    ship(m, r, seq, t)
    r.close()
    m.close()
    # promotion: reopen; the acked handles never come back, the 3 still in flight come at once
    p = RealtimeStore.open(tmp_path / "r", now_ms=t + 1)
    again, ah = p.pull(["s1"], "g", "c", max_messages=100, now_ms=t + 1)
    assert set(ah[:3].tolist()) == set(h[7:].tolist())
    assert not set(ah.tolist()) & set(h[:7].tolist())
    assert again.id_list()[3:] == [f"a{k}" for k in range(60) if k % 3][10:]
    assert p.epoch > int(again.seq.max()) >> 40
    p.close()


def test_truncation_inside_a_group_window_clamps_the_group(tmp_path):
    t = 5_000
    st = RealtimeStore.open(tmp_path, now_ms=t)
    st.append(batch("s", ["a", "b"], [b"1", b"2"], t), now_ms=t)
    cut = st.messages.end_offset
    st.append(batch("s", ["c", "d"], [b"3", b"4"], t), now_ms=t)
    _, h = st.pull(["s"], "g", "c", max_messages=10, now_ms=t)
    assert h.tolist() == [0, 1, 2, 3]
    st.truncate_log(cut)
    assert st.lag("s", "g") == 2 and st.committed("s", "g") == 0
    assert st.ack("s", "g", [(0, 4)], now_ms=t) == 2  # handles 2 and 3 no longer exist
    st.append(batch("s", ["c"], [b"3"], t), now_ms=t)  # not a duplicate any more
    b, h = st.pull(["s"], "g", "c", max_messages=10, now_ms=t)
    assert b.id_list() == ["c"] and h.tolist() == [2]
    assert np.array_equal(b.payload_list(), [b"3"])
    st.close()


def test_a_replica_indexes_messages_stored_ahead_of_due_the_same_way(tmp_path):
    """visible_ms comes from the frame's own columns: the replica's index is byte for byte the
    master's, and a message the master holds until due is held on the replica too."""
    t = 1_000_000
    m = RealtimeStore.open(tmp_path / "m", now_ms=t)
    r = RealtimeStore.open(tmp_path / "r", now_ms=t - 1000)  # long before: only indexing marks what is held
    m.append(batch(["s1", "s1", "s2"], ["now", "ahead", "s2now"], [b"x"] * 3, np.array([t, t + 50, t], np.int64)),
             now_ms=t)
    ship(m, r, -1, t + 1)
    for s in ("s1", "s2"):
        assert (tmp_path / "r" / "index" / s / "entries").read_bytes() == \
            (tmp_path / "m" / "index" / s / "entries").read_bytes()
    b, _ = r.pull(["s1", "s2"], "g", "c", max_messages=10, now_ms=t + 1)
    assert sorted(b.id_list()) == ["now", "s2now"] and r.held_next_ms == t + 52  # 50 ahead, rounded up to 4 ms
    b, _ = r.pull(["s1"], "g", "c", max_messages=10, now_ms=t + 52)
    assert b.id_list() == ["ahead"]
    m.close()
    r.close()
