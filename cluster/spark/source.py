"""The ``hourglass`` Spark data source (PySpark Python Data Source API, Spark >= 4.1).

Reads Hourglass log segments straight from node data folders, read-only::

    from cluster.spark.source import register
    register(spark)
    df = (spark.read.format("hourglass")
          .option("log", "message")            # message | schedule | dispatch | realtime
          .load("/data/delay-1,/data/delay-2"))

Options (all strings, case-insensitive names):

=================  ==========  ==========================================================
option             default     meaning
=================  ==========  ==========================================================
``path``           (required)  node folders or a folder of node folders; comma separated
                               or a JSON list (see ``cluster.spark.layout``)
``log``            ``message`` which log to read (table in ``cluster.spark.layout``)
``payload``        ``false``   ``true`` fills the ``payload`` column (otherwise null; the
                               length is always in ``payload_bytes``)
``recordBytesMax`` 8 MiB       frames announcing a longer body are treated as corrupt
``pushdown``       ``true``    ``false`` gives a reader without filter pushdown (needed
                               when ``spark.sql.python.filterPushdown.enabled`` is off)
=================  ==========  ==========================================================

Schema: ``MESSAGE_SCHEMA`` for ``message``/``schedule``/``realtime``, ``DISPATCH_SCHEMA``
for ``dispatch`` (column meanings in docs/spark.md). Every row names its ``node``,
``segment`` file and global byte ``offset``; torn and corrupt bytes come out as rows
whose ``error`` is set (see ``cluster.spark.scan``), so a job never fails on bad bytes
and ``df.where("error is not null")`` lists them.

Partitions: one per segment file (segments are at most 64 MiB by default, 256 MiB for
schedule data), so parallelism follows the data.

Filter pushdown: a filter on ``node`` (=, IN) drops other nodes' segments; on the
schedule log a range filter on ``effective_ms`` or ``bucket_start_ms`` drops whole
hour buckets whose range cannot match. Filters are only used to skip segments and are
handed back to Spark, which still applies them to the rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pyspark.sql.datasource import (DataSource, DataSourceReader, EqualTo, GreaterThan, GreaterThanOrEqual, In,
                                    InputPartition, LessThan, LessThanOrEqual)

from cluster.errors import InvalidArgument

from . import layout, scan

NAME = "hourglass"
BATCH_ROWS = 32_768

MESSAGE_SCHEMA = (
    "node string, log string, segment string, offset bigint, frame_bytes int, kind string, seq bigint, "
    "attempts int, store_ms bigint, deliver_at_ms bigint, effective_ms bigint, bucket_start_ms bigint, "
    "id string, subject string, tags array<string>, properties map<string,string>, payload_bytes int, "
    "payload binary, cancels_seq bigint, error string")
DISPATCH_SCHEMA = (
    "node string, log string, segment string, offset bigint, frame_bytes int, seq bigint, effective_ms bigint, "
    "dispatched_ms bigint, outcome string, error string")


def _arrow_types():
    import pyarrow as pa

    s, i64, i32 = pa.string(), pa.int64(), pa.int32()
    message = [s, s, s, i64, i32, s, i64, i32, i64, i64, i64, i64, s, s, pa.list_(s), pa.map_(s, s), i32,
               pa.binary(), i64, s]
    dispatch = [s, s, s, i64, i32, i64, i64, i64, s, s]
    return message, dispatch


@dataclass
class SegmentPartition(InputPartition):
    segment: layout.Segment

    def __init__(self, segment: layout.Segment) -> None:  # InputPartition's own __init__ takes `value`
        super().__init__(segment.path)
        self.segment = segment


class HourglassDataSource(DataSource):
    """``spark.read.format("hourglass")``; see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def _log(self) -> str:
        log = self.options.get("log", "message").lower()
        if log not in layout.LOGS:
            raise InvalidArgument("log", f"{log!r} is not one of {', '.join(layout.LOGS)}")
        return log

    def schema(self) -> str:
        return DISPATCH_SCHEMA if self._log() == "dispatch" else MESSAGE_SCHEMA

    def reader(self, schema) -> DataSourceReader:
        paths = layout.split_paths(self.options.get("path") or self.options.get("paths"))
        if not paths:
            raise InvalidArgument("path", "give node data folders: .load('/data/delay-1,/data/realtime-1')")
        cls = _PushdownReader if self.options.get("pushdown", "true").lower() != "false" else HourglassReader
        return cls(paths, self._log(), with_payload=self.options.get("payload", "false").lower() == "true",
                   record_bytes_max=int(self.options.get("recordBytesMax", scan.RECORD_BYTES_MAX_DEFAULT)))


class HourglassReader(DataSourceReader):
    def __init__(self, paths: list[str], log: str, *, with_payload: bool, record_bytes_max: int) -> None:
        self.paths = paths
        self.log = log
        self.with_payload = with_payload
        self.record_bytes_max = record_bytes_max
        self.nodes: set[str] | None = None          # pushed down: only these nodes
        self.effective_lo: int | None = None        # pushed down: effective_ms >= lo
        self.effective_hi: int | None = None        # pushed down: effective_ms <= hi

    def partitions(self):
        segs = layout.plan(self.paths, self.log)
        keep = []
        for s in segs:
            if self.nodes is not None and s.node not in self.nodes:
                continue
            if s.bucket_start_ms is not None:
                b_lo, b_hi = s.bucket_start_ms, s.bucket_start_ms + (s.bucket_ms or layout.BUCKET_MS_DEFAULT) - 1
                # effective_ms below the bucket start is filed at 0 in the bucket: keep the low side open
                if self.effective_hi is not None and b_lo > self.effective_hi:
                    continue
                if self.effective_lo is not None and b_hi < self.effective_lo:
                    continue
            keep.append(SegmentPartition(s))
        return keep

    def read(self, partition: SegmentPartition) -> Iterator:
        import pyarrow as pa

        if partition is None:  # Spark reads one `None` partition when partitions() kept none
            return
        seg = partition.segment
        message_types, dispatch_types = _arrow_types()
        if self.log == "dispatch":
            names, types = scan.DISPATCH_COLUMNS, dispatch_types

            def row(fr):
                return scan.dispatch_row(seg.node, seg.log, seg.path, fr)
        else:
            names, types = scan.MESSAGE_COLUMNS, message_types
            is_schedule = self.log == "schedule"

            def row(fr):
                return scan.message_row(seg.node, seg.log, seg.path, fr, schedule=is_schedule,
                                        bucket_start_ms=seg.bucket_start_ms, with_payload=self.with_payload)

        def batch(rows):
            cols = list(zip(*rows))
            return pa.RecordBatch.from_arrays([pa.array(c, type=t) for c, t in zip(cols, types)], names=list(names))

        rows = []
        for fr in scan.scan_file(seg.path, seg.base, last=seg.last, record_bytes_max=self.record_bytes_max):
            rows.append(row(fr))
            if len(rows) >= BATCH_ROWS:
                yield batch(rows)
                rows = []
        if rows:
            yield batch(rows)


class _PushdownReader(HourglassReader):
    def pushFilters(self, filters):
        for f in filters:
            col = f.attribute[0] if len(getattr(f, "attribute", ())) == 1 else None
            if col == "node" and isinstance(f, (EqualTo, In)):
                vals = {f.value} if isinstance(f, EqualTo) else set(f.value)
                self.nodes = vals if self.nodes is None else self.nodes & vals
            elif col in ("effective_ms", "bucket_start_ms") and self.log == "schedule" and isinstance(
                    f, (GreaterThan, GreaterThanOrEqual, LessThan, LessThanOrEqual, EqualTo)):
                v = int(f.value)
                if isinstance(f, (GreaterThan, GreaterThanOrEqual, EqualTo)):
                    self.effective_lo = v if self.effective_lo is None else max(self.effective_lo, v)
                if isinstance(f, (LessThan, LessThanOrEqual, EqualTo)):
                    self.effective_hi = v if self.effective_hi is None else min(self.effective_hi, v)
            yield f  # used to skip segments only; Spark still filters the rows


def register(spark) -> None:
    """Make ``spark.read.format("hourglass")`` available in this session."""
    spark.dataSource.register(HourglassDataSource)
