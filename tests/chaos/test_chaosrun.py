"""``cluster/chaosrun.py``, the pieces both chaos runners share (the harness and ``hourglass dev
chaos``): the files the checker reads and the timing of fault lanes."""

from __future__ import annotations

import asyncio
import json

from cluster.chaosplan import Fault
from cluster.chaosrun import RECORD_NAMES, Recorder, play_lanes, record_send, send_ticks, wait_until
from cluster.clock import wall_ms


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_recorder_writes_one_json_line_per_event_and_the_send_record_the_checker_reads(tmp_path):
    rec = Recorder(tmp_path / "out")
    record_send(rec, "m1", "s.a", deliver_at=10, t_req=1, t_ack=2, error=None, delay_groups=["delay-g1", "delay-g2"])
    record_send(rec, "m2", "s.a", deliver_at=10, t_req=1, t_ack=3, error=TimeoutError("slow"), delay_groups=[])
    rec.close()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(f"{n}.jsonl" for n in RECORD_NAMES)
    ok, failed = lines(tmp_path / "out" / "sends.jsonl")
    assert ok["ok"] and ok["error"] is None and ok["delay_group"] in ("delay-g1", "delay-g2")
    assert not failed["ok"] and failed["error"] == "TimeoutError: slow" and failed["delay_group"] is None
    assert (ok["id"], ok["subject"], ok["deliver_at"], ok["t_req"], ok["t_ack"]) == ("m1", "s.a", 10, 1, 2)


async def test_play_lanes_plays_every_lane_in_order_and_records_each_fault(tmp_path):
    rec = Recorder(tmp_path)
    plan = [Fault(index=0, at_s=0.0, kind="meta_stall", target=0, hold_s=0.1, lane="pauses"),
            Fault(index=1, at_s=0.0, kind="delay_master_kill", target=0, hold_s=0.0, lane="main"),
            Fault(index=2, at_s=0.0, kind="meta_stall", target=1, hold_s=0.1, lane="pauses")]
    played = []

    async def inject(name, i, faults):
        played.append((name, i, faults[i].index))
        return {"index": faults[i].index, "lane": name}
    # every fault is due already (t0 in the past): nothing waits
    await play_lanes(plan, wall_ms() - 60_000, asyncio.Event(), rec, inject)
    rec.close()
    assert sorted(played) == [("main", 0, 1), ("pauses", 0, 0), ("pauses", 1, 2)]
    assert [e["index"] for e in lines(tmp_path / "faults.jsonl") if e["lane"] == "pauses"] == [0, 2]


async def test_a_stopped_workload_plays_no_more_faults(tmp_path):
    rec = Recorder(tmp_path)
    stop = asyncio.Event()
    stop.set()
    plan = [Fault(index=0, at_s=0.0, kind="meta_stall", target=0, hold_s=0.1, lane="main")]

    async def inject(name, i, faults):
        raise AssertionError("played after the stop")
    await play_lanes(plan, wall_ms(), stop, rec, inject)
    rec.close()
    assert (tmp_path / "faults.jsonl").read_text() == ""


async def test_wait_until_returns_the_first_true_answer():
    answers = iter([None, 0, "master-1"])

    async def pred():
        return next(answers)
    assert await wait_until(pred, 30.0) == "master-1"


async def test_send_ticks_awaits_every_answer_before_it_returns():
    stop = asyncio.Event()
    sent, answered = [], []

    async def answer(k):
        await asyncio.sleep(0)
        answered.append(k)

    async def tick():
        k = len(sent)
        sent.append(k)
        if k == 4:
            stop.set()
        return None if k == 2 else answer(k)  # tick 2 sent nothing
    await send_ticks(stop, 0.0, tick)
    assert sent == [0, 1, 2, 3, 4] and sorted(answered) == [0, 1, 3, 4]
