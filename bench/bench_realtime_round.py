"""The real-time node's store work per firing round, without gRPC: append one dispatched
frame of ``--n`` messages over 16 subjects, pull it for one group over all 16 subjects,
ack it; microseconds per round for each step.

    python bench/bench_realtime_round.py --n 60 --rounds 3000

(docs/benchmarks.md, "Sixth session": the per-round cost that makes the real-time node's
CPU per message large at low rates.)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.codec import Batch  # noqa: E402
from cluster.wire import pack_ranges  # noqa: E402
from node.realtime.store import RealtimeStore  # noqa: E402

SUBJECTS = [f"s{i:02d}" for i in range(16)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=60, help="messages per round")
    p.add_argument("--rounds", type=int, default=3000)
    a = p.parse_args()
    now = int(time.time() * 1000)
    with tempfile.TemporaryDirectory() as d:
        st = RealtimeStore.open(d, now_ms=now)
        for s in SUBJECTS:
            st.create_subject(s)
        pay = b"x" * 256
        batches = []
        for r in range(a.rounds):
            k = r * a.n
            batches.append(Batch.build([SUBJECTS[(k + i) % 16] for i in range(a.n)], [pay] * a.n,
                                       [f"m{k + i}" for i in range(a.n)], np.full(a.n, now, np.int64)))
        t_append = t_pull = t_ack = 0.0
        cpu0 = time.process_time()
        for b in batches:
            t = time.perf_counter()
            st.append(b, now_ms=now)
            t_append += time.perf_counter() - t
            t = time.perf_counter()
            got, h = st.pull(SUBJECTS, "g", "c", max_messages=1000, now_ms=now)
            t_pull += time.perf_counter() - t
            subj = np.array(got.subject_list())
            acks = [(s, pack_ranges(h[subj == s])) for s in sorted(set(subj.tolist()))]  # as a consumer sends them
            t = time.perf_counter()
            st.ack_many("g", acks, now_ms=now)
            t_ack += time.perf_counter() - t
        cpu = time.process_time() - cpu0
        st.close()
    n = a.rounds
    print(f"n={a.n} messages/round, {n} rounds: append {t_append / n * 1e6:.0f} us, pull {t_pull / n * 1e6:.0f} us, "
          f"ack {t_ack / n * 1e6:.0f} us per round; CPU {cpu / (n * a.n) * 1e6:.2f} us per message")


if __name__ == "__main__":
    main()
