"""Where a send's time goes on the nodes, from their own histograms, over a window of a run.

Start a benchmark whose nodes export metrics on free ports, then point this at them:

    python3 bench/bench_e2e.py --client user --systems hourglass --phases sustain --rates 20000 \\
        --sustain-s 40 --node-env HOURGLASS_METRICS_PORT=0 &
    python3 bench/scrape_hist.py --match hg-bench-e2e-user --after-s 15 --window-s 30

It finds the node processes whose command line holds ``--match`` (by PID, never by name
alone), finds each one's metrics port among its listening sockets (the one answering
``/metrics``), scrapes ``--after-s`` seconds from now and again ``--window-s`` later, and
prints, per node, the count, mean and bucket-bound p50/p90/p99/p999 of what happened in
between for ``hourglass_send_seconds``, ``hourglass_wal_fsync_seconds`` and
``hourglass_wal_fsync_handback_seconds`` (docs/operations.md). A quantile is the upper
bound of the bucket it falls in, so it reads "at most". One JSON line per node goes to
stdout after the table.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
import urllib.request

import psutil
from prometheus_client.parser import text_string_to_metric_families

HISTOGRAMS = ("hourglass_send_seconds", "hourglass_wal_fsync_seconds", "hourglass_wal_fsync_handback_seconds")
QUANTILES = (0.5, 0.9, 0.99, 0.999)
FIND_TIMEOUT_S = 60.0  # how long to wait for the nodes to come up and listen
SCRAPE_TIMEOUT_S = 3.0


def node_processes(match: str) -> dict[str, int]:
    """``{role-node-id: pid}`` of the node processes whose command line holds ``match``."""
    out = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "node" in cmd and "--role" in cmd and any(match in a for a in cmd):
            out[cmd[cmd.index("--node-id") + 1] if "--node-id" in cmd else str(p.info["pid"])] = p.info["pid"]
    return out


def scrape(port: int) -> dict | None:
    """``{histogram: {"count", "sum", "buckets": [(le, cumulative)]}}``, or None (not metrics)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as r:
            text = r.read().decode()
    except (OSError, ValueError, http.client.HTTPException):  # not up yet, or not HTTP (its gRPC port)
        return None
    got: dict = {}
    for family in text_string_to_metric_families(text):
        if family.name not in HISTOGRAMS:
            continue
        h = got[family.name] = {"count": 0.0, "sum": 0.0, "buckets": []}
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                h["buckets"].append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith(("_count", "_sum")):
                h[sample.name.rsplit("_", 1)[1]] = sample.value
    return got or None


def metrics_port(pid: int) -> int | None:
    for c in psutil.Process(pid).net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and scrape(c.laddr.port) is not None:
            return c.laddr.port
    return None


def between(a: dict, b: dict) -> dict:
    """The histogram of what was observed from scrape ``a`` to scrape ``b``."""
    n = b["count"] - a["count"]
    out = {"count": int(n), "mean_ms": round((b["sum"] - a["sum"]) / n * 1000, 2) if n else None}
    before = dict(a["buckets"])
    cum = sorted((le, c - before.get(le, 0.0)) for le, c in b["buckets"])
    for q in QUANTILES:
        bound = next((le for le, c in cum if n and c >= q * n), None)
        out[f"p{str(q)[2:]:0<2}_ms_at_most"] = None if bound is None else bound * 1000
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--match", required=True, help="a string in the node processes' command lines (their data dir)")
    ap.add_argument("--after-s", type=float, default=15.0, help="first scrape this long from now")
    ap.add_argument("--window-s", type=float, default=30.0, help="second scrape this long after the first")
    args = ap.parse_args(argv)
    deadline = time.monotonic() + FIND_TIMEOUT_S
    ports: dict[str, int] = {}
    while time.monotonic() < deadline:
        procs = node_processes(args.match)
        ports = {name: port for name, pid in procs.items() if (port := metrics_port(pid)) is not None}
        if procs and len(ports) == len(procs):
            break
        time.sleep(1.0)
    if not ports:
        print(f"scrape_hist: no node process matching {args.match!r} exports metrics "
              "(start the nodes with HOURGLASS_METRICS_PORT=0)", file=sys.stderr)
        return 2
    time.sleep(args.after_s)
    first = {name: scrape(port) for name, port in ports.items()}
    time.sleep(args.window_s)
    second = {name: scrape(port) for name, port in ports.items()}
    rows = []
    for name in sorted(ports):
        a, b = first[name], second[name]
        if a is None or b is None:
            print(f"scrape_hist: {name} stopped answering", file=sys.stderr)
            continue
        rows.append({"node": name, "window_s": args.window_s, **{h: between(a[h], b[h]) for h in HISTOGRAMS if h in b}})
    for r in rows:
        for h in HISTOGRAMS:
            if h in r:
                v = r[h]
                qs = " ".join(f"{k.split('_')[0]}<={v[k]:g}" for k in v if k.startswith("p") and v[k] is not None)
                print(f"{r['node']:14} {h:40} n={v['count']:6d} mean={v['mean_ms']} ms  {qs} ms")
    for r in rows:
        print(json.dumps(r))
    return 0 if rows else 2


if __name__ == "__main__":
    sys.exit(main())
