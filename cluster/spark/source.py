"""The ``hourglass`` Spark data source (PySpark Python Data Source API, Spark >= 4.1).

Reads Hourglass log segments straight from node data folders, read-only::

    from cluster.spark.source import register
    register(spark)
    df = (spark.read.format("hourglass")
          .option("log", "message")            # message | schedule | dispatch | realtime
          .load("/data/delay-1,/data/delay-2"))

Options (all strings, case-insensitive names): ``path``, ``log`` (message | schedule |
dispatch | realtime), ``payload`` (true | false: fill the ``payload`` column),
``recordBytesMax``, ``pushdown`` (true | false) - defaults and checks in
``cluster.spark.options``. Any other option, a value that is not ``true``/``false``, an
unknown log or a path that does not exist fails at ``load()`` naming the valid ones
(``.option("logs", ...)`` never silently reads the message log).

Schema: ``MESSAGE_SCHEMA`` for ``message``/``schedule``/``realtime``, ``DISPATCH_SCHEMA``
for ``dispatch`` (column meanings in docs/spark.md): one row per message, although a
frame holds a whole batch. Every row names its ``node``, ``segment`` file and the global
byte ``offset`` of its batch's frame; torn and corrupt bytes come out as rows whose
``error`` is set (see ``cluster.spark.scan``), so a job never fails on bad bytes and
``df.where("error is not null")`` lists them.

Reading: ``read`` yields ``pyarrow.RecordBatch`` es built from whole codec batches with
numpy (``cluster.spark.rows``); Spark takes them as they are, no Python object per row.

Partitions: one per segment file (segments are at most 64 MiB by default, 256 MiB for
schedule data), so parallelism follows the data. A log without any segment (a delay
node's folder read as ``realtime``, a node filter matching nothing, a folder without
nodes) is an empty DataFrame: pyspark plans one empty ``InputPartition`` and ``read``
yields nothing for it.

Columns: ``.schema("seq bigint, subject string")`` with some of the log's columns (same
names and types) makes the reader build only those - the audit reads a handful of the
twenty. Anything else in the schema is refused.

Filter pushdown: a filter on ``node`` (=, IN) drops other nodes' segments and ``kind =
'cancel'`` / ``'message'`` drops other rows in the reader (both exact: Spark does not
filter again); on the schedule log a range filter on ``effective_ms`` or
``bucket_start_ms`` drops whole hour buckets whose range cannot match (handed back to
Spark, which filters the rows). ``explain()`` of a Python data source shows no pushed
filters, so the reader says it itself: with ``HOURGLASS_SPARK_LOG_PRUNING=1`` each scan
plans with one line on stderr, ``hourglass scan log=message pushed=[node = 'delay-2']
segments_read=3 segments_pruned=3 bytes_read=24576`` (``HourglassReader.plan`` returns
the same as a ``Pruning``).

Spark (4.1-4.3) keeps the pushed-down reader with the DataFrame: a later query of the
*same* DataFrame replaces the pushed filters with its own when it has any, but a query
without any filter reuses the pruned segment list. Load the DataFrame again for it
(docs/spark.md, "Partitions and pushdown").
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from pyspark.sql.datasource import (DataSource, DataSourceReader, EqualTo, GreaterThan, GreaterThanOrEqual, In,
                                    InputPartition, LessThan, LessThanOrEqual)
from pyspark.sql.types import (ArrayType, BinaryType, IntegerType, LongType, MapType, StringType, StructField,
                               StructType)

from cluster.errors import InvalidArgument
from cluster.logformat import BUCKET_MS_DEFAULT

# numpy, pyarrow (which imports pandas) and the decoder are imported by ``read`` only: Spark
# runs each planning step of a Python data source (lookup, schema, pushdown, partitions) in a
# fresh Python process that imports this module, so what it imports is paid per step
from . import layout, options

NAME = "hourglass"
LOG_PRUNING_ENV = "HOURGLASS_SPARK_LOG_PRUNING"   # 1: print each scan's pruning line on stderr

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

    def _options(self) -> options.ReadOptions:
        return options.parse(self.options)

    def schema(self) -> str:
        # Spark asks for the schema at load(): every option and path is checked here, once
        return DISPATCH_SCHEMA if self._options().log == "dispatch" else MESSAGE_SCHEMA

    def reader(self, schema) -> DataSourceReader:
        o = self._options()
        full = DISPATCH_SCHEMA if o.log == "dispatch" else MESSAGE_SCHEMA
        _check_subset(schema, full, o.log)
        cls = _PushdownReader if o.pushdown else HourglassReader
        return cls(o.paths, o.log, with_payload=o.payload, record_bytes_max=o.record_bytes_max, schema=schema)


def _check_subset(schema: StructType, full: StructType, log: str) -> None:
    """A schema given with ``.schema(...)`` must be some of the log's columns, with their types:
    the reader then builds only those (the audit reads a handful of the twenty)."""
    types = {f.name: f.dataType for f in full}
    for f in schema:
        if f.name not in types:
            raise InvalidArgument("schema", f"{f.name!r} is not a column of the {log} log; columns: "
                                            f"{', '.join(types)}")
        if f.dataType != types[f.name]:
            raise InvalidArgument("schema", f"column {f.name!r} is {types[f.name].simpleString()}, "
                                            f"not {f.dataType.simpleString()}")


@dataclass(frozen=True, slots=True)
class Pruning:
    """What a reader's pushed filters kept: the pushed filters as text and segment counts."""

    log: str
    pushed: tuple[str, ...]
    segments: int
    segments_read: int
    bytes_read: int

    def line(self) -> str:
        """One key=value log line (``HOURGLASS_SPARK_LOG_PRUNING=1`` prints it at planning)."""
        pushed = "; ".join(self.pushed) or "none"
        return (f"hourglass scan log={self.log} pushed=[{pushed}] segments_read={self.segments_read} "
                f"segments_pruned={self.segments - self.segments_read} bytes_read={self.bytes_read}")


class HourglassReader(DataSourceReader):
    def __init__(self, paths: list[str], log: str, *, with_payload: bool, record_bytes_max: int,
                 schema: StructType | None = None) -> None:
        self.paths = paths
        self.log = log
        self.schema = schema or (DISPATCH_SCHEMA if log == "dispatch" else MESSAGE_SCHEMA)
        self.with_payload = with_payload
        self.record_bytes_max = record_bytes_max
        self.nodes: set[str] | None = None          # pushed down: only these nodes
        self.effective_lo: int | None = None        # pushed down: effective_ms >= lo
        self.effective_hi: int | None = None        # pushed down: effective_ms <= hi
        self.kind: str | None = None                # pushed down: only rows of this kind
        self.pushed: list[str] = []                 # the filters used to skip segments, as text

    def plan(self) -> tuple[list[layout.Segment], Pruning]:
        """The segments to read after the pushed filters, and what was pruned."""
        segs = layout.plan(self.paths, self.log)
        keep = []
        for s in segs:
            if self.nodes is not None and s.node not in self.nodes:
                continue
            if s.bucket_start_ms is not None:
                b_lo, b_hi = s.bucket_start_ms, s.bucket_start_ms + (s.bucket_ms or BUCKET_MS_DEFAULT) - 1
                # effective_ms below the bucket start is filed at 0 in the bucket: keep the low side open
                if self.effective_hi is not None and b_lo > self.effective_hi:
                    continue
                if self.effective_lo is not None and b_hi < self.effective_lo:
                    continue
            keep.append(s)
        return keep, Pruning(self.log, tuple(self.pushed), len(segs), len(keep), layout.total_bytes(keep))

    def partitions(self):
        keep, pruning = self.plan()
        if os.environ.get(LOG_PRUNING_ENV, "") not in ("", "0"):
            print(pruning.line(), file=sys.stderr, flush=True)
        return [SegmentPartition(s) for s in keep]

    def read(self, partition: InputPartition) -> Iterator:
        """Arrow record batches of one segment file (``cluster.spark.rows``): no Python row objects."""
        # no segment at all: Spark plans one partition anyway (pyspark 4.3 an empty
        # InputPartition(None), earlier versions None) and reads it: an empty result
        seg = getattr(partition, "segment", None)
        if seg is None:
            return
        from pyspark.sql.pandas.types import to_arrow_schema

        from . import rows, scan

        frames = scan.scan_file(seg.path, seg.base, last=seg.last, record_bytes_max=self.record_bytes_max)
        where = rows.Where(seg.node, seg.log, seg.path, seg.bucket_start_ms)
        arrow_schema = to_arrow_schema(self.schema, timezone="UTC")
        if self.log == "dispatch":
            yield from rows.dispatch_batches(frames, arrow_schema, where)
        else:
            yield from rows.message_batches(frames, arrow_schema, where, with_payload=self.with_payload,
                                            kind=self.kind)


class _PushdownReader(HourglassReader):
    def pushFilters(self, filters):
        # Spark hands a DataFrame's later queries this same (already pushed) reader: start over
        self.nodes = self.effective_lo = self.effective_hi = self.kind = None
        self.pushed = []
        for f in filters:
            col = f.attribute[0] if len(getattr(f, "attribute", ())) == 1 else None
            if col == "node" and isinstance(f, (EqualTo, In)):
                vals = {f.value} if isinstance(f, EqualTo) else set(f.value)
                self.nodes = vals if self.nodes is None else self.nodes & vals
                self.pushed.append(_text(f))
                # exact: `node` is constant per segment, so skipping segments *is* the filter
                continue
            if col == "kind" and isinstance(f, EqualTo) and self.log != "dispatch":
                self.kind = f.value
                self.pushed.append(_text(f))
                continue  # exact: the reader drops the other rows
            if col in ("effective_ms", "bucket_start_ms") and self.log == "schedule" and isinstance(
                    f, (GreaterThan, GreaterThanOrEqual, LessThan, LessThanOrEqual, EqualTo)):
                v = int(f.value)
                if isinstance(f, (GreaterThan, GreaterThanOrEqual, EqualTo)):
                    self.effective_lo = v if self.effective_lo is None else max(self.effective_lo, v)
                if isinstance(f, (LessThan, LessThanOrEqual, EqualTo)):
                    self.effective_hi = v if self.effective_hi is None else min(self.effective_hi, v)
                self.pushed.append(_text(f) + " (buckets; rows filtered by Spark)")
            yield f  # used to skip whole buckets only; Spark still filters the rows


_OPS = {EqualTo: "=", In: "IN", GreaterThan: ">", GreaterThanOrEqual: ">=", LessThan: "<", LessThanOrEqual: "<="}


def _text(f) -> str:
    value = f.value if not isinstance(f, In) else tuple(f.value)
    return f"{'.'.join(f.attribute)} {_OPS.get(type(f), type(f).__name__)} {value!r}"


def load(spark, path: str | list[str], log: str = "message", **opts):
    """``spark.read.format("hourglass")...load()`` with the options checked in this process
    first, so a wrong one is a plain ``InvalidArgument`` here rather than Spark's
    ``PYTHON_DATA_SOURCE_ERROR`` with a worker's traceback::

        load(spark, "/data", log="dispatch", payload=True).where("node = 'delay-1'")
    """
    given = {"path": path if isinstance(path, str) else json.dumps([str(p) for p in path]), "log": log}
    given |= {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in opts.items()}
    options.parse(given)
    r = spark.read.format(NAME)
    for k, v in given.items():
        r = r.option(k, v)
    return r.load()


def register(spark) -> None:
    """Make ``spark.read.format("hourglass")`` available in this session."""
    spark.dataSource.register(HourglassDataSource)
