"""CPU per message of the SDK alone (``shared/ARCHITECTURE.md`` budget: <= 2 us each for
the producer and the consumer), against the fake v2 node (``tests/helpers/fake_node.py``)
running in its own process, so that this process's CPU is the SDK's (and gRPC's).

* producer: ``send_many`` calls of ``--call`` messages (256 B, 16 subjects, ids made
  by the SDK, relative delays), ``--n`` messages in all; the fake answers OK at once;
* consumer: ``batches()`` over 16 subjects; the fake answers every pull with the same
  ``--call``-message batch; per batch the loop reads ids and ``lateness_ms`` (what the
  benchmark consumer records) and acks the batch.

``--user``: the calls as ``bench/e2e_user.py``'s client makes them (issue 28): every producer
call awaited before the next, with its own ids, a subject per message and a delay per message
(built before the clock starts: the SDK's cost alone); the consumer reads ``ids`` and
``payloads`` of each batch (``--call 40``: the small batches a 20k/s lookahead consumer gets).

One JSON line per path; ``--profile`` writes a cProfile of each path next to it.

    python bench/bench_sdk.py --n 200000
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, cpu_s, emit  # noqa: E402

from cluster.client import Consumer, Producer, StaticResolver  # noqa: E402

SUBJECTS = [f"bench.s{i}" for i in range(16)]
START_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 300.0


class FakeNodeProcess:
    """``python -m tests.helpers.fake_node`` on a free port; stopped by its PID."""

    def __init__(self, endless_n: int = 0) -> None:
        self.port_file = Path(tempfile.mkdtemp(prefix="hg-bench-sdk-")) / "address"
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.fake_node", str(self.port_file),
                                      str(endless_n)], cwd=REPO)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.port_file.exists() or not self.port_file.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("fake node did not start")
            time.sleep(0.02)
        self.address = self.port_file.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


async def produce(address: str, n: int, call: int, inflight: int) -> int:
    payloads = [bytes(256)] * call
    subjects = [SUBJECTS[i % 16] for i in range(call)]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    accepted = 0
    async with Producer(StaticResolver(delay=[address]), batch_max=call, inflight_max=inflight) as p:
        futs = []
        for _ in range(n // call):
            futs.append(await p.send_many(subjects, payloads, delay_ms=3_600_000))
            if len(futs) >= inflight:
                accepted += len((await futs.pop(0)).ids)
            if time.monotonic() > deadline:
                break
        for f in futs:
            accepted += len((await f).ids)
    return accepted


async def produce_user(address: str, n: int, call: int, inflight: int) -> int:
    calls = []
    for k in range(n // call):
        blob = os.urandom(256 * call)
        calls.append(([SUBJECTS[i % 16] for i in range(call)], [blob[j:j + 256] for j in range(0, len(blob), 256)],
                      [f"user-{k}-{i}" for i in range(call)], [1000 + (i * 37 + k) % 4000 for i in range(call)]))
    accepted = 0
    async with Producer(StaticResolver(delay=[address])) as p:
        c0 = cpu_s()
        for subjects, payloads, ids, delays in calls:
            accepted += len((await (await p.send_many(subjects, payloads, ids=ids, delay_ms=delays))).ids)
        MEASURED["cpu_s"] = cpu_s() - c0
    return accepted


MEASURED: dict[str, float] = {}  # a path's own measured CPU (the user paths leave out their inputs' building)


async def consume(address: str, n: int, *, user: bool = False) -> int:
    """``batches()`` until ``n`` messages: per batch the ids and lateness (what the benchmark
    consumer records), or with ``user`` the ids and payloads, with the SDK's default pull wait
    and this path's own CPU in ``MEASURED`` (e2e_user's consumer)."""
    got = 0
    deadline = time.monotonic() + RUN_TIMEOUT_S
    kw = {} if user else {"wait_ms": 200}
    async with Consumer(StaticResolver(realtime=[address]), SUBJECTS, group="bench", **kw) as c:
        c0 = cpu_s()
        async for rb in c.batches():
            ids, other = rb.ids, (rb.payloads if user else rb.lateness_ms)
            got += len(ids)
            assert len(other) == len(ids)
            await rb.ack()
            if got >= n or time.monotonic() > deadline:
                break
        if user:
            MEASURED["cpu_s"] = cpu_s() - c0
    return got


async def consume_user(address: str, n: int) -> int:
    return await consume(address, n, user=True)


def measure(name: str, fn, args, profile: str | None) -> dict:
    prof = cProfile.Profile() if profile else None
    c0, t0 = cpu_s(), time.perf_counter()
    if prof:
        prof.enable()
    count = asyncio.run(fn(*args))
    if prof:
        prof.disable()
        prof.dump_stats(f"{profile}.{name}.prof")
    cpu, wall = MEASURED.pop("cpu_s", cpu_s() - c0), time.perf_counter() - t0
    return {"bench": "sdk", "path": name, "messages": count, "cpu_s": round(cpu, 3),
            "us_per_msg": round(cpu / max(1, count) * 1e6, 2), "msgs_per_s_wall": round(count / wall),
            "budget_us_per_msg": 2.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--call", type=int, default=1000, help="messages per send_many call / per pulled batch")
    p.add_argument("--inflight", type=int, default=8)
    p.add_argument("--user", action="store_true", help="the calls as bench/e2e_user.py's client makes them")
    p.add_argument("--profile", default=None, help="write cProfile stats to PROFILE.<path>.prof")
    a = p.parse_args()
    fake = FakeNodeProcess()
    try:
        emit(measure("producer.send_many" + ".user" * a.user, produce_user if a.user else produce,
                     (fake.address, a.n, a.call, a.inflight), a.profile))
    finally:
        fake.stop()
    fake = FakeNodeProcess(endless_n=a.call)
    try:
        emit(measure("consumer.batches" + ".user" * a.user, consume_user if a.user else consume, (fake.address, a.n),
                     a.profile))
    finally:
        fake.stop()


if __name__ == "__main__":
    main()
