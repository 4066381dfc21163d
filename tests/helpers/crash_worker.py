"""Subprocess for the crash test: appends, iterates, dispatches, until killed.

Usage: python -m tests.helpers.crash_worker DIR RUN SEED [--drain UNTIL_MS]

Prints, one line each, flushed:
  ACK <id> <deliver_at_ms>   after the message's fsync (acknowledged)
  CXLTRY <id>                before a cancel is asked for (a kill before its answer: outcome unknown)
  CXL <id>                   after a cancel's fsync (acknowledged)
  DLV <id> <seq>             when a message is handed to "dispatch" (before the dispatch log)
  READY / DRAINED
"""

from __future__ import annotations

import random
import sys
import time

import numpy as np

from node.delay.store import DelayStore, StoreSettings
from node.store.records import Message

SETTINGS = StoreSettings(message_segment_bytes=64 * 1024, dispatch_segment_bytes=16 * 1024,
                         schedule_segment_bytes=64 * 1024, id_slots=1024, id_entries_max=4096,
                         bucket_ms=10_000)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    root, run, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    drain = "--drain" in sys.argv
    drain_until_ms = int(sys.argv[sys.argv.index("--drain") + 1]) if drain else 0
    rnd = random.Random(seed * 1000 + run)
    store = DelayStore.open(root, SETTINGS, now_ms=now_ms())
    out("READY")
    i = 0
    acked: list[str] = []
    deadline = time.monotonic() + 30
    last_ckpt = time.monotonic()
    while time.monotonic() < deadline:
        t = now_ms()
        if not drain:
            batch = []
            for _ in range(rnd.randint(1, 20)):
                due = t + rnd.randint(-500, 2500)
                batch.append(Message(seq=0, store_ms=0, deliver_at_ms=due, msg_id=f"r{run}-{i}",
                                     subject="crash.test", payload=rnd.randbytes(rnd.randint(0, 300))))
                i += 1
            res = store.accept(batch, now_ms=t)
            store.flush_messages()
            for m, code in zip(batch, res.codes.tolist()):
                if code:
                    raise RuntimeError(f"refused {m.msg_id}: {res.errors}")
                out(f"ACK {m.msg_id} {m.deliver_at_ms}")
                acked.append(m.msg_id)
            if acked and rnd.random() < 0.2:
                victim = rnd.choice(acked)
                out(f"CXLTRY {victim}")  # a kill before the answer leaves the outcome unknown
                try:
                    store.cancel(victim, now_ms=t)
                    store.flush_messages()
                    out(f"CXL {victim}")
                except Exception as e:  # NotFound/TooLate are fine answers
                    out(f"CXLFAIL {victim} {type(e).__name__}")
        store.iterate(limit=None)
        for d in store.poll_due(now_ms=now_ms()):
            for mid, seq in zip(d.batch.id_list(), d.batch.seq.tolist()):
                out(f"DLV {mid} {seq}")
            store.ack_dispatched(d.unit, np.arange(d.batch.n), now_ms=now_ms())
        if time.monotonic() - last_ckpt > 0.05:
            store.checkpoint()
            last_ckpt = time.monotonic()
        # drained: past the last due time, nothing held by the wheel or in flight, and nothing
        # filed still undispatched (a wheel between two loads of a catch-up is empty for a moment)
        if (drain and now_ms() > drain_until_ms and store.pending_in_wheel == 0 and store.inflight == 0
                and not any(store.pending_by_bucket().values())):
            break
        time.sleep(0.002)
    store.close()
    out("DRAINED")


if __name__ == "__main__":
    main()
