"""Draining a delay group: the pure rules of ``node/delay/drain.py`` and ``metaserver/drains.py``,
and a moved tombstone in a real ``DelayStore`` (time passed in, no processes)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from cluster.client import group_for
from cluster.codec import KIND_CANCEL, Batch
from cluster.errors import InvalidArgument
from metaserver.drains import check_drain
from node.config import NodeSettings
from node.delay import drain, lookup
from tests.test_delay_store import T0, Harness, fire, msg

GROUPS = [("delay-g1", "127.0.0.1:1"), ("delay-g3", "127.0.0.1:3")]


def _batch(dues, ids=None):
    ids = ids or [f"id-{i}" for i in range(len(dues))]
    return Batch.build("s", [b"p"] * len(dues), ids, dues, seq=np.arange(1, len(dues) + 1))


def test_plan_moves_keeps_near_messages_and_sends_far_ones_to_the_sdk_home():
    now, horizon = T0, 5_000
    b = _batch([now + 1_000, now + 4_999, now + 5_000, now + 60_000, now + 3_600_000])
    live = np.array([True, True, True, True, False])
    plan = drain.plan_moves(b, live, now_ms=now, horizon_ms=horizon, groups=GROUPS)
    assert plan.near == 2 and plan.unplaced == 0
    moved = {int(i): g for g, idx in plan.moves.items() for i in idx.tolist()}
    assert sorted(moved) == [2, 3]  # due at or past the horizon, live; the dead one stays
    for i, g in moved.items():  # the SDK's own rule: cancel and lookup ask that group first
        assert g == group_for(b.id(i), GROUPS)


def test_plan_moves_leaves_messages_whose_target_has_no_master_for_a_later_round():
    groups = [("delay-g1", ""), ("delay-g3", "127.0.0.1:3")]
    ids = [f"x{i}" for i in range(40)]
    b = _batch([T0 + 10_000] * 40, ids)
    plan = drain.plan_moves(b, np.ones(40, bool), now_ms=T0, horizon_ms=5_000, groups=groups)
    to_g1 = sum(1 for i in ids if zlib.crc32(i.encode()) % 2 == 0)
    assert plan.unplaced == to_g1 and 0 < to_g1 < 40
    assert list(plan.moves) == ["delay-g3"] and len(plan.moves["delay-g3"]) == 40 - to_g1


def test_plan_moves_with_no_other_group_moves_nothing():
    b = _batch([T0 + 10_000, T0 + 1])
    plan = drain.plan_moves(b, np.ones(2, bool), now_ms=T0, horizon_ms=5_000, groups=[])
    assert plan.moves == {} and plan.near == 1


def test_live_mask_skips_tombstones_their_targets_and_what_is_not_pending():
    b = Batch.build("s", [b"a", b"b", (2).to_bytes(8, "little"), b"d"], ["a", "b", "b", "d"],
                    [T0 + 9_000] * 4, seq=np.array([1, 2, 3, 4]), kind=np.array([1, 1, KIND_CANCEL, 1]))
    cancelled = drain.tombstone_targets(b)
    assert cancelled == {2}
    live = drain.live_mask(b, cancelled=cancelled, status_of=lambda seq, eff: "in_flight" if seq == 4 else "pending")
    assert live.tolist() == [True, False, False, False]


def test_moved_extra_round_trips_and_a_plain_cancel_is_not_a_move(tmp_path):
    h = Harness(tmp_path)
    h.send([msg(1, T0 + 60_000), msg(2, T0 + 60_000)])
    h.store.cancel("m1", now_ms=h.now, extra=drain.moved_extra("delay-g1"))
    h.store.cancel("m2", now_ms=h.now)
    h.store.flush_messages()
    h.store.iterate(limit=None)
    assert drain.moved_to(lookup.find(h.store, "m1")[0]) == "delay-g1"
    assert drain.moved_to(lookup.find(h.store, "m2")[0]) is None
    assert sum(h.store.pending_by_bucket().values()) == 0  # a moved message is no longer pending here
    h.crash()  # the tombstone is in the message log: it survives a restart (and replicates)
    assert drain.moved_to(lookup.find(h.store, "m1")[0]) == "delay-g1"
    h.run_until(T0 + 61_000, step=500)
    assert h.delivered == []


def test_state_of():
    assert drain.state_of(False, 5, 0, 0) == "serving"
    assert drain.state_of(True, 5, 0, 0) == "draining"
    assert drain.state_of(True, 0, 1, 0) == "draining"
    assert drain.state_of(True, 0, 0, 1) == "draining"
    assert drain.state_of(True, 0, 0, 0) == "empty"


def test_check_drain_refuses_unknown_groups_and_the_last_group_not_draining():
    check_drain("delay-g2", {"delay-g1", "delay-g2"}, set())
    check_drain("delay-g2", {"delay-g2"}, {"delay-g2"})  # already draining: asked again, fine
    with pytest.raises(InvalidArgument, match="no registered delay group"):
        check_drain("delay-g9", {"delay-g1", "delay-g2"}, set())
    with pytest.raises(InvalidArgument, match="last delay group"):
        check_drain("delay-g1", {"delay-g1", "delay-g2"}, {"delay-g2"})


# ---------------------------------------------------------------------- the shell, with fakes


class _Target:
    """A target group's master: holds what it was sent (by id), answers re-sends as duplicates."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.cancelled: set[str] = set()

    async def SendBatch(self, req, timeout):
        from cluster.wire import BatchResult
        b = Batch.decode(req.batch)
        res = BatchResult.sized(b.n)
        for i in range(b.n):
            res.duplicates[i] = b.id(i) in self.held
            self.held[b.id(i)] = int(b.deliver_at_ms[i])
        return res.to_pb()

    async def Cancel(self, req, timeout):
        from cluster.proto import hourglass_pb2 as pb
        self.cancelled.add(req.id)
        return pb.CancelResponse(code=pb.OK)


def _rpc_down():
    import grpc

    class Down(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "down"

        def trailing_metadata(self):
            return ()
    return Down()


class _FakeNode:
    def __init__(self, store, now, targets):
        from types import SimpleNamespace as NS
        self.settings = NodeSettings(group="delay-g2", drain_horizon_ms=5_000, drain_batch_max=3, drain_round_max=1_000)
        self.now = now
        self.clock = NS(now_ms=lambda: self.now)
        self.store = store
        self.synced = []

        async def sync_to(end):
            store.flush_messages()
            self.synced.append(end)
        self.role = NS(store=store, committer=NS(sync_to=sync_to))
        self.channels = NS(producer=lambda address: targets[address])
        self.disk = NS(admit=lambda n: None)

    def _note_durable(self):
        pass


async def test_a_round_moves_far_messages_then_writes_tombstones_and_a_rerun_after_a_crash_is_deduplicated(tmp_path):
    h = Harness(tmp_path)
    h.send([msg(i, T0 + (1_000 if i < 3 else 30_000 + i)) for i in range(12)])  # m0-m2 near, m3-m11 far
    h.store.cancel("m4", now_ms=h.now)  # cancelled before its move: never moved
    h.store.flush_messages()
    h.store.iterate(limit=None)
    targets = {"a:1": _Target(), "a:3": _Target()}
    node = _FakeNode(h.store, T0, targets)
    task = drain.DrainTask(node)
    task.draining = True
    task.groups = [("delay-g1", "a:1"), ("delay-g3", "a:3")]
    task.masters = dict(task.groups)
    await task.round()
    held = {i: g for g, t in zip(("delay-g1", "delay-g3"), targets.values()) for i in t.held}
    assert sorted(held) == sorted(f"m{i}" for i in range(3, 12) if i != 4)
    for msg_id, g in held.items():
        assert g == group_for(msg_id, task.groups)  # the SDK's home among the others
        assert drain.moved_to(lookup.find(h.store, msg_id)[0]) == g
    assert all(t.held[i] == T0 + 30_000 + int(i[1:]) for t in targets.values() for i in t.held)  # due unchanged
    assert task.near == 3 and task.counters["moved"] == 8
    h.store.iterate(limit=None)
    assert sum(h.store.pending_by_bucket().values()) == 3  # the near ones, fired here
    assert task.status()["state"] == "draining"
    h.run_until(T0 + 2_000, step=100)
    assert sorted(h.delivered) == ["m0", "m1", "m2"]
    h.store.iterate(limit=None)
    assert task.status()["state"] == "empty"
    await task.round()  # nothing left to move
    assert task.counters["moved"] == 8 and task.counters["duplicates"] == 0
    h.run_until(T0 + 70_000, step=1_000)
    assert sorted(h.delivered) == ["m0", "m1", "m2"]  # moved and cancelled ones never fire here


async def test_a_move_the_target_did_not_acknowledge_writes_nothing_and_is_sent_again(tmp_path):
    h = Harness(tmp_path)
    h.send([msg(i, T0 + 60_000) for i in range(4)])
    down = _Target()

    async def refuse(req, timeout):
        raise _rpc_down()
    down.SendBatch = refuse
    node = _FakeNode(h.store, T0, {"a:1": down})
    task = drain.DrainTask(node)
    task.draining = True
    task.groups = [("delay-g1", "a:1")]
    task.masters = dict(task.groups)
    await task.round()
    assert task.counters["moved"] == 0 and node.synced == []
    assert lookup.lookup(h.store, "m0").status == "pending"
    up = _Target()
    up.held["m1"] = T0 + 60_000  # acknowledged there before a crash, its tombstone lost: a duplicate
    node.channels.producer = lambda address: up
    await task.round()
    assert task.counters["moved"] == 4 and task.counters["duplicates"] == 1
    assert all(drain.moved_to(lookup.find(h.store, f"m{i}")[0]) == "delay-g1" for i in range(4))
