"""The audit's per subject-hour, per hour and overall figures from one small histogram.

Pure (no Spark): the audit groups its messages once by ``(hour, subject, status, late,
early, bucket)`` with a count and the largest lateness of each group (``bucket_sql``: a
hash aggregate whose output is a few thousand rows), and everything the report shows is
computed here from those rows - the counts per status, ``late``, ``early``, percentiles
p50 / p90 / p99 / p99.9 and the maximum, for every subject-hour, every hour and overall.
Summing buckets is exact, so the hourly and overall percentiles are not percentiles of
percentiles, and no per-row percentile structure (Spark's ``percentile_approx``, four
times over with a rollup's ``Expand``) is built.

Buckets: a lateness below ``EXACT_BELOW_MS`` is its own bucket; above, it is rounded down
to ``SIGNIFICANT_DIGITS`` significant digits (12,345 ms -> 12,300 ms), so a percentile is
exact below 1 s and at most 1% low above; ``max_ms`` is always exact.

A percentile is the nearest rank: the smallest bucket whose running count reaches
``ceil(p * n)``. Example: lateness 0, 0, 5, 7, 40 ms -> p50 = 5 (rank 3), p90 = p99 = 40.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

EXACT_BELOW_MS = 1_000
SIGNIFICANT_DIGITS = 3
PERCENTILES = (("p50_ms", 0.5), ("p90_ms", 0.9), ("p99_ms", 0.99), ("p999_ms", 0.999))
STATUSES = ("delivered", "duplicated", "lost", "delivered_after_cancel", "cancelled", "pending")
DELIVERED = ("delivered", "duplicated")


def bucket_sql(col: str = "lateness_ms") -> str:
    """The bucket of ``col`` as Spark SQL (a JVM expression: no Python UDF)."""
    step = f"cast(pow(10, floor(log10({col})) - {SIGNIFICANT_DIGITS - 1}) as bigint)"
    return (f"case when {col} is null then null when {col} < {EXACT_BELOW_MS} then {col} "
            f"else ({col} div {step}) * {step} end")


def bucket(ms: int) -> int:
    """``bucket_sql`` in Python (for tests and small inputs)."""
    if ms < EXACT_BELOW_MS:
        return ms
    step = 10 ** (len(str(ms)) - SIGNIFICANT_DIGITS)
    return ms // step * step


def _empty() -> dict:
    return {k: 0 for k in (*STATUSES, "late", "early")} | {"_hist": {}, "max_ms": None}


def _add(acc: dict, r: dict) -> None:
    n = r["n"]
    acc[r["status"]] += n
    if r["late"]:
        acc["late"] += n
    if r["early"]:
        acc["early"] += n
    if r["status"] in DELIVERED and r["bucket"] is not None:
        acc["_hist"][r["bucket"]] = acc["_hist"].get(r["bucket"], 0) + n
        if r["max_ms"] is not None:
            acc["max_ms"] = r["max_ms"] if acc["max_ms"] is None else max(acc["max_ms"], r["max_ms"])


def percentiles(hist: dict[int, int]) -> dict[str, int | None]:
    """Nearest-rank percentiles of a ``bucket -> count`` histogram (see module docstring)."""
    total = sum(hist.values())
    out: dict[str, int | None] = {k: None for k, _ in PERCENTILES}
    if not total:
        return out
    items = sorted(hist.items())
    for name, p in PERCENTILES:
        rank = max(1, math.ceil(p * total - 1e-9))
        seen = 0
        for b, n in items:
            seen += n
            if seen >= rank:
                out[name] = b
                break
    return out


def _finish(acc: dict) -> dict:
    out = {k: v for k, v in acc.items() if k != "_hist"}
    # "delivered" in the tables and the report's figures counts both delivered and duplicated
    out["delivered"] = acc["delivered"] + acc["duplicated"]
    out |= percentiles(acc["_hist"])
    return out


def figures(rows: Iterable[dict]) -> tuple[list[dict], list[dict], dict]:
    """Per subject-hour rows, per hour rows (in hour order) and the overall row, from the
    histogram rows ``{hour, subject, status, late, early, bucket, n, max_ms}``."""
    cells: dict[tuple, dict] = {}
    hours: dict[object, dict] = {}
    overall = _empty()
    for r in rows:
        for acc in (cells.setdefault((r["hour"], r["subject"]), _empty()), hours.setdefault(r["hour"], _empty()),
                    overall):
            _add(acc, r)
    lateness = [{"subject": s, "hour": h} | _finish(a) for (h, s), a in cells.items()]
    hourly = [{"hour": h} | _finish(hours[h]) for h in sorted(hours, key=lambda h: (h is None, h))]
    return lateness, hourly, _finish(overall)
