"""The bulk-schedule job: a dataset of rows becomes delayed messages, sent from the executors.

Input: CSV (with a header), JSON lines or Parquet with columns

=============  ==================================================================================
column         accepted values
=============  ==================================================================================
``id``         required; the message id (printable ASCII, no spaces, <= 128 bytes). It makes a
               rerun idempotent: the delay node answers "duplicate" for an id it already holds
               with the same content, and ``AlreadyExists`` (a reject) for different content.
``subject``    required
``deliver_at`` required; epoch milliseconds (a whole number, not negative: the codec's rule),
               an ISO-8601 string (no zone means UTC), or a timestamp/date column (from 1970
               on). A time in the past means "now".
``payload``    optional; bytes (Parquet binary) or text (UTF-8, or base64 with
               ``payload_encoding="base64"``)
``tags``       optional; a list, or one string of tags separated by ``,``
=============  ==================================================================================

A dataset without the ``id``, ``subject`` or ``deliver_at`` column is refused once, before
any row is sent (``missing_columns``; the CLI reads a local file's header or schema before
Spark starts, ``check_local_columns``), not rejected row by row.

Each Spark task (``mapInArrow``) parses its rows (``plan_row``), validates the parsed ones
at once as one codec batch with the broker's own limits (``cluster.codec.Batch.validate``,
in ``plan_rows``), then sends the good ones with the producer SDK
(``cluster.client.Producer.send_many``: one call per delay node and chunk of ``batch_max``
rows, answers as arrays), waiting on a token bucket so the whole job stays under
``rate_per_s`` (each of the N tasks gets ``rate_per_s / N``). A row's delay node is chosen
from its id (``crc32(id) % len(delay_nodes)``), so a rerun sends every id to the node that
already has it and is answered "duplicate" instead of scheduling it twice.

Every row ends with one outcome in ``out/results`` (Parquet): ``scheduled``, ``duplicate``
(already scheduled by an earlier run), ``rejected`` (bad row or refused by the node; not
worth retrying) or ``failed`` (node unavailable after the SDK's retries; rerun the job).
``rejected`` and ``failed`` rows also go to ``out/rejects`` (JSON lines: the reason and the
original row), so nothing is dropped silently. ``out/summary.json`` has the counts and rate.
"""

from __future__ import annotations

import base64
import json
import math
import time
import zlib
from dataclasses import dataclass
from datetime import date, datetime, timezone
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field

from cluster.codec import DEFAULT_LIMITS, Batch, Limits, encode_extra
from cluster.errors import HourglassError, InvalidArgument

from . import outdir

FORMATS = ("csv", "json", "parquet")
CORRUPT_COLUMN = "_corrupt_record"
RESULT_SCHEMA = ("id string, subject string, deliver_at_ms bigint, status string, reason string, seq bigint, "
                 "delay_node string, source string")
OUTCOMES = ("scheduled", "duplicate", "rejected", "failed")
SOURCE_FIELD_CHARS_MAX = 1024   # per field of a reject's ``source``: the JSON stays whole, long values are cut
REQUIRED_COLUMNS = ("id", "subject", "deliver_at")
JSON_PRECHECK_BYTES_MAX = 64 << 20  # a JSON-lines file is searched this far for the required keys before Spark


class BulkSettings(BaseModel):
    input: str
    out: str
    delay_nodes: list[str] = Field(min_length=1)
    format: str | None = None                       # csv | json | parquet; default: from the file name
    rate_per_s: float = Field(default=0, ge=0)      # whole job; 0 = unlimited
    batch_max: int = Field(default=500, ge=1, le=10_000)
    partitions: int = Field(default=0, ge=0)        # 0: as read
    payload_encoding: str = "utf8"                  # utf8 | base64
    timeout_s: float = Field(default=10.0, gt=0)
    retries_max: int = Field(default=8, ge=0)
    overwrite: bool = False                         # replace an earlier output in ``out`` (``outdir``)


# ---------------------------------------------------------------------- pure parts


class BadRow(Exception):
    """A row that cannot become a message; the text is the reject reason."""


def parse_deliver_at(v) -> int:
    """Epoch ms of a row's ``deliver_at``; ``BadRow`` for anything else, and for a time before
    1970 or a fraction of a millisecond (the codec's rule: a whole, non-negative number)."""
    ms = _deliver_at(v)
    if ms < 0:
        raise BadRow(f"deliver_at {str(v)[:64]!r} is negative; epoch milliseconds must not be negative")
    return ms


def _deliver_at(v) -> int:
    if v is None or v == "":
        raise BadRow("deliver_at is missing")
    if isinstance(v, bool):
        raise BadRow(f"deliver_at {v!r} is not a time")
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise BadRow(f"deliver_at {v!r} is not a time")
        if not v.is_integer():
            raise BadRow(f"deliver_at {v!r} is not a whole number of milliseconds")
        return int(v)
    if isinstance(v, datetime):
        dt = v if v.tzinfo else v.replace(tzinfo=timezone.utc)
        return int(dt.timestamp() * 1000)
    if isinstance(v, date):
        return int(datetime(v.year, v.month, v.day, tzinfo=timezone.utc).timestamp() * 1000)
    if isinstance(v, str):
        s = v.strip()
        if s.lstrip("-").isdigit():
            return int(s)
        try:
            dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
        except ValueError:
            raise BadRow(f"deliver_at {v[:64]!r} is neither epoch milliseconds nor ISO-8601") from None
        return _deliver_at(dt)
    raise BadRow(f"deliver_at of type {type(v).__name__} is not a time")


def missing_columns(columns) -> list[str]:
    """The required columns a dataset lacks (``[]`` when it has them all)."""
    have = set(columns)
    return [c for c in REQUIRED_COLUMNS if c not in have]


def refuse_missing(columns, what: str) -> None:
    missing = missing_columns(columns)
    if missing:
        raise InvalidArgument("input", f"{what} has no {', '.join(missing)} column (required: "
                                       f"{', '.join(REQUIRED_COLUMNS)}; it has {', '.join(columns) or 'none'})")


def check_local_columns(path: str, fmt: str) -> None:
    """Refuse a local input without a required column, before Spark starts: CSV by its header
    line, Parquet by its schema, JSON lines by the keys of its objects (the first
    ``JSON_PRECHECK_BYTES_MAX`` bytes; a key seen nowhere there is left to the check after
    Spark read the schema, ``run``). A folder is judged by its first data file."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith((".", "_")))
        if not files:
            raise InvalidArgument("input", f"{path} holds no data file")
        p = files[0]
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(p).names
        except (OSError, ValueError):  # not Parquet (pyarrow's ArrowInvalid): Spark says so in its own words
            return
        refuse_missing(names, str(p))
    elif fmt == "csv":
        import csv

        with open(p, newline="", encoding="utf-8", errors="replace") as f:
            header = next(csv.reader(f), [])
        refuse_missing([h.strip() for h in header], str(p))
    else:
        seen: set[str] = set()
        done = True
        with open(p, "rb") as f:
            read = 0
            for line in f:
                read += len(line)
                if read > JSON_PRECHECK_BYTES_MAX:
                    done = False
                    break
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue  # a malformed line is that row's reject
                if isinstance(obj, dict):
                    seen.update(obj)
                if not missing_columns(seen):
                    return
        if done:
            refuse_missing(sorted(seen), str(p))


def parse_tags(v) -> tuple[str, ...]:
    if v is None or v == "":
        return ()
    if isinstance(v, str):
        return tuple(t.strip() for t in v.split(",") if t.strip())
    if isinstance(v, (list, tuple)):
        if not all(isinstance(t, str) for t in v):
            raise BadRow("tags must be strings")
        return tuple(v)
    raise BadRow(f"tags of type {type(v).__name__}")


def parse_payload(v, encoding: str) -> bytes:
    if v is None:
        return b""
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    if isinstance(v, str):
        if encoding == "base64":
            try:
                return base64.b64decode(v, validate=True)
            except ValueError:
                raise BadRow("payload is not valid base64") from None
        return v.encode("utf-8")
    raise BadRow(f"payload of type {type(v).__name__}")


@dataclass(frozen=True, slots=True)
class Planned:
    msg_id: str
    subject: str
    deliver_at_ms: int
    payload: bytes
    tags: tuple[str, ...]


def plan_row(row: dict, *, payload_encoding: str = "utf8") -> Planned:
    """Parse one input row; ``BadRow(reason)`` if it cannot become a message. The broker's
    limits are checked for a whole task at once by ``plan_rows``."""
    if row.get(CORRUPT_COLUMN):
        raise BadRow("malformed input line")
    msg_id, subject = row.get("id"), row.get("subject")
    if msg_id is None or msg_id == "":
        raise BadRow("id is missing (ids make reruns idempotent)")
    if subject is None or subject == "":
        raise BadRow("subject is missing")
    if not isinstance(msg_id, str):
        msg_id = str(msg_id)
    return Planned(msg_id, str(subject), parse_deliver_at(row.get("deliver_at")),
                   parse_payload(row.get("payload"), payload_encoding), parse_tags(row.get("tags")))


def plan_rows(rows: list[dict], *, now_ms: int, payload_encoding: str = "utf8",
              limits: Limits = DEFAULT_LIMITS) -> tuple[list[tuple[int, Planned]], dict[int, str]]:
    """Parse every row, then check the parsed ones against the broker's limits as one codec
    batch (``Batch.validate``, what the delay node applies). Returns the sendable rows as
    ``(row index, Planned)`` and ``row index -> reason`` for the others."""
    rejects: dict[int, str] = {}
    parsed: list[tuple[int, Planned]] = []
    for i, row in enumerate(rows):
        try:
            parsed.append((i, plan_row(row, payload_encoding=payload_encoding)))
        except BadRow as e:
            rejects[i] = str(e)
    if not parsed:
        return [], rejects
    ps = [p for _, p in parsed]
    try:
        batch = Batch.build([p.subject for p in ps], [p.payload for p in ps], [p.msg_id for p in ps],
                            [p.deliver_at_ms for p in ps],
                            extras=[encode_extra(p.tags) if p.tags else b"" for p in ps])
    except HourglassError:  # a tag over 255 bytes, more than 255 tags: find which, row by row
        return _plan_one_by_one(parsed, rejects, now_ms, limits)
    _, reasons = batch.validate(now_ms=now_ms, limits=limits)
    for k, reason in reasons.items():
        rejects[parsed[k][0]] = reason
    return [item for k, item in enumerate(parsed) if k not in reasons], rejects


def _plan_one_by_one(parsed: list[tuple[int, Planned]], rejects: dict[int, str], now_ms: int,
                     limits: Limits) -> tuple[list[tuple[int, Planned]], dict[int, str]]:
    ok = []
    for i, p in parsed:
        try:
            b = Batch.build(p.subject, [p.payload], [p.msg_id], [p.deliver_at_ms],
                            extras=[encode_extra(p.tags)])
        except HourglassError as e:
            rejects[i] = str(e)
            continue
        _, reasons = b.validate(now_ms=now_ms, limits=limits)
        if reasons:
            rejects[i] = reasons[0]
        else:
            ok.append((i, p))
    return ok, rejects


def node_for(msg_id: str, delay_nodes: list[str]) -> str:
    """The delay node of an id: the same on every run, so reruns meet their earlier copy."""
    return delay_nodes[zlib.crc32(msg_id.encode()) % len(delay_nodes)]


class TokenBucket:
    """``rate_per_s`` tokens a second, at most ``burst`` saved. Pure: time comes in as ``now_s``."""

    def __init__(self, rate_per_s: float, burst: float, now_s: float) -> None:
        self.rate = rate_per_s
        self.burst = max(burst, 1.0)
        self.tokens = self.burst
        self.at = now_s

    def wait_s(self, n: int, now_s: float) -> float:
        """Take ``n`` tokens; return how long to wait before sending them (0 = now)."""
        if self.rate <= 0:
            return 0.0
        self.tokens = min(self.burst, self.tokens + (now_s - self.at) * self.rate)
        self.at = now_s
        self.tokens -= n
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


def _source(row: dict) -> str:
    """The original row as a JSON object for the reject file. A long field (a payload, a
    malformed line) is cut to ``SOURCE_FIELD_CHARS_MAX`` characters with its length said, so
    the text stays valid JSON whatever the row holds."""
    def enc(v):
        if isinstance(v, (bytes, bytearray)):
            v = base64.b64encode(bytes(v)).decode()
        elif isinstance(v, (datetime, date)):
            v = v.isoformat()
        elif not isinstance(v, (str, int, float, bool)):
            text = json.dumps(v, default=str)
            v = v if len(text) <= SOURCE_FIELD_CHARS_MAX else text
        if isinstance(v, str) and len(v) > SOURCE_FIELD_CHARS_MAX:
            v = f"{v[:SOURCE_FIELD_CHARS_MAX]}...[cut: {len(v)} characters]"
        return v
    return json.dumps({k: enc(v) for k, v in row.items() if v is not None}, default=str)


# ---------------------------------------------------------------------- executor side


def send_rows(rows: list[dict], s: BulkSettings, rate_per_task: float) -> list[dict]:
    """Validate and send one task's rows; one result dict per row (see ``RESULT_SCHEMA``)."""
    import asyncio

    return asyncio.run(_send_rows(rows, s, rate_per_task))


async def _send_rows(rows: list[dict], s: BulkSettings, rate_per_task: float) -> list[dict]:
    import asyncio

    from cluster import errors as E
    from cluster.client import Producer, StaticResolver

    planned, rejects = plan_rows(rows, now_ms=int(time.time() * 1000), payload_encoding=s.payload_encoding)
    results: list[dict] = []
    for i, reason in sorted(rejects.items()):
        row = rows[i]
        results.append({"id": None if row.get("id") is None else str(row.get("id")), "subject": row.get("subject"),
                        "deliver_at_ms": None, "status": "rejected", "reason": reason, "seq": None,
                        "delay_node": None, "source": _source(row)})
    work = [(node_for(p.msg_id, s.delay_nodes), i, p) for i, p in planned]
    bucket = TokenBucket(rate_per_task, burst=min(s.batch_max, max(rate_per_task, 1.0)), now_s=time.monotonic())
    producers = {n: Producer(StaticResolver(delay=[n]), batch_max=s.batch_max, timeout_s=s.timeout_s,
                             retries_max=s.retries_max) for n in {n for n, _, _ in work}}
    try:
        for start in range(0, len(work), s.batch_max):
            chunk = work[start:start + s.batch_max]
            wait = bucket.wait_s(len(chunk), time.monotonic())
            if wait:
                await asyncio.sleep(wait)
            by_node: dict[str, list[tuple[int, Planned]]] = {}
            for n, i, p in chunk:
                by_node.setdefault(n, []).append((i, p))
            futs = [await producers[n].send_many([p.subject for _, p in items], [p.payload for _, p in items],
                                                 ids=[p.msg_id for _, p in items],
                                                 deliver_at_ms=[p.deliver_at_ms for _, p in items],
                                                 tags=[p.tags for _, p in items] if any(p.tags for _, p in items)
                                                 else None)
                    for n, items in by_node.items()]
            answers = await asyncio.gather(*futs, return_exceptions=True)
            for (n, items), res in zip(by_node.items(), answers):
                for k, (i, p) in enumerate(items):
                    r = {"id": p.msg_id, "subject": p.subject, "deliver_at_ms": p.deliver_at_ms, "seq": None,
                         "delay_node": n, "reason": None, "source": None}
                    # the SDK answers per message; an exception of the whole call fails every row of it
                    err = res if isinstance(res, BaseException) else res.errors.get(k)
                    if err is not None:
                        r.update(status="failed" if isinstance(err, E.Unavailable) else "rejected",
                                 reason=f"{type(err).__name__}: {err}", source=_source(rows[i]))
                    else:
                        r.update(status="duplicate" if res.duplicates[k] else "scheduled", seq=int(res.seqs[k]))
                    results.append(r)
    finally:
        for p in producers.values():
            await p.close()
    return results


def _map_partitions(s: BulkSettings, rate_per_task: float):
    def fn(batches):
        import pyarrow as pa

        rows: list[dict] = []
        for b in batches:
            rows.extend(b.to_pylist())
        out = send_rows(rows, s, rate_per_task)
        if out:
            yield pa.RecordBatch.from_pylist(out, schema=pa.schema([
                ("id", pa.string()), ("subject", pa.string()), ("deliver_at_ms", pa.int64()),
                ("status", pa.string()), ("reason", pa.string()), ("seq", pa.int64()),
                ("delay_node", pa.string()), ("source", pa.string())]))
    return fn


# ---------------------------------------------------------------------- driver side


def read_input(spark, path: str, fmt: str | None):
    """The input rows as a DataFrame; malformed lines are kept in ``_corrupt_record``."""
    fmt = (fmt or Path(path.rstrip("/")).suffix.lstrip(".") or "").lower()
    if fmt == "jsonl":
        fmt = "json"
    if fmt not in FORMATS:
        raise InvalidArgument("--format", f"{fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "parquet":
        return spark.read.parquet(path)
    if fmt == "json":
        return spark.read.option("mode", "PERMISSIVE").option("columnNameOfCorruptRecord", CORRUPT_COLUMN).json(path)
    header = spark.read.option("header", True).csv(path).schema
    from pyspark.sql.types import StringType, StructField, StructType

    schema = StructType([StructField(f.name, StringType()) for f in header] + [StructField(CORRUPT_COLUMN, StringType())])
    return (spark.read.option("header", True).option("mode", "PERMISSIVE").option("enforceSchema", False)
            .option("columnNameOfCorruptRecord", CORRUPT_COLUMN).schema(schema).csv(path))


def run(spark, s: BulkSettings) -> dict:
    """Send every row; write ``results``, ``rejects`` and ``summary.json`` under ``s.out``
    (refused if it exists unless ``s.overwrite``; nothing is left there when the run fails)."""
    from pyspark.sql import functions as F

    started = time.time()
    outdir.check(Path(s.out), overwrite=s.overwrite)
    df = read_input(spark, s.input, s.format)
    refuse_missing([c for c in df.columns if c != CORRUPT_COLUMN], s.input)  # once, before any row is sent
    with outdir.writing(Path(s.out), overwrite=s.overwrite) as out:
        if CORRUPT_COLUMN in df.columns:
            df = df.cache()  # Spark refuses queries on raw JSON/CSV that touch only the corrupt column
        if s.partitions:
            df = df.repartition(s.partitions)
        n_tasks = max(1, df.rdd.getNumPartitions())
        rate_per_task = s.rate_per_s / n_tasks if s.rate_per_s else 0.0
        results = df.mapInArrow(_map_partitions(s, rate_per_task), RESULT_SCHEMA)
        # one pass over the input: results land in Parquet, everything else reads them back
        results.write.parquet(str(out / "results"))
        res = spark.read.parquet(str(out / "results"))
        (res.where(F.col("status").isin("rejected", "failed"))
         .select("id", "subject", "status", "reason", "source").coalesce(1)
         .write.json(str(out / "rejects")))
        counts = {r["status"]: r["count"] for r in res.groupBy("status").count().collect()}
        seconds = time.time() - started
        total = sum(counts.values())
        summary = {"input": s.input, "rows": total, **{k: counts.get(k, 0) for k in OUTCOMES},
                   "seconds": round(seconds, 3), "rows_per_s": round(total / max(seconds, 1e-9)),
                   "rate_per_s_limit": s.rate_per_s, "tasks": n_tasks, "delay_nodes": s.delay_nodes}
        (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary
