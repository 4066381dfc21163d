"""Restart to serving with a large backlog (issue 2 target: at most 2 s with 1,000,000 pending).

A writer subprocess fills a DelayStore with ``--messages`` pending messages (due an
hour ahead, as bench_backlog.py), checkpointing every ``--checkpoint-every``; the
last ``--tail`` messages are durable in the message log but neither filed nor
checkpointed, and the writer is SIGKILLed. Then, each in a fresh process:

1. ``after_kill``: open (recovery of every log, replay of the tail into the schedule
   log and id index), one lookup, one poll: the time until the store serves;
2. ``after_clean_close``: the same after the previous open closed the store cleanly.

``import_s`` (Python importing the node) is reported apart: it is the same for an
empty store. Page cache is warm (the files were just written); a cold cache adds
the time to read the recovered tail segments from disk.

    python bench/bench_restart.py --messages 1000000 --tail 20000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, dir_bytes, emit  # noqa: E402

import bench_backlog  # noqa: E402


def writer(root: str, messages: int, payload: int, checkpoint_every: int, tail: int) -> None:
    bench_backlog.build(root, messages, payload, 5000, checkpoint_every, unfiled_tail=tail)
    print("ready", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # abandon: no close, no last checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=1_000_000)
    p.add_argument("--payload", type=int, default=256)
    p.add_argument("--checkpoint-every", type=int, default=100_000)
    p.add_argument("--tail", type=int, default=20_000,
                   help="durable but unfiled at the kill (the service files within ms; 20,000 is generous)")
    p.add_argument("--dir", default=None)
    p.add_argument("--writer", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.writer:
        writer(a.writer, a.messages, a.payload, a.checkpoint_every, a.tail)
        return

    root = tempfile.mkdtemp(prefix="hg-bench-restart-", dir=a.dir)
    try:
        w = subprocess.run([sys.executable, __file__, "--writer", root, "--messages", str(a.messages),
                            "--payload", str(a.payload), "--checkpoint-every", str(a.checkpoint_every),
                            "--tail", str(a.tail)], cwd=REPO, capture_output=True, text=True, timeout=3600)
        assert w.returncode == -signal.SIGKILL and "ready" in w.stdout, w.stderr[-3000:]
        after_kill = bench_backlog.reopen_in_subprocess(root, bench_backlog.T0 + 1000)
        after_clean = bench_backlog.reopen_in_subprocess(root, bench_backlog.T0 + 2000)
        for name, r in (("after_kill", after_kill), ("after_clean_close", after_clean)):
            emit({"bench": "restart_to_serving", "case": name, "messages": a.messages,
                  "to_serving_s": r["to_serving_s"], "open_s": r["open_s"], "import_s": r["import_s"],
                  "replayed_records": r["replayed_records"], "disk_mb": round(dir_bytes(root) / 2**20),
                  "target": "to_serving_s <= 2 with 1,000,000 pending",
                  "settings": {"payload_bytes": a.payload, "checkpoint_every": a.checkpoint_every,
                               "unfiled_tail_at_kill": a.tail, "page_cache": "warm"}})
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
