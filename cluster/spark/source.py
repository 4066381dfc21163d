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
                               (at most ``rows.RECORD_BYTES_MAX_LIMIT``, 1 GiB)
``pushdown``       ``true``    ``false`` gives a reader without filter pushdown (needed
                               when ``spark.sql.python.filterPushdown.enabled`` is off)
=================  ==========  ==========================================================

Schema: ``MESSAGE_SCHEMA`` for ``message``/``schedule``/``realtime``, ``DISPATCH_SCHEMA``
for ``dispatch`` (column meanings in docs/spark.md): one row per message, although a
frame holds a whole batch. Every row names its ``node``, ``segment`` file and the global
byte ``offset`` of its batch's frame; torn and corrupt bytes come out as rows whose
``error`` is set (see ``cluster.spark.scan``), so a job never fails on bad bytes and
``df.where("error is not null")`` lists them.

Reading: ``read`` yields ``pyarrow.RecordBatch`` es built from whole codec batches with
numpy (``cluster.spark.rows``); Spark takes them as they are, no Python object per row.

Partitions: one per segment file (segments are at most 64 MiB by default, 256 MiB for
schedule data), so parallelism follows the data.

Filter pushdown: a filter on ``node`` (=, IN) drops other nodes' segments; on the
schedule log a range filter on ``effective_ms`` or ``bucket_start_ms`` drops whole
hour buckets whose range cannot match. Filters are only used to skip segments and are
handed back to Spark, which still applies them to the rows.

Spark (4.1-4.3) keeps the pushed-down reader with the DataFrame: a later query of the
*same* DataFrame replaces the pushed filters with its own when it has any, but a query
without any filter reuses the pruned segment list. Load the DataFrame again for it
(docs/spark.md, "Partitions and pushdown").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pyspark.sql.datasource import (DataSource, DataSourceReader, EqualTo, GreaterThan, GreaterThanOrEqual, In,
                                    InputPartition, LessThan, LessThanOrEqual)
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (ArrayType, BinaryType, IntegerType, LongType, MapType, StringType, StructField,
                               StructType)

from cluster.errors import InvalidArgument

from . import layout, rows, scan

NAME = "hourglass"

MESSAGE_SCHEMA = StructType([
    StructField("node", StringType()), StructField("log", StringType()), StructField("segment", StringType()),
    StructField("offset", LongType()), StructField("frame_bytes", IntegerType()), StructField("kind", StringType()),
    StructField("seq", LongType()), StructField("attempts", IntegerType()), StructField("store_ms", LongType()),
    StructField("deliver_at_ms", LongType()), StructField("effective_ms", LongType()),
    StructField("bucket_start_ms", LongType()), StructField("id", StringType()), StructField("subject", StringType()),
    StructField("tags", ArrayType(StringType())), StructField("properties", MapType(StringType(), StringType())),
    StructField("payload_bytes", IntegerType()), StructField("payload", BinaryType()),
    StructField("cancels_seq", LongType()), StructField("error", StringType())])
DISPATCH_SCHEMA = StructType([
    StructField("node", StringType()), StructField("log", StringType()), StructField("segment", StringType()),
    StructField("offset", LongType()), StructField("frame_bytes", IntegerType()), StructField("seq", LongType()),
    StructField("effective_ms", LongType()), StructField("dispatched_ms", LongType()),
    StructField("outcome", StringType()), StructField("error", StringType())])

assert tuple(MESSAGE_SCHEMA.fieldNames()) == rows.MESSAGE_COLUMNS
assert tuple(DISPATCH_SCHEMA.fieldNames()) == rows.DISPATCH_COLUMNS


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
        record_bytes_max = int(self.options.get("recordBytesMax", scan.RECORD_BYTES_MAX_DEFAULT))
        if not 0 < record_bytes_max <= rows.RECORD_BYTES_MAX_LIMIT:
            raise InvalidArgument("recordBytesMax", f"{record_bytes_max} is not in 1..{rows.RECORD_BYTES_MAX_LIMIT}")
        cls = _PushdownReader if self.options.get("pushdown", "true").lower() != "false" else HourglassReader
        return cls(paths, self._log(), with_payload=self.options.get("payload", "false").lower() == "true",
                   record_bytes_max=record_bytes_max)


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
        """Arrow record batches of one segment file (``cluster.spark.rows``): no Python row objects."""
        if partition is None:  # Spark reads one `None` partition when partitions() kept none
            return
        seg = partition.segment
        frames = scan.scan_file(seg.path, seg.base, last=seg.last, record_bytes_max=self.record_bytes_max)
        where = rows.Where(seg.node, seg.log, seg.path, seg.bucket_start_ms)
        if self.log == "dispatch":
            yield from rows.dispatch_batches(frames, to_arrow_schema(DISPATCH_SCHEMA, timezone="UTC"), where)
        else:
            yield from rows.message_batches(frames, to_arrow_schema(MESSAGE_SCHEMA, timezone="UTC"), where,
                                            with_payload=self.with_payload)


class _PushdownReader(HourglassReader):
    def pushFilters(self, filters):
        # Spark hands a DataFrame's later queries this same (already pushed) reader: start over
        self.nodes = self.effective_lo = self.effective_hi = None
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
