"""Bounds and defaults of the on-disk format that the node's logs and the tools reading them
share (docs/format.md, "Segmented log", "Delay node data folder"). No imports: a Spark process
that only plans a scan (cluster.spark.source) loads nothing else, neither numpy nor the node's
settings, which take their default from here.

``BUCKET_MS_DEFAULT`` is the one place of ``StoreSettings.bucket_ms``'s default; a reader
takes it for a schedule folder without ``meta.json`` (cluster/spark/layout.py).
"""

RECORD_BYTES_MAX_DEFAULT = 8 * 1024 * 1024  # the largest record any reader of a log accepts unless told more
BUCKET_MS_DEFAULT = 3_600_000  # a schedule bucket's length (fixed at creation, written in schedule/meta.json)
