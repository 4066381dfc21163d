"""What both chaos runners do alike: ``tests/chaos/harness.py`` (on a ``LocalCluster`` it starts)
and ``hourglass dev chaos`` (``cluster/devchaos.py``, on a running ``dev up`` cluster) record
the same files, probe nodes, consume and sample the machine the same way, and play fault lanes
on the same clock. Each runner keeps only what differs: its cluster, what its producer sends, how
it finds and hits a fault's target.

* ``Recorder``: the files the checker (``cluster/chaoscheck.py``) reads, one JSON lines file
  per event kind (``RECORD_NAMES``), flushed per line (a crash of the runner keeps them);
  ``record_send`` writes one answered send;
* ``send_ticks``: the producer's loop, one tick of messages every period, their answers
  awaited beside it (a bounded number at once);
* ``node_statuses``: name -> the node's ``Status`` document; ``wait_until``: a predicate's first
  true answer within a time;
* ``consume``: one consumer group on one subject, every receive recorded, every batch acked
  and the ack's answer recorded (``ack_answers``: ok or the error; the checker tells a message that
  came again after a failed ack, at-least-once, from one that came again after an answered
  ack), pulls retried with a backoff;
* ``sample_load``: the machine's 1-minute load average every ``LOAD_SAMPLE_S``;
* ``play_lanes``: the lanes of a fault plan side by side (``cluster/chaosplan.py`` ``lanes``),
  each fault at ``t0_ms + at_s``, its record written when it is done; a lane stops when the
  workload does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from cluster import errors as E
from cluster.chaosfaults import stopped_within
from cluster.chaosplan import Fault, lanes
from cluster.client import Consumer, group_for
from cluster.clock import wall_ms as now_ms
from cluster.proto import hourglass_pb2 as pb

RECORD_NAMES = ("sends", "cancels", "receives", "ack_answers", "faults", "load")
STATUS_TIMEOUT_S = 2.0
POLL_S = 0.1
LOAD_SAMPLE_S = 1.0
PULL_BACKOFF_S_MAX = 1.0
CONSUME_WAIT_MS = 300
SEND_BATCHES_INFLIGHT_MAX = 64  # ticks whose answers are awaited at once


class Recorder:
    """JSON lines, one file per event kind, flushed per line (a crash of the runner keeps them)."""

    NAMES = RECORD_NAMES

    def __init__(self, out_dir: Path) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files = {n: open(self.dir / f"{n}.jsonl", "a", buffering=1) for n in self.NAMES}

    def write(self, _file: str, **event) -> None:
        self.files[_file].write(json.dumps(event, separators=(",", ":")) + "\n")

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def record_send(rec: Recorder, mid: str, subject: str, deliver_at: int, t_req: int, t_ack: int,
                error: BaseException | None, delay_groups: list[str]) -> None:
    """One answered send: ``ok`` unless ``error``; ``delay_group`` is the group the id hashes
    to (``cluster.client.group_for``), None when the runner knows no group names."""
    groups = [(g, "") for g in delay_groups]
    rec.write("sends", id=mid, subject=subject, deliver_at=deliver_at, t_req=t_req, t_ack=t_ack,
              ok=error is None, error=None if error is None else f"{type(error).__name__}: {error}"[:200],
              delay_group=group_for(mid, groups) if groups else None)


async def send_ticks(stop: asyncio.Event, period_s: float,
                     tick: Callable[[], Awaitable[Awaitable | None]]) -> None:
    """The producer's loop: ``tick()`` every ``period_s`` until ``stop``; it sends one tick's
    messages and returns what awaits their answers (or None: nothing sent), which runs as a
    task, at most ``SEND_BATCHES_INFLIGHT_MAX`` at once (a tick waits for a free one). Returns
    when every answer is in."""
    inflight = asyncio.Semaphore(SEND_BATCHES_INFLIGHT_MAX)
    tasks: set[asyncio.Task] = set()

    async def answers(waiting: Awaitable) -> None:
        try:
            await waiting
        finally:
            inflight.release()
    while not stop.is_set():
        waiting = await tick()
        if waiting is not None:
            await inflight.acquire()
            t = asyncio.create_task(answers(waiting))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        await stopped_within(stop, period_s)
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


async def node_statuses(channels, addresses: Mapping[str, str]) -> dict[str, dict]:
    """name -> the node's ``Status`` JSON document plus ``master`` and ``group``, for the nodes
    of ``addresses`` (name -> address) that answer within ``STATUS_TIMEOUT_S``."""
    out = {}
    for name, address in addresses.items():
        try:
            r = await channels.admin(address).Status(pb.StatusRequest(), timeout=STATUS_TIMEOUT_S)
        except Exception:  # a node that does not answer is not listed
            continue
        out[name] = json.loads(r.json) | {"master": r.master, "group": r.group}
    return out


async def wait_until(pred: Callable[[], Awaitable], timeout_s: float):
    """The predicate's first true answer, polled every POLL_S; None after ``timeout_s`` (a slow
    predicate, e.g. Status calls to frozen nodes, is cut at the deadline too)."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                got = await pred()
                if got:
                    return got
                await asyncio.sleep(POLL_S)
    except TimeoutError:
        return None


async def consume(resolver, subject: str, group: str, rec: Recorder, stop: asyncio.Event, *,
                  on_receive: Callable[[object], None] | None = None, log: logging.Logger | None = None) -> None:
    """Pull ``subject`` in consumer group ``group`` until ``stop``: every message is written to
    ``receives`` (and given to ``on_receive``), every batch acked and its answer written to
    ``ack_answers`` (one line per batch: its ids, when the ack was asked and answered, ok). A failed
    pull is tried again after a backoff (up to ``PULL_BACKOFF_S_MAX``); ``log`` hears of
    failures other than Unavailable (a failover) and of failed acks."""
    failures = 0
    async with Consumer(resolver, subject, group=group, wait_ms=CONSUME_WAIT_MS,
                        consumer_id=f"chaos-{group}-{subject}") as c:
        while not stop.is_set():
            try:
                batch = await c.pull()
            except Exception as e:
                failures += 1
                if log is not None and not isinstance(e, E.Unavailable):
                    log.warning("pull %s/%s: %s: %s", subject, group, type(e).__name__, e)
                await asyncio.sleep(min(PULL_BACKOFF_S_MAX, 0.05 * failures))
                continue
            failures = 0
            t = now_ms()
            for m in batch:
                rec.write("receives", id=m.id, wire_id=m.wire_id, subject=subject, group=group, t=t,
                          deliver_at=m.deliver_at_ms, attempts=m.attempts)
                if on_receive is not None:
                    on_receive(m)
            error = None
            try:
                await c.ack(batch)
            except Exception as e:  # unacked messages come back: at-least-once
                error = f"{type(e).__name__}: {e}"[:200]
                if log is not None:
                    log.info("ack %s/%s failed: %s", subject, group, e)
            if batch:
                rec.write("ack_answers", ids=[m.id for m in batch], subject=subject, group=group, t_req=t,
                          t_ans=now_ms(), ok=error is None, error=error)


async def sample_load(rec: Recorder, stop: asyncio.Event) -> None:
    """The machine's 1-minute load average every LOAD_SAMPLE_S until ``stop``."""
    while not await stopped_within(stop, LOAD_SAMPLE_S):
        rec.write("load", t=now_ms(), load1=float(Path("/proc/loadavg").read_text().split()[0]))


async def play_lanes(plan: list[Fault], t0_ms: int, stop: asyncio.Event, rec: Recorder,
                     inject: Callable[[str, int, list[Fault]], Awaitable[dict]]) -> None:
    """Every lane of ``plan`` side by side: fault ``i`` of lane ``name`` at ``t0_ms + at_s``
    (``inject(name, i, faults)`` plays it and returns its record, written to ``faults``); a
    lane ends when ``stop`` is set. A lane that fails fails the whole (a TaskGroup)."""
    async def lane(name: str, faults: list[Fault]) -> None:
        for i, f in enumerate(faults):
            if stop.is_set():
                break
            delay = t0_ms / 1000 + f.at_s - time.time()
            if delay > 0 and await stopped_within(stop, delay):
                break
            rec.write("faults", **await inject(name, i, faults))

    async with asyncio.TaskGroup() as tg:
        for name, faults in lanes(plan).items():
            tg.create_task(lane(name, faults), name=f"lane-{name}")
