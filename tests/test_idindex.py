"""IdIndex: round trips, shadowing, rolling, collisions, recovery, retention,
a Hypothesis model (dict of lists) and a real SIGKILL crash loop."""

from __future__ import annotations

import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cluster.errors import Closed, CorruptRecord, InvalidArgument
from node.store import idindex
from node.store.idindex import ENTRY_SIZE, HEADER_SIZE, IdIndex, IdLocation, key_hash, key_hashes

ROOT = Path(__file__).resolve().parent.parent


def loc(seq: int, bucket: int = 3_600_000, off: int | None = None, size: int = 100) -> IdLocation:
    return IdLocation(bucket, seq * 1000 if off is None else off, size, seq)


def idx_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.idx"))


def test_put_get_round_trip(tmp_path: Path) -> None:
    with IdIndex.open(tmp_path, slots_count=64, entries_max=128) as ids:
        assert ids.last_seq() == -1
        assert ids.get_all("nope") == []
        ids.put("m-1", IdLocation(-3_600_000, 2**64 - 1, 2**32 - 1, 5))
        ids.put("m-2", IdLocation(7_200_000, 10, 20, 6))
        assert ids.get_all("m-1") == [IdLocation(-3_600_000, 2**64 - 1, 2**32 - 1, 5)]
        assert ids.get_all("m-2") == [IdLocation(7_200_000, 10, 20, 6)]
        assert ids.get_all("m-3") == []
        assert ids.last_seq() == 6
    assert [p.name for p in idx_files(tmp_path)] == ["00000000000000000005.idx"]
    size = HEADER_SIZE + 4 * 64 + ENTRY_SIZE * 128
    assert (tmp_path / "00000000000000000005.idx").stat().st_size == size


def test_shadowing_newest_first(tmp_path: Path) -> None:
    with IdIndex.open(tmp_path, slots_count=16, entries_max=1024) as ids:
        for seq in range(10):
            ids.put("same", loc(seq))
            ids.put(f"other-{seq}", loc(seq))
        assert ids.get_all("same") == [loc(s) for s in reversed(range(10))]


def test_rolling_across_files(tmp_path: Path) -> None:
    with IdIndex.open(tmp_path, slots_count=8, entries_max=10, open_files_max=2) as ids:
        for seq in range(95):
            ids.put(f"id-{seq % 30}", loc(seq))
        assert ids.file_count() == 10
        for k in range(30):
            assert ids.get_all(f"id-{k}") == [loc(s) for s in reversed(range(k, 95, 30))]
        assert ids.last_seq() == 94
    names = [p.name for p in idx_files(tmp_path)]
    assert names == [f"{s:020d}.idx" for s in range(0, 95, 10)]


def test_roll_refuses_a_whole_file_of_one_seq(tmp_path: Path) -> None:
    with IdIndex.open(tmp_path, slots_count=4, entries_max=3) as ids:
        for i in range(3):
            ids.put(f"a{i}", loc(7))
        with pytest.raises(InvalidArgument):
            ids.put("a3", loc(7))
        ids.put("a3", loc(8))  # nothing was changed by the refused put
        assert ids.get_all("a3") == [loc(8)]
        assert ids.file_count() == 2


def test_collisions_with_tiny_slot_table(tmp_path: Path) -> None:
    with IdIndex.open(tmp_path, slots_count=4, entries_max=4096) as ids:
        for i in range(1000):
            ids.put(f"msg-{i}", loc(i))
        for i in range(1000):
            assert ids.get_all(f"msg-{i}") == [loc(i)]


def test_full_hash_collision_returns_every_candidate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two ids with the same 8-byte hash are indistinguishable to the index: both come back.
    monkeypatch.setattr(idindex, "key_hash", lambda msg_id, version=idindex.VERSION: 42)
    with IdIndex.open(tmp_path, slots_count=4, entries_max=16) as ids:
        ids.put("x", loc(1))
        ids.put("y", loc(2))
        assert ids.get_all("x") == [loc(2), loc(1)]
        assert ids.get_all("y") == [loc(2), loc(1)]


def _as_version_1(path: Path, ids: list[str]) -> None:
    """Rewrite a closed index file as a version 1 file (blake2b key hashes) of ``ids``,
    as a node before the xxh3 change wrote it: every entry's hash and the slot chains."""
    raw = bytearray(path.read_bytes())
    magic, _v, slots_count, entries_max, used, first_seq, last_seq = idindex.HEADER.unpack_from(raw)
    assert used == len(ids)
    ent_off = HEADER_SIZE + 4 * slots_count
    slots = np.zeros(slots_count, np.uint32)
    e = np.frombuffer(raw, idindex.ENTRY_DTYPE, used, ent_off).copy()
    e["key_hash"] = key_hashes([i.encode() for i in ids], idindex.VERSION_BLAKE2B)
    for n, h in enumerate(e["key_hash"].tolist()):
        e["prev"][n] = slots[h % slots_count]
        slots[h % slots_count] = n + 1
    raw[HEADER_SIZE:ent_off] = slots.tobytes()
    raw[ent_off:ent_off + used * ENTRY_SIZE] = e.tobytes()
    raw[:HEADER_SIZE] = idindex.pack_header(slots_count, entries_max, used, first_seq, last_seq,
                                            idindex.VERSION_BLAKE2B)
    path.write_bytes(bytes(raw))


def test_version_1_files_are_read_never_written(tmp_path: Path) -> None:
    """An index written before the xxh3 change (blake2b hashes, version 1) still answers
    probe and get_all; the next put rolls to a version 2 file; compaction keeps version 1."""
    old = [f"old-{i}" for i in range(20)]
    with IdIndex.open(tmp_path, slots_count=8, entries_max=64) as ids:
        ids.put_many(key_hashes([i.encode() for i in old]), np.full(20, 3_600_000), np.arange(20) * 10,
                     np.full(20, 100), np.arange(1, 21, dtype=np.uint64))
    [f1] = idx_files(tmp_path)
    _as_version_1(f1, old)
    new = [f"new-{i}" for i in range(5)]
    with IdIndex.open(tmp_path, slots_count=8, entries_max=64) as ids:
        raw = [i.encode() for i in old + new]
        assert ids.probe(key_hashes(raw), raw).tolist() == [True] * 20 + [False] * 5
        with pytest.raises(InvalidArgument, match="pass ids"):
            ids.probe(key_hashes(raw))
        assert ids.get_all("old-7") == [loc(8, off=70)]
        for k, i in enumerate(new):
            ids.put(i, loc(30 + k))
        files = idx_files(tmp_path)
        assert len(files) == 2  # rolled off the version 1 file, which was not full
        assert ids.probe(key_hashes(raw), raw).tolist() == [True] * 25
        assert ids.get_all("new-2") == [loc(32)] and ids.get_all("old-19") == [loc(20, off=190)]
        src = ids.compact_source(1)
        built = idindex.build_compacted(src[0], src[1], src[2], np.array([], np.int64), first_seq=1)
        assert ids.swap_compacted(1, built)
        assert ids.get_all("old-3") == [loc(4, off=30)]
    with IdIndex.open(tmp_path, slots_count=8, entries_max=64) as ids:
        assert [idindex.read_header(p, int(p.name[:20])).version for p in idx_files(tmp_path)] == [1, 2]
        assert ids.get_all("old-3") == [loc(4, off=30)] and ids.get_all("new-4") == [loc(34)]


def test_reopen_after_close(tmp_path: Path) -> None:
    with IdIndex.open(tmp_path, slots_count=8, entries_max=7) as ids:
        for seq in range(20):
            ids.put(f"id-{seq % 6}", loc(seq))
    with IdIndex.open(tmp_path, slots_count=8, entries_max=7) as ids:
        assert ids.last_seq() == 19
        for k in range(6):
            assert ids.get_all(f"id-{k}") == [loc(s) for s in reversed(range(k, 20, 6))]
        ids.put("id-0", loc(20))  # continues in the partly filled newest file
        assert ids.get_all("id-0")[0] == loc(20)
        assert ids.file_count() == 3


def test_reopen_with_other_geometry_keeps_old_files_readable(tmp_path: Path) -> None:
    with IdIndex.open(tmp_path, slots_count=4, entries_max=5) as ids:
        for seq in range(12):
            ids.put(f"id-{seq}", loc(seq))
    with IdIndex.open(tmp_path, slots_count=64, entries_max=50) as ids:
        for seq in range(12, 30):
            ids.put(f"id-{seq}", loc(seq))
        for seq in range(30):
            assert ids.get_all(f"id-{seq}") == [loc(seq)]


def test_reopen_after_simulated_crash(tmp_path: Path) -> None:
    old = IdIndex.open(tmp_path, slots_count=4, entries_max=50)
    for seq in range(120):
        old.put(f"id-{seq % 40}", loc(seq))
    old.flush()
    for seq in range(120, 135):  # not flushed: header behind, writes only in the page cache
        old.put(f"id-{seq % 40}", loc(seq))
    ids = IdIndex.open(tmp_path, slots_count=4, entries_max=50)  # the old one is never closed
    assert ids.last_seq() == 134
    for k in range(40):
        assert ids.get_all(f"id-{k}") == [loc(s) for s in reversed(range(k, 135, 40))]
    ids.put("new", loc(135))
    assert ids.get_all("new") == [loc(135)]
    ids.close()
    del old


def _newest(d: Path) -> Path:
    return idx_files(d)[-1]


def test_recovery_relinks_a_committed_but_unlinked_entry(tmp_path: Path) -> None:
    slots, entries = 4, 16
    with IdIndex.open(tmp_path, slots_count=slots, entries_max=entries) as ids:
        for seq in range(5):
            ids.put(f"id-{seq}", loc(seq))
    path = _newest(tmp_path)
    # a kill between "commit" and "link": append entry 5 by hand, leave its slot head alone
    h = key_hash("late")
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 4 * (h % slots))
        (head,) = struct.unpack("<I", f.read(4))
        f.seek(HEADER_SIZE + 4 * slots + 5 * ENTRY_SIZE)
        f.write(idindex.ENTRY.pack(h, 1, 2, 5, 3, head))
    with IdIndex.open(tmp_path, slots_count=slots, entries_max=entries) as ids:
        assert ids.last_seq() == 5
        assert ids.get_all("late") == [IdLocation(1, 2, 3, 5)]
        for seq in range(5):
            assert ids.get_all(f"id-{seq}") == [loc(seq)]


def test_recovery_stops_at_uncommitted_entry_and_reuses_it(tmp_path: Path) -> None:
    slots, entries = 4, 16
    with IdIndex.open(tmp_path, slots_count=slots, entries_max=entries) as ids:
        for seq in range(3):
            ids.put(f"id-{seq}", loc(seq))
    path = _newest(tmp_path)
    with open(path, "r+b") as f:  # killed after step 1: frame_size still 0
        f.seek(HEADER_SIZE + 4 * slots + 3 * ENTRY_SIZE)
        f.write(idindex.ENTRY.pack(key_hash("torn"), 9, 9, 3, 0, 0))
    with IdIndex.open(tmp_path, slots_count=slots, entries_max=entries) as ids:
        assert ids.last_seq() == 2
        assert ids.get_all("torn") == []
        ids.put("fresh", loc(3))
        assert ids.get_all("fresh") == [loc(3)]
        assert ids.get_all("torn") == []


def test_head_pointing_past_entries_is_treated_as_empty(tmp_path: Path) -> None:
    slots, entries = 4, 16
    with IdIndex.open(tmp_path, slots_count=slots, entries_max=entries) as ids:
        ids.put("a", loc(0))
    h = key_hash("b")
    with open(_newest(tmp_path), "r+b") as f:
        f.seek(HEADER_SIZE + 4 * (h % slots))
        f.write(struct.pack("<I", 9))  # points at entry 8 of a file holding 1 entry
    with IdIndex.open(tmp_path, slots_count=slots, entries_max=entries) as ids:
        assert ids.get_all("b") == []
        ids.put("b", loc(1))  # the bogus head is not linked as prev
        assert ids.get_all("b") == [loc(1)]


def test_empty_newest_file_is_removed(tmp_path: Path) -> None:
    with IdIndex.open(tmp_path, slots_count=4, entries_max=2) as ids:
        ids.put("a", loc(0))
        ids.put("b", loc(1))
    # a kill right after the next file was created, before its first entry
    (tmp_path / f"{2:020d}.idx").write_bytes(idindex.pack_header(4, 2, 0, 2, -1) + bytes(4 * 4 + ENTRY_SIZE * 2))
    (tmp_path / f"{3:020d}.idx.tmp").write_bytes(b"half")
    with IdIndex.open(tmp_path, slots_count=4, entries_max=2) as ids:
        assert ids.last_seq() == 1
        assert [p.name for p in tmp_path.iterdir()] == [f"{0:020d}.idx"]
        ids.put("c", loc(2))
        assert ids.get_all("a") == [loc(0)] and ids.get_all("c") == [loc(2)]


@pytest.mark.parametrize("offset", [0, 4, 8, 16, 24, 28, 40, 60])
def test_corrupt_header_raises_corrupt_record(tmp_path: Path, offset: int) -> None:
    with IdIndex.open(tmp_path, slots_count=4, entries_max=4) as ids:
        for seq in range(6):
            ids.put(f"id-{seq}", loc(seq))
    victim = idx_files(tmp_path)[0]
    with open(victim, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(CorruptRecord) as e:
        IdIndex.open(tmp_path, slots_count=4, entries_max=4)
    assert e.value.path == str(victim)


def test_truncated_file_raises_corrupt_record(tmp_path: Path) -> None:
    with IdIndex.open(tmp_path, slots_count=4, entries_max=4) as ids:
        ids.put("a", loc(0))
    victim = idx_files(tmp_path)[0]
    os.truncate(victim, 100)
    with pytest.raises(CorruptRecord) as e:
        IdIndex.open(tmp_path, slots_count=4, entries_max=4)
    assert e.value.path == str(victim)


def test_delete_before_seq(tmp_path: Path) -> None:
    with IdIndex.open(tmp_path, slots_count=4, entries_max=10) as ids:
        for seq in range(45):  # files first_seq 0, 10, 20, 30, 40
            ids.put(f"id-{seq}", loc(seq))
        assert ids.delete_before_seq(0) == 0
        assert ids.delete_before_seq(19) == 1  # [0..9] only; [10..19] has last_seq 19
        assert ids.get_all("id-5") == []
        assert ids.get_all("id-15") == [loc(15)]
        assert ids.delete_before_seq(40) == 3
        assert ids.delete_before_seq(10**9) == 0  # the newest file stays: it carries last_seq
        assert ids.get_all("id-44") == [loc(44)]
        assert ids.last_seq() == 44
    assert [p.name for p in idx_files(tmp_path)] == [f"{40:020d}.idx"]
    with IdIndex.open(tmp_path, slots_count=4, entries_max=10) as ids:
        assert ids.last_seq() == 44


def test_bad_input_changes_nothing(tmp_path: Path) -> None:
    with IdIndex.open(tmp_path, slots_count=4, entries_max=10) as ids:
        ids.put("a", loc(5))
        for bad_id, bad_loc in [("", loc(6)), (b"a", loc(6)), ("\ud800", loc(6)),
                                ("a", IdLocation(0, 0, 0, 6)), ("a", IdLocation(0, -1, 1, 6)),
                                ("a", IdLocation(2**63, 0, 1, 6)), ("a", IdLocation(0, 0, 2**32, 6)),
                                ("a", loc(4)), ("a", (0, 0, 1, 6))]:
            with pytest.raises(InvalidArgument):
                ids.put(bad_id, bad_loc)  # type: ignore[arg-type]
        assert ids.get_all("a") == [loc(5)] and ids.last_seq() == 5
    with pytest.raises(InvalidArgument):
        IdIndex.open(tmp_path, slots_count=0)
    with pytest.raises(Closed):
        ids.get_all("a")


def test_open_files_max_bounds_maps(tmp_path: Path) -> None:
    with IdIndex.open(tmp_path, slots_count=4, entries_max=3, open_files_max=2) as ids:
        for seq in range(30):
            ids.put(f"id-{seq}", loc(seq))
        for seq in range(30):
            assert ids.get_all(f"id-{seq}") == [loc(seq)]
            assert len(ids._mapped) <= 2


# --- Hypothesis: against a dict of lists ------------------------------------------------------

ID_POOL = [f"k{i}" for i in range(12)]
ENTRIES_MAX = 4


class IdIndexModel(RuleBasedStateMachine):
    """Files hold ENTRIES_MAX puts each, so the model knows which puts retention drops."""

    @initialize(slots=st.sampled_from([1, 2, 3, 8]))
    def setup(self, slots: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="idx-model-"))
        self.slots = slots
        self.ids = self._open()
        self.puts: list[tuple[str, IdLocation]] = []  # every put, in order
        self.dropped = 0  # puts at the front that retention removed
        self.seq = 0
        self.stale: list[IdIndex] = []

    def _open(self) -> IdIndex:
        return IdIndex.open(self.dir, slots_count=self.slots, entries_max=ENTRIES_MAX, open_files_max=2)

    @rule(msg_id=st.sampled_from(ID_POOL), step=st.integers(0, 3), bucket=st.integers(-(2**63), 2**63 - 1),
          off=st.integers(0, 2**64 - 1), size=st.integers(1, 2**32 - 1))
    def put(self, msg_id: str, step: int, bucket: int, off: int, size: int) -> None:
        # seqs non-decreasing, but never a whole file of one seq
        if step == 0 and len(self.puts) >= ENTRIES_MAX - 1 and \
                all(p[1].seq == self.seq for p in self.puts[-(ENTRIES_MAX - 1):]):
            step = 1
        self.seq += step
        location = IdLocation(bucket, off, size, self.seq)
        self.ids.put(msg_id, location)
        self.puts.append((msg_id, location))

    @rule(msg_id=st.sampled_from(ID_POOL + ["absent"]))
    def get(self, msg_id: str) -> None:
        want = [p[1] for p in reversed(self.puts[self.dropped:]) if p[0] == msg_id]
        assert self.ids.get_all(msg_id) == want

    @rule()
    def flush(self) -> None:
        self.ids.flush()

    @rule()
    def reopen(self) -> None:
        self.ids.close()
        self.ids = self._open()

    @rule()
    def crash_reopen(self) -> None:
        self.stale.append(self.ids)  # never closed, never flushed again
        self.ids = self._open()

    @precondition(lambda self: len(self.puts) > 0)
    @rule(data=st.data())
    def delete_before(self, data: st.DataObject) -> None:
        seq = data.draw(st.integers(0, self.seq + 2))
        n_files = (len(self.puts) + ENTRIES_MAX - 1) // ENTRIES_MAX
        first_kept_file = self.dropped // ENTRIES_MAX
        want = 0
        for k in range(first_kept_file, n_files - 1):
            if self.puts[(k + 1) * ENTRIES_MAX - 1][1].seq < seq:
                want += 1
            else:
                break
        assert self.ids.delete_before_seq(seq) == want
        self.dropped = (first_kept_file + want) * ENTRIES_MAX if want else self.dropped

    @invariant()
    def last_seq_matches(self) -> None:
        if hasattr(self, "ids"):
            assert self.ids.last_seq() == (self.puts[-1][1].seq if self.puts else -1)

    def teardown(self) -> None:
        if hasattr(self, "ids"):
            self.ids.close()
            shutil.rmtree(self.dir, ignore_errors=True)


TestIdIndexModel = IdIndexModel.TestCase
TestIdIndexModel.pytestmark = [pytest.mark.integration]  # tier: the state machine alone takes over 20 s on a loaded machine
TestIdIndexModel.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


# --- a real process, SIGKILLed -----------------------------------------------------------------

WORKER = r"""
import sys
from node.store.idindex import IdIndex, IdLocation
ids = IdIndex.open(sys.argv[1], slots_count=1 << 10, entries_max=3000)
start = ids.last_seq() + 1        # the caller's replay rule: skip seq <= last_seq()
print("START", start, flush=True)
for seq in range(start, start + 1_000_000):
    ids.put(f"msg-{seq}", IdLocation(seq // 100 * 3_600_000, seq * 64, 64 + seq % 7, seq))
    if seq % 1000 == 999:
        ids.flush()
        print("FLUSHED", seq, flush=True)
"""


def _expected(seq: int) -> IdLocation:
    return IdLocation(seq // 100 * 3_600_000, seq * 64, 64 + seq % 7, seq)


@pytest.mark.slow
def test_sigkill_loses_nothing_flushed(tmp_path: Path) -> None:
    rng = random.Random(1234)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    flushed_max = -1
    for _ in range(5):
        p = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert p.stdout is not None
            start_line = p.stdout.readline().split()
            assert start_line[0] == "START", start_line
            assert int(start_line[1]) > flushed_max  # nothing flushed is indexed again
            flushes_wanted = rng.randint(1, 12)
            for _ in range(flushes_wanted):
                line = p.stdout.readline()
                assert line.startswith("FLUSHED"), (line, p.stderr.read() if p.stderr else "")
                flushed_max = int(line.split()[1])
            # kill at a random point in the next stretch of puts (it may be mid-put or mid-flush)
            spin = rng.randint(0, 200_000)
            while spin:
                spin -= 1
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        with IdIndex.open(tmp_path, slots_count=1 << 10, entries_max=3000) as ids:
            last = ids.last_seq()
            assert last >= flushed_max
            # every flushed id is found, and so is everything last_seq() vouches for, exactly once
            for seq in range(last + 1):
                assert ids.get_all(f"msg-{seq}") == [_expected(seq)], seq
            assert ids.get_all(f"msg-{last + 1}") == []


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=300), st.integers(1, 64), st.integers(2, 50))
def test_put_many_equals_puts_one_by_one_and_probe_agrees(tmp_path_factory, keys, slots, per_file):
    """A batch put links chains exactly like single puts (collisions inside the batch
    included, files rolling mid-batch), and ``probe`` says yes exactly for put ids."""
    a = IdIndex.open(tmp_path_factory.mktemp("a"), slots_count=slots, entries_max=per_file)
    b = IdIndex.open(tmp_path_factory.mktemp("b"), slots_count=slots, entries_max=per_file)
    ids = [f"k{k}" for k in keys]
    n = len(ids)
    for i, mid in enumerate(ids):
        a.put(mid, IdLocation(7, i, 10 + i, i))
    b.put_many(key_hashes([m.encode() for m in ids]), np.full(n, 7), np.arange(n), 10 + np.arange(n), np.arange(n))
    for k in range(61):
        assert a.get_all(f"k{k}") == b.get_all(f"k{k}")
    asked = [f"k{k}" for k in range(70)]
    assert b.probe(key_hashes([m.encode() for m in asked])).tolist() == [m in set(ids) for m in asked]
    assert b.last_seq() == n - 1
    a.close()
    b.close()
