"""Bounds of the on-disk log format that the node's logs and the tools reading them share
(docs/format.md, "Segmented log"). No imports: a Spark process that only plans a scan
(cluster.spark.source) loads nothing else."""

RECORD_BYTES_MAX_DEFAULT = 8 * 1024 * 1024  # the largest record any reader of a log accepts unless told more
