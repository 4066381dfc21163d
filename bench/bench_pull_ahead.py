"""CPU of one lookahead pull (``RealtimeStore.pull_ahead``) in process, no network: a store
with ``--subjects`` subjects; each round appends ``--per-round`` messages over them, due
40-60 ms ahead (as a delay node dispatches with its lead), then pulls four times 10 ms apart
with a 60 ms lookahead (as the SDK's consumer). Prints CPU us per pull.

    python bench/bench_pull_ahead.py --rounds 300 --per-round 16
    python bench/bench_pull_ahead.py --rounds 200 --per-round 200
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cluster.codec import Batch  # noqa: E402
from node.realtime.store import RealtimeSettings, RealtimeStore  # noqa: E402

T0 = 1_800_000_000_000
PULLS_PER_ROUND = 4
STEP_MS = 10
LOOKAHEAD_MS = 60


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--per-round", type=int, default=16)
    p.add_argument("--subjects", type=int, default=16)
    a = p.parse_args()
    cfg = RealtimeSettings(segment_bytes=1 << 26, ack_timeout_ms=600_000, visible_hold_ms_max=100,
                           visible_step_ms=4)
    with tempfile.TemporaryDirectory() as d:
        st = RealtimeStore.open(d, cfg, now_ms=T0)
        subjects = [f"s{i}" for i in range(a.subjects)]
        for s in subjects:
            st.create_subject(s, now_ms=T0)
        now, k, cpu, pulls, got = T0, 0, 0.0, 0, 0
        for _ in range(a.rounds):
            n = a.per_round
            st.append(Batch.build([subjects[i % len(subjects)] for i in range(n)], [b"x" * 256] * n,
                                  [f"m{k + i}" for i in range(n)], [now + 40 + i % 20 for i in range(n)]), now_ms=now)
            k += n
            for _ in range(PULLS_PER_ROUND):
                now += STEP_MS
                t = time.process_time()
                b, _ = st.pull_ahead(subjects, "g", "c", max_messages=500, now_ms=now, lookahead_ms=LOOKAHEAD_MS)
                cpu += time.process_time() - t
                pulls += 1
                got += b.n
        st.close()
    print(json.dumps({"bench": "pull_ahead", "subjects": a.subjects, "per_round": a.per_round, "pulls": pulls,
                      "messages": got, "cpu_us_per_pull": round(cpu / pulls * 1e6, 1)}))


if __name__ == "__main__":
    main()
